"""Runs the issue-28 shapes of get_rope_index (24 images [1,18,18], B = 8 x 768 tokens) and of permute /
unpermute (x [6144, 2048] bf16, K = 1, 2 experts) a few times each, unchecked, for Nsight Compute:
`ncu -k regex:"rope_index|moe_" python benchmarks/profile_index_routing.py` (bench_rope.py and bench_moe.py
time the same calls).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rope import index_inputs  # noqa: E402

from sptr.ops import data_checks, moe, vision_index  # noqa: E402


def main(calls=3):
    ids, grids, _, _ = index_inputs()
    x = torch.randn(6144, 2048, device="cuda", dtype=torch.bfloat16)
    experts = (torch.rand(6144, 1, device="cuda") < 0.15).long()
    probs = torch.rand(6144, 1, device="cuda")
    with data_checks(False):
        for _ in range(calls):
            vision_index.get_rope_index(ids, grids, None, None, None, 2, 151655, 151656, 151652, 2)
            perm = moe.permute(x, experts, 2)
            moe.unpermute(perm.x_perm, perm.row_id_map, probs)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
