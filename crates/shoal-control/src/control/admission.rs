//! Admission: the scheduler's view of a job's request, and whether a job could ever run here, by the scheduler's own
//! check, its refusals mapped to the spec's key paths.

use shoal_sched::{JobRequest, Resources};
use shoal_spec::JobSpec;

use crate::db::JobRow;
use crate::error::{ControlError, Result};

use super::state::Control;

/// The tasks a job asks for: its workers' range, and its parameter servers (`ps.servers` under
/// `train.strategy = "ps"`) beside them — the last tasks of its gang.
pub fn tasks_range(spec: &JobSpec) -> (u32, u32) {
    let (lo, hi) = spec.workers.range();
    let servers = spec.ps_servers() as u32;
    (lo.saturating_add(servers), hi.saturating_add(servers))
}

/// The scheduler's view of a job's request. A job restarted by `fault_tolerance.policy = "restart"` asks for the
/// number of tasks it ran with (its gang starts again whole); an elastic one for whatever fits its range.
/// A gang of `tasks` tasks of `spec` as the events tell it: `N workers`, or `N workers and S parameter server(s)`
/// when its last tasks serve.
pub fn tell_tasks(spec: &JobSpec, tasks: usize) -> String {
    let servers = spec.ps_servers().min(tasks);
    let workers = tasks - servers;
    match servers {
        0 => format!("{workers} workers"),
        1 => format!("{workers} workers and 1 parameter server"),
        s => format!("{workers} workers and {s} parameter servers"),
    }
}

pub fn request_of(job: &JobRow, spec: &JobSpec) -> JobRequest {
    let (mut lo, mut hi) = tasks_range(spec);
    let same = job.workers.clamp(i64::from(lo), i64::from(hi)) as u32;
    if job.restarts > 0 && job.workers > 0 && spec.fault_tolerance.policy == shoal_spec::FaultPolicy::Restart {
        (lo, hi) = (same, same);
    }
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
        expected_runtime_ms: spec.expected_runtime.map(|t| t.0.as_millis().min(u128::from(u64::MAX)) as u64),
        avoid_nodes: Vec::new(),
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

impl Control {
    /// Whether a job could ever run here, by the scheduler's own admission check; a refusal names the spec's key
    /// (`resources.gpus`, `workers`, `queue`, ...) rather than the scheduler's field.
    pub fn admissible(&self, team: &str, spec: &JobSpec) -> Result<()> {
        let (lo, hi) = tasks_range(spec);
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
            avoid_nodes: Vec::new(),
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
}
