//! Carrying out the scheduler's decisions: placing a job (record before acting, undo what could not be recorded;
//! an elastic job grown in the pass that places it starts with the grown size), preempting, requeueing, and the
//! elastic resizes the scheduler asks for (recorded, not carried out, for a running job).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use shoal_exec::{Stop as Halt, TaskLaunch, TaskStatus};
use shoal_sched::{Decision, PreemptReason, TaskPlacement};

use crate::db::{JobRow, JobState, TaskRow, TaskState, Transition};
use crate::error::Result;

use super::state::{Control, StopWhy, handle};
use super::tasks::{intent_row, started_row};

impl Control {
    /// A job the scheduler places and grows in the same pass has not started yet: it starts with every task it
    /// was given — as many workers as are free within `[workers] min..max` — when its spec can share a batch among
    /// that many (otherwise the growth stays an event, as for a running job).
    pub(super) fn fold_growth(&self, decisions: Vec<Decision>) -> Vec<Decision> {
        let mut out: Vec<Decision> = Vec::with_capacity(decisions.len());
        for d in decisions {
            if let Decision::Grow { job, tasks } = &d
                && let Some(Decision::Place { assignments, .. }) =
                    out.iter_mut().find(|p| matches!(p, Decision::Place { job: j, .. } if j == job))
            {
                let spec = self.specs.lock().unwrap_or_else(|p| p.into_inner()).get(job).map(|(_, s)| s.clone());
                if spec.is_some_and(|s| s.validate_world(assignments.len() + tasks.len()).is_ok()) {
                    assignments.extend(tasks.iter().cloned());
                    continue;
                }
            }
            out.push(d);
        }
        out
    }

    pub(super) async fn carry_out(&self, d: Decision) -> Result<()> {
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
                let Some(row) = self.db.job(&job).await? else { return Ok(()) };
                let spec = self.spec_of(&row)?;
                let running = self.db.tasks(&row.id, row.attempt).await?;
                let now = running.iter().filter(|t| t.state == TaskState::Running).count();
                let to = now + tasks.len();
                let (_, hi) = spec.workers.range();
                if row.state != JobState::Running || self.stopping_now(&row.id) {
                    return Ok(());
                }
                if let Err(e) = spec.validate_world(to) {
                    self.db
                        .event(&row.id, "elastic", row.state, &format!("could grow from {now} to {to} workers: {e}"))
                        .await?;
                    return Ok(());
                }
                // Growth waits until the last regrouping has formed; the scheduler offers the capacity again.
                if self.regroups_in_place(&spec) && self.group_forming(&row) {
                    let have = self.members(&row).map_or(now, |m| m.len());
                    let positions: Vec<usize> = (have..have + tasks.len()).collect();
                    let _ = self.sched().release_tasks(&row.id, &positions);
                    tracing::debug!(job = %row.id, "growth waits for the group being formed");
                    return Ok(());
                }
                if self.grow_in_place(&row, &spec, &tasks).await? {
                    return Ok(());
                }
                let why = format!(
                    "grows from {now} to {to} workers into free capacity ([workers] max = {hi}): every worker \
                     checkpoints at its next step boundary, and the job resumes there at {to}"
                );
                self.db.event(&row.id, "elastic", row.state, &why).await?;
                self.begin_stop(&row, &running, StopWhy::Resize(why));
                Ok(())
            }
            Decision::Shrink { job, by, for_job } => {
                if let Some(row) = self.db.job(&job).await? {
                    let spec = self.spec_of(&row)?;
                    let (lo, _) = spec.workers.range();
                    let why = format!(
                        "shrinks by {by} workers for job {for_job}: every worker checkpoints at its next step \
                         boundary; back in the queue, it resumes there with as many workers as fit ([workers] min = \
                         {lo})"
                    );
                    self.db.event(&row.id, "elastic", row.state, &why).await?;
                    let tasks = self.db.tasks(&row.id, row.attempt).await?;
                    self.begin_stop(&row, &tasks, StopWhy::Requeue(why));
                }
                Ok(())
            }
        }
    }

    /// Starts a placed job. **Record before you act, undo what could not be recorded**: the job moves to
    /// running (the new attempt) and every task is stored as `starting` *before* any process starts; each process
    /// is recorded as soon as it runs; and when anything fails after a spawn, everything started is killed and
    /// confirmed gone before the job is failed or requeued. A job whose state moved meanwhile (cancelled,
    /// started by someone else) starts nothing.
    pub(super) async fn place(&self, id: &str, assignments: &[TaskPlacement]) -> Result<()> {
        let Some(job) = self.db.job(id).await? else {
            let _ = self.sched().finish(id);
            return Ok(());
        };
        if job.state != JobState::Pending {
            // Adopted jobs are placed again at recovery: their processes already run.
            return Ok(());
        }
        // Rank 0's node hosts the rendezvous.
        let node = assignments.first().map_or("?", |a| a.node.as_str()).to_owned();
        let mut nodes: Vec<&str> = Vec::new();
        for a in assignments {
            if !nodes.contains(&a.node.as_str()) {
                nodes.push(&a.node);
            }
        }
        // Nothing is recorded or started yet: a failure here gives the scheduler its resources back.
        let attempt = job.attempt + 1;
        let ready = self.spec_of(&job).and_then(|spec| Ok((spec, self.exec.rendezvous(id, attempt, &node)?)));
        let (spec, rendezvous) = match ready {
            Ok(r) => r,
            Err(e) => {
                let _ = self.sched().finish(id);
                return Err(e);
            }
        };
        let world = assignments.len();
        let moved = self
            .db
            .transition(
                id,
                &[JobState::Pending],
                JobState::Running,
                Transition {
                    kind: "placed",
                    message: format!(
                        "attempt {attempt}: {} on {}; rendezvous {rendezvous}",
                        super::admission::tell_tasks(&spec, world),
                        nodes.join(", ")
                    ),
                    attempt: Some(attempt),
                    workers: Some(world as i64),
                    started_ms: Some(self.db.now()),
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
            .map(|(rank, a)| intent_row(id, attempt, rank as i64, a, self.exec.host()))
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
        self.ingested.lock().unwrap_or_else(|p| p.into_inner()).retain(|k, _| k.0 != id);
        self.forget_group(id);
        let launches: Vec<TaskLaunch> = assignments
            .iter()
            .enumerate()
            .map(|(rank, a)| self.launch_of(&job, &spec, attempt, rank, world, &rendezvous, a))
            .collect();
        // The gang starts at once (one request to a cluster manager, or each task in turn); what started is
        // recorded right after, and undone when anything failed.
        let tasks = match self.exec.start_gang(&launches) {
            Ok(tasks) => tasks,
            Err(g) => {
                let rows: Vec<TaskRow> = g
                    .started
                    .into_iter()
                    .zip(assignments)
                    .map(|(t, a)| started_row(t, &a.node, self.db.now()))
                    .collect();
                let why = StopWhy::Failure(format!("could not start rank {}: {}", g.rank, g.error));
                return self.abort_start(&job, attempt, &rows, why).await;
            }
        };
        let mut rows = Vec::with_capacity(world);
        for (task, a) in tasks.into_iter().zip(assignments) {
            let row = started_row(task, &a.node, self.db.now());
            let recorded = self.db.upsert_task(&row).await;
            let rank = row.rank;
            rows.push(row);
            if let Err(e) = recorded {
                let why = StopWhy::Requeue(format!("recording rank {rank} failed: {e}"));
                return self.abort_start(&job, attempt, &rows, why).await;
            }
        }
        let pinned: Vec<String> =
            rows.iter().map(|r| format!("rank {} {}", r.rank, self.exec.describe(&handle(r)))).collect();
        self.db.event(id, "started", JobState::Running, &format!("attempt {attempt}: {}", pinned.join(", "))).await?;
        Ok(())
    }

    /// Undoes a start that failed half-way: kills what was started and waits until it is gone, records how each
    /// task ended, then fails the job (a task that cannot start) or requeues it (the store failed) — unless its
    /// processes survive SIGKILL, when it is left to the stop machinery, which waits for them.
    pub(super) async fn abort_start(
        &self,
        job: &JobRow,
        attempt: i64,
        started: &[TaskRow],
        why: StopWhy,
    ) -> Result<()> {
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
}
