//! The `shoal` command: thin argument parsing and output over the library crates.

mod bench;
mod launch;
mod run;

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
    /// Start N processes of a command (or a job file) with the environment
    /// contract and supervise them, like torchrun.
    Run(run::RunArgs),
    /// Show Shoal working end to end on this machine.
    Demo,
    /// List the built-in datasets.
    Datasets {
        /// One JSON array of objects (name, kind, len, features, classes, description).
        #[arg(long)]
        json: bool,
    },
    /// One rank of a training job (started by `shoal run JOB.toml`).
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        output: std::path::PathBuf,
        #[arg(long)]
        resume: bool,
        job: std::path::PathBuf,
    },
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
        Cmd::Run(args) => return run::main(&args),
        Cmd::Bench { op, args } => bench::run_bench(op, &args),
        Cmd::BenchRank { spec } => bench::run_rank(&spec).map(|()| true),
        Cmd::Worker { output, resume, job } => worker(&job, output, resume),
        Cmd::Demo => demo(),
        Cmd::Datasets { json } => datasets(json),
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

fn worker(job: &std::path::Path, output: std::path::PathBuf, resume: bool) -> Result<bool> {
    // Tensors of a training step are allocated and freed every step. Keep freed
    // memory in the process instead of returning it to the kernel, so the next
    // step does not pay a page fault and a zeroed page for every fresh buffer.
    // SAFETY: mallopt only changes glibc's allocation thresholds.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
    let spec = shoal_train::spec::load_job(job).map_err(|e| anyhow::anyhow!("{e}"))?;
    shoal_train::worker::run(&spec, &shoal_train::worker::WorkerOptions { output, resume })?;
    Ok(true)
}

fn datasets(json: bool) -> Result<bool> {
    let list = shoal_data::catalogue();
    if json {
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        println!("{:<10} {:<10} {:>8} {:>9} {:>8}  description", "name", "kind", "samples", "features", "classes");
        for d in &list {
            let kind = serde_json::to_value(d.kind)?.as_str().unwrap_or("?").to_string();
            println!("{:<10} {:<10} {:>8} {:>9} {:>8}  {}", d.name, kind, d.len, d.features, d.classes, d.description);
        }
    }
    Ok(true)
}

/// The demo: all-reduce checked element by element over shared memory and TCP,
/// then an MLP trained data-parallel on the handwritten digits by two workers.
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
    let dir = std::env::temp_dir().join(format!("shoal-demo-{}", std::process::id()));
    let job = dir.join("mlp_digits.toml");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(&job, DEMO_JOB)?;
    println!();
    let code = run::run_job(2, &job, Some(&dir.join("run")), false, false)?;
    ok &= code == std::process::ExitCode::SUCCESS;
    Ok(ok)
}

/// The demo's training job (the same as `examples/mlp_digits.toml`).
const DEMO_JOB: &str = include_str!("../../../examples/mlp_digits.toml");
