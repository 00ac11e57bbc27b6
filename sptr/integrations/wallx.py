"""Drop-in names of Wall-X's ``wall_x.fusions.backend`` (positional, as published; the published defects are
fixed, see the spec's §9): the MoE routing and dual-GEMM ops, RoPE and the Qwen2.5-VL index ops."""
from __future__ import annotations

import torch

from ..ops._checks import FLOATING, check_tensor, dtype_name, is_int
from ..ops.moe import _ops, _wants_validation, asym_dual_gmm as _dual_gmm, unpermute as _unpermute
from ..ops.rope import rope, rope_bwd  # noqa: F401
from ..ops.vision_index import get_rope_index, get_window_index, rot_pos_emb  # noqa: F401


def asym_dual_gmm(input_expert0, input_expert1, weight_expert0, weight_expert1, output_expert0=None,
                  output_expert1=None, trans_a=False, trans_b=False):
    """``(out0, out1)`` with ``out_e = op(input_e) · op(weight_e)``; given outputs are written (also
    non-contiguous ones) and must have the product's shape and dtype. Both the raw extension's and
    ``asym_dual_gmm_separated``'s argument order."""
    if output_expert0 is None and output_expert1 is None:
        return _dual_gmm(input_expert0, input_expert1, weight_expert0, weight_expert1, trans_a, trans_b)
    if output_expert0 is None or output_expert1 is None:
        own = _dual_gmm(input_expert0, input_expert1, weight_expert0, weight_expert1, trans_a, trans_b)
        outs = []
        for e, (given, computed) in enumerate(zip((output_expert0, output_expert1), own)):
            if given is None:
                outs.append(computed)
                continue
            check_tensor(f"output_expert{e}", given, device=computed.device)
            if given.shape != computed.shape or given.dtype != computed.dtype:
                raise ValueError(f"output_expert{e} must be a {dtype_name(computed.dtype)} tensor of "
                                 f"shape {tuple(computed.shape)}, got {dtype_name(given.dtype)} "
                                 f"{tuple(given.shape)}")
            outs.append(given.copy_(computed))
        return tuple(outs)
    return _dual_gmm(input_expert0, input_expert1, weight_expert0, weight_expert1, trans_a, trans_b,
                     out=(output_expert0, output_expert1))


asym_dual_gmm_separated = asym_dual_gmm


# Wall-X's kernels index the N·K slots with int32.
MAX_SLOTS = (1 << 31) - 1
ID_DTYPES = (torch.int32, torch.int64)


def permute(input, indices, num_out_tokens, workspace, max_expanded_token_num):
    """``(permuted, row_id_map, workspace)`` with the published order: the flat ids stably sorted as signed
    integers (negative ids first), the first ``num_out_tokens`` rows kept (``<= 0``: all ``N·K``),
    ``row_id_map[k·N + t]`` the row of copy k of token t or -1. Runs on the device without a host sync.
    ``indices`` int32 or int64 ``[N]`` or ``[N, K]``, sorted in their own dtype; ``N·K < 2^31``.
    ``workspace`` (any list, ``[]`` to allocate) is returned as ``[sorted ids int32, iota, sorted slots, scratch]``
    holding this call's values (ids clamped into int32), sized to at least ``max_expanded_token_num`` slots;
    its contents are never read."""
    check_tensor("input", input, dim=2, dtypes=FLOATING)
    check_tensor("indices", indices, dtypes=ID_DTYPES, device=input.device)
    ids = indices[:, None] if indices.dim() == 1 else indices
    if ids.dim() != 2 or ids.shape[0] != input.shape[0]:
        raise ValueError(f"indices must be [N] or [N, K] with N = {input.shape[0]}, got {tuple(indices.shape)}")
    N, K = ids.shape
    P = N * K
    if P > MAX_SLOTS:
        raise ValueError(f"indices has N*K = {P} slots; Wall-X's row_id_map is int32, so N*K must be < 2^31")
    if num_out_tokens is not None and not is_int(num_out_tokens):
        raise TypeError(f"num_out_tokens must be an int or None, got {type(num_out_tokens).__name__}")
    num_out = P if num_out_tokens is None or num_out_tokens <= 0 else int(num_out_tokens)
    if num_out > P:
        raise ValueError(f"num_out_tokens ({num_out}) must be <= N*K = {P}")
    if max_expanded_token_num is not None and not is_int(max_expanded_token_num):
        raise TypeError(f"max_expanded_token_num must be an int or None, got {type(max_expanded_token_num).__name__}")
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    row_of_slot = torch.full((P,), -1, dtype=torch.int32, device=input.device)
    row_of_slot[order[:num_out]] = torch.arange(num_out, dtype=torch.int32, device=input.device)
    row_id_map = row_of_slot.reshape(N, K).t().reshape(-1)
    permuted = input.index_select(0, order[:num_out] // K)
    capacity = max(int(max_expanded_token_num or 0), P)
    iota = torch.arange(capacity, dtype=torch.int32, device=input.device)
    ws = [torch.empty(capacity, dtype=torch.int32, device=input.device), iota,
          torch.empty(capacity, dtype=torch.int32, device=input.device),
          torch.empty(0, dtype=torch.int8, device=input.device)]
    info = torch.iinfo(torch.int32)
    ws[0][:P] = sorted_ids.clamp(info.min, info.max)
    ws[2][:P] = order.to(torch.int32)
    return permuted, row_id_map, ws


def _row_map(row_id_map, rows: int, input_name: str):
    """Wall-X's row map as sptr's int32 one. int64 entries outside [-1, rows) raise where validated (CPU); on
    CUDA they become -1 (dropped, as the op drops out-of-range rows) instead of wrapping to another row."""
    check_tensor("row_id_map", row_id_map, dim=1, dtypes=ID_DTYPES)
    if row_id_map.dtype == torch.int32:
        return row_id_map
    if _wants_validation(None, row_id_map) and row_id_map.numel():
        lo, hi = int(row_id_map.min()), int(row_id_map.max())
        if lo < -1 or hi >= rows:
            raise ValueError(f"row_id_map must have values in [-1, {rows}) ({input_name} has {rows} rows), got "
                             f"[{lo}, {hi}]")
    return torch.where((row_id_map < -1) | (row_id_map >= rows), -1, row_id_map).to(torch.int32)


def _prob(prob, N: int, K: int, device):
    """``prob`` as ``[N, K]`` (``[N]`` when K = 1; None or empty: weights 1), never reshaped from another layout."""
    if prob is None or (isinstance(prob, torch.Tensor) and prob.numel() == 0 and N * K != 0):
        return None
    check_tensor("prob", prob, dtypes=FLOATING, device=device)
    if prob.dim() == 1 and K == 1 and prob.shape[0] == N:
        return prob[:, None]
    if tuple(prob.shape) != (N, K):
        raise ValueError(f"prob must be [max_tokens, num_topK] = [{N}, {K}], got {tuple(prob.shape)}")
    return prob


def unpermute(input, row_id_map, prob, max_tokens, num_topK):
    """``out[t] = Σ_k prob[t,k] · input[row_id_map[k·N + t]]`` (fp32 accumulation, every K including 1;
    ``prob`` ``[N, K]``, empty or None: weights 1)."""
    check_tensor("input", input, dim=2, dtypes=FLOATING)
    for name, v in (("max_tokens", max_tokens), ("num_topK", num_topK)):
        if not is_int(v) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if row_id_map.numel() != max_tokens * num_topK:
        raise ValueError(f"row_id_map holds {row_id_map.numel()} entries, expected max_tokens * num_topK = "
                         f"{max_tokens} * {num_topK}")
    rows = _row_map(row_id_map, input.shape[0], "input")
    return _unpermute(input, rows, _prob(prob, max_tokens, num_topK, input.device), max_tokens)


def unpermute_bwd(input_bwd, input_fwd, row_id_map, prob=None):
    """``(act_grad [R, H], prob_grad fp32 [N, K])`` of :func:`unpermute` (``prob=None``: ones ``[N, 1]``)."""
    check_tensor("input_bwd", input_bwd, dim=2, dtypes=FLOATING)
    check_tensor("input_fwd", input_fwd, dim=2, dtypes=FLOATING, device=input_bwd.device)
    if input_fwd.dtype != input_bwd.dtype or input_fwd.shape[1] != input_bwd.shape[1]:
        raise ValueError(f"input_bwd ({dtype_name(input_bwd.dtype)} {tuple(input_bwd.shape)}) and "
                         f"input_fwd ({dtype_name(input_fwd.dtype)} {tuple(input_fwd.shape)}) must "
                         "share the dtype and the hidden size")
    N = input_bwd.shape[0]
    rows = _row_map(row_id_map, input_fwd.shape[0], "input_fwd")
    if rows.numel() % N if N else rows.numel():
        raise ValueError(f"row_id_map must hold K * N entries with N = {N} (input_bwd's rows), got "
                         f"{rows.numel()}")
    K = rows.numel() // N if N else 1
    prob = _prob(prob, N, K, input_bwd.device)
    if prob is None:
        prob = torch.ones(N, K, dtype=torch.float32, device=input_bwd.device)
    return tuple(_ops.moe_unpermute_bwd(input_bwd.contiguous(), input_fwd, rows, prob, True))
