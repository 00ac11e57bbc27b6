"""SparseTrTensor: the feature/coordinate container SparseTransformer modules pass along."""
import numpy as np


class SparseTrTensor:
    """``query_feats (N, C)``, ``query_indices (N, 4)`` (batch, then 3 coordinates), an index cache
    ``indice_dict`` keyed by ``indice_key``. ``key_indices`` is kept for compatibility and unused."""

    def __init__(self, query_feats, query_indices, spatial_shape, batch_size, key_feats=None, value_feats=None,
                 key_indices=None):
        self.query_feats = query_feats
        self.key_feats = key_feats
        self.value_feats = value_feats
        self.query_indices = query_indices
        self.key_indices = key_indices
        self.spatial_shape = spatial_shape
        self.batch_size = batch_size
        self.indice_dict = {}

    @property
    def spatial_size(self):
        return np.prod(self.spatial_shape)

    def find_indice_params(self, key):
        if key is None:
            return None
        return self.indice_dict.get(key)
