"""``sparse_self_attention``: windowed multi-head attention over points in original order (SparseTransformer §5)."""
from __future__ import annotations

import contextlib
import warnings
from typing import NamedTuple

import torch

from ._checks import FLOATING, INDEX, ValueChecks, cast, check_shape, check_tensor, data_checks, data_checks_enabled
from .step_attention import (
    attention_step1,
    attention_step2,
    attention_step2_with_rel_pos_value,
    dot_prod_with_idx_all,
    scatter_softmax_csr,
)
from .fused_window_attention import RelativePosition, window_attention
from .windowing import quantised_coords, relative_position_index

_ops = torch.ops.sptr


@torch.library.register_fake("sptr::window_permute_rows")
def _window_permute_rows_fake(x, dest, source, dtype=None):
    return x.new_empty(x.shape, dtype=dtype or x.dtype)


_warned_partial_rel = False
PE_TYPES = ("none", "contextual", "sine", "fourier")  # sine / fourier act in the module, before this op


class WindowOrder(NamedTuple):
    """A permutation ``order`` of the points (window order: row ``j`` is point ``order[j]``) and its inverse,
    both int64, made once per attention call. Rows move between the orders by ``sptr::window_permute_rows``
    scatters, whose gradients are scatters too: ``x[order]``'s gradient is an accumulating ``index_put``, which
    sorts the indices again on CUDA, and ``index_copy``'s is ``index_select``, which runs one CUDA thread block
    per row (~0.16 ms per call at 270k rows of 32 bytes)."""

    order: torch.Tensor
    inverse: torch.Tensor

    @classmethod
    def of(cls, sort_idx: torch.Tensor) -> "WindowOrder":
        order = sort_idx.long()
        arange = torch.arange(order.numel(), device=order.device)
        # inverse[order[j]] = j: arange's rows scattered by order, one kernel (no zero fill: a permutation writes
        # every row; the callers check sort_idx or build it)
        return cls(order, _ops.window_permute_rows(arange, order, order))

    def to_windows(self, *tensors: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """``x[order]`` of each tensor, cast to ``dtype`` on the way if given (one pass, not a cast and a
        permute)."""
        return tuple(_ops.window_permute_rows(x, self.inverse, self.order, dtype) for x in tensors)

    def to_points(self, x_sorted: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The inverse of :meth:`to_windows`: row ``j`` of ``x_sorted`` goes to row ``order[j]`` (cast to
        ``dtype`` if given)."""
        return _ops.window_permute_rows(x_sorted, self.order, self.inverse, dtype)


def check_window_order(sort_idx: torch.Tensor, query: torch.Tensor) -> None:
    """``sort_idx`` is an index vector of query's N points on its device and, with value checks on (a host
    sync), a permutation of them: each point exactly once."""
    check_tensor("sort_idx", sort_idx, dim=1, dtypes=INDEX, device=query.device)
    check_shape("sort_idx", sort_idx, (query.shape[0],))
    n = query.shape[0]
    checks = ValueChecks().range("sort_idx", sort_idx, 0, n)
    if n and data_checks_enabled():  # a permutation: every point exactly once (clamped: the range check names it)
        once = torch.zeros(n, dtype=torch.int32, device=sort_idx.device).index_add_(
            0, sort_idx.clamp(0, n - 1), torch.ones_like(sort_idx, dtype=torch.int32))
        checks.require("sort_idx must be a permutation of 0 .. N-1 (each point exactly once)", (once == 1).all())
    checks.run()


def sparse_self_attention(query, key, value, xyz, index_0, index_0_offsets, n_max, index_1, index_1_offsets,
                          sort_idx, window_size, shift_win, pe_type="none", rel_query=False, rel_key=False,
                          rel_value=False, quant_size=None, quant_grid_length=None, relative_pos_query_table=None,
                          relative_pos_key_table=None, relative_pos_value_table=None, split_func=None, dtype=None):
    """Windowed attention of ``query/key/value (N, h, d)`` (original point order) over the windows described by
    the index arrays of :func:`get_indices_params` (sorted order). Returns ``(N, h, d)`` in query's input dtype.

    ``pe_type='contextual'``: logit tables when both ``rel_query`` and ``rel_key``, value table with
    ``rel_value``; tables ``(2·qgl − 1, 3, h, d)`` indexed by :func:`relative_position_index`. ``dtype`` (None,
    fp32, fp16, bf16) casts q, k, v and the tables for the computation.
    """
    global _warned_partial_rel
    check_tensor("query", query, dim=3, dtypes=FLOATING)
    if pe_type not in PE_TYPES:
        raise ValueError(f"pe_type must be one of {PE_TYPES}, got {pe_type!r}")
    check_window_order(sort_idx, query)
    out_dtype = query.dtype
    if dtype is not None:
        query, key, value = cast(query, dtype), cast(key, dtype), cast(value, dtype)
    tables_dtype = query.dtype
    contextual = pe_type == "contextual"
    logit_tables = contextual and rel_query and rel_key
    value_table = contextual and rel_value
    if contextual and (rel_query != rel_key) and not _warned_partial_rel:
        warnings.warn("sparse_self_attention: rel_query and rel_key must both be set for the logit tables to be "
                      "used; with only one, neither is (published behaviour)")
        _warned_partial_rel = True

    window_order = WindowOrder.of(sort_idx)
    sorted_q, sorted_k, sorted_v, sorted_xyz = window_order.to_windows(query, key, value, xyz)
    rel = None
    if logit_tables or value_table:
        if quant_size is None or quant_grid_length is None:
            raise ValueError("pe_type='contextual' needs quant_size and quant_grid_length")
        rel = relative_position_index(sorted_xyz, index_0, index_1, window_size, quant_size, quant_grid_length,
                                      shift_win, split_func)
    if logit_tables:
        logits = dot_prod_with_idx_all(sorted_q, index_0, index_0_offsets, sorted_k, index_1, index_1_offsets,
                                       relative_pos_query_table.to(tables_dtype),
                                       relative_pos_key_table.to(tables_dtype), rel, n_max)
    else:
        logits = attention_step1(sorted_q, sorted_k, index_0, index_0_offsets, index_1, index_1_offsets, n_max)
    attn = scatter_softmax_csr(logits, index_0_offsets)
    # The aggregation would check index_0_offsets, index_1 and rel again (a host sync each): the softmax and the
    # logit op above already did, unless rel or the value rows took no part there.
    rechecks = (value_table and not logit_tables) or sorted_v.shape[0] != sorted_k.shape[0]
    with contextlib.nullcontext() if rechecks else data_checks(False):
        out_sorted = _aggregate(attn, sorted_v, index_0, index_0_offsets, n_max, index_1, index_1_offsets,
                                relative_pos_value_table.to(tables_dtype) if value_table else None, rel)
    return window_order.to_points(out_sorted).to(out_dtype)


def _aggregate(attn, v, index_0, index_0_offsets, n_max, index_1, index_1_offsets, table, rel):
    if table is not None:
        return attention_step2_with_rel_pos_value(attn, v, index_0, index_0_offsets, n_max, index_1, index_1_offsets,
                                                  table, rel)
    return attention_step2(attn, v, index_0, index_0_offsets, index_1, index_1_offsets, n_max)


def fused_sparse_self_attention(query, key, value, xyz, sort_idx, window_offsets, window_size, shift_win,
                                scale, quant_size=None, quant_grid_length=None, tables=(None, None, None),
                                radial_a=None, deterministic=False, dtype=None):
    """:func:`sparse_self_attention`'s contextual mode on the fused kernel: ``query/key/value (N, h, d)`` in
    original point order, unscaled (``scale`` is applied inside), windows from
    :func:`~sptr.ops.windowing.window_partition`. ``radial_a`` selects SphereFormer's exponential radial bins
    (``exponential_split``) for column 2. Returns ``(N, h, d)`` in the compute dtype (autocast's, if on), or,
    with ``dtype``, computes in ``dtype`` and returns query's input dtype, as :func:`sparse_self_attention`
    does: q, k and v are cast on their way into window order and the output on its way back (the tables
    are the caller's to cast). ``sort_idx`` must be a permutation of the N points (checked with value checks
    on; the layers, which build it, skip the check)."""
    check_tensor("query", query, dim=3, dtypes=FLOATING)
    check_window_order(sort_idx, query)
    rel_pos = None
    window_order = WindowOrder.of(sort_idx)
    out_dtype = None if dtype is None else query.dtype
    sorted_q, sorted_k, sorted_v = window_order.to_windows(query, key, value, dtype=dtype)
    if any(t is not None for t in tables):
        if quant_size is None or quant_grid_length is None:
            raise ValueError("relative-position tables need quant_size and quant_grid_length")
        coords = quantised_coords(xyz, window_size, quant_size, shift_win, order=window_order.order)
        radial = {} if radial_a is None else dict(radius=xyz[window_order.order, 2].float(), radial_a=radial_a)
        rel_pos = RelativePosition(coords, quant_grid_length - 1, *tables, **radial)
    out_sorted = window_attention(sorted_q, sorted_k, sorted_v, window_offsets, rel_pos=rel_pos, scale=scale,
                                  deterministic=deterministic)
    return window_order.to_points(out_sorted, dtype=out_dtype)
