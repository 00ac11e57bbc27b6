"""Qwen2.5-VL index functions: 3-D LLM positions (``get_rope_index``), vision RoPE angles, window index.

Semantics of transformers 4.49 (the version Wall-X pins), bit for bit; CPU and CUDA kernels.
"""
from __future__ import annotations

import torch
from torch import Tensor

import sptr._C  # noqa: F401

from ._checks import check_tensor

_ops = torch.ops.sptr


@torch.library.register_fake("sptr::rope_index")
def _rope_index_fake(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                     spatial_merge_size, image_token_id, video_token_id, vision_start_token_id, tokens_per_second):
    b, s = input_ids.shape
    return (input_ids.new_empty(3, b, s, dtype=torch.int64), input_ids.new_empty(b, 1, dtype=torch.int64))


@torch.library.register_fake("sptr::vision_rot_pos_emb")
def _rot_pos_emb_fake(inv_freq, grid_thw, spatial_merge_size):
    n = torch.library.get_ctx().new_dynamic_size()
    return inv_freq.new_empty(n, 2 * inv_freq.shape[0])


@torch.library.register_fake("sptr::vision_window_index")
def _window_index_fake(grid_thw, spatial_merge_size, window_size, spatial_merge_unit):
    ctx = torch.library.get_ctx()
    return (grid_thw.new_empty(ctx.new_dynamic_size(), dtype=torch.int32),
            grid_thw.new_empty(ctx.new_dynamic_size(), dtype=torch.int32))


def _as_seconds(second_per_grid_ts, device):
    if second_per_grid_ts is None or isinstance(second_per_grid_ts, Tensor):
        return second_per_grid_ts
    return torch.tensor(list(second_per_grid_ts), dtype=torch.float32, device=device)


def get_rope_index(input_ids: Tensor, image_grid_thw: Tensor | None, video_grid_thw: Tensor | None,
                   second_per_grid_ts, attention_mask: Tensor | None, spatial_merge_size: int, image_token_id: int,
                   video_token_id: int, vision_start_token_id: int, tokens_per_second: float):
    """``(position_ids int64 [3, B, S], mrope_position_deltas int64 [B, 1])`` exactly as transformers 4.49's
    ``Qwen2_5_VLForConditionalGeneration.get_rope_index``: padding (any side) stripped through
    ``attention_mask`` (int or bool, 2-D), image/video blocks found from the vision-start token, grid
    counters global over the batch, video time index ``trunc(fl32(fl32(a·sec)·tps))``, masked slots 1.
    ``second_per_grid_ts``: tensor, list or None (1.0 s). No host synchronisation on CUDA.
    """
    check_tensor("input_ids", input_ids, dim=2)
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask, dim=2)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
                             f"{tuple(attention_mask.shape)}")
    for name, g in (("image_grid_thw", image_grid_thw), ("video_grid_thw", video_grid_thw)):
        if g is not None:
            check_tensor(name, g, dim=2, dtypes=(torch.int32, torch.int64))
    return _ops.rope_index(input_ids, image_grid_thw, video_grid_thw, _as_seconds(second_per_grid_ts, input_ids.device),
                           attention_mask, int(spatial_merge_size), int(image_token_id), int(video_token_id),
                           int(vision_start_token_id), float(tokens_per_second))


def rot_pos_emb(inv_freq: Tensor, grid_thw: Tensor, spatial_merge_size: int) -> Tensor:
    """Vision RoPE angles fp32 ``[Σ t·h·w, 2F]`` (h then w, merge-block-major order), bit-identical to the
    Qwen2.5-VL vision tower's ``rot_pos_emb``. ``h``, ``w`` must be divisible by ``spatial_merge_size``."""
    check_tensor("inv_freq", inv_freq, dim=1, dtypes=(torch.float32,))
    check_tensor("grid_thw", grid_thw, dim=2, dtypes=(torch.int32, torch.int64))
    return _ops.vision_rot_pos_emb(inv_freq, grid_thw, int(spatial_merge_size))


def get_window_index(grid_thw: Tensor, spatial_merge_size: int, vit_merger_window_size: int, patch_size: int = 0,
                     spatial_merge_unit: int = 1):
    """``(window_index int32 [Σ t·Hm·Wm], cu_window_seqlens int32 [W + 1])``: the vision tower's window
    permutation of merged tokens, with the cumulative lengths deduplicated (as its forward uses them).
    ``patch_size`` is accepted for the published signature and unused."""
    check_tensor("grid_thw", grid_thw, dim=2, dtypes=(torch.int32, torch.int64))
    if vit_merger_window_size <= 0:
        raise ValueError(f"vit_merger_window_size must be positive, got {vit_merger_window_size}")
    return _ops.vision_window_index(grid_thw, int(spatial_merge_size), int(vit_merger_window_size),
                                    int(spatial_merge_unit))


def get_rope_index_hf5(input_ids: Tensor, mm_token_type_ids: Tensor, image_grid_thw: Tensor | None = None,
                       video_grid_thw: Tensor | None = None, second_per_grid_ts=None,
                       attention_mask: Tensor | None = None, *, spatial_merge_size: int = 2,
                       tokens_per_second: float = 2):
    """transformers 5.x call form of :func:`get_rope_index` (``Qwen2_5_VLModel.get_rope_index``): blocks come
    from ``mm_token_type_ids`` (0 text, 1 image, 2 video) instead of vision-start tokens, masked slots are 0,
    and the delta is taken against each row's unpadded length (5.x's decode formula).

    A thin adapter over the 4.49 kernel: on well-formed sequences (each vision block preceded by a text token)
    with images, or videos of one temporal patch, it equals transformers 5.17. Videos with T > 1 keep 4.49's
    time rule (fractional seconds, temporal extent reserved), which 5.17 changed.
    """
    check_tensor("mm_token_type_ids", mm_token_type_ids, dim=2)
    if mm_token_type_ids.shape != input_ids.shape:
        raise ValueError(f"mm_token_type_ids must have the shape of input_ids {tuple(input_ids.shape)}, got "
                         f"{tuple(mm_token_type_ids.shape)}")
    image, video, start = -1, -2, -3  # ids no tokenizer produces
    types = mm_token_type_ids.long()
    ids = torch.where(types == 1, image, torch.where(types == 2, video, 0))
    run_start = (types != 0) & (types != torch.nn.functional.pad(types, (1, 0), value=0)[:, :-1])
    ids = torch.where(torch.nn.functional.pad(run_start, (0, 1), value=False)[:, 1:], start, ids)
    mask = None if attention_mask is None else (attention_mask != 0).long()
    pos, _ = get_rope_index(ids, image_grid_thw, video_grid_thw, second_per_grid_ts, mask, spatial_merge_size,
                            image, video, start, tokens_per_second)
    valid = torch.ones_like(types, dtype=torch.bool) if mask is None else mask.bool()
    pos = pos.masked_fill(~valid[None], 0)
    lengths = valid.sum(-1, keepdim=True)
    delta = pos.amax(dim=(0, 2)).reshape(-1, 1) + 1 - lengths
    return pos, delta
