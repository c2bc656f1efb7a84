//! Page-locking host memory the GPU copies from (the hybrid host expert store).
//!
//! `cuMemHostRegister` pins memory that is already allocated, so the expert store is loaded
//! once, in place, and then registered: no second copy in a `cuMemHostAlloc` buffer.

use super::CudaBackend;
use crate::backend::HostPin;
use anyhow::{Context, Result};
use cudarc::driver::{sys as drv_sys, CudaContext};
use std::sync::Arc;

/// A registration, undone when dropped.
struct Registered {
    ctx: Arc<CudaContext>,
    ptr: usize,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
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
        Ok(HostPin::new(
            bytes.len(),
            Box::new(Registered {
                ctx,
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
