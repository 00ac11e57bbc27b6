"""nuScenes-lidarseg as SphereFormer reads it: the info files its ``data/nuscenes_preprocess_infos.py`` writes
(``nuscenes_seg_infos_1sweeps_{train,val}.pkl``: per sample ``lidar_path`` and ``lidarseg_label_path``, relative
to the dataset root), ``.pcd.bin`` scans of float32 (x, y, z, intensity, ring), uint8 labels of the 32 classes."""
from __future__ import annotations

import os
import pickle

import numpy as np
import torch

from .labels import LabelMap
from .lidar_segmentation import LidarSegmentation

INFO_FILES = {"train": ["nuscenes_seg_infos_1sweeps_train.pkl"], "val": ["nuscenes_seg_infos_1sweeps_val.pkl"],
              "trainval": ["nuscenes_seg_infos_1sweeps_train.pkl", "nuscenes_seg_infos_1sweeps_val.pkl"],
              "test": ["nuscenes_seg_infos_1sweeps_test.pkl"]}


class _InfoUnpickler(pickle.Unpickler):
    """The info files hold dicts, lists, strings, numbers and numpy arrays: numpy's array and scalar
    constructors are the only globals allowed, so a pickle cannot run other code."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "ndarray"),
               ("numpy", "dtype")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or (module == "numpy.dtypes" and name.endswith("DType")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"info file: {module}.{name} is not allowed (only numpy arrays and scalars)")


def read_infos(path: str) -> list[dict]:
    with open(path, "rb") as f:
        infos = _InfoUnpickler(f).load()
    if not isinstance(infos, list) or not all(isinstance(i, dict) and "lidar_path" in i for i in infos):
        raise ValueError(f"{path!r} is not a list of sample infos with 'lidar_path'")
    return infos


class NuScenesLidarSeg(LidarSegmentation):
    """Samples of the info files of a split under ``root`` (or ``info_files`` given); see
    :class:`LidarSegmentation` for the training and evaluation forms."""

    def __init__(self, root: str, split: str = "train", info_files: list[str] | None = None, **kwargs):
        if split not in INFO_FILES:
            raise ValueError(f"split must be one of {sorted(INFO_FILES)}, got {split!r}")
        self.root = root
        self.label_map = LabelMap.named("nuscenes")
        self.infos = []
        for name in info_files or INFO_FILES[split]:
            path = name if os.path.isabs(name) else os.path.join(root, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path!r} is missing: write the info files with SphereFormer's "
                                        "data/nuscenes_preprocess_infos.py, or give info_files")
            self.infos += read_infos(path)
        self.files = [os.path.join(root, str(i["lidar_path"])) for i in self.infos]
        super().__init__(split, **kwargs)

    def read(self, index: int):
        info = self.infos[index]
        data = np.fromfile(self.files[index], dtype=np.float32)
        if data.size % 5:
            raise ValueError(f"{self.files[index]!r}: a nuScenes .pcd.bin holds 5 float32 per point "
                             f"(x, y, z, intensity, ring); {data.size} floats is not a multiple of 5")
        points = torch.from_numpy(data.reshape(-1, 5)[:, :4].copy())
        label_path = info.get("lidarseg_label_path")
        if self.split == "test" or label_path is None:
            return points, None
        raw = np.fromfile(os.path.join(self.root, str(label_path)), dtype=np.uint8).astype(np.int64)
        return points, torch.from_numpy(raw)
