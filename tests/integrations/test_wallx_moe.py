"""The Wall-X backend call shapes of the MoE ops (sptr.integrations.wallx), as published, with the fixes."""
import pytest
import torch

from sptr.integrations import wallx
from sptr.reference import moe as ref
from tests.helpers import device_params


@pytest.mark.parametrize("device", device_params())
def test_permute_published_order_and_workspace(device):
    ids = torch.tensor([[1, 2], [0, 1], [0, 2], [1, 2]], dtype=torch.int32, device=device)
    x = torch.arange(4.0, device=device)[:, None].repeat(1, 3)
    permuted, row_id_map, ws = wallx.permute(x, ids, 6, [], 0)
    assert row_id_map.tolist() == [2, 0, 1, 4, 5, 3, -1, -1]
    assert permuted[:, 0].tolist() == [1, 2, 0, 1, 3, 0]
    assert isinstance(ws, list) and ws[0][:8].tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    again = wallx.permute(x, ids, 6, ws, 8)  # the workspace goes back in
    assert torch.equal(again[0], permuted) and torch.equal(again[1], row_id_map)
    neg = wallx.permute(x, torch.tensor([[-1, 0], [0, -1], [1, 0], [0, 0]], device=device), 0, [], 0)
    assert neg[1].tolist() == [0, 3, 7, 5, 2, 1, 4, 6]  # negative ids sort first, as published


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("K", [1, 2])
def test_unpermute_and_backward(device, K):
    T, H = 9, 8
    x = torch.randn(T, H, device=device)
    ids = torch.randint(0, 3, (T, K), device=device)
    permuted, row_id_map, _ = wallx.permute(x, ids, 0, [], 0)
    prob = torch.rand(T, K, device=device)
    out = wallx.unpermute(permuted, row_id_map, prob, T, K)
    want = ref.unpermute_reference(permuted.double(), row_id_map, prob.double(), T)
    assert torch.allclose(out.double(), want, atol=1e-6)
    g = torch.randn(T, H, device=device)
    act_grad, prob_grad = wallx.unpermute_bwd(g, permuted, row_id_map, prob)
    rows = row_id_map.reshape(K, T).t().long()
    assert torch.allclose(act_grad[rows], g[:, None] * prob[..., None], atol=1e-6)
    assert torch.allclose(prob_grad, (g[:, None] * permuted[rows]).sum(-1), atol=1e-5)
    with pytest.raises(ValueError, match="max_tokens \\* num_topK"):
        wallx.unpermute(permuted, row_id_map, prob, T + 1, K)


@pytest.mark.parametrize("device", device_params())
def test_asym_dual_gmm_call_shapes(device):
    a0, a1 = torch.randn(5, 16, device=device), torch.randn(3, 16, device=device)
    w0, w1 = torch.randn(16, 7, device=device), torch.randn(16, 2, device=device)
    o0, o1 = torch.empty(5, 7, device=device), torch.empty(3, 2, device=device)
    r0, r1 = wallx.asym_dual_gmm(a0, a1, w0, w1, o0, o1, False, False)  # the raw extension's order
    assert r0 is o0 and r1 is o1 and torch.allclose(o0, a0 @ w0, atol=1e-5) and torch.allclose(o1, a1 @ w1, atol=1e-5)
    s0, s1 = wallx.asym_dual_gmm_separated(a0, a1, w0.t().contiguous(), w1.t().contiguous(), trans_b=True)
    assert torch.allclose(s0, a0 @ w0, atol=1e-5) and torch.allclose(s1, a1 @ w1, atol=1e-5)
