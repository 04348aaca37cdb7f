//! A worker's side of the parameter servers: one authenticated connection to each server, and the exchanges a
//! training step makes with all of them at once (a thread a server): push this worker's part of the gradient and
//! pull the new values, densely or for some rows only. A connection that breaks (a server restarted) is opened
//! again and the server's part of the exchange made again, until the deadline; every wait has one, and an error
//! names the server and what it waited for.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::error::{PsError, Result};
use crate::net::proto::{Reply, Request, Span, read_values_into, write_init, write_pull, write_push};
use crate::net::shm::Segment;
use crate::server::Mode;

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    /// The segment shared with the server on this host, once made.
    shm: Option<Segment>,
    /// Whether sharing was tried (a server on another host keeps to TCP).
    tried: bool,
}

impl Conn {
    /// The shared segment for a shard of `len` values: made on first use when `share`, else none.
    fn segment(&mut self, len: usize, share: bool, peer: &str) -> Result<Option<&mut Segment>> {
        if self.shm.is_none() && share && !self.tried {
            self.tried = true;
            Request::Share.write(&mut self.stream, peer)?;
            match Reply::read(&mut self.stream, Vec::new(), peer)? {
                Reply::Shared { path, len: n } if n == len as u64 => {
                    match Segment::open(std::path::Path::new(&path), len) {
                        Ok(s) => self.shm = Some(s),
                        Err(e) => tracing::debug!(%peer, error = %e, "no shared memory with the server: TCP"),
                    }
                }
                Reply::Shared { .. } | Reply::Error(_) => {}
                other => return Err(unexpected(&other, peer)),
            }
        }
        Ok(self.shm.as_mut().filter(|s| s.len() == len))
    }
}

/// Bytes a [`Span`] takes on the wire: its start (`u64`) and length (`u32`).
pub const SPAN_BYTES: u64 = 12;

/// What one exchange sends to one server and takes back from it.
#[derive(Debug)]
pub struct Part<'a> {
    /// The gradient to push (`None`: pull only), for `push_spans` (empty: every value of the shard).
    pub push: Option<&'a [f32]>,
    pub push_spans: &'a [Span],
    /// Where the pulled values go (`None`: push only), for `pull_spans` (empty: every value).
    pub pull: Option<&'a mut [f32]>,
    pub pull_spans: &'a [Span],
}

/// A worker's connections to the servers.
pub struct Client {
    addrs: Vec<String>,
    conns: Vec<Option<Conn>>,
    worker: usize,
    secret: Vec<u8>,
    mode: Mode,
    /// How long one request may take, reconnections included.
    timeout: Duration,
    /// The version of each server's shard this worker last pulled: what its next gradient is computed on.
    versions: Vec<u64>,
    /// The slowest worker's clock, as the last reply said.
    slowest: u64,
    /// Bytes pushed and pulled: the values, and the table of spans of a sparse push or pull (its requests'
    /// [`SPAN_BYTES`] a span).
    pub bytes_pushed: u64,
    pub bytes_pulled: u64,
    /// Whether whole-shard pushes and pulls go through memory shared with a server on this host.
    share: bool,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("servers", &self.addrs)
            .field("worker", &self.worker)
            .field("mode", &self.mode)
            .field("versions", &self.versions)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects `worker` to every server (`addrs`, in the servers' order), retrying while they start, for up to
    /// `timeout`.
    pub fn connect(addrs: Vec<String>, worker: usize, secret: &[u8], mode: Mode, timeout: Duration) -> Result<Client> {
        let n = addrs.len();
        let mut c = Client {
            addrs,
            conns: (0..n).map(|_| None).collect(),
            worker,
            secret: secret.to_vec(),
            mode,
            timeout,
            versions: vec![0; n],
            slowest: 0,
            bytes_pushed: 0,
            bytes_pulled: 0,
            share: true,
        };
        for s in 0..n {
            c.conns[s] = Some(open(&c.addrs[s], s, worker, &c.secret, timeout)?);
        }
        Ok(c)
    }

    /// Keeps every push and pull on TCP, even with a server on this host (tests of that path, measurements).
    pub fn tcp_only(mut self) -> Client {
        self.share = false;
        self
    }

    /// How many servers.
    pub fn servers(&self) -> usize {
        self.addrs.len()
    }

    /// The versions this worker last pulled, one a server.
    pub fn versions(&self) -> &[u64] {
        &self.versions
    }

    /// The slowest worker's clock as the servers last said (bounded staleness).
    pub fn slowest(&self) -> u64 {
        self.slowest
    }

    /// Gives each server its starting values and optimizer state (`parts[s]`: values, `m`, `v`), at `version`;
    /// kept by a server that holds values already unless `force`. Returns each server's version after.
    pub fn init(&mut self, force: bool, version: u64, parts: &[[&[f32]; 3]]) -> Result<Vec<u64>> {
        self.check_parts(parts.len())?;
        let timeout = self.timeout;
        let (worker, secret, addrs) = (self.worker, &self.secret, &self.addrs);
        let replies = each(&mut self.conns, parts.iter().collect(), |s, conn, p| {
            with_retry(conn, &addrs[s], s, worker, secret, timeout, |c, peer| {
                write_init(&mut c.stream, force, version, *p, peer)?;
                expect_version(Reply::read(&mut c.stream, Vec::new(), peer)?, peer)
            })
        })?;
        let versions: Vec<u64> = replies.iter().map(|r| r.0).collect();
        self.versions.clone_from(&versions);
        Ok(versions)
    }

    /// One step's exchange with every server at once (`parts[s]` for server `s`): the push, then the pull. In the
    /// synchronous mode the pull waits for the version after the one the gradient was computed on (every worker's
    /// push applied); under bounded staleness until this worker may start its next step; otherwise it takes the
    /// newest values.
    pub fn exchange(&mut self, lr: f64, parts: Vec<Part<'_>>) -> Result<()> {
        self.check_parts(parts.len())?;
        let timeout = self.timeout;
        let (worker, secret, mode, share) = (self.worker, &self.secret, self.mode, self.share);
        let (addrs, versions) = (&self.addrs, &self.versions);
        let results = each(&mut self.conns, parts, |s, conn, mut part| {
            let version = versions[s];
            with_retry(conn, &addrs[s], s, worker, secret, timeout, |c, peer| {
                // A whole shard's push and pull go through shared memory when the server is on this host.
                let dense = part.push_spans.is_empty() && part.pull_spans.is_empty();
                let len = part.push.map(<[f32]>::len).or(part.pull.as_deref().map(<[f32]>::len)).unwrap_or(0);
                let shared = if dense && len > 0 { c.segment(len, share, peer)?.is_some() } else { false };
                let mut pushed = 0u64;
                if let Some(g) = part.push {
                    match c.shm.as_mut().filter(|_| shared) {
                        Some(seg) if seg.len() == g.len() => {
                            seg.grad().copy_from_slice(g);
                            Request::PushShared { version, lr }.write(&mut c.stream, peer)?;
                        }
                        _ => write_push(&mut c.stream, version, lr, part.push_spans, g, peer)?,
                    }
                    expect_version(Reply::read(&mut c.stream, Vec::new(), peer)?, peer)?;
                    pushed = g.len() as u64 * 4 + SPAN_BYTES * part.push_spans.len() as u64;
                }
                let Some(out) = part.pull.as_deref_mut() else { return Ok((version, 0, pushed, 0)) };
                let min_version = match (mode, part.push) {
                    (Mode::Sync, Some(_)) => version + 1,
                    _ => 0,
                };
                let (version, slowest) = match c.shm.as_mut().filter(|s| shared && s.len() == out.len()) {
                    Some(seg) => {
                        Request::PullShared { min_version }.write(&mut c.stream, peer)?;
                        let got = expect_version(Reply::read(&mut c.stream, Vec::new(), peer)?, peer)?;
                        out.copy_from_slice(seg.values());
                        got
                    }
                    None => {
                        write_pull(&mut c.stream, min_version, part.pull_spans, peer)?;
                        read_values_into(&mut c.stream, out, peer)?
                    }
                };
                Ok((version, slowest, pushed, out.len() as u64 * 4 + SPAN_BYTES * part.pull_spans.len() as u64))
            })
        })?;
        for (s, (version, slowest, pushed, pulled)) in results.into_iter().enumerate() {
            self.versions[s] = version;
            self.slowest = if s == 0 { slowest } else { self.slowest.min(slowest) };
            self.bytes_pushed += pushed;
            self.bytes_pulled += pulled;
        }
        Ok(())
    }

    /// Each server's version, values and optimizer state (`m`, `v`; empty when it has none yet).
    #[allow(clippy::type_complexity)]
    pub fn state(&mut self) -> Result<Vec<(u64, Vec<f32>, Vec<f32>, Vec<f32>)>> {
        self.simple(
            || Request::State,
            |reply, peer| match reply {
                Reply::State { version, values, m, v } => Ok((version, values, m, v)),
                other => Err(unexpected(&other, peer)),
            },
        )
    }

    /// Asks every server to save its shard as of the workers' `step`.
    pub fn checkpoint(&mut self, step: u64) -> Result<()> {
        self.simple(|| Request::Checkpoint { step }, expect_version).map(drop)
    }

    /// Tells every server this worker has finished.
    pub fn done(&mut self) -> Result<()> {
        self.simple(|| Request::Done, expect_version).map(drop)
    }

    fn simple<T: Send>(
        &mut self,
        req: impl Fn() -> Request + Sync,
        answer: impl Fn(Reply, &str) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        let timeout = self.timeout;
        let (worker, secret, addrs) = (self.worker, &self.secret, &self.addrs);
        let unit = vec![(); self.conns.len()];
        each(&mut self.conns, unit, |s, conn, ()| {
            with_retry(conn, &addrs[s], s, worker, secret, timeout, |c, peer| {
                req().write(&mut c.stream, peer)?;
                match Reply::read(&mut c.stream, Vec::new(), peer)? {
                    Reply::Error(why) => Err(PsError::Server(why)),
                    r => answer(r, peer),
                }
            })
        })
    }

    fn check_parts(&self, n: usize) -> Result<()> {
        if n != self.addrs.len() {
            return Err(PsError::InvalidArgument(format!("{n} parts for {} servers", self.addrs.len())));
        }
        Ok(())
    }
}

fn unexpected(reply: &Reply, peer: &str) -> PsError {
    let what = match reply {
        Reply::Error(why) => return PsError::Server(why.clone()),
        Reply::Version { .. } => "a version",
        Reply::Values { .. } => "values",
        Reply::State { .. } => "its state",
        Reply::Shared { .. } => "a shared segment",
    };
    PsError::Server(format!("{peer} answered with {what}, which was not asked for"))
}

fn expect_version(reply: Reply, peer: &str) -> Result<(u64, u64)> {
    match reply {
        Reply::Version { version, slowest } => Ok((version, slowest)),
        other => Err(unexpected(&other, peer)),
    }
}

/// Runs `f` for every server at once, each on its own connection and part; the first error wins.
fn each<P: Send, T: Send>(
    conns: &mut [Option<Conn>],
    parts: Vec<P>,
    f: impl Fn(usize, &mut Option<Conn>, P) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    if conns.len() == 1 {
        let p = parts.into_iter().next().ok_or_else(|| PsError::InvalidArgument("no part for server 0".into()))?;
        return Ok(vec![f(0, &mut conns[0], p)?]);
    }
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = conns
            .iter_mut()
            .zip(parts)
            .enumerate()
            .map(|(s, (conn, p))| {
                let f = &f;
                scope.spawn(move || f(s, conn, p))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(PsError::Server("a server's exchange panicked".into()))))
            .collect()
    });
    results.into_iter().collect()
}

/// Opens server `s`'s connection as `worker`, retrying while it does not accept yet, until `timeout`.
fn open(addr: &str, s: usize, worker: usize, secret: &[u8], timeout: Duration) -> Result<Conn> {
    let deadline = Instant::now() + timeout;
    let peer = format!("parameter server {s} at {addr}");
    let mut pause = Duration::from_millis(20);
    loop {
        let tried = (|| -> Result<Conn> {
            let mut stream =
                TcpStream::connect(addr).map_err(|e| shoal_comm::Error::io(format!("connecting to {peer}"), e))?;
            let _ = shoal_comm::tcp::tune(&stream);
            stream
                .set_read_timeout(Some(timeout))
                .and_then(|()| stream.set_write_timeout(Some(timeout)))
                .map_err(|e| shoal_comm::Error::io(format!("configuring the connection to {peer}"), e))?;
            shoal_comm::auth::connect(&mut stream, secret, &(worker as u32).to_le_bytes(), &peer)?;
            Ok(Conn { stream, shm: None, tried: false })
        })();
        match tried {
            Ok(c) => return Ok(c),
            Err(e @ PsError::Comm(shoal_comm::Error::Auth { .. })) => return Err(e),
            Err(e) if Instant::now() + pause >= deadline => {
                return Err(PsError::Server(format!("could not reach {peer} within {timeout:?}: {e}")));
            }
            Err(_) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// Runs `f` on server `s`'s connection; when the connection breaks, opens it again and runs `f` again, until
/// `timeout`. A server's refusal ([`PsError::Server`]) is final.
fn with_retry<T>(
    conn: &mut Option<Conn>,
    addr: &str,
    s: usize,
    worker: usize,
    secret: &[u8],
    timeout: Duration,
    mut f: impl FnMut(&mut Conn, &str) -> Result<T>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let peer = format!("parameter server {s} at {addr}");
    loop {
        let c = match conn.take() {
            Some(c) => c,
            None => open(addr, s, worker, secret, deadline.saturating_duration_since(Instant::now()))?,
        };
        let mut c = c;
        match f(&mut c, &peer) {
            Ok(t) => {
                *conn = Some(c);
                return Ok(t);
            }
            Err(e @ PsError::Server(_)) => {
                *conn = Some(c);
                return Err(e);
            }
            // The connection may hold what was not read: it is opened afresh next time.
            Err(e @ PsError::InvalidArgument(_)) => return Err(e),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(e) => {
                tracing::warn!(server = s, worker, error = %e, "the connection to the server broke; opening it again");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}
