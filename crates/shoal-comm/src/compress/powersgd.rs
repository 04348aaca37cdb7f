//! PowerSGD's linear algebra on row-major `f32` buffers: one step of subspace iteration per training step
//! (`P = M Q`, `P` orthonormalised, `Q = Mᵀ P`), so `P Qᵀ` is the projection of `M` onto a rank-`r` subspace that
//! follows the gradients from step to step (Vogels et al., 2019).

/// `p (rows × r) = m (rows × cols) · q (cols × r)`.
pub fn m_times_q(m: &[f32], rows: usize, cols: usize, q: &[f32], r: usize, p: &mut [f32]) {
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        let out = &mut p[i * r..(i + 1) * r];
        out.fill(0.0);
        for (j, x) in row.iter().enumerate() {
            let qj = &q[j * r..(j + 1) * r];
            for (o, y) in out.iter_mut().zip(qj) {
                *o += x * y;
            }
        }
    }
}

/// `q (cols × r) = mᵀ (cols × rows) · p (rows × r)`.
pub fn mt_times_p(m: &[f32], rows: usize, cols: usize, p: &[f32], r: usize, q: &mut [f32]) {
    q.fill(0.0);
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        let pi = &p[i * r..(i + 1) * r];
        for (j, x) in row.iter().enumerate() {
            let qj = &mut q[j * r..(j + 1) * r];
            for (o, y) in qj.iter_mut().zip(pi) {
                *o += x * y;
            }
        }
    }
}

/// Makes the `r` columns of `p` (rows × r) orthonormal by modified Gram–Schmidt, in f64. A column with nothing
/// left once the earlier ones are taken out (the matrix has lower rank) becomes zero rather than amplified noise.
pub fn orthonormalise(p: &mut [f32], rows: usize, r: usize) {
    let mut cols: Vec<Vec<f64>> = (0..r).map(|c| (0..rows).map(|i| f64::from(p[i * r + c])).collect()).collect();
    let scale = cols.iter().flatten().fold(0f64, |m, v| m.max(v.abs()));
    for c in 0..r {
        let (done, rest) = cols.split_at_mut(c);
        let col = &mut rest[0];
        for prev in done.iter() {
            let dot: f64 = prev.iter().zip(col.iter()).map(|(a, b)| a * b).sum();
            col.iter_mut().zip(prev).for_each(|(x, y)| *x -= dot * y);
        }
        let norm = col.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm > scale * 1e-6 && norm > 0.0 {
            col.iter_mut().for_each(|x| *x /= norm);
        } else {
            col.fill(0.0);
        }
    }
    for (c, col) in cols.iter().enumerate() {
        for (i, v) in col.iter().enumerate() {
            p[i * r + c] = *v as f32;
        }
    }
}

/// `out (rows × cols) += p · qᵀ` (`sign` -1: subtracts).
pub fn add_p_qt(out: &mut [f32], rows: usize, cols: usize, p: &[f32], q: &[f32], r: usize, sign: f32) {
    for i in 0..rows {
        let pi = &p[i * r..(i + 1) * r];
        let row = &mut out[i * cols..(i + 1) * cols];
        for (j, o) in row.iter_mut().enumerate() {
            let qj = &q[j * r..(j + 1) * r];
            let dot: f32 = pi.iter().zip(qj).map(|(a, b)| a * b).sum();
            *o += sign * dot;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compress::codec::SplitMix;

    #[test]
    fn one_iteration_recovers_a_matrix_of_rank_r_exactly() {
        let (rows, cols, r) = (40, 30, 3);
        let mut g = SplitMix::new(5);
        let a: Vec<f32> = (0..rows * r).map(|_| g.normal()).collect();
        let b: Vec<f32> = (0..cols * r).map(|_| g.normal()).collect();
        let mut m = vec![0f32; rows * cols];
        add_p_qt(&mut m, rows, cols, &a, &b, r, 1.0);
        let q0: Vec<f32> = (0..cols * r).map(|_| g.normal()).collect();
        let mut p = vec![0f32; rows * r];
        m_times_q(&m, rows, cols, &q0, r, &mut p);
        orthonormalise(&mut p, rows, r);
        let mut q = vec![0f32; cols * r];
        mt_times_p(&m, rows, cols, &p, r, &mut q);
        let mut back = vec![0f32; rows * cols];
        add_p_qt(&mut back, rows, cols, &p, &q, r, 1.0);
        let max = m.iter().fold(0f32, |x, v| x.max(v.abs()));
        for (x, y) in m.iter().zip(&back) {
            assert!((x - y).abs() <= max * 1e-5, "{x} {y}");
        }
    }

    #[test]
    fn orthonormal_columns_and_zero_for_a_dependent_one() {
        let (rows, r) = (6, 3);
        let mut p = vec![0f32; rows * r];
        for i in 0..rows {
            p[i * r] = i as f32 + 1.0;
            p[i * r + 1] = (i * i) as f32;
            p[i * r + 2] = 2.0 * (i as f32 + 1.0);
        }
        orthonormalise(&mut p, rows, r);
        let col = |c: usize| (0..rows).map(|i| p[i * r + c]).collect::<Vec<_>>();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        assert!((dot(&col(0), &col(0)) - 1.0).abs() < 1e-5);
        assert!((dot(&col(1), &col(1)) - 1.0).abs() < 1e-5);
        assert!(dot(&col(0), &col(1)).abs() < 1e-5);
        assert!(col(2).iter().all(|v| *v == 0.0), "{:?}", col(2));
    }
}
