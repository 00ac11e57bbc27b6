"""Drop-in names of Wall-X's ``wall_x.fusions.backend`` for the RoPE and Qwen2.5-VL index ops (positional, as
published; the published defects are fixed, see the spec's §9)."""
from ..ops.rope import rope, rope_bwd  # noqa: F401
from ..ops.vision_index import get_rope_index, get_window_index, rot_pos_emb  # noqa: F401
