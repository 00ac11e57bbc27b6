"""DualExpertFFN and RoutedExpertFFN against the plain PyTorch modules they replace (same state dicts):
forward and backward in fp64 / fp32 / fp16 / bf16 and under autocast, routings with empty experts and one
expert, capacity drops, the aux loss, configs, determinism."""
import copy

import pytest
import torch
from torch import nn

from sptr import _C
from sptr.layers import DualExpertFFN, DualExpertFFNConfig, RoutedExpertFFN, RoutedExpertFFNConfig
from sptr.layers.moe import load_balancing_loss, route
from sptr.reference.moe import PlainDualExpertFFN, PlainRoutedExpertFFN, capacity_keep
from tests.helpers import device_params


def worst(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def ulp(t, dtype):
    """Spacing of dtype at max |t|."""
    m = t.detach().abs().max().double().item() if t.numel() else 0.0
    return torch.finfo(dtype).eps * max(m, torch.finfo(dtype).tiny)


def assert_within_plain_error(name, got, plain, ref64, dtype):
    """At most twice the plain module's own error in the same dtype against the float64 run, plus one ulp
    (spec §10: per-expert eager nn.Linear chain for fp16/bf16, cuBLAS for fp32)."""
    bound = 2 * worst(plain, ref64) + ulp(ref64, dtype)
    err = worst(got, ref64)
    assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (plain module: {worst(plain, ref64):.3e})"


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def run_dual(module, x, index, g):
    x = x.clone().requires_grad_()
    out = module(x, index)
    out.backward(g)
    return out, x.grad, grads(module)


SMALL = dict(hidden=48, intermediate=(40, 24))


def dual_pair(device, dtype, bias=False, gemm="grouped"):
    torch.manual_seed(0)
    plain = PlainDualExpertFFN(SMALL["hidden"], SMALL["intermediate"], bias=bias).to(device, torch.float64)
    fused = DualExpertFFN(DualExpertFFNConfig(**SMALL, bias=bias, gemm=gemm)).to(device, torch.float64)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("routing", ["random", "all0", "all1", "bool", "bad_ids"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gemm", ["grouped", "cublas"])
def test_dual_expert_matches_plain_loop(device, dtype, routing, bias, gemm):
    plain64, fused64 = dual_pair(device, torch.float64, bias, gemm)
    B, S, H = 3, 29, SMALL["hidden"]
    torch.manual_seed(1)
    x = torch.randn(B, S, H, device=device, dtype=torch.float64)
    index = {"random": torch.randint(0, 2, (B, S)), "all0": torch.zeros(B, S, dtype=torch.long),
             "all1": torch.ones(B, S, dtype=torch.long), "bool": torch.rand(B, S) < 0.2,
             "bad_ids": torch.randint(-1, 3, (B, S))}[routing].to(device)
    g = torch.randn_like(x)
    ref_out, ref_dx, ref_dw = run_dual(plain64, x, index, g)
    fused64_out, fused64_dx, fused64_dw = run_dual(fused64, x, index, g)
    assert torch.allclose(fused64_out, ref_out, atol=1e-12, rtol=0) and torch.allclose(fused64_dx, ref_dx, atol=1e-12)
    for n in ref_dw:
        assert torch.allclose(fused64_dw[n], ref_dw[n], atol=1e-11), n
    plain, fused = copy.deepcopy(plain64).to(dtype), copy.deepcopy(fused64).to(dtype)
    for m in (plain, fused):
        m.zero_grad()
    p_out, p_dx, p_dw = run_dual(plain, x.to(dtype), index, g.to(dtype))
    f_out, f_dx, f_dw = run_dual(fused, x.to(dtype), index, g.to(dtype))
    assert f_out.dtype == dtype and f_out.shape == x.shape
    assert_within_plain_error("out", f_out, p_out, ref_out, dtype)
    assert_within_plain_error("dx", f_dx, p_dx, ref_dx, dtype)
    for n in ref_dw:
        assert_within_plain_error(n, f_dw[n], p_dw[n], ref_dw[n], dtype)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gemm", ["grouped", "cublas"])
def test_dual_expert_under_autocast(device, dtype, gemm):
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("CPU autocast runs bfloat16")
    plain64, fused64 = dual_pair(device, torch.float64, gemm=gemm)
    plain, fused = copy.deepcopy(plain64).float(), copy.deepcopy(fused64).float()
    x = torch.randn(70, SMALL["hidden"], device=device)
    index = torch.randint(0, 2, (70,), device=device)
    g = torch.randn_like(x)
    ref_out, ref_dx, ref_dw = run_dual(plain64, x.double(), index, g.double())
    with torch.autocast(device_type=device, dtype=dtype):
        p_out, p_dx, p_dw = run_dual(plain, x, index, g.to(dtype))
        f_out, f_dx, f_dw = run_dual(fused, x, index, g.to(dtype))
    assert f_out.dtype == p_out.dtype == dtype
    assert all(p.grad.dtype == torch.float32 for p in fused.parameters())
    assert_within_plain_error("out", f_out, p_out, ref_out, dtype)
    assert_within_plain_error("dx", f_dx, p_dx, ref_dx, dtype)
    for n in ref_dw:
        assert_within_plain_error(n, f_dw[n], p_dw[n], ref_dw[n], dtype)


@pytest.mark.parametrize("device", device_params())
def test_dual_expert_bitwise_reproducible_and_state_dict(device):
    plain, fused = dual_pair(device, torch.float64)
    fused = fused.to(torch.bfloat16)
    x = torch.randn(500, SMALL["hidden"], device=device, dtype=torch.bfloat16)
    index = torch.rand(500, device=device) < 0.15
    g = torch.randn_like(x)
    first, second = run_dual(fused, x, index, g), None
    fused.zero_grad()
    second = run_dual(fused, x, index, g)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert all(torch.equal(first[2][n], second[2][n]) for n in first[2])
    assert fused.cfg.gemm == "grouped"
    keys = set(fused.state_dict())
    assert keys == {f"experts.{e}.{p}_proj.weight" for e in (0, 1) for p in ("gate", "up", "down")}
    again = DualExpertFFN.from_plain(plain, gemm="grouped")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), plain.state_dict().values()))
    assert again.cfg == DualExpertFFNConfig(**SMALL, gemm="grouped")


def test_dual_expert_config_and_input_errors():
    with pytest.raises(ValueError, match="intermediate must be two widths"):
        DualExpertFFNConfig(hidden=8, intermediate=(4,))
    with pytest.raises(ValueError, match=r"intermediate\[1\] must be a positive int"):
        DualExpertFFNConfig(hidden=8, intermediate=(4, 0))
    with pytest.raises(ValueError, match="activation"):
        DualExpertFFNConfig(hidden=8, intermediate=(4, 4), activation="relu")
    with pytest.raises(ValueError, match="unknown keys"):
        DualExpertFFNConfig.from_dict({"hidden": 8, "width": 3})
    assert DualExpertFFNConfig.from_dict({"hidden": 8, "intermediate": [4, 2]}).intermediate == (4, 2)
    layer = DualExpertFFN(DualExpertFFNConfig(hidden=8, intermediate=(4, 2)))
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.randn(3, 7), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="expert_index must have"):
        layer(torch.randn(3, 8), torch.zeros(4, dtype=torch.long))


ROUTED = dict(hidden=40, intermediate=24, num_experts=6)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.75])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemm", ["grouped", "cublas"])
def test_routed_matches_plain_loop(device, top_k, capacity_factor, dtype, gemm):
    torch.manual_seed(top_k)
    plain64 = PlainRoutedExpertFFN(**ROUTED).to(device, torch.float64)
    cfg = RoutedExpertFFNConfig(**ROUTED, top_k=top_k, capacity_factor=capacity_factor, gemm=gemm)
    fused64 = RoutedExpertFFN.from_plain(plain64, top_k=top_k, capacity_factor=capacity_factor, gemm=gemm)
    assert fused64.cfg == cfg
    T = 90
    x = torch.randn(T, ROUTED["hidden"], device=device, dtype=torch.float64)
    probs, index, weight = route(plain64.gate(x), cfg)
    keep = capacity_keep(index, cfg.num_experts, fused64.capacity(T) or T * top_k)
    if capacity_factor:
        assert not keep.all()
    g = torch.randn_like(x)

    def run(module, combine, x, weight):
        x = x.clone().requires_grad_()
        w = weight.detach().clone().requires_grad_()
        out = combine(x, w)
        out.backward(g.to(out.dtype))
        return out, x.grad, w.grad, grads(module)

    plain_fn = lambda m: (lambda x, w: m.combine(x, index, w, keep))  # noqa: E731
    fused_fn = lambda m: (lambda x, w: m.forward_routed(x, index, w))  # noqa: E731
    ref = run(plain64, plain_fn(plain64), x, weight)
    plain, fused = copy.deepcopy(plain64).to(dtype), copy.deepcopy(fused64).to(dtype)
    plain.zero_grad(), fused.zero_grad()
    got_plain = run(plain, plain_fn(plain), x.to(dtype), weight)
    got = run(fused, fused_fn(fused), x.to(dtype), weight)
    names = ["out", "dx", "d topk_weight"]
    for name, a, p, r in zip(names, got[:3], got_plain[:3], ref[:3]):
        if dtype == torch.float64:
            assert torch.allclose(a, r, atol=1e-11), name
        else:
            assert_within_plain_error(name, a, p, r, dtype)
    for n in ref[3]:
        if n.startswith("gate."):
            continue  # the router takes no part in forward_routed
        if dtype == torch.float64:
            assert torch.allclose(got[3][n], ref[3][n], atol=1e-11), n
        else:
            assert_within_plain_error(n, got[3][n], got_plain[3][n], ref[3][n], dtype)


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_routed_forward_aux_loss_and_router_gradient(gating):
    torch.manual_seed(3)
    layer = RoutedExpertFFN(RoutedExpertFFNConfig(**ROUTED, top_k=2, gating=gating)).double()
    x = torch.randn(2, 15, ROUTED["hidden"], dtype=torch.float64)
    out = layer(x)
    assert out.hidden_states.shape == x.shape and out.router_logits.shape == (30, ROUTED["num_experts"])
    logits = x.reshape(30, -1) @ layer.gate.weight.t()
    probs = logits.softmax(-1) if gating == "softmax" else logits.sigmoid()
    top = probs.topk(2, -1).indices
    # transformers' load_balancing_loss_func for one layer
    expert_mask = torch.nn.functional.one_hot(top, ROUTED["num_experts"]).double()
    want = (expert_mask.mean(0) * probs.mean(0)[None]).sum() * ROUTED["num_experts"]
    assert torch.allclose(out.aux_loss.double(), want)
    assert torch.allclose(load_balancing_loss(probs, top, ROUTED["num_experts"]).double(), want)
    (out.hidden_states.square().sum() + out.aux_loss).backward()
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0


def test_routed_config_errors():
    with pytest.raises(ValueError, match="top_k"):
        RoutedExpertFFNConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="gating"):
        RoutedExpertFFNConfig(gating="relu")
    with pytest.raises(ValueError, match="capacity_factor"):
        RoutedExpertFFNConfig(capacity_factor=-1.0)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        RoutedExpertFFNConfig(num_experts=4.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dual_expert_grouped_no_sync_and_cuda_graph():
    plain, fused = dual_pair("cuda", torch.float64, gemm="auto")
    fused = fused.to(torch.bfloat16)
    x = torch.randn(300, SMALL["hidden"], device="cuda", dtype=torch.bfloat16)
    index = (torch.rand(300, device="cuda") < 0.3).long()
    grouped = DualExpertFFN(DualExpertFFNConfig(**SMALL, gemm="grouped")).cuda().to(torch.bfloat16)
    grouped.load_state_dict(fused.state_dict())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            grouped(x, index)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.stream(stream):
        fused(x, index)
        with torch.cuda.graph(graph, stream=stream):
            out = fused(x, index)  # auto: the grouped path while capturing
    torch.cuda.current_stream().wait_stream(stream)
    index.copy_((torch.rand(300, device="cuda") < 0.6).long())
    graph.replay()
    with torch.no_grad():
        want = grouped(x, index)
    assert torch.equal(out, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("intermediate", [(40, 24), (44, 24)])
def test_dual_expert_auto_takes_grouped_where_cutlass_runs(intermediate):
    """gemm="auto" in eager CUDA code: the sync-free grouped path (no host read, forward or backward) where the
    CUTLASS Hopper kernels run all its GEMMs; elsewhere, and for a width that is not whole 16-byte vectors
    (44), cuBLAS per expert after one read of the offsets."""
    torch.manual_seed(0)
    layer = DualExpertFFN(DualExpertFFNConfig(hidden=48, intermediate=intermediate)).cuda().to(torch.bfloat16)
    x = torch.randn(300, 48, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    index = (torch.rand(300, device="cuda") < 0.3).long()
    sync_free = _C.sm90_grouped_gemm_runs() and all(w % 8 == 0 for w in intermediate)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, index).float().square().sum().backward()
        synced = False
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        synced = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert synced != sync_free, f"auto {'read' if synced else 'did not read'} the offsets on the host"
    empty = x[:0].detach().requires_grad_()
    out = layer(empty, index[:0])
    out.float().sum().backward()
    assert out.shape == (0, 48) and empty.grad.shape == (0, 48)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


def test_configs_from_yaml():
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "moe.yaml")
    dual = DualExpertFFNConfig.from_yaml(path, "dual_expert")
    routed = RoutedExpertFFNConfig.from_yaml(path, "routed")
    assert dual == DualExpertFFNConfig() and dual.intermediate == (11008, 2048)
    assert routed.num_experts == 8 and routed.top_k == 2 and routed == RoutedExpertFFNConfig.from_dict(routed.to_dict())


def test_wallx_config_names_and_key_renaming():
    from types import SimpleNamespace

    from sptr.layers import vlm_mlp_to_expert0

    cfg = DualExpertFFNConfig.from_dict({"hidden_size": 32, "intermediate_sizes": [64, 16], "hidden_act": "silu"})
    assert (cfg.hidden, cfg.intermediate, cfg.activation) == (32, (64, 16), "silu")
    with pytest.raises(ValueError, match="both 'hidden_size' and"):
        DualExpertFFNConfig.from_dict({"hidden_size": 32, "hidden": 32})
    wallx = {"num_experts": 4, "mlp_moe": True, "experts": [
        {"hidden_size": 32, "intermediate_size": 64, "hidden_act": "silu"},
        {"hidden_size": 32, "intermediate_size": 16, "hidden_act": "silu"}]}
    assert DualExpertFFNConfig.from_wallx_config(wallx) == DualExpertFFNConfig(hidden=32, intermediate=(64, 16))
    obj = SimpleNamespace(experts=[SimpleNamespace(**e) for e in wallx["experts"]])
    assert DualExpertFFN.from_wallx_config(obj).cfg.intermediate == (64, 16)
    with pytest.raises(ValueError, match="one hidden_size"):
        DualExpertFFNConfig.from_wallx_config({"experts": [{"hidden_size": 32, "intermediate_size": 8},
                                                           {"hidden_size": 16, "intermediate_size": 8}]})
    w = torch.randn(4, 2)
    state = {"model.layers.0.mlp.gate_proj.weight": w, "model.layers.11.mlp.down_proj.weight": w,
             "model.layers.0.self_attn.q_proj.weight": w, "visual.blocks.0.mlp.fc1.weight": w}
    renamed = vlm_mlp_to_expert0(state)
    assert sorted(renamed) == ["model.layers.0.moe.experts.0.gate_proj.weight",
                               "model.layers.0.self_attn.q_proj.weight",
                               "model.layers.11.moe.experts.0.down_proj.weight", "visual.blocks.0.mlp.fc1.weight"]
    assert renamed["model.layers.0.moe.experts.0.gate_proj.weight"] is w


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_routed_layer_as_transformers_moe_block(family):
    """from_plain takes transformers' MoE blocks (4.x: expert modules, Mixtral's w1/w2/w3 among them; 5.x:
    stacked gate_up_proj / down_proj); outputs, dtypes under autocast and the masked load-balancing loss are
    transformers'."""
    module = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    import transformers

    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4,
                                            num_experts_per_tok=2)
        block, routing = module.MixtralSparseMoeBlock(config), {"top_k": 2}
    else:  # OLMoE keeps the top-k probabilities as they are (norm_topk_prob=False)
        config = transformers.OlmoeConfig(hidden_size=32, intermediate_size=48, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=False)
        block, routing = module.OlmoeSparseMoeBlock(config), {"top_k": 2, "normalize_topk": False}
    with torch.no_grad():  # 5.x allocates the stacked experts uninitialised
        for p in block.parameters():
            p.normal_(0, 0.2)
    block.eval()
    layer = RoutedExpertFFN.from_plain(block, **routing)
    x = torch.randn(2, 7, 32)

    def block_outputs(x):  # 4.x returns (out, logits); 5.x the output alone, its router (logits, weights, ids)
        out = block(x)
        return out if isinstance(out, tuple) else (out, block.gate(x.reshape(-1, 32))[0])

    with torch.no_grad():
        want, want_logits = block_outputs(x)
        got = layer(x)
    assert torch.allclose(got.hidden_states, want, atol=1e-6, rtol=1e-5)
    assert torch.allclose(got.router_logits, want_logits, atol=1e-6)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    want_aux = module.load_balancing_loss_func((want_logits,), 4, 2, mask)
    assert torch.allclose(layer(x, attention_mask=mask).aux_loss, want_aux, atol=1e-6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_logits = block_outputs(x)
        got = layer(x)
    assert got.hidden_states.dtype == want.dtype == torch.float32
    assert got.router_logits.dtype == want_logits.dtype


def test_routed_layer_from_stacked_experts_refuses_other_layouts():
    """Stacked experts the layer cannot hold (transposed, biased, a shared expert) are refused by name."""
    E, H, inter = 3, 8, 6

    class Stacked(nn.Module):
        def __init__(self, **flags):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * inter, H))
            self.down_proj = nn.Parameter(torch.randn(E, H, inter))
            self.__dict__.update(flags)

    def block(**flags):
        b = nn.Module()
        b.gate, b.experts = nn.Linear(H, E, bias=False), Stacked(**flags)
        return b

    plain = block()
    layer = RoutedExpertFFN.from_plain(plain, top_k=1)
    assert torch.equal(layer.experts[1].up_proj.weight, plain.experts.gate_up_proj[1, inter:])
    assert torch.equal(layer.experts[2].down_proj.weight, plain.experts.down_proj[2])
    for flags in ({"is_transposed": True}, {"has_bias": True}):
        with pytest.raises(ValueError, match="Stacked: only the"):
            RoutedExpertFFN.from_plain(block(**flags), top_k=1)
    bad = block()
    bad.experts.down_proj = nn.Parameter(torch.randn(E, H, inter + 1))
    with pytest.raises(ValueError, match=r"down_proj \(3, 8, 7\)"):
        RoutedExpertFFN.from_plain(bad, top_k=1)
    shared = block()
    shared.shared_expert = nn.Linear(H, H)
    with pytest.raises(ValueError, match="shared expert"):
        RoutedExpertFFN.from_plain(shared, top_k=1)
