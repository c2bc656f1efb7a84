//! The startup guards: `serve` checks a configuration before loading anything, `download`
//! checks disk space before fetching. Both refuse with the numbers.
//!
//! `serve` calls [`check_before_serve`] with the probed machine (or the one
//! [`machine_for_guard`] reads from `CAPY_FAKE_MACHINE`), the configuration id it is about to
//! load ([`crate::model_folder::identify`]; `None` for demo/tiny/unknown models, which are
//! not in the configuration table: only the CPU is checked for them) and
//! [`GuardEnv::from_process`]. `NINFER_RAM_GUARD=0` or `CAPY_RAM_GUARD=0` turns RAM
//! shortfalls into warnings; missing GPUs and a CPU without AVX2 + FMA + F16C are always
//! refused, because loading cannot succeed without them.

use crate::configurations::{self, Configuration};
use crate::machine::{Disk, Machine};
use crate::plan::{self, DiskCheck, Unmet};
use serde::Serialize;
use std::fmt;
use std::path::Path;

/// The environment variables the guard reads, passed in so tests need not touch the process
/// environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GuardEnv {
    /// `NINFER_RAM_GUARD`, the name the product's README documents.
    pub ninfer_ram_guard: Option<String>,
    /// `CAPY_RAM_GUARD`, the same switch under this project's prefix.
    pub capy_ram_guard: Option<String>,
}

impl GuardEnv {
    pub fn from_process() -> Self {
        GuardEnv {
            ninfer_ram_guard: std::env::var("NINFER_RAM_GUARD").ok(),
            capy_ram_guard: std::env::var("CAPY_RAM_GUARD").ok(),
        }
    }

    /// The name of the variable that disables the RAM guard (set to "0"), if any.
    pub fn ram_guard_disabled_by(&self) -> Option<&'static str> {
        let off = |v: &Option<String>| v.as_deref().map(str::trim) == Some("0");
        if off(&self.ninfer_ram_guard) {
            Some("NINFER_RAM_GUARD")
        } else if off(&self.capy_ram_guard) {
            Some("CAPY_RAM_GUARD")
        } else {
            None
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Warning {
    pub message: String,
}

/// Why `serve` will not load a configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "refusal", rename_all = "snake_case")]
pub enum Refusal {
    UnknownConfiguration {
        id: String,
        known: Vec<&'static str>,
    },
    /// The CPU lacks the product's minimum ([`plan::MIN_CPU_FEATURES`]); no override exists.
    CpuUnsupported {
        cpu: String,
        missing: Vec<&'static str>,
    },
    DoesNotFit {
        id: &'static str,
        display_name: &'static str,
        reasons: Vec<Unmet>,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::UnknownConfiguration { id, known } => {
                write!(
                    f,
                    "unknown configuration '{id}'; expected one of: {}",
                    known.join(", ")
                )
            }
            Refusal::CpuUnsupported { cpu, missing } => write!(
                f,
                "refusing to start: Capy Flash needs {} on the CPU; this CPU ({cpu}) lacks {}. \
                 No override exists: the server's CPU code cannot run without them.",
                plan::MIN_CPU_FEATURES,
                missing.join(", ")
            ),
            Refusal::DoesNotFit {
                display_name,
                reasons,
                ..
            } => {
                write!(f, "refusing to load {display_name} on this machine:")?;
                for r in reasons {
                    write!(f, "\n  - {}", r.message)?;
                }
                if reasons.iter().all(|r| r.overridable) {
                    write!(f, "\nSet NINFER_RAM_GUARD=0 to start anyway (the system may swap or kill the server).")
                } else if reasons.iter().any(|r| r.overridable) {
                    write!(f, "\nNINFER_RAM_GUARD=0 overrides only the RAM checks; the others cannot be overridden.")
                } else {
                    write!(
                        f,
                        "\nRun `capy-flash doctor` to see which configurations fit this machine."
                    )
                }
            }
        }
    }
}

impl std::error::Error for Refusal {}

/// Check `config_id` against `machine` before `serve` loads anything.
///
/// `None` (a tiny, demo or unknown model outside the configuration table) is checked only for
/// the CPU ([`check_cpu`]) and otherwise passes with no warnings. On success the warnings are
/// the planner's notes plus, when the RAM guard was overridden, what it would have refused.
pub fn check_before_serve(
    machine: &Machine,
    config_id: Option<&str>,
    env: &GuardEnv,
) -> Result<Vec<Warning>, Refusal> {
    let Some(id) = config_id else {
        check_cpu(machine)?;
        return Ok(Vec::new());
    };
    let config = find(id)?;
    let verdict = plan::verdict(machine, config);
    let override_by = env.ram_guard_disabled_by();
    let (overridden, refused): (Vec<Unmet>, Vec<Unmet>) = verdict
        .unmet
        .into_iter()
        .partition(|u| u.overridable && override_by.is_some());
    if !refused.is_empty() {
        return Err(Refusal::DoesNotFit {
            id: config.id,
            display_name: config.display_name,
            reasons: refused,
        });
    }
    let mut warnings: Vec<Warning> = overridden
        .into_iter()
        .map(|u| Warning {
            message: format!(
                "{}=0: starting anyway although {}",
                override_by.unwrap_or("NINFER_RAM_GUARD"),
                u.message
            ),
        })
        .collect();
    warnings.extend(verdict.notes.into_iter().map(|message| Warning { message }));
    Ok(warnings)
}

/// The CPU check every model gets: AVX2 + FMA + F16C, refused outright without them.
/// (For configurations of the table the planner makes the same check, with the configuration's
/// name in the message.)
pub fn check_cpu(machine: &Machine) -> Result<(), Refusal> {
    let features = &machine.cpu.features;
    if features.has_avx2_set() {
        Ok(())
    } else {
        Err(Refusal::CpuUnsupported {
            cpu: machine.cpu.model.clone(),
            missing: features.missing_avx2_set(),
        })
    }
}

/// The environment variable that replaces the probed machine with one read from a JSON file
/// (the `machine` object of `doctor --json`, or the whole output). For tests and what-if
/// checks of the `serve` guard only: the engine still runs on the real machine.
pub const FAKE_MACHINE_ENV: &str = "CAPY_FAKE_MACHINE";

/// The machine the `serve` guard checks: the one in `$CAPY_FAKE_MACHINE` when set (with a
/// warning to print), else [`crate::probe_at`]`(models_dir)`.
pub fn machine_for_guard(models_dir: &Path) -> Result<(Machine, Option<Warning>), String> {
    match std::env::var_os(FAKE_MACHINE_ENV).filter(|v| !v.is_empty()) {
        Some(path) => {
            let path = Path::new(&path);
            let machine = crate::machine::read_machine_file(path)?;
            let warning = Warning {
                message: format!(
                    "{FAKE_MACHINE_ENV}={}: checking the machine described there, not this one (for tests)",
                    path.display()
                ),
            };
            Ok((machine, Some(warning)))
        }
        None => Ok((crate::probe_at(models_dir), None)),
    }
}

/// Why `download` will not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DiskRefusal {
    #[error("{0}")]
    UnknownConfiguration(Refusal),
    #[error("{}; free some space or choose another folder with --models-dir", .0.message)]
    NotEnoughSpace(DiskCheck),
}

/// Check free space at `models_dir` (or its nearest existing ancestor) for downloading
/// `config_id`. When free space cannot be measured the check passes and says so.
pub fn check_disk(models_dir: &Path, config_id: &str) -> Result<DiskCheck, DiskRefusal> {
    check_disk_space(crate::probe::probe_disk(models_dir).as_ref(), config_id, 0)
}

/// [`check_disk`] on measured facts; `already_present_bytes` of the download are on disk
/// already (a resumed download needs only the rest).
pub fn check_disk_space(
    disk: Option<&Disk>,
    config_id: &str,
    already_present_bytes: u64,
) -> Result<DiskCheck, DiskRefusal> {
    let config = find(config_id).map_err(DiskRefusal::UnknownConfiguration)?;
    let check = plan::disk_check(config, disk, already_present_bytes);
    match check.ok {
        Some(false) => Err(DiskRefusal::NotEnoughSpace(check)),
        _ => Ok(check),
    }
}

fn find(id: &str) -> Result<&'static Configuration, Refusal> {
    configurations::find(id).ok_or_else(|| Refusal::UnknownConfiguration {
        id: id.to_string(),
        known: configurations::ids(),
    })
}
