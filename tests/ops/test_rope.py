"""mRoPE against transformers' apply_multimodal_rotary_pos_emb (bit-exact) and float64 references."""
import pytest
import torch

from sptr.ops import rope
from tests.helpers import device_params
hf = pytest.importorskip("tests.ops.hf_oracle", exc_type=ImportError)  # skips with the version found


def tables(B, S, D, dtype, device, vision=True, theta=1e6):
    """HF's Qwen2_5_VLRotaryEmbedding: cos/sin [3, B, S, D] from (t, h, w) positions."""
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    pos = torch.arange(S).repeat(3, B, 1)
    if vision:
        pos = pos + torch.randint(0, 50, (3, B, S))
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def qk(B, Hq, Hk, S, D, dtype, device, transposed):
    if transposed:  # [B, S, H, D] storage, as the attention projections produce
        q = torch.randn(B, S, Hq, D).to(dtype).to(device).transpose(1, 2)
        k = torch.randn(B, S, Hk, D).to(dtype).to(device).transpose(1, 2)
    else:
        q, k = torch.randn(B, Hq, S, D).to(dtype).to(device), torch.randn(B, Hk, S, D).to(dtype).to(device)
    return q, k


SECTIONS = {64: [8, 12, 12], 80: [10, 15, 15], 128: [16, 24, 24]}


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("Hk", [1, 2, 4])
@pytest.mark.parametrize("transposed", [False, True])
def test_matches_hf_bit_exact_forward_and_backward(device, dtype, D, Hk, transposed):
    torch.manual_seed(D + Hk)
    B, Hq, S = 2, 4, 33
    cos, sin = tables(B, S, D, dtype, device)
    q, k = qk(B, Hq, Hk, S, D, dtype, device, transposed)
    sec = SECTIONS[D]
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    want_q, want_k = hf.apply_multimodal_rotary_pos_emb(q1, k1, cos, sin, sec)
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    got_q, got_k = rope.apply_rotary(q2, k2, cos, sin, sec)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    gq, gk = torch.randn_like(want_q), torch.randn_like(want_k)
    torch.autograd.backward([want_q, want_k], [gq, gk])
    torch.autograd.backward([got_q, got_k], [gq, gk])
    assert torch.equal(q2.grad, q1.grad) and torch.equal(k2.grad, k1.grad)


@pytest.mark.parametrize("device", device_params())
def test_in_place_out_and_compat_backend(device):
    B, S, D = 2, 16, 128
    cos, sin = tables(B, S, D, torch.bfloat16, device)
    q, k = qk(B, 4, 2, S, D, torch.bfloat16, device, transposed=True)
    want_q, want_k = hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [16, 24, 24])
    qi, ki = q.clone(), k.clone()
    rope.rope(qi, ki, cos, sin, qi, ki, [32, 48, 48])  # in place through the Wall-X signature
    assert torch.equal(qi, want_q) and torch.equal(ki, want_k)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    rope.rope(q, k, cos, sin, qo, ko, [32, 48, 48])
    assert torch.equal(qo, want_q) and torch.equal(ko, want_k)
    gq, gk = torch.empty_like(q), torch.empty_like(k)
    rope.rope_bwd(want_q, want_k, q, k, cos, sin, gq, gk, [32, 48, 48])
    # the backward is the inverse rotation: applied to rotated values it gives back the inputs (to rounding)
    assert (gq.float() - q.float()).abs().max() < 0.1


@pytest.mark.parametrize("device", device_params())
def test_fp32_tables_broadcast_batch_and_composed(device):
    B, S, D = 3, 9, 64
    cos, sin = tables(1, S, D, torch.float32, device)
    q, k = qk(B, 2, 2, S, D, torch.float32, device, transposed=False)
    want = hf.apply_multimodal_rotary_pos_emb(q, k, cos.expand(3, B, S, D), sin.expand(3, B, S, D), [8, 12, 12])
    got = rope.apply_rotary(q, k, cos, sin, [8, 12, 12])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # composed [B, S, D] tables (transformers 5.x layout): plain rotate-half RoPE
    sec = [8, 12, 12] * 2
    comp_c = torch.cat([m[i % 3] for i, m in enumerate(cos.expand(3, B, S, D).split(sec, -1))], -1)
    comp_s = torch.cat([m[i % 3] for i, m in enumerate(sin.expand(3, B, S, D).split(sec, -1))], -1)
    got = rope.apply_rotary(q, k, comp_c, comp_s)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def wallx_reference(x, cos, sin, sec):
    """The published Wall-X kernel's stream choice: contiguous doubled sections."""
    D = x.shape[-1]
    stream = torch.cat([torch.full((2 * s,), i) for i, s in enumerate(sec)])
    c = cos[stream, :, :, torch.arange(D)].permute(1, 2, 0)[:, None]
    s = sin[stream, :, :, torch.arange(D)].permute(1, 2, 0)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * c + torch.cat([-x2, x1], -1) * s


def test_wallx_layout_opt_in():
    B, S, D = 1, 7, 128
    cos, sin = tables(B, S, D, torch.float64, "cpu")
    q, k = qk(B, 2, 1, S, D, torch.float64, "cpu", transposed=False)
    got_q, got_k = rope.apply_rotary(q, k, cos, sin, [16, 24, 24], section_layout="wallx")
    assert torch.allclose(got_q, wallx_reference(q, cos, sin, [16, 24, 24]), atol=1e-12)
    hf_q, _ = rope.apply_rotary(q, k, cos, sin, [16, 24, 24])
    assert (hf_q - got_q).abs().max() > 1e-3  # the layouts differ on vision positions


def test_gradcheck_float64_including_tables():
    B, S, D = 1, 5, 16
    cos, sin = tables(B, S, D, torch.float64, "cpu")
    q, k = qk(B, 2, 1, S, D, torch.float64, "cpu", transposed=True)
    args = [t.detach().clone().requires_grad_() for t in (q, k, cos, sin)]
    assert torch.autograd.gradcheck(lambda a, b, c, s: rope.apply_rotary(a, b, c, s, [2, 3, 3]), args)


def test_opcheck_and_errors():
    cos, sin = tables(1, 4, 16, torch.float32, "cpu")
    q, k = qk(1, 2, 1, 4, 16, torch.float32, "cpu", transposed=True)
    torch.library.opcheck(torch.ops.sptr.mrope_fwd.default, (q.requires_grad_(), k, cos, sin, [2, 3, 3], True))
    # trainable tables and a composed table: the C++ autograd's table gradients, traced with dynamic shapes too
    grads = [t.detach().clone().requires_grad_() for t in (q, k, cos, sin)]
    torch.library.opcheck(torch.ops.sptr.mrope_fwd.default, (*grads, [2, 3, 3], False))
    torch.library.opcheck(torch.ops.sptr.mrope_fwd.default, (*grads[:2], cos[0].detach().requires_grad_(),
                                                             sin[0].detach().requires_grad_(), [], True))
    torch.library.opcheck(torch.ops.sptr.mrope_bwd.default, (q.detach(), k, cos, sin, [2, 3, 3], False))
    torch.library.opcheck(torch.ops.sptr.mrope_.default, (q.detach().clone(), k.clone(), cos, sin, [2, 3, 3], True))
    torch.library.opcheck(torch.ops.sptr.mrope_bwd_.default, (q.detach().clone(), k.clone(), cos, sin, [2, 3, 3], True))
    with pytest.raises(ValueError, match="mrope_section"):
        rope.apply_rotary(q, k, cos, sin, [2, 3, 4])
    with pytest.raises(TypeError, match="k has dtype"):
        rope.apply_rotary(q, k.double(), cos, sin, [2, 3, 3])
    with pytest.raises(ValueError, match="section_layout"):
        rope.apply_rotary(q, k, cos, sin, [2, 3, 3], section_layout="other")
    with pytest.raises(RuntimeError, match="single memory location"):
        torch.ops.sptr.mrope_fwd_out(q.detach(), k, cos, sin, [2, 3, 3], True, q.detach(), torch.empty_like(k))


def test_backward_when_only_q_is_used():
    cos, sin = tables(1, 4, 16, torch.float32, "cpu")
    q, k = (t.requires_grad_() for t in qk(1, 2, 1, 4, 16, torch.float32, "cpu", transposed=False))
    q_out, _ = rope.apply_rotary(q, k, cos, sin, [2, 3, 3])
    q_out.sum().backward()
    assert q.grad is not None and torch.equal(k.grad, torch.zeros_like(k))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("table_batch", [1, 2])
@pytest.mark.parametrize("transposed", [False, True])
def test_promotes_like_transformers_under_autocast(device, dtype, table_batch, transposed):
    """Autocast hands the mRoPE fp16/bf16 q, k and fp32 cos/sin; the eager expression then promotes to fp32.
    Output dtype, values, strides, q/k gradients and trainable-table gradients are transformers', bit for bit."""
    torch.manual_seed(3)
    B, S, D = 2, 33, 64
    cos, sin = tables(table_batch, S, D, torch.float32, device)
    q, k = qk(B, 4, 2, S, D, dtype, device, transposed)
    runs = []
    for fn in (hf.apply_multimodal_rotary_pos_emb, rope.apply_rotary):
        leaves = [t.clone().requires_grad_() for t in (q, k, cos, sin)]
        outs = fn(*leaves, [8, 12, 12])
        runs.append((outs, leaves))
    (want, want_leaves), (got, got_leaves) = runs
    for w, g in zip(want, got):
        assert g.dtype == w.dtype == torch.float32 and g.stride() == w.stride() and torch.equal(g, w)
    upstream = [torch.randn_like(w) for w in want]
    torch.autograd.backward(list(want), upstream)
    torch.autograd.backward(list(got), upstream)
    for name, w, g in zip(["q", "k", "cos", "sin"], want_leaves, got_leaves):
        assert g.grad.dtype == w.grad.dtype and torch.equal(g.grad, w.grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("table_batch", [1, 2])
def test_trainable_table_gradients_match_transformers(dtype, table_batch):
    """Table gradients follow autograd's reduction for the eager expression: products in the promoted dtype,
    one sum over heads (and batch for a batch-1 table), q and k parts added."""
    torch.manual_seed(4)
    cos, sin = tables(table_batch, 17, 64, dtype, "cpu")
    q, k = qk(2, 4, 2, 17, 64, dtype, "cpu", transposed=True)
    grads = []
    for fn in (hf.apply_multimodal_rotary_pos_emb, rope.apply_rotary):
        leaves = [t.clone().requires_grad_() for t in (q, k, cos, sin)]
        outs = fn(*leaves, [8, 12, 12])
        torch.autograd.backward(list(outs), [torch.ones_like(o) * 0.37 for o in outs])
        grads.append([t.grad for t in leaves])
    for w, g in zip(*grads):
        assert torch.equal(g, w)


def test_section_and_table_shape_errors():
    cos, sin = tables(1, 4, 16, torch.float32, "cpu")
    q, k = qk(3, 2, 1, 4, 16, torch.float32, "cpu", transposed=False)
    with pytest.raises(TypeError, match="mrope_section must be a list of 3 ints"):
        rope.apply_rotary(q, k, cos, sin, [2.0, 3.0, 3.0])
    streams = cos.expand(3, 3, 4, 16)[:, 0]  # [3, S, D]: the stream tables with the batch squeezed out
    with pytest.raises(ValueError, match="composed .* takes mrope_section=None"):
        rope.apply_rotary(q, k, streams, streams, [2, 3, 3])
    with pytest.raises(ValueError, match="composed"):
        torch.ops.sptr.mrope_fwd(q, k, streams, streams, [2, 3, 3], True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 12, 3, 2048, 128, False),  # all 15 heads per CTA: rounds of 6, 6, 3
                                   (1, 2, 1, 70000, 128, False),   # many positions, one partial round
                                   (2, 16, 2, 240, 128, False),    # few tiles: chunks of 2 heads
                                   (1, 4, 2, 3, 128, False),       # one tile: one head per CTA
                                   (1, 2, 1, 5, 4104, False),      # more pair groups than a CTA has threads
                                   (3, 5, 2, 301, 80, True)],      # [B, S, H, D] views
                         ids=["all-heads", "many-positions", "head-chunks", "head-per-cta", "wide-heads",
                              "transposed"])
def test_cuda_launch_shapes_equal_the_cpu_kernel(dtype, shape):
    """The CUDA kernel's CTA shapes (positions per CTA, head chunks, pair-group loops) give the CPU kernel's
    bits (the CPU kernel is bit-exact to transformers above), forward and backward."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    B, Hq, Hk, S, D, transposed = shape
    torch.manual_seed(S)
    cos, sin = tables(B, S, D, dtype, "cpu")
    q, k = qk(B, Hq, Hk, S, D, dtype, "cpu", transposed)
    sec = [D // 8, D // 8, D // 2 - D // 4]
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    results = []
    for device in ("cpu", "cuda"):
        a, b = q.detach().to(device).requires_grad_(), k.detach().to(device).requires_grad_()
        out = rope.apply_rotary(a, b, cos.to(device), sin.to(device), sec)
        grads = torch.autograd.grad(out, (a, b), (gq.to(device), gk.to(device)))
        results.append([t.cpu() for t in (*out, *grads)])
    assert all(torch.equal(c, g) for c, g in zip(*results))


def graph_names(t):
    """The autograd node names reachable from t."""
    names, stack, seen = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_rotation_of_projection_outputs_records_the_projections(device, dtype):
    """transformers' attention rotates `proj(x).view(B, S, H, D).transpose(1, 2)`: in place, the rotation is
    recorded on the projection's output (no CopySlices, whose backward copies the gradient), the results are
    fresh views of it, and values and gradients are transformers' bits."""
    torch.manual_seed(3)
    B, S, Hq, Hk, D = 2, 7, 4, 2, 16
    cos, sin = tables(B, S, D, dtype, device)
    x = torch.randn(B, S, 24, dtype=dtype, device=device)
    wq = torch.randn(Hq * D, 24, dtype=dtype, device=device, requires_grad=True)
    wk = torch.randn(Hk * D, 24, dtype=dtype, device=device, requires_grad=True)
    gq, gk = torch.randn(B, Hq, S, D, dtype=dtype, device=device), torch.randn(B, Hk, S, D, dtype=dtype, device=device)

    def projections(w1, w2):
        q = torch.nn.functional.linear(x, w1).view(B, S, Hq, D).transpose(1, 2)
        return q, torch.nn.functional.linear(x, w2).view(B, S, Hk, D).transpose(1, 2)

    wq2, wk2 = wq.detach().clone().requires_grad_(), wk.detach().clone().requires_grad_()
    want = hf.apply_multimodal_rotary_pos_emb(*projections(wq2, wk2), cos, sin, [2, 3, 3])
    torch.autograd.backward(want, (gq, gk))
    q, k = projections(wq, wk)
    got = rope.apply_rotary_(q, k, cos, sin, [2, 3, 3])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(q, want[0])  # the views given are rotated too
    assert "CopySlices" not in graph_names(got[0]) and "AsStridedBackward0" not in graph_names(got[0])
    torch.autograd.backward(got, (gq, gk))
    assert torch.equal(wq.grad, wq2.grad) and torch.equal(wk.grad, wk2.grad)
    # the old view object follows its base's new history too
    wq.grad = None
    q, k = projections(wq, wk)
    rope.apply_rotary_(q, k, cos, sin, [2, 3, 3])
    (q * gq).sum().backward()
    assert torch.equal(wq.grad, wq2.grad)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("in_place", [False, True])
def test_backward_overwrites_only_gradients_that_nothing_else_holds(device, in_place):
    """The backward rotates the incoming gradient in place (the op mrope_bwd_) when autograd alone holds it (the
    gradient of the next op, as in a training step), never a user's gradient or one a hook was given (which
    may keep it); transformers' bits either way."""
    torch.manual_seed(4)
    B, S, Hq, Hk, D, dtype = 2, 7, 4, 2, 16, torch.bfloat16
    cos, sin = tables(B, S, D, dtype, device)
    xq = torch.randn(B, S, Hq * D, dtype=dtype, device=device, requires_grad=True)
    xk = torch.randn(B, S, Hk * D, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(B, Hq, S, D, dtype=dtype, device=device), torch.randn(B, Hk, S, D, dtype=dtype, device=device)
    rotate = rope.apply_rotary_ if in_place else rope.apply_rotary

    def grads(rotation, backward, kept=None):
        """xq's and xk's gradients, and the backward ops of the rotation that ran."""
        xq.grad = xk.grad = None
        views = [x.clone().view(B, S, -1, D).transpose(1, 2) for x in (xq, xk)]
        out = rotation(*views, cos, sin, [2, 3, 3])
        if kept is not None:
            out[0].register_hook(lambda g: kept.append((g, g.clone())))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            backward(out)
        return xq.grad, xk.grad, {e.name for e in prof.events() if e.name.startswith("sptr::mrope_bwd")}

    def next_op(out):  # the gradients reach the rotation from the next op's backward, as in a model
        sum((o * g).float().sum() for o, g in zip(out, w)).backward()

    def users(out):
        torch.autograd.backward(out, w)

    # in place, gradients that others hold reach the rotation as copies in the bases' layout (the views' backward)
    held_op = "sptr::mrope_bwd_" if in_place else "sptr::mrope_bwd"
    for backward, op in ((next_op, "sptr::mrope_bwd_"), (users, held_op)):
        want = grads(hf.apply_multimodal_rotary_pos_emb, backward)
        w_before = [t.clone() for t in w]
        got = grads(rotate, backward)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[2] == {op}
        assert all(torch.equal(t, u) for t, u in zip(w, w_before))  # the user's gradients are untouched
    kept = []
    got = grads(rotate, next_op, kept)
    assert torch.equal(got[0], want[0]) and got[2] == {held_op}
    assert torch.equal(kept[0][0], kept[0][1])  # the gradient the hook kept was not rotated


def test_in_place_rotation_of_views_is_checked_like_pytorch_in_place_ops():
    cos, sin = tables(1, 5, 16, torch.float64, "cpu")
    base = torch.randn(1, 5, 32, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 5, 16, dtype=torch.float64).view(1, 5, 1, 16).transpose(1, 2)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        rope.apply_rotary_(base.view(1, 5, 2, 16).transpose(1, 2), k, cos, sin, [2, 3, 3])

    def rotated(b):
        return rope.apply_rotary_((b * 1).view(1, 5, 2, 16).transpose(1, 2), k.clone(), cos, sin, [2, 3, 3])[0]

    assert torch.autograd.gradcheck(rotated, (base,))
    saved = base * 1
    loss = saved.square().sum()  # saves `saved`, whose view is rotated below
    rope.apply_rotary_(saved.view(1, 5, 2, 16).transpose(1, 2), k.clone(), cos, sin, [2, 3, 3])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    q = torch.randn(1, 5, 32, dtype=torch.float64)
    torch.library.opcheck(torch.ops.sptr.mrope_rebased_.default,
                          (q, k.clone(), cos, sin, [2, 3, 3], True, [1, 2, 5, 16], [160, 16, 32, 1], list(k.shape),
                           list(k.stride())))
    with pytest.raises(ValueError, match="must be contiguous"):
        strided = torch.empty_strided((1, 5, 32), (160, 1, 5), dtype=torch.float64).requires_grad_()
        torch.ops.sptr.mrope_rebased_(strided, k.clone(), cos, sin, [2, 3, 3], True,
                                      [1, 2, 5, 16], [160, 16, 32, 1], list(k.shape), list(k.stride()))
