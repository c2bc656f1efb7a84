//! Where one `moe_experts` call's time goes, per worker: when it entered the job, when it
//! ran out of gate/up tasks, how long it waited for experts' `h` to be ready, when it finished
//! its down rows; and, for the call, how long the grouping and token preparation before the
//! job took and how long the caller waited after the last worker.
//!
//! Recorded only when a bench asks ([`super::MoeScratch::record_timeline`]): a few clock reads
//! per worker and call. It measures the fixed cost per call that the top-k 3 and 10 fit of
//! session 19 found (~41 µs, the largest share of a hybrid layer's 3–4 CPU experts), so that
//! the next change to the pool or the task split is chosen from where that time is.

use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// One worker's marks, in nanoseconds since the call's start.
#[derive(Default)]
pub(super) struct WorkerMarks {
    entered: AtomicU64,
    gate_up_end: AtomicU64,
    waited: AtomicU64,
    down_end: AtomicU64,
    gate_up_tasks: AtomicU64,
    down_tasks: AtomicU64,
}

/// The marks of one call (reused across calls; [`CallTimeline::start`] clears them).
pub struct CallTimeline {
    t0: Instant,
    published: AtomicU64,
    returned: AtomicU64,
    workers: Vec<WorkerMarks>,
}

impl CallTimeline {
    pub(super) fn new(workers: usize) -> CallTimeline {
        CallTimeline {
            t0: Instant::now(),
            published: AtomicU64::new(0),
            returned: AtomicU64::new(0),
            workers: (0..workers).map(|_| WorkerMarks::default()).collect(),
        }
    }

    pub(super) fn start(&mut self) {
        self.t0 = Instant::now();
        self.published.store(0, Ordering::Relaxed);
        self.returned.store(0, Ordering::Relaxed);
        for w in &self.workers {
            for a in [
                &w.entered,
                &w.gate_up_end,
                &w.waited,
                &w.down_end,
                &w.gate_up_tasks,
                &w.down_tasks,
            ] {
                a.store(0, Ordering::Relaxed);
            }
        }
    }

    pub(super) fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    /// The grouping and token preparation are done; the job is about to be published.
    pub(super) fn mark_published(&self) {
        self.published.store(self.now(), Ordering::Relaxed);
    }

    pub(super) fn mark_returned(&self) {
        self.returned.store(self.now(), Ordering::Relaxed);
    }

    pub(super) fn entered(&self, worker: usize) {
        self.workers[worker]
            .entered
            .store(self.now(), Ordering::Relaxed);
    }

    pub(super) fn gate_up_end(&self, worker: usize, tasks: u64) {
        let w = &self.workers[worker];
        w.gate_up_end.store(self.now(), Ordering::Relaxed);
        w.gate_up_tasks.store(tasks, Ordering::Relaxed);
    }

    pub(super) fn waited(&self, worker: usize, ns: u64) {
        self.workers[worker].waited.fetch_add(ns, Ordering::Relaxed);
    }

    pub(super) fn down_end(&self, worker: usize, tasks: u64) {
        let w = &self.workers[worker];
        w.down_end.store(self.now(), Ordering::Relaxed);
        w.down_tasks.store(tasks, Ordering::Relaxed);
    }

    /// This call's summary, in microseconds.
    pub fn summary(&self) -> CallSummary {
        let us = |ns: u64| ns as f64 / 1e3;
        // One mark of every worker, in `unit`s (1e3: ns to µs; 1: a count).
        let get = |f: fn(&WorkerMarks) -> &AtomicU64, unit: f64| -> Vec<f64> {
            self.workers
                .iter()
                .map(|w| f(w).load(Ordering::Relaxed) as f64 / unit)
                .collect()
        };
        let (entered, gu_end, waited, down_end) = (
            get(|w| &w.entered, 1e3),
            get(|w| &w.gate_up_end, 1e3),
            get(|w| &w.waited, 1e3),
            get(|w| &w.down_end, 1e3),
        );
        let (gu_tasks, down_tasks) = (get(|w| &w.gate_up_tasks, 1.0), get(|w| &w.down_tasks, 1.0));
        let max = |v: &[f64]| v.iter().copied().fold(f64::MIN, f64::max);
        let min = |v: &[f64]| v.iter().copied().fold(f64::MAX, f64::min);
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let published = us(self.published.load(Ordering::Relaxed));
        let total = us(self.returned.load(Ordering::Relaxed));
        let last_down = max(&down_end);
        let n = self.workers.len() as f64;
        // Time each worker computed: from entering to its end, less its waits.
        let busy: f64 = (0..self.workers.len())
            .map(|w| (down_end[w] - entered[w] - waited[w]).max(0.0))
            .sum();
        CallSummary {
            total_us: total,
            before_job_us: published,
            start_skew_mean_us: mean(&entered) - published,
            start_skew_max_us: max(&entered) - published,
            gate_up_end_first_us: min(&gu_end),
            gate_up_end_last_us: max(&gu_end),
            wait_mean_us: mean(&waited),
            wait_max_us: max(&waited),
            down_end_first_us: min(&down_end),
            down_end_last_us: last_down,
            join_us: total - last_down,
            busy_ratio: busy / (n * total).max(1e-9),
            gate_up_tasks_max_over_mean_ratio: max(&gu_tasks) / mean(&gu_tasks).max(1e-9),
            down_tasks_max_over_mean_ratio: max(&down_tasks) / mean(&down_tasks).max(1e-9),
        }
    }
}

/// One call's timeline in microseconds from its start (see the fields' JSON names).
#[derive(Clone, Copy, Debug)]
pub struct CallSummary {
    pub total_us: f64,
    pub before_job_us: f64,
    pub start_skew_mean_us: f64,
    pub start_skew_max_us: f64,
    pub gate_up_end_first_us: f64,
    pub gate_up_end_last_us: f64,
    pub wait_mean_us: f64,
    pub wait_max_us: f64,
    pub down_end_first_us: f64,
    pub down_end_last_us: f64,
    pub join_us: f64,
    pub busy_ratio: f64,
    pub gate_up_tasks_max_over_mean_ratio: f64,
    pub down_tasks_max_over_mean_ratio: f64,
}

impl CallSummary {
    fn fields(&self) -> [(&'static str, f64); 14] {
        [
            ("total_us", self.total_us),
            ("before_job_us", self.before_job_us),
            ("start_skew_mean_us", self.start_skew_mean_us),
            ("start_skew_max_us", self.start_skew_max_us),
            ("gate_up_end_first_us", self.gate_up_end_first_us),
            ("gate_up_end_last_us", self.gate_up_end_last_us),
            ("wait_mean_us", self.wait_mean_us),
            ("wait_max_us", self.wait_max_us),
            ("down_end_first_us", self.down_end_first_us),
            ("down_end_last_us", self.down_end_last_us),
            ("join_us", self.join_us),
            ("busy_ratio", self.busy_ratio),
            (
                "gate_up_tasks_max_over_mean_ratio",
                self.gate_up_tasks_max_over_mean_ratio,
            ),
            (
                "down_tasks_max_over_mean_ratio",
                self.down_tasks_max_over_mean_ratio,
            ),
        ]
    }

    /// The median of each field over `calls`, as JSON, with a note on what each means.
    pub fn medians_json(calls: &[CallSummary]) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        out.insert("note".into(), json!(
            "medians over the timed calls, microseconds from the call's start: before_job = grouping and token preparation on the caller; start_skew = workers' entry after the job was published (mean, max); gate_up_end = when workers ran out of gate/up tasks (first, last); wait = time a worker spun for an expert's h (mean, max over workers); down_end = when workers finished their down rows (first, last); join = the caller's return after the last worker; busy_ratio = the workers' computing time (entry to end less waits) over threads x total; *_tasks_max_over_mean = the most tasks a worker took over the mean"
        ));
        out.insert("calls".into(), json!(calls.len()));
        if calls.is_empty() {
            return serde_json::Value::Object(out);
        }
        for (i, (name, _)) in calls[0].fields().iter().enumerate() {
            let mut v: Vec<f64> = calls.iter().map(|c| c.fields()[i].1).collect();
            v.sort_by(f64::total_cmp);
            out.insert((*name).into(), json!(v[v.len() / 2]));
        }
        serde_json::Value::Object(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_reads_back_the_marks_relative_to_publication() {
        let mut t = CallTimeline::new(2);
        t.start();
        t.published.store(10_000, Ordering::Relaxed);
        for (w, (e, g, wait, d)) in [
            (11_000, 20_000, 1_000, 40_000),
            (13_000, 22_000, 3_000, 44_000),
        ]
        .into_iter()
        .enumerate()
        {
            let m = &t.workers[w];
            m.entered.store(e, Ordering::Relaxed);
            m.gate_up_end.store(g, Ordering::Relaxed);
            m.waited.store(wait, Ordering::Relaxed);
            m.down_end.store(d, Ordering::Relaxed);
            m.gate_up_tasks.store(2 + 2 * w as u64, Ordering::Relaxed);
            m.down_tasks.store(3 - w as u64, Ordering::Relaxed);
        }
        t.returned.store(45_000, Ordering::Relaxed);
        let s = t.summary();
        assert_eq!(s.total_us, 45.0);
        assert_eq!(s.before_job_us, 10.0);
        assert_eq!(s.start_skew_mean_us, 2.0);
        assert_eq!(s.start_skew_max_us, 3.0);
        assert_eq!(
            (s.gate_up_end_first_us, s.gate_up_end_last_us),
            (20.0, 22.0)
        );
        assert_eq!((s.wait_mean_us, s.wait_max_us), (2.0, 3.0));
        assert_eq!((s.down_end_first_us, s.down_end_last_us), (40.0, 44.0));
        assert_eq!(s.join_us, 1.0);
        // Busy: (40 - 11 - 1) + (44 - 13 - 3) = 56 µs of 2 x 45.
        assert!((s.busy_ratio - 56.0 / 90.0).abs() < 1e-12);
        assert!((s.gate_up_tasks_max_over_mean_ratio - 4.0 / 3.0).abs() < 1e-12);
        assert!((s.down_tasks_max_over_mean_ratio - 3.0 / 2.5).abs() < 1e-12);
        let j = CallSummary::medians_json(&[s, s, s]);
        assert_eq!(j["calls"], 3);
        assert_eq!(j["join_us"], 1.0);
    }
}
