"""The sync-free forms (issue 13): rot_pos_emb / get_window_index with num_tokens equal the exact results
(the window offsets padded with empty windows), and on CUDA the index ops and mRoPE run with no host sync
(``torch.cuda.set_sync_debug_mode("error")``) and replay from a CUDA graph. The exact results themselves are
checked against transformers in test_vision_index.py / test_rope.py; here the reference is the exact path."""
import contextlib

import pytest
import torch

from sptr.ops import data_checks, rope, vision_index as vi
from tests.helpers import device_params, requires_cuda

GRIDS = [[[1, 18, 18]] * 3, [[1, 4, 6], [3, 8, 4], [2, 34, 58]], [[1, 2, 2]], [[4, 16, 30]] * 800]


def padded_like(cu_exact: torch.Tensor, length: int) -> torch.Tensor:
    """The exact offsets followed by repeats of the total, to `length` entries."""
    return torch.cat([cu_exact, cu_exact[-1:].expand(length - cu_exact.numel())])


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{len(g)}x{g[0]}")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_num_tokens_form_equals_the_exact_form(device, grid, dtype):
    g = torch.tensor(grid, dtype=dtype, device=device)
    n = int(g.prod(1).sum())
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 40, 2, device=device).float() / 40)
    assert torch.equal(vi.rot_pos_emb(inv_freq, g, 2, n), vi.rot_pos_emb(inv_freq, g, 2))
    idx, cu = vi.get_window_index(g, 2, 4, 14, 4)
    idx_n, cu_n = vi.get_window_index(g, 2, 4, 14, 4, num_tokens=n)
    assert torch.equal(idx_n, idx)
    assert cu_n.numel() == n // 4 + 1 and torch.equal(cu_n, padded_like(cu, n // 4 + 1))
    assert torch.equal(torch.unique_consecutive(cu_n), cu)
    if device == "cuda":  # a host grid with the CUDA kernel: same values
        assert torch.equal(vi.rot_pos_emb(inv_freq, g.cpu(), 2, n), vi.rot_pos_emb(inv_freq, g, 2))


@pytest.mark.parametrize("device", device_params())
def test_num_tokens_that_does_not_match_the_grid_raises(device):
    g = torch.tensor([[1, 4, 4], [2, 2, 6]], device=device)
    inv_freq = torch.rand(8, device=device)
    with pytest.raises(ValueError, match="num_tokens"):
        vi.rot_pos_emb(inv_freq, g, 2, 30)
    with pytest.raises(ValueError, match="num_tokens"):
        vi.get_window_index(g, 2, 4, 14, 4, num_tokens=36)
    with pytest.raises(ValueError, match="num_tokens"):
        vi.rot_pos_emb(inv_freq, g, 2, 34)  # not a multiple of merge^2
    with pytest.raises(TypeError, match="num_tokens"):
        vi.rot_pos_emb(inv_freq, g, 2, 40.0)


@requires_cuda
@pytest.mark.cuda
def test_unchecked_mismatched_num_tokens_is_memory_safe():
    """Unchecked, a wrong num_tokens gives unspecified values (a host grid is always checked), never a fault."""
    g = torch.tensor([[1, 4, 4], [2, 2, 6], [-3, 8, 8]], device="cuda")
    with data_checks(False):
        for n in (0, 4, 64, 400):
            emb = vi.rot_pos_emb(torch.rand(8, device="cuda"), g, 2, n)
            idx, cu = vi.get_window_index(g, 2, 4, 14, 4, num_tokens=n)
            assert emb.shape == (n, 16) and idx.shape == (n // 4,) and cu.shape == (n // 4 + 1,)
    torch.cuda.synchronize()


def test_opcheck_num_tokens():
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.sptr.vision_rot_pos_emb.default, (torch.rand(4), torch.tensor([[1, 4, 4]]), 2, 16),
                          test_utils=tests)
    torch.library.opcheck(torch.ops.sptr.vision_window_index.default, (torch.tensor([[1, 4, 8]]), 2, 4, 4, 32),
                          test_utils=tests)


def rope_index_inputs(device):
    """8 rows of 768 tokens with 3 images of 9x9 merged tokens each, the last two rows left-padded."""
    rows = []
    for _ in range(8):
        row = []
        for _ in range(3):
            row += [1000] * 150 + [151652] + [151655] * 81 + [151653]
        rows.append(row[:768] + [1000] * (768 - len(row[:768])))
    ids = torch.tensor(rows, device=device)
    mask = torch.ones_like(ids)
    mask[6:, :20] = 0
    images = int(((ids[:, :-1] == 151652) & (ids[:, 1:] == 151655) & (mask[:, 1:] == 1)).sum())
    grids = torch.tensor([[1, 18, 18]] * images, device=device)
    return ids, grids, mask


def index_calls(device):
    ids, grids, mask = rope_index_inputs(device)
    vgrid = torch.tensor([[1, 18, 18]] * 24 + [[2, 8, 12]], device=device)
    n = 24 * 324 + 2 * 96
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 40, 2, device=device).float() / 40)
    return {
        "get_rope_index": lambda: vi.get_rope_index(ids, grids, None, None, mask, 2, 151655, 151656, 151652, 2),
        "rot_pos_emb": lambda: (vi.rot_pos_emb(inv_freq, vgrid, 2, n),),
        "get_window_index": lambda: vi.get_window_index(vgrid, 2, 4, 14, 4, num_tokens=n),
    }


@contextlib.contextmanager
def sync_debug_error():
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@requires_cuda
@pytest.mark.cuda
def test_index_ops_do_not_sync_and_replay_from_a_cuda_graph():
    for name, call in index_calls("cuda").items():
        want = [t.clone() for t in call()]
        with data_checks(False), sync_debug_error():
            got = call()
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), data_checks(False):
            call()  # warm-up outside the capture (allocator, lazy init)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()  # the default checks step aside during capture
        for t in out:
            t.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, want)), name


def rope_inputs(strided):
    B, Hq, Hk, S, D = 2, 6, 2, 40, 128
    if strided:  # views of one fused qkv projection [B, S, (Hq + 2 Hk) * D]
        qkv = torch.randn(B, S, (Hq + 2 * Hk) * D, device="cuda", dtype=torch.bfloat16)
        q = qkv[..., :Hq * D].view(B, S, Hq, D).transpose(1, 2)
        k = qkv[..., Hq * D:(Hq + Hk) * D].view(B, S, Hk, D).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hk, S, D, device="cuda", dtype=torch.bfloat16)
    emb = torch.randn(3, B, S, D, device="cuda")
    return q, k, emb.cos().bfloat16(), emb.sin().bfloat16()


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("strided", [False, True])
def test_mrope_does_not_sync_and_replays_from_a_cuda_graph(strided):
    q, k, cos, sin = rope_inputs(strided)
    q = q.requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn(k.shape, device="cuda", dtype=k.dtype)
    want = rope.apply_rotary(q, k, cos, sin, [16, 24, 24])
    want_grad = torch.autograd.grad(want, q, (gq, gk))[0]
    with sync_debug_error():
        out = rope.apply_rotary(q, k, cos, sin, [16, 24, 24])
        grad = torch.autograd.grad(out, q, (gq, gk))[0]
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]) and torch.equal(grad, want_grad)
    # Leaves made for the capture: a leaf whose AccumulateGrad node was made on another stream (above)
    # would make the captured backward wait on that stream.
    leaf = lambda: q.detach().requires_grad_()  # noqa: E731
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = leaf()
        torch.autograd.grad(rope.apply_rotary(warm, k, cos, sin, [16, 24, 24]), warm, (gq, gk))
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = leaf()
        out = rope.apply_rotary(captured, k, cos, sin, [16, 24, 24])
        grad = torch.autograd.grad(out, captured, (gq, gk))[0]
    out[0].detach().fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]) and torch.equal(grad, want_grad)
