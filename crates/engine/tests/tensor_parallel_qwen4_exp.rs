//! Tensor parallelism of Flash-Next (`qwen4_exp_text`) on the CPU backend, N rank threads, on
//! every tiny Flash-Next fixture: logits within 1e-4 of the plain model (TP=1) and within the
//! fixture bound (1e-3) of transformers' logits, through full prefill, chunked prefill and
//! token-by-token decode, and transformers' greedy tokens. TP=2 splits heads, GDN heads, the
//! shared expert, experts and vocabulary; TP=4 also replicates the 2 KV heads and leaves one
//! GDN key head per two ranks; TP=3 is refused (4 heads).

use capy_engine::backend::cpu::CpuBackend;
use capy_engine::checkpoint::Checkpoint;
use capy_engine::model::qwen4_exp_text::Qwen4ExpText;
use capy_engine::model::{BatchItem, CausalLm, LogitsWanted, SeqId};
use capy_engine::parallel;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

const TP_TOLERANCE: f32 = 1e-4;
/// The bound `qwen4_exp_text_fixtures.rs` holds the plain model to against transformers.
const REFERENCE_TOLERANCE: f32 = 1e-3;
const FIXTURES: [&str; 2] = ["fused", "per_expert"];

fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/qwen4_exp_text")
        .join(name)
}

struct Fixture {
    ck: Checkpoint,
    prompts: Vec<Vec<u32>>,
    greedy: Vec<Vec<u32>>,
    /// transformers' logits of every position, per prompt.
    logits: Vec<Vec<f32>>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn fixture(name: &str) -> Fixture {
    let d = dir(name);
    let e: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("expected.json")).unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = e["prompts"].as_array().unwrap().iter().map(ids).collect();
    let greedy = e["greedy"].as_array().unwrap().iter().map(ids).collect();
    let logits = (0..prompts.len())
        .map(|i| {
            std::fs::read(d.join(format!("logits_{i}.f32")))
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
        .collect();
    Fixture {
        ck: Checkpoint::open(&d).unwrap(),
        prompts,
        greedy,
        logits,
    }
}

fn tp(ck: &Checkpoint, ranks: usize) -> Box<dyn CausalLm> {
    parallel::load(
        (0..ranks).map(|_| CpuBackend::new()).collect(),
        ck,
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("TP={ranks}: {e:#}"))
}

fn plain(ck: &Checkpoint) -> Box<dyn CausalLm> {
    Box::new(Qwen4ExpText::load(CpuBackend::new(), ck).unwrap())
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every prompt fed in chunks of `chunk` tokens, all sequences in each batch (the first chunk
/// of prompt `i` is `chunk + i` long, so batches mix chunk lengths); every position's logits.
fn run_chunked(m: &mut dyn CausalLm, prompts: &[Vec<u32>], chunk: usize) -> Vec<Vec<f32>> {
    let seqs: Vec<SeqId> = prompts.iter().map(|_| m.new_sequence()).collect();
    let mut out = vec![Vec::new(); prompts.len()];
    let mut done = vec![0usize; prompts.len()];
    let mut first = true;
    while done.iter().zip(prompts).any(|(d, p)| *d < p.len()) {
        let mut items = Vec::new();
        let mut which = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            if done[i] >= p.len() {
                continue;
            }
            let take = if first { chunk + i } else { chunk }.min(p.len() - done[i]);
            items.push(BatchItem {
                seq: seqs[i],
                tokens: &p[done[i]..done[i] + take],
                logits: LogitsWanted::All,
            });
            which.push((i, take));
        }
        first = false;
        for ((i, take), l) in which.into_iter().zip(m.forward(&items).unwrap()) {
            out[i].extend(l);
            done[i] += take;
        }
    }
    for s in seqs {
        m.drop_sequence(s);
    }
    out
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

/// All prompts prefilled in one batch, then `steps` greedy tokens decoded together.
fn greedy(m: &mut dyn CausalLm, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<u32>> {
    let seqs: Vec<SeqId> = prompts.iter().map(|_| m.new_sequence()).collect();
    let items: Vec<BatchItem<'_>> = prompts
        .iter()
        .zip(&seqs)
        .map(|(p, &seq)| BatchItem {
            seq,
            tokens: p,
            logits: LogitsWanted::Last,
        })
        .collect();
    let mut last: Vec<u32> = m
        .forward(&items)
        .unwrap()
        .iter()
        .map(|l| argmax(l))
        .collect();
    let mut got: Vec<Vec<u32>> = last.iter().map(|&t| vec![t]).collect();
    for _ in 1..steps {
        let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
        let items: Vec<BatchItem<'_>> = toks
            .iter()
            .zip(&seqs)
            .map(|(t, &seq)| BatchItem {
                seq,
                tokens: t,
                logits: LogitsWanted::Last,
            })
            .collect();
        last = m
            .forward(&items)
            .unwrap()
            .iter()
            .map(|l| argmax(l))
            .collect();
        for (g, &t) in got.iter_mut().zip(&last) {
            g.push(t);
        }
    }
    for s in seqs {
        m.drop_sequence(s);
    }
    got
}

fn check(ranks: usize) {
    for name in FIXTURES {
        let fx = fixture(name);
        let mut one = plain(&fx.ck);
        let mut split = tp(&fx.ck, ranks);
        assert!(split.info().backend.contains("tensor parallel"));
        let longest = fx.prompts.iter().map(Vec::len).max().unwrap();
        // 5 is not a multiple of the QSA block (4), the n-gram context or the conv histories.
        for (chunk, how) in [
            (longest, "full prefill"),
            (5, "chunks of 5"),
            (1, "one token at a time"),
        ] {
            let want = run_chunked(one.as_mut(), &fx.prompts, chunk);
            let got = run_chunked(split.as_mut(), &fx.prompts, chunk);
            for (i, ((g, w), r)) in got.iter().zip(&want).zip(&fx.logits).enumerate() {
                let d = max_diff(g, w);
                assert!(
                    d <= TP_TOLERANCE,
                    "{name} TP={ranks}, prompt {i}, {how}: max |Δ| to TP=1 = {d}"
                );
                let d = max_diff(g, r);
                assert!(
                    d <= REFERENCE_TOLERANCE,
                    "{name} TP={ranks}, prompt {i}, {how}: max |Δ| to transformers = {d}"
                );
            }
        }
        let steps = fx.greedy[0].len();
        let g1 = greedy(one.as_mut(), &fx.prompts, steps);
        let g2 = greedy(split.as_mut(), &fx.prompts, steps);
        assert_eq!(g2, g1, "{name} TP={ranks}: greedy tokens differ from TP=1");
        assert_eq!(
            g2, fx.greedy,
            "{name} TP={ranks}: greedy tokens differ from transformers' generate()"
        );
    }
}

#[test]
fn tp2_matches_tp1_and_transformers_on_every_fixture() {
    check(2);
}

#[test]
fn tp4_with_replicated_kv_heads_matches_tp1_and_transformers() {
    // 4 query heads over 4 ranks read 2 KV heads: each KV head lives on two ranks.
    check(4);
}

#[test]
fn tp3_is_refused_naming_the_head_count() {
    let fx = fixture("fused");
    let err = match parallel::load(
        (0..3).map(|_| CpuBackend::new()).collect(),
        &fx.ck,
        Duration::from_secs(1),
    ) {
        Ok(_) => panic!("a 3-way split of 4 attention heads was accepted"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("divisible by 3") && err.contains("has 4"),
        "{err}"
    );
}

/// Snapshot / restore, the host copy of the prefix cache (export / import) and checkpoint /
/// rollback keep every rank's state: the next token's logits come out the same.
#[test]
fn tp2_state_snapshot_export_and_rollback_resume_exactly() {
    let fx = fixture("per_expert");
    let mut split = tp(&fx.ck, 2);
    let prompt = &fx.prompts[1];
    let seq = split.new_sequence();
    let next = |m: &mut dyn CausalLm, t: u32| {
        m.forward(&[BatchItem {
            seq,
            tokens: &[t],
            logits: LogitsWanted::Last,
        }])
        .unwrap()
        .remove(0)
    };
    split
        .forward(&[BatchItem {
            seq,
            tokens: prompt,
            logits: LogitsWanted::None,
        }])
        .unwrap();
    let snap = split.snapshot(seq).unwrap();
    let host = split.export_state(seq).unwrap();
    assert_eq!(split.checkpoint(seq).unwrap(), prompt.len());
    let first = next(split.as_mut(), 3);
    // Another token changes the state, so each way back is tested from a moved state.
    assert_ne!(next(split.as_mut(), 5), first);
    assert_eq!(split.rollback(seq).unwrap(), prompt.len());
    assert_eq!(next(split.as_mut(), 3), first);
    split.restore(seq, &snap).unwrap();
    assert_eq!(next(split.as_mut(), 3), first);
    split.import_state(seq, &host).unwrap();
    assert_eq!(split.sequence_len(seq), Some(prompt.len()));
    assert_eq!(next(split.as_mut(), 3), first);
    assert!(split.state_bytes(seq).unwrap() > 0);
    // The TP=1 model's host state is refused by the TP=2 model (a different shape).
    let mut one = plain(&fx.ck);
    let s1 = one.new_sequence();
    one.forward(&[BatchItem {
        seq: s1,
        tokens: prompt,
        logits: LogitsWanted::None,
    }])
    .unwrap();
    let other = one.export_state(s1).unwrap();
    assert!(split.import_state(seq, &other).is_err());
}

/// TP=2 with hybrid expert placement, on the CPU stand-in (the "resident" side is the CPU
/// backend): one host expert store for both ranks, each rank's cache admitting only its own
/// experts. From a cold small cache (admissions and evictions while the prompts run), with no
/// cache at all (every expert on the CPU kernels) and with room for every owned expert, the
/// logits stay within the fixture bound of transformers and the greedy tokens are theirs.
#[test]
fn tp2_hybrid_shared_host_store_and_split_caches_match_transformers() {
    use capy_engine::hybrid::HybridOptions;
    use capy_engine::parallel::qwen4_exp::{load_hybrid, TpQwen4ExpText};
    for name in FIXTURES {
        let fx = fixture(name);
        let flash = fx.ck.config.qwen4_exp().unwrap();
        let (h, i) = (fx.ck.config.hidden_size, flash.moe.moe_intermediate_size);
        // F32 experts: gate, up and down, 4 bytes a weight.
        let expert_bytes = 3 * h * i * 4;
        let layers = fx.ck.config.num_hidden_layers;
        for (slots, label) in [
            (3, "small cache"),
            (0, "no cache"),
            (layers * 8, "room for all"),
        ] {
            let load = || -> TpQwen4ExpText<CpuBackend> {
                load_hybrid(
                    vec![CpuBackend::new(), CpuBackend::new()],
                    parallel::host_exchanges(2, h, Duration::from_secs(60)).unwrap(),
                    &fx.ck,
                    &HybridOptions {
                        cache_bytes: slots * expert_bytes,
                        threads: 2,
                        ..Default::default()
                    },
                )
                .unwrap_or_else(|e| panic!("{name} {label}: {e:#}"))
            };
            let mut m = load();
            let got = run_chunked(&mut m, &fx.prompts, 5);
            for (p, (g, r)) in got.iter().zip(&fx.logits).enumerate() {
                let d = max_diff(g, r);
                assert!(
                    d <= REFERENCE_TOLERANCE,
                    "{name} hybrid TP=2, {label}, prompt {p}: max |Δ| to transformers = {d}"
                );
            }
            let mut m2 = load();
            let steps = fx.greedy[0].len();
            assert_eq!(
                greedy(&mut m2, &fx.prompts, steps),
                fx.greedy,
                "{name} hybrid TP=2, {label}: greedy tokens"
            );
            // Each rank's cache holds (and has ever been asked for) only the experts it owns.
            let shards: Vec<_> = m.shards().into_iter().cloned().collect();
            let caches: Vec<_> = (0..2).filter_map(|r| m.expert_cache(r).cloned()).collect();
            match label {
                "room for all" => assert!(caches.is_empty(), "{name}: no cache policy needed"),
                _ => {
                    assert_eq!(caches.len(), 2, "{name} {label}: one cache per rank");
                    for (r, c) in caches.iter().enumerate() {
                        let c = c.lock().unwrap();
                        assert!(
                            c.stats().lookups > 0,
                            "{name} {label}: rank {r} saw no experts"
                        );
                        for l in 0..layers {
                            let resident = c.resident_in(l);
                            assert!(resident.len() <= slots);
                            for e in resident {
                                assert!(
                                    shards[r].owns_expert(e as usize),
                                    "{name} {label}: rank {r} cached expert {e} of layer {l}"
                                );
                            }
                        }
                    }
                    if slots > 0 {
                        let cached: usize = caches
                            .iter()
                            .map(|c| {
                                let c = c.lock().unwrap();
                                (0..layers).map(|l| c.resident_in(l).len()).sum::<usize>()
                            })
                            .sum();
                        assert!(cached > 0, "{name} {label}: nothing was ever admitted");
                        let seq = m.new_sequence();
                        let heat = m.routing_heat(seq).expect("the ranks' caches report heat");
                        assert!(!heat.is_empty(), "{name} {label}: no heat reported");
                    }
                }
            }
        }
    }
}
