"""Window attention at ~270k voxels, the implementations a user could pick side by side in one run (issues 3, 25).

1. fused: sptr.ops.window_attention, the checked call (its value checks cost one host sync)
2. fused unchecked: the same under ``data_checks(False)``, what the layers (SphereFormer) run
2b. fused gather kernel (rel pos only): the unchecked call with every cell coordinate + 32, which keeps the
   relative positions but sends the forward to the gather kernel instead of the one-hot one (an A/B of the two)
3. step: this library's step-by-step ops
4. sptr 1.1.1's step ops (built from its sdist, imported under the name ``sptr111``; its torch_scatter
   softmax replaced by torch.segment_reduce, as torch_scatter cannot be installed on the device)
5. FlexAttention with a block mask of the windows 6. windows padded to n_max + scaled_dot_product_attention
7. flash varlen: torch's FlashAttention varlen (``torch.nn.attention.varlen.varlen_attn``), windows as sequences
Plain attention for all; with SparseTransformer's contextual relative-position tables (q, k, v tables,
L = 47) for the three that support them. Time (median of CUDA-event repeats) and extra peak memory of
forward and forward+backward, the ratios to the fused path, and the fraction of the H200's limit reached.
Run: python benchmarks/bench_fused_attention.py [--window 6 12] [--out results.jsonl]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BF16_FLOPS, HBM_BYTES_PER_S, peak_mb, table, time_ms, warm_up_gpu  # noqa: E402

import sptr  # noqa: E402
from sptr.data import lidar_voxels  # noqa: E402
from sptr.ops._checks import data_checks  # noqa: E402
from sptr.ops import (  # noqa: E402
    RelativePosition,
    get_indices_params,
    quantised_coords,
    relative_position_index,
    window_attention,
    window_partition,
)

QGL = 24
VOXEL = 0.05


def segment_softmax_torch(logits, offsets, index_0):
    """Row softmax over CSR segments with stock torch ops (stands in for torch_scatter in sptr 1.1.1)."""
    m = torch.segment_reduce(logits, "max", offsets=offsets.long(), axis=0)
    e = (logits - m[index_0]).exp()
    return e / torch.segment_reduce(e, "sum", offsets=offsets.long(), axis=0)[index_0]


def step_pipeline(ops, softmax, lay, rel_pos, q, k, v, tables):
    i0, o0, i1, o1, rel = lay["i0"], lay["o0"], lay["i1"], lay["o1"], lay["rel"]
    if rel_pos:
        logits = ops.dot_prod_with_idx_all(q, i0, o0, k, i1, o1, tables[0], tables[1], rel, lay["n_max"])
    else:
        logits = ops.attention_step1(q, k, i0, o0, i1, o1, lay["n_max"])
    attn = softmax(logits)
    if rel_pos:
        return ops.attention_step2_with_rel_pos_value(attn, v, i0, o0, lay["n_max"], i1, o1, tables[2], rel)
    return ops.attention_step2(attn, v, i0, o0, i1, o1, lay["n_max"])


def flex_block_mask(window_id, n_pad, block=128):
    """BlockMask of the windows from their CSR structure (no dense N×N evaluation): per query block, the key
    blocks of its windows; blocks inside one window are marked full (no mask_mod call)."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = window_id.device
    wid = torch.full((n_pad,), -1, dtype=torch.long, device=dev)
    wid[: window_id.numel()] = window_id
    nb = n_pad // block
    first_tok = torch.searchsorted(wid[: window_id.numel()], wid, right=False)  # window start per token
    last_tok = torch.searchsorted(wid[: window_id.numel()], wid, right=True) - 1
    pad = wid < 0
    first_tok[pad], last_tok[pad] = torch.arange(n_pad, device=dev)[pad], torch.arange(n_pad, device=dev)[pad]
    rows = torch.arange(nb, device=dev) * block
    start = first_tok[rows] // block
    end = last_tok[rows + block - 1] // block
    cnt = end - start + 1
    width = int(cnt.max())
    cand = start[:, None] + torch.arange(width, device=dev)[None]
    valid = torch.arange(width, device=dev)[None] < cnt[:, None]
    cand_c = cand.clamp(max=nb - 1)
    same_q = wid[rows] == wid[rows + block - 1]
    full = valid & same_q[:, None] & (wid[cand_c * block] == wid[rows][:, None]) & \
        (wid[cand_c * block + block - 1] == wid[rows][:, None])
    partial = valid & ~full

    def pack(sel):  # selected blocks first; kv_indices is (1, 1, nb, nb) as BlockMask expects
        order = torch.argsort((~sel).int(), dim=1, stable=True)
        idx = torch.zeros(nb, nb, dtype=torch.int32, device=dev)
        idx[:, :width] = torch.gather(cand_c, 1, order).int()
        return sel.sum(1).int()[None, None], idx[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return wid[q_idx] == wid[kv_idx]

    kv_num, kv_idx = pack(partial)
    full_num, full_idx = pack(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(n_pad, n_pad))


def layouts(xyz, batch, win):
    w = win * VOXEL
    i0, o0, n_max, i1, o1, sort_idx = get_indices_params(xyz, batch, w, False)
    order, offsets = window_partition(xyz, batch, w, False)
    assert torch.equal(order, sort_idx)
    xs = xyz[order]
    counts = (offsets[1:] - offsets[:-1]).long()
    rel = relative_position_index(xs, i0, i1, w, w / QGL, QGL, False)
    lay = dict(i0=i0, o0=o0, i1=i1, o1=o1, n_max=n_max, rel=rel, offsets=offsets, counts=counts,
               coords=quantised_coords(xs, w, w / QGL, False), N=xyz.shape[0], M=i0.numel(), W=counts.numel())
    lay["window_id"] = torch.repeat_interleave(torch.arange(lay["W"], device=xyz.device), counts)
    slot = torch.arange(lay["N"], device=xyz.device) - offsets[:-1].long()[lay["window_id"]]
    lay["pad_index"] = (lay["window_id"], slot)
    return lay


def implementations(lay, sptr111, h, d):
    n = lay["N"]
    fused_rel = lambda t: RelativePosition(lay["coords"], QGL - 1, *t)  # noqa: E731
    fused = lambda rp, q, k, v, t: window_attention(q, k, v, lay["offsets"], rel_pos=fused_rel(t) if rp else None,  # noqa: E731
                                                    scale=1.0)

    def fused_unchecked(rp, q, k, v, t):
        with data_checks(False):
            return fused(rp, q, k, v, t)
    shifted = lay["coords"] + 32  # every relative position kept, cells past the one-hot kernel's [0, 24)

    def fused_gather(rp, q, k, v, t):
        if not rp:
            return None
        with data_checks(False):
            return window_attention(q, k, v, lay["offsets"], rel_pos=RelativePosition(shifted, QGL - 1, *t), scale=1.0)
    impls = {
        "fused": fused,
        "fused unchecked": fused_unchecked,
        "fused gather kernel": fused_gather,
        "step": lambda rp, q, k, v, t: step_pipeline(sptr, lambda x: sptr.scatter_softmax_csr(x, lay["o0"]), lay, rp,
                                                     q, k, v, t),
    }
    if sptr111 is not None:
        lay111 = dict(lay, rel=lay["rel"].to(torch.int8))  # 1.1.1 reads rel_idx as int8 (D6)
        i0 = lay["i0"].long()
        impls["sptr 1.1.1"] = lambda rp, q, k, v, t: step_pipeline(
            sptr111, lambda x: segment_softmax_torch(x, lay["o0"], i0), lay111, rp, q, k, v, t)
    n_pad = (n + 127) // 128 * 128
    try:
        from torch.nn.attention.flex_attention import flex_attention
        mask = flex_block_mask(lay["window_id"], n_pad)
        flex = torch.compile(flex_attention, dynamic=False)

        def run_flex(rp, q, k, v, t):
            if rp:
                return None
            padded = [F.pad(x.transpose(0, 1)[None], (0, 0, 0, n_pad - n)) for x in (q, k, v)]
            return flex(*padded, block_mask=mask, scale=1.0)[0, :, :n].transpose(0, 1)
        impls["flex"] = run_flex
    except Exception as exc:  # noqa: BLE001
        print(f"FlexAttention unavailable: {exc}")
    wid, slot = lay["pad_index"]
    key_ok = torch.zeros(lay["W"], lay["n_max"], dtype=torch.bool, device=wid.device)
    key_ok[wid, slot] = True
    key_ok = key_ok[:, None, None, :]

    def run_sdpa(rp, q, k, v, t):
        if rp:
            return None
        def pad(x):
            out = x.new_zeros(lay["W"], lay["n_max"], h, d)
            return out.index_put((wid, slot), x).transpose(1, 2)
        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=key_ok, scale=1.0)
        return o.transpose(1, 2)[wid, slot]
    impls["padded sdpa"] = run_sdpa
    try:
        from torch.nn.attention.varlen import varlen_attn
        cu, longest = lay["offsets"].int(), int(lay["counts"].max())
        impls["flash varlen"] = lambda rp, q, k, v, t: None if rp or q.dtype == torch.float32 else varlen_attn(
            q, k, v, cu, cu, longest, longest, scale=1.0)
    except ImportError as exc:
        print(f"torch varlen_attn unavailable: {exc}")
    return impls


def measure(fn, rp, q, k, v, tables, grad, repeat):
    if fn(rp, q, k, v, tables) is None:
        return None
    with torch.no_grad():
        t_f = time_ms(lambda: fn(rp, q, k, v, tables), 2, repeat)
    both = lambda: fn(rp, q, k, v, tables).backward(grad)  # noqa: E731
    first = time_ms(both, 0, 1)  # seconds-long backward passes (sptr 1.1.1's rel pos) get fewer repeats
    t_b = time_ms(both, 1 if first > 500 else 2, repeat if first < 100 else max(2, int(1000 / first)))
    with torch.no_grad():
        m_f = peak_mb(lambda: fn(rp, q, k, v, tables))
    m_b = peak_mb(both)
    return t_f, t_b, m_f, m_b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voxels", type=int, default=270_000)
    ap.add_argument("--window", type=float, nargs="+", default=[12, 6], help="window side in voxels")
    ap.add_argument("--heads", type=str, nargs="+", default=["4x32", "4x16"])
    ap.add_argument("--dtypes", type=str, nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--impls", type=str, nargs="+", default=None,
                    help="implementations to run (spaces in names written as _, e.g. sptr_1.1.1)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", type=str, default=None, help="append one JSON line per measurement")
    args = ap.parse_args()
    try:
        import sptr111.functional as sptr111
    except ImportError as exc:
        print(f"sptr 1.1.1 (as sptr111) not importable, column skipped: {exc}")
        sptr111 = None
    dev = "cuda"
    xyz, batch = lidar_voxels(args.voxels)
    xyz, batch = xyz.to(dev), batch.to(dev)
    warm_up_gpu()
    rows = []
    for win in args.window:
        lay = layouts(xyz, batch, win)
        print(f"window {win:g} voxels: N {lay['N']}, windows {lay['W']}, M {lay['M'] / 1e6:.1f} M pairs, "
              f"n_max {lay['n_max']}", flush=True)
        for hd in args.heads:
            h, d = (int(x) for x in hd.split("x"))
            impls = implementations(lay, sptr111, h, d)
            for dname in args.dtypes:
                dtype = getattr(torch, dname)
                g = torch.Generator(device=dev).manual_seed(0)
                mk = lambda *s: torch.randn(*s, device=dev, generator=g).to(dtype).requires_grad_()  # noqa: E731
                q, k, v = (mk(lay["N"], h, d) * (d ** -0.25)).detach().requires_grad_(), mk(lay["N"], h, d), \
                    mk(lay["N"], h, d)
                tables = [(mk(2 * QGL - 1, 3, h, d) * 0.05).detach().requires_grad_() for _ in range(3)]
                grad = torch.randn(lay["N"], h, d, device=dev, dtype=dtype)
                io = 4 * lay["N"] * h * d * q.element_size()
                for rp in (False, True):
                    res = {}
                    for name, fn in impls.items():
                        if args.impls and name.replace(" ", "_") not in args.impls:
                            continue
                        try:
                            r = measure(fn, rp, q, k, v, tables, grad, args.repeat)
                        except torch.OutOfMemoryError:
                            r = "OOM"
                        except Exception as exc:  # noqa: BLE001
                            print(f"{name} failed: {type(exc).__name__}: {str(exc)[:200]}")
                            r = "error"
                        for x in (q, k, v, *tables):
                            x.grad = None
                        torch.cuda.empty_cache()
                        if r is None:
                            continue
                        res[name] = r
                        rec = dict(window=win, N=lay["N"], M=lay["M"], n_max=lay["n_max"], h=h, d=d, dtype=dname,
                                   path="rel pos" if rp else "plain", impl=name, result=r)
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps(rec) + "\n")
                    base = res.get("fused unchecked", res.get("fused"))  # what the layers run
                    flops = 4 * lay["M"] * h * d
                    for name, r in res.items():
                        if isinstance(r, str) or not isinstance(base, tuple):
                            rows.append([f"{win:g}", hd, dname, "rel pos" if rp else "plain", name, r, "", "", "", "",
                                         "", ""])
                        else:
                            t_f, t_b, m_f, m_b = r
                            limit_f = max(flops / BF16_FLOPS, io / HBM_BYTES_PER_S) * 1e3
                            limit_b = max(3.5 * flops / BF16_FLOPS, 3 * io / HBM_BYTES_PER_S) * 1e3
                            rows.append([f"{win:g}", hd, dname, "rel pos" if rp else "plain", name, f"{t_f:.3f}",
                                         f"{t_f / base[0]:.1f}x", f"{t_b:.3f}", f"{t_b / base[1]:.1f}x",
                                         f"{m_b:.0f}", f"{m_b * 2**20 / io:.2f}",
                                         f"{100 * limit_f / t_f:.1f}% / {100 * limit_b / t_b:.1f}%"])
                        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    print()
    print(table(rows, ["win", "hxd", "dtype", "path", "impl", "fwd ms", "vs unchecked", "f+b ms", "vs unchecked",
                       "f+b extra MB", "extra / qkvo", "limit frac fwd / f+b"]))


if __name__ == "__main__":
    main()
