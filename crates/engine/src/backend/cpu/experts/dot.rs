//! f32 dot products per ISA, for rows dequantised by [`super::format`].
//!
//! The scalar reference is [`simd::dot_scalar`] (8 interleaved partial sums). AVX2 keeps
//! 4×8 partial sums and AVX-512 4×16, so the three differ only by float reassociation: for a
//! length-`n` dot the difference is bounded by about `n · ε · Σ|aᵢbᵢ|` (ε = 2⁻²⁴), and tests hold
//! them to `1e-5 · Σ|aᵢbᵢ|` at the lengths used (≤ 4096).

use crate::backend::cpu::simd::{self, Isa};

/// `a · b` with the given ISA (which the caller has checked the CPU supports).
#[inline]
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: callers pass an ISA from `Isa::detect`/`best_supported` (checked at the
        // kernel entry); both slices hold at least `n` values.
        match isa {
            Isa::Avx512 => return unsafe { dot_avx512(a.as_ptr(), b.as_ptr(), n) },
            Isa::Avx2 => return unsafe { dot_avx2(a.as_ptr(), b.as_ptr(), n) },
            Isa::Scalar => {}
        }
    }
    let _ = isa;
    simd::dot_scalar(&a[..n], &b[..n])
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(pa: *const f32, pb: *const f32, n: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8 * l)),
                _mm256_loadu_ps(pb.add(i + 8 * l)),
                *a,
            );
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i)),
            _mm256_loadu_ps(pb.add(i)),
            acc[0],
        );
        i += 8;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let mut s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    while i < n {
        s = (*pa.add(i)).mul_add(*pb.add(i), s);
        i += 1;
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(pa: *const f32, pb: *const f32, n: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(
                _mm512_loadu_ps(pa.add(i + 16 * l)),
                _mm512_loadu_ps(pb.add(i + 16 * l)),
                *a,
            );
        }
        i += 64;
    }
    while i + 16 <= n {
        acc[0] = _mm512_fmadd_ps(
            _mm512_loadu_ps(pa.add(i)),
            _mm512_loadu_ps(pb.add(i)),
            acc[0],
        );
        i += 16;
    }
    let mut s = _mm512_reduce_add_ps(_mm512_add_ps(
        _mm512_add_ps(acc[0], acc[1]),
        _mm512_add_ps(acc[2], acc[3]),
    ));
    while i < n {
        s = (*pa.add(i)).mul_add(*pb.add(i), s);
        i += 1;
    }
    s
}
