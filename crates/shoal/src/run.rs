//! `shoal run`, the launcher for users (like `torchrun`):
//!
//! ```text
//! shoal run -n N [--output DIR] [--timeout-grace 10s] [--json] -- CMD ARGS…
//! shoal run [-n N] [--output DIR] [--resume] [--json] JOB.toml
//! ```
//!
//! A job file runs with `-n` workers or its `workers.count` (1 when neither is given); when both are given and
//! differ, it is refused naming both.
//!
//! **Several hosts, no cluster manager** (as with `torchrun`): run one launcher per host,
//!
//! ```text
//! shoal run --nnodes N --node-rank R --rdzv HOST:PORT [-n PER_NODE] JOB.toml | -- CMD ARGS…
//! ```
//!
//! with the same secret in `SHOAL_JOB_SECRET` on every host. Node 0 hosts the rendezvous store at `PORT` (on
//! every address; `HOST` is how the others reach it) and PyTorch's `MASTER_PORT` is `PORT + 1`; node R's ranks
//! are `R × PER_NODE …`; a job file's `workers.count` is the whole job's (PER_NODE × N). A rank that fails on one
//! node is named on every node and stops the job everywhere; ranks whose peers never arrive time out naming
//! them. Only node 0 prints the job's summary (rank 0 writes it); checkpoints are rank 0's, so resuming on
//! several hosts needs the output directory or `checkpoint.url` shared between them.
//!
//! The first form starts the rendezvous store and N processes of CMD on this
//! machine with the environment contract (`SHOAL_*` and PyTorch's `MASTER_ADDR`,
//! `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`) and
//! supervises them through [`crate::launch`]:
//!
//! - every line a rank prints is printed as `[rank R] line`, its stdout lines on
//!   stdout and its stderr lines on stderr; with `--output DIR` the raw lines
//!   (both streams, unprefixed) also go to `DIR/logs/rank-R.log`;
//! - with `--json`, rank output goes only to stderr (and the log files), so that
//!   stdout holds exactly one JSON object, printed at the end:
//!   `{"ranks", "ok", "interrupted", "statuses": [{"rank", "exit_code", "signal"}],
//!   "first_failure": {"rank", "status"} | null, "elapsed_s"}`;
//! - when a rank fails, the others get SIGTERM, and SIGKILL after the grace
//!   (`--timeout-grace`); `shoal run: rank R exited with status C` (or
//!   `killed by signal S`) names it on stderr;
//! - SIGINT (Ctrl-C) or SIGTERM to `shoal run` is forwarded to every rank, which
//!   get SIGKILL after the grace or at a second Ctrl-C;
//! - nothing outlives it: each rank runs in its own process group and every
//!   signal goes to the group; see `launch.rs` for the rest of that guarantee.
//!
//! Exit status: 0 when every rank exited 0; otherwise the first failing rank's
//! exit code, or 128 + its signal; 130 after SIGINT (143 after SIGTERM); 127 when
//! CMD is not found, 126 when it cannot be executed; 1 for bad arguments.

use std::fs::File;
use std::io::{LineWriter, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use shoal_exec::launch::{LaunchSpec, Nodes, OnFailure, Policy, launch_with};
use shoal_exec::procfs::{describe, signal_name};
use shoal_exec::{ExecError, SpawnError};

#[derive(Debug, clap::Args)]
#[command(
    after_help = "With --json, rank output goes only to stderr (and DIR/logs), and stdout holds one JSON object \
                  printed at the end.\nExit status: 0 if every rank succeeded, else the failing rank's exit code \
                  (128 + signal if it was killed); 130 after Ctrl-C; 127 if CMD is not found."
)]
pub struct RunArgs {
    /// Number of ranks (processes) to start on this machine; for a job file, default its workers.count
    /// (else 1), and when both are given they must agree.
    #[arg(short = 'n', long = "ranks", value_name = "N")]
    pub ranks: Option<usize>,
    /// Create DIR and write each rank's raw output lines to DIR/logs/rank-R.log.
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,
    /// How long ranks get to stop after SIGTERM (a rank failed) or a forwarded
    /// Ctrl-C before they are killed, e.g. `10s`, `500ms`.
    #[arg(long, default_value = "10s", value_name = "DURATION")]
    pub timeout_grace: String,
    /// Print one JSON object with every rank's status at the end, on stdout
    /// (rank output then goes to stderr only).
    #[arg(long)]
    pub json: bool,
    /// Resume a job from its newest valid checkpoint (job files only).
    #[arg(long)]
    pub resume: bool,
    /// Say more at start (a federated job: each client's label histogram).
    #[arg(short, long)]
    pub verbose: bool,
    #[command(flatten)]
    pub nodes: crate::nodes::NodeArgs,
    /// A job file (built-in models) instead of `-- CMD ARGS…`.
    #[arg(value_name = "JOB.toml")]
    pub job: Option<PathBuf>,
    /// The program to run in every rank, and its arguments (after `--`).
    #[arg(last = true, value_name = "CMD ARGS")]
    pub command: Vec<String>,
}

/// `shoal run`: parses what clap left to us, runs, and turns the outcome into the
/// exit status.
pub fn main(args: &RunArgs) -> ExitCode {
    match run(args) {
        Ok(code) => code,
        Err(e) => {
            let spawn = e.downcast_ref::<SpawnError>().or(match e.downcast_ref::<ExecError>() {
                Some(ExecError::Spawn(s)) => Some(s),
                _ => None,
            });
            let code = match spawn.map(|s| s.source.kind()) {
                Some(std::io::ErrorKind::NotFound) => 127,
                Some(std::io::ErrorKind::PermissionDenied) => 126,
                _ => 1,
            };
            eprintln!("shoal run: {e:#}");
            ExitCode::from(code)
        }
    }
}

fn run(args: &RunArgs) -> Result<ExitCode> {
    if args.ranks == Some(0) {
        bail!("-n/--ranks must be at least 1");
    }
    let grace = shoal_comm::env::parse_duration(&args.timeout_grace)
        .with_context(|| format!("--timeout-grace {:?}", args.timeout_grace))?;
    let nodes = args.nodes.nodes()?;
    match (&args.job, args.command.is_empty()) {
        (Some(job), true) if job.extension().is_some_and(|e| e == "toml") => {
            run_job(args.ranks, job, args.output.as_deref(), args.resume, args.json, args.verbose, nodes)
        }
        (Some(job), true) => bail!(
            "{} is not a job file (JOB.toml); to run a program, put `--` before it: shoal run -n {} -- {} …",
            job.display(),
            args.ranks.unwrap_or(1),
            job.display()
        ),
        (Some(job), false) => {
            bail!("give either a job file or `-- CMD ARGS…`, not both ({} and {})", job.display(), args.command[0])
        }
        (None, true) => bail!("nothing to run: give `-- CMD ARGS…` or JOB.toml"),
        (None, false) if args.resume => bail!("--resume applies to job files, not to `-- CMD`"),
        (None, false) => {
            let Some(ranks) = args.ranks else { bail!("how many ranks? give -n N before `--`") };
            let program = resolve_program(&args.command[0])?;
            let opts =
                RunOptions { ranks, output: args.output.clone(), grace, json: args.json, progress: false, nodes };
            run_ranks(&program, &args.command[1..], &[], &opts)
        }
    }
}

/// How many workers a job file runs with: `-n` or `workers.count`, which must agree when both are given; 1 when
/// neither is (an elastic `workers.min`/`max` then needs `-n`, within them). Errors name the file and the keys.
fn worker_count(spec: &shoal_train::spec::JobSpec, ranks: Option<usize>, job: &Path) -> Result<usize> {
    let w = &spec.workers;
    let file = job.display();
    let n = match (ranks, w.count.map(|c| c as usize)) {
        (Some(n), Some(c)) if n != c => {
            bail!("{file}: workers.count = {c} but -n {n}: give one of them, or the same number in both")
        }
        (Some(n), _) => n,
        (None, Some(c)) => c,
        (None, None) if w.min.is_some() || w.max.is_some() => {
            bail!("{file}: workers.min/max describe an elastic job; give -n N to choose how many run here")
        }
        (None, None) => 1,
    };
    if let Some(lo) = w.min.filter(|&lo| n < lo as usize) {
        bail!("{file}: -n {n} is below workers.min = {lo}");
    }
    if let Some(hi) = w.max.filter(|&hi| n > hi as usize) {
        bail!("{file}: -n {n} is above workers.max = {hi}");
    }
    Ok(n)
}

/// `shoal run [-n N] [--output DIR] [--resume] JOB.toml`.
pub fn run_job(
    ranks: Option<usize>,
    job: &Path,
    output: Option<&Path>,
    resume: bool,
    json: bool,
    verbose: bool,
    nodes: Option<Nodes>,
) -> Result<ExitCode> {
    // Every error of the spec names the file and its key path, before any process starts.
    let spec = shoal_train::spec::load_job(job).map_err(|e| anyhow::anyhow!("{e}"))?;
    if shoal_train::spec::data::is_lake(&spec.train.dataset) {
        // A lake dataset's files and columns, checked where they are before any process starts.
        shoal_train::worker::open_data(&spec.train)
            .map_err(|e| anyhow::anyhow!("{}: train.dataset: {e}", job.display()))?;
    }
    let hosts = nodes.as_ref().map_or(1, |n| n.count);
    let world = worker_count(&spec, ranks.map(|n| n * hosts), job)?;
    if world % hosts != 0 {
        bail!("{}: workers.count = {world} cannot be split evenly over --nnodes {hosts}", job.display());
    }
    // Parameter servers run beside the workers, as the last ranks.
    let servers = spec.ps_servers();
    if servers > 0 && hosts > 1 {
        bail!(
            "{}: train.strategy = \"ps\" runs on one host under shoal run (its {servers} server(s) beside the workers); \
             submit it to a platform to spread it",
            job.display()
        );
    }
    // Workers on this host, and the processes started here.
    let n = world / hosts;
    let processes = n + servers;
    spec.validate_world(world).map_err(|e| anyhow::anyhow!("{}", e.with_origin(&job.display().to_string())))?;
    let out = output.map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("shoal-runs").join(&spec.name));
    std::fs::create_dir_all(&out).with_context(|| format!("creating the output directory {}", out.display()))?;
    let exe = std::env::current_exe().context("locating the shoal executable")?;
    let mut args = vec!["worker".to_string(), "--output".into(), out.display().to_string()];
    if resume {
        args.push("--resume".into());
    }
    args.push(job.display().to_string());
    use std::io::IsTerminal;
    let progress = !json && std::io::stderr().is_terminal();
    let node_rank = nodes.as_ref().map_or(0, |n| n.rank);
    let opts = RunOptions {
        ranks: processes,
        output: Some(out.clone()),
        grace: Duration::from_secs(10),
        json: false,
        progress: progress && node_rank == 0,
        nodes,
    };
    if !json && spec.is_command() {
        eprintln!(
            "shoal run: {} (`{}`) with {world} worker{} -> {}",
            spec.name,
            spec.train.command.join(" "),
            if world == 1 { "" } else { "s" },
            out.display()
        );
    } else if !json {
        let where_ =
            if hosts == 1 { String::new() } else { format!(" ({n} on this host, node {node_rank} of {hosts})") };
        let beside = match servers {
            0 => String::new(),
            1 => " and 1 parameter server".to_string(),
            s => format!(" and {s} parameter servers"),
        };
        eprintln!(
            "shoal run: {} ({} on {}, {}) with {world} worker{}{beside}{where_} -> {}",
            spec.name,
            format!("{:?}", spec.train.model.kind).to_lowercase(),
            spec.train.dataset,
            match &spec.federated {
                Some(f) => format!("{} rounds of {} clients", f.rounds, f.clients),
                None => format!("{} steps", spec.train.steps),
            },
            if world == 1 { "" } else { "s" },
            out.display()
        );
    }
    // One tensor thread per core share, unless the user chose: N workers each
    // running as many threads as there are cores would oversubscribe the machine.
    let mut env: Vec<(String, String)> = spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let threads = shoal_comm::env::var::RAYON_THREADS;
    if std::env::var_os(threads).is_none() && !spec.env.contains_key(threads) {
        let cpus = std::thread::available_parallelism().map(|c| c.get()).unwrap_or(1);
        env.push((threads.to_string(), (cpus / processes).max(1).to_string()));
    }
    if verbose {
        env.push((shoal_comm::env::var::VERBOSE.to_string(), "1".to_string()));
    }
    let code = run_ranks(&exe, &args, &env, &opts)?;
    if code != ExitCode::SUCCESS {
        return Ok(code);
    }
    if node_rank != 0 {
        // Rank 0, on node 0, writes the job's summary; this host reports its own ranks.
        let first = node_rank * n;
        let printed = if json {
            let doc = serde_json::json!({ "ok": true, "node_rank": node_rank, "ranks": (first..first + n).collect::<Vec<_>>() });
            writeln!(std::io::stdout().lock(), "{doc}")
        } else {
            writeln!(
                std::io::stdout().lock(),
                "node {node_rank}: ranks {first}..{} finished; the summary is node 0's",
                first + n - 1
            )
        };
        if let Err(e) = printed
            && e.kind() != std::io::ErrorKind::BrokenPipe
        {
            eprintln!("shoal run: writing the report: {e}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let path = out.join("summary.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let printed = if json {
        writeln!(std::io::stdout().lock(), "{}", text.trim())
    } else {
        let s: shoal_train::worker::Summary =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        print_summary(&mut std::io::stdout().lock(), &s, &out)
    };
    // A closed stdout (`| head`) loses only the report: the run succeeded, and its exit status says so.
    match printed {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => eprintln!("shoal run: writing the summary: {e}"),
        _ => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// The summary of a finished run, for people.
fn print_summary(w: &mut impl Write, s: &shoal_train::worker::Summary, out: &Path) -> std::io::Result<()> {
    if let Some(f) = &s.federated {
        writeln!(
            w,
            "{} finished: {} rounds of {} on {} worker(s) in {:.1} s",
            s.name,
            f.rounds.len(),
            f.algorithm,
            s.world_size,
            s.elapsed_s
        )?;
        writeln!(w, "  {} clients ({} partition), {} a round", f.clients, f.partition, f.clients_per_round)?;
        if let Some(a) = s.eval_accuracy {
            writeln!(w, "  eval accuracy {:.2}%, eval loss {:.4}", a * 100.0, s.eval_loss)?;
        }
        if let (Some(e), Some(d), Some(n)) = (f.epsilon, f.delta, f.noise_multiplier) {
            writeln!(w, "  differential privacy: ε {e:.3} at δ {d:e} (noise multiplier {n:.3})")?;
        }
        return writeln!(w, "  outputs in {}", out.display());
    }
    if !s.command.is_empty() {
        let last = s.final_loss.map_or_else(|| "-".to_string(), |l| format!("{l:.4}"));
        writeln!(
            w,
            "{} finished: `{}` on {} worker(s) in {:.1} s",
            s.name,
            s.command.join(" "),
            s.world_size,
            s.elapsed_s
        )?;
        writeln!(w, "  {} metrics lines; last step {}, loss {last}", s.metrics_lines, s.steps)?;
        if let Some(a) = s.eval_accuracy {
            writeln!(w, "  eval accuracy {:.2}%", a * 100.0)?;
        }
        return writeln!(w, "  outputs in {}", out.display());
    }
    writeln!(w, "{} finished: {} steps on {} worker(s) in {:.1} s", s.name, s.steps, s.world_size, s.elapsed_s)?;
    let final_loss = s.final_loss.map_or_else(|| "-".to_string(), |l| format!("{l:.4}"));
    writeln!(w, "  final loss {final_loss}, eval loss {:.4}", s.eval_loss)?;
    if let Some(a) = s.eval_accuracy {
        writeln!(w, "  eval accuracy {:.2}%", a * 100.0)?;
    }
    if let Some(p) = s.eval_perplexity {
        match s.baseline_loss {
            Some(b) => writeln!(
                w,
                "  eval perplexity {p:.2}; a unigram model of the training text: loss {b:.4}, perplexity {:.2}",
                b.exp()
            )?,
            None => writeln!(w, "  eval perplexity {p:.2}")?,
        }
    }
    writeln!(
        w,
        "  {:.0} samples/s; step medians: data {:.2} ms, compute {:.2} ms, comm {:.2} ms, optimizer {:.2} ms",
        s.samples_per_s,
        s.step_time.data_s * 1e3,
        s.step_time.compute_s * 1e3,
        s.step_time.comm_s * 1e3,
        s.step_time.optimizer_s * 1e3
    )?;
    writeln!(w, "  outputs in {}", out.display())
}

/// How `run_ranks` runs.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub ranks: usize,
    pub output: Option<PathBuf>,
    pub grace: Duration,
    pub json: bool,
    /// Show rank 0's `step N/M loss L ...` lines as a progress bar (on a terminal).
    pub progress: bool,
    /// This host's place among several (`--nnodes`); `None`: the whole job runs here.
    pub nodes: Option<Nodes>,
}

/// Parses a worker's progress line `step N/M loss L ...`.
fn parse_step(text: &str) -> Option<(u64, u64, String)> {
    let rest = text.trim_start().strip_prefix("step")?.trim_start();
    let (frac, tail) = rest.split_once(' ').unwrap_or((rest, ""));
    let (n, m) = frac.split_once('/')?;
    Some((n.trim().parse().ok()?, m.trim().parse().ok()?, tail.trim().to_string()))
}

/// Finds `name` the way `execvp` will (a name with a `/` is a path; otherwise
/// the first executable file of that name in `PATH`), so that a missing command
/// is reported before anything starts.
fn resolve_program(name: &str) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let is_exec = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if name.is_empty() {
        bail!("cannot start ``: empty command");
    }
    if name.contains('/') {
        let p = PathBuf::from(name);
        if !p.exists() {
            return Err(not_found(name, "no such file"));
        }
        if !is_exec(&p) {
            return Err(SpawnError {
                rank: 0,
                program: p,
                source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
            }
            .into());
        }
        return Ok(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    for dir in std::env::split_paths(&path) {
        let p = dir.join(name);
        if is_exec(&p) {
            return Ok(p);
        }
    }
    Err(not_found(name, "not in PATH"))
}

fn not_found(name: &str, why: &str) -> anyhow::Error {
    anyhow::Error::new(SpawnError {
        rank: 0,
        program: name.into(),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, why.to_string()),
    })
    .context(format!("command `{name}` not found ({why})"))
}

/// Opens `DIR/logs/rank-R.log` for every rank of `ranks`.
fn open_logs(dir: &Path, ranks: std::ops::Range<usize>) -> Result<Vec<LineWriter<File>>> {
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("--output: creating {}", logs.display()))?;
    ranks
        .map(|r| {
            let p = logs.join(format!("rank-{r}.log"));
            File::create(&p).map(LineWriter::new).with_context(|| format!("--output: creating {}", p.display()))
        })
        .collect()
}

/// Starts `opts.ranks` processes of `program args`, passes their output on, and
/// reports how they ended. Used by `-- CMD` and, later, by job files.
pub fn run_ranks(program: &Path, args: &[String], env: &[(String, String)], opts: &RunOptions) -> Result<ExitCode> {
    let first = opts.nodes.as_ref().map_or(0, |n| n.rank * opts.ranks);
    let mut logs = match &opts.output {
        Some(dir) => open_logs(dir, first..first + opts.ranks)?,
        None => Vec::new(),
    };
    // The job's name must be the same on every host.
    let job_id = opts.nodes.as_ref().map_or_else(|| format!("run-{}", std::process::id()), |n| n.job_id("run"));
    let spec = LaunchSpec {
        program: program.to_path_buf(),
        args: args.to_vec(),
        ranks: opts.ranks,
        job_id,
        env: env.to_vec(),
        grace: opts.grace,
        nodes: opts.nodes.clone(),
    };
    let policy = Policy { on_failure: OnFailure::Terminate, interrupt_grace: opts.grace };
    let started = Instant::now();
    let mut log_error: Option<String> = None;
    let bar = opts.progress.then(|| {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta}]")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let outcome = launch_with(&spec, policy, |line| {
        if let (Some(b), 0, true) = (&bar, line.rank, line.stderr)
            && let Some((n, m, msg)) = parse_step(&line.text)
        {
            if let Some(log) = logs.get_mut(0) {
                let _ = writeln!(log, "{}", line.text);
            }
            b.set_length(m);
            b.set_position(n);
            b.set_message(msg);
            return;
        }
        // Write errors (a closed pipe, a full disk) must not stop supervision.
        if let Some(log) = logs.get_mut(line.rank - first)
            && let Err(e) = writeln!(log, "{}", line.text)
            && log_error.is_none()
        {
            log_error = Some(format!("writing the log of rank {}: {e}", line.rank));
        }
        let print = || {
            if line.stderr || opts.json {
                let _ = writeln!(std::io::stderr().lock(), "[rank {}] {}", line.rank, line.text);
            } else {
                let _ = writeln!(std::io::stdout().lock(), "[rank {}] {}", line.rank, line.text);
            }
        };
        match &bar {
            // Lines go above the bar, not through it.
            Some(b) => b.suspend(print),
            None => print(),
        }
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let elapsed = started.elapsed();
    for log in &mut logs {
        let _ = log.flush();
    }
    if let Some(e) = log_error {
        eprintln!("shoal run: warning: {e}");
    }

    let failure = outcome.first_failure.as_ref().map(|(rank, _)| (*rank, outcome.statuses[*rank - first]));
    let code: u8 = if outcome.interrupted {
        let sig = outcome.interrupt_signal.unwrap_or(libc::SIGINT);
        eprintln!(
            "shoal run: interrupted ({}); stopped {} rank{}",
            signal_name(sig).unwrap_or("signal"),
            opts.ranks,
            if opts.ranks == 1 { "" } else { "s" }
        );
        (128 + sig).clamp(0, 255) as u8
    } else if let Some((rank, status)) = failure {
        let (how, code) = match status.map(|s| (s.code(), s.signal())) {
            Some((Some(c), _)) => (format!("exited with status {c}"), c),
            Some((None, Some(s))) => (
                format!("killed by signal {s}{}", signal_name(s).map(|n| format!(" ({n})")).unwrap_or_default()),
                128 + s,
            ),
            _ => ("failed".to_string(), 1),
        };
        eprintln!("shoal run: rank {rank} {how}");
        let others: Vec<String> = outcome
            .statuses
            .iter()
            .enumerate()
            .map(|(r, s)| (r + first, s))
            .filter(|(r, _)| *r != rank)
            .map(|(r, s)| format!("rank {r}: {}", s.map(|s| describe(&s)).unwrap_or_else(|| "still running".into())))
            .collect();
        if !others.is_empty() {
            eprintln!("shoal run: the other ranks were stopped ({})", others.join(", "));
        }
        // An exit code of 0 cannot report a failure; codes are 8 bits.
        if (1..=255).contains(&code) { code as u8 } else { 1 }
    } else if let Some(why) = &outcome.peer_failure {
        eprintln!("shoal run: {why}; stopped the {} rank(s) on this host", opts.ranks);
        1
    } else {
        0
    };

    if opts.json {
        let statuses: Vec<serde_json::Value> = outcome
            .statuses
            .iter()
            .enumerate()
            .map(|(r, s)| {
                serde_json::json!({
                    "rank": r + first,
                    "exit_code": s.and_then(|s| s.code()),
                    "signal": s.and_then(|s| s.signal()),
                })
            })
            .collect();
        let first_failure = outcome
            .first_failure
            .as_ref()
            .map(|(rank, how)| serde_json::json!({ "rank": rank, "status": how }))
            .unwrap_or(serde_json::Value::Null);
        let doc = serde_json::json!({
            "ranks": opts.ranks,
            "ok": code == 0,
            "interrupted": outcome.interrupted,
            "statuses": statuses,
            "first_failure": first_failure,
            "elapsed_s": elapsed.as_secs_f64(),
        });
        let mut doc = doc;
        if let Some(n) = &opts.nodes {
            doc["nnodes"] = n.count.into();
            doc["node_rank"] = n.rank.into();
            doc["world_size"] = (n.count * opts.ranks).into();
            doc["peer_failure"] = outcome.peer_failure.clone().into();
        }
        let _ = writeln!(std::io::stdout().lock(), "{doc}");
    }
    Ok(ExitCode::from(code))
}

#[cfg(test)]
mod tests {
    #[test]
    fn progress_lines_parse() {
        assert_eq!(super::parse_step("step     12/600 loss 0.5 lr 1e-3"), Some((12, 600, "loss 0.5 lr 1e-3".into())));
        assert_eq!(super::parse_step("eval at step 3: loss 1"), None);
        assert_eq!(super::parse_step("step x/y"), None);
    }
}
