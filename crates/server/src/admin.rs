//! The dashboard's endpoints under `/admin`: the machine's live figures, the hardware check,
//! checkpoints and their downloads, settings, and the idle-chat disk offload.
//!
//! - `GET  /admin/machine`    RAM, page-locked, CPU use, VRAM per GPU, server counters
//! - `GET  /admin/doctor`     the same JSON as `capy-flash doctor --json`
//! - `GET  /admin/checkpoints` the configuration table's checkpoints (installed or not, size)
//!   and any other folder in the models folder; follows the folder through `notify`
//! - `GET  /admin/downloads`, `POST /admin/downloads {"repo", "config_id"?}`,
//!   `POST /admin/downloads/pause {"repo"}`, `POST /admin/downloads/resume {"repo"}`
//! - `GET  /admin/settings`, `POST /admin/settings {…partial}` persisted as JSON in the OS
//!   config folder (`CAPY_CONFIG_DIR` overrides)
//! - `GET  /admin/status`, `POST /admin/disk-offload {"enabled", "dir"}`
//!
//! The admin state is one per process ([`admin()`]): the tray app restarts its server without
//! losing downloads or the folder watcher.

use crate::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use capy_download::{CancelFlag, Hub, Progress, Request};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Persisted settings (`settings.json` in the OS config folder).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Settings {
    pub models_dir: PathBuf,
    pub port: u16,
    pub api_key: Option<String>,
    pub vram_budget_gib: Option<f64>,
    pub ram_budget_gib: Option<f64>,
    pub disk_offload: bool,
    pub disk_offload_dir: PathBuf,
}

impl Default for Settings {
    fn default() -> Self {
        let data = directories::ProjectDirs::from("", "", "capy-flash")
            .map(|d| d.data_dir().to_path_buf())
            .unwrap_or_else(|| PathBuf::from("."));
        Settings {
            models_dir: capy_hardware::default_models_dir(),
            port: crate::DEFAULT_PORT,
            api_key: None,
            vram_budget_gib: None,
            ram_budget_gib: None,
            disk_offload: false,
            disk_offload_dir: data.join("offload"),
        }
    }
}

/// Where settings live: `$CAPY_CONFIG_DIR/settings.json` or the OS config folder.
pub fn settings_path() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("CAPY_CONFIG_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("settings.json"));
    }
    directories::ProjectDirs::from("", "", "capy-flash")
        .map(|d| d.config_dir().join("settings.json"))
}

impl Settings {
    /// Loads the saved settings; defaults where there are none (or they do not parse, which
    /// is logged).
    pub fn load(path: Option<&Path>) -> Settings {
        let Some(path) = path else {
            return Settings::default();
        };
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text).unwrap_or_else(|e| {
                tracing::warn!(
                    "{}: not valid settings ({e}); using defaults",
                    path.display()
                );
                Settings::default()
            }),
            Err(_) => Settings::default(),
        }
    }

    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension("json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(self).expect("settings serialise"),
        )?;
        std::fs::rename(tmp, path)
    }
}

/// One download the dashboard started.
#[derive(Debug, Clone, Serialize)]
pub struct DownloadEntry {
    pub repo: String,
    pub config_id: Option<String>,
    pub dest: PathBuf,
    /// `running`, `paused`, `failed`, `done`.
    pub state: &'static str,
    pub progress: Option<Progress>,
    pub error: Option<String>,
    #[serde(skip)]
    cancel: CancelFlag,
}

/// Process-wide state behind `/admin`.
pub struct Admin {
    settings_path: Option<PathBuf>,
    settings: Mutex<Settings>,
    hub: Hub,
    downloads: Mutex<BTreeMap<String, DownloadEntry>>,
    /// Bumped by the models-folder watcher and by finished downloads.
    models_changes: Arc<AtomicU64>,
    watcher: Mutex<Option<(PathBuf, notify::RecommendedWatcher)>>,
    sys: Mutex<(sysinfo::System, Instant)>,
    machine: Mutex<Option<(capy_hardware::Machine, Instant)>>,
}

static ADMIN: OnceLock<Arc<Admin>> = OnceLock::new();

/// The process's admin state, created on first use from the saved settings and the
/// environment (`HF_ENDPOINT`, `HF_TOKEN`, `CAPY_CONFIG_DIR`, `CAPY_MODELS_DIR`).
pub fn admin() -> Arc<Admin> {
    ADMIN
        .get_or_init(|| {
            let path = settings_path();
            let mut settings = Settings::load(path.as_deref());
            if let Some(d) = std::env::var_os("CAPY_MODELS_DIR").filter(|d| !d.is_empty()) {
                settings.models_dir = PathBuf::from(d);
            }
            let a = Arc::new(Admin {
                settings_path: path,
                settings: Mutex::new(settings),
                hub: Hub::from_env(),
                downloads: Mutex::new(BTreeMap::new()),
                models_changes: Arc::new(AtomicU64::new(0)),
                watcher: Mutex::new(None),
                sys: Mutex::new((sysinfo::System::new(), Instant::now())),
                machine: Mutex::new(None),
            });
            a.watch_models_dir();
            a
        })
        .clone()
}

impl Admin {
    pub fn settings(&self) -> Settings {
        self.settings.lock().unwrap().clone()
    }

    /// Watches the models folder (created if missing) so the checkpoint list follows files
    /// added or removed by hand.
    fn watch_models_dir(&self) {
        use notify::Watcher;
        let dir = self.settings().models_dir;
        let mut w = self.watcher.lock().unwrap();
        if w.as_ref().is_some_and(|(d, _)| *d == dir) {
            return;
        }
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::warn!("models folder {}: {e}", dir.display());
        }
        let changes = self.models_changes.clone();
        let watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
            if ev.is_ok() {
                changes.fetch_add(1, Ordering::Relaxed);
            }
        });
        match watcher {
            Ok(mut watcher) => match watcher.watch(&dir, notify::RecursiveMode::Recursive) {
                Ok(()) => *w = Some((dir, watcher)),
                Err(e) => tracing::warn!("cannot watch {}: {e}", dir.display()),
            },
            Err(e) => tracing::warn!("no file watcher: {e}"),
        }
    }

    /// The latest machine probe, at most 3 s old (a probe opens the GPU driver).
    fn machine(&self) -> capy_hardware::Machine {
        let mut m = self.machine.lock().unwrap();
        if let Some((machine, at)) = m.as_ref() {
            if at.elapsed() < Duration::from_secs(3) {
                return machine.clone();
            }
        }
        let machine = capy_hardware::probe_at(&self.settings().models_dir);
        *m = Some((machine.clone(), Instant::now()));
        machine
    }
}

/// The `/admin` routes (merged into the main router, behind the same API-key check).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/admin/machine", get(machine))
        .route("/admin/doctor", get(doctor))
        .route("/admin/checkpoints", get(checkpoints))
        .route("/admin/downloads", get(list_downloads).post(start_download))
        .route("/admin/downloads/pause", post(pause_download))
        .route("/admin/downloads/resume", post(resume_download))
        .route("/admin/settings", get(get_settings).post(post_settings))
        .route("/admin/status", get(status))
        .route("/admin/disk-offload", post(disk_offload))
}

fn bad_request(msg: String) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": {"type": "invalid_request_error", "message": msg}})),
    )
        .into_response()
}

/// Locked memory of this process (VmLck), bytes.
fn locked_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmLck:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

async fn machine(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let a = admin();
    let (ram, cpu) = {
        let mut g = a.sys.lock().unwrap();
        let (sys, last) = &mut *g;
        sys.refresh_memory();
        if last.elapsed() >= sysinfo::MINIMUM_CPU_UPDATE_INTERVAL {
            sys.refresh_cpu_usage();
            *last = Instant::now();
        }
        (
            json!({"total_bytes": sys.total_memory(), "available_bytes": sys.available_memory(),
                   "used_bytes": sys.total_memory().saturating_sub(sys.available_memory())}),
            json!({"usage_percent": sys.global_cpu_usage(), "cores": sys.cpus().len()}),
        )
    };
    let m = tokio::task::spawn_blocking(move || admin().machine())
        .await
        .expect("the probe does not panic");
    let gpus: Vec<_> = m
        .gpus
        .iter()
        .map(|g| {
            json!({"index": g.index, "name": g.name, "total_vram_bytes": g.total_vram_bytes,
                   "free_vram_bytes": g.free_vram_bytes,
                   "used_vram_bytes": g.free_vram_bytes.map(|f| g.total_vram_bytes.saturating_sub(f))})
        })
        .collect();
    let metrics = state.scheduler.metrics();
    let r = |x: &AtomicU64| x.load(Ordering::Relaxed);
    let prompt = r(&metrics.prompt_tokens_total);
    let cached = r(&metrics.cached_prompt_tokens_total);
    Json(json!({
        "ram": ram,
        "cpu": cpu,
        "process": {"resident_bytes": crate::resident_bytes(), "locked_bytes": locked_bytes()},
        "page_locked": {"cap_bytes": m.page_locked.cap_bytes, "cap_reason": m.page_locked.cap_reason,
                        "locked_bytes": locked_bytes()},
        "gpus": gpus,
        "gpu_note": m.gpu_note,
        "server": {
            "model": state.model_id,
            "requests_total": r(&metrics.requests_total),
            "generated_tokens_total": r(&metrics.generated_tokens_total),
            "active_sequences": metrics.active_sequences.load(Ordering::Relaxed),
            "queue_depth": metrics.queue_depth.load(Ordering::Relaxed),
            "prefix_cache_hits_total": r(&metrics.prefix_cache_hits_total),
            "prompt_tokens_total": prompt,
            "cached_prompt_tokens_total": cached,
            "prefix_cache_token_hit_rate": if prompt > 0 { Some(cached as f64 / prompt as f64) } else { None },
            "weight_bytes": state.scheduler.model_info().weight_bytes,
        },
    }))
}

/// The JSON of `capy-flash doctor --json`.
pub fn doctor_json(machine: &capy_hardware::Machine) -> serde_json::Value {
    let plan = capy_hardware::plan(machine);
    json!({
        "machine": machine,
        "configurations": plan.verdicts,
        "recommendation": plan.recommendation,
        "recommendation_rule": plan.recommendation_rule,
        "summary": plan.summary,
    })
}

async fn doctor() -> Json<serde_json::Value> {
    let m = tokio::task::spawn_blocking(|| admin().machine())
        .await
        .expect("the probe does not panic");
    Json(doctor_json(&m))
}

/// A folder holds a checkpoint when it has a config.json and no partial downloads.
fn folder_state(dir: &Path) -> (&'static str, u64) {
    if !dir.is_dir() {
        return ("absent", 0);
    }
    let mut bytes = 0;
    let mut partial = false;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                bytes += e.metadata().map(|m| m.len()).unwrap_or(0);
                partial |= p.extension().is_some_and(|x| x == "part");
            }
        }
    }
    let state = if partial {
        "partial"
    } else if dir.join("config.json").is_file() {
        "installed"
    } else {
        "incomplete"
    };
    (state, bytes)
}

fn repo_folder(models_dir: &Path, repo: &str) -> PathBuf {
    models_dir.join(repo.rsplit('/').next().unwrap_or(repo))
}

async fn checkpoints() -> Json<serde_json::Value> {
    let a = admin();
    let models_dir = a.settings().models_dir;
    let downloads = a.downloads.lock().unwrap().clone();
    let mut known = Vec::new();
    let mut rows = Vec::new();
    for c in capy_hardware::CONFIGURATIONS {
        let dir = repo_folder(&models_dir, c.hf_repo_hint);
        known.push(dir.clone());
        let (state, bytes) = folder_state(&dir);
        rows.push(json!({
            "id": c.id, "display_name": c.display_name, "repo": c.hf_repo_hint,
            "disk_bytes": c.disk_bytes, "folder": dir, "state": state, "bytes_on_disk": bytes,
            "default": c.default, "download": downloads.get(c.hf_repo_hint),
        }));
    }
    let mut others = Vec::new();
    for e in std::fs::read_dir(&models_dir)
        .into_iter()
        .flatten()
        .flatten()
    {
        let p = e.path();
        if p.is_dir() && !known.contains(&p) {
            let (state, bytes) = folder_state(&p);
            others.push(json!({"folder": p, "name": e.file_name().to_string_lossy(), "state": state, "bytes_on_disk": bytes}));
        }
    }
    others.sort_by(|x, y| x["name"].as_str().cmp(&y["name"].as_str()));
    let extra_downloads: Vec<_> = downloads
        .values()
        .filter(|d| {
            !capy_hardware::CONFIGURATIONS
                .iter()
                .any(|c| c.hf_repo_hint == d.repo)
        })
        .collect();
    Json(json!({
        "models_dir": models_dir,
        "changes": a.models_changes.load(Ordering::Relaxed),
        "watching": a.watcher.lock().unwrap().is_some(),
        "configurations": rows,
        "other_folders": others,
        "other_downloads": extra_downloads,
        "hub": a.hub.endpoint(),
    }))
}

async fn list_downloads() -> Json<serde_json::Value> {
    let d = admin().downloads.lock().unwrap().clone();
    Json(json!({"downloads": d.values().collect::<Vec<_>>()}))
}

#[derive(Deserialize)]
struct DownloadBody {
    repo: String,
    config_id: Option<String>,
}

fn spawn_download(a: Arc<Admin>, repo: String, config_id: Option<String>) -> Result<(), String> {
    let dest = repo_folder(&a.settings().models_dir, &repo);
    let cancel = CancelFlag::new();
    {
        let mut d = a.downloads.lock().unwrap();
        if d.get(&repo).is_some_and(|e| e.state == "running") {
            return Err(format!("{repo} is already downloading"));
        }
        d.insert(
            repo.clone(),
            DownloadEntry {
                repo: repo.clone(),
                config_id: config_id.clone(),
                dest: dest.clone(),
                state: "running",
                progress: None,
                error: None,
                cancel: cancel.clone(),
            },
        );
    }
    tokio::spawn(async move {
        let mut req = Request::new(&repo, &dest);
        req.config_id = config_id;
        let a2 = a.clone();
        let r2 = repo.clone();
        let on_progress = move |p: &Progress| {
            if let Some(e) = a2.downloads.lock().unwrap().get_mut(&r2) {
                e.progress = Some(p.clone());
            }
        };
        let result = capy_download::download(
            &a.hub,
            &req,
            &capy_hardware::probe::probe_disk,
            &cancel,
            &on_progress,
        )
        .await;
        let mut d = a.downloads.lock().unwrap();
        if let Some(e) = d.get_mut(&repo) {
            match result {
                Ok(_) => {
                    e.state = "done";
                    e.error = None;
                }
                Err(capy_download::Error::Cancelled) => e.state = "paused",
                Err(err) => {
                    tracing::warn!("download of {repo} failed: {err}");
                    e.state = "failed";
                    e.error = Some(err.to_string());
                }
            }
        }
        a.models_changes.fetch_add(1, Ordering::Relaxed);
    });
    Ok(())
}

async fn start_download(Json(body): Json<DownloadBody>) -> Response {
    match spawn_download(admin(), body.repo.clone(), body.config_id) {
        Ok(()) => (
            StatusCode::ACCEPTED,
            Json(json!({"repo": body.repo, "state": "running"})),
        )
            .into_response(),
        Err(e) => (
            StatusCode::CONFLICT,
            Json(json!({"error": {"type": "conflict", "message": e}})),
        )
            .into_response(),
    }
}

#[derive(Deserialize)]
struct RepoBody {
    repo: String,
}

async fn pause_download(Json(body): Json<RepoBody>) -> Response {
    let a = admin();
    let d = a.downloads.lock().unwrap();
    match d.get(&body.repo) {
        Some(e) if e.state == "running" => {
            e.cancel.cancel();
            Json(json!({"repo": body.repo, "state": "pausing"})).into_response()
        }
        Some(e) => bad_request(format!("{} is {}, not running", body.repo, e.state)),
        None => bad_request(format!("no download of {} was started", body.repo)),
    }
}

async fn resume_download(Json(body): Json<RepoBody>) -> Response {
    let a = admin();
    let config_id = a
        .downloads
        .lock()
        .unwrap()
        .get(&body.repo)
        .and_then(|e| e.config_id.clone());
    match spawn_download(a, body.repo.clone(), config_id) {
        Ok(()) => Json(json!({"repo": body.repo, "state": "running"})).into_response(),
        Err(e) => (
            StatusCode::CONFLICT,
            Json(json!({"error": {"type": "conflict", "message": e}})),
        )
            .into_response(),
    }
}

/// Settings with the API key masked.
fn settings_json(s: &Settings) -> serde_json::Value {
    let mut v = serde_json::to_value(s).expect("settings serialise");
    v["api_key"] = json!(s.api_key.as_ref().map(|_| "********"));
    v["path"] = json!(admin().settings_path);
    v
}

async fn get_settings() -> Json<serde_json::Value> {
    Json(settings_json(&admin().settings()))
}

async fn post_settings(Json(patch): Json<serde_json::Value>) -> Response {
    let a = admin();
    let current = a.settings();
    let mut merged = serde_json::to_value(&current).expect("settings serialise");
    let Some(obj) = patch.as_object() else {
        return bad_request("settings are a JSON object".into());
    };
    for (k, v) in obj {
        if merged.get(k).is_none() {
            return bad_request(format!("unknown setting {k:?}"));
        }
        merged[k] = v.clone();
    }
    let new: Settings = match serde_json::from_value(merged) {
        Ok(s) => s,
        Err(e) => return bad_request(format!("invalid settings: {e}")),
    };
    if let Some(path) = &a.settings_path {
        if let Err(e) = new.save(path) {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({"error": {"type": "server_error", "message": format!("cannot save {}: {e}", path.display())}})),
            )
                .into_response();
        }
    }
    *a.settings.lock().unwrap() = new.clone();
    if new.models_dir != current.models_dir {
        a.watch_models_dir();
    }
    Json(settings_json(&new)).into_response()
}

/// Bytes of files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    let mut bytes = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => bytes += m.len(),
                Err(_) => {}
            }
        }
    }
    bytes
}

/// The scheduler's prefix cache status (sessions with tier and size, budgets and use), or
/// `null` when the server runs without a prefix cache.
fn cache_status(state: &AppState) -> serde_json::Value {
    match state.scheduler.cache() {
        Some(c) => {
            let st = c.lock().unwrap_or_else(|p| p.into_inner()).status();
            serde_json::to_value(st).unwrap_or(serde_json::Value::Null)
        }
        None => serde_json::Value::Null,
    }
}

async fn status(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let a = admin();
    let s = a.settings();
    let m = state.scheduler.metrics();
    let cache = cache_status(&state);
    let requests: BTreeMap<String, u64> = state
        .sessions
        .lock()
        .map(|s| s.iter().map(|(k, v)| (k.clone(), *v)).collect())
        .unwrap_or_default();
    // The cache's sessions (tier, tokens, bytes), with the request count of those that came
    // with a Claude Code session header; header sessions with nothing cached yet follow.
    let mut sessions: Vec<serde_json::Value> = Vec::new();
    let mut listed = std::collections::HashSet::new();
    for s in cache["sessions"].as_array().into_iter().flatten() {
        let mut s = s.clone();
        if let Some(id) = s["id"].as_str() {
            listed.insert(id.to_string());
            s["requests"] = json!(requests.get(id));
        }
        sessions.push(s);
    }
    for (id, n) in &requests {
        if !listed.contains(id) {
            sessions.push(json!({"id": id, "requests": n, "tier": null, "tokens": 0, "bytes": 0}));
        }
    }
    let disk = match state.scheduler.cache() {
        Some(_) => cache["disk_offload"].clone(),
        None => json!({"enabled": s.disk_offload, "dir": s.disk_offload_dir}),
    };
    Json(json!({
        "state": "ready",
        "model": state.model_id,
        "context": state.scheduler.config().max_context,
        "active_sequences": m.active_sequences.load(Ordering::Relaxed),
        "queue_depth": m.queue_depth.load(Ordering::Relaxed),
        "sessions": sessions,
        "budgets": {"vram_gib": s.vram_budget_gib, "ram_gib": s.ram_budget_gib,
                    "prefix_cache": cache.get("budgets")},
        "use": {"prefix_cache": cache.get("use")},
        "prefix_cache": cache,
        "disk_offload": disk,
    }))
}

#[derive(Deserialize)]
struct OffloadBody {
    enabled: bool,
    dir: Option<String>,
}

/// Switches the running scheduler's disk tier (and saves the choice in the settings). On:
/// idle and evicted conversations move to `dir` (the saved folder when none is given) and the
/// entries already there are found again; off: the cache keeps RAM only (files stay).
async fn disk_offload(
    State(state): State<Arc<AppState>>,
    Json(body): Json<OffloadBody>,
) -> Response {
    let a = admin();
    let mut s = a.settings();
    s.disk_offload = body.enabled;
    if let Some(dir) = body.dir.filter(|d| !d.trim().is_empty()) {
        let dir = PathBuf::from(dir.trim());
        if !dir.is_absolute() {
            return bad_request(format!(
                "the offload folder must be an absolute path, got {}",
                dir.display()
            ));
        }
        s.disk_offload_dir = dir;
    }
    if s.disk_offload {
        if let Err(e) = std::fs::create_dir_all(&s.disk_offload_dir) {
            return bad_request(format!(
                "cannot create {}: {e}",
                s.disk_offload_dir.display()
            ));
        }
    }
    if let Some(c) = state.scheduler.cache() {
        let dir = s.disk_offload.then_some(s.disk_offload_dir.as_path());
        let mut c = c.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = c.set_disk(dir) {
            return bad_request(format!("{e:#}"));
        }
    }
    if let Some(path) = &a.settings_path {
        if let Err(e) = s.save(path) {
            return bad_request(format!("cannot save {}: {e}", path.display()));
        }
    }
    *a.settings.lock().unwrap() = s.clone();
    let cache = cache_status(&state);
    Json(json!({"enabled": s.disk_offload, "dir": s.disk_offload_dir,
                "bytes_offloaded": if s.disk_offload { dir_bytes(&s.disk_offload_dir) } else { 0 },
                "prefix_cache": cache.get("disk_offload"),
                "applied_to_running_cache": state.scheduler.cache().is_some()}))
    .into_response()
}
