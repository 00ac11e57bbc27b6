"""SphereFormer's training input: random-point voxelisation of each scan, then a random shift of the voxel grid."""
from __future__ import annotations

import torch

from ...data import collate_scans, voxelize_scan
from .config import SphereFormerUNetConfig
from .unet import sparse_input


def training_batch(cfg: SphereFormerUNetConfig, scans, generator: torch.Generator, device):
    """``(SparseConvTensor, xyz, batch, labels)`` of labelled scans ``[(points, labels), ...]``: one random
    point per voxel, the voxel grid shifted by 0 or 1 per axis (as SphereFormer's train.py)."""
    voxels = [voxelize_scan(points, cfg.voxel_size, cfg.pc_range, mode="random", labels=labels,
                            generator=generator) for points, labels in scans]
    feats, coords, xyz, batch, labels = (t.to(device) for t in collate_scans(voxels))
    coords = coords + (torch.rand(3, generator=generator) * 2).long().to(device)
    return sparse_input(feats, coords, batch, len(scans)), xyz, batch, labels
