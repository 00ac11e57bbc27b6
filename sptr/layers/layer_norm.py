"""``nn.LayerNorm`` whose CUDA forward and backward run :func:`sptr.ops.layer_norm.layer_norm`."""
from __future__ import annotations

from torch import Tensor, nn

from ..ops.layer_norm import layer_norm


class LayerNorm(nn.LayerNorm):
    """Drop-in ``nn.LayerNorm`` (same arguments, parameters and state_dict keys). Normalising over the last
    dimension of a CUDA tensor, it runs sptr's warp-per-row kernels: at SphereFormer's 32-256 channels ATen's
    one-block-per-row kernels wait on block scheduling (benchmarks/bench_layer_norm.py). Elsewhere it is
    ``nn.LayerNorm``."""

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda and len(self.normalized_shape) == 1:
            return layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)
