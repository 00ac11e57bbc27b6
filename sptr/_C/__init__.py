"""Loads the compiled kernel library; importing this module registers every ``torch.ops.sptr`` op."""
import torch  # noqa: F401  (the library links against torch; load it first)

try:
    from . import _kernels  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "sptr's compiled extension sptr._C._kernels could not be loaded "
        f"({exc}). Build it with `pip install --no-build-isolation -e .` against the torch you run "
        f"(this is torch {torch.__version__}); a build for another torch version fails to load."
    ) from exc


def has_cuda_kernels() -> bool:
    """True when the library was built with its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("sptr::window_pair_logits_fwd", "CUDA")


def has_sm90_grouped_gemm() -> bool:
    """True when the library holds the CUTLASS grouped GEMM of the MoE ops (built for sm_90a); it runs on compute
    capability 9.0 devices, the mma.sync kernel everywhere else."""
    return bool(_kernels.built_with_sm90a)


def sm90_grouped_gemm_runs(device=None) -> bool:
    """True when the grouped linear ops take the CUTLASS kernel on ``device`` (default: the current CUDA device)
    for 16-byte aligned fp16/bf16 operands: the library holds it and the device has compute capability 9.0 (a
    call made with SPTR_GROUPED_GEMM=mma still takes the mma.sync kernel)."""
    return has_sm90_grouped_gemm() and torch.cuda.get_device_capability(device) == (9, 0)
