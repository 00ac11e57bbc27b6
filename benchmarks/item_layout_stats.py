"""How well the fused window attention's work items fit a scene's windows (CPU, no kernels run).

The fp16/bf16 table kernels give each CTA an item of 64 rows (4 warps x 16 rows) and walk the item's key (or
query) range in CTA-wide blocks of 32; a warp whose rows share no window with a block skips its pair work and
waits at the block's closing barrier, the largest stall of those kernels (benchmarks/RESULTS.md, "Twelfth
session"). For the benchmark's synthetic 270k-voxel scan this prints, per window size and item layout, the
share of warp-block slots that have work and the share of the 16x16 pair tiles' slots that are real pairs:

    python benchmarks/item_layout_stats.py [--voxels 270000] [--window 12 6]
    python benchmarks/item_layout_stats.py --sphereformer-level 1   # a SphereFormer block's two branches

With --sphereformer-level L the windows are those of the SemanticKITTI U-Net's level-L block (its voxel size, the
cubic windows and the spherical ones of cart2sphere(xyz)), and for the spherical branch it also prints how many
of the radial-bin table's rows each query row's keys span (exponential_split's bins of the radius difference).

Layouts: "64-row items" (today's), "window-cut items" (items never cross a window; large windows split in 64s),
"packed window-cut" (items of whole windows while they fit in 64 rows, a sequential greedy pass) and "per-warp
blocks" (each warp walks only its own rows' key range, in blocks of 32 from its start: no idle slots, at the
price of building key-side table terms per warp).
"""
import argparse

import numpy as np
import torch

from sptr.data import lidar_voxels
from sptr.layers.sphereformer import cart2sphere, exponential_split
from sptr.ops import window_partition

VOXEL = 0.05  # the fused-attention benchmark's voxel size (bench_fused_attention.py)
ROWS, WARP_ROWS, BLOCK = 64, 16, 32


def tiles_in(c0, n, lo, hi):
    """16-key groups of the block [c0, c0 + n) that overlap the range [lo, hi)."""
    return sum(1 for s in range(c0, c0 + n, 16) if s < hi and s + 16 > lo)


def walk(items, bounds):
    """(warp-block slots, busy slots, 16x16 tiles) of CTA-wide blocks over each item's key range."""
    slots = busy = tiles = 0
    for r0, n in items:
        lo, hi = bounds[r0][0], bounds[r0 + n - 1][1]
        warps = [(bounds[a][0], bounds[min(a + WARP_ROWS, r0 + n) - 1][1]) for a in range(r0, r0 + n, WARP_ROWS)]
        for c0 in range(lo, hi, BLOCK):
            slots += ROWS // WARP_ROWS
            for wl, wh in warps:
                if c0 < wh and c0 + BLOCK > wl:
                    busy += 1
                    tiles += tiles_in(c0, BLOCK, wl, wh)
    return slots, busy, tiles


def packed_items(starts, counts):
    """Items of whole windows while they fit in 64 rows (greedy, in order); a larger window is cut in 64s, and its
    last piece starts a new item that the following whole windows may join."""
    items, r0, n = [], 0, 0
    for s, c in zip(starts, counts):
        if n + c > ROWS and n:
            items.append((r0, n))
            r0, n = s, 0
        while n + c > ROWS:
            items.append((r0, ROWS))
            r0, c = r0 + ROWS, c - ROWS
        n += c
    if n:
        items.append((r0, n))
    return items


def per_warp(n_rows, bounds):
    """The same for warps that each walk their own rows' key range."""
    slots = tiles = 0
    for a in range(0, n_rows, WARP_ROWS):
        wl, wh = bounds[a][0], bounds[min(a + WARP_ROWS, n_rows) - 1][1]
        for c0 in range(wl, wh, BLOCK):
            slots += 1
            tiles += tiles_in(c0, BLOCK, wl, wh)
    return slots, slots, tiles


def radial_bin_spans(radius, offsets, a):
    """Per query row (sorted order): max - min + 1 of its pairs' radial bins (exponential_split) in its window."""
    spans = []
    pos = torch.zeros(radius.shape[0], 3)  # exponential_split reads column 2 only
    pos[:, 2] = radius
    for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        i0, i1 = (x.reshape(-1) for x in torch.meshgrid(torch.arange(s, e), torch.arange(s, e), indexing="ij"))
        bins = exponential_split(pos, i0, i1, torch.zeros(i0.numel(), 3), a=a)[:, 2].reshape(e - s, e - s)
        spans.append(bins.max(1).values - bins.min(1).values + 1)
    return torch.cat(spans) if spans else torch.zeros(0)


def layout_report(title, offsets):
    """Prints the windows' sizes and the three layouts' slot and tile counts."""
    starts, counts = offsets[:-1].tolist(), (offsets[1:] - offsets[:-1]).tolist()
    bounds = [(s, s + c) for s, c in zip(starts, counts) for _ in range(c)]
    n_rows, pairs = len(bounds), sum(c * c for c in counts)
    items = {"64-row items": [(r0, min(ROWS, n_rows - r0)) for r0 in range(0, n_rows, ROWS)],
             "window-cut items": [(r0, min(ROWS, s + c - r0)) for s, c in zip(starts, counts)
                                  for r0 in range(s, s + c, ROWS)],
             "packed window-cut": packed_items(starts, counts)}
    layouts = {name: (*walk(its, bounds), len(its)) for name, its in items.items()}
    # a warp's own walk counted as an item
    layouts["per-warp blocks"] = (*per_warp(n_rows, bounds), (n_rows + WARP_ROWS - 1) // WARP_ROWS)
    print(f"{title}: {len(counts)} windows, mean {n_rows / len(counts):.1f} tokens, "
          f"{pairs / n_rows:.1f} pair-weighted, max {max(counts)}, {pairs / 1e6:.1f} M pairs")
    for name, (slots, busy, tiles, n_items) in layouts.items():
        print(f"  {name:17s} {n_items:6d} items, warp-block slots {slots:7d}, busy {busy / slots:6.1%}; "
              f"16x16 tiles {tiles * 256 / 1e6:5.1f} M pair slots, {pairs / (tiles * 256):6.1%} real pairs")


def sides(size):
    return " x ".join(f"{float(x):.4g}" for x in size)


def sphereformer_report(level, voxels):
    from sptr.models.sphereformer import SphereFormerUNetConfig  # needs spconv

    unet = SphereFormerUNetConfig()
    cfg = unet.block_config(unet.levels()[level - 1])
    xyz, batch = lidar_voxels(voxels, voxel=float(unet.voxel_size[0]) * 2 ** (level - 1))
    _, offsets = window_partition(xyz, batch, np.array(cfg.window_size, np.float32), False)
    layout_report(f"level {level}, cubic windows {sides(cfg.window_size)}", offsets)
    sphere = cart2sphere(xyz.float())
    order, offsets = window_partition(sphere, batch, np.array(cfg.window_size_sphere, np.float32), False)
    layout_report(f"level {level}, spherical windows {sides(cfg.window_size_sphere)}", offsets)
    spans = radial_bin_spans(sphere[order, 2], offsets, cfg.a).float()
    print(f"  radial bins spanned per query row: mean {spans.mean():.1f}, median {spans.median():.0f}, "
          f"90th percentile {spans.quantile(0.9):.0f}, max {spans.max():.0f}; "
          + ", ".join(f"<= {k}: {(spans <= k).float().mean():.0%}" for k in (8, 16, 24, 32)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voxels", type=int, default=270_000)
    ap.add_argument("--window", type=float, nargs="+", default=[12, 6], help="window side in voxels")
    ap.add_argument("--sphereformer-level", type=int, default=0, help="a U-Net level's block windows instead")
    args = ap.parse_args()
    if args.sphereformer_level:
        sphereformer_report(args.sphereformer_level, args.voxels)
        return
    xyz, batch = lidar_voxels(args.voxels)
    for win in args.window:
        _, offsets = window_partition(xyz, batch, win * VOXEL, False)
        layout_report(f"window {win:g}", offsets)


if __name__ == "__main__":
    main()
