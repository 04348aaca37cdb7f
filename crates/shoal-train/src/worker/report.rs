//! The end of a run: the final evaluation, the summary, and `summary.json` written by rank 0 once every rank got
//! there; or, for a run whose checkpoint is already at its last step, the summary of the run that got there.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use shoal_comm::{Communicator, ReduceOp};

use super::eval::{evaluate, unigram_baseline};
use super::setup::{Setup, Training};
use super::train_loop::{StepLoop, Trained};
use super::wire::{RankMemory, StepTime, Summary};
use crate::checkpoint::AsyncSaver;
use crate::error::{Error, Result};
use crate::spec::{JobSpec, ModelKind, median};

/// `summary.json` in the output directory.
fn summary_path(output: &Path) -> PathBuf {
    output.join("summary.json")
}

/// For a run resumed at `start_step`: `Some` when the run ends here, because the checkpoint is at the last step
/// already and rank 0 has the summary of the run that got there (that summary on rank 0, `None` on the other
/// ranks). `None` when there are steps left, or when that summary is missing and the checkpoint is evaluated for a
/// new one.
pub(super) fn kept_summary(
    spec: &JobSpec,
    setup: &Setup,
    start_step: usize,
    output: &Path,
) -> Result<Option<Option<Summary>>> {
    let (t, rank, comm) = (&spec.train, setup.rank, &setup.comm);
    let summary_path = summary_path(output);
    if start_step >= t.steps {
        // Nothing left to train. Keep the summary of the run that got here, when rank 0 has it.
        let kept = if rank == 0 { read_summary(&summary_path, &spec.name) } else { None };
        if any_rank(comm, kept.is_some())? {
            if rank == 0 {
                eprintln!(
                    "the run is already complete: its newest checkpoint is step {start_step} of {}; {} kept",
                    t.steps,
                    summary_path.display()
                );
            }
            comm.barrier()?;
            return Ok(Some(kept));
        }
        if rank == 0 {
            eprintln!(
                "the run is already complete (checkpoint step {start_step} of {}), but {} is missing: evaluating \
                 the checkpoint for a new one",
                t.steps,
                summary_path.display()
            );
        }
    }
    Ok(None)
}

/// The final evaluation and the summary, written to `summary.json` by rank 0 after every rank got there; rank 0
/// returns it.
pub(super) fn finish(
    spec: &JobSpec,
    setup: &Setup,
    tr: &Training,
    steps: &StepLoop,
    trained: Trained,
    started: Instant,
    output: &Path,
) -> Result<Option<Summary>> {
    let t = &spec.train;
    let (world, rank, comm, model, train, eval) =
        (setup.world, setup.rank, &setup.comm, &setup.model, &setup.train, &setup.eval);
    let (parameters, micro, ran, overlap) = (setup.parameters, tr.micro, tr.ran, tr.overlap);
    let Trained {
        last_loss,
        samples_seen,
        data_t,
        compute_t,
        comm_t,
        opt_t,
        step_t,
        train_s,
        checkpoints,
        stall_s,
        last_mb_s,
        activations_peak,
        memory_copies,
        memory_stall_s,
        bubble_t,
        bubble_theory,
        bytes_t,
        stopped_at: _,
        regroup: _,
    } = trained;
    let (eval_loss, eval_acc) = evaluate(model.as_ref(), &tr.trainer, eval.as_ref(), comm, micro, t.eval_batches)?;
    steps.eval_log.log(t.steps, eval_loss, eval_acc)?;
    let text = t.model.kind == ModelKind::Gpt;
    // A built-in text's unigram baseline (a lake's would read the whole table once more).
    let baseline = text && !crate::spec::data::is_lake(&t.dataset);
    let baseline_loss = if baseline && rank == 0 {
        Some(unigram_baseline(train.as_ref(), eval.as_ref(), t.model.vocab())?)
    } else {
        None
    };
    // Every rank's memory, gathered (-1: not measured).
    let trainer = &tr.trainer;
    let mine = [
        trainer.param_bytes() as i64,
        trainer.gradient_bytes() as i64,
        trainer.optimizer_bytes() as i64,
        activations_peak.map_or(-1, |a| a as i64),
    ];
    let mut all = vec![0i64; 4 * world];
    comm.all_gather(&mine, &mut all)?;
    let memory_bytes = all
        .chunks(4)
        .enumerate()
        .map(|(rank, m)| RankMemory {
            rank,
            params: m[0].max(0) as u64,
            grads: m[1].max(0) as u64,
            optimizer: m[2].max(0) as u64,
            activations_peak: u64::try_from(m[3]).ok(),
        })
        .collect();
    let summary = Summary {
        name: spec.name.clone(),
        model: format!("{:?}", t.model.kind).to_lowercase(),
        dataset: t.dataset.clone(),
        parameters,
        steps: t.steps,
        world_size: world,
        strategy: ran,
        final_loss: last_loss.is_finite().then_some(last_loss),
        eval_loss,
        eval_accuracy: (!text).then_some(eval_acc),
        eval_perplexity: text.then(|| eval_loss.exp()),
        baseline_loss,
        samples_per_s: samples_seen as f64 / train_s.max(1e-9),
        comm_bytes: tr.trainer.bytes_sent(),
        comm_bytes_per_step: match bytes_t.len() {
            0 => 0.0,
            n => bytes_t.iter().sum::<u64>() as f64 / n as f64,
        },
        compression: spec.compression.filter(|c| c.is_on()),
        overlap,
        // Zeros when no step ran (a complete run evaluated again).
        step_time: StepTime {
            data_s: median(data_t).unwrap_or(0.0),
            compute_s: median(compute_t).unwrap_or(0.0),
            comm_s: median(comm_t).unwrap_or(0.0),
            optimizer_s: median(opt_t).unwrap_or(0.0),
            step_s: median(step_t).unwrap_or(0.0),
        },
        elapsed_s: started.elapsed().as_secs_f64(),
        resumed_from: steps.start_step as u64,
        checkpoints,
        checkpoint_mb_per_s: last_mb_s,
        checkpoint_stall_s: stall_s,
        checkpoint_save_s: steps.saver.as_ref().map_or(0.0, AsyncSaver::total_save_seconds),
        memory_bytes,
        memory_copies,
        memory_stall_s,
        resumed_from_memory: steps.resumed_from_memory,
        bubble_fraction: median(bubble_t),
        bubble_theory,
        stage_layers: tr.trainer.stage_layers().map(|c| c.iter().map(|l| [l.start, l.end]).collect()),
        shares: tr.shares.as_ref().map(|s| {
            let n = tr.sampler.world_size();
            match s.latest() {
                Some(w) if w.len() == n && w.iter().any(|&x| x > 0) => {
                    let total: f64 = w.iter().map(|&x| f64::from(x)).sum();
                    w.iter().map(|&x| f64::from(x) / total).collect()
                }
                _ => vec![1.0 / n as f64; n],
            }
        }),
        command: Vec::new(),
        metrics_lines: 0,
        federated: None,
    };
    comm.barrier()?;
    if rank == 0 {
        write_json(&summary_path(output), &summary)?;
        return Ok(Some(summary));
    }
    Ok(None)
}

/// The `summary.json` at `path` when it is one of job `name`; `None` when it is missing, unreadable or another
/// job's.
fn read_summary(path: &Path, name: &str) -> Option<Summary> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str::<Summary>(&text).ok().filter(|s| s.name == name)
}

/// Whether `mine` holds on any rank (every rank gets the same answer).
fn any_rank(comm: &Communicator, mine: bool) -> Result<bool> {
    let mut v = [if mine { 1f64 } else { 0.0 }];
    comm.all_reduce(&mut v, ReduceOp::Sum)?;
    Ok(v[0] > 0.0)
}

/// Writes JSON atomically (temp file, fsync, rename).
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(format!("renaming {} to {}", tmp.display(), path.display()), e))
}
