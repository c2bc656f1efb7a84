//! `capy-flash serve`: the OpenAI- and Anthropic-compatible HTTP server.

use anyhow::{bail, Context, Result};
use capy_engine::scheduler::SchedulerConfig;
use capy_server::{ServerConfig, DEFAULT_PORT};
use std::net::{IpAddr, SocketAddr};

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face model folder, or "demo" for the built-in demo model.
    #[arg(long)]
    pub model: String,
    /// Address to bind; anything but loopback needs --api-key.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    #[arg(long, default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Key clients must send (`Authorization: Bearer KEY` or `x-api-key: KEY`).
    #[arg(long, env = "CAPY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Requests that may wait for a slot before new ones get 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Prompt tokens prefilled per step (interleaved with decoding).
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Context length (prompt + output), capped at the model's.
    #[arg(long)]
    pub context: Option<usize>,
    /// Name reported as the model id (default: the folder name, or "demo").
    #[arg(long)]
    pub served_model_name: Option<String>,
}

pub fn run(a: Args) -> Result<()> {
    if !a.host.is_loopback() && a.api_key.as_deref().is_none_or(str::is_empty) {
        bail!("binding to {} exposes the server beyond this machine; give --api-key KEY (or set CAPY_API_KEY), or bind 127.0.0.1", a.host);
    }
    let dir = if capy_engine::demo::is_demo_name(&a.model) {
        let dir = capy_engine::demo::ensure_demo_model(&a.model)?;
        eprintln!(
            "note: \"{}\" is the built-in demo model with random weights: its output is gibberish.",
            a.model
        );
        dir
    } else {
        std::path::PathBuf::from(&a.model)
    };
    let model_id = a.served_model_name.clone().unwrap_or_else(|| {
        if capy_engine::demo::is_demo_name(&a.model) {
            a.model.clone()
        } else {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| a.model.clone())
        }
    });
    let scheduler = SchedulerConfig {
        max_batch: a.max_batch,
        max_queue: a.max_queue,
        prefill_chunk: a.prefill_chunk,
        max_context: a.context.unwrap_or(usize::MAX),
    };
    let config = ServerConfig {
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        cors_origins: vec![
            format!("http://127.0.0.1:{}", a.port),
            format!("http://localhost:{}", a.port),
        ],
        ..Default::default()
    };
    let state = capy_server::load_state(&dir, model_id.clone(), scheduler, config)?;
    let addr = SocketAddr::new(a.host, a.port);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}; is another server using the port? try --port"))?;
        let context = state.scheduler.config().max_context;
        eprintln!("capy-flash: serving {model_id} (context {context}) on http://{addr}  (OpenAI: /v1/chat/completions, /v1/responses; Anthropic: /v1/messages)");
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        capy_server::serve(listener, state, shutdown).await.context("the HTTP server failed")
    })
}
