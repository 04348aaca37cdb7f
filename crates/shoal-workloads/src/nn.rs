//! The little the workloads' networks need, on one flat buffer of parameters laid out as the parameter servers see
//! it: named tensors one after another ([`Layout`]), dense layers that read their weights from it and add their
//! gradients into a buffer of the same layout ([`Dense`]), and seeded initial values.

use shoal_data::rng::SplitMix64;
use shoal_ps::Tensor;

/// Named tensors laid one after another in one flat buffer.
#[derive(Debug, Clone, Default)]
pub struct Layout {
    pub tensors: Vec<Tensor>,
}

impl Layout {
    /// Adds a tensor of `rows` rows of `row` values; returns where it starts.
    pub fn add(&mut self, name: &str, rows: usize, row: usize) -> usize {
        let start = self.len();
        self.tensors.push(Tensor { name: name.to_owned(), len: rows * row, row });
        start
    }

    /// Adds a dense layer `inp -> out`: its weight (`inp` rows of `out`) and its bias.
    pub fn dense(&mut self, name: &str, inp: usize, out: usize) -> Dense {
        let w = self.add(&format!("{name}.weight"), inp, out);
        let b = self.add(&format!("{name}.bias"), 1, out);
        Dense { inp, out, w, b }
    }

    /// Values in all.
    pub fn len(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A dense layer `y = x W + b` whose weight (`inp × out`, row-major) and bias live at `w` and `b` in the flat
/// parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dense {
    pub inp: usize,
    pub out: usize,
    pub w: usize,
    pub b: usize,
}

impl Dense {
    /// PyTorch's default initial values: weight and bias uniform in `±1/√inp`.
    pub fn init(&self, p: &mut [f32], rng: &mut SplitMix64) {
        let bound = 1.0 / (self.inp as f64).sqrt();
        for x in &mut p[self.w..self.w + self.inp * self.out] {
            *x = ((rng.unit_f64() * 2.0 - 1.0) * bound) as f32;
        }
        for x in &mut p[self.b..self.b + self.out] {
            *x = ((rng.unit_f64() * 2.0 - 1.0) * bound) as f32;
        }
    }

    /// `y = x W + b` for every row of `x` (`rows × inp`) into `y` (`rows × out`).
    pub fn forward(&self, p: &[f32], x: &[f32], y: &mut [f32]) {
        let (w, b) = (&p[self.w..self.w + self.inp * self.out], &p[self.b..self.b + self.out]);
        for (xr, yr) in x.chunks_exact(self.inp).zip(y.chunks_exact_mut(self.out)) {
            yr.copy_from_slice(b);
            for (&xi, wr) in xr.iter().zip(w.chunks_exact(self.out)) {
                if xi != 0.0 {
                    yr.iter_mut().zip(wr).for_each(|(y, &w)| *y += xi * w);
                }
            }
        }
    }

    /// The gradients of a loss with respect to the layer's weight and bias, from its input `x` and the loss's
    /// gradient `dy` with respect to its output, added into `g` (laid out as the parameters); and with respect to
    /// the input into `dx` when given.
    pub fn backward(&self, p: &[f32], x: &[f32], dy: &[f32], g: &mut [f32], dx: Option<&mut [f32]>) {
        let (inp, out) = (self.inp, self.out);
        {
            let (gw, rest) = g[self.w..].split_at_mut(inp * out);
            let gb = &mut rest[self.b - self.w - inp * out..][..out];
            for (xr, dyr) in x.chunks_exact(inp).zip(dy.chunks_exact(out)) {
                gb.iter_mut().zip(dyr).for_each(|(g, &d)| *g += d);
                for (&xi, gwr) in xr.iter().zip(gw.chunks_exact_mut(out)) {
                    if xi != 0.0 {
                        gwr.iter_mut().zip(dyr).for_each(|(g, &d)| *g += xi * d);
                    }
                }
            }
        }
        if let Some(dx) = dx {
            let w = &p[self.w..self.w + inp * out];
            for (dxr, dyr) in dx.chunks_exact_mut(inp).zip(dy.chunks_exact(out)) {
                for (d, wr) in dxr.iter_mut().zip(w.chunks_exact(out)) {
                    *d = wr.iter().zip(dyr).map(|(&w, &g)| w * g).sum();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layer's gradients against central differences of `sum(y · c)`.
    #[test]
    fn dense_backward_matches_finite_differences() {
        let mut layout = Layout::default();
        let d = layout.dense("l", 3, 2);
        assert_eq!((d.w, d.b, layout.len()), (0, 6, 8));
        let mut rng = SplitMix64::from_key(&[7]);
        let mut p = vec![0f32; layout.len()];
        d.init(&mut p, &mut rng);
        let x = [0.5f32, -1.0, 2.0, 1.5, 0.25, -0.75];
        let c = [1.0f32, -2.0, 0.5, 3.0];
        let loss = |p: &[f32], x: &[f32]| {
            let mut y = [0f32; 4];
            d.forward(p, x, &mut y);
            y.iter().zip(&c).map(|(y, c)| f64::from(y * c)).sum::<f64>()
        };
        let mut g = vec![0f32; layout.len()];
        let mut dx = [0f32; 6];
        d.backward(&p, &x, &c, &mut g, Some(&mut dx));
        let h = 1e-2f32;
        for i in 0..p.len() {
            let (mut a, mut b) = (p.clone(), p.clone());
            a[i] += h;
            b[i] -= h;
            let fd = (loss(&a, &x) - loss(&b, &x)) / (2.0 * f64::from(h));
            assert!((fd - f64::from(g[i])).abs() < 1e-3, "parameter {i}: {fd} vs {}", g[i]);
        }
        for i in 0..x.len() {
            let (mut a, mut b) = (x, x);
            a[i] += h;
            b[i] -= h;
            let fd = (loss(&p, &a) - loss(&p, &b)) / (2.0 * f64::from(h));
            assert!((fd - f64::from(dx[i])).abs() < 1e-3, "input {i}: {fd} vs {}", dx[i]);
        }
    }
}
