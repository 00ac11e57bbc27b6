"""Swap sptr's DualExpertFFN into a plain two-expert SwiGLU block (the Wall-X MoE layer), check it computes
the same thing, fine-tune it a few steps under autocast, and round-trip its weights through safetensors.

    python examples/moe_dual_expert_demo.py [--config configs/moe.yaml] [--steps 20]

Runs on CPU in seconds at the default (small) size; on CUDA when present.
"""
import argparse
import os
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sptr.layers import DualExpertFFN, DualExpertFFNConfig  # noqa: E402
from sptr.reference.moe import PlainDualExpertFFN  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "moe.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--scale", type=int, default=16, help="divide the published widths by this (1 = full size)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    full = DualExpertFFNConfig.from_yaml(args.config, "dual_expert")
    cfg = DualExpertFFNConfig(hidden=full.hidden // args.scale,
                              intermediate=tuple(i // args.scale for i in full.intermediate))
    torch.manual_seed(0)
    plain = PlainDualExpertFFN(cfg.hidden, cfg.intermediate).to(device)
    layer = DualExpertFFN.from_plain(plain)  # same parameter names: the plain state dict loads as is
    x = torch.randn(2, args.tokens // 2, cfg.hidden, device=device)
    action = torch.rand(2, args.tokens // 2, device=device) < 0.15  # expert 1 takes the action tokens
    with torch.no_grad():
        diff = (layer(x, action) - plain(x, action)).abs().max().item()
    print(f"DualExpertFFN {cfg.hidden} -> {cfg.intermediate} on {device}: max |sptr - plain| = {diff:.2e}")

    # Fine-tune under autocast: a regression target, AdamW, loss must fall.
    target = torch.randn_like(x) * 0.1
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    dtype = torch.bfloat16
    start = time.perf_counter()
    for step in range(args.steps):
        with torch.autocast(device_type=device, dtype=dtype):
            loss = torch.nn.functional.mse_loss(layer(x, action).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step in (0, args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.5f}")
    print(f"{args.steps * x.shape[0] * x.shape[1] / (time.perf_counter() - start):.0f} tokens/s (fwd+bwd+AdamW)")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dual_expert.safetensors")
        save_file({k: v.contiguous() for k, v in layer.state_dict().items()}, path)
        again = DualExpertFFN(cfg).to(device)
        again.load_state_dict(load_file(path, device=device))
        with torch.no_grad():
            same = torch.equal(again(x, action), layer(x, action))
    print(f"safetensors round trip: outputs {'identical' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
