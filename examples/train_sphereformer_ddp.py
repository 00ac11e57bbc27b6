"""Train the SphereFormer U-Net on several GPUs (or CPU processes) with DistributedDataParallel, as SphereFormer does.

    torchrun --nproc_per_node 2 examples/train_sphereformer_ddp.py [--steps 20] [--checkpoint released.pth]
    torchrun --nproc_per_node 2 examples/train_sphereformer_ddp.py --data-root KITTI --resume sphereformer_ddp.pth
    torchrun --nproc_per_node 2 examples/train_sphereformer_ddp.py --steps 23 --warmup 3 --losses run.json

NCCL on GPUs (one per process), gloo on CPU. SyncBatchNorm across ranks (sptr's, which is PyTorch's on CUDA and
also runs on CPU), a DistributedSampler over SemanticKITTI's train split (``--data-root``) or a pool of synthetic
scans of varying size, the loss averaged over every rank's points (not rank by rank), autocast (fp16 with a
GradScaler on CUDA; on CPU bf16 where the CPU has native bf16, else fp32), gradient clipping, a tqdm bar and
checkpoints on rank 0. On CPU the network defaults to two levels (``--small``; ``--full`` for the published five,
about four minutes a step on two cores). Checkpoints hold the DDP model's ``module.`` keys, as the
released ones, and load into a single-process model with ``load_pretrained``. A plain ``python`` run trains
in one process.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from sptr.data import SemanticKITTI, collate_samples, lidar_scan
from sptr.integrations.distributed import convert_sync_batchnorm, end_process_group, global_mean, init_from_torchrun
from sptr.models.sphereformer import (SphereFormerUNet, SphereFormerUNetConfig, batch_inputs, mixed_precision,
                                      resume_training_state, save_training_state, training_batch)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(channels=(32, 64), sphere_layers=(1, 2))  # --small: two levels, for CPU runs and tests


def scan_pool(count: int, points: int):
    """Synthetic labelled scans of 0.6x to 1.4x `points` points (ranks get different amounts of work)."""
    return [lidar_scan(int(points * (0.6 + 0.8 * i / max(count - 1, 1))), seed=i) for i in range(count)]


def build_model(args, device):
    torch.manual_seed(0)  # identical initial weights on every rank (DDP broadcasts rank 0's anyway)
    small = args.small or (device.type == "cpu" and not args.full)  # the five levels take minutes a step on CPU
    overrides = dict(SMALL) if small else {}
    if args.attention_dtype:
        overrides["attention_dtype"] = args.attention_dtype
    model = SphereFormerUNet.from_yaml(args.config, args.checkpoint, **overrides).to(device).train()
    if dist.is_initialized():  # under torchrun, DDP even in a world of one
        model = convert_sync_batchnorm(model)
        # static_graph: every parameter takes part in every step (and grad checkpointing re-enters the graph)
        model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                        static_graph=True)
    return model


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "sphereformer_semantickitti.yaml"))
    parser.add_argument("--small", action="store_true", help="two levels (C 32/64) instead of the published five "
                        "(the default on CPU)")
    parser.add_argument("--full", action="store_true", help="the published five levels also on CPU")
    parser.add_argument("--data-root", help="SemanticKITTI (the folder holding sequences/); synthetic scans if omitted")
    parser.add_argument("--checkpoint", help="released or saved weights to start from (random init if omitted)")
    parser.add_argument("--resume", help="a checkpoint written by this script: weights, optimizer, step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--scans", type=int, default=16, help="scans in the synthetic pool")
    parser.add_argument("--points", type=int, default=20000, help="mean points per synthetic scan")
    parser.add_argument("--batch-size", type=int, default=2, help="scans per rank and step")
    parser.add_argument("--lr", type=float, default=0.006)
    parser.add_argument("--weight-decay", type=float, default=0.02)
    parser.add_argument("--clip", type=float, default=10.0, help="max gradient norm (0: no clipping)")
    parser.add_argument("--amp", choices=["fp16", "bf16", "none"],
                        help="default: fp16 on CUDA; bf16 on CPUs with native bf16 (AVX512-BF16 / AMX), else none")
    parser.add_argument("--attention-dtype", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=0, help="first steps left out of the points/s figure "
                        "(cuDNN and spconv autotuning, allocator growth)")
    parser.add_argument("--losses", help="write every step's global-mean loss and the points/s here (JSON, rank 0)")
    parser.add_argument("--output", default="sphereformer_ddp.pth")
    parser.add_argument("--save-every", type=int, default=0)
    return parser.parse_args(argv)


def train(args, rank: int, world: int, device: torch.device) -> list[float]:
    """The training loop; returns the global-mean loss of each step. Its DDP model is gone when it returns."""
    model = build_model(args, device)
    net = model.module if isinstance(model, DistributedDataParallel) else model
    cfg: SphereFormerUNetConfig = net.cfg
    optimizer = torch.optim.AdamW(net.param_groups(args.lr, args.weight_decay), lr=args.lr)
    amp, amp_dtype, scaler = mixed_precision(args.amp, device.type)
    start = resume_training_state(args.resume, model, optimizer, scaler) if args.resume else 0

    if args.data_root:
        data = SemanticKITTI.from_config(args.data_root, cfg, "train", seed=rank)
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    else:
        pool = scan_pool(args.scans, args.points)
        sampler = DistributedSampler(range(len(pool)), num_replicas=world, rank=rank, shuffle=True, seed=0)
    generator = torch.Generator().manual_seed(1000 * rank + start)
    order, epoch, losses = [], 0, []
    points_seen, tic = 0.0, time.perf_counter()
    timed_from = start + min(args.warmup, max(args.steps - 1, 0))  # the first step counted in points/s
    bar = tqdm(range(start, start + args.steps), desc=f"ddp x{world}", unit="step", disable=rank != 0, initial=start,
               total=start + args.steps)
    for step in bar:
        if step == timed_from:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            points_seen, tic = 0.0, time.perf_counter()
        while len(order) < args.batch_size:  # the sampler's epochs, one after another
            sampler.set_epoch(epoch)
            order += list(sampler)
            epoch += 1
        picked, order = order[:args.batch_size], order[args.batch_size:]
        if args.data_root:
            data.epoch = epoch
            x, xyz, batch, labels = batch_inputs(collate_samples([data[i] for i in picked]), device, generator)
        else:
            x, xyz, batch, labels = training_batch(cfg, [pool[i] for i in picked], generator, device)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = model(x, xyz, batch)
        valid = labels != cfg.ignore_label
        total = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=cfg.ignore_label,
                                                  reduction="sum")
        loss = global_mean(total, valid.sum())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        # every rank's points and the global-mean loss (DDP averages the scaled per-rank losses)
        progress = torch.stack([torch.tensor(float(labels.numel()), device=device), loss.detach() / world])
        if dist.is_initialized():
            dist.all_reduce(progress)
        points, reported = progress.tolist()
        points_seen += points
        losses.append(reported)
        bar.set_postfix(loss=f"{reported:.3f}", points_per_s=f"{points_seen / (time.perf_counter() - tic):,.0f}")
        if args.save_every and (step + 1) % args.save_every == 0 and rank == 0:
            save_training_state(args.output, model, optimizer, scaler, step + 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rate = points_seen / (time.perf_counter() - tic)
    if rank == 0:
        save_training_state(args.output, model, optimizer, scaler, start + args.steps)
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump({"world": world, "losses": losses, "points_per_s": rate,
                           "timed_steps": start + args.steps - timed_from}, f)
        print(f"{world} process(es) on {device.type}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} "
              f"steps, {rate:,.0f} points/s over the last {start + args.steps - timed_from} ({amp}); "
              f"checkpoint {args.output}")
    return losses


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_from_torchrun()
    losses = train(args, rank, world, device)
    end_process_group()  # after train() has dropped the DDP model (see end_process_group)
    return losses


if __name__ == "__main__":
    main()
