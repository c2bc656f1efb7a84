//! What the process actually holds, next to what the ledgers say it should.
//!
//! The startup ledger counts the host expert store (RAM, part of it page-locked) and the
//! backend's allocations (VRAM). [`ProcessMemory`] reads the kernel's view (Linux
//! `/proc/self/status`): resident anonymous memory is what the process holds itself; file pages
//! of a mapped checkpoint are page cache the kernel can drop, so they are reported apart.
//! [`MemoryCheck`] pairs a ledger total with the measured growth around a load.

use crate::backend::cpu::experts::{ExpertLayout, ExpertSet};
use crate::backend::{Backend, HostPin};
use crate::tensor::{Bytes, DType, HostTensor};
use anyhow::Result;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// The kernel's counters for this process, in bytes (`None` where the OS has no such file).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ProcessMemory {
    /// `VmRSS`: resident now, anonymous + file + shared.
    pub rss: u64,
    /// `VmHWM`: the most ever resident.
    pub rss_peak: u64,
    /// `RssAnon`: resident anonymous memory (heap, the expert store).
    pub rss_anon: u64,
    /// `RssFile`: resident pages of mapped files (a checkpoint read in place).
    pub rss_file: u64,
    /// `VmLck` + `VmPin`: memory the kernel may not page out (mlock, pinned pages).
    pub locked: u64,
}

impl ProcessMemory {
    /// This process now; `None` off Linux.
    pub fn now() -> Option<ProcessMemory> {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .map(|s| parse_status(&s))
    }
}

/// Parses `/proc/<pid>/status` (fields in kB).
pub fn parse_status(text: &str) -> ProcessMemory {
    let mut m = ProcessMemory::default();
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let kb: u64 = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let bytes = kb * 1024;
        match key {
            "VmRSS" => m.rss = bytes,
            "VmHWM" => m.rss_peak = bytes,
            "RssAnon" => m.rss_anon = bytes,
            "RssFile" => m.rss_file = bytes,
            "VmLck" | "VmPin" => m.locked += bytes,
            _ => {}
        }
    }
    m
}

/// A ledger total beside what was measured for it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MemoryCheck {
    /// What the ledger says is held.
    pub ledger_bytes: u64,
    /// What the OS or the driver says was taken (growth around the load).
    pub measured_bytes: u64,
    /// `measured / ledger` (1.0: the ledger is exact).
    pub measured_to_ledger_ratio: f64,
    /// Within 5% either way.
    pub within_5_percent: bool,
}

impl MemoryCheck {
    pub fn new(ledger_bytes: u64, measured_bytes: u64) -> MemoryCheck {
        let ratio = measured_bytes as f64 / (ledger_bytes.max(1)) as f64;
        MemoryCheck {
            ledger_bytes,
            measured_bytes,
            measured_to_ledger_ratio: ratio,
            within_5_percent: (ratio - 1.0).abs() <= 0.05,
        }
    }
}

/// Resident anonymous growth between two readings (0 when the OS has no counters).
pub fn anon_growth(before: Option<ProcessMemory>, after: Option<ProcessMemory>) -> u64 {
    match (before, after) {
        (Some(b), Some(a)) => a.rss_anon.saturating_sub(b.rss_anon),
        _ => 0,
    }
}

/// `layers` host expert sets of `experts` records with random valid blocks (the benches'
/// full-size stand-in for a checkpoint's experts): every byte written, as a loader writes it,
/// so the pages are resident. Gate and up share one tensor scale, as fused checkpoints have.
pub fn synthetic_store(
    layout: ExpertLayout,
    layers: usize,
    experts: usize,
    seed: u64,
) -> Vec<Arc<ExpertSet>> {
    (0..layers)
        .map(|l| {
            let mut set = ExpertSet::zeroed(layout, experts);
            set.randomize(seed.wrapping_add(l as u64));
            for e in 0..experts {
                let [g, _, d] = set.multipliers(e);
                set.set_multipliers(e, [g, g, d]);
            }
            Arc::new(set)
        })
        .collect()
}

/// What [`full_size_footprint`] builds: the whole model's host store at full size, the dense
/// weights uploaded the way the loader uploads them, and the expert cache filled.
#[derive(Debug, Clone)]
pub struct FootprintOptions {
    pub layout: ExpertLayout,
    pub layers: usize,
    pub experts: usize,
    /// Dense weight bytes uploaded to the backend (as stored).
    pub dense_bytes: u64,
    /// The largest dense tensor: the loader holds one such host tensor at a time while uploading.
    pub largest_dense_tensor_bytes: u64,
    /// Device bytes for resident experts (filled with copies from the host store).
    pub cache_bytes: u64,
    /// The configuration table's promise for peak resident + page-locked RAM.
    pub promise_bytes: u64,
    pub seed: u64,
}

/// Peak RAM and the page-locked store of a full-size hybrid Flash-Next, measured: the host
/// store built and page-locked layer by layer as the loader does, the dense weights uploaded
/// through transient host tensors, the expert cache filled from the store. The n-gram table is
/// left out (it is read from disk, not held). Returns the JSON record, the loaded objects
/// dropped; `device_used` (CUDA: ledger bytes and the driver's used bytes) is read at the peak.
pub fn full_size_footprint<B: Backend>(
    b: &B,
    o: &FootprintOptions,
    device_used: &dyn Fn() -> Option<(u64, u64)>,
) -> Result<Value> {
    let t0 = Instant::now();
    let device_before = device_used();
    let before = ProcessMemory::now();
    let mut sets = Vec::with_capacity(o.layers);
    let mut pins: Vec<HostPin> = Vec::new();
    let mut pin_error = None;
    for l in 0..o.layers {
        let set = synthetic_store(o.layout, 1, o.experts, o.seed.wrapping_add(l as u64))
            .pop()
            .expect("one layer");
        if pin_error.is_none() {
            // SAFETY: `set` is an `Arc` kept in `sets` until after `pins` is dropped below.
            match unsafe { b.pin_host(set.as_bytes()) } {
                Ok(Some(p)) => pins.push(p),
                Ok(None) => {}
                Err(e) => pin_error = Some(format!("{e:#}")),
            }
        }
        sets.push(set);
    }
    let store = ProcessMemory::now();
    let store_bytes: u64 = sets.iter().map(|s| s.bytes() as u64).sum();
    let pinned: u64 = pins.iter().map(|p| p.bytes() as u64).sum();

    // Dense weights: BF16 tensors of the largest tensor's size, one host copy at a time.
    let chunk = o.largest_dense_tensor_bytes.min(o.dense_bytes.max(2)) as usize & !1;
    let cols = 2560usize;
    let host = Bytes::from_vec(vec![0u8; chunk.next_multiple_of(2 * cols)]);
    let mut dense = Vec::new();
    let mut left = o.dense_bytes as usize;
    while left > 0 {
        let n = left.min(host.len());
        let rows = (n / (2 * cols)).max(1);
        let t = HostTensor {
            name: format!("synthetic dense weight {}", dense.len()),
            dtype: DType::BF16,
            shape: vec![rows, cols],
            data: host.slice(0, rows * cols * 2),
        };
        dense.push(b.matrix(&t)?);
        left = left.saturating_sub(rows * cols * 2);
    }
    drop(host);
    // The cache filled from the store, round-robin over layers as a warm cache would be.
    let expert_bytes = o.layout.weight_bytes() as u64;
    let slots = ((o.cache_bytes / expert_bytes.max(1)) as usize).min(o.layers * o.experts);
    let mut resident = Vec::with_capacity(slots);
    for i in 0..slots {
        resident.push(super::experts::upload(
            b,
            &sets[i % o.layers],
            i / o.layers,
        )?);
    }
    let peak = ProcessMemory::now();
    let device_peak = device_used();
    let seconds = t0.elapsed().as_secs_f64();
    drop(resident);
    drop(dense);
    drop(pins);
    drop(sets);

    let p = peak.unwrap_or_default();
    // cuMemHostRegister pins pages that are already resident: they are inside VmRSS on Linux,
    // so the footprint is the resident peak; the sum is the bound for an OS that does not count
    // them (reported, not the promise's measure here).
    let footprint = p.rss_peak;
    let ram_check = MemoryCheck::new(store_bytes, anon_growth(before, store));
    let vram = match (device_before, device_peak) {
        (Some((l0, d0)), Some((l1, d1))) => {
            let c = MemoryCheck::new(l1.saturating_sub(l0), d1.saturating_sub(d0));
            json!({
                "ledger_bytes": c.ledger_bytes,
                "driver_used_growth_bytes": c.measured_bytes,
                "driver_to_ledger_ratio": c.measured_to_ledger_ratio,
                "within_5_percent": c.within_5_percent,
            })
        }
        _ => Value::Null,
    };
    let gib = |v: u64| v as f64 / (1u64 << 30) as f64;
    eprintln!(
        "footprint: store {:.2} GiB ({:.2} GiB page-locked), peak resident {:.2} GiB, promise {:.2} GiB",
        gib(store_bytes),
        gib(pinned),
        gib(footprint),
        gib(o.promise_bytes)
    );
    Ok(json!({
        "layers": o.layers,
        "experts_per_layer": o.experts,
        "format": o.layout.format.name(),
        "down_format": o.layout.down_format.name(),
        "expert_record_bytes": o.layout.record_bytes,
        "host_store_bytes": store_bytes,
        "page_locked_bytes": pinned,
        "page_lock_error": pin_error,
        "dense_bytes": o.dense_bytes,
        "largest_dense_tensor_bytes": chunk,
        "cache_slots_filled": slots,
        "cache_bytes": slots as u64 * expert_bytes,
        "process_before": before,
        "process_after_store": store,
        "process_at_peak": peak,
        "peak_resident_bytes": footprint,
        "peak_resident_plus_page_locked_bytes": p.rss_peak + pinned,
        "promise_bytes": o.promise_bytes,
        "peak_resident_to_promise_ratio": footprint as f64 / o.promise_bytes as f64,
        "within_promise": footprint <= o.promise_bytes,
        "ram_ledger": {
            "ledger_bytes": ram_check.ledger_bytes,
            "anon_growth_bytes": ram_check.measured_bytes,
            "measured_to_ledger_ratio": ram_check.measured_to_ledger_ratio,
            "within_5_percent": ram_check.within_5_percent,
        },
        "vram_ledger": vram,
        "seconds": seconds,
        "note": "n-gram table excluded (read from disk); page-locked pages are resident, so VmHWM includes them on Linux",
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernel_status_fields() {
        let text = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nRssAnon:\t 1000 kB\nRssFile:\t 24 kB\nVmLck:\t 4 kB\nVmPin:\t 8 kB\n";
        let m = parse_status(text);
        assert_eq!(m.rss, 1024 * 1024);
        assert_eq!(m.rss_peak, 2048 * 1024);
        assert_eq!(m.rss_anon, 1000 * 1024);
        assert_eq!(m.rss_file, 24 * 1024);
        assert_eq!(m.locked, 12 * 1024);
    }

    #[test]
    fn small_footprint_on_the_cpu_counts_the_store() {
        use crate::backend::cpu::experts::{ExpertShape, RowFormat};
        let layout = ExpertLayout::new(
            RowFormat::parse("q8_0").unwrap(),
            RowFormat::parse("q8_0").unwrap(),
            ExpertShape {
                hidden: 64,
                intermediate: 32,
            },
        )
        .unwrap();
        let o = FootprintOptions {
            layout,
            layers: 2,
            experts: 8,
            dense_bytes: 3 * 2560 * 2 * 4 + 10,
            largest_dense_tensor_bytes: 2560 * 2 * 4,
            cache_bytes: 3 * layout.weight_bytes() as u64,
            promise_bytes: 1 << 40,
            seed: 1,
        };
        let r = full_size_footprint(&crate::backend::cpu::CpuBackend::new(), &o, &|| None).unwrap();
        assert_eq!(r["host_store_bytes"], 16 * layout.record_bytes);
        assert_eq!(r["page_locked_bytes"], 0);
        assert_eq!(r["cache_slots_filled"], 3);
        assert_eq!(r["within_promise"], true);
        assert!(r["vram_ledger"].is_null());
    }

    #[test]
    fn check_flags_five_percent() {
        assert!(MemoryCheck::new(100, 104).within_5_percent);
        assert!(!MemoryCheck::new(100, 106).within_5_percent);
        assert!(!MemoryCheck::new(100, 90).within_5_percent);
    }
}
