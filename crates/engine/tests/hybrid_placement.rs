//! Expert placement never changes the result: the qwen4_exp_text fixtures give the reference
//! logits (transformers) and the same greedy tokens with every routed expert on the "resident"
//! side, all on the CPU expert kernels, a fixed mix, and behind the VRAM expert cache from cold
//! (admissions and evictions while the prompts run). On a machine without a GPU the resident
//! side is the CPU backend: the same code path the GPU takes, with a CPU stand-in.

use capy_engine::backend::cpu::experts::ExpertPool;
use capy_engine::backend::cpu::simd::Isa;
use capy_engine::backend::cpu::CpuBackend;
use capy_engine::checkpoint::Checkpoint;
use capy_engine::hybrid::host_store::pack_float_experts;
use capy_engine::hybrid::{
    load_flash_next, ExpertCache, ExpertCacheConfig, HybridExperts, HybridModel, HybridOptions,
    Placement,
};
use capy_engine::model::layers::moe::read_expert_tensors;
use capy_engine::model::layers::text_prefix;
use capy_engine::model::qwen4_exp_text::Qwen4ExpText;
use capy_engine::model::{BatchItem, CausalLm, LogitsWanted};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const LOGIT_TOLERANCE: f32 = 1e-3;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen4_exp_text/fused")
}

struct Reference {
    prompts: Vec<Vec<u32>>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<Vec<u32>>,
}

fn reference() -> Reference {
    let dir = fixture_dir();
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
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
    let logits = (0..prompts.len())
        .map(|i| {
            std::fs::read(dir.join(format!("logits_{i}.f32")))
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
        .collect();
    Reference {
        prompts,
        logits,
        greedy,
    }
}

enum How {
    AllResident,
    AllHost,
    /// Even experts resident, odd ones on the host.
    Mixed,
    /// The expert cache with this many slots over all layers, starting cold.
    Cache(usize),
}

fn model_with(how: How) -> (Qwen4ExpText<CpuBackend>, Option<Arc<Mutex<ExpertCache>>>) {
    let ck = Checkpoint::open(&fixture_dir()).unwrap();
    let mut model = Qwen4ExpText::load(CpuBackend::new(), &ck).unwrap();
    let moe = model.flash.moe.clone();
    let hidden = ck.config.hidden_size;
    let layers = model.layers.len();
    let pool = Arc::new(ExpertPool::new(2, false));
    let cache = match how {
        How::Cache(slots) => Some(Arc::new(Mutex::new(ExpertCache::new(
            layers,
            moe.num_experts,
            ExpertCacheConfig {
                slots,
                half_life_tokens: 8.0,
                admit_margin: 0.1,
            },
        )))),
        _ => None,
    };
    let b = CpuBackend::new();
    for l in 0..layers {
        let prefix = format!("{}layers.{l}.mlp.experts.", text_prefix(&ck));
        let tensors = read_expert_tensors(&ck, &prefix, hidden, &moe).unwrap();
        let host = Arc::new(pack_float_experts(&tensors).unwrap());
        let placement = match (&how, &cache) {
            (How::AllResident, _) => Placement::Fixed(vec![true; moe.num_experts]),
            (How::AllHost, _) => Placement::Fixed(vec![false; moe.num_experts]),
            (How::Mixed, _) => Placement::Fixed((0..moe.num_experts).map(|e| e % 2 == 0).collect()),
            (How::Cache(_), Some(c)) => Placement::Cached(c.clone()),
            (How::Cache(_), None) => unreachable!(),
        };
        let experts =
            HybridExperts::new(&b, l, host, pool.clone(), Isa::detect(), placement).unwrap();
        model.layers[l].moe.set_experts(Box::new(experts));
    }
    (model, cache)
}

fn logits_of(model: &mut dyn CausalLm, prompt: &[u32]) -> Vec<f32> {
    let seq = model.new_sequence();
    let out = model
        .forward(&[BatchItem {
            seq,
            tokens: prompt,
            logits: LogitsWanted::All,
        }])
        .unwrap();
    model.drop_sequence(seq);
    out.into_iter().next().unwrap()
}

fn greedy_of(model: &mut dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let vocab = model.info().vocab_size;
    let seq = model.new_sequence();
    let mut tokens = Vec::new();
    let mut next: Vec<u32> = prompt.to_vec();
    for _ in 0..n {
        let l = model
            .forward(&[BatchItem {
                seq,
                tokens: &next,
                logits: LogitsWanted::Last,
            }])
            .unwrap()
            .remove(0);
        assert_eq!(l.len(), vocab);
        let t = l
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        tokens.push(t);
        next = vec![t];
    }
    model.drop_sequence(seq);
    tokens
}

fn check(how: How, label: &str) -> Option<Arc<Mutex<ExpertCache>>> {
    let (mut model, cache) = model_with(how);
    check_model(&mut model, label);
    cache
}

/// Every fixture prompt's logits and greedy tokens against the reference.
fn check_model(model: &mut dyn CausalLm, label: &str) {
    let r = reference();
    for (i, p) in r.prompts.iter().enumerate() {
        let got = logits_of(model, p);
        let d = got
            .iter()
            .zip(&r.logits[i])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            d <= LOGIT_TOLERANCE,
            "{label}: prompt {i} ({} tokens): max |Δ| = {d}",
            p.len()
        );
        let g = greedy_of(model, p, r.greedy[i].len());
        assert_eq!(g, r.greedy[i], "{label}: prompt {i}: greedy tokens differ");
    }
}

#[test]
fn all_resident_matches_the_reference() {
    check(How::AllResident, "all resident");
}

#[test]
fn all_on_cpu_kernels_matches_the_reference() {
    check(How::AllHost, "all host");
}

#[test]
fn mixed_placement_matches_the_reference() {
    check(How::Mixed, "mixed");
}

#[test]
fn cold_then_warm_cache_matches_the_reference() {
    let cache = check(How::Cache(6), "expert cache").unwrap();
    let s = cache.lock().unwrap().stats();
    // The cache really moved experts while the prompts ran: both sides computed.
    assert!(s.admissions >= 6, "{s:?}");
    assert!(s.hits > 0 && s.hits < s.lookups, "{s:?}");
}

/// The loader's path: host store packed from the checkpoint, cache sized from a byte budget.
fn loaded(cache_bytes: usize, hot_set: Option<PathBuf>) -> HybridModel<CpuBackend> {
    let ck = Checkpoint::open(&fixture_dir()).unwrap();
    let o = HybridOptions {
        cache_bytes,
        threads: 2,
        half_life_tokens: 8.0,
        hot_set,
        ..Default::default()
    };
    load_flash_next(CpuBackend::new(), &ck, &o).unwrap()
}

#[test]
fn hybrid_loader_with_a_small_cache_matches_the_reference() {
    let probe = loaded(0, None);
    let six = 6 * probe.report.expert_bytes;
    let mut h = loaded(six, None);
    assert!(!h.report.all_resident);
    assert_eq!(h.report.cache_slots, 6);
    assert_eq!(
        h.report.host_bytes, probe.report.host_bytes,
        "the host store holds every expert whatever the cache size"
    );
    check_model(&mut h.model, "loader, 6 slots");
    let s = h.cache.as_ref().unwrap().lock().unwrap().stats();
    assert!(
        s.admissions >= 6 && s.hits > 0 && s.hits < s.lookups,
        "{s:?}"
    );
}

#[test]
fn hybrid_loader_with_room_for_every_expert_fixes_them_resident() {
    let mut h = loaded(usize::MAX / 2, None);
    assert!(h.report.all_resident && h.cache.is_none());
    assert_eq!(
        h.report.cache_slots,
        h.report.moe_layers * h.report.experts_per_layer
    );
    check_model(&mut h.model, "loader, all resident");
}

#[test]
fn a_saved_hot_set_starts_the_cache_warm() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hot.json");
    let probe = loaded(0, None);
    let budget = 6 * probe.report.expert_bytes;
    let ck = Checkpoint::open(&fixture_dir()).unwrap();
    let prompt = reference().prompts[0].clone();

    // A cold start: the first forward pass finds nothing resident.
    let mut cold = loaded(budget, None);
    logits_of(&mut cold.model, &prompt);
    let c = cold.cache.as_ref().unwrap().lock().unwrap();
    assert_eq!(c.stats().hits, 0, "{:?}", c.stats());
    c.save_hot_set(&path, &capy_engine::hybrid::load::hot_set_model_id(&ck))
        .unwrap();
    drop(c);

    // A warm start from the saved set: the same pass hits at once, and the result is the same.
    let mut warm = loaded(budget, Some(path));
    assert!(
        warm.cache
            .as_ref()
            .unwrap()
            .lock()
            .unwrap()
            .resident_count()
            > 0
    );
    logits_of(&mut warm.model, &prompt);
    let s = warm.cache.as_ref().unwrap().lock().unwrap().stats();
    assert!(s.hits > 0, "{s:?}");
    check_model(&mut warm.model, "loader, warm start");
}

#[test]
fn a_returning_sessions_heat_prefetches_its_experts() {
    let probe = loaded(0, None);
    let budget = 6 * probe.report.expert_bytes;
    let prompt = reference().prompts[0].clone();
    // The session's first turn: its routing heat is read at the end.
    let mut first = loaded(budget, None);
    let seq = first.model.new_sequence();
    first
        .model
        .forward(&[BatchItem {
            seq,
            tokens: &prompt,
            logits: LogitsWanted::Last,
        }])
        .unwrap();
    let heat = first
        .model
        .routing_heat(seq)
        .expect("a hybrid model has heat");
    assert!(!heat.is_empty());
    // It returns to a cold cache: the heat is prefetched before its prompt runs.
    let mut back = loaded(budget, None);
    back.model.prefetch_experts(&heat);
    let cache = back.cache.clone().unwrap();
    assert!(cache.lock().unwrap().resident_count() > 0);
    logits_of(&mut back.model, &prompt);
    assert!(cache.lock().unwrap().stats().hits > 0);
    check_model(&mut back.model, "after a session's prefetch");
}
