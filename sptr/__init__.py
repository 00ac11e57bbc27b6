"""sptr: fused-kernel layers for sparse 3D and multimodal transformers.

Drop-in for the SparseTransformer / ``sptr`` 1.1.1 API (``import sptr``), with CPU and CUDA kernels.
"""
from . import functional, modules, position_embedding, utils  # noqa: F401
from .functional import (  # noqa: F401
    AttentionStep1,
    AttentionStep2,
    AttentionStep2WithRelPosValue,
    DotProdWithIdx,
    DotProdWithIdxAll,
    PrecomputeAll,
    attention_step1,
    attention_step2,
    attention_step2_with_rel_pos_value,
    dot_prod_with_idx,
    dot_prod_with_idx_all,
    precompute_all,
)
from .modules import SparseTrTensor, VarLengthMultiheadSA  # noqa: F401
from .utils import get_indices_params, grid_sample, scatter_softmax_csr, sparse_self_attention, to_3d_numpy  # noqa: F401

__version__ = "2.0.0"
