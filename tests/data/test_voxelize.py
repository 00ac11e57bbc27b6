"""The voxel ranks of a scan's cells: one int64 key per cell where the extents allow, rows otherwise."""
import pytest
import torch

from sptr.data.voxelize import _voxel_of_cells, voxelize_scan


@pytest.mark.parametrize("extent", [(1, 1, 1), (7, 300, 5), (2000, 2000, 100), (2**40, 2**20, 2**10)],
                         ids=["one-cell", "small", "kitti", "past-int64-keys"])
def test_voxel_of_cells_is_the_row_unique(extent):
    g = torch.Generator().manual_seed(0)
    cells = torch.stack([torch.randint(e, (5000,), generator=g) for e in extent], 1)
    cells[0] = torch.tensor(extent) - 1  # the largest cell occurs: the extents are exact
    inverse, num = _voxel_of_cells(cells)
    rows, want = torch.unique(cells, dim=0, return_inverse=True)
    assert num == rows.shape[0] and torch.equal(inverse, want)


def test_voxelize_scan_voxels_in_lexicographic_cell_order():
    g = torch.Generator().manual_seed(1)
    points = torch.randn(4000, 4, generator=g) * torch.tensor([3.0, 3.0, 0.5, 1.0])
    scan = voxelize_scan(points, (0.1, 0.1, 0.1), mode="mean")
    cells = torch.floor((points[:, :3] - points[:, :3].min(0).values) / 0.1).long()
    rows, inverse = torch.unique(cells, dim=0, return_inverse=True)
    assert torch.equal(scan.point_to_voxel, inverse) and scan.coords.shape[0] == rows.shape[0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_voxelize_scan_refuses_non_finite_coordinates(bad):
    points = torch.randn(10, 4)
    points[3, 1] = bad
    with pytest.raises(ValueError, match="non-finite coordinates"):
        voxelize_scan(points)
    points[3, 1], points[5, 3] = 0.0, bad  # a non-finite intensity is a feature, not a coordinate
    assert voxelize_scan(points).coords.shape[0] > 0
