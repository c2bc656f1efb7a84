//! ggml block types: how a row of weights is stored in GGUF files.
//!
//! A row of `n` weights is `n / block` blocks stored back to back; every block holds its own
//! scale(s). Layouts (little-endian; `d` is an fp16 scale):
//! - `F32`, `F16`, `BF16`: one value per element.
//! - `Q8_0` (32 weights, 34 B): `d`, then 32 `i8`; value `q · d`.
//! - `Q2_0` (64 weights, 18 B): `d`, then 16 bytes of 2-bit codes; element `4b + j` is bits
//!   `2j..2j+1` of byte `b`; value `(code − 1) · d`.
//! - `IQ2_XS` (256, 74 B): `d`, 32 `u16` (low 9 bits: an entry of the 512×8 grid; high 7 bits:
//!   a sign pattern from `KSIGNS`), 8 bytes of 4-bit scales (one per 16 weights);
//!   value `d · (0.5 + s) · 0.25 · grid · sign`.
//! - `IQ3_XXS` (256, 98 B): `d`, 64 grid indices (256×4 grid), then 8 `u32`, one per 32
//!   weights: four 7-bit sign patterns and a 4-bit scale in the top bits;
//!   value `d · (0.5 + s) · 0.5 · grid · sign`.
//! - `IQ3_S` (256, 110 B): `d`, 64 low index bytes, 8 bytes of 9th index bits, 32 bytes of
//!   explicit sign bits (bit `i` of byte `b` is weight `8b + i`), 4 bytes of 4-bit scales (one
//!   per 32 weights); value `d · (1 + 2s) · grid · sign` over the 512×4 grid.
//!
//! The multiplication order of every formula above is the `gguf` package's, so the results are
//! bit-identical to its numpy dequantisation (tested against fixtures it wrote).

use super::iq_tables::{IQ2XS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
use anyhow::{bail, Result};
use half::{bf16, f16};
use std::fmt;

/// The ggml tensor types this engine reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q2_0,
    Iq2Xs,
    Iq3Xxs,
    Iq3S,
}

/// Names of all ggml type ids (for error messages about types this engine does not read).
fn ggml_type_name(id: u32) -> &'static str {
    match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        40 => "NVFP4",
        41 => "Q1_0",
        42 => "Q2_0",
        _ => "unknown",
    }
}

impl GgmlType {
    pub const ALL: [GgmlType; 8] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q2_0,
        GgmlType::Iq2Xs,
        GgmlType::Iq3Xxs,
        GgmlType::Iq3S,
    ];

    /// The type with ggml id `id`, or an error naming it and listing what is supported.
    pub fn from_id(id: u32) -> Result<GgmlType> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            30 => GgmlType::BF16,
            8 => GgmlType::Q8_0,
            42 => GgmlType::Q2_0,
            17 => GgmlType::Iq2Xs,
            18 => GgmlType::Iq3Xxs,
            21 => GgmlType::Iq3S,
            _ => bail!(
                "ggml type {} (id {id}) is not supported; supported types: {}",
                ggml_type_name(id),
                Self::ALL.map(|t| t.name()).join(", ")
            ),
        })
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::BF16 => 30,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_0 => 42,
            GgmlType::Iq2Xs => 17,
            GgmlType::Iq3Xxs => 18,
            GgmlType::Iq3S => 21,
        }
    }

    /// The name ggml and the `gguf` package use.
    pub fn name(self) -> &'static str {
        ggml_type_name(self.id())
    }

    /// The type named `name` (case-insensitive, as ggml spells it: `IQ3_S`, `Q8_0`, …).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Weights per block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q8_0 => 32,
            GgmlType::Q2_0 => 64,
            GgmlType::Iq2Xs | GgmlType::Iq3Xxs | GgmlType::Iq3S => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2_0 => 18,
            GgmlType::Iq2Xs => 74,
            GgmlType::Iq3Xxs => 98,
            GgmlType::Iq3S => 110,
        }
    }

    /// Bytes of a row of `n` weights, or an error when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        if !n.is_multiple_of(self.block_len()) {
            bail!(
                "a row of {n} weights is not a whole number of {} blocks ({} weights each)",
                self.name(),
                self.block_len()
            );
        }
        Ok(n / self.block_len() * self.block_bytes())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[inline]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantises whole blocks: `src` holds `out.len() / block_len` blocks of type `ty`.
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<()> {
    let (bl, bb) = (ty.block_len(), ty.block_bytes());
    if !out.len().is_multiple_of(bl) || src.len() != out.len() / bl * bb {
        bail!(
            "{ty}: {} bytes cannot hold {} weights (expected {} bytes for {} blocks of {bl})",
            src.len(),
            out.len(),
            out.len().div_ceil(bl) * bb,
            out.len().div_ceil(bl)
        );
    }
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        _ => {
            for (o, b) in out.chunks_exact_mut(bl).zip(src.chunks_exact(bb)) {
                dequantize_block(ty, b, o);
            }
        }
    }
    Ok(())
}

/// Dequantises one block of a block type (`Q8_0`, `Q2_0`, IQ types): the scalar reference.
pub fn dequantize_block(ty: GgmlType, b: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::Q8_0 => q8_0_block(b, out),
        GgmlType::Q2_0 => q2_0_block(b, out),
        GgmlType::Iq2Xs => iq2_xs_block(b, out),
        GgmlType::Iq3Xxs => iq3_xxs_block(b, out),
        GgmlType::Iq3S => iq3_s_block(b, out),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            dequantize(ty, b, out).expect("one element of a float type")
        }
    }
}

pub fn q8_0_block(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out[..32].iter_mut().zip(&b[2..34]) {
        *o = q as i8 as f32 * d;
    }
}

pub fn q2_0_block(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (byte_index, &q) in b[2..18].iter().enumerate() {
        for j in 0..4 {
            let code = ((q >> (2 * j)) & 3) as i32;
            out[4 * byte_index + j] = (code - 1) as f32 * d;
        }
    }
}

pub fn iq2_xs_block(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales = &b[66..74];
    for (g, o) in out[..256].chunks_exact_mut(8).enumerate() {
        let q = u16::from_le_bytes([b[2 + 2 * g], b[3 + 2 * g]]);
        let s = (scales[g / 4] >> (4 * ((g / 2) % 2))) & 0x0f;
        let db = d * (0.5 + s as f32) * 0.25;
        let grid = IQ2XS_GRID[(q & 511) as usize].to_le_bytes();
        let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
        for (j, &m) in grid.iter().enumerate() {
            out_set(o, j, db * m as f32, signs >> j & 1 != 0);
        }
    }
}

#[inline]
fn out_set(o: &mut [f32], j: usize, v: f32, negative: bool) {
    o[j] = if negative { -v } else { v };
}

pub fn iq3_xxs_block(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..66];
    for sub in 0..8 {
        let aux = u32::from_le_bytes(b[66 + 4 * sub..70 + 4 * sub].try_into().unwrap());
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for l in 0..4 {
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
            for half in 0..2 {
                let grid = IQ3XXS_GRID[qs[8 * sub + 2 * l + half] as usize].to_le_bytes();
                for (j, &m) in grid.iter().enumerate() {
                    let k = 4 * half + j;
                    out_set(
                        &mut out[32 * sub + 8 * l..],
                        k,
                        db * m as f32,
                        signs >> k & 1 != 0,
                    );
                }
            }
        }
    }
}

pub fn iq3_s_block(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let (qs, qh, signs, scales) = (&b[2..66], &b[66..74], &b[74..106], &b[106..110]);
    for (i, &q) in qs.iter().enumerate() {
        let index = q as usize | (((qh[i / 8] >> (i % 8)) & 1) as usize) << 8;
        let sub = i / 8; // 32 weights = 8 grid entries per scale
        let s = (scales[sub / 2] >> (4 * (sub % 2))) & 0x0f;
        let db = d * (1 + 2 * s as u32) as f32;
        let grid = IQ3S_GRID[index].to_le_bytes();
        for (j, &m) in grid.iter().enumerate() {
            let w = 4 * i + j;
            out_set(out, w, db * m as f32, (signs[w / 8] >> (w % 8)) & 1 != 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_unsupported_types_are_named() {
        let e = GgmlType::from_id(12).unwrap_err().to_string();
        assert!(
            e.contains("Q4_K") && e.contains("id 12") && e.contains("IQ3_S"),
            "{e}"
        );
        let e = GgmlType::from_id(999).unwrap_err().to_string();
        assert!(e.contains("unknown") && e.contains("999"), "{e}");
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()).unwrap(), t);
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
    }

    #[test]
    fn row_bytes_refuses_partial_blocks() {
        assert_eq!(GgmlType::Iq3S.row_bytes(512).unwrap(), 220);
        assert_eq!(GgmlType::Q2_0.row_bytes(640).unwrap(), 180);
        let e = GgmlType::Iq3S.row_bytes(100).unwrap_err().to_string();
        assert!(e.contains("IQ3_S") && e.contains("100"), "{e}");
    }
}
