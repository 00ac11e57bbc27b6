"""SemanticKITTI as SphereFormer trains and evaluates on it: ``root/sequences/XX/velodyne/N.bin`` scans with
``root/sequences/XX/labels/N.label`` labels and the standard split (configs/labels/semantickitti.yaml)."""
from __future__ import annotations

import glob
import os

import numpy as np
import torch

from .labels import LabelMap, label_map_data
from .lidar_segmentation import LidarSegmentation
from .voxelize import read_kitti_bin

SPLITS = ("train", "val", "test", "trainval")


def split_sequences(split: str, dataset: str = "semantickitti") -> list[int]:
    """The sequences of a split (train, val, test, or trainval), from the label map file."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    table = label_map_data(dataset)["split"]
    return table["train"] + table["val"] if split == "trainval" else table[split]


class SemanticKITTI(LidarSegmentation):
    """Scans of a split of ``root`` (the folder holding ``sequences/``); see :class:`LidarSegmentation` for the
    training and evaluation forms."""

    def __init__(self, root: str, split: str = "train", **kwargs):
        if not os.path.isdir(os.path.join(root, "sequences")):
            raise FileNotFoundError(f"{root!r} has no sequences/ folder (give the SemanticKITTI dataset root)")
        self.label_map = LabelMap.named("semantickitti")
        self.files = []
        for seq in split_sequences(split):
            self.files += sorted(glob.glob(os.path.join(root, "sequences", f"{seq:02d}", "velodyne", "*.bin")))
        if not self.files:
            raise FileNotFoundError(f"no scan of split {split!r} under {root!r}/sequences")
        super().__init__(split, **kwargs)

    def read(self, index: int):
        path = self.files[index]
        labels = path.replace(f"{os.sep}velodyne{os.sep}", f"{os.sep}labels{os.sep}")[:-3] + "label"
        if not os.path.isfile(labels):
            if self.split == "test":
                return read_kitti_bin(path), None
            raise FileNotFoundError(f"{labels!r} is missing (labels of {path!r})")
        return read_kitti_bin(path), torch.from_numpy(np.fromfile(labels, dtype=np.uint32).astype(np.int64))
