//! The hardware guard of `capy-flash serve`, end to end: a model folder whose config maps to a
//! configuration that does not fit the (fake, `CAPY_FAKE_MACHINE`) machine is refused with the
//! numbers before anything is loaded; `NINFER_RAM_GUARD=0` / `CAPY_RAM_GUARD=0` start it anyway
//! with a warning; a CPU without AVX2 + FMA + F16C is refused outright.

use capy_hardware::probe::page_locked_from;
use capy_hardware::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;

fn cache_dir() -> PathBuf {
    std::env::temp_dir().join("capy-cli-tests-cache")
}

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_capy-flash"));
    c.env("CAPY_CACHE_DIR", cache_dir())
        .env_remove("NINFER_RAM_GUARD")
        .env_remove("CAPY_RAM_GUARD")
        .env_remove("CAPY_API_KEY");
    c
}

fn card(index: usize) -> Gpu {
    Gpu {
        index,
        name: "NVIDIA GeForce RTX 5070 Ti".into(),
        compute_capability: ComputeCapability::SM_120,
        total_vram_bytes: 16_303 << 20,
        free_vram_bytes: Some(15_800 << 20),
        multiprocessors: Some(70),
        memory_bandwidth_gb_s: Some(896.0),
    }
}

/// Two RTX 5070 Ti with `total`/`available` RAM and the given CPU features, as JSON in `dir`.
fn fake_machine(dir: &Path, total: u64, available: u64, features: CpuFeatures) -> PathBuf {
    let m = Machine {
        cpu: Cpu {
            model: "Fake CPU".into(),
            physical_cores: Some(8),
            logical_cores: 16,
            usable_threads: 16,
            features,
        },
        memory: Memory {
            total_bytes: total,
            available_bytes: available,
        },
        page_locked: page_locked_from(MemlockLimit::Unlimited, None, total),
        os: Os {
            name: "Linux".into(),
            kernel: None,
            arch: "x86_64".into(),
        },
        gpus: vec![card(0), card(1)],
        gpu_note: None,
        cuda_driver_version: Some("13.1".into()),
        disk: None,
    };
    let path = dir.join("machine.json");
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    path
}

const AVX2: CpuFeatures = CpuFeatures {
    avx2: true,
    fma: true,
    f16c: true,
    avx512f: false,
    avx512bw: false,
    avx512vl: false,
    avx512vnni: false,
};

fn nvfp4() -> Value {
    json!({"quant_method": "modelopt", "quant_algo": "NVFP4"})
}

/// A folder holding only a `config.json`: the guard must decide from it alone.
fn config_only(dir: &Path, config: Value) -> PathBuf {
    let folder = dir.join("config-only");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
    folder
}

/// The demo model's files (tiny, random, real tokenizer) with a config that says "Qwen3.8-27B
/// NVFP4": a real, loadable folder that maps to a configuration of the table.
fn tiny_folder_posing_as_27b_nvfp4(dir: &Path) -> PathBuf {
    std::env::set_var("CAPY_CACHE_DIR", cache_dir());
    let demo = capy_engine::demo::ensure_demo_model("demo").unwrap();
    let folder = dir.join("tiny-27b-nvfp4");
    std::fs::create_dir_all(&folder).unwrap();
    for entry in std::fs::read_dir(&demo).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if name != "config.json" {
            std::os::unix::fs::symlink(&path, folder.join(name)).unwrap();
        }
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(demo.join("config.json")).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("capy_demo");
    config["quantization_config"] = nvfp4();
    std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
    folder
}

fn serve_once(model: &Path, machine: &Path, envs: &[(&str, &str)]) -> Output {
    let mut c = bin();
    c.args(["serve", "--port", "0", "--model"])
        .arg(model)
        .env("CAPY_FAKE_MACHINE", machine);
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_refused(out: &Output, expected: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(expected), "expected {expected:?} in: {err}");
}

#[test]
#[cfg(unix)]
fn flash_next_nvfp4_on_a_64_gb_machine_is_refused_with_the_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let machine = fake_machine(
        dir.path(),
        62 * GIB + 4 * GIB / 5,
        61 * GIB + GIB / 5 + 1,
        AVX2,
    );
    let folder = config_only(
        dir.path(),
        json!({"model_type": "qwen4_exp", "quantization_config": nvfp4()}),
    );
    let out = serve_once(&folder, &machine, &[]);
    assert_refused(
        &out,
        "error: refusing to load Qwen3.8-Flash-Next NVFP4 on this machine:\n  \
         - Qwen3.8-Flash-Next NVFP4 needs a 96 GB machine (at least 90.0 GiB of RAM); this one has 62.8 GiB\n  \
         - Qwen3.8-Flash-Next NVFP4 needs ~75 GiB free RAM; 61.2 GiB is available\n\
         Set NINFER_RAM_GUARD=0 to start anyway (the system may swap or kill the server).",
    );
    let err = stderr(&out);
    assert!(
        err.contains("model_type \"qwen4_exp\" with NVFP4 weights: Qwen3.8-Flash-Next NVFP4 (qwen3.8-flash-next-nvfp4)"),
        "{err}"
    );
    assert!(err.contains("warning: CAPY_FAKE_MACHINE="), "{err}");

    // CAPY_RAM_GUARD=0 lets it past the guard, with a warning; only then does loading fail
    // (the folder has no weights), which shows the guard ran before anything was loaded.
    let out = serve_once(&folder, &machine, &[("CAPY_RAM_GUARD", "0")]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(
            "warning: CAPY_RAM_GUARD=0: starting anyway although Qwen3.8-Flash-Next NVFP4 needs ~75 GiB free RAM; 61.2 GiB is available"
        ),
        "{err}"
    );
    assert!(!err.contains("refusing"), "{err}");

    // The GGUF-experts edition of the same model fits this machine.
    std::fs::write(folder.join("experts-00001-of-00002.gguf"), b"").unwrap();
    let out = serve_once(&folder, &machine, &[]);
    let err = stderr(&out);
    assert!(
        err.contains("Qwen3.8-Flash-Next 64 GB edition (GSQ-RCO experts) (qwen3.8-flash-next-64g)"),
        "{err}"
    );
    assert!(!err.contains("refusing"), "{err}");
}

#[test]
#[cfg(unix)]
fn a_cpu_without_f16c_is_refused_outright_even_for_the_demo() {
    let dir = tempfile::tempdir().unwrap();
    let no_f16c = CpuFeatures {
        f16c: false,
        ..AVX2
    };
    let machine = fake_machine(dir.path(), 64 * GIB, 60 * GIB, no_f16c);
    let out = serve_once(Path::new("demo"), &machine, &[("NINFER_RAM_GUARD", "0")]);
    assert_refused(
        &out,
        "error: refusing to start: Capy Flash needs AVX2 + FMA + F16C on the CPU; this CPU (Fake CPU) \
         lacks F16C. No override exists",
    );
    // A configuration of the table: refused with its name, override or not.
    let folder = config_only(
        dir.path(),
        json!({"model_type": "qwen3_5", "quantization_config": nvfp4()}),
    );
    let out = serve_once(&folder, &machine, &[("NINFER_RAM_GUARD", "0")]);
    assert_refused(
        &out,
        "Qwen3.8-27B NVFP4 runs on the GPU, but Capy Flash needs AVX2 + FMA + F16C on the CPU; \
         this CPU (Fake CPU) lacks F16C",
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn get_health(port: u16) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Kills the server when the test ends, however it ends.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
#[cfg(unix)]
fn the_ram_override_starts_a_refused_model_and_it_serves() {
    let dir = tempfile::tempdir().unwrap();
    // Two 16 GB cards but only 4 GiB available: the 27B NVFP4 wants ~8 GiB free.
    let machine = fake_machine(dir.path(), 16 * GIB, 4 * GIB, AVX2);
    let folder = tiny_folder_posing_as_27b_nvfp4(dir.path());

    let out = serve_once(&folder, &machine, &[]);
    assert_refused(
        &out,
        "error: refusing to load Qwen3.8-27B NVFP4 on this machine:\n  \
         - Qwen3.8-27B NVFP4 needs ~8 GiB free RAM; 4.0 GiB is available\n\
         Set NINFER_RAM_GUARD=0 to start anyway",
    );
    assert!(!stderr(&out).contains("serving"), "{}", stderr(&out));

    let port = free_port();
    let log = dir.path().join("serve.log");
    let mut c = bin();
    c.args(["serve", "--port", &port.to_string(), "--model"])
        .arg(&folder)
        .env("CAPY_FAKE_MACHINE", &machine)
        .env("NINFER_RAM_GUARD", "0")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut server = Server(c.spawn().unwrap());
    let deadline = Instant::now() + Duration::from_secs(120);
    let health = loop {
        if let Some(exited) = server.0.try_wait().unwrap() {
            panic!(
                "serve exited with {exited}: {}",
                std::fs::read_to_string(&log).unwrap()
            );
        }
        if let Some(h) = get_health(port) {
            break h;
        }
        assert!(
            Instant::now() < deadline,
            "no /health within 120 s: {}",
            std::fs::read_to_string(&log).unwrap()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.contains("tiny-27b-nvfp4"), "{health}");
    let err = std::fs::read_to_string(&log).unwrap();
    assert!(
        err.contains(
            "warning: NINFER_RAM_GUARD=0: starting anyway although Qwen3.8-27B NVFP4 needs ~8 GiB free RAM; 4.0 GiB is available"
        ),
        "{err}"
    );
    assert!(err.contains("capy-flash: serving tiny-27b-nvfp4"), "{err}");
    drop(server);
}
