//! Pipeline parallel: the model's layers cut into `stages` stages of consecutive layers, rank `s` holding only stage
//! `s`'s parameters, gradients and optimizer state; under the interleaved schedule, into `stages × V` chunks of
//! consecutive layers, rank `r` holding chunks `r, r + stages, r + 2·stages, …` (Megatron-LM's virtual stages).
//!
//! - [`Strategy::init`]: rank 0's parameters broadcast (every rank starts from the same model), the layers split
//!   into stages (chunks) of as even a parameter count as consecutive layers allow ([`balance`]), every other
//!   rank's parameters freed on this rank. Before each forward the model is cut at the chunk it runs
//!   (`crate::layers`: its forward runs only the chunk's layers, the first of them on the activation the previous
//!   rank sent).
//! - [`Strategy::run_micro_batches`]: the step's micro-batches in the order of the schedule
//!   (`super::schedule`: GPipe, 1F1B or interleaved 1F1B). A forward's output goes to the next rank with the
//!   communicator's `send` (a small header with its shape, then the values); the chunk's input is a leaf variable,
//!   so its backward — the loss's on the last chunk of the model, `sum(y · dy)` on the others, `dy` the gradient the
//!   next rank sent back — gives the input's gradient to send to the previous rank and the chunk's parameters'
//!   gradients, summed over the micro-batches. The time spent in those sends and receives is this rank's idle time:
//!   over the schedule's time it is the measured bubble.
//! - [`Strategy::step`]: one all-reduce over the stages of the squared gradient norms (the global norm, for
//!   clipping), the bubbles and the step's scalars; then each stage's optimizer on its own parameters.
//! - Checkpoints hold whole tensors by their full names, as DDP's: every rank's stage put into a buffer of the whole
//!   model (zeros elsewhere) and summed with an all-reduce, for the parameters and for each optimizer moment. A
//!   pipeline checkpoint resumes under DDP or ZeRO at any world size, and theirs under a pipeline.

use crate::{REAL_BYTES, Real};
use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use candle_core::{Tensor, Var};
use shoal_comm::{Communicator, ReduceOp};

use super::schedule::{Op, Shape, ops, theoretical_bubble};
use super::{Bubble, GradSink, StepTimes, Strategy, TensorGrads, broadcast_from_rank0};
use crate::error::{Error, Result};
use crate::kernels::{replace_storage, with_slice};
use crate::optim::{OptimConfig, Optimizer, sum_sq};
use crate::params::Params;
use crate::spec::{PipelineSchedule, StageBalance};

/// How a [`Pipeline`] cuts and schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineConfig {
    pub stages: usize,
    pub micro_batches: usize,
    pub schedule: PipelineSchedule,
    /// Model chunks per rank under the interleaved schedule (`parallel.virtual_stages`; 1 under the others,
    /// whatever is set here).
    pub virtual_stages: usize,
    /// Whether the stages are cut again by measured time after the first steps ([`Pipeline`]).
    pub balance: StageBalance,
}

impl PipelineConfig {
    /// Model chunks per rank: `virtual_stages` under the interleaved schedule, else 1.
    pub fn chunks(&self) -> usize {
        match self.schedule {
            PipelineSchedule::Interleaved => self.virtual_stages,
            _ => 1,
        }
    }
}

/// Up to 7 dimensions in an activation's header (the header's first value is the count).
const HEADER: usize = 8;

/// Under `balance = "time"`: the schedules timed (after the first, which pays for first-time allocations), after
/// which the stages are cut again.
const PROFILE_FROM: usize = 1;
const PROFILE_RUNS: usize = 2;

/// What one chunk keeps of a micro-batch between its forward and its backward.
struct Held {
    /// The chunk's input as a leaf variable (none on the model's first chunk).
    input: Option<Var>,
    /// The chunk's output with its graph (the weighted loss on the model's last chunk).
    output: Tensor,
}

/// Pipeline parallel (see the module documentation).
pub struct Pipeline {
    comm: Option<Communicator>,
    cfg: PipelineConfig,
    stage: usize,
    /// The whole cut (every rank's chunks: chunk `c` of rank `r` is `cuts[c · stages + r]`, the same on every rank),
    /// this rank's chunks' layers (one chunk but under the interleaved schedule), and their parameters (indices into
    /// the model's, ascending).
    cuts: Vec<Range<usize>>,
    chunks: Vec<Range<usize>>,
    members: Vec<usize>,
    /// The stage's parameters alone, for its optimizer.
    own: Params,
    /// The stage's optimizer (made at the first step or restore, with the trainer's configuration).
    opt: Option<Optimizer>,
    /// Gradients summed over the step's micro-batches, per stage parameter.
    acc: Vec<Vec<Real>>,
    scalars: Vec<Real>,
    /// The last schedule's idle and total seconds.
    idle_s: f64,
    span_s: f64,
    /// Micro-batches of the last schedule.
    ran: usize,
    /// Schedules run so far, and the seconds each layer of the model took on this rank in the timed ones (forward,
    /// backward and, for the model's last layer, the loss; zero for other stages' layers).
    runs: usize,
    layer_s: Vec<f64>,
    /// Whether the stages were cut by measured time already (or never will be).
    balanced: bool,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("cfg", &self.cfg)
            .field("stage", &self.stage)
            .field("chunks", &self.chunks)
            .finish_non_exhaustive()
    }
}

/// The step's `samples` split into at most `micro` contiguous micro-batches of near-equal size (fewer when there
/// are fewer samples: the last global batch of an epoch may be short), each a range of sample indices.
pub fn micro_batch_ranges(samples: usize, micro: usize) -> Vec<Range<usize>> {
    let m = micro.min(samples).max(1);
    (0..m).map(|i| (i * samples / m)..((i + 1) * samples / m)).filter(|r| !r.is_empty()).collect()
}

/// Cuts layers of `costs` into `stages` runs of consecutive layers with the smallest largest cost (ties: the
/// earliest cut); each run's range of layers. `None` when there are fewer layers than stages.
pub fn balance(costs: &[usize], stages: usize) -> Option<Vec<Range<usize>>> {
    balance_within(costs, costs, usize::MAX, stages)
}

/// The cut by time that keeps memory near the even one: the layers of `costs` (their times, measured or estimated,
/// in any integer unit) into `parts` runs with the smallest largest time, no run holding more than 10% above the
/// largest run of the cut by `sizes` (parameters) alone. `None` when no cut keeps to it. What the strategy does
/// under `parallel.balance = "time"`, and what the planner expects it to do.
pub fn time_balance(costs: &[usize], sizes: &[usize], parts: usize) -> Option<Vec<Range<usize>>> {
    let even = balance(sizes, parts)
        .map(|c| c.iter().map(|r| sizes[r.clone()].iter().sum::<usize>()).max().unwrap_or(0))
        .unwrap_or(usize::MAX);
    balance_within(costs, sizes, even.saturating_add(even / 10), parts)
}

/// As [`balance`], with every run's total of `sizes` (one per layer, as `costs`) at most `cap`; `None` also when no
/// cut keeps to it.
pub fn balance_within(costs: &[usize], sizes: &[usize], cap: usize, stages: usize) -> Option<Vec<Range<usize>>> {
    let n = costs.len();
    if stages == 0 || stages > n || sizes.len() != n {
        return None;
    }
    let sums = |v: &[usize]| -> Vec<usize> {
        std::iter::once(0)
            .chain(v.iter().scan(0usize, |s, c| {
                *s = s.saturating_add(*c);
                Some(*s)
            }))
            .collect()
    };
    let (prefix, size) = (sums(costs), sums(sizes));
    let cost = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][i]: the smallest largest cost of cutting the first i layers into k runs; from[k][i]: where the last
    // run starts.
    let mut best = vec![vec![usize::MAX; n + 1]; stages + 1];
    let mut from = vec![vec![0; n + 1]; stages + 1];
    best[0][0] = 0;
    for k in 1..=stages {
        for i in k..=n {
            for j in (k - 1)..i {
                if best[k - 1][j] == usize::MAX || size[i] - size[j] > cap {
                    continue;
                }
                let c = best[k - 1][j].max(cost(j, i));
                if c < best[k][i] {
                    best[k][i] = c;
                    from[k][i] = j;
                }
            }
        }
    }
    if best[stages][n] == usize::MAX {
        return None;
    }
    let mut cuts = vec![0..0; stages];
    let mut end = n;
    for k in (1..=stages).rev() {
        let start = from[k][end];
        cuts[k - 1] = start..end;
        end = start;
    }
    Some(cuts)
}

impl Pipeline {
    /// Stage `comm.rank()` of a pipeline of `cfg.stages` ranks (the communicator's size).
    pub fn new(comm: Option<Communicator>, cfg: PipelineConfig) -> Pipeline {
        let stage = comm.as_ref().map_or(0, Communicator::rank);
        Pipeline {
            comm,
            cfg,
            stage,
            cuts: Vec::new(),
            chunks: Vec::new(),
            members: Vec::new(),
            own: Params::default(),
            opt: None,
            acc: Vec::new(),
            scalars: Vec::new(),
            idle_s: 0.0,
            span_s: 0.0,
            ran: cfg.micro_batches,
            runs: 0,
            layer_s: Vec::new(),
            balanced: cfg.balance == StageBalance::Params,
        }
    }

    /// This rank's stage and the layers of each of its chunks (after `init`).
    pub fn stage(&self) -> (usize, Vec<Range<usize>>) {
        (self.stage, self.chunks.clone())
    }

    /// The indices of this rank's parameters among the model's, ascending (after `init`).
    pub(crate) fn members(&self) -> Vec<usize> {
        self.members.clone()
    }

    /// Model chunks per rank.
    pub(crate) fn chunks(&self) -> usize {
        self.cfg.chunks()
    }

    /// The shape of a step of `micro` micro-batches.
    fn shape(&self, micro: usize) -> Shape {
        Shape { stages: self.cfg.stages, chunks: self.cfg.chunks(), micro }
    }

    /// The step's gradients of the stage's parameters, summed over its micro-batches (one buffer per parameter, in
    /// order): for a strategy that combines them itself before its own update, leaving them zero for the next step.
    pub(crate) fn grads_mut(&mut self) -> &mut Vec<Vec<Real>> {
        &mut self.acc
    }

    /// This rank's idle time over its time running the last schedule, and that schedule's micro-batches.
    pub(crate) fn idle(&self) -> (f64, usize) {
        (if self.span_s > 0.0 { self.idle_s / self.span_s } else { 0.0 }, self.ran)
    }

    /// Whether this rank's chunk `chunk` ends the model (computes the loss).
    fn last(&self, chunk: usize) -> bool {
        self.shape(0).is_last(self.stage, chunk)
    }

    /// Cuts the model at this rank's chunk `chunk` for the next forward, on `input` (the activation the previous
    /// rank sent; none for the model's first chunk).
    fn enter(&self, params: &Params, chunk: usize, input: Option<&Var>) -> Result<()> {
        let layers = self.chunks.get(chunk).ok_or_else(|| {
            Error::InvalidArgument(format!("pipeline schedule: rank {} holds no chunk {chunk}", self.stage))
        })?;
        params.layers().cut(Some(layers.clone()));
        match input {
            Some(v) => params.layers().feed(v.as_tensor().clone()),
            None if !self.shape(0).is_first(self.stage, chunk) => {
                return Err(Error::InvalidArgument(format!(
                    "pipeline schedule: no activation for chunk {chunk} of rank {}",
                    self.stage
                )));
            }
            None => {}
        }
        Ok(())
    }

    /// Keeps this rank's chunks of `cuts` (the model's layers cut into `stages × V` runs; `ranges`: each layer's
    /// parameters): their parameters stay, the others' tensors keep their shapes and hold nothing, and the model is
    /// cut at the first chunk.
    fn keep(&mut self, params: &Params, ranges: &[(String, Range<usize>)], cuts: &[Range<usize>]) -> Result<()> {
        let v = self.cfg.chunks();
        self.chunks = (0..v).map(|c| cuts[c * self.cfg.stages + self.stage].clone()).collect();
        self.cuts = cuts.to_vec();
        self.members = self.chunks.iter().flat_map(|l| ranges[l.start].1.start..ranges[l.end - 1].1.end).collect();
        for (i, (name, var)) in params.vars().iter().enumerate() {
            if self.members.binary_search(&i).is_err() {
                replace_storage(var.as_tensor(), Vec::new()).map_err(|e| {
                    Error::InvalidArgument(format!("parameter {name} cannot be left to its stage: {e}"))
                })?;
            }
        }
        self.own = Params::from_vars(self.members.iter().map(|&i| params.vars()[i].clone()).collect());
        self.acc = self.own.vars().iter().map(|(_, v)| vec![0.0 as Real; v.elem_count()]).collect();
        params.layers().cut(Some(self.chunks[0].clone()));
        Ok(())
    }

    /// Whether this schedule is one of those timed for `balance = "time"`.
    fn timing(&self) -> bool {
        !self.balanced && (PROFILE_FROM..PROFILE_FROM + PROFILE_RUNS).contains(&self.runs)
    }

    /// Cuts the stages again by the layers' measured times (a collective over the pipeline, at a step's end, with
    /// the stage's gradients zero): when the cut changes, every parameter and optimizer moment is made whole on
    /// every rank (as for a checkpoint), then each rank keeps its new chunks and their moments. The training is the
    /// same computation under any cut, so nothing but where it runs changes.
    fn recut(&mut self, params: &Params, opt: &mut Optimizer) -> Result<()> {
        self.balanced = true;
        let mut seconds = std::mem::take(&mut self.layer_s);
        self.comm_or_err()?.all_reduce(&mut seconds, ReduceOp::Sum)?;
        let ranges = params.layers().ranges(params.vars().len())?;
        // Microseconds, at least one a layer: the same integers on every rank (the sums are).
        let costs: Vec<usize> = seconds.iter().map(|s| (s * 1e6).round() as usize + 1).collect();
        let parts = self.cfg.stages * self.cfg.chunks();
        // Memory kept near the even cut: no chunk over 10% more parameters than the largest of the cut by count.
        let sizes = layer_sizes(params, &ranges);
        let Some(cuts) = time_balance(&costs, &sizes, parts) else { return Ok(()) };
        let stage_ms: Vec<f64> = cuts.iter().map(|r| costs[r.clone()].iter().sum::<usize>() as f64 / 1e3).collect();
        // Every rank has the same costs and the same cut: every rank decides alike.
        if cuts == self.cuts {
            tracing::info!(cuts = ?cuts, ?stage_ms, "pipeline stages already balanced by measured time");
            return Ok(());
        }
        let model = self.model_state(params)?;
        let moments = self.optimizer_state(params, opt)?;
        for ((name, var), (_, whole)) in params.vars().iter().zip(&model) {
            replace_storage(var.as_tensor(), values_of(whole)?)
                .map_err(|e| Error::InvalidArgument(format!("parameter {name} cannot be made whole again: {e}")))?;
        }
        let old = std::mem::take(&mut self.cuts);
        self.keep(params, &ranges, &cuts)?;
        let named: HashMap<String, Tensor> = moments.into_iter().collect();
        let t = opt.t;
        self.opt = None;
        let own = self.own.clone();
        self.optimizer(opt.config()).load_state(&own, t, &named)?;
        tracing::info!(
            stage = self.stage,
            from = ?old,
            to = ?cuts,
            ?stage_ms,
            "pipeline stages cut again by measured time"
        );
        Ok(())
    }

    fn comm_or_err(&self) -> Result<&Communicator> {
        self.comm.as_ref().ok_or_else(|| Error::InvalidArgument("a pipeline needs a communicator".into()))
    }

    /// Sends `t` (its shape first) to the next rank; returns the seconds it took.
    fn send_act(&self, t: &Tensor) -> Result<f64> {
        let dims = t.dims();
        if dims.len() >= HEADER {
            return Err(Error::InvalidArgument(format!("an activation of {} dimensions: at most 7", dims.len())));
        }
        let mut header = [0i64; HEADER];
        header[0] = dims.len() as i64;
        for (h, d) in header[1..].iter_mut().zip(dims) {
            *h = *d as i64;
        }
        let values = t.flatten_all()?.to_vec1::<Real>()?;
        let c = self.comm_or_err()?;
        let t0 = Instant::now();
        let next = self.shape(0).next(self.stage);
        c.send(&header, next)?;
        c.send(&values, next)?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Receives an activation from the previous rank as a leaf variable; with the seconds it took.
    fn recv_act(&self) -> Result<(Var, f64)> {
        let c = self.comm_or_err()?;
        let t0 = Instant::now();
        let mut header = [0i64; HEADER];
        let prev = self.shape(0).prev(self.stage);
        c.recv(&mut header, prev)?;
        let rank = usize::try_from(header[0]).unwrap_or(HEADER).min(HEADER);
        let dims: Vec<usize> = header.get(1..1 + rank).unwrap_or(&[]).iter().map(|d| (*d).max(0) as usize).collect();
        if rank == 0 || rank >= HEADER {
            return Err(Error::InvalidArgument(format!("stage {}: a malformed activation header", self.stage)));
        }
        let mut values = vec![0.0 as Real; dims.iter().product()];
        c.recv(&mut values, prev)?;
        let idle = t0.elapsed().as_secs_f64();
        Ok((Var::from_tensor(&Tensor::from_vec(values, dims, &candle_core::Device::Cpu)?)?, idle))
    }

    /// Adds this micro-batch's gradients of the stage's parameters into the step's sums.
    fn accumulate(&mut self, params: &Params, grads: &candle_core::backprop::GradStore) -> Result<()> {
        for (k, &i) in self.members.iter().enumerate() {
            let (name, var) = &params.vars()[i];
            let Some(g) = grads.get(var.as_tensor()) else { continue };
            let g = g.contiguous()?;
            let acc = &mut self.acc[k];
            with_slice(&g, |s| {
                if s.len() != acc.len() {
                    return Err(Error::InvalidArgument(format!(
                        "gradient of {name}: {} values, {}",
                        s.len(),
                        acc.len()
                    )));
                }
                acc.iter_mut().zip(s).for_each(|(a, g)| *a += g);
                Ok(())
            })??;
        }
        Ok(())
    }

    /// The stage's optimizer, made with `cfg` if it is not yet.
    fn optimizer(&mut self, cfg: OptimConfig) -> &mut Optimizer {
        let own = &self.own;
        self.opt.get_or_insert_with(|| Optimizer::new(cfg, own))
    }

    /// Every stage's values of one kind (the parameters, or one optimizer moment), each rank's own put into a
    /// buffer of the whole model and the buffers summed: whole named tensors on every rank (a collective).
    fn gather(&self, params: &Params, own: &[Vec<Real>], suffix: &str) -> Result<Vec<(String, Tensor)>> {
        let (offsets, total) = super::flat_offsets(params);
        let mut flat = vec![0.0 as Real; total];
        for (k, &i) in self.members.iter().enumerate() {
            let values = own.get(k).ok_or_else(|| Error::InvalidArgument("a stage's state is incomplete".into()))?;
            flat[offsets[i]..offsets[i] + values.len()].copy_from_slice(values);
        }
        self.comm_or_err()?.all_reduce(&mut flat, ReduceOp::Sum)?;
        params
            .vars()
            .iter()
            .enumerate()
            .map(|(i, (name, var))| {
                let part = flat[offsets[i]..offsets[i] + var.elem_count()].to_vec();
                Ok((format!("{name}{suffix}"), Tensor::from_vec(part, var.shape(), &candle_core::Device::Cpu)?))
            })
            .collect()
    }
}

/// Each layer's parameter count, by whole shapes (every rank of a tensor-parallel group cuts the model alike).
fn layer_sizes(params: &Params, ranges: &[(String, Range<usize>)]) -> Vec<usize> {
    ranges.iter().map(|(_, m)| m.clone().map(|i| params.full_dims(i).iter().product::<usize>()).sum()).collect()
}

fn values_of(t: &Tensor) -> Result<Vec<Real>> {
    Ok(t.flatten_all()?.to_vec1::<Real>()?)
}

impl Strategy for Pipeline {
    fn name(&self) -> &'static str {
        "pipeline"
    }

    fn comm(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }

    fn init(&mut self, params: &Params) -> Result<()> {
        let world = self.comm.as_ref().map_or(1, Communicator::size);
        if world != self.cfg.stages || self.cfg.stages < 2 {
            return Err(Error::InvalidArgument(format!(
                "a pipeline of {} stages runs on as many ranks, not {world}",
                self.cfg.stages
            )));
        }
        if self.cfg.micro_batches == 0 {
            return Err(Error::InvalidArgument("a pipeline needs at least one micro-batch".into()));
        }
        let v = self.cfg.chunks();
        if v == 0 {
            return Err(Error::InvalidArgument("an interleaved pipeline needs at least one chunk per rank".into()));
        }
        broadcast_from_rank0(self.comm.as_ref(), params)?;
        let ranges = params.layers().ranges(params.vars().len())?;
        let cuts = balance(&layer_sizes(params, &ranges), self.cfg.stages * v).ok_or_else(|| {
            Error::InvalidArgument(match v {
                1 => format!(
                    "{} pipeline stages for a model of {} layers: at most one stage per layer",
                    self.cfg.stages,
                    ranges.len()
                ),
                _ => format!(
                    "{} pipeline stages × {v} virtual stages for a model of {} layers: at most one chunk per layer",
                    self.cfg.stages,
                    ranges.len()
                ),
            })
        })?;
        self.layer_s = vec![0.0; ranges.len()];
        self.keep(params, &ranges, &cuts)
    }

    fn backward(
        &mut self,
        _params: &Params,
        _last: bool,
        _scalars: Vec<Real>,
        _f: &mut dyn FnMut(&mut dyn GradSink) -> Result<()>,
    ) -> Result<()> {
        Err(Error::InvalidArgument(
            "a pipeline stage runs the step's micro-batches itself (Trainer::run_micro_batches)".into(),
        ))
    }

    fn backward_tensors(
        &mut self,
        _params: &Params,
        _last: bool,
        _scalars: Vec<Real>,
        _grads: TensorGrads,
    ) -> Result<()> {
        Err(Error::InvalidArgument(
            "a pipeline stage runs the step's micro-batches itself (Trainer::run_micro_batches)".into(),
        ))
    }

    fn splits_model(&self) -> bool {
        true
    }

    fn run_micro_batches(
        &mut self,
        params: &Params,
        count: usize,
        forward: &mut dyn FnMut(usize) -> Result<Tensor>,
        loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<()> {
        // Fewer than configured only for a short global batch (`micro_batch_ranges`).
        if count == 0 || count > self.cfg.micro_batches {
            return Err(Error::InvalidArgument(format!(
                "{count} micro-batches for a pipeline of {} a step",
                self.cfg.micro_batches
            )));
        }
        self.ran = count;
        let list = ops(self.cfg.schedule, self.shape(count), self.stage).map_err(Error::InvalidArgument)?;
        let timing = self.timing();
        if timing {
            params.layers().time_layers(true);
        }
        // Per chunk: the loss's seconds and the backward's (timed schedules only).
        let mut loss_s = vec![0f64; self.chunks.len()];
        let mut backward_s = vec![0f64; self.chunks.len()];
        let started = Instant::now();
        let mut idle = 0f64;
        // Keyed by micro-batch and chunk.
        let mut inputs: HashMap<(usize, usize), Var> = HashMap::new();
        let mut held: HashMap<(usize, usize), Held> = HashMap::new();
        let mut outgoing: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut grads_in: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut grads_out: HashMap<(usize, usize), Vec<Real>> = HashMap::new();
        let missing = |what: &str, i: usize, c: usize| {
            Error::InvalidArgument(format!("pipeline schedule: no {what} for micro-batch {i} (chunk {c})"))
        };
        for op in list {
            match op {
                Op::RecvAct(i, c) => {
                    let (v, s) = self.recv_act()?;
                    idle += s;
                    inputs.insert((i, c), v);
                }
                Op::Forward(i, c) => {
                    let input = inputs.remove(&(i, c));
                    self.enter(params, c, input.as_ref())?;
                    let y = forward(i)?;
                    let output = if self.last(c) {
                        let t0 = Instant::now();
                        let l = loss(i, &y)?;
                        loss_s[c] += t0.elapsed().as_secs_f64();
                        l
                    } else {
                        outgoing.insert((i, c), y.detach());
                        y
                    };
                    held.insert((i, c), Held { input, output });
                }
                Op::SendAct(i, c) => {
                    let y = outgoing.remove(&(i, c)).ok_or_else(|| missing("output", i, c))?;
                    idle += self.send_act(&y)?;
                }
                Op::RecvGrad(i, c) => {
                    let shape = held.get(&(i, c)).ok_or_else(|| missing("forward", i, c))?.output.shape().clone();
                    let mut values = vec![0.0 as Real; shape.elem_count()];
                    let t0 = Instant::now();
                    self.comm_or_err()?.recv(&mut values, self.shape(0).next(self.stage))?;
                    idle += t0.elapsed().as_secs_f64();
                    grads_in.insert((i, c), Tensor::from_vec(values, shape, &candle_core::Device::Cpu)?);
                }
                Op::Backward(i, c) => {
                    let h = held.remove(&(i, c)).ok_or_else(|| missing("forward", i, c))?;
                    let root = if self.last(c) {
                        h.output
                    } else {
                        let dy = grads_in.remove(&(i, c)).ok_or_else(|| missing("gradient", i, c))?;
                        (&h.output * dy)?.sum_all()?
                    };
                    let t0 = Instant::now();
                    let grads = root.backward()?;
                    self.accumulate(params, &grads)?;
                    backward_s[c] += t0.elapsed().as_secs_f64();
                    if let Some(x) = &h.input {
                        let dx = match grads.get(x.as_tensor()) {
                            Some(g) => values_of(g)?,
                            None => vec![0.0 as Real; x.elem_count()],
                        };
                        grads_out.insert((i, c), dx);
                    }
                }
                Op::SendGrad(i, c) => {
                    let dx = grads_out.remove(&(i, c)).ok_or_else(|| missing("input gradient", i, c))?;
                    let t0 = Instant::now();
                    self.comm_or_err()?.send(&dx, self.shape(0).prev(self.stage))?;
                    idle += t0.elapsed().as_secs_f64();
                }
            }
        }
        self.idle_s = idle;
        self.span_s = started.elapsed().as_secs_f64();
        if timing && let Some(forward_s) = params.layers().layer_times() {
            params.layers().time_layers(false);
            // A chunk's backward shared among its layers as their forwards; the loss goes with the model's last layer.
            for (c, layers) in self.chunks.iter().enumerate() {
                let f: f64 = forward_s[layers.clone()].iter().sum();
                for l in layers.clone() {
                    let share = if f > 0.0 { forward_s[l] / f } else { 1.0 / layers.len() as f64 };
                    if let Some(s) = self.layer_s.get_mut(l) {
                        *s += forward_s[l] + share * backward_s[c];
                    }
                }
                if let Some(s) = self.layer_s.get_mut(layers.end - 1) {
                    *s += loss_s[c];
                }
            }
        }
        self.runs += 1;
        Ok(())
    }

    fn forward_stage(&self, params: &Params, forward: &mut dyn FnMut() -> Result<Tensor>) -> Result<Option<Tensor>> {
        // Round the ranks once per chunk: receive (but on the model's first chunk), compute, send on (but from its
        // last, whose output is the model's).
        for c in 0..self.chunks.len() {
            let input = match self.shape(0).is_first(self.stage, c) {
                true => None,
                false => Some(self.recv_act()?.0),
            };
            self.enter(params, c, input.as_ref())?;
            let y = forward()?;
            if self.last(c) {
                return Ok(Some(y));
            }
            self.send_act(&y)?;
        }
        Ok(None)
    }

    fn attach_step_scalars(&mut self, values: Vec<Real>) {
        self.scalars = values;
    }

    fn stage_layers(&self) -> Option<Vec<Range<usize>>> {
        Some(self.cuts.clone()).filter(|c| !c.is_empty())
    }

    fn step(&mut self, params: &Params, opt: &mut Optimizer, lr: f64, clip: Option<f64>) -> Result<StepTimes> {
        let t0 = Instant::now();
        let sq: f64 = self.acc.iter().map(|g| sum_sq(g)).sum();
        let mine = if self.span_s > 0.0 { self.idle_s / self.span_s } else { 0.0 };
        let scalars = std::mem::take(&mut self.scalars);
        let mut summed: Vec<f64> = [sq, mine].into_iter().chain(scalars.iter().map(|v| f64::from(*v))).collect();
        self.comm_or_err()?.all_reduce(&mut summed, ReduceOp::Sum)?;
        let comm_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let norm = summed[0].sqrt();
        let grad_norm = clip.map(|_| norm);
        if let Some(max) = clip
            && norm > max
            && norm > 0.0
        {
            let s = (max / norm) as Real;
            self.acc.iter_mut().for_each(|g| g.iter_mut().for_each(|x| *x *= s));
        }
        let mut acc = std::mem::take(&mut self.acc);
        let own = self.own.clone();
        let stage_opt = self.optimizer(opt.config());
        let slices: Vec<&[Real]> = acc.iter().map(Vec::as_slice).collect();
        let stepped = stage_opt.step_slices(&own, &slices, lr);
        opt.t = stage_opt.t;
        acc.iter_mut().for_each(|g| g.fill(0.0));
        self.acc = acc;
        stepped?;
        if !self.balanced && self.runs >= PROFILE_FROM + PROFILE_RUNS {
            self.recut(params, opt)?;
        }
        let bubble = Bubble {
            rank: mine,
            mean: summed[1] / self.cfg.stages as f64,
            theory: theoretical_bubble(self.cfg.stages, self.ran, self.cfg.chunks()),
        };
        Ok(StepTimes {
            comm_s,
            optimizer_s: t1.elapsed().as_secs_f64(),
            grad_norm,
            scalars: summed[2..].iter().map(|v| *v as Real).collect(),
            bubble: Some(bubble),
        })
    }

    fn optimizer_bytes(&self, _opt: &Optimizer) -> usize {
        self.opt.as_ref().map_or(0, Optimizer::state_bytes)
    }

    fn gradient_bytes(&self, _params: &Params) -> usize {
        self.own.count() * REAL_BYTES
    }

    fn param_bytes(&self, _params: &Params) -> usize {
        self.own.count() * REAL_BYTES
    }

    fn model_state(&self, params: &Params) -> Result<Vec<(String, Tensor)>> {
        let own = self.own.vars().iter().map(|(_, v)| values_of(v.as_tensor())).collect::<Result<Vec<_>>>()?;
        self.gather(params, &own, "")
    }

    fn optimizer_state(&self, params: &Params, opt: &Optimizer) -> Result<Vec<(String, Tensor)>> {
        // The same moments on every stage (one configuration, stepped together): the same collectives.
        let moments: &[&str] = match (opt.t, opt.config()) {
            (0, _) | (_, OptimConfig::Sgd { momentum: 0.0, .. }) => &[],
            (_, OptimConfig::Sgd { .. }) => &["m"],
            (_, OptimConfig::AdamW { .. }) => &["m", "v"],
        };
        let mine: HashMap<String, Tensor> =
            self.opt.as_ref().map(|o| o.state(&self.own)).unwrap_or_default().into_iter().collect();
        let mut out: Vec<(String, Tensor)> = Vec::new();
        for m in moments {
            let suffix = format!(".{m}");
            let own = self
                .own
                .vars()
                .iter()
                .map(|(name, v)| match mine.get(&format!("{name}{suffix}")) {
                    Some(t) => values_of(t),
                    None => Ok(vec![0.0 as Real; v.elem_count()]),
                })
                .collect::<Result<Vec<_>>>()?;
            out.extend(self.gather(params, &own, &suffix)?);
        }
        super::in_optimizer_order(params, &mut out);
        Ok(out)
    }

    fn load_optimizer_state(
        &mut self,
        _params: &Params,
        opt: &mut Optimizer,
        t: u64,
        named: &HashMap<String, Tensor>,
    ) -> Result<()> {
        let own = self.own.clone();
        self.optimizer(opt.config()).load_state(&own, t, named)?;
        opt.t = t;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balance_cuts_the_smallest_largest_run_and_keeps_to_a_size_cap() {
        // Costs alone: the heavy last layer stands alone.
        assert_eq!(balance(&[1, 10, 10, 100], 2), Some(vec![0..3, 3..4]));
        assert_eq!(balance(&[5, 5, 5, 5], 2), Some(vec![0..2, 2..4]));
        assert_eq!(balance(&[1, 2], 3), None);
        // Sizes capped at 12: [0..3] would hold 3 + 3 + 8 = 14, so the cheapest largest cost within the cap is
        // [0..2] (cost 11) against [2..4] (cost 110).
        let (costs, sizes) = ([1, 10, 10, 100], [3, 3, 8, 4]);
        assert_eq!(balance_within(&costs, &sizes, 12, 2), Some(vec![0..2, 2..4]));
        assert_eq!(balance_within(&costs, &sizes, 14, 2), Some(vec![0..3, 3..4]));
        // No cut within the cap.
        assert_eq!(balance_within(&costs, &sizes, 5, 2), None);
        assert_eq!(balance_within(&costs, &sizes[..3], 100, 2), None, "one size per layer");
    }
}
