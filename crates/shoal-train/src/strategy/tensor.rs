//! Tensor parallel (Megatron-LM style): every rank of a group of `parts` runs every layer of the model on the whole
//! global batch, holding only its part of each split parameter — attention heads, MLP hidden units, a slice of the
//! vocabulary — and the optimizer state of that part.
//!
//! The model does the work (`crate::tensor_parallel`: built on `Params::tensor_parallel`, its forward all-reduces
//! row-parallel outputs and its backward column-parallel inputs' gradients through custom autograd operations), so
//! one micro-batch is one ordinary forward and backward. The strategy:
//! - [`Strategy::init`]: connects the model's group to the communicator (its size and rank must be the ones the
//!   model was built for) and makes every replicated parameter rank 0's (a broadcast); the split ones are each
//!   rank's part of the same seeded (or checkpointed) whole.
//! - [`Strategy::backward_tensors`]: adds the micro-batch's gradients of this rank's parameters into the step's sums.
//! - [`Strategy::step`]: the replicated parameters' gradients made rank 0's (a broadcast: they are the same on every
//!   rank already, see `crate::tensor_parallel`, and this keeps the copies identical bit for bit), the global norm
//!   for clipping (the split parameters' squared norms summed over the group, the replicated ones' counted once, in
//!   one all-reduce with the step's scalars), then the optimizer on this rank's parameters. The scalars (every
//!   rank's loss is the whole batch's) are averaged over the group.
//! - Checkpoints hold whole tensors by their full names, as every strategy's: the parts of each split parameter and
//!   of its optimizer moments all-gathered and put back in place (`crate::tensor_parallel::Split`). Loading cuts
//!   them again, so a tensor-parallel checkpoint resumes under DDP at any world size and a DDP one under tensor
//!   parallelism.
//!
//! Memory: each rank's parameters, gradients and optimizer state are its parts plus the replicated parameters —
//! what [`Strategy::param_bytes`] and the others report, since the model's tensors are the parts themselves.

use crate::Real;
use std::collections::HashMap;
use std::time::Instant;

use candle_core::Tensor;
use shoal_comm::{Communicator, ReduceOp};

use super::{GradSink, StepTimes, Strategy, TensorGrads, check_order};
use crate::error::{Error, Result};
use crate::kernels::with_slice;
use crate::optim::{Optimizer, sum_sq};
use crate::params::Params;
use crate::tensor_parallel::Split;

/// Tensor parallel (see the module documentation).
pub struct TensorParallel {
    comm: Option<Communicator>,
    parts: usize,
    /// Gradients summed over the step's micro-batches, per parameter.
    acc: Vec<Vec<Real>>,
    scalars: Vec<Real>,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallel").field("parts", &self.parts).finish_non_exhaustive()
    }
}

/// Adds a hand-written backward pass's gradients into the step's sums (`acc`: one buffer per parameter).
pub(crate) struct Adder<'a> {
    pub(crate) acc: &'a mut [Vec<Real>],
    pub(crate) next: Option<usize>,
    pub(crate) scalars: Option<Vec<Real>>,
}

impl GradSink for Adder<'_> {
    fn put(&mut self, index: usize, fill: &mut dyn FnMut(&mut [Real]) -> Result<()>) -> Result<()> {
        check_order(index, self.acc.len(), self.next)?;
        let mut buf = vec![0.0 as Real; self.acc[index].len()];
        fill(&mut buf)?;
        self.acc[index].iter_mut().zip(&buf).for_each(|(a, g)| *a += g);
        self.next = index.checked_sub(1);
        Ok(())
    }

    fn attach_scalars(&mut self, values: &[Real]) {
        self.scalars = Some(values.to_vec());
    }
}

impl TensorParallel {
    /// A rank of the tensor-parallel group `comm` (all its ranks).
    pub fn new(comm: Option<Communicator>) -> TensorParallel {
        let parts = comm.as_ref().map_or(1, Communicator::size);
        TensorParallel { comm, parts, acc: Vec::new(), scalars: Vec::new() }
    }

    fn comm_or_err(&self) -> Result<&Communicator> {
        self.comm.as_ref().ok_or_else(|| Error::InvalidArgument("tensor parallelism needs a communicator".into()))
    }

    /// Indices of the parameters whole on every rank.
    fn replicated(params: &Params) -> Vec<usize> {
        (0..params.vars().len()).filter(|&i| params.split(i).is_none()).collect()
    }

    /// Whole named tensors from `items` (name, how it is cut, this rank's values): see [`gather_parts`].
    fn gather(&self, items: Vec<(String, Option<Split>, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        let (names, parts): (Vec<_>, Vec<_>) = items
            .into_iter()
            .map(|(name, split, t)| {
                let dims = split.as_ref().map_or_else(|| t.dims().to_vec(), |s| s.full.clone());
                Ok(((name, dims), (split, t.flatten_all()?.to_vec1::<Real>()?)))
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let wholes = gather_parts(self.comm_or_err()?, parts)?;
        names
            .into_iter()
            .zip(wholes)
            .map(|((name, dims), v)| Ok((name, Tensor::from_vec(v, dims, &candle_core::Device::Cpu)?)))
            .collect()
    }
}

/// Whole values from `items` (how each is cut, this rank's values) on every rank of the tensor-parallel group
/// `comm`: the split ones' parts all-gathered (one collective for all of them) and put in place, the others as they
/// are.
pub(crate) fn gather_parts(comm: &Communicator, items: Vec<(Option<Split>, Vec<Real>)>) -> Result<Vec<Vec<Real>>> {
    let parts = comm.size();
    let mut local = Vec::new();
    let mut at = Vec::with_capacity(items.len());
    for (split, v) in &items {
        if split.is_some() {
            at.push(Some((local.len(), v.len())));
            local.extend_from_slice(v);
        } else {
            at.push(None);
        }
    }
    let n = local.len();
    let mut all = vec![0.0 as Real; n * parts];
    comm.all_gather(&local, &mut all)?;
    items
        .into_iter()
        .zip(at)
        .map(|((split, v), at)| match (split, at) {
            (Some(split), Some((o, l))) => {
                let shards: Vec<&[Real]> = (0..parts).map(|r| &all[r * n + o..r * n + o + l]).collect();
                split.place(&shards)
            }
            _ => Ok(v),
        })
        .collect()
}

/// Connects the model's tensor-parallel group to `comm` (its size and rank must be the ones the model was built
/// for) and makes every replicated parameter rank 0's (a broadcast); the split ones are each rank's part of the same
/// seeded (or checkpointed) whole.
pub(crate) fn connect_group(comm: &Communicator, params: &Params) -> Result<()> {
    if comm.size() < 2 {
        return Err(Error::InvalidArgument(format!("tensor parallelism needs at least 2 ranks, not {}", comm.size())));
    }
    let shard = params.shard().ok_or_else(|| {
        Error::InvalidArgument(
            "the model was not built for tensor parallelism (Params::tensor_parallel with a group of more than one \
             rank)"
                .into(),
        )
    })?;
    if (0..params.vars().len()).all(|i| params.split(i).is_none()) {
        return Err(Error::InvalidArgument("the model splits none of its parameters across the group".into()));
    }
    shard.connect(comm.clone())?;
    let replicated = TensorParallel::replicated(params);
    let mut flat = Vec::new();
    for &i in &replicated {
        with_slice(params.vars()[i].1.as_tensor(), |s| flat.extend_from_slice(s))?;
    }
    comm.broadcast(&mut flat, 0)?;
    let mut off = 0;
    for &i in &replicated {
        let var = &params.vars()[i].1;
        let n = var.elem_count();
        var.set(&Tensor::from_slice(&flat[off..off + n], var.shape(), &candle_core::Device::Cpu)?)?;
        off += n;
    }
    Ok(())
}

/// Makes rank 0's gradients of the replicated parameters (`acc[k]` for each `k` of `replicated`) every rank's of
/// the tensor-parallel group `comm` (one broadcast): they are the same already, and this keeps them so bit for bit.
pub(crate) fn broadcast_grads(comm: &Communicator, acc: &mut [Vec<Real>], replicated: &[usize]) -> Result<()> {
    let mut flat: Vec<Real> = replicated.iter().flat_map(|&i| acc[i].iter().copied()).collect();
    comm.broadcast(&mut flat, 0)?;
    let mut off = 0;
    for &i in replicated {
        let n = acc[i].len();
        acc[i].copy_from_slice(&flat[off..off + n]);
        off += n;
    }
    Ok(())
}

impl Strategy for TensorParallel {
    fn name(&self) -> &'static str {
        "tensor"
    }

    fn comm(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }

    fn init(&mut self, params: &Params) -> Result<()> {
        connect_group(self.comm_or_err()?, params)?;
        self.acc = params.vars().iter().map(|(_, v)| vec![0.0 as Real; v.elem_count()]).collect();
        Ok(())
    }

    fn backward(
        &mut self,
        _params: &Params,
        last: bool,
        scalars: Vec<Real>,
        f: &mut dyn FnMut(&mut dyn GradSink) -> Result<()>,
    ) -> Result<()> {
        let next = self.acc.len().checked_sub(1);
        let mut sink = Adder { acc: &mut self.acc, next, scalars: None };
        f(&mut sink)?;
        if last {
            self.scalars = sink.scalars.unwrap_or(scalars);
        }
        Ok(())
    }

    fn backward_tensors(&mut self, params: &Params, last: bool, scalars: Vec<Real>, grads: TensorGrads) -> Result<()> {
        super::add_tensors(&mut self.acc, params, &grads)?;
        if last {
            self.scalars = scalars;
        }
        Ok(())
    }

    fn tensor_degree(&self) -> usize {
        self.parts
    }

    fn step(&mut self, params: &Params, opt: &mut Optimizer, lr: f64, clip: Option<f64>) -> Result<StepTimes> {
        let comm = self.comm_or_err()?.clone();
        let t0 = Instant::now();
        let replicated = Self::replicated(params);
        broadcast_grads(&comm, &mut self.acc, &replicated)?;
        let split_sq: f64 =
            (0..self.acc.len()).filter(|&i| params.split(i).is_some()).map(|i| sum_sq(&self.acc[i])).sum();
        let replicated_sq: f64 = replicated.iter().map(|&i| sum_sq(&self.acc[i])).sum();
        let mut sums = vec![split_sq];
        sums.extend(self.scalars.iter().map(|&v| f64::from(v)));
        comm.all_reduce(&mut sums, ReduceOp::Sum)?;
        let shard_s = params.shard().map_or(0.0, |s| s.take_comm_seconds());
        let comm_s = t0.elapsed().as_secs_f64() + shard_s;
        let t1 = Instant::now();
        let norm = (sums[0] + replicated_sq).sqrt();
        if let Some(c) = clip
            && norm > c
            && norm > 0.0
        {
            let s = (c / norm) as Real;
            self.acc.iter_mut().for_each(|g| g.iter_mut().for_each(|x| *x *= s));
        }
        let grads: Vec<&[Real]> = self.acc.iter().map(Vec::as_slice).collect();
        opt.step_slices(params, &grads, lr)?;
        self.acc.iter_mut().for_each(|g| g.fill(0.0));
        let parts = self.parts as f64;
        Ok(StepTimes {
            comm_s,
            optimizer_s: t1.elapsed().as_secs_f64(),
            grad_norm: clip.map(|_| norm),
            scalars: sums[1..].iter().map(|v| (v / parts) as Real).collect(),
            bubble: None,
        })
    }

    fn model_state(&self, params: &Params) -> Result<Vec<(String, Tensor)>> {
        let items = params
            .vars()
            .iter()
            .enumerate()
            .map(|(i, (n, v))| (n.clone(), params.split(i).cloned(), v.as_tensor().clone()))
            .collect();
        self.gather(items)
    }

    fn optimizer_state(&self, params: &Params, opt: &Optimizer) -> Result<Vec<(String, Tensor)>> {
        let state: HashMap<String, Tensor> = opt.state(params).into_iter().collect();
        let mut items = Vec::new();
        for (i, (name, _)) in params.vars().iter().enumerate() {
            for suffix in ["m", "v"] {
                let key = format!("{name}.{suffix}");
                if let Some(t) = state.get(&key) {
                    items.push((key, params.split(i).cloned(), t.clone()));
                }
            }
        }
        self.gather(items)
    }

    fn load_optimizer_state(
        &mut self,
        params: &Params,
        opt: &mut Optimizer,
        t: u64,
        named: &HashMap<String, Tensor>,
    ) -> Result<()> {
        let Some(shard) = params.shard() else { return opt.load_state(params, t, named) };
        let mut own = HashMap::with_capacity(named.len());
        for (i, (name, var)) in params.vars().iter().enumerate() {
            for suffix in ["m", "v"] {
                let key = format!("{name}.{suffix}");
                let Some(whole) = named.get(&key) else { continue };
                let part = match params.split(i) {
                    Some(split) if whole.dims() == split.full.as_slice() => {
                        let values = whole.flatten_all()?.to_vec1::<Real>()?;
                        Tensor::from_vec(
                            split.take(&values, shard.rank(), shard.parts())?,
                            var.shape(),
                            whole.device(),
                        )?
                    }
                    Some(split) => {
                        return Err(Error::Checkpoint(format!(
                            "optimizer state {key} has shape {:?}, the parameter {:?}",
                            whole.dims(),
                            split.full
                        )));
                    }
                    None => whole.clone(),
                };
                own.insert(key, part);
            }
        }
        opt.load_state(params, t, &own)
    }
}
