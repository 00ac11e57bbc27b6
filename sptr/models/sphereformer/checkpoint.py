"""Loading released SphereFormer checkpoints and saving them as safetensors + the config YAML.

Released checkpoints are saved from the DDP-wrapped model (``module.`` keys, ``{'state_dict': ...}``) and store
spconv weights in spconv 2.1's ``(k, k, k, out, in)`` layout; spconv >= 2.2 uses ``(out, k, k, k, in)``.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

SPCONV_LAYOUTS = ("auto", "2.1", "2.2")


def match_module_prefix(state_dict: dict, model: nn.Module) -> dict:
    """Add or strip DDP/DataParallel's ``module.`` prefix, key by key, so the keys match ``model``'s (a file
    whose keys mix both forms loads too)."""
    want_prefix = next(iter(model.state_dict()), "").startswith("module.")
    bare = {k.removeprefix("module."): v for k, v in state_dict.items()}
    if len(bare) != len(state_dict):
        raise ValueError("checkpoint holds some keys both with and without the 'module.' prefix")
    return {f"module.{k}": v for k, v in bare.items()} if want_prefix else bare


def as_state_dict(state, source: str = "checkpoint") -> dict:
    """``state`` itself or its ``'state_dict'`` entry, which must map str keys to tensors."""
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise TypeError(f"{source} holds no state dict: expected a dict of tensors or {{'state_dict': dict}}, "
                        f"got {type(state).__name__}")
    odd = next(((k, v) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)),
               None)
    if odd is not None:
        raise TypeError(f"{source}: entry {odd[0]!r} is a {type(odd[1]).__name__}, expected a tensor under a str key")
    return state


def read_state_dict(path: str) -> dict:
    """Tensors of a ``.safetensors`` file or a torch checkpoint (a state dict or ``{'state_dict': ...}``), read
    with ``weights_only=True``."""
    return read_checkpoint(path)[0]


def read_checkpoint(path: str) -> tuple[dict, dict | None]:
    """``(state dict, the config it was saved with or None)``: a training checkpoint's ``config`` entry, or the
    ``config.yaml`` that :func:`save_pretrained` writes beside a ``.safetensors`` file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        beside = os.path.join(os.path.dirname(path), "config.yaml")
        config = None
        if os.path.isfile(beside):
            import yaml

            with open(beside) as f:
                config = yaml.safe_load(f)
        return load_file(path), config if isinstance(config, dict) else None
    with torch.serialization.safe_globals(_numpy_scalar_globals()):
        state = torch.load(path, map_location="cpu", weights_only=True)
    return as_state_dict(state, f"checkpoint {path!r}"), saved_config(state)


def saved_config(checkpoint) -> dict | None:
    """The ``config`` entry of a loaded training checkpoint (as ``save_training_state`` writes it), or None."""
    config = checkpoint.get("config") if isinstance(checkpoint, dict) else None
    return config if isinstance(config, dict) else None


def _config_difference(saved: dict | None, model: nn.Module) -> str:
    """'; saved with a config that differs in ...' naming the fields, or '' (no saved config, or no difference)."""
    cfg = getattr(model, "cfg", None)
    if saved is None or not dataclasses.is_dataclass(cfg):
        return ""
    current = dataclasses.asdict(cfg)
    plain = lambda v: [plain(x) for x in v] if isinstance(v, (list, tuple)) else v  # noqa: E731
    diffs = [f"{k} = {saved[k]!r} (model: {current[k]!r})" for k in current
             if k in saved and plain(saved[k]) != plain(current[k])]
    return f"; the checkpoint was saved with a config that differs in {', '.join(diffs)}" if diffs else ""


def _numpy_scalar_globals() -> list:
    """What a numpy scalar pickles with (SphereFormer's train.py stores ``best_iou`` as a numpy float64 and
    ``is_best`` as a numpy bool): numpy's scalar constructor and the dtype classes, which build values and run
    no other code; nothing else is allowed beyond weights_only's own set."""
    import numpy as np

    try:
        from numpy._core.multiarray import scalar
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import scalar
    kinds = (np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_)
    return [scalar, np.dtype, *{type(np.dtype(k)) for k in kinds}]


def _sparse_conv_weights(model: nn.Module) -> set[str]:
    from ...integrations.spconv_backend import import_spconv

    try:
        spconv = import_spconv()
    except ImportError:  # without spconv no model has sparse convolutions
        return set()
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, spconv.conv.SparseConvolution):
            names.add(f"{prefix}.weight" if prefix else "weight")
    return names


def convert_spconv_layout(state_dict: dict, model: nn.Module, layout: str = "auto") -> dict:
    """Sparse-conv weights in the installed spconv's ``(out, k, k, k, in)`` layout. ``layout="2.1"``: every such
    weight is ``(k, k, k, out, in)``; ``"2.2"``: none is; ``"auto"``: those whose shape only fits after
    ``permute(3, 0, 1, 2, 4)`` are converted."""
    if layout not in SPCONV_LAYOUTS:
        raise ValueError(f"spconv_layout must be one of {SPCONV_LAYOUTS}, got {layout!r}")
    if layout == "2.2":
        return dict(state_dict)
    target = model.state_dict()
    out = dict(state_dict)
    for name in _sparse_conv_weights(model):
        if name not in out or out[name].dim() != 5:
            continue
        weight, want = out[name], target[name].shape
        converted = weight.permute(3, 0, 1, 2, 4)
        if layout == "2.1" or (weight.shape != want and converted.shape == want):
            out[name] = converted.contiguous()
    return out


def load_pretrained(model: nn.Module, path_or_state, strict: bool = True, spconv_layout: str = "auto"):
    """Load a checkpoint into ``model``: a path (``.pth``/``.pt``/``.tar`` torch file or ``.safetensors``) or a
    state dict (or a loaded training checkpoint, whose ``config`` is then named where shapes differ), keys with or
    without ``module.``, spconv 2.1 weights converted. Strict by default; any shape mismatch raises a ValueError
    naming the key and both shapes. Returns ``load_state_dict``'s result."""
    if isinstance(path_or_state, (str, os.PathLike)):
        state, config = read_checkpoint(os.fspath(path_or_state))
    else:
        state, config = as_state_dict(path_or_state, "path_or_state"), saved_config(path_or_state)
    state = match_module_prefix(state, model)
    state = convert_spconv_layout(state, model, spconv_layout)
    target = model.state_dict()
    mismatched = [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(target[k].shape)}"
                  for k, v in state.items() if k in target and v.shape != target[k].shape]
    if mismatched:
        raise ValueError("checkpoint shapes do not match the model:\n  " + "\n  ".join(mismatched)
                         + _config_difference(config, model))
    if strict:
        missing = sorted(set(target) - set(state))
        unexpected = sorted(set(state) - set(target))
        if missing or unexpected:
            raise ValueError(f"checkpoint keys do not match the model: missing {missing[:10]}"
                             f"{' ...' if len(missing) > 10 else ''} ({len(missing)}), unexpected "
                             f"{unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} ({len(unexpected)})"
                             + _config_difference(config, model))
    return model.load_state_dict(state, strict=strict)


def save_pretrained(model: nn.Module, directory: str) -> tuple[str, str]:
    """Write ``model.safetensors`` (keys without ``module.``) and, for a model with a dataclass ``cfg``,
    ``config.yaml`` into ``directory``. Returns both paths (the second None without a config)."""
    import yaml
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    unwrapped = getattr(model, "module", model)
    weights = os.path.join(directory, "model.safetensors")
    save_file({k: v.detach().contiguous().cpu() for k, v in unwrapped.state_dict().items()}, weights)
    cfg = getattr(unwrapped, "cfg", None)
    if cfg is None or not dataclasses.is_dataclass(cfg):
        return weights, None
    config = os.path.join(directory, "config.yaml")
    with open(config, "w") as fh:
        yaml.safe_dump(_plain(dataclasses.asdict(cfg)), fh, sort_keys=False)
    return weights, config


def _plain(value):
    """YAML-friendly: tuples as lists, recursively."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
