//! ZeRO stages 1, 2 and 3: the optimizer state (stage 1), the gradients too (stage 2), and the parameters too
//! (stage 3), sharded over the ranks.
//!
//! - At [`Strategy::init`], rank 0's parameters are broadcast (as DDP) and the flat parameter space (every parameter
//!   in order) is cut into buckets — one over everything for stage 1; for stage 2 about `bucket_bytes` each, from the
//!   last parameters down (the order backward produces gradients); for stage 3 one per layer of the model — and each
//!   bucket into one equal slice per rank (padded): a rank's shard is its slice of every bucket (`super::shards`).
//! - Stage 1: each micro-batch's gradients are added into one flat buffer (weighted by the rank's share of the
//!   global batch, as for DDP), reduce-scattered in [`Strategy::step`]. Stages 2 and 3: they go into one bucket
//!   buffer, reduce-scattered as soon as backward has passed the bucket and added into the rank's shard of
//!   gradients, so the whole gradient is never held (at the price of one reduce-scatter per micro-batch with
//!   gradient accumulation).
//! - Either way each rank ends with the summed gradient of its shard only; the
//!   global norm for clipping is one all-reduce of the shards' sums of squares; each rank applies the optimizer to
//!   its shard with the moments of its shard only (`1/N` of the optimizer state per rank; the formula is
//!   [`crate::optim::update`], the one every strategy uses). Stages 1 and 2: an all-gather of the updated shards
//!   gives every rank the whole new parameters. Stage 3: the rank keeps only its shard of the parameters
//!   (`super::zero3`); the model's tensors hold nothing between steps, and each layer is gathered just before the
//!   model uses it in forward and again in backward, and freed after (`crate::layers`), the next layer's gather
//!   overlapping the current layer's computation when `prefetch` is on.
//! - The moments (and, for stage 3, the parameters) are gathered into whole named tensors (`<param>.m`, `<param>.v`,
//!   as the optimizer names them) for a checkpoint ([`Strategy::optimizer_state`], [`Strategy::model_state`],
//!   collectives), and cut to the shard again when one is loaded ([`Strategy::load_optimizer_state`]; stage 3 takes
//!   its shard of the parameters the checkpoint put in the model before `init`): its checkpoints are DDP's,
//!   resumable under any strategy and world size.

use crate::{REAL_BYTES, Real};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use shoal_comm::{Communicator, CompressConfig, Compressor, ReduceOp};

use super::shards::Shards;
use super::zero3::LayerShards;
use super::{GradSink, StepTimes, Strategy, TensorGrads, broadcast_from_rank0, check_order, put_tensors};
use crate::error::{Error, Result};
use crate::layers::LayerStore;
use crate::optim::{OptimConfig, Optimizer, sum_sq, update};
use crate::params::Params;

/// ZeRO stage 1, 2 or 3 (see the module documentation).
pub struct Zero {
    comm: Option<Communicator>,
    stage: u8,
    /// Bytes of gradient per bucket (stage 2).
    bucket_bytes: usize,
    /// Stage 3: gather the next layer while the current one computes.
    prefetch: bool,
    /// The cut of the flat space into buckets and shards (from `init`).
    shards: Arc<Shards>,
    /// Stage 3: this rank's shard of the parameters, and the store that gathers the model's layers from it.
    layers: Option<Arc<LayerShards>>,
    /// Stage 1: this step's gradients, flat. Stages 2 and 3: one bucket being filled.
    acc: Vec<Real>,
    /// Stages 2 and 3: this rank's summed gradients, accumulated bucket by bucket over the step's micro-batches.
    grad: Vec<Real>,
    /// The step's scalars (summed over ranks in `step`).
    scalars: Vec<Real>,
    /// The optimizer's state for this rank's shard: SGD's momentum or AdamW's first moment, AdamW's second.
    m: Vec<Real>,
    v: Vec<Real>,
    /// Whether the moments hold anything yet (SGD's first momentum is the gradient itself).
    started: bool,
    /// A parameter's gradient as the model writes it, reused from one call to the next.
    tmp: Vec<Real>,
    /// This rank's reduced slice of a bucket (reused).
    mine: Vec<Real>,
    /// `[compression]`: each bucket's reduce-scatter through it.
    compress: Option<Compressor>,
}

/// ZeRO stage 1 over `comm`.
#[derive(Debug)]
pub struct Zero1;

impl Zero1 {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(comm: Option<Communicator>) -> Zero {
        Zero::new(comm, 1, usize::MAX)
    }
}

/// ZeRO stage 3 over `comm`: the parameters sharded too, gathered layer by layer (the model's layers, declared with
/// `Params::layer`), the next layer's gather overlapping the current layer's computation with `prefetch`.
#[derive(Debug)]
pub struct Zero3;

impl Zero3 {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(comm: Option<Communicator>, prefetch: bool) -> Zero {
        Zero { prefetch, ..Zero::new(comm, 3, usize::MAX) }
    }
}

impl std::fmt::Debug for Zero {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zero")
            .field("stage", &self.stage)
            .field("world", &self.shards.world())
            .field("shard", &self.shards.shard)
            .finish_non_exhaustive()
    }
}

impl Zero {
    /// Stage 1, 2 or 3 (stage 2 reduce-scatters each bucket of about `bucket_bytes` of gradients as it fills; stage 3
    /// each layer's, and gathers the layers with prefetch: see [`Zero3`]).
    pub fn new(comm: Option<Communicator>, stage: u8, bucket_bytes: usize) -> Zero {
        let shards = Arc::new(Shards::empty(comm.clone()));
        Zero {
            comm,
            stage,
            bucket_bytes,
            prefetch: true,
            shards,
            layers: None,
            acc: Vec::new(),
            grad: Vec::new(),
            scalars: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            started: false,
            tmp: Vec::new(),
            mine: Vec::new(),
            compress: None,
        }
    }

    /// Reduce-scatters bucket `b`'s gradients (`data`, its flat values) and adds this rank's slice into `out`.
    fn reduce_bucket(&mut self, b: usize, data: &[Real], out: &mut [Real]) -> Result<()> {
        self.shards.reduce_bucket(b, data, &mut self.mine, out, self.compress.as_mut())
    }

    /// The same, with each bucket's slices sent compressed as `cfg` says (`shoal_comm::compress`): any codec but
    /// PowerSGD, which needs whole matrices.
    pub fn with_compression(mut self, cfg: CompressConfig) -> Zero {
        self.compress = Some(Compressor::new(cfg));
        self
    }

    /// Whole named tensors, one per parameter, from a whole flat vector (`suffix`: appended to the names).
    fn named(&self, params: &Params, full: &[Real], suffix: &str) -> Result<Vec<(String, Tensor)>> {
        params
            .vars()
            .iter()
            .enumerate()
            .map(|(i, (name, var))| {
                let (off, n) = (self.shards.offsets[i], var.elem_count());
                let t = Tensor::from_vec(full[off..off + n].to_vec(), var.shape(), var.device())?;
                Ok((format!("{name}{suffix}"), t))
            })
            .collect()
    }
}

/// Adds each parameter's gradient into the flat buffer (stage 1), or into the current bucket, reduce-scattering
/// each bucket once backward has passed it (stages 2 and 3).
struct Adder<'a> {
    z: &'a mut Zero,
    vars: &'a [(String, candle_core::Var)],
    tmp: Vec<Real>,
    next: Option<usize>,
    /// Stages 2 and 3: the bucket being filled.
    bucket: usize,
}

impl Adder<'_> {
    /// Stages 2 and 3: reduce-scatters every bucket whose parameters all lie above `index` (all of them for `None`).
    fn flush_above(&mut self, index: Option<usize>) -> Result<()> {
        if self.z.stage < 2 {
            return Ok(());
        }
        let shards = self.z.shards.clone();
        while self.bucket < shards.buckets.len() && index.is_none_or(|i| i < shards.buckets[self.bucket].0.start) {
            let b = self.bucket;
            let flat = shards.buckets[b].1.clone();
            let data = std::mem::take(&mut self.z.acc);
            let mut grad = std::mem::take(&mut self.z.grad);
            let r = self.z.reduce_bucket(b, &data, &mut grad);
            self.z.grad = grad;
            self.z.acc = data;
            self.z.acc[..flat.len()].iter_mut().for_each(|x| *x = 0.0);
            r?;
            self.bucket += 1;
        }
        Ok(())
    }
}

impl GradSink for Adder<'_> {
    fn put(&mut self, index: usize, fill: &mut dyn FnMut(&mut [Real]) -> Result<()>) -> Result<()> {
        check_order(index, self.vars.len(), self.next)?;
        self.next = index.checked_sub(1);
        self.flush_above(Some(index))?;
        let n = self.vars[index].1.elem_count();
        // Offsets within the buffer: the whole flat space (stage 1, one bucket from 0), or the current bucket.
        let buckets = &self.z.shards.buckets;
        let off = self.z.shards.offsets[index] - buckets[self.bucket.min(buckets.len() - 1)].1.start;
        if self.z.stage >= 2 {
            // The bucket's values are zeros until this micro-batch's gradients go in (every bucket is reduced and
            // zeroed once backward has passed it): the model writes straight into it.
            return fill(&mut self.z.acc[off..off + n]);
        }
        // Stage 1 adds each micro-batch into what the step's earlier ones left.
        self.tmp.clear();
        self.tmp.resize(n, 0.0);
        fill(&mut self.tmp)?;
        for (a, x) in self.z.acc[off..off + n].iter_mut().zip(&self.tmp) {
            *a += *x;
        }
        Ok(())
    }

    fn attach_scalars(&mut self, values: &[Real]) {
        self.z.scalars.clear();
        self.z.scalars.extend_from_slice(values);
    }
}

impl Strategy for Zero {
    fn name(&self) -> &'static str {
        match self.stage {
            0 | 1 => "zero1",
            2 => "zero2",
            _ => "zero3",
        }
    }

    fn comm(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }

    fn init(&mut self, params: &Params) -> Result<()> {
        broadcast_from_rank0(self.comm.as_ref(), params)?;
        // Buckets from the last parameter down: one over everything for stage 1, the model's layers for stage 3.
        let buckets = match self.stage {
            0 | 1 => Shards::by_size(params, usize::MAX),
            2 => Shards::by_size(params, self.bucket_bytes),
            _ => params.layers().ranges(params.vars().len())?.into_iter().rev().map(|(_, r)| r).collect(),
        };
        self.shards = Arc::new(Shards::new(self.comm.clone(), params, buckets)?);
        // Stages 2 and 3 hold one bucket of gradients at a time, never the whole.
        // Each bucket padded with zeros to a slice per rank, so the reduce-scatter takes it as it is.
        self.acc = vec![0.0; self.shards.padded_max()];
        if self.stage >= 2 {
            self.grad = vec![0.0; self.shards.shard];
        }
        if self.stage >= 3 {
            // The rank keeps its shard; the model's tensors are emptied and filled layer by layer from now on.
            let store = Arc::new(LayerShards::new(self.shards.clone(), params, self.prefetch)?);
            params.layers().install(store.clone());
            self.layers = Some(store);
        }
        Ok(())
    }

    fn backward(
        &mut self,
        params: &Params,
        last: bool,
        scalars: Vec<Real>,
        f: &mut dyn FnMut(&mut dyn GradSink) -> Result<()>,
    ) -> Result<()> {
        let tmp = std::mem::take(&mut self.tmp);
        let mut sink = Adder { vars: params.vars(), tmp, next: params.vars().len().checked_sub(1), bucket: 0, z: self };
        let done = f(&mut sink).and_then(|()| sink.flush_above(None));
        let tmp = std::mem::take(&mut sink.tmp);
        self.tmp = tmp;
        done?;
        if last && !scalars.is_empty() {
            self.scalars = scalars;
        }
        Ok(())
    }

    fn backward_tensors(&mut self, params: &Params, last: bool, scalars: Vec<Real>, grads: TensorGrads) -> Result<()> {
        self.backward(params, last, scalars, &mut |sink| put_tensors(sink, &grads, None))
    }

    fn step(&mut self, params: &Params, opt: &mut Optimizer, lr: f64, clip: Option<f64>) -> Result<StepTimes> {
        let t0 = Instant::now();
        let comm = self.comm.clone().filter(|c| c.size() > 1);
        let shard = self.shards.shard;
        // This rank's summed gradient (stages 2 and 3: reduced bucket by bucket during backward), and the step's
        // scalars summed over ranks.
        let mut grad = if self.stage >= 2 {
            std::mem::replace(&mut self.grad, vec![0.0; shard])
        } else {
            let mut g = vec![0.0 as Real; shard];
            let acc = std::mem::take(&mut self.acc);
            for b in 0..self.shards.buckets.len() {
                self.reduce_bucket(b, &acc, &mut g)?;
            }
            self.acc = acc;
            self.acc.iter_mut().for_each(|x| *x = 0.0);
            g
        };
        let mut scalars = std::mem::take(&mut self.scalars);
        if let (Some(c), false) = (&comm, scalars.is_empty()) {
            c.all_reduce(&mut scalars, ReduceOp::Sum)?;
        }
        // Stage 3: nothing of the pass left in flight or whole before the shard changes.
        if let Some(store) = &self.layers {
            store.settle()?;
        }
        let comm_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut grad_norm = None;
        if let Some(max) = clip {
            let mut sq = [sum_sq(&grad)];
            if let Some(c) = &comm {
                c.all_reduce(&mut sq, ReduceOp::Sum)?;
            }
            let norm = sq[0].sqrt();
            if norm > max && norm > 0.0 {
                let s = (max / norm) as Real;
                grad.iter_mut().for_each(|x| *x *= s);
            }
            grad_norm = Some(norm);
        }
        // The shard's parameters (zeros in the padding), updated in place with the shard's moments.
        opt.t += 1;
        if let Some(z) = &mut self.compress {
            // Stages 2 and 3 reduce the next step's buckets during its backward: it counts from here.
            z.set_step(opt.t);
        }
        let (cfg, t, first) = (opt.config(), opt.t, !self.started);
        let (m, v) = (&mut self.m, &mut self.v);
        let mut apply = |p: &mut [Real]| -> Result<()> {
            Ok(match cfg {
                OptimConfig::Sgd { momentum: 0.0, .. } => update(cfg, t, lr, p, &grad, None, None),
                OptimConfig::Sgd { .. } => {
                    m.resize(shard, 0.0);
                    update(cfg, t, lr, p, &grad, Some((m, first)), None)
                }
                OptimConfig::AdamW { .. } => {
                    m.resize(shard, 0.0);
                    v.resize(shard, 0.0);
                    update(cfg, t, lr, p, &grad, Some((m, first)), Some((v, false)))
                }
            }?)
        };
        let mut p = None;
        match &self.layers {
            Some(store) => store.with_shard(apply)?,
            None => {
                let mut mine = self.shards.read_shard(params)?;
                apply(&mut mine)?;
                p = Some(mine);
            }
        }
        self.started = true;
        let optimizer_s = t1.elapsed().as_secs_f64();
        let t2 = Instant::now();
        // Stages 1 and 2: every rank's updated shard, gathered into the whole parameters.
        if let Some(p) = p {
            let full = self.shards.gather(&p)?;
            self.shards.write_params(params, &full)?;
        }
        Ok(StepTimes { comm_s: comm_s + t2.elapsed().as_secs_f64(), optimizer_s, grad_norm, scalars, bubble: None })
    }

    fn optimizer_bytes(&self, _opt: &Optimizer) -> usize {
        (self.m.len() + self.v.len()) * REAL_BYTES
    }

    /// Stage 1: the whole flat gradient, and a parameter's gradient as the model writes it. Stages 2 and 3: one
    /// bucket and this rank's shard. Each padded to a multiple of the world size, with the reduce-scatter's slice.
    fn gradient_bytes(&self, _params: &Params) -> usize {
        (self.acc.len() + self.grad.len() + self.mine.capacity() + self.tmp.capacity()) * REAL_BYTES
    }

    /// Stage 3: this rank's shard of the parameters and the most of whole layers it held at once (in use, being
    /// gathered); stages 1 and 2: the whole parameters.
    fn param_bytes(&self, params: &Params) -> usize {
        match &self.layers {
            Some(store) => store.held_bytes(),
            None => params.count() * REAL_BYTES,
        }
    }

    /// Stage 3: every rank's shard gathered into whole tensors (a collective: every rank calls it at the same step);
    /// stages 1 and 2: the parameters themselves.
    fn model_state(&self, params: &Params) -> Result<Vec<(String, Tensor)>> {
        match &self.layers {
            Some(store) => self.named(params, &store.gather_all()?, ""),
            None => Ok(params.vars().iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect()),
        }
    }

    /// Every rank's moments gathered into whole tensors, named as [`Optimizer::state`] names them. A collective:
    /// every rank calls it at the same step.
    fn optimizer_state(&self, params: &Params, _opt: &Optimizer) -> Result<Vec<(String, Tensor)>> {
        if !self.started {
            return Ok(Vec::new());
        }
        let m = (!self.m.is_empty()).then(|| self.shards.gather(&self.m)).transpose()?;
        let v = (!self.v.is_empty()).then(|| self.shards.gather(&self.v)).transpose()?;
        let m = m.map(|m| self.named(params, &m, ".m")).transpose()?.unwrap_or_default();
        let v = v.map(|v| self.named(params, &v, ".v")).transpose()?.unwrap_or_default();
        // Per parameter, its m then its v (the optimizer's order).
        let mut out = Vec::with_capacity(m.len() + v.len());
        let (mut m, mut v) = (m.into_iter().peekable(), v.into_iter().peekable());
        while m.peek().is_some() || v.peek().is_some() {
            out.extend(m.next());
            out.extend(v.next());
        }
        Ok(out)
    }

    fn compression_state(&self) -> Result<Vec<(String, Tensor)>> {
        match &self.compress {
            Some(z) => super::compress::gather(self.comm.as_ref(), z),
            None => Ok(Vec::new()),
        }
    }

    fn load_compression_state(&mut self, named: &HashMap<String, Tensor>) -> Result<()> {
        match &mut self.compress {
            Some(z) => super::compress::load(self.comm.as_ref(), z, named),
            None => Ok(()),
        }
    }

    /// Keeps this rank's shard of whole moments (saved by any strategy at any world size).
    fn load_optimizer_state(
        &mut self,
        params: &Params,
        opt: &mut Optimizer,
        t: u64,
        named: &HashMap<String, Tensor>,
    ) -> Result<()> {
        opt.t = t;
        if let Some(z) = &mut self.compress {
            z.set_step(t);
        }
        let mut any = false;
        for suffix in ["m", "v"] {
            let mut full = vec![0.0 as Real; self.shards.total];
            let mut found = false;
            for (i, (name, var)) in params.vars().iter().enumerate() {
                let Some(x) = named.get(&format!("{name}.{suffix}")) else { continue };
                if x.shape() != var.shape() {
                    return Err(Error::Checkpoint(format!(
                        "optimizer state {name}.{suffix} has shape {:?}, the parameter {:?}",
                        x.dims(),
                        var.dims()
                    )));
                }
                let vals = x.flatten_all()?.to_vec1::<Real>()?;
                let o = self.shards.offsets[i];
                full[o..o + vals.len()].copy_from_slice(&vals);
                found = true;
            }
            let cut = if found { self.shards.cut(&full) } else { Vec::new() };
            any |= found;
            if suffix == "m" {
                self.m = cut;
            } else {
                self.v = cut;
            }
        }
        self.started = any;
        Ok(())
    }
}
