//! The models folder is watched (`notify`): a checkpoint folder added or removed by hand shows
//! up in (or leaves) `/admin/checkpoints`, and the watcher's change counter — what the
//! dashboard polls to know it must redraw — moves. Its own test binary: the admin state is
//! process-wide and reads `CAPY_MODELS_DIR` once.

use capy_engine::scheduler::scripted::ScriptedLm;
use capy_engine::scheduler::{Scheduler, SchedulerConfig};
use capy_engine::tokenizer::{demo_tokenizer_json, Tokenizer, DEMO_IM_END_ID};
use capy_server::{AppState, ServerConfig};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn get(addr: SocketAddr, path: &str) -> Value {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}\n{body}"
    );
    serde_json::from_str(body).unwrap()
}

fn other(v: &Value, name: &str) -> Option<Value> {
    v["other_folders"]
        .as_array()?
        .iter()
        .find(|f| f["name"] == name)
        .cloned()
}

/// Polls `/admin/checkpoints` until `done` holds (the watcher is asynchronous).
async fn wait_for(addr: SocketAddr, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let v = get(addr, "/admin/checkpoints").await;
        if done(&v) {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn folders_added_and_removed_by_hand_are_followed() {
    let tmp = std::env::temp_dir().join(format!("capy-models-watch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let models = tmp.join("models");
    // Before the first admin() call, which reads them (this binary has this one test).
    std::env::set_var("CAPY_MODELS_DIR", &models);
    std::env::set_var("CAPY_CONFIG_DIR", tmp.join("config"));

    let tok = Arc::new(Tokenizer::from_json_bytes(&demo_tokenizer_json()).unwrap());
    let lm = ScriptedLm::new(tok.vocab_size(), 64, vec![], DEMO_IM_END_ID);
    let scheduler = Scheduler::start(Box::new(lm), tok.clone(), SchedulerConfig::default());
    let state = Arc::new(AppState::new(
        scheduler,
        tok,
        None,
        "scripted".into(),
        ServerConfig::default(),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(capy_server::serve(listener, state, std::future::pending()));

    let v = get(addr, "/admin/checkpoints").await;
    assert_eq!(v["models_dir"], models.to_str().unwrap());
    assert_eq!(v["watching"], true, "the models folder is watched: {v:#}");
    assert!(other(&v, "by-hand").is_none());
    let before = v["changes"].as_u64().unwrap();

    std::fs::create_dir(models.join("by-hand")).unwrap();
    std::fs::write(models.join("by-hand/config.json"), b"{}").unwrap();
    let v = wait_for(addr, "the watcher to see the new folder", |v| {
        v["changes"].as_u64().unwrap() > before
    })
    .await;
    let f = other(&v, "by-hand").expect("the folder is listed");
    assert_eq!(f["state"], "installed", "{f:#}");
    assert_eq!(f["bytes_on_disk"], 2);

    let seen = v["changes"].as_u64().unwrap();
    std::fs::remove_dir_all(models.join("by-hand")).unwrap();
    let v = wait_for(addr, "the watcher to see the folder removed", |v| {
        v["changes"].as_u64().unwrap() > seen && other(v, "by-hand").is_none()
    })
    .await;
    assert!(other(&v, "by-hand").is_none());
    let _ = std::fs::remove_dir_all(&tmp);
}
