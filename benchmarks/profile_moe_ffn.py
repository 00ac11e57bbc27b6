"""The CUDA kernels of one DualExpertFFN forward+backward (T 8192, H 2048, intermediate (11008, 2048), 15 %
action tokens, bf16: bench_moe.py's FFN row), cuBLAS per expert against the grouped (sync-free) path: each
kernel's GPU µs in one step (torch.profiler, after warm-up steps)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import kernel_times  # noqa: E402
from sptr.layers import DualExpertFFN  # noqa: E402
from sptr.reference.moe import PlainDualExpertFFN  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=12, help="kernels listed per path")
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
            layer.zero_grad(set_to_none=True)  # a training step's zero_grad: no accumulation into old gradients
            layer(x, index).backward(g)
        for _ in range(2):
            step()
        times = kernel_times(step)  # ms
        print(f"\ngemm={gemm}: kernels {1e3 * sum(times.values()):.1f} us per forward+backward")
        for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{1e3 * t:9.1f} us  {name[:110]}")


if __name__ == "__main__":
    main()
