//! Attacks, for experiments (`[chaos]` with `byzantine_ranks`): what a lying worker sends in place of its
//! gradient. They are simulated where the gradients are gathered, the same on every process, by an attacker who
//! sees every honest gradient (the strongest the robust rules are meant to bear):
//!
//! - `signflip`: its own gradient, reversed and scaled by `scale` (default 10).
//! - `noise`: its own gradient plus Gaussian noise of standard deviation `scale` (default 1), drawn from a seed
//!   every process shares.
//! - `alie` ("a little is enough", Baruch et al., 2019): the honest gradients' coordinate-wise mean less `scale`
//!   (default 1) of their standard deviation — inside the spread, where median and trimmed mean look.
//! - `ipm` (inner-product manipulation, Xie et al., 2020): `-scale` (default 0.5) times the honest mean, which
//!   turns the aggregate against the descent direction when the rule lets it through.

use crate::error::{PsError, Result};
use crate::optim::Real;

/// An attack (`chaos.attack` in a job spec).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attack {
    SignFlip { scale: f64 },
    Noise { scale: f64 },
    Alie { scale: f64 },
    Ipm { scale: f64 },
}

impl Attack {
    /// The attack of that name, at `scale` or its default.
    pub fn parse(name: &str, scale: Option<f64>) -> Option<Attack> {
        Some(match name {
            "signflip" => Attack::SignFlip { scale: scale.unwrap_or(10.0) },
            "noise" => Attack::Noise { scale: scale.unwrap_or(1.0) },
            "alie" => Attack::Alie { scale: scale.unwrap_or(1.0) },
            "ipm" => Attack::Ipm { scale: scale.unwrap_or(0.5) },
            _ => return None,
        })
    }

    /// The name a job spec gives it.
    pub fn name(&self) -> &'static str {
        match self {
            Attack::SignFlip { .. } => "signflip",
            Attack::Noise { .. } => "noise",
            Attack::Alie { .. } => "alie",
            Attack::Ipm { .. } => "ipm",
        }
    }

    /// Its scale.
    pub fn scale(&self) -> f64 {
        match *self {
            Attack::SignFlip { scale } | Attack::Noise { scale } | Attack::Alie { scale } | Attack::Ipm { scale } => {
                scale
            }
        }
    }

    /// Replaces the parts of `byzantine` ranks in `gathered` (every rank's `len` values, one after the other) by
    /// what the attack sends; `seed` (the same on every process) draws the noise.
    pub fn apply<R: Real>(&self, gathered: &mut [R], len: usize, byzantine: &[usize], seed: u64) -> Result<()> {
        let n = gathered.len().checked_div(len).unwrap_or(0);
        if len == 0 || n * len != gathered.len() {
            return Err(PsError::InvalidArgument(format!("{} values are not parts of {len}", gathered.len())));
        }
        if let Some(r) = byzantine.iter().find(|&&r| r >= n) {
            return Err(PsError::InvalidArgument(format!("byzantine rank {r} of {n} ranks")));
        }
        let honest: Vec<usize> = (0..n).filter(|r| !byzantine.contains(r)).collect();
        // The honest parts' coordinate-wise mean and standard deviation, for the attacks that use them.
        let stats = |j: usize| -> (f64, f64) {
            let k = honest.len().max(1) as f64;
            let mean = honest.iter().map(|&r| gathered[r * len + j].wide()).sum::<f64>() / k;
            let var = honest.iter().map(|&r| (gathered[r * len + j].wide() - mean).powi(2)).sum::<f64>() / k;
            (mean, var.sqrt())
        };
        let s = self.scale();
        let forged: Vec<Vec<R>> = byzantine
            .iter()
            .map(|&r| {
                let own = &gathered[r * len..(r + 1) * len];
                let mut rng = Normal::new(seed ^ (r as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                (0..len)
                    .map(|j| match self {
                        Attack::SignFlip { .. } => R::of(-s * own[j].wide()),
                        Attack::Noise { .. } => R::of(own[j].wide() + s * rng.next()),
                        Attack::Alie { .. } => {
                            let (mean, sd) = stats(j);
                            R::of(mean - s * sd)
                        }
                        Attack::Ipm { .. } => R::of(-s * stats(j).0),
                    })
                    .collect()
            })
            .collect();
        for (&r, f) in byzantine.iter().zip(forged) {
            gathered[r * len..(r + 1) * len].copy_from_slice(&f);
        }
        Ok(())
    }
}

/// Standard normal draws (Box–Muller over SplitMix64): the same sequence on every process for a seed.
struct Normal(u64);

impl Normal {
    fn new(seed: u64) -> Normal {
        Normal(seed)
    }

    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn next(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::robust::{Rule, aggregate};

    /// Five ranks' parts of two values: four honest near (1, -1), rank 4 the attacker.
    fn parts() -> Vec<f32> {
        vec![1.0, -1.0, 1.2, -0.8, 0.8, -1.2, 1.0, -1.0, 1.1, -0.9]
    }

    #[test]
    fn each_attack_forges_what_it_promises() -> Result<()> {
        let mut g = parts();
        Attack::SignFlip { scale: 10.0 }.apply(&mut g, 2, &[4], 1)?;
        assert_eq!(&g[8..], &[-11.0, 9.0]);
        assert_eq!(&g[..8], &parts()[..8], "honest parts untouched");
        let mut g = parts();
        Attack::Ipm { scale: 0.5 }.apply(&mut g, 2, &[4], 1)?;
        assert_eq!(&g[8..], &[-0.5, 0.5]);
        let mut g = parts();
        Attack::Alie { scale: 1.0 }.apply(&mut g, 2, &[4], 1)?;
        let sd = (0.08f64 / 4.0).sqrt();
        assert!((f64::from(g[8]) - (1.0 - sd)).abs() < 1e-6 && (f64::from(g[9]) - (-1.0 - sd)).abs() < 1e-6, "{g:?}");
        let (mut a, mut b) = (parts(), parts());
        Attack::Noise { scale: 1.0 }.apply(&mut a, 2, &[4], 7)?;
        Attack::Noise { scale: 1.0 }.apply(&mut b, 2, &[4], 7)?;
        assert_eq!(a, b, "the same noise on every process");
        assert_ne!(&a[8..], &parts()[8..]);
        assert!(Attack::SignFlip { scale: 1.0 }.apply(&mut parts(), 2, &[5], 1).is_err());
        assert!(Attack::SignFlip { scale: 1.0 }.apply(&mut parts(), 3, &[0], 1).is_err());
        assert_eq!(Attack::parse("ipm", None), Some(Attack::Ipm { scale: 0.5 }));
        assert_eq!(Attack::parse("flood", None), None);
        Ok(())
    }

    /// One sign-flipping attacker of five drags the mean across zero; the median and Krum stay with the honest.
    #[test]
    fn a_sign_flipper_moves_the_mean_and_not_the_robust_rules() -> Result<()> {
        let mut g = parts();
        Attack::SignFlip { scale: 10.0 }.apply(&mut g, 2, &[4], 1)?;
        let views: Vec<&[f32]> = g.chunks(2).collect();
        let mut out = [0f32; 2];
        aggregate(Rule::Mean, 0, &views, &mut out)?;
        assert!(out[0] < 0.0 && out[1] > 0.0, "the mean turned: {out:?}");
        for rule in [Rule::Median, Rule::TrimmedMean, Rule::Krum, Rule::GeoMed] {
            aggregate(rule, 1, &views, &mut out)?;
            assert!((0.7..=1.3).contains(&out[0]) && (-1.3..=-0.7).contains(&out[1]), "{}: {out:?}", rule.name());
        }
        Ok(())
    }
}
