//! The control loop: keeps the store, the scheduler and the processes in agreement.
//!
//! Every tick (and at once after a submission or a cancellation) it
//! 1. probes the tasks of running jobs: a job whose tasks all exited 0 succeeded; one with a task that failed,
//!    was lost or went over its memory is stopped whole, then restarted (pending again, `restarts + 1`) while its
//!    restart budget lasts, else failed;
//! 2. carries out cancellations (SIGTERM to every task's process group, SIGKILL after the grace period);
//! 3. copies new lines of rank 0's `metrics.jsonl` into the store;
//! 4. hands pending jobs to the scheduler and carries out its decisions (place: start every task; preempt: SIGTERM
//!    and hold the resources for the grace period; requeue: make sure nothing runs, then pending again).
//!
//! **A job never runs twice at once**: it goes back to pending only after every process of its attempt is gone
//! (probed dead), and the data directory is locked by one server.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use shoal_sched::{Decision, JobRequest, Node, PreemptReason, Queue, Resources, Scheduler, TaskPlacement};
use shoal_spec::JobSpec;

use crate::db::{ClusterSample, Db, JobRow, JobState, MetricRow, SampleRow, TaskRow, TaskState, Transition, now};
use crate::error::{ControlError, Result};
use shoal_exec::{Executor, Stop as Halt, Task, TaskLaunch, TaskStatus, Usage};

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
}

/// Why a running job is being stopped.
#[derive(Debug, Clone)]
enum StopWhy {
    Cancel,
    /// A task failed, was lost or broke a limit: restart or fail the job.
    Failure(String),
    /// The server could not place an adopted job again: requeue it.
    Requeue(String),
}

#[derive(Debug)]
struct Stop {
    since: Instant,
    killed: bool,
    why: StopWhy,
}

/// The control plane's shared state.
#[derive(Debug)]
pub struct Control {
    pub db: Db,
    /// What runs the tasks (the local executor, or a scripted one in tests).
    pub exec: std::sync::Arc<dyn Executor>,
    pub config: ControlConfig,
    pub node: Node,
    pub queues: Vec<Queue>,
    sched: Mutex<Scheduler>,
    pub wake: tokio::sync::Notify,
    stopping: Mutex<HashMap<String, Stop>>,
    /// Per job and metrics file (rank; -1 = evaluations): bytes already read, and the newest step stored.
    ingested: Mutex<HashMap<(String, i64), (u64, i64)>>,
    /// Per task: when it was last sampled and its CPU seconds then.
    sampled: Mutex<HashMap<TaskKey, (i64, f64)>>,
    net_prev: Mutex<Option<(Instant, u64, u64)>>,
    net_last: Mutex<Option<(f64, f64)>>,
    cluster_sampled: Mutex<i64>,
    /// The all-reduce reference, once measured or loaded (see [`ControlConfig::bench`]).
    pub bench: tokio::sync::Mutex<Vec<(u64, f64)>>,
    /// GPU telemetry (NVML with the `nvml` feature).
    pub gpus: crate::gpu::Gpus,
    /// Accumulating metrics (API requests, scheduling passes) for `/metrics`.
    pub metrics: crate::metrics::Metrics,
    /// Parsed specs by job id.
    specs: Mutex<HashMap<String, std::sync::Arc<JobSpec>>>,
    /// The last processing failure recorded per job.
    trouble: Mutex<HashMap<String, String>>,
    /// Open event streams per caller (see [`crate::observe::StreamSlot`]).
    pub streams: Mutex<HashMap<String, usize>>,
}

/// The scheduler's view of a job's request.
pub fn request_of(job: &JobRow, spec: &JobSpec) -> JobRequest {
    let (lo, hi) = spec.workers.range();
    JobRequest {
        id: job.id.clone(),
        team: job.team.clone(),
        queue: job.queue.clone(),
        priority: job.priority as i32,
        tasks_min: lo,
        tasks_max: hi,
        per_task: resources_of(spec),
        spread: spec.workers.spread,
        submitted_at_ms: job.created_ms.max(0) as u64,
        expected_runtime_ms: None,
    }
}

pub fn resources_of(spec: &JobSpec) -> Resources {
    Resources {
        cpus_milli: spec.resources.cpus,
        memory_bytes: spec.resources.memory,
        gpus_milli: spec.resources.gpus,
        gpu_memory_bytes: spec.resources.gpu_memory,
    }
}

pub fn parse_stored_spec(job: &JobRow) -> Result<JobSpec> {
    let path = format!("job {} (stored spec)", job.id);
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| ControlError::Internal(format!("{path}: {e}")))?;
    Ok(spec)
}

/// The spec's key for a field of the scheduler's request.
fn spec_key(sched_field: &str) -> &'static str {
    match sched_field {
        "per_task.cpus_milli" => "resources.cpus",
        "per_task.memory_bytes" => "resources.memory",
        "per_task.gpus_milli" => "resources.gpus",
        "per_task.gpu_memory_bytes" => "resources.gpu_memory",
        "per_task" => "resources",
        _ => "workers",
    }
}

fn mib(b: u64) -> String {
    if b >= 1 << 30 { format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64) } else { format!("{} MiB", b >> 20) }
}

impl Control {
    pub fn new(db: Db, config: ControlConfig, node: Node, queues: Vec<Queue>) -> Result<Control> {
        let exec = std::sync::Arc::new(shoal_exec::LocalExecutor::new(&config.data_dir, config.task_user.clone()));
        Control::with_executor(db, config, node, queues, exec)
    }

    /// A control loop whose tasks `exec` runs.
    pub fn with_executor(
        db: Db,
        config: ControlConfig,
        node: Node,
        queues: Vec<Queue>,
        exec: std::sync::Arc<dyn Executor>,
    ) -> Result<Control> {
        let sched_cfg = shoal_sched::Config {
            preempt_grace_ms: config.preempt_grace.as_millis() as u64,
            ..shoal_sched::Config::default()
        };
        let sched = Scheduler::new(vec![node.clone()], queues.clone(), sched_cfg)
            .map_err(|e| ControlError::Config(format!("cluster model: {e}")))?;
        let bench = config.bench.clone();
        Ok(Control {
            exec,
            db,
            config,
            node,
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
        })
    }

    fn sched(&self) -> std::sync::MutexGuard<'_, Scheduler> {
        self.sched.lock().unwrap_or_else(|p| p.into_inner())
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

    /// Whether a job could ever run here, by the scheduler's own admission check; a refusal names the spec's key
    /// (`resources.gpus`, `workers`, `queue`, ...) rather than the scheduler's field.
    pub fn admissible(&self, team: &str, spec: &JobSpec) -> Result<()> {
        let (lo, hi) = spec.workers.range();
        let req = JobRequest {
            id: "(submitted)".into(),
            team: team.to_owned(),
            queue: spec.queue.clone(),
            priority: spec.priority,
            tasks_min: lo,
            tasks_max: hi,
            per_task: resources_of(spec),
            spread: spec.workers.spread,
            submitted_at_ms: 0,
            expected_runtime_ms: None,
        };
        let refused = self.sched().admissible(&req);
        refused.map_err(|e| {
            use shoal_sched::SchedError as E;
            let field = match &e {
                E::NeverFits { field, .. } => spec_key(field),
                E::ZeroTasks { .. } | E::MinAboveMax { .. } | E::TooManyTasks { .. } => "workers",
                E::EmptyRequest { .. } => "resources",
                E::FractionalMultiGpu { .. } => "resources.gpus",
                E::GpuMemoryWithoutGpu { .. } => "resources.gpu_memory",
                E::AboveQuota { .. } | E::UnknownQueue { .. } => "queue",
                _ => "",
            };
            let message = match &e {
                E::NeverFits { asked, limit, .. } => format!("can never run: asks {asked}, {limit}"),
                other => other.to_string().replace("job (submitted): ", ""),
            };
            ControlError::BadRequest { message, field: (!field.is_empty()).then(|| field.to_owned()) }
        })
    }

    /// After a restart: adopt the tasks that still run, rebuild the scheduler's books, and requeue what cannot be
    /// placed again.
    pub async fn recover(&self) -> Result<()> {
        let active = self.db.jobs_in(&[JobState::Running, JobState::Preempted]).await?;
        let mut adopted_sessions = HashSet::new();
        for job in &active {
            let tasks = self.db.tasks(&job.id, job.attempt).await?;
            let alive: Vec<&TaskRow> = tasks
                .iter()
                // A task the executor cannot tell about now counts as running: the loop probes it again.
                .filter(|t| {
                    t.state == TaskState::Running
                        && !matches!(self.exec.probe(&handle(t)), Ok(s) if s != TaskStatus::Running)
                })
                .collect();
            for t in &alive {
                self.exec.adopt(&handle(t));
                adopted_sessions.extend(t.pid);
            }
            if job.state == JobState::Preempted {
                self.begin_stop(
                    job,
                    &tasks,
                    StopWhy::Requeue("the server restarted during its preemption grace period".into()),
                );
                continue;
            }
            let pids: Vec<String> = alive.iter().filter_map(|t| t.pid.map(|p| p.to_string())).collect();
            self.db
                .event(
                    &job.id,
                    "adopted",
                    job.state,
                    &format!(
                        "the server restarted; {} of {} workers still running (pids {}), taken over",
                        alive.len(),
                        tasks.len(),
                        if pids.is_empty() { "none".into() } else { pids.join(", ") }
                    ),
                )
                .await?;
            let spec = self.spec_of(job)?;
            let mut req = request_of(job, &spec);
            req.tasks_min = job.workers.max(1) as u32;
            req.tasks_max = req.tasks_min;
            let submitted = self.sched().submit(req);
            if let Err(e) = submitted {
                self.begin_stop(
                    job,
                    &tasks,
                    StopWhy::Requeue(format!("cannot re-register it with the scheduler: {e}")),
                );
            }
        }
        // Strays: processes of this server that belong to no task it knows to be running (started just before a
        // crash, before their task was recorded). Nothing of a job may run beside its next attempt.
        for stray in self.exec.strays(&adopted_sessions) {
            tracing::warn!(pid = stray.pid, job = %stray.job_id, "killing a stray process of this server");
            self.exec.kill_stray(&stray);
            if let Ok(Some(j)) = self.db.job(&stray.job_id).await {
                let message = format!("killed stray process {} found after a restart", stray.pid);
                self.db.event(&j.id, "warning", j.state, &message).await?;
            }
        }
        // Hold the adopted jobs' resources before anything pending is considered.
        let decisions = self.sched().schedule(now() as u64);
        let placed: HashSet<String> = decisions
            .iter()
            .filter_map(|d| if let Decision::Place { job, .. } = d { Some(job.clone()) } else { None })
            .collect();
        for job in active.iter().filter(|j| j.state == JobState::Running) {
            if !placed.contains(&job.id) && !self.is_stopping(&job.id) {
                let tasks = self.db.tasks(&job.id, job.attempt).await?;
                let _ = self.sched().finish(&job.id);
                self.begin_stop(job, &tasks, StopWhy::Requeue("it no longer fits this server's capacity".into()));
            }
        }
        Ok(())
    }

    fn is_stopping(&self, id: &str) -> bool {
        self.stopping.lock().unwrap_or_else(|p| p.into_inner()).contains_key(id)
    }

    fn begin_stop(&self, job: &JobRow, tasks: &[TaskRow], why: StopWhy) {
        let mut stopping = self.stopping.lock().unwrap_or_else(|p| p.into_inner());
        if stopping.contains_key(&job.id) {
            return;
        }
        tracing::info!(job = %job.id, ?why, "stopping job");
        for t in tasks.iter().filter(|t| t.state == TaskState::Running) {
            self.exec.stop(&handle(t), Halt::Term);
        }
        stopping.insert(job.id.clone(), Stop { since: Instant::now(), killed: false, why });
    }

    /// Runs the loop until `shutdown` resolves.
    pub async fn run(self: std::sync::Arc<Self>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        loop {
            if let Err(e) = self.tick().await {
                tracing::error!(error = %e, "control loop tick failed");
            }
            tokio::select! {
                _ = tokio::time::sleep(self.config.tick) => {}
                _ = self.wake.notified() => {}
                _ = shutdown.changed() => return,
            }
        }
    }

    /// One pass of the loop.
    pub async fn tick(&self) -> Result<()> {
        let active = self.db.jobs_in(&[JobState::Pending, JobState::Running, JobState::Preempted]).await?;
        self.sample_cluster(&active).await;
        for job in &active {
            // One job's trouble is its own: it is recorded on that job and the loop goes on for the others.
            let done = match job.state {
                JobState::Pending => self.tick_pending(job).await,
                JobState::Running | JobState::Preempted => self.tick_running(job).await,
                _ => Ok(()),
            };
            if let Err(e) = done {
                self.job_trouble(job, &e).await;
            }
        }
        // What is kept per job lives as long as the job is active.
        let ids: HashSet<&str> = active.iter().map(|j| j.id.as_str()).collect();
        self.specs.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| ids.contains(id.as_str()));
        self.trouble.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| ids.contains(id.as_str()));
        let t0 = Instant::now();
        let decisions = self.sched().schedule(now() as u64);
        self.metrics.scheduler_pass.with_label_values(&[] as &[&str]).observe(t0.elapsed().as_secs_f64());
        for d in decisions {
            if let Err(e) = self.carry_out(d).await {
                tracing::error!(error = %e, "carrying out a scheduling decision failed");
            }
        }
        Ok(())
    }

    /// Records that processing `job` failed this tick, once per distinct reason (a warning event and a log line),
    /// so a job that keeps failing does not flood its events.
    async fn job_trouble(&self, job: &JobRow, e: &ControlError) {
        let why = format!("the control loop could not process this job: {e}");
        let fresh = self.trouble.lock().unwrap_or_else(|p| p.into_inner()).insert(job.id.clone(), why.clone())
            != Some(why.clone());
        if fresh {
            tracing::error!(job = %job.id, error = %e, "processing a job failed; the others go on");
            if let Err(e2) = self.db.event(&job.id, "warning", job.state, &why).await {
                tracing::error!(job = %job.id, error = %e2, "recording a job's trouble failed");
            }
        }
    }

    /// A job's spec, parsed once and kept (a stored spec never changes).
    pub fn spec_of(&self, job: &JobRow) -> Result<std::sync::Arc<JobSpec>> {
        if let Some(s) = self.specs.lock().unwrap_or_else(|p| p.into_inner()).get(&job.id) {
            return Ok(s.clone());
        }
        let spec = std::sync::Arc::new(parse_stored_spec(job)?);
        self.specs.lock().unwrap_or_else(|p| p.into_inner()).insert(job.id.clone(), spec.clone());
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

    async fn tick_pending(&self, job: &JobRow) -> Result<()> {
        if job.cancel_requested {
            let _ = self.sched().finish(&job.id);
            self.db
                .transition(
                    &job.id,
                    &[JobState::Pending],
                    JobState::Cancelled,
                    Transition {
                        kind: "cancelled",
                        message: "cancelled before it started".into(),
                        finished_ms: Some(now()),
                        ..Default::default()
                    },
                )
                .await?;
            return Ok(());
        }
        if self.sched().status(&job.id).is_none() {
            let spec = self.spec_of(job)?;
            let submitted = self.sched().submit(request_of(job, &spec));
            if let Err(e) = submitted {
                self.db
                    .transition(
                        &job.id,
                        &[JobState::Pending],
                        JobState::Failed,
                        Transition {
                            kind: "failed",
                            message: format!("the scheduler refused it: {e}"),
                            finished_ms: Some(now()),
                            ..Default::default()
                        },
                    )
                    .await?;
            }
        }
        Ok(())
    }

    async fn tick_running(&self, job: &JobRow) -> Result<()> {
        let spec = self.spec_of(job)?;
        let tasks = self.db.tasks(&job.id, job.attempt).await?;
        if tasks.is_empty() || tasks.iter().any(|t| t.state == TaskState::Starting) {
            // A start that never completed (the server stopped half-way): whatever of it ran unrecorded was killed
            // as a stray at recovery; what was recorded is stopped, then the attempt starts again.
            self.begin_stop(
                job,
                &tasks,
                StopWhy::Requeue(format!("attempt {} never finished starting; starting it again", job.attempt)),
            );
        }
        let mut statuses = Vec::with_capacity(tasks.len());
        let mut usage: HashMap<i64, Usage> = HashMap::new();
        let net = self.net_rates();
        for t in &tasks {
            if t.state == TaskState::Running
                && let Some(u) = self.sample(t, net).await
            {
                usage.insert(t.rank, u);
            }
            let st = if t.state == TaskState::Running {
                // The executor cannot tell (its cluster manager does not answer): this job waits, the others go on.
                self.exec.probe(&handle(t))?
            } else {
                TaskStatus::Exited(t.exit_code.unwrap_or(-1) as i32)
            };
            if t.state == TaskState::Running && st != TaskStatus::Running {
                self.record_end(t, &st).await?;
            }
            statuses.push((t, st));
        }
        self.ingest_metrics(&job.id, job.workers).await;

        let stop = {
            let stopping = self.stopping.lock().unwrap_or_else(|p| p.into_inner());
            stopping.get(&job.id).map(|s| (s.since, s.killed, s.why.clone()))
        };
        let any_running = statuses.iter().any(|(_, s)| *s == TaskStatus::Running);
        if let Some((since, killed, why)) = stop {
            if any_running {
                if !killed && since.elapsed() >= self.config.kill_grace {
                    for (t, s) in &statuses {
                        if *s == TaskStatus::Running {
                            self.exec.stop(&handle(t), Halt::Kill);
                        }
                    }
                    if let Some(s) = self.stopping.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&job.id) {
                        s.killed = true;
                    }
                }
                return Ok(());
            }
            // Every process of the attempt is gone: only now may the job change hands.
            self.stopping.lock().unwrap_or_else(|p| p.into_inner()).remove(&job.id);
            let _ = self.sched().finish(&job.id);
            return self.stopped(job, &spec, why).await;
        }

        if job.cancel_requested {
            self.begin_stop(job, &tasks, StopWhy::Cancel);
            return Ok(());
        }
        if job.state == JobState::Preempted {
            // Draining: the scheduler says when its grace is over (Requeue).
            return Ok(());
        }
        // Memory limits.
        for (t, s) in &statuses {
            if *s == TaskStatus::Running
                && let Some(rss) = usage.get(&t.rank).map(|u| u.rss_bytes)
                && rss > spec.resources.memory
            {
                let why = format!(
                    "rank {} used {} of memory, over its request of {} (resources.memory): killed",
                    t.rank,
                    mib(rss),
                    mib(spec.resources.memory)
                );
                self.db.event(&job.id, "warning", job.state, &why).await?;
                self.begin_stop(job, &tasks, StopWhy::Failure(why));
                return Ok(());
            }
        }
        let failed = statuses.iter().find_map(|(t, s)| match s {
            TaskStatus::Exited(c) if *c != 0 => {
                Some(format!("rank {} exited with status {c}{}", t.rank, signal_note(*c)))
            }
            TaskStatus::Lost(why) => Some(format!("rank {} was lost: {why}", t.rank)),
            _ => None,
        });
        if let Some(why) = failed {
            self.begin_stop(job, &tasks, StopWhy::Failure(why));
            return Ok(());
        }
        if !statuses.is_empty() && statuses.iter().all(|(_, s)| *s == TaskStatus::Exited(0)) {
            let _ = self.sched().finish(&job.id);
            let summary = std::fs::read_to_string(self.run_dir(&job.id).join("summary.json")).ok();
            self.ingest_metrics(&job.id, job.workers).await;
            self.db
                .transition(
                    &job.id,
                    &[JobState::Running],
                    JobState::Succeeded,
                    Transition {
                        kind: "succeeded",
                        message: format!("all {} workers exited 0", statuses.len()),
                        finished_ms: Some(now()),
                        summary,
                        ..Default::default()
                    },
                )
                .await?;
        }
        Ok(())
    }

    /// A job whose processes are all gone: cancelled, restarted, failed or requeued.
    async fn stopped(&self, job: &JobRow, spec: &JobSpec, why: StopWhy) -> Result<()> {
        let from = [JobState::Running, JobState::Preempted];
        match why {
            StopWhy::Cancel => {
                self.db
                    .transition(
                        &job.id,
                        &from,
                        JobState::Cancelled,
                        Transition {
                            kind: "cancelled",
                            message: "cancelled; every worker stopped".into(),
                            finished_ms: Some(now()),
                            ..Default::default()
                        },
                    )
                    .await?;
            }
            StopWhy::Failure(why) if (job.restarts as u64) < u64::from(spec.restart.max) => {
                self.db
                    .transition(
                        &job.id,
                        &from,
                        JobState::Pending,
                        Transition {
                            kind: "restarted",
                            message: format!(
                                "{why}; restart {} of {} (resumes from its newest checkpoint)",
                                job.restarts + 1,
                                spec.restart.max
                            ),
                            restarts: Some(job.restarts + 1),
                            ..Default::default()
                        },
                    )
                    .await?;
            }
            StopWhy::Failure(why) => {
                let message = if spec.restart.max == 0 {
                    why
                } else {
                    format!("{why}; no restarts left ({} used)", job.restarts)
                };
                self.db
                    .transition(
                        &job.id,
                        &from,
                        JobState::Failed,
                        Transition { kind: "failed", message, finished_ms: Some(now()), ..Default::default() },
                    )
                    .await?;
            }
            StopWhy::Requeue(why) => {
                self.db
                    .transition(
                        &job.id,
                        &from,
                        JobState::Pending,
                        Transition { kind: "requeued", message: why, ..Default::default() },
                    )
                    .await?;
            }
        }
        self.wake.notify_one();
        Ok(())
    }

    async fn carry_out(&self, d: Decision) -> Result<()> {
        match d {
            Decision::Place { job, assignments } => self.place(&job, &assignments).await,
            Decision::Preempt { job, reason, grace_ms } => {
                let Some(row) = self.db.job(&job).await? else { return Ok(()) };
                let tasks = self.db.tasks(&row.id, row.attempt).await?;
                for t in tasks.iter().filter(|t| t.state == TaskState::Running) {
                    self.exec.stop(&handle(t), Halt::Term);
                }
                let why = match reason {
                    PreemptReason::Priority { by } => format!("job {by} of higher priority needs the room"),
                    PreemptReason::QuotaReclaim { owner_queue, by } => {
                        format!("queue {owner_queue} reclaims its quota for job {by}")
                    }
                };
                self.db
                    .transition(
                        &row.id,
                        &[JobState::Running],
                        JobState::Preempted,
                        Transition {
                            kind: "preempted",
                            message: format!("{why}; {} s to checkpoint and stop", grace_ms / 1000),
                            ..Default::default()
                        },
                    )
                    .await?;
                Ok(())
            }
            Decision::Requeue { job } => {
                let Some(row) = self.db.job(&job).await? else { return Ok(()) };
                let tasks = self.db.tasks(&row.id, row.attempt).await?;
                // The scheduler counts its resources free from now on: nothing of it may run any more. SIGKILL
                // and wait (briefly) until every process is confirmed gone before anything else is placed.
                for t in tasks.iter().filter(|t| t.state == TaskState::Running) {
                    self.exec.stop(&handle(t), Halt::Kill);
                }
                let running: Vec<&TaskRow> = tasks.iter().filter(|t| t.state == TaskState::Running).collect();
                let mut ended: HashMap<i64, TaskStatus> = HashMap::new();
                let t0 = Instant::now();
                while ended.len() < running.len() && t0.elapsed() < Duration::from_secs(5) {
                    for t in &running {
                        if let std::collections::hash_map::Entry::Vacant(slot) = ended.entry(t.rank)
                            && let Ok(st) = self.exec.probe(&handle(t))
                            && st != TaskStatus::Running
                        {
                            slot.insert(st);
                        }
                    }
                    if ended.len() < running.len() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                if ended.len() < running.len() {
                    // Still there after SIGKILL: hold it back from the queue until its processes are gone.
                    tracing::error!(job = %row.id, "preempted job's processes survive SIGKILL; requeue deferred");
                    let _ = self.sched().finish(&row.id);
                    self.begin_stop(&row, &tasks, StopWhy::Requeue("preempted; back in the queue".into()));
                    return Ok(());
                }
                for t in &running {
                    if let Some(st) = ended.get(&t.rank) {
                        self.record_end(t, st).await?;
                    }
                }
                self.db
                    .transition(
                        &row.id,
                        &[JobState::Preempted],
                        JobState::Pending,
                        Transition {
                            kind: "requeued",
                            message: "preempted; back in the queue, resumes from its newest checkpoint".into(),
                            ..Default::default()
                        },
                    )
                    .await?;
                Ok(())
            }
            Decision::Grow { job, tasks } => {
                if let Some(row) = self.db.job(&job).await? {
                    self.db
                        .event(
                            &row.id,
                            "elastic",
                            row.state,
                            &format!("could grow by {} workers; elastic resize is not carried out yet", tasks.len()),
                        )
                        .await?;
                }
                Ok(())
            }
            Decision::Shrink { job, by, for_job } => {
                if let Some(row) = self.db.job(&job).await? {
                    self.db
                        .event(
                            &row.id,
                            "elastic",
                            row.state,
                            &format!("asked to shrink by {by} workers for job {for_job}; stopping it instead"),
                        )
                        .await?;
                    let tasks = self.db.tasks(&row.id, row.attempt).await?;
                    self.begin_stop(&row, &tasks, StopWhy::Requeue(format!("shrunk to make room for job {for_job}")));
                }
                Ok(())
            }
        }
    }

    /// Stores how a task ended (its end time and last sampled CPU time with it). Probing is not repeated here:
    /// a probe that reported the end has already released the task, so `status` is the only record of it.
    async fn record_end(&self, t: &TaskRow, status: &TaskStatus) -> Result<()> {
        let mut row = t.clone();
        match status {
            TaskStatus::Exited(c) => {
                row.state = TaskState::Exited;
                row.exit_code = Some(i64::from(*c));
            }
            TaskStatus::Lost(why) => {
                row.state = TaskState::Lost;
                row.reason = why.clone();
            }
            TaskStatus::Running => return Ok(()),
        }
        row.ended_ms = Some(now());
        let k = (t.job_id.clone(), t.attempt, t.rank);
        if let Some((_, cpu)) = self.sampled.lock().unwrap_or_else(|p| p.into_inner()).remove(&k) {
            row.cpu_seconds = Some(cpu);
        }
        self.db.upsert_task(&row).await
    }

    /// Starts a placed job. **Record before you act, undo what could not be recorded**: the job moves to
    /// running (the new attempt) and every task is stored as `starting` *before* any process starts; each process
    /// is recorded as soon as it runs; and when anything fails after a spawn, everything started is killed and
    /// confirmed gone before the job is failed or requeued. A job whose state moved meanwhile (cancelled,
    /// started by someone else) starts nothing.
    async fn place(&self, id: &str, assignments: &[TaskPlacement]) -> Result<()> {
        let Some(job) = self.db.job(id).await? else {
            let _ = self.sched().finish(id);
            return Ok(());
        };
        if job.state != JobState::Pending {
            // Adopted jobs are placed again at recovery: their processes already run.
            return Ok(());
        }
        let node = assignments.first().map_or("?", |a| a.node.as_str()).to_owned();
        // Nothing is recorded or started yet: a failure here gives the scheduler its resources back.
        let ready = self.spec_of(&job).and_then(|spec| Ok((spec, self.exec.rendezvous(&node)?)));
        let (spec, rendezvous) = match ready {
            Ok(r) => r,
            Err(e) => {
                let _ = self.sched().finish(id);
                return Err(e);
            }
        };
        let attempt = job.attempt + 1;
        let world = assignments.len();
        let moved = self
            .db
            .transition(
                id,
                &[JobState::Pending],
                JobState::Running,
                Transition {
                    kind: "placed",
                    message: format!("attempt {attempt}: {world} workers on {node}; rendezvous {rendezvous}"),
                    attempt: Some(attempt),
                    workers: Some(world as i64),
                    started_ms: Some(now()),
                    ..Default::default()
                },
            )
            .await;
        match moved {
            Ok(true) => {}
            Ok(false) => {
                // Cancelled (or moved by another writer) since it was read: nothing was started.
                let _ = self.sched().finish(id);
                return Ok(());
            }
            Err(e) => {
                let _ = self.sched().finish(id);
                return Err(e);
            }
        }
        let intents: Vec<TaskRow> = assignments
            .iter()
            .enumerate()
            .map(|(rank, a)| TaskRow {
                job_id: id.to_owned(),
                attempt,
                rank: rank as i64,
                node: a.node.clone(),
                host: self.exec.host().to_owned(),
                pid: None,
                worker_pid: None,
                start_ticks: None,
                state: TaskState::Starting,
                exit_code: None,
                reason: String::new(),
                cpus: String::new(),
                gpus: a.gpus.iter().map(|(i, _)| i.to_string()).collect::<Vec<_>>().join(","),
                started_ms: None,
                ended_ms: None,
                cpu_seconds: None,
            })
            .collect();
        for t in &intents {
            if let Err(e) = self.db.upsert_task(t).await {
                return self
                    .abort_start(&job, attempt, &[], StopWhy::Requeue(format!("recording its tasks failed: {e}")))
                    .await;
            }
        }
        let run_dir = self.run_dir(id);
        let spec_path = self.job_dir(id).join("job.json");
        if let Err(e) = self
            .exec
            .task_dir(&self.job_dir(id))
            .and_then(|()| self.exec.task_dir(&run_dir))
            .and_then(|()| self.exec.give(&spec_path))
        {
            return self
                .abort_start(&job, attempt, &[], StopWhy::Failure(format!("preparing its directory: {e}")))
                .await;
        }
        let argv = vec![
            self.config.worker_program.display().to_string(),
            "worker".into(),
            "--output".into(),
            run_dir.display().to_string(),
            "--resume".into(),
            spec_path.display().to_string(),
        ];
        self.ingested.lock().unwrap_or_else(|p| p.into_inner()).retain(|k, _| k.0 != id);
        let mut env: Vec<(String, String)> = spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        env.extend(self.config.policy.team_env(&job.team));
        let secret = self.job_secret(&job);
        let mut rows = Vec::with_capacity(world);
        for (rank, a) in assignments.iter().enumerate() {
            let launch = TaskLaunch {
                job_id: id.to_owned(),
                attempt,
                rank,
                world_size: world,
                secret: secret.clone(),
                rendezvous: rendezvous.clone(),
                argv: argv.clone(),
                cpus_milli: spec.resources.cpus,
                memory_bytes: spec.resources.memory,
                gpus: a.gpus.clone(),
                node: a.node.clone(),
                env: env.clone(),
            };
            let row = match self.exec.start(&launch) {
                Ok(task) => started_row(task, &a.node),
                Err(e) => {
                    let why = StopWhy::Failure(format!("could not start rank {rank}: {e}"));
                    return self.abort_start(&job, attempt, &rows, why).await;
                }
            };
            let recorded = self.db.upsert_task(&row).await;
            rows.push(row);
            if let Err(e) = recorded {
                let why = StopWhy::Requeue(format!("recording rank {rank} failed: {e}"));
                return self.abort_start(&job, attempt, &rows, why).await;
            }
        }
        let pinned: Vec<String> = rows
            .iter()
            .map(|r| format!("rank {} pid {} cpus {}", r.rank, r.worker_pid.or(r.pid).unwrap_or(0), r.cpus))
            .collect();
        self.db.event(id, "started", JobState::Running, &format!("attempt {attempt}: {}", pinned.join(", "))).await?;
        Ok(())
    }

    /// Undoes a start that failed half-way: kills what was started and waits until it is gone, records how each
    /// task ended, then fails the job (a task that cannot start) or requeues it (the store failed) — unless its
    /// processes survive SIGKILL, when it is left to the stop machinery, which waits for them.
    async fn abort_start(&self, job: &JobRow, attempt: i64, started: &[TaskRow], why: StopWhy) -> Result<()> {
        tracing::warn!(job = %job.id, attempt, ?why, "starting the job failed; undoing it");
        for t in started {
            self.exec.stop(&handle(t), Halt::Kill);
        }
        let t0 = Instant::now();
        let mut gone: Vec<(TaskRow, TaskStatus)> = Vec::new();
        let mut left: Vec<TaskRow> = started.to_vec();
        while !left.is_empty() && t0.elapsed() < Duration::from_secs(5) {
            let mut still = Vec::new();
            for t in left {
                match self.exec.probe(&handle(&t)) {
                    Ok(TaskStatus::Running) | Err(_) => still.push(t),
                    Ok(st) => gone.push((t, st)),
                }
            }
            left = still;
            if !left.is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        for (t, st) in &gone {
            let _ = self.record_end(t, st).await;
        }
        let mut current = job.clone();
        current.state = JobState::Running;
        current.attempt = attempt;
        if !left.is_empty() {
            tracing::error!(job = %job.id, "processes of a failed start survive SIGKILL; requeue deferred");
            let tasks = self.db.tasks(&job.id, attempt).await.unwrap_or_default();
            self.begin_stop(&current, &tasks, why);
            return Ok(());
        }
        let _ = self.sched().finish(&job.id);
        let spec = self.spec_of(job)?;
        self.stopped(&current, &spec, why).await
    }

    /// Copies new lines of every rank's metrics file (and rank 0's `eval.jsonl`, stored as rank -1) into the store.
    async fn ingest_metrics(&self, id: &str, world: i64) {
        let dir = self.run_dir(id);
        for rank in -1..world.max(1) {
            let path = match rank {
                -1 => dir.join("eval.jsonl"),
                0 => dir.join("metrics.jsonl"),
                r => dir.join(format!("metrics.rank-{r}.jsonl")),
            };
            self.ingest_file(id, rank, &path).await;
        }
    }

    async fn ingest_file(&self, id: &str, rank: i64, path: &std::path::Path) {
        let key = (id.to_owned(), rank);
        let known = self.ingested.lock().unwrap_or_else(|p| p.into_inner()).get(&key).copied();
        let (start, min_step) = match known {
            Some(k) => k,
            // First look (or after a restart or a new attempt): read from the top, skipping steps already stored.
            None => (0, self.db.last_metric_step(id, rank).await.unwrap_or(-1)),
        };
        let Ok((tail, len)) = read_from_async(path.to_path_buf(), start, usize::MAX).await else {
            return;
        };
        // A file rewritten shorter (a resumed run drops the steps it redoes) is read again from where it ends now.
        let start = start.min(len) as usize;
        let tail = tail.as_slice();
        // Only whole lines.
        let Some(end) = tail.iter().rposition(|&b| b == b'\n') else {
            self.ingested.lock().unwrap_or_else(|p| p.into_inner()).insert(key, (start as u64, min_step));
            return;
        };
        let mut rows = Vec::new();
        for line in tail[..end].split(|&b| b == b'\n') {
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(line) else { continue };
            let Some(step) = v.get("step").and_then(serde_json::Value::as_i64) else { continue };
            if step <= min_step {
                continue;
            }
            rows.push(MetricRow { rank, step, time_ms: now(), data: v });
        }
        if !rows.is_empty()
            && let Err(e) = self.db.insert_metrics(id, &rows).await
        {
            tracing::warn!(job = id, error = %e, "storing metrics failed");
            return;
        }
        let last = rows.last().map_or(min_step, |r| r.step.max(min_step));
        self.ingested.lock().unwrap_or_else(|p| p.into_inner()).insert(key, ((start + end + 1) as u64, last));
    }

    /// Samples the CPU and memory of a running task (kept every [`SAMPLE_EVERY_MS`]); returns its usage now.
    async fn sample(&self, t: &TaskRow, net: Option<(f64, f64)>) -> Option<Usage> {
        let u = self.exec.usage(&handle(t))?;
        let k = (t.job_id.clone(), t.attempt, t.rank);
        let now_ms = now();
        let prev = self.sampled.lock().unwrap_or_else(|p| p.into_inner()).get(&k).copied();
        let due = prev.is_none_or(|(at, _)| now_ms - at >= SAMPLE_EVERY_MS);
        if due {
            let cpu_percent = prev.and_then(|(at, cpu)| {
                let dt = (now_ms - at) as f64 / 1000.0;
                (dt > 0.0).then(|| ((u.cpu_seconds - cpu) / dt * 100.0).max(0.0))
            });
            self.sampled.lock().unwrap_or_else(|p| p.into_inner()).insert(k, (now_ms, u.cpu_seconds));
            let gpu = if t.gpus.is_empty() { None } else { self.gpus.read(&crate::gpu::indices(&t.gpus)) };
            let row = SampleRow {
                rank: t.rank,
                time_ms: now_ms,
                cpu_percent,
                rss_bytes: Some(u.rss_bytes as i64),
                cpu_seconds: Some(u.cpu_seconds),
                net_rx_bytes_per_s: net.map(|n| n.0),
                net_tx_bytes_per_s: net.map(|n| n.1),
                gpu_util_percent: gpu.map(|g| g.util_percent),
                gpu_memory_bytes: gpu.map(|g| g.memory_bytes as i64),
                gpu_temperature_c: gpu.map(|g| g.temperature_c),
                gpu_power_w: gpu.map(|g| g.power_w),
            };
            if cpu_percent.is_some() {
                let _ = self.db.insert_samples(&t.job_id, std::slice::from_ref(&row)).await;
            }
            let _ = self.db.set_task_cpu(t, u.cpu_seconds).await;
        }
        Some(u)
    }

    /// The host's network rates since the previous call (bytes/s in, out).
    fn net_rates(&self) -> Option<(f64, f64)> {
        let (rx, tx) = shoal_exec::procfs::host_net_bytes()?;
        let now_t = Instant::now();
        let mut prev = self.net_prev.lock().unwrap_or_else(|p| p.into_inner());
        let out = prev.and_then(|(at, prx, ptx): (Instant, u64, u64)| {
            let dt = now_t.duration_since(at).as_secs_f64();
            (dt >= 0.5).then(|| (rx.saturating_sub(prx) as f64 / dt, tx.saturating_sub(ptx) as f64 / dt))
        });
        if prev.is_none() || out.is_some() {
            *prev = Some((now_t, rx, tx));
        }
        drop(prev);
        let mut last = self.net_last.lock().unwrap_or_else(|p| p.into_inner());
        if out.is_some() {
            *last = out;
        }
        *last
    }

    /// Records the cluster's allocation (every [`CLUSTER_SAMPLE_EVERY_MS`]).
    async fn sample_cluster(&self, active: &[JobRow]) {
        let now_ms = now();
        {
            let mut last = self.cluster_sampled.lock().unwrap_or_else(|p| p.into_inner());
            if now_ms - *last < CLUSTER_SAMPLE_EVERY_MS {
                return;
            }
            *last = now_ms;
        }
        let alloc = self.allocations();
        let c = ClusterSample {
            time_ms: now_ms,
            cpus_allocated: alloc.iter().map(|a| a.cpus_milli as f64 / 1000.0).sum(),
            memory_allocated_bytes: alloc.iter().map(|a| a.memory_bytes as i64).sum(),
            gpus_allocated: alloc.iter().flat_map(|a| a.gpus.iter().map(|g| f64::from(g.0) / 1000.0)).sum::<f64>()
                + 0.0,
            pending: active.iter().filter(|j| j.state == JobState::Pending).count() as i64,
            running: active.iter().filter(|j| j.state == JobState::Running).count() as i64,
        };
        if let Err(e) = self.db.insert_cluster_sample(&c).await {
            tracing::warn!(error = %e, "storing a cluster sample failed");
        }
    }
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
    }
}

/// The row of a task its executor just started on `node`.
fn started_row(t: Task, node: &str) -> TaskRow {
    TaskRow {
        job_id: t.job_id,
        attempt: t.attempt,
        rank: t.rank,
        node: node.to_owned(),
        host: t.host,
        pid: t.pid,
        worker_pid: t.worker_pid,
        start_ticks: t.start_ticks,
        state: TaskState::Running,
        exit_code: None,
        reason: String::new(),
        cpus: t.cpus,
        gpus: t.gpus,
        started_ms: t.started_ms.or_else(|| Some(now())),
        ended_ms: None,
        cpu_seconds: None,
    }
}

/// Reads at most `max` bytes of `path` from byte `from` on ([`shoal_exec::procfs::read_from`]) on a blocking-I/O
/// thread, for async code (a log read from its start can be large).
pub async fn read_from_async(path: PathBuf, from: u64, max: usize) -> std::io::Result<(Vec<u8>, u64)> {
    tokio::task::spawn_blocking(move || shoal_exec::procfs::read_from(&path, from, max))
        .await
        .map_err(std::io::Error::other)?
}

/// A task: job id, attempt, rank.
type TaskKey = (String, i64, i64);

/// How often a running task's resources are stored.
pub const SAMPLE_EVERY_MS: i64 = 2000;
/// How often the cluster's allocation is stored.
pub const CLUSTER_SAMPLE_EVERY_MS: i64 = 5000;

fn signal_note(code: i32) -> String {
    match code {
        137 => " (killed: SIGKILL)".into(),
        143 => " (terminated: SIGTERM)".into(),
        139 => " (segmentation fault)".into(),
        134 => " (aborted)".into(),
        c if c > 128 => format!(" (signal {})", c - 128),
        _ => String::new(),
    }
}
