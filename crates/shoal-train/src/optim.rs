//! Optimizers (SGD with momentum, AdamW) whose state is plain named tensors,
//! so it can be checkpointed and restored exactly; the learning-rate schedule
//! (linear warm-up, then cosine decay); global-norm gradient clipping.

use crate::{REAL_BYTES, REAL_DTYPE, Real};
use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::kernels::{cpu_f32, with_slice, with_slice_mut};
use crate::params::Params;

pub use shoal_ps::optim::{OptimConfig, update, update_flat};

/// The terms of an AdamW update `m/c1 / (√(v/c2) + ε)` ([`Optimizer::next_terms`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamTerms {
    pub beta1: Real,
    /// The bias corrections of the two moments.
    pub c1: Real,
    pub c2: Real,
    pub eps: Real,
    /// The most an AdamW step moves a value, in learning rates: `max(1, (1 - β1) / √(1 - β2))` (Kingma & Ba, §2.1).
    pub bound: Real,
}

/// An optimizer and its per-parameter state.
#[derive(Debug)]
pub struct Optimizer {
    cfg: OptimConfig,
    /// SGD: momentum buffers; AdamW: first moments.
    m: Vec<Option<Tensor>>,
    /// AdamW: second moments.
    v: Vec<Option<Tensor>>,
    /// Updates applied so far.
    pub t: u64,
    /// AdamW: the second moment takes no new squares ([`Optimizer::freeze_second_moment`]).
    frozen: bool,
    /// Skip an update whose gradients are not all finite ([`Optimizer::skip_nonfinite`]).
    skip_nonfinite: bool,
    /// The last update was skipped for that.
    skipped: bool,
}

impl Optimizer {
    pub fn new(cfg: OptimConfig, params: &Params) -> Optimizer {
        let n = params.vars().len();
        Optimizer {
            cfg,
            m: vec![None; n],
            v: vec![None; n],
            t: 0,
            frozen: false,
            skip_nonfinite: false,
            skipped: false,
        }
    }

    /// From now on (while `on`), an update whose gradients hold an infinity or a NaN changes nothing — neither the
    /// parameters, nor the state, nor the update count — and [`Self::take_skipped`] says so (f16 loss scaling).
    pub fn skip_nonfinite(&mut self, on: bool) {
        self.skip_nonfinite = on;
    }

    /// Whether the last update was skipped for non-finite gradients (and forgets it).
    pub fn take_skipped(&mut self) -> bool {
        std::mem::take(&mut self.skipped)
    }

    /// AdamW: from the next update on (while `frozen`), the second moment takes no new squares of gradients: its
    /// average goes on as if they were zeros, with the usual bias correction. Compression that sends the first
    /// moment freezes it (1-bit Adam's scheme), since the gradient behind the moment the ranks agree on is no one's
    /// own. As the gradients shrink over a run, counting zeros keeps the steps from shrinking faster than Adam's
    /// would.
    pub fn freeze_second_moment(&mut self, frozen: bool) {
        self.frozen = frozen;
    }

    /// Parameter `i`'s first and second moments (AdamW), once an update has made them.
    pub fn moments(&self, i: usize) -> (Option<&Tensor>, Option<&Tensor>) {
        (self.m.get(i).and_then(Option::as_ref), self.v.get(i).and_then(Option::as_ref))
    }

    /// AdamW: the terms of the next update, `m/c1 / (√(v/c2) + ε)` (`None` for SGD).
    pub fn next_terms(&self) -> Option<AdamTerms> {
        match self.cfg {
            OptimConfig::AdamW { beta1, beta2, eps, .. } => {
                let t = (self.t + 1) as i32;
                Some(AdamTerms {
                    beta1: beta1 as Real,
                    c1: (1.0 - beta1.powi(t)) as Real,
                    c2: (1.0 - beta2.powi(t)) as Real,
                    eps: eps as Real,
                    bound: ((1.0 - beta1) / (1.0 - beta2).sqrt()).max(1.0) as Real,
                })
            }
            OptimConfig::Sgd { .. } => None,
        }
    }

    /// Applies one update with learning rate `lr` from gradients aligned with `params` (on the parameters' device
    /// when they are resident there).
    pub fn step(&mut self, params: &Params, grads: &[Tensor], lr: f64) -> Result<()> {
        if params.resident() {
            return self.step_tensors(params, grads, lr);
        }
        let guards: Vec<_> = grads.iter().map(|g| g.storage_and_layout()).collect();
        let slices = guards.iter().map(|(s, l)| cpu_f32(s, l)).collect::<Result<Vec<_>>>()?;
        self.step_slices(params, &slices, lr)
    }

    /// Applies one update with learning rate `lr` from plain gradient buffers
    /// aligned with `params`, in place: one pass over each parameter, its
    /// gradient and its state, with no temporary tensors.
    pub fn step_slices(&mut self, params: &Params, grads: &[&[Real]], lr: f64) -> Result<()> {
        check_sizes(params, grads.iter().map(|g| g.len()))?;
        if params.resident() {
            // Host buffers (reduced across ranks) for parameters held on a device: one copy each way there.
            let grads = params
                .vars()
                .iter()
                .zip(grads)
                .map(|((_, v), g)| Ok(Tensor::from_slice(g, v.shape(), v.device())?))
                .collect::<Result<Vec<_>>>()?;
            return self.step_tensors(params, &grads, lr);
        }
        if self.skip_nonfinite && grads.iter().any(|g| g.iter().any(|x| !x.is_finite())) {
            self.skipped = true;
            return Ok(());
        }
        self.t += 1;
        for (i, ((_, var), g)) in params.vars().iter().zip(grads).enumerate() {
            let p = var.as_tensor();
            match self.cfg {
                OptimConfig::Sgd { momentum, .. } => {
                    if momentum == 0.0 {
                        with_slice_mut(p, |p| update(self.cfg, self.t, lr, p, g, None, None))??;
                        continue;
                    }
                    match &self.m[i] {
                        // The first step's buffer is the gradient itself (PyTorch's convention).
                        None => {
                            let mut buf = vec![0.0 as Real; g.len()];
                            with_slice_mut(p, |p| update(self.cfg, self.t, lr, p, g, Some((&mut buf, true)), None))??;
                            self.m[i] = Some(Tensor::from_vec(buf, var.shape(), p.device())?);
                        }
                        Some(m) => with_slice_mut(p, |p| {
                            with_slice_mut(m, |m| update(self.cfg, self.t, lr, p, g, Some((m, false)), None))
                        })???,
                    }
                }
                OptimConfig::AdamW { .. } => {
                    for slot in [&mut self.m[i], &mut self.v[i]] {
                        if slot.is_none() {
                            *slot = Some(p.zeros_like()?);
                        }
                    }
                    let (Some(m), Some(v)) = (&self.m[i], &self.v[i]) else { continue };
                    with_slice_mut(p, |p| {
                        with_slice_mut(m, |m| {
                            with_slice_mut(v, |v| {
                                update(self.cfg, self.t, lr, p, g, Some((m, false)), Some((v, self.frozen)))
                            })
                        })
                    })????;
                }
            }
        }
        Ok(())
    }

    /// [`Self::step_slices`]' update where the parameters are held ([`Params::set_resident`]): the same formula
    /// (`shoal_ps::optim::update`) as tensor operations on their device, a few kernels a parameter, with the state
    /// made there. Each new value is written into the parameter's own storage (every handle on it sees the update,
    /// as on the host); the state's tensors are replaced, so a copy of them being taken is left as it was.
    fn step_tensors(&mut self, params: &Params, grads: &[Tensor], lr: f64) -> Result<()> {
        check_sizes(params, grads.iter().map(Tensor::elem_count))?;
        if self.skip_nonfinite && !all_finite(grads)? {
            self.skipped = true;
            return Ok(());
        }
        self.t += 1;
        let t = self.t;
        for (i, ((_, var), g)) in params.vars().iter().zip(grads).enumerate() {
            // Out of autograd's graph: an update is not differentiated.
            let p = &var.as_tensor().detach();
            let g = g.detach().reshape(p.shape())?.to_dtype(p.dtype())?;
            let new_p = match self.cfg {
                OptimConfig::Sgd { momentum, weight_decay } => {
                    // The gradient with weight decay, as `update` adds it.
                    let d = if weight_decay == 0.0 { g } else { (&g + p.affine(weight_decay, 0.0)?)? };
                    let step = match (momentum, self.m[i].take()) {
                        (0.0, _) => d,
                        // The first step's buffer is the gradient itself (PyTorch's convention).
                        (_, None) => d,
                        (mu, Some(buf)) => (buf.affine(mu, 0.0)? + d)?,
                    };
                    if momentum != 0.0 {
                        self.m[i] = Some(step.clone());
                    }
                    (p - step.affine(lr, 0.0)?)?
                }
                OptimConfig::AdamW { beta1, beta2, eps, weight_decay } => {
                    // Each constant rounded as `update` rounds it, and each operation in its order, so the host
                    // gets the same values by either path.
                    let real = |x: f64| x as Real;
                    let (b1, b2) = (real(beta1), real(beta2));
                    let scalar = |x: Real| Tensor::new(x, p.device());
                    let c1 = scalar(real(1.0 - beta1.powi(t as i32)))?;
                    let c2 = scalar(real(1.0 - beta2.powi(t as i32)))?;
                    let take = if self.frozen { 0.0 } else { 1.0 - b2 };
                    let new_m = g.affine(f64::from(1.0 - b1), 0.0)?;
                    let m = match self.m[i].take() {
                        Some(m) => (m.affine(f64::from(b1), 0.0)? + new_m)?,
                        None => new_m,
                    };
                    let sq = (g.affine(f64::from(take), 0.0)? * &g)?;
                    let v = match self.v[i].take() {
                        Some(v) => (v.affine(f64::from(b2), 0.0)? + sq)?,
                        None => sq,
                    };
                    let denom = (v.broadcast_div(&c2)?.sqrt()? + f64::from(real(eps)))?;
                    let update = m.broadcast_div(&c1)?.div(&denom)?;
                    self.m[i] = Some(m);
                    self.v[i] = Some(v);
                    (p.affine(f64::from(real(1.0 - lr * weight_decay)), 0.0)?
                        - update.affine(f64::from(real(lr)), 0.0)?)?
                }
            };
            var.set(&new_p)?;
        }
        Ok(())
    }

    /// Bytes of state this optimizer holds now.
    pub fn state_bytes(&self) -> usize {
        self.m.iter().chain(&self.v).flatten().map(|t| t.elem_count() * REAL_BYTES).sum()
    }

    /// The optimizer and its hyper-parameters.
    pub fn config(&self) -> OptimConfig {
        self.cfg
    }

    /// Sizes of the tensors [`Self::state`] will hold once every parameter has been updated, in its order.
    pub fn state_sizes(&self, params: &Params) -> Vec<usize> {
        let per = match self.cfg {
            OptimConfig::Sgd { momentum: 0.0, .. } => 0,
            OptimConfig::Sgd { .. } => 1,
            OptimConfig::AdamW { .. } => 2,
        };
        params.vars().iter().flat_map(|(_, v)| std::iter::repeat_n(v.elem_count(), per)).collect()
    }

    /// The state as named tensors (`<param>.m`, `<param>.v`), for checkpoints.
    /// They share storage with the optimizer, whose next step updates them in
    /// place: copy them out before that step if they must stay as they are.
    pub fn state(&self, params: &Params) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, (name, _)) in params.vars().iter().enumerate() {
            if let Some(m) = &self.m[i] {
                out.push((format!("{name}.m"), m.clone()));
            }
            if let Some(v) = &self.v[i] {
                out.push((format!("{name}.v"), v.clone()));
            }
        }
        out
    }

    /// Restores the state saved by [`Self::state`].
    pub fn load_state(
        &mut self,
        params: &Params,
        t: u64,
        named: &std::collections::HashMap<String, Tensor>,
    ) -> Result<()> {
        self.t = t;
        for (i, (name, var)) in params.vars().iter().enumerate() {
            for (slot, suffix) in [(&mut self.m[i], "m"), (&mut self.v[i], "v")] {
                *slot = match named.get(&format!("{name}.{suffix}")) {
                    // Where the parameter is (a checkpoint's tensors are read on the host).
                    Some(x) if x.shape() == var.shape() => Some(x.to_device(var.device())?),
                    Some(x) => {
                        return Err(Error::Checkpoint(format!(
                            "optimizer state {name}.{suffix} has shape {:?}, the parameter {:?}",
                            x.dims(),
                            var.dims()
                        )));
                    }
                    None => None,
                };
            }
        }
        Ok(())
    }
}

/// Learning rate at `step` (0-based): linear warm-up to `lr`, then cosine decay
/// to `min_lr` at `total` steps (or constant after warm-up).
pub fn learning_rate(step: usize, total: usize, lr: f64, warmup: usize, min_lr: f64, cosine: bool) -> f64 {
    if warmup > 0 && step < warmup {
        return lr * (step + 1) as f64 / warmup as f64;
    }
    if !cosine || total <= warmup {
        return lr;
    }
    let progress = ((step - warmup) as f64 / (total - warmup).max(1) as f64).min(1.0);
    min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// Scales gradients so their global L2 norm is at most `max_norm`; returns the norm before.
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let mut sq = 0f64;
    for g in grads.iter() {
        sq += with_slice(g, sum_sq)?;
    }
    let norm = sq.sqrt();
    if norm > max_norm && norm > 0.0 {
        let s = max_norm / norm;
        for g in grads.iter_mut() {
            *g = (&*g * s)?;
        }
    }
    Ok(norm)
}

/// [`clip_grad_norm`] of gradients held on a device ([`Params::set_resident`]): the norm summed there, read
/// back once, and the gradients scaled there.
pub fn clip_grad_norm_tensors(grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    if grads.is_empty() {
        return Ok(0.0);
    }
    let sums =
        grads.iter().map(|g| g.to_dtype(REAL_DTYPE)?.sqr()?.sum_all()).collect::<candle_core::Result<Vec<_>>>()?;
    let norm =
        f64::from(Tensor::stack(&sums, 0)?.sum_all()?.to_device(&candle_core::Device::Cpu)?.to_scalar::<Real>()?)
            .sqrt();
    if norm > max_norm && norm > 0.0 {
        let s = max_norm / norm;
        for g in grads.iter_mut() {
            *g = g.affine(s, 0.0)?;
        }
    }
    Ok(norm)
}

/// One gradient for each of `params`, each with as many values as its parameter (`sizes`, in order).
fn check_sizes(params: &Params, sizes: impl ExactSizeIterator<Item = usize>) -> Result<()> {
    if sizes.len() != params.vars().len() {
        return Err(Error::InvalidArgument(format!(
            "{} gradients for {} parameters",
            sizes.len(),
            params.vars().len()
        )));
    }
    for ((name, var), n) in params.vars().iter().zip(sizes) {
        if n != var.elem_count() {
            return Err(Error::InvalidArgument(format!(
                "gradient of {name} has {n} values, the parameter {}",
                var.elem_count()
            )));
        }
    }
    Ok(())
}

/// Whether every value of `grads` is finite, decided on their device with one value read back: an infinity or a
/// NaN times zero is a NaN, which any sum keeps.
fn all_finite(grads: &[Tensor]) -> Result<bool> {
    if grads.is_empty() {
        return Ok(true);
    }
    let zeros = grads
        .iter()
        .map(|g| g.to_dtype(REAL_DTYPE)?.affine(0.0, 0.0)?.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let s = Tensor::stack(&zeros, 0)?.sum_all()?.to_device(&candle_core::Device::Cpu)?.to_scalar::<Real>()?;
    Ok(s.is_finite())
}

/// Sum of squares, accumulated in f64.
pub fn sum_sq(v: &[Real]) -> f64 {
    v.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

/// [`clip_grad_norm`] over plain buffers, scaled in place.
pub fn clip_grad_norm_slices(grads: &mut [&mut [Real]], max_norm: f64) -> f64 {
    let norm = grads.iter().map(|g| sum_sq(g)).sum::<f64>().sqrt();
    if norm > max_norm && norm > 0.0 {
        let s = (max_norm / norm) as Real;
        grads.iter_mut().for_each(|g| g.iter_mut().for_each(|x| *x *= s));
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::SeededRng;

    /// Two parameters drawn from seed 3: on the host, or held where the model computes (the CPU here: the same
    /// arithmetic by the tensor path a GPU takes).
    fn two_params(resident: bool) -> Params {
        let mut p = Params::default();
        if resident {
            p.set_resident(candle_core::Device::Cpu);
        }
        let mut rng = SeededRng::new(3);
        p.uniform(&mut rng, "w", &[4, 3], 1.0).expect("w");
        p.uniform(&mut rng, "b", &[3], 1.0).expect("b");
        p
    }

    fn grads_at(step: usize) -> Vec<Tensor> {
        let dev = &candle_core::Device::Cpu;
        let w: Vec<Real> = (0..12).map(|i| ((i * 7 + step * 3) % 11) as Real / 5.0 - 1.0).collect();
        let b: Vec<Real> = (0..3).map(|i| ((i + step) % 4) as Real / 3.0 - 0.5).collect();
        vec![Tensor::from_vec(w, (4, 3), dev).expect("w"), Tensor::from_vec(b, 3, dev).expect("b")]
    }

    fn values(p: &Params) -> Vec<Real> {
        p.flatten().expect("values")
    }

    #[test]
    fn the_tensor_path_updates_as_the_host_loops_do() {
        let configs = [
            OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
            OptimConfig::Sgd { momentum: 0.9, weight_decay: 0.1 },
            OptimConfig::Sgd { momentum: 0.0, weight_decay: 0.0 },
        ];
        for cfg in configs {
            let (host, held) = (two_params(false), two_params(true));
            assert!(!host.resident() && held.resident());
            let (mut a, mut b) = (Optimizer::new(cfg, &host), Optimizer::new(cfg, &held));
            for step in 0..6 {
                let mut ga = grads_at(step);
                let na = clip_grad_norm(&mut ga, 1.5).expect("clip");
                // The norm summed in the gradients' type on the device (f64 on the host): close, not equal.
                let nb = clip_grad_norm_tensors(&mut grads_at(step), 1.5).expect("clip on the device");
                assert!((na - nb).abs() <= 1e-5 * na, "{cfg:?}: norm {na} against {nb}");
                let gb = ga.clone();
                a.step(&host, &ga, 1e-2).expect("host step");
                if step % 2 == 0 {
                    b.step(&held, &gb, 1e-2).expect("tensor step");
                } else {
                    // Host buffers (what a reduction across ranks hands over) go the same way.
                    let flat: Vec<Vec<Real>> =
                        gb.iter().map(|g| g.flatten_all().and_then(|g| g.to_vec1()).expect("values")).collect();
                    let slices: Vec<&[Real]> = flat.iter().map(Vec::as_slice).collect();
                    b.step_slices(&held, &slices, 1e-2).expect("tensor step from host buffers");
                }
            }
            // The same constants, rounded alike, and the same operations in the same order: the same values.
            assert_eq!(a.t, b.t);
            assert_eq!(values(&host), values(&held), "{cfg:?}");
            let state = |o: &Optimizer, p: &Params| -> Vec<Real> {
                o.state(p).iter().flat_map(|(_, t)| t.flatten_all().and_then(|t| t.to_vec1()).expect("state")).collect()
            };
            assert_eq!(state(&a, &host), state(&b, &held), "{cfg:?}: the same state");
        }
    }

    #[test]
    fn the_tensor_path_skips_an_update_with_an_infinity_as_the_host_loops_do() {
        let held = two_params(true);
        let before = values(&held);
        let mut o =
            Optimizer::new(OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }, &held);
        o.skip_nonfinite(true);
        let mut g = grads_at(0);
        g[1] = Tensor::from_vec(vec![0.0 as Real, Real::INFINITY, 1.0], 3, &candle_core::Device::Cpu).expect("b");
        o.step(&held, &g, 1e-2).expect("skipped");
        assert!(o.take_skipped());
        assert_eq!((o.t, values(&held)), (0, before.clone()), "nothing changed");
        o.step(&held, &grads_at(1), 1e-2).expect("taken");
        assert!(!o.take_skipped());
        assert_eq!(o.t, 1);
        assert_ne!(values(&held), before);
    }

    #[test]
    fn gradients_that_do_not_match_the_parameters_are_refused_on_both_paths() {
        for resident in [false, true] {
            let p = two_params(resident);
            let before = values(&p);
            let mut o = Optimizer::new(OptimConfig::Sgd { momentum: 0.0, weight_decay: 0.0 }, &p);
            let one = &grads_at(0)[..1];
            let e = o.step(&p, one, 1e-2).expect_err("one gradient for two parameters").to_string();
            assert!(e.contains("1 gradients for 2 parameters"), "{e}");
            let short = [grads_at(0)[0].clone(), Tensor::zeros(2, REAL_DTYPE, &candle_core::Device::Cpu).expect("b")];
            let e = o.step(&p, &short, 1e-2).expect_err("a gradient of the wrong size").to_string();
            assert!(e.contains("gradient of b has 2 values, the parameter 3"), "resident {resident}: {e}");
            assert_eq!((o.t, values(&p)), (0, before), "nothing changed");
        }
    }

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        assert!((learning_rate(0, 100, 1.0, 10, 0.1, true) - 0.1).abs() < 1e-12);
        assert!((learning_rate(9, 100, 1.0, 10, 0.1, true) - 1.0).abs() < 1e-12);
        assert!((learning_rate(10, 100, 1.0, 10, 0.1, true) - 1.0).abs() < 1e-12);
        assert!((learning_rate(100, 100, 1.0, 10, 0.1, true) - 0.1).abs() < 1e-12);
        assert!((learning_rate(55, 100, 1.0, 10, 0.0, true) - 0.5).abs() < 1e-12);
        assert_eq!(learning_rate(70, 100, 0.3, 0, 0.0, false), 0.3);
    }
}
