"""Window assignment (SparseTransformer §3): voxel-grid window ids, the sorted pair layout, relative indices.

Self-contained re-implementation of the published ``torch_cluster.grid`` rule (no PyG / torch_cluster):
window ids are dense ranks of ``(batch, z, y, x)`` cell keys, so results equal the published ordering.
"""
from __future__ import annotations

import functools
import inspect
import numbers

import numpy as np
import torch
from torch import Tensor

from ._checks import ValueChecks, data_checks_enabled
from .step_attention import precompute_all

_ops = torch.ops.sptr


def to_3d_numpy(size, name: str = "size") -> np.ndarray:
    """Number -> ``[s, s, s]`` float32; list/tuple -> ``np.array``; ndarray as is; tensor -> numpy."""
    if isinstance(size, np.ndarray):
        return size
    if isinstance(size, (numbers.Number, np.number)):
        return np.array([size, size, size], dtype=np.float32)
    if isinstance(size, (list, tuple)):
        return np.array(size)
    if isinstance(size, Tensor):
        return size.detach().cpu().numpy()
    raise ValueError(f"{name} must be a number, list, tuple, ndarray or tensor, got {type(size).__name__}")


def _as_vector(name: str, value, like: Tensor, positive: bool = True, dtype: torch.dtype | None = None) -> Tensor:
    """``value`` as a vector of ``like.shape[1]`` entries in ``dtype`` (default ``like``'s), on ``like``'s
    device. Window and cell sizes must be
    finite and > 0: checked eagerly (a host read of the small vector), not while compiling (the layers check
    theirs when built). Numbers, lists and arrays (the layers' constant sizes) are made once per value, dtype
    and device: a dozen dispatched ops per call before, a third of a SphereFormer block's ops in its forward."""
    dtype = dtype or like.dtype
    if isinstance(value, Tensor) or torch.compiler.is_compiling():
        return _vector(name, value, like.shape[1], dtype, like.device, positive)
    array = to_3d_numpy(value, name)
    if array.dtype.kind not in "biuf" or (like.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _vector(name, array, like.shape[1], dtype, like.device, positive)  # its errors, uncached
    return _cached_vector(name, array.dtype.str, array.tobytes(), array.shape, like.shape[1], dtype, like.device,
                          positive)


@functools.lru_cache(maxsize=256)
def _cached_vector(name: str, dtype: str, data: bytes, shape: tuple, n: int, like_dtype: torch.dtype,
                   device: torch.device, positive: bool) -> Tensor:
    """_vector of an array given by its bytes (hashable). The copy to a GPU is a blocking one, made once: its
    result is then safe to read from any stream. Callers never write to the vector."""
    array = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
    v = _vector(name, array, n, like_dtype, torch.device("cpu"), positive)
    return v.to(device) if device.type != "cpu" else v


def _vector(name: str, value, n: int, dtype: torch.dtype, device: torch.device, positive: bool) -> Tensor:
    v = torch.as_tensor(to_3d_numpy(value, name) if not isinstance(value, Tensor) else value)
    if not (v.is_floating_point() or v.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        raise TypeError(f"{name} must hold real numbers, got {v.dtype}")
    v = v.reshape(-1)
    if v.numel() != n:
        raise ValueError(f"{name} must have {n} entries, got {v.numel()}")
    if not torch.compiler.is_compiling():  # before the copy to the device: numbers and arrays need no sync
        host = v.detach().to("cpu", dtype).double()  # the values as used, in the target dtype
        if not torch.isfinite(host).all() or (positive and not (host > 0).all()):
            raise ValueError(f"{name} must be {'positive and ' if positive else ''}finite, got {host.tolist()}")
    if device.type == "cuda" and not v.is_cuda and not torch.compiler.is_compiling():
        # A blocking copy from pageable memory waits for everything queued on the stream (a host sync); from
        # pinned memory the copy is queued like a kernel (the uncached path: tensors, CUDA graph capture).
        return v.to(dtype).pin_memory().to(device, non_blocking=True)
    return v.to(device, dtype)


def check_points(xyz: Tensor, batch: Tensor | None = None, name: str = "xyz") -> None:
    """``xyz`` a floating ``(N, 3)`` tensor, ``batch`` an ``(N,)`` tensor of batch indices on its device."""
    if not isinstance(xyz, Tensor) or xyz.dim() != 2 or xyz.shape[1] != 3:
        raise ValueError(f"{name} must be an (N, 3) tensor, got {getattr(xyz, 'shape', type(xyz).__name__)}")
    if not xyz.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor (metric coordinates), got {xyz.dtype}")
    if batch is None:
        return
    if not isinstance(batch, Tensor) or batch.shape != xyz.shape[:1]:
        raise ValueError(f"batch must be a tensor of shape ({xyz.shape[0]},) (one entry per point of {name}), got "
                         f"{getattr(batch, 'shape', type(batch).__name__)}")
    if batch.is_complex() or batch.dtype == torch.bool:  # floating is fine: layers carry it in xyz's dtype
        raise TypeError(f"batch must be an integer or floating tensor of batch indices, got {batch.dtype}")
    if batch.device != xyz.device:
        raise ValueError(f"batch is on {batch.device}, {name} on {xyz.device}")


@torch.library.register_fake("sptr::cart2sphere")
def _cart2sphere_fake(xyz):
    return xyz.new_empty(xyz.shape)


def cart2sphere(xyz: Tensor) -> Tensor:
    """SphereFormer's spherical coordinates (θ, β, r) of each point, in degrees and metres, ``(N, 3)`` in xyz's
    dtype: ``θ = (atan2(y, x) + π)·180/π``, ``β = atan2(√(x² + y²), z)·180/π``, ``r = √(x² + y² + z²)``, the
    published chain of torch ops to the bit (``sptr::cart2sphere``: on CUDA one kernel for float32 points;
    differentiable through those ops when ``xyz`` requires grad)."""
    check_points(xyz)
    return _ops.cart2sphere(xyz)


@torch.library.register_fake("sptr::window_cells")
def _window_cells_fake(xyz, batch, size, start, shift):
    return xyz.new_empty(xyz.shape[0], dtype=torch.long)


def _cell_ids(xyz: Tensor, batch: Tensor, size: Tensor, start: Tensor | None, shift: bool, name: str) -> Tensor:
    """torch_cluster's mixed-radix cell id ``x + n_x·(y + n_y·(z + n_z·b))`` (batch as the slowest coordinate
    with cell size 1) of the cells of ``xyz`` (moved by half a cell when ``shift``), from the origin ``start``
    or the column minima: ``sptr::window_cells``, the published arithmetic in ``xyz.dtype`` to the bit, the
    batch exactly in int64 (in fp16 scans past 2048 would share windows). Checks that the coordinates are finite
    and that the id fits int64 (coordinates near 1e30 with millimetre windows would wrap and merge cells): one
    host sync, skipped under data_checks(False) and torch.compile."""
    if data_checks_enabled() and xyz.shape[0]:
        lo, hi = xyz.double().aminmax(dim=0)
        origin = lo if start is None else start.double()
        top = hi + 0.5 * size.double() if shift else hi
        b = batch.long()
        scans = b.max() - (b.min() if start is None and not shift else 0) + 1
        windows = (torch.floor((top - origin) / size.double()).clamp(min=0) + 1).prod() * scans.double()
        ValueChecks().finite(name, xyz).require(
            f"{name} spans too many windows: the window id (windows per axis times scans) overflows int64; use "
            "larger windows or coordinates nearer the origin", windows < 2.0 ** 62).run()
    return _ops.window_cells(xyz, batch, size, start, shift)


def grid_sample(pos: Tensor, batch: Tensor, size, start=None, return_p2v=True, return_counts=True,
                return_unique=False):
    """Window id (dense rank of ``(batch, z, y, x)``) per point, as SparseTransformer's ``grid_sample``.

    Returns ``cluster`` alone, ``(cluster, n_max, counts)`` with ``return_p2v=False``, or
    ``(cluster, p2v_map, counts[, unique])`` with ``p2v_map (n, n_max)`` zero-padded point lists.
    """
    check_points(pos, batch, name="pos")
    size_t = _as_vector("size", size, pos)
    start_t = None if start is None else _as_vector("start", start, pos, positive=False)
    if pos.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.long, device=pos.device)
        unique, cluster, counts = empty, empty, empty
    else:
        ids = _cell_ids(pos, batch, size_t, start_t, False, "pos")
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


def _window_cells(xyz: Tensor, batch: Tensor, window_size, shift_win: bool) -> Tensor:
    """Each point's window cell key (optionally half-window-shifted); ascending keys are SparseTransformer's
    window order (``grid_sample``'s dense ranks)."""
    check_points(xyz, batch)
    return _cell_ids(xyz, batch, _as_vector("window_size", window_size, xyz), None, shift_win, "xyz")


@torch.library.register_fake("sptr::window_sort")
def _window_sort_fake(cells):
    num_offsets = torch.library.get_ctx().new_dynamic_size(min=1)  # W + 1 (the symbol must be the size itself)
    return cells.new_empty(cells.shape), cells.new_empty(num_offsets, dtype=torch.int32)


def get_indices_params(xyz: Tensor, batch: Tensor, window_size, shift_win: bool):
    """Windows of ``xyz`` (optionally shifted by half a window) and their pair layout.

    Returns ``(index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx)``: int32 pair arrays over
    **sorted** positions, ``sort_idx`` (int64) the stable window-major order of the points.
    """
    cells = _window_cells(xyz, batch, window_size, shift_win)
    cluster, counts = torch.unique(cells, sorted=True, return_inverse=True, return_counts=True)[1:]
    n_max = int(counts.max()) if counts.numel() else 0
    sort_idx = torch.sort(cluster, stable=True).indices
    index_0_offsets, index_1_offsets, index_0, index_1 = precompute_all(xyz.shape[0], counts.shape[0], n_max,
                                                                        counts)
    return index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx


def window_partition(xyz: Tensor, batch: Tensor, window_size, shift_win: bool):
    """The same windows as :func:`get_indices_params`, as the fused path wants them: ``(sort_idx,
    window_offsets)`` with int32 ``window_offsets (W+1)`` delimiting each window in sorted order. The window
    count W is never read on the host (under torch.compile it is a data-dependent size); the only host sync is
    the finite-coordinates check, skipped under ``data_checks(False)`` and torch.compile."""
    return _ops.window_sort(_window_cells(xyz, batch, window_size, shift_win))


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


@torch.library.register_fake("sptr::window_quantised_coords")
def _window_quantised_coords_fake(xyz, order, window_size, quant_size, shift):
    return xyz.new_empty(xyz.shape[0], 3, dtype=torch.int32)


def quantised_coords(xyz: Tensor, window_size, quant_size, shift_win: bool, order: Tensor | None = None) -> Tensor:
    """Each point's quantisation cell inside its window (SparseTransformer §5.1), int32 ``(N, 3)`` in window
    order: ``xyz`` in sorted order, or in any order with ``order`` its window order (row ``j`` is point
    ``order[j]``). ``sptr::window_quantised_coords``: ``floor(remainder(x − min x [+ w/2], w) / q)`` in float32
    with torch's remainder and floor division, to the bit. For the fused path's
    :class:`~sptr.ops.fused_window_attention.RelativePosition`: ``rel = c_i − c_j + (qgl − 1)`` equals
    :func:`relative_position_index` without ``split_func``."""
    check_points(xyz)
    ValueChecks().finite("xyz", xyz).run()  # NaN would become INT_MIN cells
    w = _as_vector("window_size", window_size, xyz, dtype=torch.float32)
    q = _as_vector("quant_size", quant_size, xyz, dtype=torch.float32)
    return _ops.window_quantised_coords(xyz, order, w, q, shift_win)


def relative_position_index(xyz: Tensor, index_0: Tensor, index_1: Tensor, window_size, quant_size,
                            quant_grid_length: int, shift_win: bool, split_func=None) -> Tensor:
    """Quantised relative position of each pair (SparseTransformer §5.1, bit-exact), int32 ``(M, 3)``.

    ``xyz`` in sorted order; all arithmetic in float32 with torch's remainder / floor-division semantics.
    """
    x = xyz.float()
    xq = quantised_coords(x, window_size, quant_size, shift_win).float()  # float, as split_func gets rel
    i0, i1 = index_0.long(), index_1.long()
    rel = xq[i0] - xq[i1] + (quant_grid_length - 1)
    if split_func is not None:
        args = (x, index_0, index_1, rel.clone())
        if _split_func_arity(split_func) == 5:
            args = args + (quant_grid_length,)
        rel = torch.clamp(split_func(*args), 0, 2 * quant_grid_length - 1)
    return rel.int()
