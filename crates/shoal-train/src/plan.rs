//! The planner behind `shoal plan`: given a model (its layers' sizes, counted from the job spec's model, at any size
//! — a 7B GPT included, nothing is built) and a cluster (devices, memory each, compute rate, link bandwidth), it
//! enumerates data × tensor × pipeline × ZeRO layouts that use every device, estimates each one's memory per device
//! and step time with a cost model, and ranks the ones that fit, fastest first. No IO: the caller measures or reads
//! the cluster's rates.
//!
//! The cost model, per pipeline stage (the stages the pipeline strategy cuts; a layout reports the most any stage
//! holds and the slowest stage's time):
//! - **memory**: parameters (4 bytes each) of the stage, split by the tensor degree, and under ZeRO-3 split by the
//!   data degree too, plus the largest pair of consecutive layers in flight (one in use, the next gathered);
//!   gradients (split by the data degree from ZeRO-2); optimizer state (AdamW's two moments, SGD's momentum; split
//!   from ZeRO-1); activations of the micro-batches the stage holds at once (1F1B: stage `s` of `p` up to `p − s`),
//!   split by the tensor degree but for the part every tensor rank keeps whole.
//! - **time**: training FLOPs (6 per parameter per token, plus attention's) over the compute rate, plus a fixed cost
//!   per layer and micro-batch, stretched by the pipeline bubble `(p − 1) / (m + p − 1)`; the data-parallel gradient
//!   exchange (a ring all-reduce: `2 (d − 1) / d` of the gradient bytes; ZeRO-3 gathers parameters again for
//!   backward: 1.5×, in three collectives per layer and micro-batch), the tensor-parallel all-reduces of activations
//!   (four per block per micro-batch, and the embedding's and the loss's) and the pipeline's sends, over the link
//!   bandwidth, with a fixed cost per message and per tensor-parallel all-reduce.
//!
//! A layout is runnable when this build has a strategy for it — `ddp`/`zero1`/`zero2`/`zero3`, `tensor`,
//! `pipeline` or `3d` — and its `[parallel]` table passes the spec's checks; it carries both, and
//! [`Layout::apply`] sets them into a spec. [`choose`] and [`resolve`] are `train.strategy = "auto"`.

use crate::Real;
use crate::spec::{JobSpec, ModelKind, OptimizerKind, ParallelSpec, PipelineSchedule, Strategy};

/// How much more a step's forward and backward allocate at their peak, on candle's CPU kernels here, than the
/// activations a fused implementation keeps: measured with the counting allocator (`activations_peak` in
/// `summary.json`) against this count on the GPT of `examples/gpt_cicero.toml` at 1 and 2 ranks (3.98 and 4.01).
pub const ACTIVATION_FACTOR: f64 = 4.0;

/// Of the 34·w activation values a GPT block keeps per token (Korthikanti et al.), how many every tensor-parallel
/// rank keeps whole — the layer norms' inputs and outputs, the residual stream, the MLP's input — rather than its
/// share: 16 here, against their 10 for a fused implementation. Measured with `activations_peak` under
/// `strategy = "tensor"`, `[parallel] tensor = 2` on the GPT of `examples/gpt_cicero.toml` (80.2 MiB a rank against
/// 127.4 MiB on one rank of the same batch; `scripts/check-planner.sh`).
pub const TENSOR_WHOLE_VALUES: f64 = 16.0;

/// One layer of a model as the planner sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCost {
    pub name: String,
    pub params: u64,
    /// Bytes of activations one sample keeps for backward in this layer (Real).
    pub activation_bytes: f64,
    /// The part of `activation_bytes` every tensor-parallel rank keeps whole (the rest is split by the degree).
    pub activation_whole_bytes: f64,
    /// Training FLOPs for one sample (forward and backward).
    pub flops: f64,
    /// Bytes one sample's output of this layer is (what a pipeline stage sends on).
    pub output_bytes: f64,
    /// Whether the layer splits over tensor-parallel ranks (transformer blocks, embeddings and the head do).
    pub splits: bool,
    /// All-reduces of one micro-batch's activations (a token's width each) this layer makes, forward and backward,
    /// when split, and small ones beside (a few values per token: the loss's sums).
    pub tensor_reduces: (u32, u32),
}

/// A model as layers in order, and what splitting it allows.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCost {
    pub kind: &'static str,
    pub layers: Vec<LayerCost>,
    /// The tensor degrees the model allows (dividing its heads, width and vocabulary); `[1]` for none.
    pub tensor_degrees: Vec<usize>,
    /// The pipeline degrees this build cuts the model into: the GPT's stages divide its blocks; the MLP's are at
    /// most its layers.
    pub pipeline_degrees: Vec<usize>,
}

impl ModelCost {
    /// The model a job spec names, counted layer by layer (the sizes `shoal_train::models` builds).
    pub fn of(spec: &JobSpec) -> Result<ModelCost, String> {
        let t = &spec.train;
        let m = &t.model;
        match m.kind {
            ModelKind::Gpt => Ok(ModelCost::gpt(m.vocab(), m.context(), m.layers(), m.heads(), m.width())),
            ModelKind::Mlp => {
                let shape = t.data_shape().map_err(|e| e.to_string())?;
                Ok(ModelCost::mlp(shape.features, m.hidden(), shape.classes))
            }
            ModelKind::Cnn | ModelKind::Vit => {
                Err(format!("train.model.kind: the planner knows the mlp and the gpt (not yet the {})", m.kind))
            }
        }
    }

    /// A GPT of `layers` pre-norm blocks of `width` with `heads` heads over `context` tokens of a `vocab`.
    pub fn gpt(vocab: usize, context: usize, layers: usize, heads: usize, width: usize) -> ModelCost {
        let (v, c, w, h) = (vocab as f64, context as f64, width as f64, heads as f64);
        let embed = (vocab * width + context * width) as u64;
        let block = (12 * width * width + 13 * width) as u64;
        let out = (2 * width + width * vocab + vocab) as u64;
        // Activations kept per token and layer, in Real (after Korthikanti et al.'s count for half precision:
        // 34·w + 5·h·c bytes per token at 2 bytes a value, so half that many values at 4 bytes each), times what
        // this implementation's unfused kernels and autograd keep beyond that ([`ACTIVATION_FACTOR`]).
        let block_act = c * (34.0 * w + 5.0 * h * c) * 2.0 * ACTIVATION_FACTOR;
        // Under tensor parallelism, [`TENSOR_WHOLE_VALUES`] of the 34·w values per token stay whole on every rank.
        let block_whole = c * TENSOR_WHOLE_VALUES * w * 2.0 * ACTIVATION_FACTOR;
        let token_out = c * w * 4.0;
        let mut l = vec![LayerCost {
            name: "embed".into(),
            params: embed,
            activation_bytes: token_out,
            activation_whole_bytes: token_out,
            flops: 0.0,
            output_bytes: token_out,
            splits: true,
            // The lookups of each rank's slice of the vocabulary, summed.
            tensor_reduces: (1, 0),
        }];
        for i in 0..layers {
            l.push(LayerCost {
                name: format!("h{i}"),
                params: block,
                activation_bytes: block_act,
                activation_whole_bytes: block_whole,
                // 6 per parameter per token, and attention's scores and weighted sums (forward 4·c·w per token).
                flops: 6.0 * block as f64 * c + 3.0 * 4.0 * c * c * w,
                output_bytes: token_out,
                splits: true,
                // Attention's and the MLP's row-parallel outputs in forward, their inputs' gradients in backward.
                tensor_reduces: (4, 0),
            });
        }
        l.push(LayerCost {
            name: "head".into(),
            params: out,
            activation_bytes: c * (w + 2.0 * v) * 4.0 * ACTIVATION_FACTOR,
            // The final norm's output is whole; the logits and their softmax are split by the vocabulary.
            activation_whole_bytes: c * w * 4.0 * ACTIVATION_FACTOR,
            flops: 6.0 * (width * vocab) as f64 * c,
            output_bytes: c * v * 4.0,
            splits: true,
            // The input's gradient in backward; the cross-entropy's row maxima, sums and target logits.
            tensor_reduces: (1, 3),
        });
        let tensor_degrees = (1..=heads)
            .filter(|t| heads.is_multiple_of(*t) && width.is_multiple_of(*t) && vocab.is_multiple_of(*t))
            .collect();
        let pipeline_degrees = (1..=layers.max(1)).filter(|p| layers.max(1).is_multiple_of(*p)).collect();
        ModelCost { kind: "gpt", layers: l, tensor_degrees, pipeline_degrees }
    }

    /// An MLP from `features` through `hidden` to `classes`.
    pub fn mlp(features: usize, hidden: &[usize], classes: usize) -> ModelCost {
        let sizes: Vec<usize> = std::iter::once(features).chain(hidden.iter().copied()).chain([classes]).collect();
        let layers = sizes
            .windows(2)
            .enumerate()
            .map(|(i, io)| {
                let p = (io[0] * io[1] + io[1]) as u64;
                LayerCost {
                    name: format!("fc{i}"),
                    params: p,
                    activation_bytes: ((io[0] + 2 * io[1]) * 4) as f64,
                    activation_whole_bytes: ((io[0] + 2 * io[1]) * 4) as f64,
                    flops: 6.0 * p as f64,
                    output_bytes: (io[1] * 4) as f64,
                    splits: false,
                    tensor_reduces: (0, 0),
                }
            })
            .collect::<Vec<_>>();
        let pipeline_degrees = (1..=layers.len()).collect();
        ModelCost { kind: "mlp", layers, tensor_degrees: vec![1], pipeline_degrees }
    }

    pub fn params(&self) -> u64 {
        self.layers.iter().map(|l| l.params).sum()
    }
}

/// The machines a plan is for.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterCost {
    pub devices: usize,
    pub memory_per_device: u64,
    /// Sustained training FLOP/s of one device.
    pub flops_per_s: f64,
    /// Bytes/s one device moves to a peer in a collective.
    pub bandwidth: f64,
    /// Seconds one layer's forward and backward of one micro-batch cost beyond their FLOPs (the kernels' launches
    /// and autograd's bookkeeping, whatever the layer's size): [`LAYER_OVERHEAD_S`] here.
    pub layer_overhead_s: f64,
    /// Seconds one message costs beyond its bytes (each hop of a collective, each send between pipeline stages):
    /// [`MESSAGE_LATENCY_S`] here.
    pub latency_s: f64,
    /// Seconds each tensor-parallel all-reduce inside a forward or backward costs beyond its messages (the copies
    /// in and out of the autograd graph, and the wait for the slower rank at every one): [`TENSOR_REDUCE_S`] here.
    pub tensor_reduce_s: f64,
}

/// Fixed seconds per layer and micro-batch on this build's CPU kernels (see [`ClusterCost::layer_overhead_s`]):
/// 1 ms, from the step times of the GPT of `examples/gpt_cicero.toml` as a 2-stage pipeline at 16 and 32
/// micro-batches (0.221 s and 0.246 s: the same FLOPs, 64 more layer passes a stage, less the sends' latency),
/// on a 2-core host shared with other work (`scripts/check-planner.sh` writes and runs those specs).
pub const LAYER_OVERHEAD_S: f64 = 1e-3;

/// Fixed seconds per message of this build's shared-memory collectives (see [`ClusterCost::latency_s`]): 0.25 ms,
/// from ZeRO-3 against DDP on 2 workers of the same GPT (0.128 s against 0.122 s a step: 12 more collectives of 2
/// messages each), on the same host.
pub const MESSAGE_LATENCY_S: f64 = 2.5e-4;

/// Fixed seconds per tensor-parallel all-reduce (see [`ClusterCost::tensor_reduce_s`]): 2.6 ms, from the same GPT
/// under `strategy = "tensor"`, `tensor = 2` against DDP on 2 workers (0.157 s against 0.122 s a step for the same
/// FLOPs a rank: 13 all-reduces whose bytes take 0.7 ms), on the same host, where a rank at an all-reduce often
/// waits for its peer to be scheduled.
pub const TENSOR_REDUCE_S: f64 = 2.6e-3;

/// The share of [`measure_host`]'s matrix-product rate a training step sustains on this build's CPU kernels
/// (small products, and the layer norms, softmax and activations the FLOP count leaves out): 0.4, from DDP on 2
/// workers of the GPT of `examples/gpt_cicero.toml` (0.82 GFLOP a rank in 0.118 s, less the fixed costs, against
/// 13–22 GFLOP/s measured for the products). `shoal plan` scales a measured rate by it.
pub const TRAINING_EFFICIENCY: f64 = 0.4;

impl ClusterCost {
    /// `devices` devices of `memory_per_device` bytes at the given rates, with this build's fixed costs per layer
    /// and per message ([`LAYER_OVERHEAD_S`], [`MESSAGE_LATENCY_S`]).
    pub fn new(devices: usize, memory_per_device: u64, flops_per_s: f64, bandwidth: f64) -> ClusterCost {
        ClusterCost {
            devices,
            memory_per_device,
            flops_per_s,
            bandwidth,
            layer_overhead_s: LAYER_OVERHEAD_S,
            latency_s: MESSAGE_LATENCY_S,
            tensor_reduce_s: TENSOR_REDUCE_S,
        }
    }
}

/// How a step is shaped: the global batch and its accumulation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchCost {
    pub global: usize,
    pub grad_accum: usize,
    /// Optimizer state values per parameter (AdamW 2, SGD with momentum 1, plain SGD 0).
    pub optimizer_values: u64,
}

impl BatchCost {
    pub fn of(spec: &JobSpec) -> BatchCost {
        let t = &spec.train;
        let optimizer_values = match t.optimizer {
            OptimizerKind::Adamw => 2,
            OptimizerKind::Sgd if t.momentum() > 0.0 => 1,
            OptimizerKind::Sgd => 0,
        };
        BatchCost { global: t.global_batch, grad_accum: t.grad_accum.max(1), optimizer_values }
    }
}

/// One layout and what the cost model says of it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Layout {
    pub data: usize,
    pub tensor: usize,
    pub pipeline: usize,
    pub zero: u8,
    /// Micro-batches per step (a pipeline's: the count of the global batch's divisors the cost model finds
    /// fastest; else the accumulation steps).
    pub micro_batches: usize,
    pub memory_per_device_bytes: u64,
    pub params_bytes: u64,
    pub grads_bytes: u64,
    pub optimizer_bytes: u64,
    pub activations_bytes: u64,
    pub step_time_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub bubble: f64,
    /// Whether it fits `memory_per_device`.
    pub fits: bool,
    /// Whether this build can run it (a `train.strategy` and `[parallel]` table the spec accepts do).
    pub runnable: bool,
    /// The `train.strategy` that runs it, when one does.
    pub strategy: Option<Strategy>,
    /// The `[parallel]` table that runs it with `strategy` (none for the data-parallel strategies).
    pub parallel: Option<ParallelSpec>,
}

impl Layout {
    /// The devices the layout uses.
    pub fn devices(&self) -> usize {
        self.data * self.tensor * self.pipeline
    }

    /// The layout in words: its degrees, and the strategy and `[parallel]` settings that run it.
    pub fn describe(&self) -> String {
        let zero = if self.zero > 0 { format!(", ZeRO-{}", self.zero) } else { String::new() };
        let shape = format!("data {} × tensor {} × pipeline {}{zero}", self.data, self.tensor, self.pipeline);
        match (self.strategy, &self.parallel) {
            (Some(s), Some(p)) => format!("{s} ({shape}; [parallel] {})", parallel_keys(p)),
            (Some(s), None) => format!("{s} ({shape})"),
            (None, _) => format!("{shape} (not runnable)"),
        }
    }

    /// `spec` set to run this layout: its `train.strategy` and `[parallel]` table, checked as the spec checks them
    /// at the layout's world size. The one place a planned layout becomes a job spec (`train.strategy = "auto"`).
    pub fn apply(&self, spec: &JobSpec) -> Result<JobSpec, String> {
        let strategy =
            self.strategy.ok_or_else(|| format!("{}: this build has no strategy that runs it", self.describe()))?;
        let mut s = spec.clone();
        s.train.strategy = strategy;
        s.parallel = self.parallel.clone();
        s.validate_layout(self.devices()).map_err(|e| format!("{}: {e}", self.describe()))?;
        Ok(s)
    }
}

/// A `[parallel]` table as its keys: `tensor = 2, …`.
pub fn parallel_keys(p: &ParallelSpec) -> String {
    let mut keys = Vec::new();
    let mut push = |k: &str, v: Option<u64>| {
        if let Some(v) = v {
            keys.push(format!("{k} = {v}"));
        }
    };
    push("data", p.data);
    push("tensor", p.tensor);
    push("pipeline_stages", p.pipeline_stages.map(|v| v as u64));
    push("micro_batches", p.micro_batches.map(|v| v as u64));
    push("zero", p.zero);
    if p.pipeline_stages.is_some() {
        keys.push(format!("schedule = \"{}\"", p.schedule.as_str()));
    }
    keys.join(", ")
}

/// The strategy that runs data × tensor × pipeline with ZeRO stage `zero` for `model` and `batch`, when this build
/// has one — the rules the spec's validation holds a `[parallel]` table to: tensor degrees that divide the
/// model's heads and vocabulary (the GPT's: `ModelCost::tensor_degrees`), pipeline degrees it can cut into
/// (`ModelCost::pipeline_degrees`) with no `grad_accum` beside a pipeline's micro-batches, ZeRO 0–3 for data
/// parallelism alone, 0–1 in a composed layout.
fn runs(model: &ModelCost, batch: BatchCost, d: usize, t: usize, p: usize, zero: u8) -> Option<Strategy> {
    if !model.tensor_degrees.contains(&t) || !model.pipeline_degrees.contains(&p) {
        return None;
    }
    if p > 1 && batch.grad_accum != 1 {
        return None;
    }
    match (d, t, p) {
        (_, 1, 1) => Some(match zero {
            0 => Strategy::Ddp,
            1 => Strategy::Zero1,
            2 => Strategy::Zero2,
            _ => Strategy::Zero3,
        }),
        (1, _, 1) if zero == 0 => Some(Strategy::Tensor),
        (1, 1, _) if zero == 0 => Some(Strategy::Pipeline),
        _ if zero <= 1 => Some(Strategy::ThreeD),
        _ => None,
    }
}

/// The `[parallel]` table that runs `strategy` at these degrees (none for the data-parallel strategies).
fn parallel_of(strategy: Strategy, d: usize, t: usize, p: usize, zero: u8, m: usize) -> Option<ParallelSpec> {
    let mut table = ParallelSpec {
        pipeline_stages: None,
        micro_batches: None,
        schedule: PipelineSchedule::OneFOneB,
        virtual_stages: None,
        data: None,
        tensor: None,
        pipeline: None,
        zero: None,
        balance: None,
    };
    let above_one = |n: usize| (n > 1).then_some(n as u64);
    match strategy {
        Strategy::Tensor => table.tensor = Some(t as u64),
        Strategy::Pipeline => (table.pipeline_stages, table.micro_batches) = (Some(p), Some(m)),
        Strategy::ThreeD => {
            table.data = above_one(d);
            table.tensor = above_one(t);
            table.pipeline_stages = (p > 1).then_some(p);
            table.micro_batches = (p > 1).then_some(m);
            table.zero = (zero > 0).then_some(u64::from(zero));
        }
        _ => return None,
    }
    Some(table)
}

/// The stages a pipeline of `p` cuts `layers` into: the cut the pipeline strategy makes. By parameters
/// ([`crate::strategy::pipeline::balance`]: consecutive layers, the largest stage's parameters as few as can be), or,
/// given each layer's time (`times`, in seconds: what the strategy measures under `parallel.balance = "time"`), by
/// time within 10% of that cut's memory ([`crate::strategy::pipeline::time_balance`]).
fn stages<'a>(layers: &'a [LayerCost], p: usize, times: Option<&[f64]>) -> Vec<&'a [LayerCost]> {
    let sizes: Vec<usize> = layers.iter().map(|l| usize::try_from(l.params).unwrap_or(usize::MAX)).collect();
    let by_time = times.and_then(|times| {
        // Microseconds, at least one a layer, as the strategy counts them.
        let costs: Vec<usize> = times.iter().map(|s| (s * 1e6).round() as usize + 1).collect();
        crate::strategy::pipeline::time_balance(&costs, &sizes, p)
    });
    match by_time.or_else(|| crate::strategy::pipeline::balance(&sizes, p)) {
        Some(cuts) => cuts.into_iter().map(|r| &layers[r]).collect(),
        None => vec![layers],
    }
}

/// Every layout of `cluster.devices` devices for `model` and `batch`, fastest first among those that fit, then the
/// ones that do not fit by memory. Layouts the batch cannot be shared by (fewer samples than data ranks) are left
/// out.
pub fn plan(model: &ModelCost, batch: BatchCost, cluster: &ClusterCost) -> Vec<Layout> {
    let n = cluster.devices.max(1);
    let mut out = Vec::new();
    for &t in &model.tensor_degrees {
        for p in 1..=model.layers.len() {
            if !n.is_multiple_of(t * p) {
                continue;
            }
            let d = n / (t * p);
            if batch.global / (batch.grad_accum * d) == 0 {
                continue;
            }
            for zero in 0..=3u8 {
                if zero > 0 && d == 1 {
                    continue;
                }
                out.push(estimate(model, batch, cluster, d, t, p, zero));
            }
        }
    }
    out.sort_by(|a, b| b.fits.cmp(&a.fits).then(a.step_time_s.total_cmp(&b.step_time_s)));
    out
}

/// The cost model's figures for one layout. A pipeline this build runs takes the count of micro-batches (a divisor
/// of the global batch, at most each replica's samples) that is fastest among those that fit, else the one that
/// holds the least; any other pipeline, the accumulation steps or at least one per stage.
pub fn estimate(
    model: &ModelCost,
    batch: BatchCost,
    cluster: &ClusterCost,
    d: usize,
    t: usize,
    p: usize,
    zero: u8,
) -> Layout {
    let runnable = runs(model, batch, d, t, p, zero).is_some();
    if p == 1 || !runnable {
        let m = if p > 1 { batch.grad_accum.max(p) } else { batch.grad_accum };
        return estimate_with(model, batch, cluster, d, t, p, zero, m);
    }
    let mut best: Option<Layout> = None;
    for m in (1..=batch.global / d.max(1)).filter(|m| batch.global.is_multiple_of(*m)) {
        let l = estimate_with(model, batch, cluster, d, t, p, zero, m);
        let better = match &best {
            None => true,
            Some(b) if l.fits != b.fits => l.fits,
            Some(b) if l.fits => l.step_time_s < b.step_time_s,
            Some(b) => l.memory_per_device_bytes < b.memory_per_device_bytes,
        };
        if better {
            best = Some(l);
        }
    }
    best.unwrap_or_else(|| estimate_with(model, batch, cluster, d, t, p, zero, p))
}

/// What one pipeline stage holds and takes a step.
struct StageCost {
    params: f64,
    grads: f64,
    optimizer: f64,
    activations: f64,
    compute: f64,
    comm: f64,
}

/// The cost model's figures for one layout with `m` micro-batches a step: each pipeline stage's memory and time,
/// the layout's the most any stage holds and the slowest stage's time.
#[allow(clippy::too_many_arguments)]
pub fn estimate_with(
    model: &ModelCost,
    batch: BatchCost,
    cluster: &ClusterCost,
    d: usize,
    t: usize,
    p: usize,
    zero: u8,
    m: usize,
) -> Layout {
    let (df, tf, pf) = (d as f64, t as f64, p as f64);
    let micro_batches = m.max(1);
    let mf = micro_batches as f64;
    let micro_samples = (batch.global as f64 / (mf * df)).max(1.0);
    let per_rank_samples = batch.global as f64 / df;
    let bubble = if p > 1 { (pf - 1.0) / (mf + pf - 1.0) } else { 0.0 };
    let bw = cluster.bandwidth.max(1.0);
    let lat = cluster.latency_s.max(0.0);
    // A ring over k ranks: 2 (k − 1) / k of the bytes each way, in 2 (k − 1) messages.
    let ring = |bytes: f64, k: f64| if k > 1.0 { 2.0 * (k - 1.0) * (bytes / k / bw + lat) } else { 0.0 };
    let token_bytes = model.layers.first().map_or(0.0, |l| l.output_bytes) * micro_samples;
    // A layer's compute a step: every sample of the step through it, split by the tensor degree, and its fixed cost
    // once per micro-batch (whatever its share of the batch or of the layer).
    let layer_s = |l: &LayerCost| {
        l.flops / if l.splits { tf } else { 1.0 } * per_rank_samples / cluster.flops_per_s
            + mf * cluster.layer_overhead_s
    };
    // The pipeline strategy cuts its stages by measured time (`parallel.balance`'s default), the composed layout by
    // parameters.
    let times: Vec<f64> = model.layers.iter().map(layer_s).collect();
    let by_time = runs(model, batch, d, t, p, zero) == Some(Strategy::Pipeline);
    let staged = stages(&model.layers, p, by_time.then_some(&times[..]));
    let last = staged.len().saturating_sub(1);
    let cost = |i: usize, stage: &[LayerCost]| -> StageCost {
        let split = |l: &LayerCost| if l.splits { l.params as f64 / tf } else { l.params as f64 };
        let stage_params: f64 = stage.iter().map(split).sum();
        // ZeRO-3 holds a layer in use and the next one being gathered: the largest such pair.
        let sizes: Vec<f64> = stage.iter().map(split).collect();
        let in_use = sizes.windows(2).map(|w| w[0] + w[1]).fold(sizes.first().copied().unwrap_or(0.0), f64::max);
        let params = if zero >= 3 { 4.0 * (stage_params / df + in_use) } else { 4.0 * stage_params };
        let grads = if zero >= 2 { 4.0 * stage_params / df } else { 4.0 * stage_params };
        let opt_values = batch.optimizer_values as f64 * 4.0 * stage_params;
        let optimizer = if zero >= 1 { opt_values / df } else { opt_values };
        // 1F1B: stage i holds up to p − i micro-batches between their forwards and their backwards.
        let in_flight = micro_batches.min(p - i) as f64;
        let per_sample = |l: &LayerCost| {
            if l.splits {
                l.activation_whole_bytes + (l.activation_bytes - l.activation_whole_bytes) / tf
            } else {
                l.activation_bytes
            }
        };
        let activations = stage.iter().map(per_sample).sum::<f64>() * micro_samples * in_flight;
        let compute: f64 = stage.iter().map(layer_s).sum();
        // Data parallel: one all-reduce of the stage's gradients a step (ZeRO-1/2: its reduce-scatter and the
        // parameters' all-gather, the same bytes); ZeRO-3 gathers each layer again for backward (1.5× the bytes),
        // in three collectives per layer and micro-batch.
        let dp = if zero >= 3 {
            1.5 * ring(4.0 * stage_params, df) + 3.0 * stage.len() as f64 * mf * ring(0.0, df)
        } else {
            ring(4.0 * stage_params, df)
        };
        // Tensor parallel: per micro-batch, each layer's all-reduces (`LayerCost::tensor_reduces`).
        let (big, small) = stage
            .iter()
            .fold((0.0, 0.0), |(b, s), l| (b + f64::from(l.tensor_reduces.0), s + f64::from(l.tensor_reduces.1)));
        let call = if t > 1 { cluster.tensor_reduce_s } else { 0.0 };
        let tp = mf * (big * (ring(token_bytes, tf) + call) + small * (ring(0.0, tf) + call));
        // Pipeline: each micro-batch's activation and its gradient across each edge of the stage (what the last
        // layer before the edge outputs), in a message each.
        let edge = |s: Option<&&[LayerCost]>| s.and_then(|s| s.last()).map_or(0.0, |l| l.output_bytes);
        let mut pp = 0.0;
        if i > 0 {
            pp += 2.0 * mf * (edge(staged.get(i - 1)) * micro_samples / bw + lat);
        }
        if i < last {
            pp += 2.0 * mf * (edge(Some(&stage)) * micro_samples / bw + lat);
        }
        StageCost { params, grads, optimizer, activations, compute, comm: dp + tp + pp }
    };
    let costs: Vec<StageCost> = staged.iter().enumerate().map(|(i, s)| cost(i, s)).collect();
    let held = |c: &StageCost| c.params + c.grads + c.optimizer + c.activations;
    let took = |c: &StageCost| c.compute / (1.0 - bubble) + c.comm;
    let none = StageCost { params: 0.0, grads: 0.0, optimizer: 0.0, activations: 0.0, compute: 0.0, comm: 0.0 };
    let m0 = costs.iter().max_by(|a, b| held(a).total_cmp(&held(b))).unwrap_or(&none);
    let s0 = costs.iter().max_by(|a, b| took(a).total_cmp(&took(b))).unwrap_or(&none);
    let memory = held(m0);
    let strategy = runs(model, batch, d, t, p, zero);
    Layout {
        data: d,
        tensor: t,
        pipeline: p,
        zero,
        micro_batches,
        memory_per_device_bytes: memory as u64,
        params_bytes: m0.params as u64,
        grads_bytes: m0.grads as u64,
        optimizer_bytes: m0.optimizer as u64,
        activations_bytes: m0.activations as u64,
        step_time_s: took(s0),
        compute_s: s0.compute / (1.0 - bubble),
        comm_s: s0.comm,
        bubble,
        fits: memory <= cluster.memory_per_device as f64,
        runnable: strategy.is_some(),
        strategy,
        parallel: strategy.and_then(|s| parallel_of(s, d, t, p, zero, micro_batches)),
    }
}

/// The rates `train.strategy = "auto"` plans with: one core of this build's reference host
/// ([`CHOICE_FLOPS_PER_S`], [`CHOICE_BANDWIDTH`]), the same on every rank, whatever it runs on.
fn choice_cluster(world: usize, memory: u64) -> ClusterCost {
    ClusterCost::new(world.max(1), memory, CHOICE_FLOPS_PER_S, CHOICE_BANDWIDTH)
}

/// Sustained training FLOP/s of one core that `train.strategy = "auto"` plans with: the rate DDP sustained on the
/// reference host of [`TRAINING_EFFICIENCY`] (7 GFLOP/s).
pub const CHOICE_FLOPS_PER_S: f64 = 7e9;

/// Bytes/s between two ranks that `train.strategy = "auto"` plans with: [`measure_host`]'s memory copy on the same
/// host (9 GB/s).
pub const CHOICE_BANDWIDTH: f64 = 9e9;

/// `train.strategy = "auto"`: the layout the planner picks for `spec` on `world` workers of `memory` bytes each,
/// and why, in words. Among the layouts this build runs, the fastest by the cost model of those that fit; if none
/// fits, the one that holds the least. The same on every rank: the choice turns on the spec, the world size and
/// fixed rates only ([`CHOICE_FLOPS_PER_S`], [`CHOICE_BANDWIDTH`], no measurement). [`Layout::apply`] makes the
/// spec that runs it.
pub fn choose(spec: &JobSpec, world: usize, memory: u64) -> Result<(Layout, String), String> {
    let model = ModelCost::of(spec)?;
    let batch = BatchCost::of(spec);
    let runnable: Vec<Layout> =
        plan(&model, batch, &choice_cluster(world, memory)).into_iter().filter(|l| l.runnable).collect();
    let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    let secs = |s: f64| format!("{s:.3} s");
    let fitting: Vec<&Layout> = runnable.iter().filter(|l| l.fits).collect();
    let ddp = runnable.iter().find(|l| l.strategy == Some(Strategy::Ddp));
    let (pick, why) = match fitting.first() {
        Some(&l) => {
            let versus = match fitting.get(1) {
                Some(r) => format!(
                    "est. {} a step vs {} for {}, the runner-up",
                    secs(l.step_time_s),
                    secs(r.step_time_s),
                    r.describe()
                ),
                None => format!("est. {} a step, the only layout that fits", secs(l.step_time_s)),
            };
            let why = match (l.strategy, ddp) {
                (Some(Strategy::Ddp), _) => format!(
                    "{}: the whole model fits each of the {world} workers ({} of {} by the planner's estimate); {versus}",
                    l.describe(),
                    gib(l.memory_per_device_bytes),
                    gib(memory)
                ),
                (_, Some(d)) if !d.fits => format!(
                    "{}: ddp would need {} per worker, over resources.memory = {}; this needs {}; {versus}",
                    l.describe(),
                    gib(d.memory_per_device_bytes),
                    gib(memory),
                    gib(l.memory_per_device_bytes)
                ),
                _ => format!(
                    "{}: the fastest layout that fits ({} per worker of {}); {versus}",
                    l.describe(),
                    gib(l.memory_per_device_bytes),
                    gib(memory)
                ),
            };
            (l, why)
        }
        None => {
            let mut by_memory: Vec<&Layout> = runnable.iter().collect();
            by_memory.sort_by_key(|l| l.memory_per_device_bytes);
            let l = by_memory.first().copied().ok_or_else(|| {
                format!("train.strategy: no layout of {world} workers runs this model and batch (\"auto\" has none to choose)")
            })?;
            let versus = match by_memory.get(1) {
                Some(r) => format!("; the runner-up, {}, needs {}", r.describe(), gib(r.memory_per_device_bytes)),
                None => String::new(),
            };
            let why = format!(
                "{}: no layout fits resources.memory = {} by the planner's estimate; this one holds the least, {} \
                 (est. {} a step){versus}",
                l.describe(),
                gib(memory),
                gib(l.memory_per_device_bytes),
                secs(l.step_time_s)
            );
            (l, why)
        }
    };
    Ok((pick.clone(), why))
}

/// The spec a worker runs: `spec` itself, or under `train.strategy = "auto"` the planner's choice for `world`
/// workers of `resources.memory` each applied to it ([`choose`], [`Layout::apply`]), with why it was chosen.
pub fn resolve(spec: &JobSpec, world: usize) -> Result<(JobSpec, Option<String>), String> {
    if spec.train.strategy != Strategy::Auto {
        return Ok((spec.clone(), None));
    }
    let (layout, why) = choose(spec, world, spec.resources.memory)?;
    Ok((layout.apply(spec)?, Some(why)))
}

/// What this host sustains, measured in about a second: the FLOP/s of one core on Real matrix products of a model of
/// `width` (a device
/// here is a worker on a core) and the bytes/s a memory copy moves (what the shared-memory collectives are bound by).
/// The one function of this module that touches the machine.
pub fn measure_host(width: usize) -> (f64, f64) {
    // A product of the model's own shape (tokens × width by width × 4·width): small widths run far below a
    // large product's rate.
    let (m, k, n) = (1024usize, width.clamp(8, 4096), (4 * width).clamp(8, 16384));
    let a: Vec<Real> = (0..m * k).map(|i| (i % 7) as Real * 0.1).collect();
    let b: Vec<Real> = (0..k * n).map(|i| (i % 5) as Real * 0.1).collect();
    let mut c = vec![0.0 as Real; m * n];
    let t0 = std::time::Instant::now();
    let mut reps = 0u32;
    while t0.elapsed() < std::time::Duration::from_millis(400) {
        let (Ok(x), Ok(y)) = (crate::kernels::Mat::new(&a, m, k), crate::kernels::Mat::new(&b, k, n)) else { break };
        if crate::kernels::matmul(&mut c, x, y, false).is_err() {
            break;
        }
        reps += 1;
    }
    // The products ran on candle's threads: per core, as one worker on one core sees it.
    let threads = candle_core::utils::get_num_threads().max(1) as f64;
    let flops = 2.0 * (m * k * n) as f64 * f64::from(reps.max(1)) / t0.elapsed().as_secs_f64() / threads;
    let src = vec![1u8; 64 << 20];
    let mut dst = vec![0u8; 64 << 20];
    let t0 = std::time::Instant::now();
    let mut copies = 0u32;
    while t0.elapsed() < std::time::Duration::from_millis(300) {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        copies += 1;
    }
    let bandwidth = (src.len() as f64) * f64::from(copies) / t0.elapsed().as_secs_f64();
    (flops, bandwidth)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixed cost table: 10 GFLOP/s a device, 1 GB/s between two, 1 ms per layer and micro-batch, 50 µs a
    /// message, 1 ms a tensor-parallel all-reduce.
    fn cluster(devices: usize, memory: u64) -> ClusterCost {
        ClusterCost {
            devices,
            memory_per_device: memory,
            flops_per_s: 1e10,
            bandwidth: 1e9,
            layer_overhead_s: 1e-3,
            latency_s: 5e-5,
            tensor_reduce_s: 1e-3,
        }
    }

    fn job(train: &str, model: &str) -> JobSpec {
        let text = format!(
            "name = \"a\"\n[train]\nsteps = 1\nlr = 0.1\nstrategy = \"auto\"\n{train}\n[train.model]\n{model}\n"
        );
        crate::spec::parse_job(&text, "JOB.toml").unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn auto_takes_ddp_when_it_fits_and_a_sharded_layout_otherwise() {
        let spec = job("dataset = \"digits\"\nglobal_batch = 64", "kind = \"mlp\"\nhidden = [4096, 4096]");
        let (l, why) = choose(&spec, 4, 1 << 30).expect("choose");
        assert_eq!((l.strategy, &l.parallel), (Some(Strategy::Ddp), &None), "{why}");
        assert!(why.starts_with("ddp (data 4 × tensor 1 × pipeline 1): the whole model fits"), "{why}");
        assert!(why.contains("a step vs") && why.contains("the runner-up"), "{why}");
        // About 17M parameters: DDP needs 16 bytes each (272 MB), over 200 MiB; sharded layouts need less.
        let (l, why) = choose(&spec, 4, 200 << 20).expect("choose");
        assert!(l.fits && l.strategy != Some(Strategy::Ddp), "{why}");
        assert!(why.contains("ddp would need") && why.contains("resources.memory"), "{why}");
        let (l, why) = choose(&spec, 4, 1 << 20).expect("choose");
        assert!(!l.fits && why.contains("no layout fits"), "{why}");
        let (planned, _) = resolve(&spec, 4).expect("resolve");
        assert_eq!(planned.train.strategy, Strategy::Ddp);
    }

    /// What the plan calls runnable is exactly what the spec accepts: every layout of a GPT and an MLP at 1 to 8
    /// workers, with and without gradient accumulation, set into a spec as the strategy that would run it.
    #[test]
    fn every_runnable_layout_is_one_the_spec_accepts_and_no_other_is() {
        let specs = [
            job(
                "dataset = \"cicero\"\nglobal_batch = 24",
                "kind = \"gpt\"\nlayers = 4\nheads = 4\nwidth = 32\ncontext = 16",
            ),
            job(
                "dataset = \"cicero\"\nglobal_batch = 24\ngrad_accum = 2",
                "kind = \"gpt\"\nlayers = 2\nheads = 4\nwidth = 32\ncontext = 16",
            ),
            job("dataset = \"digits\"\nglobal_batch = 16", "kind = \"mlp\"\nhidden = [32, 16]"),
        ];
        let mut seen = std::collections::BTreeSet::new();
        for spec in &specs {
            let model = ModelCost::of(spec).expect("model");
            for world in 1..=8 {
                for l in plan(&model, BatchCost::of(spec), &cluster(world, 1 << 40)) {
                    let (d, t, p) = (l.data, l.tensor, l.pipeline);
                    let natural = match (d, t, p) {
                        (_, 1, 1) => runs(&model, BatchCost { grad_accum: 1, ..BatchCost::of(spec) }, d, 1, 1, l.zero),
                        (1, _, 1) => Some(Strategy::Tensor),
                        (1, 1, _) => Some(Strategy::Pipeline),
                        _ => Some(Strategy::ThreeD),
                    }
                    .expect("a strategy");
                    let mut s = spec.clone();
                    s.train.strategy = natural;
                    s.parallel = parallel_of(natural, d, t, p, l.zero, l.micro_batches.max(1));
                    let accepted = s.validate_layout(world);
                    assert_eq!(l.runnable, accepted.is_ok(), "{} at {world}: {accepted:?}", l.describe());
                    if l.runnable {
                        assert_eq!(l.strategy, Some(natural));
                        assert_eq!(l.apply(spec).expect("applies").parallel, l.parallel);
                        seen.insert(natural.as_str());
                    }
                }
            }
        }
        let all = ["3d", "ddp", "pipeline", "tensor", "zero1", "zero2", "zero3"];
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), all);
    }

    /// On a fixed cost table: DDP first when the whole model fits; when only a layout that splits the activations
    /// fits, a tensor-parallel or pipeline layout first, with the `[parallel]` settings that run it.
    #[test]
    fn the_ranking_takes_ddp_when_it_fits_and_splits_the_model_when_memory_forces_it() {
        // Long sequences and a wide batch: activations dominate, which only tensor and pipeline layouts divide.
        let m = ModelCost::gpt(256, 256, 4, 4, 128);
        let b = BatchCost { global: 16, grad_accum: 1, optimizer_values: 2 };
        let roomy = plan(&m, b, &cluster(2, 1 << 40));
        assert_eq!((roomy[0].strategy, roomy[0].data), (Some(Strategy::Ddp), 2), "{:?}", roomy[0]);
        let least = |f: &dyn Fn(&Layout) -> bool| {
            roomy.iter().filter(|l| l.runnable && f(l)).map(|l| l.memory_per_device_bytes).min().expect("one")
        };
        let data_parallel = least(&|l| l.tensor == 1 && l.pipeline == 1);
        let split = least(&|l| l.tensor > 1 || l.pipeline > 1);
        assert!(split < data_parallel, "{split} vs {data_parallel}");
        let tight = plan(&m, b, &cluster(2, (split + data_parallel) / 2));
        let first = &tight[0];
        assert!(first.fits && first.runnable && (first.tensor > 1 || first.pipeline > 1), "{first:?}");
        let table = first.parallel.as_ref().expect("a [parallel] table");
        match first.strategy {
            Some(Strategy::Tensor) => assert_eq!(table.tensor, Some(2)),
            Some(Strategy::Pipeline) => {
                assert_eq!(table.pipeline_stages, Some(2));
                assert!(b.global.is_multiple_of(table.micro_batches.unwrap_or(0)), "{table:?}");
            }
            other => panic!("{other:?}"),
        }
        assert!(tight.iter().filter(|l| l.tensor == 1 && l.pipeline == 1).all(|l| !l.fits));
    }

    /// `choose` for a spec whose activations only a split model holds: the layout comes with its strategy and
    /// `[parallel]` settings, and `resolve` gives the spec that runs them.
    #[test]
    fn auto_splits_a_model_whose_activations_do_not_fit_a_data_parallel_worker() {
        let spec = job(
            "dataset = \"cicero\"\nglobal_batch = 16",
            "kind = \"gpt\"\nlayers = 2\nheads = 4\nwidth = 64\ncontext = 256",
        );
        let model = ModelCost::of(&spec).expect("model");
        let all = plan(&model, BatchCost::of(&spec), &choice_cluster(2, 1 << 40));
        let dp = all.iter().filter(|l| l.tensor == 1 && l.pipeline == 1).map(|l| l.memory_per_device_bytes).min();
        let memory = dp.expect("data parallel") * 9 / 10;
        let (l, why) = choose(&spec, 2, memory).expect("choose");
        assert!(l.fits && (l.tensor > 1 || l.pipeline > 1), "{why}");
        assert!(why.contains("ddp would need") && why.contains("s a step"), "{why}");
        let mut s = spec.clone();
        s.resources.memory = memory;
        let (planned, chose) = resolve(&s, 2).expect("resolve");
        assert_eq!(chose.as_deref(), Some(why.as_str()));
        assert_eq!((Some(planned.train.strategy), &planned.parallel), (l.strategy, &l.parallel));
        assert!(planned.parallel.is_some(), "{why}");
    }

    #[test]
    fn the_gpt_is_counted_as_it_is_built() {
        let mut p = crate::params::Params::default();
        let mut rng = crate::params::SeededRng::new(0);
        let cfg = crate::models::GptConfig { vocab: 50, context: 16, layers: 3, heads: 4, width: 32 };
        crate::models::Gpt::new(&mut p, &mut rng, cfg).expect("gpt");
        let m = ModelCost::gpt(50, 16, 3, 4, 32);
        assert_eq!(m.params(), p.count() as u64);
        assert_eq!(m.tensor_degrees, [1, 2], "4 divides the heads but not the vocabulary");
        assert_eq!(m.pipeline_degrees, [1, 3]);
        let mut p = crate::params::Params::default();
        crate::models::Mlp::new(&mut p, &mut rng, 64, &[64, 32], 10).expect("mlp");
        assert_eq!(ModelCost::mlp(64, &[64, 32], 10).params(), p.count() as u64);
    }

    #[test]
    fn zero_stages_divide_what_they_shard() {
        let m = ModelCost::mlp(64, &[64], 10);
        let b = BatchCost { global: 64, grad_accum: 1, optimizer_values: 2 };
        let p = m.params();
        let c = cluster(4, 1 << 30);
        let at = |zero| estimate(&m, b, &c, 4, 1, 1, zero);
        assert_eq!((at(0).params_bytes, at(0).grads_bytes, at(0).optimizer_bytes), (4 * p, 4 * p, 8 * p));
        assert_eq!((at(1).params_bytes, at(1).grads_bytes, at(1).optimizer_bytes), (4 * p, 4 * p, 2 * p));
        assert_eq!((at(2).grads_bytes, at(2).optimizer_bytes), (p, 2 * p));
        // A quarter of the parameters, and a layer in use with the next being gathered (here the whole model).
        assert_eq!(at(3).params_bytes, p + 4 * p, "{:?}", at(3));
        assert!(at(3).comm_s > at(2).comm_s, "ZeRO-3 gathers parameters again");
    }

    #[test]
    fn a_7b_gpt_needs_sharding_on_80_gib_devices_and_the_plan_says_so() {
        // Context 512 and 8 samples a step: activations are kept whole, in Real, with no recomputation.
        let m = ModelCost::gpt(32000, 512, 32, 32, 4096);
        assert!((6.4e9..7.0e9).contains(&(m.params() as f64)), "{}", m.params());
        let b = BatchCost { global: 8, grad_accum: 1, optimizer_values: 2 };
        let plans = plan(&m, b, &cluster(8, 80 << 30));
        let ddp = plans.iter().find(|l| (l.data, l.tensor, l.pipeline, l.zero) == (8, 1, 1, 0)).expect("ddp");
        assert!(!ddp.fits, "16 bytes a parameter of a 7B model is over 80 GiB: {ddp:?}");
        let best = &plans[0];
        assert!(best.fits && (best.zero > 0 || best.tensor > 1 || best.pipeline > 1), "{best:?}");
        assert!(plans.windows(2).all(|w| w[0].fits || !w[1].fits), "fitting layouts first");
        let fitting: Vec<&Layout> = plans.iter().filter(|l| l.fits).collect();
        assert!(fitting.windows(2).all(|w| w[0].step_time_s <= w[1].step_time_s), "fastest first");
        for l in &plans {
            assert_eq!(l.data * l.tensor * l.pipeline, 8, "{l:?}");
        }
    }

    /// Under the pipeline strategy, which cuts its stages by measured time, the planner expects the cut by time
    /// (within 10% of the even cut's memory), not the cut by parameters: here the two differ, and the layout's
    /// parameters are those of a stage of the time cut.
    #[test]
    fn a_pipeline_balanced_by_time_is_planned_with_the_cut_it_will_make() {
        let m = ModelCost::gpt(2048, 16, 8, 4, 32);
        let b = BatchCost { global: 32, grad_accum: 1, optimizer_values: 2 };
        let c = cluster(2, 1 << 30);
        let l = estimate_with(&m, b, &c, 1, 1, 2, 0, 4);
        assert_eq!(l.strategy, Some(Strategy::Pipeline));
        let times: Vec<f64> =
            m.layers.iter().map(|x| x.flops * 32.0 / c.flops_per_s + 4.0 * c.layer_overhead_s).collect();
        let bytes = |cut: Vec<&[LayerCost]>| -> Vec<u64> {
            cut.iter().map(|s| 4 * s.iter().map(|x| x.params).sum::<u64>()).collect()
        };
        let (by_time, by_params) = (bytes(stages(&m.layers, 2, Some(&times))), bytes(stages(&m.layers, 2, None)));
        assert!(by_time.iter().all(|b| !by_params.contains(b)), "the cuts differ: {by_time:?} vs {by_params:?}");
        assert!(by_time.contains(&l.params_bytes), "{} is a stage of {by_time:?}", l.params_bytes);
        // Memory stays within 10% of the cut by parameters.
        let (most_t, most_p) = (by_time.iter().max(), by_params.iter().max());
        assert!(most_t.zip(most_p).is_some_and(|(t, p)| *t as f64 <= 1.1 * *p as f64), "{by_time:?} vs {by_params:?}");
        // A composed layout (data × pipeline) still cuts by parameters.
        let composed = estimate_with(&m, b, &cluster(4, 1 << 30), 2, 1, 2, 0, 4);
        assert_eq!(composed.strategy, Some(Strategy::ThreeD));
        assert!(by_params.contains(&composed.params_bytes), "{} is a stage of {by_params:?}", composed.params_bytes);
    }

    #[test]
    fn pipeline_stages_balance_parameters_and_report_the_bubble() {
        let m = ModelCost::gpt(64, 16, 4, 4, 64);
        let b = BatchCost { global: 32, grad_accum: 4, optimizer_values: 2 };
        let whole = estimate(&m, b, &cluster(2, 1 << 30), 1, 1, 1, 0);
        let two = estimate(&m, b, &cluster(2, 1 << 30), 1, 1, 2, 0);
        assert!(two.params_bytes as f64 <= 0.62 * whole.params_bytes as f64, "{two:?} vs {whole:?}");
        assert!((two.bubble - 1.0 / 5.0).abs() < 1e-12, "(p-1)/(m+p-1) = 1/5: {}", two.bubble);
        assert_eq!(stages(&m.layers, 3, None).iter().map(|s| s.len()).sum::<usize>(), m.layers.len());
    }
}
