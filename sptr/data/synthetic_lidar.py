"""A synthetic LiDAR-like scene: a 64-beam scan of ground, walls and boxes (no data download)."""
import math

import torch

# SemanticKITTI's 19-class indices of what the synthetic scene holds (0 car, 8 road, 12 building).
CAR, ROAD, BUILDING = 0, 8, 12


def _scan(rays: int, gen: torch.Generator):
    """Points (R, 3) of one scan, each ray's first hit, and its surface class (ROAD / BUILDING / CAR)."""
    beams = torch.linspace(-25.0, 3.0, 64) * math.pi / 180
    azimuth = torch.rand(rays, generator=gen) * 2 * math.pi
    elev = beams[torch.randint(0, 64, azimuth.shape, generator=gen)]
    dirs = torch.stack([elev.cos() * azimuth.cos(), elev.cos() * azimuth.sin(), elev.sin()], 1)
    # ground at z = -1.7, a ring of walls at 30-60 m, boxes scattered: range = first hit
    r_ground = torch.where(dirs[:, 2] < -1e-3, -1.7 / dirs[:, 2], torch.full_like(dirs[:, 2], 1e9))
    wall = 30 + 30 * torch.rand(1, generator=gen)
    r = torch.minimum(r_ground, torch.full_like(r_ground, float(wall)))
    label = torch.where(r_ground <= float(wall), ROAD, BUILDING)
    boxes = torch.rand(200, 3, generator=gen) * torch.tensor([80.0, 80.0, 2.0]) - torch.tensor([40.0, 40.0, 1.7])
    pts = dirs * r[:, None]
    near = torch.cdist(pts[:, :2], boxes[:, :2]).min(1)
    hit = near.values < 1.5
    pts[hit] = pts[hit] * (1 - 0.1 * torch.rand(int(hit.sum()), 1, generator=gen))
    label[hit] = CAR
    return pts + 0.02 * torch.randn(pts.shape, generator=gen), label


def lidar_voxels(target=270_000, voxel=0.05, batch=1, seed=0):
    """Unique voxel centres (N, 3) float32 and batch ids (N,), about `target` voxels per batch element."""
    gen = torch.Generator().manual_seed(seed)
    xyz_all, batch_all = [], []
    for b in range(batch):
        pts, _ = _scan(2048 * 64 * 4, gen)
        cells = torch.unique(torch.floor(pts / voxel).long(), dim=0)
        cells = cells[torch.randperm(cells.shape[0], generator=gen)[:target]]
        xyz_all.append((cells.float() + 0.5) * voxel)
        batch_all.append(torch.full((cells.shape[0],), b, dtype=torch.long))
    return torch.cat(xyz_all), torch.cat(batch_all)


def lidar_scan(num_points=120_000, seed=0):
    """One KITTI-format scan: points (N, 4) float32 (x, y, z, intensity in [0, 1]) and per-point SemanticKITTI
    labels (N,) int64 (road, building, car), what a ``.bin`` / ``.label`` pair holds."""
    gen = torch.Generator().manual_seed(seed)
    pts, label = _scan(num_points, gen)
    # intensity: dim far returns, cars brighter than road and walls
    intensity = (1.0 / (1.0 + 0.05 * pts.norm(dim=1)) + 0.3 * (label == CAR)).clamp(0, 1)
    intensity = (intensity + 0.05 * torch.rand(num_points, generator=gen)).clamp(0, 1)
    return torch.cat([pts, intensity[:, None]], 1).float(), label
