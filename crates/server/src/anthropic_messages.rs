//! `POST /v1/messages` and `/v1/messages/count_tokens`: the Anthropic Messages adapter.
//! `anthropic-version` and `anthropic-beta` headers are accepted and ignored.

use crate::error::{parse_body, ApiError, Flavor};
use crate::generate::{Collected, OutputEvent, StopReason, UsageReport};
use crate::normalize::{self, content_text, function_tool, ChatRequest, ToolChoice};
use crate::parser::ParsedEvent;
use crate::sse::{self, json_event, StreamAdapter};
use crate::state::{new_id, AppState};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use capy_engine::sampling::SamplingParams;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

const FLAVOR: Flavor = Flavor::Anthropic;
/// Opaque signature of thinking blocks (clients send it back; this server does not check it).
const THINKING_SIGNATURE: &str = "capy-flash-local-thinking";

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub system: Option<Value>,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub thinking: Option<Value>,
    /// `{"user_id"}`: the prefix cache's session key when no session header is sent.
    #[serde(default)]
    pub metadata: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Value,
}

#[derive(Debug, Deserialize)]
pub struct Tool {
    pub name: String,
    #[serde(default)]
    pub description: Option<Value>,
    #[serde(default)]
    pub input_schema: Option<Value>,
}

fn to_chat_request(r: MessagesRequest, for_counting: bool) -> Result<ChatRequest, ApiError> {
    let max_tokens = match r.max_tokens {
        Some(n) => Some(n),
        None if for_counting => None,
        None => return Err(ApiError::invalid(FLAVOR, "max_tokens: Field required")),
    };
    let mut messages = Vec::new();
    if let Some(system) = &r.system {
        messages.push(json!({"role": "system", "content": content_text(system)}));
    }
    for m in r.messages {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::invalid(
                FLAVOR,
                format!(
                    "messages: role must be \"user\" or \"assistant\", got \"{}\"",
                    m.role
                ),
            ));
        }
        let blocks = match m.content {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b,
            other => {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!("messages: content must be a string or a list of blocks, got {other}"),
                ))
            }
        };
        let mut text = Vec::new();
        let mut thinking = Vec::new();
        let mut calls = Vec::new();
        for b in blocks {
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.push(b.get("text").and_then(Value::as_str).unwrap_or_default().to_string()),
                Some("thinking") => thinking.push(b.get("thinking").and_then(Value::as_str).unwrap_or_default().to_string()),
                Some("redacted_thinking") => {}
                Some("tool_use") => calls.push(json!({
                    "id": b["id"], "type": "function",
                    "function": {"name": b["name"], "arguments": normalize::arguments_object(&b["input"])},
                })),
                Some("tool_result") => {
                    let mut content = b.get("content").map(content_text).unwrap_or_default();
                    if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                        content = format!("Error: {content}");
                    }
                    messages.push(json!({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content}));
                }
                Some("image") | Some("document") => {
                    return Err(ApiError::invalid(FLAVOR, "image and document blocks are not supported by this text-only model"));
                }
                _ => return Err(ApiError::invalid(FLAVOR, format!("messages: unknown content block {b}"))),
            }
        }
        if text.is_empty() && thinking.is_empty() && calls.is_empty() {
            continue;
        }
        let mut msg = json!({"role": m.role, "content": text.join("\n")});
        if !thinking.is_empty() {
            msg["reasoning_content"] = Value::String(thinking.join("\n"));
        }
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        messages.push(msg);
    }
    let tools = r
        .tools
        .unwrap_or_default()
        .iter()
        .map(|t| function_tool(&t.name, t.description.as_ref(), t.input_schema.as_ref()))
        .collect();
    let tool_choice = match r
        .tool_choice
        .as_ref()
        .and_then(|c| c.get("type"))
        .and_then(Value::as_str)
    {
        None | Some("auto") => ToolChoice::Auto,
        Some("none") => ToolChoice::None,
        Some("any") => ToolChoice::Required,
        Some("tool") => match r
            .tool_choice
            .as_ref()
            .and_then(|c| c.get("name"))
            .and_then(Value::as_str)
        {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => {
                return Err(ApiError::invalid(
                    FLAVOR,
                    "tool_choice.name: Field required",
                ))
            }
        },
        Some(other) => {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("tool_choice.type must be auto, any, tool or none; got \"{other}\""),
            ))
        }
    };
    // No `thinking` field means no thinking, as in the Anthropic API.
    let thinking_type = r
        .thinking
        .as_ref()
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str);
    let enable_thinking = Some(matches!(thinking_type, Some("enabled" | "adaptive")));
    let thinking_budget = match r.thinking.as_ref().and_then(|t| t.get("budget_tokens")) {
        None | Some(Value::Null) => None,
        Some(_) if enable_thinking == Some(false) => None,
        Some(v) => Some(v.as_u64().map(|n| n as usize).ok_or_else(|| {
            ApiError::invalid(
                FLAVOR,
                format!("thinking.budget_tokens: Input should be a non-negative integer, got {v}"),
            )
        })?),
    };
    let d = SamplingParams::default();
    let sampling = SamplingParams {
        temperature: r.temperature.unwrap_or(d.temperature),
        top_p: r.top_p.unwrap_or(d.top_p),
        top_k: r.top_k.filter(|&k| k > 0).unwrap_or(0) as usize,
        ..d
    };
    sampling
        .validate()
        .map_err(|m| ApiError::invalid(FLAVOR, m))?;
    Ok(ChatRequest {
        messages,
        tools,
        tool_choice,
        enable_thinking,
        thinking_budget,
        template_kwargs: Default::default(),
        sampling,
        max_tokens,
        stop: r.stop_sequences.unwrap_or_default(),
        cache_key: None,
    })
}

fn record_session(state: &AppState, headers: &HeaderMap) {
    if let Some(id) = headers
        .get("x-claude-code-session-id")
        .and_then(|v| v.to_str().ok())
    {
        state.record_session(id);
    }
}

pub async fn handle(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    AppState::count(&state.http.messages);
    record_session(&state, &headers);
    let req: MessagesRequest = parse_body(FLAVOR, body)?;
    let stream = req.stream;
    let user_id = req
        .metadata
        .as_ref()
        .and_then(|m| m.get("user_id"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let mut chat = to_chat_request(req, false)?;
    chat.cache_key = normalize::session_key(&headers, &[user_id.as_deref()]);
    let generation = normalize::start(&state, chat, FLAVOR)?;
    let id = new_id("msg_");
    let model = state.model_id.clone();
    if stream {
        let input_tokens = generation.prompt_tokens();
        let adapter = MessagesStream {
            id,
            model,
            input_tokens,
            cached_tokens: 0,
            open_block: None,
            next_index: 0,
            tool_blocks: Vec::new(),
        };
        return Ok(sse::respond(generation, adapter, state.config.keepalive));
    }
    let c = normalize::collect(generation, FLAVOR).await?;
    Ok(Json(message_json(&id, &model, &c)).into_response())
}

pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    AppState::count(&state.http.count_tokens);
    record_session(&state, &headers);
    let req: MessagesRequest = parse_body(FLAVOR, body)?;
    let chat = to_chat_request(req, true)?;
    let n = normalize::count_prompt_tokens(&state, chat, FLAVOR)?;
    Ok(Json(json!({"input_tokens": n})).into_response())
}

fn usage_json(u: &UsageReport) -> Value {
    json!({
        "input_tokens": u.input_tokens - u.cached_tokens,
        "output_tokens": u.output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
    })
}

fn stop_sequence(stop: &StopReason) -> Value {
    match stop {
        StopReason::StopSequence(s) => Value::String(s.clone()),
        _ => Value::Null,
    }
}

fn message_json(id: &str, model: &str, c: &Collected) -> Value {
    let mut content = Vec::new();
    if !c.reasoning.is_empty() {
        content.push(
            json!({"type": "thinking", "thinking": c.reasoning, "signature": THINKING_SIGNATURE}),
        );
    }
    if !c.text.is_empty() {
        content.push(json!({"type": "text", "text": c.text}));
    }
    for t in &c.tool_calls {
        let input: Value = serde_json::from_str(&t.arguments).unwrap_or_else(|_| json!({}));
        content.push(json!({"type": "tool_use", "id": format!("toolu_{}", t.id), "name": t.name, "input": input}));
    }
    json!({
        "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": c.stop.anthropic(), "stop_sequence": stop_sequence(&c.stop), "usage": usage_json(&c.usage),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
    Tool,
}

struct MessagesStream {
    id: String,
    model: String,
    input_tokens: usize,
    /// Prompt tokens resumed from the prefix cache (known at admission, before `start`).
    cached_tokens: usize,
    /// The open content block and its index.
    open_block: Option<(Block, usize)>,
    next_index: usize,
    /// Content-block index of each tool call (by call index).
    tool_blocks: Vec<usize>,
}

fn ev(name: &str, data: Value) -> Event {
    json_event(Some(name), &data)
}

impl MessagesStream {
    fn close_block(&mut self, out: &mut Vec<Event>) {
        if let Some((kind, index)) = self.open_block.take() {
            if kind == Block::Thinking {
                out.push(ev("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta", "signature": THINKING_SIGNATURE}})));
            }
            out.push(ev(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    /// Opens a block of `kind` unless one is open; returns its index.
    fn ensure_block(&mut self, kind: Block, start: Value, out: &mut Vec<Event>) -> usize {
        if let Some((k, i)) = self.open_block {
            if k == kind && kind != Block::Tool {
                return i;
            }
        }
        self.close_block(out);
        let index = self.next_index;
        self.next_index += 1;
        out.push(ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": start}),
        ));
        self.open_block = Some((kind, index));
        index
    }
}

impl StreamAdapter for MessagesStream {
    fn wants_cached_tokens(&self) -> bool {
        true
    }

    fn set_cached_tokens(&mut self, cached: usize) {
        self.cached_tokens = cached.min(self.input_tokens);
    }

    fn start(&mut self) -> Vec<Event> {
        // Like Anthropic's: `input_tokens` are the uncached ones.
        let input = self.input_tokens - self.cached_tokens;
        vec![ev(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": input, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": self.cached_tokens},
            }}),
        )]
    }

    fn on_event(&mut self, event: OutputEvent) -> Vec<Event> {
        let mut out = Vec::new();
        match event {
            OutputEvent::Parsed(ParsedEvent::Reasoning(t)) => {
                let i = self.ensure_block(
                    Block::Thinking,
                    json!({"type": "thinking", "thinking": "", "signature": ""}),
                    &mut out,
                );
                out.push(ev("content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": {"type": "thinking_delta", "thinking": t}})));
            }
            OutputEvent::Parsed(ParsedEvent::Text(t)) => {
                let i =
                    self.ensure_block(Block::Text, json!({"type": "text", "text": ""}), &mut out);
                out.push(ev("content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": t}})));
            }
            OutputEvent::Parsed(ParsedEvent::ToolCallBegin { id, name, .. }) => {
                let i = self.ensure_block(Block::Tool, json!({"type": "tool_use", "id": format!("toolu_{id}"), "name": name, "input": {}}), &mut out);
                self.tool_blocks.push(i);
            }
            OutputEvent::Parsed(ParsedEvent::ToolCallArguments { index, delta }) => {
                if let Some(&i) = self.tool_blocks.get(index) {
                    out.push(ev("content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": delta}})));
                }
            }
            OutputEvent::Parsed(ParsedEvent::ToolCallEnd { .. }) => self.close_block(&mut out),
            OutputEvent::Done { stop, usage } => {
                self.close_block(&mut out);
                let mut u = usage_json(&usage);
                u["input_tokens"] = json!(usage.input_tokens - usage.cached_tokens);
                out.push(ev(
                    "message_delta",
                    json!({"type": "message_delta", "delta": {"stop_reason": stop.anthropic(), "stop_sequence": stop_sequence(&stop)}, "usage": u}),
                ));
                out.push(ev("message_stop", json!({"type": "message_stop"})));
            }
            OutputEvent::Failed(e) => {
                out.push(ev(
                    "error",
                    json!({"type": "error", "error": {"type": "api_error", "message": e}}),
                ));
            }
        }
        out
    }

    fn keepalive(&mut self) -> Event {
        ev("ping", json!({"type": "ping"}))
    }
}
