"""MoE ops: token permute / unpermute, grouped SwiGLU, grouped linear layers and the asymmetric dual GEMM.

Routing ops keep their inputs' dtype (fp32/fp16/bf16/fp64) and never wait for the host: the expert offsets
they produce stay on the device, so a whole MoE layer is capturable in a CUDA graph and compiles to one graph.
The GEMMs accumulate in fp32 and round once; under autocast they run in the autocast dtype. The ops' autograd
is registered in C++ (moe_autograd.cpp), for its host time.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

import sptr._C  # noqa: F401

from ._checks import FLOATING, autocast_dtype, cast, check_int, check_no_overlap, check_tensor

_ops = torch.ops.sptr
ROUTING_IDS = (torch.int32, torch.int64, torch.bool, torch.uint8)


class Permutation(NamedTuple):
    """``x_perm [num_out (+ padding), H]`` rows grouped by expert; ``row_id_map`` int32 ``[K·T]`` (entry
    ``k·T + t`` is the row of copy k of token t, or -1); ``tokens_per_expert`` int64 ``[E]`` (on the device);
    ``expert_offsets`` int64 ``[E + 1]``: expert e owns rows ``[offsets[e], offsets[e] + tokens_per_expert[e])``."""
    x_perm: Tensor
    row_id_map: Tensor
    tokens_per_expert: Tensor
    expert_offsets: Tensor


def _padded_rows(num_out: int, num_experts: int, align: int) -> int:
    return num_out + num_experts * (align - 1) if align > 1 else num_out


# ---------------------------------------------------------------------------------------------------- fakes
@torch.library.register_fake("sptr::moe_permute")
def _permute_fake(x, expert_ids, num_experts, num_out_tokens, align):
    slots = expert_ids.numel()
    rows = _padded_rows(num_out_tokens, num_experts, align)
    return (x.new_empty(rows, x.shape[1]), expert_ids.new_empty(slots, dtype=torch.int32),
            x.new_empty(num_experts, dtype=torch.int64), x.new_empty(num_experts + 1, dtype=torch.int64))


@torch.library.register_fake("sptr::moe_unpermute_fwd")
def _unpermute_fake(x_perm, row_id_map, probs, num_tokens):
    return x_perm.new_empty(num_tokens, x_perm.shape[1])


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("sptr::moe_unpermute_bwd")
def _unpermute_bwd_fake(grad, x_perm, row_id_map, probs, probs_grad):
    T = grad.shape[0]
    shape = (T, row_id_map.numel() // T) if probs is not None and probs_grad else (0, 0)
    return x_perm.new_empty(x_perm.shape), x_perm.new_empty(shape, dtype=_acc_dtype(x_perm.dtype))


@torch.library.register_fake("sptr::moe_swiglu_fwd")
def _swiglu_fake(h, group_offsets, widths):
    return h.new_empty(h.shape[0], max(widths))


@torch.library.register_fake("sptr::moe_swiglu_bwd")
def _swiglu_bwd_fake(grad, h, group_offsets, widths):
    return h.new_empty(h.shape)


@torch.library.register_fake("sptr::moe_grouped_linear")
def _grouped_linear_fake(x, weights, group_offsets):
    G = group_offsets.shape[0] - 1
    P = len(weights) // G
    width = max(sum(weights[g * P + p].shape[0] for p in range(P)) for g in range(G))
    return x.new_empty(x.shape[0], width)


@torch.library.register_fake("sptr::moe_grouped_linear_wgrad")
def _wgrad_fake(grad, x, group_offsets, out_features, in_features):
    return [x.new_empty(n, k) for n, k in zip(out_features, in_features)]


def _dual_shape(a, w, trans_a, trans_b):
    m, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
    n = w.shape[0] if trans_b else w.shape[1]
    torch._check((w.shape[1] if trans_b else w.shape[0]) == k, lambda: "weight k does not match input k")
    return m, n


@torch.library.register_fake("sptr::dual_gemm")
def _dual_fake(a0, a1, w0, w1, trans_a, trans_b):
    return (a0.new_empty(_dual_shape(a0, w0, trans_a, trans_b)), a1.new_empty(_dual_shape(a1, w1, trans_a, trans_b)))


@torch.library.register_fake("sptr::dual_gemm_out")
def _dual_out_fake(a0, a1, w0, w1, trans_a, trans_b, c0, c1):
    return None


# ------------------------------------------------------------------------------------------------ public API
def _routing_ids(name: str, ids, x: Tensor) -> Tensor:
    check_tensor(name, ids, dtypes=ROUTING_IDS, device=x.device)
    if ids.dim() == 1:
        ids = ids[:, None]
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.shape[1] < 1:
        raise ValueError(f"{name} must be [T] or [T, K] with T = {x.shape[0]} and K >= 1, got {tuple(ids.shape)}")
    return ids if ids.dtype in (torch.int32, torch.int64) else ids.to(torch.int32)


def _wants_validation(validate, t: Tensor) -> bool:
    """validate=None checks values where that is free (CPU tensors, outside torch.compile); True checks always
    (one host sync on CUDA); False never (out-of-range values are then dropped, never read out of bounds)."""
    if validate is None:
        return t.device.type == "cpu" and not torch.compiler.is_compiling()
    return bool(validate)


# Experts per layer: far above any published MoE (a few hundred), far below what the per-expert buffers of
# the routing kernels could allocate.
MAX_EXPERTS = 1 << 20


def permute(x: Tensor, expert_ids: Tensor, num_experts: int, num_out_tokens: int | None = None, *, align: int = 1,
            validate: bool | None = None) -> Permutation:
    """Group the K copies of each token by expert.

    ``x [T, H]`` (fp16/bf16/fp32/fp64); ``expert_ids [T, K]`` or ``[T]`` (int32/int64/bool/uint8): copy k of
    token t goes to expert ``expert_ids[t, k]``; negative ids are dropped. Rows are grouped by ascending
    expert, in ``(t, k)`` order inside an expert; ``num_out_tokens`` keeps the first that many copies of that
    order (default all ``T·K``); rows past the kept ones are zero. ``align > 1`` starts every expert's rows at
    a multiple of ``align`` (zero padding rows in between, at most ``align - 1`` per expert). Differentiable in
    x. No host synchronisation; ids ``>= num_experts`` raise a ValueError where they are checked (see
    ``validate``) and are dropped otherwise.
    """
    check_tensor("x", x, dim=2, dtypes=FLOATING)
    ids = _routing_ids("expert_ids", expert_ids, x)
    num_experts = check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    align = check_int("align", align, 1, 1 << 16)
    slots = ids.numel()
    num_out_tokens = slots if num_out_tokens is None else check_int("num_out_tokens", num_out_tokens, 0, slots)
    if _wants_validation(validate, ids) and ids.numel() and int(ids.max()) >= num_experts:
        raise ValueError(f"expert_ids must be < num_experts = {num_experts} (negative ids are dropped), "
                         f"got {int(ids.max())}")
    return Permutation(*_ops.moe_permute(x, ids, num_experts, num_out_tokens, align))


def unpermute(x_perm: Tensor, row_id_map: Tensor, probs: Tensor | None = None, num_tokens: int | None = None, *,
              validate: bool | None = None) -> Tensor:
    """``out[t] = Σ_k probs[t, k] · x_perm[row_id_map[k·T + t]]`` over the kept copies (fp32 accumulation, in
    increasing k; probs None: weights 1). ``probs [T, K]`` any floating dtype (computed in fp32, its gradient
    returned in its dtype); ``num_tokens`` defaults to ``probs.shape[0]``, or ``row_id_map.numel()`` (K = 1)
    without probs. Differentiable in x_perm and probs. Each x_perm row may be named by at most one slot (as in
    :func:`permute`'s map): a map that repeats a row is rejected where validated (``validate``, as in
    :func:`permute`); unvalidated, the backward of such a map is unspecified."""
    check_tensor("x_perm", x_perm, dim=2, dtypes=FLOATING)
    check_tensor("row_id_map", row_id_map, dim=1, dtypes=(torch.int32,), device=x_perm.device)
    if probs is not None:
        check_tensor("probs", probs, dtypes=FLOATING, device=x_perm.device)
        if probs.dim() == 1:
            probs = probs[:, None]
        if probs.dim() != 2:
            raise ValueError(f"probs must be [T, K] or [T], got {tuple(probs.shape)}")
    if num_tokens is None and probs is not None:
        T, K = probs.shape
        if row_id_map.numel() != T * K:
            raise ValueError(f"probs must be [T, K] with T*K = row_id_map's {row_id_map.numel()} entries, got "
                             f"{tuple(probs.shape)} (give num_tokens to set T)")
        num_tokens = T
    num_tokens = row_id_map.numel() if num_tokens is None else check_int("num_tokens", num_tokens, 0)
    if (row_id_map.numel() % num_tokens if num_tokens else row_id_map.numel()):
        raise ValueError(f"row_id_map must hold K * num_tokens entries (num_tokens = {num_tokens}), got "
                         f"{row_id_map.numel()}")
    K = row_id_map.numel() // num_tokens if num_tokens else (probs.shape[1] if probs is not None else 0)
    if probs is not None and tuple(probs.shape) != (num_tokens, K):
        raise ValueError(f"probs must be [T, K] = [{num_tokens}, {K}], got {tuple(probs.shape)}")
    if num_tokens == 0 and probs is not None:
        probs = probs[:, :0]  # no token: the op's [0, 0] form, still connected to probs for autograd
    if _wants_validation(validate, row_id_map) and row_id_map.numel():
        lo, hi = int(row_id_map.min()), int(row_id_map.max())
        if lo < -1 or hi >= x_perm.shape[0]:
            raise ValueError(f"row_id_map must have values in [-1, {x_perm.shape[0]}), got [{lo}, {hi}]")
        rows = row_id_map[row_id_map >= 0]
        if torch.unique(rows).numel() != rows.numel():
            raise ValueError("row_id_map must name each x_perm row at most once (as permute's map does): its "
                             "backward gives each row the gradient of its one slot")
    return _ops.moe_unpermute_fwd(x_perm, row_id_map, probs, num_tokens)


def swiglu(h: Tensor, group_offsets: Tensor, widths: Sequence[int]) -> Tensor:
    """SwiGLU of grouped rows: rows ``[off[g], off[g+1])`` read gate columns ``[0, w_g)`` and up columns
    ``[w_g, 2·w_g)`` of ``h``; returns ``silu(gate)·up`` ``[R, max w]`` (fp32 math, one rounding; zero outside
    each group's width and rows). Differentiable in h."""
    check_tensor("h", h, dim=2, dtypes=FLOATING)
    check_tensor("group_offsets", group_offsets, dim=1, dtypes=(torch.int64,), device=h.device)
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence):
        raise TypeError(f"widths must be a sequence of ints (one per group), got {type(widths).__name__}")
    widths = [check_int(f"widths[{i}]", w, 0) for i, w in enumerate(widths)]
    if len(widths) != group_offsets.numel() - 1:
        raise ValueError(f"widths must have one entry per group ({group_offsets.numel() - 1}), got {len(widths)}")
    if 2 * max(widths, default=0) > h.shape[1]:
        raise ValueError(f"h has {h.shape[1]} columns; a group of width {max(widths)} reads 2 * width of them")
    _check_group_offsets(group_offsets, h.shape[0])
    return _ops.moe_swiglu_fwd(h, group_offsets, widths)


def _check_group_offsets(offsets: Tensor, rows: int) -> None:
    """Group g owns rows [off[g], off[g+1]): non-decreasing, inside [0, rows]. Checked where that is free (CPU,
    outside torch.compile); on CUDA the kernels clamp the offsets into [0, rows], as for permute's ids."""
    if offsets.numel() and _wants_validation(None, offsets):
        first, last = int(offsets[0]), int(offsets[-1])
        if first < 0 or last > rows or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(f"group_offsets must be non-decreasing in [0, {rows}] (the rows of h), got "
                             f"{offsets.tolist() if offsets.numel() <= 16 else f'{first} ... {last}'}")


def _gemm_dtype(named: dict) -> torch.dtype:
    """Autocast dtype when enabled, else the one dtype all operands must share."""
    first = next(iter(named.values()))
    dtype = autocast_dtype(first.device)
    if dtype is not None:
        return dtype
    for name, t in named.items():
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {next(iter(named))} has {first.dtype}; the GEMM "
                            "operands must share a dtype (cast them, or run under autocast)")
    return first.dtype


def grouped_linear(x: Tensor, weights: Sequence[Tensor], group_offsets: Tensor) -> Tensor:
    """Rows ``[off[g], off[g+1])`` of ``x [R, k]`` times group g's nn.Linear weights: ``weights`` holds P
    ``[n_gp, k_g]`` parts per group (``weights[g·P + p]``; ``k_g <= k`` reads the first k_g columns), whose
    outputs sit side by side; output ``[R, max_g Σ_p n_gp]``, zero outside each group's columns and rows.
    ``group_offsets`` int64 ``[G + 1]`` on x's device (values clamped into ``[0, R]``). One launch on CUDA, no
    host sync; differentiable in x and the weights."""
    check_tensor("x", x, dim=2, dtypes=FLOATING)
    check_tensor("group_offsets", group_offsets, dim=1, dtypes=(torch.int64,), device=x.device)
    weights = list(weights)
    for i, w in enumerate(weights):
        check_tensor(f"weights[{i}]", w, dim=2, dtypes=FLOATING, device=x.device)
    dtype = _gemm_dtype({"x": x, **{f"weights[{i}]": w for i, w in enumerate(weights)}})
    return _ops.moe_grouped_linear(cast(x, dtype), [cast(w, dtype) for w in weights], group_offsets)


def asym_dual_gmm(a0: Tensor, a1: Tensor, w0: Tensor, w1: Tensor, trans_a: bool = False, trans_b: bool = False,
                  out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Two GEMMs of independent shapes in one call: ``c_e = op(a_e) · op(w_e)`` with ``op(a) = aᵀ`` under
    ``trans_a`` (likewise ``trans_b``), so ``a_e`` is ``[m_e, k_e]`` (or ``[k_e, m_e]``) and ``w_e`` ``[k_e, n_e]``
    (or ``[n_e, k_e]``). fp16/bf16/fp32/fp64, fp32 accumulation, one rounding; any m (0 included), n, k (k = 0
    gives zeros), any strides. On CUDA each expert runs through cuBLAS on the current stream, except where
    its k, n or a leading dimension is odd (cuBLAS's slow unaligned kernels) and it has >= 256 rows: such
    experts run together in one launch of the grouped mma kernel. ``out=(c0, c1)`` writes into the
    given tensors (no autograd). Differentiable in all four operands (the gradients are dual GEMMs too)."""
    named = {"input_expert0": a0, "input_expert1": a1, "weight_expert0": w0, "weight_expert1": w1}
    for name, t in named.items():
        check_tensor(name, t, dim=2, dtypes=FLOATING, device=a0.device if name != "input_expert0" else None)
    for name, flag in (("trans_a", trans_a), ("trans_b", trans_b)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    dtype = _gemm_dtype(named)
    a0, a1, w0, w1 = (cast(t, dtype) for t in (a0, a1, w0, w1))
    if out is None:
        return _ops.dual_gemm(a0, a1, w0, w1, bool(trans_a), bool(trans_b))
    c0, c1 = out
    for name, t in (("output_expert0", c0), ("output_expert1", c1)):
        check_tensor(name, t, dim=2, dtypes=FLOATING, device=a0.device)
    check_no_overlap("output_expert0", c0, "output_expert1", c1)
    for out_name, c in (("output_expert0", c0), ("output_expert1", c1)):
        for in_name, t in named.items():
            check_no_overlap(out_name, c, in_name, t)
    _ops.dual_gemm_out(a0, a1, w0, w1, bool(trans_a), bool(trans_b), c0, c1)
    return c0, c1

