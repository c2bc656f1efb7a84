//! Fused dequantise-and-dot kernels: a block is decoded into registers and multiplied with
//! the activations directly (no scratch row), several weight rows per call, and each decoded
//! block is reused for up to four activation vectors (tokens routed to the same expert)
//! while it is in registers.
//!
//! Two paths (chosen once per process from `CAPY_EXACT_MATH`, see [`math_path`]):
//!
//! - **Exact**: f32 activations times the dequantised weights. The kernels reassociate the
//!   sum (per-group partial sums are multiplied by the group's scale, lanes are summed at the
//!   end), so they differ from the scalar reference (`format::dequantize_row_scalar` followed
//!   by `simd::dot_scalar`) only by float rounding: `|Δ| ≤ 1e-5 · Σ|wᵢxᵢ|` per dot product at
//!   the lengths used (≤ 4096; tested in `tests/quant_experts.rs` on every ISA).
//! - **Fast** (the default where a fused fast kernel exists): activations are quantised to
//!   int8 per block (`q = round(x / d)`, `d = max|x| / 127`; blocks of 64 for NVFP4 and Q2_0,
//!   32 for IQ3_S), and the integer weights (NVFP4's doubled E2M1 values, IQ3_S grid values
//!   with their signs, Q2_0 codes) are dotted with them in integer arithmetic: VNNI
//!   `vpdpbusd` on AVX-512, `vpmaddubsw` + `vpmaddwd` on AVX2, as llama.cpp does. The integer
//!   group sums are exact and identical on every ISA (the scalar fast kernel is the
//!   reference); only the final f32 combination of `scale × group sum` is reassociated.
//!   The deviation from the exact path comes from rounding the activations; it is measured
//!   by `bench cpu-experts` (key `fast_vs_exact`) and by the tests.
//!
//! Formats without a fused kernel (FP8, Q8_0, the IQ2/IQ3_XXS types, float rows) fall back to
//! dequantising a row into the worker's scratch and dotting it in f32 (both paths).
//!
//! Activations are prepared once per call ([`prepare`]) into the layout the kernels read:
//! NVFP4 exact: per block, even values then odd ones in the order of the AVX2 kernel's byte
//! unpacks, or nibble-major per two blocks (AVX-512), see [`ActSpec::slot`]; NVFP4 fast: per
//! 128 values, the 64 even then the 64 odd ones; Q2_0: per 64 values, value `4b + j` at
//! `16j + b` (the `j`-th 2-bit field of byte `b`); otherwise natural order.

use super::format::{dequantize_row, RowFormat};
use crate::backend::cpu::simd::Isa;
use crate::quant::fp8::E4M3_TO_F32;
use crate::quant::ggml::GgmlType;
use crate::quant::iq_tables::IQ3S_GRID;
use crate::quant::nvfp4::E2M1_DOUBLED;
use std::sync::OnceLock;

/// Which arithmetic the expert kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum MathPath {
    /// f32 activations on the dequantised weights (matches the reference model).
    Exact,
    /// int8 activations per block, integer dot products (where a fused kernel exists).
    Fast,
}

impl MathPath {
    pub fn name(self) -> &'static str {
        match self {
            MathPath::Exact => "exact",
            MathPath::Fast => "fast",
        }
    }
}

/// The path for this process: `CAPY_EXACT_MATH=1` (or `true`) selects [`MathPath::Exact`];
/// read once, at the first call.
pub fn math_path() -> MathPath {
    static PATH: OnceLock<MathPath> = OnceLock::new();
    *PATH.get_or_init(|| match std::env::var("CAPY_EXACT_MATH").ok().as_deref() {
        Some("1") | Some("true") | Some("yes") => MathPath::Exact,
        _ => MathPath::Fast,
    })
}

/// How a row of `k` weights of `fmt` is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Dequantise into scratch, then an f32 dot product (natural activation order).
    Dequant,
    /// Fused f32 kernel.
    Exact,
    /// Fused int8 kernel.
    Fast,
}

/// The computation chosen for rows of one format and length, and the activation layout it
/// needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActSpec {
    pub fmt: RowFormat,
    pub kind: Kind,
    pub k: usize,
    pub isa: Isa,
    /// IQ3_S on AVX-512 with VBMI + BITALG: the grid is decoded with in-register byte
    /// permutes instead of gathers, which wants its own activation order (see [`Self::slot`]).
    pub iq3s_shuffle: bool,
    /// IQ3_S without the shuffle decode: grid entries fetched with `vpgatherdd` (true) or with
    /// scalar loads (false, the default; see [`iq3s_gather`]).
    pub iq3s_gather: bool,
}

/// Whether the gather-decoded IQ3_S kernels use `vpgatherdd` for the grid (`CAPY_IQ3S_GATHER=1`)
/// instead of eight scalar loads. Gathers are microcoded and, on Intel cores with the Gather
/// Data Sampling mitigation, several times slower than the loads they replace; the scalar
/// loads are the default, and the switch is there to measure both on a new machine.
pub fn iq3s_gather() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("CAPY_IQ3S_GATHER").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
    })
}

/// Whether the CPU has AVX-512 VBMI (`vpermt2b`) and BITALG (`vpshufbitqmb`), which the
/// shuffle-decoded IQ3_S kernels need (detected once; without them the gather kernels run).
/// `CAPY_CPU_NO_VBMI=1` turns them off, to compare with the gather kernels.
pub fn has_vbmi_bitalg() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| {
        if std::env::var("CAPY_CPU_NO_VBMI").is_ok_and(|v| v == "1") {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512vbmi") && is_x86_feature_detected!("avx512bitalg")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

const NVFP4: RowFormat = RowFormat::Nvfp4;
const IQ3S: RowFormat = RowFormat::Ggml(GgmlType::Iq3S);
const Q2_0: RowFormat = RowFormat::Ggml(GgmlType::Q2_0);

/// Whether AVX-512 VNNI is present (the AVX-512 fast kernels need it; without it the AVX2
/// fast kernels run).
pub fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

impl ActSpec {
    pub fn new(isa: Isa, path: MathPath, fmt: RowFormat, k: usize) -> ActSpec {
        let fast_ok = match fmt {
            RowFormat::Nvfp4 => k.is_multiple_of(128),
            RowFormat::Ggml(GgmlType::Iq3S) | RowFormat::Ggml(GgmlType::Q2_0) => true,
            _ => false,
        };
        let exact_ok = isa >= Isa::Avx2 && matches!(fmt, NVFP4 | IQ3S | Q2_0);
        let kind = if path == MathPath::Fast && fast_ok {
            Kind::Fast
        } else if exact_ok {
            Kind::Exact
        } else {
            Kind::Dequant
        };
        // Mirrors the dispatch in `x86::one`: the AVX-512 fast kernels need VNNI too.
        let iq3s_shuffle = isa == Isa::Avx512
            && fmt == IQ3S
            && has_vbmi_bitalg()
            && match kind {
                Kind::Exact => true,
                Kind::Fast => has_vnni(),
                Kind::Dequant => false,
            };
        ActSpec {
            fmt,
            kind,
            k,
            isa,
            iq3s_shuffle,
            iq3s_gather: iq3s_gather(),
        }
    }

    /// Where value `i` goes in the prepared vector.
    #[inline]
    pub fn slot(&self, i: usize) -> usize {
        match (self.kind, self.fmt) {
            (Kind::Dequant, _) => i,
            (Kind::Fast, RowFormat::Nvfp4) => {
                let (base, r) = (i / 128 * 128, i % 128);
                base + if r % 2 == 0 { r / 2 } else { 64 + r / 2 }
            }
            // Exact, AVX-512: the kernel reads a block's 32 code bytes as 8 u32 lanes and
            // shifts nibble `s` of every lane into the index bits, two blocks side by side
            // (lanes 8–15 the second): value `64j + 8l + s` of the pair at `16s + 8j + l`; an
            // odd last block alone, value `8l + s` at `8s + l`. AVX2: value `2i + h` (nibble
            // `h` of code byte `i`) in vector `4h + r` at lane `4q + c`, where `i = 16q + 4r + c`
            // (see `nvfp4_exact_avx2`).
            (_, RowFormat::Nvfp4) => {
                if self.isa == Isa::Avx512 && i / 128 * 128 + 128 <= self.k {
                    let (base, r) = (i / 128 * 128, i % 128);
                    base + 16 * (r % 8) + 8 * (r / 64) + (r % 64) / 8
                } else if self.isa == Isa::Avx512 {
                    let (base, r) = (i / 64 * 64, i % 64);
                    base + 8 * (r % 8) + r / 8
                } else {
                    let (base, r) = (i / 64 * 64, i % 64);
                    let (byte, h) = (r / 2, r % 2);
                    let (q, r4, c) = (byte / 16, byte % 16 / 4, byte % 4);
                    base + 8 * (4 * h + r4) + 4 * q + c
                }
            }
            (_, RowFormat::Ggml(GgmlType::Q2_0)) => {
                let (base, r) = (i / 64 * 64, i % 64);
                base + 16 * (r % 4) + r / 4
            }
            // Weight `4e + j` of a 256-block is byte `j` of grid entry `e`; the shuffle
            // kernels decode byte `j` of all 64 entries into one register. Fast: entry `e` at
            // `64j + e`. Exact: the register's i32 lane `l` holds entries `4l..4l+4`, byte
            // `b` of each lane becomes one f32 vector, so entry `4l + b` sits at `64j + 16b + l`.
            (kind, RowFormat::Ggml(GgmlType::Iq3S)) if self.iq3s_shuffle => {
                let (base, r) = (i / 256 * 256, i % 256);
                let (e, j) = (r / 4, r % 4);
                base + 64 * j
                    + if kind == Kind::Fast {
                        e
                    } else {
                        16 * (e % 4) + e / 4
                    }
            }
            _ => i,
        }
    }

    /// Where the fast kind's quantisation block starting at value `at` goes, as
    /// `(start, ways, stride)`: value `at + j` of the block at `start + stride·(j % ways) +
    /// j / ways` (a `ways`-row transpose; `ways` 1 is the natural order). None where the
    /// order is not of that form (then [`Self::slot`] places each value).
    pub fn quant_block_layout(&self, at: usize) -> Option<(usize, usize, usize)> {
        match (self.kind, self.fmt) {
            (Kind::Fast, RowFormat::Nvfp4) => {
                // Even values first, then odd ones, per 128; a 64-value block is one half.
                let (base, r) = (at / 128 * 128, at % 128);
                Some((base + r / 2, 2, 64))
            }
            (_, RowFormat::Ggml(GgmlType::Q2_0)) => Some((at, 4, 16)),
            (Kind::Fast, RowFormat::Ggml(GgmlType::Iq3S)) if self.iq3s_shuffle => {
                // Byte j of the block's 8 grid entries goes to row j of 64 entries.
                let (base, r) = (at / 256 * 256, at % 256);
                Some((base + r / 4, 4, 64))
            }
            (Kind::Fast, RowFormat::Ggml(GgmlType::Iq3S)) => Some((at, 1, 0)),
            _ => None,
        }
    }

    /// Values per activation scale on the fast path.
    pub fn qblock(&self) -> usize {
        match self.fmt {
            RowFormat::Ggml(GgmlType::Iq3S) => 32,
            _ => 64,
        }
    }

    /// Scales (and block sums) per prepared vector: enough for any format.
    pub fn scales_len(k: usize) -> usize {
        k.div_ceil(32)
    }
}

/// One prepared activation vector: f32 values (exact and dequant kinds) or int8 values with
/// a scale and the integer sum per block (fast kind).
#[derive(Clone, Copy)]
pub struct Act<'a> {
    pub f: &'a [f32],
    pub q: &'a [i8],
    pub s: &'a [f32],
    pub sums: &'a [f32],
}

/// Prepares `x` (natural order, `spec.k` values) for `spec`. For the fast kind, `q`, `s` and
/// `sums` are written; otherwise `f`.
pub fn prepare(
    spec: &ActSpec,
    x: &[f32],
    f: &mut [f32],
    q: &mut [i8],
    s: &mut [f32],
    sums: &mut [f32],
) {
    assert_eq!(x.len(), spec.k, "prepare: expected {} values", spec.k);
    if spec.kind != Kind::Fast {
        for (i, &v) in x.iter().enumerate() {
            f[spec.slot(i)] = v;
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if spec.isa >= Isa::Avx2 {
        // SAFETY: `spec.isa` is supported by this CPU (the ActSpec's ISA is checked at dispatch).
        unsafe { x86::quantize_blocks_avx2(spec, x, q, s, sums) };
        return;
    }
    quantize_blocks(spec, x, q, s, sums);
}

/// The fast kind's int8 rounding of `x` per block of [`ActSpec::qblock`] values, into the
/// kernel's order: the scalar reference of `x86::quantize_blocks_avx2`, which gives the same
/// bytes and scales.
fn quantize_blocks(spec: &ActSpec, x: &[f32], q: &mut [i8], s: &mut [f32], sums: &mut [f32]) {
    let qb = spec.qblock();
    for (b, xb) in x.chunks(qb).enumerate() {
        quantize_one_block(spec, b * qb, xb, q, &mut s[b], &mut sums[b]);
    }
}

/// One block of [`quantize_blocks`]: the values `at..at + xb.len()` of the vector.
fn quantize_one_block(
    spec: &ActSpec,
    at: usize,
    xb: &[f32],
    q: &mut [i8],
    scale: &mut f32,
    block_sum: &mut f32,
) {
    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (j, &v) in xb.iter().enumerate() {
        let qv = (v * id).round().clamp(-127.0, 127.0) as i8;
        q[spec.slot(at + j)] = qv;
        sum += qv as i32;
    }
    *scale = d;
    *block_sum = sum as f32;
}

/// `out[r · acts.len() + a] = row_r · act_a` for `rows.len() / row_bytes` rows of `spec`.
/// `scratch` (≥ `spec.k` values) is used by the dequantising fallback only.
pub fn dots(
    spec: &ActSpec,
    rows: &[u8],
    row_bytes: usize,
    acts: &[Act<'_>],
    out: &mut [f32],
    scratch: &mut [f32],
) {
    let nrows = rows.len() / row_bytes;
    assert_eq!(rows.len(), nrows * row_bytes, "dots: partial row");
    assert_eq!(out.len(), nrows * acts.len(), "dots: output size");
    assert!(
        spec.isa <= Isa::best_supported(),
        "dots: ISA not supported by this CPU"
    );
    let k = spec.k;
    for a in acts {
        match spec.kind {
            Kind::Fast => assert!(
                a.q.len() >= k
                    && a.s.len() >= k.div_ceil(spec.qblock())
                    && a.sums.len() >= k.div_ceil(spec.qblock())
            ),
            _ => assert!(a.f.len() >= k),
        }
    }
    match spec.kind {
        Kind::Dequant => {
            let w = &mut scratch[..k];
            for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
                dequantize_row(spec.isa, spec.fmt, row, w);
                for (a, act) in acts.iter().enumerate() {
                    out[r * acts.len() + a] = super::dot::dot(spec.isa, w, &act.f[..k]);
                }
            }
        }
        Kind::Exact | Kind::Fast => {
            #[cfg(target_arch = "x86_64")]
            if spec.isa >= Isa::Avx2 {
                // SAFETY: the ISA is supported (asserted), rows are whole, activations long
                // enough (asserted).
                unsafe { x86::dots(spec, rows, row_bytes, acts, out) };
                return;
            }
            // Scalar (only the fast kind reaches here: exact on scalar is `Dequant`).
            for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
                for (a, act) in acts.iter().enumerate() {
                    out[r * acts.len() + a] = fast_dot_scalar(spec, row, act);
                }
            }
        }
    }
}

/// Starts loading the first bytes of `rows` (up to the kernels' prefetch distance) into the
/// cache: for the rows a task computes next, so their first lines are not waited for. A hint
/// only (nothing on other architectures, or with `CAPY_CPU_PREFETCH_BYTES=0`).
pub fn prefetch_start(rows: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    x86::prefetch_start(rows);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = rows;
}

/// The fast path's reference: integer group sums of the weights' integer values times the
/// int8 activations, then `Σ (weight scale · activation scale) · group sum` in f32.
pub fn fast_dot_scalar(spec: &ActSpec, row: &[u8], act: &Act<'_>) -> f32 {
    let q = |i: usize| act.q[spec.slot(i)] as i32;
    let mut acc = 0f32;
    match spec.fmt {
        RowFormat::Nvfp4 => {
            for (b, blk) in row.chunks_exact(36).enumerate() {
                for g in 0..4 {
                    let mut isum = 0i32;
                    for i in 0..8 {
                        let byte = blk[4 + 8 * g + i];
                        let w = 64 * b + 16 * g + 2 * i;
                        isum += E2M1_DOUBLED[(byte & 15) as usize] as i32 * q(w);
                        isum += E2M1_DOUBLED[(byte >> 4) as usize] as i32 * q(w + 1);
                    }
                    let sc = E4M3_TO_F32[blk[g] as usize] * 0.5 * act.s[b];
                    acc = sc.mul_add(isum as f32, acc);
                }
            }
        }
        RowFormat::Ggml(GgmlType::Iq3S) => {
            for (b, blk) in row.chunks_exact(110).enumerate() {
                let d = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
                for sub in 0..8 {
                    let s = (blk[106 + sub / 2] >> (4 * (sub % 2))) & 0x0f;
                    let db = d * (1 + 2 * s as u32) as f32;
                    let mut isum = 0i32;
                    for e in 0..8 {
                        let i = 8 * sub + e;
                        let index =
                            blk[2 + i] as usize | ((((blk[66 + sub] >> e) & 1) as usize) << 8);
                        let grid = IQ3S_GRID[index].to_le_bytes();
                        for (j, &m) in grid.iter().enumerate() {
                            let w = 4 * i + j;
                            let neg = (blk[74 + w / 8] >> (w % 8)) & 1 != 0;
                            let v = if neg { -(m as i32) } else { m as i32 };
                            isum += v * q(256 * b + w);
                        }
                    }
                    acc = (db * act.s[8 * b + sub]).mul_add(isum as f32, acc);
                }
            }
        }
        RowFormat::Ggml(GgmlType::Q2_0) => {
            for (b, blk) in row.chunks_exact(18).enumerate() {
                let d = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
                let mut isum = 0i32;
                for (bi, &byte) in blk[2..18].iter().enumerate() {
                    for j in 0..4 {
                        isum += ((byte >> (2 * j)) & 3) as i32 * q(64 * b + 4 * bi + j);
                    }
                }
                let sc = d * act.s[b];
                acc = sc.mul_add(isum as f32 - act.sums[b], acc);
            }
        }
        other => panic!("no fast kernel for {}", other.name()),
    }
    acc
}

/// E4M3 bytes in the low byte of each i32 lane to f32 values times `mult` (exact for every
/// finite code; the NaN codes 0x7f/0xff read as ±480, which a valid checkpoint never holds).
const E4M3_BIAS_MULT: f32 = 1.329_228e36; // 2^120

/// Same as the vector conversion, for tests.
pub fn e4m3_by_bits(b: u8) -> f32 {
    let bits = ((b as u32 & 0x7f) << 20) | ((b as u32 & 0x80) << 24);
    f32::from_bits(bits) * E4M3_BIAS_MULT
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::quant::nvfp4::E2M1_TO_F32;
    use std::arch::x86_64::*;

    /// [`super::quantize_blocks`] eight values at a time. The scalar version spent 12 µs on a
    /// 2560-value token on the dev VM (a libm `roundf` call per value), on the path of every
    /// decode call before any worker starts. Same bytes: the block maximum is the same
    /// maximum, the products are the same IEEE products, and `round` (half away from zero) is
    /// formed exactly as `trunc(y + copysign(0.5 − 2⁻²⁵, y))`. Blocks whose length is not a
    /// multiple of 8 (a row's tail) go to the scalar code.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_blocks_avx2(
        spec: &ActSpec,
        x: &[f32],
        q: &mut [i8],
        s: &mut [f32],
        sums: &mut [f32],
    ) {
        let qb = spec.qblock();
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let sign_mask = _mm256_set1_ps(-0.0);
        let below_half = _mm256_set1_ps(0.499_999_97);
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let mut bytes = [0i8; 64];
        for (b, xb) in x.chunks(qb).enumerate() {
            let at = b * qb;
            let layout = spec.quant_block_layout(at);
            if xb.len() % 8 != 0 || xb.len() > bytes.len() || layout.is_none() {
                super::quantize_one_block(spec, at, xb, q, &mut s[b], &mut sums[b]);
                continue;
            }
            let (start, ways, stride) = layout.unwrap_or_default();
            let natural = ways == 1;
            let mut m = _mm256_setzero_ps();
            for c in xb.chunks_exact(8) {
                // `maxps` returns its second operand where either is NaN: NaNs are skipped,
                // as `f32::max` skips them in the scalar fold.
                m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(c.as_ptr()), abs_mask), m);
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let idv = _mm256_set1_ps(id);
            let mut sum = _mm256_setzero_si256();
            let dst = if natural {
                q[start..start + xb.len()].as_mut_ptr()
            } else {
                bytes.as_mut_ptr()
            };
            for (c, chunk) in xb.chunks_exact(8).enumerate() {
                let y = _mm256_mul_ps(_mm256_loadu_ps(chunk.as_ptr()), idv);
                let biased =
                    _mm256_add_ps(y, _mm256_or_ps(_mm256_and_ps(y, sign_mask), below_half));
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(biased);
                // NaN (an infinite x times a zero inverse scale) becomes 0, as `NaN as i8` does.
                let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
                let i = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
                sum = _mm256_add_epi32(sum, i);
                // i32 → i8 without saturation effects (|i| ≤ 127): lanes 0–3 and 4–7 land
                // in the low dword of each 128-bit half.
                let p = _mm256_packs_epi16(_mm256_packs_epi32(i, i), _mm256_setzero_si256());
                let lo4 = _mm_cvtsi128_si32(_mm256_castsi256_si128(p));
                let hi4 = _mm_cvtsi128_si32(_mm256_extracti128_si256::<1>(p));
                (dst.add(8 * c) as *mut i32).write_unaligned(lo4);
                (dst.add(8 * c + 4) as *mut i32).write_unaligned(hi4);
            }
            if !natural {
                for (j, &v) in bytes[..xb.len()].iter().enumerate() {
                    q[start + stride * (j % ways) + j / ways] = v;
                }
            }
            let s4 = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256::<1>(sum),
            );
            let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32::<1>(s2));
            s[b] = d;
            sums[b] = _mm_cvtsi128_si32(s1) as f32;
        }
    }

    #[derive(Clone, Copy)]
    pub(super) struct P {
        f: *const f32,
        q: *const i8,
        s: *const f32,
        sums: *const f32,
    }

    fn ptrs(a: &Act<'_>) -> P {
        P {
            f: a.f.as_ptr(),
            q: a.q.as_ptr(),
            s: a.s.as_ptr(),
            sums: a.sums.as_ptr(),
        }
    }

    /// How far ahead of the current row the weights are prefetched (bytes; 4096 unless
    /// `CAPY_CPU_PREFETCH_BYTES` says otherwise, for tuning on a new machine; 0 turns it off).
    fn prefetch_bytes() -> usize {
        static V: OnceLock<usize> = OnceLock::new();
        *V.get_or_init(|| {
            std::env::var("CAPY_CPU_PREFETCH_BYTES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(4096)
        })
    }

    /// Prefetches the first `prefetch_bytes()` of `rows` (see [`super::prefetch_start`]).
    pub(super) fn prefetch_start(rows: &[u8]) {
        let end = rows.len().min(prefetch_bytes());
        for at in (0..end).step_by(64) {
            // SAFETY: a prefetch is a hint; `at` lies within `rows`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(rows.as_ptr().add(at) as *const i8) };
        }
    }

    /// Software prefetch of a call's rows, `ahead` bytes in front of the row being computed:
    /// a call's rows are contiguous, but each task starts at a new place of a large expert
    /// set and the hardware streamer restarts at every 4 KiB page, so without it the kernels
    /// wait on memory (seen on the dev VM: loads of the block headers were the hot spots).
    pub(super) struct Prefetch {
        next: usize,
        ahead: usize,
        end: usize,
    }

    impl Prefetch {
        fn new(rows: &[u8], row_bytes: usize) -> Prefetch {
            let ahead = row_bytes * prefetch_bytes().div_ceil(row_bytes);
            let start = rows.as_ptr() as usize;
            let mut pf = Prefetch {
                next: start,
                ahead,
                end: rows.as_ptr_range().end as usize,
            };
            pf.up_to(start);
            pf
        }

        /// Prefetches up to `ahead` bytes past `done` (the end of the row about to be
        /// computed), where not already done.
        #[inline(always)]
        fn up_to(&mut self, done: usize) {
            let to = (done + self.ahead).min(self.end);
            while self.next < to {
                // SAFETY: a prefetch is a hint; `next` lies within the call's rows.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(self.next as *const i8) };
                self.next += 64;
            }
        }
    }

    /// A kernel over a run of consecutive rows: `out[r · out_stride + t] = row_r · a[t]` for
    /// `nrows` rows `row_bytes` apart from `rows`.
    type RowRun<const N: usize> = unsafe fn(
        rows: *const u8,
        nrows: usize,
        row_bytes: usize,
        k: usize,
        a: [P; N],
        out: *mut f32,
        out_stride: usize,
        pf: &mut Prefetch,
    );

    /// Defines `$name`, the [`RowRun`] of the one-row kernel `$kernel` (`$extra`: its const
    /// arguments after `N`), compiled with the kernel's target features so the kernel is
    /// inlined into the row loop: the dispatch and the call happen once per run instead of
    /// once per row (about 3–4 ns a row before), and the compiler may hoist the kernel's
    /// constant setup out of the loop. The kernels' arithmetic is unchanged, so are the bits.
    macro_rules! row_run {
        ($name:ident, $features:literal, $kernel:ident $(, $extra:expr)*) => {
            // The arguments stay separate: they travel in registers to the row loop.
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $features)]
            unsafe fn $name<const N: usize>(
                rows: *const u8,
                nrows: usize,
                row_bytes: usize,
                k: usize,
                a: [P; N],
                out: *mut f32,
                out_stride: usize,
                pf: &mut Prefetch,
            ) {
                for r in 0..nrows {
                    let row = rows.add(r * row_bytes);
                    pf.up_to(row as usize + row_bytes);
                    let v = $kernel::<N $(, $extra)*>(row, k, a);
                    std::ptr::copy_nonoverlapping(v.as_ptr(), out.add(r * out_stride), N);
                }
            }
        };
    }

    row_run!(nvfp4_exact_avx2_rows, "avx2,fma,f16c", nvfp4_exact_avx2);
    row_run!(nvfp4_fast_avx2_rows, "avx2,fma,f16c", nvfp4_fast_avx2);
    row_run!(iq3s_exact_avx2_rows, "avx2,fma,f16c", iq3s_exact_avx2);
    row_run!(
        iq3s_exact_avx2_gather_rows,
        "avx2,fma,f16c",
        iq3s_exact_avx2_gather
    );
    row_run!(iq3s_fast_avx2_rows, "avx2,fma,f16c", iq3s_fast_avx2, false);
    row_run!(
        iq3s_fast_avx2_gather_rows,
        "avx2,fma,f16c",
        iq3s_fast_avx2,
        true
    );
    row_run!(q2_0_exact_avx2_rows, "avx2,fma,f16c", q2_0_exact_avx2);
    row_run!(q2_0_fast_avx2_rows, "avx2,fma,f16c", q2_0_fast_avx2);
    row_run!(
        nvfp4_exact_avx512_rows,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
        nvfp4_exact_avx512
    );
    row_run!(
        iq3s_exact_avx512_rows,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
        iq3s_exact_avx512,
        false
    );
    row_run!(
        iq3s_exact_avx512_gather_rows,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
        iq3s_exact_avx512,
        true
    );
    row_run!(
        q2_0_exact_avx512_rows,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
        q2_0_exact_avx512
    );
    row_run!(
        nvfp4_fast_avx512_rows,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        nvfp4_fast_avx512
    );
    row_run!(
        iq3s_fast_avx512_rows,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        iq3s_fast_avx512,
        false
    );
    row_run!(
        iq3s_fast_avx512_gather_rows,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        iq3s_fast_avx512,
        true
    );
    row_run!(
        q2_0_fast_avx512_rows,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        q2_0_fast_avx512
    );
    row_run!(
        iq3s_exact_vbmi_rows,
        "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bitalg,avx2,fma,f16c",
        iq3s_exact_vbmi
    );
    row_run!(
        iq3s_fast_vbmi_rows,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bitalg,avx2,fma,f16c",
        iq3s_fast_vbmi
    );

    /// The row-run kernel of `spec` for `N` activations (chosen once per call).
    fn row_run<const N: usize>(spec: &ActSpec, vnni: bool) -> RowRun<N> {
        match (spec.isa, spec.kind, spec.fmt) {
            (Isa::Avx512, Kind::Exact, NVFP4) => nvfp4_exact_avx512_rows::<N>,
            (Isa::Avx512, Kind::Exact, IQ3S) if spec.iq3s_shuffle => iq3s_exact_vbmi_rows::<N>,
            (Isa::Avx512, Kind::Exact, IQ3S) if spec.iq3s_gather => {
                iq3s_exact_avx512_gather_rows::<N>
            }
            (Isa::Avx512, Kind::Exact, IQ3S) => iq3s_exact_avx512_rows::<N>,
            (Isa::Avx512, Kind::Exact, Q2_0) => q2_0_exact_avx512_rows::<N>,
            (Isa::Avx512, Kind::Fast, NVFP4) if vnni => nvfp4_fast_avx512_rows::<N>,
            (Isa::Avx512, Kind::Fast, IQ3S) if spec.iq3s_shuffle => iq3s_fast_vbmi_rows::<N>,
            (Isa::Avx512, Kind::Fast, IQ3S) if vnni && spec.iq3s_gather => {
                iq3s_fast_avx512_gather_rows::<N>
            }
            (Isa::Avx512, Kind::Fast, IQ3S) if vnni => iq3s_fast_avx512_rows::<N>,
            (Isa::Avx512, Kind::Fast, Q2_0) if vnni => q2_0_fast_avx512_rows::<N>,
            (_, Kind::Exact, NVFP4) => nvfp4_exact_avx2_rows::<N>,
            (_, Kind::Exact, IQ3S) if spec.iq3s_gather => iq3s_exact_avx2_gather_rows::<N>,
            (_, Kind::Exact, IQ3S) => iq3s_exact_avx2_rows::<N>,
            (_, Kind::Exact, Q2_0) => q2_0_exact_avx2_rows::<N>,
            (_, Kind::Fast, NVFP4) => nvfp4_fast_avx2_rows::<N>,
            (_, Kind::Fast, IQ3S) if spec.iq3s_gather => iq3s_fast_avx2_gather_rows::<N>,
            (_, Kind::Fast, IQ3S) => iq3s_fast_avx2_rows::<N>,
            (_, Kind::Fast, Q2_0) => q2_0_fast_avx2_rows::<N>,
            _ => unreachable!("no fused kernel for {:?}", spec),
        }
    }

    /// Dispatch over ISA and kind, once per call; activations in chunks of 4, 2, 1. One,
    /// two or four activations (a decode step's tokens of an expert) run every row in one
    /// row-run call; other counts go row by row, each row's chunks while it is in cache.
    pub(super) unsafe fn dots(
        spec: &ActSpec,
        rows: &[u8],
        row_bytes: usize,
        acts: &[Act<'_>],
        out: &mut [f32],
    ) {
        let (na, k) = (acts.len(), spec.k);
        let nrows = rows.len() / row_bytes;
        let vnni = has_vnni();
        let mut pf = Prefetch::new(rows, row_bytes);
        let (r0, o) = (rows.as_ptr(), out.as_mut_ptr());
        match na {
            1 => row_run::<1>(spec, vnni)(r0, nrows, row_bytes, k, [ptrs(&acts[0])], o, 1, &mut pf),
            2 => row_run::<2>(spec, vnni)(
                r0,
                nrows,
                row_bytes,
                k,
                [ptrs(&acts[0]), ptrs(&acts[1])],
                o,
                2,
                &mut pf,
            ),
            4 => row_run::<4>(spec, vnni)(
                r0,
                nrows,
                row_bytes,
                k,
                std::array::from_fn(|t| ptrs(&acts[t])),
                o,
                4,
                &mut pf,
            ),
            _ => {
                let (run1, run2, run4) = (
                    row_run::<1>(spec, vnni),
                    row_run::<2>(spec, vnni),
                    row_run::<4>(spec, vnni),
                );
                for r in 0..nrows {
                    let row = r0.add(r * row_bytes);
                    let mut a0 = 0;
                    while a0 < na {
                        let o = o.add(r * na + a0);
                        let ap = &acts[a0..];
                        a0 += match na - a0 {
                            1 => {
                                run1(row, 1, row_bytes, k, [ptrs(&ap[0])], o, na, &mut pf);
                                1
                            }
                            2 | 3 => {
                                let a = [ptrs(&ap[0]), ptrs(&ap[1])];
                                run2(row, 1, row_bytes, k, a, o, na, &mut pf);
                                2
                            }
                            _ => {
                                let a = std::array::from_fn(|t| ptrs(&ap[t]));
                                run4(row, 1, row_bytes, k, a, o, na, &mut pf);
                                4
                            }
                        };
                    }
                }
            }
        }
    }

    /// The f16 at `p` (a block's scale; the block has at least 4 bytes), converted with F16C
    /// directly: `half` checks the CPU on each call. Written as assembly because LLVM turns
    /// any load feeding `vcvtph2ps` into a `vpinsrw` merging into a free register, often an
    /// accumulator, which chains every block to the previous block's FMA (the Q2_0 fast
    /// kernel ran 20% slower that way); `vmovd` writes the whole register.
    #[inline]
    #[target_feature(enable = "f16c")]
    unsafe fn f16(p: *const u8) -> f32 {
        let v: __m128;
        std::arch::asm!(
            "vmovd {v}, dword ptr [{p}]",
            "vcvtph2ps {v}, {v}",
            p = in(reg) p,
            v = out(xmm_reg) v,
            options(pure, readonly, nostack, preserves_flags),
        );
        _mm_cvtss_f32(v)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }

    /// i32 lanes holding E4M3 bytes (low byte) → f32 × 2^120 × `mult`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn e4m3_lanes_avx2(b: __m256i, mult: f32) -> __m256 {
        let bits = _mm256_or_si256(
            _mm256_slli_epi32::<20>(_mm256_and_si256(b, _mm256_set1_epi32(0x7f))),
            _mm256_slli_epi32::<24>(_mm256_and_si256(b, _mm256_set1_epi32(0x80))),
        );
        _mm256_mul_ps(
            _mm256_castsi256_ps(bits),
            _mm256_set1_ps(E4M3_BIAS_MULT * mult),
        )
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn e4m3_lanes_avx512(b: __m512i, mult: f32) -> __m512 {
        let bits = _mm512_or_si512(
            _mm512_slli_epi32::<20>(_mm512_and_si512(b, _mm512_set1_epi32(0x7f))),
            _mm512_slli_epi32::<24>(_mm512_and_si512(b, _mm512_set1_epi32(0x80))),
        );
        _mm512_mul_ps(
            _mm512_castsi512_ps(bits),
            _mm512_set1_ps(E4M3_BIAS_MULT * mult),
        )
    }

    /// 32 sign bits → byte mask (0xff where the bit is set).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn sign_bytes_avx2(bits: u32) -> __m256i {
        let v = _mm256_set1_epi32(bits as i32);
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        let bytes = _mm256_shuffle_epi8(v, spread);
        let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit)
    }

    /// The 9-bit grid indices of IQ3_S sub-block `sub` (8 entries).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn iq3s_idx_avx2(p: *const u8, sub: usize) -> __m256i {
        let low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(2 + 8 * sub) as *const __m128i));
        let high = _mm256_and_si256(
            _mm256_srlv_epi32(
                _mm256_set1_epi32(*p.add(66 + sub) as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            ),
            _mm256_set1_epi32(1),
        );
        _mm256_or_si256(low, _mm256_slli_epi32::<8>(high))
    }

    /// The 8 grid entries (4 magnitude bytes each) of IQ3_S sub-block `sub`: one `vpgatherdd`
    /// (`GATHER`) or eight scalar loads into a vector.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn iq3s_mags_avx2<const GATHER: bool>(p: *const u8, sub: usize) -> __m256i {
        if GATHER {
            return _mm256_i32gather_epi32::<4>(
                IQ3S_GRID.as_ptr() as *const i32,
                iq3s_idx_avx2(p, sub),
            );
        }
        let qs = p.add(2 + 8 * sub);
        let qh = *p.add(66 + sub) as usize;
        let g = |j: usize| {
            *IQ3S_GRID.get_unchecked(*qs.add(j) as usize | (((qh >> j) & 1) << 8)) as i32
        };
        _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7))
    }

    /// Offsets `index << SHIFT` of the 64 grid entries of an IQ3_S block (index: the 9-bit
    /// `qs | qh bit << 8`) as u16, formed in four vectors and read back through memory by the
    /// scalar grid loads. Per sub-block that is half the vector work of forming its 8 offsets
    /// alone (assembling each index in scalar code cost about six ops per entry, which made
    /// the index arithmetic, not the loads, the bottleneck of the scalar-load kernels).
    struct BlockOffsets([u16; 64]);

    impl BlockOffsets {
        /// Forms the offsets of the block at `p`.
        #[inline(always)]
        unsafe fn fill<const SHIFT: i32>(&mut self, p: *const u8) {
            // Lane l of a vector of 16 entries tests bit l of their two qh bytes.
            let bit = _mm256_setr_epi16(
                1,
                2,
                4,
                8,
                16,
                32,
                64,
                128,
                256,
                512,
                1024,
                2048,
                4096,
                8192,
                16384,
                i16::MIN,
            );
            let high = _mm256_set1_epi16(0x100 << SHIFT);
            for i in 0..4 {
                let low =
                    _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(2 + 16 * i) as *const __m128i));
                let qh = _mm256_set1_epi16((p.add(66 + 2 * i) as *const i16).read_unaligned());
                let set = _mm256_cmpeq_epi16(_mm256_and_si256(qh, bit), bit);
                _mm256_storeu_si256(
                    self.0.as_mut_ptr().add(16 * i) as *mut __m256i,
                    _mm256_or_si256(_mm256_slli_epi16::<SHIFT>(low), _mm256_and_si256(set, high)),
                );
            }
        }

        /// Entry `e`'s offset: a volatile load, because LLVM otherwise replaces the store and
        /// loads with `vpextrw` (two ops each, on the vector ports the kernels need).
        #[inline(always)]
        fn get(&self, e: usize) -> usize {
            // SAFETY: `e < 64` at every call site, within the array.
            unsafe { std::ptr::read_volatile(self.0.as_ptr().add(e)) as usize }
        }
    }

    /// The [`BlockOffsets`] of a row's IQ3_S blocks, formed one block ahead: block `b + 1`'s
    /// are stored while block `b` is computed, so the loads that read them back do not wait
    /// for the stores to forward (on the path of every block otherwise: 1.14x on the dev VM).
    struct OffsetsAhead<const SHIFT: i32> {
        bufs: [BlockOffsets; 2],
        row: *const u8,
        blocks: usize,
    }

    impl<const SHIFT: i32> OffsetsAhead<SHIFT> {
        #[inline(always)]
        unsafe fn new(row: *const u8, blocks: usize) -> Self {
            let mut ahead = OffsetsAhead {
                bufs: [BlockOffsets([0u16; 64]), BlockOffsets([0u16; 64])],
                row,
                blocks,
            };
            if blocks > 0 {
                ahead.bufs[0].fill::<SHIFT>(row);
            }
            ahead
        }

        /// The offsets of block `b` (blocks taken in order); forms block `b + 1`'s.
        #[inline(always)]
        unsafe fn block(&mut self, b: usize) -> &BlockOffsets {
            if b + 1 < self.blocks {
                self.bufs[(b + 1) % 2].fill::<SHIFT>(self.row.add(110 * (b + 1)));
            }
            &self.bufs[b % 2]
        }
    }

    /// The 8 grid entries (4 magnitude bytes each) of sub-block `sub` from the block's offsets
    /// (`SHIFT` 0: the offsets are indices of the u32 grid).
    #[inline(always)]
    unsafe fn iq3s_entries_avx2(off: &BlockOffsets, sub: usize) -> __m256i {
        let g = |j: usize| *IQ3S_GRID.get_unchecked(off.get(8 * sub + j)) as i32;
        _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7))
    }

    /// `v` stored for [`broadcast_lane`]: a sub-block's scale is then broadcast by a load
    /// instead of a lane permute (port 5, which the grid assembly needs).
    #[derive(Clone, Copy)]
    struct Lanes([f32; 8]);

    impl Lanes {
        #[inline(always)]
        unsafe fn new(v: __m256) -> Lanes {
            let mut l = Lanes([0f32; 8]);
            _mm256_storeu_ps(l.0.as_mut_ptr(), v);
            l
        }

        /// Lane `i` in every lane (volatile: LLVM otherwise permutes the register it keeps).
        #[inline(always)]
        unsafe fn broadcast(&self, i: usize) -> __m256 {
            _mm256_set1_ps(std::ptr::read_volatile(self.0.as_ptr().add(i)))
        }
    }

    /// The IQ3_S grid as f32 magnitudes, four per entry: one 16-byte load yields an entry's
    /// four weights ready for the FMA, with no sign extension or int-to-float conversion.
    #[repr(C, align(64))]
    struct GridF32([[f32; 4]; 512]);

    static IQ3S_GRID_F32: GridF32 = {
        let mut t = [[0f32; 4]; 512];
        let mut e = 0;
        while e < 512 {
            let mut j = 0;
            while j < 4 {
                t[e][j] = ((IQ3S_GRID[e] >> (8 * j)) as u8) as f32;
                j += 1;
            }
            e += 1;
        }
        GridF32(t)
    };

    /// The 16 grid entries of IQ3_S sub-blocks `2·pair` and `2·pair + 1`: one 16-lane gather
    /// (`GATHER`) or two vectors of scalar loads.
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    unsafe fn iq3s_mags_pair_avx512<const GATHER: bool>(p: *const u8, pair: usize) -> __m512i {
        if GATHER {
            let low = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(2 + 16 * pair) as *const __m128i));
            let qh = (p.add(66 + 2 * pair) as *const u16).read_unaligned();
            let idx = _mm512_or_si512(low, _mm512_maskz_mov_epi32(qh, _mm512_set1_epi32(256)));
            return _mm512_i32gather_epi32::<4>(idx, IQ3S_GRID.as_ptr() as *const i32);
        }
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(iq3s_mags_avx2::<false>(p, 2 * pair)),
            iq3s_mags_avx2::<false>(p, 2 * pair + 1),
        )
    }

    /// `d · (1 + 2·s)` for the 8 sub-blocks of an IQ3_S block (lane = sub-block), the same
    /// products as [`iq3s_db`].
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn iq3s_db_lanes_avx2(p: *const u8, d: f32) -> __m256 {
        let nibbles = _mm256_set1_epi32((p.add(106) as *const u32).read_unaligned() as i32);
        let s = _mm256_and_si256(
            _mm256_srlv_epi32(nibbles, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
            _mm256_set1_epi32(15),
        );
        let odd = _mm256_add_epi32(_mm256_slli_epi32::<1>(s), _mm256_set1_epi32(1));
        _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(odd))
    }

    #[inline]
    unsafe fn iq3s_db(p: *const u8, d: f32, sub: usize) -> f32 {
        let s = (*p.add(106 + sub / 2) >> (4 * (sub % 2))) & 0x0f;
        d * (1 + 2 * s as u32) as f32
    }

    // ---- NVFP4 --------------------------------------------------------------------------

    /// The two high bytes of the f32 of each E2M1 code (`[0]`: bits 24–31, `[1]`: bits
    /// 16–23; code bit 3 is the sign, code 8 is −0 as in the scalar reference): every E2M1
    /// value is a bfloat16, so its f32's low 16 bits are zero.
    const E2M1_F32_HIGH_BYTES: [[u8; 16]; 2] = {
        let mut t = [[0u8; 16]; 2];
        let mut c = 0;
        while c < 16 {
            let bits = E2M1_TO_F32[c].to_bits();
            assert!(bits & 0xffff == 0, "E2M1 values are bfloat16s");
            t[0][c] = (bits >> 24) as u8;
            t[1][c] = (bits >> 16) as u8;
            c += 1;
        }
        t
    };

    /// The group scales of one NVFP4 block for [`nvfp4_exact_avx2`]: lanes 0–3 of the first
    /// vector take group 0's, lanes 4–7 group 2's; the second vector groups 1 and 3. Each
    /// scale byte is shifted to the top of its lane, then [`e4m3_by_bits`] in vector form.
    #[inline(always)]
    unsafe fn nvfp4_scale_pairs_avx2(dword: i32) -> [__m256; 2] {
        let dw = _mm256_set1_epi32(dword);
        let convert = |top: __m256i| {
            let bits = _mm256_and_si256(
                _mm256_srai_epi32::<4>(top),
                _mm256_set1_epi32(0x87f0_0000u32 as i32),
            );
            _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(E4M3_BIAS_MULT))
        };
        [
            convert(_mm256_sllv_epi32(
                dw,
                _mm256_setr_epi32(24, 24, 24, 24, 8, 8, 8, 8),
            )),
            convert(_mm256_sllv_epi32(
                dw,
                _mm256_setr_epi32(16, 16, 16, 16, 0, 0, 0, 0),
            )),
        ]
    }

    /// Exact NVFP4 on AVX2, one block per step. Every E2M1 value's f32 is its bfloat16 with
    /// 16 zero bits below, so the weights are built by byte shuffles (which run on two ports,
    /// where `vpermps` has one): `vpshufb` looks the two high bytes of each code's f32 up in
    /// 16-entry tables, two `vpunpck*bw` pair them into 16-bit words and four `vpunpck*wd`
    /// with zero place the words at the top of f32 lanes. Per 64 weights that is 3 ops to
    /// split the nibbles, 4 lookups and 12 unpacks, against 7 shifts, 8 permutes and 16 sign
    /// ops before (the sign is in the table). The unpacks work within 128-bit lanes, so a
    /// vector holds 4 weights of the block's first half (lanes 0–3) and 4 of its second (4–7):
    /// products are summed per lane (8 weights of one group) before the group scales. The
    /// activations are laid out to match ([`ActSpec::slot`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nvfp4_exact_avx2<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        let table = |i: usize| {
            _mm256_broadcastsi128_si256(_mm_loadu_si128(
                E2M1_F32_HIGH_BYTES[i].as_ptr() as *const __m128i
            ))
        };
        let (byte3, byte2) = (table(0), table(1));
        let low = _mm256_set1_epi8(0x0f);
        let zero = _mm256_setzero_si256();
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..k / 64 {
            let blk = row.add(36 * b);
            let v = _mm256_loadu_si256(blk.add(4) as *const __m256i);
            let codes = [
                _mm256_and_si256(v, low),
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), low),
            ];
            // w[4h + r]: nibble h (element 2i + h of byte i) of bytes 4r..4r+4 (lanes 0–3)
            // and 16 + 4r..16 + 4r + 4 (lanes 4–7).
            let mut w = [_mm256_setzero_ps(); 8];
            for (h, c) in codes.iter().enumerate() {
                let (hi, lo) = (
                    _mm256_shuffle_epi8(byte3, *c),
                    _mm256_shuffle_epi8(byte2, *c),
                );
                let (first, second) = (_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi));
                w[4 * h] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, first));
                w[4 * h + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, first));
                w[4 * h + 2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, second));
                w[4 * h + 3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, second));
            }
            // Vectors r = 0, 1 hold groups 0 and 2; r = 2, 3 groups 1 and 3.
            let scales = nvfp4_scale_pairs_avx2((blk as *const i32).read_unaligned());
            for t in 0..N {
                let xp = a[t].f.add(64 * b);
                let x = |i: usize| _mm256_loadu_ps(xp.add(8 * i));
                for (half, [r0, r1]) in [[0, 1], [2, 3]].into_iter().enumerate() {
                    let mut v = _mm256_mul_ps(w[r0], x(r0));
                    v = _mm256_fmadd_ps(w[r1], x(r1), v);
                    v = _mm256_fmadd_ps(w[4 + r0], x(4 + r0), v);
                    v = _mm256_fmadd_ps(w[4 + r1], x(4 + r1), v);
                    acc[t][half] = _mm256_fmadd_ps(v, scales[half], acc[t][half]);
                }
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = hsum256(_mm256_add_ps(acc[t][0], acc[t][1]));
        }
        out
    }

    /// E4M3 scale bytes to f32, lane `l` converting byte `(l / 2) % 4` of its dword (the
    /// scale of the lane's group): the byte is shifted to the top of the lane, then
    /// [`e4m3_by_bits`] in vector form (arithmetic shift, mask, × 2^120). No table loads.
    #[inline(always)]
    unsafe fn nvfp4_scales_avx512(dwords: __m512i) -> __m512 {
        let top = _mm512_sllv_epi32(
            dwords,
            _mm512_setr_epi32(24, 24, 16, 16, 8, 8, 0, 0, 24, 24, 16, 16, 8, 8, 0, 0),
        );
        let bits = _mm512_and_si512(
            _mm512_srai_epi32::<4>(top),
            _mm512_set1_epi32(0x87f0_0000u32 as i32),
        );
        _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(E4M3_BIAS_MULT))
    }

    /// Exact NVFP4 on AVX-512, two blocks per step. The 64 code bytes are read as 16 u32 lanes
    /// (lanes 8–15 the second block); shifting them by `4s` puts nibble `s` of every lane in
    /// the four index bits `vpermps` reads, so one shift and one permute yield 16 weights with
    /// no byte-to-lane widening. A lane's 8 weights share a 16-weight group, so its 8 products
    /// are summed before one multiply by the group scale (per 128 weights: 7 shifts,
    /// 8 permutes, 8 multiply-adds, the scale vector, one scale FMA per activation; the earlier
    /// kernel needed a widening, a shift, two permutes, a blend and three arithmetic ops per 32).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn nvfp4_exact_avx512<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        let table = _mm512_setr_ps(
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        );
        // The weights of nibble `s` of every lane.
        let w = |codes: __m512i| -> [__m512; 8] {
            [
                _mm512_permutexvar_ps(codes, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(codes), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(codes), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<12>(codes), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<16>(codes), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<20>(codes), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<24>(codes), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<28>(codes), table),
            ]
        };
        // Σ_s w[s] · x[16s..16s+16], in two chains.
        let dot8 = |w: &[__m512; 8], xp: *const f32| -> __m512 {
            let mut v0 = _mm512_mul_ps(w[0], _mm512_loadu_ps(xp));
            let mut v1 = _mm512_mul_ps(w[1], _mm512_loadu_ps(xp.add(16)));
            for s in (2..8).step_by(2) {
                v0 = _mm512_fmadd_ps(w[s], _mm512_loadu_ps(xp.add(16 * s)), v0);
                v1 = _mm512_fmadd_ps(w[s + 1], _mm512_loadu_ps(xp.add(16 * s + 16)), v1);
            }
            _mm512_add_ps(v0, v1)
        };
        // Scale dword 0 for lanes 0–7, dword 9 (the second block's, at byte 36) for 8–15.
        let sidx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9);
        let mut acc = [_mm512_setzero_ps(); N];
        for pb in 0..k / 128 {
            let b0 = row.add(72 * pb);
            let codes = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(b0.add(4) as *const __m256i)),
                _mm256_loadu_si256(b0.add(40) as *const __m256i),
            );
            // 64 bytes from b0 stay within the two blocks (72 bytes).
            let sv = nvfp4_scales_avx512(_mm512_permutexvar_epi32(
                sidx,
                _mm512_loadu_si512(b0 as *const _),
            ));
            let w = w(codes);
            for t in 0..N {
                let v = dot8(&w, a[t].f.add(128 * pb));
                acc[t] = _mm512_fmadd_ps(v, sv, acc[t]);
            }
        }
        if !k.is_multiple_of(128) {
            // An odd last block: lanes 0–7 only (the upper lanes' weights are zero: code 0).
            let pb = k / 128;
            let blk = row.add(72 * pb);
            let codes = _mm512_zextsi256_si512(_mm256_loadu_si256(blk.add(4) as *const __m256i));
            let sv = nvfp4_scales_avx512(_mm512_set1_epi32((blk as *const i32).read_unaligned()));
            let w = w(codes);
            for t in 0..N {
                let xp = a[t].f.add(128 * pb);
                let mut v = _mm512_setzero_ps();
                for (s, ws) in w.iter().enumerate() {
                    let x = _mm512_maskz_loadu_ps(0x00ff, xp.add(8 * s));
                    v = _mm512_fmadd_ps(*ws, x, v);
                }
                acc[t] = _mm512_fmadd_ps(v, sv, acc[t]);
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]);
        }
        out
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nvfp4_fast_avx2<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        let tbl =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(E2M1_DOUBLED.as_ptr() as *const __m128i));
        let m0f = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        // i32 lane l ← scale byte l / 2 (the u32 of four scales sits in bytes 0..4 of each
        // 128-bit lane after the broadcast).
        let sel = _mm256_setr_epi8(
            0, -1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 2, -1, -1,
            -1, 3, -1, -1, -1, 3, -1, -1, -1,
        );
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..k / 64 {
            let blk = row.add(36 * b);
            let v = _mm256_loadu_si256(blk.add(4) as *const __m256i);
            let lo = _mm256_and_si256(v, m0f);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m0f);
            let wlo = _mm256_shuffle_epi8(tbl, lo);
            let whi = _mm256_shuffle_epi8(tbl, hi);
            let alo = _mm256_abs_epi8(wlo);
            let ahi = _mm256_abs_epi8(whi);
            let sb =
                _mm256_shuffle_epi8(_mm256_set1_epi32((blk as *const i32).read_unaligned()), sel);
            let wsc = e4m3_lanes_avx2(sb, 0.5);
            let off = 128 * (b / 2) + 32 * (b % 2);
            for t in 0..N {
                let xe = _mm256_loadu_si256(a[t].q.add(off) as *const __m256i);
                let xo = _mm256_loadu_si256(a[t].q.add(off + 64) as *const __m256i);
                let pe = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(xe, wlo));
                let po = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(xo, whi));
                let i = _mm256_madd_epi16(_mm256_add_epi16(pe, po), ones);
                let sc = _mm256_mul_ps(wsc, _mm256_set1_ps(*a[t].s.add(b)));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), sc, acc[t]);
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = hsum256(acc[t]);
        }
        out
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn nvfp4_fast_avx512<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        const MAG: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12];
        let mag = _mm512_broadcast_i32x4(_mm_loadu_si128(MAG.as_ptr() as *const __m128i));
        let m0f = _mm512_set1_epi8(0x0f);
        let eight = _mm512_set1_epi8(8);
        let zero = _mm512_setzero_si512();
        // i32 lane l ← scale byte (l / 8) · 4 + (l % 8) / 2 of the broadcast u64 (two blocks'
        // four scales), upper bytes zero.
        let sel = _mm512_setr_epi32(
            0x8080_8000u32 as i32,
            0x8080_8000u32 as i32,
            0x8080_8001u32 as i32,
            0x8080_8001u32 as i32,
            0x8080_8002u32 as i32,
            0x8080_8002u32 as i32,
            0x8080_8003u32 as i32,
            0x8080_8003u32 as i32,
            0x8080_8004u32 as i32,
            0x8080_8004u32 as i32,
            0x8080_8005u32 as i32,
            0x8080_8005u32 as i32,
            0x8080_8006u32 as i32,
            0x8080_8006u32 as i32,
            0x8080_8007u32 as i32,
            0x8080_8007u32 as i32,
        );
        let mut acc = [_mm512_setzero_ps(); N];
        for pb in 0..k / 128 {
            let b0 = row.add(72 * pb);
            let b1 = b0.add(36);
            let v = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(b0.add(4) as *const __m256i)),
                _mm256_loadu_si256(b1.add(4) as *const __m256i),
            );
            let lo = _mm512_and_si512(v, m0f);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m0f);
            let mlo = _mm512_shuffle_epi8(mag, lo);
            let mhi = _mm512_shuffle_epi8(mag, hi);
            let nlo = _mm512_test_epi8_mask(lo, eight);
            let nhi = _mm512_test_epi8_mask(hi, eight);
            let sc64 = (b0 as *const u32).read_unaligned() as u64
                | ((b1 as *const u32).read_unaligned() as u64) << 32;
            let wsc = e4m3_lanes_avx512(
                _mm512_shuffle_epi8(_mm512_set1_epi64(sc64 as i64), sel),
                0.5,
            );
            for t in 0..N {
                let xe = _mm512_loadu_si512(a[t].q.add(128 * pb) as *const _);
                let xo = _mm512_loadu_si512(a[t].q.add(128 * pb + 64) as *const _);
                let xse = _mm512_mask_sub_epi8(xe, nlo, zero, xe);
                let xso = _mm512_mask_sub_epi8(xo, nhi, zero, xo);
                let i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, mlo, xse), mhi, xso);
                let dx = _mm512_mask_mov_ps(
                    _mm512_set1_ps(*a[t].s.add(2 * pb)),
                    0xff00,
                    _mm512_set1_ps(*a[t].s.add(2 * pb + 1)),
                );
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(wsc, dx), acc[t]);
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]);
        }
        out
    }

    // ---- IQ3_S --------------------------------------------------------------------------

    /// Exact IQ3_S on AVX2: each grid entry's four magnitudes come as f32 from
    /// [`IQ3S_GRID_F32`] (two entries per vector), the sign bits are shifted to bit 31 of their
    /// lanes; per 8 weights that is one insert, a shift, an and, a xor and the FMA. The same
    /// products and sums as [`iq3s_exact_avx2_gather`], so the results are bit-identical.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq3s_exact_avx2<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        let grid = IQ3S_GRID_F32.0.as_ptr() as *const u8;
        // Sign bit 8q + l of a sub-block's u32 (weight 8q + l) shifted to bit 31 of lane l.
        let sh = |q: i32| {
            let c = 31 - 8 * q;
            _mm256_setr_epi32(c, c - 1, c - 2, c - 3, c - 4, c - 5, c - 6, c - 7)
        };
        let shifts = [sh(0), sh(1), sh(2), sh(3)];
        let sign = _mm256_set1_epi32(i32::MIN);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut offsets = OffsetsAhead::<4>::new(row, k / 256);
        for blk in 0..k / 256 {
            let p = row.add(110 * blk);
            let off = offsets.block(blk);
            let db = Lanes::new(iq3s_db_lanes_avx2(p, f16(p)));
            for sub in 0..8 {
                let sbits = _mm256_set1_epi32((p.add(74 + 4 * sub) as *const i32).read_unaligned());
                let mut tmp = [_mm256_setzero_ps(); N];
                for (q, &shift) in shifts.iter().enumerate() {
                    let mags = _mm256_loadu2_m128(
                        grid.add(off.get(8 * sub + 2 * q + 1)) as *const f32,
                        grid.add(off.get(8 * sub + 2 * q)) as *const f32,
                    );
                    // Two ALU ops instead of a table load per 8 weights: the loads (grid
                    // offsets, grid entries, activations) are what limits this kernel.
                    let signs = _mm256_and_si256(_mm256_sllv_epi32(sbits, shift), sign);
                    let w = _mm256_xor_ps(mags, _mm256_castsi256_ps(signs));
                    for t in 0..N {
                        let xp = a[t].f.add(256 * blk + 32 * sub + 8 * q);
                        tmp[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp), tmp[t]);
                    }
                }
                let s = db.broadcast(sub);
                for t in 0..N {
                    acc[t] = _mm256_fmadd_ps(tmp[t], s, acc[t]);
                }
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = hsum256(acc[t]);
        }
        out
    }

    /// Exact IQ3_S on AVX2 with the grid fetched by `vpgatherdd` (`CAPY_IQ3S_GATHER=1`).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq3s_exact_avx2_gather<const N: usize>(
        row: *const u8,
        k: usize,
        a: [P; N],
    ) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        for blk in 0..k / 256 {
            let p = row.add(110 * blk);
            let d = f16(p);
            for sub in 0..8 {
                let mags = iq3s_mags_avx2::<true>(p, sub);
                // Signs applied to the 32 weight bytes at once (two ops), then each 8 bytes
                // sign-extended and converted: fewer ops than a sign per f32 lane.
                let neg = sign_bytes_avx2((p.add(74 + 4 * sub) as *const u32).read_unaligned());
                let sw = _mm256_sub_epi8(_mm256_xor_si256(mags, neg), neg);
                let db = _mm256_set1_ps(iq3s_db(p, d, sub));
                let halves = [
                    _mm256_castsi256_si128(sw),
                    _mm256_extracti128_si256::<1>(sw),
                ];
                let mut tmp = [_mm256_setzero_ps(); N];
                for q in 0..4 {
                    let h = halves[q / 2];
                    let m = if q % 2 == 0 {
                        h
                    } else {
                        _mm_srli_si128::<8>(h)
                    };
                    let w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(m));
                    for t in 0..N {
                        let xp = a[t].f.add(256 * blk + 32 * sub + 8 * q);
                        tmp[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp), tmp[t]);
                    }
                }
                for t in 0..N {
                    acc[t] = _mm256_fmadd_ps(tmp[t], db, acc[t]);
                }
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = hsum256(acc[t]);
        }
        out
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn iq3s_exact_avx512<const N: usize, const GATHER: bool>(
        row: *const u8,
        k: usize,
        a: [P; N],
    ) -> [f32; N] {
        let sign = _mm512_set1_epi32(i32::MIN);
        let mut acc = [_mm512_setzero_ps(); N];
        for blk in 0..k / 256 {
            let p = row.add(110 * blk);
            let d = f16(p);
            for pair in 0..4 {
                let mags = iq3s_mags_pair_avx512::<GATHER>(p, pair);
                let signs = (p.add(74 + 8 * pair) as *const u64).read_unaligned();
                let parts = [
                    _mm512_castsi512_si128(mags),
                    _mm512_extracti32x4_epi32::<1>(mags),
                    _mm512_extracti32x4_epi32::<2>(mags),
                    _mm512_extracti32x4_epi32::<3>(mags),
                ];
                for h in 0..2 {
                    let db = _mm512_set1_ps(iq3s_db(p, d, 2 * pair + h));
                    let mut tmp = [_mm512_setzero_ps(); N];
                    for q in 0..2 {
                        let part = 2 * h + q;
                        let w = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                            parts[part],
                        )));
                        let w = _mm512_castsi512_ps(_mm512_mask_xor_epi32(
                            w,
                            (signs >> (16 * part)) as u16,
                            w,
                            sign,
                        ));
                        for t in 0..N {
                            let xp = a[t].f.add(256 * blk + 64 * pair + 16 * part);
                            tmp[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp), tmp[t]);
                        }
                    }
                    for t in 0..N {
                        acc[t] = _mm512_fmadd_ps(tmp[t], db, acc[t]);
                    }
                }
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]);
        }
        out
    }

    /// Fast IQ3_S on AVX2: a block's 64 grid offsets formed at once, a block ahead
    /// ([`OffsetsAhead`]), each sub-block's 8 entries fetched with scalar loads (or one
    /// `vpgatherdd`: `GATHER`), the weight signs applied to the int8 activations,
    /// `vpmaddubsw` + `vpmaddwd` for the integer sums, and each sub-block's combined scale
    /// broadcast from memory.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq3s_fast_avx2<const N: usize, const GATHER: bool>(
        row: *const u8,
        k: usize,
        a: [P; N],
    ) -> [f32; N] {
        let ones = _mm256_set1_epi16(1);
        // Two accumulators per activation hide the FMA latency where registers allow.
        let chains = if N <= 2 { 2 } else { 1 };
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        let mut offsets = OffsetsAhead::<0>::new(row, if GATHER { 0 } else { k / 256 });
        for blk in 0..k / 256 {
            let p = row.add(110 * blk);
            // Weight scale × activation scale for all 8 sub-blocks at once (lane = sub-block).
            let db = iq3s_db_lanes_avx2(p, f16(p));
            let mut scales = [Lanes([0f32; 8]); N];
            for t in 0..N {
                scales[t] = Lanes::new(_mm256_mul_ps(db, _mm256_loadu_ps(a[t].s.add(8 * blk))));
            }
            let off = (!GATHER).then(|| offsets.block(blk));
            // Sub-blocks in pairs, the accumulator chosen by the position in the pair: a
            // constant index once the inner loop is unrolled (indexed by `sub`, LLVM kept the
            // accumulators in memory and every FMA waited on a store).
            for pair in 0..4 {
                for h in 0..2 {
                    let sub = 2 * pair + h;
                    let mags = match off {
                        None => iq3s_mags_avx2::<true>(p, sub),
                        Some(off) => iq3s_entries_avx2(off, sub),
                    };
                    let neg = sign_bytes_avx2((p.add(74 + 4 * sub) as *const u32).read_unaligned());
                    for t in 0..N {
                        let x =
                            _mm256_loadu_si256(a[t].q.add(256 * blk + 32 * sub) as *const __m256i);
                        let xs = _mm256_sub_epi8(_mm256_xor_si256(x, neg), neg);
                        let i = _mm256_madd_epi16(_mm256_maddubs_epi16(mags, xs), ones);
                        let ch = &mut acc[t][h % chains];
                        *ch = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), scales[t].broadcast(sub), *ch);
                    }
                }
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = hsum256(_mm256_add_ps(acc[t][0], acc[t][1]));
        }
        out
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn iq3s_fast_avx512<const N: usize, const GATHER: bool>(
        row: *const u8,
        k: usize,
        a: [P; N],
    ) -> [f32; N] {
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); N];
        for blk in 0..k / 256 {
            let p = row.add(110 * blk);
            let d = f16(p);
            for pair in 0..4 {
                let mags = iq3s_mags_pair_avx512::<GATHER>(p, pair);
                let signs = (p.add(74 + 8 * pair) as *const u64).read_unaligned();
                let (db0, db1) = (iq3s_db(p, d, 2 * pair), iq3s_db(p, d, 2 * pair + 1));
                for t in 0..N {
                    let x = _mm512_loadu_si512(a[t].q.add(256 * blk + 64 * pair) as *const _);
                    let xs = _mm512_mask_sub_epi8(x, signs, zero, x);
                    let i = _mm512_dpbusd_epi32(zero, mags, xs);
                    let s = a[t].s.add(8 * blk + 2 * pair);
                    let sc = _mm512_mask_mov_ps(
                        _mm512_set1_ps(db0 * *s),
                        0xff00,
                        _mm512_set1_ps(db1 * *s.add(1)),
                    );
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), sc, acc[t]);
                }
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]);
        }
        out
    }

    /// Byte `j` of every IQ3_S grid entry, as `[j][entry]`: eight 64-byte tables per byte,
    /// the operands of the `vpermt2b` decode.
    /// The IQ3_S grid as two 512-byte tables, one per pair of entry bytes: byte `2p` of entry
    /// `e` in the low nibble of `t[p][e]`, byte `2p + 1` in the high nibble (every grid byte
    /// is an odd value ≤ 15). One lookup chain then decodes two of an entry's four bytes:
    /// half the `vpermi2b` of a table per byte, which bound the kernels on the shuffle port.
    #[repr(C, align(64))]
    struct GridNibblePairs([[u8; 512]; 2]);

    static IQ3S_GRID_NIBBLE_PAIRS: GridNibblePairs = {
        let mut t = [[0u8; 512]; 2];
        let mut e = 0;
        while e < 512 {
            let g = IQ3S_GRID[e];
            assert!(g & 0xf0f0_f0f0 == 0, "IQ3_S grid bytes fit a nibble");
            t[0][e] = (g & 0x0f) as u8 | ((g >> 8) as u8 & 0x0f) << 4;
            t[1][e] = ((g >> 16) & 0x0f) as u8 | ((g >> 24) as u8 & 0x0f) << 4;
            e += 1;
        }
        GridNibblePairs(t)
    };

    /// Bytes `2·pair` and `2·pair + 1` of the grid entries of one IQ3_S block (64 entries,
    /// entry `e` in byte `e`) as one nibble pair per byte (see [`IQ3S_GRID_NIBBLE_PAIRS`]).
    /// The 9-bit index is `qs[e] | qh bit e << 8`: bits 0–6 pick a byte of a 128-byte table
    /// pair, bit 7 and the qh bit pick the pair. `region[r]` holds the entries of pair `r`; a
    /// chain of masked `vpermi2b` (which keep the index byte where the mask is clear) decodes
    /// each region in place, so no blends are needed.
    #[inline(always)]
    unsafe fn iq3s_grid_nibble_pairs_vbmi(
        qs: __m512i,
        region: [__mmask64; 4],
        pair: usize,
    ) -> __m512i {
        let t = IQ3S_GRID_NIBBLE_PAIRS.0[pair].as_ptr() as *const __m512i;
        let q = |n: usize| _mm512_load_si512(t.add(n));
        let mut r = qs;
        for (n, &k) in region.iter().enumerate() {
            r = _mm512_mask2_permutex2var_epi8(q(2 * n), r, k, q(2 * n + 1));
        }
        r
    }

    /// [`iq3s_grid_nibble_pairs_vbmi`] split into the two bytes' unsigned values (a shift and
    /// two ANDs).
    #[inline(always)]
    unsafe fn iq3s_grid_pair_vbmi(
        qs: __m512i,
        region: [__mmask64; 4],
        pair: usize,
    ) -> [__m512i; 2] {
        let r = iq3s_grid_nibble_pairs_vbmi(qs, region, pair);
        let low = _mm512_set1_epi8(0x0f);
        [
            _mm512_and_si512(r, low),
            _mm512_and_si512(_mm512_srli_epi16::<4>(r), low),
        ]
    }

    /// The four table-pair regions of a block's 64 entries (see [`iq3s_grid_pair_vbmi`]).
    #[inline(always)]
    unsafe fn iq3s_regions(qs: __m512i, p: *const u8) -> [__mmask64; 4] {
        let k7 = _mm512_movepi8_mask(qs);
        let kh = (p.add(66) as *const u64).read_unaligned();
        [!k7 & !kh, k7 & !kh, !k7 & kh, k7 & kh]
    }

    /// Selector of `vpshufbitqmb` for byte `j`: result bit `8q + m` (entry `8q + m`) takes
    /// bit `4m + j` of qword `q`, which holds the sign bits of entries `8q..8q+8`.
    #[inline(always)]
    unsafe fn iq3s_sign_sel(j: usize) -> __m512i {
        let j = j as i64;
        let v = (0..8).fold(0i64, |acc, m| acc | ((4 * m + j) << (8 * m)));
        _mm512_set1_epi64(v)
    }

    /// The eight sub-block scales `d · (1 + 2s)` of a block, lane `l` holding sub-block `l / 2`:
    /// each lane's nibble `s` (shifted to its low bits) looks up `(1 + 2s) · d` in a table
    /// of the 16 products (the same products as [`iq3s_db`]; fewer ops than converting `1 + 2s`).
    #[inline(always)]
    unsafe fn iq3s_scales_vbmi(p: *const u8, d: f32) -> __m512 {
        let odd = _mm512_setr_ps(
            1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0, 17.0, 19.0, 21.0, 23.0, 25.0, 27.0, 29.0,
            31.0,
        );
        let nib = _mm512_srlv_epi32(
            _mm512_set1_epi32((p.add(106) as *const i32).read_unaligned()),
            _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28),
        );
        _mm512_permutexvar_ps(nib, _mm512_mul_ps(odd, _mm512_set1_ps(d)))
    }

    #[inline(always)]
    unsafe fn dup8_avx512(s: *const f32) -> __m512 {
        _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
            _mm512_castps256_ps512(_mm256_loadu_ps(s)),
        )
    }

    #[target_feature(
        enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bitalg,avx2,fma,f16c"
    )]
    unsafe fn iq3s_fast_vbmi<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        let zero = _mm512_setzero_si512();
        let sel = [
            iq3s_sign_sel(0),
            iq3s_sign_sel(1),
            iq3s_sign_sel(2),
            iq3s_sign_sel(3),
        ];
        let mut acc = [_mm512_setzero_ps(); N];
        for blk in 0..k / 256 {
            let p = row.add(110 * blk);
            let qs = _mm512_loadu_si512(p.add(2) as *const _);
            let region = iq3s_regions(qs, p);
            let signs = _mm512_cvtepu32_epi64(_mm256_loadu_si256(p.add(74) as *const __m256i));
            let mut isum = [zero; N];
            let grid = [
                iq3s_grid_pair_vbmi(qs, region, 0),
                iq3s_grid_pair_vbmi(qs, region, 1),
            ];
            for (j, &sel_j) in sel.iter().enumerate() {
                let w = grid[j / 2][j % 2];
                let neg = _mm512_bitshuffle_epi64_mask(signs, sel_j);
                for t in 0..N {
                    let x = _mm512_loadu_si512(a[t].q.add(256 * blk + 64 * j) as *const _);
                    let xs = _mm512_mask_sub_epi8(x, neg, zero, x);
                    isum[t] = _mm512_dpbusd_epi32(isum[t], w, xs);
                }
            }
            let db = iq3s_scales_vbmi(p, f16(p));
            for t in 0..N {
                let sc = _mm512_mul_ps(db, dup8_avx512(a[t].s.add(8 * blk)));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), sc, acc[t]);
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]);
        }
        out
    }

    /// Exact IQ3_S on AVX-512 with VBMI: the grid decoded as in [`iq3s_fast_vbmi`], each signed
    /// grid byte looked up as an f32 (see below); a block's products go to up to four partial
    /// sums per activation ([`exact_chains`]: two chains left the FMA latency exposed).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
    unsafe fn iq3s_exact_vbmi<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        // Index m: -m, index 16 + m: m (the grid magnitudes are 1..15).
        let pos = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let negt = _mm512_sub_ps(_mm512_setzero_ps(), pos);
        let bit4 = _mm512_set1_epi8(0x10);
        let sel = [
            iq3s_sign_sel(0),
            iq3s_sign_sel(1),
            iq3s_sign_sel(2),
            iq3s_sign_sel(3),
        ];
        let mut acc = [_mm512_setzero_ps(); N];
        for blk in 0..k / 256 {
            let p = row.add(110 * blk);
            let qs = _mm512_loadu_si512(p.add(2) as *const _);
            let region = iq3s_regions(qs, p);
            let signs = _mm512_cvtepu32_epi64(_mm256_loadu_si256(p.add(74) as *const __m256i));
            let mut tmp = [[_mm512_setzero_ps(); 4]; N];
            // Every grid value is odd, so bit 4 of each nibble-pair byte (the high nibble's
            // bit 0) is set, and so it is after rotating each lane by 4 (the next byte's low
            // nibble comes in above): bits 0–4 of a byte are already the index `m | 16` of
            // +m below, and one masked subtraction of 16 makes it −m where the weight is
            // negative (no nibble split, no sign OR).
            let g0 = iq3s_grid_nibble_pairs_vbmi(qs, region, 0);
            let g1 = iq3s_grid_nibble_pairs_vbmi(qs, region, 1);
            let bytes = [g0, _mm512_ror_epi32::<4>(g0), g1, _mm512_ror_epi32::<4>(g1)];
            for (j, &sel_j) in sel.iter().enumerate() {
                let neg = _mm512_bitshuffle_epi64_mask(signs, sel_j);
                // Byte b of each i32 lane, shifted down, indexes the 32-entry f32 table (±m)
                // with one two-table permute: fewer ops than sign-extending and converting
                // each byte (two shifts and a `vcvtdq2ps`, all on one port). No lane-crossing
                // unpack: the activations are laid out to match.
                let idx = _mm512_mask_sub_epi8(bytes[j], neg, bytes[j], bit4);
                let f = [
                    _mm512_permutex2var_ps(negt, idx, pos),
                    _mm512_permutex2var_ps(negt, _mm512_srli_epi32::<8>(idx), pos),
                    _mm512_permutex2var_ps(negt, _mm512_srli_epi32::<16>(idx), pos),
                    _mm512_permutex2var_ps(negt, _mm512_srli_epi32::<24>(idx), pos),
                ];
                for t in 0..N {
                    let xp = a[t].f.add(256 * blk + 64 * j);
                    for (b, fb) in f.iter().enumerate() {
                        let ch = &mut tmp[t][b % exact_chains(N)];
                        *ch = _mm512_fmadd_ps(*fb, _mm512_loadu_ps(xp.add(16 * b)), *ch);
                    }
                }
            }
            let db = iq3s_scales_vbmi(p, f16(p));
            for t in 0..N {
                let [t0, t1, t2, t3] = tmp[t];
                let sum = _mm512_add_ps(_mm512_add_ps(t0, t1), _mm512_add_ps(t2, t3));
                acc[t] = _mm512_fmadd_ps(sum, db, acc[t]);
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]);
        }
        out
    }

    // ---- Q2_0 ---------------------------------------------------------------------------

    /// `(i & 3) - 1` for a 4-bit `vpermps` index `i`: a Q2_0 code in bits 0–1 looks up its
    /// value whatever the next code in bits 2–3 holds (the AVX2 permute reads 3 bits, the
    /// first 8 entries).
    const Q2_0_VALUES: [f32; 16] = [
        -1.0, 0.0, 1.0, 2.0, -1.0, 0.0, 1.0, 2.0, -1.0, 0.0, 1.0, 2.0, -1.0, 0.0, 1.0, 2.0,
    ];

    /// Accumulator chains per activation of the exact kernels that sum a block's products
    /// straight into the accumulators: four hide the FMA latency for one or two
    /// activations, two leave registers for four.
    const fn exact_chains(n: usize) -> usize {
        if n <= 2 {
            4
        } else {
            2
        }
    }

    /// Exact Q2_0 on AVX2: each half block's 8 code bytes widened to i32 lanes once; shifting
    /// them by `2j` puts code `j` of every byte in the index bits of `vpermps`, whose table is
    /// [`Q2_0_VALUES`] times the block scale: the lookup yields the dequantised weight
    /// `(c - 1) · d` itself (the scalar reference's product), so 8 weights cost a shift, a
    /// permute and an FMA (was: a widening, a conversion and a subtraction per 8, a scale
    /// FMA per block).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2_0_exact_avx2<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        let values = _mm256_loadu_ps(Q2_0_VALUES.as_ptr());
        let chains = exact_chains(N);
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        for blk in 0..k / 64 {
            let p = row.add(18 * blk);
            let table = _mm256_mul_ps(values, _mm256_set1_ps(f16(p)));
            for h in 0..2 {
                let c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(2 + 8 * h) as *const __m128i));
                let w = [
                    _mm256_permutevar8x32_ps(table, c),
                    _mm256_permutevar8x32_ps(table, _mm256_srli_epi32::<2>(c)),
                    _mm256_permutevar8x32_ps(table, _mm256_srli_epi32::<4>(c)),
                    _mm256_permutevar8x32_ps(table, _mm256_srli_epi32::<6>(c)),
                ];
                for t in 0..N {
                    let xp = a[t].f.add(64 * blk + 8 * h);
                    for (j, wj) in w.iter().enumerate() {
                        let ch = &mut acc[t][j % chains];
                        *ch = _mm256_fmadd_ps(*wj, _mm256_loadu_ps(xp.add(16 * j)), *ch);
                    }
                }
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            let [a0, a1, a2, a3] = acc[t];
            out[t] = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        }
        out
    }

    /// Exact Q2_0 on AVX-512: [`q2_0_exact_avx2`] with the block's 16 code bytes in 16 lanes
    /// (`vpermps` reads 4 index bits: all of [`Q2_0_VALUES`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn q2_0_exact_avx512<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        let values = _mm512_loadu_ps(Q2_0_VALUES.as_ptr());
        let chains = exact_chains(N);
        let mut acc = [[_mm512_setzero_ps(); 4]; N];
        for blk in 0..k / 64 {
            let p = row.add(18 * blk);
            let table = _mm512_mul_ps(values, _mm512_set1_ps(f16(p)));
            let c = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(2) as *const __m128i));
            let w = [
                _mm512_permutexvar_ps(c, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<2>(c), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(c), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<6>(c), table),
            ];
            for t in 0..N {
                let xp = a[t].f.add(64 * blk);
                for (j, wj) in w.iter().enumerate() {
                    let ch = &mut acc[t][j % chains];
                    *ch = _mm512_fmadd_ps(*wj, _mm512_loadu_ps(xp.add(16 * j)), *ch);
                }
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            let [a0, a1, a2, a3] = acc[t];
            out[t] =
                _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        }
        out
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2_0_fast_avx2<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        let three = _mm256_set1_epi8(3);
        let ones = _mm256_set1_epi16(1);
        let sh01 = _mm256_setr_epi64x(0, 0, 2, 2);
        let sh23 = _mm256_setr_epi64x(4, 4, 6, 6);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut corr = [0f32; N];
        for blk in 0..k / 64 {
            let p = row.add(18 * blk);
            let d = f16(p);
            let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(2) as *const __m128i));
            let c01 = _mm256_and_si256(_mm256_srlv_epi64(q, sh01), three);
            let c23 = _mm256_and_si256(_mm256_srlv_epi64(q, sh23), three);
            for t in 0..N {
                let xp = a[t].q.add(64 * blk);
                let x01 = _mm256_loadu_si256(xp as *const __m256i);
                let x23 = _mm256_loadu_si256(xp.add(32) as *const __m256i);
                let i = _mm256_madd_epi16(
                    _mm256_add_epi16(
                        _mm256_maddubs_epi16(c01, x01),
                        _mm256_maddubs_epi16(c23, x23),
                    ),
                    ones,
                );
                let sc = d * *a[t].s.add(blk);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(sc), acc[t]);
                corr[t] = sc.mul_add(*a[t].sums.add(blk), corr[t]);
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = hsum256(acc[t]) - corr[t];
        }
        out
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q2_0_fast_avx512<const N: usize>(row: *const u8, k: usize, a: [P; N]) -> [f32; N] {
        let three = _mm512_set1_epi8(3);
        let zero = _mm512_setzero_si512();
        let sh = _mm512_setr_epi64(0, 0, 2, 2, 4, 4, 6, 6);
        let mut acc = [_mm512_setzero_ps(); N];
        let mut corr = [0f32; N];
        for blk in 0..k / 64 {
            let p = row.add(18 * blk);
            let d = f16(p);
            let q = _mm512_broadcast_i32x4(_mm_loadu_si128(p.add(2) as *const __m128i));
            let c = _mm512_and_si512(_mm512_srlv_epi64(q, sh), three);
            for t in 0..N {
                let x = _mm512_loadu_si512(a[t].q.add(64 * blk) as *const _);
                let i = _mm512_dpbusd_epi32(zero, c, x);
                let sc = d * *a[t].s.add(blk);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(sc), acc[t]);
                corr[t] = sc.mul_add(*a[t].sums.add(blk), corr[t]);
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]) - corr[t];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    /// Per-activation buffers of the tests: values, int8 codes, and two scale arrays.
    type ActBuffers = (Vec<f32>, Vec<i8>, Vec<f32>, Vec<f32>);
    use super::*;
    use crate::backend::cpu::experts::format::dequantize_row_scalar;
    use crate::backend::cpu::experts::{
        ExpertLayout, ExpertMatrix, ExpertSet, ExpertShape, SplitMix,
    };

    #[test]
    fn e4m3_bit_conversion_matches_the_table_for_every_finite_code() {
        for b in 0..=255u8 {
            if b & 0x7f == 0x7f {
                continue; // NaN codes
            }
            assert_eq!(
                e4m3_by_bits(b).to_bits(),
                E4M3_TO_F32[b as usize].to_bits(),
                "code {b:#x}"
            );
        }
    }

    #[test]
    fn slots_are_a_permutation() {
        for fmt in [NVFP4, IQ3S, Q2_0] {
            for (isa, path) in [Isa::Avx2, Isa::Avx512]
                .into_iter()
                .flat_map(|i| [(i, MathPath::Exact), (i, MathPath::Fast)])
            {
                // 1088: an odd NVFP4 block count (laid out alone on AVX-512's exact path).
                let k = if fmt == NVFP4 { 1088 } else { 1024 };
                let spec = ActSpec::new(isa, path, fmt, k);
                let mut seen = vec![false; k];
                for i in 0..k {
                    let s = spec.slot(i);
                    assert!(!seen[s], "{fmt:?} {path:?}: slot {s} twice");
                    seen[s] = true;
                }
            }
        }
    }

    /// The fast kind's specs whose activations are quantised, with `k` values each.
    fn quantised_specs() -> Vec<ActSpec> {
        let mut v = Vec::new();
        for isa in [Isa::Avx2, Isa::Avx512] {
            for (fmt, k) in [(NVFP4, 1024), (IQ3S, 1024), (Q2_0, 640)] {
                let spec = ActSpec::new(isa, MathPath::Fast, fmt, k);
                v.push(spec);
                if fmt == IQ3S {
                    v.push(ActSpec {
                        iq3s_shuffle: !spec.iq3s_shuffle,
                        ..spec
                    });
                }
            }
        }
        v
    }

    #[test]
    fn quant_block_layouts_agree_with_slots() {
        for spec in quantised_specs() {
            let qb = spec.qblock();
            for at in (0..spec.k).step_by(qb) {
                let (start, ways, stride) = spec.quant_block_layout(at).unwrap();
                for j in 0..qb {
                    assert_eq!(
                        start + stride * (j % ways) + j / ways,
                        spec.slot(at + j),
                        "{spec:?}: value {}",
                        at + j
                    );
                }
            }
        }
    }

    /// The vector quantisation of the activations against the scalar reference: the same
    /// bytes, scales and sums, ties (x.5 after scaling) and an all-zero block included.
    #[test]
    fn quantising_activations_matches_the_scalar_reference() {
        if Isa::best_supported() < Isa::Avx2 {
            eprintln!("skipping: this CPU lacks AVX2");
            return;
        }
        let mut rng = SplitMix(11);
        for spec in quantised_specs() {
            let qb = spec.qblock();
            let mut x: Vec<f32> = (0..spec.k).map(|_| rng.unit() * 6.0 - 3.0).collect();
            // Block 1: scale 1 (its largest value is 127), so k + 0.5 values are exact ties.
            for (j, v) in x[qb..2 * qb].iter_mut().enumerate() {
                *v = if j == 0 {
                    127.0
                } else {
                    (j as f32 - 20.0) + 0.5
                };
            }
            x[2 * qb..3 * qb].iter_mut().for_each(|v| *v = 0.0);
            // Non-finite values: a NaN is skipped by the block maximum, an infinity makes the
            // block's inverse scale 0.
            x[3 * qb + 5] = f32::NAN;
            x[4 * qb + 7] = f32::INFINITY;
            x[4 * qb + 9] = f32::NEG_INFINITY;
            let n = ActSpec::scales_len(spec.k);
            let run = |vector: bool| {
                let (mut q, mut s, mut sums) = (vec![0i8; spec.k], vec![0f32; n], vec![0f32; n]);
                if vector {
                    // SAFETY: AVX2 was checked above.
                    unsafe { x86::quantize_blocks_avx2(&spec, &x, &mut q, &mut s, &mut sums) };
                } else {
                    quantize_blocks(&spec, &x, &mut q, &mut s, &mut sums);
                }
                (q, s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), sums)
            };
            let (reference, vector) = (run(false), run(true));
            assert_eq!(vector.0, reference.0, "{spec:?}: codes");
            assert_eq!(vector.1, reference.1, "{spec:?}: scales");
            assert_eq!(vector.2, reference.2, "{spec:?}: sums");
            // The ties rounded away from zero: 0.5 → 1, −0.5 → −1.
            let tie = |v: f32| reference.0[spec.slot(qb + (v + 19.5) as usize)];
            assert_eq!((tie(0.5), tie(-0.5), tie(1.5)), (1, -1, 2), "{spec:?}");
        }
    }

    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        if Isa::best_supported() >= Isa::Avx2 {
            v.push(Isa::Avx2);
        }
        if Isa::best_supported() >= Isa::Avx512 {
            v.push(Isa::Avx512);
        } else {
            eprintln!("skipping AVX-512 fused kernels: this CPU lacks AVX-512");
        }
        v
    }

    /// The shuffle-decoded IQ3_S kernels (VBMI) against the gather ones, on both paths.
    #[test]
    fn iq3s_shuffle_decode_matches_the_gather_kernels() {
        if !(Isa::best_supported() >= Isa::Avx512 && has_vbmi_bitalg() && has_vnni()) {
            eprintln!("skipping: this CPU lacks AVX-512 VBMI/BITALG/VNNI");
            return;
        }
        for path in [MathPath::Exact, MathPath::Fast] {
            let outs: Vec<Vec<f32>> = [true, false]
                .into_iter()
                .map(|shuffle| {
                    let mut spec = ActSpec::new(Isa::Avx512, path, IQ3S, 1024);
                    assert!(spec.iq3s_shuffle);
                    spec.iq3s_shuffle = shuffle;
                    iq3s_dots(&spec)
                })
                .collect();
            for (i, (a, b)) in outs[0].iter().zip(&outs[1]).enumerate() {
                // Same integer (fast) or float (exact) terms, summed in another order.
                assert!(
                    (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1.0),
                    "{}: [{i}] shuffle {a} vs gather {b}",
                    path.name()
                );
            }
        }
    }

    /// The gather-decoded IQ3_S kernels (AVX2, and AVX-512 without VBMI) fetch the same grid
    /// entries with `vpgatherdd` or scalar loads: bit-identical results.
    #[test]
    fn iq3s_scalar_grid_loads_match_the_gathers() {
        if Isa::best_supported() < Isa::Avx2 {
            eprintln!("skipping: this CPU lacks AVX2");
            return;
        }
        for isa in isas() {
            for path in [MathPath::Exact, MathPath::Fast] {
                let outs: Vec<Vec<f32>> = [true, false]
                    .into_iter()
                    .map(|gather| {
                        let mut spec = ActSpec::new(isa, path, IQ3S, 1024);
                        spec.iq3s_shuffle = false;
                        spec.iq3s_gather = gather;
                        iq3s_dots(&spec)
                    })
                    .collect();
                assert_eq!(
                    outs[0],
                    outs[1],
                    "{isa:?} {}: gathers vs scalar loads",
                    path.name()
                );
            }
        }
    }

    /// `spec` (IQ3_S, k = 1024) on 5 random gate rows and 3 random activations.
    fn iq3s_dots(spec: &ActSpec) -> Vec<f32> {
        let k = spec.k;
        let layout = ExpertLayout::new(
            IQ3S,
            IQ3S,
            ExpertShape {
                hidden: k,
                intermediate: k,
            },
        )
        .unwrap();
        let mut set = ExpertSet::zeroed(layout, 1);
        set.randomize(11);
        let rows = 5;
        let rb = layout.gate_up_row_bytes;
        let mut bytes = Vec::new();
        for r in 0..rows {
            bytes.extend_from_slice(set.row(0, ExpertMatrix::Gate, r));
        }
        let mut rng = SplitMix(4);
        let xs: Vec<Vec<f32>> = (0..3)
            .map(|_| (0..k).map(|_| rng.unit() * 2.0 - 1.0).collect())
            .collect();
        prepared_dots(spec, &bytes, rb, &xs)
    }

    /// `spec`'s kernels on the rows `bytes` (`rb` bytes each) for the activations `xs`,
    /// prepared as the experts prepare them: `out[row · xs.len() + act]`.
    fn prepared_dots(spec: &ActSpec, bytes: &[u8], rb: usize, xs: &[Vec<f32>]) -> Vec<f32> {
        let k = spec.k;
        let sl = ActSpec::scales_len(k);
        let mut bufs: Vec<ActBuffers> = (0..xs.len())
            .map(|_| (vec![0.0; k], vec![0; k], vec![0.0; sl], vec![0.0; sl]))
            .collect();
        for (x, b) in xs.iter().zip(bufs.iter_mut()) {
            prepare(spec, x, &mut b.0, &mut b.1, &mut b.2, &mut b.3);
        }
        let acts: Vec<Act<'_>> = bufs
            .iter()
            .map(|b| Act {
                f: &b.0,
                q: &b.1,
                s: &b.2,
                sums: &b.3,
            })
            .collect();
        let mut out = vec![0f32; bytes.len() / rb * xs.len()];
        dots(spec, bytes, rb, &acts, &mut out, &mut vec![0f32; k]);
        out
    }

    /// The exact kernels of every SIMD ISA on `rows` rows of `fmt` (`k` weights each) against
    /// the f64 dot of the dequantised rows, for 1, 2 and 4 activations drawn from `rng`.
    fn exact_dots_match_the_f64_dot(
        fmt: RowFormat,
        bytes: &[u8],
        rows: usize,
        k: usize,
        rng: &mut SplitMix,
    ) {
        let rb = fmt.row_bytes(k).unwrap();
        for nacts in [1, 2, 4] {
            let xs: Vec<Vec<f32>> = (0..nacts)
                .map(|_| (0..k).map(|_| rng.unit() * 2.0 - 1.0).collect())
                .collect();
            for isa in isas().into_iter().filter(|&i| i >= Isa::Avx2) {
                let spec = ActSpec::new(isa, MathPath::Exact, fmt, k);
                assert_eq!(spec.kind, Kind::Exact);
                let out = prepared_dots(&spec, bytes, rb, &xs);
                let mut w = vec![0f32; k];
                for r in 0..rows {
                    dequantize_row_scalar(fmt, &bytes[r * rb..(r + 1) * rb], &mut w);
                    for (j, x) in xs.iter().enumerate() {
                        let terms = w.iter().zip(x).map(|(p, q)| *p as f64 * *q as f64);
                        let exact: f64 = terms.clone().sum();
                        let mag: f64 = terms.map(f64::abs).sum();
                        let got = out[r * nacts + j] as f64;
                        assert!(
                            (got - exact).abs() <= 1e-5 * mag + 1e-6,
                            "{} k {k} {}: row {r} act {j}: {got} vs {exact}",
                            fmt.name(),
                            isa.name()
                        );
                    }
                }
            }
        }
    }

    /// The exact NVFP4 kernels on rows with an odd block count (AVX-512 takes blocks in pairs
    /// and lays the last one out alone) against the f64 dot of the dequantised rows.
    #[test]
    fn nvfp4_exact_handles_an_odd_last_block() {
        for k in [64, 192, 320] {
            let layout = ExpertLayout::new(
                NVFP4,
                NVFP4,
                ExpertShape {
                    hidden: k,
                    intermediate: k,
                },
            )
            .unwrap();
            let mut set = ExpertSet::zeroed(layout, 1);
            set.randomize(5);
            let rows = 4;
            assert_eq!(layout.gate_up_row_bytes, NVFP4.row_bytes(k).unwrap());
            let mut bytes = Vec::new();
            for r in 0..rows {
                bytes.extend_from_slice(set.row(0, ExpertMatrix::Gate, r));
            }
            let mut rng = SplitMix(7);
            exact_dots_match_the_f64_dot(NVFP4, &bytes, rows, k, &mut rng);
        }
    }

    /// The exact Q2_0 kernels (a table of the block's weights looked up per code) on rows of
    /// one, three and ten blocks against the f64 dot of the dequantised rows, for 1, 2 and 4
    /// activations (four and two partial sums per activation).
    #[test]
    fn q2_0_exact_matches_the_f64_dot_at_every_block_count() {
        for k in [64, 192, 640] {
            let rows = 3;
            let bytes = crate::backend::cpu::experts::random_blocks(Q2_0, rows * k / 64, 13);
            let mut rng = SplitMix(17);
            exact_dots_match_the_f64_dot(Q2_0, &bytes, rows, k, &mut rng);
        }
    }

    /// A call over a run of rows (one row-run call for 1, 2 or 4 activations, row by row
    /// otherwise) gives the same bits as one call per row, for every format, path, ISA and
    /// 1–7 activations, with runs long enough to prefetch past the first rows.
    #[test]
    fn row_runs_match_one_call_per_row_bit_for_bit() {
        let k = 640;
        for fmt in [NVFP4, IQ3S, Q2_0] {
            let k = if fmt == IQ3S { 768 } else { k };
            let rb = fmt.row_bytes(k).unwrap();
            let rows = 9;
            let bytes =
                crate::backend::cpu::experts::random_blocks(fmt, rows * rb / fmt.block_bytes(), 21);
            let mut rng = SplitMix(23);
            for nacts in 1..=7 {
                let xs: Vec<Vec<f32>> = (0..nacts)
                    .map(|_| (0..k).map(|_| rng.unit() * 2.0 - 1.0).collect())
                    .collect();
                for path in [MathPath::Exact, MathPath::Fast] {
                    for isa in isas().into_iter().filter(|&i| i >= Isa::Avx2) {
                        let spec = ActSpec::new(isa, path, fmt, k);
                        let run = prepared_dots(&spec, &bytes, rb, &xs);
                        let per_row: Vec<f32> = bytes
                            .chunks_exact(rb)
                            .flat_map(|row| prepared_dots(&spec, row, rb, &xs))
                            .collect();
                        assert_eq!(run.len(), per_row.len());
                        for (j, (a, b)) in run.iter().zip(&per_row).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{} {} {} {nacts} acts: [{j}] {a} vs {b}",
                                fmt.name(),
                                path.name(),
                                isa.name()
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every fused kernel against the scalar reference, on random rows, for 1–7 activations.
    #[test]
    fn fused_kernels_match_the_scalar_reference() {
        let k = 512;
        for fmt in [NVFP4, IQ3S, Q2_0] {
            let layout = ExpertLayout::new(
                fmt,
                fmt,
                ExpertShape {
                    hidden: k,
                    intermediate: k,
                },
            )
            .unwrap();
            let mut set = ExpertSet::zeroed(layout, 1);
            set.randomize(3);
            let rows = 6;
            let rb = layout.gate_up_row_bytes;
            let mut bytes = Vec::new();
            for r in 0..rows {
                bytes.extend_from_slice(set.row(0, ExpertMatrix::Gate, r));
            }
            let mut rng = SplitMix(9);
            for nacts in 1..=7 {
                let xs: Vec<Vec<f32>> = (0..nacts)
                    .map(|_| (0..k).map(|_| rng.unit() * 2.0 - 1.0).collect())
                    .collect();
                for path in [MathPath::Exact, MathPath::Fast] {
                    let mut want: Option<Vec<f32>> = None;
                    for isa in isas() {
                        let spec = ActSpec::new(isa, path, fmt, k);
                        let out = prepared_dots(&spec, &bytes, rb, &xs);
                        // Magnitudes for the tolerance, from the dequantised rows.
                        let mut w = vec![0f32; k];
                        let mut mags = vec![0f64; rows * nacts];
                        for r in 0..rows {
                            dequantize_row_scalar(fmt, &bytes[r * rb..(r + 1) * rb], &mut w);
                            for (a, x) in xs.iter().enumerate() {
                                let mag: f64 = w
                                    .iter()
                                    .zip(x)
                                    .map(|(p, q)| (*p as f64 * *q as f64).abs())
                                    .sum();
                                let exact: f64 =
                                    w.iter().zip(x).map(|(p, q)| *p as f64 * *q as f64).sum();
                                mags[r * nacts + a] = mag;
                                let got = out[r * nacts + a] as f64;
                                let tol = if path == MathPath::Exact { 1e-5 } else { 3e-2 };
                                assert!(
                                    (got - exact).abs() <= tol * mag + 1e-6,
                                    "{} {} {}: row {r} act {a}: {got} vs {exact} (Σ|terms| {mag})",
                                    fmt.name(),
                                    path.name(),
                                    isa.name()
                                );
                            }
                        }
                        if spec.kind == Kind::Fast {
                            match &want {
                                None => want = Some(out),
                                Some(s) => {
                                    for (j, (g, w)) in out.iter().zip(s).enumerate() {
                                        assert!(
                                            ((g - w) as f64).abs() <= 1e-5 * mags[j] + 1e-6,
                                            "{} fast {}: [{j}] {g} vs scalar {w}",
                                            fmt.name(),
                                            isa.name()
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
