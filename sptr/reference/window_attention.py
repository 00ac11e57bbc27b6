"""Pure-PyTorch references of the window attention family (compute in the inputs' dtype; tests pass float64)."""
import torch


def precompute_all_reference(counts):
    """Query-major pairs of each window, by explicit loops (SparseTransformer §2)."""
    i0, i1, o0, o1 = [], [], [], []
    s = S = 0
    for c in [int(c) for c in counts]:
        for a in range(c):
            o0.append(S + a * c)
            o1.append(S + a)
            i0 += [s + a] * c
            i1 += list(range(s, s + c))
        s += c
        S += c * c
    o0.append(S)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return as_int(o0), as_int(o1), as_int(i0), as_int(i1)


def table_embedding(table, rel_idx):
    """``E_T[m] = Σ_a T[rel_idx[m, a], a]``: (M, h, d)."""
    rel = rel_idx.long()
    return table[rel[:, 0], 0] + table[rel[:, 1], 1] + table[rel[:, 2], 2]


def pair_logits_reference(q, k, index_0, index_1, table_q=None, table_k=None, rel_idx=None, with_qk=True):
    qi, kj = q[index_0.long()], k[index_1.long()]
    out = (qi * kj).sum(-1) if with_qk else torch.zeros(qi.shape[:2], dtype=q.dtype, device=q.device)
    if table_q is not None:
        out = out + (qi * table_embedding(table_q, rel_idx)).sum(-1)
    if table_k is not None:
        out = out + (kj * table_embedding(table_k, rel_idx)).sum(-1)
    return out


def pair_queries(index_0_offsets):
    """Query of every pair, from the row offsets."""
    counts = (index_0_offsets[1:] - index_0_offsets[:-1]).long()
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)


def aggregate_reference(attn, v, index_0_offsets, index_1, table_v=None, rel_idx=None):
    vals = v[index_1.long()]
    if table_v is not None:
        vals = vals + table_embedding(table_v, rel_idx)
    n = index_0_offsets.numel() - 1
    out = torch.zeros(n, v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    return out.index_add(0, pair_queries(index_0_offsets), attn[..., None] * vals)


def segment_softmax_reference(src, indptr):
    seg = pair_queries(indptr)
    n = indptr.numel() - 1
    idx = seg[:, None].expand_as(src)
    mx = torch.full((n, src.shape[1]), float("-inf"), dtype=src.dtype, device=src.device)
    mx = mx.scatter_reduce(0, idx, src, reduce="amax", include_self=True)
    e = torch.exp(src - mx[seg])
    total = torch.zeros_like(mx).index_add(0, seg, e)
    return e / total[seg]
