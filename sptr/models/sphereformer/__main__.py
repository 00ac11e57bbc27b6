"""Inference CLI: ``python -m sptr.models.sphereformer --config C.yaml --checkpoint X --points PATH ...``.

Reads KITTI-format ``.bin`` scans (float32 x, y, z, intensity), voxelises them as SphereFormer does and writes
one ``.label`` per scan (uint32 per point) holding the dataset's raw label ids (SemanticKITTI's
``learning_map_inv``: car = 10, road = 40, ...), as the benchmark's submission format wants. ``--points`` takes
files, directories (searched for ``.bin``) and SemanticKITTI roots; a scan at ``.../sequences/XX/velodyne/N.bin``
goes to ``OUTPUT/sequences/XX/predictions/N.label``, others to ``OUTPUT/N.label``. Existing files are kept unless
``--overwrite``. Without ``--points`` it runs on a synthetic scan; without ``--checkpoint`` on random weights
(said so on stderr).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import torch

from ...data import lidar_scan, read_kitti_bin, write_kitti_label
from ...data.labels import LabelMap
from .inference import predict_scans
from .unet import SphereFormerUNet


def scan_files(paths, sequences=None) -> list[str]:
    """The ``.bin`` files named by files, directories (recursively) and glob patterns, sorted, without repeats;
    ``sequences`` keeps those under ``sequences/XX/`` for the given XX."""
    found = []
    for p in paths:
        matches = sorted(glob.glob(p)) if glob.has_magic(p) else [p]
        for m in matches:
            if os.path.isdir(m):
                found += sorted(glob.glob(os.path.join(m, "**", "*.bin"), recursive=True))
            elif os.path.isfile(m):
                found.append(m)
            else:
                raise FileNotFoundError(f"--points {m!r}: no such file or directory")
    found = list(dict.fromkeys(os.path.normpath(f) for f in found))
    if sequences:
        wanted = {f"{int(s):02d}" for s in sequences}
        found = [f for f in found if _sequence(f) in wanted]
    return found


def _sequence(path: str):
    """XX of ``.../sequences/XX/velodyne/N.bin``, or None."""
    parts = os.path.normpath(path).split(os.sep)
    if len(parts) >= 4 and parts[-2] == "velodyne" and parts[-4] == "sequences":
        return parts[-3]
    return None


def prediction_path(scan: str, output_dir: str) -> str:
    """Where a scan's labels go: SemanticKITTI's submission layout when the scan sits in it, else beside its name."""
    stem = os.path.splitext(os.path.basename(scan))[0]
    seq = _sequence(scan)
    if seq is not None:
        return os.path.join(output_dir, "sequences", seq, "predictions", f"{stem}.label")
    return os.path.join(output_dir, f"{stem}.label")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sptr.models.sphereformer", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="SphereFormerUNetConfig YAML (configs/sphereformer_*.yaml)")
    parser.add_argument("--checkpoint", help=".pth / .safetensors checkpoint (random weights if omitted)")
    parser.add_argument("--points", nargs="*", default=[],
                        help=".bin scans, directories or glob patterns (a synthetic scan if none)")
    parser.add_argument("--sequences", nargs="*", help="SemanticKITTI sequences to keep (e.g. 08, or 11 ... 21)")
    parser.add_argument("--output-dir", default=".", help="where the .label files go")
    parser.add_argument("--overwrite", action="store_true", help="replace existing .label files")
    parser.add_argument("--label-map", default="auto",
                        help="label ids to write: a map in configs/labels (semantickitti, nuscenes), 'classes' for "
                             "the network's class ids; auto: semantickitti for 19 classes, nuscenes for 16")
    parser.add_argument("--synthetic-points", type=int, default=30_000, help="points of the synthetic scan")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attention-dtype", choices=["float32", "float16", "bfloat16"],
                        help="override the config's attention_dtype")
    args = parser.parse_args(argv)
    try:
        run(args)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, KeyError, RuntimeError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def run(args) -> None:
    overrides = {"attention_dtype": args.attention_dtype} if args.attention_dtype else {}
    if args.checkpoint is None:
        print("warning: no --checkpoint: the network has random weights, its labels mean nothing", file=sys.stderr)
    model = SphereFormerUNet.from_yaml(args.config, args.checkpoint, **overrides).to(args.device).eval()
    name = args.label_map
    if name == "auto":
        name = {19: "semantickitti", 16: "nuscenes"}.get(model.cfg.num_classes, "classes")
    label_map = None if name == "classes" else LabelMap.named(name)
    if label_map is not None and label_map.num_classes != model.cfg.num_classes:
        raise ValueError(f"label map {name!r} has {label_map.num_classes} classes, the model {model.cfg.num_classes}")
    if args.points:
        files = scan_files(args.points, args.sequences)
        if not files:
            raise FileNotFoundError(f"--points {args.points} holds no .bin scan")
        scans = [(f, prediction_path(f, args.output_dir)) for f in files]
    else:
        scans = [(None, os.path.join(args.output_dir, "synthetic.label"))]
    outputs = [out for _, out in scans]
    if len(set(outputs)) != len(outputs):
        twice = sorted({o for o in outputs if outputs.count(o) > 1})
        raise ValueError(f"two scans would write the same prediction file {twice[0]!r}; give scans in the "
                         "SemanticKITTI layout (sequences/XX/velodyne/N.bin) or one directory per run")
    existing = [o for o in outputs if os.path.exists(o)]
    if existing and not args.overwrite:
        raise FileExistsError(f"{len(existing)} prediction file(s) exist already ({existing[0]!r} ...); pass "
                              "--overwrite to replace them")
    total_points, total_time = 0, 0.0
    for scan, out in scans:
        points = read_kitti_bin(scan) if scan is not None else lidar_scan(args.synthetic_points)[0]
        if points.shape[0] == 0:
            raise ValueError(f"{scan!r} holds no point")
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        classes = predict_scans(model, [points])[0]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        write_kitti_label(out, torch.from_numpy(label_map.to_raw(classes).astype("int64")) if label_map else classes)
        total_points += points.shape[0]
        total_time += elapsed
        print(f"{scan or 'synthetic'}: {points.shape[0]} points, {elapsed * 1e3:.0f} ms -> {out}")
    print(f"throughput: {total_points / total_time:,.0f} points/s on {args.device}")


if __name__ == "__main__":
    main()
