//! Shoal's scheduler: pure scheduling logic.
//!
//! It owns the cluster model (nodes with CPUs, memory and GPUs, each GPU with its
//! memory and kind), queues with guaranteed quotas and borrowing, and the
//! decisions: gang placement (all tasks or none) packed on as few nodes as
//! possible unless `spread` is asked, GPU-memory-aware and with fractional GPUs;
//! FIFO with EASY backfill (the first job that cannot start gets a reservation,
//! later jobs start now only if they do not delay it); priorities with
//! preemption (lowest priority first, then least progress lost; victims get a
//! grace period and go back to pending); quota reclaim from borrowing queues;
//! dominant-resource fair share between teams of equal priority; elastic grow
//! and shrink of `min..max` jobs. Carrying decisions out is the caller's work.
//!
//! The policy is [`Config::policy`]: an [`Ordering`] of the pending jobs (strict FIFO, FIFO with EASY backfill,
//! shortest expected job first, Tiresias-style least attained service with preemption between levels, teams by
//! dominant share — the default — or elastic shrinking of peers) and a [`Packing`] of their tasks (best fit — the
//! default — or FGD's fragmentation gradient descent against the recent task shapes), named on command lines as
//! `las`, `fgd` or `las+fgd` ([`Policy`]'s `FromStr`).
//!
//! **Invariant: this crate never does IO: no sockets, files, threads or clocks.
//! Time is passed in as milliseconds**, so a trace-driven simulator runs the
//! very same code as the server. It depends on nothing but `thiserror`.
//!
//! No feature flags.
//!
//! ```
//! use shoal_sched::{Config, Decision, JobRequest, Resources, Scheduler, synthetic_cluster, synthetic_queues};
//!
//! let mut s = Scheduler::new(synthetic_cluster(2, 8), synthetic_queues(), Config::default())?;
//! s.submit(JobRequest {
//!     id: "train".into(),
//!     team: "vision".into(),
//!     queue: "default".into(),
//!     priority: 0,
//!     tasks_min: 2,
//!     tasks_max: 2,
//!     per_task: Resources { cpus_milli: 8_000, memory_bytes: 1 << 34, gpus_milli: 4_000, gpu_memory_bytes: 0 },
//!     spread: false,
//!     submitted_at_ms: 0,
//!     expected_runtime_ms: Some(3_600_000),
//!     avoid_nodes: Vec::new(),
//! })?;
//! let decisions = s.schedule(1_000);
//! let Decision::Place { assignments, .. } = &decisions[0] else { panic!("not placed") };
//! // Packed: both 4-GPU tasks on one node.
//! assert!(assignments.iter().all(|t| t.node == "node-00000"));
//! s.finish("train")?;
//! # Ok::<(), shoal_sched::SchedError>(())
//! ```

mod error;
mod fgd;
mod free;
mod model;
mod pending;
mod place;
mod policy;
mod scheduler;
mod synthetic;

pub use error::{Result, SchedError};
pub use model::{
    Config, Decision, Gpu, JobId, JobRequest, JobStatus, Node, NodeAllocation, PreemptReason, Queue, Quota, Resources,
    TaskPlacement,
};
pub use policy::{Ordering, Packing, Policy, UnknownPolicy};
pub use scheduler::Scheduler;
pub use synthetic::{SplitMix64, synthetic_cluster, synthetic_jobs, synthetic_queues};
