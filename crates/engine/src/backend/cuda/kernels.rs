//! CUDA C kernels: the sources in `kernels/` (embedded in the binary), compiled by NVRTC at
//! first use for the device's architecture and cached on disk.
//!
//! The cache key is the source hash, the architecture and the NVRTC version, so a new kernel
//! source, a different GPU or an NVRTC upgrade each compile afresh. The cached artefact is a
//! CUBIN (machine code for exactly that architecture), so loading it needs no PTX JIT.

use anyhow::{bail, Context, Result};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The oldest NVRTC that compiles for the architectures the product targets (sm_120 needs 12.8).
pub const MIN_NVRTC: (i32, i32) = (12, 8);

const COMMON: &str = include_str!("../../../../../kernels/common.cuh");

/// One kernel file, with the shared prelude already prepended.
pub struct KernelSource {
    pub name: &'static str,
    pub source: String,
    /// The `extern "C"` entry points it defines.
    pub functions: Vec<String>,
}

fn matvec_functions() -> Vec<String> {
    let mut v = Vec::new();
    for dt in ["bf16", "f16", "f32"] {
        for rows in 1..=super::MATVEC_MAX_ROWS {
            v.push(format!("matvec_{dt}_{rows}"));
            for ks in super::MATVEC_SPLITS {
                v.push(format!("matvec_{dt}_{rows}_k{ks}"));
            }
        }
    }
    v
}

/// The block-format codes (`#define QF_*`) and the quantized-weight tables as `__device__`
/// arrays (values as f32 bit patterns), generated from the constants the host passes and the
/// statics the CPU decodes with, so the two sides cannot drift apart.
pub fn quant_tables() -> String {
    use crate::quant::iq_tables::{IQ2XS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
    fn table<T: std::fmt::LowerHex>(
        ty: &str,
        name: &str,
        values: impl Iterator<Item = T>,
    ) -> String {
        let body: Vec<String> = values.map(|v| format!("0x{v:x}")).collect();
        format!(
            "__device__ const {ty} {name}[{}] = {{{}}};\n",
            body.len(),
            body.join(",")
        )
    }
    let mut s: String = super::QUANT_FORMAT_CODES
        .iter()
        .map(|(name, code)| format!("#define {name} {code}\n"))
        .collect();
    s += &table(
        "u32",
        "QT_E4M3",
        crate::quant::fp8::E4M3_TO_F32.iter().map(|v| v.to_bits()),
    );
    s += &table(
        "u32",
        "QT_E2M1",
        crate::quant::nvfp4::E2M1_TO_F32.iter().map(|v| v.to_bits()),
    );
    s += &table("u32", "QT_IQ3S", IQ3S_GRID.iter().copied());
    s += &table("u32", "QT_IQ3XXS", IQ3XXS_GRID.iter().copied());
    s += &table("u64", "QT_IQ2XS", IQ2XS_GRID.iter().copied());
    s += &table("unsigned char", "QT_KSIGNS", KSIGNS_IQ2XS.iter().copied());
    s
}

fn quant_functions() -> Vec<String> {
    let mut v: Vec<String> = (1..=super::MATVEC_MAX_ROWS)
        .map(|rows| format!("quant_matvec_{rows}"))
        .collect();
    v.push("quant_dequant_rows".into());
    v.extend(
        [
            "moe_q_gate_up",
            "moe_q_gate_up_1",
            "moe_q_down",
            "moe_q_down_1",
            "moe_q_dequant",
        ]
        .map(String::from),
    );
    v.push("moe_dec_gate_up_iq3_s".into());
    v.push("moe_dec_gate_up_iq3s_q8".into());
    v.push("moe_dec_down_q2_0_q8".into());
    v.push("moe_dec_gate_up_nvfp4_q8".into());
    v.push("moe_dec_down_nvfp4_q8".into());
    v.extend(
        [
            "moe_prefill_align",
            "moe_prefill_gate_up",
            "moe_prefill_down",
        ]
        .map(String::from),
    );
    v.push("quant_matvec_nvfp4_q8".into());
    v.push("quant_matvec_iq3s_q8".into());
    v.push("quantize_x_q8r".into());
    v.extend(
        (1..=4)
            .filter(|r| *r != 3)
            .map(|r| format!("quant_matvec_nvfp4r_q8_{r}")),
    );
    v.extend(super::NVFP4R_SPLITK.iter().map(|k| k.name.to_string()));
    v.extend((1..=2).map(|r| format!("quant_matvec_iq3sr_q8_{r}")));
    v.push("quant_matvec_iq3sr_q8_2_unroll2".into());
    v.extend(super::IQ3SR_SPLITK.iter().map(|k| k.name.to_string()));
    v
}

/// Every kernel file this backend uses.
pub fn sources() -> Vec<KernelSource> {
    // moe_quant.cu (the hybrid cache's grouped quantized experts) and moe_prefill.cu (prefill's
    // experts on tensor cores) decode with quant_matvec.cu's `qdecode8`, so they are compiled in
    // the same module.
    let quant_body = format!(
        "{}\n{}\n{}\n{}\n{}",
        quant_tables(),
        include_str!("../../../../../kernels/quant_matvec.cu"),
        include_str!("../../../../../kernels/moe_quant.cu"),
        include_str!("../../../../../kernels/moe_quant_decode.cu"),
        include_str!("../../../../../kernels/moe_prefill.cu")
    );
    let files: [(&str, &str, Vec<String>); 8] = [
        (
            "elementwise",
            include_str!("../../../../../kernels/elementwise.cu"),
            [
                "embedding",
                "add_assign",
                "silu_mul",
                "sigmoid_gate",
                "copy_cols",
                "split_cols4",
                "silu_mul_halves",
                "sigmoid_gate_q8",
                "silu_mul_halves_q8",
                "delta_rule_gates",
                "f32_to_bf16_kernel",
                "f32_to_f16_kernel",
                "weight_to_f32",
                "rope",
                "causal_conv1d_silu",
                "causal_conv1d_state",
                "causal_conv1d_silu_update",
                "gdn_decode_inputs",
            ]
            .map(String::from)
            .to_vec(),
        ),
        (
            "norm",
            include_str!("../../../../../kernels/norm.cu"),
            [
                "rms_norm",
                "rms_norm_warps",
                "add_rms_norm",
                "add_rms_norm_split",
                "rms_norm_rope",
                "rms_norm_wide",
                "attention_inputs_row",
            ]
            .map(String::from)
            .to_vec(),
        ),
        (
            "matvec",
            include_str!("../../../../../kernels/matvec.cu"),
            matvec_functions(),
        ),
        (
            "attention",
            include_str!("../../../../../kernels/attention.cu"),
            [
                "attn_split",
                "attn_combine",
                "causal_softmax",
                "causal_softmax_bf16",
            ]
            .map(String::from)
            .to_vec(),
        ),
        (
            "delta_rule",
            include_str!("../../../../../kernels/delta_rule.cu"),
            ["gated_delta_rule", "gdr_chunk_prep", "gdr_chunk_scan"]
                .map(String::from)
                .to_vec(),
        ),
        ("quant_matvec", &quant_body, quant_functions()),
        (
            "sampling",
            include_str!("../../../../../kernels/sampling.cu"),
            ["argmax_partial", "argmax_final"]
                .map(String::from)
                .to_vec(),
        ),
        (
            "mailbox",
            include_str!("../../../../../kernels/mailbox.cu"),
            ["mailbox_write", "mailbox_signal", "mailbox_wait_sum"]
                .map(String::from)
                .to_vec(),
        ),
    ];
    files
        .into_iter()
        .chain(super::flash_next::kernel_files())
        .map(|(name, body, functions)| KernelSource {
            name,
            source: format!("{COMMON}\n{body}"),
            functions,
        })
        .collect()
}

/// FNV-1a, 64 bits: a hash that is stable across Rust releases (the cache outlives the binary).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

static NVRTC_READY: OnceLock<std::result::Result<(i32, i32), String>> = OnceLock::new();

/// The last (by name: the highest version) file in `dir` whose name starts with `prefix`, e.g.
/// `libnvrtc.so` finds `libnvrtc.so.13` (not the `.alt` ABI variant, `libnvrtc.alt.so.13`).
pub fn library_in(dir: &Path, prefix: &str) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    found.sort();
    found.pop()
}

/// Makes sure libnvrtc can be used and returns its version.
///
/// `CAPY_NVRTC_LIB` may name the library file (e.g. the one inside the `nvidia-cuda-nvrtc`
/// wheel); it is loaded first so that the loader's by-name search finds it already resident.
/// Otherwise the usual search applies (`LD_LIBRARY_PATH`, the system's library folders).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    NVRTC_READY
        .get_or_init(|| {
            if let Ok(path) = std::env::var("CAPY_NVRTC_LIB") {
                // libnvrtc opens its builtins library by name at the first compile; a wheel's
                // copy beside it is found only if it is already resident (13.0's wheel sets no
                // search path for it).
                let dir = Path::new(&path).parent().unwrap_or(Path::new("."));
                if let Some(builtins) = library_in(dir, "libnvrtc-builtins.so") {
                    // SAFETY: as below, vendor initialisers only.
                    if let Ok(lib) = unsafe { libloading::Library::new(&builtins) } {
                        std::mem::forget(lib);
                    }
                }
                // SAFETY: loading libnvrtc runs only its (trusted, vendor) initialisers.
                match unsafe { libloading::Library::new(&path) } {
                    // Kept loaded for the life of the process.
                    Ok(lib) => std::mem::forget(lib),
                    Err(e) => return Err(format!("CAPY_NVRTC_LIB={path} cannot be loaded: {e}")),
                }
            }
            // SAFETY: probing for the library has no side effects beyond loading it.
            if !unsafe { nvrtc_sys::is_culib_present() } {
                return Err(format!(
                    "NVRTC (libnvrtc.so, CUDA {}.{} or newer) was not found. Install the CUDA runtime compiler \
                     (the CUDA toolkit, or `pip install nvidia-cuda-nvrtc` and set CAPY_NVRTC_LIB to the \
                     libnvrtc.so.* inside it), or add its folder to LD_LIBRARY_PATH",
                    MIN_NVRTC.0, MIN_NVRTC.1
                ));
            }
            let (mut major, mut minor) = (0, 0);
            // SAFETY: plain out-parameters.
            let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
            if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                return Err(format!("nvrtcVersion failed: {r:?}"));
            }
            if (major, minor) < MIN_NVRTC {
                return Err(format!(
                    "NVRTC {major}.{minor} was found; Capy Flash needs NVRTC {}.{} or newer (it compiles for sm_90 and sm_120). \
                     Install a newer CUDA toolkit or `pip install nvidia-cuda-nvrtc`",
                    MIN_NVRTC.0, MIN_NVRTC.1
                ));
            }
            Ok((major, minor))
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// The architectures this NVRTC can compile for, as `sm_XY` numbers (e.g. 90, 120).
pub fn supported_archs() -> Result<Vec<i32>> {
    nvrtc_version()?;
    let mut n = 0;
    // SAFETY: out-parameters sized by the first call.
    unsafe {
        nvrtc_sys::nvrtcGetNumSupportedArchs(&mut n)
            .result()
            .map_err(|e| anyhow::anyhow!("nvrtcGetNumSupportedArchs: {e:?}"))?;
        let mut archs = vec![0i32; n.max(0) as usize];
        nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr())
            .result()
            .map_err(|e| anyhow::anyhow!("nvrtcGetSupportedArchs: {e:?}"))?;
        Ok(archs)
    }
}

/// Compiles one kernel file for `sm_{arch}` and returns the CUBIN.
pub fn compile_cubin(src: &KernelSource, arch: i32) -> Result<Vec<u8>> {
    compile_cubin_with_log(src, arch, &[]).map(|(cubin, _)| cubin)
}

/// Compiles one kernel file for `sm_{arch}` with `extra` NVRTC options (e.g.
/// `--ptxas-options=-v`) and returns the CUBIN and NVRTC's log.
pub fn compile_cubin_with_log(
    src: &KernelSource,
    arch: i32,
    extra: &[&str],
) -> Result<(Vec<u8>, String)> {
    let (major, minor) = nvrtc_version()?;
    let archs = supported_archs()?;
    if !archs.contains(&arch) {
        bail!("NVRTC {major}.{minor} cannot compile for sm_{arch}; it supports {archs:?}. Install a newer CUDA toolkit or NVRTC");
    }
    let code = CString::new(src.source.as_str()).context("kernel source contains a NUL byte")?;
    let name = CString::new(format!("{}.cu", src.name)).expect("kernel file names have no NUL");
    let prog = nvrtc::create_program(&code, Some(&name))
        .map_err(|e| anyhow::anyhow!("nvrtcCreateProgram({}): {e:?}", src.name))?;
    let mut options = vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".to_string(),
    ];
    options.extend(extra.iter().map(|o| o.to_string()));
    // SAFETY: `prog` is a live program; it is destroyed below on every path.
    let compiled = unsafe { nvrtc::compile_program(prog, &options) };
    let result = (|| {
        // SAFETY: the log is read from the same live program.
        let log = unsafe { nvrtc::get_program_log(prog) }.unwrap_or_default();
        let log = unsafe { CStr::from_ptr(log.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        if let Err(e) = compiled {
            bail!("NVRTC {major}.{minor} failed to compile kernels/{}.cu for sm_{arch} ({e:?}):\n{log}", src.name);
        }
        let mut size = 0usize;
        // SAFETY: sizes come from NVRTC for this program.
        unsafe {
            nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                .result()
                .map_err(|e| anyhow::anyhow!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut cubin = vec![0u8; size];
            nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _)
                .result()
                .map_err(|e| anyhow::anyhow!("nvrtcGetCUBIN: {e:?}"))?;
            Ok((cubin, log))
        }
    })();
    // SAFETY: destroyed exactly once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// One entry point's resources as ptxas reports them (`--ptxas-options=-v`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelResources {
    pub function: String,
    pub registers: u32,
    /// Per-thread stack frame (local memory), bytes.
    pub stack_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
}

/// The per-function resources in a ptxas `-v` log: each "Compiling entry function 'F'" is
/// followed by "N bytes stack frame, S bytes spill stores, L bytes spill loads" and
/// "Used R registers".
pub fn parse_ptxas_resources(log: &str) -> Vec<KernelResources> {
    fn number_before(line: &str, unit: &str) -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    }
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let function = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(KernelResources {
                function,
                registers: 0,
                stack_bytes: 0,
                spill_store_bytes: 0,
                spill_load_bytes: 0,
            });
            continue;
        }
        let Some(last) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            last.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            last.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
            last.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if let Some(r) = number_before(line, "registers") {
            if line.contains("Used") {
                last.registers = r;
            }
        }
    }
    out
}

/// Where compiled kernels are cached: `$XDG_CACHE_HOME/capy-flash/kernels` (or `CAPY_KERNEL_CACHE`).
pub fn cache_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("CAPY_KERNEL_CACHE") {
        return Some(PathBuf::from(dir));
    }
    directories::ProjectDirs::from("", "", "capy-flash").map(|d| d.cache_dir().join("kernels"))
}

/// The CUBIN of one kernel file for `sm_{arch}`: from the disk cache, else compiled and cached.
pub fn cubin(src: &KernelSource, arch: i32) -> Result<Vec<u8>> {
    let (major, minor) = nvrtc_version()?;
    let key = format!(
        "{}-{:016x}-sm_{arch}-nvrtc{major}.{minor}.cubin",
        src.name,
        fnv1a(src.source.as_bytes())
    );
    let path = cache_dir().map(|d| d.join(&key));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let bytes = compile_cubin(src, arch)?;
    if let Some(p) = &path {
        // A cache that cannot be written only costs a recompile next time.
        if let Some(dir) = p.parent() {
            if std::fs::create_dir_all(dir).is_ok() {
                let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &bytes).is_ok() && std::fs::rename(&tmp, p).is_err() {
                    let _ = std::fs::remove_file(&tmp);
                }
            }
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernels are launched with programmatic dependent launch (kernels/common.cuh): one that
    /// touched memory before `griddepcontrol.wait` could race the kernel before it. Every
    /// `__global__` function must begin with `KERNEL_START();`.
    #[test]
    fn every_kernel_waits_for_its_predecessor_first() {
        let mut kernels = 0;
        for src in sources() {
            let body = &src.source;
            let mut from = 0;
            while let Some(at) = body[from..].find("__global__ void") {
                let start = from + at;
                // The signature's closing parenthesis, then the body's brace.
                let open = start + body[start..].find('(').expect("a parameter list");
                let mut depth = 0;
                let mut close = open;
                for (i, c) in body[open..].char_indices() {
                    match c {
                        '(' => depth += 1,
                        ')' => depth -= 1,
                        _ => {}
                    }
                    if depth == 0 {
                        close = open + i;
                        break;
                    }
                }
                let brace = close + body[close..].find('{').expect("a body");
                let name = body[start..open]
                    .trim_start_matches("__global__ void")
                    .trim();
                assert!(
                    body[brace + 1..]
                        .trim_start()
                        .starts_with("KERNEL_START();"),
                    "{}: kernel {name} does not begin with KERNEL_START();",
                    src.name
                );
                kernels += 1;
                from = brace;
            }
        }
        assert!(kernels >= 50, "found only {kernels} kernels");
    }
}
