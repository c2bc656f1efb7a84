//! A local hub that answers like Hugging Face: `GET /api/models/{owner}/{name}?blobs=true`
//! (siblings with `size`, `blobId`, and `lfs.sha256` for LFS files) and
//! `GET /{owner}/{name}/resolve/{rev}/{*path}` with `Range` support. Faults on demand: cut the
//! next transfer after N bytes, advertise a wrong checksum, ignore `Range`, stream slowly.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use sha1::Digest as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Clone)]
pub struct HubFile {
    pub path: String,
    pub content: Vec<u8>,
    pub lfs: bool,
    /// Advertise this checksum instead of the true one (a corrupt upload or a tampered mirror).
    pub wrong_checksum: bool,
    /// Listed but not served (404 on resolve).
    pub missing: bool,
}

impl HubFile {
    pub fn new(path: &str, content: Vec<u8>, lfs: bool) -> Self {
        HubFile {
            path: path.into(),
            content,
            lfs,
            wrong_checksum: false,
            missing: false,
        }
    }
}

#[derive(Default)]
pub struct Faults {
    /// Cut the next content transfer after this many bytes of the body.
    pub cut_next_after: Option<usize>,
    pub ignore_range: bool,
    pub chunk_delay_ms: u64,
}

pub struct Hub {
    pub repos: HashMap<String, Vec<HubFile>>,
    pub faults: Mutex<Faults>,
    /// The `Range` header of every content request, in order.
    pub ranges: Mutex<Vec<Option<String>>>,
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(b))
}

pub fn git_blob_sha1(b: &[u8]) -> String {
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", b.len()).as_bytes());
    h.update(b);
    hex::encode(h.finalize())
}

/// Deterministic content that is not all one byte.
pub fn content(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect()
}

async fn info(
    State(hub): State<Arc<Hub>>,
    Path((owner, name)): Path<(String, String)>,
) -> Response {
    let Some(files) = hub.repos.get(&format!("{owner}/{name}")) else {
        return (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": "Repository not found"})),
        )
            .into_response();
    };
    let siblings: Vec<serde_json::Value> = files
        .iter()
        .map(|f| {
            let mut sha = sha256_hex(&f.content);
            let mut blob = git_blob_sha1(&f.content);
            if f.wrong_checksum {
                sha = sha256_hex(b"something else");
                blob = git_blob_sha1(b"something else");
            }
            if f.lfs {
                serde_json::json!({"rfilename": f.path, "size": f.content.len(), "blobId": git_blob_sha1(b"pointer"),
                    "lfs": {"sha256": sha, "size": f.content.len(), "pointerSize": 134}})
            } else {
                serde_json::json!({"rfilename": f.path, "size": f.content.len(), "blobId": blob})
            }
        })
        .collect();
    Json(serde_json::json!({"id": format!("{owner}/{name}"), "sha": "0123456789abcdef0123456789abcdef01234567", "siblings": siblings})).into_response()
}

async fn resolve(
    State(hub): State<Arc<Hub>>,
    Path((owner, name, _rev, path)): Path<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    hub.ranges.lock().unwrap().push(range.clone());
    let file = hub
        .repos
        .get(&format!("{owner}/{name}"))
        .and_then(|fs| fs.iter().find(|f| f.path == path && !f.missing));
    let Some(file) = file else {
        return (StatusCode::NOT_FOUND, "Entry not found").into_response();
    };
    let (cut, ignore_range, delay) = {
        let mut f = hub.faults.lock().unwrap();
        (f.cut_next_after.take(), f.ignore_range, f.chunk_delay_ms)
    };
    let len = file.content.len();
    let start = match range.as_deref().filter(|_| !ignore_range) {
        Some(r) => {
            let Some(s) = r
                .strip_prefix("bytes=")
                .and_then(|r| r.strip_suffix('-'))
                .and_then(|s| s.parse::<usize>().ok())
            else {
                return (StatusCode::BAD_REQUEST, "unsupported range").into_response();
            };
            if s >= len {
                return (StatusCode::RANGE_NOT_SATISFIABLE, "").into_response();
            }
            Some(s)
        }
        None => None,
    };
    let body_bytes = file.content[start.unwrap_or(0)..].to_vec();
    let body_len = body_bytes.len();
    let chunks: Vec<Result<Bytes, std::io::Error>> = {
        let mut v = Vec::new();
        let limit = cut.unwrap_or(usize::MAX).min(body_len);
        for c in body_bytes[..limit].chunks(4096) {
            v.push(Ok(Bytes::copy_from_slice(c)));
        }
        if cut.is_some_and(|c| c < body_len) {
            v.push(Err(std::io::Error::other("connection cut by the test hub")));
        }
        v
    };
    let stream = futures::StreamExt::then(futures::stream::iter(chunks), move |c| async move {
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
        c
    });
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_LENGTH, body_len.into());
    h.insert(header::ACCEPT_RANGES, "bytes".parse().unwrap());
    if let Some(s) = start {
        *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
        resp.headers_mut().insert(
            header::CONTENT_RANGE,
            format!("bytes {s}-{}/{len}", len - 1).parse().unwrap(),
        );
    }
    resp
}

/// Starts the hub on a free local port; returns its endpoint URL.
pub async fn start(repos: HashMap<String, Vec<HubFile>>) -> (String, Arc<Hub>) {
    let hub = Arc::new(Hub {
        repos,
        faults: Mutex::new(Faults::default()),
        ranges: Mutex::new(Vec::new()),
    });
    let app = Router::new()
        .route("/api/models/{owner}/{name}", get(info))
        .route("/{owner}/{name}/resolve/{rev}/{*path}", get(resolve))
        .with_state(hub.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), hub)
}
