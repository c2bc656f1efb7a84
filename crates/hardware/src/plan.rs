//! The planner: machine facts in, a verdict per configuration and a recommendation out.
//!
//! Pure: it reads only the [`Machine`] it is given, so every rule is testable on made-up
//! machines. Rules:
//! - GPUs: enough cards with the VRAM each asks for, or one card with the VRAM of all of them.
//!   Among eligible cards the fastest are used. A card that is not sm_120 runs with a note; a
//!   pair of different cards runs at the slower card's pace (a note).
//! - RAM: MemTotal against the machine class, MemAvailable against the free RAM needed.
//!   The `serve` guard lets `NINFER_RAM_GUARD=0` turn exactly these two into warnings.
//! - CPU: a configuration with host experts (Flash-Next) needs AVX-512 (F, BW, VL, VNNI) or
//!   AVX2 + FMA + F16C; without either it is refused, and no override exists, because the
//!   expert kernels cannot run. The 27B runs entirely on the GPU, but the product's minimum CPU
//!   is AVX2 + FMA + F16C for every model ([`MIN_CPU_FEATURES`]): without them it is refused
//!   too, with no override.
//! - Page-locked memory below the need (WSL2, Windows) is a note: the rest of the experts stay
//!   in pageable RAM, which gives the same tokens, more slowly.
//! - Disk is checked for downloading only (a checkpoint already on disk needs no space), so it
//!   does not decide `fits` nor the recommendation.

use crate::configurations::{Configuration, GpuNeed, CONFIGURATIONS, GB, GIB};
use crate::machine::{ComputeCapability, CpuKernelPath, Disk, Gpu, Machine};
use serde::Serialize;

/// The CPU every model needs, in the table or not (`serve` refuses any other outright).
pub const MIN_CPU_FEATURES: &str = "AVX2 + FMA + F16C";

/// How the recommendation is chosen; shown by `doctor` and kept next to the code that does it.
pub const RECOMMENDATION_RULE: &str = "the most capable configuration that fits: \
     Flash-Next NVFP4 > Flash-Next 64 GB edition > 27B NVFP4 > 27B 3-bit \
     (the 125B model before the 27B, then the higher-precision build)";

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// One verdict per configuration, in recommendation order.
    pub verdicts: Vec<Verdict>,
    pub recommendation: Option<Recommendation>,
    pub recommendation_rule: &'static str,
    /// One sentence: what to run, or why nothing fits.
    pub summary: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recommendation {
    pub id: &'static str,
    pub display_name: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    pub id: &'static str,
    pub display_name: &'static str,
    pub configuration: &'static Configuration,
    /// Runs on this machine: every GPU, RAM and CPU requirement is met.
    pub fits: bool,
    /// Each requirement that is not met, with the numbers.
    pub unmet: Vec<Unmet>,
    /// Things that do not stop it but change how it runs.
    pub notes: Vec<String>,
    /// CUDA ordinals of the cards it would use (empty when the GPU requirement is not met).
    pub gpus_used: Vec<usize>,
    /// Whether a download fits on the models disk.
    pub disk: DiskCheck,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Unmet {
    #[serde(flatten)]
    pub need: Need,
    /// `NINFER_RAM_GUARD=0` may override it (RAM only).
    pub overridable: bool,
    pub message: String,
}

/// A requirement with what it needs and what the machine has.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "requirement", rename_all = "snake_case")]
pub enum Need {
    Gpus {
        needed_cards: u32,
        vram_each_bytes: u64,
        eligible_cards: u32,
    },
    SystemRam {
        needed_bytes: u64,
        actual_bytes: u64,
    },
    FreeRam {
        needed_bytes: u64,
        actual_bytes: u64,
    },
    CpuFeatures {
        needed: &'static str,
        missing: Vec<&'static str>,
    },
}

impl Need {
    pub fn is_ram(&self) -> bool {
        matches!(self, Need::SystemRam { .. } | Need::FreeRam { .. })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiskCheck {
    pub needed_bytes: u64,
    /// `None` when free space could not be measured.
    pub free_bytes: Option<u64>,
    /// `None` when unknown.
    pub ok: Option<bool>,
    pub message: String,
}

/// Plan every configuration for `machine`.
pub fn plan(machine: &Machine) -> Plan {
    let verdicts: Vec<Verdict> = CONFIGURATIONS.iter().map(|c| verdict(machine, c)).collect();
    let recommendation = verdicts.iter().find(|v| v.fits).map(|v| Recommendation {
        id: v.id,
        display_name: v.display_name,
    });
    let summary = match &recommendation {
        Some(r) => format!("recommended: {} ({})", r.display_name, r.id),
        None => {
            // The least demanding configuration says best what this machine lacks.
            let smallest = verdicts.last().expect("the table is not empty");
            let why: Vec<&str> = smallest.unmet.iter().map(|u| u.message.as_str()).collect();
            format!("no configuration fits this machine: {}", why.join("; "))
        }
    };
    Plan {
        verdicts,
        recommendation,
        recommendation_rule: RECOMMENDATION_RULE,
        summary,
    }
}

/// The verdict for one configuration.
pub fn verdict(machine: &Machine, config: &'static Configuration) -> Verdict {
    let name = config.display_name;
    let mut unmet = Vec::new();
    let mut notes = Vec::new();

    let chosen = choose_gpus(&machine.gpus, &config.gpus);
    match &chosen {
        Some(used) => gpu_notes(config, &machine.gpus, used, &mut notes),
        None => unmet.push(gpu_shortfall(machine, config)),
    }

    if let Some(needed) = config.system_ram_bytes {
        let actual = machine.memory.total_bytes;
        if actual < needed {
            let label = config.system_ram_label.unwrap_or("larger");
            unmet.push(Unmet {
                need: Need::SystemRam {
                    needed_bytes: needed,
                    actual_bytes: actual,
                },
                overridable: true,
                message: format!(
                    "{name} needs a {label} machine (at least {} of RAM); this one has {}",
                    gib(needed),
                    gib(actual)
                ),
            });
        }
    }
    if let Some(needed) = config.free_ram_bytes {
        let actual = machine.memory.available_bytes;
        if actual < needed {
            unmet.push(Unmet {
                need: Need::FreeRam {
                    needed_bytes: needed,
                    actual_bytes: actual,
                },
                overridable: true,
                message: format!(
                    "{name} needs ~{} free RAM; {} is available",
                    gib_approx(needed),
                    gib(actual)
                ),
            });
        }
    }

    let features = &machine.cpu.features;
    match (config.host_experts, features.kernel_path()) {
        (true, CpuKernelPath::None) => {
            let missing = features.missing_avx2_set();
            unmet.push(Unmet {
                need: Need::CpuFeatures { needed: "AVX-512 (F, BW, VL, VNNI) or AVX2 + FMA + F16C", missing: missing.clone() },
                overridable: false,
                message: format!(
                    "{name} computes experts on the CPU and needs AVX-512 (F, BW, VL, VNNI) or AVX2 + FMA + F16C; \
                     this CPU ({}) lacks {}",
                    machine.cpu.model,
                    missing.join(", ")
                ),
            });
        }
        (true, CpuKernelPath::Avx2) => notes.push(
            "experts on the CPU use the AVX2 + FMA + F16C kernels: slower than with AVX-512 VNNI"
                .to_string(),
        ),
        (false, _) if !features.has_avx2_set() => {
            let missing = features.missing_avx2_set();
            unmet.push(Unmet {
                need: Need::CpuFeatures {
                    needed: MIN_CPU_FEATURES,
                    missing: missing.clone(),
                },
                overridable: false,
                message: format!(
                    "{name} runs on the GPU, but Capy Flash needs {MIN_CPU_FEATURES} on the CPU; \
                     this CPU ({}) lacks {}",
                    machine.cpu.model,
                    missing.join(", ")
                ),
            });
        }
        _ => {}
    }

    // Only a cap below RAM itself (WSL2, Windows) is news: a machine short of RAM is already
    // told so by the RAM checks.
    let cap = machine.page_locked.cap_bytes;
    if config.page_locked_bytes > cap && cap < machine.memory.total_bytes {
        let what = if config.host_experts {
            "experts"
        } else {
            "context cache"
        };
        notes.push(format!(
            "page-locked memory is capped at {} ({}): {} of the {} of {what} stay in pageable RAM: same tokens, slower",
            gib(cap),
            machine.page_locked.cap_reason,
            gib(config.page_locked_bytes - cap),
            gib_approx(config.page_locked_bytes)
        ));
    }

    let gpus_used = chosen
        .map(|used| used.iter().map(|g| g.index).collect())
        .unwrap_or_default();
    Verdict {
        id: config.id,
        display_name: name,
        configuration: config,
        fits: unmet.is_empty(),
        unmet,
        notes,
        gpus_used,
        disk: disk_check(config, machine.disk.as_ref(), 0),
    }
}

/// Disk space for downloading `config`, `already_present_bytes` of which are on disk already
/// (a resumed download).
pub fn disk_check(
    config: &Configuration,
    disk: Option<&Disk>,
    already_present_bytes: u64,
) -> DiskCheck {
    let needed = config.disk_bytes.saturating_sub(already_present_bytes);
    match disk {
        None => DiskCheck {
            needed_bytes: needed,
            free_bytes: None,
            ok: None,
            message: format!(
                "downloading {} needs {}; free space could not be measured",
                config.display_name,
                gb(needed)
            ),
        },
        Some(d) => {
            let ok = d.free_bytes >= needed;
            let message = if ok {
                format!(
                    "{} free at {} ({} needed)",
                    gb(d.free_bytes),
                    d.measured_at.display(),
                    gb(needed)
                )
            } else {
                format!(
                    "downloading {} needs {} free at {}; {} is free",
                    config.display_name,
                    gb(needed),
                    d.measured_at.display(),
                    gb(d.free_bytes)
                )
            };
            DiskCheck {
                needed_bytes: needed,
                free_bytes: Some(d.free_bytes),
                ok: Some(ok),
                message,
            }
        }
    }
}

/// Cards for `need`: the fastest eligible ones, or one card holding all of them.
fn choose_gpus<'a>(gpus: &'a [Gpu], need: &GpuNeed) -> Option<Vec<&'a Gpu>> {
    let mut eligible: Vec<&Gpu> = gpus
        .iter()
        .filter(|g| g.total_vram_bytes >= need.vram_each_bytes)
        .collect();
    eligible.sort_by(|a, b| {
        speed_key(b)
            .partial_cmp(&speed_key(a))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    if eligible.len() >= need.min_cards as usize {
        eligible.truncate(need.max_cards as usize);
        return Some(eligible);
    }
    let all_in_one = need.vram_each_bytes * need.min_cards as u64;
    eligible
        .into_iter()
        .find(|g| g.total_vram_bytes >= all_in_one)
        .map(|g| vec![g])
}

/// Decode is bound by memory bandwidth; without it, more multiprocessors, then more VRAM.
fn speed_key(g: &Gpu) -> (f64, u32, u64) {
    (
        g.memory_bandwidth_gb_s.unwrap_or(0.0),
        g.multiprocessors.unwrap_or(0),
        g.total_vram_bytes,
    )
}

fn gpu_shortfall(machine: &Machine, config: &Configuration) -> Unmet {
    let need = &config.gpus;
    let eligible: Vec<&Gpu> = machine
        .gpus
        .iter()
        .filter(|g| g.total_vram_bytes >= need.vram_each_bytes)
        .collect();
    let wanted = match need.min_cards {
        1 => format!("one {} GPU", need.vram_each_label),
        2 => format!(
            "two {} GPUs (or one GPU with twice the VRAM)",
            need.vram_each_label
        ),
        n => format!("{n} {} GPUs", need.vram_each_label),
    };
    let found = if machine.gpus.is_empty() {
        match &machine.gpu_note {
            Some(why) => format!("none found ({why})"),
            None => "none found".to_string(),
        }
    } else {
        let list: Vec<String> = machine
            .gpus
            .iter()
            .map(|g| format!("{} with {}", g.name, gib(g.total_vram_bytes)))
            .collect();
        format!(
            "found {} (at least {} counts as {})",
            list.join(", "),
            gib(need.vram_each_bytes),
            need.vram_each_label
        )
    };
    Unmet {
        need: Need::Gpus {
            needed_cards: need.min_cards,
            vram_each_bytes: need.vram_each_bytes,
            eligible_cards: eligible.len() as u32,
        },
        overridable: false,
        message: format!("{} needs {wanted}; {found}", config.display_name),
    }
}

fn gpu_notes(config: &Configuration, all: &[Gpu], used: &[&Gpu], notes: &mut Vec<String>) {
    for g in used {
        if g.compute_capability != ComputeCapability::SM_120 {
            notes.push(format!(
                "GPU {} ({}, {}) is not {}: it runs, but the kernels are tuned for RTX 50 series cards",
                g.index,
                g.name,
                g.compute_capability.sm_name(),
                config.gpus.preferred_sm
            ));
        }
        if let Some(free) = g.free_vram_bytes {
            // The driver context this probe opened takes a few hundred MiB; more than 2 GiB
            // in use means other programs hold VRAM the caches would have used.
            if free + 2 * GIB < g.total_vram_bytes {
                notes.push(format!(
                    "GPU {} has {} of {} VRAM free: other programs hold the rest, leaving less for caches",
                    g.index,
                    gib(free),
                    gib(g.total_vram_bytes)
                ));
            }
        }
    }
    if let [a, b] = used {
        if a.name != b.name || a.memory_bandwidth_gb_s != b.memory_bandwidth_gb_s {
            // `used` is sorted fastest first.
            let (fast, slow) = (a, b);
            notes.push(format!(
                "mixed pair: GPU {} ({}{}) and GPU {} ({}{}) run at the slower card's pace ({})",
                fast.index,
                fast.name,
                bandwidth(fast),
                slow.index,
                slow.name,
                bandwidth(slow),
                slow.name
            ));
            if fast.total_vram_bytes >= config.gpus.vram_each_bytes * config.gpus.min_cards as u64 {
                notes.push(format!(
                    "GPU {} ({}) alone holds this configuration and would run at its own, faster pace",
                    fast.index, fast.name
                ));
            }
        }
    }
    if used.len() < all.len() {
        let list: Vec<String> = used.iter().map(|g| g.index.to_string()).collect();
        notes.push(format!(
            "uses GPU {} of the {} present",
            list.join(" and "),
            all.len()
        ));
    }
}

fn bandwidth(g: &Gpu) -> String {
    g.memory_bandwidth_gb_s
        .map(|b| format!(", {b:.0} GB/s"))
        .unwrap_or_default()
}

/// Binary gigabytes with one decimal, e.g. "61.2 GiB".
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB as f64)
}

/// A requirement in whole GiB where it is whole, e.g. "75 GiB".
pub fn gib_approx(bytes: u64) -> String {
    if bytes.is_multiple_of(GIB) {
        format!("{} GiB", bytes / GIB)
    } else {
        gib(bytes)
    }
}

/// Decimal gigabytes, as download sizes are quoted, e.g. "135 GB", "40.2 GB".
pub fn gb(bytes: u64) -> String {
    let v = bytes as f64 / 1e9;
    if bytes.is_multiple_of(GB) {
        format!("{v:.0} GB")
    } else {
        format!("{v:.1} GB")
    }
}
