//! What the API shows of jobs, tasks, queues, nodes, events, metrics and samples: the `shoal-wire` types, built
//! here from the store's rows and the scheduler's books, so that a column added to the store (a secret, a
//! checkpoint key, a process' start time) never reaches a client by accident, and a row can change shape without
//! changing the API.

use shoal_wire as wire;

use crate::control::{Control, parse_stored_spec};
use crate::db::{ClusterSample, EventRow, JobRow, JobState, MetricRow, Principal, SampleRow, TaskRow};
use crate::error::Result;

/// A job in listings.
pub fn job(j: &JobRow) -> wire::JobView {
    wire::JobView {
        id: j.id.clone(),
        name: j.name.clone(),
        user: j.user.clone(),
        team: j.team.clone(),
        queue: j.queue.clone(),
        priority: j.priority,
        state: j.state,
        restarts: j.restarts,
        attempt: j.attempt,
        worker_count: j.workers,
        created_ms: j.created_ms,
        started_ms: j.started_ms,
        finished_ms: j.finished_ms,
        reason: j.reason.clone(),
        cancel_requested: j.cancel_requested,
    }
}

/// One task of a job's attempt; `servers` of the job's tasks, the last ones, are parameter servers.
pub fn task(t: &TaskRow, tasks: i64, servers: i64) -> wire::TaskView {
    wire::TaskView {
        job_id: t.job_id.clone(),
        attempt: t.attempt,
        rank: t.rank,
        node: t.node.clone(),
        host: t.host.clone(),
        pid: t.worker_pid,
        wrapper_pid: t.pid,
        state: t.state,
        exit_code: t.exit_code,
        reason: t.reason.clone(),
        cpus: t.cpus.clone(),
        gpus: t.gpus.clone(),
        started_ms: t.started_ms,
        ended_ms: t.ended_ms,
        cpu_seconds: t.cpu_seconds,
        role: if servers > 0 && t.rank >= tasks - servers { wire::TaskRole::Server } else { wire::TaskRole::Worker },
    }
}

pub fn event(e: &EventRow) -> wire::Event {
    wire::Event {
        id: e.id,
        job_id: e.job_id.clone(),
        time_ms: e.time_ms,
        kind: e.kind.clone(),
        state: e.state.clone(),
        message: e.message.clone(),
    }
}

pub fn metric(m: MetricRow) -> wire::Metric {
    wire::Metric { rank: m.rank, step: m.step, time_ms: m.time_ms, data: m.data }
}

/// A metrics line a client sent, as the store keeps it.
pub fn metric_row(m: wire::Metric) -> MetricRow {
    MetricRow { rank: m.rank, step: m.step, time_ms: m.time_ms, data: m.data }
}

pub fn sample(s: &SampleRow) -> wire::Sample {
    wire::Sample {
        rank: s.rank,
        time_ms: s.time_ms,
        cpu_percent: s.cpu_percent,
        rss_bytes: s.rss_bytes,
        cpu_seconds: s.cpu_seconds,
        net_rx_bytes_per_s: s.net_rx_bytes_per_s,
        net_tx_bytes_per_s: s.net_tx_bytes_per_s,
        gpu_util_percent: s.gpu_util_percent,
        gpu_memory_bytes: s.gpu_memory_bytes,
        gpu_temperature_c: s.gpu_temperature_c,
        gpu_power_w: s.gpu_power_w,
    }
}

pub fn cluster_sample(c: &ClusterSample) -> wire::ClusterSample {
    wire::ClusterSample {
        time_ms: c.time_ms,
        cpus_allocated: c.cpus_allocated,
        memory_allocated_bytes: c.memory_allocated_bytes,
        gpus_allocated: c.gpus_allocated,
        pending: c.pending,
        running: c.running,
    }
}

pub fn whoami(p: &Principal) -> wire::WhoAmI {
    wire::WhoAmI { user: p.user.clone(), team: p.team.clone(), admin: p.admin }
}

pub fn finding(f: &crate::diagnose::Finding) -> wire::Finding {
    wire::Finding { kind: f.kind.to_owned(), rank: f.rank, evidence: f.evidence.clone(), action: f.action.clone() }
}

/// A job as `GET /api/v1/jobs/{id}` shows it: the row, its current workers, its events, spec, summary and the
/// newest metrics line of rank 0.
pub async fn job_detail(control: &Control, job: &JobRow) -> Result<wire::JobDetail> {
    let db = &control.db;
    let mut tasks = db.tasks(&job.id, job.attempt).await?;
    // An elastic job regrouped in place works with its group's members; the tasks it lost are in its events.
    if let Some(members) = control.members(job) {
        tasks.retain(|t| members.contains(&t.rank));
    }
    let events = db.events(&job.id, 0).await?;
    let last = db.metrics(&job.id, Some(0), db.last_metric_step(&job.id, 0).await? - 1, 1).await?;
    // Parsed afresh rather than through the control loop's cache, which holds active jobs only.
    let spec = parse_stored_spec(job).ok();
    let servers = spec.as_ref().map_or(0, |s| s.ps_servers() as i64);
    Ok(wire::JobDetail {
        job: self::job(job),
        workers: tasks.iter().map(|t| task(t, job.workers, servers)).collect(),
        events: events.iter().map(event).collect(),
        spec,
        summary: job.summary.as_deref().and_then(|s| serde_json::from_str(s).ok()),
        last_metrics: last.into_iter().next().map(|m| m.data).filter(|d| !d.is_null()),
        hang_dump: control.hang_dump(&job.id),
    })
}

/// The queues with their guarantees and what their jobs hold now.
pub async fn queues(c: &Control) -> Result<Vec<wire::QueueView>> {
    let active = c.db.jobs_in(&[JobState::Pending, JobState::Running, JobState::Preempted]).await?;
    let mut out = Vec::new();
    for q in &c.queues {
        let count = |s: JobState| active.iter().filter(|j| j.queue == q.name && j.state == s).count() as u64;
        let mut held = wire::Resources::default();
        for j in
            active.iter().filter(|j| j.queue == q.name && matches!(j.state, JobState::Running | JobState::Preempted))
        {
            if let Ok(spec) = c.spec_of(j) {
                let n = j.workers as f64;
                held.cpus += n * spec.resources.cpus as f64 / 1000.0;
                held.memory_bytes += j.workers.max(0) as u64 * spec.resources.memory;
                held.gpus += n * spec.resources.gpus as f64 / 1000.0;
            }
        }
        out.push(wire::QueueView {
            name: q.name.clone(),
            guaranteed: wire::Resources {
                cpus: q.guaranteed.cpus_milli as f64 / 1000.0,
                memory_bytes: q.guaranteed.memory_bytes,
                gpus: q.guaranteed.gpus_milli as f64 / 1000.0,
            },
            can_borrow: q.can_borrow,
            pending: count(JobState::Pending),
            running: count(JobState::Running),
            preempted: count(JobState::Preempted),
            allocated: held,
        });
    }
    Ok(out)
}

/// Each node with its capacity and what is allocated on it (`GET /api/v1/nodes`): this host, or the cluster
/// manager's nodes (Slurm's).
pub fn nodes(c: &Control) -> Vec<wire::NodeView> {
    let alloc = c.allocations();
    c.nodes.iter().map(|n| node_view(&[n], &alloc, &n.id, &n.host)).collect()
}

/// The cluster as one node (the overview, `/metrics`): its only node, or every node's capacity and allocation
/// summed under the id `cluster`.
pub fn node(c: &Control) -> wire::NodeView {
    let alloc = c.allocations();
    let all: Vec<&shoal_sched::Node> = c.nodes.iter().collect();
    match all.as_slice() {
        [n] => node_view(&all, &alloc, &n.id, &n.host),
        _ => {
            let hosts = all.iter().map(|n| n.host.as_str()).collect::<Vec<_>>().join(",");
            node_view(&all, &alloc, "cluster", &hosts)
        }
    }
}

fn node_view(
    nodes: &[&shoal_sched::Node],
    alloc: &[shoal_sched::NodeAllocation],
    id: &str,
    host: &str,
) -> wire::NodeView {
    let a: Vec<_> = alloc.iter().filter(|a| nodes.iter().any(|n| n.id == a.node)).collect();
    wire::NodeView {
        id: id.to_owned(),
        host: host.to_owned(),
        cpus: nodes.iter().map(|n| n.cpus_milli).sum::<u64>() as f64 / 1000.0,
        memory_bytes: nodes.iter().map(|n| n.memory_bytes).sum::<u64>(),
        gpus: nodes
            .iter()
            .flat_map(|n| &n.gpus)
            .map(|g| wire::GpuView { index: g.index, kind: g.kind.clone(), memory_bytes: g.memory_bytes })
            .collect(),
        allocated: wire::Resources {
            cpus: a.iter().map(|a| a.cpus_milli).sum::<u64>() as f64 / 1000.0,
            memory_bytes: a.iter().map(|a| a.memory_bytes).sum::<u64>(),
            gpus: a.iter().flat_map(|a| &a.gpus).map(|(share, _)| f64::from(*share)).sum::<f64>() / 1000.0 + 0.0,
        },
    }
}

/// The cluster at a glance: capacity and allocation, jobs by state, queues, allocation over time.
pub async fn overview(c: &Control) -> Result<wire::Overview> {
    let mut jobs = wire::JobCounts::default();
    for j in c.db.jobs(None, &[], 100_000).await? {
        let n = match j.state {
            JobState::Pending => &mut jobs.pending,
            JobState::Running => &mut jobs.running,
            JobState::Preempted => &mut jobs.preempted,
            JobState::Succeeded => &mut jobs.succeeded,
            JobState::Failed => &mut jobs.failed,
            JobState::Cancelled => &mut jobs.cancelled,
        };
        *n += 1;
    }
    let node = node(c);
    let history = c.db.cluster_samples(0, 2000).await?;
    Ok(wire::Overview {
        cluster: wire::ClusterView {
            cpus: node.cpus,
            memory_bytes: node.memory_bytes,
            gpus: node.gpus.len() as u64,
            allocated: node.allocated,
        },
        jobs,
        queues: queues(c).await?,
        history: history.iter().map(cluster_sample).collect(),
    })
}
