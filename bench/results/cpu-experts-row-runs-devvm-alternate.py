import json, os, subprocess, sys, statistics as st
reps = int(sys.argv[1]); outp = sys.argv[2]
bins = {"before": "/tmp/capy-before", "after": "/tmp/capy-after"}
res = {}
for rep in range(reps):
    for fmt in ["iq3_s", "nvfp4"]:
        for isa in ["avx512", "avx2"]:
            for exact in ["1", "0"]:
                key = f"{fmt} {isa} {'exact' if exact=='1' else 'fast'}"
                order = ["before", "after"] if rep % 2 == 0 else ["after", "before"]
                for b in order:
                    env = dict(os.environ, CAPY_CPU_ISA=isa, CAPY_EXACT_MATH=exact)
                    o = subprocess.run([bins[b], "bench", "cpu-experts", "--format", fmt, "--batch", "1",
                        "--threads", "1", "--iters", "3", "--experts", "16", "--top-k", "4",
                        "--bandwidth-mib", "64"], env=env, capture_output=True, text=True, check=True)
                    d = json.loads(o.stdout)
                    r = res.setdefault(key, {})
                    for m in ["gate_up_gbps", "down_gbps", "weighted_gbps"]:
                        r.setdefault(f"{m}_{b}", []).append(round(d["in_cache"][m], 3))
                    r[f"fast_vs_exact_{b}"] = d["fast_vs_exact"]
                    r["kernels_gate_up_down"] = [d["params"]["kernel_gate_up"], d["params"]["kernel_down"], d["params"]["down_format"]]
json.dump(res, open(outp, "w"), indent=1)
for k, r in res.items():
    line = [k]
    for m in ["gate_up_gbps", "down_gbps", "weighted_gbps"]:
        b, a = r[f"{m}_before"], r[f"{m}_after"]
        line.append(f"{m[:-5]} best {max(b):.2f}->{max(a):.2f} ({max(a)/max(b):.3f}) med {st.median(b):.2f}->{st.median(a):.2f} ({st.median(a)/st.median(b):.3f})")
    print(" | ".join(line))
    print("   fve same:", r["fast_vs_exact_before"] == r["fast_vs_exact_after"])
