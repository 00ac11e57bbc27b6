"""Per-point predictions of a SphereFormer U-Net on raw scans (SphereFormer's validation rule: voxel means)."""
from __future__ import annotations

import torch

from ...data.voxelize import collate_scans, voxelize_scan
from .unet import SphereFormerUNet, sparse_input


@torch.no_grad()
def predict_scans(model: SphereFormerUNet, scans: list[torch.Tensor]) -> list[torch.Tensor]:
    """Labels (N_i,) int64 for each scan ``(N_i, in_channels)`` (x, y, z, intensity, ...), on the model's
    device: each scan voxelised with the model's voxel size and pc_range, one batched forward, each voxel's
    argmax given to all of its points."""
    cfg = model.cfg
    device = next(model.parameters()).device
    for i, points in enumerate(scans):
        if points.dim() != 2 or points.shape[1] != cfg.in_channels:
            raise ValueError(f"scans[{i}] must be (N, in_channels={cfg.in_channels}), got {tuple(points.shape)}")
        if points.shape[0] == 0:  # spconv fails on an empty tensor with an internal assertion
            raise ValueError(f"scans[{i}] holds no point")
    voxels = [voxelize_scan(p.to(device), cfg.voxel_size, cfg.pc_range, mode="mean") for p in scans]
    feats, coords, xyz, batch, _ = collate_scans(voxels)
    logits = model(sparse_input(feats, coords, batch, len(scans)), xyz, batch)
    voxel_labels = logits.argmax(1).split([v.coords.shape[0] for v in voxels])
    return [labels[v.point_to_voxel] for labels, v in zip(voxel_labels, voxels)]
