"""Load a SphereFormer checkpoint, label the points of scans and print a per-class histogram.

    python examples/infer_sphereformer.py [--checkpoint model_best.pth] [--points 000000.bin ...]

Without ``--points`` it labels a synthetic scan; without ``--checkpoint`` it uses random weights.
"""
import argparse
import os

import torch

from sptr.data import lidar_scan, read_kitti_bin
from sptr.models.sphereformer import SphereFormerUNet, predict_scans

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEMANTIC_KITTI = ["car", "bicycle", "motorcycle", "truck", "other-vehicle", "person", "bicyclist", "motorcyclist",
                  "road", "parking", "sidewalk", "other-ground", "building", "fence", "vegetation", "trunk",
                  "terrain", "pole", "traffic-sign"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "sphereformer_semantickitti.yaml"))
    parser.add_argument("--checkpoint")
    parser.add_argument("--points", nargs="*", default=[])
    parser.add_argument("--synthetic-points", type=int, default=6000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    model = SphereFormerUNet.from_yaml(args.config, args.checkpoint).to(args.device).eval()
    cfg = model.cfg
    scans = [read_kitti_bin(p) for p in args.points] or [lidar_scan(args.synthetic_points)[0]]
    labels = torch.cat(predict_scans(model, scans)).cpu()
    counts = torch.bincount(labels, minlength=cfg.num_classes)
    names = SEMANTIC_KITTI if cfg.num_classes == len(SEMANTIC_KITTI) else [str(i) for i in range(cfg.num_classes)]
    print(f"{labels.numel()} points in {len(scans)} scan(s)")
    for name, count in zip(names, counts.tolist()):
        print(f"{name:>14} {count:8d} {'#' * round(50 * count / max(1, labels.numel()))}")
    return counts


if __name__ == "__main__":
    main()
