//! Reading the facts of the running machine into a [`Machine`].
//!
//! Nothing here panics on a machine without a GPU, without a driver, or with unreadable /proc
//! files: a fact that cannot be read is reported as absent with the reason.

use crate::machine::*;
use std::path::{Path, PathBuf};

/// Probe this machine, measuring free disk at the default models folder
/// ([`default_models_dir`]).
pub fn probe() -> Machine {
    probe_at(&default_models_dir())
}

/// Probe this machine, measuring free disk at `models_dir` (or its nearest existing ancestor
/// when it does not exist yet).
pub fn probe_at(models_dir: &Path) -> Machine {
    let mut sys = sysinfo::System::new();
    sys.refresh_memory();
    sys.refresh_cpu_list(sysinfo::CpuRefreshKind::nothing());
    let memory = Memory {
        total_bytes: sys.total_memory(),
        available_bytes: sys.available_memory(),
    };
    let gpu = probe_gpus();
    Machine {
        cpu: probe_cpu(&sys),
        memory,
        page_locked: probe_page_locked(memory.total_bytes),
        os: Os {
            name: sysinfo::System::long_os_version()
                .unwrap_or_else(|| std::env::consts::OS.to_string()),
            kernel: sysinfo::System::kernel_version(),
            arch: std::env::consts::ARCH.to_string(),
        },
        gpus: gpu.gpus,
        gpu_note: gpu.note,
        cuda_driver_version: gpu.driver_cuda_version,
        disk: probe_disk(models_dir),
    }
}

/// Where checkpoints live unless the user says otherwise: `$CAPY_MODELS_DIR`, else the
/// platform data folder (`~/.local/share/capy-flash/models` on Linux).
pub fn default_models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CAPY_MODELS_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    match directories::ProjectDirs::from("", "", "capy-flash") {
        Some(dirs) => dirs.data_dir().join("models"),
        None => PathBuf::from("models"),
    }
}

fn probe_cpu(sys: &sysinfo::System) -> Cpu {
    let logical_cores = sys.cpus().len().max(1);
    let brand_from_sysinfo = sys
        .cpus()
        .first()
        .map(|c| c.brand().trim().to_string())
        .filter(|b| !b.is_empty());
    let (brand_from_cpuid, features) = cpuid_facts();
    Cpu {
        model: brand_from_cpuid
            .or(brand_from_sysinfo)
            .unwrap_or_else(|| "unknown CPU".to_string()),
        physical_cores: sys.physical_core_count(),
        logical_cores,
        usable_threads: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(logical_cores),
        features,
    }
}

/// The CPU brand string and features from CPUID. CPUID says what the silicon has; the
/// `is_x86_feature_detected!` checks add whether the OS saves the YMM/ZMM registers (XCR0),
/// without which the instructions fault.
#[cfg(target_arch = "x86_64")]
fn cpuid_facts() -> (Option<String>, CpuFeatures) {
    let cpuid = raw_cpuid::CpuId::new();
    let brand = cpuid
        .get_processor_brand_string()
        .map(|b| b.as_str().trim().to_string())
        .filter(|b| !b.is_empty());
    let info = cpuid.get_feature_info();
    let ext = cpuid.get_extended_feature_info();
    let os_avx = std::is_x86_feature_detected!("avx");
    let os_avx512 = std::is_x86_feature_detected!("avx512f");
    let has = |f: fn(&raw_cpuid::ExtendedFeatures) -> bool| ext.as_ref().is_some_and(f);
    let features = CpuFeatures {
        avx2: os_avx && has(|e| e.has_avx2()),
        fma: os_avx && info.as_ref().is_some_and(|i| i.has_fma()),
        f16c: os_avx && info.as_ref().is_some_and(|i| i.has_f16c()),
        avx512f: os_avx512 && has(|e| e.has_avx512f()),
        avx512bw: os_avx512 && has(|e| e.has_avx512bw()),
        avx512vl: os_avx512 && has(|e| e.has_avx512vl()),
        avx512vnni: os_avx512 && has(|e| e.has_avx512vnni()),
    };
    (brand, features)
}

#[cfg(not(target_arch = "x86_64"))]
fn cpuid_facts() -> (Option<String>, CpuFeatures) {
    (None, CpuFeatures::default())
}

fn probe_page_locked(total_ram: u64) -> PageLocked {
    let osrelease = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let version = std::fs::read_to_string("/proc/version").unwrap_or_default();
    page_locked_from(memlock_limit(), detect_wsl(&osrelease, &version), total_ram)
}

/// Decide the page-locked cap from the facts. Under WSL (and Windows) the host pins at most
/// about half of RAM. On native Linux the NVIDIA driver pins CUDA host allocations itself and
/// RLIMIT_MEMLOCK does not apply to them (it limits `mlock`), so the cap is RAM itself.
pub fn page_locked_from(
    rlimit_memlock: MemlockLimit,
    wsl: Option<Wsl>,
    total_ram: u64,
) -> PageLocked {
    let (cap_bytes, cap_reason) = match wsl {
        Some(w) => (
            total_ram / 2,
            format!("{} lets CUDA page-lock about half of RAM; what does not fit stays in pageable RAM", wsl_name(w)),
        ),
        None if cfg!(windows) => {
            (total_ram / 2, "Windows lets CUDA page-lock about half of RAM; the rest stays pageable".to_string())
        }
        None => (
            total_ram,
            "native Linux: the NVIDIA driver pins CUDA host memory without RLIMIT_MEMLOCK (that limits mlock only)"
                .to_string(),
        ),
    };
    PageLocked {
        rlimit_memlock,
        wsl,
        cap_bytes,
        cap_reason,
    }
}

pub(crate) fn wsl_name(w: Wsl) -> &'static str {
    match w {
        Wsl::Wsl1 => "WSL1",
        Wsl::Wsl2 => "WSL2",
    }
}

/// WSL from the kernel's release string and /proc/version: WSL2 kernels are named
/// "…-microsoft-standard-WSL2", WSL1 reports "…-Microsoft".
pub fn detect_wsl(osrelease: &str, proc_version: &str) -> Option<Wsl> {
    let text = format!("{osrelease} {proc_version}").to_lowercase();
    if text.contains("wsl2") || text.contains("microsoft-standard") {
        Some(Wsl::Wsl2)
    } else if text.contains("microsoft") {
        Some(Wsl::Wsl1)
    } else {
        None
    }
}

#[cfg(unix)]
fn memlock_limit() -> MemlockLimit {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit struct we own.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    if rc != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        // A failing getrlimit cannot happen for a valid resource; treat it as no limit known.
        MemlockLimit::Unlimited
    } else {
        // rlim_t is u64 on Linux but not on every Unix.
        #[allow(clippy::unnecessary_cast)]
        MemlockLimit::Bytes(limit.rlim_cur as u64)
    }
}

#[cfg(not(unix))]
fn memlock_limit() -> MemlockLimit {
    MemlockLimit::Unlimited
}

/// Free space at `models_dir`, or at its nearest existing ancestor: the folder is usually
/// created by the first download, and the space it will get is that of the parent's file system.
#[cfg(unix)]
pub fn probe_disk(models_dir: &Path) -> Option<Disk> {
    use std::os::unix::ffi::OsStrExt;
    let absolute = std::path::absolute(models_dir).unwrap_or_else(|_| models_dir.to_path_buf());
    let measured_at = absolute.ancestors().find(|p| p.is_dir())?.to_path_buf();
    let c_path = std::ffi::CString::new(measured_at.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs fills a struct we own from a NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let fragment = st.f_frsize as u64;
    Some(Disk {
        models_dir: models_dir.to_path_buf(),
        measured_at,
        free_bytes: st.f_bavail as u64 * fragment,
        total_bytes: st.f_blocks as u64 * fragment,
    })
}

#[cfg(not(unix))]
pub fn probe_disk(_models_dir: &Path) -> Option<Disk> {
    None
}

struct GpuProbe {
    gpus: Vec<Gpu>,
    note: Option<String>,
    driver_cuda_version: Option<String>,
}

/// Message used when no CUDA driver library can be loaded.
pub const NO_DRIVER_NOTE: &str = "no NVIDIA driver found (libcuda.so.1 not loadable)";

fn probe_gpus() -> GpuProbe {
    let none = |note: String| GpuProbe {
        gpus: Vec::new(),
        note: Some(note),
        driver_cuda_version: None,
    };
    // cudarc panics on the first driver call when libcuda cannot be loaded, so ask first.
    // SAFETY: loading libcuda runs its initialisers, which is what any CUDA use does.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return none(NO_DRIVER_NOTE.to_string());
    }
    // A driver older than the bindings may lack a symbol, which cudarc reports by panicking.
    match std::panic::catch_unwind(probe_gpus_with_driver) {
        Ok(Ok(probe)) => probe,
        Ok(Err(e)) => none(e),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".to_string());
            none(format!(
                "the NVIDIA driver library loaded but a driver call failed: {what}"
            ))
        }
    }
}

fn probe_gpus_with_driver() -> Result<GpuProbe, String> {
    use cudarc::driver::{result, sys};
    let mut version = 0;
    // SAFETY: cuDriverGetVersion writes one int and may be called before cuInit.
    let driver_cuda_version = match unsafe { sys::cuDriverGetVersion(&mut version) } {
        sys::CUresult::CUDA_SUCCESS => {
            Some(format!("{}.{}", version / 1000, (version % 1000) / 10))
        }
        _ => None,
    };
    if let Err(e) = result::init() {
        return Ok(GpuProbe {
            gpus: Vec::new(),
            note: Some(format!(
                "the NVIDIA driver is installed but cuInit failed: {e}"
            )),
            driver_cuda_version,
        });
    }
    let count = result::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e}"))?;
    let mut gpus = Vec::new();
    let mut problems = Vec::new();
    for index in 0..count.max(0) as usize {
        match probe_one_gpu(index) {
            Ok(gpu) => gpus.push(gpu),
            Err(e) => problems.push(format!("GPU {index}: {e}")),
        }
    }
    let note = if count == 0 {
        Some("the NVIDIA driver reports no CUDA devices".to_string())
    } else if problems.is_empty() {
        None
    } else {
        Some(problems.join("; "))
    };
    Ok(GpuProbe {
        gpus,
        note,
        driver_cuda_version,
    })
}

fn probe_one_gpu(index: usize) -> Result<Gpu, String> {
    use cudarc::driver::{result, sys::CUdevice_attribute as A};
    let dev = result::device::get(index as i32).map_err(|e| format!("cuDeviceGet failed: {e}"))?;
    // SAFETY: `dev` came from cuDeviceGet just above.
    let attr = |a: A| unsafe { result::device::get_attribute(dev, a) }.ok();
    let name = result::device::get_name(dev).map_err(|e| format!("cuDeviceGetName failed: {e}"))?;
    // SAFETY: as above.
    let total = unsafe { result::device::total_mem(dev) }
        .map_err(|e| format!("cuDeviceTotalMem failed: {e}"))?;
    let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .ok_or("compute capability unreadable")?;
    let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).unwrap_or(0);
    // Free VRAM needs a context; the primary one is released again when `ctx` drops.
    let free = cudarc::driver::CudaContext::new(index)
        .and_then(|ctx| ctx.mem_get_info())
        .ok()
        .map(|(f, _)| f as u64);
    let clock_khz = attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).filter(|&v| v > 0);
    let bus_bits = attr(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).filter(|&v| v > 0);
    // Double data rate: two transfers per clock of `bus_bits` bits each.
    let bandwidth = clock_khz
        .zip(bus_bits)
        .map(|(k, b)| 2.0 * k as f64 * 1e3 * (b as f64 / 8.0) / 1e9);
    Ok(Gpu {
        index,
        name,
        compute_capability: ComputeCapability {
            major: major as u32,
            minor: minor as u32,
        },
        total_vram_bytes: total as u64,
        free_vram_bytes: free,
        multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map(|v| v as u32),
        memory_bandwidth_gb_s: bandwidth,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wsl_is_told_apart_from_native_linux() {
        assert_eq!(
            detect_wsl("5.15.167.4-microsoft-standard-WSL2\n", ""),
            Some(Wsl::Wsl2)
        );
        assert_eq!(
            detect_wsl(
                "",
                "Linux version 6.6.36.6-microsoft-standard-WSL2 (root@...)"
            ),
            Some(Wsl::Wsl2)
        );
        assert_eq!(detect_wsl("4.4.0-19041-Microsoft\n", ""), Some(Wsl::Wsl1));
        assert_eq!(
            detect_wsl(
                "6.8.0-45-generic\n",
                "Linux version 6.8.0-45-generic (buildd@lcy02)"
            ),
            None
        );
    }

    #[test]
    fn wsl_caps_page_locked_memory_at_half_of_ram() {
        let wsl = page_locked_from(MemlockLimit::Bytes(64 << 10), Some(Wsl::Wsl2), 64 << 30);
        assert_eq!(wsl.cap_bytes, 32 << 30);
        assert!(wsl.cap_reason.contains("WSL2"), "{}", wsl.cap_reason);
        let native = page_locked_from(MemlockLimit::Bytes(64 << 10), None, 64 << 30);
        assert_eq!(native.cap_bytes, 64 << 30);
    }

    #[test]
    fn probe_reads_this_machine_without_panicking() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("not/yet/created");
        let m = probe_at(&missing);
        assert!(m.memory.total_bytes > 0 && m.memory.available_bytes <= m.memory.total_bytes);
        assert!(m.cpu.logical_cores >= 1 && m.cpu.usable_threads >= 1);
        let disk = m
            .disk
            .expect("a temporary folder's file system can be measured");
        assert_eq!(disk.measured_at, std::path::absolute(dir.path()).unwrap());
        assert!(disk.free_bytes > 0 && disk.free_bytes <= disk.total_bytes);
        if m.gpus.is_empty() {
            assert!(m.gpu_note.is_some(), "an empty GPU list must say why");
        }
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn memlock_limit_matches_the_shell_view() {
        // /proc/self/limits shows the same RLIMIT_MEMLOCK soft limit in bytes.
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max locked memory"))
            .unwrap();
        let soft = line.split_whitespace().nth(3).unwrap();
        match memlock_limit() {
            MemlockLimit::Unlimited => assert_eq!(soft, "unlimited"),
            MemlockLimit::Bytes(b) => assert_eq!(soft.parse::<u64>().unwrap(), b),
        }
    }
}
