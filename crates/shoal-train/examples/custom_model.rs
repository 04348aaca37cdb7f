//! Your own candle model, trained data-parallel with no distributed code in it.
//!
//! The model below is plain candle-nn (a `VarMap`, `linear` layers). Shoal's
//! `Trainer` takes its variables and a communicator, and does the rest:
//! broadcast at start, bucketed gradient all-reduce, the same update everywhere.
//! In a build with the `cuda` feature on a machine with a GPU, the model is
//! made there: its variables, their gradients and AdamW's state stay on the
//! GPU, and only the gradient buckets cross to the host to be summed.
//!
//! Run with:
//!   cargo build --release -p shoal-train --example custom_model
//!   cargo run --release -p shoal -- run -n 2 -- target/release/examples/custom_model

use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap, linear};
use shoal_data::{Dataset, DistributedSampler, Options, SamplerConfig, Split};
use shoal_train::batch::to_tensors;
use shoal_train::{OptimConfig, Params, Trainer, TrainerConfig};

fn main() -> Result<()> {
    // 1. The communicator from the environment `shoal run` sets up.
    let comm = shoal_comm::env::EnvContract::from_env()?.connect()?;
    let (world, rank) = (comm.size(), comm.rank());

    // 2. A model written with candle-nn, knowing nothing of distribution, on the GPU where there is one.
    let device = Device::cuda_if_available(0)?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let l1 = linear(64, 96, vb.pp("l1"))?;
    let l2 = linear(96, 10, vb.pp("l2"))?;
    let forward = |x: &Tensor| -> candle_core::Result<Tensor> { l2.forward(&l1.forward(x)?.relu()?) };

    // 3. Hand its variables to the Trainer (sorted by name: the same order on every rank).
    let mut vars: Vec<_> =
        varmap.data().lock().map_err(|_| anyhow::anyhow!("varmap lock"))?.clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let cfg = TrainerConfig {
        optimizer: OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
        ..TrainerConfig::default()
    };
    let mut trainer = Trainer::new(Params::from_vars(vars), Some(comm.clone()), cfg)?;

    // 4. Each rank takes its share of every global batch of 64.
    let data: Arc<dyn Dataset> =
        Arc::from(shoal_data::builtin("digits", &Options { split: Split::Train, ..Default::default() })?);
    let mut sampler = DistributedSampler::new(SamplerConfig::new(data.len(), 64), world, rank)?;
    for step in 1..=300 {
        let rb = sampler.next_batch_cycling();
        let samples = rb.indices.iter().map(|&i| data.get(i)).collect::<shoal_data::Result<Vec<_>>>()?;
        let weight = rb.indices.len() as f64 / rb.global_size as f64;
        let loss = match to_tensors(&samples)? {
            Some(t) => {
                let (x, y) = (t.input.to_device(&device)?, t.target.to_device(&device)?);
                Some((candle_nn::loss::cross_entropy(&forward(&x)?, &y)? * weight)?)
            }
            None => None,
        };
        trainer.backward(loss.as_ref(), true)?;
        trainer.step(3e-3)?;
        if rank == 0 && step % 50 == 0 {
            let l = loss.map(|l| l.to_scalar::<f32>()).transpose()?.unwrap_or(0.0) / weight as f32;
            println!("step {step}: loss on rank 0's share {l:.4}");
        }
    }
    Ok(())
}
