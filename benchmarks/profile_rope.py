"""One launch each of the mRoPE forward and backward kernels and of the rope_index kernel at the bench_rope
shapes, for Nsight Compute:

ncu -k regex:"mrope_rows|rope_index_kernel" --section SpeedOfLight --section Occupancy \
    --section MemoryWorkloadAnalysis --section LaunchStats python benchmarks/profile_rope.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rope import index_inputs, rope_inputs  # noqa: E402

from sptr.ops import data_checks, rope, vision_index  # noqa: E402


def main():
    q, k, cos, sin = rope_inputs(torch.bfloat16)
    q = q.detach().requires_grad_()
    out = rope.apply_rotary(q, k, cos, sin, [16, 24, 24])
    torch.autograd.grad(out, q, (torch.randn_like(out[0]), torch.randn_like(out[1])))
    ids, grids, _, _ = index_inputs()
    with data_checks(False):
        vision_index.get_rope_index(ids, grids, None, None, None, 2, 151655, 151656, 151652, 2)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
