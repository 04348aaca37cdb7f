//! The [`Trainer`]: data-parallel training of any candle model with no
//! distributed code in the model. Give it the model's [`Params`] and a
//! communicator; call [`Trainer::backward`] on each micro-batch's loss and
//! [`Trainer::step`] once per global batch.
//!
//! DDP, as the trainer does it:
//! - at construction, rank 0's parameters are broadcast, so every rank starts equal;
//! - each rank's loss is weighted by its share of the global batch
//!   (`local samples / global samples`), so summing gradients across ranks gives
//!   exactly the gradient of the global-batch mean loss, whatever the shares;
//! - on the last micro-batch, gradients are flattened in reverse parameter order
//!   (the order backward produces them in frameworks with hooks) into buckets of
//!   `bucket_bytes`; each full bucket's all-reduce starts at once, on the
//!   communicator's worker thread, while the next bucket is being flattened;
//! - `step` waits for the buckets, clips, and applies the same update on every rank.

use std::time::Instant;

use candle_core::{Device, Tensor};
use shoal_comm::{Communicator, Pending, ReduceOp};

use crate::error::{Error, Result};
use crate::optim::{OptimConfig, Optimizer, clip_grad_norm};
use crate::params::Params;

/// How a [`Trainer`] trains.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    pub optimizer: OptimConfig,
    /// Gradient bucket size for the all-reduce (default 25 MiB).
    pub bucket_bytes: usize,
    /// Clip the global gradient norm to this value.
    pub clip_grad_norm: Option<f64>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            optimizer: OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
            bucket_bytes: 25 << 20,
            clip_grad_norm: None,
        }
    }
}

/// Time spent in one [`Trainer::step`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTimes {
    /// Waiting for gradient all-reduces that had not finished during backward.
    pub comm_s: f64,
    /// Clipping and the optimizer update.
    pub optimizer_s: f64,
    /// Global gradient norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
    /// The scalars given to [`Trainer::attach_scalars`], summed over ranks.
    pub scalars: Vec<f32>,
}

enum Bucket {
    Pending(Pending<Vec<f32>>),
    Ready(Vec<f32>),
}

/// Data-parallel trainer over a set of parameters.
pub struct Trainer {
    params: Params,
    comm: Option<Communicator>,
    opt: Optimizer,
    cfg: TrainerConfig,
    /// Gradients accumulated over earlier micro-batches, flat in parameter order.
    acc: Option<Vec<f32>>,
    /// Buckets of the current step, each with the parameter indices it holds (reverse order).
    buckets: Vec<(Vec<usize>, Bucket)>,
    /// Gradients kept as tensors when there is nothing to reduce.
    direct: Option<Vec<Tensor>>,
    /// Scalars to sum over ranks with this step's last gradient bucket.
    scalars: Vec<f32>,
}

/// Appends a tensor's values to `out` with one copy (straight from its storage
/// when it is a contiguous f32 CPU tensor).
fn append_f32(out: &mut Vec<f32>, t: &Tensor) -> Result<()> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    if let (candle_core::Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets())
        && let Ok(s) = cpu.as_slice::<f32>()
    {
        out.extend_from_slice(&s[a..b]);
        return Ok(());
    }
    drop(storage);
    out.extend(t.flatten_all()?.to_vec1::<f32>()?);
    Ok(())
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer").field("params", &self.params.count()).field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

impl Trainer {
    /// Builds the trainer; with a communicator, rank 0's parameters are
    /// broadcast first so every rank starts from the same model.
    pub fn new(params: Params, comm: Option<Communicator>, cfg: TrainerConfig) -> Result<Trainer> {
        if let Some(c) = comm.as_ref().filter(|c| c.size() > 1) {
            let mut flat = params.flatten()?;
            c.broadcast(&mut flat, 0)?;
            params.load_flat(&flat)?;
        }
        let opt = Optimizer::new(cfg.optimizer, &params);
        Ok(Trainer { params, comm, opt, cfg, acc: None, buckets: Vec::new(), direct: None, scalars: Vec::new() })
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    pub fn optimizer(&self) -> &Optimizer {
        &self.opt
    }

    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.opt
    }

    pub fn comm(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }

    /// Sums `values` over ranks along with this step's gradients (they ride in
    /// the last bucket, so reporting e.g. the global loss costs no extra
    /// collective); [`StepTimes::scalars`] gives them back. Call before the
    /// `last` backward of the step.
    pub fn attach_scalars(&mut self, values: &[f32]) {
        self.scalars.clear();
        self.scalars.extend_from_slice(values);
    }

    /// Back-propagates `loss` (already weighted by this rank's share of the
    /// global batch; `None` when this rank's share is empty, which contributes
    /// zeros but still takes part). With `last`, the accumulated gradients are
    /// flattened into buckets whose all-reduces start as each bucket fills.
    pub fn backward(&mut self, loss: Option<&Tensor>, last: bool) -> Result<()> {
        let grads = loss.map(Tensor::backward).transpose()?;
        let vars = self.params.vars();
        let grad_of = |i: usize| -> Result<Vec<f32>> {
            let (_, var) = &vars[i];
            match grads.as_ref().and_then(|g| g.get(var.as_tensor())) {
                Some(g) => Ok(g.flatten_all()?.to_vec1::<f32>()?),
                None => Ok(vec![0.0; var.elem_count()]),
            }
        };
        let offsets: Vec<usize> = vars
            .iter()
            .scan(0usize, |off, (_, v)| {
                let o = *off;
                *off += v.elem_count();
                Some(o)
            })
            .collect();
        if !last {
            let acc = self.acc.get_or_insert_with(|| vec![0.0; self.params.count()]);
            for i in 0..vars.len() {
                let g = grad_of(i)?;
                for (a, x) in acc[offsets[i]..offsets[i] + g.len()].iter_mut().zip(&g) {
                    *a += *x;
                }
            }
            return Ok(());
        }
        let acc = self.acc.take();
        let comm = self.comm.clone().filter(|c| c.size() > 1);
        if comm.is_none() && acc.is_none() {
            // One worker, one micro-batch: nothing to reduce, keep the tensors.
            let direct = vars
                .iter()
                .map(|(_, v)| match grads.as_ref().and_then(|g| g.get(v.as_tensor())) {
                    Some(g) => Ok(g.detach().contiguous()?),
                    None => Ok(v.as_tensor().zeros_like()?),
                })
                .collect::<Result<Vec<_>>>()?;
            self.direct = Some(direct);
            return Ok(());
        }
        let per_bucket = (self.cfg.bucket_bytes / 4).max(1);
        let mut cur: Vec<f32> = Vec::new();
        let mut members: Vec<usize> = Vec::new();
        let launch = |cur: &mut Vec<f32>, members: &mut Vec<usize>, buckets: &mut Vec<(Vec<usize>, Bucket)>| {
            let data = std::mem::take(cur);
            let m = std::mem::take(members);
            let b = match &comm {
                Some(c) => Bucket::Pending(c.all_reduce_async(data, ReduceOp::Sum)),
                None => Bucket::Ready(data),
            };
            buckets.push((m, b));
        };
        for i in (0..vars.len()).rev() {
            let start = cur.len();
            match grads.as_ref().and_then(|g| g.get(vars[i].1.as_tensor())) {
                Some(g) => append_f32(&mut cur, g)?,
                None => cur.resize(start + vars[i].1.elem_count(), 0.0),
            }
            if let Some(acc) = &acc {
                for (x, a) in cur[start..].iter_mut().zip(&acc[offsets[i]..]) {
                    *x += *a;
                }
            }
            members.push(i);
            if cur.len() >= per_bucket {
                launch(&mut cur, &mut members, &mut self.buckets);
            }
        }
        cur.extend_from_slice(&self.scalars);
        if !members.is_empty() || !self.scalars.is_empty() {
            launch(&mut cur, &mut members, &mut self.buckets);
        }
        Ok(())
    }

    /// Waits for the gradient all-reduces, clips, and applies the optimizer with `lr`.
    pub fn step(&mut self, lr: f64) -> Result<StepTimes> {
        let t0 = Instant::now();
        let vars = self.params.vars();
        if let Some(mut grads) = self.direct.take() {
            let grad_norm = match self.cfg.clip_grad_norm {
                Some(max) => Some(clip_grad_norm(&mut grads, max)?),
                None => None,
            };
            self.opt.step(&self.params, &grads, lr)?;
            let scalars = std::mem::take(&mut self.scalars);
            return Ok(StepTimes { comm_s: 0.0, optimizer_s: t0.elapsed().as_secs_f64(), grad_norm, scalars });
        }
        let mut grads: Vec<Option<Tensor>> = vec![None; vars.len()];
        let mut scalars = Vec::new();
        let last = self.buckets.len().saturating_sub(1);
        for (k, (members, b)) in self.buckets.drain(..).enumerate() {
            let data = match b {
                Bucket::Pending(p) => p.wait()?,
                Bucket::Ready(d) => d,
            };
            let mut off = 0;
            for i in members {
                let (name, var) = &vars[i];
                let n = var.elem_count();
                let part = data
                    .get(off..off + n)
                    .ok_or_else(|| Error::InvalidArgument(format!("gradient bucket too short for {name}")))?;
                grads[i] = Some(Tensor::from_slice(part, var.shape(), &Device::Cpu)?);
                off += n;
            }
            if k == last {
                scalars = data.get(off..).unwrap_or_default().to_vec();
            }
        }
        self.scalars.clear();
        let comm_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut grads: Vec<Tensor> = grads
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                g.ok_or_else(|| {
                    Error::InvalidArgument(format!("no gradient for {} (backward with last=true missing?)", vars[i].0))
                })
            })
            .collect::<Result<_>>()?;
        let grad_norm = match self.cfg.clip_grad_norm {
            Some(max) => Some(clip_grad_norm(&mut grads, max)?),
            None => None,
        };
        self.opt.step(&self.params, &grads, lr)?;
        Ok(StepTimes { comm_s, optimizer_s: t1.elapsed().as_secs_f64(), grad_norm, scalars })
    }
}
