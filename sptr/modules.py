"""SparseTransformer-compatible modules (``from sptr.modules import VarLengthMultiheadSA``)."""
from .layers.sparse_tensor import SparseTrTensor  # noqa: F401
from .layers.var_length_attention import VarLengthMultiheadSA  # noqa: F401
