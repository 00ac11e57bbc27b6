"""SparseTransformer-compatible position embeddings."""
from .layers.position_embedding import PositionEmbeddingCoordsSine, shift_scale_points  # noqa: F401
