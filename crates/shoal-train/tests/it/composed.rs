//! Composed layouts (data × tensor × pipeline, with ZeRO-1 over the data groups): the GPT trains as one process on
//! the same global batch under each composition, its checkpoints resume under other layouts and strategies, and each
//! rank holds its share.

use shoal_train::Real;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use shoal_comm::{CommConfig, Communicator, TransportChoice};
use shoal_data::{Dataset, DistributedSampler, Options, SamplerConfig, Split};
use shoal_train::batch::to_tensors;
use shoal_train::spec::PipelineSchedule;
use shoal_train::strategy::Strategy;
use shoal_train::strategy::composed::{Composed, LayoutConfig};
use shoal_train::strategy::ddp::Ddp;
use shoal_train::strategy::zero::Zero3;
use shoal_train::tensor_parallel::Shard;
use shoal_train::{Gpt, GptConfig, Model, Params, SeededRng, Trainer, TrainerConfig};

use super::equivalence::{ADAMW, Saved, assert_close_within};
use super::zero3::without_key_biases;

const GPT: GptConfig = GptConfig { vocab: 256, context: 16, layers: 4, heads: 4, width: 64 };
/// The global batch of the equivalence runs (divisible by the data-parallel degrees 2 and 4, and each share by 2
/// micro-batches). The tensor-parallel test's batch: at 12, 24 or 48 samples tensor parallelism alone (the
/// `"tensor"` strategy as much as a layout of tensor 2) ends 20 AdamW steps 2e-4 to 3e-4 relative from one process on
/// one projection weight, its split matmuls rounding differently; at 8 (and 36) within 1e-4.
const GLOBAL: usize = 8;
/// The global batch of the resumed runs: divisible by 2, 3 and 4 as well.
const GLOBAL_RESUMED: usize = 12;
const LR: f64 = 3e-3;

#[derive(Clone, Copy, Debug, PartialEq)]
enum How {
    /// One process (DDP of one rank).
    One,
    /// ZeRO-3 over every rank.
    Zero3,
    Layout(LayoutConfig),
}

fn layout(data: usize, tensor: usize, pipeline: usize, zero: u8) -> How {
    How::Layout(LayoutConfig {
        data,
        tensor,
        pipeline,
        micro_batches: 2,
        schedule: PipelineSchedule::OneFOneB,
        virtual_stages: 1,
        zero,
    })
}

fn dataset() -> Arc<dyn Dataset> {
    let opts = Options { split: Split::Train, context: Some(16), stride: Some(7), ..Options::default() };
    Arc::from(shoal_data::builtin("cicero", &opts).expect("built-in dataset"))
}

/// What one rank leaves: the whole state, the global loss of every step, the bytes it held.
struct Out {
    saved: Saved,
    losses: Vec<Real>,
    param_bytes: usize,
    optimizer_bytes: usize,
    whole_bytes: usize,
}

fn values(named: Vec<(String, candle_core::Tensor)>) -> Vec<(String, Vec<Real>)> {
    named.into_iter().map(|(n, t)| (n, t.flatten_all().and_then(|t| t.to_vec1()).expect("values"))).collect()
}

/// The whole shapes of the GPT's parameters, by name.
fn whole_dims() -> HashMap<String, Vec<usize>> {
    let mut p = Params::default();
    drop(Gpt::new(&mut p, &mut SeededRng::new(0), GPT).expect("gpt"));
    p.vars().iter().map(|(n, v)| (n.clone(), v.dims().to_vec())).collect()
}

/// `steps` steps of the GPT under `how` as one rank of `comm`'s world, from scratch or on from `from` (its whole
/// tensors put into the model, cut to this rank's parts, as the worker resumes).
fn train_rank(how: How, global: usize, steps: usize, comm: Option<Communicator>, from: Option<&Saved>) -> Out {
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
    let tensor = match how {
        How::Layout(c) => c.tensor,
        _ => 1,
    };
    let mut params =
        if tensor > 1 { Params::tensor_parallel(Shard::new(rank % tensor, tensor)) } else { Params::default() };
    let model = Gpt::new(&mut params, &mut SeededRng::new(5), GPT).expect("gpt");
    if let Some(from) = from {
        let by_name: HashMap<_, _> = from.params.iter().cloned().collect();
        for (i, (name, _)) in params.vars().iter().enumerate() {
            params.set_whole(i, &by_name[name]).expect("set");
        }
    }
    let whole_bytes = params.full_count() * shoal_train::REAL_BYTES;
    let cfg = TrainerConfig { optimizer: ADAMW, clip_grad_norm: Some(1.0), ..TrainerConfig::default() };
    let strategy: Box<dyn Strategy> = match how {
        How::One => Box::new(Ddp::new(comm, cfg.ddp())),
        How::Zero3 => Box::new(Zero3::new(comm, true)),
        How::Layout(c) => Box::new(Composed::new(comm, c)),
    };
    let mut trainer = Trainer::with_strategy(params, strategy, cfg).expect("trainer");
    if let Some(from) = from {
        let dims = whole_dims();
        let named = from
            .optimizer
            .iter()
            .map(|(n, v)| {
                let (p, _) = n.rsplit_once('.').expect("a moment's name");
                (
                    n.clone(),
                    candle_core::Tensor::from_slice(v, dims[p].as_slice(), &candle_core::Device::Cpu).expect("t"),
                )
            })
            .collect();
        trainer.load_optimizer_state(from.t, &named).expect("optimizer state");
    }
    // The ranks of a replica (its tensor groups and stages) take the same share of every batch.
    let (replicas, replica) = match how {
        How::One => (1, 0),
        How::Zero3 => (world, rank),
        How::Layout(c) => (c.data, (rank / c.tensor) % c.data),
    };
    let data = dataset();
    let mut sampler =
        DistributedSampler::new(SamplerConfig::new(data.len(), global), replicas, replica).expect("sampler");
    let done = from.map_or(0, |f| f.steps);
    for _ in 0..done {
        sampler.next_batch_cycling();
    }
    let mut losses = Vec::new();
    for _ in 0..steps {
        let rb = sampler.next_batch_cycling();
        let samples: Vec<_> = rb.indices.iter().map(|&i| data.get(i).expect("sample")).collect();
        let n = samples.len();
        let weight = n as f64 / rb.global_size as f64;
        let parts: Vec<_> = [0..n / 2, n / 2..n]
            .iter()
            .map(|r| {
                let s = to_tensors(&samples[r.clone()]).expect("tensors").expect("a micro-batch");
                (s.input, s.target, weight * r.len() as f64 / n as f64)
            })
            .collect();
        let mut local: Real = 0.0;
        if trainer.splits_model() {
            trainer
                .run_micro_batches(
                    2,
                    |i| Ok(model.forward(&parts[i].0)?),
                    |i, logits| {
                        let l = (model.loss(logits, &parts[i].1)? * parts[i].2)?;
                        local += l.to_scalar::<Real>()?;
                        Ok(l)
                    },
                )
                .expect("micro-batches");
            trainer.attach_scalars(&[local]);
        } else {
            for (i, (x, y, w)) in parts.iter().enumerate() {
                let l = (model.loss(&model.forward(x).expect("forward"), y).expect("loss") * *w).expect("weight");
                local += l.to_scalar::<Real>().expect("scalar");
                if i == 1 {
                    trainer.attach_scalars(&[local]);
                }
                trainer.backward(Some(&l), i == 1).expect("backward");
            }
        }
        let st = trainer.step(LR).expect("step");
        losses.push(st.scalars[0]);
    }
    let param_bytes = trainer.param_bytes();
    let optimizer_bytes = trainer.optimizer_bytes();
    let params = values(trainer.model_state().expect("model state"));
    let optimizer = values(trainer.optimizer_state().expect("optimizer state"));
    Out {
        saved: Saved { params, optimizer, t: trainer.optimizer().t, steps: done + steps, compression: Vec::new() },
        losses,
        param_bytes,
        optimizer_bytes,
        whole_bytes,
    }
}

/// [`train_rank`] on `world` ranks (threads); every rank's outcome, which agree on the state and the losses.
fn train(how: How, global: usize, steps: usize, world: usize, from: Option<Saved>) -> Vec<Out> {
    if world == 1 && how == How::One {
        return vec![train_rank(how, global, steps, None, from.as_ref())];
    }
    let cfg =
        CommConfig { transport: TransportChoice::InProc, timeout: Duration::from_secs(120), ..CommConfig::default() };
    let from = Arc::new(from);
    let hs: Vec<_> = Communicator::local_world(world, cfg)
        .expect("world")
        .into_iter()
        .map(|c| {
            let from = from.clone();
            std::thread::spawn(move || train_rank(how, global, steps, Some(c), from.as_ref().as_ref()))
        })
        .collect();
    let outs: Vec<Out> = hs.into_iter().map(|h| h.join().expect("rank")).collect();
    for o in &outs[1..] {
        assert_eq!(o.saved.params, outs[0].saved.params, "{how:?}: every rank gathers the same parameters");
        assert_eq!(o.saved.optimizer, outs[0].saved.optimizer, "{how:?}: every rank gathers the same moments");
        assert_eq!(o.losses, outs[0].losses, "{how:?}: every rank reports the same losses");
    }
    outs
}

/// Losses within `tol` relative, step by step.
fn assert_losses(a: &[Real], b: &[Real], tol: Real, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * x.abs().max(1.0), "{what}: step {s} loss {y}, one process {x}");
    }
}

/// Each layout against one process: every step's loss within 1e-5 and every parameter and optimizer moment within
/// 1e-4 relative after 20 steps of AdamW with clipping. The key third of the `qkv` biases is left out of the
/// parameters' comparison (`without_key_biases`: its true gradient is zero, what a step computes for it rounding
/// noise that AdamW scales to whole steps), and its moments likewise.
fn assert_matches_one_process(layouts: &[(How, usize)]) {
    let one = train(How::One, GLOBAL, 20, 1, None).remove(0);
    assert!(one.losses[19] < one.losses[0] - 0.5, "the GPT learns: {:?}", one.losses);
    let moments = |o: &Out| -> Vec<(String, Vec<Real>)> {
        o.saved.optimizer.iter().filter(|(n, _)| !n.contains("attn.qkv.bias")).cloned().collect()
    };
    for &(how, world) in layouts {
        let got = train(how, GLOBAL, 20, world, None).remove(0);
        let what = format!("{how:?} on {world} ranks");
        assert_losses(&one.losses, &got.losses, 1e-5, &what);
        assert_close_within(
            &without_key_biases(one.saved.params.clone()),
            &without_key_biases(got.saved.params.clone()),
            1e-4,
            &what,
        );
        assert_eq!(got.saved.optimizer.len(), one.saved.optimizer.len(), "{what}: every moment, whole");
        assert_close_within(&moments(&one), &moments(&got), 1e-3, &format!("{what}, moments"));
        assert_eq!(got.saved.t, 20, "{what}");
    }
}

#[test]
fn data_times_pipeline_matches_one_process_with_and_without_zero1() {
    assert_matches_one_process(&[(layout(2, 1, 2, 0), 4), (layout(2, 1, 2, 1), 4)]);
}

#[test]
fn data_times_tensor_matches_one_process_with_and_without_zero1() {
    assert_matches_one_process(&[(layout(2, 2, 1, 0), 4), (layout(2, 2, 1, 1), 4)]);
}

#[test]
fn tensor_times_pipeline_matches_one_process() {
    assert_matches_one_process(&[(layout(1, 2, 2, 0), 4)]);
}

/// The pipeline under the interleaved schedule (2 chunks of layers a rank) inside composed layouts: data 2 ×
/// pipeline 2 with ZeRO-1, and tensor 2 × pipeline 2.
#[test]
fn interleaved_pipelines_inside_layouts_match_one_process() {
    let interleaved = |how: How| match how {
        How::Layout(l) => How::Layout(LayoutConfig { schedule: PipelineSchedule::Interleaved, virtual_stages: 2, ..l }),
        other => other,
    };
    assert_matches_one_process(&[(interleaved(layout(2, 1, 2, 1)), 4), (interleaved(layout(1, 2, 2, 0)), 4)]);
}

#[test]
fn data_times_tensor_times_pipeline_matches_one_process_at_8_ranks() {
    assert_matches_one_process(&[(layout(2, 2, 2, 0), 8), (layout(2, 2, 2, 1), 8)]);
}

/// Each rank of data 2 × pipeline 2 holds its stage (about half the model), ZeRO-1 halves its optimizer state, and
/// tensor 2 × pipeline 2 leaves each rank about a quarter.
#[test]
fn each_rank_holds_its_share() {
    let plain = train(layout(2, 1, 2, 0), GLOBAL, 2, 4, None);
    let zero = train(layout(2, 1, 2, 1), GLOBAL, 2, 4, None);
    let tp = train(layout(1, 2, 2, 0), GLOBAL, 2, 4, None);
    for (o, z, t) in plain.iter().zip(&zero).zip(&tp).map(|((a, b), c)| (a, b, c)) {
        let share = o.param_bytes as f64 / o.whole_bytes as f64;
        assert!((0.35..0.65).contains(&share), "a stage holds {share:.3} of the model");
        // AdamW: two moments per parameter held; ZeRO-1 keeps half of them (a shard, padded).
        assert_eq!(o.optimizer_bytes, 2 * o.param_bytes, "the moments of the stage's parameters");
        let half = z.optimizer_bytes as f64 / o.optimizer_bytes as f64;
        assert!((0.5..0.51).contains(&half), "ZeRO-1 over 2 replicas keeps {half:.3} of the moments");
        let quarter = t.param_bytes as f64 / t.whole_bytes as f64;
        assert!((0.2..0.32).contains(&quarter), "tensor 2 × pipeline 2: a rank holds {quarter:.3}");
    }
}

/// A checkpoint saved under data 2 × pipeline 2 after 10 steps resumes under ZeRO-3 on 3 ranks and under
/// data 2 × tensor 2 with ZeRO-1, and both continue the uninterrupted run's curve: every loss within 1e-5, and the
/// parameters after 10 more steps within 1e-4 (but the key biases, as above).
#[test]
fn a_checkpoint_resumes_under_other_layouts_and_strategies() {
    let whole = train(How::One, GLOBAL_RESUMED, 20, 1, None).remove(0);
    let first = train(layout(2, 1, 2, 0), GLOBAL_RESUMED, 10, 4, None).remove(0);
    assert_losses(&whole.losses[..10], &first.losses, 1e-5, "the first half under data 2 × pipeline 2");
    for (how, world) in [(How::Zero3, 3), (layout(2, 2, 1, 1), 4), (layout(1, 2, 2, 0), 4)] {
        let rest = train(how, GLOBAL_RESUMED, 10, world, Some(first.saved.clone())).remove(0);
        let what = format!("resumed under {how:?} on {world} ranks");
        assert_losses(&whole.losses[10..], &rest.losses, 1e-5, &what);
        assert_close_within(
            &without_key_biases(whole.saved.params.clone()),
            &without_key_biases(rest.saved.params),
            1e-4,
            &what,
        );
        assert_eq!(rest.saved.t, 20, "{what}: the optimizer's step count carried over");
    }
}

/// Layouts the world or the strategy cannot run are refused, naming what does not fit.
#[test]
fn layouts_that_do_not_fit_are_refused() {
    let cfg =
        CommConfig { transport: TransportChoice::InProc, timeout: Duration::from_secs(20), ..CommConfig::default() };
    // Data 2 × pipeline 2 on 2 ranks.
    let hs: Vec<_> = Communicator::local_world(2, cfg)
        .expect("world")
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let mut params = Params::default();
                drop(Gpt::new(&mut params, &mut SeededRng::new(5), GPT).expect("gpt"));
                let How::Layout(l) = layout(2, 1, 2, 0) else { unreachable!() };
                let cfg = TrainerConfig { optimizer: ADAMW, ..TrainerConfig::default() };
                Trainer::with_strategy(params, Box::new(Composed::new(Some(c), l)), cfg)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    for h in hs {
        let e = h.join().expect("rank").expect_err("refused");
        assert!(e.contains("data 2 × tensor 1 × pipeline 2 = 4 ranks on a world of 2"), "{e}");
    }
    // A model built for tensor parallelism under a layout without it, on one rank.
    let mut params = Params::tensor_parallel(Shard::new(0, 2));
    drop(Gpt::new(&mut params, &mut SeededRng::new(5), GPT).expect("gpt"));
    let How::Layout(l) = layout(1, 1, 1, 0) else { unreachable!() };
    let e = Trainer::with_strategy(params, Box::new(Composed::new(None, l)), TrainerConfig::default())
        .map(|_| ())
        .expect_err("refused")
        .to_string();
    assert!(e.contains("parallel.tensor = 1"), "{e}");
}

/// In f64 (`train.dtype = "f64"`, a build with the `f64` feature) every composed layout — data × pipeline and
/// data × tensor with and without ZeRO-1, tensor × pipeline, interleaved pipelines inside them, and data × tensor ×
/// pipeline at 8 ranks — ends 20 AdamW steps within 1e-9 of one process in every tensor, the key biases and the
/// moments included, every loss within 1e-12; and a checkpoint of data 2 × pipeline 2 resumed under ZeRO-3 on 3
/// ranks continues the uninterrupted run within 1e-9.
#[cfg(feature = "f64")]
#[test]
fn in_f64_every_layout_matches_one_process_within_1e_9() {
    let interleaved = |how: How| match how {
        How::Layout(l) => How::Layout(LayoutConfig { schedule: PipelineSchedule::Interleaved, virtual_stages: 2, ..l }),
        other => other,
    };
    let one = train(How::One, GLOBAL, 20, 1, None).remove(0);
    for (how, world) in [
        (layout(2, 1, 2, 0), 4),
        (layout(2, 1, 2, 1), 4),
        (layout(2, 2, 1, 0), 4),
        (layout(2, 2, 1, 1), 4),
        (layout(1, 2, 2, 0), 4),
        (interleaved(layout(2, 1, 2, 1)), 4),
        (interleaved(layout(1, 2, 2, 0)), 4),
        (layout(2, 2, 2, 1), 8),
    ] {
        let got = train(how, GLOBAL, 20, world, None).remove(0);
        let what = format!("f64, {how:?} on {world} ranks");
        assert_losses(&one.losses, &got.losses, 1e-12, &what);
        assert_close_within(&one.saved.params, &got.saved.params, 1e-9, &what);
        assert_close_within(&one.saved.optimizer, &got.saved.optimizer, 1e-9, &format!("{what}, moments"));
    }
    let whole = train(How::One, GLOBAL_RESUMED, 20, 1, None).remove(0);
    let first = train(layout(2, 1, 2, 0), GLOBAL_RESUMED, 10, 4, None).remove(0);
    let rest = train(How::Zero3, GLOBAL_RESUMED, 10, 3, Some(first.saved)).remove(0);
    assert_losses(&whole.losses[10..], &rest.losses, 1e-12, "f64, resumed under ZeRO-3 on 3 ranks");
    assert_close_within(&whole.saved.params, &rest.saved.params, 1e-9, "f64, resumed under ZeRO-3 on 3 ranks");
}
