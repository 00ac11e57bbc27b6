"""SphereFormer's segmentation network (its ``Semantic`` model): a spconv U-Net with one SphereFormer block per level.

Module and parameter names follow the released checkpoints (``input_conv``, ``unet.blocks.block0.conv_branch``,
``unet.transformer_block``, ``unet.conv``, ``unet.u...``, ``unet.deconv``, ``unet.blocks_tail``, ``output_layer``,
``linear``), so their state dicts load strictly (see ``checkpoint.py``).
"""
from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...integrations.spconv_backend import import_spconv
from ...layers.sphereformer import SphereFormer
from ...ops.scatter import scatter_mean
from .checkpoint import load_pretrained
from .config import LevelSpec, SphereFormerUNetConfig

spconv = import_spconv()


def pool_coordinates(xyz, batch, indice_pairs, num_out):
    """Metric coordinates and batch ids of the next level: the mean over the voxels that the stride-2 sparse
    convolution merged into each output voxel (``indice_pairs (2, K, P)``, -1 padded)."""
    pair_in, pair_out = indice_pairs[0], indice_pairs[1]
    valid = pair_in != -1
    pair_in, pair_out = pair_in[valid].long(), pair_out[valid].long()
    xyz_next = scatter_mean(xyz[pair_in], pair_out, num_out)
    batch_next = scatter_mean(batch.float()[pair_in], pair_out, num_out)
    return xyz_next, batch_next.long()


class ResidualBlock(spconv.SparseModule):
    """BN-ReLU-SubMConv3d twice plus an identity (or 1x1 SubMConv3d) branch."""

    def __init__(self, in_channels, out_channels, norm_fn, indice_key=None):
        super().__init__()
        if in_channels == out_channels:
            self.i_branch = spconv.SparseSequential(nn.Identity())
        else:
            self.i_branch = spconv.SparseSequential(
                spconv.SubMConv3d(in_channels, out_channels, kernel_size=1, bias=False))
        self.conv_branch = spconv.SparseSequential(
            norm_fn(in_channels), nn.ReLU(),
            spconv.SubMConv3d(in_channels, out_channels, 3, padding=1, bias=False, indice_key=indice_key),
            norm_fn(out_channels), nn.ReLU(),
            spconv.SubMConv3d(out_channels, out_channels, 3, padding=1, bias=False, indice_key=indice_key))

    def forward(self, x):
        identity = spconv.SparseConvTensor(x.features, x.indices, x.spatial_shape, x.batch_size)
        out = self.conv_branch(x)
        return out.replace_feature(out.features + self.i_branch(identity).features)


class VGGBlock(spconv.SparseModule):
    """BN-ReLU-SubMConv3d (``block_residual: False``)."""

    def __init__(self, in_channels, out_channels, norm_fn, indice_key=None):
        super().__init__()
        self.conv_layers = spconv.SparseSequential(
            norm_fn(in_channels), nn.ReLU(),
            spconv.SubMConv3d(in_channels, out_channels, 3, padding=1, bias=False, indice_key=indice_key))

    def forward(self, x):
        return self.conv_layers(x)


class UBlock(nn.Module):
    """One level: blocks, the level's SphereFormer block, then (below the last level) a stride-2 conv down,
    the next level, the inverse conv up, the skip concat and ``blocks_tail``."""

    def __init__(self, cfg: SphereFormerUNetConfig, levels: list[LevelSpec], norm_fn, block):
        super().__init__()
        spec = levels[0]
        self.level = spec.level
        self.checkpointed = spec.level in cfg.grad_checkpoint_layers
        c = spec.channels
        key = f"subm{spec.level}"
        self.blocks = spconv.SparseSequential(OrderedDict(
            (f"block{i}", block(c, c, norm_fn, indice_key=key)) for i in range(cfg.block_reps)))
        if spec.level in cfg.sphere_layers:
            self.transformer_block = SphereFormer(cfg.block_config(spec))
        else:
            self.transformer_block = None
        self.has_next = len(levels) > 1
        if self.has_next:
            c_next = levels[1].channels
            down_key = f"spconv{spec.level}"
            self.conv = spconv.SparseSequential(
                norm_fn(c), nn.ReLU(),
                spconv.SparseConv3d(c, c_next, kernel_size=2, stride=2, bias=False, indice_key=down_key,
                                    algo=spconv.ConvAlgo.Native))  # Native: its indice_pairs pool coordinates
            self.u = UBlock(cfg, levels[1:], norm_fn, block)
            self.deconv = spconv.SparseSequential(
                norm_fn(c_next), nn.ReLU(),
                spconv.SparseInverseConv3d(c_next, c, kernel_size=2, bias=False, indice_key=down_key,
                                           algo=spconv.ConvAlgo.Native))
            self.blocks_tail = spconv.SparseSequential(OrderedDict(
                (f"block{i}", block(c * (2 - i), c, norm_fn, indice_key=key)) for i in range(cfg.block_reps)))

    def forward(self, x, xyz, batch):
        out = self.blocks(x)
        if self.transformer_block is not None:
            if self.checkpointed and torch.is_grad_enabled():
                feats = checkpoint(self.transformer_block, out.features, xyz, batch, use_reentrant=False)
            else:
                feats = self.transformer_block(out.features, xyz, batch)
            out = out.replace_feature(feats)
        if not self.has_next:
            return out
        skip = out.features
        down = self.conv(out)
        pairs = down.indice_dict[f"spconv{self.level}"].indice_pairs
        xyz_next, batch_next = pool_coordinates(xyz, batch, pairs, down.features.shape[0])
        up = self.deconv(self.u(down, xyz_next, batch_next))
        return self.blocks_tail(out.replace_feature(torch.cat((skip, up.features), dim=1)))


class SphereFormerUNet(nn.Module):
    """``forward(x: spconv.SparseConvTensor, xyz (N, 3) metric voxel coordinates, batch (N,)) -> (N, classes)``.

    ``x.indices`` are ``(batch, i, j, k)`` int32 voxel coordinates in the order of ``xyz``; build the input
    with :func:`sparse_input`. BatchNorm layers have SphereFormer's eps 1e-4, momentum 0.1, weight 1, bias 0.
    """

    def __init__(self, cfg: SphereFormerUNetConfig):
        super().__init__()
        self.cfg = cfg
        norm_fn = functools.partial(nn.BatchNorm1d, eps=1e-4, momentum=0.1)
        block = ResidualBlock if cfg.block_residual else VGGBlock
        m = cfg.channels[0]
        self.input_conv = spconv.SparseSequential(
            spconv.SubMConv3d(cfg.in_channels, m, kernel_size=3, padding=1, bias=False, indice_key="subm1"))
        self.unet = UBlock(cfg, cfg.levels(), norm_fn, block)
        self.output_layer = spconv.SparseSequential(norm_fn(m), nn.ReLU())
        self.linear = nn.Linear(m, cfg.num_classes)
        for module in self.modules():
            if isinstance(module, nn.BatchNorm1d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    @classmethod
    def from_yaml(cls, config_path: str, checkpoint: str | None = None, **overrides) -> "SphereFormerUNet":
        """The network of a config YAML (fields in ``overrides`` replaced), with ``checkpoint``'s weights
        loaded strictly by :func:`load_pretrained` if given."""
        model = cls(dataclasses.replace(SphereFormerUNetConfig.from_yaml(config_path), **overrides))
        if checkpoint:
            load_pretrained(model, checkpoint)
        return model

    def forward(self, x, xyz, batch):
        out = self.unet(self.input_conv(x), xyz, batch)
        return self.linear(self.output_layer(out).features)

    def param_groups(self, lr: float, weight_decay: float = 0.0) -> list[dict]:
        """AdamW groups as SphereFormer trains: parameters named ``*transformer_block*`` at
        ``lr * transformer_lr_scale``."""
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        return [
            {"params": [p for n, p in named if "transformer_block" not in n], "lr": lr, "weight_decay": weight_decay},
            {"params": [p for n, p in named if "transformer_block" in n], "lr": lr * self.cfg.transformer_lr_scale,
             "weight_decay": weight_decay},
        ]


def sparse_input(feats: torch.Tensor, coords: torch.Tensor, batch: torch.Tensor, batch_size: int | None = None):
    """The network's input tensor as SphereFormer's train.py builds it: indices ``(batch, coords)`` int32 and a
    spatial shape of ``max(coords) + 1``, at least 128 per axis."""
    if coords.dim() != 2 or coords.shape[1] != 3:
        raise ValueError(f"coords must be (N, 3) voxel coordinates, got {tuple(coords.shape)}")
    if feats.shape[0] != coords.shape[0] or batch.shape != (coords.shape[0],):
        raise ValueError(f"feats {tuple(feats.shape)}, coords {tuple(coords.shape)} and batch "
                         f"{tuple(batch.shape)} must have one row per voxel")
    indices = torch.cat([batch[:, None], coords], 1).int()
    low, high = (torch.stack(coords.aminmax(dim=0)).cpu().numpy() if coords.shape[0]
                 else np.zeros((2, 3), np.int64))  # one device-to-host copy for both
    if low.min() < 0:
        raise ValueError("coords must be non-negative voxel coordinates")
    spatial_shape = np.clip(high + 1, 128, None).tolist()
    if batch_size is None:
        batch_size = int(batch.max()) + 1 if batch.numel() else 1
    return spconv.SparseConvTensor(feats, indices, spatial_shape, batch_size)
