//! The crate's one error type.

/// What can go wrong when talking to the scheduler. Variants carry facts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    /// `tasks_min` is greater than `tasks_max`.
    #[error("job {job}: tasks_min ({min}) is greater than tasks_max ({max})")]
    MinAboveMax { job: String, min: u32, max: u32 },
    /// The job asks for no tasks at all.
    #[error("job {job}: {field} must be at least 1")]
    ZeroTasks { job: String, field: &'static str },
    /// More tasks than the scheduler's configured limit.
    #[error("job {job}: tasks_max ({tasks_max}) is above the limit of {limit} tasks per job")]
    TooManyTasks { job: String, tasks_max: u32, limit: u32 },
    /// A task that asks for nothing at all.
    #[error("job {job}: per_task asks for no CPU, memory or GPU")]
    EmptyRequest { job: String },
    /// One GPU or more must be whole GPUs (fractions only below one GPU).
    #[error(
        "job {job}: per_task.gpus_milli = {gpus_milli}: a request of one GPU or more must be a multiple of 1000 (whole GPUs)"
    )]
    FractionalMultiGpu { job: String, gpus_milli: u64 },
    /// A GPU-memory request without any GPU.
    #[error("job {job}: per_task.gpu_memory_bytes = {gpu_memory_bytes} but per_task.gpus_milli is 0")]
    GpuMemoryWithoutGpu { job: String, gpu_memory_bytes: u64 },
    /// No node of the cluster could ever hold one task (or the gang).
    #[error("job {job}: {field}: can never run: asks {asked}, {limit}")]
    NeverFits { job: String, field: &'static str, asked: String, limit: String },
    /// The queue cannot borrow and its guarantee is smaller than the job's minimum gang.
    #[error(
        "job {job}: queue {queue:?} cannot borrow and its guaranteed {field} ({guaranteed}) is below the job's minimum ({asked})"
    )]
    AboveQuota { job: String, queue: String, field: &'static str, asked: u64, guaranteed: u64 },
    /// The job names a queue that does not exist.
    #[error("job {job}: unknown queue {queue:?}")]
    UnknownQueue { job: String, queue: String },
    /// A job with this id is already known.
    #[error("job {job}: already submitted")]
    DuplicateJob { job: String },
    /// No job with this id is known.
    #[error("unknown job {job}")]
    UnknownJob { job: String },
    /// Two nodes share one id.
    #[error("node {node}: duplicate node id")]
    DuplicateNode { node: String },
    /// Two queues share one name.
    #[error("queue {queue}: duplicate queue name")]
    DuplicateQueue { queue: String },
}

/// `Result` with [`SchedError`].
pub type Result<T, E = SchedError> = std::result::Result<T, E>;
