"""Window attention ops against the float64 pure-PyTorch reference (spec §4, §9 defects, §10)."""
import pytest
import torch

import sptr
from sptr.ops import step_attention as wa
from sptr.reference.window_attention import (
    aggregate_reference,
    pair_logits_reference,
    precompute_all_reference,
    segment_softmax_reference,
)
from tests.helpers import ALL_DTYPES, TABLE_TOLERANCE, TOLERANCE, assert_close, device_params


def random_layout(counts, device):
    counts = torch.tensor(counts, dtype=torch.long, device=device)
    n = int(counts.sum())
    o0, o1, i0, i1 = sptr.precompute_all(n, counts.numel(), int(counts.max()) if counts.numel() else 0, counts)
    return n, o0, o1, i0, i1


def random_counts(gen, windows, max_size):
    c = torch.randint(0, max_size + 1, (windows,), generator=gen)
    c[0] = 1  # always one single-point window
    return c.tolist()


def make_inputs(n, h, d, L, M, dtype, device, gen, tables=True):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q, k, v = rnd(n, h, d), rnd(n, h, d), rnd(n, h, d)
    t = [rnd(L, 3, h, d) for _ in range(3)] if tables else [None] * 3
    rel = torch.randint(0, L, (M, 3), generator=gen).to(device)
    return q, k, v, t, rel


def grads_of(fn, inputs, upstream):
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in inputs]
    out = fn(*leaves)
    out.backward(upstream)
    return out, [x.grad if x is not None else None for x in leaves]


def as64(x):
    return None if x is None else x.detach().double()


# -------------------------------------------------------------------------------------------- precompute_all
def test_precompute_all_worked_examples():
    o0, o1, i0, i1 = sptr.precompute_all(5, 3, 2, torch.tensor([2, 1, 2]))
    assert i0.tolist() == [0, 0, 1, 1, 2, 3, 3, 4, 4]
    assert i1.tolist() == [0, 1, 0, 1, 2, 3, 4, 3, 4]
    assert o0.tolist() == [0, 2, 4, 5, 7, 9] and o1.tolist() == [0, 1, 4, 5, 6]
    o0, o1, i0, i1 = sptr.precompute_all(5, 2, 3, torch.tensor([3, 2]))
    assert o1.tolist() == [0, 1, 2, 9, 10] and o0.tolist() == [0, 3, 6, 9, 11, 13]
    assert all(t.dtype == torch.int32 for t in (o0, o1, i0, i1))


@pytest.mark.parametrize("device", device_params())
def test_precompute_all_matches_reference_with_empty_windows(device):
    gen = torch.Generator().manual_seed(0)
    counts = random_counts(gen, 40, 9) + [0, 0, 5]
    ref = precompute_all_reference(counts)
    c = torch.tensor(counts, device=device)
    for n_max in (0, 3, 1000):  # a hint only
        got = sptr.precompute_all(sum(counts), len(counts), n_max, c)
        for g, r in zip(got, ref):
            assert g.device.type == device
            assert torch.equal(g.cpu(), r)


def test_precompute_all_rejects_bad_counts():
    with pytest.raises(ValueError, match="counts must sum"):
        sptr.precompute_all(6, 2, 3, torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="counts"):
        sptr.precompute_all(1, 2, 3, torch.tensor([3, -2]))
    with pytest.raises(TypeError, match="counts"):
        sptr.precompute_all(5, 2, 3, torch.tensor([3.0, 2.0]))


def test_precompute_all_empty():
    o0, o1, i0, i1 = sptr.precompute_all(0, 0, 0, torch.zeros(0, dtype=torch.long))
    assert o0.tolist() == [0] and o1.numel() == 0 and i0.numel() == 0


# ------------------------------------------------------------------------------------- forward and backward
SHAPES = [(1, 16), (2, 16), (8, 16), (4, 32), (12, 48), (16, 64)]  # (16, 64): h*d > 512 (D4)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("h,d", SHAPES)
def test_rel_pos_path_forward_backward(device, dtype, h, d):
    """dot_prod_with_idx_all -> softmax -> attention_step2_with_rel_pos_value, all gradients (D2, D7, D8)."""
    gen = torch.Generator().manual_seed(h * 100 + d)
    n, o0, o1, i0, i1 = random_layout(random_counts(gen, 12, 24) + [0], device)
    M, L = i0.numel(), 47
    q, k, v, (tq, tk, tv), rel = make_inputs(n, h, d, L, M, dtype, device, gen)
    rel = rel.to(torch.int8)
    g1 = torch.randn(M, h, generator=gen).to(dtype).to(device)
    g2 = torch.randn(n, h, d, generator=gen).to(dtype).to(device)

    logits, (dq, dk, dtq, dtk) = grads_of(
        lambda a, b, c, e: sptr.dot_prod_with_idx_all(a, i0, o0, b, i1, o1, c, e, rel, 0), [q, k, tq, tk], g1)
    ref, (rq, rk, rtq, rtk) = grads_of(
        lambda a, b, c, e: pair_logits_reference(a, b, i0, i1, c, e, rel), [as64(q), as64(k), as64(tq), as64(tk)],
        g1.double())
    tol, ttol = TOLERANCE[dtype], TABLE_TOLERANCE[dtype]
    assert logits.dtype == dtype
    for name, a, b, t in [("logits", logits, ref, tol), ("dq", dq, rq, tol), ("dk", dk, rk, tol),
                          ("dtable_q", dtq, rtq, ttol), ("dtable_k", dtk, rtk, ttol)]:
        assert_close(name, a, b, t)

    attn = torch.softmax(torch.randn(M, h, generator=gen), 0).to(dtype).to(device)
    out, (da, dv, dtv) = grads_of(
        lambda a, b, c: sptr.attention_step2_with_rel_pos_value(a, b, i0, o0, 0, i1, o1, c, rel), [attn, v, tv], g2)
    ref, (ra, rv, rtv) = grads_of(lambda a, b, c: aggregate_reference(a, b, o0, i1, c, rel),
                                  [as64(attn), as64(v), as64(tv)], g2.double())
    for name, a, b, t in [("out", out, ref, tol), ("dattn", da, ra, tol), ("dv", dv, rv, tol),
                          ("dtable_v", dtv, rtv, ttol)]:
        assert_close(name, a, b, t)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_plain_path_forward_backward(device, dtype, index_dtype):
    """attention_step1 / attention_step2 incl. the dattn gradient both published versions get wrong (D1)."""
    gen = torch.Generator().manual_seed(7)
    n, o0, o1, i0, i1 = random_layout(random_counts(gen, 10, 30), device)
    o0, o1, i0, i1 = (t.to(index_dtype) for t in (o0, o1, i0, i1))
    M, h, d = i0.numel(), 4, 32
    q, k, v, _, _ = make_inputs(n, h, d, 1, M, dtype, device, gen, tables=False)
    g1 = torch.randn(M, h, generator=gen).to(dtype).to(device)
    g2 = torch.randn(n, h, d, generator=gen).to(dtype).to(device)
    tol = TOLERANCE[dtype]

    attn, (dq, dk) = grads_of(lambda a, b: sptr.attention_step1(a, b, i0, o0, i1, o1, 0), [q, k], g1)
    ref, (rq, rk) = grads_of(lambda a, b: pair_logits_reference(a, b, i0, i1), [as64(q), as64(k)], g1.double())
    for name, a, b in [("attn", attn, ref), ("dq", dq, rq), ("dk", dk, rk)]:
        assert_close(name, a, b, tol)

    w = torch.rand(M, h, generator=gen).to(dtype).to(device)
    out, (dw, dv) = grads_of(lambda a, b: sptr.attention_step2(a, b, i0, o0, i1, o1, 0), [w, v], g2)
    ref, (rw, rv) = grads_of(lambda a, b: aggregate_reference(a, b, o0, i1), [as64(w), as64(v)], g2.double())
    for name, a, b in [("out", out, ref), ("dattn", dw, rw), ("dv", dv, rv)]:
        assert_close(name, a, b, tol)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_softmax_forward_backward(device, dtype):
    gen = torch.Generator().manual_seed(3)
    n, o0, _, i0, _ = random_layout(random_counts(gen, 20, 15) + [0, 0], device)
    src = (4 * torch.randn(i0.numel(), 3, generator=gen)).to(dtype).to(device)
    g = torch.randn(i0.numel(), 3, generator=gen).to(dtype).to(device)
    out, (ds,) = grads_of(lambda s: sptr.scatter_softmax_csr(s, o0), [src], g)
    ref, (rs,) = grads_of(lambda s: segment_softmax_reference(s, o0), [as64(src)], g.double())
    assert_close("softmax", out, ref, TOLERANCE[dtype])
    assert_close("dsrc", ds, rs, TOLERANCE[dtype])


@pytest.mark.parametrize("device", device_params())
def test_dot_prod_with_idx_both_argument_orders(device):
    """Official and 1.1.1 orders give the same result; gradients reach the matching inputs (D3)."""
    gen = torch.Generator().manual_seed(11)
    n, o0, o1, i0, i1 = random_layout([3, 1, 4, 2], device)
    q, k, _, (tq, tk, _), rel = make_inputs(n, 2, 16, 5, i0.numel(), torch.float64, device, gen)
    g = torch.randn(i0.numel(), 2, generator=gen, dtype=torch.float64).to(device)
    ref, rgrads = grads_of(lambda a, b, c, e: pair_logits_reference(a, b, i0, i1, c, e, rel, with_qk=False),
                           [q, k, tq, tk], g)
    official, ogr = grads_of(lambda a, b, c, e: sptr.dot_prod_with_idx(a, i0, o0, 4, b, o1, i1, c, e, rel),
                             [q, k, tq, tk], g)
    v111, ngr = grads_of(lambda a, b, c, e: sptr.dot_prod_with_idx(a, i0, o0, b, i1, o1, c, e, rel, 4),
                         [q, k, tq, tk], g)
    for got, grads in ((official, ogr), (v111, ngr)):
        assert_close("dot_prod_with_idx", got, ref, 1e-12)
        for name, a, b in zip(["dq", "dk", "dtable_q", "dtable_k"], grads, rgrads):
            assert_close(name, a, b, 1e-12)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("rel_dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_rel_idx_dtypes_and_long_tables(device, rel_dtype):
    """rel_idx read by its dtype (D6); tables longer than 50 rows and head dims other than 16 (D7)."""
    gen = torch.Generator().manual_seed(5)
    n, o0, o1, i0, i1 = random_layout([7, 5, 1, 9], device)
    L = 120 if rel_dtype != torch.int8 else 100
    q, k, v, (tq, tk, tv), rel = make_inputs(n, 3, 24, L, i0.numel(), torch.float32, device, gen)
    rel = rel.to(rel_dtype)
    got = sptr.dot_prod_with_idx_all(q, i0, o0, k, i1, o1, tq, tk, rel, 9)
    assert_close("logits", got, pair_logits_reference(as64(q), as64(k), i0, i1, as64(tq), as64(tk), rel), 1e-5)
    attn = torch.rand(i0.numel(), 3, generator=gen).to(device)
    got = sptr.attention_step2_with_rel_pos_value(attn, v, i0, o0, 9, i1, o1, tv, rel)
    assert_close("out", got, aggregate_reference(as64(attn), as64(v), o0, i1, as64(tv), rel), 1e-5)


@pytest.mark.parametrize("device", device_params())
def test_big_windows_cross_block_size(device):
    """Windows of 600-2100 points (over a 1024-thread block) and n_max in the thousands."""
    gen = torch.Generator().manual_seed(9)
    n, o0, o1, i0, i1 = random_layout([2100, 1, 600], device)
    h, d = 1, 16
    q, k, v, (tq, tk, tv), rel = make_inputs(n, h, d, 47, i0.numel(), torch.float32, device, gen)
    logits = sptr.dot_prod_with_idx_all(q * 0.25, i0, o0, k, i1, o1, tq, tk, rel, 1100)
    attn = sptr.scatter_softmax_csr(logits, o0)
    out = sptr.attention_step2_with_rel_pos_value(attn, v, i0, o0, 1100, i1, o1, tv, rel)
    ref_logits = pair_logits_reference(as64(q) * 0.25, as64(k), i0, i1, as64(tq), as64(tk), rel)
    ref = aggregate_reference(segment_softmax_reference(ref_logits, o0), as64(v), o0, i1, as64(tv), rel)
    assert_close("out", out, ref, 2e-5)


def test_arbitrary_pair_lists_forward_and_backward():
    """Pair logits work for any pair list (not only square windows), forward and backward."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(6, 2, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(9, 2, 4, generator=gen, dtype=torch.float64)
    i0 = torch.tensor([0, 0, 3, 5, 5, 5], dtype=torch.int32)
    i1 = torch.tensor([8, 1, 1, 0, 2, 8], dtype=torch.int32)
    g = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    got, gg = grads_of(lambda a, b: wa.pair_logits(a, b, i0, i1), [q, k], g)
    ref, rg = grads_of(lambda a, b: pair_logits_reference(a, b, i0, i1), [q, k], g)
    assert_close("logits", got, ref, 1e-12)
    for a, b in zip(gg, rg):
        assert_close("grad", a, b, 1e-12)


# ----------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
    n, o0, o1, i0, i1 = random_layout([3, 2], "cpu")
    q = torch.randn(n, 2, 16)
    table = torch.randn(10, 3, 2, 16)
    rel = torch.zeros(i0.numel(), 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="q must have dtype"):
        sptr.attention_step1(q.int(), q.int(), i0, o0, i1, o1, 3)
    with pytest.raises(TypeError, match="k has dtype"):
        sptr.attention_step1(q, q.double(), i0, o0, i1, o1, 3)
    with pytest.raises(TypeError, match="index_0 must have dtype"):
        sptr.attention_step1(q, q, i0.float(), o0, i1, o1, 3)
    with pytest.raises(ValueError, match="index_1 must have values in"):
        sptr.attention_step1(q, q, i0, o0, i1 + 3, o1, 3)
    with pytest.raises(ValueError, match="q must be a 3-D"):
        sptr.attention_step1(q[0], q, i0, o0, i1, o1, 3)
    with pytest.raises(ValueError, match="table_q must have shape"):
        sptr.dot_prod_with_idx_all(q, i0, o0, q, i1, o1, table[:, :2], table, rel, 3)
    with pytest.raises(ValueError, match="rel_idx must have values in"):
        sptr.dot_prod_with_idx_all(q, i0, o0, q, i1, o1, table, table, rel + 10, 3)
    with pytest.raises(ValueError, match="rel_idx must have values in"):
        sptr.dot_prod_with_idx_all(q, i0, o0, q, i1, o1, table, table, rel - 1, 3)
    attn = torch.rand(i0.numel(), 2)
    bad = o0.clone()
    bad[2] = o0[3] + 1
    with pytest.raises(ValueError, match="non-decreasing"):
        sptr.attention_step2(attn, q, i0, bad, i1, o1, 3)
    with pytest.raises(ValueError, match="attn must have one row per pair"):
        sptr.attention_step2(attn[:-1], q, i0, o0, i1, o1, 3)
    with pytest.raises(ValueError, match="indptr must start at 0"):
        sptr.scatter_softmax_csr(attn, o0 + 1)


@pytest.mark.parametrize("device", device_params())
def test_unchecked_bad_indices_stay_in_bounds(device):
    """With the value checks off, out-of-range indices and rel_idx are skipped by the kernels (no crash, no
    out-of-bounds read; compute-sanitizer runs this on the GPU), and in-range pairs are unaffected."""
    n, o0, o1, i0, i1 = random_layout([3, 2], device)
    q = torch.randn(n, 2, 16, device=device)
    table = torch.randn(10, 3, 2, 16, device=device)
    rel = torch.zeros(i0.numel(), 3, dtype=torch.int32, device=device)
    bad_i1, bad_rel = i1.clone(), rel.clone()
    bad_i1[0], bad_rel[1, 2] = 10**6, -5
    with sptr.ops.data_checks(False):
        logits = sptr.dot_prod_with_idx_all(q, i0, o0, q, bad_i1, o1, table, table, bad_rel, 3)
        out = sptr.attention_step2_with_rel_pos_value(logits, q, i0, o0, 3, bad_i1, o1, table, bad_rel)
    good = sptr.dot_prod_with_idx_all(q, i0, o0, q, i1, o1, table, table, rel, 3)
    assert logits[0].abs().max() == 0 and logits[1].abs().max() == 0
    assert torch.equal(logits[2:], good[2:]) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="index_1 must have values in"):
        sptr.dot_prod_with_idx_all(q, i0, o0, q, bad_i1, o1, table, table, rel, 3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mismatched_devices_raise():
    n, o0, o1, i0, i1 = random_layout([3, 2], "cpu")
    q = torch.randn(n, 2, 16)
    with pytest.raises(ValueError, match="is on"):
        sptr.attention_step1(q.cuda(), q.cuda(), i0, o0, i1, o1, 3)


# ------------------------------------------------------------------------------------ opcheck and gradcheck
def small_case(device, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, o0, o1, i0, i1 = random_layout([1, 3, 0, 2], device)
    q, k, v, (tq, tk, tv), rel = make_inputs(n, 2, 3, 4, i0.numel(), dtype, device, gen)
    return n, o0, o1, i0, i1, q, k, v, tq, tk, tv, rel


@pytest.mark.parametrize("device", device_params())
def test_opcheck(device):
    n, o0, o1, i0, i1, q, k, v, tq, tk, tv, rel = small_case(device, torch.float32)
    rg = lambda t: t.detach().clone().requires_grad_(True)  # noqa: E731
    ops = torch.ops.sptr
    attn = torch.rand(i0.numel(), 2, device=device)
    cases = [
        (ops.window_pair_logits_fwd.default, (rg(q), rg(k), i0, i1, rg(tq), rg(tk), rel, True)),
        (ops.window_pair_logits_fwd.default, (rg(q), rg(k), i0, i1, None, None, None, True)),
        (ops.window_pair_logits_bwd.default, (attn, q, k, i0, i1, tq, None, rel, False)),
        (ops.window_aggregate_fwd.default, (rg(attn), rg(v), o0, i1, rg(tv), rel)),
        (ops.window_aggregate_fwd.default, (rg(attn), rg(v), o0, i1, None, None)),
        (ops.window_aggregate_bwd.default, (v, attn, v, i0, o0, i1, tv, rel)),
        (ops.window_softmax_fwd.default, (rg(attn), o0)),
        (ops.window_softmax_bwd.default, (attn, attn, o0)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    torch.library.opcheck(ops.window_precompute_all.default, (torch.tensor([2, 0, 3], device=device), 5),
                          test_utils=("test_schema", "test_faketensor"))


def test_gradcheck_float64():
    n, o0, o1, i0, i1, q, k, v, tq, tk, tv, rel = small_case("cpu")
    rg = lambda t: t.detach().clone().requires_grad_(True)  # noqa: E731
    assert torch.autograd.gradcheck(
        lambda a, b, c, e: sptr.dot_prod_with_idx_all(a, i0, o0, b, i1, o1, c, e, rel, 3), (rg(q), rg(k), rg(tq), rg(tk)))
    assert torch.autograd.gradcheck(lambda a, b: sptr.attention_step1(a, b, i0, o0, i1, o1, 3), (rg(q), rg(k)))
    attn = torch.rand(i0.numel(), 2, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda a, b, c: sptr.attention_step2_with_rel_pos_value(a, b, i0, o0, 3, i1, o1, c, rel), (rg(attn), rg(v), rg(tv)))
    assert torch.autograd.gradcheck(lambda a, b: sptr.attention_step2(a, b, i0, o0, i1, o1, 3), (rg(attn), rg(v)))
    assert torch.autograd.gradcheck(lambda s: sptr.scatter_softmax_csr(s, o0), (rg(attn),))
    assert torch.autograd.gradcheck(lambda a, b, c, e: sptr.dot_prod_with_idx(a, i0, o0, b, i1, o1, c, e, rel, 3),
                                    (rg(q), rg(k), rg(tq), rg(tk)))


def test_empty_pair_list():
    q = torch.randn(0, 2, 16, requires_grad=True)
    e = torch.zeros(0, dtype=torch.int32)
    o0 = torch.zeros(1, dtype=torch.int32)
    attn = sptr.attention_step1(q, q, e, o0, e, e, 0)
    out = sptr.attention_step2(sptr.scatter_softmax_csr(attn, o0), q, e, o0, e, e, 0)
    out.sum().backward()
    assert attn.shape == (0, 2) and out.shape == (0, 2, 16) and q.grad.shape == q.shape
