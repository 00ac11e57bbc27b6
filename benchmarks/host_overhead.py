"""Host time per call of the ops whose autograd is in C++, on the CPU with tiny inputs so that the kernels
cost next to nothing: what is left is Python and dispatcher work, the same in front of a CUDA launch (the CUDA
call adds the launches and the allocator: see profile_fused_forward.py on the device).

1. The fused window attention (issue 11's host-overhead target), a 1-token window: the whole call with and
   without the value checks, the op alone (torch.ops.sptr.window_attention_fwd, autograd layer included) and
   below the autograd layer; gradients off and on.
2. mRoPE, the dual GEMM and permute/unpermute beside what a user would write instead (transformers' eager
   mRoPE expression, two torch.mm, argsort + index_select), forward and forward+backward.
`torch.add` of two 1-token tensors is the floor of any op call from Python.

Run: python benchmarks/host_overhead.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import torch_permute, torch_unpermute  # noqa: E402
from bench_rope import hf_eager  # noqa: E402
from common import table  # noqa: E402

from sptr.ops import RelativePosition, data_checks, moe, rope, window_attention  # noqa: E402


def host_us(fn, calls=5000, repeats=5):
    """Best of `repeats` mean microseconds per call."""
    for _ in range(300):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def below_autograd(fn):
    def call():
        with torch._C._AutoDispatchBelowAutograd():
            return fn()
    return call


def attention_rows():
    torch.manual_seed(0)
    h, d, length = 1, 16, 47  # one head of SphereFormer's dim 16, the 47-row cubic tables
    offsets = torch.tensor([0, 1], dtype=torch.int32)
    coords = torch.randint(0, 24, (1, 3), dtype=torch.int32)
    tables = [torch.randn(length, 3, h, d) for _ in range(3)]
    op = torch.ops.sptr.window_attention_fwd.default
    rows = []
    for grad in (False, True):
        q, k, v = (torch.randn(1, h, d, requires_grad=grad) for _ in range(3))
        for name, rel_pos, op_args in (
                ("plain", None, (None, None, None, None, None, 0)),
                ("tables", RelativePosition(coords, length // 2, *tables), (coords, None, *tables, length // 2))):
            call = lambda rel_pos=rel_pos: window_attention(q, k, v, offsets, rel_pos=rel_pos)  # noqa: E731
            op_call = lambda op_args=op_args: op(q, k, v, offsets, *op_args, 0.0, 0.25, False)  # noqa: E731
            checked = host_us(call)
            with data_checks(False):
                unchecked = host_us(call)
            alone, below = host_us(op_call), host_us(below_autograd(op_call))
            rows.append([name, "on" if grad else "off", f"{checked:.1f}", f"{unchecked:.1f}", f"{alone:.1f}",
                         f"{below:.1f}", f"{unchecked - alone:.1f}"])
    return rows


def forward_and_backward(fn, leaves):
    """fn's forward, then forward + autograd.grad of all its outputs with ones."""
    def step():
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
    return lambda: fn(*leaves), step


def route(x, ids, num_experts, probs):
    perm = moe.permute(x, ids, num_experts, validate=False)
    return moe.unpermute(perm.x_perm, perm.row_id_map, probs, validate=False)


def peer_rows():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 4, 16, requires_grad=True), torch.randn(1, 1, 4, 16, requires_grad=True)
    cos, sin = torch.randn(3, 1, 4, 16), torch.randn(3, 1, 4, 16)
    a0, a1 = torch.randn(2, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    w0, w1 = torch.randn(8, 4, requires_grad=True), torch.randn(8, 6, requires_grad=True)
    x, ids, probs = torch.randn(6, 8, requires_grad=True), torch.randint(0, 2, (6, 1)), torch.ones(6, 1)
    cases = [
        ("mRoPE (q, k)", lambda a, b: rope.apply_rotary(a, b, cos, sin, [2, 3, 3]),
         "transformers eager", lambda a, b: hf_eager(a, b, cos, sin, [2, 3, 3]), (q, k)),
        ("asym_dual_gmm", lambda *t: moe.asym_dual_gmm(*t), "2x torch.mm", lambda a, b, c, d: (a @ c, b @ d),
         (a0, a1, w0, w1)),
        ("permute + unpermute", lambda t: route(t, ids, 2, probs), "argsort + index_select",
         lambda t: torch_unpermute(*torch_permute(t, ids), probs), (x,)),
    ]
    rows = []
    for name, fn, peer_name, peer, leaves in cases:
        (f, fb), (pf, pfb) = forward_and_backward(fn, leaves), forward_and_backward(peer, leaves)
        t = [host_us(f), host_us(fb), host_us(pf), host_us(pfb)]
        rows.append([name, f"{t[0]:.1f}", f"{t[1]:.1f}", peer_name, f"{t[2]:.1f}", f"{t[3]:.1f}"])
    return rows


def main():
    torch.set_num_threads(1)
    print(table(attention_rows(), ["attention", "grad", "call us", "call, no value checks us", "op us",
                                   "op below autograd us", "Python wrapper us"]))
    print()
    print(table(peer_rows(), ["sptr call", "fwd us", "fwd+bwd us", "peer", "peer fwd us", "peer fwd+bwd us"]))
    a = torch.randn(1, 16)
    print(f"torch.add of two 1-token tensors: {host_us(lambda: torch.add(a, a)):.1f} us (threads: 1, torch "
          f"{torch.__version__})")


if __name__ == "__main__":
    main()
