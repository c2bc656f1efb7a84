//! One module per subcommand.

pub mod bench;
pub mod bench_agent_replay;
pub mod bench_cpu_experts;
pub mod bench_gpu;
pub mod bench_http;
pub mod bench_hybrid;
pub mod doctor;
pub mod download;
pub mod generate;
pub mod model_arg;
pub mod score;
pub mod serve;
