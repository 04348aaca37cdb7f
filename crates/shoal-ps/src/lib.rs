//! Shoal's parameter server, in buffers: how a model's parameters are sharded over server processes
//! ([`shard`]), the optimizers' update that servers and the trainer's strategies share ([`optim`]), a server's part
//! of the model and the consistency modes that turn pushes into updates ([`server`]), and the robust rules that
//! combine workers' gradients when some of them may lie ([`robust`]), with the attacks that experiments simulate
//! ([`attack`]); and the servers as processes on the network, with the workers' side of them ([`net`]: push, pull,
//! sparse rows, saves and restarts, over authenticated TCP).
//!
//! **Invariants:**
//! - Buffers, not tensors: this crate knows named flat `f32` buffers and their shapes' rows, never a tensor
//!   library or the control plane, so the servers, the trainer's `ps` strategy and an all-gather form of data
//!   parallelism share it. Its one dependency in the workspace is `shoal-comm` (the wire header, the handshake, the
//!   rendezvous store).
//! - Nothing waits without a bound: every request a server holds back (a round, the staleness bound) is answered
//!   within its `wait`, with an error naming what it waited for, and a worker's every request has a deadline.
//! - Every function is deterministic: the same inputs give the same bits on every process, so every server and
//!   worker derives the same plan and the same aggregate without talking.
//! - Input from workers is untrusted: sizes are checked, and non-finite values are a rule's problem to survive
//!   (the robust rules), never a panic.
//!
//! No feature flags.

pub mod attack;
pub mod error;
pub mod net;
pub mod optim;
pub mod robust;
pub mod server;
pub mod shard;

pub use attack::Attack;
pub use error::{PsError, Result};
pub use robust::{Rule, aggregate};
pub use server::{Clocks, Mode, Round, Shard, Snapshot};
pub use shard::{Piece, ShardPlan, Tensor};
