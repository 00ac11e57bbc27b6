"""The aten and sptr ops one SphereFormer block's forward+backward dispatches, with the bytes each writes (the
sum of its outputs' sizes; views count too, though they write nothing), largest first, and the argument shapes
of the ops that assemble gradients (adds, sums, slice/select backwards, cats, stacks). Runs on the CPU: the op
sequence is the CUDA one (the fused path has CPU kernels), so it shows which ops a change adds or removes.
`python benchmarks/block_op_census.py --points 20000`."""
import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sptr.layers.sphereformer import SphereFormer, SphereFormerConfig  # noqa: E402

GRADIENT_ASSEMBLY = ("aten.add.Tensor", "aten.sum.dim_IntList", "aten.select_backward.default",
                     "aten.slice_backward.default", "aten.cat.default", "aten.stack.default")


class Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls, self.bytes, self.shapes = collections.Counter(), collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.calls[name] += 1
        self.bytes[name] += sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
        if name in GRADIENT_ASSEMBLY:
            flat = args[0] if args and isinstance(args[0], (tuple, list)) else args
            self.shapes[(name, tuple(tuple(a.shape) for a in flat if isinstance(a, torch.Tensor)))] += 1
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=20_000)
    ap.add_argument("--attention-dtype", default="float32")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    xyz = torch.rand(args.points, 3) * torch.tensor([40.0, 40.0, 4.0]) - torch.tensor([20.0, 20.0, 2.0])
    batch = torch.zeros(args.points, dtype=torch.long)
    block = SphereFormer(SphereFormerConfig(attention_dtype=args.attention_dtype))
    feats = torch.randn(args.points, block.cfg.dim, requires_grad=True)
    block(feats, xyz, batch).sum().backward()  # warm-up: window caches, lazy inits
    with Census() as census:
        out = block(feats, xyz, batch)
        out.backward(torch.ones_like(out))
    print(f"SphereFormer block, {args.points} points, dim {block.cfg.dim}, attention {args.attention_dtype}: "
          "ops of one forward+backward")
    for name, written in census.bytes.most_common(args.top):
        print(f"{name:50s} {census.calls[name]:4d} calls {written / 1e6:9.2f} MB")
    print("gradient assembly (op, argument shapes): calls")
    for (name, shapes), calls in sorted(census.shapes.items()):
        print(f"  {calls:3d}  {name} {shapes}")


if __name__ == "__main__":
    main()
