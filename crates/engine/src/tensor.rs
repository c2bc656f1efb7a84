//! Host tensors as read from checkpoint files: a dtype, a shape, and bytes that are either
//! borrowed from a memory-mapped file (no copy) or owned.

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use std::fmt;
use std::sync::Arc;

/// Element types of stored tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// FP8 E4M3 (used by quantized checkpoints).
    F8E4M3,
    U8,
    I8,
    I32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 | DType::U8 | DType::I8 => 1,
            DType::I64 => 8,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F8E4M3 => "F8_E4M3",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::I32 => "I32",
            DType::I64 => "I64",
        };
        f.write_str(s)
    }
}

/// A byte range kept alive by its owner (a memory map or a vector).
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Bytes {
    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        Bytes {
            owner: Arc::new(v),
            start: 0,
            len,
        }
    }
    pub fn slice_of(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, start: usize, len: usize) -> Self {
        debug_assert!(start + len <= (*owner).as_ref().len());
        Bytes { owner, start, len }
    }
    /// Bytes `start..start + len` of these, sharing the owner (no copy).
    pub fn slice(&self, start: usize, len: usize) -> Bytes {
        assert!(
            start + len <= self.len,
            "Bytes::slice {start}+{len} outside {} bytes",
            self.len
        );
        Bytes {
            owner: self.owner.clone(),
            start: self.start + start,
            len,
        }
    }
    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A tensor as stored: dtype, shape (row-major), little-endian bytes.
#[derive(Clone)]
pub struct HostTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Bytes,
}

impl fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.dtype, self.shape)
    }
}

impl HostTensor {
    pub fn from_f32(name: &str, shape: Vec<usize>, values: &[f32]) -> Self {
        assert_eq!(shape.iter().product::<usize>(), values.len());
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        HostTensor {
            name: name.into(),
            dtype: DType::F32,
            shape,
            data: Bytes::from_vec(bytes),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Fails unless the tensor has exactly this shape.
    pub fn expect_shape(&self, shape: &[usize]) -> Result<()> {
        if self.shape != shape {
            bail!(
                "tensor {} has shape {:?}, expected {:?} from config.json",
                self.name,
                self.shape,
                shape
            );
        }
        Ok(())
    }

    /// Converts a float tensor to f32 values.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let b = self.data.as_slice();
        Ok(match self.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => bail!(
                "tensor {} has dtype {other}; expected a float tensor (F32, F16 or BF16)",
                self.name
            ),
        })
    }
}

impl HostTensor {
    /// The same bytes under another shape with the same element count (e.g. squeezing the
    /// `[C, 1, K]` conv weight to `[C, K]`).
    pub fn reshaped(&self, shape: Vec<usize>) -> Result<HostTensor> {
        if shape.iter().product::<usize>() != self.numel() {
            bail!(
                "tensor {} of shape {:?} cannot be viewed as {:?}",
                self.name,
                self.shape,
                shape
            );
        }
        Ok(HostTensor {
            shape,
            ..self.clone()
        })
    }

    /// A new 2-D tensor made of the given row ranges, in order (used to re-lay weights once at
    /// load, e.g. to separate interleaved query and gate rows).
    pub fn gather_rows(&self, ranges: &[std::ops::Range<usize>]) -> Result<HostTensor> {
        if self.shape.len() != 2 {
            bail!(
                "tensor {} has shape {:?}; expected 2-D",
                self.name,
                self.shape
            );
        }
        let row_bytes = self.shape[1] * self.dtype.size();
        let src = self.data.as_slice();
        let mut out = Vec::with_capacity(ranges.iter().map(|r| r.len()).sum::<usize>() * row_bytes);
        for r in ranges {
            if r.end > self.shape[0] {
                bail!(
                    "tensor {}: rows {r:?} are outside its {} rows",
                    self.name,
                    self.shape[0]
                );
            }
            out.extend_from_slice(&src[r.start * row_bytes..r.end * row_bytes]);
        }
        let rows = out.len() / row_bytes.max(1);
        Ok(HostTensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: vec![rows, self.shape[1]],
            data: Bytes::from_vec(out),
        })
    }

    /// Stacks 2-D tensors with equal column counts (fusing projections that read the same
    /// input into one matmul). Mixed dtypes are converted to F32.
    pub fn concat_rows(name: &str, parts: &[HostTensor]) -> Result<HostTensor> {
        let first = parts
            .first()
            .context("concat_rows needs at least one tensor")?;
        let cols = first.shape.get(1).copied().unwrap_or(0);
        for p in parts {
            if p.shape.len() != 2 || p.shape[1] != cols {
                bail!(
                    "cannot fuse {} of shape {:?} with {} of shape {:?}: column counts differ",
                    p.name,
                    p.shape,
                    first.name,
                    first.shape
                );
            }
        }
        let rows: usize = parts.iter().map(|p| p.shape[0]).sum();
        if parts.iter().all(|p| p.dtype == first.dtype) {
            let mut out = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
            for p in parts {
                out.extend_from_slice(p.data.as_slice());
            }
            return Ok(HostTensor {
                name: name.into(),
                dtype: first.dtype,
                shape: vec![rows, cols],
                data: Bytes::from_vec(out),
            });
        }
        let mut values = Vec::with_capacity(rows * cols);
        for p in parts {
            values.extend(p.to_f32()?);
        }
        Ok(HostTensor::from_f32(name, vec![rows, cols], &values))
    }
}

/// A zeroed f32 buffer of `len` values for bulk copies (a cached conversation's KV read from
/// disk or the device): buffers of 2 MiB and up are advised to use transparent huge pages, so
/// filling 4 GB takes two thousand page faults instead of a million (on the H200 box the faults,
/// not the copies, bounded the disk tier's read).
pub fn bulk_f32(len: usize) -> Vec<f32> {
    let v = vec![0f32; len];
    let bytes = len * 4;
    const HUGE: usize = 2 << 20;
    if bytes >= HUGE && cfg!(target_os = "linux") {
        const PAGE: usize = 4096;
        let start = (v.as_ptr() as usize).next_multiple_of(PAGE);
        let end = (v.as_ptr() as usize + bytes) & !(PAGE - 1);
        if end > start {
            // SAFETY: advice only, on whole pages inside the allocation; failure (THP off) is
            // harmless and ignored.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    v
}

#[cfg(test)]
mod bulk_tests {
    #[test]
    fn bulk_buffers_are_zeroed_at_every_size() {
        for len in [0usize, 1, 1000, 600_000, 3 << 20] {
            let v = super::bulk_f32(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&x| x == 0.0));
        }
    }
}
