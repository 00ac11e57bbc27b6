"""Evaluation on SemanticKITTI or nuScenes-lidarseg: ``python -m sptr.models.sphereformer.evaluate --config
C.yaml --checkpoint X --data-root ROOT [--dataset nuscenes] [--split val] [--output scores.json|.csv]``. Every
point of every scan of the split is labelled
as SphereFormer validates (voxel means, each voxel's argmax given to its points) and scored against its label:
the per-class IoU table, mIoU and accuracy are printed, and written as JSON or CSV with ``--output``."""
from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from ...data.metrics import SegmentationMetrics
from ...data.lidar_segmentation import LidarSegmentation, collate_samples
from ...data.nuscenes import NuScenesLidarSeg
from ...data.semantic_kitti import SemanticKITTI
from .unet import SphereFormerUNet, sparse_input


@torch.no_grad()
def evaluate(model: SphereFormerUNet, dataset: LidarSegmentation, batch_size: int = 1, workers: int = 0,
             progress: bool = True) -> SegmentationMetrics:
    """Point-level scores of ``model`` on a labelled evaluation dataset (``train=False``)."""
    if dataset.train:
        raise ValueError("evaluate needs an evaluation dataset (train=False: every point kept)")
    cfg = model.cfg
    device = next(model.parameters()).device
    metrics = SegmentationMetrics(cfg.num_classes, cfg.ignore_label, dataset.label_map.names)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                         collate_fn=collate_samples)
    model.eval()
    for b in tqdm(loader, disable=not progress, desc="evaluate", unit="batch"):
        if b["point_labels"] is None:
            raise ValueError(f"{b['paths'][0]!r} has no labels: the test split cannot be scored")
        feats, coords, xyz, batch = (b[k].to(device) for k in ("feats", "coords", "xyz", "batch"))
        logits = model(sparse_input(feats, coords, batch, len(b["paths"])), xyz, batch)
        metrics.update(logits.argmax(1).cpu()[b["point_to_voxel"]], b["point_labels"])
    return metrics


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sptr.models.sphereformer.evaluate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="SphereFormerUNetConfig YAML")
    parser.add_argument("--checkpoint", required=True, help=".pth / .safetensors checkpoint")
    parser.add_argument("--data-root", required=True,
                        help="SemanticKITTI's folder holding sequences/, or nuScenes' with SphereFormer's info files")
    parser.add_argument("--dataset", choices=["semantickitti", "nuscenes"], default="semantickitti")
    parser.add_argument("--split", default="val", choices=["train", "val", "trainval"])
    parser.add_argument("--output", help="write the scores here (.json, else CSV)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        model = SphereFormerUNet.from_yaml(args.config, args.checkpoint).to(args.device)
        kind = SemanticKITTI if args.dataset == "semantickitti" else NuScenesLidarSeg
        dataset = kind.from_config(args.data_root, model.cfg, args.split, train=False)
        metrics = evaluate(model, dataset, args.batch_size, args.workers)
    except (ValueError, TypeError, FileNotFoundError, KeyError, RuntimeError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    print(metrics.table())
    if args.output:
        metrics.write(args.output)
        print(f"scores written to {args.output}")


if __name__ == "__main__":
    main()
