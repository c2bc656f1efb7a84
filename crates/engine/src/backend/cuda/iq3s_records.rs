//! IQ3_S weights repacked at upload for the decode matvec (kernels/quant_matvec.cu
//! `QF_IQ3SR`). GGUF's 110-byte block keeps each field of its 256 weights in its own run (f16 d,
//! qs[64] the low 8 bits of the grid indices, qh[8] their 9th bits, signs[32], scales[4] a
//! nibble per 32 weights), so a lane decoding a block gathers from five places at a 110-byte
//! stride from its neighbours, and the old kernel staged blocks through shared memory first.
//!
//! A record holds 1024 weights (4 blocks, 440 bytes: the same bytes per row, so rows, row
//! slices and the VRAM ledger are unchanged) as 16 slots of 64 weights, slot `i` for lane `i`
//! of a half-warp. Its 432-byte body, 16-byte aligned, is four planes, each read by the 16
//! lanes as one run of consecutive loads:
//!
//! | body offset | bytes a slot | what |
//! |---|---|---|
//! | `16 i`       | 16 | the slot's 16 grid indices packed as 9-bit fields (index `k` at bit `9k`), bits 0..128 |
//! | `256 + 8 i`  | 8  | its 64 signs: weight `n` of index `k` at bit `8n + 7 − k % 8` of word `k / 8` |
//! | `384 + 2 i`  | 2  | bits 128..144 of the packed indices |
//! | `416 + i`    | 1  | its two sub-block scales (the block's `scales[i % 4]`) |
//!
//! The 4 blocks' f16 `d` (8 bytes) go before the body when the record starts 8 bytes past a
//! 16-byte boundary, after it otherwise: a record is 8 mod 16 bytes long, so its neighbours
//! alternate and every body stays aligned whatever the row's start. The kernels tell the two
//! cases apart by the record's address, so a matrix must start on 16 bytes (device allocations
//! do).
//!
//! The sign layout makes a sign mask one `prmt` in sign-replicate mode (after a shift by
//! `k % 8`), and the packed indices make a grid offset a shift and an and: see the kernel.

use rayon::prelude::*;

/// Weights per record.
pub const RECORD_WEIGHTS: usize = 1024;
/// Bytes per record: 4 blocks of 110.
pub const RECORD_BYTES: usize = 440;
const BODY_BYTES: usize = 432;
const BLOCK_BYTES: usize = 110;
/// Body offsets of the sign, index-top and scale planes (kernels/quant_matvec.cu `IQ3SR_*`).
const SIGNS: usize = 256;
const HIGH: usize = 384;
const SCALES: usize = 416;

/// Whether rows of `cols` weights can be stored as records (whole records only).
pub fn applies(cols: usize) -> bool {
    cols > 0 && cols.is_multiple_of(RECORD_WEIGHTS)
}

/// Whether IQ3_S matrices are stored as records on the fast path: on unless
/// `CAPY_IQ3S_RECORDS=0` (or `false`), which keeps the block layout and its kernel
/// (`quant_matvec_iq3s_q8`) for a same-run comparison.
pub fn enabled_by_env() -> bool {
    !std::env::var("CAPY_IQ3S_RECORDS").is_ok_and(|v| v == "0" || v.eq_ignore_ascii_case("false"))
}

/// Where the body and the `d` values of the record at byte `offset` of a 16-byte aligned
/// matrix start, relative to the record.
fn body_and_d(offset: usize) -> (usize, usize) {
    if offset % 16 == 8 {
        (8, 0)
    } else {
        (0, BODY_BYTES)
    }
}

/// `blocks` (rows of 110-byte IQ3_S blocks, `cols` weights a row, the whole matrix from its
/// first byte) as records.
pub fn to_records(blocks: &[u8], cols: usize) -> Vec<u8> {
    assert!(
        applies(cols),
        "IQ3_S records need a multiple of {RECORD_WEIGHTS} columns, found {cols}"
    );
    assert!(
        blocks.len().is_multiple_of(RECORD_BYTES),
        "IQ3_S records: {} bytes are not whole records",
        blocks.len()
    );
    let mut out = vec![0u8; blocks.len()];
    out.par_chunks_mut(RECORD_BYTES)
        .zip(blocks.par_chunks(RECORD_BYTES))
        .enumerate()
        .for_each(|(n, (rec, src))| {
            let (body_at, d_at) = body_and_d(n * RECORD_BYTES);
            for (b, block) in src.chunks_exact(BLOCK_BYTES).enumerate() {
                rec[d_at + 2 * b..d_at + 2 * b + 2].copy_from_slice(&block[..2]);
                let (qs, qh) = (&block[2..66], &block[66..74]);
                let (signs, scales) = (&block[74..106], &block[106..110]);
                let body = &mut rec[body_at..body_at + BODY_BYTES];
                for (u, &scale) in scales.iter().enumerate() {
                    let slot = 4 * b + u;
                    // 16 indices of 9 bits: 144 bits, little-endian.
                    let mut packed = [0u8; 18];
                    for k in 0..16 {
                        let i = 16 * u + k;
                        let index = qs[i] as u32 | (((qh[i / 8] >> (i % 8)) & 1) as u32) << 8;
                        let bit = 9 * k;
                        let v = index << (bit % 8);
                        packed[bit / 8] |= v as u8;
                        packed[bit / 8 + 1] |= (v >> 8) as u8;
                    }
                    body[16 * slot..16 * slot + 16].copy_from_slice(&packed[..16]);
                    body[HIGH + 2 * slot..HIGH + 2 * slot + 2].copy_from_slice(&packed[16..]);
                    let mut words = [0u32; 2];
                    for k in 0..16 {
                        for n in 0..4 {
                            let w = 64 * u + 4 * k + n;
                            let neg = (signs[w / 8] >> (w % 8)) & 1;
                            words[k / 8] |= (neg as u32) << (8 * n + 7 - k % 8);
                        }
                    }
                    body[SIGNS + 8 * slot..SIGNS + 8 * slot + 4]
                        .copy_from_slice(&words[0].to_le_bytes());
                    body[SIGNS + 8 * slot + 4..SIGNS + 8 * slot + 8]
                        .copy_from_slice(&words[1].to_le_bytes());
                    body[SCALES + slot] = scale;
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::experts::format::RowFormat;
    use crate::backend::cpu::experts::fused::{self, Act, ActSpec, Kind, MathPath};
    use crate::backend::cpu::simd::Isa;
    use crate::quant::iq_tables::IQ3S_GRID;
    use crate::quant::GgmlType;

    const IQ3S: RowFormat = RowFormat::Ggml(GgmlType::Iq3S);
    const SLOTS: usize = 16;

    /// Byte `byte` of a slot's packed grid indices, which the kernel reads as 16 bytes, then 2.
    fn packed_byte(body: &[u8], slot: usize, byte: usize) -> u8 {
        if byte < 16 {
            body[16 * slot + byte]
        } else {
            body[HIGH + 2 * slot + byte - 16]
        }
    }

    /// One slot of a record, decoded: what the kernel's lane reads.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Slot {
        /// The 16 grid indices (9 bits).
        indices: [u16; 16],
        /// Sign of weight `4k + n` at bit `8n + 7 − k % 8` of word `k / 8`.
        signs: [u32; 2],
        /// Sub-block scales: low nibble the first 32 weights, high nibble the second.
        scales: u8,
        /// The block's `d`, as f16 bits.
        d: u16,
    }

    impl Slot {
        /// Whether weight `w` (0..64) of the slot is negative.
        fn negative(&self, w: usize) -> bool {
            let (k, n) = (w / 4, w % 4);
            (self.signs[k / 8] >> (8 * n + 7 - k % 8)) & 1 != 0
        }
    }

    /// Slot `slot` of the record at byte `offset` of the matrix (`rec` its 440 bytes).
    fn read_slot(rec: &[u8], offset: usize, slot: usize) -> Slot {
        assert!(slot < SLOTS);
        let (body_at, d_at) = body_and_d(offset);
        let body = &rec[body_at..body_at + BODY_BYTES];
        let mut indices = [0u16; 16];
        for (k, index) in indices.iter_mut().enumerate() {
            let bit = 9 * k;
            let two = packed_byte(body, slot, bit / 8) as u32
                | (packed_byte(body, slot, bit / 8 + 1) as u32) << 8;
            *index = ((two >> (bit % 8)) & 511) as u16;
        }
        let word = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4 bytes"));
        Slot {
            indices,
            signs: [word(SIGNS + 8 * slot), word(SIGNS + 8 * slot + 4)],
            scales: body[SCALES + slot],
            d: u16::from_le_bytes([rec[d_at + 2 * (slot / 4)], rec[d_at + 2 * (slot / 4) + 1]]),
        }
    }

    /// The GGUF blocks back from records (the inverse of `to_records`).
    fn from_records(records: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; records.len()];
        for (n, (rec, dst)) in records
            .chunks_exact(RECORD_BYTES)
            .zip(out.chunks_exact_mut(RECORD_BYTES))
            .enumerate()
        {
            for (b, block) in dst.chunks_exact_mut(BLOCK_BYTES).enumerate() {
                for u in 0..4 {
                    let s = read_slot(rec, n * RECORD_BYTES, 4 * b + u);
                    block[..2].copy_from_slice(&s.d.to_le_bytes());
                    for (k, &index) in s.indices.iter().enumerate() {
                        let i = 16 * u + k;
                        block[2 + i] = index as u8;
                        block[66 + i / 8] |= ((index >> 8) as u8) << (i % 8);
                    }
                    for w in 0..64 {
                        let bw = 64 * u + w;
                        block[74 + bw / 8] |= (s.negative(w) as u8) << (bw % 8);
                    }
                    block[106 + u] = s.scales;
                }
            }
        }
        out
    }

    /// Sub-block `sb` (0 or 1) of a slot against 32 int8 activations: the integer dot product
    /// of the signed grid values, as the kernel forms it (an odd grid byte g xor 0xFE is −g).
    fn slot_isum(s: &Slot, sb: usize, x: &[i8]) -> i32 {
        let mut isum = 0i32;
        for k in 8 * sb..8 * sb + 8 {
            let k8 = k % 8;
            let word = s.signs[k / 8] << k8;
            let grid = IQ3S_GRID[s.indices[k] as usize];
            for n in 0..4 {
                let mask = if (word >> (8 * n + 7)) & 1 != 0 {
                    0xFEu8
                } else {
                    0
                };
                let w = ((grid >> (8 * n)) as u8 ^ mask) as i8;
                isum += w as i32 * x[4 * (k - 8 * sb) + n] as i32;
            }
        }
        isum
    }

    /// A row of records times int8 activations `xq` (natural order) with a scale per 32
    /// values `xs`, in the kernel's arithmetic: per slot the two integer sub-block sums times
    /// `2 · scale + 1`, each times its activation scale, the pair times `d`.
    fn records_dot(row: &[u8], row_offset: usize, xq: &[i8], xs: &[f32]) -> f32 {
        let mut acc = 0f32;
        for (r, rec) in row.chunks_exact(RECORD_BYTES).enumerate() {
            for slot in 0..SLOTS {
                let s = read_slot(rec, row_offset + r * RECORD_BYTES, slot);
                let c = 32 * r + 2 * slot;
                let d = half::f16::from_bits(s.d).to_f32();
                let mut p = 0f32;
                for sb in 0..2 {
                    let scale = 2 * ((s.scales >> (4 * sb)) & 15) as i32 + 1;
                    let isum = slot_isum(&s, sb, &xq[32 * (c + sb)..32 * (c + sb + 1)]);
                    p = ((isum * scale) as f32).mul_add(xs[c + sb], p);
                }
                acc = d.mul_add(p, acc);
            }
        }
        acc
    }

    #[test]
    fn records_round_trip_to_the_blocks() {
        for (rows, cols) in [(3, 1024), (5, 5120), (2, 6144), (1, 17408)] {
            let blocks =
                crate::backend::cpu::experts::random_blocks(IQ3S, rows * cols / 256, cols as u64);
            let records = to_records(&blocks, cols);
            assert_eq!(records.len(), blocks.len());
            assert_ne!(records, blocks);
            assert_eq!(from_records(&records), blocks, "{rows}x{cols}");
        }
    }

    #[test]
    fn every_record_body_is_16_byte_aligned() {
        // 5120 columns: rows of 2200 bytes, so odd rows start 8 bytes past a boundary.
        for n in 0..7 {
            let (body, d) = body_and_d(n * RECORD_BYTES);
            assert_eq!((n * RECORD_BYTES + body) % 16, 0, "record {n}");
            assert!(
                d + 8 <= body || d >= body + BODY_BYTES,
                "record {n}: d inside the body"
            );
        }
    }

    /// The kernel's arithmetic on the records (int8 activations, an integer dot product per
    /// sub-block, the scales applied after) equals the CPU's scalar q8 reference
    /// (`fused::fast_dot_scalar`) on the GGUF blocks: the integer sums exactly, the dot up to
    /// the order of its f32 additions.
    #[test]
    fn records_dot_equals_the_scalar_q8_reference() {
        let (rows, cols) = (7, 5120);
        let blocks = crate::backend::cpu::experts::random_blocks(IQ3S, rows * cols / 256, 3);
        let records = to_records(&blocks, cols);
        let row_bytes = cols / 256 * BLOCK_BYTES;
        let spec = ActSpec {
            fmt: IQ3S,
            kind: Kind::Fast,
            k: cols,
            isa: Isa::Scalar,
            iq3s_shuffle: false,
            iq3s_gather: false,
        };
        assert_eq!(
            ActSpec::new(Isa::Scalar, MathPath::Fast, IQ3S, cols).kind,
            Kind::Fast
        );
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let x: Vec<f32> = (0..cols)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        let (mut xq, mut xs, mut sums) = (
            vec![0i8; cols],
            vec![0f32; cols / 32],
            vec![0f32; cols / 32],
        );
        fused::prepare(&spec, &x, &mut [], &mut xq, &mut xs, &mut sums);
        let act = Act {
            f: &[],
            q: &xq,
            s: &xs,
            sums: &sums,
        };
        for r in 0..rows {
            let (block_row, rec_row) = (
                &blocks[r * row_bytes..(r + 1) * row_bytes],
                &records[r * row_bytes..(r + 1) * row_bytes],
            );
            // Every sub-block: the same integer sum, scale and d.
            let mut magnitude = 0f32;
            for (b, block) in block_row.chunks_exact(BLOCK_BYTES).enumerate() {
                let d = half::f16::from_bits(u16::from_le_bytes([block[0], block[1]])).to_f32();
                for sub in 0..8 {
                    let (rec, slot) = (b / 4, 4 * (b % 4) + sub / 2);
                    let s = read_slot(
                        &rec_row[rec * RECORD_BYTES..(rec + 1) * RECORD_BYTES],
                        r * row_bytes + rec * RECORD_BYTES,
                        slot,
                    );
                    let c = 8 * b + sub;
                    let got = slot_isum(&s, sub % 2, &xq[32 * c..32 * c + 32]);
                    let mut want = 0i32;
                    for e in 0..8 {
                        let i = 8 * sub + e;
                        let index =
                            block[2 + i] as usize | ((((block[66 + sub] >> e) & 1) as usize) << 8);
                        for (j, &m) in IQ3S_GRID[index].to_le_bytes().iter().enumerate() {
                            let w = 4 * i + j;
                            let neg = (block[74 + w / 8] >> (w % 8)) & 1 != 0;
                            let v = if neg { -(m as i32) } else { m as i32 };
                            want += v * xq[256 * b + w] as i32;
                        }
                    }
                    assert_eq!(got, want, "row {r}, block {b}, sub-block {sub}");
                    assert_eq!(
                        (s.scales >> (4 * (sub % 2))) & 15,
                        (block[106 + sub / 2] >> (4 * (sub % 2))) & 15
                    );
                    assert_eq!(s.d.to_le_bytes(), [block[0], block[1]]);
                    let scale = (1 + 2 * ((s.scales >> (4 * (sub % 2))) & 15) as i32) as f32;
                    magnitude += (d * scale * xs[c] * want as f32).abs();
                }
            }
            let got = records_dot(rec_row, r * row_bytes, &xq, &xs);
            let want = fused::fast_dot_scalar(&spec, block_row, &act);
            assert!(
                (got - want).abs() <= 1e-5 * magnitude,
                "row {r}: records {got} vs scalar q8 reference {want} (Σ|terms| {magnitude})"
            );
        }
    }

    #[test]
    fn only_whole_records_apply() {
        assert!(applies(5120) && applies(17408) && applies(6144) && applies(1024));
        assert!(!applies(2560) && !applies(256) && !applies(0));
    }
}
