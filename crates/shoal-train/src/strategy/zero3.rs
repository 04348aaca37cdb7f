//! ZeRO stage 3's parameters: this rank's shard of them (its slice of every layer — the layers are stage 3's
//! buckets, `super::shards`), and the [`LayerStore`] that gathers a layer's whole parameters into the model's
//! tensors just before the model uses them and frees them after (`crate::layers`), the next layer's gather under way
//! on the communicator's thread while the current one computes.
//!
//! The model's parameter tensors keep their shapes; what they hold is replaced in place
//! (`crate::kernels::replace_storage`): a layer's values while it is entered, nothing otherwise. So between steps a
//! rank holds its shard and no whole layer; during a pass, at most the layer in use and the one being gathered
//! (briefly also a gathered bucket being copied into its tensors). [`LayerShards::held_bytes`] reports that from the
//! buffers themselves: the shard, and the most bytes of whole layers held at once so far.

use crate::{REAL_BYTES, Real};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use candle_core::Tensor;

use super::shards::{Gather, Shards};
use crate::error::{Error, Result};
use crate::kernels::replace_storage;
use crate::layers::LayerStore;
use crate::params::Params;

/// One layer: its bucket and its parameters' tensors, each with its offset in the bucket.
struct Slot {
    bucket: usize,
    params: Vec<(Tensor, usize)>,
    /// Bytes of the layer's values.
    bytes: usize,
}

struct State {
    /// This rank's shard of the parameters (zeros in the padding).
    shard: Vec<Real>,
    /// Which layers are whole in their tensors.
    resident: Vec<bool>,
    /// The gather started for the next layer, and the bytes it brings.
    pending: Option<(usize, Gather, usize)>,
    /// Bytes of whole layers (and of gathers in flight) held now, and the most at once.
    held: usize,
    peak: usize,
}

impl State {
    fn grow(&mut self, bytes: usize) {
        self.held += bytes;
        self.peak = self.peak.max(self.held);
    }

    fn shrink(&mut self, bytes: usize) {
        self.held = self.held.saturating_sub(bytes);
    }
}

/// The parameter shard and the layer store (see the module documentation).
pub(crate) struct LayerShards {
    shards: Arc<Shards>,
    layers: Vec<Slot>,
    /// Gather the next layer while the current one computes (else each layer when it is entered).
    prefetch: bool,
    state: Mutex<State>,
}

impl std::fmt::Debug for LayerShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerShards").field("layers", &self.layers.len()).finish_non_exhaustive()
    }
}

impl LayerShards {
    /// Takes this rank's shard of `params` (whole in their tensors now; the buckets of `shards` are the model's
    /// layers, from the last down) and frees every layer.
    pub(crate) fn new(shards: Arc<Shards>, params: &Params, prefetch: bool) -> Result<LayerShards> {
        let count = shards.buckets.len();
        let mut layers = Vec::with_capacity(count);
        for l in 0..count {
            let bucket = count - 1 - l;
            let (members, flat) = &shards.buckets[bucket];
            let mut slot = Slot { bucket, params: Vec::new(), bytes: flat.len() * REAL_BYTES };
            for i in members.clone() {
                let (name, var) = &params.vars()[i];
                let t = var.as_tensor();
                let (storage, layout) = t.storage_and_layout();
                crate::kernels::cpu_f32(&storage, layout)
                    .map_err(|e| Error::InvalidArgument(format!("parameter {name} cannot be sharded by layer: {e}")))?;
                if layout.start_offset() != 0 {
                    return Err(Error::InvalidArgument(format!("parameter {name} is a view into another tensor")));
                }
                drop(storage);
                slot.params.push((t.clone(), shards.offsets[i] - flat.start));
            }
            layers.push(slot);
        }
        let shard = shards.read_shard(params)?;
        let held = layers.iter().map(|s| s.bytes).sum();
        let state = State { shard, resident: vec![true; count], pending: None, held, peak: 0 };
        let store = LayerShards { shards, layers, prefetch, state: Mutex::new(state) };
        for l in 0..count {
            store.release(l)?;
        }
        Ok(store)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on this rank's shard of the parameters (the optimizer's update, in place).
    pub(crate) fn with_shard<R>(&self, f: impl FnOnce(&mut [Real]) -> R) -> R {
        f(&mut self.lock().shard)
    }

    /// Every rank's shard gathered into the whole flat parameter space (a collective).
    pub(crate) fn gather_all(&self) -> Result<Vec<Real>> {
        let s = self.lock();
        self.shards.gather(&s.shard)
    }

    /// Bytes of parameters this rank holds: its shard, and the most bytes of whole layers it has held at once.
    pub(crate) fn held_bytes(&self) -> usize {
        let s = self.lock();
        s.shard.capacity() * REAL_BYTES + s.peak
    }

    fn check(&self, layer: usize) -> Result<()> {
        if layer >= self.layers.len() {
            return Err(Error::InvalidArgument(format!("layer {layer} of {} layers", self.layers.len())));
        }
        Ok(())
    }

    /// Puts a gathered bucket's values into its layer's tensors: the largest parameter takes the gathered buffer
    /// itself (its values moved to the front, the rest cut off), so a layer is not held twice while it is copied.
    fn fill(&self, s: &mut State, layer: usize, mut gathered: Vec<Real>) -> Result<()> {
        let slot = &self.layers[layer];
        // Counted since its gather started.
        let bucket_bytes = gathered.capacity() * REAL_BYTES;
        let short = |off: usize, n: usize| {
            Error::InvalidArgument(format!("layer {layer}: gathered {} values, {} wanted", gathered.len(), off + n))
        };
        let largest = (0..slot.params.len()).max_by_key(|&k| slot.params[k].0.elem_count()).unwrap_or(0);
        for (_, (t, off)) in slot.params.iter().enumerate().filter(|&(k, _)| k != largest) {
            let n = t.elem_count();
            let values = gathered.get(*off..*off + n).ok_or_else(|| short(*off, n))?;
            replace_storage(t, values.to_vec())?;
            s.grow(n * REAL_BYTES);
        }
        if let Some(&(ref t, off)) = slot.params.get(largest) {
            let n = t.elem_count();
            if gathered.len() < off + n {
                return Err(short(off, n));
            }
            gathered.copy_within(off..off + n, 0);
            gathered.truncate(n);
            gathered.shrink_to_fit();
            replace_storage(t, gathered)?;
            s.shrink(bucket_bytes);
            s.grow(n * REAL_BYTES);
        }
        s.resident[layer] = true;
        Ok(())
    }
}

impl LayerStore for LayerShards {
    fn acquire(&self, layer: usize, next: Option<usize>) -> Result<()> {
        self.check(layer)?;
        let mut s = self.lock();
        if !s.resident[layer] {
            let gathered = match s.pending.take() {
                Some((l, g, _)) if l == layer => g.wait()?,
                other => {
                    // Not what was prefetched (every rank runs the same sequence, so every rank is here): the
                    // prefetch is waited for and dropped, the layer gathered now.
                    if let Some((_, g, bytes)) = other {
                        g.wait()?;
                        s.shrink(bytes);
                    }
                    let bytes = self.shards.slice_len(self.layers[layer].bucket) * self.shards.world() * REAL_BYTES;
                    s.grow(bytes);
                    self.shards.gather_bucket(self.layers[layer].bucket, &s.shard)?
                }
            };
            self.fill(&mut s, layer, gathered)?;
        }
        if let Some(n) = next.filter(|_| self.prefetch) {
            self.check(n)?;
            if !s.resident[n] && s.pending.is_none() {
                let bucket = self.layers[n].bucket;
                let bytes = self.shards.slice_len(bucket) * self.shards.world() * REAL_BYTES;
                let g = self.shards.gather_bucket_async(bucket, &s.shard);
                s.grow(bytes);
                s.pending = Some((n, g, bytes));
            }
        }
        Ok(())
    }

    fn release(&self, layer: usize) -> Result<()> {
        self.check(layer)?;
        let mut s = self.lock();
        if s.resident[layer] {
            for (t, _) in &self.layers[layer].params {
                replace_storage(t, Vec::new())?;
            }
            s.resident[layer] = false;
            s.shrink(self.layers[layer].bytes);
        }
        Ok(())
    }

    fn settle(&self) -> Result<()> {
        let pending = self.lock().pending.take();
        if let Some((_, g, bytes)) = pending {
            let waited = g.wait();
            self.lock().shrink(bytes);
            waited?;
        }
        for l in 0..self.layers.len() {
            self.release(l)?;
        }
        Ok(())
    }
}
