#!/usr/bin/env bash
# One device call (carry [".gpu"] after tools/gpu_box/build.sh): the hybrid expert bench with
# its time breakdown (NVFP4, IQ3_S; 15 GiB budget) and one 27B NVFP4 decode step profiled under
# ncu, summarised per kernel. Everything comes back in few files (the device returns a limited
# number): $OUT/hybrid-*.json, $OUT/ncu-summary.json and $OUT/logs.tgz.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 CAPY_KERNEL_CACHE=/tmp/capy-kernels
export CAPY_COMMIT="$(cat .gpu/commit 2>/dev/null || echo unknown)"
LOGS=/tmp/capy-logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
step() { # name timeout command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s"; tail -2 "$LOGS/$name.txt"
}
for f in ${HYBRID_FORMATS:-nvfp4 iq3_s}; do
  step "hybrid-$f" 170 .gpu/capy-flash bench --out "$OUT/hybrid-$f.json" hybrid --format "$f" \
    --vram-budget 15GiB --threads 16 --layers 8 --tokens 64
done
if [ -z "$SKIP_PROFILE" ]; then
  CAPY_PROFILE_DECODE_STEPS=2 step ncu 300 ncu --clock-control none --cache-control none \
    --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \
    .gpu/capy-flash bench --out "$LOGS/gpu-ncu.json" gpu --synthetic qwen3.8-27b --quant nvfp4 \
    --decode-tokens 8
  python3 tools/gpu_box/ncu_summary.py "$LOGS/ncu.txt" 2 > "$OUT/ncu-summary.json"
fi
( cd "$LOGS" && tar czf "$OUT/logs.tgz" . )
