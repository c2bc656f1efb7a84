//! NVFP4 weights as ModelOpt exports them to safetensors.
//!
//! A `[N, K]` linear weight is stored as three tensors:
//! - `weight`: `[N, K/2]` u8, two E2M1 codes per byte, element `2i` in the low nibble of byte
//!   `i` and `2i + 1` in the high nibble (PyTorch's `float4_e2m1fn_x2` order);
//! - `weight_scale`: `[N, K/16]` FP8 E4M3, one scale per 16 consecutive values along K;
//! - `weight_scale_2`: one f32 per tensor, a multiplier (kept as is: its reciprocal is exact
//!   only for powers of two).
//!
//! plus `input_scale` (f32, per tensor) used by W4A4 activation quantisation. E2M1 is
//! 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; doubled
//! these are small integers, which makes integer dot products within a 16-block exact.
//!
//! Dequantised weight = `(e2m1 · scale) · weight_scale_2`.

use super::fp8::E4M3_TO_F32;
use crate::tensor::{DType, HostTensor};
use anyhow::{bail, Result};

/// E2M1 code → value.
pub const E2M1_TO_F32: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E2M1 code → twice its value (an exact small integer).
pub const E2M1_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Values per FP8 scale.
pub const GROUP: usize = 16;

/// A borrowed NVFP4 matrix in ModelOpt layout.
#[derive(Debug, Clone, Copy)]
pub struct Nvfp4Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    /// `rows · cols / 2` bytes.
    pub codes: &'a [u8],
    /// `rows · cols / 16` E4M3 bytes.
    pub scales: &'a [u8],
    pub scale_2: f32,
}

impl<'a> Nvfp4Matrix<'a> {
    /// Checks the sizes; `name` is used in errors.
    pub fn new(
        name: &str,
        rows: usize,
        cols: usize,
        codes: &'a [u8],
        scales: &'a [u8],
        scale_2: f32,
    ) -> Result<Self> {
        if !cols.is_multiple_of(GROUP) {
            bail!("NVFP4 weight {name}: K = {cols} is not a multiple of {GROUP}");
        }
        if codes.len() != rows * cols / 2 {
            bail!(
                "NVFP4 weight {name} [{rows}, {cols}]: expected {} code bytes, found {}",
                rows * cols / 2,
                codes.len()
            );
        }
        if scales.len() != rows * cols / GROUP {
            bail!(
                "NVFP4 weight {name} [{rows}, {cols}]: expected {} scale bytes, found {}",
                rows * cols / GROUP,
                scales.len()
            );
        }
        if !scale_2.is_finite() {
            bail!("NVFP4 weight {name}: weight_scale_2 is {scale_2}, expected a finite number");
        }
        Ok(Nvfp4Matrix {
            rows,
            cols,
            codes,
            scales,
            scale_2,
        })
    }

    /// Row `r` dequantised into `out` (`cols` values).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let k = self.cols;
        let codes = &self.codes[r * k / 2..(r + 1) * k / 2];
        let scales = &self.scales[r * k / GROUP..(r + 1) * k / GROUP];
        for (i, &byte) in codes.iter().enumerate() {
            let s = E4M3_TO_F32[scales[2 * i / GROUP] as usize];
            out[2 * i] = E2M1_TO_F32[(byte & 15) as usize] * s * self.scale_2;
            out[2 * i + 1] = E2M1_TO_F32[(byte >> 4) as usize] * s * self.scale_2;
        }
    }

    /// The whole matrix dequantised, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.row_f32(r, row);
        }
        out
    }
}

/// The tensors of one ModelOpt NVFP4 linear, as read from a checkpoint.
pub struct Nvfp4Tensors {
    pub weight: HostTensor,
    pub weight_scale: HostTensor,
    pub weight_scale_2: f32,
    pub input_scale: Option<f32>,
}

impl Nvfp4Tensors {
    /// Looks up `<prefix>.weight`, `.weight_scale`, `.weight_scale_2` (and the optional
    /// `.input_scale`) through `get`, checking dtypes and shapes. Errors name the tensor.
    pub fn load(prefix: &str, get: impl Fn(&str) -> Option<HostTensor>) -> Result<Self> {
        let need = |suffix: &str| {
            let name = format!("{prefix}.{suffix}");
            get(&name).ok_or_else(|| {
                anyhow::anyhow!("NVFP4 weight {prefix}.weight: scale tensor {name} is missing from the checkpoint (ModelOpt NVFP4 needs weight, weight_scale and weight_scale_2)")
            })
        };
        let weight = get(&format!("{prefix}.weight")).ok_or_else(|| {
            anyhow::anyhow!("NVFP4 weight {prefix}.weight is missing from the checkpoint")
        })?;
        let weight_scale = need("weight_scale")?;
        let scale_2 = need("weight_scale_2")?;
        if !matches!(weight.dtype, DType::U8 | DType::I8) || weight.shape.len() != 2 {
            bail!(
                "NVFP4 weight {}: expected a 2-D U8 tensor of packed codes, found {} {:?}",
                weight.name,
                weight.dtype,
                weight.shape
            );
        }
        let (n, half_k) = (weight.shape[0], weight.shape[1]);
        if weight_scale.dtype != DType::F8E4M3 || weight_scale.shape != [n, half_k * 2 / GROUP] {
            bail!(
                "NVFP4 weight {}: expected {} as F8_E4M3 [{n}, {}], found {} {:?}",
                weight.name,
                weight_scale.name,
                half_k * 2 / GROUP,
                weight_scale.dtype,
                weight_scale.shape
            );
        }
        let scalar = |t: &HostTensor| -> Result<f32> {
            let v = t.to_f32()?;
            if v.len() != 1 {
                bail!(
                    "NVFP4 weight {prefix}.weight: expected {} to hold one value, found shape {:?}",
                    t.name,
                    t.shape
                );
            }
            Ok(v[0])
        };
        let weight_scale_2 = scalar(&scale_2)?;
        let input_scale = match get(&format!("{prefix}.input_scale")) {
            Some(t) => Some(scalar(&t)?),
            None => None,
        };
        Ok(Nvfp4Tensors {
            weight,
            weight_scale,
            weight_scale_2,
            input_scale,
        })
    }

    pub fn matrix(&self) -> Result<Nvfp4Matrix<'_>> {
        let (n, half_k) = (self.weight.shape[0], self.weight.shape[1]);
        Nvfp4Matrix::new(
            &self.weight.name,
            n,
            half_k * 2,
            self.weight.data.as_slice(),
            self.weight_scale.data.as_slice(),
            self.weight_scale_2,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Bytes;

    #[test]
    fn doubled_table_is_twice_the_values() {
        for c in 0..16 {
            assert_eq!(E2M1_DOUBLED[c] as f32, 2.0 * E2M1_TO_F32[c]);
        }
    }

    #[test]
    fn low_nibble_is_the_even_element() {
        // Codes 2 (1.0) low and 7 (6.0) high; scale byte 0x38 = 1.0.
        let codes = [0x72u8; 8];
        let scales = [0x38u8];
        let m = Nvfp4Matrix::new("w", 1, 16, &codes, &scales, 1.0).unwrap();
        let row = m.to_f32();
        assert_eq!(&row[..4], &[1.0, 6.0, 1.0, 6.0]);
    }

    #[test]
    fn missing_scale_tensor_is_named() {
        let w = HostTensor {
            name: "mlp.down_proj.weight".into(),
            dtype: DType::U8,
            shape: vec![2, 8],
            data: Bytes::from_vec(vec![0; 16]),
        };
        let get = |name: &str| (name == "mlp.down_proj.weight").then(|| w.clone());
        let e = Nvfp4Tensors::load("mlp.down_proj", get)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("mlp.down_proj.weight_scale") && e.contains("missing"),
            "{e}"
        );
    }
}
