//! The [`Trainer`]: training of any candle model with no distributed code in the model. Give it the model's
//! [`Params`] and a [`Strategy`] (or a communicator, for data parallel); call [`Trainer::backward`] (or
//! [`Trainer::backward_with`] for a hand-written backward pass) on each micro-batch's loss and [`Trainer::step`]
//! once per global batch. The trainer owns the parameters, the optimizer and the order of calls; the strategy
//! (`crate::strategy`) owns how the ranks share the step — for DDP, the broadcast at the start and the bucketed,
//! overlapped all-reduce of the gradients (`crate::strategy::ddp`).
//!
//! Under `precision = f16` the trainer scales the loss before backward and the gradients back after it, and an
//! update whose reduced gradients overflowed is skipped (`crate::precision::LossScaler`). The hand-written backward
//! ([`Trainer::backward_with`]) computes in [`Real`] and is not scaled.

use crate::Real;
use candle_core::Tensor;
use shoal_comm::Communicator;

use crate::error::{Error, Result};
use crate::optim::{OptimConfig, Optimizer};
use crate::params::Params;
use crate::precision::{LossScaler, Precision};
use crate::strategy::backward_by_layer;
use crate::strategy::ddp::{Ddp, DdpConfig};
pub use crate::strategy::{GradSink, StepTimes, Strategy};

/// How a [`Trainer`] trains.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    pub optimizer: OptimConfig,
    /// Gradient bucket size for the all-reduce (default 25 MiB).
    pub bucket_bytes: usize,
    /// Size of the first bucket (default 1 MiB, at most `bucket_bytes`): the
    /// last layers' gradients start their all-reduce early in backward.
    pub first_bucket_bytes: usize,
    /// Clip the global gradient norm to this value.
    pub clip_grad_norm: Option<f64>,
    /// All-reduce each bucket on the communicator's thread as soon as it is
    /// full (default), or all of them on the calling thread in `step`.
    pub overlap: bool,
    /// What the passes compute in: under `F16` the loss is scaled dynamically (the model itself is built for the
    /// precision through `Params::set_compute`).
    pub precision: Precision,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            optimizer: OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
            bucket_bytes: 25 << 20,
            first_bucket_bytes: 1 << 20,
            clip_grad_norm: None,
            overlap: true,
            precision: Precision::F32,
        }
    }
}

impl TrainerConfig {
    /// The bucketing and overlap settings, for [`Ddp`].
    pub fn ddp(&self) -> DdpConfig {
        DdpConfig {
            bucket_bytes: self.bucket_bytes,
            first_bucket_bytes: self.first_bucket_bytes,
            overlap: self.overlap,
        }
    }
}

/// Trains a set of parameters under a strategy.
pub struct Trainer {
    params: Params,
    opt: Optimizer,
    cfg: TrainerConfig,
    strategy: Box<dyn Strategy>,
    /// Scalars to sum over ranks with this step's gradients.
    scalars: Vec<Real>,
    /// f16's dynamic loss scale.
    scaler: Option<LossScaler>,
}

/// Whether overlapping the gradient all-reduce with backward can pay on this
/// host (the rule behind `overlap = "auto"`): only if every rank here has a
/// core for its communicator thread beside its compute threads
/// (`local ranks × (threads + 1) ≤ cores`). Otherwise the communicator's
/// thread runs on a core a computation needs, and reducing after backward is
/// faster.
pub fn overlap_pays(comm: &Communicator) -> bool {
    let me = comm.hosts().get(comm.rank());
    let local = comm.hosts().iter().filter(|h| Some(*h) == me).count();
    let threads = candle_core::utils::get_num_threads();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    core_free_per_rank(local, threads, cores)
}

/// `local` ranks of `threads` compute threads each leave every rank a core
/// for one more thread among `cores`.
fn core_free_per_rank(local: usize, threads: usize, cores: usize) -> bool {
    local.max(1).saturating_mul(threads.max(1).saturating_add(1)) <= cores
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("params", &self.params.count())
            .field("strategy", &self.strategy.name())
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Trainer {
    /// A data-parallel trainer ([`Ddp`] over `comm`, bucketed as `cfg` says): rank 0's parameters are broadcast
    /// first so every rank starts from the same model.
    pub fn new(params: Params, comm: Option<Communicator>, cfg: TrainerConfig) -> Result<Trainer> {
        Trainer::with_strategy(params, Box::new(Ddp::new(comm, cfg.ddp())), cfg)
    }

    /// A trainer whose ranks share the work as `strategy` does (`cfg`'s bucket settings are the strategy's
    /// business; its optimizer and clipping are the trainer's).
    pub fn with_strategy(params: Params, mut strategy: Box<dyn Strategy>, cfg: TrainerConfig) -> Result<Trainer> {
        strategy.init(&params)?;
        let mut opt = Optimizer::new(cfg.optimizer, &params);
        let scaler = (cfg.precision == Precision::F16).then(LossScaler::default);
        opt.skip_nonfinite(scaler.is_some());
        Ok(Trainer { params, opt, cfg, strategy, scalars: Vec::new(), scaler })
    }

    /// Replaces f16's loss scaler (its start and growth interval); nothing under other precisions.
    pub fn set_loss_scaler(&mut self, scaler: LossScaler) {
        if self.scaler.is_some() {
            self.scaler = Some(scaler);
        }
    }

    /// f16's loss scaler, when the run has one.
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// The parameters. Under ZeRO-3 their tensors hold values only while a layer is in use: read them with
    /// [`Self::model_state`].
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The parameters as whole named tensors (for a checkpoint, or to read them): a collective when the strategy
    /// shards them (every rank calls it at the same step).
    pub fn model_state(&self) -> Result<Vec<(String, Tensor)>> {
        self.strategy.model_state(&self.params)
    }

    /// Bytes of parameters this rank holds.
    pub fn param_bytes(&self) -> usize {
        self.strategy.param_bytes(&self.params)
    }

    pub fn optimizer(&self) -> &Optimizer {
        &self.opt
    }

    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.opt
    }

    pub fn comm(&self) -> Option<&Communicator> {
        self.strategy.comm()
    }

    /// Bytes this rank has sent: through its communicator, and what its strategy sends outside it (a parameter
    /// server's pushes).
    pub fn bytes_sent(&self) -> u64 {
        self.comm().map_or(0, Communicator::bytes_sent) + self.strategy.bytes_sent_elsewhere()
    }

    /// Bytes of optimizer state this rank holds.
    pub fn optimizer_bytes(&self) -> usize {
        self.strategy.optimizer_bytes(&self.opt)
    }

    /// Bytes of gradient buffers this rank holds for a step.
    pub fn gradient_bytes(&self) -> usize {
        self.strategy.gradient_bytes(&self.params)
    }

    /// The optimizer state as whole named tensors, for a checkpoint: a collective when the strategy shards it
    /// (every rank calls it at the same step).
    pub fn optimizer_state(&self) -> Result<Vec<(String, Tensor)>> {
        self.strategy.optimizer_state(&self.params, &self.opt)
    }

    /// Restores optimizer state saved as whole named tensors, at update count `t`.
    pub fn load_optimizer_state(&mut self, t: u64, named: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        self.strategy.load_optimizer_state(&self.params, &mut self.opt, t, named)
    }

    /// The compression hook's state (every rank's error feedback), saved beside the optimizer state: a collective,
    /// every rank calls it at the same step; empty without `[compression]`.
    pub fn compression_state(&self) -> Result<Vec<(String, Tensor)>> {
        self.strategy.compression_state()
    }

    /// Restores what [`Self::compression_state`] saved, at any world size.
    pub fn load_compression_state(&mut self, named: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        self.strategy.load_compression_state(named)
    }

    /// The run's last step is done ([`Strategy::finish`]).
    pub fn finish(&mut self) -> Result<()> {
        self.strategy.finish()
    }

    /// The strategy that runs (what the manifest and `summary.json` record).
    pub fn strategy_name(&self) -> &'static str {
        self.strategy.name()
    }

    /// Sums `values` over ranks along with this step's gradients (with DDP they ride in the last bucket, so
    /// reporting e.g. the global loss costs no extra collective); [`StepTimes::scalars`] gives them back. Call
    /// before the `last` backward of the step.
    pub fn attach_scalars(&mut self, values: &[Real]) {
        self.scalars.clear();
        self.scalars.extend_from_slice(values);
    }

    fn take_scalars(&mut self, last: bool) -> Vec<Real> {
        if last { std::mem::take(&mut self.scalars) } else { Vec::new() }
    }

    /// Back-propagates `loss` (already weighted by this rank's share of the global batch; `None` when this rank's
    /// share is empty, which contributes zeros but still takes part). With `last`, the step's gradients go to the
    /// strategy to be combined across ranks.
    pub fn backward(&mut self, loss: Option<&Tensor>, last: bool) -> Result<()> {
        if self.params.layers().is_sharded() {
            // ZeRO-3: the forward went layer by layer; so does backward, each layer's gradients into the strategy's
            // sink as soon as they are computed.
            let scalars = self.take_scalars(last);
            let (layers, vars) = (self.params.layers(), self.params.vars());
            return self
                .strategy
                .backward(&self.params, last, scalars, &mut |sink| backward_by_layer(layers, loss, vars, sink));
        }
        let scale = self.scaler.as_ref().map(LossScaler::scale);
        let grads = match (loss, scale) {
            (Some(l), Some(s)) => Some((l * s)?.backward()?),
            (l, _) => l.map(Tensor::backward).transpose()?,
        };
        // Handles to the gradients (no copies), or under loss scaling the gradients unscaled.
        let per_param: Vec<Option<Tensor>> = match &grads {
            Some(g) => self
                .params
                .vars()
                .iter()
                .map(|(_, v)| match (g.get(v.as_tensor()), scale) {
                    (Some(g), Some(s)) => Ok(Some((g / s)?)),
                    (g, _) => Ok(g.cloned()),
                })
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        drop(grads);
        let scalars = self.take_scalars(last);
        self.strategy.backward_tensors(&self.params, last, scalars, per_param)
    }

    /// Runs a hand-written backward pass `f`, which puts each parameter's gradient (already weighted like
    /// [`Self::backward`]'s loss) into the sink in reverse parameter order. With `last` and DDP, full buckets start
    /// their all-reduce while `f` is still computing the earlier layers.
    pub fn backward_with(&mut self, last: bool, f: impl FnOnce(&mut dyn GradSink) -> Result<()>) -> Result<()> {
        let scalars = self.take_scalars(last);
        let mut f = Some(f);
        self.strategy.backward(&self.params, last, scalars, &mut |sink| match f.take() {
            Some(f) => f(sink),
            None => Err(Error::InvalidArgument("a strategy ran the backward pass twice".into())),
        })
    }

    /// How many ranks compute every batch together (a tensor-parallel group; 1 otherwise).
    pub fn tensor_degree(&self) -> usize {
        self.strategy.tensor_degree()
    }

    /// Under pipeline stages, the model's layers of every chunk in the order of the cut (see
    /// [`Strategy::stage_layers`]); none otherwise.
    pub fn stage_layers(&self) -> Option<Vec<std::ops::Range<usize>>> {
        self.strategy.stage_layers()
    }

    /// Whether this rank holds only a part of the model (a pipeline stage): then a step's micro-batches go through
    /// [`Self::run_micro_batches`], and a forward pass through [`Self::forward_stage`].
    pub fn splits_model(&self) -> bool {
        self.strategy.splits_model()
    }

    /// Runs a step's `count` micro-batches: `forward(i)` runs the model on micro-batch `i`, `loss(i, logits)` gives
    /// its loss weighted by its share of the global batch. Under a pipeline each stage runs its layers in its
    /// schedule's order (`loss` only on the last stage); otherwise forward, loss and [`Self::backward`] in turn. Give
    /// the step's scalars with [`Self::attach_scalars`] before [`Self::step`].
    pub fn run_micro_batches(
        &mut self,
        count: usize,
        mut forward: impl FnMut(usize) -> Result<Tensor>,
        mut loss: impl FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<()> {
        if !self.strategy.splits_model() {
            for i in 0..count {
                let y = forward(i)?;
                let l = loss(i, &y)?;
                self.backward(Some(&l), i + 1 == count)?;
            }
            return Ok(());
        }
        self.strategy.run_micro_batches(&self.params, count, &mut forward, &mut loss)
    }

    /// One forward pass without backward, every rank calling it for the same batch (evaluation): `forward`'s output
    /// where this rank has the model's output (under a pipeline, the last stage only).
    pub fn forward_stage(&self, mut forward: impl FnMut() -> Result<Tensor>) -> Result<Option<Tensor>> {
        self.strategy.forward_stage(&self.params, &mut forward)
    }

    /// Ends the step: the strategy combines the gradients, clips, and applies the optimizer with `lr`.
    pub fn step(&mut self, lr: f64) -> Result<StepTimes> {
        if self.strategy.splits_model() {
            let scalars = std::mem::take(&mut self.scalars);
            self.strategy.attach_step_scalars(scalars);
        }
        let times = self.strategy.step(&self.params, &mut self.opt, lr, self.cfg.clip_grad_norm)?;
        if let Some(s) = &mut self.scaler {
            s.update(self.opt.take_skipped());
        }
        Ok(times)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use candle_core::{Device, Var};

    use super::*;
    use crate::strategy::TensorGrads;

    /// A strategy that records the trainer's calls and leaves the work to DDP.
    struct Recording {
        inner: Ddp,
        calls: Arc<Mutex<Vec<String>>>,
    }

    impl Recording {
        fn log(&self, s: String) {
            self.calls.lock().unwrap_or_else(|p| p.into_inner()).push(s);
        }
    }

    impl Strategy for Recording {
        fn name(&self) -> &'static str {
            "recording"
        }
        fn comm(&self) -> Option<&Communicator> {
            self.inner.comm()
        }
        fn init(&mut self, params: &Params) -> Result<()> {
            self.log("init".into());
            self.inner.init(params)
        }
        fn backward(
            &mut self,
            params: &Params,
            last: bool,
            scalars: Vec<Real>,
            f: &mut dyn FnMut(&mut dyn GradSink) -> Result<()>,
        ) -> Result<()> {
            self.log(format!("hand last={last} scalars={scalars:?}"));
            self.inner.backward(params, last, scalars, f)
        }
        fn backward_tensors(
            &mut self,
            params: &Params,
            last: bool,
            scalars: Vec<Real>,
            grads: TensorGrads,
        ) -> Result<()> {
            self.log(format!("autograd last={last} scalars={scalars:?}"));
            self.inner.backward_tensors(params, last, scalars, grads)
        }
        fn step(&mut self, params: &Params, opt: &mut Optimizer, lr: f64, clip: Option<f64>) -> Result<StepTimes> {
            self.log(format!("step lr={lr}"));
            self.inner.step(params, opt, lr, clip)
        }
    }

    fn quadratic() -> Result<Params> {
        let w = Var::from_vec(vec![1.0f32, -2.0, 4.0], 3, &Device::Cpu)?;
        Ok(Params::from_vars(vec![("w".into(), w)]))
    }

    /// Half the squared norm of `w`, times `weight`: its gradient is `weight * w`.
    fn loss(p: &Params, weight: f64) -> Result<Tensor> {
        let w = p.vars()[0].1.as_tensor();
        Ok(((w.sqr()?.sum_all()? * 0.5)? * weight)?)
    }

    #[test]
    fn the_trainer_drives_any_strategy_in_its_order() -> Result<()> {
        let cfg = TrainerConfig {
            optimizer: OptimConfig::Sgd { momentum: 0.0, weight_decay: 0.0 },
            ..TrainerConfig::default()
        };
        let calls = Arc::new(Mutex::new(Vec::new()));
        let rec = Recording { inner: Ddp::new(None, cfg.ddp()), calls: calls.clone() };
        let mut t = Trainer::with_strategy(quadratic()?, Box::new(rec), cfg.clone())?;
        assert_eq!(t.strategy_name(), "recording");
        // Two micro-batches of weight 1/2, then a hand-written one alone: the step's gradient is w each time.
        for _ in 0..2 {
            let l = loss(t.params(), 0.5)?;
            t.backward(Some(&l), false)?;
            t.attach_scalars(&[3.0]);
            let l = loss(t.params(), 0.5)?;
            t.backward(Some(&l), true)?;
            let st = t.step(0.5)?;
            assert_eq!(st.scalars, vec![3.0]);
        }
        t.backward_with(true, |sink| {
            sink.put(0, &mut |g| {
                g.copy_from_slice(&[1.0, 1.0, 1.0]);
                Ok(())
            })
        })?;
        t.step(0.5)?;
        let got = t.params().flatten()?;
        // w halves twice (w - 0.5 w), then loses 0.5 everywhere.
        assert_eq!(got, vec![0.25 - 0.5, -0.5 - 0.5, 1.0 - 0.5]);
        let calls = calls.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert_eq!(
            calls,
            vec![
                "init",
                "autograd last=false scalars=[]",
                "autograd last=true scalars=[3.0]",
                "step lr=0.5",
                "autograd last=false scalars=[]",
                "autograd last=true scalars=[3.0]",
                "step lr=0.5",
                "hand last=true scalars=[]",
                "step lr=0.5",
            ]
        );
        // The same run through plain DDP ends the same.
        let mut plain = Trainer::new(quadratic()?, None, cfg)?;
        assert_eq!(plain.strategy_name(), "ddp");
        for _ in 0..2 {
            let l = loss(plain.params(), 0.5)?;
            plain.backward(Some(&l), false)?;
            let l = loss(plain.params(), 0.5)?;
            plain.backward(Some(&l), true)?;
            plain.step(0.5)?;
        }
        assert_eq!(plain.params().flatten()?[..], [0.25, -0.5, 1.0]);
        Ok(())
    }

    #[test]
    fn overlap_needs_a_spare_core_for_every_local_rank() {
        // 2 one-thread workers on 2 cores: the communicator threads would share the computing cores.
        assert!(!core_free_per_rank(2, 1, 2));
        // The same workers on 4 cores: each has a core for its communicator thread.
        assert!(core_free_per_rank(2, 1, 4));
        // One worker whose compute threads take every core (candle's default).
        assert!(!core_free_per_rank(1, 8, 8));
        assert!(core_free_per_rank(1, 7, 8));
        // Unknown counts read as 1; absurd ones do not overflow.
        assert!(core_free_per_rank(0, 0, 2));
        assert!(!core_free_per_rank(usize::MAX, usize::MAX, 64));
    }
}
