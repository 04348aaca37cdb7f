//! Optimizers (SGD with momentum, AdamW) whose state is plain named tensors,
//! so it can be checkpointed and restored exactly; the learning-rate schedule
//! (linear warm-up, then cosine decay); global-norm gradient clipping.

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::params::Params;

/// Which optimizer, with its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimConfig {
    Sgd { momentum: f64, weight_decay: f64 },
    AdamW { beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
}

/// An optimizer and its per-parameter state.
#[derive(Debug)]
pub struct Optimizer {
    cfg: OptimConfig,
    /// SGD: momentum buffers; AdamW: first moments.
    m: Vec<Option<Tensor>>,
    /// AdamW: second moments.
    v: Vec<Option<Tensor>>,
    /// Updates applied so far.
    pub t: u64,
}

impl Optimizer {
    pub fn new(cfg: OptimConfig, params: &Params) -> Optimizer {
        let n = params.vars().len();
        Optimizer { cfg, m: vec![None; n], v: vec![None; n], t: 0 }
    }

    /// Applies one update with learning rate `lr` from gradients aligned with `params`.
    pub fn step(&mut self, params: &Params, grads: &[Tensor], lr: f64) -> Result<()> {
        if grads.len() != params.vars().len() {
            return Err(Error::InvalidArgument(format!(
                "{} gradients for {} parameters",
                grads.len(),
                params.vars().len()
            )));
        }
        self.t += 1;
        for (i, ((_, var), g)) in params.vars().iter().zip(grads).enumerate() {
            let p = var.as_tensor();
            match self.cfg {
                OptimConfig::Sgd { momentum, weight_decay } => {
                    let g = if weight_decay != 0.0 { (g + (p * weight_decay)?)? } else { g.clone() };
                    let buf = match self.m[i].take() {
                        Some(b) if momentum != 0.0 => ((b * momentum)? + &g)?,
                        _ => g,
                    };
                    var.set(&(p - (&buf * lr)?)?)?;
                    self.m[i] = Some(buf);
                }
                OptimConfig::AdamW { beta1, beta2, eps, weight_decay } => {
                    let m = match self.m[i].take() {
                        Some(m) => ((m * beta1)? + (g * (1.0 - beta1))?)?,
                        None => (g * (1.0 - beta1))?,
                    };
                    let v = match self.v[i].take() {
                        Some(v) => ((v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?,
                        None => (g.sqr()? * (1.0 - beta2))?,
                    };
                    let c1 = 1.0 - beta1.powi(self.t as i32);
                    let c2 = 1.0 - beta2.powi(self.t as i32);
                    let mhat = (&m / c1)?;
                    let vhat = (&v / c2)?;
                    let update = (mhat / (vhat.sqrt()? + eps)?)?;
                    let decayed = (p * (1.0 - lr * weight_decay))?;
                    var.set(&(decayed - (update * lr)?)?)?;
                    self.m[i] = Some(m);
                    self.v[i] = Some(v);
                }
            }
        }
        Ok(())
    }

    /// The state as named tensors (`<param>.m`, `<param>.v`), for checkpoints.
    pub fn state(&self, params: &Params) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, (name, _)) in params.vars().iter().enumerate() {
            if let Some(m) = &self.m[i] {
                out.push((format!("{name}.m"), m.clone()));
            }
            if let Some(v) = &self.v[i] {
                out.push((format!("{name}.v"), v.clone()));
            }
        }
        out
    }

    /// Restores the state saved by [`Self::state`].
    pub fn load_state(
        &mut self,
        params: &Params,
        t: u64,
        named: &std::collections::HashMap<String, Tensor>,
    ) -> Result<()> {
        self.t = t;
        for (i, (name, var)) in params.vars().iter().enumerate() {
            for (slot, suffix) in [(&mut self.m[i], "m"), (&mut self.v[i], "v")] {
                *slot = match named.get(&format!("{name}.{suffix}")) {
                    Some(x) if x.shape() == var.shape() => Some(x.clone()),
                    Some(x) => {
                        return Err(Error::Checkpoint(format!(
                            "optimizer state {name}.{suffix} has shape {:?}, the parameter {:?}",
                            x.dims(),
                            var.dims()
                        )));
                    }
                    None => None,
                };
            }
        }
        Ok(())
    }
}

/// Learning rate at `step` (0-based): linear warm-up to `lr`, then cosine decay
/// to `min_lr` at `total` steps (or constant after warm-up).
pub fn learning_rate(step: usize, total: usize, lr: f64, warmup: usize, min_lr: f64, cosine: bool) -> f64 {
    if warmup > 0 && step < warmup {
        return lr * (step + 1) as f64 / warmup as f64;
    }
    if !cosine || total <= warmup {
        return lr;
    }
    let progress = ((step - warmup) as f64 / (total - warmup).max(1) as f64).min(1.0);
    min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// Scales gradients so their global L2 norm is at most `max_norm`; returns the norm before.
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let mut sq = 0f64;
    for g in grads.iter() {
        sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    let norm = sq.sqrt();
    if norm > max_norm && norm > 0.0 {
        let s = max_norm / norm;
        for g in grads.iter_mut() {
            *g = (&*g * s)?;
        }
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        assert!((learning_rate(0, 100, 1.0, 10, 0.1, true) - 0.1).abs() < 1e-12);
        assert!((learning_rate(9, 100, 1.0, 10, 0.1, true) - 1.0).abs() < 1e-12);
        assert!((learning_rate(10, 100, 1.0, 10, 0.1, true) - 1.0).abs() < 1e-12);
        assert!((learning_rate(100, 100, 1.0, 10, 0.1, true) - 0.1).abs() < 1e-12);
        assert!((learning_rate(55, 100, 1.0, 10, 0.0, true) - 0.5).abs() < 1e-12);
        assert_eq!(learning_rate(70, 100, 0.3, 0, 0.0, false), 0.3);
    }
}
