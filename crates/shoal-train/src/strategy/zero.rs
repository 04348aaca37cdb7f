//! ZeRO stages 1 and 2: the optimizer state (stage 1), and the gradients too (stage 2), sharded over the ranks.
//!
//! - At [`Strategy::init`], rank 0's parameters are broadcast (as DDP) and the flat parameter space (every parameter
//!   in order) is cut into buckets — one over everything for stage 1; for stage 2 about `bucket_bytes` each, from the
//!   last parameters down (the order backward produces gradients) — and each bucket into one equal slice per rank
//!   (padded): a rank's shard is its slice of every bucket.
//! - Stage 1: each micro-batch's gradients are added into one flat buffer (weighted by the rank's share of the
//!   global batch, as for DDP), reduce-scattered in [`Strategy::step`]. Stage 2: they go into one bucket buffer,
//!   reduce-scattered as soon as backward has passed the bucket and added into the rank's shard of gradients, so the
//!   whole gradient is never held (at the price of one reduce-scatter per micro-batch with gradient accumulation).
//! - Either way each rank ends with the summed gradient of its shard only; the
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

use super::{GradSink, StepTimes, Strategy, TensorGrads, broadcast_from_rank0, check_order, flat_offsets, put_tensors};
use crate::error::{Error, Result};
use crate::kernels::{with_slice, with_slice_mut};
use crate::optim::{OptimConfig, Optimizer, sum_sq, update};
use crate::params::Params;

/// ZeRO stage 1 or 2 (see the module documentation).
pub struct Zero {
    comm: Option<Communicator>,
    stage: u8,
    /// Bytes of gradient per bucket (stage 2).
    bucket_bytes: usize,
    /// Flat offset of each parameter, and the number of values.
    offsets: Vec<usize>,
    total: usize,
    /// The buckets, from the last parameters to the first (the order backward produces gradients): each a range of
    /// parameter indices and the flat range they cover. Stage 1 has one, over everything.
    buckets: Vec<(std::ops::Range<usize>, std::ops::Range<usize>)>,
    /// Where each bucket's slice starts in this rank's shard vectors.
    shard_offsets: Vec<usize>,
    /// The length of this rank's shard vectors (the sum of the buckets' slices).
    shard: usize,
    /// Stage 1: this step's gradients, flat. Stage 2: one bucket being filled.
    acc: Vec<f32>,
    /// Stage 2: this rank's summed gradients, accumulated bucket by bucket over the step's micro-batches.
    grad: Vec<f32>,
    /// The step's scalars (summed over ranks in `step`).
    scalars: Vec<f32>,
    /// The optimizer's state for this rank's shard: SGD's momentum or AdamW's first moment, AdamW's second.
    m: Vec<f32>,
    v: Vec<f32>,
    /// Whether the moments hold anything yet (SGD's first momentum is the gradient itself).
    started: bool,
    /// A parameter's gradient as the model writes it, reused from one call to the next.
    tmp: Vec<f32>,
    /// This rank's reduced slice of a bucket (reused).
    mine: Vec<f32>,
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

impl std::fmt::Debug for Zero {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zero")
            .field("stage", &self.stage)
            .field("world", &self.world())
            .field("shard", &self.shard)
            .finish_non_exhaustive()
    }
}

impl Zero {
    /// Stage 1 or 2 (stage 2 reduce-scatters each bucket of about `bucket_bytes` of gradients as it fills).
    pub fn new(comm: Option<Communicator>, stage: u8, bucket_bytes: usize) -> Zero {
        Zero {
            comm,
            stage,
            bucket_bytes,
            offsets: Vec::new(),
            total: 0,
            buckets: Vec::new(),
            shard_offsets: Vec::new(),
            shard: 0,
            acc: Vec::new(),
            grad: Vec::new(),
            scalars: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            started: false,
            tmp: Vec::new(),
            mine: Vec::new(),
        }
    }

    fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, Communicator::size)
    }

    fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, Communicator::rank)
    }

    /// Bucket `b`'s slice length (its values over the world size, rounded up).
    fn slice_len(&self, b: usize) -> usize {
        self.buckets[b].1.len().div_ceil(self.world()).max(1)
    }

    /// Reduce-scatters bucket `b`'s gradients (`data`, its flat values) and adds this rank's slice into `out`.
    fn reduce_bucket(&mut self, b: usize, data: &[f32], out: &mut [f32]) -> Result<()> {
        let s = self.slice_len(b);
        // `data` is the bucket padded with zeros to `s` values per rank.
        let padded = &data[..s * self.world()];
        self.mine.clear();
        self.mine.resize(s, 0.0);
        match self.comm.as_ref().filter(|c| c.size() > 1) {
            Some(c) => c.reduce_scatter(padded, &mut self.mine, ReduceOp::Sum)?,
            None => self.mine.copy_from_slice(&padded[..s]),
        }
        let o = self.shard_offsets[b];
        for (a, x) in out[o..o + s].iter_mut().zip(&self.mine) {
            *a += *x;
        }
        Ok(())
    }

    /// Gathers a shard vector of every rank into the whole flat space.
    fn gather(&self, shard: &[f32]) -> Result<Vec<f32>> {
        let mut full = vec![0f32; self.total];
        for (b, (_, flat)) in self.buckets.iter().enumerate() {
            let s = self.slice_len(b);
            let o = self.shard_offsets[b];
            let mut all = vec![0f32; s * self.world()];
            match self.comm.as_ref().filter(|c| c.size() > 1) {
                Some(c) => c.all_gather(&shard[o..o + s], &mut all)?,
                None => all.copy_from_slice(&shard[o..o + s]),
            }
            full[flat.clone()].copy_from_slice(&all[..flat.len()]);
        }
        Ok(full)
    }

    /// This rank's shard of the parameters (zeros in the padding), read in place from the ones it overlaps.
    fn read_shard(&self, params: &Params) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.shard];
        for (b, (members, flat)) in self.buckets.iter().enumerate() {
            let s = self.slice_len(b);
            let start = flat.start + self.rank() * s;
            let end = (start + s).min(flat.end);
            let o = self.shard_offsets[b];
            // Only the bucket's own parameters can overlap its slice.
            for i in members.clone() {
                let var = &params.vars()[i].1;
                let (lo, hi) = (self.offsets[i], self.offsets[i] + var.elem_count());
                let (a, z) = (lo.max(start), hi.min(end));
                if a < z {
                    with_slice(var.as_tensor(), |p| {
                        out[o + a - start..o + z - start].copy_from_slice(&p[a - lo..z - lo]);
                    })?;
                }
            }
        }
        Ok(out)
    }

    /// Writes a whole flat vector into the parameters, in place.
    fn write_params(&self, params: &Params, full: &[f32]) -> Result<()> {
        for (i, (_, var)) in params.vars().iter().enumerate() {
            let (lo, n) = (self.offsets[i], var.elem_count());
            with_slice_mut(var.as_tensor(), |p| p.copy_from_slice(&full[lo..lo + n]))?;
        }
        Ok(())
    }

    /// This rank's shard of a whole flat vector (zeros in the padding).
    fn cut(&self, full: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; self.shard];
        for (b, (_, flat)) in self.buckets.iter().enumerate() {
            let s = self.slice_len(b);
            let start = flat.start + self.rank() * s;
            let end = (start + s).min(flat.end);
            if start < end {
                let o = self.shard_offsets[b];
                out[o..o + (end - start)].copy_from_slice(&full[start..end]);
            }
        }
        out
    }
}

/// Adds each parameter's gradient into the flat buffer (stage 1), or into the current bucket, reduce-scattering
/// each bucket once backward has passed it (stage 2).
struct Adder<'a> {
    z: &'a mut Zero,
    vars: &'a [(String, candle_core::Var)],
    tmp: Vec<f32>,
    next: Option<usize>,
    /// Stage 2: the bucket being filled.
    bucket: usize,
}

impl Adder<'_> {
    /// Stage 2: reduce-scatters every bucket whose parameters all lie above `index` (all of them for `None`).
    fn flush_above(&mut self, index: Option<usize>) -> Result<()> {
        if self.z.stage < 2 {
            return Ok(());
        }
        while self.bucket < self.z.buckets.len() && index.is_none_or(|i| i < self.z.buckets[self.bucket].0.start) {
            let b = self.bucket;
            let flat = self.z.buckets[b].1.clone();
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
    fn put(&mut self, index: usize, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()> {
        check_order(index, self.vars.len(), self.next)?;
        self.next = index.checked_sub(1);
        self.flush_above(Some(index))?;
        let n = self.vars[index].1.elem_count();
        // Offsets within the buffer: the whole flat space (stage 1, one bucket from 0), or the current bucket.
        let off = self.z.offsets[index] - self.z.buckets[self.bucket.min(self.z.buckets.len() - 1)].1.start;
        self.tmp.clear();
        self.tmp.resize(n, 0.0);
        fill(&mut self.tmp)?;
        for (a, x) in self.z.acc[off..off + n].iter_mut().zip(&self.tmp) {
            *a += *x;
        }
        Ok(())
    }

    fn attach_scalars(&mut self, values: &[f32]) {
        self.z.scalars.clear();
        self.z.scalars.extend_from_slice(values);
    }
}

impl Strategy for Zero {
    fn name(&self) -> &'static str {
        if self.stage >= 2 { "zero2" } else { "zero1" }
    }

    fn comm(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }

    fn init(&mut self, params: &Params) -> Result<()> {
        broadcast_from_rank0(self.comm.as_ref(), params)?;
        (self.offsets, self.total) = flat_offsets(params);
        // Buckets from the last parameter down: one over everything for stage 1.
        self.buckets.clear();
        let vars = params.vars();
        let limit = (self.bucket_bytes / 4).max(1);
        let mut hi = vars.len();
        while hi > 0 {
            let mut lo = hi - 1;
            let mut len = vars[lo].1.elem_count();
            while lo > 0 && (self.stage < 2 || len + vars[lo - 1].1.elem_count() <= limit) {
                lo -= 1;
                len += vars[lo].1.elem_count();
            }
            let flat = self.offsets[lo]..self.offsets[lo] + len;
            self.buckets.push((lo..hi, flat));
            hi = lo;
        }
        self.shard_offsets.clear();
        let mut o = 0;
        for b in 0..self.buckets.len() {
            self.shard_offsets.push(o);
            o += self.slice_len(b);
        }
        self.shard = o;
        // Stage 2 holds one bucket of gradients at a time, never the whole.
        // Each bucket padded with zeros to a slice per rank, so the reduce-scatter takes it as it is.
        let padded = (0..self.buckets.len()).map(|b| self.slice_len(b) * self.world()).max().unwrap_or(0);
        self.acc = vec![0.0; padded];
        if self.stage >= 2 {
            self.grad = vec![0.0; self.shard];
        }
        Ok(())
    }

    fn backward(
        &mut self,
        params: &Params,
        last: bool,
        scalars: Vec<f32>,
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

    fn backward_tensors(&mut self, params: &Params, last: bool, scalars: Vec<f32>, grads: TensorGrads) -> Result<()> {
        self.backward(params, last, scalars, &mut |sink| put_tensors(sink, &grads))
    }

    fn step(&mut self, params: &Params, opt: &mut Optimizer, lr: f64, clip: Option<f64>) -> Result<StepTimes> {
        let t0 = Instant::now();
        let comm = self.comm.clone().filter(|c| c.size() > 1);
        // This rank's summed gradient (stage 2: reduced bucket by bucket during backward), and the step's scalars
        // summed over ranks.
        let mut grad = if self.stage >= 2 {
            std::mem::replace(&mut self.grad, vec![0.0; self.shard])
        } else {
            let mut g = vec![0f32; self.shard];
            let acc = std::mem::take(&mut self.acc);
            for b in 0..self.buckets.len() {
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
        let mut p = self.read_shard(params)?;
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
        self.write_params(params, &full)?;
        Ok(StepTimes { comm_s: comm_s + t2.elapsed().as_secs_f64(), optimizer_s, grad_norm, scalars })
    }

    fn optimizer_bytes(&self, _opt: &Optimizer) -> usize {
        (self.m.len() + self.v.len()) * 4
    }

    /// Stage 1: the whole flat gradient. Stage 2: one bucket and this rank's shard. Each padded to a multiple of
    /// the world size, with the reduce-scatter's slice.
    fn gradient_bytes(&self, _params: &Params) -> usize {
        (self.acc.len() + self.grad.len() + self.mine.capacity()) * 4
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
        let mut any = false;
        for suffix in ["m", "v"] {
            let mut full = vec![0f32; self.total];
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
                full[self.offsets[i]..self.offsets[i] + vals.len()].copy_from_slice(&vals);
                found = true;
            }
            let cut = if found { self.cut(&full) } else { Vec::new() };
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
