//! Checkpoint download from Hugging Face repositories (or a mirror through `HF_ENDPOINT`).
//!
//! Shared by `capy-flash download` (an indicatif progress bar) and the dashboard (through the
//! server's `/admin/downloads`).
//!
//! - The file list and each file's checksum come from the hub's metadata:
//!   `{endpoint}/api/models/{repo}?blobs=true` (or `/api/models/{repo}/revision/{rev}`), where
//!   an LFS file carries its SHA-256 (`lfs.sha256`, or `lfs.oid` as the tree API spells it) and
//!   a plain git file its blob id (the SHA-1 of `"blob {size}\0" + content`).
//! - Content comes from `{endpoint}/{repo}/resolve/{rev}/{file}`, written to `{file}.part`,
//!   resumed with an HTTP `Range` request when a `.part` is already there.
//! - A file becomes `{file}` only after its size and checksum matched, by an atomic rename of
//!   the synced `.part`. A mismatch deletes the `.part` and fails: nothing corrupt is ever
//!   marked complete.
//! - Free disk is checked before anything is fetched: against the configuration's disk need
//!   from the configuration table ([`capy_hardware::guard::check_disk_space`]) when the
//!   repository is one of the table's, and always against the bytes still to fetch.
//! - Pause is cancellation ([`CancelFlag`]); resume is a new [`download`] call, which picks up
//!   the `.part` files.

use capy_hardware::guard::{check_disk_space, DiskRefusal};
use capy_hardware::plan::gb;
use capy_hardware::{Disk, CONFIGURATIONS};
use serde::{Deserialize, Serialize};
use sha1::Digest as _;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// The public hub, used when `HF_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Why a download stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{repo} (revision {revision}) was not found at {url} (HTTP 404): check the repository id and revision; a gated or private repository needs HF_TOKEN")]
    NotFound {
        repo: String,
        revision: String,
        url: String,
    },
    #[error("{url} answered HTTP {status}: {body}")]
    Http {
        url: String,
        status: u16,
        body: String,
    },
    #[error("could not reach {url}: {source}; check the network or HF_ENDPOINT")]
    Network {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("the hub's file list for {repo} is not what was expected: {message}")]
    BadListing { repo: String, message: String },
    #[error("{file}: {algorithm} is {found}, the hub says {expected}; the partial file was deleted, nothing was marked complete. Run the download again to fetch it afresh")]
    ChecksumMismatch {
        file: String,
        algorithm: &'static str,
        expected: String,
        found: String,
    },
    #[error("{file}: received {found} bytes, the hub says {expected}; the partial file was kept for a resume")]
    SizeMismatch {
        file: String,
        expected: u64,
        found: u64,
    },
    #[error("{0}")]
    Disk(#[from] DiskRefusal),
    #[error("not enough disk space at {dir}: {needed} still to download, {free} free; free some space or choose another folder")]
    NotEnoughSpace {
        dir: PathBuf,
        needed: String,
        free: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("download paused; run it again to resume from the partial files")]
    Cancelled,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A Hugging Face compatible hub.
#[derive(Clone)]
pub struct Hub {
    endpoint: String,
    token: Option<String>,
    client: reqwest::Client,
}

impl Hub {
    /// A hub at `endpoint` (e.g. `https://huggingface.co`), with an optional access token.
    pub fn new(endpoint: &str, token: Option<String>) -> Hub {
        let client = reqwest::Client::builder()
            .user_agent(concat!("capy-flash/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(20))
            .read_timeout(Duration::from_secs(60))
            .build()
            .expect("a reqwest client with rustls builds");
        Hub {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token: token.filter(|t| !t.is_empty()),
            client,
        }
    }

    /// `HF_ENDPOINT` (mirrors) or the public hub; `HF_TOKEN` for gated repositories.
    pub fn from_env() -> Hub {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        Hub::new(&endpoint, std::env::var("HF_TOKEN").ok())
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn get(&self, url: &str) -> reqwest::RequestBuilder {
        let r = self.client.get(url);
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    /// The metadata URL of `repo` at `revision`.
    pub fn info_url(&self, repo: &str, revision: &str) -> String {
        if revision == "main" {
            format!("{}/api/models/{repo}?blobs=true", self.endpoint)
        } else {
            format!(
                "{}/api/models/{repo}/revision/{}?blobs=true",
                self.endpoint,
                encode_segment(revision)
            )
        }
    }

    /// The content URL of one file.
    pub fn file_url(&self, repo: &str, revision: &str, path: &str) -> String {
        let path: Vec<String> = path.split('/').map(encode_segment).collect();
        format!(
            "{}/{repo}/resolve/{}/{}",
            self.endpoint,
            encode_segment(revision),
            path.join("/")
        )
    }

    /// Every file of `repo` at `revision`, with its size and checksum.
    pub async fn list_files(&self, repo: &str, revision: &str) -> Result<Vec<RepoFile>, Error> {
        check_repo_id(repo)?;
        let url = self.info_url(repo, revision);
        let resp = self
            .get(&url)
            .send()
            .await
            .map_err(|source| Error::Network {
                url: url.clone(),
                source,
            })?;
        let status = resp.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return Err(Error::NotFound {
                repo: repo.to_string(),
                revision: revision.to_string(),
                url,
            });
        }
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Err(Error::Http {
                url,
                status: status.as_u16(),
                body: truncate(&body, 300),
            });
        }
        let info: ModelInfo = resp.json().await.map_err(|e| Error::BadListing {
            repo: repo.to_string(),
            message: format!("{url} did not return model info JSON with `siblings`: {e}"),
        })?;
        info.siblings
            .into_iter()
            .map(|s| RepoFile::from_sibling(repo, s))
            .collect()
    }
}

/// Percent-encodes one URL path segment (revisions may contain `/`, file names spaces).
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

fn check_repo_id(repo: &str) -> Result<(), Error> {
    let ok = repo.split('/').count() == 2
        && repo.split('/').all(|p| {
            !p.is_empty()
                && p != "."
                && p != ".."
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        });
    if ok {
        Ok(())
    } else {
        Err(Error::BadListing {
            repo: repo.to_string(),
            message: "a repository id is OWNER/NAME (letters, digits, '-', '_', '.')".into(),
        })
    }
}

#[derive(Deserialize)]
struct ModelInfo {
    siblings: Vec<Sibling>,
}

#[derive(Deserialize)]
struct Sibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<Lfs>,
}

#[derive(Deserialize)]
struct Lfs {
    sha256: Option<String>,
    oid: Option<String>,
    size: Option<u64>,
}

/// What a file's content must hash to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "algorithm", content = "hex", rename_all = "snake_case")]
pub enum Checksum {
    /// An LFS file: SHA-256 of the content.
    Sha256(String),
    /// A plain git file: SHA-1 of `"blob {size}\0"` followed by the content.
    GitBlobSha1(String),
}

impl Checksum {
    fn name(&self) -> &'static str {
        match self {
            Checksum::Sha256(_) => "SHA-256",
            Checksum::GitBlobSha1(_) => "git blob SHA-1",
        }
    }
    fn hex(&self) -> &str {
        match self {
            Checksum::Sha256(h) | Checksum::GitBlobSha1(h) => h,
        }
    }
}

/// One file of a repository.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RepoFile {
    /// Path inside the repository (`/`-separated).
    pub path: String,
    pub size: u64,
    pub checksum: Checksum,
}

impl RepoFile {
    fn from_sibling(repo: &str, s: Sibling) -> Result<RepoFile, Error> {
        let bad = |message: String| Error::BadListing {
            repo: repo.to_string(),
            message,
        };
        check_relative_path(&s.rfilename).map_err(|m| bad(m.to_string()))?;
        let hexcheck = |h: &str, len: usize| {
            let h = h.trim().trim_start_matches("sha256:").to_ascii_lowercase();
            if h.len() == len && h.bytes().all(|b| b.is_ascii_hexdigit()) {
                Ok(h)
            } else {
                Err(bad(format!(
                    "{}: checksum {h:?} is not {len} hex digits",
                    s.rfilename
                )))
            }
        };
        let (size, checksum) = match &s.lfs {
            Some(lfs) => {
                let sha = lfs
                    .sha256
                    .as_deref()
                    .or(lfs.oid.as_deref())
                    .ok_or_else(|| {
                        bad(format!(
                            "{}: an LFS file without lfs.sha256 or lfs.oid",
                            s.rfilename
                        ))
                    })?;
                let size = lfs.size.or(s.size).ok_or_else(|| {
                    bad(format!("{}: no size (ask with ?blobs=true)", s.rfilename))
                })?;
                (size, Checksum::Sha256(hexcheck(sha, 64)?))
            }
            None => {
                let blob = s.blob_id.as_deref().ok_or_else(|| {
                    bad(format!(
                        "{}: no blobId to verify it by (ask with ?blobs=true)",
                        s.rfilename
                    ))
                })?;
                let size = s.size.ok_or_else(|| {
                    bad(format!("{}: no size (ask with ?blobs=true)", s.rfilename))
                })?;
                (size, Checksum::GitBlobSha1(hexcheck(blob, 40)?))
            }
        };
        Ok(RepoFile {
            path: s.rfilename,
            size,
            checksum,
        })
    }
}

/// A repository path must stay inside the destination folder.
fn check_relative_path(p: &str) -> Result<(), &'static str> {
    let path = Path::new(p);
    if p.is_empty()
        || p.ends_with(".part")
        || !path.components().all(|c| matches!(c, Component::Normal(_)))
    {
        return Err("a file path that would leave the destination folder (or end in .part)");
    }
    Ok(())
}

/// What to download and where.
#[derive(Debug, Clone)]
pub struct Request {
    /// `OWNER/NAME`.
    pub repo: String,
    pub revision: String,
    /// The checkpoint folder; files land at `dest/{path}`.
    pub dest: PathBuf,
    /// Configuration id whose disk need is checked first; `None`: the configuration whose
    /// repository is `repo`, if any ([`configuration_for_repo`]).
    pub config_id: Option<String>,
}

impl Request {
    pub fn new(repo: &str, dest: impl Into<PathBuf>) -> Request {
        Request {
            repo: repo.to_string(),
            revision: "main".to_string(),
            dest: dest.into(),
            config_id: None,
        }
    }
}

/// The configuration of the table published in `repo`.
pub fn configuration_for_repo(repo: &str) -> Option<&'static str> {
    CONFIGURATIONS
        .iter()
        .find(|c| c.hf_repo_hint.eq_ignore_ascii_case(repo))
        .map(|c| c.id)
}

/// Measures free space at a folder; [`capy_hardware::probe::probe_disk`] normally, a fake in
/// tests.
pub type DiskProbe = dyn Fn(&Path) -> Option<Disk> + Send + Sync;

/// Set to pause: the transfer stops at the next chunk, the `.part` stays for a resume.
#[derive(Debug, Clone, Default)]
pub struct CancelFlag(Arc<AtomicBool>);

impl CancelFlag {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst)
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Where a download is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Listing,
    Downloading,
    Verifying,
    Done,
}

/// Reported to the progress callback several times a second and at each file boundary.
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    pub phase: Phase,
    /// The file being fetched or verified.
    pub file: Option<String>,
    pub files_done: usize,
    pub files_total: usize,
    /// Bytes on disk of the whole download (resumed parts included).
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Recent transfer rate, bytes per second.
    pub speed_bytes_per_s: f64,
    /// Seconds left at that rate; `None` until a rate is known.
    pub eta_s: Option<f64>,
}

/// What a finished download did.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub dest: PathBuf,
    pub files: Vec<RepoFile>,
    /// Bytes fetched over the network this time.
    pub bytes_fetched: u64,
    /// Bytes that were on disk already (complete files and resumed parts).
    pub bytes_reused: u64,
    pub files_skipped: usize,
}

/// The final path and the `.part` path of a repository file under `dest`.
pub fn paths(dest: &Path, file: &str) -> (PathBuf, PathBuf) {
    let final_path = dest.join(file);
    let mut part = final_path.clone().into_os_string();
    part.push(".part");
    (final_path, PathBuf::from(part))
}

fn file_len(p: &Path) -> Option<u64> {
    std::fs::metadata(p)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len())
}

struct Meter {
    started: Instant,
    start_bytes: u64,
    total: u64,
    done: u64,
    last_sample: Instant,
    last_sample_bytes: u64,
    last_report: Instant,
    speed: f64,
}

impl Meter {
    fn sample(&mut self) {
        let now = Instant::now();
        let dt = now.duration_since(self.last_sample).as_secs_f64();
        if self.speed == 0.0 {
            // Until a first window has passed: the average since the start.
            let since = now.duration_since(self.started).as_secs_f64();
            if since >= 0.05 {
                self.speed = (self.done - self.start_bytes) as f64 / since;
            }
        }
        if dt >= 0.25 {
            let rate = (self.done - self.last_sample_bytes) as f64 / dt;
            self.speed = if self.speed == 0.0 {
                rate
            } else {
                0.7 * self.speed + 0.3 * rate
            };
            self.last_sample = now;
            self.last_sample_bytes = self.done;
        }
    }
    fn eta(&self) -> Option<f64> {
        (self.speed > 0.0).then(|| (self.total - self.done.min(self.total)) as f64 / self.speed)
    }
}

/// Downloads `req.repo` into `req.dest`; see the module docs for what is guaranteed.
pub async fn download(
    hub: &Hub,
    req: &Request,
    disk_probe: &DiskProbe,
    cancel: &CancelFlag,
    on_progress: &(dyn Fn(&Progress) + Send + Sync),
) -> Result<Summary, Error> {
    on_progress(&Progress {
        phase: Phase::Listing,
        file: None,
        files_done: 0,
        files_total: 0,
        bytes_done: 0,
        bytes_total: 0,
        speed_bytes_per_s: 0.0,
        eta_s: None,
    });
    let files = hub.list_files(&req.repo, &req.revision).await?;
    let total: u64 = files.iter().map(|f| f.size).sum();

    // What is on disk already: complete files (size matches) and partial ones.
    let mut present = 0u64;
    let mut complete = vec![false; files.len()];
    for (i, f) in files.iter().enumerate() {
        let (final_path, part) = paths(&req.dest, &f.path);
        if file_len(&final_path) == Some(f.size) {
            complete[i] = true;
            present += f.size;
        } else if let Some(n) = file_len(&part) {
            present += n.min(f.size);
        }
    }

    // Disk first: the configuration's need (table), then the bytes still to fetch.
    let disk = disk_probe(&req.dest);
    let config_id = req
        .config_id
        .clone()
        .or_else(|| configuration_for_repo(&req.repo).map(str::to_string));
    if let Some(id) = &config_id {
        let check = check_disk_space(disk.as_ref(), id, present)?;
        tracing::info!("disk check for {id}: {}", check.message);
    }
    let remaining = total - present.min(total);
    if let Some(d) = &disk {
        if d.free_bytes < remaining {
            return Err(Error::NotEnoughSpace {
                dir: d.measured_at.clone(),
                needed: gb(remaining),
                free: gb(d.free_bytes),
            });
        }
    }

    std::fs::create_dir_all(&req.dest).map_err(io_err(&req.dest))?;
    let now = Instant::now();
    let mut meter = Meter {
        started: now,
        start_bytes: present,
        total,
        done: present,
        last_sample: now,
        last_sample_bytes: present,
        last_report: now,
        speed: 0.0,
    };
    let mut summary = Summary {
        dest: req.dest.clone(),
        files: files.clone(),
        bytes_fetched: 0,
        bytes_reused: present,
        files_skipped: complete.iter().filter(|c| **c).count(),
    };
    let mut files_done = summary.files_skipped;
    let report = |meter: &Meter, phase: Phase, file: Option<&str>, files_done: usize| {
        on_progress(&Progress {
            phase,
            file: file.map(str::to_string),
            files_done,
            files_total: files.len(),
            bytes_done: meter.done,
            bytes_total: total,
            speed_bytes_per_s: meter.speed,
            eta_s: meter.eta(),
        })
    };
    for (i, f) in files.iter().enumerate() {
        if complete[i] {
            continue;
        }
        if cancel.is_cancelled() {
            return Err(Error::Cancelled);
        }
        report(&meter, Phase::Downloading, Some(&f.path), files_done);
        fetch_file(hub, req, f, cancel, &mut meter, &mut |m, phase| {
            if phase != Phase::Downloading || m.last_report.elapsed() >= Duration::from_millis(100)
            {
                m.last_report = Instant::now();
                report(m, phase, Some(&f.path), files_done);
            }
        })
        .await?;
        files_done += 1;
    }
    summary.bytes_fetched = meter.done - meter.start_bytes;
    report(&meter, Phase::Done, None, files_done);
    Ok(summary)
}

/// A streaming hasher for either checksum kind.
#[derive(Clone)]
enum Hasher {
    Sha256(sha2::Sha256),
    GitSha1(sha1::Sha1),
}

impl Hasher {
    fn new(c: &Checksum, size: u64) -> Hasher {
        match c {
            Checksum::Sha256(_) => Hasher::Sha256(sha2::Sha256::new()),
            Checksum::GitBlobSha1(_) => {
                let mut h = sha1::Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                Hasher::GitSha1(h)
            }
        }
    }
    fn update(&mut self, data: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(data),
            Hasher::GitSha1(h) => h.update(data),
        }
    }
    fn finish(self) -> String {
        match self {
            Hasher::Sha256(h) => hex::encode(h.finalize()),
            Hasher::GitSha1(h) => hex::encode(h.finalize()),
        }
    }
}

/// Hashes the first `len` bytes of an existing partial file (off the async threads).
async fn hash_prefix(part: &Path, mut hasher: Hasher) -> Result<Hasher, Error> {
    let part = part.to_path_buf();
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut f = std::fs::File::open(&part).map_err(io_err(&part))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf).map_err(io_err(&part))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
        Ok(hasher)
    })
    .await
    .expect("the hashing task does not panic")
}

async fn fetch_file(
    hub: &Hub,
    req: &Request,
    f: &RepoFile,
    cancel: &CancelFlag,
    meter: &mut Meter,
    tick: &mut (dyn FnMut(&mut Meter, Phase) + Send),
) -> Result<(), Error> {
    let (final_path, part) = paths(&req.dest, &f.path);
    if let Some(parent) = final_path.parent() {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    let mut have = file_len(&part).unwrap_or(0);
    if have > f.size {
        // Longer than the file can be: not ours to trust.
        std::fs::remove_file(&part).map_err(io_err(&part))?;
        meter.done -= f.size;
        have = 0;
    }
    let url = hub.file_url(&req.repo, &req.revision, &f.path);
    let mut hasher = Hasher::new(&f.checksum, f.size);
    if have < f.size {
        let mut request = hub.get(&url);
        if have > 0 {
            request = request.header(reqwest::header::RANGE, format!("bytes={have}-"));
        }
        let mut resp = request.send().await.map_err(|source| Error::Network {
            url: url.clone(),
            source,
        })?;
        let status = resp.status();
        let append = if status == reqwest::StatusCode::PARTIAL_CONTENT && have > 0 {
            let start = resp
                .headers()
                .get(reqwest::header::CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("bytes "))
                .and_then(|v| v.split('-').next())
                .and_then(|v| v.parse::<u64>().ok());
            if start != Some(have) {
                return Err(Error::Http {
                    url,
                    status: 206,
                    body: format!("asked for bytes from {have}, the Content-Range says {start:?}"),
                });
            }
            true
        } else if status.is_success() {
            // The server sent the whole file (no range support): start over.
            meter.done -= have;
            have = 0;
            false
        } else if status == reqwest::StatusCode::NOT_FOUND {
            return Err(Error::NotFound {
                repo: req.repo.clone(),
                revision: req.revision.clone(),
                url,
            });
        } else {
            let body = resp.text().await.unwrap_or_default();
            return Err(Error::Http {
                url,
                status: status.as_u16(),
                body: truncate(&body, 300),
            });
        };
        if append {
            hasher = hash_prefix(&part, hasher).await?;
        }
        let mut out = tokio::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&part)
            .await
            .map_err(io_err(&part))?;
        loop {
            if cancel.is_cancelled() {
                out.flush().await.map_err(io_err(&part))?;
                return Err(Error::Cancelled);
            }
            let chunk = match resp.chunk().await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(source) => {
                    // Keep what arrived for a resume.
                    out.flush().await.map_err(io_err(&part))?;
                    return Err(Error::Network { url, source });
                }
            };
            if have + chunk.len() as u64 > f.size {
                drop(out);
                let _ = std::fs::remove_file(&part);
                return Err(Error::SizeMismatch {
                    file: f.path.clone(),
                    expected: f.size,
                    found: have + chunk.len() as u64,
                });
            }
            out.write_all(&chunk).await.map_err(io_err(&part))?;
            hasher.update(&chunk);
            have += chunk.len() as u64;
            meter.done += chunk.len() as u64;
            meter.sample();
            tick(meter, Phase::Downloading);
        }
        out.sync_all().await.map_err(io_err(&part))?;
    } else {
        hasher = hash_prefix(&part, hasher).await?;
    }
    if have != f.size {
        return Err(Error::SizeMismatch {
            file: f.path.clone(),
            expected: f.size,
            found: have,
        });
    }
    tick(meter, Phase::Verifying);
    let found = hasher.finish();
    if found != f.checksum.hex() {
        let _ = std::fs::remove_file(&part);
        meter.done -= f.size;
        return Err(Error::ChecksumMismatch {
            file: f.path.clone(),
            algorithm: f.checksum.name(),
            expected: f.checksum.hex().to_string(),
            found,
        });
    }
    std::fs::rename(&part, &final_path).map_err(io_err(&final_path))?;
    if let Some(parent) = final_path.parent() {
        if let Ok(d) = std::fs::File::open(parent) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn git_blob_sha1_matches_git() {
        // `printf 'hello\n' | git hash-object --stdin`
        let c = Checksum::GitBlobSha1("ce013625030ba8dba906f756967f9e9ca394464a".into());
        let mut h = Hasher::new(&c, 6);
        h.update(b"hello\n");
        assert_eq!(h.finish(), c.hex());
    }

    #[test]
    fn paths_stay_inside() {
        for bad in ["../x", "/etc/passwd", "a/../../b", "", "x.part"] {
            assert!(check_relative_path(bad).is_err(), "{bad}");
        }
        assert!(check_relative_path("sub/model.safetensors").is_ok());
        assert!(check_repo_id("nvidia/Qwen3.8-27B-NVFP4").is_ok());
        assert!(check_repo_id("../x").is_err());
        assert!(check_repo_id("justname").is_err());
    }

    #[test]
    fn urls_follow_the_hub() {
        let hub = Hub::new("https://hf-mirror.example/", None);
        assert_eq!(
            hub.info_url("a/b", "main"),
            "https://hf-mirror.example/api/models/a/b?blobs=true"
        );
        assert_eq!(
            hub.file_url("a/b", "refs/pr/1", "dir/my file.json"),
            "https://hf-mirror.example/a/b/resolve/refs%2Fpr%2F1/dir/my%20file.json"
        );
    }

    #[test]
    fn table_repos_map_to_configurations() {
        assert_eq!(
            configuration_for_repo("nvidia/Qwen3.8-Flash-Next-NVFP4"),
            Some("qwen3.8-flash-next-nvfp4")
        );
        assert_eq!(configuration_for_repo("someone/else"), None);
    }
}
