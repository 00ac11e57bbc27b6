"""Where the fused window attention's forward time goes at ~270k voxels: the whole call (value checks
included), the call without value checks, the op alone, and its CUDA kernels alone (torch.profiler); plus
forward+backward. `--once` only runs the op three times, for `ncu -k regex:fwd_mma`; `--once --rel-pos` runs
one forward+backward with SparseTransformer's three contextual tables, for `ncu -k regex:"fwd|bwd"`;
`--rel-pos` alone: the CUDA kernel time of one forward+backward with the tables, by kernel (torch.profiler).

Run: python benchmarks/profile_fused_forward.py [--window 12] [--heads 4x32]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fused_attention import QGL, layouts  # noqa: E402
from common import table, time_ms, warm_up_gpu  # noqa: E402

from sptr.data import lidar_voxels  # noqa: E402
from sptr.ops import RelativePosition, data_checks, window_attention  # noqa: E402


def kernel_ms(fn, repeat=10):
    """Mean summed CUDA kernel time of one call of fn, by name."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:  # names without the namespace, template arguments kept apart (a sum per name)
            name = e.key.replace("void ", "").replace("sptr::(anonymous namespace)::", "")[:70]
            per[name] = per.get(name, 0.0) + e.device_time_total / 1e3 / repeat
    return per


def table_step(lay, h, d, dtype):
    """One forward+backward with SparseTransformer's three contextual tables (random data), values unchecked."""
    q, k, v = (torch.randn(lay["N"], h, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    tables = [(torch.randn(2 * QGL - 1, 3, h, d, device="cuda") * 0.05).to(dtype) for _ in range(3)]
    rel_pos = RelativePosition(lay["coords"], QGL - 1, *tables)
    grad = torch.randn_like(q)

    def step():
        with data_checks(False):
            window_attention(q, k, v, lay["offsets"], rel_pos=rel_pos).backward(grad)
    return step


def plain_forward(q, k, v, offsets):
    """The forward op alone: no Python checks, no autograd wrapper."""
    return torch.ops.sptr.window_attention_fwd(q, k, v, offsets, None, None, None, None, None, 0, 0.0,
                                               q.shape[-1] ** -0.5, False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voxels", type=int, default=270_000)
    ap.add_argument("--window", type=float, default=12)
    ap.add_argument("--heads", type=str, default="4x32")
    ap.add_argument("--dtypes", type=str, nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--once", action="store_true", help="three plain calls of the op and nothing else (for ncu)")
    ap.add_argument("--rel-pos", action="store_true",
                    help="one forward+backward with the tables: alone, its kernel times; with --once, for ncu")
    args = ap.parse_args()
    xyz, batch = lidar_voxels(args.voxels)
    lay = layouts(xyz.cuda(), batch.cuda(), args.window)
    h, d = (int(x) for x in args.heads.split("x"))
    if args.once and args.rel_pos:
        table_step(lay, h, d, getattr(torch, args.dtypes[0]))()
        torch.cuda.synchronize()
        return
    if args.rel_pos:
        for dname in args.dtypes:
            kern = kernel_ms(table_step(lay, h, d, getattr(torch, dname)))
            rows = sorted(([name, f"{t:.3f}"] for name, t in kern.items() if t >= 0.002), key=lambda r: -float(r[1]))
            print(f"{dname}, window {args.window}, {args.heads}, with tables: ms per forward+backward, by kernel "
                  f"(total {sum(kern.values()):.3f})")
            print(table(rows, ["kernel", "ms"]))
        return
    if args.once:
        q = torch.randn(lay["N"], h, d, device="cuda", dtype=getattr(torch, args.dtypes[0]))
        for _ in range(3):
            plain_forward(q, q, q, lay["offsets"])
        torch.cuda.synchronize()
        return
    warm_up_gpu()
    rows = []
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(lay["N"], h, d, device="cuda", generator=g).to(dtype) for _ in range(3))
        offsets = lay["offsets"]
        with torch.no_grad():
            call = lambda: window_attention(q, k, v, offsets)  # noqa: E731
            t_call = time_ms(call, 3, args.repeat)
            with data_checks(False):
                t_nochk = time_ms(call, 3, args.repeat)
            op = lambda: plain_forward(q, k, v, offsets)  # noqa: E731
            t_op = time_ms(op, 3, args.repeat)
            kern = kernel_ms(op)
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        grad = torch.randn_like(q)
        t_fb = time_ms(lambda: window_attention(qg, kg, vg, offsets).backward(grad), 3, args.repeat)
        fwd_kernel = sum(t for name, t in kern.items() if "fwd" in name)
        other = sum(kern.values()) - fwd_kernel
        rows.append([dname, f"{t_call:.3f}", f"{t_nochk:.3f}", f"{t_op:.3f}", f"{fwd_kernel:.3f}", f"{other:.3f}",
                     f"{t_fb:.3f}"])
        print(" | ".join(str(c) for c in rows[-1]), "|", {k_: round(t, 4) for k_, t in kern.items()}, flush=True)
    print(table(rows, ["dtype", "call ms", "no checks ms", "op ms", "fwd kernel ms", "other kernels ms", "f+b ms"]))


if __name__ == "__main__":
    main()
