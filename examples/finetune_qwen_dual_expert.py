"""Fine-tune a Wall-X-style dual-expert Qwen2.5-VL on a synthetic vision-language-action batch.

A tiny random Qwen2.5-VL (or ``--model-dir``: a plain Qwen2.5-VL ``from_pretrained`` directory) becomes the
dual-expert model (its MLPs expert 0, a new action expert 1); each batch holds an image and ``<|action|>`` tokens
routed to expert 1. AdamW with the action expert at its own learning rate, ``--freeze-vlm`` (only expert 1
trains, as Wall-X's ``freeze_vlm``), autocast (bf16 on CUDA and on CPUs with native bf16, else fp32), a tqdm bar
with loss and tokens/s, safetensors checkpoints in Wall-X's format and ``--resume``.

    python examples/finetune_qwen_dual_expert.py [--steps 8] [--freeze-vlm] [--output runs/qwen_dual]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from tqdm import tqdm

from sptr.amp import mixed_precision
from sptr.integrations import qwen2_5_vl
from sptr.models import qwen2_5_vl_moe as wx

IMG, VS, VE, ACTION = 151655, 151652, 151653, 151666  # the Qwen2.5-VL vision ids; ACTION: the <|action|> id


def tiny_qwen():
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(qwen2_5_vl.tiny_config())


def synthetic_batch(batch_size: int, actions: int, generator: torch.Generator, device):
    """Text, one 4x8-patch image, text, then ``actions`` action tokens, per row; labels are the next tokens."""
    grid = torch.tensor([[1, 4, 8]] * batch_size)
    rows = []
    for _ in range(batch_size):
        text = torch.randint(100, 1000, (6,), generator=generator).tolist()
        rows.append(text[:3] + [VS] + [IMG] * 8 + [VE] + text[3:] + [ACTION] * actions)
    ids = torch.tensor(rows)
    pixels = torch.randn(batch_size * 32, 3 * 2 * 14 * 14, generator=generator)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "pixel_values": pixels.to(device), "image_grid_thw": grid.to(device), "labels": ids.to(device)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir",
                        help="a plain Qwen2.5-VL from_pretrained directory (a tiny random one if omitted)")
    parser.add_argument("--action-intermediate", type=int, default=32, help="the action expert's width")
    parser.add_argument("--output", default="runs/qwen_dual_expert", help="checkpoint directory (Wall-X format)")
    parser.add_argument("--resume", action="store_true", help="continue from --output's checkpoint")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--actions", type=int, default=8, help="action tokens per row")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--action-lr", type=float, default=1e-3, help="the action expert's learning rate")
    parser.add_argument("--freeze-vlm", action="store_true", help="train only the action expert (Wall-X freeze_vlm)")
    parser.add_argument("--amp", choices=["bf16", "none"], help="default: bf16 on CUDA and on CPUs with native bf16")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = torch.device(args.device)
    moe_cfg = wx.DualExpertQwenConfig(action_intermediate=args.action_intermediate, action_token_id=ACTION)
    model = wx.from_qwen2_5_vl(args.model_dir or tiny_qwen(), moe_cfg).to(device).train()
    state_path = os.path.join(args.output, "trainer_state.pt")
    if args.resume:
        if not os.path.isfile(state_path):
            raise FileNotFoundError(f"--resume: {state_path!r} is missing")
        others = wx.load_wallx(model, args.output)
        if others:
            raise ValueError(f"{args.output!r} holds keys this model does not own: {sorted(others)[:5]}")
    elif os.path.exists(state_path):
        raise FileExistsError(f"{args.output!r} holds a previous run; pass --resume or another --output")
    action = [p for n, p in model.named_parameters() if ".moe.experts.1." in n]
    rest = [p for n, p in model.named_parameters() if ".moe.experts.1." not in n]
    if args.freeze_vlm:
        for p in rest:
            p.requires_grad_(False)
    groups = [{"params": action, "lr": args.action_lr}] + ([] if args.freeze_vlm else [{"params": rest, "lr": args.lr}])
    optimizer = torch.optim.AdamW(groups, weight_decay=0.01)
    amp, amp_dtype, _ = mixed_precision("bf16" if args.amp is None and device.type == "cuda" else args.amp, device.type)
    start = 0
    if args.resume:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    losses = []
    bar = tqdm(range(start, start + args.steps), desc="dual-expert", unit="step", initial=start,
               total=start + args.steps)
    for step in bar:
        batch = synthetic_batch(args.batch_size, args.actions, torch.Generator().manual_seed(step % 4), device)
        tic = time.perf_counter()
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        tokens = batch["input_ids"].numel()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tokens_per_s=f"{tokens / (time.perf_counter() - tic):,.0f}")
        if (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == start + args.steps:
            wx.save_pretrained(model, args.output)
            torch.save({"optimizer": optimizer.state_dict(), "step": step + 1}, state_path)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps ({amp}, "
          f"{'action expert only' if args.freeze_vlm else 'all weights'}); checkpoint {args.output}")
    return losses


if __name__ == "__main__":
    main()
