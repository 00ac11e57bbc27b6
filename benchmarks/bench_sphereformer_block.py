"""One SphereFormer block (both branches: cubic and spherical windows, the three contextual tables, the
SemanticKITTI head split of 16-channel heads) on ~270k voxels: forward and forward+backward, with the fused
attention in fp32 (SphereFormer's default), fp16 and bf16 and with the published step ops beside it, plus the
GPU time of one forward+backward's kernels and the attention kernels' share of it. The block runs in fp32 (no
autocast); only the attention dtype changes between rows.

    python benchmarks/bench_sphereformer_block.py [--levels 1 2] [--voxels 270000]

`--once` runs one forward+backward per row after a warm-up one, untimed, for Nsight Compute (variant names may
be written with '-' for ' ', which survives word splitting: `ncu -k regex:"fwd_mma_kernel|bwd_dq_mma" python
benchmarks/bench_sphereformer_block.py --once --levels 1 --variants fused-fp16`; at head dims up to 32 both
branches run the one-hot forward and dq kernels (the spherical one with its radial axis gathered per pair) and
the gather dk/dv kernel; a one-hot launch's gather twin is launched too and returns at once).
"""
import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sphereformer_unet import attention_share  # noqa: E402
from common import kernel_times, peak_mb, table, time_ms, warm_up_gpu  # noqa: E402

from sptr.data import lidar_voxels  # noqa: E402
from sptr.layers import SphereFormer  # noqa: E402
from sptr.models.sphereformer import SphereFormerUNetConfig  # noqa: E402
from sptr.ops import data_checks  # noqa: E402

VARIANTS = {"fused fp32": dict(attention="fused", attention_dtype="float32"),
            "fused fp16": dict(attention="fused", attention_dtype="float16"),
            "fused bf16": dict(attention="fused", attention_dtype="bfloat16"),
            "step fp32": dict(attention="step", attention_dtype="float32")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voxels", type=int, default=270_000)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2], help="U-Net levels (1: C 32, 2: C 64)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--kernels", type=int, default=0, help="also list each row's N slowest CUDA kernels (f+b)")
    ap.add_argument("--once", action="store_true", help="one untimed forward+backward per row (for ncu)")
    args = ap.parse_args()
    args.variants = [name.replace("-", " ") for name in args.variants]
    if not args.once:
        warm_up_gpu()
    unet = SphereFormerUNetConfig()
    rows = []
    for level in args.levels:
        spec = unet.levels()[level - 1]
        voxel = float(unet.voxel_size[0]) * 2 ** (level - 1)  # the level's voxel after the U-Net's poolings
        xyz, batch = lidar_voxels(args.voxels, voxel=voxel)
        xyz, batch = xyz.cuda(), batch.cuda()
        feats = torch.randn(xyz.shape[0], spec.channels, device="cuda", requires_grad=True)
        for name in args.variants:
            torch.manual_seed(0)
            block = SphereFormer(dataclasses.replace(unet.block_config(spec), **VARIANTS[name])).cuda()

            def forward():
                with torch.no_grad():
                    return block(feats, xyz, batch)

            def train_step():
                block(feats, xyz, batch).square().mean().backward()

            # What SphereFormer runs: the layers' unchecked call (windows built by the layer are valid).
            if args.once:
                with data_checks(False):
                    train_step()
                    torch.cuda.synchronize()
                    train_step()
                    torch.cuda.synchronize()
                print(f"level {level}, {name}: one forward+backward after a warm-up one", flush=True)
                continue
            with data_checks(False):
                fwd = time_ms(forward, warmup=2, repeat=args.repeat)
                both = time_ms(train_step, warmup=2, repeat=args.repeat)
                times = kernel_times(train_step)
                mem = peak_mb(train_step)
            share, gpu = attention_share(times), sum(times.values())
            rows.append([level, xyz.shape[0], f"{spec.channels} ({spec.num_heads}x{spec.channels // spec.num_heads})",
                         name, f"{fwd:.2f}", f"{both:.2f}", f"{gpu:.2f}", f"{share:.0%}", f"{mem:.0f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
            if args.kernels:
                top = sorted(times.items(), key=lambda kv: -kv[1])[:args.kernels]
                print(f"  kernel time of one forward+backward: {gpu:.2f} ms in all; slowest:")
                for kernel, t in top:
                    print(f"  {t:8.3f} ms  {kernel[:150]}")
            del block
            torch.cuda.empty_cache()
    if args.once:
        return
    print("\nSphereFormer block (both branches, contextual q/k/v tables), fp32 block, unchecked call, "
          f"{torch.cuda.get_device_name()}")
    print(table(rows, ["level", "voxels", "C (heads)", "attention", "fwd ms", "fwd+bwd ms", "f+b kernels ms",
                       "attention share f+b", "f+b peak MiB"]))
    # "f+b kernels ms": the GPU time of one forward+backward's kernels (torch.profiler), free of the host's share
    # (the window partitions' syncs, Python), which moves the wall-clock columns between runs of one machine.


if __name__ == "__main__":
    main()
