"""All vision-side indices of a Qwen2.5-VL batch of image/video grids, from the fused kernels."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.vision_index import get_window_index, rot_pos_emb
from .config import LayerConfig, check_positive


@dataclasses.dataclass(frozen=True)
class VisionIndicesConfig(LayerConfig):
    """Defaults: the Qwen2.5-VL vision tower (merge 2, window 112 px, patch 14 px, head_dim 80)."""
    spatial_merge_size: int = 2
    window_size: int = 112
    patch_size: int = 14
    head_dim: int = 80
    theta: float = 10000.0

    def __post_init__(self):
        super().__post_init__()
        check_positive(type(self).__name__, spatial_merge_size=self.spatial_merge_size, window_size=self.window_size,
                       patch_size=self.patch_size, head_dim=self.head_dim)
        if self.window_size // self.spatial_merge_size // self.patch_size < 1:
            raise ValueError("window_size must cover at least one merged patch")

    @property
    def merged_window(self) -> int:
        return self.window_size // self.spatial_merge_size // self.patch_size


class VisionIndexBatch(NamedTuple):
    rotary_pos_emb: torch.Tensor       # fp32 [N, head_dim / 2], patch order (the tower's rot_pos_emb)
    window_index: torch.Tensor         # int64 [N / merge^2], merged tokens in window order
    reverse_index: torch.Tensor        # int64, argsort(window_index)
    cu_window_seqlens: torch.Tensor    # int32 [W + 1], deduplicated (padded when num_tokens is given)
    cu_seqlens: torch.Tensor           # int32 [frames + 1], full attention per frame
    position_embeddings: tuple         # fp32 (cos, sin) [N, head_dim], in window order


class VisionIndices(nn.Module):
    """``forward(grid_thw [n, 3]) -> VisionIndexBatch`` with the values the vision tower's forward builds."""

    def __init__(self, cfg: VisionIndicesConfig):
        super().__init__()
        self.cfg = cfg
        dim = cfg.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)),
                             persistent=False)

    def forward(self, grid_thw: torch.Tensor, num_tokens: int | None = None) -> VisionIndexBatch:
        """num_tokens (Σ t·h·w) spares the index kernels a read of a GPU grid; cu_window_seqlens then comes
        padded with empty windows (see :func:`sptr.ops.vision_index.get_window_index`)."""
        m = self.cfg.spatial_merge_size
        unit = m * m
        if grid_thw.shape[0] == 0:  # a batch without images or videos: empty indices
            return self._empty(grid_thw.device)
        emb = rot_pos_emb(self.inv_freq, grid_thw, m, num_tokens)
        window_index, cu_window = get_window_index(grid_thw, m, self.cfg.merged_window, self.cfg.patch_size, unit,
                                                   num_tokens)
        window_index = window_index.long()
        reverse = torch.empty_like(window_index).scatter_(0, window_index, torch.arange(
            window_index.numel(), device=window_index.device))
        n = emb.shape[0]
        ordered = emb.reshape(n // unit, unit, -1)[window_index].reshape(n, -1)
        full = torch.cat((ordered, ordered), dim=-1)
        cu = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(0, dtype=torch.int32)
        return VisionIndexBatch(emb, window_index, reverse, cu_window, F.pad(cu, (1, 0), value=0),
                                (full.cos(), full.sin()))

    def _empty(self, device) -> VisionIndexBatch:
        emb = self.inv_freq.new_zeros(0, self.inv_freq.shape[0] * 2).to(device)
        index = torch.zeros(0, dtype=torch.long, device=device)
        offsets = torch.zeros(1, dtype=torch.int32, device=device)
        full = emb.new_zeros(0, self.cfg.head_dim)
        return VisionIndexBatch(emb, index, index.clone(), offsets, offsets.clone(), (full, full.clone()))
