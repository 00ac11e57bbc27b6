#!/usr/bin/env bash
# Creates .venv/ and installs sptr (editable, extension built in place) with its test dependencies.
# Also installs spconv 2.3.8 (CPU wheel, or spconv-cu126 where an NVIDIA driver runs; SPCONV_WHEEL overrides).
# CUDA kernels are compiled when a CUDA toolkit and a CUDA build of torch are present (or FORCE_CUDA=1),
# for TORCH_CUDA_ARCH_LIST (default 8.0;8.6;8.9;9.0a; 9.0a builds the MoE grouped GEMM on CUTLASS, whose headers
# come from the nvidia-cutlass wheel); otherwise a CPU-only extension is built.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q "torch==2.14.1" numpy einops safetensors pyyaml tqdm ninja setuptools wheel
# spconv (the SphereFormer U-Net's sparse convolutions) is independent of the torch version: its CUDA 12.6 wheel
# where an NVIDIA driver is present, else the CPU wheel. SPCONV_WHEEL overrides (e.g. spconv-cu121).
if [ -z "${SPCONV_WHEEL:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then SPCONV_WHEEL=spconv-cu126; else SPCONV_WHEEL=spconv; fi
fi
$PIP install -q "$SPCONV_WHEEL==2.3.8"
$PIP install -q pytest expecttest "transformers==4.49.0"
# CUTLASS's headers only (its Python side's dependencies are not needed to build against them).
$PIP install -q --no-deps "nvidia-cutlass==4.2.0.0"
# Rebuilding the extension takes minutes: skip it when the kernel sources and build settings are unchanged.
STAMP=.venv/sptr-build.stamp
want=$( (cat setup.py; find sptr/_C -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' \) \
         | sort | xargs cat; echo "${FORCE_CUDA:-} ${TORCH_CUDA_ARCH_LIST:-} ${DEBUG:-}") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import sptr._C" 2>/dev/null; then
  MAX_JOBS=${MAX_JOBS:-$(nproc)} $PIP install -q --no-build-isolation -e .
  echo "$want" > "$STAMP"
fi
.venv/bin/python -c "import sptr._C as c; print('sptr built;', 'CUDA kernels' if c.has_cuda_kernels() else 'CPU kernels only')"
