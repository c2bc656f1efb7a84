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

use super::{ceil_div, grid_1d, CudaBackend, CudaMatrix, CudaTensor, DevBuf};
use crate::backend::{cpu, AttentionShape, Backend, ExpertMatrices, MoeRouting, QsaShape};
use cudarc::driver::result as drv;
use std::ffi::c_void;

/// Rows per expert up to which the grouped matvec kernels run (`MOE_MAX_ROWS` in moe.cu).
pub const MOE_MATVEC_MAX_ROWS: usize = 8;
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
                "qsa_select",
                "qsa_attn_split",
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
                "moe_swiglu_halves",
                "moe_combine",
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
        self.bind();
        if len > 0 {
            // SAFETY: `ptr` holds at least `len` values of T (callers allocate them); the stream
            // is synchronised before the vector is read.
            unsafe { drv::memcpy_dtoh_async(&mut out, ptr, self.stream()) }
                .expect("device-to-host copy failed");
        }
        self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
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
        let out = self.alloc_act(x.rows, x.cols, x.rows);
        let n = x.len();
        if n > 0 {
            launch!(self, "silu_scaled", grid_1d(n), (256, 1, 1), 0;
                x.ptr(), out.ptr(), n as u64, scale);
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
            launch!(self, "hc_mix", grid_1d(n), (256, 1, 1), 0;
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
        assert_eq!(
            (inject_logits.rows, inject_logits.cols),
            (residual.rows, streams),
            "hc_inject: injection logits [{}, {}], expected [{}, {streams}]",
            inject_logits.rows,
            inject_logits.cols,
            residual.rows
        );
        let res = self.alloc_act(residual.rows, residual.cols, residual.rows);
        let n = residual.len();
        if n > 0 {
            launch!(self, "hc_inject", grid_1d(n), (256, 1, 1), 0;
                residual.ptr(), out.ptr(), inject_logits.ptr(), res.ptr(), residual.rows as u64,
                h as i32, streams as i32);
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
        launch!(self, "qsa_block_scores", (ceil_div(scratch.stride, 8) as u32, rows as u32, 1), (256, 1, 1), 0;
            index_q.row_ptr(r0), block_keys.ptr(), scratch.scores.ptr, p0 as i32, qsa.index_heads as i32,
            qsa.index_head_dim as i32, qsa.compress_ratio as i32, scratch.stride as i32);
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
                part_o.ptr, part_ml.ptr, out.row_ptr(r0), s.num_heads as i32, s.head_dim as i32, splits as i32);
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
            experts * 4 <= 48 << 10,
            "moe: {experts} experts are above the routing kernel's {}",
            (48 << 10) / 4
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
            logits.ptr(), out.ptr, weights_ptr, experts as i32, top_k as i32, normalize as i32);
        let host: Vec<u32> = self.download(out.ptr, 2 * n * top_k);
        let (ids, weights) = host.split_at(n * top_k);
        MoeRouting {
            top_k,
            experts: ids.to_vec(),
            weights: weights.iter().map(|&b| f32::from_bits(b)).collect(),
        }
    }

    pub(super) fn fn_moe_experts(
        &self,
        x: &CudaTensor,
        routing: &MoeRouting,
        experts: &[ExpertMatrices<CudaMatrix>],
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
        let uniform = experts
            .iter()
            .all(|e| e.gate_up.dtype == dtype && e.down.dtype == dtype);
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
            if uniform && list.len() <= MOE_MATVEC_MAX_ROWS {
                small.extend([
                    experts[e].gate_up.buf.ptr,
                    experts[e].down.buf.ptr,
                    off as u64,
                    list.len() as u64,
                ]);
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
            let groups = small.len() / 4;
            let groups_dev = self.upload(&small, "MoE expert groups");
            let act = self.alloc(slots_total * inter * 4, "MoE expert activations");
            let warps = 8usize;
            launch!(self, "moe_gate_up", (ceil_div(inter, warps) as u32, groups as u32, 1), (32 * warps as u32, 1, 1), 0;
                groups_dev.ptr, rows_ptr, x.ptr(), act.ptr, dtype as i32, hidden as i32, inter as i32);
            launch!(self, "moe_down", (ceil_div(hidden, warps) as u32, groups as u32, 1), (32 * warps as u32, 1, 1), 0;
                groups_dev.ptr, act.ptr, ys.ptr, dtype as i32, hidden as i32, inter as i32);
        }
        for (e, off, cnt) in big {
            let xe = self.alloc_act(cnt, hidden, cnt);
            launch!(self, "moe_gather_rows", grid_1d(cnt * hidden), (256, 1, 1), 0;
                x.ptr(), rows_ptr + (off * 4) as u64, xe.ptr(), cnt as u64, hidden as i32);
            let gu = self.linear(&xe, &experts[e].gate_up);
            let act = self.alloc_act(cnt, inter, cnt);
            launch!(self, "moe_swiglu_halves", grid_1d(cnt * inter), (256, 1, 1), 0;
                gu.ptr(), act.ptr(), cnt as u64, inter as i32);
            let y = self.linear(&act, &experts[e].down);
            self.copy_dtod(
                ys.ptr + (off * hidden * 4) as u64,
                y.ptr(),
                cnt * hidden * 4,
            );
        }
        launch!(self, "moe_combine", grid_1d(n * hidden), (256, 1, 1), 0;
            ys.ptr, slots_ptr, weights_ptr, out.ptr(), n as u64, hidden as i32, k as i32);
        out
    }
}
