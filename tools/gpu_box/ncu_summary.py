#!/usr/bin/env python3
"""Sums an ncu CSV (--metrics gpu__time_duration.sum --csv) by kernel name and grid: launches,
total and mean microseconds, share of the profiled time. Usage: ncu_summary.py FILE.csv STEPS
(STEPS: decode steps the profile bracketed, to report per-step figures; 1 for a prefill).
With a third argument `name`, kernels are summed by name alone, not by name and grid (a
prefill launches the same kernel at many grid sizes). Prints JSON."""
import csv
import json
import sys
from collections import defaultdict


def main(path, steps, by_name=False):
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        ns = float(r["Metric Value"].replace(",", ""))
        rows.append((r["Kernel Name"], r["Grid Size"], r["Block Size"], ns))
    by = defaultdict(lambda: [0, 0.0])
    for name, grid, block, ns in rows:
        key = name if by_name else f"{name} grid{grid} block{block}"
        by[key][0] += 1
        by[key][1] += ns
    total = sum(v[1] for v in by.values())
    kernels = sorted(by.items(), key=lambda kv: -kv[1][1])
    out = {
        "profiled_kernels": len(rows),
        "steps": steps,
        "kernels_per_step": len(rows) / steps,
        "gpu_time_per_step_us": total / steps / 1e3,
        "by_kernel": [
            {
                "kernel": k,
                "launches_per_step": n / steps,
                "us_per_step": ns / steps / 1e3,
                "mean_us": ns / n / 1e3,
                "share_ratio": ns / total,
            }
            for k, (n, ns) in kernels
        ],
    }
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1,
         len(sys.argv) > 3 and sys.argv[3] == "name")
