"""Each op family under torch.compile(fullgraph=True) with backward: fake kernels and autograd, no graph break."""
import torch

import sptr
from sptr.ops import rope
from sptr.ops.step_attention import aggregate, pair_logits, segment_softmax


def counted(fn):
    """Compile with fullgraph (a graph break raises) and count the graphs produced."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        boxed = lambda g, _: make_boxed_func(g)  # noqa: E731
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, example_inputs)

    return torch.compile(fn, backend=backend, fullgraph=True), graphs


def assert_one_graph_with_backward(fn, *leaves):
    """fn compiles to one graph, matches eager, and its backward reaches every leaf."""
    compiled, graphs = counted(fn)
    out = compiled(*leaves)
    out.square().sum().backward()
    eager = fn(*(t.detach().requires_grad_() for t in leaves))
    assert len(graphs) == 1
    assert torch.allclose(out, eager, atol=1e-6)
    assert all(t.grad is not None for t in leaves)


def test_window_attention_compiles_to_one_graph():
    torch._dynamo.reset()
    counts = torch.tensor([3, 1, 4, 2])
    o0, o1, i0, i1 = sptr.precompute_all(10, 4, 4, counts)
    q, k, v = (torch.randn(10, 2, 16, requires_grad=True) for _ in range(3))
    table = torch.randn(5, 3, 2, 16, requires_grad=True)
    rel = torch.randint(0, 5, (i0.numel(), 3), dtype=torch.int32)

    def attend(q, k, v, table):
        logits = pair_logits(q * 0.25, k, i0, i1, table, table, rel)
        return aggregate(segment_softmax(logits, o0), v, o0, i1, table, rel)

    assert_one_graph_with_backward(attend, q, k, v, table)


def test_fused_window_attention_compiles_to_one_graph():
    torch._dynamo.reset()
    offsets = torch.tensor([0, 3, 4, 8, 10], dtype=torch.int32)
    q, k, v = (torch.randn(10, 2, 16, requires_grad=True) for _ in range(3))
    table = torch.randn(5, 3, 2, 16, requires_grad=True)
    coords = torch.randint(0, 3, (10, 3), dtype=torch.int32)

    def attend(q, k, v, table):
        rel_pos = sptr.ops.RelativePosition(coords, 2, table, table, table)
        return sptr.ops.window_attention(q, k, v, offsets, rel_pos=rel_pos, scale=0.25)

    assert_one_graph_with_backward(attend, q, k, v, table)


def test_rope_compiles_to_one_graph():
    torch._dynamo.reset()
    q = torch.randn(1, 2, 6, 16, requires_grad=True)
    k = torch.randn(1, 1, 6, 16, requires_grad=True)
    cos, sin = torch.randn(3, 1, 6, 16), torch.randn(3, 1, 6, 16)
    compiled, graphs = counted(lambda a, b: rope.apply_rotary(a, b, cos, sin, [2, 3, 3]))
    qo, ko = compiled(q, k)
    (qo.sum() + ko.sum()).backward()
    want = rope.apply_rotary(q.detach(), k.detach(), cos, sin, [2, 3, 3])
    assert len(graphs) == 1 and torch.equal(qo, want[0]) and q.grad is not None


def test_moe_layers_compile_to_one_graph():
    from sptr.layers import DualExpertFFN, DualExpertFFNConfig, RoutedExpertFFN, RoutedExpertFFNConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    dual = DualExpertFFN(DualExpertFFNConfig(hidden=16, intermediate=(12, 8)))
    index = torch.randint(0, 2, (2, 9))
    x = torch.randn(2, 9, 16, requires_grad=True)
    compiled, graphs = counted(lambda x: dual(x, index))
    out = compiled(x)
    out.square().sum().backward()
    assert len(graphs) == 1 and torch.allclose(out, dual(x.detach(), index), atol=1e-6)
    assert x.grad is not None and all(p.grad is not None for p in dual.parameters())

    torch._dynamo.reset()
    routed = RoutedExpertFFN(RoutedExpertFFNConfig(hidden=16, intermediate=8, num_experts=4, top_k=2,
                                                   capacity_factor=1.0))
    compiled, graphs = counted(lambda x: routed(x))
    got = compiled(x)
    (got.hidden_states.square().sum() + got.aux_loss).backward()
    want = routed(x.detach())
    assert len(graphs) == 1 and torch.allclose(got.hidden_states, want.hidden_states, atol=1e-6)
    assert routed.gate.weight.grad is not None


def test_dual_gemm_compiles_to_one_graph():
    from sptr.ops import moe

    torch._dynamo.reset()
    leaves = [torch.randn(s, requires_grad=True) for s in ((5, 4), (3, 6), (4, 7), (6, 2))]
    compiled, graphs = counted(lambda a0, a1, w0, w1: sum(c.square().sum() for c in moe.asym_dual_gmm(a0, a1, w0, w1)))
    compiled(*leaves).backward()
    assert len(graphs) == 1 and all(t.grad is not None for t in leaves)


def _scene(n=120, channels=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xyz = torch.rand(n, 3, generator=gen) * torch.tensor([3.0, 3.0, 1.0]) + torch.tensor([2.0, -1.0, -0.5])
    batch = (torch.arange(n) >= n // 3).long()
    return torch.randn(n, channels, generator=gen, requires_grad=True), xyz, batch


def test_sphereformer_block_compiles_to_one_graph():
    """The fused path of the SphereFormer block (both window branches, tables) traces in full: the window
    count is a data-dependent size of the window_sort op, nothing reads it on the host."""
    from sptr.layers import SphereFormer, SphereFormerConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = SphereFormer(SphereFormerConfig(dim=32, num_heads=4, window_size=(0.6, 0.6, 0.6),
                                            quant_size=(0.05, 0.05, 0.05)))
    feats, xyz, batch = _scene()
    compiled, graphs = counted(lambda f: block(f, xyz, batch))
    out = compiled(feats)
    out.square().sum().backward()
    assert len(graphs) == 1
    assert torch.allclose(out, block(feats.detach(), xyz, batch), atol=1e-5)
    assert feats.grad is not None and all(p.grad is not None for p in block.parameters())


def test_var_length_attention_compiles_to_one_graph():
    from sptr.layers import SparseTrTensor, VarLengthMultiheadSA

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = VarLengthMultiheadSA(32, 2, "k", 0.8, shift_win=True, pe_type="contextual", rel_query=True,
                                 rel_key=True, rel_value=True, quant_size=0.1)
    feats, xyz, batch = _scene(seed=1)
    indices = torch.cat([batch[:, None].float(), xyz], 1)
    compiled, graphs = counted(lambda f: layer(SparseTrTensor(f, indices, None, 2)).query_feats)
    out = compiled(feats)
    out.square().sum().backward()
    assert len(graphs) == 1
    assert torch.allclose(out, layer(SparseTrTensor(feats.detach(), indices, None, 2)).query_feats, atol=1e-5)
    assert layer.relative_pos_value_table.grad is not None
