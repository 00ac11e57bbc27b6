"""SphereFormer's scan preprocessing: clip to pc_range, voxelise, batch; KITTI ``.bin`` / ``.label`` files.

``mode="mean"`` is SphereFormer's validation/inference rule (every point kept, voxel features and coordinates
are the means of their points, ``point_to_voxel`` maps predictions back); ``mode="random"`` its training rule
(one random point per voxel, then at most ``voxel_max`` voxels nearest to a random point). Voxels come in
lexicographic order of their cells (SphereFormer sorts them by an FNV hash; the order changes nothing else).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..ops.scatter import scatter_mean


@dataclasses.dataclass
class VoxelScan:
    coords: torch.Tensor          # (V, 3) int64 voxel cells, from the scan's clipped minimum
    xyz: torch.Tensor             # (V, 3) float32 metric coordinates (clipped)
    feats: torch.Tensor           # (V, C) float32 point features (x, y, z, intensity: unclipped)
    labels: torch.Tensor | None   # (V,) labels of the kept points ("random"), or None ("mean")
    point_to_voxel: torch.Tensor | None  # (N,) voxel of every input point ("mean"), or None


def read_kitti_bin(path: str) -> torch.Tensor:
    """A KITTI velodyne scan: float32 (x, y, z, intensity) rows."""
    data = np.fromfile(path, dtype=np.float32)
    if data.size % 4:
        raise ValueError(f"{path!r}: a KITTI .bin holds float32 x, y, z, intensity rows; {data.size} floats "
                         "is not a multiple of 4")
    return torch.from_numpy(data.reshape(-1, 4).copy())


def write_kitti_label(path: str, labels: torch.Tensor) -> None:
    """Per-point labels as SemanticKITTI's ``.label``: uint32 (instance id 0 in the upper 16 bits)."""
    labels.detach().cpu().numpy().astype(np.uint32).tofile(path)


def voxelize_scan(points: torch.Tensor, voxel_size=(0.05, 0.05, 0.05), pc_range=None, mode: str = "mean",
                  labels: torch.Tensor | None = None, voxel_max: int | None = None,
                  generator: torch.Generator | None = None) -> VoxelScan:
    """Voxelise one scan ``points (N, C >= 3)`` (xyz first) as SphereFormer's data pipeline does."""
    if points.dim() != 2 or points.shape[1] < 3 or not points.is_floating_point():
        raise ValueError(f"points must be a floating (N, C >= 3) tensor with xyz first, got "
                         f"{points.dtype} {tuple(points.shape)}")
    if mode not in ("mean", "random"):
        raise ValueError(f"mode must be 'mean' (inference) or 'random' (training), got {mode!r}")
    if labels is not None and labels.shape != (points.shape[0],):
        raise ValueError(f"labels must be (N,) = ({points.shape[0]},), got {tuple(labels.shape)}")
    points = points.float()
    if not bool(torch.isfinite(points[:, :3]).all()):
        raise ValueError("points hold non-finite coordinates (NaN or inf): they belong to no voxel")
    feats = points
    xyz = points[:, :3]
    if pc_range is not None:
        low, high = (torch.tensor(r, dtype=torch.float32, device=points.device) for r in pc_range)
        xyz = torch.minimum(torch.maximum(xyz, low), high)
    voxel = torch.tensor(np.array(voxel_size, np.float32), device=points.device)
    if points.shape[0] == 0:
        empty = torch.zeros(0, 3, dtype=torch.long, device=points.device)
        return VoxelScan(empty, xyz, feats, None if mode == "mean" else labels,
                         torch.zeros(0, dtype=torch.long, device=points.device) if mode == "mean" else None)
    xyz_norm = xyz - xyz.min(0).values
    cells = torch.floor(xyz_norm / voxel).long()
    inverse, num = _voxel_of_cells(cells)
    if mode == "mean":
        coords = torch.floor(scatter_mean(xyz_norm, inverse, num) / voxel).long()
        return VoxelScan(coords, scatter_mean(xyz, inverse, num), scatter_mean(feats, inverse, num), None, inverse)
    # one random point per voxel: the first of its points in a random order
    shuffled = torch.randperm(points.shape[0], generator=generator, device=points.device)
    chosen = shuffled[_first_per_group(inverse[shuffled])]
    if voxel_max is not None and chosen.numel() > voxel_max:
        centre = xyz[chosen[torch.randint(chosen.numel(), (1,), generator=generator, device=points.device)]]
        nearest = torch.argsort((xyz[chosen] - centre).square().sum(1), stable=True)[:voxel_max]
        chosen = chosen[nearest]
    return VoxelScan(cells[chosen], xyz[chosen], feats[chosen], None if labels is None else labels[chosen], None)


def _voxel_of_cells(cells: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each point's voxel (the rank of its cell among the occupied cells, lexicographic) and the voxel count, for
    cells >= 0. Where the cells' extents allow, each cell is one int64 key in lexicographic order: torch.unique
    of keys gives the same ranks as of rows (dim=0), which on the CPU sorts rows ~15x slower."""
    extent = [int(e) + 1 for e in cells.max(0).values.tolist()]
    if extent[0] * extent[1] * extent[2] < 2**62:
        key = (cells[:, 0] * extent[1] + cells[:, 1]) * extent[2] + cells[:, 2]
        occupied, inverse = torch.unique(key, return_inverse=True)
    else:
        occupied, inverse = torch.unique(cells, dim=0, return_inverse=True)
    return inverse, occupied.shape[0]


def _first_per_group(group: torch.Tensor) -> torch.Tensor:
    """Positions of the first occurrence of every value of ``group``, in increasing value."""
    order = torch.argsort(group, stable=True)
    first = torch.ones_like(order, dtype=torch.bool)
    first[1:] = group[order][1:] != group[order][:-1]
    return order[first]


def collate_scans(scans: list[VoxelScan]):
    """One batch: ``feats, coords, xyz, batch, labels`` concatenated (labels None if any scan has none)."""
    if not scans:
        raise ValueError("collate_scans needs at least one scan")
    batch = torch.cat([torch.full((s.coords.shape[0],), i, dtype=torch.long, device=s.coords.device)
                       for i, s in enumerate(scans)])
    labels = None if any(s.labels is None for s in scans) else torch.cat([s.labels for s in scans])
    return (torch.cat([s.feats for s in scans]), torch.cat([s.coords for s in scans]),
            torch.cat([s.xyz for s in scans]), batch, labels)
