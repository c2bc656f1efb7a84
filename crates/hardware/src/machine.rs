//! The facts about a machine that decide which configuration runs on it.
//!
//! Everything here is plain data: [`crate::probe()`] fills it in from the running machine, tests
//! and `capy-flash doctor --machine FILE` build it by hand or read it from JSON, and the planner
//! only ever looks at this struct. Sizes are bytes.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// One machine: CPU, memory, page-locked limit, OS, GPUs, and the disk holding the models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    pub cpu: Cpu,
    pub memory: Memory,
    pub page_locked: PageLocked,
    pub os: Os,
    /// CUDA devices in driver order; empty when there is no driver or no device.
    pub gpus: Vec<Gpu>,
    /// Why `gpus` is empty (or incomplete); `None` when the driver answered normally.
    pub gpu_note: Option<String>,
    /// The CUDA version the driver supports, e.g. "13.1"; `None` without a driver.
    pub cuda_driver_version: Option<String>,
    /// Free space where checkpoints are stored; `None` when it could not be measured.
    pub disk: Option<Disk>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cpu {
    /// The brand string, e.g. "AMD Ryzen 9 9950X 16-Core Processor".
    pub model: String,
    pub physical_cores: Option<usize>,
    /// Logical processors the OS knows about (hyper-threads included).
    pub logical_cores: usize,
    /// Logical processors this process may run on (affinity and cgroup limits applied).
    pub usable_threads: usize,
    pub features: CpuFeatures,
}

/// Instruction-set extensions the CPU expert kernels choose between. A flag is true only when
/// the CPU has it and the OS saves the registers it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512vnni: bool,
}

/// The CPU kernel family a machine can run for host-side experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuKernelPath {
    /// AVX-512 F + BW + VL + VNNI.
    Avx512,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// Neither: host experts cannot run at a usable speed.
    None,
}

impl CpuFeatures {
    pub fn has_avx512_set(&self) -> bool {
        self.avx512f && self.avx512bw && self.avx512vl && self.avx512vnni
    }

    pub fn has_avx2_set(&self) -> bool {
        self.avx2 && self.fma && self.f16c
    }

    /// The best kernel family available; AVX-512 wins when both are present.
    pub fn kernel_path(&self) -> CpuKernelPath {
        if self.has_avx512_set() {
            CpuKernelPath::Avx512
        } else if self.has_avx2_set() {
            CpuKernelPath::Avx2
        } else {
            CpuKernelPath::None
        }
    }

    /// Names of the AVX2-set features this CPU lacks, in the order the requirement lists them.
    pub fn missing_avx2_set(&self) -> Vec<&'static str> {
        [("AVX2", self.avx2), ("FMA", self.fma), ("F16C", self.f16c)]
            .into_iter()
            .filter(|(_, has)| !has)
            .map(|(name, _)| name)
            .collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    /// MemTotal: installed RAM less what firmware and kernel keep.
    pub total_bytes: u64,
    /// MemAvailable: what can be allocated now without swapping.
    pub available_bytes: u64,
}

/// How much host memory can be page-locked (pinned) for the GPU to read directly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PageLocked {
    /// RLIMIT_MEMLOCK of this process (what `mlock` may lock).
    pub rlimit_memlock: MemlockLimit,
    /// Set when running under Windows Subsystem for Linux.
    pub wsl: Option<Wsl>,
    /// The most host memory CUDA can pin here, as far as we can tell.
    pub cap_bytes: u64,
    /// How `cap_bytes` was decided.
    pub cap_reason: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemlockLimit {
    Unlimited,
    Bytes(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Wsl {
    #[serde(rename = "WSL1")]
    Wsl1,
    #[serde(rename = "WSL2")]
    Wsl2,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Os {
    /// e.g. "Linux 24.04 Ubuntu".
    pub name: String,
    pub kernel: Option<String>,
    /// e.g. "x86_64".
    pub arch: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// CUDA device ordinal.
    pub index: usize,
    pub name: String,
    pub compute_capability: ComputeCapability,
    pub total_vram_bytes: u64,
    /// Free VRAM as the driver reports it with this process's own context open.
    pub free_vram_bytes: Option<u64>,
    pub multiprocessors: Option<u32>,
    /// Peak memory bandwidth from the memory clock and bus width; decode speed follows it.
    pub memory_bandwidth_gb_s: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

impl ComputeCapability {
    /// The architecture the kernels are tuned for: RTX 50 series (Blackwell consumer).
    pub const SM_120: ComputeCapability = ComputeCapability {
        major: 12,
        minor: 0,
    };

    /// "sm_120" style name.
    pub fn sm_name(&self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Disk {
    /// The models folder as asked for.
    pub models_dir: PathBuf,
    /// The folder actually measured: `models_dir` or its nearest existing ancestor.
    pub measured_at: PathBuf,
    /// Space an unprivileged user can still write.
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// Read a machine from a JSON file: a bare [`Machine`] or a whole `doctor --json` output
/// (its `machine` object).
pub fn read_machine_file(path: &std::path::Path) -> Result<Machine, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read machine file {}: {e}", path.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format!("machine file {} is not JSON: {e}", path.display()))?;
    let machine = value.get("machine").cloned().unwrap_or(value);
    serde_json::from_value(machine).map_err(|e| {
        format!(
            "{} does not hold a machine as `capy-flash doctor --json` prints it: {e}",
            path.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_path_prefers_avx512_and_needs_the_whole_set() {
        let all = CpuFeatures {
            avx2: true,
            fma: true,
            f16c: true,
            avx512f: true,
            avx512bw: true,
            avx512vl: true,
            avx512vnni: true,
        };
        assert_eq!(all.kernel_path(), CpuKernelPath::Avx512);
        let no_vnni = CpuFeatures {
            avx512vnni: false,
            ..all
        };
        assert_eq!(no_vnni.kernel_path(), CpuKernelPath::Avx2);
        let no_f16c = CpuFeatures {
            f16c: false,
            ..no_vnni
        };
        assert_eq!(no_f16c.kernel_path(), CpuKernelPath::None);
        assert_eq!(no_f16c.missing_avx2_set(), vec!["F16C"]);
        assert_eq!(
            CpuFeatures::default().missing_avx2_set(),
            vec!["AVX2", "FMA", "F16C"]
        );
    }

    #[test]
    fn machine_json_round_trips() {
        let m = Machine {
            cpu: Cpu {
                model: "Test CPU".into(),
                physical_cores: Some(8),
                logical_cores: 16,
                usable_threads: 16,
                features: CpuFeatures {
                    avx2: true,
                    fma: true,
                    f16c: true,
                    ..Default::default()
                },
            },
            memory: Memory {
                total_bytes: 64 << 30,
                available_bytes: 60 << 30,
            },
            page_locked: PageLocked {
                rlimit_memlock: MemlockLimit::Bytes(8 << 20),
                wsl: Some(Wsl::Wsl2),
                cap_bytes: 32 << 30,
                cap_reason: "WSL2".into(),
            },
            os: Os {
                name: "Linux".into(),
                kernel: None,
                arch: "x86_64".into(),
            },
            gpus: vec![Gpu {
                index: 0,
                name: "NVIDIA GeForce RTX 5090".into(),
                compute_capability: ComputeCapability::SM_120,
                total_vram_bytes: 32 << 30,
                free_vram_bytes: Some(31 << 30),
                multiprocessors: Some(170),
                memory_bandwidth_gb_s: Some(1792.0),
            }],
            gpu_note: None,
            cuda_driver_version: Some("13.1".into()),
            disk: None,
        };
        let json = serde_json::to_string(&m).unwrap();
        assert!(json.contains("\"wsl\":\"WSL2\""), "{json}");
        assert!(
            json.contains("\"rlimit_memlock\":{\"bytes\":8388608}"),
            "{json}"
        );
        let back: Machine = serde_json::from_str(&json).unwrap();
        assert_eq!(back, m);
    }
}
