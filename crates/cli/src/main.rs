//! `capy-flash`: the headless command-line face of Capy Flash.

mod commands;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "capy-flash",
    version,
    about = "Local inference server for Qwen3.8-Flash-Next and Qwen3.8-27B"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Stream a completion of a prompt (raw or as a chat turn).
    Generate(commands::generate::Args),
    /// Score token ids or text: per-position log-probabilities as JSON.
    Score(commands::score::Args),
    /// Serve OpenAI- and Anthropic-compatible HTTP APIs (default 127.0.0.1:8439).
    Serve(commands::serve::Args),
    /// Benchmarks; every figure is reported with its ratio to a ceiling measured in the same run.
    Bench(commands::bench::Args),
    /// Hardware check: the machine, which configurations fit, and the one to run.
    Doctor(commands::doctor::Args),
    /// Download a checkpoint from Hugging Face (HF_ENDPOINT for mirrors): resumable, verified.
    Download(commands::download::Args),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CAPY_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => commands::generate::run(a),
        Command::Score(a) => commands::score::run(a),
        Command::Serve(a) => commands::serve::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Doctor(a) => commands::doctor::run(a),
        Command::Download(a) => commands::download::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
