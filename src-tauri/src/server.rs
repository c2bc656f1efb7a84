//! The server, in-process: the same router as `capy-flash serve`, started and stopped from the
//! tray. Loading runs on its own thread so the tray stays responsive; the state it reports
//! drives the tray icon.

use anyhow::Context;
use capy_engine::scheduler::{Scheduler, SchedulerConfig};
use capy_server::{AppState, ServerConfig};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Stopped,
    Loading,
    Ready,
    Error(String),
}

impl State {
    pub fn label(&self) -> String {
        match self {
            State::Stopped => "stopped".into(),
            State::Loading => "loading".into(),
            State::Ready => "ready".into(),
            State::Error(e) => format!("error: {e}"),
        }
    }
}

/// What the app serves: a model folder (or "demo") on a loopback port.
#[derive(Debug, Clone)]
pub struct Options {
    pub model: String,
    pub port: u16,
    pub api_key: Option<String>,
}

impl Options {
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

type OnChange = Arc<dyn Fn(&State) + Send + Sync>;

struct Running {
    stop: oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

pub struct Server {
    pub options: Options,
    state: Arc<Mutex<State>>,
    running: Mutex<Option<Running>>,
    on_change: OnChange,
}

impl Server {
    pub fn new(options: Options, on_change: impl Fn(&State) + Send + Sync + 'static) -> Server {
        Server {
            options,
            state: Arc::new(Mutex::new(State::Stopped)),
            running: Mutex::new(None),
            on_change: Arc::new(on_change),
        }
    }

    fn set(state: &Mutex<State>, on_change: &OnChange, s: State) {
        tracing::info!(state = %s.label(), "server state");
        *state.lock().unwrap() = s.clone();
        on_change(&s);
    }

    /// Starts loading and serving; a second start while running does nothing.
    pub fn start(&self) {
        let mut running = self.running.lock().unwrap();
        if let Some(r) = running.as_ref() {
            if !r.thread.is_finished() {
                return;
            }
        }
        if let Some(r) = running.take() {
            let _ = r.thread.join();
        }
        let (stop, stopped) = oneshot::channel();
        let (options, state, on_change) = (
            self.options.clone(),
            self.state.clone(),
            self.on_change.clone(),
        );
        Server::set(&state, &on_change, State::Loading);
        let thread = std::thread::Builder::new()
            .name("capy-server".into())
            .spawn(move || {
                let result = run(&options, stopped, || {
                    Server::set(&state, &on_change, State::Ready)
                });
                match result {
                    Ok(()) => Server::set(&state, &on_change, State::Stopped),
                    Err(e) => {
                        tracing::error!("server failed: {e:#}");
                        Server::set(&state, &on_change, State::Error(format!("{e:#}")))
                    }
                }
            })
            .expect("spawning the server thread");
        *running = Some(Running { stop, thread });
    }

    /// Stops serving (in-flight requests finish first) and waits for it.
    pub fn stop(&self) {
        if let Some(r) = self.running.lock().unwrap().take() {
            let _ = r.stop.send(());
            let _ = r.thread.join();
        }
    }
}

/// The model on the CPU backend, its tokenizer and chat template, and the scheduler over them.
fn load(
    dir: &std::path::Path,
    model_id: String,
    config: ServerConfig,
) -> anyhow::Result<Arc<AppState>> {
    let (tokenizer, template) = capy_engine::chat_template::load_tokenizer_and_template(dir)?;
    let checkpoint = capy_engine::checkpoint::Checkpoint::open(dir)?;
    let model =
        capy_engine::model::load(capy_engine::backend::cpu::CpuBackend::new(), &checkpoint)?;
    let tokenizer = Arc::new(tokenizer);
    let scheduler = Scheduler::start(model, tokenizer.clone(), SchedulerConfig::default());
    Ok(Arc::new(AppState::new(
        scheduler, tokenizer, template, model_id, config,
    )))
}

fn run(
    options: &Options,
    stopped: oneshot::Receiver<()>,
    ready: impl FnOnce(),
) -> anyhow::Result<()> {
    let dir = if capy_engine::demo::is_demo_name(&options.model) {
        capy_engine::demo::ensure_demo_model(&options.model)?
    } else {
        std::path::PathBuf::from(&options.model)
    };
    let model_id = if capy_engine::demo::is_demo_name(&options.model) {
        options.model.clone()
    } else {
        dir.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| options.model.clone())
    };
    let port = options.port;
    let config = ServerConfig {
        api_key: options.api_key.clone().filter(|k| !k.is_empty()),
        // The window shows the dashboard from the app's own origin; browsers use the server's.
        cors_origins: vec![
            format!("http://127.0.0.1:{port}"),
            format!("http://localhost:{port}"),
            "tauri://localhost".into(),
            "http://tauri.localhost".into(),
        ],
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    // Bind first: a port in use is an error the tray shows at once, before the model loads.
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(addr))
        .with_context(|| format!("cannot listen on {addr}; is another server using the port? change the port in the dashboard's settings"))?;
    let state = load(&dir, model_id.clone(), config)
        .with_context(|| format!("loading {}", dir.display()))?;
    tracing::info!("serving {model_id} on http://{addr}");
    ready();
    rt.block_on(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        capy_server::serve(listener, state, shutdown)
            .await
            .context("the HTTP server failed")
    })
}
