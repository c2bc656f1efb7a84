//! The `serve` and `download` guards: refusals with the numbers, and the RAM override.

use capy_hardware::configurations::{GB, GIB};
use capy_hardware::guard::{
    check_before_serve, check_disk, check_disk_space, DiskRefusal, GuardEnv, Refusal,
};
use capy_hardware::plan::Need;
use capy_hardware::probe::page_locked_from;
use capy_hardware::*;
use std::path::PathBuf;

fn card(index: usize, name: &str, vram_bytes: u64) -> Gpu {
    Gpu {
        index,
        name: name.to_string(),
        compute_capability: ComputeCapability::SM_120,
        total_vram_bytes: vram_bytes,
        free_vram_bytes: Some(vram_bytes - (1 << 29)),
        multiprocessors: Some(70),
        memory_bandwidth_gb_s: Some(896.0),
    }
}

/// Two RTX 5070 Ti, a 64 GB machine with 61.2 GiB available: the example numbers.
fn two_cards_64gb(features: CpuFeatures) -> Machine {
    let total = 62 * GIB + 4 * GIB / 5; // 62.8 GiB
    Machine {
        cpu: Cpu {
            model: "Test CPU".into(),
            physical_cores: Some(8),
            logical_cores: 16,
            usable_threads: 16,
            features,
        },
        memory: Memory {
            total_bytes: total,
            available_bytes: 61 * GIB + GIB / 5 + 1,
        },
        page_locked: page_locked_from(MemlockLimit::Unlimited, None, total),
        os: Os {
            name: "Linux".into(),
            kernel: None,
            arch: "x86_64".into(),
        },
        gpus: vec![
            card(0, "NVIDIA GeForce RTX 5070 Ti", 16_303 << 20),
            card(1, "NVIDIA GeForce RTX 5070 Ti", 16_303 << 20),
        ],
        gpu_note: None,
        cuda_driver_version: Some("13.1".into()),
        disk: None,
    }
}

const AVX2: CpuFeatures = CpuFeatures {
    avx2: true,
    fma: true,
    f16c: true,
    ..avx512_off()
};

const fn avx512_off() -> CpuFeatures {
    CpuFeatures {
        avx2: false,
        fma: false,
        f16c: false,
        avx512f: false,
        avx512bw: false,
        avx512vl: false,
        avx512vnni: false,
    }
}

fn env(ninfer: Option<&str>, capy: Option<&str>) -> GuardEnv {
    GuardEnv {
        ninfer_ram_guard: ninfer.map(str::to_string),
        capy_ram_guard: capy.map(str::to_string),
    }
}

#[test]
fn refuses_flash_next_nvfp4_with_the_numbers() {
    let m = two_cards_64gb(AVX2);
    let err =
        check_before_serve(&m, Some("qwen3.8-flash-next-nvfp4"), &env(None, None)).unwrap_err();
    let Refusal::DoesNotFit { id, reasons, .. } = &err else {
        panic!("expected DoesNotFit, got {err:?}")
    };
    assert_eq!(*id, "qwen3.8-flash-next-nvfp4");
    assert_eq!(reasons.len(), 2);
    assert!(
        matches!(reasons[0].need, Need::SystemRam { needed_bytes, .. } if needed_bytes == 90 * GIB)
    );
    assert_eq!(
        err.to_string(),
        "refusing to load Qwen3.8-Flash-Next NVFP4 on this machine:\n  \
         - Qwen3.8-Flash-Next NVFP4 needs a 96 GB machine (at least 90.0 GiB of RAM); this one has 62.8 GiB\n  \
         - Qwen3.8-Flash-Next NVFP4 needs ~75 GiB free RAM; 61.2 GiB is available\n\
         Set NINFER_RAM_GUARD=0 to start anyway (the system may swap or kill the server)."
    );
}

#[test]
fn ram_guard_override_turns_ram_refusals_into_warnings() {
    let m = two_cards_64gb(AVX2);
    for e in [
        env(Some("0"), None),
        env(None, Some("0")),
        env(Some(" 0\n"), Some("1")),
    ] {
        let warnings = check_before_serve(&m, Some("qwen3.8-flash-next-nvfp4"), &e).unwrap();
        let texts: Vec<&str> = warnings.iter().map(|w| w.message.as_str()).collect();
        let var = e.ram_guard_disabled_by().unwrap();
        assert_eq!(
            texts,
            vec![
                format!(
                    "{var}=0: starting anyway although Qwen3.8-Flash-Next NVFP4 needs a 96 GB machine \
                     (at least 90.0 GiB of RAM); this one has 62.8 GiB"
                ),
                format!(
                    "{var}=0: starting anyway although Qwen3.8-Flash-Next NVFP4 needs ~75 GiB free RAM; 61.2 GiB is available"
                ),
                "experts on the CPU use the AVX2 + FMA + F16C kernels: slower than with AVX-512 VNNI".to_string(),
            ]
        );
    }
    // Any other value keeps the guard on.
    for e in [
        env(Some("1"), None),
        env(Some("false"), Some("")),
        env(None, None),
    ] {
        assert!(
            check_before_serve(&m, Some("qwen3.8-flash-next-nvfp4"), &e).is_err(),
            "{e:?}"
        );
    }
}

#[test]
fn missing_cpu_features_are_refused_even_with_the_override() {
    let m = two_cards_64gb(CpuFeatures {
        f16c: false,
        ..AVX2
    });
    let err = check_before_serve(
        &m,
        Some("qwen3.8-flash-next-64g"),
        &env(Some("0"), Some("0")),
    )
    .unwrap_err();
    let Refusal::DoesNotFit { reasons, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(reasons.len(), 1);
    assert!(
        matches!(&reasons[0].need, Need::CpuFeatures { missing, .. } if missing == &vec!["F16C"])
    );
    assert!(
        err.to_string()
            .ends_with("Run `capy-flash doctor` to see which configurations fit this machine."),
        "{err}"
    );
    // The 27B runs on the GPU, but the minimum CPU holds for every model.
    let err = check_before_serve(&m, Some("qwen3.8-27b-nvfp4"), &env(Some("0"), None)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "refusing to load Qwen3.8-27B NVFP4 on this machine:\n  \
         - Qwen3.8-27B NVFP4 runs on the GPU, but Capy Flash needs AVX2 + FMA + F16C on the CPU; \
         this CPU (Test CPU) lacks F16C\n\
         Run `capy-flash doctor` to see which configurations fit this machine."
    );
}

#[test]
fn missing_gpus_are_not_overridable_but_ram_in_the_same_refusal_is() {
    let mut m = two_cards_64gb(AVX2);
    m.gpus.clear();
    m.gpu_note = Some(probe::NO_DRIVER_NOTE.into());
    let err =
        check_before_serve(&m, Some("qwen3.8-flash-next-nvfp4"), &env(None, None)).unwrap_err();
    assert!(
        err.to_string()
            .contains("NINFER_RAM_GUARD=0 overrides only the RAM checks"),
        "{err}"
    );
    let err = check_before_serve(&m, Some("qwen3.8-flash-next-nvfp4"), &env(Some("0"), None))
        .unwrap_err();
    let Refusal::DoesNotFit { reasons, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(reasons.len(), 1, "only the GPU reason is left: {reasons:?}");
    assert!(matches!(reasons[0].need, Need::Gpus { .. }));
}

#[test]
fn models_outside_the_table_get_only_the_cpu_check() {
    // No GPU and little RAM: a demo or tiny model still starts.
    let mut m = two_cards_64gb(AVX2);
    m.gpus.clear();
    m.memory.available_bytes = GIB;
    assert_eq!(check_before_serve(&m, None, &env(None, None)), Ok(vec![]));
    // A CPU without AVX2 + FMA + F16C is refused outright, override or not.
    m.cpu.features = CpuFeatures {
        fma: false,
        f16c: false,
        ..AVX2
    };
    for e in [env(None, None), env(Some("0"), Some("0"))] {
        let err = check_before_serve(&m, None, &e).unwrap_err();
        assert_eq!(
            err,
            Refusal::CpuUnsupported {
                cpu: "Test CPU".into(),
                missing: vec!["FMA", "F16C"]
            }
        );
        assert_eq!(
            err.to_string(),
            "refusing to start: Capy Flash needs AVX2 + FMA + F16C on the CPU; this CPU (Test CPU) \
             lacks FMA, F16C. No override exists: the server's CPU code cannot run without them."
        );
    }
    assert!(check_before_serve(&two_cards_64gb(avx512_off()), None, &env(None, None)).is_err());
}

#[test]
fn an_unknown_configuration_lists_the_known_ones() {
    let m = two_cards_64gb(AVX2);
    let err = check_before_serve(&m, Some("qwen3.8-7b"), &env(None, None)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown configuration 'qwen3.8-7b'; expected one of: qwen3.8-flash-next-nvfp4, qwen3.8-flash-next-64g, \
         qwen3.8-27b-nvfp4, qwen3.8-27b-gsq3"
    );
}

#[test]
fn fitting_configuration_passes_without_warnings() {
    let m = two_cards_64gb(CpuFeatures {
        avx512f: true,
        avx512bw: true,
        avx512vl: true,
        avx512vnni: true,
        ..AVX2
    });
    assert_eq!(
        check_before_serve(&m, Some("qwen3.8-flash-next-64g"), &env(None, None)),
        Ok(vec![])
    );
}

fn disk(free_bytes: u64) -> Disk {
    Disk {
        models_dir: PathBuf::from("/models"),
        measured_at: PathBuf::from("/models"),
        free_bytes,
        total_bytes: 2000 * GB,
    }
}

#[test]
fn download_needs_the_configurations_disk_space() {
    let err =
        check_disk_space(Some(&disk(40_200_000_000)), "qwen3.8-flash-next-nvfp4", 0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "downloading Qwen3.8-Flash-Next NVFP4 needs 135 GB free at /models; 40.2 GB is free; \
         free some space or choose another folder with --models-dir"
    );
    let ok = check_disk_space(Some(&disk(40_200_000_000)), "qwen3.8-27b-nvfp4", 0).unwrap();
    assert_eq!((ok.needed_bytes, ok.ok), (20 * GB, Some(true)));
    // A resumed download needs only what is missing.
    let resumed = check_disk_space(
        Some(&disk(40_200_000_000)),
        "qwen3.8-flash-next-nvfp4",
        100 * GB,
    )
    .unwrap();
    assert_eq!(resumed.needed_bytes, 35 * GB);
    // Unknown free space does not block, and says so.
    let unknown = check_disk_space(None, "qwen3.8-27b-gsq3", 0).unwrap();
    assert_eq!(unknown.ok, None);
    assert!(
        unknown.message.contains("could not be measured"),
        "{}",
        unknown.message
    );
    assert!(matches!(
        check_disk_space(None, "nope", 0),
        Err(DiskRefusal::UnknownConfiguration(_))
    ));
}

#[test]
fn check_disk_measures_a_real_folder() {
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().join("models");
    // Whatever this disk has, the smallest download's verdict must agree with statvfs.
    let free = probe::probe_disk(&models).unwrap().free_bytes;
    let result = check_disk(&models, "qwen3.8-27b-gsq3");
    assert_eq!(result.is_ok(), free >= 15 * GB, "{result:?}");
}
