//! What every handler shares: the scheduler, the tokenizer and template, settings, counters.

use capy_engine::chat_template::ChatTemplate;
use capy_engine::scheduler::Scheduler;
use capy_engine::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The port `capy-flash serve` listens on unless told otherwise.
pub const DEFAULT_PORT: u16 = 8439;
/// Default request body limit: long agent conversations are large, images are not supported.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// Settings of the HTTP layer.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// When set, every request but `/health` needs it (`Authorization: Bearer` or `x-api-key`).
    pub api_key: Option<String>,
    /// Interval of keep-alive events while a stream waits (long prefills).
    pub keepalive: Duration,
    pub max_body_bytes: usize,
    /// Origins allowed by CORS (the web UI's own); empty means no CORS headers.
    pub cors_origins: Vec<String>,
    /// Seconds suggested in `retry-after` when overloaded.
    pub retry_after_s: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            keepalive: Duration::from_secs(5),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            cors_origins: Vec::new(),
            retry_after_s: 1,
        }
    }
}

/// HTTP-level counters for `/metrics`.
#[derive(Debug, Default)]
pub struct HttpMetrics {
    pub chat_completions: AtomicU64,
    pub responses: AtomicU64,
    pub messages: AtomicU64,
    pub count_tokens: AtomicU64,
    pub errors: AtomicU64,
}

pub struct AppState {
    pub scheduler: Scheduler,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// The loaded model's id, reported whatever name a client asked for.
    pub model_id: String,
    pub config: ServerConfig,
    pub created_unix: u64,
    pub http: HttpMetrics,
    /// Claude Code session ids seen (`X-Claude-Code-Session-Id`) → requests, for session
    /// affinity of the prefix cache.
    pub sessions: Mutex<HashMap<String, u64>>,
}

impl AppState {
    pub fn new(
        scheduler: Scheduler,
        tokenizer: Arc<Tokenizer>,
        template: Option<ChatTemplate>,
        model_id: String,
        config: ServerConfig,
    ) -> Self {
        let created_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        AppState {
            scheduler,
            tokenizer,
            template,
            model_id,
            config,
            created_unix,
            http: HttpMetrics::default(),
            sessions: Mutex::new(HashMap::new()),
        }
    }

    pub fn record_session(&self, id: &str) {
        if let Ok(mut s) = self.sessions.lock() {
            *s.entry(id.to_string()).or_insert(0) += 1;
        }
    }

    pub fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A random id with the API's prefix (`msg_`, `chatcmpl-`, `resp_`, …).
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}
