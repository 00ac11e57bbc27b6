"""What SphereFormer's LiDAR segmentation datasets share: its training augmentations, the voxelisation of a scan
for training or evaluation, and a DataLoader collate."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .labels import LabelMap
from .voxelize import VoxelScan, voxelize_scan


@dataclasses.dataclass(frozen=True)
class SphereFormerAugment:
    """SphereFormer's training augmentations of SemanticKITTI, in its order: a rotation about z by a uniform
    angle, a flip of x, y, both or neither, a scale of x and y from ``scale``, a normal translation of xyz."""

    rotate: bool = True
    flip: bool = True
    scale: tuple | None = (0.95, 1.05)
    translate_std: tuple | None = (0.1, 0.1, 0.1)

    def __call__(self, points: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        points = points.clone()
        xy = points[:, :2]
        if self.rotate:
            angle = math.radians(float(torch.rand((), generator=generator)) * 360) - math.pi
            c, s = math.cos(angle), math.sin(angle)
            points[:, :2] = xy @ torch.tensor([[c, s], [-s, c]], dtype=points.dtype)
        if self.flip:
            kind = int(torch.randint(4, (), generator=generator))
            if kind in (1, 3):
                points[:, 0] = -points[:, 0]
            if kind in (2, 3):
                points[:, 1] = -points[:, 1]
        if self.scale is not None:
            low, high = self.scale
            points[:, :2] *= low + (high - low) * float(torch.rand((), generator=generator))
        if self.translate_std is not None:
            points[:, :3] += torch.randn(3, generator=generator, dtype=points.dtype) * torch.tensor(
                self.translate_std, dtype=points.dtype)
        return points


@dataclasses.dataclass
class LidarSample:
    voxels: VoxelScan                 # the scan's voxels (labels per voxel when training)
    point_labels: torch.Tensor | None  # (N,) classes of every point (evaluation splits with labels), else None
    path: str


class LidarSegmentation(torch.utils.data.Dataset):
    """A labelled scan dataset as SphereFormer reads it. Subclasses give ``files`` (one entry per scan),
    ``label_map`` and ``read(index) -> (points (N, 4) x, y, z, intensity; raw label ids (N,) or None)``.
    ``train=True``: augmented, one random point per voxel, at most ``voxel_max`` voxels, labels per voxel.
    Otherwise every point is kept (voxel means) with ``point_to_voxel`` and the per-point labels (None without
    labels). Labels are the network's classes (``LabelMap.to_classes``: ignored ids are ``ignore_label``)."""

    files: list
    label_map: LabelMap

    def __init__(self, split: str, voxel_size=(0.05, 0.05, 0.05), pc_range=None, voxel_max: int | None = None,
                 train: bool | None = None, augment: SphereFormerAugment | None = None, ignore_label: int = 255,
                 seed: int = 0):
        self.split, self.ignore_label = split, ignore_label
        self.train = split in ("train", "trainval") if train is None else train
        self.augment = (augment or SphereFormerAugment()) if self.train else augment
        self.voxel_size, self.pc_range, self.voxel_max, self.seed = voxel_size, pc_range, voxel_max, seed
        self.epoch = 0

    @classmethod
    def from_config(cls, root: str, cfg, split: str = "train", voxel_max: int | None = 120_000, **kwargs):
        """With a SphereFormerUNetConfig's voxel size and range (and SphereFormer's voxel_max for training)."""
        return cls(root, split, voxel_size=cfg.voxel_size, pc_range=cfg.pc_range, voxel_max=voxel_max,
                   ignore_label=cfg.ignore_label, **kwargs)

    def __len__(self) -> int:
        return len(self.files)

    def read(self, index: int):
        raise NotImplementedError(f"{type(self).__name__} must read its scans")

    def __getitem__(self, index: int) -> LidarSample:
        path = str(self.files[index])
        points, raw = self.read(index)
        labels = None if raw is None else self.label_map.to_classes(raw, self.ignore_label)
        if labels is not None and labels.shape[0] != points.shape[0]:
            raise ValueError(f"{path!r} holds {points.shape[0]} points but its labels {labels.shape[0]}")
        if points.shape[0] == 0:
            raise ValueError(f"{path!r} holds no point")
        # One generator per (seed, epoch, scan): the same sample in any worker and any order.
        generator = torch.Generator().manual_seed(hash((self.seed, self.epoch, index)) & 0x7FFFFFFF)
        if self.augment is not None:
            points = self.augment(points, generator)
        if self.train:
            voxels = voxelize_scan(points, self.voxel_size, self.pc_range, mode="random", labels=labels,
                                   voxel_max=self.voxel_max, generator=generator)
            return LidarSample(voxels, None, path)
        voxels = voxelize_scan(points, self.voxel_size, self.pc_range, mode="mean")
        return LidarSample(voxels, labels, path)


def collate_samples(samples: list[LidarSample]) -> dict:
    """One batch of samples: ``feats, coords, xyz, batch`` over all voxels, ``labels`` per voxel (training),
    ``point_to_voxel`` into the batch's voxels and ``point_labels`` (evaluation), ``paths``."""
    if not samples:
        raise ValueError("collate_samples needs at least one sample")
    v = [s.voxels for s in samples]
    out = {"feats": torch.cat([x.feats for x in v]), "coords": torch.cat([x.coords for x in v]),
           "xyz": torch.cat([x.xyz for x in v]),
           "batch": torch.cat([torch.full((x.coords.shape[0],), i, dtype=torch.long) for i, x in enumerate(v)]),
           "labels": None if any(x.labels is None for x in v) else torch.cat([x.labels for x in v]),
           "paths": [s.path for s in samples]}
    if all(x.point_to_voxel is not None for x in v):
        starts = np.cumsum([0] + [x.coords.shape[0] for x in v[:-1]])
        out["point_to_voxel"] = torch.cat([x.point_to_voxel + int(o) for x, o in zip(v, starts)])
        out["points_per_scan"] = [x.point_to_voxel.shape[0] for x in v]
        out["point_labels"] = (None if any(s.point_labels is None for s in samples)
                               else torch.cat([s.point_labels for s in samples]))
    return out
