//! Every op of the CUDA backend against the CPU reference on random inputs, and the synthetic
//! model end to end on both backends.
//!
//! Tolerance for the f32 paths (exact math): |gpu − cpu| ≤ 1e-4 · (1 + |cpu|), per element.
//! The two backends sum in different orders (warp trees, cuBLAS blocking against the CPU's
//! SIMD lanes), which moves results by a few ulp of the largest partial sums; 1e-4 leaves room
//! for that over the longest reductions here (17,408 terms) and nothing more.
//!
//! Without a CUDA driver (CI, laptops) each test prints why it is skipped and passes.
#![cfg(feature = "cuda")]

use capy_engine::backend::cpu::{CpuBackend, CpuTensor};
use capy_engine::backend::cuda::CudaBackend;
use capy_engine::backend::{
    argmax_rows_on_host, attention_inputs_composed, AttentionShape, Backend, DeltaRuleMode,
    DeltaRuleShape, NormScale,
};
use capy_engine::config::GateActivation;
use capy_engine::tensor::{Bytes, DType, HostTensor};

const ATOL: f32 = 1e-4;
const RTOL: f32 = 1e-4;

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::with_exact_math(0, None, true) {
        Ok(b) => {
            println!("running on {}", b.name());
            Some(b)
        }
        Err(e) => {
            capy_engine::backend::cuda::no_device_for_test(&format!("{e:#}"));
            None
        }
    }
}

/// The default (fast-math) backend, for the tests that bound how far it strays from exact.
fn fast_gpu() -> Option<CudaBackend> {
    match CudaBackend::with_exact_math(0, None, false) {
        Ok(b) => Some(b),
        Err(e) => {
            capy_engine::backend::cuda::no_device_for_test(&format!("{e:#}"));
            None
        }
    }
}

/// `(max |got − want|, max |want|)`.
fn deviation(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().map(|v| v.abs()).fold(0.0, f32::max);
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    (worst, scale)
}

fn attention_shape(heads: usize, kv: usize, d: usize) -> AttentionShape {
    AttentionShape {
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: d,
        scale: (d as f32).powf(-0.5),
    }
}

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

fn host_matrix(name: &str, rows: usize, cols: usize, values: &[f32], dtype: DType) -> HostTensor {
    let bytes: Vec<u8> = match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        other => panic!("no test matrices of {other}"),
    };
    HostTensor {
        name: name.into(),
        dtype,
        shape: vec![rows, cols],
        data: Bytes::from_vec(bytes),
    }
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_close_tol(got, want, ATOL, RTOL, what)
}

fn assert_close_tol(got: &[f32], want: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: {} values, expected {}",
        got.len(),
        want.len()
    );
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{what}: element {i}: gpu {g} vs cpu {w} (|Δ| {err:e})"
        );
        worst = worst.max(err);
    }
    println!("{what}: {} values, max |Δ| {worst:.2e}", got.len());
}

/// The same activation on both backends.
fn pair(
    g: &CudaBackend,
    rows: usize,
    cols: usize,
    data: &[f32],
) -> (CpuTensor, <CudaBackend as Backend>::Act) {
    (
        CpuBackend::new().from_host(rows, cols, data),
        g.from_host(rows, cols, data),
    )
}

#[test]
fn layout_ops_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(1);
    let data = r.vec(7 * 12, 1.0);
    let (xc, xg) = pair(&g, 7, 12, &data);
    assert_eq!(g.shape(&xg), (7, 12));
    assert_eq!(g.to_host(&xg), data);
    assert_eq!(g.to_host(&g.rows(&xg, 2..5)), c.rows(&xc, 2..5).data);
    assert_eq!(g.to_host(&g.cols(&xg, 3..10)), c.cols(&xc, 3..10).data);
    let parts_c = [c.rows(&xc, 0..2), c.rows(&xc, 4..7)];
    let parts_g = [g.rows(&xg, 0..2), g.rows(&xg, 4..7)];
    assert_eq!(g.to_host(&g.cat_rows(&parts_g)), c.cat_rows(&parts_c).data);
    // A cache grown one row at a time, past several capacity doublings, then rolled back.
    let mut cache_c = c.zeros(0, 12);
    let mut cache_g = g.zeros(0, 12);
    for i in 0..40 {
        let row = r.vec(12, 1.0);
        c.append_rows(&mut cache_c, &c.from_host(1, 12, &row));
        g.append_rows(&mut cache_g, &g.from_host(1, 12, &row));
        if i == 20 {
            let block = r.vec(3 * 12, 1.0);
            c.append_rows(&mut cache_c, &c.from_host(3, 12, &block));
            g.append_rows(&mut cache_g, &g.from_host(3, 12, &block));
        }
    }
    assert_eq!(g.to_host(&cache_g), cache_c.data);
    let snapshot = cache_g.clone();
    c.truncate_rows(&mut cache_c, 17);
    g.truncate_rows(&mut cache_g, 17);
    assert_eq!(g.shape(&cache_g), (17, 12));
    assert_eq!(g.to_host(&cache_g), cache_c.data);
    // The clone is independent of the truncated original.
    assert_eq!(g.shape(&snapshot), (43, 12));
    let row = r.vec(12, 1.0);
    c.append_rows(&mut cache_c, &c.from_host(1, 12, &row));
    g.append_rows(&mut cache_g, &g.from_host(1, 12, &row));
    assert_eq!(g.to_host(&cache_g), cache_c.data);
    assert_eq!(g.to_host(&g.zeros(3, 5)), vec![0.0; 15]);
}

/// Copies large enough to go through the page-locked staging buffers (4 MiB and up, in 32 MiB
/// pieces), at sizes that end inside a piece, interleaved with kernels on the same stream; and
/// a restored KV cache that appends in place.
#[test]
fn large_copies_round_trip_through_staging() {
    let Some(g) = gpu() else { return };
    let mut r = Rng(11);
    let cols = 1024;
    let mut kept = Vec::new();
    for rows in [1024usize, 8192 + 1, 25_000 + 3] {
        let data = r.vec(rows * cols, 1.0);
        let x = g.from_host(rows, cols, &data);
        // A kernel between the upload and the download, reading what was uploaded.
        let mut doubled = x.clone();
        g.add_assign(&mut doubled, &x);
        assert_eq!(g.to_host(&x), data, "{rows} rows uploaded and read back");
        let want: Vec<f32> = data.iter().map(|v| v + v).collect();
        assert_eq!(g.to_host(&doubled), want, "{rows} rows doubled");
        kept.push((x, data));
    }
    // Several uploads queued back to back reuse the two stages; every one arrived intact.
    for (x, data) in &kept {
        assert_eq!(&g.to_host(x), data);
    }
    let rows = 6000;
    let data = r.vec(rows * cols, 1.0);
    let mut kv = g.from_host_with_capacity(rows, cols, rows + 512, &data);
    assert_eq!(kv.capacity(), rows + 512);
    let more = r.vec(300 * cols, 1.0);
    g.append_rows(&mut kv, &g.from_host(300, cols, &more));
    assert_eq!(kv.capacity(), rows + 512, "the append stayed in place");
    let mut want = data;
    want.extend_from_slice(&more);
    assert_eq!(g.to_host(&kv), want);
}

#[test]
fn elementwise_ops_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(2);
    let (n, m) = (9, 1000);
    let a = r.vec(n * m, 4.0);
    let b = r.vec(n * m, 4.0);
    let (ac, ag) = pair(&g, n, m, &a);
    let (bc, bg) = pair(&g, n, m, &b);
    assert_close(
        &g.to_host(&g.silu_mul(&ag, &bg)),
        &c.silu_mul(&ac, &bc).data,
        "silu_mul",
    );
    assert_close(
        &g.to_host(&g.sigmoid_gate(&ag, &bg)),
        &c.sigmoid_gate(&ac, &bc).data,
        "sigmoid_gate",
    );
    let (mut xc, mut xg) = (ac.clone(), ag.clone());
    c.add_assign(&mut xc, &bc);
    g.add_assign(&mut xg, &bg);
    assert_close(&g.to_host(&xg), &xc.data, "add_assign");
    // GDN gates, including inputs past softplus's threshold of 20.
    let heads = 48;
    let mut av = r.vec(n * heads, 8.0);
    av[0] = 25.0;
    av[1] = -30.0;
    let bv = r.vec(n * heads, 8.0);
    let a_log = r.vec(heads, 1.0);
    let dt_bias = r.vec(heads, 1.0);
    let (gc, betac) = c.delta_rule_gates(
        &c.from_host(n, heads, &av),
        &c.from_host(n, heads, &bv),
        &a_log,
        &dt_bias,
    );
    let (gg, betag) = g.delta_rule_gates(
        &g.from_host(n, heads, &av),
        &g.from_host(n, heads, &bv),
        &g.vector(&a_log).unwrap(),
        &g.vector(&dt_bias).unwrap(),
    );
    assert_close(&g.to_host(&gg), &gc.data, "delta_rule_gates g");
    assert_close(&g.to_host(&betag), &betac.data, "delta_rule_gates beta");
}

#[test]
fn norms_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(3);
    for (rows, cols, group) in [
        (3, 5120, 5120),
        (5, 24 * 256, 256),
        (2, 48 * 128, 128),
        (4, 48, 16),
        (1, 40, 40),
    ] {
        let x = r.vec(rows * cols, 3.0);
        let w = r.vec(group, 0.5);
        let (xc, xg) = pair(&g, rows, cols, &x);
        let wg = g.vector(&w).unwrap();
        for scale in [NormScale::OnePlus, NormScale::Plain] {
            assert_close(
                &g.to_host(&g.rms_norm(&xg, &wg, 1e-6, scale, group)),
                &c.rms_norm(&xc, &w, 1e-6, scale, group).data,
                &format!("rms_norm {scale:?} {rows}x{cols}/{group}"),
            );
        }
        let z = r.vec(rows * cols, 3.0);
        let (zc, zg) = pair(&g, rows, cols, &z);
        assert_close(
            &g.to_host(&g.rms_norm_gated(&xg, &zg, &wg, 1e-6, group)),
            &c.rms_norm_gated(&xc, &zc, &w, 1e-6, group).data,
            &format!("rms_norm_gated {rows}x{cols}/{group}"),
        );
    }
}

/// One wide decode row normed over several blocks that meet at a barrier in device memory
/// (`add_rms_norm_split`) against the one-block kernel, call after call through the same
/// barrier: the residual bit for bit, the normed row within the other summation order.
#[test]
fn split_norm_matches_the_one_block_norm_call_after_call() {
    let Some(g) = gpu() else { return };
    let mut r = Rng(41);
    for group in [5120, 2560, 1056] {
        let w = r.vec(group, 0.5);
        let wg = g.vector(&w).unwrap();
        for call in 0..40 {
            let (x, y) = (r.vec(group, 3.0), r.vec(group, 3.0));
            let yg = g.from_host(1, group, &y);
            let run = |split: bool| {
                g.set_norm_split(split);
                let mut xg = g.from_host(1, group, &x);
                let out = if call % 4 == 3 {
                    g.rms_norm(&xg, &wg, 1e-6, NormScale::OnePlus, group)
                } else {
                    g.add_rms_norm(&mut xg, &yg, &wg, 1e-6, NormScale::OnePlus, group)
                };
                (g.to_host(&xg), g.to_host(&out))
            };
            let (x_split, out_split) = run(true);
            let (x_one, out_one) = run(false);
            let what = format!("{group} values, call {call}");
            assert_eq!(x_split, x_one, "residual of the split norm, {what}");
            assert_close_tol(
                &out_split,
                &out_one,
                1e-6,
                1e-6,
                &format!("split norm, {what}"),
            );
        }
    }
    g.set_norm_split(true);
}

#[test]
fn embedding_and_rope_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(4);
    let (vocab, h) = (300, 72);
    let table = r.vec(vocab * h, 1.0);
    let ids = [0u32, 299, 17, 17, 5];
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let t = host_matrix("embed", vocab, h, &table, dtype);
        let (mc, mg) = (c.matrix(&t).unwrap(), g.matrix(&t).unwrap());
        assert_eq!(
            g.to_host(&g.embedding(&mg, &ids)),
            c.embedding(&mc, &ids).data,
            "embedding {dtype}"
        );
        let repeated = g.embedding_repeated(&mg, &ids, 4);
        assert_eq!(g.shape(&repeated), (ids.len(), 4 * h));
        assert_eq!(
            g.to_host(&repeated),
            c.embedding_repeated(&mc, &ids, 4).data,
            "embedding repeated {dtype}"
        );
    }
    // Qwen3.8-27B's attention: 24 heads of 256, rotary 64, theta 1e7, positions up to 8K.
    let (heads, d, rot) = (24, 256, 64);
    let inv_freq: Vec<f32> = (0..rot / 2)
        .map(|i| (1.0 / 1e7f64.powf((2 * i) as f64 / rot as f64)) as f32)
        .collect();
    let positions = [0usize, 1, 7, 300, 8191, 8192];
    let x = r.vec(positions.len() * heads * d, 2.0);
    let (mut xc, mut xg) = pair(&g, positions.len(), heads * d, &x);
    c.rope(&mut xc, &positions, d, rot, &inv_freq);
    g.rope(&mut xg, &positions, d, rot, &inv_freq);
    assert_close(&g.to_host(&xg), &xc.data, "rope");
}

#[test]
fn linear_matches_cpu_on_every_path() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(5);
    // matvec (≤ 8 rows) with vector and scalar loads; cuBLAS (exact) beyond.
    for (out, inp) in [(200, 5120), (33, 100), (17408 / 16, 17408), (64, 8)] {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let w = r.vec(out * inp, 0.05);
            let t = host_matrix("w", out, inp, &w, dtype);
            let (mc, mg) = (c.matrix(&t).unwrap(), g.matrix(&t).unwrap());
            for n in [1, 2, 5, 8, 9, 40] {
                let x = r.vec(n * inp, 1.0);
                let (xc, xg) = pair(&g, n, inp, &x);
                assert_close(
                    &g.to_host(&g.linear(&xg, &mg)),
                    &c.linear(&xc, &mc).data,
                    &format!("linear {dtype} {n}x{inp} → {out}"),
                );
            }
        }
    }
}

/// Every block format the GPU keeps quantized, against the CPU multiplying the dequantized
/// matrix: the decode matvec (≤ 8 rows), the prefill GEMM (dequantize + cuBLAS), embedding rows.
#[test]
fn quantized_linear_matches_cpu_dequantized_reference() {
    use capy_engine::backend::cpu::experts::format::RowFormat;
    use capy_engine::backend::cpu::experts::random_blocks;
    use capy_engine::quant::GgmlType as G;
    let Some(g) = gpu() else { return };
    let fast = CudaBackend::with_exact_math(0, None, false).unwrap();
    let c = CpuBackend::new();
    let mut r = Rng(15);
    for (i, fmt) in [
        RowFormat::Nvfp4,
        RowFormat::Ggml(G::Iq3S),
        RowFormat::Ggml(G::Iq3Xxs),
        RowFormat::Ggml(G::Iq2Xs),
        RowFormat::Ggml(G::Q8_0),
        RowFormat::Ggml(G::Q2_0),
        RowFormat::Fp8B128,
        RowFormat::Ggml(G::BF16),
    ]
    .into_iter()
    .enumerate()
    {
        // 37 rows: not a multiple of the rows a warp takes (4) nor of a block's (32).
        for (out, inp) in [(37, 512), (130, 2560), (70, 2048)] {
            let blocks = random_blocks(fmt, out * inp / fmt.block_len(), 100 + i as u64);
            let mult = if fmt == RowFormat::Nvfp4 { 0.0125 } else { 1.0 };
            let mc = c.quant_matrix(fmt, out, inp, &blocks, mult).unwrap();
            // NVFP4 as records at 2048 columns, in the checkpoint's blocks elsewhere.
            let records = inp == 2048;
            g.set_nvfp4_records(records);
            fast.set_nvfp4_records(records);
            let mg = g.quant_matrix(fmt, out, inp, &blocks, mult).unwrap();
            if !matches!(fmt, RowFormat::Ggml(G::BF16)) {
                assert_eq!(
                    mg.quant_format(),
                    Some(fmt),
                    "{} stays quantized",
                    fmt.name()
                );
                assert_eq!(
                    mg.bytes(),
                    blocks.len(),
                    "{} keeps its block bytes",
                    fmt.name()
                );
            }
            for n in [1, 3, 8, 40] {
                let x = r.vec(n * inp, 1.0);
                let (xc, xg) = pair(&g, n, inp, &x);
                let want = c.linear(&xc, &mc).data;
                assert_close(
                    &g.to_host(&g.linear(&xg, &mg)),
                    &want,
                    &format!("linear {} {n}x{inp} → {out}", fmt.name()),
                );
                if n == 40 || n == 1 {
                    // Fast path: BF16 activations and weights for the GEMM (40 rows), int8
                    // activations and dp4a for the NVFP4 / IQ3_S decode matvec (1 row): within
                    // 1% of the output scale.
                    let mf = fast.quant_matrix(fmt, out, inp, &blocks, mult).unwrap();
                    let got = fast.to_host(&fast.linear(&fast.from_host(n, inp, &x), &mf));
                    let scale = want.iter().map(|v| v.abs()).fold(0.0, f32::max);
                    let worst = got
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max);
                    assert!(
                        worst <= 0.01 * scale,
                        "fast {} {n}x{inp} → {out} deviates by {worst} (output scale {scale})",
                        fmt.name()
                    );
                }
            }
            let ids = [3u32, 0, (out - 1) as u32, 3];
            assert_close(
                &g.to_host(&g.embedding(&mg, &ids)),
                &c.embedding(&mc, &ids).data,
                &format!("embedding {}", fmt.name()),
            );
            assert_close(
                &g.to_host(&g.embedding_repeated(&mg, &ids, 3)),
                &c.embedding_repeated(&mc, &ids, 3).data,
                &format!("embedding repeated {}", fmt.name()),
            );
        }
    }
    let err = g
        .quant_matrix(RowFormat::Ggml(G::Iq3S), 2, 256, &[0u8; 100], 1.0)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("expected 220 bytes"), "{err}");
}

#[test]
fn fast_linear_stays_near_exact() {
    // The default (non-exact) path rounds activations to BF16 for cuBLAS; measure how far that moves.
    let Some(fast) = fast_gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(6);
    let (out, inp, n) = (256, 5120, 64);
    let w = r.vec(out * inp, 0.02);
    let t = host_matrix("w", out, inp, &w, DType::BF16);
    let x = r.vec(n * inp, 1.0);
    let got = fast.to_host(&fast.linear(&fast.from_host(n, inp, &x), &fast.matrix(&t).unwrap()));
    let want = c
        .linear(&c.from_host(n, inp, &x), &c.matrix(&t).unwrap())
        .data;
    // BF16 keeps 8 significant bits: each product is off by ≤ 2^-8 relative, and the errors of
    // 5,120 random terms add like a random walk, so 1% of the output scale bounds it widely.
    let (worst, scale) = deviation(&got, &want);
    println!("fast BF16 linear {n}x{inp} → {out}: max |Δ| {worst:.2e} of output scale {scale:.2e}");
    assert!(
        worst <= 0.01 * scale,
        "fast linear deviates by {worst} (output scale {scale})"
    );
}

#[test]
fn attention_matches_cpu_for_decode_and_prefill() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(7);
    // (heads, kv_heads, d, past, n): split-KV kernel below 16 query rows, cuBLAS path above.
    for (heads, kv, d, past, n) in [
        (24, 4, 256, 0, 1),
        (24, 4, 256, 1000, 1),
        (6, 2, 64, 7, 5),
        (4, 4, 16, 0, 3),
        (24, 4, 256, 0, 40),
        (6, 3, 64, 100, 33),
        (4, 1, 16, 5, 16),
        // Deep enough that the query rows go in several blocks (group 8 over 300K keys).
        (8, 1, 32, 300_000, 24),
        // Decode splits of hundreds of keys; an odd head dim; a group of 16 (three blocks of
        // query heads a KV head).
        (8, 1, 32, 200_000, 2),
        (4, 2, 18, 300, 2),
        (32, 2, 64, 700, 1),
    ] {
        let s = attention_shape(heads, kv, d);
        let total = past + n;
        let q = r.vec(n * heads * d, 1.0);
        let k = r.vec(total * kv * d, 1.0);
        let v = r.vec(total * kv * d, 1.0);
        let (qc, qg) = pair(&g, n, heads * d, &q);
        let (kc, kg) = pair(&g, total, kv * d, &k);
        let (vc, vg) = pair(&g, total, kv * d, &v);
        let want = c.attention(&qc, &kc, &vc, past, s).data;
        assert_close(
            &g.to_host(&g.attention(&qg, &kg, &vg, past, s)),
            &want,
            &format!("attention {heads}/{kv}x{d} past {past} n {n}"),
        );
    }
}

/// The fast path's prefill attention (Q, K, V and probabilities in BF16, f32 scores and sums)
/// against the f32 CPU reference, at a depth where each query averages over thousands of keys.
#[test]
fn fast_attention_stays_near_exact() {
    let Some(fast) = fast_gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(12);
    let (heads, kv, d, past, n) = (24, 4, 256, 3000, 64);
    let s = attention_shape(heads, kv, d);
    // Scores spread over a few units (a peaked softmax), as in a trained model.
    let q = r.vec(n * heads * d, 2.0);
    let k = r.vec((past + n) * kv * d, 2.0);
    let v = r.vec((past + n) * kv * d, 1.0);
    let up = |rows, cols, x: &[f32]| fast.from_host(rows, cols, x);
    let got = fast.to_host(&fast.attention(
        &up(n, heads * d, &q),
        &up(past + n, kv * d, &k),
        &up(past + n, kv * d, &v),
        past,
        s,
    ));
    let want = c
        .attention(
            &c.from_host(n, heads * d, &q),
            &c.from_host(past + n, kv * d, &k),
            &c.from_host(past + n, kv * d, &v),
            past,
            s,
        )
        .data;
    // BF16 inputs move each score by about 2^-8 of its size and each probability by 2^-8
    // relative; the output, a weighted mean of values in [-1, 1], moves by well under 2%.
    let (worst, scale) = deviation(&got, &want);
    println!(
        "fast BF16 attention past {past} n {n}: max |Δ| {worst:.2e} of output scale {scale:.2e}"
    );
    assert!(
        worst <= 0.02 * scale.max(0.1),
        "fast attention deviates by {worst} (output scale {scale})"
    );
}

/// Every way of cutting prefill attention up (heads per batched GEMM, scores workspace small
/// enough to force several row blocks) gives the CPU reference's result.
#[test]
fn attention_plans_all_match_cpu() {
    use capy_engine::backend::cuda::AttentionGemmPlan;
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(9);
    let (heads, kv, d, past, n) = (12, 2, 64, 300, 40);
    let s = attention_shape(heads, kv, d);
    let q = r.vec(n * heads * d, 1.0);
    let k = r.vec((past + n) * kv * d, 1.0);
    let v = r.vec((past + n) * kv * d, 1.0);
    let (qc, qg) = pair(&g, n, heads * d, &q);
    let (kc, kg) = pair(&g, past + n, kv * d, &k);
    let (vc, vg) = pair(&g, past + n, kv * d, &v);
    let want = c.attention(&qc, &kc, &vc, past, s).data;
    for heads_per_call in [1, 2, 3, 4, 6] {
        // 340 keys: 7 rows of one head per block at the smallest scratch, all rows at the largest.
        for scratch_elems in [2_400, 40_000, 1 << 20] {
            let plan = AttentionGemmPlan {
                heads_per_call,
                scratch_elems,
            };
            assert_close(
                &g.to_host(&g.attention_with_plan(&qg, &kg, &vg, past, s, plan)),
                &want,
                &format!("attention with {plan:?}"),
            );
        }
    }
}

#[test]
fn causal_conv_matches_cpu_and_carries_state() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(8);
    // Flash-Next's channels; taps past the kernel's register window (CONV_MAX_TAPS = 8).
    for (channels, taps) in [(10240, 4), (40, 4), (33, 2), (12, 10)] {
        let w = r.vec(channels * taps, 0.5);
        let t = host_matrix("conv", channels, taps, &w, DType::BF16);
        let (wc, wg) = (c.matrix(&t).unwrap(), g.matrix(&t).unwrap());
        let init = r.vec((taps - 1) * channels, 1.0);
        let (mut sc, mut sg) = pair(&g, taps - 1, channels, &init);
        // A prefill chunk, then single decode steps: state must carry across calls.
        // Up to MATVEC_MAX_ROWS (8) tokens take the fused decode kernel, more the two-pass one
        // (runs of CONV_RUN = 16 tokens a thread: 40 is two and a part).
        for n in [10, 1, 1, 3, 8, 9, 1, 40] {
            let x = r.vec(n * channels, 1.0);
            let (xc, xg) = pair(&g, n, channels, &x);
            let oc = c.causal_conv1d_silu(&xc, &mut sc, &wc);
            let og = g.causal_conv1d_silu(&xg, &mut sg, &wg);
            assert_close(
                &g.to_host(&og),
                &oc.data,
                &format!("causal conv {channels}x{taps} n {n}"),
            );
            assert_close(
                &g.to_host(&sg),
                &sc.data,
                &format!("causal conv state {channels}x{taps} n {n}"),
            );
        }
    }
}

/// The GDN layer's decode inputs in one kernel (split, conv with its state, gates) against the
/// CPU backend's composition of the plain ops, over several steps so that the state carries.
#[test]
fn gdn_decode_inputs_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(23);
    // The 27B's layer (10240 conv channels, 48 heads of 128) and a tiny one with 2 taps.
    for (conv_dim, heads, dv, taps) in [(10240, 48, 128, 4), (40, 3, 8, 2)] {
        let v_dim = heads * dv;
        let cols = conv_dim + v_dim + 2 * heads;
        let w = r.vec(conv_dim * taps, 0.5);
        let t = host_matrix("conv", conv_dim, taps, &w, DType::BF16);
        let (wc, wg) = (c.matrix(&t).unwrap(), g.matrix(&t).unwrap());
        let init = r.vec((taps - 1) * conv_dim, 1.0);
        let (mut sc, mut sg) = pair(&g, taps - 1, conv_dim, &init);
        let a_log = r.vec(heads, 1.0);
        let dt_bias = r.vec(heads, 1.0);
        let (a_log_g, dt_bias_g) = (g.vector(&a_log).unwrap(), g.vector(&dt_bias).unwrap());
        for step in 0..3 {
            let mut proj = r.vec(cols, 4.0);
            // An `a` past softplus's threshold of 20.
            proj[conv_dim + v_dim + heads] = 25.0;
            let (pc, pg) = pair(&g, 1, cols, &proj);
            let want = c.gdn_decode_inputs(&pc, &mut sc, &wc, &a_log, &dt_bias, conv_dim, v_dim);
            let got = g.gdn_decode_inputs(&pg, &mut sg, &wg, &a_log_g, &dt_bias_g, conv_dim, v_dim);
            for (name, (gv, cv)) in ["conv", "z", "g", "beta"].iter().zip(got.iter().zip(&want)) {
                assert_eq!(g.shape(gv), c.shape(cv), "{name} shape");
                assert_close(
                    &g.to_host(gv),
                    &cv.data,
                    &format!("gdn_decode_inputs {conv_dim}/{heads} step {step}: {name}"),
                );
            }
            assert_close(
                &g.to_host(&sg),
                &sc.data,
                &format!("gdn_decode_inputs {conv_dim}/{heads} step {step}: conv state"),
            );
        }
    }
}

#[test]
fn gated_delta_rule_matches_cpu_in_both_modes() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(9);
    for shape in [
        DeltaRuleShape {
            num_k_heads: 16,
            num_v_heads: 48,
            k_head_dim: 128,
            v_head_dim: 128,
        },
        DeltaRuleShape {
            num_k_heads: 2,
            num_v_heads: 4,
            k_head_dim: 8,
            v_head_dim: 6,
        },
        DeltaRuleShape {
            num_k_heads: 1,
            num_v_heads: 3,
            k_head_dim: 16,
            v_head_dim: 40,
        },
    ] {
        let (nk, nv, dk, dv) = (
            shape.num_k_heads,
            shape.num_v_heads,
            shape.k_head_dim,
            shape.v_head_dim,
        );
        let init = r.vec(nv * dk * dv, 0.5);
        let (mut sc, mut sg) = pair(&g, nv * dk, dv, &init);
        for (n, mode) in [
            (70, DeltaRuleMode::Chunked),
            (1, DeltaRuleMode::Recurrent),
            (5, DeltaRuleMode::Chunked),
            (1, DeltaRuleMode::Recurrent),
            // Past one workspace segment of the chunked kernel at 48 heads (18 chunks).
            (1300, DeltaRuleMode::Chunked),
            (1, DeltaRuleMode::Recurrent),
        ] {
            let q = r.vec(n * nk * dk, 1.0);
            let k = r.vec(n * nk * dk, 1.0);
            let v = r.vec(n * nv * dv, 1.0);
            let gate: Vec<f32> = r
                .vec(n * nv, 1.0)
                .iter()
                .map(|x| -(x.abs() * 0.5))
                .collect();
            let beta: Vec<f32> = r.vec(n * nv, 1.0).iter().map(|x| x.abs()).collect();
            let cpu = |x: &[f32], cols| c.from_host(n, cols, x);
            let gpu_t = |x: &[f32], cols| g.from_host(n, cols, x);
            let oc = c.gated_delta_rule(
                &cpu(&q, nk * dk),
                &cpu(&k, nk * dk),
                &cpu(&v, nv * dv),
                &cpu(&gate, nv),
                &cpu(&beta, nv),
                &mut sc,
                shape,
                mode,
            );
            let og = g.gated_delta_rule(
                &gpu_t(&q, nk * dk),
                &gpu_t(&k, nk * dk),
                &gpu_t(&v, nv * dv),
                &gpu_t(&gate, nv),
                &gpu_t(&beta, nv),
                &mut sg,
                shape,
                mode,
            );
            assert_close(
                &g.to_host(&og),
                &oc.data,
                &format!("gated delta rule {nv}x{dk}x{dv} n {n} {mode:?}"),
            );
            assert_close(
                &g.to_host(&sg),
                &sc.data,
                &format!("gated delta rule state {nv}x{dk}x{dv} n {n} {mode:?}"),
            );
        }
    }
}

/// Every records matvec (the plain kernel and each split-K variant) on the shapes they are
/// chosen for, against the CPU on the dequantized matrix (the int8 activations: within 1% of
/// the output scale) and against each other (the same int8 products summed in another order).
#[test]
fn records_matvec_variants_agree() {
    use capy_engine::backend::cpu::experts::format::RowFormat;
    use capy_engine::backend::cpu::experts::random_blocks;
    use capy_engine::backend::cuda::{RecordsKernel, NVFP4R_SPLITK};
    let Some(f) = fast_gpu() else { return };
    let c = CpuBackend::new();
    f.set_nvfp4_records(true);
    let mut r = Rng(41);
    // A row count that is not a multiple of any block's rows; 2, 5, 6 and 17 records.
    for (rows, cols) in [(1037, 2048), (1037, 5120), (515, 6144), (1037, 17408)] {
        let blocks = random_blocks(
            RowFormat::Nvfp4,
            rows * cols / RowFormat::Nvfp4.block_len(),
            rows as u64 + cols as u64,
        );
        let mc = c
            .quant_matrix(RowFormat::Nvfp4, rows, cols, &blocks, 0.0125)
            .unwrap();
        let mf = f
            .quant_matrix(RowFormat::Nvfp4, rows, cols, &blocks, 0.0125)
            .unwrap();
        let x = r.vec(cols, 1.0);
        let (xc, xf) = pair(&f, 1, cols, &x);
        let want = c.linear(&xc, &mc).data;
        f.set_records_kernel(RecordsKernel::Plain);
        let plain = f.to_host(&f.linear(&xf, &mf));
        let (worst, scale) = deviation(&plain, &want);
        assert!(
            worst <= 0.01 * scale,
            "plain {rows}x{cols}: {worst} (scale {scale})"
        );
        for k in NVFP4R_SPLITK {
            if cols / 1024 < k.ks {
                continue; // a warp with no records: never chosen
            }
            f.set_records_kernel(RecordsKernel::SplitK(k));
            let got = f.to_host(&f.linear(&xf, &mf));
            let (worst, scale) = deviation(&got, &plain);
            assert!(
                worst <= 1e-5 * (1.0 + scale),
                "{} {rows}x{cols} against the plain kernel: {worst} (scale {scale})",
                k.name
            );
        }
    }
    f.set_records_kernel(RecordsKernel::Auto);
}

/// IQ3_S records (backend/cuda/iq3s_records.rs) on the fast path: the records matvec (plain,
/// as planned, and every split-K variant a shape allows) against the CPU on the dequantized
/// matrix (int8 activations: within 1% of the output scale), against the block-layout kernel
/// `quant_matvec_iq3s_q8` (`set_iq3s_records(false)`, the same int8 arithmetic: within 0.1%,
/// as the two quantize x with differently rounded reciprocals) and against each other (the same
/// integer sums added in another order); the generic decode of records (several rows, prefill,
/// embedding rows, routed experts) against the CPU; a producer's int8 copy; and widths that are
/// not whole records staying on the block kernel.
#[test]
fn iq3s_records_matvec_matches_block_kernel_and_cpu() {
    use capy_engine::backend::cpu::experts::format::RowFormat;
    use capy_engine::backend::cpu::experts::random_blocks;
    use capy_engine::backend::cuda::{RecordsKernel, IQ3SR_SPLITK};
    use capy_engine::backend::{ExpertMatrices, MoeRouting};
    use capy_engine::quant::GgmlType as G;
    const IQ3S: RowFormat = RowFormat::Ggml(G::Iq3S);
    let Some(f) = fast_gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(53);
    // Rows that are not a multiple of a block's 32 (or of 2), 1, 2, 5, 6 and 17 records, and
    // 2560 columns (not whole records: the block kernel either way). 34816 rows: more blocks
    // than one wave, the plain kernel without its unrolled record loop.
    for (rows, cols) in [
        (34816, 1024),
        (1037, 1024),
        (70, 2048),
        (1037, 5120),
        (515, 6144),
        (1037, 17408),
        (37, 2560),
    ] {
        let blocks = random_blocks(IQ3S, rows * cols / 256, rows as u64 * 7 + cols as u64);
        let mc = c.quant_matrix(IQ3S, rows, cols, &blocks, 1.0).unwrap();
        f.set_iq3s_records(false);
        let mb = f.quant_matrix(IQ3S, rows, cols, &blocks, 1.0).unwrap();
        f.set_iq3s_records(true);
        let mf = f.quant_matrix(IQ3S, rows, cols, &blocks, 1.0).unwrap();
        assert_eq!(mf.quant_format(), Some(IQ3S));
        assert_eq!(mf.bytes(), blocks.len(), "records keep the block bytes");
        let x = r.vec(cols, 1.0);
        let (xc, xf) = pair(&f, 1, cols, &x);
        let want = c.linear(&xc, &mc).data;
        let blocked = f.to_host(&f.linear(&xf, &mb));
        let (worst, scale) = deviation(&blocked, &want);
        assert!(
            worst <= 0.01 * scale,
            "block kernel {rows}x{cols}: {worst} (scale {scale})"
        );
        f.set_records_kernel(RecordsKernel::Plain);
        let plain = f.to_host(&f.linear(&xf, &mf));
        let (worst, scale) = deviation(&plain, &want);
        println!("iq3s records {rows}x{cols}: max |Δ| against the CPU {worst:.2e} of {scale:.2e}");
        assert!(
            worst <= 0.01 * scale,
            "records {rows}x{cols} against the CPU: {worst} (scale {scale})"
        );
        let (worst, scale) = deviation(&plain, &blocked);
        assert!(
            worst <= 1e-3 * (1.0 + scale),
            "records {rows}x{cols} against the block kernel: {worst} (scale {scale})"
        );
        if cols % 1024 != 0 {
            assert_eq!(
                plain, blocked,
                "{rows}x{cols}: not records, the same kernel"
            );
        }
        f.set_records_kernel(RecordsKernel::Auto);
        let mut variants: Vec<(String, Vec<f32>)> =
            vec![("planned".into(), f.to_host(&f.linear(&xf, &mf)))];
        for k in IQ3SR_SPLITK {
            if cols / 1024 < k.ks {
                continue; // a half-warp with no records: never chosen
            }
            f.set_records_kernel(RecordsKernel::SplitK(k));
            variants.push((k.name.into(), f.to_host(&f.linear(&xf, &mf))));
        }
        f.set_records_kernel(RecordsKernel::Auto);
        for (name, got) in variants {
            let (worst, scale) = deviation(&got, &plain);
            assert!(
                worst <= 1e-5 * (1.0 + scale),
                "{name} {rows}x{cols} against the plain kernel: {worst} (scale {scale})"
            );
        }
        // The generic decode of records (several rows: the f32 matvec; a prefill: the BF16 GEMM
        // of dequantized rows) gives the block layout's values bit for bit, and stays near the
        // CPU (the f32 sums of up to 17408 terms in another order: 1e-6 of the output scale).
        for n in [3, 40] {
            let xn = r.vec(n * cols, 1.0);
            let (xnc, xnf) = pair(&f, n, cols, &xn);
            let got = f.to_host(&f.linear(&xnf, &mf));
            assert_eq!(
                got,
                f.to_host(&f.linear(&xnf, &mb)),
                "iq3s records {n}x{cols} → {rows} against blocks"
            );
            let (worst, scale) = deviation(&got, &c.linear(&xnc, &mc).data);
            let bound = if n == 40 { 0.01 * scale } else { 1e-6 * scale };
            assert!(
                worst <= bound,
                "iq3s records {n}x{cols} → {rows} against the CPU: {worst} (scale {scale})"
            );
        }
        let ids = [3u32, 0, (rows - 1) as u32, 3];
        assert_close(
            &f.to_host(&f.embedding(&mf, &ids)),
            &c.embedding(&mc, &ids).data,
            &format!("iq3s records embedding {rows}x{cols}"),
        );
    }

    // A norm's int8 copy read by the IQ3_S records matvec, bit-identical to quantizing in the
    // matvec.
    let blocks = random_blocks(IQ3S, 70 * 5120 / 256, 5);
    let m = f.quant_matrix(IQ3S, 70, 5120, &blocks, 1.0).unwrap();
    let (x, w) = (r.vec(5120, 3.0), r.vec(5120, 0.5));
    let wf = f.vector(&w).unwrap();
    let normed = f.rms_norm(&f.from_host(1, 5120, &x), &wf, 1e-6, NormScale::Plain, 5120);
    assert!(
        normed.has_int8_copy(),
        "rms_norm leaves no int8 copy with IQ3_S records loaded"
    );
    let requantized = f.from_host(1, 5120, &f.to_host(&normed));
    assert_eq!(
        f.to_host(&f.linear(&normed, &m)),
        f.to_host(&f.linear(&requantized, &m)),
        "IQ3_S records matvec on the producer's int8 copy"
    );

    // Routed experts with IQ3_S records (hidden 1024) go through the grouped quantized
    // kernels (kernels/moe_quant.cu).
    let (hidden, inter, count) = (1024usize, 128usize, 6usize);
    let (mut ec, mut ef) = (Vec::new(), Vec::new());
    for e in 0..count as u64 {
        let gu = random_blocks(IQ3S, 2 * inter * hidden / 256, 300 + e);
        let down = random_blocks(RowFormat::Ggml(G::Q8_0), hidden * inter / 32, 400 + e);
        let q8 = RowFormat::Ggml(G::Q8_0);
        ec.push(ExpertMatrices {
            gate_up: c.quant_matrix(IQ3S, 2 * inter, hidden, &gu, 0.01).unwrap(),
            down: c.quant_matrix(q8, hidden, inter, &down, 0.02).unwrap(),
        });
        ef.push(ExpertMatrices {
            gate_up: f.quant_matrix(IQ3S, 2 * inter, hidden, &gu, 0.01).unwrap(),
            down: f.quant_matrix(q8, hidden, inter, &down, 0.02).unwrap(),
        });
    }
    for n in [1usize, 5] {
        let logits = r.vec(n * count, 2.0);
        let routing: MoeRouting = c.moe_route(&c.from_host(n, count, &logits), 2, true);
        let (xc, xf) = pair(&f, n, hidden, &r.vec(n * hidden, 1.0));
        let want = c.moe_experts(&xc, &routing, &ec).data;
        let (worst, scale) = deviation(&f.to_host(&f.moe_experts(&xf, &routing, &ef)), &want);
        assert!(
            worst <= 0.01 * scale,
            "moe_experts iq3s records/q8_0 {n} rows: {worst} (scale {scale})"
        );
    }
}

/// On the fast path the one-row producers of a records matvec's input (the norms, the gated
/// norm, SwiGLU, the attention output gate) write its int8 copy themselves: the matvec then
/// skips `quantize_x_q8r`, and its output must be bit-identical to quantizing separately. An
/// in-place write drops the copy.
#[test]
fn producers_int8_copy_equals_quantizing_in_the_matvec() {
    use capy_engine::backend::cpu::experts::format::RowFormat;
    use capy_engine::backend::cpu::experts::random_blocks;
    let Some(f) = fast_gpu() else { return };
    let c = CpuBackend::new();
    f.set_nvfp4_records(true);
    let mut r = Rng(31);
    let matrix = |cols: usize, seed: u64| {
        let blocks = random_blocks(
            RowFormat::Nvfp4,
            70 * cols / RowFormat::Nvfp4.block_len(),
            seed,
        );
        f.quant_matrix(RowFormat::Nvfp4, 70, cols, &blocks, 0.0125)
            .unwrap()
    };
    // The same values without the copy: the matvec quantizes them itself.
    let requantized = |t: &<CudaBackend as Backend>::Act| {
        let (rows, cols) = f.shape(t);
        f.from_host(rows, cols, &f.to_host(t))
    };
    let check = |what: &str,
                 out: &<CudaBackend as Backend>::Act,
                 want: &[f32],
                 m: &<CudaBackend as Backend>::Matrix| {
        assert!(out.has_int8_copy(), "{what}: no int8 copy on the fast path");
        let (worst, scale) = deviation(&f.to_host(out), want);
        assert!(
            worst <= 1e-4 * (1.0 + scale),
            "{what}: values deviate by {worst} (scale {scale})"
        );
        let fused = f.to_host(&f.linear(out, m));
        let separate = f.to_host(&f.linear(&requantized(out), m));
        assert_eq!(
            fused, separate,
            "{what}: matvec on the producer's int8 copy"
        );
    };
    let m5120 = matrix(5120, 1);
    let m6144 = matrix(6144, 2);
    let m17408 = matrix(17408, 3);
    for scale in [NormScale::OnePlus, NormScale::Plain] {
        let x = r.vec(5120, 3.0);
        let y = r.vec(5120, 3.0);
        let w = r.vec(5120, 0.5);
        let (mut xc, mut xf) = pair(&f, 1, 5120, &x);
        let (yc, yf) = pair(&f, 1, 5120, &y);
        let wf = f.vector(&w).unwrap();
        let want = c.add_rms_norm(&mut xc, &yc, &w, 1e-6, scale, 5120).data;
        let mut out = f.add_rms_norm(&mut xf, &yf, &wf, 1e-6, scale, 5120);
        check(&format!("add_rms_norm {scale:?}"), &out, &want, &m5120);
        let want = c.rms_norm(&xc, &w, 1e-6, scale, 5120).data;
        check(
            &format!("rms_norm {scale:?}"),
            &f.rms_norm(&xf, &wf, 1e-6, scale, 5120),
            &want,
            &m5120,
        );
        // Written in place: the copy goes, and the matvec sees the new values.
        f.add_assign(&mut out, &yf);
        assert!(!out.has_int8_copy(), "add_assign keeps a stale int8 copy");
        assert_eq!(
            f.to_host(&f.linear(&out, &m5120)),
            f.to_host(&f.linear(&requantized(&out), &m5120)),
            "matvec after an in-place add"
        );
    }
    // The GDN output norm: 48 heads of 128, gated.
    let (x, z, w) = (r.vec(6144, 2.0), r.vec(6144, 2.0), r.vec(128, 0.5));
    let ((xc, xf), (zc, zf)) = (pair(&f, 1, 6144, &x), pair(&f, 1, 6144, &z));
    let want = c.rms_norm_gated(&xc, &zc, &w, 1e-6, 128).data;
    let wf = f.vector(&w).unwrap();
    check(
        "rms_norm_gated 48x128",
        &f.rms_norm_gated(&xf, &zf, &wf, 1e-6, 128),
        &want,
        &m6144,
    );
    // The same norm fused into the delta rule (the 27B's GDN shape, one decode row).
    let shape = DeltaRuleShape {
        num_k_heads: 16,
        num_v_heads: 48,
        k_head_dim: 128,
        v_head_dim: 128,
    };
    let qkv = r.vec(2 * 2048 + 6144, 1.0);
    let (decay, beta) = (vec![-0.1f32; 48], vec![0.5f32; 48]);
    let init = r.vec(48 * 128 * 128, 0.5);
    let ((qc, qf), (dc, df), (bc, bf)) = (
        pair(&f, 1, qkv.len(), &qkv),
        pair(&f, 1, 48, &decay),
        pair(&f, 1, 48, &beta),
    );
    let (mut sc, mut sf) = pair(&f, 48 * 128, 128, &init);
    let gate = GateActivation::Silu;
    let want = c.gated_delta_rule_normed(&qc, &dc, &bc, &mut sc, shape, &zc, &w, 1e-6, gate);
    check(
        "gated_delta_rule_normed 48x128",
        &f.gated_delta_rule_normed(&qf, &df, &bf, &mut sf, shape, &zf, &wf, 1e-6, gate),
        &want.data,
        &m6144,
    );
    // The attention output gate, alone and inside the decode attention's combine.
    let s = attention_shape(24, 4, 256);
    let (kv, q) = (r.vec(301 * 1024, 1.0), r.vec(6144, 1.0));
    let ((kc, kf), (qc, qf)) = (pair(&f, 301, 1024, &kv), pair(&f, 1, 6144, &q));
    let want = c.attention_gated(&qc, &kc, &kc, 300, s, &zc).data;
    check(
        "attention_gated 24x256",
        &f.attention_gated(&qf, &kf, &kf, 300, s, &zf),
        &want,
        &m6144,
    );
    let want = c.sigmoid_gate(&xc, &zc).data;
    check(
        "sigmoid_gate 6144",
        &f.sigmoid_gate(&xf, &zf),
        &want,
        &m6144,
    );
    let gu = r.vec(2 * 17408, 4.0);
    let (gc, gf) = pair(&f, 1, 2 * 17408, &gu);
    let want = c.silu_mul_halves(&gc).data;
    check(
        "silu_mul_halves 17408",
        &f.silu_mul_halves(&gf),
        &want,
        &m17408,
    );
}

/// The decode tails fused into the kernels before them, against the same backend's plain ops
/// and the CPU: the GDN output norm inside the recurrent delta rule (both gate activations, the
/// 27B's heads and heads of 40 value columns, state carried over steps), and the attention's
/// output gate inside its combine (one and two query rows).
#[test]
fn fused_decode_tails_match_the_plain_ops_and_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(41);
    for (shape, gate) in [
        (
            DeltaRuleShape {
                num_k_heads: 16,
                num_v_heads: 48,
                k_head_dim: 128,
                v_head_dim: 128,
            },
            GateActivation::Silu,
        ),
        (
            DeltaRuleShape {
                num_k_heads: 1,
                num_v_heads: 3,
                k_head_dim: 16,
                v_head_dim: 40,
            },
            GateActivation::Sigmoid,
        ),
    ] {
        let (kd, vd) = (
            shape.num_k_heads * shape.k_head_dim,
            shape.num_v_heads * shape.v_head_dim,
        );
        let nv = shape.num_v_heads;
        let init = r.vec(nv * shape.k_head_dim * shape.v_head_dim, 0.5);
        let (mut sc, mut sg) = pair(&g, nv * shape.k_head_dim, shape.v_head_dim, &init);
        let mut sg_plain = g.from_host(nv * shape.k_head_dim, shape.v_head_dim, &init);
        let w = r.vec(shape.v_head_dim, 1.0);
        let wg = g.vector(&w).unwrap();
        for step in 0..3 {
            let qkv = r.vec(2 * kd + vd, 1.0);
            let z = r.vec(vd, 2.0);
            let decay: Vec<f32> = r.vec(nv, 1.0).iter().map(|x| -x.abs()).collect();
            let beta: Vec<f32> = r.vec(nv, 1.0).iter().map(|x| x.abs()).collect();
            let (qc, qg) = pair(&g, 1, 2 * kd + vd, &qkv);
            let (zc, zg) = pair(&g, 1, vd, &z);
            let (dc, dg) = pair(&g, 1, nv, &decay);
            let (bc, bg) = pair(&g, 1, nv, &beta);
            let want =
                c.gated_delta_rule_normed(&qc, &dc, &bc, &mut sc, shape, &zc, &w, 1e-6, gate);
            g.set_fused_tails(true);
            let fused =
                g.gated_delta_rule_normed(&qg, &dg, &bg, &mut sg, shape, &zg, &wg, 1e-6, gate);
            g.set_fused_tails(false);
            let plain = g.gated_delta_rule_normed(
                &qg,
                &dg,
                &bg,
                &mut sg_plain,
                shape,
                &zg,
                &wg,
                1e-6,
                gate,
            );
            g.set_fused_tails(true);
            let what = format!(
                "normed delta rule {nv}x{}, {gate:?}, step {step}",
                shape.v_head_dim
            );
            assert_close(&g.to_host(&fused), &want.data, &what);
            assert_close(
                &g.to_host(&plain),
                &want.data,
                &format!("{what} (plain ops)"),
            );
            assert_close(&g.to_host(&sg), &sc.data, &format!("{what}: state"));
            assert_eq!(
                g.to_host(&sg),
                g.to_host(&sg_plain),
                "{what}: fused and plain states"
            );
        }
    }
    let s = attention_shape(24, 4, 256);
    for (rows, past) in [(1, 300), (2, 77)] {
        let total = past + rows;
        let q = r.vec(rows * 24 * 256, 1.0);
        let k = r.vec(total * 4 * 256, 1.0);
        let v = r.vec(total * 4 * 256, 1.0);
        let gate = r.vec(rows * 24 * 256, 3.0);
        let ((qc, qg), (kc, kg), (vc, vg)) = (
            pair(&g, rows, 24 * 256, &q),
            pair(&g, total, 4 * 256, &k),
            pair(&g, total, 4 * 256, &v),
        );
        let (gc, gg) = pair(&g, rows, 24 * 256, &gate);
        let want = c.attention_gated(&qc, &kc, &vc, past, s, &gc).data;
        let fused = g.to_host(&g.attention_gated(&qg, &kg, &vg, past, s, &gg));
        g.set_fused_tails(false);
        let plain = g.to_host(&g.attention_gated(&qg, &kg, &vg, past, s, &gg));
        g.set_fused_tails(true);
        assert_close(
            &fused,
            &want,
            &format!("gated attention, {rows} rows after {past}"),
        );
        assert_close(
            &plain,
            &want,
            &format!("gated attention (plain ops), {rows} rows"),
        );
    }
}

/// Greedy picks on the device equal the host's (`sampling::argmax` on the read-back rows):
/// the 27B's vocabulary with its maximum planted twice (the first wins), limited below the
/// row's end with a larger value past the limit, a row of NaN and −∞ with one finite value,
/// a row with no candidate at all, and −0 against +0.
#[test]
fn device_argmax_matches_the_host() {
    let Some(g) = gpu() else { return };
    let mut r = Rng(43);
    let cols = 248_320;
    let mut x = r.vec(4 * cols, 20.0);
    x[17] = 30.0;
    x[200_000] = 30.0;
    let row1 = &mut x[cols..2 * cols];
    row1[248_100] = 99.0; // past the limit below
    row1[248_000] = 31.0;
    let row2 = &mut x[2 * cols..3 * cols];
    for (i, v) in row2.iter_mut().enumerate() {
        *v = if i % 2 == 0 {
            f32::NAN
        } else {
            f32::NEG_INFINITY
        };
    }
    row2[123_457] = -5.0;
    let row3 = &mut x[3 * cols..];
    for (i, v) in row3.iter_mut().enumerate() {
        *v = if i % 3 == 0 {
            f32::NAN
        } else {
            f32::NEG_INFINITY
        };
    }
    let xg = g.from_host(4, cols, &x);
    for limit in [cols, 248_077] {
        let host = argmax_rows_on_host(&g, &xg, limit);
        let device = g.argmax_rows(&xg, limit);
        println!("limit {limit}: host {host:?}, device {device:?}");
        assert_eq!(device, host, "device against host picks, limit {limit}");
    }
    assert_eq!(
        g.argmax_rows(&xg, 248_077),
        vec![17, 248_000, 123_457, 0],
        "the expected picks"
    );
    let signed_zeros = g.from_host(1, 3, &[f32::NEG_INFINITY, -0.0, 0.0]);
    assert_eq!(
        g.argmax_rows(&signed_zeros, 3),
        vec![1],
        "−0 and +0 tie: the first wins"
    );
}

/// A decode row's attention inputs in one launch (`attention_inputs_row`) against the same
/// backend's plain ops (bit for bit) and the CPU backend, into caches with room for the row
/// and caches that must grow.
#[test]
fn fused_attention_inputs_match_the_plain_ops_and_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(17);
    let s = attention_shape(24, 4, 256);
    let (qd, kvd) = (24 * 256, 4 * 256);
    let inv_freq: Vec<f32> = (0..32).map(|i| 10000f32.powf(-(i as f32) / 32.0)).collect();
    let (qw, kw) = (r.vec(256, 0.5), r.vec(256, 0.5));
    let (qwg, kwg) = (g.vector(&qw).unwrap(), g.vector(&kw).unwrap());
    // 16 rows fill a fresh cache's first allocation; the 17th grows it.
    for past in [3, 16] {
        let cached = r.vec(past * kvd, 1.0);
        let row = r.vec(2 * qd + 2 * kvd, 2.0);
        let (rc, rg) = pair(&g, 1, row.len(), &row);
        let caches = |b: &CudaBackend| {
            let mut k = b.from_host(0, kvd, &[]);
            let mut v = b.from_host(0, kvd, &[]);
            b.append_rows(&mut k, &b.from_host(past, kvd, &cached));
            b.append_rows(&mut v, &b.from_host(past, kvd, &cached));
            (k, v)
        };
        let pos = [past];
        // (q, gate, key cache, value cache) on the host, through the fused op or the plain ones.
        let run = |fused: bool| {
            let (mut k, mut v) = caches(&g);
            let (norms, kv) = ([&qwg, &kwg], [&mut k, &mut v]);
            let (q, gate) = if fused {
                g.attention_inputs(&rg, s, norms, 1e-6, &pos, 64, &inv_freq, kv)
            } else {
                attention_inputs_composed(&g, &rg, s, norms, 1e-6, &pos, 64, &inv_freq, kv)
            };
            assert_eq!(
                g.shape(&k),
                (past + 1, kvd),
                "{past} cached rows, fused {fused}"
            );
            [q, gate, k, v].map(|t| g.to_host(&t))
        };
        let what = format!("{past} cached rows");
        let [qf, gf, kf, vf] = run(true);
        let [qp, gp, kp, vp] = run(false);
        assert_eq!(qf, qp, "q, {what}");
        assert_eq!(gf, gp, "gate, {what}");
        assert_eq!(kf, kp, "key cache, {what}");
        assert_eq!(vf, vp, "value cache, {what}");
        let mut kc = c.from_host(past, kvd, &cached);
        let mut vc = c.from_host(past, kvd, &cached);
        let (qc, gc) = c.attention_inputs(
            &rc,
            s,
            [&qw, &kw],
            1e-6,
            &pos,
            64,
            &inv_freq,
            [&mut kc, &mut vc],
        );
        assert_close(&qf, &qc.data, &format!("q against the CPU, {what}"));
        assert_eq!(gf, gc.data, "gate against the CPU, {what}");
        assert_close(&kf, &kc.data, &format!("key cache against the CPU, {what}"));
        assert_eq!(vf, vc.data, "value cache against the CPU, {what}");
    }
}

/// The fused decode ops (split_cols, silu_mul_halves, add_rms_norm, the packed delta rule,
/// rms_norm_rope) and the cached RoPE positions against the CPU backend, whose defaults
/// compose the plain ops.
#[test]
fn fused_decode_ops_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(12);
    // split_cols: the GDN in_proj pieces (four, one launch), a zero-width piece, more than
    // four pieces (two launches), and pieces that leave trailing columns out.
    for (rows, cols) in [(1, 10240 + 6144 + 48 + 48), (3, 100)] {
        let x = r.vec(rows * cols, 1.0);
        let (xc, xg) = pair(&g, rows, cols, &x);
        let widths4 = if cols == 100 {
            [40, 0, 33, 27]
        } else {
            [10240, 6144, 48, 48]
        };
        let (pc, pg) = (c.split_cols(&xc, widths4), g.split_cols(&xg, widths4));
        for (i, (pc, pg)) in pc.iter().zip(&pg).enumerate() {
            assert_eq!(g.shape(pg), c.shape(pc), "split_cols piece {i}");
            assert_eq!(g.to_host(pg), pc.data, "split_cols {rows}x{cols} piece {i}");
        }
        let widths6 = [3, 7, 1, 20, 0, 9];
        let (pc, pg) = (c.split_cols(&xc, widths6), g.split_cols(&xg, widths6));
        for (i, (pc, pg)) in pc.iter().zip(&pg).enumerate() {
            assert_eq!(g.to_host(pg), pc.data, "split_cols of six, piece {i}");
        }
    }
    // silu_mul_halves: the MLP's fused gate ‖ up, decode and a few rows.
    for (rows, inter) in [(1, 17408), (5, 96)] {
        let gu = r.vec(rows * 2 * inter, 4.0);
        let (gc, gg) = pair(&g, rows, 2 * inter, &gu);
        assert_close(
            &g.to_host(&g.silu_mul_halves(&gg)),
            &c.silu_mul_halves(&gc).data,
            &format!("silu_mul_halves {rows}x{inter}"),
        );
    }
    // add_rms_norm: whole-row norms (the residual stream) and per-group ones.
    for (rows, cols, group) in [(1, 5120, 5120), (3, 5120, 5120), (4, 48 * 128, 128)] {
        let x = r.vec(rows * cols, 3.0);
        let y = r.vec(rows * cols, 3.0);
        let w = r.vec(group, 0.5);
        let (mut xc, mut xg) = pair(&g, rows, cols, &x);
        let (yc, yg) = pair(&g, rows, cols, &y);
        let wg = g.vector(&w).unwrap();
        for scale in [NormScale::OnePlus, NormScale::Plain] {
            let oc = c.add_rms_norm(&mut xc, &yc, &w, 1e-6, scale, group);
            let og = g.add_rms_norm(&mut xg, &yg, &wg, 1e-6, scale, group);
            let what = format!("add_rms_norm {scale:?} {rows}x{cols}/{group}");
            assert_close(&g.to_host(&xg), &xc.data, &format!("{what} sum"));
            assert_close(&g.to_host(&og), &oc.data, &what);
        }
    }
    // The packed delta rule: decode reads q, k, v in place; prefill splits for the chunks.
    let shape = DeltaRuleShape {
        num_k_heads: 16,
        num_v_heads: 48,
        k_head_dim: 128,
        v_head_dim: 128,
    };
    let (kd, vd, nv) = (16 * 128, 48 * 128, 48);
    let init = r.vec(nv * 128 * 128, 0.5);
    let (mut sc, mut sg) = pair(&g, nv * 128, 128, &init);
    for (n, mode) in [
        (1, DeltaRuleMode::Recurrent),
        (70, DeltaRuleMode::Chunked),
        (1, DeltaRuleMode::Recurrent),
        (3, DeltaRuleMode::Recurrent),
    ] {
        let qkv = r.vec(n * (2 * kd + vd), 1.0);
        let gate: Vec<f32> = r
            .vec(n * nv, 1.0)
            .iter()
            .map(|x| -(x.abs() * 0.5))
            .collect();
        let beta: Vec<f32> = r.vec(n * nv, 1.0).iter().map(|x| x.abs()).collect();
        let (qc, qg) = pair(&g, n, 2 * kd + vd, &qkv);
        let (gc, gg) = pair(&g, n, nv, &gate);
        let (bc, bg) = pair(&g, n, nv, &beta);
        let oc = c.gated_delta_rule_packed(&qc, &gc, &bc, &mut sc, shape, mode);
        let og = g.gated_delta_rule_packed(&qg, &gg, &bg, &mut sg, shape, mode);
        assert_close(
            &g.to_host(&og),
            &oc.data,
            &format!("packed delta rule n {n} {mode:?}"),
        );
        assert_close(
            &g.to_host(&sg),
            &sc.data,
            &format!("packed delta rule state n {n} {mode:?}"),
        );
    }
    // RoPE positions are uploaded once and reused while unchanged: q and k of one step, then
    // the next step's positions (same count, new values), then a different count.
    let (heads, d, rot) = (4, 64, 32);
    let inv_freq: Vec<f32> = (0..rot / 2)
        .map(|i| (1.0 / 1e7f64.powf((2 * i) as f64 / rot as f64)) as f32)
        .collect();
    for positions in [&[5usize][..], &[5], &[6], &[6, 7, 900]] {
        for _ in 0..2 {
            let x = r.vec(positions.len() * heads * d, 2.0);
            let (mut xc, mut xg) = pair(&g, positions.len(), heads * d, &x);
            c.rope(&mut xc, positions, d, rot, &inv_freq);
            g.rope(&mut xg, positions, d, rot, &inv_freq);
            assert_close(&g.to_host(&xg), &xc.data, &format!("rope at {positions:?}"));
        }
    }
    // rms_norm_rope: the 27B's q (24 heads of 256, rotary 64) and k (4 heads), a head with
    // no rotary part past its first 16 dims, decode and prefill rows, both scales.
    let inv_freq: Vec<f32> = (0..32)
        .map(|i| (1.0 / 1e7f64.powf((2 * i) as f64 / 64.0)) as f32)
        .collect();
    for (heads, d, rot, positions) in [
        (24, 256, 64, &[8191usize][..]),
        (4, 256, 64, &[0, 1, 300, 8192][..]),
        (3, 40, 16, &[7, 9][..]),
    ] {
        let x = r.vec(positions.len() * heads * d, 3.0);
        let w = r.vec(d, 0.5);
        let (xc, xg) = pair(&g, positions.len(), heads * d, &x);
        let wg = g.vector(&w).unwrap();
        for scale in [NormScale::OnePlus, NormScale::Plain] {
            assert_close(
                &g.to_host(&g.rms_norm_rope(&xg, &wg, 1e-6, scale, positions, d, rot, &inv_freq)),
                &c.rms_norm_rope(&xc, &w, 1e-6, scale, positions, d, rot, &inv_freq)
                    .data,
                &format!("rms_norm_rope {scale:?} {heads}x{d}/{rot} at {positions:?}"),
            );
        }
    }
}

#[test]
fn vram_budget_is_enforced_with_numbers() {
    let b = match CudaBackend::with_exact_math(0, Some(1 << 20), true) {
        Ok(b) => b,
        Err(e) => {
            capy_engine::backend::cuda::no_device_for_test(&format!("{e:#}"));
            return;
        }
    };
    let small = host_matrix("small", 256, 256, &vec![0.5; 256 * 256], DType::BF16);
    let kept = b.matrix(&small).expect("128 KiB fits a 1 MiB budget");
    assert_eq!(b.ledger().weights, 256 * 256 * 2);
    let big = host_matrix("big", 1024, 1024, &vec![0.5; 1024 * 1024], DType::BF16);
    let err = b
        .matrix(&big)
        .err()
        .expect("2 MiB must not fit a 1 MiB budget")
        .to_string();
    assert!(
        err.contains("VRAM budget") && err.contains("1048576") && err.contains("2097152"),
        "unhelpful error: {err}"
    );
    drop(kept);
    assert_eq!(
        b.ledger().used,
        0,
        "dropping the weights returns their bytes to the ledger"
    );
}

#[test]
fn synthetic_model_matches_cpu_end_to_end() {
    use capy_engine::model::{qwen3_5_text::Qwen3_5Text, BatchItem, CausalLm, LogitsWanted};
    let Some(g) = gpu() else { return };
    // The 27B configuration scaled down: same head dims (256 / 128) and layer pattern.
    let mut cfg = capy_engine::synthetic::config("qwen3.8-27b").unwrap();
    for (k, v) in [
        ("vocab_size", 1000),
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("num_hidden_layers", 8),
    ] {
        cfg[k] = serde_json::json!(v);
    }
    let ck = capy_engine::synthetic::checkpoint_from_config(&cfg, 11).unwrap();
    let mut mc = Qwen3_5Text::load(CpuBackend::new(), &ck).unwrap();
    let mut mg = Qwen3_5Text::load(g, &ck).unwrap();
    let prompt: Vec<u32> = (0..37).map(|i| (i * 97 + 5) % 1000).collect();
    let (sc, sg) = (mc.new_sequence(), mg.new_sequence());
    let lc = mc
        .forward(&[BatchItem {
            seq: sc,
            tokens: &prompt,
            logits: LogitsWanted::All,
        }])
        .unwrap()
        .remove(0);
    let lg = mg
        .forward(&[BatchItem {
            seq: sg,
            tokens: &prompt,
            logits: LogitsWanted::All,
        }])
        .unwrap()
        .remove(0);
    assert_close_tol(&lg, &lc, 1e-3, 0.0, "synthetic prefill logits");
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32
    };
    let (mut tc, mut tg) = (
        argmax(&lc[lc.len() - 1000..]),
        argmax(&lg[lg.len() - 1000..]),
    );
    for step in 0..8 {
        assert_eq!(tg, tc, "greedy token {step} differs");
        let lc = mc
            .forward(&[BatchItem {
                seq: sc,
                tokens: &[tc],
                logits: LogitsWanted::Last,
            }])
            .unwrap()
            .remove(0);
        let lg = mg
            .forward(&[BatchItem {
                seq: sg,
                tokens: &[tg],
                logits: LogitsWanted::Last,
            }])
            .unwrap()
            .remove(0);
        assert_close_tol(
            &lg,
            &lc,
            1e-3,
            0.0,
            &format!("synthetic decode step {step} logits"),
        );
        tc = argmax(&lc);
        tg = argmax(&lg);
    }
}
