//! The CUDA side of the exchange: the mailbox kernel's source (`kernels/mailbox.cu`, flag spin
//! on mapped host memory, replayable inside CUDA graphs) and the GPU count check for `--tp`.
//!
//! What runs today on CUDA ranks is the stream-ordered staged path: [`super::HostExchange`]
//! copies each partial sum to the host (`to_host` waits for the rank's stream), sums it in the
//! host mailbox, and copies the result back. Wiring the mailbox kernel into the CUDA backend's
//! activations (and the startup probe that picks it over the staged path) needs two GPUs to
//! measure and is not done; see the note of issue 11.

use crate::backend::cuda::kernels::KernelSource;
use anyhow::{bail, Result};

/// `kernels/mailbox.cu` as an NVRTC source with its entry points.
pub fn mailbox_kernels() -> KernelSource {
    KernelSource {
        name: "mailbox",
        source: include_str!("../../../../kernels/mailbox.cu").to_string(),
        functions: ["mailbox_write", "mailbox_signal", "mailbox_wait_sum"]
            .map(String::from)
            .to_vec(),
    }
}

/// GPUs the driver shows this process (after `CUDA_VISIBLE_DEVICES`).
pub fn gpu_count() -> Result<usize> {
    // Checks that a driver loads first (counting without one would panic inside cudarc).
    crate::backend::cuda::driver_version()?;
    cudarc::driver::CudaContext::device_count()
        .map(|n| n as usize)
        .map_err(|e| anyhow::anyhow!("cannot count CUDA devices (cuDeviceGetCount): {e}"))
}

/// Refuses `--tp ranks` when fewer GPUs than ranks are visible.
pub fn check_gpus(ranks: usize, visible: usize) -> Result<()> {
    if visible < ranks {
        bail!(
            "--tp {ranks} needs {ranks} GPUs, one per rank, but {visible} {} visible (check CUDA_VISIBLE_DEVICES); use --tp {} or --backend cpu (which runs {ranks} rank threads)",
            if visible == 1 { "is" } else { "are" },
            visible.max(1)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_few_gpus_are_refused_with_the_counts() {
        let e = check_gpus(2, 1).unwrap_err().to_string();
        assert!(
            e.contains("--tp 2 needs 2 GPUs") && e.contains("1 is visible"),
            "{e}"
        );
        assert!(check_gpus(2, 2).is_ok());
        assert!(check_gpus(1, 8).is_ok());
    }

    #[test]
    fn the_mailbox_source_defines_its_entry_points() {
        let k = mailbox_kernels();
        for f in &k.functions {
            assert!(
                k.source.contains(&format!("void {f}(")),
                "kernels/mailbox.cu lacks {f}"
            );
        }
    }
}
