//! One rank of a job: builds the communicator from the environment contract,
//! the datasets, the model and the [`Trainer`](crate::Trainer) from the job spec, trains, and
//! (on rank 0) writes `metrics.jsonl` and `summary.json` into the output
//! directory. `shoal run JOB.toml` starts N of these.
//!
//! [`run`] goes through four phases, a file each:
//! - `setup.rs`: the environment contract, the datasets, the model, where checkpoints go; then the trainer over
//!   the strategy the job names and the sampler;
//! - `resume.rs`: the checkpoint to resume from (the run's own: its host's in-memory copy when every rank has it
//!   and storage holds nothing newer, else storage, fetched from its object store first; or the one
//!   `checkpoint.resume_from` names), loaded into the model, then the sampler and the optimizer;
//! - `train_loop.rs`: the step loop — metrics, periodic checkpoints, in-memory copies, evaluations;
//! - `report.rs`: the final evaluation and `summary.json`, or the summary kept when the run was already complete.
//!
//! `stop.rs` turns a SIGTERM during the step loop into a stop at the next step boundary, with a checkpoint there,
//! agreed by every rank. `eval.rs` holds the evaluation pass both the loop and the report run; `wire.rs` the types of the files others
//! read (`metrics.jsonl`, `eval.jsonl`, `summary.json`); `heartbeat.rs` the thread that, on the platform, tells the
//! control loop twice a second that the rank lives, its phase, its step and the collective it is in.

mod eval;
mod heartbeat;
mod report;
mod resume;
mod setup;
mod stop;
mod train_loop;
mod wire;

use std::path::PathBuf;
use std::time::Instant;

use crate::error::Result;
use crate::spec::JobSpec;

pub use eval::unigram_baseline;
pub use heartbeat::{INTERVAL as HEARTBEAT_INTERVAL, TAG_HEADER as HEARTBEAT_TAG_HEADER, heartbeat_file};
pub use report::write_json;
pub use setup::{build_model, checkpoint_remote, checkpoint_root};
pub use wire::{EvalMetrics, StepMetrics, StepTime, Summary, metrics_file};

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub output: PathBuf,
    pub resume: bool,
}

/// Runs this process's rank of `spec`; rank 0 returns the summary.
pub fn run(spec: &JobSpec, opts: &WorkerOptions) -> Result<Option<Summary>> {
    let started = Instant::now();
    let (setup, params) = setup::setup(spec, &opts.output)?;
    // On the platform, the control plane hears from this rank until it exits, and at once why it fails.
    let beat = setup
        .attempt
        .and_then(|a| heartbeat::Beat::start(setup.comm.clone(), setup.rank, a, &opts.output, setup.link.clone()));
    let ran = train(spec, opts, &setup, params, beat.as_ref(), started);
    match (&ran, &beat) {
        (Err(crate::error::Error::Stopped { .. }), _) | (Ok(_), _) | (_, None) => {}
        (Err(e), Some(b)) => b.fail(&e.to_string()),
    }
    ran
}

/// Everything after the setup: resume, train, report.
fn train(
    spec: &JobSpec,
    opts: &WorkerOptions,
    setup: &setup::Setup,
    params: crate::params::Params,
    beat: Option<&heartbeat::Beat>,
    started: Instant,
) -> Result<Option<Summary>> {
    if let Some(b) = beat {
        b.phase(heartbeat::Phase::Resume);
    }
    let resumed = resume::load(spec, opts.resume, setup, &params)?;
    let from_memory = match (&resumed, &setup.memory) {
        (Some(l), Some(m)) => l.dir.starts_with(m.job_root()),
        _ => false,
    };
    if let (Some(b), Some(l), 0) = (beat, &resumed, setup.rank) {
        let source = if from_memory { "memory copy" } else { "storage checkpoint" };
        b.resumed(format!("{source} at step {}", l.manifest.step));
    }
    let mut training = setup::training(spec, setup, params)?;
    if let (Some(b), Some(why), 0) = (beat, &training.chose, setup.rank) {
        b.chose(why.clone());
    }
    let start_step = match &resumed {
        Some(l) => resume::restore(l, &mut training)?,
        None => 0,
    };
    // Nothing left to train: the run ends with the summary of the run that got here, when rank 0 has it.
    if let Some(kept) = report::kept_summary(spec, setup, start_step, &opts.output)? {
        remove_memory_copies(setup);
        return Ok(kept);
    }
    let mut steps = train_loop::StepLoop::open(spec, setup, &training, start_step, &opts.output)?;
    steps.resumed_from_memory = from_memory;
    if let Some(b) = beat {
        b.step(start_step as u64);
        b.phase(heartbeat::Phase::Train);
    }
    let trained = steps.run(spec, setup, &mut training, resumed.as_ref(), beat)?;
    if let Some(step) = trained.stopped_at {
        return Err(crate::error::Error::Stopped { step });
    }
    if let Some(b) = beat {
        b.phase(heartbeat::Phase::Finish);
    }
    let summary = report::finish(spec, setup, &training, &steps, trained, started, &opts.output)?;
    drop(steps);
    remove_memory_copies(setup);
    Ok(summary)
}

/// At the successful end of a run, the first rank of each host removes the job's in-memory copies there (every
/// rank got past the final barrier, so none reads them any more). A failure to is logged: the directory stays in
/// `/dev/shm` until the host restarts or someone removes it.
fn remove_memory_copies(setup: &setup::Setup) {
    if let (Some(m), true) = (&setup.memory, setup.host_leader) {
        match m.remove() {
            Ok(()) => tracing::debug!(dir = %m.job_root().display(), "in-memory copies removed"),
            Err(e) => tracing::warn!("the job's in-memory copies could not be removed: {e}"),
        }
    }
}
