//! Quantized weights kept quantized: a checkpoint tensor as rows of one of the CPU kernels'
//! [`RowFormat`]s (for [`crate::backend::Backend::quant_matrix`]), and a layer's routed experts
//! packed into an [`ExpertSet`] without dequantizing them.
//!
//! - GGUF block types are taken as they are stored (the expert tensors carry no converter
//!   transform; a tensor the loader has to transform is not offered here);
//! - ModelOpt NVFP4 is repacked into [`RowFormat::Nvfp4`] blocks of 64 (so `K` must be a
//!   multiple of 64), `weight_scale_2` becoming the matrix multiplier;
//! - FP8 E4M3 with 128×128 block scales, row scales or one scale is repacked into
//!   [`RowFormat::Fp8B128`] (`K` a multiple of 128) with each block's scale in front.
//!
//! Anything else (float tensors, sizes the formats cannot hold) gives `None`: the caller reads
//! the tensor through [`Weights::get`] (dequantized) instead. The values are bit-identical
//! either way: both paths compute `(code · scale) · multiplier` in the same order (tested).

use super::weights::Weights;
use crate::backend::cpu::experts::format::{repack_fp8_row, repack_nvfp4_row};
use crate::backend::cpu::experts::{ExpertLayout, ExpertMatrix, ExpertSet, ExpertShape, RowFormat};
use crate::quant::GgmlType;
use crate::tensor::DType;
use anyhow::{bail, Result};

/// A `[rows, cols]` matrix as whole blocks of `format`, row after row.
#[derive(Debug, Clone)]
pub struct QuantRows {
    pub format: RowFormat,
    pub rows: usize,
    pub cols: usize,
    /// `rows · format.row_bytes(cols)` bytes.
    pub bytes: Vec<u8>,
    /// Multiplies every weight (NVFP4's `weight_scale_2`; 1 otherwise).
    pub multiplier: f32,
}

impl QuantRows {
    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.bytes.len() / self.rows;
        &self.bytes[r * rb..(r + 1) * rb]
    }
}

impl Weights {
    /// The 2-D weight `name` in a kernel row format without dequantizing it, when it is stored
    /// quantized in a way the formats can hold; `None` for float tensors and unfitting sizes.
    pub fn quant_rows(&self, name: &str) -> Result<Option<QuantRows>> {
        if let Some(g) = self.gguf() {
            if let Some((t, expert)) = g.source_of(name) {
                if !g.is_verbatim(name) {
                    return Ok(None);
                }
                let shape = t.shape();
                let (rows, cols) = match expert {
                    Some(_) if shape.len() == 3 => (shape[1], shape[2]),
                    None if shape.len() == 2 => (shape[0], shape[1]),
                    _ => return Ok(None),
                };
                if matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                    return Ok(None);
                }
                let data = g.file().data(t);
                let bytes = match expert {
                    Some(e) => {
                        let per = t.bytes / shape[0];
                        data[e * per..(e + 1) * per].to_vec()
                    }
                    None => data.to_vec(),
                };
                return Ok(Some(QuantRows {
                    format: RowFormat::Ggml(t.ty),
                    rows,
                    cols,
                    bytes,
                    multiplier: 1.0,
                }));
            }
        }
        let st = self.store();
        if !st.contains(name) {
            return Ok(None);
        }
        let w = st.get(name)?;
        let module = name.strip_suffix(".weight").unwrap_or(name);
        if w.shape.len() != 2 {
            return Ok(None);
        }
        match w.dtype {
            DType::U8 => {
                let (n, k) = (w.shape[0], w.shape[1] * 2);
                if !k.is_multiple_of(64) {
                    return Ok(None);
                }
                let (Some(scales), Some(s2)) = (
                    st.get(&format!("{module}.weight_scale")).ok(),
                    st.get(&format!("{module}.weight_scale_2")).ok(),
                ) else {
                    // Let the dequantizing reader name what is missing.
                    self.get(name)?;
                    return Ok(None);
                };
                let s2 = s2.to_f32()?;
                if scales.dtype != DType::F8E4M3 || scales.shape != [n, k / 16] || s2.len() != 1 {
                    self.get(name)?;
                    return Ok(None);
                }
                let mut bytes = Vec::with_capacity(n * RowFormat::Nvfp4.row_bytes(k)?);
                for r in 0..n {
                    repack_nvfp4_row(w.data.as_slice(), scales.data.as_slice(), k, r, &mut bytes);
                }
                Ok(Some(QuantRows {
                    format: RowFormat::Nvfp4,
                    rows: n,
                    cols: k,
                    bytes,
                    multiplier: s2[0],
                }))
            }
            DType::F8E4M3 => {
                let (n, k) = (w.shape[0], w.shape[1]);
                if !k.is_multiple_of(128) {
                    return Ok(None);
                }
                let suffix = if st.contains(&format!("{module}.weight_scale_inv")) {
                    "weight_scale_inv"
                } else {
                    "weight_scale"
                };
                let scale = st.get(&format!("{module}.{suffix}"))?;
                let s = scale.to_f32()?;
                let block = self.quant_config().map(|q| q.block).unwrap_or([128, 128]);
                let blocks = [n.div_ceil(128), k.div_ceil(128)];
                // Per-block scales for 128-column blocks, one row of them per 128 rows
                // (`Block`), or per row (`Row`, one scale).
                let per_row: Option<Vec<f32>> = if scale.shape == [n] || scale.shape == [n, 1] {
                    Some(s.clone())
                } else if s.len() == 1 {
                    Some(vec![s[0]; n])
                } else {
                    None
                };
                let mut bytes = Vec::with_capacity(n * RowFormat::Fp8B128.row_bytes(k)?);
                match per_row {
                    Some(rs) => {
                        for (r, &sc) in rs.iter().enumerate() {
                            let row = &w.data.as_slice()[r * k..(r + 1) * k];
                            for blk in row.chunks_exact(128) {
                                bytes.extend_from_slice(&sc.to_le_bytes());
                                bytes.extend_from_slice(blk);
                            }
                        }
                    }
                    None if block == [128, 128] && scale.shape == blocks => {
                        for r in 0..n {
                            repack_fp8_row(w.data.as_slice(), &s, k, r, &mut bytes);
                        }
                    }
                    None => return Ok(None),
                }
                Ok(Some(QuantRows {
                    format: RowFormat::Fp8B128,
                    rows: n,
                    cols: k,
                    bytes,
                    multiplier: 1.0,
                }))
            }
            _ => Ok(None),
        }
    }
}

/// One layer's routed experts (`{p}{e}.gate_proj.weight`, `up_proj`, `down_proj` for
/// `e < experts`) packed into an [`ExpertSet`] straight from their quantized storage, or
/// `None` when they are not all stored quantized in one format (gate and up) and one format
/// (down) the kernels read.
pub fn quantized_expert_set(
    w: &Weights,
    p: &str,
    experts: usize,
    shape: ExpertShape,
) -> Result<Option<ExpertSet>> {
    let (h, i) = (shape.hidden, shape.intermediate);
    let mut set: Option<ExpertSet> = None;
    for e in 0..experts {
        let mut mats = Vec::with_capacity(3);
        for (proj, want) in [
            ("gate_proj", [i, h]),
            ("up_proj", [i, h]),
            ("down_proj", [h, i]),
        ] {
            let name = format!("{p}{e}.{proj}.weight");
            let Some(q) = w.quant_rows(&name)? else {
                return Ok(None);
            };
            if [q.rows, q.cols] != want {
                bail!(
                    "routed expert {name}: stored as [{}, {}], expected {want:?} from config.json",
                    q.rows,
                    q.cols
                );
            }
            mats.push(q);
        }
        let (gate, up, down) = (&mats[0], &mats[1], &mats[2]);
        if gate.format != up.format {
            return Ok(None);
        }
        let s = match &mut set {
            Some(s) => s,
            None => set.insert(ExpertSet::zeroed(
                ExpertLayout::new(gate.format, down.format, shape)?,
                experts,
            )),
        };
        if s.layout.format != gate.format || s.layout.down_format != down.format {
            return Ok(None);
        }
        for r in 0..i {
            s.set_row(e, ExpertMatrix::Gate, r, gate.row(r))?;
            s.set_row(e, ExpertMatrix::Up, r, up.row(r))?;
        }
        for r in 0..h {
            s.set_row(e, ExpertMatrix::Down, r, down.row(r))?;
        }
        s.set_multipliers(e, [gate.multiplier, up.multiplier, down.multiplier]);
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::SafetensorStore;
    use crate::tensor::HostTensor;
    use std::path::PathBuf;
    use std::sync::Arc;

    /// A store of NVFP4 experts with K = 64 (gate/up, H = 64) and FP8 row-scaled down
    /// projections with K = I = 128.
    fn store(experts: usize) -> (SafetensorStore, ExpertShape) {
        let shape = ExpertShape {
            hidden: 128,
            intermediate: 128,
        };
        let (h, i) = (shape.hidden, shape.intermediate);
        let mut buf = Vec::new();
        let mut entries = Vec::new();
        let mut seed = 7u64;
        let mut rand = |n: usize, buf: &mut Vec<u8>, scales: bool| {
            for _ in 0..n {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let b = (seed >> 33) as u8;
                // E4M3 scales in 0x30..0x3f (finite, around 1); codes any byte.
                buf.push(if scales {
                    0x30 | (b & 0x0f)
                } else {
                    b & 0x77 | (b & 0x80)
                });
            }
        };
        for e in 0..experts {
            for proj in ["gate_proj", "up_proj"] {
                let m = format!("e.{e}.{proj}");
                entries.push((format!("{m}.weight"), DType::U8, vec![i, h / 2], buf.len()));
                rand(i * h / 2, &mut buf, false);
                entries.push((
                    format!("{m}.weight_scale"),
                    DType::F8E4M3,
                    vec![i, h / 16],
                    buf.len(),
                ));
                rand(i * h / 16, &mut buf, true);
                entries.push((format!("{m}.weight_scale_2"), DType::F32, vec![], buf.len()));
                buf.extend_from_slice(&(0.01f32 * (e + 1) as f32).to_le_bytes());
            }
            let m = format!("e.{e}.down_proj");
            entries.push((format!("{m}.weight"), DType::F8E4M3, vec![h, i], buf.len()));
            rand(h * i, &mut buf, false);
            entries.push((
                format!("{m}.weight_scale"),
                DType::F32,
                vec![h, 1],
                buf.len(),
            ));
            for r in 0..h {
                buf.extend_from_slice(&(0.001f32 * (r + 1) as f32).to_le_bytes());
            }
        }
        let store =
            SafetensorStore::from_buffer(PathBuf::from("mem"), Arc::new(buf), entries).unwrap();
        (store, shape)
    }

    #[test]
    fn quantized_experts_equal_the_dequantized_weights_bit_for_bit() {
        let (st, shape) = store(3);
        let w = Weights::from(st);
        let set = quantized_expert_set(&w, "e.", 3, shape)
            .unwrap()
            .expect("quantized set");
        assert_eq!(set.layout.format, RowFormat::Nvfp4);
        assert_eq!(set.layout.down_format, RowFormat::Fp8B128);
        for e in 0..3 {
            for (m, proj) in [
                (ExpertMatrix::Gate, "gate_proj"),
                (ExpertMatrix::Up, "up_proj"),
                (ExpertMatrix::Down, "down_proj"),
            ] {
                let want: HostTensor = w.get(&format!("e.{e}.{proj}.weight")).unwrap();
                let want = want.to_f32().unwrap();
                let got = set.matrix_f32(e, m);
                assert_eq!(got.len(), want.len());
                for (a, b) in got.iter().zip(&want) {
                    assert_eq!(a.to_bits(), b.to_bits(), "expert {e} {proj}");
                }
            }
        }
    }

    #[test]
    fn float_experts_are_not_offered() {
        let buf = vec![0u8; 4 * 64 * 64];
        let st = SafetensorStore::from_buffer(
            PathBuf::from("mem"),
            Arc::new(buf),
            vec![("x.weight".into(), DType::F32, vec![64, 64], 0)],
        )
        .unwrap();
        assert!(Weights::from(st).quant_rows("x.weight").unwrap().is_none());
    }
}
