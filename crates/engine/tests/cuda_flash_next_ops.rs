//! Every Flash-Next op of the CUDA backend (hyper-connection mixers, PLE gate, QSA, MoE routing
//! and routed experts) against the CPU reference on random inputs.
//!
//! Tolerance (exact math, f32 activations): |gpu − cpu| ≤ 1e-4 · (1 + |cpu|) per element, as in
//! `cuda_ops.rs`: the backends sum in different orders (warp trees against SIMD lanes), which
//! moves results by a few ulp of the largest partial sums. Discrete results are compared
//! exactly: the QSA token selections (also past the budget, where the top-k blocks are chosen)
//! and the MoE expert ids.
//!
//! Without a CUDA driver (CI, laptops) each test prints why it is skipped and passes.
#![cfg(feature = "cuda")]

use capy_engine::backend::cpu::{qsa, CpuBackend, CpuTensor};
use capy_engine::backend::cuda::{flash_next, CudaBackend};
use capy_engine::backend::{AttentionShape, Backend, ExpertMatrices, MoeRouting, QsaShape};
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
            err <= ATOL + RTOL * w.abs(),
            "{what}: element {i}: gpu {g} vs cpu {w} (|Δ| {err:e})"
        );
        worst = worst.max(err);
    }
    println!("{what}: {} values, max |Δ| {worst:.2e}", got.len());
}

type GpuAct = <CudaBackend as Backend>::Act;

/// The same activation on both backends.
fn pair(g: &CudaBackend, rows: usize, cols: usize, data: &[f32]) -> (CpuTensor, GpuAct) {
    (
        CpuBackend::new().from_host(rows, cols, data),
        g.from_host(rows, cols, data),
    )
}

#[test]
fn hyper_connection_and_ple_ops_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(7);
    // Real Flash-Next widths (4 streams × 2560), an odd one (3 × 100), and one the mixers take
    // a value at a time (h not a multiple of 4).
    for (n, h, s) in [
        (5usize, 2560usize, 4usize),
        (9, 100, 3),
        (1, 2560, 4),
        (3, 99, 2),
    ] {
        let wide = s * h;
        let (xc, xg) = pair(&g, n, wide, &r.vec(n * wide, 2.0));
        let (sc, sg) = pair(&g, 1, wide, &r.vec(wide, 1.5));
        assert_close(
            &g.to_host(&g.scale_cols(&xg, &sg)),
            &c.scale_cols(&xc, &sc).data,
            &format!("scale_cols {n}x{wide}"),
        );
        assert_close(
            &g.to_host(&g.silu_scaled(&xg, 0.25)),
            &c.silu_scaled(&xc, 0.25).data,
            &format!("silu_scaled {n}x{wide}"),
        );
        let (mc, mg) = pair(&g, n, wide, &r.vec(n * wide, 3.0));
        assert_close(
            &g.to_host(&g.hc_mix(&xg, &mg, s)),
            &c.hc_mix(&xc, &mc, s).data,
            &format!("hc_mix {n}x{s}x{h}"),
        );
        let (oc, og) = pair(&g, n, h, &r.vec(n * h, 1.0));
        let (lc, lg) = pair(&g, n, s, &r.vec(n * s, 4.0));
        assert_close(
            &g.to_host(&g.hc_inject(&xg, &og, &lg, s)),
            &c.hc_inject(&xc, &oc, &lc, s).data,
            &format!("hc_inject {n}x{s}x{h}"),
        );
        // The column-window forms read the mixer's fused projection in place.
        let proj_cols = 7 + s + 3;
        let (pc, pg) = pair(&g, n, proj_cols, &r.vec(n * proj_cols, 4.0));
        assert_close(
            &g.to_host(&g.silu_scaled_cols(&pg, 2..9, 0.25)),
            &c.silu_scaled_cols(&pc, 2..9, 0.25).data,
            &format!("silu_scaled_cols {n}x{proj_cols}"),
        );
        assert_close(
            &g.to_host(&g.hc_inject_cols(&xg, &og, &pg, 7, s)),
            &c.hc_inject_cols(&xc, &oc, &pc, 7, s).data,
            &format!("hc_inject_cols {n}x{s}x{h}"),
        );
        let (qc, qg) = pair(&g, n, wide, &r.vec(n * wide, 1.0));
        assert_close(
            &g.to_host(&g.ple_gate(&xg, &qg, &og, s)),
            &c.ple_gate(&xc, &qc, &oc, s).data,
            &format!("ple_gate {n}x{s}x{h}"),
        );
    }
    // Mean pooling drops the partial last block.
    let (xc, xg) = pair(&g, 4 * 37 + 3, 128, &r.vec((4 * 37 + 3) * 128, 1.0));
    let pooled = g.mean_pool_rows(&xg, 4);
    assert_eq!(g.shape(&pooled), (37, 128));
    assert_close(
        &g.to_host(&pooled),
        &c.mean_pool_rows(&xc, 4).data,
        "mean_pool_rows",
    );
}

/// One QSA case: `total` tokens in the cache, the last `n` of them new queries.
struct QsaCase {
    attn: AttentionShape,
    qsa: QsaShape,
    total: usize,
    n: usize,
}

fn run_qsa_case(g: &CudaBackend, case: &QsaCase, seed: u64) -> usize {
    let c = CpuBackend::new();
    let mut r = Rng(seed);
    let (a, s) = (case.attn, case.qsa);
    let past = case.total - case.n;
    let n = case.n;
    let qd = a.num_heads * a.head_dim;
    let kvd = a.num_kv_heads * a.head_dim;
    let iq = s.index_heads * s.index_head_dim;
    let blocks = case.total / s.compress_ratio;
    let (qc, qg) = pair(g, n, qd, &r.vec(n * qd, 1.0));
    let (kc, kg) = pair(g, case.total, kvd, &r.vec(case.total * kvd, 1.0));
    let (vc, vg) = pair(g, case.total, kvd, &r.vec(case.total * kvd, 1.0));
    let iq_data = r.vec(n * iq, 1.0);
    let bk_data = r.vec(blocks * s.index_head_dim, 1.0);
    let (ic, ig) = pair(g, n, iq, &iq_data);
    let (bc, bg) = pair(g, blocks, s.index_head_dim, &bk_data);
    // Selections: identical token lists, and the sparse path really taken.
    let got = g.qsa_token_lists(&ig, &bg, past, s);
    let mut sparse = 0;
    for (i, sel) in got.iter().enumerate() {
        let want = qsa::select_tokens(&iq_data[i * iq..(i + 1) * iq], &bk_data, past + i, s);
        assert_eq!(
            sel,
            &want,
            "QSA selection of query {i} at position {}",
            past + i
        );
        sparse += sel.is_some() as usize;
    }
    let out_g = g.to_host(&g.qsa_attention(&qg, &kg, &vg, &ig, &bg, past, a, s));
    let out_c = c.qsa_attention(&qc, &kc, &vc, &ic, &bc, past, a, s).data;
    assert_close(
        &out_g,
        &out_c,
        &format!(
            "qsa_attention {} tokens, {n} queries, {sparse} past the budget",
            case.total
        ),
    );
    sparse
}

#[test]
fn qsa_selects_the_same_tokens_and_attends_like_cpu() {
    let Some(g) = gpu() else { return };
    let small = AttentionShape {
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        scale: 0.125,
    };
    // Budget of 12 tokens (3 blocks of 4): two indexer heads make many all-zero (tied) scores,
    // which must break towards the lower block like the CPU's stable sort.
    let tiny = QsaShape {
        index_heads: 2,
        index_head_dim: 32,
        block_topk: 3,
        compress_ratio: 4,
    };
    let mut sparse = 0;
    for (i, (total, n)) in [(70, 70), (70, 1), (49, 9), (13, 13), (301, 17)]
        .into_iter()
        .enumerate()
    {
        sparse += run_qsa_case(
            &g,
            &QsaCase {
                attn: small,
                qsa: tiny,
                total,
                n,
            },
            11 + i as u64,
        );
    }
    // The real shape: 24 heads × 256, 4 indexer heads × 128, top 512 blocks of 4 (budget 2048),
    // decode at 8K and a prefill chunk that crosses the budget.
    let (real, real_qsa) = flash_next::attention_shapes();
    for (i, (total, n)) in [(8192, 1), (2300, 300)].into_iter().enumerate() {
        sparse += run_qsa_case(
            &g,
            &QsaCase {
                attn: real,
                qsa: real_qsa,
                total,
                n,
            },
            101 + i as u64,
        );
    }
    assert!(sparse > 300, "only {sparse} queries ran past the budget");
}

#[test]
fn qsa_within_budget_is_dense_attention() {
    let Some(g) = gpu() else { return };
    let a = AttentionShape {
        num_heads: 4,
        num_kv_heads: 1,
        head_dim: 32,
        scale: 0.2,
    };
    let s = QsaShape {
        index_heads: 2,
        index_head_dim: 16,
        block_topk: 16,
        compress_ratio: 4,
    };
    let mut r = Rng(5);
    let (total, n) = (60, 20);
    let q = g.from_host(n, 128, &r.vec(n * 128, 1.0));
    let k = g.from_host(total, 32, &r.vec(total * 32, 1.0));
    let v = g.from_host(total, 32, &r.vec(total * 32, 1.0));
    let iq = g.from_host(n, 32, &r.vec(n * 32, 1.0));
    let bk = g.from_host(total / 4, 16, &r.vec(total / 4 * 16, 1.0));
    assert!(g
        .qsa_token_lists(&iq, &bk, total - n, s)
        .iter()
        .all(Option::is_none));
    let sparse = g.to_host(&g.qsa_attention(&q, &k, &v, &iq, &bk, total - n, a, s));
    let dense = g.to_host(&g.attention(&q, &k, &v, total - n, a));
    assert_eq!(sparse, dense);
}

#[test]
fn few_row_float_matvecs_split_over_warps_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(13);
    // Shapes whose rows cannot fill the GPU a warp a row (split-K: the router, the shared
    // expert, a hyper-connection projection, a narrow odd one) and one that can, for 1 to 8
    // input rows, BF16 and F32 weights.
    for (rows, cols) in [
        (513usize, 2560usize),
        (1280, 2560),
        (328, 10240),
        (37, 1024),
        (20000, 512),
    ] {
        for dtype in [DType::BF16, DType::F32] {
            let w = r.vec(rows * cols, 0.05);
            let wm = host_matrix("w", rows, cols, &w, dtype);
            let (wc, wg) = (c.matrix(&wm).unwrap(), g.matrix(&wm).unwrap());
            for n in [1usize, 3, 8] {
                let (xc, xg) = pair(&g, n, cols, &r.vec(n * cols, 1.0));
                assert_close(
                    &g.to_host(&g.linear(&xg, &wg)),
                    &c.linear(&xc, &wc).data,
                    &format!("linear {n}x{cols} · [{rows}, {cols}] {dtype}ᵀ"),
                );
            }
        }
    }
}

#[test]
fn shared_expert_gate_reads_its_logit_column_like_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(11);
    // The router's logits: 512 experts ‖ the shared gate (the last column); one decode row,
    // a prefill batch and a narrow odd case.
    for (n, h, logit_cols) in [(1usize, 2560usize, 513usize), (7, 2560, 513), (3, 100, 9)] {
        let (xc, xg) = pair(&g, n, h, &r.vec(n * h, 2.0));
        let (lc, lg) = pair(&g, n, logit_cols, &r.vec(n * logit_cols, 6.0));
        for col in [logit_cols - 1, 0] {
            assert_close(
                &g.to_host(&g.sigmoid_gate_rows(&xg, &lg, col)),
                &c.sigmoid_gate_rows(&xc, &lc, col).data,
                &format!("sigmoid_gate_rows {n}x{h}, column {col} of {logit_cols}"),
            );
        }
    }
}

#[test]
fn moe_routing_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(3);
    for (n, experts, k, normalize) in [(37, 64, 10, true), (1, 512, 10, true), (5, 16, 4, false)] {
        let mut logits = r.vec(n * experts, 3.0);
        // Exact ties: the lower expert comes first on both backends.
        logits[1] = logits[0];
        logits[2] = logits[0];
        let (lc, lg) = pair(&g, n, experts, &logits);
        let got = g.moe_route(&lg, k, normalize);
        let want = c.moe_route(&lc, k, normalize);
        assert_eq!(got.top_k, k);
        assert_eq!(
            got.experts, want.experts,
            "routing of {n} rows over {experts} experts, top {k}: expert ids"
        );
        assert_close(
            &got.weights,
            &want.weights,
            &format!("routing weights {n}x{experts} top {k}"),
        );
    }
}

/// One backend's experts.
type Experts<B> = Vec<ExpertMatrices<<B as Backend>::Matrix>>;

/// Random experts on both backends: `[2I, H]` gate‖up and `[H, I]` down each.
fn experts_pair(
    g: &CudaBackend,
    r: &mut Rng,
    count: usize,
    hidden: usize,
    inter: usize,
    dtype: DType,
) -> (Experts<CpuBackend>, Experts<CudaBackend>) {
    let c = CpuBackend::new();
    let mut cpu = Vec::new();
    let mut gpu = Vec::new();
    for e in 0..count {
        let gu = host_matrix(
            &format!("e{e}.gate_up"),
            2 * inter,
            hidden,
            &r.vec(2 * inter * hidden, 0.1),
            dtype,
        );
        let down = host_matrix(
            &format!("e{e}.down"),
            hidden,
            inter,
            &r.vec(hidden * inter, 0.1),
            dtype,
        );
        cpu.push(ExpertMatrices {
            gate_up: c.matrix(&gu).unwrap(),
            down: c.matrix(&down).unwrap(),
        });
        gpu.push(ExpertMatrices {
            gate_up: g.matrix(&gu).unwrap(),
            down: g.matrix(&down).unwrap(),
        });
    }
    (cpu, gpu)
}

#[test]
fn routed_experts_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(9);
    // (rows, experts, top-k, hidden, intermediate): decode (grouped matvec), a few rows, a
    // prefill batch whose experts get more than 8 rows each (GEMM), odd widths (scalar loads).
    let cases = [
        (1usize, 64usize, 10usize, 2560usize, 640usize),
        (3, 16, 4, 256, 96),
        (40, 8, 4, 256, 96),
        (12, 6, 2, 100, 36),
    ];
    for dtype in [DType::BF16, DType::F32] {
        for &(n, count, k, hidden, inter) in &cases {
            let (ec, eg) = experts_pair(&g, &mut r, count, hidden, inter, dtype);
            let logits = r.vec(n * count, 2.0);
            let routing: MoeRouting = c.moe_route(&c.from_host(n, count, &logits), k, true);
            let (xc, xg) = pair(&g, n, hidden, &r.vec(n * hidden, 1.0));
            assert_close(
                &g.to_host(&g.moe_experts(&xg, &routing, &eg)),
                &c.moe_experts(&xc, &routing, &ec).data,
                &format!("moe_experts {dtype} {n} rows, {count} experts top {k}, {hidden}x{inter}"),
            );
        }
    }
}

/// Random quantized experts of `formats` (gate‖up, down) on the CPU and on `g`, the blocks of
/// expert e seeded `seed + e` and `seed + 100 + e`.
fn quant_experts_pair(
    g: &CudaBackend,
    (fg, fd): (
        capy_engine::backend::cpu::experts::RowFormat,
        capy_engine::backend::cpu::experts::RowFormat,
    ),
    count: usize,
    hidden: usize,
    inter: usize,
    seed: u64,
) -> (Experts<CpuBackend>, Experts<CudaBackend>) {
    use capy_engine::backend::cpu::experts::random_blocks;
    let c = CpuBackend::new();
    let (mut ec, mut eg) = (Vec::new(), Vec::new());
    for e in 0..count as u64 {
        let gu = random_blocks(fg, 2 * inter * hidden / fg.block_len(), seed + e);
        let down = random_blocks(fd, hidden * inter / fd.block_len(), seed + 100 + e);
        let (mg, md) = (0.01, 0.02);
        ec.push(ExpertMatrices {
            gate_up: c.quant_matrix(fg, 2 * inter, hidden, &gu, mg).unwrap(),
            down: c.quant_matrix(fd, hidden, inter, &down, md).unwrap(),
        });
        eg.push(ExpertMatrices {
            gate_up: g.quant_matrix(fg, 2 * inter, hidden, &gu, mg).unwrap(),
            down: g.quant_matrix(fd, hidden, inter, &down, md).unwrap(),
        });
    }
    (ec, eg)
}

/// A fast-path result against the exact one: finite, and off by at most `rms_tol` times the
/// exact output's root mean square in rms and `max_tol` times it at any element (rounding the
/// operands moves every output a little; a misplaced row or expert moves some by ~100%).
fn assert_near_exact(got: &[f32], want: &[f32], (rms_tol, max_tol): (f64, f64), what: &str) {
    let scale = rms(want.iter().copied());
    let err = rms(got.iter().zip(want).map(|(g, w)| g - w));
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, f32::max);
    println!("{what}: rms {scale:.3e}, rms |Δ| {err:.3e}, max |Δ| {worst:.3e}");
    assert!(
        scale > 0.0 && got.iter().all(|v| v.is_finite()),
        "{what}: not finite"
    );
    assert!(
        err <= rms_tol * scale && (worst as f64) <= max_tol * scale,
        "{what}: rms |Δ| {err:.3e}, max |Δ| {worst:.3e} against an output rms of {scale:.3e}"
    );
}

/// Root mean square, in f64.
fn rms(values: impl Iterator<Item = f32>) -> f64 {
    let (sum, k) = values.fold((0f64, 0usize), |(s, k), x| (s + (x as f64).powi(2), k + 1));
    (sum / k.max(1) as f64).sqrt()
}

/// Quantized experts (the hybrid expert cache keeps its resident copies in their block
/// format): the GPU must not read them as dense rows. Decode (one row), a small batch (the
/// grouped matvec), and a prefill batch whose experts take more than 8 rows each (the grouped
/// GEMMs: at Flash-Next's shape 24 experts are two chunks of the dequantization scratch).
#[test]
fn quantized_routed_experts_match_cpu() {
    use capy_engine::backend::cpu::experts::RowFormat;
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(11);
    // A small shape and Flash-Next's (2560 × 640: 80 groups a down row, 2560 down rows).
    for (hidden, inter, (gate_fmt, down_fmt)) in [(512usize, 128usize), (2560, 640)]
        .into_iter()
        .flat_map(|(h, i)| {
            [("nvfp4", "nvfp4"), ("iq3_s", "q2_0"), ("q8_0", "q8_0")].map(|f| (h, i, f))
        })
    {
        let count = if hidden == 2560 { 24usize } else { 12 };
        let (fg, fd) = (
            RowFormat::parse(gate_fmt).unwrap(),
            RowFormat::parse(down_fmt).unwrap(),
        );
        let (ec, eg) = quant_experts_pair(&g, (fg, fd), count, hidden, inter, 100);
        for n in [1usize, 5, 96] {
            let logits = r.vec(n * count, 2.0);
            let routing: MoeRouting = c.moe_route(&c.from_host(n, count, &logits), 4, true);
            let (xc, xg) = pair(&g, n, hidden, &r.vec(n * hidden, 1.0));
            assert_close(
                &g.to_host(&g.moe_experts(&xg, &routing, &eg)),
                &c.moe_experts(&xc, &routing, &ec).data,
                &format!("moe_experts {gate_fmt}/{down_fmt} {n} rows, {count} experts top 4, {hidden}x{inter}"),
            );
        }
    }
}

/// A decode row's routing kept on the device (`moe_routed_on_device`: route, group and run the
/// experts with no host round trip) gives bit for bit what routing on the host and grouping
/// there gives (the same kernels, the same order of sums), and matches the CPU: quantized
/// experts (Flash-Next's IQ3_S gate‖up with Q2_0 down, and NVFP4) and dense BF16 ones, top 10
/// of 64 from router logits with one column more (the shared expert's gate), both
/// normalisations; and with the gated shared expert added in its combine. It declines what it
/// does not take: several rows on the exact path, experts of mixed kinds.
#[test]
fn device_routed_experts_equal_host_routing() {
    use capy_engine::backend::cpu::experts::RowFormat;
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(17);
    let (count, k, hidden, inter) = (64usize, 10usize, 2560usize, 640usize);
    let quantized = [("iq3_s", "q2_0"), ("nvfp4", "nvfp4")].map(|(fg, fd)| {
        let formats = (RowFormat::parse(fg).unwrap(), RowFormat::parse(fd).unwrap());
        (
            format!("{fg}/{fd}"),
            quant_experts_pair(&g, formats, count, hidden, inter, 300),
        )
    });
    let dense = (
        "bf16".to_string(),
        experts_pair(&g, &mut r, count, hidden, inter, DType::BF16),
    );
    for (what, (ec, eg)) in quantized.iter().chain(std::iter::once(&dense)) {
        for normalize in [true, false] {
            let logits = r.vec(count + 1, 2.0);
            let (lc, lg) = pair(&g, 1, count + 1, &logits);
            let (xc, xg) = pair(&g, 1, hidden, &r.vec(hidden, 1.0));
            let on_device = g
                .moe_routed_on_device(&xg, &lg, k, normalize, eg, None)
                .unwrap_or_else(|| panic!("{what}: the device routing declined a decode row"));
            let routing = g.moe_route(&g.cols(&lg, 0..count), k, normalize);
            let on_host = g.moe_experts(&xg, &routing, eg);
            assert_eq!(
                g.to_host(&on_device),
                g.to_host(&on_host),
                "{what}, normalize {normalize}: device routing against host routing"
            );
            let cpu_routing = c.moe_route(&c.cols(&lc, 0..count), k, normalize);
            assert_close(
                &g.to_host(&on_device),
                &c.moe_experts(&xc, &cpu_routing, ec).data,
                &format!("{what}, normalize {normalize}: device routing against the CPU"),
            );
            // With the shared expert's output: its gate (the logits' last column) and the sum
            // in the combine, as `sigmoid_gate_rows` then `add_assign`.
            let shared = g.from_host(1, hidden, &r.vec(hidden, 1.0));
            let with_shared = g
                .moe_routed_on_device(&xg, &lg, k, normalize, eg, Some(&shared))
                .unwrap_or_else(|| panic!("{what}: declined with a shared expert"));
            let mut composed = g.moe_experts(&xg, &routing, eg);
            g.add_assign(&mut composed, &g.sigmoid_gate_rows(&shared, &lg, count));
            assert_eq!(
                g.to_host(&with_shared),
                g.to_host(&composed),
                "{what}, normalize {normalize}: the shared expert added in the combine"
            );
        }
    }
    let (_, (_, eg)) = &quantized[0];
    let two_rows = g.from_host(2, hidden, &r.vec(2 * hidden, 1.0));
    let two_logits = g.from_host(2, count + 1, &r.vec(2 * (count + 1), 1.0));
    assert!(
        g.moe_routed_on_device(&two_rows, &two_logits, k, true, eg, None)
            .is_none(),
        "two rows are routed on the host on the exact path"
    );
    let iq3s = (
        RowFormat::parse("iq3_s").unwrap(),
        RowFormat::parse("q2_0").unwrap(),
    );
    let (_, quant_half) = quant_experts_pair(&g, iq3s, count / 2, hidden, inter, 500);
    let (_, dense_half) = experts_pair(&g, &mut r, count / 2, hidden, inter, DType::BF16);
    let mixed: Vec<_> = quant_half.into_iter().chain(dense_half).collect();
    let (x1, l1) = (
        g.from_host(1, hidden, &r.vec(hidden, 1.0)),
        g.from_host(1, count + 1, &r.vec(count + 1, 1.0)),
    );
    assert!(
        g.moe_routed_on_device(&x1, &l1, k, true, &mixed, None)
            .is_none(),
        "experts of mixed kinds are routed on the host"
    );
}

/// The fast path's prefill experts (the grouped GEMMs on BF16 operands) against the CPU's
/// exact sums: BF16 rounds each weight and activation to 8 bits of mantissa, so the check is
/// relative to the output's size (a misplaced row or expert is off by ~100%).
#[test]
fn quantized_prefill_experts_on_the_fast_path_stay_near_exact() {
    use capy_engine::backend::cpu::experts::RowFormat;
    let fast = match CudaBackend::with_exact_math(0, None, false) {
        Ok(b) => b,
        Err(e) => return capy_engine::backend::cuda::no_device_for_test(&format!("{e:#}")),
    };
    let c = CpuBackend::new();
    let mut r = Rng(12);
    let (hidden, inter, count, n) = (2560usize, 640usize, 24usize, 96usize);
    for (gate_fmt, down_fmt) in [("iq3_s", "q2_0"), ("nvfp4", "nvfp4")] {
        let (fg, fd) = (
            RowFormat::parse(gate_fmt).unwrap(),
            RowFormat::parse(down_fmt).unwrap(),
        );
        let (ec, eg) = quant_experts_pair(&fast, (fg, fd), count, hidden, inter, 300);
        let logits = r.vec(n * count, 2.0);
        let routing: MoeRouting = c.moe_route(&c.from_host(n, count, &logits), 4, true);
        let x = r.vec(n * hidden, 1.0);
        let got = fast.to_host(&fast.moe_experts(&fast.from_host(n, hidden, &x), &routing, &eg));
        let want = c
            .moe_experts(&c.from_host(n, hidden, &x), &routing, &ec)
            .data;
        assert_near_exact(
            &got,
            &want,
            (1e-2, 0.1),
            &format!("fast moe_experts {gate_fmt}/{down_fmt} {n} rows"),
        );
    }
}

/// Prefill rows routed on the device on the fast path (kernels/moe_prefill.cu: the picks sorted
/// by expert into blocks, tensor-core gate/up and down on the quantized weights in place), at
/// Flash-Next's shape with experts of several blocks: against the CPU's exact sums and the
/// host-grouped fast path (both round weights and x to BF16, so the check is relative to the
/// output's size), with and without the gated shared expert. The exact path, a backend with
/// the device routing switched off, and a few rows (experts of a handful of entries) decline.
#[test]
fn quantized_prefill_experts_routed_on_the_device_stay_near_exact() {
    use capy_engine::backend::cpu::experts::RowFormat;
    let (Some(exact), Ok(fast)) = (gpu(), CudaBackend::with_exact_math(0, None, false)) else {
        return capy_engine::backend::cuda::no_device_for_test(&"a backend did not start");
    };
    let c = CpuBackend::new();
    let mut r = Rng(14);
    let (hidden, inter, count, k, n) = (2560usize, 640usize, 24usize, 4usize, 500usize);
    for (gate_fmt, down_fmt) in [("iq3_s", "q2_0"), ("nvfp4", "nvfp4")] {
        let formats = (
            RowFormat::parse(gate_fmt).unwrap(),
            RowFormat::parse(down_fmt).unwrap(),
        );
        let (ec, eg) = quant_experts_pair(&fast, formats, count, hidden, inter, 900);
        // One column more than the experts: the shared expert's gate.
        let logits = r.vec(n * (count + 1), 2.0);
        let x = r.vec(n * hidden, 1.0);
        let shared = r.vec(n * hidden, 1.0);
        let (lc, lg) = pair(&fast, n, count + 1, &logits);
        let routing = c.moe_route(&c.cols(&lc, 0..count), k, true);
        let xc = c.from_host(n, hidden, &x);
        let want = c.moe_experts(&xc, &routing, &ec).data;
        let xg = fast.from_host(n, hidden, &x);
        let device = fast
            .moe_routed_on_device(&xg, &lg, k, true, &eg, None)
            .expect("the fast path routes prefill rows on the device");
        let what = format!("prefill experts {gate_fmt}/{down_fmt} routed on the device, {n} rows");
        assert_near_exact(&fast.to_host(&device), &want, (1e-2, 0.1), &what);
        fast.set_moe_device_routing(false);
        let host_grouped = fast.to_host(&fast.moe_experts(&xg, &routing, &eg));
        assert!(
            fast.moe_routed_on_device(&xg, &lg, k, true, &eg, None)
                .is_none(),
            "the device routing switched off declines"
        );
        fast.set_moe_device_routing(true);
        assert_near_exact(
            &fast.to_host(&device),
            &host_grouped,
            (1e-2, 0.1),
            &format!("{what}, against the host-grouped fast path"),
        );
        // The gated shared expert added in the combine, as sigmoid_gate_rows then add_assign.
        let sg = fast.from_host(n, hidden, &shared);
        let with_shared = fast
            .moe_routed_on_device(&xg, &lg, k, true, &eg, Some(&sg))
            .expect("routed on the device with a shared expert");
        let sc = c.from_host(n, hidden, &shared);
        let mut want_shared = c.moe_experts(&xc, &routing, &ec);
        c.add_assign(&mut want_shared, &c.sigmoid_gate_rows(&sc, &lc, count));
        assert_near_exact(
            &fast.to_host(&with_shared),
            &want_shared.data,
            (1e-2, 0.1),
            &format!("{what}, with the shared expert"),
        );
        // A few rows (5 × 4 entries over 24 experts) keep the host path's grouped matvecs.
        let (few_x, few_logits) = (
            fast.from_host(5, hidden, &x[..5 * hidden]),
            fast.from_host(5, count + 1, &logits[..5 * (count + 1)]),
        );
        assert!(
            fast.moe_routed_on_device(&few_x, &few_logits, k, true, &eg, None)
                .is_none(),
            "a few prefill rows are grouped on the host"
        );
        let (_, ee) = quant_experts_pair(&exact, formats, count, hidden, inter, 900);
        assert!(
            exact
                .moe_routed_on_device(
                    &exact.from_host(n, hidden, &x),
                    &exact.from_host(n, count + 1, &logits),
                    k,
                    true,
                    &ee,
                    None
                )
                .is_none(),
            "the exact path routes prefill rows on the host"
        );
    }
}

/// The fast path's decode experts (one row: kernels/moe_quant_decode.cu's int8 kernels, IQ3_S
/// with Q2_0 and NVFP4, at Flash-Next's shape) against the CPU's exact sums, routed on the host
/// and on the device: x and the SwiGLU output are rounded to int8 per 32 values, so the check is
/// relative to the output's size (a misplaced row or expert is off by ~100%). The exact GPU
/// path must differ from them (else the int8 kernels did not run).
#[test]
fn quantized_decode_experts_on_the_fast_path_stay_near_exact() {
    use capy_engine::backend::cpu::experts::RowFormat;
    let (Some(exact), Ok(fast)) = (gpu(), CudaBackend::with_exact_math(0, None, false)) else {
        return capy_engine::backend::cuda::no_device_for_test(&"a backend did not start");
    };
    let c = CpuBackend::new();
    let mut r = Rng(13);
    let (hidden, inter, count, k) = (2560usize, 640usize, 24usize, 4usize);
    for (gate_fmt, down_fmt) in [("iq3_s", "q2_0"), ("nvfp4", "nvfp4")] {
        let formats = (
            RowFormat::parse(gate_fmt).unwrap(),
            RowFormat::parse(down_fmt).unwrap(),
        );
        let (ec, eg) = quant_experts_pair(&fast, formats, count, hidden, inter, 700);
        let (_, ee) = quant_experts_pair(&exact, formats, count, hidden, inter, 700);
        let logits = r.vec(count + 1, 2.0);
        let x = r.vec(hidden, 1.0);
        let routing = c.moe_route(&c.from_host(1, count, &logits[..count]), k, true);
        let want = c
            .moe_experts(&c.from_host(1, hidden, &x), &routing, &ec)
            .data;
        let xg = fast.from_host(1, hidden, &x);
        let host_routed = fast.to_host(&fast.moe_experts(&xg, &routing, &eg));
        let device_routed = fast.to_host(
            &fast
                .moe_routed_on_device(
                    &xg,
                    &fast.from_host(1, count + 1, &logits),
                    k,
                    true,
                    &eg,
                    None,
                )
                .expect("the device routing takes a decode row"),
        );
        let exact_out =
            exact.to_host(&exact.moe_experts(&exact.from_host(1, hidden, &x), &routing, &ee));
        assert_ne!(
            host_routed, exact_out,
            "{gate_fmt}/{down_fmt}: the fast path computed the exact sums"
        );
        for (how, got) in [("host", &host_routed), ("device", &device_routed)] {
            assert_near_exact(
                got,
                &want,
                (3e-2, 0.15),
                &format!("fast decode experts {gate_fmt}/{down_fmt}, routed on the {how}"),
            );
        }
    }
}

/// QSA prefill on the fast path (the masked dense attention on BF16 tensor cores) against the
/// CPU's exact sparse attention: BF16 rounds Q, K, V and the probabilities, so the check is
/// relative to the output's size; attending a wrong token set moves rows by far more.
#[test]
fn qsa_prefill_on_the_fast_path_stays_near_exact() {
    let fast = match CudaBackend::with_exact_math(0, None, false) {
        Ok(b) => b,
        Err(e) => return capy_engine::backend::cuda::no_device_for_test(&format!("{e:#}")),
    };
    let c = CpuBackend::new();
    let mut r = Rng(21);
    let (a, s) = flash_next::attention_shapes();
    let (total, n) = (2300usize, 300usize);
    let past = total - n;
    let (qd, kvd) = (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim);
    let iq = s.index_heads * s.index_head_dim;
    let blocks = total / s.compress_ratio;
    let data = [
        r.vec(n * qd, 1.0),
        r.vec(total * kvd, 1.0),
        r.vec(total * kvd, 1.0),
        r.vec(n * iq, 1.0),
        r.vec(blocks * s.index_head_dim, 1.0),
    ];
    let shapes = [
        (n, qd),
        (total, kvd),
        (total, kvd),
        (n, iq),
        (blocks, s.index_head_dim),
    ];
    let g: Vec<_> = data
        .iter()
        .zip(shapes)
        .map(|(d, (rows, cols))| fast.from_host(rows, cols, d))
        .collect();
    let h: Vec<_> = data
        .iter()
        .zip(shapes)
        .map(|(d, (rows, cols))| c.from_host(rows, cols, d))
        .collect();
    let got = fast.to_host(&fast.qsa_attention(&g[0], &g[1], &g[2], &g[3], &g[4], past, a, s));
    let want = c
        .qsa_attention(&h[0], &h[1], &h[2], &h[3], &h[4], past, a, s)
        .data;
    let scale = rms(want.iter().copied());
    let err = rms(got.iter().zip(&want).map(|(g, w)| g - w));
    println!("fast qsa_attention {total} tokens, {n} queries: rms {scale:.3e}, rms |Δ| {err:.3e}");
    assert!(scale > 0.0 && got.iter().all(|v| v.is_finite()));
    assert!(
        err <= 2e-2 * scale,
        "fast qsa_attention: rms |Δ| {err:.3e} against an output rms of {scale:.3e}"
    );
}
