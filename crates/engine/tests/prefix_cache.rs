//! The prefix cache through the scheduler on the tiny transformers fixtures of both
//! architectures: every cached generation (hit at any depth, from RAM, from disk, after a
//! restart, interleaved sessions, continued on a parked sequence or after its rollback) yields
//! exactly the tokens of an uncached one.

use capy_engine::backend::cpu::CpuBackend;
use capy_engine::cache::{CacheConfig, CacheIdentity, PrefixCache, Tier};
use capy_engine::checkpoint::Checkpoint;
use capy_engine::model;
use capy_engine::sampling::SamplingParams;
use capy_engine::scheduler::{
    GenerationEvent, GenerationRequest, Scheduler, SchedulerConfig, StopConditions, Usage,
};
use capy_engine::tokenizer::{demo_tokenizer_json, Tokenizer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MODELS: [&str; 2] = ["qwen3_5_text/gqa4x2_gdn2x4_rot25", "qwen4_exp_text/fused"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_json_bytes(&demo_tokenizer_json()).unwrap())
}

fn identity(name: &str) -> CacheIdentity {
    CacheIdentity {
        model_id: name.into(),
        format: "f32/cpu".into(),
    }
}

fn scheduler(name: &str, cache: Option<CacheConfig>) -> Scheduler {
    let ck = Checkpoint::open(&fixture(name)).unwrap();
    let m = model::load(CpuBackend::new(), &ck).unwrap();
    Scheduler::start(
        m,
        tokenizer(),
        SchedulerConfig {
            max_batch: 4,
            prefill_chunk: 40,
            prefix_cache: cache,
            ..Default::default()
        },
    )
}

/// A scheduler keeping at most `max_parked` finished sequences on the device (0: none, every
/// turn goes to the host cache).
fn parking_scheduler(name: &str, cache: CacheConfig, max_parked: usize) -> Scheduler {
    scheduler(
        name,
        Some(CacheConfig {
            max_parked,
            ..cache
        }),
    )
}

fn cache_config(name: &str, disk: Option<&Path>, ram_bytes: usize) -> CacheConfig {
    CacheConfig {
        block_tokens: 16,
        capture_every_blocks: 2,
        ram_bytes,
        disk_dir: disk.map(Path::to_path_buf),
        ..CacheConfig::new(identity(name))
    }
}

/// Deterministic pseudo-random ids inside the fixtures' vocabularies (160 and 256; no eos).
fn ids(seed: u32, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            3 + x % 150
        })
        .collect()
}

fn request(prompt: &[u32], session: Option<&str>) -> GenerationRequest {
    GenerationRequest {
        prompt_tokens: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens: 10,
        stop: StopConditions::default(),
        skip_special_tokens: true,
        cache_key: session.map(str::to_string),
        thinking_budget: None,
    }
}

fn generate(s: &Scheduler, prompt: &[u32], session: Option<&str>) -> (Vec<u32>, Usage) {
    let mut stream = s.submit(request(prompt, session)).unwrap();
    let mut out = Vec::new();
    loop {
        match stream.blocking_recv().expect("stream ended early") {
            GenerationEvent::Token { id, .. } => out.push(id),
            GenerationEvent::Finished { usage, .. } => return (out, usage),
            GenerationEvent::Error(e) => panic!("generation failed: {e}"),
        }
    }
}

/// A conversation: each turn's prompt is the previous prompt, the previous answer (as the
/// model generated it) and new text.
struct Conversation {
    prompts: Vec<Vec<u32>>,
    /// Per turn, the tokens in the state at its end (the last sampled token is never fed).
    tips: Vec<usize>,
}

fn conversation(reference: &Scheduler, seed: u32, turns: usize) -> (Conversation, Vec<Vec<u32>>) {
    let mut prompt = ids(seed, 70);
    let mut prompts = Vec::new();
    let mut answers = Vec::new();
    let mut tips = Vec::new();
    for t in 0..turns {
        let (answer, usage) = generate(reference, &prompt, None);
        assert_eq!(usage.cached_tokens, 0);
        tips.push(prompt.len() + usage.completion_tokens - 1);
        prompts.push(prompt.clone());
        answers.push(answer.clone());
        prompt.extend(&answer);
        prompt.extend(ids(seed * 31 + t as u32, 23 + 9 * t));
    }
    (Conversation { prompts, tips }, answers)
}

#[test]
fn cached_turns_generate_exactly_the_uncached_tokens() {
    for name in MODELS {
        let reference = scheduler(name, None);
        let (conv, answers) = conversation(&reference, 7, 3);
        let cached = scheduler(name, Some(cache_config(name, None, 64 << 20)));
        for (t, (p, want)) in conv.prompts.iter().zip(&answers).enumerate() {
            let (got, usage) = generate(&cached, p, Some("s1"));
            assert_eq!(&got, want, "{name}: turn {t} differs with the cache");
            if t > 0 {
                // The previous turn's prompt and answer (but its last token, never fed) come
                // from the cache.
                assert_eq!(usage.cached_tokens, conv.tips[t - 1], "{name}: turn {t}");
            }
        }
        // Hits at every depth: prompts that leave the conversation at different points resume
        // from the deepest boundary before it.
        let long = &conv.prompts[2];
        for cut in [5, 16, 17, 33, 64, 90, long.len() - 3] {
            let mut p = long[..cut].to_vec();
            p.extend(ids(cut as u32 + 1000, 11));
            let (want, _) = generate(&reference, &p, None);
            let (got, usage) = generate(&cached, &p, None);
            assert_eq!(got, want, "{name}: leaving at {cut}");
            assert!(usage.cached_tokens <= cut, "{name}: {cut}");
            if cut >= 32 {
                assert!(usage.cached_tokens >= 16, "{name}: cut {cut} hit nothing");
            }
        }
        let st = cached.cache().unwrap().lock().unwrap().status();
        // Turns 2 and 3, the four cuts past the conversation's first captured boundary (32),
        // and cut 17, which resumes at 16: cut 16's own prompt captured its last boundary.
        assert_eq!(st.hits, 7, "{name}: {} hits", st.hits);
        assert_eq!(
            cached
                .metrics()
                .prefix_cache_hits_total
                .load(std::sync::atomic::Ordering::Relaxed),
            st.hits
        );
    }
}

#[test]
fn interleaved_sessions_keep_their_prefixes_under_a_small_budget() {
    for (name, max_parked) in MODELS.into_iter().flat_map(|m| [(m, 0), (m, 4)]) {
        let reference = scheduler(name, None);
        let (a, a_answers) = conversation(&reference, 11, 3);
        let (b, b_answers) = conversation(&reference, 12, 3);
        // Measure one long state, then give RAM room for about two of them.
        let probe = parking_scheduler(name, cache_config(name, None, 1 << 30), 0);
        generate(&probe, &a.prompts[2], Some("probe"));
        let one = probe
            .cache()
            .unwrap()
            .lock()
            .unwrap()
            .status()
            .usage
            .ram_bytes as usize;
        let budget = one * 2;
        let cached = parking_scheduler(name, cache_config(name, None, budget), max_parked);
        for t in 0..3 {
            // Both sessions' turns run at the same time.
            let (sa, sb) = (&cached, &cached);
            let (ra, rb) = std::thread::scope(|sc| {
                let ha = sc.spawn(|| generate(sa, &a.prompts[t], Some("a")));
                let hb = sc.spawn(|| generate(sb, &b.prompts[t], Some("b")));
                (ha.join().unwrap(), hb.join().unwrap())
            });
            assert_eq!(ra.0, a_answers[t], "{name}: a turn {t}");
            assert_eq!(rb.0, b_answers[t], "{name}: b turn {t}");
            if t > 0 {
                assert!(ra.1.cached_tokens > a.prompts[t - 1].len(), "{name} a {t}");
                assert!(rb.1.cached_tokens > b.prompts[t - 1].len(), "{name} b {t}");
            }
            let st = cached.cache().unwrap().lock().unwrap().status();
            assert!(st.usage.ram_bytes as usize <= budget, "{name}: over budget");
        }
        // Many small requests of a third session evict neither conversation.
        for i in 0..6 {
            generate(&cached, &ids(500 + i, 20), Some("small"));
        }
        let c = cached.cache().unwrap().lock().unwrap();
        if max_parked == 0 {
            let deepest = |s: &str| c.entries_of(s).last().map(|e| e.0);
            assert_eq!(deepest("a"), Some(a.tips[2]), "{name}");
            assert_eq!(deepest("b"), Some(b.tips[2]), "{name}");
        } else {
            // Both conversations stay parked on the device; the small session has one slot.
            let parked = c.parked_sessions();
            assert!(
                parked.contains(&("a".into(), a.tips[2])),
                "{name}: {parked:?}"
            );
            assert!(
                parked.contains(&("b".into(), b.tips[2])),
                "{name}: {parked:?}"
            );
            let vram = c.status().sessions;
            assert!(
                vram.iter()
                    .any(|s| s.id == "a" && s.tier == Tier::Vram && s.tokens == a.tips[2]),
                "{name}: {vram:?}"
            );
        }
    }
}

#[test]
fn disk_tier_and_restart_give_the_same_tokens() {
    for name in MODELS {
        let dir = tempfile::tempdir().unwrap();
        let reference = scheduler(name, None);
        let (conv, answers) = conversation(&reference, 21, 3);
        let mut cfg = cache_config(name, Some(dir.path()), 64 << 20);
        cfg.idle = std::time::Duration::ZERO;
        {
            let cached = scheduler(name, Some(cfg.clone()));
            let (got, _) = generate(&cached, &conv.prompts[0], Some("d"));
            assert_eq!(got, answers[0]);
            // Idle: everything moves to disk (the scheduler does it while waiting).
            let cache = cached.cache().unwrap().clone();
            let t0 = std::time::Instant::now();
            let in_memory = |c: &capy_engine::cache::PrefixCache| {
                c.status().usage.ram_bytes > 0 || !c.parked_sessions().is_empty()
            };
            while in_memory(&cache.lock().unwrap()) {
                assert!(t0.elapsed().as_secs() < 20, "{name}: nothing moved to disk");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let (got, usage) = generate(&cached, &conv.prompts[1], Some("d"));
            assert_eq!(got, answers[1], "{name}: resumed from disk");
            assert!(usage.cached_tokens > conv.prompts[0].len());
        }
        // A new process: the folder is scanned and the conversation resumes from disk.
        cfg.idle = std::time::Duration::from_secs(3600);
        let restarted = scheduler(name, Some(cfg.clone()));
        {
            let c = restarted.cache().unwrap().lock().unwrap();
            assert!(!c.is_empty(), "{name}: nothing found after the restart");
            assert!(c.entries_of("d").iter().all(|e| e.1 == Tier::Disk));
        }
        let (got, usage) = generate(&restarted, &conv.prompts[2], None);
        assert_eq!(got, answers[2], "{name}: after restart");
        assert_eq!(usage.cached_tokens, conv.tips[1], "{name}: after restart");
        drop(restarted);
        // The same folder for another model (or quantization): nothing is used.
        let mut other = cfg.clone();
        other.identity.format = "nvfp4/cuda".into();
        let foreign = scheduler(name, Some(other));
        let (got, usage) = generate(&foreign, &conv.prompts[2], None);
        assert_eq!(got, answers[2]);
        assert_eq!(
            usage.cached_tokens, 0,
            "{name}: another model's cache was used"
        );
    }
}

#[test]
fn a_corrupted_disk_entry_is_recomputed_not_used() {
    let name = MODELS[0];
    let dir = tempfile::tempdir().unwrap();
    let reference = scheduler(name, None);
    let (conv, answers) = conversation(&reference, 33, 2);
    let mut cfg = cache_config(name, Some(dir.path()), 64 << 20);
    cfg.idle = std::time::Duration::ZERO;
    {
        let cached = scheduler(name, Some(cfg.clone()));
        generate(&cached, &conv.prompts[0], Some("x"));
        let cache = cached.cache().unwrap().clone();
        let in_memory = |c: &capy_engine::cache::PrefixCache| {
            c.status().usage.ram_bytes > 0 || !c.parked_sessions().is_empty()
        };
        while in_memory(&cache.lock().unwrap()) {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    // Flip one bit in the state section of every entry.
    let sub = std::fs::read_dir(dir.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut n = 0;
    for e in std::fs::read_dir(&sub).unwrap() {
        let p = e.unwrap().path();
        let mut b = std::fs::read(&p).unwrap();
        let at = b.len() - 9;
        b[at] ^= 0x04;
        std::fs::write(&p, b).unwrap();
        n += 1;
    }
    assert!(
        n >= 2,
        "expected boundary and end-of-turn entries, found {n}"
    );
    cfg.idle = std::time::Duration::from_secs(3600);
    let cached = scheduler(name, Some(cfg));
    let (got, usage) = generate(&cached, &conv.prompts[1], None);
    assert_eq!(got, answers[1]);
    assert_eq!(usage.cached_tokens, 0, "a corrupt entry was used");
    let st = cached.cache().unwrap().lock().unwrap().status();
    assert_eq!(st.disk_rejected, n as u64);
}

#[test]
fn under_ram_pressure_sessions_move_to_disk_and_resume_exactly() {
    for name in MODELS {
        let dir = tempfile::tempdir().unwrap();
        let reference = scheduler(name, None);
        let (a, a_answers) = conversation(&reference, 41, 2);
        let (b, b_answers) = conversation(&reference, 42, 2);
        // RAM for half of one first turn's entries (two boundary snapshots and the tip, the
        // tip the largest): one tip fits, two do not, so b's turn pushes a's intermediates,
        // then a's conversation itself, down to disk. One parked sequence: b's parks evict
        // a's to RAM (and so on), so the turns resume from the host tiers.
        let probe = parking_scheduler(name, cache_config(name, None, 1 << 30), 0);
        generate(&probe, &a.prompts[0], Some("probe"));
        // The end-of-turn capture follows the Finished event: wait for it.
        let t0 = std::time::Instant::now();
        let one = loop {
            let c = probe.cache().unwrap().lock().unwrap();
            if c.entries_of("probe").last().map(|e| e.0) == Some(a.tips[0]) {
                break c.ram_use();
            }
            drop(c);
            assert!(
                t0.elapsed().as_secs() < 20,
                "{name}: the turn was not captured"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        let budget = one / 2;
        let cached = parking_scheduler(name, cache_config(name, Some(dir.path()), budget), 1);
        assert_eq!(generate(&cached, &a.prompts[0], Some("a")).0, a_answers[0]);
        assert_eq!(generate(&cached, &b.prompts[0], Some("b")).0, b_answers[0]);
        wait_for(&cached, "b parked", parked_is("b", b.tips[0]));
        {
            let mut c = cached.cache().unwrap().lock().unwrap();
            // Entries moving down are written on the cache's writer thread.
            c.wait_writes();
            assert!(c.ram_use() <= budget, "{name}: over the RAM budget");
            // a's conversation left the device for RAM, the newest there; it pushed the older
            // entries (a's boundaries, b's shared ones) down to disk.
            let a_tiers = c.entries_of("a");
            assert_eq!(
                a_tiers.last(),
                Some(&(a.tips[0], Tier::Ram)),
                "{name}: a's conversation was not exported: {a_tiers:?}"
            );
            let b_tiers = c.entries_of("b");
            assert!(
                b_tiers.iter().all(|e| e.1 == Tier::Disk) && !b_tiers.is_empty(),
                "{name}: b's entries stayed in RAM: {b_tiers:?}"
            );
        }
        // a returns: its turn resumes from the host cache and generates exactly the uncached
        // tokens.
        let (got, usage) = generate(&cached, &a.prompts[1], Some("a"));
        assert_eq!(got, a_answers[1], "{name}: a resumed from the host cache");
        assert_eq!(usage.cached_tokens, a.tips[0], "{name}");
        let (got, usage) = generate(&cached, &b.prompts[1], Some("b"));
        assert_eq!(got, b_answers[1], "{name}: b after a");
        assert_eq!(usage.cached_tokens, b.tips[0], "{name}");
        let mut c = cached.cache().unwrap().lock().unwrap();
        c.wait_writes();
        assert!(c.ram_use() <= budget);
    }
}

/// Waits (at most 20 s) until `done` holds for the cache: parking a finished turn's sequence,
/// and exporting the ones it evicts, follow its Finished event.
fn wait_for(s: &Scheduler, what: &str, done: impl Fn(&PrefixCache) -> bool) {
    let t0 = std::time::Instant::now();
    while !done(&s.cache().unwrap().lock().unwrap()) {
        assert!(t0.elapsed().as_secs() < 20, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn parked_is(session: &str, tokens: usize) -> impl Fn(&PrefixCache) -> bool + '_ {
    move |c| c.parked_sessions() == [(session.to_string(), tokens)]
}

fn parked_hits(s: &Scheduler) -> u64 {
    s.metrics()
        .prefix_cache_parked_hits_total
        .load(std::sync::atomic::Ordering::Relaxed)
}

/// `prompt`'s last block boundary before its end: where a turn's sequence is checkpointed.
fn checkpoint_of(prompt: &[u32]) -> usize {
    (prompt.len() - 1) / 16 * 16
}

#[test]
fn turns_continue_on_the_parked_sequence_exactly_and_copy_nothing() {
    for name in MODELS {
        let reference = scheduler(name, None);
        let (conv, answers) = conversation(&reference, 51, 3);
        let cached = scheduler(name, Some(cache_config(name, None, 64 << 20)));
        for (t, (p, want)) in conv.prompts.iter().zip(&answers).enumerate() {
            let (got, usage) = generate(&cached, p, Some("s"));
            assert_eq!(&got, want, "{name}: turn {t}");
            let resumed = if t == 0 { 0 } else { conv.tips[t - 1] };
            assert_eq!(usage.cached_tokens, resumed, "{name}: turn {t}");
            assert_eq!(parked_hits(&cached), t as u64, "{name}: turn {t}");
            wait_for(&cached, "the turn parked", parked_is("s", conv.tips[t]));
        }
        let c = cached.cache().unwrap().lock().unwrap();
        // Only the first turn's shared boundaries went to the host; no turn was exported.
        let host: Vec<usize> = c.entries_of("s").iter().map(|e| e.0).collect();
        assert_eq!(host, [32, 64], "{name}");
        assert_eq!(c.status().hits, 2, "{name}");
    }
}

#[test]
fn a_prompt_leaving_the_generated_tokens_rolls_back_to_the_checkpoint() {
    for name in MODELS {
        let reference = scheduler(name, None);
        let first = ids(61, 70);
        let (answer, _) = generate(&reference, &first, None);
        // The previous answer re-rendered differently after its third token.
        let mut next = first.clone();
        next.extend(&answer[..3]);
        next.push(if answer[3] == 7 { 8 } else { 7 });
        next.extend(ids(62, 30));
        let (want_next, _) = generate(&reference, &next, None);
        let (want_again, _) = generate(&reference, &first, None);

        let cached = scheduler(name, Some(cache_config(name, None, 64 << 20)));
        generate(&cached, &first, Some("r"));
        // The same prompt again (a retry): nothing past the checkpoint can be kept.
        let (got, usage) = generate(&cached, &first, Some("r"));
        assert_eq!(got, want_again, "{name}: the same prompt again");
        assert_eq!(usage.cached_tokens, checkpoint_of(&first), "{name}");
        assert_eq!(parked_hits(&cached), 1, "{name}");
        let (got, usage) = generate(&cached, &next, Some("r"));
        assert_eq!(got, want_next, "{name}: after the rollback");
        assert_eq!(usage.cached_tokens, checkpoint_of(&first), "{name}");
        assert_eq!(parked_hits(&cached), 2, "{name}");
    }
}

#[test]
fn interleaved_sessions_each_continue_their_own_parked_sequence() {
    for name in MODELS {
        let reference = scheduler(name, None);
        let (a, a_answers) = conversation(&reference, 71, 3);
        let (b, b_answers) = conversation(&reference, 72, 3);
        let cached = scheduler(name, Some(cache_config(name, None, 64 << 20)));
        for t in 0..3 {
            let (ra, rb) = std::thread::scope(|sc| {
                let ha = sc.spawn(|| generate(&cached, &a.prompts[t], Some("a")));
                let hb = sc.spawn(|| generate(&cached, &b.prompts[t], Some("b")));
                (ha.join().unwrap(), hb.join().unwrap())
            });
            assert_eq!(ra.0, a_answers[t], "{name}: a turn {t}");
            assert_eq!(rb.0, b_answers[t], "{name}: b turn {t}");
            if t > 0 {
                assert_eq!(ra.1.cached_tokens, a.tips[t - 1], "{name}: a turn {t}");
                assert_eq!(rb.1.cached_tokens, b.tips[t - 1], "{name}: b turn {t}");
            }
        }
        assert_eq!(parked_hits(&cached), 4, "{name}");
    }
}

#[test]
fn an_evicted_parked_sequence_resumes_from_ram_exactly() {
    for name in MODELS {
        let reference = scheduler(name, None);
        let (a, a_answers) = conversation(&reference, 81, 2);
        let (b, b_answers) = conversation(&reference, 82, 2);
        // One parked sequence: b's first turn evicts a's to RAM, a's second turn evicts b's.
        let cached = parking_scheduler(name, cache_config(name, None, 64 << 20), 1);
        assert_eq!(generate(&cached, &a.prompts[0], Some("a")).0, a_answers[0]);
        assert_eq!(generate(&cached, &b.prompts[0], Some("b")).0, b_answers[0]);
        wait_for(&cached, "b parked", parked_is("b", b.tips[0]));
        {
            let c = cached.cache().unwrap().lock().unwrap();
            // a's tip and its checkpoint (a shared boundary already) are in RAM.
            let a_host = c.entries_of("a");
            assert_eq!(a_host.last(), Some(&(a.tips[0], Tier::Ram)), "{name}");
            assert!(a_host.contains(&(checkpoint_of(&a.prompts[0]), Tier::Ram)));
        }
        let (got, usage) = generate(&cached, &a.prompts[1], Some("a"));
        assert_eq!(got, a_answers[1], "{name}: a resumed from RAM");
        assert_eq!(usage.cached_tokens, a.tips[0], "{name}");
        let (got, usage) = generate(&cached, &b.prompts[1], Some("b"));
        assert_eq!(got, b_answers[1], "{name}: b resumed from RAM");
        assert_eq!(usage.cached_tokens, b.tips[0], "{name}");
        assert_eq!(parked_hits(&cached), 0, "{name}");
    }
}

#[test]
fn a_prompt_diverging_before_the_checkpoint_falls_back_to_the_host_cache() {
    for name in MODELS {
        let reference = scheduler(name, None);
        let first = ids(91, 70);
        let mut edited = first[..40].to_vec();
        edited.extend(ids(92, 25));
        let (want, _) = generate(&reference, &edited, None);
        let cached = scheduler(name, Some(cache_config(name, None, 64 << 20)));
        generate(&cached, &first, Some("e"));
        let (got, usage) = generate(&cached, &edited, Some("e"));
        assert_eq!(got, want, "{name}");
        // The first turn's shared boundary at 32, from RAM; the parked sequence is not used.
        assert_eq!(usage.cached_tokens, 32, "{name}");
        assert_eq!(parked_hits(&cached), 0, "{name}");
        // The session keeps one parked sequence: its latest turn.
        let tip = edited.len() + usage.completion_tokens - 1;
        wait_for(&cached, "the latest turn parked", parked_is("e", tip));
    }
}
