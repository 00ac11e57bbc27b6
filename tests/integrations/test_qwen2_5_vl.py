"""apply_to(model) leaves a transformers 4.49 Qwen2.5-VL model's outputs unchanged, bit for bit."""
import pytest
import torch

hf = pytest.importorskip("tests.ops.hf_oracle", exc_type=ImportError)  # skips with the version found

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration  # noqa: E402

from sptr.integrations import qwen2_5_vl  # noqa: E402


def tiny_model():
    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        vocab_size=151700, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, max_position_embeddings=512,
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                       "fullatt_block_indexes": [1], "tokens_per_second": 2, "in_chans": 3},
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        attn_implementation="eager")
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


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
