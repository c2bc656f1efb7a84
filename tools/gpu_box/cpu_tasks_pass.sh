#!/usr/bin/env bash
# The CPU experts' task sizes on the box (issue 8), after build.sh: bench cpu-experts (IQ3_S
# fast path, 16 threads, top-k 3 and 10) with gate/up tasks of 16, 32 and 64 row pairs
# (CAPY_GATE_UP_ROWS) and down tasks of 16 rows against the default (~2.5 a worker); then the
# hybrid bench with the defaults and with 16-row down tasks, the A/B session 26 had no device
# time for. Every record goes into $LOGS, packed as $OUT/logs.tgz (a call returns only ~8 files).
source tools/gpu_box/common.sh
CE="cpu-experts --threads 16 --batch 1 --format iq3_s"
for k in 3 10; do
  for g in 16 32 64; do
    CAPY_GATE_UP_ROWS=$g step ce-g$g-k$k 60 .gpu/capy-flash bench --out "$LOGS/ce-g$g-k$k.json" $CE --top-k $k
  done
  CAPY_DOWN_ROWS=16 step ce-d16-k$k 60 .gpu/capy-flash bench --out "$LOGS/ce-d16-k$k.json" $CE --top-k $k
done
finish
H="hybrid --format iq3_s --vram-budget 15GiB --threads 16 --layers 8 --tokens 64"
step hy-default 120 .gpu/capy-flash bench --out "$LOGS/hy-default.json" $H; finish
CAPY_DOWN_ROWS=16 step hy-d16 120 .gpu/capy-flash bench --out "$LOGS/hy-d16.json" $H; finish
