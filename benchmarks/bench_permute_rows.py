"""Rows into window order at SphereFormer's shapes (270k voxels): sptr::window_permute_rows, the scatter the
attention layers run (its gradient is the same scatter by the inverse permutation), against `index_copy_` (what
it ran before) and `x[perm]` (what a user would write; its gradient is an accumulating index_put). GPU time of
one call from a CUDA graph of ten, µs, forward and forward+backward, and the forward's copy rate (read and
write x, read the indices) as TB/s and share of the HBM rate."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import HBM_BYTES_PER_S, graph_ms, table, warm_up_gpu  # noqa: E402

from sptr.ops.sparse_attention import WindowOrder  # noqa: E402


def operands(n):
    """(name, x): a head of q as the block takes it from its qkv projection (a strided view), the fp16 copy the
    low-precision attention gets, and a contiguous two-head operand."""
    qkv = torch.randn(n, 3, 2, 16, device="cuda")
    yield "fp32 view of qkv, [N, 1, 16]", qkv.split([1, 1], 2)[1].unbind(1)[0]
    yield "fp16, [N, 1, 16]", qkv[:, 0, :1].half().contiguous()
    yield "fp32, [N, 2, 32]", torch.randn(n, 2, 32, device="cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=270_000)
    args = ap.parse_args()
    warm_up_gpu()
    order = WindowOrder.of(torch.randperm(args.rows, device="cuda"))
    rows = []
    for name, x in operands(args.rows):
        impls = {
            "sptr window_permute_rows": lambda t: torch.ops.sptr.window_permute_rows(t, order.inverse, order.order),
            "index_copy_": lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device).index_copy_(
                0, order.inverse, t),
            "x[perm]": lambda t: t[order.order],
        }
        want = x[order.order]
        xg = x.detach().requires_grad_()
        g = torch.randn(x.shape, device="cuda").to(x.dtype)
        moved = 2 * x.numel() * x.element_size() + x.shape[0] * 8
        base = None
        for impl, fn in impls.items():
            assert torch.equal(fn(x), want), impl
            fwd = graph_ms(lambda: fn(x), calls=10)
            both = graph_ms(lambda: torch.autograd.grad(fn(xg), xg, g), calls=10)
            base = base or (fwd, both)
            rate = moved / (fwd * 1e-3)
            rows.append([name, impl, f"{fwd * 1e3:.1f}", f"{both * 1e3:.1f}", f"{rate / 1e12:.2f}",
                         f"{100 * rate / HBM_BYTES_PER_S:.0f}%", f"{fwd / base[0]:.2f}x", f"{both / base[1]:.2f}x"])
    print(f"window order permutes, {args.rows} rows, {torch.cuda.get_device_name()}")
    print(table(rows, ["x", "impl", "fwd us", "fwd+bwd us", "fwd TB/s", "of HBM", "fwd vs sptr", "f+b vs sptr"]))


if __name__ == "__main__":
    main()
