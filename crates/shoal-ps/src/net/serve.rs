//! A parameter server: one process's [`Shard`] behind a TCP listener. Each worker holds one authenticated
//! connection (the job secret, `shoal_comm::auth`) and is served by a thread of its own; the shard, the
//! synchronous mode's round and the staleness clocks sit under one lock, and a condition variable wakes the pulls
//! that wait for a version or for the slowest worker. Every wait is bounded by [`ServerConfig::wait`] and, when it
//! passes, answered with an error that names what it waited for (the workers missing from the round, the slowest
//! worker), never left hanging. The shard is saved through a [`Persist`] when the workers ask (at their
//! checkpoints), and a server started again resumes from the newest save.

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{PsError, Result};
use crate::net::proto::{Reply, Request, write_values};
use crate::net::shm::Segment;
use crate::optim::OptimConfig;
use crate::robust::Rule;
use crate::server::{Clocks, Mode, Round, Shard, Snapshot, check_spans};

/// Where shared-memory segments are made for workers on the server's host.
const SHM_DIR: &str = "/dev/shm";

/// Where a server's shard is saved and found again (a checkpoint directory, in the trainer).
pub trait Persist: Send + Sync {
    /// Saves `snapshot`.
    fn save(&self, snapshot: &Snapshot) -> Result<()>;
    /// The newest valid save, if any.
    fn load(&self) -> Result<Option<Snapshot>>;
}

/// How a server runs.
#[derive(Clone)]
pub struct ServerConfig {
    /// This server's index among `servers`.
    pub index: usize,
    pub servers: usize,
    /// How many workers push to it.
    pub workers: usize,
    pub mode: Mode,
    pub optim: OptimConfig,
    /// How the synchronous mode combines a round's pushes, bearing `f` attackers.
    pub rule: Rule,
    pub f: usize,
    /// The longest a request waits (for a round to complete, for the slowest worker), and the longest the server
    /// waits without hearing from any worker before it gives up.
    pub wait: Duration,
    /// The job secret every worker proves it holds.
    pub secret: Vec<u8>,
    /// `[chaos]`, an experiment: the workers whose pushes each synchronous round forges, and how.
    pub attack: Option<(crate::Attack, Vec<usize>)>,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("index", &self.index)
            .field("servers", &self.servers)
            .field("workers", &self.workers)
            .field("mode", &self.mode)
            .field("optim", &self.optim)
            .field("rule", &self.rule)
            .field("f", &self.f)
            .field("wait", &self.wait)
            .field("attack", &self.attack)
            .finish_non_exhaustive()
    }
}

/// What a server did, when it ends.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServeReport {
    /// The shard's version at the end.
    pub version: u64,
    /// Pushes and pulls served, and the bytes of values they moved.
    pub pushes: u64,
    pub pulls: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Whether the server started from a save of its own.
    pub restored: bool,
}

struct State {
    shard: Option<Shard>,
    round: Option<Round>,
    clocks: Clocks,
    done: Vec<bool>,
    /// A worker's connection is open.
    connected: Vec<bool>,
    /// Started from a save: the synchronous mode takes the workers' version as its own at their first push.
    restored: bool,
    report: ServeReport,
    heard: Instant,
}

struct Shared {
    cfg: ServerConfig,
    state: Mutex<State>,
    changed: Condvar,
    persist: Option<Arc<dyn Persist>>,
    stop: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A parameter server, bound and ready to serve.
pub struct Server {
    listener: TcpListener,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("listener", &self.listener).field("index", &self.shared.cfg.index).finish()
    }
}

impl Server {
    /// A server on `listener`, resuming from `persist`'s newest save when there is one.
    pub fn new(listener: TcpListener, cfg: ServerConfig, persist: Option<Arc<dyn Persist>>) -> Result<Server> {
        cfg.rule.check(cfg.workers, cfg.f)?;
        let mut clocks = Clocks::new(cfg.workers, cfg.mode.staleness());
        let mut report = ServeReport::default();
        let shard = match persist.as_ref().map(|p| p.load()).transpose()?.flatten() {
            Some(s) => {
                tracing::info!(
                    server = cfg.index,
                    version = s.version,
                    step = s.step,
                    "resuming from the shard's save"
                );
                clocks.restore(&s.clocks);
                report.restored = true;
                report.version = s.version;
                Some(Shard::with_state(s.values, cfg.optim, s.m, s.v, s.version)?)
            }
            None => None,
        };
        let state = State {
            shard,
            round: None,
            clocks,
            done: vec![false; cfg.workers],
            connected: vec![false; cfg.workers],
            restored: report.restored,
            report,
            heard: Instant::now(),
        };
        listener.set_nonblocking(true).map_err(|e| shoal_comm::Error::io("making the server's listener poll", e))?;
        Ok(Server {
            listener,
            shared: Arc::new(Shared {
                cfg,
                state: Mutex::new(state),
                changed: Condvar::new(),
                persist,
                stop: false.into(),
            }),
        })
    }

    /// A handle that stops the server at once, as a crash would (nothing more is saved), for tests of restarts.
    pub fn killer(&self) -> Killer {
        Killer(self.shared.clone())
    }

    /// Serves until every worker has said it is done, or until no worker
    /// has been heard from for [`ServerConfig::wait`] (an error naming the workers not done).
    pub fn run(self) -> Result<ServeReport> {
        let shared = self.shared.clone();
        let mut threads = Vec::new();
        let poll = Duration::from_millis(10);
        let outcome = loop {
            if shared.stop.load(Ordering::SeqCst) {
                break Err(PsError::Server(format!("server {} was stopped", shared.cfg.index)));
            }
            match self.listener.accept() {
                Ok((stream, addr)) => {
                    let s = shared.clone();
                    let spawned = std::thread::Builder::new()
                        .name("shoal-ps-conn".into())
                        .spawn(move || serve_connection(&s, stream, addr.to_string()));
                    match spawned {
                        Ok(t) => threads.push(t),
                        Err(e) => tracing::warn!(error = %e, "no thread for a worker's connection"),
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let st = shared.lock();
                    if st.done.iter().all(|&d| d) {
                        break Ok(());
                    }
                    if st.heard.elapsed() > shared.cfg.wait {
                        let waiting: Vec<usize> = (0..st.done.len()).filter(|&w| !st.done[w]).collect();
                        break Err(PsError::Server(format!(
                            "server {}: no worker was heard from for {:?}; workers {waiting:?} had not finished",
                            shared.cfg.index, shared.cfg.wait
                        )));
                    }
                    let (st, _) =
                        shared.changed.wait_timeout(st, poll).unwrap_or_else(std::sync::PoisonError::into_inner);
                    drop(st);
                }
                Err(e) => break Err(PsError::Comm(shoal_comm::Error::io("accepting a worker's connection", e))),
            }
        };
        shared.stop.store(true, Ordering::SeqCst);
        shared.changed.notify_all();
        for t in threads {
            let _ = t.join();
        }
        outcome?;
        let st = shared.lock();
        Ok(ServeReport { version: st.shard.as_ref().map_or(0, |s| s.version), ..st.report.clone() })
    }
}

/// Stops a running [`Server`] abruptly ([`Server::killer`]).
#[derive(Clone)]
pub struct Killer(Arc<Shared>);

impl std::fmt::Debug for Killer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Killer").field(&self.0.cfg.index).finish()
    }
}

impl Killer {
    pub fn kill(&self) {
        self.0.stop.store(true, Ordering::SeqCst);
        self.0.changed.notify_all();
    }
}

fn snapshot(cfg: &ServerConfig, shard: &Shard, clocks: &Clocks, step: u64) -> Snapshot {
    let (m, v) = shard.moments();
    Snapshot {
        server: cfg.index,
        servers: cfg.servers,
        step,
        version: shard.version,
        values: shard.values.clone(),
        m: m.to_vec(),
        v: v.to_vec(),
        clocks: clocks.clocks().iter().map(|&c| c.min(u64::MAX / 4)).collect(),
    }
}

/// One worker's connection: the handshake (whose hello is the worker's index), then requests until it closes.
fn serve_connection(shared: &Shared, mut stream: TcpStream, addr: String) {
    let cfg = &shared.cfg;
    let set_up = (|| -> Result<usize> {
        stream.set_nonblocking(false).map_err(|e| shoal_comm::Error::io("configuring a worker's connection", e))?;
        let _ = shoal_comm::tcp::tune(&stream);
        let _ = stream.set_read_timeout(Some(cfg.wait));
        let _ = stream.set_write_timeout(Some(cfg.wait));
        let hello = shoal_comm::auth::accept(&mut stream, &cfg.secret, &addr)?;
        let w = <[u8; 4]>::try_from(hello.as_slice())
            .map(u32::from_le_bytes)
            .map_err(|_| PsError::Server(format!("a connection from {addr} did not say which worker it is")))?
            as usize;
        if w >= cfg.workers {
            return Err(PsError::Server(format!("worker {w} connected to a server of {} workers", cfg.workers)));
        }
        Ok(w)
    })();
    let worker = match set_up {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(server = cfg.index, peer = %addr, error = %e, "a connection was refused");
            return;
        }
    };
    // Poll for the stop flag between requests without giving up on a quiet worker.
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let peer = format!("worker {worker} ({addr})");
    {
        let mut st = shared.lock();
        st.connected[worker] = true;
        st.heard = Instant::now();
    }
    tracing::debug!(server = cfg.index, worker, "connected");
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let mut seg: Option<Segment> = None;
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let mut peek = [0u8; 1];
        match stream.peek(&mut peek) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(_) => break,
        }
        let _ = stream.set_read_timeout(Some(cfg.wait));
        let req = match Request::read(&mut stream, std::mem::take(&mut buf), &peer) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(server = cfg.index, worker, error = %e, "a request could not be read; closing");
                break;
            }
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        let done = matches!(req, Request::Done);
        let reply = match handle(shared, worker, req, &mut out, &mut buf, &mut seg, &mut stream, &peer) {
            Ok(Some(r)) => r,
            // Sent already, from the shard itself.
            Ok(None) => continue,
            Err(e) => Reply::Error(e.to_string()),
        };
        let sent = match &reply {
            Reply::Values { version, slowest, .. } => {
                let r = Reply::Values { version: *version, slowest: *slowest, values: std::mem::take(&mut out) };
                let sent = r.write(&mut stream, &peer);
                if let Reply::Values { values, .. } = r {
                    out = values;
                }
                sent
            }
            r => r.write(&mut stream, &peer),
        };
        if let Reply::Error(why) = &reply {
            tracing::warn!(server = cfg.index, worker, "{why}");
        }
        if let Err(e) = sent {
            tracing::warn!(server = cfg.index, worker, error = %e, "a reply could not be sent; closing");
            break;
        }
        if done {
            break;
        }
    }
    let mut st = shared.lock();
    st.connected[worker] = false;
    shared.changed.notify_all();
}

/// Waits on the condition variable until `ready` holds, the server stops, or `limit` passes (then `why` says what
/// was waited for).
fn wait_until<'a>(
    shared: &'a Shared,
    mut st: MutexGuard<'a, State>,
    limit: Duration,
    mut ready: impl FnMut(&State) -> bool,
    why: impl Fn(&State) -> String,
) -> Result<MutexGuard<'a, State>> {
    let deadline = Instant::now() + limit;
    while !ready(&st) {
        if shared.stop.load(Ordering::SeqCst) {
            return Err(PsError::Server(format!("server {} is stopping", shared.cfg.index)));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(PsError::Server(format!("server {}: waited {limit:?} for {}", shared.cfg.index, why(&st))));
        }
        let step = (deadline - now).min(Duration::from_millis(100));
        st = shared.changed.wait_timeout(st, step).unwrap_or_else(std::sync::PoisonError::into_inner).0;
    }
    Ok(st)
}

fn not_ready(index: usize) -> PsError {
    PsError::Server(format!("server {index} holds no values yet: worker 0 gives them first"))
}

/// Serves one request; a [`Reply::Values`] leaves its values in `out`, and a push applied at once gives its buffer
/// back in `spare` for the next request to be read into.
/// A whole pull is written from the shard itself while the lock is held (`None`: replied already), saving a copy of
/// the shard a pull.
#[allow(clippy::too_many_arguments)]
fn handle(
    shared: &Shared,
    worker: usize,
    req: Request,
    out: &mut Vec<f32>,
    spare: &mut Vec<f32>,
    seg: &mut Option<Segment>,
    stream: &mut TcpStream,
    peer: &str,
) -> Result<Option<Reply>> {
    let cfg = &shared.cfg;
    let mut st = shared.lock();
    st.heard = Instant::now();
    match req {
        Request::Init { force, version, values, m, v } => {
            if force || st.shard.is_none() {
                st.shard = Some(Shard::with_state(values, cfg.optim, m, v, version)?);
                st.round = None;
                st.restored = false;
                shared.changed.notify_all();
            }
            let version = st.shard.as_ref().map_or(0, |s| s.version);
            Ok(Some(Reply::Version { version, slowest: st.clocks.slowest() }))
        }
        Request::Push { version, lr, spans, grad } => {
            push(shared, &mut st, worker, version, lr, spans, Grad::Owned(grad), spare)?;
            let version = st.shard.as_ref().map_or(0, |s| s.version);
            Ok(Some(Reply::Version { version, slowest: st.clocks.slowest() }))
        }
        Request::PushShared { version, lr } => {
            let seg = shared_segment(seg, &st, cfg.index)?;
            push(shared, &mut st, worker, version, lr, Vec::new(), Grad::Shared(seg.grad()), spare)?;
            let version = st.shard.as_ref().map_or(0, |s| s.version);
            Ok(Some(Reply::Version { version, slowest: st.clocks.slowest() }))
        }
        Request::PullShared { min_version } => {
            let mut st = wait_pull(shared, st, worker, min_version)?;
            let seg = shared_segment(seg, &st, cfg.index)?;
            let shard = st.shard.as_ref().ok_or_else(|| not_ready(cfg.index))?;
            seg.values().copy_from_slice(&shard.values);
            let (version, slowest, n) = (shard.version, st.clocks.slowest(), shard.values.len());
            st.report.pulls += 1;
            st.report.bytes_out += n as u64 * 4;
            Ok(Some(Reply::Version { version, slowest }))
        }
        Request::Share => {
            let n = st.shard.as_ref().ok_or_else(|| not_ready(cfg.index))?.values.len();
            drop(st);
            let made = Segment::create(Path::new(SHM_DIR), n)?;
            let path = made.path().map(|p| p.display().to_string()).unwrap_or_default();
            *seg = Some(made);
            Ok(Some(Reply::Shared { path, len: n as u64 }))
        }
        Request::Pull { min_version, spans } => {
            let st = wait_pull(shared, st, worker, min_version)?;
            let mut st = st;
            let shard = st.shard.as_ref().ok_or_else(|| not_ready(cfg.index))?;
            let (version, slowest, n) = (shard.version, st.clocks.slowest(), shard.values.len());
            if spans.is_empty() {
                write_values(stream, version, slowest, &[&shard.values], peer)?;
                st.report.pulls += 1;
                st.report.bytes_out += n as u64 * 4;
                return Ok(None);
            }
            out.clear();
            {
                check_spans(&spans, shard.values.len())?;
                for s in &spans {
                    out.extend_from_slice(&shard.values[s.start as usize..s.start as usize + s.len as usize]);
                }
            }
            st.report.pulls += 1;
            st.report.bytes_out += out.len() as u64 * 4;
            Ok(Some(Reply::Values { version, slowest, values: Vec::new() }))
        }
        Request::State => {
            let shard = st.shard.as_ref().ok_or_else(|| not_ready(cfg.index))?;
            let (m, v) = shard.moments();
            Ok(Some(Reply::State {
                version: shard.version,
                values: shard.values.clone(),
                m: m.to_vec(),
                v: v.to_vec(),
            }))
        }
        Request::Checkpoint { step } => {
            let shard = st.shard.as_ref().ok_or_else(|| not_ready(cfg.index))?;
            let snap = snapshot(cfg, shard, &st.clocks, step);
            drop(st);
            if let Some(p) = &shared.persist {
                p.save(&snap)?;
            }
            Ok(Some(Reply::Version { version: snap.version, slowest: 0 }))
        }
        Request::Done => {
            st.done[worker] = true;
            st.clocks.retire(worker);
            shared.changed.notify_all();
            let version = st.shard.as_ref().map_or(0, |s| s.version);
            Ok(Some(Reply::Version { version, slowest: st.clocks.slowest() }))
        }
    }
}

/// A pull's wait: until the shard holds values, is at `min_version` (sync) and this worker may start its next step
/// (bounded staleness), or an error naming what it waited for.
fn wait_pull<'a>(
    shared: &'a Shared,
    st: MutexGuard<'a, State>,
    worker: usize,
    min_version: u64,
) -> Result<MutexGuard<'a, State>> {
    let cfg = &shared.cfg;
    let sync = matches!(cfg.mode, Mode::Sync);
    let ssp = matches!(cfg.mode, Mode::Ssp { .. });
    let index = cfg.index;
    wait_until(
        shared,
        st,
        cfg.wait,
        |s| {
            s.shard.as_ref().is_some_and(|sh| !sync || sh.version >= min_version)
                && (!ssp || s.clocks.may_start(worker))
        },
        |s| match &s.shard {
            None => format!("worker 0's starting values (server {index} holds none)"),
            Some(sh) if sync && sh.version < min_version => format!(
                "version {min_version} (the shard is at {}; the round still waits for workers {:?})",
                sh.version,
                s.round.as_ref().map(Round::missing).unwrap_or_default()
            ),
            Some(_) => format!(
                "the slowest worker: worker {worker} is at step {}, more than {} ahead of step {}",
                s.clocks.clocks().get(worker).copied().unwrap_or(0),
                cfg.mode.staleness(),
                s.clocks.slowest()
            ),
        },
    )
}

/// Where a worker's push comes from: the request's own buffer, or the connection's shared segment.
enum Grad<'a> {
    Owned(Vec<f32>),
    Shared(&'a mut [f32]),
}

/// The connection's shared segment, checked against the shard.
fn shared_segment<'a>(seg: &'a mut Option<Segment>, st: &State, index: usize) -> Result<&'a mut Segment> {
    let n = st.shard.as_ref().map_or(0, |s| s.values.len());
    match seg {
        Some(s) if s.len() == n => Ok(s),
        _ => Err(PsError::Server(format!("server {index}: no shared segment of {n} values for this connection"))),
    }
}

/// Takes one push: into the synchronous round, or applied at once (then a buffer of its own is given back in
/// `spare`).
#[allow(clippy::too_many_arguments)]
fn push(
    shared: &Shared,
    st: &mut State,
    worker: usize,
    version: u64,
    lr: f64,
    spans: Vec<crate::shard::Span>,
    grad: Grad<'_>,
    spare: &mut Vec<f32>,
) -> Result<()> {
    let cfg = &shared.cfg;
    let w = cfg.workers as f32;
    let n = st.shard.as_ref().ok_or_else(|| not_ready(cfg.index))?.values.len();
    let len = match &grad {
        Grad::Owned(g) => g.len(),
        Grad::Shared(g) => g.len(),
    };
    st.report.pushes += 1;
    st.report.bytes_in += len as u64 * 4;
    if spans.is_empty() && len != n {
        return Err(PsError::InvalidArgument(format!(
            "worker {worker} pushed {len} values to server {} of {n}",
            cfg.index
        )));
    }
    match cfg.mode {
        Mode::Sync => {
            let grad = match grad {
                Grad::Owned(g) => g,
                Grad::Shared(g) => g.to_vec(),
            };
            let State { shard, round, restored, .. } = st;
            let shard = shard.as_mut().ok_or_else(|| not_ready(cfg.index))?;
            // A restarted server takes up the workers' count where they are.
            if *restored && version > shard.version {
                shard.version = version;
            }
            *restored = false;
            if version < shard.version {
                return Err(PsError::Server(format!(
                    "server {}: worker {worker} pushed a gradient of version {version}, but the shard is at {}",
                    cfg.index, shard.version
                )));
            }
            let mut r = match round.take() {
                Some(r) => r,
                None => Round::new(cfg.workers, cfg.rule, cfg.f, shard.version)?.scaled(w).attacked(cfg.attack.clone()),
            };
            match r.push_spans(worker, version, spans, grad) {
                Ok(true) => {
                    r.finish(shard, lr)?;
                    shared.changed.notify_all();
                }
                Ok(false) => *round = Some(r),
                Err(e) => {
                    *round = Some(r);
                    return Err(e);
                }
            }
        }
        Mode::Async | Mode::Ssp { .. } => {
            let shard = st.shard.as_mut().ok_or_else(|| not_ready(cfg.index))?;
            let mut owned = None;
            let g: &mut [f32] = match grad {
                Grad::Owned(g) => owned.insert(g),
                Grad::Shared(g) => g,
            };
            g.iter_mut().for_each(|x| *x *= w);
            if spans.is_empty() {
                shard.apply(g, lr)?;
            } else {
                shard.apply_spans(&spans, g, lr)?;
            }
            if let Some(g) = owned {
                *spare = g;
            }
            st.clocks.tick(worker)?;
            shared.changed.notify_all();
        }
    }
    Ok(())
}
