//! The [`Transport`] trait: moving one message to a peer while receiving one from
//! another, with a deadline. Collectives are written once, over this trait, and
//! run unchanged on every transport.
//!
//! Invariants every implementation keeps:
//! - messages between a pair of ranks arrive in the order they were sent, and each
//!   carries the operation's sequence number, checked by the receiver;
//! - each message also carries its sender's [`Timing`] ([`crate::arrival`]), and
//!   the receiver records its arrival through [`OpCtx::arrived`] when it sees the
//!   first bytes;
//! - `exchange` never returns while the transport still reads the send buffer or
//!   writes through the sink;
//! - no wait is unbounded: past `OpCtx::deadline` the call fails with
//!   [`Error::Timeout`], and a peer that is known dead fails it with
//!   [`Error::PeerLost`] as soon as that is seen.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::arrival::{Arrivals, Timing};
use crate::error::{Error, Participation, Result};

/// Which mechanism carries a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Blocking sockets, one sender thread per peer.
    Tcp,
    /// Single-producer single-consumer slot rings in `/dev/shm`, futex wake-ups.
    Shm,
    /// The same rings in this process's heap (ranks are threads).
    InProc,
}

impl TransportKind {
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::InProc => "inproc",
        }
    }
}

/// The operation a message belongs to: names it in errors and counts its bytes.
#[derive(Debug)]
pub struct OpCtx<'a> {
    pub name: &'static str,
    pub seq: u64,
    pub rank: usize,
    pub started: Instant,
    pub deadline: Instant,
    /// Bytes sent plus bytes received so far.
    pub bytes: AtomicU64,
    /// Bytes sent so far (payload and headers).
    pub sent: AtomicU64,
    /// Where the arrival of every message is recorded (none: nowhere).
    arrivals: Option<&'a Arrivals>,
}

impl OpCtx<'_> {
    pub fn new(name: &'static str, seq: u64, rank: usize, timeout: Duration) -> OpCtx<'static> {
        let started = Instant::now();
        OpCtx {
            name,
            seq,
            rank,
            started,
            deadline: started + timeout,
            bytes: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            arrivals: None,
        }
    }

    /// Records message arrivals in `a` ([`crate::arrival`]).
    pub fn with_arrivals(self, a: &Arrivals) -> OpCtx<'_> {
        let OpCtx { name, seq, rank, started, deadline, bytes, sent, .. } = self;
        OpCtx { name, seq, rank, started, deadline, bytes, sent, arrivals: Some(a) }
    }

    /// What a message sent now, `stamp` ([`crate::arrival::now_ns`]), carries ([`Arrivals::outgoing`]).
    pub fn timing(&self, stamp: u64) -> Timing {
        self.arrivals.as_ref().map_or(Timing { stamp, held: 0 }, |a| a.outgoing(stamp))
    }

    /// Records a message from `peer` ([`Arrivals::incoming`]): `posted` and `seen` in this process's clock
    /// ([`crate::arrival::now_ns`]), `t` as its sender wrote it.
    pub fn arrived(&self, peer: usize, posted: u64, seen: u64, t: Timing) {
        if let Some(a) = &self.arrivals {
            a.incoming(peer, posted, seen, t);
        }
    }

    pub fn add_bytes(&self, n: usize) {
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Counts `n` bytes sent (also counted in [`Self::bytes_moved`]).
    pub fn add_sent(&self, n: usize) {
        self.sent.fetch_add(n as u64, Ordering::Relaxed);
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn bytes_moved(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Time left before the deadline (zero when past it).
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// The timeout error for this operation.
    pub fn timeout(&self, waiting_for: String) -> Error {
        Error::Timeout {
            op: self.name,
            seq: self.seq,
            rank: self.rank,
            waited: self.started.elapsed(),
            waiting_for,
            participation: Participation::default(),
            bytes_moved: self.bytes_moved(),
        }
    }

    /// The lost-peer error for this operation.
    pub fn peer_lost(&self, peer: usize, reason: String) -> Error {
        Error::PeerLost {
            op: self.name,
            seq: self.seq,
            rank: self.rank,
            peer,
            reason,
            participation: Participation::default(),
            bytes_moved: self.bytes_moved(),
        }
    }
}

/// Receives the bytes of a message as they arrive: `(offset in message, bytes)`.
/// Chunks arrive in order, are contiguous, and are multiples of 8 bytes except
/// possibly the last one of the message.
pub type Sink<'a> = &'a mut (dyn FnMut(usize, &[u8]) + Send);

/// One outgoing message.
#[derive(Debug, Clone, Copy)]
pub struct SendReq<'a> {
    pub peer: usize,
    pub data: &'a [u8],
}

/// One incoming message of a known length.
pub struct RecvReq<'a> {
    pub peer: usize,
    pub len: usize,
    pub sink: Sink<'a>,
}

impl std::fmt::Debug for RecvReq<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvReq").field("peer", &self.peer).field("len", &self.len).finish_non_exhaustive()
    }
}

/// Point-to-point message movement between the ranks of one communicator.
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// The mechanism.
    fn kind(&self) -> TransportKind;

    /// True when this transport has a link to `peer`.
    fn reaches(&self, peer: usize) -> bool;

    /// Sends `send` and receives `recv` concurrently; returns when both are done.
    /// Either may be absent. The send buffer and the sink's target must not overlap.
    fn exchange(&self, op: &OpCtx, send: Option<SendReq<'_>>, recv: Option<RecvReq<'_>>) -> Result<()>;

    /// Records that this rank entered operation `seq` (visible to peers where the
    /// transport can show it, e.g. in shared memory).
    fn set_progress(&self, _seq: u64) {}

    /// The last operation sequence number `peer` is known to have entered, where
    /// the transport can tell without a message.
    fn peer_progress(&self, _peer: usize) -> Option<u64> {
        None
    }

    /// Tells the peers this rank leaves (its communicator closed after a failed operation): a peer waiting on it
    /// fails at once, naming it, instead of waiting out its deadline. Nothing moves over the transport after.
    fn close(&self) {}
}
