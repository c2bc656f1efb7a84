//! `CAPY_PROFILE_HOST=1`: where a forward pass spends host time. The GPU backend only queues
//! work, so a phase's host time is the time it keeps the host from queueing the next one; a
//! phase that takes longer on the host than its kernels take on the GPU leaves the GPU idle.
//! The last phase, reading the logits, waits for the GPU: with the host ahead, it holds what
//! the GPU still had to do.

use std::time::{Duration, Instant};

/// Host wall time per named phase of one forward pass (a no-op unless enabled).
pub struct HostPhases {
    enabled: bool,
    start: Instant,
    last: Instant,
    /// (phase, total time, times marked), in the order first marked.
    phases: Vec<(&'static str, Duration, usize)>,
}

impl HostPhases {
    /// Enabled by `CAPY_PROFILE_HOST=1`, read once: every forward pass (decode steps
    /// included) starts one, and an environment lookup takes a lock.
    pub fn from_env() -> Self {
        static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        Self::new(*ENABLED.get_or_init(|| std::env::var("CAPY_PROFILE_HOST").as_deref() == Ok("1")))
    }

    pub fn new(enabled: bool) -> Self {
        let now = Instant::now();
        Self {
            enabled,
            start: now,
            last: now,
            phases: Vec::new(),
        }
    }

    /// Charges the time since the previous mark (or the start) to `phase`.
    pub fn mark(&mut self, phase: &'static str) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        let spent = now - self.last;
        self.last = now;
        match self.phases.iter_mut().find(|(p, ..)| *p == phase) {
            Some((_, total, count)) => {
                *total += spent;
                *count += 1;
            }
            None => self.phases.push((phase, spent, 1)),
        }
    }

    /// The phases' totals, in the order first marked.
    pub fn totals(&self) -> &[(&'static str, Duration, usize)] {
        &self.phases
    }

    /// One line per phase, then the pass's total; `None` when disabled.
    pub fn report(&self, tokens: usize) -> Option<String> {
        if !self.enabled {
            return None;
        }
        let total = self.last - self.start;
        let mut out = format!(
            "host phases of a {tokens}-token pass: {:.2} ms in all\n",
            ms(total)
        );
        for (phase, spent, count) in &self.phases {
            out += &format!(
                "  {phase:<28} {:>9.2} ms  {:>5.1}%  ({count}×)\n",
                ms(*spent),
                100.0 * spent.as_secs_f64() / total.as_secs_f64().max(1e-12)
            );
        }
        Some(out)
    }

    /// Prints the report to stderr when enabled.
    pub fn print(&self, tokens: usize) {
        if let Some(report) = self.report(tokens) {
            eprint!("{report}");
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_add_up_per_phase_in_first_marked_order() {
        let mut t = HostPhases::new(true);
        t.mark("a");
        std::thread::sleep(Duration::from_millis(3));
        t.mark("b");
        t.mark("a");
        std::thread::sleep(Duration::from_millis(2));
        t.mark("c");
        let names: Vec<_> = t.totals().iter().map(|(p, _, n)| (*p, *n)).collect();
        assert_eq!(names, [("a", 2), ("b", 1), ("c", 1)]);
        assert!(t.totals()[1].1 >= Duration::from_millis(3));
        assert!(t.totals()[2].1 >= Duration::from_millis(2));
        let sum: Duration = t.totals().iter().map(|(_, d, _)| *d).sum();
        assert_eq!(sum, t.last - t.start);
        let report = t.report(7).unwrap();
        assert!(
            report.starts_with("host phases of a 7-token pass"),
            "{report}"
        );
        assert_eq!(report.lines().count(), 4, "{report}");
    }

    #[test]
    fn disabled_marks_nothing() {
        let mut t = HostPhases::new(false);
        t.mark("a");
        assert!(t.totals().is_empty());
        assert!(t.report(1).is_none());
    }
}
