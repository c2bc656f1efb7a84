//! NVFP4 weights repacked at upload for the decode matvec (kernels/quant_matvec.cu
//! `QF_NVFP4R`). The checkpoint's layout interleaves 4 scale bytes with 32 code bytes per 64
//! weights (36-byte blocks), so a warp reading consecutive blocks gets 16-byte pieces that
//! straddle scales and codes; a record gathers 16 blocks (1024 weights) as 64 scale bytes then
//! 512 code bytes, so a warp reads a record's codes as 32 consecutive aligned 16-byte loads and
//! its scales as 32 consecutive 2-byte loads. Same bytes per row, so rows, row slices and the
//! VRAM ledger are unchanged.

use rayon::prelude::*;

/// Weights per record.
pub const RECORD_WEIGHTS: usize = 1024;
/// Bytes per record: 64 E4M3 scales, then 512 bytes of E2M1 codes.
pub const RECORD_BYTES: usize = 576;
const BLOCK_BYTES: usize = 36;
const BLOCKS_PER_RECORD: usize = RECORD_WEIGHTS / 64;

/// Whether rows of `cols` weights can be stored as records (whole records only).
pub fn applies(cols: usize) -> bool {
    cols > 0 && cols.is_multiple_of(RECORD_WEIGHTS)
}

/// Whether NVFP4 matrices are stored as records: on unless `CAPY_NVFP4_RECORDS=0` (or
/// `false`). Measured on an H100 (bench/results/gpu-qwen3.8-27b-nvfp4-records-h100box.json):
/// the 27B NVFP4 decodes at 63.1 tok/s with records against 55.5 with the block layout (1.14x).
pub fn enabled_by_env() -> bool {
    !std::env::var("CAPY_NVFP4_RECORDS").is_ok_and(|v| v == "0" || v.eq_ignore_ascii_case("false"))
}

/// `blocks` (rows of 36-byte NVFP4 blocks, `cols` weights a row) as records.
pub fn to_records(blocks: &[u8], cols: usize) -> Vec<u8> {
    assert!(
        applies(cols),
        "NVFP4 records need a multiple of {RECORD_WEIGHTS} columns, found {cols}"
    );
    let mut out = vec![0u8; blocks.len()];
    out.par_chunks_mut(RECORD_BYTES)
        .zip(blocks.par_chunks(RECORD_BYTES))
        .for_each(|(rec, src)| {
            for b in 0..BLOCKS_PER_RECORD {
                let block = &src[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                rec[4 * b..4 * b + 4].copy_from_slice(&block[..4]);
                rec[64 + 32 * b..64 + 32 * (b + 1)].copy_from_slice(&block[4..]);
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::experts::format::RowFormat;

    /// The code of weight `i` in its byte: even weights in the low nibble.
    fn nibble(byte: u8, i: usize) -> u8 {
        if i.is_multiple_of(2) {
            byte & 15
        } else {
            byte >> 4
        }
    }

    /// Weight `k` of a record row as (E4M3 scale byte, E2M1 code), read the way the kernels'
    /// `qdecode8<QF_NVFP4R>` reads it.
    fn record_weight(row: &[u8], k: usize) -> (u8, u8) {
        let rec = &row[(k / RECORD_WEIGHTS) * RECORD_BYTES..];
        let i = k % RECORD_WEIGHTS;
        (rec[i / 16], nibble(rec[64 + i / 2], i))
    }

    /// The same from the checkpoint's 36-byte blocks.
    fn block_weight(row: &[u8], k: usize) -> (u8, u8) {
        let block = &row[(k / 64) * BLOCK_BYTES..];
        let i = k % 64;
        (block[i / 16], nibble(block[4 + i / 2], i))
    }

    #[test]
    fn records_hold_every_weight_and_scale_of_the_blocks() {
        let (rows, cols) = (3, 2048);
        let blocks =
            crate::backend::cpu::experts::random_blocks(RowFormat::Nvfp4, rows * cols / 64, 11);
        let records = to_records(&blocks, cols);
        assert_eq!(records.len(), blocks.len());
        let row_bytes = cols / 64 * BLOCK_BYTES;
        for r in 0..rows {
            let (b, rec) = (&blocks[r * row_bytes..], &records[r * row_bytes..]);
            for k in 0..cols {
                assert_eq!(
                    record_weight(rec, k),
                    block_weight(b, k),
                    "row {r}, weight {k}"
                );
            }
        }
    }

    #[test]
    fn only_whole_records_apply() {
        assert!(applies(5120) && applies(17408) && applies(6144));
        assert!(!applies(2560) && !applies(640) && !applies(0));
    }
}
