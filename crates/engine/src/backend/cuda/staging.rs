//! Large host↔device copies through two page-locked staging buffers.
//!
//! A copy from pageable memory is staged by the driver through its own pinned bounce buffer on
//! one thread: about 8.6 GB/s on the H200 box, so importing a 30K-token conversation (4 GB of
//! KV) took 470 ms and dominated resuming it from RAM or disk. Here the host side is copied by
//! several threads into one page-locked buffer while the DMA engine moves the other, so the
//! copy runs at PCIe speed instead of at one core's memcpy speed.
//!
//! The buffers are allocated on the first large copy; when page-locked memory cannot be had
//! (an `ulimit -l` or a full machine) copies fall back to the driver's pageable path.

use anyhow::{bail, Result};
use cudarc::driver::{sys as drv_sys, CudaContext};
use std::ffi::c_void;
use std::sync::Arc;

/// Copies from this size up go through the staging buffers (a 27B GDN layer's recurrent state
/// is 3 MiB, and a state export is 48 of them); smaller ones (per-step tables, parameter
/// vectors) are not worth the synchronisation.
pub(super) const STAGED_MIN_BYTES: usize = 1 << 20;
/// Bytes of each of the two staging buffers.
const STAGE_BYTES: usize = 32 << 20;
/// Pieces below this are copied by the calling thread alone (starting threads costs more than
/// it saves). A fresh destination page-faults as it is filled, which several threads do faster.
const PARALLEL_MIN_BYTES: usize = 1 << 20;

fn check(r: drv_sys::CUresult, what: &str) -> Result<()> {
    if r == drv_sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        bail!("{what} failed: {r:?}")
    }
}

/// `dst ← src` split over up to `threads` threads (equal page-aligned slices).
pub(super) fn parallel_copy(dst: &mut [u8], src: &[u8], threads: usize) {
    assert_eq!(dst.len(), src.len(), "parallel_copy: lengths differ");
    if threads <= 1 || src.len() < PARALLEL_MIN_BYTES {
        dst.copy_from_slice(src);
        return;
    }
    let per = src.len().div_ceil(threads).next_multiple_of(4096);
    std::thread::scope(|s| {
        for (d, from) in dst.chunks_mut(per).zip(src.chunks(per)) {
            s.spawn(move || d.copy_from_slice(from));
        }
    });
}

struct Stage {
    host: *mut u8,
    /// Recorded after the last copy that used `host`; waited on before `host` is reused.
    done: drv_sys::CUevent,
}

impl Stage {
    /// Waits until the last copy that used this stage's buffer has finished, so the buffer can
    /// be reused (upload) or read (download).
    fn wait(&self) -> Result<()> {
        // SAFETY: the event belongs to this stage (recorded, or never: then it returns at once).
        check(
            unsafe { drv_sys::cuEventSynchronize(self.done) },
            "waiting for a staged copy",
        )
    }
}

enum Buffers {
    NotYet,
    Ready([Stage; 2]),
    /// Allocation failed once; the reason was logged and pageable copies are used.
    Unavailable,
}

pub(super) struct TransferStaging {
    ctx: Arc<CudaContext>,
    buffers: Buffers,
    next: usize,
    threads: usize,
}

// SAFETY: the raw pointers are page-locked buffers and events owned by this struct; it is only
// used under the backend's mutex.
unsafe impl Send for TransferStaging {}

impl TransferStaging {
    pub(super) fn new(ctx: Arc<CudaContext>) -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        TransferStaging {
            ctx,
            buffers: Buffers::NotYet,
            next: 0,
            threads,
        }
    }

    /// The two stages, allocating them on first use; `None` when page-locked memory is not
    /// available (the caller copies from pageable memory instead).
    fn stages(&mut self) -> Option<&[Stage; 2]> {
        if let Buffers::NotYet = self.buffers {
            self.buffers = match Self::allocate() {
                Ok(s) => Buffers::Ready(s),
                Err(e) => {
                    tracing::warn!(
                        "large host↔device copies use pageable memory (slower): {e:#}; raise the \
                         locked-memory limit (ulimit -l) for page-locked staging"
                    );
                    Buffers::Unavailable
                }
            };
        }
        match &self.buffers {
            Buffers::Ready(s) => Some(s),
            _ => None,
        }
    }

    fn allocate() -> Result<[Stage; 2]> {
        let one = || -> Result<Stage> {
            let mut host: *mut c_void = std::ptr::null_mut();
            // SAFETY: plain page-locked allocation, freed in Drop.
            check(
                unsafe { drv_sys::cuMemHostAlloc(&mut host, STAGE_BYTES, 0) },
                "cuMemHostAlloc of a 32 MiB copy staging buffer",
            )?;
            let mut done: drv_sys::CUevent = std::ptr::null_mut();
            // SAFETY: creates an event owned by the returned stage.
            let r = unsafe {
                drv_sys::cuEventCreate(
                    &mut done,
                    drv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            };
            if let Err(e) = check(r, "cuEventCreate for copy staging") {
                // SAFETY: allocated just above, not used by anything.
                let _ = unsafe { drv_sys::cuMemFreeHost(host) };
                return Err(e);
            }
            Ok(Stage {
                host: host as *mut u8,
                done,
            })
        };
        let a = one()?;
        match one() {
            Ok(b) => Ok([a, b]),
            Err(e) => {
                free_stage(&a);
                Err(e)
            }
        }
    }

    /// Queues `dst ← src` on `stream`; returns `false` (nothing queued) when staging is not
    /// available. `src` may be dropped when this returns: it has been copied into the stages.
    ///
    /// # Safety
    /// `dst` must hold `src.len()` bytes of device memory of this context.
    pub(super) unsafe fn upload(
        &mut self,
        dst: drv_sys::CUdeviceptr,
        src: &[u8],
        stream: drv_sys::CUstream,
    ) -> Result<bool> {
        let threads = self.threads;
        let mut next = self.next;
        let Some(stages) = self.stages() else {
            return Ok(false);
        };
        for (i, piece) in src.chunks(STAGE_BYTES).enumerate() {
            let st = &stages[next];
            next ^= 1;
            st.wait()?;
            // SAFETY: the stage holds STAGE_BYTES ≥ piece.len() bytes and no copy reads it now.
            let host = unsafe { std::slice::from_raw_parts_mut(st.host, piece.len()) };
            parallel_copy(host, piece, threads);
            let at = dst + (i * STAGE_BYTES) as u64;
            // SAFETY: `at..at+len` lies inside `dst` (the caller's guarantee); the stage stays
            // untouched until `done` has passed this copy.
            check(
                unsafe {
                    drv_sys::cuMemcpyHtoDAsync_v2(at, st.host as *const c_void, piece.len(), stream)
                },
                "host-to-device copy from staging",
            )?;
            check(
                unsafe { drv_sys::cuEventRecord(st.done, stream) },
                "recording a staged copy",
            )?;
        }
        self.next = next;
        Ok(true)
    }

    /// `dst ← src`, waiting for everything queued on `stream` before it; returns `false`
    /// (nothing copied) when staging is not available.
    ///
    /// # Safety
    /// `src` must hold `dst.len()` bytes of device memory of this context.
    pub(super) unsafe fn download(
        &mut self,
        dst: &mut [u8],
        src: drv_sys::CUdeviceptr,
        stream: drv_sys::CUstream,
    ) -> Result<bool> {
        let threads = self.threads;
        let mut next = self.next;
        let Some(stages) = self.stages() else {
            return Ok(false);
        };
        // The piece copied last, still to be moved out of its stage: (stage, dst piece).
        let mut pending: Option<(usize, &mut [u8])> = None;
        let drain = |stage: &Stage, out: &mut [u8]| -> Result<()> {
            stage.wait()?;
            // SAFETY: the copy into the stage has finished; it holds `out.len()` bytes.
            let host = unsafe { std::slice::from_raw_parts(stage.host, out.len()) };
            parallel_copy(out, host, threads);
            Ok(())
        };
        for (i, piece) in dst.chunks_mut(STAGE_BYTES).enumerate() {
            let s = next;
            next ^= 1;
            let st = &stages[s];
            st.wait()?;
            let from = src + (i * STAGE_BYTES) as u64;
            // SAFETY: `from..from+len` lies inside `src` (the caller's guarantee); the stage
            // holds STAGE_BYTES bytes.
            check(
                unsafe {
                    drv_sys::cuMemcpyDtoHAsync_v2(st.host as *mut c_void, from, piece.len(), stream)
                },
                "device-to-host copy into staging",
            )?;
            check(
                unsafe { drv_sys::cuEventRecord(st.done, stream) },
                "recording a staged copy",
            )?;
            if let Some((p, out)) = pending.take() {
                drain(&stages[p], out)?;
            }
            pending = Some((s, piece));
        }
        if let Some((p, out)) = pending.take() {
            drain(&stages[p], out)?;
        }
        self.next = next;
        Ok(true)
    }
}

fn free_stage(s: &Stage) {
    // SAFETY: both were created by `allocate`; freed once. The owner synchronised its stream.
    unsafe {
        let _ = drv_sys::cuEventSynchronize(s.done);
        let _ = drv_sys::cuEventDestroy_v2(s.done);
        let _ = drv_sys::cuMemFreeHost(s.host as *mut c_void);
    }
}

impl Drop for TransferStaging {
    fn drop(&mut self) {
        if let Buffers::Ready(stages) = &self.buffers {
            let _ = self.ctx.bind_to_thread();
            for s in stages {
                free_stage(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_copy_matches_a_plain_copy_for_any_size_and_thread_count() {
        for len in [
            0usize,
            1,
            4095,
            PARALLEL_MIN_BYTES - 1,
            PARALLEL_MIN_BYTES,
            9 << 20 | 7,
        ] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            for threads in [1, 2, 3, 8] {
                let mut dst = vec![0u8; len];
                parallel_copy(&mut dst, &src, threads);
                assert!(dst == src, "len {len}, threads {threads}");
            }
        }
    }
}
