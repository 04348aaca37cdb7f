//! The parameter server over the network: servers as processes, each holding one part of the model
//! ([`crate::ShardPlan`]) behind a TCP listener ([`serve`]), and workers that push gradients to all of them and pull
//! the new values ([`client`]), in the messages of [`proto`]. Servers say where they listen through the job's
//! rendezvous store ([`publish`], [`addresses`]).
//!
//! Modes ([`Mode`]): `sync` — a server applies version `t + 1` once every worker's gradient for version `t` is in
//! (combined by a robust rule, the mean by default), and a worker's pull waits for it, so the run is data
//! parallelism's to rounding; `async` — each push applied on arrival, pulls answered at once; `ssp` (bounded
//! staleness) — applied on arrival, but a worker's pull waits while it is more than `staleness` steps ahead of the
//! slowest worker.

pub mod client;
pub mod proto;
pub mod serve;
pub mod shm;

use std::time::Duration;

use shoal_comm::Store;

pub use crate::server::{Mode, Snapshot};
pub use client::{Client, Part, SPAN_BYTES};
pub use proto::Span;
pub use serve::{Killer, Persist, ServeReport, Server, ServerConfig};

use crate::error::{PsError, Result};

/// The store key where server `s` of the job `name` says where it listens.
fn address_key(name: &str, s: usize) -> String {
    format!("ps/{name}/server/{s}")
}

/// Server `s` of `name` listens at `addr` (`host:port`).
pub fn publish(store: &dyn Store, name: &str, s: usize, addr: &str) -> Result<()> {
    store.set(&address_key(name, s), addr.as_bytes()).map_err(PsError::Comm)
}

/// Where each of the `servers` servers of `name` listens, waiting up to `timeout` for them to say.
pub fn addresses(store: &dyn Store, name: &str, servers: usize, timeout: Duration) -> Result<Vec<String>> {
    (0..servers)
        .map(|s| {
            let v = store
                .get(&address_key(name, s), timeout)
                .map_err(|e| PsError::Server(format!("parameter server {s} did not say where it listens: {e}")))?;
            String::from_utf8(v).map_err(|_| PsError::Server(format!("parameter server {s}'s address is not text")))
        })
        .collect()
}
