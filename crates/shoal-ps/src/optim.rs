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

/// The floating-point types the formula runs in: `f32`, training's, and `f64`, which tells a rounding from a bug.
pub trait Real:
    Copy
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::SubAssign
    + PartialEq
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// `x`, rounded to this type.
    fn of(x: f64) -> Self;
    /// This value in `f64` (exact).
    fn wide(self) -> f64;
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    fn of(x: f64) -> f32 {
        x as f32
    }
    fn wide(self) -> f64 {
        f64::from(self)
    }
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    fn of(x: f64) -> f64 {
        x
    }
    fn wide(self) -> f64 {
        self
    }
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
}

/// One optimizer update of `p` from `g` at update number `t` (1-based), in place: the one formula every strategy
/// applies, to whole parameters or to flat shards of them, in `f32` or `f64` ([`Real`]). SGD: `m` is the momentum buffer (`first`: its first use,
/// when it becomes the gradient itself, PyTorch's convention; `None` without momentum). AdamW: `m` and `v` are the
/// moments, `v` with whether it is frozen (see shoal-train's `Optimizer::freeze_second_moment`). Every slice is as long as `p`.
pub fn update<T: Real>(
    cfg: OptimConfig,
    t: u64,
    lr: f64,
    p: &mut [T],
    g: &[T],
    m: Option<(&mut [T], bool)>,
    v: Option<(&mut [T], bool)>,
) -> Result<()> {
    let lr32 = T::of(lr);
    let one = T::of(1.0);
    match (cfg, m, v) {
        (OptimConfig::Sgd { weight_decay, .. }, None, _) => {
            let wd = T::of(weight_decay);
            for (p, &g) in p.iter_mut().zip(g) {
                *p -= lr32 * (g + wd * *p);
            }
        }
        (OptimConfig::Sgd { momentum, weight_decay }, Some((buf, first)), _) => {
            let (mu, wd) = (T::of(momentum), T::of(weight_decay));
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
            let c1 = T::of(1.0 - beta1.powi(t as i32));
            let c2 = T::of(1.0 - beta2.powi(t as i32));
            let (b1, b2, eps) = (T::of(beta1), T::of(beta2), T::of(eps));
            let decay = T::of(1.0 - lr * weight_decay);
            // Frozen, the average of squares goes on counting the unknown squares as zeros.
            let take = if frozen { T::of(0.0) } else { one - b2 };
            for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
                *m = b1 * *m + (one - b1) * g;
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

/// [`update`] of a flat shard `p` whose optimizer state is kept in `m` and `v`, grown to `p`'s length as the
/// optimizer needs them (`first`: no update has used them yet) — how ZeRO's shards, a composed layout's and a
/// parameter server's are updated.
#[allow(clippy::too_many_arguments)]
pub fn update_flat<T: Real>(
    cfg: OptimConfig,
    t: u64,
    lr: f64,
    p: &mut [T],
    g: &[T],
    m: &mut Vec<T>,
    v: &mut Vec<T>,
    first: bool,
) -> Result<()> {
    let (n, zero) = (p.len(), T::of(0.0));
    match cfg {
        OptimConfig::Sgd { momentum: 0.0, .. } => update(cfg, t, lr, p, g, None, None),
        OptimConfig::Sgd { .. } => {
            m.resize(n, zero);
            update(cfg, t, lr, p, g, Some((m, first)), None)
        }
        OptimConfig::AdamW { .. } => {
            m.resize(n, zero);
            v.resize(n, zero);
            update(cfg, t, lr, p, g, Some((m, first)), Some((v, false)))
        }
    }
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

    /// The formula in f64 is the f32 one's, to f32's rounding: AdamW from the same start agrees within 1e-5.
    #[test]
    fn the_formula_in_f64_follows_the_f32_one() -> Result<()> {
        let cfg = OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
        let (mut p32, mut m32, mut v32) = (vec![0.5f32, -1.5, 2.0], vec![0f32; 3], vec![0f32; 3]);
        let (mut p64, mut m64, mut v64) = (vec![0.5f64, -1.5, 2.0], vec![0f64; 3], vec![0f64; 3]);
        for t in 1..=20u64 {
            let g32: Vec<f32> = (0..3).map(|j| ((t * 7 + j) % 5) as f32 * 0.1 - 0.2).collect();
            let g64: Vec<f64> = g32.iter().map(|&x| f64::from(x)).collect();
            update(cfg, t, 1e-2, &mut p32, &g32, Some((&mut m32, false)), Some((&mut v32, false)))?;
            update(cfg, t, 1e-2, &mut p64, &g64, Some((&mut m64, false)), Some((&mut v64, false)))?;
        }
        for (a, b) in p32.iter().zip(&p64) {
            assert!((f64::from(*a) - b).abs() < 1e-5, "{a} against {b}");
        }
        Ok(())
    }
}
