//! Decode steps recorded as CUDA graphs give the logits of the same steps launched op by op,
//! on both architectures' fixtures (Flash-Next's steps read the device mid-step, so they are
//! recorded in several segments), with exact and fast math; steps of one shape reuse the
//! executable graph by an in-place update. Without a CUDA driver the test prints why it is
//! skipped and passes.
#![cfg(feature = "cuda")]

use capy_engine::backend::cuda::CudaBackend;
use capy_engine::checkpoint::Checkpoint;
use capy_engine::model::{self, BatchItem, LogitsWanted};
use std::path::{Path, PathBuf};

/// Greedy steps decoded after the prompt.
const STEPS: usize = 12;

fn fixture_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for arch in ["qwen3_5_text", "qwen4_exp_text"] {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(arch);
        let mut found: Vec<PathBuf> = std::fs::read_dir(&root)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", root.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("config.json").exists())
            .collect();
        found.sort();
        assert!(!found.is_empty(), "no fixtures under {}", root.display());
        dirs.extend(found);
    }
    dirs
}

fn argmax(l: &[f32]) -> u32 {
    l.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0 as u32
}

/// The logits of a prompt's last token and of `STEPS` greedy steps after it.
fn decode(backend: &CudaBackend, ck: &Checkpoint, graphs: bool) -> Vec<Vec<f32>> {
    backend.set_cuda_graphs(graphs).unwrap();
    let mut m = model::load(backend.clone(), ck).unwrap();
    let seq = m.new_sequence();
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 50).collect();
    let mut logits = vec![m
        .forward(&[BatchItem {
            seq,
            tokens: &prompt,
            logits: LogitsWanted::Last,
        }])
        .unwrap()
        .remove(0)];
    for _ in 0..STEPS {
        let t = argmax(logits.last().unwrap());
        logits.push(
            m.forward(&[BatchItem {
                seq,
                tokens: &[t],
                logits: LogitsWanted::Last,
            }])
            .unwrap()
            .remove(0),
        );
    }
    m.drop_sequence(seq);
    logits
}

#[test]
fn graph_replayed_decode_equals_direct_launches() {
    if let Err(e) = CudaBackend::new(0, None) {
        capy_engine::backend::cuda::no_device_for_test(&format!("{e:#}"));
        return;
    }
    for dir in fixture_dirs() {
        let ck = Checkpoint::open(&dir).unwrap();
        for exact in [true, false] {
            let backend = CudaBackend::with_exact_math(0, None, exact).unwrap();
            let direct = decode(&backend, &ck, false);
            assert_eq!(backend.graph_stats().launched, 0, "graphs were off");
            let recorded = decode(&backend, &ck, true);
            let stats = backend.graph_stats();
            let name = format!("{} (exact math {exact})", dir.display());
            println!("{name}: {stats:?}");
            assert!(
                stats.launched >= STEPS as u64,
                "{name}: {} graphs launched for {STEPS} decode steps",
                stats.launched
            );
            assert!(
                stats.updated > 0,
                "{name}: no step reused its executable graph"
            );
            assert_eq!(
                stats.launched,
                stats.updated + stats.instantiated,
                "{name}: every launched graph is updated or instantiated"
            );
            for (step, (d, r)) in direct.iter().zip(&recorded).enumerate() {
                let worst = d
                    .iter()
                    .zip(r)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                // The same kernels on the same data: only an atomic's order could differ.
                assert!(
                    worst <= 1e-5,
                    "{name}: step {step}: graph logits differ by {worst:e}"
                );
                assert_eq!(argmax(d), argmax(r), "{name}: step {step}: greedy token");
            }
        }
    }
}
