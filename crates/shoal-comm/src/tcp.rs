//! The TCP transport: one authenticated connection per pair of ranks, blocking
//! sockets with `TCP_NODELAY` and large buffers.
//!
//! Receiving runs on the calling thread, in chunks handed to the sink as they
//! arrive, so the collective reduces one chunk while the kernel receives the next.
//! Sending a large message runs on the peer's dedicated sender thread so that a
//! rank sends and receives at once (a ring step does both); small messages are
//! written inline because they always fit the socket buffer.
//!
//! Every message is one frame (`frame::Header`, the sender's stamp and hold, the
//! payload) whose kind, sequence number and length the receiver checks against
//! what the operation expects; a mismatch is a protocol error and the communicator
//! is closed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::arrival::{Timing, now_ns};
use crate::auth;
use crate::error::{Error, Result};
use crate::frame::{DATA_TIMING_LEN, HEADER_LEN, Header, Kind};
use crate::transport::{OpCtx, RecvReq, SendReq, Transport, TransportKind};

/// Socket buffer size asked of the kernel (it may round it).
const SOCKET_BUFFER: usize = 4 << 20;
/// Messages up to this size are written on the calling thread.
const INLINE_SEND: usize = 256 << 10;
/// Receive chunk handed to the sink.
const RECV_CHUNK: usize = 256 << 10;
/// What a data frame costs beyond its payload.
const FRAME_BYTES: usize = HEADER_LEN + DATA_TIMING_LEN;

/// Hands one send at a time to the peer's sender thread and its result back,
/// without allocating (a channel would allocate blocks as messages flow).
#[derive(Debug, Default)]
struct Mailbox {
    state: Mutex<Slot>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct Slot {
    job: Option<Job>,
    done: Option<std::io::Result<()>>,
    closed: bool,
}

impl Mailbox {
    fn post(&self, job: Job) -> bool {
        let Ok(mut s) = self.state.lock() else { return false };
        if s.closed {
            return false;
        }
        s.job = Some(job);
        s.done = None;
        self.cv.notify_all();
        true
    }

    /// Waits for the result of the posted job (the sender's write timeout ends
    /// at the operation's deadline, so this returns).
    fn result(&self) -> Option<std::io::Result<()>> {
        let mut s = self.state.lock().ok()?;
        loop {
            if let Some(r) = s.done.take() {
                return Some(r);
            }
            if s.closed {
                return None;
            }
            s = self.cv.wait(s).ok()?;
        }
    }

    /// The sender thread's side: next job, or None when closed.
    fn next(&self) -> Option<Job> {
        let mut s = self.state.lock().ok()?;
        loop {
            if s.closed {
                return None;
            }
            if let Some(j) = s.job.take() {
                return Some(j);
            }
            s = self.cv.wait(s).ok()?;
        }
    }

    fn finish(&self, r: std::io::Result<()>) {
        if let Ok(mut s) = self.state.lock() {
            s.done = Some(r);
            self.cv.notify_all();
        }
    }

    fn close(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.closed = true;
            self.cv.notify_all();
        }
    }
}

struct Job {
    ptr: usize,
    len: usize,
    seq: u64,
    timing: Timing,
    deadline: Instant,
}

#[derive(Debug)]
struct Peer {
    addr: String,
    reader: Mutex<(TcpStream, Vec<u64>)>,
    writer: Mutex<TcpStream>,
    mailbox: Arc<Mailbox>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("len", &self.len).field("seq", &self.seq).finish()
    }
}

/// The TCP transport of one communicator.
#[derive(Debug)]
pub struct TcpTransport {
    rank: usize,
    peers: Vec<Option<Peer>>,
}

/// Tunes a connection for bulk transfers as the collectives' links are: no Nagle delay, 4 MiB socket buffers (the
/// parameter servers' connections use it too).
pub fn tune(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = socket2::SockRef::from(stream);
    sock.set_send_buffer_size(SOCKET_BUFFER)?;
    sock.set_recv_buffer_size(SOCKET_BUFFER)?;
    Ok(())
}

/// Writes one data frame, with the sender's `timing` ([`crate::arrival`]).
fn write_message(
    stream: &mut TcpStream,
    seq: u64,
    timing: Timing,
    data: &[u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_write_timeout(Some(left))?;
    let mut h = [0u8; FRAME_BYTES];
    h[..HEADER_LEN].copy_from_slice(&Header { kind: Kind::Data, seq, len: data.len() as u64 }.encode());
    h[HEADER_LEN..].copy_from_slice(&timing.encode());
    if data.len() <= INLINE_SEND {
        // One syscall for header and payload.
        let mut bufs = [std::io::IoSlice::new(&h), std::io::IoSlice::new(data)];
        let mut bufs: &mut [std::io::IoSlice<'_>] = &mut bufs;
        while !bufs.is_empty() {
            let n = stream.write_vectored(bufs)?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            std::io::IoSlice::advance_slices(&mut bufs, n);
        }
        Ok(())
    } else {
        stream.write_all(&h)?;
        stream.write_all(data)
    }
}

fn classify(op: &OpCtx, peer: usize, what: &str, e: std::io::Error) -> Error {
    use std::io::ErrorKind::*;
    match e.kind() {
        WouldBlock | TimedOut => op.timeout(format!("rank {peer} ({what})")),
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected => {
            op.peer_lost(peer, format!("its connection closed while {what} it: {e}"))
        }
        _ => Error::io(format!("{} #{} {what} rank {peer}", op.name, op.seq), e),
    }
}

impl Peer {
    fn new(rank: usize, peer: usize, stream: TcpStream) -> Result<Peer> {
        let addr = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let ctx = |what: &str| format!("{what} connection to rank {peer} ({addr})");
        tune(&stream).map_err(|e| Error::io(ctx("tuning"), e))?;
        let reader = stream.try_clone().map_err(|e| Error::io(ctx("cloning"), e))?;
        let mut sender = stream.try_clone().map_err(|e| Error::io(ctx("cloning"), e))?;
        let mailbox = Arc::new(Mailbox::default());
        let mb = mailbox.clone();
        let thread = std::thread::Builder::new()
            .name(format!("shoal-tcp-send-{rank}-{peer}"))
            .spawn(move || {
                while let Some(job) = mb.next() {
                    // SAFETY: the communicator keeps the buffer alive and unmodified
                    // until it has received this job's completion (see `exchange`).
                    let data = unsafe { std::slice::from_raw_parts(job.ptr as *const u8, job.len) };
                    mb.finish(write_message(&mut sender, job.seq, job.timing, data, job.deadline));
                }
            })
            .map_err(|e| Error::io(ctx("starting the sender thread for"), e))?;
        Ok(Peer {
            addr,
            reader: Mutex::new((reader, vec![0u64; RECV_CHUNK / 8])),
            writer: Mutex::new(stream),
            mailbox,
            thread: Some(thread),
        })
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        for p in self.peers.iter_mut().flatten() {
            if let Ok(w) = p.writer.lock() {
                let _ = w.shutdown(std::net::Shutdown::Both);
            }
            p.mailbox.close();
            if let Some(t) = p.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl TcpTransport {
    /// Connects this rank to every peer that has an address, authenticating each
    /// connection with `secret`. Rank `i` dials every lower rank and accepts every
    /// higher one on `listener`; a connection that fails the handshake or names a
    /// wrong communicator is dropped and logged, and waiting goes on until
    /// `deadline`.
    pub fn connect_mesh(
        ctx: &str,
        rank: usize,
        addrs: &[Option<String>],
        listener: TcpListener,
        secret: &[u8],
        deadline: Instant,
    ) -> Result<TcpTransport> {
        let size = addrs.len();
        let started = Instant::now();
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        for (peer, addr) in addrs.iter().enumerate().take(rank) {
            let Some(addr) = addr else { continue };
            streams[peer] = Some(dial(ctx, rank, peer, addr, secret, deadline)?);
        }
        let mut expected: Vec<usize> = (rank + 1..size).filter(|&p| addrs[p].is_some()).collect();
        listener.set_nonblocking(true).map_err(|e| Error::io("listener set_nonblocking", e))?;
        while !expected.is_empty() {
            match listener.accept() {
                Ok((mut s, from)) => {
                    let r = (|| -> Result<usize> {
                        s.set_nonblocking(false).map_err(|e| Error::io("accepted socket", e))?;
                        s.set_read_timeout(Some(Duration::from_secs(10)))
                            .map_err(|e| Error::io("accepted socket", e))?;
                        s.set_write_timeout(Some(Duration::from_secs(10)))
                            .map_err(|e| Error::io("accepted socket", e))?;
                        let hello = auth::accept(&mut s, secret, &from.to_string())?;
                        let text = String::from_utf8_lossy(&hello);
                        let (c, r) = text.rsplit_once('/').unwrap_or(("", ""));
                        let peer: usize = r.parse().map_err(|_| Error::Protocol {
                            peer: from.to_string(),
                            detail: format!("bad hello {text:?}"),
                        })?;
                        if c != ctx || !expected.contains(&peer) {
                            return Err(Error::Protocol {
                                peer: from.to_string(),
                                detail: format!(
                                    "unexpected peer {text:?} (communicator {ctx:?}, waiting for ranks {expected:?})"
                                ),
                            });
                        }
                        Ok(peer)
                    })();
                    match r {
                        Ok(peer) => {
                            expected.retain(|&p| p != peer);
                            streams[peer] = Some(s);
                        }
                        Err(e) => tracing::warn!(%from, error = %e, "refused a connection"),
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(Error::Timeout {
                            op: "connect",
                            seq: 0,
                            rank,
                            waited: started.elapsed(),
                            waiting_for: format!("connections from ranks {expected:?}"),
                            participation: crate::Participation { arrived: vec![], missing: expected.clone() },
                            bytes_moved: 0,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(Error::io("accepting peer connections", e)),
            }
        }
        let mut peers = Vec::with_capacity(size);
        for (peer, s) in streams.into_iter().enumerate() {
            peers.push(match s {
                Some(s) => {
                    s.set_read_timeout(None).map_err(|e| Error::io("socket", e))?;
                    Some(Peer::new(rank, peer, s)?)
                }
                None => None,
            });
        }
        Ok(TcpTransport { rank, peers })
    }

    fn peer(&self, peer: usize, op: &OpCtx) -> Result<&Peer> {
        self.peers.get(peer).and_then(|p| p.as_ref()).ok_or_else(|| {
            Error::InvalidArgument(format!("{} #{}: rank {peer} is not reachable over tcp", op.name, op.seq))
        })
    }

    /// Receives one message; `posted`: when the exchange asked for it ([`now_ns`]).
    fn recv(&self, op: &OpCtx, req: RecvReq<'_>, posted: u64) -> Result<()> {
        let p = self.peer(req.peer, op)?;
        let mut guard = p.reader.lock().map_err(|_| Error::Closed("tcp reader lock poisoned".into()))?;
        let (stream, scratch) = &mut *guard;
        let peer = req.peer;
        let left = op.remaining().max(Duration::from_millis(1));
        stream.set_read_timeout(Some(left)).map_err(|e| Error::io("set_read_timeout", e))?;
        // The header and the timing after it, in one read where they came together (as they are sent).
        let mut fb = [0u8; FRAME_BYTES];
        let mut got = 0;
        while got < HEADER_LEN {
            match stream.read(&mut fb[got..]) {
                Ok(0) => {
                    let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(classify(op, peer, "waiting for a message from", eof));
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(classify(op, peer, "waiting for a message from", e)),
            }
        }
        let seen = now_ns();
        let mut hb = [0u8; HEADER_LEN];
        hb.copy_from_slice(&fb[..HEADER_LEN]);
        let h = Header::decode(&hb, req.len as u64, &p.addr).map_err(|e| match e {
            Error::Protocol { detail, .. } => Error::Protocol { peer: format!("rank {peer} ({})", p.addr), detail },
            e => e,
        })?;
        if h.kind != Kind::Data || h.seq != op.seq || h.len != req.len as u64 {
            return Err(Error::Protocol {
                peer: format!("rank {peer} ({})", p.addr),
                detail: format!(
                    "expected a {}-byte message of {} #{}, got a {:?} frame of {} bytes for #{}",
                    req.len, op.name, op.seq, h.kind, h.len, h.seq
                ),
            });
        }
        stream.read_exact(&mut fb[got..]).map_err(|e| classify(op, peer, "receiving from", e))?;
        let mut timing = [0u8; DATA_TIMING_LEN];
        timing.copy_from_slice(&fb[HEADER_LEN..]);
        op.arrived(peer, posted, seen, Timing::decode(&timing));
        op.add_bytes(FRAME_BYTES);
        let buf: &mut [u8] = bytemuck::cast_slice_mut(scratch.as_mut_slice());
        let mut off = 0;
        while off < req.len {
            let n = (req.len - off).min(buf.len());
            stream.read_exact(&mut buf[..n]).map_err(|e| classify(op, peer, "receiving from", e))?;
            (req.sink)(off, &buf[..n]);
            off += n;
            op.add_bytes(n);
        }
        Ok(())
    }
}

fn dial(ctx: &str, rank: usize, peer: usize, addr: &str, secret: &[u8], deadline: Instant) -> Result<TcpStream> {
    let sa: SocketAddr =
        addr.parse().map_err(|_| Error::InvalidArgument(format!("rank {peer} published a bad address {addr:?}")))?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&sa, left.max(Duration::from_millis(10))) {
            Ok(mut s) => {
                s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| Error::io("socket", e))?;
                s.set_write_timeout(Some(Duration::from_secs(10))).map_err(|e| Error::io("socket", e))?;
                auth::connect(&mut s, secret, format!("{ctx}/{rank}").as_bytes(), &format!("rank {peer} ({addr})"))?;
                return Ok(s);
            }
            Err(e) if Instant::now() < deadline && e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(Error::io(format!("connecting to rank {peer} at {addr}"), e)),
        }
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn close(&self) {
        for p in self.peers.iter().flatten() {
            if let Ok(w) = p.writer.lock() {
                let _ = w.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    fn reaches(&self, peer: usize) -> bool {
        peer != self.rank && matches!(self.peers.get(peer), Some(Some(_)))
    }

    fn exchange(&self, op: &OpCtx, send: Option<SendReq<'_>>, recv: Option<RecvReq<'_>>) -> Result<()> {
        let now = now_ns();
        let Some(s) = send else {
            return match recv {
                Some(r) => self.recv(op, r, now),
                None => Ok(()),
            };
        };
        let sp = self.peer(s.peer, op)?;
        if s.data.len() <= INLINE_SEND || recv.is_none() {
            {
                let mut w = sp.writer.lock().map_err(|_| Error::Closed("tcp writer lock poisoned".into()))?;
                write_message(&mut w, op.seq, op.timing(now), s.data, op.deadline)
                    .map_err(|e| classify(op, s.peer, "sending to", e))?;
            }
            op.add_sent(s.data.len() + FRAME_BYTES);
            return match recv {
                Some(r) => self.recv(op, r, now),
                None => Ok(()),
            };
        }
        // Large send alongside a receive: hand the send to the peer's sender thread.
        if !sp.mailbox.post(Job {
            ptr: s.data.as_ptr() as usize,
            len: s.data.len(),
            seq: op.seq,
            timing: op.timing(now),
            deadline: op.deadline,
        }) {
            return Err(op.peer_lost(s.peer, "its sender thread has stopped".into()));
        }
        let recv_result = match recv {
            Some(r) => self.recv(op, r, now),
            None => Ok(()),
        };
        // Always wait for the sender thread before returning: it reads `s.data`.
        // Its socket write timeout ends at the deadline, so this wait is bounded.
        let send_result = match sp.mailbox.result() {
            Some(r) => r.map_err(|e| classify(op, s.peer, "sending to", e)),
            None => Err(op.peer_lost(s.peer, "its sender thread has stopped".into())),
        };
        if send_result.is_ok() {
            op.add_sent(s.data.len() + FRAME_BYTES);
        }
        recv_result.and(send_result)
    }
}
