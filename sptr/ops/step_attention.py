"""Window attention ops in SparseTransformer's pair layout (drop-in for `sptr` 1.1.1's functional API).

Pairs ``m`` join a query ``index_0[m]`` and a key ``index_1[m]``; ``index_0_offsets`` (N+1) delimits each query's
row of pairs (query-major, see :func:`precompute_all`). ``h`` heads, ``d`` head dim, tables ``(L, 3, h, d)``,
``rel_idx (M, 3)``. Floating inputs: fp16/bf16/fp32/fp64 (one dtype per call; fp16/bf16 accumulate in fp32).
Index tensors: int32 or int64; ``rel_idx``: int8/16/32/64. ``n_max`` arguments are launch hints, ignored.
The ops' autograd is registered in C++ (window_attention_autograd.cpp), for its host time.
"""
from __future__ import annotations

import torch
from torch import Tensor

import sptr._C  # noqa: F401  (registers torch.ops.sptr)

from ._checks import (
    FLOATING,
    INDEX,
    INTEGER,
    ValueChecks,
    cast,
    check_offsets,
    check_range,
    check_shape,
    check_tensor,
    common_float_dtype,
)

_ops = torch.ops.sptr


# ----------------------------------------------------------------------------------------------- fake kernels
@torch.library.register_fake("sptr::window_precompute_all")
def _precompute_all_fake(counts, num_points):
    m = torch.library.get_ctx().new_dynamic_size()
    i32 = dict(dtype=torch.int32, device=counts.device)
    return (torch.empty(num_points + 1, **i32), torch.empty(num_points, **i32), torch.empty(m, **i32),
            torch.empty(m, **i32))


@torch.library.register_fake("sptr::window_pair_logits_fwd")
def _pair_logits_fake(q, k, index_0, index_1, table_q, table_k, rel_idx, with_qk):
    torch._check(q.shape[1:] == k.shape[1:])
    return q.new_empty(index_0.shape[0], q.shape[1])


def _grad_like(t, ref):
    return ref.new_empty(0) if t is None else t.new_empty(t.shape)


@torch.library.register_fake("sptr::window_pair_logits_bwd")
def _pair_logits_bwd_fake(grad, q, k, index_0, index_1, table_q, table_k, rel_idx, with_qk):
    return q.new_empty(q.shape), k.new_empty(k.shape), _grad_like(table_q, q), _grad_like(table_k, q)


@torch.library.register_fake("sptr::window_aggregate_fwd")
def _aggregate_fake(attn, v, index_0_offsets, index_1, table_v, rel_idx):
    return v.new_empty(index_0_offsets.shape[0] - 1, v.shape[1], v.shape[2])


@torch.library.register_fake("sptr::window_aggregate_bwd")
def _aggregate_bwd_fake(grad, attn, v, index_0, index_0_offsets, index_1, table_v, rel_idx):
    return attn.new_empty(attn.shape), v.new_empty(v.shape), _grad_like(table_v, v)


@torch.library.register_fake("sptr::window_softmax_fwd")
def _softmax_fake(src, indptr):
    return src.new_empty(src.shape)


@torch.library.register_fake("sptr::window_softmax_bwd")
def _softmax_bwd_fake(grad, out, indptr):
    return out.new_empty(out.shape)


# ------------------------------------------------------------------------------------------- checked entry points
def _check_features(name: str, t: Tensor, device=None) -> Tensor:
    return check_tensor(name, t, dim=3, dtypes=FLOATING, device=device)


def _check_pairs(index_0: Tensor, index_1: Tensor, num_q: int, num_k: int, device, checks: ValueChecks) -> int:
    check_tensor("index_0", index_0, dim=1, dtypes=INDEX, device=device)
    check_tensor("index_1", index_1, dim=1, dtypes=INDEX, device=device)
    if index_0.shape[0] != index_1.shape[0]:
        raise ValueError(f"index_0 and index_1 must have the same length, got {index_0.shape[0]} and "
                         f"{index_1.shape[0]}")
    checks.range("index_0", index_0, 0, num_q).range("index_1", index_1, 0, num_k)
    return index_0.shape[0]


def _check_rel(rel_idx: Tensor, num_pairs: int, length: int, device, checks: ValueChecks) -> None:
    check_tensor("rel_idx", rel_idx, dim=2, dtypes=INTEGER, device=device)
    check_shape("rel_idx", rel_idx, (num_pairs, 3))
    checks.range("rel_idx", rel_idx, 0, length)


def _check_table(name: str, table: Tensor, h: int, d: int, device, features: str) -> None:
    check_tensor(name, table, dim=4, dtypes=FLOATING, device=device)
    if table.shape[1:] != (3, h, d):
        raise ValueError(f"{name} must have shape (L, 3, {h}, {d}) (the heads and head_dim of {features}), got "
                         f"{tuple(table.shape)}")


def pair_logits(q: Tensor, k: Tensor, index_0: Tensor, index_1: Tensor, table_q: Tensor | None = None,
                table_k: Tensor | None = None, rel_idx: Tensor | None = None, with_qk: bool = True) -> Tensor:
    """Per-pair, per-head logits ``(M, h)``:
    ``with_qk·<q[i], k[j]> + <q[i], E_Tq[m]> + <k[j], E_Tk[m]>`` with ``E_T[m] = Σ_a T[rel_idx[m, a], a]``.

    q ``(Nq, h, d)``, k ``(Nk, h, d)``, index_0/index_1 ``(M,)``, tables ``(L, 3, h, d)`` or None, rel_idx ``(M, 3)``.
    Differentiable in q, k and the tables.
    """
    _check_features("q", q)
    _check_features("k", k, q.device)
    if k.shape[1:] != q.shape[1:]:
        raise ValueError(f"q and k must agree in (heads, head_dim), got {tuple(q.shape)} and {tuple(k.shape)}")
    dtype = common_float_dtype(q=q, k=k, table_q=table_q, table_k=table_k)
    checks = ValueChecks()
    num_pairs = _check_pairs(index_0, index_1, q.shape[0], k.shape[0], q.device, checks)
    h, d = q.shape[1], q.shape[2]
    tables = [t for t in (table_q, table_k) if t is not None]
    for name, t in (("table_q", table_q), ("table_k", table_k)):
        if t is not None:
            _check_table(name, t, h, d, q.device, "q")
    if len(tables) == 2 and table_q.shape[0] != table_k.shape[0]:
        raise ValueError(f"table_q and table_k must have the same length L, got {table_q.shape[0]} and "
                         f"{table_k.shape[0]}")
    if tables:
        if rel_idx is None:
            raise ValueError("rel_idx is required when a relative-position table is given")
        _check_rel(rel_idx, num_pairs, tables[0].shape[0], q.device, checks)
    checks.run()
    return _ops.window_pair_logits_fwd(cast(q, dtype), cast(k, dtype), index_0, index_1, cast(table_q, dtype),
                                       cast(table_k, dtype), rel_idx if tables else None, with_qk)


def aggregate(attn: Tensor, v: Tensor, index_0_offsets: Tensor, index_1: Tensor, table_v: Tensor | None = None,
              rel_idx: Tensor | None = None) -> Tensor:
    """``out[p] = Σ_{m in row(p)} attn[m] · (v[index_1[m]] + E_Tv[m])`` per head: ``(N, h, d)`` with
    ``N = index_0_offsets.numel() - 1``. attn ``(M, h)``, v ``(Nk, h, d)``. Differentiable in attn, v, table_v.

    The backward rebuilds each pair's query from ``index_0_offsets``, so it is exact for any pair list whose
    rows are contiguous (as the offsets require), square windows or not.
    """
    check_tensor("attn", attn, dim=2, dtypes=FLOATING)
    _check_features("v", v, attn.device)
    dtype = common_float_dtype(attn=attn, v=v, table=table_v)
    check_tensor("index_0_offsets", index_0_offsets, dim=1, dtypes=INDEX, device=attn.device)
    check_tensor("index_1", index_1, dim=1, dtypes=INDEX, device=attn.device)
    num_pairs, h, d = index_1.shape[0], v.shape[1], v.shape[2]
    if attn.shape[0] != num_pairs:
        raise ValueError(f"attn must have one row per pair of index_1 ({num_pairs}), got shape {tuple(attn.shape)}")
    if attn.shape[1] != h:
        raise ValueError(f"attn (M, h) and v (Nk, h, d) must have the same number of heads, got {tuple(attn.shape)} "
                         f"and {tuple(v.shape)}")
    checks = ValueChecks().offsets("index_0_offsets", index_0_offsets, num_pairs)
    checks.range("index_1", index_1, 0, v.shape[0])
    if table_v is not None:
        _check_table("table", table_v, h, d, attn.device, "v")
        if rel_idx is None:
            raise ValueError("rel_idx is required when a relative-position table is given")
        _check_rel(rel_idx, num_pairs, table_v.shape[0], attn.device, checks)
    checks.run()
    return _ops.window_aggregate_fwd(cast(attn, dtype), cast(v, dtype), index_0_offsets, index_1,
                                     cast(table_v, dtype), None if table_v is None else rel_idx)


def segment_softmax(src: Tensor, indptr: Tensor) -> Tensor:
    """Softmax of ``src (M, h)`` over each CSR segment ``[indptr[p], indptr[p+1])`` along dim 0, per head
    (max-subtracted; fp16/bf16 computed in fp32). Empty segments are allowed. Differentiable in src."""
    check_tensor("src", src, dim=2, dtypes=FLOATING)
    check_tensor("indptr", indptr, dim=1, dtypes=INDEX, device=src.device)
    check_offsets("indptr", indptr, src.shape[0])
    return _ops.window_softmax_fwd(src, indptr)


# ------------------------------------------------------------------------- SparseTransformer-compatible API
def precompute_all(N: int, n: int, n_max: int, counts: Tensor):
    """Query-major pair layout of ``n`` windows with ``counts`` points each (points sorted by window).

    Returns int32 ``(index_0_offsets (N+1), index_1_offsets (N), index_0 (M), index_1 (M))`` on
    ``counts.device``, ``M = Σ counts²``. ``n_max`` is a hint and does not affect the result.
    """
    check_tensor("counts", counts, dim=1, dtypes=INTEGER)
    if counts.shape[0] != n:
        raise ValueError(f"counts must have n = {n} entries, got {counts.shape[0]}")
    check_range("counts", counts, 0, N + 1)
    return _ops.window_precompute_all(counts, int(N))


def attention_step1(q, k, index0, index0_offsets, index1, index1_offsets, n_max):
    """``attn[m] = <q[index0[m]], k[index1[m]]>`` per head: ``(M, h)``."""
    return pair_logits(q, k, index0, index1)


def attention_step2(attn, v, index0, index0_offsets, index1, index1_offsets, n_max):
    """``out[p] = Σ_{m in row(p)} attn[m] · v[index1[m]]``: ``(N, h, d)``."""
    return aggregate(attn, v, index0_offsets, index1)


def dot_prod_with_idx(q, index_q, index_q_offsets, *args, **kwargs):
    """Table terms only: ``<q[i], E_Tq[m]> + <k[j], E_Tk[m]>`` (no q·k term), ``(M, h)``.

    Accepts the official argument order ``(q, index_q, index_q_offsets, n_max, k, index_k_offsets, index_k,
    table_q, table_k, rel_idx)`` and the 1.1.1 order ``(q, index_q, index_q_offsets, k, index_k,
    index_k_offsets, table_q, table_k, rel_idx, n_max)``: the 4th positional argument is ``n_max`` (an int,
    a numpy integer or a 0-d tensor) in the first and the ``(Nk, h, d)`` tensor ``k`` in the second.
    """
    names_official = ["n_max", "k", "index_k_offsets", "index_k", "table_q", "table_k", "rel_idx"]
    names_111 = ["k", "index_k", "index_k_offsets", "table_q", "table_k", "rel_idx", "n_max"]
    official = bool(args) and not (isinstance(args[0], Tensor) and args[0].dim() > 0)
    bound = dict(zip(names_official if official else names_111, args))
    overlap = set(bound) & set(kwargs)
    if overlap:
        raise TypeError(f"dot_prod_with_idx got multiple values for {sorted(overlap)}")
    bound.update(kwargs)
    missing = [n for n in ("k", "index_k", "table_q", "table_k", "rel_idx") if n not in bound]
    if missing:
        raise TypeError(f"dot_prod_with_idx missing arguments {missing}")
    return pair_logits(q, bound["k"], index_q, bound["index_k"], bound["table_q"], bound["table_k"],
                       bound["rel_idx"], with_qk=False)


def dot_prod_with_idx_all(q, index_q, index_q_offsets, k, index_k, index_k_offsets, table_q, table_k, rel_idx,
                          n_max):
    """``<q[i], k[j]> + <q[i], E_Tq[m]> + <k[j], E_Tk[m]>`` per head, ``(M, h)``; requires ``q.shape[0] ==
    k.shape[0]``."""
    if isinstance(q, Tensor) and isinstance(k, Tensor) and q.shape[0] != k.shape[0]:
        raise ValueError(f"dot_prod_with_idx_all needs q and k of the same length, got {q.shape[0]} and "
                         f"{k.shape[0]}")
    return pair_logits(q, k, index_q, index_k, table_q, table_k, rel_idx, with_qk=True)


def attention_step2_with_rel_pos_value(attn, v, index0, index0_offsets, n_max, index1, index1_offsets, table,
                                       rel_idx):
    """``out[p] = Σ_{m in row(p)} attn[m] · (v[index1[m]] + E_T[m])``: ``(N, h, d)``. Any L, any d."""
    return aggregate(attn, v, index0_offsets, index1, table, rel_idx)


def scatter_softmax_csr(src, indptr, dim=-1):
    """Softmax over CSR segments of ``src (M, h)`` along dim 0 (``dim`` is ignored, as published)."""
    return segment_softmax(src, indptr)
