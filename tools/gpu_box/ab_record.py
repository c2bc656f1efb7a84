#!/usr/bin/env python3
"""A same-run comparison of two `capy-flash bench gpu` records (kernels_pass.sh AB_ENV,
ab_pass.sh) as one bench/results file: the default record in full, the other's decode (and
prefill) figures, and their ratios.
Usage: ab_record.py DEFAULT.json OTHER.json "OTHER'S SETTING" "what the default adds" RUN OUT.json"""
import json, sys

default_path, other_path, setting, change, run, out_path = sys.argv[1:7]
default, other = json.load(open(default_path)), json.load(open(other_path))
d, o = default["decode"], other["decode"]
default["run"] = run
default["comparison"] = {
    "change": change,
    "baseline_setting": setting,
    "baseline_command": f"{setting} {other['command']}",
    "baseline_decode_tokens_per_s": o["tokens_per_s"],
    "baseline_median_step_ms": o["median_step_ms"],
    "baseline_bandwidth_roofline_ratio": o["bandwidth_roofline_ratio"],
    "decode_speedup_ratio": d["tokens_per_s"] / o["tokens_per_s"],
}
if "prefill" in default and "prefill" in other:
    p, q = default["prefill"], other["prefill"]
    default["comparison"].update({
        "baseline_prefill_tokens_per_s": q["tokens_per_s"],
        "baseline_prefill_matmul_roofline_ratio": q.get("matmul_roofline_ratio"),
        "prefill_speedup_ratio": p["tokens_per_s"] / q["tokens_per_s"],
    })
json.dump(default, open(out_path, "w"), indent=1)
print(json.dumps(default["comparison"], indent=1))
