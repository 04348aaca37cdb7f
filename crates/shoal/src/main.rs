//! The `shoal` command: thin argument parsing and output over the library crates.

mod bench;
mod launch;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "shoal", version, about = "Shoal: distributed training that never hangs silently")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Measure a collective across N local rank processes (nccl-tests style table).
    Bench {
        #[arg(value_enum, id = "collective")]
        op: bench::BenchOp,
        #[command(flatten)]
        args: bench::BenchArgs,
    },
    /// Show Shoal working end to end on this machine.
    Demo,
    /// One rank of `shoal bench` (started by it).
    #[command(hide = true, name = "bench-rank")]
    BenchRank { spec: String },
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("SHOAL_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> std::process::ExitCode {
    init_tracing();
    let cli = Cli::parse();
    let result: Result<bool> = match cli.command {
        Cmd::Bench { op, args } => bench::run_bench(op, &args),
        Cmd::BenchRank { spec } => bench::run_rank(&spec).map(|()| true),
        Cmd::Demo => demo(),
    };
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The demo: all-reduce checked element by element over shared memory and TCP.
fn demo() -> Result<bool> {
    let mut ok = true;
    for transport in ["shm", "tcp"] {
        let args = bench::BenchArgs {
            ranks: 4,
            transport: transport.into(),
            algo: "auto".into(),
            sizes: "4KiB,1MiB,16MiB".into(),
            dtype: "f32".into(),
            op: "sum".into(),
            iters: None,
            warmup: None,
            timeout: "30s".into(),
            check: true,
            json: false,
        };
        ok &= bench::run_bench(bench::BenchOp::Allreduce, &args)?;
    }
    Ok(ok)
}
