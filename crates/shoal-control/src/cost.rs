//! What jobs cost: resource-hours allocated (what a worker held, from its start to its end) and used (CPU time
//! its processes took; memory from the resident-size samples), queue time, and money at the server's prices.
//! Money is charged on allocation, as clouds do. Pure: rows in, report out.
//!
//! Prices come from the server's configuration (`--prices FILE`, TOML):
//! ```toml
//! currency = "USD"
//! cpu_hour = 0.04     # per CPU-hour
//! gib_hour = 0.005    # per GiB-hour of memory
//! gpu_hour = 2.50     # per GPU-hour
//! kwh = 0.15          # per kWh, for the energy estimate where GPUs report power
//! ```

pub use shoal_wire::{CostReport, Hours, JobCost, Prices, TeamCost};

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

/// One job's cost. `per_worker` is `(cpus, memory bytes, gpus)` held by each worker.
pub fn job_cost(
    job: &JobRow,
    per_worker: (f64, u64, f64),
    tasks: &[TaskRow],
    samples: &[SampleRow],
    prices: &Prices,
    now_ms: i64,
) -> JobCost {
    let (cpus, mem, gpus) = per_worker;
    let gib = mem as f64 / (1u64 << 30) as f64;
    let mut allocated = Hours::default();
    let mut used = Hours::default();
    for t in tasks {
        let Some(start) = t.started_ms else { continue };
        let end = t.ended_ms.unwrap_or(now_ms).max(start);
        let h = (end - start) as f64 / 3_600_000.0;
        allocated.add(&Hours { cpu_hours: cpus * h, gib_hours: gib * h, gpu_hours: gpus * h });
        used.cpu_hours += t.cpu_seconds.unwrap_or(0.0) / 3600.0;
    }
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
    let cost = allocated.cpu_hours * prices.cpu_hour
        + allocated.gib_hours * prices.gib_hour
        + allocated.gpu_hours * prices.gpu_hour
        + energy_kwh.unwrap_or(0.0) * prices.kwh;
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
    }
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
    fn costs_add_up_on_known_jobs() {
        let prices = Prices { currency: "USD".into(), cpu_hour: 0.10, gib_hour: 0.01, gpu_hour: 3.0, kwh: 0.0 };
        // Job a: 2 workers x (2 CPUs, 4 GiB, 1 GPU) for exactly one hour, queued 60 s.
        let a = job_cost(
            &job("a", "vision", 0),
            (2.0, 4 << 30, 1.0),
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
            (1.0, 1 << 30, 0.0),
            &[task(0, 1_000, 901_000, 100.0), task(0, 901_000, 1_801_000, 100.0)],
            &[],
            &prices,
            10_000_000,
        );
        // 0.5 CPU-h * 0.10 + 0.5 GiB-h * 0.01 = 0.055
        assert!((b.cost - 0.055).abs() < 1e-9, "{}", b.cost);
        let c = job_cost(&job("c", "vision", 0), (1.0, 1 << 30, 0.0), &[], &[], &prices, 5_000);
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
