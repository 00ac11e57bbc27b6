#!/usr/bin/env bash
# One build + GPU test + benchmark (+ optional Nsight Compute profile) cycle on the device (see docs/benchmarks.md).
# Wheels for transformers 4.49 (the test oracle), liger-kernel and spconv's pure-Python needs (pccm, ccimport,
# fire, termcolor, lark) travel in .whl/ (not committed); spconv-cu126 and cumm-cu126 as one xz tarball of their
# unpacked wheels (.whl/spconv_cu126_cumm.tar.xz: the two wheels are 98 MB, over a call's 64 MiB); CUTLASS's
# headers as .whl/cutlass_include.tar.xz. benchmarks/fetch_device_wheels.sh makes .whl/.
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# TORCH_CUDA_ARCH_LIST=9.0 (no "a") leaves out the CUTLASS grouped GEMM units, about half the build's time, for
# calls that do not test them (the grouped linear ops then run the mma.sync kernel).
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=16
ORACLE=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && ORACLE=/tmp/site
fi
[ -f .whl/spconv_cu126_cumm.tar.xz ] && mkdir -p /tmp/site && tar xJf .whl/spconv_cu126_cumm.tar.xz -C /tmp/site
# CUTLASS's headers for the sm_90a build (benchmarks/fetch_device_wheels.sh packs them).
[ -f .whl/cutlass_include.tar.xz ] && mkdir -p /tmp/cutlass && tar xJf .whl/cutlass_include.tar.xz -C /tmp/cutlass \
  && export CUTLASS_PATH=/tmp/cutlass
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# The published sptr 1.1.1, for the fused-attention benchmark: its sdist plus the four headers the sdist lacks
# (D11, taken from its git repository), carried in .bench_deps/ (not committed), built next to ours and
# imported as `sptr111` (our package has its import name).
SPTR111_PID=""
if [ -f .bench_deps/sptr-1.1.1-src.tar.gz ] && [ ! -d /tmp/sptr111pkg/sptr111 ]; then
  ( set -e; mkdir -p /tmp/sptr111src /tmp/sptr111pkg/sptr111; tar xzf .bench_deps/sptr-1.1.1-src.tar.gz -C /tmp/sptr111src
    cd /tmp/sptr111src/sptr-1.1.1; ENABLE_BF16=1 python3 setup.py build_ext --inplace > "$OUT/sptr111_build.log" 2>&1
    cp sptr/functional.py sptr/sptr_cuda*.so /tmp/sptr111pkg/sptr111/; touch /tmp/sptr111pkg/sptr111/__init__.py ) &
  SPTR111_PID=$!
fi
# SKIP_BUILD=1 on a machine still warm from the last call keeps the extension built there (the machine keeps
# ignored build outputs between calls), instead of rebuilding for ~4 minutes. Without it the build is
# incremental by file times: after a call that built other sources there (git stash, git apply), the next
# call's copied sources may be older than those objects and rebuild nothing, so touch the changed files first.
if [ -n "${SKIP_BUILD:-}" ] && ls sptr/_C/_kernels*.so >/dev/null 2>&1; then
  echo "build skipped (SKIP_BUILD): $(ls -l sptr/_C/_kernels*.so)"
else
  ( time python3 setup.py build_ext --inplace ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  tail -3 "$OUT/build.log"
fi
[ -n "$SPTR111_PID" ] && { wait $SPTR111_PID && echo "sptr 1.1.1 built" || tail -5 "$OUT/sptr111_build.log"; }
# transformers 4.49 (the oracle) shadows the machine's transformers for the main run ...
# PYTEST_K: a -k expression (with spaces) for the main run; PYTEST_ARGS: more options (-n 8 for xdist, say).
# Two threads per test process, so that xdist workers and the multi-process tests' ranks do not oversubscribe
# the 16 cores, and a per-test time limit (pytest-timeout), so that a stuck test fails with its stack instead
# of using up the call.
# SKIP_TESTS=1 leaves the main run out (a follow-up call on a warm machine that only profiles or benchmarks).
[ -n "${SKIP_TESTS:-}" ] || PYTHONPATH=$ORACLE:. OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} python3 -m pytest ${PYTEST_TARGETS:-tests} \
  -q -p no:cacheprovider -rs --timeout "${PYTEST_TIMEOUT:-240}" ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
  | tee "$OUT/pytest.log" | tail -25
# ... and the 5.x-form adapter and MoE layers are checked against the machine's own transformers 5.x.
[ -n "${SKIP_HF5:-}" ] || PYTHONPATH=. python3 -m pytest tests/ops/test_rope_index_hf5.py \
  tests/integrations/test_qwen2_5_vl_hf5.py tests/models/test_qwen2_5_vl_moe_hf5.py tests/layers/test_moe_layers.py \
  -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_hf5.log" | tail -3
# Out-of-bounds accesses and races in the CUDA kernels, on the CUDA test cases of the smaller tests.
[ -n "${SKIP_MEMCHECK:-}" ] || PYTHONPATH=$ORACLE:. timeout ${SANITIZER_TIMEOUT:-150} compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 -m pytest ${SANITIZER_TARGETS:-tests/ops} -q -p no:cacheprovider -x \
  -k "${SANITIZER_K:-cuda and not big_windows and not random_batches}" 2>&1 | tee "$OUT/memcheck.log" | tail -4
# Shared-memory races and barrier misuse (compute-sanitizer's racecheck and synccheck; slow: name a few small
# cases) when RACE_K is set, e.g. "cuda and sphereformer_table and dtype2 and False" (the test's dtype ids:
# dtype2 is float32; False: cubic tables) for the fp32 backward's two groups and their named barriers; one log
# per tool. First racecheck_named_barriers.cu, a race-free probe in four modes: whether racecheck itself reports
# hazards across CTA barriers after two groups ran unequal numbers of named barriers (modes 0-2), or when each
# group barrier sits beside a predicated-off __syncthreads() (mode 3), the shape of the two-group kernels'
# reports (benchmarks/RESULTS.md, tenth session).
if [ -n "${RACE_K:-}" ] && nvcc -arch=sm_90 -o /tmp/racecheck_probe benchmarks/racecheck_named_barriers.cu; then
  for mode in 0 1 2 3; do
    compute-sanitizer --tool racecheck /tmp/racecheck_probe $mode 2>&1 | grep -E "^mode|SUMMARY"
  done | tee "$OUT/racecheck_probe.log"
fi
for tool in ${RACE_K:+racecheck synccheck}; do
  PYTHONPATH=$ORACLE:. timeout ${RACE_TIMEOUT:-200} compute-sanitizer --tool $tool --error-exitcode 1 python3 -m pytest \
    ${RACE_TARGETS:-tests/ops/test_fused_window_attention.py} -q -p no:cacheprovider -x -k "$RACE_K" 2>&1 \
    | tee "$OUT/$tool.log" | tail -4
done
# BENCHMARKS unset: the three below; set and empty: none.
for b in ${BENCHMARKS-bench_fused_attention bench_window_attention bench_rope}; do
  PYTHONPATH=$ORACLE:/tmp/sptr111pkg:. timeout ${BENCH_TIMEOUT:-240} python3 "benchmarks/$b.py" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/$b.log" | tail -60
done
# NCU_KERNELS: one or more Nsight Compute profiles separated by ';', each a kernel-name regex with optional
# profile_fused_forward.py arguments after '@' (default NCU_ARGS, else window 12, 4x32), e.g.
# "(fwd|dq|dkv)_onehot;(fwd|bwd_dq|bwd_dkv)_kernel<@--window 6 --heads 4x16 --dtypes float32": the source
# counters of one forward+backward with the tables, summarised by ncu_hotspots.py into $OUT/ncu<i>_hotspots.txt;
# the per-instruction CSV comes back xz-compressed. NCU_SCRIPT replaces the profiled command (default
# "benchmarks/profile_fused_forward.py --once --rel-pos"; the '@' arguments follow it), e.g.
# NCU_SCRIPT="benchmarks/bench_sphereformer_block.py --once --levels 1" with "...@--variants fused-fp16":
# a SphereFormer block's kernels (its spherical windows run the gather kernels).
i=0
IFS=';' read -r -a NCU_PROFILES <<< "${NCU_KERNELS:-}"
for profile in "${NCU_PROFILES[@]}"; do
  i=$((i + 1)); regex=${profile%%@*}; pargs=${NCU_ARGS:---window 12 --heads 4x32}
  [ "$regex" != "$profile" ] && pargs=${profile#*@}
  PYTHONPATH=$ORACLE:. timeout ${NCU_TIMEOUT:-200} ncu -k "regex:$regex" --launch-count ${NCU_LAUNCHES:-3} \
    --section SourceCounters --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SpeedOfLight -o "$OUT/ncu$i" python3 ${NCU_SCRIPT:-benchmarks/profile_fused_forward.py --once --rel-pos} \
    $pargs > "$OUT/ncu$i.log" 2>&1
  ncu -i "$OUT/ncu$i.ncu-rep" --page details > "$OUT/ncu${i}_details.txt"
  ncu -i "$OUT/ncu$i.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu${i}_source.csv" \
    && python3 benchmarks/ncu_hotspots.py "$OUT/ncu${i}_source.csv" > "$OUT/ncu${i}_hotspots.txt"
  rm -f "$OUT/ncu$i.ncu-rep"
  xz -T8 "$OUT/ncu${i}_source.csv"
  head -40 "$OUT/ncu${i}_hotspots.txt"
done
