"""The dual-expert Qwen2.5-VL (Wall-X style) against transformers 4.49's model and a Wall-X-style loop."""
import os
import pickle

import pytest
import torch

hf = pytest.importorskip("tests.ops.hf_oracle", exc_type=ImportError)  # skips with the version found

from safetensors.torch import save_file  # noqa: E402

from sptr.models import qwen2_5_vl_moe as moe  # noqa: E402
from tests.integrations.test_qwen2_5_vl import inputs, tiny_model  # noqa: E402

ACTION = 4  # the tiny model's <|action|> stand-in


def dual(plain, **kw):
    return moe.from_qwen2_5_vl(plain, moe.DualExpertQwenConfig(action_intermediate=24, **kw))


def step(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**batch, labels=batch["input_ids"], **kw)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                                    if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_tokens_on_expert0_is_the_plain_model_bit_for_bit(dtype):
    plain = tiny_model().to(dtype).train()
    model = dual(plain).train()
    batch = inputs()
    batch["pixel_values"] = batch["pixel_values"].to(dtype)
    want_logits, want_loss, want_grads = step(plain, batch)
    logits, loss, grads = step(model, batch)
    assert torch.equal(logits, want_logits) and torch.equal(loss, want_loss)
    for name, g in want_grads.items():
        mine = name.replace(".mlp.", ".moe.experts.0.") if ".layers." in name and ".mlp." in name else name
        assert torch.equal(grads[mine], g), name
    assert all(".moe.experts.1." in n for n in set(dict(model.named_parameters())) - set(grads))


def test_action_tokens_follow_a_python_loop_over_the_experts():
    torch.manual_seed(1)
    model = dual(tiny_model()).eval()
    batch = inputs()
    types = torch.zeros_like(batch["input_ids"])
    types[0, -1] = 1
    types[0, 2:4] = 1  # text tokens routed to the action expert
    with torch.no_grad():
        got = model(**batch, moe_token_types=types).logits
        # the reference: each layer's MLP as Wall-X's loop over the experts
        layers = model.model.layers
        saved = [layer.mlp for layer in layers]

        def loop(layer):
            def mlp(hidden):
                out = torch.zeros_like(hidden)
                for e, expert in enumerate(layer.moe.experts):
                    rows = types == e
                    out[rows] = expert(hidden[rows])
                return out
            return mlp
        for layer in layers:
            layer.mlp = loop(layer)
        want = model(**batch).logits
        for layer, m in zip(layers, saved):
            layer.mlp = m
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, model(**batch).logits.detach())  # expert 1 does change the action tokens


def test_routing_from_the_action_token_and_gradient_checkpointing():
    model = dual(tiny_model(), action_token_id=ACTION).train()
    model.gradient_checkpointing_enable()
    batch = inputs()
    batch["input_ids"][0, -1] = ACTION  # the last text token
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    expert1 = model.model.layers[0].moe.experts[1].gate_proj.weight.grad
    assert expert1 is not None and expert1.abs().sum() > 0


def test_wallx_checkpoints_load_strictly_and_return_other_keys(tmp_path):
    model = dual(tiny_model())
    head = {"action_preprocessor.proj.weight": torch.randn(3, 4)}
    moe.save_pretrained(model, str(tmp_path / "ckpt"), extra=head)
    fresh = moe.dual_expert_qwen2_5_vl(model.config, model.moe_config)
    others = moe.load_wallx(fresh, str(tmp_path / "ckpt"))
    assert list(others) == ["action_preprocessor.proj.weight"] and torch.equal(others[list(others)[0]],
                                                                              list(head.values())[0])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    config = __import__("json").load(open(tmp_path / "ckpt" / "config.json"))
    assert moe.DualExpertQwenConfig.from_wallx_config(config).action_intermediate == 24
    state = {k: v for k, v in model.state_dict().items() if "layers.1.moe.experts.1" not in k}
    (tmp_path / "partial").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "partial" / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.moe.experts.1"):
        moe.load_wallx(fresh, str(tmp_path / "partial"))
    assert moe.load_wallx(fresh, str(tmp_path / "partial"), strict=False) == {}
    bad = dict(state, **{"model.layers.0.moe.experts.1.up_proj.weight": torch.zeros(5, 5)})
    save_file({k: v.contiguous() for k, v in bad.items()}, str(tmp_path / "partial" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj.weight: file \(5, 5\)"):
        moe.load_wallx(fresh, str(tmp_path / "partial"), strict=False)


def test_tied_embeddings_save_once_and_load_strictly(tmp_path):
    config = tiny_model().config
    config.tie_word_embeddings = True  # as Qwen2.5-VL-3B, Wall-X's base
    torch.manual_seed(1)
    model = moe.dual_expert_qwen2_5_vl(config, moe.DualExpertQwenConfig(action_intermediate=24)).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    moe.save_pretrained(model, str(tmp_path / "ckpt"))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    torch.manual_seed(2)
    fresh = moe.dual_expert_qwen2_5_vl(config, model.moe_config).eval()
    assert moe.load_wallx(fresh, str(tmp_path / "ckpt")) == {}
    assert fresh.lm_head.weight is fresh.get_input_embeddings().weight
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    state = {k: v for k, v in model.state_dict().items() if k not in ("lm_head.weight", "model.embed_tokens.weight")}
    (tmp_path / "no_embed").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "no_embed" / "model.safetensors"))
    with pytest.raises(ValueError, match="embed_tokens"):  # the twin itself is still required
        moe.load_wallx(fresh, str(tmp_path / "no_embed"))


def test_pickles_and_config_errors(tmp_path):
    model = dual(tiny_model()).eval()
    batch = inputs()
    with torch.no_grad():
        want = model(**batch).logits
    loaded = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, want)
    with pytest.raises(ValueError, match="moe_token_types must be"):
        model(**batch, moe_token_types=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="mlp_moe"):
        moe.DualExpertQwenConfig.from_wallx_config({"mlp_moe": False, "experts": []})
    with pytest.raises(ValueError, match="action_intermediate"):
        moe.DualExpertQwenConfig(action_intermediate=0)
    with pytest.raises(ValueError, match="gemm"):
        moe.DualExpertQwenConfig(gemm="fast")
    assert os.path.basename(moe.__file__) == "qwen2_5_vl_moe.py"


def test_finetune_example_trains_freezes_and_resumes(tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    example = [sys.executable, os.path.join(root, "examples", "finetune_qwen_dual_expert.py"), "--device", "cpu"]
    run = subprocess.run(example + ["--steps", "6", "--output", str(tmp_path / "all")], capture_output=True,
                         text=True, cwd=root, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    first, last = (float(x) for x in run.stdout.split("loss ")[1].split(" over")[0].split(" -> "))
    assert last < first
    again = subprocess.run(example + ["--steps", "1", "--output", str(tmp_path / "all")], capture_output=True,
                           text=True, cwd=root, timeout=600)
    assert again.returncode != 0 and "previous run" in again.stderr
    resumed = subprocess.run(example + ["--steps", "1", "--resume", "--output", str(tmp_path / "all")],
                             capture_output=True, text=True, cwd=root, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(tmp_path / "all" / "trainer_state.pt", weights_only=True)["step"] == 7
    frozen = subprocess.run(example + ["--steps", "2", "--freeze-vlm", "--output", str(tmp_path / "frozen")],
                            capture_output=True, text=True, cwd=root, timeout=600)
    assert frozen.returncode == 0, frozen.stderr[-2000:]
    sys.path.insert(0, os.path.join(root, "examples"))
    try:
        import finetune_qwen_dual_expert as ex
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    start = ex.tiny_qwen().state_dict()
    saved = load_file(str(tmp_path / "frozen" / "model.safetensors"))
    assert torch.equal(saved["model.layers.0.moe.experts.0.gate_proj.weight"],
                       start["model.layers.0.mlp.gate_proj.weight"])  # the VLM is frozen
    assert torch.equal(saved["model.embed_tokens.weight"], start["model.embed_tokens.weight"])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bidirectional_attention_among_action_tokens(attn):
    plain = tiny_model()
    plain.config._attn_implementation = attn
    causal = dual(plain).eval()
    both = dual(plain, bidirectional_actions=True).eval()
    both.load_state_dict(causal.state_dict())
    batch = inputs()
    types = torch.zeros_like(batch["input_ids"])
    types[0, -3:] = 1  # the last three tokens form the action chunk
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][0, -1] = 77
    with torch.no_grad():
        a, b = (both(**x, moe_token_types=types).logits for x in (batch, changed))
        c, d = (causal(**x, moe_token_types=types).logits for x in (batch, changed))
    # tokens before the chunk: causal as before (the two left-padding rows attend to everything, action tokens
    # included, as transformers' fully masked rows do, so they are left out)
    assert torch.equal(a[0, 2:-3], c[0, 2:-3])
    assert not torch.allclose(a[0, -3], b[0, -3])   # the chunk's first token sees its last
    assert torch.equal(c[0, -3], d[0, -3])          # causally it does not
    with torch.no_grad():  # no action token: the plain causal model
        assert torch.equal(both(**batch).logits, causal(**batch).logits)


def test_config_from_yaml():
    cfg = moe.DualExpertQwenConfig.from_yaml("qwen2_5_vl_dual_expert")
    assert cfg == moe.DualExpertQwenConfig()
