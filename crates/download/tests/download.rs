//! Library-level download tests against a local hub that emulates the Hugging Face endpoints.

mod hub;

use capy_download::{download, paths, CancelFlag, Error, Hub, Phase, Progress, Request};
use capy_hardware::Disk;
use hub::{content, HubFile};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

const REPO: &str = "capy-test/tiny-model";

fn files() -> Vec<HubFile> {
    vec![
        HubFile::new(
            "config.json",
            br#"{"model_type": "qwen3_5_text"}"#.to_vec(),
            false,
        ),
        HubFile::new("model.safetensors", content(300_000, 7), true),
        HubFile::new("sub/tokenizer.json", content(5_000, 3), false),
    ]
}

async fn start(files: Vec<HubFile>) -> (Hub, std::sync::Arc<hub::Hub>) {
    let (url, state) = hub::start(HashMap::from([(REPO.to_string(), files)])).await;
    (Hub::new(&url, None), state)
}

fn plenty(dir: &Path) -> Option<Disk> {
    fake_disk(dir, 1 << 40)
}

fn fake_disk(dir: &Path, free: u64) -> Option<Disk> {
    Some(Disk {
        models_dir: dir.to_path_buf(),
        measured_at: dir.to_path_buf(),
        free_bytes: free,
        total_bytes: free * 2,
    })
}

fn parts_left(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in walk(dir) {
        if e.ends_with(".part") {
            out.push(e);
        }
    }
    out
}

fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p.to_string_lossy().into_owned());
            }
        }
    }
    out
}

fn no_progress(_: &Progress) {}

/// The plain case: plenty of disk, never cancelled, progress ignored.
async fn fetch(hub: &Hub, repo: &str, dest: &Path) -> Result<capy_download::Summary, Error> {
    download(
        hub,
        &Request::new(repo, dest),
        &plenty,
        &CancelFlag::new(),
        &no_progress,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downloads_verifies_and_skips_what_is_complete() {
    let (hub, _state) = start(files()).await;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("tiny");
    let seen: Mutex<Vec<Progress>> = Mutex::new(Vec::new());
    let record = |p: &Progress| seen.lock().unwrap().push(p.clone());
    let summary = download(
        &hub,
        &Request::new(REPO, &dest),
        &plenty,
        &CancelFlag::new(),
        &record,
    )
    .await
    .unwrap();
    for f in files() {
        assert_eq!(
            std::fs::read(dest.join(&f.path)).unwrap(),
            f.content,
            "{}",
            f.path
        );
    }
    assert!(parts_left(&dest).is_empty());
    let total: u64 = files().iter().map(|f| f.content.len() as u64).sum();
    assert_eq!(summary.bytes_fetched, total);
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.first().unwrap().phase, Phase::Listing);
    let last = seen.last().unwrap();
    assert_eq!(
        (last.phase, last.bytes_done, last.bytes_total),
        (Phase::Done, total, total)
    );
    assert_eq!((last.files_done, last.files_total), (3, 3));
    assert!(seen.iter().any(|p| p.phase == Phase::Verifying));
    // bytes_done never goes backwards on a clean run
    assert!(seen.windows(2).all(|w| w[0].bytes_done <= w[1].bytes_done));

    let again = fetch(&hub, REPO, &dest).await.unwrap();
    assert_eq!((again.files_skipped, again.bytes_fetched), (3, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_transfer_resumes_with_a_range_request() {
    let (hub, state) = start(files()).await;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("tiny");
    // config.json comes first, then the big file is cut after 120_000 bytes.
    std::fs::create_dir_all(&dest).unwrap();
    std::fs::write(
        dest.join("config.json"),
        br#"{"model_type": "qwen3_5_text"}"#,
    )
    .unwrap();
    state.faults.lock().unwrap().cut_next_after = Some(120_000);
    let err = fetch(&hub, REPO, &dest).await.unwrap_err();
    assert!(matches!(err, Error::Network { .. }), "{err}");
    let (final_path, part) = paths(&dest, "model.safetensors");
    assert!(
        !final_path.exists(),
        "an interrupted file must not be marked complete"
    );
    let kept = std::fs::metadata(&part).unwrap().len();
    assert!(kept > 0 && kept <= 120_000, "kept {kept}");

    let summary = fetch(&hub, REPO, &dest).await.unwrap();
    assert_eq!(std::fs::read(&final_path).unwrap(), content(300_000, 7));
    assert!(parts_left(&dest).is_empty());
    assert_eq!(summary.bytes_fetched, 300_000 - kept + 5_000);
    let ranges = state.ranges.lock().unwrap().clone();
    assert_eq!(ranges[0], None);
    assert_eq!(ranges[1], Some(format!("bytes={kept}-")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_ignores_range_restarts_the_file_correctly() {
    let (hub, state) = start(files()).await;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("tiny");
    state.faults.lock().unwrap().cut_next_after = Some(10);
    fetch(&hub, REPO, &dest).await.unwrap_err();
    state.faults.lock().unwrap().ignore_range = true;
    fetch(&hub, REPO, &dest).await.unwrap();
    for f in files() {
        assert_eq!(std::fs::read(dest.join(&f.path)).unwrap(), f.content);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_checksum_is_refused_and_nothing_is_marked_complete() {
    for lfs in [true, false] {
        let mut fs = files();
        fs[1].lfs = lfs;
        fs[1].wrong_checksum = true;
        let (hub, _state) = start(fs).await;
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("tiny");
        let err = fetch(&hub, REPO, &dest).await.unwrap_err();
        match &err {
            Error::ChecksumMismatch {
                file, algorithm, ..
            } => {
                assert_eq!(file, "model.safetensors");
                assert_eq!(*algorithm, if lfs { "SHA-256" } else { "git blob SHA-1" });
            }
            other => panic!("expected a checksum mismatch, got {other}"),
        }
        assert!(err.to_string().contains("nothing was marked complete"));
        assert!(!dest.join("model.safetensors").exists());
        assert!(parts_left(&dest).is_empty(), "the corrupt .part is deleted");
        // The file before it is complete and verified, the one after was never started.
        assert!(dest.join("config.json").exists());
        assert!(!dest.join("sub/tokenizer.json").exists());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_partial_file_is_caught_at_verification() {
    let (hub, _state) = start(files()).await;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("tiny");
    std::fs::create_dir_all(&dest).unwrap();
    let (final_path, part) = paths(&dest, "model.safetensors");
    std::fs::write(&part, vec![0u8; 50_000]).unwrap();
    let err = fetch(&hub, REPO, &dest).await.unwrap_err();
    assert!(matches!(err, Error::ChecksumMismatch { .. }), "{err}");
    assert!(!final_path.exists() && !part.exists());
    // The next run fetches it afresh and succeeds.
    fetch(&hub, REPO, &dest).await.unwrap();
    assert_eq!(std::fs::read(&final_path).unwrap(), content(300_000, 7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_found_repository_and_file() {
    let mut fs = files();
    fs[2].missing = true;
    let (hub, _state) = start(fs).await;
    let dir = tempfile::tempdir().unwrap();
    let err = fetch(&hub, "capy-test/nope", &dir.path().join("x"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("capy-test/nope") && err.to_string().contains("HF_TOKEN"));
    assert!(
        !dir.path().join("x").exists(),
        "nothing is created for a missing repository"
    );

    let dest = dir.path().join("tiny");
    let err = fetch(&hub, REPO, &dest).await.unwrap_err();
    match &err {
        Error::NotFound { url, .. } => {
            assert!(url.ends_with("/resolve/main/sub/tokenizer.json"), "{url}")
        }
        other => panic!("expected 404, got {other}"),
    }
    assert!(!dest.join("sub/tokenizer.json").exists());
    assert!(parts_left(&dest).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_is_refused_before_fetching() {
    let (hub, state) = start(files()).await;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("tiny");
    let tiny = |d: &Path| fake_disk(d, 100_000);
    let err = download(
        &hub,
        &Request::new(REPO, &dest),
        &tiny,
        &CancelFlag::new(),
        &no_progress,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::NotEnoughSpace { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("0.3 GB") || msg.contains("GB"), "{msg}");
    assert!(
        state.ranges.lock().unwrap().is_empty(),
        "no content was requested"
    );
    assert!(!dest.exists());

    // A repository of the configuration table is checked against the table's disk need
    // (15 GB for the 27B 3-bit) even though this listing is tiny.
    let mut req = Request::new(REPO, &dest);
    req.config_id = Some("qwen3.8-27b-gsq3".into());
    let ten_gb = |d: &Path| fake_disk(d, 10_000_000_000);
    let err = download(&hub, &req, &ten_gb, &CancelFlag::new(), &no_progress)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Disk(_)), "{err}");
    assert!(err.to_string().contains("15"), "{err}");
    let sixteen_gb = |d: &Path| fake_disk(d, 16_000_000_000);
    download(&hub, &req, &sixteen_gb, &CancelFlag::new(), &no_progress)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_keeps_the_part_and_resume_finishes() {
    let (hub, state) = start(files()).await;
    state.faults.lock().unwrap().chunk_delay_ms = 5;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("tiny");
    let cancel = CancelFlag::new();
    let c2 = cancel.clone();
    let pause_at = move |p: &Progress| {
        if p.file.as_deref() == Some("model.safetensors") && p.bytes_done > 100_000 {
            c2.cancel();
        }
    };
    let err = download(
        &hub,
        &Request::new(REPO, &dest),
        &plenty,
        &cancel,
        &pause_at,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Cancelled), "{err}");
    let (final_path, part) = paths(&dest, "model.safetensors");
    assert!(!final_path.exists());
    let kept = std::fs::metadata(&part).unwrap().len();
    assert!(kept > 60_000 && kept < 300_000, "kept {kept}");
    let speeds: Mutex<Vec<(f64, Option<f64>)>> = Mutex::new(Vec::new());
    let rec = |p: &Progress| {
        if p.phase == Phase::Downloading {
            speeds.lock().unwrap().push((p.speed_bytes_per_s, p.eta_s))
        }
    };
    download(
        &hub,
        &Request::new(REPO, &dest),
        &plenty,
        &CancelFlag::new(),
        &rec,
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read(&final_path).unwrap(), content(300_000, 7));
    let speeds = speeds.into_inner().unwrap();
    assert!(
        speeds.iter().any(|(s, eta)| *s > 0.0 && eta.is_some()),
        "speed and ETA are reported while downloading: {speeds:?}"
    );
}
