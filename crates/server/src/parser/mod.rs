//! The output parser: splits the model's text into reasoning (`<think>…</think>`), answer text
//! and tool calls, incrementally while streaming. Shared by every API adapter.
//!
//! Tool calls come in the Qwen XML form
//! `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>` (streamed
//! one parameter at a time as JSON argument fragments) or the JSON form
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (emitted when the call closes).
//! Text that may be the start of a tag is held back until it is known not to be one. At the end
//! of generation unclosed tags are closed, so every call's arguments are valid JSON.

pub mod tool_args;

use serde_json::Value;
use std::collections::HashMap;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// What the parser produces, in output order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParsedEvent {
    Reasoning(String),
    Text(String),
    /// A tool call starts; `index` counts calls from 0 in this output.
    ToolCallBegin {
        index: usize,
        id: String,
        name: String,
    },
    /// A fragment of the call's arguments JSON; the fragments concatenate to `ToolCallEnd`'s.
    ToolCallArguments {
        index: usize,
        delta: String,
    },
    ToolCallEnd {
        index: usize,
        arguments: String,
    },
}

/// How the parser reads one generation.
#[derive(Debug, Clone, Default)]
pub struct ParserConfig {
    /// The prompt ended inside `<think>` (the template opened the reasoning block).
    pub start_in_reasoning: bool,
    /// Parse tool calls (false when no tools were given or `tool_choice` is none).
    pub parse_tool_calls: bool,
    /// Tool name → its JSON schema `properties`, to type XML parameter values.
    pub tool_parameters: HashMap<String, Value>,
    /// The prompt already opened a call with this text (a forced tool choice), e.g.
    /// `<tool_call>\n<function=NAME>\n`; the parser starts inside it.
    pub prefilled_call: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
    ToolCall,
}

/// Incremental state of the call being read.
#[derive(Debug, Default)]
struct Call {
    body: String,
    /// Bytes of `body` already consumed by the XML reader.
    cursor: usize,
    json_form: Option<bool>,
    begun: bool,
    name: String,
    arguments: String,
    params: usize,
    function_closed: bool,
}

pub struct OutputParser {
    config: ParserConfig,
    mode: Mode,
    pending: String,
    calls: usize,
    call: Call,
    /// Nothing but whitespace has been emitted as text yet.
    content_empty: bool,
    /// Drop leading whitespace of the next text (answer start, after a tool call).
    trim_next: bool,
    reasoning_empty: bool,
}

impl OutputParser {
    pub fn new(config: ParserConfig) -> Self {
        let mut p = OutputParser {
            mode: if config.start_in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            config,
            pending: String::new(),
            calls: 0,
            call: Call::default(),
            content_empty: true,
            trim_next: true,
            reasoning_empty: true,
        };
        if let Some(prefill) = p.config.prefilled_call.clone() {
            p.mode = Mode::ToolCall;
            p.call.body = prefill
                .strip_prefix(CALL_OPEN)
                .unwrap_or(&prefill)
                .to_string();
        }
        p
    }

    /// True while the output is inside the reasoning block (for counting reasoning tokens).
    pub fn in_reasoning(&self) -> bool {
        self.mode == Mode::Reasoning
    }

    /// Tool calls seen so far.
    pub fn tool_calls(&self) -> usize {
        self.calls + usize::from(self.call.begun)
    }

    pub fn push(&mut self, text: &str) -> Vec<ParsedEvent> {
        let mut out = Vec::new();
        self.pending.push_str(text);
        self.drain(&mut out, false);
        out
    }

    /// Ends the output: releases held text and closes an unclosed call.
    pub fn finish(&mut self) -> Vec<ParsedEvent> {
        let mut out = Vec::new();
        self.drain(&mut out, true);
        match self.mode {
            Mode::Reasoning => {
                let rest = std::mem::take(&mut self.pending);
                self.emit_reasoning(rest, &mut out);
            }
            Mode::Content => {
                let rest = std::mem::take(&mut self.pending);
                self.emit_text(rest, &mut out);
            }
            Mode::ToolCall => self.close_call_at_end(&mut out),
        }
        out
    }

    fn drain(&mut self, out: &mut Vec<ParsedEvent>, at_end: bool) {
        loop {
            match self.mode {
                Mode::Reasoning => {
                    if let Some(pos) = self.pending.find(THINK_CLOSE) {
                        let before = self.pending[..pos].trim_end_matches('\n').to_string();
                        self.pending.drain(..pos + THINK_CLOSE.len());
                        self.emit_reasoning(before, out);
                        self.mode = Mode::Content;
                        continue;
                    }
                    let keep = if at_end {
                        0
                    } else {
                        partial_tag_len(&self.pending, &[THINK_CLOSE])
                    };
                    let mut cut = self.pending.len() - keep;
                    if !at_end {
                        // Newlines before `</think>` are dropped, so hold them until more comes.
                        cut = self.pending[..cut].trim_end_matches('\n').len();
                    }
                    let text: String = self.pending.drain(..cut).collect();
                    self.emit_reasoning(text, out);
                    return;
                }
                Mode::Content => {
                    let mut tags: Vec<&str> = Vec::with_capacity(2);
                    if self.config.parse_tool_calls {
                        tags.push(CALL_OPEN);
                    }
                    // A reasoning block the model opened itself, before any answer text.
                    if self.content_empty && self.reasoning_empty {
                        tags.push(THINK_OPEN);
                    }
                    let found = tags
                        .iter()
                        .filter_map(|t| self.pending.find(t).map(|p| (p, *t)))
                        .min();
                    if let Some((pos, tag)) = found {
                        let before = self.pending[..pos].to_string();
                        self.pending.drain(..pos + tag.len());
                        if tag == THINK_OPEN && before.trim().is_empty() {
                            self.mode = Mode::Reasoning;
                            continue;
                        }
                        self.emit_text(before, out);
                        if tag == THINK_OPEN {
                            self.emit_text(THINK_OPEN.to_string(), out);
                            continue;
                        }
                        self.mode = Mode::ToolCall;
                        self.call = Call::default();
                        continue;
                    }
                    let keep = if at_end {
                        0
                    } else {
                        partial_tag_len(&self.pending, &tags)
                    };
                    let cut = self.pending.len() - keep;
                    let text: String = self.pending.drain(..cut).collect();
                    self.emit_text(text, out);
                    return;
                }
                Mode::ToolCall => {
                    let moved = std::mem::take(&mut self.pending);
                    self.call.body.push_str(&moved);
                    if let Some(end) = self.call.body.find(CALL_CLOSE) {
                        let rest = self.call.body[end + CALL_CLOSE.len()..].to_string();
                        self.call.body.truncate(end);
                        self.advance_call(out);
                        self.close_call(out);
                        self.pending = rest;
                        self.mode = Mode::Content;
                        continue;
                    }
                    self.advance_call(out);
                    return;
                }
            }
        }
    }

    fn emit_reasoning(&mut self, mut text: String, out: &mut Vec<ParsedEvent>) {
        if self.reasoning_empty {
            text = text.trim_start().to_string();
        }
        if !text.is_empty() {
            self.reasoning_empty = false;
            out.push(ParsedEvent::Reasoning(text));
        }
    }

    /// Emits answer text; leading whitespace is dropped at the start of the answer and after a
    /// tool call (the template's separators), held until non-blank text shows up.
    fn emit_text(&mut self, text: String, out: &mut Vec<ParsedEvent>) {
        let text = if self.trim_next {
            text.trim_start().to_string()
        } else {
            text
        };
        if !text.is_empty() {
            self.content_empty = false;
            self.trim_next = false;
            out.push(ParsedEvent::Text(text));
        }
    }

    /// Reads as much of the XML call body as is complete.
    fn advance_call(&mut self, out: &mut Vec<ParsedEvent>) {
        let c = &mut self.call;
        if c.json_form.is_none() {
            match c.body.trim_start().chars().next() {
                Some('{') => c.json_form = Some(true),
                Some(_) => c.json_form = Some(false),
                None => return,
            }
        }
        if c.json_form == Some(true) {
            return; // read whole at the close
        }
        let index = self.calls;
        loop {
            let rest = &c.body[c.cursor..];
            if !c.begun {
                let Some(start) = rest.find("<function=") else {
                    return;
                };
                let Some(end) = rest[start..].find('>') else {
                    return;
                };
                c.name = rest[start + "<function=".len()..start + end]
                    .trim()
                    .to_string();
                c.cursor += start + end + 1;
                c.begun = true;
                c.arguments.push('{');
                out.push(ParsedEvent::ToolCallBegin {
                    index,
                    id: new_call_id(),
                    name: c.name.clone(),
                });
                out.push(ParsedEvent::ToolCallArguments {
                    index,
                    delta: "{".into(),
                });
                continue;
            }
            if c.function_closed {
                return;
            }
            let next_param = rest.find("<parameter=");
            let fn_close = rest.find("</function>");
            match (next_param, fn_close) {
                (Some(p), f) if f.is_none_or(|f| p < f) => {
                    let Some(name_end) = rest[p..].find('>') else {
                        return;
                    };
                    let pname = rest[p + "<parameter=".len()..p + name_end]
                        .trim()
                        .to_string();
                    let value_start = p + name_end + 1;
                    let Some(value_len) = rest[value_start..].find("</parameter>") else {
                        return;
                    };
                    let raw = rest[value_start..value_start + value_len].to_string();
                    c.cursor += value_start + value_len + "</parameter>".len();
                    let delta = param_fragment(
                        &self.config.tool_parameters,
                        &c.name,
                        &pname,
                        &raw,
                        c.params == 0,
                    );
                    c.params += 1;
                    c.arguments.push_str(&delta);
                    out.push(ParsedEvent::ToolCallArguments { index, delta });
                }
                (_, Some(f)) => {
                    c.cursor += f + "</function>".len();
                    c.function_closed = true;
                    return;
                }
                _ => return,
            }
        }
    }

    /// Ends the current call at `</tool_call>`.
    fn close_call(&mut self, out: &mut Vec<ParsedEvent>) {
        let index = self.calls;
        let c = std::mem::take(&mut self.call);
        if c.json_form == Some(true) {
            match tool_args::json_tool_call(&c.body) {
                Some((name, arguments)) => {
                    out.push(ParsedEvent::ToolCallBegin {
                        index,
                        id: new_call_id(),
                        name,
                    });
                    out.push(ParsedEvent::ToolCallArguments {
                        index,
                        delta: arguments.clone(),
                    });
                    out.push(ParsedEvent::ToolCallEnd { index, arguments });
                    self.calls += 1;
                    self.trim_next = true;
                }
                // Not a call after all: keep the text so nothing the model wrote is lost.
                None => self.emit_text(format!("{CALL_OPEN}{}{CALL_CLOSE}", c.body), out),
            }
            return;
        }
        if !c.begun {
            self.emit_text(format!("{CALL_OPEN}{}{CALL_CLOSE}", c.body), out);
            return;
        }
        let mut arguments = c.arguments;
        arguments.push('}');
        out.push(ParsedEvent::ToolCallArguments {
            index,
            delta: "}".into(),
        });
        out.push(ParsedEvent::ToolCallEnd { index, arguments });
        self.calls += 1;
        self.trim_next = true;
    }

    /// Generation ended inside a call: take an open parameter's text as its value and close.
    fn close_call_at_end(&mut self, out: &mut Vec<ParsedEvent>) {
        let moved = std::mem::take(&mut self.pending);
        self.call.body.push_str(&moved);
        self.advance_call(out);
        let c = &mut self.call;
        if c.json_form == Some(false) && c.begun && !c.function_closed {
            let rest = c.body[c.cursor..].to_string();
            if let Some(p) = rest.find("<parameter=") {
                if let Some(name_end) = rest[p..].find('>') {
                    let pname = rest[p + "<parameter=".len()..p + name_end]
                        .trim()
                        .to_string();
                    let mut raw = rest[p + name_end + 1..].to_string();
                    // Drop a partial closing tag the generation stopped in.
                    let cut = raw.len() - partial_tag_len(&raw, &["</parameter>", "</function>"]);
                    raw.truncate(cut);
                    let delta = param_fragment(
                        &self.config.tool_parameters,
                        &c.name,
                        &pname,
                        &raw,
                        c.params == 0,
                    );
                    c.params += 1;
                    c.arguments.push_str(&delta);
                    out.push(ParsedEvent::ToolCallArguments {
                        index: self.calls,
                        delta,
                    });
                }
            }
        }
        self.close_call(out);
        self.mode = Mode::Content;
    }
}

/// `"name": value` with a leading comma when it is not the first parameter.
fn param_fragment(
    tools: &HashMap<String, Value>,
    function: &str,
    param: &str,
    raw: &str,
    first: bool,
) -> String {
    let schema = tools.get(function).and_then(|props| props.get(param));
    let value = tool_args::parameter_value(raw, tool_args::schema_type(schema));
    let key = Value::String(param.to_string());
    format!("{}{key}: {value}", if first { "" } else { ", " })
}

fn new_call_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..24].to_string()
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags`.
fn partial_tag_len(text: &str, tags: &[&str]) -> usize {
    let mut best = 0;
    for tag in tags {
        for k in (best + 1..tag.len().min(text.len() + 1)).rev() {
            let start = text.len() - k;
            if text.is_char_boundary(start) && tag.as_bytes().starts_with(&text.as_bytes()[start..])
            {
                best = k;
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests;
