"""nuScenes-lidarseg from SphereFormer's info files (a tiny dataset in the real layout)."""
import os
import pickle

import numpy as np
import pytest
import torch

from sptr.data import NuScenesLidarSeg, collate_samples, lidar_scan
from sptr.data.labels import LabelMap

RAW = {0: 17, 8: 24, 12: 28}  # the synthetic scan's car, road, building as nuScenes' 32-class ids


def write_nuscenes(root, count=2, points=600, split="val"):
    infos = []
    for i in range(count):
        token = f"tok{i}"
        pts, cls = lidar_scan(points, seed=i)
        raw = np.array([RAW[c] for c in cls.tolist()], dtype=np.uint8)
        raw[::9] = 0                           # noise: ignored
        raw[1::13] = 2                         # human.pedestrian.adult -> pedestrian
        lidar = os.path.join("samples", "LIDAR_TOP", f"{token}.pcd.bin")
        label = os.path.join("lidarseg", "v1.0-trainval", f"{token}_lidarseg.bin")
        for rel in (lidar, label):
            os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        ring = np.zeros((points, 1), np.float32)
        np.concatenate([pts.numpy(), ring], 1).tofile(os.path.join(root, lidar))
        raw.tofile(os.path.join(root, label))
        infos.append({"lidar_path": lidar, "lidarseg_label_path": label, "token": token, "sweeps": [],
                      "ref_from_car": np.eye(4), "timestamp": 1_500_000 + i})
    with open(os.path.join(root, f"nuscenes_seg_infos_1sweeps_{split}.pkl"), "wb") as f:
        pickle.dump(infos, f)


def test_nuscenes_samples_and_labels(tmp_path):
    write_nuscenes(tmp_path)
    data = NuScenesLidarSeg(str(tmp_path), "val")
    assert len(data) == 2 and not data.train
    sample = data[0]
    raw = np.fromfile(tmp_path / "lidarseg" / "v1.0-trainval" / "tok0_lidarseg.bin", dtype=np.uint8)
    labels = sample.point_labels
    assert set(labels[raw == 0].tolist()) == {255} and set(labels[raw == 2].tolist()) == {6}
    assert set(labels[raw == 17].tolist()) == {3} and set(labels[raw == 24].tolist()) == {10}
    assert torch.equal(torch.from_numpy(LabelMap.named("nuscenes").to_raw(torch.tensor([3, 10]))).long(),
                       torch.tensor([4, 11]))  # the benchmark's ids 1..16
    batch = collate_samples([data[0], data[1]])
    assert batch["point_labels"].shape == (1200,)
    train = NuScenesLidarSeg(str(tmp_path), "train", info_files=["nuscenes_seg_infos_1sweeps_val.pkl"],
                             voxel_max=200)
    assert train.train and train[0].voxels.coords.shape[0] <= 200


def test_nuscenes_info_files_cannot_run_code(tmp_path):
    write_nuscenes(tmp_path)
    with open(tmp_path / "nuscenes_seg_infos_1sweeps_train.pkl", "wb") as f:
        pickle.dump([{"lidar_path": "x", "hook": os.system}], f)
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        NuScenesLidarSeg(str(tmp_path), "train")
    with pytest.raises(FileNotFoundError, match="nuscenes_preprocess_infos"):
        NuScenesLidarSeg(str(tmp_path / "elsewhere"), "val")
