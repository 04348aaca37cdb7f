//! Federated clients' data: a dataset's samples cut among clients, as experiments on non-IID data do — a seeded
//! shuffle into near-equal parts, each class spread by proportions drawn from a Dirichlet distribution (Hsu et
//! al., 2019), or label-sorted shards (McMahan et al., 2017). Every draw comes from this crate's own generator
//! keyed by the seed, so every process cuts alike.

use crate::error::invalid;
use crate::rng::SplitMix64;
use crate::{Result, rng};

/// How samples are cut among clients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cut {
    Iid,
    /// Concentration α over the labels: small is far from IID.
    Dirichlet(f64),
    /// Shards a client: the samples sorted by label, cut into `clients × shards` shards.
    Shards(usize),
}

/// Each client's sample indices, from the samples' `labels` (classes `0..classes`). Errors: no clients, fewer
/// samples than clients, a bad α or shard count, a label outside the classes.
pub fn cut(labels: &[u32], classes: usize, clients: usize, how: Cut, seed: u64) -> Result<Vec<Vec<usize>>> {
    let n = labels.len();
    if clients == 0 || n < clients {
        return Err(invalid("clients", format!("{clients} clients for {n} samples")));
    }
    if let Some(bad) = labels.iter().find(|&&l| l as usize >= classes) {
        return Err(invalid("clients", format!("label {bad} is not below the {classes} classes")));
    }
    let mut parts = vec![Vec::new(); clients];
    match how {
        Cut::Iid => {
            let order = rng::permutation(n, &[seed, 0x11d]);
            for (i, &s) in order.iter().enumerate() {
                parts[i * clients / n].push(s);
            }
        }
        Cut::Dirichlet(alpha) => {
            if !(alpha.is_finite() && alpha > 0.0) {
                return Err(invalid("alpha", format!("{alpha} is not > 0")));
            }
            let mut g = SplitMix64::from_key(&[seed, 0xd1c]);
            for class in 0..classes {
                let mut members: Vec<usize> = (0..n).filter(|&i| labels[i] as usize == class).collect();
                let order = rng::permutation(members.len(), &[seed, class as u64, 0xc1a]);
                members = order.iter().map(|&k| members[k]).collect();
                let draws: Vec<f64> = (0..clients).map(|_| gamma(&mut g, alpha)).collect();
                let total: f64 = draws.iter().sum::<f64>().max(f64::MIN_POSITIVE);
                let mut cum = 0f64;
                let mut start = 0usize;
                for (c, d) in draws.iter().enumerate() {
                    cum += d / total;
                    let end = if c + 1 == clients {
                        members.len()
                    } else {
                        ((cum * members.len() as f64) as usize).min(members.len())
                    };
                    parts[c].extend_from_slice(&members[start..end.max(start)]);
                    start = end.max(start);
                }
            }
        }
        Cut::Shards(per) => {
            let count = clients * per;
            if per == 0 || count > n {
                return Err(invalid(
                    "shards_per_client",
                    format!("{per} shards for each of {clients} clients of {n} samples"),
                ));
            }
            let mut sorted: Vec<usize> = (0..n).collect();
            sorted.sort_by_key(|&i| (labels[i], i));
            let order = rng::permutation(count, &[seed, 0x5a4d]);
            for (k, &shard) in order.iter().enumerate() {
                let (a, b) = (shard * n / count, (shard + 1) * n / count);
                parts[k / per].extend_from_slice(&sorted[a..b]);
            }
        }
    }
    Ok(parts)
}

/// Each client's count of each class.
pub fn histogram(parts: &[Vec<usize>], labels: &[u32], classes: usize) -> Vec<Vec<usize>> {
    parts
        .iter()
        .map(|p| {
            let mut h = vec![0; classes];
            for &i in p {
                if let Some(c) = labels.get(i).and_then(|&l| h.get_mut(l as usize)) {
                    *c += 1;
                }
            }
            h
        })
        .collect()
}

/// A Gamma(`shape`, 1) draw (Marsaglia and Tsang; below shape 1 by the boost `Gamma(a+1) · U^(1/a)`).
fn gamma(g: &mut SplitMix64, shape: f64) -> f64 {
    if shape < 1.0 {
        let u = g.unit_f64().max(f64::MIN_POSITIVE);
        return gamma(g, shape + 1.0) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = g.normal();
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = g.unit_f64();
        if u < 1.0 - 0.0331 * x.powi(4) || u.ln() < 0.5 * x * x + d * (1.0 - v + v.ln()) {
            return d * v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels() -> Vec<u32> {
        (0..1000u32).map(|i| i % 10).collect()
    }

    fn covers_once(parts: &[Vec<usize>], n: usize) -> bool {
        let mut seen = vec![0u8; n];
        parts.iter().flatten().for_each(|&i| seen[i] += 1);
        seen.iter().all(|&s| s == 1)
    }

    #[test]
    fn every_cut_gives_every_sample_to_one_client() -> Result<()> {
        let l = labels();
        for how in [Cut::Iid, Cut::Dirichlet(0.5), Cut::Dirichlet(0.1), Cut::Shards(2)] {
            let parts = cut(&l, 10, 20, how, 7)?;
            assert_eq!(parts.len(), 20);
            assert!(covers_once(&parts, l.len()), "{how:?}");
            assert_eq!(parts, cut(&l, 10, 20, how, 7)?, "{how:?}: the same cut for the same seed");
        }
        Ok(())
    }

    #[test]
    fn smaller_alpha_and_shards_are_further_from_iid() -> Result<()> {
        let l = labels();
        // The mean over clients of the share of their largest class.
        let skew = |how| -> Result<f64> {
            let h = histogram(&cut(&l, 10, 20, how, 3)?, &l, 10);
            let shares: Vec<f64> = h
                .iter()
                .filter(|c| c.iter().sum::<usize>() > 0)
                .map(|c| *c.iter().max().unwrap_or(&0) as f64 / c.iter().sum::<usize>() as f64)
                .collect();
            Ok(shares.iter().sum::<f64>() / shares.len() as f64)
        };
        let (iid, half, tenth, shards) =
            (skew(Cut::Iid)?, skew(Cut::Dirichlet(0.5))?, skew(Cut::Dirichlet(0.1))?, skew(Cut::Shards(2))?);
        assert!(iid < 0.25 && iid < half && half < tenth, "iid {iid}, α 0.5 {half}, α 0.1 {tenth}");
        assert!(shards >= 0.5, "two label-sorted shards: at most two classes, {shards}");
        assert!(cut(&l, 10, 2000, Cut::Iid, 0).is_err() && cut(&l, 10, 20, Cut::Dirichlet(0.0), 0).is_err());
        Ok(())
    }

    #[test]
    fn gamma_draws_have_their_mean() {
        let mut g = SplitMix64::from_key(&[1]);
        for shape in [0.1, 0.5, 1.0, 3.0] {
            let mean = (0..20_000).map(|_| gamma(&mut g, shape)).sum::<f64>() / 20_000.0;
            assert!((mean - shape).abs() < 0.05 * shape.max(1.0), "Gamma({shape}) mean {mean}");
        }
    }
}
