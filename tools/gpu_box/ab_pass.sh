#!/usr/bin/env bash
# A same-run A/B pass: the baseline binary (.gpu-base, build_base.sh) and the current one
# (.gpu, build.sh) alternate on each case of $AB_CASES ("model:format …", default the 27B in
# NVFP4 and IQ3_S and Flash-Next in IQ3_S), and each pair becomes one record
# $OUT/gpu-<model>-<format>-ab.json holding both runs' decode and prefill and their ratios
# (ab_record.py). $TESTS ("cuda_ops …") run first on the current binaries.
# Run with carry [".gpu", ".gpu-base"].
source tools/gpu_box/common.sh
for t in $TESTS; do
  step "$t" 150 ".gpu/tests/$t" --test-threads=1
done
xz -dc .gpu-base/capy-flash.xz > /tmp/capy-base && chmod +x /tmp/capy-base
base_commit=$(cat .gpu-base/commit)
for case in ${AB_CASES:-qwen3.8-27b:nvfp4 qwen3.8-27b:iq3_s qwen3.8-flash-next:iq3_s}; do
  model=${case%%:*} format=${case##*:}
  name="gpu-$model-$format"
  step "$name-base" 300 /tmp/capy-base bench --out "$LOGS/$name-base.json" gpu \
    --synthetic "$model" --quant "$format" --decode-tokens 16
  step "$name" 300 .gpu/capy-flash bench --out "$LOGS/$name.json" gpu \
    --synthetic "$model" --quant "$format" --decode-tokens 16
  [ -f "$LOGS/$name.json" ] && [ -f "$LOGS/$name-base.json" ] &&
    python3 tools/gpu_box/ab_record.py "$LOGS/$name.json" "$LOGS/$name-base.json" \
      "binary built from $base_commit" "the commits since $base_commit" \
      "$(cat "$LOGS/smi.txt" | tail -1)" "$OUT/$name-ab.json"
done
finish
