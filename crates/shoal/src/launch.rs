//! The one launcher: starts N copies of a command with the environment contract,
//! hosts the rendezvous store they meet at, prefixes their output with the rank,
//! and supervises them. `shoal bench` uses it now; `shoal run` and the local
//! executor build on it.
//!
//! Guarantees: no orphans (every child gets `PR_SET_PDEATHSIG = SIGKILL`, and
//! the launcher kills the rest when one fails or on Ctrl-C); the first rank that
//! fails is named with its exit status; the surviving ranks get a grace period to
//! report their own errors (which name the missing rank) before they are killed.

use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use shoal_comm::StoreServer;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub program: std::path::PathBuf,
    pub args: Vec<String>,
    pub ranks: usize,
    pub job_id: String,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// Grace period for the survivors after a rank fails.
    pub grace: Duration,
}

/// One line a rank printed.
#[derive(Debug, Clone)]
pub struct Line {
    pub rank: usize,
    pub stderr: bool,
    pub text: String,
}

/// How a launch ended.
#[derive(Debug)]
pub struct Outcome {
    pub statuses: Vec<Option<ExitStatus>>,
    /// The first rank that failed, with a description of how.
    pub first_failure: Option<(usize, String)>,
    pub interrupted: bool,
}

pub fn describe(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("killed by signal {s}{}", if s == libc::SIGKILL { " (SIGKILL)" } else { "" }),
        _ => format!("{status}"),
    }
}

/// A fresh random job secret (hex).
pub fn new_secret() -> String {
    let mut b = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut b);
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Launches the ranks and calls `on_line` for every line they print, on this
/// thread, until all have exited.
pub fn launch(spec: &LaunchSpec, mut on_line: impl FnMut(&Line)) -> Result<Outcome> {
    // SAFETY: installing a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
    }
    let secret = new_secret();
    let store =
        StoreServer::bind("127.0.0.1:0", secret.clone().into_bytes()).context("starting the rendezvous store")?;
    let addr = store.local_addr().to_string();
    let master_port = free_port().unwrap_or(29500);
    let (tx, rx) = mpsc::channel::<Line>();
    let mut children: Vec<Child> = Vec::with_capacity(spec.ranks);
    for rank in 0..spec.ranks {
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .env("SHOAL_JOB_ID", &spec.job_id)
            .env("SHOAL_RANK", rank.to_string())
            .env("SHOAL_WORLD_SIZE", spec.ranks.to_string())
            .env("SHOAL_LOCAL_RANK", rank.to_string())
            .env("SHOAL_LOCAL_WORLD_SIZE", spec.ranks.to_string())
            .env("SHOAL_RENDEZVOUS", &addr)
            .env("SHOAL_JOB_SECRET", &secret)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", master_port.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", spec.ranks.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", spec.ranks.to_string())
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: prctl is async-signal-safe; it makes the kernel kill the child
        // if the launcher dies, so no rank outlives it.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut children);
                bail!("starting rank {rank} ({}): {e}", spec.program.display());
            }
        };
        for (stderr, pipe) in [
            (false, child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>)),
            (true, child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>)),
        ] {
            let Some(pipe) = pipe else { continue };
            let tx = tx.clone();
            std::thread::spawn(move || {
                for text in BufReader::new(pipe).lines().map_while(|l| l.ok()) {
                    if tx.send(Line { rank, stderr, text }).is_err() {
                        break;
                    }
                }
            });
        }
        children.push(child);
    }
    drop(tx);

    let mut statuses: Vec<Option<ExitStatus>> = vec![None; spec.ranks];
    let mut first_failure: Option<(usize, String)> = None;
    let mut kill_at: Option<Instant> = None;
    let mut interrupted = false;
    loop {
        while let Ok(line) = rx.recv_timeout(Duration::from_millis(20)) {
            on_line(&line);
        }
        for (rank, child) in children.iter_mut().enumerate() {
            if statuses[rank].is_some() {
                continue;
            }
            if let Ok(Some(st)) = child.try_wait() {
                statuses[rank] = Some(st);
                if !st.success() && first_failure.is_none() {
                    first_failure = Some((rank, describe(&st)));
                    kill_at = Some(Instant::now() + spec.grace);
                }
            }
        }
        if INTERRUPTED.swap(false, Ordering::SeqCst) && !interrupted {
            interrupted = true;
            for c in &children {
                // SAFETY: plain kill(2) on our own child.
                unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
            }
            kill_at = Some(Instant::now() + Duration::from_secs(5));
        }
        if statuses.iter().all(Option::is_some) {
            break;
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            kill_all(&mut children);
            kill_at = None;
        }
    }
    // Drain what is left in the pipes.
    while let Ok(line) = rx.recv_timeout(Duration::from_millis(50)) {
        on_line(&line);
    }
    // A rank killed by a signal is the cause; the ranks that exited with an
    // error after it were reporting its loss (they may have been seen first).
    if let Some((r, st)) = statuses
        .iter()
        .enumerate()
        .find_map(|(r, s)| s.filter(|s| s.signal().is_some() && !interrupted).map(|s| (r, s)))
    {
        first_failure = Some((r, describe(&st)));
    }
    drop(store);
    Ok(Outcome { statuses, first_failure, interrupted })
}

fn kill_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
    }
}

fn free_port() -> Option<u16> {
    std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok().map(|a| a.port())
}
