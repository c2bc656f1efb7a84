#!/usr/bin/env bash
# One device call's whole pass (carry [".gpu"] after build.sh): every CUDA suite (fast math,
# then the fixture and graph suites under CAPY_EXACT_MATH=1); the 27B NVFP4 bench, again under
# $AB_ENV ("VAR=value", into gpu-27b-nvfp4-ab.json) for a same-run comparison, and the 27B
# IQ3_S bench; with NCU_KERNELS (a regex) the ncu sections of those decode kernels
# (ncu-detail.txt); then Flash-Next with every routed expert on the GPU in each format of
# $FN_FORMATS (default iq3_s nvfp4) the card holds (NVFP4 needs ~80 GB). Bench records land
# in $OUT; the logs in $OUT/logs.tgz. SKIP_TESTS=1 leaves the suites out.
source tools/gpu_box/common.sh
[ -n "$SKIP_TESTS" ] || cuda_suites
bench() { # name limit bench-gpu-args...
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" .gpu/capy-flash bench --out "$OUT/$name.json" gpu "$@" --decode-tokens 16
}
bench gpu-27b-nvfp4 150 --synthetic qwen3.8-27b --quant nvfp4
if [ -n "$AB_ENV" ]; then
  ( export $AB_ENV; bench gpu-27b-nvfp4-ab 150 --synthetic qwen3.8-27b --quant nvfp4 )
fi
bench gpu-27b-iq3_s 150 --synthetic qwen3.8-27b --quant iq3_s
[ -z "$NCU_KERNELS" ] || ncu_detail "$NCU_KERNELS" "${NCU_LAUNCHES:-8}"
gpu_gib=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) / 1024 ))
for f in ${FN_FORMATS:-iq3_s nvfp4}; do
  if [ "$f" = nvfp4 ] && [ "$gpu_gib" -lt 100 ]; then
    echo "gpu-flash-next-nvfp4 skipped: ${gpu_gib} GiB on this card, ~80 GB needed"
    continue
  fi
  bench "gpu-flash-next-$f" 200 --synthetic qwen3.8-flash-next --quant "$f"
done
finish
