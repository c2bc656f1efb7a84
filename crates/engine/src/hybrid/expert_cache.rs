//! Which routed experts stay resident in VRAM: frequency with recency decay.
//!
//! Every (layer, expert) has a decayed use count `s = Σ_uses 2^(−age / half_life)`, age in
//! observed tokens. Plain LRU thrashes on MoE routing (a long tail of one-off experts evicts
//! the hot set); plain LFU never forgets a topic the conversation has left. The decayed count
//! keeps the experts that are both frequent and recent.
//!
//! Implementation: instead of decaying every score each step, a use at tick `t` adds
//! `2^(t / half_life)` to a stored key (the global time frame), so the ordering of keys equals
//! the ordering of decayed scores at any common "now" and only the used expert's key changes.
//! Keys are rescaled when they grow large. Resident experts sit in a `BTreeSet` ordered by key,
//! so the eviction candidate (the coldest resident) is found in O(log n).
//!
//! The policy is pure bookkeeping: it says which experts hit, which missed, and which to copy
//! in or drop; the engine carries out the copies (on a copy stream) and computes misses on the
//! CPU. Per-session heat ([`ExpertCache::heat`], [`ExpertCache::warm`]) lets the agent caches
//! save a session's hot set and prefetch it when the session returns.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};

/// Settings of the VRAM expert cache.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertCacheConfig {
    /// Experts that fit in VRAM, over all layers (0 disables the cache: everything on CPU).
    pub slots: usize,
    /// Tokens after which a use counts half.
    pub half_life_tokens: f32,
    /// A missed expert replaces the coldest resident only when its score is this much higher
    /// (0.25 = 25 %): hysteresis, so two experts of equal heat do not swap back and forth.
    pub admit_margin: f32,
}

impl Default for ExpertCacheConfig {
    fn default() -> Self {
        ExpertCacheConfig {
            slots: 0,
            half_life_tokens: 256.0,
            admit_margin: 0.25,
        }
    }
}

/// Counters for `/metrics` and the bench output.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ExpertCacheStats {
    /// (token, expert) pairs looked up.
    pub lookups: u64,
    /// Of those, served by a resident expert.
    pub hits: u64,
    pub admissions: u64,
    pub evictions: u64,
    /// Tokens observed (for "CPU experts per token").
    pub tokens: u64,
}

impl ExpertCacheStats {
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }
    /// Routed pairs computed on the CPU per token, over all layers.
    pub fn cpu_experts_per_token(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            (self.lookups - self.hits) as f64 / self.tokens as f64
        }
    }
}

/// What one layer's routing means for the cache.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decision {
    /// Distinct experts of the step that are resident now (compute on the GPU).
    pub resident: Vec<u32>,
    /// Distinct experts of the step that are not (compute on the CPU this step).
    pub host: Vec<u32>,
    /// Experts to copy into VRAM now, usable from the next step.
    pub admit: Vec<u32>,
    /// Experts whose VRAM slot is given up (before the admissions are copied in).
    pub evict: Vec<(usize, u32)>,
}

/// What warming the cache with a session's heat asks the engine to do.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Warmed {
    /// (layer, expert) to copy into VRAM.
    pub admit: Vec<(usize, u32)>,
    /// (layer, expert) whose slots are given up first.
    pub evict: Vec<(usize, u32)>,
}

/// `f32` with a total order, for the resident set's keys.
#[derive(Debug, Clone, Copy)]
struct Key(f32);
impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.0.total_cmp(&other.0).is_eq()
    }
}
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Key {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// The VRAM expert cache's policy for a model with `layers × experts` routed experts.
pub struct ExpertCache {
    config: ExpertCacheConfig,
    layers: usize,
    experts: usize,
    /// Stored key per (layer, expert): decayed count scaled by `2^(tick0 / half_life)`.
    key: Vec<f32>,
    resident: Vec<bool>,
    /// Resident experts ordered by key (coldest first): (key, layer · experts + expert).
    order: BTreeSet<(Key, u32)>,
    /// Tokens since the last rescale.
    tick: f64,
    stats: ExpertCacheStats,
}

/// Above this weight the keys are rescaled (f32 has ~2^127 of range).
const RESCALE_AT: f32 = 1e30;

impl ExpertCache {
    pub fn new(layers: usize, experts: usize, config: ExpertCacheConfig) -> ExpertCache {
        ExpertCache {
            config,
            layers,
            experts,
            key: vec![0.0; layers * experts],
            resident: vec![false; layers * experts],
            order: BTreeSet::new(),
            tick: 0.0,
            stats: ExpertCacheStats::default(),
        }
    }

    pub fn config(&self) -> ExpertCacheConfig {
        self.config
    }
    pub fn stats(&self) -> ExpertCacheStats {
        self.stats
    }
    pub fn resident_count(&self) -> usize {
        self.order.len()
    }
    pub fn is_resident(&self, layer: usize, expert: u32) -> bool {
        self.resident[self.index(layer, expert)]
    }
    /// Resident experts of `layer`, in increasing id order.
    pub fn resident_in(&self, layer: usize) -> Vec<u32> {
        (0..self.experts as u32)
            .filter(|&e| self.is_resident(layer, e))
            .collect()
    }

    fn index(&self, layer: usize, expert: u32) -> usize {
        assert!(
            layer < self.layers && (expert as usize) < self.experts,
            "expert ({layer}, {expert}) outside {} layers × {} experts",
            self.layers,
            self.experts
        );
        layer * self.experts + expert as usize
    }

    /// The weight of a use now, in the stored keys' frame.
    fn weight_now(&self) -> f32 {
        (self.tick / self.config.half_life_tokens as f64).exp2() as f32
    }

    /// The decayed score of an expert now (uses count 1 when fresh, ½ after a half-life).
    pub fn score(&self, layer: usize, expert: u32) -> f32 {
        self.key[self.index(layer, expert)] / self.weight_now()
    }

    fn set_key(&mut self, i: usize, key: f32) {
        if self.resident[i] {
            self.order.remove(&(Key(self.key[i]), i as u32));
            self.order.insert((Key(key), i as u32));
        }
        self.key[i] = key;
    }

    /// Divides every key by the current weight so the frame starts again at 1.
    fn rescale(&mut self) {
        let w = self.weight_now();
        let keys: Vec<f32> = self.key.iter().map(|k| k / w).collect();
        self.order = self
            .order
            .iter()
            .map(|&(_, i)| (Key(keys[i as usize]), i))
            .collect();
        self.key = keys;
        self.tick = 0.0;
    }

    /// Advances time by `tokens` (call once per step, before that step's layers).
    pub fn advance(&mut self, tokens: usize) {
        self.tick += tokens as f64;
        self.stats.tokens += tokens as u64;
        if self.weight_now() > RESCALE_AT {
            self.rescale();
        }
    }

    /// Records one layer's routing (`ids`: every routed (token, expert) pair of the step) and
    /// decides hits, misses, admissions and evictions.
    pub fn observe(&mut self, layer: usize, ids: &[u32]) -> Decision {
        let w = self.weight_now();
        let mut d = Decision::default();
        let mut distinct: Vec<u32> = ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        for &e in ids {
            let i = self.index(layer, e);
            self.stats.lookups += 1;
            if self.resident[i] {
                self.stats.hits += 1;
            }
            let k = self.key[i] + w;
            self.set_key(i, k);
        }
        for &e in &distinct {
            let i = self.index(layer, e);
            if self.resident[i] {
                d.resident.push(e);
            } else {
                d.host.push(e);
            }
        }
        // Admit the hottest misses first.
        let mut misses = d.host.clone();
        misses.sort_by(|&a, &b| {
            let (ka, kb) = (
                self.key[self.index(layer, a)],
                self.key[self.index(layer, b)],
            );
            kb.total_cmp(&ka).then(a.cmp(&b))
        });
        for e in misses {
            if self.try_admit(self.index(layer, e), &mut d.evict) {
                d.admit.push(e);
            }
        }
        d.admit.sort_unstable();
        d
    }

    /// Admits expert `i` if a slot is free or it beats the coldest resident by the margin.
    fn try_admit(&mut self, i: usize, evicted: &mut Vec<(usize, u32)>) -> bool {
        if self.config.slots == 0 || self.resident[i] {
            return false;
        }
        if self.order.len() >= self.config.slots {
            let &(Key(cold_key), cold) = self.order.first().expect("slots > 0");
            if self.key[i] <= cold_key * (1.0 + self.config.admit_margin) {
                return false;
            }
            self.order.remove(&(Key(cold_key), cold));
            self.resident[cold as usize] = false;
            self.stats.evictions += 1;
            evicted.push((
                cold as usize / self.experts,
                (cold as usize % self.experts) as u32,
            ));
        }
        self.resident[i] = true;
        self.order.insert((Key(self.key[i]), i as u32));
        self.stats.admissions += 1;
        true
    }

    /// Lookahead: the next layer's router already chose `ids`; admit what qualifies so the copy
    /// overlaps this layer's compute. Does not count as lookups.
    pub fn prefetch(&mut self, layer: usize, ids: &[u32]) -> Decision {
        let mut d = Decision::default();
        let mut distinct = ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        for e in distinct {
            if self.try_admit(self.index(layer, e), &mut d.evict) {
                d.admit.push(e);
            }
        }
        d
    }

    /// The `n` hottest experts with their scores now (a session's heat, saved with it).
    pub fn heat(&self, n: usize) -> Vec<HeatEntry> {
        let w = self.weight_now();
        let mut all: Vec<HeatEntry> = self
            .key
            .iter()
            .enumerate()
            .filter(|(_, &k)| k > 0.0)
            .map(|(i, &k)| HeatEntry {
                layer: (i / self.experts) as u32,
                expert: (i % self.experts) as u32,
                score: k / w,
            })
            .collect();
        all.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then((a.layer, a.expert).cmp(&(b.layer, b.expert)))
        });
        all.truncate(n);
        all
    }

    /// A returning session's heat: raises each entry's score to at least its saved score and
    /// admits what qualifies (hottest first). Returns what to copy in and what to drop.
    pub fn warm(&mut self, heat: &[HeatEntry]) -> Result<Warmed> {
        let w = self.weight_now();
        let mut d = Warmed::default();
        let mut sorted = heat.to_vec();
        sorted.sort_by(|a, b| b.score.total_cmp(&a.score));
        for h in &sorted {
            if h.layer as usize >= self.layers || h.expert as usize >= self.experts {
                bail!(
                    "expert heat names expert ({}, {}) but the model has {} layers × {} experts",
                    h.layer,
                    h.expert,
                    self.layers,
                    self.experts
                );
            }
            let i = self.index(h.layer as usize, h.expert);
            let k = self.key[i].max(h.score * w);
            self.set_key(i, k);
        }
        for h in &sorted {
            let i = self.index(h.layer as usize, h.expert);
            if self.try_admit(i, &mut d.evict) {
                d.admit.push((h.layer as usize, h.expert));
            }
        }
        Ok(d)
    }

    /// Saves the hot set (to preload at the next start).
    pub fn save_hot_set(&self, path: &Path, model_id: &str) -> Result<()> {
        let file = HotSetFile {
            format: HOT_SET_FORMAT,
            model_id: model_id.to_string(),
            layers: self.layers,
            experts: self.experts,
            entries: self.heat(self.config.slots.max(1) * 2),
        };
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(&file)?)
            .with_context(|| format!("writing the expert hot set to {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("moving the expert hot set into {}", path.display()))?;
        Ok(())
    }

    /// Reads a hot set saved by [`ExpertCache::save_hot_set`]; refuses another model's.
    pub fn load_hot_set(
        path: &Path,
        model_id: &str,
        layers: usize,
        experts: usize,
    ) -> Result<Vec<HeatEntry>> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("reading the expert hot set {}", path.display()))?;
        let file: HotSetFile = serde_json::from_slice(&bytes).with_context(|| {
            format!(
                "{} is not an expert hot set (delete it; it is rebuilt at stop)",
                path.display()
            )
        })?;
        if file.format != HOT_SET_FORMAT
            || file.model_id != model_id
            || file.layers != layers
            || file.experts != experts
        {
            bail!(
                "{} was saved for model {:?} ({} layers × {} experts, format {}); this is {model_id:?} ({layers} × {experts}, format {HOT_SET_FORMAT}); ignoring it",
                path.display(),
                file.model_id,
                file.layers,
                file.experts,
                file.format
            );
        }
        Ok(file.entries)
    }
}

/// One expert's heat.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HeatEntry {
    pub layer: u32,
    pub expert: u32,
    pub score: f32,
}

const HOT_SET_FORMAT: u32 = 1;

#[derive(Serialize, Deserialize)]
struct HotSetFile {
    format: u32,
    model_id: String,
    layers: usize,
    experts: usize,
    entries: Vec<HeatEntry>,
}

/// The expert caches of the loaded models, for `/metrics` (held weakly: a dropped model's
/// cache leaves the sums), each with the bytes one expert copy moves and the GPU it is on.
static METRICS_REGISTRY: Mutex<Vec<Registered>> = Mutex::new(Vec::new());

struct Registered {
    cache: Weak<Mutex<ExpertCache>>,
    expert_bytes: usize,
    device: usize,
}

/// Expert cache figures summed over the loaded models (or over one GPU's caches).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ExpertCacheMetrics {
    pub stats: ExpertCacheStats,
    pub resident: usize,
    pub slots: usize,
    /// Host-to-device bytes the admissions copied.
    pub bytes_copied: u64,
}

impl ExpertCacheMetrics {
    fn add(&mut self, c: &ExpertCache, expert_bytes: usize) {
        let s = c.stats();
        self.stats.lookups += s.lookups;
        self.stats.hits += s.hits;
        self.stats.admissions += s.admissions;
        self.stats.evictions += s.evictions;
        self.stats.tokens += s.tokens;
        self.resident += c.resident_count();
        self.slots += c.config().slots;
        self.bytes_copied += s.admissions * expert_bytes as u64;
    }
}

/// Makes `cache` (on GPU `device`) visible to [`expert_cache_metrics`]; `expert_bytes` is one
/// expert's copy size.
pub fn register_for_metrics(cache: &Arc<Mutex<ExpertCache>>, expert_bytes: usize, device: usize) {
    let mut r = METRICS_REGISTRY.lock().expect("expert cache registry");
    r.retain(|e| e.cache.strong_count() > 0);
    r.push(Registered {
        cache: Arc::downgrade(cache),
        expert_bytes,
        device,
    });
}

/// The registered caches' figures summed, or `None` when no hybrid model is loaded.
pub fn expert_cache_metrics() -> Option<ExpertCacheMetrics> {
    let by_device = expert_cache_metrics_by_device();
    (!by_device.is_empty()).then(|| {
        let mut total = ExpertCacheMetrics::default();
        for (_, m) in &by_device {
            total.stats.lookups += m.stats.lookups;
            total.stats.hits += m.stats.hits;
            total.stats.admissions += m.stats.admissions;
            total.stats.evictions += m.stats.evictions;
            total.stats.tokens += m.stats.tokens;
            total.resident += m.resident;
            total.slots += m.slots;
            total.bytes_copied += m.bytes_copied;
        }
        total
    })
}

/// The registered caches' figures per GPU (tensor parallelism splits the cache across the
/// cards), in device order; empty when no hybrid model is loaded.
pub fn expert_cache_metrics_by_device() -> Vec<(usize, ExpertCacheMetrics)> {
    let r = METRICS_REGISTRY.lock().expect("expert cache registry");
    let mut out: Vec<(usize, ExpertCacheMetrics)> = Vec::new();
    for e in r.iter() {
        let Some(cache) = e.cache.upgrade() else {
            continue;
        };
        let c = cache.lock().expect("expert cache");
        let i = match out.iter().position(|(d, _)| *d == e.device) {
            Some(i) => i,
            None => {
                out.push((e.device, ExpertCacheMetrics::default()));
                out.len() - 1
            }
        };
        out[i].1.add(&c, e.expert_bytes);
    }
    out.sort_by_key(|(d, _)| *d);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn metrics_sum_the_live_caches_and_forget_dropped_ones() {
        let config = ExpertCacheConfig {
            slots: 2,
            half_life_tokens: 8.0,
            admit_margin: 0.0,
        };
        let cache = Arc::new(Mutex::new(ExpertCache::new(1, 4, config)));
        register_for_metrics(&cache, 1000, 0);
        {
            let mut c = cache.lock().unwrap();
            c.advance(1);
            c.observe(0, &[1, 2]);
            c.advance(1);
            c.observe(0, &[1, 2]);
        }
        let m = expert_cache_metrics().expect("a registered cache");
        let s = cache.lock().unwrap().stats();
        assert_eq!(m.stats, s);
        assert!(s.admissions > 0 && s.hits > 0, "{s:?}");
        assert_eq!(m.bytes_copied, s.admissions * 1000);
        assert_eq!(
            (m.slots, m.resident),
            (2, cache.lock().unwrap().resident_count())
        );
        // A second card's cache (tensor parallelism): listed apart, summed in the total.
        let second = Arc::new(Mutex::new(ExpertCache::new(1, 4, config)));
        register_for_metrics(&second, 1000, 1);
        second.lock().unwrap().observe(0, &[3]);
        let by_device = expert_cache_metrics_by_device();
        assert_eq!(by_device.len(), 2);
        assert_eq!((by_device[0].0, by_device[1].0), (0, 1));
        assert_eq!(by_device[0].1.stats, s);
        assert_eq!(by_device[1].1.stats, second.lock().unwrap().stats());
        let total = expert_cache_metrics().unwrap();
        assert_eq!(total.slots, 4);
        assert_eq!(
            total.stats.lookups,
            s.lookups + second.lock().unwrap().stats().lookups
        );
        drop(cache);
        drop(second);
        assert_eq!(expert_cache_metrics(), None);
        assert!(expert_cache_metrics_by_device().is_empty());
    }

    use super::*;

    fn cache(slots: usize) -> ExpertCache {
        ExpertCache::new(
            2,
            8,
            ExpertCacheConfig {
                slots,
                half_life_tokens: 4.0,
                admit_margin: 0.25,
            },
        )
    }

    #[test]
    fn fills_free_slots_then_hits() {
        let mut c = cache(3);
        c.advance(1);
        let d = c.observe(0, &[1, 2]);
        assert_eq!(d.host, vec![1, 2]);
        assert_eq!(d.admit, vec![1, 2]);
        assert!(d.evict.is_empty());
        c.advance(1);
        let d = c.observe(0, &[2, 3]);
        assert_eq!(d.resident, vec![2]);
        assert_eq!(d.host, vec![3]);
        assert_eq!(d.admit, vec![3]);
        let s = c.stats();
        assert_eq!((s.lookups, s.hits, s.admissions), (4, 1, 3));
        assert_eq!(c.resident_in(0), vec![1, 2, 3]);
    }

    #[test]
    fn a_one_off_expert_does_not_evict_the_hot_set() {
        let mut c = cache(2);
        for _ in 0..6 {
            c.advance(1);
            c.observe(0, &[0, 1]);
        }
        c.advance(1);
        let d = c.observe(0, &[5]);
        assert_eq!(d.host, vec![5]);
        assert!(
            d.admit.is_empty(),
            "a single use must not beat a hot expert"
        );
        assert_eq!(c.resident_in(0), vec![0, 1]);
    }

    #[test]
    fn a_topic_change_replaces_the_hot_set_after_decay() {
        let mut c = cache(2);
        for _ in 0..6 {
            c.advance(1);
            c.observe(0, &[0, 1]);
        }
        // The conversation moves on: experts 6 and 7 are used from now on.
        let mut swapped_at = None;
        for step in 0..40 {
            c.advance(1);
            let d = c.observe(0, &[6, 7]);
            if c.resident_in(0) == vec![6, 7] && swapped_at.is_none() {
                swapped_at = Some(step);
                assert!(d.evict.iter().all(|&(l, e)| l == 0 && e < 2));
            }
        }
        let at = swapped_at.expect("the new hot pair must become resident");
        assert!(at < 12, "swap took {at} steps with a half-life of 4 tokens");
        assert_eq!(c.stats().evictions, 2);
    }

    #[test]
    fn scores_halve_after_a_half_life() {
        let mut c = cache(0);
        c.observe(1, &[3]);
        assert!((c.score(1, 3) - 1.0).abs() < 1e-6);
        c.advance(4);
        assert!((c.score(1, 3) - 0.5).abs() < 1e-6);
        c.advance(4);
        c.observe(1, &[3]);
        assert!((c.score(1, 3) - 1.25).abs() < 1e-6);
    }

    #[test]
    fn keys_rescale_without_changing_scores_or_order() {
        let mut c = cache(2);
        c.observe(0, &[1]);
        c.observe(0, &[2, 2]);
        let before = (c.score(0, 1), c.score(0, 2));
        // 2^105: past the rescale point (2^100), old scores still representable (2^-105).
        for _ in 0..420 {
            c.advance(1);
        }
        c.observe(1, &[4]);
        assert!(c.key.iter().all(|k| k.is_finite()));
        assert!(c.tick < 100.0, "the keys were rescaled (tick {})", c.tick);
        let ratio = c.score(0, 2) / c.score(0, 1);
        assert!((ratio - before.1 / before.0).abs() < 1e-3, "{ratio}");
        assert!(c.score(0, 1) >= 0.0);
    }

    #[test]
    fn disabled_cache_sends_everything_to_the_host() {
        let mut c = cache(0);
        let d = c.observe(1, &[0, 7, 7]);
        assert_eq!(d.host, vec![0, 7]);
        assert!(d.admit.is_empty() && d.resident.is_empty());
        assert_eq!(c.stats().hit_rate(), 0.0);
        c.advance(1);
        assert!((c.stats().cpu_experts_per_token() - 3.0).abs() < 1e-9);
    }

    #[test]
    fn prefetch_admits_without_counting_lookups() {
        let mut c = cache(4);
        let d = c.prefetch(1, &[2, 3, 3]);
        assert_eq!(d.admit, vec![2, 3]);
        assert_eq!(c.stats().lookups, 0);
        let d = c.observe(1, &[3]);
        assert_eq!(d.resident, vec![3]);
    }

    #[test]
    fn session_heat_round_trips_and_warms_a_cold_cache() {
        let mut a = cache(2);
        for _ in 0..5 {
            a.advance(1);
            a.observe(1, &[4, 5]);
        }
        let heat = a.heat(2);
        assert_eq!(
            heat.iter().map(|h| (h.layer, h.expert)).collect::<Vec<_>>(),
            vec![(1, 4), (1, 5)]
        );
        let mut b = cache(2);
        let d = b.warm(&heat).unwrap();
        assert_eq!(d.admit.len(), 2);
        assert!(b.is_resident(1, 4) && b.is_resident(1, 5));
        let bad = [HeatEntry {
            layer: 9,
            expert: 0,
            score: 1.0,
        }];
        assert!(b
            .warm(&bad)
            .unwrap_err()
            .to_string()
            .contains("2 layers × 8 experts"));
    }

    #[test]
    fn hot_set_file_refuses_another_model() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hot.json");
        let mut c = cache(2);
        c.observe(0, &[1, 1, 2]);
        c.save_hot_set(&path, "model-a").unwrap();
        let entries = ExpertCache::load_hot_set(&path, "model-a", 2, 8).unwrap();
        assert_eq!(entries[0].expert, 1);
        let err = ExpertCache::load_hot_set(&path, "model-b", 2, 8).unwrap_err();
        assert!(err.to_string().contains("model-a"), "{err}");
        std::fs::write(&path, b"garbage").unwrap();
        assert!(ExpertCache::load_hot_set(&path, "model-a", 2, 8).is_err());
    }
}
