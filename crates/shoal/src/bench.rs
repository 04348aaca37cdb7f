//! `shoal bench <op>`: collective benchmarks in the style of nccl-tests, with
//! ranks as separate processes. The parent launches the ranks (see `launch`);
//! each rank times `barrier -> t0 -> op -> t1` per iteration; rank 0 gathers the
//! times, takes the slowest rank per iteration and the median over iterations,
//! and prints one JSON object per size on stdout, which the parent turns into
//! the table (or passes through with `--json`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use shoal_comm::chunk::segment;
use shoal_comm::env::EnvContract;
use shoal_comm::{Algo, DType, ReduceOp};

use shoal_comm::env::var;
use shoal_exec::launch::{LaunchSpec, launch};
use shoal_exec::procfs::describe;

/// The collective to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchOp {
    Allreduce,
    Broadcast,
    Allgather,
    Reducescatter,
}

/// What `shoal bench` measures: a collective, checkpoint saving, or gradient compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchWhat {
    Allreduce,
    Broadcast,
    Allgather,
    Reducescatter,
    /// Checkpoint save speed against the disk's (see `bench_ckpt`).
    Checkpoint,
    /// Gradient codecs: their speed on one core, the bytes they send and the all-reduce time (see
    /// `bench_compress`).
    Compress,
    /// Parameter servers: push and pull throughput, against Ray's actor parameter server and an all-reduce of the
    /// same size (see `bench_ps`).
    Ps,
    /// A recommender with a million-row embedding table through the parameter servers: held-out AUC against the
    /// planted model's, bytes pushed against the rows touched (see `bench_workloads`).
    Recommender,
    /// A3C on CartPole with actors as the parameter servers' workers: seconds to solve with 1 actor and with more
    /// (see `bench_workloads`).
    A3c,
    /// Batch rebalancing: two workers, one slowed to half speed from outside, static shares against dynamic (see
    /// `bench_balance`).
    Balance,
}

impl BenchWhat {
    /// The collective, or `None` for the checkpoint and compression benchmarks.
    pub fn collective(self) -> Option<BenchOp> {
        match self {
            BenchWhat::Allreduce => Some(BenchOp::Allreduce),
            BenchWhat::Broadcast => Some(BenchOp::Broadcast),
            BenchWhat::Allgather => Some(BenchOp::Allgather),
            BenchWhat::Reducescatter => Some(BenchOp::Reducescatter),
            BenchWhat::Checkpoint
            | BenchWhat::Compress
            | BenchWhat::Ps
            | BenchWhat::Recommender
            | BenchWhat::A3c
            | BenchWhat::Balance => None,
        }
    }
}

impl BenchOp {
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::Allreduce => "allreduce",
            BenchOp::Broadcast => "broadcast",
            BenchOp::Allgather => "allgather",
            BenchOp::Reducescatter => "reducescatter",
        }
    }

    /// nccl-tests' bus-bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::Allreduce => 2.0 * (n - 1.0) / n,
            BenchOp::Broadcast => 1.0,
            BenchOp::Allgather | BenchOp::Reducescatter => (n - 1.0) / n,
        }
    }
}

/// Options shared by the parent and the ranks.
#[derive(Debug, Clone, clap::Args, Serialize, Deserialize)]
pub struct BenchArgs {
    /// Number of ranks (separate processes).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// tcp, shm or auto (default: auto; for `compress`, tcp).
    #[arg(long)]
    pub transport: Option<String>,
    /// ring, tree, rhd (recursive halving-doubling), hier or auto.
    #[arg(long, default_value = "auto")]
    pub algo: String,
    /// Comma-separated sizes in bytes, with units B, KiB, MiB, GiB (or KB, MB, GB: powers of 10) (default:
    /// 4KiB,64KiB,1MiB,16MiB,64MiB; for `compress`, 64MiB).
    #[arg(long)]
    pub sizes: Option<String>,
    /// Element type: f32, f64, f16, bf16, i32, i64.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Reduction: sum, avg, min, max, prod.
    #[arg(long, default_value = "sum")]
    pub op: String,
    /// Timed iterations per size (default: by size, as the peers' scripts do).
    #[arg(long)]
    pub iters: Option<usize>,
    /// Warm-up iterations per size (default: by size).
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Limit for every collective; a stuck or dead rank fails the run within it.
    #[arg(long, default_value = "30s")]
    pub timeout: String,
    /// Verify every element against a reference; any wrong value fails the run.
    #[arg(long)]
    pub check: bool,
    /// One JSON object per size instead of the table.
    #[arg(long)]
    pub json: bool,
    /// checkpoint: parameters of the model saved, with AdamW's two moments (12 bytes each; default 100M); ps:
    /// parameters on the servers (default 10M); K, M, G suffixes.
    #[arg(long)]
    pub params: Option<String>,
    /// ps, recommender, a3c: parameter servers (separate processes; `--ranks` is the workers; default 2, a3c 1).
    #[arg(long)]
    pub servers: Option<usize>,
    /// recommender: the servers' mode, sync, async or ssp (staleness 3).
    #[arg(long, default_value = "async")]
    pub mode: String,
    /// recommender: steps each worker takes (default 6000).
    #[arg(long)]
    pub steps: Option<usize>,
    /// recommender: rows of the user embedding table (default 1M; K, M suffixes); the item table has a tenth.
    #[arg(long)]
    pub users: Option<String>,
    /// a3c: the numbers of actors to compare, comma-separated.
    #[arg(long, default_value = "1,4")]
    pub actors: String,
    /// a3c: runs of each number of actors (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// ps: seconds of pushes and pulls timed, after one of warm-up.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// ps: a Python with Ray, to measure Ray's actor parameter server of the same shape beside ours
    /// (`scripts/setup-ray.sh` makes one; default: `$SHOAL_RAY_PYTHON`; neither: ours alone).
    #[arg(long)]
    pub ray: Option<std::path::PathBuf>,
    /// checkpoint: rounds, each probing the disk both ways and saving once.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// checkpoint: directory to write in (default: the system temp directory).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Over several hosts: `--nnodes N --node-rank R --rdzv HOST:PORT`, --ranks per host (node 0 prints the table).
    #[command(flatten)]
    pub nodes: crate::nodes::NodeArgs,
}

/// The sizes the collectives are measured at unless `--sizes` says otherwise.
pub const DEFAULT_SIZES: &str = "4KiB,64KiB,1MiB,16MiB,64MiB";

impl BenchArgs {
    /// The sizes of `--sizes` (the collectives' default when not given).
    pub fn sizes(&self) -> Result<Vec<usize>> {
        parse_sizes(self.sizes.as_deref().unwrap_or(DEFAULT_SIZES))
    }
}

/// One result row.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[allow(non_snake_case)]
pub struct Row {
    pub op: String,
    pub ranks: usize,
    pub transport: String,
    pub algo: String,
    pub dtype: String,
    pub redop: String,
    pub bytes: usize,
    pub count: usize,
    pub iters: usize,
    pub time_s: f64,
    pub algbw_GBps: f64,
    pub busbw_GBps: f64,
    pub wrong: u64,
    /// Rank 0's peak resident memory so far (VmHWM), bytes.
    #[serde(default)]
    pub peak_rss_bytes: u64,
}

/// This process's peak resident set size (VmHWM) in bytes.
pub(crate) fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?.to_string();
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Parses `4KiB,1MiB,16MiB`: the units of job specs (B, KiB, MiB, GiB, TiB, K, M, G, T binary; KB, MB, GB, TB
/// decimal).
pub fn parse_sizes(s: &str) -> Result<Vec<usize>> {
    s.split(',').filter(|p| !p.trim().is_empty()).map(|p| parse_size(p.trim())).collect()
}

/// One size of `--sizes`, by the spec's byte-size parser ([`shoal_spec::parse_bytes`]).
pub fn parse_size(p: &str) -> Result<usize> {
    let bytes = shoal_spec::parse_bytes(p).map_err(|e| anyhow::anyhow!("--sizes: {e}"))?;
    usize::try_from(bytes).with_context(|| format!("--sizes: {p:?} does not fit in memory"))
}

/// Warm-up and timed iterations at a size, as the peers' scripts choose them.
pub fn default_iters(bytes: usize) -> (usize, usize) {
    match bytes {
        b if b <= 64 << 10 => (20, 300),
        b if b <= 1 << 20 => (10, 100),
        b if b <= 16 << 20 => (3, 30),
        b if b <= 64 << 20 => (2, 12),
        _ => (2, 7),
    }
}

/// The transport of `--transport` (`default` when not given), refused when the ranks could not use it.
pub fn transport_arg(args: &BenchArgs, default: &str) -> Result<String> {
    let name = args.transport.clone().unwrap_or_else(|| default.to_string());
    let transport: shoal_comm::TransportChoice = name.parse().map_err(|e| anyhow::anyhow!("--transport: {e}"))?;
    if transport == shoal_comm::TransportChoice::InProc {
        bail!(
            "--transport inproc needs ranks in one process; shoal bench runs separate processes (use tcp, shm or auto)"
        );
    }
    Ok(name)
}

/// Rank processes of a benchmark: this executable run as `shoal RANK_ARGS…`, `--ranks` of them on this host (and
/// as many on each of `--nnodes` hosts), with the benchmark's transport, algorithm and timeout in their
/// environment.
pub struct Ranks {
    spec: LaunchSpec,
    /// How many hosts the ranks span.
    pub hosts: usize,
}

impl Ranks {
    pub fn new(args: &BenchArgs, transport: &str, rank_args: Vec<String>) -> Result<Ranks> {
        if args.ranks == 0 {
            bail!("--ranks must be at least 1");
        }
        args.algo.parse::<Algo>().map_err(|e| anyhow::anyhow!("--algo: {e}"))?;
        let timeout = shoal_comm::env::parse_duration(&args.timeout).map_err(|e| anyhow::anyhow!("--timeout: {e}"))?;
        let nodes = args.nodes.nodes()?;
        let exe = std::env::current_exe().context("locating the shoal executable")?;
        let hosts = nodes.as_ref().map_or(1, |n| n.count);
        let spec = LaunchSpec {
            program: exe,
            args: rank_args,
            ranks: args.ranks,
            // The same on every host.
            job_id: nodes.as_ref().map_or_else(|| format!("bench-{}", std::process::id()), |n| n.job_id("bench")),
            env: vec![
                (var::TRANSPORT.into(), transport.to_string()),
                (var::ALGO.into(), args.algo.clone()),
                (var::TIMEOUT.into(), args.timeout.clone()),
            ],
            grace: timeout + Duration::from_secs(5),
            nodes,
        };
        Ok(Ranks { spec, hosts })
    }

    /// Ranks in all.
    pub fn world(&self) -> usize {
        self.spec.ranks * self.hosts
    }

    /// Runs the ranks to the end. `on_row` gets every line rank 0 prints on stdout and says whether it was a
    /// result; every other line goes to stderr, labelled with its rank. Returns the (global) rank of this host's
    /// first rank (0 on the host that prints results), or `None` once it has said on stderr how the run failed.
    pub fn run(&self, mut on_row: impl FnMut(&str) -> bool) -> Result<Option<usize>> {
        self.run_all(|rank, text| rank == 0 && on_row(text))
    }

    /// [`Ranks::run`] for a benchmark whose rank 0 prints one JSON line of figures: those figures, or `None` once
    /// stderr says how the run failed (or when rank 0 printed none).
    pub fn run_figures<T: serde::de::DeserializeOwned>(&self) -> Result<Option<T>> {
        let mut figures = None;
        let ran = self.run(|line| match serde_json::from_str::<T>(line) {
            Ok(f) => {
                figures = Some(f);
                true
            }
            Err(_) => false,
        })?;
        Ok(ran.and(figures))
    }

    /// [`Ranks::run`], with every rank's lines on stdout given to `on_line` (with the rank) in the order they
    /// arrive.
    pub fn run_all(&self, mut on_line: impl FnMut(usize, &str) -> bool) -> Result<Option<usize>> {
        let outcome = launch(&self.spec, |line| {
            if line.stderr || !on_line(line.rank, &line.text) {
                eprintln!("[rank {}] {}", line.rank, line.text);
            }
        })?;
        if outcome.interrupted {
            eprintln!("shoal bench: interrupted");
            return Ok(None);
        }
        if let Some(why) = &outcome.peer_failure {
            eprintln!("shoal bench: {why}");
            return Ok(None);
        }
        if let Some((rank, how)) = &outcome.first_failure {
            let others: Vec<String> = outcome
                .statuses
                .iter()
                .enumerate()
                .map(|(r, s)| (r + outcome.first_rank, s))
                .filter(|(r, _)| r != rank)
                .map(|(r, s)| {
                    format!("rank {r}: {}", s.map(|s| describe(&s)).unwrap_or_else(|| "still running".into()))
                })
                .collect();
            eprintln!("shoal bench: rank {rank} failed first ({how}); {}", others.join(", "));
            return Ok(None);
        }
        Ok(Some(outcome.first_rank))
    }
}

/// The parent: launches the ranks, prints the table; exit status non-zero on
/// any failure or wrong value.
pub fn run_bench(what: BenchWhat, args: &BenchArgs) -> Result<bool> {
    let Some(op) = what.collective() else { bail!("{what:?} is not a collective") };
    let mut args = args.clone();
    let args = &mut args;
    // The ranks get the defaults filled in.
    args.sizes.get_or_insert_with(|| DEFAULT_SIZES.into());
    args.sizes()?;
    args.dtype.parse::<DType>()?;
    args.op.parse::<ReduceOp>()?;
    let transport = transport_arg(args, "auto")?;
    args.transport = Some(transport.clone());
    let ranks = Ranks::new(args, &transport, vec!["bench-rank".into(), serde_json::to_string(&(op, &*args))?])?;
    if !args.json {
        println!(
            "# shoal bench {}: {} ranks{}, transport {}, algo {}, dtype {}, op {}",
            op.name(),
            ranks.world(),
            if ranks.hosts == 1 { String::new() } else { format!(" on {} hosts", ranks.hosts) },
            transport,
            args.algo,
            args.dtype,
            args.op
        );
        println!(
            "# {:>12} {:>12} {:>6} {:>6} {:>6} {:>12} {:>12} {:>12} {:>8}",
            "size", "count", "type", "redop", "algo", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
        );
    }
    let mut wrong = 0u64;
    let mut rows = 0usize;
    let first_rank = ranks.run(|text| {
        let Ok(row) = serde_json::from_str::<Row>(text) else { return false };
        wrong += row.wrong;
        rows += 1;
        if args.json {
            println!("{text}");
        } else {
            println!(
                "  {:>12} {:>12} {:>6} {:>6} {:>6} {:>12.1} {:>12.3} {:>12.3} {:>8}",
                row.bytes,
                row.count,
                row.dtype,
                row.redop,
                row.algo,
                row.time_s * 1e6,
                row.algbw_GBps,
                row.busbw_GBps,
                row.wrong
            );
        }
        true
    })?;
    let Some(first_rank) = first_rank else { return Ok(false) };
    if wrong > 0 {
        eprintln!("shoal bench: {wrong} wrong values");
        return Ok(false);
    }
    if !args.json && first_rank == 0 {
        println!("# {rows} sizes, 0 wrong values{}", if args.check { " (every element checked)" } else { "" });
    }
    Ok(true)
}

/// Value that rank `r` contributes at element `i`: small integers, so every sum
/// and product is exact in every dtype and the reference is exact.
fn pattern(op: ReduceOp, r: usize, i: usize) -> f64 {
    if op == ReduceOp::Prod { [1.0, -1.0, 2.0][(r + i) % 3] } else { ((r * 3 + i) % 7) as f64 - 3.0 }
}

fn fill(dtype: DType, buf: &mut [u8], f: impl Fn(usize) -> f64) {
    use half::{bf16, f16};
    let es = dtype.size();
    for (i, c) in buf.chunks_exact_mut(es).enumerate() {
        let v = f(i);
        match dtype {
            DType::F32 => c.copy_from_slice(&(v as f32).to_le_bytes()),
            DType::F64 => c.copy_from_slice(&v.to_le_bytes()),
            DType::F16 => c.copy_from_slice(&f16::from_f64(v).to_le_bytes()),
            DType::BF16 => c.copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
            DType::I32 => c.copy_from_slice(&(v as i32).to_le_bytes()),
            DType::I64 => c.copy_from_slice(&(v as i64).to_le_bytes()),
        }
    }
}

fn reduce_ref(op: ReduceOp, n: usize, i: usize, dtype: DType) -> f64 {
    let vals = (0..n).map(|r| pattern(op, r, i));
    let v = match op {
        ReduceOp::Sum | ReduceOp::Avg => vals.sum::<f64>(),
        ReduceOp::Prod => vals.product(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    };
    if op == ReduceOp::Avg { if dtype.is_float() { v / n as f64 } else { (v / n as f64).trunc() } } else { v }
}

fn count_wrong(dtype: DType, buf: &[u8], want: impl Fn(usize) -> f64) -> u64 {
    let mut expect = vec![0u8; buf.len()];
    fill(dtype, &mut expect, want);
    buf.chunks_exact(dtype.size()).zip(expect.chunks_exact(dtype.size())).filter(|(a, b)| a != b).count() as u64
}

/// One rank of the benchmark (started by the parent through `launch`).
pub fn run_rank(spec: &str) -> Result<()> {
    let (op, args): (BenchOp, BenchArgs) = serde_json::from_str(spec).context("bench-rank: bad arguments")?;
    let env = EnvContract::from_env()?;
    let comm = env.connect().context("joining the benchmark's communicator")?;
    let (n, rank) = (comm.size(), comm.rank());
    let dtype: DType = args.dtype.parse()?;
    let rop: ReduceOp = args.op.parse()?;
    let algo: Algo = args.algo.parse()?;
    let es = dtype.size();
    for bytes in args.sizes()? {
        let count = bytes / es;
        let bytes = count * es;
        let (dw, di) = default_iters(bytes);
        let (warm, iters) = (args.warmup.unwrap_or(dw), args.iters.unwrap_or(di).max(1));
        // Buffers are allocated once per size; the loop allocates nothing.
        let (mut a, mut b) = match op {
            BenchOp::Allreduce | BenchOp::Broadcast => (vec![0u8; bytes], Vec::new()),
            BenchOp::Allgather => {
                (vec![0u8; segment(count, n, 0).len() * es], vec![0u8; segment(count, n, 0).len() * es * n])
            }
            BenchOp::Reducescatter => (vec![0u8; bytes], vec![0u8; segment(count, n, rank).len() * es]),
        };
        let run_once = |a: &mut Vec<u8>, b: &mut Vec<u8>| -> shoal_comm::Result<()> {
            match op {
                BenchOp::Allreduce => comm.all_reduce_bytes(a, dtype, rop, algo),
                BenchOp::Broadcast => comm.broadcast_bytes(a, 0),
                BenchOp::Allgather => comm.all_gather_bytes(a, b),
                BenchOp::Reducescatter => comm.reduce_scatter_bytes(a, b, dtype, rop),
            }
        };
        fill(dtype, &mut a, |i| pattern(rop, rank, i));
        for _ in 0..warm {
            run_once(&mut a, &mut b)?;
        }
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            comm.barrier()?;
            let t0 = Instant::now();
            run_once(&mut a, &mut b)?;
            times.push(t0.elapsed().as_secs_f64());
        }
        let mut wrong = 0u64;
        if args.check {
            fill(dtype, &mut a, |i| pattern(rop, rank, i));
            run_once(&mut a, &mut b)?;
            wrong = match op {
                BenchOp::Allreduce => count_wrong(dtype, &a, |i| reduce_ref(rop, n, i, dtype)),
                BenchOp::Broadcast => count_wrong(dtype, &a, |i| pattern(rop, 0, i)),
                BenchOp::Allgather => {
                    let m = a.len() / es;
                    count_wrong(dtype, &b, |i| pattern(rop, i / m.max(1), i % m.max(1)))
                }
                BenchOp::Reducescatter => {
                    let seg = segment(count, n, rank);
                    count_wrong(dtype, &b, |i| reduce_ref(rop, n, seg.start + i, dtype))
                }
            };
        }
        // Gather every rank's times and wrong count at rank 0.
        let mut mine: Vec<f64> = times.clone();
        mine.push(wrong as f64);
        let mut all = vec![0f64; mine.len() * n];
        comm.all_gather(&mine, &mut all)?;
        if rank == 0 {
            let per_iter: Vec<f64> =
                (0..iters).map(|it| (0..n).map(|r| all[r * (iters + 1) + it]).fold(0.0, f64::max)).collect();
            let wrong_total: u64 = (0..n).map(|r| all[r * (iters + 1) + iters] as u64).sum();
            let time_s = shoal_spec::median(per_iter.iter().copied()).unwrap_or(0.0);
            let total_bytes = match op {
                BenchOp::Allgather => b.len(),
                _ => bytes,
            };
            let algbw = if time_s > 0.0 { total_bytes as f64 / time_s / 1e9 } else { 0.0 };
            let algo_used = match op {
                BenchOp::Allreduce => comm.choose_all_reduce(bytes, algo).name().to_string(),
                _ => algo.name().to_string(),
            };
            let row = Row {
                op: op.name().into(),
                ranks: n,
                transport: args.transport.clone().unwrap_or_else(|| "auto".into()),
                algo: algo_used,
                dtype: dtype.name().into(),
                redop: rop.name().into(),
                bytes: total_bytes,
                count: total_bytes / es,
                iters,
                time_s,
                algbw_GBps: algbw,
                busbw_GBps: algbw * op.bus_factor(n),
                wrong: wrong_total,
                peak_rss_bytes: peak_rss(),
            };
            println!("{}", serde_json::to_string(&row)?);
        }
    }
    comm.barrier()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_sizes("4KiB,1MiB,16MiB,1GiB,7B,9").ok(), Some(vec![4096, 1 << 20, 16 << 20, 1 << 30, 7, 9]));
        assert!(parse_sizes("4XB").is_err());
        assert!(parse_sizes("KiB").is_err());
        assert_eq!(parse_sizes("1KB,2M,0.5KiB").ok(), Some(vec![1000, 2 << 20, 512]));
        assert!(parse_sizes("18446744073709551616").is_err_and(|e| e.to_string().contains("too large")));
    }
}
