"""apply_to on a transformers 5.x Qwen2.5-VL: the same logits, loss and gradients bit for bit (run where
transformers 5.x is installed: the GPU machine; CI installs 4.49, the version Wall-X pins)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("5."):
    pytest.skip(f"needs transformers 5.x, found {transformers.__version__}", allow_module_level=True)

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration  # noqa: E402

from sptr.integrations import qwen2_5_vl  # noqa: E402

IMG, VS, VE = 151655, 151652, 151653


def tiny_model():
    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        text_config={"vocab_size": 151700, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                       "fullatt_block_indexes": [1], "tokens_per_second": 2, "in_chans": 3},
        image_token_id=IMG, video_token_id=151656, vision_start_token_id=VS, vision_end_token_id=VE)
    cfg._attn_implementation = "eager"
    return Qwen2_5_VLForConditionalGeneration(cfg)


def inputs():
    grids = torch.tensor([[1, 4, 8], [1, 10, 6]])
    row = [9, VS] + [IMG] * 8 + [VE, 11, 12, VS] + [IMG] * 15 + [VE, 13]
    ids = torch.tensor([[0, 0] + row])
    types = (ids == IMG).int()
    mask = (torch.arange(ids.shape[1]) >= 2).long()[None]
    pixels = torch.randn(int((grids[:, 1] * grids[:, 2]).sum()), 3 * 2 * 14 * 14)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=types)


def run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_apply_to_keeps_a_5x_model_bit_for_bit():
    model = tiny_model().train()
    batch = inputs()
    want, want_grads = run(model, batch)
    calls = {"rope": 0, "index": 0}
    rope, index = qwen2_5_vl.rope_ops.apply_rotary, qwen2_5_vl.vision_index.get_rope_index_hf5

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call
    qwen2_5_vl.rope_ops.apply_rotary = counted("rope", rope)
    qwen2_5_vl.vision_index.get_rope_index_hf5 = counted("index", index)
    try:
        qwen2_5_vl.apply_to(model)
        got, grads = run(model, batch)
    finally:
        qwen2_5_vl.rope_ops.apply_rotary, qwen2_5_vl.vision_index.get_rope_index_hf5 = rope, index
    assert calls["rope"] == 2 and calls["index"] == 1, calls  # two layers' mRoPE, one position computation
    assert torch.equal(got, want)
    assert all(torch.equal(grads[n], g) for n, g in want_grads.items())
    qwen2_5_vl.restore(model)
    assert "get_rope_index" not in model.model.__dict__
