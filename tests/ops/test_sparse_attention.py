"""Window assignment, relative index and the composite sparse_self_attention (spec §3, §5)."""
import numpy as np
import pytest
import torch

import sptr
from sptr.ops.sparse_attention import WindowOrder
from sptr.ops.windowing import _as_vector, relative_position_index
from sptr.reference.windowing import sparse_self_attention_reference, window_ids_reference
from tests.helpers import assert_close, device_params


def scene(n=600, seed=0, extent=1.5):
    gen = torch.Generator().manual_seed(seed)
    xyz = torch.rand(n, 3, generator=gen) * extent
    batch = torch.zeros(n, dtype=torch.long)
    batch[n // 3:] = 2  # batch 1 is empty
    return xyz, batch[torch.randperm(n, generator=gen)]  # batch not sorted


def test_to_3d_numpy():
    assert sptr.to_3d_numpy(0.5).tolist() == [0.5, 0.5, 0.5] and sptr.to_3d_numpy(0.5).dtype == np.float32
    assert sptr.to_3d_numpy([1, 2, 3]).dtype.kind == "i"
    a = np.zeros(3)
    assert sptr.to_3d_numpy(a) is a
    with pytest.raises(ValueError):
        sptr.to_3d_numpy("x")


@pytest.mark.parametrize("device", device_params())
def test_constant_sizes_are_made_once_and_still_checked(device):
    """Window and cell sizes given as numbers, lists or arrays become one cached vector per value, dtype and
    device (the same values as before the cache: an fp32 array's entries exactly, a list's rounded once), and bad
    values are refused on every call."""
    like32 = torch.zeros(1, 3, device=device)
    like64 = like32.double()
    sizes = np.array([0.3, 0.25, 0.4], np.float32)
    a, b = _as_vector("window_size", sizes, like32), _as_vector("window_size", sizes.copy(), like32)
    assert a is b and a.device == like32.device and a.dtype == torch.float32
    assert torch.equal(a.cpu(), torch.from_numpy(sizes))
    c = _as_vector("window_size", sizes, like64)
    assert c.dtype == torch.float64 and torch.equal(c.cpu(), torch.from_numpy(sizes).double())
    assert torch.equal(_as_vector("quant_size", [0.3, 0.3, 0.3], like32).cpu(), torch.full((3,), 0.3))
    assert torch.equal(_as_vector("quant_size", 2, like32).cpu(), torch.full((3,), 2.0))
    for bad in ([0.3, 0.0, 0.3], [0.3, float("nan"), 0.3], [0.3, 1e39, 0.3]):  # 1e39 overflows fp32
        for _ in range(2):
            with pytest.raises(ValueError, match="must be positive and finite"):
                _as_vector("window_size", bad, like32)
    with pytest.raises(ValueError, match="must have 3 entries"):
        _as_vector("window_size", [0.3, 0.3], like32)
    with pytest.raises(TypeError, match="real numbers"):
        _as_vector("window_size", np.array([True, True, True]), like32)


@pytest.mark.parametrize("device", device_params())
def test_window_order_and_back_are_scatters_both_ways(device):
    """Rows in window order (and back) by sptr::window_permute_rows scatters: the same values and gradients as
    x[sort_idx] (and as index_copy), with the op itself as the gradient (no IndexSelect, which runs one CUDA
    block per row, and no accumulating index_put, which sorts on CUDA, in the backward graph)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 2, 16, generator=gen).to(device)[:, :1].requires_grad_()  # a strided view, as the layers
    perm = torch.randperm(300, generator=gen).to(device)
    (got,) = WindowOrder.of(perm).to_windows(x)
    assert torch.equal(got, x[perm]) and got.is_contiguous() and "PermuteRows" in got.grad_fn.name()
    g = torch.randn(got.shape, generator=gen).to(device)
    assert torch.equal(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(x[perm], x, g)[0])
    order = WindowOrder.of(perm)
    back = order.to_points(order.to_windows(x)[0])
    assert torch.equal(back, x) and torch.equal(torch.autograd.grad(back, x, g)[0], g)
    assert WindowOrder.of(perm[:0]).to_windows(x[:0])[0].shape == (0, 1, 16)
    x64 = torch.randn(7, 3, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    p7 = torch.randperm(7, generator=gen).to(device)
    o7 = WindowOrder.of(p7)
    assert torch.equal(o7.inverse[p7], torch.arange(7, device=device))
    assert torch.autograd.gradcheck(lambda t: o7.to_windows(t)[0], (x64,))
    assert torch.autograd.gradgradcheck(lambda t: o7.to_windows(t)[0], (x64,))
    torch.library.opcheck(torch.ops.sptr.window_permute_rows, (x64, o7.inverse, o7.order))


@pytest.mark.parametrize("device", device_params())
def test_window_permute_rows_every_layout_and_width(device):
    """The row copy (CUDA: vectors of 16 down to 1 bytes, as the row size, row stride and addresses allow) equals
    x[perm] for strided rows (views of a fused qkv), rows that are not contiguous, odd row sizes, offset
    addresses, expanded rows, 1-D x, every dtype and empty shapes."""
    gen = torch.Generator().manual_seed(5)
    n = 37
    perm = torch.randperm(n, generator=gen).to(device)
    inv = torch.empty_like(perm).index_copy_(0, perm, torch.arange(n, device=device))
    qkv = torch.randn(n, 3, 4, 16, generator=gen).to(device)
    cases = {
        "contiguous": torch.randn(n, 2, 16, generator=gen).to(device),
        "qkv head split": qkv.split([1, 3], 2)[1].unbind(1)[0],
        "transposed rows": torch.randn(n, 16, 3, generator=gen).to(device).transpose(1, 2),
        "fp16 rows of 6 bytes": torch.randn(n, 3, generator=gen).to(device).half(),
        "offset address": torch.randn(n * 5 + 1, generator=gen).to(device)[1:].view(n, 5),
        "expanded rows": torch.randn(1, 8, generator=gen).to(device).expand(n, 8),
        "1-D int8": torch.randint(-100, 100, (n,), generator=gen, dtype=torch.int8).to(device),
        "bf16": torch.randn(n, 8, generator=gen).to(device).bfloat16(),
        "fp64 with an empty row dim": torch.randn(n, 0, generator=gen, dtype=torch.float64).to(device),
    }
    for name, x in cases.items():
        got = torch.ops.sptr.window_permute_rows(x, inv, perm)
        assert got.shape == x.shape and got.is_contiguous() and torch.equal(got, x[perm]), name
    assert torch.ops.sptr.window_permute_rows(qkv[:0], inv[:0], perm[:0]).shape == (0, 3, 4, 16)


@pytest.mark.parametrize("device", device_params())
def test_window_permute_rows_casts_on_the_way(device):
    """With dtype, the rows come out cast: the bits of x.to(dtype)[perm] for every pair of floating dtypes, in the
    CUDA kernel's packs of 4 and single elements (strided qkv views, odd rows, an offset address), and the
    gradient comes back permuted and cast to x's dtype."""
    gen = torch.Generator().manual_seed(6)
    n = 41
    perm = torch.randperm(n, generator=gen).to(device)
    order = WindowOrder.of(perm)
    qkv = (torch.randn(n, 3, 4, 16, generator=gen) * 300).to(device)  # beyond fp16's 2^-14 steps near 300
    layouts = {
        "qkv head split": qkv.split([1, 3], 2)[1].unbind(1)[0],
        "odd rows": qkv[:, 0, 0, :5],
        "offset address": qkv.reshape(-1)[1:n * 8 + 1].view(n, 8),
    }
    floats = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    for name, base in layouts.items():
        for src in floats:
            x = base.to(src)
            for dst in floats:
                got = torch.ops.sptr.window_permute_rows(x, order.inverse, order.order, dst)
                want = x.to(dst)[perm]
                assert got.dtype == dst and got.is_contiguous(), (name, src, dst)
                assert torch.equal(got, want), (name, src, dst)
    x = qkv[:, 0].clone().requires_grad_()
    (got,) = order.to_windows(x, dtype=torch.bfloat16)
    g = torch.randn(got.shape, generator=gen).to(device).bfloat16()
    (dx,) = torch.autograd.grad(got, x, g)
    assert dx.dtype == torch.float32 and torch.equal(dx, torch.autograd.grad(x.bfloat16()[perm], x, g)[0])
    back = order.to_points(got, dtype=torch.float32)
    assert back.dtype == torch.float32 and torch.equal(back, x.bfloat16().float())
    x64 = torch.randn(7, 3, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    o7 = WindowOrder.of(torch.randperm(7, generator=gen).to(device))
    torch.library.opcheck(torch.ops.sptr.window_permute_rows, (x64, o7.inverse, o7.order, torch.float32))
    with pytest.raises(TypeError, match="dtype casts floating x to another floating dtype"):
        torch.ops.sptr.window_permute_rows(perm, order.inverse, order.order, torch.float32)


def test_window_permute_rows_refuses_bad_indices():
    x = torch.randn(5, 2)
    perm = torch.randperm(5)
    with pytest.raises(ValueError, match="dest must be a 1-D tensor of x.shape\\[0\\] = 5 entries"):
        torch.ops.sptr.window_permute_rows(x, perm[:4], perm)
    with pytest.raises(TypeError, match="source must be int64"):
        torch.ops.sptr.window_permute_rows(x, perm, perm.int())


@pytest.mark.parametrize("shift", [False, True])
def test_window_ids_exact(shift):
    xyz, batch = scene()
    w = np.array([0.3, 0.25, 0.4], np.float32)
    if shift:
        got = sptr.grid_sample(xyz + 0.5 * torch.from_numpy(w), batch, w, start=xyz.min(0).values, return_p2v=False,
                               return_counts=False)
        want = window_ids_reference(xyz + 0.5 * torch.from_numpy(w), batch, w, xyz.min(0).values.numpy())
    else:
        got = sptr.grid_sample(xyz, batch, w, return_p2v=False, return_counts=False)
        want = window_ids_reference(xyz, batch, w)
    assert torch.equal(got, want)


def test_grid_sample_forms_and_p2v():
    xyz, batch = scene(200)
    cluster, n_max, counts = sptr.grid_sample(xyz, batch, 0.5, return_p2v=False)
    assert int(counts.sum()) == 200 and n_max == int(counts.max())
    cluster2, p2v, counts2, unique = sptr.grid_sample(xyz, batch, 0.5, return_unique=True)
    assert torch.equal(cluster, cluster2) and torch.equal(counts, counts2) and p2v.shape == (counts.numel(), n_max)
    for w in range(counts.numel()):
        members = torch.nonzero(cluster == w).flatten()
        assert torch.equal(p2v[w, : counts[w]], members)
    assert torch.all(unique[1:] > unique[:-1])


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("shift", [False, True])
def test_get_indices_params_layout(device, shift):
    xyz, batch = scene()
    i0, o0, n_max, i1, o1, sort_idx = sptr.get_indices_params(xyz.to(device), batch.to(device), [0.3, 0.3, 0.3],
                                                              shift)
    assert i0.dtype == torch.int32 and sort_idx.dtype == torch.int64
    cluster = sptr.grid_sample(xyz + (0.15 if shift else 0.0), batch, 0.3, start=xyz.min(0).values if shift else None,
                               return_p2v=False, return_counts=False)
    assert torch.equal(sort_idx.cpu(), torch.sort(cluster, stable=True).indices)
    # every pair joins two points of the same window; every window is complete
    sc = cluster[sort_idx.cpu()]
    assert torch.equal(sc[i0.long().cpu()], sc[i1.long().cpu()])
    assert i0.numel() == int((torch.bincount(cluster) ** 2).sum())


def test_relative_index_exact_and_split_func_arity():
    xyz, batch = scene(300)
    i0, o0, _, i1, _, sort_idx = sptr.get_indices_params(xyz, batch, 0.3, False)
    X = xyz[sort_idx]
    rel = relative_position_index(X, i0, i1, 0.3, 0.0125, 24, False)
    # independent float32 evaluation of spec §5.1
    d = (X - X.min(0).values).numpy().astype(np.float32)
    r = np.fmod(d, np.float32(0.3))
    xq = np.floor_divide(r, np.float32(0.0125))
    want = xq[i0.long().numpy()] - xq[i1.long().numpy()] + 23
    assert np.array_equal(rel.numpy(), want.astype(np.int32))
    assert rel.min() >= 0 and rel.max() <= 46
    calls = []

    def four(x, a, b, r):
        calls.append(4)
        return r

    def five(x, a, b, r, qgl):
        calls.append(qgl)
        return r

    relative_position_index(X, i0, i1, 0.3, 0.0125, 24, False, four)
    relative_position_index(X, i0, i1, 0.3, 0.0125, 24, False, five)
    assert calls == [4, 24]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("pe", ["none", "contextual"])
def test_sparse_self_attention_matches_reference(device, shift, pe):
    xyz, batch = scene(500)
    gen = torch.Generator().manual_seed(1)
    h, d, qgl = 2, 16, 24
    q, k, v = (torch.randn(500, h, d, generator=gen) for _ in range(3))
    tables = [torch.randn(2 * qgl - 1, 3, h, d, generator=gen) * 0.1 for _ in range(3)]
    leaves = [t.to(device).clone().requires_grad_() for t in (q, k, v, *tables)]
    i0, o0, n_max, i1, o1, sort_idx = sptr.get_indices_params(xyz.to(device), batch.to(device), 0.3, shift)
    extra = {}
    if pe == "contextual":
        extra = dict(rel_query=True, rel_key=True, rel_value=True, quant_size=0.0125, quant_grid_length=qgl,
                     relative_pos_query_table=leaves[3], relative_pos_key_table=leaves[4],
                     relative_pos_value_table=leaves[5])
    out = sptr.sparse_self_attention(*leaves[:3], xyz.to(device), i0, o0, n_max, i1, o1, sort_idx, 0.3, shift,
                                     pe_type=pe, **extra)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g.to(device))
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, *tables)]
    ref = sparse_self_attention_reference(*ref_leaves[:3], xyz, batch, 0.3, shift, 0.0125, qgl,
                                          ref_leaves[3:] if pe == "contextual" else None)
    ref.backward(g.double())
    assert_close("out", out, ref, 2e-5)
    names = ["dq", "dk", "dv", "dtable_q", "dtable_k", "dtable_v"][: 6 if pe == "contextual" else 3]
    for name, a, b in zip(names, leaves, ref_leaves):
        assert_close(name, a.grad, b.grad, 5e-5)


@pytest.mark.parametrize("device", device_params())
def test_lidar_scene_partition(device):
    """A realistic partition: a synthetic 64-beam scan, windows of 6 voxels, two scans in one batch."""
    from sptr.data import lidar_voxels

    xyz, batch = lidar_voxels(3000, batch=2)
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(xyz.shape[0], 2, 16, generator=gen) for _ in range(3))
    tables = [torch.randn(47, 3, 2, 16, generator=gen) * 0.1 for _ in range(3)]
    i0, o0, n_max, i1, o1, sort_idx = sptr.get_indices_params(xyz.to(device), batch.to(device), 0.3, False)
    out = sptr.sparse_self_attention(
        q.to(device), k.to(device), v.to(device), xyz.to(device), i0, o0, n_max, i1, o1, sort_idx, 0.3, False,
        pe_type="contextual", rel_query=True, rel_key=True, rel_value=True, quant_size=0.0125, quant_grid_length=24,
        relative_pos_query_table=tables[0].to(device), relative_pos_key_table=tables[1].to(device),
        relative_pos_value_table=tables[2].to(device))
    ref = sparse_self_attention_reference(q.double(), k.double(), v.double(), xyz, batch, 0.3, False, 0.0125, 24,
                                          [t.double() for t in tables])
    assert_close("out", out, ref, 2e-5)


def test_autocast_keeps_fp32_and_promotes_mixed_inputs():
    """Under autocast the ops never downcast fp32 inputs (SphereFormer casts to fp32 on purpose); mixed
    inputs are promoted to the widest, and outside autocast mixed dtypes are an error."""
    n, counts = 6, torch.tensor([4, 2])
    o0, o1, i0, i1 = sptr.precompute_all(n, 2, 4, counts)
    q = torch.randn(n, 2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sptr.attention_step1(q, q, i0, o0, i1, o1, 4).dtype == torch.float32
        assert sptr.attention_step1(q, q.bfloat16(), i0, o0, i1, o1, 4).dtype == torch.float32
    with pytest.raises(TypeError, match="k has dtype"):
        sptr.attention_step1(q, q.bfloat16(), i0, o0, i1, o1, 4)


def test_low_precision_dtype_argument_keeps_output_dtype():
    xyz, batch = scene(300)
    q = torch.randn(300, 2, 16)
    params = sptr.get_indices_params(xyz, batch, 0.3, False)
    i0, o0, n_max, i1, o1, sort_idx = params
    out = sptr.sparse_self_attention(q, q, q, xyz, i0, o0, n_max, i1, o1, sort_idx, 0.3, False,
                                     dtype=torch.bfloat16)
    ref = sparse_self_attention_reference(q.double(), q.double(), q.double(), xyz, batch, 0.3, False, None, None)
    assert out.dtype == torch.float32
    assert_close("out bf16", out, ref, 4e-2)
