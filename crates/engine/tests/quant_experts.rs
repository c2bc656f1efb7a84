//! CPU expert kernels: every ISA against the scalar reference, and the fused expert FFN
//! against an f64 reference on the dequantised weights.
//!
//! Dequantisation must be bit-identical on every ISA. Float dot products differ only by
//! reassociation; the documented tolerance is `|Δ| ≤ 1e-5 · Σ|terms|` per output (f32
//! epsilon is 6e-8; the longest reduction here is 2560 terms).
//!
//! AVX-512 variants are skipped, with a printed reason, on CPUs without AVX-512.

use capy_engine::backend::cpu::experts::format::{self, dequantize_row, dequantize_row_scalar};
use capy_engine::backend::cpu::experts::{
    moe_experts, moe_experts_with, ExpertLayout, ExpertMatrix, ExpertPool, ExpertSet, ExpertShape,
    MathPath, MoeScratch, RowFormat,
};
use capy_engine::backend::cpu::simd::Isa;
use capy_engine::quant::fp8::{self, Fp8Scaling};
use capy_engine::quant::nvfp4::Nvfp4Matrix;
use capy_engine::quant::GgmlType;
use std::path::PathBuf;

/// The SIMD ISAs this CPU can run; prints why AVX-512 (or AVX2) is skipped.
fn simd_isas() -> Vec<Isa> {
    let best = Isa::best_supported();
    let mut v = Vec::new();
    if best >= Isa::Avx2 {
        v.push(Isa::Avx2);
    } else {
        eprintln!("skipping AVX2 variants: this CPU lacks AVX2/FMA/F16C");
    }
    if best >= Isa::Avx512 {
        v.push(Isa::Avx512);
    } else {
        eprintln!("skipping AVX-512 variants: this CPU lacks AVX-512 F/BW/VL (run these tests on an AVX-512 machine)");
    }
    v
}

fn down_format_for(fmt: RowFormat, i: usize) -> RowFormat {
    if i.is_multiple_of(fmt.block_len()) {
        fmt
    } else {
        RowFormat::Ggml(GgmlType::Q2_0)
    }
}

fn random_set(fmt: RowFormat, shape: ExpertShape, experts: usize, seed: u64) -> ExpertSet {
    let layout = ExpertLayout::new(fmt, down_format_for(fmt, shape.intermediate), shape).unwrap();
    let mut set = ExpertSet::zeroed(layout, experts);
    set.randomize(seed);
    set
}

#[test]
fn dequantisation_is_bit_identical_on_every_isa() {
    let shape = ExpertShape {
        hidden: 512,
        intermediate: 256,
    };
    for fmt in RowFormat::ALL {
        let set = random_set(fmt, shape, 2, 7);
        for e in 0..2 {
            for (m, rows, cols) in [
                (ExpertMatrix::Gate, 256, 512),
                (ExpertMatrix::Up, 256, 512),
                (ExpertMatrix::Down, 512, 256),
            ] {
                let f = if m == ExpertMatrix::Down {
                    set.layout.down_format
                } else {
                    fmt
                };
                for r in (0..rows).step_by(37) {
                    let mut want = vec![0f32; cols];
                    dequantize_row_scalar(f, set.row(e, m, r), &mut want);
                    assert!(
                        want.iter().all(|v| v.is_finite()),
                        "{} produced non-finite values",
                        f.name()
                    );
                    for isa in simd_isas() {
                        let mut got = vec![0f32; cols];
                        dequantize_row(isa, f, set.row(e, m, r), &mut got);
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                w.to_bits(),
                                "{} {} expert {e} {m:?} row {r} [{i}]: {g} vs {w}",
                                f.name(),
                                isa.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/quant")
            .join(name),
    )
    .unwrap()
}

#[test]
fn nvfp4_and_fp8_repacking_keeps_the_values() {
    let (n, k) = (16, 128);
    let raw = fixture("nvfp4.bin");
    let (codes, scales) = (&raw[..n * k / 2], &raw[n * k / 2..n * k / 2 + n * k / 16]);
    // Without weight_scale_2 (the kernels apply it per row), the repacked row must equal the
    // ModelOpt row exactly.
    let m = Nvfp4Matrix::new("fixture", n, k, codes, scales, 1.0).unwrap();
    let want = m.to_f32();
    for r in 0..n {
        let mut packed = Vec::new();
        format::repack_nvfp4_row(codes, scales, k, r, &mut packed);
        for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
            let mut got = vec![0f32; k];
            dequantize_row(isa, RowFormat::Nvfp4, &packed, &mut got);
            assert_eq!(
                got,
                want[r * k..(r + 1) * k],
                "nvfp4 row {r} {}",
                isa.name()
            );
        }
    }
    // FP8 with 128×128 block scales: use the first 256 columns (whole blocks).
    let (n, k) = (200, 300);
    let raw = fixture("fp8_block.bin");
    let weight = &raw[..n * k];
    let block_scales: Vec<f32> = raw[n * k..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want = fp8::dequantize(
        "fixture",
        weight,
        n,
        k,
        &block_scales,
        Fp8Scaling::Block {
            rows: 128,
            cols: 128,
        },
    )
    .unwrap();
    for r in [0, 127, 128, 199] {
        let mut packed = Vec::new();
        format::repack_fp8_row(weight, &block_scales, k, r, &mut packed);
        let mut got = vec![0f32; 256];
        dequantize_row(Isa::best_supported(), RowFormat::Fp8B128, &packed, &mut got);
        assert_eq!(got, want[r * k..r * k + 256], "fp8 row {r}");
    }
}

/// f64 reference of the routed-expert sum on the dequantised weights; also returns, per
/// output, the sum of absolute terms (for the tolerance).
fn reference(
    set: &ExpertSet,
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    top_k: usize,
) -> (Vec<f64>, Vec<f64>) {
    let ExpertShape {
        hidden: h,
        intermediate: i,
    } = set.layout.shape;
    let n = x.len() / h;
    let mut out = vec![0f64; n * h];
    let mut mag = vec![0f64; n * h];
    for t in 0..n {
        for k in 0..top_k {
            let e = ids[t * top_k + k] as usize;
            let w = weights[t * top_k + k] as f64;
            let (g, u, d) = (
                set.matrix_f32(e, ExpertMatrix::Gate),
                set.matrix_f32(e, ExpertMatrix::Up),
                set.matrix_f32(e, ExpertMatrix::Down),
            );
            let xt = &x[t * h..(t + 1) * h];
            let mut hv = vec![0f64; i];
            let mut hmag = vec![0f64; i];
            for r in 0..i {
                let gd: f64 = (0..h).map(|c| g[r * h + c] as f64 * xt[c] as f64).sum();
                let ud: f64 = (0..h).map(|c| u[r * h + c] as f64 * xt[c] as f64).sum();
                let gm: f64 = (0..h)
                    .map(|c| (g[r * h + c] as f64 * xt[c] as f64).abs())
                    .sum();
                let um: f64 = (0..h)
                    .map(|c| (u[r * h + c] as f64 * xt[c] as f64).abs())
                    .sum();
                let silu = gd / (1.0 + (-gd).exp());
                hv[r] = silu * ud;
                hmag[r] = gm.max(gd.abs()) * um.max(ud.abs()) + hv[r].abs();
            }
            for r in 0..h {
                out[t * h + r] += w * (0..i).map(|c| d[r * i + c] as f64 * hv[c]).sum::<f64>();
                mag[t * h + r] += w
                    * (0..i)
                        .map(|c| (d[r * i + c] as f64).abs() * hmag[c])
                        .sum::<f64>();
            }
        }
    }
    (out, mag)
}

#[test]
fn fused_expert_ffn_matches_the_f64_reference_on_every_isa_and_thread_count() {
    let shape = ExpertShape {
        hidden: 512,
        intermediate: 256,
    };
    let (experts, top_k, n) = (6, 3, 5);
    let pools = [ExpertPool::new(1, false), ExpertPool::new(3, false)];
    for fmt in RowFormat::ALL {
        let set = random_set(fmt, shape, experts, 11);
        let mut seed = 12345u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let x: Vec<f32> = (0..n * shape.hidden).map(|_| rnd() * 2.0 - 1.0).collect();
        // Token 0 routes to the same expert as token 1 in one slot (shared experts), others vary.
        let ids: Vec<u32> = (0..n * top_k)
            .map(|p| ((p / top_k) * 2 + p % top_k) as u32 % experts as u32)
            .collect();
        let weights: Vec<f32> = (0..ids.len()).map(|_| 0.2 + rnd() * 0.5).collect();
        let (want, mag) = reference(&set, &x, &ids, &weights, top_k);
        let mut scalar_out = None;
        for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
            let mut per_pool = Vec::new();
            for pool in &pools {
                let mut scratch = MoeScratch::new(shape, experts, n, top_k, pool.threads());
                let mut out = vec![0.5f32; x.len()]; // accumulates into existing values
                moe_experts_with(
                    pool,
                    isa,
                    MathPath::Exact,
                    &set,
                    &x,
                    &ids,
                    &weights,
                    top_k,
                    &mut out,
                    &mut scratch,
                )
                .unwrap();
                for (j, (o, (w, m))) in out.iter().zip(want.iter().zip(&mag)).enumerate() {
                    let err = (*o as f64 - 0.5 - w).abs();
                    assert!(
                        err <= 1e-5 * m + 1e-6,
                        "{} {} threads {}: out[{j}] = {o}, reference {}, |Δ| {err} > 1e-5·{m}",
                        fmt.name(),
                        isa.name(),
                        pool.threads(),
                        w + 0.5
                    );
                }
                per_pool.push(out);
            }
            assert_eq!(
                per_pool[0],
                per_pool[1],
                "{} {}: the result depends on the thread count",
                fmt.name(),
                isa.name()
            );
            match &scalar_out {
                None => scalar_out = Some(per_pool.remove(0)),
                Some(s) => {
                    for (j, (a, b)) in per_pool[0].iter().zip(s).enumerate() {
                        assert!(
                            ((a - b) as f64).abs() <= 1e-5 * mag[j] + 1e-6,
                            "{} {} vs scalar at {j}: {a} vs {b}",
                            fmt.name(),
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}

/// The fast path (int8 activations): every ISA equals the scalar fast kernels within float
/// reassociation (the integer group sums are exact), the result does not depend on the
/// thread count, and it stays close to the f64 reference on the dequantised weights (the
/// deviation is the activations' 8-bit rounding; this bounds it at 2% of Σ|terms|, and
/// prints the maximum error relative to the largest output).
#[test]
fn fast_path_matches_scalar_on_every_isa_and_stays_close_to_exact() {
    let shape = ExpertShape {
        hidden: 512,
        intermediate: 256,
    };
    let (experts, top_k, n) = (6, 3, 5);
    let pools = [ExpertPool::new(1, false), ExpertPool::new(3, false)];
    for fmt in RowFormat::ALL {
        let set = random_set(fmt, shape, experts, 21);
        let mut seed = 777u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let x: Vec<f32> = (0..n * shape.hidden).map(|_| rnd() * 2.0 - 1.0).collect();
        let ids: Vec<u32> = (0..n * top_k)
            .map(|p| ((p / top_k) * 2 + p % top_k) as u32 % experts as u32)
            .collect();
        let weights: Vec<f32> = (0..ids.len()).map(|_| 0.2 + rnd() * 0.5).collect();
        let (want, mag) = reference(&set, &x, &ids, &weights, top_k);
        let max_out = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let mut scalar_out: Option<Vec<f32>> = None;
        for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
            let mut per_pool = Vec::new();
            for pool in &pools {
                let mut scratch = MoeScratch::new(shape, experts, n, top_k, pool.threads());
                let mut out = vec![0f32; x.len()];
                moe_experts_with(
                    pool,
                    isa,
                    MathPath::Fast,
                    &set,
                    &x,
                    &ids,
                    &weights,
                    top_k,
                    &mut out,
                    &mut scratch,
                )
                .unwrap();
                per_pool.push(out);
            }
            assert_eq!(
                per_pool[0],
                per_pool[1],
                "{} {}: fast result depends on the thread count",
                fmt.name(),
                isa.name()
            );
            let out = per_pool.remove(0);
            let mut max_err = 0f64;
            for (j, (o, (w, m))) in out.iter().zip(want.iter().zip(&mag)).enumerate() {
                let err = (*o as f64 - w).abs();
                max_err = max_err.max(err);
                assert!(
                    err <= 2e-2 * m + 1e-6,
                    "{} {} fast: out[{j}] = {o}, reference {w}, |Δ| {err} > 2e-2·{m}",
                    fmt.name(),
                    isa.name()
                );
            }
            if isa == Isa::Scalar {
                eprintln!(
                    "{}: fast path max |Δ| / max |out| = {:.2e}",
                    fmt.name(),
                    max_err / max_out
                );
            }
            match &scalar_out {
                None => scalar_out = Some(out),
                Some(s) => {
                    for (j, (a, b)) in out.iter().zip(s).enumerate() {
                        assert!(
                            ((a - b) as f64).abs() <= 1e-5 * mag[j] + 1e-6,
                            "{} {} fast vs scalar fast at {j}: {a} vs {b}",
                            fmt.name(),
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn bad_calls_are_refused() {
    let shape = ExpertShape {
        hidden: 256,
        intermediate: 256,
    };
    let set = random_set(RowFormat::Ggml(GgmlType::Q8_0), shape, 2, 1);
    let pool = ExpertPool::new(1, false);
    let mut scratch = MoeScratch::new(shape, 2, 1, 1, 1);
    let x = vec![0f32; 256];
    let mut out = vec![0f32; 256];
    let e = moe_experts(
        &pool,
        Isa::Scalar,
        &set,
        &x,
        &[5],
        &[1.0],
        1,
        &mut out,
        &mut scratch,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("expert id 5"), "{e}");
    let e = ExpertLayout::new(
        RowFormat::Ggml(GgmlType::Iq3S),
        RowFormat::Ggml(GgmlType::Iq3S),
        ExpertShape {
            hidden: 2560,
            intermediate: 640,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("640") && e.contains("iq3_s"), "{e}");
    assert!(RowFormat::parse("q4_k")
        .unwrap_err()
        .to_string()
        .contains("nvfp4"));
}

/// The `bench cpu-experts` core as an ignored test, so the bench runs from the test binary
/// too (no CLI needed): `CAPY_BENCH_FORMAT=nvfp4 CAPY_BENCH_THREADS=16 CAPY_BENCH_BATCH=1
/// <test-binary> --ignored --nocapture bench_cpu_experts`. Prints the JSON report.
#[test]
#[ignore = "a benchmark: run explicitly"]
fn bench_cpu_experts() {
    use capy_engine::backend::cpu::experts::bench::{run, BenchParams};
    let var = |k: &str, d: usize| std::env::var(k).ok().map_or(d, |v| v.parse().expect(k));
    let format = std::env::var("CAPY_BENCH_FORMAT").unwrap_or_else(|_| "nvfp4".into());
    let params = BenchParams {
        format: RowFormat::parse(&format).unwrap(),
        down_format: std::env::var("CAPY_BENCH_DOWN_FORMAT")
            .ok()
            .map(|f| RowFormat::parse(&f).unwrap()),
        threads: var("CAPY_BENCH_THREADS", 0),
        batch: var("CAPY_BENCH_BATCH", 1),
        experts: var("CAPY_BENCH_EXPERTS", 512),
        top_k: var("CAPY_BENCH_TOP_K", 10),
        hidden: var("CAPY_BENCH_HIDDEN", 2560),
        intermediate: var("CAPY_BENCH_INTERMEDIATE", 640),
        iters: var("CAPY_BENCH_ITERS", 50),
        isa: Isa::detect(),
        path: capy_engine::backend::cpu::experts::fused::math_path(),
        bandwidth_mib: var("CAPY_BENCH_BANDWIDTH_MIB", 2048),
        seed: 1,
    };
    let report = run(&params).unwrap();
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
}

/// A small `bench cpu-experts` run reports where its calls' time went, in order: the job is
/// published after the grouping, the gate/up tasks run out before the down rows end, and the
/// caller returns after the last worker.
#[test]
fn the_cpu_experts_bench_reports_each_calls_timeline() {
    use capy_engine::backend::cpu::experts::bench::{run, BenchParams};
    let params = BenchParams {
        format: RowFormat::Ggml(GgmlType::Iq3S),
        down_format: Some(RowFormat::Ggml(GgmlType::Q2_0)),
        threads: 2,
        batch: 1,
        experts: 16,
        top_k: 4,
        hidden: 512,
        intermediate: 256,
        iters: 6,
        isa: Isa::detect(),
        path: MathPath::Fast,
        bandwidth_mib: 16,
        seed: 3,
    };
    let report = run(&params).unwrap();
    let t = &report["timeline"];
    assert_eq!(t["calls"], 6, "{t}");
    let f = |k: &str| t[k].as_f64().unwrap_or_else(|| panic!("{k} in {t}"));
    assert!(f("before_job_us") > 0.0, "{t}");
    assert!(f("before_job_us") <= f("gate_up_end_first_us"), "{t}");
    assert!(f("gate_up_end_first_us") <= f("gate_up_end_last_us"), "{t}");
    assert!(f("gate_up_end_last_us") <= f("down_end_last_us"), "{t}");
    assert!(f("down_end_first_us") <= f("down_end_last_us"), "{t}");
    assert!(f("down_end_last_us") <= f("total_us"), "{t}");
    assert!(
        f("join_us") >= 0.0 && f("wait_mean_us") <= f("wait_max_us"),
        "{t}"
    );
    assert!(f("busy_ratio") > 0.0 && f("busy_ratio") <= 1.0, "{t}");
}
