"""Synthetic inputs for demos, tests and benchmarks."""
from .synthetic_lidar import lidar_voxels  # noqa: F401
