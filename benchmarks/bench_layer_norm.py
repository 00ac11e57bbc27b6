"""LayerNorm over the last dimension at SphereFormer's shapes (270k voxels, 32-256 channels, fp32 as the
network runs it, and bf16): sptr.layers.LayerNorm against torch's nn.LayerNorm (eager and torch.compile), forward
and forward+backward in ms, and the share of the HBM floor (forward: read x, write y; forward+backward: also
read the gradient and x, write dx)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import HBM_BYTES_PER_S, table, time_ms, warm_up_gpu  # noqa: E402

from sptr.layers import LayerNorm  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=270_000)
    ap.add_argument("--channels", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    warm_up_gpu()
    rows = []
    for dtype in (getattr(torch, d) for d in args.dtypes):
        for c in args.channels:
            x = torch.randn(args.rows, c, device="cuda", dtype=dtype, requires_grad=True)
            g = torch.randn_like(x)
            ours = LayerNorm(c).to("cuda", dtype)
            torch_ln = torch.nn.LayerNorm(c).to("cuda", dtype)
            impls = {"sptr": (ours, ours), "torch": (torch_ln, torch_ln),
                     "torch.compile": (torch.compile(torch_ln), torch_ln)}
            floor = x.numel() * x.element_size() / HBM_BYTES_PER_S * 1e3
            base = None
            for name, (mod, params) in impls.items():
                with torch.no_grad():
                    fwd = time_ms(lambda: mod(x))
                both = time_ms(lambda: torch.autograd.grad(mod(x), (x, params.weight, params.bias), g))
                base = base or (fwd, both)
                rows.append([str(dtype).removeprefix("torch."), c, name, f"{fwd:.3f}", f"{fwd / base[0]:.2f}x",
                             f"{2 * floor / fwd:.0%}", f"{both:.3f}", f"{both / base[1]:.2f}x", f"{5 * floor / both:.0%}"])
    print(f"LayerNorm, {args.rows} rows, {torch.cuda.get_device_name()}; ms, time vs sptr, share of the HBM floor")
    print(table(rows, ["dtype", "C", "impl", "fwd ms", "vs sptr", "fwd % floor", "f+b ms", "vs sptr",
                       "f+b % floor"]))


if __name__ == "__main__":
    main()
