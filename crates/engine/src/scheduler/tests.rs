use super::scripted::ScriptedLm;
use super::*;
use crate::tokenizer::{demo_tokenizer_json, DEMO_IM_END_ID};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(Tokenizer::from_json_bytes(&demo_tokenizer_json()).unwrap()))
        .clone()
}

fn scheduler_for(
    text: &str,
    config: SchedulerConfig,
    delay: Duration,
) -> (Scheduler, Arc<scripted::ScriptedStats>, Vec<u32>) {
    let tok = tokenizer();
    let script = tok.encode(text, false).unwrap();
    let lm = ScriptedLm::new(tok.vocab_size(), 4096, script.clone(), DEMO_IM_END_ID)
        .with_step_delay(delay);
    let stats = lm.stats();
    (Scheduler::start(Box::new(lm), tok, config), stats, script)
}

fn request(prompt_len: usize, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt_tokens: (0..prompt_len as u32).map(|i| 100 + i % 1000).collect(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: StopConditions::default(),
        skip_special_tokens: true,
        cache_key: None,
        thinking_budget: None,
    }
}

/// Collects a stream: (text, token count, finish reason, usage).
fn collect(mut s: GenerationStream) -> (String, usize, FinishReason, Usage) {
    let mut text = String::new();
    let mut n = 0;
    loop {
        match s.blocking_recv().expect("stream ended without Finished") {
            GenerationEvent::Token { text: t, .. } => {
                text.push_str(&t);
                n += 1;
            }
            GenerationEvent::Finished { reason, usage } => return (text, n, reason, usage),
            GenerationEvent::Error(e) => panic!("generation failed: {e}"),
        }
    }
}

#[test]
fn streams_the_scripted_text_and_stops_at_eos() {
    let (s, _, script) = scheduler_for(
        "Hello, world! ¿Qué tal? 🦫",
        SchedulerConfig::default(),
        Duration::ZERO,
    );
    let (text, n, reason, usage) = collect(s.submit(request(5, 100)).unwrap());
    assert_eq!(text, "Hello, world! ¿Qué tal? 🦫");
    assert_eq!(reason, FinishReason::StopToken(DEMO_IM_END_ID));
    assert_eq!(n, script.len(), "the stop token itself is not streamed");
    assert_eq!(
        usage,
        Usage {
            prompt_tokens: 5,
            completion_tokens: script.len() + 1,
            cached_tokens: 0
        }
    );
}

#[test]
fn max_tokens_ends_with_length() {
    let (s, _, _) = scheduler_for(
        "one two three four five six seven",
        SchedulerConfig::default(),
        Duration::ZERO,
    );
    let (text, _, reason, usage) = collect(s.submit(request(3, 3)).unwrap());
    assert_eq!(reason, FinishReason::MaxTokens);
    assert_eq!(usage.completion_tokens, 3);
    assert_eq!(text, "one two three");
}

#[test]
fn stop_string_spanning_tokens_is_cut_and_reported() {
    let (s, _, _) = scheduler_for(
        "alpha beta gamma delta",
        SchedulerConfig::default(),
        Duration::ZERO,
    );
    let mut r = request(3, 100);
    r.stop.strings = vec!["ta gam".into()];
    let (text, _, reason, _) = collect(s.submit(r).unwrap());
    assert_eq!(text, "alpha be");
    assert_eq!(reason, FinishReason::StopString(0, "ta gam".into()));
}

#[test]
fn extra_stop_token_ids_end_generation() {
    let tok = tokenizer();
    let (s, _, script) = scheduler_for("a b c d", SchedulerConfig::default(), Duration::ZERO);
    let mut r = request(2, 100);
    r.stop.token_ids = vec![script[2]];
    let (text, _, reason, _) = collect(s.submit(r).unwrap());
    assert_eq!(reason, FinishReason::StopToken(script[2]));
    assert_eq!(text, tok.decode(&script[..2], true).unwrap());
}

#[test]
fn context_full_ends_with_length() {
    let tok = tokenizer();
    let lm = ScriptedLm::new(
        tok.vocab_size(),
        10,
        tok.encode("x y z w v u t s", false).unwrap(),
        DEMO_IM_END_ID,
    );
    let s = Scheduler::start(Box::new(lm), tok, SchedulerConfig::default());
    let (_, n, reason, _) = collect(s.submit(request(7, 100)).unwrap());
    assert_eq!(reason, FinishReason::ContextFull);
    assert_eq!(n, 3);
}

#[test]
fn prompt_longer_than_context_is_refused_before_work() {
    let (s, stats, _) = scheduler_for(
        "x",
        SchedulerConfig {
            max_context: 16,
            ..Default::default()
        },
        Duration::ZERO,
    );
    let e = s.submit(request(16, 1)).err().unwrap();
    assert_eq!(
        e,
        SubmitError::ContextLength {
            prompt_tokens: 16,
            max_context: 16
        }
    );
    assert_eq!(stats.forward_calls.load(Ordering::Relaxed), 0);
    assert!(matches!(
        s.submit(request(0, 1)),
        Err(SubmitError::Invalid(_))
    ));
    assert!(matches!(
        s.submit(request(2, 0)),
        Err(SubmitError::Invalid(_))
    ));
}

#[test]
fn full_queue_is_overloaded() {
    let cfg = SchedulerConfig {
        max_batch: 1,
        max_queue: 2,
        ..Default::default()
    };
    let (s, _, _) = scheduler_for(
        "a b c d e f g h i j k l m n o p",
        cfg,
        Duration::from_millis(20),
    );
    let mut streams = Vec::new();
    let mut refused = 0;
    for _ in 0..6 {
        match s.submit(request(2, 50)) {
            Ok(st) => streams.push(st),
            Err(SubmitError::Overloaded { limit, .. }) => {
                assert_eq!(limit, 2);
                refused += 1
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    // One may have been admitted already; the queue holds two more.
    assert!(refused >= 3, "refused {refused} of 6");
    for st in streams {
        collect(st);
    }
    assert_eq!(s.metrics().queue_depth.load(Ordering::Relaxed), 0);
}

#[test]
fn long_prefill_is_chunked_and_mixed_with_decoding() {
    let cfg = SchedulerConfig {
        prefill_chunk: 16,
        ..Default::default()
    };
    let (s, stats, _) = scheduler_for(
        "one two three four five six seven eight nine ten",
        cfg,
        Duration::from_millis(2),
    );
    let mut first = s.submit(request(4, 40)).unwrap();
    // Wait until the first request decodes, then send a long prompt.
    assert!(matches!(
        first.blocking_recv(),
        Some(GenerationEvent::Token { .. })
    ));
    let second = s.submit(request(100, 5)).unwrap();
    let (_, _, _, usage) = collect(second);
    assert_eq!(usage.prompt_tokens, 100);
    collect(first);
    assert!(stats.max_item_tokens.load(Ordering::Relaxed) <= 16);
    assert!(
        stats.mixed_steps.load(Ordering::Relaxed) >= 1,
        "no step mixed prefill and decode"
    );
    assert!(stats.max_batch_items.load(Ordering::Relaxed) >= 2);
}

#[test]
fn dropping_the_stream_frees_the_sequence() {
    let long = "word ".repeat(400);
    let (s, stats, _) = scheduler_for(&long, SchedulerConfig::default(), Duration::from_millis(2));
    let streams: Vec<_> = (0..4)
        .map(|_| s.submit(request(3, 1000)).unwrap())
        .collect();
    let mut streams = streams.into_iter();
    let mut kept = streams.next().unwrap();
    for _ in 0..3 {
        assert!(matches!(
            kept.blocking_recv(),
            Some(GenerationEvent::Token { .. })
        ));
    }
    assert_eq!(stats.live_sequences.load(Ordering::Relaxed), 4);
    drop(streams);
    let deadline = Instant::now() + Duration::from_secs(5);
    while stats.live_sequences.load(Ordering::Relaxed) != 1 {
        assert!(
            Instant::now() < deadline,
            "cancelled sequences were not freed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        s.metrics().requests_cancelled_total.load(Ordering::Relaxed),
        3
    );
    drop(kept);
    while stats.live_sequences.load(Ordering::Relaxed) != 0 {
        assert!(
            Instant::now() < deadline,
            "cancelled sequence was not freed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn same_seed_gives_same_tokens_through_the_scheduler() {
    // The scripted logits leave every non-script token at 0 and the script at 40, so a
    // temperature of 30 makes the draw genuinely random over the vocabulary.
    let (s, _, _) = scheduler_for(
        "a b c d e f g h",
        SchedulerConfig::default(),
        Duration::ZERO,
    );
    let run = |seed| {
        let mut r = request(2, 8);
        r.sampling = SamplingParams {
            temperature: 30.0,
            seed: Some(seed),
            ..Default::default()
        };
        let mut st = s.submit(r).unwrap();
        let mut ids = Vec::new();
        while let Some(ev) = st.blocking_recv() {
            if let GenerationEvent::Token { id, .. } = ev {
                ids.push(id)
            }
        }
        ids
    };
    assert_eq!(run(11), run(11));
    assert_ne!(run(11), run(12));
}

/// Collects a stream's token ids (text-less stop tokens are not streamed) and the finish.
fn collect_ids(mut s: GenerationStream) -> (Vec<u32>, String, FinishReason, Usage) {
    let (mut ids, mut text) = (Vec::new(), String::new());
    loop {
        match s.blocking_recv().expect("stream ended without Finished") {
            GenerationEvent::Token { id, text: t } => {
                ids.push(id);
                text.push_str(&t);
            }
            GenerationEvent::Finished { reason, usage } => return (ids, text, reason, usage),
            GenerationEvent::Error(e) => panic!("generation failed: {e}"),
        }
    }
}

fn thinking_budget(max_tokens: usize) -> ThinkingBudget {
    let tok = tokenizer();
    ThinkingBudget {
        max_tokens,
        starts_inside: true,
        open_token: tok.token_to_id("<think>"),
        close_token: tok.token_to_id("</think>").unwrap(),
        close_sequence: tok.encode("\n</think>\n\n", false).unwrap(),
    }
}

#[test]
fn the_thinking_budget_forces_the_block_closed_then_generation_continues() {
    let text = "Let me think about this carefully, step by step, and then answer the question.";
    let (s, _, script) = scheduler_for(text, SchedulerConfig::default(), Duration::ZERO);
    let budget = thinking_budget(4);
    let close = budget.close_sequence.clone();
    assert_eq!(
        close.len(),
        3,
        "\\n, </think>, \\n\\n in the Qwen tokenizer"
    );
    let mut r = request(5, 100);
    r.thinking_budget = Some(budget);
    let (ids, out, reason, usage) = collect_ids(s.submit(r).unwrap());
    // Four thinking tokens, the forced close, then the model goes on (the scripted model's
    // positions under the forced tokens are spent).
    let mut expected = script[..4].to_vec();
    expected.extend(&close);
    expected.extend(&script[4 + close.len()..]);
    assert_eq!(ids, expected);
    assert_eq!(reason, FinishReason::StopToken(DEMO_IM_END_ID));
    // Forced tokens are output tokens like any other (+1: the end token).
    assert_eq!(usage.completion_tokens, expected.len() + 1);
    let tok = tokenizer();
    let (thought, answer) = out
        .split_once("\n</think>\n\n")
        .expect("the block is closed");
    assert_eq!(thought, tok.decode(&script[..4], true).unwrap());
    assert_eq!(
        answer,
        tok.decode(&script[4 + close.len()..], true).unwrap()
    );
}

#[test]
fn the_thinking_budget_leaves_a_model_that_closes_in_time_alone_and_counts_toward_max_tokens() {
    let (s, _, script) = scheduler_for(
        "Short.\n</think>\n\nThe answer is 42.",
        SchedulerConfig::default(),
        Duration::ZERO,
    );
    let mut r = request(5, 100);
    r.thinking_budget = Some(thinking_budget(50));
    let (ids, _, _, _) = collect_ids(s.submit(r).unwrap());
    assert_eq!(ids, script);

    // A budget of zero closes the block before the first sampled token; max_tokens cuts the
    // forced tokens like sampled ones.
    let (s, _, _) = scheduler_for("abc def", SchedulerConfig::default(), Duration::ZERO);
    let budget = thinking_budget(0);
    let close = budget.close_sequence.clone();
    let mut r = request(5, 2);
    r.thinking_budget = Some(budget);
    let (ids, _, reason, usage) = collect_ids(s.submit(r).unwrap());
    assert_eq!(ids, close[..2].to_vec());
    assert_eq!(reason, FinishReason::MaxTokens);
    assert_eq!(usage.completion_tokens, 2);
}

fn session_request(prompt: Vec<u32>, session: &str) -> GenerationRequest {
    GenerationRequest {
        prompt_tokens: prompt,
        cache_key: Some(session.into()),
        // One token: it is never fed back, so the routing is the prompt's alone.
        ..request(1, 1)
    }
}

#[test]
fn a_returning_session_gets_its_hot_experts_prefetched() {
    let tok = tokenizer();
    let script = tok.encode("ok", false).unwrap();
    // 8 experts per layer; session a's prompt routes only to experts 0 and 1, b's to 4.
    let lm = ScriptedLm::new(tok.vocab_size(), 4096, script, DEMO_IM_END_ID).with_experts(2, 8);
    let stats = lm.stats();
    let config = SchedulerConfig {
        prefix_cache: Some(crate::cache::CacheConfig {
            block_tokens: 4,
            ..crate::cache::CacheConfig::new(crate::cache::CacheIdentity {
                model_id: "scripted".into(),
                format: "test".into(),
            })
        }),
        ..Default::default()
    };
    let s = Scheduler::start(Box::new(lm), tok, config);
    let a: Vec<u32> = (0..24).map(|i| 800 + i % 2).collect();
    let b: Vec<u32> = vec![804; 20];
    let prefetched = || stats.prefetched.lock().unwrap().clone();
    collect(s.submit(session_request(a.clone(), "a")).unwrap());
    // a's first turn: no heat yet, nothing to prefetch.
    assert!(prefetched().is_empty());
    // The stream ends when the last token is sent; the scheduler files the turn's heat just
    // after, on its own thread: wait for it (a request submitted now would be served after it).
    let mut heat_a = Vec::new();
    for _ in 0..500 {
        heat_a = s.cache().unwrap().lock().unwrap().heat_of("a");
        if !heat_a.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let experts = |h: &[crate::hybrid::expert_cache::HeatEntry]| {
        let mut v: Vec<(u32, u32)> = h.iter().map(|e| (e.layer, e.expert)).collect();
        v.sort();
        v
    };
    assert_eq!(experts(&heat_a), vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
    collect(s.submit(session_request(b.clone(), "b")).unwrap());
    let mut a2 = a.clone();
    a2.extend([800, 801, 800]);
    collect(s.submit(session_request(a2.clone(), "a")).unwrap());
    // a came back after b: its heat (experts 0 and 1 of both layers) was prefetched.
    let p = prefetched();
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(experts(&p[0]), experts(&heat_a));
    // a again right away: its experts are the warm ones, no second prefetch.
    let mut a3 = a2.clone();
    a3.extend([801, 800]);
    collect(s.submit(session_request(a3, "a")).unwrap());
    assert_eq!(prefetched().len(), 1);
    // b returns: b's own experts (4), not a's.
    let mut b2 = b.clone();
    b2.push(804);
    collect(s.submit(session_request(b2, "b")).unwrap());
    let p = prefetched();
    assert_eq!(p.len(), 2);
    assert_eq!(experts(&p[1]), vec![(0, 4), (1, 4)]);
    // The session's heat accumulates over turns and shows in the status.
    let st = s.cache().unwrap().lock().unwrap().status();
    let sa = st.sessions.iter().find(|x| x.id == "a").unwrap();
    assert_eq!(sa.hot_experts, 4);
}

#[test]
fn a_slow_disk_write_does_not_hold_up_requests() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer();
    let script = tok.encode("ok then", false).unwrap();
    let lm = ScriptedLm::new(tok.vocab_size(), 4096, script, DEMO_IM_END_ID);
    let config = SchedulerConfig {
        prefix_cache: Some(crate::cache::CacheConfig {
            block_tokens: 4,
            disk_dir: Some(dir.path().to_path_buf()),
            // Every session is idle at once: each maintenance pass moves it to disk.
            idle: Duration::ZERO,
            ..crate::cache::CacheConfig::new(crate::cache::CacheIdentity {
                model_id: "scripted".into(),
                format: "test".into(),
            })
        }),
        ..Default::default()
    };
    let s = Scheduler::start(Box::new(lm), tok, config);
    let cache = s.cache().unwrap().clone();
    // Disk writes wait for this channel: a disk that never finishes, until released.
    let gate = cache.lock().unwrap().gate_writes();
    let a: Vec<u32> = (0..24).map(|i| 900 + i).collect();
    collect(s.submit(session_request(a.clone(), "a")).unwrap());
    // The scheduler's maintenance queues a's entries for disk (it runs every second).
    let mut queued = 0;
    for _ in 0..1000 {
        queued = cache.lock().unwrap().writes_in_flight();
        if queued > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(queued > 0, "nothing was queued for disk");
    // With a write stuck, another request is still served to the end (on the scheduler
    // thread it would wait forever: the bound only turns a hang into a failure).
    let b: Vec<u32> = (0..18).map(|i| 2000 + i).collect();
    let stream = s.submit(session_request(b, "b")).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(collect(stream)).unwrap());
    let (_, n, _, usage) = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("a request was held up by a disk write");
    assert_eq!((n, usage.prompt_tokens), (1, 18));
    assert!(cache
        .lock()
        .unwrap()
        .entries_of("a")
        .iter()
        .all(|e| e.1 == crate::cache::Tier::Ram));
    // Released: a's entries reach the disk.
    drop(gate);
    let mut c = cache.lock().unwrap();
    c.wait_writes();
    let on_disk = c.entries_of("a");
    assert!(
        on_disk.iter().any(|e| e.1 == crate::cache::Tier::Disk),
        "{on_disk:?}"
    );
}

/// Waits (at most 5 s) until the cache lists exactly these parked sessions: parking follows
/// the Finished event, on the scheduler's thread.
fn wait_parked(s: &Scheduler, want: &[(&str, usize)]) {
    let want: Vec<(String, usize)> = want.iter().map(|(s, n)| (s.to_string(), *n)).collect();
    let t0 = Instant::now();
    loop {
        let got = s.cache().unwrap().lock().unwrap().parked_sessions();
        if got == want {
            return;
        }
        assert!(
            t0.elapsed().as_secs() < 5,
            "parked {got:?}, expected {want:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn parked_sequences_stay_within_their_limits_least_recently_used_out() {
    let tok = tokenizer();
    let script = tok.encode("ok", false).unwrap();
    let lm = ScriptedLm::new(tok.vocab_size(), 4096, script, DEMO_IM_END_ID);
    let stats = lm.stats();
    // Two parked sequences of at most 2600 bytes in all (ScriptedLm: 4 bytes per token).
    let config = SchedulerConfig {
        prefix_cache: Some(crate::cache::CacheConfig {
            block_tokens: 4,
            max_parked: 2,
            parked_bytes: 2600,
            ..crate::cache::CacheConfig::new(crate::cache::CacheIdentity {
                model_id: "scripted".into(),
                format: "test".into(),
            })
        }),
        ..Default::default()
    };
    let s = Scheduler::start(Box::new(lm), tok, config);
    let prompt =
        |seed: u32, n: u32| -> Vec<u32> { (0..n).map(|i| 100 + (seed + i) % 50).collect() };
    let long = prompt(0, 400);
    collect(s.submit(session_request(long.clone(), "long")).unwrap());
    // Another session's small requests take one slot, not the long conversation's.
    for i in 0..5 {
        collect(
            s.submit(session_request(prompt(7 + i, 20), "small"))
                .unwrap(),
        );
    }
    wait_parked(&s, &[("long", 400), ("small", 20)]);
    let mut long2 = long.clone();
    long2.extend(prompt(3, 8));
    let (_, _, _, usage) = collect(s.submit(session_request(long2, "long")).unwrap());
    assert_eq!(usage.cached_tokens, 400, "continued on the parked sequence");
    let m = s.metrics();
    assert_eq!(m.prefix_cache_parked_hits_total.load(Ordering::Relaxed), 1);
    wait_parked(&s, &[("long", 408), ("small", 20)]);
    let st = s.cache().unwrap().lock().unwrap().status();
    let line = st.sessions.iter().find(|x| x.id == "long").unwrap();
    assert_eq!((line.tier, line.tokens), (crate::cache::Tier::Vram, 408));
    // A third session exceeds the count: the least recently used (small) leaves.
    collect(s.submit(session_request(prompt(20, 200), "mid")).unwrap());
    wait_parked(&s, &[("long", 408), ("mid", 200)]);
    // Larger than the whole budget: not parked, the others stay.
    collect(s.submit(session_request(prompt(30, 700), "huge")).unwrap());
    wait_parked(&s, &[("long", 408), ("mid", 200)]);
    // The huge one is exported and dropped just after its Finished event.
    let t0 = Instant::now();
    while stats.live_sequences.load(Ordering::Relaxed) != 2 {
        assert!(t0.elapsed().as_secs() < 5, "the huge sequence was kept");
        std::thread::sleep(Duration::from_millis(5));
    }
    // What left the device went to the RAM tier.
    let c = s.cache().unwrap().lock().unwrap();
    assert_eq!(c.entries_of("small").last().map(|e| e.0), Some(20));
    assert_eq!(c.entries_of("huge").last().map(|e| e.0), Some(700));
}

#[test]
fn shared_snapshots_are_regular_then_at_doublings() {
    // The defaults: 64-token blocks, a snapshot every 32 blocks (2048 tokens).
    let at = |t| super::shared_capture_at(t, 64, 32);
    let taken: Vec<usize> = (1..=1024).map(|b| b * 64).filter(|&t| at(t)).collect();
    assert_eq!(taken, [2048, 4096, 6144, 8192, 16384, 32768, 65536]);
    assert!(!at(0));
    // Small caches (tests, tiny models) keep every spacing up to the threshold.
    let small: Vec<usize> = (1..=20)
        .map(|b| b * 16)
        .filter(|&t| super::shared_capture_at(t, 16, 2))
        .collect();
    assert_eq!(small, [32, 64, 96, 128, 160, 192, 224, 256, 288, 320]);
}
