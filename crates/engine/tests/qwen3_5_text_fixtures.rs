//! The `qwen3_5_text` model on the CPU backend against Hugging Face `transformers`.
//!
//! The fixtures under `tests/fixtures/qwen3_5_text/` are tiny random-weight checkpoints with
//! the logits of every prompt position and the greedy continuations that transformers computes
//! (`tools/make_fixtures.py` writes them; see its header to regenerate). Every way of feeding the
//! model — one full prefill, chunked prefill, token-by-token decode, several sequences of
//! unequal lengths in one batch, a batch mixing decode and prefill, snapshot and restore — must
//! give the reference logits within [`TOLERANCE`], and greedy decoding must give the reference
//! tokens. The second half checks that bad input is refused with an error that says what is
//! wrong, never a panic.

use capy_engine::backend::cpu::CpuBackend;
use capy_engine::checkpoint::{write_safetensors, Checkpoint};
use capy_engine::model::{self, BatchItem, CausalLm, LogitsWanted, SeqId};
use capy_engine::tensor::HostTensor;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Largest allowed |Δ| between our logits and the reference (F32 fixtures).
const TOLERANCE: f32 = 1e-3;

#[derive(Deserialize)]
struct Expected {
    fixture: String,
    multimodal_layout: bool,
    vocab_size: usize,
    prompts: Vec<ExpectedPrompt>,
}

#[derive(Deserialize)]
struct ExpectedPrompt {
    token_ids: Vec<u32>,
    logits_file: String,
    logits_shape: [usize; 2],
    greedy_new_tokens: Vec<u32>,
}

/// One prompt with its reference logits `[len × vocab]`.
struct Prompt {
    ids: Vec<u32>,
    logits: Vec<f32>,
    greedy: Vec<u32>,
}

struct Fixture {
    name: String,
    dir: PathBuf,
    multimodal_layout: bool,
    vocab: usize,
    prompts: Vec<Prompt>,
}

fn fixture_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_5_text")
}

/// Reads a little-endian float32, C-order, 2-D `.npy` file (what numpy.save writes).
fn read_npy_f32(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes =
        std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    assert_eq!(
        &bytes[..6],
        b"\x93NUMPY",
        "{} is not a .npy file",
        path.display()
    );
    let (header_len, header_start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => panic!("{}: unsupported .npy version {v}", path.display()),
    };
    let header = std::str::from_utf8(&bytes[header_start..header_start + header_len])
        .expect("npy header is ASCII");
    assert!(
        header.contains("'descr': '<f4'"),
        "{}: expected float32 data, header {header}",
        path.display()
    );
    assert!(
        header.contains("'fortran_order': False"),
        "{}: expected C order, header {header}",
        path.display()
    );
    let shape_text = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .expect("npy header has a shape");
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().expect("shape entry"))
        .collect();
    let data: Vec<f32> = bytes[header_start + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(
        data.len(),
        shape.iter().product::<usize>(),
        "{}: data does not fill shape {shape:?}",
        path.display()
    );
    (shape, data)
}

fn fixtures() -> Vec<Fixture> {
    let root = fixture_root();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", root.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.join("expected.json").exists())
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 4,
        "expected at least 4 fixtures under {}, found {}",
        root.display(),
        dirs.len()
    );
    dirs.into_iter()
        .map(|dir| {
            let text =
                std::fs::read_to_string(dir.join("expected.json")).expect("read expected.json");
            let e: Expected = serde_json::from_str(&text).expect("parse expected.json");
            let prompts = e
                .prompts
                .into_iter()
                .map(|p| {
                    let (shape, logits) = read_npy_f32(&dir.join(&p.logits_file));
                    assert_eq!(shape, p.logits_shape.to_vec());
                    assert_eq!(shape, vec![p.token_ids.len(), e.vocab_size]);
                    Prompt {
                        ids: p.token_ids,
                        logits,
                        greedy: p.greedy_new_tokens,
                    }
                })
                .collect();
            Fixture {
                name: e.fixture,
                dir,
                multimodal_layout: e.multimodal_layout,
                vocab: e.vocab_size,
                prompts,
            }
        })
        .collect()
}

fn open(dir: &Path) -> Box<dyn CausalLm> {
    let ck = Checkpoint::open(dir).unwrap_or_else(|e| panic!("open {}: {e:#}", dir.display()));
    model::load(CpuBackend::new(), &ck).unwrap_or_else(|e| panic!("load {}: {e:#}", dir.display()))
}

/// Largest |a − b|; fails on a length mismatch or a non-finite value.
fn max_abs_diff(got: &[f32], want: &[f32], what: &str) -> f32 {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: {} logits, expected {}",
        got.len(),
        want.len()
    );
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            assert!(g.is_finite(), "{what}: non-finite logit {g}");
            (g - w).abs()
        })
        .fold(0.0, f32::max)
}

fn check(fx: &Fixture, what: &str, worst: f32) {
    println!("{}: {what}: max |Δ| = {worst:.3e}", fx.name);
    assert!(
        worst <= TOLERANCE,
        "{}: {what}: max |Δ| {worst:.3e} exceeds {TOLERANCE:e}",
        fx.name
    );
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn one(m: &mut dyn CausalLm, seq: SeqId, tokens: &[u32], logits: LogitsWanted) -> Vec<f32> {
    m.forward(&[BatchItem {
        seq,
        tokens,
        logits,
    }])
    .expect("forward")
    .remove(0)
}

/// Feeds a prompt in chunks of `chunk` tokens and returns the logits of every position.
fn chunked_logits(m: &mut dyn CausalLm, ids: &[u32], chunk: usize) -> Vec<f32> {
    let seq = m.new_sequence();
    let mut out = Vec::new();
    for part in ids.chunks(chunk) {
        out.extend(one(m, seq, part, LogitsWanted::All));
    }
    assert_eq!(m.sequence_len(seq), Some(ids.len()));
    m.drop_sequence(seq);
    out
}

#[test]
fn full_prefill_logits_match_reference() {
    for fx in fixtures() {
        let ck = Checkpoint::open(&fx.dir).expect("open");
        // The multimodal fixture must really use the published tensor names, so that the
        // loader's prefix detection is what this test exercises.
        assert_eq!(
            ck.weights
                .contains("model.language_model.embed_tokens.weight"),
            fx.multimodal_layout,
            "{}: tensor layout does not match expected.json",
            fx.name
        );
        assert_eq!(ck.config.vocab_size, fx.vocab);
        let mut m = model::load(CpuBackend::new(), &ck).expect("load");
        let mut worst = 0f32;
        for (i, p) in fx.prompts.iter().enumerate() {
            let seq = m.new_sequence();
            let got = one(m.as_mut(), seq, &p.ids, LogitsWanted::All);
            worst = worst.max(max_abs_diff(
                &got,
                &p.logits,
                &format!("{} prompt {i}", fx.name),
            ));
        }
        check(&fx, "full prefill", worst);
    }
}

#[test]
fn chunked_prefill_logits_match_reference() {
    for fx in fixtures() {
        let mut m = open(&fx.dir);
        for chunk in [7, 64] {
            let mut worst = 0f32;
            for (i, p) in fx.prompts.iter().enumerate() {
                let got = chunked_logits(m.as_mut(), &p.ids, chunk);
                worst = worst.max(max_abs_diff(
                    &got,
                    &p.logits,
                    &format!("{} prompt {i} chunk {chunk}", fx.name),
                ));
            }
            check(&fx, &format!("prefill in chunks of {chunk}"), worst);
        }
    }
}

#[test]
fn token_by_token_decode_matches_reference() {
    for fx in fixtures() {
        let mut m = open(&fx.dir);
        let mut worst = 0f32;
        for (i, p) in fx.prompts.iter().enumerate() {
            let seq = m.new_sequence();
            let mut got = Vec::new();
            for t in &p.ids {
                got.extend(one(
                    m.as_mut(),
                    seq,
                    std::slice::from_ref(t),
                    LogitsWanted::Last,
                ));
            }
            worst = worst.max(max_abs_diff(
                &got,
                &p.logits,
                &format!("{} prompt {i} decode", fx.name),
            ));
        }
        check(&fx, "token-by-token decode", worst);
    }
}

#[test]
fn prompts_of_unequal_lengths_in_one_batch_match_reference() {
    for fx in fixtures() {
        let mut m = open(&fx.dir);
        let seqs: Vec<SeqId> = fx.prompts.iter().map(|_| m.new_sequence()).collect();
        let batch: Vec<BatchItem<'_>> = fx
            .prompts
            .iter()
            .zip(&seqs)
            .map(|(p, &seq)| BatchItem {
                seq,
                tokens: &p.ids,
                logits: LogitsWanted::All,
            })
            .collect();
        let outs = m.forward(&batch).expect("batched forward");
        assert_eq!(outs.len(), fx.prompts.len());
        let mut worst = 0f32;
        for (i, (got, p)) in outs.iter().zip(&fx.prompts).enumerate() {
            worst = worst.max(max_abs_diff(
                got,
                &p.logits,
                &format!("{} batched prompt {i}", fx.name),
            ));
        }
        check(&fx, "all prompts in one batch", worst);
    }
}

/// A scheduler-like loop: every step, each unfinished sequence contributes either one token
/// (decoding) or a chunk of its prompt (prefilling), so batches mix decode and prefill items
/// of different lengths, and sequences join late and finish at different steps.
#[test]
fn batches_mixing_decode_and_prefill_match_reference() {
    for fx in fixtures() {
        let mut m = open(&fx.dir);
        let n = fx.prompts.len();
        let seqs: Vec<SeqId> = (0..n).map(|_| m.new_sequence()).collect();
        let mut cursor = vec![0usize; n];
        let mut got: Vec<Vec<f32>> = vec![Vec::new(); n];
        let mut step = 0usize;
        let mut saw_mixed = false;
        while (0..n).any(|i| cursor[i] < fx.prompts[i].ids.len()) {
            let mut items = Vec::new();
            let mut owners = Vec::new();
            for i in 0..n {
                let len = fx.prompts[i].ids.len();
                // Sequence i joins at step i; the first one decodes token by token, the others
                // prefill in chunks whose size changes from step to step.
                if step < i || cursor[i] >= len {
                    continue;
                }
                let take = if i == 0 {
                    1
                } else {
                    (step * 13 + i * 29) % 47 + 1
                };
                let end = (cursor[i] + take).min(len);
                let tokens = &fx.prompts[i].ids[cursor[i]..end];
                items.push(BatchItem {
                    seq: seqs[i],
                    tokens,
                    logits: LogitsWanted::All,
                });
                owners.push(i);
                cursor[i] = end;
            }
            if items.iter().any(|it| it.tokens.len() == 1)
                && items.iter().any(|it| it.tokens.len() > 1)
            {
                saw_mixed = true;
            }
            let outs = m.forward(&items).expect("mixed forward");
            for (i, o) in owners.into_iter().zip(outs) {
                got[i].extend(o);
            }
            step += 1;
        }
        assert!(
            saw_mixed,
            "{}: the loop never mixed a decode item with a prefill item",
            fx.name
        );
        let mut worst = 0f32;
        for (i, p) in fx.prompts.iter().enumerate() {
            worst = worst.max(max_abs_diff(
                &got[i],
                &p.logits,
                &format!("{} mixed prompt {i}", fx.name),
            ));
        }
        check(&fx, "batches mixing decode and prefill", worst);
    }
}

/// Greedy continuation, argmax fed back one token at a time, after a full prefill and after a
/// token-by-token prefill.
#[test]
fn greedy_continuation_matches_reference() {
    for fx in fixtures() {
        let mut m = open(&fx.dir);
        for (i, p) in fx.prompts.iter().enumerate() {
            for prefill in ["full prefill", "token-by-token prefill"] {
                let seq = m.new_sequence();
                let mut last = if prefill == "full prefill" {
                    one(m.as_mut(), seq, &p.ids, LogitsWanted::Last)
                } else {
                    let mut l = Vec::new();
                    for t in &p.ids {
                        l = one(m.as_mut(), seq, std::slice::from_ref(t), LogitsWanted::Last);
                    }
                    l
                };
                let mut tokens = Vec::new();
                while tokens.len() < p.greedy.len() {
                    assert_eq!(last.len(), fx.vocab);
                    let next = argmax(&last);
                    tokens.push(next);
                    last = one(m.as_mut(), seq, &[next], LogitsWanted::Last);
                }
                assert_eq!(
                    tokens, p.greedy,
                    "{} prompt {i}: greedy continuation after {prefill}",
                    fx.name
                );
                m.drop_sequence(seq);
            }
        }
        println!(
            "{}: greedy continuations identical ({} prompts, 2 prefill paths)",
            fx.name,
            fx.prompts.len()
        );
    }
}

/// The greedy pass (`forward_greedy`: the model picks, no logits returned) continues every
/// prompt as transformers does, all prompts decoded in one batch; a batch item that asks for
/// every position's logits is refused by it.
#[test]
fn greedy_pass_continues_as_the_reference() {
    for fx in fixtures() {
        let mut m = open(&fx.dir);
        let prompts: Vec<Vec<u32>> = fx.prompts.iter().map(|p| p.ids.clone()).collect();
        let steps = fx.prompts.iter().map(|p| p.greedy.len()).min().unwrap();
        let got = model::greedy_continuations(m.as_mut(), &prompts, steps).unwrap();
        for (i, (g, p)) in got.iter().zip(&fx.prompts).enumerate() {
            assert_eq!(
                g[..],
                p.greedy[..steps],
                "{} prompt {i}: greedy pass",
                fx.name
            );
        }
        let seq = m.new_sequence();
        let err = m
            .forward_greedy(
                &[BatchItem {
                    seq,
                    tokens: &prompts[0],
                    logits: LogitsWanted::All,
                }],
                fx.vocab,
            )
            .unwrap_err();
        assert!(err.to_string().contains("every position's logits"), "{err}");
    }
}

#[test]
fn snapshot_and_restore_mid_sequence_give_the_same_next_logits() {
    for fx in fixtures() {
        let mut m = open(&fx.dir);
        let p = fx
            .prompts
            .iter()
            .max_by_key(|p| p.ids.len())
            .expect("a prompt");
        let vocab = fx.vocab;
        // Cut after a chunk boundary of the GDN prefill, in the middle of the prompt.
        let cut = 100.min(p.ids.len() - 10);
        let seq = m.new_sequence();
        assert!(one(m.as_mut(), seq, &p.ids[..cut], LogitsWanted::None).is_empty());
        let snap = m.snapshot(seq).expect("snapshot");
        assert_eq!(snap.len, cut);
        assert!(snap.bytes > 0);
        let rest = &p.ids[cut..];
        let first = one(m.as_mut(), seq, rest, LogitsWanted::All);
        assert_eq!(m.sequence_len(seq), Some(p.ids.len()));

        // Restore into the same sequence (rolls it back) and into a fresh one.
        m.restore(seq, &snap).expect("restore");
        assert_eq!(m.sequence_len(seq), Some(cut));
        let again = one(m.as_mut(), seq, rest, LogitsWanted::All);
        let other = m.new_sequence();
        m.restore(other, &snap)
            .expect("restore into a new sequence");
        let mut fresh = Vec::new();
        for t in rest {
            fresh.extend(one(
                m.as_mut(),
                other,
                std::slice::from_ref(t),
                LogitsWanted::Last,
            ));
        }
        assert_eq!(
            first, again,
            "{}: logits after restore differ from those before",
            fx.name
        );
        let want = &p.logits[cut * vocab..];
        let worst = max_abs_diff(&first, want, &fx.name).max(max_abs_diff(
            &fresh,
            want,
            &format!("{} restored into a new sequence", fx.name),
        ));
        check(
            &fx,
            &format!("snapshot at {cut} tokens, restore, continue"),
            worst,
        );
    }
}

// -------------------------------------------------------------------------------------------
// Bad input: every case is an Err whose message names the file or tensor and what was expected.

fn copy_fixture(name_contains: &str) -> (tempfile::TempDir, PathBuf) {
    let fx = fixtures()
        .into_iter()
        .find(|f| f.name.contains(name_contains))
        .expect("fixture");
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for name in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(fx.dir.join(name), dir.join(name)).unwrap();
    }
    (tmp, dir)
}

fn load_err(dir: &Path) -> String {
    let result = Checkpoint::open(dir).and_then(|ck| model::load(CpuBackend::new(), &ck));
    match result {
        Ok(_) => panic!("{} loaded, expected an error", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

/// All tensors of a fixture's weights, with `edit` applied, written back to its folder.
fn rewrite_weights(dir: &Path, edit: impl FnOnce(&mut Vec<HostTensor>)) {
    let ck = Checkpoint::open(dir).expect("open copy");
    let mut names: Vec<String> = ck.weights.names().map(str::to_owned).collect();
    names.sort();
    let mut tensors: Vec<HostTensor> = names
        .iter()
        .map(|n| {
            let t = ck.weights.get(n).unwrap();
            // Own the bytes: the file is about to be replaced.
            HostTensor::from_f32(n, t.shape.clone(), &t.to_f32().unwrap())
        })
        .collect();
    drop(ck);
    edit(&mut tensors);
    write_safetensors(&dir.join("model.safetensors"), &tensors).expect("write safetensors");
}

#[test]
fn nonexistent_folder_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-model");
    let e = format!("{:#}", Checkpoint::open(&missing).err().expect("an error"));
    assert!(
        e.contains("no-such-model") && e.contains("does not exist"),
        "{e}"
    );
}

#[test]
fn unknown_model_type_is_refused() {
    let (_tmp, dir) = copy_fixture("gqa4x2");
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["model_type"] = "llama".into();
    std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("config.json")
            && e.contains("unsupported model_type \"llama\"")
            && e.contains("qwen3_5"),
        "{e}"
    );
}

#[test]
fn truncated_safetensors_is_refused() {
    let (_tmp, dir) = copy_fixture("gqa4x2");
    let path = dir.join("model.safetensors");
    let full = std::fs::metadata(&path).unwrap().len();
    // Cut in the middle of the tensor data: the header is intact, the data is short.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(full / 2)
        .unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model.safetensors")
            && e.contains("truncated")
            && e.contains(&format!("{} bytes", full / 2)),
        "{e}"
    );
    // Cut inside the header: not a safetensors file at all.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(20)
        .unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model.safetensors") && e.contains("not a valid safetensors file"),
        "{e}"
    );
}

#[test]
fn tensor_with_wrong_shape_is_refused() {
    let (_tmp, dir) = copy_fixture("gqa4x2");
    let name = "model.layers.1.mlp.down_proj.weight";
    rewrite_weights(&dir, |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).expect("down_proj");
        // A transposed export: same element count, wrong shape.
        t.shape = vec![t.shape[1], t.shape[0]];
    });
    let e = load_err(&dir);
    assert!(
        e.contains(name) && e.contains("[128, 64]") && e.contains("expected [64, 128]"),
        "{e}"
    );
    assert!(
        e.contains("model.safetensors"),
        "the error should name the file: {e}"
    );
}

#[test]
fn missing_tensor_is_refused() {
    let (_tmp, dir) = copy_fixture("gqa4x2");
    let name = "model.layers.2.linear_attn.A_log";
    rewrite_weights(&dir, |ts| ts.retain(|t| t.name != name));
    let e = load_err(&dir);
    assert!(
        e.contains(name) && e.contains("missing") && e.contains("model.safetensors"),
        "{e}"
    );

    let (_tmp, dir) = copy_fixture("gqa4x2");
    rewrite_weights(&dir, |ts| ts.retain(|t| t.name != "lm_head.weight"));
    let e = load_err(&dir);
    assert!(
        e.contains("lm_head.weight") && e.contains("tie_word_embeddings"),
        "{e}"
    );
}

#[test]
fn token_ids_out_of_range_and_empty_items_are_refused() {
    let fx = fixtures().into_iter().next().expect("a fixture");
    let mut m = open(&fx.dir);
    let seq = m.new_sequence();
    let bad = fx.vocab as u32;
    let e = format!(
        "{:#}",
        m.forward(&[BatchItem {
            seq,
            tokens: &[3, bad, 4],
            logits: LogitsWanted::All
        }])
        .unwrap_err()
    );
    assert!(
        e.contains(&format!("token id {bad} is out of range"))
            && e.contains(&format!("{} ids", fx.vocab)),
        "{e}"
    );
    // A refused batch leaves the sequence untouched.
    assert_eq!(m.sequence_len(seq), Some(0));
    let e = format!(
        "{:#}",
        m.forward(&[BatchItem {
            seq,
            tokens: &[],
            logits: LogitsWanted::All
        }])
        .unwrap_err()
    );
    assert!(e.contains("no tokens"), "{e}");
    // The model still works afterwards.
    let p = &fx.prompts[0];
    let got = one(m.as_mut(), seq, &p.ids, LogitsWanted::All);
    check(
        &fx,
        "after refused batches",
        max_abs_diff(&got, &p.logits, &fx.name),
    );
}
