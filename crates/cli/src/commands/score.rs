//! `capy-flash score`: per-position log-probabilities of a token sequence, optionally every
//! position's full logits as a NumPy `.npy` file.

use super::model_arg::{open_model, ModelArg};
use anyhow::{bail, Context, Result};
use capy_engine::model::{BatchItem, LogitsWanted};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArg,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',', conflicts_with = "text")]
    pub token_ids: Option<Vec<u32>>,
    /// Text to tokenize with the checkpoint's tokenizer.
    #[arg(long)]
    pub text: Option<String>,
    /// Write every position's logits as float32 [tokens, vocab] to this .npy file.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    if a.token_ids.is_none() && a.text.is_none() {
        bail!("give --token-ids 1,2,3 or --text TEXT");
    }
    let loaded = open_model(&a.model)?;
    let ids = match (&a.token_ids, &a.text) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => loaded
            .tokenizer
            .as_ref()
            .with_context(|| {
                format!(
                    "--text needs {}/tokenizer.json; give --token-ids instead",
                    loaded.dir.display()
                )
            })?
            .encode(text, false)?,
        (None, None) => unreachable!("checked above"),
    };
    if ids.is_empty() {
        bail!("nothing to score: the token list is empty");
    }
    let mut lm = loaded.model;
    let vocab = lm.info().vocab_size;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!(
            "token id {bad} is out of range: the model's vocabulary has {vocab} ids (0..{vocab})"
        );
    }
    let seq = lm.new_sequence();
    let logits = lm
        .forward(&[BatchItem {
            seq,
            tokens: &ids,
            logits: LogitsWanted::All,
        }])?
        .remove(0);
    let mut positions = Vec::with_capacity(ids.len());
    for (i, row) in logits.chunks_exact(vocab).enumerate() {
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let lse = max
            + row
                .iter()
                .map(|v| ((v - max) as f64).exp())
                .sum::<f64>()
                .ln() as f32;
        let argmax = row
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |acc, (j, &v)| if v > acc.1 { (j, v) } else { acc },
            )
            .0;
        let next = ids.get(i + 1).copied();
        positions.push(serde_json::json!({
            "position": i,
            "token_id": ids[i],
            "next_token_id": next,
            "next_token_logprob": next.map(|t| row[t as usize] - lse),
            "argmax": argmax,
            "argmax_logprob": row[argmax] - lse,
        }));
    }
    if let Some(path) = &a.logits_out {
        write_npy_f32(path, &[ids.len(), vocab], &logits)?;
    }
    let out =
        serde_json::json!({ "tokens": ids.len(), "vocab_size": vocab, "positions": positions });
    let mut stdout = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut stdout, &out)?;
    writeln!(stdout)?;
    Ok(())
}

/// Writes a little-endian float32 C-order `.npy` (format version 1.0).
pub fn write_npy_f32(path: &std::path::Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_str = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_str}, }}");
    // Pad so that magic + version + length + header is a multiple of 64 bytes, ending in '\n'.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}
