//! Named parameters in a fixed order, grouped into the model's layers, seeded initialisation, and flattening of
//! parameters and gradients into plain `Real` buffers (what the collectives move).

use crate::{REAL_DTYPE, Real};
use candle_core::{Device, Tensor, Var};

use crate::error::{Error, Result};
use crate::kernels::with_slice;
use crate::layers::Layers;
use crate::tensor_parallel::{Shard, Split};

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

/// The model's parameters, in a stable order (registration order), and the layers the model groups them in. Under
/// tensor parallelism ([`Params::tensor_parallel`]) a split parameter holds only this rank's part, under its full
/// name, and remembers how it was cut ([`Params::split`]).
#[derive(Debug, Clone, Default)]
pub struct Params {
    vars: Vec<(String, Var)>,
    layers: Layers,
    /// Per parameter, how it is cut across the tensor-parallel group (`None`: whole on every rank).
    splits: Vec<Option<Split>>,
    shard: Option<Shard>,
    /// What a model built on these computes its passes in (`None`: [`REAL_DTYPE`]); the parameters themselves are
    /// always `REAL_DTYPE` (`crate::precision`).
    compute: Option<candle_core::DType>,
    /// Where a model built on these computes (`None`: the CPU).
    device: Option<Device>,
    /// The parameters are held where the model computes ([`Params::set_resident`]), not on the host: their
    /// gradients stay there, the optimizer updates them there, and only what crosses ranks is staged through the
    /// host.
    resident: bool,
}

impl Params {
    /// Registers a parameter drawn uniformly from [-bound, bound].
    pub fn uniform(&mut self, rng: &mut SeededRng, name: &str, shape: &[usize], bound: f64) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let data: Vec<Real> = (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as Real).collect();
        self.insert(name, Tensor::from_vec(data, shape, &Device::Cpu)?)
    }

    /// Registers a parameter filled with `value`.
    pub fn constant(&mut self, name: &str, shape: &[usize], value: Real) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        self.insert(name, Tensor::from_vec(vec![value; n], shape, &Device::Cpu)?)
    }

    fn insert(&mut self, name: &str, t: Tensor) -> Result<Tensor> {
        let t = match (&self.device, self.resident) {
            (Some(d), true) => t.to_device(d)?,
            _ => t,
        };
        let v = Var::from_tensor(&t)?;
        let out = v.as_tensor().clone();
        self.vars.push((name.to_string(), v));
        self.splits.push(None);
        Ok(out)
    }

    /// Sets what a model built on these from now on computes in (`crate::precision`): the parameters stay
    /// [`REAL_DTYPE`].
    pub fn set_compute(&mut self, dtype: candle_core::DType) {
        self.compute = Some(dtype);
    }

    /// Sets where a model built on these from now on computes (`crate::device`): the parameters registered from
    /// now on stay on the host (see [`Self::set_resident`]).
    pub fn set_device(&mut self, device: Device) {
        self.device = Some(device);
        self.resident = false;
    }

    /// Sets where a model built on these from now on computes, and holds the parameters registered from now on
    /// there: the optimizer updates them on `device` (with tensor operations rather than host loops), their
    /// gradients stay there, and a strategy stages through the host only what crosses ranks — a bucket at a time.
    /// What data parallelism on a GPU runs on; on the CPU it is the same arithmetic by another path (what tests
    /// check it by).
    pub fn set_resident(&mut self, device: Device) {
        self.device = Some(device);
        self.resident = true;
    }

    /// Whether the parameters are held where the model computes ([`Self::set_resident`]; a model built on
    /// [`Self::from_vars`] whose variables are on a device is too).
    pub fn resident(&self) -> bool {
        self.resident
    }

    /// Where and in what a model built on these computes.
    pub fn compute(&self) -> crate::precision::Compute {
        crate::precision::Compute {
            dtype: self.compute.unwrap_or(REAL_DTYPE),
            device: self.device.clone().unwrap_or(Device::Cpu),
        }
    }

    /// Parameters for the model of rank `shard.rank()` of a tensor-parallel group (`crate::tensor_parallel`).
    pub fn tensor_parallel(shard: Shard) -> Self {
        Params { shard: Some(shard), ..Params::default() }
    }

    /// This rank's place in its tensor-parallel group, when the model is built for one of more than one rank.
    pub fn shard(&self) -> Option<&Shard> {
        self.shard.as_ref().filter(|s| s.parts() > 1)
    }

    /// Registers a parameter drawn like [`Self::uniform`] (the same values, whatever the group), of which a
    /// tensor-parallel rank keeps only its part: dimension `dim` cut into `groups` equal blocks, each shared among
    /// the group's ranks (see [`Split`]). Whole without a group.
    pub fn uniform_split(
        &mut self,
        rng: &mut SeededRng,
        name: &str,
        shape: &[usize],
        bound: f64,
        dim: usize,
        groups: usize,
    ) -> Result<Tensor> {
        let Some(shard) = self.shard().cloned() else { return self.uniform(rng, name, shape, bound) };
        let n: usize = shape.iter().product();
        let data: Vec<Real> = (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as Real).collect();
        let split = Split { dim, groups, full: shape.to_vec() };
        let part = split
            .take(&data, shard.rank(), shard.parts())
            .map_err(|e| Error::InvalidArgument(format!("parameter {name}: {e}")))?;
        let t = self.insert(name, Tensor::from_vec(part, split.shard_dims(shard.parts())?, &Device::Cpu)?)?;
        if let Some(last) = self.splits.last_mut() {
            *last = Some(split);
        }
        Ok(t)
    }

    /// How parameter `index` is cut across the tensor-parallel group (`None`: whole).
    pub fn split(&self, index: usize) -> Option<&Split> {
        self.splits.get(index).and_then(Option::as_ref)
    }

    /// The whole shape of parameter `index` (its own, unless it is split).
    pub fn full_dims(&self, index: usize) -> Vec<usize> {
        match (self.split(index), self.vars.get(index)) {
            (Some(s), _) => s.full.clone(),
            (None, Some((_, v))) => v.dims().to_vec(),
            (None, None) => Vec::new(),
        }
    }

    /// Number of scalar parameters of the whole model (this rank's, [`Self::count`], are fewer under tensor
    /// parallelism).
    pub fn full_count(&self) -> usize {
        (0..self.vars.len()).map(|i| self.full_dims(i).iter().product::<usize>()).sum()
    }

    /// Sets parameter `index` from its whole values (a checkpoint's): a split parameter keeps its part.
    pub fn set_whole(&self, index: usize, values: &[Real]) -> Result<()> {
        let Some((name, var)) = self.vars.get(index) else {
            return Err(Error::InvalidArgument(format!("no parameter {index}")));
        };
        let part = match (self.split(index), self.shard()) {
            (Some(split), Some(shard)) => split
                .take(values, shard.rank(), shard.parts())
                .map_err(|e| Error::InvalidArgument(format!("parameter {name}: {e}")))?,
            _ => values.to_vec(),
        };
        if part.len() != var.elem_count() {
            return Err(Error::InvalidArgument(format!(
                "parameter {name}: {} values for shape {:?}",
                values.len(),
                self.full_dims(index)
            )));
        }
        var.set(&Tensor::from_vec(part, var.shape(), var.device())?)?;
        Ok(())
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
    ///
    /// Variables made on a device (a candle model built there) make the parameters resident there
    /// ([`Self::set_resident`]).
    pub fn from_vars(vars: Vec<(String, Var)>) -> Self {
        let splits = vec![None; vars.len()];
        let device = vars.iter().map(|(_, v)| v.device()).find(|d| !d.is_cpu()).cloned();
        let resident = device.is_some();
        Params { vars, layers: Layers::default(), splits, shard: None, compute: None, device, resident }
    }

    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Number of scalar parameters.
    pub fn count(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// Every parameter, flattened in order, into one buffer.
    pub fn flatten(&self) -> Result<Vec<Real>> {
        let mut out = Vec::with_capacity(self.count());
        for (name, v) in &self.vars {
            let t = v.as_tensor();
            if t.dtype() == REAL_DTYPE && t.is_contiguous() && t.device().is_cpu() {
                // Read in place; a parameter whose values this rank does not hold (ZeRO-3) is an error, not a panic.
                with_slice(t, |s| out.extend_from_slice(s))
                    .map_err(|e| Error::InvalidArgument(format!("parameter {name}: {e}")))?;
            } else {
                out.extend(t.flatten_all()?.to_dtype(REAL_DTYPE)?.to_vec1::<Real>()?);
            }
        }
        Ok(out)
    }

    /// Takes the parameters back from a strategy that shards them (ZeRO-3's layer store, which leaves them holding
    /// nothing between uses): the store is removed and every tensor holds whole values again — `whole`'s, by
    /// parameter name, where given, else zeros until they are set. Without a store installed it changes nothing but
    /// the tensors `whole` names.
    pub fn unshard(&self, whole: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        let sharded = self.layers.is_sharded();
        self.layers.uninstall();
        for (name, var) in &self.vars {
            match whole.get(name) {
                Some(t) if t.elem_count() == var.elem_count() => {
                    crate::kernels::replace_storage(var.as_tensor(), t.flatten_all()?.to_vec1::<Real>()?)?
                }
                Some(t) => {
                    return Err(Error::InvalidArgument(format!(
                        "parameter {name}: {} values for shape {:?}",
                        t.elem_count(),
                        var.dims()
                    )));
                }
                None if sharded => crate::kernels::replace_storage(var.as_tensor(), vec![0.0; var.elem_count()])?,
                None => {}
            }
        }
        Ok(())
    }

    /// Sets every parameter from one flat buffer (the inverse of [`Self::flatten`]).
    pub fn load_flat(&self, flat: &[Real]) -> Result<()> {
        let mut off = 0;
        for (name, v) in &self.vars {
            let n = v.elem_count();
            let Some(part) = flat.get(off..off + n) else {
                return Err(Error::InvalidArgument(format!("flat buffer too short for parameter {name}")));
            };
            v.set(&Tensor::from_slice(part, v.shape(), v.device())?)?;
            off += n;
        }
        Ok(())
    }
}
