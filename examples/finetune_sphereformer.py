"""Fine-tune the SphereFormer U-Net as SphereFormer trains: on SemanticKITTI (``--data-root``) or synthetic scans.

AdamW with the transformer blocks at ``transformer_lr_scale`` (0.1) of the learning rate and SphereFormer's poly
schedule (power 0.9, per step), the class-weighted cross-entropy with its ignore index, SphereFormer's training
augmentations and voxelisation, autocast (fp16 with a GradScaler on CUDA; bf16 on CPUs with native bf16, else
fp32) with the attention in ``attention_dtype`` (float32 by default, SphereFormer's rule), a tqdm bar with loss
and points/s, validation (mIoU) every ``--val-every`` steps, and an experiment directory with ``train.log``,
``last.pth`` and ``best.pth`` (``--resume`` continues from ``last.pth``).

    python examples/finetune_sphereformer.py [--data-root KITTI] [--checkpoint released.pth] [--steps 6]
"""
from __future__ import annotations

import argparse
import itertools
import os
import time

import torch
from tqdm import tqdm

from sptr.data import SegmentationMetrics, SemanticKITTI, collate_samples, lidar_scan
from sptr.models.sphereformer import (SphereFormerUNet, batch_inputs, mixed_precision, predict_scans,
                                      resume_training_state, training_batch)
from sptr.models.sphereformer.evaluate import evaluate
from sptr.models.sphereformer.recipe import Experiment, class_weights, poly_schedule, segmentation_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kitti_batches(root, cfg, batch_size, workers, device):
    """Endless (SparseConvTensor, xyz, batch, labels) batches of SemanticKITTI's train split, reshuffled per epoch."""
    data = SemanticKITTI.from_config(root, cfg, "train")
    for epoch in itertools.count():
        data.epoch = epoch
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=workers,
                                             collate_fn=collate_samples, drop_last=len(data) >= batch_size,
                                             generator=torch.Generator().manual_seed(epoch))
        for b in loader:
            yield batch_inputs(b, device)


def synthetic_batches(cfg, pool, batch_size, generator, device, start):
    for step in itertools.count(start):
        scans = [pool[(step * batch_size + i) % len(pool)] for i in range(batch_size)]
        yield training_batch(cfg, scans, generator, device)


def validate(model, args, held_out) -> float:
    """mIoU on SemanticKITTI's val split, or on held-out synthetic scans."""
    was_training = model.training
    model.eval()
    if args.data_root:
        metrics = evaluate(model, SemanticKITTI.from_config(args.data_root, model.cfg, "val", train=False),
                           progress=False)
    else:
        metrics = SegmentationMetrics(model.cfg.num_classes, model.cfg.ignore_label)
        for (points, labels), pred in zip(held_out, predict_scans(model, [p for p, _ in held_out])):
            metrics.update(pred.cpu(), labels)
    model.train(was_training)
    return metrics.miou()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "sphereformer_semantickitti.yaml"))
    parser.add_argument("--checkpoint", help="released or saved weights to start from (random init if omitted)")
    parser.add_argument("--data-root", help="SemanticKITTI (the folder holding sequences/); synthetic scans if omitted")
    parser.add_argument("--experiment", default="runs/finetune_sphereformer", help="train.log, last.pth, best.pth")
    parser.add_argument("--resume", action="store_true", help="continue from the experiment's last.pth")
    parser.add_argument("--overwrite", action="store_true", help="reuse an experiment directory of another run")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--val-every", type=int, default=0, help="validate and save every N steps (0: at the end)")
    parser.add_argument("--points", type=int, default=2500, help="points per synthetic scan")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers (with --data-root)")
    parser.add_argument("--lr", type=float, default=0.006)
    parser.add_argument("--weight-decay", type=float, default=0.02)
    parser.add_argument("--class-weight", choices=["auto", "semantickitti", "none"], default="auto",
                        help="SphereFormer's class weights (auto: with --data-root)")
    parser.add_argument("--amp", choices=["fp16", "bf16", "none"],
                        help="default: fp16 on CUDA; bf16 on CPUs with native bf16 (AVX512-BF16 / AMX), else none")
    parser.add_argument("--attention-dtype", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    experiment = Experiment(args.experiment, resume=args.resume, overwrite=args.overwrite)
    overrides = {"attention_dtype": args.attention_dtype} if args.attention_dtype else {}
    model = SphereFormerUNet.from_yaml(args.config, args.checkpoint, **overrides).to(args.device).train()
    cfg = model.cfg
    optimizer = torch.optim.AdamW(model.param_groups(args.lr, args.weight_decay), lr=args.lr)
    device_type = torch.device(args.device).type
    amp, amp_dtype, scaler = mixed_precision(args.amp, device_type)
    start = 0
    if args.resume:
        start = int(torch.load(experiment.last, map_location="cpu", weights_only=True)["step"])
    scheduler = poly_schedule(optimizer, start + args.steps)
    if args.resume:
        resume_training_state(experiment.last, model, optimizer, scaler, scheduler)
    weighted = args.class_weight == "semantickitti" or (args.class_weight == "auto" and args.data_root)
    weight = class_weights("semantickitti").to(args.device) if weighted else None
    criterion = segmentation_loss(cfg.num_classes, cfg.ignore_label, weight)
    if args.data_root:
        batches = kitti_batches(args.data_root, cfg, args.batch_size, args.workers, args.device)
        held_out = None
    else:  # a fixed pool of synthetic scans (road, building, car), cycled; each step re-voxelises randomly
        pool = [lidar_scan(args.points, seed=s) for s in range(4 * args.batch_size)]
        held_out = [lidar_scan(args.points, seed=1000 + s) for s in range(2)]
        batches = synthetic_batches(cfg, pool, args.batch_size, torch.Generator().manual_seed(start), args.device,
                                    start)
    experiment.log(f"start at step {start}: {args.steps} steps, amp {amp}, attention {cfg.attention_dtype}, "
                   f"data {args.data_root or 'synthetic'}, class weights {'on' if weighted else 'off'}")
    losses = []
    bar = tqdm(range(start, start + args.steps), desc="fine-tune", unit="step", initial=start,
               total=start + args.steps)
    for step in bar:
        x, xyz, batch, labels = next(batches)
        tic = time.perf_counter()
        with torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = criterion(model(x, xyz, batch).float(), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", points_per_s=f"{labels.numel() / (time.perf_counter() - tic):,.0f}")
        experiment.log(f"step {step + 1}: loss {losses[-1]:.4f}, lr {scheduler.get_last_lr()[0]:.3g}")
        last = step + 1 == start + args.steps
        if last or (args.val_every and (step + 1) % args.val_every == 0):
            miou = validate(model, args, held_out)
            experiment.log(f"step {step + 1}: val mIoU {miou:.4f}")
            experiment.save(model, optimizer, scaler, step + 1, scheduler, score=miou)
    experiment.close()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps ({amp}, attention "
          f"{cfg.attention_dtype}); best mIoU {experiment.best_score:.3f}; {experiment.last}")
    return losses


if __name__ == "__main__":
    main()
