#!/usr/bin/env bash
# Same-run A/B of settings (carry [".gpu"] after build.sh, plus ".gpu-base" for BASE_FN=1):
# $TESTS first (and $EXACT_TESTS under CAPY_EXACT_MATH=1, $ENV_TESTS under a setting); then for each case of $CASES
# ("model:format:VAR=value[,VAR2=value2] …") the default bench
# and the bench under VAR=value, as <model>-<format>.json and <model>-<format>-<VAR>.json in $OUT/logs.tgz
# (each case's default run once); BASE_FN=1 adds Flash-Next IQ3_S from the .gpu-base binary
# (qwen3.8-flash-next-iq3_s-base.json), BASE_CASES others; NCU_KERNELS (a regex) the ncu sections of those
# 27B NVFP4 decode kernels (or of `bench gpu $NCU_ARGS`) into $OUT/ncu-detail.txt; NCU_DECODE ("name:model:format …") one
# decode step's kernels of each under ncu into $OUT/<name>.json. HYBRID_CASES
# ("format:VAR=value …") the hybrid bench at a 15 GiB budget, default and under VAR=value, as
# hybrid-<format>.json and hybrid-<format>-<VAR>.json; CPU_TOPK ("k …") the IQ3_S CPU expert
# bench at 16 threads for each top-k, as cpu-experts-iq3_s-top<k>.json (per-call fixed cost:
# the intercept of time against experts), and under $CPU_ENV (VAR=value) as
# cpu-experts-iq3_s-top<k>-<VAR>.json. Logs: $OUT/logs.tgz.
source tools/gpu_box/common.sh
for t in $TESTS; do
  step "$t" 150 ".gpu/tests/$t" --test-threads=1
done
for t in $EXACT_TESTS; do
  CAPY_EXACT_MATH=1 step "$t-exact" 120 ".gpu/tests/$t" --test-threads=1
done
# ENV_TESTS ("VAR=value:suite …"): a suite again under one setting, as <suite>-<VAR>.txt.
for case in $ENV_TESTS; do
  ( export "${case%%:*}"; t=${case#*:}; step "$t-${case%%=*}" 150 ".gpu/tests/$t" --test-threads=1 )
done
# The records go into logs.tgz with the logs: a device call returns only a few files.
bench() { # out-name binary model format
  step "$1" 150 "$2" bench --out "$LOGS/$1.json" gpu --synthetic "$3" --quant "$4" --decode-tokens 16
}
for case in $CASES; do
  model=${case%%:*} rest=${case#*:} format=${rest%%:*} setting=${rest#*:}
  [ -f "$LOGS/$model-$format.json" ] || bench "$model-$format" .gpu/capy-flash "$model" "$format"
  # Several settings at once: VAR=value,VAR2=value2 (the output named after the first).
  ( IFS=, read -ra settings <<< "$setting"; export "${settings[@]}"
    bench "$model-$format-${setting%%=*}" .gpu/capy-flash "$model" "$format" )
done
if [ -n "$BASE_FN$BASE_CASES" ]; then
  xz -dc .gpu-base/capy-flash.xz > /tmp/capy-base && chmod +x /tmp/capy-base
fi
[ -z "$BASE_FN" ] || bench qwen3.8-flash-next-iq3_s-base /tmp/capy-base qwen3.8-flash-next iq3_s
# BASE_CASES ("model:format …"): each from the .gpu binary and the .gpu-base one, as
# <model>-<format>.json and <model>-<format>-base.json.
for case in $BASE_CASES; do
  model=${case%%:*} format=${case#*:}
  [ -f "$LOGS/$model-$format.json" ] || bench "$model-$format" .gpu/capy-flash "$model" "$format"
  bench "$model-$format-base" /tmp/capy-base "$model" "$format"
done
hybrid() { # out-name format
  step "$1" 170 .gpu/capy-flash bench --out "$LOGS/$1.json" hybrid --format "$2" \
    --vram-budget 15GiB --threads 16 --layers 8 --tokens 64
}
for case in $HYBRID_CASES; do
  format=${case%%:*} setting=${case#*:}
  [ -f "$LOGS/hybrid-$format.json" ] || hybrid "hybrid-$format" "$format"
  ( export "$setting"; hybrid "hybrid-$format-${setting%%=*}" "$format" )
done
cpu_experts() { # out-name top-k
  step "$1" 90 .gpu/capy-flash bench --out "$LOGS/$1.json" \
    cpu-experts --format iq3_s --threads 16 --batch 1 --top-k "$2"
}
for k in $CPU_TOPK; do
  cpu_experts "cpu-experts-iq3_s-top$k" "$k"
  # CPU_ENV=VAR=value: each top-k again under it, as cpu-experts-iq3_s-top<k>-<VAR>.json.
  [ -z "$CPU_ENV" ] || ( export "$CPU_ENV"; cpu_experts "cpu-experts-iq3_s-top$k-${CPU_ENV%%=*}" "$k" )
done
for profile in $NCU_DECODE; do
  name=${profile%%:*} rest=${profile#*:}
  ncu_decode_profile "$name" --synthetic "${rest%%:*}" --quant "${rest#*:}"
done
# NCU_PREFILL=NAME: one whole Flash-Next IQ3_S prefill's kernels under ncu into $OUT/NAME.json.
[ -z "$NCU_PREFILL" ] || ncu_prefill_profile "$NCU_PREFILL" --synthetic qwen3.8-flash-next --quant iq3_s
# shellcheck disable=SC2086 # NCU_ARGS is a list of arguments
[ -z "$NCU_KERNELS" ] || ncu_detail "$NCU_KERNELS" "${NCU_LAUNCHES:-8}" $NCU_ARGS
finish
