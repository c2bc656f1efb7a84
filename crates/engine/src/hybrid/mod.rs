//! Hybrid expert placement: Flash-Next's routed experts split between VRAM and host RAM.
//!
//! - [`expert_cache`]: which experts stay resident (decayed frequency, lookahead, session heat);
//! - [`split`]: a batch's routing split into resident and host halves;
//! - [`experts`]: the MoE layer's routed experts computed on both sides and summed;
//! - [`host_store`]: packing experts into the CPU kernels' record layout;
//! - [`load`]: Flash-Next loaded with its experts in the host store and a VRAM cache;
//! - [`memory`]: the RAM/VRAM ledgers against what the process holds;
//! - [`cost_model`]: when a prefill should stream experts to the GPU instead;
//! - [`zipf`]: skewed routing for the benches; [`bench`]: the hybrid expert decode bench.

pub mod bench;
pub mod cost_model;
pub mod expert_cache;
pub mod experts;
pub mod host_store;
pub mod load;
pub mod memory;
pub mod split;
pub mod zipf;

pub use expert_cache::{ExpertCache, ExpertCacheConfig, ExpertCacheStats};
pub use experts::{ForwardTimes, HybridExperts, Placement};
pub use load::{load_flash_next, HybridModel, HybridOptions, HybridReport};
