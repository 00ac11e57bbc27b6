"""spconv 2.x, the sparse-convolution library of the SphereFormer U-Net, with two fixes for its CPU path.

Install the wheel that matches the machine: ``spconv`` (CPU) or ``spconv-cu12x`` (CUDA 12.x, runs under newer
drivers too); both are independent of the torch version. :func:`import_spconv` returns ``spconv.pytorch`` after
applying these fixes, once per process:

* ``get_current_stream``: spconv's convolution backward asks ``torch.cuda`` for the current stream even for CPU
  tensors, which raises on a machine without a GPU driver. CPU work gets stream 0 (spconv's own CPU value).
* The CPU convolution (``indice_conv`` / ``indice_conv_backward``) gives wrong, run-to-run different outputs when
  torch runs more than one intra-op thread (spconv 2.3.8: up to 0.4 absolute error on a SubMConv3d; exact with
  one thread, checked against a dense ``conv3d`` in tests/models). The CPU calls run with one torch thread.
* CUDA wheels build small-kernel convolutions with the CUDA-only implicit-GEMM algorithm by default, so a model
  made on a GPU machine fails on CPU tensors: CPU inputs run the native algorithm.
* On CPU it has no bf16 and breaks under CPU autocast (its ``mm`` calls turn bf16): the CPU calls run with
  autocast off on inputs cast to the weights' dtype, as its CUDA path casts to fp16 under autocast.

And one notice: spconv asks ``torch.fx`` whether it is tracing in every forward, which torch 2.10+ answers with
a one-time log line about torch.export ("is_fx_tracing will return true for both ...") that says nothing to a
spconv user; it is muted.

The fixes patch spconv's ``ops`` module for the process (spconv offers no hook for them) at the first
:func:`import_spconv`, which ``sptr.models.sphereformer`` calls on import; they change only the cases above.
"""
from __future__ import annotations

import functools

import torch

_INSTALL_HINT = ("the SphereFormer U-Net needs spconv 2.x: `pip install spconv` (CPU) or `pip install "
                 "spconv-cu126` (CUDA 12.x wheels; pick the one nearest your CUDA)")
_patched = False


def import_spconv():
    """``spconv.pytorch`` with the fixes above applied; ImportError with the install command if missing."""
    global _patched
    try:
        import spconv.pytorch as spconv
        from spconv.pytorch import ops
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    if not _patched:
        _patch(ops)
        _mute_fx_tracing_notice()
        _patched = True
    return spconv


def _mute_fx_tracing_notice() -> None:
    """torch prints the notice from a cached function: calling it once with its logger disabled mutes it (and
    nothing else)."""
    import logging

    from torch.fx import _symbolic_trace

    notice = getattr(_symbolic_trace, "is_fx_tracing_warning", None)
    if notice is None:
        return
    log = logging.getLogger(_symbolic_trace.__name__)
    was = log.disabled
    log.disabled = True
    try:
        notice()
    finally:
        log.disabled = was


def _current_stream_or_zero():
    return torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else 0


def _cpu_conv(fn, float_args: int):
    """``fn(features, filters, ...)`` on CPU: one torch thread, autocast off, the first ``float_args`` tensors
    in the filters' dtype (spconv has no bf16, and autocast would turn its internal ``mm`` into bf16)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        features, filters = args[0], args[1]
        if features.is_cuda:
            return fn(*args, **kwargs)
        args = list(args)
        for i in [0] + list(range(2, float_args)):
            args[i] = args[i].to(filters.dtype).contiguous()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.autocast("cpu", enabled=False):
                return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return wrapper


def _native_algo_on_cpu(forward, native):
    """CUDA wheels default every small-kernel convolution to implicit GEMM, which is CUDA-only: CPU inputs take
    the native algorithm (same weight layout, same results)."""
    @functools.wraps(forward)
    def wrapper(self, input, *args, **kwargs):
        if input.features.is_cuda or self.algo == native:
            return forward(self, input, *args, **kwargs)
        algo, self.algo = self.algo, native
        try:
            return forward(self, input, *args, **kwargs)
        finally:
            self.algo = algo

    return wrapper


def _patch(ops) -> None:
    from spconv.core import ConvAlgo
    from spconv.pytorch.conv import SparseConvolution

    SparseConvolution.forward = _native_algo_on_cpu(SparseConvolution.forward, ConvAlgo.Native)
    ops.get_current_stream = _current_stream_or_zero
    ops.indice_conv = _cpu_conv(ops.indice_conv, 1)                    # (features, filters, ...)
    ops.indice_conv_backward = _cpu_conv(ops.indice_conv_backward, 3)  # (features, filters, out_bp, ...)
