//! Small statistics shared by every crate above this one (the trainer's step-time summary, the benchmarks, the
//! control plane's diagnosis), kept here because they all depend on this crate.

/// The median of `values`, NaNs left out: the middle value, or the mean of the two middle ones for an even count;
/// `None` when nothing is left.
pub fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn medians() {
        assert_eq!(median([]), None);
        assert_eq!(median([f64::NAN]), None);
        assert_eq!(median([3.0]), Some(3.0));
        assert_eq!(median([3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median([4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median([1.0, f64::NAN, 5.0, 3.0]), Some(3.0));
        assert_eq!(median([1.0, f64::INFINITY, 2.0]), Some(2.0));
        assert_eq!(median(vec![-1.0, -3.0]), Some(-2.0));
    }
}
