"""The CUDA kernels of one DualExpertFFN forward+backward (T 8192, H 2048, intermediate (11008, 2048), 15 %
action tokens, bf16: bench_moe.py's FFN row), cuBLAS per expert against the grouped (sync-free) path: each
kernel's GPU µs in one step (torch.profiler, after warm-up steps)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import ffn_case, training_step  # noqa: E402
from common import kernel_times  # noqa: E402
from sptr.layers import DualExpertFFN  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=12, help="kernels listed per path")
    args = ap.parse_args()
    plain, x, index, g = ffn_case()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for gemm in ("cublas", "grouped"):
        step = training_step(DualExpertFFN.from_plain(plain, gemm=gemm), lambda m: m(x, index), x, g)
        for _ in range(2):
            step()
        times = kernel_times(step)  # ms
        print(f"\ngemm={gemm}: kernels {1e3 * sum(times.values()):.1f} us per forward+backward")
        for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{1e3 * t:9.1f} us  {name[:110]}")


if __name__ == "__main__":
    main()
