use super::*;

fn identity() -> CacheIdentity {
    CacheIdentity {
        model_id: "tiny".into(),
        format: "f32/cpu".into(),
    }
}

fn config(ram: usize) -> CacheConfig {
    CacheConfig {
        block_tokens: 4,
        ram_bytes: ram,
        ..CacheConfig::new(identity())
    }
}

/// A state whose contents are a function of its tokens, `n` f32 values per token.
fn state_for(tokens: &[u32], n: usize) -> HostState {
    let mut s = HostState::new(tokens.len());
    let data: Vec<f32> = tokens
        .iter()
        .flat_map(|&t| (0..n).map(move |i| t as f32 * 10.0 + i as f32))
        .collect();
    s.tensors.push(HostPart {
        rows: tokens.len(),
        cols: n,
        data,
    });
    s.ids.push(tokens.iter().rev().take(2).copied().collect());
    s
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn deepest_prefix_wins_and_tokens_are_compared_exactly() {
    let mut c = PrefixCache::new(config(1 << 20)).unwrap();
    let a = toks(0..8);
    c.insert("s", &a[..4], state_for(&a[..4], 2));
    c.insert("s", &a, state_for(&a, 2));
    c.insert("s", &a[..6], state_for(&a[..6], 2));
    let mut prompt = toks(0..12);
    let b = c.begin(&prompt, prompt.len() - 1, None);
    let h = b.hit.expect("a hit");
    assert_eq!(h.len, 8);
    assert_eq!(*h.state, state_for(&a, 2));
    // Leave at least one token to compute: the whole prompt is never a hit.
    let b = c.begin(&a, a.len() - 1, None);
    assert_eq!(b.hit.unwrap().len, 6);
    // A different token inside the second block: only the first block's entry matches.
    prompt[5] = 999;
    let b = c.begin(&prompt, prompt.len() - 1, None);
    assert_eq!(b.hit.unwrap().len, 4);
    prompt[0] = 999;
    assert!(c.begin(&prompt, prompt.len() - 1, None).hit.is_none());
    assert_eq!((c.hits, c.misses), (3, 1));
}

#[test]
fn partial_block_entries_match_too() {
    let mut c = PrefixCache::new(config(1 << 20)).unwrap();
    let a = toks(0..6); // one block and two tokens
    c.insert("s", &a, state_for(&a, 1));
    c.insert("s", &a[..3], state_for(&a[..3], 1));
    let p = toks(0..10);
    assert_eq!(c.begin(&p, 9, None).hit.unwrap().len, 6);
    let mut q = p.clone();
    q[5] = 7777;
    assert_eq!(c.begin(&q, 9, None).hit.unwrap().len, 3);
}

#[test]
fn session_follows_the_conversation_tip_not_a_shared_prefix() {
    let mut c = PrefixCache::new(config(1 << 20)).unwrap();
    let sys = toks(0..8);
    let conv = toks(0..16);
    c.insert("alice", &sys, state_for(&sys, 1));
    c.insert("alice", &conv, state_for(&conv, 1));
    let cont = toks(0..20);
    assert_eq!(c.begin(&cont, 19, None).session, "alice");
    // Another conversation on the same system prompt hits it but is not alice's.
    let mut other = toks(0..12);
    other[9] = 5000;
    let b = c.begin(&other, 11, None);
    assert_eq!(b.hit.unwrap().len, 8);
    assert_ne!(b.session, "alice");
    // An explicit key wins.
    assert_eq!(c.begin(&cont, 19, Some("k")).session, "k");
}

#[test]
fn eviction_keeps_every_sessions_deepest_entry_and_the_budget() {
    let per = |n: usize| n * 8 * 4 + 2 * 4 + n * 4; // tensor + ids + tokens
    let long_a = toks(0..64);
    let long_b = toks(1000..1064);
    // Room for both long conversations and a little more.
    let budget = per(64) * 2 + per(8) * 2;
    let mut c = PrefixCache::new(config(budget)).unwrap();
    for n in [8, 16, 32, 48, 64] {
        c.insert("a", &long_a[..n], state_for(&long_a[..n], 8));
        assert!(c.ram_use() <= budget);
    }
    for n in [8, 16, 32, 48, 64] {
        c.insert("b", &long_b[..n], state_for(&long_b[..n], 8));
        assert!(c.ram_use() <= budget);
    }
    // Session b's small requests push out intermediates, never a's conversation.
    for i in 0..20u32 {
        let t: Vec<u32> = (0..8).map(|k| 5000 + i * 8 + k).collect();
        c.insert("b", &t, state_for(&t, 8));
        assert!(c.ram_use() <= budget, "{} > {budget}", c.ram_use());
        assert!(c.entries_of("a").contains(&(64, Tier::Ram)), "{i}");
    }
    let p = toks(0..80);
    assert_eq!(c.begin(&p, 79, None).hit.unwrap().len, 64);
    // An entry larger than the whole budget is not stored.
    let huge = toks(0..400);
    c.insert("c", &huge, state_for(&huge, 8));
    assert!(c.entries_of("c").is_empty());
}

#[test]
fn deepest_entries_give_way_by_recency_to_disk() {
    let dir = tempfile::tempdir().unwrap();
    let per = 32 * 4 * 4 + 8 + 32 * 4;
    let mut cfg = config(per * 2);
    cfg.disk_dir = Some(dir.path().to_path_buf());
    let mut c = PrefixCache::new(cfg).unwrap();
    for (s, base) in [("a", 0u32), ("b", 100), ("c", 200)] {
        let t: Vec<u32> = (base..base + 32).collect();
        c.insert(s, &t, state_for(&t, 4));
    }
    // The writes run on the cache's writer thread.
    c.wait_writes();
    // Three deepest entries, room for two in RAM: the oldest (a) went to disk, not away.
    assert_eq!(c.entries_of("a"), vec![(32, Tier::Disk)]);
    assert_eq!(c.entries_of("c"), vec![(32, Tier::Ram)]);
    assert!(c.ram_use() <= per * 2);
    // a returns: read back from disk, exactly.
    let p: Vec<u32> = (0..40).collect();
    let b = c.begin(&p, 39, Some("a"));
    let h = b.hit.unwrap();
    assert_eq!(h.tier, Tier::Disk);
    assert_eq!(*h.state, state_for(&p[..32], 4));
    assert_eq!(c.entries_of("a"), vec![(32, Tier::Ram)]);
}

#[test]
fn disk_entries_survive_a_restart_and_idle_sessions_move_down() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(1 << 20);
    cfg.disk_dir = Some(dir.path().to_path_buf());
    cfg.idle = Duration::ZERO;
    let t = toks(0..13);
    {
        let mut c = PrefixCache::new(cfg.clone()).unwrap();
        c.insert("sess", &t, state_for(&t, 3));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(c.maintain(), 1);
        c.wait_writes();
        assert_eq!(c.entries_of("sess"), vec![(13, Tier::Disk)]);
        assert_eq!(c.ram_use(), 0);
        assert!(c.disk_use() > 0);
    }
    let mut c = PrefixCache::new(cfg.clone()).unwrap();
    assert_eq!(c.entries_of("sess"), vec![(13, Tier::Disk)]);
    let st = c.status();
    assert_eq!(st.sessions.len(), 1);
    assert_eq!(st.sessions[0].tier, Tier::Disk);
    assert_eq!(st.sessions[0].tokens, 13);
    assert!(st.disk_offload.enabled);
    let p = toks(0..20);
    let h = c.begin(&p, 19, None).hit.unwrap();
    assert_eq!((h.len, h.tier), (13, Tier::Disk));
    assert_eq!(*h.state, state_for(&t, 3));
    // Another model's cache lives elsewhere and never sees this entry.
    let mut other = cfg.clone();
    other.identity.format = "nvfp4/cuda".into();
    let mut o = PrefixCache::new(other).unwrap();
    assert!(o.is_empty());
    assert!(o.begin(&p, 19, None).hit.is_none());
}

fn only_file(dir: &Path) -> PathBuf {
    let sub = std::fs::read_dir(dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let files: Vec<PathBuf> = std::fs::read_dir(&sub)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

fn demoted_entry(dir: &Path) -> (CacheConfig, Vec<u32>, PathBuf) {
    let mut cfg = config(1 << 20);
    cfg.disk_dir = Some(dir.to_path_buf());
    cfg.idle = Duration::ZERO;
    let t = toks(0..9);
    let mut c = PrefixCache::new(cfg.clone()).unwrap();
    c.insert("s", &t, state_for(&t, 5));
    std::thread::sleep(Duration::from_millis(5));
    c.maintain();
    c.wait_writes();
    (cfg, t, only_file(dir))
}

#[test]
fn a_corrupt_payload_is_detected_discarded_and_never_used() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _, path) = demoted_entry(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 7] ^= 0x10; // one bit inside the state section
    std::fs::write(&path, &bytes).unwrap();
    let mut c = PrefixCache::new(cfg).unwrap();
    assert_eq!(c.len(), 1, "the header is intact, so the entry is indexed");
    let p = toks(0..12);
    assert!(c.begin(&p, 11, None).hit.is_none());
    assert!(!path.exists(), "the corrupt file is deleted");
    assert_eq!(c.disk_rejected, 1);
    assert!(c.is_empty());
}

#[test]
fn truncated_mislabelled_and_foreign_files_are_rejected_at_scan() {
    for damage in ["truncate", "header", "model", "version", "rename"] {
        let dir = tempfile::tempdir().unwrap();
        let (mut cfg, t, path) = demoted_entry(dir.path());
        let bytes = std::fs::read(&path).unwrap();
        match damage {
            "truncate" => std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap(),
            "header" => {
                let mut b = bytes.clone();
                b[20] ^= 1;
                std::fs::write(&path, b).unwrap();
            }
            "model" => {
                // A file another model wrote, put in this model's folder.
                let mut other = cfg.identity.clone();
                other.model_id = "other".into();
                let tmp = tempfile::tempdir().unwrap();
                let (p2, _) =
                    disk::write_entry(tmp.path(), &other, "s", &t, &state_for(&t, 5)).unwrap();
                std::fs::copy(p2, &path).unwrap();
            }
            "version" => {
                let mut b = bytes.clone();
                b[8] = 99;
                std::fs::write(&path, b).unwrap();
            }
            _ => {
                let wrong = path.with_file_name(disk::file_name(&toks(0..4)));
                std::fs::rename(&path, wrong).unwrap();
            }
        }
        cfg.idle = Duration::from_secs(1000);
        let mut c = PrefixCache::new(cfg).unwrap();
        assert!(c.is_empty(), "{damage}: a damaged entry was indexed");
        assert_eq!(c.disk_rejected, 1, "{damage}");
        let p = toks(0..12);
        assert!(c.begin(&p, 11, None).hit.is_none(), "{damage}");
        let sub = path.parent().unwrap();
        assert_eq!(std::fs::read_dir(sub).unwrap().count(), 0, "{damage}");
    }
}

#[test]
fn disk_budget_deletes_least_recent_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(1 << 20);
    cfg.disk_dir = Some(dir.path().to_path_buf());
    cfg.idle = Duration::ZERO;
    let mut c = PrefixCache::new(cfg).unwrap();
    let mut sizes = Vec::new();
    for (s, base) in [("a", 0u32), ("b", 100), ("c", 200)] {
        let t: Vec<u32> = (base..base + 16).collect();
        c.insert(s, &t, state_for(&t, 4));
        std::thread::sleep(Duration::from_millis(5));
        c.maintain();
        c.wait_writes();
        sizes.push(c.disk_use());
    }
    let one = sizes[0];
    c.set_disk_budget(one * 2);
    assert!(c.disk_use() <= one * 2);
    assert!(
        c.entries_of("a").is_empty(),
        "the least recent session went"
    );
    assert_eq!(c.entries_of("c"), vec![(16, Tier::Disk)]);
}

#[test]
fn disk_offload_can_be_switched_at_run_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = PrefixCache::new(config(1 << 20)).unwrap();
    assert!(!c.status().disk_offload.enabled);
    let t = toks(0..10);
    c.insert("s", &t, state_for(&t, 2));
    c.set_disk(Some(dir.path())).unwrap();
    c.set_idle(Duration::ZERO);
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(c.maintain(), 1);
    c.wait_writes();
    let st = c.status();
    assert!(st.disk_offload.enabled);
    assert_eq!(
        st.disk_offload.dir.as_deref(),
        Some(dir.path().to_str().unwrap())
    );
    c.set_disk(None).unwrap();
    assert!(
        c.is_empty(),
        "disk-only entries are forgotten when offload is off"
    );
    c.set_disk(Some(dir.path())).unwrap();
    assert_eq!(c.entries_of("s"), vec![(10, Tier::Disk)], "and found again");
    let bad = dir.path().join("file-not-dir");
    std::fs::write(&bad, b"x").unwrap();
    let e = c.set_disk(Some(&bad)).unwrap_err();
    assert!(format!("{e:#}").contains("writable"), "{e:#}");
}

#[test]
fn state_section_round_trips() {
    let t = toks(3..40);
    let s = state_for(&t, 7);
    assert_eq!(disk::decode_state(&disk::encode_state(&s)).unwrap(), s);
    let enc = disk::encode_state(&s);
    assert!(disk::decode_state(&enc[..enc.len() - 1]).is_err());
}

#[test]
fn ram_pressure_moves_intermediates_to_disk_instead_of_dropping_them() {
    let dir = tempfile::tempdir().unwrap();
    let per = |n: usize| n * 8 * 4 + 2 * 4 + n * 4;
    let t = toks(0..64);
    let mut cfg = config(per(64) + per(32));
    cfg.disk_dir = Some(dir.path().to_path_buf());
    let mut c = PrefixCache::new(cfg).unwrap();
    for n in [16, 32, 48, 64] {
        c.insert("a", &t[..n], state_for(&t[..n], 8));
        c.wait_writes();
        assert!(c.ram_use() <= per(64) + per(32));
    }
    // Nothing was dropped: what did not fit in RAM is on disk, the deepest stays in RAM.
    let e = c.entries_of("a");
    assert_eq!(e.len(), 4, "{e:?}");
    assert_eq!(e.last(), Some(&(64, Tier::Ram)));
    assert!(e.iter().any(|x| x.1 == Tier::Disk), "{e:?}");
    // An intermediate resumes from disk, exactly.
    let mut p = t[..20].to_vec();
    p.extend([900, 901]);
    let h = c.begin(&p, p.len() - 1, None).hit.unwrap();
    assert_eq!(h.len, 16);
    assert_eq!(*h.state, state_for(&t[..16], 8));
}

#[test]
fn expert_heat_halves_older_turns_and_adds_the_new_one() {
    use crate::hybrid::expert_cache::HeatEntry;
    let mut c = PrefixCache::new(config(1 << 20)).unwrap();
    let t = toks(0..8);
    c.insert("a", &t, state_for(&t, 2));
    let h = |expert: u32, score: f32| HeatEntry {
        layer: 1,
        expert,
        score,
    };
    c.merge_heat("a", &[h(3, 4.0), h(5, 1.0)]);
    c.merge_heat("a", &[h(5, 2.0), h(7, 1.0)]);
    // 3: 4/2 = 2; 5: 1/2 + 2 = 2.5; 7: 1. Hottest first.
    assert_eq!(c.heat_of("a"), vec![h(5, 2.5), h(3, 2.0), h(7, 1.0)]);
    assert!(c.heat_of("b").is_empty());
    assert_eq!(c.status().sessions[0].hot_experts, 3);
}

#[test]
fn disk_writes_wait_on_the_writer_thread_not_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(1 << 20);
    cfg.disk_dir = Some(dir.path().to_path_buf());
    cfg.idle = Duration::ZERO;
    let mut c = PrefixCache::new(cfg).unwrap();
    let gate = c.gate_writes();
    let t = toks(0..12);
    c.insert("a", &t, state_for(&t, 3));
    std::thread::sleep(Duration::from_millis(5));
    // The write is queued and held by the gate; the cache keeps answering meanwhile.
    assert_eq!(c.maintain(), 1);
    assert_eq!(c.writes_in_flight(), 1);
    assert_eq!(c.entries_of("a"), vec![(12, Tier::Ram)]);
    let mut p = t.clone();
    p.push(77);
    let h = c
        .begin(&p, 12, None)
        .hit
        .expect("a queued entry is still usable");
    assert_eq!((h.len, h.tier), (12, Tier::Ram));
    let u = toks(500..520);
    c.insert("b", &u, state_for(&u, 3));
    // Released: the entry lands on disk and leaves RAM.
    gate.send(()).unwrap();
    drop(gate);
    c.wait_writes();
    assert_eq!(c.writes_in_flight(), 0);
    assert_eq!(c.entries_of("a"), vec![(12, Tier::Disk)]);
    assert!(c.disk_use() > 0);
    // An entry removed while it is being written leaves no file behind.
    let gate = c.gate_writes();
    std::thread::sleep(Duration::from_millis(5));
    c.maintain();
    assert_eq!(c.writes_in_flight(), 1, "b is queued");
    c.set_enabled(false);
    assert!(c.entries_of("b").is_empty());
    drop(gate);
    c.wait_writes();
    let files = std::fs::read_dir(only_sub(dir.path())).unwrap().count();
    assert_eq!(files, 1, "only a's file");
}

fn only_sub(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
}

/// A state of several tensors of different shapes (and values no arithmetic produces, so a
/// byte-level mix-up shows), plus id lists.
fn mixed_state(len: usize) -> HostState {
    let mut s = HostState::new(len);
    for (i, &(rows, cols)) in [(len, 16), (3, 5), (len, 1), (0, 8), (7, 33)]
        .iter()
        .enumerate()
    {
        let data = (0..rows * cols)
            .map(|j| {
                f32::from_bits(
                    0x3f80_0000 ^ ((i as u32) << 24) ^ (j as u32).wrapping_mul(2_654_435_761),
                )
            })
            .collect();
        s.tensors.push(HostPart { rows, cols, data });
    }
    s.ids.push(vec![1, 2, 3]);
    s.ids.push(vec![]);
    s
}

#[test]
fn disk_entries_round_trip_bitwise_and_keep_the_format() {
    let dir = tempfile::tempdir().unwrap();
    let t = toks(0..50);
    let s = mixed_state(t.len());
    let (path, n) = disk::write_entry(dir.path(), &identity(), "s", &t, &s).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len() as u64, n);
    // The streamed write lays the state section out exactly as `encode_state` does.
    let enc = disk::encode_state(&s);
    assert_eq!(&bytes[bytes.len() - enc.len()..], enc.as_slice());
    let back = disk::read_entry(&path, &identity(), Some(&t)).unwrap();
    assert_eq!(back.len, s.len);
    assert_eq!(back.ids, s.ids);
    assert_eq!(back.tensors.len(), s.tensors.len());
    for (a, b) in back.tensors.iter().zip(&s.tensors) {
        assert_eq!((a.rows, a.cols), (b.rows, b.cols));
        let bits = |p: &HostPart| p.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b));
    }
}

#[test]
fn a_flipped_bit_anywhere_in_the_state_section_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let t = toks(0..50);
    let s = mixed_state(t.len());
    let (path, _) = disk::write_entry(dir.path(), &identity(), "s", &t, &s).unwrap();
    let good = std::fs::read(&path).unwrap();
    let enc_len = disk::encode_state(&s).len();
    let start = good.len() - enc_len;
    // The section's header, the first tensor's data, a small tensor, the id lists.
    for at in [
        start + 1,
        start + 20,
        start + 12 + 8 + 50 * 64 + 8 + 3,
        good.len() - 2,
    ] {
        let mut bad = good.clone();
        bad[at] ^= 0x04;
        std::fs::write(&path, &bad).unwrap();
        let err = disk::read_entry(&path, &identity(), Some(&t));
        assert!(err.is_err(), "a flipped bit at byte {at} went unnoticed");
    }
    // Truncated by one byte: refused before anything is read.
    std::fs::write(&path, &good[..good.len() - 1]).unwrap();
    let err = disk::read_entry(&path, &identity(), Some(&t)).unwrap_err();
    assert!(format!("{err:#}").contains("the header says"), "{err:#}");
}

#[test]
fn page_cache_drop_covers_every_entry_file_and_leaves_them_readable() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (toks(0..40), toks(100..170));
    let (pa, na) = disk::write_entry(dir.path(), &identity(), "s", &a, &state_for(&a, 6)).unwrap();
    let (_, nb) = disk::write_entry(dir.path(), &identity(), "s", &b, &state_for(&b, 6)).unwrap();
    std::fs::write(dir.path().join("notes.txt"), b"not an entry").unwrap();
    let (files, bytes) = disk::drop_from_page_cache(dir.path()).unwrap();
    assert_eq!((files, bytes), (2, na + nb));
    assert_eq!(
        disk::read_entry(&pa, &identity(), Some(&a)).unwrap(),
        state_for(&a, 6)
    );
    let missing = dir.path().join("gone");
    let err = disk::drop_from_page_cache(&missing).unwrap_err();
    assert!(format!("{err:#}").contains("gone"), "{err:#}");
}
