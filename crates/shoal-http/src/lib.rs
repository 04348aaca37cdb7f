//! `shoal-http`: serving HTTP/1.1, inside TLS when asked, for the processes of Shoal that listen — the control
//! plane's API (`shoal-control`) and a federated job's server (`shoal-train`'s `fed`).
//!
//! - [`tls`]: rustls configurations read from PEM files — a server's certificate and key, optionally requiring
//!   client certificates signed by a given CA; and a client's trust roots and identity. Every error names the file
//!   and the option it came from.
//! - [`serve()`]: the accept loop: bounded connections, deadlines on the TLS handshake, on headers and on idle
//!   connections, and a graceful shutdown.
//!
//! Invariants:
//! - Nothing here knows a route or a body: callers hand over an `axum::Router`.
//! - Every wait is bounded: a client that opens a connection and sends nothing is dropped after
//!   [`HEADER_TIMEOUT`], and shutdown waits at most [`SHUTDOWN_GRACE`] for open requests.

pub mod tls;

mod serve;

pub use serve::{HEADER_TIMEOUT, MAX_CONNECTIONS, SHUTDOWN_GRACE, serve};

/// What went wrong setting up TLS: the message names the file and the option.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);
