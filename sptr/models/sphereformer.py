"""A SphereFormer-style point segmentation network (transformer stages only) and checkpoint loading.

The released SphereFormer wraps these blocks in a spconv U-Net; this model keeps the transformer stages and
their parameter names (``...transformer_block.*``) so that the attention weights of released checkpoints load.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..layers.config import LayerConfig, check_positive
from ..layers.sphereformer import SphereFormer, SphereFormerConfig


@dataclasses.dataclass(frozen=True)
class SphereFormerNetConfig(LayerConfig):
    in_channels: int = 4
    num_classes: int = 19
    dim: int = 32
    num_heads: int = 2
    depth: int = 2
    block: dict = dataclasses.field(default_factory=dict)  # extra SphereFormerConfig fields

    def __post_init__(self):
        check_positive(type(self).__name__, in_channels=self.in_channels, num_classes=self.num_classes,
                       dim=self.dim, depth=self.depth)
        SphereFormerConfig.from_dict({"dim": self.dim, "num_heads": self.num_heads, **self.block})  # validates


class SphereFormerNet(nn.Module):
    """``forward(feats (N, in), xyz (N, 3), batch (N,)) -> logits (N, num_classes)``."""

    def __init__(self, cfg: SphereFormerNetConfig):
        super().__init__()
        self.cfg = cfg
        self.input = nn.Linear(cfg.in_channels, cfg.dim)
        self.blocks = nn.ModuleList()
        for i in range(cfg.depth):
            block = nn.Module()
            block.transformer_block = SphereFormer(SphereFormerConfig.from_dict(
                {"dim": cfg.dim, "num_heads": cfg.num_heads, "indice_key": f"sphereformer{i}", **cfg.block}))
            self.blocks.append(block)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, feats, xyz, batch):
        x = self.input(feats)
        for block in self.blocks:
            x = block.transformer_block(x, xyz, batch)
        return self.head(x)


def match_module_prefix(state_dict: dict, model: nn.Module) -> dict:
    """Add or strip DDP/DataParallel's ``module.`` prefix so the keys match ``model``."""
    want_prefix = next(iter(model.state_dict())).startswith("module.")
    has_prefix = next(iter(state_dict), "").startswith("module.")
    if has_prefix == want_prefix:
        return dict(state_dict)
    if has_prefix:
        return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}
    return {f"module.{k}": v for k, v in state_dict.items()}


def load_checkpoint(model: nn.Module, path: str, strict: bool = True):
    """Load a ``.safetensors`` file or a torch checkpoint (``{'state_dict': ...}`` as SphereFormer saves it)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
    return model.load_state_dict(match_module_prefix(state, model), strict=strict)
