//! `capy-flash generate`: streams a completion of a prompt (raw, or as one chat turn through
//! the checkpoint's chat template) to stdout.

use super::model_arg::{open_model, ModelArg};
use anyhow::{bail, Context, Result};
use capy_engine::chat_template::ChatTemplateInput;
use capy_engine::model::{BatchItem, LogitsWanted};
use capy_engine::sampling::{Sampler, SamplingParams, StopStringMatcher};
use std::io::Write;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArg,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Treat the prompt as a user message and render it with the chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Let the model think first (with --chat; the template's `enable_thinking`).
    #[arg(long, requires = "chat")]
    pub think: bool,
    /// Most new tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Bias a token: ID=BIAS (repeatable).
    #[arg(long = "logit-bias", value_parser = parse_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Stop when this text appears (repeatable; not printed).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Seed for sampling; the same seed gives the same tokens.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print token ids and timing to stderr at the end.
    #[arg(long)]
    pub verbose: bool,
}

fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("expected ID=BIAS, found \"{s}\""))?;
    Ok((
        id.trim()
            .parse()
            .map_err(|_| format!("\"{id}\" is not a token id"))?,
        bias.trim()
            .parse()
            .map_err(|_| format!("\"{bias}\" is not a number"))?,
    ))
}

pub fn run(a: Args) -> Result<()> {
    if a.prompt.is_empty() {
        bail!("the prompt is empty: give --prompt TEXT");
    }
    let loaded = open_model(&a.model)?;
    let tokenizer = loaded.tokenizer.as_ref().with_context(|| {
        format!(
            "{} has no tokenizer.json; generate needs one",
            loaded.dir.display()
        )
    })?;
    let text = if a.chat {
        let template = loaded.template.as_ref().with_context(|| format!("{} has no chat template (chat_template.jinja or tokenizer_config.json); drop --chat", loaded.dir.display()))?;
        let mut messages = Vec::new();
        if let Some(sys) = &a.system {
            messages.push(serde_json::json!({"role": "system", "content": sys}));
        }
        messages.push(serde_json::json!({"role": "user", "content": a.prompt}));
        template.render(&ChatTemplateInput {
            messages,
            add_generation_prompt: true,
            enable_thinking: Some(a.think),
            ..Default::default()
        })?
    } else {
        a.prompt.clone()
    };
    let prompt = tokenizer.encode(&text, false)?;
    if prompt.is_empty() {
        bail!("the prompt tokenized to nothing");
    }
    let mut lm = loaded.model;
    let info = lm.info().clone();
    if prompt.len() + a.max_tokens > info.max_context {
        bail!(
            "prompt ({} tokens) plus --max-tokens {} exceeds the model's context of {} tokens",
            prompt.len(),
            a.max_tokens,
            info.max_context
        );
    }
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        logit_bias: a.logit_bias.iter().copied().collect(),
        seed: a.seed,
    };
    params.validate().map_err(anyhow::Error::msg)?;
    let mut sampler = Sampler::new(params, &prompt);
    let mut stops = StopStringMatcher::new(a.stop.clone());
    let mut decoder = tokenizer.stream_decoder(true);
    let mut out = std::io::stdout().lock();
    let seq = lm.new_sequence();
    let started = std::time::Instant::now();
    let mut logits = lm
        .forward(&[BatchItem {
            seq,
            tokens: &prompt,
            logits: LogitsWanted::Last,
        }])?
        .remove(0);
    let prefill_s = started.elapsed().as_secs_f64();
    let mut generated = Vec::new();
    let mut reason = "length";
    while generated.len() < a.max_tokens {
        let token = sampler.sample(&mut logits);
        sampler.accept(token);
        generated.push(token);
        if info.eos_token_ids.contains(&token) {
            reason = "eos";
            break;
        }
        let piece = decoder.push(token)?;
        let m = stops.push(&piece);
        out.write_all(m.emit.as_bytes())?;
        out.flush()?;
        if m.stopped.is_some() {
            reason = "stop";
            break;
        }
        if generated.len() == a.max_tokens {
            break;
        }
        logits = lm
            .forward(&[BatchItem {
                seq,
                tokens: &[token],
                logits: LogitsWanted::Last,
            }])?
            .remove(0);
    }
    if reason != "stop" {
        let tail = decoder.finish()?;
        let m = stops.push(&tail);
        out.write_all(m.emit.as_bytes())?;
        out.write_all(stops.finish().as_bytes())?;
    }
    writeln!(out)?;
    if a.verbose {
        let total = started.elapsed().as_secs_f64();
        eprintln!(
            "[{} prompt tokens, {} generated, stop: {reason}; prefill {:.1} tok/s, decode {:.1} tok/s]\n[ids: {:?}]",
            prompt.len(),
            generated.len(),
            prompt.len() as f64 / prefill_s,
            generated.len().saturating_sub(1) as f64 / (total - prefill_s).max(1e-9),
            generated
        );
    }
    Ok(())
}
