"""The whole SphereFormer U-Net (SemanticKITTI config, 32.3M parameters) on the GPU: forward (eval) and
forward+backward (train) per scan and peak memory, at one scan and a batch of 4 synthetic scans (about 120k
voxels each after the crop), with the fused attention in fp32 and bf16 and with the published step ops, and
the attention kernels' share of the forward+backward's GPU time (torch.profiler; ``ATTENTION_KERNELS``).

The network runs in fp32 without autocast (SphereFormer's validation setting); only the attention dtype
changes between the fused rows. The step rows are the same network with ``attention="step"``.
"""
import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import kernel_times, peak_mb, table, time_ms, warm_up_gpu  # noqa: E402

from sptr.data import collate_scans, lidar_scan, voxelize_scan  # noqa: E402
from sptr.models.sphereformer import SphereFormerUNet, SphereFormerUNetConfig, sparse_input  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"fused fp32": dict(attention="fused", attention_dtype="float32"),
            "fused bf16": dict(attention="fused", attention_dtype="bfloat16"),
            "step fp32": dict(attention="step", attention_dtype="float32")}


# The CUDA kernels of the attention itself, fused and step ops (window partitions, q/k/v projections and the
# torch ops around them are the network's other time).
ATTENTION_KERNELS = ("fwd_onehot_kernel", "fwd_mma_kernel", "fwd_kernel", "bwd_dq", "bwd_dkv", "delta_kernel",
                     "onehot_range_kernel", "token_bounds_kernel", "pair_logits", "aggregate", "softmax_kernel",
                     "softmax_backward_kernel", "precompute_all_kernel")


def attention_share(times):
    """Fraction of the kernel time (kernel_times) spent in ATTENTION_KERNELS."""
    attention = sum(t for name, t in times.items() if any(k in name for k in ATTENTION_KERNELS))
    return attention / max(sum(times.values()), 1e-9)


def make_batch(cfg, scans):
    voxels = [voxelize_scan(points.cuda(), cfg.voxel_size, cfg.pc_range, mode="random", voxel_max=120_000,
                            generator=torch.Generator("cuda").manual_seed(i)) for i, (points, _) in enumerate(scans)]
    feats, coords, xyz, batch, _ = collate_scans(voxels)
    return feats, coords, xyz, batch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", type=int, default=160_000, help="points per synthetic scan")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    warm_up_gpu()
    base = SphereFormerUNetConfig.from_yaml(os.path.join(ROOT, "configs", "sphereformer_semantickitti.yaml"))
    pool = [lidar_scan(args.points, seed=s) for s in range(max(args.batches))]
    torch.manual_seed(0)
    weights = SphereFormerUNet(base).state_dict()
    rows = []
    for b in args.batches:
        feats, coords, xyz, batch = make_batch(base, pool[:b])
        voxels = feats.shape[0]
        for name in args.variants:
            model = SphereFormerUNet(dataclasses.replace(base, **VARIANTS[name])).cuda()
            model.load_state_dict(weights)

            def forward():
                model.eval()
                with torch.no_grad():
                    return model(sparse_input(feats, coords, batch, b), xyz, batch)

            def train_step():
                model.train()
                model(sparse_input(feats, coords, batch, b), xyz, batch).square().mean().backward()

            try:
                fwd = time_ms(forward, warmup=2, repeat=args.repeat)
                fwd_mem = peak_mb(forward)
                both = time_ms(train_step, warmup=2, repeat=args.repeat)
                both_mem = peak_mb(train_step)
                share = attention_share(kernel_times(train_step))
                rows.append([b, voxels, name, f"{fwd / b:.1f}", f"{both / b:.1f}", f"{share:.0%}", f"{fwd_mem:.0f}",
                             f"{both_mem:.0f}"])
            except torch.OutOfMemoryError:
                rows.append([b, voxels, name, "OOM", "OOM", "-", "-", "-"])
            print(rows[-1], flush=True)
            del model
            torch.cuda.empty_cache()
    print("\nSphereFormer U-Net (SemanticKITTI config), fp32 network, "
          f"{torch.cuda.get_device_name()}; ms per scan, peak MiB above inputs")
    print(table(rows, ["scans", "voxels", "attention", "fwd ms/scan", "fwd+bwd ms/scan", "attention share f+b",
                       "fwd MiB", "f+b MiB"]))


if __name__ == "__main__":
    main()
