#!/usr/bin/env bash
# One device call after a kernel change (carry [".gpu"] after tools/gpu_box/build.sh): every
# CUDA suite (fast math, then the fixture and graph suites under CAPY_EXACT_MATH=1), the 27B
# NVFP4 bench and one decode step under ncu (SKIP_BENCH=1 leaves both out); AB_ENV="VAR=value"
# runs the bench again under that setting into $OUT/gpu-27b-ab.json, for a same-run comparison.
# Returns $OUT/gpu-27b.json, $OUT/ncu-summary.json, $OUT/logs.tgz.
source tools/gpu_box/common.sh
cuda_suites
if [ -z "$SKIP_BENCH" ]; then
  step gpu-27b 200 .gpu/capy-flash bench --out "$OUT/gpu-27b.json" gpu --synthetic qwen3.8-27b \
    --quant nvfp4 --decode-tokens 16
  if [ -n "$AB_ENV" ]; then
    ( export $AB_ENV; step gpu-27b-ab 200 .gpu/capy-flash bench --out "$OUT/gpu-27b-ab.json" gpu \
        --synthetic qwen3.8-27b --quant nvfp4 --decode-tokens 16 )
  fi
  ncu_decode_profile
fi
finish
