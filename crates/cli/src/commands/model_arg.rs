//! `--model DIR|demo|demo-moe` and `--backend auto|cpu|cuda`, shared by every subcommand that
//! loads a model.

use anyhow::{Context, Result};
use capy_engine::backend::cpu::CpuBackend;
use capy_engine::chat_template::{load_tokenizer_and_template, ChatTemplate};
use capy_engine::checkpoint::Checkpoint;
use capy_engine::demo;
use capy_engine::model::{self, CausalLm};
use capy_engine::tokenizer::Tokenizer;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct ModelArg {
    /// A Hugging Face model folder, or a built-in demo model: "demo" (dense Qwen3.8 layout) or
    /// "demo-moe" (Flash-Next layout: sparse attention, MoE, hyper-connections, PLE).
    #[arg(long)]
    pub model: String,
    #[command(flatten)]
    pub backend: BackendArg,
}

/// Where the model runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// CUDA when a driver and a GPU are usable, else the CPU (with a note saying why).
    Auto,
    Cpu,
    Cuda,
}

#[derive(clap::Args, Clone, Debug)]
pub struct BackendArg {
    /// Where the model runs: auto (CUDA GPU 0 when a driver and a GPU are present, else the
    /// CPU), cpu, or cuda (an error when no GPU is usable).
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    pub backend: BackendKind,
    /// With CUDA: caps the bytes the engine allocates on the GPU (bytes, or a size such as
    /// 15GiB, 16GB).
    #[arg(long, value_parser = super::bench_gpu::parse_bytes)]
    pub vram_budget: Option<u64>,
    /// Tensor parallelism over N ranks: N GPUs with CUDA (each card with its own
    /// --vram-budget; refused when fewer are visible), N rank threads on the CPU.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Flash-Next on CUDA: VRAM for the routed-expert cache (the other experts stay in host RAM
    /// and run on the CPU). Default with --vram-budget: what the budget leaves after the dense
    /// weights and --vram-reserve; without either, every expert is put on the GPU.
    #[arg(long, value_parser = super::bench_gpu::parse_bytes)]
    pub expert_cache: Option<u64>,
    /// Flash-Next on CUDA with --vram-budget: VRAM held back for KV, states and activations.
    #[arg(long, default_value = "2GiB", value_parser = super::bench_gpu::parse_bytes)]
    pub vram_reserve: u64,
}

impl BackendArg {
    /// Loads `ck` on the chosen backend; returns the model and the backend's name ("cpu",
    /// "cuda"). `auto` falls back to the CPU only when the GPU cannot be opened; a model that
    /// fails to load on an opened GPU is an error, not a silent CPU run.
    pub fn load(&self, ck: &Checkpoint) -> Result<(Box<dyn CausalLm>, &'static str)> {
        if self.tp != 1 {
            return self.load_tp(ck);
        }
        let cuda = match self.backend {
            BackendKind::Cpu => None,
            BackendKind::Cuda => Some(open_cuda(self.vram_budget).map_err(|e| {
                anyhow::anyhow!(
                    "--backend cuda: no usable CUDA GPU: {e:#}. Use --backend cpu (or auto) to run on the CPU"
                )
            })?),
            BackendKind::Auto => match open_cuda(self.vram_budget) {
                Ok(b) => Some(b),
                Err(e) => {
                    eprintln!("note: --backend auto: running on the CPU, no usable CUDA GPU ({e:#})");
                    None
                }
            },
        };
        match cuda {
            Some(backend) if ck.config.qwen4_exp().is_ok() && self.hybrid_wanted() => {
                Ok((self.load_hybrid(backend, ck)?, "cuda"))
            }
            Some(backend) => {
                let model = model::load(backend, ck).context("loading the model on the GPU")?;
                Ok((model, "cuda"))
            }
            None => {
                if self.vram_budget.is_some() {
                    eprintln!("note: --vram-budget is ignored on the CPU backend");
                }
                Ok((model::load(CpuBackend::new(), ck)?, "cpu"))
            }
        }
    }
}

impl BackendArg {
    fn hybrid_wanted(&self) -> bool {
        self.expert_cache.is_some() || self.vram_budget.is_some()
    }

    /// The expert cache's VRAM: `--expert-cache`, else what `--vram-budget` leaves after the
    /// dense weights and `--vram-reserve` (printed).
    fn expert_cache_bytes(&self, ck: &Checkpoint) -> Result<u64> {
        use capy_engine::hybrid::load::vram_plan;
        Ok(match (self.expert_cache, self.vram_budget) {
            (Some(bytes), _) => bytes,
            (None, Some(budget)) => {
                let plan = vram_plan(ck, budget, self.vram_reserve)?;
                eprintln!(
                    "capy-flash: VRAM plan (GiB): budget {:.2} = dense weights {:.2} + reserve {:.2} + expert cache {:.2}",
                    gib(plan.budget),
                    gib(plan.dense_bytes),
                    gib(plan.reserve),
                    gib(plan.cache_bytes)
                );
                plan.cache_bytes
            }
            (None, None) => unreachable!("hybrid_wanted"),
        })
    }

    /// Flash-Next with hybrid experts: dense weights and an expert cache on the GPU, the
    /// routed experts in page-locked host RAM computed on the CPU when not cached.
    fn load_hybrid(
        &self,
        backend: capy_engine::backend::cuda::CudaBackend,
        ck: &Checkpoint,
    ) -> Result<Box<dyn CausalLm>> {
        use capy_engine::hybrid::{load_flash_next, HybridOptions};
        let cache_bytes = self.expert_cache_bytes(ck)?;
        let machine = capy_hardware::probe::probe();
        let o = HybridOptions {
            cache_bytes: cache_bytes as usize,
            page_locked_limit: Some(machine.page_locked.cap_bytes),
            ..Default::default()
        };
        let handle = backend.clone();
        let driver_before = handle.device_memory_used().ok();
        let ledger_before = handle.ledger().used + handle.pooled_bytes();
        let h =
            load_flash_next(backend, ck, &o).context("loading Flash-Next with hybrid experts")?;
        let r = &h.report;
        eprintln!(
            "capy-flash: hybrid experts: {} layers × {} experts ({}), host store {:.2} GiB ({:.2} GiB page-locked), expert cache {} slots{}",
            r.moe_layers,
            r.experts_per_layer,
            r.formats,
            gib(r.host_bytes as u64),
            gib(r.pinned_bytes as u64),
            r.cache_slots,
            if r.all_resident { " (every expert resident)" } else { "" }
        );
        if let Some(w) = &r.warning {
            eprintln!("warning: {w}");
        }
        // The ledgers beside what the OS and the driver say the load took.
        if let Some(c) = &r.store_memory {
            eprintln!(
                "capy-flash: RAM ledger: host store {:.2} GiB; resident anonymous memory grew {:.2} GiB building it (ratio {:.3}), {:.2} GiB over the whole load; resident now {:.2} GiB, peak {:.2} GiB",
                gib(c.ledger_bytes),
                gib(c.measured_bytes),
                c.measured_to_ledger_ratio,
                gib(r.load_anon_growth_bytes),
                gib(r.process_after_load.map_or(0, |p| p.rss)),
                gib(r.process_after_load.map_or(0, |p| p.rss_peak)),
            );
        }
        if let (Some(d0), Ok(d1)) = (driver_before, handle.device_memory_used()) {
            let ledger =
                (handle.ledger().used + handle.pooled_bytes()).saturating_sub(ledger_before);
            let c = capy_engine::hybrid::memory::MemoryCheck::new(ledger, d1.saturating_sub(d0));
            eprintln!(
                "capy-flash: VRAM ledger: {:.2} GiB allocated by the load; the driver's used memory grew {:.2} GiB (ratio {:.3})",
                gib(c.ledger_bytes),
                gib(c.measured_bytes),
                c.measured_to_ledger_ratio
            );
        }
        Ok(Box::new(h.model))
    }

    /// `--tp N`: the model split over N GPUs or N CPU rank threads (`auto` takes the GPUs when
    /// N of them are visible).
    fn load_tp(&self, ck: &Checkpoint) -> Result<(Box<dyn CausalLm>, &'static str)> {
        use capy_engine::parallel::{self, TpDevices};
        let n = self.tp;
        let cuda = TpDevices::Cuda {
            vram_budget: self.vram_budget,
        };
        let (devices, name) = match self.backend {
            BackendKind::Cpu => (TpDevices::Cpu, "cpu"),
            BackendKind::Cuda => (cuda, "cuda"),
            BackendKind::Auto => {
                match parallel::cuda::gpu_count().and_then(|g| parallel::cuda::check_gpus(n, g)) {
                    Ok(()) => (cuda, "cuda"),
                    Err(e) => {
                        eprintln!(
                            "note: --backend auto --tp {n}: running {n} CPU rank threads ({e:#})"
                        );
                        (TpDevices::Cpu, "cpu")
                    }
                }
            }
        };
        let hybrid = name == "cuda" && ck.config.qwen4_exp().is_ok() && self.hybrid_wanted();
        let model = if hybrid {
            // Each card's budget holds the whole dense part here (its shard is smaller): the
            // cache sizes err on the safe side.
            let o = capy_engine::hybrid::HybridOptions {
                cache_bytes: self.expert_cache_bytes(ck)? as usize,
                page_locked_limit: Some(capy_hardware::probe::probe().page_locked.cap_bytes),
                ..Default::default()
            };
            eprintln!(
                "capy-flash: hybrid experts over {n} ranks: one host expert store, an expert cache of {:.2} GiB on each GPU for the experts that GPU owns",
                gib(o.cache_bytes as u64)
            );
            parallel::load_tp_hybrid(ck, n, self.vram_budget, &o)
        } else {
            parallel::load_tp(ck, n, &devices)
        }
        .with_context(|| format!("loading the model with --tp {n} on {name}"))?;
        eprintln!("capy-flash: tensor parallel over {n} ranks ({name})");
        Ok((model, name))
    }
}

fn open_cuda(vram_budget: Option<u64>) -> Result<capy_engine::backend::cuda::CudaBackend> {
    let b = capy_engine::backend::cuda::CudaBackend::new(0, vram_budget)?;
    eprintln!("capy-flash: running on CUDA device 0");
    Ok(b)
}

/// A loaded model with its tokenizer and template (when the folder has them).
pub struct Loaded {
    pub dir: PathBuf,
    pub model: Box<dyn CausalLm>,
    pub tokenizer: Option<Tokenizer>,
    pub template: Option<ChatTemplate>,
}

/// Resolves `--model` to a folder: the demo is generated on first use.
pub fn resolve(name: &str) -> Result<PathBuf> {
    if demo::is_demo_name(name) {
        let dir = demo::ensure_demo_model(name)?;
        eprintln!("note: \"{name}\" is the built-in demo model with random weights: its output is gibberish.");
        Ok(dir)
    } else {
        Ok(PathBuf::from(name))
    }
}

pub fn open_model(arg: &ModelArg) -> Result<Loaded> {
    let dir = resolve(&arg.model)?;
    let ck = Checkpoint::open(&dir)?;
    let (model, _) = arg.backend.load(&ck)?;
    // `ck.dir` is the folder (the parent of a `.gguf` file given as --model).
    let (tokenizer, template) = if ck.dir.join("tokenizer.json").exists() {
        let (t, tpl) = load_tokenizer_and_template(&ck.dir)?;
        (Some(t), tpl)
    } else {
        (None, None)
    };
    Ok(Loaded {
        dir,
        model,
        tokenizer,
        template,
    })
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
