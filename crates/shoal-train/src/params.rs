//! Named parameters in a fixed order, grouped into the model's layers, seeded initialisation, and flattening of
//! parameters and gradients into plain `f32` buffers (what the collectives move).

use candle_core::{DType, Device, Tensor, Var};

use crate::error::{Error, Result};
use crate::kernels::with_slice;
use crate::layers::Layers;

/// The seeded generator of initial weights: `shoal-data`'s SplitMix64 keyed by
/// the seed, so the same seed gives the same weights in every process and on
/// every platform.
#[derive(Debug, Clone)]
pub struct SeededRng(shoal_data::rng::SplitMix64);

impl SeededRng {
    pub fn new(seed: u64) -> Self {
        SeededRng(shoal_data::rng::SplitMix64::from_key(&[seed, 0x5EED_1417]))
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.0.unit_f64()
    }
}

/// The model's parameters, in a stable order (registration order), and the layers the model groups them in.
#[derive(Debug, Clone, Default)]
pub struct Params {
    vars: Vec<(String, Var)>,
    layers: Layers,
}

impl Params {
    /// Registers a parameter drawn uniformly from [-bound, bound].
    pub fn uniform(&mut self, rng: &mut SeededRng, name: &str, shape: &[usize], bound: f64) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32).collect();
        self.insert(name, Tensor::from_vec(data, shape, &Device::Cpu)?)
    }

    /// Registers a parameter filled with `value`.
    pub fn constant(&mut self, name: &str, shape: &[usize], value: f32) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        self.insert(name, Tensor::from_vec(vec![value; n], shape, &Device::Cpu)?)
    }

    fn insert(&mut self, name: &str, t: Tensor) -> Result<Tensor> {
        let v = Var::from_tensor(&t)?;
        let out = v.as_tensor().clone();
        self.vars.push((name.to_string(), v));
        Ok(out)
    }

    /// Starts layer `name`: the parameters registered after this call, up to the next one, are one layer — what a
    /// strategy that shards the parameters themselves (ZeRO-3) gathers together just before the model uses them
    /// (`crate::layers`). Returns the layer's index, for the model's calls to [`Self::layers`].
    pub fn layer(&mut self, name: &str) -> usize {
        self.layers.declare(name, self.vars.len())
    }

    /// The model's layers: the handle a model keeps to go through them (and a strategy installs its store in).
    pub fn layers(&self) -> &Layers {
        &self.layers
    }

    /// Adopts existing variables (for users' own candle models; no layers).
    pub fn from_vars(vars: Vec<(String, Var)>) -> Self {
        Params { vars, layers: Layers::default() }
    }

    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Number of scalar parameters.
    pub fn count(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// Every parameter, flattened in order, into one buffer.
    pub fn flatten(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.count());
        for (name, v) in &self.vars {
            let t = v.as_tensor();
            if t.dtype() == DType::F32 && t.is_contiguous() {
                // Read in place; a parameter whose values this rank does not hold (ZeRO-3) is an error, not a panic.
                with_slice(t, |s| out.extend_from_slice(s))
                    .map_err(|e| Error::InvalidArgument(format!("parameter {name}: {e}")))?;
            } else {
                out.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
            }
        }
        Ok(out)
    }

    /// Sets every parameter from one flat buffer (the inverse of [`Self::flatten`]).
    pub fn load_flat(&self, flat: &[f32]) -> Result<()> {
        let mut off = 0;
        for (name, v) in &self.vars {
            let n = v.elem_count();
            let Some(part) = flat.get(off..off + n) else {
                return Err(Error::InvalidArgument(format!("flat buffer too short for parameter {name}")));
            };
            v.set(&Tensor::from_slice(part, v.shape(), &Device::Cpu)?)?;
            off += n;
        }
        Ok(())
    }
}
