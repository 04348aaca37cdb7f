//! `shoal-wire`: the types that cross processes over HTTP — the bodies of Shoal's API requests and responses,
//! shared by the server (`shoal-control`, which builds them from its store's rows) and its clients (the `shoal`
//! CLI, which reads them typed).
//!
//! - [`error`]: the JSON error body and its stable machine-readable [`ErrorCode`]s.
//! - [`jobs`]: jobs, their workers, events, metrics, diagnosis; submission and cancellation answers.
//! - [`cluster`]: health, callers and tokens, queues, nodes, resource samples, the overview.
//! - [`cost`]: prices and the cost report.
//! - [`faults`]: a worker's heartbeat, the dump of a job's ranks (hangs, `shoal debug`), chaos requests.
//!
//! Invariants:
//! - Plain data: serde, `serde_json` and `utoipa` (every type derives `ToSchema`, so the server's OpenAPI document
//!   is generated from the same types it sends); no async runtime, no HTTP framework, no database, no tensors.
//! - What a type serializes to is the API's contract: field names, `null`s and nesting do not change without a
//!   new API version. Optional values are `null`, never left out.
//! - The job spec's wire form is [`shoal_spec::JobSpec`] (in its JSON shape), which describes itself to OpenAPI
//!   with `shoal-spec`'s feature `openapi`.

pub mod cluster;
pub mod cost;
pub mod error;
pub mod faults;
pub mod jobs;

pub use cluster::{
    ClusterSample, ClusterView, GpuView, Health, JobCounts, NewToken, NodeList, NodeView, Overview, QueueList,
    QueueView, Resources, Sample, SampleList, TokenCreated, WhoAmI,
};
pub use cost::{CostReport, Hours, JobCost, PhaseCost, Prices, TeamCost};
pub use error::{ErrorBody, ErrorCode};
pub use faults::{ChaosAction, ChaosDone, ChaosRequest, HangDump, Heartbeat, HeartbeatReply, RankDump, Regroup};
pub use jobs::{
    CancelAccepted, Diagnosis, Event, EventList, Finding, JobDetail, JobList, JobState, JobView, LogText, Metric,
    MetricList, MetricsBatch, MetricsStored, Submitted, TaskRole, TaskState, TaskView,
};
