//! The `shoal` command: thin argument parsing and output over the library crates.

mod bench;
mod bench_balance;
mod bench_ckpt;
mod bench_compress;
mod bench_ps;
mod bench_workloads;
mod checkpoint;
mod data;
mod faults;
mod fed;
mod k8s;
mod nodes;
mod plan;
mod platform;
mod run;
mod sim;
mod validate;

use anyhow::Result;

/// Counts the heap, so a worker reports the memory its steps use from the real buffers.
#[global_allocator]
static ALLOC: shoal_train::memory::CountingAlloc = shoal_train::memory::CountingAlloc;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "shoal", version, about = "Shoal: distributed training that never hangs silently")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Measure a collective across N local rank processes (nccl-tests style
    /// table), `checkpoint`: checkpoint save speed against the disk's, or
    /// `compress`: each gradient codec's speed, bytes sent and all-reduce time.
    Bench {
        #[arg(value_enum, id = "what")]
        op: bench::BenchWhat,
        #[command(flatten)]
        args: bench::BenchArgs,
    },
    /// Start N processes of a command (or a job file) with the environment
    /// contract and supervise them, like torchrun.
    Run(run::RunArgs),
    /// Show Shoal working end to end on this machine: an embedded server runs a built-in
    /// data-parallel training job on real data.
    Demo {
        /// Leave the server running afterwards (Ctrl-C stops it).
        #[arg(long)]
        keep: bool,
        /// Train for this many steps instead of the job's 800 (a quicker look).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        steps: Option<u64>,
        /// Print one JSON object on stdout at the end (job id, state, summary, events,
        /// diagnosis, data directory; the dashboard URL with --keep); progress goes to stderr.
        #[arg(long)]
        json: bool,
    },
    /// Run the platform: API, scheduler, local executor, state in SQLite (or PostgreSQL).
    Server(platform::ServerArgs),
    /// Replay a job trace through the scheduler on a simulated cluster: JCT, queueing, allocation,
    /// fragmentation, preemptions and fairness per policy (`compare` several; `synth` writes a trace).
    Sim(sim::SimArgs),
    /// Submit a job spec to a server; prints the job id.
    Submit {
        job: std::path::PathBuf,
        /// Print `{"id": ...}`.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: platform::ClientArgs,
    },
    /// List jobs (your team's; an admin's: all).
    Jobs {
        /// Only these states, comma-separated (pending, running, preempted, succeeded, failed, cancelled).
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: platform::ClientArgs,
    },
    /// A job's state, workers, events and result.
    Status {
        id: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: platform::ClientArgs,
    },
    /// A worker's output.
    Logs {
        id: String,
        #[arg(long, default_value_t = 0)]
        rank: u32,
        /// Keep streaming until the job ends.
        #[arg(long, short)]
        follow: bool,
        #[command(flatten)]
        client: platform::ClientArgs,
    },
    /// Cancel a job (its workers get SIGTERM, then SIGKILL).
    Cancel {
        id: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: platform::ClientArgs,
    },
    /// A running job's ranks now: the collective each is in (or finished last), its sequence number and time in
    /// it, or how long it has been silent; the ranks holding the others up.
    Debug {
        id: String,
        /// Print the dump as JSON (`{"job_id", "attempt", "step", "stalled_s", "culprits", "summary", "ranks"}`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: platform::ClientArgs,
    },
    /// Kill (or with --stop, SIGSTOP) a random worker of a running job at an interval, printing each fault:
    /// `shoal chaos ID --kill-every 30s [--for 5m] [--seed S] [--stop] [--json]`.
    Chaos(faults::ChaosArgs),
    /// Queues with their guarantees and what they hold.
    Queues {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: platform::ClientArgs,
    },
    /// What holds a job back (data loading, communication, a straggler, idle or short resources), with the
    /// evidence and what to do.
    Diagnose {
        id: String,
        /// Print `{"findings": [{"kind", "rank", "evidence", "action"}]}`.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: platform::ClientArgs,
    },
    /// What jobs cost: resource-hours allocated and used, queue time, money; per job and per team.
    Cost {
        #[arg(long)]
        team: Option<String>,
        /// Only jobs submitted since then: 90m, 24h, 7d, or epoch milliseconds.
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: platform::ClientArgs,
    },
    /// Nodes with their capacity and allocation.
    Nodes {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: platform::ClientArgs,
    },
    /// Check a job spec here, with no server: prints it with every default filled in (TOML), or every
    /// problem with its key path; exit status 1 when invalid.
    Validate {
        job: std::path::PathBuf,
        /// Print `{"ok": true, "spec": {...}}` or `{"ok": false, "errors": [{"path", "message", ...}]}`.
        #[arg(long)]
        json: bool,
    },
    /// Layouts (data × tensor × pipeline × ZeRO) for a job's model on a cluster, with memory and step-time
    /// estimates: fitting and fastest first.
    Plan(plan::PlanArgs),
    /// Kubernetes: the objects that run a job, for `kubectl apply` or GitOps.
    K8s {
        #[command(subcommand)]
        cmd: k8s::K8sCmd,
    },
    /// Checkpoints on disk: `inspect` what one holds and how it is laid out, `consolidate` its full tensors by
    /// parameter name into one safetensors file.
    Checkpoint {
        #[command(subcommand)]
        cmd: checkpoint::CheckpointCmd,
    },
    /// Data where it lives: `inspect` a file, prefix or glob in an object store or on a path.
    Data {
        #[command(subcommand)]
        cmd: data::DataCmd,
    },
    /// Federated learning's real clients: `client` trains on its own data for a job's server
    /// (`federated.listen`); `partition` cuts a job's dataset into one file per client.
    Fed {
        #[command(subcommand)]
        cmd: fed::FedCmd,
    },
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
    /// One rank of `shoal bench compress` (started by it).
    #[command(hide = true, name = "bench-compress-rank")]
    BenchCompressRank { spec: String },
    /// One worker or server of `shoal bench ps` (started by it).
    #[command(hide = true, name = "bench-ps-rank")]
    BenchPsRank { spec: String },
    /// One worker or server of `shoal bench recommender` or `a3c` (started by it).
    #[command(hide = true, name = "bench-workload-rank")]
    BenchWorkloadRank { spec: String },
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

/// Whether a closed stdout (`shoal jobs | head -1`) ends the command quietly, as it does any Unix filter: SIGPIPE's
/// default action, which Rust's runtime replaces by ignoring it (a write then fails with EPIPE and `println!`
/// panics). The launcher, the server and the ranks keep ignoring it: a closed pipe must not stop supervision,
/// serving or training (their own output tolerates it).
fn quiet_on_closed_stdout(cmd: &Cmd) -> bool {
    !matches!(
        cmd,
        Cmd::Run(_)
            | Cmd::Server(_)
            | Cmd::Worker { .. }
            | Cmd::BenchRank { .. }
            | Cmd::BenchCompressRank { .. }
            | Cmd::BenchPsRank { .. }
            | Cmd::BenchWorkloadRank { .. }
    )
}

fn main() -> std::process::ExitCode {
    init_tracing();
    let cli = Cli::parse();
    if quiet_on_closed_stdout(&cli.command) {
        // SAFETY: restores a signal's default disposition before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result: Result<bool> = match cli.command {
        Cmd::Run(args) => return run::main(&args),
        Cmd::Bench { op: bench::BenchWhat::Compress, args } => bench_compress::run(&args),
        Cmd::Bench { op: bench::BenchWhat::Ps, args } => bench_ps::run(&args),
        Cmd::Bench { op: bench::BenchWhat::Recommender, args } => bench_workloads::recommender(&args),
        Cmd::Bench { op: bench::BenchWhat::A3c, args } => bench_workloads::a3c(&args),
        Cmd::Bench { op: bench::BenchWhat::Balance, args } => bench_balance::run_balance(&args),
        Cmd::Bench { op, args } if op.collective().is_none() => bench_ckpt::run(&args),
        Cmd::Bench { op, args } => bench::run_bench(op, &args),
        Cmd::BenchRank { spec } => bench::run_rank(&spec).map(|()| true),
        Cmd::BenchCompressRank { spec } => bench_compress::run_rank(&spec).map(|()| true),
        Cmd::BenchPsRank { spec } => bench_ps::run_rank(&spec).map(|()| true),
        Cmd::BenchWorkloadRank { spec } => bench_workloads::run_rank(&spec).map(|()| true),
        Cmd::Worker { output, resume, job } => worker(&job, output, resume),
        Cmd::Demo { keep, steps, json } => platform::demo(keep, steps.map(|n| n as usize), json),
        Cmd::Server(args) => platform::server(&args),
        Cmd::Submit { job, json, client } => {
            platform::Client::from_args(&client).and_then(|c| platform::submit(&c, &job, json))
        }
        Cmd::Jobs { state, json, client } => {
            platform::Client::from_args(&client).and_then(|c| platform::jobs(&c, state.as_deref(), json))
        }
        Cmd::Status { id, json, client } => {
            platform::Client::from_args(&client).and_then(|c| platform::status(&c, &id, json))
        }
        Cmd::Logs { id, rank, follow, client } => {
            platform::Client::from_args(&client).and_then(|c| platform::logs(&c, &id, rank, follow))
        }
        Cmd::Cancel { id, json, client } => {
            platform::Client::from_args(&client).and_then(|c| platform::cancel(&c, &id, json))
        }
        Cmd::Debug { id, json, client } => {
            platform::Client::from_args(&client).and_then(|c| faults::debug(&c, &id, json))
        }
        Cmd::Chaos(args) => faults::chaos(&args),
        Cmd::Queues { json, client } => platform::Client::from_args(&client).and_then(|c| platform::queues(&c, json)),
        Cmd::Diagnose { id, json, client } => {
            platform::Client::from_args(&client).and_then(|c| platform::diagnose(&c, &id, json))
        }
        Cmd::Cost { team, since, json, client } => platform::Client::from_args(&client)
            .and_then(|c| platform::cost(&c, team.as_deref(), since.as_deref(), json)),
        Cmd::Nodes { json, client } => platform::Client::from_args(&client).and_then(|c| platform::nodes(&c, json)),
        Cmd::Datasets { json } => datasets(json),
        Cmd::Data { cmd } => data::run(&cmd),
        Cmd::Fed { cmd } => fed::run(&cmd),
        Cmd::Validate { job, json } => validate::run(&job, json),
        Cmd::K8s { cmd } => k8s::run(&cmd),
        Cmd::Plan(args) => plan::run(&args),
        Cmd::Checkpoint { cmd } => checkpoint::run(&cmd),
        Cmd::Sim(args) => sim::run(&args),
    };
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        // A worker stopped from outside at a step boundary, with its checkpoint: not an error, but not the end of
        // the run either (EX_TEMPFAIL: resume it).
        Err(e) if matches!(e.downcast_ref(), Some(shoal_train::Error::Stopped { .. })) => {
            eprintln!("stopped: {e:#}");
            std::process::ExitCode::from(shoal_exec::STOPPED_EXIT as u8)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            match e.downcast_ref() {
                // A job's own program failed: its rank exits with the program's status.
                Some(shoal_train::Error::Program { code, .. }) => {
                    std::process::ExitCode::from((*code).clamp(1, 255) as u8)
                }
                _ => std::process::ExitCode::FAILURE,
            }
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
