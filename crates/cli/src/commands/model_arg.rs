//! `--model DIR|demo|demo-moe`, shared by every subcommand that loads a model.

use anyhow::Result;
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
    let model = model::load(CpuBackend::new(), &ck)?;
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
