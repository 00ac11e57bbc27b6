"""Host time of one fused window attention call (issue 11's host-overhead target), on the CPU with a 1-token
window so that the kernel itself costs next to nothing: the whole call with and without the value checks, the
op alone (torch.ops.sptr.window_attention_fwd, autograd layer included), and the op below the autograd layer;
each with gradients off and on. `torch.add` of two 1-token tensors is the floor of any op call from Python.
What it measures is Python and dispatcher work, which is the same in front of a CUDA launch (the CUDA call adds
the launches and the allocator: see profile_fused_forward.py on the device).

Run: python benchmarks/host_overhead.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table  # noqa: E402

from sptr.ops import RelativePosition, data_checks, window_attention  # noqa: E402


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


def main():
    torch.set_num_threads(1)
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
    a = torch.randn(1, h, d)
    floor = host_us(lambda: torch.add(a, a))
    print(table(rows, ["attention", "grad", "call us", "call, no value checks us", "op us", "op below autograd us",
                       "Python wrapper us"]))
    print(f"torch.add of two 1-token tensors: {floor:.1f} us (threads: 1, torch {torch.__version__})")


if __name__ == "__main__":
    main()
