"""Shared test helpers: devices, dtype tolerances, and a comparison that reports the worst element."""
import pytest
import torch

import sptr._C

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LOW_PRECISION = [torch.float16, torch.bfloat16]
ALL_DTYPES = [torch.float32, torch.float64, *LOW_PRECISION]

# err = max|x - ref| / max|ref| against a float64 reference on the already-rounded inputs. Bounds: fp32 and
# fp64 a few hundred ulps of accumulation; fp16 (2^-11 unit roundoff) and bf16 (2^-8) allow the one final
# rounding plus fp32-accumulation error over windows of ~1000 pairs (spec §10).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
TABLE_TOLERANCE = {torch.float64: 1e-12, torch.float32: 5e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def device_params():
    return [pytest.param(d, marks=pytest.mark.cuda) if d == "cuda" else d for d in DEVICES]


def assert_close(name, actual, expected, tol):
    """Relative max error; the message names the worst element."""
    actual = actual.detach().double().cpu()
    expected = expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    diff = (actual - expected).abs()
    assert not torch.isnan(actual).any(), f"{name}: NaN in result"
    scale = expected.abs().max().clamp_min(1e-30)
    err = (diff.max() / scale).item()
    if err > tol:
        worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.1e} at {worst}: got {actual[worst].item()}, "
                             f"expected {expected[worst].item()}")


def cuda_build_has_kernels():
    """On a CUDA build, a missing CUDA kernel is a failure, not a skip."""
    return sptr._C.has_cuda_kernels()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
