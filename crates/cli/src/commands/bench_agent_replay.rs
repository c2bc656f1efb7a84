//! `capy-flash bench agent-replay`: a coding-agent conversation replayed through the real HTTP
//! API (Anthropic Messages, streaming, `X-Claude-Code-Session-Id`), with the prefix cache on
//! and off, on a server started in-process on `127.0.0.1:0`.
//!
//! Session A: a system prompt, tool definitions, then `--turns` turns whose context grows to
//! about `--target-context` tokens with tool results (each turn's assistant message is the
//! model's own text plus a `tool_use`, the next user message its `tool_result`). Session B (a
//! second agent with the same system prompt and tools, smaller results) takes a turn after each
//! of A's, so the two interleave. Reported per turn: time to first streamed event (TTFT), prompt
//! and cached tokens. Then, with the cache on, A's next turn is resumed from RAM, then (disk
//! offload switched on through `/admin/disk-offload`, the session left idle until it is on
//! disk) from disk, and the same prompt is recomputed on the server without a cache.

use super::model_arg::BackendArg;
use anyhow::{bail, Context, Result};
use capy_engine::cache::{CacheConfig, CacheIdentity};
use capy_engine::scheduler::{Scheduler, SchedulerConfig};
use capy_server::{AppState, ServerConfig};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(clap::Args)]
pub struct BenchAgentReplayArgs {
    /// Model folder, "demo" or "demo-moe".
    #[arg(long, default_value = "demo")]
    pub model: String,
    #[command(flatten)]
    pub backend: BackendArg,
    /// Session A's context at its last turn, in tokens (about).
    #[arg(long, default_value_t = 30_000)]
    pub target_context: usize,
    /// Turns of session A (session B takes as many).
    #[arg(long, default_value_t = 20)]
    pub turns: usize,
    /// Tokens generated per turn.
    #[arg(long, default_value_t = 16)]
    pub decode_tokens: usize,
    /// Prompt tokens prefilled per scheduler step.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Tokens per prefix cache block.
    #[arg(long, default_value_t = 64)]
    pub block_tokens: usize,
}

const TOOLS: [(&str, &str); 4] = [
    (
        "read_file",
        "Reads a file of the repository and returns its text.",
    ),
    (
        "run_tests",
        "Runs the test suite (or one test) and returns the output.",
    ),
    (
        "grep",
        "Searches the repository for a pattern; returns matching lines.",
    ),
    (
        "edit_file",
        "Replaces a unique string in a file with another.",
    ),
];

fn tools() -> Value {
    TOOLS
        .iter()
        .map(|(name, d)| {
            json!({"name": name, "description": d, "input_schema": {"type": "object",
                "properties": {"path": {"type": "string", "description": "File or folder, relative to the repository root"},
                               "pattern": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
                "required": ["path"]}})
        })
        .collect()
}

fn system_prompt() -> String {
    let rules = [
        "You are a coding agent working in a Rust repository.",
        "Read the relevant files before editing; keep edits small and focused.",
        "Run the tests after every change and report what failed and why.",
        "Never commit files you did not change; explain each change briefly.",
    ];
    rules.repeat(12).join(" ")
}

/// Deterministic source-like text of about `words` words (a tool result).
fn tool_result(seed: usize, words: usize) -> String {
    const VOCAB: [&str; 24] = [
        "fn", "let", "mut", "self", "Result", "Ok", "impl", "pub", "struct", "match", "Some",
        "None", "return", "cache", "entry", "tokens", "state", "session", "block", "disk", "ram",
        "budget", "&", "=>",
    ];
    let mut x = (seed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::with_capacity(words * 6);
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(VOCAB[(x % VOCAB.len() as u64) as usize]);
        out.push(if i % 12 == 11 { '\n' } else { ' ' });
    }
    out
}

const TASK_A: &str = "The prefix cache drops sessions under load; find out why and fix it.";

/// One agent conversation as Anthropic messages.
struct Agent {
    id: String,
    messages: Vec<Value>,
    turn: usize,
}

impl Agent {
    fn new(id: &str, task: &str) -> Agent {
        Agent {
            id: id.into(),
            messages: vec![json!({"role": "user", "content": task})],
            turn: 0,
        }
    }

    fn body(&self, max_tokens: usize) -> Value {
        // Claude Code's billing line changes every request; the server strips it.
        let billing = format!(
            "x-anthropic-billing-header: cc_version=2.0.14; cch={:05x};",
            self.turn * 7919 + self.id.len()
        );
        json!({"model": "agent-replay", "max_tokens": max_tokens, "stream": true, "temperature": 0,
               "system": [{"type": "text", "text": billing}, {"type": "text", "text": system_prompt()}],
               "tools": tools(), "messages": self.messages})
    }

    /// Appends the model's answer (plus a tool call) and the tool's result of `words` words.
    fn advance(&mut self, answer: &str, words: usize) {
        self.turn += 1;
        let (name, _) = TOOLS[self.turn % TOOLS.len()];
        let id = format!("toolu_{}_{}", self.id, self.turn);
        let mut content = Vec::new();
        if !answer.trim().is_empty() {
            content.push(json!({"type": "text", "text": answer}));
        }
        content.push(json!({"type": "tool_use", "id": id, "name": name,
                            "input": {"path": format!("crates/engine/src/file_{}.rs", self.turn)}}));
        self.messages
            .push(json!({"role": "assistant", "content": content}));
        self.messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id, "content": tool_result(self.turn * 131 + self.id.len(), words)}]}));
    }
}

/// One streamed request's figures.
#[derive(Debug, Clone)]
struct Turn {
    ttft_s: f64,
    total_s: f64,
    prompt_tokens: u64,
    cached_tokens: u64,
    text: String,
}

/// Streams one Messages request over HTTP/1.0 (close-delimited body); the TTFT clock stops at
/// the first event after `message_start` (the first token's event).
async fn stream(addr: SocketAddr, session: &str, body: &Value) -> Result<Turn> {
    let body = body.to_string();
    let t = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let req = format!(
        "POST /v1/messages HTTP/1.0\r\nHost: bench\r\nContent-Type: application/json\r\nanthropic-version: 2023-06-01\r\nX-Claude-Code-Session-Id: {session}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 1 << 16];
    let mut first = None;
    loop {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if first.is_none() {
            let text = String::from_utf8_lossy(&buf);
            if text.contains("content_block_start") || text.contains("message_delta") {
                first = Some(t.elapsed());
            }
        }
    }
    let total = t.elapsed();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, events) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!(
            "the server answered: {}",
            text.chars().take(600).collect::<String>()
        );
    }
    let mut answer = String::new();
    let mut usage = None;
    for data in events.lines().filter_map(|l| l.strip_prefix("data:")) {
        let Ok(v) = serde_json::from_str::<Value>(data.trim()) else {
            continue;
        };
        if v["type"] == "content_block_delta" {
            if let Some(t) = v["delta"]["text"].as_str() {
                answer.push_str(t);
            }
        }
        if v["type"] == "message_delta" {
            usage = Some(v["usage"].clone());
        }
    }
    let u = usage.context("the stream ended without a message_delta")?;
    let cached = u["cache_read_input_tokens"].as_u64().unwrap_or(0);
    Ok(Turn {
        ttft_s: first.unwrap_or(total).as_secs_f64(),
        total_s: total.as_secs_f64(),
        prompt_tokens: u["input_tokens"].as_u64().unwrap_or(0) + cached,
        cached_tokens: cached,
        text: answer,
    })
}

async fn http_json(addr: SocketAddr, method: &str, path: &str, body: &Value) -> Result<Value> {
    let body = body.to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let (_, b) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    serde_json::from_str(b).with_context(|| format!("{path} answered: {text}"))
}

struct Server {
    addr: SocketAddr,
    state: Arc<AppState>,
    /// Dropping it stops the server, which frees the model (one model loaded at a time).
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start_server(a: &BenchAgentReplayArgs, cache: Option<CacheConfig>) -> Result<Server> {
    let dir = super::model_arg::resolve(&a.model)?;
    let ck = capy_engine::checkpoint::Checkpoint::open(&dir)?;
    let (model, _backend) = a.backend.load(&ck)?;
    drop(ck);
    let (tokenizer, template) = capy_engine::chat_template::load_tokenizer_and_template(&dir)?;
    let tokenizer = Arc::new(tokenizer);
    let scheduler = Scheduler::start(
        model,
        tokenizer.clone(),
        SchedulerConfig {
            max_batch: 2,
            max_queue: 8,
            prefill_chunk: a.prefill_chunk,
            max_context: usize::MAX,
            prefix_cache: cache,
        },
    );
    let state = Arc::new(AppState::new(
        scheduler,
        tokenizer,
        template,
        a.model.clone(),
        ServerConfig::default(),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let s = state.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = capy_server::serve(listener, s, async {
            let _ = stopped.await;
        })
        .await;
    });
    Ok(Server {
        addr,
        state,
        _stop: stop,
    })
}

/// Words per tool result so that A's context reaches about `target` tokens at its last turn
/// (`base`: the first turn's prompt tokens, system prompt and tools included).
fn words_per_turn(state: &AppState, a: &BenchAgentReplayArgs, base: usize) -> Result<(usize, f64)> {
    let sample = tool_result(1, 400);
    let per_word = state
        .tokenizer
        .encode(&sample, false)
        .map_err(|e| anyhow::anyhow!("{e:#}"))?
        .len() as f64
        / 400.0;
    // Each turn also adds the answer and the tool call/result wrappers (~60 tokens).
    let room = a
        .target_context
        .saturating_sub(base + a.turns * (a.decode_tokens + 60));
    let words = (room as f64 / per_word / a.turns.max(1) as f64) as usize;
    Ok((words.max(8), per_word))
}

/// Runs both sessions' turns on one server; returns (A's turns, B's turns, A, B).
async fn replay(
    srv: &Server,
    a: &BenchAgentReplayArgs,
    words: usize,
) -> Result<(Vec<Turn>, Vec<Turn>, Agent)> {
    let mut agent_a = Agent::new("agent-a", TASK_A);
    let mut agent_b = Agent::new("agent-b", "Add a --json flag to the doctor command.");
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for t in 0..a.turns {
        let r = stream(srv.addr, &agent_a.id, &agent_a.body(a.decode_tokens)).await?;
        eprintln!(
            "turn {:>2} A: {:>6} prompt tokens, {:>6} cached, ttft {:>8.1} ms",
            t + 1,
            r.prompt_tokens,
            r.cached_tokens,
            r.ttft_s * 1e3
        );
        agent_a.advance(&r.text, words);
        ta.push(r);
        let r = stream(srv.addr, &agent_b.id, &agent_b.body(a.decode_tokens)).await?;
        agent_b.advance(&r.text, words / 4);
        tb.push(r);
    }
    Ok((ta, tb, agent_a))
}

fn turns_json(turns: &[Turn]) -> Value {
    turns
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"turn": i + 1, "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                   "ttft_ms": t.ttft_s * 1e3, "total_ms": t.total_s * 1e3})
        })
        .collect()
}

fn ratio(a: f64, b: f64) -> Value {
    if b > 0.0 {
        json!(a / b)
    } else {
        Value::Null
    }
}

pub fn run(a: BenchAgentReplayArgs) -> Result<Value> {
    if a.turns < 2 || a.decode_tokens == 0 {
        bail!("--turns must be at least 2 and --decode-tokens at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run_async(a))
}

async fn run_async(a: BenchAgentReplayArgs) -> Result<Value> {
    let offload = tempfile_dir()?;
    let identity = CacheIdentity {
        model_id: format!("agent-replay:{}", a.model),
        format: "bench".into(),
    };
    let cache = CacheConfig {
        block_tokens: a.block_tokens,
        // Disk offload starts off; it is switched on through the admin endpoint below.
        disk_dir: None,
        idle: Duration::from_secs(3600),
        ..CacheConfig::new(identity)
    };
    let on = start_server(&a, Some(cache)).await?;
    let probe = Agent::new("agent-a", TASK_A);
    let count = http_json(
        on.addr,
        "POST",
        "/v1/messages/count_tokens",
        &probe.body(a.decode_tokens),
    )
    .await?;
    let base = count["input_tokens"]
        .as_u64()
        .with_context(|| format!("count_tokens answered {count}"))? as usize;
    let (words, tokens_per_word) = words_per_turn(&on.state, &a, base)?;
    eprintln!("cache on: {} turns, {words} words per tool result", a.turns);
    let t0 = Instant::now();
    let (on_a, on_b, agent) = replay(&on, &a, words).await?;
    let on_wall = t0.elapsed().as_secs_f64();

    // A's next turn (its last tool result) resumed from RAM; then the same prompt from disk
    // and recomputed. It stays inside the tool loop: a new plain user message would make the
    // Qwen template re-render the earlier assistant turns (thinking dropped before the last
    // user query), which no cache can reuse.
    let resume = agent.body(a.decode_tokens);
    let ram = stream(on.addr, &agent.id, &resume).await?;
    let dir = offload.path().to_string_lossy().into_owned();
    http_json(
        on.addr,
        "POST",
        "/admin/disk-offload",
        &json!({"enabled": true, "dir": dir}),
    )
    .await?;
    let cache = on
        .state
        .scheduler
        .cache()
        .context("the cache is on")?
        .clone();
    cache.lock().unwrap().set_idle(Duration::ZERO);
    let t = Instant::now();
    loop {
        let st = http_json(on.addr, "GET", "/admin/status", &Value::Null).await?;
        let ram_use = st["use"]["prefix_cache"]["ram_bytes"].as_u64().unwrap_or(1);
        if ram_use == 0 {
            break;
        }
        if t.elapsed() > Duration::from_secs(120) {
            bail!("the idle sessions did not move to disk in 2 minutes: {st}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let offload_s = t.elapsed().as_secs_f64();
    cache.lock().unwrap().set_idle(Duration::from_secs(3600));
    let disk = stream(on.addr, &agent.id, &resume).await?;
    let status = http_json(on.addr, "GET", "/admin/status", &Value::Null).await?;
    drop(cache);
    drop(on);
    // Let the server task end and free the model before the next one loads.
    tokio::time::sleep(Duration::from_millis(500)).await;

    eprintln!("cache off");
    let off = start_server(&a, None).await?;
    let t0 = Instant::now();
    let (off_a, off_b, _) = replay(&off, &a, words).await?;
    let off_wall = t0.elapsed().as_secs_f64();
    // The same resume prompt, recomputed.
    let recompute = stream(off.addr, &agent.id, &resume).await?;

    let last = a.turns - 1;
    let first_last = |v: &[Turn]| (v[0].ttft_s, v[last].ttft_s);
    let (on1, on20) = first_last(&on_a);
    let (off1, off20) = first_last(&off_a);
    Ok(json!({
        "bench": "agent-replay",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "commit": super::bench::commit(),
        "machine": super::bench::machine(),
        "model": a.model,
        "api": "anthropic /v1/messages, streaming, X-Claude-Code-Session-Id, billing line varying",
        "turns": a.turns,
        "target_context": a.target_context,
        "decode_tokens": a.decode_tokens,
        "prefill_chunk": a.prefill_chunk,
        "block_tokens": a.block_tokens,
        "tool_result_words": words,
        "tokens_per_word": tokens_per_word,
        "final_context_tokens": on_a[last].prompt_tokens,
        "ttft_definition": "request sent to the first streamed event after message_start",
        "cache_on": {"session_a": turns_json(&on_a), "session_b": turns_json(&on_b), "wall_s": on_wall},
        "cache_off": {"session_a": turns_json(&off_a), "session_b": turns_json(&off_b), "wall_s": off_wall},
        "resume": {
            "prompt_tokens": disk.prompt_tokens,
            "ram": {"ttft_ms": ram.ttft_s * 1e3, "cached_tokens": ram.cached_tokens, "prompt_tokens": ram.prompt_tokens},
            "disk": {"ttft_ms": disk.ttft_s * 1e3, "cached_tokens": disk.cached_tokens, "offload_wait_s": offload_s},
            "recompute": {"ttft_ms": recompute.ttft_s * 1e3, "cached_tokens": recompute.cached_tokens},
        },
        "cache_status_after": {"budgets": status["budgets"]["prefix_cache"], "use": status["use"]["prefix_cache"],
                               "sessions": status["sessions"], "hits": status["prefix_cache"]["hits"],
                               "misses": status["prefix_cache"]["misses"]},
        "turn20_over_turn1_ttft_ratio": ratio(on20, on1),
        "turn20_over_turn1_ttft_ratio_cache_off": ratio(off20, off1),
        "last_turn_cache_speedup_ratio": ratio(off20, on20),
        "ram_resume_speedup_ratio": ratio(recompute.ttft_s, ram.ttft_s),
        "disk_resume_speedup_ratio": ratio(recompute.ttft_s, disk.ttft_s),
        "goals": {"turn20_over_turn1_ttft_ratio_max": 1.5, "disk_resume_speedup_ratio_min": 10.0,
                  "note": "goals are for the GPU box with a full-size model at ~30K tokens"},
    }))
}

/// A temporary folder for the disk tier, removed when dropped.
fn tempfile_dir() -> Result<TempDir> {
    let p = std::env::temp_dir().join(format!(
        "capy-agent-replay-{}-{}",
        std::process::id(),
        capy_engine::cache::unix_now() as u64
    ));
    std::fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
    Ok(TempDir(p))
}

struct TempDir(std::path::PathBuf);

impl TempDir {
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
