//! Mixed precision (`train.precision`): the forward and backward passes in bf16 or f16, the parameters, their
//! gradients, the optimizer state and checkpoints in f32.
//!
//! Invariants:
//! - The parameters stay f32 `Var`s ("master weights"): a model casts each weight to the compute type where it
//!   uses it ([`at`]), so candle's backward of that cast hands the `Var` an f32 gradient. What the strategies
//!   reduce, what the optimizer updates and what a checkpoint holds is therefore the same in every precision: a
//!   checkpoint written under one precision resumes under another.
//! - Reductions that lose most in 16 bits — layer norms' statistics, softmax, the loss — run in f32, and every
//!   model's logits come out in f32.
//! - f16's narrow range is kept by dynamic loss scaling ([`LossScaler`]): the loss is multiplied by the scale
//!   before backward and every gradient divided by it after; a step whose reduced gradients hold an infinity or a
//!   NaN is skipped by every rank alike (they all see the same reduced gradients) and the scale halved; after
//!   `growth_interval` good steps in a row it doubles. The scale is not part of a checkpoint: a resumed run starts
//!   again from the initial scale (at worst a few skipped steps).

use candle_core::{DType, Device, Tensor};

use crate::REAL_DTYPE;
pub use shoal_spec::Precision;

/// The candle type the passes compute in under `p`.
pub fn compute_dtype(p: Precision) -> DType {
    match p {
        Precision::F32 => REAL_DTYPE,
        Precision::Bf16 => DType::BF16,
        Precision::F16 => DType::F16,
    }
}

/// `t` in `dtype`: itself (a handle, no copy) when it is already, else a cast that autograd goes back through.
pub fn at(t: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    if t.dtype() == dtype { Ok(t.clone()) } else { t.to_dtype(dtype) }
}

/// `t` on `x`'s device in `x`'s type (a weight where an activation is).
pub fn like(t: &Tensor, x: &Tensor) -> candle_core::Result<Tensor> {
    at(&t.to_device(x.device())?, x.dtype())
}

/// Where and in what a model computes. Its parameters are [`crate::REAL_DTYPE`], held either on the host — then
/// autograd brings their gradients back there through the copies [`Compute::put`] makes — or on the device itself
/// (`Params::set_resident`), where `put` only casts.
#[derive(Debug, Clone)]
pub struct Compute {
    pub dtype: DType,
    pub device: Device,
}

impl Default for Compute {
    fn default() -> Self {
        Compute { dtype: REAL_DTYPE, device: Device::Cpu }
    }
}

impl Compute {
    /// `t` on the compute device in the compute type (itself when it is already).
    pub fn put(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        at(&t.to_device(&self.device)?, self.dtype)
    }
}

/// Dynamic loss scaling for f16 (see the module's invariants).
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    scale: f64,
    /// Good steps in a row needed before the scale doubles.
    growth_interval: u32,
    good: u32,
    /// Steps skipped so far.
    skipped: u64,
}

impl LossScaler {
    /// The usual start (2^16) and growth interval (2000 steps).
    pub const INITIAL: f64 = 65536.0;
    pub const GROWTH_INTERVAL: u32 = 2000;
    /// The scale never falls below 1 nor grows past 2^24: past that an f16 gradient overflows whatever it is.
    const MIN: f64 = 1.0;
    const MAX: f64 = 16_777_216.0;

    pub fn new(initial: f64, growth_interval: u32) -> LossScaler {
        let scale = if initial.is_finite() { initial.clamp(Self::MIN, Self::MAX) } else { Self::INITIAL };
        LossScaler { scale, growth_interval: growth_interval.max(1), good: 0, skipped: 0 }
    }

    /// What the loss is multiplied by before backward.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Steps skipped for overflow so far.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// After a step: `overflowed` (its gradients were not all finite, so it was skipped) halves the scale and
    /// starts the count of good steps again; a good step counts, and the `growth_interval`-th in a row doubles it.
    pub fn update(&mut self, overflowed: bool) {
        if overflowed {
            self.skipped += 1;
            self.good = 0;
            self.scale = (self.scale / 2.0).max(Self::MIN);
            return;
        }
        self.good += 1;
        if self.good >= self.growth_interval {
            self.good = 0;
            self.scale = (self.scale * 2.0).min(Self::MAX);
        }
    }
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler::new(Self::INITIAL, Self::GROWTH_INTERVAL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loss_scaler_halves_on_overflow_and_grows_after_good_steps() {
        let mut s = LossScaler::new(1024.0, 3);
        assert_eq!(s.scale(), 1024.0);
        // Two good steps: not yet.
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 1024.0);
        // An overflow: skipped, halved, and the count of good steps starts again.
        s.update(true);
        assert_eq!((s.scale(), s.skipped()), (512.0, 1));
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 512.0);
        // The third good step in a row doubles it.
        s.update(false);
        assert_eq!(s.scale(), 1024.0);
        // Overflows in a row keep halving, never below 1.
        for _ in 0..20 {
            s.update(true);
        }
        assert_eq!((s.scale(), s.skipped()), (1.0, 21));
        // Growth stops at 2^24.
        let mut g = LossScaler::new(8_388_608.0, 1);
        g.update(false);
        g.update(false);
        assert_eq!(g.scale(), 16_777_216.0);
        // Nonsense starts are tamed.
        assert_eq!(LossScaler::new(f64::NAN, 0).scale(), LossScaler::INITIAL);
        assert_eq!(LossScaler::new(0.0, 5).scale(), 1.0);
    }

    #[test]
    fn casts_are_handles_when_the_type_already_matches() -> candle_core::Result<()> {
        let t = Tensor::new(&[1.5f32, -2.0], &candle_core::Device::Cpu)?;
        assert_eq!(at(&t, DType::F32)?.id(), t.id());
        let h = at(&t, DType::BF16)?;
        assert_eq!(h.dtype(), DType::BF16);
        assert_eq!(at(&h, DType::F32)?.to_vec1::<f32>()?, vec![1.5, -2.0]);
        assert_eq!(compute_dtype(Precision::F16), DType::F16);
        assert_eq!(compute_dtype(Precision::Bf16), DType::BF16);
        assert_eq!(compute_dtype(Precision::F32), REAL_DTYPE);
        Ok(())
    }

    use crate::checkpoint::{CheckpointDir, ManifestMeta, TensorData, tensors_of};
    use crate::models::{Gpt, GptConfig, Mlp, Model};
    use crate::params::{Params, SeededRng};
    use crate::trainer::{Trainer, TrainerConfig};
    use crate::{OptimConfig, Real};

    type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;
    type Any<T> = std::result::Result<T, Box<dyn std::error::Error>>;

    const GPT: GptConfig = GptConfig { vocab: 12, context: 8, layers: 2, heads: 2, width: 16 };

    /// A GPT built on parameters that compute in `p`, seeded alike whatever `p`.
    fn gpt(p: Precision) -> crate::Result<(Params, Gpt)> {
        let mut params = Params::default();
        params.set_compute(compute_dtype(p));
        let model = Gpt::new(&mut params, &mut SeededRng::new(7), GPT)?;
        Ok((params, model))
    }

    /// Batch `k` of sequences counting up modulo the vocabulary from varied starts: the next token is learnable.
    fn batch(k: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let (b, t) = (4, GPT.context);
        let v = GPT.vocab as u32;
        let seq = |i: usize, j: usize| ((k * 5 + i * 3 + j) as u32) % v;
        let ids: Vec<u32> = (0..b).flat_map(|i| (0..t).map(move |j| seq(i, j))).collect();
        let next: Vec<u32> = (0..b).flat_map(|i| (0..t).map(move |j| seq(i, j + 1))).collect();
        let dev = &candle_core::Device::Cpu;
        Ok((Tensor::from_vec(ids, (b, t), dev)?, Tensor::from_vec(next, b * t, dev)?))
    }

    fn config(p: Precision) -> TrainerConfig {
        TrainerConfig {
            optimizer: OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
            precision: p,
            ..TrainerConfig::default()
        }
    }

    /// Trains `steps` steps from batch `from` on; returns each step's loss.
    fn train(t: &mut Trainer, model: &dyn Model, from: usize, steps: usize) -> crate::Result<Vec<f64>> {
        let mut losses = Vec::new();
        for k in from..from + steps {
            let (x, y) = batch(k)?;
            let loss = model.loss(&model.forward(&x)?, &y)?;
            assert_eq!(loss.dtype(), REAL_DTYPE, "the loss is computed in f32");
            losses.push(f64::from(loss.to_scalar::<Real>()?));
            t.backward(Some(&loss), true)?;
            t.step(3e-2)?;
        }
        Ok(losses)
    }

    fn run(p: Precision, steps: usize) -> crate::Result<(Trainer, Gpt, Vec<f64>)> {
        let (params, model) = gpt(p)?;
        let mut t = Trainer::new(params, None, config(p))?;
        let losses = train(&mut t, &model, 0, steps)?;
        Ok((t, model, losses))
    }

    #[test]
    fn a_bf16_run_learns_and_stays_near_the_f32_run() -> TestResult {
        let (_, _, f32s) = run(Precision::F32, 40)?;
        let (t, _, bf16s) = run(Precision::Bf16, 40)?;
        // The master weights stay f32.
        assert!(t.params().vars().iter().all(|(_, v)| v.dtype() == REAL_DTYPE));
        let (first, last) = (bf16s[0], bf16s[bf16s.len() - 1]);
        assert!(last < 0.5 * first, "bf16 loss {first} -> {last}");
        // The same start (same weights, the first pass rounded to bf16) and the same course within bf16's rounding.
        assert!((bf16s[0] - f32s[0]).abs() < 0.02, "first losses {} vs {}", bf16s[0], f32s[0]);
        for (i, (a, b)) in bf16s.iter().zip(&f32s).enumerate() {
            assert!((a - b).abs() < 0.1 + 0.1 * b, "step {i}: bf16 {a}, f32 {b}");
        }
        // And the passes did run in bf16: not bit for bit the f32 run.
        assert_ne!(bf16s, f32s);
        Ok(())
    }

    #[test]
    fn an_f16_run_scales_its_loss_skips_overflows_and_learns() -> TestResult {
        let (_, _, f32s) = run(Precision::F32, 30)?;
        let (params, model) = gpt(Precision::F16)?;
        let mut t = Trainer::new(params, None, config(Precision::F16))?;
        // A scale far too large: the first steps' gradients overflow f16, are skipped, and the scale halves until
        // they fit.
        t.set_loss_scaler(LossScaler::new(16_777_216.0, 1000));
        let before = t.params().flatten()?;
        let first = train(&mut t, &model, 0, 1)?;
        let s = t.loss_scaler().cloned().ok_or("an f16 trainer has a loss scaler")?;
        assert_eq!((s.skipped(), s.scale()), (1, 8_388_608.0), "the overflowing step was skipped and the scale halved");
        assert_eq!(t.params().flatten()?, before, "a skipped step changes no parameter");
        assert_eq!(t.optimizer().t, 0, "nor the optimizer's count");
        let rest = train(&mut t, &model, 1, 29)?;
        let s = t.loss_scaler().cloned().ok_or("scaler")?;
        assert!(s.skipped() >= 1 && s.scale() < 16_777_216.0);
        assert_eq!(t.optimizer().t + s.skipped(), 30, "every step either updated or was skipped");
        let losses: Vec<f64> = first.into_iter().chain(rest).collect();
        let last = losses[losses.len() - 1];
        assert!(last < 0.5 * losses[0], "f16 loss {} -> {last}", losses[0]);
        assert!((last - f32s[f32s.len() - 1]).abs() < 0.25 + 0.25 * f32s[f32s.len() - 1], "f16 {last} vs f32 {f32s:?}");
        // Without loss scaling (f32 and bf16) there is no scaler and nothing is skipped.
        assert!(Trainer::new(gpt(Precision::Bf16)?.0, None, config(Precision::Bf16))?.loss_scaler().is_none());
        Ok(())
    }

    /// Saves `t`'s model and optimizer state at `step` under `root`; returns what was saved.
    fn save(t: &Trainer, root: &std::path::Path, step: u64) -> Any<(Vec<TensorData>, Vec<TensorData>)> {
        let model = tensors_of(t.model_state()?, &mut std::iter::empty())?;
        let opt = tensors_of(t.optimizer_state()?, &mut std::iter::empty())?;
        let meta = ManifestMeta {
            epoch: 0,
            sampler: serde_json::Value::Null,
            rng: serde_json::Value::Null,
            world_size: 1,
            strategy: "ddp".into(),
            extra: serde_json::json!({ "optimizer_t": t.optimizer().t }),
        };
        CheckpointDir::new(root).save(step, &model, &opt, meta)?;
        Ok((model, opt))
    }

    /// A trainer under `p` resumed from the newest checkpoint under `root`.
    fn resume(p: Precision, root: &std::path::Path) -> Any<(Trainer, Gpt)> {
        let l = CheckpointDir::new(root).latest_valid()?.ok_or("no checkpoint")?;
        let (params, model) = gpt(p)?;
        for (i, (name, _)) in params.vars().iter().enumerate() {
            let td = l.model.iter().find(|td| &td.name == name).ok_or_else(|| format!("no tensor {name}"))?;
            params.set_whole(i, &td.data)?;
        }
        let mut t = Trainer::new(params, None, config(p))?;
        let dev = &candle_core::Device::Cpu;
        let named = l
            .optimizer
            .iter()
            .map(|td| Ok((td.name.clone(), Tensor::from_slice(&td.data, td.shape.as_slice(), dev)?)))
            .collect::<crate::Result<_>>()?;
        let opt_t = l.manifest.extra.get("optimizer_t").and_then(|v| v.as_u64()).unwrap_or(l.manifest.step);
        t.load_optimizer_state(opt_t, &named)?;
        Ok((t, model))
    }

    /// Names, shapes and safetensors dtypes of a checkpoint's two files.
    fn layout(dir: &std::path::Path) -> Any<Vec<(String, Vec<usize>, String)>> {
        let mut out = Vec::new();
        for f in [crate::checkpoint::MODEL_FILE, crate::checkpoint::OPTIMIZER_FILE] {
            let bytes = std::fs::read(dir.join(f))?;
            let st = safetensors::SafeTensors::deserialize(&bytes)?;
            let mut names: Vec<_> =
                st.iter().map(|(n, v)| (n.to_string(), v.shape().to_vec(), format!("{:?}", v.dtype()))).collect();
            names.sort();
            out.extend(names);
        }
        Ok(out)
    }

    fn bits(ts: &[TensorData]) -> Vec<(String, Vec<u64>)> {
        ts.iter().map(|t| (t.name.clone(), t.data.iter().map(|x| u64::from(x.to_bits())).collect())).collect()
    }

    #[test]
    fn checkpoints_are_the_same_format_in_every_precision_and_resume_across_them() -> TestResult {
        let tmp = std::env::temp_dir().join(format!("shoal-precision-{}", std::process::id()));
        let (a, b) = (tmp.join("bf16"), tmp.join("f32"));
        // Written under bf16 at step 10 and under f32 at step 10.
        let (bf, model_bf, _) = run(Precision::Bf16, 10)?;
        let (saved_model, saved_opt) = save(&bf, &a, 10)?;
        let (f, model_f, _) = run(Precision::F32, 10)?;
        save(&f, &b, 10)?;
        // The same files: the same tensors, shapes and types (f32), whatever the precision of the run.
        let (la, lb) = (layout(&CheckpointDir::new(&a).step_dir(10))?, layout(&CheckpointDir::new(&b).step_dir(10))?);
        assert_eq!(la, lb);
        assert!(!la.is_empty() && la.iter().all(|(_, _, dt)| dt == "F32"), "{la:?}");

        // bf16 → f32: the resumed trainer holds exactly what was saved, and trains on as the bf16 run's own
        // continuation (in f32 now) would, from the same state.
        let (mut resumed, model_r) = resume(Precision::F32, &a)?;
        let again = tensors_of(resumed.model_state()?, &mut std::iter::empty())?;
        assert_eq!(bits(&again), bits(&saved_model));
        assert_eq!(bits(&tensors_of(resumed.optimizer_state()?, &mut std::iter::empty())?), bits(&saved_opt));
        assert_eq!(resumed.optimizer().t, bf.optimizer().t);
        let next_f32 = train(&mut resumed, &model_r, 10, 10)?;
        let mut bf = bf;
        let next_bf16 = train(&mut bf, &model_bf, 10, 10)?;
        for (x, y) in next_f32.iter().zip(&next_bf16) {
            assert!((x - y).abs() < 0.1 + 0.1 * y, "after resuming in f32 {x}, bf16 going on {y}");
        }
        assert!(next_f32[9] < next_f32[0] + 1e-3, "training goes on after the resume: {next_f32:?}");

        // f32 → bf16: the same, the other way.
        let (mut resumed, model_r) = resume(Precision::Bf16, &b)?;
        let saved = CheckpointDir::new(&b).latest_valid()?.ok_or("saved")?;
        assert_eq!(bits(&tensors_of(resumed.model_state()?, &mut std::iter::empty())?), bits(&saved.model));
        let next_bf16 = train(&mut resumed, &model_r, 10, 10)?;
        let mut f = f;
        let next_f32 = train(&mut f, &model_f, 10, 10)?;
        for (x, y) in next_bf16.iter().zip(&next_f32) {
            assert!((x - y).abs() < 0.1 + 0.1 * y, "after resuming in bf16 {x}, f32 going on {y}");
        }
        let _ = std::fs::remove_dir_all(&tmp);
        Ok(())
    }

    #[test]
    fn the_mlp_and_its_logits_follow_the_compute_type() -> TestResult {
        let mut params = Params::default();
        params.set_compute(DType::BF16);
        let mlp = Mlp::new(&mut params, &mut SeededRng::new(1), 4, &[8], 3)?;
        let x = Tensor::new(&[[0.5f32, -1.0, 2.0, 0.25]], &candle_core::Device::Cpu)?;
        let y = mlp.forward(&x)?;
        assert_eq!(y.dtype(), REAL_DTYPE);
        assert!(params.vars().iter().all(|(_, v)| v.dtype() == REAL_DTYPE));
        // The same weights in f32 give nearly the same logits.
        let mut p32 = Params::default();
        let m32 = Mlp::new(&mut p32, &mut SeededRng::new(1), 4, &[8], 3)?;
        let (a, b) = (y.flatten_all()?.to_vec1::<Real>()?, m32.forward(&x)?.flatten_all()?.to_vec1::<Real>()?);
        assert_ne!(a, b);
        for (a, b) in a.iter().zip(&b) {
            assert!((a - b).abs() < 0.05, "bf16 {a} vs f32 {b}");
        }
        Ok(())
    }
}
