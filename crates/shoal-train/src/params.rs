//! Named parameters in a fixed order, seeded initialisation, and flattening of
//! parameters and gradients into plain `f32` buffers (what the collectives move).

use candle_core::{DType, Device, Tensor, Var};

use crate::error::Result;

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

/// The model's parameters, in a stable order (registration order).
#[derive(Debug, Clone, Default)]
pub struct Params {
    vars: Vec<(String, Var)>,
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

    /// Adopts existing variables (for users' own candle models).
    pub fn from_vars(vars: Vec<(String, Var)>) -> Self {
        Params { vars }
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
        for (_, v) in &self.vars {
            out.extend(v.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        Ok(out)
    }

    /// Sets every parameter from one flat buffer (the inverse of [`Self::flatten`]).
    pub fn load_flat(&self, flat: &[f32]) -> Result<()> {
        let mut off = 0;
        for (name, v) in &self.vars {
            let n = v.elem_count();
            let Some(part) = flat.get(off..off + n) else {
                return Err(crate::Error::InvalidArgument(format!("flat buffer too short for parameter {name}")));
            };
            v.set(&Tensor::from_slice(part, v.shape(), &Device::Cpu)?)?;
            off += n;
        }
        Ok(())
    }
}
