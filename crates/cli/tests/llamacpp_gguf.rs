//! `--model FILE.gguf` with GGUF files written by llama.cpp's own converter and quantizer
//! (crates/engine/tests/fixtures/llamacpp_gguf, tools/make_llamacpp_gguf_fixtures.py): `score`
//! gives transformers' logits, `generate` finds the tokenizer beside the file.

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures/llamacpp_gguf")
        .join(name)
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_capy-flash"))
        // The exact path: the reference is f32 math on the dequantized weights.
        .env("CAPY_EXACT_MATH", "1")
        .env(
            "CAPY_CACHE_DIR",
            std::env::temp_dir().join("capy-cli-tests-cache"),
        )
        .args(args)
        .output()
        .expect("capy-flash runs")
}

fn read_npy_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn score_a_llamacpp_gguf_file_gives_transformers_logits() {
    for name in ["qwen35_untied_mtp", "qwen35_tied"] {
        let dir = fixture(name);
        let exp: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        let model = dir.join("model.gguf");
        let tmp = tempfile::tempdir().unwrap();
        for (pi, p) in exp["prompts"].as_array().unwrap().iter().enumerate() {
            let ids: Vec<String> = p["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.to_string())
                .collect();
            let npy = tmp.path().join(format!("{pi}.npy"));
            let out = run(&[
                "score",
                "--model",
                model.to_str().unwrap(),
                "--backend",
                "cpu",
                "--token-ids",
                &ids.join(","),
                "--logits-out",
                npy.to_str().unwrap(),
            ]);
            assert!(
                out.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let got = read_npy_f32(&npy);
            let want: Vec<f32> = std::fs::read(dir.join(p["logits_file"].as_str().unwrap()))
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(got.len(), want.len(), "{name} prompt {pi}");
            let max = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(max <= 1e-3, "{name} prompt {pi}: max |Δ logits| = {max:e}");
            // The last position's argmax is transformers' first greedy token.
            let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let last = json["positions"].as_array().unwrap().last().unwrap();
            assert_eq!(
                last["argmax"], p["greedy_new_tokens"][0],
                "{name} prompt {pi}"
            );
        }
    }
}

#[test]
fn generate_from_a_llamacpp_gguf_file_uses_the_tokenizer_beside_it() {
    let model = fixture("qwen35_untied_mtp").join("model.gguf");
    let out = run(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--backend",
        "cpu",
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.stdout.is_empty(), "no text generated");
}
