//! A worker pool for expert work: one thread per physical core (pinned on Linux), jobs
//! dispatched without locks or allocation.
//!
//! [`ExpertPool::run`] hands the same closure to every worker (the calling thread is worker 0)
//! and returns when all have finished; the closure splits its work itself, usually by pulling
//! task indices from an atomic counter so that no core idles while another has work. Idle
//! workers spin briefly on a generation counter (a decode step issues many jobs in a row)
//! and then park; `run` unparks them, which is an atomic operation, not a lock.
//! [`ExpertPool::run_after`] lets the caller do its own work (queue device launches) while the
//! other workers start on the job, and join it afterwards.
//!
//! Why not rayon: a rayon `scope` allocates per spawned job and its work stealing is tuned
//! for recursive splitting; here every call is a flat loop over tasks, and threads must be
//! pinned to distinct physical cores for memory bandwidth to scale.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

type Job<'a> = dyn Fn(usize) + Sync + 'a;

struct Shared {
    generation: AtomicU64,
    /// The current job: a `*const Job` with its lifetime erased (valid while `run` waits).
    job: AtomicUsize,
    job_meta: AtomicUsize,
    done: AtomicUsize,
    stop: AtomicBool,
    panicked: AtomicBool,
    /// A job is published: a nested or concurrent call would overwrite it under the workers.
    busy: AtomicBool,
}

/// A pool of `threads` workers (including the caller).
pub struct ExpertPool {
    shared: Arc<Shared>,
    workers: Vec<(JoinHandle<()>, Thread)>,
    threads: usize,
    pub cores: Vec<usize>,
}

/// The first logical CPU of each physical core this process may run on (Linux), in order;
/// elsewhere, `0..available_parallelism`.
pub fn physical_cores() -> Vec<usize> {
    // Read once, before any pool pins its threads: the affinity mask of a pinned thread names
    // one CPU, and a bench that asked afterwards reported one physical core.
    static CORES: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    CORES.get_or_init(detect_physical_cores).clone()
}

fn detect_physical_cores() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        let allowed = allowed_cpus();
        let mut seen = std::collections::BTreeSet::new();
        let mut cores = Vec::new();
        for cpu in allowed {
            let read = |f: &str| {
                std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu{cpu}/topology/{f}"))
                    .ok()
                    .and_then(|s| s.trim().parse::<i64>().ok())
            };
            let key = (
                read("physical_package_id").unwrap_or(0),
                read("core_id").unwrap_or(cpu as i64),
            );
            if seen.insert(key) {
                cores.push(cpu);
            }
        }
        if !cores.is_empty() {
            return cores;
        }
    }
    (0..thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

#[cfg(target_os = "linux")]
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return (0..thread::available_parallelism().map_or(1, |n| n.get())).collect();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

fn pin_to(cpu: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: as above; pinning the calling thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cpu;
}

const SPIN: Duration = Duration::from_micros(200);

impl ExpertPool {
    /// A pool of `threads` workers (0: one per physical core). Workers 1.. are pinned to
    /// distinct physical cores; the caller (worker 0) is not pinned (it is the caller's
    /// thread), unless `pin_caller` is set.
    pub fn new(threads: usize, pin_caller: bool) -> ExpertPool {
        let cores = physical_cores();
        let threads = if threads == 0 { cores.len() } else { threads };
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: AtomicUsize::new(0),
            job_meta: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            busy: AtomicBool::new(false),
        });
        if pin_caller {
            pin_to(cores[0]);
        }
        let mut workers = Vec::new();
        for w in 1..threads {
            let shared = shared.clone();
            let cpu = cores.get(w % cores.len()).copied();
            let h = thread::Builder::new()
                .name(format!("capy-expert-{w}"))
                .spawn(move || {
                    if let Some(cpu) = cpu {
                        pin_to(cpu);
                    }
                    worker_loop(&shared, w)
                })
                .expect("spawning an expert worker thread");
            let t = h.thread().clone();
            workers.push((h, t));
        }
        ExpertPool {
            shared,
            workers,
            threads,
            cores,
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `job(worker)` on every worker (0 = the caller) and waits for all of them.
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        self.run_after(job, || {});
    }

    /// Publishes `job` to the workers, runs `first` on the calling thread, then runs `job(0)`
    /// there and waits for every worker: the caller's own work (queuing device launches)
    /// overlaps the job's start instead of preceding it.
    ///
    /// Every worker still runs `job` once, so any job stays correct; but worker 0 starts late,
    /// so only a job that pulls tasks from a shared counter keeps every core busy (the late
    /// worker just takes fewer tasks). A job split by worker index waits for `first` before its
    /// part 0 starts: use [`ExpertPool::run`] for those.
    ///
    /// One job at a time: a call from inside `first` or `job`, or from another thread while a
    /// job runs, panics (it would replace the job under the workers). A panic in `first` or in
    /// any worker's `job` is raised here once every worker is done with the job.
    pub fn run_after(&self, job: &(dyn Fn(usize) + Sync), first: impl FnOnce()) {
        let s = &*self.shared;
        if s.busy.swap(true, Ordering::Acquire) {
            panic!("ExpertPool: a job was started while another runs (nested or concurrent call)");
        }
        let _busy = ClearOnDrop(&s.busy);
        if self.threads == 1 {
            first();
            job(0);
            return;
        }
        // SAFETY: a fat pointer split into two words; workers rebuild it only for this
        // generation, and we do not return (nor unwind) before every worker is done with it.
        let raw: [usize; 2] =
            unsafe { std::mem::transmute::<*const Job<'_>, [usize; 2]>(job as *const Job<'_>) };
        s.job.store(raw[0], Ordering::Relaxed);
        s.job_meta.store(raw[1], Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Release);
        for (_, t) in &self.workers {
            t.unpark();
        }
        // Caught so that the workers are waited for before the job's borrows end.
        let caller = std::panic::catch_unwind(std::panic::AssertUnwindSafe(first))
            .and_then(|()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(0))));
        let start = Instant::now();
        while s.done.load(Ordering::Acquire) != self.threads - 1 {
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
        if let Err(payload) = caller {
            std::panic::resume_unwind(payload);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("an expert worker thread panicked");
        }
    }
}

/// Clears a flag when dropped (on return and on unwinding).
struct ClearOnDrop<'a>(&'a AtomicBool);
impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

fn worker_loop(s: &Shared, worker: usize) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let gen = loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen || s.stop.load(Ordering::Relaxed) {
                break g;
            }
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                thread::park_timeout(Duration::from_millis(10));
            }
        };
        if s.stop.load(Ordering::Relaxed) {
            return;
        }
        seen = gen;
        let raw = [
            s.job.load(Ordering::Relaxed),
            s.job_meta.load(Ordering::Relaxed),
        ];
        // SAFETY: `run` keeps the job alive until `done` reaches the worker count.
        let job: &Job<'_> = unsafe { &*std::mem::transmute::<[usize; 2], *const Job<'_>>(raw) };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(worker))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

impl Drop for ExpertPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for (h, t) in self.workers.drain(..) {
            t.unpark();
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once_across_workers() {
        for threads in [1, 2, 3] {
            let pool = ExpertPool::new(threads, false);
            for round in 0..200 {
                let n = 50 + round % 7;
                let next = AtomicUsize::new(0);
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(&|_| loop {
                    let t = next.fetch_add(1, Ordering::Relaxed);
                    if t >= n {
                        break;
                    }
                    hits[t].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "threads {threads} round {round}"
                );
            }
        }
    }

    /// A job pulling tasks from a counter; `hits[t]` counts the runs of task `t`.
    fn counted_tasks<'a>(
        next: &'a AtomicUsize,
        hits: &'a [AtomicUsize],
    ) -> impl Fn(usize) + Sync + 'a {
        move |_| loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            if t >= hits.len() {
                break;
            }
            hits[t].fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn every_task_runs_exactly_once_with_a_slow_first() {
        for threads in [1, 2, 3] {
            let pool = ExpertPool::new(threads, false);
            for round in 0..20 {
                let next = AtomicUsize::new(0);
                let hits: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
                let first_runs = AtomicUsize::new(0);
                pool.run_after(&counted_tasks(&next, &hits), || {
                    thread::sleep(Duration::from_millis(2));
                    first_runs.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(first_runs.load(Ordering::Relaxed), 1);
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "threads {threads} round {round}"
                );
            }
        }
    }

    #[test]
    fn first_runs_on_the_caller_before_it_joins_the_job() {
        for threads in [1, 2, 3] {
            let pool = ExpertPool::new(threads, false);
            let caller = thread::current().id();
            let first_done = AtomicBool::new(false);
            let first_on = std::sync::Mutex::new(None);
            let worker0_saw_first_done = AtomicBool::new(false);
            pool.run_after(
                &|worker| {
                    if worker == 0 {
                        assert_eq!(thread::current().id(), caller);
                        worker0_saw_first_done
                            .store(first_done.load(Ordering::Relaxed), Ordering::Relaxed);
                    }
                },
                || {
                    *first_on.lock().unwrap() = Some(thread::current().id());
                    first_done.store(true, Ordering::Relaxed);
                },
            );
            assert_eq!(*first_on.lock().unwrap(), Some(caller), "threads {threads}");
            assert!(
                worker0_saw_first_done.load(Ordering::Relaxed),
                "threads {threads}"
            );
        }
    }

    #[test]
    fn one_thread_runs_first_then_the_job() {
        let pool = ExpertPool::new(1, false);
        let order = std::sync::Mutex::new(Vec::new());
        pool.run_after(
            &|worker| order.lock().unwrap().push(format!("job {worker}")),
            || order.lock().unwrap().push("first".to_string()),
        );
        assert_eq!(*order.lock().unwrap(), ["first", "job 0"]);
    }

    #[test]
    fn the_other_workers_start_while_first_runs() {
        let pool = ExpertPool::new(3, false);
        let next = AtomicUsize::new(0);
        let hits: Vec<AtomicUsize> = (0..8).map(|_| AtomicUsize::new(0)).collect();
        let job = counted_tasks(&next, &hits);
        // `first` waits until the workers have taken every task: it would wait forever if
        // they only started once the caller joined.
        pool.run_after(&job, || {
            let start = Instant::now();
            while next.load(Ordering::Relaxed) < hits.len() {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "workers did not start"
                );
                thread::yield_now();
            }
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_panic_in_first_is_raised_after_the_workers_finish() {
        let pool = ExpertPool::new(3, false);
        let next = AtomicUsize::new(0);
        let hits: Vec<AtomicUsize> = (0..32).map(|_| AtomicUsize::new(0)).collect();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run_after(&counted_tasks(&next, &hits), || panic!("first failed"))
        }));
        assert!(r.is_err());
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        // The pool takes the next job.
        let next = AtomicUsize::new(0);
        let hits: Vec<AtomicUsize> = (0..32).map(|_| AtomicUsize::new(0)).collect();
        pool.run(&counted_tasks(&next, &hits));
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_nested_job_panics_instead_of_replacing_the_running_one() {
        for threads in [1, 2] {
            let pool = ExpertPool::new(threads, false);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.run_after(&|_| {}, || pool.run(&|_| {}))
            }));
            assert!(r.is_err(), "threads {threads}");
            pool.run(&|_| {});
        }
    }

    #[test]
    fn physical_cores_are_distinct_and_nonempty() {
        let c = physical_cores();
        assert!(!c.is_empty());
        let set: std::collections::BTreeSet<_> = c.iter().collect();
        assert_eq!(set.len(), c.len());
    }
}
