"""Segment means over an index (torch-scatter's ``scatter_mean``), for voxel pooling."""
import torch


def scatter_mean(src: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """``torch_scatter.scatter_mean(src, index, dim=0, dim_size=size)``: the sum of the rows of each index
    divided by their count (clamped to 1), in src's dtype. Uses torch-scatter when it is installed, else
    ``index_add_`` (the same sums; sequential on CPU, atomics on CUDA like torch-scatter's)."""
    if index.shape != src.shape[:1]:
        raise ValueError(f"index must be ({src.shape[0]},), got {tuple(index.shape)}")
    try:
        from torch_scatter import scatter_mean as ts_scatter_mean
    except ImportError:
        total = src.new_zeros((size,) + src.shape[1:]).index_add_(0, index, src)
        count = src.new_zeros(size).index_add_(0, index, torch.ones_like(index, dtype=src.dtype))
        return total / count.clamp(min=1).view(-1, *([1] * (src.dim() - 1)))
    return ts_scatter_mean(src, index, dim=0, dim_size=size)
