#!/usr/bin/env bash
# DDP scaling of the SphereFormer U-Net (examples/train_sphereformer_ddp.py, the full SemanticKITTI network):
# points/s with 1, 2, ... GPUs at the same per-GPU batch under torchrun and NCCL, counted over STEPS steps after
# WARMUP; the scaling efficiency (n-GPU rate / n x the 1-GPU rate) and every run's loss curve side by side.
# Run from the repository root on a GPU machine. Env: STEPS (timed steps, default 20), WARMUP (default 3),
# POINTS (per scan, default 120000), BATCH (scans per GPU, default 2), AMP (default fp16), ATTENTION (the
# attention dtype, default bfloat16), GPUS (default: every visible GPU), OUT (logs and JSON, default /tmp/ddp),
# EXTRA (more arguments; a CPU dry run: GPUS=2 STEPS=2 WARMUP=1 POINTS=3000 EXTRA=--small, gloo processes).
set -u -o pipefail
STEPS=${STEPS:-20} WARMUP=${WARMUP:-3} POINTS=${POINTS:-120000} BATCH=${BATCH:-2} AMP=${AMP:-fp16}
ATTENTION=${ATTENTION:-bfloat16} OUT=${OUT:-/tmp/ddp} EXTRA=${EXTRA:-}
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
mkdir -p "$OUT"
ARGS="--steps $((STEPS + WARMUP)) --warmup $WARMUP --points $POINTS --batch-size $BATCH --scans $((4 * BATCH * GPUS))
      --amp $AMP --attention-dtype $ATTENTION --full --output $OUT/ddp_bench.pth $EXTRA"
for n in $(seq 1 "$GPUS"); do
  python3 -m torch.distributed.run --nproc_per_node "$n" examples/train_sphereformer_ddp.py $ARGS \
    --losses "$OUT/ddp_x$n.json" > "$OUT/ddp_x$n.log" 2>&1 || { echo "torchrun x$n failed:"; tail -20 "$OUT/ddp_x$n.log"; }
  echo "torchrun x$n: $(tail -1 "$OUT/ddp_x$n.log")"
done
python3 - "$OUT" "$GPUS" <<'EOF'
import json, os, sys
out, gpus = sys.argv[1], int(sys.argv[2])
runs = {n: json.load(open(p)) for n in range(1, gpus + 1) if os.path.exists(p := os.path.join(out, f"ddp_x{n}.json"))}
if 1 in runs:
    for n, r in runs.items():
        eff = r["points_per_s"] / (n * runs[1]["points_per_s"])
        print(f"{n} process(es): {r['points_per_s']:,.0f} points/s over {r['timed_steps']} steps, scaling efficiency {eff:.2f}")
print("step | " + " | ".join(f"loss x{n}" for n in runs))
for i in range(max((len(r["losses"]) for r in runs.values()), default=0)):
    print(f"{i:4d} | " + " | ".join(f"{r['losses'][i]:7.3f}" if i < len(r["losses"]) else "      -" for r in runs.values()))
EOF
