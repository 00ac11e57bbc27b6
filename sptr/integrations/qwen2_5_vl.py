"""Swap sptr's kernels into a transformers Qwen2.5-VL model without changing its outputs.

``apply_to(model)`` patches that model instance only. With transformers 4.49 (the version Wall-X pins): the text
model's ``get_rope_index``, the vision tower's ``rot_pos_emb`` / ``get_window_index``, and the ``forward`` of
each text attention module, replaced by a copy of transformers' own forward that calls sptr's mRoPE. With
transformers 5.x: each text attention's ``apply_rotary_pos_emb`` (5.x composes the three mRoPE streams in its
rotary module; sptr rotates with the composed tables) and the model's ``get_rope_index`` (5.x call form; videos
keep transformers' own, whose time rule 5.x changed); the vision tower stays transformers'. Other models,
patched or not, are unaffected, and ``restore(model)`` removes the patches. Every replacement gives
transformers' results bit for bit, under autocast too.
"""
from __future__ import annotations

import types

import torch

from ..ops import rope as rope_ops
from ..ops import vision_index

_SUPPORTED = ("4.49", "5.")
_MROPE = "apply_multimodal_rotary_pos_emb"   # transformers 4.49's text attention calls it
_ROPE5 = "apply_rotary_pos_emb"              # 5.x's, with composed [B, S, D] tables
_with_fused_mrope_cache: dict = {}


def _modeling():
    import transformers
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    if not transformers.__version__.startswith(_SUPPORTED):
        raise RuntimeError(f"sptr.integrations.qwen2_5_vl.apply_to supports transformers 4.49.x and 5.x, found "
                           f"{transformers.__version__}")
    rope = _MROPE if transformers.__version__.startswith("4.") else _ROPE5
    for name in (rope, "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VisionTransformerPretrainedModel"):
        if not hasattr(modeling_qwen2_5_vl, name):
            raise RuntimeError(f"transformers' Qwen2.5-VL module has no {name}; cannot patch")
    return modeling_qwen2_5_vl


def _is_v5(hf) -> bool:
    return hasattr(hf, "Qwen2_5_VLTextModel") and not hasattr(hf, _MROPE)


def fused_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Same signature and values as transformers' ``apply_multimodal_rotary_pos_emb`` (cos/sin
    ``[3, B, S, D]``, the output dtype by type promotion)."""
    if cos.dim() != 4 or sin.dim() != 4:
        raise ValueError(f"cos/sin must be the [3, B, S, D] stream tables of the mRoPE, got {tuple(cos.shape)} / "
                         f"{tuple(sin.shape)}")
    if unsqueeze_dim == 2:  # [B, S, H, D] operands: the kernel takes [B, H, S, D] views
        q_out, k_out = rope_ops.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin, list(mrope_section))
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    if unsqueeze_dim != 1:
        raise ValueError(f"unsqueeze_dim must be 1 ([B, H, S, D] q, k) or 2 ([B, S, H, D]), got {unsqueeze_dim}")
    return rope_ops.apply_rotary(q, k, cos, sin, list(mrope_section))


def fused_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers 5.x's ``apply_rotary_pos_emb`` (composed ``[B, S, D]`` tables) on sptr's kernel, same values."""
    if unsqueeze_dim == 2:
        q_out, k_out = rope_ops.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin, None)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    if unsqueeze_dim != 1:
        raise ValueError(f"unsqueeze_dim must be 1 ([B, H, S, D] q, k) or 2 ([B, S, H, D]), got {unsqueeze_dim}")
    return rope_ops.apply_rotary(q, k, cos, sin, None)


def _innermost(fn):
    """``fn`` without its ``functools.wraps`` decorators (5.x wraps the attention's forward in ``deprecate_kwarg``)."""
    while getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _copy_function(fn, scope: dict, closure):
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return copy


def _with_fused_mrope(forward):
    """A copy of transformers' ``forward`` whose global mRoPE function (4.49's or 5.x's) is sptr's (its module's
    other globals as they were when first patched); only the modules given the copy use it. A decorator's
    wrapper is copied around the fused copy of the function it wraps."""
    copy = _with_fused_mrope_cache.get(forward)
    if copy is None:
        inner = getattr(forward, "__wrapped__", None)
        if inner is None:
            mrope = _MROPE in forward.__code__.co_names
            scope = dict(forward.__globals__)
            scope[_MROPE if mrope else _ROPE5] = fused_multimodal_rotary_pos_emb if mrope else fused_rotary_pos_emb
            copy = _copy_function(forward, scope, forward.__closure__)
        else:
            cells = forward.__closure__ or ()
            if not any(_holds(c, inner) for c in cells):
                raise RuntimeError(f"cannot patch {forward.__qualname__}: its decorator does not hold the function "
                                   "it wraps")
            fused = _with_fused_mrope(inner)
            copy = _copy_function(forward, forward.__globals__,
                                  tuple(types.CellType(fused) if _holds(c, inner) else c for c in cells))
            copy.__wrapped__ = fused
        _with_fused_mrope_cache[forward] = copy
    return copy


def _get_rope_index5(self, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                     second_per_grid_ts=None, attention_mask=None, **kwargs):
    if video_grid_thw is not None or kwargs:  # 5.x's video time rule (and any newer argument): its own
        return type(self).get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw,
                                         second_per_grid_ts, attention_mask, **kwargs)
    cfg = self.config
    return vision_index.get_rope_index_hf5(input_ids, mm_token_type_ids, image_grid_thw, None, second_per_grid_ts,
                                           attention_mask, spatial_merge_size=cfg.vision_config.spatial_merge_size,
                                           tokens_per_second=cfg.vision_config.tokens_per_second)


def _get_rope_index(self, input_ids=None, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                    attention_mask=None):
    if input_ids is None:
        return type(self).get_rope_index(self, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                                         attention_mask)
    cfg = self.config
    return vision_index.get_rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                                       cfg.vision_config.spatial_merge_size, cfg.image_token_id, cfg.video_token_id,
                                       cfg.vision_start_token_id, cfg.vision_config.tokens_per_second)


def _rot_pos_emb(self, grid_thw):
    return vision_index.rot_pos_emb(self.rotary_pos_emb.inv_freq, grid_thw, self.spatial_merge_size)


def _get_window_index(self, grid_thw):
    window = self.window_size // self.spatial_merge_size // self.patch_size
    index, cu = vision_index.get_window_index(grid_thw, self.spatial_merge_size, window, self.patch_size,
                                              self.spatial_merge_unit)
    # The tower turns the list into a tensor and deduplicates it; ours is already deduplicated.
    return index.long(), cu.tolist()


_REPLACEMENTS = {
    "get_rope_index": lambda module: _get_rope_index5 if _is_v5(_modeling()) else _get_rope_index,
    "rot_pos_emb": lambda module: _rot_pos_emb,
    "get_window_index": lambda module: _get_window_index,
    "forward": lambda module: _with_fused_mrope(type(module).forward),
}


class PatchedMethod:
    """sptr's replacement of one method of one module instance. It pickles as (name, module), so a patched model
    saved with ``torch.save`` (or deep-copied) loads patched wherever sptr is importable; a bound method would
    pickle as a lookup of its function's name on the module, which fails at load time."""

    __slots__ = ("name", "module", "_bound")

    def __init__(self, name: str, module: torch.nn.Module):
        self.name, self.module = name, module
        self._bound = types.MethodType(_REPLACEMENTS[name](module), module)

    def __call__(self, *args, **kwargs):
        return self._bound(*args, **kwargs)

    def __reduce__(self):
        return PatchedMethod, (self.name, self.module)


def apply_to(model: torch.nn.Module) -> torch.nn.Module:
    """Patch a ``Qwen2_5_VLForConditionalGeneration`` (or a model holding one) in place; returns it."""
    hf = _modeling()
    target = next((m for m in model.modules() if isinstance(m, hf.Qwen2_5_VLForConditionalGeneration)), None)
    if target is None:
        raise TypeError(f"{type(model).__name__} holds no Qwen2_5_VLForConditionalGeneration")
    v5 = _is_v5(hf)
    owner = target.model if v5 else target  # 5.x computes the positions in Qwen2_5_VLModel
    owner.get_rope_index = PatchedMethod("get_rope_index", owner)
    rope = _ROPE5 if v5 else _MROPE
    for module in target.modules():
        if not v5 and isinstance(module, hf.Qwen2_5_VisionTransformerPretrainedModel):
            module.rot_pos_emb = PatchedMethod("rot_pos_emb", module)
            module.get_window_index = PatchedMethod("get_window_index", module)
        forward = _innermost(type(module).forward)
        if getattr(forward, "__globals__", None) is vars(hf) and rope in forward.__code__.co_names:
            module.forward = PatchedMethod("forward", module)
    return model


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply_to` on ``model``; returns it."""
    for module in model.modules():
        for name in _REPLACEMENTS:
            if isinstance(module.__dict__.get(name), PatchedMethod):
                del module.__dict__[name]
    return model


def tiny_config():
    """A tiny Qwen2.5-VL config (2 text layers of width 64, a 2-block vision tower of width 32) with the released
    model's token ids and mRoPE layout: the random model of the demos and tests."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        vocab_size=151700, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, max_position_embeddings=512,
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                       "fullatt_block_indexes": [1], "tokens_per_second": 2, "in_chans": 3},
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        attn_implementation="eager")
