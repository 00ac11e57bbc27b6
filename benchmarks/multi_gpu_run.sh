#!/usr/bin/env bash
# Issue 30's measurements in one device call on a two-GPU machine (nvidia-h200-x2): build, then the DDP scaling
# of the full SphereFormer U-Net (bench_ddp_sphereformer.sh) and FSDP2 of the dual-expert Qwen2.5-VL (bench_wallx_qwen.py
# --fsdp) with 1 and 2 processes; logs under $OUT. Needs .whl/ (benchmarks/fetch_device_wheels.sh: spconv-cu126,
# CUTLASS's headers, transformers 4.49) carried. NVLink multicast stays off, as the device's docs require.
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=32
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f .whl/spconv_cu126_cumm.tar.xz ] && tar xJf .whl/spconv_cu126_cumm.tar.xz -C /tmp/site
mkdir -p /tmp/cutlass && tar xJf .whl/cutlass_include.tar.xz -C /tmp/cutlass && export CUTLASS_PATH=/tmp/cutlass
export PYTHONPATH=/tmp/site:.
nvidia-smi topo -m | tee "$OUT/topology.txt"
( time python3 setup.py build_ext --inplace ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
OUT=$OUT/ddp GPUS=${GPUS:-2} bash benchmarks/bench_ddp_sphereformer.sh 2>&1 | tee "$OUT/ddp_sphereformer.log"
# Qwen2.5-VL-3B's language model (hidden 2048, 36 layers; FFN 11264 here against its 11008) with a smaller vision
# tower than its 32 blocks of 1280, so that one GPU holds the unsharded model, its gradients and AdamW's state.
QWEN=${QWEN:---hidden 2048 --layers 36 --vision-depth 8 --vision-hidden 1280 --batch 4 --seq 2048 --grid 32 32}
for n in 1 2; do
  python3 -m torch.distributed.run --nproc_per_node $n benchmarks/bench_wallx_qwen.py --fsdp $QWEN \
    2>&1 | tee "$OUT/fsdp_qwen_x$n.log" | tail -4
done
