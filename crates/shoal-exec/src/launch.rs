//! The attached launcher: starts N ranks of a command as children of this process, with the environment contract,
//! hosts the rendezvous store they meet at, passes on their output line by line with the rank, and supervises them
//! as one gang. `shoal run` and `shoal bench` use it: where the local executor's tasks outlive the server that
//! started them, these ranks live and die with their launcher.
//!
//! Guarantees:
//! - No orphans. Every rank gets `PR_SET_PDEATHSIG = SIGKILL` (checked against a
//!   launcher that died before the call took effect) and runs in its own process
//!   group, and every signal the launcher sends goes to the whole group, so a
//!   rank's own children (`sh -c 'a & b'`) are stopped with it. The launcher is a
//!   child subreaper: a grandchild that left its group (`setsid`) is re-parented
//!   to it when its parent dies, and is killed when the launch ends. When `launch`
//!   returns, every rank's group has been sent SIGKILL and every re-parented
//!   descendant has been killed and reaped. A launcher that dies without cleaning
//!   up (SIGKILL, the OOM killer) takes the ranks with it through the death
//!   signal, and a small guard process it forked at the start (see [`Guard`])
//!   sees it gone and SIGKILLs every rank's group, which takes the ranks'
//!   children too. Only descendants that left their rank's group (`setsid`)
//!   survive that case.
//! - The first rank that fails is named with its exit status. What happens to
//!   the survivors is the caller's [`Policy`]: either they get a grace period to
//!   report their own errors (which name the missing rank) before SIGKILL
//!   ([`OnFailure::WaitThenKill`], `shoal bench`), or they get SIGTERM at once and
//!   SIGKILL after the grace ([`OnFailure::Terminate`], `shoal run`).
//! - SIGINT or SIGTERM to the launcher is forwarded to every rank's group; after
//!   the interrupt grace, or at a second signal, the groups get SIGKILL.
//! - Supervision never starves: a rank that prints without pause still gets its
//!   exit noticed and signals forwarded within tens of milliseconds; output that
//!   is not UTF-8 is passed on (lossily) rather than left blocking the rank.

use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use shoal_comm::StoreServer;

use crate::error::{ExecError, Result, SpawnError};
use crate::executor::set_env;
use crate::procfs::{children_of, describe};

/// How many interrupting signals arrived, and the last one.
static SIGNALS: AtomicUsize = AtomicUsize::new(0);
static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    LAST_SIGNAL.store(sig, Ordering::SeqCst);
    SIGNALS.fetch_add(1, Ordering::SeqCst);
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
    /// Where these ranks sit among the launchers of several hosts; `None`: this launcher runs the whole job.
    pub nodes: Option<Nodes>,
}

/// One launcher of several, one per host (`shoal run --nnodes N --node-rank R --rdzv HOST:PORT`): node 0 hosts the
/// rendezvous store at `rendezvous`, every node starts `ranks` ranks numbered from `rank * ranks`, and a rank that
/// fails on one node stops the job on every node, named there too.
#[derive(Debug, Clone)]
pub struct Nodes {
    /// How many launchers (hosts) the job spans.
    pub count: usize,
    /// This launcher's place among them, from 0.
    pub rank: usize,
    /// `HOST:PORT` of the rendezvous store, hosted by node 0's launcher (which listens on every address at PORT).
    pub rendezvous: String,
    /// The secret every node shares (each launcher must be given the same one).
    pub secret: String,
}

impl Nodes {
    /// A job name every host derives alike (`PREFIX-HOST-PORT` of the rendezvous), since they share no other.
    pub fn job_id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.rendezvous.replace([':', '[', ']'], "-"))
    }

    /// The rendezvous address split into host and port.
    pub fn host_port(&self) -> Result<(String, u16)> {
        let bad = || ExecError::Config(format!("--rdzv {:?}: expected HOST:PORT", self.rendezvous));
        let (host, port) = self.rendezvous.rsplit_once(':').ok_or_else(bad)?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port: u16 = port.parse().map_err(|_| bad())?;
        if host.is_empty() || port == 0 || port == u16::MAX {
            return Err(bad());
        }
        Ok((host.to_owned(), port))
    }
}

/// Store key under which the first launcher whose rank failed says so, for the launchers of the other nodes: the
/// value is `NODE<tab>what happened`.
const FAILED_KEY: &str = "launch/failed";
/// How long a launcher of several waits, at its end, for its own failure report to reach the store.
const REPORT_GRACE: Duration = Duration::from_secs(3);
/// How often a launcher of several looks for another node's failure.
const PEER_POLL: Duration = Duration::from_millis(200);

/// What the launcher does to the surviving ranks when one fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// Leave them running for the grace period (they notice the loss and report
    /// it themselves), then SIGKILL.
    WaitThenKill,
    /// SIGTERM at once, SIGKILL after the grace period.
    Terminate,
}

/// How the launcher stops ranks.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub on_failure: OnFailure,
    /// After SIGINT/SIGTERM was forwarded: how long to wait before SIGKILL.
    pub interrupt_grace: Duration,
}

impl Default for Policy {
    /// What `launch` uses (and `shoal bench` relies on).
    fn default() -> Self {
        Policy { on_failure: OnFailure::WaitThenKill, interrupt_grace: Duration::from_secs(5) }
    }
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
    /// This launcher's ranks, in order: `statuses[i]` is rank `first_rank + i`.
    pub statuses: Vec<Option<ExitStatus>>,
    /// The (global) rank of `statuses[0]`: 0 unless this is one node of several.
    pub first_rank: usize,
    /// The first rank of this launcher that failed (its global rank), with a description of how (`describe`).
    /// Ranks the launcher itself signalled are never named here.
    pub first_failure: Option<(usize, String)>,
    /// What another node's launcher reported when one of its ranks failed first (this node's ranks were then
    /// stopped): `rank R on node N exited with status C`.
    pub peer_failure: Option<String>,
    pub interrupted: bool,
    /// The signal that interrupted the launcher (SIGINT or SIGTERM), if any.
    pub interrupt_signal: Option<i32>,
}

/// Where job secrets come from.
const RANDOM_SOURCE: &str = "/dev/urandom";

/// A fresh random job secret (hex), from [`RANDOM_SOURCE`]; an error when it cannot be read, never a weak secret.
pub fn new_secret() -> Result<String> {
    secret_from(std::path::Path::new(RANDOM_SOURCE))
}

/// 16 bytes of `source`, in hex.
fn secret_from(source: &std::path::Path) -> Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open(source).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b)).map_err(|e| {
        ExecError::io(format!("reading {} bytes of {} for the job secret", b.len(), source.display()), e)
    })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Launches the ranks with the default [`Policy`] and calls `on_line` for every
/// line they print, on this thread, until all have exited.
pub fn launch(spec: &LaunchSpec, on_line: impl FnMut(&Line)) -> Result<Outcome> {
    launch_with(spec, Policy::default(), on_line)
}

/// Sends `sig` to rank's process group (its pgid is its pid, and stays reserved
/// while any member of the group lives, even after the rank was reaped).
fn signal_group(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a process group we created; ESRCH (group gone) is fine.
    unsafe { libc::kill(-(pid as i32), sig) };
}

/// Launches the ranks and calls `on_line` for every line they print, on this
/// thread, until all have exited. Fails (with a [`SpawnError`] in the chain) only
/// if a rank cannot be started, after stopping those already started.
pub fn launch_with(spec: &LaunchSpec, policy: Policy, mut on_line: impl FnMut(&Line)) -> Result<Outcome> {
    // Before anything is installed or started, so that a failure leaves nothing to undo.
    let secret = match &spec.nodes {
        Some(n) if n.secret.is_empty() => {
            return Err(ExecError::Config("a launch over several nodes needs their shared secret".into()));
        }
        Some(n) => n.secret.clone(),
        None => new_secret()?,
    };
    let node = spec.nodes.as_ref().map(|n| n.host_port().map(|hp| (n, hp))).transpose()?;
    // SAFETY: installing handlers that only store to atomics; making this process
    // the reaper of its orphaned descendants (see the module comment).
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
    let seen_signals = SIGNALS.load(Ordering::SeqCst);
    let guard = Guard::start();
    // One node of several: node 0 hosts the store where every node was told to meet, on every address of its
    // host (the rendezvous address is how the others reach it); the others host nothing.
    let (store, addr, master_addr, master_port, first_rank, world) = match node {
        None => {
            let store = StoreServer::bind("127.0.0.1:0", secret.clone().into_bytes())
                .map_err(|e| ExecError::Config(format!("starting the rendezvous store: {e}")))?;
            let addr = store.local_addr().to_string();
            (Some(store), addr, "127.0.0.1".to_owned(), shoal_comm::env::free_port().unwrap_or(29500), 0, spec.ranks)
        }
        Some((n, (host, port))) => {
            let store = if n.rank == 0 {
                let s = StoreServer::bind(("0.0.0.0", port), secret.clone().into_bytes()).map_err(|e| {
                    ExecError::Config(format!("node 0 hosting the rendezvous store at port {port} (--rdzv): {e}"))
                })?;
                Some(s)
            } else {
                None
            };
            // PyTorch's store (MASTER_PORT) is rank 0's, next to ours: the same on every node without a word
            // between them.
            (store, n.rendezvous.clone(), host, port + 1, n.rank * spec.ranks, n.count * spec.ranks)
        }
    };
    let peers = spec.nodes.as_ref().map(|n| PeerWatch::start(n, &secret));
    let (tx, rx) = mpsc::channel::<Line>();
    let mut children: Vec<Child> = Vec::with_capacity(spec.ranks);
    // SAFETY: getpid(2) cannot fail.
    let launcher = unsafe { libc::getpid() };
    for local in 0..spec.ranks {
        let rank = first_rank + local;
        let contract = shoal_comm::env::TaskEnv {
            job_id: spec.job_id.clone(),
            rank,
            world_size: world,
            local_rank: local,
            local_world_size: spec.ranks,
            rendezvous: addr.clone(),
            secret: secret.clone(),
            master_addr: master_addr.clone(),
            master_port,
            ..Default::default()
        };
        let mut cmd = Command::new(&spec.program);
        set_env(&mut cmd, &contract, &spec.env);
        cmd.args(&spec.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group: signals reach the rank's children too, and a
            // Ctrl-C on the terminal reaches only the launcher, which forwards it.
            .process_group(0);
        // SAFETY: prctl, getppid and _exit are async-signal-safe. The death signal
        // makes the kernel kill the child if the launcher dies, so no rank outlives
        // it; if the launcher died before the call, the parent is no longer it.
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() != launcher {
                    libc::_exit(137);
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for c in &children {
                    signal_group(c.id(), libc::SIGKILL);
                }
                for c in children.iter_mut() {
                    let _ = c.wait();
                }
                if let Some(g) = guard {
                    g.disarm();
                }
                reap_descendants();
                return Err(SpawnError { rank, program: spec.program.clone(), source: e }.into());
            }
        };
        for (stderr, pipe) in [
            (false, child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>)),
            (true, child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>)),
        ] {
            let Some(pipe) = pipe else { continue };
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(pipe);
                let mut buf = Vec::new();
                loop {
                    buf.clear();
                    match r.read_until(b'\n', &mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                    if buf.last() == Some(&b'\n') {
                        buf.pop();
                        if buf.last() == Some(&b'\r') {
                            buf.pop();
                        }
                    }
                    let text = String::from_utf8_lossy(&buf).into_owned();
                    if tx.send(Line { rank, stderr, text }).is_err() {
                        break;
                    }
                }
            });
        }
        if let Some(g) = &guard {
            g.watch(child.id());
        }
        children.push(child);
    }
    drop(tx);

    let mut statuses: Vec<Option<ExitStatus>> = vec![None; spec.ranks];
    // Whether the launcher had signalled a rank before its exit was seen.
    let mut signalled = vec![false; spec.ranks];
    let mut any_signalled = false;
    let mut first_failure: Option<(usize, String)> = None;
    let mut kill_at: Option<Instant> = None;
    let mut interrupted = false;
    let mut interrupt_signal = None;
    let mut handled_signals = seen_signals;
    let mut pipes_open = true;
    let mut peer_failure: Option<String> = None;
    loop {
        // Pass on output for at most ~20 ms, then look at the ranks.
        let slice = Instant::now() + Duration::from_millis(20);
        if pipes_open {
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(line) => {
                    on_line(&line);
                    while Instant::now() < slice {
                        match rx.try_recv() {
                            Ok(line) => on_line(&line),
                            Err(TryRecvError::Empty) => break,
                            Err(TryRecvError::Disconnected) => {
                                pipes_open = false;
                                break;
                            }
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => pipes_open = false,
            }
        } else {
            std::thread::sleep(Duration::from_millis(20));
        }
        for (local, child) in children.iter_mut().enumerate() {
            if statuses[local].is_some() {
                continue;
            }
            if let Ok(Some(st)) = child.try_wait() {
                statuses[local] = Some(st);
                if !st.success() && first_failure.is_none() && !signalled[local] && peer_failure.is_none() {
                    first_failure = Some((first_rank + local, describe(&st)));
                    if let (Some(p), Some(n)) = (&peers, &spec.nodes) {
                        p.report(&format!("rank {} on node {} ended: {}", first_rank + local, n.rank, describe(&st)));
                    }
                    if !interrupted {
                        kill_at = Some(Instant::now() + spec.grace);
                    }
                }
            }
        }
        // Another node's rank failed first: this node's ranks are stopped as if one of its own had.
        if peer_failure.is_none()
            && first_failure.is_none()
            && !interrupted
            && let Some(why) = peers.as_ref().and_then(PeerWatch::failure)
        {
            for (r, c) in children.iter().enumerate() {
                signal_group(c.id(), libc::SIGTERM);
                signalled[r] |= statuses[r].is_none();
            }
            any_signalled = true;
            kill_at = Some(Instant::now() + spec.grace);
            peer_failure = Some(why);
        }
        // A rank failed: under `Terminate`, the survivors get SIGTERM now.
        if policy.on_failure == OnFailure::Terminate && first_failure.is_some() && !any_signalled && !interrupted {
            for (r, c) in children.iter().enumerate() {
                signal_group(c.id(), libc::SIGTERM);
                signalled[r] |= statuses[r].is_none();
            }
            any_signalled = true;
        }
        let now_signals = SIGNALS.load(Ordering::SeqCst);
        if now_signals != handled_signals {
            let sig = LAST_SIGNAL.load(Ordering::SeqCst);
            if !interrupted {
                // Forward it to every rank's group.
                interrupted = true;
                interrupt_signal = Some(sig);
                for (r, c) in children.iter().enumerate() {
                    signal_group(c.id(), sig);
                    signalled[r] |= statuses[r].is_none();
                }
                any_signalled = true;
                kill_at = Some(Instant::now() + policy.interrupt_grace);
            } else {
                // A second Ctrl-C: stop now.
                kill_at = Some(Instant::now());
            }
            handled_signals = now_signals;
        }
        if statuses.iter().all(Option::is_some) {
            break;
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for (r, c) in children.iter().enumerate() {
                signal_group(c.id(), libc::SIGKILL);
                signalled[r] |= statuses[r].is_none();
            }
            any_signalled = true;
            kill_at = None;
        }
    }
    // Whatever is left of the ranks' groups (background children) goes now, and
    // so do descendants that left their group and were re-parented to us; then
    // the pipes they held close.
    for c in &children {
        signal_group(c.id(), libc::SIGKILL);
    }
    if let Some(g) = guard {
        g.disarm();
    }
    reap_descendants();
    // Drain what is left in the pipes (bounded: a descendant we could not reach
    // may still hold one open).
    let drain_until = Instant::now() + Duration::from_secs(2);
    while let Ok(line) = rx.recv_timeout(Duration::from_millis(50)) {
        on_line(&line);
        if Instant::now() >= drain_until {
            break;
        }
    }
    // A rank killed by a signal (that the launcher did not send) is the cause;
    // the ranks that exited with an error after it were reporting its loss (they
    // may have been seen first).
    if !interrupted
        && let Some((r, st)) = statuses
            .iter()
            .enumerate()
            .find_map(|(r, s)| s.filter(|s| s.signal().is_some() && !signalled[r]).map(|s| (r, s)))
    {
        first_failure = Some((first_rank + r, describe(&st)));
    }
    if let Some(p) = peers {
        p.stop();
    }
    drop(store);
    Ok(Outcome { statuses, first_rank, first_failure, peer_failure, interrupted, interrupt_signal })
}

/// A launcher's link to the launchers of the other nodes, through the rendezvous store: a thread connects (the
/// store may start after this node's launcher), then looks every [`PEER_POLL`] for a failure reported by another
/// node, and passes on this node's first failure. Only that thread talks to the store: a store behind a cut link
/// makes its calls wait for their own deadlines, and the launcher's supervision must never wait with them.
struct PeerWatch {
    seen: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    /// This node's own report, until the thread has passed it on.
    pending: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl PeerWatch {
    fn start(nodes: &Nodes, secret: &str) -> PeerWatch {
        use std::sync::{Arc, Mutex, atomic::AtomicBool};
        let seen = Arc::new(Mutex::new(None));
        let pending: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let done = Arc::new(AtomicBool::new(false));
        let (addr, secret, node) = (nodes.rendezvous.clone(), secret.as_bytes().to_vec(), nodes.rank);
        let (se, pe, dn) = (seen.clone(), pending.clone(), done.clone());
        let _ = std::thread::Builder::new().name("shoal-launch-peers".into()).spawn(move || {
            use shoal_comm::Store;
            // Keep trying while the launch runs: node 0 may start after us.
            let client = loop {
                if dn.load(Ordering::SeqCst) {
                    return;
                }
                match shoal_comm::TcpStore::connect(&addr, &secret, Duration::from_secs(1)) {
                    Ok(c) => break c,
                    Err(_) => std::thread::sleep(PEER_POLL),
                }
            };
            loop {
                // This node's report goes out before the watch ends (`stop` waits for it, briefly).
                let mine = pe.lock().unwrap_or_else(|p| p.into_inner()).clone();
                if let Some(mine) = mine {
                    let _ = client.compare_set(FAILED_KEY, None, format!("{node}\t{mine}").as_bytes());
                    pe.lock().unwrap_or_else(|p| p.into_inner()).take();
                }
                if dn.load(Ordering::SeqCst) {
                    return;
                }
                if let Ok(Some(v)) = client.try_get(FAILED_KEY) {
                    let text = String::from_utf8_lossy(&v).into_owned();
                    let (from, what) = text.split_once('\t').unwrap_or(("", text.as_str()));
                    // Our own report is not another node's failure.
                    if from != node.to_string() {
                        *se.lock().unwrap_or_else(|p| p.into_inner()) = Some(what.to_owned());
                    }
                }
                std::thread::sleep(PEER_POLL);
            }
        });
        PeerWatch { seen, pending, done }
    }

    /// Tells the other nodes that this one's rank failed (the first report wins); never waits.
    fn report(&self, what: &str) {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some(what.to_owned());
    }

    /// Another node's failure, once one was reported.
    fn failure(&self) -> Option<String> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Ends the watch, waiting at most [`REPORT_GRACE`] for this node's own report to go out, never for the
    /// thread, which may sit in a store call to a host that no longer answers until that call's own deadline.
    fn stop(self) {
        self.done.store(true, Ordering::SeqCst);
        // This node's failure must reach the others: give the thread a moment to pass it on, never more.
        let until = Instant::now() + REPORT_GRACE;
        while self.pending.lock().unwrap_or_else(|p| p.into_inner()).is_some() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Kills and reaps every child of this process that is not a rank: descendants of
/// the ranks re-parented to us (we are their subreaper). Called once every rank
/// was reaped, so `waitpid` here takes nothing `Child` still waits for.
fn reap_descendants() {
    // SAFETY: getpid(2) cannot fail.
    let me = unsafe { libc::getpid() } as u32;
    // A dying parent hands its children over a moment later: look twice.
    for round in 0..2 {
        let mut found = false;
        for pid in children_of(me) {
            found = true;
            // SAFETY: kill(2) and waitpid(2) on our own child.
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
                libc::waitpid(pid as i32, std::ptr::null_mut(), 0);
            }
        }
        if round == 0 && found {
            std::thread::sleep(Duration::from_millis(20));
        } else if round == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The guard: a process forked from the launcher that holds the read end of a
/// pipe. The launcher writes every rank's pid (its process group) into it; if the
/// launcher dies without disarming it, the guard reads end-of-file and SIGKILLs
/// every group it was told of. On a normal end the launcher disarms it (a
/// negative pid) and reaps it, so a group id reused later is never signalled.
#[derive(Debug)]
struct Guard {
    pid: libc::pid_t,
    fd: libc::c_int,
}

/// How many rank groups the guard can remember (it allocates nothing).
const GUARD_SLOTS: usize = 4096;

impl Guard {
    /// Starts the guard; `None` (no guard, the rest still holds) if fork fails.
    fn start() -> Option<Guard> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 fills `fds`; the write end is close-on-exec, so ranks never
        // hold it and only the launcher's death or `disarm` closes it.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        // SAFETY: the child runs only async-signal-safe system calls and never
        // returns (the launcher may have threads already).
        match unsafe { libc::fork() } {
            -1 => {
                // SAFETY: closing the descriptors we just made.
                unsafe {
                    libc::close(fds[0]);
                    libc::close(fds[1]);
                }
                None
            }
            // SAFETY: see above.
            0 => unsafe { guard_main(fds[0]) },
            pid => {
                // SAFETY: the read end is the guard's.
                unsafe { libc::close(fds[0]) };
                Some(Guard { pid, fd: fds[1] })
            }
        }
    }

    fn send(&self, v: i32) {
        let b = v.to_ne_bytes();
        // SAFETY: writing 4 bytes from a live buffer to our pipe; a pipe write of
        // this size is atomic.
        unsafe { libc::write(self.fd, b.as_ptr().cast(), b.len()) };
    }

    fn watch(&self, pid: u32) {
        self.send(pid as i32);
    }

    fn disarm(self) {
        self.send(-1);
        // SAFETY: closing our end and reaping our own child.
        unsafe {
            libc::close(self.fd);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// The guard's whole life (in the forked child).
///
/// # Safety
/// Only in a freshly forked child: it closes every other descriptor and exits.
unsafe fn guard_main(rd: libc::c_int) -> ! {
    // SAFETY: async-signal-safe system calls only, on our own process.
    unsafe {
        // Ctrl-C and the launcher's SIGTERM are for the launcher; the guard
        // leaves when its pipe says so, in a group of its own.
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        libc::setpgid(0, 0);
        // Hold nothing of the launcher's open: its output pipes, the store socket.
        for fd in 0..1024 {
            if fd != rd {
                libc::close(fd);
            }
        }
        let mut groups = [0 as libc::pid_t; GUARD_SLOTS];
        let mut n = 0;
        let mut buf = [0u8; 4];
        let mut have = 0;
        loop {
            let r = libc::read(rd, buf.as_mut_ptr().add(have).cast(), 4 - have);
            if r == 0 {
                break; // the launcher is gone
            }
            if r < 0 {
                if *libc::__errno_location() == libc::EINTR {
                    continue;
                }
                break;
            }
            have += r as usize;
            if have == 4 {
                have = 0;
                let v = i32::from_ne_bytes(buf);
                if v < 0 {
                    libc::_exit(0); // disarmed: the launcher cleaned up itself
                }
                if n < GUARD_SLOTS && v > 0 {
                    groups[n] = v;
                    n += 1;
                }
            }
        }
        for &g in &groups[..n] {
            libc::kill(-g, libc::SIGKILL);
        }
        libc::_exit(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_fresh_hex_or_an_error_naming_its_source() {
        let (a, b) = (new_secret().expect("a secret"), new_secret().expect("a secret"));
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_ne!(a, b);
        for source in ["/nonexistent/urandom", "/dev/null"] {
            let e = secret_from(std::path::Path::new(source)).expect_err("no secret from it");
            assert!(e.to_string().contains(source), "{e}");
        }
    }
}
