//! The tasks of a job as they start: how each is launched (the worker over the job's spec, with the job's
//! environment and the contract) and the rows that record it before and after it starts — for a whole attempt
//! (`decisions.rs`) and for a task that joins a running group in place (`group.rs`).

use shoal_exec::{Task, TaskLaunch};
use shoal_sched::TaskPlacement;

use super::state::Control;
use crate::db::{JobRow, TaskRow, TaskState};

impl Control {
    /// How task `rank` of `world` of attempt `attempt` of `job` starts where the scheduler placed it (`a`): the
    /// worker over the job's spec, resuming from its newest checkpoint, with the job's environment and the contract.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_of(
        &self,
        job: &JobRow,
        spec: &shoal_spec::JobSpec,
        attempt: i64,
        rank: usize,
        world: usize,
        rendezvous: &str,
        a: &TaskPlacement,
    ) -> TaskLaunch {
        let argv = vec![
            self.config.worker_program.display().to_string(),
            "worker".into(),
            "--output".into(),
            self.run_dir(&job.id).display().to_string(),
            "--resume".into(),
            self.job_dir(&job.id).join("job.json").display().to_string(),
        ];
        let mut env: Vec<(String, String)> = spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        env.extend(self.config.policy.team_env(&job.team));
        TaskLaunch {
            job_id: job.id.clone(),
            attempt,
            rank,
            world_size: world,
            secret: self.job_secret(job),
            rendezvous: rendezvous.to_owned(),
            argv,
            cpus_milli: spec.resources.cpus,
            memory_bytes: spec.resources.memory,
            gpus: a.gpus.clone(),
            node: a.node.clone(),
            env,
            queue: job.queue.clone(),
            server: self.config.server.clone(),
            server_ca: self.config.server_ca.clone(),
            join: None,
        }
    }
}

/// The row of task `rank` of attempt `attempt` of job `id`, placed at `a`, before it starts (recorded first).
pub(super) fn intent_row(id: &str, attempt: i64, rank: i64, a: &TaskPlacement, host: &str) -> TaskRow {
    TaskRow {
        job_id: id.to_owned(),
        attempt,
        rank,
        node: a.node.clone(),
        host: host.to_owned(),
        pid: None,
        worker_pid: None,
        start_ticks: None,
        state: TaskState::Starting,
        exit_code: None,
        reason: String::new(),
        cpus: String::new(),
        gpus: a.gpus.iter().map(|(i, _)| i.to_string()).collect::<Vec<_>>().join(","),
        started_ms: None,
        ended_ms: None,
        cpu_seconds: None,
        external_id: None,
    }
}

/// The row of a task its executor just started on `node`.
pub(super) fn started_row(t: Task, node: &str, now_ms: i64) -> TaskRow {
    TaskRow {
        job_id: t.job_id,
        attempt: t.attempt,
        rank: t.rank,
        node: node.to_owned(),
        host: t.host,
        pid: t.pid,
        worker_pid: t.worker_pid,
        start_ticks: t.start_ticks,
        state: TaskState::Running,
        exit_code: None,
        reason: String::new(),
        cpus: t.cpus,
        gpus: t.gpus,
        started_ms: t.started_ms.or(Some(now_ms)),
        ended_ms: None,
        cpu_seconds: None,
        external_id: t.external_id,
    }
}
