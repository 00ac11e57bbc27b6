#!/usr/bin/env bash
# DDP scaling of the SphereFormer U-Net (examples/train_sphereformer_ddp.py): points/s with 1, 2, ... GPUs at the
# same per-GPU batch, NCCL, plus the same training without DDP (plain python). Run from the repository root on a
# GPU machine; prints one line per run. Env: STEPS (default 12), POINTS (per scan, default 120000), BATCH (scans
# per GPU, default 2), AMP (default fp16), GPUS (default: every visible GPU).
set -u -o pipefail
STEPS=${STEPS:-12} POINTS=${POINTS:-120000} BATCH=${BATCH:-2} AMP=${AMP:-fp16}
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
ARGS="--steps $STEPS --points $POINTS --batch-size $BATCH --scans $((4 * BATCH * GPUS)) --amp $AMP --output /tmp/ddp_bench.pth"
echo "plain: $(python3 examples/train_sphereformer_ddp.py $ARGS 2>/dev/null | tail -1)"
for n in $(seq 1 "$GPUS"); do
  echo "torchrun x$n: $(python3 -m torch.distributed.run --nproc_per_node "$n" examples/train_sphereformer_ddp.py $ARGS 2>/dev/null | tail -1)"
done
