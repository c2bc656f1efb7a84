//! Loading Flash-Next with hybrid expert placement: dense weights on the backend, every
//! layer's routed experts in the host expert store (in their stored format where the CPU
//! kernels read it), and a VRAM expert cache sized from what the budget leaves for experts.
//!
//! The experts are never uploaded whole: the backend only ever holds the cache's slots. With
//! room for every expert the placement is fixed (all resident, no warm-up); otherwise the
//! decayed-frequency cache decides, starting cold or from a saved hot set.

use super::expert_cache::{ExpertCache, ExpertCacheConfig};
use super::experts::{HybridExperts, Placement};
use super::host_store::pack_float_experts;
use crate::backend::cpu::experts::{ExpertPool, ExpertSet, ExpertShape};
use crate::backend::cpu::simd::Isa;
use crate::backend::Backend;
use crate::checkpoint::quant_experts::quantized_expert_set;
use crate::checkpoint::Checkpoint;
use crate::model::layers::moe::{read_expert_tensors, RoutedExperts};
use crate::model::qwen4_exp_text::Qwen4ExpText;
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// How the routed experts are placed.
#[derive(Debug, Clone)]
pub struct HybridOptions {
    /// Device bytes the expert cache may fill (the VRAM ledger's remainder for experts).
    pub cache_bytes: usize,
    /// CPU expert workers (0: one per physical core).
    pub threads: usize,
    /// Recency half-life of the cache's frequency counts, in tokens.
    pub half_life_tokens: f32,
    /// A newcomer must beat the coldest resident expert by this fraction to replace it.
    pub admit_margin: f32,
    /// A hot set saved by an earlier run ([`ExpertCache::save`]) to start warm from.
    pub hot_set: Option<PathBuf>,
}

impl Default for HybridOptions {
    fn default() -> Self {
        HybridOptions {
            cache_bytes: 0,
            threads: 0,
            half_life_tokens: 256.0,
            admit_margin: 0.1,
            hot_set: None,
        }
    }
}

/// What the loader placed where.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HybridReport {
    pub moe_layers: usize,
    pub experts_per_layer: usize,
    /// Host expert store: all layers' records.
    pub host_bytes: usize,
    /// Weight bytes of one expert as the cache holds it (its stored format).
    pub expert_bytes: usize,
    /// Slots the cache budget buys, over all layers.
    pub cache_slots: usize,
    /// Every expert resident: the placement is fixed, no cache policy runs.
    pub all_resident: bool,
    /// Row formats of the host store (gate/up, down), e.g. "nvfp4/nvfp4".
    pub formats: String,
}

/// A Flash-Next model whose routed experts run hybrid.
pub struct HybridModel<B: Backend> {
    pub model: Qwen4ExpText<B>,
    /// The shared cache policy (`None` when every expert is resident).
    pub cache: Option<Arc<Mutex<ExpertCache>>>,
    pub report: HybridReport,
}

/// One layer's routed experts as a host [`ExpertSet`]: straight from their quantized storage
/// when the kernels read it, else packed from the float tensors.
pub fn host_expert_set(ck: &Checkpoint, prefix: &str) -> Result<ExpertSet> {
    let flash = ck.config.qwen4_exp()?;
    let m = &flash.moe;
    let shape = ExpertShape {
        hidden: ck.config.hidden_size,
        intermediate: m.moe_intermediate_size,
    };
    if let Some(set) = quantized_expert_set(&ck.weights, prefix, m.num_experts, shape)? {
        return Ok(set);
    }
    let tensors = read_expert_tensors(ck, prefix, ck.config.hidden_size, m)?;
    pack_float_experts(&tensors).with_context(|| format!("packing the routed experts {prefix}*"))
}

/// The model name a hot set is saved under: the checkpoint folder's name.
pub fn hot_set_model_id(ck: &Checkpoint) -> String {
    ck.dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Loads `ck` (a `qwen4_exp_text` checkpoint) on `backend` with hybrid expert placement.
pub fn load_flash_next<B: Backend>(
    backend: B,
    ck: &Checkpoint,
    o: &HybridOptions,
) -> Result<HybridModel<B>> {
    let flash = ck.config.qwen4_exp()?;
    let layers = ck.config.num_hidden_layers;
    let experts = flash.moe.num_experts;
    // The host store first: its record size decides the cache's slot count.
    let sets: Vec<Arc<ExpertSet>> = (0..layers)
        .map(|l| {
            let prefix = format!(
                "{}layers.{l}.mlp.experts.",
                crate::model::layers::text_prefix(ck)
            );
            host_expert_set(ck, &prefix).map(Arc::new)
        })
        .collect::<Result<_>>()?;
    let layout = sets[0].layout;
    let expert_bytes = layout.weight_bytes();
    let cache_slots = o.cache_bytes / expert_bytes.max(1);
    let all_resident = cache_slots >= layers * experts;
    let cache = (!all_resident).then(|| {
        let mut c = ExpertCache::new(
            layers,
            experts,
            ExpertCacheConfig {
                slots: cache_slots,
                half_life_tokens: o.half_life_tokens,
                admit_margin: o.admit_margin,
            },
        );
        if let Some(path) = &o.hot_set {
            let warmed = ExpertCache::load_hot_set(path, &hot_set_model_id(ck), layers, experts)
                .and_then(|hot| c.warm(&hot));
            if let Err(e) = warmed {
                tracing::warn!("expert cache: starting cold: {e:#}");
            }
        }
        Arc::new(Mutex::new(c))
    });
    let pool = Arc::new(ExpertPool::new(o.threads, false));
    let isa = Isa::detect();
    let report = HybridReport {
        moe_layers: layers,
        experts_per_layer: experts,
        host_bytes: sets.iter().map(|s| s.bytes()).sum(),
        expert_bytes,
        cache_slots: cache_slots.min(layers * experts),
        all_resident,
        formats: format!("{}/{}", layout.format.name(), layout.down_format.name()),
    };
    let mut make = |device: &B, layer: usize, _prefix: &str| -> Result<Box<dyn RoutedExperts<B>>> {
        let placement = match &cache {
            Some(c) => Placement::Cached(c.clone()),
            None => Placement::Fixed(vec![true; experts]),
        };
        let h = HybridExperts::new(
            device,
            layer,
            sets[layer].clone(),
            pool.clone(),
            isa,
            placement,
        )?;
        Ok(Box::new(h))
    };
    let model = Qwen4ExpText::load_with_experts(backend, ck, Some(&mut make))?;
    Ok(HybridModel {
        model,
        cache,
        report,
    })
}
