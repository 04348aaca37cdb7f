//! What the API shows of jobs, tasks, queues and nodes: its own types and JSON, built from the store's rows and the
//! scheduler's books, so that a column added to the store (a secret, a checkpoint key, a process' start time) never
//! reaches a client by accident, and a row can change shape without changing the API.

use serde::Serialize;
use serde_json::{Value, json};

use crate::control::Control;
use crate::db::{JobRow, JobState, TaskRow, TaskState};
use crate::error::Result;

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

/// A job in listings.
pub(crate) fn job_json(j: &JobRow) -> Value {
    serde_json::to_value(crate::view::JobView::from(j)).unwrap_or(Value::Null)
}

/// A job as `GET /api/v1/jobs/{id}` shows it: the row, its current workers, its events, spec, summary and the
/// newest metrics line.
pub(crate) async fn job_view(control: &Control, job: &JobRow) -> Result<Value> {
    let db = &control.db;
    let tasks = db.tasks(&job.id, job.attempt).await?;
    let events = db.events(&job.id, 0).await?;
    let last = db.metrics(&job.id, Some(0), db.last_metric_step(&job.id, 0).await? - 1, 1).await?;
    let mut v = job_json(job);
    if let Some(obj) = v.as_object_mut() {
        let workers: Vec<crate::view::TaskView<'_>> = tasks.iter().map(Into::into).collect();
        obj.insert("workers".into(), serde_json::to_value(&workers).unwrap_or(Value::Null));
        obj.insert("events".into(), serde_json::to_value(&events).unwrap_or(Value::Null));
        obj.insert("spec".into(), serde_json::from_str(&job.spec).unwrap_or(Value::Null));
        obj.insert(
            "summary".into(),
            job.summary.as_deref().and_then(|s| serde_json::from_str(s).ok()).unwrap_or(Value::Null),
        );
        obj.insert("last_metrics".into(), last.first().map_or(Value::Null, |m| m.data.clone()));
    }
    Ok(v)
}

/// The queues with their guarantees and what their jobs hold now.
pub(crate) async fn queues_json(c: &Control) -> Result<Vec<Value>> {
    let active = c.db.jobs_in(&[JobState::Pending, JobState::Running, JobState::Preempted]).await?;
    let mut out = Vec::new();
    for q in &c.queues {
        let count = |s: JobState| active.iter().filter(|j| j.queue == q.name && j.state == s).count();
        let (mut cpus, mut mem, mut gpus) = (0.0, 0u64, 0.0);
        for j in
            active.iter().filter(|j| j.queue == q.name && matches!(j.state, JobState::Running | JobState::Preempted))
        {
            if let Ok(spec) = c.spec_of(j) {
                let n = j.workers as f64;
                cpus += n * spec.resources.cpus as f64 / 1000.0;
                mem += j.workers.max(0) as u64 * spec.resources.memory;
                gpus += n * spec.resources.gpus as f64 / 1000.0;
            }
        }
        out.push(json!({
            "name": q.name,
            "guaranteed": { "cpus": q.guaranteed.cpus_milli as f64 / 1000.0, "memory_bytes": q.guaranteed.memory_bytes,
                            "gpus": q.guaranteed.gpus_milli as f64 / 1000.0 },
            "can_borrow": q.can_borrow,
            "pending": count(JobState::Pending),
            "running": count(JobState::Running),
            "preempted": count(JobState::Preempted),
            "allocated": { "cpus": cpus, "memory_bytes": mem, "gpus": gpus },
        }));
    }
    Ok(out)
}

/// Each node with its capacity and what is allocated on it (`GET /api/v1/nodes`).
pub(crate) fn nodes_json(c: &Control) -> Vec<Value> {
    let alloc = c.allocations();
    c.nodes.iter().map(|n| node_value(&[n], &alloc, &n.id, &n.host)).collect()
}

/// The cluster as one node (the overview, `/metrics`): its only node, or every node's capacity and allocation
/// summed under the id `cluster`.
pub(crate) fn node_json(c: &Control) -> Value {
    let alloc = c.allocations();
    let all: Vec<&shoal_sched::Node> = c.nodes.iter().collect();
    match all.as_slice() {
        [n] => node_value(&all, &alloc, &n.id, &n.host),
        _ => node_value(&all, &alloc, "cluster", &all.iter().map(|n| n.host.as_str()).collect::<Vec<_>>().join(",")),
    }
}

fn node_value(nodes: &[&shoal_sched::Node], alloc: &[shoal_sched::NodeAllocation], id: &str, host: &str) -> Value {
    let a: Vec<_> = alloc.iter().filter(|a| nodes.iter().any(|n| n.id == a.node)).collect();
    json!({
        "id": id,
        "host": host,
        "cpus": nodes.iter().map(|n| n.cpus_milli).sum::<u64>() as f64 / 1000.0,
        "memory_bytes": nodes.iter().map(|n| n.memory_bytes).sum::<u64>(),
        "gpus": nodes.iter().flat_map(|n| &n.gpus).map(|g| json!({ "index": g.index, "kind": g.kind, "memory_bytes": g.memory_bytes })).collect::<Vec<_>>(),
        "allocated": {
            "cpus": a.iter().map(|a| a.cpus_milli).sum::<u64>() as f64 / 1000.0,
            "memory_bytes": a.iter().map(|a| a.memory_bytes).sum::<u64>(),
            "gpus": a.iter().flat_map(|a| &a.gpus).map(|(share, _)| f64::from(*share)).sum::<f64>() / 1000.0 + 0.0,
        },
    })
}
