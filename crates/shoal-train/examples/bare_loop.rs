//! The same MLP as `examples/mlp_synthetic.toml` (784-1024-1024-10, SGD with
//! momentum 0.9, lr 0.01, synthetic data) in a bare loop: no launcher, no
//! communicator, no loader thread, no trainer, no metrics. Against
//! `shoal run -n 1` it measures what the platform adds to a training step.
//!
//! Two loops are timed, one after the other:
//! - `hand`: the model's hand-written backward pass into plain gradient
//!   buffers, then the optimizer — what `shoal run` does for the MLP;
//! - `autograd`: candle's forward, cross-entropy and `backward()`, then the
//!   optimizer — the same model as a plain candle program.
//!
//! Run with:
//!   cargo build --release -p shoal-train --example bare_loop
//!   RAYON_NUM_THREADS=1 target/release/examples/bare_loop [STEPS] [BATCH]

use anyhow::Result;
use shoal_data::{Dataset, Options, Sample, Split};
use shoal_train::batch::{to_flat, to_tensors};
use shoal_train::{GradSink, Mlp, Model, OptimConfig, Optimizer, Params, SeededRng};

/// One gradient buffer per parameter.
struct Grads(Vec<Vec<f32>>);

impl GradSink for Grads {
    fn put(
        &mut self,
        index: usize,
        fill: &mut dyn FnMut(&mut [f32]) -> shoal_train::Result<()>,
    ) -> shoal_train::Result<()> {
        let g = &mut self.0[index];
        g.iter_mut().for_each(|x| *x = 0.0);
        fill(g)
    }

    fn attach_scalars(&mut self, _values: &[f32]) {}
}

fn median_ms(times: Vec<f64>) -> f64 {
    shoal_train::spec::median(times).unwrap_or(f64::NAN) * 1e3
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(60);
    let batch: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(256);
    let data = shoal_data::builtin("synthetic", &Options { split: Split::Train, ..Default::default() })?;
    let warmup = 5;
    let batches: Vec<Vec<Sample>> = (0..steps + warmup)
        .map(|step| (step * batch..(step + 1) * batch).map(|i| data.get(i % data.len())).collect())
        .collect::<shoal_data::Result<_>>()?;
    let sgd = OptimConfig::Sgd { momentum: 0.9, weight_decay: 0.0 };

    // The hand-written backward pass.
    let mut params = Params::default();
    let model = Mlp::new(&mut params, &mut SeededRng::new(0), 784, &[1024, 1024], 10)?;
    let mut opt = Optimizer::new(sgd, &params);
    let mut grads = Grads(params.vars().iter().map(|(_, v)| vec![0f32; v.elem_count()]).collect());
    let hand = model.hand_backward().ok_or_else(|| anyhow::anyhow!("the MLP has a hand-written backward pass"))?;
    let mut hand_times = Vec::with_capacity(steps);
    let mut hand_loss = f32::NAN;
    for (step, samples) in batches.iter().enumerate() {
        let t0 = std::time::Instant::now();
        let flat = to_flat(samples)?.ok_or_else(|| anyhow::anyhow!("empty batch"))?;
        hand_loss = hand.loss_and_grads(&flat, 1.0, &mut grads)?;
        let g: Vec<&[f32]> = grads.0.iter().map(Vec::as_slice).collect();
        opt.step_slices(&params, &g, 0.01)?;
        if step >= warmup {
            hand_times.push(t0.elapsed().as_secs_f64());
        }
    }

    // candle's autograd.
    let mut params = Params::default();
    let model = Mlp::new(&mut params, &mut SeededRng::new(0), 784, &[1024, 1024], 10)?;
    let mut opt = Optimizer::new(sgd, &params);
    let mut auto_times = Vec::with_capacity(steps);
    let mut auto_loss = f32::NAN;
    for (step, samples) in batches.iter().enumerate() {
        let t0 = std::time::Instant::now();
        let t = to_tensors(samples)?.ok_or_else(|| anyhow::anyhow!("empty batch"))?;
        let loss = candle_nn::loss::cross_entropy(&model.forward(&t.input)?, &t.target)?;
        let grads = loss.backward()?;
        let g: Vec<_> = params
            .vars()
            .iter()
            .map(|(_, v)| grads.get(v.as_tensor()).map(|g| g.detach()).ok_or_else(|| anyhow::anyhow!("no gradient")))
            .collect::<Result<_>>()?;
        opt.step(&params, &g, 0.01)?;
        auto_loss = loss.to_scalar::<f32>()?;
        if step >= warmup {
            auto_times.push(t0.elapsed().as_secs_f64());
        }
    }

    let (hand_ms, auto_ms) = (median_ms(hand_times), median_ms(auto_times));
    println!(
        "{}",
        serde_json::json!({
            "steps": steps,
            "batch": batch,
            "hand": { "step_ms_median": hand_ms, "samples_per_s": batch as f64 / hand_ms * 1e3, "final_loss": hand_loss },
            "autograd": { "step_ms_median": auto_ms, "samples_per_s": batch as f64 / auto_ms * 1e3, "final_loss": auto_loss },
        })
    );
    Ok(())
}
