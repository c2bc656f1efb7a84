//! Flash-Next (`qwen4_exp_text`) ops on the GPU: hyper-connection mixers, the PLE gate, Qwen
//! Sparse Attention (indexer scores, top-k block selection, attention over the selected
//! tokens) and the sparse MoE (routing; routed experts grouped per expert).
//!
//! The CPU reference of each op is in `backend/cpu/{hyper,qsa,moe}.rs`; the kernels are
//! `kernels/{hyper,qsa,moe}.cu`. [`super::CudaBackend`]'s `Backend` impl delegates the
//! Flash-Next trait methods here.
//!
//! - QSA keeps everything on the device: the indexer's block keys are the sequence's state
//!   tensor, the selection is a token list per query that never leaves the GPU, and while every
//!   query's blocks fit the budget it is the dense attention kernel itself (as on the CPU).
//! - MoE routing runs on the GPU; the routing decisions come back to the host (the trait's
//!   [`MoeRouting`] is host data, and expert placement decides on the host where each expert
//!   runs). The routed experts then run on the device: groups of up to 8 rows per expert (decode)
//!   in one grouped-matvec launch for all experts (gate‖up with SwiGLU, then down), larger
//!   groups (prefill) as cuBLAS GEMMs through [`Backend::linear`]; one combine kernel sums each
//!   row's expert outputs with its routing weights in ascending expert order (the CPU's order).
//! - PLE: the n-gram rows are read from the memory-mapped host table by the model and uploaded
//!   as one `[n, heads·dim]` activation (only the rows the tokens hash to); the gate runs here.

use super::{
    blas_sys, ceil_div, grid_1d, grid_quads, CudaBackend, CudaMatrix, CudaTensor, DevBuf,
    GroupedProblem, QuantLayout, WeightType,
};
use crate::backend::cpu::experts::RowFormat;
use crate::backend::{cpu, AttentionShape, Backend, ExpertMatrices, MoeRouting, QsaShape};
use std::ffi::c_void;
use std::sync::atomic::Ordering;

/// Rows per expert up to which the grouped matvec kernels run (`MOE_MAX_ROWS` in moe.cu).
pub const MOE_MATVEC_MAX_ROWS: usize = 8;
/// Output rows a warp of `moe_q_down` takes (`MOE_Q_DOWN_RPW` in moe_quant.cu).
const MOE_Q_DOWN_ROWS_PER_WARP: usize = 1;
/// kernels/moe_quant_decode.cu's gate/up kernel for rows of `cols` weights in format `code`,
/// where it takes them: IQ3_S in raw blocks (not the records repack), whole blocks.
fn decode_gate_up_kernel(code: i32, cols: usize) -> Option<&'static str> {
    (code == super::QF_IQ3_S && cols.is_multiple_of(256)).then_some("moe_dec_gate_up_iq3_s")
}
/// Warps a block of the fast path's grouped decode kernels takes (`MQ8_WARPS` in
/// kernels/moe_quant_decode.cu), and the 8-byte words a lane of each stages (`MQ8_*_STAGE`).
const MQ8_WARPS: usize = 8;
const MQ8_IQ3S_STAGE: usize = 18;
const MQ8_Q2_0_STAGE: usize = 6;
const MQ8_NVFP4_STAGE: usize = 12;
/// Dynamic shared memory a block may take without opting in (the launches do not).
const MQ8_MAX_SMEM: usize = 48 << 10;

/// A launch of one of the fast path's grouped decode expert kernels (kernels/
/// moe_quant_decode.cu, `moe_dec_*_q8`): its name, blocks along x, dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeQ8Launch {
    pub kernel: &'static str,
    pub blocks: usize,
    pub smem: usize,
}

/// Bytes a lane of the fast decode kernels stages in `words` 8-byte registers, for a warp.
fn staged_bytes(words: usize) -> usize {
    8 * 32 * words
}

/// The fast path's gate/up decode kernel for `format` rows of `hidden` weights and `inter`
/// columns, where one takes the shape: IQ3_S (two columns a warp: whole blocks, 2-row runs on
/// 8-byte boundaries, four rows within a lane's staging) or NVFP4 (one column a warp, rows
/// whole multiples of 8 bytes, two rows within the staging).
pub fn decode_q8_gate_up_plan(
    format: RowFormat,
    hidden: usize,
    inter: usize,
) -> Option<DecodeQ8Launch> {
    use crate::quant::GgmlType;
    let (kernel, cols_per_warp, smem, fits) = match format {
        RowFormat::Ggml(GgmlType::Iq3S) => {
            let row = hidden / 256 * 110;
            (
                "moe_dec_gate_up_iq3s_q8",
                2,
                hidden + hidden / 8 + 2048 + MQ8_WARPS * 4 * row,
                hidden.is_multiple_of(256)
                    && inter.is_multiple_of(2)
                    && (2 * row).is_multiple_of(8)
                    && 4 * row <= staged_bytes(MQ8_IQ3S_STAGE),
            )
        }
        RowFormat::Nvfp4 => {
            let row = hidden / 64 * 36;
            (
                "moe_dec_gate_up_nvfp4_q8",
                1,
                hidden + hidden / 8 + 1024 + MQ8_WARPS * 2 * row,
                hidden.is_multiple_of(128) && 2 * row <= staged_bytes(MQ8_NVFP4_STAGE),
            )
        }
        _ => return None,
    };
    (hidden > 0 && inter > 0 && fits && smem <= MQ8_MAX_SMEM).then_some(DecodeQ8Launch {
        kernel,
        blocks: inter.div_ceil(cols_per_warp * MQ8_WARPS),
        smem,
    })
}

/// The fast path's down decode kernel for `hidden` output rows of `inter` weights in
/// `format`, where one takes the shape (Q2_0 or NVFP4: whole 64-weight blocks, whole runs of
/// eight rows within a lane's staging).
pub fn decode_q8_down_plan(
    format: RowFormat,
    hidden: usize,
    inter: usize,
) -> Option<DecodeQ8Launch> {
    use crate::quant::GgmlType;
    // Q2_0 keeps the sums of x per 16 values (inter / 4 bytes), NVFP4 the E4M3 table (1 KiB).
    let (kernel, row, words, tables) = match format {
        RowFormat::Ggml(GgmlType::Q2_0) => (
            "moe_dec_down_q2_0_q8",
            inter / 64 * 18,
            MQ8_Q2_0_STAGE,
            inter / 4,
        ),
        RowFormat::Nvfp4 => (
            "moe_dec_down_nvfp4_q8",
            inter / 64 * 36,
            MQ8_NVFP4_STAGE,
            1024,
        ),
        _ => return None,
    };
    let smem = inter + inter / 8 + tables + MQ8_WARPS * 8 * row;
    (inter > 0
        && hidden.is_multiple_of(8)
        && inter.is_multiple_of(64)
        && 8 * row <= staged_bytes(words)
        && smem <= MQ8_MAX_SMEM)
        .then_some(DecodeQ8Launch {
            kernel,
            blocks: hidden.div_ceil(8 * MQ8_WARPS),
            smem,
        })
}

/// Entries (row, pick) a block of the prefill experts' sorted list holds, weight rows a CTA of
/// their kernels takes, the shared-memory row stride in u32, and the most picks a row the align
/// kernel sorts (kernels/moe_prefill.cu `MP_BM`, `MP_ROWS`, `MP_STRIDE`, `MP_MAX_K`).
const MP_BM: usize = 128;
const MP_ROWS: usize = 128;
const MP_STRIDE: usize = 36;
const MP_MAX_K: usize = 16;
/// Threads of the align kernel's one CTA, and of the expert kernels' CTAs (`MP_WARPS` warps).
const MP_ALIGN_THREADS: usize = 1024;
const MP_THREADS: usize = 256;

/// The launches of prefill's routed experts on the device (kernels/moe_prefill.cu) for `rows`
/// rows routed to `top_k` of `experts` experts of `hidden` × `inter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoePrefillPlan {
    /// Blocks of `MP_BM` sorted entries the routing can make at most: every expert's run is
    /// padded to whole blocks, so at most one partial block per hit expert beyond
    /// entries / `MP_BM` (the grids' y; CTAs past the routing's count return at once).
    pub max_blocks: usize,
    /// CTAs along x of `moe_prefill_gate_up` (`MP_ROWS / 2` intermediate columns each) and of
    /// `moe_prefill_down` (`MP_ROWS` output rows each).
    pub gate_up_blocks: usize,
    pub down_blocks: usize,
    /// Input buffers of either (`xbufs`): [`moe_prefill_input_buffers`].
    pub input_buffers: usize,
    /// Dynamic shared memory of either (weights of a k-step, inputs of `input_buffers`, the
    /// block's entries: `MP_SMEM_BYTES(xbufs)`, past the 48 KiB default, so the kernels opt in
    /// at load).
    pub smem: usize,
}

/// Shared memory an SM of sm_86, sm_89 and sm_120 holds (the consumer cards).
const CONSUMER_SM_SMEM: usize = 100 * 1024;

/// Shared memory the prefill expert kernels take a CTA with `input_buffers` input buffers
/// (kernels/moe_prefill.cu `MP_SMEM_BYTES`).
fn moe_prefill_smem(input_buffers: usize) -> usize {
    (MP_ROWS + input_buffers * MP_BM) * MP_STRIDE * 4 + MP_BM * 4
}

/// Input buffers the prefill expert kernels take on an SM of `smem_per_sm` bytes of shared
/// memory: two (the next k-step's inputs in flight during this one's products) where two such
/// CTAs fit, as on sm_90; else one, so that two CTAs still share the SM (sm_86, sm_89, sm_120,
/// ~100 KiB), one staging while the other multiplies.
pub fn moe_prefill_input_buffers(smem_per_sm: usize) -> usize {
    // The driver reserves 1 KiB of an SM's shared memory for each resident CTA.
    if 2 * (moe_prefill_smem(2) + 1024) <= smem_per_sm {
        2
    } else {
        1
    }
}

pub fn moe_prefill_plan(
    rows: usize,
    top_k: usize,
    experts: usize,
    hidden: usize,
    inter: usize,
    smem_per_sm: usize,
) -> MoePrefillPlan {
    let entries = rows * top_k;
    let input_buffers = moe_prefill_input_buffers(smem_per_sm);
    MoePrefillPlan {
        max_blocks: entries.div_ceil(MP_BM) + experts.min(entries),
        gate_up_blocks: inter.div_ceil(MP_ROWS / 2),
        down_blocks: hidden.div_ceil(MP_ROWS),
        input_buffers,
        smem: moe_prefill_smem(input_buffers),
    }
}

/// Queries and key blocks a `qsa_block_scores` CTA scores (kernels/qsa.cu `QSA_TQ`, `QSA_TB`).
const QSA_SCORE_QUERIES: usize = 32;
const QSA_SCORE_BLOCKS: usize = 64;

/// QSA splits each query's token list into parts of this many tokens (as the dense decode
/// kernel splits the KV length).
const QSA_SPLIT: usize = 128;
/// Bytes of per-chunk QSA scratch (scores, token lists, partial outputs): query rows are
/// processed in chunks that fit.
const QSA_SCRATCH_BYTES: usize = 256 << 20;
/// The largest head dimension the QSA attention kernel takes (`QSA_MAX_D`).
const QSA_MAX_D: usize = 256;
/// The most routed experts per token the routing kernel takes.
const MOE_MAX_TOP_K: usize = 64;
/// The most experts the routing kernel takes: 32 lanes × `MOE_ROUTE_PER_LANE` (moe.cu).
const MOE_ROUTE_MAX_EXPERTS: usize = 32 * 32;
/// Picks the device routing takes a row (kernels/moe.cu `MOE_DEVICE_MAX_K`).
const MOE_DEVICE_MAX_K: usize = 64;

/// What a layer's routed experts are, for the grouped kernels: their shared intermediate
/// size and dtype, one quantized format for every gate_up and one for every down (`quant`),
/// or all dense of one dtype (`dense`); experts of mixed kinds take the per-expert path.
struct ExpertKinds {
    inter: usize,
    dtype: WeightType,
    quant: Option<(QuantLayout, QuantLayout)>,
    dense: bool,
    /// Every expert's matrices start on 8-byte boundaries (the fast decode kernels' staging
    /// loads need it).
    aligned8: bool,
}

impl ExpertKinds {
    /// Checks every expert's shapes against the first's (panics naming the odd one).
    fn of(experts: &[ExpertMatrices<CudaMatrix>], hidden: usize) -> Self {
        let first = experts.first().expect("moe_experts: no experts");
        let inter = first.gate_up.rows / 2;
        let dtype = first.gate_up.dtype;
        for (e, ex) in experts.iter().enumerate() {
            assert!(
                ex.gate_up.rows == 2 * inter
                    && ex.gate_up.cols == hidden
                    && ex.down.rows == hidden
                    && ex.down.cols == inter,
                "moe_experts: expert {e} has gate_up [{}, {}] and down [{}, {}]; expected [{}, {hidden}] and [{hidden}, {inter}]",
                ex.gate_up.rows,
                ex.gate_up.cols,
                ex.down.rows,
                ex.down.cols,
                2 * inter
            );
        }
        // Quantized experts of one gate_up and one down format (the hybrid cache's copies):
        // the grouped kernels of moe_quant.cu, 6 u64 per group (pointers, slots, multipliers).
        let quant = match (first.gate_up.quant, first.down.quant) {
            (Some(gq), Some(dq)) if hidden.is_multiple_of(8) && inter.is_multiple_of(8) => experts
                .iter()
                .all(|e| {
                    e.gate_up
                        .quant
                        .is_some_and(|q| q.code == gq.code && q.row_bytes == gq.row_bytes)
                        && e.down
                            .quant
                            .is_some_and(|q| q.code == dq.code && q.row_bytes == dq.row_bytes)
                })
                .then_some((gq, dq)),
            _ => None,
        };
        // The grouped kernels read dense rows: quantized experts of mixed formats go through
        // `linear`, which dequantizes in the matvec.
        let dense = experts.iter().all(|e| {
            e.gate_up.dtype == dtype
                && e.down.dtype == dtype
                && e.gate_up.quant.is_none()
                && e.down.quant.is_none()
        });
        let aligned8 = experts
            .iter()
            .all(|e| e.gate_up.buf.ptr.is_multiple_of(8) && e.down.buf.ptr.is_multiple_of(8));
        ExpertKinds {
            inter,
            dtype,
            quant,
            dense,
            aligned8,
        }
    }

    /// Whether the grouped decode kernels take these experts.
    fn grouped(&self) -> bool {
        self.quant.is_some() || self.dense
    }

    /// u64 a group entry holds: 6 for quantized experts (with the two multipliers), 4 dense.
    fn group_len(&self) -> usize {
        if self.quant.is_some() {
            6
        } else {
            4
        }
    }

    /// One group's entry: the expert's gate_up and down pointers, its first slot and row
    /// count, and (quantized) the two matrices' multipliers as f32 bits.
    /// A fixed-size array and its used length: no allocation per expert (the device routing
    /// checks its cached table against every expert at every call).
    fn group(
        &self,
        ex: &ExpertMatrices<CudaMatrix>,
        first_slot: usize,
        rows: usize,
    ) -> ([u64; 6], usize) {
        let mult = |q: Option<QuantLayout>| q.map_or(0, |q| q.multiplier.to_bits()) as u64;
        let words = [
            ex.gate_up.buf.ptr,
            ex.down.buf.ptr,
            first_slot as u64,
            rows as u64,
            mult(ex.gate_up.quant),
            mult(ex.down.quant),
        ];
        (words, self.group_len())
    }
}

/// Kernel arguments: each expression is copied into a local and passed by address.
macro_rules! launch {
    ($self:expr, $name:expr, $grid:expr, $block:expr, $smem:expr; $($arg:expr),* $(,)?) => {{
        #[allow(unused_mut)]
        let mut storage: Vec<Box<dyn std::any::Any>> = Vec::new();
        let mut params: Vec<*mut c_void> = Vec::new();
        $(
            let boxed = Box::new($arg);
            params.push(&*boxed as *const _ as *mut c_void);
            storage.push(boxed);
        )*
        $self.launch_raw($name, $grid, $block, $smem, &mut params);
        drop(storage);
    }};
}

/// The Flash-Next kernel files: (name, source, entry points), for `kernels::sources`.
pub(super) fn kernel_files() -> Vec<(&'static str, &'static str, Vec<String>)> {
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        (
            "hyper",
            include_str!("../../../../../kernels/hyper.cu"),
            names(&[
                "scale_cols",
                "silu_scaled",
                "hc_mix",
                "hc_inject",
                "ple_gate",
            ]),
        ),
        (
            "qsa",
            include_str!("../../../../../kernels/qsa.cu"),
            names(&[
                "mean_pool_rows",
                "qsa_block_scores",
                "qsa_block_scores_rows",
                "qsa_select",
                "qsa_attn_split",
                "qsa_token_mask",
            ]),
        ),
        (
            "moe",
            include_str!("../../../../../kernels/moe.cu"),
            names(&[
                "moe_route",
                "moe_gate_up",
                "moe_down",
                "moe_gather_rows",
                "moe_gather_rows_bf16",
                "moe_swiglu_halves",
                "moe_swiglu_pairs",
                "moe_swiglu_bf16",
                "moe_combine",
                "moe_shared_gate",
                "moe_route_groups",
            ]),
        ),
    ]
}

/// Device scratch of one QSA chunk.
struct QsaScratch {
    scores: DevBuf,
    tokens: DevBuf,
    counts: DevBuf,
    rows: usize,
    stride: usize,
    cap: usize,
}

impl CudaBackend {
    /// Copies `len` values of `T` from the device to a new host vector (waits for the stream).
    fn download<T: Copy + Default>(&self, ptr: u64, len: usize) -> Vec<T> {
        let mut out = vec![T::default(); len];
        self.dtoh(&mut out, ptr);
        out
    }

    pub(super) fn fn_scale_cols(&self, x: &CudaTensor, scale: &CudaTensor) -> CudaTensor {
        assert_eq!(
            scale.len(),
            x.cols,
            "scale_cols: {} scales for {} columns",
            scale.len(),
            x.cols
        );
        let out = self.alloc_act(x.rows, x.cols, x.rows);
        let n = x.len();
        if n > 0 {
            launch!(self, "scale_cols", grid_1d(n), (256, 1, 1), 0;
                x.ptr(), scale.ptr(), out.ptr(), n as u64, x.cols as i32);
        }
        out
    }

    pub(super) fn fn_silu_scaled(&self, x: &CudaTensor, scale: f32) -> CudaTensor {
        self.fn_silu_scaled_cols(x, 0..x.cols, scale)
    }

    pub(super) fn fn_silu_scaled_cols(
        &self,
        x: &CudaTensor,
        cols: std::ops::Range<usize>,
        scale: f32,
    ) -> CudaTensor {
        assert!(
            cols.start <= cols.end && cols.end <= x.cols,
            "silu_scaled_cols: columns {cols:?} of a [{}, {}] tensor",
            x.rows,
            x.cols
        );
        let width = cols.end - cols.start;
        let out = self.alloc_act(x.rows, width, x.rows);
        let n = x.rows * width;
        if n > 0 {
            launch!(self, "silu_scaled", grid_1d(n), (256, 1, 1), 0;
                x.ptr(), out.ptr(), x.rows as u64, width as i32, x.cols as i32, cols.start as i32, scale);
        }
        out
    }

    pub(super) fn fn_hc_mix(
        &self,
        normed: &CudaTensor,
        mix: &CudaTensor,
        streams: usize,
    ) -> CudaTensor {
        assert!(
            streams > 0 && normed.cols.is_multiple_of(streams),
            "hc_mix: {} columns are not {streams} streams",
            normed.cols
        );
        assert_eq!(
            (mix.rows, mix.cols),
            (normed.rows, normed.cols),
            "hc_mix: mix logits [{}, {}] for streams [{}, {}]",
            mix.rows,
            mix.cols,
            normed.rows,
            normed.cols
        );
        let h = normed.cols / streams;
        let out = self.alloc_act(normed.rows, h, normed.rows);
        let n = normed.rows * h;
        if n > 0 {
            let grid = grid_quads(n, h, &[normed.ptr(), mix.ptr(), out.ptr()]);
            launch!(self, "hc_mix", grid, (256, 1, 1), 0;
                normed.ptr(), mix.ptr(), out.ptr(), normed.rows as u64, h as i32, streams as i32);
        }
        out
    }

    pub(super) fn fn_hc_inject(
        &self,
        residual: &CudaTensor,
        out: &CudaTensor,
        inject_logits: &CudaTensor,
        streams: usize,
    ) -> CudaTensor {
        assert_eq!(
            inject_logits.cols, streams,
            "hc_inject: injection logits [{}, {}], expected {streams} columns",
            inject_logits.rows, inject_logits.cols
        );
        self.fn_hc_inject_cols(residual, out, inject_logits, 0, streams)
    }

    pub(super) fn fn_hc_inject_cols(
        &self,
        residual: &CudaTensor,
        out: &CudaTensor,
        logits: &CudaTensor,
        first_col: usize,
        streams: usize,
    ) -> CudaTensor {
        assert!(streams > 0 && residual.cols.is_multiple_of(streams));
        let h = residual.cols / streams;
        assert_eq!(
            (out.rows, out.cols),
            (residual.rows, h),
            "hc_inject: block output [{}, {}] for {} rows of {streams} streams × {h}",
            out.rows,
            out.cols,
            residual.rows
        );
        assert!(
            logits.rows == residual.rows && first_col + streams <= logits.cols,
            "hc_inject: injection logits at columns {first_col}..{} of [{}, {}], for {} rows",
            first_col + streams,
            logits.rows,
            logits.cols,
            residual.rows
        );
        let res = self.alloc_act(residual.rows, residual.cols, residual.rows);
        let n = residual.len();
        if n > 0 {
            let grid = grid_quads(n, h, &[residual.ptr(), out.ptr(), res.ptr()]);
            launch!(self, "hc_inject", grid, (256, 1, 1), 0;
                residual.ptr(), out.ptr(), logits.ptr(), res.ptr(), residual.rows as u64,
                h as i32, streams as i32, logits.cols as i32, first_col as i32);
        }
        res
    }

    pub(super) fn fn_ple_gate(
        &self,
        key: &CudaTensor,
        query: &CudaTensor,
        value: &CudaTensor,
        streams: usize,
    ) -> CudaTensor {
        assert!(streams > 0 && key.cols.is_multiple_of(streams));
        let h = key.cols / streams;
        assert_eq!(
            (query.rows, query.cols),
            (key.rows, key.cols),
            "ple_gate: query and key shapes differ"
        );
        assert_eq!(
            (value.rows, value.cols),
            (key.rows, h),
            "ple_gate: value [{}, {}], expected [{}, {h}]",
            value.rows,
            value.cols,
            key.rows
        );
        let out = self.alloc_act(key.rows, key.cols, key.rows);
        let blocks = key.rows * streams;
        if blocks > 0 && h > 0 {
            let mut at = 0;
            // One block per (row, stream); the grid's x dimension takes at most 2³¹ − 1 blocks.
            while at < blocks {
                let count = (blocks - at).min(1 << 30);
                let rows_done = at / streams;
                launch!(self, "ple_gate", (count as u32, 1, 1), (256, 1, 1), 0;
                    key.row_ptr(rows_done), query.row_ptr(rows_done), value.row_ptr(rows_done),
                    out.row_ptr(rows_done), h as i32, streams as i32);
                at += count;
            }
        }
        out
    }

    pub(super) fn fn_sigmoid_gate_rows(
        &self,
        x: &CudaTensor,
        logits: &CudaTensor,
        col: usize,
    ) -> CudaTensor {
        assert!(
            logits.rows == x.rows && col < logits.cols,
            "sigmoid_gate_rows: x has {} rows, the logits [{}, {}] and column {col} is asked for",
            x.rows,
            logits.rows,
            logits.cols
        );
        let out = self.alloc_act(x.rows, x.cols, x.rows);
        let n = x.rows * x.cols;
        if n > 0 {
            launch!(self, "moe_shared_gate", grid_1d(n), (256, 1, 1), 0;
                x.ptr(), logits.ptr(), out.ptr(), x.rows as u64, x.cols as i32, logits.cols as i32, col as i32);
        }
        out
    }

    pub(super) fn fn_mean_pool_rows(&self, x: &CudaTensor, group: usize) -> CudaTensor {
        assert!(group > 0, "mean_pool_rows: group of 0 rows");
        let blocks = x.rows / group;
        let out = self.alloc_act(blocks, x.cols, blocks);
        let n = blocks * x.cols;
        if n > 0 {
            launch!(self, "mean_pool_rows", grid_1d(n), (256, 1, 1), 0;
                x.ptr(), out.ptr(), blocks as u64, x.cols as i32, group as i32);
        }
        out
    }

    /// Scores and selects (kernels 1 and 2 of qsa.cu) for query rows `r0 .. r0 + rows`.
    #[allow(clippy::too_many_arguments)]
    fn qsa_select_chunk(
        &self,
        index_q: &CudaTensor,
        block_keys: &CudaTensor,
        r0: usize,
        rows: usize,
        past: usize,
        qsa: QsaShape,
        scratch: &QsaScratch,
    ) {
        let p0 = past + r0;
        if rows < QSA_SCORE_QUERIES / 4 {
            // A few queries (decode): a warp a (query, block), not tiles of 32 queries.
            launch!(self, "qsa_block_scores_rows", (ceil_div(scratch.stride, 8) as u32, rows as u32, 1), (256, 1, 1), 0;
                index_q.row_ptr(r0), block_keys.ptr(), scratch.scores.ptr, p0 as i32, qsa.index_heads as i32,
                qsa.index_head_dim as i32, qsa.compress_ratio as i32, scratch.stride as i32);
        } else {
            let grid = (
                ceil_div(scratch.stride, QSA_SCORE_BLOCKS) as u32,
                ceil_div(rows, QSA_SCORE_QUERIES) as u32,
                1,
            );
            launch!(self, "qsa_block_scores", grid, (128, 1, 1), 0;
                index_q.row_ptr(r0), block_keys.ptr(), scratch.scores.ptr, rows as i32, p0 as i32,
                qsa.index_heads as i32, qsa.index_head_dim as i32, qsa.compress_ratio as i32,
                scratch.stride as i32);
        }
        launch!(self, "qsa_select", (rows as u32, 1, 1), (256, 1, 1), 0;
            scratch.scores.ptr, scratch.tokens.ptr, scratch.counts.ptr, p0 as i32, qsa.block_topk as i32,
            qsa.compress_ratio as i32, scratch.stride as i32, scratch.cap as i32);
    }

    fn qsa_check(
        &self,
        n: usize,
        index_q: &CudaTensor,
        block_keys: &CudaTensor,
        past: usize,
        qsa: QsaShape,
    ) {
        assert!(
            qsa.compress_ratio > 0 && qsa.block_topk > 0,
            "qsa: compress ratio {} and block top-k {} must be positive",
            qsa.compress_ratio,
            qsa.block_topk
        );
        assert_eq!(
            (index_q.rows, index_q.cols),
            (n, qsa.index_heads * qsa.index_head_dim),
            "qsa: indexer queries [{}, {}], expected [{n}, {}]",
            index_q.rows,
            index_q.cols,
            qsa.index_heads * qsa.index_head_dim
        );
        assert_eq!(
            block_keys.cols, qsa.index_head_dim,
            "qsa: block keys have {} columns, expected {}",
            block_keys.cols, qsa.index_head_dim
        );
        let complete = (past + n) / qsa.compress_ratio;
        assert!(
            block_keys.rows >= complete,
            "qsa: {} block keys for {complete} complete blocks",
            block_keys.rows
        );
    }

    fn qsa_scratch(&self, rows: usize, stride: usize, cap: usize) -> QsaScratch {
        QsaScratch {
            scores: self.alloc(rows * stride.max(1) * 4, "QSA block scores"),
            tokens: self.alloc(rows * cap * 4, "QSA token lists"),
            counts: self.alloc(rows * 4, "QSA token counts"),
            rows,
            stride: stride.max(1),
            cap,
        }
    }

    /// The tokens each query of `index_q` (at positions `past ..`) attends to, chosen on the GPU
    /// exactly as [`Backend::qsa_attention`] chooses them: per row `None` while its blocks fit
    /// the budget (all tokens), else the positions, ascending. The same contract as
    /// `cpu::qsa::select_tokens`, so tests can hold the two selections together.
    pub fn qsa_token_lists(
        &self,
        index_q: &CudaTensor,
        block_keys: &CudaTensor,
        past: usize,
        qsa: QsaShape,
    ) -> Vec<Option<Vec<usize>>> {
        let n = index_q.rows;
        self.qsa_check(n, index_q, block_keys, past, qsa);
        if n == 0 {
            return vec![];
        }
        let stride = (past + n) / qsa.compress_ratio;
        let cap = (qsa.block_topk + 1) * qsa.compress_ratio;
        let scratch = self.qsa_scratch(n, stride, cap);
        self.qsa_select_chunk(index_q, block_keys, 0, n, past, qsa, &scratch);
        let tokens: Vec<i32> = self.download(scratch.tokens.ptr, n * cap);
        let counts: Vec<i32> = self.download(scratch.counts.ptr, n);
        (0..n)
            .map(|i| {
                let complete = (past + i + 1) / qsa.compress_ratio;
                if complete <= qsa.block_topk {
                    None
                } else {
                    Some(
                        tokens[i * cap..i * cap + counts[i] as usize]
                            .iter()
                            .map(|&t| t as usize)
                            .collect(),
                    )
                }
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn fn_qsa_attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        index_q: &CudaTensor,
        block_keys: &CudaTensor,
        past: usize,
        s: AttentionShape,
        qsa: QsaShape,
    ) -> CudaTensor {
        let n = q.rows;
        self.qsa_check(n, index_q, block_keys, past, qsa);
        let complete = (past + n) / qsa.compress_ratio;
        if n == 0 || complete <= qsa.block_topk {
            // Every query sees all its tokens: exactly dense attention.
            return self.attention(q, k, v, past, s);
        }
        assert_eq!(q.cols, s.num_heads * s.head_dim, "qsa: query columns");
        assert_eq!(k.cols, s.num_kv_heads * s.head_dim, "qsa: key columns");
        assert_eq!(
            k.rows,
            past + n,
            "qsa_attention: cache has {} rows, expected {}",
            k.rows,
            past + n
        );
        assert_eq!((v.rows, v.cols), (k.rows, k.cols), "qsa: value cache shape");
        assert!(
            s.head_dim <= QSA_MAX_D,
            "qsa: head_dim {} is above the kernel's {QSA_MAX_D}",
            s.head_dim
        );
        let out = self.alloc_act(n, q.cols, n);
        let cap = (qsa.block_topk + 1) * qsa.compress_ratio;
        if n >= super::ATTENTION_GEMM_MIN_ROWS {
            // Prefill: the token lists as a block mask, then the dense GEMM attention with it
            // (tensor cores). Attending each query's list on CUDA cores (below) took 1.1 s of
            // a 2.0 s Flash-Next 8K prefill on an H100: every query gathered its ~2K tokens'
            // rows one head at a time.
            let words = ceil_div(ceil_div(past + n, qsa.compress_ratio) + 1, 32);
            let per_row = 4 * (complete + cap + 1);
            let chunk = (QSA_SCRATCH_BYTES / per_row).clamp(1, n.min(65535));
            let scratch = self.qsa_scratch(chunk, complete, cap);
            let mask = self.alloc(n * words * 4, "QSA token mask");
            for r0 in (0..n).step_by(chunk) {
                let rows = chunk.min(n - r0);
                self.qsa_select_chunk(index_q, block_keys, r0, rows, past, qsa, &scratch);
                launch!(self, "qsa_token_mask", (rows as u32, 1, 1), (256, 1, 1), (words * 4) as u32;
                    scratch.tokens.ptr, scratch.counts.ptr, mask.ptr + (r0 * words * 4) as u64,
                    cap as i32, qsa.compress_ratio as i32, words as i32);
            }
            let plan = super::AttentionGemmPlan::choose(n, past + n, s);
            let token_mask = super::TokenMask {
                ptr: mask.ptr,
                words,
                ratio: qsa.compress_ratio,
            };
            self.attention_gemm_with(q, k, v, past, s, &out, plan, Some(token_mask));
            return out;
        }
        let splits = ceil_div(cap, QSA_SPLIT);
        let stride = complete;
        let per_row = 4 * (stride + cap + 1 + s.num_heads * splits * (s.head_dim + 2));
        let chunk = (QSA_SCRATCH_BYTES / per_row).clamp(1, n.min(65535));
        let scratch = self.qsa_scratch(chunk, stride, cap);
        let part_o = self.alloc(
            chunk * s.num_heads * splits * s.head_dim * 4,
            "QSA attention partials",
        );
        let part_ml = self.alloc(
            chunk * s.num_heads * splits * 2 * 4,
            "QSA attention partials",
        );
        for r0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - r0);
            debug_assert!(rows <= scratch.rows);
            self.qsa_select_chunk(index_q, block_keys, r0, rows, past, qsa, &scratch);
            launch!(self, "qsa_attn_split", (s.num_heads as u32, splits as u32, rows as u32), (128, 1, 1), 0;
                q.row_ptr(r0), k.ptr(), v.ptr(), scratch.tokens.ptr, scratch.counts.ptr, part_o.ptr, part_ml.ptr,
                s.num_heads as i32, s.num_kv_heads as i32, s.head_dim as i32, s.scale, QSA_SPLIT as i32, cap as i32);
            launch!(self, "attn_combine", (s.num_heads as u32, rows as u32, 1), (256, 1, 1), 0;
                part_o.ptr, part_ml.ptr, out.row_ptr(r0), s.num_heads as i32, s.head_dim as i32, splits as i32,
                0u64, 0u64, 0u64);
        }
        out
    }

    pub(super) fn fn_moe_route(
        &self,
        logits: &CudaTensor,
        top_k: usize,
        normalize: bool,
    ) -> MoeRouting {
        let (n, experts) = (logits.rows, logits.cols);
        assert!(
            top_k >= 1 && top_k <= experts,
            "moe: top_k {top_k} with {experts} experts"
        );
        assert!(
            top_k <= MOE_MAX_TOP_K,
            "moe: top_k {top_k} is above the routing kernel's {MOE_MAX_TOP_K}"
        );
        assert!(
            experts <= MOE_ROUTE_MAX_EXPERTS,
            "moe: {experts} experts are above the routing kernel's {MOE_ROUTE_MAX_EXPERTS}"
        );
        if n == 0 {
            return MoeRouting {
                top_k,
                experts: vec![],
                weights: vec![],
            };
        }
        let out = self.alloc(n * top_k * 8, "MoE routing");
        let weights_ptr = out.ptr + (n * top_k * 4) as u64;
        launch!(self, "moe_route", (n as u32, 1, 1), (256, 1, 1), (experts * 4) as u32;
            logits.ptr(), out.ptr, weights_ptr, experts as i32, top_k as i32, normalize as i32, experts as i32);
        let host: Vec<u32> = self.download(out.ptr, 2 * n * top_k);
        let (ids, weights) = host.split_at(n * top_k);
        MoeRouting {
            top_k,
            experts: ids.to_vec(),
            weights: weights.iter().map(|&b| f32::from_bits(b)).collect(),
        }
    }

    /// Launches the grouped expert kernels on `groups` (device pointer, count, whether every
    /// group has one row; entries of `kinds.group_len()` u64) into `ys` [slots, hidden]:
    /// quantized experts through moe_quant.cu, dense ones through moe.cu.
    #[allow(clippy::too_many_arguments)]
    fn launch_expert_groups(
        &self,
        kinds: &ExpertKinds,
        (groups, count, one_row): (u64, usize, bool),
        rows_ptr: u64,
        x: &CudaTensor,
        slots: usize,
        interleaved: bool,
        ys: u64,
    ) {
        let (hidden, inter) = (x.cols, kinds.inter);
        let act = self.alloc(slots * inter * 4, "MoE expert activations");
        let warps = 8usize;
        match kinds.quant {
            Some((gq, dq)) => {
                let gate_up_grid = (ceil_div(inter, warps) as u32, count as u32, 1);
                let block = (32 * warps as u32, 1, 1);
                // Every group one row (a decode step): IQ3_S, Q2_0 and NVFP4 rows have kernels of
                // their own (moe_quant_decode.cu) with int8 activations on the fast path; when
                // exact, IQ3_S gate/up rows an f32 one; other formats the one-row kernels, with
                // fewer registers than the several-row ones.
                let decode = one_row && self.inner.moe_decode_kernels;
                let fast =
                    decode && self.inner.moe_decode_q8 && !self.inner.exact && kinds.aligned8;
                // The raw block format of rows of `cols` weights coded `code`, `row_bytes` long.
                let raw = |code: i32, cols: usize, row_bytes: usize| {
                    use crate::quant::GgmlType::{Iq3S, Q2_0};
                    [
                        RowFormat::Ggml(Iq3S),
                        RowFormat::Ggml(Q2_0),
                        RowFormat::Nvfp4,
                    ]
                    .into_iter()
                    .find(|&f| {
                        super::quant_code(f) == Some(code)
                            && f.row_bytes(cols).ok() == Some(row_bytes)
                    })
                    .filter(|_| fast)
                };
                let q8_gate_up = raw(gq.code, hidden, gq.row_bytes)
                    .and_then(|f| decode_q8_gate_up_plan(f, hidden, inter));
                let q8_down = raw(dq.code, inter, dq.row_bytes)
                    .and_then(|f| decode_q8_down_plan(f, hidden, inter));
                match (
                    q8_gate_up,
                    decode_gate_up_kernel(gq.code, hidden).filter(|_| decode),
                ) {
                    (Some(l), _) => {
                        launch!(self, l.kernel, (l.blocks as u32, count as u32, 1), block, l.smem as u32;
                        groups, rows_ptr, x.ptr(), act.ptr, hidden as i32, inter as i32,
                        gq.row_bytes as u64, interleaved as i32)
                    }
                    (None, Some(name)) => launch!(self, name, gate_up_grid, block, 0;
                        groups, rows_ptr, x.ptr(), act.ptr, hidden as i32, inter as i32,
                        gq.row_bytes as u64, interleaved as i32),
                    (None, None) => {
                        launch!(self, if one_row { "moe_q_gate_up_1" } else { "moe_q_gate_up" }, gate_up_grid, block, 0;
                        groups, rows_ptr, x.ptr(), act.ptr, gq.code, hidden as i32, inter as i32,
                        gq.row_bytes as u64, interleaved as i32)
                    }
                }
                if let Some(l) = q8_down {
                    launch!(self, l.kernel, (l.blocks as u32, count as u32, 1), block, l.smem as u32;
                        groups, act.ptr, ys, hidden as i32, inter as i32, dq.row_bytes as u64);
                    return;
                }
                let down = if one_row {
                    "moe_q_down_1"
                } else {
                    "moe_q_down"
                };
                launch!(self, down, (ceil_div(hidden, warps * MOE_Q_DOWN_ROWS_PER_WARP) as u32, count as u32, 1), block, 0;
                    groups, act.ptr, ys, dq.code, hidden as i32, inter as i32, dq.row_bytes as u64);
            }
            None => {
                launch!(self, "moe_gate_up", (ceil_div(inter, warps) as u32, count as u32, 1), (32 * warps as u32, 1, 1), 0;
                    groups, rows_ptr, x.ptr(), act.ptr, kinds.dtype as i32, hidden as i32, inter as i32,
                    interleaved as i32);
                launch!(self, "moe_down", (ceil_div(hidden, warps) as u32, count as u32, 1), (32 * warps as u32, 1, 1), 0;
                    groups, act.ptr, ys, kinds.dtype as i32, hidden as i32, inter as i32);
            }
        }
    }

    /// Backend::moe_routed_on_device: one decode row, experts of one kind the grouped kernels
    /// take (all quantized alike, or all dense of one dtype). `moe_route_groups` picks the
    /// experts on the device and writes them as the grouped kernels' tables from the layer's
    /// expert table (uploaded once, `expert_table`), and the combine sums as after
    /// host grouping (adding the gated shared expert, where given): the same arithmetic, bit
    /// for bit the same output, no host round trip.
    pub(super) fn fn_moe_routed_on_device(
        &self,
        x: &CudaTensor,
        logits: &CudaTensor,
        top_k: usize,
        normalize: bool,
        experts: &[ExpertMatrices<CudaMatrix>],
        shared: Option<&CudaTensor>,
    ) -> Option<CudaTensor> {
        let e_count = experts.len();
        let usable = x.rows >= 1
            && logits.rows == x.rows
            && logits.cols >= e_count + shared.is_some() as usize
            && shared.is_none_or(|s| (s.rows, s.cols) == (x.rows, x.cols))
            && e_count <= MOE_ROUTE_MAX_EXPERTS
            && x.cols > 0
            && self.inner.moe_device_routing.load(Ordering::Relaxed);
        if !usable {
            return None;
        }
        let kinds = ExpertKinds::of(experts, x.cols);
        if x.rows > 1 {
            return self.moe_prefill_on_device(
                x,
                logits,
                (top_k, normalize),
                experts,
                &kinds,
                shared,
            );
        }
        if !(1..=MOE_DEVICE_MAX_K.min(e_count)).contains(&top_k) || !kinds.grouped() {
            return None;
        }
        let stride = kinds.group_len();
        let table = self.expert_table(&kinds, experts);
        // groups: [k, stride] u64; index tables: rows, slots, weights.
        let groups = self.alloc(top_k * stride * 8, "MoE expert groups");
        let index = self.alloc(top_k * 12, "MoE routing tables");
        let (rows_ptr, slots_ptr, sorted_weights) = (
            index.ptr,
            index.ptr + (top_k * 4) as u64,
            index.ptr + (top_k * 8) as u64,
        );
        launch!(self, "moe_route_groups", (1, 1, 1), (256, 1, 1), (e_count * 4) as u32;
            logits.ptr(), e_count as i32, top_k as i32, normalize as i32, logits.cols as i32,
            table, stride as i32, groups.ptr, rows_ptr, slots_ptr, sorted_weights);
        let hidden = x.cols;
        let ys = self.alloc(top_k * hidden * 4, "MoE expert outputs");
        self.launch_expert_groups(
            &kinds,
            (groups.ptr, top_k, true),
            rows_ptr,
            x,
            top_k,
            false,
            ys.ptr,
        );
        Some(self.combine_routed(
            ys.ptr,
            (slots_ptr, sorted_weights),
            x,
            top_k,
            logits,
            e_count,
            shared,
        ))
    }

    /// Prefill rows' routed experts with the routing kept on the device (kernels/
    /// moe_prefill.cu): route, sort the picks by expert into blocks, gate/up and down on
    /// tensor cores reading the quantized weights in place, combine. The fast path's, for
    /// experts of one quantized format per projection with on average at least
    /// `MOE_MATVEC_MAX_ROWS` entries each, unless `CAPY_MOE_PREFILL_DEVICE=0`; `None`
    /// otherwise (the host groups the routing: grouped matvecs, `moe_grouped_gemm`).
    fn moe_prefill_on_device(
        &self,
        x: &CudaTensor,
        logits: &CudaTensor,
        (top_k, normalize): (usize, bool),
        experts: &[ExpertMatrices<CudaMatrix>],
        kinds: &ExpertKinds,
        shared: Option<&CudaTensor>,
    ) -> Option<CudaTensor> {
        let (n, hidden, inter, e_count) = (x.rows, x.cols, kinds.inter, experts.len());
        let (gq, dq) = kinds.quant?;
        let smem_per_sm = if self.inner.moe_prefill_one_buffer {
            CONSUMER_SM_SMEM
        } else {
            self.inner.info.smem_per_multiprocessor
        };
        let plan = moe_prefill_plan(n, top_k, e_count, hidden, inter, smem_per_sm);
        // A few rows (a short turn, several sequences' decode rows) leave most experts with a
        // handful of entries: the host path's grouped matvecs read those experts once, where a
        // block here would decode all of an expert's weights into tiles mostly of padding.
        let few_rows = n * top_k < MOE_MATVEC_MAX_ROWS * e_count;
        if self.inner.exact
            || !self.inner.moe_prefill_device
            || few_rows
            || !(1..=MP_MAX_K.min(e_count)).contains(&top_k)
            || plan.max_blocks > u16::MAX as usize
        {
            return None;
        }
        let entries = n * top_k;
        let routing = self.alloc(entries * 8, "MoE routing");
        let picked_weights = routing.ptr + (entries * 4) as u64;
        launch!(self, "moe_route", (n as u32, 1, 1), (256, 1, 1), (e_count * 4) as u32;
            logits.ptr(), routing.ptr, picked_weights, e_count as i32, top_k as i32,
            normalize as i32, logits.cols as i32);
        // One allocation: sorted entries, each block's expert, the combine's slots and weights.
        let positions = plan.max_blocks * MP_BM;
        let index = self.alloc(
            (positions + plan.max_blocks + 2 * entries) * 4,
            "MoE prefill tables",
        );
        let sorted = index.ptr;
        let block_expert = sorted + (positions * 4) as u64;
        let combine_slots = block_expert + (plan.max_blocks * 4) as u64;
        let combine_weights = combine_slots + (entries * 4) as u64;
        launch!(self, "moe_prefill_align", (1, 1, 1), (MP_ALIGN_THREADS as u32, 1, 1), (3 * e_count * 4) as u32;
            routing.ptr, picked_weights, n as i32, top_k as i32, e_count as i32,
            plan.max_blocks as i32, sorted, block_expert, combine_slots, combine_weights);
        let table = self.expert_table(kinds, experts);
        let stride = kinds.group_len() as i32;
        let xb = self.to_16bit(x.ptr(), n * hidden, WeightType::BF16, "MoE prefill inputs");
        let act = self.alloc(positions * inter * 2, "MoE prefill activations");
        let block = (MP_THREADS as u32, 1, 1);
        launch!(self, "moe_prefill_gate_up", (plan.gate_up_blocks as u32, plan.max_blocks as u32, 1), block, plan.smem as u32;
            table, stride, block_expert, sorted, top_k as i32, xb.ptr, act.ptr, gq.code,
            hidden as i32, inter as i32, gq.row_bytes as u64, 0i32, plan.input_buffers as i32);
        let ys = self.alloc(entries * hidden * 4, "MoE expert outputs");
        launch!(self, "moe_prefill_down", (plan.down_blocks as u32, plan.max_blocks as u32, 1), block, plan.smem as u32;
            table, stride, block_expert, sorted, act.ptr, ys.ptr, dq.code, hidden as i32,
            inter as i32, dq.row_bytes as u64, plan.input_buffers as i32);
        Some(self.combine_routed(
            ys.ptr,
            (combine_slots, combine_weights),
            x,
            top_k,
            logits,
            e_count,
            shared,
        ))
    }

    /// `moe_combine` of routed outputs `ys` by the routing's (slots, weights) tables into a
    /// new [x.rows, x.cols]: with the gated shared expert in the same pass (unless
    /// `CAPY_MOE_SHARED_FUSED=0`, then two launches of its own, to measure what that saves).
    #[allow(clippy::too_many_arguments)]
    fn combine_routed(
        &self,
        ys: u64,
        (slots, weights): (u64, u64),
        x: &CudaTensor,
        top_k: usize,
        logits: &CudaTensor,
        e_count: usize,
        shared: Option<&CudaTensor>,
    ) -> CudaTensor {
        let (n, hidden) = (x.rows, x.cols);
        let mut out = self.alloc_act(n, hidden, n);
        let fused = self.inner.moe_shared_fused.then_some(shared).flatten();
        launch!(self, "moe_combine", grid_1d(n * hidden), (256, 1, 1), 0;
            ys, slots, weights, out.ptr(), n as u64, hidden as i32, top_k as i32,
            fused.map_or(0, |s| s.ptr()), logits.ptr(), logits.cols as i32, e_count as i32);
        if let (None, Some(s)) = (fused, shared) {
            let gated = self.sigmoid_gate_rows(s, logits, e_count);
            self.add_assign(&mut out, &gated);
        }
        out
    }

    /// The layer's expert table for `moe_route_groups` (`kinds.group(expert, 0, 0)` of every
    /// expert), uploaded at the first call and kept: keyed by the experts' first pointer and
    /// checked against every pointer, so a table is never used for other experts.
    fn expert_table(&self, kinds: &ExpertKinds, experts: &[ExpertMatrices<CudaMatrix>]) -> u64 {
        let entries = || experts.iter().map(|e| kinds.group(e, 0, 0));
        let key = experts[0].gate_up.buf.ptr;
        let mut tables = self
            .inner
            .expert_tables
            .lock()
            .expect("expert tables poisoned");
        if let Some((kept, dev)) = tables.get(&key) {
            let stride = kinds.group_len();
            if kept.len() == experts.len() * stride
                && kept
                    .chunks(stride)
                    .zip(entries())
                    .all(|(k, (words, len))| k == &words[..len])
            {
                return dev.ptr;
            }
        }
        let host: Vec<u64> = entries()
            .flat_map(|(w, len)| w.into_iter().take(len))
            .collect();
        let dev = self.upload(&host, "MoE expert table");
        let ptr = dev.ptr;
        tables.insert(key, (host, dev));
        ptr
    }

    /// `interleaved`: each expert's gate_up rows alternate gate, up (the hybrid expert cache's
    /// copies of host records) instead of all gate rows, then all up rows.
    pub(super) fn fn_moe_experts(
        &self,
        x: &CudaTensor,
        routing: &MoeRouting,
        experts: &[ExpertMatrices<CudaMatrix>],
        interleaved: bool,
    ) -> CudaTensor {
        let (n, hidden) = (x.rows, x.cols);
        let k = routing.top_k;
        assert_eq!(
            routing.experts.len(),
            n * k,
            "moe_experts: routing for {} rows of top-{k}, the input has {n} rows",
            routing.experts.len() / k.max(1)
        );
        let out = self.alloc_act(n, hidden, n);
        if n == 0 || hidden == 0 {
            return out;
        }
        let kinds = ExpertKinds::of(experts, hidden);
        let (inter, dtype, quant_uniform, uniform) =
            (kinds.inter, kinds.dtype, kinds.quant, kinds.dense);
        // Grouped layout: the slots of each hit expert, in ascending expert order; per row, its
        // k (slot, weight) pairs in the same order.
        let per = cpu::moe::rows_per_expert(routing, experts.len());
        let slots_total = n * k;
        let mut slot_rows: Vec<u32> = Vec::with_capacity(slots_total);
        let mut combine_slots = vec![0u32; n * k];
        let mut combine_weights = vec![0f32; n * k];
        let mut filled = vec![0usize; n];
        let mut small: Vec<u64> = Vec::new();
        let mut big: Vec<(usize, usize, usize)> = Vec::new();
        for (e, list) in per.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let off = slot_rows.len();
            for &(r, w) in list {
                let slot = slot_rows.len();
                slot_rows.push(r as u32);
                combine_slots[r * k + filled[r]] = slot as u32;
                combine_weights[r * k + filled[r]] = w;
                filled[r] += 1;
            }
            if kinds.grouped() && list.len() <= MOE_MATVEC_MAX_ROWS {
                let (words, len) = kinds.group(&experts[e], off, list.len());
                small.extend_from_slice(&words[..len]);
            } else {
                big.push((e, off, list.len()));
            }
        }
        debug_assert!(filled.iter().all(|&f| f == k));
        // One upload of the index tables: slot rows, combine slots, combine weights (as bits).
        let mut table: Vec<u32> = Vec::with_capacity(slots_total + 2 * n * k);
        table.extend_from_slice(&slot_rows);
        table.extend_from_slice(&combine_slots);
        table.extend(combine_weights.iter().map(|w| w.to_bits()));
        let table_dev = self.upload(&table, "MoE routing tables");
        let rows_ptr = table_dev.ptr;
        let slots_ptr = table_dev.ptr + (slots_total * 4) as u64;
        let weights_ptr = slots_ptr + (n * k * 4) as u64;
        let ys = self.alloc(slots_total * hidden * 4, "MoE expert outputs");
        if !small.is_empty() {
            let stride = kinds.group_len();
            let groups_dev = self.upload(&small, "MoE expert groups");
            let one_row = small.chunks(stride).all(|g| g[3] == 1);
            self.launch_expert_groups(
                &kinds,
                (groups_dev.ptr, small.len() / stride, one_row),
                rows_ptr,
                x,
                slots_total,
                interleaved,
                ys.ptr,
            );
        }
        if !big.is_empty() {
            let weights = match quant_uniform {
                Some((gq, dq)) => Some(GroupedWeights::Quant(gq, dq)),
                None if uniform && dtype == WeightType::F32 => Some(GroupedWeights::Dense(dtype)),
                None if uniform && dtype == WeightType::BF16 && !self.inner.exact => {
                    Some(GroupedWeights::Dense(dtype))
                }
                None => None,
            };
            if let Some(weights) = weights {
                self.moe_grouped_gemm(x, &slot_rows, &big, experts, weights, interleaved, ys.ptr);
                big.clear();
            }
        }
        for (e, off, cnt) in big {
            let xe = self.alloc_act(cnt, hidden, cnt);
            launch!(self, "moe_gather_rows", grid_1d(cnt * hidden), (256, 1, 1), 0;
                x.ptr(), rows_ptr + (off * 4) as u64, xe.ptr(), cnt as u64, hidden as i32);
            let gu = self.linear(&xe, &experts[e].gate_up);
            let act = self.alloc_act(cnt, inter, cnt);
            let swiglu = if interleaved {
                "moe_swiglu_pairs"
            } else {
                "moe_swiglu_halves"
            };
            launch!(self, swiglu, grid_1d(cnt * inter), (256, 1, 1), 0;
                gu.ptr(), act.ptr(), cnt as u64, inter as i32);
            let y = self.linear(&act, &experts[e].down);
            self.copy_dtod(
                ys.ptr + (off * hidden * 4) as u64,
                y.ptr(),
                cnt * hidden * 4,
            );
        }
        launch!(self, "moe_combine", grid_1d(n * hidden), (256, 1, 1), 0;
            ys.ptr, slots_ptr, weights_ptr, out.ptr(), n as u64, hidden as i32, k as i32,
            0u64, 0u64, 0i32, 0i32);
        out
    }

    /// The prefill experts (`big`: (expert, first slot, rows), each above the grouped matvec's
    /// rows) as grouped GEMMs: a chunk of experts at a time, their slots' rows gathered at once,
    /// their quantized weights widened at once into one scratch (`moe_q_dequant`), and each
    /// projection one grouped cuBLAS call; the down products land in `ys` at each expert's
    /// slots. Per expert this was 9 launches (gather, activation conversion, dequantization and
    /// GEMM per projection, SwiGLU, copy), which at 512 experts and ~160 rows each kept a
    /// Flash-Next layer's prefill at ~4% of the GPU's matmul rate. BF16 operands on the fast
    /// path (as `linear_gemm_quant`), f32 when exact.
    #[allow(clippy::too_many_arguments)]
    fn moe_grouped_gemm(
        &self,
        x: &CudaTensor,
        slot_rows: &[u32],
        big: &[(usize, usize, usize)],
        experts: &[ExpertMatrices<CudaMatrix>],
        weights: GroupedWeights,
        interleaved: bool,
        ys: u64,
    ) {
        use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
        let hidden = x.cols;
        let inter = experts[big[0].0].down.cols;
        let exact = self.inner.exact;
        // Operand types: dequantized weights and activations in BF16 on the fast path, f32
        // when exact; dense experts in their own type (F32 or BF16, BF16 only on the fast path).
        let (bf16, compute) = match weights {
            GroupedWeights::Quant(..) if exact => {
                (false, blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F)
            }
            GroupedWeights::Quant(..) => (true, blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F),
            GroupedWeights::Dense(WeightType::BF16) => {
                (true, blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F)
            }
            GroupedWeights::Dense(_) => (false, self.f32_compute()),
        };
        let (esize, dtype) = if bf16 {
            (2usize, CUDA_R_16BF)
        } else {
            (4, CUDA_R_32F)
        };
        let counts: Vec<usize> = big.iter().map(|&(_, _, cnt)| cnt).collect();
        let max_experts = match weights {
            GroupedWeights::Quant(..) => super::QUANT_SCRATCH_ELEMS / (2 * inter * hidden).max(1),
            GroupedWeights::Dense(_) => usize::MAX,
        };
        let chunks = grouped_chunks(&counts, max_experts, GROUPED_MAX_SLOTS);
        let scratch = match weights {
            GroupedWeights::Quant(..) => {
                let most = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
                Some(self.alloc(
                    most * 2 * inter * hidden * esize,
                    "dequantized expert scratch",
                ))
            }
            GroupedWeights::Dense(_) => None,
        };
        for chunk in chunks {
            let part = &big[chunk];
            let slots: usize = part.iter().map(|&(_, _, cnt)| cnt).sum();
            let mut rows: Vec<u32> = Vec::with_capacity(slots);
            for &(_, off, cnt) in part {
                rows.extend_from_slice(&slot_rows[off..off + cnt]);
            }
            let rows_dev = self.upload(&rows, "grouped expert rows");
            let xs = self.alloc(slots * hidden * esize, "grouped expert inputs");
            let gather = if bf16 {
                "moe_gather_rows_bf16"
            } else {
                "moe_gather_rows"
            };
            launch!(self, gather, grid_1d(slots * hidden), (256, 1, 1), 0;
                x.ptr(), rows_dev.ptr, xs.ptr, slots as u64, hidden as i32);
            // The weight operand of each expert of the chunk: widened into the scratch, or
            // the expert's own dense matrix.
            let weight_ptrs = |down: bool| -> Vec<u64> {
                let (rows_w, cols_w) = if down {
                    (hidden, inter)
                } else {
                    (2 * inter, hidden)
                };
                match (weights, &scratch) {
                    (GroupedWeights::Quant(gq, dq), Some(scratch)) => {
                        let q = if down { dq } else { gq };
                        let table: Vec<u64> = part
                            .iter()
                            .flat_map(|&(e, _, _)| {
                                let m = if down {
                                    &experts[e].down
                                } else {
                                    &experts[e].gate_up
                                };
                                [
                                    m.buf.ptr,
                                    m.quant.map_or(0, |q| q.multiplier.to_bits()) as u64,
                                ]
                            })
                            .collect();
                        let table_dev = self.upload(&table, "grouped expert weights");
                        let per_expert_blocks = ceil_div(rows_w * cols_w / 8, 256).clamp(1, 4096);
                        launch!(self, "moe_q_dequant", (per_expert_blocks as u32, part.len() as u32, 1), (256, 1, 1), 0;
                            table_dev.ptr, q.code, rows_w as i32, cols_w as i32, q.row_bytes as u64,
                            scratch.ptr, bf16 as i32);
                        (0..part.len())
                            .map(|i| scratch.ptr + (i * rows_w * cols_w * esize) as u64)
                            .collect()
                    }
                    _ => part
                        .iter()
                        .map(|&(e, _, _)| {
                            if down {
                                experts[e].down.buf.ptr
                            } else {
                                experts[e].gate_up.buf.ptr
                            }
                        })
                        .collect(),
                }
            };
            // One problem an expert: m × (its rows) × k, its B rows packed from `b` on (the
            // chunk's order), its C at `c_at(first slot, first row in the chunk)`.
            let problems =
                |a: &[u64], (m, k): (usize, usize), b: u64, c_at: &dyn Fn(usize, usize) -> u64| {
                    let mut local = 0usize;
                    part.iter()
                        .zip(a)
                        .map(|(&(_, off, cnt), &a)| {
                            let p = GroupedProblem {
                                m,
                                n: cnt,
                                k,
                                a,
                                b: b + (local * k * esize) as u64,
                                c: c_at(off, local),
                            };
                            local += cnt;
                            p
                        })
                        .collect::<Vec<_>>()
                };
            // gate‖up: [2·inter, hidden] per expert times its rows → gu [slots, 2·inter] (f32).
            let gu = self.alloc(slots * 2 * inter * 4, "grouped expert gate/up");
            let gu_at = |_: usize, local: usize| gu.ptr + (local * 2 * inter * 4) as u64;
            let p = problems(&weight_ptrs(false), (2 * inter, hidden), xs.ptr, &gu_at);
            self.gemm_grouped(
                (true, false),
                &p,
                (dtype, hidden),
                (dtype, hidden),
                2 * inter,
                compute,
            );
            let act = self.alloc(slots * inter * esize, "grouped expert activations");
            if bf16 {
                launch!(self, "moe_swiglu_bf16", grid_1d(slots * inter), (256, 1, 1), 0;
                    gu.ptr, act.ptr, slots as u64, inter as i32, interleaved as i32);
            } else {
                let swiglu = if interleaved {
                    "moe_swiglu_pairs"
                } else {
                    "moe_swiglu_halves"
                };
                launch!(self, swiglu, grid_1d(slots * inter), (256, 1, 1), 0;
                    gu.ptr, act.ptr, slots as u64, inter as i32);
            }
            // down: [hidden, inter] per expert → ys at the expert's own slots.
            let ys_at = |off: usize, _: usize| ys + (off * hidden * 4) as u64;
            let p = problems(&weight_ptrs(true), (hidden, inter), act.ptr, &ys_at);
            self.gemm_grouped(
                (true, false),
                &p,
                (dtype, inter),
                (dtype, inter),
                hidden,
                compute,
            );
        }
    }
}

/// Where the grouped prefill GEMMs take each expert's weights from.
#[derive(Clone, Copy)]
enum GroupedWeights {
    /// One block format per projection: widened a chunk of experts at a time.
    Quant(QuantLayout, QuantLayout),
    /// Dense experts read in place (F32, or BF16 on the fast path).
    Dense(WeightType),
}

/// Slots one grouped chunk takes at most (its gathered inputs and gate/up outputs are
/// allocated per chunk: 16384 rows of Flash-Next are ~84 MB each).
const GROUPED_MAX_SLOTS: usize = 16384;

/// Consecutive runs of experts (by their row counts) for the grouped GEMMs: at most
/// `max_experts` experts (the dequantization scratch) and `max_slots` rows a run, except that
/// an expert with more rows than that is a run of its own.
fn grouped_chunks(
    counts: &[usize],
    max_experts: usize,
    max_slots: usize,
) -> Vec<std::ops::Range<usize>> {
    let max_experts = max_experts.max(1);
    let mut chunks = Vec::new();
    let (mut start, mut slots) = (0usize, 0usize);
    for (i, &cnt) in counts.iter().enumerate() {
        let full = i - start == max_experts || (i > start && slots + cnt > max_slots);
        if full {
            chunks.push(start..i);
            start = i;
            slots = 0;
        }
        slots += cnt;
    }
    if start < counts.len() {
        chunks.push(start..counts.len());
    }
    chunks
}

/// The synthetic `qwen3.8-flash-next` shape (MODELS.md) with `num_experts` routed experts per
/// layer (512 in the real model) and PLE n-gram tables sized from `ngram_vocab_size_base` (about
/// 20M in the real model, so the table has ~320M rows). Everything else is the real
/// configuration: 48 layers (QSA every 4th), hidden 2560, 4 hyper-connection streams, top-10
/// routing with intermediate 640, a shared expert of 640, QSA budget 2048 in blocks of 4.
pub fn flash_next_config(num_experts: usize, ngram_vocab_size_base: u64) -> serde_json::Value {
    let layer_types: Vec<&str> = (0..48)
        .map(|i| {
            if i % 4 == 3 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    let mut config = serde_json::json!({
        "model_type": "qwen4_exp_text",
        "architectures": ["Qwen4ExpForCausalLM"],
        "vocab_size": 248320,
        "hidden_size": 2560,
        "num_hidden_layers": 48,
        "num_attention_heads": 24,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_act": "silu",
        "output_gate_type": "sigmoid",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": true},
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "layer_types": layer_types,
        "eos_token_id": 248044,
        "bos_token_id": null,
        "pad_token_id": null
    });
    let flash = serde_json::json!({
        "moe_intermediate_size": 640,
        "shared_expert_intermediate_size": 640,
        "num_experts": num_experts,
        "num_experts_per_tok": 10,
        "norm_topk_prob": true,
        "hc_count": 4,
        "hc_lowrank": 320,
        "ple_layer_ids": [2],
        "ple_embed_dim": 2560,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": ngram_vocab_size_base,
        "make_ngram_vocab_size_divisible_by": 128,
        "seed": 1234,
        "split_ngram_parts": 4,
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 128,
        "indexer_budget": 2048,
        "indexer_compress_ratio": 4
    });
    for (key, value) in flash.as_object().expect("a JSON object") {
        config[key] = value.clone();
    }
    config
}

/// Routed experts per layer in the BF16 bench: the full 512 would be ~250 GB of BF16 weights.
pub const BENCH_BF16_EXPERTS: usize = 64;
/// The bench's n-gram table size base (the real ~20M gives a 51 GB table on the host; the
/// per-token cost, 16 rows read on the host, does not depend on it).
pub const BENCH_NGRAM_BASE: u64 = 1 << 20;

/// `count` BF16 experts of the real shape (constant values) for the op timings.
fn bf16_bench_experts(
    b: &CudaBackend,
    count: usize,
) -> anyhow::Result<Vec<ExpertMatrices<CudaMatrix>>> {
    use crate::tensor::{Bytes, DType, HostTensor};
    let weight = |name: &str, rows: usize, cols: usize| -> anyhow::Result<CudaMatrix> {
        b.matrix(&HostTensor {
            name: name.into(),
            dtype: DType::BF16,
            shape: vec![rows, cols],
            data: Bytes::from_vec(vec![0x3c; rows * cols * 2]),
        })
    };
    (0..count)
        .map(|e| {
            Ok(ExpertMatrices {
                gate_up: weight(&format!("e{e}.gate_up"), 2 * MOE_INTERMEDIATE, MOE_HIDDEN)?,
                down: weight(&format!("e{e}.down"), MOE_HIDDEN, MOE_INTERMEDIATE)?,
            })
        })
        .collect()
}

/// GPU time of the Flash-Next ops at the real shapes, each alone: routed experts for one decode
/// token (10 experts, grouped matvec) and for a prefill batch (host-grouped GEMMs, and routed on
/// the device where the backend takes the experts there), QSA decode at
/// `context` and QSA prefill of `context` queries.
fn flash_next_op_timings(
    b: &CudaBackend,
    context: usize,
    ex: &[ExpertMatrices<CudaMatrix>],
    expert_bytes: f64,
) -> anyhow::Result<serde_json::Value> {
    let (h, k) = (2560usize, 10usize);
    let experts = ex.len();
    let routing = |n: usize| MoeRouting {
        top_k: k,
        experts: (0..n * k)
            .map(|i| ((i * 7 + i / k) % experts) as u32)
            .collect(),
        weights: vec![1.0 / k as f32; n * k],
    };
    let x1 = b.zeros(1, h);
    let r1 = routing(1);
    drop(b.moe_experts(&x1, &r1, ex));
    let moe_decode_ms = b.time_ms(|| {
        for _ in 0..10 {
            drop(b.moe_experts(&x1, &r1, ex));
        }
    })? / 10.0;
    let xn = b.zeros(context, h);
    let rn = routing(context);
    drop(b.moe_experts(&xn, &rn, ex));
    let moe_prefill_ms = b.time_ms(|| drop(b.moe_experts(&xn, &rn, ex)))?;
    // The same routing kept on the device (the fast path's quantized experts): logits that
    // pick each row's experts of `rn`.
    let mut picks = vec![0f32; context * experts];
    for (i, &e) in rn.experts.iter().enumerate() {
        picks[i / k * experts + e as usize] = 1.0;
    }
    let logits = b.from_host(context, experts, &picks);
    let moe_prefill_device_ms = match b.moe_routed_on_device(&xn, &logits, k, true, ex, None) {
        Some(out) => {
            drop(out);
            let routed = || drop(b.moe_routed_on_device(&xn, &logits, k, true, ex, None));
            Some(b.time_ms(routed)?)
        }
        None => None,
    };
    let prefill_flop = 2.0 * (context * k * 3 * MOE_INTERMEDIATE * h) as f64;
    let (a, s) = attention_shapes();
    let mut rng = 1u64;
    let mut rand = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    };
    let kv = b.from_host(context, 512, &rand(context * 512));
    let keys = b.from_host(context / 4, 128, &rand(context / 4 * 128));
    let q1 = b.from_host(1, 24 * 256, &rand(24 * 256));
    let iq1 = b.from_host(1, 512, &rand(512));
    let past = context - 1;
    drop(b.qsa_attention(&q1, &kv, &kv, &iq1, &keys, past, a, s));
    let qsa_decode_ms = b.time_ms(|| {
        for _ in 0..10 {
            drop(b.qsa_attention(&q1, &kv, &kv, &iq1, &keys, past, a, s));
        }
    })? / 10.0;
    let qn = b.from_host(context, 24 * 256, &rand(context * 24 * 256));
    let iqn = b.from_host(context, 512, &rand(context * 512));
    let qsa_prefill_ms =
        b.time_ms(|| drop(b.qsa_attention(&qn, &kv, &kv, &iqn, &keys, 0, a, s)))?;
    Ok(serde_json::json!({
        "moe_experts_decode_ms": moe_decode_ms,
        "moe_experts_decode_bytes_per_s": k as f64 * expert_bytes / (moe_decode_ms as f64 / 1e3),
        "moe_experts_prefill_tokens": context,
        "moe_experts_prefill_ms": moe_prefill_ms,
        "moe_experts_prefill_flop_per_s": prefill_flop / (moe_prefill_ms as f64 / 1e3),
        "moe_experts_prefill_device_routed_ms": moe_prefill_device_ms,
        "moe_experts_prefill_device_routed_flop_per_s": moe_prefill_device_ms.map(|ms| prefill_flop / (ms as f64 / 1e3)),
        "moe_experts_prefill_device_over_host_grouped_speedup_ratio": moe_prefill_device_ms.map(|ms| moe_prefill_ms as f64 / ms as f64),
        "qsa_decode_ms_at_context": qsa_decode_ms,
        "qsa_prefill_ms": qsa_prefill_ms,
    }))
}

/// Flash-Next's routed experts per layer and their shape (MODELS.md).
pub const FLASH_NEXT_EXPERTS: usize = 512;
const MOE_HIDDEN: usize = 2560;
const MOE_INTERMEDIATE: usize = 640;

/// Distinct random expert payloads of the quantized bench; each expert gets its own device
/// copy of one of them.
const SYNTHETIC_EXPERT_PAYLOADS: usize = 8;

/// The routed experts of the quantized Flash-Next bench: random valid blocks of the gate/up
/// format and of the down format, generated once as a few distinct payloads and uploaded into
/// every expert's own allocation. Each token reads the bytes and runs the kernels a real
/// checkpoint of these formats would; only the values repeat between experts, which the
/// routing (the random BF16 router) does not see.
struct SyntheticExperts {
    gate_up_format: RowFormat,
    down_format: RowFormat,
    gate_up: Vec<(Vec<u8>, f32)>,
    down: Vec<(Vec<u8>, f32)>,
}

impl SyntheticExperts {
    fn new(gate_up_format: RowFormat, down_format: RowFormat, seed: u64) -> anyhow::Result<Self> {
        let (h, i) = (MOE_HIDDEN, MOE_INTERMEDIATE);
        let payloads = |format, rows, cols, salt: u64| {
            (0..SYNTHETIC_EXPERT_PAYLOADS as u64)
                .map(|p| super::synthetic_quant_blocks(format, rows, cols, seed ^ (salt + p) << 32))
                .collect::<anyhow::Result<Vec<_>>>()
        };
        Ok(SyntheticExperts {
            gate_up_format,
            down_format,
            gate_up: payloads(gate_up_format, 2 * i, h, 0x100)?,
            down: payloads(down_format, h, i, 0x200)?,
        })
    }

    /// Device bytes of one expert (gate ‖ up, then down), as stored.
    fn expert_bytes(&self) -> u64 {
        (self.gate_up[0].0.len() + self.down[0].0.len()) as u64
    }

    /// Uploads `count` experts; `first` picks where in the payload cycle they start.
    fn upload(
        &self,
        b: &CudaBackend,
        first: usize,
        count: usize,
    ) -> anyhow::Result<Vec<ExpertMatrices<CudaMatrix>>> {
        let (h, i) = (MOE_HIDDEN, MOE_INTERMEDIATE);
        (first..first + count)
            .map(|e| {
                let (gu, gu_mult) = &self.gate_up[e % self.gate_up.len()];
                // A different stride for down, so that an expert's two payloads pair up differently.
                let (d, d_mult) = &self.down[(e / self.gate_up.len() + e) % self.down.len()];
                Ok(ExpertMatrices {
                    gate_up: b.quant_matrix(self.gate_up_format, 2 * i, h, gu, *gu_mult)?,
                    down: b.quant_matrix(self.down_format, h, i, d, *d_mult)?,
                })
            })
            .collect()
    }
}

/// Builds the synthetic Flash-Next model with every routed expert on the GPU, prefills
/// `opts.context` tokens (timed), then times `opts.decode_steps` single-token steps at that
/// context. Returns the figures as JSON.
///
/// With `opts.quant` the routed experts are all [`FLASH_NEXT_EXPERTS`] per layer in that
/// format (down in [`default_down_format`]), kept quantized, and everything else BF16, as the
/// published NVFP4 build stores it; without, everything is BF16 and each layer keeps
/// [`BENCH_BF16_EXPERTS`] experts (the full set would be ~250 GB).
pub fn run_synthetic_flash_next(
    opts: &super::bench::SyntheticBenchOptions,
) -> anyhow::Result<serde_json::Value> {
    use crate::hybrid::bench::default_down_format;
    use crate::model::layers::moe::{BackendExperts, RoutedExperts};
    use crate::model::qwen4_exp_text::Qwen4ExpText;
    use crate::model::{BatchItem, CausalLm, LogitsWanted};
    use anyhow::Context;
    use std::time::Instant;
    let backend = CudaBackend::new(opts.device, opts.vram_budget)?;
    let info = backend.device_info().clone();
    let copy_bw = backend.measure_copy_bandwidth(2 << 30, 10)?;
    let gemm_rate = backend.measure_bf16_gemm_rate(8192, 10)?;

    let t0 = Instant::now();
    let synthetic = match opts.quant {
        Some(f) => Some(SyntheticExperts::new(
            f,
            default_down_format(f, MOE_INTERMEDIATE)?,
            opts.seed,
        )?),
        None => None,
    };
    let experts_per_layer = if synthetic.is_some() {
        FLASH_NEXT_EXPERTS
    } else {
        BENCH_BF16_EXPERTS
    };
    let config = flash_next_config(experts_per_layer, BENCH_NGRAM_BASE);
    // The quantized bench builds the routed experts itself: their BF16 tensors are left out.
    let ck = crate::synthetic::checkpoint_from_config_keeping(&config, opts.seed, |name| {
        synthetic.is_none() || !name.contains(".mlp.experts.")
    })?;
    let c = ck.config.clone();
    let f = c.qwen4_exp()?;
    let (h, v, layers) = (c.hidden_size, c.vocab_size, c.num_hidden_layers);
    let (e, k, inter) = (
        f.moe.num_experts,
        f.moe.num_experts_per_tok,
        f.moe.moe_intermediate_size,
    );
    anyhow::ensure!(
        (h, inter) == (MOE_HIDDEN, MOE_INTERMEDIATE),
        "the bench's expert shape is [{MOE_INTERMEDIATE}, {MOE_HIDDEN}]; the config has [{inter}, {h}]"
    );
    let expert_bytes = match &synthetic {
        Some(s) => s.expert_bytes(),
        None => (3 * inter * h * 2) as u64,
    };
    let all_expert_bytes = (layers * e) as u64 * expert_bytes;
    // Refused before loading when the experts alone cannot fit what the card (or the budget)
    // has: the dense BF16 weights (~8.6 GB), KV and workspace come on top.
    let dense_estimate: u64 = crate::synthetic::tensors(&c)?
        .iter()
        .filter(|(name, _)| !name.contains(".mlp.experts."))
        .map(|(_, shape)| shape.iter().product::<usize>() as u64 * 2)
        .sum();
    let room = opts.vram_budget.unwrap_or(info.total_memory);
    let reserve = 4u64 << 30;
    if all_expert_bytes + dense_estimate + reserve > room {
        anyhow::bail!(
            "Flash-Next with every routed expert on the GPU needs {} of experts + {} of dense weights + {} of KV and \
             workspace = {}, and this card offers {} ({}); use a larger card, or `bench hybrid` to keep the experts in RAM",
            super::bench::gib(all_expert_bytes),
            super::bench::gib(dense_estimate),
            super::bench::gib(reserve),
            super::bench::gib(all_expert_bytes + dense_estimate + reserve),
            super::bench::gib(room),
            if opts.vram_budget.is_some() { "--vram-budget" } else { "its memory" }
        );
    }
    let mut model = match &synthetic {
        None => Qwen4ExpText::load(backend.clone(), &ck),
        Some(s) => {
            let t_load = Instant::now();
            let mut loader = |b: &CudaBackend,
                              layer: usize,
                              _prefix: &str|
             -> anyhow::Result<Box<dyn RoutedExperts<CudaBackend>>> {
                let experts = s.upload(b, layer * e, e)?;
                if (layer + 1).is_multiple_of(8) || layer + 1 == layers {
                    eprintln!(
                        "routed experts: {} of {layers} layers on the GPU ({} in {:.1} s)",
                        layer + 1,
                        super::bench::gib((layer as u64 + 1) * e as u64 * expert_bytes),
                        t_load.elapsed().as_secs_f64()
                    );
                }
                Ok(Box::new(BackendExperts { experts }))
            };
            Qwen4ExpText::load_with_experts(backend.clone(), &ck, Some(&mut loader))
        }
    }
    .context("building the synthetic Flash-Next model on the GPU")?;
    backend.synchronize()?;
    let load_s = t0.elapsed().as_secs_f64();
    let ledger = backend.ledger();

    let embed_bytes = (v * h * 2) as u64;
    let dense_bytes = ledger.weights - embed_bytes - all_expert_bytes;
    // Per decode token: every dense weight but the embedding table, and k experts per layer.
    let active_bytes = dense_bytes + (layers * k) as u64 * expert_bytes;
    let head_params = (v * h) as f64;
    // FLOPs: dense weights at 2 bytes a parameter, and k experts' parameters per layer.
    let matmul_params =
        (dense_bytes as f64 / 2.0 - head_params) + (layers * k * 3 * inter * h) as f64;
    let mut rng = opts.seed | 1;
    let mut token = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % v as u64) as u32
    };
    // Warm-up: cuBLAS heuristics, the memory pool, both attention paths.
    {
        let s = model.new_sequence();
        let warm: Vec<u32> = (0..256).map(|_| token()).collect();
        model.forward(&[BatchItem {
            seq: s,
            tokens: &warm,
            logits: LogitsWanted::Last,
        }])?;
        for _ in 0..2 {
            let t = [token()];
            model.forward(&[BatchItem {
                seq: s,
                tokens: &t,
                logits: LogitsWanted::Last,
            }])?;
        }
        model.drop_sequence(s);
        backend.synchronize()?;
    }

    let seq = model.new_sequence();
    let prompt: Vec<u32> = (0..opts.context).map(|_| token()).collect();
    let (logits, prefill_s) = super::bench::timed_prefill(&mut model, seq, &prompt)?;
    let qsa = f.qsa.expect("the bench config has QSA");
    let attn_layers = c
        .layer_types
        .iter()
        .filter(|t| **t == crate::config::LayerType::FullAttention)
        .count() as f64;
    // QSA: each query attends all its tokens within the budget, else budget + tail; QKᵀ and PV
    // at 2 FLOPs per multiply-add; plus the indexer's block scores.
    let attended: f64 = (0..opts.context)
        .map(|p| {
            let complete = (p + 1) / qsa.compress_ratio;
            if complete <= qsa.block_topk() {
                (p + 1) as f64
            } else {
                (qsa.budget + (p + 1 - complete * qsa.compress_ratio)) as f64
            }
        })
        .sum();
    let indexer_pairs: f64 = (0..opts.context)
        .map(|p| ((p + 1) / qsa.compress_ratio) as f64)
        .sum();
    let attn_flops = attn_layers
        * (4.0 * (c.num_attention_heads * c.head_dim) as f64 * attended
            + 2.0 * (qsa.indexer_n_heads * qsa.indexer_head_dim) as f64 * indexer_pairs);
    let n = opts.context as f64;
    let prefill_flops = 2.0 * matmul_params * n + 2.0 * head_params + attn_flops;

    let mut next = super::bench::argmax(&logits[0]);
    // Two untimed steps first, as the 27B bench does: the first step after the prompt grows
    // every KV cache (a doubling copy) and fills the buffer pool.
    super::bench::greedy_steps(&mut model, seq, &mut next, 2)?;
    let launches_before = backend.launches();
    let (step_s, decode_total_s) =
        super::bench::greedy_steps(&mut model, seq, &mut next, opts.decode_steps)?;
    let launches_per_token =
        (backend.launches() - launches_before) as f64 / opts.decode_steps.max(1) as f64;
    let graphs_default = backend.cuda_graphs();
    let profiled_steps =
        super::bench::profile_decode(&backend, &mut model, seq, &mut next, graphs_default)?;
    let (seq, warm_prefill_s) = super::bench::repeat_prefill(&mut model, seq, &prompt)?;
    let profiled_prefill = super::bench::profile_prefill(&backend, &mut model, seq, &prompt)?;
    let decode_tok_s = opts.decode_steps as f64 / decode_total_s;
    let median_step = super::bench::median(&mut step_s.clone());
    let context_at_end = opts.context + opts.decode_steps;
    // KV (f32, read up to the budget), indexer block keys and GDN state also read per step.
    let kv_tokens = context_at_end.min(qsa.budget + qsa.compress_ratio);
    let kv_bytes = (attn_layers as usize
        * (2 * kv_tokens * c.num_key_value_heads * c.head_dim
            + context_at_end / qsa.compress_ratio * qsa.indexer_head_dim)
        * 4) as u64;
    let gdn_layers = layers - attn_layers as usize;
    let state_bytes = (gdn_layers
        * c.linear_num_value_heads
        * c.linear_key_head_dim
        * c.linear_value_head_dim
        * 4) as u64;
    let roof_tok_s = copy_bw / active_bytes as f64;
    let roof_with_state = copy_bw / (active_bytes + kv_bytes + state_bytes) as f64;
    drop(model);
    drop(ck);
    // The op timings' experts: one layer's worth in the bench's format.
    let op_experts = match &synthetic {
        Some(s) => s.upload(&backend, 0, e)?,
        None => bf16_bench_experts(&backend, e)?,
    };
    let ops = flash_next_op_timings(&backend, opts.context, &op_experts, expert_bytes as f64)?;
    drop(op_experts);
    let weights = match &synthetic {
        Some(s) => format!(
            "routed experts {} (down {}), everything else bf16",
            s.gate_up_format.name(),
            s.down_format.name()
        ),
        None => "bf16".to_string(),
    };
    let shape_note = match &synthetic {
        Some(_) => serde_json::json!({
            "routed_experts_per_layer": e,
            "note": format!(
                "every routed expert of the real model on the GPU, {SYNTHETIC_EXPERT_PAYLOADS} distinct random payloads \
                 uploaded into each expert's own allocation (the bytes read per token are the real ones). The n-gram \
                 table (read on the host) has base {BENCH_NGRAM_BASE} instead of ~20M rows per head; its per-token \
                 cost (16 rows) is the same."
            ),
        }),
        None => serde_json::json!({
            "routed_experts_per_layer": e,
            "real_routed_experts_per_layer": FLASH_NEXT_EXPERTS,
            "note": format!(
                "BF16 with all {FLASH_NEXT_EXPERTS} experts would be ~250 GB; this run keeps {e} experts per layer and routes top-{k} over them, \
                 so the active bytes and FLOPs per token equal the real model's (same expert shape, same top-k); only the \
                 resident expert bytes are 1/{} of the real ones. The n-gram table (read on the host) has base {} instead of \
                 ~20M rows per head; its per-token cost (16 rows) is the same.",
                FLASH_NEXT_EXPERTS / e.max(1),
                BENCH_NGRAM_BASE
            ),
        }),
    };

    Ok(serde_json::json!({
        "benchmark": "synthetic",
        "shape": opts.shape,
        "weights": weights,
        "shape_note": shape_note,
        "experts_on_gpu": "all",
        "exact_math": backend.exact_math(),
        "machine": {
            "gpu": info.name,
            "compute_capability": format!("sm_{}{}", info.compute_capability.0, info.compute_capability.1),
            "multiprocessors": info.multiprocessors,
            "smem_per_multiprocessor": info.smem_per_multiprocessor,
            "gpu_memory_bytes": info.total_memory,
            "driver_cuda": format!("{}.{}", info.driver_version.0, info.driver_version.1),
            "nvrtc": format!("{}.{}", info.nvrtc_version.0, info.nvrtc_version.1),
            "host_threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        },
        "ceilings": {
            "device_copy_bytes_per_s": copy_bw,
            "device_copy_note": "cuMemcpyDtoD of 2 GiB, bytes read + written, 10 repetitions",
            "bf16_gemm_flop_per_s": gemm_rate,
            "bf16_gemm_note": "cublasGemmEx 8192^3, BF16 in, F32 out, F32 accumulation, random operands, 10 repetitions",
        },
        "load_seconds": load_s,
        "vram": {
            "weights_bytes": ledger.weights,
            "routed_expert_bytes": all_expert_bytes,
            "dense_weight_bytes": dense_bytes + embed_bytes,
            "after_load_bytes": ledger.used,
            "peak_bytes": backend.ledger().peak,
        },
        "prefill": super::bench::prefill_record(opts.context, prefill_flops, prefill_s, warm_prefill_s, gemm_rate),
        "decode": {
            "batch": 1,
            "context_start": opts.context,
            "steps": opts.decode_steps,
            "tokens_per_s": decode_tok_s,
            "median_step_ms": median_step * 1e3,
            "step_ms": super::bench::step_ms(&step_s),
            "launches_per_token": launches_per_token,
            "profiled_steps": profiled_steps,
            "profiled_prefill": profiled_prefill,
            "active_weight_bytes_per_token": active_bytes,
            "active_weight_bytes_note": "dense weights except the embedding table, plus top-k routed experts per layer, as stored",
            "kv_index_and_state_bytes_per_token": kv_bytes + state_bytes,
            "roofline_tokens_per_s": roof_tok_s,
            "bandwidth_roofline_ratio": decode_tok_s / roof_tok_s,
            "bandwidth_roofline_ratio_with_kv_and_state": decode_tok_s / roof_with_state,
        },
        "op_timings": ops,
    }))
}

/// Flash-Next's QSA attention layers: 24 query heads and 2 KV heads of 256, 4 indexer heads of
/// 128, the top 512 blocks of 4 tokens (a 2048-token budget). For op timings and GPU tests.
pub fn attention_shapes() -> (AttentionShape, QsaShape) {
    (
        AttentionShape {
            num_heads: 24,
            num_kv_heads: 2,
            head_dim: 256,
            scale: 1.0 / 16.0,
        },
        QsaShape {
            index_heads: 4,
            index_head_dim: 128,
            block_topk: 512,
            compress_ratio: 4,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::{grouped_chunks, moe_prefill_input_buffers, moe_prefill_plan};

    #[test]
    fn prefill_experts_keep_two_ctas_an_sm_on_every_card() {
        // sm_90 (228 KiB an SM, 227 KiB a CTA) takes two input buffers; the 100 KiB SMs of
        // the consumer cards (sm_86, sm_89, sm_120) take one.
        for (smem_per_sm, buffers) in [(233_472, 2), (167_936, 2), (super::CONSUMER_SM_SMEM, 1)] {
            assert_eq!(
                moe_prefill_input_buffers(smem_per_sm),
                buffers,
                "{smem_per_sm}"
            );
            let plan = moe_prefill_plan(8192, 10, 512, 2560, 640, smem_per_sm);
            assert_eq!(plan.input_buffers, buffers);
            assert!(
                2 * (plan.smem + 1024) <= smem_per_sm,
                "two CTAs of {} bytes do not fit an SM of {smem_per_sm}",
                plan.smem
            );
        }
        assert_eq!(moe_prefill_plan(1, 1, 1, 64, 64, 233_472).smem, 55_808);
    }

    #[test]
    fn grouped_chunks_cover_every_expert_once_within_both_limits() {
        let counts = [9, 30, 12, 200, 9, 9, 9, 40, 15];
        for (max_experts, max_slots) in [(3, 64), (1, 1000), (100, 50), (4, 10_000)] {
            let chunks = grouped_chunks(&counts, max_experts, max_slots);
            let mut next = 0;
            for c in &chunks {
                assert_eq!(c.start, next, "chunks {chunks:?} leave a gap or overlap");
                assert!(
                    !c.is_empty() && c.len() <= max_experts,
                    "{c:?} of {chunks:?}"
                );
                let slots: usize = counts[c.clone()].iter().sum();
                assert!(
                    slots <= max_slots || c.len() == 1,
                    "{c:?} holds {slots} slots over {max_slots}"
                );
                next = c.end;
            }
            assert_eq!(next, counts.len());
        }
        // Greedy: as few chunks as the limits allow for this order.
        assert_eq!(grouped_chunks(&counts, 3, 64), vec![0..3, 3..4, 4..7, 7..9]);
        assert_eq!(grouped_chunks(&counts, 100, 10_000), vec![0..counts.len()]);
        assert!(grouped_chunks(&[], 4, 4).is_empty());
    }
}
