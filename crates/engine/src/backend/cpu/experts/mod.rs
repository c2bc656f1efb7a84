//! Routed-expert FFN on the CPU over quantised weights.
//!
//! For each token `t` and each of its routed experts `e` with weight `w`:
//! `out[t] += w · down_e(silu(gate_e(x[t])) ⊙ up_e(x[t]))`, gate/up `[I, H]`, down `[H, I]`.
//!
//! Layout: an [`ExpertSet`] holds one contiguous record per expert (so one expert's weights
//! stream from memory in one pass): a 64-byte header (three f32 multipliers for gate, up and
//! down — NVFP4's `weight_scale_2`, 1 elsewhere), then `2I` rows of `H` weights with gate and
//! up rows interleaved (row `2i` = gate row `i`, row `2i + 1` = up row `i`), then `H` down
//! rows of `I` weights, every row in one [`RowFormat`]; records are padded to 64 bytes.
//!
//! Computation: rows are dotted with the activations by the fused kernels of [`fused`]
//! (blocks decoded in registers, no scratch row; f32 on the exact path, int8 activations on
//! the fast path, chosen by `CAPY_EXACT_MATH`), or, for formats without a fused kernel, each
//! row is dequantised into per-worker scratch (bit-identical on every ISA) and dotted in f32.
//! Work is split in phases on the [`ExpertPool`]: (0) tokens are prepared for the gate/up
//! kernels; (1) tasks of (active expert, block of 16 gate/up row pairs) write
//! `h = silu(g) · u` — at batch 1 the ~10 routed experts make ~400 tasks, so all cores stay
//! busy; (1b) each pair's `h` is prepared for the down kernels; (2) tasks of blocks of output
//! rows (16 to 64, about 2.5 tasks a worker) run over every active expert's down rows, in
//! expert order, so each output element has one writer and the result does not depend on the
//! thread count. Phases 1 and 2 are one pool job: a worker that finds no gate/up task left
//! starts on the down rows, and waits only where an expert's `h` is not ready yet; there is no
//! barrier between them, so the last gate/up tasks overlap the first down rows (a barrier and
//! the wait for the slowest task were a fixed cost of every call, measured on the 16-core
//! box).

pub mod bench;
pub mod dot;
pub mod format;
pub mod fused;
pub mod pool;
pub mod timeline;

pub use format::RowFormat;
use fused::Act;
pub use fused::MathPath;
pub use pool::ExpertPool;
pub use timeline::CallTimeline;

use super::ops::silu;
use super::simd::Isa;
use anyhow::{bail, Result};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Expert sizes: `hidden` (H, the model width) and `intermediate` (I).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ExpertShape {
    pub hidden: usize,
    pub intermediate: usize,
}

const HEADER: usize = 64;

/// Byte layout of one expert record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayout {
    /// Format of the gate and up rows.
    pub format: RowFormat,
    /// Format of the down rows (GGUF files fall back to another type when `I` is not a
    /// multiple of the gate/up type's block, e.g. IQ types with `I` = 640).
    pub down_format: RowFormat,
    pub shape: ExpertShape,
    /// Bytes of one gate or up row (`H` weights).
    pub gate_up_row_bytes: usize,
    /// Bytes of one down row (`I` weights).
    pub down_row_bytes: usize,
    pub record_bytes: usize,
}

impl ExpertLayout {
    pub fn new(
        format: RowFormat,
        down_format: RowFormat,
        shape: ExpertShape,
    ) -> Result<ExpertLayout> {
        let gate_up_row_bytes = format.row_bytes(shape.hidden)?;
        let down_row_bytes = down_format.row_bytes(shape.intermediate)?;
        let body = 2 * shape.intermediate * gate_up_row_bytes + shape.hidden * down_row_bytes;
        Ok(ExpertLayout {
            format,
            down_format,
            shape,
            gate_up_row_bytes,
            down_row_bytes,
            record_bytes: (HEADER + body).next_multiple_of(64),
        })
    }

    /// Weight bytes of one expert (without header and padding).
    pub fn weight_bytes(&self) -> usize {
        2 * self.shape.intermediate * self.gate_up_row_bytes
            + self.shape.hidden * self.down_row_bytes
    }
}

/// Which matrix of an expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertMatrix {
    Gate,
    Up,
    Down,
}

/// All routed experts of one layer, in the repacked record layout.
pub struct ExpertSet {
    pub layout: ExpertLayout,
    pub experts: usize,
    data: Vec<u8>,
}

impl ExpertSet {
    /// `experts` records with zero weights and multipliers 1, in huge pages where the OS
    /// gives them ([`huge_pages`](super::huge_pages): a decode step reads experts at random).
    pub fn zeroed(layout: ExpertLayout, experts: usize) -> ExpertSet {
        let mut set = ExpertSet {
            layout,
            experts,
            data: super::huge_pages::zeroed(layout.record_bytes * experts),
        };
        for e in 0..experts {
            set.set_multipliers(e, [1.0; 3]);
        }
        set
    }

    pub fn record(&self, e: usize) -> &[u8] {
        &self.data[e * self.layout.record_bytes..(e + 1) * self.layout.record_bytes]
    }
    pub fn record_mut(&mut self, e: usize) -> &mut [u8] {
        let rb = self.layout.record_bytes;
        &mut self.data[e * rb..(e + 1) * rb]
    }

    /// The per-matrix multipliers (gate, up, down) of expert `e`.
    pub fn multipliers(&self, e: usize) -> [f32; 3] {
        let r = self.record(e);
        std::array::from_fn(|m| f32::from_le_bytes(r[4 * m..4 * m + 4].try_into().unwrap()))
    }
    pub fn set_multipliers(&mut self, e: usize, m: [f32; 3]) {
        let r = self.record_mut(e);
        for (i, v) in m.iter().enumerate() {
            r[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
    }

    fn row_range(&self, m: ExpertMatrix, row: usize) -> std::ops::Range<usize> {
        let l = &self.layout;
        let start = match m {
            ExpertMatrix::Gate => HEADER + 2 * row * l.gate_up_row_bytes,
            ExpertMatrix::Up => HEADER + (2 * row + 1) * l.gate_up_row_bytes,
            ExpertMatrix::Down => {
                HEADER + 2 * l.shape.intermediate * l.gate_up_row_bytes + row * l.down_row_bytes
            }
        };
        let len = if m == ExpertMatrix::Down {
            l.down_row_bytes
        } else {
            l.gate_up_row_bytes
        };
        start..start + len
    }

    /// The stored bytes of one row.
    pub fn row(&self, e: usize, m: ExpertMatrix, row: usize) -> &[u8] {
        &self.record(e)[self.row_range(m, row)]
    }

    /// Sets one row from bytes already in the set's row format.
    pub fn set_row(&mut self, e: usize, m: ExpertMatrix, row: usize, bytes: &[u8]) -> Result<()> {
        let range = self.row_range(m, row);
        if bytes.len() != range.len() {
            bail!(
                "expert {e} {m:?} row {row}: expected {} bytes of {}, found {}",
                range.len(),
                self.layout.format.name(),
                bytes.len()
            );
        }
        self.record_mut(e)[range].copy_from_slice(bytes);
        Ok(())
    }

    /// One matrix of expert `e` dequantised (row-major, multiplier applied), for references.
    pub fn matrix_f32(&self, e: usize, m: ExpertMatrix) -> Vec<f32> {
        let (rows, cols) = match m {
            ExpertMatrix::Down => (self.layout.shape.hidden, self.layout.shape.intermediate),
            _ => (self.layout.shape.intermediate, self.layout.shape.hidden),
        };
        let mult = self.multipliers(e)[m as usize];
        let mut out = vec![0f32; rows * cols];
        for (r, o) in out.chunks_exact_mut(cols).enumerate() {
            let fmt = if m == ExpertMatrix::Down {
                self.layout.down_format
            } else {
                self.layout.format
            };
            format::dequantize_row_scalar(fmt, self.row(e, m, r), o);
            o.iter_mut().for_each(|v| *v *= mult);
        }
        out
    }

    /// Total bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Every record, as one allocation (page-locked as a whole by the hybrid store).
    pub fn as_bytes(&self) -> &[u8] {
        &self.data
    }

    /// Fills every expert with random *valid* blocks (finite scales of a sensible size), as
    /// the bench and the tests need; deterministic in `seed`. Runs on rayon.
    pub fn randomize(&mut self, seed: u64) {
        use rayon::prelude::*;
        let layout = self.layout;
        self.data
            .par_chunks_mut(layout.record_bytes)
            .enumerate()
            .for_each(|(e, rec)| {
                let mut rng = SplitMix(seed ^ (e as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                rng.fill(&mut rec[HEADER..]);
                let split = HEADER + 2 * layout.shape.intermediate * layout.gate_up_row_bytes;
                for b in rec[HEADER..split].chunks_exact_mut(layout.format.block_bytes()) {
                    fix_block(layout.format, b, &mut rng);
                }
                for b in rec[split..HEADER + layout.weight_bytes()]
                    .chunks_exact_mut(layout.down_format.block_bytes())
                {
                    fix_block(layout.down_format, b, &mut rng);
                }
                let m: [f32; 3] = if layout.format == RowFormat::Nvfp4 {
                    std::array::from_fn(|_| 0.01 + 0.01 * rng.unit())
                } else {
                    [1.0; 3]
                };
                for (i, v) in m.iter().enumerate() {
                    rec[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
                }
            });
    }
}

/// A small fast PRNG (SplitMix64) for filling large buffers.
pub(crate) struct SplitMix(pub(crate) u64);
impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let v = self.next().to_le_bytes();
        rest.copy_from_slice(&v[..rest.len()]);
    }
    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// `blocks` random valid blocks of `fmt` (as [`ExpertSet::randomize`] makes them), deterministic
/// in `seed`: weights for tests and benchmarks of other backends.
pub fn random_blocks(fmt: RowFormat, blocks: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix(seed);
    let mut data = vec![0u8; blocks * fmt.block_bytes()];
    rng.fill(&mut data);
    for b in data.chunks_exact_mut(fmt.block_bytes()) {
        fix_block(fmt, b, &mut rng);
    }
    data
}

/// Makes one random block valid: finite scales of a sensible size, no NaN codes.
fn fix_block(fmt: RowFormat, b: &mut [u8], rng: &mut SplitMix) {
    use crate::quant::GgmlType as G;
    let f16_scale = |rng: &mut SplitMix| {
        let sign = if rng.next() & 1 == 0 { 1.0 } else { -1.0 };
        half::f16::from_f32(sign * (1e-3 + 2e-2 * rng.unit()))
            .to_bits()
            .to_le_bytes()
    };
    match fmt {
        RowFormat::Ggml(G::F32) => {
            let v = rng.unit() * 2.0 - 1.0;
            b.copy_from_slice(&v.to_le_bytes());
        }
        RowFormat::Ggml(G::F16) => b.copy_from_slice(
            &half::f16::from_f32(rng.unit() * 2.0 - 1.0)
                .to_bits()
                .to_le_bytes(),
        ),
        RowFormat::Ggml(G::BF16) => b.copy_from_slice(
            &half::bf16::from_f32(rng.unit() * 2.0 - 1.0)
                .to_bits()
                .to_le_bytes(),
        ),
        RowFormat::Ggml(_) => b[0..2].copy_from_slice(&f16_scale(rng)),
        RowFormat::Nvfp4 => {
            for s in &mut b[0..4] {
                // Positive E4M3 with exponent field 1..9.
                *s = ((1 + (rng.next() % 9) as u8) << 3) | (rng.next() & 7) as u8;
            }
        }
        RowFormat::Fp8B128 => {
            b[0..4].copy_from_slice(&(0.005 + 0.01 * rng.unit()).to_le_bytes());
            for q in &mut b[4..] {
                if *q & 0x7f == 0x7f {
                    *q &= 0xf7; // NaN → the largest magnitude below 448.
                }
            }
        }
    }
}

/// Per-call scratch, sized once for the largest batch; reused without allocation.
pub struct MoeScratch {
    max_pairs: usize,
    max_tokens: usize,
    shape: ExpertShape,
    counts: Vec<u32>,
    /// Active experts in increasing id order and where their pairs start in `pairs`.
    active: Vec<u32>,
    active_start: Vec<u32>,
    /// (token, weight) per routed pair, grouped by expert.
    pairs: Vec<(u32, f32)>,
    /// `h` rows, one per pair: `silu(g) · u`, `I` values.
    h: SharedBuf<f32>,
    /// Tokens prepared for the gate/up rows, pairs' `h` prepared for the down rows.
    x_act: ActBufs,
    h_act: ActBufs,
    /// Per-worker dequantisation buffers of `max(H, I)` values (formats without a fused
    /// kernel).
    rows: Vec<SharedBuf<f32>>,
    /// Phase-1 tasks finished per active expert: the worker finishing an expert's last one
    /// prepares its pairs' `h` for the down rows, then marks the expert ready (one more).
    blocks_done: Vec<AtomicUsize>,
    /// Per-worker marks of the last call, when a bench asked for them.
    timeline: Option<CallTimeline>,
}

/// Prepared activation vectors (see [`fused::prepare`]), `k` values each. Every vector starts
/// on a 64-byte boundary (the buffers do, and the strides are whole cache lines), so the
/// kernels' 32- and 64-byte activation loads never straddle two lines.
struct ActBufs {
    k: usize,
    sl: usize,
    /// Strides of `f` (f32 values) and `q` (bytes) between vectors.
    f_stride: usize,
    q_stride: usize,
    f: SharedBuf<f32>,
    q: SharedBuf<i8>,
    s: SharedBuf<f32>,
    sums: SharedBuf<f32>,
}

impl ActBufs {
    fn new(n: usize, k: usize) -> ActBufs {
        let sl = fused::ActSpec::scales_len(k);
        let (f_stride, q_stride) = (k.next_multiple_of(16), k.next_multiple_of(64));
        ActBufs {
            k,
            sl,
            f_stride,
            q_stride,
            f: SharedBuf::new(n * f_stride),
            q: SharedBuf::new(n * q_stride),
            s: SharedBuf::new(n * sl),
            sums: SharedBuf::new(n * sl),
        }
    }
    /// SAFETY: no other live reference to vector `v`.
    unsafe fn prepare(&self, spec: &fused::ActSpec, v: usize, x: &[f32]) {
        let (k, sl, fs, qs) = (self.k, self.sl, self.f_stride, self.q_stride);
        fused::prepare(
            spec,
            x,
            self.f.slice_mut(v * fs..v * fs + k),
            self.q.slice_mut(v * qs..v * qs + k),
            self.s.slice_mut(v * sl..(v + 1) * sl),
            self.sums.slice_mut(v * sl..(v + 1) * sl),
        );
    }
    /// SAFETY: vector `v` is not being written.
    unsafe fn get(&self, v: usize) -> Act<'_> {
        let (k, sl, fs, qs) = (self.k, self.sl, self.f_stride, self.q_stride);
        Act {
            f: self.f.slice(v * fs..v * fs + k),
            q: self.q.slice(v * qs..v * qs + k),
            s: self.s.slice(v * sl..(v + 1) * sl),
            sums: self.sums.slice(v * sl..(v + 1) * sl),
        }
    }
}

/// A buffer written by disjoint ranges from several workers. Element 0 sits on a 64-byte
/// boundary (the allocation has a cache line to spare).
struct SharedBuf<T> {
    data: UnsafeCell<Vec<T>>,
    start: usize,
}
// SAFETY: workers write disjoint ranges (one task owns each range), and a phase's output is
// read only after `ExpertPool::run` has returned (a full barrier) or, for an expert's `h`,
// after its ready mark has been acquired.
unsafe impl<T: Send> Sync for SharedBuf<T> {}
impl<T: Copy + Default> SharedBuf<T> {
    fn new(n: usize) -> Self {
        let size = std::mem::size_of::<T>();
        assert!(
            64 % size == 0,
            "SharedBuf: element size {size} does not divide 64"
        );
        let data = vec![T::default(); n + 64 / size];
        // The allocation is aligned to `size`, so the gap to the next line is whole elements;
        // the Vec is never resized, so the offset stays valid.
        let start = (data.as_ptr() as usize).wrapping_neg() % 64 / size;
        SharedBuf {
            data: UnsafeCell::new(data),
            start,
        }
    }
    #[allow(clippy::mut_from_ref)]
    /// SAFETY: the caller guarantees no other live reference overlaps `range`.
    unsafe fn slice_mut(&self, range: std::ops::Range<usize>) -> &mut [T] {
        let v = &mut *self.data.get();
        &mut v[self.start + range.start..self.start + range.end]
    }
    unsafe fn slice(&self, range: std::ops::Range<usize>) -> &[T] {
        let v = &*self.data.get();
        &v[self.start + range.start..self.start + range.end]
    }
}

impl MoeScratch {
    /// Scratch for up to `max_tokens × top_k` routed pairs over `experts` experts, run by
    /// `workers` workers.
    pub fn new(
        shape: ExpertShape,
        experts: usize,
        max_tokens: usize,
        top_k: usize,
        workers: usize,
    ) -> MoeScratch {
        let max_pairs = max_tokens * top_k;
        MoeScratch {
            max_pairs,
            max_tokens,
            shape,
            counts: vec![0; experts],
            active: Vec::with_capacity(max_pairs),
            active_start: Vec::with_capacity(max_pairs + 1),
            pairs: vec![(0, 0.0); max_pairs],
            h: SharedBuf::new(max_pairs * shape.intermediate),
            x_act: ActBufs::new(max_tokens, shape.hidden),
            h_act: ActBufs::new(max_pairs, shape.intermediate),
            rows: (0..workers)
                .map(|_| SharedBuf::new(shape.hidden.max(shape.intermediate)))
                .collect(),
            blocks_done: (0..max_pairs).map(|_| AtomicUsize::new(0)).collect(),
            timeline: None,
        }
    }

    /// Records where each following call's time goes (see [`timeline`]), or stops.
    pub fn record_timeline(&mut self, on: bool) {
        self.timeline = on.then(|| CallTimeline::new(self.rows.len()));
    }

    /// The last call's marks, if recorded.
    pub fn timeline(&self) -> Option<&CallTimeline> {
        self.timeline.as_ref()
    }
}

/// Gate/up row pairs per phase-1 task (`CAPY_GATE_UP_ROWS` overrides it, to measure), and the
/// most pairs of one expert handed to a kernel at once.
const GATE_UP_ROWS_PER_TASK: usize = 16;
const PAIRS_PER_CHUNK: usize = 32;
/// The most output rows a phase-2 task takes by default; the most rows of either kind of task
/// an override may ask for.
const DOWN_ROWS_DEFAULT_MAX: usize = 64;
const TASK_ROWS_MAX: usize = 128;

/// A task size forced by the environment variable `var`: a multiple of 16 up to
/// [`TASK_ROWS_MAX`]; anything else is ignored. Read once per variable.
fn task_rows_override(var: &'static str, cell: &'static OnceLock<Option<usize>>) -> Option<usize> {
    *cell.get_or_init(|| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&r| r > 0 && r <= TASK_ROWS_MAX && r % 16 == 0)
    })
}

/// Gate/up row pairs per phase-1 task: 16, or `CAPY_GATE_UP_ROWS`.
fn gate_up_rows_per_task() -> usize {
    static FORCED: OnceLock<Option<usize>> = OnceLock::new();
    task_rows_override("CAPY_GATE_UP_ROWS", &FORCED).unwrap_or(GATE_UP_ROWS_PER_TASK)
}

/// Output rows per phase-2 task for `h_dim` rows on `workers` workers: about 2.5 tasks a
/// worker, a multiple of 16 from 16 to 64 (64 for Flash-Next on 16 cores); `CAPY_DOWN_ROWS`
/// overrides it, to measure.
///
/// Why: a task runs over every active expert's rows, and each expert's short run of them (16
/// Q2_0 rows of Flash-Next are 2.9 KB) cost about a microsecond more than its bytes on the
/// 16-core box. There 64-row tasks made top-3 calls 1.28x and top-10 calls 1.14x faster than
/// 16-row ones (`bench/results/cpu-experts-iq3_s-down-rows-timeline-h100box.json`). Fewer,
/// larger tasks would leave workers idle at the end: hence ~2.5 a worker.
fn down_rows_per_task(h_dim: usize, workers: usize) -> usize {
    static FORCED: OnceLock<Option<usize>> = OnceLock::new();
    task_rows_override("CAPY_DOWN_ROWS", &FORCED).unwrap_or_else(|| {
        let per_task = 2 * h_dim / (5 * workers.max(1));
        (per_task / 16 * 16).clamp(16, DOWN_ROWS_DEFAULT_MAX)
    })
}

/// `out[t] += Σ_k weights[t·k] · expert_{ids[t·k]}(x[t])` for `n = x.len() / H` tokens, on
/// the process's math path ([`fused::math_path`]: fast unless `CAPY_EXACT_MATH=1`).
///
/// `ids`/`weights` hold `top_k` entries per token (as `MoeRouting`). `isa` must be supported
/// by the CPU (use [`Isa::detect`]). Allocation-free once `scratch` is sized.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    pool: &ExpertPool,
    isa: Isa,
    set: &ExpertSet,
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    top_k: usize,
    out: &mut [f32],
    scratch: &mut MoeScratch,
) -> Result<()> {
    moe_experts_overlapping(pool, isa, set, x, ids, weights, top_k, out, scratch, || {})
}

/// [`moe_experts`], with the caller's own work `first` (queuing device launches) run on the
/// calling thread while the other workers start on the gate/up rows (phase 1, the first
/// phase that has work for every core); the caller then joins as worker 0
/// ([`ExpertPool::run_after`]). The result is the same as without `first`; `first` runs
/// exactly once when this returns `Ok`; not at all when the arguments are rejected.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_overlapping(
    pool: &ExpertPool,
    isa: Isa,
    set: &ExpertSet,
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    top_k: usize,
    out: &mut [f32],
    scratch: &mut MoeScratch,
    first: impl FnOnce(),
) -> Result<()> {
    moe_experts_on(
        pool,
        isa,
        fused::math_path(),
        set,
        x,
        ids,
        weights,
        top_k,
        out,
        scratch,
        first,
    )
}

/// [`moe_experts`] on an explicit math path.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_with(
    pool: &ExpertPool,
    isa: Isa,
    path: MathPath,
    set: &ExpertSet,
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    top_k: usize,
    out: &mut [f32],
    scratch: &mut MoeScratch,
) -> Result<()> {
    moe_experts_on(
        pool,
        isa,
        path,
        set,
        x,
        ids,
        weights,
        top_k,
        out,
        scratch,
        || {},
    )
}

/// [`moe_experts_overlapping`] on an explicit math path.
#[allow(clippy::too_many_arguments)]
fn moe_experts_on(
    pool: &ExpertPool,
    isa: Isa,
    path: MathPath,
    set: &ExpertSet,
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    top_k: usize,
    out: &mut [f32],
    scratch: &mut MoeScratch,
    first: impl FnOnce(),
) -> Result<()> {
    let ExpertShape {
        hidden: h_dim,
        intermediate: i_dim,
    } = set.layout.shape;
    let n = x.len() / h_dim;
    if x.len() != n * h_dim
        || out.len() != x.len()
        || ids.len() != n * top_k
        || weights.len() != ids.len()
    {
        bail!(
            "moe_experts: x has {} values, out {}, ids {}, weights {}; expected multiples of H = {h_dim} with top_k = {top_k} per token",
            x.len(),
            out.len(),
            ids.len(),
            weights.len()
        );
    }
    if ids.len() > scratch.max_pairs
        || n > scratch.max_tokens
        || scratch.shape != set.layout.shape
        || scratch.rows.len() < pool.threads()
        || scratch.counts.len() < set.experts
    {
        bail!("moe_experts: scratch was sized for {} pairs / {} tokens / shape {:?} / {} workers, called with {} pairs / {n} tokens / {:?} / {} workers", scratch.max_pairs, scratch.max_tokens, scratch.shape, scratch.rows.len(), ids.len(), set.layout.shape, pool.threads());
    }
    if isa > Isa::best_supported() {
        bail!(
            "ISA {} is not supported by this CPU (best: {})",
            isa.name(),
            Isa::best_supported().name()
        );
    }
    if let Some(&bad) = ids.iter().find(|&&e| e as usize >= set.experts) {
        bail!(
            "moe_experts: expert id {bad} out of range (the set has {} experts)",
            set.experts
        );
    }

    if let Some(t) = scratch.timeline.as_mut() {
        t.start();
    }
    // Group pairs by expert (counting sort; expert order fixes the summation order).
    let s = &mut *scratch;
    s.counts.iter_mut().for_each(|c| *c = 0);
    for &e in ids {
        s.counts[e as usize] += 1;
    }
    s.active.clear();
    s.active_start.clear();
    let mut pos = 0u32;
    for (e, c) in s.counts.iter_mut().enumerate() {
        if *c > 0 {
            s.active.push(e as u32);
            s.active_start.push(pos);
            let count = *c;
            *c = pos; // becomes the insertion cursor
            pos += count;
        }
    }
    s.active_start.push(pos);
    for (p, (&e, &w)) in ids.iter().zip(weights).enumerate() {
        let cursor = &mut s.counts[e as usize];
        s.pairs[*cursor as usize] = ((p / top_k) as u32, w);
        *cursor += 1;
    }

    let l = set.layout;
    let gu_spec = fused::ActSpec::new(isa, path, l.format, h_dim);
    let down_spec = fused::ActSpec::new(isa, path, l.down_format, i_dim);
    let (active, active_start, pairs, hbuf, rows) =
        (&s.active, &s.active_start, &s.pairs, &s.h, &s.rows);
    let blocks_done = &s.blocks_done[..active.len()];
    let (x_act, h_act) = (&s.x_act, &s.h_act);
    let timeline = s.timeline.as_ref();
    let empty = Act {
        f: &[],
        q: &[],
        s: &[],
        sums: &[],
    };

    // Phase 0: tokens into the gate/up kernels' activation layout. A decode step's one or
    // two tokens are prepared here: a pool call would idle every other worker and add a
    // barrier.
    if n <= 2 {
        for t in 0..n {
            // SAFETY: no worker runs; token t's vectors have no other reference.
            unsafe { x_act.prepare(&gu_spec, t, &x[t * h_dim..(t + 1) * h_dim]) };
        }
    } else {
        let next = AtomicUsize::new(0);
        pool.run(&|_| loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            if t >= n {
                break;
            }
            // SAFETY: token t's vectors are written by this task only.
            unsafe { x_act.prepare(&gu_spec, t, &x[t * h_dim..(t + 1) * h_dim]) };
        });
    }
    for d in blocks_done {
        d.store(0, Ordering::Relaxed); // published by the pool's start of phase 1
    }

    // Phase 1: h[pair] = silu(gate · x) ⊙ (up · x); tasks are (expert, block of row pairs),
    // so the ~10 experts of a decode step spread over every core. Tasks come from a counter,
    // so the caller's `first` only leaves it fewer of them.
    let gate_up_per_task = gate_up_rows_per_task();
    let blocks_per_expert = i_dim.div_ceil(gate_up_per_task);
    let tasks = active.len() * blocks_per_expert;
    let next = AtomicUsize::new(0);
    // Set when a gate/up task unwinds: its expert never becomes ready, and the down tasks
    // waiting for it must stop (the pool then reports the panic) instead of spinning forever.
    let aborted = AtomicBool::new(false);
    let gu_row = l.gate_up_row_bytes;
    let gate_up_tasks = |worker: usize| {
        let _abort = AbortOnUnwind(&aborted);
        // SAFETY: each worker uses only its own row buffer.
        let scratch_row = unsafe { rows[worker].slice_mut(0..h_dim) };
        let mut acts = [empty; PAIRS_PER_CHUNK];
        let mut res = [0f32; 2 * TASK_ROWS_MAX * PAIRS_PER_CHUNK];
        if let Some(tl) = timeline {
            tl.entered(worker);
        }
        let mut taken = 0;
        loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            if t >= tasks {
                if let Some(tl) = timeline {
                    tl.gate_up_end(worker, taken);
                }
                break;
            }
            taken += 1;
            let (a, blk) = (t / blocks_per_expert, t % blocks_per_expert);
            let e = active[a] as usize;
            let [mg, mu, _] = set.multipliers(e);
            let (p0, p1) = (active_start[a] as usize, active_start[a + 1] as usize);
            let (i0, i1) = (
                blk * gate_up_per_task,
                ((blk + 1) * gate_up_per_task).min(i_dim),
            );
            // Gate and up rows are interleaved: rows 2·i0 .. 2·i1 are contiguous.
            let start = set.row_range(ExpertMatrix::Gate, i0).start;
            let bytes = &set.record(e)[start..start + 2 * (i1 - i0) * gu_row];
            let mut done = 0;
            while done < p1 - p0 {
                let chunk = (p1 - p0 - done).min(PAIRS_PER_CHUNK);
                for (c, act) in acts[..chunk].iter_mut().enumerate() {
                    // SAFETY: phase 0 finished (barrier); token vectors are only read now.
                    *act = unsafe { x_act.get(pairs[p0 + done + c].0 as usize) };
                }
                let r = &mut res[..2 * (i1 - i0) * chunk];
                fused::dots(&gu_spec, bytes, gu_row, &acts[..chunk], r, scratch_row);
                for i in i0..i1 {
                    for c in 0..chunk {
                        let g = r[2 * (i - i0) * chunk + c] * mg;
                        let u = r[(2 * (i - i0) + 1) * chunk + c] * mu;
                        let p = p0 + done + c;
                        // SAFETY: element (p, i) is written by this task only.
                        unsafe {
                            hbuf.slice_mut(p * i_dim + i..p * i_dim + i + 1)[0] = silu(g) * u
                        };
                    }
                }
                done += chunk;
            }
            // Phase 1b: the last task of expert `a` puts its pairs' h into the down kernels'
            // layout, then marks the expert ready. AcqRel: this RMW reads the others'
            // releases, so their h rows are seen; the ready store releases the prepared h.
            if blocks_done[a].fetch_add(1, Ordering::AcqRel) + 1 == blocks_per_expert {
                for p in p0..p1 {
                    // SAFETY: all of expert a's h rows are written; pair p's vectors are
                    // written by this task only, and read only once the expert is ready.
                    unsafe { h_act.prepare(&down_spec, p, hbuf.slice(p * i_dim..(p + 1) * i_dim)) };
                }
                blocks_done[a].store(blocks_per_expert + 1, Ordering::Release);
            }
        }
    };

    // Phase 2: out[token][j] += w · (down_e[j] · h[pair]), experts in id order; tasks are
    // blocks of output rows, so each output element has one writer. A worker comes here only
    // once every gate/up task has been taken, so the experts it waits for are being finished
    // by workers that wait for nothing: no deadlock.
    let down_per_task = down_rows_per_task(h_dim, pool.threads());
    let down_tasks = h_dim.div_ceil(down_per_task);
    let next_down = AtomicUsize::new(0);
    let out_buf = SharedOut(out.as_mut_ptr(), out.len());
    let out_ref = &out_buf;
    let d_row = l.down_row_bytes;
    let wait_ready = |a: usize, worker: usize| {
        // (No rows, no gate/up tasks: nothing to wait for.)
        let ready =
            || blocks_per_expert == 0 || blocks_done[a].load(Ordering::Acquire) > blocks_per_expert;
        if ready() {
            return;
        }
        let start = std::time::Instant::now();
        while !ready() {
            if aborted.load(Ordering::Relaxed) {
                panic!("moe_experts: a gate/up task panicked; the down rows cannot be computed");
            }
            // A few microseconds at most in a decode step; yield if a worker was descheduled.
            if start.elapsed() < std::time::Duration::from_micros(200) {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if let Some(tl) = timeline {
            tl.waited(worker, start.elapsed().as_nanos() as u64);
        }
    };
    let down_rows = |worker: usize| {
        // SAFETY: each worker uses only its own row buffer.
        let scratch_row = unsafe { rows[worker].slice_mut(0..i_dim) };
        let mut acts = [empty; PAIRS_PER_CHUNK];
        let mut res = [0f32; TASK_ROWS_MAX * PAIRS_PER_CHUNK];
        let mut taken = 0;
        loop {
            let t = next_down.fetch_add(1, Ordering::Relaxed);
            if t >= down_tasks {
                if let Some(tl) = timeline {
                    tl.down_end(worker, taken);
                }
                break;
            }
            taken += 1;
            let (j0, j1) = (t * down_per_task, ((t + 1) * down_per_task).min(h_dim));
            let start = set.row_range(ExpertMatrix::Down, j0).start;
            let rows_of = |e: u32| &set.record(e as usize)[start..start + (j1 - j0) * d_row];
            for (a, &e) in active.iter().enumerate() {
                wait_ready(a, worker);
                // Each expert's rows here are a short run (16 Q2_0 rows of Flash-Next: 2.9 KB)
                // in a new place: the next expert's first lines load while this one computes,
                // instead of being waited for at its start.
                if let Some(&next) = active.get(a + 1) {
                    fused::prefetch_start(rows_of(next));
                }
                let e = e as usize;
                let md = set.multipliers(e)[2];
                let (p0, p1) = (active_start[a] as usize, active_start[a + 1] as usize);
                let bytes = rows_of(e as u32);
                let mut done = 0;
                while done < p1 - p0 {
                    let chunk = (p1 - p0 - done).min(PAIRS_PER_CHUNK);
                    for (c, act) in acts[..chunk].iter_mut().enumerate() {
                        // SAFETY: expert a is ready (acquired above); its h vectors are only
                        // read now.
                        *act = unsafe { h_act.get(p0 + done + c) };
                    }
                    let r = &mut res[..(j1 - j0) * chunk];
                    fused::dots(&down_spec, bytes, d_row, &acts[..chunk], r, scratch_row);
                    for j in j0..j1 {
                        for c in 0..chunk {
                            let (tok, w) = pairs[p0 + done + c];
                            let y = r[(j - j0) * chunk + c] * md;
                            // SAFETY: output rows j0..j1 belong to this task only.
                            unsafe { out_ref.add(tok as usize * h_dim + j, w * y) };
                        }
                    }
                    done += chunk;
                }
            }
        }
    };
    if let Some(tl) = timeline {
        tl.mark_published();
    }
    if phase_barrier() {
        pool.run_after(&gate_up_tasks, first);
        pool.run(&down_rows);
    } else {
        pool.run_after(
            &|worker| {
                gate_up_tasks(worker);
                down_rows(worker);
            },
            first,
        );
    }
    if let Some(tl) = timeline {
        tl.mark_returned();
    }
    Ok(())
}

/// Whether the gate/up and down phases run as two pool jobs with a barrier between them
/// (`CAPY_EXPERT_BARRIER=1`), as before they were one job: to measure what the overlap saves
/// on a new machine. Read once.
fn phase_barrier() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("CAPY_EXPERT_BARRIER").is_ok_and(|v| v == "1"))
}

/// Sets the flag if dropped while unwinding (a panicking gate/up task).
struct AbortOnUnwind<'a>(&'a AtomicBool);
impl Drop for AbortOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

struct SharedOut(*mut f32, usize);
// SAFETY: tasks write disjoint output elements (see `moe_experts`).
unsafe impl Sync for SharedOut {}
impl SharedOut {
    unsafe fn add(&self, i: usize, v: f32) {
        assert!(i < self.1);
        *self.0.add(i) += v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;

    /// Every prepared activation vector starts on a 64-byte boundary, whatever `k`, and the
    /// vectors do not overlap.
    #[test]
    fn down_tasks_are_about_two_and_a_half_a_worker_in_whole_16_row_steps() {
        if std::env::var("CAPY_DOWN_ROWS").is_ok() {
            eprintln!("skipping: CAPY_DOWN_ROWS is set");
            return;
        }
        // Flash-Next's 2560 rows: 40 tasks of 64 on 16 workers, 80 of 32 on 32.
        assert_eq!(down_rows_per_task(2560, 16), 64);
        assert_eq!(down_rows_per_task(2560, 32), 32);
        assert_eq!(down_rows_per_task(2560, 64), 16);
        // Capped at 64 with few workers, at least 16 with many or few rows.
        assert_eq!(down_rows_per_task(2560, 2), 64);
        assert_eq!(down_rows_per_task(2560, 128), 16);
        assert_eq!(down_rows_per_task(512, 16), 16);
    }

    #[test]
    fn activation_vectors_start_on_cache_lines() {
        for k in [64, 100, 640, 2560] {
            let bufs = ActBufs::new(3, k);
            let mut ends = (0usize, 0usize);
            for v in 0..3 {
                // SAFETY: nothing writes the buffers.
                let act = unsafe { bufs.get(v) };
                let (f, q) = (act.f.as_ptr() as usize, act.q.as_ptr() as usize);
                assert_eq!(f % 64, 0, "k {k}: f32 vector {v} at {f:#x}");
                assert_eq!(q % 64, 0, "k {k}: int8 vector {v} at {q:#x}");
                assert_eq!((act.f.len(), act.q.len()), (k, k));
                assert!(
                    f >= ends.0 && q >= ends.1,
                    "k {k}: vector {v} overlaps the previous one"
                );
                ends = (f + 4 * k, q + k);
            }
        }
    }

    #[test]
    fn overlapping_gives_the_same_output_and_runs_first_once_on_the_caller() {
        let shape = ExpertShape {
            hidden: 256,
            intermediate: 128,
        };
        let fmt = RowFormat::Ggml(GgmlType::Q8_0);
        let layout = ExpertLayout::new(fmt, fmt, shape).unwrap();
        let (experts, top_k) = (8, 2);
        let mut set = ExpertSet::zeroed(layout, experts);
        set.randomize(5);
        let mut rng = SplitMix(9);
        // One token (phase 0 on the caller) and five (phase 0 on the pool).
        for n in [1, 5] {
            let x: Vec<f32> = (0..n * shape.hidden).map(|_| rng.unit() - 0.5).collect();
            let ids: Vec<u32> = (0..n * top_k)
                .map(|_| (rng.next() % experts as u64) as u32)
                .collect();
            let weights: Vec<f32> = (0..ids.len()).map(|_| rng.unit()).collect();
            for threads in [1, 3] {
                let pool = ExpertPool::new(threads, false);
                let mut scratch = MoeScratch::new(shape, experts, n, top_k, threads);
                let isa = Isa::detect();
                let mut want = vec![0.25f32; x.len()];
                moe_experts(
                    &pool,
                    isa,
                    &set,
                    &x,
                    &ids,
                    &weights,
                    top_k,
                    &mut want,
                    &mut scratch,
                )
                .unwrap();
                let mut got = vec![0.25f32; x.len()];
                let caller = std::thread::current().id();
                let first_runs = AtomicUsize::new(0);
                moe_experts_overlapping(
                    &pool,
                    isa,
                    &set,
                    &x,
                    &ids,
                    &weights,
                    top_k,
                    &mut got,
                    &mut scratch,
                    || {
                        assert_eq!(std::thread::current().id(), caller);
                        std::thread::sleep(std::time::Duration::from_millis(1));
                        first_runs.fetch_add(1, Ordering::Relaxed);
                    },
                )
                .unwrap();
                assert_eq!(first_runs.load(Ordering::Relaxed), 1);
                let same = want
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{n} tokens, {threads} threads: outputs differ");
            }
        }
    }
}
