"""benchmarks/item_layout_stats.py's slot counts on layouts small enough to count by hand."""
import importlib.util
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("item_layout_stats", os.path.join(ROOT, "benchmarks",
                                                                                "item_layout_stats.py"))
stats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stats)


def window_bounds(counts):
    return [(s, s + c) for s, c in zip([sum(counts[:i]) for i in range(len(counts))], counts) for _ in range(c)]


def test_four_windows_of_16_leave_half_the_slots_idle():
    # One item of 64 rows, each warp's 16 rows one window: the item's 64 keys are two blocks of 32, and each
    # warp has work in one of them (one 16x16 tile of real pairs).
    bounds = window_bounds([16] * 4)
    assert stats.walk([(0, 64)], bounds) == (8, 4, 4)
    assert stats.per_warp(64, bounds) == (4, 4, 4)


def test_one_window_keeps_every_warp_busy():
    # 64 rows in one window: every warp needs both blocks, four 16-key groups each.
    bounds = window_bounds([64])
    assert stats.walk([(0, 64)], bounds) == (8, 8, 16)
    assert stats.per_warp(64, bounds) == (8, 8, 16)


def test_window_straddling_two_items():
    # Windows of 40 and 88 rows: item 0 (rows 0-63) spans keys 0-127 (4 blocks), its warp 2 (rows 32-47)
    # straddles both windows and so needs all four blocks.
    bounds = window_bounds([40, 88])
    slots, busy, _ = stats.walk([(0, 64)], bounds)
    assert slots == 16
    assert busy == 2 + 2 + 4 + 3  # warps of rows 0-15, 16-31: keys 0-39; 32-47: 0-127; 48-63: 40-127


def test_radial_bin_spans_by_hand():
    # Radii 10, 10, 10.5 in one window (a = 0.0125): a difference of 0 is bin 24, -0.5 bin 15 and +0.5 bin 32
    # (exponential_split: 2·floor(log2(0.525 / 0.0125)) − 2 = 8, its edge 46·a = 0.575 > 0.5), so the two rows
    # at 10 span bins 15-24 and the row at 10.5 bins 24-32; a one-token window spans one bin.
    radius = torch.tensor([10.0, 10.0, 10.5, 3.0])
    spans = stats.radial_bin_spans(radius, torch.tensor([0, 3, 4]), 0.0125)
    assert spans.tolist() == [10, 10, 9, 1]


def test_packed_items_hold_whole_windows_and_cut_large_ones():
    # 40 fits; 88 does not join it and is cut at 64, its last 24 rows start an item that 10 and 20 join.
    assert stats.packed_items([0, 40, 128, 138], [40, 88, 10, 20]) == [(0, 40), (40, 64), (104, 54)]
    assert stats.packed_items([0, 16, 32, 48], [16] * 4) == [(0, 64)]
    assert stats.packed_items([0], [65]) == [(0, 64), (64, 1)]
