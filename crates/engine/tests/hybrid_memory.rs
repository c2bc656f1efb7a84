//! The RAM ledger of the hybrid host expert store matches what the process holds: resident
//! anonymous memory grows by the store's bytes (within 5%) while a synthetic store is built the
//! way the loader builds it, and falls back when it is dropped. One test in its own binary, so
//! no other test's allocations run beside the measurement.

use capy_engine::backend::cpu::experts::{ExpertLayout, ExpertShape, RowFormat};
use capy_engine::hybrid::memory::{anon_growth, synthetic_store, MemoryCheck, ProcessMemory};

#[test]
fn store_ledger_matches_resident_growth() {
    if ProcessMemory::now().is_none() {
        eprintln!("no /proc/self/status on this OS: nothing to measure");
        return;
    }
    let layout = ExpertLayout::new(
        RowFormat::parse("q8_0").unwrap(),
        RowFormat::parse("q8_0").unwrap(),
        ExpertShape {
            hidden: 256,
            intermediate: 128,
        },
    )
    .unwrap();
    // 4 layers × 640 experts × ~104 KB ≈ 64 MiB: far above allocator noise.
    let (layers, experts) = (4, 640);
    // Warm the thread pool and the allocator first so their own growth is not measured.
    drop(synthetic_store(layout, 1, 8, 0));
    let before = ProcessMemory::now();
    let store = synthetic_store(layout, layers, experts, 1);
    let after = ProcessMemory::now();
    let ledger: u64 = store.iter().map(|s| s.bytes() as u64).sum();
    assert_eq!(ledger, (layers * experts * layout.record_bytes) as u64);
    let check = MemoryCheck::new(ledger, anon_growth(before, after));
    assert!(
        check.within_5_percent,
        "the store's ledger says {} B, resident anonymous memory grew by {} B (ratio {:.3})",
        check.ledger_bytes, check.measured_bytes, check.measured_to_ledger_ratio
    );
    let peak = after.unwrap().rss_peak;
    assert!(
        peak >= ledger,
        "VmHWM {peak} B below the store's {ledger} B"
    );
    drop(store);
    let freed = ProcessMemory::now().unwrap().rss_anon;
    let held = after.unwrap().rss_anon;
    assert!(
        held - freed.min(held) >= ledger * 95 / 100,
        "dropping the store gave back {} of {ledger} B",
        held - freed.min(held)
    );
}
