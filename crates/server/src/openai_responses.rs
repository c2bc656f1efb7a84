//! `POST /v1/responses` and `/v1/responses/input_tokens`: the OpenAI Responses adapter, with
//! the event sequence Codex reads.

use crate::error::{parse_body, ApiError, Flavor};
use crate::generate::{Collected, OutputEvent, StopReason, UsageReport};
use crate::normalize::{self, arguments_object, content_text, function_tool, ChatRequest};
use crate::openai_chat::{tool_choice, SamplingFields};
use crate::parser::ParsedEvent;
use crate::sse::{self, comment, json_event, StreamAdapter};
use crate::state::{new_id, unix_now, AppState};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::sync::Arc;

const FLAVOR: Flavor = Flavor::OpenAi;

#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub input: Value,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub max_output_tokens: Option<usize>,
    #[serde(default)]
    pub reasoning: Option<Value>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// The prefix cache's session key (then `user`) when no session header is sent.
    #[serde(default)]
    pub prompt_cache_key: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
}

fn to_chat_request(r: &ResponsesRequest) -> Result<ChatRequest, ApiError> {
    let mut messages: Vec<Value> = Vec::new();
    if let Some(i) = &r.instructions {
        messages.push(json!({"role": "system", "content": i}));
    }
    let items = match &r.input {
        Value::String(s) => vec![json!({"type": "message", "role": "user", "content": s})],
        Value::Array(a) => a.clone(),
        other => {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("input must be a string or a list of items, got {other}"),
            )
            .with_param("input"))
        }
    };
    for item in items {
        let kind =
            item.get("type")
                .and_then(Value::as_str)
                .unwrap_or(if item.get("role").is_some() {
                    "message"
                } else {
                    ""
                });
        match kind {
            "message" => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer") | Some("system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    other => return Err(ApiError::invalid(FLAVOR, format!("input message role must be user, assistant, system or developer; got {other:?}")).with_param("input")),
                };
                let content = item.get("content").map(content_text).unwrap_or_default();
                messages.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let call = json!({"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments_object(&item["arguments"])}});
                // Consecutive calls belong to one assistant turn.
                match messages.last_mut() {
                    Some(last)
                        if last["role"] == "assistant" && last.get("tool_calls").is_some() =>
                    {
                        if let Some(calls) = last["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    Some(last) if last["role"] == "assistant" => last["tool_calls"] = json!([call]),
                    _ => messages
                        .push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let output = item.get("output").map(content_text).unwrap_or_default();
                messages.push(
                    json!({"role": "tool", "tool_call_id": item["call_id"], "content": output}),
                );
            }
            "reasoning" => {
                let text: String = item
                    .get("content")
                    .and_then(Value::as_array)
                    .map(|parts| {
                        parts
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .collect::<Vec<_>>()
                            .join("\n")
                    })
                    .unwrap_or_default();
                if !text.is_empty() {
                    messages.push(
                        json!({"role": "assistant", "content": "", "reasoning_content": text}),
                    );
                }
            }
            other => {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!("unsupported input item type \"{other}\""),
                )
                .with_param("input"))
            }
        }
    }
    // Assistant turns that carried only reasoning are merged into the next assistant message.
    let mut merged: Vec<Value> = Vec::with_capacity(messages.len());
    for m in messages {
        if let Some(prev) = merged.last_mut() {
            if prev["role"] == "assistant"
                && m["role"] == "assistant"
                && prev.get("tool_calls").is_none()
                && prev["content"] == ""
            {
                let reasoning = prev.get("reasoning_content").cloned();
                *prev = m;
                if let (Some(r), None) = (reasoning, prev.get("reasoning_content")) {
                    prev["reasoning_content"] = r;
                }
                continue;
            }
        }
        merged.push(m);
    }
    let tools = r
        .tools
        .iter()
        .flatten()
        .filter(|t| t.get("type").and_then(Value::as_str) == Some("function"))
        .filter_map(|t| {
            Some(function_tool(
                t.get("name")?.as_str()?,
                t.get("description"),
                t.get("parameters"),
            ))
        })
        .collect();
    let effort = r
        .reasoning
        .as_ref()
        .and_then(|v| v.get("effort"))
        .and_then(Value::as_str);
    let normalize::Reasoning {
        template_kwargs: kwargs,
        enable_thinking,
        budget: thinking_budget,
    } = normalize::openai_reasoning(r.chat_template_kwargs.clone(), effort, None, FLAVOR)?;
    Ok(ChatRequest {
        messages: merged,
        tools,
        tool_choice: tool_choice(r.tool_choice.as_ref())?,
        enable_thinking,
        thinking_budget,
        template_kwargs: kwargs,
        sampling: r.sampling.to_params(FLAVOR)?,
        max_tokens: r.max_output_tokens,
        stop: Vec::new(),
        cache_key: None,
    })
}

fn usage_json(u: &UsageReport) -> Value {
    json!({
        "input_tokens": u.input_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.input_tokens + u.output_tokens,
    })
}

/// The response object; `output`, `status` and `usage` vary over its life.
fn response_json(
    id: &str,
    model: &str,
    created: u64,
    req: &Meta,
    status: &str,
    output: Vec<Value>,
    usage: Option<&UsageReport>,
) -> Value {
    json!({
        "id": id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "usage": usage.map(usage_json),
        "error": null,
        "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": true, "previous_response_id": null,
        "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
        "reasoning": {"effort": null, "summary": null}, "store": false, "metadata": {},
    })
}

fn status_of(stop: &StopReason) -> &'static str {
    if *stop == StopReason::MaxTokens {
        "incomplete"
    } else {
        "completed"
    }
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"id": id, "type": "message", "status": status, "role": "assistant",
           "content": if status == "in_progress" { json!([]) } else { json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]) }})
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"id": id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
}

fn function_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"id": id, "type": "function_call", "status": status, "call_id": call_id, "name": name, "arguments": arguments})
}

/// Request fields echoed in the response object.
#[derive(Clone)]
struct Meta {
    instructions: Option<String>,
    max_output_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
}

pub async fn handle(
    State(state): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    AppState::count(&state.http.responses);
    let req: ResponsesRequest = parse_body(FLAVOR, body)?;
    let meta = Meta {
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        temperature: req.sampling.temperature,
        top_p: req.sampling.top_p,
    };
    let mut chat = to_chat_request(&req)?;
    chat.cache_key = normalize::session_key(
        &headers,
        &[req.prompt_cache_key.as_deref(), req.user.as_deref()],
    );
    let generation = normalize::start(&state, chat, FLAVOR)?;
    let id = new_id("resp_");
    let model = state.model_id.clone();
    let created = unix_now();
    if req.stream {
        let adapter = ResponsesStream {
            id,
            model,
            created,
            meta,
            seq: 0,
            output: Vec::new(),
            open: None,
            calls: Vec::new(),
        };
        return Ok(sse::respond(generation, adapter, state.config.keepalive));
    }
    let c = normalize::collect(generation, FLAVOR).await?;
    Ok(Json(collected_json(&id, &model, created, &meta, &c)).into_response())
}

pub async fn input_tokens(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    AppState::count(&state.http.count_tokens);
    let req: ResponsesRequest = parse_body(FLAVOR, body)?;
    let chat = to_chat_request(&req)?;
    let n = normalize::count_prompt_tokens(&state, chat, FLAVOR)?;
    Ok(Json(json!({"object": "response.input_tokens", "input_tokens": n})).into_response())
}

fn collected_json(id: &str, model: &str, created: u64, meta: &Meta, c: &Collected) -> Value {
    let mut output = Vec::new();
    if !c.reasoning.is_empty() {
        output.push(reasoning_item(&new_id("rs_"), &c.reasoning));
    }
    if !c.text.is_empty() || c.tool_calls.is_empty() {
        output.push(message_item(&new_id("msg_"), &c.text, "completed"));
    }
    for t in &c.tool_calls {
        output.push(function_item(
            &format!("fc_{}", t.id),
            &format!("call_{}", t.id),
            &t.name,
            &t.arguments,
            "completed",
        ));
    }
    let mut r = response_json(
        id,
        model,
        created,
        meta,
        status_of(&c.stop),
        output,
        Some(&c.usage),
    );
    r["output_text"] = Value::String(c.text.clone());
    r
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ItemKind {
    Reasoning,
    Message,
    Function,
}

/// The item being streamed.
struct OpenItem {
    kind: ItemKind,
    id: String,
    output_index: usize,
    text: String,
    call_id: String,
    name: String,
}

struct ResponsesStream {
    id: String,
    model: String,
    created: u64,
    meta: Meta,
    seq: u64,
    /// Finished items, for `response.completed`.
    output: Vec<Value>,
    open: Option<OpenItem>,
    /// Output index of each tool call (by call index) — calls stream one at a time.
    calls: Vec<usize>,
}

impl ResponsesStream {
    fn ev(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = Value::String(kind.to_string());
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        json_event(Some(kind), &data)
    }

    fn close_item(&mut self, out: &mut Vec<Event>) {
        let Some(item) = self.open.take() else { return };
        let (id, oi) = (item.id.clone(), item.output_index);
        let done = match item.kind {
            ItemKind::Reasoning => {
                let e = self.ev("response.reasoning_text.done", json!({"item_id": id, "output_index": oi, "content_index": 0, "text": item.text}));
                out.push(e);
                reasoning_item(&id, &item.text)
            }
            ItemKind::Message => {
                let e = self.ev("response.output_text.done", json!({"item_id": id, "output_index": oi, "content_index": 0, "text": item.text, "logprobs": []}));
                out.push(e);
                let part = json!({"type": "output_text", "text": item.text, "annotations": [], "logprobs": []});
                let e = self.ev(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": oi, "content_index": 0, "part": part}),
                );
                out.push(e);
                message_item(&id, &item.text, "completed")
            }
            ItemKind::Function => {
                let e = self.ev(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": oi, "arguments": item.text}),
                );
                out.push(e);
                function_item(&id, &item.call_id, &item.name, &item.text, "completed")
            }
        };
        let e = self.ev(
            "response.output_item.done",
            json!({"output_index": oi, "item": done}),
        );
        out.push(e);
        self.output.push(done);
    }

    fn open_item(&mut self, kind: ItemKind, call: Option<(&str, &str)>, out: &mut Vec<Event>) {
        if self
            .open
            .as_ref()
            .is_some_and(|o| o.kind == kind && kind != ItemKind::Function)
        {
            return;
        }
        self.close_item(out);
        let output_index = self.output.len();
        let (id, added) = match (kind, call) {
            (ItemKind::Reasoning, _) => {
                let id = new_id("rs_");
                let item = json!({"id": id, "type": "reasoning", "summary": [], "content": []});
                (id, item)
            }
            (ItemKind::Function, Some((cid, name))) => {
                let id = format!("fc_{cid}");
                let item = function_item(&id, &format!("call_{cid}"), name, "", "in_progress");
                (id, item)
            }
            _ => {
                let id = new_id("msg_");
                let item = message_item(&id, "", "in_progress");
                (id, item)
            }
        };
        let e = self.ev(
            "response.output_item.added",
            json!({"output_index": output_index, "item": added}),
        );
        out.push(e);
        if kind == ItemKind::Message {
            let e = self.ev(
                "response.content_part.added",
                json!({"item_id": id, "output_index": output_index, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
            );
            out.push(e);
        }
        let (call_id, name) = call
            .map(|(c, n)| (format!("call_{c}"), n.to_string()))
            .unwrap_or_default();
        self.open = Some(OpenItem {
            kind,
            id,
            output_index,
            text: String::new(),
            call_id,
            name,
        });
    }
}

impl StreamAdapter for ResponsesStream {
    fn start(&mut self) -> Vec<Event> {
        let r = response_json(
            &self.id,
            &self.model,
            self.created,
            &self.meta,
            "in_progress",
            vec![],
            None,
        );
        let a = self.ev("response.created", json!({"response": r}));
        let b = self.ev("response.in_progress", json!({"response": r}));
        vec![a, b]
    }

    fn on_event(&mut self, event: OutputEvent) -> Vec<Event> {
        let mut out = Vec::new();
        match event {
            OutputEvent::Parsed(ParsedEvent::Reasoning(t)) => {
                self.open_item(ItemKind::Reasoning, None, &mut out);
                let o = self.open.as_mut().expect("opened above");
                o.text.push_str(&t);
                let (id, oi) = (o.id.clone(), o.output_index);
                let e = self.ev(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": oi, "content_index": 0, "delta": t}),
                );
                out.push(e);
            }
            OutputEvent::Parsed(ParsedEvent::Text(t)) => {
                self.open_item(ItemKind::Message, None, &mut out);
                let o = self.open.as_mut().expect("opened above");
                o.text.push_str(&t);
                let (id, oi) = (o.id.clone(), o.output_index);
                let e = self.ev("response.output_text.delta", json!({"item_id": id, "output_index": oi, "content_index": 0, "delta": t, "logprobs": []}));
                out.push(e);
            }
            OutputEvent::Parsed(ParsedEvent::ToolCallBegin { id, name, .. }) => {
                self.open_item(ItemKind::Function, Some((&id, &name)), &mut out);
                self.calls.push(self.output.len());
            }
            OutputEvent::Parsed(ParsedEvent::ToolCallArguments { delta, .. }) => {
                if let Some(o) = self.open.as_mut().filter(|o| o.kind == ItemKind::Function) {
                    o.text.push_str(&delta);
                    let (id, oi) = (o.id.clone(), o.output_index);
                    let e = self.ev(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": oi, "delta": delta}),
                    );
                    out.push(e);
                }
            }
            OutputEvent::Parsed(ParsedEvent::ToolCallEnd { .. }) => self.close_item(&mut out),
            OutputEvent::Done { stop, usage } => {
                self.close_item(&mut out);
                let status = status_of(&stop);
                let r = response_json(
                    &self.id,
                    &self.model,
                    self.created,
                    &self.meta,
                    status,
                    self.output.clone(),
                    Some(&usage),
                );
                let kind = if status == "incomplete" {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                let e = self.ev(kind, json!({"response": r}));
                out.push(e);
            }
            OutputEvent::Failed(message) => {
                let mut r = response_json(
                    &self.id,
                    &self.model,
                    self.created,
                    &self.meta,
                    "failed",
                    self.output.clone(),
                    None,
                );
                r["error"] = json!({"code": "server_error", "message": message});
                let e = self.ev("response.failed", json!({"response": r}));
                out.push(e);
            }
        }
        out
    }

    fn keepalive(&mut self) -> Event {
        comment("keep-alive")
    }
}
