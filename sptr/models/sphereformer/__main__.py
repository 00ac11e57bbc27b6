"""Inference CLI: ``python -m sptr.models.sphereformer --config C.yaml [--checkpoint X] [--points scan.bin ...]``.

Reads KITTI-format ``.bin`` scans (float32 x, y, z, intensity), voxelises them as SphereFormer does, writes one
SemanticKITTI ``.label`` (uint32 per point) beside each output path, and prints the throughput. Without
``--points`` it runs on a synthetic scan; without ``--checkpoint`` on random weights.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from ...data import lidar_scan, read_kitti_bin, write_kitti_label
from .inference import predict_scans
from .unet import SphereFormerUNet


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sptr.models.sphereformer", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="SphereFormerUNetConfig YAML (configs/sphereformer_*.yaml)")
    parser.add_argument("--checkpoint", help=".pth / .safetensors checkpoint (random weights if omitted)")
    parser.add_argument("--points", nargs="*", default=[], help="KITTI .bin scans (a synthetic scan if none)")
    parser.add_argument("--output-dir", default=".", help="where the .label files go")
    parser.add_argument("--synthetic-points", type=int, default=30_000, help="points of the synthetic scan")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attention-dtype", choices=["float32", "float16", "bfloat16"],
                        help="override the config's attention_dtype")
    args = parser.parse_args(argv)

    overrides = {"attention_dtype": args.attention_dtype} if args.attention_dtype else {}
    model = SphereFormerUNet.from_yaml(args.config, args.checkpoint, **overrides).to(args.device).eval()
    if args.points:
        scans = [(os.path.splitext(os.path.basename(p))[0], read_kitti_bin(p)) for p in args.points]
    else:
        scans = [("synthetic", lidar_scan(args.synthetic_points)[0])]
    os.makedirs(args.output_dir, exist_ok=True)
    total_points, total_time = 0, 0.0
    for name, points in scans:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        labels = predict_scans(model, [points])[0]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        path = os.path.join(args.output_dir, f"{name}.label")
        write_kitti_label(path, labels)
        total_points += points.shape[0]
        total_time += elapsed
        print(f"{name}: {points.shape[0]} points, {elapsed * 1e3:.0f} ms -> {path}")
    print(f"throughput: {total_points / total_time:,.0f} points/s on {args.device}")


if __name__ == "__main__":
    main()
