"""Window assignment (SparseTransformer §3): voxel-grid window ids, the sorted pair layout, relative indices.

Self-contained re-implementation of the published ``torch_cluster.grid`` rule (no PyG / torch_cluster):
window ids are dense ranks of ``(batch, z, y, x)`` cell keys, so results equal the published ordering.
"""
from __future__ import annotations

import inspect
import numbers

import numpy as np
import torch
from torch import Tensor

from .step_attention import precompute_all


def to_3d_numpy(size) -> np.ndarray:
    """Number -> ``[s, s, s]`` float32; list/tuple -> ``np.array``; ndarray as is; tensor -> numpy."""
    if isinstance(size, np.ndarray):
        return size
    if isinstance(size, (numbers.Number, np.number)):
        return np.array([size, size, size], dtype=np.float32)
    if isinstance(size, (list, tuple)):
        return np.array(size)
    if isinstance(size, Tensor):
        return size.detach().cpu().numpy()
    raise ValueError(f"size must be a number, list, tuple, ndarray or tensor, got {type(size).__name__}")


def _as_vector(name: str, value, like: Tensor) -> Tensor:
    v = torch.as_tensor(to_3d_numpy(value) if not isinstance(value, Tensor) else value, device=like.device)
    v = v.to(like.dtype).reshape(-1)
    if v.numel() != like.shape[1]:
        raise ValueError(f"{name} must have {like.shape[1]} entries, got {v.numel()}")
    return v


def _cell_ids(pos: Tensor, batch: Tensor, size: Tensor, start: Tensor | None):
    """torch_cluster's mixed-radix cell id ``x + n_x·(y + n_y·(z + n_z·b))`` (batch as the slowest
    coordinate with cell size 1), evaluated in ``pos.dtype``."""
    b = batch.to(pos.dtype).reshape(-1, 1)
    coords = torch.cat([pos, b], dim=1)
    sizes = torch.cat([size, size.new_ones(1)])
    if start is None:
        origin = coords.min(0).values
    else:
        origin = torch.cat([start, start.new_zeros(1)])
    end = coords.max(0).values
    cell = torch.floor((coords - origin) / sizes).long()
    extent = torch.trunc((end - origin) / sizes).long() + 1
    ids = cell[:, 0]
    stride = torch.ones((), dtype=torch.long, device=pos.device)
    for dim in range(1, coords.shape[1]):
        stride = stride * extent[dim - 1]
        ids = ids + cell[:, dim] * stride
    return ids


def grid_sample(pos: Tensor, batch: Tensor, size, start=None, return_p2v=True, return_counts=True,
                return_unique=False):
    """Window id (dense rank of ``(batch, z, y, x)``) per point, as SparseTransformer's ``grid_sample``.

    Returns ``cluster`` alone, ``(cluster, n_max, counts)`` with ``return_p2v=False``, or
    ``(cluster, p2v_map, counts[, unique])`` with ``p2v_map (n, n_max)`` zero-padded point lists.
    """
    if not isinstance(pos, Tensor) or pos.dim() != 2 or not pos.is_floating_point():
        raise ValueError(f"pos must be a floating (N, 3) tensor, got {getattr(pos, 'shape', type(pos))}")
    if not isinstance(batch, Tensor) or batch.shape != pos.shape[:1]:
        raise ValueError(f"batch must be a tensor of shape ({pos.shape[0]},), got {getattr(batch, 'shape', None)}")
    size_t = _as_vector("size", size, pos)
    start_t = None if start is None else _as_vector("start", start, pos)
    if pos.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.long, device=pos.device)
        unique, cluster, counts = empty, empty, empty
    else:
        ids = _cell_ids(pos, batch, size_t, start_t)
        unique, cluster, counts = torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)
    if not return_p2v and not return_counts:
        return cluster
    n_max = int(counts.max()) if counts.numel() else 0
    if not return_p2v:
        return cluster, n_max, counts
    order = torch.sort(cluster, stable=True).indices
    first = torch.cumsum(counts, 0) - counts
    slot = torch.arange(order.numel(), device=pos.device) - first[cluster[order]]
    p2v_map = torch.zeros(counts.numel(), n_max, dtype=torch.long, device=pos.device)
    p2v_map[cluster[order], slot] = order
    if return_unique:
        return cluster, p2v_map, counts, unique
    return cluster, p2v_map, counts


def _windows(xyz: Tensor, batch: Tensor, window_size, shift_win: bool):
    """``(cluster, n_max, counts)`` of the (optionally half-window-shifted) windows of ``xyz``."""
    w = _as_vector("window_size", window_size, xyz)
    if shift_win:
        start = xyz.min(0).values if xyz.shape[0] else None
        return grid_sample(xyz + 0.5 * w, batch, w, start=start, return_p2v=False)
    return grid_sample(xyz, batch, w, start=None, return_p2v=False)


def get_indices_params(xyz: Tensor, batch: Tensor, window_size, shift_win: bool):
    """Windows of ``xyz`` (optionally shifted by half a window) and their pair layout.

    Returns ``(index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx)``: int32 pair arrays over
    **sorted** positions, ``sort_idx`` (int64) the stable window-major order of the points.
    """
    cluster, n_max, counts = _windows(xyz, batch, window_size, shift_win)
    sort_idx = torch.sort(cluster, stable=True).indices
    index_0_offsets, index_1_offsets, index_0, index_1 = precompute_all(xyz.shape[0], counts.shape[0], n_max,
                                                                        counts)
    return index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx


def window_partition(xyz: Tensor, batch: Tensor, window_size, shift_win: bool):
    """The same windows as :func:`get_indices_params`, as the fused path wants them: ``(sort_idx,
    window_offsets)`` with int32 ``window_offsets (W+1)`` delimiting each window in sorted order."""
    cluster, _, counts = _windows(xyz, batch, window_size, shift_win)
    sort_idx = torch.sort(cluster, stable=True).indices
    offsets = torch.zeros(counts.shape[0] + 1, dtype=torch.int32, device=xyz.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return sort_idx, offsets


def _split_func_arity(split_func) -> int:
    """4 positional args if the signature takes 4 (official), else 5 if it takes 5 (1.1.1), else 4."""
    try:
        sig = inspect.signature(split_func)
    except (TypeError, ValueError):
        return 4
    for n in (4, 5):
        try:
            sig.bind(*range(n))
            return n
        except TypeError:
            continue
    return 4


def _quantised(xyz: Tensor, window_size, quant_size, shift_win: bool) -> Tensor:
    """Each point's quantisation cell inside its window, as float32 (SparseTransformer §5.1)."""
    x = xyz.float()
    w = _as_vector("window_size", window_size, x)
    q = _as_vector("quant_size", quant_size, x)
    d = x - x.min(0).values if x.shape[0] else x
    if shift_win:
        d = d + 0.5 * w
    return torch.div(torch.remainder(d, w), q, rounding_mode="floor")


def quantised_coords(xyz: Tensor, window_size, quant_size, shift_win: bool) -> Tensor:
    """Per-point quantised coordinates (int32 ``(N, 3)``, ``xyz`` in sorted order) for the fused path's
    :class:`~sptr.ops.fused_window_attention.RelativePosition`: ``rel = c_i − c_j + (qgl − 1)`` equals
    :func:`relative_position_index` without ``split_func``."""
    return _quantised(xyz, window_size, quant_size, shift_win).int()


def relative_position_index(xyz: Tensor, index_0: Tensor, index_1: Tensor, window_size, quant_size,
                            quant_grid_length: int, shift_win: bool, split_func=None) -> Tensor:
    """Quantised relative position of each pair (SparseTransformer §5.1, bit-exact), int32 ``(M, 3)``.

    ``xyz`` in sorted order; all arithmetic in float32 with torch's remainder / floor-division semantics.
    """
    x = xyz.float()
    xq = _quantised(x, window_size, quant_size, shift_win)
    i0, i1 = index_0.long(), index_1.long()
    rel = xq[i0] - xq[i1] + (quant_grid_length - 1)
    if split_func is not None:
        args = (x, index_0, index_1, rel.clone())
        if _split_func_arity(split_func) == 5:
            args = args + (quant_grid_length,)
        rel = torch.clamp(split_func(*args), 0, 2 * quant_grid_length - 1)
    return rel.int()
