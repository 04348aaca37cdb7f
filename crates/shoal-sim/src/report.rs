//! The report of one simulation: job completion and queueing times, makespan, GPU allocation, fragmentation,
//! preemptions and fairness between teams, as one JSON object; and the time series as CSV.
//!
//! How each figure is computed (times in seconds; "time-weighted" means over the simulated time between one
//! instant's pass and the next, from the first submission to the last end):
//! - JCT = end − submit of each completed job; `median` is the middle value (the mean of the two middle ones
//!   for an even count), `p99` the nearest-rank 99th percentile. Queueing delay = first start − submit.
//! - `makespan_s`: last end − first submission.
//! - `gpu_allocation_mean`: time-weighted mean of the fraction of the cluster's GPU capacity held by running
//!   and draining jobs; `gpu_allocation_arrivals_mean` the same from the first submission to the last (a trace
//!   whose longest jobs outlast its arrivals by far, as the Alibaba one's, leaves the first near zero). `utilisation`: the GPU time the completed jobs asked for (GPUs × duration) over
//!   capacity × makespan.
//! - `unallocated_gpus_mean`: time-weighted mean of the GPUs nobody holds, over the time some job waits (idle
//!   GPUs while nothing waits are no loss). That time is each policy's own (a policy that packs better may make
//!   jobs wait less, and then is averaged over other moments), so it does not compare policies: the next two do.
//! - `unallocated_gpus_arrivals_mean`: the mean, over the trace's arrivals, of the GPUs nobody holds after the
//!   pass at the instant each job arrives — the same instants under every policy (arrival times do not depend on
//!   the policy). `unallocated_gpus_oversubscribed_mean`: the same over the arrivals from the first at which the
//!   jobs arrived so far ask for at least the cluster's GPUs (GPUs × minimum tasks, summed; also independent of
//!   the policy); 0 when that never happens. As FGD (Weng et al., ATC'23) measures packing: the GPUs left
//!   unallocated as the arrived workload grows, here once it exceeds the cluster — GPUs that stay idle then are
//!   GPUs the packing could not use. `unallocated_gpus_oversubscribed_arrivals` counts those arrivals.
//! - `fragmentation_gpus_mean`: over the time some job waits, FGD's
//!   fragmentation for the head of the queue (the first job the pass could not start): on each node, all its
//!   free GPU capacity where that job's task cannot fit at all (CPU, memory or GPUs short), else the free
//!   capacity of the GPUs with too little room for the task's share of one GPU (for whole-GPU tasks, the partly
//!   used GPUs); summed over the nodes. Both in GPUs.
//! - Fairness: over the time some job waits, each team's GPU time against its entitlement — at each instant the
//!   cluster's GPUs split max-min fairly among teams by their demand (held plus waiting at minimum size);
//!   `fairness_jain` is Jain's index of the teams' ratios (1: every team got its entitlement in proportion).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::outcome::{Outcome, Sample};

/// One team's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TeamReport {
    /// Its jobs that completed.
    pub jobs: usize,
    /// Their mean JCT.
    pub avg_jct_s: f64,
    /// GPU time its jobs held.
    pub gpu_s: f64,
    /// Its GPU time while some job waited, over its entitlement then (1: exactly its entitlement).
    pub share_over_entitlement: f64,
    /// Its share of the GPU time held while some job waited.
    pub contended_share: f64,
    /// Its entitlement's share of the same.
    pub entitled_share: f64,
}

/// The figures of one simulation. See the module's docs for how each is computed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The policy, `ORDERING+PACKING`.
    pub policy: String,
    /// What the trace ran through: `scheduler` (shoal-sched alone) or `control` (the server's control loop).
    pub engine: &'static str,
    /// The trace's file name.
    pub trace: String,
    /// The arrival speed-up.
    pub load: f64,
    /// How many times the trace was replayed.
    pub repeat: u32,
    /// The seed given (it draws a synthetic trace; a trace read from a file draws nothing).
    pub seed: u64,
    /// Nodes of the cluster.
    pub nodes: usize,
    /// GPUs of the cluster.
    pub gpus: f64,
    /// Jobs in the trace (skipped rows aside).
    pub jobs: usize,
    /// Jobs that completed.
    pub completed: usize,
    /// Jobs the scheduler refused (they could never fit this cluster).
    pub rejected: usize,
    /// Rows of the trace skipped (Alibaba pods that never ran).
    pub skipped: usize,
    /// Mean job completion time.
    pub avg_jct_s: f64,
    /// Median JCT.
    pub median_jct_s: f64,
    /// 99th percentile JCT.
    pub p99_jct_s: f64,
    /// Mean queueing delay (first start − submit).
    pub avg_queue_s: f64,
    /// Median queueing delay.
    pub median_queue_s: f64,
    /// 99th percentile queueing delay.
    pub p99_queue_s: f64,
    /// Last end − first submission.
    pub makespan_s: f64,
    /// Time-weighted mean fraction of GPU capacity allocated.
    pub gpu_allocation_mean: f64,
    /// GPU time of the completed work over capacity × makespan.
    pub utilisation: f64,
    /// Time-weighted mean fraction of GPU capacity allocated while jobs arrive (first to last submission): the
    /// steady state, apart from the tail of long jobs after the last arrival.
    pub gpu_allocation_arrivals_mean: f64,
    /// Time-weighted mean unallocated GPUs while some job waits.
    pub unallocated_gpus_mean: f64,
    /// Mean unallocated GPUs at the trace's arrivals (the same instants under every policy).
    pub unallocated_gpus_arrivals_mean: f64,
    /// Mean unallocated GPUs at the arrivals once the arrived jobs ask for at least the cluster's GPUs.
    pub unallocated_gpus_oversubscribed_mean: f64,
    /// How many arrivals that mean is over.
    pub unallocated_gpus_oversubscribed_arrivals: usize,
    /// Time-weighted mean FGD fragmentation (GPUs) for the head of the queue while some job waits.
    pub fragmentation_gpus_mean: f64,
    /// Fraction of the makespan during which some job waits.
    pub waiting_time_fraction: f64,
    /// Time-weighted mean number of waiting jobs.
    pub pending_mean: f64,
    /// Preemptions.
    pub preemptions: u64,
    /// Jobs preempted at least once.
    pub preempted_jobs: usize,
    /// GPU time held by preempted jobs through their grace periods.
    pub drain_gpu_s: f64,
    /// Elastic shrinks.
    pub shrinks: u64,
    /// Elastic grows.
    pub grows: u64,
    /// Scheduling passes.
    pub passes: u64,
    /// Jain's index of the teams' share over entitlement.
    pub fairness_jain: f64,
    /// Per team.
    pub teams: BTreeMap<String, TeamReport>,
}

/// The median (mean of the two middle values for an even count) of sorted values.
fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The nearest-rank `p`-th percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 }
}

const SEC: f64 = 1000.0;

impl Report {
    /// Sums up a simulation.
    pub fn of(o: &Outcome) -> Report {
        let done: Vec<_> = o.jobs.iter().filter(|j| j.end_ms.is_some()).collect();
        let mut jct: Vec<f64> =
            done.iter().map(|j| (j.end_ms.unwrap_or(0).saturating_sub(j.submit_ms)) as f64 / SEC).collect();
        let mut queue: Vec<f64> = done
            .iter()
            .map(|j| (j.first_start_ms.unwrap_or(j.submit_ms).saturating_sub(j.submit_ms)) as f64 / SEC)
            .collect();
        jct.sort_by(f64::total_cmp);
        queue.sort_by(f64::total_cmp);
        let start = o.jobs.iter().map(|j| j.submit_ms).min().unwrap_or(0);
        let end = o.jobs.iter().filter_map(|j| j.end_ms).max().unwrap_or(start).max(start);
        let span = (end - start) as f64;
        let total = o.total_gpu_milli as f64;

        // Time-weighted integrals: each sample holds until the next.
        let (mut alloc, mut unalloc, mut frag, mut waiting, mut pend) = (0.0, 0.0, 0.0, 0.0, 0.0);
        let last_submit = o.jobs.iter().map(|j| j.submit_ms).max().unwrap_or(start);
        let mut arriving = 0.0;
        for (s, t_next) in o.series.iter().zip(o.series.iter().skip(1).map(|s| s.t_ms)) {
            let Sample { t_ms, allocated_gpu_milli, pending, fragmentation_milli, .. } = *s;
            let dt = t_next.saturating_sub(t_ms) as f64;
            alloc += allocated_gpu_milli as f64 * dt;
            let within = t_next.min(last_submit).saturating_sub(t_ms.max(start)) as f64;
            arriving += allocated_gpu_milli as f64 * within;
            pend += pending as f64 * dt;
            if pending > 0 {
                waiting += dt;
                unalloc += (o.total_gpu_milli - allocated_gpu_milli) as f64 * dt;
                frag += fragmentation_milli as f64 * dt;
            }
        }
        let per = |x: f64, d: f64| if d > 0.0 { x / d } else { 0.0 };
        let at_arrivals: f64 = o.arrivals.iter().map(|a| a.unallocated_gpu_milli as f64).sum();
        let over: Vec<f64> = o
            .arrivals
            .iter()
            .skip_while(|a| a.arrived_gpu_milli < o.total_gpu_milli)
            .map(|a| a.unallocated_gpu_milli as f64)
            .collect();
        let demand: f64 = done.iter().map(|j| j.demand_milli_ms as f64).sum();

        let contended: f64 = o.teams.iter().map(|t| t.contended_gpu_milli_ms as f64).sum();
        let entitled: f64 = o.teams.iter().map(|t| t.entitled_gpu_milli_ms).sum();
        let mut ratios = Vec::new();
        let mut teams = BTreeMap::new();
        for t in &o.teams {
            let mine: Vec<f64> = done
                .iter()
                .filter(|j| j.team == t.team)
                .map(|j| (j.end_ms.unwrap_or(0).saturating_sub(j.submit_ms)) as f64 / SEC)
                .collect();
            let gpu: f64 = o.jobs.iter().filter(|j| j.team == t.team).map(|j| j.gpu_milli_ms as f64).sum();
            let ratio = per(t.contended_gpu_milli_ms as f64, t.entitled_gpu_milli_ms);
            if t.entitled_gpu_milli_ms > 0.0 {
                ratios.push(ratio);
            }
            teams.insert(
                t.team.clone(),
                TeamReport {
                    jobs: mine.len(),
                    avg_jct_s: mean(&mine),
                    gpu_s: gpu / 1000.0 / SEC,
                    share_over_entitlement: ratio,
                    contended_share: per(t.contended_gpu_milli_ms as f64, contended),
                    entitled_share: per(t.entitled_gpu_milli_ms, entitled),
                },
            );
        }
        let sum: f64 = ratios.iter().sum();
        let sq: f64 = ratios.iter().map(|r| r * r).sum();
        let jain = if ratios.is_empty() { 1.0 } else { per(sum * sum, ratios.len() as f64 * sq) };

        Report {
            policy: o.policy.to_string(),
            engine: o.engine,
            trace: o.trace.clone(),
            load: o.options.load,
            repeat: o.options.repeat,
            seed: o.options.seed,
            nodes: o.nodes,
            gpus: total / 1000.0,
            jobs: o.jobs.len(),
            completed: done.len(),
            rejected: o.jobs.iter().filter(|j| j.rejected.is_some()).count(),
            skipped: o.skipped,
            avg_jct_s: mean(&jct),
            median_jct_s: median(&jct),
            p99_jct_s: percentile(&jct, 99.0),
            avg_queue_s: mean(&queue),
            median_queue_s: median(&queue),
            p99_queue_s: percentile(&queue, 99.0),
            makespan_s: span / SEC,
            gpu_allocation_mean: per(alloc, total * span),
            utilisation: per(demand, total * span),
            gpu_allocation_arrivals_mean: per(arriving, total * (last_submit - start) as f64),
            unallocated_gpus_mean: per(unalloc, waiting) / 1000.0,
            unallocated_gpus_arrivals_mean: per(at_arrivals, o.arrivals.len() as f64) / 1000.0,
            unallocated_gpus_oversubscribed_mean: per(over.iter().sum(), over.len() as f64) / 1000.0,
            unallocated_gpus_oversubscribed_arrivals: over.len(),
            fragmentation_gpus_mean: per(frag, waiting) / 1000.0,
            waiting_time_fraction: per(waiting, span),
            pending_mean: per(pend, span),
            preemptions: o.preemptions,
            preempted_jobs: o.jobs.iter().filter(|j| j.preemptions > 0).count(),
            drain_gpu_s: o.drain_gpu_milli_ms as f64 / 1000.0 / SEC,
            shrinks: o.shrinks,
            grows: o.grows,
            passes: o.passes,
            fairness_jain: jain,
            teams,
        }
    }

    /// The report as pretty JSON (deterministic: the same outcome gives the same bytes).
    pub fn to_json(&self) -> serde_json::Result<String> {
        serde_json::to_string_pretty(self)
    }
}

/// The time series as CSV: `t_s,allocated_gpus,unallocated_gpus,pending,running,fragmentation_gpus`.
pub fn series_csv(o: &Outcome) -> String {
    let mut s = String::from("t_s,allocated_gpus,unallocated_gpus,pending,running,fragmentation_gpus\n");
    for x in &o.series {
        let _ = writeln!(
            s,
            "{},{},{},{},{},{}",
            x.t_ms as f64 / SEC,
            x.allocated_gpu_milli as f64 / 1000.0,
            (o.total_gpu_milli - x.allocated_gpu_milli) as f64 / 1000.0,
            x.pending,
            x.running,
            x.fragmentation_milli as f64 / 1000.0
        );
    }
    s
}

/// Every job as CSV: `job_id,team,submit_s,first_start_s,end_s,jct_s,queue_s,starts,preemptions,rejected`.
pub fn jobs_csv(o: &Outcome) -> String {
    let mut s = String::from("job_id,team,submit_s,first_start_s,end_s,jct_s,queue_s,starts,preemptions,rejected\n");
    let secs = |v: Option<u64>| v.map(|v| (v as f64 / SEC).to_string()).unwrap_or_default();
    for j in &o.jobs {
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{},{}",
            j.id,
            j.team,
            j.submit_ms as f64 / SEC,
            secs(j.first_start_ms),
            secs(j.end_ms),
            secs(j.end_ms.map(|e| e.saturating_sub(j.submit_ms))),
            secs(j.first_start_ms.map(|f| f.saturating_sub(j.submit_ms))),
            j.starts,
            j.preemptions,
            if j.rejected.is_some() { "yes" } else { "" }
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_percentiles() {
        assert_eq!(median(&[1.0, 2.0, 3.0, 10.0]), 2.5);
        assert_eq!(median(&[1.0, 2.0, 3.0]), 2.0);
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(percentile(&v, 99.0), 198.0);
        assert_eq!(percentile(&[5.0], 99.0), 5.0);
    }
}
