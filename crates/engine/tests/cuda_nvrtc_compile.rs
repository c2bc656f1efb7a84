//! Every CUDA kernel compiles with NVRTC for sm_90 (H100/H200) and sm_120 (RTX 50), without a
//! GPU. CI installs libnvrtc from the `nvidia-cuda-nvrtc` wheel and points `CAPY_NVRTC_LIB` at
//! it; where no libnvrtc is found the test prints why and passes.
#![cfg(feature = "cuda")]

use capy_engine::backend::cuda::kernels;
use std::path::{Path, PathBuf};

/// `CAPY_NVRTC_LIB`, else a `libnvrtc.so*` in a folder of `LD_LIBRARY_PATH`.
fn find_nvrtc() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("CAPY_NVRTC_LIB") {
        return Some(PathBuf::from(p));
    }
    let dirs = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    dirs.split(':')
        .filter(|d| !d.is_empty())
        .find_map(|d| kernels::library_in(Path::new(d), "libnvrtc.so"))
}

/// Points the kernel module at the NVRTC found (`find_nvrtc`) and returns true, or prints why
/// the test is skipped and returns false.
fn use_nvrtc() -> bool {
    let Some(lib) = find_nvrtc() else {
        println!(
            "skipping: no libnvrtc found (set CAPY_NVRTC_LIB to libnvrtc.so.*, e.g. from `pip install nvidia-cuda-nvrtc`, \
             or add its folder to LD_LIBRARY_PATH)"
        );
        return false;
    };
    // The kernel module loads it from here before its own by-name search.
    std::env::set_var("CAPY_NVRTC_LIB", &lib);
    println!("NVRTC from {}", lib.display());
    true
}

#[test]
fn every_kernel_compiles_for_sm_90_and_sm_120() {
    if !use_nvrtc() {
        return;
    }
    let (major, minor) = kernels::nvrtc_version().expect("libnvrtc loads and reports its version");
    println!("NVRTC {major}.{minor}");
    let sources = kernels::sources();
    assert!(
        sources.len() >= 5,
        "expected every kernel file, found {}",
        sources.len()
    );
    for arch in [90, 120] {
        for src in &sources {
            let cubin = kernels::compile_cubin(src, arch).unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "kernels/{}.cu for sm_{arch}: NVRTC did not return a CUBIN",
                src.name
            );
            // Every entry point the backend looks up is in the machine code's symbol table.
            for f in &src.functions {
                assert!(
                    cubin
                        .windows(f.len() + 1)
                        .any(|w| &w[..f.len()] == f.as_bytes() && w[f.len()] == 0),
                    "kernels/{}.cu for sm_{arch} lacks the entry point {f}",
                    src.name
                );
            }
            println!(
                "kernels/{}.cu: sm_{arch} CUBIN of {} bytes, {} entry points",
                src.name,
                cubin.len(),
                src.functions.len()
            );
        }
    }
}

#[test]
fn unsupported_architecture_is_refused_with_the_supported_list() {
    if !use_nvrtc() {
        return;
    }
    let src = &kernels::sources()[0];
    let err = kernels::compile_cubin(src, 11)
        .expect_err("sm_11 does not exist")
        .to_string();
    assert!(
        err.contains("sm_11") && err.contains("supports"),
        "unhelpful error: {err}"
    );
}

/// ptxas's register and local-memory report for every entry point of the quantized-expert
/// module on sm_90 and sm_120. The tensor-core prefill kernels are built to fit their launch
/// bound (two CTAs an SM, 128 registers) without spilling: a spill there put 76M local-memory
/// requests into one gate/up launch on the H100 (bench/results/ncu-detail-moe-prefill-*).
#[test]
fn tensor_core_prefill_kernels_fit_their_registers_without_spilling() {
    if !use_nvrtc() {
        return;
    }
    let sources = kernels::sources();
    let quant = sources
        .iter()
        .find(|s| s.functions.iter().any(|f| f == "moe_prefill_gate_up"))
        .expect("the module holding moe_prefill_gate_up");
    for arch in [90, 120] {
        let (_, log) = kernels::compile_cubin_with_log(quant, arch, &["--ptxas-options=-v"])
            .unwrap_or_else(|e| panic!("{e:#}"));
        let report = kernels::parse_ptxas_resources(&log);
        for f in &quant.functions {
            let r = report
                .iter()
                .find(|r| &r.function == f)
                .unwrap_or_else(|| panic!("ptxas reported nothing for {f} on sm_{arch}:\n{log}"));
            println!(
                "sm_{arch} {f}: {} registers, {} B stack, {} B spill stores, {} B spill loads",
                r.registers, r.stack_bytes, r.spill_store_bytes, r.spill_load_bytes
            );
            assert!(r.registers > 0, "no register count for {f} in:\n{log}");
            if f.starts_with("moe_prefill_") && f != "moe_prefill_align" {
                assert!(
                    r.registers <= 128 && r.spill_store_bytes == 0 && r.spill_load_bytes == 0,
                    "{f} on sm_{arch}: expected ≤ 128 registers and no spills, found {} registers, \
                     {} B spill stores, {} B spill loads; shrink what the staging keeps live",
                    r.registers,
                    r.spill_store_bytes,
                    r.spill_load_bytes
                );
            }
        }
    }
}
