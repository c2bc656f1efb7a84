//! The CLI end to end: good input works, bad input gives a clear error and a non-zero exit,
//! never a panic.

use std::path::PathBuf;
use std::process::{Command, Output};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_capy-flash"));
    // Keep generated demo models out of the user's cache.
    c.env(
        "CAPY_CACHE_DIR",
        std::env::temp_dir().join("capy-cli-tests-cache"),
    );
    c
}

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures/qwen3_5_text/gqa4x2_gdn2x4_rot25")
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("capy-flash runs")
}

fn assert_clean_failure(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success; stderr: {err}"
    );
    assert!(!err.contains("panicked"), "must not panic: {err}");
    assert!(
        err.contains(needle),
        "stderr should mention {needle:?}: {err}"
    );
}

#[test]
fn score_token_ids_writes_logits_npy_matching_json() {
    let dir = tempfile::tempdir().unwrap();
    let npy = dir.path().join("logits.npy");
    let out = run(&[
        "score",
        "--model",
        fixture().to_str().unwrap(),
        "--token-ids",
        "1,2,3,4",
        "--logits-out",
        npy.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["tokens"], 4);
    let vocab = json["vocab_size"].as_u64().unwrap() as usize;
    let bytes = std::fs::read(&npy).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(
        header.contains(&format!("'shape': (4, {vocab})")),
        "{header}"
    );
    assert_eq!(
        (10 + header_len) % 64,
        0,
        "npy header must be 64-byte aligned"
    );
    assert_eq!(bytes.len() - 10 - header_len, 4 * vocab * 4);
    // The JSON's log-probability of token 2 after token 1 agrees with the raw logits.
    let row0: Vec<f32> = bytes[10 + header_len..10 + header_len + vocab * 4]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let max = row0.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + row0.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
    let lp = json["positions"][0]["next_token_logprob"].as_f64().unwrap() as f32;
    assert!(
        (lp - (row0[2] - lse)).abs() < 1e-4,
        "{lp} vs {}",
        row0[2] - lse
    );
}

#[test]
fn bad_inputs_fail_cleanly() {
    let fx = fixture();
    let fx = fx.to_str().unwrap();
    assert_clean_failure(
        &run(&["score", "--model", "/nonexistent/model", "--token-ids", "1"]),
        "does not exist",
    );
    assert_clean_failure(
        &run(&["score", "--model", fx, "--token-ids", "1,99999"]),
        "token id 99999 is out of range",
    );
    assert_clean_failure(
        &run(&["score", "--model", fx, "--text", "hi"]),
        "tokenizer.json",
    );
    assert_clean_failure(
        &run(&["generate", "--model", fx, "--prompt", ""]),
        "prompt is empty",
    );
    // bench gpu --tp: refused before any GPU is touched.
    assert_clean_failure(
        &run(&["bench", "gpu", "--tp-on-one-gpu"]),
        "give --tp 2 or more",
    );
    assert_clean_failure(
        &run(&["bench", "gpu", "--tp", "0"]),
        "--tp must be at least 1",
    );
    assert_clean_failure(
        &run(&[
            "bench",
            "gpu",
            "--synthetic",
            "qwen3.8-flash-next",
            "--tp",
            "2",
        ]),
        "splits the dense synthetic shape",
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fx.to_string() + "/config.json",
        dir.path().join("config.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json",
    )
    .unwrap();
    assert_clean_failure(
        &run(&[
            "score",
            "--model",
            dir.path().to_str().unwrap(),
            "--token-ids",
            "1",
        ]),
        "not a valid safetensors file",
    );
}

#[test]
fn generate_with_the_demo_model_is_deterministic_for_a_seed() {
    let args = [
        "generate",
        "--model",
        "demo",
        "--prompt",
        "Hello",
        "--chat",
        "--max-tokens",
        "8",
        "--temperature",
        "0.8",
        "--seed",
        "42",
    ];
    let a = run(&args);
    let b = run(&args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert!(
        String::from_utf8_lossy(&a.stderr).contains("gibberish"),
        "the demo says once that it is random"
    );
    assert_eq!(a.stdout, b.stdout);
    assert!(!a.stdout.is_empty());
}

#[test]
fn generate_with_the_moe_demo_model_is_deterministic_for_a_seed() {
    let args = [
        "generate",
        "--model",
        "demo-moe",
        "--prompt",
        "Hello",
        "--chat",
        "--max-tokens",
        "6",
        "--temperature",
        "0.8",
        "--seed",
        "7",
    ];
    let a = run(&args);
    let b = run(&args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert!(
        String::from_utf8_lossy(&a.stderr).contains("gibberish"),
        "the demo says once that it is random"
    );
    assert_eq!(a.stdout, b.stdout);
    assert!(!a.stdout.is_empty());
    // Another seed samples other tokens from the same model.
    let mut other = args;
    other[11] = "8";
    assert_ne!(run(&other).stdout, a.stdout);
}

#[test]
fn backend_cpu_runs_and_bad_backend_flags_fail_cleanly() {
    let out = run(&[
        "generate",
        "--model",
        "demo",
        "--backend",
        "cpu",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("--backend auto"), "{err}");
    let fixture = fixture();
    let fixture = fixture.to_str().unwrap();
    let out = run(&[
        "score",
        "--model",
        fixture,
        "--backend",
        "cpu",
        "--token-ids",
        "1,2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_clean_failure(
        &run(&[
            "score",
            "--model",
            fixture,
            "--backend",
            "tpu",
            "--token-ids",
            "1",
        ]),
        "possible values: auto, cpu, cuda",
    );
    assert_clean_failure(
        &run(&["serve", "--model", "demo", "--vram-budget", "15 parsecs"]),
        "unknown size unit",
    );
}

/// Without a CUDA driver (CI), `--backend cuda` is a clear error before anything is served, and
/// `auto` runs on the CPU with a note saying why. (On a GPU machine there is nothing to check.)
#[test]
fn backend_cuda_without_a_driver_is_a_clear_error_and_auto_falls_back() {
    if capy_engine::backend::cuda::driver_version().is_ok() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let needle = "--backend cuda: no usable CUDA GPU: no CUDA driver found";
    let generate = run(&[
        "generate",
        "--model",
        "demo",
        "--backend",
        "cuda",
        "--prompt",
        "hi",
    ]);
    assert_clean_failure(&generate, needle);
    assert_clean_failure(&generate, "Use --backend cpu");
    // Port 9 (discard) is never bound: the error comes before the listener.
    let serve = run(&[
        "serve",
        "--model",
        "demo",
        "--backend",
        "cuda",
        "--port",
        "9",
    ]);
    assert_clean_failure(&serve, needle);
    assert!(!String::from_utf8_lossy(&serve.stderr).contains("serving"));
    let auto = run(&[
        "generate",
        "--model",
        "demo",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ]);
    let err = String::from_utf8_lossy(&auto.stderr);
    assert!(auto.status.success(), "{err}");
    assert!(
        err.contains(
            "note: --backend auto: running on the CPU, no usable CUDA GPU (no CUDA driver found"
        ),
        "{err}"
    );
}

#[test]
fn score_with_the_moe_demo_model_is_reproducible() {
    let dir = tempfile::tempdir().unwrap();
    let score = |name: &str| {
        let npy = dir.path().join(name);
        let out = run(&[
            "score",
            "--model",
            "demo-moe",
            "--text",
            "Hello there, Flash-Next",
            "--logits-out",
            npy.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (json, std::fs::read(&npy).unwrap())
    };
    let (a, la) = score("a.npy");
    let (b, lb) = score("b.npy");
    assert!(a["tokens"].as_u64().unwrap() > 1, "{a}");
    assert_eq!(a, b);
    assert_eq!(la, lb);
    assert_eq!(&la[..6], b"\x93NUMPY");
}
