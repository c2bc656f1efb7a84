//! The prefix cache through the real HTTP API: session keys from each API (the Claude Code
//! session header, Responses `prompt_cache_key`, `user`), cached input tokens reported in each
//! API's usage, the Anthropic billing line not breaking the cache, and the admin endpoints
//! (`/admin/status` sessions and budgets, `/admin/disk-offload` switching the running cache's
//! disk tier). The model is a `ScriptedLm` (state = its length; the cache stores and resumes
//! it exactly like a real model's).

use capy_engine::cache::{CacheConfig, CacheIdentity};
use capy_engine::chat_template::ChatTemplate;
use capy_engine::scheduler::scripted::ScriptedLm;
use capy_engine::scheduler::{Scheduler, SchedulerConfig};
use capy_engine::tokenizer::{demo_tokenizer_json, Tokenizer, DEMO_CHAT_TEMPLATE, DEMO_IM_END_ID};
use capy_server::{AppState, ServerConfig};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ANSWER: &str = "Sure, here it is.";

/// A long shared system prompt (several cache blocks).
fn system() -> String {
    "You are a coding agent. Follow the repository's rules, run the tests, keep edits small. "
        .repeat(4)
}

fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(Tokenizer::from_json_bytes(&demo_tokenizer_json()).unwrap()))
        .clone()
}

/// A fresh folder under the system's temporary folder, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!(
            "capy-prefix-cache-http-{}-{what}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The admin settings are process-wide: keep them in a folder of this test binary's own.
fn config_dir() -> &'static std::path::Path {
    static DIR: OnceLock<std::path::PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // Left behind on purpose: the settings are read until the process ends.
        let d = std::env::temp_dir().join(format!(
            "capy-prefix-cache-http-config-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&d).unwrap();
        std::env::set_var("CAPY_CONFIG_DIR", &d);
        d
    })
}

fn cache_config(idle: Duration) -> CacheConfig {
    CacheConfig {
        block_tokens: 16,
        capture_every_blocks: 2,
        idle,
        ..CacheConfig::new(CacheIdentity {
            model_id: "scripted-model".into(),
            format: "test".into(),
        })
    }
}

async fn start(cache: Option<CacheConfig>) -> (SocketAddr, Arc<AppState>) {
    config_dir();
    let tok = tokenizer();
    let script = tok.encode(ANSWER, false).unwrap();
    let lm = ScriptedLm::new(tok.vocab_size(), 4096, script, DEMO_IM_END_ID);
    let template =
        ChatTemplate::from_source(DEMO_CHAT_TEMPLATE, None, Some("<|im_end|>".into())).unwrap();
    let sched = SchedulerConfig {
        prefix_cache: cache,
        ..Default::default()
    };
    let scheduler = Scheduler::start(Box::new(lm), tok.clone(), sched);
    let state = Arc::new(AppState::new(
        scheduler,
        tok,
        Some(template),
        "scripted-model".into(),
        ServerConfig::default(),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let s = state.clone();
    tokio::spawn(async move {
        capy_server::serve(listener, s, std::future::pending())
            .await
            .unwrap()
    });
    (addr, state)
}

async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!("{method} {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

async fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: Value) -> Value {
    let (status, text) = request(addr, "POST", path, headers, &body.to_string()).await;
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap_or(Value::String(text))
}

async fn get(addr: SocketAddr, path: &str) -> Value {
    let (status, text) = request(addr, "GET", path, &[], "").await;
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap()
}

fn anthropic_body(billing: &str, turns: usize, stream: bool) -> Value {
    let mut messages = vec![json!({"role": "user", "content": "List the files."})];
    if turns > 1 {
        messages.push(json!({"role": "assistant", "content": ANSWER}));
        messages.push(json!({"role": "user", "content": "Now open main.rs."}));
    }
    json!({"model": "claude-sonnet-4", "max_tokens": 20, "stream": stream,
        "system": [{"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.0.14; cch={billing};")},
                   {"type": "text", "text": system()}],
        "messages": messages})
}

fn session<'a>(status: &'a Value, id: &str) -> &'a Value {
    status["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == id)
        .unwrap_or_else(|| panic!("no session {id} in {status}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_turns_hit_the_cache_although_the_billing_line_changes() {
    let (addr, state) = start(Some(cache_config(Duration::from_secs(3600)))).await;
    let h = [("X-Claude-Code-Session-Id", "cc-session-1")];
    let first = post(addr, "/v1/messages", &h, anthropic_body("a1b2c", 1, false)).await;
    assert_eq!(first["usage"]["cache_read_input_tokens"], 0, "{first}");
    let total_first = first["usage"]["input_tokens"].as_u64().unwrap();
    let second = post(addr, "/v1/messages", &h, anthropic_body("f9e8d", 2, false)).await;
    let u = &second["usage"];
    let cached = u["cache_read_input_tokens"].as_u64().unwrap();
    // At least the first turn's prompt up to its last block boundary is resumed.
    assert!(cached + 16 >= total_first, "{second}");
    assert!(u["input_tokens"].as_u64().unwrap() > 0, "{second}");
    // Streaming: the final usage carries the cached tokens too.
    let (status, text) = request(
        addr,
        "POST",
        "/v1/messages",
        &h,
        &anthropic_body("77777", 2, true).to_string(),
    )
    .await;
    assert_eq!(status, 200);
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .collect();
    let delta = events
        .iter()
        .find(|v| v["type"] == "message_delta")
        .expect("no message_delta");
    let streamed = delta["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(streamed >= cached, "{delta}");
    // message_start (the first event) already tells the truth: the same cached and uncached
    // counts as the final usage.
    assert_eq!(events[0]["type"], "message_start", "{text}");
    let start = &events[0]["message"]["usage"];
    assert_eq!(start["cache_read_input_tokens"], streamed, "{text}");
    assert_eq!(
        start["input_tokens"], delta["usage"]["input_tokens"],
        "{text}"
    );
    // The session is the header's, parked on the device, with its size; its turns continued
    // on the parked sequence.
    let st = wait_for_tier(addr, "cc-session-1", "vram").await;
    let s = session(&st, "cc-session-1");
    let parked_hits = &state.scheduler.metrics().prefix_cache_parked_hits_total;
    assert_eq!(parked_hits.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert!(s["tokens"].as_u64().unwrap() > total_first, "{st}");
    assert!(s["bytes"].as_u64().unwrap() > 0, "{st}");
    assert_eq!(s["requests"], 3, "{st}");
    assert!(st["prefix_cache"]["hits"].as_u64().unwrap() >= 2, "{st}");
    assert!(st["budgets"]["prefix_cache"]["ram_bytes"].as_u64().unwrap() > 0);
    assert!(st["use"]["prefix_cache"]["ram_bytes"].as_u64().unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_chat_and_responses_report_cached_tokens_under_their_keys() {
    let (addr, _) = start(Some(cache_config(Duration::from_secs(3600)))).await;
    // Chat completions, keyed by `user`.
    let chat = |turns: usize| {
        let mut m = vec![
            json!({"role": "system", "content": system()}),
            json!({"role": "user", "content": "Explain the build."}),
        ];
        if turns > 1 {
            m.push(json!({"role": "assistant", "content": ANSWER}));
            m.push(json!({"role": "user", "content": "And the tests?"}));
        }
        json!({"model": "m", "max_tokens": 20, "user": "user-7", "messages": m})
    };
    let a = post(addr, "/v1/chat/completions", &[], chat(1)).await;
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let b = post(addr, "/v1/chat/completions", &[], chat(2)).await;
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 16, "{b}");
    assert!(cached < b["usage"]["prompt_tokens"].as_u64().unwrap());
    // Responses, keyed by `prompt_cache_key`.
    let resp = |turns: usize| {
        let mut input = vec![json!({"role": "user", "content": "Summarise the diff."})];
        if turns > 1 {
            input.push(json!({"role": "assistant", "content": ANSWER}));
            input.push(json!({"role": "user", "content": "Shorter."}));
        }
        json!({"model": "m", "max_output_tokens": 20, "instructions": system(),
               "prompt_cache_key": "pck-42", "user": "ignored-when-a-key-is-given", "input": input})
    };
    let a = post(addr, "/v1/responses", &[], resp(1)).await;
    assert_eq!(
        a["usage"]["input_tokens_details"]["cached_tokens"], 0,
        "{a}"
    );
    let b = post(addr, "/v1/responses", &[], resp(2)).await;
    assert!(
        b["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 16,
        "{b}"
    );
    wait_for_tier(addr, "user-7", "vram").await;
    let st = wait_for_tier(addr, "pck-42", "vram").await;
    assert!(st["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["id"] != "ignored-when-a-key-is-given"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_disk_offload_switches_the_running_caches_disk_tier() {
    // Sessions idle at once: with disk offload on, they move to disk within a second or two.
    let (addr, state) = start(Some(cache_config(Duration::ZERO))).await;
    let h = [("X-Claude-Code-Session-Id", "offload-me")];
    let first = post(addr, "/v1/messages", &h, anthropic_body("1", 1, false)).await;
    let st = get(addr, "/admin/status").await;
    assert_eq!(st["disk_offload"]["enabled"], false, "{st}");
    // Parked on the device, or already exported to RAM (it is idle at once).
    let tier = &session(&st, "offload-me")["tier"];
    assert!(tier == "vram" || tier == "ram", "{st}");
    let dir = TempDir::new("offload");
    let on = post(
        addr,
        "/admin/disk-offload",
        &[],
        json!({"enabled": true, "dir": dir.path()}),
    )
    .await;
    assert_eq!(on["prefix_cache"]["enabled"], true, "{on}");
    assert_eq!(on["applied_to_running_cache"], true);
    let t0 = Instant::now();
    loop {
        let st = get(addr, "/admin/status").await;
        if session(&st, "offload-me")["tier"] == "disk" {
            assert_eq!(st["use"]["prefix_cache"]["ram_bytes"], 0, "{st}");
            assert!(st["use"]["prefix_cache"]["disk_bytes"].as_u64().unwrap() > 0);
            assert_eq!(st["disk_offload"]["enabled"], true);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "never offloaded: {st}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let files = walk(dir.path());
    assert!(files.iter().any(|f| f.ends_with(".kv")), "{files:?}");
    // Coming back: resumed from disk, cached tokens reported.
    let second = post(addr, "/v1/messages", &h, anthropic_body("2", 2, false)).await;
    let cached = second["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(cached + 16 >= first["usage"]["input_tokens"].as_u64().unwrap());
    // Off: the running cache has no disk tier any more.
    let off = post(addr, "/admin/disk-offload", &[], json!({"enabled": false})).await;
    assert_eq!(off["prefix_cache"]["enabled"], false, "{off}");
    let c = state.scheduler.cache().unwrap().lock().unwrap();
    assert!(c.disk_dir().is_none());
    assert_eq!(c.disk_use(), 0);
}

/// The status once `id` is in `tier` (parking a finished turn follows its response; at most
/// 20 s).
async fn wait_for_tier(addr: SocketAddr, id: &str, tier: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let st = get(addr, "/admin/status").await;
        let found = st["sessions"]
            .as_array()
            .is_some_and(|v| v.iter().any(|s| s["id"] == id && s["tier"] == tier));
        if found {
            return st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{id} never reached tier {tier}: {st}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.path().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path().to_string_lossy().into_owned());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_prefix_cache_nothing_is_reported_cached() {
    let (addr, _) = start(None).await;
    let h = [("X-Claude-Code-Session-Id", "no-cache")];
    post(addr, "/v1/messages", &h, anthropic_body("1", 1, false)).await;
    let second = post(addr, "/v1/messages", &h, anthropic_body("2", 2, false)).await;
    assert_eq!(second["usage"]["cache_read_input_tokens"], 0, "{second}");
    let st = get(addr, "/admin/status").await;
    assert_eq!(st["prefix_cache"], Value::Null);
    assert_eq!(session(&st, "no-cache")["requests"], 2);
}
