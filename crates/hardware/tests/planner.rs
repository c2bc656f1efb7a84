//! The planner on a table of machine profiles: each verdict, message and recommendation.
//!
//! Card sizes are what the driver reports (RTX 5060 Ti / 5070 Ti 16 GB: about 16,300 MiB;
//! RTX 5090: 32,607 MiB); RAM sizes are MemTotal of machines with 32, 64 and 96 GB installed.

use capy_hardware::configurations::GIB;
use capy_hardware::plan::{Need, Plan, Verdict};
use capy_hardware::probe::page_locked_from;
use capy_hardware::*;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

fn gpu(index: usize, name: &str, vram_mib: u64, bandwidth: f64, sms: u32, cc: (u32, u32)) -> Gpu {
    Gpu {
        index,
        name: name.to_string(),
        compute_capability: ComputeCapability {
            major: cc.0,
            minor: cc.1,
        },
        total_vram_bytes: vram_mib * MIB,
        free_vram_bytes: Some(vram_mib * MIB - 400 * MIB),
        multiprocessors: Some(sms),
        memory_bandwidth_gb_s: Some(bandwidth),
    }
}

fn rtx_5060_ti(index: usize) -> Gpu {
    gpu(
        index,
        "NVIDIA GeForce RTX 5060 Ti",
        16_311,
        448.0,
        36,
        (12, 0),
    )
}

fn rtx_5070_ti(index: usize) -> Gpu {
    gpu(
        index,
        "NVIDIA GeForce RTX 5070 Ti",
        16_303,
        896.0,
        70,
        (12, 0),
    )
}

fn rtx_5090(index: usize) -> Gpu {
    gpu(
        index,
        "NVIDIA GeForce RTX 5090",
        32_607,
        1792.0,
        170,
        (12, 0),
    )
}

const AVX512: CpuFeatures = CpuFeatures {
    avx2: true,
    fma: true,
    f16c: true,
    avx512f: true,
    avx512bw: true,
    avx512vl: true,
    avx512vnni: true,
};
const AVX2_ONLY: CpuFeatures = CpuFeatures {
    avx2: true,
    fma: true,
    f16c: true,
    avx512f: false,
    avx512bw: false,
    avx512vl: false,
    avx512vnni: false,
};

const RAM_32GB: u64 = 32_600_000 * KIB; // 31.1 GiB
const RAM_64GB: u64 = 65_617_000 * KIB; // 62.6 GiB
const RAM_96GB: u64 = 98_600_000 * KIB; // 94.0 GiB

fn machine(gpus: Vec<Gpu>, total: u64, available: u64, features: CpuFeatures) -> Machine {
    Machine {
        cpu: Cpu {
            model: "Test CPU".to_string(),
            physical_cores: Some(16),
            logical_cores: 32,
            usable_threads: 32,
            features,
        },
        memory: Memory {
            total_bytes: total,
            available_bytes: available,
        },
        page_locked: page_locked_from(MemlockLimit::Bytes(8 * MIB), None, total),
        os: Os {
            name: "Linux 24.04 Ubuntu".to_string(),
            kernel: Some("6.8.0".to_string()),
            arch: "x86_64".to_string(),
        },
        gpu_note: if gpus.is_empty() {
            Some(probe::NO_DRIVER_NOTE.to_string())
        } else {
            None
        },
        cuda_driver_version: if gpus.is_empty() {
            None
        } else {
            Some("13.1".to_string())
        },
        gpus,
        disk: None,
    }
}

fn get<'a>(plan: &'a Plan, id: &str) -> &'a Verdict {
    plan.verdicts
        .iter()
        .find(|v| v.id == id)
        .unwrap_or_else(|| panic!("no verdict for {id}"))
}

fn messages(v: &Verdict) -> Vec<&str> {
    v.unmet.iter().map(|u| u.message.as_str()).collect()
}

/// Every configuration of the table fits, in the table's order.
const ALL_FIT: [(&str, bool); 4] = [
    (NVFP4, true),
    (G64, true),
    (B27_NVFP4, true),
    (B27_3BIT, true),
];

fn fits(plan: &Plan) -> Vec<(&str, bool)> {
    plan.verdicts.iter().map(|v| (v.id, v.fits)).collect()
}

const NVFP4: &str = "qwen3.8-flash-next-nvfp4";
const G64: &str = "qwen3.8-flash-next-64g";
const B27_NVFP4: &str = "qwen3.8-27b-nvfp4";
const B27_3BIT: &str = "qwen3.8-27b-gsq3";

#[test]
fn one_5060_ti_with_64_gb_runs_the_64_gb_edition() {
    let p = plan(&machine(vec![rtx_5060_ti(0)], RAM_64GB, 58 * GIB, AVX512));
    assert_eq!(
        fits(&p),
        vec![
            (NVFP4, false),
            (G64, true),
            (B27_NVFP4, false),
            (B27_3BIT, true)
        ]
    );
    assert_eq!(
        messages(get(&p, NVFP4)),
        vec![
            "Qwen3.8-Flash-Next NVFP4 needs two 16 GB GPUs (or one GPU with twice the VRAM); \
             found NVIDIA GeForce RTX 5060 Ti with 15.9 GiB (at least 15.0 GiB counts as 16 GB)",
            "Qwen3.8-Flash-Next NVFP4 needs a 96 GB machine (at least 90.0 GiB of RAM); this one has 62.6 GiB",
            "Qwen3.8-Flash-Next NVFP4 needs ~75 GiB free RAM; 58.0 GiB is available",
        ]
    );
    let nvfp4 = get(&p, NVFP4);
    assert!(matches!(
        nvfp4.unmet[0].need,
        Need::Gpus {
            needed_cards: 2,
            eligible_cards: 1,
            ..
        }
    ));
    assert_eq!(
        nvfp4.unmet[2].need,
        Need::FreeRam {
            needed_bytes: 75 * GIB,
            actual_bytes: 58 * GIB
        }
    );
    assert!(
        !nvfp4.unmet[0].overridable && nvfp4.unmet[1].overridable && nvfp4.unmet[2].overridable
    );
    let g64 = get(&p, G64);
    assert_eq!(g64.gpus_used, vec![0]);
    assert!(g64.notes.is_empty(), "{:?}", g64.notes);
    assert_eq!(
        messages(get(&p, B27_NVFP4)),
        vec![
            "Qwen3.8-27B NVFP4 needs two 16 GB GPUs (or one GPU with twice the VRAM); \
             found NVIDIA GeForce RTX 5060 Ti with 15.9 GiB (at least 15.0 GiB counts as 16 GB)"
        ]
    );
    assert_eq!(p.recommendation.as_ref().unwrap().id, G64);
    assert_eq!(
        p.summary,
        "recommended: Qwen3.8-Flash-Next 64 GB edition (GSQ-RCO experts) (qwen3.8-flash-next-64g)"
    );
}

#[test]
fn two_5070_ti_with_96_gb_run_everything_and_get_the_default() {
    let p = plan(&machine(
        vec![rtx_5070_ti(0), rtx_5070_ti(1)],
        RAM_96GB,
        88 * GIB,
        AVX512,
    ));
    assert_eq!(fits(&p), ALL_FIT);
    let nvfp4 = get(&p, NVFP4);
    assert_eq!(nvfp4.gpus_used, vec![0, 1]);
    assert!(nvfp4.notes.is_empty(), "{:?}", nvfp4.notes);
    assert_eq!(get(&p, G64).gpus_used, vec![0, 1]);
    assert_eq!(get(&p, B27_3BIT).notes, vec!["uses GPU 0 of the 2 present"]);
    assert_eq!(p.recommendation.as_ref().unwrap().id, NVFP4);
}

#[test]
fn a_5090_with_32_gb_runs_the_27b_nvfp4_on_its_own() {
    let p = plan(&machine(vec![rtx_5090(0)], RAM_32GB, 28 * GIB, AVX512));
    assert_eq!(
        fits(&p),
        vec![
            (NVFP4, false),
            (G64, false),
            (B27_NVFP4, true),
            (B27_3BIT, true)
        ]
    );
    // One 32 GB card stands in for the pair: only RAM stops Flash-Next.
    assert_eq!(
        messages(get(&p, NVFP4)),
        vec![
            "Qwen3.8-Flash-Next NVFP4 needs a 96 GB machine (at least 90.0 GiB of RAM); this one has 31.1 GiB",
            "Qwen3.8-Flash-Next NVFP4 needs ~75 GiB free RAM; 28.0 GiB is available",
        ]
    );
    assert_eq!(
        messages(get(&p, G64)),
        vec![
            "Qwen3.8-Flash-Next 64 GB edition (GSQ-RCO experts) needs a 64 GB machine (at least 60.0 GiB of RAM); \
             this one has 31.1 GiB",
            "Qwen3.8-Flash-Next 64 GB edition (GSQ-RCO experts) needs ~56 GiB free RAM; 28.0 GiB is available",
        ]
    );
    assert!(get(&p, G64).unmet.iter().all(|u| u.overridable));
    assert_eq!(get(&p, B27_NVFP4).gpus_used, vec![0]);
    assert_eq!(p.recommendation.as_ref().unwrap().id, B27_NVFP4);
}

#[test]
fn wsl2_with_64_gb_keeps_part_of_the_experts_pageable() {
    let mut m = machine(vec![rtx_5060_ti(0)], 64 * GIB, 60 * GIB, AVX512);
    m.page_locked = page_locked_from(
        MemlockLimit::Unlimited,
        Some(Wsl::Wsl2),
        m.memory.total_bytes,
    );
    assert_eq!(m.page_locked.cap_bytes, 32 * GIB);
    let p = plan(&m);
    assert_eq!(
        fits(&p),
        vec![
            (NVFP4, false),
            (G64, true),
            (B27_NVFP4, false),
            (B27_3BIT, true)
        ]
    );
    assert_eq!(
        get(&p, G64).notes,
        vec![
            "page-locked memory is capped at 32.0 GiB (WSL2 lets CUDA page-lock about half of RAM; what does not fit \
             stays in pageable RAM): 16.0 GiB of the 48 GiB of experts stay in pageable RAM: same tokens, slower"
        ]
    );
    // The 27B 3-bit needs no page-locked memory, so WSL2 changes nothing for it.
    assert!(get(&p, B27_3BIT).notes.is_empty());
    assert_eq!(p.recommendation.as_ref().unwrap().id, G64);
}

#[test]
fn an_avx2_only_cpu_runs_flash_next_with_a_note() {
    let p = plan(&machine(
        vec![rtx_5070_ti(0), rtx_5070_ti(1)],
        RAM_96GB,
        88 * GIB,
        AVX2_ONLY,
    ));
    assert_eq!(fits(&p), ALL_FIT);
    let note =
        "experts on the CPU use the AVX2 + FMA + F16C kernels: slower than with AVX-512 VNNI";
    assert_eq!(get(&p, NVFP4).notes, vec![note]);
    assert_eq!(get(&p, G64).notes, vec![note]);
    assert!(get(&p, B27_NVFP4).notes.is_empty());
    assert_eq!(p.recommendation.as_ref().unwrap().id, NVFP4);
}

#[test]
fn a_cpu_without_f16c_is_refused_every_configuration() {
    let no_f16c = CpuFeatures {
        f16c: false,
        ..AVX2_ONLY
    };
    let mut m = machine(
        vec![rtx_5070_ti(0), rtx_5070_ti(1)],
        RAM_96GB,
        88 * GIB,
        no_f16c,
    );
    m.cpu.model = "Old CPU".to_string();
    let p = plan(&m);
    assert_eq!(
        fits(&p),
        vec![
            (NVFP4, false),
            (G64, false),
            (B27_NVFP4, false),
            (B27_3BIT, false)
        ]
    );
    let nvfp4 = get(&p, NVFP4);
    assert_eq!(
        messages(nvfp4),
        vec![
            "Qwen3.8-Flash-Next NVFP4 computes experts on the CPU and needs AVX-512 (F, BW, VL, VNNI) or \
             AVX2 + FMA + F16C; this CPU (Old CPU) lacks F16C"
        ]
    );
    assert!(
        matches!(&nvfp4.unmet[0].need, Need::CpuFeatures { missing, .. } if missing == &vec!["F16C"])
    );
    assert!(!nvfp4.unmet[0].overridable);
    // The 27B runs on the GPU, but the product's minimum CPU holds for every model.
    let b27 = get(&p, B27_NVFP4);
    assert_eq!(
        messages(b27),
        vec![
            "Qwen3.8-27B NVFP4 runs on the GPU, but Capy Flash needs AVX2 + FMA + F16C on the CPU; \
             this CPU (Old CPU) lacks F16C"
        ]
    );
    assert!(!b27.unmet[0].overridable);
    assert!(b27.notes.is_empty());
    assert_eq!(p.recommendation, None);
    assert!(
        p.summary.starts_with(
            "no configuration fits this machine: Qwen3.8-27B 3-bit (GSQ-RCO) runs on the GPU"
        ),
        "{}",
        p.summary
    );
}

#[test]
fn no_gpu_fits_nothing_and_says_why() {
    let p = plan(&machine(vec![], 24 * GIB, 23 * GIB, AVX2_ONLY));
    assert_eq!(
        fits(&p),
        vec![
            (NVFP4, false),
            (G64, false),
            (B27_NVFP4, false),
            (B27_3BIT, false)
        ]
    );
    let small = get(&p, B27_3BIT);
    assert_eq!(
        messages(small),
        vec!["Qwen3.8-27B 3-bit (GSQ-RCO) needs one 16 GB GPU; none found (no NVIDIA driver found (libcuda.so.1 not loadable))"]
    );
    assert!(matches!(
        small.unmet[0].need,
        Need::Gpus {
            needed_cards: 1,
            eligible_cards: 0,
            ..
        }
    ));
    assert_eq!(
        get(&p, NVFP4).unmet.len(),
        3,
        "GPU, machine size and free RAM: {:?}",
        messages(get(&p, NVFP4))
    );
    assert_eq!(p.recommendation, None);
    assert_eq!(
        p.summary,
        "no configuration fits this machine: Qwen3.8-27B 3-bit (GSQ-RCO) needs one 16 GB GPU; \
         none found (no NVIDIA driver found (libcuda.so.1 not loadable))"
    );
}

#[test]
fn a_mixed_5060_ti_and_5090_pair_runs_at_the_slower_pace() {
    let p = plan(&machine(
        vec![rtx_5060_ti(0), rtx_5090(1)],
        RAM_96GB,
        88 * GIB,
        AVX512,
    ));
    assert_eq!(fits(&p), ALL_FIT);
    let nvfp4 = get(&p, NVFP4);
    assert_eq!(nvfp4.gpus_used, vec![1, 0], "fastest card first");
    assert_eq!(
        nvfp4.notes,
        vec![
            "mixed pair: GPU 1 (NVIDIA GeForce RTX 5090, 1792 GB/s) and GPU 0 (NVIDIA GeForce RTX 5060 Ti, 448 GB/s) \
             run at the slower card's pace (NVIDIA GeForce RTX 5060 Ti)",
            "GPU 1 (NVIDIA GeForce RTX 5090) alone holds this configuration and would run at its own, faster pace",
        ]
    );
    // The 64 GB edition needs one card; with two it still uses both and the pace note applies.
    assert_eq!(get(&p, G64).gpus_used, vec![1, 0]);
    // The one-card 27B picks the faster card.
    assert_eq!(get(&p, B27_3BIT).gpus_used, vec![1]);
    assert_eq!(get(&p, B27_3BIT).notes, vec!["uses GPU 1 of the 2 present"]);
    assert_eq!(p.recommendation.as_ref().unwrap().id, NVFP4);
}

#[test]
fn a_12_gb_card_does_not_count_as_16_gb() {
    let rtx_5070 = gpu(0, "NVIDIA GeForce RTX 5070", 12_227, 672.0, 48, (12, 0));
    let p = plan(&machine(vec![rtx_5070], RAM_64GB, 58 * GIB, AVX512));
    assert!(p.verdicts.iter().all(|v| !v.fits));
    assert_eq!(
        messages(get(&p, B27_3BIT)),
        vec!["Qwen3.8-27B 3-bit (GSQ-RCO) needs one 16 GB GPU; found NVIDIA GeForce RTX 5070 with 11.9 GiB \
              (at least 15.0 GiB counts as 16 GB)"]
    );
}

#[test]
fn a_card_that_is_not_sm_120_runs_with_a_note() {
    let h200 = gpu(0, "NVIDIA H200", 143_771, 4800.0, 132, (9, 0));
    let p = plan(&machine(vec![h200], RAM_96GB, 88 * GIB, AVX512));
    assert!(p.verdicts.iter().all(|v| v.fits));
    assert_eq!(
        get(&p, NVFP4).notes,
        vec!["GPU 0 (NVIDIA H200, sm_90) is not sm_120: it runs, but the kernels are tuned for RTX 50 series cards"]
    );
}

#[test]
fn vram_held_by_other_programs_is_noted() {
    let mut busy = rtx_5070_ti(0);
    busy.free_vram_bytes = Some(10 * GIB);
    let p = plan(&machine(vec![busy], RAM_64GB, 58 * GIB, AVX512));
    assert_eq!(
        get(&p, B27_3BIT).notes,
        vec!["GPU 0 has 10.0 GiB of 15.9 GiB VRAM free: other programs hold the rest, leaving less for caches"]
    );
}

#[test]
fn the_plan_serialises_for_the_ui() {
    let p = plan(&machine(vec![rtx_5060_ti(0)], RAM_64GB, 58 * GIB, AVX512));
    let json = serde_json::to_value(&p).unwrap();
    let first = &json["verdicts"][0];
    assert_eq!(first["id"], NVFP4);
    assert_eq!(first["unmet"][2]["requirement"], "free_ram");
    assert_eq!(first["unmet"][2]["needed_bytes"], 75 * GIB);
    assert_eq!(first["configuration"]["disk_bytes"], 135_000_000_000u64);
    assert_eq!(json["recommendation"]["id"], G64);
}
