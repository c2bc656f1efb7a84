#!/usr/bin/env bash
# Flash-Next with every routed expert on the GPU (needs the H200's memory: ~68 GB of NVFP4
# experts + 8.6 GB of BF16 dense weights), for each format in $FN_FORMATS (default nvfp4
# iq3_s) into $OUT/gpu-flash-next-<format>.json; with NCU=1 one decode step (NCU_FORMAT, nvfp4) under ncu
# into $OUT/ncu-flash-next.json; with NCU_PREFILL=1 one 27B NVFP4 prefill of 8K under ncu into
# $OUT/ncu-prefill-27b.json; with NCU_PREFILL_FN=1 one Flash-Next IQ3_S prefill of 8K under ncu into
# $OUT/ncu-prefill-flash-next.json; with BENCH_27B=1 the 27B NVFP4 and IQ3_S benches too
# (carry [".gpu"] after build.sh). TESTS="cuda_flash_next_ops …" runs those suites first. Logs: $OUT/logs.tgz.
source tools/gpu_box/common.sh
for t in $TESTS; do
  step "$t" 150 ".gpu/tests/$t" --test-threads=1
done
gpu_gib=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) / 1024 ))
for f in ${FN_FORMATS:-nvfp4 iq3_s}; do
  if [ "$f" = nvfp4 ] && [ "$gpu_gib" -lt 100 ]; then
    echo "gpu-flash-next-nvfp4 skipped: ${gpu_gib} GiB on this card, ~80 GB needed"
    continue
  fi
  step "gpu-flash-next-$f" 300 .gpu/capy-flash bench --out "$OUT/gpu-flash-next-$f.json" gpu \
    --synthetic qwen3.8-flash-next --quant "$f" --decode-tokens 16
done
if [ -n "$NCU" ]; then
  ncu_decode_profile ncu-flash-next --synthetic qwen3.8-flash-next --quant "${NCU_FORMAT:-nvfp4}"
fi
if [ -n "$NCU_PREFILL" ]; then
  ncu_prefill_profile ncu-prefill-27b --synthetic qwen3.8-27b --quant nvfp4
fi
if [ -n "$NCU_PREFILL_FN" ]; then
  ncu_prefill_profile ncu-prefill-flash-next --synthetic qwen3.8-flash-next --quant iq3_s
fi
if [ -n "$BENCH_27B" ]; then
  for f in nvfp4 iq3_s; do
    step "gpu-27b-$f" 200 .gpu/capy-flash bench --out "$OUT/gpu-27b-$f.json" gpu \
      --synthetic qwen3.8-27b --quant "$f" --decode-tokens 16
  done
fi
finish
