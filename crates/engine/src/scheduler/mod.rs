//! The scheduler: continuous batching of sequences over a [`crate::model::CausalLm`].
//!
//! One thread owns the model. Requests arrive through [`Scheduler::submit`], wait in a bounded
//! queue, and join the running batch between forward steps. Every step carries one token for
//! each decoding sequence plus at most `prefill_chunk` prompt tokens, so a long prompt is
//! prefilled in chunks interleaved with the decode steps of the others and their streams stay
//! smooth. Each request gets a [`GenerationStream`] of [`GenerationEvent`]s; dropping the
//! stream cancels the request and frees its sequence before the next step.
//!
//! With a prefix cache ([`SchedulerConfig::prefix_cache`]) a request resumes from the deepest
//! cached state of its prompt and prefills only the rest; prefill chunks then end on the
//! cache's block boundaries so states can be captured there, and every finished turn is
//! captured too (see [`crate::cache`]). With parking on ([`CacheConfig::max_parked`]) a
//! finished turn's sequence stays live on the model's device instead ([`parked`]): the
//! session's next request continues on it, nothing is copied, and only the new tokens are
//! computed; its state goes to the host cache only when it leaves the device (evicted, idle,
//! at shutdown), and requests resumed that way skip the captures within their prefill (the
//! shallow ones of fresh prompts stay, for prefixes shared across sessions). The cache's maintenance (idle sessions to disk) runs
//! about once a second, busy or not. When a request's session differs from the last one
//! admitted, the model is asked to prefetch that session's hot experts
//! ([`CausalLm::prefetch_experts`]); at the end of each turn the sequence's routing heat
//! ([`CausalLm::routing_heat`]) is merged into its session's.

pub mod forced;
mod parked;
pub mod scripted;

pub use forced::ThinkingBudget;

use crate::cache::{CacheConfig, PrefixCache};
use crate::model::{BatchItem, CausalLm, LogitsWanted, ModelInfo, SeqId};
use crate::sampling::{Sampler, SamplingParams, StopStringMatcher};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use tokio::sync::mpsc as tokio_mpsc;

/// Limits of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Sequences decoded together in one step.
    pub max_batch: usize,
    /// Requests that may wait for a free slot; one more is refused with [`SubmitError::Overloaded`].
    pub max_queue: usize,
    /// Prompt tokens prefilled per step (shared by all prefilling sequences).
    pub prefill_chunk: usize,
    /// Context length: prompt plus generated tokens of one sequence. Capped at the model's.
    pub max_context: usize,
    /// The prefix cache; `None` computes every prompt from scratch.
    pub prefix_cache: Option<CacheConfig>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_batch: 8,
            max_queue: 64,
            prefill_chunk: 256,
            max_context: usize::MAX,
            prefix_cache: None,
        }
    }
}

/// When generation ends besides the model's own end-of-sequence tokens.
#[derive(Debug, Clone, Default)]
pub struct StopConditions {
    /// Token ids that end generation (added to the model's eos ids); their text is not emitted.
    pub token_ids: Vec<u32>,
    /// Strings that end generation; the text from the match on is not emitted.
    pub strings: Vec<String>,
}

/// One generation job.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt_tokens: Vec<u32>,
    pub sampling: SamplingParams,
    /// Upper bound on generated tokens (the stop token included).
    pub max_tokens: usize,
    pub stop: StopConditions,
    /// Drop special tokens' text (`<|im_end|>` and the like) from the streamed text.
    pub skip_special_tokens: bool,
    /// Close the thinking block after this many tokens by forcing its closing tokens
    /// (see [`forced`]); `None`: the model thinks as long as it likes.
    pub thinking_budget: Option<ThinkingBudget>,
    /// The conversation this request continues (session affinity of the prefix cache);
    /// `None` lets the cache match it by prefix.
    pub cache_key: Option<String>,
}

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-sequence or stop token.
    StopToken(u32),
    /// A stop string matched (the index into the request's list and the string).
    StopString(usize, String),
    /// `max_tokens` were generated.
    MaxTokens,
    /// The sequence filled the context window.
    ContextFull,
}

impl FinishReason {
    /// True when the output was cut by a length limit rather than ended by the model.
    pub fn is_length(&self) -> bool {
        matches!(self, FinishReason::MaxTokens | FinishReason::ContextFull)
    }
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache (resumed, not computed).
    pub cached_tokens: usize,
}

/// What a [`GenerationStream`] yields.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// A sampled token and the text it completes (possibly empty: an incomplete UTF-8
    /// sequence, a special token, or text held back because it may begin a stop string).
    Token { id: u32, text: String },
    /// Generation ended; no event follows.
    Finished { reason: FinishReason, usage: Usage },
    /// Generation failed; no event follows.
    Error(String),
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is overloaded: {queued} requests are already waiting (limit {limit}); retry later")]
    Overloaded { queued: usize, limit: usize },
    #[error("the prompt has {prompt_tokens} tokens but the context window is {max_context} tokens; shorten the conversation")]
    ContextLength {
        prompt_tokens: usize,
        max_context: usize,
    },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("the scheduler has stopped")]
    Stopped,
}

/// The events of one request. Dropping it cancels the request.
pub struct GenerationStream {
    rx: tokio_mpsc::UnboundedReceiver<GenerationEvent>,
    prompt_tokens: usize,
    /// Sent once when the request is admitted: the prompt tokens resumed from the cache.
    admitted: Option<tokio::sync::oneshot::Receiver<usize>>,
    cached: Option<usize>,
}

impl GenerationStream {
    /// The next event; `None` after `Finished`/`Error` (or if the scheduler died).
    pub async fn recv(&mut self) -> Option<GenerationEvent> {
        self.rx.recv().await
    }

    /// Blocking variant for synchronous callers (not inside an async runtime).
    pub fn blocking_recv(&mut self) -> Option<GenerationEvent> {
        self.rx.blocking_recv()
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Waits until the request is admitted and returns the prompt tokens it resumed from the
    /// prefix cache (known only then; 0 without a cache). `None` when it never will be (the
    /// scheduler dropped it; `recv` then says why). Cancel-safe.
    pub async fn admitted(&mut self) -> Option<usize> {
        if let Some(rx) = &mut self.admitted {
            self.cached = rx.await.ok();
            self.admitted = None;
        }
        self.cached
    }
}

/// Counters, readable from any thread (rendered by the server's `/metrics`).
#[derive(Debug, Default)]
pub struct SchedulerMetrics {
    pub requests_total: AtomicU64,
    pub requests_rejected_total: AtomicU64,
    pub requests_cancelled_total: AtomicU64,
    pub requests_finished_total: AtomicU64,
    pub requests_failed_total: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub generated_tokens_total: AtomicU64,
    pub cached_prompt_tokens_total: AtomicU64,
    pub prefix_cache_hits_total: AtomicU64,
    pub prefix_cache_misses_total: AtomicU64,
    /// Hits served by a parked sequence (also counted in `prefix_cache_hits_total`).
    pub prefix_cache_parked_hits_total: AtomicU64,
    pub forward_steps_total: AtomicU64,
    pub queue_depth: AtomicUsize,
    pub active_sequences: AtomicUsize,
}

struct Pending {
    request: GenerationRequest,
    tx: tokio_mpsc::UnboundedSender<GenerationEvent>,
    admitted: tokio::sync::oneshot::Sender<usize>,
}

/// Handle to the scheduler thread. Dropping it stops the thread after the current step.
pub struct Scheduler {
    tx: Option<mpsc::Sender<Pending>>,
    metrics: Arc<SchedulerMetrics>,
    info: ModelInfo,
    config: SchedulerConfig,
    cache: Option<Arc<Mutex<PrefixCache>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the scheduler thread; it owns `model` from now on.
    pub fn start(
        model: Box<dyn CausalLm>,
        tokenizer: Arc<Tokenizer>,
        mut config: SchedulerConfig,
    ) -> Scheduler {
        let info = model.info().clone();
        config.max_context = config.max_context.min(info.max_context).max(1);
        config.max_batch = config.max_batch.max(1);
        config.prefill_chunk = config.prefill_chunk.max(1);
        let metrics = Arc::new(SchedulerMetrics::default());
        let cache = config.prefix_cache.clone().map(|c| {
            let with_disk = c.disk_dir.clone();
            let cache = PrefixCache::new(c.clone()).unwrap_or_else(|e| {
                tracing::error!(
                    "prefix cache: disk offload to {:?} is off: {e:#}",
                    with_disk
                );
                PrefixCache::new(CacheConfig {
                    disk_dir: None,
                    ..c
                })
                .expect("a RAM-only prefix cache needs no I/O")
            });
            Arc::new(Mutex::new(cache))
        });
        let (tx, rx) = mpsc::channel();
        let thread_metrics = metrics.clone();
        let thread_config = config.clone();
        let thread_cache = cache.clone();
        let thread = std::thread::Builder::new()
            .name("capy-scheduler".into())
            .spawn(move || {
                run_loop(
                    model,
                    &tokenizer,
                    thread_config,
                    rx,
                    &thread_metrics,
                    thread_cache.as_deref(),
                )
            })
            .expect("spawning the scheduler thread");
        Scheduler {
            tx: Some(tx),
            metrics,
            info,
            config,
            cache,
            thread: Some(thread),
        }
    }

    /// The prefix cache, shared with the admin endpoints (locked briefly per request).
    pub fn cache(&self) -> Option<&Arc<Mutex<PrefixCache>>> {
        self.cache.as_ref()
    }

    pub fn model_info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn metrics(&self) -> &SchedulerMetrics {
        &self.metrics
    }

    /// Checks the request and queues it. Errors come before any model work.
    pub fn submit(&self, request: GenerationRequest) -> Result<GenerationStream, SubmitError> {
        let prompt_tokens = request.prompt_tokens.len();
        let m = &self.metrics;
        if prompt_tokens == 0 {
            return Err(SubmitError::Invalid(
                "the prompt is empty: it has no tokens".into(),
            ));
        }
        if prompt_tokens >= self.config.max_context {
            m.requests_rejected_total.fetch_add(1, Ordering::Relaxed);
            return Err(SubmitError::ContextLength {
                prompt_tokens,
                max_context: self.config.max_context,
            });
        }
        if let Some(bad) = request
            .prompt_tokens
            .iter()
            .find(|&&t| t as usize >= self.info.vocab_size)
        {
            return Err(SubmitError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {} ids",
                self.info.vocab_size
            )));
        }
        if request.max_tokens == 0 {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        request.sampling.validate().map_err(SubmitError::Invalid)?;
        // Reserve a queue place, or refuse.
        let limit = self.config.max_queue;
        let reserved = m
            .queue_depth
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < limit).then_some(q + 1)
            });
        if let Err(queued) = reserved {
            m.requests_rejected_total.fetch_add(1, Ordering::Relaxed);
            return Err(SubmitError::Overloaded { queued, limit });
        }
        let (tx, rx) = tokio_mpsc::unbounded_channel();
        let (admitted_tx, admitted) = tokio::sync::oneshot::channel();
        let sender = self.tx.as_ref().ok_or(SubmitError::Stopped)?;
        let pending = Pending {
            request,
            tx,
            admitted: admitted_tx,
        };
        if sender.send(pending).is_err() {
            m.queue_depth.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::Stopped);
        }
        m.requests_total.fetch_add(1, Ordering::Relaxed);
        Ok(GenerationStream {
            rx,
            prompt_tokens,
            admitted: Some(admitted),
            cached: None,
        })
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One admitted sequence.
struct Active<'t> {
    seq: SeqId,
    tx: tokio_mpsc::UnboundedSender<GenerationEvent>,
    prompt: Vec<u32>,
    /// Prompt tokens already in the model's state.
    prefilled: usize,
    /// The last sampled token, fed in the next decode step.
    next_input: Option<u32>,
    generated: usize,
    max_tokens: usize,
    stop_ids: Vec<u32>,
    sampler: Sampler,
    stops: StopStringMatcher,
    stop_strings: Vec<String>,
    decoder: StreamDecoder<'t>,
    /// Tokens emitted next instead of sampled ones (the thinking budget's closing tokens).
    forced: forced::ForcedTokens,
    /// Set when the sequence is done (finished, failed or cancelled) and must be freed.
    done: bool,
    /// Set when generation failed: the state is not captured.
    failed: bool,
    /// Prefix cache: the session its entries belong to (`None` without a cache).
    session: Option<String>,
    /// Prompt tokens resumed from the cache.
    cached: usize,
    /// Generated tokens fed back into the model (the state holds `prompt[..prefilled] ++ fed`).
    fed: Vec<u32>,
    /// Parking: the prompt position of the model checkpoint (the last block boundary before
    /// the prompt's end, or the resumed position when past it); `None`: not parked at the end.
    checkpoint_at: Option<usize>,
    /// The checkpoint was taken (the sequence can be parked at the end).
    checkpointed: bool,
    /// Resumed from a parked sequence: no captures within the prefill (its own next turn
    /// resumes from the parked sequence).
    from_parked: bool,
}

impl Active<'_> {
    /// The tokens in the model's state: `prompt[..prefilled] ++ fed`.
    fn state_tokens(&self) -> Vec<u32> {
        let fed: &[u32] = if self.prefilled == self.prompt.len() {
            &self.fed
        } else {
            &[]
        };
        let mut tokens = Vec::with_capacity(self.prefilled + fed.len());
        tokens.extend_from_slice(&self.prompt[..self.prefilled]);
        tokens.extend_from_slice(fed);
        tokens
    }

    /// Takes the model checkpoint when the prefill has reached its position.
    fn checkpoint_if_due(&mut self, model: &mut dyn CausalLm) {
        if self.checkpointed || self.checkpoint_at != Some(self.prefilled) {
            return;
        }
        match model.checkpoint(self.seq) {
            Ok(len) if len == self.prefilled => self.checkpointed = true,
            Ok(len) => {
                tracing::warn!(
                    "prefix cache: the model checkpointed {len} tokens, expected {}; the sequence will not be parked",
                    self.prefilled
                );
                self.checkpoint_at = None;
            }
            Err(e) => {
                tracing::debug!("prefix cache: no parking for this model: {e:#}");
                self.checkpoint_at = None;
            }
        }
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt.len(),
            completion_tokens: self.generated,
            cached_tokens: self.cached,
        }
    }

    fn finish(&mut self, reason: FinishReason, metrics: &SchedulerMetrics) {
        let usage = self.usage();
        let _ = self.tx.send(GenerationEvent::Finished { reason, usage });
        metrics
            .requests_finished_total
            .fetch_add(1, Ordering::Relaxed);
        self.done = true;
    }

    fn fail(&mut self, message: String, metrics: &SchedulerMetrics) {
        let _ = self.tx.send(GenerationEvent::Error(message));
        metrics
            .requests_failed_total
            .fetch_add(1, Ordering::Relaxed);
        self.done = true;
        self.failed = true;
    }

    /// Handles one sampled token: stop checks, detokenization, emission.
    fn on_token(&mut self, token: u32, max_context: usize, metrics: &SchedulerMetrics) {
        self.generated += 1;
        self.forced.observe(token);
        self.sampler.accept(token);
        metrics
            .generated_tokens_total
            .fetch_add(1, Ordering::Relaxed);
        if self.stop_ids.contains(&token) {
            let tail = self.flush_text();
            if !tail.is_empty() {
                let _ = self.tx.send(GenerationEvent::Token {
                    id: token,
                    text: tail,
                });
            }
            return self.finish(FinishReason::StopToken(token), metrics);
        }
        let piece = match self.decoder.push(token) {
            Ok(p) => p,
            Err(e) => return self.fail(format!("detokenizing token {token}: {e:#}"), metrics),
        };
        let m = self.stops.push(&piece);
        if let Some(i) = m.stopped {
            let _ = self.tx.send(GenerationEvent::Token {
                id: token,
                text: m.emit,
            });
            let s = self.stop_strings[i].clone();
            return self.finish(FinishReason::StopString(i, s), metrics);
        }
        let length_reason = if self.generated >= self.max_tokens {
            Some(FinishReason::MaxTokens)
        } else if self.prompt.len() + self.generated >= max_context {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        let mut text = m.emit;
        if length_reason.is_some() {
            text.push_str(&self.flush_text());
        }
        let _ = self.tx.send(GenerationEvent::Token { id: token, text });
        match length_reason {
            Some(r) => self.finish(r, metrics),
            None => self.next_input = Some(token),
        }
    }

    /// Text still buffered in the detokenizer and the stop matcher.
    fn flush_text(&mut self) -> String {
        let rest = self.decoder.finish().unwrap_or_default();
        let mut out = self.stops.push(&rest).emit;
        out.push_str(&self.stops.finish());
        out
    }
}

fn run_loop(
    mut model: Box<dyn CausalLm>,
    tokenizer: &Tokenizer,
    config: SchedulerConfig,
    rx: mpsc::Receiver<Pending>,
    metrics: &SchedulerMetrics,
    cache: Option<&Mutex<PrefixCache>>,
) {
    let mut waiting: VecDeque<Pending> = VecDeque::new();
    let mut active: Vec<Active<'_>> = Vec::new();
    let eos = model.info().eos_token_ids.clone();
    let mut disconnected = false;
    // The session admitted last (its experts are the warm ones).
    let mut last_session: Option<String> = None;
    let mut last_maintain = std::time::Instant::now();
    let mut parked = match &config.prefix_cache {
        Some(c) => parked::ParkedSet::new(c.max_parked, c.parked_bytes),
        None => parked::ParkedSet::new(0, 0),
    };
    loop {
        // Block size and capture spacing of the prefix cache (`None` while it is off).
        let blocks = cache.and_then(|c| {
            let c = lock(c);
            c.is_enabled()
                .then(|| (c.block_tokens(), c.config().capture_every_blocks))
        });
        if let (Some(c), None) = (cache, blocks) {
            // Switched off: nothing is resumed, so parked sequences only hold device memory.
            for p in parked.take_all() {
                discard_parked(c, model.as_mut(), p);
            }
        }
        // Idle sessions move down a tier even while others keep the model busy.
        if let Some(c) = cache {
            if last_maintain.elapsed() >= MAINTAIN_EVERY {
                let idle = lock(c).config().idle;
                for p in parked.take_idle(idle) {
                    retire_parked(c, model.as_mut(), p);
                }
                lock(c).maintain();
                last_maintain = std::time::Instant::now();
            }
        }
        // 1. Take new requests: block when idle, poll otherwise. While idle, the cache moves
        //    idle sessions down a tier.
        if active.is_empty() && waiting.is_empty() {
            if disconnected {
                if let Some(c) = cache {
                    shut_down_cache(c, model.as_mut(), &mut parked);
                }
                return;
            }
            // With a cache, wake up for its maintenance (disk offload may be switched on at
            // run time, and sessions become idle while nothing arrives).
            let got = if cache.is_some() {
                rx.recv_timeout(MAINTAIN_EVERY)
            } else {
                rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected)
            };
            match got {
                Ok(p) => waiting.push_back(p),
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    if let Some(c) = cache {
                        shut_down_cache(c, model.as_mut(), &mut parked);
                    }
                    return;
                }
            }
        }
        loop {
            match rx.try_recv() {
                Ok(p) => waiting.push_back(p),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            }
        }
        // 2. Admit into free slots; skip requests whose client already left.
        while active.len() < config.max_batch {
            let Some(p) = waiting.pop_front() else { break };
            metrics.queue_depth.fetch_sub(1, Ordering::AcqRel);
            if p.tx.is_closed() {
                metrics
                    .requests_cancelled_total
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let r = p.request;
            metrics
                .prompt_tokens_total
                .fetch_add(r.prompt_tokens.len() as u64, Ordering::Relaxed);
            let mut stop_ids = eos.clone();
            stop_ids.extend(r.stop.token_ids.iter().copied());
            let resumed = match cache {
                Some(c) => resume(
                    c,
                    model.as_mut(),
                    &mut parked,
                    &r,
                    metrics,
                    &mut last_session,
                ),
                None => Resumed {
                    seq: model.new_sequence(),
                    session: None,
                    cached: 0,
                    from_parked: false,
                },
            };
            let cached = resumed.cached;
            let _ = p.admitted.send(cached);
            // Parking: checkpoint at the last block boundary before the prompt's end (where
            // prefill chunks end anyway), or right away when resumed past it.
            let checkpoint_at = match blocks {
                Some((block, _)) if parked.enabled() => {
                    Some(((r.prompt_tokens.len() - 1) / block * block).max(cached))
                }
                _ => None,
            };
            active.push(Active {
                seq: resumed.seq,
                failed: false,
                session: resumed.session,
                cached,
                fed: Vec::new(),
                checkpoint_at,
                checkpointed: false,
                from_parked: resumed.from_parked,
                tx: p.tx,
                sampler: Sampler::new(r.sampling, &r.prompt_tokens),
                prompt: r.prompt_tokens,
                prefilled: cached,
                next_input: None,
                generated: 0,
                max_tokens: r.max_tokens,
                stop_ids,
                stops: StopStringMatcher::new(r.stop.strings.clone()),
                stop_strings: r
                    .stop
                    .strings
                    .into_iter()
                    .filter(|s| !s.is_empty())
                    .collect(),
                decoder: tokenizer.stream_decoder(r.skip_special_tokens),
                forced: forced::ForcedTokens::new(r.thinking_budget),
                done: false,
            });
            if let Some(a) = active.last_mut() {
                a.checkpoint_if_due(model.as_mut());
            }
        }
        metrics
            .active_sequences
            .store(active.len(), Ordering::Relaxed);
        // 3. Free cancelled sequences at once.
        for a in active.iter_mut() {
            if a.tx.is_closed() {
                metrics
                    .requests_cancelled_total
                    .fetch_add(1, Ordering::Relaxed);
                a.done = true;
            }
        }
        free_done(&mut active, model.as_mut(), metrics, cache, &mut parked);
        if active.is_empty() {
            continue;
        }
        // 4. Plan the step: every decoding sequence's last token, then prompt chunks up to the
        //    prefill budget, oldest request first.
        let mut plan: Vec<Planned> = Vec::with_capacity(active.len());
        for (i, a) in active.iter().enumerate() {
            if a.next_input.is_some() {
                plan.push(Planned {
                    index: i,
                    decode: true,
                    end: 0,
                });
            }
        }
        let mut budget = config.prefill_chunk;
        for (i, a) in active.iter().enumerate() {
            if a.next_input.is_none() && budget > 0 {
                let mut end = a.prefilled + (a.prompt.len() - a.prefilled).min(budget);
                if let Some((block, _)) = blocks {
                    // End on a block boundary (at most the last one before the prompt's end)
                    // so the state there can be captured.
                    let boundary = end.min(a.prompt.len() - 1) / block * block;
                    if boundary > a.prefilled {
                        end = boundary;
                    }
                }
                budget -= end - a.prefilled;
                plan.push(Planned {
                    index: i,
                    decode: false,
                    end,
                });
            }
        }
        let decode_tokens: Vec<[u32; 1]> =
            active.iter().map(|a| [a.next_input.unwrap_or(0)]).collect();
        let batch: Vec<BatchItem<'_>> = plan
            .iter()
            .map(|p| {
                let a = &active[p.index];
                if p.decode {
                    BatchItem {
                        seq: a.seq,
                        tokens: &decode_tokens[p.index],
                        logits: LogitsWanted::Last,
                    }
                } else {
                    let logits = if p.end == a.prompt.len() {
                        LogitsWanted::Last
                    } else {
                        LogitsWanted::None
                    };
                    BatchItem {
                        seq: a.seq,
                        tokens: &a.prompt[a.prefilled..p.end],
                        logits,
                    }
                }
            })
            .collect();
        // 5. Run it, then sample for every item that asked for logits: where every such item
        //    samples greedily, the model picks the tokens (on its device) and returns no logits.
        let greedy = plan.iter().zip(&batch).all(|(p, item)| {
            item.logits == LogitsWanted::None || active[p.index].sampler.params().is_plain_greedy()
        });
        let result: anyhow::Result<Vec<StepOutput>> = if greedy {
            model
                .forward_greedy(&batch, tokenizer.vocab_size())
                .map(|picks| picks.into_iter().map(StepOutput::Greedy).collect())
        } else {
            model
                .forward(&batch)
                .map(|logits| logits.into_iter().map(StepOutput::Logits).collect())
        };
        drop(batch);
        metrics.forward_steps_total.fetch_add(1, Ordering::Relaxed);
        match result {
            Err(e) => {
                let msg = format!("model forward failed: {e:#}");
                tracing::error!("{msg}");
                for p in &plan {
                    active[p.index].fail(msg.clone(), metrics);
                }
            }
            Ok(mut outputs) => {
                if outputs.len() != plan.len() {
                    let msg = format!(
                        "the model returned {} outputs for a batch of {}",
                        outputs.len(),
                        plan.len()
                    );
                    for p in &plan {
                        active[p.index].fail(msg.clone(), metrics);
                    }
                }
                for (p, output) in plan.iter().zip(outputs.iter_mut()) {
                    let a = &mut active[p.index];
                    if a.done {
                        continue;
                    }
                    if p.decode {
                        a.fed.extend(a.next_input.take());
                    } else {
                        a.prefilled = p.end;
                        if p.end < a.prompt.len() {
                            a.checkpoint_if_due(model.as_mut());
                            if let (Some(c), Some(blocks)) = (cache, blocks) {
                                if captures_here(a, blocks) {
                                    capture(c, &*model, a);
                                }
                            }
                            continue;
                        }
                    }
                    let logits = match output {
                        StepOutput::Logits(logits) => logits,
                        &mut StepOutput::Greedy(Some(t)) => {
                            let t = a.forced.pop_next().unwrap_or(t);
                            a.on_token(t, config.max_context, metrics);
                            continue;
                        }
                        StepOutput::Greedy(None) => {
                            a.fail(
                                "the model picked no token for a sequence that asked for one"
                                    .into(),
                                metrics,
                            );
                            continue;
                        }
                    };
                    if logits.len() < model_vocab(&*model) {
                        a.fail(
                            format!(
                                "the model returned {} logits, expected the vocabulary size {}",
                                logits.len(),
                                model_vocab(&*model)
                            ),
                            metrics,
                        );
                        continue;
                    }
                    // Ids the tokenizer cannot decode (the padding rows of an embedding table)
                    // are never sampled (a greedy pass is limited to the same ids).
                    if let Some(pad) = logits.get_mut(tokenizer.vocab_size()..) {
                        pad.fill(f32::NEG_INFINITY);
                    }
                    let t = match a.forced.pop_next() {
                        Some(t) => t,
                        None => a.sampler.sample(logits),
                    };
                    a.on_token(t, config.max_context, metrics);
                }
            }
        }
        free_done(&mut active, model.as_mut(), metrics, cache, &mut parked);
    }
}

/// Whether the prefill of `a`, just past `a.prefilled`, is captured into the host cache there
/// (`blocks`: block size and capture spacing). On every `every`-th block boundary, for
/// prefixes shared across sessions, unless resumed from a parked sequence (its prompt is its
/// own conversation's); on the last boundary before the prompt's end when the sequence will
/// not be parked, so that the next turn resumes there.
fn captures_here(a: &Active<'_>, (block, every): (usize, usize)) -> bool {
    let at = a.prefilled;
    if !at.is_multiple_of(block) {
        return false;
    }
    let shared = !a.from_parked && shared_capture_at(at, block, every);
    let last = (a.prompt.len() - 1) / block * block;
    shared || (at == last && !a.checkpointed)
}

/// Prompt tokens up to which shared-prefix snapshots are taken every `every` blocks; past it
/// only at doublings of that spacing. A snapshot copies the whole state to the host (4 GB at
/// 30K tokens of the 27B, about 0.5 s on the H200 box), so a long cold prompt would otherwise
/// spend more time capturing than computing; the prefixes sessions share (system prompt and
/// tools) sit mostly in the first few thousand tokens.
pub const REGULAR_CAPTURE_TOKENS: usize = 8192;

/// Whether block boundary `at` (a multiple of `block`) gets a shared-prefix snapshot.
fn shared_capture_at(at: usize, block: usize, every: usize) -> bool {
    let blocks = at / block;
    if at == 0 || !blocks.is_multiple_of(every) {
        return false;
    }
    at <= REGULAR_CAPTURE_TOKENS || (blocks / every).is_power_of_two()
}

/// What a step's pass returned for one item: its logits, or (a greedy pass) its token.
enum StepOutput {
    Logits(Vec<f32>),
    Greedy(Option<u32>),
}

/// One sequence's part of a step.
struct Planned {
    index: usize,
    decode: bool,
    /// For prefill: the prompt position this chunk ends at.
    end: usize,
}

fn model_vocab(model: &dyn CausalLm) -> usize {
    model.info().vocab_size
}

/// How often the prefix cache's maintenance runs.
const MAINTAIN_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

fn free_done(
    active: &mut Vec<Active<'_>>,
    model: &mut dyn CausalLm,
    metrics: &SchedulerMetrics,
    cache: Option<&Mutex<PrefixCache>>,
    parked: &mut parked::ParkedSet,
) {
    active.retain(|a| {
        if !a.done {
            return true;
        }
        // The end of a turn: keep the state, and the experts it used, for the next one.
        let Some(c) = cache.filter(|_| !a.failed) else {
            model.drop_sequence(a.seq);
            return false;
        };
        if let (Some(heat), Some(s)) = (model.routing_heat(a.seq), &a.session) {
            lock(c).merge_heat(s, &heat);
        }
        match park(model, parked, a) {
            Ok(evicted) => {
                for p in evicted {
                    retire_parked(c, model, p);
                }
                // Listed after the evictions: one of them may be the session's older turn.
                if let (true, Some(s)) = (parked.contains(a.seq), &a.session) {
                    let bytes = model.state_bytes(a.seq).unwrap_or(0);
                    let tokens = model.sequence_len(a.seq).unwrap_or(0);
                    lock(c).set_parked(s, Some((tokens, bytes)));
                }
            }
            Err(()) => {
                capture(c, model, a);
                model.drop_sequence(a.seq);
            }
        }
        false
    });
    metrics
        .active_sequences
        .store(active.len(), Ordering::Relaxed);
}

fn lock(c: &Mutex<PrefixCache>) -> std::sync::MutexGuard<'_, PrefixCache> {
    // A panic while holding the lock leaves a consistent index (no partial updates escape).
    c.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where an admitted request starts.
struct Resumed {
    seq: SeqId,
    /// The session its entries belong to (`None` without a cache).
    session: Option<String>,
    /// Prompt tokens resumed (in the state already).
    cached: usize,
    /// Continued on a parked sequence.
    from_parked: bool,
}

/// Finds the request's deepest resumable state: a parked sequence (continued as it is, or
/// after a rollback to its checkpoint) unless the host cache holds a deeper one, else the
/// host cache's deepest entry loaded into a new sequence.
fn resume(
    cache: &Mutex<PrefixCache>,
    model: &mut dyn CausalLm,
    parked: &mut parked::ParkedSet,
    r: &GenerationRequest,
    metrics: &SchedulerMetrics,
    last_session: &mut Option<String>,
) -> Resumed {
    let mut c = lock(cache);
    let prompt = &r.prompt_tokens;
    let key = r.cache_key.as_deref();
    let best = parked
        .best_for(prompt, key)
        .filter(|m| c.is_enabled() && m.depth >= c.deepest_len(prompt, prompt.len() - 1));
    if let Some(m) = best {
        let p = parked.take(m.index);
        c.set_parked(&p.session, None);
        match continue_parked(model, &p, m) {
            Ok(()) => {
                let session = c.resume_parked(key, &p.session, m.depth);
                returning_session(&c, model, &session, last_session);
                count_hit(metrics, m.depth);
                metrics
                    .prefix_cache_parked_hits_total
                    .fetch_add(1, Ordering::Relaxed);
                return Resumed {
                    seq: p.seq,
                    session: Some(session),
                    cached: m.depth,
                    from_parked: true,
                };
            }
            Err(e) => {
                tracing::warn!("prefix cache: a parked sequence could not continue: {e:#}");
                model.drop_sequence(p.seq);
            }
        }
    }
    let seq = model.new_sequence();
    let begin = c.begin(prompt, prompt.len() - 1, key);
    returning_session(&c, model, &begin.session, last_session);
    let mut cached = 0;
    if let Some(hit) = begin.hit {
        let started = std::time::Instant::now();
        match model.import_state(seq, &hit.state) {
            Ok(()) => {
                cached = hit.len;
                tracing::info!(
                    target: "capy::cache",
                    tokens = hit.len,
                    bytes = hit.state.bytes(),
                    tier = ?hit.tier,
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    "import: state loaded into the model"
                );
            }
            Err(e) => {
                tracing::warn!("prefix cache: a cached state did not load, recomputing: {e:#}");
                c.discard(hit.entry);
            }
        }
    }
    if cached > 0 {
        count_hit(metrics, cached);
    } else {
        metrics
            .prefix_cache_misses_total
            .fetch_add(1, Ordering::Relaxed);
    }
    Resumed {
        seq,
        session: Some(begin.session),
        cached,
        from_parked: false,
    }
}

fn count_hit(metrics: &SchedulerMetrics, cached: usize) {
    metrics
        .prefix_cache_hits_total
        .fetch_add(1, Ordering::Relaxed);
    metrics
        .cached_prompt_tokens_total
        .fetch_add(cached as u64, Ordering::Relaxed);
}

/// A session becoming active again: its hot experts first.
fn returning_session(
    c: &PrefixCache,
    model: &mut dyn CausalLm,
    session: &str,
    last_session: &mut Option<String>,
) {
    if last_session.as_deref() != Some(session) {
        let heat = c.heat_of(session);
        if !heat.is_empty() {
            model.prefetch_experts(&heat);
        }
        *last_session = Some(session.to_string());
    }
}

/// Readies a parked sequence to continue at `m.depth` tokens (rolled back to its checkpoint
/// when the prompt leaves its tokens after it).
fn continue_parked(
    model: &mut dyn CausalLm,
    p: &parked::Parked,
    m: parked::ParkedMatch,
) -> anyhow::Result<()> {
    let len = if m.rollback {
        model.rollback(p.seq)?
    } else {
        model.sequence_len(p.seq).unwrap_or(0)
    };
    if len != m.depth {
        anyhow::bail!(
            "the parked sequence holds {len} tokens, expected {} (its token list is out of step)",
            m.depth
        );
    }
    Ok(())
}

/// Parks a finished sequence for its session's next turn; returns the parked sequences that
/// must leave to make room. `Err` when it cannot be parked (parking off, no checkpoint, no
/// session, or its state is not the tokens it should hold): the caller captures it instead.
fn park(
    model: &dyn CausalLm,
    parked: &mut parked::ParkedSet,
    a: &Active<'_>,
) -> Result<Vec<parked::Parked>, ()> {
    let (Some(session), Some(checkpoint), true) = (&a.session, a.checkpoint_at, a.checkpointed)
    else {
        return Err(());
    };
    let tokens = a.state_tokens();
    if !parked.enabled() || model.sequence_len(a.seq) != Some(tokens.len()) {
        return Err(());
    }
    Ok(parked.park(parked::Parked {
        seq: a.seq,
        session: session.clone(),
        tokens,
        checkpoint,
        bytes: model.state_bytes(a.seq),
        last_used: std::time::Instant::now(),
    }))
}

/// A parked sequence leaves the device: its state goes to the RAM tier (the tip, then the
/// checkpoint at its prompt's end, which a re-rendered next prompt resumes from), once.
fn retire_parked(cache: &Mutex<PrefixCache>, model: &mut dyn CausalLm, p: parked::Parked) {
    let mut c = lock(cache);
    c.set_parked(&p.session, None);
    export(&mut c, model, &p.session, p.seq, &p.tokens);
    if p.checkpoint < p.tokens.len() {
        match model.rollback(p.seq) {
            Ok(_) => export(&mut c, model, &p.session, p.seq, &p.tokens[..p.checkpoint]),
            Err(e) => tracing::debug!("prefix cache: the checkpoint was not exported: {e:#}"),
        }
    }
    drop(c);
    model.drop_sequence(p.seq);
}

/// Drops a parked sequence without keeping its state (the cache was switched off).
fn discard_parked(cache: &Mutex<PrefixCache>, model: &mut dyn CausalLm, p: parked::Parked) {
    lock(cache).set_parked(&p.session, None);
    model.drop_sequence(p.seq);
}

/// The scheduler stops: parked sequences go to the host cache, whose sessions are written to
/// disk (when it is on) so that they are found again after a restart.
fn shut_down_cache(
    cache: &Mutex<PrefixCache>,
    model: &mut dyn CausalLm,
    parked: &mut parked::ParkedSet,
) {
    for p in parked.take_all() {
        retire_parked(cache, model, p);
    }
    lock(cache).flush_to_disk();
}

/// Stores the state of `a` (holding `prompt[..prefilled] ++ fed`).
fn capture(cache: &Mutex<PrefixCache>, model: &dyn CausalLm, a: &Active<'_>) {
    let Some(session) = &a.session else { return };
    export(&mut lock(cache), model, session, a.seq, &a.state_tokens());
}

/// Copies the state of `seq` (holding exactly `tokens`) into the host cache, unless an entry
/// holds these tokens already.
fn export(c: &mut PrefixCache, model: &dyn CausalLm, session: &str, seq: SeqId, tokens: &[u32]) {
    if !c.wants(tokens) || model.sequence_len(seq) != Some(tokens.len()) {
        return;
    }
    let started = std::time::Instant::now();
    match model.export_state(seq) {
        Ok(state) => {
            let exported = started.elapsed();
            let bytes = state.bytes();
            c.insert(session, tokens, state);
            tracing::info!(
                target: "capy::cache",
                tokens = tokens.len(),
                bytes,
                export_ms = exported.as_secs_f64() * 1e3,
                insert_ms = (started.elapsed() - exported).as_secs_f64() * 1e3,
                "export: state captured into the RAM tier"
            );
        }
        Err(e) => tracing::debug!("prefix cache: not captured: {e:#}"),
    }
}

#[cfg(test)]
mod tests;
