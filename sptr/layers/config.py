"""Base of the layer configs: frozen dataclasses built from dicts / YAML that reject unknown keys and values of
the wrong type, naming the key."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping

import numpy as np

from ..ops._checks import is_finite_number, is_int


def _type_ok(hint, value) -> bool:
    """``value`` fits the field annotation ``hint`` (int, float, bool, str, tuple, or one of them | None)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_type_ok(h, value) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, (bool, np.bool_))
    if hint is int:
        return is_int(value)
    if hint is float:
        return is_finite_number(value)
    if hint is str:
        return isinstance(value, str)
    if hint is tuple:
        return isinstance(value, (tuple, list))
    return True


def _type_name(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    names = {bool: "a bool", int: "an int", float: "a finite number", str: "a str", tuple: "a list",
             type(None): "None"}
    return names.get(hint, str(hint))


class LayerConfig:
    """Mixin for frozen dataclass configs. ``__post_init__`` checks every field against its annotation;
    subclasses call it first, then validate values."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _type_ok(hints[f.name], value):
                raise TypeError(f"{type(self).__name__}.{f.name} must be {_type_name(hints[f.name])}, "
                                f"got {value!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        if not isinstance(values, Mapping):
            raise ValueError(f"{cls.__name__}: expected a mapping of keys to values, got {type(values).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {unknown}; expected a subset of {sorted(names)}")
        converted = {}
        for f in dataclasses.fields(cls):
            if f.name in values:
                v = values[f.name]
                converted[f.name] = tuple(v) if isinstance(v, list) else v
        return cls(**converted)

    @classmethod
    def from_yaml(cls, path: str, section: str | None = None):
        """A YAML file's keys (or its ``section``'s); ``path`` may name a shipped config (configs/<name>.yaml)."""
        import yaml

        from ..config_files import config_path

        with open(config_path(path)) as fh:
            data = yaml.safe_load(fh)
        if section is not None:
            if not isinstance(data, Mapping) or section not in data:
                raise ValueError(f"{cls.__name__}.from_yaml: {path!r} has no section {section!r}")
            data = data[section]
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}.from_yaml: {path!r} holds no mapping of config keys "
                             f"(got {type(data).__name__}{', an empty file' if data is None else ''})")
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_positive(cls_name: str, **values) -> None:
    for name, v in values.items():
        if not (is_finite_number(v) and v > 0):
            raise ValueError(f"{cls_name}.{name} must be positive, got {v!r}")


def check_sizes(cls_name: str, count: int = 3, **values) -> None:
    """Each value a list of ``count`` finite numbers > 0 (window and quantisation sizes)."""
    for name, v in values.items():
        ok = isinstance(v, (tuple, list, np.ndarray)) and len(v) == count and all(
            is_finite_number(x) and x > 0 for x in v)
        if not ok:
            raise ValueError(f"{cls_name}.{name} must be {count} finite numbers > 0, got {v!r}")


def check_fraction(cls_name: str, **values) -> None:
    """Each value in [0, 1) (dropout and drop-path rates)."""
    for name, v in values.items():
        if not 0.0 <= v < 1.0:
            raise ValueError(f"{cls_name}.{name} must be in [0, 1), got {v!r}")
