#!/usr/bin/env bash
# One device call (carry [".gpu"] after tools/gpu_box/build.sh): the CUDA suites that cover the
# copy paths (cuda_ops, cuda_hybrid, cuda_graphs, tensor_parallel_cuda, both fixture suites),
# the hybrid expert bench for NVFP4 and IQ3_S at a 15 GiB budget (store page-locked), and the
# 27B NVFP4 bench with the records layout. Logs come back as $OUT/logs.tgz, records as
# $OUT/*.json. Each step has its own timeout so one hang does not eat the call.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 CAPY_KERNEL_CACHE=/tmp/capy-kernels
export CAPY_COMMIT="$(cat .gpu/commit 2>/dev/null || echo unknown)"
mkdir -p "$OUT/logs"
built_at=$(cat .gpu/built_at)
if [ "$built_at" != "$PWD" ] && [ ! -e "$built_at" ]; then
  mkdir -p "$(dirname "$built_at")" && ln -s "$PWD" "$built_at"
fi
step() { # name timeout command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/logs/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s"; tail -3 "$OUT/logs/$name.txt"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv > "$OUT/logs/smi.txt"
lscpu > "$OUT/logs/lscpu.txt"
for t in cuda_ops cuda_hybrid cuda_graphs tensor_parallel_cuda cuda_qwen3_5_text_fixtures \
         cuda_qwen4_exp_text_fixtures; do
  step "$t" 120 ".gpu/tests/$t" --test-threads=1
done
for f in ${HYBRID_FORMATS:-nvfp4 iq3_s}; do
  step "hybrid-$f" 170 .gpu/capy-flash bench --out "$OUT/hybrid-$f.json" hybrid --format "$f" \
    --vram-budget 15GiB --threads 16 --layers 8 --tokens 64
done
if [ -z "$SKIP_RECORDS" ]; then
  # Records and blocks in the same call: the two are compared on the same card.
  CAPY_NVFP4_RECORDS=1 step records 200 .gpu/capy-flash bench --out "$OUT/gpu-records.json" gpu \
    --synthetic qwen3.8-27b --quant nvfp4 --decode-tokens 16
  CAPY_NVFP4_RECORDS=0 step blocks 200 .gpu/capy-flash bench --out "$OUT/gpu-blocks.json" gpu \
    --synthetic qwen3.8-27b --quant nvfp4 --decode-tokens 16
fi
( cd "$OUT" && tar czf logs.tgz logs && rm -rf logs )
