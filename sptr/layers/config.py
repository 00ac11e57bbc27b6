"""Base of the layer configs: frozen dataclasses built from dicts / YAML that reject unknown keys."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


class LayerConfig:
    """Mixin for frozen dataclass configs; subclasses validate in ``__post_init__``."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
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
        import yaml

        with open(path) as fh:
            data = yaml.safe_load(fh)
        return cls.from_dict(data[section] if section else data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_positive(cls_name: str, **values) -> None:
    for name, v in values.items():
        if not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{cls_name}.{name} must be positive, got {v!r}")
