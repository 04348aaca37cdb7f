//! Supervision: pending jobs handed to the scheduler (once a restart's backoff is over) or cancelled; running jobs'
//! tasks probed, their memory held to the request, their heartbeats judged (`watch.rs`), failures, silent ranks
//! and hangs turned into a stop of the whole gang (and persistent stragglers, `stragglers.rs`), and a stopped job
//! restarted (by `fault_tolerance.policy`),
//! failed, cancelled or requeued only once every process of its attempt is gone.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use shoal_exec::{STOPPED_EXIT, Stop as Halt, TaskStatus, Usage};
use shoal_spec::{FaultPolicy, JobSpec, Seconds};

use crate::db::{JobRow, JobState, TaskRow, TaskState, Transition};
use crate::error::Result;

use super::admission::{request_of, tell_tasks};
use super::state::{Control, Stop, StopWhy, handle};
use super::watch::{Verdict, dump_text};

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

    /// Every worker of `job` ended at the same step boundary with a checkpoint, unasked by this server: the end of a
    /// `[[phases]]` phase (the next one is placed at its own size, what it does not need released), or a SIGTERM from
    /// elsewhere (a failure, handled by the job's policy).
    async fn workers_stopped(&self, job: &JobRow, tasks: &[TaskRow]) -> Result<()> {
        let stored = super::state::parse_stored_spec(job)?;
        let phase = self.phases.lock().unwrap_or_else(|p| p.into_inner()).get(&job.id).copied().unwrap_or(0);
        let (count, ended) = (stored.phases.len(), stored.phases.get(phase).and_then(|p| p.until_step));
        let Some(step) = ended.filter(|_| phase + 1 < count) else {
            let why = format!(
                "every worker stopped at a step boundary (exit status {STOPPED_EXIT}) on a SIGTERM this server did \
                 not send"
            );
            self.begin_stop(job, tasks, StopWhy::Failure(why));
            return Ok(());
        };
        let next = stored.in_phase(phase + 1);
        let (lo, hi) = next.workers.range();
        let workers = if lo == hi { format!("{lo}") } else { format!("{lo}..{hi}") };
        let message = format!(
            "phase {} of {count} ended at step {step} (phases[{phase}].until_step): every worker checkpointed there; \
             phase {} runs with {workers} workers of {} CPUs and {} each",
            phase + 1,
            phase + 2,
            next.resources.cpus as f64 / 1000.0,
            mib(next.resources.memory),
        );
        self.phases.lock().unwrap_or_else(|p| p.into_inner()).insert(job.id.clone(), phase + 1);
        let _ = self.sched().finish(&job.id);
        self.db
            .transition(
                &job.id,
                &[JobState::Running],
                JobState::Pending,
                Transition { kind: "phase", message, ..Default::default() },
            )
            .await?;
        self.wake.notify_one();
        Ok(())
    }

    /// Whether `id` is being stopped already.
    pub(super) fn stopping_now(&self, id: &str) -> bool {
        self.stopping.lock().unwrap_or_else(|p| p.into_inner()).contains_key(id)
    }

    pub(super) fn begin_stop(&self, job: &JobRow, tasks: &[TaskRow], why: StopWhy) {
        self.begin_stop_with(job, tasks, why, Halt::Term);
    }

    /// Stops every running task of `job` with `how`: SIGTERM first (SIGKILL after the grace), or SIGKILL at once
    /// for a gang that cannot stop cleanly (a hang: its ranks wait in a collective, or are stopped themselves).
    pub(super) fn begin_stop_with(&self, job: &JobRow, tasks: &[TaskRow], why: StopWhy, how: Halt) {
        let mut stopping = self.stopping.lock().unwrap_or_else(|p| p.into_inner());
        if stopping.contains_key(&job.id) {
            return;
        }
        tracing::info!(job = %job.id, ?why, ?how, "stopping job");
        for t in tasks.iter().filter(|t| t.state == TaskState::Running) {
            self.exec.stop(&handle(t), how);
        }
        stopping.insert(job.id.clone(), Stop { since: Instant::now(), killed: how == Halt::Kill, why });
    }

    /// How long a job that restarted must still wait before it starts again (its backoff), if at all; after a
    /// server restart, from the newest `restarted` event (its time and the backoff it announced), so a server
    /// restart does not cut a backoff short.
    async fn backoff_left(&self, job: &JobRow, spec: &JobSpec) -> Result<Option<i64>> {
        let ft = &spec.fault_tolerance;
        if job.restarts == 0 || ft.policy != FaultPolicy::Restart {
            return Ok(None);
        }
        let known = self.backoff.lock().unwrap_or_else(|p| p.into_inner()).get(&job.id).copied();
        let until = match known {
            Some((until, _)) => until,
            None => match self.last_restart(job, spec).await? {
                Some((at, wait)) => {
                    let until = at.saturating_add(wait.as_millis() as i64);
                    self.backoff.lock().unwrap_or_else(|p| p.into_inner()).insert(job.id.clone(), (until, wait));
                    until
                }
                None => return Ok(None),
            },
        };
        Ok(Some(until - self.db.now()).filter(|left| *left > 0))
    }

    /// The newest `restarted` event of `job`: when, and the backoff it announced (`after a backoff of 4s`; none
    /// when it started again at once; the spec's backoff when it says neither).
    async fn last_restart(&self, job: &JobRow, spec: &JobSpec) -> Result<Option<(i64, Duration)>> {
        let events = self.db.events(&job.id, 0).await?;
        let Some(e) = events.iter().rev().find(|e| e.kind == "restarted") else { return Ok(None) };
        let announced = e.message.split_once("after a backoff of ").and_then(|(_, rest)| {
            let word = rest.split([' ', ')', ',', ';']).next()?;
            shoal_comm::env::parse_duration(word).ok()
        });
        let wait = match announced {
            Some(w) => w,
            None if e.message.contains("start again at once") => Duration::ZERO,
            None => spec.fault_tolerance.backoff.0,
        };
        Ok(Some((e.time_ms, wait)))
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
                        finished_ms: Some(self.db.now()),
                        ..Default::default()
                    },
                )
                .await?;
            // An attempt before a restart may have left in-memory checkpoints.
            self.exec.job_ended(&job.id);
            return Ok(());
        }
        if self.sched().status(&job.id).is_none() {
            let spec = self.spec_of(job)?;
            if let Some(left) = self.backoff_left(job, &spec).await? {
                tracing::debug!(job = %job.id, left_ms = left, "waiting out the restart's backoff");
                return Ok(());
            }
            let mut request = request_of(job, &spec);
            request.avoid_nodes = self.avoided_nodes(&job.id);
            if let Some(most) = self.shrunk_to(&job.id) {
                // A straggler was replaced by leaving its place out.
                request.tasks_max = request.tasks_max.min(most).max(request.tasks_min);
            }
            let submitted = self.sched().submit(request);
            if let Err(e) = submitted {
                self.db
                    .transition(
                        &job.id,
                        &[JobState::Pending],
                        JobState::Failed,
                        Transition {
                            kind: "failed",
                            message: format!("the scheduler refused it: {e}"),
                            finished_ms: Some(self.db.now()),
                            ..Default::default()
                        },
                    )
                    .await?;
                self.exec.job_ended(&job.id);
            }
        }
        Ok(())
    }

    pub(super) async fn tick_running(&self, job: &JobRow) -> Result<()> {
        let spec = self.spec_of(job)?;
        let mut tasks = self.db.tasks(&job.id, job.attempt).await?;
        // A job regrouped in place is its group's members; the tasks it lost have ended and are recorded.
        if let Some(members) = self.members(job) {
            tasks.retain(|t| members.contains(&t.rank));
        }
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
        for t in &tasks {
            if t.state == TaskState::Running
                && let Some(u) = self.sample(t).await
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
            self.forget_group(&job.id);
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
        // Memory limits: host memory, and GPU memory where the job asked for a share of it (`gpu_memory`: a
        // fraction of a GPU shared with other tasks is held to what it asked for).
        for (t, s) in &statuses {
            if *s != TaskStatus::Running {
                continue;
            }
            let Some(u) = usage.get(&t.rank) else { continue };
            let gpu_limit = spec.resources.gpu_memory;
            let why = if u.rss_bytes > spec.resources.memory {
                format!(
                    "rank {} used {} of memory, over its request of {} (resources.memory): killed",
                    t.rank,
                    mib(u.rss_bytes),
                    mib(spec.resources.memory)
                )
            } else if let Some(g) = u.gpu_memory_bytes
                && gpu_limit > 0
                && g > gpu_limit
            {
                format!(
                    "rank {} held {} of GPU memory on GPU {}, over its request of {} (resources.gpu_memory): killed",
                    t.rank,
                    mib(g),
                    t.gpus,
                    mib(gpu_limit)
                )
            } else {
                continue;
            };
            self.db.event(&job.id, "warning", job.state, &why).await?;
            self.begin_stop(job, &tasks, StopWhy::Failure(why));
            return Ok(());
        }
        // A rank killed by a signal or lost is named first: the others' errors (a peer gone from a collective) most
        // often follow from it.
        let mut failures: Vec<(bool, String)> = statuses
            .iter()
            .filter_map(|(t, s)| match s {
                // Stopped at a step boundary with a checkpoint: judged below, once every rank has.
                TaskStatus::Exited(STOPPED_EXIT) => None,
                TaskStatus::Exited(c) if *c != 0 => {
                    // A rank that failed by itself says why on its last error line (a collective's report: the
                    // operation, its sequence number, who had entered it).
                    let said = if *c > 128 { None } else { self.last_error(t) };
                    let said = said.map_or(String::new(), |e| format!(": {e}"));
                    Some((*c > 128, format!("rank {} exited with status {c}{}{said}", t.rank, signal_note(*c))))
                }
                TaskStatus::Lost(why) => Some((true, format!("rank {} was lost: {why}", t.rank))),
                _ => None,
            })
            .collect();
        failures.sort_by_key(|(cause, _)| !*cause);
        let failed = match failures.as_slice() {
            [] => None,
            [(_, one)] => Some(one.clone()),
            [(_, first), rest @ ..] => {
                let rest: Vec<&str> = rest.iter().map(|(_, w)| w.as_str()).collect();
                Some(format!("{first} (also {})", rest.join(", ")))
            }
        };
        if let Some(why) = failed {
            // An elastic job that can goes on in place with its survivors, while there are enough of them.
            let lost: Vec<i64> = statuses
                .iter()
                .filter(|(_, s)| !matches!(s, TaskStatus::Running | TaskStatus::Exited(0)))
                .map(|(t, _)| t.rank)
                .collect();
            let survivors = statuses.iter().filter(|(_, s)| *s == TaskStatus::Running).count();
            let (lo, _) = spec.workers.range();
            if self.regroups_in_place(&spec)
                && survivors >= (lo as usize).max(1)
                && survivors + lost.len() == statuses.len()
                && spec.validate_world(survivors).is_ok()
            {
                return self.shrink_in_place(job, &tasks, &lost, &why).await;
            }
            self.begin_stop(job, &tasks, StopWhy::Failure(why));
            return Ok(());
        }
        if !statuses.is_empty() && statuses.iter().all(|(_, s)| *s == TaskStatus::Exited(STOPPED_EXIT)) {
            return self.workers_stopped(job, &tasks).await;
        }
        let verdict = self.observe(job, &spec, &statuses);
        if let Some(news) = self.resume_news(&job.id, job.attempt) {
            self.db.event(&job.id, "resumed", job.state, &news).await?;
        }
        if let Some(news) = self.strategy_news(&job.id, job.attempt) {
            self.db.event(&job.id, "strategy", job.state, &news).await?;
        }
        match verdict {
            Verdict::Fine => {}
            Verdict::Silent { why, dump } => {
                self.save_dump(&dump);
                self.db.event(&job.id, "heartbeat", job.state, &format!("{why}. {}", dump_text(&dump))).await?;
                self.begin_stop_with(job, &tasks, StopWhy::Failure(why), Halt::Kill);
                return Ok(());
            }
            Verdict::Hang { why, dump } => {
                self.save_dump(&dump);
                self.db.event(&job.id, "hang", job.state, &format!("{why}. {}", dump_text(&dump))).await?;
                let culprits = if dump.culprits.is_empty() {
                    String::new()
                } else {
                    format!(
                        " (holding it up: rank {})",
                        dump.culprits.iter().map(i64::to_string).collect::<Vec<_>>().join(", rank ")
                    )
                };
                self.begin_stop_with(job, &tasks, StopWhy::Failure(format!("{why}{culprits}")), Halt::Kill);
                return Ok(());
            }
        }
        if !statuses.is_empty()
            && statuses.iter().all(|(_, s)| *s == TaskStatus::Running)
            && self.replace_straggler(job, &spec, &tasks).await?
        {
            return Ok(());
        }
        if !statuses.is_empty() && statuses.iter().all(|(_, s)| *s == TaskStatus::Exited(0)) {
            let _ = self.sched().finish(&job.id);
            self.forget_group(&job.id);
            let summary = std::fs::read_to_string(self.run_dir(&job.id).join("summary.json")).ok();
            self.ingest_metrics(&job.id, job.workers).await;
            self.db
                .transition(
                    &job.id,
                    &[JobState::Running],
                    JobState::Succeeded,
                    Transition {
                        kind: "succeeded",
                        message: format!("all {} exited 0", tell_tasks(&spec, statuses.len())),
                        finished_ms: Some(self.db.now()),
                        summary,
                        ..Default::default()
                    },
                )
                .await?;
            self.exec.job_ended(&job.id);
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
                            finished_ms: Some(self.db.now()),
                            ..Default::default()
                        },
                    )
                    .await?;
                self.exec.job_ended(&job.id);
            }
            StopWhy::Failure(why) => self.after_failure(job, spec, why).await?,
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
            StopWhy::Resize(why) => {
                self.db
                    .transition(
                        &job.id,
                        &from,
                        JobState::Pending,
                        Transition { kind: "resized", message: why, ..Default::default() },
                    )
                    .await?;
            }
        }
        self.wake.notify_one();
        Ok(())
    }
    /// The last line starting with `error:` in the newest 8 KiB of a task's log, without the prefix, at most 400
    /// characters.
    fn last_error(&self, t: &TaskRow) -> Option<String> {
        let path = self.exec.log_path(&t.job_id, t.attempt, t.rank);
        let len = std::fs::metadata(&path).ok()?.len();
        let (tail, _) = shoal_exec::procfs::read_from(&path, len.saturating_sub(8192), 8192).ok()?;
        let text = String::from_utf8_lossy(&tail);
        let line = text.lines().rev().find_map(|l| l.trim().strip_prefix("error:"))?.trim();
        Some(line.chars().take(400).collect())
    }

    /// A job stopped for a failure, a lost or silent rank or a hang, every process gone: restarted or failed by
    /// `fault_tolerance`.
    async fn after_failure(&self, job: &JobRow, spec: &JobSpec, why: String) -> Result<()> {
        let from = [JobState::Running, JobState::Preempted];
        let ft = &spec.fault_tolerance;
        let n = job.restarts + 1;
        let mut backoff = None;
        let restart = match ft.policy {
            FaultPolicy::None => None,
            _ if (job.restarts as u64) >= u64::from(ft.max_restarts) => None,
            FaultPolicy::Restart => {
                let previous = self.backoff.lock().unwrap_or_else(|p| p.into_inner()).get(&job.id).map(|(_, w)| *w);
                let previous = match previous {
                    Some(w) => Some(w),
                    None if job.restarts > 0 => self.last_restart(job, spec).await?.map(|(_, w)| w),
                    None => None,
                };
                let trained = self.progressed(&job.id, job.attempt);
                let wait = ft.next_backoff(previous, trained);
                backoff = Some(wait);
                let why_wait = match previous {
                    None => format!("fault_tolerance.backoff = {}", ft.backoff),
                    Some(_) if trained => {
                        format!("the attempt trained: fault_tolerance.backoff = {} again", ft.backoff)
                    }
                    Some(p) => format!("the attempt completed no step: twice the last wait of {}", Seconds(p)),
                };
                let wait = if wait.is_zero() {
                    format!("at once ({why_wait})")
                } else {
                    format!("after a backoff of {} ({why_wait})", Seconds(wait))
                };
                Some(format!(
                    "{why}; restart {n} of {}: every worker stopped; all {} start again {wait} and resume from its \
                     newest checkpoint",
                    ft.max_restarts, job.workers
                ))
            }
            FaultPolicy::Elastic => {
                let (lo, hi) = spec.workers.range();
                Some(format!(
                    "{why}; restart {n} of {} (elastic): every worker stopped; starts again at once with as many \
                     workers as are free within {lo}..{hi} and resumes from its newest checkpoint at that size",
                    ft.max_restarts
                ))
            }
        };
        match backoff {
            Some(wait) if restart.is_some() => {
                let until = self.db.now().saturating_add(wait.as_millis() as i64);
                self.backoff.lock().unwrap_or_else(|p| p.into_inner()).insert(job.id.clone(), (until, wait));
            }
            _ => {
                self.backoff.lock().unwrap_or_else(|p| p.into_inner()).remove(&job.id);
            }
        }
        let (to, t) = match restart {
            Some(message) => {
                (JobState::Pending, Transition { kind: "restarted", message, restarts: Some(n), ..Default::default() })
            }
            None => {
                let message = match ft.policy {
                    FaultPolicy::None => format!("{why}; fault_tolerance.policy = \"none\": not restarted"),
                    _ if ft.max_restarts == 0 => format!("{why}; fault_tolerance.max_restarts = 0: not restarted"),
                    _ => format!("{why}; no restarts left ({} used)", job.restarts),
                };
                (
                    JobState::Failed,
                    Transition { kind: "failed", message, finished_ms: Some(self.db.now()), ..Default::default() },
                )
            }
        };
        self.db.transition(&job.id, &from, to, t).await?;
        if to == JobState::Failed {
            self.exec.job_ended(&job.id);
        }
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
        row.ended_ms = Some(self.db.now());
        let k = (t.job_id.clone(), t.attempt, t.rank);
        if let Some((_, cpu)) = self.sampled.lock().unwrap_or_else(|p| p.into_inner()).remove(&k) {
            row.cpu_seconds = Some(cpu);
        }
        self.db.upsert_task(&row).await
    }
}
