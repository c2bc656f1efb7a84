//! `capy-flash download REPO`: fetch a checkpoint from Hugging Face (or `HF_ENDPOINT`),
//! resumable, every file verified against the hub's checksums, free disk checked first.

use anyhow::{Context, Result};
use capy_download::{CancelFlag, Hub, Phase, Progress, Request};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face repository, OWNER/NAME (e.g. nvidia/Qwen3.8-Flash-Next-NVFP4).
    pub repo: String,
    /// Folder for the checkpoint (default: the models folder / NAME).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The models folder the default --dir lives in.
    #[arg(long, env = "CAPY_MODELS_DIR")]
    pub models_dir: Option<PathBuf>,
    /// Branch, tag or commit.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// Configuration id whose disk need is checked first (default: the configuration published
    /// in REPO, if any; see `capy-flash doctor`).
    #[arg(long)]
    pub config: Option<String>,
}

pub fn run(a: Args) -> Result<()> {
    let name = a.repo.rsplit('/').next().unwrap_or(&a.repo).to_string();
    let dest = match &a.dir {
        Some(d) => d.clone(),
        None => a
            .models_dir
            .clone()
            .unwrap_or_else(capy_hardware::default_models_dir)
            .join(&name),
    };
    let mut req = Request::new(&a.repo, &dest);
    req.revision = a.revision.clone();
    req.config_id = a.config.clone();
    let hub = Hub::from_env();
    eprintln!(
        "downloading {} ({}) from {} into {}",
        a.repo,
        a.revision,
        hub.endpoint(),
        dest.display()
    );
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:30!} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    let on_progress = |p: &Progress| {
        bar.set_length(p.bytes_total);
        bar.set_position(p.bytes_done);
        let what = match p.phase {
            Phase::Listing => "listing files".to_string(),
            Phase::Downloading | Phase::Verifying => {
                let verb = if p.phase == Phase::Verifying {
                    "verifying"
                } else {
                    ""
                };
                format!(
                    "{verb} {} ({}/{})",
                    p.file.as_deref().unwrap_or(""),
                    p.files_done + 1,
                    p.files_total
                )
                .trim()
                .to_string()
            }
            Phase::Done => "done".to_string(),
        };
        bar.set_message(what);
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let cancel = CancelFlag::new();
    let c2 = cancel.clone();
    let summary = rt.block_on(async {
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                c2.cancel();
            }
        });
        capy_download::download(
            &hub,
            &req,
            &capy_hardware::probe::probe_disk,
            &cancel,
            &on_progress,
        )
        .await
    });
    bar.finish_and_clear();
    let summary = summary.with_context(|| format!("downloading {}", a.repo))?;
    eprintln!(
        "{}: {} files verified in {} ({} fetched, {} already present)",
        a.repo,
        summary.files.len(),
        dest.display(),
        capy_hardware::plan::gb(summary.bytes_fetched),
        capy_hardware::plan::gb(summary.bytes_reused)
    );
    println!("{}", dest.display());
    Ok(())
}
