"""Bits of the fused attention's gather kernels (tables with radial bins, or cells past the one-hot range), on
CUDA: `save PATH` writes the output and every gradient of each case; `compare A B` says which cases of two saves
differ and where. The A/B of a kernel change that must not move a bit: save with each build, then compare (run
`save` twice with one build to see which gradients vary run to run: the table gradients of the tile kernels
with `deterministic=False`).

    PYTHONPATH=. python benchmarks/fused_attention_bits.py save new.pt"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.ops.test_fused_window_attention import fused, make_case, run_with_grads  # noqa: E402

TABLE_NAMES = {"q": "query", "k": "key", "v": "value"}
OUTPUTS = ["out", "dq", "dk", "dv", "dTq", "dTk", "dTv"]


def cases():
    """(name, [output, gradients]) of windows from 1 to 300 tokens, 2 heads, fp16/bf16, head dim 16/32."""
    counts = [200, 1, 64, 7, 130, 33, 300, 90]
    for dtype in (torch.float16, torch.bfloat16):
        for d in (16, 32):
            for tables, radial, qgl in (("qkv", True, 24), ("qk", True, 24), ("v", True, 24), ("qkv", False, 30)):
                q, k, v, off, rp = make_case(counts, 2, d, dtype, "cuda", tuple(TABLE_NAMES[t] for t in tables),
                                             radial, seed=5, qgl=qgl)
                upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).cuda()
                out, grads = run_with_grads(fused(off, 0.25), q, k, v, rp, upstream)
                yield f"{dtype} d{d} {tables} radial={radial} qgl={qgl}", [out] + grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "compare"])
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args()
    if args.mode == "save":
        torch.save({name: [None if t is None else t.detach().cpu() for t in ts] for name, ts in cases()},
                   args.paths[0])
        return
    a, b = (torch.load(p) for p in args.paths[:2])
    for case in a:
        differ = [n for n, x, y in zip(OUTPUTS, a[case], b[case])
                  if (x is None) != (y is None) or (x is not None and not torch.equal(x, y))]
        print(f"{case}: {'identical' if not differ else 'differ in ' + ', '.join(differ)}")


if __name__ == "__main__":
    main()
