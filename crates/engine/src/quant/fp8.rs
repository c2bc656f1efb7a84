//! FP8 E4M3 weights (the `float8_e4m3fn` of PyTorch): 1 sign bit, 4 exponent bits (bias 7),
//! 3 mantissa bits; no infinities, `S.1111.111` is NaN, largest finite value 448.
//!
//! Checkpoints scale FP8 weights either per 128×128 block (a `[ceil(N/128), ceil(K/128)]` f32
//! tensor, usually named `weight_scale_inv` even though it multiplies) or per output row
//! (`[N]` or `[N, 1]`). Dequantised weight = `decode(byte) · scale`.

use anyhow::{bail, Result};

const fn e4m3_value(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((byte >> 3) & 0x0f) as u32;
    let man = (byte & 0x07) as u32;
    if exp == 15 && man == 7 {
        return f32::NAN;
    }
    if exp == 0 {
        // Subnormal: man/8 · 2^-6, exact in f32.
        return sign * man as f32 / 512.0;
    }
    // Normal: rebias the exponent into an f32 bit pattern (exact).
    sign * f32::from_bits(((exp + 127 - 7) << 23) | (man << 20))
}

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_value(i as u8);
        i += 1;
    }
    t
}

/// Every E4M3 byte's value.
pub static E4M3_TO_F32: [f32; 256] = e4m3_table();

/// How an FP8 weight is scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// One scale per `rows × cols` block (128×128 in the published checkpoints).
    Block { rows: usize, cols: usize },
    /// One scale per output row.
    Row,
}

/// Dequantises a `[n, k]` FP8 E4M3 matrix (`weight` holds `n · k` bytes) with `scales` laid
/// out as `scaling` says. `name` is used in errors.
pub fn dequantize(
    name: &str,
    weight: &[u8],
    n: usize,
    k: usize,
    scales: &[f32],
    scaling: Fp8Scaling,
) -> Result<Vec<f32>> {
    if weight.len() != n * k {
        bail!(
            "FP8 weight {name}: expected {n}×{k} = {} bytes, found {}",
            n * k,
            weight.len()
        );
    }
    let expected_scales = match scaling {
        Fp8Scaling::Block { rows, cols } => n.div_ceil(rows) * k.div_ceil(cols),
        Fp8Scaling::Row => n,
    };
    if scales.len() != expected_scales {
        bail!(
            "FP8 weight {name} [{n}, {k}] with {scaling:?} scales needs {expected_scales} scale values, found {}",
            scales.len()
        );
    }
    let mut out = vec![0f32; n * k];
    for (r, (orow, wrow)) in out
        .chunks_exact_mut(k)
        .zip(weight.chunks_exact(k))
        .enumerate()
    {
        match scaling {
            Fp8Scaling::Row => {
                let s = scales[r];
                for (o, &b) in orow.iter_mut().zip(wrow) {
                    *o = E4M3_TO_F32[b as usize] * s;
                }
            }
            Fp8Scaling::Block { rows, cols } => {
                let srow = &scales[(r / rows) * k.div_ceil(cols)..];
                for (c, (o, &b)) in orow.iter_mut().zip(wrow).enumerate() {
                    *o = E4M3_TO_F32[b as usize] * srow[c / cols];
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_table_has_the_format_landmarks() {
        assert_eq!(E4M3_TO_F32[0x00], 0.0);
        assert_eq!(E4M3_TO_F32[0x38], 1.0); // exponent 7 = bias
        assert_eq!(E4M3_TO_F32[0x7e], 448.0);
        assert_eq!(E4M3_TO_F32[0xfe], -448.0);
        assert_eq!(E4M3_TO_F32[0x01], 2f32.powi(-9)); // smallest subnormal
        assert_eq!(E4M3_TO_F32[0x08], 2f32.powi(-6)); // smallest normal
        assert!(E4M3_TO_F32[0x7f].is_nan() && E4M3_TO_F32[0xff].is_nan());
        assert!(E4M3_TO_F32[0x80] == 0.0 && E4M3_TO_F32[0x80].is_sign_negative());
    }

    #[test]
    fn scale_count_mismatch_is_refused_with_the_name() {
        let e = dequantize("mtp.w", &[0; 6], 2, 3, &[1.0], Fp8Scaling::Row)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mtp.w") && e.contains("needs 2"), "{e}");
    }
}
