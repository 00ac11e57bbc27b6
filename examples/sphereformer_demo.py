"""Main demo: SphereFormer's SemanticKITTI network (spconv U-Net + SphereFormer blocks, 32.3M parameters) on
synthetic LiDAR scans.

Builds the network from configs/sphereformer_semantickitti.yaml, fine-tunes a few steps under autocast (fp16
with GradScaler on CUDA; on CPU bf16 where the CPU computes it natively, else fp32; the attention in fp32,
SphereFormer's rule) with the transformer blocks at
0.1x the learning rate, saves a DDP-style checkpoint (``module.`` keys, ``{'state_dict': ...}``), loads it back
strictly into a fresh model, checks that the logits are identical, and labels every point of a scan.
"""
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from sptr.data import collate_scans, lidar_scan, voxelize_scan
from sptr.models.sphereformer import (SphereFormerUNet, SphereFormerUNetConfig, load_pretrained, mixed_precision,
                                      predict_scans, sparse_input)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(points=3000, steps=3):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = SphereFormerUNetConfig.from_yaml(os.path.join(ROOT, "configs", "sphereformer_semantickitti.yaml"))
    model = SphereFormerUNet(cfg).to(device)
    scans = [lidar_scan(points, seed=s) for s in range(2)]
    voxels = [voxelize_scan(p.to(device), cfg.voxel_size, cfg.pc_range, mode="random", labels=label.to(device))
              for p, label in scans]
    feats, coords, xyz, batch, labels = collate_scans(voxels)
    print(f"{xyz.shape[0]} voxels in 2 scans, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(model.state_dict())} state-dict keys, {device}")

    amp, amp_dtype, scaler = mixed_precision(None, device)
    print(f"autocast: {amp}")
    opt = torch.optim.AdamW(model.param_groups(lr=0.006, weight_decay=0.02))
    for step in range(steps):
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(sparse_input(feats, coords, batch), xyz, batch), labels)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step}: loss {loss.item():.4f} ({(time.perf_counter() - t0) * 1e3:.0f} ms)")

    model.eval()
    with torch.no_grad():
        before = model(sparse_input(feats, coords, batch), xyz, batch)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model_best.pth")
        torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, path)  # as DDP saves
        restored = SphereFormerUNet(cfg).to(device).eval()
        load_pretrained(restored, path)
    with torch.no_grad():
        after = restored(sparse_input(feats, coords, batch), xyz, batch)
    assert torch.equal(before, after), "checkpoint round trip changed the logits"
    print("checkpoint round trip (module. prefix stripped, strict): logits identical")
    labels = predict_scans(restored, [scans[0][0]])[0]
    print(f"labelled {labels.numel()} points of scan 0; classes predicted: {sorted(set(labels.tolist()))}")


if __name__ == "__main__":
    main()
