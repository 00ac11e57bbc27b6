"""SparseTransformer-compatible utilities (``from sptr.utils import get_indices_params``)."""
from .ops.sparse_attention import sparse_self_attention  # noqa: F401
from .ops.step_attention import scatter_softmax_csr  # noqa: F401
from .ops.windowing import get_indices_params, grid_sample, to_3d_numpy  # noqa: F401
