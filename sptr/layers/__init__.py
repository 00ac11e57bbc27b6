"""nn.Modules built on sptr's ops, each configured by a frozen dataclass."""
from .position_embedding import PositionEmbeddingCoordsSine  # noqa: F401
from .sparse_tensor import SparseTrTensor  # noqa: F401
from .var_length_attention import VarLengthMultiheadSA, VarLengthMultiheadSAConfig  # noqa: F401
