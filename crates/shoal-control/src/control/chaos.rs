//! Chaos on purpose: one running worker of a job killed (SIGKILL) or stopped (SIGSTOP) through the executor, so
//! that recovery can be watched and measured on every executor. The control loop then sees the fault as it would a
//! real one: a killed rank exits 137; a stopped one stops its heartbeats and holds the others in a collective.

use shoal_exec::Fault;
use shoal_wire::{ChaosAction, ChaosDone};

use crate::db::{JobRow, JobState, TaskState};
use crate::error::{ControlError, Result};

use super::state::{Control, handle};

impl Control {
    /// Injects `action` into rank `rank` of `job`'s current attempt; `by` (a user) is recorded in the job's
    /// `chaos` event.
    pub async fn chaos(&self, job: &JobRow, rank: i64, action: ChaosAction, by: &str) -> Result<ChaosDone> {
        if job.state != JobState::Running {
            return Err(ControlError::bad(format!(
                "job {} is {}, not running: no worker to hit",
                job.id,
                job.state.as_str()
            )));
        }
        let tasks = self.db.tasks(&job.id, job.attempt).await?;
        let running: Vec<i64> = tasks.iter().filter(|t| t.state == TaskState::Running).map(|t| t.rank).collect();
        let Some(task) = tasks.iter().find(|t| t.rank == rank && t.state == TaskState::Running) else {
            return Err(ControlError::bad_field(
                "rank",
                format!(
                    "rank {rank} is not a running worker of job {} (attempt {}; running: {})",
                    job.id,
                    job.attempt,
                    if running.is_empty() {
                        "none".to_owned()
                    } else {
                        running.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
                    }
                ),
            ));
        };
        let fault = match action {
            ChaosAction::Kill => Fault::Kill,
            ChaosAction::Stop => Fault::Pause,
        };
        let h = handle(task);
        let exec = self.exec.clone();
        let done = tokio::task::spawn_blocking(move || exec.inject(&h, fault))
            .await
            .map_err(|e| ControlError::Internal(format!("injecting a fault: {e}")))?;
        let what = match done {
            Ok(what) => what,
            Err(e @ shoal_exec::ExecError::Unsupported(_)) => {
                return Err(ControlError::bad_field("action", e.to_string()));
            }
            Err(e) => return Err(e.into()),
        };
        let message = format!("chaos ({by}): {} rank {rank} of attempt {}: {what}", action.as_str(), job.attempt);
        tracing::info!(job = %job.id, rank, action = action.as_str(), %what, "chaos");
        self.db.event(&job.id, "chaos", job.state, &message).await?;
        self.wake.notify_one();
        Ok(ChaosDone {
            job_id: job.id.clone(),
            attempt: job.attempt,
            rank,
            action,
            host: task.host.clone(),
            pid: task.worker_pid.or(task.pid),
            time_ms: self.db.now(),
            message,
        })
    }
}
