#!/usr/bin/env python3
"""One bench/results file from a same-call set of `capy-flash bench gpu` records: the default
record in full and, for each baseline (another binary, or a setting), its prefill, MoE-layer
and decode figures with their ratios to the default's.
Usage: multi_record.py DEFAULT.json RUN CHANGE OUT.json BASELINE.json=LABEL [BASELINE.json=LABEL ...]
(LABEL: what the baseline is, e.g. "CAPY_MOE_PREFILL_DEVICE=0" or "binary of commit abc1234")."""
import json, sys

default_path, run, change, out_path = sys.argv[1:5]
default = json.load(open(default_path))
default["run"] = run
default["change"] = change
p, d, ops = default["prefill"], default["decode"], default.get("op_timings", {})
default_layer_ms = ops.get("moe_experts_prefill_device_routed_ms") or ops.get("moe_experts_prefill_ms")
comparisons = []
for arg in sys.argv[5:]:
    path, label = arg.split("=", 1)
    other = json.load(open(path))
    q, o, oops = other["prefill"], other["decode"], other.get("op_timings", {})
    layer_ms = oops.get("moe_experts_prefill_device_routed_ms") or oops.get("moe_experts_prefill_ms")
    comparisons.append({
        "baseline": label,
        "baseline_command": other["command"],
        "baseline_commit": other.get("commit"),
        "baseline_prefill_tokens_per_s": q["tokens_per_s"],
        "baseline_prefill_matmul_roofline_ratio": q.get("matmul_roofline_ratio"),
        "prefill_speedup_ratio": p["tokens_per_s"] / q["tokens_per_s"],
        "baseline_moe_layer_prefill_ms": layer_ms,
        "moe_layer_prefill_speedup_ratio": layer_ms / default_layer_ms if layer_ms and default_layer_ms else None,
        "baseline_decode_tokens_per_s": o["tokens_per_s"],
        "decode_speedup_ratio": d["tokens_per_s"] / o["tokens_per_s"],
    })
default["comparisons"] = comparisons
json.dump(default, open(out_path, "w"), indent=1)
print(json.dumps({"prefill_tokens_per_s": p["tokens_per_s"], "matmul_roofline_ratio": p.get("matmul_roofline_ratio"),
                  "moe_layer_prefill_ms": default_layer_ms, "comparisons": comparisons}, indent=1))
