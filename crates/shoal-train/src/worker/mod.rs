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
//! `command.rs` runs a job's own program (`train.command`) instead, as the rank's supervised child.
//! `regroup.rs` keeps an elastic job's survivors training when the group loses a member or gains newcomers: a new
//! communicator at the new size, and the state of the group's rank 0, with no process restarted.
//! `stop.rs` turns a SIGTERM during the step loop into a stop at the next step boundary, with a checkpoint there,
//! agreed by every rank. `eval.rs` holds the evaluation pass both the loop and the report run; `wire.rs` the types of the files others
//! read (`metrics.jsonl`, `eval.jsonl`, `summary.json`); `heartbeat.rs` the thread that, on the platform, tells the
//! control loop twice a second that the rank lives, its phase, its step and the collective it is in.

mod collectives;
mod command;
mod eval;
mod federated;
mod heartbeat;
mod regroup;
mod report;
mod resume;
mod serve;
pub(crate) mod setup;
mod stop;
mod train_loop;
pub(crate) mod wire;

use std::path::PathBuf;
use std::time::Instant;

use crate::error::Result;
use crate::spec::JobSpec;

pub use eval::unigram_baseline;
pub use heartbeat::{INTERVAL as HEARTBEAT_INTERVAL, TAG_HEADER as HEARTBEAT_TAG_HEADER, heartbeat_file};
pub use report::write_json;
pub use setup::{build_model, checkpoint_remote, checkpoint_root, open_data, optimizer_config};
pub use wire::{EvalMetrics, FederatedReport, RoundReport, StepMetrics, StepTime, Summary, metrics_file};

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub output: PathBuf,
    pub resume: bool,
}

/// Runs this process's rank of `spec`; rank 0 returns the summary.
pub fn run(spec: &JobSpec, opts: &WorkerOptions) -> Result<Option<Summary>> {
    if spec.is_command() {
        return command::run(spec, &opts.output, opts.resume);
    }
    let started = Instant::now();
    // The last `ps.servers` tasks of a parameter-server job serve the model instead.
    if spec.ps_servers() > 0 {
        let env = shoal_comm::env::EnvContract::from_env()?;
        if let Some(index) = serve::server_index(spec, &env) {
            return serve::run(spec, &opts.output, opts.resume, env, index).map(|()| None);
        }
    }
    let (mut setup, params) = setup::setup(spec, &opts.output)?;
    // From here on, the job as it runs (`train.strategy = "auto"` resolved).
    let spec = &setup.spec.clone();
    // On the platform, the control plane hears from this rank until it exits, and at once why it fails.
    let beat = setup.attempt.and_then(|a| {
        heartbeat::Beat::start(setup.comm.clone(), setup.task_rank, a, setup.joined, &opts.output, setup.link.clone())
    });
    let ran = match spec.train.strategy {
        crate::spec::Strategy::Federated => {
            federated::train(spec, &setup, &params, &opts.output, beat.as_ref(), started)
        }
        _ => train(spec, opts, &mut setup, params, beat.as_ref(), started),
    };
    match (&ran, &beat) {
        (Err(crate::error::Error::Stopped { .. }), _) | (Ok(_), _) | (_, None) => {}
        (Err(e), Some(b)) => b.fail(&e.to_string()),
    }
    ran
}

/// Everything after the setup: resume (or, for a rank that joined a running group, the group's state), train —
/// regrouping in place as often as the group changes — and report.
fn train(
    spec: &JobSpec,
    opts: &WorkerOptions,
    setup: &mut setup::Setup,
    params: crate::params::Params,
    beat: Option<&heartbeat::Beat>,
    started: Instant,
) -> Result<Option<Summary>> {
    if let Some(b) = beat {
        b.phase(heartbeat::Phase::Resume);
    }
    let joined = setup.joined > 0;
    let resumed = if joined { None } else { resume::load(spec, opts.resume, setup, &params)? };
    let from_memory = match (&resumed, &setup.memory) {
        (Some(l), Some(m)) => l.dir.starts_with(m.job_root()),
        _ => false,
    };
    if let (Some(b), Some(l), 0) = (beat, &resumed, setup.rank) {
        let source = if from_memory { "memory copy" } else { "storage checkpoint" };
        b.resumed(format!("{source} at step {}", l.manifest.step));
    }
    let (mut training, start_step, last_loss) = if joined {
        // A newcomer: it takes the group's state as a member that regrouped does.
        let met = regroup::rejoin(spec, setup, None, params)?;
        (met.training, met.boundary.step, met.boundary.loss)
    } else {
        let mut training = setup::training(spec, setup, params)?;
        let start_step = match &resumed {
            Some(l) => resume::restore(l, &mut training)?,
            None => 0,
        };
        let loss = resumed.as_ref().and_then(|l| l.manifest.extra.get("loss").and_then(serde_json::Value::as_f64));
        (training, start_step, loss.unwrap_or(f64::NAN))
    };
    if let (Some(b), Some(why), 0) = (beat, &training.chose, setup.rank) {
        b.chose(why.clone());
    }
    // Nothing left to train: the run ends with the summary of the run that got here, when rank 0 has it.
    if let Some(kept) = report::kept_summary(spec, setup, start_step, &opts.output)? {
        remove_memory_copies(setup);
        return Ok(kept);
    }
    let mut steps = train_loop::StepLoop::open(spec, setup, &training, start_step, last_loss, &opts.output)?;
    steps.resumed_from_memory = from_memory;
    let mut trained: Option<train_loop::Trained> = None;
    loop {
        if let Some(b) = beat {
            b.step(steps.boundary.step as u64);
            b.phase(heartbeat::Phase::Train);
        }
        let failed = match steps.run(spec, setup, &mut training, beat) {
            Ok(t) => {
                let again = t.regroup;
                match trained.as_mut() {
                    Some(all) => all.absorb(t),
                    None => trained = Some(t),
                }
                if !again {
                    break;
                }
                None
            }
            // A peer gone from a collective: an elastic group goes on without it, when the server says how.
            Err(crate::error::Error::Comm(e)) if regroup::in_place(spec, setup) && beat.is_some() => Some(e),
            Err(e) => return Err(e),
        };
        let Some(b) = beat else { break };
        b.phase(heartbeat::Phase::Regroup);
        let limit = if failed.is_some() { regroup::patience(spec) } else { std::time::Duration::from_secs(30) };
        if let Some(e) = &failed {
            tracing::warn!(error = %e, "a collective failed; waiting to hear of the group that goes on");
        }
        let at = steps.boundary.clone();
        drop(steps);
        let mine = regroup::given(spec, &training, at.clone(), failed.is_some());
        let params = training.trainer.params().clone();
        // A group that does not form (a member lost while it meets) gives way to the next one the server names.
        let mut failed = failed.map(crate::error::Error::from);
        let (next, met) = loop {
            let Some(next) = b.wait_regroup(limit) else {
                return Err(failed.unwrap_or_else(|| {
                    crate::error::Error::InvalidArgument(format!(
                        "the group was to regroup after step {}, but the server named no new group within {limit:?}",
                        at.step
                    ))
                }));
            };
            let met = regroup::enter(spec, setup, &next)
                .and_then(|()| regroup::rejoin(spec, setup, Some(&mine), params.clone()));
            match met {
                Ok(met) => break (next, met),
                Err(e @ crate::error::Error::Comm(_)) => {
                    tracing::warn!(generation = next.generation, error = %e, "the group did not form; waiting for the next");
                    failed = Some(e);
                }
                Err(e) => return Err(e),
            }
        };
        b.regrouped(next.generation, setup.comm.clone());
        if let Some(from) = &met.rolled_back {
            b.resumed(format!("{from}, as group {} regrouped", next.generation));
        }
        training = met.training;
        let at = met.boundary;
        if setup.rank == 0 {
            match met.rolled_back {
                None => eprintln!(
                    "regrouped in place: group {} of {} workers goes on from step {}",
                    next.generation, setup.world, at.step
                ),
                Some(from) => eprintln!(
                    "regrouped in place: group {} of {} workers goes on from its {from} (a shard of the state was \
                     lost with a member)",
                    next.generation, setup.world
                ),
            }
        }
        steps = train_loop::StepLoop::open(spec, setup, &training, at.step, at.loss, &opts.output)?;
    }
    let trained = trained.ok_or_else(|| crate::error::Error::InvalidArgument("the step loop never ran".into()))?;
    if let Some(step) = trained.stopped_at {
        return Err(crate::error::Error::Stopped { step });
    }
    if let Some(b) = beat {
        b.phase(heartbeat::Phase::Finish);
    }
    training.trainer.finish()?;
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
