"""apply_to(model) leaves a transformers 4.49 Qwen2.5-VL model's outputs unchanged, bit for bit."""
import pytest
import torch

hf = pytest.importorskip("tests.ops.hf_oracle", exc_type=ImportError)  # skips with the version found

from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: E402

from sptr.integrations import qwen2_5_vl  # noqa: E402


def tiny_model():
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(qwen2_5_vl.tiny_config()).eval()


def inputs():
    grids = torch.tensor([[1, 4, 8], [1, 10, 6]])
    text = [[9, hf.VS] + [hf.IMG] * 8 + [151653, 11, 12, hf.VS] + [hf.IMG] * 15 + [151653, 13]]
    ids = torch.tensor(text)
    ids = torch.cat([torch.full((1, 2), 0), ids], 1)  # left padding
    mask = (torch.arange(ids.shape[1]) >= 2).long()[None]
    pixels = torch.randn(int((grids[:, 1] * grids[:, 2]).sum()), 3 * 2 * 14 * 14)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids)


def test_apply_to_keeps_outputs_identical():
    model = tiny_model()
    batch = inputs()
    with torch.no_grad():
        want = model(**batch).logits
        grid = batch["image_grid_thw"]
        want_vis = (model.visual.rot_pos_emb(grid), model.visual.get_window_index(grid))
        want_pos = model.get_rope_index(batch["input_ids"], grid, None, None, batch["attention_mask"])
    qwen2_5_vl.apply_to(model)
    try:
        with torch.no_grad():
            got = model(**batch).logits
            got_pos = model.get_rope_index(batch["input_ids"], grid, None, None, batch["attention_mask"])
            got_vis = (model.visual.rot_pos_emb(grid), model.visual.get_window_index(grid))
    finally:
        qwen2_5_vl.restore(model)
    assert torch.equal(got_pos[0], want_pos[0]) and torch.equal(got_pos[1], want_pos[1])
    assert torch.equal(got_vis[0], want_vis[0]) and torch.equal(got_vis[1][0], want_vis[1][0])
    assert got_vis[1][1] == torch.unique_consecutive(torch.tensor(want_vis[1][1])).tolist()
    assert torch.equal(got, want)
    assert "get_rope_index" not in model.__dict__


def training_step(model, batch, dtype):
    """One autocast fine-tuning step: loss, every parameter gradient, the parameters after AdamW."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=dtype):
        loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_fine_tuning_step_is_bitwise_transformers(dtype):
    """An fp32 model under autocast: transformers' mRoPE promotes the fp16/bf16 q, k with fp32 cos/sin to fp32;
    the patched model's loss, all gradients and the updated weights equal the unpatched model's bit for bit."""
    import copy

    model = tiny_model()
    patched = qwen2_5_vl.apply_to(copy.deepcopy(model))
    batch = inputs()
    want_loss, want_grads, want_params = training_step(model, batch, dtype)
    got_loss, got_grads, got_params = training_step(patched, batch, dtype)
    assert torch.equal(got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys() and len(want_grads) == 57
    assert [n for n in want_grads if not torch.equal(got_grads[n], want_grads[n])] == []
    assert all(torch.equal(got_params[n], want_params[n]) for n in want_params)


def test_model_cast_to_bfloat16_runs_and_matches():
    """model.to(torch.bfloat16) casts the vision tower's inv_freq too; the patched tower computes in bf16."""
    import copy

    model = tiny_model().to(torch.bfloat16)
    patched = qwen2_5_vl.apply_to(copy.deepcopy(model))
    batch = inputs()
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(patched(**batch).logits, model(**batch).logits)
        grid = batch["image_grid_thw"]
        assert torch.equal(patched.visual.rot_pos_emb(grid), model.visual.rot_pos_emb(grid))


def test_patching_is_per_model_instance():
    """Patching one model leaves another (never patched) on transformers' own functions; restore(model) puts
    the patched one back."""
    hf_module = hf.hf
    model, other = tiny_model(), tiny_model()
    qwen2_5_vl.apply_to(model)
    attention = [m for m in model.modules() if "forward" in m.__dict__]
    assert len(attention) == model.config.num_hidden_layers  # the text attention modules
    assert hf_module.apply_multimodal_rotary_pos_emb is hf.apply_multimodal_rotary_pos_emb
    calls = []
    original = rope_apply = qwen2_5_vl.rope_ops.apply_rotary

    def counting(*args, **kwargs):
        calls.append(1)
        return rope_apply(*args, **kwargs)

    qwen2_5_vl.rope_ops.apply_rotary = counting
    try:
        batch = inputs()
        with torch.no_grad():
            other(**batch)
            assert calls == []
            model(**batch)
            assert len(calls) == model.config.num_hidden_layers
            qwen2_5_vl.restore(model)
            calls.clear()
            model(**batch)
            assert calls == []
    finally:
        qwen2_5_vl.rope_ops.apply_rotary = original
    assert not any(name in m.__dict__ for m in model.modules()
                   for name in ("forward", "get_rope_index", "rot_pos_emb", "get_window_index"))


def test_fused_mrope_rejects_squeezed_stream_tables():
    q = torch.randn(3, 2, 5, 16)
    streams = torch.randn(3, 5, 16)  # [3, S, D]: would be read as a composed [B = 3, S, D] table
    with pytest.raises(ValueError, match=r"\[3, B, S, D\] stream tables"):
        qwen2_5_vl.fused_multimodal_rotary_pos_emb(q, q, streams, streams, [2, 3, 3])


def test_a_patched_model_pickles_and_loads_patched(tmp_path):
    """torch.save of a patched model loads (a bound method pickled as a name lookup failed at load time), still
    patched, with the same logits."""
    model = qwen2_5_vl.apply_to(tiny_model())
    batch = inputs()
    with torch.no_grad():
        want = model(**batch).logits
    path = tmp_path / "patched.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert isinstance(loaded.__dict__["get_rope_index"], qwen2_5_vl.PatchedMethod)
    assert loaded.__dict__["get_rope_index"].module is loaded
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, want)
    qwen2_5_vl.restore(loaded)
    assert not any(isinstance(v, qwen2_5_vl.PatchedMethod) for m in loaded.modules() for v in m.__dict__.values())


def test_fused_copy_of_a_decorated_forward_keeps_the_decorator():
    """transformers 5.x wraps the attention's forward (deprecate_kwarg): the copy keeps the wrapper and rotates
    with sptr's kernel inside it; the original still calls transformers' function."""
    import functools

    calls = []

    def renaming(fn):  # a decorator like deprecate_kwarg: renames a keyword, then calls the wrapped function
        @functools.wraps(fn)
        def wrapper(self, *args, old=None, **kwargs):
            calls.append("wrapper")
            return fn(self, *args, **kwargs)
        return wrapper

    def transformers_rope(q, k, cos, sin, unsqueeze_dim=1):
        calls.append("transformers")
        return q, k

    scope = {"apply_rotary_pos_emb": transformers_rope}
    exec("def forward(self, q, k, cos, sin):\n    return apply_rotary_pos_emb(q, k, cos, sin)", scope)
    forward = renaming(scope["forward"])
    fused = qwen2_5_vl._with_fused_mrope(forward)
    assert fused is qwen2_5_vl._with_fused_mrope(forward) and fused.__wrapped__ is not forward.__wrapped__
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    got = fused(None, q, k, cos, sin, old=1)
    want = qwen2_5_vl.fused_rotary_pos_emb(q, k, cos, sin)
    assert calls == ["wrapper"] and all(torch.equal(a, b) for a, b in zip(got, want))
    forward(None, q, k, cos, sin)
    assert calls == ["wrapper", "wrapper", "transformers"]
    with pytest.raises(RuntimeError, match="does not hold the function it wraps"):
        qwen2_5_vl._with_fused_mrope(functools.wraps(forward.__wrapped__)(lambda *a: None))
