#!/usr/bin/env bash
# One build + GPU test + benchmark cycle on the H200 device (see README "GPU validation").
# Wheels for transformers 4.49 (the test oracle) and liger-kernel travel in .whl/ (not committed).
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
( time python3 setup.py build_ext --inplace ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
tail -3 "$OUT/build.log"
python3 -m pytest tests -q -p no:cacheprovider -rs ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -25
for b in ${BENCHMARKS:-bench_window_attention bench_rope}; do
  timeout ${BENCH_TIMEOUT:-240} python3 "benchmarks/$b.py" 2>&1 | tee "$OUT/$b.log" | tail -45
done
