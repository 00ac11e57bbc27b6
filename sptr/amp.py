"""The autocast choice of the training examples: fp16 (with a GradScaler) on CUDA, bf16 on CPUs that compute it
natively, fp32 elsewhere."""
from __future__ import annotations

import torch

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "none": None}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX tiles, as torch's CPU kernels detect them).
    Elsewhere (AVX2 machines) bf16 autocast converts every operand and was measured 8x slower than fp32."""
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def mixed_precision(amp: str | None, device_type: str):
    """``(amp, autocast dtype or None, GradScaler)`` for ``amp`` in fp16 / bf16 / none; None picks fp16 (with
    the scaler) on CUDA, bf16 on a CPU with native bf16 (:func:`cpu_has_native_bf16`) and none (fp32) on
    other CPUs."""
    amp = amp or ("fp16" if device_type == "cuda" else "bf16" if cpu_has_native_bf16() else "none")
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp must be one of {sorted(AMP_DTYPES)}, got {amp!r}")
    return amp, AMP_DTYPES[amp], torch.amp.GradScaler(device_type, enabled=amp == "fp16")
