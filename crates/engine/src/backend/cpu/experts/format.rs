//! Row formats the expert kernels read, and their dequantisation per ISA.
//!
//! Every format stores a row of `K` weights as `K / block_len` blocks of `block_bytes`:
//! - the ggml block types exactly as in GGUF files (see `quant::ggml`);
//! - `Nvfp4`: a repacking of ModelOpt NVFP4 into 36-byte blocks of 64 weights: the four E4M3
//!   scales of the block's four 16-groups, then 32 bytes of E2M1 codes in ModelOpt order
//!   (element `2i` in the low nibble of byte `i`). The tensor's `weight_scale_2` is not in the
//!   block: kernels multiply each row's dot product by it.
//! - `Fp8B128`: FP8 E4M3 in 132-byte blocks of 128 weights: the f32 scale of the weight's
//!   128×128 block, then 128 E4M3 bytes (a row-scaled FP8 tensor repacks the same way).
//!
//! Dequantisation is bit-identical on every ISA (tested): the SIMD versions perform the same
//! f32 operations as the scalar reference, in the same order for each element.

use crate::backend::cpu::simd::Isa;
use crate::quant::fp8::E4M3_TO_F32;
use crate::quant::ggml::{self, GgmlType};
use crate::quant::nvfp4::E2M1_TO_F32;
use anyhow::{bail, Result};

/// A weight row format the expert kernels compute with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum RowFormat {
    Ggml(GgmlType),
    Nvfp4,
    Fp8B128,
}

impl RowFormat {
    /// Parses `nvfp4`, `fp8`, or a ggml type name (`iq3_s`, `q8_0`, `bf16`, …).
    pub fn parse(name: &str) -> Result<RowFormat> {
        match name.to_ascii_lowercase().as_str() {
            "nvfp4" => Ok(RowFormat::Nvfp4),
            "fp8" | "fp8_b128" => Ok(RowFormat::Fp8B128),
            other => match GgmlType::from_name(other) {
                Some(t) => Ok(RowFormat::Ggml(t)),
                None => bail!(
                    "unknown expert weight format {name:?}; expected nvfp4, fp8, or one of {}",
                    GgmlType::ALL
                        .map(|t| t.name().to_ascii_lowercase())
                        .join(", ")
                ),
            },
        }
    }

    pub const ALL: [RowFormat; 10] = [
        RowFormat::Nvfp4,
        RowFormat::Fp8B128,
        RowFormat::Ggml(GgmlType::F32),
        RowFormat::Ggml(GgmlType::F16),
        RowFormat::Ggml(GgmlType::BF16),
        RowFormat::Ggml(GgmlType::Q8_0),
        RowFormat::Ggml(GgmlType::Q2_0),
        RowFormat::Ggml(GgmlType::Iq2Xs),
        RowFormat::Ggml(GgmlType::Iq3Xxs),
        RowFormat::Ggml(GgmlType::Iq3S),
    ];

    pub fn name(self) -> String {
        match self {
            RowFormat::Ggml(t) => t.name().to_ascii_lowercase(),
            RowFormat::Nvfp4 => "nvfp4".into(),
            RowFormat::Fp8B128 => "fp8".into(),
        }
    }

    pub fn block_len(self) -> usize {
        match self {
            RowFormat::Ggml(t) => t.block_len(),
            RowFormat::Nvfp4 => 64,
            RowFormat::Fp8B128 => 128,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            RowFormat::Ggml(t) => t.block_bytes(),
            RowFormat::Nvfp4 => 36,
            RowFormat::Fp8B128 => 132,
        }
    }

    /// Bytes of a row of `k` weights (`k` must be a multiple of the block length).
    pub fn row_bytes(self, k: usize) -> Result<usize> {
        if !k.is_multiple_of(self.block_len()) {
            bail!(
                "{}: a row of {k} weights is not a whole number of {}-weight blocks",
                self.name(),
                self.block_len()
            );
        }
        Ok(k / self.block_len() * self.block_bytes())
    }
}

/// Dequantises a row (`src` = whole blocks, `out.len()` weights) with the given ISA.
/// Panics if `isa` is above what the CPU supports or the sizes disagree.
pub fn dequantize_row(isa: Isa, fmt: RowFormat, src: &[u8], out: &mut [f32]) {
    assert_eq!(
        src.len(),
        out.len() / fmt.block_len() * fmt.block_bytes(),
        "dequantize_row: size mismatch"
    );
    assert!(
        isa <= Isa::best_supported(),
        "ISA {} is not supported by this CPU",
        isa.name()
    );
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the ISA is supported (asserted above) and sizes agree.
        match isa {
            Isa::Avx512 => return unsafe { x86::dequantize_row_avx512(fmt, src, out) },
            Isa::Avx2 => return unsafe { x86::dequantize_row_avx2(fmt, src, out) },
            Isa::Scalar => {}
        }
    }
    dequantize_row_scalar(fmt, src, out)
}

/// The scalar reference.
pub fn dequantize_row_scalar(fmt: RowFormat, src: &[u8], out: &mut [f32]) {
    let (bl, bb) = (fmt.block_len(), fmt.block_bytes());
    match fmt {
        RowFormat::Ggml(t) => ggml::dequantize(t, src, out).expect("sizes checked by the caller"),
        RowFormat::Nvfp4 => {
            for (o, b) in out.chunks_exact_mut(bl).zip(src.chunks_exact(bb)) {
                nvfp4_block_scalar(b, o);
            }
        }
        RowFormat::Fp8B128 => {
            for (o, b) in out.chunks_exact_mut(bl).zip(src.chunks_exact(bb)) {
                let s = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                for (v, &q) in o.iter_mut().zip(&b[4..132]) {
                    *v = E4M3_TO_F32[q as usize] * s;
                }
            }
        }
    }
}

fn nvfp4_block_scalar(b: &[u8], o: &mut [f32]) {
    for (g, &scale) in b[..4].iter().enumerate() {
        let s = E4M3_TO_F32[scale as usize];
        for i in 0..8 {
            let byte = b[4 + 8 * g + i];
            o[16 * g + 2 * i] = E2M1_TO_F32[(byte & 15) as usize] * s;
            o[16 * g + 2 * i + 1] = E2M1_TO_F32[(byte >> 4) as usize] * s;
        }
    }
}

/// Repacks row `r` of a ModelOpt NVFP4 matrix (`codes` `[n, k/2]`, `scales` `[n, k/16]`) into
/// `Nvfp4` blocks appended to `out`.
pub fn repack_nvfp4_row(codes: &[u8], scales: &[u8], k: usize, r: usize, out: &mut Vec<u8>) {
    let codes = &codes[r * k / 2..(r + 1) * k / 2];
    let scales = &scales[r * k / 16..(r + 1) * k / 16];
    for blk in 0..k / 64 {
        out.extend_from_slice(&scales[4 * blk..4 * blk + 4]);
        out.extend_from_slice(&codes[32 * blk..32 * blk + 32]);
    }
}

/// Repacks row `r` of an FP8 E4M3 `[n, k]` matrix with 128×128 block scales
/// (`[ceil(n/128), ceil(k/128)]`) into `Fp8B128` blocks appended to `out`.
pub fn repack_fp8_row(weight: &[u8], block_scales: &[f32], k: usize, r: usize, out: &mut Vec<u8>) {
    let row = &weight[r * k..(r + 1) * k];
    let srow = &block_scales[(r / 128) * k.div_ceil(128)..];
    for blk in 0..k / 128 {
        out.extend_from_slice(&srow[blk].to_le_bytes());
        out.extend_from_slice(&row[128 * blk..128 * blk + 128]);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::quant::ggml::f16_at;
    use crate::quant::iq_tables::{IQ2XS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
    use std::arch::x86_64::*;

    /// E2M1 doubled values as bytes, for `pshufb` (16 entries: exactly one 128-bit lane).
    /// E2M1 doubled magnitudes by code (the sign bit 3 is applied separately, so that code 8
    /// gives −0 as the scalar reference does).
    const E2M1_X2_MAG: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12];

    // ---- AVX2 -------------------------------------------------------------------------

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequantize_row_avx2(fmt: RowFormat, src: &[u8], out: &mut [f32]) {
        let (bl, bb) = (fmt.block_len(), fmt.block_bytes());
        let n = out.len() / bl;
        let (s, o) = (src.as_ptr(), out.as_mut_ptr());
        match fmt {
            RowFormat::Ggml(GgmlType::F32) => {
                std::ptr::copy_nonoverlapping(s, o as *mut u8, src.len())
            }
            RowFormat::Ggml(GgmlType::F16) => {
                for i in 0..out.len() / 8 {
                    _mm256_storeu_ps(
                        o.add(8 * i),
                        _mm256_cvtph_ps(_mm_loadu_si128(s.add(16 * i) as *const __m128i)),
                    );
                }
                let done = out.len() / 8 * 8;
                ggml::dequantize(GgmlType::F16, &src[2 * done..], &mut out[done..]).unwrap();
            }
            RowFormat::Ggml(GgmlType::BF16) => {
                for i in 0..out.len() / 8 {
                    let h = _mm_loadu_si128(s.add(16 * i) as *const __m128i);
                    _mm256_storeu_ps(
                        o.add(8 * i),
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)),
                    );
                }
                let done = out.len() / 8 * 8;
                ggml::dequantize(GgmlType::BF16, &src[2 * done..], &mut out[done..]).unwrap();
            }
            RowFormat::Ggml(GgmlType::Q8_0) => {
                for b in 0..n {
                    let p = s.add(b * bb);
                    let d = _mm256_set1_ps(f16_at(&src[b * bb..], 0));
                    for c in 0..4 {
                        let q = _mm_loadl_epi64(p.add(2 + 8 * c) as *const __m128i);
                        let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                        _mm256_storeu_ps(o.add(b * 32 + 8 * c), _mm256_mul_ps(v, d));
                    }
                }
            }
            RowFormat::Ggml(GgmlType::Q2_0) => {
                let shifts = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
                let three = _mm256_set1_epi32(3);
                let one = _mm256_set1_epi32(1);
                for b in 0..n {
                    let p = s.add(b * bb);
                    let d = _mm256_set1_ps(f16_at(&src[b * bb..], 0));
                    let q = _mm_loadu_si128(p.add(2) as *const __m128i);
                    for c in 0..8 {
                        // Bytes 2c and 2c+1, each repeated for its four 2-bit fields.
                        let lo = 2 * c as i8;
                        let sel = _mm_setr_epi8(
                            lo,
                            lo,
                            lo,
                            lo,
                            lo + 1,
                            lo + 1,
                            lo + 1,
                            lo + 1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                        );
                        let bytes = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(q, sel));
                        let codes = _mm256_and_si256(_mm256_srlv_epi32(bytes, shifts), three);
                        let v = _mm256_cvtepi32_ps(_mm256_sub_epi32(codes, one));
                        _mm256_storeu_ps(o.add(b * 64 + 8 * c), _mm256_mul_ps(v, d));
                    }
                }
            }
            RowFormat::Nvfp4 => {
                let table = _mm_loadu_si128(E2M1_X2_MAG.as_ptr() as *const __m128i);
                let mask = _mm_set1_epi8(15);
                for b in 0..n {
                    let p = s.add(b * bb);
                    for g in 0..4 {
                        // Doubled value × half the scale is exactly value × scale.
                        let half_scale = _mm256_set1_ps(E4M3_TO_F32[*p.add(g) as usize] * 0.5);
                        let q = _mm_loadl_epi64(p.add(4 + 8 * g) as *const __m128i);
                        let lo = _mm_and_si128(q, mask);
                        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
                        let codes = _mm_unpacklo_epi8(lo, hi); // element order 0, 1, 2, …
                        let vals = _mm_shuffle_epi8(table, codes);
                        let eight = _mm_set1_epi8(8);
                        let neg = _mm_cmpeq_epi8(_mm_and_si128(codes, eight), eight);
                        for h in 0..2 {
                            let (m, n) = if h == 0 {
                                (vals, neg)
                            } else {
                                (_mm_srli_si128(vals, 8), _mm_srli_si128(neg, 8))
                            };
                            let v = _mm256_mul_ps(
                                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)),
                                half_scale,
                            );
                            let sign =
                                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepi8_epi32(n), 31));
                            _mm256_storeu_ps(
                                o.add(b * 64 + 16 * g + 8 * h),
                                _mm256_xor_ps(v, sign),
                            );
                        }
                    }
                }
            }
            RowFormat::Fp8B128 => {
                for b in 0..n {
                    let p = s.add(b * bb);
                    let scale =
                        _mm256_set1_ps(f32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]));
                    for c in 0..16 {
                        let idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                            p.add(4 + 8 * c) as *const __m128i
                        ));
                        let v = _mm256_i32gather_ps::<4>(E4M3_TO_F32.as_ptr(), idx);
                        _mm256_storeu_ps(o.add(b * 128 + 8 * c), _mm256_mul_ps(v, scale));
                    }
                }
            }
            RowFormat::Ggml(GgmlType::Iq3S) => {
                for b in 0..n {
                    iq3_s_avx2(&src[b * bb..(b + 1) * bb], o.add(b * 256));
                }
            }
            RowFormat::Ggml(GgmlType::Iq3Xxs) => {
                for b in 0..n {
                    iq3_xxs_avx2(&src[b * bb..(b + 1) * bb], o.add(b * 256));
                }
            }
            RowFormat::Ggml(GgmlType::Iq2Xs) => {
                for b in 0..n {
                    iq2_xs_avx2(&src[b * bb..(b + 1) * bb], o.add(b * 256));
                }
            }
        }
    }

    /// 32 sign bits (bit `i` for byte `i`) to a byte mask (0xff where negative).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn sign_mask_avx2(bits: u32) -> __m256i {
        let v = _mm256_set1_epi32(bits as i32);
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        let bytes = _mm256_shuffle_epi8(v, spread);
        let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit)
    }

    /// 32 magnitudes (u8 < 128) with a negative byte mask, times per-8 scales, stored as f32.
    /// The product is taken on the magnitude and then negated, as the scalar reference does.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store32_avx2(mags: __m256i, neg: __m256i, scales: [f32; 4], o: *mut f32) {
        let lo = _mm256_castsi256_si128(mags);
        let hi = _mm256_extracti128_si256(mags, 1);
        let nlo = _mm256_castsi256_si128(neg);
        let nhi = _mm256_extracti128_si256(neg, 1);
        let parts = [
            (lo, nlo),
            (_mm_srli_si128(lo, 8), _mm_srli_si128(nlo, 8)),
            (hi, nhi),
            (_mm_srli_si128(hi, 8), _mm_srli_si128(nhi, 8)),
        ];
        for (c, (m, n)) in parts.into_iter().enumerate() {
            let v = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)),
                _mm256_set1_ps(scales[c]),
            );
            // Sign flip: xor the f32 sign bit where the byte mask is set.
            let nmask = _mm256_slli_epi32(_mm256_cvtepi8_epi32(n), 31);
            _mm256_storeu_ps(o.add(8 * c), _mm256_xor_ps(v, _mm256_castsi256_ps(nmask)));
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn iq3_s_avx2(b: &[u8], o: *mut f32) {
        let d = f16_at(b, 0);
        let shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let one = _mm256_set1_epi32(1);
        for sub in 0..8 {
            let s = (b[106 + sub / 2] >> (4 * (sub % 2))) & 0x0f;
            let db = d * (1 + 2 * s as u32) as f32;
            let lowidx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                b.as_ptr().add(2 + 8 * sub) as *const __m128i
            ));
            let high = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(b[66 + sub] as i32), shifts),
                one,
            );
            let idx = _mm256_or_si256(lowidx, _mm256_slli_epi32(high, 8));
            let mags = _mm256_i32gather_epi32::<4>(IQ3S_GRID.as_ptr() as *const i32, idx);
            let signs = u32::from_le_bytes(b[74 + 4 * sub..78 + 4 * sub].try_into().unwrap());
            store32_avx2(mags, sign_mask_avx2(signs), [db; 4], o.add(32 * sub));
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn iq3_xxs_avx2(b: &[u8], o: *mut f32) {
        let d = f16_at(b, 0);
        for sub in 0..8 {
            let aux = u32::from_le_bytes(b[66 + 4 * sub..70 + 4 * sub].try_into().unwrap());
            let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
            let idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                b.as_ptr().add(2 + 8 * sub) as *const __m128i
            ));
            let mags = _mm256_i32gather_epi32::<4>(IQ3XXS_GRID.as_ptr() as *const i32, idx);
            let signs = u32::from_le_bytes(std::array::from_fn(|l| {
                KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize]
            }));
            store32_avx2(mags, sign_mask_avx2(signs), [db; 4], o.add(32 * sub));
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn iq2_xs_avx2(b: &[u8], o: *mut f32) {
        let d = f16_at(b, 0);
        for sub in 0..8 {
            // Four grid entries of 8 weights; a scale per two entries.
            let q: [u16; 4] = std::array::from_fn(|e| {
                u16::from_le_bytes([b[2 + 8 * sub + 2 * e], b[3 + 8 * sub + 2 * e]])
            });
            let sc = b[66 + sub];
            let db0 = d * (0.5 + (sc & 0x0f) as f32) * 0.25;
            let db1 = d * (0.5 + (sc >> 4) as f32) * 0.25;
            let idx = _mm_setr_epi32(
                (q[0] & 511) as i32,
                (q[1] & 511) as i32,
                (q[2] & 511) as i32,
                (q[3] & 511) as i32,
            );
            let mags = _mm256_i32gather_epi64::<8>(IQ2XS_GRID.as_ptr() as *const i64, idx);
            let signs =
                u32::from_le_bytes(std::array::from_fn(|e| KSIGNS_IQ2XS[(q[e] >> 9) as usize]));
            store32_avx2(
                mags,
                sign_mask_avx2(signs),
                [db0, db0, db1, db1],
                o.add(32 * sub),
            );
        }
    }

    // ---- AVX-512 ----------------------------------------------------------------------

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dequantize_row_avx512(fmt: RowFormat, src: &[u8], out: &mut [f32]) {
        let (bl, bb) = (fmt.block_len(), fmt.block_bytes());
        let n = out.len() / bl;
        let (s, o) = (src.as_ptr(), out.as_mut_ptr());
        match fmt {
            RowFormat::Ggml(GgmlType::F32) => {
                std::ptr::copy_nonoverlapping(s, o as *mut u8, src.len())
            }
            RowFormat::Ggml(GgmlType::F16) => {
                for i in 0..out.len() / 16 {
                    _mm512_storeu_ps(
                        o.add(16 * i),
                        _mm512_cvtph_ps(_mm256_loadu_si256(s.add(32 * i) as *const __m256i)),
                    );
                }
                let done = out.len() / 16 * 16;
                ggml::dequantize(GgmlType::F16, &src[2 * done..], &mut out[done..]).unwrap();
            }
            RowFormat::Ggml(GgmlType::BF16) => {
                for i in 0..out.len() / 16 {
                    let h = _mm256_loadu_si256(s.add(32 * i) as *const __m256i);
                    _mm512_storeu_ps(
                        o.add(16 * i),
                        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)),
                    );
                }
                let done = out.len() / 16 * 16;
                ggml::dequantize(GgmlType::BF16, &src[2 * done..], &mut out[done..]).unwrap();
            }
            RowFormat::Ggml(GgmlType::Q8_0) => {
                for b in 0..n {
                    let p = s.add(b * bb);
                    let d = _mm512_set1_ps(f16_at(&src[b * bb..], 0));
                    for c in 0..2 {
                        let q = _mm_loadu_si128(p.add(2 + 16 * c) as *const __m128i);
                        let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
                        _mm512_storeu_ps(o.add(b * 32 + 16 * c), _mm512_mul_ps(v, d));
                    }
                }
            }
            RowFormat::Ggml(GgmlType::Q2_0) => {
                let shifts = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
                let three = _mm512_set1_epi32(3);
                let one = _mm512_set1_epi32(1);
                for b in 0..n {
                    let p = s.add(b * bb);
                    let d = _mm512_set1_ps(f16_at(&src[b * bb..], 0));
                    for c in 0..4 {
                        // Four bytes 4c..4c+3, each repeated for its four 2-bit fields.
                        let word = _mm512_set1_epi32(
                            (p.add(2 + 4 * c) as *const u32).read_unaligned() as i32,
                        );
                        let byte_of_lane = _mm512_setr_epi32(
                            0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24,
                        );
                        let fields = _mm512_add_epi32(byte_of_lane, shifts);
                        let codes = _mm512_and_si512(_mm512_srlv_epi32(word, fields), three);
                        let v = _mm512_cvtepi32_ps(_mm512_sub_epi32(codes, one));
                        _mm512_storeu_ps(o.add(b * 64 + 16 * c), _mm512_mul_ps(v, d));
                    }
                }
            }
            RowFormat::Nvfp4 => {
                let table = _mm_loadu_si128(E2M1_X2_MAG.as_ptr() as *const __m128i);
                let mask = _mm_set1_epi8(15);
                for b in 0..n {
                    let p = s.add(b * bb);
                    for g in 0..4 {
                        let half_scale = _mm512_set1_ps(E4M3_TO_F32[*p.add(g) as usize] * 0.5);
                        let q = _mm_loadl_epi64(p.add(4 + 8 * g) as *const __m128i);
                        let lo = _mm_and_si128(q, mask);
                        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
                        let codes = _mm_unpacklo_epi8(lo, hi);
                        let vals = _mm_shuffle_epi8(table, codes);
                        let neg = _mm_test_epi8_mask(codes, _mm_set1_epi8(8));
                        let v = _mm512_castps_si512(_mm512_mul_ps(
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(vals)),
                            half_scale,
                        ));
                        let v = _mm512_mask_xor_epi32(v, neg, v, _mm512_set1_epi32(i32::MIN));
                        _mm512_storeu_ps(o.add(b * 64 + 16 * g), _mm512_castsi512_ps(v));
                    }
                }
            }
            RowFormat::Fp8B128 => {
                for b in 0..n {
                    let p = s.add(b * bb);
                    let scale =
                        _mm512_set1_ps(f32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]));
                    for c in 0..8 {
                        let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                            p.add(4 + 16 * c) as *const __m128i
                        ));
                        let v = _mm512_i32gather_ps::<4>(idx, E4M3_TO_F32.as_ptr());
                        _mm512_storeu_ps(o.add(b * 128 + 16 * c), _mm512_mul_ps(v, scale));
                    }
                }
            }
            RowFormat::Ggml(GgmlType::Iq3S) => {
                for b in 0..n {
                    iq3_s_avx512(&src[b * bb..(b + 1) * bb], o.add(b * 256));
                }
            }
            RowFormat::Ggml(GgmlType::Iq3Xxs) => {
                for b in 0..n {
                    iq3_xxs_avx512(&src[b * bb..(b + 1) * bb], o.add(b * 256));
                }
            }
            RowFormat::Ggml(GgmlType::Iq2Xs) => {
                for b in 0..n {
                    iq2_xs_avx512(&src[b * bb..(b + 1) * bb], o.add(b * 256));
                }
            }
        }
    }

    /// 32 magnitudes (u8), sign bits in a mask register, per-16 scales → 32 f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn store32_avx512(mags: __m256i, signs: u32, scales: [f32; 2], o: *mut f32) {
        let sign_bit = _mm512_set1_epi32(i32::MIN);
        for (c, m) in [
            _mm256_castsi256_si128(mags),
            _mm256_extracti128_si256(mags, 1),
        ]
        .into_iter()
        .enumerate()
        {
            let v = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)),
                _mm512_set1_ps(scales[c]),
            );
            let neg = (signs >> (16 * c)) as u16;
            let flipped = _mm512_mask_xor_epi32(
                _mm512_castps_si512(v),
                neg,
                _mm512_castps_si512(v),
                sign_bit,
            );
            _mm512_storeu_ps(o.add(16 * c), _mm512_castsi512_ps(flipped));
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    unsafe fn iq3_s_avx512(b: &[u8], o: *mut f32) {
        let d = f16_at(b, 0);
        for pair in 0..4 {
            // Two 32-weight sub-blocks (16 grid entries) per gather.
            let lowidx = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                b.as_ptr().add(2 + 16 * pair) as *const __m128i
            ));
            let qh = u16::from_le_bytes([b[66 + 2 * pair], b[67 + 2 * pair]]) as u32;
            let high = _mm512_maskz_mov_epi32(qh as u16, _mm512_set1_epi32(256));
            let idx = _mm512_or_si512(lowidx, high);
            let mags = _mm512_i32gather_epi32::<4>(idx, IQ3S_GRID.as_ptr() as *const i32);
            for h in 0..2 {
                let sub = 2 * pair + h;
                let s = (b[106 + sub / 2] >> (4 * (sub % 2))) & 0x0f;
                let db = d * (1 + 2 * s as u32) as f32;
                let signs = u32::from_le_bytes(b[74 + 4 * sub..78 + 4 * sub].try_into().unwrap());
                let m = if h == 0 {
                    _mm512_castsi512_si256(mags)
                } else {
                    _mm512_extracti64x4_epi64(mags, 1)
                };
                store32_avx512(m, signs, [db; 2], o.add(32 * sub));
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    unsafe fn iq3_xxs_avx512(b: &[u8], o: *mut f32) {
        let d = f16_at(b, 0);
        for pair in 0..4 {
            let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                b.as_ptr().add(2 + 16 * pair) as *const __m128i
            ));
            let mags = _mm512_i32gather_epi32::<4>(idx, IQ3XXS_GRID.as_ptr() as *const i32);
            for h in 0..2 {
                let sub = 2 * pair + h;
                let aux = u32::from_le_bytes(b[66 + 4 * sub..70 + 4 * sub].try_into().unwrap());
                let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
                let signs = u32::from_le_bytes(std::array::from_fn(|l| {
                    KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize]
                }));
                let m = if h == 0 {
                    _mm512_castsi512_si256(mags)
                } else {
                    _mm512_extracti64x4_epi64(mags, 1)
                };
                store32_avx512(m, signs, [db; 2], o.add(32 * sub));
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    unsafe fn iq2_xs_avx512(b: &[u8], o: *mut f32) {
        let d = f16_at(b, 0);
        for pair in 0..4 {
            // Eight grid entries of 8 weights (two 32-weight sub-blocks) per gather.
            let q: [u16; 8] = std::array::from_fn(|e| {
                u16::from_le_bytes([b[2 + 16 * pair + 2 * e], b[3 + 16 * pair + 2 * e]])
            });
            let idx = _mm256_setr_epi32(
                (q[0] & 511) as i32,
                (q[1] & 511) as i32,
                (q[2] & 511) as i32,
                (q[3] & 511) as i32,
                (q[4] & 511) as i32,
                (q[5] & 511) as i32,
                (q[6] & 511) as i32,
                (q[7] & 511) as i32,
            );
            let mags = _mm512_i32gather_epi64::<8>(idx, IQ2XS_GRID.as_ptr() as *const i64);
            for h in 0..2 {
                let sub = 2 * pair + h;
                let sc = b[66 + sub];
                let db0 = d * (0.5 + (sc & 0x0f) as f32) * 0.25;
                let db1 = d * (0.5 + (sc >> 4) as f32) * 0.25;
                let signs = u32::from_le_bytes(std::array::from_fn(|e| {
                    KSIGNS_IQ2XS[(q[4 * h + e] >> 9) as usize]
                }));
                let m = if h == 0 {
                    _mm512_castsi512_si256(mags)
                } else {
                    _mm512_extracti64x4_epi64(mags, 1)
                };
                store32_avx512(m, signs, [db0, db1], o.add(32 * sub));
            }
        }
    }
}
