"""SphereFormer's training input: random-point voxelisation of each scan, then a random shift of the voxel grid."""
from __future__ import annotations

import torch

from ...data import collate_scans, voxelize_scan
from .config import SphereFormerUNetConfig
from .unet import sparse_input
from ...amp import AMP_DTYPES, cpu_has_native_bf16, mixed_precision  # noqa: F401  (their home before sptr.amp)


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
    missing = [k for k in ("state_dict", "optimizer", "scaler", "step")
               if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path!r} is not a training checkpoint of this library (it lacks {missing}); load its "
                         "weights with --checkpoint instead")
    load_pretrained(model, state)  # the file is read once
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])
