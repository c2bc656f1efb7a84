//! Drives one generation: scheduler stream → output parser → API-neutral events, with the
//! stop reason and usage every adapter reports. Shared by all APIs.

use crate::error::{ApiError, Flavor};
use crate::normalize::Prepared;
use crate::parser::{OutputParser, ParsedEvent};
use crate::state::AppState;
use capy_engine::scheduler::{FinishReason, GenerationEvent, GenerationStream};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    EndTurn,
    MaxTokens,
    StopSequence(String),
    ToolUse,
}

impl StopReason {
    pub fn anthropic(&self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::MaxTokens => "max_tokens",
            StopReason::StopSequence(_) => "stop_sequence",
            StopReason::ToolUse => "tool_use",
        }
    }

    pub fn openai(&self) -> &'static str {
        match self {
            StopReason::EndTurn | StopReason::StopSequence(_) => "stop",
            StopReason::MaxTokens => "length",
            StopReason::ToolUse => "tool_calls",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageReport {
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub cached_tokens: usize,
    pub reasoning_tokens: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum OutputEvent {
    Parsed(ParsedEvent),
    Done {
        stop: StopReason,
        usage: UsageReport,
    },
    Failed(String),
}

/// A running generation.
pub struct Generation {
    stream: GenerationStream,
    parser: OutputParser,
    prompt_tokens: usize,
    reasoning_tokens: usize,
    finished: bool,
}

/// Submits a prepared request; refusals (overload, context) come back in `flavor`'s shape.
pub fn start(state: &AppState, prepared: Prepared, flavor: Flavor) -> Result<Generation, ApiError> {
    let stream = state
        .scheduler
        .submit(prepared.generation)
        .map_err(|e| ApiError::from_submit(flavor, e, state.config.retry_after_s))?;
    Ok(Generation {
        stream,
        parser: OutputParser::new(prepared.parser),
        prompt_tokens: prepared.prompt_tokens,
        reasoning_tokens: 0,
        finished: false,
    })
}

impl Generation {
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Waits for admission; the prompt tokens resumed from the prefix cache (`None`: the
    /// request was dropped before admission, [`Generation::next`] says why). Cancel-safe.
    pub async fn admitted(&mut self) -> Option<usize> {
        self.stream.admitted().await
    }

    /// The events of the next token (possibly none); `None` once finished.
    pub async fn next(&mut self) -> Option<Vec<OutputEvent>> {
        if self.finished {
            return None;
        }
        let mut out = Vec::new();
        match self.stream.recv().await {
            Some(GenerationEvent::Token { text, .. }) => {
                if self.parser.in_reasoning() {
                    self.reasoning_tokens += 1;
                }
                out.extend(self.parser.push(&text).into_iter().map(OutputEvent::Parsed));
            }
            Some(GenerationEvent::Finished { reason, usage }) => {
                self.finished = true;
                out.extend(self.parser.finish().into_iter().map(OutputEvent::Parsed));
                let stop = match reason {
                    _ if self.parser.tool_calls() > 0 && !reason.is_length() => StopReason::ToolUse,
                    FinishReason::StopToken(_) => StopReason::EndTurn,
                    FinishReason::StopString(_, s) => StopReason::StopSequence(s),
                    FinishReason::MaxTokens | FinishReason::ContextFull => StopReason::MaxTokens,
                };
                let usage = UsageReport {
                    input_tokens: usage.prompt_tokens,
                    output_tokens: usage.completion_tokens,
                    cached_tokens: usage.cached_tokens,
                    reasoning_tokens: self.reasoning_tokens,
                };
                out.push(OutputEvent::Done { stop, usage });
            }
            Some(GenerationEvent::Error(e)) => {
                self.finished = true;
                out.push(OutputEvent::Failed(e));
            }
            None => {
                self.finished = true;
                out.push(OutputEvent::Failed(
                    "the scheduler stopped before the generation finished".into(),
                ));
            }
        }
        Some(out)
    }

    /// Runs to the end (non-streaming responses).
    pub async fn collect(mut self) -> Result<Collected, String> {
        let mut c = Collected::default();
        while let Some(events) = self.next().await {
            for e in events {
                match e {
                    OutputEvent::Parsed(ParsedEvent::Reasoning(t)) => c.reasoning.push_str(&t),
                    OutputEvent::Parsed(ParsedEvent::Text(t)) => c.text.push_str(&t),
                    OutputEvent::Parsed(ParsedEvent::ToolCallBegin { id, name, .. }) => {
                        c.tool_calls.push(ToolCall {
                            id,
                            name,
                            arguments: String::new(),
                        })
                    }
                    OutputEvent::Parsed(ParsedEvent::ToolCallArguments { .. }) => {}
                    OutputEvent::Parsed(ParsedEvent::ToolCallEnd { index, arguments }) => {
                        if let Some(call) = c.tool_calls.get_mut(index) {
                            call.arguments = arguments;
                        }
                    }
                    OutputEvent::Done { stop, usage } => {
                        c.stop = stop;
                        c.usage = usage;
                    }
                    OutputEvent::Failed(e) => return Err(e),
                }
            }
        }
        Ok(c)
    }
}

#[derive(Debug, Clone)]
pub struct ToolCall {
    /// Neutral id from the parser; adapters add their API's prefix.
    pub id: String,
    pub name: String,
    /// A JSON object text.
    pub arguments: String,
}

#[derive(Debug, Clone)]
pub struct Collected {
    pub reasoning: String,
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    pub stop: StopReason,
    pub usage: UsageReport,
}

impl Default for Collected {
    fn default() -> Self {
        Collected {
            reasoning: String::new(),
            text: String::new(),
            tool_calls: Vec::new(),
            stop: StopReason::EndTurn,
            usage: UsageReport::default(),
        }
    }
}
