#!/usr/bin/env bash
# The ncu sections (launch, occupancy, speed of light, memory) of the decode kernels whose
# names match $KERNELS (a regex; default the norms and attention), from one 27B NVFP4 decode
# step (BENCH_ARGS: other `bench gpu` arguments, e.g. "--synthetic qwen3.8-flash-next --quant
# iq3_s"): registers, spills, achieved occupancy and where they wait. Text into
# $OUT/ncu-detail.txt.
source tools/gpu_box/common.sh
# shellcheck disable=SC2086 # BENCH_ARGS is a word list
ncu_detail "${KERNELS:-attn_split|add_rms_norm|gated_delta_rule}" "${LAUNCHES:-6}" ${BENCH_ARGS:-}
finish
