//! What jobs cost: resource-hours allocated (what a worker held, from its start to its end) and used (CPU time
//! its processes took; memory from the resident-size samples), queue time, and money at the server's prices.
//! Money is charged on allocation, as clouds do; a job with `[[phases]]` is charged each phase at its own resources
//! (a task at those of the phase it started in) and reported phase by phase. Pure: rows in, report out.
//!
//! Prices come from the server's configuration (`--prices FILE`, TOML):
//! ```toml
//! currency = "USD"
//! cpu_hour = 0.04     # per CPU-hour
//! gib_hour = 0.005    # per GiB-hour of memory
//! gpu_hour = 2.50     # per GPU-hour
//! kwh = 0.15          # per kWh, for the energy estimate where GPUs report power
//! ```

pub use shoal_wire::{CostReport, Hours, JobCost, PhaseCost, Prices, TeamCost};

use crate::db::{JobRow, SampleRow, TaskRow};

/// Parses a price table (TOML); errors name the key.
pub fn parse_prices(text: &str) -> Result<Prices, String> {
    let p: Prices = toml::from_str(text).map_err(|e| e.to_string())?;
    for (k, v) in [("cpu_hour", p.cpu_hour), ("gib_hour", p.gib_hour), ("gpu_hour", p.gpu_hour), ("kwh", p.kwh)] {
        if !v.is_finite() || v < 0.0 {
            return Err(format!("{k}: must be a finite number >= 0, not {v}"));
        }
    }
    Ok(p)
}

/// What each worker of a job (or of one of its `[[phases]]`) holds, and from when.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    /// `(cpus, memory bytes, gpus)` held by each worker.
    pub per_worker: (f64, u64, f64),
    /// Tasks started from this time on (ms since the epoch) are charged at this rate (the first: `i64::MIN`).
    pub from_ms: i64,
    /// The phase's last step (none: the run's end).
    pub until_step: Option<usize>,
}

impl Rate {
    /// A job without phases.
    pub fn whole(per_worker: (f64, u64, f64)) -> [Rate; 1] {
        [Rate { per_worker, from_ms: i64::MIN, until_step: None }]
    }
}

/// One job's cost: each task charged at the rate of the phase it started in (`rates`, in phase order; one for a job
/// without phases).
pub fn job_cost(
    job: &JobRow,
    rates: &[Rate],
    tasks: &[TaskRow],
    samples: &[SampleRow],
    prices: &Prices,
    now_ms: i64,
) -> JobCost {
    let mut allocated = Hours::default();
    let mut used = Hours::default();
    let mut phases: Vec<PhaseCost> = rates
        .iter()
        .enumerate()
        .map(|(phase, r)| PhaseCost {
            phase,
            until_step: r.until_step,
            workers: 0,
            allocated: Hours::default(),
            cost: 0.0,
        })
        .collect();
    let mut spans: Vec<Vec<(i64, i64)>> = vec![Vec::new(); rates.len()];
    for t in tasks {
        let Some(start) = t.started_ms else { continue };
        let Some(phase) = rates.iter().rposition(|r| r.from_ms <= start) else { continue };
        let (cpus, mem, gpus) = rates[phase].per_worker;
        let gib = mem as f64 / (1u64 << 30) as f64;
        let end = t.ended_ms.unwrap_or(now_ms).max(start);
        let h = (end - start) as f64 / 3_600_000.0;
        let held = Hours { cpu_hours: cpus * h, gib_hours: gib * h, gpu_hours: gpus * h };
        allocated.add(&held);
        phases[phase].allocated.add(&held);
        spans[phase].push((start, end));
        used.cpu_hours += t.cpu_seconds.unwrap_or(0.0) / 3600.0;
    }
    for (p, s) in phases.iter_mut().zip(&spans) {
        p.workers = s.iter().map(|(a, _)| s.iter().filter(|(b, e)| b <= a && a < e).count()).max().unwrap_or(0);
        p.cost = charge(&p.allocated, prices);
    }
    // A job without phases is one; a phase not reached yet is left out.
    let phases =
        if rates.len() > 1 { phases.into_iter().filter(|p| !spans[p.phase].is_empty()).collect() } else { Vec::new() };
    // Memory used: resident size held between consecutive samples of each rank.
    let mut ranks: Vec<i64> = samples.iter().map(|s| s.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for r in ranks {
        let mut mine: Vec<&SampleRow> = samples.iter().filter(|s| s.rank == r).collect();
        mine.sort_by_key(|s| s.time_ms);
        for w in mine.windows(2) {
            let h = (w[1].time_ms - w[0].time_ms).max(0) as f64 / 3_600_000.0;
            used.gib_hours += w[0].rss_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64 * h;
        }
    }
    used.gpu_hours = 0.0;
    let energy_kwh = {
        let mut kwh = 0.0;
        let mut any = false;
        let mut mine: Vec<&SampleRow> = samples.iter().collect();
        mine.sort_by_key(|s| (s.rank, s.time_ms));
        for w in mine.windows(2).filter(|w| w[0].rank == w[1].rank) {
            if let Some(p) = w[0].gpu_power_w {
                any = true;
                kwh += p * (w[1].time_ms - w[0].time_ms).max(0) as f64 / 3_600_000.0 / 1000.0;
            }
        }
        any.then_some(kwh)
    };
    let first_start = tasks.iter().filter_map(|t| t.started_ms).min();
    let queue_s = (first_start.unwrap_or(now_ms) - job.created_ms).max(0) as f64 / 1000.0;
    let cost = charge(&allocated, prices) + energy_kwh.unwrap_or(0.0) * prices.kwh;
    JobCost {
        id: job.id.clone(),
        name: job.name.clone(),
        team: job.team.clone(),
        state: job.state.as_str().into(),
        queue_s,
        allocated,
        used,
        cost,
        energy_kwh,
        phases,
    }
}

/// What holding `h` costs.
fn charge(h: &Hours, prices: &Prices) -> f64 {
    h.cpu_hours * prices.cpu_hour + h.gib_hours * prices.gib_hour + h.gpu_hours * prices.gpu_hour
}

/// Sums jobs into teams and a total.
pub fn report(jobs: Vec<JobCost>, prices: &Prices) -> CostReport {
    let mut teams: Vec<TeamCost> = Vec::new();
    for j in &jobs {
        let t = match teams.iter_mut().position(|t| t.team == j.team) {
            Some(i) => &mut teams[i],
            None => {
                teams.push(TeamCost {
                    team: j.team.clone(),
                    jobs: 0,
                    queue_s: 0.0,
                    allocated: Hours::default(),
                    used: Hours::default(),
                    cost: 0.0,
                });
                let last = teams.len() - 1;
                &mut teams[last]
            }
        };
        t.jobs += 1;
        t.queue_s += j.queue_s;
        t.allocated.add(&j.allocated);
        t.used.add(&j.used);
        t.cost += j.cost;
    }
    teams.sort_by(|a, b| a.team.cmp(&b.team));
    let total_cost = jobs.iter().map(|j| j.cost).sum();
    CostReport { prices: prices.clone(), currency: prices.currency.clone(), jobs, teams, total_cost }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::JobState;

    fn job(id: &str, team: &str, created_ms: i64) -> JobRow {
        JobRow {
            id: id.into(),
            name: id.into(),
            user: "u".into(),
            team: team.into(),
            queue: "default".into(),
            priority: 0,
            state: JobState::Succeeded,
            spec: String::new(),
            secret: String::new(),
            restarts: 0,
            attempt: 1,
            workers: 2,
            created_ms,
            started_ms: None,
            finished_ms: None,
            reason: String::new(),
            cancel_requested: false,
            summary: None,
            checkpoint_key: None,
        }
    }

    fn task(rank: i64, start: i64, end: i64, cpu_s: f64) -> TaskRow {
        TaskRow {
            job_id: "j".into(),
            attempt: 1,
            rank,
            node: "local".into(),
            host: "h".into(),
            pid: None,
            start_ticks: None,
            state: crate::db::TaskState::Exited,
            worker_pid: None,
            exit_code: Some(0),
            reason: String::new(),
            cpus: String::new(),
            gpus: String::new(),
            started_ms: Some(start),
            ended_ms: Some(end),
            cpu_seconds: Some(cpu_s),
            external_id: None,
        }
    }

    #[test]
    fn a_job_with_phases_is_charged_each_at_its_own_resources() {
        let prices = Prices { currency: "USD".into(), cpu_hour: 0.10, gib_hour: 0.0, gpu_hour: 0.0, kwh: 0.0 };
        let rates = [
            Rate { per_worker: (4.0, 0, 0.0), from_ms: i64::MIN, until_step: Some(1000) },
            Rate { per_worker: (1.0, 0, 0.0), from_ms: 3_600_000, until_step: None },
        ];
        // Phase 0: two workers of 4 CPUs for an hour; phase 1 (from its event at 1 h): one of 1 CPU for an hour.
        let tasks = [task(0, 0, 3_600_000, 0.0), task(1, 0, 3_600_000, 0.0), task(0, 3_600_000, 7_200_000, 0.0)];
        let c = job_cost(&job("p", "nlp", 0), &rates, &tasks, &[], &prices, 10_000_000);
        let got: Vec<(usize, Option<usize>, usize, f64)> =
            c.phases.iter().map(|p| (p.phase, p.until_step, p.workers, p.allocated.cpu_hours)).collect();
        assert_eq!(got, vec![(0, Some(1000), 2, 8.0), (1, None, 1, 1.0)]);
        assert!((c.phases[0].cost - 0.8).abs() < 1e-12 && (c.phases[1].cost - 0.1).abs() < 1e-12, "{c:?}");
        assert!((c.cost - c.phases.iter().map(|p| p.cost).sum::<f64>()).abs() < 1e-12, "the phases add up");
        // Before the second phase is reached it is not reported; a job without phases reports none.
        let early = job_cost(&job("p", "nlp", 0), &rates, &tasks[..2], &[], &prices, 10_000_000);
        assert_eq!(early.phases.len(), 1);
        let plain = job_cost(&job("q", "nlp", 0), &Rate::whole((4.0, 0, 0.0)), &tasks[..2], &[], &prices, 1);
        assert!(plain.phases.is_empty() && (plain.cost - 0.8).abs() < 1e-12, "{plain:?}");
    }

    #[test]
    fn costs_add_up_on_known_jobs() {
        let prices = Prices { currency: "USD".into(), cpu_hour: 0.10, gib_hour: 0.01, gpu_hour: 3.0, kwh: 0.0 };
        // Job a: 2 workers x (2 CPUs, 4 GiB, 1 GPU) for exactly one hour, queued 60 s.
        let a = job_cost(
            &job("a", "vision", 0),
            &Rate::whole((2.0, 4 << 30, 1.0)),
            &[task(0, 60_000, 3_660_000, 3600.0), task(1, 60_000, 3_660_000, 1800.0)],
            &[],
            &prices,
            10_000_000,
        );
        assert!((a.allocated.cpu_hours - 4.0).abs() < 1e-12);
        assert!((a.allocated.gib_hours - 8.0).abs() < 1e-12);
        assert!((a.allocated.gpu_hours - 2.0).abs() < 1e-12);
        assert!((a.used.cpu_hours - 1.5).abs() < 1e-12);
        assert!((a.queue_s - 60.0).abs() < 1e-12);
        // 4 * 0.10 + 8 * 0.01 + 2 * 3.0 = 6.48
        assert!((a.cost - 6.48).abs() < 1e-9, "{}", a.cost);
        // Job b: one CPU-only worker for 30 minutes, restarted once (two tasks of 15 minutes), still waiting 0 s.
        let b = job_cost(
            &job("b", "nlp", 1_000),
            &Rate::whole((1.0, 1 << 30, 0.0)),
            &[task(0, 1_000, 901_000, 100.0), task(0, 901_000, 1_801_000, 100.0)],
            &[],
            &prices,
            10_000_000,
        );
        // 0.5 CPU-h * 0.10 + 0.5 GiB-h * 0.01 = 0.055
        assert!((b.cost - 0.055).abs() < 1e-9, "{}", b.cost);
        let c = job_cost(&job("c", "vision", 0), &Rate::whole((1.0, 1 << 30, 0.0)), &[], &[], &prices, 5_000);
        assert_eq!(c.cost, 0.0);
        assert!((c.queue_s - 5.0).abs() < 1e-12, "a job never started has queued until now");
        let r = report(vec![a.clone(), b.clone(), c], &prices);
        assert_eq!(r.teams.len(), 2);
        let vision = r.teams.iter().find(|t| t.team == "vision").expect("vision");
        assert_eq!(vision.jobs, 2);
        assert!((vision.cost - 6.48).abs() < 1e-9);
        assert!((r.total_cost - (6.48 + 0.055)).abs() < 1e-9);
        assert!((r.teams.iter().map(|t| t.cost).sum::<f64>() - r.total_cost).abs() < 1e-12);
    }

    #[test]
    fn price_tables_are_checked() {
        assert!(parse_prices("cpu_hour = 0.1\ngpu_hour = 2").is_ok());
        assert!(parse_prices("cpu_hour = -1").is_err_and(|e| e.contains("cpu_hour")));
        assert!(parse_prices("cpu_hours = 1").is_err());
    }
}
