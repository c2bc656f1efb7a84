# Sourced by the device-call scripts here (run with carry [".gpu"] after build.sh): the
# environment of the box, the fixture path the test executables were built at, a timed `step`
# whose log lands in $LOGS, the ncu decode profile, and `finish`, which packs $LOGS into
# $OUT/logs.tgz (a device call returns only a few files).
# CAPY_REQUIRE_GPU: a GPU test whose backend does not start fails here instead of skipping.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 CAPY_KERNEL_CACHE=/tmp/capy-kernels CAPY_REQUIRE_GPU=1
export CAPY_COMMIT="$(cat .gpu/commit 2>/dev/null || echo unknown)"
LOGS=/tmp/capy-logs
rm -rf "$LOGS"; mkdir -p "$LOGS"
[ -f .gpu/tests.tar.xz ] && tar -C .gpu -xJf .gpu/tests.tar.xz
built_at=$(cat .gpu/built_at)
if [ "$built_at" != "$PWD" ] && [ ! -e "$built_at" ]; then
  mkdir -p "$(dirname "$built_at")" && ln -s "$PWD" "$built_at"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv > "$LOGS/smi.txt"
lscpu > "$LOGS/lscpu.txt"

step() { # name timeout command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s $(grep -h 'test result' "$LOGS/$name.txt" | tail -1)"
  [ $rc -eq 0 ] || tail -25 "$LOGS/$name.txt"
}

# One decode step's kernels under ncu, summed per kernel into $OUT/<name>.json: by default the
# 27B NVFP4 into ncu-summary.json; `ncu_decode_profile NAME ARGS...` profiles `bench gpu ARGS`.
ncu_decode_profile() {
  local name=${1:-ncu-summary}
  shift || true
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(--synthetic qwen3.8-27b --quant nvfp4)
  CAPY_PROFILE_DECODE_STEPS=2 step "$name" 400 ncu --clock-control none --cache-control none \
    --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \
    .gpu/capy-flash bench --out "$LOGS/$name-bench.json" gpu "${args[@]}" --decode-tokens 8
  python3 tools/gpu_box/ncu_summary.py "$LOGS/$name.txt" 2 > "$OUT/$name.json"
}

# One whole prefill (the bench's context) under ncu, summed per kernel name into
# $OUT/<name>.json: `ncu_prefill_profile NAME ARGS...` profiles `bench gpu ARGS`.
ncu_prefill_profile() {
  local name=$1
  shift
  CAPY_PROFILE_PREFILL=1 step "$name" 400 ncu --clock-control none --cache-control none \
    --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \
    .gpu/capy-flash bench --out "$LOGS/$name-bench.json" gpu "$@" --decode-tokens 2
  python3 tools/gpu_box/ncu_summary.py "$LOGS/$name.txt" 1 name > "$OUT/$name.json"
}

# Every CUDA suite (fast math), then the fixture and graph suites under CAPY_EXACT_MATH=1.
cuda_suites() {
  local t
  for t in cuda_ops cuda_graphs cuda_hybrid tensor_parallel_cuda cuda_qwen3_5_text_fixtures \
           cuda_qwen4_exp_text_fixtures cuda_flash_next_ops; do
    step "$t" 150 ".gpu/tests/$t" --test-threads=1
  done
  for t in cuda_graphs cuda_qwen3_5_text_fixtures cuda_qwen4_exp_text_fixtures; do
    CAPY_EXACT_MATH=1 step "$t-exact" 120 ".gpu/tests/$t" --test-threads=1
  done
}

# The ncu sections (launch, occupancy, speed of light, memory, warp states) of the decode
# kernels matching regex $1, the first $2 launches (default 8) of one decode step of `bench gpu`
# with the remaining arguments (default the 27B NVFP4), into $OUT/ncu-detail.txt.
ncu_detail() {
  local kernels=$1 launches=${2:-8}
  shift 2 || shift $#
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(--synthetic qwen3.8-27b --quant nvfp4)
  CAPY_PROFILE_DECODE_STEPS=1 step ncu-detail 300 ncu --clock-control none --cache-control none \
    --profile-from-start off -k "regex:$kernels" --launch-count "$launches" \
    --section LaunchStats --section Occupancy --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats \
    .gpu/capy-flash bench --out "$LOGS/gpu-ncu.json" gpu "${args[@]}" --decode-tokens 4
  cp "$LOGS/ncu-detail.txt" "$OUT/ncu-detail.txt"
}

# As ncu_detail, for the kernels matching $1 in one whole prefill (the bench's context): the
# first $2 launches (default 4), with the source counters (bank conflicts, L1 wavefronts) too,
# into $OUT/ncu-prefill-detail.txt. Session 25's two rejected changes were reasoned from counts
# of wavefronts; these sections measure them.
ncu_prefill_detail() {
  local kernels=$1 launches=${2:-4}
  shift 2 || shift $#
  CAPY_PROFILE_PREFILL=1 step ncu-prefill-detail 400 ncu --clock-control none --cache-control none \
    --profile-from-start off -k "regex:$kernels" --launch-count "$launches" \
    --section LaunchStats --section Occupancy --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
    --section SourceCounters \
    .gpu/capy-flash bench --out "$LOGS/gpu-ncu-prefill.json" gpu "$@" --decode-tokens 2
  cp "$LOGS/ncu-prefill-detail.txt" "$OUT/ncu-prefill-detail.txt"
}

finish() {
  ( cd "$LOGS" && tar czf "$OUT/logs.tgz" . )
}
