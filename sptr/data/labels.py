"""Dataset label maps: raw label ids to the network's classes and back (SemanticKITTI's semantic-kitti.yaml)."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch
import yaml

from ..config_files import config_dir

LABEL_MAPS = os.path.join(config_dir(), "labels")


def label_map_file(dataset: str) -> str:
    """The path of a label map shipped in configs/labels (``semantickitti``, ``nuscenes``)."""
    path = os.path.join(LABEL_MAPS, f"{dataset}.yaml")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(LABEL_MAPS) if f.endswith(".yaml"))
        raise ValueError(f"no label map {dataset!r}; known: {known}")
    return path


def label_map_data(dataset: str) -> dict:
    """A shipped label map file's entries (its split and class weights too, for those who read them)."""
    with open(label_map_file(dataset)) as f:
        return yaml.safe_load(f) or {}


@dataclasses.dataclass(frozen=True)
class LabelMap:
    """``learning_map`` (raw id -> training id, 0 ignored) and ``learning_map_inv`` (training id -> raw id). The
    network's class c is training id c + 1 (SphereFormer's and Pointcept's convention)."""

    names: tuple
    learning_map: dict
    learning_map_inv: dict

    @classmethod
    def from_yaml(cls, path: str) -> "LabelMap":
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        missing = [k for k in ("names", "learning_map", "learning_map_inv") if k not in data]
        if missing:
            raise ValueError(f"label map {path!r} lacks {missing}")
        table = cls(tuple(data["names"]), {int(k): int(v) for k, v in data["learning_map"].items()},
                    {int(k): int(v) for k, v in data["learning_map_inv"].items()})
        wanted = set(range(1, len(table.names) + 1))
        if not wanted <= set(table.learning_map_inv):
            raise ValueError(f"label map {path!r}: learning_map_inv must map training ids 1..{len(table.names)}")
        return table

    @classmethod
    def named(cls, dataset: str) -> "LabelMap":
        """The map shipped in configs/labels (``semantickitti``)."""
        return cls.from_yaml(label_map_file(dataset))

    @property
    def num_classes(self) -> int:
        return len(self.names)

    def to_classes(self, raw: torch.Tensor, ignore_label: int = 255) -> torch.Tensor:
        """Network classes (int64, ``ignore_label`` where the training id is 0) of raw ids (the lower 16 bits of
        a SemanticKITTI ``.label``: the upper hold the instance id). Ids outside the map raise."""
        semantic = raw.long() & 0xFFFF
        lut = torch.full((max(self.learning_map) + 1,), -1, dtype=torch.long)
        for k, v in self.learning_map.items():
            lut[k] = v
        if semantic.numel() and (int(semantic.max()) >= lut.numel() or bool((lut[semantic.clamp(max=lut.numel() - 1)]
                                                                            < 0).any())):
            unknown = sorted(set(semantic.unique().tolist()) - set(self.learning_map))
            raise ValueError(f"labels hold ids that the label map does not list: {unknown[:10]}")
        train = lut.to(semantic.device)[semantic]
        return torch.where(train > 0, train - 1, torch.full_like(train, ignore_label))

    def to_raw(self, classes: torch.Tensor) -> np.ndarray:
        """Raw label ids (uint32, as a prediction file holds them) of network classes 0..C-1."""
        classes = classes.detach().cpu().long()
        if classes.numel() and (int(classes.min()) < 0 or int(classes.max()) >= self.num_classes):
            raise ValueError(f"classes must lie in [0, {self.num_classes}), got [{int(classes.min())}, "
                             f"{int(classes.max())}]")
        lut = np.array([self.learning_map_inv[c + 1] for c in range(self.num_classes)], dtype=np.uint32)
        return lut[classes.numpy()]
