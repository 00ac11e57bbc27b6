"""VarLengthMultiheadSA and the SphereFormer block (spec §6, §7)."""
from functools import partial

import numpy as np
import pytest
import torch

import sptr
from sptr.layers.sphereformer import SphereFormer, SphereFormerConfig, cart2sphere, exponential_split
from sptr.layers.var_length_attention import VarLengthMultiheadSAConfig
from sptr.reference.windowing import sparse_self_attention_reference
from tests.helpers import TOLERANCE, assert_close, device_params


def points(n=400, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xyz = torch.rand(n, 3, generator=gen) * 1.2
    batch = (torch.arange(n) >= n // 2).long()
    return xyz, batch, torch.randn(n, 32, generator=gen)


def ring_scan(n, gen):
    """Points on a ring 2-10 m around the sensor, 1.2-1.7 m below it (a LiDAR-like layout)."""
    ang = torch.rand(n, generator=gen) * 6.283
    rad = 2 + 8 * torch.rand(n, generator=gen)
    return torch.stack([rad * ang.cos(), rad * ang.sin(), torch.rand(n, generator=gen) * 0.5 - 1.7], 1)


def assert_paths_agree(fused, step, run, zero_grad=()):
    """Same outputs and parameter gradients from the fused and the step-by-step module; parameters named in
    `zero_grad` have a gradient that is 0 up to rounding in both."""
    y_fused, y_step = run(fused), run(step)
    assert_close("fused vs step", y_fused, y_step, 1e-5)
    y_fused.square().sum().backward()
    y_step.square().sum().backward()
    for (name, p), q in zip(fused.named_parameters(), step.parameters()):
        if name in zero_grad:
            assert p.grad.abs().max() < 1e-5 and q.grad.abs().max() < 1e-5
        else:
            assert_close(f"grad {name}", p.grad, q.grad, 5e-5)


def test_contextual_pe_type_is_used_and_trained():
    """Published VarLengthMultiheadSA drops pe_type (D5): here the tables change the output and get gradients."""
    xyz, batch, feats = points()
    torch.manual_seed(0)
    m = sptr.VarLengthMultiheadSA(32, 2, "k", 0.3, pe_type="contextual", rel_query=True, rel_key=True,
                                  rel_value=True, quant_size=0.0125)
    plain = sptr.VarLengthMultiheadSA(32, 2, "k", 0.3)
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if "relative" not in k})
    t = lambda: sptr.SparseTrTensor(feats, torch.cat([batch[:, None].float(), xyz], 1), None, 2)  # noqa: E731
    y = m(t()).query_feats
    assert (y - plain(t()).query_feats).abs().max() > 1e-4
    y.square().sum().backward()
    assert all(getattr(m, f"relative_pos_{n}_table").grad.abs().sum() > 0 for n in ("query", "key", "value"))
    assert list(m.state_dict())[:3] == ["relative_pos_query_table", "relative_pos_key_table",
                                        "relative_pos_value_table"]


@pytest.mark.parametrize("attention,cache_key", [("step", "key"), ("fused", "key/fused")])
def test_index_cache_hit_and_mismatch(attention, cache_key):
    """A cache hit works (published raises on every hit, D13); other window parameters are rejected."""
    xyz, batch, feats = points()
    t = sptr.SparseTrTensor(feats, torch.cat([batch[:, None].float(), xyz], 1), None, 2)
    make = lambda w: sptr.VarLengthMultiheadSA(32, 2, "key", w, attention=attention)  # noqa: E731
    a, b = make(0.3), make(0.3)
    a(t)
    assert list(t.indice_dict) == [cache_key]
    cached = t.indice_dict[cache_key]
    b(t)
    assert t.indice_dict[cache_key] is cached
    with pytest.raises(ValueError, match="window_size"):
        make(0.4)(t)


def test_fused_layers_check_values_only_when_building_windows(monkeypatch):
    """The fused layers' attention runs without value checks (each would be a host sync on CUDA): only the
    checks of a window partition run (finite coordinates, window ids inside int64: one run, one sync), once per
    partition (the block's cubic and spherical windows; none when VarLengthMultiheadSA reuses the cached
    windows)."""
    from sptr.ops import _checks

    runs = []
    run = _checks.ValueChecks.run
    monkeypatch.setattr(_checks.ValueChecks, "run", lambda self: (  # a run with no check is no sync
        self._checks and runs.append([c[0] for c in self._checks]), run(self))[1])
    partition = ["xyz", "xyz spans too many windows: the window id (windows per axis times scans) overflows int64; "
                        "use larger windows or coordinates nearer the origin"]
    xyz, batch, feats = points()
    SphereFormer(SphereFormerConfig(window_size=(0.6, 0.6, 0.6), quant_size=(0.05, 0.05, 0.05)))(feats, xyz, batch)
    assert runs == [partition, partition]
    runs.clear()
    t = sptr.SparseTrTensor(feats, torch.cat([batch[:, None].float(), xyz], 1), None, 2)
    layer = sptr.VarLengthMultiheadSA(32, 2, "k", 0.3, pe_type="contextual", rel_query=True, rel_key=True,
                                      rel_value=True, quant_size=0.0125)
    layer(t)
    assert runs == [partition]
    layer(t)
    assert runs == [partition]


def published_cart2sphere(xyz):
    x, y, z = xyz[:, 0], xyz[:, 1], xyz[:, 2]
    theta = (torch.atan2(y, x) + np.pi) * 180 / np.pi
    beta = torch.atan2(torch.sqrt(x ** 2 + y ** 2), z) * 180 / np.pi
    r = torch.sqrt(x ** 2 + y ** 2 + z ** 2)
    return torch.stack([theta, beta, r], -1)


@pytest.mark.parametrize("device", device_params())
def test_cart2sphere_is_the_published_arithmetic_to_the_bit(device):
    """sptr::cart2sphere (CUDA: one float32 kernel) equals SphereFormer's chain of torch ops on the same device
    to the bit: a LiDAR-like ring, points on the axes and at the origin (atan2's edge cases), a strided view,
    float64 and an empty cloud; with xyz requiring grad, the gradient is the chain's (up to the order in which
    x² + y²'s two uses add up: the published chain computes it twice) and passes float64 gradcheck."""
    gen = torch.Generator().manual_seed(3)
    ring = ring_scan(5000, gen)
    axes = torch.tensor([[0.0, 0, 0], [1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1],
                         [-0.0, 0, 0], [0, -0.0, 1], [1e-30, -1e-30, 1e30], [3e19, 4e19, -5e19]])
    for xyz in (ring, axes, torch.cat([ring, ring], 1)[:, 1:4], ring.double(), ring[:0]):
        xyz = xyz.to(device)
        got = cart2sphere(xyz)
        assert got.dtype == xyz.dtype and got.shape == xyz.shape
        assert torch.equal(got, published_cart2sphere(xyz)) and not got.requires_grad
    xyz = ring[:100].to(device).requires_grad_()
    g = torch.randn(100, 3, generator=gen).to(device)
    (got,) = torch.autograd.grad(cart2sphere(xyz), xyz, g)
    assert_close("dxyz", got, torch.autograd.grad(published_cart2sphere(xyz), xyz, g)[0], 1e-6)
    assert torch.autograd.gradcheck(cart2sphere, (ring[:20].double().to(device).requires_grad_(),))
    with pytest.raises(ValueError, match=r"xyz must be an \(N, 3\) tensor"):
        cart2sphere(ring[:, :2].to(device))
    torch.library.opcheck(torch.ops.sptr.cart2sphere, (ring[:50].double().to(device).requires_grad_(),))


def test_sphereformer_builds_both_window_partitions_before_attending():
    """window_sort reads its window count on the host (a CUDA stream sync): both branches' partitions come
    before the first attention kernel, so that the second read does not wait for the first branch's attention.
    The op order is the same on every device: recorded on the CPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpOrder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.name())
            return func(*args, **(kwargs or {}))

    xyz, batch, feats = points()
    block = SphereFormer(SphereFormerConfig(window_size=(0.6, 0.6, 0.6), quant_size=(0.05, 0.05, 0.05)))
    with torch.no_grad(), OpOrder() as order:
        block(feats, xyz, batch)
    sorts = [i for i, op in enumerate(order.ops) if op == "sptr::window_sort"]
    attends = [i for i, op in enumerate(order.ops) if op.startswith("sptr::window_attention")]
    assert len(sorts) == 2 and attends and max(sorts) < min(attends), order.ops


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sphereformer_attention_on_cached_windows_never_syncs_the_host():
    """Once its windows are cached (as in a U-Net stage), SphereFormer's attention runs on CUDA without waiting
    for the GPU: no value checks, and the window/cell sizes reach the device through pinned memory (a blocking
    copy from pageable memory is a stream sync). torch.cuda's sync debug mode turns any sync into an error."""
    from sptr.layers.sphereformer import SparseMultiheadSASphereConcat

    xyz, batch, feats = points()
    attn = SparseMultiheadSASphereConcat(32, 2, "k", np.float32([0.6] * 3), np.float32([2.0, 2.0, 80.0]),
                                         pe_type="contextual", rel_query=True, rel_key=True, rel_value=True,
                                         quant_size=np.float32([0.05] * 3),
                                         quant_size_sphere=np.float32([2 / 24, 2 / 24, 80 / 24])).cuda()
    t = sptr.SparseTrTensor(feats.cuda(), torch.cat([batch[:, None].float(), xyz], 1).cuda(), None, 2)
    want = attn(t).query_feats  # builds and caches both window partitions (their unique() syncs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = attn(t).query_feats
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)


@pytest.mark.parametrize("pe", ["none", "contextual"])
def test_fused_and_step_paths_agree(pe):
    xyz, batch, feats = points()
    extra = dict(rel_query=True, rel_key=True, rel_value=True, quant_size=0.0125) if pe == "contextual" else {}
    torch.manual_seed(0)
    fused = sptr.VarLengthMultiheadSA(32, 2, "k", 0.3, pe_type=pe, **extra)
    step = sptr.VarLengthMultiheadSA(32, 2, "k", 0.3, pe_type=pe, attention="step", **extra)
    step.load_state_dict(fused.state_dict())
    indices = torch.cat([batch[:, None].float(), xyz], 1)
    # Without tables, q·b_k shifts a whole softmax row: the k bias gradient is 0 up to rounding.
    assert_paths_agree(fused, step, lambda m: m(sptr.SparseTrTensor(feats, indices, None, 2)).query_feats,
                       zero_grad=("k.bias",) if pe == "none" else ())


def test_sphereformer_fused_and_step_paths_agree():
    gen = torch.Generator().manual_seed(6)
    n = 400
    xyz = ring_scan(n, gen)
    batch = (torch.arange(n) >= 250).long()
    cfg = dict(dim=32, num_heads=2, window_size=(1.2, 1.2, 1.2), quant_size=(0.05, 0.05, 0.05),
               window_size_sphere=(4.5, 4.5, 80.0), quant_size_sphere=(4.5 / 24, 4.5 / 24, 80 / 24))
    torch.manual_seed(1)
    fused = SphereFormer(SphereFormerConfig(**cfg))
    step = SphereFormer(SphereFormerConfig(**cfg, attention="step"))
    step.load_state_dict(fused.state_dict())
    feats = torch.randn(n, 32, generator=gen)
    assert_paths_agree(fused, step, lambda m: m(feats, xyz, batch))


@pytest.mark.parametrize("pe", ["sine", "fourier"])
def test_position_embedding_out_of_place(pe):
    xyz, batch, feats = points()
    before = feats.clone()
    m = sptr.VarLengthMultiheadSA(32, 2, "k", 0.3, pe_type=pe)
    m(sptr.SparseTrTensor(feats, torch.cat([batch[:, None].float(), xyz], 1), None, 2))
    assert torch.equal(feats, before)


def test_config_from_dict_rejects_unknown_keys():
    cfg = VarLengthMultiheadSAConfig.from_dict({"embed_dim": 32, "num_heads": 2, "indice_key": "a",
                                                "window_size": [0.3, 0.3, 0.3]})
    assert isinstance(sptr.VarLengthMultiheadSA.from_config(cfg), sptr.VarLengthMultiheadSA)
    with pytest.raises(ValueError, match="unknown keys \\['heads'\\]"):
        VarLengthMultiheadSAConfig.from_dict({"embed_dim": 32, "heads": 2, "indice_key": "a"})
    with pytest.raises(ValueError, match="divisible"):
        VarLengthMultiheadSAConfig(embed_dim=30, num_heads=4, indice_key="a")


def test_sphereformer_state_dict_names_and_shapes():
    m = SphereFormer(SphereFormerConfig(dim=64, num_heads=4))
    sd = m.state_dict()
    assert sd["attn.relative_pos_query_table"].shape == (47, 3, 2, 16)
    assert sd["attn.relative_pos_value_table_sphere"].shape == (48, 3, 2, 16)
    assert sd["attn.qkv.weight"].shape == (192, 64) and sd["mlp.fc1.weight"].shape == (256, 64)
    assert sorted(sd) == sorted(
        ["norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.qkv.weight", "attn.qkv.bias",
         "attn.proj.weight", "attn.proj.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"]
        + [f"attn.relative_pos_{k}_table{s}" for k in ("query", "key", "value") for s in ("", "_sphere")])


def test_exponential_split_bins():
    a = 0.0125
    r = torch.tensor([0.0, 0.5 * a, 1.5 * a, 3 * a, 5 * a, 8 * a, 12 * a])
    xyz = torch.stack([torch.zeros_like(r), torch.zeros_like(r), r], 1)
    i0 = torch.arange(7, dtype=torch.int32)
    i1 = torch.zeros(7, dtype=torch.int32)
    bins = exponential_split(xyz, i0, i1, torch.zeros(7, 3), a=a)[:, 2] - 24
    assert bins.tolist() == [0, 0, 1, 2, 3, 4, 5]
    bins = exponential_split(xyz, i1, i0, torch.zeros(7, 3), a=a)[:, 2] - 24
    assert bins.tolist() == [0, -1, -2, -3, -4, -5, -6]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_attention_casts_in_its_permutes(dtype, device):
    """With dtype, the fused attention computes in it and returns q's dtype: the bits, output and gradients, of
    casting q, k and v before the call and the output after it (the casts ride on the window-order permutes)."""
    from sptr.ops.sparse_attention import fused_sparse_self_attention
    from sptr.ops.windowing import window_partition

    gen = torch.Generator().manual_seed(8)
    n, window, quant = 300, np.full(3, 0.6, np.float32), np.full(3, 0.05, np.float32)
    xyz = (torch.rand(n, 3, generator=gen) * 1.5).to(device)
    sort_idx, offsets = window_partition(xyz, torch.zeros(n, dtype=torch.long, device=device), window, False)
    q, k, v = (torch.randn(n, 2, 16, generator=gen).to(device).requires_grad_() for _ in range(3))
    tables = [(torch.randn(23, 3, 2, 16, generator=gen) * 0.1).to(device, dtype).requires_grad_() for _ in range(3)]
    args = (xyz, sort_idx, offsets, window, False, 0.25, quant, 12, tables)
    got = fused_sparse_self_attention(q, k, v, *args, dtype=dtype)
    want = fused_sparse_self_attention(q.to(dtype), k.to(dtype), v.to(dtype), *args).float()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    g = torch.randn(got.shape, generator=gen).to(device)
    grads_got = torch.autograd.grad(got, [q, k, v, *tables], g)
    grads_want = torch.autograd.grad(want, [q, k, v, *tables], g)
    for name, a, b in zip(("q", "k", "v", "table_q", "table_k", "table_v"), grads_got, grads_want):
        assert a.dtype == b.dtype, name
        if device == "cpu" or name == "q":
            assert torch.equal(a, b), name
        else:  # CUDA scatters key-side and table gradients with atomics: the summation order differs run to run
            assert_close(name, a, b, TOLERANCE[dtype])


def test_sphereformer_attention_matches_reference_branches():
    gen = torch.Generator().manual_seed(4)
    n = 500
    xyz = ring_scan(n, gen)
    batch = torch.zeros(n, dtype=torch.long)
    cfg = SphereFormerConfig(dim=32, num_heads=2, window_size=(1.2, 1.2, 1.2), quant_size=(0.05, 0.05, 0.05),
                             window_size_sphere=(4.5, 4.5, 80.0), quant_size_sphere=(4.5 / 24, 4.5 / 24, 80 / 24))
    block = SphereFormer(cfg)
    feats = torch.randn(n, 32, generator=gen)
    x = block.norm1(feats)
    got = block.attn(sptr.SparseTrTensor(x, torch.cat([batch[:, None].float(), xyz], 1), None, None)).query_feats
    qkv = block.attn.qkv(x).reshape(n, 3, 2, 16).double()
    q, k, v = qkv[:, 0] * 0.25, qkv[:, 1], qkv[:, 2]
    at = block.attn
    cubic = sparse_self_attention_reference(
        q[:, :1], k[:, :1], v[:, :1], xyz, batch, at.window_size, False, at.quant_size, 24,
        [t.double() for t in (at.relative_pos_query_table, at.relative_pos_key_table, at.relative_pos_value_table)])
    sphere = sparse_self_attention_reference(
        q[:, 1:], k[:, 1:], v[:, 1:], cart2sphere(xyz), batch, at.window_size_sphere, False, at.quant_size_sphere, 24,
        [t.double() for t in (at.relative_pos_query_table_sphere, at.relative_pos_key_table_sphere,
                              at.relative_pos_value_table_sphere)], partial(exponential_split, a=cfg.a))
    ref = torch.nn.functional.linear(torch.cat([cubic, sphere], 1).reshape(n, 32), at.proj.weight.double(),
                                     at.proj.bias.double())
    assert_close("sphereformer attention", got, ref, 2e-5)
    out = block(feats, xyz, batch)
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in block.parameters())
    assert np.isfinite(out.detach().numpy()).all()


def test_drop_path_is_timms_to_the_last_bit():
    """SphereFormer uses timm's DropPath: x * (mask / keep), the same random draw; p = 1 drops everything."""
    from sptr.layers.sphereformer import DropPath

    x = torch.randn(64, 8)
    layer = DropPath(0.3).train()
    torch.manual_seed(5)
    got = layer(x)
    torch.manual_seed(5)
    mask = x.new_empty(64, 1).bernoulli_(0.7)
    assert torch.equal(got, x * (mask / 0.7))
    assert torch.equal(DropPath(1.0).train()(x), torch.zeros_like(x))
    assert DropPath(0.3).eval()(x) is x
