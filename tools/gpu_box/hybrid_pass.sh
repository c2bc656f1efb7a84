#!/usr/bin/env bash
# One device call for the hybrid experts (carry [".gpu"] after tools/gpu_box/build.sh): the
# hybrid bench with its time breakdown for NVFP4 and IQ3_S at a 15 GiB budget (HYBRID_FORMATS);
# with FOOTPRINT=1 the configuration table's RAM promises at full size (48 layers × 512
# experts, page-locked); with CPU_EXPERTS=1 the CPU expert kernels at 16 threads; with
# COMPARE_RECORDS=1 the 27B NVFP4 bench with records and with blocks on the same card.
# Records come back as $OUT/*.json (keep the count under eight), logs as $OUT/logs.tgz.
source tools/gpu_box/common.sh
for f in ${HYBRID_FORMATS:-nvfp4 iq3_s}; do
  step "hybrid-$f" 170 .gpu/capy-flash bench --out "$OUT/hybrid-$f.json" hybrid --format "$f" \
    --vram-budget 15GiB --threads 16 --layers 8 --tokens 64
done
if [ -n "$FOOTPRINT" ]; then
  for f in nvfp4 iq3_s; do
    step "footprint-$f" 240 .gpu/capy-flash bench --out "$OUT/footprint-$f.json" hybrid --footprint \
      --format "$f" --layers 48 --vram-budget 15GiB
  done
fi
if [ -n "$CPU_EXPERTS" ]; then
  for run in iq3_s:avx512:0 iq3_s:avx512:1 iq3_s:avx2:0 iq3_s:avx2:1 nvfp4:avx512:0 nvfp4:avx512:1 \
             nvfp4:avx2:0 nvfp4:avx2:1; do
    IFS=: read -r f isa exact <<< "$run"
    CAPY_CPU_ISA=$isa CAPY_EXACT_MATH=$exact step "cpu-experts-$f-$isa-$exact" 90 .gpu/capy-flash \
      bench --out "$LOGS/cpu-experts-$f-$isa-exact$exact.json" cpu-experts --format "$f" --threads 16 --batch 1
  done
  ( cd "$LOGS" && tar czf "$OUT/cpu-experts.tgz" cpu-experts-*.json )
fi
if [ -n "$COMPARE_RECORDS" ]; then
  for r in 1:records 0:blocks; do
    CAPY_NVFP4_RECORDS=${r%%:*} step "${r#*:}" 200 .gpu/capy-flash bench --out "$OUT/gpu-${r#*:}.json" \
      gpu --synthetic qwen3.8-27b --quant nvfp4 --decode-tokens 16
  done
fi
finish
