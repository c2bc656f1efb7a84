//! `y = x · wᵀ` on the CPU, multi-threaded over output columns, with BF16/F16 weights read in
//! place (converted a few rows at a time into a per-thread f32 buffer) so a checkpoint's
//! weights need no f32 copy in RAM.

use super::experts::format::{dequantize_row, RowFormat};
use super::simd;
use crate::tensor::{Bytes, DType, HostTensor};
use anyhow::{bail, Result};
use rayon::prelude::*;
use std::cell::RefCell;

/// Weight storage of a CPU matrix.
enum Storage {
    F32(Vec<f32>),
    /// Borrowed little-endian f32 (4-byte aligned inside a memory map).
    F32Mapped(Bytes),
    BF16(Bytes),
    F16(Bytes),
    /// Rows of whole blocks of a kernel row format, kept as stored (quantized experts and
    /// matrices are never expanded to f32 in RAM); each row dequantized when it is read, then
    /// scaled by its multiplier (NVFP4's `weight_scale_2`, 1 otherwise).
    Quant {
        format: RowFormat,
        row_bytes: usize,
        bytes: Vec<u8>,
        multipliers: Vec<f32>,
    },
}

/// A `[rows, cols]` weight matrix (rows = outputs).
pub struct CpuMatrix {
    pub rows: usize,
    pub cols: usize,
    storage: Storage,
}

impl CpuMatrix {
    pub fn from_host(t: &HostTensor) -> Result<Self> {
        if t.shape.len() != 2 {
            bail!(
                "tensor {} has shape {:?}; expected a 2-D matrix",
                t.name,
                t.shape
            );
        }
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let bytes = t.data.clone();
        let aligned = |align: usize| (bytes.as_slice().as_ptr() as usize).is_multiple_of(align);
        let storage = match t.dtype {
            DType::F32 if aligned(4) => Storage::F32Mapped(bytes),
            DType::F32 => Storage::F32(t.to_f32()?),
            DType::BF16 if aligned(2) => Storage::BF16(bytes),
            DType::F16 if aligned(2) => Storage::F16(bytes),
            DType::BF16 | DType::F16 => {
                // Rare (hand-written files): copy into an aligned buffer once.
                let v: Vec<u8> = bytes.as_slice().to_vec();
                let owned = Bytes::from_vec(v);
                if t.dtype == DType::BF16 {
                    Storage::BF16(owned)
                } else {
                    Storage::F16(owned)
                }
            }
            other => bail!(
                "tensor {} has dtype {other}; the CPU backend takes F32, F16 or BF16 matrices",
                t.name
            ),
        };
        Ok(CpuMatrix {
            rows,
            cols,
            storage,
        })
    }

    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(rows * cols, data.len());
        CpuMatrix {
            rows,
            cols,
            storage: Storage::F32(data),
        }
    }

    /// A matrix kept in `format`: `parts` are `(rows, blocks, multiplier)` stacked in order
    /// (a fused gate ‖ up from two stored matrices), each `rows · format.row_bytes(cols)` bytes.
    pub fn from_quant_parts(
        format: RowFormat,
        cols: usize,
        parts: &[(usize, &[u8], f32)],
    ) -> Result<Self> {
        let row_bytes = format.row_bytes(cols)?;
        let rows: usize = parts.iter().map(|p| p.0).sum();
        let mut bytes = Vec::with_capacity(rows * row_bytes);
        let mut multipliers = Vec::with_capacity(rows);
        for &(r, blocks, m) in parts {
            if blocks.len() != r * row_bytes {
                bail!(
                    "{} matrix part [{r}, {cols}]: expected {} bytes ({row_bytes} per row), found {}",
                    format.name(),
                    r * row_bytes,
                    blocks.len()
                );
            }
            bytes.extend_from_slice(blocks);
            multipliers.extend(std::iter::repeat_n(m, r));
        }
        Ok(CpuMatrix {
            rows,
            cols,
            storage: Storage::Quant {
                format,
                row_bytes,
                bytes,
                multipliers,
            },
        })
    }

    /// The row format of a matrix kept quantized; `None` for float storage.
    pub fn quant_format(&self) -> Option<RowFormat> {
        match &self.storage {
            Storage::Quant { format, .. } => Some(*format),
            _ => None,
        }
    }

    /// Bytes of the stored weights (quantized matrices at their stored size).
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(v) => v.len() * 4,
            Storage::F32Mapped(b) | Storage::BF16(b) | Storage::F16(b) => b.len(),
            Storage::Quant { bytes, .. } => bytes.len(),
        }
    }

    fn f32_rows(&self) -> Option<&[f32]> {
        match &self.storage {
            Storage::F32(v) => Some(v),
            Storage::F32Mapped(b) => {
                let s = b.as_slice();
                // SAFETY: alignment checked at construction; length is a multiple of 4.
                Some(unsafe { std::slice::from_raw_parts(s.as_ptr() as *const f32, s.len() / 4) })
            }
            _ => None,
        }
    }

    fn u16_rows(&self) -> Option<(&[u16], bool)> {
        let (b, is_bf16) = match &self.storage {
            Storage::BF16(b) => (b, true),
            Storage::F16(b) => (b, false),
            _ => return None,
        };
        let s = b.as_slice();
        // SAFETY: 2-byte alignment checked (or the buffer is a fresh Vec<u8>, which the
        // allocator aligns to at least 8 bytes); length is a multiple of 2.
        Some((
            unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u16, s.len() / 2) },
            is_bf16,
        ))
    }

    /// Row `r` as f32 into `out`.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        if let Storage::Quant {
            format,
            row_bytes,
            bytes,
            multipliers,
        } = &self.storage
        {
            // Bit-identical to the scalar dequantization `backend::dequantize_matrix` and the
            // checkpoint readers use (tested per ISA), so a quantized matrix multiplies exactly
            // like its f32 expansion.
            dequantize_row(
                simd::isa(),
                *format,
                &bytes[r * row_bytes..(r + 1) * row_bytes],
                out,
            );
            let m = multipliers[r];
            if m != 1.0 {
                out.iter_mut().for_each(|v| *v *= m);
            }
        } else if let Some(v) = self.f32_rows() {
            out.copy_from_slice(&v[r * c..(r + 1) * c]);
        } else if let Some((u, bf)) = self.u16_rows() {
            if bf {
                simd::bf16_to_f32(&u[r * c..(r + 1) * c], out)
            } else {
                simd::f16_to_f32(&u[r * c..(r + 1) * c], out)
            }
        }
    }
}

/// Output columns per task: enough work to amortise scheduling, small enough to balance.
const COLS_PER_TASK: usize = 16;
/// Input rows processed against one converted block of weight rows.
const ROW_TILE: usize = 64;

thread_local! {
    static WEIGHT_BLOCK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint column ranges of the output.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `x [n, k] · wᵀ → y [n, rows]`.
pub fn linear(x: &[f32], n: usize, w: &CpuMatrix) -> Vec<f32> {
    let k = w.cols;
    let m = w.rows;
    assert_eq!(
        x.len(),
        n * k,
        "linear: input has {} values, expected {n}×{k}",
        x.len()
    );
    let mut y = vec![0f32; n * m];
    if n == 0 || m == 0 {
        return y;
    }
    let out = OutPtr(y.as_mut_ptr());
    let tasks = m.div_ceil(COLS_PER_TASK);
    let f32_rows = w.f32_rows();
    (0..tasks).into_par_iter().for_each(|t| {
        let j0 = t * COLS_PER_TASK;
        let j1 = (j0 + COLS_PER_TASK).min(m);
        let out = &out;
        let compute = |block: &[f32]| {
            for i0 in (0..n).step_by(ROW_TILE) {
                let i1 = (i0 + ROW_TILE).min(n);
                for i in i0..i1 {
                    let xi = &x[i * k..(i + 1) * k];
                    for j in j0..j1 {
                        let wj = &block[(j - j0) * k..(j - j0 + 1) * k];
                        let v = simd::dot(xi, wj);
                        // SAFETY: (i, j) is inside y and only this task writes column j.
                        unsafe { *out.0.add(i * m + j) = v };
                    }
                }
            }
        };
        match f32_rows {
            Some(rows) => compute(&rows[j0 * k..j1 * k]),
            None => WEIGHT_BLOCK.with(|cell| {
                let mut block = cell.borrow_mut();
                block.resize((j1 - j0) * k, 0.0);
                for j in j0..j1 {
                    w.row_f32(j, &mut block[(j - j0) * k..(j - j0 + 1) * k]);
                }
                compute(&block);
            }),
        }
    });
    y
}

/// Straightforward reference for tests: f64 accumulation.
pub fn linear_reference(x: &[f32], n: usize, w: &CpuMatrix) -> Vec<f32> {
    let (m, k) = (w.rows, w.cols);
    let mut row = vec![0f32; k];
    let mut y = vec![0f32; n * m];
    for j in 0..m {
        w.row_f32(j, &mut row);
        for i in 0..n {
            y[i * m + j] = x[i * k..(i + 1) * k]
                .iter()
                .zip(&row)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32;
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn linear_matches_reference_for_f32_and_bf16_weights() {
        for &(n, m, k) in &[
            (1, 1, 1),
            (1, 37, 65),
            (3, 16, 8),
            (70, 33, 129),
            (5, 100, 512),
        ] {
            let x = rand_vec(n * k, 1);
            let wv = rand_vec(m * k, 2);
            let w = CpuMatrix::from_f32(m, k, wv.clone());
            let got = linear(&x, n, &w);
            let want = linear_reference(&x, n, &w);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "f32 {n}x{m}x{k}: {a} vs {b}");
            }
            let bytes: Vec<u8> = wv
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect();
            let t = HostTensor {
                name: "w".into(),
                dtype: DType::BF16,
                shape: vec![m, k],
                data: Bytes::from_vec(bytes),
            };
            let wb = CpuMatrix::from_host(&t).unwrap();
            let got = linear(&x, n, &wb);
            let want = linear_reference(&x, n, &wb);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "bf16 {n}x{m}x{k}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn quantized_matrix_multiplies_exactly_like_its_dequantized_values() {
        use crate::backend::cpu::experts::random_blocks;
        use crate::backend::dequantize_matrix;
        use crate::quant::GgmlType;
        for (fmt, k) in [
            (RowFormat::Nvfp4, 128),
            (RowFormat::Fp8B128, 128),
            (RowFormat::Ggml(GgmlType::Q8_0), 64),
            (RowFormat::Ggml(GgmlType::Iq3S), 256),
        ] {
            // Two stacked parts with their own multipliers (a fused gate ‖ up).
            let (r0, r1) = (3, 5);
            let per_row = k / fmt.block_len();
            let a = random_blocks(fmt, r0 * per_row, 1);
            let b = random_blocks(fmt, r1 * per_row, 2);
            let q = CpuMatrix::from_quant_parts(fmt, k, &[(r0, &a, 0.5), (r1, &b, 3.0)]).unwrap();
            assert_eq!(q.quant_format(), Some(fmt));
            assert_eq!(q.bytes(), a.len() + b.len());
            let mut values = dequantize_matrix(fmt, r0, k, &a, 0.5).unwrap();
            values.extend(dequantize_matrix(fmt, r1, k, &b, 3.0).unwrap());
            let f = CpuMatrix::from_f32(r0 + r1, k, values);
            let x = rand_vec(4 * k, 3);
            let (got, want) = (linear(&x, 4, &q), linear(&x, 4, &f));
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits()),
                "{}: quantized and dequantized matmuls differ",
                fmt.name()
            );
        }
        let e = CpuMatrix::from_quant_parts(RowFormat::Nvfp4, 64, &[(2, &[0u8; 10], 1.0)])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("expected") && e.contains("found 10"), "{e}");
    }
}
