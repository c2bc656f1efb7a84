#!/usr/bin/env bash
# One device call (carry [".gpu"] after tools/gpu_box/build.sh) after a kernel change: every CUDA
# suite (fast math, then the fixture and graph suites again under CAPY_EXACT_MATH=1), the 27B
# NVFP4 bench, and one decode step under ncu summarised per kernel. Returns $OUT/gpu-27b.json,
# $OUT/ncu-summary.json, $OUT/logs.tgz.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 CAPY_KERNEL_CACHE=/tmp/capy-kernels
export CAPY_COMMIT="$(cat .gpu/commit 2>/dev/null || echo unknown)"
LOGS=/tmp/capy-logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
built_at=$(cat .gpu/built_at)
if [ "$built_at" != "$PWD" ] && [ ! -e "$built_at" ]; then
  mkdir -p "$(dirname "$built_at")" && ln -s "$PWD" "$built_at"
fi
step() { # name timeout command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s $(grep -h 'test result' "$LOGS/$name.txt" | tail -1)"
  [ $rc -eq 0 ] || tail -25 "$LOGS/$name.txt"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$LOGS/smi.txt"
for t in cuda_ops cuda_graphs cuda_hybrid tensor_parallel_cuda cuda_qwen3_5_text_fixtures \
         cuda_qwen4_exp_text_fixtures cuda_flash_next_ops; do
  step "$t" 150 ".gpu/tests/$t" --test-threads=1
done
for t in cuda_graphs cuda_qwen3_5_text_fixtures cuda_qwen4_exp_text_fixtures; do
  CAPY_EXACT_MATH=1 step "$t-exact" 120 ".gpu/tests/$t" --test-threads=1
done
if [ -z "$SKIP_BENCH" ]; then
  step gpu-27b 200 .gpu/capy-flash bench --out "$OUT/gpu-27b.json" gpu --synthetic qwen3.8-27b \
    --quant nvfp4 --decode-tokens 16
  CAPY_PROFILE_DECODE_STEPS=2 step ncu 300 ncu --clock-control none --cache-control none \
    --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \
    .gpu/capy-flash bench --out "$LOGS/gpu-ncu.json" gpu --synthetic qwen3.8-27b --quant nvfp4 \
    --decode-tokens 8
  python3 tools/gpu_box/ncu_summary.py "$LOGS/ncu.txt" 2 > "$OUT/ncu-summary.json"
fi
( cd "$LOGS" && tar czf "$OUT/logs.tgz" . )
