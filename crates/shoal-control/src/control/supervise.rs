//! Supervision: pending jobs handed to the scheduler or cancelled; running jobs' tasks probed, their memory held to
//! the request, failures turned into a stop of the whole gang, and a stopped job restarted, failed, cancelled or
//! requeued only once every process of its attempt is gone.

use std::collections::HashMap;
use std::time::Instant;

use shoal_exec::{Stop as Halt, TaskStatus, Usage};
use shoal_spec::JobSpec;

use crate::db::{JobRow, JobState, TaskRow, TaskState, Transition, now};
use crate::error::Result;

use super::admission::request_of;
use super::state::{Control, Stop, StopWhy, handle};

fn mib(b: u64) -> String {
    if b >= 1 << 30 { format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64) } else { format!("{} MiB", b >> 20) }
}

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

impl Control {
    pub(super) fn is_stopping(&self, id: &str) -> bool {
        self.stopping.lock().unwrap_or_else(|p| p.into_inner()).contains_key(id)
    }

    pub(super) fn begin_stop(&self, job: &JobRow, tasks: &[TaskRow], why: StopWhy) {
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

    pub(super) async fn tick_pending(&self, job: &JobRow) -> Result<()> {
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

    pub(super) async fn tick_running(&self, job: &JobRow) -> Result<()> {
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
            if st == TaskStatus::Running {
                self.note(job, t).await?;
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
    pub(super) async fn stopped(&self, job: &JobRow, spec: &JobSpec, why: StopWhy) -> Result<()> {
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
    /// Stores how a task ended (its end time and last sampled CPU time with it). Probing is not repeated here:
    /// a probe that reported the end has already released the task, so `status` is the only record of it.
    pub(super) async fn record_end(&self, t: &TaskRow, status: &TaskStatus) -> Result<()> {
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
}
