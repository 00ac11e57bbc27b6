"""Independent references of window assignment and the relative index (spec §3.2, §5.1), by explicit loops."""
import numpy as np
import torch


def window_ids_reference(pos, batch, size, start=None):
    """Dense rank of (batch, z, y, x) cells, computed with numpy float32 arithmetic per point."""
    p = pos.detach().cpu().numpy().astype(np.float32)
    s = np.asarray(size, dtype=np.float32).reshape(3)
    o = p.min(0) if start is None else np.asarray(start, dtype=np.float32).reshape(3)
    cells = np.floor((p - o) / s).astype(np.int64)
    keys = [(int(b), int(c[2]), int(c[1]), int(c[0])) for b, c in zip(batch.tolist(), cells)]
    rank = {k: i for i, k in enumerate(sorted(set(keys)))}
    return torch.tensor([rank[k] for k in keys], dtype=torch.long)


def window_cells_reference(xyz, batch, size, start=None, shift=False):
    """The published cell key arithmetic, one torch op at a time: ``xyz`` moved by half a cell when ``shift``
    (its origin then the unmoved minimum and scans counted from 0), the cells in ``xyz.dtype``, the key
    ``x + n_x·(y + n_y·(z + n_z·(b − b0)))`` in int64."""
    pos = xyz + 0.5 * size if shift else xyz
    origin = xyz.min(0).values if start is None else start
    cell = torch.floor((pos - origin) / size).long()
    extent = (torch.trunc((pos.max(0).values - origin) / size) + 1).long()
    b = batch.long()
    b0 = b.min() if start is None and not shift else 0
    return cell[:, 0] + extent[0] * (cell[:, 1] + extent[1] * (cell[:, 2] + extent[2] * (b - b0)))


def quantised_coords_reference(xyz, window_size, quant_size, shift=False):
    """The published quantisation cells, one torch op at a time in float32: ``floor(remainder(x − min x
    [+ w/2], w) / q)`` as int32, in ``xyz``'s order."""
    x = xyz.float()
    w, q = (torch.as_tensor(s, dtype=torch.float32, device=x.device) for s in (window_size, quant_size))
    d = x - x.min(0).values
    if shift:
        d = d + 0.5 * w
    return torch.div(torch.remainder(d, w), q, rounding_mode="floor").int()


def sparse_self_attention_reference(q, k, v, xyz, batch, window_size, shift_win, quant_size, qgl, tables=None,
                                    split_func=None):
    """Windowed attention in original order from scratch: windows, pairs, rel, softmax, value tables."""
    from .window_attention import aggregate_reference, pair_logits_reference, segment_softmax_reference
    from ..ops.windowing import get_indices_params, relative_position_index

    i0, o0, _, i1, _, sort_idx = get_indices_params(xyz, batch, window_size, shift_win)
    Q, K, V, X = q[sort_idx], k[sort_idx], v[sort_idx], xyz[sort_idx]
    rel = None
    if tables is not None:
        rel = relative_position_index(X, i0, i1, window_size, quant_size, qgl, shift_win, split_func)
        logits = pair_logits_reference(Q, K, i0, i1, tables[0], tables[1], rel)
    else:
        logits = pair_logits_reference(Q, K, i0, i1)
    out = aggregate_reference(segment_softmax_reference(logits, o0), V, o0, i1,
                              None if tables is None else tables[2], rel)
    return torch.empty_like(out).index_copy(0, sort_idx, out)
