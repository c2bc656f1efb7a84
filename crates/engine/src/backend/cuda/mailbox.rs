//! The GPU side of the tensor-parallel exchange (parallel/exchange.rs has the layout and the
//! host side): a mailbox in page-locked host memory mapped into the device's address space,
//! and the three kernels of kernels/mailbox.cu queued on a rank's stream per all-reduce step.
//! Nothing here waits on the host, so the exchange stays in stream order and can be captured
//! in a CUDA graph; the step counter lives in device memory for the same reason.

use super::{ceil_div, CudaBackend, CudaTensor, DevBuf};
use crate::parallel::exchange::{HostRegion, MailboxLayout};
use anyhow::{bail, Context, Result};
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext};
use std::ffi::c_void;
use std::sync::Arc;

/// Zeroed page-locked host memory that every context can map (`cuMemHostAlloc` with
/// `DEVICEMAP | PORTABLE`); freed when dropped.
pub struct MappedRegion {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the region is plain host memory owned by this value; concurrent access goes through
// atomics (host side) or the kernels' volatile loads and system fences (device side).
unsafe impl Send for MappedRegion {}
unsafe impl Sync for MappedRegion {}

impl MappedRegion {
    /// `bytes` of zeroed mapped memory, allocated in `backend`'s context.
    pub fn new(backend: &CudaBackend, bytes: usize) -> Result<Self> {
        backend.bind();
        let len = bytes.max(8);
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-parameter; the flags ask for portable, device-mapped pinned memory.
        unsafe {
            drv_sys::cuMemHostAlloc(
                &mut p,
                len,
                drv_sys::CU_MEMHOSTALLOC_DEVICEMAP | drv_sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .result()
        .with_context(|| {
            format!("cuMemHostAlloc of {len} bytes (mapped, portable) for the tensor-parallel mailbox failed")
        })?;
        // SAFETY: `p` points at `len` bytes just allocated.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, len) };
        Ok(MappedRegion {
            ptr: p as *mut u8,
            len,
            ctx: backend.inner.ctx.clone(),
        })
    }

    /// The address kernels of `backend`'s context use for the region's first byte.
    pub fn device_ptr(&self, backend: &CudaBackend) -> Result<u64> {
        backend.bind();
        let mut d: drv_sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a live mapped allocation; flags must be 0.
        unsafe { drv_sys::cuMemHostGetDevicePointer_v2(&mut d, self.ptr as *mut c_void, 0) }
            .result()
            .context("cuMemHostGetDevicePointer for the tensor-parallel mailbox failed")?;
        Ok(d)
    }

    /// The u64 at byte `offset` as the device last wrote it (a volatile read).
    pub fn read_u64(&self, offset: usize) -> u64 {
        assert!(offset + 8 <= self.len && offset.is_multiple_of(8));
        // SAFETY: in bounds and aligned (checked); the device writes it with system fences.
        unsafe { std::ptr::read_volatile(self.ptr.add(offset) as *const u64) }
    }
}

impl HostRegion for MappedRegion {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for MappedRegion {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once here.
        let _ = unsafe { drv_sys::cuMemFreeHost(self.ptr as *mut c_void) };
    }
}

/// One rank's handles on a mapped mailbox: device addresses of the mailbox and of the rank's
/// status words, and its step counter in device memory.
pub struct MailboxDevice {
    layout: MailboxLayout,
    rank: usize,
    mailbox: u64,
    status: u64,
    step: DevBuf,
    timeout_ns: u64,
}

impl MailboxDevice {
    /// `mailbox` laid out as `layout`; `status` two u64 words (step, missing rank + 1) this
    /// rank's wait kernel writes on failure.
    pub fn new(
        backend: &CudaBackend,
        layout: MailboxLayout,
        rank: usize,
        mailbox: &MappedRegion,
        status: (&MappedRegion, usize),
        timeout_ns: u64,
    ) -> Result<Self> {
        if rank >= layout.ranks {
            bail!(
                "rank {rank} does not exist: the mailbox has {} ranks",
                layout.ranks
            );
        }
        if mailbox.len() < layout.bytes() || status.1 + 16 > status.0.len() {
            bail!(
                "mapped mailbox of {} bytes is smaller than its layout ({} bytes), or the status words lie outside their region",
                mailbox.len(),
                layout.bytes()
            );
        }
        let step = backend.try_alloc(8, "tensor-parallel step counter", true)?;
        backend.queue_work();
        // SAFETY: the 8-byte allocation above.
        unsafe { drv::memset_d8_async(step.ptr, 0, 8, backend.stream()) }
            .context("clearing the tensor-parallel step counter")?;
        Ok(MailboxDevice {
            layout,
            rank,
            mailbox: mailbox.device_ptr(backend)?,
            status: status.0.device_ptr(backend)? + status.1 as u64,
            step,
            timeout_ns,
        })
    }
}

impl CudaBackend {
    /// Queues one all-reduce step over `n` values of `x` from value `offset` (at most the
    /// mailbox's capacity): copy them into this rank's slot, publish the step, wait for every
    /// rank, and write the rank-ordered sum back in place. On timeout or abort the wait kernel
    /// leaves `x` as it was and writes the status words.
    pub fn mailbox_all_reduce_step(
        &self,
        x: &CudaTensor,
        offset: usize,
        n: usize,
        mb: &MailboxDevice,
    ) {
        assert!(
            offset + n <= x.len() && n <= mb.layout.capacity,
            "mailbox step of {n} values at {offset}: the tensor has {}, a slot holds {}",
            x.len(),
            mb.layout.capacity
        );
        if n == 0 {
            return;
        }
        let values: u64 = x.ptr() + 4 * offset as u64;
        let (ranks, rank) = (mb.layout.ranks as i32, mb.rank as i32);
        let (capacity, len) = (mb.layout.capacity as i64, n as i64);
        let (mailbox, step, status, timeout) = (mb.mailbox, mb.step.ptr, mb.status, mb.timeout_ns);
        // Each argument passed by address, as cuLaunchKernel takes them.
        let launch = |name: &str, grid: u32, block: u32, args: &[&dyn std::any::Any]| {
            let mut params: Vec<*mut c_void> = args
                .iter()
                .map(|a| *a as *const dyn std::any::Any as *const c_void as *mut c_void)
                .collect();
            self.launch_raw(name, (grid, 1, 1), (block, 1, 1), 0, &mut params);
        };
        let blocks = ceil_div(n, 256).clamp(1, 1024) as u32;
        launch(
            "mailbox_write",
            blocks,
            256,
            &[&values, &mailbox, &step, &ranks, &rank, &capacity, &len],
        );
        launch(
            "mailbox_signal",
            1,
            1,
            &[&mailbox, &step, &ranks, &rank, &len],
        );
        // Few blocks: each one's first thread polls host memory over the bus while it waits.
        let wait_blocks = ceil_div(n, 256).clamp(1, 16) as u32;
        launch(
            "mailbox_wait_sum",
            wait_blocks,
            256,
            &[
                &mailbox, &step, &ranks, &rank, &capacity, &len, &values, &timeout, &status,
            ],
        );
    }
}
