//! The cluster model, job requests and scheduling decisions (plain data).

use std::collections::BTreeMap;

use crate::policy::Policy;

/// A job's id, chosen by the caller.
pub type JobId = String;

/// One accelerator of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Index on its node (what `CUDA_VISIBLE_DEVICES` names).
    pub index: u32,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// Model name, e.g. `"H100"`.
    pub kind: String,
}

/// One machine of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Unique id.
    pub id: String,
    /// Host name.
    pub host: String,
    /// CPU in thousandths of a core.
    pub cpus_milli: u64,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Its GPUs.
    pub gpus: Vec<Gpu>,
    /// Free-form labels.
    pub labels: BTreeMap<String, String>,
}

/// What one task asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Resources {
    /// CPU in thousandths of a core.
    pub cpus_milli: u64,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// GPUs in thousandths: 1000 is one whole GPU, a multiple of 1000 is that many
    /// whole GPUs, below 1000 is a fractional share of one GPU.
    pub gpus_milli: u64,
    /// Device memory needed on each GPU the task uses.
    pub gpu_memory_bytes: u64,
}

/// A queue's guaranteed share, in the units of [`Resources`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quota {
    /// CPU in thousandths of a core.
    pub cpus_milli: u64,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// GPUs in thousandths.
    pub gpus_milli: u64,
}

impl Quota {
    /// No limit at all.
    pub const UNLIMITED: Quota = Quota { cpus_milli: u64::MAX, memory_bytes: u64::MAX, gpus_milli: u64::MAX };
}

/// A queue: a guaranteed share, and whether it may use more while others leave
/// theirs idle (borrowed capacity is reclaimed by preemption when its owner needs it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queue {
    /// Unique name.
    pub name: String,
    /// What the queue is guaranteed.
    pub guaranteed: Quota,
    /// Whether jobs may run beyond the guarantee on idle capacity.
    pub can_borrow: bool,
}

/// A job: a gang of `tasks_min..=tasks_max` identical tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRequest {
    /// Unique id.
    pub id: JobId,
    /// Team, for fair share.
    pub team: String,
    /// Queue name; must exist.
    pub queue: String,
    /// Higher runs first and may preempt lower.
    pub priority: i32,
    /// The job starts with at least this many tasks, all at once.
    pub tasks_min: u32,
    /// And grows up to this many.
    pub tasks_max: u32,
    /// What each task asks for.
    pub per_task: Resources,
    /// One task per node instead of packing.
    pub spread: bool,
    /// Submission time (FIFO order).
    pub submitted_at_ms: u64,
    /// The user's estimate of the run time, used by backfill.
    pub expected_runtime_ms: Option<u64>,
    /// Nodes to place it elsewhere than when it can (the node of a straggler it was restarted without).
    pub avoid_nodes: Vec<String>,
}

/// Where one task runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskPlacement {
    /// Node id.
    pub node: String,
    /// `(gpu index, share in thousandths)`; 1000 is the whole GPU.
    pub gpus: Vec<(u32, u32)>,
}

/// Why a job is preempted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreemptReason {
    /// A pending job of higher priority needs the room.
    Priority { by: JobId },
    /// The job's queue borrowed capacity that its owner queue now needs.
    QuotaReclaim { owner_queue: String, by: JobId },
}

/// What the caller must carry out, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Start every task of the job at once.
    Place { job: JobId, assignments: Vec<TaskPlacement> },
    /// Ask the job to checkpoint and stop within `grace_ms`; its resources stay
    /// held until then, after which it is requeued ([`Decision::Requeue`]).
    Preempt { job: JobId, reason: PreemptReason, grace_ms: u64 },
    /// The preempted job's grace period is over: its resources are free and it
    /// is pending again (it resumes from its checkpoint when placed).
    Requeue { job: JobId },
    /// Add these tasks to a running elastic job.
    Grow { job: JobId, tasks: Vec<TaskPlacement> },
    /// Remove the job's last `by` tasks (its highest ranks); their resources are
    /// counted free at once, so stop them before starting what follows.
    Shrink { job: JobId, by: u32, for_job: JobId },
}

/// Configuration of a [`crate::Scheduler`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Grace period given to a preempted job.
    pub preempt_grace_ms: u64,
    /// How many pending jobs per pass may try shrink/preemption.
    pub max_preemption_tries_per_pass: usize,
    /// The most tasks one job may ask for (`tasks_max`).
    pub max_tasks_per_job: u32,
    /// How pending jobs are ordered and their tasks packed.
    pub policy: Policy,
    /// [`crate::Ordering::Las`]: the attained service (GPU-milliseconds: one GPU held for one millisecond; a task
    /// without GPUs counts as one GPU) at which a job moves down a level, ascending. Level `i` holds jobs below
    /// threshold `i`; the last level everything above the last threshold.
    pub las_thresholds_gpu_ms: Vec<u64>,
    /// [`crate::Packing::Fgd`]: how many of the latest submitted jobs' task shapes make the workload that
    /// fragmentation is measured against (at most the 16 commonest shapes among them are used).
    pub shape_window: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            preempt_grace_ms: 30_000,
            max_preemption_tries_per_pass: 8,
            max_tasks_per_job: 65_536,
            policy: Policy::default(),
            las_thresholds_gpu_ms: vec![3_600_000, 36_000_000],
            shape_window: 1_000,
        }
    }
}

/// Where a job stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobStatus {
    /// Waiting.
    Pending,
    /// Running with these tasks since `started_ms`.
    Running { started_ms: u64, tasks: Vec<TaskPlacement> },
    /// Preempted, holding its resources until `until_ms`.
    Draining { until_ms: u64 },
}

/// What is allocated on one node (for checks and displays).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAllocation {
    /// Node id.
    pub node: String,
    /// CPU allocated, thousandths.
    pub cpus_milli: u64,
    /// Memory allocated.
    pub memory_bytes: u64,
    /// Per GPU: `(share allocated in thousandths, memory allocated)`.
    pub gpus: Vec<(u32, u64)>,
}
