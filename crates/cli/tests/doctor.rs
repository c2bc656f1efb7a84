//! `capy-flash doctor` end to end: its numbers against /proc/meminfo, /proc/cpuinfo, `lscpu`,
//! `nproc` and (where present) `nvidia-smi`; the `serve` guard through `doctor --check`.

use serde_json::Value;
use std::process::Command;

fn capy() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_capy-flash"));
    c.env_remove("NINFER_RAM_GUARD")
        .env_remove("CAPY_RAM_GUARD")
        .env_remove("CAPY_MODELS_DIR");
    c
}

fn doctor_json(models_dir: &std::path::Path) -> Value {
    let out = capy()
        .args(["doctor", "--json", "--models-dir"])
        .arg(models_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "doctor --json failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("doctor --json prints one JSON object")
}

fn meminfo_kib(key: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
#[cfg(target_os = "linux")]
fn doctor_json_reports_this_machines_true_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let j = doctor_json(&dir.path().join("models"));
    let m = &j["machine"];

    // RAM: MemTotal exactly, MemAvailable within what a few hundred ms of other work moves.
    assert_eq!(
        m["memory"]["total_bytes"].as_u64().unwrap(),
        meminfo_kib("MemTotal") * 1024
    );
    let available = m["memory"]["available_bytes"].as_u64().unwrap() as i64;
    let now = (meminfo_kib("MemAvailable") * 1024) as i64;
    assert!(
        (available - now).abs() < 1 << 30,
        "MemAvailable {now} vs doctor {available}"
    );

    // CPU: every flag as /proc/cpuinfo lists it, processor counts as the kernel and nproc see them.
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| l.split(':').nth(1).unwrap().split_whitespace().collect())
        .unwrap_or_default();
    let features = &m["cpu"]["features"];
    for (ours, linux) in [
        ("avx2", "avx2"),
        ("fma", "fma"),
        ("f16c", "f16c"),
        ("avx512f", "avx512f"),
        ("avx512bw", "avx512bw"),
        ("avx512vl", "avx512vl"),
        ("avx512vnni", "avx512_vnni"),
    ] {
        assert_eq!(
            features[ours].as_bool().unwrap(),
            flags.contains(&linux),
            "{ours} vs /proc/cpuinfo {linux}"
        );
    }
    let processors = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count() as u64;
    assert_eq!(m["cpu"]["logical_cores"].as_u64().unwrap(), processors);
    let nproc = Command::new("nproc").output().unwrap();
    let nproc: u64 = String::from_utf8(nproc.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(m["cpu"]["usable_threads"].as_u64().unwrap(), nproc);
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .map(|l| l.split(':').nth(1).unwrap().trim());
    if let Some(model) = model {
        assert_eq!(m["cpu"]["model"].as_str().unwrap(), model);
    }
    // Physical cores: the distinct (core, socket) pairs lscpu lists, where lscpu exists.
    if let Ok(out) = Command::new("lscpu").arg("-p=Core,Socket").output() {
        if out.status.success() {
            let pairs: std::collections::BTreeSet<String> = String::from_utf8(out.stdout)
                .unwrap()
                .lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_string)
                .collect();
            assert_eq!(
                m["cpu"]["physical_cores"].as_u64(),
                Some(pairs.len() as u64),
                "lscpu lists {pairs:?}"
            );
        }
    }

    // Page-locked limit: the soft RLIMIT_MEMLOCK of the child, as /proc/self/limits of a child shows it.
    let limits = Command::new("cat")
        .arg("/proc/self/limits")
        .output()
        .unwrap();
    let limits = String::from_utf8(limits.stdout).unwrap();
    let soft = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))
        .unwrap()
        .split_whitespace()
        .nth(3)
        .unwrap();
    match &m["page_locked"]["rlimit_memlock"] {
        Value::String(s) => assert_eq!((s.as_str(), soft), ("unlimited", "unlimited")),
        v => assert_eq!(v["bytes"].as_u64().unwrap(), soft.parse::<u64>().unwrap()),
    }

    // Disk: measured at the nearest existing folder, which is the temporary one.
    assert_eq!(
        m["disk"]["measured_at"].as_str().unwrap(),
        dir.path().to_str().unwrap()
    );

    // GPUs: none without a driver (and a note why); on a GPU box, what nvidia-smi lists.
    let smi = Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,memory.total",
            "--format=csv,noheader,nounits",
        ])
        .output();
    let gpus = m["gpus"].as_array().unwrap();
    match smi {
        Ok(out) if out.status.success() => {
            let rows: Vec<String> = String::from_utf8(out.stdout)
                .unwrap()
                .lines()
                .map(str::to_string)
                .collect();
            assert_eq!(
                gpus.len(),
                rows.len(),
                "doctor {gpus:?} vs nvidia-smi {rows:?}"
            );
            for (g, row) in gpus.iter().zip(&rows) {
                let (name, mib) = row.rsplit_once(',').unwrap();
                assert_eq!(g["name"].as_str().unwrap(), name.trim());
                assert_eq!(
                    g["total_vram_bytes"].as_u64().unwrap() >> 20,
                    mib.trim().parse::<u64>().unwrap()
                );
            }
        }
        _ => {
            if !std::path::Path::new("/proc/driver/nvidia").exists() {
                assert!(gpus.is_empty(), "{gpus:?}");
                assert!(
                    m["gpu_note"].as_str().unwrap().contains("no NVIDIA driver"),
                    "{}",
                    m["gpu_note"]
                );
            }
        }
    }

    // The table and the recommendation agree with the verdicts.
    let configs = j["configurations"].as_array().unwrap();
    assert_eq!(configs.len(), 4);
    let first_fit = configs
        .iter()
        .find(|c| c["fits"].as_bool().unwrap())
        .map(|c| c["id"].clone());
    assert_eq!(j["recommendation"].get("id").cloned(), first_fit);
}

#[test]
fn doctor_prints_an_aligned_report() {
    let dir = tempfile::tempdir().unwrap();
    let out = capy()
        .args(["doctor", "--models-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    for section in ["Machine\n", "\nConfigurations\n", "\nRecommendation\n"] {
        assert!(text.contains(section), "{section:?} missing in:\n{text}");
    }
    // The verdict column starts at the same place on every configuration row.
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("  qwen3.8-"))
        .collect();
    assert_eq!(rows.len(), 4, "{text}");
    let cols: Vec<usize> = rows
        .iter()
        .map(|r| r.find("fits").or_else(|| r.find("does not fit")).unwrap())
        .collect();
    assert!(cols.windows(2).all(|w| w[0] == w[1]), "{rows:#?}");
}

/// A saved 5090 + 32 GB machine: Flash-Next 64 GB edition is refused on RAM, and the
/// override lets it through with a warning.
#[test]
fn serve_guard_refuses_with_numbers_and_obeys_the_override() {
    let dir = tempfile::tempdir().unwrap();
    let machine = serde_json::json!({
        "cpu": {"model": "AMD Ryzen 9 9950X", "physical_cores": 16, "logical_cores": 32, "usable_threads": 32,
                "features": {"avx2": true, "fma": true, "f16c": true, "avx512f": true, "avx512bw": true,
                             "avx512vl": true, "avx512vnni": true}},
        "memory": {"total_bytes": 33_381_376_000u64, "available_bytes": 30_064_771_072u64},
        "page_locked": {"rlimit_memlock": {"bytes": 8_388_608}, "wsl": null, "cap_bytes": 33_381_376_000u64,
                        "cap_reason": "native Linux"},
        "os": {"name": "Linux 24.04 Ubuntu", "kernel": "6.8.0", "arch": "x86_64"},
        "gpus": [{"index": 0, "name": "NVIDIA GeForce RTX 5090", "compute_capability": {"major": 12, "minor": 0},
                  "total_vram_bytes": 34_190_917_632u64, "free_vram_bytes": 33_000_000_000u64,
                  "multiprocessors": 170, "memory_bandwidth_gb_s": 1792.0}],
        "gpu_note": null, "cuda_driver_version": "13.1", "disk": null
    });
    let path = dir.path().join("machine.json");
    std::fs::write(&path, serde_json::to_string(&machine).unwrap()).unwrap();

    let refused = capy()
        .args(["doctor", "--check", "qwen3.8-flash-next-64g", "--machine"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let err = String::from_utf8(refused.stderr).unwrap();
    assert!(
        err.contains("Qwen3.8-Flash-Next 64 GB edition (GSQ-RCO experts) needs ~56 GiB free RAM; 28.0 GiB is available"),
        "{err}"
    );
    assert!(err.contains("Set NINFER_RAM_GUARD=0"), "{err}");

    for var in ["NINFER_RAM_GUARD", "CAPY_RAM_GUARD"] {
        let forced = capy()
            .env(var, "0")
            .args(["doctor", "--check", "qwen3.8-flash-next-64g", "--machine"])
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&forced.stderr);
        assert!(forced.status.success(), "{var}=0 should override: {err}");
        assert!(
            err.contains(&format!("warning: {var}=0: starting anyway although")),
            "{err}"
        );
    }

    // The 27B NVFP4 fits the 5090 alone: no refusal, no override needed.
    let fits = capy()
        .args(["doctor", "--check", "qwen3.8-27b-nvfp4", "--machine"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        fits.status.success(),
        "{}",
        String::from_utf8_lossy(&fits.stderr)
    );

    // The whole `doctor --json` output is accepted as a machine file too.
    let json = capy()
        .args(["doctor", "--json", "--machine"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(json.status.success());
    let plan: Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(plan["recommendation"]["id"], "qwen3.8-27b-nvfp4");
    assert_eq!(plan["machine"], machine);
}
