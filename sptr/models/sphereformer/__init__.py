"""SphereFormer's segmentation network (a spconv U-Net with SphereFormer blocks), the released checkpoints'
loader, and scan inference. ``python -m sptr.models.sphereformer`` runs the inference CLI."""
from .checkpoint import load_pretrained, match_module_prefix, read_state_dict, save_pretrained  # noqa: F401
from .config import LevelSpec, SphereFormerUNetConfig  # noqa: F401
from .inference import predict_scans  # noqa: F401
from .training import (batch_inputs, mixed_precision, resume_training_state, save_training_state,  # noqa: F401
                       training_batch)
from .unet import SphereFormerUNet, pool_coordinates, sparse_input  # noqa: F401
