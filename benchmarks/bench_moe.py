"""MoE ops on the GPU against the alternatives a user would pick, in one run (issue 10's shapes).

1. permute + unpermute, x [6144, 2048] bf16, K = 1 (2 experts, ~15 % on expert 1), 2 and 8 (8 experts):
   sptr vs a stable argsort + index_select / index_add implementation (eager and torch.compile), as µs per
   call (eager, and replayed from a CUDA graph = GPU time alone: a graph of one call, which also times the
   replay's start, and of ten calls, per call), GB/s and the share of the 4.3 TB/s copy.
2. asym_dual_gmm bf16 / fp16 at (m0, m1) in {(3000, 700), (16384, 2048), (64, 64), (1, 5000)}, k 2048 / 4096,
   n1 = k/2 and n0 = 4k/3 rounded up to a multiple of 8 (2736, 5464: the 16-byte rows TMA needs; bf16 also
   at the unrounded 2730 / 5461): sptr (auto dispatch), the sync-free grouped GEMM (device offsets, as the
   layers use it: CUTLASS on sm_90a builds, and the mma.sync kernel it replaces there, SPTR_GROUPED_GEMM=mma),
   two cuBLAS torch.mm calls, and torch._grouped_mm with expert 1 padded to n0 (bf16 only), as TFLOP/s and
   the share of 790 TFLOP/s; each call timed with CUDA events around it and as GPU time alone (a replayed
   CUDA graph of ten calls, per call: the issue's measure for the small problems, whose events also time the
   host's launches). The header line says whether this build has the CUTLASS kernel (9.0a in
   TORCH_CUDA_ARCH_LIST).
3. DualExpertFFN forward+backward at T = 8192, H = 2048, intermediate (11008, 2048), 15 % action tokens,
   bf16: sptr (cuBLAS per expert after one offsets read; the sync-free grouped GEMM, CUTLASS and mma.sync,
   eager and under torch.compile(fullgraph=True), also with mode="reduce-overhead": CUDA graphs, which only a
   sync-free layer allows) vs the plain two-expert module, eager and compiled (both modes).
4. RoutedExpertFFN forward+backward (8 experts of width 1408, top 2; T = 8192, H = 2048, bf16): cuBLAS per
   expert and the grouped GEMM (eager and compiled, both modes) vs transformers' MixtralSparseMoeBlock with its
   weights.
5. shares: part 3's forward+backward, cuBLAS per expert against the grouped GEMM, at 5-50 % action tokens
   (each share's rows interleaved over three rounds, best round), since the two paths tile the experts' rows
   differently.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BF16_FLOPS, HBM_BYTES_PER_S, graph_ms, table, time_ms, warm_up_gpu  # noqa: E402

from sptr import _C  # noqa: E402
from sptr.layers import DualExpertFFN, RoutedExpertFFN  # noqa: E402
from sptr.ops import moe  # noqa: E402
from sptr.reference.moe import PlainDualExpertFFN  # noqa: E402


def torch_permute(x, ids):
    T, K = ids.shape
    order = torch.sort(ids.reshape(-1), stable=True).indices
    return x.index_select(0, order // K), order


def torch_unpermute(y, order, probs):
    T, K = probs.shape
    w = probs.reshape(-1)[order].to(torch.float32)
    out = torch.zeros(T, y.shape[1], device=y.device, dtype=torch.float32)
    out.index_add_(0, order // K, y.float() * w[:, None])
    return out.to(y.dtype)


def routing_rows(impl_names=None):
    T, H = 6144, 2048
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    rows = []
    compiled_permute = torch.compile(torch_permute)
    compiled_unpermute = torch.compile(torch_unpermute)
    for K, E in ((1, 2), (2, 8), (8, 8)):
        ids = (torch.rand(T, 1, device="cuda") < 0.15).long() if K == 1 else torch.rand(T, E, device="cuda").topk(K, -1).indices
        probs = torch.rand(T, K, device="cuda")
        perm = moe.permute(x, ids, E)
        y = perm.x_perm.clone()
        _, order = torch_permute(x, ids)
        y_t = y.clone()
        gb = 2 * H * T * (1 + K) / 1e9
        impls = [
            ("sptr", lambda: moe.permute(x, ids, E), lambda: moe.unpermute(y, perm.row_id_map, probs)),
            ("argsort+index_select", lambda: torch_permute(x, ids), lambda: torch_unpermute(y_t, order, probs)),
            ("same, torch.compile", lambda: compiled_permute(x, ids), lambda: compiled_unpermute(y_t, order, probs)),
        ]
        for name, fp, fu in impls:
            if impl_names and name not in impl_names:
                continue
            for op, fn in (("permute", fp), ("unpermute", fu)):
                eager = time_ms(fn) * 1e3
                try:  # a replayed graph of one call also times the replay's own start (~5 µs); of ten, per call
                    gpu1, gpu = graph_ms(fn) * 1e3, graph_ms(fn, calls=10) * 1e3
                except Exception as exc:  # noqa: BLE001 - a peer that cannot be captured
                    gpu1 = gpu = float("nan")
                    print(f"# {name} {op} K={K}: no CUDA graph ({type(exc).__name__})")
                best = min(eager, gpu) if gpu == gpu else eager
                rows.append([op, K, name, f"{eager:.1f}", f"{gpu1:.1f}", f"{gpu:.1f}", f"{gb / (best * 1e-6):.0f}",
                             f"{100 * gb * 1e9 / (best * 1e-6) / HBM_BYTES_PER_S:.0f}%"])
    print(table(rows, ["op", "K", "impl", "eager µs", "graph µs, 1 call", "graph µs, 10 calls", "GB/s",
                       "of 4.3 TB/s"]))


def with_env(fn, **env):
    """fn run with the given environment variables set (the kernel switches that the extension reads per call)."""
    def run():
        os.environ.update(env)
        try:
            return fn()
        finally:
            for key in env:
                del os.environ[key]
    return run


def same(fn):
    """fn as it is (the table rows' default wrapper)."""
    return fn


def mma_kernel(fn):
    """fn run with SPTR_GROUPED_GEMM=mma: the mma.sync grouped kernel where the CUTLASS one would run."""
    return with_env(fn, SPTR_GROUPED_GEMM="mma")


def gemm_rows(dtypes):
    rows = []
    for dtype in dtypes:
        for k, rounded in ((2048, True), (4096, True), (2048, False), (4096, False)):
            if not rounded and dtype != torch.bfloat16:
                continue
            n0, n1 = (4 * k) // 3, k // 2
            n0 = (n0 + 7) // 8 * 8 if rounded else n0
            for m0, m1 in ((3000, 700), (16384, 2048), (64, 64), (1, 5000)):
                a0 = torch.randn(m0, k, device="cuda", dtype=dtype)
                a1 = torch.randn(m1, k, device="cuda", dtype=dtype)
                w0 = torch.randn(k, n0, device="cuda", dtype=dtype) / k ** 0.5
                w1 = torch.randn(k, n1, device="cuda", dtype=dtype) / k ** 0.5
                flop = 2 * k * (m0 * n0 + m1 * n1)
                x = torch.cat([a0, a1])
                off = torch.tensor([0, m0, m0 + m1], device="cuda")
                wt0, wt1 = w0.t().contiguous(), w1.t().contiguous()
                impls = [
                    ("sptr asym_dual_gmm", lambda: moe.asym_dual_gmm(a0, a1, w0, w1)),
                    ("sptr grouped (no sync)", lambda: moe.grouped_linear(x, [wt0, wt1], off)),
                    ("sptr grouped, mma.sync", mma_kernel(lambda: moe.grouped_linear(x, [wt0, wt1], off))),
                    ("2x cuBLAS torch.mm", lambda: (a0 @ w0, a1 @ w1)),
                ]
                if dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
                    wpad = torch.zeros(2, k, n0, device="cuda", dtype=dtype)
                    wpad[0], wpad[1, :, :n1] = w0, w1
                    offs = off[1:].to(torch.int32)
                    impls.append(("torch._grouped_mm (padded)", lambda: torch._grouped_mm(x, wpad, offs=offs)))
                first = len(rows)
                for name, fn in impls:
                    try:
                        ms = time_ms(fn)
                    except Exception as exc:  # noqa: BLE001
                        print(f"# {name} {m0},{m1},{k}: {type(exc).__name__}: {exc}")
                        continue
                    try:  # GPU time alone: the small problems' events also time the host's launches
                        gpu = graph_ms(fn, calls=10)
                    except Exception as exc:  # noqa: BLE001 - a call that cannot be captured
                        print(f"# {name} {m0},{m1},{k}: no CUDA graph ({type(exc).__name__})")
                        gpu = float("nan")
                    best = min(ms, gpu) if gpu == gpu else ms
                    rows.append([str(dtype).replace("torch.", ""), f"{m0},{m1}", k, f"{n0},{n1}", name,
                                 f"{ms * 1e3:.1f}", f"{gpu * 1e3:.1f}", f"{flop / best / 1e9:.0f}",
                                 f"{100 * flop / best / 1e-3 / BF16_FLOPS:.0f}%"])
                cublas = next(r for r in rows[::-1] if r[4].startswith("2x cuBLAS"))
                for r in rows[first:]:
                    r.append(f"{float(cublas[5]) / float(r[5]):.2f}x")
                    r.append(f"{float(cublas[6]) / float(r[6]):.2f}x" if r[6] != "nan" else "-")
    print(table(rows, ["dtype", "m0,m1", "k", "n0,n1", "impl", "events µs", "GPU µs", "TFLOP/s", "of 790",
                       "vs 2x cuBLAS", "GPU vs 2x cuBLAS"]))


def graph_steps(fn):
    """For torch.compile(mode="reduce-overhead"), whose CUDA graphs (cudagraph trees) replay each step: every call
    a new step, so that a forward without its backward is replayed too."""
    def run():
        torch.compiler.cudagraph_mark_step_begin()
        return fn()
    return run


def training_step(m, forward, x, g):
    """One forward+backward of module m as a training step runs it: x's and the weights' gradients cleared first
    (no accumulation into the last step's), then forward(m)'s output takes the gradient g."""
    def step():
        x.grad = None
        m.zero_grad(set_to_none=True)
        forward(m).backward(g)
    return step


def layer_table(impls, forward, x, g, flop):
    """ms forward / forward+backward (training_step) of each (name, module, wrap) impl, forward(m) giving the
    output that takes the gradient g."""
    rows = []
    for name, m, wrap in impls:
        try:
            fwd = time_ms(wrap(lambda m=m: forward(m)))
            both = time_ms(wrap(training_step(m, forward, x, g)))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            rows.append([name, "failed", f"{type(exc).__name__}: {str(exc)[:60]}", "", ""])
            continue
        rows.append([name, f"{fwd:.2f}", f"{both:.2f}", f"{flop / both / 1e9:.0f}",
                     f"{100 * flop / both / 1e-3 / BF16_FLOPS:.0f}%"])
    for r in rows:
        r.append(f"{float(r[2]) / float(rows[0][2]):.2f}x" if r[1] != "failed" else "")
    print(table(rows, ["impl", "fwd ms", "fwd+bwd ms", "TFLOP/s (f+b)", "of 790", "time vs sptr"]))


FFN_SHAPE = (8192, 2048, (11008, 2048))  # T, H, the two experts' widths


def ffn_case():
    """The FFN table's plain two-expert module (bf16), its input x [T, H], the expert index (~15 % on expert 1)
    and the output's gradient."""
    T, H, inter = FFN_SHAPE
    torch.manual_seed(0)
    plain = PlainDualExpertFFN(H, inter).cuda().to(torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    index = (torch.rand(T, device="cuda") < 0.15).long()
    g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    return plain, x, index, g


def ffn_rows():
    _, H, inter = FFN_SHAPE
    plain, x, index, g = ffn_case()
    fused = DualExpertFFN.from_plain(plain, gemm="cublas")
    grouped = DualExpertFFN.from_plain(plain, gemm="grouped")
    compiled = torch.compile(plain)
    flop = 3 * 2 * H * 3 * sum(int((index == e).sum()) * i for e, i in enumerate(inter))
    impls = (("sptr DualExpertFFN, cuBLAS per expert (one sync)", fused, same),
             ("sptr DualExpertFFN, grouped (no sync)", grouped, same),
             ("sptr grouped, torch.compile(fullgraph)", torch.compile(grouped, fullgraph=True), same),
             ("sptr grouped, torch.compile(fullgraph, reduce-overhead)",
              torch.compile(grouped, fullgraph=True, mode="reduce-overhead"), graph_steps),
             ("sptr grouped, mma.sync kernel", grouped, mma_kernel),
             ("plain module", plain, same), ("plain, torch.compile", compiled, same),
             ("plain, torch.compile(reduce-overhead)", torch.compile(plain, mode="reduce-overhead"), graph_steps))
    layer_table(impls, lambda m: m(x, index), x, g, flop)


def share_rows():
    """Part 3's training step, cuBLAS per expert against the grouped GEMM, at 5-50 % action tokens: best of three
    interleaved rounds per share."""
    plain, x, _, g = ffn_case()
    layers = {gemm: DualExpertFFN.from_plain(plain, gemm=gemm) for gemm in ("cublas", "grouped")}
    T = x.shape[0]
    rows = []
    for share in (0.05, 0.10, 0.15, 0.20, 0.30, 0.50):
        index = torch.zeros(T, dtype=torch.long, device="cuda")
        index[torch.randperm(T, device="cuda")[:int(T * share)]] = 1
        ms = {gemm: [] for gemm in layers}
        for _ in range(3):
            for gemm, m in layers.items():
                ms[gemm].append(time_ms(training_step(m, lambda m: m(x, index), x, g), repeat=10))
        cublas, grouped = min(ms["cublas"]), min(ms["grouped"])
        rows.append([f"{int(T * share)} ({share:.0%})", f"{cublas:.2f}", f"{grouped:.2f}", f"{grouped / cublas:.3f}"])
    print(table(rows, ["action rows", "cuBLAS per expert f+b ms", "grouped f+b ms", "grouped / cuBLAS"]))


def routed_rows():
    """RoutedExpertFFN (8 experts of width 1408, top 2: configs/moe.yaml's routed layer) against transformers'
    MixtralSparseMoeBlock with the same weights, T = 8192, H = 2048, bf16."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    T, H, inter, E, K = 8192, 2048, 1408, 8, 2
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=inter, num_local_experts=E,
                                        num_experts_per_tok=K)
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():  # transformers 5.x allocates its stacked experts uninitialised
        for p in block.parameters():
            p.normal_(0, H ** -0.5)
    block = block.cuda().to(torch.bfloat16)
    cublas = RoutedExpertFFN.from_plain(block, top_k=K, gemm="cublas").cuda().to(torch.bfloat16)
    grouped = RoutedExpertFFN.from_plain(block, top_k=K, gemm="grouped").cuda().to(torch.bfloat16)
    x = torch.randn(4, T // 4, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    flop = 3 * 2 * H * 3 * inter * T * K
    impls = (("sptr RoutedExpertFFN, cuBLAS per expert (one sync)", cublas, same),
             ("sptr RoutedExpertFFN, grouped (no sync)", grouped, same),
             ("sptr grouped, torch.compile(fullgraph)", torch.compile(grouped, fullgraph=True), same),
             ("sptr grouped, torch.compile(fullgraph, reduce-overhead)",
              torch.compile(grouped, fullgraph=True, mode="reduce-overhead"), graph_steps),
             ("transformers MixtralSparseMoeBlock", block, same))
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731  (4.x: (out, logits); 5.x: out)
    layer_table(impls, lambda m: first(m(x)), x, g, flop)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="routing,gemm,ffn,routed,shares")
    parser.add_argument("--routing-impls", nargs="+", help="only these rows of the routing table (e.g. sptr)")
    args = parser.parse_args()
    warm_up_gpu()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    # Without the sm_90a CUTLASS units (TORCH_CUDA_ARCH_LIST without 9.0a), "grouped" rows are the mma.sync kernel.
    print("grouped GEMM kernel on this build and GPU:",
          "CUTLASS sm_90a" if _C.sm90_grouped_gemm_runs() else "mma.sync")
    parts = set(args.parts.split(","))
    if "routing" in parts:
        routing_rows(args.routing_impls)
    if "gemm" in parts:
        gemm_rows([torch.bfloat16, torch.float16])
    if "ffn" in parts:
        ffn_rows()
    if "routed" in parts:
        routed_rows()
    if "shares" in parts:
        share_rows()
