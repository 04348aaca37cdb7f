//! Tensor parallelism on the model side (Megatron-LM style): how a parameter is cut across the ranks of a
//! tensor-parallel group ([`Split`]), this rank's place in the group ([`Shard`]), and the few communicating
//! operations a model needs to compute with its shards — the seam through which `crate::strategy::tensor` runs a
//! model split across ranks, as `crate::layers` is the one through which ZeRO-3 and pipelines run it.
//!
//! A model built on `Params::tensor_parallel` registers its split parameters with `Params::uniform_split`: the
//! whole tensor is drawn from the seed exactly as a one-process model draws it, and only this rank's part is kept,
//! under the parameter's full name. Its forward then follows the usual layout:
//! - a column-parallel linear (weight cut by output features, its bias too) takes its input through
//!   [`Shard::enter`] — the identity in forward, an all-reduce (sum) of the input's gradient in backward, since
//!   every rank's part of the output contributes to it;
//! - a row-parallel linear (weight cut by input features) takes a column-parallel layer's cut output and sums its
//!   partial products with [`Shard::reduce`] — an all-reduce in forward, the identity in backward; its bias is added
//!   after the sum, whole on every rank;
//! - attention is cut by heads (the fused `q|k|v` weight is column-parallel with three groups: each rank holds its
//!   heads' columns of each of q, k and v), its output projection is row-parallel; the MLP is column then row;
//! - the vocabulary-parallel embedding ([`Shard::embedding`]) holds a slice of the vocabulary's rows: each rank looks
//!   up the tokens in its slice (zeros for the others) and the lookups are summed with [`Shard::reduce`];
//! - the vocabulary-parallel cross-entropy ([`Shard::cross_entropy`]) takes each rank's slice of the logits and
//!   all-reduces only the per-row max, the sum of exponentials and the target's logit: the full logits are never
//!   gathered.
//!
//! The communication is custom autograd operations (`candle_core::CustomOp1`) rather than a cut graph: candle's
//! backward runs each operation's `bwd` exactly once, after every gradient of its output is summed, in an order that
//! depends only on the graph's structure — and every rank of the group builds the same structure from the same code
//! and shapes — so the backward all-reduces happen in the same order on every rank, inside one ordinary backward
//! pass, with nothing for the trainer to know.
//!
//! Replicated parameters (layer norms, row-parallel biases, position embeddings, and the ViT's patch embedding,
//! class token and head) see the same gradient on every rank: everything that reaches them is either whole on every
//! rank or has passed through an all-reduce, whose result is bitwise the same everywhere. The strategy still makes
//! rank 0's gradients of them everyone's each step, so the ranks' copies cannot drift even where two hosts' kernels
//! round differently.

use crate::Real;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use shoal_comm::{Communicator, ReduceOp};

use crate::error::{Error, Result};

/// How one parameter is cut across a group of `parts` ranks: dimension `dim` is `groups` equal blocks (the fused
/// `q|k|v` projection: 3) and rank `r` holds part `r` of every block, in order. `full` is the whole shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub dim: usize,
    pub groups: usize,
    pub full: Vec<usize>,
}

impl Split {
    /// `(outer, n, inner, piece)`: the whole tensor as `outer × n × inner` with `n` the cut dimension, and the rows
    /// of one part of one block. An error when `parts` does not divide the blocks.
    fn geometry(&self, parts: usize) -> Result<(usize, usize, usize, usize)> {
        let n = *self.full.get(self.dim).ok_or_else(|| {
            Error::InvalidArgument(format!("a split at dimension {} of shape {:?}", self.dim, self.full))
        })?;
        let block = n / self.groups.max(1);
        if parts == 0 || self.groups == 0 || block * self.groups != n || !block.is_multiple_of(parts) {
            return Err(Error::InvalidArgument(format!(
                "{parts} ranks cannot share dimension {} of shape {:?} in {} equal blocks",
                self.dim, self.full, self.groups
            )));
        }
        let outer = self.full[..self.dim].iter().product();
        let inner = self.full[self.dim + 1..].iter().product();
        Ok((outer, n, inner, block / parts))
    }

    /// The shape of one rank's part.
    pub fn shard_dims(&self, parts: usize) -> Result<Vec<usize>> {
        self.geometry(parts)?;
        let mut d = self.full.clone();
        d[self.dim] /= parts;
        Ok(d)
    }

    /// Each `(offset, len)` of the whole tensor's values that rank `rank`'s part holds, in its order.
    fn runs(&self, rank: usize, parts: usize) -> Result<Vec<(usize, usize)>> {
        let (outer, n, inner, piece) = self.geometry(parts)?;
        let block = piece * parts;
        let mut out = Vec::with_capacity(outer * self.groups);
        for o in 0..outer {
            for k in 0..self.groups {
                out.push(((o * n + k * block + rank * piece) * inner, piece * inner));
            }
        }
        Ok(out)
    }

    /// Rank `rank`'s part of the whole values `full`.
    pub fn take(&self, full: &[Real], rank: usize, parts: usize) -> Result<Vec<Real>> {
        let total: usize = self.full.iter().product();
        if full.len() != total {
            return Err(Error::InvalidArgument(format!("{} values for shape {:?}", full.len(), self.full)));
        }
        let mut out = Vec::with_capacity(total / parts.max(1));
        for (o, l) in self.runs(rank, parts)? {
            out.extend_from_slice(&full[o..o + l]);
        }
        Ok(out)
    }

    /// The whole values from every rank's part (`shards[r]`: rank `r`'s).
    pub fn place(&self, shards: &[&[Real]]) -> Result<Vec<Real>> {
        let parts = shards.len();
        let total: usize = self.full.iter().product();
        let mut full = vec![0.0 as Real; total];
        for (r, shard) in shards.iter().enumerate() {
            if shard.len() * parts != total {
                return Err(Error::InvalidArgument(format!(
                    "a part of {} values of shape {:?} cut in {parts}",
                    shard.len(),
                    self.full
                )));
            }
            let mut at = 0;
            for (o, l) in self.runs(r, parts)? {
                full[o..o + l].copy_from_slice(&shard[at..at + l]);
                at += l;
            }
        }
        Ok(full)
    }
}

struct Inner {
    rank: usize,
    parts: usize,
    comm: OnceLock<Communicator>,
    /// Nanoseconds spent in the group's collectives since last taken.
    comm_ns: AtomicU64,
}

/// This rank's place in a tensor-parallel group of `parts` ranks, shared by the model's `Params`, the model and the
/// strategy (which connects the group's communicator at its start). Cheap to clone.
#[derive(Clone)]
pub struct Shard(Arc<Inner>);

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("rank", &self.0.rank)
            .field("parts", &self.0.parts)
            .field("connected", &self.0.comm.get().is_some())
            .finish()
    }
}

fn wrap(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

impl Shard {
    /// Rank `rank` of a group of `parts`.
    pub fn new(rank: usize, parts: usize) -> Shard {
        Shard(Arc::new(Inner { rank, parts, comm: OnceLock::new(), comm_ns: AtomicU64::new(0) }))
    }

    pub fn rank(&self) -> usize {
        self.0.rank
    }

    pub fn parts(&self) -> usize {
        self.0.parts
    }

    /// Gives the group its communicator (once): its size and this rank's must be the shard's.
    pub fn connect(&self, comm: Communicator) -> Result<()> {
        if comm.size() != self.0.parts || comm.rank() != self.0.rank {
            return Err(Error::InvalidArgument(format!(
                "the model was built as rank {} of {} tensor-parallel ranks, the communicator is rank {} of {}",
                self.0.rank,
                self.0.parts,
                comm.rank(),
                comm.size()
            )));
        }
        if self.0.comm.set(comm).is_err() {
            return Err(Error::InvalidArgument("this model's tensor-parallel group is connected already".into()));
        }
        Ok(())
    }

    /// Seconds spent in the group's collectives since the last call.
    pub fn take_comm_seconds(&self) -> f64 {
        self.0.comm_ns.swap(0, Ordering::Relaxed) as f64 * 1e-9
    }

    fn all_reduce(&self, buf: &mut [Real], op: ReduceOp) -> candle_core::Result<()> {
        let comm = self.0.comm.get().ok_or_else(|| {
            wrap("a tensor-parallel model ran before its strategy connected its group (train.strategy = \"tensor\")")
        })?;
        let t0 = Instant::now();
        comm.all_reduce(buf, op).map_err(wrap)?;
        self.0.comm_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Column-parallel input: `x` unchanged in forward; in backward its gradient summed over the group.
    pub fn enter(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.contiguous()?.apply_op1(Enter(self.clone()))
    }

    /// Row-parallel output: `x` summed over the group in forward; its gradient unchanged in backward.
    pub fn reduce(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.contiguous()?.apply_op1(Reduce(self.clone()))
    }

    /// Vocabulary-parallel embedding: `table` holds this rank's consecutive slice of the vocabulary's rows; `ids`
    /// (any shape, `u32`) looked up, `[ids..., width]`, summed over the group.
    pub fn embedding(&self, table: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
        let rows = table.dim(0)?;
        let start = self.0.rank * rows;
        let flat = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
        let (local, mask): (Vec<u32>, Vec<Real>) = flat
            .iter()
            .map(|&id| match (id as usize).checked_sub(start).filter(|l| *l < rows) {
                Some(l) => (l as u32, 1.0),
                None => (0, 0.0),
            })
            .unzip();
        let n = local.len();
        let local = Tensor::from_vec(local, n, table.device())?;
        let mask = Tensor::from_vec(mask, (n, 1), table.device())?;
        let looked = table.embedding(&local)?.broadcast_mul(&mask)?;
        let mut dims = ids.dims().to_vec();
        dims.push(table.dim(1)?);
        self.reduce(&looked)?.reshape(dims)
    }

    /// Vocabulary-parallel cross-entropy: `logits` `[rows, vocab / parts]` is this rank's slice of the vocabulary
    /// (consecutive, rank order), `target` `[rows]` the whole-vocabulary labels. The mean loss over rows (the same on
    /// every rank, with the graph to this rank's logits), and the rows whose target has the largest logit.
    pub fn cross_entropy(&self, logits: &Tensor, target: &Tensor) -> candle_core::Result<(Tensor, f64)> {
        let (rows, width) = logits.dims2()?;
        let start = self.0.rank * width;
        let mut max = logits.detach().max_keepdim(1)?.flatten_all()?.to_vec1::<Real>()?;
        self.all_reduce(&mut max, ReduceOp::Max)?;
        let max = Tensor::from_vec(max, (rows, 1), logits.device())?;
        let shifted = logits.broadcast_sub(&max)?;
        let sum = self.reduce(&shifted.exp()?.sum_keepdim(1)?)?;
        let labels = target.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
        if labels.len() != rows {
            candle_core::bail!("{} labels for {rows} rows of logits", labels.len());
        }
        let (index, mask): (Vec<u32>, Vec<Real>) = labels
            .iter()
            .map(|&y| match (y as usize).checked_sub(start).filter(|l| *l < width) {
                Some(l) => (l as u32, 1.0),
                None => (0, 0.0),
            })
            .unzip();
        let index = Tensor::from_vec(index, (rows, 1), logits.device())?;
        let mask = Tensor::from_vec(mask, (rows, 1), logits.device())?;
        let picked = self.reduce(&(shifted.gather(&index, 1)? * mask)?)?;
        let loss = (sum.log()? - &picked)?.mean_all()?;
        // The target's logit less the row's max: 0 exactly where the target has the largest logit.
        let correct = picked.flatten_all()?.to_vec1::<Real>()?.iter().filter(|v| **v >= 0.0).count();
        Ok((loss, correct as f64))
    }
}

/// The values of a contiguous `Real` storage.
fn values(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<Vec<Real>> {
    let all = storage.as_slice::<Real>()?;
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(all[a..b].to_vec()),
        None => candle_core::bail!("a tensor-parallel collective on a non-contiguous tensor"),
    }
}

/// [`Shard::enter`]'s operation.
struct Enter(Shard);

impl CustomOp1 for Enter {
    fn name(&self) -> &'static str {
        "tensor-parallel-enter"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((crate::kernels::real_storage(values(storage, layout)?), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&Reduce(self.0.clone()))?))
    }
}

/// [`Shard::reduce`]'s operation.
struct Reduce(Shard);

impl CustomOp1 for Reduce {
    fn name(&self) -> &'static str {
        "tensor-parallel-reduce"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let mut v = values(storage, layout)?;
        self.0.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok((crate::kernels::real_storage(v), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.clone()))
    }
}

/// Column-parallel input under `shard` (the identity without one).
pub fn enter(shard: Option<&Shard>, x: &Tensor) -> candle_core::Result<Tensor> {
    match shard {
        Some(s) if s.parts() > 1 => s.enter(x),
        _ => Ok(x.clone()),
    }
}

/// Row-parallel output under `shard` (the identity without one).
pub fn reduce(shard: Option<&Shard>, x: &Tensor) -> candle_core::Result<Tensor> {
    match shard {
        Some(s) if s.parts() > 1 => s.reduce(x),
        _ => Ok(x.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_of_blocks_take_and_place_back() -> Result<()> {
        // A [2, 6] weight whose columns are q|k|v (2 each), cut in 2: rank 0 holds the first column of each.
        let s = Split { dim: 1, groups: 3, full: vec![2, 6] };
        let full: Vec<Real> = (0..12).map(|v| v as Real).collect();
        let a = s.take(&full, 0, 2)?;
        let b = s.take(&full, 1, 2)?;
        assert_eq!(a, vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(b, vec![1.0, 3.0, 5.0, 7.0, 9.0, 11.0]);
        assert_eq!(s.shard_dims(2)?, vec![2, 3]);
        assert_eq!(s.place(&[&a, &b])?, full);
        // Rows.
        let r = Split { dim: 0, groups: 1, full: vec![4, 2] };
        assert_eq!(r.take(&(0..8).map(|v| v as Real).collect::<Vec<_>>(), 1, 2)?, vec![4.0, 5.0, 6.0, 7.0]);
        assert!(Split { dim: 1, groups: 3, full: vec![2, 6] }.take(&full, 0, 4).is_err());
        assert!(s.place(&[&a]).is_err());
        Ok(())
    }
}
