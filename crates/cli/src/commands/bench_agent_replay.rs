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
//!
//! One model is loaded once (`--model DIR|demo`, or `--synthetic SHAPE [--quant F]`: random
//! weights of the real configuration with the real Qwen tokenizer and chat template) and
//! served by one server: a warm-up request first (other system prompt, so it shares no prefix),
//! then the cache-on replay and the resumes, then the cache is switched off at run time
//! ([`capy_engine::cache::PrefixCache::set_enabled`]) for the cache-off replay (session A only:
//! without a cache B's turns cannot change A's) and the recompute.

use super::model_arg::{BackendArg, BackendKind};
use anyhow::{bail, Context, Result};
use capy_engine::cache::{CacheConfig, CacheIdentity};
use capy_engine::chat_template::ChatTemplate;
use capy_engine::config::TextConfig;
use capy_engine::model::CausalLm;
use capy_engine::scheduler::{Scheduler, SchedulerConfig};
use capy_engine::tokenizer::Tokenizer;
use capy_server::{AppState, ServerConfig};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(clap::Args)]
pub struct BenchAgentReplayArgs {
    /// Model folder, "demo" or "demo-moe" (ignored with --synthetic).
    #[arg(long, default_value = "demo")]
    pub model: String,
    /// A synthetic model instead: random weights of a real configuration ("qwen3.8-27b",
    /// "moe-mid", or "tiny": the 27B layout shrunk to hidden 64 and 4 layers with the full
    /// vocabulary, for checking the plumbing on a CPU), served with the real Qwen tokenizer and
    /// chat template.
    #[arg(long)]
    pub synthetic: Option<String>,
    /// With --synthetic on CUDA: projection weights as random blocks of this format kept
    /// quantized on the GPU (bf16, nvfp4, iq3_s, ...).
    #[arg(long, default_value = "bf16")]
    pub quant: String,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// RAM tier budget of the prefix cache (a 30K-token state of the 27B is about 4 GB).
    #[arg(long, default_value = "24GiB", value_parser = super::bench_gpu::parse_bytes)]
    pub cache_ram: u64,
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
    /// Finished sessions' sequences kept parked on the device for their next turn (the prefix
    /// cache's VRAM tier); 0 copies every turn to RAM instead (the cache before parking).
    #[arg(long, default_value_t = 4)]
    pub max_parked: usize,
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
    /// Dropping it stops the server.
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// The model to serve, loaded once.
struct Loaded {
    model: Box<dyn CausalLm>,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// What the record calls it: the folder, or "synthetic SHAPE QUANT".
    label: String,
    backend: &'static str,
    gpu: Option<Value>,
    vram_plan: Option<Value>,
}

/// `config.json` of a synthetic shape; "tiny" is the 27B layout shrunk (full vocabulary).
fn synthetic_config(shape: &str) -> Result<Value> {
    if shape != "tiny" {
        return capy_engine::synthetic::config(shape);
    }
    let mut c = capy_engine::synthetic::config("qwen3.8-27b")?;
    for (k, v) in [
        ("hidden_size", 64),
        ("intermediate_size", 128),
        ("num_hidden_layers", 4),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("head_dim", 16),
        ("linear_num_key_heads", 2),
        ("linear_num_value_heads", 4),
        ("linear_key_head_dim", 16),
        ("linear_value_head_dim", 16),
    ] {
        c[k] = json!(v);
    }
    Ok(c)
}

/// KV bytes per token (f32 K and V of every attention layer, as the CUDA backend keeps them).
fn kv_bytes_per_token(c: &TextConfig) -> u64 {
    let attn = c
        .layer_types
        .iter()
        .filter(|t| **t == capy_engine::config::LayerType::FullAttention)
        .count();
    (attn * 2 * c.num_key_value_heads * c.head_dim * 4) as u64
}

/// Where the replay's VRAM goes on CUDA, before anything is loaded: the weights, session A's
/// KV at its last turn with room for the backend's doubling growth (a state imported at n rows
/// grows to 2n when the turn appends), session B's at a quarter of that, both sequences' GDN
/// states (twice with parking: each parked sequence keeps a checkpoint copy of them), one
/// prefill chunk's activations and scratch, and the pool's reserve.
fn replay_vram_plan(
    c: &TextConfig,
    quant: Option<capy_engine::backend::cpu::experts::format::RowFormat>,
    a: &BenchAgentReplayArgs,
) -> Result<(u64, Value)> {
    use capy_engine::backend::cuda::bench::plan_vram;
    let p = plan_vram(c, quant, a.prefill_chunk, a.decode_tokens)?;
    // The last turn's context overshoots the target a little (rendering wrappers).
    let ctx_a = (a.target_context as f64 * 1.05) as u64 + a.decode_tokens as u64 + 1024;
    let ctx_b = ctx_a / 4 + 1024;
    let per = kv_bytes_per_token(c);
    let kv = 2 * (ctx_a + ctx_b) * per;
    let copies = if a.max_parked > 0 { 2 } else { 1 };
    let states = 2 * copies * p.states;
    let total = p.weights + kv + states + p.workspace + p.reserve;
    Ok((
        total,
        json!({"weights": p.weights, "kv": kv, "kv_bytes_per_token": per, "kv_tokens_a": ctx_a,
               "kv_tokens_b": ctx_b, "states": states, "workspace": p.workspace,
               "reserve": p.reserve, "total": total}),
    ))
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn load(a: &BenchAgentReplayArgs) -> Result<Loaded> {
    let Some(shape) = &a.synthetic else {
        let dir = super::model_arg::resolve(&a.model)?;
        let ck = capy_engine::checkpoint::Checkpoint::open(&dir)?;
        let (model, backend) = a.backend.load(&ck)?;
        drop(ck);
        let (tokenizer, template) = capy_engine::chat_template::load_tokenizer_and_template(&dir)?;
        return Ok(Loaded {
            model,
            tokenizer,
            template,
            label: a.model.clone(),
            backend,
            gpu: None,
            vram_plan: None,
        });
    };
    use capy_engine::backend::cuda::CudaBackend;
    let cfg_json = synthetic_config(shape)?;
    let cfg = TextConfig::from_value(&cfg_json)?;
    let tokenizer = Tokenizer::from_json_bytes(&capy_engine::tokenizer::demo_tokenizer_json())?;
    if cfg.vocab_size < tokenizer.vocab_size() {
        bail!(
            "--synthetic {shape}: its vocabulary has {} ids but the tokenizer has {}; a synthetic \
             model served with this tokenizer needs at least as many",
            cfg.vocab_size,
            tokenizer.vocab_size()
        );
    }
    let template = ChatTemplate::from_source(
        capy_engine::tokenizer::DEMO_CHAT_TEMPLATE,
        None,
        Some("<|im_end|>".into()),
    )?;
    let quant = match a.quant.to_ascii_lowercase().as_str() {
        "bf16" | "none" => None,
        other => Some(capy_engine::backend::cpu::experts::format::RowFormat::parse(other)?),
    };
    // The plan is checked before the GPU is opened (a refusal needs no GPU).
    let (need, plan) = replay_vram_plan(&cfg, quant, a)?;
    let plan = (a.backend.backend != BackendKind::Cpu).then_some(plan);
    if let Some(plan) = &plan {
        eprintln!(
        "VRAM plan (GiB): weights {:.2} + KV {:.2} (A {} tokens, B {}) + states {:.2} + workspace {:.2} + reserve {:.2} = {:.2}{}",
        gib(plan["weights"].as_u64().unwrap_or(0)),
        gib(plan["kv"].as_u64().unwrap_or(0)),
        plan["kv_tokens_a"],
        plan["kv_tokens_b"],
        gib(plan["states"].as_u64().unwrap_or(0)),
        gib(plan["workspace"].as_u64().unwrap_or(0)),
        gib(plan["reserve"].as_u64().unwrap_or(0)),
        gib(need),
        a.backend
            .vram_budget
            .map_or(String::new(), |b| format!(" of a {:.2} GiB budget", gib(b)))
    );
        if let Some(budget) = a.backend.vram_budget {
            if need > budget {
                let per = plan["kv_bytes_per_token"].as_u64().unwrap_or(1).max(1);
                let fixed = need - plan["kv"].as_u64().unwrap_or(0);
                let room = budget.saturating_sub(fixed) / (2 * per);
                bail!(
                "--synthetic {shape} --quant {} does not fit --vram-budget {:.2} GiB for a {}-token replay: it needs \
                 {need} bytes ({:.2} GiB: weights {} + KV {} + states {} + workspace {} + reserve {}). The weights \
                 alone leave room for about {} tokens of context; use --vram-budget {:.0}GiB or more, a smaller \
                 --quant, or a shorter --target-context",
                a.quant,
                gib(budget),
                a.target_context,
                gib(need),
                plan["weights"],
                plan["kv"],
                plan["states"],
                plan["workspace"],
                plan["reserve"],
                room * 4 / 5,
                gib(need).ceil()
            );
            }
        }
    }
    let cuda = match a.backend.backend {
        BackendKind::Cpu => None,
        BackendKind::Cuda => Some(CudaBackend::new(0, a.backend.vram_budget).map_err(|e| {
            anyhow::anyhow!("--backend cuda: no usable CUDA GPU: {e:#}; use --backend cpu")
        })?),
        BackendKind::Auto => CudaBackend::new(0, a.backend.vram_budget)
            .map_err(|e| eprintln!("note: --backend auto: running on the CPU ({e:#})"))
            .ok(),
    };
    let label = format!("synthetic {shape} {}", a.quant.to_ascii_lowercase());
    let t = Instant::now();
    let ck = capy_engine::synthetic::checkpoint_from_config(&cfg_json, a.seed)?;
    let Some(backend) = cuda else {
        if quant.is_some() {
            bail!(
                "--quant {}: synthetic quantized weights are built by the CUDA backend only; use \
                 --backend cuda or --quant bf16",
                a.quant
            );
        }
        let model = capy_engine::model::load(capy_engine::backend::cpu::CpuBackend::new(), &ck)?;
        eprintln!(
            "{label}: built on the CPU in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        return Ok(Loaded {
            model,
            tokenizer,
            template: Some(template),
            label,
            backend: "cpu",
            gpu: None,
            vram_plan: None,
        });
    };
    let info = backend.device_info().clone();
    backend.set_synthetic_quant(quant);
    let model = capy_engine::model::load(backend.clone(), &ck);
    backend.set_synthetic_quant(None);
    let model = model.context("building the synthetic model on the GPU")?;
    drop(ck);
    eprintln!(
        "{label}: built on {} in {:.1} s",
        info.name,
        t.elapsed().as_secs_f64()
    );
    Ok(Loaded {
        model,
        tokenizer,
        template: Some(template),
        label,
        backend: "cuda",
        gpu: Some(
            json!({"name": info.name, "compute_capability": format!("sm_{}{}", info.compute_capability.0, info.compute_capability.1),
                         "memory_bytes": info.total_memory, "vram_budget_bytes": a.backend.vram_budget}),
        ),
        vram_plan: plan,
    })
}

async fn start_server(
    a: &BenchAgentReplayArgs,
    loaded: Loaded,
    cache: Option<CacheConfig>,
) -> Result<Server> {
    let tokenizer = Arc::new(loaded.tokenizer);
    let scheduler = Scheduler::start(
        loaded.model,
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
        loaded.template,
        loaded.label,
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
    with_b: bool,
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
        if !with_b {
            continue;
        }
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
    let loaded = load(&a)?;
    let (label, backend, gpu, vram_plan) = (
        loaded.label.clone(),
        loaded.backend,
        loaded.gpu.clone(),
        loaded.vram_plan.clone(),
    );
    let identity = CacheIdentity {
        model_id: format!("agent-replay:{label}"),
        format: "bench".into(),
    };
    let cache = CacheConfig {
        block_tokens: a.block_tokens,
        max_parked: a.max_parked,
        ram_bytes: usize::try_from(a.cache_ram).unwrap_or(usize::MAX),
        // Disk offload starts off; it is switched on through the admin endpoint below.
        disk_dir: None,
        idle: Duration::from_secs(3600),
        ..CacheConfig::new(identity)
    };
    let load_start = Instant::now();
    let srv = start_server(&a, loaded, Some(cache)).await?;
    let prefix_cache = srv
        .state
        .scheduler
        .cache()
        .context("the server was started with a prefix cache")?
        .clone();
    // Warm-up (kernels, GEMM heuristics, the memory pool): another system prompt, no tools, so
    // it shares no prefix with the sessions measured.
    let warm = json!({"model": "agent-replay", "max_tokens": 2, "stream": true, "temperature": 0,
                      "system": "Warm-up.", "messages": [{"role": "user", "content": tool_result(7, 300)}]});
    stream(srv.addr, "warm-up", &warm).await?;
    let warmup_s = load_start.elapsed().as_secs_f64();
    let probe = Agent::new("agent-a", TASK_A);
    let count = http_json(
        srv.addr,
        "POST",
        "/v1/messages/count_tokens",
        &probe.body(a.decode_tokens),
    )
    .await?;
    let base = count["input_tokens"]
        .as_u64()
        .with_context(|| format!("count_tokens answered {count}"))? as usize;
    let (words, tokens_per_word) = words_per_turn(&srv.state, &a, base)?;
    eprintln!("cache on: {} turns, {words} words per tool result", a.turns);
    let t0 = Instant::now();
    let (on_a, on_b, agent) = replay(&srv, &a, words, true).await?;
    let on_wall = t0.elapsed().as_secs_f64();

    // A's next turn (its last tool result) resumed from its parked sequence (with parking),
    // then from RAM once the idle sessions left the device, then the same prompt from disk and
    // recomputed. It stays inside the tool loop, as an agent does between user messages.
    let resume = agent.body(a.decode_tokens);
    let first = stream(srv.addr, &agent.id, &resume).await?;
    let (vram, ram) = if a.max_parked > 0 {
        prefix_cache.lock().unwrap().set_idle(Duration::ZERO);
        wait_off_device(&prefix_cache).await?;
        prefix_cache
            .lock()
            .unwrap()
            .set_idle(Duration::from_secs(3600));
        (Some(first), stream(srv.addr, &agent.id, &resume).await?)
    } else {
        (None, first)
    };
    let dir = offload.path().to_string_lossy().into_owned();
    http_json(
        srv.addr,
        "POST",
        "/admin/disk-offload",
        &json!({"enabled": true, "dir": dir}),
    )
    .await?;
    let offload_s = move_idle_to_disk(&srv, &prefix_cache).await?;
    // Warm: the entry files were just written, so the kernel may still hold their pages.
    let disk = stream(srv.addr, &agent.id, &resume).await?;
    let status = http_json(srv.addr, "GET", "/admin/status", &Value::Null).await?;
    // Cold: the same resume once the session is back on disk and the kernel has dropped the
    // files' pages, so the state is read from the disk itself.
    move_idle_to_disk(&srv, &prefix_cache).await?;
    let (dropped_files, dropped_bytes) =
        capy_engine::cache::disk::drop_from_page_cache(offload.path())?;
    let disk_cold = stream(srv.addr, &agent.id, &resume).await?;
    // A third session's long first prompt (two thirds of the target context, sharing no prefix
    // with A or B) with the cache on, then again with it off below: what the cache's
    // snapshots cost a cold start.
    let cold_words = ((a.target_context * 2 / 3) as f64 / tokens_per_word) as usize;
    let cold_body = json!({"model": "agent-replay", "max_tokens": a.decode_tokens, "stream": true,
        "temperature": 0, "system": "Cold start: a new project.",
        "messages": [{"role": "user", "content": tool_result(99, cold_words)}]});
    let cold_on = stream(srv.addr, "agent-c", &cold_body).await?;

    // The same loaded model without a cache: lookups and captures off, the RAM tier emptied,
    // disk offload off.
    {
        let mut c = prefix_cache.lock().unwrap();
        c.set_disk(None)?;
        c.set_enabled(false);
    }
    eprintln!("cache off (session A only)");
    let t0 = Instant::now();
    let (off_a, _, _) = replay(&srv, &a, words, false).await?;
    let off_wall = t0.elapsed().as_secs_f64();
    // The same resume prompt, recomputed.
    let recompute = stream(srv.addr, &agent.id, &resume).await?;
    let cold_off = stream(srv.addr, "agent-c", &cold_body).await?;
    drop(prefix_cache);
    drop(srv);

    let last = a.turns - 1;
    let first_last = |v: &[Turn]| (v[0].ttft_s, v[last].ttft_s);
    let (on1, on20) = first_last(&on_a);
    let (off1, off20) = first_last(&off_a);
    let mut machine = super::bench::machine();
    machine["gpu"] = gpu.unwrap_or(Value::Null);
    Ok(json!({
        "bench": "agent-replay",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "commit": super::bench::commit(),
        "machine": machine,
        "model": label,
        "backend": backend,
        "vram_plan": vram_plan,
        "api": "anthropic /v1/messages, streaming, X-Claude-Code-Session-Id, billing line varying",
        "turns": a.turns,
        "target_context": a.target_context,
        "decode_tokens": a.decode_tokens,
        "prefill_chunk": a.prefill_chunk,
        "block_tokens": a.block_tokens,
        "max_parked": a.max_parked,
        "cache_ram_bytes": a.cache_ram,
        "tool_result_words": words,
        "tokens_per_word": tokens_per_word,
        "final_context_tokens": on_a[last].prompt_tokens,
        "load_and_warmup_s": warmup_s,
        "ttft_definition": "request sent to the first streamed event after message_start",
        "cache_on": {"session_a": turns_json(&on_a), "session_b": turns_json(&on_b), "wall_s": on_wall},
        "cache_off": {"session_a": turns_json(&off_a), "wall_s": off_wall,
                      "note": "same loaded model, cache switched off; session A only (without a cache B cannot change A's turns)"},
        "resume": {
            "prompt_tokens": disk.prompt_tokens,
            "vram": vram.as_ref().map(|v| json!({"ttft_ms": v.ttft_s * 1e3, "cached_tokens": v.cached_tokens})),
            "ram": {"ttft_ms": ram.ttft_s * 1e3, "cached_tokens": ram.cached_tokens, "prompt_tokens": ram.prompt_tokens},
            "disk": {"ttft_ms": disk.ttft_s * 1e3, "cached_tokens": disk.cached_tokens, "offload_wait_s": offload_s,
                     "note": "warm: read right after the offload wrote it (page cache may hold it)"},
            "disk_cold": {"ttft_ms": disk_cold.ttft_s * 1e3, "cached_tokens": disk_cold.cached_tokens,
                          "page_cache_dropped_files": dropped_files, "page_cache_dropped_bytes": dropped_bytes,
                          "note": "posix_fadvise(DONTNEED) on every entry file first: read from the disk"},
            "recompute": {"ttft_ms": recompute.ttft_s * 1e3, "cached_tokens": recompute.cached_tokens},
        },
        "cold_first_turn": {"prompt_tokens": cold_on.prompt_tokens,
                            "cache_on_ttft_ms": cold_on.ttft_s * 1e3, "cache_off_ttft_ms": cold_off.ttft_s * 1e3,
                            "note": "a new session's first prompt, no shared prefix: the cost of the cache's snapshots"},
        "cold_first_turn_cache_on_over_off_ratio": ratio(cold_on.ttft_s, cold_off.ttft_s),
        "cache_status_after": {"budgets": status["budgets"]["prefix_cache"], "use": status["use"]["prefix_cache"],
                               "sessions": status["sessions"], "hits": status["prefix_cache"]["hits"],
                               "misses": status["prefix_cache"]["misses"]},
        "turn20_over_turn1_ttft_ratio": ratio(on20, on1),
        "turn20_over_turn1_ttft_ratio_cache_off": ratio(off20, off1),
        "last_turn_cache_speedup_ratio": ratio(off20, on20),
        "vram_resume_speedup_ratio": vram.as_ref().map(|v| ratio(recompute.ttft_s, v.ttft_s)),
        "ram_resume_speedup_ratio": ratio(recompute.ttft_s, ram.ttft_s),
        "disk_resume_speedup_ratio": ratio(recompute.ttft_s, disk.ttft_s),
        "disk_cold_resume_speedup_ratio": ratio(recompute.ttft_s, disk_cold.ttft_s),
        "goals": {"turn20_over_turn1_ttft_ratio_max": 1.5, "disk_resume_speedup_ratio_min": 10.0,
                  "note": "goals are for the GPU box with a full-size model at ~30K tokens"},
    }))
}

/// Makes every session idle and waits until the prefix cache's RAM tier is empty (all of it
/// written to disk); returns the seconds that took. Sessions are active again afterwards.
async fn move_idle_to_disk(
    srv: &Server,
    cache: &std::sync::Mutex<capy_engine::cache::PrefixCache>,
) -> Result<f64> {
    cache.lock().unwrap().set_idle(Duration::ZERO);
    let t = Instant::now();
    wait_off_device(cache).await?;
    loop {
        let st = http_json(srv.addr, "GET", "/admin/status", &Value::Null).await?;
        let ram_use = st["use"]["prefix_cache"]["ram_bytes"].as_u64().unwrap_or(1);
        if ram_use == 0 {
            break;
        }
        if t.elapsed() > Duration::from_secs(180) {
            bail!("the idle sessions did not move to disk in 3 minutes: {st}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cache.lock().unwrap().set_idle(Duration::from_secs(3600));
    Ok(t.elapsed().as_secs_f64())
}

/// Waits until no session is parked on the device any more (with the idle time at zero the
/// scheduler exports them to RAM within a second).
async fn wait_off_device(cache: &std::sync::Mutex<capy_engine::cache::PrefixCache>) -> Result<()> {
    let t = Instant::now();
    while !cache.lock().unwrap().parked_sessions().is_empty() {
        if t.elapsed() > Duration::from_secs(180) {
            bail!("the parked sequences did not leave the device in 3 minutes");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
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
