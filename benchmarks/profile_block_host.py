"""Where a SphereFormer block's no-grad forward goes (level 1 of the SemanticKITTI U-Net, ~270k voxels, the
layers' unchecked call): wall time, host time until the call returns, the GPU kernels' summed time, kernel
launches and host syncs (torch.profiler), then the profiler's table by host time. A forward whose wall time is
well above its kernels' sum waits on the host: its launches, or a host read (a sync) in its middle.

    python benchmarks/profile_block_host.py [--voxels 270000] [--dtypes float16 float32] [--rows 25]
"""
import argparse
import dataclasses
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import time_ms, warm_up_gpu  # noqa: E402

from sptr.data import lidar_voxels  # noqa: E402
from sptr.layers import SphereFormer  # noqa: E402
from sptr.models.sphereformer import SphereFormerUNetConfig  # noqa: E402
from sptr.ops import data_checks  # noqa: E402


def host_ms(fn, repeat=11):
    """Median milliseconds from the call until it returns to the host, the GPU idle at the start."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[repeat // 2] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voxels", type=int, default=270_000)
    ap.add_argument("--dtypes", nargs="+", default=["float16", "float32"], help="attention dtypes")
    ap.add_argument("--rows", type=int, default=25, help="rows of the profiler table (0: none)")
    args = ap.parse_args()
    warm_up_gpu()
    unet = SphereFormerUNetConfig()
    spec = unet.levels()[0]
    xyz, batch = lidar_voxels(args.voxels, voxel=float(unet.voxel_size[0]))
    xyz, batch = xyz.cuda(), batch.cuda()
    feats = torch.randn(xyz.shape[0], spec.channels, device="cuda")
    for dtype in args.dtypes:
        config = dataclasses.replace(unet.block_config(spec), attention="fused", attention_dtype=dtype)
        block = SphereFormer(config).cuda()

        def forward():
            with torch.no_grad():
                return block(feats, xyz, batch)

        with data_checks(False):
            wall = time_ms(forward, warmup=3, repeat=10)
            host = host_ms(forward)
            forward()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                forward()
                torch.cuda.synchronize()
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
        counts = {e.key: e.count for e in events}
        launches = sum(n for k, n in counts.items() if "LaunchKernel" in k or "cuLaunch" in k)
        syncs = counts.get("cudaStreamSynchronize", 0)  # host reads (.item(), a size known only on the GPU)
        print(f"== {xyz.shape[0]} voxels, {dtype} attention: wall {wall:.2f} ms, host to return {host:.2f} ms, "
              f"GPU kernels {gpu:.2f} ms, launches {launches}, stream syncs {syncs}")
        if args.rows:
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
