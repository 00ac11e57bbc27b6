"""Fused window attention: flash-attention-style over variable-size windows, relative-position tables inside.

Tokens are sorted by window; ``window_offsets (W+1)`` delimits window ``w`` as tokens
``[window_offsets[w], window_offsets[w+1])``. Only the output and the per-row log-sum-exp are stored; the
backward recomputes the attention, so nothing of size ``M = Σ n_w²`` is ever allocated. The op's autograd is
registered in C++ (fused_window_attention_autograd.cpp): the Python layer of ``register_autograd`` would cost
more host time per call than the rest of the call.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

import sptr._C  # noqa: F401  (registers torch.ops.sptr)

from ._checks import (FLOATING, INDEX, ValueChecks, autocast_dtype, cast, check_shape, check_tensor,
                      data_checks_enabled, is_finite_number, is_int)

_ops = torch.ops.sptr


@dataclasses.dataclass(frozen=True)
class RelativePosition:
    """SparseTransformer's contextual relative-position encoding, described per token (sorted order).

    ``rel_a(i, j) = coords[i, a] − coords[j, a] + rel_shift`` indexes column ``a`` of the ``(L, 3, h, d)``
    tables; with ``radius`` given, column 2 is instead SphereFormer's exponential bin of ``radius[i] −
    radius[j]`` with bin width ``radial_a`` (``exponential_split``), clamped to ``[0, L−1]``. Any table may be
    None: the query/key tables add ``scale·q_i·E_Tq + k_j·E_Tk`` to the logits, the value table adds
    ``Σ_j p_ij·E_Tv`` to the output.
    """

    coords: Tensor
    rel_shift: int
    query_table: Tensor | None = None
    key_table: Tensor | None = None
    value_table: Tensor | None = None
    radius: Tensor | None = None
    radial_a: float = 0.0

    def tables(self):
        return self.query_table, self.key_table, self.value_table


# ----------------------------------------------------------------------------------------------- fake kernels
@torch.library.register_fake("sptr::window_attention_fwd")
def _fwd_fake(q, k, v, window_offsets, coords, radius, table_q, table_k, table_v, rel_shift, radial_a, scale,
              deterministic):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=acc)


@torch.library.register_fake("sptr::window_attention_bwd")
def _bwd_fake(grad_out, q, k, v, out, lse, window_offsets, coords, radius, table_q, table_k, table_v, rel_shift,
              radial_a, scale, deterministic):
    like = lambda t: q.new_empty(0) if t is None else t.new_empty(t.shape)  # noqa: E731
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), like(table_q), like(table_k),
            like(table_v))


# ----------------------------------------------------------------------------------------------- entry point
def _check_rel_pos(rel_pos: RelativePosition, n: int, h: int, d: int, device, checks: ValueChecks) -> None:
    if not isinstance(rel_pos, RelativePosition):
        raise TypeError(f"rel_pos must be a RelativePosition or None, got {type(rel_pos).__name__}")
    check_tensor("rel_pos.coords", rel_pos.coords, dim=2, dtypes=INDEX, device=device)
    check_shape("rel_pos.coords", rel_pos.coords, (n, 3))
    tables = [(name, t) for name, t in zip(("query_table", "key_table", "value_table"), rel_pos.tables())
              if t is not None]
    if not tables:
        raise ValueError("rel_pos needs at least one of query_table, key_table, value_table")
    first = tables[0][1]
    for i, (name, t) in enumerate(tables):
        # a table of the first one's shape, dtype and device passes (the usual call: three alike)
        if i and isinstance(t, Tensor) and t.shape == first.shape and t.dtype == first.dtype and t.device == first.device:
            continue
        check_tensor(f"rel_pos.{name}", t, dim=4, dtypes=FLOATING, device=device)
        check_shape(f"rel_pos.{name}", t, (None, 3, h, d))
        if t.shape[0] != first.shape[0]:
            lengths = ", ".join(f"{name} {t.shape[0]}" for name, t in tables)
            raise ValueError(f"rel_pos tables must have the same length L, got {lengths}")
    length = first.shape[0]
    if length < 1:
        raise ValueError("rel_pos tables must have L >= 1 rows")
    if rel_pos.radius is not None:
        check_tensor("rel_pos.radius", rel_pos.radius, dim=1, dtypes=FLOATING, device=device)
        check_shape("rel_pos.radius", rel_pos.radius, (n,))
        radial_a = rel_pos.radial_a
        if not (is_finite_number(radial_a) and radial_a > 0):
            raise ValueError(f"rel_pos.radial_a must be a finite number > 0 with a radius, got {radial_a!r}")
    shift = rel_pos.rel_shift
    if not is_int(shift):
        raise TypeError(f"rel_pos.rel_shift must be an int, got {shift!r}")
    shift = int(shift)
    if 2 * shift > length - 1 or shift < 0:
        raise ValueError(f"rel_pos.rel_shift must be in [0, (L-1)/2] so that coords_i - coords_j + rel_shift "
                         f"stays in [0, L-1] (L = {length}), got {shift}")
    # coords_i - coords_j + rel_shift in [0, L-1] for every pair; with a radius, column 2 is not a coordinate
    if data_checks_enabled():
        linear = rel_pos.coords if rel_pos.radius is None else rel_pos.coords[:, :2]
        checks.range("rel_pos.coords", linear, 0, shift + 1)


def window_attention(q: Tensor, k: Tensor, v: Tensor, window_offsets: Tensor, *,
                     rel_pos: RelativePosition | None = None, scale: float | None = None,
                     deterministic: bool = False) -> Tensor:
    """Softmax attention of ``q, k, v (N, h, d)`` within each window; returns ``(N, h, d)``.

    ``scale`` (default ``d**-0.5``) multiplies the query side of the logits: ``scale·(q·k + q·E_Tq) + k·E_Tk``,
    i.e. SparseTransformer's pre-scaled query. Differentiable in q, k, v and the tables. Under autocast the
    floating inputs are cast to the autocast dtype (as ``scaled_dot_product_attention``); otherwise they must
    share one dtype. q/k/v gradients are always bitwise reproducible, and so are all gradients of the CUDA
    tensor-core path (fp16/bf16, head dim 16/32/64/128, tables that fit in shared memory); elsewhere on CUDA
    ``deterministic=True`` makes the table gradients reproducible too (it fixes which CTA sums which tiles; by
    default tiles go to whichever is free).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dim=3, dtypes=FLOATING, device=q.device if name != "q" else None)
        if t.shape != q.shape:
            raise ValueError(f"q, k and v must have the same shape (N, h, d), got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
    n, h, d = q.shape
    if h < 1 or d < 1:
        raise ValueError(f"q, k and v need at least one head and head_dim >= 1, got shape {tuple(q.shape)}")
    if scale is not None and not is_finite_number(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    check_tensor("window_offsets", window_offsets, dim=1, dtypes=INDEX, device=q.device)
    checks = ValueChecks().offsets("window_offsets", window_offsets, n)
    if rel_pos is not None:
        _check_rel_pos(rel_pos, n, h, d, q.device, checks)
    checks.run()
    floats = [q, k, v, *(rel_pos.tables() if rel_pos is not None else (None, None, None))]
    dtype = autocast_dtype(q.device)
    if dtype is None:
        for t in floats:
            if t is not None and t.dtype != q.dtype:
                raise TypeError(f"q, k, v and the rel_pos tables must share one dtype, got {q.dtype} and "
                                f"{t.dtype} (cast them, or run under autocast)")
    else:
        floats = [cast(t, dtype) for t in floats]
    coords = radius = None
    rel_shift, radial_a = 0, 0.0
    if rel_pos is not None:
        coords = cast(rel_pos.coords, torch.int32)
        rel_shift = int(rel_pos.rel_shift)
        if rel_pos.radius is not None:
            radius = cast(rel_pos.radius, torch.float32)
            radial_a = float(rel_pos.radial_a)
    scale = d ** -0.5 if scale is None else float(scale)
    q, k, v, tq, tk, tv = floats
    out, _ = _ops.window_attention_fwd(q, k, v, window_offsets, coords, radius, tq, tk, tv, rel_shift, radial_a,
                                       scale, bool(deterministic))
    return out
