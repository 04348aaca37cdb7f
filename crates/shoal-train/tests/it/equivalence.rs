//! DDP with N workers ends with the same parameters as one worker with the same
//! global batch and seed: every tensor within 1e-5 relative (max |a-b| / max |a|).

use shoal_train::Real;
use std::sync::Arc;
use std::time::Duration;

use shoal_comm::{CommConfig, Communicator, TransportChoice};
use shoal_data::{Dataset, DistributedSampler, Options, SamplerConfig, Split};
use shoal_train::batch::{to_flat, to_tensors};
use shoal_train::{Gpt, GptConfig, Mlp, Model, OptimConfig, Params, SeededRng, Trainer, TrainerConfig};

#[derive(Clone, Copy, Debug)]
pub(crate) enum Which {
    Mlp,
    Gpt,
}

#[derive(Clone)]
pub(crate) struct Run {
    pub(crate) which: Which,
    pub(crate) steps: usize,
    pub(crate) global_batch: usize,
    pub(crate) grad_accum: usize,
    pub(crate) optimizer: OptimConfig,
    /// Train through the model's hand-written backward pass instead of autograd.
    pub(crate) hand: bool,
    /// All-reduce buckets during backward (else in `step`, on the training thread).
    pub(crate) overlap: bool,
    /// ZeRO stage 1, 2 or 3 instead of DDP (0: DDP); stage 3 prefetches the next layer with `overlap`.
    pub(crate) zero: u8,
    /// Gradients sent compressed.
    pub(crate) compress: Option<shoal_comm::CompressConfig>,
    /// With `compress` under DDP: past its warm-up, AdamW's first moment sent in place of the gradients.
    pub(crate) momentum: bool,
    /// Under DDP: the buckets combined by this robust rule bearing this many attackers.
    pub(crate) robust: Option<(shoal_ps::Rule, usize)>,
    /// With `robust`: one rank's buckets forged by this attack.
    pub(crate) attack: Option<(shoal_ps::Attack, usize)>,
    /// Clip the gradient at a global norm of 1 (the parameter servers cannot).
    pub(crate) clip: bool,
    /// On parameter servers (`strategy = "ps"`): where they listen, and their mode.
    pub(crate) ps: Option<(Vec<String>, shoal_ps::Mode)>,
    /// The parameters held where the model computes (`Params::set_resident`, on the CPU here): the path a GPU
    /// takes — the optimizer's tensor operations, gradients summed where they are, buckets staged to the host.
    pub(crate) resident: bool,
    /// With `resident`, under DDP: the buckets summed where the gradients are, through [`DeviceSum`] (the seam NCCL
    /// fills on a GPU), instead of staged to the host by the strategy.
    pub(crate) device_reduce: bool,
}

/// The device all-reduce seam filled by the communicator: a bucket read out, summed across the ranks, and put back
/// where it was — on the CPU, what `Ddp`'s device path is checked with where no GPU is (NCCL fills the seam there).
struct DeviceSum(Communicator);

impl shoal_train::strategy::DeviceAllReduce for DeviceSum {
    fn all_reduce(&mut self, flat: candle_core::Tensor) -> shoal_train::Result<candle_core::Tensor> {
        let mut values = flat.to_vec1::<Real>()?;
        self.0.all_reduce(&mut values, shoal_comm::ReduceOp::Sum)?;
        Ok(candle_core::Tensor::from_vec(values, flat.dims(), flat.device())?)
    }

    fn name(&self) -> &'static str {
        "communicator"
    }
}

impl Run {
    /// Plain data parallelism on the digits MLP with AdamW, overlapping, autograd: the base the tests vary.
    pub(crate) fn mlp(steps: usize, global_batch: usize, grad_accum: usize) -> Run {
        Run {
            which: Which::Mlp,
            steps,
            global_batch,
            grad_accum,
            optimizer: ADAMW,
            hand: false,
            overlap: true,
            zero: 0,
            compress: None,
            momentum: false,
            robust: None,
            attack: None,
            clip: true,
            ps: None,
            resident: false,
            device_reduce: false,
        }
    }
}

/// What a run leaves, as a checkpoint holds it: every parameter and the optimizer state as whole named tensors, the
/// optimizer's update count, and the steps taken.
#[derive(Clone, Debug)]
pub(crate) struct Saved {
    pub(crate) params: Vec<(String, Vec<Real>)>,
    pub(crate) optimizer: Vec<(String, Vec<Real>)>,
    pub(crate) t: u64,
    pub(crate) steps: usize,
    /// The compressor's state (every rank's error feedback), as a checkpoint holds it.
    pub(crate) compression: Vec<(String, Vec<Real>)>,
}

fn values(named: Vec<(String, candle_core::Tensor)>) -> Vec<(String, Vec<Real>)> {
    named.into_iter().map(|(n, t)| (n, t.flatten_all().and_then(|t| t.to_vec1::<Real>()).expect("values"))).collect()
}

pub(crate) fn dataset(which: Which) -> Arc<dyn Dataset> {
    let opts = match which {
        Which::Mlp => Options { split: Split::Train, ..Options::default() },
        Which::Gpt => Options { split: Split::Train, context: Some(16), stride: Some(7), ..Options::default() },
    };
    let name = match which {
        Which::Mlp => "digits",
        Which::Gpt => "cicero",
    };
    Arc::from(shoal_data::builtin(name, &opts).expect("built-in dataset"))
}

/// Trains on one rank; returns every parameter (name, values) and the losses.
fn train_rank(
    run: &Run,
    comm: Option<Communicator>,
    world: usize,
    rank: usize,
) -> (Vec<(String, Vec<Real>)>, Vec<Real>) {
    let (saved, losses) = train_rank_from(run, comm, world, rank, None);
    (saved.params, losses)
}

/// Trains on one rank, from scratch or on from what a run left (`from`, at the same world size: its parameters put
/// into the model before the trainer starts, its optimizer state loaded after, its steps' batches skipped, as the
/// worker resumes); returns what this run leaves and its losses.
pub(crate) fn train_rank_from(
    run: &Run,
    comm: Option<Communicator>,
    world: usize,
    rank: usize,
    from: Option<&Saved>,
) -> (Saved, Vec<Real>) {
    let data = dataset(run.which);
    let mut params = Params::default();
    if run.resident {
        params.set_resident(candle_core::Device::Cpu);
    }
    // Each rank seeds differently: the broadcast from rank 0 must make them equal.
    let mut rng = SeededRng::new(7 + rank as u64);
    let model: Box<dyn Model> = match run.which {
        Which::Mlp => Box::new(Mlp::new(&mut params, &mut rng, 64, &[32, 16], 10).expect("mlp")),
        Which::Gpt => Box::new(
            Gpt::new(&mut params, &mut rng, GptConfig { vocab: 256, context: 16, layers: 2, heads: 2, width: 32 })
                .expect("gpt"),
        ),
    };
    if let Some(from) = from {
        let by_name: std::collections::HashMap<_, _> = from.params.iter().cloned().collect();
        for (name, var) in params.vars() {
            let t = candle_core::Tensor::from_slice(&by_name[name], var.shape(), &candle_core::Device::Cpu);
            var.set(&t.expect("tensor")).expect("set");
        }
    }
    let cfg = TrainerConfig {
        optimizer: run.optimizer,
        bucket_bytes: 4096,
        clip_grad_norm: run.clip.then_some(1.0),
        overlap: run.overlap,
        ..TrainerConfig::default()
    };
    let strategy: Box<dyn shoal_train::strategy::Strategy> = match (run.zero, run.compress) {
        (0, None) if run.ps.is_some() => {
            let (addresses, mode) = run.ps.clone().expect("servers");
            let cfg = shoal_train::strategy::ps::PsConfig {
                addresses,
                mode,
                secret: crate::ps::SECRET.to_vec(),
                timeout: Duration::from_secs(60),
            };
            Box::new(shoal_train::strategy::ps::Ps::new(comm, &params, cfg).expect("parameter-server strategy"))
        }
        (0, None) => {
            let summing = comm.clone().filter(|_| run.device_reduce).map(DeviceSum);
            let ddp = shoal_train::strategy::ddp::Ddp::new(comm, cfg.ddp());
            let ddp = match summing {
                Some(s) => ddp.with_device_reduce(Box::new(s)),
                None => ddp,
            };
            let ddp = match run.robust {
                Some((rule, f)) => ddp.with_robust(rule, f),
                None => ddp,
            };
            Box::new(match run.attack {
                Some((attack, liar)) => ddp.attacked_by(attack, vec![liar]),
                None => ddp,
            })
        }
        (0, Some(c)) => Box::new(
            shoal_train::strategy::ddp::Ddp::new(comm, cfg.ddp()).with_compression(c).sending_moment(run.momentum),
        ),
        (stage, c) => {
            let zero = match stage {
                3 => shoal_train::strategy::zero::Zero3::new(comm, run.overlap),
                _ => shoal_train::strategy::zero::Zero::new(comm, stage, cfg.bucket_bytes),
            };
            Box::new(match c {
                Some(c) => zero.with_compression(c),
                None => zero,
            })
        }
    };
    let mut trainer = Trainer::with_strategy(params, strategy, cfg).expect("trainer");
    let micro = run.global_batch / run.grad_accum;
    let mut sampler = DistributedSampler::new(SamplerConfig::new(data.len(), micro), world, rank).expect("sampler");
    let done = from.map_or(0, |f| f.steps);
    if let Some(from) = from {
        // `<param>.m`, `<param>.v`: shaped as their parameter.
        let shapes: std::collections::HashMap<_, _> =
            trainer.params().vars().iter().map(|(n, v)| (n.clone(), v.shape().clone())).collect();
        let named = from
            .optimizer
            .iter()
            .map(|(n, v)| {
                let shape = n.rsplit_once('.').and_then(|(p, _)| shapes.get(p)).expect("its parameter");
                (n.clone(), candle_core::Tensor::from_slice(v, shape, &candle_core::Device::Cpu).expect("tensor"))
            })
            .collect();
        trainer.load_optimizer_state(from.t, &named).expect("optimizer state");
        let compression = from
            .compression
            .iter()
            .map(|(n, v)| {
                (n.clone(), candle_core::Tensor::from_slice(v, v.len(), &candle_core::Device::Cpu).expect("t"))
            })
            .collect();
        trainer.load_compression_state(&compression).expect("compression state");
        for _ in 0..done * run.grad_accum {
            sampler.next_batch_cycling();
        }
    }
    let mut losses = Vec::new();
    for _ in 0..run.steps {
        let mut step_loss: Real = 0.0;
        for k in 0..run.grad_accum {
            let rb = sampler.next_batch_cycling();
            let samples: Vec<_> = rb.indices.iter().map(|&i| data.get(i).expect("sample")).collect();
            let weight = rb.indices.len() as f64 / (rb.global_size * run.grad_accum) as f64;
            if let (true, Some(hand), Some(flat)) = (run.hand, model.hand_backward(), to_flat(&samples).expect("flat"))
            {
                trainer
                    .backward_with(k + 1 == run.grad_accum, |sink| {
                        step_loss += hand.loss_and_grads(&flat, weight as Real, sink)?;
                        Ok(())
                    })
                    .expect("hand backward");
                continue;
            }
            let loss = match to_tensors(&samples).expect("tensors") {
                Some(t) => {
                    let logits = model.forward(&t.input).expect("forward");
                    let l = candle_nn::loss::cross_entropy(&logits, &t.target).expect("loss");
                    Some((l * weight).expect("scale"))
                }
                None => None,
            };
            if let Some(l) = &loss {
                step_loss += l.to_scalar::<Real>().expect("scalar");
            }
            trainer.backward(loss.as_ref(), k + 1 == run.grad_accum).expect("backward");
        }
        trainer.step(1e-2).expect("step");
        losses.push(step_loss);
    }
    // Whole tensors under every strategy (ZeRO-3 gathers them from the shards; collectives, in this order on every
    // rank).
    let params = values(trainer.model_state().expect("model state"));
    let optimizer = values(trainer.optimizer_state().expect("optimizer state"));
    let compression = values(trainer.compression_state().expect("compression state"));
    trainer.finish().expect("finish");
    (Saved { params, optimizer, t: trainer.optimizer().t, steps: done + run.steps, compression }, losses)
}

fn train_world(run: Run, world: usize) -> Vec<(String, Vec<Real>)> {
    train_world_from(run, world, None).params
}

/// [`train_rank_from`] on `world` ranks (threads of this process); what rank 0 leaves, checked equal on every rank.
pub(crate) fn train_world_from(run: Run, world: usize, from: Option<Saved>) -> Saved {
    train_world_with_losses(run, world, from).0
}

/// [`train_world_from`], with rank 0's losses (its share of each step's).
pub(crate) fn train_world_with_losses(run: Run, world: usize, from: Option<Saved>) -> (Saved, Vec<Real>) {
    if world == 1 {
        return train_rank_from(&run, None, 1, 0, from.as_ref());
    }
    let cfg =
        CommConfig { transport: TransportChoice::InProc, timeout: Duration::from_secs(120), ..CommConfig::default() };
    let comms = Communicator::local_world(world, cfg).expect("world");
    let (run, from) = (Arc::new(run), Arc::new(from));
    let hs: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let (run, from) = (run.clone(), from.clone());
            std::thread::spawn(move || train_rank_from(&run, Some(c), world, r, from.as_ref().as_ref()))
        })
        .collect();
    let (outs, losses): (Vec<_>, Vec<_>) = hs.into_iter().map(|h| h.join().expect("rank")).unzip();
    for o in &outs[1..] {
        assert_eq!(o.params, outs[0].params, "the ranks must hold identical parameters");
        assert_eq!(o.optimizer, outs[0].optimizer, "the ranks must save identical optimizer state");
        assert_eq!(o.compression, outs[0].compression, "the ranks must save identical compression state");
    }
    (outs.into_iter().next().expect("rank 0"), losses.into_iter().next().expect("rank 0"))
}

pub(crate) fn assert_close(a: &[(String, Vec<Real>)], b: &[(String, Vec<Real>)], what: &str) {
    assert_close_within(a, b, 1e-5, what);
}

/// Every tensor within `tol` relative (max |a-b| / max |a|).
pub(crate) fn assert_close_within(a: &[(String, Vec<Real>)], b: &[(String, Vec<Real>)], tol: Real, what: &str) {
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let max_a = va.iter().fold(0.0 as Real, |m, x| m.max(x.abs()));
        let max_d = va.iter().zip(vb).fold(0.0 as Real, |m, (x, y)| m.max((x - y).abs()));
        let rel = max_d / max_a.max(Real::MIN_POSITIVE);
        assert!(rel <= tol, "{what}: parameter {na} differs by {rel:e} relative");
    }
}

pub(crate) const ADAMW: OptimConfig = OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
pub(crate) const SGD: OptimConfig = OptimConfig::Sgd { momentum: 0.9, weight_decay: 0.0 };

/// The MLP with SGD (48 samples a step), or with AdamW and 2 micro-batches a step (60 samples).
pub(crate) fn mlp(hand: bool, overlap: bool, adamw_accum: bool) -> Run {
    let (global_batch, grad_accum, optimizer) = if adamw_accum { (60, 2, ADAMW) } else { (48, 1, SGD) };
    Run { optimizer, hand, overlap, ..Run::mlp(50, global_batch, grad_accum) }
}

/// Every way of computing and reducing gradients: autograd or the hand-written
/// backward, buckets reduced during backward or after it.
const PATHS: [(bool, bool); 4] = [(false, true), (false, false), (true, true), (true, false)];

#[test]
fn mlp_ddp_matches_one_worker_at_2_and_3_workers() {
    for (hand, overlap) in PATHS {
        let one = train_world(mlp(hand, overlap, false), 1);
        for n in [2, 3] {
            let what = format!("mlp (hand {hand}, overlap {overlap}), {n} workers");
            assert_close(&one, &train_world(mlp(hand, overlap, false), n), &what);
        }
    }
}

#[test]
fn mlp_ddp_with_gradient_accumulation_and_adamw_matches_at_4_workers() {
    for (hand, overlap) in PATHS {
        let what = format!("mlp (hand {hand}, overlap {overlap}), 4 workers, grad_accum 2");
        assert_close(&train_world(mlp(hand, overlap, true), 1), &train_world(mlp(hand, overlap, true), 4), &what);
    }
}

#[test]
fn hand_backward_and_autograd_train_the_same_mlp() {
    // Different rounding, same maths.
    let hand = train_world(mlp(true, true, false), 1);
    let auto = train_world(mlp(false, true, false), 1);
    for ((name, a), (_, h)) in auto.iter().zip(&hand) {
        let scale = a.iter().fold(0.0 as Real, |m, x| m.max(x.abs()));
        let diff = a.iter().zip(h).fold(0.0 as Real, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff / scale < 1e-4, "{name}: hand backward and autograd differ by {:e} relative", diff / scale);
    }
}

#[test]
fn gpt_ddp_matches_one_worker_at_2_and_4_workers() {
    // SGD: with AdamW, rounding differences in near-zero gradients of rarely seen
    // token embeddings are amplified by the m/sqrt(v) normalisation (seen: 2.5e-4
    // relative on gpt.tok_emb after 50 steps), so equality within 1e-5 is a
    // property of the reduction, checked here with the optimizer that does not
    // amplify it; the MLP test covers AdamW.
    let run = || Run { which: Which::Gpt, optimizer: SGD, ..Run::mlp(50, 12, 1) };
    let one = train_world(run(), 1);
    for n in [2, 4] {
        assert_close(&one, &train_world(run(), n), &format!("gpt, {n} workers"));
    }
}

/// Parameters held where the model computes (a GPU's path, taken on the CPU): with AdamW, two micro-batches a step
/// and clipping, one worker (gradients summed where they are, the update by tensor operations) and 2 and 3
/// workers — gradients staged to the host a bucket at a time (4 KiB here) and reduced, or summed bucket by bucket
/// through the device all-reduce seam — end where one worker on the host loops does; and the GPT through autograd
/// likewise.
#[test]
fn ddp_with_parameters_held_where_the_model_computes_matches_the_host_path() {
    let host = train_world(mlp(false, true, true), 1);
    for n in [1, 2, 3] {
        for device_reduce in [false, true] {
            let held = train_world(Run { resident: true, device_reduce, ..mlp(false, true, true) }, n);
            let what = format!("mlp held where it computes (device all-reduce: {device_reduce}), AdamW, {n} workers");
            assert_close(&host, &held, &what);
        }
    }
    let gpt = |resident, device_reduce| Run {
        which: Which::Gpt,
        optimizer: SGD,
        resident,
        device_reduce,
        ..Run::mlp(30, 12, 1)
    };
    let one = train_world(gpt(false, false), 1);
    for (n, device_reduce) in [(1, false), (2, false), (2, true)] {
        let what = format!("gpt held where it computes (device all-reduce: {device_reduce}), {n} workers");
        assert_close(&one, &train_world(gpt(true, device_reduce), n), &what);
    }
}

#[test]
fn loss_falls_on_real_data() {
    let (_, losses) = train_rank(&Run::mlp(60, 64, 1), None, 1, 0);
    let first: Real = losses[..5].iter().sum::<Real>() / 5.0;
    let last: Real = losses[losses.len() - 5..].iter().sum::<Real>() / 5.0;
    assert!(last < first * 0.5, "loss should fall: first {first}, last {last}");
}

/// ZeRO stages 1 and 2 (optimizer state sharded, gradients reduce-scattered — stage 2 bucket by bucket during
/// backward, 4 KiB buckets here — shards all-gathered) end where one worker does, with AdamW and gradient accumulation, through autograd and the hand-written backward, at world sizes that
/// do and do not divide the parameter count; and so with momentum SGD.
#[test]
fn mlp_zero1_and_zero2_match_one_worker_with_adamw_and_sgd() {
    for (hand, _) in PATHS {
        let one = train_world(mlp(hand, true, true), 1);
        for n in [2, 3, 4] {
            for stage in [1, 2] {
                let zero = train_world(Run { zero: stage, ..mlp(hand, true, true) }, n);
                let what = format!("mlp zero{stage} (hand {hand}), AdamW, {n} workers, grad_accum 2");
                assert_close(&one, &zero, &what);
            }
        }
    }
    let one = train_world(mlp(false, true, false), 1);
    assert_close(&one, &train_world(Run { zero: 1, ..mlp(false, true, false) }, 3), "mlp zero1, SGD, 3 workers");
    assert_close(&one, &train_world(Run { zero: 2, ..mlp(false, true, false) }, 3), "mlp zero2, SGD, 3 workers");
}

/// A ZeRO rank holds a 1/N shard of the optimizer state (and with stage 2 a bucket and a shard of the gradients),
/// and what it saves is the whole state, the same on every rank.
#[test]
fn zero_shards_the_optimizer_state_and_the_gradients_and_saves_the_state_whole() {
    for stage in [1u8, 2] {
        zero_shards(stage);
    }
}

fn zero_shards(stage: u8) {
    let world = 4;
    let cfg =
        CommConfig { transport: TransportChoice::InProc, timeout: Duration::from_secs(120), ..CommConfig::default() };
    let comms = Communicator::local_world(world, cfg).expect("world");
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let mut params = Params::default();
                let mut rng = SeededRng::new(7);
                // Layers of similar size (the largest, 64x16, is 40% of the model), so a bucket is a part of it.
                let model = Mlp::new(&mut params, &mut rng, 64, &[16; 6], 10).expect("mlp");
                let count = params.count();
                let tcfg = TrainerConfig { optimizer: ADAMW, bucket_bytes: 4096, ..TrainerConfig::default() };
                let zero = shoal_train::strategy::zero::Zero::new(Some(c), stage, tcfg.bucket_bytes);
                let mut trainer = Trainer::with_strategy(params, Box::new(zero), tcfg).expect("trainer");
                let data = dataset(Which::Mlp);
                let samples: Vec<_> = (0..8).map(|i| data.get(i).expect("sample")).collect();
                let t = to_tensors(&samples).expect("tensors").expect("batch");
                for _ in 0..3 {
                    let logits = model.forward(&t.input).expect("forward");
                    let l = (candle_nn::loss::cross_entropy(&logits, &t.target).expect("loss") * 0.25).expect("w");
                    trainer.backward(Some(&l), true).expect("backward");
                    trainer.step(1e-2).expect("step");
                }
                let state = trainer.optimizer_state().expect("gathered state");
                let held = (trainer.optimizer_bytes(), trainer.gradient_bytes());
                (
                    count,
                    held,
                    state
                        .into_iter()
                        .map(|(n, t)| (n, t.flatten_all().and_then(|t| t.to_vec1::<Real>()).expect("v")))
                        .collect::<Vec<_>>(),
                )
            })
        })
        .collect();
    let outs: Vec<_> = hs.into_iter().map(|h| h.join().expect("rank")).collect();
    let (count, _, state) = &outs[0];
    for (_, (opt, grads), _) in &outs {
        // m and v of a quarter of the parameters, in Real, plus at most one padding value per bucket.
        let quarter = 2 * count.div_ceil(world) * 4;
        if stage == 1 {
            assert_eq!(*opt, quarter, "stage 1: each rank holds its shard of the state only");
            // The whole gradient (padded to the world size), the reduce-scatter's slice, and a parameter's gradient
            // as the model writes it (a buffer grown to the largest, the 64x16 first layer).
            let whole = count.div_ceil(world) * world + count.div_ceil(world);
            let (lo, hi) = ((whole + 1024) * 4, (whole + 2 * 1024) * 4);
            assert!((lo..=hi).contains(grads), "stage 1: the whole gradient: {grads} bytes, not in {lo}..={hi}");
        } else {
            assert!(*opt >= quarter && *opt <= quarter + 2 * 4 * 8, "stage 2: {opt} bytes of state, {quarter} wanted");
            // One bucket (about 4 KiB), its reduced slice and a shard: less than the whole gradient, and at most a
            // bucket's worth (the largest, the 64x16 first layer with its bias) more than a quarter of it.
            let bound = (count.div_ceil(world) + 2 * (1024 + 16) + 32 * world) * 4;
            assert!(*grads < count * 4 && *grads <= bound, "stage 2: a bucket and a shard of gradients: {grads}");
        }
    }
    let saved: usize = state.iter().map(|(_, v)| v.len()).sum();
    assert_eq!(saved, 2 * count, "the whole AdamW state (m and v of every parameter) is saved");
    for (_, _, s) in &outs[1..] {
        assert_eq!(s, state, "every rank gathers the same whole state");
    }
    assert!(state.iter().any(|(n, _)| n.ends_with(".m")) && state.iter().any(|(n, _)| n.ends_with(".v")));
}

/// In f64 (`train.dtype = "f64"`, a build with the `f64` feature) the MLP's data-parallel and ZeRO runs end within
/// 1e-9 of one worker with AdamW and gradient accumulation, through autograd and the hand-written backward, and the
/// GPT's DDP with AdamW too (the comparison f32 can only make with SGD, above): what f32 leaves at 1e-5 is rounding.
#[cfg(feature = "f64")]
#[test]
fn in_f64_data_parallel_and_zero_match_one_worker_within_1e_9() {
    for (hand, _) in PATHS {
        let one = train_world(mlp(hand, true, true), 1);
        for (n, stage) in [(2, 0), (3, 0), (3, 1), (4, 2), (3, 3)] {
            let got = train_world(Run { zero: stage, ..mlp(hand, true, true) }, n);
            assert_close_within(&one, &got, 1e-9, &format!("f64 mlp zero{stage} (hand {hand}), {n} workers"));
        }
    }
    let gpt = || Run { which: Which::Gpt, ..Run::mlp(20, 12, 1) };
    let one = train_world(gpt(), 1);
    for n in [2, 4] {
        assert_close_within(&one, &train_world(gpt(), n), 1e-9, &format!("f64 gpt ddp, AdamW, {n} workers"));
    }
}
