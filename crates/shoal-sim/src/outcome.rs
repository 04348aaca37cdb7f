//! What a simulation is asked to do ([`SimOptions`]) and what it produced ([`Outcome`]: each job's record, the
//! cluster after each pass and at each arrival, each team's tally), shared by both engines and by the report.

use shoal_sched::Policy;

use crate::trace::{Trace, TraceJob};

/// How to run a simulation.
#[derive(Debug, Clone, PartialEq)]
pub struct SimOptions {
    /// The scheduling policy.
    pub policy: Policy,
    /// Arrivals this many times as fast as the trace's (`submit = first + (submit - first) / load`); durations
    /// are kept. 1 replays the trace as it was.
    pub load: f64,
    /// The trace replayed this many times back to back (copy `c` submitted `c` trace spans later, its ids
    /// suffixed `~c`), to offer more work than the cluster holds; 1 replays it once.
    pub repeat: u32,
    /// The scheduler's loop: a pass runs at the first multiple of this after something happened (everything
    /// up to then happens at its own time, the pass sees it all); 0 runs a pass at every instant something happens.
    pub interval_ms: u64,
    /// Grace period of a preempted job.
    pub grace_ms: u64,
    /// LAS thresholds in GPU-milliseconds (`None`: shoal-sched's defaults).
    pub las_thresholds_gpu_ms: Option<Vec<u64>>,
    /// Check the invariants after every pass (no node over capacity, the scheduler's books balance); slow.
    pub audit: bool,
    /// The seed given, recorded in the report (it draws a synthetic trace; the simulation itself draws nothing).
    pub seed: u64,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            policy: Policy::default(),
            load: 1.0,
            repeat: 1,
            interval_ms: 1_000,
            grace_ms: 30_000,
            las_thresholds_gpu_ms: None,
            audit: false,
            seed: 0,
        }
    }
}

/// What happened to one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRecord {
    /// Its id.
    pub id: String,
    /// Its team.
    pub team: String,
    /// Submitted (after the load factor).
    pub submit_ms: u64,
    /// First started.
    pub first_start_ms: Option<u64>,
    /// Ended.
    pub end_ms: Option<u64>,
    /// How many times it started (1 + resumptions after preemption).
    pub starts: u32,
    /// How many times it was preempted.
    pub preemptions: u32,
    /// GPU time held while running, thousandths of a GPU times milliseconds.
    pub gpu_milli_ms: u128,
    /// GPU time it asked for: its GPUs at `tasks_min` times its duration.
    pub demand_milli_ms: u128,
    /// Task-milliseconds of work done (equals `duration × tasks_min` once it ends).
    pub worked_task_ms: u128,
    /// Why the scheduler refused it, if it did.
    pub rejected: Option<String>,
}

/// The cluster after one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// When.
    pub t_ms: u64,
    /// GPU capacity held by running and draining jobs, thousandths.
    pub allocated_gpu_milli: u64,
    /// Jobs waiting.
    pub pending: u64,
    /// Jobs running.
    pub running: u64,
    /// FGD's fragmentation for the head of the queue (the first job the pass could not start), thousandths of a
    /// GPU; 0 when nothing waits.
    pub fragmentation_milli: u64,
}

/// The cluster as a job of the trace arrives: after the pass of the instant it arrives at (the same instants,
/// in the same order, under every policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrivalSample {
    /// GPU capacity asked for by the jobs arrived so far, this one included (GPUs × minimum tasks), thousandths.
    pub arrived_gpu_milli: u64,
    /// GPU capacity nobody holds after the pass, thousandths.
    pub unallocated_gpu_milli: u64,
}

/// One team's GPU time while jobs waited, against what it was entitled to then.
#[derive(Debug, Clone, PartialEq)]
pub struct TeamTally {
    /// The team.
    pub team: String,
    /// GPU time its jobs held while some job waited, thousandths × ms.
    pub contended_gpu_milli_ms: u128,
    /// Its entitlement over the same time, thousandths × ms: at each instant the cluster's GPUs split max-min
    /// fairly among the teams by what they ask for (held plus waiting at their minimum size).
    pub entitled_gpu_milli_ms: f64,
}

/// Max-min fair split of `capacity` among demands: each gets its demand or an equal level, whichever is less.
pub(crate) fn water_fill(demand: &[u64], capacity: u64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..demand.len()).filter(|&i| demand[i] > 0).collect();
    order.sort_by_key(|&i| (demand[i], i));
    let mut out = vec![0.0; demand.len()];
    let mut left = capacity as f64;
    let mut n = order.len();
    for i in order {
        let level = left / n as f64;
        let give = (demand[i] as f64).min(level);
        out[i] = give;
        left -= give;
        n -= 1;
    }
    out
}

/// Everything a simulation produced; [`crate::Report`] sums it up.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// What the trace ran through: `scheduler` ([`crate::simulate`]) or `control` (`simulate_control`).
    pub engine: &'static str,
    /// The policy it ran.
    pub policy: Policy,
    /// The options.
    pub options: SimOptions,
    /// The trace's name.
    pub trace: String,
    /// Rows the trace skipped.
    pub skipped: usize,
    /// Nodes of the cluster.
    pub nodes: usize,
    /// GPU capacity, thousandths.
    pub total_gpu_milli: u64,
    /// One record per job, in trace order.
    pub jobs: Vec<JobRecord>,
    /// The cluster after each pass (one sample per instant).
    pub series: Vec<Sample>,
    /// Scheduling passes run.
    pub passes: u64,
    /// Decisions carried out, by kind.
    pub preemptions: u64,
    /// Shrinks.
    pub shrinks: u64,
    /// Grows.
    pub grows: u64,
    /// GPU time held by preempted jobs through their grace periods (thousandths × ms): no work done.
    pub drain_gpu_milli_ms: u128,
    /// Each team's share while jobs waited, by team name.
    pub teams: Vec<TeamTally>,
    /// One sample per job of the trace, in arrival order.
    pub arrivals: Vec<ArrivalSample>,
}

/// The trace's jobs `repeat` times back to back, copy `c` shifted by `c` spans (last submission − first, plus
/// one second) and its ids suffixed `~c`.
pub(crate) fn repeated(trace: &Trace, repeat: u32) -> Trace {
    let first = trace.jobs.first().map(|j| j.submit_ms).unwrap_or(0);
    let span = trace.jobs.last().map(|j| j.submit_ms - first).unwrap_or(0) + 1000;
    let mut jobs = Vec::with_capacity(trace.jobs.len() * repeat as usize);
    for c in 0..repeat as u64 {
        jobs.extend(trace.jobs.iter().map(|j| TraceJob {
            id: if c == 0 { j.id.clone() } else { format!("{}~{c}", j.id) },
            submit_ms: j.submit_ms + c * span,
            ..j.clone()
        }));
    }
    Trace { jobs, ..trace.clone() }
}
