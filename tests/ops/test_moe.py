"""MoE ops against the pure-PyTorch references of sptr.reference.moe: permute / unpermute (bit-exact rows and
maps; fp32-accumulated combines against float64), grouped SwiGLU, grouped linear and the dual GEMM; opcheck,
float64 gradcheck, bad input, determinism, CUDA-graph capture."""
import pytest
import torch

from sptr.ops import moe
from sptr.reference import moe as ref
from tests.helpers import LOW_PRECISION, TOLERANCE, assert_close, device_params, requires_cuda

DTYPES = [torch.float32, *LOW_PRECISION]


def routing(T, K, E, device, seed, negative=0.0, one_expert=None, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, K), generator=g)
    if one_expert is not None:
        ids.fill_(one_expert)
    if negative:
        ids[torch.rand(T, K, generator=g) < negative] = -1
    return ids.to(dtype).to(device)


# ----------------------------------------------------------------------------------------------- permute
def test_published_example():
    ids = torch.tensor([[1, 2], [0, 1], [0, 2], [1, 2]])
    x = torch.arange(4.0)[:, None].repeat(1, 3)
    perm = moe.permute(x, ids, 3)
    assert perm.row_id_map.tolist() == [2, 0, 1, 4, 5, 3, 6, 7]
    assert perm.tokens_per_expert.tolist() == [2, 3, 3] and perm.expert_offsets.tolist() == [0, 2, 5, 8]
    assert perm.x_perm[:, 0].tolist() == [1, 2, 0, 1, 3, 0, 2, 3]
    capped = moe.permute(x, ids, 3, num_out_tokens=6)
    assert capped.row_id_map.tolist() == [2, 0, 1, 4, 5, 3, -1, -1]
    assert capped.tokens_per_expert.tolist() == [2, 3, 1]


@pytest.mark.parametrize("device", device_params())
# Up to 18,000 slots (71 routing chunks on CUDA) and 100 experts; (1100, 8, 64) has a histogram table past
# 2048 entries (the scan kernel's layout), the others are laid out by the rank kernel's CTAs.
@pytest.mark.parametrize("T,K,E", [(0, 2, 3), (1, 1, 1), (37, 1, 2), (50, 2, 5), (33, 3, 4), (40, 8, 8), (9, 16, 3),
                                   (4500, 4, 6), (300, 2, 100), (1100, 8, 64)])
@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("dtype", DTYPES)
# H = 24: 16-byte vectors on CUDA (a few per row); 9: single elements; 1032: more vectors than a block has threads
@pytest.mark.parametrize("H", [24, 9, 1032])
def test_permute_matches_reference(device, T, K, E, align, dtype, H):
    x = torch.randn(T, H).to(dtype).to(device)
    for case, ids in enumerate([routing(T, K, E, device, T + K), routing(T, K, E, device, 7, negative=0.3),
                                routing(T, K, E, device, 1, one_expert=E - 1)]):
        for num_out in (None, (T * K) // 2):
            got = moe.permute(x, ids, E, num_out, align=align)
            want_x, want_map, want_counts = ref.permute_reference(x, ids, E, num_out)
            assert torch.equal(got.row_id_map.cpu(), _aligned_map(want_map, want_counts, align).cpu()), case
            assert torch.equal(got.tokens_per_expert.cpu(), want_counts.cpu())
            rows = got.row_id_map.long()
            kept = rows >= 0
            tok = torch.arange(T, device=device).repeat(K)
            assert torch.equal(got.x_perm[rows[kept]], x[tok[kept]])
            covered = torch.zeros(got.x_perm.shape[0], dtype=torch.bool, device=device)
            covered[rows[kept]] = True
            assert not got.x_perm[~covered].any(), "rows of no copy must be zero"
            assert got.x_perm.shape[0] == (num_out if num_out is not None else T * K) + (E * (align - 1) if align > 1 else 0)


def _aligned_map(row_id_map, counts, align):
    """The reference map with every expert's rows moved to its aligned offset."""
    starts = torch.cumsum(counts, 0) - counts
    aligned = torch.cumsum((counts + align - 1) // align * align, 0) - (counts + align - 1) // align * align
    rows = row_id_map.long()
    expert = torch.searchsorted(torch.cumsum(counts, 0), rows, right=True)
    moved = rows - starts[expert.clamp_max(len(counts) - 1)] + aligned[expert.clamp_max(len(counts) - 1)]
    return torch.where(rows >= 0, moved, rows).to(torch.int32)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_permute_index_dtypes(device, ids_dtype):
    x = torch.randn(20, 8, device=device)
    ids = torch.randint(0, 2, (20,)).to(ids_dtype).to(device)
    got = moe.permute(x, ids, 2)
    want = ref.permute_reference(x, ids.long()[:, None], 2)
    assert torch.equal(got.x_perm, want[0]) and torch.equal(got.row_id_map, want[1].to(device))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_backward_sums_copies(device, dtype):
    T, K, E, H = 30, 3, 4, 16
    x = torch.randn(T, H).to(dtype).to(device).requires_grad_()
    ids = routing(T, K, E, device, 3, negative=0.2)
    perm = moe.permute(x, ids, E)
    g = torch.randn_like(perm.x_perm)
    perm.x_perm.backward(g)
    want = ref.unpermute_reference(g.double(), perm.row_id_map, None, T)
    assert_close("dx", x.grad, want, TOLERANCE[dtype])
    if K == 1 or dtype == torch.float32:
        return
    # K = 1: exactly the gathered rows
    x1 = x.detach().clone().requires_grad_()
    p1 = moe.permute(x1, ids[:, :1], E)
    g1 = torch.randn_like(p1.x_perm)
    p1.x_perm.backward(g1)
    assert torch.equal(x1.grad, ref.unpermute_reference(g1, p1.row_id_map, None, T))


# --------------------------------------------------------------------------------------------- unpermute
@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("K", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("probs_kind", ["none", "fp32", "bf16"])
# H = 250: rows of single elements on CUDA; 536: 16-byte vectors, with two per thread for a few columns
@pytest.mark.parametrize("H", [250, 536])
def test_unpermute_forward_and_backward(device, K, dtype, probs_kind, H):
    torch.manual_seed(K)
    T, E = 41, 5
    x = torch.randn(T, H).to(dtype).to(device)
    ids = routing(T, K, E, device, K, negative=0.1)
    perm = moe.permute(x, ids, E, num_out_tokens=(T * K * 3) // 4)
    y = torch.randn_like(perm.x_perm).requires_grad_()
    probs = None
    if probs_kind != "none":
        probs = torch.rand(T, K).to(torch.float32 if probs_kind == "fp32" else torch.bfloat16).to(device)
        probs.requires_grad_()
    num_tokens = T if probs is None else None  # with probs, T comes from their shape
    out = moe.unpermute(y, perm.row_id_map, probs, num_tokens)
    y64 = y.detach().double().requires_grad_()
    p64 = None if probs is None else probs.detach().double().requires_grad_()
    want = ref.unpermute_reference(y64, perm.row_id_map, p64, T)
    assert out.dtype == dtype
    assert_close("out", out, want, TOLERANCE[dtype])
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g.double())
    assert_close("d x_perm", y.grad, y64.grad, TOLERANCE[dtype])
    if probs is not None:
        assert probs.grad.dtype == probs.dtype
        assert_close("d probs", probs.grad, p64.grad, TOLERANCE[probs.dtype])


@pytest.mark.parametrize("device", device_params())
def test_unpermute_k1_uses_probs(device):
    """The published kernel ignores probs at K = 1 and leaves their gradient uninitialised."""
    x = torch.randn(6, 4, device=device)
    perm = moe.permute(x, torch.tensor([0, 1, 1, 0, 1, 0], device=device), 2)
    probs = torch.tensor([[0.5], [2.0], [1.0], [0.0], [3.0], [1.5]], device=device, requires_grad=True)
    out = moe.unpermute(perm.x_perm, perm.row_id_map, probs)
    assert torch.equal(out, x * probs.detach())
    out.sum().backward()
    assert torch.allclose(probs.grad[:, 0], x.sum(1))


# ------------------------------------------------------------------------------- swiglu, grouped linear
def offsets_of(counts, device):
    return torch.tensor([0] + list(torch.cumsum(torch.tensor(counts), 0)), dtype=torch.int64, device=device)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("widths, pad", [([7, 3, 12], 1), ([16, 8, 24], 8)], ids=["odd", "16-byte"])
def test_swiglu_matches_reference(device, dtype, widths, pad):
    counts = [5, 0, 9]
    R = sum(counts) + 3  # rows past the last group
    h = torch.randn(R, 2 * max(widths) + pad).to(dtype).to(device).requires_grad_()
    off = offsets_of(counts, device)
    out = moe.swiglu(h, off, widths)
    h64 = h.detach().double().requires_grad_()
    want = torch.zeros(R, max(widths), dtype=torch.float64, device=device)
    for g, w in enumerate(widths):
        lo, hi = int(off[g]), int(off[g + 1])
        want[lo:hi, :w] = torch.nn.functional.silu(h64[lo:hi, :w]) * h64[lo:hi, w:2 * w]
    assert_close("swiglu", out, want, TOLERANCE[dtype])
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g.double())
    assert_close("d h", h.grad, h64.grad, TOLERANCE[dtype])


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_cuda_vector_and_scalar_kernels_agree_bitwise(dtype):
    """16-byte rows take the vector kernel; the same values at an address off by one element, the scalar one."""
    counts, widths = [6, 0, 11], [16, 8, 24]
    R, ld = sum(counts) + 2, 56
    off = offsets_of(counts, "cuda")
    h = torch.randn(R, ld, device="cuda").to(dtype)
    g = torch.randn(R, max(widths), device="cuda").to(dtype)
    shifted = [torch.empty(t.numel() + 1, device="cuda", dtype=dtype)[1:].view_as(t).copy_(t) for t in (h, g)]
    assert shifted[0].data_ptr() % 16 and shifted[0].is_contiguous()
    fwd = torch.ops.sptr.moe_swiglu_fwd
    bwd = torch.ops.sptr.moe_swiglu_bwd
    assert torch.equal(fwd(h, off, widths), fwd(shifted[0], off, widths))
    assert torch.equal(bwd(g, h, off, widths), bwd(shifted[1], shifted[0], off, widths))


GROUP_CASES = [  # counts per group, (n, k) per group, parts per group
    ([3, 0, 11], [(5, 6), (2, 6), (7, 3)], 1),
    ([16, 40], [(24, 32), (8, 32)], 2),
    ([0, 0], [(4, 8), (4, 8)], 1),
    ([129, 70, 1], [(130, 72), (33, 64), (17, 72)], 2),
    ([200, 57], [(136, 264), (72, 264)], 2),  # several k blocks, a partial last one
]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(GROUP_CASES)))
def test_grouped_linear_forward_and_backward(device, dtype, case):
    torch.manual_seed(case)
    counts, shapes, P = GROUP_CASES[case]
    kx = max(k for _, k in shapes) + 2
    R = sum(counts) + 5
    x = torch.randn(R, kx).to(dtype).to(device).requires_grad_()
    weights = [torch.randn(n, k).div(k ** 0.5).to(dtype).to(device).requires_grad_() for n, k in shapes for _ in range(P)]
    off = offsets_of(counts, device)
    out = moe.grouped_linear(x, weights, off)
    x64 = x.detach().double().requires_grad_()
    w64 = [w.detach().double().requires_grad_() for w in weights]
    stacked = [torch.cat(w64[g * P:(g + 1) * P]) for g in range(len(counts))]
    want = ref.grouped_linear_reference(x64, stacked, off)
    assert_close("out", out, want, TOLERANCE[dtype])
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g.double())
    assert_close("dx", x.grad, x64.grad, TOLERANCE[dtype])
    for i, (w, wr) in enumerate(zip(weights, w64)):
        assert_close(f"dW[{i}]", w.grad, wr.grad, TOLERANCE[dtype])


# ------------------------------------------------------------------------------------------- dual GEMM
DUAL_SHAPES = [  # (m0, k0, n0), (m1, k1, n1)
    ((37, 24, 19), (5, 40, 72)),
    ((0, 16, 8), (33, 16, 24)),
    ((17, 0, 9), (8, 13, 7)),
    ((130, 72, 136), (64, 64, 64)),
    ((300, 33, 40), (260, 16, 7)),  # odd k and n at >= 256 rows: the grouped kernel on CUDA
    ((300, 33, 40), (100, 16, 8)),  # expert 0 through the grouped kernel, expert 1 through cuBLAS
]


def dual_operands(shape, ta, tb, dtype, device):
    (m, k, n) = shape
    a = torch.randn(k, m) if ta else torch.randn(m, k)
    w = torch.randn(n, k) if tb else torch.randn(k, n)
    return a.to(dtype).to(device), w.div(max(k, 1) ** 0.5).to(dtype).to(device)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("case", range(len(DUAL_SHAPES)))
def test_dual_gemm_matches_matmul(device, dtype, ta, tb, case):
    torch.manual_seed(case)
    (a0, w0), (a1, w1) = (dual_operands(s, ta, tb, dtype, device) for s in DUAL_SHAPES[case])
    leaves = [t.requires_grad_() for t in (a0, a1, w0, w1)]
    c0, c1 = moe.asym_dual_gmm(a0, a1, w0, w1, ta, tb)
    op = lambda t, tr: t.t() if tr else t  # noqa: E731
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    want0, want1 = op(l64[0], ta) @ op(l64[2], tb), op(l64[1], ta) @ op(l64[3], tb)
    assert_close("c0", c0, want0, TOLERANCE[dtype])
    assert_close("c1", c1, want1, TOLERANCE[dtype])
    g0, g1 = torch.randn_like(c0), torch.randn_like(c1)
    torch.autograd.backward([c0, c1], [g0, g1])
    torch.autograd.backward([want0, want1], [g0.double(), g1.double()])
    for name, t, r in zip(("da0", "da1", "dw0", "dw1"), leaves, l64):
        assert t.grad.shape == t.shape and t.grad.is_contiguous()
        assert_close(name, t.grad, r.grad, TOLERANCE[dtype])


@pytest.mark.parametrize("device", device_params())
def test_dual_gemm_writes_given_non_contiguous_outputs(device):
    a0, a1 = torch.randn(9, 16, device=device), torch.randn(4, 16, device=device)
    w0, w1 = torch.randn(16, 10, device=device), torch.randn(16, 3, device=device)
    c0 = torch.full((10, 9), 7.0, device=device).t()  # column-major [9, 10]
    c1 = torch.full((4, 6), 7.0, device=device)[:, ::2]
    r0, r1 = moe.asym_dual_gmm(a0, a1, w0, w1, out=(c0, c1))
    assert r0 is c0 and r1 is c1
    assert_close("c0", c0, a0.double() @ w0.double(), TOLERANCE[torch.float32])
    assert_close("c1", c1, a1.double() @ w1.double(), TOLERANCE[torch.float32])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_dual_gemm_cublas_path(dtype):
    """Shapes above the launch-bound threshold take cuBLAS; results stay within the dtype bound."""
    a0, a1 = torch.randn(1000, 2048, device="cuda").to(dtype), torch.randn(300, 2048, device="cuda").to(dtype)
    w0, w1 = (torch.randn(2048, n, device="cuda").div(45).to(dtype) for n in (1000, 512))
    c0, c1 = moe.asym_dual_gmm(a0, a1, w0, w1)
    assert_close("c0", c0, a0.double() @ w0.double(), TOLERANCE[dtype])
    assert_close("c1", c1, a1.double() @ w1.double(), TOLERANCE[dtype])


# ------------------------------------------------------------------------------ opcheck and gradcheck
@pytest.mark.parametrize("device", device_params())
def test_opcheck_every_op(device):
    T, K, E, H = 12, 2, 3, 8
    x = torch.randn(T, H, device=device, requires_grad=True)
    ids = routing(T, K, E, device, 0, negative=0.2)
    torch.library.opcheck(torch.ops.sptr.moe_permute, (x, ids, E, T * K, 1))
    torch.library.opcheck(torch.ops.sptr.moe_permute, (x, ids.int(), E, 10, 8))
    perm = moe.permute(x.detach(), ids, E)
    y = perm.x_perm.clone().requires_grad_()
    probs = torch.rand(T, K, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.sptr.moe_unpermute_fwd, (y, perm.row_id_map, probs, T))
    torch.library.opcheck(torch.ops.sptr.moe_unpermute_fwd, (y, perm.row_id_map, None, T))
    torch.library.opcheck(torch.ops.sptr.moe_unpermute_bwd, (torch.randn(T, H, device=device), y.detach(),
                                                             perm.row_id_map, probs.detach(), True))
    off = offsets_of([4, 0, 6], device)
    h = torch.randn(12, 10, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.sptr.moe_swiglu_fwd, (h, off, [3, 2, 5]))
    torch.library.opcheck(torch.ops.sptr.moe_swiglu_bwd, (torch.randn(12, 5, device=device), h.detach(), off,
                                                          [3, 2, 5]))
    xs = torch.randn(12, 6, device=device, requires_grad=True)
    ws = [torch.randn(n, 6, device=device, requires_grad=True) for n in (4, 3, 5, 2, 1, 6)]
    torch.library.opcheck(torch.ops.sptr.moe_grouped_linear, (xs, ws, off))
    torch.library.opcheck(torch.ops.sptr.moe_grouped_linear_wgrad, (torch.randn(12, 7, device=device),
                                                                    xs.detach(), off, [7, 5, 7], [6, 4, 6]))
    a0, a1 = torch.randn(5, 4, device=device, requires_grad=True), torch.randn(3, 6, device=device, requires_grad=True)
    w0, w1 = torch.randn(4, 7, device=device, requires_grad=True), torch.randn(6, 2, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.sptr.dual_gemm, (a0, a1, w0, w1, False, False))
    torch.library.opcheck(torch.ops.sptr.dual_gemm, (a0.detach().t().contiguous(), a1.detach().t().contiguous(),
                                                     w0.detach().t().contiguous(), w1.detach().t().contiguous(),
                                                     True, True))
    torch.library.opcheck(torch.ops.sptr.dual_gemm_out, (a0.detach(), a1.detach(), w0.detach(), w1.detach(), False,
                                                         False, torch.empty(5, 7, device=device),
                                                         torch.empty(3, 2, device=device)))


def test_gradcheck_float64():
    d = dict(dtype=torch.float64)
    T, K, E, H = 7, 3, 3, 5
    ids = routing(T, K, E, "cpu", 2, negative=0.2)
    x = torch.randn(T, H, **d, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: moe.permute(x, ids, E, 15, align=4).x_perm, (x,))
    perm = moe.permute(x.detach(), ids, E, 15)
    y = torch.randn_like(perm.x_perm, requires_grad=True)
    probs = torch.rand(T, K, **d, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, p: moe.unpermute(y, perm.row_id_map, p), (y, probs))
    off = offsets_of([3, 0, 4], "cpu")
    h = torch.randn(9, 9, **d, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h: moe.swiglu(h, off, [2, 1, 4]), (h,))
    xs = torch.randn(9, 5, **d, requires_grad=True)
    ws = [torch.randn(n, k, **d, requires_grad=True) for n, k in ((3, 5), (2, 5), (1, 2), (4, 2), (2, 4), (2, 4))]
    assert torch.autograd.gradcheck(lambda x, *w: moe.grouped_linear(x, w, off), (xs, *ws))
    for ta in (False, True):
        for tb in (False, True):
            ops_ = [dual_operands(s, ta, tb, torch.float64, "cpu") for s in ((4, 3, 5), (2, 6, 3))]
            leaves = [t.requires_grad_() for t in (ops_[0][0], ops_[1][0], ops_[0][1], ops_[1][1])]
            assert torch.autograd.gradcheck(lambda *t: moe.asym_dual_gmm(*t, ta, tb), leaves)


# ------------------------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="expert_ids must be < num_experts"):
        moe.permute(x, torch.tensor([0, 1, 2, 3]), 3)
    with pytest.raises(ValueError, match="expert_ids must be"):
        moe.permute(x, torch.zeros(5, dtype=torch.int64), 3)
    with pytest.raises(TypeError, match="expert_ids must have dtype"):
        moe.permute(x, torch.zeros(4), 3)
    with pytest.raises(ValueError, match="num_out_tokens"):
        moe.permute(x, torch.zeros(4, dtype=torch.int64), 3, num_out_tokens=5)
    with pytest.raises(ValueError, match="num_experts"):
        moe.permute(x, torch.zeros(4, dtype=torch.int64), 0)
    perm = moe.permute(x, torch.zeros(4, 2, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="probs must be"):
        moe.unpermute(perm.x_perm, perm.row_id_map, torch.ones(4, 3))
    with pytest.raises(ValueError, match="row_id_map must have values"):
        moe.unpermute(perm.x_perm, perm.row_id_map + 5, torch.ones(4, 2))
    with pytest.raises(ValueError, match="weight_expert1 has k = 5 but input_expert1 has k = 4"):
        moe.asym_dual_gmm(torch.randn(2, 3), torch.randn(2, 4), torch.randn(3, 2), torch.randn(5, 2))
    with pytest.raises(ValueError, match="input_expert0 must be a 2-D"):
        moe.asym_dual_gmm(torch.randn(2), torch.randn(2, 4), torch.randn(3, 2), torch.randn(4, 2))
    with pytest.raises(TypeError, match="weight_expert0 has dtype"):
        moe.asym_dual_gmm(torch.randn(2, 3), torch.randn(2, 4), torch.randn(3, 2).double(), torch.randn(4, 2))
    with pytest.raises(ValueError, match="output_expert0 must be"):
        moe.asym_dual_gmm(torch.randn(2, 3), torch.randn(2, 4), torch.randn(3, 2), torch.randn(4, 2),
                          out=(torch.empty(3, 2), torch.empty(2, 2)))
    with pytest.raises(ValueError, match="has 9 input features"):
        moe.grouped_linear(torch.randn(4, 8), [torch.randn(3, 9)], torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="widths must have one entry per group"):
        moe.swiglu(torch.randn(4, 8), torch.tensor([0, 4]), [2, 2])


# ----------------------------------------------------------------------------- determinism, CUDA graphs
@pytest.mark.parametrize("device", device_params())
def test_bitwise_reproducible(device):
    T, K, E, H = 300, 4, 6, 64
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    ids = routing(T, K, E, device, 5)
    probs = torch.rand(T, K, device=device)
    runs = []
    for _ in range(2):
        perm = moe.permute(x, ids, E)
        y = perm.x_perm.float().square().to(torch.bfloat16).requires_grad_()
        p = probs.clone().requires_grad_()
        out = moe.unpermute(y, perm.row_id_map, p)
        out.float().pow(3).sum().backward()
        runs.append((perm.x_perm, out, y.grad, p.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_permute_unpermute_no_sync_and_cuda_graph():
    T, K, E, H = 512, 2, 8, 256
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, K), device="cuda")
    probs = torch.rand(T, K, device="cuda")

    def step():
        perm = moe.permute(x, ids, E, align=8)
        return perm, moe.unpermute(perm.x_perm, perm.row_id_map, probs)

    eager_perm, eager_out = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        with torch.cuda.graph(graph, stream=stream):
            g_perm, g_out = step()
    torch.cuda.current_stream().wait_stream(stream)
    ids.copy_(torch.randint(0, E, (T, K), device="cuda"))  # new routing, same buffers
    graph.replay()
    torch.cuda.synchronize()
    want_perm, want_out = step()
    assert torch.equal(g_perm.row_id_map, want_perm.row_id_map) and torch.equal(g_out, want_out)
    assert not torch.equal(want_perm.row_id_map, eager_perm.row_id_map)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_int64_offsets_past_2_pow_31_elements():
    T, H = 2 ** 31 // 1024 + 16, 1024  # T·H > 2^31 elements
    x = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    x[-4:] = torch.arange(4, device="cuda", dtype=torch.bfloat16)[:, None]
    ids = torch.zeros(T, dtype=torch.int64, device="cuda")
    ids[-4:] = torch.tensor([1, 0, 1, 0], device="cuda")
    perm = moe.permute(x, ids, 2)
    assert torch.equal(perm.x_perm[-2:, 0].float().cpu(), torch.tensor([0.0, 2.0]))
    assert torch.equal(perm.x_perm[T - 3, :].float().cpu(), torch.full((H,), 3.0))
    del x
    out = moe.unpermute(perm.x_perm, perm.row_id_map, None, T)
    assert torch.equal(out[-4:, -1].float().cpu(), torch.arange(4.0))
