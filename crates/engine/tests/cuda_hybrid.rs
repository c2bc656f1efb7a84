//! Hybrid expert placement on the GPU: Flash-Next's tiny fixture loaded by
//! `hybrid::load_flash_next` on the CUDA backend (exact math), with the host expert store
//! page-locked, against the reference logits and greedy tokens; and the page-locked cap.
//!
//! Without a CUDA driver (CI, laptops) each test prints why it is skipped and passes.
#![cfg(feature = "cuda")]

use capy_engine::backend::cuda::CudaBackend;
use capy_engine::backend::Backend;
use capy_engine::checkpoint::Checkpoint;
use capy_engine::hybrid::{load_flash_next, HybridModel, HybridOptions};
use capy_engine::model::{BatchItem, CausalLm, LogitsWanted};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::with_exact_math(0, None, true) {
        Ok(b) => {
            println!("running on {}", b.name());
            Some(b)
        }
        Err(e) => {
            capy_engine::backend::cuda::no_device_for_test(&format!("{e:#}"));
            None
        }
    }
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen4_exp_text/fused")
}

fn load(b: CudaBackend, cache_experts: usize, limit: Option<u64>) -> HybridModel<CudaBackend> {
    let ck = Checkpoint::open(&fixture_dir()).unwrap();
    // The expert size first (the CPU loader reports it without touching the GPU).
    let probe = load_flash_next(
        capy_engine::backend::cpu::CpuBackend::new(),
        &ck,
        &HybridOptions::default(),
    )
    .unwrap();
    let o = HybridOptions {
        // `usize::MAX` experts means "room for all": saturate instead of overflowing.
        cache_bytes: cache_experts.saturating_mul(probe.report.expert_bytes),
        threads: 4,
        half_life_tokens: 8.0,
        page_locked_limit: limit,
        ..Default::default()
    };
    load_flash_next(b, &ck, &o).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn check(model: &mut dyn CausalLm, label: &str) {
    let dir = fixture_dir();
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = expected["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        let want: Vec<f32> = std::fs::read(dir.join(format!("logits_{i}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let seq = model.new_sequence();
        let got = model
            .forward(&[BatchItem {
                seq,
                tokens: p,
                logits: LogitsWanted::All,
            }])
            .unwrap()
            .remove(0);
        model.drop_sequence(seq);
        let d = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d <= 1e-3, "{label}: prompt {i}: max |Δ| = {d}");
        // Greedy decode, token by token (the cache moves experts between steps).
        let greedy = ids(&expected["greedy"][i]);
        let seq = model.new_sequence();
        let mut next = p.clone();
        let mut out = Vec::new();
        for _ in 0..greedy.len() {
            let l = model
                .forward(&[BatchItem {
                    seq,
                    tokens: &next,
                    logits: LogitsWanted::Last,
                }])
                .unwrap()
                .remove(0);
            let t = l
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32;
            out.push(t);
            next = vec![t];
        }
        model.drop_sequence(seq);
        assert_eq!(out, greedy, "{label}: prompt {i}: greedy tokens differ");
    }
}

#[test]
fn hybrid_on_the_gpu_matches_the_reference_with_the_store_page_locked() {
    let Some(b) = gpu() else { return };
    let mut h = load(b, 6, None);
    assert!(!h.report.all_resident);
    assert_eq!(h.report.pinned_bytes, h.report.host_bytes, "{:?}", h.report);
    assert!(h.report.warning.is_none(), "{:?}", h.report.warning);
    check(&mut h.model, "gpu, 6-slot cache");
    let s = h.cache.as_ref().unwrap().lock().unwrap().stats();
    assert!(
        s.admissions >= 6 && s.hits > 0 && s.hits < s.lookups,
        "{s:?}"
    );
}

#[test]
fn all_resident_on_the_gpu_matches_the_reference() {
    let Some(b) = gpu() else { return };
    let mut h = load(b, usize::MAX, None);
    assert!(h.report.all_resident);
    check(&mut h.model, "gpu, all resident");
}

#[test]
fn a_page_locked_cap_leaves_the_rest_pageable_with_the_numbers() {
    let Some(b) = gpu() else { return };
    let ck = Checkpoint::open(&fixture_dir()).unwrap();
    let layer_bytes = load_flash_next(
        capy_engine::backend::cpu::CpuBackend::new(),
        &ck,
        &HybridOptions::default(),
    )
    .unwrap()
    .report
    .host_bytes
        / ck.config.num_hidden_layers;
    let mut h = load(b, 6, Some(layer_bytes as u64));
    assert_eq!(h.report.pinned_bytes, layer_bytes, "{:?}", h.report);
    assert_eq!(h.report.pageable_bytes, h.report.host_bytes - layer_bytes);
    let w = h
        .report
        .warning
        .clone()
        .expect("a warning with the numbers");
    assert!(w.contains("capped at") && w.contains("GiB"), "{w}");
    check(&mut h.model, "gpu, partly pageable");
}
