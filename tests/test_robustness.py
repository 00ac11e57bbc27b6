"""Unusual but legal calls that must work, and unsafe ones that must fail loudly (issue 16): second-order
gradients, value checks that cannot be fooled, thread-local data_checks, inference-mode and meta tensors,
dtypes the raw ops read, checkpoint containers."""
import threading

import numpy as np
import pytest
import torch

import sptr
from sptr.ops import RelativePosition, data_checks, window_attention
from sptr.ops.step_attention import aggregate, pair_logits, segment_softmax

OFFSETS = [0, 3, 7]


def attention_case(dtype=torch.float64, requires_grad=True):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 2, 4, generator=gen, dtype=dtype).requires_grad_(requires_grad) for _ in range(3))
    coords = torch.randint(0, 2, (7, 3), generator=gen, dtype=torch.int32)
    table = torch.randn(3, 3, 2, 4, generator=gen, dtype=dtype).requires_grad_(requires_grad)
    return q, k, v, torch.tensor(OFFSETS, dtype=torch.int32), RelativePosition(coords, 1, table, table, table)


def pair_case(dtype=torch.float64):
    counts = torch.tensor([3, 4])
    o0, _, i0, i1 = sptr.precompute_all(7, 2, 4, counts)
    gen = torch.Generator().manual_seed(1)
    rel = torch.randint(0, 3, (i0.numel(), 3), generator=gen, dtype=torch.int32)
    return o0, i0, i1, rel


# ------------------------------------------------------------------------------------ second-order gradients
def test_double_backward_through_window_attention_is_an_error():
    q, k, v, offsets, rel_pos = attention_case()
    out = window_attention(q, k, v, offsets, rel_pos=rel_pos)
    (g,) = torch.autograd.grad(out.square().sum(), q)  # first order without create_graph works
    assert torch.isfinite(g).all()
    out = window_attention(q, k, v, offsets, rel_pos=rel_pos)
    with pytest.raises(RuntimeError, match="window_attention has no second-order gradient"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


@pytest.mark.parametrize("op", ["pair_logits", "segment_softmax", "aggregate"])
def test_double_backward_through_step_ops_is_an_error(op):
    q, k, v, _, rel_pos = attention_case()
    o0, i0, i1, rel = pair_case()
    table = rel_pos.query_table
    logits = pair_logits(q, k, i0, i1, table, table, rel)
    attn = segment_softmax(logits, o0)
    out = aggregate(attn, v, o0, i1, table, rel)
    target = {"pair_logits": logits, "segment_softmax": attn, "aggregate": out}[op]
    with pytest.raises(RuntimeError, match=f"{op} has no second-order gradient"):
        torch.autograd.grad(target.square().sum(), [q, v], create_graph=True, allow_unused=True)


def test_dual_gemm_has_exact_second_order_gradients():
    """The dual GEMM's backward is itself a dual GEMM, so its double backward is real, not zero."""
    from sptr.ops import moe

    gen = torch.Generator().manual_seed(2)
    a0, a1 = torch.randn(3, 5, generator=gen, dtype=torch.float64), torch.randn(2, 5, generator=gen, dtype=torch.float64)
    w0, w1 = torch.randn(5, 4, generator=gen, dtype=torch.float64), torch.randn(5, 6, generator=gen, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (a0, a1, w0, w1)]
    assert torch.autograd.gradgradcheck(lambda *t: moe.asym_dual_gmm(*t), leaves)


# ----------------------------------------------------------------------------- value checks, every call
def test_step_op_checks_see_writes_through_data_and_numpy():
    q, k, v, _, rel_pos = attention_case(requires_grad=False)
    o0, i0, i1, rel = pair_case()
    pair_logits(q, k, i0, i1)
    i1.numpy()[5] = -1
    with pytest.raises(ValueError, match="index_1 must have values in"):
        pair_logits(q, k, i0, i1)
    i1.data[5] = 0
    pair_logits(q, k, i0, i1)
    o0.data[1] = 99
    with pytest.raises(ValueError, match="index_0_offsets must be non-decreasing"):
        aggregate(torch.zeros(i1.numel(), 2, dtype=q.dtype), v, o0, i1)


def test_data_checks_are_thread_local():
    """A thread inside data_checks(False) leaves the checks on in the other threads."""
    q, k, v, _, _ = attention_case(requires_grad=False)
    bad = torch.tensor([0, 9, 7], dtype=torch.int32)
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def unchecked_thread():
        with data_checks(False):
            inside.set()
            done.wait(10)
            seen["enabled_in_thread"] = sptr.ops._checks.data_checks_enabled()

    thread = threading.Thread(target=unchecked_thread)
    thread.start()
    assert inside.wait(10)
    try:
        with pytest.raises(ValueError, match="window_offsets must be non-decreasing"):
            window_attention(q, k, v, bad)
    finally:
        done.set()
        thread.join()
    assert seen["enabled_in_thread"] is False


def test_raw_ops_reject_uint8_rel_idx():
    q, k, v, _, rel_pos = attention_case(requires_grad=False)
    o0, i0, i1, rel = pair_case()
    table = rel_pos.query_table
    wide = rel.to(torch.uint8)
    with pytest.raises(TypeError, match="rel_idx must be int8, int16, int32 or int64"):
        torch.ops.sptr.window_pair_logits_fwd(q, k, i0, i1, table, table, wide, True)
    attn = torch.rand(i1.numel(), 2, dtype=q.dtype)
    with pytest.raises(TypeError, match="rel_idx must be int8, int16, int32 or int64"):
        torch.ops.sptr.window_aggregate_fwd(attn, v, o0, i1, table, wide)
    with pytest.raises(TypeError, match="rel_idx must have dtype"):
        pair_logits(q, k, i0, i1, table, table, wide)


# ------------------------------------------------------------------------- inference-mode and meta tensors
def test_inference_mode_index_tensors():
    with torch.inference_mode():
        q, k, v, offsets, rel_pos = attention_case(requires_grad=False)
        o0, i0, i1, rel = pair_case()
    want = window_attention(q.clone(), k.clone(), v.clone(), offsets.clone(), rel_pos=rel_pos)
    assert torch.equal(window_attention(q, k, v, offsets, rel_pos=rel_pos), want)
    with torch.inference_mode():
        assert torch.equal(window_attention(q, k, v, offsets, rel_pos=rel_pos), want)
    assert pair_logits(q, k, i0, i1, rel_pos.query_table, None, rel).shape == (i0.numel(), 2)
    with pytest.raises(ValueError, match="window_offsets must start at 0"):
        window_attention(q, k, v, offsets + 1)


def test_meta_tensors_give_meta_outputs():
    q, k, v, offsets, rel_pos = attention_case(torch.float32, requires_grad=False)
    o0, i0, i1, rel = pair_case()
    meta = lambda t: t.to("meta")  # noqa: E731
    rel_meta = RelativePosition(meta(rel_pos.coords), 1, *(meta(t) for t in rel_pos.tables()))
    out = window_attention(meta(q), meta(k), meta(v), meta(offsets), rel_pos=rel_meta)
    assert out.is_meta and out.shape == q.shape and out.dtype == q.dtype
    logits = pair_logits(meta(q), meta(k), meta(i0), meta(i1), meta(rel_pos.query_table), None, meta(rel))
    assert logits.is_meta and logits.shape == (i0.numel(), 2)
    attn = segment_softmax(logits, meta(o0))
    assert aggregate(attn, meta(v), meta(o0), meta(i1)).shape == q.shape


# --------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_prefixes_key_by_key_and_bad_containers(tmp_path):
    from sptr.models.sphereformer import load_pretrained, match_module_prefix

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    state = model.state_dict()
    mixed = {("module." + k if i % 2 else k): v for i, (k, v) in enumerate(state.items())}
    assert list(match_module_prefix(mixed, model)) == list(state)
    load_pretrained(model, mixed)
    with pytest.raises(ValueError, match="both with and without"):
        match_module_prefix({"0.bias": state["0.bias"], "module.0.bias": state["0.bias"]}, model)
    for bad, kind in (([1, 2], "list"), ({"state_dict": None}, "NoneType")):
        path = tmp_path / f"{kind}.pth"
        torch.save(bad, path)
        with pytest.raises(TypeError, match=f"holds no state dict.*got {kind}"):
            load_pretrained(model, str(path))
        with pytest.raises(TypeError, match=f"path_or_state holds no state dict.*got {kind}"):
            load_pretrained(model, bad)
    with pytest.raises(TypeError, match="entry '0.weight' is a str"):
        load_pretrained(model, {"0.weight": "x"})


# --------------------------------------------------------------------------------- the published signatures
def test_dot_prod_with_idx_reads_numpy_and_tensor_n_max_as_the_official_order():
    q, k, v, _, rel_pos = attention_case(requires_grad=False)
    o0, i0, i1, rel = pair_case()
    t = rel_pos.query_table
    want = sptr.dot_prod_with_idx(q, i0, o0, 4, k, o0[:-1], i1, t, t, rel)
    for n_max in (np.int64(4), torch.tensor(4)):
        assert torch.equal(sptr.dot_prod_with_idx(q, i0, o0, n_max, k, o0[:-1], i1, t, t, rel), want)
    assert torch.equal(sptr.dot_prod_with_idx(q, i0, o0, k, i1, o0[:-1], t, t, rel, 4), want)


def test_sparse_self_attention_rejects_out_of_range_sort_idx():
    q, k, v, _, _ = attention_case(torch.float32, requires_grad=False)
    xyz = torch.rand(7, 3)
    params = sptr.get_indices_params(xyz, torch.zeros(7, dtype=torch.long), 2.0, False)
    index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx = params
    bad = sort_idx.clone()
    bad[0] = 7
    with pytest.raises(ValueError, match=r"sort_idx must have values in \[0, 7\)"):
        sptr.sparse_self_attention(q, k, v, xyz, index_0, index_0_offsets, n_max, index_1, index_1_offsets, bad,
                                   2.0, False)
