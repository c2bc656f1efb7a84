//! The CUDA side of the exchange: the GPU count check for `--tp`, and how CUDA ranks sum
//! their partial results.
//!
//! Two exchanges exist. [`MappedExchange`] queues kernels/mailbox.cu on each rank's stream
//! over a page-locked mailbox mapped into the device (backend/cuda/mailbox.rs): no host
//! round trip per all-reduce and nothing the CPU waits on, so decode steps can be captured
//! as CUDA graphs. The staged path ([`super::HostExchange`]) copies each partial sum to the
//! host, sums it there and copies it back. [`exchanges`] runs a startup probe on the real
//! devices (a checked sum, then timed exchanges of each kind) and takes the mapped mailbox
//! when it is correct and not much slower; `CAPY_TP_EXCHANGE=mapped|staged` overrides.

use super::exchange::{HostMailbox, MailboxLayout};
use super::{HostExchange, RankExchange, MAILBOX_TOKENS};
use crate::backend::cuda::kernels::KernelSource;
use crate::backend::cuda::mailbox::{MailboxDevice, MappedRegion};
use crate::backend::cuda::{CudaBackend, CudaTensor};
use crate::backend::Backend;
use anyhow::{bail, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `kernels/mailbox.cu` as the backend compiles it (with the shared prelude).
pub fn mailbox_kernels() -> KernelSource {
    crate::backend::cuda::kernels::sources()
        .into_iter()
        .find(|k| k.name == "mailbox")
        .expect("kernels::sources lists mailbox.cu")
}

/// How CUDA ranks exchange their partial sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExchangeKind {
    /// kernels/mailbox.cu over mapped host memory, in stream order.
    Mapped,
    /// Copy to the host, sum there, copy back.
    Staged,
}

/// `CAPY_TP_EXCHANGE`: `mapped`, `staged`, or unset / `auto` (the probe decides).
pub fn requested_exchange() -> Result<Option<ExchangeKind>> {
    match std::env::var("CAPY_TP_EXCHANGE") {
        Err(_) => Ok(None),
        Ok(v) => parse_exchange(&v),
    }
}

fn parse_exchange(v: &str) -> Result<Option<ExchangeKind>> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(None),
        "mapped" => Ok(Some(ExchangeKind::Mapped)),
        "staged" => Ok(Some(ExchangeKind::Staged)),
        other => bail!("CAPY_TP_EXCHANGE={other:?}: expected mapped, staged or auto"),
    }
}

/// One rank's end of a mapped mailbox.
pub struct MappedExchange {
    mailbox: Arc<HostMailbox>,
    status: Arc<MappedRegion>,
    device: MailboxDevice,
    rank: usize,
    chunk: usize,
}

/// One [`MappedExchange`] per backend (rank order) over a new mapped mailbox for activations
/// `hidden` wide; a rank that does not arrive within `timeout` fails the step.
pub fn mapped_exchanges(
    backends: &[CudaBackend],
    hidden: usize,
    timeout: Duration,
) -> Result<Vec<MappedExchange>> {
    let ranks = backends.len();
    let Some(first) = backends.first() else {
        bail!("a mapped mailbox needs at least one rank");
    };
    let chunk = MAILBOX_TOKENS * hidden;
    let layout = MailboxLayout {
        ranks,
        capacity: chunk,
    };
    let region = MappedRegion::new(first, layout.bytes())?;
    let status = Arc::new(MappedRegion::new(first, 16 * ranks)?);
    let timeout_ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
    let devices = backends
        .iter()
        .enumerate()
        .map(|(r, b)| MailboxDevice::new(b, layout, r, &region, (&status, 16 * r), timeout_ns))
        .collect::<Result<Vec<_>>>()?;
    let mailbox = HostMailbox::in_region(Box::new(region), layout, timeout)?;
    Ok(devices
        .into_iter()
        .enumerate()
        .map(|(rank, device)| MappedExchange {
            mailbox: mailbox.clone(),
            status: status.clone(),
            device,
            rank,
            chunk,
        })
        .collect())
}

impl MappedExchange {
    /// Fails when this rank's wait kernel gave up on a step (timeout, abort, other length).
    fn check(&self) -> Result<()> {
        let step = self.status.read_u64(16 * self.rank);
        let missing = self.status.read_u64(16 * self.rank + 8);
        if missing == 0 {
            return Ok(());
        }
        let why = self
            .mailbox
            .aborted()
            .map(|(r, reason)| format!("; rank {r} aborted the exchange: {reason}"))
            .unwrap_or_default();
        bail!(
            "tensor-parallel exchange of rank {} failed at step {step}: rank {} did not publish that step within {:?} (or published another length){why}",
            self.rank,
            missing - 1,
            self.mailbox.timeout()
        )
    }
}

impl RankExchange<CudaBackend> for MappedExchange {
    fn all_reduce(&mut self, b: &CudaBackend, x: &mut CudaTensor) -> Result<()> {
        // A step that failed earlier in this pass shows here without waiting.
        self.check()?;
        let (rows, cols) = b.shape(x);
        let n = rows * cols;
        let mut offset = 0;
        while offset < n {
            let len = self.chunk.min(n - offset);
            b.mailbox_all_reduce_step(x, offset, len, &self.device);
            offset += len;
        }
        Ok(())
    }

    fn finish(&mut self, b: &CudaBackend) -> Result<()> {
        b.synchronize()?;
        self.check()
    }

    fn abort(&self, reason: &str) {
        self.mailbox.abort(self.rank, reason);
    }
}

/// What the startup probe found: the exchange chosen, each kind's time per all-reduce of one
/// `values`-wide row (the slowest rank's), and why.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ExchangeProbe {
    pub kind: ExchangeKind,
    pub values: usize,
    pub mapped_us: Option<f64>,
    pub staged_us: Option<f64>,
    pub note: String,
}

/// Timed all-reduces per probe run (after one checked exchange and one warm-up).
const PROBE_STEPS: usize = 16;
/// The probe's own mailbox timeout: a broken mapping fails fast.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// The mapped mailbox is taken unless it is this much slower than the staged path (it still
/// wins by keeping decode steps capturable as CUDA graphs).
const MAPPED_SLOWDOWN_ACCEPTED: f64 = 1.5;

/// Value `i` of rank `r`'s probe row: multiples of 1/8 below 8, so every sum is exact in f32.
fn probe_value(r: usize, i: usize) -> f32 {
    (r + 1) as f32 * 0.25 + (i % 7) as f32 * 0.125
}

/// Runs one checked exchange of a `hidden`-wide row on every rank (each on its own thread),
/// then `PROBE_STEPS` timed ones; microseconds per exchange of the slowest rank.
pub fn time_exchange(
    backends: &[CudaBackend],
    exchanges: Vec<CudaExchange>,
    hidden: usize,
) -> Result<f64> {
    let ranks = backends.len();
    let want: Vec<f32> = (0..hidden)
        .map(|i| (0..ranks).fold(0f32, |acc, r| acc + probe_value(r, i)))
        .collect();
    let want = &want;
    let per_rank: Vec<Result<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = backends
            .iter()
            .zip(exchanges)
            .enumerate()
            .map(|(r, (b, mut ex))| {
                s.spawn(move || -> Result<f64> {
                    let row: Vec<f32> = (0..hidden).map(|i| probe_value(r, i)).collect();
                    let run = (|| -> Result<f64> {
                        let mut x = b.from_host(1, hidden, &row);
                        ex.all_reduce(b, &mut x)?;
                        ex.finish(b)?;
                        let got = b.to_host(&x);
                        if let Some(i) = (0..hidden).find(|&i| got[i] != want[i]) {
                            bail!(
                                "rank {r}: value {i} of the summed probe row is {}, expected {}",
                                got[i],
                                want[i]
                            );
                        }
                        ex.all_reduce(b, &mut x)?;
                        ex.finish(b)?;
                        let t = Instant::now();
                        for _ in 0..PROBE_STEPS {
                            ex.all_reduce(b, &mut x)?;
                        }
                        ex.finish(b)?;
                        Ok(t.elapsed().as_secs_f64() * 1e6 / PROBE_STEPS as f64)
                    })();
                    if let Err(e) = &run {
                        ex.abort(&format!("{e:#}"));
                    }
                    run
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a probe rank thread panicked")))
            })
            .collect()
    });
    let mut worst = 0f64;
    for r in per_rank {
        worst = worst.max(r?);
    }
    Ok(worst)
}

/// One rank's exchange, of either kind.
pub type CudaExchange = Box<dyn RankExchange<CudaBackend>>;

fn boxed<E: RankExchange<CudaBackend> + 'static>(v: Vec<E>) -> Vec<CudaExchange> {
    v.into_iter().map(|e| Box::new(e) as CudaExchange).collect()
}

/// Times both exchanges on `backends` for a `hidden`-wide row and picks one (see the module
/// docs); `force` skips the choice but still reports the figures it could take.
pub fn probe(
    backends: &[CudaBackend],
    hidden: usize,
    force: Option<ExchangeKind>,
) -> ExchangeProbe {
    let ranks = backends.len();
    let staged = if force == Some(ExchangeKind::Mapped) {
        None
    } else {
        Some(
            HostExchange::for_ranks(ranks, hidden, PROBE_TIMEOUT)
                .and_then(|e| time_exchange(backends, boxed(e), hidden)),
        )
    };
    let mapped = if force == Some(ExchangeKind::Staged) {
        None
    } else {
        Some(
            mapped_exchanges(backends, hidden, PROBE_TIMEOUT)
                .and_then(|e| time_exchange(backends, boxed(e), hidden)),
        )
    };
    let us = |r: &Option<Result<f64>>| r.as_ref().and_then(|r| r.as_ref().ok().copied());
    let (mapped_us, staged_us) = (us(&mapped), us(&staged));
    let failed = |r: &Option<Result<f64>>| {
        r.as_ref()
            .and_then(|r| r.as_ref().err().map(|e| format!("{e:#}")))
    };
    let (kind, note) = match (force, mapped_us, staged_us) {
        (Some(k), _, _) => (k, format!("CAPY_TP_EXCHANGE={k:?}").to_lowercase()),
        (None, Some(m), Some(s)) if m <= MAPPED_SLOWDOWN_ACCEPTED * s => (
            ExchangeKind::Mapped,
            format!("mapped mailbox: {m:.1} µs per exchange against {s:.1} µs staged"),
        ),
        (None, Some(m), Some(s)) => (
            ExchangeKind::Staged,
            format!(
                "staged: the mapped mailbox took {m:.1} µs per exchange against {s:.1} µs staged"
            ),
        ),
        (None, Some(m), None) => (
            ExchangeKind::Mapped,
            format!(
                "mapped mailbox ({m:.1} µs per exchange); the staged probe failed: {}",
                failed(&staged).unwrap_or_default()
            ),
        ),
        (None, None, _) => (
            ExchangeKind::Staged,
            format!(
                "staged: the mapped mailbox failed its startup check: {}",
                failed(&mapped).unwrap_or_default()
            ),
        ),
    };
    ExchangeProbe {
        kind,
        values: hidden,
        mapped_us,
        staged_us,
        note,
    }
}

/// The exchanges of CUDA ranks `backends` for activations `hidden` wide, as the startup probe
/// (or `CAPY_TP_EXCHANGE`) chooses them, with the probe's report.
pub fn exchanges(
    backends: &[CudaBackend],
    hidden: usize,
    timeout: Duration,
) -> Result<(Vec<CudaExchange>, ExchangeProbe)> {
    let force = requested_exchange()?;
    let report = probe(backends, hidden, force);
    if force == Some(ExchangeKind::Mapped) && report.mapped_us.is_none() {
        bail!(
            "CAPY_TP_EXCHANGE=mapped, but the mapped mailbox failed its startup check: {}; unset it to fall back to the staged exchange",
            report.note
        );
    }
    let ex = match report.kind {
        ExchangeKind::Mapped => boxed(mapped_exchanges(backends, hidden, timeout)?),
        ExchangeKind::Staged => boxed(HostExchange::for_ranks(backends.len(), hidden, timeout)?),
    };
    Ok((ex, report))
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
    fn exchange_choice_parses_and_refuses_unknown_names() {
        assert_eq!(parse_exchange("").unwrap(), None);
        assert_eq!(parse_exchange("Auto").unwrap(), None);
        assert_eq!(
            parse_exchange("mapped").unwrap(),
            Some(ExchangeKind::Mapped)
        );
        assert_eq!(
            parse_exchange(" staged ").unwrap(),
            Some(ExchangeKind::Staged)
        );
        let e = parse_exchange("p2p").unwrap_err().to_string();
        assert!(e.contains("expected mapped, staged or auto"), "{e}");
    }

    #[test]
    fn probe_rows_sum_exactly_in_any_rank_order() {
        // The probe compares sums bit for bit, which needs every partial sum exact in f32.
        for ranks in 1..=8 {
            for i in 0..14 {
                let exact: f64 = (0..ranks).map(|r| probe_value(r, i) as f64).sum();
                let f = (0..ranks).fold(0f32, |acc, r| acc + probe_value(r, i));
                assert_eq!(f as f64, exact);
            }
        }
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
