//! What holds a job back, decided from its per-rank step-time breakdown and its resource samples, with the evidence
//! and an action. Pure: the inputs are rows from the store, so the rules are tested on their own.
//!
//! The rules, over a window of time: every rank's rows of the last [`WINDOW_S`] seconds (by the time the worker
//! wrote on each row, else the time it was stored), and at least its last [`WINDOW_MIN_ROWS`] rows. Means over the
//! window, so that stalls of a few steps, such as a process stopped now and then, count with their whole weight;
//! and a window of time, not of steps, because a few hundred steps of a small model are a fraction of a second.
//! - **straggler**: the rank the others wait for. Where the rows carry the arrival skew the communicator measures
//!   (`comm_waited_for`, see `shoal_comm::arrival`: who held each rank up inside collectives, as the root of the
//!   delay), the rank that the others wait for ≥ [`STRAGGLER_SHARE`] of their step, ≥ [`STRAGGLER_DOMINANCE`]×
//!   as long as for any other rank, and at least twice as long as it waits for them. This names it whatever it
//!   is slow at — its own work, being stopped or descheduled, or its own side of a collective — where its compute
//!   time alone cannot tell (stops that land inside its collectives inflate everyone's communication time alike).
//!   Rows without the arrival skew (older workers): one rank's own work (compute + optimizer) is
//!   ≥ [`STRAGGLER_RATIO`]× the median of the others', and the excess is ≥ [`STRAGGLER_SHARE`] of that rank's
//!   step (a rank 2 ms slower in a step of 60 ms spent waiting for data holds nobody back);
//! - **data_loading**: waiting for the next batch is ≥ [`DATA_SHARE`] of the step on some rank;
//! - **communication**: with no straggler, the ranks arrive together and the transfer itself is slow: the time in
//!   collectives that is not spent waiting for a late peer is ≥ [`COMM_SHARE`] of the step on every rank (without
//!   the arrival skew: collectives take that share even on the rank that spends least there); the evidence gives
//!   the bytes per step and the achieved bus bandwidth, against what `shoal bench` measured for the transport when
//!   a reference is known;
//! - **memory_pressure**: a worker's peak resident memory is ≥ [`MEMORY_SHARE`] of its request;
//! - **underutilized**: nothing above, yet the workers use < [`IDLE_SHARE`] of the CPUs they hold;
//! - **healthy**: none of these.

use crate::db::{MetricRow, SampleRow};

/// Seconds of rows judged, ending at the newest row of any rank.
pub const WINDOW_S: f64 = 10.0;
/// Rows of each rank judged at least, however long ago they were written (a step may take longer than the window).
pub const WINDOW_MIN_ROWS: usize = 20;
pub const STRAGGLER_RATIO: f64 = 1.4;
pub const STRAGGLER_SHARE: f64 = 0.1;
/// How much longer the others wait for the straggler than for the next rank they wait for most.
pub const STRAGGLER_DOMINANCE: f64 = 2.0;
pub const DATA_SHARE: f64 = 0.25;
pub const COMM_SHARE: f64 = 0.35;
pub const MEMORY_SHARE: f64 = 0.9;
pub const IDLE_SHARE: f64 = 0.3;

/// One finding (the API shows it as a [`shoal_wire::Finding`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    /// `data_loading`, `communication`, `straggler`, `underutilized`, `memory_pressure` or `healthy`.
    pub kind: &'static str,
    pub rank: Option<i64>,
    pub evidence: String,
    pub action: String,
}

/// What the rules need besides the rows.
#[derive(Debug, Clone, Default)]
pub struct Context {
    pub world_size: i64,
    /// CPUs each worker holds.
    pub cpus_per_worker: f64,
    pub memory_per_worker: u64,
    /// Bus bandwidth (bytes/s) `shoal bench` measured for all-reduce on this transport, if known.
    pub reference_busbw: Option<f64>,
}

/// Per-rank means of the step-time parts over the window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Breakdown {
    pub rank: i64,
    /// Rows in the window.
    pub steps: usize,
    /// Wall seconds from the window's first row of this rank to its last.
    pub span_s: f64,
    pub data_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub optimizer_s: f64,
    pub step_s: f64,
    /// Bytes sent in collectives per step (from the cumulative counter).
    pub comm_bytes_per_step: f64,
    /// The arrival skew, per step; `None` when the rows do not carry it.
    pub arrival: Option<Arrival>,
}

/// What a rank's communicator measured of its peers' arrivals, per step over the window (from its cumulative
/// counters: `comm_waited_for`, `comm_wait_s`, `comm_lag_s`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Arrival {
    /// Seconds per step this rank waited inside collectives for each rank (the root of the delay).
    pub waited_for: Vec<f64>,
    /// Their sum.
    pub wait_s: f64,
    /// Seconds per step messages sat ready before this rank took them (stopped or descheduled while it waited).
    pub lag_s: f64,
}

impl Breakdown {
    /// The rank's own work: computing and updating. Waiting is left out: for data (a loader slow on every rank
    /// shows on whichever rank asks first, the others wait in the collective meanwhile and find their batch ready)
    /// and for collectives (which wait for the slowest).
    pub fn own_s(&self) -> f64 {
        self.compute_s + self.optimizer_s
    }
}

fn mean(v: Vec<f64>) -> f64 {
    if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 }
}

/// The workspace's one median (`shoal_spec::median`), 0 for no values.
fn median(v: Vec<f64>) -> f64 {
    shoal_spec::median(v).unwrap_or(0.0)
}

/// When a row was written, in milliseconds since the Unix epoch: the worker's own time (`unix_ms`) where it wrote
/// one, else when the row was stored.
pub fn row_ms(r: &MetricRow) -> i64 {
    r.data.get("unix_ms").and_then(|v| v.as_i64()).filter(|t| *t > 0).unwrap_or(r.time_ms)
}

/// Each rank's training rows in the window, by step: those of the last [`WINDOW_S`] seconds before the newest row
/// of any rank, and at least the last [`WINDOW_MIN_ROWS`].
pub fn window(rows: &[MetricRow]) -> Vec<(i64, Vec<&MetricRow>)> {
    let mut ranks: Vec<i64> = rows.iter().map(|r| r.rank).filter(|r| *r >= 0).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let end = rows.iter().filter(|r| r.rank >= 0).map(row_ms).max().unwrap_or(0);
    let from = end - (WINDOW_S * 1e3) as i64;
    ranks
        .into_iter()
        .map(|rank| {
            let mut mine: Vec<&MetricRow> = rows.iter().filter(|r| r.rank == rank).collect();
            mine.sort_by_key(|r| r.step);
            let recent = mine.iter().filter(|r| row_ms(r) >= from).count();
            let skip = mine.len().saturating_sub(recent.max(WINDOW_MIN_ROWS));
            (rank, mine.split_off(skip))
        })
        .collect()
}

/// The arrival skew per step between the first and the last row of `mine` that carry it.
fn arrival(mine: &[&MetricRow]) -> Option<Arrival> {
    let carries =
        |r: &&&MetricRow| r.data.get("comm_waited_for").and_then(|v| v.as_array()).is_some_and(|a| !a.is_empty());
    let (a, b) = (mine.iter().find(carries)?, mine.iter().rev().find(carries)?);
    let steps = (b.step - a.step) as f64;
    if steps < 1.0 {
        return None;
    }
    let num = |r: &MetricRow, k: &str| r.data.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
    let list = |r: &MetricRow| -> Vec<f64> {
        r.data["comm_waited_for"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect())
            .unwrap_or_default()
    };
    let (wa, wb) = (list(a), list(b));
    let waited_for: Vec<f64> =
        (0..wb.len()).map(|i| (wb[i] - wa.get(i).copied().unwrap_or(0.0)).max(0.0) / steps).collect();
    Some(Arrival {
        wait_s: waited_for.iter().sum(),
        waited_for,
        lag_s: (num(b, "comm_lag_s") - num(a, "comm_lag_s")).max(0.0) / steps,
    })
}

/// Means over each rank's rows in the [`window`].
pub fn breakdowns(rows: &[MetricRow]) -> Vec<Breakdown> {
    let mut out = Vec::new();
    for (rank, mine) in window(rows) {
        let mine = mine.as_slice();
        let field =
            |k: &str| -> Vec<f64> { mine.iter().filter_map(|r| r.data.get(k).and_then(|v| v.as_f64())).collect() };
        let bytes: Vec<(i64, f64)> = mine
            .iter()
            .filter_map(|r| r.data.get("comm_bytes").and_then(|v| v.as_f64()).map(|b| (r.step, b)))
            .collect();
        let comm_bytes_per_step = match (bytes.first(), bytes.last()) {
            (Some(a), Some(b)) if b.0 > a.0 => (b.1 - a.1) / (b.0 - a.0) as f64,
            _ => 0.0,
        };
        let span_s = match (mine.first(), mine.last()) {
            (Some(a), Some(b)) => (row_ms(b) - row_ms(a)).max(0) as f64 / 1e3,
            _ => 0.0,
        };
        out.push(Breakdown {
            rank,
            steps: mine.len(),
            span_s,
            data_s: mean(field("data_s")),
            compute_s: mean(field("compute_s")),
            comm_s: mean(field("comm_s")),
            optimizer_s: mean(field("optimizer_s")),
            step_s: mean(field("step_s")),
            comm_bytes_per_step,
            arrival: arrival(mine),
        });
    }
    out
}

fn ms(s: f64) -> String {
    format!("{:.1} ms", s * 1e3)
}

fn secs(s: f64) -> String {
    format!("{s:.1} s")
}

fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

fn rate(bps: f64) -> String {
    if bps >= 1e9 { format!("{:.2} GB/s", bps / 1e9) } else { format!("{:.1} MB/s", bps / 1e6) }
}

/// The findings, most important first; `healthy` alone when nothing holds the job back.
pub fn diagnose(rows: &[MetricRow], samples: &[SampleRow], ctx: &Context) -> Vec<Finding> {
    let b = breakdowns(rows);
    let mut out = Vec::new();
    if b.iter().all(|x| x.steps == 0) {
        return vec![Finding {
            kind: "healthy",
            rank: None,
            evidence: "no step timings yet; nothing to judge".into(),
            action: "wait for the job to run a few steps".into(),
        }];
    }
    let skew = b.len() >= 2 && b.iter().all(|x| x.arrival.is_some());
    let straggler = if skew { straggler_by_arrival(&b) } else { straggler_by_own_work(&b) };
    let named = straggler.as_ref().and_then(|f| f.rank);
    out.extend(straggler);
    // Data loading.
    if let Some(x) =
        b.iter().filter(|x| x.step_s > 0.0).max_by(|a, c| (a.data_s / a.step_s).total_cmp(&(c.data_s / c.step_s)))
        && x.data_s / x.step_s >= DATA_SHARE
    {
        out.push(Finding {
            kind: "data_loading",
            rank: Some(x.rank),
            evidence: format!(
                "waiting for the next batch is {} of the step on rank {} (mean {} of {})",
                pct(x.data_s / x.step_s),
                x.rank,
                ms(x.data_s),
                ms(x.step_s)
            ),
            action: "make loading faster than a step: more loader threads or prefetch, a faster or local copy of the \
                     data, lighter per-sample work; or a larger batch per step"
                .into(),
        });
    }
    if named.is_none() {
        out.extend(communication(&b, ctx, skew));
    }
    // Memory pressure.
    if ctx.memory_per_worker > 0 {
        let mut peak: Vec<(i64, i64)> = Vec::new();
        for s in samples {
            if let Some(r) = s.rss_bytes {
                match peak.iter_mut().find(|p| p.0 == s.rank) {
                    Some(p) => p.1 = p.1.max(r),
                    None => peak.push((s.rank, r)),
                }
            }
        }
        if let Some(&(rank, rss)) = peak.iter().max_by_key(|p| p.1)
            && rss as f64 >= MEMORY_SHARE * ctx.memory_per_worker as f64
        {
            out.push(Finding {
                kind: "memory_pressure",
                rank: Some(rank),
                evidence: format!(
                    "rank {rank} peaked at {} MiB resident, {} of its {} MiB request",
                    rss >> 20,
                    pct(rss as f64 / ctx.memory_per_worker as f64),
                    ctx.memory_per_worker >> 20
                ),
                action: "ask for more memory (resources.memory) before it is killed, or lower the batch or the model \
                         size"
                    .into(),
            });
        }
    }
    // Idle resources, when nothing else explains them.
    if out.is_empty() && ctx.cpus_per_worker > 0.0 {
        let cpu: Vec<f64> = samples.iter().filter_map(|s| s.cpu_percent).collect();
        if cpu.len() >= 3 {
            let used = median(cpu) / 100.0;
            if used < IDLE_SHARE * ctx.cpus_per_worker {
                out.push(Finding {
                    kind: "underutilized",
                    rank: None,
                    evidence: format!(
                        "the workers use a median of {:.2} CPUs each of the {} they hold ({})",
                        used,
                        ctx.cpus_per_worker,
                        pct(used / ctx.cpus_per_worker)
                    ),
                    action: "ask for fewer CPUs per worker (resources.cpus), or give each more work (a larger batch)"
                        .into(),
                });
            }
        }
    }
    if out.is_empty() {
        let x = b.first().cloned().unwrap_or_default();
        let spread = {
            let own: Vec<f64> = b.iter().map(Breakdown::own_s).collect();
            let lo = own.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = own.iter().copied().fold(0.0, f64::max);
            if lo > 0.0 { hi / lo } else { 1.0 }
        };
        let share = |v: f64| if x.step_s > 0.0 { pct(v / x.step_s) } else { "-".into() };
        out.push(Finding {
            kind: "healthy",
            rank: None,
            evidence: format!(
                "step {} on rank 0: data {}, compute {}, communication {}, optimizer {}; the slowest rank's own work is \
                 {spread:.2}x the fastest's",
                ms(x.step_s),
                share(x.data_s),
                share(x.compute_s),
                share(x.comm_s),
                share(x.optimizer_s)
            ),
            action: "nothing to fix; to go faster, add workers or use a larger batch".into(),
        });
    }
    out
}

/// The straggler from the arrival skew: the rank the others wait for inside collectives.
fn straggler_by_arrival(b: &[Breakdown]) -> Option<Finding> {
    let n = b.len();
    let waited_for = |x: &Breakdown, k: i64| -> f64 {
        x.arrival.as_ref().and_then(|a| a.waited_for.get(usize::try_from(k).ok()?).copied()).unwrap_or(0.0)
    };
    // For each rank: how long per step the others wait for it, on average.
    let held: Vec<(i64, f64)> = b
        .iter()
        .map(|x| {
            (x.rank, b.iter().filter(|o| o.rank != x.rank).map(|o| waited_for(o, x.rank)).sum::<f64>() / (n - 1) as f64)
        })
        .collect();
    let &(rank, most) = held.iter().max_by(|a, c| a.1.total_cmp(&c.1))?;
    let next = held.iter().filter(|h| h.0 != rank).map(|h| h.1).fold(0.0, f64::max);
    let x = b.iter().find(|x| x.rank == rank)?;
    let others: Vec<&Breakdown> = b.iter().filter(|o| o.rank != rank).collect();
    let others_step = median(others.iter().map(|o| o.step_s).collect());
    let own_wait = x.arrival.as_ref().map_or(0.0, |a| a.wait_s);
    // Late because it waited longer for its batch: a loader slow on every rank shows on whichever asks first, and
    // the data finding names it.
    let data_late = x.data_s - median(others.iter().map(|o| o.data_s).collect());
    if others_step <= 0.0
        || most < STRAGGLER_SHARE * others_step
        || most < STRAGGLER_DOMINANCE * next
        || own_wait * 2.0 > most
        || data_late * 2.0 >= most
    {
        return None;
    }
    let lag = x.arrival.as_ref().map_or(0.0, |a| a.lag_s);
    let others_own = median(others.iter().map(|o| o.own_s()).collect());
    let span = b.iter().map(|x| x.span_s).fold(0.0, f64::max);
    let most_waiting = others
        .iter()
        .max_by(|a, c| waited_for(a, rank).total_cmp(&waited_for(c, rank)))
        .map(|o| {
            format!(
                "; rank {} waited {} of them for it",
                o.rank,
                secs(waited_for(o, rank) * o.steps.saturating_sub(1) as f64)
            )
        })
        .unwrap_or_default();
    Some(Finding {
        kind: "straggler",
        rank: Some(rank),
        evidence: format!(
            "the other ranks wait {} per step for rank {rank} inside collectives, {} of their step, over the last {} \
             ({} steps{most_waiting}): it arrives last or sends late; rank {rank} itself waits {} per step for the others. \
             On rank {rank}: own work (compute + optimizer) {} against {} on the others, messages left waiting {} per \
             step while it was stopped or descheduled inside its collectives",
            ms(most),
            pct(most / others_step),
            secs(span),
            x.steps,
            ms(own_wait),
            ms(x.own_s()),
            ms(others_own),
            ms(lag),
        ),
        action: straggler_action(rank),
    })
}

/// The straggler from rows without the arrival skew: one rank's own work stands out against the others'.
fn straggler_by_own_work(b: &[Breakdown]) -> Option<Finding> {
    let mut straggler = None;
    if b.len() >= 2 {
        for x in b {
            let others = median(b.iter().filter(|o| o.rank != x.rank).map(Breakdown::own_s).collect());
            let matters = x.own_s() - others >= STRAGGLER_SHARE * x.step_s;
            if others > 0.0 && x.own_s() >= STRAGGLER_RATIO * others && matters {
                let worst = straggler.is_none_or(|(_, r): (i64, f64)| x.own_s() / others > r);
                if worst {
                    straggler = Some((x.rank, x.own_s() / others));
                }
            }
        }
    }
    let (rank, ratio) = straggler?;
    let x = b.iter().find(|x| x.rank == rank).cloned().unwrap_or_default();
    let others = median(b.iter().filter(|o| o.rank != rank).map(Breakdown::own_s).collect());
    let others_comm = median(b.iter().filter(|o| o.rank != rank).map(|o| o.comm_s).collect());
    Some(Finding {
        kind: "straggler",
        rank: Some(rank),
        evidence: format!(
            "rank {rank} takes {} per step on average for its own work (compute + optimizer) against {} \
             on the other ranks: {ratio:.1}x slower; the others wait for it in communication ({} per step)",
            ms(x.own_s()),
            ms(others),
            ms(others_comm)
        ),
        action: straggler_action(rank),
    })
}

fn straggler_action(rank: i64) -> String {
    format!(
        "find what slows rank {rank}: other processes on its CPUs or host, throttling, a slower device; move it to \
         another node or exclude that node (an elastic job with fault_tolerance.replace_stragglers does it itself)"
    )
}

/// Communication, when no straggler explains it: the ranks arrive together and the transfer itself is slow. With
/// the arrival skew, judged on the time in collectives that is not spent waiting for a late peer, on the rank where
/// that is least; without it, on the rank that spends the least time in collectives (the last to arrive waits for
/// no one, so what it spends is the transfer itself).
fn communication(b: &[Breakdown], ctx: &Context, skew: bool) -> Option<Finding> {
    let transfer = |x: &Breakdown| {
        let waited = if skew { x.arrival.as_ref().map_or(0.0, |a| a.wait_s) } else { 0.0 };
        (x.comm_s - waited).max(0.0)
    };
    let x = b
        .iter()
        .filter(|x| x.step_s > 0.0)
        .min_by(|a, c| (transfer(a) / a.step_s).total_cmp(&(transfer(c) / c.step_s)))?;
    if transfer(x) / x.step_s < COMM_SHARE {
        return None;
    }
    let achieved = if x.comm_s > 0.0 { x.comm_bytes_per_step / x.comm_s } else { 0.0 };
    let versus = match ctx.reference_busbw {
        Some(r) if r > 0.0 => {
            format!("; `shoal bench` measured {} on this transport ({} of it)", rate(r), pct(achieved / r))
        }
        _ => String::new(),
    };
    let together = if skew {
        let most = b.iter().map(|x| x.arrival.as_ref().map_or(0.0, |a| a.wait_s)).fold(0.0, f64::max);
        format!(
            "; the ranks arrive together (none waits more than {} per step for a late peer): the transfer itself is slow",
            ms(most)
        )
    } else {
        String::new()
    };
    Some(Finding {
        kind: "communication",
        rank: None,
        evidence: format!(
            "collectives take {} of the step even on rank {}, the one that waits least (mean {} of {}){together}; {:.0} \
             KB sent per step at {} achieved bus bandwidth{versus}",
            pct(x.comm_s / x.step_s),
            x.rank,
            ms(x.comm_s),
            ms(x.step_s),
            x.comm_bytes_per_step / 1e3,
            rate(achieved)
        ),
        action: "overlap more: larger gradient buckets (train.bucket_mb) or gradient accumulation (train.grad_accum) \
                 to all-reduce less often; keep the workers on one host (shared memory); compress gradients; check \
                 the network"
            .into(),
    })
}

/// The all-reduce reference from `shoal bench allreduce --json` output (one JSON array, or one object per line):
/// `(bytes, bus bandwidth in bytes/s)` per size.
pub fn parse_bench(text: &str) -> Vec<(u64, f64)> {
    let rows: Vec<serde_json::Value> = match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Array(a)) => a,
        _ => text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect(),
    };
    rows.iter()
        .filter(|r| r.get("op").and_then(|o| o.as_str()).is_none_or(|o| o == "allreduce"))
        .filter_map(|r| {
            let bytes = r.get("bytes")?.as_u64()?;
            let bw = r.get("busbw_GBps")?.as_f64()?;
            (bw > 0.0).then_some((bytes, bw * 1e9))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rows(per_rank: &[(f64, f64, f64, f64)]) -> Vec<MetricRow> {
        let mut out = Vec::new();
        for step in 1..=50 {
            for (rank, &(data, compute, comm, opt)) in per_rank.iter().enumerate() {
                out.push(MetricRow {
                    rank: rank as i64,
                    step,
                    time_ms: step,
                    data: json!({ "step": step, "data_s": data, "compute_s": compute, "comm_s": comm,
                                  "optimizer_s": opt, "step_s": data + compute + comm + opt,
                                  "comm_bytes": step * 1_000_000 }),
                });
            }
        }
        out
    }

    fn ctx() -> Context {
        Context { world_size: 2, cpus_per_worker: 1.0, memory_per_worker: 1 << 30, reference_busbw: Some(2e9) }
    }

    fn kinds(f: &[Finding]) -> Vec<&'static str> {
        f.iter().map(|f| f.kind).collect()
    }

    #[test]
    fn each_problem_is_named() {
        let healthy = diagnose(&rows(&[(0.0001, 0.010, 0.001, 0.001), (0.0001, 0.0105, 0.0008, 0.001)]), &[], &ctx());
        assert_eq!(kinds(&healthy), ["healthy"], "{healthy:?}");
        let data = diagnose(&rows(&[(0.020, 0.010, 0.001, 0.001), (0.020, 0.010, 0.001, 0.001)]), &[], &ctx());
        assert_eq!(kinds(&data), ["data_loading"], "{data:?}");
        let slow = diagnose(&rows(&[(0.0001, 0.010, 0.030, 0.001), (0.0001, 0.040, 0.001, 0.001)]), &[], &ctx());
        assert_eq!(kinds(&slow), ["straggler"], "{slow:?}");
        assert_eq!(slow[0].rank, Some(1));
        assert!(slow[0].evidence.contains("3.7x slower"), "{}", slow[0].evidence);
        // A rank 1.5x slower at its own work, but by 2.6 ms of a 60 ms step spent waiting for data: only the data.
        let data_bound =
            diagnose(&rows(&[(0.053, 0.005, 0.003, 0.0004), (0.053, 0.0076, 0.0005, 0.0004)]), &[], &ctx());
        assert_eq!(kinds(&data_bound), ["data_loading"], "{data_bound:?}");
        let comm = diagnose(&rows(&[(0.0001, 0.010, 0.020, 0.001), (0.0001, 0.010, 0.020, 0.001)]), &[], &ctx());
        assert_eq!(kinds(&comm), ["communication"], "{comm:?}");
        // 1 MB per step in 20 ms = 50 MB/s, 2.5% of the 2 GB/s reference.
        assert!(
            comm[0].evidence.contains("50.0 MB/s") && comm[0].evidence.contains("(2% of it)"),
            "{}",
            comm[0].evidence
        );
    }

    /// Rows with the arrival skew: per rank `(compute, comm, waited_for per step, lag per step)`, a step every
    /// `step_ms` milliseconds from `start_ms` on, the cumulative counters starting at `base`.
    fn skew_rows(per_rank: &[(f64, f64, Vec<f64>, f64)], steps: i64, start_ms: i64, step_ms: i64) -> Vec<MetricRow> {
        let mut out = Vec::new();
        for step in 1..=steps {
            for (rank, (compute, comm, waited_for, lag)) in per_rank.iter().enumerate() {
                let cum: Vec<f64> = waited_for.iter().map(|w| w * step as f64).collect();
                out.push(MetricRow {
                    rank: rank as i64,
                    step,
                    time_ms: 0,
                    data: json!({ "step": step, "data_s": 0.0001, "compute_s": compute, "comm_s": comm,
                                  "optimizer_s": 0.001, "step_s": 0.0011 + compute + comm,
                                  "comm_bytes": step * 1_000_000, "unix_ms": start_ms + step * step_ms,
                                  "comm_waited_for": cum, "comm_wait_s": cum.iter().sum::<f64>(),
                                  "comm_lag_s": lag * step as f64 }),
                });
            }
        }
        out
    }

    #[test]
    fn stops_inside_collectives_name_the_rank_the_others_wait_for() {
        // Rank 1 is stopped inside its own collectives: compute is the same everywhere and both ranks spend 30 ms
        // of a step in collectives, but rank 0 waits 25 ms of them for rank 1, while rank 1 leaves rank 0's
        // messages waiting (lag) and waits for no one.
        let per_rank = vec![(0.010, 0.030, vec![0.0, 0.025], 0.0001), (0.010, 0.030, vec![0.0002, 0.0], 0.025)];
        let f = diagnose(&skew_rows(&per_rank, 300, 0, 40), &[], &ctx());
        assert_eq!(kinds(&f), ["straggler"], "{f:?}");
        assert_eq!(f[0].rank, Some(1));
        assert!(f[0].evidence.contains("wait 25.0 ms per step for rank 1"), "{}", f[0].evidence);
        // The same steps without the arrival skew: compute time alone cannot tell, and the time in collectives
        // reads as a slow network.
        let mut bare = skew_rows(&per_rank, 300, 0, 40);
        for r in &mut bare {
            for k in ["comm_waited_for", "comm_wait_s", "comm_lag_s"] {
                r.data.as_object_mut().map(|o| o.remove(k));
            }
        }
        assert_eq!(kinds(&diagnose(&bare, &[], &ctx())), ["communication"]);
    }

    #[test]
    fn in_a_ring_every_rank_charges_the_late_one() {
        // Four ranks; rank 2 is late and everyone else waits for it (the root of each delay).
        let w = |k: usize| {
            let mut v = vec![0.0001; 4];
            v[k] = 0.0;
            v[2] = if k == 2 { 0.0 } else { 0.012 };
            v
        };
        let per_rank: Vec<_> = (0..4).map(|k| (0.010, 0.015, w(k), if k == 2 { 0.004 } else { 0.0 })).collect();
        let f = diagnose(&skew_rows(&per_rank, 200, 0, 30), &[], &Context { world_size: 4, ..ctx() });
        assert_eq!(kinds(&f), ["straggler"], "{f:?}");
        assert_eq!(f[0].rank, Some(2));
    }

    #[test]
    fn ranks_that_arrive_together_over_a_slow_transfer_are_communication() {
        let per_rank = vec![(0.010, 0.020, vec![0.0, 0.0003], 0.002), (0.010, 0.020, vec![0.0004, 0.0], 0.002)];
        let f = diagnose(&skew_rows(&per_rank, 300, 0, 32), &[], &ctx());
        assert_eq!(kinds(&f), ["communication"], "{f:?}");
        assert!(
            f[0].evidence.contains("arrive together") && f[0].evidence.contains("bus bandwidth"),
            "{}",
            f[0].evidence
        );
        // Healthy: short collectives, nobody waits.
        let per_rank = vec![(0.010, 0.001, vec![0.0, 0.0002], 0.0), (0.010, 0.001, vec![0.0002, 0.0], 0.0)];
        assert_eq!(kinds(&diagnose(&skew_rows(&per_rank, 300, 0, 12), &[], &ctx())), ["healthy"]);
    }

    #[test]
    fn a_rank_late_for_want_of_data_is_the_data() {
        // Both ranks wait for a slow loader; rank 1 asks later each time, so rank 0 waits 10 ms for it in every
        // collective: the data, not a straggler.
        let mut rows =
            skew_rows(&[(0.010, 0.012, vec![0.0, 0.010], 0.0), (0.010, 0.002, vec![0.0, 0.0], 0.0)], 300, 0, 80);
        for r in &mut rows {
            let d = r.data.as_object_mut().expect("object");
            let data = if r.rank == 0 { 0.050 } else { 0.060 };
            d.insert("data_s".into(), json!(data));
            d.insert("step_s".into(), json!(data + 0.011 + d["comm_s"].as_f64().unwrap_or(0.0)));
        }
        let f = diagnose(&rows, &[], &ctx());
        assert_eq!(kinds(&f), ["data_loading"], "{f:?}");
    }

    #[test]
    fn the_window_is_one_of_time() {
        let slow = vec![(0.010, 0.030, vec![0.0, 0.025], 0.0), (0.010, 0.030, vec![0.0, 0.0], 0.025)];
        let fine = vec![(0.010, 0.001, vec![0.0, 0.0002], 0.0), (0.010, 0.001, vec![0.0002, 0.0], 0.0)];
        // 50 s of a straggler, then 10 s of health (100 ms steps): the window sees only the health.
        let mut rows = skew_rows(&slow, 500, 0, 100);
        let shift = |rows: Vec<MetricRow>, steps: i64, acc: &[f64]| -> Vec<MetricRow> {
            rows.into_iter()
                .map(|mut r| {
                    let rank = r.rank as usize;
                    r.step += steps;
                    let d = r.data.as_object_mut().expect("object");
                    d.insert("step".into(), json!(r.step));
                    let cum: Vec<f64> = d["comm_waited_for"]
                        .as_array()
                        .expect("array")
                        .iter()
                        .enumerate()
                        .map(|(i, v)| v.as_f64().unwrap_or(0.0) + if i != rank { acc[rank] } else { 0.0 })
                        .collect();
                    d.insert("comm_waited_for".into(), json!(cum));
                    r
                })
                .collect()
        };
        rows.extend(shift(skew_rows(&fine, 100, 50_000, 100), 500, &[12.5, 0.0]));
        let f = diagnose(&rows, &[], &ctx());
        assert_eq!(kinds(&f), ["healthy"], "{f:?}");
        // 50 s of health, then 10 s of a straggler: named, though most steps of the run were healthy.
        let mut rows = skew_rows(&fine, 500, 0, 100);
        rows.extend(shift(skew_rows(&slow, 100, 50_000, 100), 500, &[0.1, 0.1]));
        let f = diagnose(&rows, &[], &ctx());
        assert_eq!(kinds(&f), ["straggler"], "{f:?}");
        assert_eq!(f[0].rank, Some(1));
    }

    #[test]
    fn memory_and_idle_cpus_are_named() {
        let fine = rows(&[(0.0001, 0.010, 0.001, 0.001), (0.0001, 0.010, 0.001, 0.001)]);
        let sample = |rank, cpu, rss| SampleRow {
            rank,
            time_ms: 0,
            cpu_percent: Some(cpu),
            rss_bytes: Some(rss),
            cpu_seconds: None,
            net_rx_bytes_per_s: None,
            net_tx_bytes_per_s: None,
            gpu_util_percent: None,
            gpu_memory_bytes: None,
            gpu_temperature_c: None,
            gpu_power_w: None,
        };
        let hot: Vec<SampleRow> = (0..4).map(|i| sample(i % 2, 95.0, 1000 << 20)).collect();
        let f = diagnose(&fine, &hot, &ctx());
        assert_eq!(kinds(&f), ["memory_pressure"], "{f:?}");
        let idle: Vec<SampleRow> = (0..4).map(|i| sample(i % 2, 10.0, 100 << 20)).collect();
        let f = diagnose(&fine, &idle, &ctx());
        assert_eq!(kinds(&f), ["underutilized"], "{f:?}");
    }
}
