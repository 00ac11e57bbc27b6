"""transformers 4.49's Qwen2.5-VL functions, called unbound with a minimal `self` (the oracle of spec §5-§7).

Raises ImportError unless transformers 4.49.x is importable: the tests that use it skip with that message
(importorskip with exc_type=ImportError), benchmarks report it.
"""
from types import SimpleNamespace

import torch
import transformers

if not transformers.__version__.startswith("4.49"):
    raise ImportError(f"the oracle is transformers 4.49.x, found {transformers.__version__}")

from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf  # noqa: E402

IMG, VID, VS = 151655, 151656, 151652


def rope_index(input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None, attention_mask=None,
               merge=2, tps=2):
    cfg = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge, tokens_per_second=tps),
                          image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS)
    return hf.Qwen2_5_VLForConditionalGeneration.get_rope_index(
        SimpleNamespace(config=cfg), input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask)


def vision_tower(merge=2, window_size=112, patch_size=14, head_dim=80):
    return SimpleNamespace(spatial_merge_size=merge, window_size=window_size, patch_size=patch_size,
                           spatial_merge_unit=merge * merge,
                           rotary_pos_emb=hf.Qwen2_5_VisionRotaryEmbedding(head_dim // 2))


def rot_pos_emb(grid_thw, merge=2, head_dim=80):
    return hf.Qwen2_5_VisionTransformerPretrainedModel.rot_pos_emb(vision_tower(merge, head_dim=head_dim), grid_thw)


def window_index(grid_thw, merge=2, window_size=112, patch_size=14):
    idx, cu = hf.Qwen2_5_VisionTransformerPretrainedModel.get_window_index(
        vision_tower(merge, window_size, patch_size), grid_thw)
    return idx, torch.unique_consecutive(torch.tensor(cu, dtype=torch.int32))


apply_multimodal_rotary_pos_emb = hf.apply_multimodal_rotary_pos_emb
