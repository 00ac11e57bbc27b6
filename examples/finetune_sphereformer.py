"""Fine-tune the SphereFormer U-Net on synthetic scans, as SphereFormer trains.

AdamW with the transformer blocks at ``transformer_lr_scale`` (0.1) of the learning rate, SphereFormer's
training voxelisation (one random point per voxel, random shift of the voxel grid), autocast (fp16 with a
GradScaler, or bf16) with the attention in ``attention_dtype`` (float32 by default, SphereFormer's rule), a tqdm
bar with loss and points/s, a checkpoint every ``--save-every`` steps and at the end, ``--resume``.

    python examples/finetune_sphereformer.py [--checkpoint released.pth] [--steps 6] [--amp bf16]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from tqdm import tqdm

from sptr.data import lidar_scan
from sptr.models.sphereformer import (SphereFormerUNet, mixed_precision, resume_training_state, save_training_state,
                                      training_batch)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "sphereformer_semantickitti.yaml"))
    parser.add_argument("--checkpoint", help="released or saved weights to start from (random init if omitted)")
    parser.add_argument("--resume", help="a checkpoint written by this script: weights, optimizer, step")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--points", type=int, default=2500, help="points per synthetic scan")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.006)
    parser.add_argument("--weight-decay", type=float, default=0.02)
    parser.add_argument("--amp", choices=["fp16", "bf16", "none"], help="default: fp16 on CUDA; on CPU bf16 where the CPU has native bf16 (AVX512-BF16 / AMX), else none (fp32)")
    parser.add_argument("--attention-dtype", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--output", default="sphereformer_finetune.pth")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    overrides = {"attention_dtype": args.attention_dtype} if args.attention_dtype else {}
    model = SphereFormerUNet.from_yaml(args.config, args.checkpoint, **overrides).to(args.device).train()
    cfg = model.cfg
    optimizer = torch.optim.AdamW(model.param_groups(args.lr, args.weight_decay), lr=args.lr)
    device_type = torch.device(args.device).type
    amp, amp_dtype, scaler = mixed_precision(args.amp, device_type)
    start = resume_training_state(args.resume, model, optimizer, scaler) if args.resume else 0

    # A fixed pool of synthetic scans (labels: road, building, car), cycled; each step re-voxelises randomly.
    pool = [lidar_scan(args.points, seed=s) for s in range(4 * args.batch_size)]
    generator = torch.Generator().manual_seed(start)
    losses = []
    bar = tqdm(range(start, start + args.steps), desc="fine-tune", unit="step", initial=start,
               total=start + args.steps)
    for step in bar:
        scans = [pool[(step * args.batch_size + i) % len(pool)] for i in range(args.batch_size)]
        x, xyz, batch, labels = training_batch(cfg, scans, generator, args.device)
        tic = time.perf_counter()
        with torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x, xyz, batch), labels, ignore_index=cfg.ignore_label)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", points_per_s=f"{labels.numel() / (time.perf_counter() - tic):,.0f}")
        if args.save_every and (step + 1) % args.save_every == 0:
            save_training_state(args.output, model, optimizer, scaler, step + 1)
    save_training_state(args.output, model, optimizer, scaler, start + args.steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps ({amp}, attention "
          f"{cfg.attention_dtype}); checkpoint {args.output}")
    return losses


if __name__ == "__main__":
    main()
