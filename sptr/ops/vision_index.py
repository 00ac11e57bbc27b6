"""Qwen2.5-VL index functions: 3-D LLM positions (``get_rope_index``), vision RoPE angles, window index.

Semantics of transformers 4.49 (the version Wall-X pins), bit for bit; CPU and CUDA kernels.
"""
from __future__ import annotations

import torch
from torch import Tensor

from torch._subclasses.fake_tensor import is_fake

import sptr._C  # noqa: F401

from ._checks import (FLOATING, INDEX, ValueChecks, check_int, check_tensor, data_checks_enabled, is_finite_number,
                      is_int)

_ops = torch.ops.sptr


@torch.library.register_fake("sptr::rope_index")
def _rope_index_fake(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                     spatial_merge_size, image_token_id, video_token_id, vision_start_token_id, tokens_per_second):
    b, s = input_ids.shape
    return (input_ids.new_empty(3, b, s, dtype=torch.int64), input_ids.new_empty(b, 1, dtype=torch.int64))


@torch.library.register_fake("sptr::vision_rot_pos_emb")
def _rot_pos_emb_fake(inv_freq, grid_thw, spatial_merge_size, num_tokens=None):
    n = torch.library.get_ctx().new_dynamic_size() if num_tokens is None else num_tokens
    return inv_freq.new_empty(n, 2 * inv_freq.shape[0])


@torch.library.register_fake("sptr::vision_window_index")
def _window_index_fake(grid_thw, spatial_merge_size, window_size, spatial_merge_unit, num_tokens=None):
    if num_tokens is not None:
        entries = num_tokens // (spatial_merge_size * spatial_merge_size)
        return (grid_thw.new_empty(entries, dtype=torch.int32), grid_thw.new_empty(entries + 1, dtype=torch.int32))
    ctx = torch.library.get_ctx()
    return (grid_thw.new_empty(ctx.new_dynamic_size(), dtype=torch.int32),
            grid_thw.new_empty(ctx.new_dynamic_size(), dtype=torch.int32))


def _check_num_tokens(grid_thw: Tensor, spatial_merge_size: int, num_tokens) -> None:
    """num_tokens must be Σ t·h·w of the grid, with h, w divisible by the merge size: checked on the host for
    a host grid (in C++), with one host sync for a GPU grid unless data checks are off."""
    if num_tokens is None:
        return
    if not is_int(num_tokens) and not isinstance(num_tokens, torch.SymInt):
        raise TypeError(f"num_tokens must be an int (the vision sequence length), got {num_tokens!r}")
    if grid_thw.device.type == "cpu" or grid_thw.numel() == 0 or not data_checks_enabled():
        return
    m = int(spatial_merge_size)
    g = grid_thw.long()
    ValueChecks().require(
        f"grid_thw must hold non-negative sizes with h, w divisible by spatial_merge_size {m}, summing to "
        f"num_tokens = {num_tokens} patches (t*h*w)",
        (g >= 0).all() & (g[:, 1:] % m == 0).all() & (g.prod(1).sum() == num_tokens)).run()


def _as_seconds(second_per_grid_ts, device):
    if second_per_grid_ts is None or isinstance(second_per_grid_ts, Tensor):
        return second_per_grid_ts
    return torch.tensor(list(second_per_grid_ts), dtype=torch.float32, device=device)


def _check_rope_index_values(input_ids, image_grid_thw, video_grid_thw, attention_mask, image_token_id,
                             video_token_id, vision_start_token_id, spatial_merge_size, extra=()) -> None:
    """Where transformers 4.49 raises (IndexError, TypeError, a failed cat or assignment), raise a ValueError
    naming the argument: one host sync for all of them (and the caller's `extra` (message, condition) pairs),
    skipped under data_checks(False) and torch.compile."""
    if not data_checks_enabled():  # nor compute the conditions: they are a dozen kernel launches
        return
    checks = ValueChecks()
    for message, condition in extra:
        checks.require(message, condition)
    m, length = spatial_merge_size, input_ids.shape[1]
    for name, grid in (("image_grid_thw", image_grid_thw), ("video_grid_thw", video_grid_thw)):
        if grid is not None and grid.numel():
            checks.require(f"{name} must hold positive sizes t, h, w >= 1", (grid > 0).all())
            # h // merge == 0 leaves an empty block (transformers fails taking its max); a block of more merged
            # tokens than a row holds cannot be placed (transformers fails assigning its positions)
            checks.require(f"{name} must have h and w >= spatial_merge_size {m}", (grid[:, 1:] >= m).all())
            tokens = grid[:, 0].double() * (grid[:, 1] // m).double() * (grid[:, 2] // m).double()
            checks.require(f"{name} has a block of more t*(h/{m})*(w/{m}) tokens than input_ids' rows hold "
                           f"({length})", (tokens <= length).all())
    kept = torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask is not None:
        checks.require("attention_mask must hold only 0 and 1 (transformers keeps the tokens where it == 1; "
                       "packed-sequence ids or fractional values are not a padding mask)",
                       ((attention_mask == 0) | (attention_mask == 1)).all())
        kept = attention_mask == 1
    if (image_grid_thw is not None or video_grid_thw is not None) and input_ids.shape[1] > 0:
        # Each row without its padding, as transformers reads it: kept tokens first, in order.
        order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices
        ids = input_ids.gather(1, order)
        length = kept.sum(1, keepdim=True)
        pos = torch.arange(ids.shape[1], device=ids.device)
        starts = (ids[:, :-1] == vision_start_token_id) & (pos[None, 1:] < length)
        for name, grid, token in (("image", image_grid_thw, image_token_id), ("video", video_grid_thw,
                                                                           video_token_id)):
            rows = 0 if grid is None else grid.shape[0]
            blocks = (starts & (ids[:, 1:] == token)).sum()
            checks.require(f"input_ids holds more {name} blocks (vision start + {name} token) than "
                           f"{name}_grid_thw has rows ({rows}{', it is None' if grid is None else ''})",
                           blocks <= rows)
        last = ids.gather(1, (length - 1).clamp(min=0))
        checks.require("a row of input_ids ends with vision_start_token_id (no vision token follows it)",
                       ~((last[:, 0] == vision_start_token_id) & (length[:, 0] > 0)).any())
        checks.require("input_ids has a row that is all padding (attention_mask all 0) next to vision inputs; "
                       "transformers cannot position it", (length > 0).all())
    checks.run()


def get_rope_index(input_ids: Tensor, image_grid_thw: Tensor | None, video_grid_thw: Tensor | None,
                   second_per_grid_ts, attention_mask: Tensor | None, spatial_merge_size: int, image_token_id: int,
                   video_token_id: int, vision_start_token_id: int, tokens_per_second: float):
    """``(position_ids int64 [3, B, S], mrope_position_deltas int64 [B, 1])`` exactly as transformers 4.49's
    ``Qwen2_5_VLForConditionalGeneration.get_rope_index``: padding (any side) stripped through
    ``attention_mask`` (int or bool, 2-D), image/video blocks found from the vision-start token, grid
    counters global over the batch, video time index ``trunc(fl32(fl32(a·sec)·tps))``, masked slots 1.
    ``second_per_grid_ts``: tensor, list or None (1.0 s); the time index is computed in the seconds tensor's
    dtype as transformers does (fp16/bf16 round each product; a list or None: fp32).

    Inputs on which transformers raises raise a ValueError here: grids with a size <= 0, more image or video
    blocks than grid rows (video tokens with only ``image_grid_thw``), a row ending with the vision-start
    token, an attention mask with values other than 0 and 1, an all-padding row next to vision inputs. Those
    checks cost one host sync; under ``sptr.ops.data_checks(False)`` (or torch.compile) they are skipped and
    the call has no host synchronisation on CUDA. int32 ``input_ids`` (transformers fails to write int64
    positions into its int32 buffer) give the int64 result transformers computes for the same ids as int64.
    """
    return _rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                       spatial_merge_size, image_token_id, video_token_id, vision_start_token_id, tokens_per_second)


def _rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask, spatial_merge_size,
                image_token_id, video_token_id, vision_start_token_id, tokens_per_second, extra_checks=()):
    check_tensor("input_ids", input_ids, dim=2)
    if input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask, dim=2, device=input_ids.device)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
                             f"{tuple(attention_mask.shape)}")
    for name, g in (("image_grid_thw", image_grid_thw), ("video_grid_thw", video_grid_thw)):
        if g is not None:
            check_tensor(name, g, dim=2, dtypes=INDEX, device=input_ids.device)
    merge = check_int("spatial_merge_size", spatial_merge_size, 1)
    ids = [check_int(name, v) for name, v in (("image_token_id", image_token_id), ("video_token_id", video_token_id),
                                              ("vision_start_token_id", vision_start_token_id))]
    if not is_finite_number(tokens_per_second):
        raise TypeError(f"tokens_per_second must be a finite number, got {tokens_per_second!r}")
    _check_rope_index_values(input_ids, image_grid_thw, video_grid_thw, attention_mask, *ids, merge, extra_checks)
    return _ops.rope_index(input_ids, image_grid_thw, video_grid_thw, _as_seconds(second_per_grid_ts, input_ids.device),
                           attention_mask, merge, *ids, float(tokens_per_second))


def _vision_grid(grid_thw, spatial_merge_size, num_tokens, op: str) -> int:
    """The checks shared by the vision tower's index functions; the merge size as an int."""
    check_tensor("grid_thw", grid_thw, dim=2, dtypes=INDEX)
    merge = check_int("spatial_merge_size", spatial_merge_size, 1)
    if grid_thw.shape[0] == 0:
        raise ValueError(f"grid_thw has no rows: {op} needs at least one image or video (transformers fails on an "
                         "empty grid too)")
    if num_tokens is None and (grid_thw.is_meta or is_fake(grid_thw)):
        raise ValueError(f"{op} of a grid without values (meta or fake) needs num_tokens, the output size")
    _check_num_tokens(grid_thw, merge, num_tokens)
    return merge


def rot_pos_emb(inv_freq: Tensor, grid_thw: Tensor, spatial_merge_size: int, num_tokens: int | None = None) -> Tensor:
    """Vision RoPE angles ``[Σ t·h·w, 2F]`` in inv_freq's dtype (h then w, merge-block-major order),
    bit-identical to the Qwen2.5-VL vision tower's ``rot_pos_emb`` for every floating inv_freq (a model cast
    with ``.to(torch.bfloat16)`` computes the positions and products in bf16, and so does this).
    ``h``, ``w`` must be divisible by ``spatial_merge_size``.

    ``num_tokens`` (Σ t·h·w, the tower's sequence length ``hidden_states.shape[0]``) fixes the output size
    without reading a GPU grid: with it and ``data_checks(False)`` (or under CUDA-graph capture or
    torch.compile) the call is one kernel launch with no host sync. Without it the size is read from the grid
    (one device-to-host copy for a GPU grid)."""
    check_tensor("inv_freq", inv_freq, dim=1, dtypes=FLOATING)
    merge = _vision_grid(grid_thw, spatial_merge_size, num_tokens, "rot_pos_emb")
    return _ops.vision_rot_pos_emb(inv_freq, grid_thw, merge, num_tokens)


def get_window_index(grid_thw: Tensor, spatial_merge_size: int, vit_merger_window_size: int, patch_size: int = 0,
                     spatial_merge_unit: int = 1, num_tokens: int | None = None):
    """``(window_index int32 [Σ t·Hm·Wm], cu_window_seqlens int32 [W + 1])``: the vision tower's window
    permutation of merged tokens, with the cumulative lengths deduplicated (as its forward uses them), as
    device tensors. ``patch_size`` is accepted for the published signature and unused. transformers 4.49's
    own ``get_window_index`` returns the lengths as a Python list: ``cu_window_seqlens.tolist()`` gives it.

    ``num_tokens`` (Σ t·h·w, ``hidden_states.shape[0]``; h, w divisible by the merge size) fixes the sizes
    without reading a GPU grid (one launch, no host sync with ``data_checks(False)``, capturable in a CUDA
    graph): ``cu_window_seqlens`` then has ``num_tokens / merge² + 1`` entries, the deduplicated lengths
    followed by repeats of the total (empty windows: the same attention for varlen kernels and masks, and
    ``torch.unique_consecutive`` of it is the exact result)."""
    merge = _vision_grid(grid_thw, spatial_merge_size, num_tokens, "get_window_index")
    window = check_int("vit_merger_window_size", vit_merger_window_size, 1)
    unit = check_int("spatial_merge_unit", spatial_merge_unit, 1)
    return _ops.vision_window_index(grid_thw, merge, window, unit, num_tokens)


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
    check_tensor("mm_token_type_ids", mm_token_type_ids, dim=2, device=input_ids.device)
    if mm_token_type_ids.is_floating_point() or mm_token_type_ids.is_complex() or mm_token_type_ids.dtype == torch.bool:
        raise TypeError(f"mm_token_type_ids must be an integer tensor (0 text, 1 image, 2 video), got "
                        f"{mm_token_type_ids.dtype}")
    if mm_token_type_ids.shape != input_ids.shape:
        raise ValueError(f"mm_token_type_ids must have the shape of input_ids {tuple(input_ids.shape)}, got "
                         f"{tuple(mm_token_type_ids.shape)}")
    image, video, start = -1, -2, -3  # ids no tokenizer produces
    types = mm_token_type_ids.long()
    ids = torch.where(types == 1, image, torch.where(types == 2, video, 0))
    run_start = (types != 0) & (types != torch.nn.functional.pad(types, (1, 0), value=0)[:, :-1])
    ids = torch.where(torch.nn.functional.pad(run_start, (0, 1), value=False)[:, 1:], start, ids)
    mask = None if attention_mask is None else (attention_mask != 0).long()
    extra = []
    if data_checks_enabled():  # the condition is computed only where it is checked
        known = ((types >= 0) & (types <= 2)).all()
        extra.append(("mm_token_type_ids must hold 0 (text), 1 (image) or 2 (video)", known))
    pos, _ = _rope_index(ids, image_grid_thw, video_grid_thw, second_per_grid_ts, mask, spatial_merge_size, image,
                         video, start, tokens_per_second, extra)
    valid = torch.ones_like(types, dtype=torch.bool) if mask is None else mask.bool()
    pos = pos.masked_fill(~valid[None], 0)
    lengths = valid.sum(-1, keepdim=True)
    delta = pos.amax(dim=(0, 2)).reshape(-1, 1) + 1 - lengths
    return pos, delta
