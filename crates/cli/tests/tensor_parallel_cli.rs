//! `--tp N` on the command line for a Flash-Next checkpoint: `score` with `--tp 2 --backend cpu`
//! (two CPU rank threads) gives the logits of `--tp 1` within 1e-4 and so the same greedy
//! token at every position, on a tiny `qwen4_exp_text` fixture.

use std::path::PathBuf;
use std::process::Command;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures/qwen4_exp_text/per_expert")
}

/// `score` of `ids` with `--tp tp`: the logits `[positions, vocab]` read back from the .npy.
fn score(tp: usize, ids: &str, out: &std::path::Path) -> (Vec<f32>, usize, String) {
    let npy = out.join(format!("tp{tp}.npy"));
    let run = Command::new(env!("CARGO_BIN_EXE_capy-flash"))
        .args([
            "score",
            "--model",
            fixture().to_str().unwrap(),
            "--backend",
            "cpu",
            "--tp",
            &tp.to_string(),
            "--token-ids",
            ids,
            "--logits-out",
            npy.to_str().unwrap(),
        ])
        .output()
        .expect("capy-flash runs");
    let err = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(run.status.success(), "--tp {tp}: {err}");
    let json: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let vocab = json["vocab_size"].as_u64().unwrap() as usize;
    let bytes = std::fs::read(&npy).unwrap();
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let logits = bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (logits, vocab, err)
}

fn argmax_rows(logits: &[f32], vocab: usize) -> Vec<usize> {
    logits
        .chunks_exact(vocab)
        .map(|row| {
            (0..vocab)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
                .unwrap()
        })
        .collect()
}

#[test]
fn score_with_tp2_on_flash_next_matches_tp1() {
    let dir = tempfile::tempdir().unwrap();
    // 23 tokens: past the fixture's QSA budget (12) so the sparse selection is exercised.
    let ids: Vec<String> = (0..23).map(|i| ((i * 37 + 5) % 160).to_string()).collect();
    let ids = ids.join(",");
    let (one, vocab, _) = score(1, &ids, dir.path());
    let (two, vocab2, err) = score(2, &ids, dir.path());
    assert!(err.contains("tensor parallel over 2 ranks (cpu)"), "{err}");
    assert_eq!(vocab, vocab2);
    assert_eq!(one.len(), 23 * vocab);
    assert_eq!(two.len(), one.len());
    let worst = one
        .iter()
        .zip(&two)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst <= 1e-4, "--tp 2 vs --tp 1: max |Δ| {worst}");
    assert_eq!(argmax_rows(&two, vocab), argmax_rows(&one, vocab));
}
