//! The optimizers' update, on plain buffers: the one formula every data-parallel strategy of the trainer and every
//! parameter server applies, to whole parameters or to any flat part of them — so a value updated on a server is
//! the value a worker would have computed, bit for bit.

use crate::error::{PsError, Result};

/// Which optimizer, with its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimConfig {
    Sgd { momentum: f64, weight_decay: f64 },
    AdamW { beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
}

/// One optimizer update of `p` from `g` at update number `t` (1-based), in place: the one formula every strategy
/// applies, to whole parameters or to flat shards of them. SGD: `m` is the momentum buffer (`first`: its first use,
/// when it becomes the gradient itself, PyTorch's convention; `None` without momentum). AdamW: `m` and `v` are the
/// moments, `v` with whether it is frozen (see shoal-train's `Optimizer::freeze_second_moment`). Every slice is as long as `p`.
pub fn update(
    cfg: OptimConfig,
    t: u64,
    lr: f64,
    p: &mut [f32],
    g: &[f32],
    m: Option<(&mut [f32], bool)>,
    v: Option<(&mut [f32], bool)>,
) -> Result<()> {
    let lr32 = lr as f32;
    match (cfg, m, v) {
        (OptimConfig::Sgd { weight_decay, .. }, None, _) => {
            let wd = weight_decay as f32;
            for (p, &g) in p.iter_mut().zip(g) {
                *p -= lr32 * (g + wd * *p);
            }
        }
        (OptimConfig::Sgd { momentum, weight_decay }, Some((buf, first)), _) => {
            let (mu, wd) = (momentum as f32, weight_decay as f32);
            if first {
                for ((p, b), &g) in p.iter_mut().zip(buf.iter_mut()).zip(g) {
                    *b = g + wd * *p;
                    *p -= lr32 * *b;
                }
            } else {
                for ((p, b), &g) in p.iter_mut().zip(buf.iter_mut()).zip(g) {
                    *b = mu * *b + (g + wd * *p);
                    *p -= lr32 * *b;
                }
            }
        }
        (OptimConfig::AdamW { beta1, beta2, eps, weight_decay }, Some((m, _)), Some((v, frozen))) => {
            let c1 = (1.0 - beta1.powi(t as i32)) as f32;
            let c2 = (1.0 - beta2.powi(t as i32)) as f32;
            let (b1, b2, eps) = (beta1 as f32, beta2 as f32, eps as f32);
            let decay = (1.0 - lr * weight_decay) as f32;
            // Frozen, the average of squares goes on counting the unknown squares as zeros.
            let take = if frozen { 0.0 } else { 1.0 - b2 };
            for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + take * g * g;
                let update = (*m / c1) / ((*v / c2).sqrt() + eps);
                *p = *p * decay - lr32 * update;
            }
        }
        (OptimConfig::AdamW { .. }, _, _) => {
            return Err(PsError::InvalidArgument("AdamW needs both of its moments".into()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frozen, AdamW's second moment counts the step's square as zero (it decays by β2) while the first moment and
    /// the parameter are updated as usual; thawed, it takes squares again.
    #[test]
    fn a_frozen_second_moment_takes_no_new_squares() -> Result<()> {
        let cfg = OptimConfig::AdamW { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
        let (mut p, mut m, mut v) = (vec![1.0f32, -2.0], vec![0.5f32, 0.25], vec![0.04f32, 0.04]);
        let g = [0.3f32, -0.1];
        update(cfg, 5, 0.1, &mut p, &g, Some((&mut m, false)), Some((&mut v, true)))?;
        assert_eq!(v, vec![0.99 * 0.04f32, 0.99 * 0.04f32]);
        assert_eq!(m, vec![0.9 * 0.5f32 + 0.1 * 0.3, 0.9 * 0.25f32 + 0.1 * -0.1]);
        let c2 = (1.0 - 0.99f64.powi(5)) as f32;
        let c1 = (1.0 - 0.9f64.powi(5)) as f32;
        for (k, start) in [1.0f32, -2.0].into_iter().enumerate() {
            assert_eq!(p[k], start - 0.1 * ((m[k] / c1) / ((v[k] / c2).sqrt() + 1e-8)));
        }
        update(cfg, 6, 0.1, &mut p, &g, Some((&mut m, false)), Some((&mut v, false)))?;
        assert_eq!(v[0], 0.99 * (0.99 * 0.04f32) + (1.0 - 0.99f32) * 0.3 * 0.3);
        Ok(())
    }
}
