"""Pure-PyTorch reference of the MoE routing ops and the grouped GEMMs (the specification the kernels are
tested against; they compute in the inputs' dtype, the tests pass float64 for the arithmetic ones)."""
import torch
import torch.nn.functional as F


def permute_order_reference(expert_ids, num_experts, num_out_tokens=None):
    """``(order, row_id_map, tokens_per_expert)``: flat slots ``s = t·K + k`` with an id in
    ``[0, num_experts)``, stably sorted by id (ties by ``s``), the first ``num_out`` kept;
    ``row_id_map[k·T + t]`` = the slot's row or -1."""
    ids = (expert_ids if expert_ids.dim() == 2 else expert_ids[:, None]).long()
    T, K = ids.shape
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    slots = torch.arange(T * K, device=ids.device)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = slots[torch.sort(key, stable=True).indices][: int(valid.sum())]
    num_out = T * K if num_out_tokens is None else num_out_tokens
    order = order[:num_out]
    row_of_slot = torch.full((T * K,), -1, dtype=torch.int64, device=ids.device)
    row_of_slot[order] = torch.arange(order.numel(), device=ids.device)
    row_id_map = row_of_slot.reshape(T, K).t().reshape(-1).to(torch.int32)
    counts = torch.bincount(flat[order], minlength=num_experts)[:num_experts]
    return order, row_id_map, counts


def permute_reference(x, expert_ids, num_experts, num_out_tokens=None):
    """``(x_perm [num_out, H], row_id_map int32 [K·T], tokens_per_expert int64 [E])``; rows past the kept
    ones are zero."""
    T = x.shape[0]
    K = expert_ids.shape[1] if expert_ids.dim() == 2 else 1
    order, row_id_map, counts = permute_order_reference(expert_ids, num_experts, num_out_tokens)
    num_out = T * K if num_out_tokens is None else num_out_tokens
    x_perm = x.new_zeros(num_out, x.shape[1])
    x_perm[: order.numel()] = x[order // K]
    return x_perm, row_id_map, counts


def unpermute_reference(x_perm, row_id_map, probs, num_tokens):
    """``out[t] = Σ_k probs[t,k] · x_perm[row_id_map[k·T + t]]`` over kept copies (probs None: weights 1)."""
    T = num_tokens
    K = row_id_map.numel() // T if T else 0
    rows = row_id_map.reshape(K, T).t().long()
    w = torch.ones(T, K, dtype=x_perm.dtype, device=x_perm.device) if probs is None else probs.to(x_perm.dtype)
    kept = rows >= 0
    gathered = x_perm[rows.clamp_min(0)] * (w * kept)[..., None]
    return gathered.sum(1)


def grouped_linear_reference(x, weights, offsets):
    """Rows ``[offsets[g], offsets[g+1])`` of x times ``weights[g]ᵀ`` (``[n_g, k_g]``, first k_g columns of x);
    output ``[R, max n_g]``, zero outside each group's columns and past the last group."""
    n_max = max(w.shape[0] for w in weights)
    out = x.new_zeros(x.shape[0], n_max)
    off = [int(o) for o in offsets]
    for g, w in enumerate(weights):
        lo, hi = off[g], off[g + 1]
        out[lo:hi, : w.shape[0]] = x[lo:hi, : w.shape[1]] @ w.t()
    return out


def swiglu_expert_reference(x, gate_weight, up_weight, down_weight, act="silu"):
    """``down(act(gate x) ⊙ up x)`` of one expert (nn.Linear weights, no bias)."""
    a = getattr(F, act)(x @ gate_weight.t())
    return (a * (x @ up_weight.t())) @ down_weight.t()


class SwiGLUExpert(torch.nn.Module):
    """One SwiGLU expert with nn.Linear projections (the parameter names of Wall-X / Qwen MLPs)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=bias)
        self.activation = activation

    def forward(self, x):
        return self.down_proj(getattr(F, self.activation)(self.gate_proj(x)) * self.up_proj(x))


class PlainDualExpertFFN(torch.nn.Module):
    """The plain two-expert loop that DualExpertFFN replaces: ``y[t] = expert_{id(t)}(x[t])``, ids outside
    {0, 1} give zero rows."""

    def __init__(self, hidden: int, intermediate=(11008, 2048), bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.experts = torch.nn.ModuleList(SwiGLUExpert(hidden, i, bias, activation) for i in intermediate)

    def forward(self, x, expert_index):
        flat = x.reshape(-1, x.shape[-1])
        ids = expert_index.reshape(-1).long()
        masks = [ids == e for e in range(len(self.experts))]
        ys = [expert(flat[mask]) for expert, mask in zip(self.experts, masks)]
        out = flat.new_zeros(flat.shape, dtype=ys[0].dtype)  # the experts' dtype (autocast's, under autocast)
        for mask, y in zip(masks, ys):
            out[mask] = y
        return out.reshape(x.shape)


def capacity_keep(topk_index, num_experts, capacity):
    """Copies kept by a per-expert capacity: the first ``capacity`` copies of each expert in (t, k) order."""
    flat = topk_index.reshape(-1)
    onehot = F.one_hot(flat.clamp(0, num_experts - 1), num_experts) * (flat >= 0)[:, None]
    rank = (onehot.cumsum(0) * onehot).sum(-1) - 1
    return (rank < capacity).reshape(topk_index.shape) & (topk_index >= 0)


class PlainRoutedExpertFFN(torch.nn.Module):
    """The plain top-k MoE loop that RoutedExpertFFN replaces: ``y[t] = Σ_k w[t,k]·expert_{idx[t,k]}(x[t])``
    over kept copies, with a given routing."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, bias: bool = False,
                 activation: str = "silu"):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.experts = torch.nn.ModuleList(
            SwiGLUExpert(hidden, intermediate, bias, activation) for _ in range(num_experts))

    def combine(self, x, topk_index, topk_weight, keep):
        out = torch.zeros(x.shape, dtype=torch.float32 if x.dtype != torch.float64 else x.dtype, device=x.device)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero((topk_index == e) & keep, as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]).to(out.dtype) * topk_weight[tok, slot, None].to(out.dtype))
        return out.to(x.dtype)
