//! Decode steps as CUDA graphs: recorded by stream capture, replayed as one launch.
//!
//! A batch-1 decode step of the 27B queues about 1,700 small kernels. Launched one by one,
//! each costs the host several microseconds and leaves the GPU a gap; a graph launches them
//! back to back. With graphs on, the backend *records* the step's work instead of launching
//! it (stream capture, relaxed mode) and launches the recording when the host needs a result
//! ([`Backend::to_host`], `synchronize`) or asks for the work to start
//! ([`Backend::submit`], before long host work that should overlap it).
//!
//! The model code does not change: every step is recorded again, and the executable graph of
//! the previous step at the same point is updated in place (`cuGraphExecUpdate`: same
//! topology, new kernel arguments such as the KV length), which costs far less than
//! instantiating a new one. Only a step whose shape changed (a grown KV cache, a different
//! split) instantiates anew.
//!
//! Recording starts at an embedding of at most [`super::MATVEC_MAX_ROWS`] tokens (a decode
//! step) and never during prefill, whose few large GEMMs gain nothing from it. While
//! recording, nothing may wait for the device or read pageable host memory: host data goes
//! through [`StagingArena`] (page-locked, valid until the recording has run), allocations
//! that miss the buffer pool use the synchronous allocator, and frees wait for the flush.
//!
//! [`Backend::to_host`]: crate::backend::Backend::to_host
//! [`Backend::submit`]: crate::backend::Backend::submit

use anyhow::{bail, Result};
use cudarc::driver::sys as drv_sys;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// `CAPY_CUDA_GRAPHS=1` turns graphs on; unset or `0`, every op is launched as it comes.
/// Off by default until a step's graph is reliably updated in place: on the 27B at 8K context
/// every step still instantiates anew, which costs more than the launches it saves
/// (bench/results/gpu-qwen3.8-27b-*-h200box.json, `graphs_over_eager_speedup_ratio`).
pub fn graphs_requested() -> bool {
    graphs_on(std::env::var("CAPY_CUDA_GRAPHS").ok().as_deref())
}

fn graphs_on(value: Option<&str>) -> bool {
    matches!(value.map(str::trim), Some("1" | "true" | "on" | "yes"))
}

/// Counters for benchmarks and `/metrics`.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GraphStats {
    /// Recordings launched as graphs.
    pub launched: u64,
    /// Of those, how many reused the previous executable graph by an in-place update.
    pub updated: u64,
    /// And how many needed a fresh instantiation.
    pub instantiated: u64,
    /// Work items (kernels, copies, memsets) in all launched graphs.
    pub nodes: u64,
    /// Host time recording (first captured item to the end of capture), in nanoseconds.
    pub record_ns: u64,
    /// Host time ending captures, updating or instantiating, and launching, in nanoseconds.
    pub flush_ns: u64,
    /// Why the last in-place update was refused (result and the node type it stopped at).
    pub last_update_refusal: Option<String>,
}

fn check(r: drv_sys::CUresult, what: &str) -> Result<()> {
    if r == drv_sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        bail!("{what} failed: {r:?} (unset CAPY_CUDA_GRAPHS to launch every op directly)")
    }
}

struct ExecGraph(drv_sys::CUgraphExec);
// SAFETY: an executable graph is a driver handle usable from any thread of its context; it
// is only touched under the recorder's mutex.
unsafe impl Send for ExecGraph {}

/// Page-locked host memory for the host data of recorded copies: a captured copy reads its
/// source when the graph runs, so the bytes must stay put until then, and pageable memory
/// cannot be captured at all. Chunks are kept and reused after every synchronisation.
pub(super) struct StagingArena {
    chunks: Vec<(*mut u8, usize)>,
    /// Chunk being filled and the offset in it.
    at: (usize, usize),
}

// SAFETY: the chunks are plain page-locked host memory owned by the arena.
unsafe impl Send for StagingArena {}

const STAGING_CHUNK: usize = 4 << 20;

impl StagingArena {
    fn new() -> Self {
        StagingArena {
            chunks: Vec::new(),
            at: (0, 0),
        }
    }

    /// Copies `bytes` into page-locked memory that stays valid until [`Self::reset`].
    fn stage(&mut self, bytes: &[u8]) -> Result<*const u8> {
        let need = bytes.len().next_multiple_of(256);
        loop {
            let (chunk, off) = self.at;
            if let Some(&(base, size)) = self.chunks.get(chunk) {
                if off + need <= size {
                    // SAFETY: `off + len ≤ size` bytes lie inside the chunk; the chunk and
                    // `bytes` do not overlap (one is ours, page-locked).
                    unsafe {
                        let dst = base.add(off);
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len());
                        self.at = (chunk, off + need);
                        return Ok(dst);
                    }
                }
                self.at = (chunk + 1, 0);
                continue;
            }
            let size = STAGING_CHUNK.max(need);
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: plain page-locked allocation, freed in Drop.
            check(
                unsafe { drv_sys::cuMemHostAlloc(&mut p, size, 0) },
                "cuMemHostAlloc for graph staging",
            )?;
            self.chunks.push((p as *mut u8, size));
        }
    }

    fn reset(&mut self) {
        self.at = (0, 0);
    }
}

impl Drop for StagingArena {
    fn drop(&mut self) {
        for &(p, _) in &self.chunks {
            // SAFETY: allocated by cuMemHostAlloc above; the stream was synchronised before the
            // backend dropped its recorder.
            let _ = unsafe { drv_sys::cuMemFreeHost(p as *mut c_void) };
        }
    }
}

struct RecorderState {
    /// A decode step is being recorded (recording resumes after each flush until the next
    /// prefill-sized embedding).
    in_step: bool,
    /// Flushes so far in this step: the index of the executable graph to update next.
    segment: usize,
    /// Executable graphs of the last step, one per segment.
    execs: Vec<ExecGraph>,
    staging: StagingArena,
    /// Device buffers whose free waits for the recording to run.
    deferred_frees: Vec<drv_sys::CUdeviceptr>,
    stats: GraphStats,
}

/// Records and replays decode steps (see the module documentation).
pub(super) struct GraphRecorder {
    enabled: AtomicBool,
    /// The stream is capturing right now (read on every queued work item).
    capturing: AtomicBool,
    /// Work items queued into the current recording.
    pending: AtomicU64,
    /// When the current recording started.
    record_start: Mutex<Option<std::time::Instant>>,
    state: Mutex<RecorderState>,
}

impl GraphRecorder {
    pub(super) fn new(enabled: bool) -> Self {
        GraphRecorder {
            enabled: AtomicBool::new(enabled),
            capturing: AtomicBool::new(false),
            pending: AtomicU64::new(0),
            record_start: Mutex::new(None),
            state: Mutex::new(RecorderState {
                in_step: false,
                segment: 0,
                execs: Vec::new(),
                staging: StagingArena::new(),
                deferred_frees: Vec::new(),
                stats: GraphStats::default(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, RecorderState> {
        self.state.lock().expect("graph recorder poisoned")
    }

    pub(super) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Turns recording on or off; the caller flushes first (work recorded so far still runs).
    pub(super) fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
        if !on {
            self.state().in_step = false;
        }
    }

    pub(super) fn capturing(&self) -> bool {
        self.capturing.load(Ordering::Relaxed)
    }

    pub(super) fn stats(&self) -> GraphStats {
        self.state().stats.clone()
    }

    /// A forward pass starts with an embedding of `rows` tokens: decode-sized steps are
    /// recorded, anything larger runs directly. The caller flushes first.
    pub(super) fn begin_step(&self, rows: usize, max_rows: usize) {
        let mut st = self.state();
        st.in_step = self.enabled() && rows <= max_rows;
        st.segment = 0;
    }

    /// Called before every work item is queued: starts a recording where one is due.
    pub(super) fn before_work(&self, stream: drv_sys::CUstream) {
        if self.capturing() {
            self.pending.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if !self.enabled() || !self.state().in_step {
            return;
        }
        // SAFETY: our own stream, not capturing (checked above; one thread queues work).
        let r = unsafe {
            drv_sys::cuStreamBeginCapture_v2(
                stream,
                drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        };
        check(r, "cuStreamBeginCapture").unwrap_or_else(|e| panic!("{e:#}"));
        self.capturing.store(true, Ordering::Relaxed);
        self.pending.store(1, Ordering::Relaxed);
        *self.record_start.lock().expect("graph recorder poisoned") =
            Some(std::time::Instant::now());
    }

    /// Copies host data for a recorded copy into page-locked staging memory.
    pub(super) fn stage(&self, bytes: &[u8]) -> *const u8 {
        self.state()
            .staging
            .stage(bytes)
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// Frees `ptr` after the recording has run (a free cannot be recorded).
    pub(super) fn defer_free(&self, ptr: drv_sys::CUdeviceptr) {
        self.state().deferred_frees.push(ptr);
    }

    /// Ends the recording and launches it (without waiting). Returns the device buffers whose
    /// free was deferred, for the caller to free in stream order.
    pub(super) fn flush(&self, stream: drv_sys::CUstream) -> Result<Vec<drv_sys::CUdeviceptr>> {
        let mut st = self.state();
        if !self.capturing() {
            return Ok(std::mem::take(&mut st.deferred_frees));
        }
        self.capturing.store(false, Ordering::Relaxed);
        let flush_start = std::time::Instant::now();
        if let Some(t) = self
            .record_start
            .lock()
            .expect("graph recorder poisoned")
            .take()
        {
            st.stats.record_ns += flush_start.duration_since(t).as_nanos() as u64;
        }
        let mut graph: drv_sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing (flag above); the graph is ours to destroy.
        check(
            unsafe { drv_sys::cuStreamEndCapture(stream, &mut graph) },
            "cuStreamEndCapture (recording a decode step)",
        )?;
        let segment = st.segment;
        st.segment += 1;
        let result = self.launch(&mut st, graph, segment, stream);
        // SAFETY: created by the capture above; the executable graph keeps what it needs.
        unsafe { drv_sys::cuGraphDestroy(graph) };
        st.stats.flush_ns += flush_start.elapsed().as_nanos() as u64;
        result?;
        Ok(std::mem::take(&mut st.deferred_frees))
    }

    fn launch(
        &self,
        st: &mut RecorderState,
        graph: drv_sys::CUgraph,
        segment: usize,
        stream: drv_sys::CUstream,
    ) -> Result<()> {
        let mut nodes = 0usize;
        // SAFETY: a valid graph; a null node array asks for the count only.
        check(
            unsafe { drv_sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes) },
            "cuGraphGetNodes",
        )?;
        if nodes == 0 {
            return Ok(());
        }
        let mut updated = false;
        if let Some(exec) = st.execs.get(segment) {
            // SAFETY: both handles are valid; on failure the executable graph is unchanged.
            let mut info: drv_sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
            updated = unsafe { drv_sys::cuGraphExecUpdate_v2(exec.0, graph, &mut info) }
                == drv_sys::CUresult::CUDA_SUCCESS;
            if !updated {
                let mut node_type = drv_sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                if !info.errorNode.is_null() {
                    // SAFETY: a node of `graph`, reported by the failed update.
                    unsafe { drv_sys::cuGraphNodeGetType(info.errorNode, &mut node_type) };
                }
                st.stats.last_update_refusal = Some(format!(
                    "{:?} at a {:?} node (segment {segment}, {nodes} nodes)",
                    info.result, node_type
                ));
            }
        }
        if !updated {
            let mut exec: drv_sys::CUgraphExec = std::ptr::null_mut();
            // SAFETY: a valid graph; the executable graph is destroyed in `Drop` or replaced.
            check(
                unsafe { drv_sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
                "cuGraphInstantiate (a decode step)",
            )?;
            if segment < st.execs.len() {
                let old = std::mem::replace(&mut st.execs[segment], ExecGraph(exec));
                // SAFETY: no launch of the old graph is pending on the host side; the driver
                // defers the destruction of one still running.
                unsafe { drv_sys::cuGraphExecDestroy(old.0) };
            } else {
                st.execs.truncate(segment);
                st.execs.push(ExecGraph(exec));
            }
            st.stats.instantiated += 1;
        } else {
            st.stats.updated += 1;
        }
        // SAFETY: a valid executable graph, launched on our stream.
        check(
            unsafe { drv_sys::cuGraphLaunch(st.execs[segment].0, stream) },
            "cuGraphLaunch (a decode step)",
        )?;
        st.stats.launched += 1;
        st.stats.nodes += nodes as u64;
        Ok(())
    }

    /// After the stream was synchronised: staging memory may be reused.
    pub(super) fn after_sync(&self) {
        self.state().staging.reset();
    }
}

impl Drop for GraphRecorder {
    fn drop(&mut self) {
        let st = self.state.get_mut().expect("graph recorder poisoned");
        for exec in st.execs.drain(..) {
            // SAFETY: created by cuGraphInstantiate; destroyed once.
            unsafe { drv_sys::cuGraphExecDestroy(exec.0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::graphs_on;

    #[test]
    fn graphs_are_off_unless_switched_on() {
        for (value, on) in [
            (None, false),
            (Some("1"), true),
            (Some(" on"), true),
            (Some(""), false),
            (Some("0"), false),
            (Some("off"), false),
            (Some("false"), false),
            (Some("no"), false),
        ] {
            assert_eq!(graphs_on(value), on, "CAPY_CUDA_GRAPHS={value:?}");
        }
    }
}
