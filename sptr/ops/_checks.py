"""Input checks shared by the op wrappers: every error names the argument and what was expected."""
from __future__ import annotations

import contextlib
import math
import numbers
import threading

import numpy as np
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX = (torch.int32, torch.int64)
INTEGER = (torch.int8, torch.int16, torch.int32, torch.int64)


# Thread-local, like torch.no_grad: a data_checks(False) block in one thread leaves the others checked.
_STATE = threading.local()


def data_checks_enabled() -> bool:
    """Data-dependent checks (index ranges, offsets) need a host sync; they are skipped while tracing, while
    the current CUDA stream is captured into a graph (a sync would break the capture), and inside
    :func:`data_checks` ``(False)`` (in the calling thread only)."""
    return (getattr(_STATE, "enabled", True) and not torch.compiler.is_compiling()
            and not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()))


@contextlib.contextmanager
def data_checks(enabled: bool):
    """Turn the value checks of index arrays on or off in this thread (e.g. off in a training loop whose
    indices come from ``get_indices_params``). Without them bad indices still never read out of bounds: the
    kernels skip out-of-range pairs, so the result for such input is unspecified but memory-safe."""
    previous = getattr(_STATE, "enabled", True)
    _STATE.enabled = bool(enabled)
    try:
        yield
    finally:
        _STATE.enabled = previous


# The `type(v) is ...` tests first: the ABC isinstance checks cost ~0.3 µs each on every op call.
def is_int(v) -> bool:
    """A Python or numpy integer, not a bool."""
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)))


def is_finite_number(v) -> bool:
    """A finite Python or numpy real number, not a bool."""
    return ((type(v) is float or type(v) is int or (isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))))
            and math.isfinite(v))


def check_int(name: str, v, minimum: int | None = None, maximum: int | None = None) -> int:
    """A Python or numpy integer (not a bool, not a float) in [minimum, maximum], as a Python int."""
    if not is_int(v):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        low = "-inf" if minimum is None else minimum
        bound = f"in [{low}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be an int {bound}, got {v!r}")
    return int(v)


def dtype_name(dtype: torch.dtype) -> str:
    """``float16`` for ``torch.float16``: the name an error message shows."""
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, t, *, dim: int | None = None, dtypes=None, device: torch.device | None = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-D tensor, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {dtype_name(t.dtype)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs must be on one device)")
    return t


def check_shape(name: str, t: Tensor, shape: tuple) -> None:
    """`shape` may hold None for a free dimension."""
    actual = t.shape
    if len(actual) == len(shape):
        for s, a in zip(shape, actual):  # a loop, not any(<generator>): this runs several times per op call
            if s is not None and s != a:
                break
        else:
            return
    want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
    raise ValueError(f"{name} must have shape {want}, got {tuple(actual)}")


def _has_values(t: Tensor) -> bool:
    """Meta and fake tensors have shapes but no values to check."""
    return not (t.is_meta or is_fake(t))


class ValueChecks:
    """The value checks of one call, run together with one host sync. Nothing is remembered between calls: a
    cache keyed on a tensor's version counter is fooled by writes through ``.data`` or ``.numpy()``."""

    def __init__(self):
        self._checks = []  # (name, tensor, kind, bounds)

    def range(self, name: str, t: Tensor, low: int, high: int) -> "ValueChecks":
        """Every value in [low, high)."""
        if t.numel() and data_checks_enabled() and _has_values(t):
            self._checks.append((name, t, "range", (low, high)))
        return self

    def offsets(self, name: str, offsets: Tensor, total: int) -> "ValueChecks":
        """CSR offsets: first 0, last `total`, non-decreasing."""
        if offsets.numel() == 0:
            raise ValueError(f"{name} must have at least one entry (N + 1 offsets)")
        if data_checks_enabled() and _has_values(offsets):
            self._checks.append((name, offsets, "offsets", (total,)))
        return self

    def finite(self, name: str, t: Tensor) -> "ValueChecks":
        """No NaN or infinity."""
        if t.numel() and data_checks_enabled() and _has_values(t):
            self._checks.append((name, t, "finite", ()))
        return self

    def require(self, message: str, condition: Tensor) -> "ValueChecks":
        """A 0-d boolean tensor that must be True; `message` says what was expected, naming the argument."""
        if data_checks_enabled() and _has_values(condition):
            self._checks.append((message, condition, "require", ()))
        return self

    @staticmethod
    def _statistics(t: Tensor, kind: str) -> Tensor:
        if kind == "require":
            return t.all().long().reshape(1)
        if kind == "finite":
            return torch.isfinite(t).all().long().reshape(1)
        t = t.reshape(-1).long()
        if kind == "range":
            return torch.stack(torch.aminmax(t))
        return torch.stack((t[0], t[-1], (t[1:] < t[:-1]).any().long()))

    def run(self) -> None:
        if not self._checks:
            return
        by_device: dict = {}
        for i, (_, t, kind, _) in enumerate(self._checks):
            by_device.setdefault(t.device, []).append((i, self._statistics(t, kind)))
        values = {}
        for items in by_device.values():
            flat = torch.cat([stats for _, stats in items]).tolist()  # the one host sync per device
            start = 0
            for i, stats in items:
                values[i] = flat[start:start + stats.numel()]
                start += stats.numel()
        for i, (name, _, kind, bounds) in enumerate(self._checks):
            v = values[i]
            if kind == "require":
                if not v[0]:
                    raise ValueError(name)
            elif kind == "finite":
                if not v[0]:
                    raise ValueError(f"{name} must be finite, got NaN or infinite values")
            elif kind == "range":
                low, high = bounds
                if v[0] < low or v[1] >= high:
                    raise ValueError(f"{name} must have values in [{low}, {high}), got values in [{v[0]}, {v[1]}]")
            elif v[0] != 0 or v[1] != bounds[0]:
                raise ValueError(f"{name} must start at 0 and end at {bounds[0]}, got {v[0]} ... {v[1]}")
            elif v[2]:
                raise ValueError(f"{name} must be non-decreasing")
        self._checks.clear()


def check_range(name: str, t: Tensor, low: int, high: int) -> None:
    """Every value in [low, high): one host sync; skipped under torch.compile and data_checks(False)."""
    ValueChecks().range(name, t, low, high).run()


def check_offsets(name: str, offsets: Tensor, total: int) -> None:
    """CSR offsets: first 0, last `total`, non-decreasing: one host sync (see :func:`check_range`)."""
    ValueChecks().offsets(name, offsets, total).run()


def _element_span(t: Tensor) -> tuple[int, int]:
    """First and last storage element (inclusive) that t reads."""
    low = high = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        if size > 1:
            if stride >= 0:
                high += (size - 1) * stride
            else:
                low += (size - 1) * stride
    return low, high


def _offset_reachable(delta: int, sizes, strides):
    """Whether delta = Σ i_d·stride_d for some |i_d| < size_d: the offset between two views of the same sizes
    and strides at which an element of one is an element of the other. Exact when each stride exceeds the span
    of the smaller ones (views of a contiguous buffer), as then only two digits are possible per dimension;
    None when the strides do not nest so."""
    dims = sorted(((abs(st), n) for n, st in zip(sizes, strides) if n > 1 and st != 0), reverse=True)
    spans = [sum((n - 1) * st for st, n in dims[d + 1:]) for d in range(len(dims))]
    if any(st <= span for (st, _), span in zip(dims, spans)):
        return None

    def reach(rest: int, d: int) -> bool:
        if d == len(dims):
            return rest == 0
        stride, n = dims[d]
        for digit in {rest // stride, -(-rest // stride)}:
            r = rest - digit * stride
            if abs(digit) < n and abs(r) <= spans[d] and reach(r, d + 1):
                return True
        return False

    return reach(delta, 0)


def check_no_overlap(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    """Two tensors that an op writes must not share memory. Exact for views of one buffer with the same
    sizes and nesting strides (q and k of a fused qkv tensor are disjoint and pass); other views whose
    storage ranges intersect are refused, as PyTorch's own ops refuse what they cannot prove disjoint."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or is_fake(a) or a.is_meta:
        return
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.element_size() != b.element_size():
        return
    (lo_a, hi_a), (lo_b, hi_b) = _element_span(a), _element_span(b)
    if hi_a < lo_b or hi_b < lo_a:
        return
    if a.shape == b.shape and a.stride() == b.stride():
        reachable = _offset_reachable(b.storage_offset() - a.storage_offset(), a.shape, a.stride())
        if reachable is False:
            return
    raise ValueError(f"{name_a} and {name_b} share memory; the op writes into one while it reads or writes the "
                     "other, so they must not overlap")


def autocast_dtype(device: torch.device):
    """The autocast dtype when autocast is on for the device's type (cuda / cpu), else None."""
    kind = device.type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def cast(t, dtype: torch.dtype):
    """``t`` in ``dtype`` (None stays None). Tensor.to costs ~1 µs of host time even when it returns its input,
    so it is called only for a real cast."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


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
