"""Synthetic inputs for demos, tests and benchmarks, and SphereFormer's scan preprocessing."""
from .synthetic_lidar import lidar_scan, lidar_voxels  # noqa: F401
from .voxelize import VoxelScan, collate_scans, read_kitti_bin, voxelize_scan, write_kitti_label  # noqa: F401
