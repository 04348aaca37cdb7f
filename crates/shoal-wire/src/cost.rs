//! What jobs cost, as `GET /api/v1/cost` reports it: the prices in force, every job, every team, the total.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The server's price table (`--prices FILE`, TOML with these keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    #[serde(default = "usd")]
    pub currency: String,
    /// Per CPU-hour.
    #[serde(default)]
    pub cpu_hour: f64,
    /// Per GiB-hour of memory.
    #[serde(default)]
    pub gib_hour: f64,
    /// Per GPU-hour.
    #[serde(default)]
    pub gpu_hour: f64,
    /// Per kWh, for the energy estimate where GPUs report power.
    #[serde(default)]
    pub kwh: f64,
}

fn usd() -> String {
    "USD".into()
}

impl Default for Prices {
    /// On-demand list prices of the order of a general-purpose cloud VM and a data-centre GPU; set your own.
    fn default() -> Self {
        Prices { currency: usd(), cpu_hour: 0.04, gib_hour: 0.005, gpu_hour: 2.5, kwh: 0.15 }
    }
}

/// Resource-hours.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Hours {
    pub cpu_hours: f64,
    pub gib_hours: f64,
    pub gpu_hours: f64,
}

impl Hours {
    pub fn add(&mut self, o: &Hours) {
        self.cpu_hours += o.cpu_hours;
        self.gib_hours += o.gib_hours;
        self.gpu_hours += o.gpu_hours;
    }
}

/// One job's cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobCost {
    pub id: String,
    pub name: String,
    pub team: String,
    pub state: String,
    /// From submission to the first start (to now while still waiting).
    pub queue_s: f64,
    /// What its workers held, from their start to their end.
    pub allocated: Hours,
    /// What they used (CPU time; memory from resident-size samples).
    pub used: Hours,
    /// Charged on allocation.
    pub cost: f64,
    /// Energy where GPUs report power (NVML); none otherwise.
    pub energy_kwh: Option<f64>,
    /// A job with `[[phases]]`: what each phase held and cost (the phases it has reached), adding up to the job's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhaseCost>,
}

/// One `[[phases]]` phase of a job's cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PhaseCost {
    /// Its index in `[[phases]]`.
    pub phase: usize,
    /// The step it ends at (none: the run's end).
    pub until_step: Option<usize>,
    /// The most workers it ran with at once.
    pub workers: usize,
    pub allocated: Hours,
    /// Charged on allocation (energy is the job's, not split by phase).
    pub cost: f64,
}

/// One team's jobs, summed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TeamCost {
    pub team: String,
    pub jobs: u64,
    pub queue_s: f64,
    pub allocated: Hours,
    pub used: Hours,
    pub cost: f64,
}

/// `GET /api/v1/cost`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CostReport {
    pub prices: Prices,
    pub currency: String,
    pub jobs: Vec<JobCost>,
    pub teams: Vec<TeamCost>,
    pub total_cost: f64,
}
