//! The seam between the [`crate::Trainer`] (the loop, the parameters, the optimizer) and how the ranks of a job
//! share a step's work. A [`Strategy`] makes the ranks' parameters agree at the start, takes each micro-batch's
//! gradients from the model through a [`GradSink`], and ends the step: gradients combined across ranks, clipped,
//! the optimizer applied — so a strategy that shards optimizer state (ZeRO), pushes and pulls instead of
//! all-reducing (a parameter server) or compresses what it sends owns exactly the part it changes, and the trainer
//! and the models stay as they are.
//!
//! - [`ddp`]: data parallel — every rank holds everything; gradients are summed with bucketed all-reduces that
//!   start while backward still runs.
//! - [`zero`]: ZeRO — stage 1: gradients reduce-scattered, each rank updates its shard of the flat parameters with
//!   its shard of the optimizer state, the shards all-gathered; stage 2: the gradients reduce-scattered bucket by
//!   bucket as backward produces them, so no rank holds them whole; stage 3: the parameters sharded too, each rank
//!   keeping only its shard between steps, every layer gathered just before the model uses it in forward and in
//!   backward and freed after, the next layer's gather overlapping the current layer's computation ([`zero3`],
//!   through the model-side seam `crate::layers`). The cut into buckets and shards, and the collectives that move
//!   them, are one place for every stage ([`shards`]). Checkpoints hold whole tensors, as DDP's.
//!
//! - [`pipeline`]: pipeline parallel — the model's layers cut into stages of consecutive layers, each rank holding
//!   one stage's parameters, gradients and optimizer state. A stage runs only part of each forward, so a pipeline
//!   does not fit "one backward per micro-batch, then step": the trainer hands it the whole step's micro-batches
//!   ([`Strategy::run_micro_batches`], with [`Strategy::splits_model`] saying so), and it runs them in its
//!   schedule's order ([`schedule`]: GPipe, 1F1B, or interleaved 1F1B with several chunks of layers a rank),
//!   activations and their gradients going between neighbouring stages with the communicator's point-to-point calls; evaluation's forward passes go through it too
//!   ([`Strategy::forward_stage`]). [`Strategy::step`] then clips at the global norm (an all-reduce of the stages'
//!   squared norms) and updates each stage. Checkpoints hold whole tensors, gathered from the stages.
//!
//! - [`tensor`]: tensor parallel (Megatron-LM style) — every layer split across the ranks of a group, attention by
//!   heads, the MLP by hidden units, the GPT's embedding and head by vocabulary rows; each rank holds its parts and
//!   their optimizer state. The model does the communication (`crate::tensor_parallel`: all-reduces as custom
//!   autograd operations in its forward and backward, built on `Params::tensor_parallel`), so a micro-batch is one
//!   ordinary forward and backward; the strategy connects the group, keeps the replicated parameters identical,
//!   clips at the global norm and updates each rank's parts. Checkpoints hold whole tensors, gathered from the
//!   parts.
//!
//! - [`composed`]: composed layouts (`train.strategy = "3d"`): data × tensor × pipeline ranks in Megatron-LM's
//!   order (tensor index fastest), each rank's tensor, data and pipeline groups split from the world once
//!   (`Communicator::split`); the tensor-parallel model inside the stages of a [`pipeline`], the stages' gradients
//!   summed over each data group (or reduce-scattered onto ZeRO-1 shards, [`shards`]) before the update, the norm
//!   for clipping over the world. Checkpoints hold whole tensors: tensor parts gathered, then stages summed.
//!
//! - [`compress`]: the compression hook (`[compression]`): DDP sums each bucket, and ZeRO reduce-scatters it,
//!   through a `shoal_comm::Compressor` instead of a plain collective; the compressor's error feedback is saved
//!   with the optimizer state.
//!
//! - [`robust`]: `[robust]` under DDP — each bucket all-gathered and combined by a robust rule (`shoal_ps`) in
//!   place of the sum, so that up to `f` lying ranks move the model no further than the rule lets them.
//!
//! The worker builds the strategy `train.strategy` names; a name with no strategy yet is refused when the spec is
//! validated (`shoal_spec::Strategy`), never silently replaced.

pub mod composed;
pub mod compress;
pub mod ddp;
pub mod pipeline;
pub mod ps;
pub mod robust;
pub mod schedule;
pub mod shards;
pub mod tensor;
pub mod zero;
pub mod zero3;

use crate::{REAL_BYTES, Real};
use candle_core::{Tensor, Var};
use shoal_comm::Communicator;

use crate::error::{Error, Result};
use crate::kernels::with_slice;
use crate::layers::Layers;
use crate::optim::Optimizer;
use crate::params::Params;

/// Where a backward pass puts its gradients: one buffer per parameter, handed out in reverse parameter order (the
/// order backward produces them). Each buffer is zeroed and as long as its parameter; once `fill` returns, the
/// strategy owns it (DDP: a full gradient bucket starts its all-reduce at once, while the backward pass goes on
/// with earlier layers).
pub trait GradSink {
    /// Gives `fill` the gradient buffer of parameter `index`. Indices must strictly decrease from one call to the
    /// next; a parameter left out has a zero gradient.
    fn put(&mut self, index: usize, fill: &mut dyn FnMut(&mut [Real]) -> Result<()>) -> Result<()>;

    /// Like [`crate::Trainer::attach_scalars`], for values only known once the backward pass has run (the
    /// micro-batch's loss); the last call wins.
    fn attach_scalars(&mut self, values: &[Real]);
}

/// Time spent in one step's end ([`Strategy::step`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTimes {
    /// Combining gradients across ranks: waiting for what had not finished during backward, or all of it.
    pub comm_s: f64,
    /// Clipping and the optimizer update.
    pub optimizer_s: f64,
    /// Global gradient norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
    /// The scalars given with the step's last micro-batch, summed over ranks.
    pub scalars: Vec<Real>,
    /// A pipeline's idle time in the step (`None` for a strategy that does not cut the model into stages).
    pub bubble: Option<Bubble>,
}

/// A pipeline step's idle time on its stages ([`pipeline`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Bubble {
    /// This rank's time waiting for its neighbours over its time running the schedule.
    pub rank: f64,
    /// The same, averaged over the stages.
    pub mean: f64,
    /// `(S-1)/(M+S-1)`.
    pub theory: f64,
}

/// A micro-batch's gradients from autograd: per parameter, `None` for a parameter with no gradient.
pub type TensorGrads = Vec<Option<Tensor>>;

/// How the ranks share a step. Called by the trainer in this order, every step: [`Strategy::backward`] or
/// [`Strategy::backward_tensors`] once per micro-batch (`last` on the step's final one), then [`Strategy::step`] —
/// or, for a strategy that [splits the model](Strategy::splits_model), [`Strategy::run_micro_batches`] once, then
/// [`Strategy::step`].
pub trait Strategy: Send {
    /// The name a run records (`train.strategy`, the manifest, `summary.json`).
    fn name(&self) -> &'static str;

    /// The communicator of the ranks that share the model (`None`: one process).
    fn comm(&self) -> Option<&Communicator>;

    /// Once, before the first step: every rank's parameters made what the strategy needs them to be (DDP: rank
    /// 0's, broadcast).
    fn init(&mut self, params: &Params) -> Result<()>;

    /// One micro-batch's hand-written backward pass: `f` puts every parameter's gradient (already weighted by this
    /// rank's share of the global batch) into the sink, in reverse parameter order. `scalars` (on the `last` call)
    /// are summed over ranks with the step's gradients.
    fn backward(
        &mut self,
        params: &Params,
        last: bool,
        scalars: Vec<Real>,
        f: &mut dyn FnMut(&mut dyn GradSink) -> Result<()>,
    ) -> Result<()>;

    /// One micro-batch's gradients from autograd.
    fn backward_tensors(&mut self, params: &Params, last: bool, scalars: Vec<Real>, grads: TensorGrads) -> Result<()>;

    /// Whether each rank holds only a part of the model's layers (a pipeline stage): then the trainer hands the
    /// strategy the whole step's micro-batches ([`Strategy::run_micro_batches`]) instead of one backward at a time,
    /// and a forward pass goes through it ([`Strategy::forward_stage`]).
    fn splits_model(&self) -> bool {
        false
    }

    /// Runs the step's `count` micro-batches in the strategy's order: `forward(i)` runs the model on micro-batch
    /// `i` (on a stage, only the stage's layers) and `loss(i, output)` gives its loss, already weighted by its
    /// share of the global batch, where the model's output is the logits. Each micro-batch's gradients are kept for
    /// [`Strategy::step`]. By default (a strategy whose ranks hold every layer): forward, loss and
    /// [`Strategy::backward_tensors`] in turn.
    fn run_micro_batches(
        &mut self,
        params: &Params,
        count: usize,
        forward: &mut dyn FnMut(usize) -> Result<Tensor>,
        loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<()> {
        each_micro_batch(self, params, count, forward, loss)
    }

    /// One forward pass without backward (evaluation), every rank calling it for the same batch: the model's
    /// output where this rank has it (everywhere by default; on a pipeline's last stage only).
    fn forward_stage(&self, _params: &Params, forward: &mut dyn FnMut() -> Result<Tensor>) -> Result<Option<Tensor>> {
        forward().map(Some)
    }

    /// How many ranks compute every batch together, each with its part of every layer (a tensor-parallel group;
    /// 1 otherwise): evaluation gives the ranks of a group the same batches and counts them once.
    fn tensor_degree(&self) -> usize {
        1
    }

    /// Under pipeline stages, the model's layers of every chunk in the order of the cut (chunk `c` of pipeline rank
    /// `r` is entry `c · stages + r`); none for a strategy that does not cut the model.
    fn stage_layers(&self) -> Option<Vec<std::ops::Range<usize>>> {
        None
    }

    /// The scalars to sum over ranks at the next [`Strategy::step`], for a strategy that runs the micro-batches
    /// itself (the others take them with the last backward).
    fn attach_step_scalars(&mut self, _values: Vec<Real>) {}

    /// Ends the step: the gradients combined across ranks, clipped to a global norm of `clip`, and `opt` applied
    /// with `lr`, the same update on every rank that holds a parameter.
    fn step(&mut self, params: &Params, opt: &mut Optimizer, lr: f64, clip: Option<f64>) -> Result<StepTimes>;

    /// Bytes of optimizer state this rank holds (a strategy that shards it: its shard).
    fn optimizer_bytes(&self, opt: &Optimizer) -> usize {
        opt.state_bytes()
    }

    /// Bytes of gradient buffers this rank holds for a step (by default one value per parameter).
    fn gradient_bytes(&self, params: &Params) -> usize {
        params.count() * REAL_BYTES
    }

    /// Bytes of parameters this rank holds (by default every parameter, whole).
    fn param_bytes(&self, params: &Params) -> usize {
        params.count() * REAL_BYTES
    }

    /// The parameters as whole named tensors, for a checkpoint or to read them (by default the parameters' own
    /// tensors, which the next step updates in place: copy them out before it; a strategy that shards them gathers
    /// them: then every rank calls this at the same step).
    fn model_state(&self, params: &Params) -> Result<Vec<(String, Tensor)>> {
        Ok(params.vars().iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect())
    }

    /// The optimizer state as whole named tensors, for a checkpoint (by default the optimizer's own; a strategy
    /// that shards it gathers it: then every rank calls this at the same step).
    fn optimizer_state(&self, params: &Params, opt: &Optimizer) -> Result<Vec<(String, Tensor)>> {
        Ok(opt.state(params))
    }

    /// Restores optimizer state saved as whole named tensors (by any strategy, at any world size); a strategy that
    /// shards it keeps its shard.
    fn load_optimizer_state(
        &mut self,
        params: &Params,
        opt: &mut Optimizer,
        t: u64,
        named: &std::collections::HashMap<String, Tensor>,
    ) -> Result<()> {
        opt.load_state(params, t, named)
    }

    /// The state of gradient compression (every rank's error feedback, named `compression.rank{R}.…`), for a
    /// checkpoint beside the optimizer state: a collective, every rank calls it at the same step. Empty for a
    /// strategy that does not compress.
    fn compression_state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(Vec::new())
    }

    /// Restores what [`Strategy::compression_state`] saved (at any world size, [`compress`]).
    fn load_compression_state(&mut self, _named: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        Ok(())
    }

    /// Bytes of payload this rank has sent outside its communicator (a parameter server's pushes); none by default.
    fn bytes_sent_elsewhere(&self) -> u64 {
        0
    }

    /// The run's last step is done: what the strategy holds outside this process is let go (parameter servers are
    /// told this worker has finished). Nothing by default.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Makes every rank's parameters rank 0's (one broadcast of the flat parameters; nothing on one process). Every
/// strategy starts with it: parameters a ZeRO-3 trainer already holds sharded are refused here.
pub(crate) fn broadcast_from_rank0(comm: Option<&Communicator>, params: &Params) -> Result<()> {
    if params.layers().is_sharded() {
        return Err(Error::InvalidArgument(
            "these parameters are already sharded by a ZeRO-3 trainer: start each trainer on a model of its own".into(),
        ));
    }
    if let Some(c) = comm.filter(|c| c.size() > 1) {
        let mut flat = params.flatten()?;
        c.broadcast(&mut flat, 0)?;
        params.load_flat(&flat)?;
    }
    Ok(())
}

/// Each parameter's offset in the flat parameter space (parameter order), and the space's length.
pub(crate) fn flat_offsets(params: &Params) -> (Vec<usize>, usize) {
    let mut total = 0;
    let offsets = params
        .vars()
        .iter()
        .map(|(_, v)| {
            let o = total;
            total += v.elem_count();
            o
        })
        .collect();
    (offsets, total)
}

/// Sums a flat bucket of gradients held on a device across the ranks, on that device: what
/// [`ddp::Ddp::with_device_reduce`] hands each bucket to instead of staging it through the host
/// (`crate::nccl::NcclAllReduce` in a build with the `nccl` feature).
pub trait DeviceAllReduce: Send {
    /// The sum over the ranks of `flat` (a 1-D [`crate::REAL_DTYPE`] tensor of the same length on every rank), on
    /// its device; `flat` itself when summed in place. Every rank calls it the same number of times, in the same
    /// order, and a wait has the communicator's deadline.
    fn all_reduce(&mut self, flat: Tensor) -> Result<Tensor>;
    /// What sums ("nccl"), for logs.
    fn name(&self) -> &'static str;
}

/// Puts autograd's gradients into a sink, in the reverse parameter order it asks for.
///
/// With `stage_bytes` (gradients held on a device: [`Params::set_resident`]) they cross to the host a bucket at a
/// time: the gradients next in the sink's order, flattened and joined on the device into one buffer of about
/// `stage_bytes`, come back in one transfer and are put from it. Under DDP, a bucket's all-reduce runs on the
/// communicator's thread while the next bucket is joined and copied.
pub(crate) fn put_tensors(sink: &mut dyn GradSink, grads: &TensorGrads, stage_bytes: Option<usize>) -> Result<()> {
    let Some(limit) = stage_bytes else {
        for (i, g) in grads.iter().enumerate().rev() {
            if let Some(g) = g {
                sink.put(i, &mut |out| copy_f32(out, g))?;
            }
        }
        return Ok(());
    };
    let order: Vec<(usize, &Tensor)> =
        grads.iter().enumerate().rev().filter_map(|(i, g)| Some((i, g.as_ref()?))).collect();
    let mut at = 0;
    while at < order.len() {
        let (mut end, mut bytes) = (at, 0usize);
        while end < order.len() && (end == at || bytes < limit) {
            bytes += order[end].1.elem_count() * REAL_BYTES;
            end += 1;
        }
        let parts = order[at..end]
            .iter()
            .map(|(_, g)| g.flatten_all()?.to_dtype(crate::REAL_DTYPE))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let host = Tensor::cat(&parts, 0)?.to_device(&candle_core::Device::Cpu)?;
        with_slice(&host, |values| -> Result<()> {
            let mut off = 0;
            for (i, g) in &order[at..end] {
                let n = g.elem_count();
                let part = &values[off..off + n];
                sink.put(*i, &mut |out| {
                    if out.len() != n {
                        return Err(Error::InvalidArgument(format!(
                            "gradient has {n} values, its parameter {}",
                            out.len()
                        )));
                    }
                    out.copy_from_slice(part);
                    Ok(())
                })?;
                off += n;
            }
            Ok(())
        })??;
        at = end;
    }
    Ok(())
}

/// Refuses a gradient given out of the order a [`GradSink`] takes them in (`next`: the highest index still
/// allowed).
pub(crate) fn check_order(index: usize, count: usize, next: Option<usize>) -> Result<()> {
    if index >= count || next.is_none_or(|n| index > n) {
        return Err(Error::InvalidArgument(format!(
            "gradient of parameter {index} given out of order (parameters must come in reverse order, each once)"
        )));
    }
    Ok(())
}

/// [`Strategy::run_micro_batches`] for ranks that hold every layer: each micro-batch's forward, loss and
/// [`Strategy::backward_tensors`] in turn.
pub(crate) fn each_micro_batch<S: Strategy + ?Sized>(
    s: &mut S,
    params: &Params,
    count: usize,
    forward: &mut dyn FnMut(usize) -> Result<Tensor>,
    loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
) -> Result<()> {
    for i in 0..count {
        let y = forward(i)?;
        let l = loss(i, &y)?;
        let grads = l.backward()?;
        let per_param = params.vars().iter().map(|(_, v)| grads.get(v.as_tensor()).cloned()).collect();
        s.backward_tensors(params, i + 1 == count, Vec::new(), per_param)?;
    }
    Ok(())
}

/// Sorts named optimizer state (`{parameter}.{moment}`) into the optimizer's own order: each parameter's moments
/// together, the parameters in their order.
pub(crate) fn in_optimizer_order(params: &Params, state: &mut [(String, Tensor)]) {
    let order: std::collections::HashMap<&str, usize> =
        params.vars().iter().enumerate().map(|(i, (n, _))| (n.as_str(), i)).collect();
    state.sort_by_key(|(n, _)| {
        let (p, m) = n.rsplit_once('.').unwrap_or((n, ""));
        (order.get(p).copied().unwrap_or(usize::MAX), m.to_string())
    });
}

/// Adds autograd's gradients into per-parameter accumulators (a micro-batch's share of the step's).
pub(crate) fn add_tensors(acc: &mut [Vec<Real>], params: &Params, grads: &TensorGrads) -> Result<()> {
    for (i, g) in grads.iter().enumerate() {
        let Some(g) = g else { continue };
        let acc = acc.get_mut(i).ok_or_else(|| {
            Error::InvalidArgument(format!("a gradient for parameter {i} of {}", params.vars().len()))
        })?;
        add_f32(acc, g)?;
    }
    Ok(())
}

/// Adds a tensor's values into `acc`, which must be exactly as long (read in place: no copy between).
pub(crate) fn add_f32(acc: &mut [Real], t: &Tensor) -> Result<()> {
    let t = t.contiguous()?;
    let n = with_slice(&t, |s| {
        if s.len() == acc.len() {
            acc.iter_mut().zip(s).for_each(|(a, g)| *a += g);
        }
        s.len()
    })?;
    if n != acc.len() {
        return Err(Error::InvalidArgument(format!("gradient has {n} values, its parameter {}", acc.len())));
    }
    Ok(())
}

/// Copies a tensor's values into `out`, which must be exactly as long.
pub(crate) fn copy_f32(out: &mut [Real], t: &Tensor) -> Result<()> {
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

/// Autograd's gradients of a training pass whose forward went layer by layer under a layer store (ZeRO-3,
/// `crate::layers`), put into `sink` layer by layer from the last: each layer's graph back-propagated with only that
/// layer's parameters whole, the loss's for the last layer, `sum(y · dy)` for the others (`dy`: the gradient of the
/// next layer's input), every parameter of the layer put (zeros where it has no gradient) before the layer below is
/// entered. With no loss (this rank had no data for the micro-batch) the same layers are entered in the same order
/// and zeros put, so its collectives match the other ranks'.
pub(crate) fn backward_by_layer(
    layers: &Layers,
    loss: Option<&Tensor>,
    vars: &[(String, Var)],
    sink: &mut dyn GradSink,
) -> Result<()> {
    let ranges = layers.ranges(vars.len())?;
    let count = ranges.len();
    let mut tape: Vec<Option<_>> = layers.take_tape().into_iter().map(Some).collect();
    let idle = match (loss, tape.len()) {
        (Some(_), n) if n == count => false,
        (None, n) if n == count => true,
        (None, 0) => {
            // The forward this rank had no data for.
            layers.idle_forward()?;
            true
        }
        (Some(_), 0) => {
            return Err(Error::InvalidArgument(
                "the loss was not computed through the model's layers (Layers::run): ZeRO-3 cannot back-propagate it"
                    .into(),
            ));
        }
        (_, n) => {
            return Err(Error::InvalidArgument(format!(
                "the forward pass went through {n} of the model's {count} layers: ZeRO-3 needs every layer, in order"
            )));
        }
    };
    let mut dy: Option<Tensor> = None;
    for (l, (name, members)) in ranges.iter().enumerate().rev() {
        let entered = layers.backward_layer(l)?;
        let taped = tape.get_mut(l).and_then(Option::take);
        let grads = match (idle, taped.as_ref(), loss) {
            (false, Some(t), Some(loss)) => {
                let root = if l + 1 == count {
                    loss.clone()
                } else {
                    let dy = dy.take().ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "the output of layer {name} does not reach the loss: a model computes everything between \
                             its input and its output inside its layers"
                        ))
                    })?;
                    (&t.output * dy)?.sum_all()?
                };
                let grads = root.backward()?;
                // Detached: candle leaves a gradient's own graph on it (through this layer's parameters, freed
                // before the layer below is back-propagated).
                dy = t.input.as_ref().and_then(|x| grads.get(x)).map(Tensor::detach);
                Some(grads)
            }
            _ => None,
        };
        for i in members.clone().rev() {
            let g = grads.as_ref().and_then(|g| g.get(vars[i].1.as_tensor()));
            sink.put(i, &mut |out| match g {
                Some(g) => copy_f32(out, g),
                None => Ok(()),
            })?;
        }
        // The layer's graph and activations go before the layer below is gathered.
        drop((grads, taped));
        entered.release()?;
    }
    Ok(())
}
