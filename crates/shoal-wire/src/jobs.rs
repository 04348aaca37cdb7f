//! Jobs as the API shows them: listings, a job's status with its workers and events, submission and cancellation
//! answers, metrics going in and out, the diagnosis, and the log lines of a job's live stream.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// Where a job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Pending,
    Running,
    Preempted,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 6] = [
        JobState::Pending,
        JobState::Running,
        JobState::Preempted,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Preempted => "preempted",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Succeeded, failed or cancelled: nothing will change it any more.
    pub fn is_final(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where one worker process stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TaskState {
    /// Recorded before its process starts (the intent): a server that crashes before the process is recorded
    /// finds the row, kills whatever of the job's runs unrecorded, and starts the attempt again.
    Starting,
    Running,
    Exited,
    Lost,
}

impl TaskState {
    pub const ALL: [TaskState; 4] = [TaskState::Starting, TaskState::Running, TaskState::Exited, TaskState::Lost];

    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Starting => "starting",
            TaskState::Running => "running",
            TaskState::Exited => "exited",
            TaskState::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Option<TaskState> {
        TaskState::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl std::fmt::Display for TaskState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A job in listings (and the head of `GET /api/v1/jobs/{id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobView {
    /// `j-` and 8 hex digits.
    pub id: String,
    pub name: String,
    pub user: String,
    pub team: String,
    pub queue: String,
    pub priority: i64,
    pub state: JobState,
    /// Times it was started again after a failure or a loss.
    pub restarts: i64,
    /// Starts so far (1 after the first placement); a preemption starts a new attempt but is no restart.
    pub attempt: i64,
    /// Workers of the current (or last) attempt.
    pub worker_count: i64,
    /// Milliseconds since the Unix epoch, like every `_ms` time of the API.
    pub created_ms: i64,
    pub started_ms: Option<i64>,
    pub finished_ms: Option<i64>,
    /// Why it is in its state (the last transition's reason).
    pub reason: String,
    pub cancel_requested: bool,
}

/// One worker of a job's current attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TaskView {
    pub job_id: String,
    pub attempt: i64,
    pub rank: i64,
    pub node: String,
    pub host: String,
    /// The training process itself: the one to signal, profile or attach a debugger to.
    pub pid: Option<i64>,
    /// The exit-status wrapper, leader of the task's session (its process group gets the server's signals).
    pub wrapper_pid: Option<i64>,
    pub state: TaskState,
    pub exit_code: Option<i64>,
    pub reason: String,
    /// CPUs it is pinned to (`0-3,6`), empty when not pinned.
    pub cpus: String,
    /// `CUDA_VISIBLE_DEVICES` it got, empty for none.
    pub gpus: String,
    pub started_ms: Option<i64>,
    pub ended_ms: Option<i64>,
    /// CPU time its processes used (user + system), as last sampled.
    pub cpu_seconds: Option<f64>,
    /// What it does: `worker` (trains), or `server` (a parameter server of `train.strategy = "ps"`, the job's last
    /// tasks).
    pub role: TaskRole,
}

/// What a task of a job does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TaskRole {
    /// Trains: a rank of the workers' group.
    #[default]
    Worker,
    /// Serves the model: a parameter server.
    Server,
}

/// One transition or notable fact of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Event {
    /// Increasing: `GET /api/v1/jobs/{id}/events?after=ID` continues after it.
    pub id: i64,
    pub job_id: String,
    pub time_ms: i64,
    /// `submitted`, `placed`, `started`, `succeeded`, `failed`, `cancelled`, `preempted`, `requeued`, `lost`,
    /// `adopted`, `restarted`, `cancel`, `warning`, ...
    pub kind: String,
    /// The job's state after the event.
    pub state: String,
    pub message: String,
}

/// `GET /api/v1/jobs/{id}`: the job, its current workers, its events, spec, summary and newest metrics line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobDetail {
    #[serde(flatten)]
    pub job: JobView,
    pub workers: Vec<TaskView>,
    pub events: Vec<Event>,
    /// The spec as accepted, defaults spelled out (`null` if the stored spec cannot be read).
    pub spec: Option<shoal_spec::JobSpec>,
    /// The run's `summary.json` once it finished (steps, losses, evaluation, throughput).
    #[schema(value_type = Option<Object>)]
    pub summary: Option<Value>,
    /// Rank 0's newest metrics line, as the worker wrote it (`step`, `loss`, timings, ...).
    #[schema(value_type = Option<Object>)]
    pub last_metrics: Option<Value>,
    /// The dump taken when the job last hung or a rank of it fell silent: every rank's collective, sequence number
    /// and time in it (`null`: neither happened).
    pub hang_dump: Option<crate::faults::HangDump>,
}

/// `GET /api/v1/jobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobList {
    pub jobs: Vec<JobView>,
}

/// `POST /api/v1/jobs`: the new job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Submitted {
    pub id: String,
    pub state: JobState,
    pub name: String,
}

/// `POST /api/v1/jobs/{id}/cancel`: accepted; the job ends `cancelled` once its workers are gone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CancelAccepted {
    pub id: String,
    /// Its state when the cancel was recorded.
    pub state: JobState,
    pub cancel_requested: bool,
}

/// `GET /api/v1/jobs/{id}/events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EventList {
    pub events: Vec<Event>,
}

/// One metrics line of one rank (`rank` -1: an evaluation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Metric {
    pub rank: i64,
    pub step: i64,
    pub time_ms: i64,
    /// The line as the worker wrote it (a JSON object: `step`, `loss`, `step_s`, ...).
    #[schema(value_type = Object)]
    pub data: Value,
}

/// `POST /api/v1/jobs/{id}/metrics`: lines to store (a line already stored, same rank and step, is kept).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MetricsBatch {
    pub metrics: Vec<Metric>,
}

/// `POST /api/v1/jobs/{id}/metrics`: how many lines were new.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MetricsStored {
    pub stored: u64,
}

/// `GET /api/v1/jobs/{id}/metrics`, by step then rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MetricList {
    pub metrics: Vec<Metric>,
}

/// What holds a job back, with the evidence and an action.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Finding {
    /// `data_loading`, `communication`, `straggler`, `underutilized`, `memory_pressure` or `healthy`.
    pub kind: String,
    /// The rank it is about, when one.
    pub rank: Option<i64>,
    pub evidence: String,
    pub action: String,
}

/// `GET /api/v1/jobs/{id}/diagnosis`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Diagnosis {
    pub id: String,
    pub state: JobState,
    pub findings: Vec<Finding>,
}

/// A `log` event of a job's live stream: new output of a rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LogText {
    pub rank: i64,
    pub text: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> JobView {
        JobView {
            id: "j-0123abcd".into(),
            name: "tiny".into(),
            user: "alice".into(),
            team: "vision".into(),
            queue: "default".into(),
            priority: 0,
            state: JobState::Pending,
            restarts: 0,
            attempt: 0,
            worker_count: 2,
            created_ms: 1,
            started_ms: None,
            finished_ms: None,
            reason: "submitted".into(),
            cancel_requested: false,
        }
    }

    #[test]
    fn a_job_detail_is_the_job_flattened_with_its_parts_and_nulls() {
        let d = JobDetail {
            job: job(),
            workers: Vec::new(),
            events: Vec::new(),
            spec: None,
            summary: None,
            last_metrics: None,
            hang_dump: None,
        };
        let v = serde_json::to_value(&d).expect("serialize");
        assert_eq!(v["id"], "j-0123abcd");
        assert_eq!(v["state"], "pending");
        assert!(v["started_ms"].is_null() && v.get("started_ms").is_some(), "{v}");
        for k in ["spec", "summary", "last_metrics", "hang_dump"] {
            assert!(v.get(k).is_some_and(Value::is_null), "{k}: {v}");
        }
        let back: JobDetail = serde_json::from_value(v).expect("deserialize");
        assert_eq!(back, d);
    }

    #[test]
    fn states_round_trip_through_their_names() {
        for s in JobState::ALL {
            assert_eq!(JobState::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).expect("serialize"), s.as_str());
        }
        for s in TaskState::ALL {
            assert_eq!(TaskState::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).expect("serialize"), s.as_str());
        }
    }
}
