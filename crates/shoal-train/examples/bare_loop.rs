//! The same MLP as `examples/mlp_synthetic.toml` (784-1024-1024-10, SGD with
//! momentum 0.9, lr 0.01, synthetic data) in a bare candle loop: no launcher, no
//! communicator, no loader thread, no metrics. Against `shoal run -n 1` it
//! measures what the platform adds to a training step.
//!
//! Run with:
//!   cargo build --release -p shoal-train --example bare_loop
//!   RAYON_NUM_THREADS=1 target/release/examples/bare_loop [STEPS] [BATCH]

use anyhow::Result;
use shoal_data::{Dataset, Options, Split};
use shoal_train::batch::to_tensors;
use shoal_train::{Mlp, Model, OptimConfig, Optimizer, Params, SeededRng};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(60);
    let batch: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(256);
    let data = shoal_data::builtin("synthetic", &Options { split: Split::Train, ..Default::default() })?;
    let mut params = Params::default();
    let model = Mlp::new(&mut params, &mut SeededRng::new(0), 784, &[1024, 1024], 10)?;
    let mut opt = Optimizer::new(OptimConfig::Sgd { momentum: 0.9, weight_decay: 0.0 }, &params);
    let mut times = Vec::with_capacity(steps);
    let warmup = 5;
    for step in 0..steps + warmup {
        let samples = (step * batch..(step + 1) * batch)
            .map(|i| data.get(i % data.len()))
            .collect::<shoal_data::Result<Vec<_>>>()?;
        let t0 = std::time::Instant::now();
        let t = to_tensors(&samples)?.ok_or_else(|| anyhow::anyhow!("empty batch"))?;
        let loss = candle_nn::loss::cross_entropy(&model.forward(&t.input)?, &t.target)?;
        let grads = loss.backward()?;
        let g: Vec<_> = params
            .vars()
            .iter()
            .map(|(_, v)| grads.get(v.as_tensor()).map(|g| g.detach()).ok_or_else(|| anyhow::anyhow!("no gradient")))
            .collect::<Result<_>>()?;
        opt.step(&params, &g, 0.01)?;
        if step >= warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let median = times[times.len() / 2];
    println!(
        "{}",
        serde_json::json!({ "steps": steps, "batch": batch, "step_ms_median": median * 1e3, "samples_per_s": batch as f64 / median })
    );
    Ok(())
}
