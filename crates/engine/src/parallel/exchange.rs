//! The all-reduce between tensor-parallel ranks, through host memory (no peer-to-peer).
//!
//! A [`HostMailbox`] is one region of host memory (page-locked and device-mapped on CUDA, so
//! the GPU can read and write it; plain memory on the CPU backend) laid out as:
//!
//! ```text
//! [abort word][arrival counter × N][length: 2 parities × N][slots: 2 parities × N × capacity f32]
//! ```
//!
//! Step `s` of rank `r` (every rank counts its steps from 1, in the same order): write the
//! partial sum into slot `[s % 2][r]`, store its length `[s % 2][r]`, then publish `counter[r] = s` (release).
//! Wait until every `counter[j] >= s` (acquire), then sum the slots of parity `s % 2` in rank
//! order, so that every rank computes the bitwise same result and the replicated residual stays
//! identical on all ranks. Two parities suffice: a rank can only write parity `s % 2` again at
//! step `s + 2`, which needs every other rank to have published `s + 1`, which each does only
//! after it has finished reading step `s`.
//!
//! The barrier in the wait is what makes a mixed pair run at the slower rank's pace: a fast rank
//! simply waits there. A rank that never arrives makes the others fail after the timeout with
//! an error naming the missing rank and the step; the first rank to fail writes the abort word
//! so that the others stop at once instead of each waiting out its own timeout.

use anyhow::{bail, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default time a rank waits for the others at one step before the engine fails.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Host memory a mailbox lives in. The CPU backend uses [`HeapRegion`]; the CUDA backend a
/// page-locked, device-mapped allocation, so that a kernel can spin on the same counters.
pub trait HostRegion: Send + Sync {
    /// Start of the region, 8-byte aligned, valid for [`HostRegion::len`] bytes for the
    /// region's lifetime.
    fn as_ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A zeroed heap region (u64 words, so it is 8-byte aligned).
pub struct HeapRegion {
    words: Box<[AtomicU64]>,
}

impl HeapRegion {
    pub fn zeroed(bytes: usize) -> Self {
        HeapRegion {
            words: (0..bytes.div_ceil(8)).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl HostRegion for HeapRegion {
    fn as_ptr(&self) -> *mut u8 {
        // Atomics have interior mutability, so writing through this pointer is allowed.
        self.words.as_ptr() as *mut u8
    }
    fn len(&self) -> usize {
        self.words.len() * 8
    }
}

/// Byte offsets of the mailbox's parts inside its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MailboxLayout {
    pub ranks: usize,
    /// f32 values one slot holds (the largest tensor one all-reduce sums).
    pub capacity: usize,
}

impl MailboxLayout {
    pub fn abort_offset(&self) -> usize {
        0
    }
    pub fn counter_offset(&self, rank: usize) -> usize {
        8 + rank * 8
    }
    /// Length word of `rank` for steps of `parity` (two, like the slots: a rank that already
    /// moved on to the next step must not overwrite the length the others still check).
    pub fn length_offset(&self, parity: usize, rank: usize) -> usize {
        8 + self.ranks * 8 + (parity * self.ranks + rank) * 8
    }
    /// Slot of `rank` for steps of `parity` (`step % 2`).
    pub fn slot_offset(&self, parity: usize, rank: usize) -> usize {
        8 + self.ranks * 24 + (parity * self.ranks + rank) * self.capacity * 4
    }
    pub fn bytes(&self) -> usize {
        self.slot_offset(2, 0)
    }
}

/// The shared mailbox of N ranks. Each rank talks to it through its own [`MailboxPort`].
pub struct HostMailbox {
    region: Box<dyn HostRegion>,
    layout: MailboxLayout,
    timeout: Duration,
    /// Why the exchange was aborted (the abort word says by which rank).
    reason: Mutex<Option<String>>,
}

impl HostMailbox {
    /// A mailbox in ordinary heap memory (ranks on CPU threads).
    pub fn new(ranks: usize, capacity: usize, timeout: Duration) -> Result<Arc<Self>> {
        let layout = MailboxLayout { ranks, capacity };
        Self::in_region(
            Box::new(HeapRegion::zeroed(layout.bytes())),
            layout,
            timeout,
        )
    }

    /// A mailbox in `region`, which must be zeroed and at least `layout.bytes()` long.
    pub fn in_region(
        region: Box<dyn HostRegion>,
        layout: MailboxLayout,
        timeout: Duration,
    ) -> Result<Arc<Self>> {
        if layout.ranks == 0 {
            bail!("a mailbox needs at least one rank");
        }
        if region.len() < layout.bytes() || !(region.as_ptr() as usize).is_multiple_of(8) {
            bail!(
                "mailbox region of {} bytes at {:p} is too small or misaligned: {} ranks × {} values need {} bytes, 8-byte aligned",
                region.len(),
                region.as_ptr(),
                layout.ranks,
                layout.capacity,
                layout.bytes()
            );
        }
        Ok(Arc::new(HostMailbox {
            region,
            layout,
            timeout,
            reason: Mutex::new(None),
        }))
    }

    pub fn layout(&self) -> MailboxLayout {
        self.layout
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Start of the region (the CUDA side maps it into the device's address space).
    pub fn region_ptr(&self) -> *mut u8 {
        self.region.as_ptr()
    }

    /// The port of `rank`; each rank takes exactly one.
    pub fn port(self: &Arc<Self>, rank: usize) -> Result<MailboxPort> {
        if rank >= self.layout.ranks {
            bail!(
                "rank {rank} does not exist: the mailbox has {} ranks",
                self.layout.ranks
            );
        }
        Ok(MailboxPort {
            mailbox: self.clone(),
            rank,
            step: 0,
            waited: Duration::ZERO,
        })
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offsets come from the layout, which the region was checked to hold; 8-aligned.
        unsafe { &*(self.region.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn slot(&self, parity: usize, rank: usize) -> *mut f32 {
        // SAFETY: inside the region (checked at construction).
        unsafe {
            self.region
                .as_ptr()
                .add(self.layout.slot_offset(parity, rank)) as *mut f32
        }
    }

    /// Fails the exchange for every rank: the others stop at their next wait.
    pub fn abort(&self, rank: usize, reason: &str) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(reason.to_string());
            self.word(self.layout.abort_offset())
                .store(rank as u64 + 1, Ordering::Release);
        }
    }

    /// `Some((rank, reason))` once some rank aborted.
    pub fn aborted(&self) -> Option<(usize, String)> {
        let w = self
            .word(self.layout.abort_offset())
            .load(Ordering::Acquire);
        (w != 0).then(|| {
            let reason = self
                .reason
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_else(|| "written by the device".into());
            (w as usize - 1, reason)
        })
    }
}

/// One rank's end of a [`HostMailbox`]: counts its steps and the time it spent waiting.
pub struct MailboxPort {
    mailbox: Arc<HostMailbox>,
    rank: usize,
    step: u64,
    waited: Duration,
}

impl MailboxPort {
    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn ranks(&self) -> usize {
        self.mailbox.layout.ranks
    }
    /// Steps completed so far.
    pub fn step(&self) -> u64 {
        self.step
    }
    /// Time this rank spent waiting for the others (how much a slower rank paced it).
    pub fn waited(&self) -> Duration {
        self.waited
    }
    pub fn mailbox(&self) -> &Arc<HostMailbox> {
        &self.mailbox
    }

    /// Replaces `data` by the element-wise sum of every rank's `data` at this step.
    pub fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()> {
        let mb = &*self.mailbox;
        let l = mb.layout;
        if data.len() > l.capacity {
            let msg = format!(
                "rank {}: an all-reduce of {} values does not fit the mailbox's {}-value slots (size the mailbox for the largest batch × hidden size)",
                self.rank,
                data.len(),
                l.capacity
            );
            mb.abort(self.rank, &msg);
            bail!(msg);
        }
        if let Some((by, reason)) = mb.aborted() {
            bail!(
                "tensor-parallel exchange: rank {} stopped before step {}: rank {by} aborted it: {reason}",
                self.rank,
                self.step + 1
            );
        }
        let step = self.step + 1;
        let parity = (step % 2) as usize;
        // SAFETY: slot `[parity][rank]` is written only by this rank, and no other rank reads
        // it until the counter below is published (see the module docs).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), mb.slot(parity, self.rank), data.len())
        };
        mb.word(l.length_offset(parity, self.rank))
            .store(data.len() as u64, Ordering::Relaxed);
        mb.word(l.counter_offset(self.rank))
            .store(step, Ordering::Release);
        let start = Instant::now();
        for j in 0..l.ranks {
            self.wait_for(j, step, start)?;
        }
        self.waited += start.elapsed();
        for j in 0..l.ranks {
            let len = mb.word(l.length_offset(parity, j)).load(Ordering::Relaxed) as usize;
            if len != data.len() {
                let msg = format!(
                    "tensor-parallel exchange step {step}: rank {} sums {} values but rank {j} sent {len}; the ranks ran different shapes",
                    self.rank,
                    data.len()
                );
                mb.abort(self.rank, &msg);
                bail!(msg);
            }
        }
        // Fixed rank order: the same additions in the same order on every rank.
        // SAFETY: every rank published step `step`, so parity `parity` holds its values and
        // stays unchanged until this rank publishes `step + 1`.
        let first = unsafe { std::slice::from_raw_parts(mb.slot(parity, 0), data.len()) };
        data.copy_from_slice(first);
        for j in 1..l.ranks {
            let src = unsafe { std::slice::from_raw_parts(mb.slot(parity, j), data.len()) };
            for (d, s) in data.iter_mut().zip(src) {
                *d += s;
            }
        }
        self.step = step;
        Ok(())
    }

    /// Spins, then yields, until rank `j` has published `step`; fails on abort or timeout.
    fn wait_for(&self, j: usize, step: u64, start: Instant) -> Result<()> {
        let mb = &*self.mailbox;
        let counter = mb.word(mb.layout.counter_offset(j));
        let mut spins = 0u32;
        loop {
            let seen = counter.load(Ordering::Acquire);
            if seen >= step {
                return Ok(());
            }
            if let Some((by, reason)) = mb.aborted() {
                bail!(
                    "tensor-parallel exchange: rank {} stopped at step {step}: rank {by} aborted it: {reason}",
                    self.rank
                );
            }
            spins += 1;
            if spins < 256 {
                std::hint::spin_loop();
                continue;
            }
            if start.elapsed() > mb.timeout {
                let msg = format!(
                    "tensor-parallel exchange timed out: rank {} waited {:?} at all-reduce step {step} for rank {j}, which is still at step {seen}; rank {j} is hung or has died",
                    self.rank, mb.timeout
                );
                mb.abort(self.rank, &msg);
                bail!(msg);
            }
            if spins < 4096 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank `r`'s value at step `s`, index `i`: small integers, so every sum is exact in f32.
    fn value(r: usize, s: usize, i: usize) -> f32 {
        ((r + 1) * 1000 + s * 10 + i % 7) as f32
    }

    fn run_ranks(ranks: usize, steps: usize, len: usize) {
        let mb = HostMailbox::new(ranks, len, Duration::from_secs(20)).unwrap();
        std::thread::scope(|s| {
            for r in 0..ranks {
                let mut port = mb.port(r).unwrap();
                s.spawn(move || {
                    for step in 0..steps {
                        // Lengths vary per step, like batches of different sizes.
                        let n = len - step % 3;
                        let mut data: Vec<f32> = (0..n).map(|i| value(r, step, i)).collect();
                        port.all_reduce_sum(&mut data).unwrap();
                        for (i, d) in data.iter().enumerate() {
                            let want: f32 = (0..ranks).map(|q| value(q, step, i)).sum();
                            assert_eq!(*d, want, "rank {r} step {step} index {i}");
                        }
                    }
                    assert_eq!(port.step(), steps as u64);
                });
            }
        });
    }

    #[test]
    fn two_ranks_sum_exactly_over_repeated_steps() {
        run_ranks(2, 200, 37);
    }

    #[test]
    fn three_ranks_sum_exactly_over_repeated_steps() {
        run_ranks(3, 150, 16);
    }

    #[test]
    fn a_single_rank_is_its_own_sum() {
        let mb = HostMailbox::new(1, 4, DEFAULT_TIMEOUT).unwrap();
        let mut p = mb.port(0).unwrap();
        let mut d = vec![1.5, -2.0];
        p.all_reduce_sum(&mut d).unwrap();
        assert_eq!(d, vec![1.5, -2.0]);
    }

    #[test]
    fn a_rank_that_never_arrives_fails_the_others_with_its_name_and_step() {
        let mb = HostMailbox::new(3, 8, Duration::from_millis(200)).unwrap();
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = [0usize, 1]
                .into_iter()
                .map(|r| {
                    let mut port = mb.port(r).unwrap();
                    s.spawn(move || {
                        // One good step is impossible (rank 2 is absent from the start), so the
                        // first step is where the others must give up.
                        let mut d = vec![1.0; 8];
                        port.all_reduce_sum(&mut d).unwrap_err().to_string()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // One rank times out naming rank 2; the other either does too or stops on its abort.
        assert!(
            errors
                .iter()
                .any(|e| e.contains("for rank 2") && e.contains("step 1")),
            "{errors:?}"
        );
        for e in &errors {
            assert!(e.contains("step 1"), "{e}");
        }
        assert!(mb.aborted().is_some());
    }

    #[test]
    fn a_rank_that_stops_midway_is_named_with_the_step_it_missed() {
        let mb = HostMailbox::new(2, 4, Duration::from_millis(200)).unwrap();
        let err = std::thread::scope(|s| {
            let mut p1 = mb.port(1).unwrap();
            s.spawn(move || {
                for _ in 0..3 {
                    p1.all_reduce_sum(&mut [1.0; 4]).unwrap();
                }
            });
            let mut p0 = mb.port(0).unwrap();
            for _ in 0..3 {
                p0.all_reduce_sum(&mut [2.0; 4]).unwrap();
            }
            p0.all_reduce_sum(&mut [2.0; 4]).unwrap_err().to_string()
        });
        assert!(
            err.contains("step 4") && err.contains("for rank 1"),
            "{err}"
        );
        assert!(err.contains("still at step 3"), "{err}");
    }

    #[test]
    fn an_abort_stops_the_other_ranks_at_once() {
        // A long timeout: the waiting rank must stop because of the abort, not the timeout.
        let mb = HostMailbox::new(2, 4, Duration::from_secs(600)).unwrap();
        let err = std::thread::scope(|s| {
            let mut p0 = mb.port(0).unwrap();
            let waiter = s.spawn(move || p0.all_reduce_sum(&mut [1.0; 4]).unwrap_err());
            std::thread::sleep(Duration::from_millis(20));
            mb.abort(1, "rank 1 failed to load its shard");
            waiter.join().unwrap().to_string()
        });
        assert!(
            err.contains("rank 1 aborted") && err.contains("load its shard"),
            "{err}"
        );
    }

    #[test]
    fn mismatched_lengths_and_oversized_tensors_are_refused() {
        let mb = HostMailbox::new(2, 4, Duration::from_secs(20)).unwrap();
        let errs = std::thread::scope(|s| {
            let mut p1 = mb.port(1).unwrap();
            let h = s.spawn(move || p1.all_reduce_sum(&mut [1.0; 3]).unwrap_err().to_string());
            let mut p0 = mb.port(0).unwrap();
            let e0 = p0.all_reduce_sum(&mut [1.0; 4]).unwrap_err().to_string();
            (e0, h.join().unwrap())
        });
        assert!(
            errs.0.contains("different shapes") || errs.1.contains("different shapes"),
            "{errs:?}"
        );
        let mb = HostMailbox::new(1, 4, DEFAULT_TIMEOUT).unwrap();
        let err = mb
            .port(0)
            .unwrap()
            .all_reduce_sum(&mut [0.0; 5])
            .unwrap_err()
            .to_string();
        assert!(err.contains("5 values") && err.contains("4-value"), "{err}");
        assert!(mb.port(1).is_err());
    }

    /// A mixed pair: the barrier makes the fast rank wait for the slow one at every step, and
    /// nothing fails. The bound is a logical one (the slow rank cannot publish step s before
    /// it slept s times), not a performance figure.
    #[test]
    fn the_slower_rank_paces_every_step() {
        let delay = Duration::from_millis(15);
        let steps = 4;
        let mb = HostMailbox::new(2, 2, Duration::from_secs(20)).unwrap();
        let origin = Instant::now();
        let (fast_done, fast_waited) = std::thread::scope(|s| {
            let mut slow = mb.port(1).unwrap();
            s.spawn(move || {
                for k in 0..steps {
                    std::thread::sleep(delay);
                    let mut d = [k as f32, 1.0];
                    slow.all_reduce_sum(&mut d).unwrap();
                }
            });
            let mut fast = mb.port(0).unwrap();
            let mut done = Vec::new();
            for k in 0..steps {
                let mut d = [k as f32, 2.0];
                fast.all_reduce_sum(&mut d).unwrap();
                assert_eq!(d, [2.0 * k as f32, 3.0]);
                done.push(origin.elapsed());
            }
            (done, fast.waited())
        });
        for (k, t) in fast_done.iter().enumerate() {
            assert!(*t >= delay * (k as u32 + 1), "step {k} done at {t:?}");
        }
        assert!(fast_waited > Duration::ZERO);
    }
}
