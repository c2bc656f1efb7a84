#!/usr/bin/env bash
# One device call (carry [".gpu"] after tools/gpu_box/build.sh): the configuration table's RAM
# promises measured at full size (bench hybrid --footprint, 48 layers × 512 experts, page-locked,
# 15 GiB VRAM budget) for NVFP4 (≤ 75 GiB) and IQ3_S (the 64 GB edition, ≤ 56 GiB); then one
# 27B NVFP4 decode step profiled under ncu, and the matvec microbench. Logs come back as
# $OUT/logs.tgz, records as $OUT/*.json.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 CAPY_KERNEL_CACHE=/tmp/capy-kernels
export CAPY_COMMIT="$(cat .gpu/commit 2>/dev/null || echo unknown)"
mkdir -p "$OUT/logs"
step() { # name timeout command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/logs/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s"; tail -3 "$OUT/logs/$name.txt"
}
free -b > "$OUT/logs/free.txt"; ulimit -l >> "$OUT/logs/free.txt"
for f in ${FOOTPRINT_FORMATS:-nvfp4 iq3_s}; do
  step "footprint-$f" 240 .gpu/capy-flash bench --out "$OUT/footprint-$f.json" hybrid --footprint \
    --format "$f" --layers 48 --vram-budget 15GiB
done
# The CPU expert kernels at 16 threads, batch 1: IQ3_S on both ISAs and paths, NVFP4 AVX-512.
for run in iq3_s:avx512:0 iq3_s:avx512:1 iq3_s:avx2:0 iq3_s:avx2:1 nvfp4:avx512:0 nvfp4:avx512:1; do
  IFS=: read -r f isa exact <<< "$run"
  CAPY_CPU_ISA=$isa CAPY_EXACT_MATH=$exact step "cpu-experts-$f-$isa-$exact" 90 .gpu/capy-flash bench \
    --out "$OUT/cpu-experts-$f-$isa-16t-b1-exact$exact.json" cpu-experts --format "$f" --threads 16 --batch 1
done
if [ -z "$SKIP_PROFILE" ]; then
  CAPY_PROFILE_DECODE_STEPS=2 step ncu 300 ncu --clock-control none --cache-control none \
    --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \
    .gpu/capy-flash bench --out "$OUT/gpu-ncu.json" gpu --synthetic qwen3.8-27b --quant nvfp4 \
    --decode-tokens 8
  ( cd tools/cuda_microbench && nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/qmvb quant_matvec_bench.cu ) \
    > "$OUT/logs/qmvb-build.txt" 2>&1 && step qmvb 120 /tmp/qmvb
fi
( cd "$OUT" && tar czf logs.tgz logs && rm -rf logs )
