//! The one error type of `shoal-comm`. Variants carry facts (operation, sequence
//! number, ranks, bytes), not prose, so that callers and logs can act on them.

use std::time::Duration;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Who took part in a collective when it failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Participation {
    /// Ranks known to have entered the operation.
    pub arrived: Vec<usize>,
    /// Ranks not known to have entered it (dead, stuck elsewhere, or late).
    pub missing: Vec<usize>,
}

impl std::fmt::Display for Participation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "arrived {:?}, missing {:?}", self.arrived, self.missing)
    }
}

/// Everything that can go wrong in `shoal-comm`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A collective or point-to-point operation did not finish before its deadline.
    #[error(
        "{op} #{seq} on rank {rank} timed out after {waited:?} waiting for {waiting_for}; {participation}; {bytes_moved} bytes moved"
    )]
    Timeout {
        op: &'static str,
        seq: u64,
        rank: usize,
        waited: Duration,
        waiting_for: String,
        participation: Participation,
        bytes_moved: u64,
    },
    /// A peer closed its connection or its process died during an operation.
    #[error(
        "{op} #{seq} on rank {rank}: peer rank {peer} is gone ({reason}); {participation}; {bytes_moved} bytes moved"
    )]
    PeerLost {
        op: &'static str,
        seq: u64,
        rank: usize,
        peer: usize,
        reason: String,
        participation: Participation,
        bytes_moved: u64,
    },
    /// A peer sent something that does not follow the wire protocol. The connection
    /// it came on is closed.
    #[error("protocol violation from {peer}: {detail}")]
    Protocol { peer: String, detail: String },
    /// The other side of a connection does not hold the job secret (or we do not).
    #[error("authentication with {peer} failed: {detail}")]
    Auth { peer: String, detail: String },
    /// A key of the rendezvous store did not appear in time.
    #[error("rendezvous store: key {key:?} not set within {waited:?}")]
    StoreTimeout { key: String, waited: Duration },
    /// The rendezvous store refused or failed a request.
    #[error("rendezvous store at {addr}: {detail}")]
    Store { addr: String, detail: String },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The caller passed something unusable (mismatched lengths, bad rank, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The communicator was shut down or poisoned by an earlier failure.
    #[error("communicator is closed: {0}")]
    Closed(String),
}

impl Error {
    /// Wraps an `io::Error` with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    /// True when the error means a peer is unreachable (timeout or lost).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::PeerLost { .. })
    }
}
