//! The real router on an ephemeral port, driven over raw HTTP. The model is a `ScriptedLm`
//! whose greedy tokens spell a given text through the real Qwen tokenizer (the output is
//! injected below the parser; tokenizer, template, scheduler, parser and adapters are real).

use capy_engine::chat_template::ChatTemplate;
use capy_engine::scheduler::scripted::{ScriptedLm, ScriptedStats};
use capy_engine::scheduler::{Scheduler, SchedulerConfig};
use capy_engine::tokenizer::{demo_tokenizer_json, Tokenizer, DEMO_CHAT_TEMPLATE, DEMO_IM_END_ID};
use capy_server::{AppState, ServerConfig};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(Tokenizer::from_json_bytes(&demo_tokenizer_json()).unwrap()))
        .clone()
}

struct Server {
    addr: SocketAddr,
    stats: Arc<ScriptedStats>,
    state: Arc<AppState>,
}

async fn start(
    output: &str,
    sched: SchedulerConfig,
    config: ServerConfig,
    delay: Duration,
) -> Server {
    let tok = tokenizer();
    let script = tok.encode(output, false).unwrap();
    let lm = ScriptedLm::new(tok.vocab_size(), 4096, script, DEMO_IM_END_ID).with_step_delay(delay);
    let stats = lm.stats();
    let template =
        ChatTemplate::from_source(DEMO_CHAT_TEMPLATE, None, Some("<|im_end|>".into())).unwrap();
    let scheduler = Scheduler::start(Box::new(lm), tok.clone(), sched);
    let state = Arc::new(AppState::new(
        scheduler,
        tok,
        Some(template),
        "scripted-model".into(),
        config,
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let s = state.clone();
    tokio::spawn(async move {
        capy_server::serve(listener, s, std::future::pending())
            .await
            .unwrap()
    });
    Server { addr, stats, state }
}

/// One HTTP/1.0 request (the body is close-delimited, so streams need no chunk decoding).
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
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
    (status, head.to_string(), body.to_string())
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (status, _, body) = request(addr, "POST", path, &[], &body.to_string()).await;
    (
        status,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    )
}

/// SSE events as (event name or "", data JSON or string).
fn sse_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|b| b.lines().any(|l| l.starts_with("data:")))
        .map(|b| {
            let mut name = String::new();
            let mut data = String::new();
            for l in b.lines() {
                if let Some(n) = l.strip_prefix("event:") {
                    name = n.trim().to_string();
                } else if let Some(d) = l.strip_prefix("data:") {
                    data.push_str(d.trim_start());
                }
            }
            (
                name,
                serde_json::from_str(&data).unwrap_or(Value::String(data)),
            )
        })
        .collect()
}

const TOOL_OUTPUT: &str = "Checking the weather.</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

fn weather_tool_anthropic() -> Value {
    json!({"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_stream_event_order_with_injected_thinking_and_tool_call() {
    let srv = start(
        TOOL_OUTPUT,
        SchedulerConfig::default(),
        ServerConfig::default(),
        Duration::ZERO,
    )
    .await;
    let body = json!({"model": "claude-opus-4", "max_tokens": 100, "stream": true, "thinking": {"type": "enabled", "budget_tokens": 50},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=42;\nYou are helpful."}],
        "tools": [weather_tool_anthropic()], "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let (status, head, text) = request(
        srv.addr,
        "POST",
        "/v1/messages",
        &[
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", "x"),
            ("X-Claude-Code-Session-Id", "sess-1"),
        ],
        &body.to_string(),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(head.to_lowercase().contains("text/event-stream"));
    let events = sse_events(&text);
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    for (name, data) in &events {
        assert_eq!(data["type"], *name, "event name and data type agree");
    }
    let mut expected = vec!["message_start", "content_block_start"];
    let thinking_deltas = names
        .iter()
        .filter(|n| **n == "content_block_delta")
        .count();
    assert!(thinking_deltas >= 3);
    assert_eq!(names[0], "message_start");
    assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"]);
    expected.clear();
    // Block structure: thinking (with signature), then tool_use with input_json_delta.
    let starts: Vec<&Value> = events
        .iter()
        .filter(|e| e.0 == "content_block_start")
        .map(|e| &e.1["content_block"])
        .collect();
    assert_eq!(starts.len(), 2);
    assert_eq!(starts[0]["type"], "thinking");
    assert_eq!(starts[1]["type"], "tool_use");
    assert_eq!(starts[1]["name"], "get_weather");
    assert!(starts[1]["id"].as_str().unwrap().starts_with("toolu_"));
    let deltas: Vec<&Value> = events
        .iter()
        .filter(|e| e.0 == "content_block_delta")
        .map(|e| &e.1["delta"])
        .collect();
    assert!(deltas.iter().any(|d| d["type"] == "signature_delta"));
    let thinking: String = deltas
        .iter()
        .filter(|d| d["type"] == "thinking_delta")
        .map(|d| d["thinking"].as_str().unwrap())
        .collect();
    assert_eq!(thinking, "Checking the weather.");
    let json_text: String = deltas
        .iter()
        .filter(|d| d["type"] == "input_json_delta")
        .map(|d| d["partial_json"].as_str().unwrap())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&json_text).unwrap(),
        json!({"city": "Paris", "days": 3})
    );
    let md = &events[events.len() - 2].1;
    assert_eq!(md["delta"]["stop_reason"], "tool_use");
    let usage = &events[0].1["message"]["usage"];
    assert!(usage["input_tokens"].as_u64().unwrap() > 10);
    assert!(md["usage"]["output_tokens"].as_u64().unwrap() > 10);
    assert_eq!(srv.state.sessions.lock().unwrap().get("sess-1"), Some(&1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_stream_event_order_with_injected_function_call() {
    let srv = start(
        TOOL_OUTPUT,
        SchedulerConfig::default(),
        ServerConfig::default(),
        Duration::ZERO,
    )
    .await;
    let body = json!({"model": "gpt-5-codex", "stream": true, "instructions": "Be brief.", "reasoning": {"effort": "medium"},
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}],
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}]});
    let (status, _, text) =
        request(srv.addr, "POST", "/v1/responses", &[], &body.to_string()).await;
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], *name);
        assert_eq!(data["sequence_number"], i as u64);
    }
    let skeleton: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| !n.ends_with(".delta"))
        .collect();
    assert_eq!(
        skeleton,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.reasoning_text.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let done = &events[events.len() - 1].1["response"];
    assert_eq!(done["status"], "completed");
    assert!(done["id"].as_str().unwrap().starts_with("resp_"));
    let call = &done["output"][1];
    assert_eq!(call["type"], "function_call");
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(
        serde_json::from_str::<Value>(call["arguments"].as_str().unwrap()).unwrap(),
        json!({"city": "Paris", "days": 3})
    );
    let u = &done["usage"];
    assert_eq!(
        u["total_tokens"],
        u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap()
    );
    assert_eq!(u["input_tokens_details"]["cached_tokens"], 0);
    assert!(
        u["output_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap()
            >= 3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_and_non_stream_with_injected_tool_call() {
    let srv = start(
        TOOL_OUTPUT,
        SchedulerConfig::default(),
        ServerConfig::default(),
        Duration::ZERO,
    )
    .await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let msgs = json!([{"role": "user", "content": "Weather?"}]);
    let (status, r) = post(
        srv.addr,
        "/v1/chat/completions",
        json!({"model": "any", "messages": msgs, "tools": tools}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["model"], "scripted-model");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(
        choice["message"]["reasoning_content"],
        "Checking the weather."
    );
    let args: Value = serde_json::from_str(
        choice["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 3}));
    let body = json!({"model": "any", "messages": msgs, "tools": tools, "stream": true, "stream_options": {"include_usage": true}});
    let (_, _, text) = request(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &body.to_string(),
    )
    .await;
    let events = sse_events(&text);
    assert_eq!(events.last().unwrap().1, Value::String("[DONE]".into()));
    assert_eq!(events[0].1["choices"][0]["delta"]["role"], "assistant");
    let usage_chunk = &events[events.len() - 2].1;
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"]["total_tokens"],
        r["usage"]["total_tokens"]
    );
    assert_eq!(
        events[events.len() - 3].1["choices"][0]["finish_reason"],
        "tool_calls"
    );
    let args: String = events
        .iter()
        .filter_map(|e| {
            e.1["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        json!({"city": "Paris", "days": 3})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_each_apis_error_shape() {
    let cfg = ServerConfig {
        api_key: Some("sekret".into()),
        max_body_bytes: 4096,
        ..Default::default()
    };
    let srv = start(
        "hi",
        SchedulerConfig {
            max_context: 64,
            ..Default::default()
        },
        cfg,
        Duration::ZERO,
    )
    .await;
    let auth = [("Authorization", "Bearer sekret")];
    let xkey = [("x-api-key", "sekret")];
    let msg =
        json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    // 401 without or with a wrong key, in both shapes; /health stays open.
    let (s, _, b) = request(srv.addr, "POST", "/v1/messages", &[], &msg).await;
    assert_eq!(s, 401);
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap()["error"]["type"],
        "authentication_error"
    );
    let (s, _, b) = request(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer wrong")],
        &msg,
    )
    .await;
    assert_eq!(s, 401);
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap()["error"]["code"],
        "invalid_api_key"
    );
    assert_eq!(request(srv.addr, "GET", "/health", &[], "").await.0, 200);
    assert_eq!(
        request(srv.addr, "POST", "/v1/messages", &xkey, &msg)
            .await
            .0,
        200
    );
    let check = |s: u16, b: &str, want: u16, anthropic: bool, needle: &str| {
        assert_eq!(s, want, "{b}");
        let v: Value = serde_json::from_str(b).unwrap_or_else(|_| panic!("not JSON: {b}"));
        if anthropic {
            assert_eq!(v["type"], "error", "{v}");
            assert!(
                v["error"]["type"].is_string()
                    && v["error"]["message"].as_str().unwrap().contains(needle),
                "{v}"
            );
        } else {
            assert!(
                v["error"]["type"].is_string()
                    && v["error"]["message"].as_str().unwrap().contains(needle),
                "{v}"
            );
        }
    };
    for (path, anthropic) in [
        ("/v1/messages", true),
        ("/v1/chat/completions", false),
        ("/v1/responses", false),
    ] {
        let (s, _, b) = request(srv.addr, "POST", path, &auth, "{not json").await;
        check(s, &b, 400, anthropic, "not valid JSON");
        let (s, _, b) = request(srv.addr, "POST", path, &auth, &"x".repeat(5000)).await;
        check(s, &b, 413, anthropic, "larger than");
        let (s, _, b) = request(srv.addr, "POST", path, &auth, r#"{"model": "m"}"#).await;
        check(s, &b, 400, anthropic, "missing field");
        let (s, _, b) = request(
            srv.addr,
            "POST",
            path,
            &auth,
            r#"{"messages": 5, "input": 5, "max_tokens": 3}"#,
        )
        .await;
        check(s, &b, 400, anthropic, "");
        let long = "word ".repeat(100);
        let body = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": long}], "input": long}).to_string();
        let (s, _, b) = request(srv.addr, "POST", path, &auth, &body).await;
        check(
            s,
            &b,
            400,
            anthropic,
            if anthropic {
                "prompt is too long"
            } else {
                "maximum context length"
            },
        );
    }
    let (s, _, b) = request(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        &json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).to_string(),
    )
    .await;
    check(s, &b, 400, false, "invalid type");
    let (s, _, b) = request(
        srv.addr,
        "POST",
        "/v1/messages",
        &auth,
        &json!({"messages": [{"role": "user", "content": "x"}]}).to_string(),
    )
    .await;
    check(s, &b, 400, true, "max_tokens");
    let (s, _, b) = request(srv.addr, "GET", "/v1/unknown", &auth, "").await;
    check(s, &b, 404, false, "Invalid URL");
    let (s, _, b) = request(srv.addr, "GET", "/v1/messages", &auth, "").await;
    check(s, &b, 405, true, "not allowed");
    // Unknown extra fields are ignored.
    let body = json!({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": "u"}, "whatever": [1]});
    let (s, _, _) = request(srv.addr, "POST", "/v1/messages", &auth, &body.to_string()).await;
    assert_eq!(s, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_429_with_retry_after() {
    let sched = SchedulerConfig {
        max_batch: 1,
        max_queue: 1,
        ..Default::default()
    };
    let srv = start(
        &"go ".repeat(200),
        sched,
        ServerConfig::default(),
        Duration::from_millis(5),
    )
    .await;
    let body =
        json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "x"}]});
    let mut handles = Vec::new();
    for _ in 0..6 {
        let b = body.clone();
        let addr = srv.addr;
        handles.push(tokio::spawn(async move {
            request(addr, "POST", "/v1/messages", &[], &b.to_string()).await
        }));
    }
    let mut overloaded = 0;
    for h in handles {
        let (s, head, b) = h.await.unwrap();
        if s == 429 {
            overloaded += 1;
            assert!(head.to_lowercase().contains("retry-after: 1"), "{head}");
            assert_eq!(
                serde_json::from_str::<Value>(&b).unwrap()["error"]["type"],
                "rate_limit_error"
            );
        } else {
            assert_eq!(s, 200, "{b}");
        }
    }
    assert!(overloaded >= 3, "only {overloaded} of 6 were refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn load_32_streaming_clients_across_apis_and_half_cancelled() {
    let sched = SchedulerConfig {
        max_batch: 32,
        max_queue: 64,
        ..Default::default()
    };
    let srv = start(
        &"tok ".repeat(60),
        sched,
        ServerConfig::default(),
        Duration::from_millis(3),
    )
    .await;
    let mut handles = Vec::new();
    for i in 0..32 {
        let addr = srv.addr;
        handles.push(tokio::spawn(async move {
            let (path, body) = match i % 3 {
                0 => ("/v1/messages", json!({"model": "claude", "max_tokens": 40, "stream": true, "messages": [{"role": "user", "content": "hi"}]})),
                1 => ("/v1/chat/completions", json!({"model": "gpt", "max_tokens": 40, "stream": true, "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "hi"}]})),
                _ => ("/v1/responses", json!({"model": "codex", "max_output_tokens": 40, "stream": true, "input": "hi"})),
            };
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            let b = body.to_string();
            let req = format!("POST {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len());
            s.write_all(req.as_bytes()).await.unwrap();
            let cancel = i % 2 == 1;
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                let n = s.read(&mut chunk).await.unwrap();
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
                // Cancel after a few streamed tokens by closing the connection.
                if cancel && String::from_utf8_lossy(&buf).matches("tok").count() >= 3 {
                    return None;
                }
            }
            let text = String::from_utf8_lossy(&buf).into_owned();
            let events = sse_events(text.split_once("\r\n\r\n").unwrap().1);
            let output_tokens = match i % 3 {
                0 => events.iter().find(|e| e.0 == "message_delta").unwrap().1["usage"]["output_tokens"].clone(),
                1 => events.iter().find(|e| e.1.get("usage").is_some_and(|u| !u.is_null())).unwrap().1["usage"]["completion_tokens"].clone(),
                _ => events.iter().find(|e| e.0 == "response.incomplete").unwrap().1["response"]["usage"]["output_tokens"].clone(),
            };
            Some(output_tokens)
        }));
    }
    let mut completed = 0;
    for h in handles {
        if let Some(tokens) = h.await.unwrap() {
            assert_eq!(tokens, 40);
            completed += 1;
        }
    }
    assert_eq!(completed, 16);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while srv.stats.live_sequences.load(Ordering::Relaxed) != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "cancelled sequences were not freed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let m = srv.state.scheduler.metrics();
    assert_eq!(m.requests_cancelled_total.load(Ordering::Relaxed), 16);
    assert!(
        srv.stats.max_batch_items.load(Ordering::Relaxed) > 1,
        "requests were batched"
    );
    // The server stays up and serves again.
    let (s, r) = post(
        srv.addr,
        "/v1/chat/completions",
        json!({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(r["usage"]["completion_tokens"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_pings_while_waiting_and_models_and_metrics() {
    let cfg = ServerConfig {
        keepalive: Duration::from_millis(20),
        ..Default::default()
    };
    let sched = SchedulerConfig {
        prefill_chunk: 1,
        ..Default::default()
    };
    let srv = start("ok", sched, cfg, Duration::from_millis(15)).await;
    // A 20-token prompt prefilled one token per 15 ms step: pings arrive before the text.
    let body = json!({"model": "m", "max_tokens": 2, "stream": true, "messages": [{"role": "user", "content": "one two three four five six"}]});
    let (_, _, text) = request(srv.addr, "POST", "/v1/messages", &[], &body.to_string()).await;
    let events = sse_events(&text);
    let first_ping = events
        .iter()
        .position(|e| e.0 == "ping")
        .expect("no ping during the prefill");
    let first_text = events
        .iter()
        .position(|e| e.0 == "content_block_start")
        .unwrap();
    assert!(first_ping < first_text);
    let (_, _, text) = request(srv.addr, "POST", "/v1/chat/completions", &[], &json!({"max_tokens": 2, "stream": true, "messages": [{"role": "user", "content": "one two three four five six"}]}).to_string()).await;
    assert!(text.contains(": keep-alive"));
    let (s, _, b) = request(srv.addr, "GET", "/v1/models", &[], "").await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["data"][0]["id"], "scripted-model");
    assert_eq!(v["data"][0]["context_length"], 4096);
    let (_, _, b) = request(srv.addr, "GET", "/v1/models/claude-sonnet-4-5", &[], "").await;
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap()["id"],
        "scripted-model"
    );
    let (_, _, b) = request(srv.addr, "GET", "/metrics", &[], "").await;
    assert!(b.contains("capy_requests_total 2"), "{b}");
    assert!(b.contains("capy_queue_depth 0"));
    assert!(b.contains("capy_prefix_cache_hits_total 0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_tool_choice_prefills_the_call_with_injected_parameters_and_history_with_tool_results(
) {
    // The prompt opens `<tool_call><function=get_weather>`; the injected output continues it.
    let srv = start(
        "<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>",
        SchedulerConfig::default(),
        ServerConfig::default(),
        Duration::ZERO,
    )
    .await;
    let body = json!({"model": "m", "max_tokens": 50, "tools": [weather_tool_anthropic()], "tool_choice": {"type": "tool", "name": "get_weather"},
    "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": true, "content": [{"type": "text", "text": "timeout"}]}, {"type": "text", "text": "Try Bern."}]},
    ]});
    let (s, r) = post(srv.addr, "/v1/messages", body).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["stop_reason"], "tool_use");
    assert_eq!(r["content"][0]["type"], "tool_use");
    assert_eq!(r["content"][0]["input"], json!({"city": "Bern"}));
    // Unknown tool names in tool_choice are refused.
    let body = json!({"model": "m", "max_tokens": 5, "tools": [weather_tool_anthropic()], "tool_choice": {"type": "tool", "name": "nope"}, "messages": [{"role": "user", "content": "x"}]});
    let (s, r) = post(srv.addr, "/v1/messages", body).await;
    assert_eq!(s, 400, "{r}");
}

const LONG_THOUGHT: &str = "First I consider the question from every side, then I weigh each option slowly, and only then do I answer.";

/// The scripted model's tokens for LONG_THOUGHT, split as a thinking budget of `budget`
/// splits them: (thinking tokens, tokens under the forced close, answer tokens).
fn budget_split(budget: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let tok = tokenizer();
    let script = tok.encode(LONG_THOUGHT, false).unwrap();
    let close = tok.encode("\n</think>\n\n", false).unwrap();
    (
        script[..budget].to_vec(),
        close.clone(),
        script[budget + close.len()..].to_vec(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_budget_closes_thinking_early_in_every_api() {
    let srv = start(
        LONG_THOUGHT,
        SchedulerConfig::default(),
        ServerConfig::default(),
        Duration::ZERO,
    )
    .await;
    let tok = tokenizer();
    let budget = 5;
    let (thought, close, answer) = budget_split(budget);
    let thought_text = tok.decode(&thought, true).unwrap();
    let answer_text = tok.decode(&answer, true).unwrap();
    // Every generated token (thinking, the 3 forced ones, the answer, the end token) is output.
    let output_tokens = thought.len() + close.len() + answer.len() + 1;
    // The block's tokens: the budget, then the forced "\n" and "</think>".
    let reasoning_tokens = budget + 2;

    // Anthropic: thinking.budget_tokens.
    let (status, m) = post(
        srv.addr,
        "/v1/messages",
        json!({"model": "claude-sonnet-4", "max_tokens": 200, "thinking": {"type": "enabled", "budget_tokens": budget},
               "messages": [{"role": "user", "content": "Think, then answer."}]}),
    )
    .await;
    assert_eq!(status, 200, "{m}");
    let content = m["content"].as_array().unwrap();
    assert_eq!(content.len(), 2, "{m}");
    assert_eq!(content[0]["type"], "thinking");
    assert_eq!(
        content[0]["thinking"].as_str().unwrap().trim(),
        thought_text.trim()
    );
    assert_eq!(content[1]["type"], "text");
    assert_eq!(
        content[1]["text"].as_str().unwrap().trim(),
        answer_text.trim()
    );
    assert_eq!(m["stop_reason"], "end_turn");
    assert_eq!(m["usage"]["output_tokens"], output_tokens);

    // Chat completions: the budget in chat_template_kwargs, and at the top level.
    for extra in [
        json!({"chat_template_kwargs": {"thinking_budget": budget}}),
        json!({"thinking_budget": budget, "chat_template_kwargs": {"thinking_budget": 1000}}),
    ] {
        let mut body = json!({"model": "gpt-4o", "max_tokens": 200,
                              "messages": [{"role": "user", "content": "Think, then answer."}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, c) = post(srv.addr, "/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{c}");
        let msg = &c["choices"][0]["message"];
        assert_eq!(
            msg["reasoning_content"].as_str().unwrap().trim(),
            thought_text.trim()
        );
        assert_eq!(msg["content"].as_str().unwrap().trim(), answer_text.trim());
        assert_eq!(c["choices"][0]["finish_reason"], "stop");
        assert_eq!(c["usage"]["completion_tokens"], output_tokens);
        assert_eq!(
            c["usage"]["completion_tokens_details"]["reasoning_tokens"],
            reasoning_tokens
        );
    }

    // Responses, streaming: the reasoning item is done before the message starts.
    let (status, _, text) = request(
        srv.addr,
        "POST",
        "/v1/responses",
        &[],
        &json!({"model": "gpt-5-codex", "stream": true, "input": "Think, then answer.",
                "chat_template_kwargs": {"thinking_budget": budget}})
        .to_string(),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    let done: Vec<&Value> = events
        .iter()
        .filter(|e| e.1["type"] == "response.output_item.done")
        .map(|e| &e.1["item"])
        .collect();
    assert_eq!(done.len(), 2, "{text}");
    assert_eq!(done[0]["type"], "reasoning");
    assert_eq!(
        done[0]["content"][0]["text"].as_str().unwrap().trim(),
        thought_text.trim()
    );
    assert_eq!(done[1]["type"], "message");
    assert_eq!(
        done[1]["content"][0]["text"].as_str().unwrap().trim(),
        answer_text.trim()
    );
    let completed = &events.last().unwrap().1;
    assert_eq!(completed["type"], "response.completed");
    assert_eq!(
        completed["response"]["usage"]["output_tokens"],
        output_tokens
    );
    assert_eq!(
        completed["response"]["usage"]["output_tokens_details"]["reasoning_tokens"],
        reasoning_tokens
    );

    // Without a budget the same model thinks through the whole script.
    let (_, c) = post(
        srv.addr,
        "/v1/chat/completions",
        json!({"model": "m", "messages": [{"role": "user", "content": "Think."}]}),
    )
    .await;
    assert_eq!(
        c["choices"][0]["message"]["reasoning_content"]
            .as_str()
            .unwrap()
            .trim(),
        LONG_THOUGHT
    );

    // A bad budget is the API's own 400.
    let (status, e) = post(
        srv.addr,
        "/v1/chat/completions",
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
               "chat_template_kwargs": {"thinking_budget": "lots"}}),
    )
    .await;
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["param"], "chat_template_kwargs.thinking_budget");
    let (status, e) = post(
        srv.addr,
        "/v1/messages",
        json!({"model": "m", "max_tokens": 10, "thinking": {"type": "enabled", "budget_tokens": -1},
               "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["type"], "error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("budget_tokens"),
        "{e}"
    );
}

/// A repeated conversation is resumed from the prefix cache, and each API reports the resumed
/// prompt tokens in its own usage field (chat `prompt_tokens_details.cached_tokens`, Responses
/// `input_tokens_details.cached_tokens`, Messages `cache_read_input_tokens` beside the
/// uncached `input_tokens`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_reports_prefix_cache_hits_in_all_three_apis() {
    use capy_engine::cache::{CacheConfig, CacheIdentity};
    let mut cache = CacheConfig::new(CacheIdentity {
        model_id: "scripted-model".into(),
        format: "test".into(),
    });
    cache.block_tokens = 8;
    cache.capture_every_blocks = 1;
    cache.ram_bytes = 64 << 20;
    let sched = SchedulerConfig {
        prefix_cache: Some(cache),
        ..SchedulerConfig::default()
    };
    let srv = start(
        "Hello there.",
        sched,
        ServerConfig::default(),
        Duration::ZERO,
    )
    .await;
    let long = "the capybara is the largest living rodent ".repeat(12);

    // (path, body, (uncached input, cached) from the usage object)
    type Split = fn(&Value) -> (u64, u64);
    let chat: Split = |u| {
        let cached = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        (u["prompt_tokens"].as_u64().unwrap() - cached, cached)
    };
    let responses: Split = |u| {
        let cached = u["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
        (u["input_tokens"].as_u64().unwrap() - cached, cached)
    };
    let messages: Split = |u| {
        (
            u["input_tokens"].as_u64().unwrap(),
            u["cache_read_input_tokens"].as_u64().unwrap(),
        )
    };
    let cases: [(&str, Value, Split); 3] = [
        (
            "/v1/chat/completions",
            json!({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": format!("chat {long}")}]}),
            chat,
        ),
        (
            "/v1/responses",
            json!({"model": "m", "max_output_tokens": 4, "input": format!("responses {long}")}),
            responses,
        ),
        (
            "/v1/messages",
            json!({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": format!("messages {long}")}]}),
            messages,
        ),
    ];
    for (path, body, split) in cases {
        let (status, first) = post(srv.addr, path, body.clone()).await;
        assert_eq!(status, 200, "{path}: {first}");
        let (uncached_1, cached_1) = split(&first["usage"]);
        assert_eq!(
            cached_1, 0,
            "{path}: a new prompt has nothing cached: {first}"
        );
        let (status, second) = post(srv.addr, path, body).await;
        assert_eq!(status, 200, "{path}: {second}");
        let (uncached_2, cached_2) = split(&second["usage"]);
        assert!(
            cached_2 >= 8,
            "{path}: the repeat should resume at least one block: {second}"
        );
        assert_eq!(
            uncached_2 + cached_2,
            uncached_1,
            "{path}: the same prompt, split into cached and computed: {second}"
        );
    }
    let (_, _, metrics) = request(srv.addr, "GET", "/metrics", &[], "").await;
    assert!(
        !metrics.contains("capy_prefix_cache_hits_total 0\n"),
        "{metrics}"
    );
}
