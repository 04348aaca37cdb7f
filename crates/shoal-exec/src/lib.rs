//! `shoal-exec`: Shoal's launch layer — every process of a job starts here.
//!
//! - [`Executor`] ([`executor`]): what the control loop asks of whatever runs its tasks — start one with the
//!   environment contract, probe it, stop it, inject a fault into it on purpose (`shoal chaos`: SIGKILL or SIGSTOP
//!   of the training process), sample it, adopt it after a restart, find strays, say where its log is and where
//!   its job's rendezvous is hosted, clear what an ended job left on its hosts (`job_ended`: the local executor
//!   removes its in-memory checkpoints from `/dev/shm`). [`LocalExecutor`] ([`local`]) runs tasks as processes of this
//!   machine that outlive the server; [`SlurmExecutor`] ([`slurm`]) runs a job's gang as one Slurm allocation, a
//!   step per rank; `KubeExecutor` (`kubernetes`, feature `kubernetes`) runs an attempt as a headless Service and a
//!   Pod per rank through a Kubernetes API server, watching the Pods.
//! - [`launch`]: the attached launcher of `shoal run` and `shoal bench` — ranks as children that live and die with
//!   it, output passed on by rank, one gang supervised.
//! - [`procfs`]: what both read of processes and the machine.
//! - [`k8s`]: the Kubernetes objects that run a job (ConfigMap, Secret, headless Service, a Pod per rank) as JSON
//!   values, and a YAML writer for them: what `shoal k8s manifests` prints; the Kubernetes executor builds its
//!   objects from the same pieces.
//! - `fake` (feature `fake`): a scripted executor for the control loop's unit tests.
//!
//! Invariants:
//! - The environment contract is written only by `shoal_comm::env::TaskEnv::vars`, and it reaches a process only
//!   through this crate (`executor::task_env`, for a local process's command or a Slurm step's exports): no other
//!   code sets a task's contract variables.
//! - Nothing started here is left behind: a local task is over only when every process of its session is gone, a
//!   Slurm task's success only once its allocation has ended; an attached rank dies with its launcher (death
//!   signal, process group, a guard process, subreaping).
//! - A local task is identified by its PID *and* its start time, so a reused PID is never signalled or taken for
//!   it; a Slurm task by its Slurm job id.
//! - Nothing of the control plane's store: the control loop maps its rows to [`Task`]. No async runtime, except the
//!   Kubernetes executor's own, on its own thread (kube-rs is async): its trait calls block at most a bounded time.

pub mod error;
pub mod executor;
#[cfg(feature = "fake")]
pub mod fake;
pub mod k8s;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
pub mod launch;
pub mod local;
pub mod procfs;
pub mod slurm;

pub use error::{ExecError, Result, SpawnError};
pub use executor::{
    Executor, Fault, GangError, Join, NodeInfo, STOPPED_EXIT, Stop, Stray, Task, TaskLaunch, TaskStatus, Usage,
};
#[cfg(feature = "kubernetes")]
pub use kubernetes::{KubeExecutor, KubeOptions};
pub use local::{DEFAULT_TASK_USER, LocalExecutor, TaskUser};
pub use slurm::SlurmExecutor;
