"""Issue 28's small ops at their benchmark shapes: get_rope_index (24 images [1,18,18], B = 8 x 768 tokens),
permute / unpermute (x [6144, 2048] bf16; K = 1 with 2 experts, K = 2 with 8) and mRoPE (bf16, bench_rope's q
and k), unchecked.

Without arguments each op runs a few times, for Nsight Compute:
`ncu -k regex:"rope_index|moe_|mrope" python benchmarks/profile_index_routing.py`.
`--times`: each op's CUDA kernels with their GPU times in one call (torch.profiler) beside the time of a
CUDA graph of one call (which also times the replay's start, ~6 µs on an H100). bench_rope.py and bench_moe.py
time the same calls against their peers.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rope import index_inputs, rope_inputs  # noqa: E402
from common import graph_ms, kernel_times, warm_up_gpu  # noqa: E402

from sptr.ops import data_checks, moe, rope, vision_index  # noqa: E402


def print_kernel_times(name, fn):
    times = kernel_times(fn)
    print(f"== {name}: graph of one call {graph_ms(fn) * 1e3:.1f} µs, kernels {sum(times.values()) * 1e3:.1f} µs")
    for kernel, ms in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"   {ms * 1e3:7.2f} µs  {kernel[:110]}")


def ops():
    ids, grids, _, _ = index_inputs()
    yield "get_rope_index", lambda: vision_index.get_rope_index(ids, grids, None, None, None, 2, 151655, 151656,
                                                                151652, 2)
    x = torch.randn(6144, 2048, device="cuda", dtype=torch.bfloat16)
    for K, E in ((1, 2), (2, 8)):
        experts = (torch.rand(6144, 1, device="cuda") < 0.15).long() if K == 1 else \
            torch.rand(6144, E, device="cuda").topk(K, -1).indices
        probs = torch.rand(6144, K, device="cuda")
        perm = moe.permute(x, experts, E)
        yield f"permute K={K}", lambda experts=experts, E=E: moe.permute(x, experts, E)
        yield f"unpermute K={K}", lambda p=perm, probs=probs: moe.unpermute(p.x_perm, p.row_id_map, probs)
    q, k, cos, sin = rope_inputs(torch.bfloat16)
    section = [16, 24, 24]
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    q1, k1 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    yield "mRoPE forward", lambda: rope.apply_rotary(q, k, cos, sin, section)
    yield "mRoPE forward+backward", lambda: torch.autograd.grad(rope.apply_rotary(q1, k1, cos, sin, section),
                                                                (q1, k1), (gq, gk))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--times", action="store_true", help="kernel times and graph times instead of ncu runs")
    args = ap.parse_args()
    if args.times:
        warm_up_gpu()
    with data_checks(False):
        for name, fn in ops():
            if args.times:
                print_kernel_times(name, fn)
            else:
                for _ in range(3):
                    fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
