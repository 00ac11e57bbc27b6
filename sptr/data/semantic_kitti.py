"""SemanticKITTI as SphereFormer trains and evaluates on it: ``root/sequences/XX/velodyne/N.bin`` scans with
``root/sequences/XX/labels/N.label`` labels, the standard split (configs/labels/semantickitti.yaml), SphereFormer's
training augmentations and voxelisation, and a DataLoader collate."""
from __future__ import annotations

import dataclasses
import glob
import math
import os

import numpy as np
import torch
import yaml

from .labels import LABEL_MAPS, LabelMap
from .voxelize import VoxelScan, read_kitti_bin, voxelize_scan

SPLITS = ("train", "val", "test", "trainval")


def split_sequences(split: str, dataset: str = "semantickitti") -> list[int]:
    """The sequences of a split (train, val, test, or trainval), from the label map file."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    with open(os.path.join(LABEL_MAPS, f"{dataset}.yaml")) as f:
        table = yaml.safe_load(f)["split"]
    return table["train"] + table["val"] if split == "trainval" else table[split]


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


class SemanticKITTI(torch.utils.data.Dataset):
    """Scans of a split of ``root`` (the folder holding ``sequences/``). ``train=True`` (default for the train
    splits): augmented, one random point per voxel, at most ``voxel_max`` voxels, labels per voxel. Otherwise
    every point is kept (voxel means) with ``point_to_voxel`` and the per-point labels (none for test).
    Labels are the network's classes (``LabelMap.to_classes``: ignored ids are ``ignore_label``)."""

    def __init__(self, root: str, split: str = "train", voxel_size=(0.05, 0.05, 0.05), pc_range=None,
                 voxel_max: int | None = None, train: bool | None = None, augment: SphereFormerAugment | None = None,
                 ignore_label: int = 255, seed: int = 0):
        if not os.path.isdir(os.path.join(root, "sequences")):
            raise FileNotFoundError(f"{root!r} has no sequences/ folder (give the SemanticKITTI dataset root)")
        self.split, self.ignore_label = split, ignore_label
        self.label_map = LabelMap.named("semantickitti")
        self.files = []
        for seq in split_sequences(split):
            self.files += sorted(glob.glob(os.path.join(root, "sequences", f"{seq:02d}", "velodyne", "*.bin")))
        if not self.files:
            raise FileNotFoundError(f"no scan of split {split!r} under {root!r}/sequences")
        self.train = split in ("train", "trainval") if train is None else train
        self.augment = (augment or SphereFormerAugment()) if self.train else augment
        self.voxel_size, self.pc_range, self.voxel_max, self.seed = voxel_size, pc_range, voxel_max, seed
        self.epoch = 0

    @classmethod
    def from_config(cls, root: str, cfg, split: str = "train", voxel_max: int | None = 120_000, **kwargs):
        """With a SphereFormerUNetConfig's voxel size and range (and SphereFormer's voxel_max for training)."""
        return cls(root, split, cfg.voxel_size, cfg.pc_range, voxel_max, ignore_label=cfg.ignore_label, **kwargs)

    def __len__(self) -> int:
        return len(self.files)

    def labels_of(self, index: int) -> torch.Tensor | None:
        path = self.files[index].replace(f"{os.sep}velodyne{os.sep}", f"{os.sep}labels{os.sep}")[:-3] + "label"
        if not os.path.isfile(path):
            if self.split == "test":
                return None
            raise FileNotFoundError(f"{path!r} is missing (labels of {self.files[index]!r})")
        raw = torch.from_numpy(np.fromfile(path, dtype=np.uint32).astype(np.int64))
        return self.label_map.to_classes(raw, self.ignore_label)

    def __getitem__(self, index: int) -> LidarSample:
        path = self.files[index]
        points = read_kitti_bin(path)
        labels = self.labels_of(index)
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
