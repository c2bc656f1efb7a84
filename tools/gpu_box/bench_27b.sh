#!/usr/bin/env bash
# The 27B decode and prefill bench for each format in $FORMATS (default nvfp4 iq3_s) into
# $OUT/gpu-27b-<format>.json (carry [".gpu"] after build.sh).
source tools/gpu_box/common.sh
for f in ${FORMATS:-nvfp4 iq3_s}; do
  step "gpu-27b-$f" 200 .gpu/capy-flash bench --out "$OUT/gpu-27b-$f.json" gpu --synthetic qwen3.8-27b \
    --quant "$f" --decode-tokens 16
done
( cd "$LOGS" && tar czf "$OUT/bench-logs.tgz" . )
