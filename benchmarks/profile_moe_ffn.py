"""The CUDA kernels of one DualExpertFFN forward+backward (T 8192, H 2048, intermediate (11008, 2048), 15 %
action tokens, bf16: bench_moe.py's FFN row), cuBLAS per expert against the grouped (sync-free) path: GPU µs
per step and launches per step of each kernel, from torch.profiler."""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sptr.layers import DualExpertFFN  # noqa: E402
from sptr.reference.moe import PlainDualExpertFFN  # noqa: E402


def kernel_times(step, steps: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (µs per step, launches per step)} over ``steps`` calls of ``step``."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows: dict[str, tuple[float, float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, t = rows.get(e.name, (0.0, 0.0))
            rows[e.name] = (n + 1 / steps, t + e.device_time / steps)
    return {name: (t, n) for name, (n, t) in rows.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=12, help="kernels listed per path")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    T, H, inter = 8192, 2048, (11008, 2048)
    torch.manual_seed(0)
    plain = PlainDualExpertFFN(H, inter).cuda().to(torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    index = (torch.rand(T, device="cuda") < 0.15).long()
    g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for gemm in ("cublas", "grouped"):
        layer = DualExpertFFN.from_plain(plain, gemm=gemm)

        def step():
            x.grad = None
            layer(x, index).backward(g)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        rows = kernel_times(step, args.steps)
        print(f"\ngemm={gemm}: kernels {sum(t for t, _ in rows.values()):.1f} us per forward+backward")
        for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"{t:9.1f} us  x{n:4.1f}  {name[:110]}")


if __name__ == "__main__":
    main()
