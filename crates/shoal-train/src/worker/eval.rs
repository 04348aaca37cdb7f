//! Evaluation: the mean loss and accuracy over the eval set (sharded across ranks), its line in `eval.jsonl`, and
//! for text the unigram baseline a language model must beat.

use crate::Real;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use shoal_comm::{Communicator, ReduceOp};
use shoal_data::Dataset;

use super::wire::EvalMetrics;
use crate::batch::to_tensors;
use crate::error::{Error, Result};
use crate::models::Model;
use crate::trainer::Trainer;

/// Loss (mean over rows) and correct predictions of one batch.
fn loss_and_correct(model: &dyn Model, input: &Tensor, target: &Tensor) -> Result<(Tensor, usize)> {
    let logits = model.forward(input)?;
    let loss = model.loss(&logits, target)?;
    let correct = model.correct(&logits, target)? as usize;
    Ok((loss, correct))
}

/// Mean loss and accuracy over the eval set (sharded across ranks, summed with an all-reduce). With the model's
/// layers gathered one by one (ZeRO-3) every rank runs as many forward passes as the rank with the most batches,
/// the ones it has no batch for without computing, so the layers' gathers stay in step. Under a pipeline every
/// stage goes through every batch ([`evaluate_stages`]).
pub(super) fn evaluate(
    model: &dyn Model,
    trainer: &Trainer,
    data: &dyn Dataset,
    comm: &Communicator,
    batch: usize,
    max_batches: usize,
) -> Result<(f64, f64)> {
    if trainer.splits_model() {
        return evaluate_stages(model, trainer, data, comm, batch, max_batches);
    }
    let layers = trainer.params().layers();
    let _inference = layers.inference();
    let n = data.len().min(batch * max_batches.max(1));
    // The ranks of a tensor-parallel group compute the same batches together; one of them counts them.
    let group = trainer.tensor_degree().max(1);
    let share = shoal_comm::chunk::segment(n, comm.size() / group, comm.rank() / group);
    let counts = comm.rank().is_multiple_of(group);
    let (mut loss_sum, mut correct, mut rows, mut tokens) = (0f64, 0f64, 0f64, 0f64);
    let mut passes = 0usize;
    let mut i = share.start;
    while i < share.end {
        let end = (i + batch).min(share.end);
        let samples = (i..end).map(|j| data.get(j)).collect::<shoal_data::Result<Vec<_>>>()?;
        if let Some(t) = to_tensors(&samples)? {
            let (loss, c) = loss_and_correct(model, &t.input, &t.target)?;
            passes += 1;
            let targets = t.target.elem_count() as f64;
            loss_sum += loss.to_scalar::<Real>()? as f64 * targets;
            correct += c as f64;
            tokens += targets;
            rows += t.rows as f64;
        }
        i = end;
    }
    if layers.is_sharded() {
        let mut most = [passes as f64];
        comm.all_reduce(&mut most, ReduceOp::Max)?;
        for _ in passes..most[0] as usize {
            layers.idle_forward()?;
        }
    }
    let mut v = if counts { [loss_sum, correct, tokens, rows] } else { [0.0; 4] };
    comm.all_reduce(&mut v, ReduceOp::Sum)?;
    let [loss_sum, correct, tokens, _] = v;
    Ok((loss_sum / tokens.max(1.0), correct / tokens.max(1.0)))
}

/// [`evaluate`] through a pipeline: every stage takes every batch through its layers (the activations sent on), the
/// last stage scores them, and the sums are shared with an all-reduce.
fn evaluate_stages(
    model: &dyn Model,
    trainer: &Trainer,
    data: &dyn Dataset,
    comm: &Communicator,
    batch: usize,
    max_batches: usize,
) -> Result<(f64, f64)> {
    let n = data.len().min(batch * max_batches.max(1));
    let (mut loss_sum, mut correct, mut tokens) = (0f64, 0f64, 0f64);
    let mut i = 0;
    while i < n {
        let end = (i + batch.max(1)).min(n);
        let samples = (i..end).map(|j| data.get(j)).collect::<shoal_data::Result<Vec<_>>>()?;
        if let Some(t) = to_tensors(&samples)? {
            let logits = trainer.forward_stage(|| Ok(model.forward(&t.input)?))?;
            if let Some(logits) = logits {
                let loss = model.loss(&logits, &t.target)?;
                let c = model.correct(&logits, &t.target)? as Real;
                let targets = t.target.elem_count() as f64;
                loss_sum += loss.to_scalar::<Real>()? as f64 * targets;
                correct += f64::from(c);
                tokens += targets;
            }
        }
        i = end;
    }
    let mut v = [loss_sum, correct, tokens];
    comm.all_reduce(&mut v, ReduceOp::Sum)?;
    let [loss_sum, correct, tokens] = v;
    Ok((loss_sum / tokens.max(1.0), correct / tokens.max(1.0)))
}

/// Cross-entropy on `eval` of the add-one-smoothed unigram distribution of `train`'s target tokens.
pub fn unigram_baseline(train: &dyn Dataset, eval: &dyn Dataset, vocab: usize) -> Result<f64> {
    let mut counts = vec![1f64; vocab.max(1)];
    for i in 0..train.len() {
        if let shoal_data::Label::Tokens(ys) = train.get(i)?.label {
            for y in ys {
                if let Some(c) = counts.get_mut(y as usize) {
                    *c += 1.0;
                }
            }
        }
    }
    let total: f64 = counts.iter().sum();
    let (mut nll, mut n) = (0f64, 0f64);
    for i in 0..eval.len() {
        if let shoal_data::Label::Tokens(ys) = eval.get(i)?.label {
            for y in ys {
                nll -= (counts.get(y as usize).copied().unwrap_or(1.0) / total).ln();
                n += 1.0;
            }
        }
    }
    Ok(nll / n.max(1.0))
}

/// `eval.jsonl` in the output directory: rank 0 appends a line for each evaluation pass.
#[derive(Debug)]
pub(super) struct EvalLog {
    path: PathBuf,
    rank: usize,
    /// A language model: its line has the perplexity, not the accuracy.
    text_model: bool,
}

impl EvalLog {
    pub(super) fn new(output: &Path, rank: usize, text_model: bool) -> Self {
        Self { path: output.join("eval.jsonl"), rank, text_model }
    }

    /// The file.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Appends the line of one evaluation pass (on rank 0; the other ranks write nothing).
    pub(super) fn log(&self, step: usize, loss: f64, acc: f64) -> Result<()> {
        if self.rank != 0 {
            return Ok(());
        }
        let text_model = self.text_model;
        let e = EvalMetrics {
            step,
            eval_loss: loss,
            eval_accuracy: (!text_model).then_some(acc),
            eval_perplexity: text_model.then(|| loss.exp()),
        };
        let line = serde_json::to_string(&e).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(|e| Error::io(format!("opening {}", self.path.display()), e))?;
        writeln!(f, "{line}").map_err(|e| Error::io("writing eval.jsonl", e))
    }
}
