//! Differential privacy of federated rounds: the Rényi-DP accountant of the Poisson-subsampled Gaussian mechanism
//! (Mironov, Talwar and Zhang, 2019), for integer orders, and its conversion to (ε, δ)-DP.
//!
//! A round samples each client with probability `q`, clips each sampled client's update to L2 norm `C`, and adds
//! Gaussian noise of standard deviation `σ·C` to their sum. At integer order α its RDP is
//! `log(A_α) / (α − 1)` with `A_α = Σ_k C(α,k) (1−q)^(α−k) q^k exp((k² − k) / (2σ²))`; `T` rounds compose to `T` times
//! that, and ε for a δ is the least over the orders of `T·RDP(α) + log((α−1)/α) − (log δ + log α) / (α − 1)`
//! (the conversion of Balle et al., 2020, which Opacus also uses).

/// The orders the accountant tries.
const ORDERS: std::ops::RangeInclusive<u32> = 2..=256;

/// `log(exp(a) + exp(b))` without overflow.
fn log_add(a: f64, b: f64) -> f64 {
    let (hi, lo) = if a > b { (a, b) } else { (b, a) };
    if lo == f64::NEG_INFINITY { hi } else { hi + (lo - hi).exp().ln_1p() }
}

/// `log C(n, k)`.
fn log_binomial(n: u32, k: u32) -> f64 {
    let lg = |m: u32| (1..=m).map(|i| f64::from(i).ln()).sum::<f64>();
    lg(n) - lg(k) - lg(n - k)
}

/// The RDP at integer order `alpha` ≥ 2 of one round: sampling rate `q`, noise multiplier `sigma`.
pub fn rdp(q: f64, sigma: f64, alpha: u32) -> f64 {
    if q <= 0.0 {
        return 0.0;
    }
    let a = f64::from(alpha);
    if q >= 1.0 {
        return a / (2.0 * sigma * sigma);
    }
    let mut log_a = f64::NEG_INFINITY;
    for k in 0..=alpha {
        let kf = f64::from(k);
        let term =
            log_binomial(alpha, k) + (a - kf) * (1.0 - q).ln() + kf * q.ln() + (kf * kf - kf) / (2.0 * sigma * sigma);
        log_a = log_add(log_a, term);
    }
    log_a / (a - 1.0)
}

/// ε spent after `rounds` rounds at `delta`, and the order that gives it.
pub fn epsilon(q: f64, sigma: f64, rounds: u64, delta: f64) -> (f64, u32) {
    let mut best = (f64::INFINITY, 2);
    for alpha in ORDERS {
        let a = f64::from(alpha);
        let eps = rounds as f64 * rdp(q, sigma, alpha) + ((a - 1.0) / a).ln() - (delta.ln() + a.ln()) / (a - 1.0);
        if eps < best.0 {
            best = (eps.max(0.0), alpha);
        }
    }
    best
}

/// The least noise multiplier (to 0.1% of it) whose ε after `rounds` rounds stays within `target` at `delta`;
/// `None` when none up to 1,000 does.
pub fn sigma_for(target: f64, q: f64, rounds: u64, delta: f64) -> Option<f64> {
    let (mut lo, mut hi) = (0.05, 1000.0);
    if epsilon(q, hi, rounds, delta).0 > target {
        return None;
    }
    while hi - lo > 1e-3 * lo {
        let mid = 0.5 * (lo + hi);
        if epsilon(q, mid, rounds, delta).0 > target { lo = mid } else { hi = mid }
    }
    Some(hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `A_α` by numerical integration of `E_{z~N(0,σ²)}[((1−q) + q·exp((2z − 1)/(2σ²)))^α]`: the same mechanism
    /// computed independently of the binomial sum.
    fn a_by_quadrature(q: f64, sigma: f64, alpha: u32) -> f64 {
        let (lo, hi, n) = (-40.0 * sigma - 10.0, 40.0 * sigma + 10.0, 400_000);
        let h = (hi - lo) / f64::from(n);
        let mut sum = 0.0;
        for i in 0..=n {
            let z = lo + h * f64::from(i);
            let density = (-(z * z) / (2.0 * sigma * sigma)).exp() / (sigma * (2.0 * std::f64::consts::PI).sqrt());
            let ratio = (1.0 - q) + q * ((2.0 * z - 1.0) / (2.0 * sigma * sigma)).exp();
            let w = if i == 0 || i == n { 0.5 } else { 1.0 };
            sum += w * density * ratio.powi(alpha as i32);
        }
        sum * h
    }

    #[test]
    fn the_rdp_matches_an_independent_integration_within_a_percent() {
        for (q, sigma) in [(0.5, 1.1), (0.1, 0.8), (0.01, 1.5), (0.05, 4.0)] {
            for alpha in [2u32, 4, 8, 16, 32] {
                let ours = rdp(q, sigma, alpha);
                let theirs = a_by_quadrature(q, sigma, alpha).ln() / f64::from(alpha - 1);
                if theirs.is_finite() && theirs > 1e-9 {
                    let rel = (ours - theirs).abs() / theirs;
                    assert!(rel < 0.01, "q {q} σ {sigma} α {alpha}: {ours} against {theirs} ({rel})");
                }
            }
        }
        // Without sampling, the Gaussian mechanism's own α/(2σ²).
        assert!((rdp(1.0, 2.0, 8) - 1.0).abs() < 1e-12);
        assert!((a_by_quadrature(1.0, 2.0, 8).ln() / 7.0 - 1.0).abs() < 1e-3);
    }

    #[test]
    fn epsilon_grows_with_rounds_and_falls_with_noise_and_the_calibration_meets_its_target() {
        let (e1, _) = epsilon(0.5, 1.0, 10, 1e-5);
        let (e2, _) = epsilon(0.5, 1.0, 40, 1e-5);
        let (e3, _) = epsilon(0.5, 2.0, 40, 1e-5);
        assert!(e1 < e2 && e3 < e2, "{e1} {e2} {e3}");
        let sigma = sigma_for(8.0, 0.5, 40, 1e-5).unwrap_or(f64::NAN);
        let (eps, _) = epsilon(0.5, sigma, 40, 1e-5);
        assert!(eps <= 8.0 && eps > 7.9, "σ {sigma} gives ε {eps}");
        assert!(sigma_for(1e-9, 1.0, 1000, 1e-5).is_none());
    }
}
