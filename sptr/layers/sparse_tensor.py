"""SparseTrTensor: the feature/coordinate container SparseTransformer modules pass along."""
import numpy as np

from ..ops._checks import FLOATING, INTEGER, check_shape, check_tensor


class SparseTrTensor:
    """``query_feats (N, C)``, ``query_indices (N, 4)`` (batch, then 3 coordinates), an index cache
    ``indice_dict`` keyed by ``indice_key``. ``key_indices`` is kept for compatibility and unused.

    ``batch`` (optional, integer ``(N,)``): the batch ids exactly, used instead of ``query_indices[:, 0]``,
    which holds them in the coordinates' dtype (fp16 represents integers only up to 2048, bf16 up to 256).
    """

    def __init__(self, query_feats, query_indices, spatial_shape, batch_size, key_feats=None, value_feats=None,
                 key_indices=None, batch=None):
        self.query_feats = query_feats
        self.key_feats = key_feats
        self.value_feats = value_feats
        self.query_indices = query_indices
        self.key_indices = key_indices
        self.spatial_shape = spatial_shape
        self.batch_size = batch_size
        self.batch = batch
        self.indice_dict = {}

    def batch_ids(self):
        """The batch id of every point: ``batch`` if given, else column 0 of ``query_indices``."""
        return self.query_indices[:, 0] if self.batch is None else self.batch

    @property
    def spatial_size(self):
        return np.prod(self.spatial_shape)

    def find_indice_params(self, key):
        if key is None:
            return None
        return self.indice_dict.get(key)


def check_features(sptr_tensor: "SparseTrTensor", channels: int, self_attention: bool = False):
    """``query_feats (N, channels)`` floating, ``query_indices (N, 4)``, key/value features of the same shape
    (or None; both must be None for self-attention). Returns N."""
    if not isinstance(sptr_tensor, SparseTrTensor):
        raise TypeError(f"the input must be a SparseTrTensor, got {type(sptr_tensor).__name__}")
    feats = check_tensor("query_feats", sptr_tensor.query_feats, dim=2, dtypes=FLOATING)
    check_shape("query_feats", feats, (None, channels))
    n = feats.shape[0]
    check_tensor("query_indices", sptr_tensor.query_indices, dim=2, device=feats.device)
    check_shape("query_indices", sptr_tensor.query_indices, (n, 4))
    if sptr_tensor.batch is not None:
        check_tensor("batch", sptr_tensor.batch, dim=1, dtypes=INTEGER, device=feats.device)
        check_shape("batch", sptr_tensor.batch, (n,))
    for name in ("key_feats", "value_feats"):
        t = getattr(sptr_tensor, name)
        if t is None:
            continue
        if self_attention:
            raise ValueError(f"{name} must be None: this module is self-attention")
        check_tensor(name, t, dim=2, dtypes=FLOATING, device=feats.device)
        check_shape(name, t, (n, channels))
    return n
