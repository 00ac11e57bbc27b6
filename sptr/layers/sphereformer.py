"""SphereFormer's attention block (spec §7): cubic-window heads + spherical-window heads, pre-norm MLP block.

Parameter names match the released SphereFormer checkpoints (``transformer_block.{norm1, attn, norm2, mlp}``
with ``attn.relative_pos_{query,key,value}_table[_sphere]``, ``attn.qkv``, ``attn.proj``).
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import numpy as np
import torch
from torch import nn

from ..ops.sparse_attention import sparse_self_attention
from ..ops._checks import FLOATING, INTEGER, cast, check_shape, check_tensor
from ..ops.windowing import cart2sphere, check_points, get_indices_params, to_3d_numpy
from .config import LayerConfig, check_fraction, check_positive, check_sizes
from .layer_norm import LayerNorm
from .sparse_tensor import SparseTrTensor, check_features
from .var_length_attention import attend_in_windows, cached_windows, check_attention_path, quant_grid_length


def exponential_split(xyz, index_0, index_1, relative_position_index, a=0.05 * 0.25):
    """Exponentially growing radial bins of the pair radius difference (overwrites column 2; qgl 24)."""
    bins = relative_position_index
    delta = xyz[index_0.long(), 2] - xyz[index_1.long(), 2]
    dist = delta.abs()
    b = 2 * torch.floor(torch.log((dist + 2 * a) / a) / math.log(2)) - 2
    b = b + ((3 * torch.pow(2, torch.floor(b / 2)) - 2) * a <= dist).float()
    b = torch.where(delta >= 0, b, -b - 1)
    bins[:, 2] = b + 24
    return bins


ATTENTION_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                    "float64": torch.float64}


def attention_compute_dtype(name: str) -> torch.dtype:
    """SphereFormer's AMP rule: q, k, v and the tables are cast to float32 before attention, so under autocast
    the attention still runs in fp32; "float16"/"bfloat16" opt into the fused low-precision path; "float64"
    (CPU, or the fp64 tile kernels on CUDA) is for reference runs of a double model."""
    if name not in ATTENTION_DTYPES:
        raise ValueError(f"attention_dtype must be one of {sorted(ATTENTION_DTYPES)}, got {name!r}")
    return ATTENTION_DTYPES[name]


class DropPath(nn.Module):
    """Stochastic depth per sample (here: per point, as SphereFormer applies it to (N, C) features)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep = 1 - self.p
        mask = x.new_empty(x.shape[0], *([1] * (x.dim() - 1))).bernoulli_(keep)
        if keep > 0:  # timm's order, x * (mask / keep): the original's values to the last bit (and p = 1 gives 0)
            mask.div_(keep)
        return x * mask


class SparseMultiheadSASphereConcat(nn.Module):
    """Heads [0, h/2): cubic windows on xyz; heads [h/2, h): spherical windows on cart2sphere(xyz)."""

    def __init__(self, embed_dim, num_heads, indice_key, window_size, window_size_sphere, shift_win=False,
                 pe_type="none", dropout=0.0, qk_scale=None, qkv_bias=True, algo="native", **kwargs):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.indice_key, self.shift_win, self.pe_type = indice_key, shift_win, pe_type
        self.scale = qk_scale or self.head_dim ** -0.5
        self.window_size = to_3d_numpy(window_size)
        self.window_size_sphere = to_3d_numpy(window_size_sphere)
        self.quant_size = to_3d_numpy(kwargs["quant_size"])
        self.quant_size_sphere = to_3d_numpy(kwargs["quant_size_sphere"])
        self.rel_query, self.rel_key, self.rel_value = (kwargs.get(f, False) for f in ("rel_query", "rel_key", "rel_value"))
        self.a = kwargs.get("a", 0.05 * 0.25)
        self.attention = check_attention_path(kwargs.get("attention", "fused"))
        self.attention_dtype = attention_compute_dtype(kwargs.get("attention_dtype", "float32"))
        self.quant_grid_length = quant_grid_length(self.window_size, self.quant_size)
        self.quant_grid_length_sphere = quant_grid_length(self.window_size_sphere, self.quant_size_sphere)
        h1 = num_heads // 2
        h2 = num_heads - h1
        cubic = (2 * self.quant_grid_length - 1, 3, h1, self.head_dim)
        sphere = (2 * self.quant_grid_length_sphere, 3, h2, self.head_dim)  # one more row: the clamped radial bin
        for suffix, shape in (("", cubic), ("_sphere", sphere)):
            for kind in ("query", "key", "value"):
                table = nn.Parameter(torch.zeros(shape))
                nn.init.trunc_normal_(table, std=0.02)
                setattr(self, f"relative_pos_{kind}_table{suffix}", table)
        self.qkv = nn.Linear(embed_dim, embed_dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(dropout)  # never applied (published behaviour)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.proj_drop = nn.Dropout(dropout)

    def _logit_and_value_tables(self, tables):
        """The tables the published module uses: logit tables only with both rel_query and rel_key."""
        if self.pe_type != "contextual":
            return (None, None, None)
        both = self.rel_query and self.rel_key
        return (tables[0] if both else None, tables[1] if both else None, tables[2] if self.rel_value else None)

    def _fused(self, windows, q, k, v, xyz, window, quant, qgl, tables, radial_a=None):
        dtype = self.attention_dtype
        tables = tuple(cast(t, dtype) for t in self._logit_and_value_tables(tables))
        # attention_dtype decides, not autocast (which would cast the fused op's inputs to its own dtype); the
        # output comes back in q's dtype
        with torch.autocast(q.device.type, enabled=False):
            return attend_in_windows(windows, q, k, v, xyz, window, self.shift_win, self.scale, quant, qgl, tables,
                                     radial_a, dtype=dtype)

    def _step(self, q, k, v, xyz, params, window, quant, qgl, tables, split_func=None):
        index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = params
        dtype = self.attention_dtype
        return sparse_self_attention(
            (q * self.scale).contiguous().to(dtype), k.contiguous().to(dtype), v.contiguous().to(dtype),
            xyz.float(), index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx, window,
            self.shift_win, pe_type=self.pe_type, rel_query=self.rel_query, rel_key=self.rel_key,
            rel_value=self.rel_value, quant_size=quant, quant_grid_length=qgl,
            relative_pos_query_table=tables[0].to(dtype), relative_pos_key_table=tables[1].to(dtype),
            relative_pos_value_table=tables[2].to(dtype), split_func=split_func)

    def _step_indices(self, sptr_tensor, xyz, xyz_sphere, batch):
        """The published 14-tuple cache entry: cubic 6-tuple, window_size, shift_win, spherical 6-tuple."""
        cached = sptr_tensor.find_indice_params(self.indice_key)
        if cached is None:
            cubic = get_indices_params(xyz, batch, self.window_size, self.shift_win)
            sphere = get_indices_params(xyz_sphere, batch, self.window_size_sphere, self.shift_win)
            sptr_tensor.indice_dict[self.indice_key] = cubic + (self.window_size, self.shift_win) + sphere
            return cubic, sphere
        if not np.array_equal(cached[6], self.window_size) or cached[7] != self.shift_win:
            raise ValueError(f"indice_key {self.indice_key!r} was computed with other window parameters")
        return tuple(cached[:6]), tuple(cached[8:])

    def forward(self, sptr_tensor: SparseTrTensor) -> SparseTrTensor:
        check_features(sptr_tensor, self.embed_dim, self_attention=True)
        feats, indices = sptr_tensor.query_feats, sptr_tensor.query_indices
        xyz, batch = indices[:, 1:], sptr_tensor.batch_ids()
        n, c = feats.shape
        h, d = self.num_heads, self.head_dim
        h1 = h // 2
        xyz_sphere = cart2sphere(xyz.float())
        if self.attention == "fused":
            # Both branches' windows first: window_sort reads its window count on the host (a stream sync), and
            # here the second read does not wait for the first branch's attention kernels.
            cubic_windows = cached_windows(sptr_tensor, f"{self.indice_key}/cubic", xyz, batch, self.window_size,
                                           self.shift_win)
            sphere_windows = cached_windows(sptr_tensor, f"{self.indice_key}/sphere", xyz_sphere, batch,
                                            self.window_size_sphere, self.shift_win)
        # split + unbind: their backwards are one cat and two stacks into the qkv gradient; indexing q, k, v
        # and then their head halves cost a zero-filled full-size gradient per slice and the adds of them
        cubic_qkv, sphere_qkv = self.qkv(feats).reshape(n, 3, h, d).split([h1, h - h1], 2)
        cubic_qkv, sphere_qkv = cubic_qkv.unbind(1), sphere_qkv.unbind(1)
        cubic_tables = (self.relative_pos_query_table, self.relative_pos_key_table, self.relative_pos_value_table)
        sphere_tables = (self.relative_pos_query_table_sphere, self.relative_pos_key_table_sphere,
                         self.relative_pos_value_table_sphere)
        cubic_args = (self.window_size, self.quant_size, self.quant_grid_length, cubic_tables)
        sphere_args = (self.window_size_sphere, self.quant_size_sphere, self.quant_grid_length_sphere, sphere_tables)
        if self.attention == "fused":
            out_cubic = self._fused(cubic_windows, *cubic_qkv, xyz, *cubic_args)
            out_sphere = self._fused(sphere_windows, *sphere_qkv, xyz_sphere, *sphere_args, radial_a=self.a)
        else:
            cubic, sphere = self._step_indices(sptr_tensor, xyz, xyz_sphere, batch)
            out_cubic = self._step(*cubic_qkv, xyz, cubic, *cubic_args)
            out_sphere = self._step(*sphere_qkv, xyz_sphere, sphere, *sphere_args, partial(exponential_split, a=self.a))
        # the fused branches return q's dtype (the projection's), the step ops attention_dtype
        x = cast(torch.cat([out_cubic, out_sphere], 1).reshape(n, c), cubic_qkv[0].dtype)
        x = self.proj_drop(self.proj(x))
        return SparseTrTensor(x, indices, sptr_tensor.spatial_shape, sptr_tensor.batch_size, batch=sptr_tensor.batch)


@dataclasses.dataclass(frozen=True)
class SphereFormerConfig(LayerConfig):
    """One SphereFormer block; defaults are SemanticKITTI level 1 (C 32, 2 heads, 0.3 m cubic windows)."""
    dim: int = 32
    num_heads: int = 2
    window_size: tuple = (0.3, 0.3, 0.3)
    window_size_sphere: tuple = (2.0, 2.0, 80.0)
    quant_size: tuple = (0.0125, 0.0125, 0.0125)
    quant_size_sphere: tuple = (2.0 / 24, 2.0 / 24, 80.0 / 24)
    indice_key: str = "sphereformer0"
    drop_path: float = 0.0
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    qk_scale: float | None = None
    a: float = 0.05 * 0.25
    attention: str = "fused"
    attention_dtype: str = "float32"  # SphereFormer's rule; "float16"/"bfloat16": the fused low-precision path

    def __post_init__(self):
        super().__post_init__()
        check_attention_path(self.attention)
        attention_compute_dtype(self.attention_dtype)
        name = type(self).__name__
        check_positive(name, dim=self.dim, num_heads=self.num_heads, mlp_ratio=self.mlp_ratio, a=self.a)
        check_sizes(name, window_size=self.window_size, window_size_sphere=self.window_size_sphere,
                    quant_size=self.quant_size, quant_size_sphere=self.quant_size_sphere)
        if self.qk_scale is not None:
            check_positive(name, qk_scale=self.qk_scale)
        if self.dim % self.num_heads:
            raise ValueError(f"{name}.dim {self.dim} must be divisible by num_heads {self.num_heads}")
        if self.num_heads < 2:
            raise ValueError(f"{name}.num_heads must be >= 2: SphereFormer splits heads between cubic and "
                             "spherical windows")
        if int(self.dim * self.mlp_ratio) < 1:
            raise ValueError(f"{name}.mlp_ratio {self.mlp_ratio} gives an MLP of width 0 at dim {self.dim}")
        check_fraction(name, drop_path=self.drop_path)
        for side, window, quant in (("", self.window_size, self.quant_size),
                                    ("_sphere", self.window_size_sphere, self.quant_size_sphere)):
            quant_grid_length(np.array(window), np.array(quant), f"{name}.window_size{side} / quant_size{side}")


class SphereFormer(nn.Module):
    """Pre-norm block: ``x + DropPath(attn(norm1(x)))``, then ``x + DropPath(mlp(norm2(x)))``.

    ``forward(feats (N, C), xyz (N, 3) metric coordinates, batch (N,))``; window indices are rebuilt each call.
    """

    def __init__(self, cfg: SphereFormerConfig):
        super().__init__()
        self.cfg = cfg
        self.norm1 = LayerNorm(cfg.dim)
        self.attn = SparseMultiheadSASphereConcat(
            cfg.dim, cfg.num_heads, cfg.indice_key, np.array(cfg.window_size, np.float32),
            np.array(cfg.window_size_sphere, np.float32), pe_type="contextual", qk_scale=cfg.qk_scale,
            qkv_bias=cfg.qkv_bias, rel_query=True, rel_key=True, rel_value=True,
            quant_size=np.array(cfg.quant_size, np.float32), quant_size_sphere=np.array(cfg.quant_size_sphere, np.float32),
            a=cfg.a, attention=cfg.attention, attention_dtype=cfg.attention_dtype)
        self.drop_path = DropPath(cfg.drop_path)
        self.norm2 = LayerNorm(cfg.dim)
        hidden = int(cfg.dim * cfg.mlp_ratio)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", nn.Linear(cfg.dim, hidden))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("drop1", nn.Dropout(0.0))
        self.mlp.add_module("fc2", nn.Linear(hidden, cfg.dim))
        self.mlp.add_module("drop2", nn.Dropout(0.0))

    def forward(self, feats, xyz, batch):
        check_tensor("feats", feats, dim=2, dtypes=FLOATING)
        check_shape("feats", feats, (None, self.cfg.dim))
        check_points(xyz, batch)
        if xyz.shape[0] != feats.shape[0] or xyz.device != feats.device:
            raise ValueError(f"xyz must hold the {feats.shape[0]} points of feats on {feats.device}, got "
                             f"{xyz.shape[0]} on {xyz.device}")
        check_tensor("batch", batch, dtypes=INTEGER)  # scan indices: exact whatever xyz's dtype
        indices = torch.cat([batch[:, None].to(xyz.dtype), xyz], -1)
        attn = self.attn(SparseTrTensor(self.norm1(feats), indices, None, None, batch=batch)).query_feats
        x = feats + self.drop_path(attn)
        return x + self.drop_path(self.mlp(self.norm2(x)))
