"""Pure-PyTorch reference of the fused window attention: dense softmax attention inside each window, the
relative-position tables gathered per pair (computes in the inputs' dtype; tests pass float64)."""
import torch

from ..layers.sphereformer import exponential_split


def pair_table_rows(rel_pos, lo, hi):
    """Relative index ``(n, n, 3)`` of every pair of window ``[lo, hi)`` (query-major)."""
    c = rel_pos.coords[lo:hi].long()
    rel = c[:, None, :] - c[None, :, :] + rel_pos.rel_shift
    length = next(t for t in rel_pos.tables() if t is not None).shape[0]
    if rel_pos.radius is not None:
        n = hi - lo
        i0 = torch.arange(n, device=c.device).repeat_interleave(n)
        i1 = torch.arange(n, device=c.device).repeat(n)
        xyz = torch.zeros(n, 3, device=c.device)
        xyz[:, 2] = rel_pos.radius[lo:hi].float()
        bins = exponential_split(xyz, i0, i1, rel.reshape(-1, 3).float(), a=rel_pos.radial_a)
        rel = bins.reshape(n, n, 3).long()
    return rel.clamp(0, length - 1)


def _embedding(table, rel):
    return table[rel[..., 0], 0] + table[rel[..., 1], 1] + table[rel[..., 2], 2]  # (n, n, h, d)


def window_attention_reference(q, k, v, window_offsets, rel_pos=None, scale=None):
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    offsets = [int(o) for o in window_offsets]
    parts = []
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        if hi == lo:
            continue
        qi, kj, vj = q[lo:hi], k[lo:hi], v[lo:hi]
        logits = scale * torch.einsum("ihc,jhc->hij", qi, kj)
        value_term = None
        if rel_pos is not None:
            rel = pair_table_rows(rel_pos, lo, hi)
            tq, tk, tv = rel_pos.tables()
            if tq is not None:
                logits = logits + scale * torch.einsum("ihc,ijhc->hij", qi, _embedding(tq, rel))
            if tk is not None:
                logits = logits + torch.einsum("jhc,ijhc->hij", kj, _embedding(tk, rel))
            if tv is not None:
                value_term = _embedding(tv, rel)
        p = torch.softmax(logits, dim=-1)
        out = torch.einsum("hij,jhc->ihc", p, vj)
        if value_term is not None:
            out = out + torch.einsum("hij,ijhc->ihc", p, value_term)
        parts.append(out)
    return torch.cat(parts, 0) if parts else q.new_zeros(q.shape)
