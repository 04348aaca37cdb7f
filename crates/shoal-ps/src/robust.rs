//! Robust aggregation: combining `n` workers' gradients (or updates) when up to `f` of them may send anything at
//! all. Each rule names the least `n` it needs for `f` ([`Rule::least_workers`]); asked for more than it can bear
//! it refuses, rather than give an answer the attackers chose.
//!
//! - `mean`: the plain average, what data parallelism computes; no attacker is tolerated.
//! - `median`: coordinate by coordinate, the median (the mean of the two middle values when `n` is even).
//! - `trimmed_mean`: coordinate by coordinate, the mean of what is left once the `f` largest and `f` smallest are
//!   dropped.
//! - `krum` (Blanchard et al., 2017): the one input whose summed squared distance to its `n - f - 2` nearest
//!   others is least.
//! - `multi_krum`: the mean of the `n - f` inputs of least Krum score.
//! - `geomed`: the geometric median (the point of least summed distance to the inputs) by Weiszfeld's iteration
//!   from the coordinate-wise median.
//!
//! A value that is not finite is an attacker's: the coordinate-wise rules sort it to an end, where the trimming
//! takes it; Krum and the geometric median count an input holding one as infinitely far from every other.
//! Sums run in `f64`.

use crate::error::{PsError, Result};
use crate::optim::Real;

/// A robust aggregation rule (`robust.rule` in a job spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    Mean,
    Median,
    TrimmedMean,
    Krum,
    MultiKrum,
    GeoMed,
}

impl Rule {
    /// The name a job spec gives it.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Mean => "mean",
            Rule::Median => "median",
            Rule::TrimmedMean => "trimmed_mean",
            Rule::Krum => "krum",
            Rule::MultiKrum => "multi_krum",
            Rule::GeoMed => "geomed",
        }
    }

    /// The rule of that name.
    pub fn parse(name: &str) -> Option<Rule> {
        [Rule::Mean, Rule::Median, Rule::TrimmedMean, Rule::Krum, Rule::MultiKrum, Rule::GeoMed]
            .into_iter()
            .find(|r| r.name() == name)
    }

    /// The fewest inputs with which the rule bears `f` attackers (the mean bears none).
    pub fn least_workers(self, f: usize) -> usize {
        match self {
            Rule::Mean => 1,
            Rule::Median | Rule::GeoMed => 2 * f + 1,
            Rule::TrimmedMean => 2 * f + 1,
            Rule::Krum | Rule::MultiKrum => 2 * f + 3,
        }
    }

    /// Whether `n` inputs suffice for `f` attackers, with the reason when not.
    pub fn check(self, n: usize, f: usize) -> Result<()> {
        if self == Rule::Mean && f > 0 {
            return Err(PsError::InvalidArgument(format!(
                "the mean tolerates no attacker; f = {f} needs a robust rule (median, trimmed_mean, krum, multi_krum, \
                 geomed)"
            )));
        }
        let least = self.least_workers(f);
        if n < least {
            return Err(PsError::InvalidArgument(format!(
                "{} with f = {f} needs at least {least} workers, not {n}",
                self.name()
            )));
        }
        Ok(())
    }
}

/// Combines `inputs` (one buffer per worker, all as long as `out`) by `rule` bearing up to `f` attackers, into
/// `out`.
pub fn aggregate<R: Real>(rule: Rule, f: usize, inputs: &[&[R]], out: &mut [R]) -> Result<()> {
    let n = inputs.len();
    rule.check(n, f)?;
    if let Some((k, x)) = inputs.iter().enumerate().find(|(_, x)| x.len() != out.len()) {
        return Err(PsError::InvalidArgument(format!("input {k} has {} values, the others {}", x.len(), out.len())));
    }
    match rule {
        Rule::Mean => {
            for (j, o) in out.iter_mut().enumerate() {
                *o = R::of(inputs.iter().map(|x| x[j].wide()).sum::<f64>() / n as f64);
            }
        }
        Rule::Median => coordinate_wise(inputs, out, |v| {
            let m = v.len() / 2;
            if v.len() % 2 == 1 { v[m] } else { (v[m - 1] + v[m]) / 2.0 }
        }),
        Rule::TrimmedMean => coordinate_wise(inputs, out, |v| {
            let kept = &v[f..v.len() - f];
            kept.iter().sum::<f64>() / kept.len() as f64
        }),
        Rule::Krum => {
            let scores = krum_scores(inputs, f);
            let best = order(&scores).first().copied().unwrap_or(0);
            out.copy_from_slice(inputs[best]);
        }
        Rule::MultiKrum => {
            let scores = krum_scores(inputs, f);
            let chosen: Vec<usize> = order(&scores).into_iter().take(n - f).collect();
            for (j, o) in out.iter_mut().enumerate() {
                *o = R::of(chosen.iter().map(|&k| inputs[k][j].wide()).sum::<f64>() / chosen.len() as f64);
            }
        }
        Rule::GeoMed => geometric_median(inputs, out),
    }
    Ok(())
}

/// `pick` of each coordinate's values, sorted (non-finite values at the ends: `f64::total_cmp` with NaN as
/// infinity of its sign).
fn coordinate_wise<R: Real>(inputs: &[&[R]], out: &mut [R], pick: impl Fn(&[f64]) -> f64) {
    let mut v = vec![0f64; inputs.len()];
    for (j, o) in out.iter_mut().enumerate() {
        for (slot, x) in v.iter_mut().zip(inputs) {
            let x = x[j].wide();
            *slot = if x.is_nan() { f64::INFINITY.copysign(x) } else { x };
        }
        v.sort_by(f64::total_cmp);
        *o = R::of(pick(&v));
    }
}

/// Whether every value of `x` is finite.
fn finite<R: Real>(x: &[R]) -> bool {
    x.iter().all(|v| v.wide().is_finite())
}

/// Squared distance between `a` and `b` (infinite when either holds a value that is not).
fn distance2<R: Real>(a: &[R], b: &[R]) -> f64 {
    if !finite(a) || !finite(b) {
        return f64::INFINITY;
    }
    a.iter().zip(b).map(|(x, y)| (x.wide() - y.wide()).powi(2)).sum()
}

/// Each input's Krum score: its summed squared distance to its `n - f - 2` nearest others.
fn krum_scores<R: Real>(inputs: &[&[R]], f: usize) -> Vec<f64> {
    let n = inputs.len();
    let near = n.saturating_sub(f + 2).max(1);
    let mut d = vec![vec![0f64; n]; n];
    for i in 0..n {
        for j in i + 1..n {
            let x = distance2(inputs[i], inputs[j]);
            d[i][j] = x;
            d[j][i] = x;
        }
    }
    d.iter()
        .enumerate()
        .map(|(i, row)| {
            let mut others: Vec<f64> = row.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, x)| *x).collect();
            others.sort_by(f64::total_cmp);
            others.iter().take(near).sum()
        })
        .collect()
}

/// Indices by increasing score (ties: the lower index first).
fn order(scores: &[f64]) -> Vec<usize> {
    let mut k: Vec<usize> = (0..scores.len()).collect();
    k.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
    k
}

/// Weiszfeld's iteration for the geometric median of the finite inputs, from their coordinate-wise median, until
/// a step moves less than 1e-7 of the point's size (at most 200 steps).
fn geometric_median<R: Real>(inputs: &[&[R]], out: &mut [R]) {
    let good: Vec<&[R]> = inputs.iter().copied().filter(|x| finite(x)).collect();
    if good.is_empty() {
        out.iter_mut().for_each(|o| *o = R::of(f64::NAN));
        return;
    }
    coordinate_wise(&good, out, |v| {
        let m = v.len() / 2;
        if v.len() % 2 == 1 { v[m] } else { (v[m - 1] + v[m]) / 2.0 }
    });
    let mut z: Vec<f64> = out.iter().map(|&v| v.wide()).collect();
    let mut next = vec![0f64; z.len()];
    for _ in 0..200 {
        next.iter_mut().for_each(|v| *v = 0.0);
        let mut weights = 0f64;
        for x in &good {
            let d = x.iter().zip(&z).map(|(a, b)| (a.wide() - b).powi(2)).sum::<f64>().sqrt();
            // On an input itself: weigh it heavily rather than divide by zero.
            let w = 1.0 / d.max(1e-12);
            weights += w;
            next.iter_mut().zip(x.iter()).for_each(|(s, a)| *s += w * a.wide());
        }
        next.iter_mut().for_each(|v| *v /= weights);
        let moved = next.iter().zip(&z).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt();
        let size = z.iter().map(|v| v * v).sum::<f64>().sqrt();
        std::mem::swap(&mut z, &mut next);
        if moved <= 1e-7 * (1.0 + size) {
            break;
        }
    }
    out.iter_mut().zip(&z).for_each(|(o, v)| *o = R::of(*v));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(rule: Rule, f: usize, inputs: &[Vec<f32>]) -> Result<Vec<f32>> {
        let views: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
        let mut out = vec![0f32; inputs.first().map_or(0, Vec::len)];
        aggregate(rule, f, &views, &mut out)?;
        Ok(out)
    }

    #[test]
    fn coordinate_wise_rules_give_their_known_answers() -> Result<()> {
        let x = vec![vec![1.0, 5.0], vec![2.0, -1.0], vec![100.0, 3.0]];
        assert_eq!(run(Rule::Median, 1, &x)?, vec![2.0, 3.0]);
        assert_eq!(run(Rule::Mean, 0, &x)?, vec![103.0 / 3.0, 7.0 / 3.0]);
        let y = vec![vec![1.0], vec![2.0], vec![3.0], vec![100.0]];
        assert_eq!(run(Rule::Median, 1, &y)?, vec![2.5]);
        assert_eq!(run(Rule::TrimmedMean, 1, &y)?, vec![2.5]);
        let z = vec![vec![1.0], vec![2.0], vec![4.0], vec![-50.0], vec![90.0]];
        assert_eq!(run(Rule::TrimmedMean, 1, &z)?, vec![7.0 / 3.0]);
        assert_eq!(run(Rule::TrimmedMean, 2, &z)?, vec![2.0]);
        Ok(())
    }

    #[test]
    fn krum_picks_from_the_cluster_and_multi_krum_averages_it() -> Result<()> {
        // Four honest inputs close together and one far away; f = 1 keeps n - f - 2 = 2 neighbours.
        let x = vec![vec![0.0, 0.0], vec![1.0, 0.0], vec![0.0, 1.0], vec![1.0, 1.0], vec![50.0, -40.0]];
        // Scores: each corner's two nearest are at distance² 1 and 1: all four score 2; the lowest index wins.
        assert_eq!(run(Rule::Krum, 1, &x)?, vec![0.0, 0.0]);
        assert_eq!(run(Rule::MultiKrum, 1, &x)?, vec![0.5, 0.5]);
        Ok(())
    }

    #[test]
    fn the_geometric_median_of_an_equilateral_triangle_is_its_centre() -> Result<()> {
        let h = 3f32.sqrt();
        let x = vec![vec![0.0, 0.0], vec![2.0, 0.0], vec![1.0, h]];
        let g = run(Rule::GeoMed, 1, &x)?;
        assert!((g[0] - 1.0).abs() < 1e-4 && (g[1] - h / 3.0).abs() < 1e-4, "{g:?}");
        // On a line, the median point.
        assert_eq!(run(Rule::GeoMed, 1, &[vec![1.0], vec![2.0], vec![100.0]])?, vec![2.0]);
        Ok(())
    }

    #[test]
    fn an_attacker_sending_non_finite_values_is_borne_by_every_robust_rule() -> Result<()> {
        let honest = [vec![1.0f32, 2.0], vec![1.5, 2.5], vec![2.0, 1.5], vec![1.2, 2.2]];
        for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x: Vec<Vec<f32>> = honest.to_vec();
            x.push(vec![bad, 1.0]);
            for rule in [Rule::Median, Rule::TrimmedMean, Rule::Krum, Rule::MultiKrum, Rule::GeoMed] {
                let got = run(rule, 1, &x)?;
                let inside = got.iter().zip([1.0..=2.0, 1.0..=2.5]).all(|(v, r)| r.contains(v));
                assert!(inside, "{} with {bad}: {got:?}", rule.name());
            }
            assert!(!finite(&run(Rule::Mean, 0, &x)?), "the mean takes the attacker's value");
        }
        Ok(())
    }

    #[test]
    fn too_many_attackers_and_uneven_inputs_are_refused() {
        let x = vec![vec![1.0f32]; 4];
        let refuse = |rule: Rule, f: usize| run(rule, f, &x).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refuse(Rule::Krum, 1).contains("krum with f = 1 needs at least 5 workers, not 4"));
        assert!(refuse(Rule::Median, 2).contains("at least 5"));
        assert!(refuse(Rule::TrimmedMean, 2).contains("trimmed_mean"));
        assert!(refuse(Rule::Mean, 1).contains("tolerates no attacker"));
        assert!(run(Rule::Median, 1, &x).is_ok());
        let uneven = vec![vec![1.0f32, 2.0], vec![1.0], vec![3.0, 4.0]];
        assert!(run(Rule::Median, 1, &uneven).is_err());
        assert_eq!(Rule::parse("multi_krum"), Some(Rule::MultiKrum));
        assert_eq!(Rule::parse("average"), None);
    }
}
