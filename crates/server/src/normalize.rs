//! The request every adapter normalises into, and its preparation: chat template → tokens →
//! a scheduler request plus the output parser's configuration. Shared by all APIs.

use crate::error::{ApiError, ErrorKind, Flavor};
use crate::parser::ParserConfig;
use crate::state::AppState;
use capy_engine::chat_template::ChatTemplateInput;
use capy_engine::sampling::SamplingParams;
use capy_engine::scheduler::{GenerationRequest, StopConditions};
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
    pub template_kwargs: Map<String, Value>,
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
}

/// A request ready for the scheduler.
pub struct Prepared {
    pub generation: GenerationRequest,
    pub parser: ParserConfig,
    pub prompt_tokens: usize,
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
    fn string_arguments_become_objects() {
        assert_eq!(arguments_object(&json!("{\"a\": 1}")), json!({"a": 1}));
        assert_eq!(arguments_object(&json!("garbage")), json!({}));
    }
}
