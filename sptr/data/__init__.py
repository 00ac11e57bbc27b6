"""Synthetic inputs for demos, tests and benchmarks, SphereFormer's scan preprocessing, SemanticKITTI and
nuScenes-lidarseg on disk, label maps and segmentation metrics."""
from .labels import LabelMap  # noqa: F401
from .lidar_segmentation import LidarSample, LidarSegmentation, SphereFormerAugment, collate_samples  # noqa: F401
from .metrics import SegmentationMetrics, confusion_matrix  # noqa: F401
from .nuscenes import NuScenesLidarSeg  # noqa: F401
from .semantic_kitti import SemanticKITTI  # noqa: F401
from .synthetic_lidar import lidar_scan, lidar_voxels  # noqa: F401
from .voxelize import VoxelScan, collate_scans, read_kitti_bin, voxelize_scan, write_kitti_label  # noqa: F401
