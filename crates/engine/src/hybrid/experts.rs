//! Routed experts split between the backend (resident copies) and the CPU (the host store).
//!
//! [`HybridExperts`] plugs into a MoE layer through [`RoutedExperts`]. Per step it splits the
//! routing with [`split_routing`]: pairs whose expert has a resident copy run through the
//! backend's `moe_experts` on those copies; the rest run on the CPU expert kernels over the
//! host [`ExpertSet`]; the two partial sums are added. Which experts are resident is either
//! fixed (tests, "all on GPU" / "all on CPU") or decided by the shared [`ExpertCache`]; with
//! the cache, experts it admits are uploaded after the step and used from the next one.
//!
//! On the CPU backend the "resident" side is the CPU backend itself: that is the CPU-only
//! stand-in CI uses to prove that placement never changes the result.

use super::expert_cache::ExpertCache;
use super::split::split_routing;
use crate::backend::cpu::experts::{
    self, timeline::CallSummary, ExpertMatrix, ExpertPool, ExpertSet, ExpertShape, MoeScratch,
};
use crate::backend::cpu::simd::Isa;
use crate::backend::{Backend, ExpertMatrices, HostPin, MoeRouting};
use crate::model::layers::moe::RoutedExperts;
use crate::tensor::HostTensor;
use anyhow::{bail, Result};
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Who decides which experts of a layer are resident.
pub enum Placement {
    /// A fixed set (`resident[e]`), uploaded at construction.
    Fixed(Vec<bool>),
    /// The VRAM expert cache shared by every layer. The layer with index 0 advances its clock.
    Cached(Arc<Mutex<ExpertCache>>),
}

/// Where a layer's calls spent their time, on the calling thread, summed over calls (seconds).
/// A few clock reads per call: cheap next to a MoE layer, and what the hybrid bench reports as
/// where the time goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ForwardTimes {
    pub calls: u64,
    /// The cache's bookkeeping and dropping given-up slots.
    pub policy_s: f64,
    /// Reading `x` back to the host: waits for the device's queued work (the step so far).
    pub read_x_s: f64,
    /// Queuing the caller's device work handed to [`RoutedExperts::forward_overlapped`] (the
    /// MoE layer's shared expert). With CPU experts this runs inside `cpu_experts_s` (see
    /// `queued_during_cpu_s`).
    pub caller_queue_s: f64,
    /// Queuing the resident experts on the backend and, where experts also run on the CPU,
    /// submitting the queued device work (launch cost on the host; the device runs them while
    /// the CPU computes). With CPU experts this runs inside `cpu_experts_s`, on the calling
    /// thread while the other workers compute (see `queued_during_cpu_s`).
    pub resident_queue_s: f64,
    /// The CPU experts: the wall time of the pool's run, caller included (and so the queuing
    /// the caller does at its start).
    pub cpu_experts_s: f64,
    /// The part of `caller_queue_s + resident_queue_s` that ran inside `cpu_experts_s` (counted
    /// in both; the calling thread's time is [`ForwardTimes::total_s`], which counts it once).
    pub queued_during_cpu_s: f64,
    /// Uploading the CPU's partial sum and queuing its addition.
    pub merge_s: f64,
    /// Queuing the copies of admitted experts.
    pub admit_s: f64,
}

impl ForwardTimes {
    pub fn add(&mut self, o: &ForwardTimes) {
        self.calls += o.calls;
        self.policy_s += o.policy_s;
        self.read_x_s += o.read_x_s;
        self.caller_queue_s += o.caller_queue_s;
        self.resident_queue_s += o.resident_queue_s;
        self.cpu_experts_s += o.cpu_experts_s;
        self.queued_during_cpu_s += o.queued_during_cpu_s;
        self.merge_s += o.merge_s;
        self.admit_s += o.admit_s;
    }
    /// The time spent since `before` (an earlier reading of the same counters).
    pub fn since(&self, before: &ForwardTimes) -> ForwardTimes {
        ForwardTimes {
            calls: self.calls - before.calls,
            policy_s: self.policy_s - before.policy_s,
            read_x_s: self.read_x_s - before.read_x_s,
            caller_queue_s: self.caller_queue_s - before.caller_queue_s,
            resident_queue_s: self.resident_queue_s - before.resident_queue_s,
            cpu_experts_s: self.cpu_experts_s - before.cpu_experts_s,
            queued_during_cpu_s: self.queued_during_cpu_s - before.queued_during_cpu_s,
            merge_s: self.merge_s - before.merge_s,
            admit_s: self.admit_s - before.admit_s,
        }
    }
    /// The calling thread's time: every phase, the overlapped queuing counted once.
    pub fn total_s(&self) -> f64 {
        self.policy_s
            + self.read_x_s
            + self.caller_queue_s
            + self.resident_queue_s
            + self.cpu_experts_s
            + self.merge_s
            + self.admit_s
            - self.queued_during_cpu_s
    }
}

struct Resident<M> {
    /// Resident copies, compact; `slot_of[e]` indexes them.
    slots: Vec<ExpertMatrices<M>>,
    slot_expert: Vec<u32>,
    slot_of: Vec<Option<u32>>,
    scratch: Option<MoeScratch>,
    /// Routed pairs the scratch was sized for.
    scratch_pairs: usize,
    /// The CPU calls' timelines since the last take, where a bench asked for them.
    cpu_calls: Option<Vec<CallSummary>>,
    /// The backend refused a copy (its memory budget is full): no more copies are tried, the
    /// rest of this layer's experts run on the host.
    upload_refused: bool,
    times: ForwardTimes,
}

/// One MoE layer's routed experts, placed across the backend and the CPU.
pub struct HybridExperts<B: Backend> {
    layer: usize,
    /// The host store's page-locking; declared before `host` so it is undone first.
    pin: Option<HostPin>,
    host: Arc<ExpertSet>,
    pool: Arc<ExpertPool>,
    isa: Isa,
    placement: Placement,
    /// Resident copies are the records' bytes as stored ([`interleaved_for`]).
    interleaved: bool,
    state: Mutex<Resident<B::Matrix>>,
}

/// Whether a layer's resident copies are the host records' bytes as stored (gate and up rows
/// alternating): the backend takes that layout and every expert's gate and up share one tensor
/// scale (else gate_up would need two multipliers in one matrix).
pub fn interleaved_for<B: Backend>(b: &B, set: &ExpertSet) -> bool {
    b.takes_interleaved_experts()
        && (0..set.experts).all(|e| {
            let [g, u, _] = set.multipliers(e);
            g == u
        })
}

/// The record bytes of expert `e`'s gate/up rows (interleaved, `2I` rows) and its down rows.
fn record_regions(set: &ExpertSet, e: usize) -> (&[u8], &[u8]) {
    let l = set.layout;
    let rec = set.record(e);
    let at = |row: &[u8]| row.as_ptr() as usize - rec.as_ptr() as usize;
    let gu = at(set.row(e, ExpertMatrix::Gate, 0));
    let down = at(set.row(e, ExpertMatrix::Down, 0));
    (
        &rec[gu..gu + 2 * l.shape.intermediate * l.gate_up_row_bytes],
        &rec[down..down + l.shape.hidden * l.down_row_bytes],
    )
}

/// The backend copy of expert `e` of `set`, in the set's own format: a backend that computes
/// on quantised blocks (CUDA) keeps them quantised, so a copy moves the record's bytes only.
/// `interleaved` ([`interleaved_for`]): both matrices are copied straight from the record (no
/// staging buffer; from a page-locked store the copies are DMA, asynchronous to the host).
/// Otherwise gate_up is regrouped into halves; gate and up with different tensor scales cannot
/// share one fused matrix and are dequantised (exact either way).
pub fn upload_as<B: Backend>(
    b: &B,
    set: &ExpertSet,
    e: usize,
    interleaved: bool,
) -> Result<ExpertMatrices<B::Matrix>> {
    let l = set.layout;
    let ExpertShape {
        hidden,
        intermediate,
    } = l.shape;
    let [m_gate, m_up, m_down] = set.multipliers(e);
    let (gu_bytes, down_bytes) = record_regions(set, e);
    let gate_up = if interleaved {
        if m_gate != m_up {
            bail!("expert {e}: gate and up scales differ ({m_gate} vs {m_up}): cannot copy the record interleaved");
        }
        b.quant_matrix(l.format, 2 * intermediate, hidden, gu_bytes, m_gate)?
    } else if m_gate == m_up {
        let mut rows = Vec::with_capacity(2 * intermediate * l.gate_up_row_bytes);
        for m in [ExpertMatrix::Gate, ExpertMatrix::Up] {
            for i in 0..intermediate {
                rows.extend_from_slice(set.row(e, m, i));
            }
        }
        b.quant_matrix(l.format, 2 * intermediate, hidden, &rows, m_gate)?
    } else {
        let mut values = set.matrix_f32(e, ExpertMatrix::Gate);
        values.extend(set.matrix_f32(e, ExpertMatrix::Up));
        b.matrix(&HostTensor::from_f32(
            &format!("expert {e} gate_up"),
            vec![2 * intermediate, hidden],
            &values,
        ))?
    };
    Ok(ExpertMatrices {
        gate_up,
        down: b.quant_matrix(l.down_format, hidden, intermediate, down_bytes, m_down)?,
    })
}

/// [`upload_as`] in the layout [`interleaved_for`] picks for this backend and set.
pub fn upload<B: Backend>(b: &B, set: &ExpertSet, e: usize) -> Result<ExpertMatrices<B::Matrix>> {
    upload_as(b, set, e, interleaved_for(b, set))
}

impl<B: Backend> HybridExperts<B> {
    pub fn new(
        b: &B,
        layer: usize,
        host: Arc<ExpertSet>,
        pool: Arc<ExpertPool>,
        isa: Isa,
        placement: Placement,
    ) -> Result<Self> {
        let mut state = Resident {
            slots: Vec::new(),
            slot_expert: Vec::new(),
            slot_of: vec![None; host.experts],
            scratch: None,
            scratch_pairs: 0,
            cpu_calls: None,
            upload_refused: false,
            times: ForwardTimes::default(),
        };
        let resident: Vec<usize> = match &placement {
            Placement::Fixed(resident) => {
                if resident.len() != host.experts {
                    bail!(
                        "layer {layer}: a fixed placement names {} experts, the layer has {}",
                        resident.len(),
                        host.experts
                    );
                }
                (0..host.experts).filter(|&e| resident[e]).collect()
            }
            // A cache warmed from a saved hot set starts with its residents copied in.
            Placement::Cached(cache) => {
                let c = cache.lock().expect("expert cache");
                c.resident_in(layer)
                    .into_iter()
                    .map(|e| e as usize)
                    .collect()
            }
        };
        let interleaved = interleaved_for(b, &host);
        for e in resident {
            state.slot_of[e] = Some(state.slots.len() as u32);
            state.slots.push(upload_as(b, &host, e, interleaved)?);
            state.slot_expert.push(e as u32);
        }
        Ok(HybridExperts {
            layer,
            pin: None,
            host,
            pool,
            isa,
            placement,
            interleaved,
            state: Mutex::new(state),
        })
    }

    /// Page-locks this layer's host expert records through the backend (copies into the
    /// cache then run as DMA). Returns the bytes pinned: 0 where the backend does not pin.
    pub fn pin_host_store(&mut self, b: &B) -> Result<usize> {
        if self.pin.is_none() {
            // SAFETY: `self.host` is an immutable `Arc`ed set: its allocation neither moves nor
            // is freed while `self` holds it, and `self.pin` is dropped before `self.host`.
            self.pin = unsafe { b.pin_host(self.host.as_bytes())? };
        }
        Ok(self.pin.as_ref().map_or(0, HostPin::bytes))
    }

    /// Experts with a resident copy now.
    pub fn resident_count(&self) -> usize {
        self.state.lock().expect("expert state").slots.len()
    }

    /// Where this layer's calls spent their time so far.
    pub fn times(&self) -> ForwardTimes {
        self.state.lock().expect("expert state").times
    }

    /// Records the timeline of each following CPU experts call (see
    /// [`crate::backend::cpu::experts::timeline`]), for [`Self::take_cpu_calls`].
    pub fn record_cpu_calls(&self) {
        self.state.lock().expect("expert state").cpu_calls = Some(Vec::new());
    }

    /// The CPU calls' timelines recorded since the last take (none unless recording).
    pub fn take_cpu_calls(&self) -> Vec<CallSummary> {
        let mut st = self.state.lock().expect("expert state");
        st.cpu_calls
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }
}

impl<M> Resident<M> {
    fn drop_slot(&mut self, e: u32) {
        if let Some(s) = self.slot_of[e as usize].take() {
            let s = s as usize;
            self.slots.swap_remove(s);
            self.slot_expert.swap_remove(s);
            if let Some(&moved) = self.slot_expert.get(s) {
                self.slot_of[moved as usize] = Some(s as u32);
            }
        }
    }
}

impl<B: Backend> RoutedExperts<B> for HybridExperts<B> {
    fn forward(&self, b: &B, x: &B::Act, routing: &MoeRouting) -> B::Act {
        self.forward_overlapped(b, x, routing, &mut || {})
    }

    fn forward_overlapped(
        &self,
        b: &B,
        x: &B::Act,
        routing: &MoeRouting,
        queue_device_work: &mut dyn FnMut(),
    ) -> B::Act {
        let (n, hidden) = b.shape(x);
        let mut guard = self.state.lock().expect("expert state");
        // Through a plain reference, so that fields can be borrowed apart.
        let st = &mut *guard;
        let mut clock = Instant::now();
        let mut lap = || {
            let now = Instant::now();
            let s = (now - clock).as_secs_f64();
            clock = now;
            s
        };
        // 1. Where each expert is this step (and what the cache wants copied in after it).
        let admit = match &self.placement {
            Placement::Fixed(_) => Vec::new(),
            Placement::Cached(cache) => {
                let mut c = cache.lock().expect("expert cache");
                if self.layer == 0 {
                    c.advance(n);
                }
                c.observe(self.layer, &routing.experts);
                // Slots given up by this or an earlier layer's decision.
                let stale: Vec<u32> = st
                    .slot_expert
                    .iter()
                    .copied()
                    .filter(|&e| !c.is_resident(self.layer, e))
                    .collect();
                for e in stale {
                    st.drop_slot(e);
                }
                // What the cache holds resident without a copy here: admitted just now, or
                // earlier by a lookahead prefetch or a returning session's heat.
                c.resident_in(self.layer)
                    .into_iter()
                    .filter(|&e| st.slot_of[e as usize].is_none())
                    .collect()
            }
        };
        let split = split_routing(routing, |e| st.slot_of[e as usize].is_some());
        let mut t = ForwardTimes {
            calls: 1,
            policy_s: lap(),
            ..ForwardTimes::default()
        };
        // The host copy first: reading `x` back waits for the device, and the resident work
        // launched next must overlap the CPU's share rather than precede it.
        let x_host = split.host.as_ref().map(|_| b.to_host(x));
        t.read_x_s = lap();

        // 2. The caller's device work, then the resident pairs on the backend over the compact
        // slot list (asynchronous on a GPU); returns the resident output and the two queuing
        // times.
        let (slots, slot_of) = (&st.slots, &st.slot_of);
        let mut queue_device = || -> (B::Act, f64, f64) {
            let start = Instant::now();
            queue_device_work();
            let caller_done = Instant::now();
            let out = match &split.resident {
                Some(r) => {
                    let compact = MoeRouting {
                        top_k: r.top_k,
                        experts: r
                            .experts
                            .iter()
                            .map(|&e| slot_of[e as usize].expect("resident expert has a slot"))
                            .collect(),
                        weights: r.weights.clone(),
                    };
                    if self.interleaved {
                        b.moe_experts_interleaved(x, &compact, slots).expect(
                            "the backend takes interleaved experts (checked at construction)",
                        )
                    } else {
                        b.moe_experts(x, &compact, slots)
                    }
                }
                None => b.zeros(n, hidden),
            };
            let resident_s = caller_done.elapsed().as_secs_f64();
            (out, (caller_done - start).as_secs_f64(), resident_s)
        };

        // 3. Host pairs on the CPU expert kernels. The workers start on them first; the
        // calling thread queues the device work of step 2 meanwhile, submits it, then joins
        // them: the launch cost overlaps the CPU's work instead of preceding it, and the
        // device runs that work while the CPU computes.
        let out = match (&split.host, &x_host) {
            (Some(h), Some(x_host)) => {
                let pairs = h.experts.len();
                if st.scratch.is_none() || st.scratch_pairs < pairs {
                    st.scratch = Some(MoeScratch::new(
                        self.host.layout.shape,
                        self.host.experts,
                        n,
                        h.top_k,
                        self.pool.threads(),
                    ));
                    st.scratch_pairs = n * h.top_k;
                }
                let scratch = st.scratch.as_mut().expect("sized above");
                if st.cpu_calls.is_some() && scratch.timeline().is_none() {
                    scratch.record_timeline(true);
                }
                let mut y = vec![0f32; n * hidden];
                let mut queued = None;
                experts::moe_experts_overlapping(
                    &self.pool,
                    self.isa,
                    &self.host,
                    x_host,
                    &h.experts,
                    &h.weights,
                    h.top_k,
                    &mut y,
                    scratch,
                    || {
                        let (out, caller_s, resident_s) = queue_device();
                        let submit_start = Instant::now();
                        b.submit();
                        let submit_s = submit_start.elapsed().as_secs_f64();
                        queued = Some((out, caller_s, resident_s + submit_s));
                    },
                )
                .expect("host experts: shapes were checked at load");
                t.cpu_experts_s = lap();
                if let (Some(calls), Some(timeline)) = (st.cpu_calls.as_mut(), scratch.timeline()) {
                    calls.push(timeline.summary());
                }
                let (mut out, caller_s, resident_s) =
                    queued.expect("the pool runs the caller's work");
                t.caller_queue_s = caller_s;
                t.resident_queue_s = resident_s;
                t.queued_during_cpu_s = caller_s + resident_s;
                b.add_assign(&mut out, &b.from_host(n, hidden, &y));
                t.merge_s = lap();
                out
            }
            _ => {
                let (out, caller_s, resident_s) = queue_device();
                t.caller_queue_s = caller_s;
                t.resident_queue_s = resident_s;
                lap(); // the two above
                out
            }
        };

        // 4. Copy in what the cache admitted (used from the next step).
        for e in admit {
            if st.upload_refused || st.slot_of[e as usize].is_some() {
                continue;
            }
            match upload_as(b, &self.host, e as usize, self.interleaved) {
                Ok(m) => {
                    st.slot_of[e as usize] = Some(st.slots.len() as u32);
                    st.slots.push(m);
                    st.slot_expert.push(e);
                }
                Err(err) => {
                    // Correct either way (the expert runs on the host); only slower.
                    tracing::warn!(
                        "layer {}: expert cache copies stop at {} resident experts: {err:#}",
                        self.layer,
                        st.slots.len()
                    );
                    st.upload_refused = true;
                }
            }
        }
        t.admit_s = lap();
        st.times.add(&t);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::experts::{ExpertLayout, RowFormat};
    use crate::backend::cpu::CpuBackend;
    use crate::quant::GgmlType;

    const HIDDEN: usize = 64;
    const EXPERTS: usize = 6;

    fn host_set() -> Arc<ExpertSet> {
        let shape = ExpertShape {
            hidden: HIDDEN,
            intermediate: 32,
        };
        let fmt = RowFormat::Ggml(GgmlType::Q8_0);
        let mut set = ExpertSet::zeroed(ExpertLayout::new(fmt, fmt, shape).unwrap(), EXPERTS);
        set.randomize(4);
        Arc::new(set)
    }

    /// Three rows: one split across the sides, one resident only, one host only.
    fn routing() -> MoeRouting {
        MoeRouting {
            top_k: 2,
            experts: vec![0, 1, 2, 4, 3, 5],
            weights: vec![0.6, 0.4, 0.7, 0.3, 0.5, 0.5],
        }
    }

    fn input(b: &CpuBackend, n: usize) -> (Vec<f32>, <CpuBackend as Backend>::Act) {
        let x: Vec<f32> = (0..n * HIDDEN)
            .map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0)
            .collect();
        let act = b.from_host(n, HIDDEN, &x);
        (x, act)
    }

    /// Publishing the host experts first and queuing the resident ones from inside the pool
    /// call adds the same two partial sums, in the same order, as running the sides one after
    /// the other; the queuing is timed inside the CPU phase and counted once.
    #[test]
    fn mixed_placement_adds_the_same_partial_sums_and_counts_the_overlap_once() {
        let b = CpuBackend::new();
        let set = host_set();
        let resident: Vec<bool> = (0..EXPERTS).map(|e| e % 2 == 0).collect();
        let routing = routing();
        let n = routing.experts.len() / routing.top_k;
        let (x_host, x) = input(&b, n);
        for threads in [1, 3] {
            let pool = Arc::new(ExpertPool::new(threads, false));
            let layer = HybridExperts::new(
                &b,
                0,
                set.clone(),
                pool.clone(),
                Isa::detect(),
                Placement::Fixed(resident.clone()),
            )
            .unwrap();
            let got = b.to_host(&layer.forward(&b, &x, &routing));

            let split = split_routing(&routing, |e| resident[e as usize]);
            let slots: Vec<_> = (0..EXPERTS)
                .filter(|&e| resident[e])
                .map(|e| upload(&b, &set, e).unwrap())
                .collect();
            let slot_of = |e: u32| (0..e as usize).filter(|&f| resident[f]).count() as u32;
            let r = split.resident.unwrap();
            let compact = MoeRouting {
                top_k: r.top_k,
                experts: r.experts.iter().map(|&e| slot_of(e)).collect(),
                weights: r.weights.clone(),
            };
            let mut want = b.moe_experts(&x, &compact, &slots);
            let h = split.host.unwrap();
            let mut y = vec![0f32; n * HIDDEN];
            let mut scratch = MoeScratch::new(set.layout.shape, EXPERTS, n, h.top_k, threads);
            experts::moe_experts(
                &pool,
                Isa::detect(),
                &set,
                &x_host,
                &h.experts,
                &h.weights,
                h.top_k,
                &mut y,
                &mut scratch,
            )
            .unwrap();
            b.add_assign(&mut want, &b.from_host(n, HIDDEN, &y));
            let want = b.to_host(&want);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits()),
                "{threads} threads: the hybrid forward differs from the two sides in turn"
            );

            let t = layer.times();
            assert_eq!(t.calls, 1);
            assert!(t.resident_queue_s > 0.0, "{t:?}");
            // `forward` hands no device work of the caller's: its empty call is all there is.
            assert_eq!(
                t.queued_during_cpu_s,
                t.caller_queue_s + t.resident_queue_s,
                "{t:?}"
            );
            assert!(t.queued_during_cpu_s <= t.cpu_experts_s, "{t:?}");
            let once = t.policy_s + t.read_x_s + t.cpu_experts_s + t.merge_s + t.admit_s;
            assert!((t.total_s() - once).abs() < 1e-12, "{t:?}");
        }
    }

    /// With every expert resident nothing runs on the CPU: the resident queuing is a phase
    /// of its own.
    #[test]
    fn all_resident_queues_outside_the_cpu_phase() {
        let b = CpuBackend::new();
        let set = host_set();
        let routing = routing();
        let (_, x) = input(&b, routing.experts.len() / routing.top_k);
        let pool = Arc::new(ExpertPool::new(2, false));
        let layer = HybridExperts::new(
            &b,
            0,
            set,
            pool,
            Isa::detect(),
            Placement::Fixed(vec![true; EXPERTS]),
        )
        .unwrap();
        layer.forward(&b, &x, &routing);
        let t = layer.times();
        assert!(t.resident_queue_s > 0.0, "{t:?}");
        assert_eq!(t.cpu_experts_s, 0.0, "{t:?}");
        assert_eq!(t.queued_during_cpu_s, 0.0, "{t:?}");
    }
}
