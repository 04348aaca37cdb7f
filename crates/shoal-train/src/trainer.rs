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
//!   (the order backward produces them) into buckets of `bucket_bytes` (the
//!   first one `first_bucket_bytes`); each full bucket's all-reduce starts at
//!   once, on the communicator's worker thread. With a hand-written backward
//!   ([`Trainer::backward_with`]) the gradients are written straight into the
//!   buckets as each layer finishes, so communication overlaps the backward
//!   pass of the earlier layers. With `overlap` off, the buckets are reduced
//!   on the calling thread in `step` instead: when the compute threads already
//!   fill every core, a communicator thread running beside them only slows
//!   the computation it was meant to hide behind;
//! - `step` waits for the buckets, clips, and applies the same update on every rank.

use std::time::Instant;

use candle_core::Tensor;
use shoal_comm::{Communicator, Pending, ReduceOp};

use crate::error::{Error, Result};
use crate::kernels::with_slice;
use crate::optim::{OptimConfig, Optimizer, clip_grad_norm, clip_grad_norm_slices};
use crate::params::Params;

/// How a [`Trainer`] trains.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    pub optimizer: OptimConfig,
    /// Gradient bucket size for the all-reduce (default 25 MiB).
    pub bucket_bytes: usize,
    /// Size of the first bucket (default 1 MiB, at most `bucket_bytes`): the
    /// last layers' gradients start their all-reduce early in backward.
    pub first_bucket_bytes: usize,
    /// Clip the global gradient norm to this value.
    pub clip_grad_norm: Option<f64>,
    /// All-reduce each bucket on the communicator's thread as soon as it is
    /// full (default), or all of them on the calling thread in `step`.
    pub overlap: bool,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            optimizer: OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
            bucket_bytes: 25 << 20,
            first_bucket_bytes: 1 << 20,
            clip_grad_norm: None,
            overlap: true,
        }
    }
}

/// Time spent in one [`Trainer::step`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTimes {
    /// Gradient all-reduces: waiting for those that had not finished during
    /// backward, or running them all when `overlap` is off.
    pub comm_s: f64,
    /// Clipping and the optimizer update.
    pub optimizer_s: f64,
    /// Global gradient norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
    /// The scalars given to [`Trainer::attach_scalars`], summed over ranks.
    pub scalars: Vec<f32>,
}

enum Bucket {
    /// Being all-reduced on the communicator's thread.
    Pending(Pending<Vec<f32>>),
    /// Final (nothing to reduce).
    Ready(Vec<f32>),
    /// To all-reduce on the calling thread in `step`.
    Deferred(Vec<f32>),
}

/// Where a backward pass puts its gradients: one buffer per parameter, handed
/// out in reverse parameter order (the order backward produces them). Each
/// buffer is zeroed and as long as its parameter; once `fill` returns, the
/// trainer owns it, and a full gradient bucket starts its all-reduce at once,
/// while the backward pass goes on with earlier layers.
pub trait GradSink {
    /// Gives `fill` the gradient buffer of parameter `index`. Indices must
    /// strictly decrease from one call to the next; a parameter left out has a
    /// zero gradient.
    fn put(&mut self, index: usize, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()>;

    /// Like [`Trainer::attach_scalars`], for values only known once the
    /// backward pass has run (the micro-batch's loss); the last call wins.
    fn attach_scalars(&mut self, values: &[f32]);
}

/// Data-parallel trainer over a set of parameters.
pub struct Trainer {
    params: Params,
    comm: Option<Communicator>,
    opt: Optimizer,
    cfg: TrainerConfig,
    /// Flat offset of each parameter (parameter order).
    offsets: Vec<usize>,
    /// Gradients accumulated over earlier micro-batches, flat in parameter order.
    acc: Option<Vec<f32>>,
    /// Buckets of the current step, each with the parameter indices it holds (reverse order).
    buckets: Vec<(Vec<usize>, Bucket)>,
    /// Gradients kept as tensors when there is nothing to reduce.
    direct: Option<Vec<Tensor>>,
    /// Scalars to sum over ranks with this step's last gradient bucket.
    scalars: Vec<f32>,
    /// Bucket buffers of the last step, reused by the next (no allocation, no page faults).
    spare: Vec<Vec<f32>>,
}

/// The [`GradSink`] of one micro-batch: accumulates (`acc`) or fills buckets.
struct Collector<'a> {
    vars: &'a [(String, candle_core::Var)],
    offsets: &'a [usize],
    /// Next index allowed (every index below it, and it, may still come).
    next: Option<usize>,
    /// Scalars that ride in the last bucket.
    scalars: Vec<f32>,
    mode: Mode<'a>,
}

enum Mode<'a> {
    /// Not the last micro-batch: add into the accumulator.
    Accumulate { acc: &'a mut Vec<f32>, tmp: Vec<f32> },
    /// The last micro-batch: bucket, add what earlier micro-batches accumulated, launch.
    Reduce {
        comm: Option<Communicator>,
        overlap: bool,
        acc: Option<Vec<f32>>,
        cur: Vec<f32>,
        members: Vec<usize>,
        limit: usize,
        bucket_bytes: usize,
        buckets: &'a mut Vec<(Vec<usize>, Bucket)>,
        spare: &'a mut Vec<Vec<f32>>,
    },
}

impl Collector<'_> {
    fn zero_down_to(&mut self, stop: Option<usize>) -> Result<()> {
        // Parameters between the last one put and `stop` got no gradient: zeros.
        while let Some(i) = self.next {
            if stop.is_some_and(|s| i <= s) {
                break;
            }
            self.put_inner(i, &mut |_| Ok(()))?;
        }
        Ok(())
    }

    fn put_inner(&mut self, index: usize, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()> {
        let n = self.vars[index].1.elem_count();
        let off = self.offsets[index];
        self.next = index.checked_sub(1);
        match &mut self.mode {
            Mode::Accumulate { acc, tmp } => {
                tmp.clear();
                tmp.resize(n, 0.0);
                fill(tmp)?;
                for (a, x) in acc[off..off + n].iter_mut().zip(tmp.iter()) {
                    *a += *x;
                }
            }
            Mode::Reduce { comm, overlap, acc, cur, members, limit, bucket_bytes, buckets, spare } => {
                let start = cur.len();
                cur.resize(start + n, 0.0);
                fill(&mut cur[start..])?;
                if let Some(acc) = acc {
                    for (x, a) in cur[start..].iter_mut().zip(&acc[off..off + n]) {
                        *x += *a;
                    }
                }
                members.push(index);
                if cur.len() >= *limit {
                    let data = std::mem::replace(cur, spare.pop().unwrap_or_default());
                    launch(comm.as_ref(), *overlap, data, std::mem::take(members), buckets);
                    *limit = (*bucket_bytes / 4).max(1);
                }
            }
        }
        Ok(())
    }

    /// Zero-fills what was left out and launches the last bucket with the scalars.
    fn finish(mut self) -> Result<()> {
        self.zero_down_to(None)?;
        if let Mode::Reduce { comm, overlap, mut cur, members, buckets, .. } = self.mode {
            cur.extend_from_slice(&self.scalars);
            if !members.is_empty() || !self.scalars.is_empty() {
                launch(comm.as_ref(), overlap, cur, members, buckets);
            }
        }
        Ok(())
    }
}

impl GradSink for Collector<'_> {
    fn put(&mut self, index: usize, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()> {
        if index >= self.vars.len() || self.next.is_none_or(|n| index > n) {
            return Err(Error::InvalidArgument(format!(
                "gradient of parameter {index} given out of order (parameters must come in reverse order, each once)"
            )));
        }
        self.zero_down_to(Some(index))?;
        self.put_inner(index, fill)
    }

    fn attach_scalars(&mut self, values: &[f32]) {
        self.scalars.clear();
        self.scalars.extend_from_slice(values);
    }
}

fn launch(
    comm: Option<&Communicator>,
    overlap: bool,
    data: Vec<f32>,
    members: Vec<usize>,
    buckets: &mut Vec<(Vec<usize>, Bucket)>,
) {
    let b = match comm {
        Some(c) if overlap => Bucket::Pending(c.all_reduce_async(data, ReduceOp::Sum)),
        Some(_) => Bucket::Deferred(data),
        None => Bucket::Ready(data),
    };
    buckets.push((members, b));
}

/// Whether overlapping the gradient all-reduce with backward can pay on this
/// host (the rule behind `overlap = "auto"`): only if every rank here has a
/// core for its communicator thread beside its compute threads
/// (`local ranks × (threads + 1) ≤ cores`). Otherwise the communicator's
/// thread runs on a core a computation needs, and reducing after backward is
/// faster.
pub fn overlap_pays(comm: &Communicator) -> bool {
    let me = comm.hosts().get(comm.rank());
    let local = comm.hosts().iter().filter(|h| Some(*h) == me).count();
    let threads = candle_core::utils::get_num_threads();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    core_free_per_rank(local, threads, cores)
}

/// `local` ranks of `threads` compute threads each leave every rank a core
/// for one more thread among `cores`.
fn core_free_per_rank(local: usize, threads: usize, cores: usize) -> bool {
    local.max(1).saturating_mul(threads.max(1).saturating_add(1)) <= cores
}

/// Copies a tensor's values into `out`, which must be exactly as long.
fn copy_f32(out: &mut [f32], t: &Tensor) -> Result<()> {
    let t = t.contiguous()?;
    let n = with_slice(&t, |s| {
        let n = s.len().min(out.len());
        out[..n].copy_from_slice(&s[..n]);
        s.len()
    })?;
    if n != out.len() {
        return Err(Error::InvalidArgument(format!("gradient has {n} values, its parameter {}", out.len())));
    }
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
        let offsets = params
            .vars()
            .iter()
            .scan(0usize, |off, (_, v)| {
                let o = *off;
                *off += v.elem_count();
                Some(o)
            })
            .collect();
        Ok(Trainer {
            params,
            comm,
            opt,
            cfg,
            offsets,
            acc: None,
            buckets: Vec::new(),
            direct: None,
            scalars: Vec::new(),
            spare: Vec::new(),
        })
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
        let reduce = self.comm.as_ref().is_some_and(|c| c.size() > 1);
        if last && !reduce && self.acc.is_none() {
            // One worker, one micro-batch: nothing to reduce, keep the tensors.
            let direct = self
                .params
                .vars()
                .iter()
                .map(|(_, v)| match grads.as_ref().and_then(|g| g.get(v.as_tensor())) {
                    Some(g) => Ok(g.detach().contiguous()?),
                    None => Ok(v.as_tensor().zeros_like()?),
                })
                .collect::<Result<Vec<_>>>()?;
            self.direct = Some(direct);
            return Ok(());
        }
        // Handles to the gradients (no copies), so the sink can borrow the trainer.
        let per_param: Vec<Option<Tensor>> = match &grads {
            Some(g) => self.params.vars().iter().map(|(_, v)| g.get(v.as_tensor()).cloned()).collect(),
            None => Vec::new(),
        };
        drop(grads);
        self.backward_with(last, |sink| {
            for (i, g) in per_param.iter().enumerate().rev() {
                if let Some(g) = g {
                    sink.put(i, &mut |out| copy_f32(out, g))?;
                }
            }
            Ok(())
        })
    }

    /// Runs a hand-written backward pass `f`, which puts each parameter's
    /// gradient (already weighted like [`Self::backward`]'s loss) into the
    /// sink in reverse parameter order. With `last`, full buckets start their
    /// all-reduce while `f` is still computing the earlier layers.
    pub fn backward_with(&mut self, last: bool, f: impl FnOnce(&mut dyn GradSink) -> Result<()>) -> Result<()> {
        let n = self.params.vars().len();
        let total = self.params.count();
        if !last {
            let acc = self.acc.get_or_insert_with(|| vec![0.0; total]);
            let mut c = Collector {
                vars: self.params.vars(),
                offsets: &self.offsets,
                next: n.checked_sub(1),
                scalars: Vec::new(),
                mode: Mode::Accumulate { acc, tmp: Vec::new() },
            };
            f(&mut c)?;
            return c.finish();
        }
        let comm = self.comm.clone().filter(|c| c.size() > 1);
        let bucket_bytes = self.cfg.bucket_bytes;
        // The first bucket is small, so communication starts early in backward (as in PyTorch's DDP);
        // without overlap there is nothing to start early.
        let first = if self.cfg.overlap { self.cfg.first_bucket_bytes.min(bucket_bytes) } else { bucket_bytes };
        let limit = (first / 4).max(1);
        let cur = self.spare.pop().unwrap_or_default();
        let mut c = Collector {
            vars: self.params.vars(),
            offsets: &self.offsets,
            next: n.checked_sub(1),
            scalars: std::mem::take(&mut self.scalars),
            mode: Mode::Reduce {
                comm,
                overlap: self.cfg.overlap,
                acc: self.acc.take(),
                cur,
                members: Vec::new(),
                limit,
                bucket_bytes,
                buckets: &mut self.buckets,
                spare: &mut self.spare,
            },
        };
        f(&mut c)?;
        // The scalars ride in the last bucket; `step` takes them back out of it.
        c.finish()
    }

    /// Waits for the gradient all-reduces, clips, and applies the optimizer with `lr`.
    pub fn step(&mut self, lr: f64) -> Result<StepTimes> {
        let t0 = Instant::now();
        if let Some(mut grads) = self.direct.take() {
            let grad_norm = match self.cfg.clip_grad_norm {
                Some(max) => Some(clip_grad_norm(&mut grads, max)?),
                None => None,
            };
            self.opt.step(&self.params, &grads, lr)?;
            let scalars = std::mem::take(&mut self.scalars);
            return Ok(StepTimes { comm_s: 0.0, optimizer_s: t0.elapsed().as_secs_f64(), grad_norm, scalars });
        }
        let vars = self.params.vars();
        let mut datas: Vec<(Vec<usize>, Vec<f32>)> = Vec::with_capacity(self.buckets.len());
        for (members, b) in self.buckets.drain(..) {
            let data = match b {
                Bucket::Pending(p) => p.wait()?,
                Bucket::Ready(d) => d,
                Bucket::Deferred(mut d) => {
                    if let Some(c) = &self.comm {
                        c.all_reduce(&mut d, ReduceOp::Sum)?;
                    }
                    d
                }
            };
            datas.push((members, data));
        }
        let comm_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut grads: Vec<Option<&mut [f32]>> = (0..vars.len()).map(|_| None).collect();
        let mut scalars = Vec::new();
        let last = datas.len().saturating_sub(1);
        for (k, (members, data)) in datas.iter_mut().enumerate() {
            let mut rest: &mut [f32] = data;
            for &i in members.iter() {
                let (name, var) = &vars[i];
                let n = var.elem_count();
                if rest.len() < n {
                    return Err(Error::InvalidArgument(format!("gradient bucket too short for {name}")));
                }
                let (part, tail) = rest.split_at_mut(n);
                grads[i] = Some(part);
                rest = tail;
            }
            if k == last {
                scalars = rest.to_vec();
            }
        }
        let mut grads: Vec<&mut [f32]> = grads
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                g.ok_or_else(|| {
                    Error::InvalidArgument(format!("no gradient for {} (backward with last=true missing?)", vars[i].0))
                })
            })
            .collect::<Result<_>>()?;
        let grad_norm = self.cfg.clip_grad_norm.map(|max| clip_grad_norm_slices(&mut grads, max));
        let grads: Vec<&[f32]> = grads.into_iter().map(|g| &*g).collect();
        self.opt.step_slices(&self.params, &grads, lr)?;
        for (_, mut data) in datas {
            data.clear();
            self.spare.push(data);
        }
        Ok(StepTimes { comm_s, optimizer_s: t1.elapsed().as_secs_f64(), grad_norm, scalars })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_needs_a_spare_core_for_every_local_rank() {
        // 2 one-thread workers on 2 cores: the communicator threads would share the computing cores.
        assert!(!core_free_per_rank(2, 1, 2));
        // The same workers on 4 cores: each has a core for its communicator thread.
        assert!(core_free_per_rank(2, 1, 4));
        // One worker whose compute threads take every core (candle's default).
        assert!(!core_free_per_rank(1, 8, 8));
        assert!(core_free_per_rank(1, 7, 8));
        // Unknown counts read as 1; absurd ones do not overflow.
        assert!(core_free_per_rank(0, 0, 2));
        assert!(!core_free_per_rank(usize::MAX, usize::MAX, 64));
    }
}
