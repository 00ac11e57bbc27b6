"""VarLengthMultiheadSA: SparseTransformer's windowed multi-head self-attention module (§6.2)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from ..ops._checks import data_checks
from ..ops.sparse_attention import fused_sparse_self_attention, sparse_self_attention
from ..ops.windowing import get_indices_params, to_3d_numpy, window_partition
from .config import LayerConfig, check_fraction, check_positive, check_sizes
from .position_embedding import PositionEmbeddingCoordsSine
from .sparse_tensor import SparseTrTensor, check_features

PE_TYPES = ("none", "contextual", "sine", "fourier")
ATTENTION_PATHS = ("fused", "step")


def check_attention_path(attention: str) -> str:
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {attention!r}")
    return attention


def cached_indices(sptr_tensor, key, window_size, shift_win, compute):
    """``compute()``'s tuple of window indices, cached in ``indice_dict[key]`` followed by ``(window_size,
    shift_win)`` (SparseTransformer's layout); a cached entry made with other window parameters is an error."""
    cached = sptr_tensor.find_indice_params(key)
    if cached is None:
        params = tuple(compute())
        sptr_tensor.indice_dict[key] = params + (window_size, shift_win)
        return params
    *params, cached_size, cached_shift = cached
    if not np.array_equal(cached_size, window_size) or cached_shift != shift_win:
        raise ValueError(f"indice_key {key!r} was computed with window_size {cached_size}, shift_win "
                         f"{cached_shift}; this module has {window_size}, {shift_win}")
    return tuple(params)


def cached_windows(sptr_tensor, key, xyz, batch, window_size, shift_win):
    """``(sort_idx, window_offsets)`` of the fused path, cached in ``indice_dict`` under ``key``."""
    return cached_indices(sptr_tensor, key, window_size, shift_win,
                          lambda: window_partition(xyz, batch, window_size, shift_win))


def attend_in_windows(windows, q, k, v, xyz, window_size, shift_win, scale, quant_size=None, quant_grid_length=None,
                      tables=(None, None, None), radial_a=None, dtype=None):
    """The fused attention of a layer over ``windows`` of ``xyz`` (:func:`cached_windows`), computed in ``dtype``
    if given (q, k and v cast on their way into window order, the output back to q's dtype on its way out).
    The window offsets and quantised coordinates are built from points whose coordinates ``window_partition``
    checked, so they are valid by construction (a relative position pushed past the table by rounding at a
    window's edge is clamped to it by the kernel); their value checks would only add a host sync to every call,
    and are skipped."""
    sort_idx, offsets = windows
    with data_checks(False):
        return fused_sparse_self_attention(q, k, v, xyz, sort_idx, offsets, window_size, shift_win, scale,
                                           quant_size, quant_grid_length, tables, radial_a, dtype=dtype)


def quant_grid_length(window_size: np.ndarray, quant_size: np.ndarray, what: str = "window_size / quant_size") -> int:
    """Cells per window side; the published code requires the first two dimensions to agree."""
    qgl = int((window_size[0] + 1e-4) / quant_size[0])
    if qgl != int((window_size[1] + 1e-4) / quant_size[1]):
        raise ValueError(f"{what} must give the same grid length in x and y, got {window_size} / {quant_size}")
    if qgl < 1:
        raise ValueError(f"{what} must give at least one quantisation cell per window, got {window_size} / "
                         f"{quant_size}")
    return qgl


@dataclasses.dataclass(frozen=True)
class VarLengthMultiheadSAConfig(LayerConfig):
    embed_dim: int
    num_heads: int
    indice_key: str
    window_size: tuple = (0.3, 0.3, 0.3)
    shift_win: bool = False
    pe_type: str = "none"
    dropout: float = 0.0
    qk_scale: float | None = None
    qkv_bias: bool = True
    quant_size: tuple | None = None
    attention: str = "fused"

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        check_attention_path(self.attention)
        check_positive(name, embed_dim=self.embed_dim, num_heads=self.num_heads)
        check_sizes(name, window_size=self.window_size)
        check_fraction(name, dropout=self.dropout)
        if self.qk_scale is not None:
            check_positive(name, qk_scale=self.qk_scale)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"{name}.embed_dim {self.embed_dim} must be divisible by num_heads {self.num_heads}")
        if self.pe_type not in PE_TYPES:
            raise ValueError(f"{name}.pe_type must be one of {PE_TYPES}, got {self.pe_type!r}")
        if self.pe_type == "contextual":
            if self.quant_size is None:
                raise ValueError(f"{name}: pe_type='contextual' needs quant_size")
            check_sizes(name, quant_size=self.quant_size)
            quant_grid_length(np.array(self.window_size), np.array(self.quant_size), f"{name}.window_size / quant_size")
        if self.pe_type in ("sine", "fourier") and self.embed_dim % 2:
            raise ValueError(f"{name}: pe_type={self.pe_type!r} needs an even embed_dim, got {self.embed_dim}")


class VarLengthMultiheadSA(nn.Module):
    """Windowed self-attention on a :class:`SparseTrTensor`; published constructor signature.

    ``pe_type='contextual'`` needs ``rel_query=rel_key=rel_value=True`` and ``quant_size`` in kwargs and adds
    the three relative-position tables ``(2·qgl − 1, 3, num_heads, head_dim)``.

    ``attention='fused'`` (default) runs the fused kernel in the features' dtype (autocast's under autocast);
    ``'step'`` runs SparseTransformer's step-by-step ops in float32, as published.
    """

    def __init__(self, embed_dim, num_heads, indice_key, window_size, shift_win=False, pe_type="none", dropout=0.0,
                 qk_scale=None, qkv_bias=True, algo="native", attention="fused", **kwargs):
        super().__init__()
        # The published signature, validated as the config would be (every argument named in the error)
        quant = kwargs.get("quant_size")
        VarLengthMultiheadSAConfig(embed_dim, num_heads, indice_key, tuple(to_3d_numpy(window_size).tolist()),
                                   shift_win, pe_type, dropout, qk_scale, qkv_bias,
                                   None if quant is None else tuple(to_3d_numpy(quant).tolist()), attention)
        self.attention = attention
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.indice_key = indice_key
        self.shift_win = shift_win
        self.pe_type = pe_type
        self.scale = qk_scale or self.head_dim ** -0.5
        self.window_size = to_3d_numpy(window_size)
        if pe_type == "contextual":
            for flag in ("rel_query", "rel_key", "rel_value"):
                if not kwargs.get(flag, False):
                    raise ValueError(f"pe_type='contextual' requires {flag}=True")
            if "quant_size" not in kwargs:
                raise ValueError("pe_type='contextual' requires quant_size")
            self.rel_query, self.rel_key, self.rel_value = True, True, True
            self.quant_size = to_3d_numpy(kwargs["quant_size"])
            self.quant_grid_length = quant_grid_length(self.window_size, self.quant_size)
            shape = (2 * self.quant_grid_length - 1, 3, num_heads, self.head_dim)
            for name in ("relative_pos_query_table", "relative_pos_key_table", "relative_pos_value_table"):
                table = nn.Parameter(torch.zeros(shape))
                nn.init.trunc_normal_(table, std=0.02)
                setattr(self, name, table)
        elif pe_type in ("sine", "fourier"):
            normalize = kwargs.get("normalize_pos_enc", True)
            extra = {"gauss_scale": kwargs.get("gauss_scale", 1.0)} if pe_type == "fourier" else {}
            self.pos_enc = PositionEmbeddingCoordsSine(pos_type=pe_type, d_pos=embed_dim, normalize=normalize, **extra)
        self.q = nn.Linear(embed_dim, embed_dim, bias=qkv_bias)
        self.k = nn.Linear(embed_dim, embed_dim, bias=qkv_bias)
        self.v = nn.Linear(embed_dim, embed_dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(dropout)  # never applied (published behaviour)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.proj_drop = nn.Dropout(dropout)

    @classmethod
    def from_config(cls, cfg: VarLengthMultiheadSAConfig) -> "VarLengthMultiheadSA":
        extra = {}
        if cfg.pe_type == "contextual":
            extra = dict(rel_query=True, rel_key=True, rel_value=True, quant_size=np.array(cfg.quant_size))
        return cls(cfg.embed_dim, cfg.num_heads, cfg.indice_key, np.array(cfg.window_size), cfg.shift_win,
                   cfg.pe_type, cfg.dropout, cfg.qk_scale, cfg.qkv_bias, attention=cfg.attention, **extra)

    def _add_position_embedding(self, feats, xyz, batch):
        """Per batch element, the embedding of its coordinates over its own range (out of place, D15)."""
        if batch.numel() > 1 and bool((batch[1:] < batch[:-1]).any()):
            raise ValueError("sine/fourier position embedding needs points sorted by batch index")
        parts = []
        for b in torch.unique_consecutive(batch):
            sel = batch == b
            pts = xyz[sel].float()[None]
            rng = [pts.min(1).values, pts.max(1).values]
            parts.append(self.pos_enc(pts, input_range=rng)[0].t().to(feats.dtype))
        return feats + torch.cat(parts, 0)

    def forward(self, sptr_tensor: SparseTrTensor) -> SparseTrTensor:
        check_features(sptr_tensor, self.embed_dim)
        query = sptr_tensor.query_feats
        key = sptr_tensor.key_feats if sptr_tensor.key_feats is not None else query.clone()
        value = sptr_tensor.value_feats if sptr_tensor.value_feats is not None else query.clone()
        indices = sptr_tensor.query_indices
        xyz, batch = indices[:, 1:], sptr_tensor.batch_ids()
        xyz = xyz if xyz.is_floating_point() else xyz.float()
        if self.pe_type in ("sine", "fourier"):
            query = self._add_position_embedding(query, xyz, batch)
            key = self._add_position_embedding(key, xyz, batch)
        n, c = query.shape
        if self.attention == "fused":
            x = self._fused(sptr_tensor, query, key, value, xyz, batch)
        else:
            x = self._step(sptr_tensor, query, key, value, xyz, batch)
        x = self.proj_drop(self.proj(x.reshape(n, c).to(self.proj.weight.dtype)))
        return SparseTrTensor(x, sptr_tensor.query_indices, sptr_tensor.spatial_shape, sptr_tensor.batch_size,
                              batch=sptr_tensor.batch)

    def _tables(self):
        if self.pe_type != "contextual":
            return (None, None, None)
        return self.relative_pos_query_table, self.relative_pos_key_table, self.relative_pos_value_table

    def _fused(self, sptr_tensor, query, key, value, xyz, batch):
        n, h, d = query.shape[0], self.num_heads, self.head_dim
        q, k, v = (lin(x).reshape(n, h, d) for lin, x in ((self.q, query), (self.k, key), (self.v, value)))
        contextual = self.pe_type == "contextual"
        windows = cached_windows(sptr_tensor, f"{self.indice_key}/fused", xyz, batch, self.window_size,
                                 self.shift_win)
        quant = (self.quant_size, self.quant_grid_length) if contextual else (None, None)
        return attend_in_windows(windows, q, k, v, xyz, self.window_size, self.shift_win, self.scale, *quant,
                                 self._tables())

    def _step(self, sptr_tensor, query, key, value, xyz, batch):
        n, c = query.shape
        h, d = self.num_heads, self.head_dim
        q = self.q(query).reshape(n, h, d) * self.scale
        k = self.k(key).reshape(n, h, d)
        v = self.v(value).reshape(n, h, d)

        params = cached_indices(sptr_tensor, self.indice_key, self.window_size, self.shift_win,
                                lambda: get_indices_params(xyz, batch, self.window_size, self.shift_win))
        index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = params
        extra = {}
        if self.pe_type == "contextual":
            extra = dict(rel_query=True, rel_key=True, rel_value=True, quant_size=self.quant_size,
                         quant_grid_length=self.quant_grid_length,
                         relative_pos_query_table=self.relative_pos_query_table.float(),
                         relative_pos_key_table=self.relative_pos_key_table.float(),
                         relative_pos_value_table=self.relative_pos_value_table.float())
        return sparse_self_attention(q.float(), k.float(), v.float(), xyz.float(), index_0, index_0_offsets, n_max,
                                     index_1, index_1_offsets, sort_idx, self.window_size, self.shift_win,
                                     pe_type=self.pe_type, **extra)
