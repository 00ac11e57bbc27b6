"""The dual-expert Qwen2.5-VL on transformers 5.x's classes (run where 5.x is installed: the GPU machine)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("5."):
    pytest.skip(f"needs transformers 5.x, found {transformers.__version__}", allow_module_level=True)

from sptr.models import qwen2_5_vl_moe as wx  # noqa: E402
from tests.integrations.test_qwen2_5_vl_hf5 import inputs, run, tiny_model  # noqa: E402


def test_expert0_is_the_plain_5x_model_and_checkpoints_keep_wallx_keys(tmp_path):
    plain = tiny_model().train()
    batch = inputs()
    want, want_grads = run(plain, batch)
    model = wx.from_qwen2_5_vl(plain, wx.DualExpertQwenConfig(action_intermediate=24)).train()
    got, grads = run(model, batch)
    assert torch.equal(got, want)
    for name, g in want_grads.items():
        assert torch.equal(grads[name.replace(".mlp.", ".moe.experts.0.") if ".layers." in name else name], g), name
    types = torch.zeros_like(batch["input_ids"])
    types[0, -2:] = 1
    with torch.no_grad():
        assert not torch.equal(model(**batch, moe_token_types=types).logits, got)
    wx.save_pretrained(model, str(tmp_path / "ckpt"))
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    assert "model.layers.0.moe.experts.1.gate_proj.weight" in keys and any(k.startswith("visual.") for k in keys)
    fresh = wx.dual_expert_qwen2_5_vl(model.config, model.moe_config)
    assert wx.load_wallx(fresh, str(tmp_path / "ckpt")) == {}
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ValueError, match="bidirectional_actions needs transformers 4.49"):
        wx.dual_expert_qwen2_5_vl(model.config, wx.DualExpertQwenConfig(bidirectional_actions=True))
