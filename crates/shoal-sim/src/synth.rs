//! A Philly-like synthetic trace: heavy-tailed run times, mostly one-GPU jobs, Poisson arrivals at a chosen
//! offered load.
//!
//! The distribution, loosely calibrated to what Jeon et al. (ATC'19) and Gu et al. (Tiresias, NSDI'19) publish
//! of Microsoft's Philly cluster — most jobs run minutes, a few run days and hold most of the GPU time:
//! - GPUs per job: 1 (62%), 2 (13%), 4 (12%), 8 (9%), 16 (3%), 32 (1%); up to 8 as one task, beyond as tasks of
//!   8 GPUs (a gang over nodes). 4 cores and 24 GiB per GPU.
//! - Run time: with probability 0.8 log-normal with a median of 10 minutes and σ = 1.6 (at least 30 s), else
//!   Pareto with a minimum of 2 hours and α = 1.3, at most 30 days.
//! - Elastic: a tenth of the jobs of 1 to 4 GPUs run 1 to 4 such tasks (their run time given at one).
//! - Teams: 8, the `k`-th with weight `1/(k+1)`.
//! - Arrivals: Poisson, at the rate at which the jobs' GPU time (at their minimum size) offers `load` times the
//!   cluster's GPU capacity.
//!
//! Everything is drawn from shoal-sched's SplitMix64, so a seed gives the same trace everywhere.

use shoal_sched::{Resources, SplitMix64};

use crate::trace::TraceJob;

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthOptions {
    /// How many jobs.
    pub jobs: usize,
    /// GPUs of the cluster it is meant for (sets the arrival rate).
    pub gpus: u64,
    /// Offered load: the jobs' GPU time over the cluster's capacity over the arrival span.
    pub load: f64,
    /// The seed.
    pub seed: u64,
}

/// Uniform in (0, 1).
fn unit(rng: &mut SplitMix64) -> f64 {
    ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut SplitMix64) -> f64 {
    let (u, v) = (unit(rng), unit(rng));
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

const SIZES: [(u64, f64); 6] = [(1, 0.62), (2, 0.13), (4, 0.12), (8, 0.09), (16, 0.03), (32, 0.01)];
const TEAMS: usize = 8;
const MIN_S: f64 = 30.0;
const MAX_S: f64 = 30.0 * 86_400.0;

/// The jobs, submitted from time 0.
pub fn philly_like(o: &SynthOptions) -> Vec<TraceJob> {
    let mut rng = SplitMix64::new(o.seed);
    let team_weight: Vec<f64> = (0..TEAMS).map(|k| 1.0 / (k + 1) as f64).collect();
    let team_total: f64 = team_weight.iter().sum();
    let mut jobs: Vec<TraceJob> = (0..o.jobs)
        .map(|i| {
            let mut roll = unit(&mut rng);
            let mut gpus = SIZES[SIZES.len() - 1].0;
            for (g, p) in SIZES {
                if roll < p {
                    gpus = g;
                    break;
                }
                roll -= p;
            }
            let secs = if unit(&mut rng) < 0.8 {
                (600.0 * (1.6 * normal(&mut rng)).exp()).max(MIN_S)
            } else {
                7200.0 * unit(&mut rng).powf(-1.0 / 1.3)
            }
            .min(MAX_S);
            let (per_task, tasks) = if gpus > 8 { (8, (gpus / 8) as u32) } else { (gpus, 1) };
            let elastic = gpus <= 4 && unit(&mut rng) < 0.1;
            let mut t = unit(&mut rng) * team_total;
            let mut team = TEAMS - 1;
            for (k, w) in team_weight.iter().enumerate() {
                if t < *w {
                    team = k;
                    break;
                }
                t -= w;
            }
            TraceJob {
                id: format!("job-{i:06}"),
                submit_ms: 0,
                duration_ms: (secs * 1000.0).round() as u64,
                per_task: Resources {
                    cpus_milli: 4_000 * per_task,
                    memory_bytes: 24 * per_task * (1 << 30),
                    gpus_milli: 1000 * per_task,
                    gpu_memory_bytes: 0,
                },
                tasks_min: tasks,
                tasks_max: if elastic { 4 } else { tasks },
                team: format!("team-{team}"),
                queue: "default".into(),
                priority: 0,
            }
        })
        .collect();
    let demand: f64 =
        jobs.iter().map(|j| j.duration_ms as f64 * (j.per_task.gpus_milli * j.tasks_min as u64) as f64 / 1000.0).sum();
    let rate = if demand > 0.0 && o.gpus > 0 && o.load > 0.0 {
        // Jobs per millisecond such that GPU-ms offered per ms = load × GPUs.
        o.load * o.gpus as f64 * jobs.len() as f64 / demand
    } else {
        1.0
    };
    let mut t = 0.0f64;
    for j in &mut jobs {
        j.submit_ms = t.round() as u64;
        t += -unit(&mut rng).ln() / rate;
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_trace_and_the_mix_is_heavy_tailed() {
        let o = SynthOptions { jobs: 5_000, gpus: 800, load: 0.9, seed: 7 };
        let a = philly_like(&o);
        assert_eq!(a, philly_like(&o));
        assert_ne!(a, philly_like(&SynthOptions { seed: 8, ..o.clone() }));
        let one = a.iter().filter(|j| j.per_task.gpus_milli == 1000 && j.tasks_min == 1).count() as f64;
        assert!((0.55..0.70).contains(&(one / a.len() as f64)), "{one}");
        let mut d: Vec<u64> = a.iter().map(|j| j.duration_ms).collect();
        d.sort_unstable();
        let mean = d.iter().map(|&x| x as f64).sum::<f64>() / d.len() as f64;
        // Heavy tail: the mean is many times the median.
        assert!(mean > 5.0 * d[d.len() / 2] as f64, "mean {mean} median {}", d[d.len() / 2]);
        assert!(a.windows(2).all(|w| w[0].submit_ms <= w[1].submit_ms));
    }
}
