"""Sine / Fourier coordinate embeddings (SparseTransformer's ``PositionEmbeddingCoordsSine``, §6.3)."""
import math

import torch
from torch import nn


def shift_scale_points(pred_xyz, src_range, dst_range=None):
    """Map ``pred_xyz (B, P, 3)`` from ``src_range = [min (B,3), max (B,3)]`` to ``dst_range`` ([0, 1])."""
    if dst_range is None:
        dst_range = [torch.zeros_like(src_range[0]), torch.ones_like(src_range[1])]
    src_diff = src_range[1][:, None, :] - src_range[0][:, None, :]
    dst_diff = dst_range[1][:, None, :] - dst_range[0][:, None, :]
    return ((pred_xyz - src_range[0][:, None, :]) * dst_diff) / src_diff + dst_range[0][:, None, :]


class PositionEmbeddingCoordsSine(nn.Module):
    def __init__(self, temperature=10000, normalize=False, scale=None, pos_type="fourier", d_pos=None, d_in=3,
                 gauss_scale=1.0):
        super().__init__()
        self.temperature = temperature
        self.normalize = normalize
        if scale is not None and not normalize:
            raise ValueError("normalize should be True if scale is passed")
        self.scale = 2 * math.pi if scale is None else scale
        if pos_type not in ("sine", "fourier"):
            raise ValueError(f"pos_type must be 'sine' or 'fourier', got {pos_type!r}")
        self.pos_type = pos_type
        self.d_pos = d_pos
        if pos_type == "fourier":
            if d_pos is None or d_pos % 2 != 0:
                raise ValueError(f"fourier embedding needs an even d_pos, got {d_pos}")
            self.register_buffer("gauss_B", torch.empty((d_in, d_pos // 2)).normal_() * gauss_scale)

    def get_sine_embeddings(self, xyz, num_channels, input_range):
        num_channels = self.d_pos
        orig_xyz = xyz
        xyz = orig_xyz.clone()
        if self.normalize:
            xyz = shift_scale_points(xyz, src_range=input_range)
        ndim = num_channels // xyz.shape[2]
        if ndim % 2 != 0:
            ndim -= 1
        rems = num_channels - (ndim * xyz.shape[2])
        final_embeds = []
        for d in range(xyz.shape[2]):
            cdim = ndim
            if rems > 0:
                cdim += 2
                rems -= 2
            dim_t = torch.arange(cdim, dtype=torch.float32, device=xyz.device)
            dim_t = self.temperature ** (2 * (dim_t // 2) / cdim)
            raw_pos = xyz[:, :, d]
            if self.scale:
                raw_pos = raw_pos * self.scale
            pos = raw_pos[:, :, None] / dim_t
            pos = torch.stack((pos[:, :, 0::2].sin(), pos[:, :, 1::2].cos()), dim=3).flatten(2)
            final_embeds.append(pos)
        return torch.cat(final_embeds, dim=2).permute(0, 2, 1)

    def get_fourier_embeddings(self, xyz, num_channels=None, input_range=None):
        if num_channels is None:
            num_channels = self.gauss_B.shape[1] * 2
        bsize, npoints = xyz.shape[0], xyz.shape[1]
        if num_channels <= 0 or num_channels % 2 != 0:
            raise ValueError(f"num_channels must be a positive even number, got {num_channels}")
        d_in, max_local_pos_dim = self.gauss_B.shape
        d_out = num_channels // 2
        if d_out > max_local_pos_dim or d_in != xyz.shape[-1]:
            raise ValueError(f"num_channels {num_channels} / coordinate dim {xyz.shape[-1]} do not fit gauss_B "
                             f"{tuple(self.gauss_B.shape)}")
        xyz = xyz.to(self.gauss_B.dtype)  # computed in the buffer's dtype (a .double() module: float64)
        if self.normalize:
            xyz = shift_scale_points(xyz, src_range=[r.to(xyz.dtype) for r in input_range])
        xyz = xyz * (2 * math.pi)
        xyz_proj = torch.mm(xyz.view(-1, d_in), self.gauss_B[:, :d_out]).view(bsize, npoints, d_out)
        return torch.cat([xyz_proj.sin(), xyz_proj.cos()], dim=2).permute(0, 2, 1)

    def forward(self, xyz, num_channels=None, input_range=None):
        if not isinstance(xyz, torch.Tensor) or xyz.dim() != 3:
            raise ValueError(f"xyz must be a (B, P, 3) tensor, got {getattr(xyz, 'shape', type(xyz))}")
        with torch.no_grad():
            if self.pos_type == "sine":
                return self.get_sine_embeddings(xyz, num_channels, input_range)
            return self.get_fourier_embeddings(xyz, num_channels, input_range)
