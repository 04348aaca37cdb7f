//! `shoal-control`: Shoal's control plane — the server behind `shoal server` and `shoal demo`.
//!
//! - [`api`]: the HTTP+JSON API (axum) under `/api/v1/` and its OpenAPI 3 document; bodies are `shoal-wire` types,
//!   built from the store's rows in [`view`]. [`api_error`]: every error JSON with a stable `code`, a 4xx when the
//!   caller can fix it.
//! - [`auth`]: bearer tokens stored hashed, mapped to a user and a team.
//! - [`db`]: the state store, SQLite (default, WAL) or PostgreSQL through one set of SQL statements.
//! - [`control`]: the loop that keeps store, scheduler (`shoal-sched`) and processes in agreement.
//! - Tasks run through `shoal-exec`'s `Executor` (the local one by default, or Slurm's): this crate starts no
//!   process itself.
//! - [`server`]: start-up (data-directory lock, admin token, recovery) and shutdown.
//! - [`observe`]: the dashboard (assets embedded from `assets/` by `build.rs`), overview, live streams (SSE),
//!   resource samples, `/metrics` for Prometheus; [`diagnose`]: what holds a job back; [`cost`]: what it costs.
//!
//! Invariants:
//! - The store is the truth: every job state change is one conditional transaction with its event, so a crash at
//!   any point leaves a job in exactly one state, and a restarted server continues from it.
//! - A job never runs twice at once: it is requeued only after every process of its attempt is probed dead
//!   (PID and start time), and one server holds a data directory's lock.
//! - Tasks outlive the server (their own sessions, exit status written by a wrapper), so a server restart adopts
//!   them instead of killing work; a task that vanished is *lost* and its job restarted by its policy.
//! - A failed, lost or silent rank, or a hang, stops the whole gang; what follows (`[fault_tolerance]`: restart
//!   after a backoff that doubles while attempts complete no step, elastic, none) is decided only once every process
//!   of the attempt is gone, and a backoff is counted from the stored `restarted` event, so a server restart does
//!   not cut it short.
//! - A user sees and acts on its own team's jobs only; another team's job is reported as not found.
//! - No candle here: the control plane talks to workers only through processes, files and the wire.
//!
//! Feature `nvml`: GPU discovery and per-task GPU telemetry through NVML ([`gpu`]); without it, GPUs are what
//! `--gpus` declares and their samples are empty.

pub mod api;
pub mod api_error;
pub mod auth;
pub mod clock;
pub mod control;
pub mod cost;
pub mod db;
pub mod diagnose;
pub mod error;
pub mod gpu;
pub mod http;
pub mod metrics;
pub mod observe;
pub mod policy;
pub mod server;
pub mod view;

pub use error::{ControlError, Result};
pub use server::{ExecutorKind, Server, ServerOptions, start};
