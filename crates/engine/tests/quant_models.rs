//! Quantized checkpoints loaded as models, against transformers run on their dequantized
//! weights.
//!
//! `tests/fixtures/quant_models/` (written by `tools/make_quant_model_fixtures.py`) holds tiny
//! `qwen3_5_text` and `qwen4_exp_text` checkpoints as ModelOpt NVFP4 and FP8 safetensors, as
//! `qwen35` GGUF files laid out as llama.cpp's converter writes them (mixed Q8_0 / Q2_0 / IQ3_S
//! / IQ3_XXS / IQ2_XS, tied and untied heads, an MTP block to ignore), and as a Flash-Next
//! folder whose routed experts come from a GGUF file; and GGUF files written by llama.cpp's own
//! converter and llama-quantize (`tests/fixtures/llamacpp_gguf/`, the `llamacpp_*` tests). Each
//! must give transformers' logits within 1e-3 and the same greedy tokens. The second half feeds
//! corrupt checkpoints and expects errors that name the tensor.

use capy_engine::backend::cpu::CpuBackend;
use capy_engine::checkpoint::{write_safetensors, Checkpoint, SafetensorStore};
use capy_engine::model::{self, BatchItem, LogitsWanted};
use capy_engine::quant::GgmlType;
use capy_engine::tensor::{DType, HostTensor};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const TOLERANCE: f32 = 1e-3;

#[derive(Deserialize)]
struct Expected {
    fixture: String,
    architecture: String,
    vocab_size: usize,
    formats: BTreeMap<String, String>,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    token_ids: Vec<u32>,
    logits_file: String,
    logits_shape: [usize; 2],
    greedy_new_tokens: Vec<u32>,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant_models")
}

/// `(model path given to Checkpoint::open, folder of expected.json)`.
fn fixture(name: &str) -> (PathBuf, PathBuf) {
    let r = root();
    match name {
        "gguf_qwen35_iq" => (
            r.join("gguf_qwen35_iq.gguf"),
            r.join("gguf_qwen35_iq.expected"),
        ),
        _ => (r.join(name), r.join(name)),
    }
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn expected(dir: &Path) -> Expected {
    let p = dir.join("expected.json");
    let text =
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

fn check(name: &str) {
    let (model_path, exp_dir) = fixture(name);
    check_files(name, &model_path, &exp_dir);
}

/// Checks the checkpoint stores what the fixture says (so a loader that ignored the
/// quantized tensors could not pass), then the logits and the greedy tokens.
fn check_files(name: &str, model_path: &Path, exp_dir: &Path) {
    let exp = expected(exp_dir);
    assert_eq!(exp.fixture, name);
    let ck = Checkpoint::open(model_path).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    assert_eq!(ck.config.architecture.model_type(), exp.architecture);
    assert_eq!(ck.config.vocab_size, exp.vocab_size);
    let mut quantized = 0;
    for (tensor, format) in &exp.formats {
        let stored = match ck.weights.gguf().and_then(|g| g.source_of(tensor)) {
            Some((t, _)) => t.ty.name().to_string(),
            None => ck
                .weights
                .store()
                .get(tensor)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .dtype
                .to_string(),
        };
        let want = match format.as_str() {
            "nvfp4" => "U8",
            "fp8_row" | "fp8_block" => "F8_E4M3",
            "bf16" => "BF16",
            f => f,
        };
        assert!(
            stored.eq_ignore_ascii_case(want),
            "{name}: {tensor} is stored as {stored}, the fixture says {format}"
        );
        if !matches!(want, "BF16" | "F32" | "F16") {
            quantized += 1;
        }
        // The model sees full precision whatever the storage.
        if ck.weights.contains(tensor) {
            let t = ck.weights.get(tensor).unwrap();
            assert!(t.dtype.is_float(), "{name}: {tensor} reads as {}", t.dtype);
        }
    }
    assert!(quantized > 0, "{name}: no quantized tensor in the fixture");
    assert!(
        !ck.weights.names().any(|n| n.ends_with("_scale")
            || n.ends_with("_scale_2")
            || n.ends_with("weight_scale_inv")),
        "{name}: scale tensors must be hidden from the model"
    );

    let mut m = model::load(CpuBackend::new(), &ck).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let v = exp.vocab_size;
    for (pi, p) in exp.prompts.iter().enumerate() {
        let want = read_f32(&exp_dir.join(&p.logits_file));
        assert_eq!(want.len(), p.logits_shape[0] * p.logits_shape[1]);
        let seq = m.new_sequence();
        let got = m
            .forward(&[BatchItem {
                seq,
                tokens: &p.token_ids,
                logits: LogitsWanted::All,
            }])
            .unwrap()
            .remove(0);
        assert_eq!(got.len(), want.len());
        let max = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            max <= TOLERANCE,
            "{name} prompt {pi}: max |Δ logits| = {max:e} > {TOLERANCE:e}"
        );
        eprintln!("{name} prompt {pi}: max |Δ logits| = {max:.2e}");
        // Greedy continuation, token by token.
        let argmax = |row: &[f32]| {
            row.iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &x)| if x > b.1 { (i, x) } else { b },
                )
                .0 as u32
        };
        let mut tokens = vec![argmax(&got[got.len() - v..])];
        while tokens.len() < p.greedy_new_tokens.len() {
            let last = [*tokens.last().unwrap()];
            let l = m
                .forward(&[BatchItem {
                    seq,
                    tokens: &last,
                    logits: LogitsWanted::Last,
                }])
                .unwrap()
                .remove(0);
            tokens.push(argmax(&l));
        }
        assert_eq!(
            tokens, p.greedy_new_tokens,
            "{name} prompt {pi}: greedy tokens differ"
        );
        m.drop_sequence(seq);
    }
}

#[test]
fn nvfp4_qwen3_5_matches_transformers() {
    check("nvfp4_qwen3_5");
}

#[test]
fn fp8_block_and_row_qwen3_5_matches_transformers() {
    check("fp8_qwen3_5");
}

#[test]
fn nvfp4_qwen4_exp_matches_transformers() {
    check("nvfp4_qwen4_exp");
}

#[test]
fn gguf_qwen35_iq_file_matches_transformers() {
    check("gguf_qwen35_iq");
}

#[test]
fn gguf_qwen35_tied_folder_matches_transformers() {
    check("gguf_qwen35_tied");
}

#[test]
fn gguf_experts_with_safetensors_rest_match_transformers() {
    check("gguf_experts_qwen4_exp");
}

#[test]
fn gguf_mtp_block_and_converter_layout_are_undone() {
    let (path, _) = fixture("gguf_qwen35_tied");
    let ck = Checkpoint::open(&path).unwrap();
    let g = ck.weights.gguf().unwrap();
    let blocks = g
        .file()
        .meta("qwen35.block_count")
        .and_then(|v| v.as_u64())
        .unwrap() as usize;
    assert_eq!(blocks, ck.config.num_hidden_layers + 1, "one MTP block");
    assert!(g.file().tensors.iter().any(|t| t.name.contains("nextn")));
    assert!(!ck
        .weights
        .names()
        .any(|n| n.contains(&format!("layers.{blocks}"))
            || n.contains(&format!("layers.{}.", blocks - 1))));
    assert!(ck.config.tie_word_embeddings && !ck.weights.contains("lm_head.weight"));
    // conv1d back to [C, 1, K]; dt_bias under its Hugging Face name.
    let conv = ck
        .weights
        .get("model.layers.0.linear_attn.conv1d.weight")
        .unwrap();
    assert_eq!(conv.shape.len(), 3);
    assert_eq!(conv.shape[1], 1);
    assert!(ck.weights.contains("model.layers.0.linear_attn.dt_bias"));
    // Layer types come from the tensors (this fixture's pattern has no interval).
    let kinds: Vec<String> = ck
        .config
        .layer_types
        .iter()
        .map(|k| format!("{k:?}"))
        .collect();
    assert_eq!(
        kinds,
        [
            "LinearAttention",
            "FullAttention",
            "LinearAttention",
            "LinearAttention",
            "FullAttention"
        ]
    );
}

// --- GGUF files written by llama.cpp itself ----------------------------------------------------
//
// `tests/fixtures/llamacpp_gguf/<name>/model.gguf` were written by llama.cpp's
// convert_hf_to_gguf.py and quantized by llama-quantize (tools/make_llamacpp_gguf_fixtures.py;
// the reference is transformers on the file's tensors dequantized by gguf-py). The path given
// to `Checkpoint::open` is the `.gguf` file, as `--model FILE.gguf` gives it.

fn llamacpp(name: &str) -> (PathBuf, PathBuf) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llamacpp_gguf")
        .join(name);
    (dir.join("model.gguf"), dir)
}

#[test]
fn llamacpp_quantized_untied_with_mtp_matches_transformers() {
    let (model, dir) = llamacpp("qwen35_untied_mtp");
    check_files("qwen35_untied_mtp", &model, &dir);
}

#[test]
fn llamacpp_quantized_tied_matches_transformers() {
    let (model, dir) = llamacpp("qwen35_tied");
    check_files("qwen35_tied", &model, &dir);
}

#[test]
fn llamacpp_files_cover_every_block_type_and_their_metadata_is_read() {
    let mut types = std::collections::BTreeSet::new();
    for (name, tied, mtp) in [("qwen35_untied_mtp", false, 1), ("qwen35_tied", true, 0)] {
        let (path, _) = llamacpp(name);
        let ck = Checkpoint::open(&path).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let g = ck.weights.gguf().unwrap();
        let f = g.file();
        let blocks = f
            .meta("qwen35.block_count")
            .and_then(|v| v.as_u64())
            .unwrap() as usize;
        assert_eq!(blocks, ck.config.num_hidden_layers + mtp, "{name}");
        assert_eq!(ck.config.tie_word_embeddings, tied, "{name}");
        assert_eq!(ck.weights.contains("lm_head.weight"), !tied, "{name}");
        // The MTP block is in the file (as the converter writes it) but no model tensor.
        let nextn = f.tensors.iter().any(|t| t.name.contains(".nextn."));
        assert_eq!(nextn, mtp > 0, "{name}");
        let last = ck.config.num_hidden_layers;
        assert!(
            !ck.weights
                .names()
                .any(|n| n.contains(&format!("layers.{last}."))),
            "{name}: the MTP block must not become a layer"
        );
        for t in &f.tensors {
            types.insert(t.ty.name().to_string());
        }
    }
    for want in ["Q8_0", "Q2_0", "IQ3_S", "IQ3_XXS", "IQ2_XS"] {
        assert!(
            types.contains(want),
            "no {want} tensor in the llama.cpp files: {types:?}"
        );
    }
}

// --- corrupt input ---------------------------------------------------------------------------

fn load_err(path: &Path) -> String {
    match Checkpoint::open(path) {
        Err(e) => format!("{e:#}"),
        Ok(ck) => match model::load(CpuBackend::new(), &ck) {
            Err(e) => format!("{e:#}"),
            Ok(_) => panic!("{} loaded although it is corrupt", path.display()),
        },
    }
}

/// A copy of a safetensors fixture with `edit` applied to its tensors.
fn edited_copy(name: &str, edit: impl Fn(&mut BTreeMap<String, HostTensor>)) -> tempfile::TempDir {
    let (src, _) = fixture(name);
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "hf_quant_config.json"] {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
    }
    let store = SafetensorStore::open_dir(&src).unwrap();
    let mut tensors: BTreeMap<String, HostTensor> = store
        .names()
        .map(|n| (n.to_owned(), store.get(n).unwrap()))
        .collect();
    edit(&mut tensors);
    let list: Vec<HostTensor> = tensors.into_values().collect();
    write_safetensors(&dir.path().join("model.safetensors"), &list).unwrap();
    dir
}

#[test]
fn nvfp4_missing_scale_is_named() {
    let w = "model.layers.1.mlp.down_proj";
    let d = edited_copy("nvfp4_qwen3_5", |t| {
        t.remove(&format!("{w}.weight_scale_2"));
    });
    let e = load_err(d.path());
    assert!(
        e.contains(&format!("{w}.weight_scale_2")) && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn nvfp4_scale_shape_mismatch_is_named() {
    let w = "model.layers.2.mlp.up_proj";
    let d = edited_copy("nvfp4_qwen3_5", |t| {
        let s = t.get_mut(&format!("{w}.weight_scale")).unwrap();
        let n = s.shape[0];
        *s = HostTensor {
            shape: vec![n / 2, s.shape[1] * 2],
            ..s.clone()
        };
    });
    let e = load_err(d.path());
    assert!(
        e.contains(&format!("{w}.weight")) && e.contains("weight_scale"),
        "{e}"
    );
}

#[test]
fn fp8_missing_scale_and_block_mismatch_are_named() {
    let w = "model.layers.0.linear_attn.in_proj_qkv";
    let d = edited_copy("fp8_qwen3_5", |t| {
        t.remove(&format!("{w}.weight_scale_inv"));
    });
    let e = load_err(d.path());
    assert!(
        e.contains(&format!("{w}.weight_scale")) && e.contains("missing"),
        "{e}"
    );

    let d = edited_copy("fp8_qwen3_5", |t| {
        let s = t.get_mut(&format!("{w}.weight_scale_inv")).unwrap();
        let v = s.to_f32().unwrap();
        *s = HostTensor::from_f32(&s.name, vec![1, v.len() - 1], &v[..v.len() - 1]);
    });
    let e = load_err(d.path());
    assert!(
        e.contains(&format!("{w}.weight")) && e.contains("blocks"),
        "{e}"
    );
}

#[test]
fn quantized_dtype_without_nvfp4_scale_is_refused() {
    // A BF16 weight next to a scale tensor: the checkpoint does not match its config.
    let w = "model.layers.1.mlp.gate_proj";
    let d = edited_copy("nvfp4_qwen3_5", |t| {
        let codes = t.get(&format!("{w}.weight")).unwrap().clone();
        let (n, half) = (codes.shape[0], codes.shape[1]);
        t.insert(
            format!("{w}.weight"),
            HostTensor::from_f32(
                &format!("{w}.weight"),
                vec![n, half * 2],
                &vec![0.0; n * half * 2],
            ),
        );
    });
    let e = load_err(d.path());
    assert!(
        e.contains(&format!("{w}.weight")) && e.contains("scale"),
        "{e}"
    );
}

/// Byte offset of tensor info `name` in a GGUF file's header: (position of its type id,
/// position of its data offset).
fn tensor_info_pos(bytes: &[u8], name: &str) -> (usize, usize) {
    let needle = name.as_bytes();
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("tensor name in header");
    let dims_at = at + needle.len();
    let n_dims = u32::from_le_bytes(bytes[dims_at..dims_at + 4].try_into().unwrap()) as usize;
    let ty = dims_at + 4 + 8 * n_dims;
    (ty, ty + 4)
}

#[test]
fn corrupt_gguf_models_are_refused_naming_the_tensor() {
    let (src, _) = fixture("gguf_qwen35_tied");
    let bytes = std::fs::read(src.join("model.gguf")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let write = |b: &[u8]| std::fs::write(&path, b).unwrap();

    // Truncated: the last tensor's data is cut off.
    write(&bytes[..bytes.len() - 100]);
    let e = load_err(&path);
    assert!(e.contains("tensor ") && e.contains("past the end"), "{e}");

    let name = "blk.2.ffn_up.weight";
    let (ty, off) = tensor_info_pos(&bytes, name);
    // Misaligned offset.
    let mut b = bytes.clone();
    let o = u64::from_le_bytes(b[off..off + 8].try_into().unwrap());
    b[off..off + 8].copy_from_slice(&(o + 1).to_le_bytes());
    write(&b);
    let e = load_err(&path);
    assert!(e.contains(name) && e.contains("alignment"), "{e}");
    // Unknown type id.
    let mut b = bytes.clone();
    b[ty..ty + 4].copy_from_slice(&12u32.to_le_bytes()); // Q4_K: not read by this engine
    write(&b);
    let e = load_err(&path);
    assert!(e.contains(name) && e.contains("Q4_K"), "{e}");
    // Shape/block mismatch: F16 rows read as Q2_0 (64-weight blocks) no longer divide.
    let mut b = bytes.clone();
    b[ty..ty + 4].copy_from_slice(&GgmlType::Q2_0.id().to_le_bytes());
    write(&b);
    let e = load_err(&path);
    assert!(e.contains(name) && e.contains("whole number"), "{e}");
}

#[test]
fn gguf_shape_that_contradicts_the_metadata_is_named() {
    // ssm.time_step_rank says 2 value heads where the tensors hold 4: the GDN untiling (and
    // the model's shape checks) must refuse the file naming a tensor.
    let (src, _) = fixture("gguf_qwen35_tied");
    let mut bytes = std::fs::read(src.join("model.gguf")).unwrap();
    let key = b"qwen35.ssm.time_step_rank";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 4); // UINT32 tag
    bytes[at + 4..at + 8].copy_from_slice(&2u32.to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let e = load_err(&path);
    assert!(
        e.contains("tensor ") && (e.contains("blk.") || e.contains("model.layers.")),
        "{e}"
    );
}

#[test]
fn llamacpp_qwen4exp_experts_beside_safetensors_match_transformers() {
    // A Flash-Next folder: the tiny fixture's config and safetensors, plus the whole-model
    // GGUF llama.cpp's converter (qwen4exp) and llama-quantize wrote; only its routed experts
    // are read.
    let (_, exp_dir) = llamacpp("qwen4exp_experts");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen4_exp_text/fused");
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    std::fs::copy(
        exp_dir.join("experts.gguf"),
        dir.path().join("experts.gguf"),
    )
    .unwrap();
    check_files("qwen4exp_experts", dir.path(), &exp_dir);
    // Alone (no config.json, no safetensors) a qwen4exp file is refused with what to do.
    let e = load_err(&exp_dir.join("experts.gguf"));
    assert!(
        e.contains("\"qwen4exp\" is not supported alone") && e.contains("beside config.json"),
        "{e}"
    );
}

#[test]
fn llamacpp_recurrent_layers_that_contradict_the_tensors_are_named() {
    // The converter writes qwen35.attention.recurrent_layers (one bool per block): flip block
    // 0's (Gated DeltaNet) to false.
    let (src, _) = llamacpp("qwen35_untied_mtp");
    let mut bytes = std::fs::read(src).unwrap();
    let key = b"qwen35.attention.recurrent_layers";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 9); // ARRAY
    assert_eq!(
        u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()),
        7
    ); // of BOOL
    assert_eq!(
        u64::from_le_bytes(bytes[at + 8..at + 16].try_into().unwrap()),
        3
    ); // 2 + MTP
    assert_eq!(&bytes[at + 16..at + 19], &[1, 0, 0]);
    bytes[at + 16] = 0;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let e = load_err(&path);
    assert!(
        e.contains("recurrent_layers[0] = false") && e.contains("block 0"),
        "{e}"
    );
}

#[test]
fn gguf_folder_without_config_is_opened_and_dtype_is_f32() {
    let (dir, _) = fixture("gguf_qwen35_tied");
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.dir, dir);
    let t = ck
        .weights
        .get("model.layers.1.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(t.dtype, DType::F32);
}

#[test]
fn quantized_experts_stay_quantized_and_multiply_like_their_dequantized_values() {
    use capy_engine::backend::cpu::experts::format::RowFormat;
    use capy_engine::backend::cpu::matmul::{linear, CpuMatrix};
    use capy_engine::model::layers::moe::load_expert_matrices;

    // Gate and up are Q8_0 in the GGUF file, down BF16 (tools/make_q8_experts_fixture.py).
    let (dir, _) = fixture("gguf_q8_experts_qwen4_exp");
    let ck = Checkpoint::open(&dir).unwrap();
    let moe = ck.config.qwen4_exp().unwrap().moe;
    let (h, inter) = (ck.config.hidden_size, moe.moe_intermediate_size);
    let b = CpuBackend::new();
    let x: Vec<f32> = (0..3 * h)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0)
        .collect();
    for layer in 0..ck.config.num_hidden_layers {
        let p = format!("model.layers.{layer}.mlp.experts.");
        let experts = load_expert_matrices(&b, &ck, &p, h, &moe).unwrap();
        assert_eq!(experts.len(), moe.num_experts);
        for (e, ex) in experts.iter().enumerate() {
            assert_eq!(
                ex.gate_up.quant_format(),
                Some(RowFormat::Ggml(GgmlType::Q8_0)),
                "{p}{e}: gate ‖ up must stay Q8_0"
            );
            // Stored size (34 bytes per 32 weights), not an f32 copy.
            assert_eq!(ex.gate_up.bytes(), 2 * inter * (h / 32) * 34);
            assert_eq!(ex.down.quant_format(), None, "{p}{e}: down is BF16");
            let gate = ck.weights.get(&format!("{p}{e}.gate_proj.weight")).unwrap();
            let up = ck.weights.get(&format!("{p}{e}.up_proj.weight")).unwrap();
            let dequantized =
                CpuMatrix::from_host(&HostTensor::concat_rows("gate_up", &[gate, up]).unwrap())
                    .unwrap();
            let (got, want) = (linear(&x, 3, &ex.gate_up), linear(&x, 3, &dequantized));
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{p}{e}: the quantized matmul differs from the dequantized one"
            );
        }
    }
    // The model built from it runs.
    let mut m = model::load(CpuBackend::new(), &ck).unwrap();
    let seq = m.new_sequence();
    let l = m
        .forward(&[BatchItem {
            seq,
            tokens: &[1, 2, 3, 4],
            logits: LogitsWanted::All,
        }])
        .unwrap()
        .remove(0);
    assert_eq!(l.len(), 4 * m.info().vocab_size);
    assert!(l.iter().all(|v| v.is_finite()));
}
