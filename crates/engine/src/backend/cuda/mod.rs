//! The CUDA backend: the same ops as the CPU reference, on one GPU, through cudarc.
//!
//! Everything is loaded at run time (`libcuda`, `libnvrtc`, `libcublas`), so the binary builds
//! and starts without a toolkit or a GPU; [`CudaBackend::new`] says what is missing.
//!
//! - Activations ([`CudaTensor`]) are f32 `[rows, cols]` device buffers; KV caches grow in
//!   place with spare capacity.
//! - Weights ([`CudaMatrix`]) stay in the checkpoint's dtype (BF16, F16 or F32). A linear layer
//!   on a few rows (decode) runs the `matvec` kernel: f32 activations, f32 accumulation, each
//!   weight read once. On many rows (prefill) it runs cuBLAS: by default with the activations
//!   rounded to the weight's 16-bit type (BF16 tensor cores, f32 accumulation); with
//!   `CAPY_EXACT_MATH=1` the weights are widened to f32 a block at a time and multiplied in f32,
//!   so the result matches the CPU reference.
//! - All work is queued on one stream; only [`Backend::to_host`] waits for it.
//! - Every device allocation goes through a ledger that enforces the VRAM budget.

pub mod bench;
pub mod flash_next;
pub mod graph;
mod host_pin;
pub mod iq3s_records;
pub mod kernels;
pub mod mailbox;
mod nvfp4_records;
mod staging;

use super::cpu::experts::format::RowFormat;
use super::{
    argmax_rows_on_host, attention_inputs_composed, gdn_output_norm, AttentionShape, Backend,
    DeltaRuleMode, DeltaRuleShape, NormScale,
};
use crate::config::GateActivation;
use crate::tensor::{DType, HostTensor};
use anyhow::{bail, Result};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaStream};
use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CString};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Rows up to which a linear layer uses the matvec kernel instead of cuBLAS.
pub const MATVEC_MAX_ROWS: usize = 8;
/// Warps a row of the split-K float matvecs (`matvec_<dt>_<rows>_k<KS>` in matvec.cu).
pub const MATVEC_SPLITS: [usize; 3] = [2, 4, 8];

/// Warps a row for the float matvec of a `[rows, ·]` matrix of `vectors` 16-byte vectors a
/// row: 1 (a warp a row, 8 rows a block) where that gives every SM 4 blocks; else the fewest
/// [`MATVEC_SPLITS`] that do, or failing that the most, each keeping every lane at least one
/// vector. Flash-Next's router (513 rows) and hyper-connection projections ran at a tenth of
/// the copy bandwidth on 41 to 65 blocks.
pub fn dense_matvec_splits(rows: usize, vectors: usize, multiprocessors: usize) -> usize {
    let full = 4 * multiprocessors.max(1);
    let blocks = |ks: usize| ceil_div(rows, 8 / ks);
    if blocks(1) >= full {
        return 1;
    }
    let fits = MATVEC_SPLITS
        .iter()
        .copied()
        .filter(|&ks| vectors >= 32 * ks);
    fits.clone()
        .find(|&ks| blocks(ks) >= full)
        .or_else(|| fits.max())
        .unwrap_or(1)
}
/// Widest input the int8 decode matvec takes (its shared memory holds x as int8).
const QMV8_MAX_COLS: usize = 32768;
/// Warps per block of the int8 decode matvec (each block quantizes x once for all of them).
const QMV8_WARPS: usize = 16;
/// Rows per warp and warps per block of the NVFP4 records matvec (kernels/quant_matvec.cu
/// `quant_matvec_nvfp4r_q8_*`; tools/cuda_microbench measures the alternatives).
const NVFP4R_ROWS_PER_WARP: usize = 2;
const NVFP4R_WARPS: usize = 8;

/// A records matvec with each row's records split over `ks` slices of a 256-thread block
/// (`RecordsFamily::slices`: warps for NVFP4, `quant_matvec_nvfp4r_q8k_*`; half-warps for
/// IQ3_S, `quant_matvec_iq3sr_q8k_*`): `rpw` rows a slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordsSplitK {
    pub name: &'static str,
    pub rpw: usize,
    pub ks: usize,
}

const fn splitk(name: &'static str, rpw: usize, ks: usize) -> RecordsSplitK {
    RecordsSplitK { name, rpw, ks }
}

/// In order of preference: more rows a warp (fewer x reloads), fewer warps a row (less to add).
pub const NVFP4R_SPLITK: [RecordsSplitK; 6] = [
    splitk("quant_matvec_nvfp4r_q8k_2_2", 2, 2),
    splitk("quant_matvec_nvfp4r_q8k_2_4", 2, 4),
    splitk("quant_matvec_nvfp4r_q8k_1_2", 1, 2),
    splitk("quant_matvec_nvfp4r_q8k_1_4", 1, 4),
    splitk("quant_matvec_nvfp4r_q8k_2_8", 2, 8),
    splitk("quant_matvec_nvfp4r_q8k_1_8", 1, 8),
];

/// IQ3_S records, a half-warp a slice, in order of preference: one row a half-warp first. On
/// an H100 (tools/cuda_microbench/iq3s_records_bench.cu) the 5120-row matrices of the 27B read
/// at 1.66 TB/s with `_1_2` and `_1_4`, 1.46 to 1.56 with two rows a half-warp.
pub const IQ3SR_SPLITK: [RecordsSplitK; 5] = [
    splitk("quant_matvec_iq3sr_q8k_1_2", 1, 2),
    splitk("quant_matvec_iq3sr_q8k_1_4", 1, 4),
    splitk("quant_matvec_iq3sr_q8k_2_4", 2, 4),
    splitk("quant_matvec_iq3sr_q8k_2_8", 2, 8),
    splitk("quant_matvec_iq3sr_q8k_1_8", 1, 8),
];

/// One format's records matvecs (kernels/quant_matvec.cu): `slices` (warps or half-warps) a
/// 256-thread block, the plain kernel (`plain_rpw` rows a slice, one pass over the rows), the
/// split-K variants, and the blocks an SM from which the plain kernel needs no split.
/// `plain_one_wave`: the plain kernel with more loads in flight and the blocks an SM up to
/// which it replaces `plain`.
struct RecordsFamily {
    slices: usize,
    plain: &'static str,
    plain_rpw: usize,
    splitk: &'static [RecordsSplitK],
    full_blocks_per_sm: usize,
    plain_one_wave: Option<(&'static str, usize)>,
}

const NVFP4R_FAMILY: RecordsFamily = RecordsFamily {
    slices: NVFP4R_WARPS,
    plain: "quant_matvec_nvfp4r_q8_2",
    plain_rpw: NVFP4R_ROWS_PER_WARP,
    splitk: &NVFP4R_SPLITK,
    full_blocks_per_sm: 8,
    plain_one_wave: None,
};

/// Two rows a half-warp (64 registers on sm_90): on an H100 the 27B's gate_up reads at
/// 2.02 TB/s against 1.85 with one row, and the plain kernel stays ahead of every split down to
/// 448 blocks (3.4 an SM: 1.66 against 1.54 TB/s for the 14336-row projection). Up to 4 blocks
/// an SM (one wave at 64 registers) the record loop unrolled twice: 2.08 against 1.72 TB/s for
/// the 16480-row projection, 1.85 against 1.64 for the 14336-row one, while the 1088 blocks of
/// gate_up read at 1.86 against 2.03 with it.
const IQ3SR_FAMILY: RecordsFamily = RecordsFamily {
    slices: 16,
    plain: "quant_matvec_iq3sr_q8_2",
    plain_rpw: 2,
    splitk: &IQ3SR_SPLITK,
    full_blocks_per_sm: 3,
    plain_one_wave: Some(("quant_matvec_iq3sr_q8_2_unroll2", 4)),
};

/// The split-K records kernel of `family` for a `[rows, cols]` matrix, or `None` where the
/// plain one already gives every SM a full load (`full_blocks_per_sm`). The first variant (in
/// order of preference) that reaches a full load with at least 2 records a slice; failing that,
/// the one with the most blocks.
fn records_splitk_plan(
    family: &RecordsFamily,
    rows: usize,
    cols: usize,
    multiprocessors: usize,
) -> Option<RecordsSplitK> {
    let full = family.full_blocks_per_sm * multiprocessors.max(1);
    let blocks = |rpw: usize, ks: usize| ceil_div(rows, rpw * (family.slices / ks));
    let plain = blocks(family.plain_rpw, 1);
    if plain >= full {
        return None;
    }
    let records = cols / 1024;
    let fits: Vec<RecordsSplitK> = family
        .splitk
        .iter()
        .copied()
        .filter(|k| records >= 2 * k.ks)
        .collect();
    fits.iter()
        .copied()
        .find(|k| blocks(k.rpw, k.ks) >= full)
        .or_else(|| {
            fits.iter()
                .copied()
                .max_by_key(|k| (blocks(k.rpw, k.ks), std::cmp::Reverse(k.ks)))
        })
        .filter(|k| blocks(k.rpw, k.ks) > plain)
}

/// The NVFP4 records plan (`records_splitk_plan`; the plain kernel takes
/// `NVFP4R_ROWS_PER_WARP` rows a warp).
pub fn nvfp4r_splitk_plan(
    rows: usize,
    cols: usize,
    multiprocessors: usize,
) -> Option<RecordsSplitK> {
    records_splitk_plan(&NVFP4R_FAMILY, rows, cols, multiprocessors)
}

/// The IQ3_S records plan (`records_splitk_plan`; the plain kernel takes two rows a half-warp).
pub fn iq3sr_splitk_plan(
    rows: usize,
    cols: usize,
    multiprocessors: usize,
) -> Option<RecordsSplitK> {
    records_splitk_plan(&IQ3SR_FAMILY, rows, cols, multiprocessors)
}

/// The kernel of `family` a one-row product over a `[rows, cols]` matrix launches, and its
/// blocks (256 threads each), given the backend's `RecordsKernel` setting (a forced variant of
/// the other format plans as `Auto`).
fn records_launch(
    family: &RecordsFamily,
    rows: usize,
    cols: usize,
    multiprocessors: usize,
    forced: RecordsKernel,
) -> (&'static str, usize) {
    let sms = multiprocessors.max(1);
    let plan = || records_splitk_plan(family, rows, cols, sms);
    let splitk = match forced {
        RecordsKernel::Auto => plan(),
        RecordsKernel::Plain => None,
        RecordsKernel::SplitK(k) if family.splitk.contains(&k) => Some(k),
        RecordsKernel::SplitK(_) => plan(),
    };
    match splitk {
        Some(k) => (k.name, ceil_div(rows, k.rpw * (family.slices / k.ks))),
        None => {
            let blocks = ceil_div(rows, family.plain_rpw * family.slices);
            match family.plain_one_wave {
                Some((name, per_sm)) if blocks <= per_sm * sms => (name, blocks),
                _ => (family.plain, blocks),
            }
        }
    }
}

/// An IQ3_S records matvec launch as the backend makes it: kernel and blocks of 256 threads
/// (the CPU emulator's tests launch the kernels this way).
pub fn iq3sr_launch_plan(
    rows: usize,
    cols: usize,
    multiprocessors: usize,
    forced: RecordsKernel,
) -> (&'static str, usize) {
    records_launch(&IQ3SR_FAMILY, rows, cols, multiprocessors, forced)
}

/// Which records matvec one-row products take (NVFP4 and IQ3_S alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordsKernel {
    /// Split-K where the format's plan says so (the default).
    Auto,
    /// The plain kernel for every shape.
    Plain,
    /// This split-K variant (of `NVFP4R_SPLITK` or `IQ3SR_SPLITK`) for every shape of its
    /// format; the other format plans as in `Auto` (tests).
    SplitK(RecordsSplitK),
}

/// Every split-K variant, as `records_kernel_code` numbers them.
fn all_splitk() -> impl Iterator<Item = &'static RecordsSplitK> {
    NVFP4R_SPLITK.iter().chain(IQ3SR_SPLITK.iter())
}

fn records_kernel_code(k: RecordsKernel) -> u64 {
    match k {
        RecordsKernel::Auto => 0,
        RecordsKernel::Plain => 1,
        RecordsKernel::SplitK(v) => {
            2 + all_splitk()
                .position(|x| *x == v)
                .expect("a variant of NVFP4R_SPLITK or IQ3SR_SPLITK") as u64
        }
    }
}

fn records_kernel_of(code: u64) -> RecordsKernel {
    match code {
        0 => RecordsKernel::Auto,
        1 => RecordsKernel::Plain,
        v => RecordsKernel::SplitK(
            *all_splitk()
                .nth(v as usize - 2)
                .expect("a records_kernel_code"),
        ),
    }
}

/// `CAPY_PDL=0` launches every kernel after its predecessor has finished (for comparisons).
/// `CAPY_NORM_SPLIT=0` norms every decode row with one block (`add_rms_norm`) instead of
/// `add_rms_norm_split` (for same-run comparisons).
/// A setting that is on unless the environment sets it to `0` (for same-run comparisons).
fn enabled_unless_zero(var: &str) -> bool {
    std::env::var(var).map_or(true, |v| v != "0")
}

fn norm_split_enabled_by_env() -> bool {
    enabled_unless_zero("CAPY_NORM_SPLIT")
}

fn pdl_enabled() -> bool {
    enabled_unless_zero("CAPY_PDL")
}

/// `CAPY_NVFP4R_SPLITK=0` keeps the plain records kernels (NVFP4 and IQ3_S) for every shape
/// (for comparisons).
fn nvfp4r_splitk_enabled() -> bool {
    std::env::var("CAPY_NVFP4R_SPLITK").map_or(true, |v| v != "0")
}
/// Query rows from which attention uses cuBLAS (scores as a matrix product) instead of the
/// split-KV kernel.
const ATTENTION_GEMM_MIN_ROWS: usize = 16;
/// How prefill attention through cuBLAS is cut up (`CudaBackend::attention_gemm_with`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionGemmPlan {
    /// Query heads of one key/value head per batched GEMM.
    pub heads_per_call: usize,
    /// Floats of scores per block of query rows (workspace memory).
    pub scratch_elems: usize,
}

impl AttentionGemmPlan {
    /// Batch the heads of a group only while all `n` query rows still fit one block: a smaller
    /// block makes the GEMMs skinny and rereads K and V, which costs more than the launches
    /// saved (measured on the H200: batching all six heads at 28K keys halved the speed).
    pub fn choose(n: usize, total: usize, s: AttentionShape) -> Self {
        let group = (s.num_heads / s.num_kv_heads).max(1);
        let fit = ATTENTION_SCRATCH_ELEMS / (total * n).max(1);
        AttentionGemmPlan {
            heads_per_call: fit.clamp(1, group),
            scratch_elems: ATTENTION_SCRATCH_ELEMS,
        }
    }
}

/// f32 attention scores per block of query rows (256 MiB; the fast path adds half that for
/// BF16 probabilities). At 28K keys a 1424-token chunk then runs in one block of rows: 10.8 ms
/// a layer instead of 17.8 ms with 64 MiB (H200, TF32).
const ATTENTION_SCRATCH_ELEMS: usize = 64 << 20;
/// Elements of the f32 scratch that the exact GEMM path widens weights into (bounds workspace
/// memory: 64 MiB).
const SCRATCH_ELEMS: usize = 16 << 20;
/// Weight elements a quantized prefill GEMM dequantizes at a time (BF16: 128 MiB of scratch).
const QUANT_SCRATCH_ELEMS: usize = 64 << 20;
/// Bytes of workspace the chunked delta rule may use at once (it runs long prompts in segments).
const GDR_WORKSPACE_BYTES: usize = 128 << 20;
/// Kernels that take more than the default 48 KiB of dynamic shared memory.
/// How the chunked gated delta rule (kernels/delta_rule.cu `gdr_chunk_prep`, `gdr_chunk_scan`)
/// is launched for `n` tokens: the workspace per (head, chunk), the segments that bound it to
/// [`GDR_WORKSPACE_BYTES`], and each kernel's dynamic shared memory. Public so the CPU
/// emulation test (tests/cuda_emulated.rs) launches the kernels exactly as the backend does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkedDeltaRulePlan {
    /// Floats of workspace per (value head, chunk): U, W, Qe, Kd, P and the chunk's decay,
    /// padded to a multiple of 4 so every part starts 16-byte aligned (float4 loads).
    pub per_chunk_floats: usize,
    pub chunks: usize,
    /// Chunks per pair of launches.
    pub seg_chunks: usize,
    /// Blocks along y of the scan: value columns in tiles of [`Self::TILE`].
    pub scan_tiles: usize,
    pub prep_smem: usize,
    pub scan_smem: usize,
}

impl ChunkedDeltaRulePlan {
    /// Tokens per chunk (`GDR_CHUNK`).
    pub const CHUNK: usize = 64;
    /// Value columns per scan block (`GDR_TILE`).
    pub const TILE: usize = 32;

    pub fn new(n: usize, s: DeltaRuleShape) -> ChunkedDeltaRulePlan {
        Self::with_workspace(n, s, GDR_WORKSPACE_BYTES)
    }

    /// The plan with the workspace bounded to `workspace_bytes` (tests force several segments).
    pub fn with_workspace(
        n: usize,
        s: DeltaRuleShape,
        workspace_bytes: usize,
    ) -> ChunkedDeltaRulePlan {
        let (c, t) = (Self::CHUNK, Self::TILE);
        let (dk, dv, nv) = (s.k_head_dim, s.v_head_dim, s.num_v_heads);
        let per_chunk_floats = c * (dv + 3 * dk) + c * c + 4;
        let chunks = ceil_div(n, c);
        ChunkedDeltaRulePlan {
            per_chunk_floats,
            chunks,
            seg_chunks: (workspace_bytes / (per_chunk_floats * nv * 4)).clamp(1, chunks.max(1)),
            scan_tiles: ceil_div(dv, t),
            // Ks, Qs [64][dk+1]; A [64][68]; the cumulative decay and β.
            prep_smem: (2 * c * (dk + 1) + c * (c + 4) + 2 * c) * 4,
            // S [dk][32]; one staging buffer [64][dk+4]; V' [64][32]; P [64][65].
            scan_smem: (dk * t + c * (dk + 4) + c * t + c * (c + 1)) * 4,
        }
    }
}

const LARGE_SMEM_KERNELS: [&str; 5] = [
    "gdr_chunk_prep",
    "gdr_chunk_scan",
    "quant_matvec_iq3s_q8",
    "moe_prefill_gate_up",
    "moe_prefill_down",
];
/// What a GPU test does where the backend cannot start: prints why and skips (machines
/// without a GPU, such as CI), unless `CAPY_REQUIRE_GPU=1` (the GPU box's scripts set it), where
/// a backend that fails to start is a failure, not a skip.
pub fn no_device_for_test(why: &dyn std::fmt::Display) {
    if std::env::var("CAPY_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("CAPY_REQUIRE_GPU=1 but the CUDA backend did not start: {why}");
    }
    println!("skipping: no usable CUDA device: {why}");
}

/// The oldest driver API version accepted: CUDA 13.0 (driver R580).
pub const MIN_DRIVER: i32 = 13000;

/// How many bytes are where; the ledger refuses any allocation past the budget.
#[derive(Debug, Default)]
pub struct Ledger {
    budget: Option<u64>,
    used: AtomicU64,
    peak: AtomicU64,
    weights: AtomicU64,
}

/// A snapshot of the ledger.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct LedgerReport {
    pub budget: Option<u64>,
    /// Bytes allocated now (weights included).
    pub used: u64,
    /// The most ever allocated at once.
    pub peak: u64,
    /// Bytes held by weights (matrices and vectors).
    pub weights: u64,
}

impl CudaBackend {
    /// Bytes of freed activation buffers kept for reuse (device memory held beyond `used`).
    pub fn pooled_bytes(&self) -> u64 {
        self.inner.pooled.load(Ordering::Relaxed)
    }
}

impl Ledger {
    fn reserve(&self, bytes: u64, what: &str) -> Result<()> {
        let before = self.used.fetch_add(bytes, Ordering::Relaxed);
        let after = before + bytes;
        if let Some(budget) = self.budget {
            if after > budget {
                self.used.fetch_sub(bytes, Ordering::Relaxed);
                bail!(
                    "VRAM budget exceeded: {what} needs {bytes} bytes with {before} bytes already allocated \
                     ({} of them weights); the budget is {budget} bytes (--vram-budget). Use a shorter context, \
                     a smaller model or quantization, or a larger budget",
                    self.weights.load(Ordering::Relaxed)
                );
            }
        }
        self.peak.fetch_max(after, Ordering::Relaxed);
        Ok(())
    }
    fn release(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::Relaxed);
    }
    pub fn report(&self) -> LedgerReport {
        LedgerReport {
            budget: self.budget,
            used: self.used.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            weights: self.weights.load(Ordering::Relaxed),
        }
    }
}

/// Facts about the device, found at start.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: i32,
    /// Shared memory an SM holds, in bytes (228 KiB on sm_90, 100 KiB on sm_86/89/120).
    pub smem_per_multiprocessor: usize,
    pub total_memory: u64,
    pub driver_version: (i32, i32),
    pub nvrtc_version: (i32, i32),
}

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Mutex<BlasHandle>,
    functions: HashMap<String, Function>,
    ledger: Ledger,
    exact: bool,
    info: DeviceInfo,
    /// Device copy of the last RoPE frequency table, reused while it is unchanged.
    inv_freq: Mutex<Option<(Vec<f32>, DevBuf)>>,
    /// Device copy of the last RoPE positions: every rope call of a step (q and k of each
    /// attention layer) rotates the same rows, so one upload per step serves them all.
    positions: Mutex<Option<(Vec<i32>, DevBuf)>>,
    /// Freed activation buffers by exact size, reused before asking the driver: a decode step
    /// allocates the same shapes every time, and a driver call per op would cost more than
    /// most of the kernels. Reuse is safe because all work is on one stream.
    pool: Mutex<HashMap<usize, Vec<drv_sys::CUdeviceptr>>>,
    /// Bytes held in `pool` (device memory we own but no tensor uses).
    pooled: AtomicU64,
    /// Work items queued on the stream (kernels, copies, memsets, GEMMs): launch overhead is
    /// per item, so benchmarks report it per token.
    launches: AtomicU64,
    /// Elements of every matrix uploaded (FLOP counts for benchmarks).
    matrix_elems: AtomicU64,
    /// Benchmarks only: replace uploaded projection matrices by random blocks of this format.
    synthetic_quant: Mutex<Option<RowFormat>>,
    /// NVFP4 matrices uploaded from now on are repacked into records (nvfp4_records.rs).
    nvfp4_records: std::sync::atomic::AtomicBool,
    /// IQ3_S matrices uploaded from now on are repacked into records on the fast path
    /// (iq3s_records.rs).
    iq3s_records: std::sync::atomic::AtomicBool,
    /// Some matrix was repacked into NVFP4 or IQ3_S records: one-row producers write int8
    /// copies.
    records_loaded: std::sync::atomic::AtomicBool,
    /// Set once cuBLAS has refused a grouped GEMM (warned once, then per-problem GEMMs).
    grouped_gemm_warned: std::sync::atomic::AtomicBool,
    /// Which records matvec a one-row product takes (`RecordsKernel`, as `records_kernel_code`).
    records_kernel: AtomicU64,
    /// Kernels are launched with programmatic dependent launch (kernels/common.cuh): sm_90 and
    /// later, unless `CAPY_PDL=0`.
    pdl: bool,
    /// One-row norms of wide rows run as `add_rms_norm_split` (unless `CAPY_NORM_SPLIT=0`).
    norm_split: std::sync::atomic::AtomicBool,
    /// `add_rms_norm_split`'s meeting point, allocated with the backend and zeroed: its
    /// partial sums, then its two counters, which every call leaves at zero.
    norm_barrier: NormBarrier,
    /// A decode row's attention inputs in one launch (`attention_inputs_row`), unless
    /// `CAPY_ATTENTION_INPUTS_FUSED=0`.
    attention_inputs_fused: bool,
    /// A decode row's GDN output norm inside the delta rule's launch
    /// (`Backend::gated_delta_rule_normed`), unless `CAPY_GDN_NORM_FUSED=0`.
    gdn_norm_fused: std::sync::atomic::AtomicBool,
    /// The decode attention's output gate applied where `attn_combine` writes
    /// (`Backend::attention_gated`), unless `CAPY_ATTENTION_GATE_FUSED=0`.
    attention_gate_fused: std::sync::atomic::AtomicBool,
    /// Greedy picks made on the device (`Backend::argmax_rows`), unless `CAPY_DEVICE_ARGMAX=0`.
    device_argmax: std::sync::atomic::AtomicBool,
    /// A decode row's MoE routing kept on the device (`Backend::moe_routed_on_device`), unless
    /// `CAPY_MOE_DEVICE_ROUTING=0`.
    moe_device_routing: std::sync::atomic::AtomicBool,
    /// The device-routed MoE adds the gated shared expert in its combine, unless
    /// `CAPY_MOE_SHARED_FUSED=0`.
    moe_shared_fused: bool,
    /// Decode steps' grouped IQ3_S gate/up experts on kernels/moe_quant_decode.cu, unless
    /// `CAPY_MOE_DECODE_KERNELS=0` (then moe_quant.cu's one-row kernel).
    moe_decode_kernels: bool,
    /// On the fast path, those kernels with int8 activations (`moe_dec_*_q8`), unless
    /// `CAPY_MOE_DECODE_Q8=0` (then the f32 ones).
    moe_decode_q8: bool,
    /// On the fast path, prefill rows' quantized routed experts routed, sorted and computed on
    /// the device (kernels/moe_prefill.cu), unless `CAPY_MOE_PREFILL_DEVICE=0` (then the host
    /// groups the routing for grouped cuBLAS GEMMs over dequantized copies).
    moe_prefill_device: bool,
    /// `CAPY_MOE_PREFILL_ONE_BUFFER=1`: those kernels planned as for a 100 KiB SM (sm_120,
    /// one input buffer) whatever the card, to run and time that form on an sm_90 one.
    moe_prefill_one_buffer: bool,
    /// Each MoE layer's expert table for the device routing, by its first expert's pointer:
    /// the host copy (checked at every use) and the device one.
    expert_tables: Mutex<HashMap<u64, (Vec<u64>, DevBuf)>>,
    /// `CudaBackend::attention_slots`, computed at the first decode attention.
    attention_slots: std::sync::OnceLock<usize>,
    /// Decode steps recorded as CUDA graphs (`graph.rs`).
    graphs: graph::GraphRecorder,
    /// Buffers allocated while recording a graph (the synchronous allocator: a stream-ordered
    /// allocation would belong to the graph); freed with `cuMemFree`, never `cuMemFreeAsync`.
    sync_allocated: Mutex<HashSet<drv_sys::CUdeviceptr>>,
    /// Page-locked buffers for large copies (`staging.rs`); dropped after the stream is
    /// synchronised in `Drop for Inner`.
    staging: Mutex<staging::TransferStaging>,
    /// Host ranges registered as page-locked (`host_pin.rs`): copies from them are queued as
    /// DMA directly.
    pinned: Arc<host_pin::PinnedRanges>,
}

/// cuBLAS's name for "transpose this operand" or not.
fn blas_op(transpose: bool) -> blas_sys::cublasOperation_t {
    if transpose {
        blas_sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        blas_sys::cublasOperation_t::CUBLAS_OP_N
    }
}

struct BlasHandle(blas_sys::cublasHandle_t);
// SAFETY: the handle is only used under its mutex, on the backend's one stream.
unsafe impl Send for BlasHandle {}

#[derive(Clone, Copy)]
struct Function(drv_sys::CUfunction);
// SAFETY: CUDA functions are immutable handles, usable from any thread of the context.
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

impl Inner {
    /// Returns every pooled buffer to the driver.
    fn trim_pool(&self) {
        if self.graphs.capturing() {
            // A free cannot be recorded; the pool is trimmed at the next chance.
            return;
        }
        let mut pool = self.pool.lock().expect("buffer pool poisoned");
        for (bytes, ptrs) in pool.drain() {
            for ptr in ptrs {
                self.free_device(ptr);
                self.pooled.fetch_sub(bytes as u64, Ordering::Relaxed);
            }
        }
    }

    /// Frees a buffer this backend allocated (not while recording a graph).
    fn free_device(&self, ptr: drv_sys::CUdeviceptr) {
        let sync = self
            .sync_allocated
            .lock()
            .expect("allocation set poisoned")
            .remove(&ptr);
        if sync {
            // SAFETY: allocated by cuMemAlloc while recording; cuMemFree waits for the device.
            let _ = unsafe { drv_sys::cuMemFree_v2(ptr) };
        } else {
            // SAFETY: owned by no tensor; freed once, in stream order.
            let _ = unsafe { drv::free_async(ptr, self.stream.cu_stream()) };
        }
    }
}

/// `add_rms_norm_split`'s partial sums (`NORM_SPLIT_MAX_BLOCKS` floats) then its two u32
/// counters, in one small allocation outside the buffer pool (it lives as long as the backend).
struct NormBarrier(drv_sys::CUdeviceptr);

impl NormBarrier {
    const BYTES: usize = NORM_SPLIT_MAX_BLOCKS * 4 + 8;

    /// Allocates and zeroes it (the context is current).
    fn new() -> Result<NormBarrier> {
        let mut ptr = 0;
        // SAFETY: plain synchronous allocation and memset of our own buffer.
        unsafe {
            drv_sys::cuMemAlloc_v2(&mut ptr, Self::BYTES)
                .result()
                .map_err(|e| anyhow::anyhow!("cuMemAlloc of the norm barrier: {e}"))?;
            drv_sys::cuMemsetD8_v2(ptr, 0, Self::BYTES)
                .result()
                .map_err(|e| anyhow::anyhow!("cuMemset of the norm barrier: {e}"))?;
        }
        Ok(NormBarrier(ptr))
    }

    fn partials(&self) -> u64 {
        self.0
    }

    fn counters(&self) -> u64 {
        self.0 + (NORM_SPLIT_MAX_BLOCKS * 4) as u64
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        if let Ok(frees) = self.graphs.flush(self.stream.cu_stream()) {
            for ptr in frees {
                self.free_device(ptr);
            }
        }
        self.trim_pool();
        let _ = self.stream.synchronize();
        if let Ok(h) = self.blas.lock() {
            // SAFETY: the handle was created by us and is destroyed once.
            let _ = unsafe { blas::destroy_handle(h.0) };
        }
        // SAFETY: allocated by NormBarrier::new; the stream is idle.
        let _ = unsafe { drv_sys::cuMemFree_v2(self.norm_barrier.0) };
    }
}

/// A device allocation, returned to the pool (and the ledger) when dropped.
struct DevBuf {
    ptr: drv_sys::CUdeviceptr,
    bytes: usize,
    weight: bool,
    dev: Arc<Inner>,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let _ = self.dev.ctx.bind_to_thread();
            if self.weight && self.dev.graphs.capturing() {
                self.dev.graphs.defer_free(self.ptr);
            } else if self.weight {
                // Freed once; later work on the stream is ordered after.
                self.dev.free_device(self.ptr);
            } else if let Ok(mut pool) = self.dev.pool.lock() {
                pool.entry(self.bytes).or_default().push(self.ptr);
                self.dev
                    .pooled
                    .fetch_add(self.bytes as u64, Ordering::Relaxed);
            }
            self.dev.ledger.release(self.bytes as u64);
            if self.weight {
                self.dev
                    .ledger
                    .weights
                    .fetch_sub(self.bytes as u64, Ordering::Relaxed);
            }
        }
    }
}

/// A `[rows, cols]` f32 activation on the device, with room for `capacity` rows.
pub struct CudaTensor {
    rows: usize,
    cols: usize,
    capacity: usize,
    buf: DevBuf,
    /// The int8 copy of a one-row tensor for the records matvecs (`quantize_x_q8r`'s
    /// layout), written by the kernel that produced the tensor on the fast path so that the
    /// matvecs reading it skip their quantize launch. Dropped by every in-place write.
    q8: Option<DevBuf>,
}

impl CudaTensor {
    /// Rows the buffer holds before an append has to move it.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Whether the producing kernel left an int8 copy for the records matvec (tests check
    /// that the fused path is the one taken).
    pub fn has_int8_copy(&self) -> bool {
        self.q8.is_some()
    }
    fn ptr(&self) -> u64 {
        self.buf.ptr
    }
    fn row_ptr(&self, r: usize) -> u64 {
        self.buf.ptr + (r * self.cols * 4) as u64
    }
    fn len(&self) -> usize {
        self.rows * self.cols
    }
    /// The values are about to change in place: an int8 copy would be stale.
    fn written(&mut self) {
        self.q8 = None;
    }
    /// (plane pointer, scales pointer) of the int8 copy, or (0, 0) for none: the arguments
    /// of the kernels that fill it.
    fn q8_args(&self) -> (u64, u64) {
        match &self.q8 {
            Some(b) => (b.ptr, b.ptr + self.cols as u64),
            None => (0, 0),
        }
    }
}

impl Clone for CudaTensor {
    fn clone(&self) -> Self {
        let dev = CudaBackend {
            inner: self.buf.dev.clone(),
        };
        let out = dev.alloc_act(self.rows, self.cols, self.rows);
        dev.copy_dtod(out.ptr(), self.ptr(), self.len() * 4);
        out
    }
}

/// Stored type of a weight matrix (the code the kernels take).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WeightType {
    F32 = 0,
    BF16 = 1,
    F16 = 2,
}

impl WeightType {
    fn name(self) -> &'static str {
        match self {
            WeightType::F32 => "f32",
            WeightType::BF16 => "bf16",
            WeightType::F16 => "f16",
        }
    }
}

/// A `[rows, cols]` weight matrix in its stored dtype, or quantized (`quant`).
pub struct CudaMatrix {
    pub rows: usize,
    pub cols: usize,
    dtype: WeightType,
    quant: Option<QuantLayout>,
    buf: DevBuf,
}

/// How a quantized matrix is stored: rows of `format` blocks, every weight times `multiplier`.
#[derive(Debug, Clone, Copy)]
struct QuantLayout {
    format: RowFormat,
    /// The kernels' format code (kernels/quant_matvec.cu `QF_*`).
    code: i32,
    row_bytes: usize,
    multiplier: f32,
}

/// The kernels' block-format codes (`QF_*`), defined for them by the generated prelude
/// (kernels.rs `quant_tables`): the one place both sides take them from.
const QF_Q8_0: i32 = 1;
/// NVFP4 in the checkpoint's 36-byte blocks.
const QF_NVFP4: i32 = 2;
/// IQ3_S in GGUF's 110-byte blocks.
const QF_IQ3_S: i32 = 3;
const QF_IQ3_XXS: i32 = 4;
const QF_IQ2_XS: i32 = 5;
const QF_Q2_0: i32 = 6;
const QF_FP8: i32 = 7;
/// NVFP4 repacked into records at upload (backend/cuda/nvfp4_records.rs).
const QF_NVFP4R: i32 = 8;
/// IQ3_S repacked into records at upload (backend/cuda/iq3s_records.rs).
const QF_IQ3SR: i32 = 9;
/// Every code by its kernel-side name.
pub(crate) const QUANT_FORMAT_CODES: [(&str, i32); 9] = [
    ("QF_Q8_0", QF_Q8_0),
    ("QF_NVFP4", QF_NVFP4),
    ("QF_IQ3_S", QF_IQ3_S),
    ("QF_IQ3_XXS", QF_IQ3_XXS),
    ("QF_IQ2_XS", QF_IQ2_XS),
    ("QF_Q2_0", QF_Q2_0),
    ("QF_FP8", QF_FP8),
    ("QF_NVFP4R", QF_NVFP4R),
    ("QF_IQ3SR", QF_IQ3SR),
];
// The producers' int8 copies (`wants_q8`) serve both records formats: one record width.
const _: () = assert!(nvfp4_records::RECORD_WEIGHTS == iq3s_records::RECORD_WEIGHTS);

/// The quant_matvec.cu code of a block format, if the kernels decode it.
fn quant_code(format: RowFormat) -> Option<i32> {
    use crate::quant::GgmlType as G;
    Some(match format {
        RowFormat::Ggml(G::Q8_0) => QF_Q8_0,
        RowFormat::Nvfp4 => QF_NVFP4,
        RowFormat::Ggml(G::Iq3S) => QF_IQ3_S,
        RowFormat::Ggml(G::Iq3Xxs) => QF_IQ3_XXS,
        RowFormat::Ggml(G::Iq2Xs) => QF_IQ2_XS,
        RowFormat::Ggml(G::Q2_0) => QF_Q2_0,
        RowFormat::Fp8B128 => QF_FP8,
        RowFormat::Ggml(_) => return None,
    })
}

impl CudaMatrix {
    /// Bytes the weights occupy on the device.
    pub fn bytes(&self) -> usize {
        self.buf.bytes
    }
    /// The block format of a quantized matrix (None for BF16/F16/F32).
    pub fn quant_format(&self) -> Option<RowFormat> {
        self.quant.map(|q| q.format)
    }
    fn dense_dtype(&self, op: &str) -> WeightType {
        if let Some(q) = self.quant {
            panic!(
                "{op}: a {} matrix [{}, {}] is quantized; this op takes BF16, F16 or F32 weights",
                q.format.name(),
                self.rows,
                self.cols
            );
        }
        self.dtype
    }
}

/// A parameter vector, f32 on the device.
pub struct CudaVector {
    len: usize,
    buf: DevBuf,
}

/// The CUDA backend on one device.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

/// Kernel arguments: each expression is evaluated into a temporary that lives until the end
/// of the one statement that launches, and passed by address (no heap allocation per launch).
macro_rules! launch {
    ($self:expr, $name:expr, $grid:expr, $block:expr, $smem:expr; $($arg:expr),* $(,)?) => {{
        $self.launch_raw($name, $grid, $block, $smem, &mut [$(&($arg) as *const _ as *mut c_void),*]);
    }};
}

/// The shapes [`Backend::attention`] takes: `q` `[n, heads·d]`, caches `[past + n, kv_heads·d]`,
/// heads of at most 256 (the kernels' limit).
fn check_attention_shapes(
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    past: usize,
    s: AttentionShape,
) {
    let n = q.rows;
    assert_eq!(q.cols, s.num_heads * s.head_dim);
    assert_eq!(k.cols, s.num_kv_heads * s.head_dim);
    assert_eq!(
        k.rows,
        past + n,
        "attention: cache has {} rows, expected {}",
        k.rows,
        past + n
    );
    assert_eq!(v.rows, k.rows);
    assert!(
        s.head_dim <= 256,
        "attention: head_dim {} is above the kernel's 256",
        s.head_dim
    );
}

fn ceil_div(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// Values one `argmax_partial` block scans (kernels/sampling.cu).
const ARGMAX_CHUNK: usize = 2048;

/// Whether one block holds a whole head of the normed delta rule (kernels/delta_rule.cu): a
/// warp per 32 key rows (at most 128) of each 32-column value tile, at most `GDR_MAX_TILES`
/// tiles and `GDR_MAX_THREADS` threads (the kernel's register bound): the 27B's 128x128 heads
/// are 16 warps.
fn normed_delta_rule_fits(s: DeltaRuleShape) -> bool {
    const GDR_MAX_TILES: usize = 8;
    const GDR_MAX_THREADS: usize = 512;
    let (warps, tiles) = (s.k_head_dim.div_ceil(32), s.v_head_dim.div_ceil(32));
    s.k_head_dim <= 128 && tiles <= GDR_MAX_TILES && 32 * warps * tiles <= GDR_MAX_THREADS
}

/// Values a norm thread holds in registers (kernels/norm.cu `NORM_VALS`).
const NORM_VALS: usize = 8;

/// Threads of a norm block over groups of `group` values: each thread keeps up to
/// `NORM_VALS` of them in registers, so a 5120-value decode row is one round of loads over
/// 640 threads instead of 20 dependent rounds over 256.
pub fn norm_threads(group: usize) -> usize {
    ceil_div(ceil_div(group, NORM_VALS), 32).clamp(1, 32) * 32
}

/// Groups an `rms_norm_warps` block takes, a warp each (kernels/norm.cu `NORM_WARPS`).
const NORM_WARPS: usize = 8;

/// Threads of an `add_rms_norm_split` block and the values each holds (kernels/norm.cu
/// `NORM_SPLIT_VALS`): 512 values a block, ten blocks for a 5120-value row.
const NORM_SPLIT_THREADS: usize = 128;
const NORM_SPLIT_VALS: usize = 4;
/// At most this many blocks meet at the split norm's barrier (and `NormBarrier` holds as many
/// partial sums): few enough to be resident at once on any GPU.
const NORM_SPLIT_MAX_BLOCKS: usize = 64;

/// How `add_rms_norm_split` cuts one row of `group` values: (blocks, threads a block), or None
/// where one block is the better launch (a row of at most 1024 values loads in one round on
/// one SM) or the row does not split into whole int8 groups.
pub fn norm_split_plan(group: usize) -> Option<(usize, usize)> {
    let per_block = NORM_SPLIT_THREADS * NORM_SPLIT_VALS;
    let blocks = ceil_div(group, per_block);
    (group > 1024 && group.is_multiple_of(32) && blocks <= NORM_SPLIT_MAX_BLOCKS)
        .then_some((blocks, NORM_SPLIT_THREADS))
}

/// Keys per split of the decode attention: enough splits to fill every block slot of the GPU
/// once (`resident_blocks`: the SMs times the blocks of `attn_split` an SM holds, which its
/// registers decide: 3 of 168-register blocks on sm_90) — a decode step has only KV heads ×
/// query rows blocks a split (4 for the 27B); with 128-key splits at 8K context the cache was
/// read by 2 blocks an SM at 1.2 TB/s, and with 4 blocks an SM sized for 4 slots a step ran
/// 1.3 waves, its last third of the blocks alone on the GPU. At least 64 keys a split (every
/// split costs the combine a partial row), and at most 1024 splits (attn_combine's limit).
/// `CAPY_ATTN_SLOTS_PER_SM=N` sizes the decode attention's splits for N blocks an SM instead
/// of the driver's occupancy (for same-run comparisons; 4 was the fixed assumption before).
fn attention_slots_override() -> Option<usize> {
    static SLOTS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *SLOTS.get_or_init(|| {
        std::env::var("CAPY_ATTN_SLOTS_PER_SM")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
    })
}

fn attention_split_len(total: usize, blocks_per_split: usize, resident_blocks: usize) -> usize {
    let want_splits = ceil_div(resident_blocks.max(1), blocks_per_split.max(1));
    ceil_div(total, want_splits)
        .max(64)
        .max(ceil_div(total, 1024))
}

/// Grid size for a grid-stride loop over `n` elements with 256-thread blocks.
fn grid_1d(n: usize) -> (u32, u32, u32) {
    (ceil_div(n, 256).clamp(1, 65535 * 4) as u32, 1, 1)
}

/// Tokens a `causal_conv1d_silu` thread takes in turn (kernels/elementwise.cu `CONV_RUN`).
const CONV_RUN: usize = 16;

/// The grid of an elementwise kernel over `n` values that moves four a thread where its rows'
/// `width` is a multiple of 4 and every pointer is 16-byte aligned (the kernels check the
/// same), else one.
fn grid_quads(n: usize, width: usize, ptrs: &[u64]) -> (u32, u32, u32) {
    let quads = width.is_multiple_of(4) && ptrs.iter().all(|p| p.is_multiple_of(16));
    grid_1d(if quads { n / 4 } else { n })
}

/// Random valid blocks of `format` for a `[rows, cols]` matrix (generated in parallel from
/// `seed`) and the multiplier that scales them to an RMS of 0.01, like the synthetic BF16
/// weights (measured on the first row): the weights of synthetic quantized benchmarks.
pub(crate) fn synthetic_quant_blocks(
    format: RowFormat,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<(Vec<u8>, f32)> {
    use rayon::prelude::*;
    let blocks_total = rows * cols / format.block_len();
    let parts = 64usize.min(blocks_total.max(1));
    let per = blocks_total.div_ceil(parts);
    let chunks: Vec<Vec<u8>> = (0..parts)
        .into_par_iter()
        .map(|p| {
            let n = per.min(blocks_total.saturating_sub(p * per));
            super::cpu::experts::random_blocks(format, n, seed ^ (p as u64 + 1))
        })
        .collect();
    let blocks = chunks.concat();
    let row_bytes = format.row_bytes(cols)?;
    let sample = super::dequantize_matrix(format, 1, cols, &blocks[..row_bytes], 1.0)?;
    let rms = (sample.iter().map(|v| v * v).sum::<f32>() / cols as f32).sqrt();
    let multiplier = if rms > 0.0 { 0.01 / rms } else { 1.0 };
    Ok((blocks, multiplier))
}

/// Whether `CAPY_EXACT_MATH=1` asks for exact (f32-activation) math.
pub fn exact_math_requested() -> bool {
    std::env::var("CAPY_EXACT_MATH").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// Checks that the CUDA driver can be used; returns its version as (major, minor).
pub fn driver_version() -> Result<(i32, i32)> {
    // SAFETY: probing for the library has no side effects beyond loading it.
    if !unsafe { drv_sys::is_culib_present() } {
        bail!(
            "no CUDA driver found (libcuda.so); the CUDA backend needs an NVIDIA GPU with driver R580 or newer \
             (CUDA {}.{}). Install the NVIDIA driver, or run on the CPU backend",
            MIN_DRIVER / 1000,
            (MIN_DRIVER % 1000) / 10
        );
    }
    drv::init()
        .map_err(|e| anyhow::anyhow!("cuInit failed: {e} (is a GPU visible to this process?)"))?;
    let mut v = 0;
    // SAFETY: out-parameter.
    unsafe { drv_sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(|e| anyhow::anyhow!("cuDriverGetVersion: {e}"))?;
    let found = (v / 1000, (v % 1000) / 10);
    if v < MIN_DRIVER {
        bail!(
            "the CUDA driver supports CUDA {}.{}; Capy Flash needs CUDA {}.{} (driver R580 or newer). Update the NVIDIA driver",
            found.0,
            found.1,
            MIN_DRIVER / 1000,
            (MIN_DRIVER % 1000) / 10
        );
    }
    Ok(found)
}

impl CudaBackend {
    /// Opens device `device_index`. `vram_budget` caps the bytes this backend allocates;
    /// exact math follows `CAPY_EXACT_MATH`.
    pub fn new(device_index: usize, vram_budget: Option<u64>) -> Result<Self> {
        Self::with_exact_math(device_index, vram_budget, exact_math_requested())
    }

    /// As [`CudaBackend::new`], choosing exact (f32-activation) math explicitly.
    pub fn with_exact_math(
        device_index: usize,
        vram_budget: Option<u64>,
        exact: bool,
    ) -> Result<Self> {
        let driver_version = driver_version()?;
        let count =
            CudaContext::device_count().map_err(|e| anyhow::anyhow!("cuDeviceGetCount: {e}"))?;
        if device_index >= count.max(0) as usize {
            bail!("CUDA device {device_index} does not exist; this machine has {count} CUDA device(s)");
        }
        let nvrtc_version = kernels::nvrtc_version()?;
        if !unsafe { blas_sys::is_culib_present() } {
            bail!("cuBLAS (libcublas.so) was not found; install the CUDA toolkit's cuBLAS or add its folder to LD_LIBRARY_PATH");
        }
        let ctx = CudaContext::new(device_index)
            .map_err(|e| anyhow::anyhow!("cannot open CUDA device {device_index}: {e}"))?;
        // One stream, so cudarc's cross-stream event tracking is not needed.
        // SAFETY: nothing of ours uses cudarc's tracked slices.
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx
            .compute_capability()
            .map_err(|e| anyhow::anyhow!("compute capability: {e}"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let total_memory =
            ctx.total_mem()
                .map_err(|e| anyhow::anyhow!("cuDeviceTotalMem: {e}"))? as u64;
        let multiprocessors = ctx
            .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| anyhow::anyhow!("device attribute: {e}"))?;
        let smem_per_multiprocessor = ctx
            .attribute(
                drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            )
            .map_err(|e| anyhow::anyhow!("device attribute: {e}"))? as usize;
        if let Some(b) = vram_budget {
            if b > total_memory {
                bail!("--vram-budget is {b} bytes but {name} has only {total_memory} bytes");
            }
        }
        let stream = ctx
            .new_stream()
            .map_err(|e| anyhow::anyhow!("cannot create a CUDA stream: {e}"))?;
        // Keep freed memory in the stream-ordered pool instead of returning it at every sync.
        // SAFETY: the default pool of this device; u64::MAX is a valid threshold.
        unsafe {
            let mut pool = std::ptr::null_mut();
            if drv_sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                == drv_sys::CUresult::CUDA_SUCCESS
            {
                let mut threshold = u64::MAX;
                let _ = drv_sys::cuMemPoolSetAttribute(
                    pool,
                    drv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut threshold as *mut u64 as *mut c_void,
                );
            }
        }
        let arch = cc.0 * 10 + cc.1;
        let mut functions = HashMap::new();
        for src in kernels::sources() {
            let cubin = kernels::cubin(&src, arch)?;
            // SAFETY: a CUBIN compiled for this device's architecture; kept loaded for the context's life.
            let module = unsafe { drv::module::load_data(cubin.as_ptr() as *const c_void) }
                .map_err(|e| {
                    anyhow::anyhow!(
                        "cannot load kernels/{}.cu compiled for sm_{arch}: {e}",
                        src.name
                    )
                })?;
            for f in &src.functions {
                // SAFETY: the module is loaded; the name is one of its entry points.
                let func = unsafe {
                    drv::module::get_function(module, CString::new(f.as_str()).expect("no NUL"))
                }
                .map_err(|e| {
                    anyhow::anyhow!("kernel {f} is missing from kernels/{}.cu: {e}", src.name)
                })?;
                functions.insert(f.clone(), Function(func));
            }
        }
        let smem_optin = ctx
            .attribute(
                drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| anyhow::anyhow!("device attribute: {e}"))?;
        for name in LARGE_SMEM_KERNELS {
            let f = functions[name];
            // SAFETY: a loaded function; the value is the device's own opt-in maximum.
            unsafe {
                drv_sys::cuFuncSetAttribute(
                    f.0,
                    drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem_optin,
                )
            }
            .result()
            .map_err(|e| anyhow::anyhow!("cuFuncSetAttribute({name}): {e}"))?;
        }
        let handle = blas::create_handle().map_err(|e| anyhow::anyhow!("cublasCreate: {e:?}"))?;
        // SAFETY: the handle and stream are live.
        unsafe { blas::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| anyhow::anyhow!("cublasSetStream: {e:?}"))?;
        let info = DeviceInfo {
            index: device_index,
            name,
            compute_capability: cc,
            multiprocessors,
            smem_per_multiprocessor,
            total_memory,
            driver_version,
            nvrtc_version,
        };
        ctx.bind_to_thread()
            .map_err(|e| anyhow::anyhow!("binding the CUDA context: {e}"))?;
        let norm_barrier = NormBarrier::new()?;
        Ok(CudaBackend {
            inner: Arc::new(Inner {
                staging: Mutex::new(staging::TransferStaging::new(ctx.clone())),
                pinned: Arc::default(),
                ctx,
                stream,
                blas: Mutex::new(BlasHandle(handle)),
                functions,
                ledger: Ledger {
                    budget: vram_budget,
                    ..Default::default()
                },
                exact,
                info,
                inv_freq: Mutex::new(None),
                positions: Mutex::new(None),
                pool: Mutex::new(HashMap::new()),
                pooled: AtomicU64::new(0),
                launches: AtomicU64::new(0),
                matrix_elems: AtomicU64::new(0),
                synthetic_quant: Mutex::new(None),
                nvfp4_records: std::sync::atomic::AtomicBool::new(nvfp4_records::enabled_by_env()),
                iq3s_records: std::sync::atomic::AtomicBool::new(iq3s_records::enabled_by_env()),
                records_loaded: std::sync::atomic::AtomicBool::new(false),
                grouped_gemm_warned: std::sync::atomic::AtomicBool::new(false),
                pdl: cc.0 >= 9 && pdl_enabled(),
                norm_split: std::sync::atomic::AtomicBool::new(norm_split_enabled_by_env()),
                norm_barrier,
                attention_slots: std::sync::OnceLock::new(),
                attention_inputs_fused: enabled_unless_zero("CAPY_ATTENTION_INPUTS_FUSED"),
                gdn_norm_fused: std::sync::atomic::AtomicBool::new(enabled_unless_zero(
                    "CAPY_GDN_NORM_FUSED",
                )),
                attention_gate_fused: std::sync::atomic::AtomicBool::new(enabled_unless_zero(
                    "CAPY_ATTENTION_GATE_FUSED",
                )),
                device_argmax: std::sync::atomic::AtomicBool::new(enabled_unless_zero(
                    "CAPY_DEVICE_ARGMAX",
                )),
                moe_device_routing: std::sync::atomic::AtomicBool::new(enabled_unless_zero(
                    "CAPY_MOE_DEVICE_ROUTING",
                )),
                moe_shared_fused: enabled_unless_zero("CAPY_MOE_SHARED_FUSED"),
                moe_decode_kernels: enabled_unless_zero("CAPY_MOE_DECODE_KERNELS"),
                moe_decode_q8: enabled_unless_zero("CAPY_MOE_DECODE_Q8"),
                moe_prefill_device: enabled_unless_zero("CAPY_MOE_PREFILL_DEVICE"),
                moe_prefill_one_buffer: std::env::var("CAPY_MOE_PREFILL_ONE_BUFFER")
                    .is_ok_and(|v| v == "1"),
                expert_tables: Mutex::new(HashMap::new()),
                records_kernel: AtomicU64::new(records_kernel_code(if nvfp4r_splitk_enabled() {
                    RecordsKernel::Auto
                } else {
                    RecordsKernel::Plain
                })),
                graphs: graph::GraphRecorder::new(graph::graphs_requested()),
                sync_allocated: Mutex::new(HashSet::new()),
            }),
        })
    }

    pub fn device_info(&self) -> &DeviceInfo {
        &self.inner.info
    }
    pub fn ledger(&self) -> LedgerReport {
        self.inner.ledger.report()
    }
    pub fn exact_math(&self) -> bool {
        self.inner.exact
    }
    /// Work items (kernels, copies, GEMMs) queued so far.
    pub fn launches(&self) -> u64 {
        self.inner.launches.load(Ordering::Relaxed)
    }
    /// Elements of all matrices uploaded so far.
    pub fn matrix_elems(&self) -> u64 {
        self.inner.matrix_elems.load(Ordering::Relaxed)
    }

    /// Which records matvec one-row products take from now on (default `Auto`;
    /// `CAPY_NVFP4R_SPLITK=0` starts at `Plain`).
    pub fn set_records_kernel(&self, k: RecordsKernel) {
        self.inner
            .records_kernel
            .store(records_kernel_code(k), Ordering::Relaxed);
    }

    /// Repack NVFP4 matrices uploaded from now on into records for the records matvec
    /// (default: on, `CAPY_NVFP4_RECORDS=0` turns it off); matrices already uploaded keep their
    /// layout.
    pub fn set_nvfp4_records(&self, on: bool) {
        self.inner.nvfp4_records.store(on, Ordering::Relaxed);
    }

    /// Repack IQ3_S matrices uploaded from now on into records for the IQ3_S records matvec
    /// (default: on, `CAPY_IQ3S_RECORDS=0` turns it off; exact math never repacks, as only the
    /// int8 matvec reads records); matrices already uploaded keep their layout.
    pub fn set_iq3s_records(&self, on: bool) {
        self.inner.iq3s_records.store(on, Ordering::Relaxed);
    }

    /// For synthetic benchmarks: from now on every uploaded projection matrix (2-D, not the
    /// embedding, the LM head or a conv filter, with whole blocks per row) is replaced by random
    /// valid blocks of `format`, scaled to an RMS of 0.01 like the synthetic BF16 weights, and
    /// kept quantized. `None` uploads weights as given.
    pub fn set_synthetic_quant(&self, format: Option<RowFormat>) {
        *self.inner.synthetic_quant.lock().expect("poisoned") = format;
    }

    /// Whether [`CudaBackend::set_synthetic_quant`] replaces a matrix of this name and shape.
    pub fn synthetic_quant_applies(format: RowFormat, name: &str, cols: usize) -> bool {
        !(name.contains("embed") || name.contains("lm_head") || name.contains("conv"))
            && cols.is_multiple_of(format.block_len())
    }

    fn synthetic_quant_matrix(&self, format: RowFormat, t: &HostTensor) -> Result<CudaMatrix> {
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let seed = t.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        let (blocks, multiplier) = synthetic_quant_blocks(format, rows, cols, seed)?;
        self.quant_matrix(format, rows, cols, &blocks, multiplier)
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.bind();
        self.submit_recorded()?;
        self.inner
            .stream
            .synchronize()
            .map_err(|e| anyhow::anyhow!("CUDA stream failed: {e}"))?;
        self.inner.graphs.after_sync();
        Ok(())
    }

    /// Launches the graph being recorded (if any), without waiting for it.
    fn submit_recorded(&self) -> Result<()> {
        for ptr in self.inner.graphs.flush(self.stream())? {
            self.inner.free_device(ptr);
        }
        Ok(())
    }

    /// Records decode steps as CUDA graphs (`CAPY_CUDA_GRAPHS=1` at start) or launches every
    /// op directly (the default).
    pub fn set_cuda_graphs(&self, on: bool) -> Result<()> {
        self.bind();
        self.submit_recorded()?;
        self.inner.graphs.set_enabled(on);
        Ok(())
    }

    pub fn cuda_graphs(&self) -> bool {
        self.inner.graphs.enabled()
    }

    /// Norms one wide decode row over several blocks (`add_rms_norm_split`, the default) or
    /// with one (`CAPY_NORM_SPLIT=0`); for tests and same-run comparisons.
    pub fn set_norm_split(&self, on: bool) {
        self.inner.norm_split.store(on, Ordering::Relaxed);
    }

    /// The decode tails fused into the kernels before them (the GDN output norm into the
    /// delta rule, the attention's output gate into its combine), or composed of the plain
    /// ops: tests run both.
    pub fn set_fused_tails(&self, on: bool) {
        self.inner.gdn_norm_fused.store(on, Ordering::Relaxed);
        self.inner.attention_gate_fused.store(on, Ordering::Relaxed);
    }

    /// Greedy picks on the device, or on the host from the downloaded rows (tests run both).
    pub fn set_device_argmax(&self, on: bool) {
        self.inner.device_argmax.store(on, Ordering::Relaxed);
    }

    /// MoE routing kept on the device (a decode row; prefill rows of quantized experts on the
    /// fast path), or read back to group the experts on the host (tests run both).
    pub fn set_moe_device_routing(&self, on: bool) {
        self.inner.moe_device_routing.store(on, Ordering::Relaxed);
    }

    pub fn graph_stats(&self) -> graph::GraphStats {
        self.inner.graphs.stats()
    }

    /// Counts a work item and starts a graph recording where one is due; called before every
    /// kernel, copy, memset and GEMM is queued.
    fn queue_work(&self) {
        self.inner.launches.fetch_add(1, Ordering::Relaxed);
        self.inner.graphs.before_work(self.stream());
    }

    /// Queues a copy of host data to the device. While a graph is being recorded the data is
    /// staged in page-locked memory first (a recorded copy reads its source when it runs).
    fn htod<T: Copy>(&self, dst: drv_sys::CUdeviceptr, data: &[T]) {
        if data.is_empty() {
            return;
        }
        self.queue_work();
        let bytes = std::mem::size_of_val(data);
        if self.inner.graphs.capturing() {
            // SAFETY: `data` is `bytes` bytes of plain values.
            let raw = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, bytes) };
            let staged = self.inner.graphs.stage(raw);
            // SAFETY: `dst` holds `bytes` bytes (callers allocate it); the staged copy stays
            // valid until the stream has been synchronised.
            let r = unsafe {
                drv_sys::cuMemcpyHtoDAsync_v2(dst, staged as *const c_void, bytes, self.stream())
            };
            assert!(
                r == drv_sys::CUresult::CUDA_SUCCESS,
                "host-to-device copy (recorded) failed: {r:?}"
            );
        } else {
            // SAFETY: `data` is `bytes` bytes of plain values.
            let raw = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, bytes) };
            // Only copies worth a DMA look the range up (an expert matrix, not a step's small
            // tables), so the per-step uploads take no lock.
            if bytes >= host_pin::DIRECT_DMA_MIN_BYTES && self.inner.pinned.contains(raw) {
                // Page-locked already (the host expert store): DMA from it, no staging. The
                // range stays registered, hence allocated, until its pin is dropped, and the
                // pin waits for the device before it unregisters.
                // SAFETY: `dst` holds `bytes` bytes (callers allocate it).
                let r = unsafe {
                    drv_sys::cuMemcpyHtoDAsync_v2(
                        dst,
                        raw.as_ptr() as *const c_void,
                        bytes,
                        self.stream(),
                    )
                };
                assert!(
                    r == drv_sys::CUresult::CUDA_SUCCESS,
                    "host-to-device copy from page-locked memory failed: {r:?}"
                );
                return;
            }
            if bytes >= staging::STAGED_MIN_BYTES {
                // SAFETY: `data` is `bytes` bytes of plain values; `dst` holds `bytes` bytes.
                let raw = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, bytes) };
                let mut st = self.inner.staging.lock().expect("copy staging poisoned");
                // SAFETY: as above; the stages are reused only after their copies passed.
                if unsafe { st.upload(dst, raw, self.stream()) }.unwrap_or_else(|e| panic!("{e:#}"))
                {
                    return;
                }
            }
            // SAFETY: as above; the copy from pageable memory is staged by the driver before
            // the call returns, so `data` may be dropped afterwards.
            unsafe { drv::memcpy_htod_async(dst, data, self.stream()) }
                .expect("host-to-device copy failed");
        }
    }

    /// Copies device memory into `out`, waiting for the stream (and launching what is recorded).
    fn dtoh<T: Copy>(&self, out: &mut [T], src: drv_sys::CUdeviceptr) {
        self.bind();
        self.submit_recorded().unwrap_or_else(|e| panic!("{e:#}"));
        let bytes = std::mem::size_of_val(out);
        let mut staged = false;
        if bytes >= staging::STAGED_MIN_BYTES {
            // SAFETY: `out` is `bytes` bytes of plain values, any bit pattern of which the
            // callers' types (f32, integers) accept.
            let raw = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, bytes) };
            let mut st = self.inner.staging.lock().expect("copy staging poisoned");
            // SAFETY: `src` holds `bytes` bytes (callers allocate it).
            staged =
                unsafe { st.download(raw, src, self.stream()) }.unwrap_or_else(|e| panic!("{e:#}"));
        }
        if !out.is_empty() && !staged {
            // SAFETY: `src` holds `out.len()` values of T (callers allocate it); the stream is
            // synchronised before `out` is read.
            unsafe { drv::memcpy_dtoh_async(out, src, self.stream()) }
                .expect("device-to-host copy failed");
        }
        self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
    }

    fn bind(&self) {
        self.inner
            .ctx
            .bind_to_thread()
            .expect("cannot make the CUDA context current on this thread");
    }
    fn stream(&self) -> drv_sys::CUstream {
        self.inner.stream.cu_stream()
    }

    fn try_alloc(&self, bytes: usize, what: &str, weight: bool) -> Result<DevBuf> {
        self.bind();
        if bytes == 0 {
            return Ok(DevBuf {
                ptr: 0,
                bytes: 0,
                weight,
                dev: self.inner.clone(),
            });
        }
        if !weight {
            let reused = self
                .inner
                .pool
                .lock()
                .expect("buffer pool poisoned")
                .get_mut(&bytes)
                .and_then(Vec::pop);
            if let Some(ptr) = reused {
                self.inner.pooled.fetch_sub(bytes as u64, Ordering::Relaxed);
                self.inner.ledger.reserve(bytes as u64, what)?;
                return Ok(DevBuf {
                    ptr,
                    bytes,
                    weight,
                    dev: self.inner.clone(),
                });
            }
        }
        if self.inner.graphs.capturing() {
            return self.alloc_while_recording(bytes, what, weight);
        }
        // Pooled memory counts against the budget too: give it back before exceeding it.
        let held = self.inner.ledger.used.load(Ordering::Relaxed)
            + self.inner.pooled.load(Ordering::Relaxed);
        if self
            .inner
            .ledger
            .budget
            .is_some_and(|b| held + bytes as u64 > b)
        {
            self.inner.trim_pool();
        }
        self.inner.ledger.reserve(bytes as u64, what)?;
        // SAFETY: stream-ordered allocation on our stream.
        let mut allocated = unsafe { drv::malloc_async(self.stream(), bytes) };
        if allocated.is_err() && self.inner.pooled.load(Ordering::Relaxed) > 0 {
            self.inner.trim_pool();
            let _ = self.inner.stream.synchronize();
            // SAFETY: as above.
            allocated = unsafe { drv::malloc_async(self.stream(), bytes) };
        }
        match allocated {
            Ok(ptr) => Ok(self.allocated(ptr, bytes, weight)),
            Err(e) => {
                self.inner.ledger.release(bytes as u64);
                let (free, total) = drv::mem_get_info().unwrap_or((0, 0));
                bail!(
                    "CUDA out of memory allocating {bytes} bytes for {what} ({e}); the device has {free} of {total} bytes free, \
                     this backend holds {} bytes",
                    self.inner.ledger.used.load(Ordering::Relaxed)
                )
            }
        }
    }

    /// A pool miss while a graph is recorded (a KV cache outgrowing its capacity): the
    /// synchronous allocator, since a stream-ordered allocation would belong to the graph.
    fn alloc_while_recording(&self, bytes: usize, what: &str, weight: bool) -> Result<DevBuf> {
        self.inner.ledger.reserve(bytes as u64, what)?;
        let mut ptr: drv_sys::CUdeviceptr = 0;
        // SAFETY: a plain device allocation (allowed in relaxed capture mode).
        let r = unsafe { drv_sys::cuMemAlloc_v2(&mut ptr, bytes) };
        if r != drv_sys::CUresult::CUDA_SUCCESS {
            self.inner.ledger.release(bytes as u64);
            bail!("CUDA out of memory allocating {bytes} bytes for {what} while recording a decode step ({r:?})");
        }
        self.inner
            .sync_allocated
            .lock()
            .expect("allocation set poisoned")
            .insert(ptr);
        Ok(self.allocated(ptr, bytes, weight))
    }

    /// A fresh allocation (already reserved in the ledger) as a buffer; weights are counted.
    fn allocated(&self, ptr: drv_sys::CUdeviceptr, bytes: usize, weight: bool) -> DevBuf {
        if weight {
            self.inner
                .ledger
                .weights
                .fetch_add(bytes as u64, Ordering::Relaxed);
        }
        DevBuf {
            ptr,
            bytes,
            weight,
            dev: self.inner.clone(),
        }
    }

    fn alloc(&self, bytes: usize, what: &str) -> DevBuf {
        self.try_alloc(bytes, what, false)
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    fn alloc_act(&self, rows: usize, cols: usize, capacity: usize) -> CudaTensor {
        let capacity = capacity.max(rows);
        CudaTensor {
            rows,
            cols,
            capacity,
            buf: self.alloc(capacity * cols * 4, "activations"),
            q8: None,
        }
    }

    /// `alloc_act(1, cols, 1)` with room for the int8 copy when a records matvec may read it
    /// (the fast path, NVFP4 or IQ3_S records loaded, a width the records kernels take);
    /// otherwise `alloc_act(rows, cols, rows)`.
    fn alloc_act_q8(&self, rows: usize, cols: usize) -> CudaTensor {
        let mut t = self.alloc_act(rows, cols, rows);
        if self.wants_q8(rows, cols) {
            t.q8 = Some(self.alloc(cols + cols / 32 * 4, "int8 activations"));
        }
        t
    }

    fn wants_q8(&self, rows: usize, cols: usize) -> bool {
        rows == 1
            && !self.inner.exact
            && self.inner.records_loaded.load(Ordering::Relaxed)
            && nvfp4_records::applies(cols)
            && cols <= QMV8_MAX_COLS
    }

    /// The output of a norm over groups of `group`: with an int8 copy where the kernel can
    /// write one (whole warps of a group in registers: kernels/norm.cu `rms_norm_group`).
    fn norm_out(&self, x: &CudaTensor, group: usize) -> CudaTensor {
        if group.is_multiple_of(32) && group <= norm_threads(group) * NORM_VALS {
            self.alloc_act_q8(x.rows, x.cols)
        } else {
            self.alloc_act(x.rows, x.cols, x.rows)
        }
    }

    fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) {
        if bytes > 0 {
            self.queue_work();
            // SAFETY: both ranges are inside live allocations (callers check shapes).
            unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream()) }
                .expect("device copy failed");
        }
    }

    /// Uploads `data` into a fresh buffer (small per-call tables: ids, positions).
    /// `rms_norm` of `groups` groups of x into out (gated by silu(gate) unless `gate` is 0):
    /// a warp a group where the groups are small and no int8 copy is wanted
    /// (`rms_norm_warps`), else a block a group.
    #[allow(clippy::too_many_arguments)]
    fn launch_rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaVector,
        gate: u64,
        out: &CudaTensor,
        group: usize,
        groups: usize,
        eps: f32,
        one_plus: i32,
    ) {
        let threads = norm_threads(group);
        let (xq, xs) = out.q8_args();
        if threads == 32 && xq == 0 && groups > 1 {
            launch!(self, "rms_norm_warps", (ceil_div(groups, NORM_WARPS) as u32, 1, 1), (32 * NORM_WARPS as u32, 1, 1), 0;
                x.ptr(), w.buf.ptr, gate, out.ptr(), group as i32, groups as u64, eps, one_plus);
        } else {
            launch!(self, "rms_norm", (groups as u32, 1, 1), (threads as u32, 1, 1), 0;
                x.ptr(), w.buf.ptr, gate, out.ptr(), group as i32, eps, one_plus, xq, xs);
        }
    }

    /// A forward pass of `tokens` rows starts: decode-sized steps are recorded as graphs.
    fn begin_forward(&self, tokens: usize) {
        self.bind();
        self.submit_recorded().unwrap_or_else(|e| panic!("{e:#}"));
        self.inner.graphs.begin_step(tokens, MATVEC_MAX_ROWS);
    }

    /// Rows of `table` selected by `ids`, as f32 activations.
    fn gather_rows(&self, table: &CudaMatrix, ids: &[u32]) -> CudaTensor {
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
            panic!(
                "embedding: id {bad} is outside the table's {} rows",
                table.rows
            );
        }
        let out = self.alloc_act(ids.len(), table.cols, ids.len());
        if ids.is_empty() {
            return out;
        }
        let dev_ids = self.upload(ids, "token ids");
        if let Some(q) = table.quant {
            self.dequant_rows(table, q, dev_ids.ptr, 0, ids.len(), out.ptr(), false);
        } else {
            launch!(self, "embedding", (ids.len() as u32, 1, 1), (256, 1, 1), 0;
                table.buf.ptr, table.dtype as i32, dev_ids.ptr, out.ptr(), table.cols as i32);
        }
        out
    }

    fn upload<T: Copy>(&self, data: &[T], what: &str) -> DevBuf {
        let buf = self.alloc(std::mem::size_of_val(data), what);
        self.htod(buf.ptr, data);
        buf
    }

    /// `elems` f32 values at `src` rounded into a new buffer of 16-bit `dtype` (BF16, or F16
    /// for F16 weights).
    fn to_16bit(&self, src: u64, elems: usize, dtype: WeightType, what: &str) -> DevBuf {
        let out = self.alloc(elems * 2, what);
        if dtype == WeightType::BF16 {
            // Four values a thread (kernels/elementwise.cu).
            launch!(self, "f32_to_bf16_kernel", grid_1d(elems.div_ceil(4)), (256, 1, 1), 0; src, out.ptr, elems as u64);
        } else {
            launch!(self, "f32_to_f16_kernel", grid_1d(elems), (256, 1, 1), 0; src, out.ptr, elems as u64);
        }
        out
    }

    /// Room for `extra` more rows in `dst` (a cache), whose contents are about to change.
    fn reserve_rows(&self, dst: &mut CudaTensor, extra: usize) {
        dst.written();
        let needed = dst.rows + extra;
        if needed > dst.capacity {
            // Grow by doubling so a cache filled token by token is copied O(log n) times.
            let capacity = needed.max(dst.capacity * 2).max(16);
            let grown = self.alloc_act(dst.rows, dst.cols, capacity);
            self.copy_dtod(grown.ptr(), dst.ptr(), dst.len() * 4);
            *dst = grown;
        }
    }

    fn norm_split(&self) -> bool {
        self.inner.norm_split.load(Ordering::Relaxed)
    }

    /// One row normed by `add_rms_norm_split` (x += y first where `y` is not null), with the
    /// int8 copy where `out` has room for one.
    #[allow(clippy::too_many_arguments)]
    fn launch_norm_split(
        &self,
        x: u64,
        y: u64,
        w: &CudaVector,
        out: &CudaTensor,
        group: usize,
        eps: f32,
        one_plus: i32,
        (blocks, threads): (usize, usize),
    ) {
        let (xq, xs) = out.q8_args();
        let barrier = &self.inner.norm_barrier;
        launch!(self, "add_rms_norm_split", (blocks as u32, 1, 1), (threads as u32, 1, 1), 32 * 4;
            x, y, w.buf.ptr, out.ptr(), group as i32, eps, one_plus, xq, xs,
            barrier.partials(), barrier.counters());
    }

    /// How many blocks of `threads` threads (and `smem` bytes of dynamic shared memory) of
    /// kernel `name` one SM holds at once, as the driver computes it from the compiled
    /// kernel's registers and shared memory; None if the driver does not say.
    fn resident_blocks_per_sm(&self, name: &str, threads: u32, smem: usize) -> Option<usize> {
        let f = self.inner.functions.get(name)?;
        let mut blocks: std::ffi::c_int = 0;
        // SAFETY: `f.0` is a loaded function of this context; the driver writes one int.
        unsafe {
            drv_sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut blocks,
                f.0,
                threads as std::ffi::c_int,
                smem,
            )
        }
        .result()
        .ok()?;
        (blocks > 0).then_some(blocks as usize)
    }

    fn launch_raw(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        params: &mut [*mut c_void],
    ) {
        let f = self
            .inner
            .functions
            .get(name)
            .unwrap_or_else(|| panic!("kernel {name} is not loaded"));
        self.queue_work();
        let launched = if self.inner.pdl {
            // Every kernel waits for its predecessor before touching memory (KERNEL_START in
            // kernels/common.cuh), so it may be scheduled while that one finishes.
            let mut attr = drv_sys::CUlaunchAttribute {
                id: drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: drv_sys::CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: 1,
                },
            };
            let config = drv_sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: smem,
                hStream: self.stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as below; the config and its attribute outlive the call.
            unsafe {
                drv_sys::cuLaunchKernelEx(&config, f.0, params.as_mut_ptr(), std::ptr::null_mut())
            }
            .result()
        } else {
            // SAFETY: the parameters match the kernel's signature (each call site mirrors the
            // .cu file).
            unsafe { drv::launch_kernel(f.0, grid, block, smem, self.stream(), params) }
        };
        launched.unwrap_or_else(|e| {
            panic!("launching kernel {name} (grid {grid:?}, block {block:?}) failed: {e}")
        });
    }

    /// `C = op(A)·op(B)` in f32 through cuBLAS (column-major, as cuBLAS sees it).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        trans_a: bool,
        trans_b: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: (u64, blas_sys::cudaDataType, usize),
        b: (u64, blas_sys::cudaDataType, usize),
        c: (u64, usize),
        compute: blas_sys::cublasComputeType_t,
    ) {
        let op = blas_op;
        let beta = 0f32;
        self.queue_work();
        let h = self.inner.blas.lock().expect("cuBLAS handle poisoned");
        // SAFETY: pointers and leading dimensions describe live device buffers (callers check shapes).
        unsafe {
            blas::gemm_ex(
                h.0,
                op(trans_a),
                op(trans_b),
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                a.0 as *const c_void,
                a.1,
                a.2 as i32,
                b.0 as *const c_void,
                b.1,
                b.2 as i32,
                &beta as *const f32 as *const c_void,
                c.0 as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                c.1 as i32,
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .unwrap_or_else(|e| panic!("cublasGemmEx (m={m}, n={n}, k={k}) failed: {e:?}"));
    }

    /// The f32 compute type: plain f32 when exact, TF32 tensor cores otherwise.
    fn f32_compute(&self) -> blas_sys::cublasComputeType_t {
        if self.inner.exact {
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        } else {
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        }
    }

    fn elementwise_out(&self, name: &str, a: &CudaTensor, b: &CudaTensor) -> CudaTensor {
        assert_eq!(
            a.len(),
            b.len(),
            "{name}: operands have {} and {} values",
            a.len(),
            b.len()
        );
        let out = self.alloc_act(a.rows, a.cols, a.rows);
        let n = a.len();
        if n > 0 {
            launch!(self, name, grid_1d(n), (256, 1, 1), 0; a.ptr(), b.ptr(), out.ptr(), n as u64);
        }
        out
    }

    fn inv_freq_device(&self, inv_freq: &[f32]) -> u64 {
        let mut cached = self.inner.inv_freq.lock().expect("rope table poisoned");
        if let Some((v, buf)) = cached.as_ref() {
            if v.as_slice() == inv_freq {
                return buf.ptr;
            }
        }
        let buf = self.upload(inv_freq, "rope frequencies");
        let ptr = buf.ptr;
        *cached = Some((inv_freq.to_vec(), buf));
        ptr
    }

    /// The device copy of `positions`, uploaded only when they differ from the last call's.
    fn positions_device(&self, positions: &[i32]) -> u64 {
        let mut cached = self.inner.positions.lock().expect("positions poisoned");
        if let Some((p, buf)) = cached.as_ref() {
            if p.as_slice() == positions {
                return buf.ptr;
            }
        }
        let buf = self.upload(positions, "positions");
        let ptr = buf.ptr;
        *cached = Some((positions.to_vec(), buf));
        ptr
    }

    /// The recurrent delta rule over `n` tokens whose q, k and v rows are `strides` floats apart
    /// (separate tensors, or the packed conv output read in place).
    #[allow(clippy::too_many_arguments)]
    /// The recurrent delta rule; with `norm` (weight, z, activation, eps) a block holds each
    /// head's every value column and writes the normed, gated output (kernels/delta_rule.cu),
    /// with its int8 copy where `out` has one.
    #[allow(clippy::too_many_arguments)]
    fn delta_rule_recurrent(
        &self,
        (q, k, v): (u64, u64, u64),
        strides: (usize, usize, usize),
        g: &CudaTensor,
        beta: &CudaTensor,
        state: &mut CudaTensor,
        s: DeltaRuleShape,
        n: usize,
        out: &CudaTensor,
        norm: Option<(&CudaVector, &CudaTensor, GateActivation, f32)>,
    ) {
        state.written();
        assert!(
            s.k_head_dim <= 128,
            "gated delta rule: key head dim {} is above the kernel's 128",
            s.k_head_dim
        );
        assert_eq!(state.len(), s.num_v_heads * s.k_head_dim * s.v_head_dim);
        assert_eq!(g.len(), n * s.num_v_heads, "gated delta rule: g shape");
        assert_eq!(
            beta.len(),
            n * s.num_v_heads,
            "gated delta rule: beta shape"
        );
        if n == 0 {
            return;
        }
        // One warp per 32 key rows of a 32-column value tile (kernels/delta_rule.cu); a normed
        // launch puts all of a head's tiles in one block.
        let warps = ceil_div(s.k_head_dim, 32).max(1);
        let value_tiles = ceil_div(s.v_head_dim, 32);
        let (tiles_per_block, (w, z, act, eps)) = match norm {
            Some((w, z, act, eps)) => {
                assert!(
                    normed_delta_rule_fits(s),
                    "gated delta rule: a normed head of {}x{} does not fit a block",
                    s.k_head_dim,
                    s.v_head_dim
                );
                let act = match act {
                    GateActivation::Silu => 0i32,
                    GateActivation::Sigmoid => 1,
                };
                (value_tiles, (w.buf.ptr, z.ptr(), act, eps))
            }
            None => (1, (0u64, 0u64, 0i32, 0f32)),
        };
        let (xq, xs) = if norm.is_some() {
            out.q8_args()
        } else {
            (0, 0)
        };
        launch!(self, "gated_delta_rule",
            (s.num_v_heads as u32, (value_tiles / tiles_per_block) as u32, 1),
            (32, (warps * tiles_per_block) as u32, 1), 0;
            q, k, v, g.ptr(), beta.ptr(), state.ptr(), out.ptr(), n as i32,
            s.num_k_heads as i32, s.num_v_heads as i32, s.k_head_dim as i32, s.v_head_dim as i32,
            strides.0 as i32, strides.1 as i32, strides.2 as i32, w, z, act, eps, xq, xs);
    }

    /// [`CudaBackend::delta_rule_recurrent`] reading q, k and v in place from the packed conv
    /// output `qkv` (`q ‖ k ‖ v` a row).
    #[allow(clippy::too_many_arguments)]
    fn delta_rule_recurrent_packed(
        &self,
        qkv: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        state: &mut CudaTensor,
        s: DeltaRuleShape,
        out: &CudaTensor,
        norm: Option<(&CudaVector, &CudaTensor, GateActivation, f32)>,
    ) {
        let kd = s.num_k_heads * s.k_head_dim;
        let base = qkv.ptr();
        self.delta_rule_recurrent(
            (base, base + (kd * 4) as u64, base + (2 * kd * 4) as u64),
            (qkv.cols, qkv.cols, qkv.cols),
            g,
            beta,
            state,
            s,
            qkv.rows,
            out,
            norm,
        );
    }

    /// Whether the int8 (dp4a) decode matvecs may take `x · wᵀ`: the fast path, one input
    /// row, whole 256-weight super-blocks. Exact math and several rows keep the f32 kernels.
    fn fast_single_row(&self, x: &CudaTensor, w: &CudaMatrix) -> bool {
        !self.inner.exact && x.rows == 1 && w.cols.is_multiple_of(256) && w.cols <= QMV8_MAX_COLS
    }

    /// `out = x · wᵀ` for one row of x and NVFP4 or IQ3_S records: x quantized to int8 once
    /// (into a scratch buffer every warp reads through L1) unless its producer left the copy,
    /// then the format's records matvec, plain or split-K, one pass over the rows.
    fn records_matvec(&self, x: &CudaTensor, w: &CudaMatrix, q: QuantLayout, out: &CudaTensor) {
        let groups = w.cols / 32;
        // Plane A and B (cols bytes), then a scale per group of 32: the producer's copy, or
        // quantized here.
        let scratch;
        let (planes, scales) = match x.q8_args() {
            (0, _) => {
                scratch = self.alloc(w.cols + groups * 4, "int8 activations");
                let scales = scratch.ptr + w.cols as u64;
                launch!(self, "quantize_x_q8r", (ceil_div(groups, 128) as u32, 1, 1), (128, 1, 1), 0;
                    x.ptr(), w.cols as i32, scratch.ptr, scales);
                (scratch.ptr, scales)
            }
            fused => fused,
        };
        let family = if q.code == QF_IQ3SR {
            &IQ3SR_FAMILY
        } else {
            &NVFP4R_FAMILY
        };
        let sms = self.inner.info.multiprocessors.max(1) as usize;
        let forced = records_kernel_of(self.inner.records_kernel.load(Ordering::Relaxed));
        let (kernel, blocks) = records_launch(family, w.rows, w.cols, sms, forced);
        launch!(self, kernel, (blocks as u32, 1, 1), (256, 1, 1), 0;
            w.buf.ptr, planes, scales, out.ptr(), w.cols as i32, w.rows as i32, q.row_bytes as u64, q.multiplier);
    }

    /// The int8 (dp4a) decode matvec on the checkpoint's block layouts for one input row on
    /// the fast path, where the format and shape allow it: (kernel, dynamic shared bytes, rows
    /// per warp). Ragged widths and unaligned rows keep the f32 kernels.
    fn int8_matvec_plan(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        q: QuantLayout,
    ) -> Option<(&'static str, u32, i32)> {
        if !self.fast_single_row(x, w) {
            return None;
        }
        let spr = w.cols / 256;
        use crate::quant::GgmlType as G;
        let (name, sb_bytes, table_bytes) = match q.format {
            RowFormat::Nvfp4 if q.code == QF_NVFP4 => ("quant_matvec_nvfp4_q8", 144, 1024),
            // Grid table, sign masks and one 32-block staging buffer per warp.
            RowFormat::Ggml(G::Iq3S) if q.code == QF_IQ3_S => {
                ("quant_matvec_iq3s_q8", 110, 2048 + 64 + QMV8_WARPS * 3520)
            }
            _ => return None,
        };
        if q.row_bytes != spr * sb_bytes
            || !q.row_bytes.is_multiple_of(8)
            || !w.buf.ptr.is_multiple_of(16)
        {
            return None;
        }
        // A warp's rows must start on 16 bytes (IQ3_S rows of 8 mod 16 bytes: an even count).
        let even = !q.row_bytes.is_multiple_of(16);
        // About 16 warps per SM in one pass; enough rows per warp that its lanes have work.
        let sms = self.inner.info.multiprocessors.max(1) as usize;
        let mut rpw = (w.rows / (sms * 16)).clamp(1, 8);
        rpw = rpw.max(32usize.div_ceil(spr)).min(8);
        if even && !rpw.is_multiple_of(2) {
            rpw += 1;
        }
        let smem = spr * (272 + 48) + table_bytes;
        Some((name, smem as u32, rpw as i32))
    }

    /// Rows `r0..r0 + rows` of a quantized matrix (or rows `ids`, when given) widened into
    /// `dst` as f32 or BF16.
    #[allow(clippy::too_many_arguments)]
    fn dequant_rows(
        &self,
        w: &CudaMatrix,
        q: QuantLayout,
        ids: u64,
        r0: usize,
        rows: usize,
        dst: u64,
        bf16: bool,
    ) {
        let groups = rows * w.cols / 8;
        if groups > 0 {
            launch!(self, "quant_dequant_rows", grid_1d(groups), (256, 1, 1), 0;
                q.code, w.buf.ptr, ids, r0 as u64, rows as i32, w.cols as i32, q.row_bytes as u64,
                q.multiplier, dst, bf16 as i32);
        }
    }

    /// Prefill through a quantized matrix: a block of rows at a time dequantized into scratch
    /// (BF16 for the fast path, f32 when exact), then a cuBLAS GEMM writes those output columns.
    fn linear_gemm_quant(&self, x: &CudaTensor, w: &CudaMatrix, q: QuantLayout, out: &CudaTensor) {
        use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
        let (n, k, m) = (x.rows, x.cols, w.rows);
        let exact = self.inner.exact;
        // Large row blocks, a multiple of 256 rows where possible: cuBLAS runs narrow or
        // ragged blocks (3276 rows of a 5120-wide matrix) far below its full rate.
        let fit = QUANT_SCRATCH_ELEMS / k.max(1);
        let block_rows = if fit >= 256 { fit / 256 * 256 } else { fit }.clamp(1, m);
        let esize = if exact { 4 } else { 2 };
        let scratch = self.alloc(block_rows * k * esize, "dequantized weight scratch");
        let xh = if exact {
            None
        } else {
            Some(self.to_16bit(x.ptr(), x.len(), WeightType::BF16, "16-bit activations"))
        };
        for r0 in (0..m).step_by(block_rows) {
            let rows = block_rows.min(m - r0);
            self.dequant_rows(w, q, 0, r0, rows, scratch.ptr, !exact);
            let (a, b, compute) = match &xh {
                None => (
                    (scratch.ptr, CUDA_R_32F, k),
                    (x.ptr(), CUDA_R_32F, k),
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                ),
                Some(xh) => (
                    (scratch.ptr, CUDA_R_16BF, k),
                    (xh.ptr, CUDA_R_16BF, k),
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                ),
            };
            self.gemm(
                true,
                false,
                rows,
                n,
                k,
                1.0,
                a,
                b,
                (out.ptr() + (r0 * 4) as u64, m),
                compute,
            );
        }
    }

    fn linear_gemm(&self, x: &CudaTensor, w: &CudaMatrix, out: &CudaTensor) {
        if let Some(q) = w.quant {
            return self.linear_gemm_quant(x, w, q, out);
        }
        let (n, k, m) = (x.rows, x.cols, w.rows);
        use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
        let wtype = match w.dtype {
            WeightType::F32 => CUDA_R_32F,
            WeightType::BF16 => CUDA_R_16BF,
            WeightType::F16 => CUDA_R_16F,
        };
        if w.dtype == WeightType::F32 {
            self.gemm(
                true,
                false,
                m,
                n,
                k,
                1.0,
                (w.buf.ptr, CUDA_R_32F, k),
                (x.ptr(), CUDA_R_32F, k),
                (out.ptr(), m),
                self.f32_compute(),
            );
        } else if !self.inner.exact {
            // Activations rounded to the weights' 16-bit type; f32 accumulation and output.
            let xh = self.to_16bit(x.ptr(), x.len(), w.dtype, "16-bit activations");
            self.gemm(
                true,
                false,
                m,
                n,
                k,
                1.0,
                (w.buf.ptr, wtype, k),
                (xh.ptr, wtype, k),
                (out.ptr(), m),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            );
        } else {
            // Exact: widen a block of weight rows to f32, multiply in f32, write those output columns.
            let block_rows = (SCRATCH_ELEMS / k.max(1)).clamp(1, m);
            let scratch = self.alloc(block_rows * k * 4, "exact-math weight scratch");
            for r0 in (0..m).step_by(block_rows) {
                let rows = block_rows.min(m - r0);
                let count = rows * k;
                launch!(self, "weight_to_f32", grid_1d(count), (256, 1, 1), 0;
                    w.buf.ptr, w.dtype as i32, (r0 * k) as u64, scratch.ptr, count as u64);
                self.gemm(
                    true,
                    false,
                    rows,
                    n,
                    k,
                    1.0,
                    (scratch.ptr, CUDA_R_32F, k),
                    (x.ptr(), CUDA_R_32F, k),
                    (out.ptr() + (r0 * 4) as u64, m),
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                );
            }
        }
    }

    /// The chunked gated delta rule (kernels/delta_rule.cu): the state-free UT transform of
    /// every chunk of a segment in parallel, then one ordered scan over the segment's chunks.
    /// Segments bound the workspace to [`GDR_WORKSPACE_BYTES`].
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule_chunked(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        state: &mut CudaTensor,
        s: DeltaRuleShape,
        out: &CudaTensor,
    ) {
        state.written();
        let n = q.rows;
        let (dk, dv, nv) = (s.k_head_dim, s.v_head_dim, s.num_v_heads);
        let plan = ChunkedDeltaRulePlan::new(n, s);
        let ws = self.alloc(
            plan.seg_chunks * nv * plan.per_chunk_floats * 4,
            "delta-rule chunk workspace",
        );
        for c0 in (0..plan.chunks).step_by(plan.seg_chunks) {
            let seg = plan.seg_chunks.min(plan.chunks - c0);
            let t0 = (c0 * ChunkedDeltaRulePlan::CHUNK) as i32;
            launch!(self, "gdr_chunk_prep", (nv as u32, seg as u32, 1), (256, 1, 1), plan.prep_smem as u32;
                q.ptr(), k.ptr(), v.ptr(), g.ptr(), beta.ptr(), ws.ptr, n as i32, t0,
                s.num_k_heads as i32, nv as i32, dk as i32, dv as i32);
            launch!(self, "gdr_chunk_scan", (nv as u32, plan.scan_tiles as u32, 1), (256, 1, 1), plan.scan_smem as u32;
                ws.ptr, state.ptr(), out.ptr(), n as i32, t0, seg as i32, nv as i32, dk as i32, dv as i32);
        }
    }

    /// Blocks of `attn_split` the whole GPU holds at once (the SMs times the driver's
    /// occupancy, or `CAPY_ATTN_SLOTS_PER_SM`), asked of the driver once per backend.
    fn attention_slots(&self) -> usize {
        *self.inner.attention_slots.get_or_init(|| {
            let sms = self.inner.info.multiprocessors.max(1) as usize;
            sms * attention_slots_override()
                .or_else(|| self.resident_blocks_per_sm("attn_split", 128, 0))
                .unwrap_or(4)
        })
    }

    /// Decode attention split over the keys; with `gate` the combine writes
    /// `attention · sigmoid(gate)` (and the int8 copy where `out` has one).
    #[allow(clippy::too_many_arguments)]
    fn attention_split_kv(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        past: usize,
        s: AttentionShape,
        out: &CudaTensor,
        gate: Option<&CudaTensor>,
    ) {
        let n = q.rows;
        let total = k.rows;
        // Up to 6 query heads of one KV head a block (kernels/attention.cu, ATTN_GQA_MAX).
        let group = s.num_heads / s.num_kv_heads;
        let blocks = s.num_kv_heads * ceil_div(group, 6);
        let split_len = attention_split_len(total, blocks * n, self.attention_slots());
        let splits = ceil_div(total, split_len).max(1);
        let part_o = self.alloc(
            n * s.num_heads * splits * s.head_dim * 4,
            "attention partials",
        );
        let part_ml = self.alloc(n * s.num_heads * splits * 2 * 4, "attention partials");
        launch!(self, "attn_split", (blocks as u32, splits as u32, n as u32), (128, 1, 1), 0;
            q.ptr(), k.ptr(), v.ptr(), part_o.ptr, part_ml.ptr, past as i32, s.num_heads as i32,
            s.num_kv_heads as i32, s.head_dim as i32, s.scale, split_len as i32);
        let (xq, xs) = if gate.is_some() {
            out.q8_args()
        } else {
            (0, 0)
        };
        launch!(self, "attn_combine", (s.num_heads as u32, n as u32, 1), (256, 1, 1), 0;
            part_o.ptr, part_ml.ptr, out.ptr(), s.num_heads as i32, s.head_dim as i32, splits as i32,
            gate.map_or(0, |g| g.ptr()), xq, xs);
    }

    /// Prefill attention (as [`Backend::attention`] with 16 or more query rows) cut up by
    /// `plan` instead of the default: for tests and for the benchmark that chose the default.
    pub fn attention_with_plan(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        past: usize,
        s: AttentionShape,
        plan: AttentionGemmPlan,
    ) -> CudaTensor {
        assert_eq!(
            k.rows,
            past + q.rows,
            "attention: keys must cover past + queries"
        );
        let out = self.alloc_act(q.rows, q.cols, q.rows);
        if q.rows > 0 {
            self.attention_gemm_with(q, k, v, past, s, &out, plan, None);
        }
        out
    }

    /// Prefill attention through cuBLAS with the default [`AttentionGemmPlan`].
    fn attention_gemm(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        past: usize,
        s: AttentionShape,
        out: &CudaTensor,
    ) {
        let plan = AttentionGemmPlan::choose(q.rows, past + q.rows, s);
        self.attention_gemm_with(q, k, v, past, s, out, plan, None);
    }

    /// Prefill attention through cuBLAS: for each block of query rows and each group of
    /// `plan.heads_per_call` query heads sharing a key/value head, one strided-batched GEMM
    /// for the scores (K read once for the group), one softmax launch, one batched GEMM for
    /// P·V. The scores of a block take at most `plan.scratch_elems` floats. `mask`: QSA's
    /// token mask of the query rows (only their listed tokens are attended), or None.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_gemm_with(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        past: usize,
        s: AttentionShape,
        out: &CudaTensor,
        plan: AttentionGemmPlan,
        mask: Option<TokenMask>,
    ) {
        use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
        let (n, d) = (q.rows, s.head_dim);
        let (qd, kvd) = (s.num_heads * d, s.num_kv_heads * d);
        let group = s.num_heads / s.num_kv_heads;
        let total = past + n;
        // A divisor of the group, so that every call's heads share one key/value head.
        let mut batch = plan.heads_per_call.clamp(1, group);
        while !group.is_multiple_of(batch) {
            batch -= 1;
        }
        let block = (plan.scratch_elems / (total * batch)).clamp(1, n);
        let scores = self.alloc(block * total * batch * 4, "attention scores");
        // Fast math: Q, K, V and the probabilities in BF16 (f32 scores and accumulation), so
        // both products run on BF16 tensor cores and P is half the bytes; exact: all f32.
        let exact = self.inner.exact;
        let to_bf16 = |x: &CudaTensor, elems: usize, what: &str| {
            self.to_16bit(x.ptr(), elems, WeightType::BF16, what)
        };
        let half = (!exact).then(|| {
            (
                to_bf16(q, n * qd, "BF16 queries"),
                to_bf16(k, total * kvd, "BF16 keys"),
                to_bf16(v, total * kvd, "BF16 values"),
                self.alloc(block * total * batch * 2, "BF16 attention probabilities"),
            )
        });
        let (dtype, esize, compute) = if exact {
            (CUDA_R_32F, 4, self.f32_compute())
        } else {
            (
                CUDA_R_16BF,
                2,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        let (qp, kp, vp) = match &half {
            Some((qh, kh, vh, _)) => (qh.ptr, kh.ptr, vh.ptr),
            None => (q.ptr(), k.ptr(), v.ptr()),
        };
        let probs = half.as_ref().map_or(scores.ptr, |h| h.3.ptr);
        for q0 in (0..n).step_by(block) {
            let rows = block.min(n - q0);
            // Keys the last query of this block can see.
            let keys = past + q0 + rows;
            let per_head = (rows * keys) as i64;
            for h0 in (0..s.num_heads).step_by(batch) {
                let kvh = h0 / group;
                let q_ptr = qp + ((q0 * qd + h0 * d) * esize) as u64;
                let k_ptr = kp + ((kvh * d) * esize) as u64;
                let v_ptr = vp + ((kvh * d) * esize) as u64;
                // scores_h[rows, keys] = scale · Q_h Kᵀ (column-major: Sᵀ = K · Q_hᵀ), h in
                // the call's heads: Q_h a head (d values) further along each row, K shared.
                self.gemm_batched(
                    (true, false),
                    (keys, rows, d),
                    s.scale,
                    ((k_ptr, dtype), kvd, 0),
                    ((q_ptr, dtype), qd, d as i64),
                    (scores.ptr, keys, per_head),
                    batch,
                    compute,
                );
                let grid = ((rows * batch) as u32, 1, 1);
                let first = (past + q0 + 1) as i32;
                let (mask_ptr, words, ratio) = mask.map_or((0u64, 0i32, 1i32), |m| {
                    (
                        m.ptr + (q0 * m.words * 4) as u64,
                        m.words as i32,
                        m.ratio as i32,
                    )
                });
                if exact {
                    launch!(self, "causal_softmax", grid, (256, 1, 1), 0;
                        scores.ptr, keys as i32, first, rows as i32, mask_ptr, words, ratio);
                } else {
                    launch!(self, "causal_softmax_bf16", grid, (256, 1, 1), 0;
                        scores.ptr, probs, keys as i32, first, rows as i32, mask_ptr, words, ratio);
                }
                // out_h[rows, d] = P_h · V (column-major: Oᵀ = Vᵀ · P_hᵀ)
                let o_ptr = out.ptr() + ((q0 * qd + h0 * d) * 4) as u64;
                self.gemm_batched(
                    (false, false),
                    (d, rows, keys),
                    1.0,
                    ((v_ptr, dtype), kvd, 0),
                    ((probs, dtype), keys, per_head),
                    (o_ptr, qd, d as i64),
                    batch,
                    compute,
                );
            }
        }
    }

    /// `C_i = alpha · op(A_i)·op(B_i)` for `batch` matrices (column-major, as cuBLAS sees
    /// them; C in f32), each operand given as `((pointer, type), leading dimension, stride
    /// between matrices in elements)`; a stride of 0 shares one matrix across the batch.
    #[allow(clippy::too_many_arguments)]
    fn gemm_batched(
        &self,
        (trans_a, trans_b): (bool, bool),
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: ((u64, blas_sys::cudaDataType), usize, i64),
        b: ((u64, blas_sys::cudaDataType), usize, i64),
        c: (u64, usize, i64),
        batch: usize,
        compute: blas_sys::cublasComputeType_t,
    ) {
        let op = blas_op;
        let beta = 0f32;
        self.queue_work();
        let h = self.inner.blas.lock().expect("cuBLAS handle poisoned");
        // SAFETY: pointers, leading dimensions and strides describe live device buffers
        // (callers check shapes).
        let r = unsafe {
            blas_sys::cublasGemmStridedBatchedEx(
                h.0,
                op(trans_a),
                op(trans_b),
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                a.0 .0 as *const c_void,
                a.0 .1,
                a.1 as i32,
                a.2,
                b.0 .0 as *const c_void,
                b.0 .1,
                b.1 as i32,
                b.2,
                &beta as *const f32 as *const c_void,
                c.0 as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                c.1 as i32,
                c.2,
                batch as i32,
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        };
        assert!(
            r == blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
            "cublasGemmStridedBatchedEx (m={m}, n={n}, k={k}, batch {batch}) failed: {r:?}"
        );
    }

    /// Problems that share their types but not their sizes (the routed experts of a prefill
    /// step: the same weight shape, each expert its own token count) as one grouped cuBLAS
    /// call, each problem a group of one: `C_i = op(A_i)·op(B_i)` in f32, operands as
    /// [`gemm`](Self::gemm) takes them, `(m, n, k)` and the three device pointers per problem.
    /// Where this cuBLAS lacks grouped GEMM for these types (or at all), the same products as
    /// one `cublasGemmEx` per problem.
    #[allow(clippy::too_many_arguments)]
    fn gemm_grouped(
        &self,
        (trans_a, trans_b): (bool, bool),
        problems: &[GroupedProblem],
        (a_type, lda): (blas_sys::cudaDataType, usize),
        (b_type, ldb): (blas_sys::cudaDataType, usize),
        ldc: usize,
        compute: blas_sys::cublasComputeType_t,
    ) {
        if problems.is_empty() {
            return;
        }
        let count = problems.len();
        // Pointer arrays live on the device; sizes, scalars and operations on the host.
        let mut ptrs: Vec<u64> = Vec::with_capacity(3 * count);
        ptrs.extend(problems.iter().map(|p| p.a));
        ptrs.extend(problems.iter().map(|p| p.b));
        ptrs.extend(problems.iter().map(|p| p.c));
        let ptrs_dev = self.upload(&ptrs, "grouped GEMM pointers");
        let int = |v: usize| vec![v as i32; count];
        let (ms, ns, ks): (Vec<i32>, Vec<i32>, Vec<i32>) = (
            problems.iter().map(|p| p.m as i32).collect(),
            problems.iter().map(|p| p.n as i32).collect(),
            problems.iter().map(|p| p.k as i32).collect(),
        );
        let (ta, tb) = (vec![blas_op(trans_a); count], vec![blas_op(trans_b); count]);
        let (alpha, beta) = (vec![1f32; count], vec![0f32; count]);
        let (ldas, ldbs, ldcs, sizes) = (int(lda), int(ldb), int(ldc), int(1));
        self.queue_work();
        let status = {
            let h = self.inner.blas.lock().expect("cuBLAS handle poisoned");
            // SAFETY: every host array holds `count` entries; the device pointer arrays hold
            // live operands of the given sizes and leading dimensions (callers check shapes).
            unsafe {
                blas_sys::cublasGemmGroupedBatchedEx(
                    h.0,
                    ta.as_ptr(),
                    tb.as_ptr(),
                    ms.as_ptr(),
                    ns.as_ptr(),
                    ks.as_ptr(),
                    alpha.as_ptr() as *const c_void,
                    ptrs_dev.ptr as *const *const c_void,
                    a_type,
                    ldas.as_ptr(),
                    (ptrs_dev.ptr + 8 * count as u64) as *const *const c_void,
                    b_type,
                    ldbs.as_ptr(),
                    beta.as_ptr() as *const c_void,
                    (ptrs_dev.ptr + 16 * count as u64) as *const *mut c_void,
                    blas_sys::cudaDataType::CUDA_R_32F,
                    ldcs.as_ptr(),
                    count as i32,
                    sizes.as_ptr(),
                    compute,
                )
            }
        };
        if status == blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return;
        }
        if !self.inner.grouped_gemm_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "cublasGemmGroupedBatchedEx ({a_type:?} × {b_type:?} → f32, {compute:?}) returned \
                 {status:?}; the routed experts' prefill GEMMs run one call per expert instead"
            );
        }
        for p in problems {
            self.gemm(
                trans_a,
                trans_b,
                p.m,
                p.n,
                p.k,
                1.0,
                (p.a, a_type, lda),
                (p.b, b_type, ldb),
                (p.c, ldc),
                compute,
            );
        }
    }
}

/// QSA's token mask for [`CudaBackend::attention_gemm_with`]: `[rows, words]` u32 on the
/// device (kernels/qsa.cu `qsa_token_mask`), bit b of a row set where the query attends the
/// tokens of block b (`ratio` tokens a block).
#[derive(Clone, Copy, Debug)]
pub(super) struct TokenMask {
    pub ptr: u64,
    pub words: usize,
    pub ratio: usize,
}

/// One problem of [`CudaBackend::gemm_grouped`]: `C (m × n) = op(A)·op(B)` with inner size `k`.
#[derive(Clone, Copy, Debug)]
struct GroupedProblem {
    m: usize,
    n: usize,
    k: usize,
    a: u64,
    b: u64,
    c: u64,
}

impl Backend for CudaBackend {
    type Act = CudaTensor;
    type Matrix = CudaMatrix;
    type Vector = CudaVector;

    unsafe fn pin_host(&self, bytes: &[u8]) -> Result<Option<super::HostPin>> {
        // SAFETY: forwarded from the caller's promise.
        unsafe { self.pin(bytes) }.map(Some)
    }

    fn name(&self) -> String {
        let i = &self.inner.info;
        format!(
            "cuda ({}, sm_{}{}, driver CUDA {}.{}, NVRTC {}.{}{})",
            i.name,
            i.compute_capability.0,
            i.compute_capability.1,
            i.driver_version.0,
            i.driver_version.1,
            i.nvrtc_version.0,
            i.nvrtc_version.1,
            if self.inner.exact { ", exact math" } else { "" }
        )
    }

    fn matrix(&self, t: &HostTensor) -> Result<CudaMatrix> {
        if t.shape.len() != 2 {
            bail!(
                "tensor {} has shape {:?}; expected a 2-D matrix",
                t.name,
                t.shape
            );
        }
        let synthetic = *self.inner.synthetic_quant.lock().expect("poisoned");
        if let Some(format) = synthetic {
            if Self::synthetic_quant_applies(format, &t.name, t.shape[1]) {
                return self.synthetic_quant_matrix(format, t);
            }
        }
        self.inner
            .matrix_elems
            .fetch_add((t.shape[0] * t.shape[1]) as u64, Ordering::Relaxed);
        let dtype = match t.dtype {
            DType::F32 => WeightType::F32,
            DType::BF16 => WeightType::BF16,
            DType::F16 => WeightType::F16,
            other => bail!(
                "tensor {} has dtype {other}; the CUDA backend takes F32, F16 or BF16 matrices",
                t.name
            ),
        };
        let bytes = t.data.as_slice();
        let buf = self.try_alloc(bytes.len(), &format!("weight {}", t.name), true)?;
        self.htod(buf.ptr, bytes);
        Ok(CudaMatrix {
            rows: t.shape[0],
            cols: t.shape[1],
            dtype,
            quant: None,
            buf,
        })
    }

    fn quant_matrix(
        &self,
        format: RowFormat,
        rows: usize,
        cols: usize,
        blocks: &[u8],
        multiplier: f32,
    ) -> Result<CudaMatrix> {
        use crate::quant::GgmlType as G;
        let row_bytes = format.row_bytes(cols)?;
        if blocks.len() != rows * row_bytes {
            bail!(
                "{} matrix [{rows}, {cols}]: expected {} bytes ({row_bytes} per row), found {}",
                format.name(),
                rows * row_bytes,
                blocks.len()
            );
        }
        let Some(code) = quant_code(format) else {
            // Plain float "blocks": upload as a dense matrix (scaled on the host if need be).
            let dtype = match format {
                RowFormat::Ggml(G::BF16) => DType::BF16,
                RowFormat::Ggml(G::F16) => DType::F16,
                _ => DType::F32,
            };
            let t = if multiplier == 1.0 && dtype != DType::F32 {
                HostTensor {
                    name: format!("{} matrix", format.name()),
                    dtype,
                    shape: vec![rows, cols],
                    data: crate::tensor::Bytes::from_vec(blocks.to_vec()),
                }
            } else {
                let values = super::dequantize_matrix(format, rows, cols, blocks, multiplier)?;
                HostTensor::from_f32(
                    &format!("{} matrix", format.name()),
                    vec![rows, cols],
                    &values,
                )
            };
            return self.matrix(&t);
        };
        let what = format!("{} weight [{rows}, {cols}]", format.name());
        let buf = self.try_alloc(blocks.len(), &what, true)?;
        self.inner
            .matrix_elems
            .fetch_add((rows * cols) as u64, Ordering::Relaxed);
        let code = if code == QF_NVFP4
            && nvfp4_records::applies(cols)
            && self.inner.nvfp4_records.load(Ordering::Relaxed)
        {
            self.htod(buf.ptr, &nvfp4_records::to_records(blocks, cols));
            self.inner.records_loaded.store(true, Ordering::Relaxed);
            QF_NVFP4R
        } else if code == QF_IQ3_S
            && iq3s_records::applies(cols)
            && self.inner.iq3s_records.load(Ordering::Relaxed)
            && !self.inner.exact
            // The kernels find each record's body by its address (iq3s_records.rs).
            && buf.ptr.is_multiple_of(16)
        {
            self.htod(buf.ptr, &iq3s_records::to_records(blocks, cols));
            self.inner.records_loaded.store(true, Ordering::Relaxed);
            QF_IQ3SR
        } else {
            self.htod(buf.ptr, blocks);
            code
        };
        Ok(CudaMatrix {
            rows,
            cols,
            dtype: WeightType::F32,
            quant: Some(QuantLayout {
                format,
                code,
                row_bytes,
                multiplier,
            }),
            buf,
        })
    }

    fn vector(&self, values: &[f32]) -> Result<CudaVector> {
        let buf = self.try_alloc(values.len() * 4, "parameter vector", true)?;
        self.htod(buf.ptr, values);
        Ok(CudaVector {
            len: values.len(),
            buf,
        })
    }

    fn from_host(&self, rows: usize, cols: usize, data: &[f32]) -> CudaTensor {
        self.from_host_with_capacity(rows, cols, rows, data)
    }

    fn from_host_with_capacity(
        &self,
        rows: usize,
        cols: usize,
        capacity: usize,
        data: &[f32],
    ) -> CudaTensor {
        assert_eq!(rows * cols, data.len());
        let t = self.alloc_act(rows, cols, capacity);
        self.htod(t.ptr(), data);
        t
    }

    fn to_host(&self, x: &CudaTensor) -> Vec<f32> {
        let mut out = crate::tensor::bulk_f32(x.len());
        self.dtoh(&mut out, x.ptr());
        out
    }

    fn argmax_rows(&self, x: &CudaTensor, limit: usize) -> Vec<u32> {
        let cols = limit.min(x.cols);
        if !self.inner.device_argmax.load(Ordering::Relaxed) || x.rows == 0 || cols == 0 {
            return argmax_rows_on_host(self, x, limit);
        }
        // Parts of 2K values: a 248K-value row is ~120 blocks, one wave.
        let chunk = ARGMAX_CHUNK;
        let parts = ceil_div(cols, chunk);
        let partial = self.alloc(x.rows * parts * 8, "argmax partials");
        let ids = self.alloc(x.rows * 4, "argmax ids");
        launch!(self, "argmax_partial", (parts as u32, x.rows as u32, 1), (256, 1, 1), 0;
            x.ptr(), x.cols as i32, cols as i32, chunk as i32, partial.ptr);
        launch!(self, "argmax_final", (x.rows as u32, 1, 1), (256, 1, 1), 0;
            partial.ptr, parts as i32, ids.ptr);
        let mut out = vec![0u32; x.rows];
        self.dtoh(&mut out, ids.ptr);
        out
    }

    fn submit(&self) {
        self.bind();
        self.submit_recorded().unwrap_or_else(|e| panic!("{e:#}"));
    }

    fn zeros(&self, rows: usize, cols: usize) -> CudaTensor {
        let t = self.alloc_act(rows, cols, rows);
        if t.buf.bytes > 0 {
            self.queue_work();
            // SAFETY: inside the allocation.
            unsafe { drv::memset_d8_async(t.ptr(), 0, t.buf.bytes, self.stream()) }
                .expect("memset failed");
        }
        t
    }

    fn shape(&self, x: &CudaTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn rows(&self, x: &CudaTensor, r: Range<usize>) -> CudaTensor {
        assert!(
            r.start <= r.end && r.end <= x.rows,
            "rows {r:?} of a tensor with {} rows",
            x.rows
        );
        let out = self.alloc_act(r.len(), x.cols, r.len());
        self.copy_dtod(out.ptr(), x.row_ptr(r.start), r.len() * x.cols * 4);
        out
    }

    fn cols(&self, x: &CudaTensor, c: Range<usize>) -> CudaTensor {
        assert!(
            c.start <= c.end && c.end <= x.cols,
            "columns {c:?} of a tensor with {} columns",
            x.cols
        );
        let out = self.alloc_act(x.rows, c.len(), x.rows);
        let n = x.rows * c.len();
        if n > 0 {
            launch!(self, "copy_cols", grid_1d(n), (256, 1, 1), 0;
                x.ptr(), out.ptr(), x.rows as u64, x.cols as i32, c.start as i32, c.len() as i32);
        }
        out
    }

    fn split_cols<const N: usize>(&self, x: &CudaTensor, widths: [usize; N]) -> [CudaTensor; N] {
        let total: usize = widths.iter().sum();
        assert!(
            total <= x.cols,
            "split_cols: pieces of {widths:?} columns from a tensor with {} columns",
            x.cols
        );
        let outs = widths.map(|w| self.alloc_act(x.rows, w, x.rows));
        // Four pieces a launch (split_cols4); piece bounds b0 ≤ … ≤ b4, unused ones empty.
        let mut start = 0;
        for (pieces, ws) in outs.chunks(4).zip(widths.chunks(4)) {
            let mut bounds = [start; 5];
            let mut dst = [0u64; 4];
            for (j, (p, &w)) in pieces.iter().zip(ws).enumerate() {
                dst[j] = p.ptr();
                bounds[j + 1] = bounds[j] + w;
            }
            let end = bounds[pieces.len()];
            for b in &mut bounds[pieces.len() + 1..] {
                *b = end;
            }
            let n = x.rows * (end - start);
            // Four values a thread where the kernel can take them so (kernels/elementwise.cu).
            let quads = bounds.iter().all(|b| b.is_multiple_of(4))
                && x.cols.is_multiple_of(4)
                && std::iter::once(x.ptr())
                    .chain(dst)
                    .all(|p| p.is_multiple_of(16));
            if n > 0 {
                launch!(self, "split_cols4", grid_1d(if quads { n / 4 } else { n }), (256, 1, 1), 0;
                    x.ptr(), x.rows as u64, x.cols as i32, dst[0], dst[1], dst[2], dst[3],
                    bounds[0] as i32, bounds[1] as i32, bounds[2] as i32, bounds[3] as i32, bounds[4] as i32);
            }
            start = end;
        }
        outs
    }

    fn cat_rows(&self, parts: &[CudaTensor]) -> CudaTensor {
        let cols = parts.first().map_or(0, |p| p.cols);
        let rows = parts.iter().map(|p| p.rows).sum();
        let out = self.alloc_act(rows, cols, rows);
        let mut at = 0;
        for p in parts {
            assert_eq!(p.cols, cols, "cat_rows: column counts differ");
            self.copy_dtod(out.row_ptr(at), p.ptr(), p.len() * 4);
            at += p.rows;
        }
        out
    }

    fn append_rows(&self, dst: &mut CudaTensor, src: &CudaTensor) {
        assert_eq!(dst.cols, src.cols, "append_rows: column counts differ");
        self.reserve_rows(dst, src.rows);
        self.copy_dtod(dst.row_ptr(dst.rows), src.ptr(), src.len() * 4);
        dst.rows += src.rows;
    }

    fn truncate_rows(&self, x: &mut CudaTensor, rows: usize) {
        x.written();
        x.rows = x.rows.min(rows);
    }

    fn embedding(&self, table: &CudaMatrix, ids: &[u32]) -> CudaTensor {
        self.begin_forward(ids.len());
        self.gather_rows(table, ids)
    }

    fn embedding_repeated(&self, table: &CudaMatrix, ids: &[u32], copies: usize) -> CudaTensor {
        self.begin_forward(ids.len());
        let repeated: Vec<u32> = ids
            .iter()
            .flat_map(|&id| std::iter::repeat_n(id, copies))
            .collect();
        let mut out = self.gather_rows(table, &repeated);
        // [n·copies, cols] and [n, copies·cols] are the same bytes in row-major order.
        (out.rows, out.cols, out.capacity) = (ids.len(), out.cols * copies, ids.len());
        out
    }

    fn linear(&self, x: &CudaTensor, w: &CudaMatrix) -> CudaTensor {
        assert_eq!(
            x.cols, w.cols,
            "linear: input has {} columns, weight expects {}",
            x.cols, w.cols
        );
        let out = self.alloc_act(x.rows, w.rows, x.rows);
        if x.rows == 0 || w.rows == 0 {
            return out;
        }
        if x.cols == 0 {
            let zeros = self.zeros(x.rows, w.rows);
            return zeros;
        }
        if let Some(q) = w
            .quant
            .filter(|q| (q.code == QF_NVFP4R || q.code == QF_IQ3SR) && self.fast_single_row(x, w))
        {
            self.records_matvec(x, w, q, &out);
        } else if let Some((name, smem, rpw)) = w.quant.and_then(|q| self.int8_matvec_plan(x, w, q))
        {
            let q = w.quant.expect("checked");
            let warps = ceil_div(w.rows, rpw as usize);
            launch!(self, name, (ceil_div(warps, QMV8_WARPS) as u32, 1, 1), (32 * QMV8_WARPS as u32, 1, 1), smem;
                w.buf.ptr, x.ptr(), out.ptr(), w.cols as i32, w.rows as i32, q.row_bytes as u64, q.multiplier, rpw);
        } else if let (Some(q), true) = (w.quant, x.rows <= MATVEC_MAX_ROWS) {
            let name = format!("quant_matvec_{}", x.rows);
            let rows_per_block = 8 * 4; // 8 warps of QMV_RPW rows
            launch!(self, &name, (ceil_div(w.rows, rows_per_block) as u32, 1, 1), (256, 1, 1), 0;
                q.code, w.buf.ptr, x.ptr(), out.ptr(), w.cols as i32, w.rows as i32, q.row_bytes as u64, q.multiplier);
        } else if x.rows <= MATVEC_MAX_ROWS {
            let per_vector = if w.dtype == WeightType::F32 { 4 } else { 8 };
            let splits = if w.cols.is_multiple_of(per_vector) {
                let sms = self.inner.info.multiprocessors.max(1) as usize;
                dense_matvec_splits(w.rows, w.cols / per_vector, sms)
            } else {
                1
            };
            let name = match splits {
                1 => format!("matvec_{}_{}", w.dtype.name(), x.rows),
                ks => format!("matvec_{}_{}_k{ks}", w.dtype.name(), x.rows),
            };
            let rows_per_block = 8 / splits;
            launch!(self, &name, (ceil_div(w.rows, rows_per_block) as u32, 1, 1), (256, 1, 1), 0;
                w.buf.ptr, x.ptr(), out.ptr(), w.cols as i32, w.rows as i32);
        } else {
            self.linear_gemm(x, w, &out);
        }
        out
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) {
        x.written();
        assert_eq!(
            x.len(),
            y.len(),
            "add_assign: {} and {} values",
            x.len(),
            y.len()
        );
        let n = x.len();
        if n > 0 {
            launch!(self, "add_assign", grid_1d(n), (256, 1, 1), 0; x.ptr(), y.ptr(), n as u64);
        }
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaVector,
        eps: f32,
        scale: NormScale,
        group: usize,
    ) -> CudaTensor {
        assert_eq!(
            w.len, group,
            "rms_norm: weight has {} values for groups of {group}",
            w.len
        );
        assert_eq!(
            x.cols % group,
            0,
            "rms_norm: {} columns are not a multiple of {group}",
            x.cols
        );
        let out = self.norm_out(x, group);
        let groups = x.len() / group;
        let one_plus = (scale == NormScale::OnePlus) as i32;
        match norm_split_plan(group) {
            Some((blocks, threads)) if groups == 1 && self.norm_split() => {
                self.launch_norm_split(x.ptr(), 0, w, &out, group, eps, one_plus, (blocks, threads))
            }
            _ if groups > 0 => {
                self.launch_rms_norm(x, w, 0, &out, group, groups, eps, one_plus);
            }
            _ => {}
        }
        out
    }

    fn rms_norm_gated(
        &self,
        x: &CudaTensor,
        gate: &CudaTensor,
        w: &CudaVector,
        eps: f32,
        group: usize,
    ) -> CudaTensor {
        assert_eq!(
            w.len, group,
            "rms_norm_gated: weight has {} values for groups of {group}",
            w.len
        );
        assert_eq!(
            x.len(),
            gate.len(),
            "rms_norm_gated: gate has {} values, input {}",
            gate.len(),
            x.len()
        );
        assert_eq!(x.cols % group, 0);
        let out = self.norm_out(x, group);
        let groups = x.len() / group;
        if groups > 0 {
            self.launch_rms_norm(x, w, gate.ptr(), &out, group, groups, eps, 0);
        }
        out
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> CudaTensor {
        self.elementwise_out("silu_mul", gate, up)
    }

    fn silu_mul_halves(&self, gate_up: &CudaTensor) -> CudaTensor {
        assert!(
            gate_up.cols.is_multiple_of(2),
            "silu_mul_halves: {} columns do not split into gate and up halves",
            gate_up.cols
        );
        let inter = gate_up.cols / 2;
        let out = self.alloc_act_q8(gate_up.rows, inter);
        let n = out.len();
        match out.q8_args() {
            _ if n == 0 => {}
            (0, _) => {
                // Four values a thread where the kernel can take them so (kernels/elementwise.cu).
                let quads = inter.is_multiple_of(4)
                    && gate_up.ptr().is_multiple_of(16)
                    && out.ptr().is_multiple_of(16);
                launch!(self, "silu_mul_halves", grid_1d(if quads { n / 4 } else { n }), (256, 1, 1), 0;
                    gate_up.ptr(), out.ptr(), gate_up.rows as u64, inter as i32);
            }
            (xq, xs) => {
                launch!(self, "silu_mul_halves_q8", (ceil_div(inter, 256) as u32, 1, 1), (256, 1, 1), 0;
                    gate_up.ptr(), out.ptr(), inter as i32, xq, xs);
            }
        }
        out
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        w: &CudaVector,
        eps: f32,
        scale: NormScale,
        group: usize,
    ) -> CudaTensor {
        x.written();
        assert_eq!(
            x.len(),
            y.len(),
            "add_rms_norm: {} and {} values",
            x.len(),
            y.len()
        );
        assert_eq!(
            w.len, group,
            "add_rms_norm: weight has {} values for groups of {group}",
            w.len
        );
        assert_eq!(
            x.cols % group,
            0,
            "add_rms_norm: {} columns are not a multiple of {group}",
            x.cols
        );
        let out = self.norm_out(x, group);
        let groups = x.len() / group;
        let (xq, xs) = out.q8_args();
        let one_plus = (scale == NormScale::OnePlus) as i32;
        match norm_split_plan(group) {
            Some((blocks, threads)) if groups == 1 && self.norm_split() => self.launch_norm_split(
                x.ptr(),
                y.ptr(),
                w,
                &out,
                group,
                eps,
                one_plus,
                (blocks, threads),
            ),
            _ if groups > 0 => {
                let threads = norm_threads(group);
                launch!(self, "add_rms_norm", (groups as u32, 1, 1), (threads as u32, 1, 1), 0;
                    x.ptr(), y.ptr(), w.buf.ptr, out.ptr(), group as i32, eps, one_plus, xq, xs);
            }
            _ => {}
        }
        out
    }

    fn sigmoid_gate(&self, x: &CudaTensor, gate: &CudaTensor) -> CudaTensor {
        if x.len() != gate.len() || !self.wants_q8(x.rows, x.cols) {
            return self.elementwise_out("sigmoid_gate", x, gate);
        }
        let out = self.alloc_act_q8(x.rows, x.cols);
        let (xq, xs) = out.q8_args();
        launch!(self, "sigmoid_gate_q8", (ceil_div(x.cols, 256) as u32, 1, 1), (256, 1, 1), 0;
            x.ptr(), gate.ptr(), out.ptr(), x.cols as i32, xq, xs);
        out
    }

    fn sigmoid_gate_rows(&self, x: &CudaTensor, logits: &CudaTensor, col: usize) -> CudaTensor {
        self.fn_sigmoid_gate_rows(x, logits, col)
    }

    // --- Flash-Next ops: kernels in kernels/{hyper,qsa,moe}.cu, driven from flash_next.rs ---
    fn wide_rms_norm(
        &self,
        x: &CudaTensor,
        _zero: &CudaVector,
        scale: &CudaTensor,
        eps: f32,
        group: usize,
    ) -> CudaTensor {
        let span = scale.len();
        assert!(
            group > 0 && span.is_multiple_of(group) && x.cols.is_multiple_of(span),
            "wide_rms_norm: groups of {group} with a scale of {span} over rows of {} columns",
            x.cols
        );
        let out = self.norm_out(x, group);
        let groups = x.len() / group;
        if groups > 0 {
            let threads = norm_threads(group);
            let (xq, xs) = out.q8_args();
            launch!(self, "rms_norm_wide", (groups as u32, 1, 1), (threads as u32, 1, 1), 0;
                x.ptr(), scale.ptr(), out.ptr(), group as i32, span as i32, eps, xq, xs);
        }
        out
    }

    fn scale_cols(&self, x: &CudaTensor, scale: &CudaTensor) -> CudaTensor {
        self.fn_scale_cols(x, scale)
    }
    fn silu_scaled(&self, x: &CudaTensor, scale: f32) -> CudaTensor {
        self.fn_silu_scaled(x, scale)
    }
    fn silu_scaled_cols(&self, x: &CudaTensor, cols: Range<usize>, scale: f32) -> CudaTensor {
        self.fn_silu_scaled_cols(x, cols, scale)
    }
    fn hc_mix(&self, normed: &CudaTensor, mix_logits: &CudaTensor, streams: usize) -> CudaTensor {
        self.fn_hc_mix(normed, mix_logits, streams)
    }
    fn hc_inject_cols(
        &self,
        residual: &CudaTensor,
        out: &CudaTensor,
        logits: &CudaTensor,
        first_col: usize,
        streams: usize,
    ) -> CudaTensor {
        self.fn_hc_inject_cols(residual, out, logits, first_col, streams)
    }
    fn hc_inject(
        &self,
        residual: &CudaTensor,
        out: &CudaTensor,
        inject_logits: &CudaTensor,
        streams: usize,
    ) -> CudaTensor {
        self.fn_hc_inject(residual, out, inject_logits, streams)
    }
    fn ple_gate(
        &self,
        key: &CudaTensor,
        query: &CudaTensor,
        value: &CudaTensor,
        streams: usize,
    ) -> CudaTensor {
        self.fn_ple_gate(key, query, value, streams)
    }
    fn mean_pool_rows(&self, x: &CudaTensor, group: usize) -> CudaTensor {
        self.fn_mean_pool_rows(x, group)
    }
    fn qsa_attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        index_q: &CudaTensor,
        block_keys: &CudaTensor,
        past: usize,
        shape: AttentionShape,
        qsa: crate::backend::QsaShape,
    ) -> CudaTensor {
        self.fn_qsa_attention(q, k, v, index_q, block_keys, past, shape, qsa)
    }
    fn moe_route(
        &self,
        logits: &CudaTensor,
        top_k: usize,
        normalize: bool,
    ) -> crate::backend::MoeRouting {
        self.fn_moe_route(logits, top_k, normalize)
    }
    fn moe_experts(
        &self,
        x: &CudaTensor,
        routing: &crate::backend::MoeRouting,
        experts: &[crate::backend::ExpertMatrices<CudaMatrix>],
    ) -> CudaTensor {
        self.fn_moe_experts(x, routing, experts, false)
    }
    fn moe_routed_on_device(
        &self,
        x: &CudaTensor,
        logits: &CudaTensor,
        top_k: usize,
        normalize: bool,
        experts: &[crate::backend::ExpertMatrices<CudaMatrix>],
        shared: Option<&CudaTensor>,
    ) -> Option<CudaTensor> {
        self.fn_moe_routed_on_device(x, logits, top_k, normalize, experts, shared)
    }
    fn takes_interleaved_experts(&self) -> bool {
        true
    }
    fn moe_experts_interleaved(
        &self,
        x: &CudaTensor,
        routing: &crate::backend::MoeRouting,
        experts: &[crate::backend::ExpertMatrices<CudaMatrix>],
    ) -> Option<CudaTensor> {
        Some(self.fn_moe_experts(x, routing, experts, true))
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        positions: &[usize],
        head_dim: usize,
        rotary_dim: usize,
        inv_freq: &[f32],
    ) {
        x.written();
        assert_eq!(
            positions.len(),
            x.rows,
            "rope: {} positions for {} rows",
            positions.len(),
            x.rows
        );
        assert_eq!(x.cols % head_dim, 0);
        assert!(inv_freq.len() >= rotary_dim / 2);
        let n = x.rows * (x.cols / head_dim) * (rotary_dim / 2);
        if n == 0 {
            return;
        }
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let dev_pos = self.positions_device(&pos);
        let freq = self.inv_freq_device(inv_freq);
        launch!(self, "rope", grid_1d(n), (256, 1, 1), 0;
            x.ptr(), dev_pos, freq, x.rows as u64, x.cols as i32, head_dim as i32, rotary_dim as i32);
    }

    fn rms_norm_rope(
        &self,
        x: &CudaTensor,
        w: &CudaVector,
        eps: f32,
        scale: NormScale,
        positions: &[usize],
        head_dim: usize,
        rotary_dim: usize,
        inv_freq: &[f32],
    ) -> CudaTensor {
        assert_eq!(
            w.len, head_dim,
            "rms_norm_rope: weight has {} values for heads of {head_dim}",
            w.len
        );
        assert_eq!(
            x.cols % head_dim,
            0,
            "rms_norm_rope: {} columns are not a multiple of {head_dim}",
            x.cols
        );
        assert_eq!(
            positions.len(),
            x.rows,
            "rms_norm_rope: {} positions for {} rows",
            positions.len(),
            x.rows
        );
        assert!(rotary_dim <= head_dim && inv_freq.len() >= rotary_dim / 2);
        let out = self.alloc_act(x.rows, x.cols, x.rows);
        let groups = x.len() / head_dim;
        if groups == 0 {
            return out;
        }
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let dev_pos = self.positions_device(&pos);
        let freq = self.inv_freq_device(inv_freq);
        let threads = ceil_div(head_dim, 32).clamp(1, 8) * 32;
        launch!(self, "rms_norm_rope", (groups as u32, 1, 1), (threads as u32, 1, 1), 0;
            x.ptr(), w.buf.ptr, out.ptr(), head_dim as i32, eps, (scale == NormScale::OnePlus) as i32,
            dev_pos, freq, (x.cols / head_dim) as i32, rotary_dim as i32);
        out
    }

    fn attention_inputs(
        &self,
        qkv: &CudaTensor,
        s: AttentionShape,
        norms: [&CudaVector; 2],
        eps: f32,
        positions: &[usize],
        rotary_dim: usize,
        inv_freq: &[f32],
        [k_cache, v_cache]: [&mut CudaTensor; 2],
    ) -> (CudaTensor, CudaTensor) {
        let (qd, kvd, d) = (
            s.num_heads * s.head_dim,
            s.num_kv_heads * s.head_dim,
            s.head_dim,
        );
        let fused = qkv.rows == 1
            && positions.len() == 1
            && qkv.cols == 2 * qd + 2 * kvd
            && k_cache.cols == kvd
            && v_cache.cols == kvd
            && norms.iter().all(|w| w.len == d)
            && rotary_dim <= d
            && inv_freq.len() >= rotary_dim / 2
            && self.inner.attention_inputs_fused;
        if !fused {
            return attention_inputs_composed(
                self,
                qkv,
                s,
                norms,
                eps,
                positions,
                rotary_dim,
                inv_freq,
                [k_cache, v_cache],
            );
        }
        let (q, gate) = (self.alloc_act(1, qd, 1), self.alloc_act(1, qd, 1));
        self.reserve_rows(k_cache, 1);
        self.reserve_rows(v_cache, 1);
        let dev_pos = self.positions_device(&[positions[0] as i32]);
        let freq = self.inv_freq_device(inv_freq);
        let threads = ceil_div(d, 32).clamp(1, 8) * 32;
        // A head a block, then enough 256-value copiers for the gate and v.
        let copiers = ceil_div(qd + kvd, threads * 4).max(1);
        let blocks = s.num_heads + s.num_kv_heads + copiers;
        launch!(self, "attention_inputs_row", (blocks as u32, 1, 1), (threads as u32, 1, 1), 0;
            qkv.ptr(), norms[0].buf.ptr, norms[1].buf.ptr, q.ptr(), gate.ptr(),
            k_cache.row_ptr(k_cache.rows), v_cache.row_ptr(v_cache.rows), s.num_heads as i32,
            s.num_kv_heads as i32, d as i32, eps, 1i32, dev_pos, freq, rotary_dim as i32);
        k_cache.rows += 1;
        v_cache.rows += 1;
        (q, gate)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        past: usize,
        s: AttentionShape,
    ) -> CudaTensor {
        let n = q.rows;
        check_attention_shapes(q, k, v, past, s);
        let out = self.alloc_act(n, q.cols, n);
        if n == 0 {
            return out;
        }
        if n < ATTENTION_GEMM_MIN_ROWS {
            self.attention_split_kv(q, k, v, past, s, &out, None);
        } else {
            self.attention_gemm(q, k, v, past, s, &out);
        }
        out
    }

    fn attention_gated(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        past: usize,
        s: AttentionShape,
        gate: &CudaTensor,
    ) -> CudaTensor {
        let n = q.rows;
        let fused = n > 0
            && n < ATTENTION_GEMM_MIN_ROWS
            && (gate.rows, gate.cols) == (q.rows, q.cols)
            && self.inner.attention_gate_fused.load(Ordering::Relaxed);
        if !fused {
            return self.sigmoid_gate(&self.attention(q, k, v, past, s), gate);
        }
        check_attention_shapes(q, k, v, past, s);
        // The combine stores whole int8 groups per warp: heads of whole groups only.
        let out = if s.head_dim.is_multiple_of(32) {
            self.alloc_act_q8(n, q.cols)
        } else {
            self.alloc_act(n, q.cols, n)
        };
        self.attention_split_kv(q, k, v, past, s, &out, Some(gate));
        out
    }

    fn causal_conv1d_silu(
        &self,
        x: &CudaTensor,
        state: &mut CudaTensor,
        weight: &CudaMatrix,
    ) -> CudaTensor {
        state.written();
        let (channels, taps) = (weight.rows, weight.cols);
        assert_eq!(x.cols, channels);
        assert!(taps >= 1, "causal conv: the weight has no taps");
        assert_eq!(state.len(), (taps - 1) * channels);
        let out = self.alloc_act(x.rows, channels, x.rows);
        if x.rows > 0 && channels > 0 && x.rows <= MATVEC_MAX_ROWS {
            // Decode: outputs and state shift in one launch, a thread per channel.
            launch!(self, "causal_conv1d_silu_update", (ceil_div(channels, 128) as u32, 1, 1), (128, 1, 1), 0;
                x.ptr(), state.ptr(), weight.buf.ptr, weight.dense_dtype("causal conv") as i32, out.ptr(), x.rows as i32,
                channels as i32, taps as i32);
        } else if x.rows > 0 && channels > 0 {
            let grid = (
                ceil_div(channels, 256) as u32,
                ceil_div(x.rows, CONV_RUN) as u32,
                1,
            );
            launch!(self, "causal_conv1d_silu", grid, (256, 1, 1), 0;
                x.ptr(), state.ptr(), weight.buf.ptr, weight.dense_dtype("causal conv") as i32, out.ptr(), x.rows as i32,
                channels as i32, taps as i32);
            if taps > 1 {
                launch!(self, "causal_conv1d_state", (ceil_div(channels, 128) as u32, 1, 1), (128, 1, 1), 0;
                    x.ptr(), state.ptr(), x.rows as i32, channels as i32, taps as i32);
            }
        }
        out
    }

    fn gdn_decode_inputs(
        &self,
        proj: &CudaTensor,
        conv_state: &mut CudaTensor,
        conv_weight: &CudaMatrix,
        a_log: &CudaVector,
        dt_bias: &CudaVector,
        conv_dim: usize,
        v_dim: usize,
    ) -> [CudaTensor; 4] {
        conv_state.written();
        let heads = a_log.len;
        let (channels, taps) = (conv_weight.rows, conv_weight.cols);
        assert_eq!(
            (proj.rows, proj.cols),
            (1, conv_dim + v_dim + 2 * heads),
            "gdn_decode_inputs: one row of qkv ‖ z ‖ b ‖ a expected"
        );
        assert_eq!(channels, conv_dim, "gdn_decode_inputs: conv weight rows");
        assert!(taps >= 1, "causal conv: the weight has no taps");
        assert_eq!(conv_state.len(), (taps - 1) * channels);
        assert_eq!(dt_bias.len, heads);
        let conv = self.alloc_act(1, conv_dim, 1);
        let z = self.alloc_act(1, v_dim, 1);
        let g = self.alloc_act(1, heads, 1);
        let beta = self.alloc_act(1, heads, 1);
        let threads = conv_dim + v_dim + heads;
        launch!(self, "gdn_decode_inputs", (ceil_div(threads, 128) as u32, 1, 1), (128, 1, 1), 0;
            proj.ptr(), conv_state.ptr(), conv_weight.buf.ptr, conv_weight.dense_dtype("causal conv") as i32,
            taps as i32, channels as i32, v_dim as i32, heads as i32, a_log.buf.ptr, dt_bias.buf.ptr,
            conv.ptr(), z.ptr(), g.ptr(), beta.ptr());
        [conv, z, g, beta]
    }

    fn delta_rule_gates(
        &self,
        a: &CudaTensor,
        b: &CudaTensor,
        a_log: &CudaVector,
        dt_bias: &CudaVector,
    ) -> (CudaTensor, CudaTensor) {
        let h = a_log.len;
        assert_eq!(a.cols, h);
        assert_eq!(a.len(), b.len());
        let g = self.alloc_act(a.rows, h, a.rows);
        let beta = self.alloc_act(b.rows, h, b.rows);
        let n = a.len();
        if n > 0 {
            launch!(self, "delta_rule_gates", grid_1d(n), (256, 1, 1), 0;
                a.ptr(), b.ptr(), a_log.buf.ptr, dt_bias.buf.ptr, g.ptr(), beta.ptr(), n as u64, h as i32);
        }
        (g, beta)
    }

    fn gated_delta_rule(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        state: &mut CudaTensor,
        shape: DeltaRuleShape,
        mode: DeltaRuleMode,
    ) -> CudaTensor {
        state.written();
        let s = shape;
        let n = q.rows;
        assert!(
            s.k_head_dim <= 128,
            "gated delta rule: key head dim {} is above the kernel's 128",
            s.k_head_dim
        );
        assert_eq!(q.cols, s.num_k_heads * s.k_head_dim);
        assert_eq!(k.cols, q.cols);
        assert_eq!(v.cols, s.num_v_heads * s.v_head_dim);
        assert_eq!(state.len(), s.num_v_heads * s.k_head_dim * s.v_head_dim);
        let out = self.alloc_act(n, v.cols, n);
        if n > 1 && mode == DeltaRuleMode::Chunked && s.k_head_dim.is_multiple_of(4) {
            self.gated_delta_rule_chunked(q, k, v, g, beta, state, s, &out);
        } else {
            self.delta_rule_recurrent(
                (q.ptr(), k.ptr(), v.ptr()),
                (q.cols, k.cols, v.cols),
                g,
                beta,
                state,
                s,
                n,
                &out,
                None,
            );
        }
        out
    }

    fn gated_delta_rule_packed(
        &self,
        qkv: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        state: &mut CudaTensor,
        shape: DeltaRuleShape,
        mode: DeltaRuleMode,
    ) -> CudaTensor {
        state.written();
        let s = shape;
        let n = qkv.rows;
        let kd = s.num_k_heads * s.k_head_dim;
        let vd = s.num_v_heads * s.v_head_dim;
        assert_eq!(
            qkv.cols,
            2 * kd + vd,
            "gated delta rule: packed q ‖ k ‖ v has {} columns, expected {}",
            qkv.cols,
            2 * kd + vd
        );
        if n > 1 && mode == DeltaRuleMode::Chunked && s.k_head_dim.is_multiple_of(4) {
            // The chunked kernels take separate tensors; prefill splits once.
            let [q, k, v] = self.split_cols(qkv, [kd, kd, vd]);
            return self.gated_delta_rule(&q, &k, &v, g, beta, state, s, mode);
        }
        let out = self.alloc_act(n, vd, n);
        self.delta_rule_recurrent_packed(qkv, g, beta, state, s, &out, None);
        out
    }

    fn gated_delta_rule_normed(
        &self,
        qkv: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        state: &mut CudaTensor,
        shape: DeltaRuleShape,
        z: &CudaTensor,
        w: &CudaVector,
        eps: f32,
        gate: GateActivation,
    ) -> CudaTensor {
        let s = shape;
        let (kd, vd) = (s.num_k_heads * s.k_head_dim, s.num_v_heads * s.v_head_dim);
        let fused = qkv.cols == 2 * kd + vd
            && z.rows == qkv.rows
            && z.cols == vd
            && w.len == s.v_head_dim
            && normed_delta_rule_fits(s)
            && self.inner.gdn_norm_fused.load(Ordering::Relaxed);
        if !fused {
            let core =
                self.gated_delta_rule_packed(qkv, g, beta, state, s, DeltaRuleMode::Recurrent);
            return gdn_output_norm(self, &core, z, w, eps, s.v_head_dim, gate);
        }
        let n = qkv.rows;
        let out = if s.v_head_dim.is_multiple_of(32) {
            self.alloc_act_q8(n, vd)
        } else {
            self.alloc_act(n, vd, n)
        };
        self.delta_rule_recurrent_packed(qkv, g, beta, state, s, &out, Some((w, z, gate, eps)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_microbenchmarks_format_codes_equal_the_engines() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tools/cuda_microbench/quant_formats.cuh"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let defined: Vec<(String, i32)> = text
            .lines()
            .filter_map(|l| l.strip_prefix("#define QF_"))
            .map(|l| {
                let (name, code) = l.split_once(' ').expect("#define QF_NAME CODE");
                (format!("QF_{name}"), code.trim().parse().unwrap())
            })
            .collect();
        let engine: Vec<(String, i32)> = QUANT_FORMAT_CODES
            .iter()
            .map(|(n, c)| (n.to_string(), *c))
            .collect();
        assert_eq!(defined, engine, "{path} must define QUANT_FORMAT_CODES");
    }

    #[test]
    fn a_forced_records_variant_of_the_other_format_plans_as_auto() {
        let k = IQ3SR_SPLITK[1];
        let (name, blocks) = iq3sr_launch_plan(5120, 17408, 132, RecordsKernel::SplitK(k));
        assert_eq!((name, blocks), (k.name, ceil_div(5120, k.rpw * 16 / k.ks)));
        let auto = iq3sr_launch_plan(5120, 17408, 132, RecordsKernel::Auto);
        let other = iq3sr_launch_plan(5120, 17408, 132, RecordsKernel::SplitK(NVFP4R_SPLITK[0]));
        assert_eq!(auto, other);
        let plain = iq3sr_launch_plan(34816, 5120, 132, RecordsKernel::Plain);
        assert_eq!(plain, ("quant_matvec_iq3sr_q8_2", 1088));
    }

    #[test]
    fn the_chunked_delta_rule_plan_fits_an_rtx_50_block_and_aligns_every_part() {
        // sm_120 grants a block at most 99 KiB of shared memory; both checkpoints' heads are
        // 128 wide. The scan loads the workspace parts as float4s: each part of each chunk
        // must start on 16 bytes.
        let s = DeltaRuleShape {
            num_k_heads: 16,
            num_v_heads: 48,
            k_head_dim: 128,
            v_head_dim: 128,
        };
        let plan = ChunkedDeltaRulePlan::new(8192, s);
        assert!(plan.prep_smem <= 99 << 10, "{plan:?}");
        assert!(plan.scan_smem <= 99 << 10, "{plan:?}");
        assert_eq!(plan.per_chunk_floats % 4, 0);
        assert_eq!(plan.chunks, 128);
        assert!(plan.seg_chunks * 48 * plan.per_chunk_floats * 4 <= GDR_WORKSPACE_BYTES);
        assert_eq!(plan.scan_tiles, 4);
    }

    #[test]
    fn few_row_float_matvecs_split_rows_over_warps() {
        // Flash-Next on an H100 (132 SMs, 528 blocks for 4 an SM): the lm_head and the GDN
        // input projection fill the GPU a warp a row; the shared expert (1280 rows) takes four
        // warps a row, the 2560-row projections two; the router (513 rows × 320 vectors) and
        // the hyper-connection projections the most splits every lane still has a vector for.
        assert_eq!(dense_matvec_splits(248_320, 320, 132), 1);
        assert_eq!(dense_matvec_splits(16_480, 320, 132), 1);
        assert_eq!(dense_matvec_splits(1280, 320, 132), 4);
        assert_eq!(dense_matvec_splits(2560, 320, 132), 2);
        assert_eq!(dense_matvec_splits(513, 320, 132), 8);
        assert_eq!(dense_matvec_splits(328, 1280, 132), 8);
        // Too few vectors a row for any split: a warp a row.
        assert_eq!(dense_matvec_splits(16, 40, 132), 1);
        assert_eq!(dense_matvec_splits(16, 64, 132), 2);
        for rows in [1, 7, 100, 513, 5000, 100_000] {
            for vectors in [1, 31, 32, 64, 320, 1280] {
                let ks = dense_matvec_splits(rows, vectors, 132);
                assert!(ks == 1 || (MATVEC_SPLITS.contains(&ks) && vectors >= 32 * ks));
            }
        }
    }

    #[test]
    fn few_row_records_matvecs_split_rows_over_warps() {
        let plan = |rows, cols| nvfp4r_splitk_plan(rows, cols, 132).map(|k| (k.rpw, k.ks));
        // The 27B on an H100: gate_up fills the GPU as it is; the 5-record projections take
        // two warps a row, down (17 records) four, the 6-record output projections one row a
        // warp over two.
        assert_eq!(plan(34816, 5120), None);
        assert_eq!(plan(14336, 5120), Some((2, 2)));
        assert_eq!(plan(16480, 5120), Some((2, 2)));
        assert_eq!(plan(5120, 17408), Some((2, 4)));
        assert_eq!(plan(5120, 6144), Some((1, 2)));
        // One or three records: no split leaves every warp 2 records.
        assert_eq!(plan(70, 1024), None);
        assert_eq!(plan(70, 3072), None);
        // Tiny matrices take the variant with the most blocks.
        assert_eq!(plan(70, 17408), Some((1, 8)));
        for rows in [1, 7, 70, 5120, 100_000] {
            for cols in [1024, 2048, 5120, 17408, 32768] {
                if let Some(k) = nvfp4r_splitk_plan(rows, cols, 132) {
                    assert!(cols / 1024 >= 2 * k.ks, "{rows}x{cols}: {k:?}");
                    assert!(NVFP4R_WARPS.is_multiple_of(k.ks));
                }
            }
        }
    }

    #[test]
    fn few_row_iq3s_records_matvecs_split_rows_over_half_warps() {
        let plan = |rows, cols| iq3sr_splitk_plan(rows, cols, 132).map(|k| (k.rpw, k.ks));
        // The 27B on an H100 (3 blocks an SM: 396): the plain kernel (32 rows a block) takes
        // gate_up (1088 blocks) and the 5-record projections (515 and 448 blocks); the
        // 5120-row down and output projections take a row a half-warp over two (640 blocks).
        assert_eq!(plan(34816, 5120), None);
        assert_eq!(plan(14336, 5120), None);
        assert_eq!(plan(16480, 5120), None);
        assert_eq!(plan(5120, 17408), Some((1, 2)));
        assert_eq!(plan(5120, 6144), Some((1, 2)));
        // Fewer rows: more slices a row.
        assert_eq!(plan(2048, 17408), Some((1, 4)));
        // One record: no split leaves every half-warp 2 records.
        assert_eq!(plan(70, 1024), None);
        for rows in [1, 7, 70, 5120, 100_000] {
            for cols in [1024, 2048, 5120, 17408, 32768] {
                if let Some(k) = iq3sr_splitk_plan(rows, cols, 132) {
                    assert!(cols / 1024 >= 2 * k.ks, "{rows}x{cols}: {k:?}");
                    assert!(IQ3SR_FAMILY.slices.is_multiple_of(k.ks));
                    assert!(IQ3SR_SPLITK.contains(&k));
                }
            }
        }
        // Every variant of both formats has its own code.
        for k in NVFP4R_SPLITK.iter().chain(&IQ3SR_SPLITK) {
            let code = records_kernel_code(RecordsKernel::SplitK(*k));
            assert_eq!(records_kernel_of(code), RecordsKernel::SplitK(*k));
        }
    }

    #[test]
    fn attention_splits_fill_the_gpu_within_the_combine_limit() {
        // The 27B at 8K on an H100: 4 blocks a split, 132 SMs of 3 resident blocks → 99
        // splits of 83 keys, 396 blocks: one full wave (not 129 splits of 64 in 1.3 waves).
        assert_eq!(attention_split_len(8193, 4, 3 * 132), 83);
        assert_eq!(ceil_div(8193, 83) * 4, 3 * 132);
        // Four resident blocks an SM: 128 splits of 64 keys.
        assert_eq!(attention_split_len(8192, 4, 4 * 132), 64);
        // Longer contexts: longer splits.
        assert_eq!(attention_split_len(65536, 4, 4 * 132), 497);
        // Short contexts keep 64 keys a split.
        assert_eq!(attention_split_len(100, 4, 4 * 132), 64);
        for total in [1, 63, 64, 65, 8191, 100_000, 131_072, 131_073, 1 << 20] {
            for (blocks, slots) in [(1, 1), (4, 396), (4, 528), (48, 680), (1, 4000)] {
                let len = attention_split_len(total, blocks, slots);
                let splits = ceil_div(total, len);
                assert!(len >= 64, "{total} keys: splits of {len}");
                assert!(splits <= 1024, "{total} keys: {splits} splits");
            }
        }
    }
}
