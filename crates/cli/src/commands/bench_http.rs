//! `capy-flash bench http --model demo`: what the HTTP layer costs. The same chat request is run
//! against the scheduler directly ("engine") and through a real server on a loopback port
//! (chat completions, streaming SSE), alternately; time to first token and decode tokens/s are
//! reported for each with the HTTP/engine ratios.
//!
//! Both paths share the tokens (the request is prepared by the server's own normalisation),
//! greedy sampling, and the end-of-sequence tokens biased away so every run decodes exactly
//! `--decode-tokens`. The prefix cache is off: a repeated prompt would otherwise be resumed
//! and the time to first token would measure the cache, not the prefill.

use super::model_arg::BackendArg;
use anyhow::{bail, Context, Result};
use capy_engine::scheduler::{GenerationEvent, SchedulerConfig};
use capy_server::error::Flavor;
use capy_server::normalize;
use capy_server::openai_chat::{to_chat_request, ChatCompletionRequest};
use capy_server::{AppState, ServerConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct BenchHttpArgs {
    /// Model folder, "demo" or "demo-moe".
    #[arg(long, default_value = "demo")]
    pub model: String,
    #[command(flatten)]
    pub backend: BackendArg,
    /// Words of the user message (about one token each; the record has the exact prompt length,
    /// chat template included).
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Timed runs of each path (after one untimed warm-up of each).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
}

/// One run's figures.
#[derive(Clone, Copy, Debug)]
struct Run {
    ttft_s: f64,
    decode_tokens_per_s: f64,
    completion_tokens: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Decode rate after the first token: the tokens that followed it over the time they took.
fn decode_rate(tokens: usize, first: Duration, end: Duration) -> f64 {
    let span = (end - first).as_secs_f64();
    if tokens < 2 || span <= 0.0 {
        return 0.0;
    }
    (tokens - 1) as f64 / span
}

/// The request body both paths run.
fn body(model_id: &str, a: &BenchHttpArgs, eos: &[u32]) -> Value {
    let words = vec!["the"; a.prompt_tokens.max(1)].join(" ");
    let bias: serde_json::Map<String, Value> =
        eos.iter().map(|id| (id.to_string(), json!(-100))).collect();
    json!({
        "model": model_id,
        "messages": [{"role": "user", "content": words}],
        "max_tokens": a.decode_tokens,
        "temperature": 0,
        "logit_bias": bias,
        "chat_template_kwargs": {"enable_thinking": false},
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// The body as the chat completions adapter turns it into the scheduler's request.
fn prepare(state: &AppState, body: &Value) -> Result<normalize::Prepared> {
    let parsed: ChatCompletionRequest = serde_json::from_value(body.clone())?;
    let (req, _) = to_chat_request(parsed).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    normalize::prepare(state, req, Flavor::OpenAi).map_err(|e| anyhow::anyhow!("{e:?}"))
}

fn engine_run(state: &AppState, body: &Value) -> Result<Run> {
    let prepared = prepare(state, body)?;
    let t = Instant::now();
    let mut stream = state
        .scheduler
        .submit(prepared.generation)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut first = None;
    loop {
        match stream.blocking_recv() {
            Some(GenerationEvent::Token { text, .. }) => {
                if first.is_none() && !text.is_empty() {
                    first = Some(t.elapsed());
                }
            }
            Some(GenerationEvent::Finished { usage, .. }) => {
                let end = t.elapsed();
                let first = first.context("the engine produced no visible text")?;
                return Ok(Run {
                    ttft_s: first.as_secs_f64(),
                    decode_tokens_per_s: decode_rate(usage.completion_tokens, first, end),
                    completion_tokens: usage.completion_tokens,
                });
            }
            Some(GenerationEvent::Error(e)) => bail!("the engine failed: {e}"),
            None => bail!("the scheduler stopped"),
        }
    }
}

/// One streaming chat completion over HTTP; the clock stops at the first chunk with visible
/// text and at the chunk carrying the usage (the last one before `[DONE]`).
async fn http_run(client: &reqwest::Client, url: &str, body: &Value) -> Result<Run> {
    let t = Instant::now();
    let mut resp = client.post(url).json(body).send().await?;
    if !resp.status().is_success() {
        bail!(
            "the server answered {}: {}",
            resp.status(),
            resp.text().await?
        );
    }
    let mut buf = String::new();
    let mut first = None;
    while let Some(chunk) = resp.chunk().await? {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue; // keep-alive comment
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data)
                .with_context(|| format!("an SSE event that is not JSON: {data}"))?;
            let delta = &v["choices"][0]["delta"];
            let visible = ["content", "reasoning_content"]
                .iter()
                .any(|k| delta[*k].as_str().is_some_and(|s| !s.is_empty()));
            if first.is_none() && visible {
                first = Some(t.elapsed());
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                let end = t.elapsed();
                let first = first.context("the server streamed no visible text")?;
                return Ok(Run {
                    ttft_s: first.as_secs_f64(),
                    decode_tokens_per_s: decode_rate(n as usize, first, end),
                    completion_tokens: n as usize,
                });
            }
        }
    }
    bail!("the stream ended without a usage chunk")
}

fn summary(runs: &[Run]) -> Value {
    json!({
        "ttft_ms_median": median(runs.iter().map(|r| r.ttft_s * 1e3).collect()),
        "decode_tokens_per_s_median": median(runs.iter().map(|r| r.decode_tokens_per_s).collect()),
        "completion_tokens": runs.first().map(|r| r.completion_tokens),
        "ttft_ms": runs.iter().map(|r| r.ttft_s * 1e3).collect::<Vec<_>>(),
        "decode_tokens_per_s": runs.iter().map(|r| r.decode_tokens_per_s).collect::<Vec<_>>(),
    })
}

pub fn run(a: BenchHttpArgs) -> Result<Value> {
    if a.runs == 0 || a.decode_tokens < 2 {
        bail!("--runs must be positive and --decode-tokens at least 2");
    }
    let dir = super::model_arg::resolve(&a.model)?;
    let ck = capy_engine::checkpoint::Checkpoint::open(&dir)?;
    let (model, backend) = a.backend.load(&ck)?;
    drop(ck);
    let model_id = a.model.clone();
    let scheduler = SchedulerConfig {
        max_batch: 1,
        max_queue: 4,
        prefill_chunk: 256,
        max_context: usize::MAX,
        prefix_cache: None,
    };
    let state = capy_server::load_state(
        &dir,
        model,
        model_id.clone(),
        scheduler,
        ServerConfig::default(),
    )?;
    let eos = state.scheduler.model_info().eos_token_ids.clone();
    let body = body(&model_id, &a, &eos);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let url = format!("http://{}/v1/chat/completions", listener.local_addr()?);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(capy_server::serve(listener, state.clone(), async {
        let _ = stop_rx.await;
    }));
    let client = reqwest::Client::builder().no_proxy().build()?;

    let mut engine = Vec::new();
    let mut http = Vec::new();
    // Alternate the paths so drift in the machine's load affects both alike.
    for i in 0..=a.runs {
        let e = engine_run(&state, &body)?;
        let h = rt.block_on(http_run(&client, &url, &body))?;
        if e.completion_tokens != h.completion_tokens {
            bail!(
                "the paths generated different lengths ({} engine, {} HTTP); the comparison needs equal work",
                e.completion_tokens,
                h.completion_tokens
            );
        }
        if i > 0 {
            engine.push(e);
            http.push(h);
        }
    }
    let _ = stop_tx.send(());
    let _ = rt.block_on(server);

    let (e, h) = (summary(&engine), summary(&http));
    let ratio = |key: &str| h[key].as_f64().unwrap_or(0.0) / e[key].as_f64().unwrap_or(1.0);
    Ok(json!({
        "bench": "http-overhead",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "commit": super::bench::commit(),
        "machine": super::bench::machine(),
        // Other work on the machine skews both paths; the 1/5/15-minute load at the end.
        "load_average": std::fs::read_to_string("/proc/loadavg")
            .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default(),
        "model": model_id,
        "backend": backend,
        "build": if cfg!(debug_assertions) { "debug (opt-level 2)" } else { "release" },
        "prompt_tokens": prepare(&state, &body)?.prompt_tokens,
        "decode_tokens": a.decode_tokens,
        "runs": a.runs,
        "api": "POST /v1/chat/completions, stream: true, one client on 127.0.0.1",
        "engine": e,
        "http": h,
        "ttft_http_over_engine_ratio": ratio("ttft_ms_median"),
        "decode_tps_http_over_engine_ratio": ratio("decode_tokens_per_s_median"),
    }))
}
