//! `shoal bench ps`: the parameter servers' push and pull throughput, measured as Ray's documented actor parameter
//! server is (`scripts/ps-ray.py`, run beside ours when a Python with Ray is given), and next to an all-reduce of
//! the same size.
//!
//! `--params` float32 values (default 10M) are spread over `--servers` server processes (default 2); each of
//! `--ranks` worker processes (default 2) pushes a gradient for every server's part and pulls every part back, over
//! and over, for `--seconds` after a second of warm-up. The servers run the asynchronous mode with plain SGD (each
//! push applied on arrival, as Ray's actors apply theirs), so the figure is the system's, not a round's waiting.
//! Reported: the payload moved (bytes pushed plus pulled by every worker) per second, rounds per second, and the
//! time of one all-reduce of the same bytes among the workers, with its algorithm bandwidth. With Ray, its figures
//! for the same shape follow, and ours over Ray's.
//!
//! The ranks are separate processes started like the collective benchmark's (`bench.rs`); every exchange is
//! bounded by `--timeout`. Rank 0 prints one JSON line of its figures; the parent prints the table, or with
//! `--json` one object: `params servers workers seconds rounds payload_gb_s rounds_per_s allreduce_s
//! allreduce_gb_s` and, with Ray, `ray` (its own line) and `vs_ray`.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use shoal_comm::ReduceOp;
use shoal_comm::env::EnvContract;
use shoal_ps::net::{Client, Part, Server, ServerConfig};
use shoal_ps::optim::OptimConfig;
use shoal_ps::{Mode, Rule};

use crate::bench::{BenchArgs, Ranks, transport_arg};
use crate::bench_ckpt::parse_count;

/// What the ranks are told.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Plan {
    params: usize,
    servers: usize,
    workers: usize,
    seconds: f64,
    timeout: Duration,
}

/// What rank 0 reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Figures {
    params: usize,
    servers: usize,
    workers: usize,
    seconds: f64,
    rounds: u64,
    payload_gb_s: f64,
    rounds_per_s: f64,
    allreduce_s: f64,
    allreduce_gb_s: f64,
}

pub fn run(args: &BenchArgs) -> Result<bool> {
    let params = parse_count(args.params.as_deref().unwrap_or("10M"))?;
    let servers = args.servers.unwrap_or(2);
    if servers == 0 || args.ranks == 0 {
        bail!("--servers and --ranks (the workers) must be at least 1");
    }
    if !(args.seconds.is_finite() && args.seconds > 0.0) {
        bail!("--seconds must be positive, got {}", args.seconds);
    }
    if args.nodes.nodes()?.is_some() {
        bail!("shoal bench ps runs on one host");
    }
    let timeout = shoal_comm::env::parse_duration(&args.timeout).map_err(|e| anyhow::anyhow!("--timeout: {e}"))?;
    let plan = Plan { params, servers, workers: args.ranks, seconds: args.seconds, timeout };
    let mut ranks_args = args.clone();
    ranks_args.ranks = args.ranks + servers;
    let transport = transport_arg(args, "tcp")?;
    let ranks = Ranks::new(&ranks_args, &transport, vec!["bench-ps-rank".into(), serde_json::to_string(&plan)?])?;
    if !args.json {
        println!(
            "# shoal bench ps: {params} float32 parameters on {} server(s), {} worker(s), {} s timed",
            servers, args.ranks, args.seconds
        );
    }
    let Some(ours) = ranks.run_figures::<Figures>()? else { return Ok(false) };
    let ray_python = args.ray.clone().or_else(|| std::env::var_os("SHOAL_RAY_PYTHON").map(Into::into));
    let ray = match &ray_python {
        Some(py) => Some(ray(py, &plan)?),
        None => None,
    };
    let ray_gb = ray.as_ref().and_then(|r| r["payload_gb_s"].as_f64());
    if args.json {
        let mut doc = serde_json::to_value(&ours)?;
        if let Some(r) = &ray {
            doc["ray"] = r.clone();
            doc["vs_ray"] = serde_json::json!(ray_gb.map(|g| ours.payload_gb_s / g));
        }
        println!("{doc}");
        return Ok(true);
    }
    println!("{:<28} {:>12} {:>12}", "system", "payload GB/s", "rounds/s");
    println!("{:<28} {:>12.3} {:>12.1}", "shoal ps", ours.payload_gb_s, ours.rounds_per_s);
    if let Some(r) = &ray {
        let rounds = r["rounds_per_s"].as_f64().unwrap_or(f64::NAN);
        let version = r["ray_version"].as_str().unwrap_or("?");
        println!("{:<28} {:>12.3} {:>12.1}", format!("ray {version} actors"), ray_gb.unwrap_or(f64::NAN), rounds);
        println!("shoal over ray: {:.2}x payload GB/s", ray_gb.map_or(f64::NAN, |g| ours.payload_gb_s / g));
    } else {
        println!("(no Ray measured: give --ray PYTHON or SHOAL_RAY_PYTHON; scripts/setup-ray.sh makes one)");
    }
    println!(
        "all-reduce of the same {:.1} MB among the {} workers: {:.2} ms ({:.2} GB/s algorithm bandwidth)",
        params as f64 * 4e-6,
        ours.workers,
        ours.allreduce_s * 1e3,
        ours.allreduce_gb_s
    );
    Ok(true)
}

/// Ray's figures for the same shape: `scripts/ps-ray.py` under `python`, one JSON line.
fn ray(python: &std::path::Path, plan: &Plan) -> Result<serde_json::Value> {
    let script = std::path::Path::new("scripts/ps-ray.py");
    if !script.exists() {
        bail!("--ray: {} not found (run shoal bench ps from the repository's root)", script.display());
    }
    let out = std::process::Command::new(python)
        .arg(script)
        .args(["--params", &plan.params.to_string(), "--servers", &plan.servers.to_string()])
        .args(["--workers", &plan.workers.to_string(), "--seconds", &plan.seconds.to_string(), "--json"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running {} {}", python.display(), script.display()))?;
    if !out.status.success() {
        bail!("{} {} failed ({})", python.display(), script.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{')).unwrap_or("");
    serde_json::from_str(line).with_context(|| format!("Ray's figures are not JSON: {text}"))
}

/// Which server a rank is, among how many, for how many workers.
#[derive(Debug, Clone, Copy)]
pub struct ServerPlace {
    pub index: usize,
    pub servers: usize,
    pub workers: usize,
}

/// Runs a benchmark's server until its workers are done: listens on the advertised address, says where in the
/// rendezvous store, and serves `mode` with `optim`.
pub fn serve(
    env: &shoal_comm::CommConfig,
    world: &shoal_comm::Communicator,
    place: ServerPlace,
    mode: Mode,
    optim: OptimConfig,
    wait: Duration,
) -> Result<()> {
    let listener = TcpListener::bind((env.advertise, 0)).context("binding the server")?;
    let addr = listener.local_addr()?.to_string();
    shoal_ps::net::publish(world.store().as_ref(), &env.name, place.index, &addr)?;
    let cfg = ServerConfig {
        index: place.index,
        servers: place.servers,
        workers: place.workers,
        mode,
        optim,
        rule: Rule::Mean,
        f: 0,
        wait,
        secret: env.secret.clone(),
        attack: None,
    };
    Server::new(listener, cfg, None)?.run()?;
    Ok(())
}

/// One rank: the last `servers` serve, the others push and pull.
pub fn run_rank(spec: &str) -> Result<()> {
    let plan: Plan = serde_json::from_str(spec).context("the benchmark's plan")?;
    let env = EnvContract::from_env()?;
    let cfg = env.cfg.clone();
    let (name, secret) = (cfg.name.clone(), cfg.secret.clone());
    let world = env.connect()?;
    let rank = world.rank();
    let is_server = rank >= plan.workers;
    let workers = world.split((!is_server).then_some(0), rank as i64)?;
    // The model spread over the servers as evenly as whole values allow.
    let sizes: Vec<usize> =
        (0..plan.servers).map(|s| plan.params * (s + 1) / plan.servers - plan.params * s / plan.servers).collect();
    if is_server {
        let place = ServerPlace { index: rank - plan.workers, servers: plan.servers, workers: plan.workers };
        let optim = OptimConfig::Sgd { momentum: 0.0, weight_decay: 0.0 };
        let wait = plan.timeout + Duration::from_secs(plan.seconds.ceil() as u64 + 30);
        return serve(&cfg, &world, place, Mode::Async, optim, wait);
    }
    let workers = workers.context("the workers' group")?;
    let addrs = shoal_ps::net::addresses(world.store().as_ref(), &name, plan.servers, plan.timeout)?;
    let mut client = Client::connect(addrs, rank, &secret, Mode::Async, plan.timeout)?;
    let grads: Vec<Vec<f32>> = sizes.iter().map(|&n| (0..n).map(|i| (i % 97) as f32 * 1e-3).collect()).collect();
    let mut values: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.5; n]).collect();
    if rank == 0 {
        let parts: Vec<[&[f32]; 3]> = values.iter().map(|v| [v.as_slice(), &[][..], &[][..]]).collect();
        client.init(false, 0, &parts)?;
    }
    workers.barrier()?;
    let round = |client: &mut Client, values: &mut [Vec<f32>]| -> Result<()> {
        let parts = grads
            .iter()
            .zip(values.iter_mut())
            .map(|(g, v)| Part {
                push: Some(g.as_slice()),
                push_spans: &[],
                pull: Some(v.as_mut_slice()),
                pull_spans: &[],
            })
            .collect();
        Ok(client.exchange(1e-6, parts)?)
    };
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_secs(1) {
        round(&mut client, &mut values)?;
    }
    workers.barrier()?;
    let (b0, p0) = (client.bytes_pushed, client.bytes_pulled);
    let start = Instant::now();
    let mut rounds = 0u64;
    while start.elapsed().as_secs_f64() < plan.seconds {
        round(&mut client, &mut values)?;
        rounds += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut totals = [rounds as f64, (client.bytes_pushed - b0 + client.bytes_pulled - p0) as f64, elapsed];
    workers.all_reduce(&mut totals[..2], ReduceOp::Sum)?;
    workers.all_reduce(&mut totals[2..], ReduceOp::Max)?;
    client.done()?;
    // An all-reduce of the same bytes among the workers, the median of a few.
    let mut buf = vec![1f32; plan.params];
    let mut times = Vec::new();
    for i in 0..6 {
        workers.barrier()?;
        let t = Instant::now();
        workers.all_reduce(&mut buf, ReduceOp::Sum)?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let mut slowest = vec![shoal_spec::median(times).unwrap_or(f64::NAN)];
    workers.all_reduce(&mut slowest, ReduceOp::Max)?;
    if rank == 0 {
        let f = Figures {
            params: plan.params,
            servers: plan.servers,
            workers: plan.workers,
            seconds: totals[2],
            rounds: totals[0] as u64,
            payload_gb_s: totals[1] / totals[2] / 1e9,
            rounds_per_s: totals[0] / totals[2],
            allreduce_s: slowest[0],
            allreduce_gb_s: plan.params as f64 * 4.0 / slowest[0] / 1e9,
        };
        println!("{}", serde_json::to_string(&f)?);
    }
    Ok(())
}
