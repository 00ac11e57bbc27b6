"""sptr::window_cells (the window cell keys behind every window partition) and sptr::window_quantised_coords
(the quantisation cells inside the windows, whose differences index the relative-position tables): bit-equal to
the published arithmetic (torch ops one at a time) on both devices, for plain and shifted windows, an explicit
origin, strided coordinates, unsorted and floating batch indices, a window order, and empty input."""
import pytest
import torch

from sptr.ops.windowing import quantised_coords
from sptr.reference.windowing import quantised_coords_reference, window_cells_reference
from tests.helpers import ALL_DTYPES, device_params

MODES = {"plain": (False, False), "shifted": (False, True), "start": (True, False)}


def scene(n, dtype, device, seed=0):
    """Points of a LiDAR-like spread (tens of metres, millimetre detail) as a strided view of (batch, x, y, z)
    rows, with three scans in no order."""
    gen = torch.Generator().manual_seed(seed)
    xyz = (torch.rand(n, 3, generator=gen, dtype=torch.float64) - 0.3) * torch.tensor([80.0, 60.0, 6.0])
    batch = torch.randint(0, 3, (n,), generator=gen) + 2
    rows = torch.cat([batch[:, None].double(), xyz], 1).to(dtype)
    return rows.to(device)[:, 1:], batch.to(device)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("size", [0.3, 2.0, 0.05])
def test_window_cells_match_the_published_arithmetic(device, dtype, mode, size):
    with_start, shift = MODES[mode]
    xyz, batch = scene(3001, dtype, device)
    assert not xyz.is_contiguous()
    w = torch.tensor([size, size * 1.5, size * 0.75], dtype=dtype, device=device)
    start = xyz.min(0).values - 1.0 if with_start else None
    got = torch.ops.sptr.window_cells(xyz, batch, w, start, shift)
    want = window_cells_reference(xyz, batch, w, start, shift)
    assert got.dtype == torch.long and torch.equal(got, want)
    # Floating batch indices (layers carry them in the coordinates' dtype) give the same keys.
    assert torch.equal(torch.ops.sptr.window_cells(xyz, batch.to(dtype), w, start, shift), want)


@pytest.mark.parametrize("device", device_params())
def test_window_cells_of_no_points_and_of_one(device):
    w = torch.full((3,), 0.5, device=device)
    empty = torch.ops.sptr.window_cells(torch.zeros(0, 3, device=device), torch.zeros(0, dtype=torch.long,
                                        device=device), w, None, False)
    assert empty.shape == (0,) and empty.dtype == torch.long
    one, scan = torch.tensor([[1.0, 2.0, 3.0]], device=device), torch.tensor([4], device=device)
    # scans count from the first one, or from 0 with shifted windows (the published rule)
    assert torch.ops.sptr.window_cells(one, scan, w, None, False).tolist() == [0]
    assert torch.ops.sptr.window_cells(one, scan, w, None, True).tolist() == [4]


def test_window_cells_errors_name_the_argument():
    xyz, batch = torch.rand(5, 3), torch.zeros(5, dtype=torch.long)
    w = torch.full((3,), 0.5)
    cases = [((torch.rand(5, 2), batch, w), "xyz must have shape"),
             ((xyz.long(), batch, w), "xyz must be a floating"),
             ((xyz, batch[:4], w), "batch must have shape"),
             ((xyz, batch.bool(), w), "batch must be an integer or floating"),
             ((xyz, batch, w[:2]), "size must have shape"),
             ((xyz, batch, w.double()), "size must have xyz's dtype")]
    for args, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            torch.ops.sptr.window_cells(*args, None, False)
    with pytest.raises(TypeError, match="start must have xyz's dtype"):
        torch.ops.sptr.window_cells(xyz, batch, w, w.half(), False)


@pytest.mark.parametrize("device", device_params())
def test_window_cells_opcheck(device):
    xyz, batch = scene(50, torch.float32, device)
    w = torch.full((3,), 0.7, device=device)
    for start, shift in ((None, False), (None, True), (xyz.min(0).values, False)):
        torch.library.opcheck(torch.ops.sptr.window_cells, (xyz, batch, w, start, shift))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("sizes", [(0.3, 0.0125), (2.0, 2.0 / 24), ((2.0, 2.0, 80.0), (2 / 24, 2 / 24, 80 / 24))])
def test_quantised_coords_match_the_published_arithmetic(device, dtype, shift, sizes):
    window, quant = sizes
    xyz, _ = scene(2999, dtype, device, seed=1)
    order = torch.randperm(xyz.shape[0], device=device)
    want = quantised_coords_reference(xyz[order], window, quant, shift)
    got = quantised_coords(xyz, window, quant, shift, order=order)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert torch.equal(quantised_coords(xyz[order], window, quant, shift), want)


@pytest.mark.parametrize("device", device_params())
def test_quantised_coords_of_no_points(device):
    got = quantised_coords(torch.zeros(0, 3, device=device), 0.3, 0.05, True,
                           order=torch.zeros(0, dtype=torch.long, device=device))
    assert got.shape == (0, 3) and got.dtype == torch.int32


def test_quantised_coords_errors_name_the_argument():
    xyz, w = torch.rand(5, 3), torch.full((3,), 0.5)
    cases = [((xyz, torch.arange(4), w, w), "order must have shape"),
             ((xyz, torch.arange(5).int(), w, w), "order must be int64"),
             ((xyz, None, w.double(), w), "window_size must be float32"),
             ((xyz, None, w, w[:2]), "quant_size must have shape"),
             ((xyz.int(), None, w, w), "xyz must be a floating")]
    for args, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            torch.ops.sptr.window_quantised_coords(*args, False)


@pytest.mark.parametrize("device", device_params())
def test_quantised_coords_opcheck(device):
    xyz, _ = scene(40, torch.float32, device)
    w, q = torch.full((3,), 0.7, device=device), torch.full((3,), 0.1, device=device)
    for order in (None, torch.randperm(40, device=device)):
        torch.library.opcheck(torch.ops.sptr.window_quantised_coords, (xyz, order, w, q, True))
