"""Drop-in names of Wall-X's ``wall_x.fusions.backend`` (positional, as published; the published defects are
fixed, see the spec's §9): the MoE routing and dual-GEMM ops, RoPE and the Qwen2.5-VL index ops."""
from __future__ import annotations

import torch

from ..ops.moe import _ops, asym_dual_gmm as _dual_gmm, unpermute as _unpermute
from ..ops.rope import rope, rope_bwd  # noqa: F401
from ..ops.vision_index import get_rope_index, get_window_index, rot_pos_emb  # noqa: F401


def asym_dual_gmm(input_expert0, input_expert1, weight_expert0, weight_expert1, output_expert0=None,
                  output_expert1=None, trans_a=False, trans_b=False):
    """``(out0, out1)`` with ``out_e = op(input_e) · op(weight_e)``; given outputs are written (also
    non-contiguous ones). Both the raw extension's and ``asym_dual_gmm_separated``'s argument order."""
    if output_expert0 is None and output_expert1 is None:
        return _dual_gmm(input_expert0, input_expert1, weight_expert0, weight_expert1, trans_a, trans_b)
    if output_expert0 is None or output_expert1 is None:
        own0, own1 = _dual_gmm(input_expert0, input_expert1, weight_expert0, weight_expert1, trans_a, trans_b)
        output_expert0 = own0 if output_expert0 is None else output_expert0.copy_(own0)
        output_expert1 = own1 if output_expert1 is None else output_expert1.copy_(own1)
        return output_expert0, output_expert1
    return _dual_gmm(input_expert0, input_expert1, weight_expert0, weight_expert1, trans_a, trans_b,
                     out=(output_expert0, output_expert1))


asym_dual_gmm_separated = asym_dual_gmm


def permute(input, indices, num_out_tokens, workspace, max_expanded_token_num):
    """``(permuted, row_id_map, workspace)`` with the published order: the flat ids stably sorted as signed
    integers (negative ids first), the first ``num_out_tokens`` rows kept (``<= 0``: all ``N·K``),
    ``row_id_map[k·N + t]`` the row of copy k of token t or -1. Runs on the device without a host sync.
    ``workspace`` (any list, ``[]`` to allocate) is returned as ``[sorted ids int32, iota, sorted slots, scratch]``
    holding this call's values, sized to at least ``max_expanded_token_num`` slots; its contents are never read."""
    if not isinstance(input, torch.Tensor) or input.dim() != 2:
        raise ValueError(f"input must be a 2-D tensor [N, H], got {getattr(input, 'shape', type(input))}")
    if not isinstance(indices, torch.Tensor) or indices.device != input.device:
        raise ValueError("indices must be a tensor on input's device")
    ids = indices.reshape(input.shape[0], -1) if indices.dim() == 1 else indices
    if ids.dim() != 2 or ids.shape[0] != input.shape[0]:
        raise ValueError(f"indices must be [N] or [N, K] with N = {input.shape[0]}, got {tuple(indices.shape)}")
    N, K = ids.shape
    P = N * K
    num_out = P if num_out_tokens is None or num_out_tokens <= 0 else int(num_out_tokens)
    if num_out > P:
        raise ValueError(f"num_out_tokens ({num_out}) must be <= N*K = {P}")
    sorted_ids, order = torch.sort(ids.reshape(-1).to(torch.int32), stable=True)
    row_of_slot = torch.full((P,), -1, dtype=torch.int32, device=input.device)
    row_of_slot[order[:num_out]] = torch.arange(num_out, dtype=torch.int32, device=input.device)
    row_id_map = row_of_slot.reshape(N, K).t().reshape(-1)
    permuted = input.index_select(0, order[:num_out] // K)
    capacity = max(int(max_expanded_token_num or 0), P)
    iota = torch.arange(capacity, dtype=torch.int32, device=input.device)
    ws = [torch.empty(capacity, dtype=torch.int32, device=input.device), iota,
          torch.empty(capacity, dtype=torch.int32, device=input.device),
          torch.empty(0, dtype=torch.int8, device=input.device)]
    ws[0][:P] = sorted_ids
    ws[2][:P] = order.to(torch.int32)
    return permuted, row_id_map, ws


def unpermute(input, row_id_map, prob, max_tokens, num_topK):
    """``out[t] = Σ_k prob[t,k] · input[row_id_map[k·N + t]]`` (fp32 accumulation, every K including 1;
    ``prob`` empty or None: weights 1)."""
    if row_id_map.numel() != max_tokens * num_topK:
        raise ValueError(f"row_id_map holds {row_id_map.numel()} entries, expected max_tokens * num_topK = "
                         f"{max_tokens} * {num_topK}")
    probs = None if prob is None or prob.numel() == 0 else prob.reshape(max_tokens, num_topK)
    return _unpermute(input, row_id_map.to(torch.int32), probs, max_tokens)


def unpermute_bwd(input_bwd, input_fwd, row_id_map, prob=None):
    """``(act_grad [R, H], prob_grad fp32 [N, K])`` of :func:`unpermute` (``prob=None``: ones ``[N, 1]``)."""
    if prob is None:
        prob = torch.ones(input_bwd.shape[0], 1, dtype=torch.float32, device=input_bwd.device)
    return tuple(_ops.moe_unpermute_bwd(input_bwd.contiguous(), input_fwd, row_id_map.to(torch.int32), prob, True))
