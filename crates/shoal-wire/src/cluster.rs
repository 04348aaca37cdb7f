//! The cluster as the API shows it: health, the caller and new tokens, queues, nodes, resource samples and the
//! overview the dashboard draws.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `GET /healthz`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Health {
    pub ok: bool,
    /// The store in use: `sqlite` or `postgres`.
    pub database: String,
}

/// `GET /api/v1/whoami`: a token's owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct WhoAmI {
    pub user: String,
    pub team: String,
    pub admin: bool,
}

/// `POST /api/v1/tokens` (admin): a token for a user of a team.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewToken {
    /// 1-64 letters, digits, `.`, `_` or `-`.
    #[schema(pattern = "^[A-Za-z0-9._-]{1,64}$")]
    pub user: String,
    /// 1-64 letters, digits, `.`, `_` or `-`.
    #[schema(pattern = "^[A-Za-z0-9._-]{1,64}$")]
    pub team: String,
    /// An admin sees and acts on every team's jobs and creates tokens.
    #[serde(default)]
    pub admin: bool,
}

/// `POST /api/v1/tokens`: the new token, shown this once (the server keeps only its hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TokenCreated {
    pub token: String,
    pub user: String,
    pub team: String,
    pub admin: bool,
}

/// An amount of resources.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Resources {
    /// CPUs (cores, fractional).
    pub cpus: f64,
    pub memory_bytes: u64,
    /// GPUs (fractional shares count as fractions).
    pub gpus: f64,
}

/// A queue with its guarantee and what its jobs hold now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct QueueView {
    pub name: String,
    pub guaranteed: Resources,
    /// Whether its jobs may use what other queues leave idle.
    pub can_borrow: bool,
    pub pending: u64,
    pub running: u64,
    pub preempted: u64,
    /// What its running and preempted jobs hold.
    pub allocated: Resources,
}

/// `GET /api/v1/queues`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct QueueList {
    pub queues: Vec<QueueView>,
}

/// One GPU of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct GpuView {
    /// What `CUDA_VISIBLE_DEVICES` names.
    pub index: u32,
    /// The model, e.g. `H100`.
    pub kind: String,
    pub memory_bytes: u64,
}

/// A node with its capacity and what is allocated on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct NodeView {
    pub id: String,
    pub host: String,
    pub cpus: f64,
    pub memory_bytes: u64,
    pub gpus: Vec<GpuView>,
    pub allocated: Resources,
}

/// `GET /api/v1/nodes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct NodeList {
    pub nodes: Vec<NodeView>,
}

/// One resource sample of one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Sample {
    pub rank: i64,
    pub time_ms: i64,
    /// 100 = one CPU busy.
    pub cpu_percent: Option<f64>,
    pub rss_bytes: Option<i64>,
    pub cpu_seconds: Option<f64>,
    /// The host's network, all interfaces (bytes/s).
    pub net_rx_bytes_per_s: Option<f64>,
    pub net_tx_bytes_per_s: Option<f64>,
    pub gpu_util_percent: Option<f64>,
    pub gpu_memory_bytes: Option<i64>,
    pub gpu_temperature_c: Option<f64>,
    pub gpu_power_w: Option<f64>,
}

/// `GET /api/v1/jobs/{id}/samples`, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SampleList {
    pub samples: Vec<Sample>,
}

/// Cluster-wide allocation at one time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ClusterSample {
    pub time_ms: i64,
    pub cpus_allocated: f64,
    pub memory_allocated_bytes: i64,
    pub gpus_allocated: f64,
    /// Jobs pending and running then.
    pub pending: i64,
    pub running: i64,
}

/// The cluster's capacity and allocation, summed over its nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ClusterView {
    pub cpus: f64,
    pub memory_bytes: u64,
    /// How many GPUs.
    pub gpus: u64,
    pub allocated: Resources,
}

/// Jobs by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct JobCounts {
    pub pending: u64,
    pub running: u64,
    pub preempted: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub cancelled: u64,
}

/// `GET /api/v1/overview` (and each `overview` event of its stream).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Overview {
    pub cluster: ClusterView,
    pub jobs: JobCounts,
    pub queues: Vec<QueueView>,
    /// Allocation over time, oldest first.
    pub history: Vec<ClusterSample>,
}
