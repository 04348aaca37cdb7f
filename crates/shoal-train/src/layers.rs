//! Layer by layer access to a model's parameters: the seam through which a strategy that shards the parameters
//! themselves (ZeRO stage 3, `crate::strategy::zero3`) gives a model each layer's whole parameters just before the
//! model uses them, and frees them after.
//!
//! A model declares its layers as it registers its parameters (`Params::layer`: a layer is the parameters
//! registered after that call, up to the next one), keeps the [`Layers`] handle of its `Params`, and goes through
//! it layer by layer:
//! - an autograd forward runs each layer's computation through [`Layers::run`];
//! - a hand-written forward and backward enter each layer with [`Layers::forward_layer`] and
//!   [`Layers::backward_layer`], and compute with its parameters while the guard lives.
//!
//! With no [`LayerStore`] installed (every strategy but ZeRO-3) this costs nothing: the parameters are always
//! there, `run` calls the closure, the guards do nothing.
//!
//! With a store installed, the parameters' tensors hold nothing between uses (their shapes stay; their storage is
//! freed), and a training pass is one fixed sequence of collectives, the same on every rank whatever its data:
//! - forward, layers `0, 1, …, G-1`: each gathered (or the gather started during the layer before waited for),
//!   the next layer's gather started on the communicator's thread so it overlaps this layer's computation, the layer
//!   freed once computed — but the last one, which backward starts with;
//! - backward, layers `G-1, …, 0`: each gathered again (prefetching the one below), its gradients put into the
//!   strategy's sink (every parameter of the layer, in reverse order), then freed.
//!
//! A rank with no data for a micro-batch walks the same sequence (`Trainer::backward` with no loss, through
//! `crate::strategy::backward_by_layer`), and an evaluation pass a rank has no batch for walks the forward half
//! ([`Layers::idle_forward`]), so the ranks never fall out of step. Evaluation runs in an [`Layers::inference`]
//! scope: every layer freed after its forward, nothing recorded.
//!
//! Autograd: candle's backward runs over a whole graph at once, with no hook between operations, so a graph over
//! every layer would need every layer's parameters at once. [`Layers::run`] therefore cuts the graph at each
//! layer's output during a training forward: layer `l`'s input is a leaf variable (a copy of layer `l-1`'s output),
//! and the layer's output is kept, with the graph that computed it, on a tape. Backward then takes the layers from
//! the last: the loss's graph (which ends in the last layer) first, then for each layer below the graph of
//! `sum(y · dy)`, `dy` being the gradient of the next layer's input leaf — the same chain rule, one layer's graph at
//! a time, each with only its own layer's parameters present (refilled in place: the graph holds the same tensors).
//! Hence the one rule for a model: everything between its input and its output is computed inside its layers'
//! closures, and the last layer's output is what the loss is computed from.
//!
//! Pipeline stages (`crate::strategy::pipeline`) use the same rule: a rank that holds only layers `a..b` of the
//! model cuts it there ([`Layers::cut`]). The model's forward then runs only those layers: a layer before `a`
//! hands its input on untouched, layer `a` (when it is not the first) takes the activation the previous stage sent
//! ([`Layers::feed`]) in place of its input, and a layer from `b` on hands its input on, so the forward returns the
//! stage's output — the logits on the last stage.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use candle_core::{Tensor, Var};

use crate::error::{Error, Result};

/// What a strategy that shards parameters by layer provides ([`Layers::install`]).
pub trait LayerStore: Send + Sync {
    /// Makes layer `layer`'s parameters whole in their tensors — gathered now, or the gather started earlier
    /// waited for; nothing to do when they are there already — then starts gathering layer `next` in the background.
    fn acquire(&self, layer: usize, next: Option<usize>) -> Result<()>;

    /// Frees layer `layer`'s parameters: their tensors keep their shapes and hold nothing until acquired again.
    fn release(&self, layer: usize) -> Result<()>;

    /// Ends what a pass left behind: a gather in flight waited for and dropped, every layer still held freed.
    fn settle(&self) -> Result<()>;
}

/// One layer of a recorded training forward.
pub(crate) struct Taped {
    /// The layer's input as a leaf variable (none for the first layer, whose input is the model's).
    pub(crate) input: Option<Tensor>,
    /// Its output, with the graph that computed it.
    pub(crate) output: Tensor,
}

#[derive(Default)]
struct Inner {
    /// Each layer's name and the index of its first parameter.
    starts: Vec<(String, usize)>,
    store: Option<Arc<dyn LayerStore>>,
    /// Open inference scopes.
    inference: usize,
    /// The current training forward's layers so far.
    tape: Vec<Taped>,
    /// The layers this rank computes, when it is one stage of a pipeline, and the activation its first layer takes
    /// in the next forward.
    cut: Option<(Range<usize>, Option<Tensor>)>,
    /// Seconds each layer's computation took in the cut's forwards since timing was turned on
    /// ([`Layers::time_layers`]).
    timing: Option<Vec<f64>>,
}

/// A model's layers, shared by its `Params`, the model (which goes through it layer by layer) and the strategy
/// (which installs its store in it). Cheap to clone.
#[derive(Clone, Default)]
pub struct Layers(Arc<Mutex<Inner>>);

impl std::fmt::Debug for Layers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.lock();
        f.debug_struct("Layers")
            .field("layers", &g.starts.len())
            .field("sharded", &g.store.is_some())
            .finish_non_exhaustive()
    }
}

/// While it lives, a layer's parameters are whole in their tensors ([`Layers::forward_layer`],
/// [`Layers::backward_layer`]); dropped, they are freed again (unless the pass keeps them).
#[must_use = "the layer's parameters are freed when the guard is dropped"]
pub struct LayerGuard {
    release: Option<(Arc<dyn LayerStore>, usize)>,
}

impl std::fmt::Debug for LayerGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerGuard").field("layer", &self.release.as_ref().map(|(_, l)| *l)).finish()
    }
}

impl LayerGuard {
    /// Frees the layer now, reporting a failure (dropping the guard only logs it).
    pub fn release(mut self) -> Result<()> {
        match self.release.take() {
            Some((store, layer)) => store.release(layer),
            None => Ok(()),
        }
    }
}

impl Drop for LayerGuard {
    fn drop(&mut self) {
        if let Some((store, layer)) = self.release.take()
            && let Err(e) = store.release(layer)
        {
            tracing::warn!(layer, "a layer's parameters could not be freed: {e}");
        }
    }
}

/// An inference scope ([`Layers::inference`]).
#[must_use = "the scope ends when dropped"]
#[derive(Debug)]
pub struct Inference(Layers);

impl Drop for Inference {
    fn drop(&mut self) {
        let mut g = self.0.lock();
        g.inference = g.inference.saturating_sub(1);
    }
}

impl Layers {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts layer `name` at parameter index `start`; returns its index.
    pub(crate) fn declare(&self, name: &str, start: usize) -> usize {
        let mut g = self.lock();
        g.starts.push((name.to_string(), start));
        g.starts.len() - 1
    }

    /// How many layers the model declared.
    pub fn count(&self) -> usize {
        self.lock().starts.len()
    }

    /// Each layer's name and the range of its parameters' indices, for a model of `params` parameters. An error when
    /// the model declared no layer, or registered a parameter before its first one.
    pub fn ranges(&self, params: usize) -> Result<Vec<(String, Range<usize>)>> {
        let g = self.lock();
        match g.starts.first() {
            None => {
                return Err(Error::InvalidArgument(
                    "the model declares no layers (Params::layer): its parameters cannot be gathered layer by layer"
                        .into(),
                ));
            }
            Some((name, start)) if *start > 0 => {
                return Err(Error::InvalidArgument(format!(
                    "{start} parameters come before the model's first layer ({name}): every parameter must be in a \
                     layer"
                )));
            }
            Some(_) => {}
        }
        let mut out = Vec::with_capacity(g.starts.len());
        for (i, (name, start)) in g.starts.iter().enumerate() {
            let end = g.starts.get(i + 1).map_or(params, |(_, s)| *s);
            if end <= *start || end > params {
                return Err(Error::InvalidArgument(format!("layer {name} has no parameters")));
            }
            out.push((name.clone(), *start..end));
        }
        Ok(out)
    }

    /// Installs the store that gathers and frees the layers' parameters (a strategy's `init`, once the store has
    /// freed them).
    pub fn install(&self, store: Arc<dyn LayerStore>) {
        self.lock().store = Some(store);
    }

    /// Removes the installed store, if any (its strategy is gone): the parameters' tensors must be given whole
    /// values again before the model computes with them ([`crate::params::Params::unshard`]).
    pub fn uninstall(&self) {
        self.lock().store = None;
    }

    /// Whether a store gathers the layers (their parameters are not always there).
    pub fn is_sharded(&self) -> bool {
        self.lock().store.is_some()
    }

    /// The store, the number of layers, and whether a training pass runs (no inference scope open).
    fn state(&self) -> (Option<Arc<dyn LayerStore>>, usize, bool) {
        let g = self.lock();
        (g.store.clone(), g.starts.len(), g.inference == 0)
    }

    fn check(layer: usize, count: usize) -> Result<()> {
        if layer >= count {
            return Err(Error::InvalidArgument(format!("layer {layer} of a model of {count} layers")));
        }
        Ok(())
    }

    /// Enters layer `layer` in a forward pass: its parameters are whole while the guard lives, and the next layer's
    /// are being gathered. In a training pass the last layer stays whole after its guard for backward, and entering
    /// the first layer ends whatever an unfinished pass left.
    pub fn forward_layer(&self, layer: usize) -> Result<LayerGuard> {
        let (store, count, training) = self.state();
        let Some(store) = store else { return Ok(LayerGuard { release: None }) };
        Self::check(layer, count)?;
        if training && layer == 0 {
            self.lock().tape.clear();
            store.settle()?;
        }
        store.acquire(layer, (layer + 1 < count).then_some(layer + 1))?;
        let keep = training && layer + 1 == count;
        Ok(LayerGuard { release: (!keep).then_some((store, layer)) })
    }

    /// Enters layer `layer` in a backward pass (from the last layer down): its parameters are whole while the guard
    /// lives, and the layer below's are being gathered.
    pub fn backward_layer(&self, layer: usize) -> Result<LayerGuard> {
        let (store, count, _) = self.state();
        let Some(store) = store else { return Ok(LayerGuard { release: None }) };
        Self::check(layer, count)?;
        store.acquire(layer, layer.checked_sub(1))?;
        Ok(LayerGuard { release: Some((store, layer)) })
    }

    /// Runs layer `layer`'s computation `f` on `x` (the model's input for the first layer, the previous layer's
    /// output for the others) with the layer's parameters whole, and returns its output. In a training pass under a
    /// store the output is recorded for backward (`crate::strategy::backward_by_layer`) and, but for the last layer's, given
    /// back detached from its graph (see the module documentation).
    pub fn run(
        &self,
        layer: usize,
        x: &Tensor,
        f: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let (cut, timed) = {
            let g = self.lock();
            (g.cut.as_ref().map(|(r, _)| r.clone()), g.timing.is_some())
        };
        if let Some(r) = cut {
            if !r.contains(&layer) {
                return Ok(x.clone());
            }
            let started = timed.then(std::time::Instant::now);
            let y = if layer == r.start && layer > 0 {
                let input = self.lock().cut.as_mut().and_then(|(_, i)| i.take()).ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "layer {layer} starts this pipeline stage, and no activation came for it"
                    ))
                })?;
                f(&input)?
            } else {
                f(x)?
            };
            if let Some(t0) = started
                && let Some(slot) = self.lock().timing.as_mut().and_then(|t| t.get_mut(layer))
            {
                *slot += t0.elapsed().as_secs_f64();
            }
            return Ok(y);
        }
        let (store, count, training) = self.state();
        if store.is_none() {
            return f(x);
        }
        let guard = self.forward_layer(layer).map_err(candle_core::Error::wrap)?;
        if !training {
            let y = f(x)?;
            guard.release().map_err(candle_core::Error::wrap)?;
            return Ok(y);
        }
        // A leaf in place of the input: its gradient is what backward hands the layer below.
        let input = match layer > 0 && x.dtype().is_float() {
            true => Some(Var::from_tensor(&x.detach())?.as_tensor().clone()),
            false => None,
        };
        let y = f(input.as_ref().unwrap_or(x))?;
        guard.release().map_err(candle_core::Error::wrap)?;
        self.lock().tape.push(Taped { input, output: y.clone() });
        Ok(if layer + 1 == count { y } else { y.detach() })
    }

    /// Makes this rank compute only `layers` of the model in every forward (a pipeline stage; see the module
    /// documentation); `None` computes them all again.
    pub(crate) fn cut(&self, layers: Option<Range<usize>>) {
        self.lock().cut = layers.map(|r| (r, None));
    }

    /// Starts (`true`: from zero) or stops timing each layer's computation in the forwards of a cut model
    /// ([`Self::layer_times`]).
    pub(crate) fn time_layers(&self, on: bool) {
        let mut g = self.lock();
        g.timing = on.then(|| vec![0.0; g.starts.len()]);
    }

    /// Seconds each layer's computation took in this rank's forwards since [`Self::time_layers`] (zero for the
    /// layers of other stages); none when not timing.
    pub(crate) fn layer_times(&self) -> Option<Vec<f64>> {
        self.lock().timing.clone()
    }

    /// The layers this rank computes, when the model is cut into pipeline stages.
    pub fn stage_layers(&self) -> Option<Range<usize>> {
        self.lock().cut.as_ref().map(|(r, _)| r.clone())
    }

    /// The activation the first layer of this rank's stage takes in the next forward (what the previous stage sent).
    pub(crate) fn feed(&self, input: Tensor) {
        if let Some((_, slot)) = self.lock().cut.as_mut() {
            *slot = Some(input);
        }
    }

    /// Opens an inference scope: until it is dropped, forward passes record nothing and free every layer after
    /// its use (evaluation).
    pub fn inference(&self) -> Inference {
        self.lock().inference += 1;
        Inference(self.clone())
    }

    /// Takes part in a forward pass without computing: every layer entered and left in order, so this rank's
    /// collectives match those of the ranks that have data.
    pub fn idle_forward(&self) -> Result<()> {
        for layer in 0..self.count() {
            drop(self.forward_layer(layer)?);
        }
        Ok(())
    }

    /// The layers the current training forward recorded, taken.
    pub(crate) fn take_tape(&self) -> Vec<Taped> {
        std::mem::take(&mut self.lock().tape)
    }
}
