"""The SphereFormer U-Net's configuration (the published ``TRAIN`` values) and its per-level window table."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ...layers.config import LayerConfig, check_positive
from ...layers.sphereformer import SphereFormerConfig, attention_compute_dtype
from ...layers.var_length_attention import check_attention_path


@dataclasses.dataclass(frozen=True)
class LevelSpec:
    """What one U-Net level's SphereFormer block is built with (spec §7's per-level table)."""
    level: int
    channels: int
    num_heads: int
    window_size: np.ndarray
    quant_size: np.ndarray
    window_size_sphere: np.ndarray
    quant_size_sphere: np.ndarray
    drop_path: float


@dataclasses.dataclass(frozen=True)
class SphereFormerUNetConfig(LayerConfig):
    """SphereFormer's ``Semantic`` network. Defaults are SemanticKITTI's; names map to the published YAML as
    in_channels=input_c, channels=layers, num_classes=classes, the rest keep their names."""
    in_channels: int = 4
    num_classes: int = 19
    channels: tuple = (32, 64, 128, 256, 256)
    block_reps: int = 2
    block_residual: bool = True
    head_dim: int = 16
    voxel_size: tuple = (0.05, 0.05, 0.05)
    window_size: int = 6                      # cubic window of level 1, in voxels (patch_size 1)
    quant_size_scale: int = 24
    window_size_sphere: tuple = (2, 2, 80)    # degrees, degrees, metres
    window_size_scale: tuple = (2.0, 1.5)     # per level: cubic window and angular window growth
    sphere_layers: tuple = (1, 2, 3, 4, 5)
    grad_checkpoint_layers: tuple = ()
    drop_path_rate: float = 0.3
    a: float = 0.0125                         # exponential_split's radial bin unit
    pc_range: tuple | None = ((-51.2, -51.2, -4.0), (51.2, 51.2, 2.4))  # points are clipped to it
    attention: str = "fused"                  # "fused" kernel or the published "step" ops
    attention_dtype: str = "float32"          # SphereFormer's AMP rule; "bfloat16"/"float16": fused fast path
    transformer_lr_scale: float = 0.1         # lr factor of parameters named *transformer_block*
    ignore_label: int = 255

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        check_positive(name, in_channels=self.in_channels, num_classes=self.num_classes,
                       block_reps=self.block_reps, head_dim=self.head_dim, window_size=self.window_size,
                       quant_size_scale=self.quant_size_scale, transformer_lr_scale=self.transformer_lr_scale)
        if len(self.channels) < 1 or any(not isinstance(c, int) or c % self.head_dim for c in self.channels):
            raise ValueError(f"{name}.channels must be a non-empty list of multiples of head_dim {self.head_dim}, "
                             f"got {self.channels}")
        for field, n in (("voxel_size", 3), ("window_size_sphere", 3), ("window_size_scale", 2)):
            if len(getattr(self, field)) != n:
                raise ValueError(f"{name}.{field} must have {n} values, got {getattr(self, field)}")
        levels = set(range(1, len(self.channels) + 1))
        for field in ("sphere_layers", "grad_checkpoint_layers"):
            if not set(getattr(self, field)) <= levels:
                raise ValueError(f"{name}.{field} must name levels in 1..{len(self.channels)}, "
                                 f"got {getattr(self, field)}")
        if not 0.0 <= self.drop_path_rate < 1.0:
            raise ValueError(f"{name}.drop_path_rate must be in [0, 1), got {self.drop_path_rate}")
        if self.pc_range is not None and (len(self.pc_range) != 2 or any(len(r) != 3 for r in self.pc_range)):
            raise ValueError(f"{name}.pc_range must be [[xmin, ymin, zmin], [xmax, ymax, zmax]] or null")
        check_attention_path(self.attention)
        attention_compute_dtype(self.attention_dtype)

    @classmethod
    def from_yaml(cls, path: str, section: str | None = None):
        """Our YAML (a path, or a shipped config's name: ``sphereformer_semantickitti``, ``_nuscenes``,
        ``_waymo``), or SphereFormer's published one (DATA / TRAIN sections), converted by
        :func:`~sptr.models.sphereformer.published_config.from_sphereformer_yaml`."""
        from ...config_files import config_path

        if section is None:
            path = config_path(path)
            import yaml

            with open(path) as f:
                data = yaml.safe_load(f)
            if isinstance(data, dict) and "TRAIN" in data:
                from .published_config import from_sphereformer_yaml

                return from_sphereformer_yaml(path).config
        return super().from_yaml(path, section)

    @classmethod
    def from_dict(cls, values):
        values = dict(values)
        if values.get("pc_range") is not None:
            values["pc_range"] = tuple(tuple(r) for r in values["pc_range"])
        return super().from_dict(values)

    def levels(self) -> list[LevelSpec]:
        """Window and quantisation sizes per level, computed as SphereFormer's train.py and UBlock do (float32
        cubic sizes from the voxel size; the spherical ones from the integer YAML values)."""
        dpr = torch.linspace(0, self.drop_path_rate, 7).tolist()  # SphereFormer's: 7 rates, level k takes k-1
        window = np.array(self.voxel_size, dtype=np.float32) * self.window_size
        quant = window / self.quant_size_scale
        window_sphere = np.array(self.window_size_sphere)
        quant_sphere = window_sphere / self.quant_size_scale
        cubic_scale, sphere_scale = self.window_size_scale
        specs = []
        for i, c in enumerate(self.channels):
            specs.append(LevelSpec(i + 1, c, c // self.head_dim, window, quant, window_sphere, quant_sphere,
                                   dpr[i] if i < len(dpr) else dpr[-1]))
            window, quant = window * cubic_scale, quant * cubic_scale
            angular = np.array([sphere_scale, sphere_scale, 1.0])
            window_sphere, quant_sphere = window_sphere * angular, quant_sphere * angular
        return specs

    def block_config(self, spec: LevelSpec) -> SphereFormerConfig:
        return SphereFormerConfig(
            dim=spec.channels, num_heads=spec.num_heads, window_size=tuple(spec.window_size.tolist()),
            window_size_sphere=tuple(spec.window_size_sphere.tolist()), quant_size=tuple(spec.quant_size.tolist()),
            quant_size_sphere=tuple(spec.quant_size_sphere.tolist()), indice_key=f"sphereformer{spec.level}",
            drop_path=spec.drop_path, a=self.a, attention=self.attention, attention_dtype=self.attention_dtype)
