//! ZeRO-3's parameter memory, measured by the counting allocator (installed here as the `shoal` binary installs
//! it): N ranks, threads of this process, hold between steps what their strategies report — under ZeRO-3 a shard of
//! the parameters each, the N shards together one model; under DDP a whole model each. A test binary of its own: the
//! heap is the process's, so nothing else may run beside it.
//!
//! Run with: cargo test -p shoal-train --test zero3_memory -- --nocapture (prints the figures).

use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use shoal_comm::{CommConfig, Communicator, TransportChoice};
use shoal_data::{Dataset, Options, Split};
use shoal_train::batch::to_tensors;
use shoal_train::memory::{CountingAlloc, heap};
use shoal_train::strategy::zero::Zero3;
use shoal_train::{Gpt, GptConfig, Model, OptimConfig, Params, SeededRng, Trainer, TrainerConfig};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// 6 blocks of about 50 k parameters, embeddings and head of 16 k each: about 330 k parameters.
const GPT: GptConfig = GptConfig { vocab: 256, context: 16, layers: 6, heads: 2, width: 64 };

/// What one rank reports after its steps: parameter, gradient and optimizer bytes.
type Reported = (usize, usize, usize);

/// Runs 2 AdamW steps on `n` ranks (ZeRO-3 or DDP); returns, for each rank, what its trainer and model hold between
/// steps as the allocator measures it (what dropping them gives back, each rank in turn while the others wait) and
/// what it reports; and the model's parameter count. The communicators outlive the measurement, and so do the
/// threads (their matrix kernels' per-thread buffers are theirs, not the model's).
fn held_between_steps(zero3: bool, n: usize) -> (Vec<(usize, Reported)>, usize) {
    let opts = Options { split: Split::Train, context: Some(16), stride: Some(7), ..Options::default() };
    let data: Arc<dyn Dataset> = Arc::from(shoal_data::builtin("cicero", &opts).expect("dataset"));
    let comms: Vec<Option<Communicator>> = if n == 1 {
        vec![None]
    } else {
        let cfg = CommConfig {
            transport: TransportChoice::InProc,
            timeout: Duration::from_secs(120),
            ..CommConfig::default()
        };
        Communicator::local_world(n, cfg).expect("world").into_iter().map(Some).collect()
    };
    let (stepped, measured) = (Arc::new(Barrier::new(n)), Arc::new(Barrier::new(n)));
    let turn = Arc::new(Mutex::new(()));
    let hs: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (data, stepped, measured, turn) = (data.clone(), stepped.clone(), measured.clone(), turn.clone());
            std::thread::spawn(move || {
                let mut params = Params::default();
                let model = Gpt::new(&mut params, &mut SeededRng::new(3), GPT).expect("gpt");
                let count = params.count();
                let cfg = TrainerConfig {
                    optimizer: OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
                    ..TrainerConfig::default()
                };
                let keep = comm.clone();
                let mut trainer = match zero3 {
                    true => Trainer::with_strategy(params, Box::new(Zero3::new(comm, true)), cfg),
                    false => Trainer::new(params, comm, cfg),
                }
                .expect("trainer");
                for step in 0..2 {
                    let samples: Vec<_> = (0..4).map(|i| data.get(8 * step + 4 * rank + i).expect("sample")).collect();
                    let t = to_tensors(&samples).expect("tensors").expect("batch");
                    let logits = model.forward(&t.input).expect("forward");
                    let l = (candle_nn::loss::cross_entropy(&logits, &t.target).expect("loss") / n as f64).expect("w");
                    trainer.backward(Some(&l), true).expect("backward");
                    trainer.step(1e-3).expect("step");
                }
                let reported = (trainer.param_bytes(), trainer.gradient_bytes(), trainer.optimizer_bytes());
                stepped.wait();
                let held = {
                    let _turn = turn.lock().unwrap_or_else(|p| p.into_inner());
                    let before = heap().expect("the counting allocator is installed");
                    drop((trainer, model));
                    before.saturating_sub(heap().expect("installed"))
                };
                measured.wait();
                drop(keep);
                ((held, reported), count)
            })
        })
        .collect();
    let outs: Vec<_> = hs.into_iter().map(|h| h.join().expect("rank")).collect();
    let count = outs[0].1;
    (outs.into_iter().map(|(r, _)| r).collect(), count)
}

#[test]
fn zero3_ranks_hold_a_shard_of_the_parameters_each_as_the_allocator_measures() {
    for n in [1, 2, 4] {
        let (ddp, p) = held_between_steps(false, n);
        let zero3 = held_between_steps(true, n).0;
        let whole = 4 * p;
        eprintln!("{n} ranks, {p} parameters ({whole} bytes): per rank (held, (params, grads, optimizer) reported):");
        eprintln!("  ddp {ddp:?}\n  zero3 {zero3:?}");
        for (rank, ((d, (_, _, d_opt)), (z, (params, grads, opt)))) in ddp.iter().zip(&zero3).enumerate() {
            // DDP: a whole model on every rank, beside its optimizer state (its gradient buffers are the step's:
            // with one rank none is kept between steps).
            assert!(d.saturating_sub(*d_opt) >= whole, "ddp, {n} ranks: rank {rank} holds {d}, {d_opt} of state");
            // ZeRO-3: what is held less the gradient buffers and optimizer state it reports (all kept between steps)
            // is its shard of the parameters — a 1/N slice of every layer — and a little more (names, handles, the
            // layers' bookkeeping); what it reports for parameters is that shard and the whole layers it held at once
            // during a pass: at most the two largest (one in use, one being gathered), each padded to a slice per
            // rank, one of them twice while its gathered values are copied into its tensors.
            let shard = whole.div_ceil(n);
            let measured = z.saturating_sub(grads + opt);
            assert!(
                measured >= shard && measured <= shard + whole / 50 + (16 << 10),
                "zero3, {n} ranks: rank {rank} holds {measured} bytes beside its gradients and state; its shard of \
                 the parameters is {shard}"
            );
            let block = 4 * (12 * GPT.width * GPT.width + 13 * GPT.width + n);
            assert!(
                *params >= shard && *params <= shard + 3 * block,
                "zero3, {n} ranks: rank {rank} reports {params} bytes of parameters; its shard is {shard}, a block \
                 {block}"
            );
        }
    }
}
