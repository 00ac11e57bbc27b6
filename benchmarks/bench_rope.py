"""mRoPE and the Qwen2.5-VL index functions on the GPU, against the alternatives a user would pick.

rope: sptr vs transformers' eager `apply_multimodal_rotary_pos_emb`, the same compiled by Inductor, and Liger's
Triton kernel (if installed), bf16, q [8,16,768,128], k [8,2,768,128] (spec §11), with the fraction of HBM
bandwidth. Index functions: sptr's CUDA kernels vs transformers 4.49's Python (if importable).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import HBM_BYTES_PER_S, table, time_ms  # noqa: E402

from sptr.ops import rope, vision_index  # noqa: E402


def hf_eager(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers 4.49 `apply_multimodal_rotary_pos_emb`, verbatim in behaviour."""
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_rows():
    B, Hq, Hk, S, D = 8, 16, 2, 768, 128
    dt, dev, sec = torch.bfloat16, "cuda", [16, 24, 24]
    q = torch.randn(B, S, Hq, D, device=dev, dtype=dt).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device=dev, dtype=dt).transpose(1, 2)
    pos = torch.arange(S, device=dev).repeat(3, B, 1) + torch.randint(0, 40, (3, B, S), device=dev)
    inv = 1.0 / 1e6 ** (torch.arange(0, D, 2, device=dev).float() / D)
    emb = torch.cat([pos[..., None].float() * inv] * 2, -1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qk_bytes = 2 * (q.numel() + k.numel()) * q.element_size()
    table_bytes = 2 * B * S * D * cos.element_size()  # one stream of cos and sin per dim
    floor_ms = (qk_bytes + table_bytes) / HBM_BYTES_PER_S * 1e3
    compiled = torch.compile(hf_eager)
    contenders = {
        "sptr": lambda a, b: rope.apply_rotary(a, b, cos, sin, sec),
        "HF eager": lambda a, b: hf_eager(a, b, cos, sin, sec),
        "HF + torch.compile": lambda a, b: compiled(a, b, cos, sin, sec),
    }
    try:
        from liger_kernel.ops.qwen2vl_mrope import LigerQwen2VLMRopeFunction

        contenders["Liger (Triton)"] = lambda a, b: LigerQwen2VLMRopeFunction.apply(a, b, cos, sin, sec, 1)
    except Exception as exc:  # noqa: BLE001 - report, don't fail the run
        print(f"liger-kernel unavailable: {exc}")
    rows, base = [], None
    for name, fn in contenders.items():
        with torch.no_grad():
            t = time_ms(lambda: fn(q, k))
        q1, k1 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        # backward = (forward + backward) - forward, the same way for every contender
        tb = time_ms(lambda: torch.autograd.backward(list(fn(q1, k1)), [gq, gk])) - t
        base = base or (t, tb)
        rows.append([name, f"{t * 1e3:.1f}", f"{t / base[0]:.2f}x", f"{100 * floor_ms / t:.0f}%",
                     f"{tb * 1e3:.1f}", f"{100 * floor_ms / tb:.0f}%"])
    return rows, floor_ms


def index_rows():
    try:
        from tests.ops import hf_oracle as hf
    except ImportError as exc:
        print(f"transformers 4.49 oracle unavailable ({exc}); index functions timed alone")
        hf = None
    dev = "cuda"
    grids = torch.tensor([[1, 18, 18]] * 24, device=dev)
    tokens, img = [], []
    for b in range(8):  # 8 rows of ~768 tokens, 3 images of 9x9 merged tokens each
        row = []
        for _ in range(3):
            row += [1000] * 150 + [hf.VS if hf else 151652] + [151655] * 81 + [151653]
        tokens.append(row[:768] + [1000] * (768 - len(row[:768])))
    ids = torch.tensor(tokens, device=dev)
    inv = 1.0 / 10000 ** (torch.arange(0, 40, 2, device=dev).float() / 40)
    ours = {
        "get_rope_index": lambda: vision_index.get_rope_index(ids, grids, None, None, None, 2, 151655, 151656, 151652, 2),
        "rot_pos_emb": lambda: vision_index.rot_pos_emb(inv, grids, 2),
        "get_window_index": lambda: vision_index.get_window_index(grids, 2, 4, 14, 4),
    }
    theirs = {}
    if hf:
        theirs = {
            "get_rope_index": lambda: hf.rope_index(ids, grids, None, None, None),
            "rot_pos_emb": lambda: hf.rot_pos_emb(grids),
            "get_window_index": lambda: hf.window_index(grids),
        }
    rows = []
    for name, fn in ours.items():
        t = time_ms(fn)
        ref = time_ms(theirs[name], 1, 5) if name in theirs else float("nan")
        rows.append([name, f"{t * 1e3:.1f}", f"{ref * 1e3:.0f}", f"{ref / t:.0f}x"])
    return rows


def main():
    rows, floor_ms = rope_rows()
    print(f"rope bf16 q [8,16,768,128] k [8,2,768,128]; HBM floor {floor_ms * 1e3:.1f} us at 4.3 TB/s")
    print(table(rows, ["rope", "fwd us", "vs sptr", "fwd % of HBM floor", "bwd us", "bwd % of HBM floor"]))
    print()
    print(table(index_rows(), ["index function (24 x [1,18,18], B=8 x 768)", "sptr us", "HF 4.49 us", "speedup"]))


if __name__ == "__main__":
    main()
