//! Composed layouts ("3D parallelism", as Megatron-LM and DeepSpeed compose it): `data × tensor × pipeline` ranks,
//! each data-parallel replica a pipeline of stages, each stage a tensor-parallel group, with ZeRO-1 over each
//! data-parallel group on request.
//!
//! - Rank layout (Megatron-LM's order): the tensor index varies fastest, then the data index, then the stage:
//!   `rank = t + tensor · (d + data · p)`. At [`Strategy::init`] each rank splits the world once into its three
//!   groups ([`Groups`], `Communicator::split`): its tensor group (same `d`, `p`), its data group (same `t`, `p`)
//!   and its pipeline (same `t`, `d`). The ranks of a tensor group sit next to each other (one host, where they
//!   fit), as the many all-reduces of a tensor-parallel model need.
//! - Init: the model's tensor group connected and its replicated parameters made the group's rank 0's
//!   (`super::tensor`), every parameter made data rank 0's, then the pipeline cut (`super::pipeline`: its stage's
//!   layers kept, the others' freed, by whole shapes so every rank of a tensor group cuts alike).
//! - A step: the micro-batches go through the pipeline's schedule (or, with one stage, one forward and backward
//!   each; the tensor-parallel model communicates inside them), each rank summing its own parameters' gradients.
//!   [`Strategy::step`] then makes the replicated parameters' gradients tensor rank 0's, sums the gradients over the
//!   data group — an all-reduce, or with `zero = 1` a reduce-scatter leaving each data rank its shard
//!   (`super::shards`) — takes the global norm for clipping in one all-reduce over the world (with the step's
//!   scalars and the pipeline's idle time; each gradient value counted once: split parts on every tensor rank,
//!   replicated ones on tensor rank 0, whole reduced gradients on data rank 0, shards on every data rank), and
//!   applies the optimizer: to the rank's parameters, or with `zero = 1` to its shard with the shard's moments,
//!   the updated shards all-gathered over the data group.
//! - Checkpoints hold whole tensors by their full names, as every strategy's: the tensor parts of each parameter
//!   (and optimizer moment; under ZeRO-1 first gathered over the data group) all-gathered and placed, then the
//!   stages' summed over the pipeline into the whole model. Loading cuts them again (tensor part, ZeRO shard), so a
//!   checkpoint of any layout resumes under any other, or under DDP or ZeRO at any world size.
//!
//! Memory: each rank holds its stage's parameters (its parts of them), their gradients and their optimizer state —
//! a `1/data` shard of it under ZeRO-1 — which is what [`Strategy::param_bytes`] and the others report.

use crate::{REAL_BYTES, Real};
use std::collections::HashMap;
use std::time::Instant;

use candle_core::Tensor;
use shoal_comm::{Communicator, ReduceOp};

use super::pipeline::{Pipeline, PipelineConfig};
use super::schedule::theoretical_bubble;
use super::shards::Shards;
use super::tensor::{Adder, broadcast_grads, connect_group, gather_parts};
use super::{Bubble, GradSink, StepTimes, Strategy, TensorGrads, broadcast_from_rank0};
use crate::error::{Error, Result};
use crate::kernels::with_slice;
use crate::optim::{OptimConfig, Optimizer, sum_sq, update};
use crate::params::Params;
use crate::spec::PipelineSchedule;

/// The degrees of a composed layout and how its pipeline runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutConfig {
    /// Data-parallel replicas.
    pub data: usize,
    /// Ranks each layer is split across.
    pub tensor: usize,
    /// Pipeline stages.
    pub pipeline: usize,
    /// Micro-batches a step (the pipeline's; with one stage, the micro-batches the trainer is given).
    pub micro_batches: usize,
    pub schedule: PipelineSchedule,
    /// Model chunks per pipeline rank under the interleaved schedule (1 under the others).
    pub virtual_stages: usize,
    /// ZeRO stage inside each data group: 0 or 1.
    pub zero: u8,
}

impl LayoutConfig {
    /// The ranks the layout needs.
    pub fn ranks(&self) -> usize {
        self.data * self.tensor * self.pipeline
    }

    /// Rank `rank`'s place: its tensor index, data index and stage (the tensor index varies fastest).
    pub fn coords(&self, rank: usize) -> (usize, usize, usize) {
        let (t, d) = (self.tensor.max(1), self.data.max(1));
        (rank % t, (rank / t) % d, rank / (t * d))
    }
}

/// One rank's three groups, split from the world.
#[derive(Debug, Clone)]
pub struct Groups {
    /// The ranks that split every layer of one stage with this one.
    pub tensor: Communicator,
    /// The ranks that hold the same part of the model in the other replicas.
    pub data: Communicator,
    /// The stages of this rank's replica (this rank's tensor index in each).
    pub pipeline: Communicator,
}

impl Groups {
    /// Splits `world` (a collective over it) into this rank's groups of the layout `cfg`.
    pub fn split(world: &Communicator, cfg: &LayoutConfig) -> Result<Groups> {
        if world.size() != cfg.ranks() {
            return Err(Error::InvalidArgument(format!(
                "a layout of data {} × tensor {} × pipeline {} = {} ranks on a world of {}",
                cfg.data,
                cfg.tensor,
                cfg.pipeline,
                cfg.ranks(),
                world.size()
            )));
        }
        let (t, d, p) = cfg.coords(world.rank());
        let one = |colour: usize, key: usize, what: &str| -> Result<Communicator> {
            let colour = u32::try_from(colour)
                .map_err(|_| Error::InvalidArgument(format!("too many {what} groups: {colour}")))?;
            world
                .split(Some(colour), key as i64)?
                .ok_or_else(|| Error::InvalidArgument(format!("rank {} is in no {what} group", world.rank())))
        };
        let tensor = one(p * cfg.data + d, t, "tensor")?;
        let data = one(p * cfg.tensor + t, d, "data")?;
        let pipeline = one(d * cfg.tensor + t, p, "pipeline")?;
        Ok(Groups { tensor, data, pipeline })
    }
}

/// ZeRO-1 over the data group: the cut of this rank's parameters into shards, and the shard's optimizer state.
struct ZeroState {
    shards: Shards,
    m: Vec<Real>,
    v: Vec<Real>,
    /// Whether the moments hold anything yet (SGD's first momentum is the gradient itself).
    started: bool,
    /// This rank's shard of the step's summed gradients.
    grad: Vec<Real>,
    /// Scratch for the reduce-scatter's slice.
    mine: Vec<Real>,
}

/// A composed layout (see the module documentation).
pub struct Composed {
    world: Option<Communicator>,
    cfg: LayoutConfig,
    groups: Option<Groups>,
    /// The schedule, when there are stages.
    pipe: Option<Pipeline>,
    /// This rank's parameters (its stage's): their indices among the model's, and they alone.
    members: Vec<usize>,
    own: Params,
    /// Per own parameter: whether it is split across the tensor group (else whole on every tensor rank).
    split: Vec<bool>,
    /// Gradients summed over the step's micro-batches, per own parameter (with one stage; else the pipeline's).
    acc: Vec<Vec<Real>>,
    scalars: Vec<Real>,
    /// The optimizer of the own parameters (without ZeRO).
    opt: Option<Optimizer>,
    zero: Option<ZeroState>,
    /// The gradients flat, for the data group's collective (reused).
    flat: Vec<Real>,
}

impl std::fmt::Debug for Composed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Composed").field("cfg", &self.cfg).field("members", &self.members).finish_non_exhaustive()
    }
}

impl Composed {
    /// A rank of `world` (every rank of the job) under the layout `cfg`.
    pub fn new(world: Option<Communicator>, cfg: LayoutConfig) -> Composed {
        Composed {
            world,
            cfg,
            groups: None,
            pipe: None,
            members: Vec::new(),
            own: Params::default(),
            split: Vec::new(),
            acc: Vec::new(),
            scalars: Vec::new(),
            opt: None,
            zero: None,
            flat: Vec::new(),
        }
    }

    /// This rank's groups (after `init`).
    pub fn groups(&self) -> Option<&Groups> {
        self.groups.as_ref()
    }

    fn groups_or_err(&self) -> Result<&Groups> {
        self.groups.as_ref().ok_or_else(|| Error::InvalidArgument("a composed layout used before its init".into()))
    }

    fn grads_mut(&mut self) -> &mut Vec<Vec<Real>> {
        match &mut self.pipe {
            Some(p) => p.grads_mut(),
            None => &mut self.acc,
        }
    }

    /// The own parameters' optimizer, made with `cfg` if it is not yet.
    fn optimizer(&mut self, cfg: OptimConfig) -> &mut Optimizer {
        let own = &self.own;
        self.opt.get_or_insert_with(|| Optimizer::new(cfg, own))
    }

    /// Whole named tensors of every parameter of the model (`suffix` appended to the names) from this rank's values
    /// of its own parameters (`local[k]`: own parameter `k`, its tensor part where it is split): the parts
    /// all-gathered over the tensor group and placed, the stages' put into a buffer of the whole model and summed
    /// over the pipeline. A collective over the world.
    fn whole(&self, params: &Params, local: Vec<Vec<Real>>, suffix: &str) -> Result<Vec<(String, Tensor)>> {
        let groups = self.groups_or_err()?;
        let wholes = if self.cfg.tensor > 1 {
            let items = local
                .into_iter()
                .enumerate()
                .map(|(k, v)| (params.split(self.members[k]).filter(|_| self.split[k]).cloned(), v))
                .collect();
            gather_parts(&groups.tensor, items)?
        } else {
            local
        };
        let dims: Vec<Vec<usize>> = (0..params.vars().len()).map(|i| params.full_dims(i)).collect();
        let named = |i: usize, v: Vec<Real>| -> Result<(String, Tensor)> {
            let name = format!("{}{suffix}", params.vars()[i].0);
            Ok((name, Tensor::from_vec(v, dims[i].as_slice(), &candle_core::Device::Cpu)?))
        };
        if self.pipe.is_none() {
            return wholes.into_iter().enumerate().map(|(i, v)| named(i, v)).collect();
        }
        let mut offsets = Vec::with_capacity(dims.len());
        let mut total = 0;
        for d in &dims {
            offsets.push(total);
            total += d.iter().product::<usize>();
        }
        let mut flat = vec![0.0 as Real; total];
        for (k, v) in wholes.iter().enumerate() {
            let o = offsets[self.members[k]];
            flat.get_mut(o..o + v.len())
                .ok_or_else(|| Error::InvalidArgument("a stage's state does not fit its parameters".into()))?
                .copy_from_slice(v);
        }
        groups.pipeline.all_reduce(&mut flat, ReduceOp::Sum)?;
        (0..dims.len())
            .map(|i| {
                let n = dims[i].iter().product::<usize>();
                named(i, flat[offsets[i]..offsets[i] + n].to_vec())
            })
            .collect()
    }

    /// This rank's values of one optimizer moment (`"m"` or `"v"`) per own parameter (zeros where it has none yet).
    /// Under ZeRO-1 a collective over the data group.
    fn local_moment(&self, suffix: &str) -> Result<Vec<Vec<Real>>> {
        let sizes: Vec<usize> = self.own.vars().iter().map(|(_, v)| v.elem_count()).collect();
        if let Some(z) = &self.zero {
            let shard = if suffix == "m" { &z.m } else { &z.v };
            let full = if shard.is_empty() { vec![0.0 as Real; z.shards.total] } else { z.shards.gather(shard)? };
            return Ok(sizes.iter().enumerate().map(|(k, &n)| full[z.shards.offsets[k]..][..n].to_vec()).collect());
        }
        let state: HashMap<String, Tensor> =
            self.opt.as_ref().map(|o| o.state(&self.own)).unwrap_or_default().into_iter().collect();
        self.own
            .vars()
            .iter()
            .zip(&sizes)
            .map(|((name, _), &n)| match state.get(&format!("{name}.{suffix}")) {
                Some(t) => Ok(t.flatten_all()?.to_vec1::<Real>()?),
                None => Ok(vec![0.0 as Real; n]),
            })
            .collect()
    }
}

impl Strategy for Composed {
    fn name(&self) -> &'static str {
        "3d"
    }

    fn comm(&self) -> Option<&Communicator> {
        self.world.as_ref()
    }

    fn init(&mut self, params: &Params) -> Result<()> {
        let cfg = self.cfg;
        if cfg.data == 0 || cfg.tensor == 0 || cfg.pipeline == 0 {
            return Err(Error::InvalidArgument(format!("a layout of degrees {cfg:?}: each at least 1")));
        }
        if cfg.zero > 1 {
            return Err(Error::InvalidArgument(format!(
                "ZeRO-{} inside a composed layout is not available yet (0 or 1)",
                cfg.zero
            )));
        }
        let world = match &self.world {
            Some(w) => w.clone(),
            None if cfg.ranks() == 1 => Communicator::local_world(1, shoal_comm::CommConfig::default())?
                .pop()
                .ok_or_else(|| Error::InvalidArgument("no communicator for one rank".into()))?,
            None => {
                return Err(Error::InvalidArgument("a composed layout of several ranks needs a communicator".into()));
            }
        };
        let groups = Groups::split(&world, &cfg)?;
        if cfg.tensor > 1 {
            connect_group(&groups.tensor, params)?;
        } else if params.shard().is_some() {
            return Err(Error::InvalidArgument(
                "the model was built for tensor parallelism, the layout has parallel.tensor = 1".into(),
            ));
        }
        if cfg.data > 1 {
            broadcast_from_rank0(Some(&groups.data), params)?;
        }
        if cfg.pipeline > 1 {
            let mut pipe = Pipeline::new(
                Some(groups.pipeline.clone()),
                PipelineConfig {
                    stages: cfg.pipeline,
                    micro_batches: cfg.micro_batches,
                    schedule: cfg.schedule,
                    virtual_stages: cfg.virtual_stages,
                    // The composed step updates and re-shards the stage's parameters itself: cut once.
                    balance: crate::spec::StageBalance::Params,
                },
            );
            pipe.init(params)?;
            self.members = pipe.members();
            self.pipe = Some(pipe);
        } else {
            self.members = (0..params.vars().len()).collect();
        }
        self.own = Params::from_vars(self.members.iter().map(|&i| params.vars()[i].clone()).collect());
        self.split = self.members.iter().map(|&i| cfg.tensor > 1 && params.split(i).is_some()).collect();
        if self.pipe.is_none() {
            self.acc = self.own.vars().iter().map(|(_, v)| vec![0.0 as Real; v.elem_count()]).collect();
        }
        if cfg.zero == 1 {
            let shards = Shards::new(Some(groups.data.clone()), &self.own, Shards::by_size(&self.own, usize::MAX))?;
            self.flat = vec![0.0 as Real; shards.padded_max()];
            self.zero = Some(ZeroState {
                shards,
                m: Vec::new(),
                v: Vec::new(),
                started: false,
                grad: Vec::new(),
                mine: Vec::new(),
            });
        }
        self.world = Some(world);
        self.groups = Some(groups);
        Ok(())
    }

    fn backward(
        &mut self,
        _params: &Params,
        last: bool,
        scalars: Vec<Real>,
        f: &mut dyn FnMut(&mut dyn GradSink) -> Result<()>,
    ) -> Result<()> {
        if self.pipe.is_some() {
            return Err(Error::InvalidArgument(
                "a pipeline stage runs the step's micro-batches itself (Trainer::run_micro_batches)".into(),
            ));
        }
        let next = self.acc.len().checked_sub(1);
        let mut sink = Adder { acc: &mut self.acc, next, scalars: None };
        f(&mut sink)?;
        if last {
            self.scalars = sink.scalars.unwrap_or(scalars);
        }
        Ok(())
    }

    fn backward_tensors(&mut self, params: &Params, last: bool, scalars: Vec<Real>, grads: TensorGrads) -> Result<()> {
        if self.pipe.is_some() {
            return Err(Error::InvalidArgument(
                "a pipeline stage runs the step's micro-batches itself (Trainer::run_micro_batches)".into(),
            ));
        }
        super::add_tensors(&mut self.acc, params, &grads)?;
        if last {
            self.scalars = scalars;
        }
        Ok(())
    }

    fn splits_model(&self) -> bool {
        self.cfg.pipeline > 1
    }

    fn run_micro_batches(
        &mut self,
        params: &Params,
        count: usize,
        forward: &mut dyn FnMut(usize) -> Result<Tensor>,
        loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<()> {
        if let Some(p) = &mut self.pipe {
            return p.run_micro_batches(params, count, forward, loss);
        }
        super::each_micro_batch(self, params, count, forward, loss)
    }

    fn forward_stage(&self, params: &Params, forward: &mut dyn FnMut() -> Result<Tensor>) -> Result<Option<Tensor>> {
        match &self.pipe {
            Some(p) => p.forward_stage(params, forward),
            None => forward().map(Some),
        }
    }

    fn tensor_degree(&self) -> usize {
        self.cfg.tensor
    }

    fn stage_layers(&self) -> Option<Vec<std::ops::Range<usize>>> {
        self.pipe.as_ref().and_then(Pipeline::stage_layers)
    }

    fn attach_step_scalars(&mut self, values: Vec<Real>) {
        self.scalars = values;
    }

    fn step(&mut self, params: &Params, opt: &mut Optimizer, lr: f64, clip: Option<f64>) -> Result<StepTimes> {
        let t0 = Instant::now();
        let cfg = self.cfg;
        let groups = self.groups_or_err()?.clone();
        let world = self.world.clone().ok_or_else(|| Error::InvalidArgument("no world communicator".into()))?;
        let mut grads = std::mem::take(self.grads_mut());
        if grads.len() != self.own.vars().len() {
            return Err(Error::InvalidArgument("the step's gradients do not match this rank's parameters".into()));
        }
        // The replicated parameters' gradients: the tensor group's rank 0's.
        if cfg.tensor > 1 {
            let replicated: Vec<usize> = (0..grads.len()).filter(|&k| !self.split[k]).collect();
            broadcast_grads(&groups.tensor, &mut grads, &replicated)?;
        }
        let tensor_rank = groups.tensor.rank();
        let counted = |k: usize| self.split[k] || tensor_rank == 0;
        // Summed over the data group: whole (all-reduce), or this rank's shard (ZeRO-1's reduce-scatter).
        let mut sq = 0f64;
        match &mut self.zero {
            None => {
                if cfg.data > 1 {
                    self.flat.clear();
                    grads.iter().for_each(|g| self.flat.extend_from_slice(g));
                    groups.data.all_reduce(&mut self.flat, ReduceOp::Sum)?;
                    let mut off = 0;
                    for g in &mut grads {
                        let n = g.len();
                        g.copy_from_slice(&self.flat[off..off + n]);
                        off += n;
                    }
                }
                if groups.data.rank() == 0 {
                    sq = (0..grads.len()).filter(|&k| counted(k)).map(|k| sum_sq(&grads[k])).sum();
                }
            }
            Some(z) => {
                self.flat.iter_mut().for_each(|x| *x = 0.0);
                for (k, g) in grads.iter().enumerate() {
                    let o = z.shards.offsets[k];
                    self.flat[o..o + g.len()].copy_from_slice(g);
                }
                z.grad.clear();
                z.grad.resize(z.shards.shard, 0.0);
                z.shards.reduce_bucket(0, &self.flat, &mut z.mine, &mut z.grad, None)?;
                // The shard covers the flat range from `lo`; each parameter's values in it counted once.
                let lo = z.shards.rank() * z.shards.slice_len(0);
                let hi = lo + z.shards.shard;
                for (k, (_, v)) in self.own.vars().iter().enumerate() {
                    let (a, b) = (z.shards.offsets[k].max(lo), (z.shards.offsets[k] + v.elem_count()).min(hi));
                    if a < b && counted(k) {
                        sq += sum_sq(&z.grad[a - lo..b - lo]);
                    }
                }
            }
        }
        let (idle, ran) = self.pipe.as_ref().map_or((0.0, 0), Pipeline::idle);
        let scalars = std::mem::take(&mut self.scalars);
        let mut summed: Vec<f64> = [sq, idle].into_iter().chain(scalars.iter().map(|v| f64::from(*v))).collect();
        world.all_reduce(&mut summed, ReduceOp::Sum)?;
        let shard_s = params.shard().map_or(0.0, |s| s.take_comm_seconds());
        let comm_s = t0.elapsed().as_secs_f64() + shard_s;
        let t1 = Instant::now();
        let norm = summed[0].sqrt();
        let scale = match clip {
            Some(max) if norm > max && norm > 0.0 => Some((max / norm) as Real),
            _ => None,
        };
        let own = self.own.clone();
        let mut gathered = None;
        match &mut self.zero {
            None => {
                if let Some(s) = scale {
                    grads.iter_mut().for_each(|g| g.iter_mut().for_each(|x| *x *= s));
                }
                let inner = self.optimizer(opt.config());
                let slices: Vec<&[Real]> = grads.iter().map(Vec::as_slice).collect();
                inner.step_slices(&own, &slices, lr)?;
                opt.t = inner.t;
            }
            Some(z) => {
                if let Some(s) = scale {
                    z.grad.iter_mut().for_each(|x| *x *= s);
                }
                opt.t += 1;
                let (ocfg, t, first, n) = (opt.config(), opt.t, !z.started, z.shards.shard);
                let mut p = z.shards.read_shard(&own)?;
                match ocfg {
                    OptimConfig::Sgd { momentum: 0.0, .. } => update(ocfg, t, lr, &mut p, &z.grad, None, None)?,
                    OptimConfig::Sgd { .. } => {
                        z.m.resize(n, 0.0);
                        update(ocfg, t, lr, &mut p, &z.grad, Some((&mut z.m, first)), None)?;
                    }
                    OptimConfig::AdamW { .. } => {
                        z.m.resize(n, 0.0);
                        z.v.resize(n, 0.0);
                        update(ocfg, t, lr, &mut p, &z.grad, Some((&mut z.m, first)), Some((&mut z.v, false)))?;
                    }
                }
                z.started = true;
                gathered = Some(p);
            }
        }
        let optimizer_s = t1.elapsed().as_secs_f64();
        let t2 = Instant::now();
        if let (Some(p), Some(z)) = (gathered, &self.zero) {
            let full = z.shards.gather(&p)?;
            z.shards.write_params(&own, &full)?;
        }
        grads.iter_mut().for_each(|g| g.fill(0.0));
        *self.grads_mut() = grads;
        let bubble = self.pipe.as_ref().map(|_| Bubble {
            rank: idle,
            mean: summed[1] / world.size() as f64,
            theory: theoretical_bubble(cfg.pipeline, ran, self.pipe.as_ref().map_or(1, Pipeline::chunks)),
        });
        // Every rank of a tensor group has its replica's loss: counted once.
        let tensor = cfg.tensor as f64;
        Ok(StepTimes {
            comm_s: comm_s + t2.elapsed().as_secs_f64(),
            optimizer_s,
            grad_norm: clip.map(|_| norm),
            scalars: summed[2..].iter().map(|v| (v / tensor) as Real).collect(),
            bubble,
        })
    }

    fn optimizer_bytes(&self, _opt: &Optimizer) -> usize {
        match &self.zero {
            Some(z) => (z.m.len() + z.v.len()) * REAL_BYTES,
            None => self.opt.as_ref().map_or(0, Optimizer::state_bytes),
        }
    }

    /// The own parameters' summed gradients, the flat buffer of the data group's collective and, under ZeRO-1, the
    /// shard's.
    fn gradient_bytes(&self, _params: &Params) -> usize {
        let shard = self.zero.as_ref().map_or(0, |z| z.grad.capacity() + z.mine.capacity());
        (self.own.count() + self.flat.capacity() + shard) * REAL_BYTES
    }

    fn param_bytes(&self, _params: &Params) -> usize {
        self.own.count() * REAL_BYTES
    }

    fn model_state(&self, params: &Params) -> Result<Vec<(String, Tensor)>> {
        let mut local = Vec::with_capacity(self.own.vars().len());
        for (_, v) in self.own.vars() {
            let mut values = Vec::with_capacity(v.elem_count());
            with_slice(v.as_tensor(), |s| values.extend_from_slice(s))?;
            local.push(values);
        }
        self.whole(params, local, "")
    }

    fn optimizer_state(&self, params: &Params, opt: &Optimizer) -> Result<Vec<(String, Tensor)>> {
        // The same moments on every rank (one configuration, stepped together): the same collectives.
        let moments: &[&str] = match (opt.t, opt.config()) {
            (0, _) | (_, OptimConfig::Sgd { momentum: 0.0, .. }) => &[],
            (_, OptimConfig::Sgd { .. }) => &["m"],
            (_, OptimConfig::AdamW { .. }) => &["m", "v"],
        };
        let mut out = Vec::new();
        for m in moments {
            let local = self.local_moment(m)?;
            out.extend(self.whole(params, local, &format!(".{m}"))?);
        }
        // In the optimizer's order: each parameter's moments together.
        super::in_optimizer_order(params, &mut out);
        Ok(out)
    }

    /// Keeps this rank's part of whole moments (saved under any layout or strategy): its stage's parameters, its
    /// tensor part of each, and under ZeRO-1 its shard of those.
    fn load_optimizer_state(
        &mut self,
        params: &Params,
        opt: &mut Optimizer,
        t: u64,
        named: &HashMap<String, Tensor>,
    ) -> Result<()> {
        let tensor_rank = self.groups_or_err()?.tensor.rank();
        let mut mine: HashMap<String, Vec<Real>> = HashMap::new();
        for (k, (name, var)) in self.own.vars().iter().enumerate() {
            let i = self.members[k];
            for suffix in ["m", "v"] {
                let key = format!("{name}.{suffix}");
                let Some(whole) = named.get(&key) else { continue };
                let full = params.full_dims(i);
                if whole.dims() != full.as_slice() {
                    return Err(Error::Checkpoint(format!(
                        "optimizer state {key} has shape {:?}, the parameter {full:?}",
                        whole.dims()
                    )));
                }
                let values = whole.flatten_all()?.to_vec1::<Real>()?;
                let part = match params.split(i).filter(|_| self.split[k]) {
                    Some(split) => split.take(&values, tensor_rank, self.cfg.tensor)?,
                    None => values,
                };
                if part.len() != var.elem_count() {
                    return Err(Error::Checkpoint(format!("optimizer state {key} does not fit this rank's part")));
                }
                mine.insert(key, part);
            }
        }
        opt.t = t;
        match &mut self.zero {
            Some(z) => {
                let mut any = false;
                for suffix in ["m", "v"] {
                    let mut full = vec![0.0 as Real; z.shards.total];
                    let mut found = false;
                    for (k, (name, _)) in self.own.vars().iter().enumerate() {
                        if let Some(v) = mine.get(&format!("{name}.{suffix}")) {
                            let o = z.shards.offsets[k];
                            full[o..o + v.len()].copy_from_slice(v);
                            found = true;
                        }
                    }
                    let cut = if found { z.shards.cut(&full) } else { Vec::new() };
                    any |= found;
                    if suffix == "m" {
                        z.m = cut;
                    } else {
                        z.v = cut;
                    }
                }
                z.started = any;
            }
            None => {
                let own = self.own.clone();
                let tensors = own
                    .vars()
                    .iter()
                    .flat_map(|(name, var)| ["m", "v"].map(|s| (format!("{name}.{s}"), var.shape().clone())))
                    .filter_map(|(key, shape)| mine.remove(&key).map(|v| (key, v, shape)))
                    .map(|(key, v, shape)| Ok((key, Tensor::from_vec(v, shape, &candle_core::Device::Cpu)?)))
                    .collect::<Result<HashMap<_, _>>>()?;
                self.optimizer(opt.config()).load_state(&own, t, &tensors)?;
            }
        }
        Ok(())
    }
}
