//! Tensor parallelism on the CPU backend: the whole design (sharding plan, layer shards loaded
//! by the model's own loaders, two host-mailbox all-reduces per layer, vocabulary-split head)
//! with N rank threads, held to the plain model (TP=1) on the tiny `qwen3_5_text` fixtures:
//! logits within 1e-4 and the same greedy tokens (which are also transformers' tokens).

use capy_engine::backend::cpu::CpuBackend;
use capy_engine::checkpoint::Checkpoint;
use capy_engine::model::{self, BatchItem, CausalLm, LogitsWanted};
use capy_engine::parallel;
use serde::Deserialize;
use std::path::Path;
use std::time::Duration;

const TOLERANCE: f32 = 1e-4;

#[derive(Deserialize)]
struct Expected {
    prompts: Vec<ExpectedPrompt>,
}

#[derive(Deserialize)]
struct ExpectedPrompt {
    token_ids: Vec<u32>,
    greedy_new_tokens: Vec<u32>,
}

fn open(name: &str) -> (Checkpoint, Expected) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/qwen3_5_text")
        .join(name);
    let expected: Expected =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    (Checkpoint::open(&dir).unwrap(), expected)
}

fn tp(ck: &Checkpoint, ranks: usize) -> Box<dyn CausalLm> {
    parallel::load(
        (0..ranks).map(|_| CpuBackend::new()).collect(),
        ck,
        Duration::from_secs(60),
    )
    .unwrap()
}

fn all_logits(m: &mut dyn CausalLm, ids: &[u32]) -> Vec<f32> {
    let seq = m.new_sequence();
    let out = m
        .forward(&[BatchItem {
            seq,
            tokens: ids,
            logits: LogitsWanted::All,
        }])
        .unwrap();
    m.drop_sequence(seq);
    out.into_iter().next().unwrap()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Prefill then token-by-token greedy decode (the decode path uses the recurrent delta rule).
fn greedy(m: &mut dyn CausalLm, ids: &[u32], n: usize) -> Vec<u32> {
    let seq = m.new_sequence();
    let mut logits = m
        .forward(&[BatchItem {
            seq,
            tokens: ids,
            logits: LogitsWanted::Last,
        }])
        .unwrap()
        .remove(0);
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        logits = m
            .forward(&[BatchItem {
                seq,
                tokens: &[t],
                logits: LogitsWanted::Last,
            }])
            .unwrap()
            .remove(0);
    }
    m.drop_sequence(seq);
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check(name: &str, ranks: usize) {
    let (ck, expected) = open(name);
    let mut one = model::load(CpuBackend::new(), &ck).unwrap();
    let mut split = tp(&ck, ranks);
    assert!(split.info().backend.contains("tensor parallel"));
    for p in &expected.prompts {
        let d = max_diff(
            &all_logits(one.as_mut(), &p.token_ids),
            &all_logits(split.as_mut(), &p.token_ids),
        );
        assert!(d <= TOLERANCE, "{name} TP={ranks}: logits differ by {d}");
        let n = p.greedy_new_tokens.len();
        let g1 = greedy(one.as_mut(), &p.token_ids, n);
        let g2 = greedy(split.as_mut(), &p.token_ids, n);
        assert_eq!(g2, g1, "{name} TP={ranks}: greedy tokens differ from TP=1");
        assert_eq!(
            g2, p.greedy_new_tokens,
            "{name}: greedy tokens differ from transformers"
        );
    }
}

#[test]
fn tp2_matches_tp1_gqa4x2_gdn2x4() {
    check("gqa4x2_gdn2x4_rot25", 2);
}

#[test]
fn tp2_matches_tp1_one_kv_head_replicated() {
    // 1 KV head and 8 layers: both ranks keep the KV head their query heads read.
    check("gqa4x1_gdn2x2_rot50_8layers", 2);
}

#[test]
fn tp2_matches_tp1_tied_head() {
    check("mha2x2_tied_layer_types", 2);
}

#[test]
fn tp3_matches_tp1_three_heads() {
    // 3 attention heads and 3 GDN value heads over 3 ranks; vocabulary split 3 ways.
    check("multimodal_layout_gqa3x1_gdn1x3", 3);
}

#[test]
fn tp2_refuses_three_heads_with_the_numbers() {
    let (ck, _) = open("multimodal_layout_gqa3x1_gdn1x3");
    let err = match parallel::load(
        vec![CpuBackend::new(), CpuBackend::new()],
        &ck,
        Duration::from_secs(1),
    ) {
        Ok(_) => panic!("a 2-way split of 3 heads was accepted"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("divisible by 2") && err.contains("has 3"),
        "{err}"
    );
}

/// A batch of two sequences of unequal lengths, chunked prefill, and a batch mixing decode
/// and prefill: the same logits as TP=1 run the same way.
#[test]
fn tp2_batches_and_chunked_prefill_match_tp1() {
    let (ck, expected) = open("gqa4x2_gdn2x4_rot25");
    let mut one = model::load(CpuBackend::new(), &ck).unwrap();
    let mut split = tp(&ck, 2);
    let a = &expected.prompts[0].token_ids;
    let b = &expected.prompts[expected.prompts.len() - 1].token_ids;
    let run = |m: &mut dyn CausalLm| -> Vec<Vec<f32>> {
        let (sa, sb) = (m.new_sequence(), m.new_sequence());
        let half = a.len() / 2;
        let mut out = m
            .forward(&[
                BatchItem {
                    seq: sa,
                    tokens: &a[..half],
                    logits: LogitsWanted::None,
                },
                BatchItem {
                    seq: sb,
                    tokens: b,
                    logits: LogitsWanted::Last,
                },
            ])
            .unwrap();
        out.extend(
            m.forward(&[
                BatchItem {
                    seq: sb,
                    tokens: &[7],
                    logits: LogitsWanted::Last,
                },
                BatchItem {
                    seq: sa,
                    tokens: &a[half..],
                    logits: LogitsWanted::All,
                },
            ])
            .unwrap(),
        );
        out
    };
    let (r1, r2) = (run(one.as_mut()), run(split.as_mut()));
    assert_eq!(r1.len(), r2.len());
    for (x, y) in r1.iter().zip(&r2) {
        assert!(max_diff(x, y) <= TOLERANCE);
    }
    // Snapshot and restore keep every rank's state.
    let seq = split.new_sequence();
    split
        .forward(&[BatchItem {
            seq,
            tokens: a,
            logits: LogitsWanted::None,
        }])
        .unwrap();
    let snap = split.snapshot(seq).unwrap();
    let next = |m: &mut dyn CausalLm| {
        m.forward(&[BatchItem {
            seq,
            tokens: &[3],
            logits: LogitsWanted::Last,
        }])
        .unwrap()
        .remove(0)
    };
    let host = split.export_state(seq).unwrap();
    let first = next(split.as_mut());
    split.restore(seq, &snap).unwrap();
    assert_eq!(next(split.as_mut()), first);
    // The host copy (prefix cache) holds every rank's part and loads back.
    split.import_state(seq, &host).unwrap();
    assert_eq!(split.sequence_len(seq), Some(a.len()));
    assert_eq!(next(split.as_mut()), first);
}
