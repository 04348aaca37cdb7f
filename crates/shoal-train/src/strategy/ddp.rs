//! Data parallel, as PyTorch's DDP does it:
//! - at [`Strategy::init`], rank 0's parameters are broadcast, so every rank starts equal;
//! - each rank's loss is weighted by its share of the global batch (`local samples / global samples`, by the
//!   caller), so summing gradients across ranks gives exactly the gradient of the global-batch mean loss,
//!   whatever the shares;
//! - on the last micro-batch, gradients are flattened in reverse parameter order (the order backward produces
//!   them) into buckets of `bucket_bytes` (the first one `first_bucket_bytes`); each full bucket's all-reduce
//!   starts at once, on the communicator's worker thread. With a hand-written backward the gradients are written
//!   straight into the buckets as each layer finishes, so communication overlaps the backward pass of the earlier
//!   layers. With `overlap` off, the buckets are reduced on the calling thread in `step` instead: when the compute
//!   threads already fill every core, a communicator thread running beside them only slows the computation it was
//!   meant to hide behind;
//! - `step` waits for the buckets, clips, and applies the same update on every rank. Bucket buffers are reused
//!   from step to step;
//! - parameters held on a device (`Params::set_resident`) keep one rank's gradients there, summed over
//!   micro-batches, and are updated there. Ranks together either sum them there, bucket by bucket, through a
//!   [`DeviceAllReduce`] (NCCL; the step's scalars ride in the last bucket), or stage them to the host bucket by
//!   bucket (`put_tensors`) into the communicator, the reduced buckets going back up with the update.

use crate::{REAL_BYTES, Real};
use std::time::Instant;

use candle_core::Tensor;
use shoal_comm::{Communicator, CompressConfig, Compressor, Pending, ReduceOp};

use super::{
    DeviceAllReduce, GradSink, StepTimes, Strategy, TensorGrads, broadcast_from_rank0, check_order, flat_offsets,
    put_tensors,
};
use crate::error::{Error, Result};
use crate::optim::{Optimizer, clip_grad_norm, clip_grad_norm_slices, clip_grad_norm_tensors};
use crate::params::Params;

/// How [`Ddp`] buckets and overlaps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DdpConfig {
    /// Gradient bucket size for the all-reduce.
    pub bucket_bytes: usize,
    /// Size of the first bucket (at most `bucket_bytes`): the last layers' gradients start their all-reduce early.
    pub first_bucket_bytes: usize,
    /// All-reduce each bucket on the communicator's thread as soon as it is full, or all of them on the calling
    /// thread in `step`.
    pub overlap: bool,
}

enum Bucket {
    /// Being all-reduced on the communicator's thread.
    Pending(Pending<Vec<Real>>),
    /// Final (nothing to reduce).
    Ready(Vec<Real>),
    /// To all-reduce on the calling thread in `step`.
    Deferred(Vec<Real>),
}

/// Data parallel with bucketed, overlapped all-reduces (see the module documentation).
pub struct Ddp {
    comm: Option<Communicator>,
    cfg: DdpConfig,
    /// Flat offset of each parameter (parameter order).
    offsets: Vec<usize>,
    /// Gradients accumulated over earlier micro-batches, flat in parameter order.
    acc: Option<Vec<Real>>,
    /// Buckets of the current step, each with the parameter indices it holds (reverse order).
    buckets: Vec<(Vec<usize>, Bucket)>,
    /// Gradients kept as tensors when there is nothing to reduce, with the step's scalars.
    direct: Option<(Vec<Tensor>, Vec<Real>)>,
    /// Parameters held on a device ([`Params::set_resident`]) and nothing to reduce, or a device all-reduce: the
    /// gradients of earlier micro-batches, summed there.
    acc_tensors: Option<Vec<Tensor>>,
    /// Sums gradient buckets across the ranks on their device ([`Ddp::with_device_reduce`]).
    device_reduce: Option<Box<dyn DeviceAllReduce>>,
    /// Seconds the step's device all-reduces took (reported as its communication).
    device_comm_s: f64,
    /// Bucket buffers of the last step, reused by the next (no allocation, no page faults).
    spare: Vec<Vec<Real>>,
    /// `[compression]`: each bucket summed through it, on the calling thread in `step`.
    compress: Option<Compressor>,
    /// `[compression] momentum`: past the warm-up, each rank sends its AdamW first moment instead of its gradients.
    momentum: bool,
    /// `[robust]`: each bucket all-gathered and combined by this rule bearing this many attackers, in `step`.
    robust: Option<(shoal_ps::Rule, usize)>,
    /// The gathered buckets of the robust rule, reused.
    gathered: Vec<Real>,
    /// `[chaos]`, an experiment: these ranks' buckets forged by the attack where they are gathered.
    attack: Option<(shoal_ps::Attack, Vec<usize>)>,
}

impl std::fmt::Debug for Ddp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ddp").field("cfg", &self.cfg).field("world", &self.world()).finish_non_exhaustive()
    }
}

impl Ddp {
    pub fn new(comm: Option<Communicator>, cfg: DdpConfig) -> Ddp {
        Ddp {
            comm,
            cfg,
            offsets: Vec::new(),
            acc: None,
            buckets: Vec::new(),
            direct: None,
            acc_tensors: None,
            device_reduce: None,
            device_comm_s: 0.0,
            spare: Vec::new(),
            compress: None,
            momentum: false,
            robust: None,
            gathered: Vec::new(),
            attack: None,
        }
    }

    /// The same, with every gradient bucket sent compressed as `cfg` says (`shoal_comm::compress`). The buckets
    /// are then reduced on the calling thread in `step` (a compressor keeps state per bucket, and encoding is
    /// computation that a communicator thread would take from the backward pass), and bucket `k` holds the same
    /// parameters every step, which its error feedback relies on.
    pub fn with_compression(mut self, cfg: CompressConfig) -> Ddp {
        self.cfg.overlap = false;
        self.compress = Some(Compressor::new(cfg));
        self
    }

    /// With compression, past its warm-up: each rank sends its AdamW first moment taken one step with its own
    /// gradients in place of them, the second moment frozen (`[compression] momentum`, [`super::compress`]).
    pub fn sending_moment(mut self, on: bool) -> Ddp {
        self.momentum = on && self.compress.is_some();
        self
    }

    /// Every bucket all-gathered and combined by `rule` bearing `f` attackers, after backward, in place of the sum
    /// ([`super::robust`]).
    pub fn with_robust(mut self, rule: shoal_ps::Rule, f: usize) -> Ddp {
        self.cfg.overlap = false;
        self.robust = Some((rule, f));
        self
    }

    /// With [`Ddp::with_robust`], an experiment: the `liars`' buckets replaced by what `attack` sends.
    pub fn attacked_by(mut self, attack: shoal_ps::Attack, liars: Vec<usize>) -> Ddp {
        self.attack = Some((attack, liars));
        self
    }

    /// With parameters held on a device ([`Params::set_resident`]): the ranks' gradients summed there by `reduce`,
    /// a bucket of `bucket_bytes` at a time in reverse parameter order, instead of staged through the host (which
    /// stays the way under `[compression]` or a `[robust]` rule, whose work is on host buffers).
    pub fn with_device_reduce(mut self, reduce: Box<dyn DeviceAllReduce>) -> Ddp {
        self.device_reduce = Some(reduce);
        self
    }

    fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, Communicator::size)
    }

    /// Whether the step's gradients stay on the parameters' device: held there, and nothing to reduce or a device
    /// all-reduce to reduce them (without a compressor or a robust rule, which read host buffers).
    fn on_device(&self, params: &Params) -> bool {
        params.resident()
            && (self.world() <= 1 || (self.device_reduce.is_some() && self.compress.is_none() && self.robust.is_none()))
    }

    /// The ranks' gradients (one rank's, summed over its micro-batches) summed on their device by the device
    /// all-reduce, bucket by bucket in reverse parameter order, the step's scalars riding in the last bucket.
    fn reduce_on_device(
        &mut self,
        params: &Params,
        grads: Vec<Tensor>,
        scalars: Vec<Real>,
    ) -> Result<(Vec<Tensor>, Vec<Real>)> {
        let t0 = Instant::now();
        let reduce = self
            .device_reduce
            .as_mut()
            .ok_or_else(|| Error::InvalidArgument("no device all-reduce to sum the gradients with".into()))?;
        let device = params.vars().first().map_or(candle_core::Device::Cpu, |(_, v)| v.device().clone());
        let n = grads.len();
        let limit = (self.cfg.bucket_bytes / REAL_BYTES).max(1);
        let mut summed: Vec<Option<Tensor>> = vec![None; n];
        let mut out_scalars = scalars.clone();
        let (mut at, mut done) = (0, false);
        while !done {
            let (mut end, mut len) = (at, 0);
            while end < n && (end == at || len < limit) {
                len += grads[n - 1 - end].elem_count();
                end += 1;
            }
            done = end >= n;
            let members: Vec<usize> = (at..end).map(|k| n - 1 - k).collect();
            let mut parts = members.iter().map(|&i| grads[i].flatten_all()).collect::<candle_core::Result<Vec<_>>>()?;
            if done && !scalars.is_empty() {
                parts.push(Tensor::from_slice(&scalars, scalars.len(), &device)?);
            }
            if parts.is_empty() {
                break;
            }
            let flat = reduce.all_reduce(Tensor::cat(&parts, 0)?)?;
            let mut off = 0;
            for &i in &members {
                let count = grads[i].elem_count();
                summed[i] = Some(flat.narrow(0, off, count)?.reshape(grads[i].shape())?);
                off += count;
            }
            if done && !scalars.is_empty() {
                out_scalars = flat.narrow(0, off, scalars.len())?.to_device(&candle_core::Device::Cpu)?.to_vec1()?;
            }
            at = end;
        }
        self.device_comm_s += t0.elapsed().as_secs_f64();
        let grads = summed
            .into_iter()
            .enumerate()
            .map(|(i, g)| g.ok_or_else(|| Error::InvalidArgument(format!("no summed gradient for parameter {i}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok((grads, out_scalars))
    }
}

/// The [`GradSink`] of one micro-batch: accumulates (`acc`) or fills buckets.
struct Collector<'a> {
    vars: &'a [(String, candle_core::Var)],
    offsets: &'a [usize],
    /// Next index allowed (every index below it, and it, may still come).
    next: Option<usize>,
    /// Scalars that ride in the last bucket.
    scalars: Vec<Real>,
    mode: Mode<'a>,
}

enum Mode<'a> {
    /// Not the last micro-batch: add into the accumulator.
    Accumulate { acc: &'a mut Vec<Real>, tmp: Vec<Real> },
    /// The last micro-batch: bucket, add what earlier micro-batches accumulated, launch.
    Reduce {
        comm: Option<Communicator>,
        overlap: bool,
        acc: Option<Vec<Real>>,
        cur: Vec<Real>,
        members: Vec<usize>,
        limit: usize,
        bucket_bytes: usize,
        buckets: &'a mut Vec<(Vec<usize>, Bucket)>,
        spare: &'a mut Vec<Vec<Real>>,
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

    fn put_inner(&mut self, index: usize, fill: &mut dyn FnMut(&mut [Real]) -> Result<()>) -> Result<()> {
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
                    *limit = (*bucket_bytes / REAL_BYTES).max(1);
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
    fn put(&mut self, index: usize, fill: &mut dyn FnMut(&mut [Real]) -> Result<()>) -> Result<()> {
        check_order(index, self.vars.len(), self.next)?;
        self.zero_down_to(Some(index))?;
        self.put_inner(index, fill)
    }

    fn attach_scalars(&mut self, values: &[Real]) {
        self.scalars.clear();
        self.scalars.extend_from_slice(values);
    }
}

fn launch(
    comm: Option<&Communicator>,
    overlap: bool,
    data: Vec<Real>,
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

impl Strategy for Ddp {
    fn name(&self) -> &'static str {
        "ddp"
    }

    fn comm(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }

    fn init(&mut self, params: &Params) -> Result<()> {
        broadcast_from_rank0(self.comm.as_ref(), params)?;
        self.offsets = flat_offsets(params).0;
        Ok(())
    }

    fn backward(
        &mut self,
        params: &Params,
        last: bool,
        scalars: Vec<Real>,
        f: &mut dyn FnMut(&mut dyn GradSink) -> Result<()>,
    ) -> Result<()> {
        let n = params.vars().len();
        let total = params.count();
        if !last {
            let acc = self.acc.get_or_insert_with(|| vec![0.0; total]);
            let mut c = Collector {
                vars: params.vars(),
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
        // The first bucket is small, so communication starts early in backward (as in PyTorch's DDP); without
        // overlap there is nothing to start early.
        let first = if self.cfg.overlap { self.cfg.first_bucket_bytes.min(bucket_bytes) } else { bucket_bytes };
        let limit = (first / REAL_BYTES).max(1);
        let cur = self.spare.pop().unwrap_or_default();
        let mut c = Collector {
            vars: params.vars(),
            offsets: &self.offsets,
            next: n.checked_sub(1),
            scalars,
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

    fn backward_tensors(&mut self, params: &Params, last: bool, scalars: Vec<Real>, grads: TensorGrads) -> Result<()> {
        if self.on_device(params) {
            // The parameters on a device, and nothing to reduce or a device all-reduce: the gradients stay there,
            // summed over micro-batches, then over the ranks.
            let mut sum = Vec::with_capacity(params.vars().len());
            for (i, (_, v)) in params.vars().iter().enumerate() {
                let g = match grads.get(i).and_then(Option::as_ref) {
                    Some(g) => g.detach(),
                    None => v.as_tensor().zeros_like()?,
                };
                sum.push(match self.acc_tensors.as_ref().and_then(|a| a.get(i)) {
                    Some(a) => (a + g)?,
                    None => g.contiguous()?,
                });
            }
            if !last {
                self.acc_tensors = Some(sum);
                return Ok(());
            }
            self.acc_tensors = None;
            self.direct = Some(match self.world() {
                0 | 1 => (sum, scalars),
                _ => self.reduce_on_device(params, sum, scalars)?,
            });
            return Ok(());
        }
        if last && self.world() <= 1 && self.acc.is_none() {
            // One worker, one micro-batch: nothing to reduce, keep the tensors.
            let direct = params
                .vars()
                .iter()
                .enumerate()
                .map(|(i, (_, v))| match grads.get(i).and_then(Option::as_ref) {
                    Some(g) => Ok(g.detach().contiguous()?),
                    None => Ok(v.as_tensor().zeros_like()?),
                })
                .collect::<Result<Vec<_>>>()?;
            self.direct = Some((direct, scalars));
            return Ok(());
        }
        // Gradients on a device cross to the host a bucket at a time.
        let stage = params.resident().then_some(self.cfg.bucket_bytes);
        self.backward(params, last, scalars, &mut |sink| put_tensors(sink, &grads, stage))
    }

    fn compression_state(&self) -> Result<Vec<(String, Tensor)>> {
        match &self.compress {
            Some(z) => super::compress::gather(self.comm.as_ref(), z),
            None => Ok(Vec::new()),
        }
    }

    fn load_compression_state(&mut self, named: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        match &mut self.compress {
            Some(z) => super::compress::load(self.comm.as_ref(), z, named),
            None => Ok(()),
        }
    }

    fn step(&mut self, params: &Params, opt: &mut Optimizer, lr: f64, clip: Option<f64>) -> Result<StepTimes> {
        let t0 = Instant::now();
        if let Some((mut grads, scalars)) = self.direct.take() {
            let grad_norm = match clip {
                Some(max) if params.resident() => Some(clip_grad_norm_tensors(&mut grads, max)?),
                Some(max) => Some(clip_grad_norm(&mut grads, max)?),
                None => None,
            };
            opt.step(params, &grads, lr)?;
            return Ok(StepTimes {
                comm_s: std::mem::take(&mut self.device_comm_s),
                optimizer_s: t0.elapsed().as_secs_f64(),
                grad_norm,
                scalars,
                bubble: None,
            });
        }
        let vars = params.vars();
        let mut datas: Vec<(Vec<usize>, Vec<Real>)> = Vec::with_capacity(self.buckets.len());
        if let Some(z) = &mut self.compress {
            z.set_step(opt.t);
            if self.momentum {
                opt.freeze_second_moment(z.active());
            }
        }
        for (k, (members, b)) in self.buckets.drain(..).enumerate() {
            let data = match b {
                Bucket::Pending(p) => p.wait()?,
                Bucket::Ready(d) => d,
                Bucket::Deferred(mut d) => {
                    match (&self.comm, &mut self.compress) {
                        (Some(c), Some(z)) => {
                            // The gradients compressed; the step's scalars after them (the last bucket's) exact.
                            let grads: usize = members.iter().map(|i| vars[*i].1.elem_count()).sum();
                            let at = grads.min(d.len());
                            let (g, scalars) = d.split_at_mut(at);
                            let matrices = match z.config().codec.wants_matrices() {
                                true => super::compress::matrices(params, members.iter().copied()),
                                false => Vec::new(),
                            };
                            let moment = self.momentum && z.active();
                            let scaled = matches!(z.config().codec, shoal_comm::Codec::TopK { .. });
                            if moment {
                                super::compress::moment_in(opt, params, &members, g, c.size(), scaled)?;
                            }
                            crate::kernels::with_f32_mut(g, |g| z.all_reduce(c, k, g, &matrices))?;
                            if moment {
                                super::compress::moment_out(opt, params, &members, g, scaled)?;
                            }
                            if !scalars.is_empty() {
                                c.all_reduce(scalars, ReduceOp::Sum)?;
                            }
                        }
                        (Some(c), None) => match self.robust {
                            Some((rule, f)) => {
                                let grads: usize = members.iter().map(|i| vars[*i].1.elem_count()).sum();
                                let seed = opt.t.wrapping_mul(1 << 20) ^ k as u64;
                                let attack = self.attack.as_ref().map(|(a, liars)| (a, &liars[..], seed));
                                super::robust::all_reduce(c, rule, f, &mut d, grads, &mut self.gathered, attack)?;
                            }
                            None => c.all_reduce(&mut d, ReduceOp::Sum)?,
                        },
                        (None, _) => {}
                    }
                    d
                }
            };
            datas.push((members, data));
        }
        let comm_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut grads: Vec<Option<&mut [Real]>> = (0..vars.len()).map(|_| None).collect();
        let mut scalars = Vec::new();
        let last = datas.len().saturating_sub(1);
        for (k, (members, data)) in datas.iter_mut().enumerate() {
            let mut rest: &mut [Real] = data;
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
        let mut grads: Vec<&mut [Real]> = grads
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                g.ok_or_else(|| {
                    Error::InvalidArgument(format!("no gradient for {} (backward with last=true missing?)", vars[i].0))
                })
            })
            .collect::<Result<_>>()?;
        let grad_norm = clip.map(|max| clip_grad_norm_slices(&mut grads, max));
        let grads: Vec<&[Real]> = grads.into_iter().map(|g| &*g).collect();
        opt.step_slices(params, &grads, lr)?;
        for (_, mut data) in datas {
            data.clear();
            self.spare.push(data);
        }
        Ok(StepTimes { comm_s, optimizer_s: t1.elapsed().as_secs_f64(), grad_norm, scalars, bubble: None })
    }
}
