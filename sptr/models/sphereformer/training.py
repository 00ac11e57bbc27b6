"""SphereFormer's training input: random-point voxelisation of each scan, then a random shift of the voxel grid."""
from __future__ import annotations

import torch

from ...data import collate_scans, voxelize_scan
from .config import SphereFormerUNetConfig
from .unet import sparse_input


def training_batch(cfg: SphereFormerUNetConfig, scans, generator: torch.Generator, device):
    """``(SparseConvTensor, xyz, batch, labels)`` of labelled scans ``[(points, labels), ...]``: one random
    point per voxel, the voxel grid shifted by 0 or 1 per axis (as SphereFormer's train.py)."""
    voxels = [voxelize_scan(points, cfg.voxel_size, cfg.pc_range, mode="random", labels=labels,
                            generator=generator) for points, labels in scans]
    feats, coords, xyz, batch, labels = (t.to(device) for t in collate_scans(voxels))
    coords = coords + (torch.rand(3, generator=generator) * 2).long().to(device)
    return sparse_input(feats, coords, batch, len(scans)), xyz, batch, labels


def batch_inputs(batch: dict, device, generator: torch.Generator | None = None):
    """``(SparseConvTensor, xyz, batch, labels)`` of a training batch from ``sptr.data.collate_samples``, the voxel
    grid shifted by 0 or 1 per axis as in :func:`training_batch`."""
    coords = batch["coords"] + (torch.rand(3, generator=generator) * 2).long()
    feats, coords, xyz, ids = (t.to(device) for t in (batch["feats"], coords, batch["xyz"], batch["batch"]))
    labels = None if batch["labels"] is None else batch["labels"].to(device)
    return sparse_input(feats, coords, ids, len(batch["paths"])), xyz, ids, labels


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


def save_training_state(path: str, model, optimizer, scaler, step: int, extra: dict | None = None) -> None:
    """Weights (as ``model.state_dict()``: a DDP model's keep ``module.``), optimizer, scaler, step, config, and
    ``extra`` entries (a scheduler's state, the best score)."""
    import dataclasses

    net = getattr(model, "module", model)
    torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                "step": step, "config": dataclasses.asdict(net.cfg), **(extra or {})}, path)


def resume_training_state(path: str, model, optimizer, scaler, scheduler=None) -> int:
    """Load what :func:`save_training_state` wrote (and the scheduler's state, if saved); returns the step to
    continue from."""
    from .checkpoint import _numpy_scalar_globals, load_pretrained

    if path.endswith(".safetensors"):
        raise ValueError(f"{path!r} holds weights only; resuming needs a training checkpoint (weights, optimizer, "
                         "scaler, step, as save_training_state writes): load weights with --checkpoint instead")
    with torch.serialization.safe_globals(_numpy_scalar_globals()):
        state = torch.load(path, map_location="cpu", weights_only=True)
    missing = [k for k in ("state_dict", "optimizer", "scaler", "step") if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path!r} is not a training checkpoint of this library (it lacks {missing}); load its "
                         "weights with --checkpoint instead")
    load_pretrained(model, path)
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])
