//! The control loop: keeps the store, the scheduler and the processes in agreement.
//!
//! Every tick (every 50 ms while a job is being stopped, when a restart's backoff ends, and at once after a
//! submission or a cancellation) it
//! 1. probes the tasks of running jobs: a job whose tasks all exited 0 succeeded; one with a task that failed,
//!    was lost, went over its memory or stopped sending heartbeats, or that hung (no step for
//!    `fault_tolerance.hang_timeout` while every rank lives; dumped first), is stopped whole, then by its
//!    `fault_tolerance.policy` restarted (pending again, `restarts + 1`, after the backoff) while
//!    `max_restarts` lasts, else failed; an elastic job with `replace_stragglers` whose diagnosis names the same
//!    straggler for 30 s is restarted without it;
//! 2. carries out cancellations (SIGTERM to every task's process group, SIGKILL after the grace period);
//! 3. copies new lines of rank 0's `metrics.jsonl` into the store;
//! 4. hands pending jobs to the scheduler and carries out its decisions (place: start every task; preempt: SIGTERM
//!    and hold the resources for the grace period; requeue: make sure nothing runs, then pending again).
//!
//! **A job never runs twice at once**: it goes back to pending only after every process of its attempt is gone
//! (probed dead), and the data directory is locked by one server.
//!
//! The parts, each one concern over the shared [`state::Control`]: `admission.rs` (the scheduler's check),
//! `supervise.rs` (probing, limits, stopping and what follows a stop), `notes.rs` (what the executor says of a task
//! that waits), `watch.rs` (heartbeats, hangs and their dumps), `stragglers.rs` (persistent stragglers replaced),
//! `chaos.rs` (faults injected on purpose), `group.rs` (elastic jobs regrouped in place: survivors keep their
//! processes, newcomers join),
//! `decisions.rs` (placing, preempting,
//! requeueing), `tasks.rs` (how a task is launched and recorded), `ingest.rs` (metrics files into the store), `sampling.rs` (resource samples), `recovery.rs` (after a
//! server restart); this file holds the loop itself.

mod admission;
mod chaos;
mod decisions;
mod group;
mod ingest;
mod notes;
mod recovery;
mod sampling;
mod state;
mod stragglers;
mod supervise;
mod tasks;
mod watch;

use std::collections::HashSet;
use std::time::Instant;

use crate::db::{JobRow, JobState};
use crate::error::{ControlError, Result};

pub use admission::{request_of, resources_of};
pub use ingest::read_from_async;
pub use sampling::{CLUSTER_SAMPLE_EVERY_MS, SAMPLE_EVERY_MS};
pub use state::{Control, ControlConfig, handle, parse_stored_spec};

/// How often the loop turns while a job is being stopped.
const STOPPING_TICK: std::time::Duration = std::time::Duration::from_millis(50);

impl Control {
    /// Runs the loop until `shutdown` resolves.
    pub async fn run(self: std::sync::Arc<Self>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        loop {
            if let Err(e) = self.tick().await {
                tracing::error!(error = %e, "control loop tick failed");
            }
            // While a gang is being stopped, look again soon: what follows (a restart) waits only for its processes
            // to be gone, which takes milliseconds after SIGTERM or SIGKILL.
            let mut pause = if self.stopping_any() { self.config.tick.min(STOPPING_TICK) } else { self.config.tick };
            // A backoff that ends before the next turn: turn when it ends.
            let t = self.db.now();
            let ends = self
                .backoff
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .map(|(u, _)| *u)
                .filter(|u| *u > t)
                .min();
            if let Some(u) = ends {
                pause = pause.min(std::time::Duration::from_millis((u - t) as u64));
            }
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = self.wake.notified() => {}
                _ = shutdown.changed() => return,
            }
        }
    }

    /// Whether some job is being stopped now (the loop then turns again soon: what follows waits only for its
    /// processes to be gone).
    pub fn stopping_any(&self) -> bool {
        !self.stopping.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
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
        self.watched.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| ids.contains(id.as_str()));
        self.heard.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| ids.contains(id.as_str()));
        self.phases.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| ids.contains(id.as_str()));
        self.backoff.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| ids.contains(id.as_str()));
        self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| ids.contains(id.as_str()));
        self.shrunk.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| ids.contains(id.as_str()));
        self.avoided.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| ids.contains(id.as_str()));
        self.groups.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| ids.contains(id.as_str()));
        let t0 = Instant::now();
        let decisions = self.sched().schedule(self.db.now() as u64);
        let decisions = self.fold_growth(decisions);
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
}
