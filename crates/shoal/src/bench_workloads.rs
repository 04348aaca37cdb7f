//! `shoal bench recommender` and `shoal bench a3c`: the parameter servers' workloads, with servers and workers as
//! separate processes started like `shoal bench ps`'s.
//!
//! **recommender**: `--ranks` workers (default 2) train the DLRM-like recommender of `shoal-workloads` on planted
//! clicks through `--servers` servers (default 2) in `--mode` (default async), `--steps` steps each (default 6000)
//! with a user table of `--users` rows (default 1M). Reported: the held-out AUC and the planted model's, the bytes
//! a worker pushed per step against the embedding rows its batches touched (and against a dense push of the whole
//! model), samples per second. `--json`: one object `users items servers workers mode steps batch seconds
//! samples_per_s auc planted_auc auc_gap push_bytes_per_step touched_bytes_per_step top_bytes_per_step
//! rows_ratio dense_ratio loss_first loss_last`.
//!
//! **a3c**: for each number of actors in `--actors` (default `1,4`), `--repeats` runs (default 3) of A3C on
//! CartPole against `--servers` servers (default 1 here), each until solved (mean reward ≥ 195 over the last 100
//! episodes of all actors, in the order they finished) or `--seconds` pass. Every actor prints each finished
//! episode; this process keeps the window and, once solved, tells the actors to stop (a file they look for). The
//! clock starts when every actor is ready. Reported per number of actors: the median seconds to solve, episodes
//! and updates; and the first's median over each other's. `--json`: `{"runs": [{actors, repeat, solved, seconds,
//! episodes}], "medians": [{actors, seconds, solved_runs}], "speedup"}`.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use shoal_comm::ReduceOp;
use shoal_comm::env::EnvContract;
use shoal_ps::Mode;
use shoal_ps::net::Client;
use shoal_ps::optim::OptimConfig;
use shoal_workloads::a3c::{self, A3cConfig, Episodes};
use shoal_workloads::recommender::{self, RecConfig};

use crate::bench::{BenchArgs, Ranks, transport_arg};
use crate::bench_ckpt::parse_count;
use crate::bench_ps::{ServerPlace, serve};

/// What the ranks are told.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Plan {
    Recommender { cfg: RecConfig, servers: usize, workers: usize, mode: String, timeout: Duration },
    A3c { cfg: A3cConfig, servers: usize, actors: usize, stop: PathBuf, timeout: Duration },
}

const ADAMW: OptimConfig = OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };

fn parse_mode(mode: &str) -> Result<Mode> {
    match mode {
        "sync" => Ok(Mode::Sync),
        "async" => Ok(Mode::Async),
        "ssp" => Ok(Mode::Ssp { staleness: 3 }),
        other => bail!("--mode: {other:?} is none of sync, async, ssp"),
    }
}

/// The servers (`--servers`, else `default`) and the deadline of every exchange, once the flags are checked.
fn checked(args: &BenchArgs, what: &str, default: usize) -> Result<(usize, Duration)> {
    let servers = args.servers.unwrap_or(default);
    if servers == 0 || args.ranks == 0 {
        bail!("--servers and --ranks (the workers) must be at least 1");
    }
    if args.nodes.nodes()?.is_some() {
        bail!("shoal bench {what} runs on one host");
    }
    let timeout = shoal_comm::env::parse_duration(&args.timeout).map_err(|e| anyhow::anyhow!("--timeout: {e}"))?;
    Ok((servers, timeout))
}

/// What the recommender's rank 0 reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RecFigures {
    users: usize,
    items: usize,
    servers: usize,
    workers: usize,
    mode: String,
    steps: usize,
    batch: usize,
    seconds: f64,
    samples_per_s: f64,
    auc: f64,
    planted_auc: f64,
    auc_gap: f64,
    push_bytes_per_step: f64,
    touched_bytes_per_step: f64,
    top_bytes_per_step: f64,
    rows_ratio: f64,
    dense_ratio: f64,
    loss_first: f64,
    loss_last: f64,
}

pub fn recommender(args: &BenchArgs) -> Result<bool> {
    let (servers, timeout) = checked(args, "recommender", 2)?;
    let mut cfg = RecConfig::default();
    if let Some(users) = &args.users {
        cfg.clicks.users = parse_count(users)?;
        cfg.clicks.items = (cfg.clicks.users / 10).max(1);
    }
    if let Some(steps) = args.steps {
        if steps == 0 {
            bail!("--steps must be at least 1");
        }
        cfg.steps = steps;
    }
    shoal_workloads::recommender::Recommender::new(&cfg)?;
    shoal_workloads::clicks::Clicks::new(cfg.clicks)?;
    parse_mode(&args.mode)?;
    let plan = Plan::Recommender { cfg, servers, workers: args.ranks, mode: args.mode.clone(), timeout };
    let mut ranks_args = args.clone();
    ranks_args.ranks = args.ranks + servers;
    let transport = transport_arg(args, "tcp")?;
    let ranks = Ranks::new(&ranks_args, &transport, vec!["bench-workload-rank".into(), serde_json::to_string(&plan)?])?;
    if !args.json {
        println!(
            "# shoal bench recommender: {} users × {} items (embedding width {}), {} worker(s) × {} steps of {}, {} \
             server(s), {}",
            cfg.clicks.users, cfg.clicks.items, cfg.dim, args.ranks, cfg.steps, cfg.batch, servers, args.mode
        );
    }
    let Some(f) = ranks.run_figures::<RecFigures>()? else { return Ok(false) };
    if args.json {
        println!("{}", serde_json::to_string(&f)?);
        return Ok(true);
    }
    println!("held-out AUC       {:.4}   (planted model {:.4}, gap {:.4})", f.auc, f.planted_auc, f.auc_gap);
    println!("training loss      {:.4} → {:.4}", f.loss_first, f.loss_last);
    println!(
        "pushed per step    {:.1} KB: embedding rows {:.2}× the {:.1} KB of rows touched, + {:.1} KB top network",
        f.push_bytes_per_step / 1e3,
        f.rows_ratio,
        f.touched_bytes_per_step / 1e3,
        f.top_bytes_per_step / 1e3
    );
    println!("                   {:.5}× a dense push of the whole model", f.dense_ratio);
    println!("throughput         {:.0} samples/s over {:.1} s", f.samples_per_s, f.seconds);
    Ok(true)
}

/// One rank of either workload: the last `servers` serve, the others work.
pub fn run_rank(spec: &str) -> Result<()> {
    let plan: Plan = serde_json::from_str(spec).context("the benchmark's plan")?;
    let env = EnvContract::from_env()?;
    let comm_cfg = env.cfg.clone();
    let world = env.connect()?;
    let rank = world.rank();
    let (servers, workers, mode, timeout) = match &plan {
        Plan::Recommender { servers, workers, mode, timeout, .. } => (*servers, *workers, parse_mode(mode)?, *timeout),
        Plan::A3c { servers, actors, timeout, .. } => (*servers, *actors, Mode::Async, *timeout),
    };
    let is_server = rank >= workers;
    let group = world.split((!is_server).then_some(0), rank as i64)?;
    if is_server {
        let place = ServerPlace { index: rank - workers, servers, workers };
        // A worker's whole run may pass between two requests of another (the recommender's last pull).
        return serve(&comm_cfg, &world, place, mode, ADAMW, timeout + Duration::from_secs(600));
    }
    let group = group.context("the workers' group")?;
    let addrs = shoal_ps::net::addresses(world.store().as_ref(), &comm_cfg.name, servers, timeout)?;
    let mut client = Client::connect(addrs, rank, &comm_cfg.secret, mode, timeout)?;
    match plan {
        Plan::Recommender { cfg, servers, workers, mode: mode_name, .. } => {
            group.barrier()?;
            let (report, params) = recommender::train(&mut client, &cfg, rank, workers)?;
            client.done()?;
            let mut totals = [report.samples as f64, report.seconds];
            group.all_reduce(&mut totals[..1], ReduceOp::Sum)?;
            group.all_reduce(&mut totals[1..], ReduceOp::Max)?;
            if rank == 0 {
                let eval = recommender::evaluate(&cfg, &params)?;
                let steps = report.steps.max(1) as f64;
                let f = RecFigures {
                    users: cfg.clicks.users,
                    items: cfg.clicks.items,
                    servers,
                    workers,
                    mode: mode_name,
                    steps: report.steps,
                    batch: cfg.batch,
                    seconds: totals[1],
                    samples_per_s: totals[0] / totals[1],
                    auc: eval.auc,
                    planted_auc: eval.planted_auc,
                    auc_gap: eval.planted_auc - eval.auc,
                    push_bytes_per_step: report.push_bytes as f64 / steps,
                    touched_bytes_per_step: report.touched_bytes as f64 / steps,
                    top_bytes_per_step: report.top_bytes as f64 / steps,
                    rows_ratio: (report.push_bytes - report.top_bytes) as f64 / report.touched_bytes.max(1) as f64,
                    dense_ratio: report.push_bytes as f64 / (report.model_bytes as f64 * steps),
                    loss_first: report.loss_first,
                    loss_last: report.loss_last,
                };
                println!("{}", serde_json::to_string(&f)?);
            }
        }
        Plan::A3c { cfg, stop, .. } => {
            group.barrier()?;
            if rank == 0 {
                println!("{}", serde_json::json!({ "ready": true }));
            }
            let lines = Lines { stop };
            let report = a3c::act(&mut client, &cfg, rank, &lines)?;
            tracing::info!(?report, "actor done");
            client.done()?;
        }
    }
    Ok(())
}

/// [`Episodes`] for an actor process: each finished episode printed for the parent, which keeps the window and
/// makes the stop file once solved.
struct Lines {
    stop: PathBuf,
}

impl Episodes for Lines {
    fn finished(&self, actor: usize, reward: f64) -> shoal_workloads::Result<bool> {
        println!("{}", serde_json::json!({ "actor": actor, "episode": reward }));
        Ok(self.stopped())
    }

    fn stopped(&self) -> bool {
        self.stop.exists()
    }
}

/// One A3C run.
#[derive(Debug, Clone, Serialize)]
struct A3cRun {
    actors: usize,
    repeat: usize,
    solved: bool,
    seconds: f64,
    episodes: u64,
}

pub fn a3c(args: &BenchArgs) -> Result<bool> {
    let (servers, timeout) = checked(args, "a3c", 1)?;
    let actors: Vec<usize> = args
        .actors
        .split(',')
        .map(|a| a.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<_>>()
        .with_context(|| format!("--actors: {:?} is not a list of positive numbers", args.actors))?;
    if args.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    if !(args.seconds.is_finite() && args.seconds > 0.0) {
        bail!("--seconds must be positive, got {}", args.seconds);
    }
    let cfg = A3cConfig { max_seconds: args.seconds, ..A3cConfig::default() };
    if !args.json {
        println!(
            "# shoal bench a3c: CartPole, actors {:?}, {} run(s) each, {} server(s), async; solved = mean ≥ 195 over \
             100 episodes",
            actors, args.repeats, servers
        );
    }
    let mut runs = Vec::new();
    for &n in &actors {
        for repeat in 0..args.repeats {
            let stop = std::env::temp_dir().join(format!("shoal-a3c-{}-{n}-{repeat}.stop", std::process::id()));
            let _ = std::fs::remove_file(&stop);
            let cfg = A3cConfig { seed: cfg.seed + repeat as u64, ..cfg };
            let plan = Plan::A3c { cfg, servers, actors: n, stop: stop.clone(), timeout };
            let mut ranks_args = args.clone();
            ranks_args.ranks = n + servers;
            let transport = transport_arg(args, "tcp")?;
            let ranks =
                Ranks::new(&ranks_args, &transport, vec!["bench-workload-rank".into(), serde_json::to_string(&plan)?])?;
            let run = watch(&ranks, &stop, n, repeat)?;
            let _ = std::fs::remove_file(&stop);
            let Some(run) = run else { return Ok(false) };
            if !args.json {
                println!(
                    "{} actor(s), run {}: {} in {:.2} s, {} episodes",
                    n,
                    repeat + 1,
                    if run.solved { "solved" } else { "NOT solved" },
                    run.seconds,
                    run.episodes
                );
            }
            runs.push(run);
        }
    }
    let medians: Vec<serde_json::Value> = actors
        .iter()
        .map(|&n| {
            let mine: Vec<&A3cRun> = runs.iter().filter(|r| r.actors == n).collect();
            let solved = mine.iter().filter(|r| r.solved).count();
            let secs = shoal_spec::median(
                mine.iter().map(|r| if r.solved { r.seconds } else { f64::INFINITY }).collect::<Vec<f64>>(),
            );
            serde_json::json!({ "actors": n, "seconds": secs, "solved_runs": solved })
        })
        .collect();
    let secs = |i: usize| medians.get(i).and_then(|m| m["seconds"].as_f64());
    let speedup = match (secs(0), secs(medians.len().saturating_sub(1))) {
        (Some(a), Some(b)) if medians.len() > 1 && a.is_finite() && b.is_finite() => Some(a / b),
        _ => None,
    };
    if args.json {
        println!("{}", serde_json::json!({ "runs": runs, "medians": medians, "speedup": speedup }));
        return Ok(true);
    }
    println!("{:<8} {:>16} {:>8}", "actors", "median seconds", "solved");
    for m in &medians {
        println!(
            "{:<8} {:>16.2} {:>5}/{}",
            m["actors"].as_u64().unwrap_or(0),
            m["seconds"].as_f64().unwrap_or(f64::NAN),
            m["solved_runs"].as_u64().unwrap_or(0),
            args.repeats
        );
    }
    if let Some(s) = speedup {
        println!("{} actor(s) solve {s:.2}× faster than {}", actors.last().copied().unwrap_or(0), actors[0]);
    }
    Ok(true)
}

/// Runs the actors, keeping the window of finished episodes; makes `stop` once solved.
fn watch(ranks: &Ranks, stop: &Path, actors: usize, repeat: usize) -> Result<Option<A3cRun>> {
    let mut start: Option<Instant> = None;
    let mut last = VecDeque::new();
    let mut episodes = 0u64;
    let mut solved: Option<f64> = None;
    let mut stop_err = None;
    let ran = ranks.run_all(|_, line| {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { return false };
        if v.get("ready").is_some() {
            start = Some(Instant::now());
            return true;
        }
        let Some(reward) = v.get("episode").and_then(serde_json::Value::as_f64) else { return false };
        episodes += 1;
        if a3c::record(&mut last, reward) && solved.is_none() {
            solved = Some(start.map_or(0.0, |s| s.elapsed().as_secs_f64()));
            if let Err(e) = std::fs::write(stop, b"solved") {
                stop_err = Some(e);
            }
        }
        true
    })?;
    if let Some(e) = stop_err {
        bail!("telling the actors to stop ({}): {e}", stop.display());
    }
    Ok(ran.map(|_| A3cRun {
        actors,
        repeat,
        solved: solved.is_some(),
        seconds: solved.unwrap_or(f64::INFINITY),
        episodes,
    }))
}
