"""Fused window attention against the float64 dense reference and against the step-by-step ops."""
import dataclasses

import pytest
import torch

from sptr.ops import RelativePosition, data_checks, window_attention
from sptr.ops.sparse_attention import sparse_self_attention
from sptr.ops.windowing import get_indices_params, quantised_coords, window_partition
from sptr.reference.fused_window_attention import window_attention_reference
from tests.helpers import TABLE_TOLERANCE, TOLERANCE, assert_close, device_params

# Windows of 1 token, several that straddle a 32-token tile, one spanning three tiles, one empty.
COUNTS = [1, 5, 33, 2, 0, 70, 1, 17, 40]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TABLE_SETS = {"none": (), "qk": ("query", "key"), "qkv": ("query", "key", "value"), "v": ("value",),
              "q": ("query",), "k": ("key",)}


def offsets_of(counts, device):
    o = torch.zeros(len(counts) + 1, dtype=torch.int32)
    o[1:] = torch.cumsum(torch.tensor(counts), 0)
    return o.to(device)


def make_case(counts, h, d, dtype, device, tables=(), radial=False, seed=0, qgl=4):
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(device)  # noqa: E731
    q, k, v = rnd(n, h, d), rnd(n, h, d), rnd(n, h, d)
    rel_pos = None
    if tables:
        length = 2 * qgl - 1 + (1 if radial else 0)
        coords = torch.randint(0, qgl, (n, 3), generator=gen, dtype=torch.int32).to(device)
        named = {f"{t}_table": rnd(length, 3, h, d) * 0.5 for t in tables}
        extra = {}
        if radial:
            extra = dict(radius=(torch.rand(n, generator=gen) * 2.0).to(device), radial_a=0.0125 * 4)
        rel_pos = RelativePosition(coords, qgl - 1, **named, **extra)
    return q, k, v, offsets_of(counts, device), rel_pos


def rel_with(rel_pos, tables):
    """rel_pos with its tables replaced (None stays None)."""
    if rel_pos is None:
        return None
    tq, tk, tv = tables
    return RelativePosition(rel_pos.coords, rel_pos.rel_shift, tq, tk, tv, rel_pos.radius, rel_pos.radial_a)


def leaves(q, k, v, rel_pos, dtype=None):
    conv = lambda t: None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True)  # noqa: E731
    ql, kl, vl = conv(q), conv(k), conv(v)
    tabs = [conv(t) for t in rel_pos.tables()] if rel_pos is not None else [None] * 3
    return ql, kl, vl, tabs, rel_with(rel_pos, tabs)


def run_with_grads(fn, q, k, v, rel_pos, upstream, dtype=None, **kw):
    ql, kl, vl, tabs, rp = leaves(q, k, v, rel_pos, dtype)
    out = fn(ql, kl, vl, rp, **kw)
    out.backward(upstream.to(out.dtype))
    return out, [ql.grad, kl.grad, vl.grad] + [t.grad if t is not None else None for t in tabs]


def fused(offsets, scale):
    return lambda q, k, v, rp, **kw: window_attention(q, k, v, offsets, rel_pos=rp, scale=scale, **kw)


def reference(offsets, scale):
    return lambda q, k, v, rp: window_attention_reference(q, k, v, offsets, rp, scale)


def assert_matches_reference(q, k, v, offsets, rel_pos, scale, seed):
    """Output and every gradient of the fused op against the float64 reference, with a random upstream gradient
    (seeded), in the inputs' dtype; a table that is absent gets no gradient."""
    dtype = q.dtype
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.device)
    out, grads = run_with_grads(fused(offsets, scale), q, k, v, rel_pos, upstream)
    ref, ref_grads = run_with_grads(reference(offsets, scale), q, k, v, rel_pos, upstream, dtype=torch.float64)
    assert out.dtype == dtype
    assert_close("out", out, ref, TOLERANCE[dtype])
    for name, g, r in zip(["dq", "dk", "dv", "dTq", "dTk", "dTv"], grads, ref_grads):
        if r is None:
            assert g is None
            continue
        assert g.dtype == dtype
        assert_close(name, g, r, (TABLE_TOLERANCE if name.startswith("dT") else TOLERANCE)[dtype])


RADIAL_SETS = ("qk", "qkv", "v", "q", "k")


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])  # float64: the tile kernels' FMA path on CUDA
@pytest.mark.parametrize("tables,radial", [(t, False) for t in TABLE_SETS] + [(t, True) for t in RADIAL_SETS])
def test_forward_backward_match_reference(device, dtype, tables, radial):
    q, k, v, offsets, rel_pos = make_case(COUNTS, 2, 16, dtype, device, TABLE_SETS[tables], radial)
    assert_matches_reference(q, k, v, offsets, rel_pos, 0.3, seed=1)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # CUDA fp32: the 3xTF32 tiles of every bucket
@pytest.mark.parametrize("d", [8, 32, 48, 64, 128])
def test_head_dims(device, dtype, d):
    q, k, v, offsets, rel_pos = make_case([3, 40, 9], 3, d, dtype, device, ("query", "key", "value"))
    assert_matches_reference(q, k, v, offsets, rel_pos, d ** -0.5, seed=2)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_plain_low_precision_head_dims(device, dtype, d):
    """The tensor-core path on CUDA (fp16/bf16, no tables): windows of 1 token, windows straddling 16-row warp
    groups and 64-row tiles, one of 300 tokens (several key blocks), and a token count that is no multiple of
    the tile."""
    counts = [1, 5, 33, 2, 0, 70, 1, 17, 300, 40, 3]
    q, k, v, offsets, _ = make_case(counts, 3, d, dtype, device, seed=11)
    assert_matches_reference(q, k, v, offsets, None, d ** -0.5, seed=12)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("radial", [False, True])
@pytest.mark.parametrize("d", [16, 32])
def test_sphereformer_table_length(device, dtype, radial, d):
    """SphereFormer's tables (qgl 24: L = 47 cubic, 48 with the radial bins), head dims 16 and 32 (the 2x16 and
    4x32 benchmark shapes; at 32 the CUDA kernels' shared memory is tightest), all three tables, windows up to
    200 tokens."""
    counts = [200, 1, 64, 7, 130, 33]
    q, k, v, offsets, rel_pos = make_case(counts, 2, d, dtype, device, ("query", "key", "value"), radial, seed=13,
                                          qgl=24)
    assert_matches_reference(q, k, v, offsets, rel_pos, 0.25, seed=14)


def stored_heads_per_pass(counts, h, d, dtype):
    """Heads per pass of the CUDA one-hot backward that stores P and dS (fused_window_attention_bwd.cuh: a
    budget of 0.5x the q/k/v/out bytes in 4-byte words, one word per pair and head); 0: the recomputing kernels."""
    words = sum(counts) * h * d * torch.finfo(dtype).bits // 8 // 2
    return min(h, words // sum(n * n for n in counts))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window,per_pass", [(13, 4), (21, 3), (30, 2), (64, 1), (100, 0)],
                         ids=["one-pass", "passes-of-3-and-1", "passes-of-2", "passes-of-1", "recomputed"])
def test_onehot_backward_stored_pairs(device, dtype, window, per_pass):
    """The CUDA one-hot backward's two forms at SphereFormer's table length, 4 heads of 16: P and dS stored by
    the dk/dv kernel for the dq kernel in passes of as many heads as the buffer holds (all four, 3 + 1, 2 + 2,
    one by one), or recomputed by both kernels where one head's pairs do not fit; windows around the regime's
    size, one of 1 token, one straddling the 64-row tiles."""
    counts = [window] * 9 + [1, window + 7, window // 2]
    assert stored_heads_per_pass(counts, 4, 16, dtype) == per_pass
    q, k, v, offsets, rel_pos = make_case(counts, 4, 16, dtype, device, ("query", "key", "value"), seed=15, qgl=24)
    assert_matches_reference(q, k, v, offsets, rel_pos, 0.25, seed=16)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("radial", [False, True])
def test_cells_past_the_one_hot_range(device, dtype, radial):
    """Windows of 40 cells a side: coordinates past the CUDA one-hot kernels' 24 cells send the call to the
    gather kernel (a device flag, no host sync); the result is the same function."""
    q, k, v, offsets, rel_pos = make_case(COUNTS, 2, 16, dtype, device, ("query", "key", "value"), radial, seed=21,
                                          qgl=40)
    assert int(rel_pos.coords[:, :2].max()) >= 24
    assert_matches_reference(q, k, v, offsets, rel_pos, 0.3, seed=22)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_radial_cells_past_the_one_hot_range(device, dtype):
    """With radial bins the tables read no cell of axis 2 (the radii give its bins), so radial cells past 24
    keep the spherical one-hot forward on CUDA, whose result is the same function."""
    q, k, v, offsets, rel_pos = make_case([200, 1, 64, 7, 130, 33], 2, 16, dtype, device, ("query", "key", "value"),
                                          True, seed=25, qgl=24)
    rel_pos = dataclasses.replace(rel_pos, coords=rel_pos.coords + torch.tensor([0, 0, 40], device=device,
                                                                                dtype=torch.int32))
    assert_matches_reference(q, k, v, offsets, rel_pos, 0.3, seed=26)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_relative_positions_match_reference(device, dtype):
    """Tables shorter than the windows' span (unchecked call): relative positions past either end use the end
    rows, in the one-hot kernel's value histogram as in the reference."""
    q, k, v, offsets, rel_pos = make_case(COUNTS, 2, 16, dtype, device, ("query", "key", "value"), seed=23, qgl=24)
    short = RelativePosition(rel_pos.coords, 2, *(t[:5] for t in rel_pos.tables()))
    with data_checks(False):
        assert_matches_reference(q, k, v, offsets, short, 0.3, seed=24)


@pytest.mark.parametrize("device", device_params())
def test_large_window_and_batch_of_clouds(device):
    """One window of 1,500 tokens (47 key blocks) next to many small ones, as batched scans give."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    counts = [1500] + [3, 1, 7] * 20
    q, k, v, offsets, rel_pos = make_case(counts, 2, 32, dtype, device, ("query", "key", "value"), seed=3)
    out = window_attention(q, k, v, offsets, rel_pos=rel_pos)
    ref = window_attention_reference(*(t.double() for t in (q, k, v)), offsets,
                                     rel_with(rel_pos, [t.double() for t in rel_pos.tables()]))
    assert_close("out", out, ref, TOLERANCE[dtype])


@pytest.mark.parametrize("device", device_params())
def test_matches_step_by_step_sparse_self_attention(device):
    """Contextual mode on a real window layout equals sparse_self_attention's step ops to rounding."""
    gen = torch.Generator().manual_seed(5)
    n, h, d = 600, 2, 16
    xyz = (torch.rand(n, 3, generator=gen) * torch.tensor([2.0, 2.0, 0.6])).to(device)
    batch = (torch.arange(n) >= 350).long().to(device)
    window, quant = 0.6, 0.6 / 6
    q, k, v = (torch.randn(n, h, d, generator=gen).to(device) for _ in range(3))
    tables = [(torch.randn(11, 3, h, d, generator=gen) * 0.1).to(device) for _ in range(3)]
    for shift in (False, True):
        i0, o0, n_max, i1, o1, sort_idx = get_indices_params(xyz, batch, window, shift)
        step = sparse_self_attention(q * d ** -0.5, k, v, xyz, i0, o0, n_max, i1, o1, sort_idx, window, shift,
                                     pe_type="contextual", rel_query=True, rel_key=True, rel_value=True,
                                     quant_size=quant, quant_grid_length=6, relative_pos_query_table=tables[0],
                                     relative_pos_key_table=tables[1], relative_pos_value_table=tables[2])
        order, offsets = window_partition(xyz, batch, window, shift)
        assert torch.equal(order, sort_idx)
        coords = quantised_coords(xyz[order], window, quant, shift)
        rp = RelativePosition(coords, 5, *tables)
        out_sorted = window_attention(q[order], k[order], v[order], offsets, rel_pos=rp, scale=d ** -0.5)
        out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)
        assert_close(f"shift={shift}", out, step, TOLERANCE[torch.float32])


@pytest.mark.parametrize("device", device_params())
def test_window_sort_matches_the_pair_layout(device):
    """window_partition's one-op layout (window_sort) equals get_indices_params' order and window sizes, on
    empty, one-point and multi-batch scenes; opcheck covers its fake kernel (data-dependent window count)."""
    gen = torch.Generator().manual_seed(8)
    for n in (0, 1, 257):
        xyz = (torch.rand(n, 3, generator=gen) * 3).to(device)
        batch = (torch.arange(n) >= n // 2).long().to(device)
        for shift in (False, True):
            i0, o0, n_max, i1, o1, sort_idx = get_indices_params(xyz, batch, 0.7, shift)
            order, offsets = window_partition(xyz, batch, 0.7, shift)
            assert torch.equal(order, sort_idx) and offsets.dtype == torch.int32
            sizes = (offsets[1:] - offsets[:-1]).long()
            assert torch.equal(o0[offsets.long()[:-1]], offsets.new_tensor(
                (torch.cumsum(sizes * sizes, 0) - sizes * sizes).tolist(), dtype=o0.dtype))
    cells = torch.tensor([5, 2, 5, 9, 2, 2], device=device)
    torch.library.opcheck(torch.ops.sptr.window_sort.default, (cells,))
    order, offsets = torch.ops.sptr.window_sort(cells)
    assert order.tolist() == [1, 4, 5, 0, 2, 3] and offsets.tolist() == [0, 3, 5, 6]


@pytest.mark.parametrize("device", device_params())
def test_empty_input(device):
    q = torch.zeros(0, 2, 16, device=device, requires_grad=True)
    out = window_attention(q, q, q, torch.zeros(1, dtype=torch.int32, device=device))
    assert out.shape == (0, 2, 16)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_opcheck_and_gradcheck_cpu():
    q, k, v, offsets, rel_pos = make_case([1, 4, 6, 0, 3], 2, 5, torch.float64, "cpu",
                                          ("query", "key", "value"), radial=True, qgl=3)
    tq, tk, tv = rel_pos.tables()
    # inputs that require grad, so that opcheck also checks the autograd registration (C++, Autograd key)
    grads = [t.detach().clone().requires_grad_(True) for t in (q, k, v, tq, tk, tv)]
    args = (*grads[:3], offsets, rel_pos.coords, rel_pos.radius.float(), *grads[3:], rel_pos.rel_shift,
            rel_pos.radial_a, 0.7, False)
    torch.library.opcheck(torch.ops.sptr.window_attention_fwd.default, args)
    plain = (*grads[:3], offsets, None, None, None, None, None, 0, 0.0, 0.7, False)
    torch.library.opcheck(torch.ops.sptr.window_attention_fwd.default, plain)

    def f(q, k, v, tq, tk, tv):
        return window_attention(q, k, v, offsets, rel_pos=rel_with(rel_pos, (tq, tk, tv)), scale=0.7)

    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, tq, tk, tv)]
    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_opcheck_cuda():
    q, k, v, offsets, rel_pos = make_case(COUNTS, 2, 16, torch.float16, "cuda", ("query", "key", "value"))
    q, k, v, tq, tk, tv = (t.detach().clone().requires_grad_(True) for t in (q, k, v, *rel_pos.tables()))
    args = (q, k, v, offsets, rel_pos.coords, None, tq, tk, tv, rel_pos.rel_shift, 0.0, 0.25, False)
    torch.library.opcheck(torch.ops.sptr.window_attention_fwd.default, args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("counts,radial", [([300] * 8 + [5] * 50, False), ([20] * 60, False),
                                           ([200, 1, 64, 7, 130, 33] * 3, True)],
                         ids=["large-windows", "stored-pairs", "radial"])
def test_deterministic_backward_is_bitwise_reproducible(dtype, counts, radial):
    """Three runs give the same bits; radial: the spherical tables' kernels (fp16: the hybrid dq kernel, whose
    radial histograms take one bin per pair, and the gather dk/dv kernel)."""
    q, k, v, offsets, rel_pos = make_case(counts, 4, 16, dtype, "cuda", ("query", "key", "value"), radial, seed=7,
                                          qgl=24 if radial else 6)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to("cuda")
    runs = [run_with_grads(fused(offsets, 0.25), q, k, v, rel_pos, upstream, deterministic=True)[1]
            for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    atomic = run_with_grads(fused(offsets, 0.25), q, k, v, rel_pos, upstream)[1]
    for a, b in zip(runs[0], atomic):  # same values, up to the order of the table sums
        assert_close("deterministic vs atomic", a, b.to(a.dtype), TABLE_TOLERANCE[dtype])


@pytest.mark.parametrize("device", device_params())
def test_autocast_runs_in_the_autocast_dtype(device):
    q, k, v, offsets, rel_pos = make_case(COUNTS, 2, 16, torch.float32, device, ("query", "key", "value"))
    low = torch.bfloat16
    with torch.autocast(device, dtype=low):
        out = window_attention(q, k, v, offsets, rel_pos=rel_pos)
    assert out.dtype == low
    expected = window_attention(q.to(low), k.to(low), v.to(low), offsets,
                                rel_pos=rel_with(rel_pos, [t.to(low) for t in rel_pos.tables()]))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("device", device_params())
def test_bad_input_raises_clear_errors(device):
    q, k, v, offsets, rel_pos = make_case([3, 4], 2, 16, torch.float32, device, ("query", "key"))
    with pytest.raises(ValueError, match="window_offsets must start at 0 and end at 7"):
        window_attention(q, k, v, offsets[:-1])
    with pytest.raises(ValueError, match="same shape"):
        window_attention(q, k[:3], v, offsets)
    with pytest.raises(TypeError, match="share one dtype"):
        window_attention(q, k.double(), v, offsets)
    with pytest.raises(ValueError, match="rel_pos.coords must have values in"):
        window_attention(q, k, v, offsets, rel_pos=RelativePosition(rel_pos.coords + 5, rel_pos.rel_shift,
                                                                   *rel_pos.tables()))
    with pytest.raises(ValueError, match="rel_pos.query_table must have shape"):
        window_attention(q, k, v, offsets, rel_pos=RelativePosition(rel_pos.coords, rel_pos.rel_shift,
                                                                   rel_pos.query_table[:, :2], None))
    with pytest.raises(ValueError, match="rel_shift"):
        window_attention(q, k, v, offsets, rel_pos=RelativePosition(rel_pos.coords, 9, *rel_pos.tables()))
    with pytest.raises(ValueError, match="window_offsets must be non-decreasing"):
        window_attention(q, k, v, torch.tensor([0, 5, 2, 7], dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", device_params())
def test_checks_see_every_change_of_a_checked_tensor(device):
    """Nothing is remembered between calls: a write after a first call is seen, also one through ``.data``
    (which bumps no version counter) or, on CPU, through ``.numpy()``."""
    q, k, v, offsets, rel_pos = make_case([3, 4], 2, 16, torch.float32, device, ("query", "key"))
    window_attention(q, k, v, offsets, rel_pos=rel_pos)
    writers = [lambda t, i, x: t.data.__setitem__(i, x)]
    if device == "cpu":
        writers.append(lambda t, i, x: t.numpy().__setitem__(i, x))
    for write in writers:
        write(offsets, 1, 9)  # offsets (0, 3, 7) -> (0, 9, 7)
        with pytest.raises(ValueError, match="window_offsets must be non-decreasing"):
            window_attention(q, k, v, offsets)
        write(offsets, 1, 3)
        window_attention(q, k, v, offsets, rel_pos=rel_pos)
        write(rel_pos.coords, (0, 0), rel_pos.rel_shift + 1)
        with pytest.raises(ValueError, match="rel_pos.coords must have values in"):
            window_attention(q, k, v, offsets, rel_pos=rel_pos)
        write(rel_pos.coords, (0, 0), 0)
    # with a radius only columns 0-1 are checked
    radial = dataclasses.replace(rel_pos, radius=torch.ones(7, device=device), radial_a=0.5)
    rel_pos.coords[0, 2] = -1
    window_attention(q, k, v, offsets, rel_pos=radial)
    rel_pos.coords[1, 1] = -1
    with pytest.raises(ValueError, match="rel_pos.coords must have values in"):
        window_attention(q, k, v, offsets, rel_pos=radial)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_head_dim_limit_is_an_error():
    q = torch.randn(4, 1, 136, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim 1..128"):
        window_attention(q, q, q, torch.tensor([0, 4], dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # fp16: the one-hot kernel's range flag
def test_unchecked_bad_coords_stay_in_bounds(device, dtype):
    """Without the value checks, coordinates out of range are clamped in the kernel, never read past the
    tables (the result is unspecified but finite)."""
    q, k, v, offsets, rel_pos = make_case(COUNTS, 2, 16, dtype, device, ("query", "key", "value"))
    wild = RelativePosition(rel_pos.coords * 1000 - 7, rel_pos.rel_shift, *rel_pos.tables())
    with data_checks(False):
        out = window_attention(q, k, v, offsets, rel_pos=wild)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("device", device_params())
def test_unchecked_offsets_without_windows_raise(device):
    q = torch.randn(3, 1, 16, device=device)
    with data_checks(False), pytest.raises(ValueError, match="no window"):
        window_attention(q, q, q, torch.zeros(1, dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", device_params())
def test_window_of_thousands_of_tokens_backward(device):
    """A 3,000-token window (94 key blocks on CUDA; no n x n buffer on the CPU) next to a tiny one."""
    q, k, v, offsets, _ = make_case([3000, 2], 2, 16, torch.float32, device, seed=9)
    assert_matches_reference(q, k, v, offsets, None, 0.25, seed=10)
