//! The control plane's shared state: [`Control`] (the store, the executor, the scheduler's books and what the loop
//! keeps per job), its configuration and the accessors every part of the loop uses.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use shoal_exec::{Executor, Task};
use shoal_sched::{Node, Queue, Scheduler};
use shoal_spec::JobSpec;

use crate::db::{Db, JobRow, MetricRow, TaskRow};
use crate::error::{ControlError, Result};

/// How the control loop behaves.
#[derive(Debug, Clone)]
pub struct ControlConfig {
    pub data_dir: PathBuf,
    /// The `shoal` executable that runs built-in jobs (`shoal worker`).
    pub worker_program: PathBuf,
    pub tick: Duration,
    /// Between SIGTERM and SIGKILL when stopping a job.
    pub kill_grace: Duration,
    /// Preempted jobs get this long to checkpoint and stop.
    pub preempt_grace: Duration,
    /// The scheduler's policy.
    pub sched_policy: shoal_sched::Policy,
    /// The price table for cost reports.
    pub prices: crate::cost::Prices,
    /// All-reduce `(bytes, bus bandwidth in bytes/s)` that `shoal bench` measured here (`DATA/bench.json`), the
    /// reference diagnosis compares a job's communication against; measured on first need when absent.
    pub bench: Vec<(u64, f64)>,
    /// What jobs may touch (checkpoint locations, loader variables).
    pub policy: crate::policy::Policy,
    /// The user tasks run as (`None`: the server's own).
    pub task_user: Option<shoal_exec::TaskUser>,
    /// The key job secrets are derived from (`DATA/server.key`).
    pub secret_key: Vec<u8>,
    /// This server's URL as tasks reach it (`--advertise-url`; by default its own address, loopback for an
    /// unspecified one) and the certificate file they trust for it (the `--tls-cert` chain): where workers send
    /// their heartbeats. `None`: tasks report through files only.
    pub server: Option<String>,
    pub server_ca: Option<String>,
}

/// Why a running job is being stopped.
#[derive(Debug, Clone)]
pub(super) enum StopWhy {
    Cancel,
    /// A task failed, was lost or broke a limit, or the job hung: restart or fail the job by its policy.
    Failure(String),
    /// The server could not place an adopted job again, or the scheduler shrinks it: requeue it.
    Requeue(String),
    /// The scheduler grows it: every worker checkpoints at its next step boundary, and the job is placed again at
    /// the larger size and resumes there.
    Resize(String),
}

/// A job being stopped: since when, whether SIGKILL was sent yet, and what follows once every process is gone.
#[derive(Debug)]
pub(super) struct Stop {
    pub(super) since: Instant,
    pub(super) killed: bool,
    pub(super) why: StopWhy,
}

/// The control plane's shared state.
#[derive(Debug)]
pub struct Control {
    pub db: Db,
    /// What runs the tasks (the local executor, Slurm's, or a scripted one in tests).
    pub exec: std::sync::Arc<dyn Executor>,
    pub config: ControlConfig,
    /// The cluster's nodes: this host, or what the executor describes (Slurm's nodes).
    pub nodes: Vec<Node>,
    pub queues: Vec<Queue>,
    pub(super) sched: Mutex<Scheduler>,
    pub wake: tokio::sync::Notify,
    pub(super) stopping: Mutex<HashMap<String, Stop>>,
    /// Per job and metrics file (rank; -1 = evaluations): bytes already read, and the newest step stored.
    pub(super) ingested: Mutex<HashMap<(String, i64), (u64, i64)>>,
    /// Per task: when it was last sampled and its CPU seconds then.
    pub(super) sampled: Mutex<HashMap<TaskKey, (i64, f64)>>,
    pub(super) net_prev: Mutex<Option<(Instant, u64, u64)>>,
    pub(super) net_last: Mutex<Option<(f64, f64)>>,
    pub(super) cluster_sampled: Mutex<i64>,
    /// The all-reduce reference, once measured or loaded (see [`ControlConfig::bench`]).
    pub bench: tokio::sync::Mutex<Vec<(u64, f64)>>,
    /// GPU telemetry (NVML with the `nvml` feature).
    pub gpus: crate::gpu::Gpus,
    /// Accumulating metrics (API requests, scheduling passes) for `/metrics`.
    pub metrics: crate::metrics::Metrics,
    /// Parsed specs by job id, as they run in the job's current phase (`[[phases]]`; the phase beside).
    pub(super) specs: Mutex<HashMap<String, (usize, std::sync::Arc<JobSpec>)>>,
    /// Per job with `[[phases]]`: the phase it is in (how many `phase` events it has; counted again from them
    /// after a server restart).
    pub(super) phases: Mutex<HashMap<String, usize>>,
    /// The last processing failure recorded per job.
    pub(super) trouble: Mutex<HashMap<String, String>>,
    /// Open event streams per caller (see [`crate::observe::StreamSlot`]).
    pub streams: Mutex<HashMap<String, usize>>,
    /// Per task: what its executor last said of why it waits (recorded as an event when it changes).
    pub(super) notes: Mutex<HashMap<TaskKey, String>>,
    /// Per running job: its ranks' heartbeats as last seen, and its step counter (`watch.rs`).
    pub(super) watched: Mutex<HashMap<String, Watch>>,
    /// Per job and rank: the newest heartbeat that came over HTTP (`watch.rs` takes it or the rank's file,
    /// whichever is newer).
    pub(super) heard: Mutex<HashMap<String, HashMap<i64, shoal_wire::Heartbeat>>>,
    /// Per restarted job: when it may start again (ms since the epoch) and the backoff it waits out.
    pub(super) backoff: Mutex<HashMap<String, (i64, Duration)>>,
    /// Per running job that replaces stragglers: its recent rows and diagnoses (`stragglers.rs`).
    pub(super) stragglers: Mutex<HashMap<String, Straggling>>,
    /// Per job whose straggler was replaced by shrinking it: the most workers it may be placed with.
    pub(super) shrunk: Mutex<HashMap<String, u32>>,
    /// Per job whose straggler was replaced: the nodes it ran on, which the job is placed elsewhere than if it can.
    pub(super) avoided: Mutex<HashMap<String, Vec<String>>>,
    /// Per elastic job regrouped in place: its current group (`group.rs`).
    pub(super) groups: Mutex<Groups>,
}

/// An attempt regrouped in place at least once.
pub(crate) struct Group {
    pub(super) attempt: i64,
    pub(super) generation: u32,
    /// The attempt's task numbers of the members, in rank order.
    pub(super) members: Vec<i64>,
    /// Where the group meets.
    pub(super) rendezvous: String,
    /// Newcomers not heard from yet: the members are told of the group once every newcomer has said it is there
    /// (its first heartbeat), so they train on while the newcomers start.
    pub(super) joining: Vec<i64>,
    /// The generation each task last said it trains in (its heartbeats), since the group was made.
    pub(super) heard: std::collections::HashMap<i64, u32>,
    /// Hosts the store while the group lives (shut down when dropped).
    pub(super) _store: shoal_comm::store::StoreServer,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("attempt", &self.attempt)
            .field("generation", &self.generation)
            .field("members", &self.members)
            .field("rendezvous", &self.rendezvous)
            .finish_non_exhaustive()
    }
}

/// The groups of running jobs, by job id.
pub(crate) type Groups = HashMap<String, Group>;

pub fn parse_stored_spec(job: &JobRow) -> Result<JobSpec> {
    let path = format!("job {} (stored spec)", job.id);
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| ControlError::Internal(format!("{path}: {e}")))?;
    Ok(spec)
}

impl Control {
    pub fn new(db: Db, config: ControlConfig, nodes: Vec<Node>, queues: Vec<Queue>) -> Result<Control> {
        let exec = std::sync::Arc::new(shoal_exec::LocalExecutor::new(&config.data_dir, config.task_user.clone()));
        Control::with_executor(db, config, nodes, queues, exec)
    }

    /// A control loop whose tasks `exec` runs.
    pub fn with_executor(
        db: Db,
        config: ControlConfig,
        nodes: Vec<Node>,
        queues: Vec<Queue>,
        exec: std::sync::Arc<dyn Executor>,
    ) -> Result<Control> {
        let sched_cfg = shoal_sched::Config {
            preempt_grace_ms: config.preempt_grace.as_millis() as u64,
            policy: config.sched_policy,
            ..shoal_sched::Config::default()
        };
        let sched = Scheduler::new(nodes.clone(), queues.clone(), sched_cfg)
            .map_err(|e| ControlError::Config(format!("cluster model: {e}")))?;
        let bench = config.bench.clone();
        Ok(Control {
            exec,
            db,
            config,
            nodes,
            queues,
            sched: Mutex::new(sched),
            wake: tokio::sync::Notify::new(),
            stopping: Mutex::new(HashMap::new()),
            ingested: Mutex::new(HashMap::new()),
            sampled: Mutex::new(HashMap::new()),
            net_prev: Mutex::new(None),
            net_last: Mutex::new(None),
            cluster_sampled: Mutex::new(0),
            bench: tokio::sync::Mutex::new(bench),
            gpus: crate::gpu::Gpus::new(),
            metrics: crate::metrics::Metrics::new(),
            specs: Mutex::new(HashMap::new()),
            trouble: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            notes: Mutex::new(HashMap::new()),
            watched: Mutex::new(HashMap::new()),
            heard: Mutex::new(HashMap::new()),
            phases: Mutex::new(HashMap::new()),
            backoff: Mutex::new(HashMap::new()),
            stragglers: Mutex::new(HashMap::new()),
            shrunk: Mutex::new(HashMap::new()),
            avoided: Mutex::new(HashMap::new()),
            groups: Mutex::new(HashMap::new()),
        })
    }

    pub(super) fn sched(&self) -> std::sync::MutexGuard<'_, Scheduler> {
        self.sched.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the scheduler's books (what is allocated, what waits) without changing them.
    pub fn with_scheduler<R>(&self, f: impl FnOnce(&Scheduler) -> R) -> R {
        f(&self.sched())
    }

    pub fn job_dir(&self, id: &str) -> PathBuf {
        self.config.data_dir.join("jobs").join(id)
    }

    pub fn run_dir(&self, id: &str) -> PathBuf {
        self.job_dir(id).join("run")
    }

    /// Allocations per node from the scheduler's books.
    pub fn allocations(&self) -> Vec<shoal_sched::NodeAllocation> {
        self.sched().allocations()
    }

    pub fn pending_in_scheduler(&self) -> usize {
        self.sched().pending_count()
    }

    /// A job's spec, parsed once and kept (a stored spec never changes).
    pub fn spec_of(&self, job: &JobRow) -> Result<std::sync::Arc<JobSpec>> {
        let phase = self.phases.lock().unwrap_or_else(|p| p.into_inner()).get(&job.id).copied().unwrap_or(0);
        if let Some((at, s)) = self.specs.lock().unwrap_or_else(|p| p.into_inner()).get(&job.id)
            && *at == phase
        {
            return Ok(s.clone());
        }
        let stored = parse_stored_spec(job)?;
        let spec = std::sync::Arc::new(if stored.phases.is_empty() { stored } else { stored.in_phase(phase) });
        self.specs.lock().unwrap_or_else(|p| p.into_inner()).insert(job.id.clone(), (phase, spec.clone()));
        Ok(spec)
    }

    /// The secret a job's workers authenticate with: derived from the job id under the server's key (nothing
    /// secret is stored), or the one stored by an older server.
    pub fn job_secret(&self, job: &JobRow) -> String {
        if !job.secret.is_empty() {
            return job.secret.clone();
        }
        crate::auth::derive_secret(&self.config.secret_key, &job.id)
    }
}

/// A rank's heartbeat as last read, and when (by this server's clock) it last changed.
#[derive(Debug)]
pub(super) struct Seen {
    pub(super) hb: shoal_wire::Heartbeat,
    pub(super) changed: Instant,
}

/// What the control loop keeps of one running job's heartbeats.
#[derive(Debug)]
pub(crate) struct Watch {
    pub(super) attempt: i64,
    pub(super) ranks: HashMap<i64, Seen>,
    /// The highest step any rank reported.
    pub(super) step: u64,
    /// The step the attempt was first seen training at: it trained when `step` went past it.
    pub(super) first_step: Option<u64>,
    /// When that step counter last moved, or when every rank was first seen training; `None` while not every
    /// rank trains (starting, resuming, finishing), when no hang is judged.
    pub(super) step_moved: Option<Instant>,
    /// Where the attempt said it took its state from, as last recorded in a `resumed` event (a group that regroups
    /// in place and rolls back to a copy says so again).
    pub(super) resume_told: Option<String>,
    /// Whether the attempt's `strategy` event (what `train.strategy = "auto"` chose) was recorded.
    pub(super) strategy_told: bool,
}

impl Watch {
    pub(super) fn new(attempt: i64) -> Watch {
        Watch {
            attempt,
            ranks: HashMap::new(),
            step: 0,
            first_step: None,
            step_moved: None,
            resume_told: None,
            strategy_told: false,
        }
    }
}

/// What is kept of one job's recent rows and diagnoses.
#[derive(Debug, Default)]
pub(crate) struct Straggling {
    pub(super) attempt: i64,
    /// Rows after this step are read next.
    pub(super) after_step: i64,
    pub(super) rows: Vec<MetricRow>,
    /// The row time of the last diagnosis.
    pub(super) judged_ms: i64,
    /// The rank named in every diagnosis since (row time of the first of them), with the last evidence.
    pub(super) named: Option<(i64, i64, String)>,
    /// Whether it was told that no restart is left to replace it.
    pub(super) told: bool,
}

/// What the executor needs to find a stored task again.
pub fn handle(t: &TaskRow) -> Task {
    Task {
        job_id: t.job_id.clone(),
        attempt: t.attempt,
        rank: t.rank,
        host: t.host.clone(),
        pid: t.pid,
        worker_pid: t.worker_pid,
        start_ticks: t.start_ticks,
        cpus: t.cpus.clone(),
        gpus: t.gpus.clone(),
        started_ms: t.started_ms,
        external_id: t.external_id.clone(),
    }
}

/// A task: job id, attempt, rank.
pub(super) type TaskKey = (String, i64, i64);
