//! `cargo xtask bench-ddp`: data-parallel training throughput of the MLP
//! 784-1024-1024-10 (batch 256 per rank, SGD momentum 0.9, synthetic data), ours
//! (`shoal run` on a job derived from `examples/mlp_synthetic.toml`) side by side with
//! PyTorch (one process, and DDP over Gloo), alternating configurations round by round.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::bench::{median, shoal_binary};
use crate::idle::wait_idle;
use crate::util::{peer_scripts_dir, peers_dir, run_group, tail, timestamp, venv_python, workspace_root};

/// Samples per rank and step: the workload.
const BATCH_PER_RANK: usize = 256;
/// Longest idle wait before each configuration (the full `--idle-wait-s` is per round).
const BETWEEN_CONFIGS_IDLE_S: u64 = 10;

#[derive(Debug, clap::Args)]
pub struct DdpArgs {
    /// Measurement rounds; the configurations alternate within each round.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Timed training steps per run.
    #[arg(long, default_value_t = 60)]
    pub steps: usize,
    /// Untimed warm-up steps before them (ours runs warmup + steps and drops the first ones).
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// One JSON object per table row and per ratio instead of the tables.
    #[arg(long)]
    pub json: bool,
    /// Sides to leave out, comma-separated: ours, torch.
    #[arg(long, value_delimiter = ',')]
    pub skip: Vec<String>,
    /// Path of the shoal binary (default: target/release/shoal).
    #[arg(long)]
    pub shoal: Option<PathBuf>,
    /// The job file the benchmark job is derived from.
    #[arg(long, default_value = "examples/mlp_synthetic.toml")]
    pub job: PathBuf,
    /// Give up on one run after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// Longest wait for an idle machine (≥ 90 % idle over 1 s) before each round, seconds;
    /// before each configuration the wait is at most 10 s.
    #[arg(long, default_value_t = 60)]
    pub idle_wait_s: u64,
    /// Keep our runs' output directories (metrics, logs, checkpoints) under bench-results/.
    #[arg(long)]
    pub keep_runs: bool,
}

/// One measured configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Config {
    Ours1x1,
    Ours2x1,
    Torch1x1,
    Torch1x2,
    TorchDdp2x1,
}

impl Config {
    pub const ALL: [Config; 5] =
        [Config::Ours1x1, Config::Ours2x1, Config::Torch1x1, Config::Torch1x2, Config::TorchDdp2x1];

    pub fn name(self) -> &'static str {
        match self {
            Config::Ours1x1 => "ours 1 worker x 1 thread",
            Config::Ours2x1 => "ours 2 workers x 1 thread",
            Config::Torch1x1 => "torch 1 process x 1 thread",
            Config::Torch1x2 => "torch 1 process x 2 threads",
            Config::TorchDdp2x1 => "torch DDP gloo 2 procs x 1 thread",
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            Config::Ours1x1 => "ours_1x1",
            Config::Ours2x1 => "ours_2x1",
            Config::Torch1x1 => "torch_1x1",
            Config::Torch1x2 => "torch_1x2threads",
            Config::TorchDdp2x1 => "torch_ddp_2x1",
        }
    }

    fn is_ours(self) -> bool {
        matches!(self, Config::Ours1x1 | Config::Ours2x1)
    }

    /// (processes, threads per process)
    fn shape(self) -> (usize, usize) {
        match self {
            Config::Ours1x1 | Config::Torch1x1 => (1, 1),
            Config::Torch1x2 => (1, 2),
            Config::Ours2x1 | Config::TorchDdp2x1 => (2, 1),
        }
    }
}

/// What one run of one configuration gave.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Measure {
    /// Samples over the timed steps / their total time (warm-up excluded).
    pub samples_per_s: f64,
    /// world · batch / median step time.
    pub samples_per_s_median: f64,
    pub median_step_s: f64,
    /// Ours only: the summary's own figure (the whole training loop, warm-up included).
    pub summary_samples_per_s: Option<f64>,
    /// Ours only: medians over the timed steps of rank 0's step split, seconds.
    pub split: Option<Split>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Split {
    pub data_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub optimizer_s: f64,
}

/// Rewrites a job file line by line: in each `[section]`, a `key = …` line named in
/// `set` gets the new value; keys not present are appended at the end of their section
/// (sections not present are appended at the end). Comments on replaced lines are dropped.
/// Enough for the flat job files of `examples/` without a TOML dependency in the xtask.
pub fn rewrite_job(text: &str, set: &[(&str, &str, String)]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut section = String::new();
    let mut done = vec![false; set.len()];
    let flush_missing = |section: &str, out: &mut Vec<String>, done: &mut Vec<bool>| {
        // insert before trailing blank lines of the section
        let mut at = out.len();
        while at > 0 && out[at - 1].trim().is_empty() {
            at -= 1;
        }
        for (i, (s, k, v)) in set.iter().enumerate() {
            if !done[i] && *s == section {
                out.insert(at, format!("{k} = {v}"));
                at += 1;
                done[i] = true;
            }
        }
    };
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('[') && !t.starts_with("[[") {
            flush_missing(&section, &mut out, &mut done);
            section = t.trim_start_matches('[').split(']').next().unwrap_or("").trim().to_owned();
            out.push(line.to_owned());
            continue;
        }
        let key = t.split('=').next().unwrap_or("").trim();
        if !t.starts_with('#')
            && t.contains('=')
            && let Some(i) = set.iter().position(|(s, k, _)| *s == section && *k == key)
        {
            out.push(format!("{key} = {}", set[i].2));
            done[i] = true;
            continue;
        }
        out.push(line.to_owned());
    }
    flush_missing(&section, &mut out, &mut done);
    let mut missing_sections: Vec<&str> = Vec::new();
    for (i, (s, _, _)) in set.iter().enumerate() {
        if !done[i] && !missing_sections.contains(s) {
            missing_sections.push(s);
        }
    }
    for s in missing_sections {
        out.push(String::new());
        out.push(format!("[{s}]"));
        for (i, (s2, k, v)) in set.iter().enumerate() {
            if *s2 == s && !done[i] {
                out.push(format!("{k} = {v}"));
            }
        }
    }
    out.join("\n") + "\n"
}

/// The benchmark job for `ranks` workers: the example job with 256 samples per rank,
/// `steps` steps, no progress lines (except the last step's), no evaluation and no checkpoint
/// before the end.
pub fn bench_job(example: &str, ranks: usize, steps: usize) -> String {
    rewrite_job(
        example,
        &[
            ("", "name", format!("\"bench-ddp-{ranks}\"")),
            ("train", "global_batch", (BATCH_PER_RANK * ranks).to_string()),
            ("train", "steps", steps.to_string()),
            ("train", "log_every", "1000000".into()), // must be positive; metrics.jsonl still gets every step
            ("train", "eval_every", "0".into()),
            ("checkpoint", "every", "0".into()),
            ("checkpoint", "keep", "1".into()),
        ],
    )
}

/// Our numbers from a run's `metrics.jsonl` (rank 0, one line per step) and summary:
/// steps after the first `warmup` are the timed ones.
pub fn ours_measure(metrics: &str, summary: &Value, warmup: usize) -> Result<Measure> {
    let mut steps: Vec<Value> = Vec::new();
    for line in metrics.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).context("a metrics.jsonl line is not JSON")?;
        if v.get("step").and_then(Value::as_u64).is_some_and(|s| s as usize > warmup) {
            steps.push(v);
        }
    }
    anyhow::ensure!(!steps.is_empty(), "metrics.jsonl has no step after the {warmup} warm-up steps");
    let col =
        |k: &str| -> Vec<f64> { steps.iter().map(|v| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN)).collect() };
    let step_s = col("step_s");
    let samples = col("samples");
    let total_t: f64 = step_s.iter().sum();
    let total_n: f64 = samples.iter().sum();
    let med_step = median(&mut step_s.clone()).context("no step times")?;
    let med_samples = median(&mut samples.clone()).unwrap_or(f64::NAN);
    let m = |k: &str| median(&mut col(k)).unwrap_or(f64::NAN);
    Ok(Measure {
        samples_per_s: total_n / total_t,
        samples_per_s_median: med_samples / med_step,
        median_step_s: med_step,
        summary_samples_per_s: summary.get("samples_per_s").and_then(Value::as_f64),
        split: Some(Split {
            data_s: m("data_s"),
            compute_s: m("compute_s"),
            comm_s: m("comm_s"),
            optimizer_s: m("optimizer_s"),
        }),
    })
}

/// The peer's JSON line.
pub fn torch_measure(stdout: &str) -> Option<Measure> {
    let v: Value = stdout.lines().rev().find_map(|l| {
        let l = l.trim();
        l.starts_with('{').then(|| serde_json::from_str(l).ok()).flatten()
    })?;
    let f = |k: &str| v.get(k).and_then(Value::as_f64);
    Some(Measure {
        samples_per_s: f("samples_per_s")?,
        samples_per_s_median: f("samples_per_s_median").unwrap_or(f64::NAN),
        median_step_s: f("median_step_s").unwrap_or(f64::NAN),
        summary_samples_per_s: None,
        split: None,
    })
}

struct Ctx {
    args: DdpArgs,
    shoal: Option<PathBuf>,
    py: PathBuf,
    jobs: BTreeMap<usize, PathBuf>,
    runs: PathBuf,
    raw: std::fs::File,
    failures: BTreeMap<Config, u32>,
    disabled: Vec<Config>,
    idle_misses: usize,
}

impl Ctx {
    fn record(&mut self, v: Value) -> Result<()> {
        writeln!(self.raw, "{v}").context("writing raw results")
    }

    fn idle(&mut self, what: &str, max_s: u64) -> Result<()> {
        let w = wait_idle(0.9, Duration::from_secs(max_s));
        if !w.reached {
            self.idle_misses += 1;
            eprintln!(
                "  ! machine never got to 90% idle within {max_s} s before {what} (last second: {:.0}% idle); measuring anyway",
                w.idle * 100.0
            );
        }
        self.record(
            json!({"kind": "idle", "before": what, "reached": w.reached, "idle": w.idle, "waited_s": w.waited_s}),
        )
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn thread_env(cmd: &mut Command, threads: usize) {
    use shoal_comm::env::var;
    for k in [var::OMP_THREADS, "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", var::RAYON_THREADS] {
        cmd.env(k, threads.to_string());
    }
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("      {l}")).collect::<Vec<_>>().join("\n")
}

/// Runs one configuration once.
fn run_config(cx: &mut Ctx, c: Config, round: usize) -> Result<Option<Measure>> {
    let (procs, threads) = c.shape();
    let timeout = Duration::from_secs(cx.args.timeout_s);
    let total_steps = cx.args.warmup + cx.args.steps;
    let mut cmds = Vec::new();
    let mut out_dir = None;
    if c.is_ours() {
        let shoal = cx.shoal.clone().context("no shoal binary")?;
        let dir = cx.runs.join(format!("{}-r{round}", c.key()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        let job = cx.jobs.get(&procs).context("no job file")?.clone();
        let mut cmd = Command::new(shoal);
        cmd.args(["run", "-n", &procs.to_string(), "--json", "--output"]).arg(&dir).arg(job);
        thread_env(&mut cmd, threads);
        cmds.push(cmd);
        out_dir = Some(dir);
    } else {
        let script = peer_scripts_dir().join("ddp_mlp.py");
        let port = free_port()?.to_string();
        for r in 0..procs {
            let mut cmd = Command::new(&cx.py);
            cmd.arg(&script).args([
                "--threads",
                &threads.to_string(),
                "--batch",
                &BATCH_PER_RANK.to_string(),
                "--steps",
                &cx.args.steps.to_string(),
                "--warmup",
                &cx.args.warmup.to_string(),
            ]);
            if procs > 1 {
                // torchrun's names, as the contract defines them.
                use shoal_comm::env::var;
                cmd.env(var::TORCH_RANK, r.to_string())
                    .env(var::TORCH_LOCAL_RANK, r.to_string())
                    .env(var::TORCH_WORLD_SIZE, procs.to_string())
                    .env(var::MASTER_ADDR, "127.0.0.1")
                    .env(var::MASTER_PORT, &port)
                    .env("GLOO_SOCKET_IFNAME", "lo");
            }
            thread_env(&mut cmd, threads);
            cmds.push(cmd);
        }
    }
    let done = run_group(cmds, timeout)?;
    let failed: Vec<_> = done.iter().enumerate().filter(|(_, f)| !f.ok).collect();
    for (i, f) in &failed {
        let why = if f.timed_out { format!("timed out after {} s", cx.args.timeout_s) } else { f.status.clone() };
        let err = if f.stderr.trim().is_empty() { "(nothing on stderr)".to_owned() } else { tail(&f.stderr, 15) };
        eprintln!("  ! {} (process {i}) failed: {why}\n{}", c.name(), indent(&err));
    }
    // A peer whose result line is out and that then fails on the way out (Gloo teardown)
    // still counts; a timeout or a failure of ours never does.
    let late_failure_only = out_dir.is_none() && done.iter().all(|f| !f.timed_out);
    let measure = if !failed.is_empty() && !late_failure_only {
        None
    } else if let Some(dir) = &out_dir {
        let summary: Value = serde_json::from_str(done[0].stdout.trim())
            .or_else(|_| {
                std::fs::read_to_string(dir.join("summary.json"))
                    .map_err(anyhow::Error::from)
                    .and_then(|s| Ok(serde_json::from_str(&s)?))
            })
            .unwrap_or(Value::Null);
        let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
        match ours_measure(&metrics, &summary, cx.args.warmup) {
            Ok(m) => {
                let steps = summary.get("steps").and_then(Value::as_u64);
                if steps.is_some_and(|s| s as usize != total_steps) {
                    eprintln!("  ! {}: summary says {steps:?} steps, expected {total_steps}", c.name());
                }
                cx.record(json!({"kind": "raw", "config": c.key(), "round": round, "summary": summary}))?;
                Some(m)
            }
            Err(e) => {
                eprintln!("  ! {}: {e:#}\n{}", c.name(), indent(&tail(&done[0].stderr, 15)));
                None
            }
        }
    } else {
        let m = torch_measure(&done[0].stdout);
        if m.is_some() && !failed.is_empty() {
            eprintln!("    (the result line was printed before the failure; it is used)");
        }
        if m.is_none() && failed.is_empty() {
            eprintln!(
                "  ! {}: no result line on stdout\n{}",
                c.name(),
                indent(&tail(&format!("{}{}", done[0].stdout, done[0].stderr), 15))
            );
        }
        for line in done[0].stdout.lines().filter(|l| l.trim_start().starts_with('{')) {
            if let Ok(v) = serde_json::from_str::<Value>(line) {
                cx.record(json!({"kind": "raw", "config": c.key(), "round": round, "row": v}))?;
            }
        }
        m
    };
    if let Some(dir) = out_dir
        && !cx.args.keep_runs
    {
        let _ = std::fs::remove_dir_all(dir);
    }
    let f = cx.failures.entry(c).or_insert(0);
    if measure.is_some() {
        *f = 0;
    } else {
        *f += 1;
        if *f >= 2 && !cx.disabled.contains(&c) {
            cx.disabled.push(c);
            eprintln!("  ! {} failed twice in a row; leaving it out from now on", c.name());
        }
    }
    Ok(measure)
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a.is_finite() => Some(a / b),
        _ => None,
    }
}

fn fmt_opt(x: Option<f64>, prec: usize) -> String {
    x.map(|v| format!("{v:.prec$}")).unwrap_or_else(|| "-".into())
}

/// The targets: (label, key, numerator, denominator, at least).
pub const TARGETS: [(&str, &str, Config, Config, f64); 4] = [
    ("ours 1x1 / torch 1x1", "ours1x1_over_torch1x1", Config::Ours1x1, Config::Torch1x1, 1.0),
    ("ours 2x1 / torch DDP 2x1", "ours2x1_over_torch_ddp2x1", Config::Ours2x1, Config::TorchDdp2x1, 1.0),
    ("ours 2x1 / torch 1x2 threads", "ours2x1_over_torch1x2threads", Config::Ours2x1, Config::Torch1x2, 0.9),
    ("ours scaling 2x1 / 1x1", "ours_scaling_2x1_over_1x1", Config::Ours2x1, Config::Ours1x1, 1.8),
];

pub fn bench_ddp(args: DdpArgs) -> Result<()> {
    anyhow::ensure!(args.rounds >= 1, "--rounds must be ≥ 1");
    anyhow::ensure!(args.steps >= 1, "--steps must be ≥ 1");
    for s in &args.skip {
        anyhow::ensure!(["ours", "torch"].contains(&s.as_str()), "unknown side {s:?} in --skip (ours, torch)");
    }
    let skip = |n: &str| args.skip.iter().any(|s| s == n);
    let mut configs: Vec<Config> = Vec::new();
    let shoal = if skip("ours") { None } else { shoal_binary(args.shoal.as_deref()) };
    if skip("ours") {
        eprintln!("ours: skipped (--skip)");
    } else if let Some(p) = &shoal {
        anyhow::ensure!(p.is_file(), "{} does not exist", p.display());
        eprintln!("ours: {}", p.display());
        configs.extend([Config::Ours1x1, Config::Ours2x1]);
    } else {
        eprintln!(
            "ours: target/release/shoal not found — run `cargo build --release -p shoal` first; measuring torch only"
        );
    }
    let peers = peers_dir();
    let py = venv_python(&peers);
    let mut torch_version = None;
    if !skip("torch") {
        match crate::setup::probe(&py).torch {
            Some(v) => {
                eprintln!("torch: {v} in {}", peers.display());
                configs.extend([Config::Torch1x1, Config::Torch1x2, Config::TorchDdp2x1]);
                torch_version = Some(v);
            }
            None => eprintln!("torch: not installed in {} — run `cargo xtask setup-peers`; skipping", peers.display()),
        }
    }
    if configs.is_empty() {
        bail!("nothing to measure: neither ours nor torch is available");
    }

    let root = workspace_root();
    let dir = root.join("bench-results");
    std::fs::create_dir_all(&dir)?;
    let stamp = timestamp();
    let runs = dir.join(format!("ddp-{stamp}-runs"));
    std::fs::create_dir_all(&runs)?;
    let mut jobs = BTreeMap::new();
    if shoal.is_some() {
        let job_path = if args.job.is_absolute() { args.job.clone() } else { root.join(&args.job) };
        let example =
            std::fs::read_to_string(&job_path).with_context(|| format!("reading the job {}", job_path.display()))?;
        for n in [1usize, 2] {
            let p = runs.join(format!("job-{n}.toml"));
            std::fs::write(&p, bench_job(&example, n, args.warmup + args.steps))?;
            jobs.insert(n, p);
        }
    }
    let raw_path = dir.join(format!("ddp-{stamp}.jsonl"));
    let raw = std::fs::File::create(&raw_path).with_context(|| format!("creating {}", raw_path.display()))?;
    let mut cx = Ctx {
        shoal,
        py,
        jobs,
        runs: runs.clone(),
        raw,
        failures: BTreeMap::new(),
        disabled: Vec::new(),
        idle_misses: 0,
        args,
    };
    let meta = json!({
        "kind": "meta", "stamp": stamp, "rounds": cx.args.rounds, "steps": cx.args.steps, "warmup": cx.args.warmup,
        "batch_per_rank": BATCH_PER_RANK, "configs": configs.iter().map(|c| c.key()).collect::<Vec<_>>(),
        "shoal": cx.shoal.as_ref().map(|p| p.display().to_string()), "torch": torch_version,
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
    });
    cx.record(meta)?;

    let mut res: BTreeMap<Config, Vec<Measure>> = BTreeMap::new();
    let rounds = cx.args.rounds;
    // The bare loop beside `shoal run -n 1`: the platform's overhead on a step.
    let bare = if cx.shoal.is_some() { bare_loop_binary() } else { None };
    let mut bare_ms: Vec<f64> = Vec::new();
    for round in 0..rounds {
        eprintln!("== round {}/{rounds}", round + 1);
        cx.idle(&format!("round {}", round + 1), cx.args.idle_wait_s)?;
        let mut order = configs.clone();
        let k = round % order.len();
        order.rotate_left(k); // alternate who goes first
        for c in order {
            if cx.disabled.contains(&c) {
                continue;
            }
            cx.idle(c.name(), cx.args.idle_wait_s.min(BETWEEN_CONFIGS_IDLE_S))?;
            let Some(m) = run_config(&mut cx, c, round)? else { continue };
            let split = m
                .split
                .map(|s| {
                    format!(
                        "; step split ms: data {:.2} compute {:.2} comm {:.2} optimizer {:.2}",
                        s.data_s * 1e3,
                        s.compute_s * 1e3,
                        s.comm_s * 1e3,
                        s.optimizer_s * 1e3
                    )
                })
                .unwrap_or_default();
            eprintln!(
                "  {:<34} {:>8.0} samples/s (median step {:.1} ms){split}",
                c.name(),
                m.samples_per_s,
                m.median_step_s * 1e3
            );
            cx.record(json!({"kind": "measure", "config": c.key(), "round": round, "measure": m}))?;
            res.entry(c).or_default().push(m);
        }
        if let Some(b) = &bare {
            cx.idle("bare loop", cx.args.idle_wait_s.min(BETWEEN_CONFIGS_IDLE_S))?;
            match run_bare_loop(b, cx.args.warmup + cx.args.steps) {
                Ok(v) => {
                    let hand = v["hand"]["step_ms_median"].as_f64();
                    eprintln!(
                        "  {:<34} median step {} ms (candle autograd: {} ms)",
                        "bare loop, 1 thread",
                        fmt_opt(hand, 2),
                        fmt_opt(v["autograd"]["step_ms_median"].as_f64(), 2)
                    );
                    cx.record(json!({"kind": "bare_loop", "round": round, "result": v}))?;
                    bare_ms.extend(hand);
                }
                Err(e) => eprintln!("  bare loop failed: {e:#}"),
            }
        }
    }

    // Summaries: medians over rounds.
    let med_of = |c: Config, f: &dyn Fn(&Measure) -> Option<f64>| -> Option<f64> {
        res.get(&c).and_then(|ms| median(&mut ms.iter().filter_map(f).collect::<Vec<_>>()))
    };
    let sps = |c: Config| med_of(c, &|m| Some(m.samples_per_s));
    let mut text = String::new();
    let mut rows: Vec<Value> = Vec::new();
    let _ = writeln!(
        text,
        "MLP 784-1024-1024-10, {BATCH_PER_RANK} samples per rank, SGD momentum 0.9, synthetic data; \
         {} timed steps after {} warm-up; medians of {rounds} round(s)",
        cx.args.steps, cx.args.warmup
    );
    let _ = writeln!(
        text,
        "  {:<34} {:>10} {:>12} {:>10} {:>12}  step split ms: data / compute / comm / opt",
        "config", "samples/s", "median-step", "step ms", "summary s/s"
    );
    for c in Config::ALL {
        if !configs.contains(&c) {
            continue;
        }
        let n = res.get(&c).map_or(0, Vec::len);
        let s = sps(c);
        let sm = med_of(c, &|m| Some(m.samples_per_s_median));
        let st = med_of(c, &|m| Some(m.median_step_s));
        let ss = med_of(c, &|m| m.summary_samples_per_s);
        let sp = |f: fn(&Split) -> f64| med_of(c, &|m| m.split.as_ref().map(f));
        let (d, co, cm, o) = (sp(|s| s.data_s), sp(|s| s.compute_s), sp(|s| s.comm_s), sp(|s| s.optimizer_s));
        let split = if c.is_ours() {
            let ms = |x: Option<f64>| fmt_opt(x.map(|v| v * 1e3), 2);
            format!("{} / {} / {} / {}", ms(d), ms(co), ms(cm), ms(o))
        } else {
            String::new()
        };
        let _ = writeln!(
            text,
            "  {:<34} {:>10} {:>12} {:>10} {:>12}  {split}{}",
            c.name(),
            fmt_opt(s, 0),
            fmt_opt(sm, 0),
            fmt_opt(st.map(|v| v * 1e3), 2),
            fmt_opt(ss, 0),
            if n < rounds { format!("  ({n}/{rounds} rounds)") } else { String::new() }
        );
        rows.push(json!({
            "kind": "row", "config": c.key(), "name": c.name(), "procs": c.shape().0, "threads": c.shape().1,
            "samples_per_s": s, "samples_per_s_median_step": sm, "median_step_s": st,
            "summary_samples_per_s": ss,
            "step_split_s": if c.is_ours() { json!({"data": d, "compute": co, "comm": cm, "optimizer": o}) } else { Value::Null },
            "rounds": n,
        }));
    }
    let _ = writeln!(text, "\ntargets (ratios of the samples/s medians above)");
    for (label, key, a, b, want) in TARGETS {
        let r = ratio(sps(a), sps(b));
        let verdict = match r {
            Some(r) if r >= want => "ok",
            Some(_) => "BELOW",
            None => "-",
        };
        let _ = writeln!(text, "  {label:<30} {:>6}   target ≥ {want:.1}  {verdict}", fmt_opt(r, 2));
        rows.push(json!({"kind": "ratio", "ratio": key, "value": r, "target": want, "met": r.map(|r| r >= want)}));
    }
    let ours_step_ms = med_of(Config::Ours1x1, &|m| Some(m.median_step_s)).map(|s| s * 1e3);
    let bare_med = median(&mut bare_ms);
    let overhead = match (ours_step_ms, bare_med) {
        (Some(o), Some(b)) if b > 0.0 => Some(o / b - 1.0),
        _ => None,
    };
    let verdict = match overhead {
        Some(o) if o <= 0.05 => "ok",
        Some(_) => "ABOVE",
        None => "-",
    };
    let _ = writeln!(
        text,
        "  overhead 1-worker run / bare   {:>6}   target ≤ 5%   {verdict}  (median step {} ms vs bare loop {} ms)",
        overhead.map_or("-".to_string(), |o| format!("{:+.1}%", o * 100.0)),
        fmt_opt(ours_step_ms, 2),
        fmt_opt(bare_med, 2)
    );
    rows.push(json!({"kind": "overhead", "value": overhead, "ours_step_ms": ours_step_ms, "bare_step_ms": bare_med,
        "target": 0.05, "met": overhead.map(|o| o <= 0.05)}));
    let _ = writeln!(
        text,
        "\nsamples/s = samples / time of the timed steps; median-step = samples per step / median step time;\n\
         summary s/s = our summary.json samples_per_s (whole training loop, warm-up included).\n\
         Compare ratios within this run only (2-core machine)."
    );
    if cx.idle_misses > 0 {
        let _ = writeln!(
            text,
            "WARNING: the machine was not idle before {} of the waits (see the idle lines in the .jsonl): figures are unreliable.",
            cx.idle_misses
        );
    }
    crate::util::finish_report(&mut cx.raw, &dir.join(format!("ddp-{stamp}.txt")), &text, &rows, cx.args.json)?;
    if !cx.args.keep_runs {
        let _ = std::fs::remove_dir_all(&runs);
    }
    eprintln!("raw results: {}", raw_path.display());
    Ok(())
}

/// `target/release/examples/bare_loop`, (re)built first so it matches the source
/// being measured (a no-op when fresh; the xtask itself does not link candle).
fn bare_loop_binary() -> Option<PathBuf> {
    let root = workspace_root();
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let path = target.join("release/examples/bare_loop");
    let built = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "-q", "-p", "shoal-train", "--example", "bare_loop"])
        .current_dir(&root)
        .status();
    if !built.is_ok_and(|s| s.success()) {
        eprintln!(
            "bare loop: `cargo build --release -p shoal-train --example bare_loop` failed; the overhead line stays empty"
        );
        return None;
    }
    path.is_file().then_some(path)
}

/// Runs the bare loop on one thread; its JSON line.
fn run_bare_loop(bin: &std::path::Path, steps: usize) -> Result<Value> {
    let mut cmd = Command::new(bin);
    cmd.args([steps.to_string(), BATCH_PER_RANK.to_string()]);
    thread_env(&mut cmd, 1);
    let out = cmd.output().with_context(|| format!("running {}", bin.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} failed: {}",
        bin.display(),
        tail(&String::from_utf8_lossy(&out.stderr), 20)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("bare loop printed {line:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "# comment\nname = \"mlp-synthetic\"\n\n[train]\ndataset = \"synthetic\"\nglobal_batch = 512       # 256 per rank\nsteps = 200\nlog_every = 10\n\n[train.model]\nkind = \"mlp\"\n\n[checkpoint]\nkeep = 1                 # only the final checkpoint\n";

    #[test]
    fn rewrites_the_example_job() {
        let j = bench_job(EXAMPLE, 2, 65);
        assert!(j.contains("name = \"bench-ddp-2\"\n"), "{j}");
        assert!(j.contains("[train]\ndataset = \"synthetic\"\nglobal_batch = 512\nsteps = 65\nlog_every = 1000000\neval_every = 0\n\n[train.model]"), "{j}");
        assert!(j.contains("[checkpoint]\nkeep = 1\nevery = 0\n"), "{j}");
        assert!(j.contains("# comment\n"));
        assert!(bench_job(EXAMPLE, 1, 10).contains("global_batch = 256\n"));
        let k = rewrite_job("a = 1\n", &[("x", "y", "2".into())]);
        assert_eq!(k, "a = 1\n\n[x]\ny = 2\n");
    }

    #[test]
    fn ours_from_metrics() {
        let metrics = (1..=4)
            .map(|s| {
                format!(
                    "{{\"step\":{s},\"samples\":512,\"data_s\":0.001,\"compute_s\":0.05,\"comm_s\":0.01,\"optimizer_s\":0.002,\"step_s\":{}}}\n",
                    if s == 1 { 1.0 } else { 0.1 * s as f64 }
                )
            })
            .collect::<String>();
        let m = ours_measure(&metrics, &json!({"samples_per_s": 1000.0}), 1).expect("measure");
        assert!((m.samples_per_s - 3.0 * 512.0 / 0.9).abs() < 1e-6);
        assert!((m.median_step_s - 0.3).abs() < 1e-12);
        assert_eq!(m.summary_samples_per_s, Some(1000.0));
        assert!((m.split.expect("split").comm_s - 0.01).abs() < 1e-12);
        assert!(ours_measure(&metrics, &Value::Null, 4).is_err());
    }

    #[test]
    fn torch_line() {
        let out = "noise\n{\"peer\": \"torch\", \"samples_per_s\": 8600.0, \"samples_per_s_median\": 8700.0, \"median_step_s\": 0.0294}\n";
        let m = torch_measure(out).expect("line");
        assert_eq!(m.samples_per_s, 8600.0);
        assert!(torch_measure("nothing").is_none());
    }
}
