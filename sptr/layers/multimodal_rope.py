"""Qwen2-VL / Qwen2.5-VL multimodal RoPE as a module, configured by a dataclass."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..ops.rope import LAYOUTS, apply_rotary
from .config import LayerConfig, check_positive


@dataclasses.dataclass(frozen=True)
class MultimodalRotaryEmbeddingConfig(LayerConfig):
    """Defaults: Qwen2.5-VL text model (head_dim 128, rope_theta 1e6, mrope_section [16, 24, 24])."""
    head_dim: int = 128
    theta: float = 1_000_000.0
    mrope_section: tuple = (16, 24, 24)
    attention_scaling: float = 1.0
    section_layout: str = "hf"

    def __post_init__(self):
        super().__post_init__()
        check_positive(type(self).__name__, head_dim=self.head_dim, theta=self.theta)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section must be 3 ints summing to head_dim / 2 = {self.head_dim // 2}, got "
                             f"{self.mrope_section}")
        if self.section_layout not in LAYOUTS:
            raise ValueError(f"section_layout must be one of {LAYOUTS}, got {self.section_layout!r}")


class MultimodalRotaryEmbedding(nn.Module):
    """``forward(x, position_ids [3, B, S]) -> (cos, sin) [3, B, S, D]`` exactly as transformers'
    ``Qwen2_5_VLRotaryEmbedding`` (fp32 angles, cast to x's dtype); ``rotate(q, k, position_ids)`` applies
    them with the fused kernel."""

    def __init__(self, cfg: MultimodalRotaryEmbeddingConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"position_ids must be [3, B, S], got {tuple(position_ids.shape)}")
        inv = self.inv_freq[None, None, :, None].float().expand(3, position_ids.shape[1], -1, 1)
        pos = position_ids[:, :, None, :].float()
        with torch.autocast(device_type=x.device.type if x.device.type in ("cuda", "cpu") else "cpu", enabled=False):
            freqs = (inv @ pos).transpose(2, 3)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.cfg.attention_scaling, emb.sin() * self.cfg.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)

    def rotate(self, q, k, position_ids):
        cos, sin = self(q, position_ids)
        return apply_rotary(q, k, cos, sin, self.cfg.mrope_section, section_layout=self.cfg.section_layout)
