//! `cargo xtask bench-vs-peers`: Shoal's all-reduce side by side with Open MPI
//! (mpi4py) and Gloo (torch.distributed), same sizes, same iteration counts, same
//! method, alternating engines round by round; tables of per-size medians.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::idle::{IdleWait, wait_idle};
use crate::limits::{self, Limits};
use crate::util::{peer_scripts_dir, peers_dir, run_group, tail, timestamp, venv_python, which, workspace_root};

/// Keys `shoal bench allreduce --json` promises in each row.
pub const OURS_KEYS: [&str; 10] =
    ["op", "ranks", "transport", "algo", "dtype", "bytes", "time_s", "algbw_GBps", "busbw_GBps", "wrong"];

/// Longest idle wait between two engines of one round (the full wait is per round).
const BETWEEN_ENGINES_IDLE_S: u64 = 10;

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Rank counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    pub ranks: Vec<usize>,
    /// Transports, comma-separated: tcp, shm.
    #[arg(long, value_delimiter = ',', default_value = "tcp,shm")]
    pub transports: Vec<String>,
    /// Message sizes, comma-separated (bytes, or with KiB/MiB/GiB).
    #[arg(long, value_delimiter = ',', default_value = "4KiB,64KiB,1MiB,16MiB,64MiB,256MiB")]
    pub sizes: Vec<String>,
    /// Measurement rounds; engines alternate within each round.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// One JSON object per table row (and per limit / latency line) instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Engines to leave out, comma-separated: ours, ompi, gloo.
    #[arg(long, value_delimiter = ',')]
    pub skip: Vec<String>,
    /// Path of the shoal binary (default: target/release/shoal).
    #[arg(long)]
    pub shoal: Option<PathBuf>,
    /// Give up on one engine invocation after this many seconds.
    #[arg(long, default_value_t = 900)]
    pub timeout_s: u64,
    /// Longest wait for an idle machine (≥ 90 % idle over 1 s) before each round, seconds;
    /// between engines the wait is at most 10 s.
    #[arg(long, default_value_t = 60)]
    pub idle_wait_s: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Engine {
    Ours,
    Ompi,
    Gloo,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Ours => "ours",
            Engine::Ompi => "ompi",
            Engine::Gloo => "gloo",
        }
    }
}

/// One measured (engine, ranks, transport, size) point of one round.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub bytes: u64,
    pub time_s: f64,
    pub busbw: f64,
    pub wrong: u64,
    pub algo: Option<String>,
}

/// (warm-up, timed) iterations per size — the same table the peer scripts use.
pub fn iteration_counts(bytes: u64) -> (u32, u32) {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    match bytes {
        b if b <= 64 * KIB => (20, 300),
        b if b <= MIB => (10, 100),
        b if b <= 16 * MIB => (3, 30),
        b if b <= 64 * MIB => (2, 12),
        _ => (2, 7),
    }
}

/// "4KiB", "1MiB", "65536", "16M" → bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().with_context(|| format!("bad size {s:?}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        u => bail!("unknown size unit {u:?} in {s:?} (use KiB, MiB, GiB)"),
    };
    let b = n.checked_mul(mult).context("size overflows")?;
    anyhow::ensure!(b > 0 && b % 4 == 0, "size {s:?} must be a positive multiple of 4 bytes (f32)");
    Ok(b)
}

/// Bytes → "4KiB" / "1MiB" / "100B": the largest binary unit that divides exactly.
pub fn format_size(b: u64) -> String {
    for (unit, m) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if b >= m && b.is_multiple_of(m) {
            return format!("{}{unit}", b / m);
        }
    }
    format!("{b}B")
}

/// JSON objects in a process's stdout that look like result rows (other lines ignored).
/// For ours, rows lacking keys of the contract are still used if the numbers are there;
/// the missing keys are returned so the caller can warn.
pub fn parse_rows(stdout: &str, contract: &[&str]) -> (Vec<Point>, Vec<String>) {
    let mut points = Vec::new();
    let mut missing: Vec<String> = Vec::new();
    for line in stdout.lines() {
        let line = line.trim();
        if !line.starts_with('{') {
            continue;
        }
        let Ok(Value::Object(o)) = serde_json::from_str::<Value>(line) else { continue };
        let num = |k: &str| o.get(k).and_then(Value::as_f64);
        let (Some(bytes), Some(time_s), Some(busbw)) = (num("bytes"), num("time_s"), num("busbw_GBps")) else {
            continue;
        };
        if let Some(op) = o.get("op").and_then(Value::as_str)
            && op != "allreduce"
            && op != "all_reduce"
        {
            continue;
        }
        for k in contract {
            if !o.contains_key(*k) && !missing.iter().any(|m| m == k) {
                missing.push((*k).to_owned());
            }
        }
        points.push(Point {
            bytes: bytes as u64,
            time_s,
            busbw,
            wrong: num("wrong").map(|w| w as u64).unwrap_or(0),
            algo: o.get("algo").and_then(Value::as_str).map(str::to_owned),
        });
    }
    (points, missing)
}

/// The median of the finite values (the workspace's one median, `shoal_spec::median`).
pub fn median(xs: &mut [f64]) -> Option<f64> {
    shoal_spec::median(xs.iter().copied().filter(|x| x.is_finite()))
}

struct Ctx {
    args: BenchArgs,
    sizes: Vec<u64>,
    shoal: Option<PathBuf>,
    py: PathBuf,
    scripts: PathBuf,
    raw: std::fs::File,
    /// consecutive failed invocations with no rows, per engine
    failures: BTreeMap<Engine, u32>,
    disabled: Vec<Engine>,
}

impl Ctx {
    fn log(&self, msg: &str) {
        eprintln!("{msg}");
    }

    fn record(&mut self, v: Value) -> Result<()> {
        writeln!(self.raw, "{v}").context("writing raw results")
    }

    /// Waits for ≥ 90 % idle CPU for at most `max_s` seconds (the full `--idle-wait-s` at
    /// the start of a round, a short one between engines) and says so when it never was.
    fn idle(&mut self, what: &str, max_s: u64) -> Result<IdleWait> {
        let w = wait_idle(0.9, Duration::from_secs(max_s));
        if !w.reached {
            self.log(&format!(
                "  ! machine never got to 90% idle within {max_s} s before {what} (last second: {:.0}% idle); measuring anyway",
                w.idle * 100.0
            ));
        }
        self.record(
            json!({"kind": "idle", "before": what, "reached": w.reached, "idle": w.idle, "waited_s": w.waited_s}),
        )?;
        Ok(w)
    }

    fn note_result(&mut self, e: Engine, got_rows: bool) {
        let f = self.failures.entry(e).or_insert(0);
        if got_rows {
            *f = 0;
        } else {
            *f += 1;
            if *f >= 2 && !self.disabled.contains(&e) {
                self.disabled.push(e);
                eprintln!("  ! {} failed twice in a row without results; leaving it out from now on", e.name());
            }
        }
    }
}

fn python_env(cmd: &mut Command) {
    for k in [shoal_comm::env::var::OMP_THREADS, "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"] {
        cmd.env(k, "1");
    }
}

fn plan_arg(sizes: &[u64]) -> String {
    sizes
        .iter()
        .map(|&b| {
            let (w, k) = iteration_counts(b);
            format!("{b}:{w}:{k}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs one engine for one (ranks, transport) over all sizes; returns its points.
fn run_engine(cx: &mut Ctx, e: Engine, ranks: usize, transport: &str, round: usize) -> Result<Vec<Point>> {
    let timeout = Duration::from_secs(cx.args.timeout_s);
    let mut invocations: Vec<(Vec<Command>, String)> = Vec::new();
    match e {
        Engine::Ours => {
            let shoal = cx.shoal.clone().context("no shoal binary")?;
            // one invocation per size, so each gets its own iteration counts
            for &b in &cx.sizes {
                let (w, k) = iteration_counts(b);
                let mut c = Command::new(&shoal);
                c.args(["bench", "allreduce", "--ranks", &ranks.to_string(), "--transport", transport]).args([
                    "--sizes",
                    &format_size(b),
                    "--iters",
                    &k.to_string(),
                    "--warmup",
                    &w.to_string(),
                    "--json",
                    // verifies one extra, untimed all-reduce per size, like the peers' checks
                    "--check",
                ]);
                invocations.push((vec![c], format!("ours {}", format_size(b))));
            }
        }
        Engine::Ompi => {
            let mut c = Command::new("mpirun");
            c.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
            c.args(["-np", &ranks.to_string(), "--oversubscribe", "--mca", "pml", "ob1"]);
            match transport {
                "shm" => c.args(["--mca", "btl", "self,vader", "--mca", "btl_vader_single_copy_mechanism", "none"]),
                _ => c.args(["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"]),
            };
            c.args(["--mca", "oob_tcp_if_include", "lo"]);
            c.arg(&cx.py).arg(cx.scripts.join("mpi_allreduce.py"));
            c.args(["--transport", transport, "--plan", &plan_arg(&cx.sizes)]);
            python_env(&mut c);
            invocations.push((vec![c], "ompi".into()));
        }
        Engine::Gloo => {
            let port = free_port()?.to_string();
            let mut cmds = Vec::new();
            for r in 0..ranks {
                let mut c = Command::new(&cx.py);
                c.arg(cx.scripts.join("gloo_allreduce.py")).args(["--plan", &plan_arg(&cx.sizes)]);
                use shoal_comm::env::var;
                c.env(var::TORCH_RANK, r.to_string())
                    .env(var::TORCH_LOCAL_RANK, r.to_string())
                    .env(var::TORCH_WORLD_SIZE, ranks.to_string())
                    .env(var::MASTER_ADDR, "127.0.0.1")
                    .env(var::MASTER_PORT, &port)
                    .env("GLOO_SOCKET_IFNAME", "lo");
                python_env(&mut c);
                cmds.push(c);
            }
            invocations.push((cmds, "gloo".into()));
        }
    }
    let mut points = Vec::new();
    for (cmds, label) in invocations {
        let done = run_group(cmds, timeout)?;
        let rank0 = &done[0];
        let contract: &[&str] = if e == Engine::Ours { &OURS_KEYS } else { &[] };
        let (pts, missing) = parse_rows(&rank0.stdout, contract);
        if !missing.is_empty() {
            cx.log(&format!("  ! {label}: output lacks keys of the contract: {}", missing.join(", ")));
        }
        let failed: Vec<_> = done.iter().enumerate().filter(|(_, f)| !f.ok).collect();
        if !failed.is_empty() {
            for (i, f) in &failed {
                let why =
                    if f.timed_out { format!("timed out after {} s", cx.args.timeout_s) } else { f.status.clone() };
                let err =
                    if f.stderr.trim().is_empty() { "(nothing on stderr)".to_owned() } else { tail(&f.stderr, 15) };
                cx.log(&format!("  ! {label} (process {i}) failed: {why}\n{}", indent(&err)));
            }
        } else if pts.is_empty() {
            cx.log(&format!(
                "  ! {label}: no result rows on stdout\n{}",
                indent(&tail(&format!("{}{}", rank0.stdout, rank0.stderr), 15))
            ));
        }
        for line in rank0.stdout.lines().filter(|l| l.trim_start().starts_with('{')) {
            if let Ok(v) = serde_json::from_str::<Value>(line) {
                cx.record(json!({"kind": "raw", "engine": e.name(), "round": round, "ranks": ranks, "transport": transport, "row": v}))?;
            }
        }
        cx.note_result(e, !pts.is_empty());
        points.extend(pts);
    }
    Ok(points)
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("      {l}")).collect::<Vec<_>>().join("\n")
}

pub fn shoal_binary(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    let mut cands = Vec::new();
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        cands.push(PathBuf::from(t).join("release/shoal"));
    }
    cands.push(workspace_root().join("target/release/shoal"));
    cands.into_iter().find(|p| p.is_file())
}

fn fmt_opt(x: Option<f64>, prec: usize) -> String {
    x.map(|v| format!("{v:.prec$}")).unwrap_or_else(|| "-".into())
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

type Key = (usize, String); // (ranks, transport)

pub fn bench_vs_peers(args: BenchArgs) -> Result<()> {
    let mut sizes = args.sizes.iter().map(|s| parse_size(s)).collect::<Result<Vec<_>>>()?;
    sizes.dedup();
    for t in &args.transports {
        anyhow::ensure!(t == "tcp" || t == "shm", "unknown transport {t:?} (tcp, shm)");
    }
    for s in &args.skip {
        anyhow::ensure!(
            ["ours", "ompi", "gloo"].contains(&s.as_str()),
            "unknown engine {s:?} in --skip (ours, ompi, gloo)"
        );
    }
    anyhow::ensure!(args.ranks.iter().all(|&r| r >= 2), "--ranks must be ≥ 2");
    anyhow::ensure!(args.rounds >= 1, "--rounds must be ≥ 1");

    // Which engines can run.
    let mut engines = Vec::new();
    let skip = |n: &str| args.skip.iter().any(|s| s == n);
    let shoal = if skip("ours") { None } else { shoal_binary(args.shoal.as_deref()) };
    if skip("ours") {
        eprintln!("ours: skipped (--skip)");
    } else if let Some(p) = &shoal {
        anyhow::ensure!(p.is_file(), "{} does not exist", p.display());
        eprintln!("ours: {}", p.display());
        engines.push(Engine::Ours);
    } else {
        eprintln!(
            "ours: target/release/shoal not found — run `cargo build --release -p shoal` first; measuring the peers only"
        );
    }
    let peers = peers_dir();
    let py = venv_python(&peers);
    let have = crate::setup::probe(&py);
    if !skip("ompi") {
        match (which("mpirun"), &have.numpy, &have.mpi4py) {
            (Some(_), Some(_), Some(v)) => {
                let ompi = crate::setup::mpi_version().unwrap_or_default();
                eprintln!("ompi: Open MPI {ompi} via mpi4py {v} in {}", peers.display());
                engines.push(Engine::Ompi);
            }
            _ => eprintln!(
                "ompi: not installed (mpirun + numpy + mpi4py in {}) — run `cargo xtask setup-peers`; skipping",
                peers.display()
            ),
        }
    }
    if !skip("gloo") && args.transports.iter().any(|t| t == "tcp") {
        if let Some(v) = &have.torch {
            eprintln!("gloo: torch {v} in {}", peers.display());
            engines.push(Engine::Gloo);
        } else {
            eprintln!("gloo: torch not installed in {} — run `cargo xtask setup-peers`; skipping", peers.display());
        }
    }
    if engines.is_empty() {
        eprintln!("nothing to compare: no engine available; measuring the limits only");
    }

    let dir = workspace_root().join("bench-results");
    std::fs::create_dir_all(&dir)?;
    let stamp = timestamp();
    let raw_path = dir.join(format!("vs-peers-{stamp}.jsonl"));
    let raw = std::fs::File::create(&raw_path).with_context(|| format!("creating {}", raw_path.display()))?;
    let mut cx = Ctx {
        sizes: sizes.clone(),
        shoal,
        py,
        scripts: peer_scripts_dir(),
        raw,
        failures: BTreeMap::new(),
        disabled: Vec::new(),
        args,
    };
    let meta = json!({
        "kind": "meta", "stamp": stamp, "ranks": cx.args.ranks, "transports": cx.args.transports,
        "sizes": sizes, "rounds": cx.args.rounds, "engines": engines.iter().map(|e| e.name()).collect::<Vec<_>>(),
        "shoal": cx.shoal.as_ref().map(|p| p.display().to_string()),
        "peers_versions": std::fs::read_to_string(peers.join("versions.json")).ok().and_then(|s| serde_json::from_str::<Value>(&s).ok()),
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
    });
    cx.record(meta)?;

    let combos: Vec<Key> =
        cx.args.ranks.iter().flat_map(|&r| cx.args.transports.iter().map(move |t| (r, t.clone()))).collect();
    // (ranks, transport) -> engine -> bytes -> points over rounds
    let mut res: BTreeMap<Key, BTreeMap<Engine, BTreeMap<u64, Vec<Point>>>> = BTreeMap::new();
    let mut lims: Vec<Limits> = Vec::new();
    let rounds = cx.args.rounds;
    for round in 0..rounds {
        eprintln!("== round {}/{rounds}", round + 1);
        cx.idle(&format!("round {}", round + 1), cx.args.idle_wait_s)?;
        let l = limits::measure()?;
        eprintln!(
            "  limits: memcpy 1 thread {:.2} GB/s; TCP loopback both ways {:.2} GB/s per direction",
            l.memcpy_1t_gbps, l.tcp_bidir_per_dir_gbps
        );
        cx.record(json!({"kind": "limits", "round": round, "limits": l}))?;
        lims.push(l);
        for key in &combos {
            let (ranks, transport) = (key.0, key.1.as_str());
            let mut order: Vec<Engine> =
                engines.iter().copied().filter(|&e| !(e == Engine::Gloo && transport != "tcp")).collect();
            if !order.is_empty() {
                let k = round % order.len();
                order.rotate_left(k); // alternate who goes first
            }
            for e in order {
                if cx.disabled.contains(&e) {
                    continue;
                }
                cx.idle(
                    &format!("{} {ranks} ranks {transport}", e.name()),
                    cx.args.idle_wait_s.min(BETWEEN_ENGINES_IDLE_S),
                )?;
                eprintln!("  {} — {ranks} ranks, {transport}", e.name());
                let pts = run_engine(&mut cx, e, ranks, transport, round)?;
                let slot = res.entry(key.clone()).or_default().entry(e).or_default();
                for p in pts {
                    let wrong = if p.wrong > 0 { format!("  WRONG={}", p.wrong) } else { String::new() };
                    eprintln!(
                        "    {:>7}  {:>9.2} µs  busbw {:>7.3} GB/s{wrong}",
                        format_size(p.bytes),
                        p.time_s * 1e6,
                        p.busbw
                    );
                    slot.entry(p.bytes).or_default().push(p);
                }
            }
        }
    }

    // Summaries.
    let med = |f: &dyn Fn(&Limits) -> f64| median(&mut lims.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN);
    let memcpy = med(&|l| l.memcpy_1t_gbps);
    let tcp = med(&|l| l.tcp_bidir_per_dir_gbps);
    let mut text = String::new();
    let mut json_rows: Vec<Value> = Vec::new();
    json_rows
        .push(json!({"kind": "limits", "memcpy_1t_GBps": memcpy, "tcp_bidir_per_dir_GBps": tcp, "rounds": lims.len()}));
    let _ = writeln!(text, "limits (median of {} rounds, GB = 1e9 B):", lims.len());
    let _ = writeln!(text, "  memcpy, 1 thread, 256 MiB:                 {memcpy:>7.2} GB/s");
    let _ = writeln!(text, "  loopback TCP, both directions at once:     {tcp:>7.2} GB/s per direction");
    let cell = |key: &Key, e: Engine, b: u64| -> (Option<f64>, Option<f64>, u64, Option<String>) {
        let Some(pts) = res.get(key).and_then(|m| m.get(&e)).and_then(|m| m.get(&b)) else {
            return (None, None, 0, None);
        };
        let bw = median(&mut pts.iter().map(|p| p.busbw).collect::<Vec<_>>());
        let t = median(&mut pts.iter().map(|p| p.time_s).collect::<Vec<_>>());
        let wrong = pts.iter().map(|p| p.wrong).sum();
        let mut algos: Vec<String> = pts.iter().filter_map(|p| p.algo.clone()).collect();
        algos.sort();
        algos.dedup();
        (bw, t, wrong, (!algos.is_empty()).then(|| algos.join("+")))
    };
    let mut wrong_notes = Vec::new();
    for key in &combos {
        let (ranks, transport) = (key.0, key.1.as_str());
        let (limit, limit_name) =
            if transport == "shm" { (memcpy, "memcpy 1 thread") } else { (tcp, "TCP bidir per direction") };
        let _ = writeln!(
            text,
            "\n{ranks} ranks, {transport}: all-reduce f32 sum, busbw GB/s, median of {rounds} rounds (limit: {limit_name} {limit:.2} GB/s)"
        );
        let _ = writeln!(
            text,
            "  {:>7}  {:>7}  {:>7}  {:>7}  {:>9}  {:>9}  {:>11}  ours algo",
            "size", "ours", "ompi", "gloo", "ours/ompi", "ours/gloo", "ours %limit"
        );
        for &b in &sizes {
            let (o, ot, ow, oalgo) = cell(key, Engine::Ours, b);
            let (m, mt, mw, _) = cell(key, Engine::Ompi, b);
            let (g, gt, gw, _) = cell(key, Engine::Gloo, b);
            for (e, w) in [("ours", ow), ("ompi", mw), ("gloo", gw)] {
                if w > 0 {
                    wrong_notes.push(format!("{e} {ranks} ranks {transport} {}: {w} wrong elements", format_size(b)));
                }
            }
            let mark = |v: Option<f64>, w: u64| format!("{}{}", fmt_opt(v, 3), if w > 0 { "!" } else { "" });
            let pct = ratio(o, Some(limit)).map(|r| r * 100.0);
            let _ = writeln!(
                text,
                "  {:>7}  {:>7}  {:>7}  {:>7}  {:>9}  {:>9}  {:>11}  {}",
                format_size(b),
                mark(o, ow),
                mark(m, mw),
                if transport == "tcp" { mark(g, gw) } else { "n/a".into() },
                fmt_opt(ratio(o, m), 2),
                fmt_opt(ratio(o, g), 2),
                pct.map(|p| format!("{p:.0}%")).unwrap_or_else(|| "-".into()),
                oalgo.clone().unwrap_or_else(|| "-".into()),
            );
            json_rows.push(json!({
                "kind": "row", "ranks": ranks, "transport": transport, "bytes": b, "size": format_size(b),
                "ours_busbw_GBps": o, "ompi_busbw_GBps": m, "gloo_busbw_GBps": g,
                "ours_time_s": ot, "ompi_time_s": mt, "gloo_time_s": gt,
                "ours_over_ompi": ratio(o, m), "ours_over_gloo": ratio(o, g),
                "limit": if transport == "shm" { "memcpy_1t" } else { "tcp_bidir_per_dir" },
                "limit_GBps": limit, "ours_pct_of_limit": pct, "ours_algo": oalgo,
                "wrong": {"ours": ow, "ompi": mw, "gloo": gw}, "rounds": rounds,
            }));
        }
    }
    // 4 KiB latency, 2 ranks, shared memory.
    let lat_key: Key = (2, "shm".into());
    if combos.contains(&lat_key) && sizes.contains(&4096) {
        let (_, ot, _, _) = cell(&lat_key, Engine::Ours, 4096);
        let (_, mt, _, _) = cell(&lat_key, Engine::Ompi, 4096);
        let us = |t: Option<f64>| t.map(|t| format!("{:.2} µs", t * 1e6)).unwrap_or_else(|| "-".into());
        let _ = writeln!(
            text,
            "\n4 KiB latency, 2 ranks shm (median time): ours {}, Open MPI {} (ours/ompi time {})",
            us(ot),
            us(mt),
            fmt_opt(ratio(ot, mt), 2)
        );
        json_rows.push(json!({"kind": "latency", "ranks": 2, "transport": "shm", "bytes": 4096,
            "ours_time_s": ot, "ompi_time_s": mt, "ours_over_ompi_time": ratio(ot, mt)}));
    }
    if !wrong_notes.is_empty() {
        let _ = writeln!(text, "\nWRONG RESULTS (marked !):");
        for n in &wrong_notes {
            let _ = writeln!(text, "  {n}");
        }
    }
    let _ = writeln!(text, "\nbusbw = bytes/time · 2(n−1)/n; compare ratios within this run only (2-core machine).");
    crate::util::finish_report(
        &mut cx.raw,
        &dir.join(format!("vs-peers-{stamp}.txt")),
        &text,
        &json_rows,
        cx.args.json,
    )?;
    eprintln!("raw results: {}", raw_path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip() {
        for (s, b) in [
            ("4KiB", 4096),
            ("64KiB", 65536),
            ("1MiB", 1 << 20),
            ("256MiB", 256 << 20),
            ("1048576", 1 << 20),
            ("16M", 16 << 20),
        ] {
            assert_eq!(parse_size(s).expect("parse"), b, "{s}");
        }
        assert_eq!(format_size(4096), "4KiB");
        assert_eq!(format_size(1 << 20), "1MiB");
        assert_eq!(format_size(1 << 30), "1GiB");
        assert_eq!(format_size(6144), "6KiB");
        assert_eq!(format_size(100), "100B");
        assert!(parse_size("3").is_err());
        assert!(parse_size("1XB").is_err());
    }

    #[test]
    fn counts_match_peer_table() {
        assert_eq!(iteration_counts(4096), (20, 300));
        assert_eq!(iteration_counts(64 << 10), (20, 300));
        assert_eq!(iteration_counts(1 << 20), (10, 100));
        assert_eq!(iteration_counts(16 << 20), (3, 30));
        assert_eq!(iteration_counts(64 << 20), (2, 12));
        assert_eq!(iteration_counts(256 << 20), (2, 7));
        assert_eq!(plan_arg(&[4096, 1 << 20]), "4096:20:300,1048576:10:100");
    }

    #[test]
    fn parses_ours_contract_rows() {
        let out = "starting 2 ranks\n\
            {\"op\":\"allreduce\",\"ranks\":2,\"transport\":\"shm\",\"algo\":\"ring\",\"dtype\":\"f32\",\"bytes\":4096,\"time_s\":3.1e-6,\"algbw_GBps\":1.3,\"busbw_GBps\":1.3,\"wrong\":0}\n\
            {\"op\":\"allreduce\",\"ranks\":2,\"transport\":\"shm\",\"algo\":\"ring\",\"dtype\":\"f32\",\"bytes\":1048576,\"time_s\":2e-4,\"algbw_GBps\":5.2,\"busbw_GBps\":5.2,\"wrong\":3}\n\
            {\"op\":\"broadcast\",\"bytes\":1,\"time_s\":1,\"busbw_GBps\":1}\n\
            not json {\n";
        let (pts, missing) = parse_rows(out, &OURS_KEYS);
        assert!(missing.is_empty(), "{missing:?}");
        assert_eq!(pts.len(), 2);
        assert_eq!(pts[0].bytes, 4096);
        assert_eq!(pts[0].algo.as_deref(), Some("ring"));
        assert_eq!(pts[1].wrong, 3);
        assert!((pts[1].busbw - 5.2).abs() < 1e-12);
    }

    #[test]
    fn parses_peer_rows_and_reports_missing_keys() {
        let peer = r#"{"peer": "ompi", "ranks": 2, "transport": "tcp", "bytes": 16777216, "time_s": 0.01, "algbw_GBps": 1.67, "busbw_GBps": 1.67, "wrong": 0, "warmup": 3, "iters": 30}"#;
        let (pts, missing) = parse_rows(peer, &[]);
        assert_eq!(pts.len(), 1);
        assert!(missing.is_empty());
        let (pts, missing) = parse_rows(peer, &OURS_KEYS);
        assert_eq!(pts.len(), 1);
        assert_eq!(missing, vec!["op", "algo", "dtype"]);
    }

    #[test]
    fn medians() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&mut []), None);
    }
}
