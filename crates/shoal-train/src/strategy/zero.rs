//! ZeRO stage 1: the optimizer state sharded over the ranks.
//!
//! - At [`Strategy::init`], rank 0's parameters are broadcast (as DDP) and the flat parameter space (every parameter
//!   in order, padded to a multiple of the world size) is cut into one equal shard per rank.
//! - Each micro-batch's gradients are added into one flat buffer (weighted by the rank's share of the global batch,
//!   as for DDP).
//! - [`Strategy::step`] reduce-scatters that buffer, so each rank holds the summed gradient of its shard only; the
//!   global norm for clipping is one all-reduce of the shards' sums of squares; each rank applies the optimizer to
//!   its shard with the moments of its shard only (`1/N` of the optimizer state per rank; the formula is
//!   [`crate::optim::update`], the one every strategy uses); an all-gather of the updated shards gives every rank the
//!   whole new parameters.
//! - The moments are gathered into whole named tensors (`<param>.m`, `<param>.v`, as the optimizer names them) for
//!   a checkpoint ([`Strategy::optimizer_state`], a collective), and cut to the shard again when one is loaded
//!   ([`Strategy::load_optimizer_state`]): its checkpoints are DDP's, resumable under any strategy and world size.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::Tensor;
use shoal_comm::{Communicator, ReduceOp};

use super::{GradSink, StepTimes, Strategy, TensorGrads, copy_f32};
use crate::error::{Error, Result};
use crate::optim::{OptimConfig, Optimizer, sum_sq, update};
use crate::params::Params;

/// ZeRO stage 1 (see the module documentation).
pub struct Zero1 {
    comm: Option<Communicator>,
    /// Flat offset of each parameter, and the number of values.
    offsets: Vec<usize>,
    total: usize,
    /// Values per shard (the padded total over the world size).
    shard: usize,
    /// This step's gradients, flat (padded).
    acc: Vec<f32>,
    /// The step's scalars (summed over ranks in `step`).
    scalars: Vec<f32>,
    /// The optimizer's state for this rank's shard: SGD's momentum or AdamW's first moment, AdamW's second.
    m: Vec<f32>,
    v: Vec<f32>,
    /// Whether the moments hold anything yet (SGD's first momentum is the gradient itself).
    started: bool,
}

impl std::fmt::Debug for Zero1 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zero1").field("world", &self.world()).field("shard", &self.shard).finish_non_exhaustive()
    }
}

impl Zero1 {
    pub fn new(comm: Option<Communicator>) -> Zero1 {
        Zero1 {
            comm,
            offsets: Vec::new(),
            total: 0,
            shard: 0,
            acc: Vec::new(),
            scalars: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            started: false,
        }
    }

    fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, Communicator::size)
    }

    fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, Communicator::rank)
    }

    /// This rank's range of the flat parameter space (possibly reaching into the padding).
    fn range(&self) -> std::ops::Range<usize> {
        let start = self.rank() * self.shard;
        start..start + self.shard
    }

    /// Gathers a shard-sized vector of every rank into the whole flat space (unpadded).
    fn gather(&self, shard: &[f32]) -> Result<Vec<f32>> {
        let mut full = vec![0f32; self.shard * self.world()];
        match self.comm.as_ref().filter(|c| c.size() > 1) {
            Some(c) => c.all_gather(shard, &mut full)?,
            None => full.copy_from_slice(shard),
        }
        full.truncate(self.total);
        Ok(full)
    }
}

/// Adds each parameter's gradient into the flat buffer.
struct Adder<'a> {
    vars: &'a [(String, candle_core::Var)],
    offsets: &'a [usize],
    acc: &'a mut [f32],
    tmp: Vec<f32>,
    scalars: &'a mut Vec<f32>,
    next: Option<usize>,
}

impl GradSink for Adder<'_> {
    fn put(&mut self, index: usize, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()> {
        if index >= self.vars.len() || self.next.is_none_or(|n| index > n) {
            return Err(Error::InvalidArgument(format!(
                "gradient of parameter {index} given out of order (parameters must come in reverse order, each once)"
            )));
        }
        self.next = index.checked_sub(1);
        let n = self.vars[index].1.elem_count();
        let off = self.offsets[index];
        self.tmp.clear();
        self.tmp.resize(n, 0.0);
        fill(&mut self.tmp)?;
        for (a, x) in self.acc[off..off + n].iter_mut().zip(&self.tmp) {
            *a += *x;
        }
        Ok(())
    }

    fn attach_scalars(&mut self, values: &[f32]) {
        self.scalars.clear();
        self.scalars.extend_from_slice(values);
    }
}

impl Strategy for Zero1 {
    fn name(&self) -> &'static str {
        "zero1"
    }

    fn comm(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }

    fn init(&mut self, params: &Params) -> Result<()> {
        if let Some(c) = self.comm.as_ref().filter(|c| c.size() > 1) {
            let mut flat = params.flatten()?;
            c.broadcast(&mut flat, 0)?;
            params.load_flat(&flat)?;
        }
        let mut off = 0;
        self.offsets = params
            .vars()
            .iter()
            .map(|(_, v)| {
                let o = off;
                off += v.elem_count();
                o
            })
            .collect();
        self.total = off;
        self.shard = self.total.div_ceil(self.world()).max(1);
        self.acc = vec![0.0; self.shard * self.world()];
        Ok(())
    }

    fn backward(
        &mut self,
        params: &Params,
        last: bool,
        scalars: Vec<f32>,
        f: &mut dyn FnMut(&mut dyn GradSink) -> Result<()>,
    ) -> Result<()> {
        let mut sink = Adder {
            vars: params.vars(),
            offsets: &self.offsets,
            acc: &mut self.acc,
            tmp: Vec::new(),
            scalars: &mut self.scalars,
            next: params.vars().len().checked_sub(1),
        };
        f(&mut sink)?;
        if last && !scalars.is_empty() {
            self.scalars = scalars;
        }
        Ok(())
    }

    fn backward_tensors(&mut self, params: &Params, last: bool, scalars: Vec<f32>, grads: TensorGrads) -> Result<()> {
        self.backward(params, last, scalars, &mut |sink| {
            for (i, g) in grads.iter().enumerate().rev() {
                if let Some(g) = g {
                    sink.put(i, &mut |out| copy_f32(out, g))?;
                }
            }
            Ok(())
        })
    }

    fn step(&mut self, params: &Params, opt: &mut Optimizer, lr: f64, clip: Option<f64>) -> Result<StepTimes> {
        let t0 = Instant::now();
        let comm = self.comm.clone().filter(|c| c.size() > 1);
        // This rank's summed gradient, and the step's scalars summed over ranks.
        let mut grad = vec![0f32; self.shard];
        match &comm {
            Some(c) => c.reduce_scatter(&self.acc, &mut grad, ReduceOp::Sum)?,
            None => grad.copy_from_slice(&self.acc[..self.shard]),
        }
        self.acc.iter_mut().for_each(|x| *x = 0.0);
        let mut scalars = std::mem::take(&mut self.scalars);
        if let (Some(c), false) = (&comm, scalars.is_empty()) {
            c.all_reduce(&mut scalars, ReduceOp::Sum)?;
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
                let s = (max / norm) as f32;
                grad.iter_mut().for_each(|x| *x *= s);
            }
            grad_norm = Some(norm);
        }
        // The shard's parameters (zeros in the padding), updated in place with the shard's moments.
        let range = self.range();
        let flat = params.flatten()?;
        let mut p = vec![0f32; self.shard];
        let end = range.end.min(self.total);
        if range.start < end {
            p[..end - range.start].copy_from_slice(&flat[range.start..end]);
        }
        opt.t += 1;
        let cfg = opt.config();
        let first = !self.started;
        match cfg {
            OptimConfig::Sgd { momentum: 0.0, .. } => update(cfg, opt.t, lr, &mut p, &grad, None, None)?,
            OptimConfig::Sgd { .. } => {
                self.m.resize(self.shard, 0.0);
                update(cfg, opt.t, lr, &mut p, &grad, Some((&mut self.m, first)), None)?;
            }
            OptimConfig::AdamW { .. } => {
                self.m.resize(self.shard, 0.0);
                self.v.resize(self.shard, 0.0);
                update(cfg, opt.t, lr, &mut p, &grad, Some((&mut self.m, first)), Some(&mut self.v))?;
            }
        }
        self.started = true;
        let optimizer_s = t1.elapsed().as_secs_f64();
        let t2 = Instant::now();
        let full = self.gather(&p)?;
        params.load_flat(&full)?;
        Ok(StepTimes { comm_s: comm_s + t2.elapsed().as_secs_f64(), optimizer_s, grad_norm, scalars })
    }

    fn optimizer_bytes(&self, _opt: &Optimizer) -> usize {
        (self.m.len() + self.v.len()) * 4
    }

    /// Every rank's moments gathered into whole tensors, named as [`Optimizer::state`] names them. A collective:
    /// every rank calls it at the same step.
    fn optimizer_state(&self, params: &Params, _opt: &Optimizer) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        if !self.started {
            return Ok(out);
        }
        let m = (!self.m.is_empty()).then(|| self.gather(&self.m)).transpose()?;
        let v = (!self.v.is_empty()).then(|| self.gather(&self.v)).transpose()?;
        for (i, (name, var)) in params.vars().iter().enumerate() {
            let (off, n) = (self.offsets[i], var.elem_count());
            for (full, suffix) in [(&m, "m"), (&v, "v")] {
                if let Some(full) = full {
                    let t = Tensor::from_vec(full[off..off + n].to_vec(), var.shape(), var.device())?;
                    out.push((format!("{name}.{suffix}"), t));
                }
            }
        }
        Ok(out)
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
        let range = self.range();
        let padded = self.shard * self.world();
        let offsets = self.offsets.clone();
        let mut any = false;
        for (suffix, dst) in [("m", &mut self.m), ("v", &mut self.v)] {
            let mut full = vec![0f32; padded];
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
                let vals = x.flatten_all()?.to_vec1::<f32>()?;
                full[offsets[i]..offsets[i] + vals.len()].copy_from_slice(&vals);
                found = true;
            }
            if found {
                *dst = full[range.clone()].to_vec();
                any = true;
            } else {
                dst.clear();
            }
        }
        self.started = any;
        Ok(())
    }
}
