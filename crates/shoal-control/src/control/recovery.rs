//! Recovery after a server restart: tasks that still run are adopted, the scheduler's books rebuilt, strays
//! killed, and what cannot be placed again requeued.

use std::collections::HashSet;

use shoal_exec::TaskStatus;
use shoal_sched::Decision;

use crate::db::{JobState, TaskRow, TaskState};
use crate::error::Result;

use super::admission::request_of;
use super::state::{Control, StopWhy, handle};

impl Control {
    /// After a restart: adopt the tasks that still run, rebuild the scheduler's books, and requeue what cannot be
    /// placed again.
    pub async fn recover(&self) -> Result<()> {
        // The phase each unfinished job with `[[phases]]` is in: how many phases it has ended.
        for job in self.db.jobs_in(&[JobState::Pending, JobState::Running, JobState::Preempted]).await? {
            let ended = self.db.events(&job.id, 0).await?.iter().filter(|e| e.kind == "phase").count();
            if ended > 0 {
                self.phases.lock().unwrap_or_else(|p| p.into_inner()).insert(job.id.clone(), ended);
            }
        }
        let active = self.db.jobs_in(&[JobState::Running, JobState::Preempted]).await?;
        let mut adopted = Vec::new();
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
                adopted.push(handle(t));
            }
            if job.state == JobState::Preempted {
                self.begin_stop(
                    job,
                    &tasks,
                    StopWhy::Requeue("the server restarted during its preemption grace period".into()),
                );
                continue;
            }
            // Local tasks by the session their signals go to; others as their executor describes them.
            let running: Vec<String> = alive
                .iter()
                .map(|t| match t.pid {
                    Some(pid) => format!("pid {pid}"),
                    None => format!("rank {} {}", t.rank, self.exec.describe(&handle(t))),
                })
                .collect();
            self.db
                .event(
                    &job.id,
                    "adopted",
                    job.state,
                    &format!(
                        "the server restarted; {} of {} workers still running ({}), taken over",
                        alive.len(),
                        tasks.len(),
                        if running.is_empty() { "none".into() } else { running.join(", ") }
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
        for stray in self.exec.strays(&adopted) {
            tracing::warn!(stray = %stray.what, job = %stray.job_id, "killing a stray of this server");
            self.exec.kill_stray(&stray);
            if let Ok(Some(j)) = self.db.job(&stray.job_id).await {
                let message = format!("killed stray {} found after a restart", stray.what);
                self.db.event(&j.id, "warning", j.state, &message).await?;
            }
        }
        // Hold the adopted jobs' resources before anything pending is considered.
        let decisions = self.sched().schedule(self.db.now() as u64);
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
}
