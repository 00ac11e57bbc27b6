"""Main demo: a SphereFormer-style network on a synthetic LiDAR scan.

Builds the net from configs/sphereformer_semantickitti.yaml, fine-tunes a few steps under autocast (fp16 with
GradScaler on CUDA, bf16 on CPU), saves a DDP-style checkpoint (``module.`` keys) as safetensors and loads it
back into an unwrapped model, checking that the outputs are identical.
"""
import os
import tempfile
import time

import torch

from safetensors.torch import save_file

from sptr.data import lidar_voxels
from sptr.models.sphereformer import SphereFormerNet, SphereFormerNetConfig, load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(voxels=20_000, steps=3):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = SphereFormerNetConfig.from_yaml(os.path.join(ROOT, "configs", "sphereformer_semantickitti.yaml"), "net")
    model = SphereFormerNet(cfg).to(device)
    xyz, batch = lidar_voxels(voxels // 2, batch=2)
    xyz, batch = xyz.to(device), batch.to(device)
    feats = torch.cat([xyz, xyz.norm(dim=1, keepdim=True)], 1)
    labels = torch.randint(0, cfg.num_classes, (xyz.shape[0],), device=device)
    print(f"{xyz.shape[0]} voxels in 2 scans, {sum(p.numel() for p in model.parameters())} parameters, {device}")

    amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
    # SphereFormer trains its transformer blocks at 0.1x the learning rate (names contain "transformer_block").
    groups = [{"params": [p for n, p in model.named_parameters() if "transformer_block" in n], "lr": 1e-4},
              {"params": [p for n, p in model.named_parameters() if "transformer_block" not in n], "lr": 1e-3}]
    opt = torch.optim.AdamW(groups)
    for step in range(steps):
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=amp_dtype):
            loss = torch.nn.functional.cross_entropy(model(feats, xyz, batch), labels)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step}: loss {loss.item():.4f} ({(time.perf_counter() - t0) * 1e3:.0f} ms)")

    model.eval()
    with torch.no_grad():
        before = model(feats, xyz, batch)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.safetensors")
        save_file({f"module.{k}": v.contiguous() for k, v in model.state_dict().items()}, path)  # as DDP saves it
        restored = SphereFormerNet(cfg).to(device).eval()
        load_checkpoint(restored, path)
    with torch.no_grad():
        after = restored(feats, xyz, batch)
    assert torch.equal(before, after), "checkpoint round trip changed the outputs"
    print("checkpoint round trip (module. prefix stripped): outputs identical")


if __name__ == "__main__":
    main()
