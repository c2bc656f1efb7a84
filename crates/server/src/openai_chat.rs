//! `POST /v1/chat/completions`: the OpenAI chat completions adapter.

use crate::error::{parse_body, ApiError, Flavor};
use crate::generate::{Collected, OutputEvent, UsageReport};
use crate::normalize::{
    self, arguments_object, content_text, function_tool, ChatRequest, ToolChoice,
};
use crate::parser::ParsedEvent;
use crate::sse::{self, comment, json_event, StreamAdapter};
use crate::state::{new_id, unix_now, AppState};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use capy_engine::sampling::SamplingParams;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::sync::Arc;

const FLAVOR: Flavor = Flavor::OpenAi;

#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub n: Option<usize>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    /// Tokens the model may think before its thinking is closed (also accepted as
    /// `chat_template_kwargs.thinking_budget`).
    #[serde(default)]
    pub thinking_budget: Option<usize>,
    /// The end user; the prefix cache's session key when no session header is sent.
    #[serde(default)]
    pub user: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Value>,
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub reasoning_content: Option<String>,
    #[serde(default)]
    pub reasoning: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// Sampling fields shared by the OpenAI APIs (`top_k`, `min_p`, `repetition_penalty` are the
/// common extensions of local servers).
#[derive(Debug, Deserialize, Default)]
pub struct SamplingFields {
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub logit_bias: Option<HashMap<String, f32>>,
    #[serde(default)]
    pub seed: Option<u64>,
}

impl SamplingFields {
    pub fn to_params(&self, flavor: Flavor) -> Result<SamplingParams, ApiError> {
        let d = SamplingParams::default();
        let mut logit_bias = HashMap::new();
        for (k, v) in self.logit_bias.iter().flatten() {
            let id: u32 = k.parse().map_err(|_| {
                ApiError::invalid(
                    flavor,
                    format!("logit_bias keys must be token ids, got \"{k}\""),
                )
                .with_param("logit_bias")
            })?;
            logit_bias.insert(id, *v);
        }
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.filter(|&k| k > 0).unwrap_or(0) as usize,
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            logit_bias,
            seed: self.seed,
        };
        p.validate().map_err(|m| ApiError::invalid(flavor, m))?;
        Ok(p)
    }
}

pub fn tool_choice(v: Option<&Value>) -> Result<ToolChoice, ApiError> {
    Ok(match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!(
                    "tool_choice must be auto, none, required or a named function; got \"{other}\""
                ),
                )
                .with_param("tool_choice"))
            }
        },
        Some(o) => match o
            .get("function")
            .and_then(|f| f.get("name"))
            .or_else(|| o.get("name"))
            .and_then(Value::as_str)
        {
            Some(name) => ToolChoice::Named(name.to_string()),
            None => {
                return Err(
                    ApiError::invalid(FLAVOR, "tool_choice object needs function.name")
                        .with_param("tool_choice"),
                )
            }
        },
    })
}

/// The shared request of a chat completion body, and whether usage is streamed.
pub fn to_chat_request(r: ChatCompletionRequest) -> Result<(ChatRequest, bool), ApiError> {
    if r.n.unwrap_or(1) != 1 {
        return Err(ApiError::invalid(
            FLAVOR,
            "n must be 1: this server returns one choice per request",
        )
        .with_param("n"));
    }
    let mut messages = Vec::with_capacity(r.messages.len());
    for m in r.messages {
        let role = match m.role.as_str() {
            "developer" | "system" => "system",
            "user" | "assistant" | "tool" => m.role.as_str(),
            other => return Err(ApiError::invalid(FLAVOR, format!("unknown message role \"{other}\"; expected system, developer, user, assistant or tool")).with_param("messages")),
        };
        let mut msg = json!({"role": role, "content": m.content.as_ref().map(content_text).unwrap_or_default()});
        if let Some(r) = m.reasoning_content.or(m.reasoning) {
            msg["reasoning_content"] = Value::String(r);
        }
        if let Some(calls) = m.tool_calls {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    json!({"id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": arguments_object(&c["function"]["arguments"])}})
                })
                .collect();
            msg["tool_calls"] = Value::Array(calls);
        }
        if let Some(id) = m.tool_call_id {
            msg["tool_call_id"] = Value::String(id);
        }
        messages.push(msg);
    }
    let tools = r
        .tools
        .unwrap_or_default()
        .iter()
        .filter_map(|t| {
            let f = t.get("function")?;
            Some(function_tool(
                f.get("name")?.as_str()?,
                f.get("description"),
                f.get("parameters"),
            ))
        })
        .collect();
    let normalize::Reasoning {
        template_kwargs: kwargs,
        enable_thinking,
        budget: thinking_budget,
    } = normalize::openai_reasoning(
        r.chat_template_kwargs,
        r.reasoning_effort.as_deref(),
        r.thinking_budget,
        FLAVOR,
    )?;
    let include_usage = r.stream_options.map(|o| o.include_usage).unwrap_or(false);
    let cache_key = r.user;
    Ok((
        ChatRequest {
            messages,
            tools,
            tool_choice: tool_choice(r.tool_choice.as_ref())?,
            enable_thinking,
            thinking_budget,
            template_kwargs: kwargs,
            sampling: r.sampling.to_params(FLAVOR)?,
            max_tokens: r.max_completion_tokens.or(r.max_tokens),
            stop: r.stop.map(StopField::into_vec).unwrap_or_default(),
            cache_key,
        },
        include_usage,
    ))
}

pub fn usage_json(u: &UsageReport) -> Value {
    json!({
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    })
}

pub async fn handle(
    State(state): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    AppState::count(&state.http.chat_completions);
    let req: ChatCompletionRequest = parse_body(FLAVOR, body)?;
    let stream = req.stream;
    let (mut chat, include_usage) = to_chat_request(req)?;
    chat.cache_key = normalize::session_key(&headers, &[chat.cache_key.as_deref()]);
    let generation = normalize::start(&state, chat, FLAVOR)?;
    let id = new_id("chatcmpl-");
    let model = state.model_id.clone();
    if stream {
        let adapter = ChatStream {
            id,
            model,
            created: unix_now(),
            include_usage,
        };
        return Ok(sse::respond(generation, adapter, state.config.keepalive));
    }
    let c = normalize::collect(generation, FLAVOR).await?;
    Ok(Json(completion_json(&id, &model, &c)).into_response())
}

fn completion_json(id: &str, model: &str, c: &Collected) -> Value {
    let mut message = json!({"role": "assistant", "content": if c.text.is_empty() && !c.tool_calls.is_empty() { Value::Null } else { Value::String(c.text.clone()) }});
    if !c.reasoning.is_empty() {
        message["reasoning_content"] = Value::String(c.reasoning.clone());
        message["reasoning"] = Value::String(c.reasoning.clone());
    }
    if !c.tool_calls.is_empty() {
        message["tool_calls"] = c
            .tool_calls
            .iter()
            .map(|t| json!({"id": format!("call_{}", t.id), "type": "function", "function": {"name": t.name, "arguments": t.arguments}}))
            .collect();
    }
    json!({
        "id": id,
        "object": "chat.completion",
        "created": unix_now(),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": c.stop.openai()}],
        "usage": usage_json(&c.usage),
    })
}

struct ChatStream {
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
}

impl ChatStream {
    fn chunk(&self, delta: Value, finish_reason: Value) -> Event {
        json_event(
            None,
            &json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
            }),
        )
    }
}

impl StreamAdapter for ChatStream {
    fn start(&mut self) -> Vec<Event> {
        vec![self.chunk(json!({"role": "assistant", "content": ""}), Value::Null)]
    }

    fn on_event(&mut self, event: OutputEvent) -> Vec<Event> {
        match event {
            OutputEvent::Parsed(ParsedEvent::Reasoning(t)) => vec![self.chunk(json!({"reasoning_content": t, "reasoning": t}), Value::Null)],
            OutputEvent::Parsed(ParsedEvent::Text(t)) => vec![self.chunk(json!({"content": t}), Value::Null)],
            OutputEvent::Parsed(ParsedEvent::ToolCallBegin { index, id, name }) => vec![self.chunk(
                json!({"tool_calls": [{"index": index, "id": format!("call_{id}"), "type": "function", "function": {"name": name, "arguments": ""}}]}),
                Value::Null,
            )],
            OutputEvent::Parsed(ParsedEvent::ToolCallArguments { index, delta }) => {
                vec![self.chunk(json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}), Value::Null)]
            }
            OutputEvent::Parsed(ParsedEvent::ToolCallEnd { .. }) => vec![],
            OutputEvent::Done { stop, usage } => {
                let mut out = vec![self.chunk(json!({}), Value::String(stop.openai().into()))];
                if self.include_usage {
                    out.push(json_event(
                        None,
                        &json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": [], "usage": usage_json(&usage)}),
                    ));
                }
                out.push(Event::default().data("[DONE]"));
                out
            }
            OutputEvent::Failed(e) => vec![
                json_event(None, &json!({"error": {"message": e, "type": "server_error", "param": null, "code": "server_error"}})),
                Event::default().data("[DONE]"),
            ],
        }
    }

    fn keepalive(&mut self) -> Event {
        comment("keep-alive")
    }
}
