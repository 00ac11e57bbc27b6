"""A training step of a Wall-X-style dual-expert Qwen2.5-VL (issue 29), three ways in one run:

1. sptr: ``sptr.models.qwen2_5_vl_moe`` (DualExpertFFN per decoder layer, sptr's mRoPE and index ops), with
   cuBLAS per expert after one offsets read per layer (``gemm="cublas"``, the model's default: bit-exact to the
   plain model) and with the sync-free grouped GEMM (``gemm="grouped"``, what the layers' ``auto`` runs on
   Hopper builds with the CUTLASS kernels, under torch.compile and in CUDA graphs);
2. the Wall-X way in plain PyTorch: the same model with transformers' own mRoPE and index functions and each
   layer's experts as a Python loop over the token masks (what Wall-X's SparseMoeBlock computes);
3. the Wall-X way + Liger's kernels where they apply (``apply_liger_kernel_to_qwen2_5_vl``: RMSNorm, mRoPE,
   fused linear cross-entropy), if liger-kernel is installed.

Each step: forward with labels, backward, AdamW step, bf16 autocast, images and ~15 % action tokens per row.
Reported: median ms per step (the models resident together, taking turns: ``--rounds`` turns of ``--repeat``
steps each, every turn's median shown; Liger's model after the others, alone, since its patches reach past its
model), peak memory above the resident model (CUDA), tokens/s.

With ``--fsdp`` under torchrun, the sptr model alone, sharded with FSDP2 as Wall-X shards it (each decoder layer,
then the root), every rank on its own batch: ms per step (the slowest rank), tokens/s of all ranks together, and
per GPU the peak memory and the resident (sharded) model and optimizer state; run it with 1 and 2 processes.

    python benchmarks/bench_wallx_qwen.py [--hidden 1024] [--layers 4] [--batch 8] [--seq 768]
    python benchmarks/bench_wallx_qwen.py --tiny --device cpu   # a smoke run
    torchrun --nproc_per_node 2 benchmarks/bench_wallx_qwen.py --fsdp [--hidden 2048 --layers 8]
"""
import argparse
import os
import sys
import time
from statistics import median

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table  # noqa: E402

from sptr.integrations import qwen2_5_vl  # noqa: E402
from sptr.models import qwen2_5_vl_moe as wx  # noqa: E402

IMG, VS, VE, ACTION = 151655, 151652, 151653, 151666


def transformers_major():
    import transformers

    return int(transformers.__version__.split(".")[0])


def config(args):
    """The config in the form of the installed transformers: 4.x takes the text fields at the top level and
    ``rope_scaling``; 5.x takes them in ``text_config`` with ``rope_parameters``."""
    from transformers import Qwen2_5_VLConfig

    heads = max(2, args.hidden // 128)
    half = args.hidden // heads // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]  # 128: [16, 24, 24]
    text = dict(vocab_size=151700, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 2,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                max_position_embeddings=4096)
    vision = {"depth": args.vision_depth, "hidden_size": args.vision_hidden, "intermediate_size":
              args.vision_hidden * 4, "num_heads": max(2, args.vision_hidden // 80), "out_hidden_size": args.hidden,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
              "fullatt_block_indexes": [args.vision_depth - 1], "tokens_per_second": 2, "in_chans": 3}
    ids = dict(image_token_id=IMG, video_token_id=151656, vision_start_token_id=VS, vision_end_token_id=VE)
    if transformers_major() >= 5:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section}
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        cfg._attn_implementation = args.attn
        return cfg
    return Qwen2_5_VLConfig(**text, rope_scaling={"type": "mrope", "mrope_section": section},
                            vision_config=vision, attn_implementation=args.attn, **ids)


def batch(args, device, seed=0):
    """Rows of text, one image of grid (1, h, w) and a chunk of action tokens (~15 % of the row) at the end."""
    g = torch.Generator().manual_seed(seed)
    h, w = args.grid
    merged = h * w // 4
    actions = max(1, int(0.15 * args.seq))
    text = args.seq - merged - actions - 2
    if text < 2:
        raise ValueError(f"--seq {args.seq} is too short for {merged} image tokens and {actions} action tokens")
    rows = []
    for _ in range(args.batch):
        words = torch.randint(100, 50000, (text,), generator=g).tolist()
        rows.append(words[:text // 2] + [VS] + [IMG] * merged + [VE] + words[text // 2:] + [ACTION] * actions)
    ids = torch.tensor(rows, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
            "image_grid_thw": torch.tensor([[1, h, w]] * args.batch, device=device),
            "pixel_values": torch.randn(args.batch * h * w, 3 * 2 * 14 * 14, generator=g).to(device),
            "moe_token_types": (ids == ACTION).long(), **image_token_types(ids)}


def image_token_types(ids):
    """transformers 5.x takes the image tokens' positions as ``mm_token_type_ids`` (1 = image)."""
    return {"mm_token_type_ids": (ids == IMG).int()} if transformers_major() >= 5 else {}


class LoopMLP:
    """Wall-X's SparseMoeBlock: a Python loop over the experts with boolean token masks."""

    def __init__(self, layer, model):
        self.layer, self.model = layer, model

    def __call__(self, hidden):
        types = self.model._token_types.value
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self.layer.moe.experts):
            rows = types == e
            out[rows] = expert(hidden[rows]).to(out.dtype)
        return out


def build(kind, cfg, args, device):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    plain = Qwen2_5_VLForConditionalGeneration(cfg)
    gemm = "grouped" if kind == "sptr, grouped (no sync)" else "cublas"
    model = wx.from_qwen2_5_vl(plain, wx.DualExpertQwenConfig(action_intermediate=args.hidden, gemm=gemm,
                                                              action_token_id=ACTION))
    if kind.startswith("wall-x"):
        qwen2_5_vl.restore(model)
        for layer in wx.decoder_layers(model):
            layer.mlp = LoopMLP(layer, model)
    if kind == "wall-x + liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2_5_vl
        apply_liger_kernel_to_qwen2_5_vl(model=model)
    return model.to(device).train()


def trainer(model, inputs, device):
    """One training step of the model: forward with labels under bf16 autocast, backward, AdamW, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def peak_of(step, device):
    """(peak MiB of one step above what was allocated before it, that allocation in MiB): CUDA only."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20, base / 2**20


def timed(step, n, device):
    """Wall-clock ms of each of n steps (each waits for the GPU)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def warmed(model, inputs, args, device):
    """(the model's training step after --warmup steps, peak MiB of one more step above the resident model,
    resident MiB: the model, its optimizer state)."""
    step = trainer(model, inputs, device)
    for _ in range(args.warmup):
        step()
    return (step, *peak_of(step, device))


def measure(model, inputs, args, device):
    """(median ms per step, peak MiB above the resident model, resident MiB)."""
    step, peak, resident = warmed(model, inputs, args, device)
    return median(timed(step, args.repeat * args.rounds, device)), peak, resident


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vision-depth", type=int, default=4)
    ap.add_argument("--vision-hidden", type=int, default=640)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=768)
    ap.add_argument("--grid", type=int, nargs=2, default=(16, 16), help="patches of each row's image")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=4, help="steps per model and round")
    ap.add_argument("--rounds", type=int, default=3, help="turns each model takes, in the same order")
    ap.add_argument("--tiny", action="store_true", help="a smoke-sized model and batch")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 under torchrun (the sptr model only)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.vision_depth, args.vision_hidden = 64, 2, 2, 32
        args.batch, args.seq, args.grid, args.warmup, args.repeat, args.rounds = 2, 64, (4, 8), 1, 2, 2
    if args.fsdp:
        return fsdp_main(args)
    device = torch.device(args.device)
    cfg = config(args)
    inputs = batch(args, device)
    tokens = inputs["input_ids"].numel()
    # The models stay resident and take turns, `--rounds` times `--repeat` steps each, so that a drift of the
    # machine (clocks, a neighbour) falls on all of them alike; the median is over all their steps. Liger's
    # patches reach past its model (it replaces transformers' module-level mRoPE function, which the Wall-X
    # loop model calls too), so its model is built and timed after the others: its row takes its turns alone.
    times, peaks = {}, {}

    def load(kind):
        try:
            model = build(kind, cfg, args, device)
        except ImportError as exc:
            print(f"{kind}: unavailable ({exc})")
            return None
        step, peaks[kind], _ = warmed(model, inputs, args, device)
        times[kind] = []
        return step

    for group in (("sptr", "sptr, grouped (no sync)", "wall-x loop"), ("wall-x + liger",)):
        steps = {kind: step for kind in group if (step := load(kind)) is not None}
        for _ in range(args.rounds):
            for kind, step in steps.items():
                times[kind].append(timed(step, args.repeat, device))
        del steps
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows, base = [], None
    for kind, rounds in times.items():
        ms = median([t for r in rounds for t in r])
        base = base or ms
        spread = ", ".join(f"{median(r):.1f}" for r in rounds)
        rows.append([kind, f"{ms:.1f}", f"{ms / base:.2f}x", spread, f"{tokens / ms * 1e3:,.0f}", f"{peaks[kind]:.0f}"])
    print(f"\nhidden {args.hidden}, {args.layers} layers, vision depth {args.vision_depth}, batch {args.batch} x "
          f"{args.seq} tokens (~15 % action), bf16 autocast, {args.attn}, {device.type}")
    print(table(rows, ["impl", "ms / step", "vs sptr", "rounds' medians", "tokens/s", "peak MiB"]))
    return rows


def fsdp_main(args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sptr.integrations.distributed import end_process_group, init_from_torchrun

    rank, world, device = init_from_torchrun()
    cfg = config(args)
    inputs = batch(args, device, seed=rank)
    model = build("sptr", cfg, args, device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in wx.decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ms, peak, resident = measure(model, inputs, args, device)
    slowest = torch.tensor([ms, peak + resident, resident], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    ms, peak_total, resident = slowest.tolist()
    tokens = world * inputs["input_ids"].numel()
    row = [f"FSDP2 x{world}", f"{ms:.1f}", f"{tokens / ms * 1e3:,.0f}", f"{peak_total:.0f}", f"{resident:.0f}"]
    if rank == 0:
        print(f"hidden {args.hidden}, {args.layers} layers, vision depth {args.vision_depth}, per rank batch "
              f"{args.batch} x {args.seq} tokens (~15 % action), bf16 autocast, {args.attn}, {device.type}")
        print(table([row], ["sptr model", "ms / step", "tokens/s (all ranks)", "peak MiB per GPU",
                            "resident MiB per GPU"]))
    del model
    end_process_group()
    return row


if __name__ == "__main__":
    main()
