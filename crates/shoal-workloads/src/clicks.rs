//! Click data with a planted model: every user and every item has hidden factors, each impression has a few dense
//! features, and a click happens with probability `σ(α·⟨u, v⟩ + w·x + b)`. Users and items are drawn with
//! Zipf-like popularity, as real logs are (a few users and items are everywhere, most are seldom seen), so a large
//! embedding table is touched a few rows at a time. Since the click probabilities are known, so is the best
//! ranking any model can achieve: the planted model's AUC on the same impressions.
//!
//! Everything is derived from the seed and the impression's index, without tables: any process makes the same
//! impression `i` with nothing but the configuration.

use serde::{Deserialize, Serialize};
use shoal_data::rng::SplitMix64;

use crate::error::{Error, Result};

/// Dense features per impression.
pub const DENSE: usize = 4;
/// The planted model's weights of the dense features, its scale of the factors' product and its bias.
const DENSE_WEIGHTS: [f64; DENSE] = [0.8, -0.6, 0.4, 0.0];
const ALPHA: f64 = 2.0;
const BIAS: f64 = -0.4;

/// The data's shape.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ClickConfig {
    pub users: usize,
    pub items: usize,
    /// The planted factors' dimension.
    pub factors: usize,
    /// Zipf exponents of users' and items' popularity (larger: more skewed; above 1).
    pub user_skew: f64,
    pub item_skew: f64,
    pub seed: u64,
}

impl Default for ClickConfig {
    fn default() -> Self {
        ClickConfig { users: 1_000_000, items: 100_000, factors: 8, user_skew: 1.5, item_skew: 1.3, seed: 17 }
    }
}

/// One impression.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Click {
    pub user: u32,
    pub item: u32,
    pub dense: [f32; DENSE],
    /// The planted click probability.
    pub p: f64,
    pub clicked: bool,
}

/// Which impressions: those to train on, or the held-out ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train = 1,
    Eval = 2,
}

/// The generator.
#[derive(Debug, Clone)]
pub struct Clicks {
    cfg: ClickConfig,
    /// Multipliers that turn a popularity rank into an id, so popular ids are spread over the table (and over
    /// the servers).
    user_mul: u64,
    item_mul: u64,
}

impl Clicks {
    pub fn new(cfg: ClickConfig) -> Result<Clicks> {
        let bad = |what: &str| Err(Error::InvalidArgument(format!("clicks: {what}")));
        if cfg.users == 0 || cfg.items == 0 || cfg.users > u32::MAX as usize || cfg.items > u32::MAX as usize {
            return bad("users and items must be between 1 and 2^32 - 1");
        }
        if cfg.factors == 0 {
            return bad("factors must be at least 1");
        }
        if !(cfg.user_skew > 1.0 && cfg.item_skew > 1.0 && cfg.user_skew < 10.0 && cfg.item_skew < 10.0) {
            return bad("user_skew and item_skew must lie in (1, 10)");
        }
        Ok(Clicks { cfg, user_mul: coprime(cfg.users), item_mul: coprime(cfg.items) })
    }

    pub fn config(&self) -> &ClickConfig {
        &self.cfg
    }

    /// Impression `i` of `split`.
    pub fn get(&self, split: Split, i: u64) -> Click {
        let c = &self.cfg;
        let mut rng = SplitMix64::from_key(&[c.seed, split as u64, i]);
        let user = spread(zipf(&mut rng, c.users, c.user_skew), self.user_mul, c.users);
        let item = spread(zipf(&mut rng, c.items, c.item_skew), self.item_mul, c.items);
        let mut dense = [0f32; DENSE];
        dense.iter_mut().for_each(|x| *x = rng.normal() as f32);
        let p = self.planted(user, item, &dense);
        let clicked = rng.unit_f64() < p;
        Click { user: user as u32, item: item as u32, dense, p, clicked }
    }

    /// The planted click probability.
    pub fn planted(&self, user: usize, item: usize, dense: &[f32; DENSE]) -> f64 {
        let c = &self.cfg;
        let mut u = SplitMix64::from_key(&[c.seed, 10, user as u64]);
        let mut v = SplitMix64::from_key(&[c.seed, 11, item as u64]);
        let dot: f64 = (0..c.factors).map(|_| u.normal() * v.normal()).sum::<f64>() / (c.factors as f64).sqrt();
        let lin: f64 = dense.iter().zip(DENSE_WEIGHTS).map(|(&x, w)| f64::from(x) * w).sum();
        sigmoid(ALPHA * dot + lin + BIAS)
    }
}

pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// A popularity rank in `0..n`, drawn with probability falling as `(rank + 1)^-s` (the continuous inverse of the
/// distribution function, floored).
fn zipf(rng: &mut SplitMix64, n: usize, s: f64) -> usize {
    let top = (n as f64 + 1.0).powf(1.0 - s);
    let x = ((top - 1.0) * rng.unit_f64() + 1.0).powf(1.0 / (1.0 - s));
    (x.floor() as usize).clamp(1, n) - 1
}

fn spread(rank: usize, mul: u64, n: usize) -> usize {
    ((rank as u128 * mul as u128) % n as u128) as usize
}

/// A multiplier near `0.618 · n` with no factor in common with `n`: rank ↦ `rank · mul mod n` is a bijection.
fn coprime(n: usize) -> u64 {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut m = ((n as f64 * 0.618) as u64).max(1);
    while gcd(m, n as u64) != 1 {
        m += 1;
    }
    m
}

/// The area under the ROC curve of `scores` for the `positive` labels: the chance that a positive scores above a
/// negative, ties counting a half. `None` when one class is missing.
pub fn auc(scores: &[f64], positive: &[bool]) -> Option<f64> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut rank_sum, mut pos) = (0f64, 0usize);
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        // Ranks i+1..=j+1 share their mean.
        let mean = (i + j + 2) as f64 / 2.0;
        for &k in &order[i..=j] {
            if positive[k] {
                rank_sum += mean;
                pos += 1;
            }
        }
        i = j + 1;
    }
    let neg = scores.len() - pos;
    (pos > 0 && neg > 0).then(|| (rank_sum - (pos * (pos + 1)) as f64 / 2.0) / (pos as f64 * neg as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_of_known_rankings() {
        assert_eq!(auc(&[0.1, 0.2, 0.8, 0.9], &[false, false, true, true]), Some(1.0));
        assert_eq!(auc(&[0.9, 0.8, 0.2, 0.1], &[false, false, true, true]), Some(0.0));
        // One positive between two negatives: it beats one of two.
        assert_eq!(auc(&[0.1, 0.5, 0.9], &[false, true, false]), Some(0.5));
        // Ties count a half.
        assert_eq!(auc(&[0.5, 0.5], &[true, false]), Some(0.5));
        assert_eq!(auc(&[0.5, 0.7], &[true, true]), None);
    }

    #[test]
    fn impressions_are_reproducible_skewed_and_as_likely_as_planted() -> Result<()> {
        let clicks = Clicks::new(ClickConfig { users: 10_000, items: 1_000, ..ClickConfig::default() })?;
        assert_eq!(clicks.get(Split::Train, 5), clicks.get(Split::Train, 5));
        assert_ne!(clicks.get(Split::Train, 5), clicks.get(Split::Eval, 5));
        let n = 50_000;
        let all: Vec<Click> = (0..n).map(|i| clicks.get(Split::Train, i)).collect();
        // Popularity is skewed: the most frequent user shows up far more than 1 in 10,000.
        let mut counts = vec![0usize; 10_000];
        all.iter().for_each(|c| counts[c.user as usize] += 1);
        let top = counts.iter().max().copied().unwrap_or(0);
        assert!(top > n as usize / 100, "the most popular user has {top} of {n} impressions");
        // The click rate matches the planted probabilities.
        let rate = all.iter().filter(|c| c.clicked).count() as f64 / n as f64;
        let mean_p = all.iter().map(|c| c.p).sum::<f64>() / n as f64;
        assert!((rate - mean_p).abs() < 0.01, "click rate {rate} against planted {mean_p}");
        // The planted model ranks well above chance, and short of perfect.
        let scores: Vec<f64> = all.iter().map(|c| c.p).collect();
        let labels: Vec<bool> = all.iter().map(|c| c.clicked).collect();
        let a = auc(&scores, &labels).unwrap_or(0.0);
        assert!(a > 0.7 && a < 0.95, "planted AUC {a}");
        Ok(())
    }

    #[test]
    fn bad_shapes_are_refused_naming_the_setting() {
        let e = Clicks::new(ClickConfig { user_skew: 1.0, ..ClickConfig::default() }).err().map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("user_skew")));
        assert!(Clicks::new(ClickConfig { users: 0, ..ClickConfig::default() }).is_err());
    }
}
