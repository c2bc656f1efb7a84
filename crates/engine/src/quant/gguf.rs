//! GGUF v3 files (ggml's single-file checkpoints), memory-mapped.
//!
//! Layout (little-endian): magic `GGUF`, version `u32` (2 and 3 share this layout), tensor
//! count `u64`, metadata count `u64`; the metadata key/value pairs (key: `u64` length + UTF-8;
//! value: `u32` type tag + payload; arrays are an element type, a `u64` count and the
//! elements); the tensor infos (name, `u32` dims, `u64` dims innermost first, `u32` ggml type,
//! `u64` offset relative to the data section); padding to `general.alignment` (default 32);
//! the data section. Every tensor offset must be a multiple of the alignment.
//!
//! GGUF dims list the innermost (contiguous) dimension first: a `[rows, cols]` matrix has
//! `dims = [cols, rows]`. [`GgufTensor::shape`] returns the row-major order used elsewhere.

use super::ggml::{self, GgmlType};
use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// One tensor's description and where its bytes are.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    /// As stored: innermost dimension first.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub bytes: usize,
}

impl GgufTensor {
    /// Row-major shape (outermost first), e.g. `[rows, cols]` for a matrix.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
    pub fn numel(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
    /// The innermost dimension (the length of a row).
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(1) as usize
    }
}

/// An open GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub alignment: usize,
    /// Absolute offset of the data section.
    pub data_offset: usize,
    pub metadata: BTreeMap<String, GgufValue>,
    /// In file order.
    pub tensors: Vec<GgufTensor>,
    map: Arc<Mmap>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.buf.len() => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => bail!(
                "truncated GGUF file: {} needs {n} bytes at offset {}, but the file has {} bytes",
                what(),
                self.pos,
                self.buf.len()
            ),
        }
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.buf.len())
            .with_context(|| format!("{}: string length {len} is larger than the file", what()))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .with_context(|| format!("{}: string is not UTF-8", what()))
    }
    fn value(&mut self, tag: u32, what: &dyn Fn() -> String, depth: usize) -> Result<GgufValue> {
        Ok(match tag {
            0 => GgufValue::U8(self.take(1, what)?[0]),
            1 => GgufValue::I8(self.take(1, what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap())),
            3 => GgufValue::I16(i16::from_le_bytes(self.take(2, what)?.try_into().unwrap())),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(self.u32(what)? as i32),
            6 => GgufValue::F32(f32::from_bits(self.u32(what)?)),
            7 => match self.take(1, what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => bail!("{}: boolean byte is {b}, expected 0 or 1", what()),
            },
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth > 0 {
                    bail!("{}: arrays of arrays are not supported", what());
                }
                let elem = self.u32(what)?;
                let n = self.u64(what)?;
                if n > (self.buf.len() - self.pos) as u64 {
                    bail!(
                        "{}: array of {n} elements is longer than the rest of the file",
                        what()
                    );
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem, what, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(self.u64(what)? as i64),
            12 => GgufValue::F64(f64::from_bits(self.u64(what)?)),
            t => bail!("{}: unknown GGUF value type {t} (expected 0..=12)", what()),
        })
    }
}

impl GgufFile {
    /// Opens and checks a GGUF file: every tensor's type, shape and byte range.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file =
            File::open(path).with_context(|| format!("opening GGUF file {}", path.display()))?;
        // SAFETY: the map is read-only; like every checkpoint reader we assume the file is not
        // truncated by another process while open.
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("memory-mapping {}", path.display()))?;
        Self::parse(path, Arc::new(map))
            .with_context(|| format!("reading GGUF file {}", path.display()))
    }

    fn parse(path: &Path, map: Arc<Mmap>) -> Result<GgufFile> {
        let buf: &[u8] = &map;
        let mut c = Cursor { buf, pos: 0 };
        let header = || "the header".to_string();
        let magic = c.take(4, &header)?;
        if magic != b"GGUF" {
            bail!("not a GGUF file: magic is {magic:?}, expected \"GGUF\"");
        }
        let version = c.u32(&header)?;
        if !(2..=3).contains(&version) {
            bail!("GGUF version {version} is not supported (expected 3, or 2 which has the same layout)");
        }
        let n_tensors = c.u64(&header)?;
        let n_kv = c.u64(&header)?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key #{i}"))?;
            let what = || format!("metadata value {key}");
            let tag = c.u32(&what)?;
            let v = c.value(tag, &what, 0)?;
            metadata.insert(key, v);
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a as usize,
                _ => bail!("general.alignment is {v:?}, expected a power of two"),
            },
        };
        let mut infos = Vec::new();
        for i in 0..n_tensors {
            let name = c.string(&|| format!("tensor info #{i}"))?;
            let what = || format!("tensor info of {name}");
            let n_dims = c.u32(&what)?;
            if n_dims > 4 {
                bail!("tensor {name}: {n_dims} dimensions, GGUF allows at most 4");
            }
            let dims = (0..n_dims)
                .map(|_| c.u64(&what))
                .collect::<Result<Vec<_>>>()?;
            let ty_id = c.u32(&what)?;
            let offset = c.u64(&what)?;
            infos.push((name, dims, ty_id, offset));
        }
        let data_offset = c.pos.next_multiple_of(alignment);
        let mut tensors = Vec::with_capacity(infos.len());
        for (name, dims, ty_id, offset) in infos {
            let ty = GgmlType::from_id(ty_id).with_context(|| format!("tensor {name}"))?;
            let numel = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .with_context(|| format!("tensor {name}: dims {dims:?} overflow"))?;
            let row = dims.first().copied().unwrap_or(1) as usize;
            let row_bytes = ty
                .row_bytes(row)
                .with_context(|| format!("tensor {name} (dims {dims:?}, type {ty})"))?;
            let bytes = (numel / row.max(1) as u64) as usize * row_bytes;
            if offset % alignment as u64 != 0 {
                bail!("tensor {name}: data offset {offset} is not a multiple of the alignment {alignment}");
            }
            let start = (data_offset as u64)
                .checked_add(offset)
                .filter(|&s| s <= buf.len() as u64);
            let end = start
                .and_then(|s| s.checked_add(bytes as u64))
                .filter(|&e| e <= buf.len() as u64);
            let Some(start) = start.filter(|_| end.is_some()) else {
                bail!(
                    "tensor {name}: data [{}, +{bytes}) runs past the end of the file ({} bytes); the file is truncated or the offset is wrong",
                    data_offset as u64 + offset,
                    buf.len()
                );
            };
            tensors.push(GgufTensor {
                name,
                dims,
                ty,
                offset: start as usize,
                bytes,
            });
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            alignment,
            data_offset,
            metadata,
            tensors,
            map,
        })
    }

    pub fn get(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (borrowed from the map).
    pub fn data(&self, t: &GgufTensor) -> &[u8] {
        &self.map[t.offset..t.offset + t.bytes]
    }

    /// The raw bytes of a tensor as a [`crate::tensor::Bytes`] that keeps the map alive.
    pub fn bytes(&self, t: &GgufTensor) -> crate::tensor::Bytes {
        crate::tensor::Bytes::slice_of(self.map.clone(), t.offset, t.bytes)
    }

    /// A tensor dequantised to f32, row-major.
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self
            .get(name)
            .with_context(|| format!("tensor {name} is not in {}", self.path.display()))?;
        let mut out = vec![0f32; t.numel()];
        ggml::dequantize(t.ty, self.data(t), &mut out).with_context(|| format!("tensor {name}"))?;
        Ok(out)
    }

    pub fn meta(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }
}
