"""The defects of the second bad-input pass (issue 26), one test each, so that they stay fixed: silently wrong
results, a hang, valid input rejected, inputs silently accepted, and errors that did not name the argument."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from sptr.integrations import wallx
from sptr.layers import SphereFormer, SphereFormerConfig
from sptr.layers.moe import DualExpertFFN, DualExpertFFNConfig, RoutedExpertFFN, RoutedExpertFFNConfig
from sptr.layers.vision_indices import VisionIndices, VisionIndicesConfig
from sptr.ops import rope
from sptr.ops import moe as moe_ops
from sptr.ops import vision_index as vi
from sptr.ops.sparse_attention import fused_sparse_self_attention, sparse_self_attention
from sptr.ops.windowing import get_indices_params, quantised_coords, window_partition

IMG, VID, VS = 151655, 151656, 151652
SECTION = [1, 2, 1]  # head_dim 8


def rope_case(heads=2, seq=5, dim=8, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, seq, dim, generator=gen, requires_grad=requires_grad)
    k = torch.randn(1, 1, seq, dim, generator=gen, requires_grad=requires_grad)
    cos, sin = torch.randn(3, 1, seq, dim, generator=gen), torch.randn(3, 1, seq, dim, generator=gen)
    return q, k, cos, sin


# ------------------------------------------------------------------------------------------ silently wrong
def test_in_place_rotation_is_differentiable_like_pytorch_in_place_ops():
    x, y, cos, sin = rope_case(requires_grad=True)
    q, k = x * 3, y * 2
    rope.apply_rotary_(q, k, cos, sin, SECTION)
    (q.square().sum() + k.sum()).backward()
    x2, y2 = x.detach().requires_grad_(), y.detach().requires_grad_()
    q2, k2 = rope.apply_rotary(x2 * 3, y2 * 2, cos, sin, SECTION)
    (q2.square().sum() + k2.sum()).backward()
    assert torch.equal(q.detach(), q2.detach()) and torch.equal(x.grad, x2.grad) and torch.equal(y.grad, y2.grad)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        rope.apply_rotary_(x, y, cos, sin, SECTION)
    saved = x * 1
    loss = saved.square().sum()  # saves `saved` for its backward
    with torch.no_grad():
        rope.apply_rotary_(saved, y.detach().clone(), cos, sin, SECTION)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_in_place_rotation_of_views_of_a_tensor_that_requires_grad():
    base = torch.randn(1, 3, 5, 8, requires_grad=True)
    _, _, cos, sin = rope_case()
    t = base * 1
    rope.apply_rotary_(t[:, :2], t[:, 2:], cos, sin, SECTION)
    t.sum().backward()
    ref = base.detach().requires_grad_()
    a, b = rope.apply_rotary(ref[:, :2], ref[:, 2:], cos, sin, SECTION)
    (a.sum() + b.sum()).backward()
    assert torch.equal(base.grad, ref.grad)


def test_wallx_rope_out_variant_refuses_autograd_inputs():
    q, k, cos, sin = rope_case(requires_grad=True)
    with pytest.raises(RuntimeError, match="apply_rotary"):
        wallx.rope(q, k, cos, sin, torch.empty(1, 2, 5, 8), torch.empty(1, 1, 5, 8), [2, 4, 2])


def test_overlapping_q_and_k_are_refused_and_disjoint_views_of_one_buffer_pass():
    _, _, cos, sin = rope_case()
    q = torch.randn(1, 3, 5, 8)
    with pytest.raises(ValueError, match="q and k share memory"):
        rope.apply_rotary_(q, q[:, :2], cos, sin, SECTION)
    qkv = torch.randn(1, 5, 3, 2, 8)  # [B, S, 3, H, D]: q and k interleave in memory without overlapping
    qv, kv = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    want = rope.apply_rotary(qv.clone(), kv.clone(), cos, sin, SECTION)
    rope.apply_rotary_(qv, kv, cos, sin, SECTION)
    assert torch.equal(qv, want[0]) and torch.equal(kv, want[1])


def test_unpermute_rejects_a_map_that_repeats_a_row():
    x_perm = torch.randn(4, 6)
    with pytest.raises(ValueError, match="row_id_map must name each x_perm row at most once"):
        moe_ops.unpermute(x_perm, torch.tensor([0, 0, 1, 3], dtype=torch.int32), torch.ones(2, 2))


@pytest.mark.parametrize("unit,match", [(0, "spatial_merge_unit must be an int >= 1"),
                                        (2**29, "cu_window_seqlens is int32"), (2**31, "cu_window_seqlens")])
def test_window_index_spatial_merge_unit(unit, match):
    with pytest.raises(ValueError, match=match):
        vi.get_window_index(torch.tensor([[1, 8, 8]]), 2, 4, 14, unit)


@pytest.mark.parametrize("dtype,scan", [(torch.float16, 2048), (torch.bfloat16, 256)])
def test_batch_ids_stay_exact_with_low_precision_coordinates(dtype, scan):
    xyz = torch.tensor([[1.0, 2.0, 3.0]] * 2, dtype=dtype)  # the same place in two scans
    batch = torch.tensor([scan, scan + 1])
    _, offsets = window_partition(xyz, batch, 0.6, False)
    assert offsets.tolist() == [0, 1, 2]
    assert get_indices_params(xyz, batch, 0.6, False)[2] == 1  # n_max: one point per window
    block = SphereFormer(SphereFormerConfig(dim=32, num_heads=4, window_size=(0.6, 0.6, 0.6),
                                            quant_size=(0.05, 0.05, 0.05)))
    feats = torch.randn(2, 32)
    both = block(feats, xyz, batch)
    alone = torch.cat([block(feats[i:i + 1], xyz[i:i + 1], batch[i:i + 1]) for i in range(2)])
    assert torch.allclose(both, alone, atol=1e-6)


def test_sphereformer_refuses_fractional_batch_ids():
    block = SphereFormer(SphereFormerConfig(dim=32, num_heads=4))
    with pytest.raises(TypeError, match="batch"):
        block(torch.randn(3, 32), torch.randn(3, 3), torch.tensor([0.0, 0.5, 1.0]))


def test_window_ids_that_overflow_int64_raise():
    xyz = torch.tensor([[1e30, 0.0, 0.0], [-1e30, 5.0, 1e29]], dtype=torch.float64)
    with pytest.raises(ValueError, match="overflows int64"):
        window_partition(xyz, torch.zeros(2, dtype=torch.long), 1e-3, False)


def test_wallx_unpermute_does_not_narrow_an_int64_row_map():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"row_id_map must have values in \[-1, 3\)"):
        wallx.unpermute(x, torch.tensor([2**32 + 1, 0], dtype=torch.int64), None, 2, 1)
    out = wallx.unpermute(x, torch.tensor([2, 0], dtype=torch.int64), None, 2, 1)
    assert torch.equal(out, x[[2, 0]])


# ------------------------------------------------------------------------------------------------- hang
def test_rope_index_work_does_not_grow_with_a_grid_t():
    """A 4-token image block of t = 2^40: the checked call raises (transformers fails too); the unchecked
    one returns at once (it used to walk every t). In a subprocess, so that a hang fails the test."""
    ids = torch.tensor([[1, VS, IMG, IMG, IMG, IMG, 2]])
    grid = torch.tensor([[2**40, 4, 4]])
    with pytest.raises(ValueError, match="more t\\*\\(h/2\\)\\*\\(w/2\\) tokens"):
        vi.get_rope_index(ids, grid, None, None, None, 2, IMG, VID, VS, 2.0)
    code = ("import torch; from sptr.ops import data_checks; from sptr.ops import vision_index as vi\n"
            f"with data_checks(False): vi.get_rope_index(torch.tensor({ids.tolist()}), torch.tensor([[2**40, 4, 4]]), "
            f"None, None, None, 2, {IMG}, {VID}, {VS}, 2.0)\nprint('done')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "done", done.stderr[-2000:]


# ------------------------------------------------------------------------------ valid input, round trips
def test_empty_batches_work():
    dual = DualExpertFFN(DualExpertFFNConfig(hidden=8, intermediate=(16, 8)))
    routed = RoutedExpertFFN(RoutedExpertFFNConfig(hidden=8, intermediate=16, num_experts=4, top_k=2))
    for shape in ((0, 8), (2, 0, 8)):
        x = torch.randn(*shape, requires_grad=True)
        out = routed(x)
        assert out.hidden_states.shape == shape
        (out.hidden_states.sum() + out.aux_loss).backward()
        assert dual(x, torch.zeros(shape[:-1], dtype=torch.long)).shape == shape
    x_perm, probs = torch.randn(3, 6, requires_grad=True), torch.ones(0, 2, requires_grad=True)
    out = moe_ops.unpermute(x_perm, torch.zeros(0, dtype=torch.int32), probs)
    out.sum().backward()
    assert out.shape == (0, 6) and probs.grad.shape == (0, 2)
    batch = VisionIndices(VisionIndicesConfig())(torch.zeros(0, 3, dtype=torch.long))
    assert batch.rotary_pos_emb.shape == (0, 40) and batch.cu_window_seqlens.tolist() == [0]
    perm = moe_ops.permute(torch.randn(4, 6), torch.tensor([0, 3, 1, 3]), num_experts=np.int64(4))
    assert perm.tokens_per_expert.tolist() == [1, 1, 0, 2]


# ---------------------------------------------------------------------------- silently accepted inputs
def test_swiglu_checks_its_offsets_and_widths():
    h = torch.randn(6, 8)
    for offsets in ([0, 4, 2], [-1, 2, 6], [0, 3, 7]):
        with pytest.raises(ValueError, match="group_offsets must be non-decreasing"):
            moe_ops.swiglu(h, torch.tensor(offsets), [2, 4])
    for widths, error in (([2.5, 4], TypeError), ([True, 4], TypeError), (None, TypeError), ("24", TypeError),
                          ([2, 5], ValueError)):
        with pytest.raises(error, match="widths|columns"):
            moe_ops.swiglu(h, torch.tensor([0, 3, 6]), widths)


@pytest.mark.parametrize("flag", ["yes", None, 2])
def test_dual_gemm_trans_flags_are_bools(flag):
    a, w = torch.randn(4, 3), torch.randn(3, 5)
    with pytest.raises(TypeError, match="trans_a must be a bool"):
        moe_ops.asym_dual_gmm(a, a, w, w, trans_a=flag)


def test_rope_index_rejects_what_transformers_cannot_position():
    ids = torch.tensor([[1, VS] + [IMG] * 4 + [2]])
    args = (None, None, None)
    with pytest.raises(ValueError, match="more t"):  # INT64_MAX: positions near -4.6e18 before
        vi.get_rope_index(ids, torch.tensor([[2**63 - 1, 4, 4]]), *args, 2, IMG, VID, VS, 2.0)
    with pytest.raises(ValueError, match="h and w >= spatial_merge_size"):  # h // merge == 0: an empty block
        vi.get_rope_index(ids, torch.tensor([[1, 1, 4]]), *args, 2, IMG, VID, VS, 2.0)
    with pytest.raises(TypeError, match="spatial_merge_size must be an int"):
        vi.get_rope_index(ids, torch.tensor([[1, 4, 4]]), *args, 2.5, IMG, VID, VS, 2.0)
    with pytest.raises(ValueError, match="image_grid_thw is on cpu, expected meta"):
        vi.get_rope_index(ids.to("meta"), torch.tensor([[1, 4, 4]]), *args, 2, IMG, VID, VS, 2.0)


def test_rope_index_hf5_checks_token_types():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    grid = torch.tensor([[1, 2, 4]])
    with pytest.raises(TypeError, match="mm_token_type_ids must be an integer tensor"):
        vi.get_rope_index_hf5(ids, torch.tensor([[0.0, 1, 1, 0, 0]]), grid)
    with pytest.raises(ValueError, match="mm_token_type_ids must hold 0"):
        vi.get_rope_index_hf5(ids, torch.tensor([[0, 1, 1, 7, 0]]), grid)


def test_sparse_self_attention_checks_sort_idx_and_pe_type():
    xyz = torch.rand(6, 3)
    batch = torch.zeros(6, dtype=torch.long)
    i0, o0, n_max, i1, o1, sort_idx = get_indices_params(xyz, batch, 10.0, False)
    q = torch.randn(6, 2, 4)
    with pytest.raises(ValueError, match="sort_idx must be a permutation"):
        sparse_self_attention(q, q, q, xyz, i0, o0, n_max, i1, o1, torch.tensor([0, 0, 2, 3, 4, 5]), 10.0, False)
    with pytest.raises(ValueError, match="pe_type must be one of"):
        sparse_self_attention(q, q, q, xyz, i0, o0, n_max, i1, o1, sort_idx, 10.0, False, pe_type="bogus")


def test_fused_sparse_self_attention_checks_sort_idx():
    """The fused path's sort_idx gets sparse_self_attention's checks: a repeated point (which would leave a row
    of the window order unwritten), an index out of range, the wrong length."""
    xyz = torch.rand(6, 3)
    sort_idx, offsets = window_partition(xyz, torch.zeros(6, dtype=torch.long), 10.0, False)
    q = torch.randn(6, 2, 4)
    rest = (offsets, 10.0, False, 0.5)
    assert fused_sparse_self_attention(q, q, q, xyz, sort_idx, *rest).shape == (6, 2, 4)
    with pytest.raises(ValueError, match="sort_idx must be a permutation"):
        fused_sparse_self_attention(q, q, q, xyz, torch.tensor([0, 0, 2, 3, 4, 5]), *rest)
    with pytest.raises(ValueError, match=r"sort_idx must have values in \[0, 6\)"):
        fused_sparse_self_attention(q, q, q, xyz, torch.tensor([0, 1, 2, 3, 4, 6]), *rest)
    with pytest.raises(ValueError, match="sort_idx"):
        fused_sparse_self_attention(q, q, q, xyz, sort_idx[:5], *rest)


def test_quantised_coords_refuse_nan():
    with pytest.raises(ValueError, match="xyz must be finite"):
        quantised_coords(torch.tensor([[0.0, float("nan"), 1.0]]), 1.0, 0.25, False)


def test_vision_functions_on_an_empty_grid_raise_as_transformers_does():
    with pytest.raises(ValueError, match="grid_thw has no rows"):
        vi.rot_pos_emb(torch.rand(20), torch.zeros(0, 3, dtype=torch.long), 2)


# ------------------------------------------------------------------------ errors that name the argument
def test_errors_name_the_argument():
    q, k, cos, sin = rope_case()
    cases = [
        (lambda: rope.apply_rotary(q, k, cos, sin, "233"), TypeError, "mrope_section"),
        (lambda: vi.get_window_index(torch.tensor([[1, 8, 8]]), 2, "4"), TypeError, "vit_merger_window_size"),
        (lambda: vi.rot_pos_emb(torch.rand(20), torch.tensor([[1, 4, 4]], device="meta"), 2), ValueError,
         "needs num_tokens"),
        (lambda: moe_ops.permute(torch.randn(4, 6), torch.zeros(4, dtype=torch.long), 2**40), ValueError,
         "num_experts"),
        (lambda: moe_ops.unpermute(torch.randn(4, 6), torch.arange(4, dtype=torch.int32), torch.ones(3, 2)),
         ValueError, "probs must be"),
        (lambda: DualExpertFFN(DualExpertFFNConfig(hidden=8, intermediate=(16, 8)))(
            torch.randn(3, 8), torch.tensor([0.0, 1.0, 0.0])), TypeError, "expert_index"),
    ]
    big = torch.randn(4, 5)
    cases.append((lambda: moe_ops.asym_dual_gmm(big[:, :3], big[:, :3], torch.randn(3, 5), torch.randn(3, 5),
                                                out=(big, torch.empty(4, 5))), ValueError, "output_expert0"))
    for call, error, name in cases:
        with pytest.raises(error, match=name):
            call()


def test_wallx_input_handling():
    x = torch.randn(0, 4)
    permuted, row_id_map, _ = wallx.permute(x, torch.zeros(0, dtype=torch.long), 0, [], 0)  # N = 0, 1-D ids
    assert permuted.shape == (0, 4) and row_id_map.numel() == 0
    ids = torch.tensor([2**31 + 5, 1, -1], dtype=torch.int64)  # sorted as int64, not wrapped to negative
    permuted, row_id_map, _ = wallx.permute(torch.arange(3.0)[:, None], ids, 0, [], 0)
    assert permuted[:, 0].tolist() == [2.0, 1.0, 0.0]
    with pytest.raises(TypeError, match="indices"):
        wallx.permute(torch.randn(3, 4), torch.tensor([0.5, 1.0, 2.0]), 0, [], 0)
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"prob must be \[max_tokens, num_topK\] = \[2, 2\]"):
        wallx.unpermute(x, torch.arange(4, dtype=torch.int32), torch.ones(2, 2).t().reshape(4, 1), 2, 2)
    a, w = torch.randn(4, 3), torch.randn(3, 5)
    for bad in (torch.empty(4, 5, dtype=torch.float64), torch.empty(2, 2, 5)):
        with pytest.raises(ValueError, match="output_expert0 must be"):
            wallx.asym_dual_gmm(a, a, w, w, bad, None)
    with pytest.raises(ValueError, match="input_bwd"):
        wallx.unpermute_bwd(torch.randn(2, 3), torch.randn(4, 5), torch.arange(4, dtype=torch.int32))
