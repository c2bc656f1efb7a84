//! The configuration table: what the product promises to run, and what each needs.
//!
//! This is the one place these numbers live (the README's table, `doctor`, the `serve` and
//! `download` guards and the UI all read it). Source: "The configuration table" of
//! shared/MODELS.md and the product brief.
//!
//! How the table's words become thresholds:
//! - "16 GB card": a card whose driver-reported total VRAM is at least [`VRAM_16GB_CARD`]
//!   (15 GiB). A 16 GB card reports about 15.9 GiB, so the threshold accepts every 16 GB card and
//!   refuses 12 GB ones. Where two 16 GB cards are asked for, one card with twice that VRAM
//!   (an RTX 5090) holds the same weights without a split and counts as the pair.
//! - "64 GB" / "96 GB" machine: MemTotal of at least 60 / 90 GiB. Firmware and the kernel keep
//!   part of installed RAM, so a 64 GB machine reads about 62–63 GiB in MemTotal.
//! - "free RAM needed": MemAvailable at start, in GiB as the table gives it. For the 27B NVFP4
//!   it is the 8 GiB context cache the table puts under "system RAM".
//! - Page-locked need: the routed experts that live in host RAM (65 GiB NVFP4, 48 GiB
//!   GSQ-RCO) and the 27B NVFP4's context cache. Short of it the rest stays pageable: a note,
//!   not a refusal.
//! - Disk: decimal GB, as download sizes are quoted.

use serde::Serialize;

pub const GIB: u64 = 1 << 30;
pub const GB: u64 = 1_000_000_000;

/// Driver-reported total VRAM that counts as a "16 GB card".
pub const VRAM_16GB_CARD: u64 = 15 * GIB;

// The threshold accepts every 16 GB card (an RTX 5060 Ti 16 GB reports 16,311 MiB), refuses
// 12 GB ones, and lets an RTX 5090 (32,607 MiB) stand in for two 16 GB cards.
const _: () = assert!(16_311 * (1 << 20) >= VRAM_16GB_CARD);
const _: () = assert!(12 * GB < VRAM_16GB_CARD);
const _: () = assert!(32_607 * (1 << 20) >= 2 * VRAM_16GB_CARD);

/// Which model a configuration runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Model {
    /// Qwen3.8-27B, dense: runs entirely on the GPU(s).
    Qwen3_8_27b,
    /// Qwen3.8-Flash-Next, 125B MoE: routed experts that do not fit in VRAM run on the CPU.
    Qwen3_8FlashNext,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GpuNeed {
    /// Cards required, each with at least `vram_each_bytes`.
    pub min_cards: u32,
    /// Cards the configuration uses when more are present.
    pub max_cards: u32,
    pub vram_each_bytes: u64,
    /// How the table names the card, e.g. "16 GB".
    pub vram_each_label: &'static str,
    /// The architecture the kernels are tuned for; others run with a note.
    pub preferred_sm: &'static str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Configuration {
    /// Stable identifier used on the command line, in the API and in the UI.
    pub id: &'static str,
    pub display_name: &'static str,
    pub model: Model,
    /// Where the checkpoint is published (the Hugging Face repository to look for).
    pub hf_repo_hint: &'static str,
    pub gpus: GpuNeed,
    /// Least MemTotal, and how the table names the machine ("64 GB"); `None`: ordinary RAM.
    pub system_ram_bytes: Option<u64>,
    pub system_ram_label: Option<&'static str>,
    /// Least MemAvailable at start; `None`: nothing beyond ordinary use.
    pub free_ram_bytes: Option<u64>,
    /// Host memory the configuration wants page-locked (experts in RAM, context cache).
    pub page_locked_bytes: u64,
    pub disk_bytes: u64,
    pub quality_note: &'static str,
    /// Routed experts are computed on the CPU, which then needs AVX-512 or AVX2 + FMA + F16C.
    pub host_experts: bool,
    /// The product's default configuration.
    pub default: bool,
}

const CARD_16GB: GpuNeed = GpuNeed {
    min_cards: 1,
    max_cards: 1,
    vram_each_bytes: VRAM_16GB_CARD,
    vram_each_label: "16 GB",
    preferred_sm: "sm_120",
};

/// Every configuration, most capable first: this order is the recommendation order
/// (see [`crate::plan::RECOMMENDATION_RULE`]).
pub const CONFIGURATIONS: &[Configuration] = &[
    Configuration {
        id: "qwen3.8-flash-next-nvfp4",
        display_name: "Qwen3.8-Flash-Next NVFP4",
        model: Model::Qwen3_8FlashNext,
        hf_repo_hint: "nvidia/Qwen3.8-Flash-Next-NVFP4",
        gpus: GpuNeed {
            min_cards: 2,
            max_cards: 2,
            ..CARD_16GB
        },
        system_ram_bytes: Some(90 * GIB),
        system_ram_label: Some("96 GB"),
        free_ram_bytes: Some(75 * GIB),
        page_locked_bytes: 65 * GIB,
        disk_bytes: 135 * GB,
        quality_note: "reference",
        host_experts: true,
        default: true,
    },
    Configuration {
        id: "qwen3.8-flash-next-64g",
        display_name: "Qwen3.8-Flash-Next 64 GB edition (GSQ-RCO experts)",
        model: Model::Qwen3_8FlashNext,
        hf_repo_hint: "ISTA-DASLab/Qwen3.8-Flash-Next-GSQ-RCO-GGUF",
        gpus: GpuNeed {
            min_cards: 1,
            max_cards: 2,
            ..CARD_16GB
        },
        system_ram_bytes: Some(60 * GIB),
        system_ram_label: Some("64 GB"),
        free_ram_bytes: Some(56 * GIB),
        page_locked_bytes: 48 * GIB,
        disk_bytes: 110 * GB,
        quality_note:
            "on par with NVFP4 on GSM8K and MMLU-Pro; experts 48 GiB in RAM instead of 65",
        host_experts: true,
        default: false,
    },
    Configuration {
        id: "qwen3.8-27b-nvfp4",
        display_name: "Qwen3.8-27B NVFP4",
        model: Model::Qwen3_8_27b,
        hf_repo_hint: "nvidia/Qwen3.8-27B-NVFP4",
        gpus: GpuNeed {
            min_cards: 2,
            max_cards: 2,
            ..CARD_16GB
        },
        system_ram_bytes: None,
        system_ram_label: None,
        free_ram_bytes: Some(8 * GIB),
        page_locked_bytes: 8 * GIB,
        disk_bytes: 20 * GB,
        quality_note: "reference quality",
        host_experts: false,
        default: false,
    },
    Configuration {
        id: "qwen3.8-27b-gsq3",
        display_name: "Qwen3.8-27B 3-bit (GSQ-RCO)",
        model: Model::Qwen3_8_27b,
        hf_repo_hint: "ISTA-DASLab/Qwen3.8-27B-GSQ-RCO-GGUF",
        gpus: CARD_16GB,
        system_ram_bytes: None,
        system_ram_label: None,
        free_ram_bytes: None,
        page_locked_bytes: 0,
        disk_bytes: 15 * GB,
        quality_note: "GSM8K level with NVFP4; MMLU-Pro about 0.72 vs 0.78",
        host_experts: false,
        default: false,
    },
];

/// The configuration with this id.
pub fn find(id: &str) -> Option<&'static Configuration> {
    CONFIGURATIONS.iter().find(|c| c.id == id)
}

/// All ids, for error messages and `--help`.
pub fn ids() -> Vec<&'static str> {
    CONFIGURATIONS.iter().map(|c| c.id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_models_md() {
        let nvfp4 = find("qwen3.8-flash-next-nvfp4").unwrap();
        assert!(nvfp4.default && nvfp4.host_experts);
        assert_eq!(
            (nvfp4.gpus.min_cards, nvfp4.free_ram_bytes, nvfp4.disk_bytes),
            (2, Some(75 * GIB), 135 * GB)
        );
        let g64 = find("qwen3.8-flash-next-64g").unwrap();
        assert_eq!(
            (g64.gpus.min_cards, g64.gpus.max_cards, g64.free_ram_bytes),
            (1, 2, Some(56 * GIB))
        );
        assert_eq!(
            (g64.disk_bytes, g64.page_locked_bytes),
            (110 * GB, 48 * GIB)
        );
        let b27 = find("qwen3.8-27b-nvfp4").unwrap();
        assert_eq!(
            (b27.gpus.min_cards, b27.disk_bytes, b27.host_experts),
            (2, 20 * GB, false)
        );
        let b3 = find("qwen3.8-27b-gsq3").unwrap();
        assert_eq!(
            (b3.gpus.min_cards, b3.disk_bytes, b3.free_ram_bytes),
            (1, 15 * GB, None)
        );
        assert_eq!(CONFIGURATIONS.iter().filter(|c| c.default).count(), 1);
        assert_eq!(find("qwen3.8-7b"), None);
    }

    #[test]
    fn ids_are_unique() {
        let mut ids = ids();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), CONFIGURATIONS.len());
    }
}
