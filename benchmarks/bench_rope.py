"""mRoPE, the Qwen2.5-VL index functions and a Qwen2.5-VL training step on the GPU, against the alternatives a
user would pick.

rope: sptr vs transformers' eager `apply_multimodal_rotary_pos_emb`, the same compiled by Inductor, and Liger's
Triton kernel (if installed); q [8,16,768,128], k [8,2,768,128] as views of one fused qkv projection (strided,
GQA), bf16 with every peer, fp16/fp32 and the in-place form for sptr. Each is timed eagerly (CUDA events around
the Python call: launch and host overhead included) and replayed from a CUDA graph (GPU time alone), with the
share of the HBM floor. Index functions: sptr's kernels (num_tokens given, data checks off: no host sync) vs
transformers 4.49's Python. Step: forward + backward of a small random Qwen2.5-VL (bf16, images) with and
without `sptr.integrations.qwen2_5_vl.apply_to`.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import HBM_BYTES_PER_S, graph_ms, table, time_ms, warm_up_gpu  # noqa: E402

from sptr.ops import data_checks, rope, vision_index  # noqa: E402

try:
    from tests.ops import hf_oracle as hf
except ImportError as exc:
    print(f"transformers 4.49 oracle unavailable ({exc}): no HF index or model rows")
    hf = None


def hf_eager(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers 4.49 `apply_multimodal_rotary_pos_emb`, verbatim in behaviour."""
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_inputs(dt, B=8, Hq=16, Hk=2, S=768, D=128):
    """q, k as [B, H, S, D] views of one [B, S, Hq + 2 Hk, D] qkv projection; bf16-style cos/sin of q's dtype."""
    dev = "cuda"
    qkv = torch.randn(B, S, Hq + 2 * Hk, D, device=dev, dtype=dt)
    q, k = qkv[:, :, :Hq].transpose(1, 2), qkv[:, :, Hq:Hq + Hk].transpose(1, 2)
    pos = torch.arange(S, device=dev).repeat(3, B, 1) + torch.randint(0, 40, (3, B, S), device=dev)
    inv = 1.0 / 1e6 ** (torch.arange(0, D, 2, device=dev).float() / D)
    emb = torch.cat([pos[..., None].float() * inv] * 2, -1)
    return q, k, emb.cos().to(dt), emb.sin().to(dt)


def floor_ms(q, k, cos):
    """Read and write q and k once, read one table stream of cos and sin per dim, at the copy bandwidth."""
    B, _, S, D = q.shape
    moved = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * B * S * D * cos.element_size()
    return moved / HBM_BYTES_PER_S * 1e3


def time_contender(fn, q, k, gq, gk, backward=True):
    """(eager fwd, graph fwd, eager fwd+bwd, graph fwd+bwd) in ms. Forward and backward are timed together:
    a difference of the two can mislead (Liger's no-grad forward is slower than its forward with grad)."""
    with torch.no_grad():
        fwd = (time_ms(lambda: fn(q, k)), graph_ms(lambda: fn(q, k), calls=10))
    if not backward:
        return (*fwd, float("nan"), float("nan"))
    q1, k1 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    step = lambda: torch.autograd.grad(fn(q1, k1), (q1, k1), (gq, gk))  # noqa: E731
    return (*fwd, time_ms(step), graph_ms(step, calls=10))


def rope_rows():
    sec = [16, 24, 24]
    rows, base = [], None
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        q, k, cos, sin = rope_inputs(dt)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        floor = floor_ms(q, k, cos)
        contenders = {"sptr": lambda a, b: rope.apply_rotary(a, b, cos, sin, sec)}
        # in place on copies, so every replay rotates the same data volume
        qc, kc = q.clone(), k.clone()
        inplace = {"sptr in place": lambda a, b: rope.apply_rotary_(qc, kc, cos, sin, sec)}
        if dt == torch.bfloat16:
            compiled = torch.compile(hf_eager)
            contenders["HF eager"] = lambda a, b: hf_eager(a, b, cos, sin, sec)
            contenders["HF + torch.compile"] = lambda a, b: compiled(a, b, cos, sin, sec)
            try:
                from liger_kernel.ops.qwen2vl_mrope import LigerQwen2VLMRopeFunction

                contenders["Liger (Triton)"] = lambda a, b: LigerQwen2VLMRopeFunction.apply(a, b, cos, sin, sec, 1)
            except Exception as exc:  # noqa: BLE001 - report, don't fail the run
                print(f"liger-kernel unavailable: {exc}")
        for name, fn in {**contenders, **inplace}.items():
            t = time_contender(fn, q, k, gq, gk, backward=name in contenders)
            base = base or t  # sptr bf16, the first row
            us = lambda ms: f"{ms * 1e3:.1f}" if ms == ms else "-"  # noqa: E731
            share = lambda ms, n: f"{100 * n * floor / ms:.0f}%" if ms == ms else "-"  # noqa: E731
            ratio = lambda ms, ref: f"{ms / ref:.2f}x" if ms == ms else "-"  # noqa: E731
            rows.append([str(dt).removeprefix("torch."), name, us(t[0]), us(t[1]), share(t[1], 1), ratio(t[1], base[1]),
                         us(t[2]), us(t[3]), share(t[3], 2), ratio(t[3], base[3])])
        rows.append([str(dt).removeprefix("torch."), "HBM floor", "", f"{floor * 1e3:.1f}", "100%", "", "",
                     f"{2 * floor * 1e3:.1f}", "100%", ""])
    return rows


def backward_rows():
    """The backward kernel alone (the op autograd calls), graph time: issue 28's mRoPE backward target, which a
    difference of the forward+backward and forward columns only estimates. The gradients are dense [B, S, H, D]
    tensors, as autograd hands them over."""
    sec, rows = [16, 24, 24], []
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        q, k, cos, sin = rope_inputs(dt)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        floor = floor_ms(q, k, cos)
        g = graph_ms(lambda: torch.ops.sptr.mrope_bwd(gq, gk, cos, sin, sec, True, None), calls=10)
        rows.append([str(dt).removeprefix("torch."), f"{g * 1e3:.1f}", f"{floor * 1e3:.1f}", f"{100 * floor / g:.0f}%"])
    return rows


def in_place_by_copy(q, k, cos, sin, sec):
    """apply_rotary_'s form for views it cannot record on their base (slices of a fused qkv output; before
    `mrope_rebased_`, every view): the rotation out of place, copied in with `copy_` (and CopySlices in the
    backward)."""
    saved = rope._covering_base
    rope._covering_base = lambda x: None
    try:
        return rope.apply_rotary_(q, k, cos, sin, sec)
    finally:
        rope._covering_base = saved


def attention_rows():
    """As in Qwen2.5-VL's text attention: q and k are the [B, H, S, D] views of their own projections' outputs,
    fresh each step (here a clone of a leaf, timed alone in the first row and subtracted), so in-place rotations
    (sptr's `apply_rotary_`, Liger's kernel) are legal. Forward+backward, bf16, with the rotation's gradient
    either the user's tensors (autograd.grad's grad_outputs: Liger's backward overwrites them, sptr's copies
    them into new ones) or, as in a model, the fresh output of the next op's backward (here a scale by 1, also in
    the first row), which sptr's backward then also rotates in place (not where a hook holds it: the A/B row)."""
    sec, B, S, D = [16, 24, 24], 8, 768, 128
    q, k, cos, sin = rope_inputs(torch.bfloat16)
    xq = torch.randn(B, S, q.shape[1], D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xk = torch.randn(B, S, k.shape[1], D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    kept = [None]

    def keeping(a, b):  # the A/B of sptr's in-place backward: a hook holds the gradient, which is then not overwritten
        out = rope.apply_rotary(a, b, cos, sin, sec)
        if out[0].requires_grad:
            out[0].register_hook(lambda g: kept.__setitem__(0, g))
        return out
    contenders = {"clone only (the projections' outputs)": lambda a, b: (a, b),
                  "sptr apply_rotary": lambda a, b: rope.apply_rotary(a, b, cos, sin, sec),
                  "sptr apply_rotary, a hook holds the gradient": keeping,
                  "sptr apply_rotary_ (in place)": lambda a, b: rope.apply_rotary_(a, b, cos, sin, sec),
                  "sptr apply_rotary_, copy_ form": lambda a, b: in_place_by_copy(a, b, cos, sin, sec)}
    try:
        from liger_kernel.ops.qwen2vl_mrope import LigerQwen2VLMRopeFunction

        contenders["Liger (Triton, in place)"] = lambda a, b: LigerQwen2VLMRopeFunction.apply(a, b, cos, sin, sec, 1)
    except Exception as exc:  # noqa: BLE001 - report, don't fail the run
        print(f"liger-kernel unavailable: {exc}")
    times = {}
    for name, fn in contenders.items():
        def users(fn=fn):
            out = fn(xq.clone().transpose(1, 2), xk.clone().transpose(1, 2))
            return torch.autograd.grad(out, (xq, xk), (gq, gk))

        def next_op(fn=fn):
            out = fn(xq.clone().transpose(1, 2), xk.clone().transpose(1, 2))
            return torch.autograd.grad((out[0] * 1.0, out[1] * 1.0), (xq, xk), (gq, gk))
        times[name] = [time_ms(users), graph_ms(users, calls=10), time_ms(next_op), graph_ms(next_op, calls=10)]
    clone = times["clone only (the projections' outputs)"]
    liger = times.get("Liger (Triton, in place)", [float("nan")] * 4)
    rows = []
    for name, t in times.items():
        row = [name]
        for i in (0, 2):
            own, ref = t[i + 1] - clone[i + 1], liger[i + 1] - clone[i + 1]
            row += [f"{t[i] * 1e3:.1f}", f"{t[i + 1] * 1e3:.1f}", f"{own * 1e3:.1f}" if own > 0 else "",
                    f"{own / ref:.2f}x" if own > 0 and ref == ref else ""]
        rows.append(row)
    return rows


def index_inputs():
    dev = "cuda"
    grids = torch.tensor([[1, 18, 18]] * 24, device=dev)
    tokens = []
    for _ in range(8):  # 8 rows of 768 tokens, 3 images of 9x9 merged tokens each
        row = []
        for _ in range(3):
            row += [1000] * 150 + [151652] + [151655] * 81 + [151653]
        tokens.append(row + [1000] * (768 - len(row)))
    inv = 1.0 / 10000 ** (torch.arange(0, 40, 2, device=dev).float() / 40)
    return torch.tensor(tokens, device=dev), grids, inv, int(grids.prod(1).sum())


def index_rows():
    ids, grids, inv, n = index_inputs()
    mask = torch.ones_like(ids)
    mask[:, -64:] = 0  # a padded batch: the rows' last 64 tokens (text) masked
    ours = {
        "get_rope_index": lambda: vision_index.get_rope_index(ids, grids, None, None, None, 2, 151655, 151656,
                                                              151652, 2),
        "get_rope_index, masked": lambda: vision_index.get_rope_index(ids, grids, None, None, mask, 2, 151655,
                                                                      151656, 151652, 2),
        "rot_pos_emb": lambda: vision_index.rot_pos_emb(inv, grids, 2, num_tokens=n),
        "get_window_index": lambda: vision_index.get_window_index(grids, 2, 4, 14, 4, num_tokens=n),
    }
    checked = {  # the default call: data checks on, and without num_tokens the sizes are read from the grid
        "get_rope_index": ours["get_rope_index"],
        "get_rope_index, masked": ours["get_rope_index, masked"],
        "rot_pos_emb": lambda: vision_index.rot_pos_emb(inv, grids, 2),
        "get_window_index": lambda: vision_index.get_window_index(grids, 2, 4, 14, 4),
    }
    theirs = {}
    if hf:
        theirs = {
            "get_rope_index": lambda: hf.rope_index(ids, grids, None, None, None),
            "get_rope_index, masked": lambda: hf.rope_index(ids, grids, None, None, mask),
            "rot_pos_emb": lambda: hf.rot_pos_emb(grids),
            "get_window_index": lambda: hf.window_index(grids),
        }
    rows = []
    for name, fn in ours.items():
        with data_checks(False):
            t, g = time_ms(fn), graph_ms(fn, calls=10)
        t_checked = time_ms(checked[name])
        ref = time_ms(theirs[name], 1, 5) if name in theirs else float("nan")
        rows.append([name, f"{t * 1e3:.1f}", f"{g * 1e3:.1f}", f"{t_checked * 1e3:.1f}", f"{ref * 1e3:.0f}",
                     f"{ref / t:.0f}x"])
    return rows


def tiny_qwen(attn="sdpa"):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        vocab_size=151700, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        max_position_embeddings=4096,
        vision_config={"depth": 4, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
                       "out_hidden_size": 1024, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "window_size": 112, "fullatt_block_indexes": [3], "tokens_per_second": 2, "in_chans": 3},
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        attn_implementation=attn)
    return Qwen2_5_VLForConditionalGeneration(cfg).cuda().to(torch.bfloat16).train()


def step_rows():
    from sptr.integrations import qwen2_5_vl

    ids, grids, _, n = index_inputs()
    pixels = torch.randn(n, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, image_grid_thw=grids,
                 labels=ids)
    model = tiny_qwen()

    def step():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    rows = []
    plain = time_ms(step, 3, 10)
    qwen2_5_vl.apply_to(model)
    try:
        patched = time_ms(step, 3, 10)
    finally:
        qwen2_5_vl.restore(model)
    rows.append(["transformers 4.49 (sdpa)", f"{plain:.2f}", "1.00x"])
    rows.append(["+ sptr apply_to", f"{patched:.2f}", f"{plain / patched:.2f}x"])
    rows.append(["saved per step", f"{plain - patched:.2f}", ""])
    return rows


def main():
    warm_up_gpu()
    print("mRoPE, q [8,16,768,128] k [8,2,768,128] (views of a fused qkv), cos/sin in q's dtype; "
          "eager = CUDA events around the Python call, graph = CUDA-graph replay (GPU time); "
          "% = HBM floor / time at 4.3 TB/s (fwd+bwd: twice the bytes); vs = against sptr bf16 graph time")
    print(table(rope_rows(), ["dtype", "rope", "fwd eager us", "fwd graph us", "fwd % floor", "fwd vs sptr",
                              "fwd+bwd eager us", "fwd+bwd graph us", "fwd+bwd % floor", "fwd+bwd vs sptr"]))
    print()
    print("mRoPE in the attention (forward+backward): q, k the [B,H,S,D] views of fresh projection outputs, "
          "bf16; the rotation's gradient: the user's tensors, or the next op's fresh output (as in a model); "
          "'rope us' = graph time minus the clone row's")
    print(table(attention_rows(), ["rope", "user's grad: eager us", "graph us", "rope us", "vs Liger",
                                   "next op's grad: eager us", "graph us", "rope us", "vs Liger"]))
    print()
    print("mRoPE backward alone (sptr.mrope_bwd, the op autograd runs), same shapes, gradients dense")
    print(table(backward_rows(), ["dtype", "bwd graph us", "HBM floor us", "% floor"]))
    print()
    print("index functions, 24 images [1,18,18], B = 8 x 768 tokens (masked: with an attention mask whose last 64 "
          "tokens per row are 0); sptr with num_tokens and data_checks(False); 'checked' = the default call (data "
          "checks on, no num_tokens: host syncs)")
    print(table(index_rows(), ["index function", "sptr eager us", "sptr graph us", "sptr checked eager us",
                               "HF 4.49 us", "speedup (eager)"]))
    if hf:
        print()
        print("Qwen2.5-VL training step (random weights, hidden 1024, 4 layers, 8/2 heads of 128, vision depth 4), "
              "bf16, B = 8 x 768 tokens with 24 images: forward + backward, ms")
        print(table(step_rows(), ["model", "step ms", "speedup"]))


if __name__ == "__main__":
    main()
