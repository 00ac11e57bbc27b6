"""Input checks shared by the op wrappers: every error names the argument and what was expected."""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX = (torch.int32, torch.int64)
INTEGER = (torch.int8, torch.int16, torch.int32, torch.int64)


_DATA_CHECKS = True


def data_checks_enabled() -> bool:
    """Data-dependent checks (index ranges, offsets) need a host sync; they are skipped while tracing and
    inside :func:`data_checks` ``(False)``."""
    return _DATA_CHECKS and not torch.compiler.is_compiling()


@contextlib.contextmanager
def data_checks(enabled: bool):
    """Turn the value checks of index arrays on or off (e.g. off in a training loop whose indices come from
    ``get_indices_params``). Without them bad indices still never read out of bounds: the kernels skip
    out-of-range pairs, so the result for such input is unspecified but memory-safe."""
    global _DATA_CHECKS
    previous, _DATA_CHECKS = _DATA_CHECKS, bool(enabled)
    try:
        yield
    finally:
        _DATA_CHECKS = previous


def check_tensor(name: str, t, *, dim: int | None = None, dtypes=None, device: torch.device | None = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-D tensor, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs must be on one device)")
    return t


def check_shape(name: str, t: Tensor, shape: tuple) -> None:
    """`shape` may hold None for a free dimension."""
    if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


# Tensors whose values passed a check, by identity and version counter, so that a layer stack handing one
# offsets or index tensor to every block pays the host sync once. An in-place write bumps the version (views
# share it with their base, which is what is remembered for a view, with the view's geometry).
_PASSED: dict = {}


def _cache_key(t: Tensor, check: tuple):
    owner = t if t._base is None else t._base
    return owner, (id(owner), check, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _passed_before(t: Tensor, check: tuple) -> bool:
    owner, key = _cache_key(t, check)
    entry = _PASSED.get(key)
    return entry is not None and entry[0]() is owner and entry[1] == t._version


def _remember(t: Tensor, check: tuple) -> None:
    if len(_PASSED) >= 256:
        for key in [key for key, (ref, _) in _PASSED.items() if ref() is None]:
            del _PASSED[key]
        if len(_PASSED) >= 256:
            _PASSED.clear()
    owner, key = _cache_key(t, check)
    _PASSED[key] = (weakref.ref(owner), t._version)


def check_range(name: str, t: Tensor, low: int, high: int) -> None:
    """Every value in [low, high). One host sync the first time a tensor is seen; skipped under torch.compile."""
    check = ("range", low, high)
    if t.numel() == 0 or not data_checks_enabled() or _passed_before(t, check):
        return
    lo, hi = torch.stack(torch.aminmax(t)).tolist()
    if lo < low or hi >= high:
        raise ValueError(f"{name} must have values in [{low}, {high}), got values in [{lo}, {hi}]")
    _remember(t, check)


def check_offsets(name: str, offsets: Tensor, total: int) -> None:
    """CSR offsets: first 0, last `total`, non-decreasing. One host sync the first time a tensor is seen."""
    if offsets.numel() == 0:
        raise ValueError(f"{name} must have at least one entry (N + 1 offsets)")
    check = ("offsets", total)
    if not data_checks_enabled() or _passed_before(offsets, check):
        return
    decreasing = (offsets[1:] < offsets[:-1]).any().to(offsets.dtype)
    first, last, decreasing = torch.stack((offsets[0], offsets[-1], decreasing)).tolist()
    if first != 0 or last != total:
        raise ValueError(f"{name} must start at 0 and end at {total}, got {first} ... {last}")
    if decreasing:
        raise ValueError(f"{name} must be non-decreasing")
    _remember(offsets, check)


def autocast_dtype(device: torch.device):
    """The autocast dtype when autocast is on for the device's type (cuda / cpu), else None."""
    kind = device.type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def common_float_dtype(**tensors: Tensor) -> torch.dtype:
    """The one floating dtype of an op's inputs. Mixed dtypes are an error, except under autocast, where
    they are promoted to the widest (never downcast: fp32 inputs stay fp32)."""
    named = {k: v for k, v in tensors.items() if v is not None}
    for k, v in named.items():
        check_tensor(k, v, dtypes=FLOATING)
    dtypes = {v.dtype for v in named.values()}
    if len(dtypes) == 1:
        return dtypes.pop()
    device = next(iter(named.values())).device.type
    if torch.is_autocast_enabled(device) if device in ("cuda", "cpu") else False:
        out = None
        for v in named.values():
            out = v.dtype if out is None else torch.promote_types(out, v.dtype)
        return out
    first = next(iter(named))
    odd = next(k for k, v in named.items() if v.dtype != named[first].dtype)
    raise TypeError(
        f"{odd} has dtype {named[odd].dtype} but {first} has {named[first].dtype}; "
        "floating inputs of one op must share a dtype (cast them, or run under autocast to promote)"
    )
