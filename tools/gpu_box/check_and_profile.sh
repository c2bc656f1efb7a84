#!/usr/bin/env bash
# One device call (run with carry [".gpu"] after tools/gpu_box/build.sh): the matvec
# microbench, the CUDA suites, a decode profile under ncu, and bench gpu with and without the
# NVFP4 records. Logs come back as $OUT/logs.tgz, the bench records as $OUT/*.json.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 CAPY_KERNEL_CACHE=/tmp/capy-kernels
export CAPY_COMMIT="$(cat .gpu/commit 2>/dev/null || echo unknown)"
mkdir -p "$OUT/logs"
# The test executables read their fixtures at the path they were built at (.gpu/built_at).
built_at=$(cat .gpu/built_at)
if [ "$built_at" != "$PWD" ] && [ ! -e "$built_at" ]; then
  mkdir -p "$(dirname "$built_at")" && ln -s "$PWD" "$built_at"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/logs/smi.txt"
( cd tools/cuda_microbench && nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/qmvb quant_matvec_bench.cu && /tmp/qmvb ) \
  > "$OUT/logs/qmvb.json" 2> "$OUT/logs/qmvb.err"; echo "microbench rc=$?"
for t in cuda_ops tensor_parallel_cuda; do
  timeout 180 ".gpu/tests/$t" > "$OUT/logs/$t.txt" 2>&1; echo "$t rc=$?"; tail -2 "$OUT/logs/$t.txt"
done
CAPY_PROFILE_DECODE_STEPS=2 timeout 300 ncu --clock-control none --cache-control none --profile-from-start off \
  --metrics gpu__time_duration.sum --csv --print-units base \
  .gpu/capy-flash bench --out "$OUT/gpu-blocks.json" gpu --synthetic qwen3.8-27b --quant nvfp4 --decode-tokens 8 \
  > "$OUT/logs/ncu.csv" 2> "$OUT/logs/ncu.err"; echo "ncu rc=$?"
CAPY_NVFP4_RECORDS=1 timeout 200 .gpu/capy-flash bench --out "$OUT/gpu-records.json" gpu --synthetic qwen3.8-27b \
  --quant nvfp4 --decode-tokens 16 > "$OUT/logs/records.txt" 2>&1; echo "records bench rc=$?"
( cd "$OUT" && tar czf logs.tgz logs && rm -rf logs )
