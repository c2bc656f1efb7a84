//! `capy-flash doctor`: what this machine has, which configurations fit, and which to run.
//!
//! `--json` prints one object `{machine, configurations, recommendation, ...}` for the UI.
//! `--machine FILE` plans for a machine saved from `doctor --json` (support, what-if).
//! `--check ID` runs the same guard `serve` runs before loading, and fails as `serve` would.

use anyhow::{Context, Result};
use capy_hardware::guard::{check_before_serve, GuardEnv};
use capy_hardware::plan::{gb, gib};
use capy_hardware::{Machine, MemlockLimit, Plan};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object (machine, configurations with verdicts, recommendation).
    #[arg(long)]
    pub json: bool,
    /// Folder where checkpoints are stored (free disk is measured there).
    #[arg(long, env = "CAPY_MODELS_DIR")]
    pub models_dir: Option<PathBuf>,
    /// Plan for the machine in this JSON file (the `machine` object of `doctor --json`)
    /// instead of probing this one.
    #[arg(long)]
    pub machine: Option<PathBuf>,
    /// Run the startup guard of `serve` for this configuration id and fail as `serve` would.
    #[arg(long)]
    pub check: Option<String>,
}

pub fn run(a: Args) -> Result<()> {
    let machine: Machine = match &a.machine {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading machine file {}", path.display()))?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", path.display()))?;
            // Accept both a bare machine and a whole `doctor --json` output.
            let machine = value.get("machine").cloned().unwrap_or(value);
            serde_json::from_value(machine).with_context(|| {
                format!(
                    "{} does not hold a machine as `doctor --json` prints it",
                    path.display()
                )
            })?
        }
        None => match &a.models_dir {
            Some(dir) => capy_hardware::probe_at(dir),
            None => capy_hardware::probe(),
        },
    };
    if let Some(id) = &a.check {
        let warnings = check_before_serve(&machine, Some(id), &GuardEnv::from_process())?;
        for w in &warnings {
            eprintln!("warning: {}", w.message);
        }
        println!("{id}: fits this machine");
        return Ok(());
    }
    let plan = capy_hardware::plan(&machine);
    if a.json {
        let out = serde_json::json!({
            "machine": machine,
            "configurations": plan.verdicts,
            "recommendation": plan.recommendation,
            "recommendation_rule": plan.recommendation_rule,
            "summary": plan.summary,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", render(&machine, &plan));
    }
    Ok(())
}

fn yes_no(v: bool) -> &'static str {
    if v {
        "yes"
    } else {
        "no"
    }
}

/// The readable report: machine, configuration table with verdicts, recommendation.
fn render(m: &Machine, plan: &Plan) -> String {
    let mut out = String::new();
    let mut row = |label: &str, value: String| out.push_str(&format!("  {label:<12} {value}\n"));
    let f = &m.cpu.features;
    let cores = match m.cpu.physical_cores {
        Some(p) => format!(
            "{p} physical cores, {} logical, {} usable",
            m.cpu.logical_cores, m.cpu.usable_threads
        ),
        None => format!(
            "{} logical cores, {} usable",
            m.cpu.logical_cores, m.cpu.usable_threads
        ),
    };
    let mut text = String::from("Machine\n");
    row("CPU", format!("{} ({cores})", m.cpu.model));
    row(
        "CPU features",
        format!(
            "AVX2 {} FMA {} F16C {} | AVX-512 F {} BW {} VL {} VNNI {}",
            yes_no(f.avx2),
            yes_no(f.fma),
            yes_no(f.f16c),
            yes_no(f.avx512f),
            yes_no(f.avx512bw),
            yes_no(f.avx512vl),
            yes_no(f.avx512vnni)
        ),
    );
    row(
        "RAM",
        format!(
            "{} total, {} available",
            gib(m.memory.total_bytes),
            gib(m.memory.available_bytes)
        ),
    );
    let memlock = match m.page_locked.rlimit_memlock {
        MemlockLimit::Unlimited => "unlimited".to_string(),
        MemlockLimit::Bytes(b) => format!("{} MiB", b >> 20),
    };
    row(
        "Page-locked",
        format!(
            "up to {} ({}); RLIMIT_MEMLOCK {memlock}",
            gib(m.page_locked.cap_bytes),
            m.page_locked.cap_reason
        ),
    );
    let kernel =
        m.os.kernel
            .as_deref()
            .map(|k| format!(", kernel {k}"))
            .unwrap_or_default();
    row("OS", format!("{} ({}{kernel})", m.os.name, m.os.arch));
    if m.gpus.is_empty() {
        row(
            "GPUs",
            format!(
                "none: {}",
                m.gpu_note.as_deref().unwrap_or("no CUDA devices")
            ),
        );
    } else {
        for g in &m.gpus {
            let free = g
                .free_vram_bytes
                .map(|b| format!(", {} free", gib(b)))
                .unwrap_or_default();
            let bw = g
                .memory_bandwidth_gb_s
                .map(|b| format!(", {b:.0} GB/s"))
                .unwrap_or_default();
            row(
                &format!("GPU {}", g.index),
                format!(
                    "{} ({}, {} VRAM{free}{bw})",
                    g.name,
                    g.compute_capability.sm_name(),
                    gib(g.total_vram_bytes)
                ),
            );
        }
        if let Some(note) = &m.gpu_note {
            row("GPU note", note.clone());
        }
    }
    if let Some(v) = &m.cuda_driver_version {
        row("CUDA driver", v.clone());
    }
    match &m.disk {
        Some(d) => row(
            "Disk",
            format!(
                "{} free of {} at {} (models: {})",
                gb(d.free_bytes),
                gb(d.total_bytes),
                d.measured_at.display(),
                d.models_dir.display()
            ),
        ),
        None => row(
            "Disk",
            "free space at the models folder could not be measured".to_string(),
        ),
    }
    text.push_str(&out);

    text.push_str("\nConfigurations\n");
    let id_w = plan.verdicts.iter().map(|v| v.id.len()).max().unwrap_or(0);
    let name_w = plan
        .verdicts
        .iter()
        .map(|v| v.display_name.len())
        .max()
        .unwrap_or(0);
    for v in &plan.verdicts {
        let verdict = if v.fits { "fits" } else { "does not fit" };
        let default = if v.configuration.default {
            " (default)"
        } else {
            ""
        };
        text.push_str(&format!(
            "  {:<id_w$}  {:<name_w$}  {verdict}{default}\n",
            v.id, v.display_name
        ));
        for u in &v.unmet {
            text.push_str(&format!("      - {}\n", u.message));
        }
        for n in &v.notes {
            text.push_str(&format!("      note: {n}\n"));
        }
        if v.disk.ok != Some(true) {
            text.push_str(&format!("      disk: {}\n", v.disk.message));
        }
    }
    text.push_str(&format!(
        "\nRecommendation\n  {}\n  rule: {}\n",
        plan.summary, plan.recommendation_rule
    ));
    text
}
