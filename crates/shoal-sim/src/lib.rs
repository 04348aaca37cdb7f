//! Shoal's cluster scheduling simulator: a job trace replayed through `shoal-sched` — the very scheduler the
//! server runs — with time passed in, and what came of it: job completion and queueing times, makespan, GPU
//! allocation and fragmentation over time, preemptions, fairness between teams; reports as JSON and CSV, plots as
//! SVG.
//!
//! - `trace.rs`: traces (Shoal's CSV, the Alibaba 2023 GPU trace), told apart by their header; `csv.rs` the plain
//!   CSV both are written in, every error naming its file, line and column.
//! - `cluster.rs`: the cluster (the Alibaba node list, or identical nodes).
//! - `synth.rs`: a Philly-like synthetic trace at a chosen offered load.
//! - `outcome.rs`: what a simulation is asked ([`SimOptions`]) and what it produced ([`Outcome`]); `books.rs` the
//!   counting both engines share.
//! - `sim.rs`: the event loop ([`simulate`]); `report.rs` the figures ([`Report`]); `plot.rs` the plots.
//! - `control.rs` (feature `control`): the same trace through the server's control loop ([`simulate_control`]).
//!
//! **Invariants.** Scheduling decisions are shoal-sched's alone: this crate keeps no copy of any policy, it only
//! submits jobs, calls `Scheduler::schedule(now_ms)` at each instant something happens and carries out the
//! decisions on simulated jobs. A simulation is a pure function of the trace, the cluster and the options: no
//! clock, no randomness but seeded generators, no iteration over hashed maps, so the same inputs give the same
//! report byte for byte. A bad input is an error naming where it is, never a panic. Files are read and written
//! only by the `read_*`/`write_*` functions; the rest does no IO.
//!
//! Feature `control`: [`simulate_control`] replays a trace through the server's own control loop (`shoal-control`
//! with `shoal-exec`'s fake executor and a manual clock) instead of the scheduler alone: admission, the store,
//! placement, preemption and requeueing are then the production code paths. It keeps a scratch store on disk.
//!
//! ```
//! use shoal_sim::{Report, SimOptions, homogeneous, parse_trace, simulate};
//!
//! let trace = parse_trace(
//!     "t.csv",
//!     "job_id,submit_s,duration_s,gpus,gpu_milli,cpus,memory_mib,team\n\
//!      a,0,100,8,,8,1024,x\n\
//!      b,0,10,8,,8,1024,y\n",
//! )?;
//! let options = SimOptions { policy: "sjf".parse()?, ..SimOptions::default() };
//! let report = Report::of(&simulate(&trace, homogeneous(1, 8)?, &options)?);
//! // b runs first (10 s), then a (100 s): JCTs 10 and 110.
//! assert_eq!(report.avg_jct_s, 60.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod books;
mod cluster;
#[cfg(feature = "control")]
mod control;
mod csv;
mod error;
mod outcome;
mod plot;
mod report;
mod sim;
mod synth;
mod trace;

pub use cluster::{homogeneous, parse_cluster, read_cluster};
#[cfg(feature = "control")]
pub use control::simulate_control;
pub use error::{Result, SimError};
pub use outcome::{ArrivalSample, JobRecord, Outcome, Sample, SimOptions, TeamTally};
pub use plot::{POINTS, write_plots};
pub use report::{Report, TeamReport, jobs_csv, series_csv};
pub use sim::simulate;
pub use synth::{SynthOptions, philly_like};
pub use trace::{Trace, TraceFormat, TraceJob, parse_trace, read_trace, write_trace};

/// Writes a simulation's report and series into `dir` (created if needed): `report.json`, `series.csv` (the
/// cluster after each instant) and `jobs.csv` (every job's times); returns their paths.
pub fn write_outcome(dir: &std::path::Path, outcome: &Outcome) -> Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|source| SimError::Io { path: dir.display().to_string(), source })?;
    let files = [
        ("report.json", Report::of(outcome).to_json()? + "\n"),
        ("series.csv", series_csv(outcome)),
        ("jobs.csv", jobs_csv(outcome)),
    ];
    let mut out = Vec::new();
    for (name, text) in files {
        let p = dir.join(name);
        error::write(&p, text.as_bytes())?;
        out.push(p);
    }
    Ok(out)
}
