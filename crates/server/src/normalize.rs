//! The request every adapter normalises into, and its preparation: chat template → tokens →
//! a scheduler request plus the output parser's configuration. Shared by all APIs.
//!
//! Reasoning controls, per API, all ending in [`ChatRequest::enable_thinking`] and
//! [`ChatRequest::thinking_budget`]:
//! - Chat completions: `chat_template_kwargs.enable_thinking`, `reasoning_effort`, and a
//!   thinking budget as `thinking_budget` (top level) or `chat_template_kwargs.thinking_budget`
//!   (the top level wins when both are given).
//! - Responses: `reasoning.effort` (and `chat_template_kwargs` as in chat).
//! - Messages: `thinking: {"type": "enabled", "budget_tokens": N}`; no `thinking` or
//!   `{"type": "disabled"}` turns thinking off, as in the Anthropic API.
//!
//! Effort → budget ([`effort_budget`]): `none` / `minimal`: thinking off; `low`: 1,024 tokens;
//! `medium`: 8,192; `high`: 32,768; any other value: thinking on, no budget.
//!
//! A budget closes the thinking block early: once the model has produced that many tokens
//! inside `<think>`, the scheduler forces the tokens of "\n</think>\n\n" and generation goes
//! on normally ([`capy_engine::scheduler::ThinkingBudget`]). The forced tokens are output
//! tokens: they count in `output_tokens`, and up to `</think>` in the reasoning tokens.

use crate::error::{ApiError, ErrorKind, Flavor};
use crate::generate::{self, Collected, Generation};
use crate::parser::ParserConfig;
use crate::state::AppState;
use capy_engine::chat_template::ChatTemplateInput;
use capy_engine::sampling::SamplingParams;
use capy_engine::scheduler::{GenerationRequest, StopConditions, ThinkingBudget};
use serde_json::{Map, Value};
use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    #[default]
    Auto,
    None,
    Required,
    Named(String),
}

/// A chat request in the template's terms (OpenAI-style messages and tools).
#[derive(Debug, Clone, Default)]
pub struct ChatRequest {
    /// `{role, content, reasoning_content?, tool_calls?: [{id, type, function: {name,
    /// arguments: object}}], tool_call_id?}`; roles system, user, assistant, tool.
    pub messages: Vec<Value>,
    /// `{"type": "function", "function": {name, description, parameters}}`.
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// `None` leaves the template's default (Qwen: thinking on).
    pub enable_thinking: Option<bool>,
    /// Tokens the model may think before its thinking block is closed for it; `None`: no limit.
    pub thinking_budget: Option<usize>,
    pub template_kwargs: Map<String, Value>,
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    /// The conversation this request continues, for the prefix cache's session affinity
    /// ([`session_key`]); `None` leaves the match to the prompt's prefix.
    pub cache_key: Option<String>,
}

/// The prefix cache's session key of a request: the `X-Claude-Code-Session-Id` header, else
/// the API's own key (Responses `prompt_cache_key`, then `user`; Messages
/// `metadata.user_id`; chat `user`), first non-empty wins.
pub fn session_key(headers: &axum::http::HeaderMap, fields: &[Option<&str>]) -> Option<String> {
    let header = headers
        .get("x-claude-code-session-id")
        .and_then(|v| v.to_str().ok());
    std::iter::once(header)
        .chain(fields.iter().copied())
        .flatten()
        .map(str::trim)
        .find(|k| !k.is_empty())
        .map(str::to_string)
}

/// A request ready for the scheduler.
pub struct Prepared {
    pub generation: GenerationRequest,
    pub parser: ParserConfig,
    pub prompt_tokens: usize,
}

/// Thinking on/off and budget for a `reasoning_effort` / `reasoning.effort` value (see the
/// module documentation for the table).
pub fn effort_budget(effort: &str) -> (bool, Option<usize>) {
    match effort {
        "none" | "minimal" => (false, None),
        "low" => (true, Some(1024)),
        "medium" => (true, Some(8192)),
        "high" => (true, Some(32_768)),
        _ => (true, None),
    }
}

/// What [`openai_reasoning`] makes of a request's reasoning controls.
pub struct Reasoning {
    /// `chat_template_kwargs` without the keys taken out.
    pub template_kwargs: Map<String, Value>,
    pub enable_thinking: Option<bool>,
    /// Thinking tokens before thinking is closed.
    pub budget: Option<usize>,
}

/// The reasoning controls the OpenAI APIs share: `chat_template_kwargs` (its
/// `enable_thinking` and `thinking_budget` are taken out, the rest goes to the template), an
/// effort, and a top-level budget.
pub fn openai_reasoning(
    kwargs: Option<Map<String, Value>>,
    effort: Option<&str>,
    top_level_budget: Option<usize>,
    flavor: Flavor,
) -> Result<Reasoning, ApiError> {
    let mut kwargs = kwargs.unwrap_or_default();
    let mut enable_thinking = kwargs.remove("enable_thinking").and_then(|v| v.as_bool());
    let kwargs_budget = match kwargs.remove("thinking_budget") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().map(|n| n as usize).ok_or_else(|| {
            ApiError::invalid(
                flavor,
                format!(
                    "chat_template_kwargs.thinking_budget must be a non-negative integer, got {v}"
                ),
            )
            .with_param("chat_template_kwargs.thinking_budget")
        })?),
    };
    let mut budget = top_level_budget.or(kwargs_budget);
    if let Some(effort) = effort {
        let (on, effort_budget) = effort_budget(effort);
        enable_thinking = Some(on);
        budget = budget.or(effort_budget);
    }
    Ok(Reasoning {
        template_kwargs: kwargs,
        enable_thinking,
        budget,
    })
}

/// Prepares and submits a request: what every adapter's handler does first.
pub fn start(state: &AppState, req: ChatRequest, flavor: Flavor) -> Result<Generation, ApiError> {
    let prepared = prepare(state, req, flavor)?;
    generate::start(state, prepared, flavor)
}

/// Runs a generation to its end (non-streaming responses); a failure in `flavor`'s shape.
pub async fn collect(generation: Generation, flavor: Flavor) -> Result<Collected, ApiError> {
    generation
        .collect()
        .await
        .map_err(|e| ApiError::new(flavor, ErrorKind::Internal, e))
}

/// Puts all system text into one leading system message (the Qwen templates accept a system
/// message only first), removes Claude Code's per-request billing line so prompts stay
/// prefix-identical across turns, and drops empty system text.
pub fn normalize_messages(messages: Vec<Value>) -> Vec<Value> {
    let mut system_parts: Vec<String> = Vec::new();
    let mut rest = Vec::with_capacity(messages.len());
    for m in messages {
        if m.get("role").and_then(Value::as_str) == Some("system") {
            if let Some(text) = m.get("content").map(content_text) {
                let text = strip_billing_header(&text);
                if !text.trim().is_empty() {
                    system_parts.push(text);
                }
            }
        } else {
            rest.push(m);
        }
    }
    let mut out = Vec::with_capacity(rest.len() + 1);
    if !system_parts.is_empty() {
        out.push(serde_json::json!({"role": "system", "content": system_parts.join("\n\n")}));
    }
    out.extend(rest);
    out
}

/// Claude Code puts `x-anthropic-billing-header: cc_version=…; cch=…;` (changing every
/// request) at the top of the system prompt; leaving it would defeat prefix caching.
pub fn strip_billing_header(text: &str) -> String {
    if !text.contains("x-anthropic-billing-header") {
        return text.to_string();
    }
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("x-anthropic-billing-header"))
        .collect();
    kept.join("\n").trim_start_matches('\n').to_string()
}

/// Text of a content value: a string, or the text parts of a block list.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("text").and_then(Value::as_str).map(str::to_string),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Tool-call arguments as an object for the template (OpenAI sends a JSON string).
pub fn arguments_object(arguments: &Value) -> Value {
    match arguments {
        Value::String(s) => crate::parser::tool_args::parse_lenient(s)
            .filter(Value::is_object)
            .unwrap_or_else(|| Value::Object(Map::new())),
        Value::Object(_) => arguments.clone(),
        _ => Value::Object(Map::new()),
    }
}

pub fn function_tool(name: &str, description: Option<&Value>, parameters: Option<&Value>) -> Value {
    serde_json::json!({
        "type": "function",
        "function": {
            "name": name,
            "description": description.cloned().unwrap_or(Value::String(String::new())),
            "parameters": parameters.cloned().unwrap_or(serde_json::json!({"type": "object", "properties": {}})),
        }
    })
}

/// Renders, tokenizes and builds the scheduler request. Errors are in `flavor`'s shape.
pub fn prepare(state: &AppState, req: ChatRequest, flavor: Flavor) -> Result<Prepared, ApiError> {
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::new(flavor, ErrorKind::Internal, "the loaded model has no chat template (chat_template.jinja or tokenizer_config.json); chat APIs need one")
    })?;
    if req.messages.is_empty() {
        return Err(
            ApiError::invalid(flavor, "messages must contain at least one message")
                .with_param("messages"),
        );
    }
    let use_tools = !req.tools.is_empty() && req.tool_choice != ToolChoice::None;
    if let ToolChoice::Named(name) = &req.tool_choice {
        let known = req
            .tools
            .iter()
            .any(|t| t["function"]["name"].as_str() == Some(name));
        if !known {
            return Err(ApiError::invalid(
                flavor,
                format!(
                    "tool_choice names the tool \"{name}\", which is not among the request's tools"
                ),
            )
            .with_param("tool_choice"));
        }
    }
    if req.tool_choice == ToolChoice::Required && req.tools.is_empty() {
        return Err(ApiError::invalid(
            flavor,
            "tool_choice is required but the request has no tools",
        )
        .with_param("tool_choice"));
    }
    let input = ChatTemplateInput {
        messages: normalize_messages(req.messages),
        tools: use_tools.then(|| req.tools.clone()),
        add_generation_prompt: true,
        enable_thinking: req.enable_thinking,
        extra: req.template_kwargs,
    };
    let mut prompt = template.render(&input).map_err(|e| {
        ApiError::invalid(
            flavor,
            format!("the conversation cannot be rendered with the model's chat template: {e:#}"),
        )
    })?;
    // A forced tool choice: close any open reasoning and open the call in the prompt, so the
    // model can only continue with a call.
    let prefilled_call = match &req.tool_choice {
        ToolChoice::Named(name) if use_tools => Some(format!("<tool_call>\n<function={name}>\n")),
        ToolChoice::Required if use_tools => Some("<tool_call>\n<function=".to_string()),
        _ => None,
    };
    if let Some(call) = &prefilled_call {
        if prompt.trim_end().ends_with("<think>") {
            prompt.push_str("\n</think>\n\n");
        }
        prompt.push_str(call);
    }
    let start_in_reasoning = prefilled_call.is_none() && prompt.trim_end().ends_with("<think>");
    // The budget applies where the model may still think: the prompt opened the block, or
    // thinking was not turned off and the model may open it itself.
    let thinking_budget = match req.thinking_budget {
        Some(max_tokens)
            if prefilled_call.is_none()
                && (start_in_reasoning || req.enable_thinking != Some(false)) =>
        {
            thinking_budget(state, max_tokens, start_in_reasoning, flavor)?
        }
        _ => None,
    };
    let tokens = state.tokenizer.encode(&prompt, false).map_err(|e| {
        ApiError::new(
            flavor,
            ErrorKind::Internal,
            format!("tokenizing the prompt failed: {e:#}"),
        )
    })?;
    let max_context = state.scheduler.config().max_context;
    if tokens.len() >= max_context {
        return Err(ApiError::context_length(flavor, tokens.len(), max_context));
    }
    let room = max_context - tokens.len();
    let max_tokens = req.max_tokens.unwrap_or(room).min(room);
    if max_tokens == 0 {
        return Err(
            ApiError::invalid(flavor, "max_tokens must be at least 1").with_param("max_tokens")
        );
    }
    let mut stop_ids = Vec::new();
    for t in ["<|im_end|>", "<|endoftext|>"] {
        if let Some(id) = state.tokenizer.token_to_id(t) {
            stop_ids.push(id);
        }
    }
    let tool_parameters: HashMap<String, Value> = req
        .tools
        .iter()
        .filter_map(|t| {
            let f = &t["function"];
            Some((
                f["name"].as_str()?.to_string(),
                f["parameters"]
                    .get("properties")
                    .cloned()
                    .unwrap_or(Value::Null),
            ))
        })
        .collect();
    let prompt_tokens = tokens.len();
    Ok(Prepared {
        generation: GenerationRequest {
            prompt_tokens: tokens,
            sampling: req.sampling,
            max_tokens,
            stop: StopConditions {
                token_ids: stop_ids,
                strings: req.stop,
            },
            skip_special_tokens: true,
            cache_key: req.cache_key,
            thinking_budget,
        },
        parser: ParserConfig {
            start_in_reasoning,
            parse_tool_calls: use_tools,
            tool_parameters,
            prefilled_call,
        },
        prompt_tokens,
    })
}

/// The scheduler's budget, in the model's tokens: `</think>` must be one token (Qwen
/// tokenizers); a tokenizer without it cannot have its thinking closed, and says so.
fn thinking_budget(
    state: &AppState,
    max_tokens: usize,
    starts_inside: bool,
    flavor: Flavor,
) -> Result<Option<ThinkingBudget>, ApiError> {
    let tok = &state.tokenizer;
    let Some(close_token) = tok.token_to_id("</think>") else {
        return Err(ApiError::invalid(
            flavor,
            "a thinking budget was given, but the loaded model's tokenizer has no </think> token to close thinking with; leave the budget out",
        ));
    };
    let close_sequence = tok.encode("\n</think>\n\n", false).map_err(|e| {
        ApiError::new(
            flavor,
            ErrorKind::Internal,
            format!("tokenizing the thinking close failed: {e:#}"),
        )
    })?;
    Ok(Some(ThinkingBudget {
        max_tokens,
        starts_inside,
        open_token: tok.token_to_id("<think>"),
        close_token,
        close_sequence,
    }))
}

/// Token count of a request's prompt (for `count_tokens` / `input_tokens`).
pub fn count_prompt_tokens(
    state: &AppState,
    req: ChatRequest,
    flavor: Flavor,
) -> Result<usize, ApiError> {
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::new(
            flavor,
            ErrorKind::Internal,
            "the loaded model has no chat template",
        )
    })?;
    let use_tools = !req.tools.is_empty() && req.tool_choice != ToolChoice::None;
    let input = ChatTemplateInput {
        messages: normalize_messages(req.messages),
        tools: use_tools.then_some(req.tools),
        add_generation_prompt: true,
        enable_thinking: req.enable_thinking,
        extra: req.template_kwargs,
    };
    let prompt = template.render(&input).map_err(|e| {
        ApiError::invalid(
            flavor,
            format!("the conversation cannot be rendered with the model's chat template: {e:#}"),
        )
    })?;
    let tokens = state
        .tokenizer
        .encode(&prompt, false)
        .map_err(|e| ApiError::new(flavor, ErrorKind::Internal, format!("{e:#}")))?;
    Ok(tokens.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn billing_header_line_is_removed() {
        let a = "x-anthropic-billing-header: cc_version=2.0.1; cch=abc;\nYou are Claude Code.";
        let b = "x-anthropic-billing-header: cc_version=2.0.1; cch=def;\nYou are Claude Code.";
        assert_eq!(strip_billing_header(a), "You are Claude Code.");
        assert_eq!(strip_billing_header(a), strip_billing_header(b));
        assert_eq!(strip_billing_header("plain"), "plain");
    }

    #[test]
    fn system_messages_merge_first() {
        let m = normalize_messages(vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "system", "content": [{"type": "text", "text": "A"}]}),
            json!({"role": "system", "content": "B"}),
        ]);
        assert_eq!(m[0], json!({"role": "system", "content": "A\n\nB"}));
        assert_eq!(m[1]["role"], "user");
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn effort_maps_to_thinking_and_budget() {
        assert_eq!(effort_budget("minimal"), (false, None));
        assert_eq!(effort_budget("none"), (false, None));
        assert_eq!(effort_budget("low"), (true, Some(1024)));
        assert_eq!(effort_budget("medium"), (true, Some(8192)));
        assert_eq!(effort_budget("high"), (true, Some(32_768)));
        assert_eq!(effort_budget("extreme"), (true, None));
    }

    #[test]
    fn openai_reasoning_takes_its_keys_out_of_the_template_kwargs() {
        let kwargs = json!({"enable_thinking": true, "thinking_budget": 7, "other": 1});
        let kwargs = kwargs.as_object().cloned();
        let r = openai_reasoning(kwargs.clone(), None, None, Flavor::OpenAi).unwrap();
        let (rest, on, budget) = (r.template_kwargs, r.enable_thinking, r.budget);
        assert_eq!(Value::Object(rest), json!({"other": 1}));
        assert_eq!((on, budget), (Some(true), Some(7)));
        // The top level beats the kwargs, the kwargs beat the effort's budget; the effort
        // decides on/off.
        let Reasoning {
            enable_thinking: on,
            budget,
            ..
        } = openai_reasoning(kwargs.clone(), Some("low"), Some(3), Flavor::OpenAi).unwrap();
        assert_eq!((on, budget), (Some(true), Some(3)));
        let Reasoning {
            enable_thinking: on,
            budget,
            ..
        } = openai_reasoning(kwargs, Some("minimal"), None, Flavor::OpenAi).unwrap();
        assert_eq!((on, budget), (Some(false), Some(7)));
        let Reasoning {
            enable_thinking: on,
            budget,
            ..
        } = openai_reasoning(None, Some("medium"), None, Flavor::OpenAi).unwrap();
        assert_eq!((on, budget), (Some(true), Some(8192)));
        let bad = json!({"thinking_budget": -2}).as_object().cloned();
        assert!(openai_reasoning(bad, None, None, Flavor::OpenAi).is_err());
    }

    #[test]
    fn string_arguments_become_objects() {
        assert_eq!(arguments_object(&json!("{\"a\": 1}")), json!({"a": 1}));
        assert_eq!(arguments_object(&json!("garbage")), json!({}));
    }
}
