//! `capy-flash serve`: the OpenAI- and Anthropic-compatible HTTP server.
//!
//! Before loading anything it runs the hardware guard of capy-hardware: the model folder is
//! mapped to its configuration ([`model_folder::identify`]) and checked against this machine
//! ([`guard::check_before_serve`]); a configuration that does not fit is refused with the
//! numbers (`NINFER_RAM_GUARD=0` / `CAPY_RAM_GUARD=0` override the RAM part), and a CPU
//! without AVX2 + FMA + F16C is refused for every model.

use anyhow::{bail, Context, Result};
use capy_engine::cache::{CacheConfig, CacheIdentity};
use capy_engine::scheduler::SchedulerConfig;
use capy_hardware::{guard, model_folder};
use capy_server::{ServerConfig, DEFAULT_PORT};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face model folder, or "demo" for the built-in demo model.
    #[arg(long)]
    pub model: String,
    #[command(flatten)]
    pub backend: super::model_arg::BackendArg,
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
    /// Host RAM the prefix cache may hold (conversation states resumed across turns).
    #[arg(long, default_value = "4GiB", value_parser = super::bench_gpu::parse_bytes)]
    pub prefix_cache_ram: u64,
    /// Disk budget of the prefix cache when idle chats are offloaded to disk.
    #[arg(long, default_value = "64GiB", value_parser = super::bench_gpu::parse_bytes)]
    pub prefix_cache_disk: u64,
    /// Folder idle conversations are moved to (default: the dashboard's disk-offload setting;
    /// RAM only when that is off).
    #[arg(long)]
    pub disk_offload: Option<std::path::PathBuf>,
    /// Turn the prefix cache off: every request computes its whole prompt.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// With disk offload on, a conversation without requests for this many seconds moves from
    /// RAM to disk (it comes back on its next request).
    #[arg(long, default_value_t = 300)]
    pub idle_offload_secs: u64,
}

/// The prefix cache's settings for the model in `dir`: disk entries are tied to the model's
/// name and to a checksum of its config.json, so a changed checkpoint never resumes old states.
fn prefix_cache_config(a: &Args, model_id: &str, dir: &Path, backend: &str) -> Option<CacheConfig> {
    if a.no_prefix_cache {
        return None;
    }
    let config_sum = std::fs::read(dir.join("config.json"))
        .map(|b| crc32fast::hash(&b))
        .unwrap_or(0);
    let identity = CacheIdentity {
        model_id: format!("{model_id}:{config_sum:08x}"),
        // States saved by one backend are not resumed by another.
        format: format!("{backend}-f32"),
    };
    let mut c = CacheConfig::new(identity);
    c.ram_bytes = a.prefix_cache_ram as usize;
    c.disk_bytes = a.prefix_cache_disk;
    c.idle = std::time::Duration::from_secs(a.idle_offload_secs);
    c.disk_dir = a.disk_offload.clone().or_else(|| {
        let s = capy_server::admin::Settings::load(capy_server::admin::settings_path().as_deref());
        s.disk_offload.then_some(s.disk_offload_dir)
    });
    Some(c)
}

/// The hardware guard, run before anything is loaded: which configuration `model` is, and
/// whether this machine runs it. Refuses with the numbers; prints the warnings it lets pass.
///
/// `CAPY_FAKE_MACHINE=FILE` (tests only) checks the machine described in FILE instead of this one.
fn check_hardware(model: &str) -> Result<()> {
    let (identified, probe_at) = if capy_engine::demo::is_demo_name(model) {
        (None, capy_hardware::default_models_dir())
    } else {
        let dir = Path::new(model);
        let facts =
            model_folder::read_folder(dir, gguf_architecture).map_err(anyhow::Error::msg)?;
        (Some(model_folder::identify(&facts)), dir.to_path_buf())
    };
    let (machine, fake) = guard::machine_for_guard(&probe_at).map_err(anyhow::Error::msg)?;
    if let Some(w) = fake {
        eprintln!("warning: {}", w.message);
    }
    let config_id = identified
        .as_ref()
        .and_then(|i| i.configuration)
        .map(|c| c.id);
    if let Some(i) = &identified {
        if config_id.is_some() {
            eprintln!("capy-flash: {}: {}", model, i.reason);
        } else {
            eprintln!(
                "note: {}: {}; only the CPU is checked before loading",
                model, i.reason
            );
        }
    }
    let warnings =
        guard::check_before_serve(&machine, config_id, &guard::GuardEnv::from_process())?;
    for w in warnings {
        eprintln!("warning: {}", w.message);
    }
    Ok(())
}

/// `general.architecture` of a GGUF file, from its header (no tensor data is read).
fn gguf_architecture(path: &Path) -> Option<String> {
    let file = capy_engine::quant::gguf::GgufFile::open(path).ok()?;
    file.meta("general.architecture")?
        .as_str()
        .map(str::to_string)
}

pub fn run(a: Args) -> Result<()> {
    if !a.host.is_loopback() && a.api_key.as_deref().is_none_or(str::is_empty) {
        bail!("binding to {} exposes the server beyond this machine; give --api-key KEY (or set CAPY_API_KEY), or bind 127.0.0.1", a.host);
    }
    check_hardware(&a.model)?;
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
    let checkpoint = capy_engine::checkpoint::Checkpoint::open(&dir)?;
    let (model, backend) = a.backend.load(&checkpoint)?;
    drop(checkpoint);
    let scheduler = SchedulerConfig {
        max_batch: a.max_batch,
        max_queue: a.max_queue,
        prefill_chunk: a.prefill_chunk,
        max_context: a.context.unwrap_or(usize::MAX),
        prefix_cache: prefix_cache_config(&a, &model_id, &dir, backend),
    };
    let config = ServerConfig {
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        cors_origins: vec![
            format!("http://127.0.0.1:{}", a.port),
            format!("http://localhost:{}", a.port),
        ],
        ..Default::default()
    };
    let state = capy_server::load_state(&dir, model, model_id.clone(), scheduler, config)?;
    let addr = SocketAddr::new(a.host, a.port);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}; is another server using the port? try --port"))?;
        let context = state.scheduler.config().max_context;
        eprintln!("capy-flash: serving {model_id} on {backend} (context {context}) on http://{addr}  (OpenAI: /v1/chat/completions, /v1/responses; Anthropic: /v1/messages)");
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        capy_server::serve(listener, state, shutdown).await.context("the HTTP server failed")
    })
}
