//! What the API shows of jobs and tasks: its own types, built from the store's rows, so that a column added to
//! the store (a secret, a checkpoint key, a process' start time) never reaches a client by accident, and a row can
//! change shape without changing the API.

use serde::Serialize;

use crate::db::{JobRow, JobState, TaskRow, TaskState};

/// A job in listings (and the head of `GET /api/v1/jobs/{id}`).
#[derive(Debug, Clone, Serialize)]
pub struct JobView<'a> {
    pub id: &'a str,
    pub name: &'a str,
    pub user: &'a str,
    pub team: &'a str,
    pub queue: &'a str,
    pub priority: i64,
    pub state: JobState,
    pub restarts: i64,
    pub attempt: i64,
    /// Workers of the current (or last) attempt.
    pub worker_count: i64,
    pub created_ms: i64,
    pub started_ms: Option<i64>,
    pub finished_ms: Option<i64>,
    pub reason: &'a str,
    pub cancel_requested: bool,
}

impl<'a> From<&'a JobRow> for JobView<'a> {
    fn from(j: &'a JobRow) -> Self {
        JobView {
            id: &j.id,
            name: &j.name,
            user: &j.user,
            team: &j.team,
            queue: &j.queue,
            priority: j.priority,
            state: j.state,
            restarts: j.restarts,
            attempt: j.attempt,
            worker_count: j.workers,
            created_ms: j.created_ms,
            started_ms: j.started_ms,
            finished_ms: j.finished_ms,
            reason: &j.reason,
            cancel_requested: j.cancel_requested,
        }
    }
}

/// One worker of a job's current attempt.
#[derive(Debug, Clone, Serialize)]
pub struct TaskView<'a> {
    pub job_id: &'a str,
    pub attempt: i64,
    pub rank: i64,
    pub node: &'a str,
    pub host: &'a str,
    /// The training process itself: the one to signal, profile or attach a debugger to.
    pub pid: Option<i64>,
    /// The exit-status wrapper, leader of the task's session (its process group gets the server's signals).
    pub wrapper_pid: Option<i64>,
    pub state: TaskState,
    pub exit_code: Option<i64>,
    pub reason: &'a str,
    /// CPUs it is pinned to (`0-3,6`), empty when not pinned.
    pub cpus: &'a str,
    /// `CUDA_VISIBLE_DEVICES` it got, empty for none.
    pub gpus: &'a str,
    pub started_ms: Option<i64>,
    pub ended_ms: Option<i64>,
    pub cpu_seconds: Option<f64>,
}

impl<'a> From<&'a TaskRow> for TaskView<'a> {
    fn from(t: &'a TaskRow) -> Self {
        TaskView {
            job_id: &t.job_id,
            attempt: t.attempt,
            rank: t.rank,
            node: &t.node,
            host: &t.host,
            pid: t.worker_pid,
            wrapper_pid: t.pid,
            state: t.state,
            exit_code: t.exit_code,
            reason: &t.reason,
            cpus: &t.cpus,
            gpus: &t.gpus,
            started_ms: t.started_ms,
            ended_ms: t.ended_ms,
            cpu_seconds: t.cpu_seconds,
        }
    }
}
