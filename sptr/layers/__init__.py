"""nn.Modules built on sptr's ops, each configured by a frozen dataclass."""
from .layer_norm import LayerNorm  # noqa: F401
from .position_embedding import PositionEmbeddingCoordsSine  # noqa: F401
from .sparse_tensor import SparseTrTensor  # noqa: F401
from .var_length_attention import VarLengthMultiheadSA, VarLengthMultiheadSAConfig  # noqa: F401
from .multimodal_rope import MultimodalRotaryEmbedding, MultimodalRotaryEmbeddingConfig  # noqa: F401
from .sphereformer import SphereFormer, SphereFormerConfig  # noqa: F401
from .vision_indices import VisionIndexBatch, VisionIndices, VisionIndicesConfig  # noqa: F401
from .moe import (DualExpertFFN, DualExpertFFNConfig, RoutedExpertFFN, RoutedExpertFFNConfig, RoutedOutput,  # noqa: F401
                  vlm_mlp_to_expert0)
