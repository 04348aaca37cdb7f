//! How ZeRO cuts the flat parameter space (every parameter in order) among the ranks, and the collectives that
//! move the pieces — one place for every stage.
//!
//! The space is cut into buckets, each a run of whole parameters, listed from the last parameters down (the order
//! backward produces gradients): one bucket over everything (stage 1), buckets of about `bucket_bytes` (stage 2), or
//! one bucket per layer of the model (stage 3). Each bucket is cut into one equal slice per rank, padded with zeros
//! at its end; a rank's shard is its slice of every bucket, one after the other. A bucket's gradients are
//! reduce-scattered into the slices, a bucket's slices all-gathered into the bucket.

use crate::Real;
use std::ops::Range;

use shoal_comm::{Communicator, Compressor, Pending, ReduceOp};

use crate::error::{Error, Result};
use crate::kernels::{with_slice, with_slice_mut};
use crate::params::Params;

/// The cut (see the module documentation).
#[derive(Debug)]
pub(crate) struct Shards {
    comm: Option<Communicator>,
    /// Flat offset of each parameter.
    pub(crate) offsets: Vec<usize>,
    /// Values in the flat space.
    pub(crate) total: usize,
    /// The buckets, from the last parameters to the first: each a range of parameter indices and the flat range
    /// they cover.
    pub(crate) buckets: Vec<(Range<usize>, Range<usize>)>,
    /// Where each bucket's slice starts in a shard.
    pub(crate) shard_offsets: Vec<usize>,
    /// A shard's length (the sum of the buckets' slices).
    pub(crate) shard: usize,
}

/// A bucket's gather: under way on the communicator's thread, or done (one rank).
#[derive(Debug)]
pub(crate) enum Gather {
    Pending(Pending<Vec<Real>>),
    Ready(Vec<Real>),
}

impl Gather {
    /// The bucket's values, padded (its slices one after the other).
    pub(crate) fn wait(self) -> Result<Vec<Real>> {
        match self {
            Gather::Pending(p) => Ok(p.wait()?),
            Gather::Ready(v) => Ok(v),
        }
    }
}

impl Shards {
    /// No cut yet (before a strategy's `init`).
    pub(crate) fn empty(comm: Option<Communicator>) -> Shards {
        Shards { comm, offsets: Vec::new(), total: 0, buckets: Vec::new(), shard_offsets: Vec::new(), shard: 0 }
    }

    /// The cut of `params` into `buckets` (ranges of parameter indices, from the last parameters down, each
    /// non-empty, together covering every parameter once) over the ranks of `comm`.
    pub(crate) fn new(comm: Option<Communicator>, params: &Params, buckets: Vec<Range<usize>>) -> Result<Shards> {
        let (offsets, total) = super::flat_offsets(params);
        let mut expect = params.vars().len();
        let mut cut = Vec::with_capacity(buckets.len());
        for members in buckets {
            if members.is_empty() || members.end != expect {
                return Err(Error::InvalidArgument(format!(
                    "bucket of parameters {members:?} does not continue the buckets down from parameter {expect}"
                )));
            }
            expect = members.start;
            let lo = offsets[members.start];
            let hi = offsets.get(members.end).copied().unwrap_or(total);
            cut.push((members, lo..hi));
        }
        if expect != 0 {
            return Err(Error::InvalidArgument(format!("parameters 0..{expect} are in no bucket")));
        }
        let mut s = Shards { comm, offsets, total, buckets: cut, shard_offsets: Vec::new(), shard: 0 };
        let mut o = 0;
        for b in 0..s.buckets.len() {
            s.shard_offsets.push(o);
            o += s.slice_len(b);
        }
        s.shard = o;
        Ok(s)
    }

    /// Buckets of about `bytes` of values each, from the last parameter down (a parameter larger than that is a
    /// bucket of its own); `usize::MAX`: one bucket over everything.
    pub(crate) fn by_size(params: &Params, bytes: usize) -> Vec<Range<usize>> {
        let vars = params.vars();
        let limit = (bytes / 4).max(1);
        let mut out = Vec::new();
        let mut hi = vars.len();
        while hi > 0 {
            let mut lo = hi - 1;
            let mut len = vars[lo].1.elem_count();
            while lo > 0 && len.saturating_add(vars[lo - 1].1.elem_count()) <= limit {
                lo -= 1;
                len += vars[lo].1.elem_count();
            }
            out.push(lo..hi);
            hi = lo;
        }
        out
    }

    pub(crate) fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, Communicator::size)
    }

    pub(crate) fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, Communicator::rank)
    }

    /// The communicator, when there are other ranks.
    fn others(&self) -> Option<&Communicator> {
        self.comm.as_ref().filter(|c| c.size() > 1)
    }

    /// Bucket `b`'s slice length (its values over the world size, rounded up).
    pub(crate) fn slice_len(&self, b: usize) -> usize {
        self.buckets[b].1.len().div_ceil(self.world()).max(1)
    }

    /// The largest bucket padded to a slice per rank: the buffer a bucket's reduce-scatter or gather needs.
    pub(crate) fn padded_max(&self) -> usize {
        (0..self.buckets.len()).map(|b| self.slice_len(b) * self.world()).max().unwrap_or(0)
    }

    /// Reduce-scatters bucket `b`'s gradients (`data`, its flat values padded with zeros to a slice per rank) and
    /// adds this rank's slice into `out` (a shard); `mine` is scratch. With a compressor (`[compression]`), each
    /// slice travels compressed to its rank.
    pub(crate) fn reduce_bucket(
        &self,
        b: usize,
        data: &[Real],
        mine: &mut Vec<Real>,
        out: &mut [Real],
        compress: Option<&mut Compressor>,
    ) -> Result<()> {
        let s = self.slice_len(b);
        let padded = &data[..s * self.world()];
        mine.clear();
        mine.resize(s, 0.0);
        match (self.others(), compress) {
            (Some(c), Some(z)) => {
                let padded = crate::kernels::as_f32(padded);
                crate::kernels::with_f32_mut(mine, |mine| z.reduce_scatter(c, b, &padded, mine))?
            }
            (Some(c), None) => c.reduce_scatter(padded, mine, ReduceOp::Sum)?,
            (None, _) => mine.copy_from_slice(&padded[..s]),
        }
        let o = self.shard_offsets[b];
        for (a, x) in out[o..o + s].iter_mut().zip(mine.iter()) {
            *a += *x;
        }
        Ok(())
    }

    /// Bucket `b` gathered from every rank's slice of `shard`: its values, padded.
    pub(crate) fn gather_bucket(&self, b: usize, shard: &[Real]) -> Result<Vec<Real>> {
        let (s, o) = (self.slice_len(b), self.shard_offsets[b]);
        let mut all = vec![0.0 as Real; s * self.world()];
        match self.others() {
            Some(c) => c.all_gather(&shard[o..o + s], &mut all)?,
            None => all.copy_from_slice(&shard[o..o + s]),
        }
        Ok(all)
    }

    /// [`Self::gather_bucket`] on the communicator's thread.
    pub(crate) fn gather_bucket_async(&self, b: usize, shard: &[Real]) -> Gather {
        let (s, o) = (self.slice_len(b), self.shard_offsets[b]);
        match self.others() {
            Some(c) => Gather::Pending(c.all_gather_async(shard[o..o + s].to_vec())),
            None => Gather::Ready(shard[o..o + s].to_vec()),
        }
    }

    /// Every rank's shard gathered into the whole flat space.
    pub(crate) fn gather(&self, shard: &[Real]) -> Result<Vec<Real>> {
        let mut full = vec![0.0 as Real; self.total];
        for (b, (_, flat)) in self.buckets.iter().enumerate() {
            let all = self.gather_bucket(b, shard)?;
            full[flat.clone()].copy_from_slice(&all[..flat.len()]);
        }
        Ok(full)
    }

    /// This rank's shard of the parameters (zeros in the padding), read in place from the ones it overlaps.
    pub(crate) fn read_shard(&self, params: &Params) -> Result<Vec<Real>> {
        let mut out = vec![0.0 as Real; self.shard];
        for (b, (members, flat)) in self.buckets.iter().enumerate() {
            let s = self.slice_len(b);
            let start = flat.start + self.rank() * s;
            let end = (start + s).min(flat.end);
            let o = self.shard_offsets[b];
            // Only the bucket's own parameters can overlap its slice.
            for i in members.clone() {
                let var = &params.vars()[i].1;
                let (lo, hi) = (self.offsets[i], self.offsets[i] + var.elem_count());
                let (a, z) = (lo.max(start), hi.min(end));
                if a < z {
                    with_slice(var.as_tensor(), |p| {
                        out[o + a - start..o + z - start].copy_from_slice(&p[a - lo..z - lo]);
                    })?;
                }
            }
        }
        Ok(out)
    }

    /// Writes a whole flat vector into the parameters, in place.
    pub(crate) fn write_params(&self, params: &Params, full: &[Real]) -> Result<()> {
        for (i, (_, var)) in params.vars().iter().enumerate() {
            let (lo, n) = (self.offsets[i], var.elem_count());
            with_slice_mut(var.as_tensor(), |p| p.copy_from_slice(&full[lo..lo + n]))?;
        }
        Ok(())
    }

    /// This rank's shard of a whole flat vector (zeros in the padding).
    pub(crate) fn cut(&self, full: &[Real]) -> Vec<Real> {
        let mut out = vec![0.0 as Real; self.shard];
        for (b, (_, flat)) in self.buckets.iter().enumerate() {
            let s = self.slice_len(b);
            let start = flat.start + self.rank() * s;
            let end = (start + s).min(flat.end);
            if start < end {
                let o = self.shard_offsets[b];
                out[o..o + (end - start)].copy_from_slice(&full[start..end]);
            }
        }
        out
    }
}
