#!/usr/bin/env bash
# Fills .whl/ (git-ignored through .git/info/exclude) with what benchmarks/device_run.sh installs on the device,
# which cannot reach the network: transformers 4.49 with the tokenizers / huggingface_hub it accepts (the test
# oracle), liger-kernel (bench_wallx_qwen's peer) and spconv's pure-Python needs as wheels; CUTLASS's headers
# (those of the nvidia-cutlass wheel, for the sm_90a build: 1 MB as xz instead of its 6.4 MB wheel) and
# spconv-cu126 + cumm-cu126 (98 MB of wheels, unpacked) as xz tarballs. All for the device's Python 3.12. A call
# carries at most 64 MiB with the working tree: about 60 MiB here (SKIP_SPCONV=1 leaves spconv out, 43 MiB
# less; its U-Net tests then skip on the device).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
platform=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q "${platform[@]}" -d .whl transformers==4.49.0 "tokenizers>=0.21,<0.22" \
  "huggingface_hub>=0.26,<1.0" liger-kernel==0.8.5 pccm ccimport fire termcolor lark pybind11
if [ ! -f .whl/cutlass_include.tar.xz ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" nvidia-cutlass==4.2.0.0
  unzip -q "$tmp"/nvidia_cutlass-*.whl 'cutlass_library/source/include/*' -d "$tmp"
  tar cf - -C "$tmp/cutlass_library/source" include | xz -T0 -9 > .whl/cutlass_include.tar.xz
  rm -rf "$tmp"
fi
if [ -z "${SKIP_SPCONV:-}" ] && [ ! -f .whl/spconv_cu126_cumm.tar.xz ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q "${platform[@]}" -d "$tmp/wheels" spconv-cu126==2.3.8 "cumm-cu126>=0.7.11,<0.8.0"
  mkdir "$tmp/site"
  for w in "$tmp"/wheels/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
  tar cf - -C "$tmp/site" . | xz -T0 -9 > .whl/spconv_cu126_cumm.tar.xz
  rm -rf "$tmp"
fi
du -sh .whl
