//! The planner behind `shoal plan`: given a model (its layers' sizes, counted from the job spec's model, at any size
//! — a 7B GPT included, nothing is built) and a cluster (devices, memory each, compute rate, link bandwidth), it
//! enumerates data × tensor × pipeline × ZeRO layouts that use every device, estimates each one's memory per device
//! and step time with a cost model, and ranks the ones that fit, fastest first. No IO: the caller measures or reads
//! the cluster's rates.
//!
//! The cost model, per device:
//! - **memory**: parameters (4 bytes each) of its pipeline stage, split by the tensor degree, and under ZeRO-3 split
//!   by the data degree too, plus the largest pair of consecutive layers in flight (one in use, the next gathered); gradients (split by the data degree from ZeRO-2);
//!   optimizer state (AdamW's two moments, SGD's momentum; split from ZeRO-1); activations of the micro-batches a
//!   stage holds at once (1F1B: up to the pipeline degree), split by the tensor degree.
//! - **time**: training FLOPs (6 per parameter per token, plus attention's) over the compute rate, stretched by the
//!   pipeline bubble `(p − 1) / (m + p − 1)`; the data-parallel gradient exchange (a ring all-reduce: `2 (d − 1) / d`
//!   of the gradient bytes; ZeRO-3 gathers parameters again for backward: 1.5×), the tensor-parallel all-reduces of
//!   activations (four per layer per micro-batch) and the pipeline's sends, over the link bandwidth.

use crate::spec::{JobSpec, ModelKind, OptimizerKind};

/// How much more a step's forward and backward allocate at their peak, on candle's CPU kernels here, than the
/// activations a fused implementation keeps: measured with the counting allocator (`activations_peak` in
/// `summary.json`) against this count on the GPT of `examples/gpt_cicero.toml` at 1 and 2 ranks (3.98 and 4.01).
pub const ACTIVATION_FACTOR: f64 = 4.0;

/// One layer of a model as the planner sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCost {
    pub name: String,
    pub params: u64,
    /// Bytes of activations one sample keeps for backward in this layer (f32).
    pub activation_bytes: f64,
    /// Training FLOPs for one sample (forward and backward).
    pub flops: f64,
    /// Bytes one sample's output of this layer is (what a pipeline stage sends on).
    pub output_bytes: f64,
    /// Whether the layer splits over tensor-parallel ranks (transformer blocks, embeddings and the head do).
    pub splits: bool,
}

/// A model as layers in order, and what splitting it allows.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCost {
    pub kind: &'static str,
    pub layers: Vec<LayerCost>,
    /// The tensor degrees the model allows (dividing its heads and width); `[1]` for none.
    pub tensor_degrees: Vec<usize>,
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
        // Activations kept per token and layer, in f32 (after Korthikanti et al.'s count for half precision:
        // 34·w + 5·h·c bytes per token at 2 bytes a value, so half that many values at 4 bytes each), times what
        // this implementation's unfused kernels and autograd keep beyond that ([`ACTIVATION_FACTOR`]).
        let block_act = c * (34.0 * w + 5.0 * h * c) * 2.0 * ACTIVATION_FACTOR;
        let token_out = c * w * 4.0;
        let mut l = vec![LayerCost {
            name: "embed".into(),
            params: embed,
            activation_bytes: token_out,
            flops: 0.0,
            output_bytes: token_out,
            splits: true,
        }];
        for i in 0..layers {
            l.push(LayerCost {
                name: format!("h{i}"),
                params: block,
                activation_bytes: block_act,
                // 6 per parameter per token, and attention's scores and weighted sums (forward 4·c·w per token).
                flops: 6.0 * block as f64 * c + 3.0 * 4.0 * c * c * w,
                output_bytes: token_out,
                splits: true,
            });
        }
        l.push(LayerCost {
            name: "head".into(),
            params: out,
            activation_bytes: c * (w + 2.0 * v) * 4.0 * ACTIVATION_FACTOR,
            flops: 6.0 * (width * vocab) as f64 * c,
            output_bytes: c * v * 4.0,
            splits: true,
        });
        let tensor_degrees = (1..=heads).filter(|t| heads.is_multiple_of(*t) && width.is_multiple_of(*t)).collect();
        ModelCost { kind: "gpt", layers: l, tensor_degrees }
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
                    flops: 6.0 * p as f64,
                    output_bytes: (io[1] * 4) as f64,
                    splits: false,
                }
            })
            .collect();
        ModelCost { kind: "mlp", layers, tensor_degrees: vec![1] }
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
    /// Micro-batches per step through the pipeline (the accumulation steps, at least the pipeline degree).
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
    /// Whether this build can run it (data parallel with any ZeRO stage today).
    pub runnable: bool,
    /// The `train.strategy` that runs it, when one does.
    pub strategy: Option<&'static str>,
}

/// Contiguous stages of `layers` with balanced parameters: the largest stage's layers.
fn stages(layers: &[LayerCost], p: usize) -> Vec<&[LayerCost]> {
    let total: u64 = layers.iter().map(|l| l.params).sum();
    let mut out = Vec::with_capacity(p);
    let mut start = 0;
    let mut acc = 0u64;
    for (i, l) in layers.iter().enumerate() {
        acc += l.params;
        let left_layers = layers.len() - i - 1;
        let left_stages = p - out.len() - 1;
        let target = total * (out.len() as u64 + 1) / p as u64;
        if left_stages > 0 && (acc >= target || left_layers == left_stages) {
            out.push(&layers[start..=i]);
            start = i + 1;
        }
    }
    out.push(&layers[start..]);
    out
}

/// Every layout of `cluster.devices` devices for `model` and `batch`, fastest first among those that fit, then the
/// ones that do not fit by memory. Layouts the batch cannot be shared by (fewer samples than data ranks) are left
/// out.
pub fn plan(model: &ModelCost, batch: BatchCost, cluster: &ClusterCost) -> Vec<Layout> {
    let n = cluster.devices.max(1);
    let mut out = Vec::new();
    for &t in &model.tensor_degrees {
        for p in (1..=model.layers.len()).filter(|p| (n / t.max(1)).is_multiple_of(*p) || *p == 1) {
            if !n.is_multiple_of(t * p) {
                continue;
            }
            let d = n / (t * p);
            let micro_samples = batch.global / (batch.grad_accum * d);
            if micro_samples == 0 {
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

/// The cost model's figures for one layout.
pub fn estimate(
    model: &ModelCost,
    batch: BatchCost,
    cluster: &ClusterCost,
    d: usize,
    t: usize,
    p: usize,
    zero: u8,
) -> Layout {
    let (df, tf, pf) = (d as f64, t as f64, p as f64);
    let staged = stages(&model.layers, p);
    let stage = staged.iter().max_by_key(|s| s.iter().map(|l| l.params).sum::<u64>()).copied().unwrap_or(&[]);
    let split = |l: &LayerCost| if l.splits { l.params as f64 / tf } else { l.params as f64 };
    let stage_params: f64 = stage.iter().map(split).sum();
    // ZeRO-3 holds a layer in use and the next one being gathered: the largest such pair.
    let sizes: Vec<f64> = stage.iter().map(split).collect();
    let in_use = sizes.windows(2).map(|w| w[0] + w[1]).fold(sizes.first().copied().unwrap_or(0.0), f64::max);
    let params = if zero >= 3 { 4.0 * (stage_params / df + in_use) } else { 4.0 * stage_params };
    let grads = if zero >= 2 { 4.0 * stage_params / df } else { 4.0 * stage_params };
    let opt_values = batch.optimizer_values as f64 * 4.0 * stage_params;
    let optimizer = if zero >= 1 { opt_values / df } else { opt_values };
    let micro_batches = if p > 1 { batch.grad_accum.max(p) } else { batch.grad_accum };
    let micro_samples = (batch.global as f64 / (micro_batches as f64 * df)).max(1.0);
    let in_flight = micro_batches.min(p) as f64;
    let act: f64 = stage.iter().map(|l| l.activation_bytes / if l.splits { tf } else { 1.0 }).sum();
    let activations = act * micro_samples * in_flight;
    let memory = params + grads + optimizer + activations;

    // Compute: every sample of the step through the stage, split by the tensor degree; the bubble stretches it.
    let stage_flops: f64 = stage.iter().map(|l| l.flops / if l.splits { tf } else { 1.0 }).sum();
    let per_rank_samples = batch.global as f64 / df;
    let bubble = if p > 1 { (pf - 1.0) / (micro_batches as f64 + pf - 1.0) } else { 0.0 };
    let compute = stage_flops * per_rank_samples / cluster.flops_per_s / (1.0 - bubble);
    let bw = cluster.bandwidth.max(1.0);
    let ring = |bytes: f64, k: f64| if k > 1.0 { 2.0 * (k - 1.0) / k * bytes / bw } else { 0.0 };
    let dp = ring(4.0 * stage_params, df) * if zero >= 3 { 1.5 } else { 1.0 };
    let blocks = stage.iter().filter(|l| l.splits).count() as f64;
    let out_bytes = stage.last().map_or(0.0, |l| l.output_bytes);
    let tp = 4.0 * blocks * micro_batches as f64 * ring(out_bytes * micro_samples, tf);
    let pp = if p > 1 { 2.0 * micro_batches as f64 * out_bytes * micro_samples / bw } else { 0.0 };
    let comm = dp + tp + pp;
    let runnable = t == 1 && p == 1;
    Layout {
        data: d,
        tensor: t,
        pipeline: p,
        zero,
        micro_batches,
        memory_per_device_bytes: memory as u64,
        params_bytes: params as u64,
        grads_bytes: grads as u64,
        optimizer_bytes: optimizer as u64,
        activations_bytes: activations as u64,
        step_time_s: compute + comm,
        compute_s: compute,
        comm_s: comm,
        bubble,
        fits: memory <= cluster.memory_per_device as f64,
        runnable,
        strategy: runnable.then_some(match zero {
            0 => "ddp",
            1 => "zero1",
            2 => "zero2",
            _ => "zero3",
        }),
    }
}

/// `train.strategy = "auto"`: the strategy the planner picks for `spec` on `world` workers of `memory` bytes each,
/// and why, in words. Among the layouts this build runs (data parallel, any ZeRO stage), the first that fits by the
/// cost model — DDP when it does, since sharding only adds communication — else ZeRO-3, which holds the least. The
/// same on every rank (no measurement: the choice turns on memory and communication volume only).
pub fn choose(spec: &JobSpec, world: usize, memory: u64) -> Result<(crate::spec::Strategy, String), String> {
    use crate::spec::Strategy;
    let model = ModelCost::of(spec)?;
    let cluster = ClusterCost { devices: world.max(1), memory_per_device: memory, flops_per_s: 1e11, bandwidth: 1e10 };
    let runnable: Vec<Layout> =
        plan(&model, BatchCost::of(spec), &cluster).into_iter().filter(|l| l.runnable).collect();
    let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    let by_name = |n: &str| match n {
        "zero1" => Strategy::Zero1,
        "zero2" => Strategy::Zero2,
        "zero3" => Strategy::Zero3,
        _ => Strategy::Ddp,
    };
    let ddp = runnable.iter().find(|l| l.zero == 0);
    let pick = runnable.iter().find(|l| l.fits);
    Ok(match pick {
        Some(l) => {
            let name = l.strategy.unwrap_or("ddp");
            let why = match (name, ddp) {
                ("ddp", _) => format!(
                    "ddp: the whole model fits each of the {world} workers ({} of {} by the planner's estimate)",
                    gib(l.memory_per_device_bytes),
                    gib(memory)
                ),
                (_, Some(d)) => format!(
                    "{name}: ddp would need {} per worker, over resources.memory = {}; {name} needs {}",
                    gib(d.memory_per_device_bytes),
                    gib(memory),
                    gib(l.memory_per_device_bytes)
                ),
                (_, None) => {
                    format!("{name}: it needs {} per worker of {}", gib(l.memory_per_device_bytes), gib(memory))
                }
            };
            (by_name(name), why)
        }
        None => {
            let least = runnable.iter().map(|l| l.memory_per_device_bytes).min().unwrap_or(0);
            (
                Strategy::Zero3,
                format!(
                    "zero3: no data-parallel layout fits resources.memory = {} by the planner's estimate (ZeRO-3 needs \
                     {}); it holds the least",
                    gib(memory),
                    gib(least)
                ),
            )
        }
    })
}

/// What this host sustains, measured in about a second: the FLOP/s of one core on f32 matrix products of a model of
/// `width` (a device
/// here is a worker on a core) and the bytes/s a memory copy moves (what the shared-memory collectives are bound by).
/// The one function of this module that touches the machine.
pub fn measure_host(width: usize) -> (f64, f64) {
    // A product of the model's own shape (tokens × width by width × 4·width): small widths run far below a
    // large product's rate.
    let (m, k, n) = (1024usize, width.clamp(8, 4096), (4 * width).clamp(8, 16384));
    let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut c = vec![0f32; m * n];
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

    fn cluster(devices: usize, memory: u64) -> ClusterCost {
        ClusterCost { devices, memory_per_device: memory, flops_per_s: 1e11, bandwidth: 1e9 }
    }

    #[test]
    fn auto_takes_ddp_when_it_fits_and_the_lightest_zero_stage_otherwise() {
        let spec = crate::spec::parse_job(
            "name = \"a\"\n[train]\ndataset = \"digits\"\nglobal_batch = 64\nsteps = 1\nlr = 0.1\n\
             strategy = \"auto\"\n[train.model]\nkind = \"mlp\"\nhidden = [4096, 4096]\n",
            "JOB.toml",
        )
        .expect("spec");
        let (s, why) = choose(&spec, 4, 1 << 30).expect("choose");
        assert_eq!(s, crate::spec::Strategy::Ddp, "{why}");
        assert!(why.starts_with("ddp: the whole model fits"), "{why}");
        // About 17M parameters: DDP needs 16 bytes each (272 MB); ZeRO-1 on 4 workers 10 (170 MB).
        let (s, why) = choose(&spec, 4, 200 << 20).expect("choose");
        assert_eq!(s, crate::spec::Strategy::Zero1, "{why}");
        assert!(why.contains("ddp would need") && why.contains("resources.memory"), "{why}");
        let (s, why) = choose(&spec, 4, 1 << 20).expect("choose");
        assert_eq!(s, crate::spec::Strategy::Zero3, "{why}");
        assert!(why.contains("no data-parallel layout fits"), "{why}");
    }

    #[test]
    fn the_gpt_is_counted_as_it_is_built() {
        let mut p = crate::params::Params::default();
        let mut rng = crate::params::SeededRng::new(0);
        let cfg = crate::models::GptConfig { vocab: 50, context: 16, layers: 3, heads: 4, width: 32 };
        crate::models::Gpt::new(&mut p, &mut rng, cfg).expect("gpt");
        let m = ModelCost::gpt(50, 16, 3, 4, 32);
        assert_eq!(m.params(), p.count() as u64);
        assert_eq!(m.tensor_degrees, [1, 2, 4]);
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
        // Context 512 and 8 samples a step: activations are kept whole, in f32, with no recomputation.
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

    #[test]
    fn pipeline_stages_balance_parameters_and_report_the_bubble() {
        let m = ModelCost::gpt(64, 16, 4, 4, 64);
        let b = BatchCost { global: 32, grad_accum: 4, optimizer_values: 2 };
        let whole = estimate(&m, b, &cluster(2, 1 << 30), 1, 1, 1, 0);
        let two = estimate(&m, b, &cluster(2, 1 << 30), 1, 1, 2, 0);
        assert!(two.params_bytes as f64 <= 0.62 * whole.params_bytes as f64, "{two:?} vs {whole:?}");
        assert!((two.bubble - 1.0 / 5.0).abs() < 1e-12, "(p-1)/(m+p-1) = 1/5: {}", two.bubble);
        assert_eq!(stages(&m.layers, 3).iter().map(|s| s.len()).sum::<usize>(), m.layers.len());
    }
}
