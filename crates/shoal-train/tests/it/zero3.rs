//! ZeRO stage 3 (parameters sharded too, gathered layer by layer): the same result as one worker with the same
//! global batch, through autograd and the hand-written backward, with and without prefetch; a rank with no data
//! keeps in step; checkpoints move between ZeRO-3 and DDP; models it cannot shard are refused with a reason.

use shoal_train::Real;
use std::time::Duration;

use candle_core::{Device, Tensor, Var};
use shoal_comm::{CommConfig, Communicator, TransportChoice};
use shoal_train::batch::{to_flat, to_tensors};
use shoal_train::strategy::zero::Zero3;
use shoal_train::{Gpt, GptConfig, Mlp, Model, Params, SeededRng, Trainer, TrainerConfig};

use super::equivalence::{ADAMW, Run, Which, assert_close, assert_close_within, dataset, mlp, train_world_from};

/// Every way of computing gradients (autograd, the hand-written backward) and of gathering layers (the next one
/// prefetched on the communicator's thread, or each when entered).
const PATHS: [(bool, bool); 4] = [(false, true), (false, false), (true, true), (true, false)];

fn world(n: usize) -> Vec<Communicator> {
    let cfg =
        CommConfig { transport: TransportChoice::InProc, timeout: Duration::from_secs(120), ..CommConfig::default() };
    Communicator::local_world(n, cfg).expect("world")
}

#[test]
fn mlp_zero3_matches_one_worker_with_adamw_and_gradient_accumulation() {
    for (hand, prefetch) in PATHS {
        let one = train_world_from(mlp(hand, prefetch, true), 1, None).params;
        for n in [1, 2, 3] {
            let zero3 = train_world_from(Run { zero: 3, ..mlp(hand, prefetch, true) }, n, None).params;
            let what = format!("mlp zero3 (hand {hand}, prefetch {prefetch}), AdamW, {n} workers, grad_accum 2");
            assert_close(&one, &zero3, &what);
        }
    }
}

fn gpt(zero: u8, steps: usize, grad_accum: usize, prefetch: bool) -> Run {
    Run { which: Which::Gpt, overlap: prefetch, zero, ..Run::mlp(steps, 12, grad_accum) }
}

/// The parameters without the key third of each attention's `qkv` bias. Its gradient is zero in exact arithmetic
/// (softmax over the keys ignores what adds the same to every key's score), so what a step computes for it is
/// rounding noise, which AdamW's `m / sqrt(v)` scales up to a full step: there one process and N ranks (DDP as much
/// as ZeRO) differ by about 1e-3 relative after 20 steps, and by at most 2e-5 everywhere else.
pub(crate) fn without_key_biases(params: Vec<(String, Vec<Real>)>) -> Vec<(String, Vec<Real>)> {
    params
        .into_iter()
        .map(|(n, v)| {
            if !n.ends_with("attn.qkv.bias") {
                return (n, v);
            }
            let w = v.len() / 3;
            (n, v[..w].iter().chain(&v[2 * w..]).copied().collect())
        })
        .collect()
}

/// The GPT through its layer-by-layer autograd (the graph cut at each layer, each back-propagated with only its own
/// parameters gathered) ends where one worker does with AdamW, but for the key biases ([`without_key_biases`]):
/// within 5e-5 relative after 20 steps, where DDP is within 2e-5 (the rounding of a sum over ranks, amplified by
/// AdamW); bit for bit where one DDP worker does on one rank, and where DDP does on 2 (the same sums); within 1e-5 of
/// DDP at 3 ranks (its reduce-scatter adds in another order than DDP's all-reduce).
#[test]
fn gpt_zero3_matches_one_worker_with_adamw_at_2_and_3_workers() {
    let one = train_world_from(gpt(0, 20, 1, true), 1, None).params;
    for (n, accum, prefetch) in [(1, 1, true), (2, 1, true), (3, 1, false), (3, 2, true)] {
        let zero3 = train_world_from(gpt(3, 20, accum, prefetch), n, None).params;
        let what = format!("gpt zero3, AdamW, {n} workers, grad_accum {accum}, prefetch {prefetch}");
        let ddp = train_world_from(gpt(0, 20, accum, prefetch), n, None).params;
        if n <= 2 {
            assert_eq!(ddp, zero3, "{what}: as DDP at {n} workers");
        }
        let (zero3, ddp) = (without_key_biases(zero3), without_key_biases(ddp));
        assert_close(&ddp, &zero3, &format!("{what}: as DDP"));
        assert_close_within(&without_key_biases(one.clone()), &zero3, 5e-5, &what);
    }
}

/// A checkpoint of a ZeRO-3 run (whole tensors gathered from the shards) is a DDP checkpoint and the other way round:
/// 20 steps under one, 20 more under the other, end where 40 steps of DDP do.
#[test]
fn zero3_resumes_a_ddp_checkpoint_and_ddp_resumes_a_zero3_one() {
    for hand in [false, true] {
        let run = |zero: u8, steps: usize| Run { zero, steps, ..mlp(hand, true, true) };
        let straight = train_world_from(run(0, 40), 2, None);
        let ddp20 = train_world_from(run(0, 20), 2, None);
        let zero20 = train_world_from(run(3, 20), 2, None);
        assert_close(&ddp20.params, &zero20.params, &format!("hand {hand}: 20 steps, zero3 against ddp"));
        assert_close(&ddp20.optimizer, &zero20.optimizer, &format!("hand {hand}: saved AdamW state"));
        assert_eq!(zero20.t, 20);
        let zero_from_ddp = train_world_from(run(3, 20), 2, Some(ddp20));
        let ddp_from_zero = train_world_from(run(0, 20), 2, Some(zero20));
        assert_eq!(zero_from_ddp.steps, 40);
        assert_close(&straight.params, &zero_from_ddp.params, &format!("hand {hand}: zero3 resumed from ddp"));
        assert_close(&straight.params, &ddp_from_zero.params, &format!("hand {hand}: ddp resumed from zero3"));
        assert_close(&straight.optimizer, &zero_from_ddp.optimizer, &format!("hand {hand}: zero3's state"));
    }
}

/// One step of 2 ranks where rank 1 has no data (its loss `None`: it only takes part in the layers' gathers and the
/// gradients' reduce-scatters): the parameters end as one worker's do on rank 0's batch alone.
#[test]
fn a_rank_with_no_data_keeps_in_step() {
    for which in [Which::Mlp, Which::Gpt] {
        for hand in [false, true] {
            if hand && matches!(which, Which::Gpt) {
                continue;
            }
            let alone = idle_step(which, hand, 1);
            let two = idle_step(which, hand, 2);
            assert_close(&alone, &two, &format!("{which:?} (hand {hand}): rank 1 with no data"));
        }
    }
}

fn build(which: Which, params: &mut Params) -> Box<dyn Model> {
    let mut rng = SeededRng::new(11);
    match which {
        Which::Mlp => Box::new(Mlp::new(params, &mut rng, 64, &[32, 16], 10).expect("mlp")),
        Which::Gpt => Box::new(
            Gpt::new(params, &mut rng, GptConfig { vocab: 256, context: 16, layers: 2, heads: 2, width: 32 })
                .expect("gpt"),
        ),
    }
}

/// Two steps on `n` ranks, only rank 0 with data (the same 6 samples each step); the parameters after.
fn idle_step(which: Which, hand: bool, n: usize) -> Vec<(String, Vec<Real>)> {
    let comms: Vec<Option<Communicator>> = if n == 1 { vec![None] } else { world(n).into_iter().map(Some).collect() };
    let hs: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            std::thread::spawn(move || {
                let mut params = Params::default();
                let model = build(which, &mut params);
                let cfg = TrainerConfig { optimizer: ADAMW, ..TrainerConfig::default() };
                let mut trainer =
                    Trainer::with_strategy(params, Box::new(Zero3::new(comm, true)), cfg).expect("trainer");
                let data = dataset(which);
                let samples: Vec<_> = (0..6).map(|i| data.get(i).expect("sample")).collect();
                for _ in 0..2 {
                    match (rank, hand) {
                        (0, true) => {
                            let flat = to_flat(&samples).expect("flat").expect("batch");
                            let hb = model.hand_backward().expect("hand backward");
                            trainer.backward_with(true, |sink| hb.loss_and_grads(&flat, 1.0, sink).map(|_| ()))
                        }
                        (0, false) => {
                            let t = to_tensors(&samples).expect("tensors").expect("batch");
                            let logits = model.forward(&t.input).expect("forward");
                            let l = candle_nn::loss::cross_entropy(&logits, &t.target).expect("loss");
                            trainer.backward(Some(&l), true)
                        }
                        _ => trainer.backward(None, true),
                    }
                    .expect("backward");
                    trainer.step(1e-2).expect("step");
                }
                trainer
                    .model_state()
                    .expect("state")
                    .into_iter()
                    .map(|(n, t)| (n, t.flatten_all().and_then(|t| t.to_vec1::<Real>()).expect("values")))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let outs: Vec<_> = hs.into_iter().map(|h| h.join().expect("rank")).collect();
    outs.into_iter().next().expect("rank 0")
}

/// What ZeRO-3 cannot shard is refused with the reason, never a panic or a hang: a model that declares no layers, a
/// parameter outside every layer, parameters a ZeRO-3 trainer already holds, a loss not computed through the layers.
#[test]
fn zero3_refuses_what_it_cannot_shard() {
    let cfg = || TrainerConfig { optimizer: ADAMW, ..TrainerConfig::default() };
    let err = |r: shoal_train::Result<Trainer>| r.err().map(|e| e.to_string()).unwrap_or_default();

    let w = Var::from_vec(vec![1.0 as Real, 2.0, 3.0], 3, &Device::Cpu).expect("var");
    let bare = Params::from_vars(vec![("w".into(), w)]);
    let e = err(Trainer::with_strategy(bare, Box::new(Zero3::new(None, true)), cfg()));
    assert!(e.contains("declares no layers"), "{e}");

    let mut early = Params::default();
    early.constant("stray", &[2], 1.0).expect("param");
    early.layer("l");
    early.constant("w", &[2], 1.0).expect("param");
    let e = err(Trainer::with_strategy(early, Box::new(Zero3::new(None, true)), cfg()));
    assert!(e.contains("come before the model's first layer"), "{e}");

    let mut params = Params::default();
    let model = build(Which::Mlp, &mut params);
    let mut trainer = Trainer::with_strategy(params.clone(), Box::new(Zero3::new(None, true)), cfg()).expect("trainer");
    for again in [Trainer::new(params.clone(), None, cfg()), {
        Trainer::with_strategy(params.clone(), Box::new(Zero3::new(None, true)), cfg())
    }] {
        let e = err(again);
        assert!(e.contains("already sharded by a ZeRO-3 trainer"), "{e}");
    }
    // A loss not computed through the model's layers.
    let w = trainer.params().vars()[0].1.as_tensor().clone();
    let stray = Tensor::zeros(w.dims(), candle_core::DType::F32, &Device::Cpu).expect("zeros");
    let e = trainer.backward(Some(&stray.sum_all().expect("sum")), true).err().map(|e| e.to_string());
    assert!(e.is_some_and(|e| e.contains("not computed through the model's layers")));
    // And the model still trains after the refusal.
    let data = dataset(Which::Mlp);
    let samples: Vec<_> = (0..4).map(|i| data.get(i).expect("sample")).collect();
    let t = to_tensors(&samples).expect("tensors").expect("batch");
    let l = candle_nn::loss::cross_entropy(&model.forward(&t.input).expect("forward"), &t.target).expect("loss");
    trainer.backward(Some(&l), true).expect("backward");
    trainer.step(1e-2).expect("step");
}
