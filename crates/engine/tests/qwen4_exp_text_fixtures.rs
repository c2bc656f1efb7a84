//! Qwen3.8-Flash-Next (`qwen4_exp_text`) against transformers on tiny random checkpoints.
//!
//! The fixtures come from `tools/make_fixtures_qwen4_exp.py`: F32 checkpoints with PLE,
//! hyper-connections, more experts than top-k and a QSA budget of 8–12 tokens that the prompts
//! run far past. The whole model must reproduce the reference logits (max |Δ| ≤ 1e-3) and greedy
//! continuations through full prefill, chunked prefill and token-by-token decode; each block is
//! also checked on its own against values recorded from the reference forward, so that a
//! regression names its block.

use capy_engine::backend::cpu::CpuBackend;
use capy_engine::backend::Backend;
use capy_engine::checkpoint::{write_safetensors, Checkpoint};
use capy_engine::config::TextConfig;
use capy_engine::model::qwen4_exp_text::Qwen4ExpText;
use capy_engine::model::{BatchItem, CausalLm, LogitsWanted, SeqId};
use capy_engine::tensor::{Bytes, DType, HostTensor};
use serde_json::Value;
use std::path::{Path, PathBuf};

const LOGIT_TOLERANCE: f32 = 1e-3;
const BLOCK_TOLERANCE: f32 = 1e-4;
const FIXTURES: [&str; 2] = ["fused", "per_expert"];

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/qwen4_exp_text")
        .join(name)
}

struct Fixture {
    name: &'static str,
    expected: Value,
    prompts: Vec<Vec<u32>>,
    greedy: Vec<Vec<u32>>,
    logits: Vec<Vec<f32>>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("a list of ids")
        .iter()
        .map(|t| t.as_u64().expect("an id") as u32)
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("a list of rows")
        .iter()
        .flat_map(|r| r.as_array().expect("a row").iter())
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

fn fixture(name: &'static str) -> Fixture {
    let dir = fixture_dir(name);
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = expected["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let greedy = expected["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let vocab = expected["vocab_size"].as_u64().unwrap() as usize;
    let logits = (0..prompts.len())
        .map(|i| {
            let bytes = std::fs::read(dir.join(format!("logits_{i}.f32"))).unwrap();
            let v: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(
                v.len(),
                prompts[i].len() * vocab,
                "{name}: logits_{i}.f32 has the wrong size"
            );
            v
        })
        .collect();
    Fixture {
        name,
        expected,
        prompts,
        greedy,
        logits,
    }
}

fn load(name: &str) -> Qwen4ExpText<CpuBackend> {
    load_dir(&fixture_dir(name))
}

fn load_dir(dir: &Path) -> Qwen4ExpText<CpuBackend> {
    let ck = Checkpoint::open(dir).unwrap();
    Qwen4ExpText::load(CpuBackend::new(), &ck).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Feeds every prompt in chunks of `chunk` tokens, all sequences in each batch, and returns the
/// logits of every position per prompt.
fn run_chunked(model: &mut dyn CausalLm, prompts: &[Vec<u32>], chunk: usize) -> Vec<Vec<f32>> {
    let seqs: Vec<SeqId> = prompts.iter().map(|_| model.new_sequence()).collect();
    let mut out = vec![Vec::new(); prompts.len()];
    let mut done = vec![0usize; prompts.len()];
    // Shift each sequence's chunk boundaries so batches mix prefill chunks and single tokens.
    let mut first = true;
    while done.iter().zip(prompts).any(|(d, p)| *d < p.len()) {
        let mut items = Vec::new();
        let mut which = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            if done[i] >= p.len() {
                continue;
            }
            let take = if first {
                (chunk + i).min(p.len())
            } else {
                chunk.min(p.len() - done[i])
            };
            items.push(BatchItem {
                seq: seqs[i],
                tokens: &p[done[i]..done[i] + take],
                logits: LogitsWanted::All,
            });
            which.push((i, take));
        }
        first = false;
        let res = model.forward(&items).unwrap();
        for ((i, take), l) in which.into_iter().zip(res) {
            out[i].extend(l);
            done[i] += take;
        }
    }
    for s in seqs {
        model.drop_sequence(s);
    }
    out
}

fn check_logits(fx: &Fixture, got: &[Vec<f32>], how: &str) {
    for (i, (g, want)) in got.iter().zip(&fx.logits).enumerate() {
        let d = max_diff(g, want);
        assert!(
            d <= LOGIT_TOLERANCE,
            "{}: prompt {i} ({} tokens), {how}: max |Δ| = {d}",
            fx.name,
            fx.prompts[i].len()
        );
    }
}

#[test]
fn full_prefill_matches_reference_logits() {
    for name in FIXTURES {
        let fx = fixture(name);
        let mut model = load(name);
        let longest = fx.prompts.iter().map(Vec::len).max().unwrap();
        check_logits(
            &fx,
            &run_chunked(&mut model, &fx.prompts, longest),
            "full prefill",
        );
    }
}

#[test]
fn chunked_prefill_matches_reference_logits() {
    for name in FIXTURES {
        let fx = fixture(name);
        let mut model = load(name);
        // 5 is not a multiple of the QSA block (4) nor of the n-gram context or conv histories.
        check_logits(&fx, &run_chunked(&mut model, &fx.prompts, 5), "chunks of 5");
    }
}

#[test]
fn token_by_token_decode_matches_reference_logits() {
    for name in FIXTURES {
        let fx = fixture(name);
        let mut model = load(name);
        check_logits(
            &fx,
            &run_chunked(&mut model, &fx.prompts, 1),
            "one token at a time",
        );
    }
}

#[test]
fn greedy_continuations_match_reference() {
    for name in FIXTURES {
        let fx = fixture(name);
        let mut model = load(name);
        let seqs: Vec<SeqId> = fx.prompts.iter().map(|_| model.new_sequence()).collect();
        let items: Vec<BatchItem<'_>> = fx
            .prompts
            .iter()
            .zip(&seqs)
            .map(|(p, &seq)| BatchItem {
                seq,
                tokens: p,
                logits: LogitsWanted::Last,
            })
            .collect();
        let argmax = |l: &[f32]| {
            l.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32
        };
        let mut last: Vec<u32> = model
            .forward(&items)
            .unwrap()
            .iter()
            .map(|l| argmax(l))
            .collect();
        let mut got: Vec<Vec<u32>> = last.iter().map(|&t| vec![t]).collect();
        let steps = fx.greedy[0].len();
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
            last = model
                .forward(&items)
                .unwrap()
                .iter()
                .map(|l| argmax(l))
                .collect();
            for (g, &t) in got.iter_mut().zip(&last) {
                g.push(t);
            }
        }
        assert_eq!(
            got, fx.greedy,
            "{name}: greedy continuations differ from transformers' generate()"
        );
    }
}

#[test]
fn ngram_ids_match_reference() {
    for name in FIXTURES {
        let fx = fixture(name);
        let model = load(name);
        let ngram = &fx.expected["ngram"];
        let first = model
            .layers
            .iter()
            .find_map(|l| l.ple.as_ref())
            .expect("the fixtures have PLE");
        let mult: Vec<i64> = ngram["layer_multipliers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert_eq!(first.hasher.multipliers, mult, "{name}: hash multipliers");
        let sizes: Vec<u64> = ngram["head_vocab_sizes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(
            first.hasher.head_sizes, sizes,
            "{name}: per-head prime table sizes"
        );
        assert_eq!(
            first.hasher.table_rows,
            ngram["table_rows"].as_u64().unwrap(),
            "{name}: padded table rows"
        );
        let mut checked = 0;
        for (li, layer) in model.layers.iter().enumerate() {
            let Some(ple) = &layer.ple else { continue };
            for (pi, prompt) in fx.prompts.iter().enumerate() {
                let want: Vec<u64> = fx.expected["blocks"][pi][format!("layer{li}.ngram_ids")]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_u64().unwrap()))
                    .collect();
                // In pieces, as prefill chunks and decode steps see them.
                let mut ctx = vec![ple.hasher.eos; ple.hasher.context_len()];
                let mut got = Vec::new();
                for piece in prompt.chunks(3) {
                    got.extend(ple.hasher.ids(&mut ctx, piece));
                }
                assert_eq!(got, want, "{name}: layer {li} n-gram ids of prompt {pi}");
                checked += 1;
            }
        }
        assert!(checked >= fx.prompts.len());
    }
}

#[test]
fn qsa_selection_matches_reference() {
    for name in FIXTURES {
        let fx = fixture(name);
        let model = load(name);
        let b = model.backend();
        let mut sparse_rows = 0;
        for (li, layer) in model.layers.iter().enumerate() {
            let Some(attn) = layer.attention() else {
                continue;
            };
            for (pi, prompt) in fx.prompts.iter().enumerate() {
                let blocks = &fx.expected["blocks"][pi];
                let x = floats(&blocks[format!("layer{li}.attn")]["input"]);
                let n = prompt.len();
                let sel = attn
                    .qsa_selections(b, &b.from_host(n, x.len() / n, &x), model.inv_freq())
                    .expect("a QSA layer");
                for (p, (got, want)) in sel
                    .iter()
                    .zip(blocks[format!("layer{li}.indexer")].as_array().unwrap())
                    .enumerate()
                {
                    // The recorded eager mask lists the positions it masks out; the query sees the rest
                    // up to itself.
                    let masked: Vec<usize> = ids(want).into_iter().map(|t| t as usize).collect();
                    let want: Vec<usize> = (0..=p).filter(|t| !masked.contains(t)).collect();
                    let got = got.clone().unwrap_or_else(|| (0..=p).collect());
                    if got.len() < p + 1 {
                        sparse_rows += 1;
                    }
                    assert_eq!(
                        got, want,
                        "{name}: layer {li}, prompt {pi}, query {p}: selected tokens"
                    );
                }
            }
        }
        assert!(
            sparse_rows > 50,
            "{name}: only {sparse_rows} queries ran past the QSA budget"
        );
    }
}

/// The recorded rows of a block's tensors, with the rows' count.
fn recorded(fx: &Fixture, prompt: usize, key: &str, field: &str) -> (Vec<f32>, usize) {
    let v = &fx.expected["blocks"][prompt][key][field];
    (floats(v), v.as_array().unwrap().len())
}

#[test]
fn hyper_connection_mixers_match_reference() {
    for name in FIXTURES {
        let fx = fixture(name);
        let model = load(name);
        let b = model.backend();
        let streams = model.flash.hc_count;
        for pi in 0..fx.prompts.len() {
            for (li, layer) in model.layers.iter().enumerate() {
                let key = format!("layer{li}.attn_hc");
                let (input, n) = recorded(&fx, pi, &key, "input");
                let x = b.from_host(n, input.len() / n, &input);
                let (mixed, inject) = layer.attn_hyper.read(b, &x);
                let d = max_diff(&b.to_host(&mixed), &recorded(&fx, pi, &key, "mixed").0);
                assert!(
                    d <= BLOCK_TOLERANCE,
                    "{name}: {key} mixed input, max |Δ| = {d}"
                );
                // Writing ones back into zero streams leaves each stream's injection weight.
                let hidden = input.len() / n / streams;
                let ones = b.from_host(n, hidden, &vec![1.0; n * hidden]);
                let weights = b.to_host(&layer.attn_hyper.write_back(
                    b,
                    &b.zeros(n, streams * hidden),
                    &ones,
                    &inject.unwrap(),
                ));
                let want = recorded(&fx, pi, &key, "inject").0;
                let got: Vec<f32> = weights.chunks_exact(hidden).map(|c| c[0]).collect();
                let d = max_diff(&got, &want);
                assert!(
                    d <= BLOCK_TOLERANCE,
                    "{name}: {key} injection weights, max |Δ| = {d}"
                );
            }
            let (input, n) = recorded(&fx, pi, "final_mixer", "input");
            let (mixed, inject) = model
                .final_mixer
                .read(b, &b.from_host(n, input.len() / n, &input));
            assert!(inject.is_none());
            let d = max_diff(
                &b.to_host(&mixed),
                &recorded(&fx, pi, "final_mixer", "mixed").0,
            );
            assert!(d <= BLOCK_TOLERANCE, "{name}: final mixer, max |Δ| = {d}");
        }
    }
}

#[test]
fn sparse_moe_matches_reference() {
    for name in FIXTURES {
        let fx = fixture(name);
        let model = load(name);
        let b = model.backend();
        for pi in 0..fx.prompts.len() {
            for (li, layer) in model.layers.iter().enumerate() {
                let key = format!("layer{li}.mlp");
                let (input, n) = recorded(&fx, pi, &key, "input");
                let out = layer
                    .moe
                    .forward(b, &b.from_host(n, input.len() / n, &input));
                let d = max_diff(&b.to_host(&out), &recorded(&fx, pi, &key, "output").0);
                assert!(
                    d <= BLOCK_TOLERANCE,
                    "{name}: {key} (router, experts, shared expert), max |Δ| = {d}"
                );
            }
        }
    }
}

#[test]
fn ple_matches_reference() {
    use capy_engine::model::layers::Span;
    for name in FIXTURES {
        let fx = fixture(name);
        let model = load(name);
        let b = model.backend();
        let mut checked = 0;
        for (pi, prompt) in fx.prompts.iter().enumerate() {
            let rows: Vec<usize> = ids(&fx.expected["blocks"][pi]["rows"])
                .into_iter()
                .map(|r| r as usize)
                .collect();
            assert_eq!(
                &rows[..2],
                &[0, 1],
                "the first recorded rows are the sequence start"
            );
            for (li, layer) in model.layers.iter().enumerate() {
                let Some(ple) = &layer.ple else { continue };
                let key = format!("layer{li}.ple");
                let (input, n) = recorded(&fx, pi, &key, "input");
                let wide = input.len() / n;
                // Rows 0 and 1 depend on nothing before them: run the PLE on the first two tokens.
                let x = b.from_host(2, wide, &input[..2 * wide]);
                let mut state = ple.new_state(b);
                let spans = [Span {
                    start: 0,
                    len: 2,
                    past: 0,
                }];
                let out = ple.forward(b, &x, &prompt[..2], &spans, &mut [&mut state]);
                let want = recorded(&fx, pi, &key, "output").0;
                let d = max_diff(&b.to_host(&out), &want[..2 * wide]);
                assert!(
                    d <= BLOCK_TOLERANCE,
                    "{name}: {key} on prompt {pi}, max |Δ| = {d}"
                );
                checked += 1;
            }
        }
        assert!(checked > 0);
    }
}

#[test]
fn ignores_mtp_and_vision_tensors() {
    let ck = Checkpoint::open(&fixture_dir("per_expert")).unwrap();
    assert!(
        ck.weights.names().any(|n| n.starts_with("mtp.")),
        "the fixture carries mtp tensors"
    );
    assert!(
        ck.weights.names().any(|n| n.contains("visual.")),
        "the fixture carries vision tensors"
    );
    assert!(
        ck.weights
            .contains("model.layers.0.mlp.experts.0.gate_proj.weight"),
        "per-expert layout"
    );
    assert!(
        ck.weights
            .names()
            .any(|n| n.contains("ngram_embedding.shard_")),
        "a sharded n-gram table"
    );
    let model = capy_engine::model::load(CpuBackend::new(), &ck).unwrap();
    assert_eq!(model.info().architecture.model_type(), "qwen4_exp_text");
}

fn config_of(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir(name).join("config.json")).unwrap())
        .unwrap()
}

fn refusal(edit: impl FnOnce(&mut Value)) -> String {
    let mut v = config_of("fused");
    edit(&mut v);
    format!("{:#}", TextConfig::from_value(&v).unwrap_err())
}

#[test]
fn refuses_configs_with_broken_invariants() {
    assert!(TextConfig::from_value(&config_of("fused")).is_ok());
    let e = refusal(|v| {
        v.as_object_mut().unwrap().remove("indexer_budget");
    });
    assert!(
        e.contains("QSA config is partly set: indexer_budget missing"),
        "{e}"
    );
    let e = refusal(|v| v["ple_layer_ids"] = serde_json::json!([2]));
    assert!(
        e.contains("PLE is only supported on linear_attention layers") && e.contains("[2]"),
        "{e}"
    );
    let e = refusal(|v| v["num_experts_per_tok"] = serde_json::json!(7));
    assert!(e.contains("num_experts_per_tok must be in 1..=6"), "{e}");
    let e = refusal(|v| v["indexer_budget"] = serde_json::json!(10));
    assert!(e.contains("multiple of indexer_compress_ratio"), "{e}");
    let e = refusal(|v| v["indexer_kv_heads"] = serde_json::json!(2));
    assert!(e.contains("indexer_kv_heads must be 1"), "{e}");
    let e = refusal(|v| v["hc_count"] = serde_json::json!(1));
    assert!(e.contains("hc_count must be greater than 1"), "{e}");
    let e = refusal(|v| v["ple_embed_dim"] = serde_json::json!(18));
    assert!(e.contains("ple_embed_dim (18)"), "{e}");
    let e = refusal(|v| v["output_gate_type"] = serde_json::json!("gelu"));
    assert!(e.contains("output_gate_type \"gelu\""), "{e}");
    let e = refusal(|v| v["indexer_head_dim"] = serde_json::json!(4));
    assert!(e.contains("must fit the QSA index head"), "{e}");
}

#[test]
fn loads_a_sharded_table_that_does_not_match_the_config_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture_dir("fused")).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let mut v = config_of("fused");
    v["ngram_vocab_size_base"] = serde_json::json!(60);
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&v).unwrap(),
    )
    .unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let e = format!(
        "{:#}",
        Qwen4ExpText::load(CpuBackend::new(), &ck).err().unwrap()
    );
    assert!(
        e.contains("does not match the n-gram hashing of config.json"),
        "{e}"
    );
}

/// The E4M3 code nearest to `v` (finite codes only; the first of two equally near).
fn to_e4m3(v: f32) -> u8 {
    use capy_engine::quant::fp8::E4M3_TO_F32;
    (0u8..=255)
        .filter(|&c| E4M3_TO_F32[c as usize].is_finite())
        .min_by(|&a, &b| {
            let (da, db) = (
                (E4M3_TO_F32[a as usize] - v).abs(),
                (E4M3_TO_F32[b as usize] - v).abs(),
            );
            da.partial_cmp(&db).unwrap()
        })
        .unwrap()
}

/// Copies fixture `name` into `dir` with its PLE table shards rewritten by `table`, which gets
/// each shard (index, F32 tensor) and returns the tensors stored in its place.
fn with_table(
    name: &str,
    dir: &Path,
    table: impl Fn(usize, &HostTensor) -> Vec<HostTensor>,
) -> usize {
    let ck = Checkpoint::open(&fixture_dir(name)).unwrap();
    let mut out = Vec::new();
    let mut shards = 0;
    let names: Vec<String> = ck.weights.names().map(str::to_owned).collect();
    for n in &names {
        let t = ck.weights.get(n).unwrap();
        match n
            .split("ngram_embedding.shard_")
            .nth(1)
            .and_then(|r| r.strip_suffix(".weight"))
        {
            Some(i) => {
                shards += 1;
                out.extend(table(i.parse().unwrap(), &t));
            }
            None => out.push(t),
        }
    }
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(fixture_dir(name).join(f), dir.join(f)).unwrap();
    }
    write_safetensors(&dir.join("model.safetensors"), &out).unwrap();
    shards
}

/// FP8 E4M3 codes and their scales (per row `[rows]` for shard 0, `[rows, 1]` for shard 1, one
/// per tensor from shard 2 on: the layouts ModelOpt writes), and the same values dequantized.
fn quantize_shard(i: usize, t: &HostTensor) -> (Vec<HostTensor>, HostTensor) {
    use capy_engine::quant::fp8::E4M3_TO_F32;
    let (rows, dim) = (t.shape[0], t.shape[1]);
    let v = t.to_f32().unwrap();
    let row_max: Vec<f32> = v
        .chunks_exact(dim)
        .map(|r| r.iter().fold(1e-6f32, |m, x| m.max(x.abs())))
        .collect();
    let per_tensor = i >= 2;
    let scales: Vec<f32> = if per_tensor {
        vec![row_max.iter().fold(0f32, |m, &x| m.max(x)) / 448.0]
    } else {
        row_max.iter().map(|m| m / 448.0).collect()
    };
    let scale_of = |r: usize| scales[if per_tensor { 0 } else { r }];
    let codes: Vec<u8> = v
        .iter()
        .enumerate()
        .map(|(k, x)| to_e4m3(x / scale_of(k / dim)))
        .collect();
    let dequantized: Vec<f32> = codes
        .iter()
        .enumerate()
        .map(|(k, &c)| E4M3_TO_F32[c as usize] * scale_of(k / dim))
        .collect();
    let scale_shape = match (per_tensor, i) {
        (true, _) => vec![],
        (false, 1) => vec![rows, 1],
        (false, _) => vec![rows],
    };
    let fp8 = vec![
        HostTensor {
            name: t.name.clone(),
            dtype: DType::F8E4M3,
            shape: t.shape.clone(),
            data: Bytes::from_vec(codes),
        },
        HostTensor::from_f32(&format!("{}_scale", t.name), scale_shape, &scales),
    ];
    (
        fp8,
        HostTensor::from_f32(&t.name, t.shape.clone(), &dequantized),
    )
}

#[test]
fn fp8_ngram_table_matches_the_same_table_dequantized_to_f32() {
    for name in FIXTURES {
        let fx = fixture(name);
        let (fp8_dir, f32_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let shards = with_table(name, fp8_dir.path(), |i, t| quantize_shard(i, t).0);
        assert!(shards >= 3, "{name}: the table is sharded");
        with_table(name, f32_dir.path(), |i, t| vec![quantize_shard(i, t).1]);
        let ck = Checkpoint::open(fp8_dir.path()).unwrap();
        assert!(ck
            .weights
            .store()
            .names()
            .any(|n| n.ends_with("ngram_embedding.shard_0.weight_scale")));
        let mut fp8 = Qwen4ExpText::load(CpuBackend::new(), &ck).unwrap();
        let mut f32m = load_dir(f32_dir.path());
        let a = run_chunked(&mut fp8, &fx.prompts, 5);
        let b = run_chunked(&mut f32m, &fx.prompts, 1000);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            // Row by row the FP8 reader computes exactly the dequantized values.
            let d = max_diff(x, y);
            assert!(
                d <= 1e-5,
                "{name} prompt {i}: FP8 vs dequantized F32 max |Δ| {d}"
            );
            // And the table matters: rounding it to FP8 moves the logits off the F32 reference.
            assert!(
                max_diff(x, &fx.logits[i]) > 0.0,
                "{name} prompt {i}: the FP8 table changed nothing"
            );
        }
    }
}

#[test]
fn fp8_ngram_table_without_its_scale_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    with_table("fused", dir.path(), |i, t| {
        let mut q = quantize_shard(i, t).0;
        if i == 1 {
            q.truncate(1);
        }
        q
    });
    let ck = Checkpoint::open(dir.path()).unwrap();
    let e = format!(
        "{:#}",
        Qwen4ExpText::load(CpuBackend::new(), &ck).err().unwrap()
    );
    assert!(e.contains("shard_1.weight_scale is missing"), "{e}");
}
