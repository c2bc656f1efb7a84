//! Page-locking host memory the GPU copies from (the hybrid host expert store).
//!
//! `cuMemHostRegister` pins memory that is already allocated, so the expert store is loaded
//! once, in place, and then registered: no second copy in a `cuMemHostAlloc` buffer.
//!
//! The registered ranges are also kept in a [`PinnedRanges`] list: a copy whose source lies in
//! one is queued as DMA straight from it (asynchronous to the host, no staging), which is what
//! the VRAM expert cache's admissions need to stay off the CPU workers' cores.

use super::CudaBackend;
use crate::backend::HostPin;
use anyhow::{Context, Result};
use cudarc::driver::{sys as drv_sys, CudaContext};
use std::sync::{Arc, Mutex};

/// Copies from this size up are checked against the registered ranges (the smallest routed
/// expert matrix, an IQ3_S down projection, is about 0.5 MB).
pub(super) const DIRECT_DMA_MIN_BYTES: usize = 64 << 10;

/// Host ranges `[start, end)` registered by [`CudaBackend::pin`] and not yet released.
#[derive(Default)]
pub(super) struct PinnedRanges(Mutex<Vec<(usize, usize)>>);

impl PinnedRanges {
    /// Whether `bytes` lies wholly inside one registered range.
    pub(super) fn contains(&self, bytes: &[u8]) -> bool {
        let (start, end) = (
            bytes.as_ptr() as usize,
            bytes.as_ptr() as usize + bytes.len(),
        );
        self.0
            .lock()
            .expect("pinned ranges poisoned")
            .iter()
            .any(|&(s, e)| s <= start && end <= e)
    }
    fn add(&self, start: usize, len: usize) {
        self.0
            .lock()
            .expect("pinned ranges poisoned")
            .push((start, start + len));
    }
    fn remove(&self, start: usize) {
        self.0
            .lock()
            .expect("pinned ranges poisoned")
            .retain(|&(s, _)| s != start);
    }
}

/// A registration, undone when dropped.
struct Registered {
    ctx: Arc<CudaContext>,
    ranges: Arc<PinnedRanges>,
    ptr: usize,
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Copies are queued straight from this range without waiting: let them finish before
        // the memory goes back to being pageable (and perhaps freed).
        self.ranges.remove(self.ptr);
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        // SAFETY: `ptr` was registered by `pin` below and is unregistered once, here.
        let _ = unsafe { drv_sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
    }
}

impl CudaBackend {
    /// Registers `bytes` with the driver as page-locked, portable across contexts.
    ///
    /// # Safety
    /// `bytes` must stay allocated and in place until the returned pin is dropped.
    pub(super) unsafe fn pin(&self, bytes: &[u8]) -> Result<HostPin> {
        let ctx = self.inner.ctx.clone();
        ctx.bind_to_thread()?;
        // SAFETY: the caller keeps the range alive until the pin (which unregisters it) drops.
        unsafe {
            drv_sys::cuMemHostRegister_v2(
                bytes.as_ptr() as *mut std::ffi::c_void,
                bytes.len(),
                drv_sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .with_context(|| {
            format!(
                "cuMemHostRegister of {:.2} GiB failed (the OS page-locked limit, or RAM itself)",
                bytes.len() as f64 / (1u64 << 30) as f64
            )
        })?;
        let ranges = self.inner.pinned.clone();
        ranges.add(bytes.as_ptr() as usize, bytes.len());
        Ok(HostPin::new(
            bytes.len(),
            Box::new(Registered {
                ctx,
                ranges,
                ptr: bytes.as_ptr() as usize,
            }),
        ))
    }
}

impl CudaBackend {
    /// The driver's view of this device's memory: `(free, total)` bytes (`cuMemGetInfo`), for
    /// checking the VRAM ledger against what the process (and the context) really holds.
    pub fn device_memory_info(&self) -> Result<(u64, u64)> {
        self.inner.ctx.bind_to_thread()?;
        let (free, total) =
            cudarc::driver::result::mem_get_info().context("cuMemGetInfo failed")?;
        Ok((free as u64, total as u64))
    }

    /// Device bytes in use by every process and context on this GPU (`total − free`).
    pub fn device_memory_used(&self) -> Result<u64> {
        let (free, total) = self.device_memory_info()?;
        Ok(total - free)
    }
}

#[cfg(test)]
mod tests {
    use super::PinnedRanges;

    #[test]
    fn a_copy_source_counts_as_pinned_only_wholly_inside_a_live_range() {
        let store = vec![0u8; 4096];
        let ranges = PinnedRanges::default();
        assert!(!ranges.contains(&store[..16]), "nothing registered yet");
        ranges.add(store[1024..].as_ptr() as usize, 2048);
        assert!(ranges.contains(&store[1024..3072]));
        assert!(ranges.contains(&store[2000..2100]));
        assert!(
            !ranges.contains(&store[1000..1100]),
            "starts before the range"
        );
        assert!(!ranges.contains(&store[3000..3100]), "ends after the range");
        ranges.remove(store[1024..].as_ptr() as usize);
        assert!(!ranges.contains(&store[2000..2100]), "released");
    }
}
