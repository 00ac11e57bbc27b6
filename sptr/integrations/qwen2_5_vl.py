"""Swap sptr's kernels into a transformers Qwen2.5-VL model without changing its outputs.

``apply_to(model)`` (transformers 4.49, the version Wall-X pins) replaces, on that model instance, the text
model's ``get_rope_index`` and the vision tower's ``rot_pos_emb`` / ``get_window_index``; the mRoPE applied
inside the text attention layers is a module-level function in transformers, so it is replaced process-wide
(``restore()`` undoes it). Every replacement is bit-identical to the function it replaces.
"""
from __future__ import annotations

import types

import torch

from ..ops import rope as rope_ops
from ..ops import vision_index

_SUPPORTED = "4.49"
_original_mrope = None


def _modeling():
    import transformers
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    if not transformers.__version__.startswith(_SUPPORTED):
        raise RuntimeError(f"sptr.integrations.qwen2_5_vl.apply_to supports transformers {_SUPPORTED}.x, found "
                           f"{transformers.__version__}; for transformers 5.x call "
                           "sptr.ops.vision_index.get_rope_index_hf5 with the 5.x arguments")
    for name in ("apply_multimodal_rotary_pos_emb", "Qwen2_5_VLForConditionalGeneration",
                 "Qwen2_5_VisionTransformerPretrainedModel"):
        if not hasattr(modeling_qwen2_5_vl, name):
            raise RuntimeError(f"transformers' Qwen2.5-VL module has no {name}; cannot patch")
    return modeling_qwen2_5_vl


def fused_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Same signature and values as transformers' ``apply_multimodal_rotary_pos_emb``."""
    if unsqueeze_dim == 2:  # [B, S, H, D] operands: the kernel takes [B, H, S, D] views
        q_out, k_out = rope_ops.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin, list(mrope_section))
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return rope_ops.apply_rotary(q, k, cos, sin, list(mrope_section))


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


def apply_to(model: torch.nn.Module) -> torch.nn.Module:
    """Patch a ``Qwen2_5_VLForConditionalGeneration`` (or a model holding one) in place; returns it."""
    global _original_mrope
    hf = _modeling()
    target = next((m for m in model.modules() if isinstance(m, hf.Qwen2_5_VLForConditionalGeneration)), None)
    if target is None:
        raise TypeError(f"{type(model).__name__} holds no Qwen2_5_VLForConditionalGeneration")
    target.get_rope_index = types.MethodType(_get_rope_index, target)
    for tower in (m for m in target.modules() if isinstance(m, hf.Qwen2_5_VisionTransformerPretrainedModel)):
        tower.rot_pos_emb = types.MethodType(_rot_pos_emb, tower)
        tower.get_window_index = types.MethodType(_get_window_index, tower)
    if _original_mrope is None:
        _original_mrope = hf.apply_multimodal_rotary_pos_emb
        hf.apply_multimodal_rotary_pos_emb = fused_multimodal_rotary_pos_emb
    return model


def restore(model: torch.nn.Module | None = None) -> None:
    """Undo :func:`apply_to`: the process-wide mRoPE, and the instance patches of ``model`` if given."""
    global _original_mrope
    hf = _modeling()
    if _original_mrope is not None:
        hf.apply_multimodal_rotary_pos_emb = _original_mrope
        _original_mrope = None
    if model is not None:
        for m in model.modules():
            for name in ("get_rope_index", "rot_pos_emb", "get_window_index"):
                m.__dict__.pop(name, None)
