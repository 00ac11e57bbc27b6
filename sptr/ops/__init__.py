"""Public functional API: one module per op family."""
from . import layer_norm, moe, rope, vision_index  # noqa: F401
from ._checks import data_checks  # noqa: F401
from .step_attention import (  # noqa: F401
    aggregate,
    attention_step1,
    attention_step2,
    attention_step2_with_rel_pos_value,
    dot_prod_with_idx,
    dot_prod_with_idx_all,
    pair_logits,
    precompute_all,
    scatter_softmax_csr,
    segment_softmax,
)
from .fused_window_attention import RelativePosition, window_attention  # noqa: F401
from .windowing import (  # noqa: F401
    get_indices_params,
    grid_sample,
    quantised_coords,
    relative_position_index,
    to_3d_numpy,
    window_partition,
)
from .sparse_attention import sparse_self_attention  # noqa: F401
