//! Tensor parallelism over N ranks (GPUs, or CPU threads on the CPU backend) without
//! peer-to-peer: every rank holds a shard of each layer ([`shard`]), runs the layers on its own
//! backend, and the two partial sums of each layer (after the mixer's output projection and
//! after the MLP's down projection) are summed through page-locked host memory ([`exchange`]).
//! The residual stream is replicated: every rank adds the same sums, in the same order.
//!
//! [`qwen3_5`] is the TP form of `qwen3_5_text`, [`qwen4_exp`] that of `qwen4_exp_text`
//! (Flash-Next); [`load`] builds either from one backend per rank.

#[cfg(feature = "cuda")]
pub mod bench;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod exchange;
pub mod experts;
pub mod qwen3_5;
pub mod qwen4_exp;
pub mod shard;

use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::config::Architecture;
use crate::model::CausalLm;
use anyhow::{bail, Result};
use exchange::{HostMailbox, MailboxPort};
use std::time::Duration;

/// Token rows one mailbox slot holds per exchange; larger batches are summed in several
/// exchanges of this size (every rank cuts them the same way).
pub const MAILBOX_TOKENS: usize = 256;

/// Sums one activation across the ranks, in place. One per rank.
pub trait RankExchange<B: Backend>: Send {
    fn all_reduce(&mut self, b: &B, x: &mut B::Act) -> Result<()>;
    /// Called at the end of every forward pass: an exchange that runs in stream order (the
    /// CUDA mapped mailbox) reports here a step that failed after `all_reduce` returned.
    fn finish(&mut self, _b: &B) -> Result<()> {
        Ok(())
    }
    /// Fails every rank's exchange (a rank that hit an error calls this so the others stop).
    fn abort(&self, reason: &str);
}

/// The exchange for any backend through host memory: copy to the host, sum in the mailbox,
/// copy back. On CUDA this is the stream-ordered staged path (`to_host` waits for the
/// stream); the CPU backend's activations are host memory already.
pub struct HostExchange {
    port: MailboxPort,
    chunk: usize,
}

impl HostExchange {
    /// One exchange per rank over a new heap mailbox for activations `hidden` wide.
    pub fn for_ranks(ranks: usize, hidden: usize, timeout: Duration) -> Result<Vec<Self>> {
        let chunk = MAILBOX_TOKENS * hidden;
        let mb = HostMailbox::new(ranks, chunk, timeout)?;
        (0..ranks)
            .map(|r| {
                Ok(HostExchange {
                    port: mb.port(r)?,
                    chunk,
                })
            })
            .collect()
    }
    pub fn port(&self) -> &MailboxPort {
        &self.port
    }
}

impl<B: Backend> RankExchange<B> for HostExchange {
    fn all_reduce(&mut self, b: &B, x: &mut B::Act) -> Result<()> {
        let (rows, cols) = b.shape(x);
        let mut host = b.to_host(x);
        for part in host.chunks_mut(self.chunk) {
            self.port.all_reduce_sum(part)?;
        }
        *x = b.from_host(rows, cols, &host);
        Ok(())
    }
    fn abort(&self, reason: &str) {
        self.port.mailbox().abort(self.port.rank(), reason);
    }
}

/// Loads the model a checkpoint describes split over `backends.len()` ranks, exchanging
/// through host memory with `timeout` per step.
pub fn load<B: Backend>(
    backends: Vec<B>,
    ck: &Checkpoint,
    timeout: Duration,
) -> Result<Box<dyn CausalLm>> {
    let exchanges = host_exchanges(backends.len(), ck.config.hidden_size, timeout)?;
    load_with(backends, exchanges, ck)
}

/// As [`load`], with the exchanges given (one per rank, in rank order).
pub fn load_with<B: Backend>(
    backends: Vec<B>,
    exchanges: Vec<Box<dyn RankExchange<B>>>,
    ck: &Checkpoint,
) -> Result<Box<dyn CausalLm>> {
    match ck.config.architecture {
        Architecture::Qwen3_5Text => Ok(Box::new(qwen3_5::TpQwen3_5Text::load(
            backends, exchanges, ck,
        )?)),
        Architecture::Qwen4ExpText => Ok(Box::new(qwen4_exp::TpQwen4ExpText::load(
            backends, exchanges, ck,
        )?)),
    }
}

/// One [`HostExchange`] per rank over one mailbox, as the models take them.
pub fn host_exchanges<B: Backend>(
    ranks: usize,
    hidden: usize,
    timeout: Duration,
) -> Result<Vec<Box<dyn RankExchange<B>>>> {
    Ok(HostExchange::for_ranks(ranks, hidden, timeout)?
        .into_iter()
        .map(|e| Box::new(e) as Box<dyn RankExchange<B>>)
        .collect())
}

/// Where the ranks of `--tp N` run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TpDevices {
    /// N rank threads on the CPU backend.
    Cpu,
    /// CUDA GPUs `0..N`, each with its own VRAM budget (`None`: the card's free memory).
    Cuda { vram_budget: Option<u64> },
}

/// Loads `ck` over `ranks` ranks on `devices` (the `--tp` of `serve` and `bench`); the timeout
/// of one exchange is [`exchange::DEFAULT_TIMEOUT`].
pub fn load_tp(ck: &Checkpoint, ranks: usize, devices: &TpDevices) -> Result<Box<dyn CausalLm>> {
    if ranks == 0 {
        bail!("--tp must be at least 1");
    }
    match devices {
        TpDevices::Cpu => load(
            (0..ranks)
                .map(|_| crate::backend::cpu::CpuBackend::new())
                .collect(),
            ck,
            exchange::DEFAULT_TIMEOUT,
        ),
        #[cfg(feature = "cuda")]
        TpDevices::Cuda { vram_budget } => {
            let backends = cuda_backends(ranks, *vram_budget)?;
            let exchanges = cuda_exchanges(&backends, ck.config.hidden_size)?;
            load_with(backends, exchanges, ck)
        }
        #[cfg(not(feature = "cuda"))]
        TpDevices::Cuda { .. } => {
            bail!("--tp {ranks} on CUDA: this build has no CUDA backend (built without the cuda feature)")
        }
    }
}

/// The exchanges of CUDA ranks as the startup probe chooses them ([`cuda::exchanges`]), with
/// the choice and its figures on stderr.
#[cfg(feature = "cuda")]
fn cuda_exchanges(
    backends: &[crate::backend::cuda::CudaBackend],
    hidden: usize,
) -> Result<Vec<Box<dyn RankExchange<crate::backend::cuda::CudaBackend>>>> {
    let (exchanges, probe) = cuda::exchanges(backends, hidden, exchange::DEFAULT_TIMEOUT)?;
    eprintln!(
        "capy-flash: tensor-parallel exchange over {} ranks: {}",
        backends.len(),
        probe.note
    );
    Ok(exchanges)
}

/// CUDA GPUs `0..ranks`, one backend per rank, each within `vram_budget`.
#[cfg(feature = "cuda")]
fn cuda_backends(
    ranks: usize,
    vram_budget: Option<u64>,
) -> Result<Vec<crate::backend::cuda::CudaBackend>> {
    cuda::check_gpus(ranks, cuda::gpu_count()?)?;
    (0..ranks)
        .map(|r| {
            crate::backend::cuda::CudaBackend::new(r, vram_budget).map_err(|e| {
                anyhow::anyhow!("--tp {ranks}: cannot open GPU {r} for rank {r}: {e:#}")
            })
        })
        .collect()
}

/// `--tp ranks` for Flash-Next with hybrid experts on CUDA GPUs `0..ranks` (see
/// [`qwen4_exp::load_hybrid`]): one host expert store for all ranks, and on each card an
/// expert cache of `o.cache_bytes` within that card's `vram_budget`.
#[cfg(feature = "cuda")]
pub fn load_tp_hybrid(
    ck: &Checkpoint,
    ranks: usize,
    vram_budget: Option<u64>,
    o: &crate::hybrid::HybridOptions,
) -> Result<Box<dyn CausalLm>> {
    if ck.config.architecture != Architecture::Qwen4ExpText {
        bail!(
            "hybrid expert placement is for Flash-Next (qwen4_exp_text) checkpoints; this one is {}",
            ck.config.architecture.model_type()
        );
    }
    let backends = cuda_backends(ranks, vram_budget)?;
    let exchanges = cuda_exchanges(&backends, ck.config.hidden_size)?;
    Ok(Box::new(qwen4_exp::load_hybrid(
        backends, exchanges, ck, o,
    )?))
}
