"""sptr.ops.layer_norm and sptr.layers.LayerNorm against torch's layer_norm in float64 (forward and the gradients
of x, weight and bias), the warp kernel's row lengths (one to 32 elements per lane, odd lengths) and the ATen
form past 1024 channels, empty inputs, autocast, opcheck, float64 gradcheck, bad input, determinism."""
import pytest
import torch
import torch.nn.functional as F

from sptr.layers import LayerNorm
from sptr.ops.layer_norm import layer_norm
from tests.helpers import TOLERANCE, assert_close, device_params

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def inputs(shape, dtype, device, affine, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype).to(device)
    c = shape[-1]
    w = (torch.randn(c, generator=g) + 1).to(dtype).to(device) if affine else None
    b = torch.randn(c, generator=g).to(dtype).to(device) if affine else None
    return x, w, b


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 32), (2, 5, 64), (300, 1), (41, 7), (29, 33), (64, 100), (17, 256),
                                   (9, 1000), (5, 1030)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_torch_in_float64(device, dtype, shape, affine):
    x, w, b = inputs(shape, dtype, device, affine)
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    y = layer_norm(x, w, b, 1e-5)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    xr, wr, br = (ref_leaves + [None, None])[:3]
    ref = F.layer_norm(xr, shape[-1:], wr, br, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close("y", y, ref, TOLERANCE[dtype])
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    grads = torch.autograd.grad(y, leaves, g)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.double())
    for name, got, want in zip(("dx", "dweight", "dbias"), grads, ref_grads):
        assert got.dtype == dtype
        if name != "dbias" and shape[-1] == 1:  # x̂ = 0: exactly zero (torch's float64 has rounding noise)
            assert not got.any()
            continue
        assert_close(name, got, want, 4 * TOLERANCE[dtype])  # dweight / dbias: sums over the rows


@pytest.mark.parametrize("device", device_params())
def test_layer_norm_empty_rows(device):
    x = torch.randn(0, 48, device=device, requires_grad=True)
    w = torch.ones(48, device=device, requires_grad=True)
    y = layer_norm(x, w, None)
    assert y.shape == (0, 48)
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert dx.shape == (0, 48) and torch.equal(dw, torch.zeros(48, device=device))


@pytest.mark.parametrize("device", device_params())
def test_layer_norm_module_is_nn_layer_norm(device):
    torch.manual_seed(0)
    ours, theirs = LayerNorm(64).to(device), torch.nn.LayerNorm(64).to(device)
    with torch.no_grad():
        ours.weight.normal_()
        ours.bias.normal_()
    theirs.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = torch.randn(50, 64, device=device)
    assert_close("module", ours(x), theirs(x), TOLERANCE[torch.float32])
    assert_close("no bias", LayerNorm(64, bias=False).to(device)(x), F.layer_norm(x, (64,)), TOLERANCE[torch.float32])


@pytest.mark.parametrize("device", device_params())
def test_layer_norm_autocast_runs_in_fp32(device):
    x, w, b = inputs((20, 32), torch.float32, device, True)
    low = torch.bfloat16
    with torch.autocast(device, dtype=low):
        y = layer_norm(x.to(low), w, b)
    assert y.dtype == torch.float32
    assert_close("autocast", y, F.layer_norm(x.to(low).double(), (32,), w.double(), b.double()),
                 TOLERANCE[torch.float32])


def test_layer_norm_opcheck_and_gradcheck():
    x, w, b = inputs((6, 10), torch.float64, "cpu", True)
    torch.library.opcheck(torch.ops.sptr.layer_norm_fwd.default, (x.float(), w.float(), b.float(), 1e-5))
    torch.library.opcheck(torch.ops.sptr.layer_norm_fwd.default, (x.float(), None, None, 1e-5))
    _, mean, rstd = torch.ops.sptr.layer_norm_fwd(x.float(), w.float(), None, 1e-5)
    torch.library.opcheck(torch.ops.sptr.layer_norm_bwd.default,
                          (torch.randn(6, 10), x.float(), mean, rstd, w.float(), False))
    assert torch.autograd.gradcheck(layer_norm, tuple(t.requires_grad_() for t in (x, w, b)))


def test_layer_norm_refuses_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight must be a 1-D tensor of x.shape\\[-1\\] = 8 entries"):
        layer_norm(x, torch.ones(7))
    with pytest.raises(TypeError, match="bias must have x's dtype"):
        layer_norm(x, None, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="last dimension .* must not be empty"):
        layer_norm(torch.randn(4, 0))
    with pytest.raises(TypeError, match="x must have dtype in"):
        layer_norm(torch.ones(4, 8, dtype=torch.long))
    y = layer_norm(x.requires_grad_(), torch.ones(8, requires_grad=True))
    with pytest.raises(RuntimeError, match="layer_norm has no second-order gradient"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layer_norm_cuda_is_deterministic():
    x, w, b = inputs((9000, 64), torch.float32, "cuda", True)
    g = torch.randn_like(x)
    runs = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        runs.append(torch.autograd.grad(layer_norm(*leaves), leaves, g))
    for a, c in zip(*runs):
        assert torch.equal(a, c)
