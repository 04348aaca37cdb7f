//! What holds a job back, decided from its per-rank step-time breakdown and its resource samples, with the evidence
//! and an action. Pure: the inputs are rows from the store, so the rules are tested on their own.
//!
//! The rules, over the last [`WINDOW`] steps of every rank (means, so that stalls of a few steps, such as a process
//! stopped now and then, count with their whole weight):
//! - **straggler**: one rank's own work (compute + optimizer) is ≥ [`STRAGGLER_RATIO`]× the median of the
//!   others' (the others then wait for it in communication), and the excess is ≥ [`STRAGGLER_SHARE`] of that
//!   rank's step (a rank 2 ms slower in a step of 60 ms spent waiting for data holds nobody back);
//! - **data_loading**: waiting for the next batch is ≥ [`DATA_SHARE`] of the step on some rank;
//! - **communication**: collectives take ≥ [`COMM_SHARE`] of the step even on the rank that waits least there
//!   (with no straggler to explain it); the
//!   evidence gives the bytes per step and the achieved bus bandwidth, against what `shoal bench` measured for
//!   the transport when a reference is known;
//! - **memory_pressure**: a worker's peak resident memory is ≥ [`MEMORY_SHARE`] of its request;
//! - **underutilized**: nothing above, yet the workers use < [`IDLE_SHARE`] of the CPUs they hold;
//! - **healthy**: none of these.

use crate::db::{MetricRow, SampleRow};

pub const WINDOW: usize = 200;
pub const STRAGGLER_RATIO: f64 = 1.4;
pub const STRAGGLER_SHARE: f64 = 0.1;
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

/// Per-rank means of the step-time parts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Breakdown {
    pub rank: i64,
    pub steps: usize,
    pub data_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub optimizer_s: f64,
    pub step_s: f64,
    /// Bytes sent in collectives per step (from the cumulative counter).
    pub comm_bytes_per_step: f64,
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

/// Means over the last [`WINDOW`] training rows of each rank.
pub fn breakdowns(rows: &[MetricRow]) -> Vec<Breakdown> {
    let mut ranks: Vec<i64> = rows.iter().map(|r| r.rank).filter(|r| *r >= 0).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let mut out = Vec::new();
    for rank in ranks {
        let mut mine: Vec<&MetricRow> = rows.iter().filter(|r| r.rank == rank).collect();
        mine.sort_by_key(|r| r.step);
        let skip = mine.len().saturating_sub(WINDOW);
        let mine = &mine[skip..];
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
        out.push(Breakdown {
            rank,
            steps: mine.len(),
            data_s: mean(field("data_s")),
            compute_s: mean(field("compute_s")),
            comm_s: mean(field("comm_s")),
            optimizer_s: mean(field("optimizer_s")),
            step_s: mean(field("step_s")),
            comm_bytes_per_step,
        });
    }
    out
}

fn ms(s: f64) -> String {
    format!("{:.1} ms", s * 1e3)
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
    // Straggler: one rank's own work stands out against the others'.
    let mut straggler = None;
    if b.len() >= 2 {
        for x in &b {
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
    if let Some((rank, ratio)) = straggler {
        let x = b.iter().find(|x| x.rank == rank).copied().unwrap_or_default();
        let others = median(b.iter().filter(|o| o.rank != rank).map(Breakdown::own_s).collect());
        let others_comm = median(b.iter().filter(|o| o.rank != rank).map(|o| o.comm_s).collect());
        out.push(Finding {
            kind: "straggler",
            rank: Some(rank),
            evidence: format!(
                "rank {rank} takes {} per step on average for its own work (compute + optimizer) against {} \
                 on the other ranks: {ratio:.1}x slower; the others wait for it in communication ({} per step)",
                ms(x.own_s()),
                ms(others),
                ms(others_comm)
            ),
            action: format!(
                "find what slows rank {rank}: other processes on its CPUs or host, throttling, a slower device; move it \
                 to another node or exclude that node"
            ),
        });
    }
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
    // Communication, when no straggler explains it. Judged on the rank that spends the least time in collectives:
    // the others may also be waiting there for a slower peer, but the last to arrive waits for no one, so what it
    // spends is the transfer itself.
    if straggler.is_none()
        && let Some(x) =
            b.iter().filter(|x| x.step_s > 0.0).min_by(|a, c| (a.comm_s / a.step_s).total_cmp(&(c.comm_s / c.step_s)))
        && x.comm_s / x.step_s >= COMM_SHARE
    {
        let achieved = if x.comm_s > 0.0 { x.comm_bytes_per_step / x.comm_s } else { 0.0 };
        let versus = match ctx.reference_busbw {
            Some(r) if r > 0.0 => {
                format!("; `shoal bench` measured {} on this transport ({} of it)", rate(r), pct(achieved / r))
            }
            _ => String::new(),
        };
        out.push(Finding {
            kind: "communication",
            rank: None,
            evidence: format!(
                "collectives take {} of the step even on rank {}, the one that waits least (mean {} of {}); {:.0} KB \
                 sent per step at {} achieved bus bandwidth{versus}",
                pct(x.comm_s / x.step_s),
                x.rank,
                ms(x.comm_s),
                ms(x.step_s),
                x.comm_bytes_per_step / 1e3,
                rate(achieved)
            ),
            action:
                "overlap more: larger gradient buckets (train.bucket_mb) or gradient accumulation (train.grad_accum) \
                     to all-reduce less often; keep the workers on one host (shared memory); compress gradients; check \
                     the network"
                    .into(),
        });
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
        let x = b.first().copied().unwrap_or_default();
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
