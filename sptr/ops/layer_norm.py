"""LayerNorm over the last dimension on sptr's kernels (CUDA: one warp per row for rows of at most 1024
elements, where ATen runs one thread block per row; CPU and longer rows: the same math in ATen ops)."""
from __future__ import annotations

import torch
from torch import Tensor

import sptr._C  # noqa: F401

from ._checks import FLOATING, check_tensor

_ops = torch.ops.sptr


@torch.library.register_fake("sptr::layer_norm_fwd")
def _layer_norm_fwd_fake(x, weight, bias, eps):
    rows = x.numel() // x.shape[-1]
    stats = x.new_empty(rows, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    return x.new_empty(x.shape), stats, stats.new_empty(rows)


@torch.library.register_fake("sptr::layer_norm_bwd")
def _layer_norm_bwd_fake(grad, x, mean, rstd, weight, has_bias):
    c = x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(c if weight is not None else 0), x.new_empty(c if has_bias else 0)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)``: mean and variance (two passes)
    in fp32 for fp16/bf16/fp32 inputs, differentiable in x, weight and bias. Under autocast it runs in fp32 and
    returns fp32, as torch's layer_norm does; otherwise weight and bias must have x's dtype."""
    check_tensor("x", x, dtypes=FLOATING)
    if x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type):
        x, weight, bias = (None if t is None else t.float() for t in (x, weight, bias))
    return _ops.layer_norm_fwd(x, weight, bias, float(eps))[0]
