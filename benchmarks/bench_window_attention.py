"""Window attention at ~270k voxels: sptr's ops vs the pure-PyTorch reference (gather + index_add), one run.

Both paths of SparseTransformer: plain (step1 -> softmax -> step2) and rel pos (dot_prod_with_idx_all ->
softmax -> step2_with_rel_pos_value); FP32/FP16/BF16; forward and forward+backward; time and peak memory.
Run: python benchmarks/bench_window_attention.py [--voxels 270000]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import HBM_BYTES_PER_S, peak_mb, table, time_ms  # noqa: E402

import sptr  # noqa: E402
from sptr.data import lidar_voxels  # noqa: E402
from sptr.reference.window_attention import (  # noqa: E402
    aggregate_reference,
    pair_logits_reference,
    segment_softmax_reference,
)


def attention(impl, rel_pos, q, k, v, tables, idx):
    i0, o0, i1, o1, rel = idx
    if impl == "sptr":
        if rel_pos:
            logits = sptr.dot_prod_with_idx_all(q, i0, o0, k, i1, o1, tables[0], tables[1], rel, 0)
        else:
            logits = sptr.attention_step1(q, k, i0, o0, i1, o1, 0)
        attn = sptr.scatter_softmax_csr(logits, o0)
        if rel_pos:
            return sptr.attention_step2_with_rel_pos_value(attn, v, i0, o0, 0, i1, o1, tables[2], rel)
        return sptr.attention_step2(attn, v, i0, o0, i1, o1, 0)
    logits = pair_logits_reference(q, k, i0, i1, *(tables[:2] if rel_pos else (None, None)),
                                   rel if rel_pos else None)
    attn = segment_softmax_reference(logits, o0)
    return aggregate_reference(attn, v, o0, i1, tables[2] if rel_pos else None, rel if rel_pos else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voxels", type=int, default=270_000)
    ap.add_argument("--window", type=float, nargs="+", default=[6, 12], help="window side in voxels")
    args = ap.parse_args()
    dev = "cuda"
    xyz, batch = lidar_voxels(args.voxels)
    xyz, batch = xyz.to(dev), batch.to(dev)
    rows = []
    for win in args.window:
        i0, o0, n_max, i1, o1, sort_idx = sptr.get_indices_params(xyz, batch, win * 0.05, False)
        N, M = xyz.shape[0], i0.numel()
        for (h, d) in ((1, 16), (4, 32)):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                g = torch.Generator(device=dev).manual_seed(0)
                mk = lambda *s: torch.randn(*s, device=dev, generator=g).to(dtype).requires_grad_()  # noqa: E731
                q, k, v = mk(N, h, d), mk(N, h, d), mk(N, h, d)
                tables = [mk(47, 3, h, d) for _ in range(3)]
                rel = torch.randint(0, 47, (M, 3), device=dev, dtype=torch.int32)
                idx = (i0, o0, i1, o1, rel)
                io_bytes = 4 * N * h * d * q.element_size()
                for rel_pos in (False, True):
                    res = {}
                    for impl in ("sptr", "reference"):
                        fwd = lambda: attention(impl, rel_pos, q, k, v, tables, idx)  # noqa: E731
                        grad = torch.randn(N, h, d, device=dev, dtype=dtype)
                        both = lambda: fwd().backward(grad)  # noqa: E731
                        try:
                            with torch.no_grad():
                                t_f = time_ms(fwd, 2, 10)
                            t_b = time_ms(both, 2, 10)
                            mem = peak_mb(both)
                        except torch.OutOfMemoryError:
                            t_f = t_b = mem = float("nan")
                        res[impl] = (t_f, t_b, mem)
                    s, r = res["sptr"], res["reference"]
                    rows.append([f"{int(win)}", f"{N}", f"{M / 1e6:.1f}M", f"{n_max}", f"{h}x{d}", str(dtype)[6:],
                                 "rel pos" if rel_pos else "plain", f"{s[0]:.2f}", f"{r[0]:.2f}", f"{r[0] / s[0]:.1f}x",
                                 f"{s[1]:.2f}", f"{r[1]:.2f}", f"{r[1] / s[1]:.1f}x", f"{s[2]:.0f}", f"{r[2]:.0f}",
                                 f"{100 * io_bytes / (s[0] * 1e-3) / HBM_BYTES_PER_S:.2f}%"])
                    print(" | ".join(rows[-1]), flush=True)
    print()
    print(table(rows, ["win", "N", "M", "n_max", "hxd", "dtype", "path", "fwd ms", "ref fwd", "speedup",
                       "f+b ms", "ref f+b", "speedup", "peak MB", "ref MB", "q/k/v/out HBM frac (fwd)"]))


if __name__ == "__main__":
    main()
