//! The `qwen3_5_text` fixtures (tiny transformers checkpoints with reference logits and greedy
//! tokens, see `qwen3_5_text_fixtures.rs`) on the GPU with exact math: full prefill, chunked
//! prefill (both attention and linear paths) and token-by-token decode give the reference
//! logits within 1e-3 and the reference greedy tokens. The fast path is measured beside it.
//! Without a CUDA driver the test prints why it is skipped and passes.
#![cfg(feature = "cuda")]

use capy_engine::backend::cuda::CudaBackend;
use capy_engine::checkpoint::Checkpoint;
use capy_engine::model::{self, BatchItem, CausalLm, LogitsWanted};
use serde::Deserialize;
use std::path::{Path, PathBuf};

const TOLERANCE: f32 = 1e-3;

#[derive(Deserialize)]
struct Expected {
    fixture: String,
    vocab_size: usize,
    prompts: Vec<ExpectedPrompt>,
}

#[derive(Deserialize)]
struct ExpectedPrompt {
    token_ids: Vec<u32>,
    logits_file: String,
    greedy_new_tokens: Vec<u32>,
}

fn read_npy_f32(path: &Path) -> Vec<f32> {
    let bytes =
        std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let (len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&bytes[start..start + len]).unwrap();
    assert!(
        header.contains("'<f4'") && header.contains("False"),
        "{}: expected C-order float32",
        path.display()
    );
    bytes[start + len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn fixture_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_5_text");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("expected.json").exists())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no fixtures under {}", root.display());
    dirs
}

fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if g.is_finite() {
                (g - w).abs()
            } else {
                f32::INFINITY
            }
        })
        .fold(0.0, f32::max)
}

fn argmax(l: &[f32]) -> u32 {
    l.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0 as u32
}

fn run(m: &mut dyn CausalLm, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let seq = m.new_sequence();
    let mut out = Vec::new();
    for part in tokens.chunks(chunk) {
        out.extend(
            m.forward(&[BatchItem {
                seq,
                tokens: part,
                logits: LogitsWanted::All,
            }])
            .unwrap()
            .remove(0),
        );
    }
    m.drop_sequence(seq);
    out
}

/// Greedy tokens and, per step, the gap between the top two logits.
fn greedy(m: &mut dyn CausalLm, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let seq = m.new_sequence();
    let mut l = m
        .forward(&[BatchItem {
            seq,
            tokens: prompt,
            logits: LogitsWanted::Last,
        }])
        .unwrap()
        .remove(0);
    let (mut out, mut gaps) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = argmax(&l);
        let second = l
            .iter()
            .enumerate()
            .filter(|(i, _)| *i as u32 != t)
            .map(|(_, v)| *v)
            .fold(f32::NEG_INFINITY, f32::max);
        gaps.push(l[t as usize] - second);
        out.push(t);
        l = m
            .forward(&[BatchItem {
                seq,
                tokens: &[t],
                logits: LogitsWanted::Last,
            }])
            .unwrap()
            .remove(0);
    }
    m.drop_sequence(seq);
    (out, gaps)
}

#[test]
fn fixtures_on_the_gpu_match_reference() {
    if let Err(e) = CudaBackend::with_exact_math(0, None, true) {
        capy_engine::backend::cuda::no_device_for_test(&format!("{e:#}"));
        return;
    }
    for dir in fixture_dirs() {
        let e: Expected =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        let mut exact =
            model::load(CudaBackend::with_exact_math(0, None, true).unwrap(), &ck).unwrap();
        let mut fast =
            model::load(CudaBackend::with_exact_math(0, None, false).unwrap(), &ck).unwrap();
        for (i, p) in e.prompts.iter().enumerate() {
            let want = read_npy_f32(&dir.join(&p.logits_file));
            assert_eq!(want.len(), p.token_ids.len() * e.vocab_size);
            // Whole prompt (cuBLAS paths once ≥ 16 tokens), chunks of 7 (matvec + split-KV
            // attention), one token at a time (decode kernels).
            for chunk in [usize::MAX, 7, 1] {
                let worst = max_diff(
                    &run(exact.as_mut(), &p.token_ids, chunk.min(p.token_ids.len())),
                    &want,
                );
                println!(
                    "{} prompt {i} chunk {chunk}: exact max |Δ| {worst:.3e}",
                    e.fixture
                );
                assert!(
                    worst <= TOLERANCE,
                    "{} prompt {i} chunk {chunk}: max |Δ| {worst:e} exceeds {TOLERANCE:e}",
                    e.fixture
                );
            }
            let (tokens, gaps) = greedy(exact.as_mut(), &p.token_ids, p.greedy_new_tokens.len());
            assert_eq!(
                tokens, p.greedy_new_tokens,
                "{} prompt {i}: greedy tokens differ from transformers",
                e.fixture
            );
            // The same through the greedy pass: the tokens picked on the device.
            let picked = model::greedy_continuations(
                exact.as_mut(),
                std::slice::from_ref(&p.token_ids),
                p.greedy_new_tokens.len(),
            )
            .unwrap();
            assert_eq!(
                picked[0], p.greedy_new_tokens,
                "{} prompt {i}: tokens picked on the device differ from transformers",
                e.fixture
            );
            let worst_fast = max_diff(&run(fast.as_mut(), &p.token_ids, p.token_ids.len()), &want);
            let (fast_tokens, _) = greedy(fast.as_mut(), &p.token_ids, p.greedy_new_tokens.len());
            let agree = fast_tokens
                .iter()
                .zip(&p.greedy_new_tokens)
                .take_while(|(a, b)| a == b)
                .count();
            // The fast path must follow the reference for as long as every exact top-1/top-2 gap
            // is decisive: wider than twice the largest deviation the fast path showed.
            let decisive = gaps.iter().take_while(|g| **g > 2.0 * worst_fast).count();
            println!(
                "{} prompt {i}: fast path max |Δ| {worst_fast:.3e}, greedy agrees for {agree}/{} tokens ({decisive} decisive)",
                e.fixture,
                p.greedy_new_tokens.len()
            );
            assert!(
                agree >= decisive,
                "{} prompt {i}: fast greedy leaves the reference after {agree} tokens; gaps were decisive for {decisive}",
                e.fixture
            );
            // A gross bound that catches a broken fast path (these logits are of scale ~1).
            assert!(
                worst_fast < 0.5,
                "{} prompt {i}: fast path deviates by {worst_fast}",
                e.fixture
            );
        }
    }
}
