//! The prefix cache through the scheduler on the tiny transformers fixtures of both
//! architectures: every cached generation (hit at any depth, from RAM, from disk, after a
//! restart, interleaved sessions) yields exactly the tokens of an uncached one.

use capy_engine::backend::cpu::CpuBackend;
use capy_engine::cache::{CacheConfig, CacheIdentity, Tier};
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
    for name in MODELS {
        let reference = scheduler(name, None);
        let (a, a_answers) = conversation(&reference, 11, 3);
        let (b, b_answers) = conversation(&reference, 12, 3);
        // Measure one long state, then give RAM room for about two of them.
        let probe = scheduler(name, Some(cache_config(name, None, 1 << 30)));
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
        let cached = scheduler(name, Some(cache_config(name, None, budget)));
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
        let deepest = |s: &str| c.entries_of(s).last().map(|e| e.0);
        assert_eq!(deepest("a"), Some(a.tips[2]), "{name}");
        assert_eq!(deepest("b"), Some(b.tips[2]), "{name}");
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
            while cache.lock().unwrap().status().usage.ram_bytes > 0 {
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
        while cache.lock().unwrap().status().usage.ram_bytes > 0 {
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
        // then a's conversation itself, down to disk.
        let probe = scheduler(name, Some(cache_config(name, None, 1 << 30)));
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
        let cached = scheduler(name, Some(cache_config(name, Some(dir.path()), budget)));
        assert_eq!(generate(&cached, &a.prompts[0], Some("a")).0, a_answers[0]);
        assert_eq!(generate(&cached, &b.prompts[0], Some("b")).0, b_answers[0]);
        {
            let mut c = cached.cache().unwrap().lock().unwrap();
            // Entries moving down are written on the cache's writer thread.
            c.wait_writes();
            assert!(c.ram_use() <= budget, "{name}: over the RAM budget");
            let a_tiers = c.entries_of("a");
            assert_eq!(
                a_tiers.last(),
                Some(&(a.tips[0], Tier::Disk)),
                "{name}: a's conversation was not moved to disk: {a_tiers:?}"
            );
        }
        // a returns: its turn resumes from disk and generates exactly the uncached tokens.
        let (got, usage) = generate(&cached, &a.prompts[1], Some("a"));
        assert_eq!(got, a_answers[1], "{name}: a resumed from disk");
        assert_eq!(usage.cached_tokens, a.tips[0], "{name}");
        let (got, usage) = generate(&cached, &b.prompts[1], Some("b"));
        assert_eq!(got, b_answers[1], "{name}: b after a");
        assert_eq!(usage.cached_tokens, b.tips[0], "{name}");
        let mut c = cached.cache().unwrap().lock().unwrap();
        c.wait_writes();
        assert!(c.ram_use() <= budget);
    }
}
