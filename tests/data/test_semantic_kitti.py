"""SemanticKITTI on disk (a tiny dataset in the real layout), label maps, metrics and the evaluation entry point."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sptr.data import lidar_scan
from sptr.data.labels import LabelMap
from sptr.data.metrics import SegmentationMetrics, confusion_matrix
from sptr.data.lidar_segmentation import SphereFormerAugment, collate_samples
from sptr.data.semantic_kitti import SemanticKITTI, split_sequences

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAW = {0: 10, 8: 40, 12: 50}  # the synthetic scan's classes (car, road, building) as raw SemanticKITTI ids


def write_dataset(root, scans=(("00", 2), ("08", 1)), points=900):
    """``root/sequences/XX/{velodyne,labels}/NNNNNN.{bin,label}``; raw ids with instance bits, some unlabeled."""
    for seq, count in scans:
        for d in ("velodyne", "labels"):
            os.makedirs(os.path.join(root, "sequences", seq, d), exist_ok=True)
        for i in range(count):
            pts, cls = lidar_scan(points, seed=int(seq) * 10 + i)
            raw = np.array([RAW[c] for c in cls.tolist()], dtype=np.uint32)
            raw[::7] = 0                                   # unlabeled
            raw[1::11] = np.where(raw[1::11] == 10, 252, raw[1::11])  # moving car -> car
            raw |= np.uint32(3 << 16)                      # an instance id in the upper bits
            pts.numpy().tofile(os.path.join(root, "sequences", seq, "velodyne", f"{i:06d}.bin"))
            raw.tofile(os.path.join(root, "sequences", seq, "labels", f"{i:06d}.label"))


def test_splits_and_labels(tmp_path):
    write_dataset(tmp_path)
    assert split_sequences("val") == [8] and 8 not in split_sequences("train") and split_sequences("test")[0] == 11
    val = SemanticKITTI(str(tmp_path), "val")
    assert not val.train and [os.path.basename(f) for f in val.files] == ["000000.bin"]
    train = SemanticKITTI(str(tmp_path), "train", voxel_max=300)
    assert train.train and len(train) == 2
    sample = val[0]
    labels = sample.point_labels
    raw = np.fromfile(val.files[0].replace("velodyne", "labels")[:-3] + "label", dtype=np.uint32) & 0xFFFF
    assert torch.equal(labels[raw == 0], torch.full_like(labels[raw == 0], 255))
    assert set(labels[raw == 40].tolist()) == {8} and set(labels[(raw == 252) | (raw == 10)].tolist()) == {0}
    assert sample.voxels.point_to_voxel.shape == labels.shape
    t = train[1]
    assert t.voxels.coords.shape[0] <= 300 and t.voxels.labels.shape[0] == t.voxels.coords.shape[0]
    again = train[1]  # the same (seed, epoch, scan): the same sample
    assert torch.equal(t.voxels.coords, again.voxels.coords) and torch.equal(t.voxels.labels, again.voxels.labels)
    with pytest.raises(FileNotFoundError, match="sequences"):
        SemanticKITTI(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="split"):
        SemanticKITTI(str(tmp_path), "holdout")


def test_collate_offsets_the_point_to_voxel_maps(tmp_path):
    write_dataset(tmp_path, (("08", 2),))
    val = SemanticKITTI(str(tmp_path), "val")
    a, b = val[0], val[1]
    batch = collate_samples([a, b])
    na = a.voxels.coords.shape[0]
    assert torch.equal(batch["point_to_voxel"], torch.cat([a.voxels.point_to_voxel, b.voxels.point_to_voxel + na]))
    assert batch["batch"].tolist() == [0] * na + [1] * b.voxels.coords.shape[0]
    assert torch.equal(batch["point_labels"], torch.cat([a.point_labels, b.point_labels]))
    loader = torch.utils.data.DataLoader(val, batch_size=2, collate_fn=collate_samples, num_workers=1)
    assert torch.equal(next(iter(loader))["coords"], batch["coords"])


def test_augmentation_is_sphereformers():
    points = torch.randn(50, 4) * 10
    g = torch.Generator().manual_seed(3)
    out = SphereFormerAugment(rotate=True, flip=True, scale=None, translate_std=None)(points, g)
    assert torch.allclose(out[:, :2].norm(dim=1), points[:, :2].norm(dim=1), atol=1e-4)  # rotations and flips
    assert torch.equal(out[:, 2:], points[:, 2:])
    scaled = SphereFormerAugment(rotate=False, flip=False, scale=(2.0, 2.0), translate_std=None)(points, g)
    assert torch.allclose(scaled[:, :2], 2 * points[:, :2]) and torch.equal(scaled[:, 2:], points[:, 2:])


def test_metrics_against_a_hand_computed_confusion_matrix(tmp_path):
    pred = torch.tensor([0, 1, 1, 2, 2, 2, 0])
    target = torch.tensor([0, 1, 2, 2, 255, 2, 1])
    assert confusion_matrix(pred, target, 3).tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 2]]
    m = SegmentationMetrics(3, names=["a", "b", "c"])
    m.update(pred[:4], target[:4])
    m.update(pred[4:], target[4:])
    assert torch.allclose(m.iou(), torch.tensor([1 / 2, 1 / 3, 2 / 3], dtype=torch.float64))
    assert m.miou() == pytest.approx(0.5) and m.accuracy() == pytest.approx(4 / 6)
    m.write(str(tmp_path / "s.json"))
    assert json.load(open(tmp_path / "s.json"))["miou"] == pytest.approx(0.5)
    m.write(str(tmp_path / "s.csv"))
    assert open(tmp_path / "s.csv").read().splitlines()[1].startswith("a,0.5")
    absent = SegmentationMetrics(3)
    absent.update(torch.tensor([0, 0]), torch.tensor([0, 1]))
    assert torch.isnan(absent.iou()[2]) and absent.miou() == pytest.approx((1 / 2 + 0) / 2)
    with pytest.raises(ValueError, match="target holds classes"):
        confusion_matrix(torch.tensor([0]), torch.tensor([7]), 3)


def test_label_map_checks():
    table = LabelMap.named("semantickitti")
    assert table.num_classes == 19 and table.names[0] == "car"
    with pytest.raises(ValueError, match="no label map"):
        LabelMap.named("kitti360")


def test_evaluation_entry_point(tmp_path):
    pytest.importorskip("spconv", reason="the SphereFormer U-Net needs spconv")
    from sptr.models.sphereformer import SphereFormerUNet, SphereFormerUNetConfig, save_pretrained

    write_dataset(tmp_path / "kitti", (("08", 2),), points=700)
    config = os.path.join(ROOT, "configs", "sphereformer_semantickitti.yaml")
    weights, _ = save_pretrained(SphereFormerUNet(SphereFormerUNetConfig.from_yaml(config)), str(tmp_path / "ckpt"))
    run = subprocess.run([sys.executable, "-m", "sptr.models.sphereformer.evaluate", "--config", config,
                          "--checkpoint", weights, "--data-root", str(tmp_path / "kitti"), "--output",
                          str(tmp_path / "scores.json"), "--device", "cpu"], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "mIoU" in run.stdout and "road" in run.stdout
    scores = json.load(open(tmp_path / "scores.json"))
    assert set(scores) == {"iou", "miou", "accuracy", "confusion"}
    assert sum(map(sum, scores["confusion"])) > 0
