//! A job's own program (`train.command`) as one rank: any framework's training script on the platform.
//!
//! The worker process stays as the program's supervisor, so the job is run, watched and recovered as a built-in
//! one is:
//! - it meets the other ranks through the rendezvous store (rank 0 hosting it when the launcher asks), where every
//!   rank publishes a `host:port` it reserved for its framework; the program is started with the environment
//!   contract the launcher wrote (torchrun's names among them) and the frameworks' part of it
//!   ([`shoal_comm::env::framework_vars`]: `TF_CONFIG`, `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` /
//!   `JAX_PROCESS_ID`);
//! - every line the program prints goes on to the task's log, and a line that is a JSON object with an integer
//!   `step` is a metrics line: written to the rank's metrics file (with `rank` and `unix_ms` added when absent),
//!   where the server ingests it for the job's page, `/metrics` and diagnosis — or, when it holds `eval_loss` or
//!   `eval_accuracy` and no `loss`, to rank 0's `eval.jsonl`;
//! - on the platform it sends heartbeats: the rank's phase is `train` from the program's first metrics line on,
//!   its step the last one printed, so a program that stops making steps is found hung as a built-in job is;
//! - the rank exits with the program's status (a program killed by a signal: 128 + the signal), and rank 0 writes
//!   `summary.json` with the last step, loss and evaluation the program printed.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shoal_comm::env::EnvContract;
use shoal_comm::{Communicator, Store};

use super::heartbeat::{Beat, Phase};
use super::report::write_json;
use super::wire::{Summary, metrics_file};
use crate::error::{Error, Result};
use crate::spec::JobSpec;

/// Runs this rank of a job whose workers run `train.command`, its files in `output` (appended to when
/// `resume`); rank 0 returns the summary.
pub(super) fn run(spec: &JobSpec, output: &Path, resume: bool) -> Result<Option<Summary>> {
    let started = Instant::now();
    let env = EnvContract::from_env()?;
    let link = super::setup::server_link(&env);
    let (attempt, task_rank, generation) = (env.attempt, env.task_rank, env.generation);
    let comm = env.connect()?;
    std::fs::create_dir_all(output).map_err(|e| Error::io(format!("creating {}", output.display()), e))?;
    let beat = attempt.and_then(|a| Beat::start(comm.clone(), task_rank, a, generation, output, link));
    let ran = supervise(spec, output, resume, &comm, beat.as_ref(), started);
    if let (Err(e), Some(b)) = (&ran, &beat) {
        b.fail(&e.to_string());
    }
    ran
}

/// A free port for the framework on `ip`, below the kernel's ephemeral range: the port is released before the
/// program binds it, and a port there is never handed out to another process's `bind(0)` or outgoing connection
/// meanwhile. Candidates start at a place drawn from the job and rank, so the ranks of one host seldom collide;
/// without such a port, one from the ephemeral range.
fn framework_port(ip: std::net::IpAddr, key: &str) -> Result<u16> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|w| w.parse::<u16>().ok()))
        .unwrap_or(32768);
    let (first, span) = (10_000u16, low.saturating_sub(10_000));
    if span > 0 {
        let start =
            shoal_data::rng::SplitMix64::from_key(&[key.bytes().fold(0u64, |h, b| h.wrapping_mul(131) ^ u64::from(b))])
                .next_u64()
                % u64::from(span);
        for k in 0..u64::from(span).min(512) {
            let port = first + ((start + k) % u64::from(span)) as u16;
            if std::net::TcpListener::bind((ip, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    let listener = std::net::TcpListener::bind((ip, 0))
        .map_err(|e| Error::io(format!("reserving a port on {ip} for the framework"), e))?;
    Ok(listener.local_addr().map_err(|e| Error::io("reading the framework's port", e))?.port())
}

/// Every rank's `host:port` for its framework, in rank order: each reserves a free port where its peers reach it.
fn framework_addresses(comm: &Communicator) -> Result<Vec<String>> {
    let cfg = comm.config();
    let port = framework_port(cfg.advertise, &format!("{}/{}", cfg.name, comm.rank()))?;
    let mine = std::net::SocketAddr::new(cfg.advertise, port).to_string();
    let key = |r: usize| format!("{}/framework/{r}", cfg.name);
    let store: &dyn Store = comm.store().as_ref();
    store.set(&key(comm.rank()), mine.as_bytes())?;
    (0..comm.size())
        .map(|r| {
            let v = store.get(&key(r), cfg.timeout)?;
            String::from_utf8(v).map_err(|e| Error::InvalidArgument(format!("rank {r}'s framework address: {e}")))
        })
        .collect()
}

/// What the program printed last, for the summary.
#[derive(Default)]
struct Seen {
    step: Option<u64>,
    loss: Option<f64>,
    eval_loss: Option<f64>,
    eval_accuracy: Option<f64>,
    lines: u64,
}

/// Starts the program, passes its output on, keeps its metrics, and waits for it.
fn supervise(
    spec: &JobSpec,
    output: &Path,
    resume: bool,
    comm: &Communicator,
    beat: Option<&Beat>,
    started: Instant,
) -> Result<Option<Summary>> {
    let (rank, world) = (comm.rank(), comm.size());
    let addresses = framework_addresses(comm)?;
    let program = &spec.train.command[0];
    if rank == 0 {
        eprintln!("train.command: {} on {world} worker(s)", spec.train.command.join(" "));
    }
    let mut child = Command::new(program)
        .args(&spec.train.command[1..])
        .envs(shoal_comm::env::framework_vars(rank, &addresses))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| Error::io(format!("starting train.command[0] `{program}`"), e))?;
    let out = child.stdout.take().ok_or_else(|| Error::InvalidArgument("the program has no stdout".into()))?;
    let seen = pass_on(out, output, rank, resume, beat)?;
    let status = child.wait().map_err(|e| Error::io(format!("waiting for `{program}`"), e))?;
    use std::os::unix::process::ExitStatusExt;
    let (code, how) = match (status.code(), status.signal()) {
        (Some(0), _) => (0, String::new()),
        (Some(c), _) => (c, format!("exited with status {c}")),
        (None, Some(s)) => (128 + s, format!("was killed by signal {s}")),
        (None, None) => (1, "ended without a status".to_string()),
    };
    if code != 0 {
        return Err(Error::Program { program: program.clone(), code, how });
    }
    if rank != 0 {
        return Ok(None);
    }
    let elapsed = started.elapsed();
    let summary = summary(spec, world, &seen, elapsed);
    write_json(&output.join("summary.json"), &summary)?;
    Ok(Some(summary))
}

/// Passes the program's lines on to this process's stdout (the task's log) and keeps its metrics lines.
fn pass_on(out: impl std::io::Read, output: &Path, rank: usize, resume: bool, beat: Option<&Beat>) -> Result<Seen> {
    let open = |path: &Path| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(resume)
            .write(true)
            .truncate(!resume)
            .open(path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))
    };
    let mut metrics = open(&metrics_file(output, rank))?;
    let mut evals = if rank == 0 { Some(open(&output.join("eval.jsonl"))?) } else { None };
    let mut seen = Seen::default();
    let mut reader = BufReader::new(out);
    let mut line = Vec::new();
    let stdout = std::io::stdout();
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line).map_err(|e| Error::io("reading the program's output", e))?;
        if n == 0 {
            return Ok(seen);
        }
        // The log gets every byte; a closed stdout must not stop the program's supervision.
        let mut log = stdout.lock();
        let _ = log.write_all(&line).and_then(|()| log.flush());
        drop(log);
        let Ok(serde_json::Value::Object(mut m)) = serde_json::from_slice::<serde_json::Value>(&line) else {
            continue;
        };
        let Some(step) = m.get("step").and_then(serde_json::Value::as_u64) else { continue };
        let num =
            |m: &serde_json::Map<String, serde_json::Value>, k: &str| m.get(k).and_then(serde_json::Value::as_f64);
        let (loss, eval_loss, eval_accuracy) = (num(&m, "loss"), num(&m, "eval_loss"), num(&m, "eval_accuracy"));
        let is_eval = m.get("loss").is_none() && (eval_loss.is_some() || eval_accuracy.is_some());
        m.entry("rank").or_insert(rank.into());
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or(Duration::ZERO);
        m.entry("unix_ms").or_insert((now.as_millis() as u64).into());
        let text = serde_json::Value::Object(m).to_string();
        let file = match (is_eval, evals.as_mut()) {
            (true, Some(f)) => Some(f),
            (true, None) => None,
            (false, _) => Some(&mut metrics),
        };
        if let Some(f) = file {
            writeln!(f, "{text}").map_err(|e| Error::io("writing the program's metrics", e))?;
        }
        seen.lines += 1;
        if is_eval {
            seen.eval_loss = eval_loss.or(seen.eval_loss);
            seen.eval_accuracy = eval_accuracy.or(seen.eval_accuracy);
            continue;
        }
        seen.step = Some(step);
        seen.loss = loss.or(seen.loss);
        if let Some(b) = beat {
            b.phase(Phase::Train);
            b.step(step);
        }
    }
}

fn summary(spec: &JobSpec, world: usize, seen: &Seen, elapsed: Duration) -> Summary {
    Summary {
        steps: seen.step.unwrap_or(0) as usize,
        final_loss: seen.loss.filter(|l| l.is_finite()),
        eval_loss: seen.eval_loss.unwrap_or(f64::NAN),
        eval_accuracy: seen.eval_accuracy,
        command: spec.train.command.clone(),
        metrics_lines: seen.lines,
        ..Summary::bare(&spec.name, "command", "", world, Default::default(), elapsed.as_secs_f64())
    }
}
