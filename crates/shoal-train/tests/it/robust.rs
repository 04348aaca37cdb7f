//! `[robust]` under DDP: the ranks' buckets all-gathered and combined by a robust rule. The mean is the sum DDP
//! computes, to rounding; every rule keeps the ranks' parameters identical (checked by the runs' helpers) and
//! trains.

use shoal_ps::{Attack, Rule};
use shoal_train::Real;

use crate::equivalence::{Run, train_world_with_losses};

fn run(robust: Option<(Rule, usize)>) -> Run {
    Run { robust, ..Run::mlp(30, 60, 2) }
}

/// The largest difference over the largest value, tensor by tensor.
fn worst(a: &[(String, Vec<Real>)], b: &[(String, Vec<Real>)]) -> Real {
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| {
            let scale = y.iter().fold(0.0 as Real, |m, v| m.max(v.abs())).max(1e-12);
            x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0 as Real, Real::max) / scale
        })
        .fold(0.0 as Real, Real::max)
}

#[test]
fn the_robust_mean_is_the_sum_ddp_computes() {
    let (plain, plain_losses) = train_world_with_losses(run(None), 3, None);
    let (mean, mean_losses) = train_world_with_losses(run(Some((Rule::Mean, 0))), 3, None);
    let w = worst(&mean.params, &plain.params);
    assert!(w <= 1e-5, "the mean of the gathered buckets drifts {w:e} from their sum");
    for (a, b) in mean_losses.iter().zip(&plain_losses) {
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} against {b}");
    }
}

#[test]
fn every_robust_rule_keeps_the_ranks_identical_and_trains() {
    let (_, plain) = train_world_with_losses(run(None), 5, None);
    let last = |l: &[Real]| l[l.len() - 5..].iter().sum::<Real>() / 5.0;
    let first = |l: &[Real]| l[..5].iter().sum::<Real>() / 5.0;
    for rule in [Rule::Median, Rule::TrimmedMean, Rule::Krum, Rule::MultiKrum, Rule::GeoMed] {
        // `train_world_with_losses` checks that every rank ends with the same parameters.
        let (_, losses) = train_world_with_losses(run(Some((rule, 1))), 5, None);
        let (l0, l1) = (first(&losses), last(&losses));
        // Krum follows one rank's gradient, a fifth of the batch: it learns, more slowly.
        let fall = if rule == Rule::Krum { 0.85 } else { 0.6 };
        assert!(l1 < l0 * fall, "{}: the loss fell from {l0} to {l1} only", rule.name());
        eprintln!("{}: the loss fell from {l0} to {l1} (plain DDP: to {})", rule.name(), last(&plain));
        // Honest ranks only: the rule lands near the sum.
        assert!(l1 < last(&plain) * 2.0 + 0.05, "{}: {l1} against plain DDP's {}", rule.name(), last(&plain));
    }
}

/// One sign-flipping attacker (×10) of five: the mean is dragged up the loss; the median, the trimmed mean, Krum
/// and the geometric median train on.
#[test]
fn one_sign_flipper_of_five_defeats_the_mean_and_not_the_robust_rules() {
    let flip = Some((Attack::SignFlip { scale: 10.0 }, 4));
    let (_, plain) = train_world_with_losses(run(None), 5, None);
    let last = |l: &[Real]| l[l.len() - 5..].iter().sum::<Real>() / 5.0;
    let (_, mean) = train_world_with_losses(Run { attack: flip, ..run(Some((Rule::Mean, 0))) }, 5, None);
    let held = last(&mean).partial_cmp(&mean[0]).is_none_or(|o| o != std::cmp::Ordering::Less);
    assert!(held, "the mean still learned under the attack: {} from {}", last(&mean), mean[0]);
    for rule in [Rule::Median, Rule::TrimmedMean, Rule::Krum, Rule::GeoMed] {
        let (_, losses) = train_world_with_losses(Run { attack: flip, ..run(Some((rule, 1))) }, 5, None);
        let l1 = last(&losses);
        eprintln!(
            "{} under a sign flipper: {} to {l1} (plain DDP, no attacker: {})",
            rule.name(),
            losses[0],
            last(&plain)
        );
        assert!(l1 < losses[0] * 0.85 && l1 < last(&plain) * 2.0 + 0.05, "{}: to {l1}", rule.name());
    }
}
