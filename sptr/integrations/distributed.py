"""Helpers for training sptr's layers with torch.distributed (DDP, FSDP2) under torchrun.

PyTorch's ``nn.SyncBatchNorm`` only runs on GPUs (DDP refuses it in a CPU module), so a gloo run on CPU (CI,
debugging without GPUs) could not synchronise batch norm. :func:`convert_sync_batchnorm` gives PyTorch's own
``nn.SyncBatchNorm`` for a CUDA model and :class:`CPUSyncBatchNorm`, built on torch.distributed's
differentiable all-reduce, for a CPU one.
"""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from torch import nn


class _SumAcrossRanks(torch.autograd.Function):
    """all_reduce(SUM) whose backward is all_reduce(SUM) of the gradient (each rank's output feeds its own
    loss, so the input's gradient is the sum over ranks)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm over every rank's batch, for CPU tensors (gloo): per-channel sums and counts, then the sums of
    squared deviations from the global mean, are all-reduced differentiably (the backward reduces the gradient
    terms across ranks the same way); the batch is normalised with the global biased variance, the running
    statistics take the unbiased one (as ``nn.SyncBatchNorm``). Outside training, or in a world of one, it is
    plain batch norm."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-D input (N, C, ...), got {x.dim()}-D")

    def _group(self):
        return self.process_group or dist.group.WORLD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self._group()) > 1):
            return super().forward(x)
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        acc = torch.promote_types(x.dtype, torch.float32)  # at least fp32; a float64 model keeps float64
        xf = x.to(acc)
        count = torch.tensor([x.numel() // max(x.shape[1], 1)], dtype=acc)
        # Two passes (mean, then squared deviations): E[x^2] - E[x]^2 cancels badly when |mean| >> std
        stats = _SumAcrossRanks.apply(torch.cat([xf.sum(dims), count]), self._group())
        total = stats[-1]
        mean = stats[:-1] / total
        centred = xf - mean.reshape(shape)
        var = _SumAcrossRanks.apply((centred * centred).sum(dims), self._group()) / total
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var * total / (total - 1).clamp(min=1)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        out = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out.to(x.dtype)


def _cpu_sync(module: nn.Module, process_group) -> nn.Module:
    converted = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        converted = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                     module.track_running_stats, process_group)
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, _cpu_sync(child, process_group))
    return converted


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Every ``BatchNorm*d`` of ``module`` synchronised across ranks, same parameters and buffers (state dict
    keys unchanged): PyTorch's ``nn.SyncBatchNorm`` when the module is on a GPU, :class:`CPUSyncBatchNorm`
    when it is on the CPU."""
    on_gpu = any(p.device.type != "cpu" for p in module.parameters())
    if on_gpu:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _cpu_sync(module, process_group)


def init_from_torchrun() -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)`` of this torchrun process, after ``init_process_group``: NCCL and
    ``cuda:LOCAL_RANK`` when GPUs are present, else gloo on CPU. A plain ``python`` run is a world of one."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"torchrun started local rank {local} but only {torch.cuda.device_count()} GPU(s) "
                               "are visible: use --nproc_per_node <= the GPU count, or CUDA_VISIBLE_DEVICES= to run "
                               "on the CPU with gloo")
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def end_process_group() -> None:
    """End the default process group on every rank together, once the caller has dropped its DDP/FSDP modules.
    Their hooks hold the group in reference cycles; a group still alive at interpreter shutdown is freed while
    gloo's threads run and aborts the process ("terminate called without an active exception"), so the cycles
    are collected first. A no-op when no group is initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def global_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total`` scaled so that DDP's gradient averaging gives the mean over every rank's items: with ranks
    holding different numbers of points, the per-rank mean would weight each rank equally instead."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return total / count.clamp(min=1)
    everyone = count.detach().clone().float()
    dist.all_reduce(everyone)
    return total * dist.get_world_size() / everyone.clamp(min=1)
