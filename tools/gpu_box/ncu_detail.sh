#!/usr/bin/env bash
# The ncu sections (launch, occupancy, speed of light, memory) of the decode kernels whose
# names match $KERNELS (a regex; default the norms and attention), from one 27B NVFP4 decode
# step (BENCH_ARGS: other `bench gpu` arguments, e.g. "--synthetic qwen3.8-flash-next --quant
# iq3_s"): registers, spills, achieved occupancy and where they wait. Text into
# $OUT/ncu-detail.txt.
source tools/gpu_box/common.sh
KERNELS=${KERNELS:-"attn_split|add_rms_norm|gated_delta_rule"}
CAPY_PROFILE_DECODE_STEPS=1 step ncu-detail 300 ncu --clock-control none --cache-control none \
  --profile-from-start off -k "regex:$KERNELS" --launch-count ${LAUNCHES:-6} \
  --section LaunchStats --section Occupancy --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats \
  .gpu/capy-flash bench --out "$LOGS/gpu-ncu.json" gpu ${BENCH_ARGS:---synthetic qwen3.8-27b --quant nvfp4} \
  --decode-tokens 4
cp "$LOGS/ncu-detail.txt" "$OUT/ncu-detail.txt"
finish
