//! Dot-product and conversion kernels: a scalar reference and an AVX2+FMA version, chosen
//! once from the CPU's features. Tests hold them together.
//!
//! Hand-written because the matmul inner loop is where CPU time goes, and the compiler does
//! not reassociate float sums on its own (so it cannot vectorise a plain reduction).

use half::{bf16, f16};
use std::sync::OnceLock;

/// Instruction sets the CPU kernels can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The best ISA this CPU supports, or the one `CAPY_CPU_ISA` forces (never above what
    /// the CPU has).
    pub fn detect() -> Isa {
        let best = Self::best_supported();
        match std::env::var("CAPY_CPU_ISA").ok().as_deref() {
            Some("scalar") => Isa::Scalar,
            Some("avx2") => best.min(Isa::Avx2),
            Some("avx512") => best,
            _ => best,
        }
    }

    pub fn best_supported() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }
}

/// The ISA chosen for this process (detected once).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(Isa::detect)
}

/// Scalar reference dot product (8 interleaved partial sums, the same association as the
/// SIMD version so the two agree closely).
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] = a[c * 8 + l].mul_add(b[c * 8 + l], acc[l]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in chunks * 8..a.len() {
        s = a[i].mul_add(b[i], s);
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len();
    let pa = a.as_ptr();
    let pb = b.as_ptr();
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut acc2 = _mm256_setzero_ps();
    let mut acc3 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + 8)),
            _mm256_loadu_ps(pb.add(i + 8)),
            acc1,
        );
        acc2 = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + 16)),
            _mm256_loadu_ps(pb.add(i + 16)),
            acc2,
        );
        acc3 = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + 24)),
            _mm256_loadu_ps(pb.add(i + 24)),
            acc3,
        );
        i += 32;
    }
    while i + 8 <= n {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        i += 8;
    }
    let acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
    let hi = _mm256_extractf128_ps(acc, 1);
    let lo = _mm256_castps256_ps128(acc);
    let s4 = _mm_add_ps(lo, hi);
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    let mut s = _mm_cvtss_f32(s1);
    while i < n {
        s = (*pa.add(i)).mul_add(*pb.add(i), s);
        i += 1;
    }
    s
}

/// `a · b` with the process's ISA.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if isa() >= Isa::Avx2 {
            // SAFETY: the CPU supports AVX2 and FMA (checked by `isa()`), lengths are equal.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_scalar(a, b)
}

/// `y += alpha · x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = alpha.mul_add(*xi, *yi);
    }
}

/// BF16 bits to f32 (scalar reference).
pub fn bf16_to_f32_scalar(src: &[u16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16::from_bits(*s).to_f32();
    }
}

/// F16 bits to f32 (scalar reference).
pub fn f16_to_f32_scalar(src: &[u16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f16::from_bits(*s).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn bf16_to_f32_avx2(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        let w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_castsi256_ps(w));
        i += 8;
    }
    bf16_to_f32_scalar(&src[i..n], &mut dst[i..n]);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_to_f32_f16c(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    f16_to_f32_scalar(&src[i..n], &mut dst[i..n]);
}

/// BF16 bits to f32 with the process's ISA (exact either way: BF16 → f32 is a shift).
pub fn bf16_to_f32(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        if isa() >= Isa::Avx2 {
            // SAFETY: AVX2 checked by `isa()`.
            return unsafe { bf16_to_f32_avx2(src, dst) };
        }
    }
    bf16_to_f32_scalar(src, dst)
}

/// F16 bits to f32 with the process's ISA (exact either way).
pub fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        if isa() >= Isa::Avx2 {
            // SAFETY: AVX2 and F16C checked by `isa()`.
            return unsafe { f16_to_f32_f16c(src, dst) };
        }
    }
    f16_to_f32_scalar(src, dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    #[test]
    fn simd_dot_matches_scalar_reference() {
        for n in [0, 1, 7, 8, 31, 32, 33, 100, 1000, 5120] {
            let a = data(n, 1);
            let b = data(n, 2);
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let s = dot_scalar(&a, &b);
            let v = dot(&a, &b);
            let tol = 1e-5 * (n as f32).sqrt().max(1.0);
            assert!(
                (s as f64 - exact).abs() < tol as f64,
                "scalar n={n}: {s} vs {exact}"
            );
            assert!((v - s).abs() < tol, "simd n={n}: {v} vs scalar {s}");
        }
    }

    #[test]
    fn half_conversions_match_scalar_reference_bit_for_bit() {
        let bits: Vec<u16> = (0..1000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 16) as u16)
            .collect();
        let mut a = vec![0f32; bits.len()];
        let mut b = vec![0f32; bits.len()];
        bf16_to_f32_scalar(&bits, &mut a);
        bf16_to_f32(&bits, &mut b);
        assert!(a
            .iter()
            .zip(&b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())));
        f16_to_f32_scalar(&bits, &mut a);
        f16_to_f32(&bits, &mut b);
        assert!(a
            .iter()
            .zip(&b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())));
    }
}
