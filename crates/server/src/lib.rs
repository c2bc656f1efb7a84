//! Capy Flash HTTP server: one axum router, one adapter per API (OpenAI chat completions,
//! OpenAI Responses, Anthropic Messages) over a shared scheduler.
//!
//! Request flow: adapter (`openai_chat`, `openai_responses`, `anthropic_messages`) →
//! [`normalize::ChatRequest`] → chat template → tokens → scheduler → [`generate`] (output
//! [`parser`]) → the adapter's events, written as SSE by [`sse`]. Everything but the adapters is
//! shared.

pub mod admin;
pub mod anthropic_messages;
pub mod error;
pub mod generate;
pub mod normalize;
pub mod openai_chat;
pub mod openai_responses;
pub mod parser;
pub mod sse;
pub mod state;
pub mod ui;

pub use state::{AppState, ServerConfig, DEFAULT_PORT};

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use error::{ApiError, ErrorKind, Flavor};
use serde_json::json;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The full router: every endpoint, the API-key check, the body limit and CORS.
pub fn router(state: Arc<AppState>) -> Router {
    let cors = cors_layer(&state.config.cors_origins);
    let limit = state.config.max_body_bytes;
    let mut r = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route("/v1/chat/completions", post(openai_chat::handle))
        .route("/v1/responses", post(openai_responses::handle))
        .route(
            "/v1/responses/input_tokens",
            post(openai_responses::input_tokens),
        )
        .route("/v1/messages", post(anthropic_messages::handle))
        .route(
            "/v1/messages/count_tokens",
            post(anthropic_messages::count_tokens),
        )
        .merge(admin::routes())
        .merge(ui::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), check_api_key));
    if let Some(cors) = cors {
        r = r.layer(cors);
    }
    r.with_state(state)
}

fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    let values: Vec<HeaderValue> = origins
        .iter()
        .filter_map(|o| HeaderValue::from_str(o).ok())
        .collect();
    if values.is_empty() {
        return None;
    }
    Some(
        tower_http::cors::CorsLayer::new()
            .allow_origin(values)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([
                header::CONTENT_TYPE,
                header::AUTHORIZATION,
                header::HeaderName::from_static("x-api-key"),
            ]),
    )
}

async fn check_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = state.config.api_key.as_deref() else {
        return next.run(req).await;
    };
    // The dashboard's files are public; its /admin calls carry the key.
    if req.uri().path() == "/health"
        || req.uri().path().starts_with("/ui")
        || req.method() == Method::OPTIONS
    {
        return next.run(req).await;
    }
    let h = req.headers();
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let x_api_key = h
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    if bearer == Some(key) || x_api_key == Some(key) {
        return next.run(req).await;
    }
    AppState::count(&state.http.errors);
    let flavor = Flavor::for_path(req.uri().path());
    let message = if bearer.is_none() && x_api_key.is_none() {
        "this server needs an API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`"
    } else {
        "invalid API key"
    };
    ApiError::new(flavor, ErrorKind::Authentication, message).into_response()
}

async fn not_found(req: Request) -> ApiError {
    let path = req.uri().path().to_string();
    ApiError::new(
        Flavor::for_path(&path),
        ErrorKind::NotFound,
        format!("Invalid URL ({} {path}): no such endpoint", req.method()),
    )
}

async fn method_not_allowed(req: Request) -> ApiError {
    let path = req.uri().path().to_string();
    ApiError::new(
        Flavor::for_path(&path),
        ErrorKind::MethodNotAllowed,
        format!("method {} is not allowed on {path}", req.method()),
    )
}

async fn health(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"status": "ok", "model": state.model_id}))
}

fn model_json(state: &AppState) -> serde_json::Value {
    let info = state.scheduler.model_info();
    json!({
        "id": state.model_id, "object": "model", "created": state.created_unix, "owned_by": "capy-flash",
        "type": "model", "display_name": state.model_id,
        "context_length": state.scheduler.config().max_context,
        "max_model_len": state.scheduler.config().max_context,
        "architecture": info.architecture,
    })
}

async fn list_models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(
        json!({"object": "list", "data": [model_json(&state)], "has_more": false, "first_id": state.model_id, "last_id": state.model_id}),
    )
}

/// Any model name is served by the loaded model (Claude Code asks for its own names).
async fn get_model(
    State(state): State<Arc<AppState>>,
    Path(_id): Path<String>,
) -> Json<serde_json::Value> {
    Json(model_json(&state))
}

/// The expert cache figures of each GPU (tensor parallelism splits the cache across the
/// cards) as labelled series, one family per figure.
fn write_per_device_expert_cache(
    out: &mut String,
    by_device: &[(usize, capy_engine::hybrid::expert_cache::ExpertCacheMetrics)],
) {
    if by_device.is_empty() {
        return;
    }
    type Figure = fn(&capy_engine::hybrid::expert_cache::ExpertCacheMetrics) -> u64;
    let families: [(&str, &str, &str, Figure); 5] = [
        (
            "expert_cache_device_lookups_total",
            "counter",
            "Routed (token, expert) pairs looked up in this GPU's expert cache.",
            |m| m.stats.lookups,
        ),
        (
            "expert_cache_device_hits_total",
            "counter",
            "Of those, computed by an expert resident on this GPU.",
            |m| m.stats.hits,
        ),
        (
            "expert_cache_device_bytes_copied_total",
            "counter",
            "Host-to-device bytes of expert copies to this GPU.",
            |m| m.bytes_copied,
        ),
        (
            "expert_cache_device_resident",
            "gauge",
            "Experts resident on this GPU now.",
            |m| m.resident as u64,
        ),
        (
            "expert_cache_device_slots",
            "gauge",
            "Experts this GPU's cache can hold.",
            |m| m.slots as u64,
        ),
    ];
    for (name, kind, help, figure) in families {
        let _ = writeln!(out, "# HELP capy_{name} {help}\n# TYPE capy_{name} {kind}");
        for (device, m) in by_device {
            let _ = writeln!(out, "capy_{name}{{device=\"{device}\"}} {}", figure(m));
        }
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let m = state.scheduler.metrics();
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
        let _ = writeln!(
            out,
            "# HELP capy_{name} {help}\n# TYPE capy_{name} {kind}\ncapy_{name} {value}"
        );
    };
    let r = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    metric(
        "requests_total",
        "counter",
        "Generation requests accepted.",
        r(&m.requests_total),
    );
    metric(
        "requests_rejected_total",
        "counter",
        "Requests refused (overload, context length).",
        r(&m.requests_rejected_total),
    );
    metric(
        "requests_cancelled_total",
        "counter",
        "Requests cancelled by the client.",
        r(&m.requests_cancelled_total),
    );
    metric(
        "requests_finished_total",
        "counter",
        "Requests that finished.",
        r(&m.requests_finished_total),
    );
    metric(
        "requests_failed_total",
        "counter",
        "Requests that failed in the engine.",
        r(&m.requests_failed_total),
    );
    metric(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens admitted.",
        r(&m.prompt_tokens_total),
    );
    metric(
        "generated_tokens_total",
        "counter",
        "Tokens generated.",
        r(&m.generated_tokens_total),
    );
    metric(
        "cached_prompt_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
        r(&m.cached_prompt_tokens_total),
    );
    metric(
        "prefix_cache_hits_total",
        "counter",
        "Prefix cache hits.",
        r(&m.prefix_cache_hits_total),
    );
    if let Some(e) = capy_engine::hybrid::expert_cache::expert_cache_metrics() {
        let s = &e.stats;
        metric(
            "expert_cache_lookups_total",
            "counter",
            "Routed (token, expert) pairs looked up in the VRAM expert cache.",
            s.lookups,
        );
        metric(
            "expert_cache_hits_total",
            "counter",
            "Of those, computed by a resident expert on the GPU.",
            s.hits,
        );
        metric(
            "expert_cache_admissions_total",
            "counter",
            "Experts copied into the VRAM expert cache.",
            s.admissions,
        );
        metric(
            "expert_cache_evictions_total",
            "counter",
            "Experts given up by the VRAM expert cache.",
            s.evictions,
        );
        metric(
            "expert_cache_bytes_copied_total",
            "counter",
            "Host-to-device bytes of expert copies.",
            e.bytes_copied,
        );
        metric(
            "expert_cache_resident",
            "gauge",
            "Experts resident in VRAM now.",
            e.resident as u64,
        );
        metric(
            "expert_cache_slots",
            "gauge",
            "Experts the VRAM expert cache can hold.",
            e.slots as u64,
        );
        metric("expert_cache_tokens_total", "counter", "Tokens routed through the hybrid MoE layers (CPU experts per token = (lookups - hits) / tokens).", s.tokens);
    }
    metric(
        "forward_steps_total",
        "counter",
        "Model forward steps.",
        r(&m.forward_steps_total),
    );
    metric(
        "queue_depth",
        "gauge",
        "Requests waiting for a slot.",
        m.queue_depth.load(Ordering::Relaxed) as u64,
    );
    metric(
        "active_sequences",
        "gauge",
        "Sequences being prefilled or decoded.",
        m.active_sequences.load(Ordering::Relaxed) as u64,
    );
    metric(
        "model_weight_bytes",
        "gauge",
        "Bytes of model weights.",
        state.scheduler.model_info().weight_bytes as u64,
    );
    metric(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory of this process.",
        resident_bytes(),
    );
    metric(
        "http_errors_total",
        "counter",
        "Requests refused before reaching an API handler.",
        r(&state.http.errors),
    );
    metric(
        "claude_code_sessions",
        "gauge",
        "Distinct Claude Code session ids seen.",
        state.sessions.lock().map(|s| s.len() as u64).unwrap_or(0),
    );
    let _ = writeln!(out, "# HELP capy_http_requests_total Requests per API.\n# TYPE capy_http_requests_total counter");
    for (api, c) in [
        ("chat_completions", &state.http.chat_completions),
        ("responses", &state.http.responses),
        ("messages", &state.http.messages),
        ("count_tokens", &state.http.count_tokens),
    ] {
        let _ = writeln!(out, "capy_http_requests_total{{api=\"{api}\"}} {}", r(c));
    }
    let by_device = capy_engine::hybrid::expert_cache::expert_cache_metrics_by_device();
    write_per_device_expert_cache(&mut out, &by_device);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

/// Resident set size from /proc (0 where that does not exist).
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map(|pages| pages * 4096)
        .unwrap_or(0)
}

/// Builds the state the router serves: `model` (already loaded on its backend) with the
/// tokenizer and chat template of `model_dir`.
pub fn load_state(
    model_dir: &std::path::Path,
    model: Box<dyn capy_engine::model::CausalLm>,
    model_id: String,
    scheduler_config: capy_engine::scheduler::SchedulerConfig,
    config: ServerConfig,
) -> anyhow::Result<Arc<AppState>> {
    let (tokenizer, template) = capy_engine::chat_template::load_tokenizer_and_template(model_dir)?;
    let tokenizer = Arc::new(tokenizer);
    let scheduler =
        capy_engine::scheduler::Scheduler::start(model, tokenizer.clone(), scheduler_config);
    Ok(Arc::new(AppState::new(
        scheduler, tokenizer, template, model_id, config,
    )))
}

/// Serves the router on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_device_expert_cache_series_carry_the_device_label() {
        use capy_engine::hybrid::expert_cache::ExpertCacheMetrics;
        let mut a = ExpertCacheMetrics::default();
        a.stats.hits = 7;
        a.slots = 3;
        let mut b = ExpertCacheMetrics::default();
        b.stats.hits = 2;
        b.resident = 1;
        let mut out = String::new();
        write_per_device_expert_cache(&mut out, &[(0, a), (1, b)]);
        assert!(
            out.contains("capy_expert_cache_device_hits_total{device=\"0\"} 7\n"),
            "{out}"
        );
        assert!(
            out.contains("capy_expert_cache_device_hits_total{device=\"1\"} 2\n"),
            "{out}"
        );
        assert!(
            out.contains("capy_expert_cache_device_slots{device=\"0\"} 3\n"),
            "{out}"
        );
        assert!(
            out.contains("capy_expert_cache_device_resident{device=\"1\"} 1\n"),
            "{out}"
        );
        assert_eq!(
            out.matches("# TYPE capy_expert_cache_device_hits_total counter")
                .count(),
            1
        );
        let mut empty = String::new();
        write_per_device_expert_cache(&mut empty, &[]);
        assert!(empty.is_empty());
    }
}
