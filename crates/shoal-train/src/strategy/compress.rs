//! The compression hook's side in the strategies: which parts of a gradient bucket are matrices (PowerSGD's), and
//! the compressor's state in a checkpoint. The codecs and their reductions are `shoal_comm::compress`; DDP calls
//! [`Compressor::all_reduce`] on each bucket, ZeRO [`Compressor::reduce_scatter`].
//!
//! Each rank's error feedback is its own, so a checkpoint holds every rank's, named
//! `compression.rank{R}.{part}.{bucket}` (gathered: a collective). Resumed at the same world size each rank takes
//! its own back, so the run goes on bit for bit. At another size the mass is kept: rank 0 takes the sum of every
//! saved rank's residual (each summed segment's second-stage residual added where it belongs), which is what the
//! ranks had not yet sent, and every rank takes rank 0's PowerSGD factors (the same on every rank).

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use shoal_comm::{Communicator, Compressor, Matrix, ReduceOp};

use crate::error::{Error, Result};
use crate::params::Params;

/// The prefix of every compression entry among a checkpoint's optimizer tensors.
pub const PREFIX: &str = "compression.";

/// The matrices of a bucket holding parameters `members` one after the other (in that order): every parameter of
/// two or more dimensions, as `dims[0] × the rest`.
pub(crate) fn matrices(params: &Params, members: impl IntoIterator<Item = usize>) -> Vec<Matrix> {
    let mut out = Vec::new();
    let mut offset = 0;
    for i in members {
        let var = &params.vars()[i].1;
        let dims = var.dims();
        if dims.len() >= 2 {
            out.push(Matrix { offset, rows: dims[0], cols: var.elem_count() / dims[0].max(1) });
        }
        offset += var.elem_count();
    }
    out
}

/// Every rank's compression state, named by rank (a collective over `comm`).
pub(crate) fn gather(comm: Option<&Communicator>, z: &Compressor) -> Result<Vec<(String, Tensor)>> {
    let own = z.state();
    let len: usize = own.iter().map(|(_, v)| v.len()).sum();
    let (n, flat) = match comm.filter(|c| c.size() > 1) {
        None => (1, own.iter().flat_map(|(_, v)| v.iter().copied()).collect::<Vec<f32>>()),
        Some(c) => {
            let mut sizes = [len as i64, -(len as i64)];
            c.all_reduce(&mut sizes, ReduceOp::Max)?;
            if sizes[0] != -sizes[1] {
                return Err(Error::InvalidArgument(format!(
                    "the ranks hold compression state of different sizes ({} to {} values): they did not compress the \
                     same buckets",
                    -sizes[1], sizes[0]
                )));
            }
            let mine: Vec<f32> = own.iter().flat_map(|(_, v)| v.iter().copied()).collect();
            let mut all = vec![0f32; len * c.size()];
            c.all_gather(&mine, &mut all)?;
            (c.size(), all)
        }
    };
    let mut out = Vec::with_capacity(own.len() * n);
    for r in 0..n {
        let mut at = r * len;
        for (name, v) in &own {
            let t = Tensor::from_slice(&flat[at..at + v.len()], v.len(), &Device::Cpu)?;
            out.push((format!("{PREFIX}rank{r}.{name}"), t));
            at += v.len();
        }
    }
    Ok(out)
}

/// Restores this rank's compression state from a checkpoint's entries (those under [`PREFIX`]; none: a fresh
/// start), at any world size (see the module documentation).
pub(crate) fn load(comm: Option<&Communicator>, z: &mut Compressor, named: &HashMap<String, Tensor>) -> Result<()> {
    let (rank, world) = comm.map_or((0, 1), |c| (c.rank(), c.size()));
    let mut saved: Vec<(usize, String, Vec<f32>)> = Vec::new();
    for (name, t) in named {
        let Some(rest) = name.strip_prefix(PREFIX) else { continue };
        let parsed = rest.strip_prefix("rank").and_then(|s| s.split_once('.'));
        let Some((r, part)) = parsed.and_then(|(r, p)| Some((r.parse::<usize>().ok()?, p))) else {
            return Err(Error::Checkpoint(format!("compression state {name:?}: not compression.rankR.PART.BUCKET")));
        };
        saved.push((r, part.to_string(), t.flatten_all()?.to_vec1::<f32>()?));
    }
    if saved.is_empty() {
        return Ok(());
    }
    let saved_world = saved.iter().map(|(r, _, _)| r + 1).max().unwrap_or(1);
    if saved_world == world {
        return Ok(z.load_state(saved.into_iter().filter(|(r, _, _)| *r == rank).map(|(_, p, v)| (p, v)).collect())?);
    }
    // Another world size: the factors every rank shares, and on rank 0 the mass nobody had sent yet.
    let mut state: std::collections::BTreeMap<String, Vec<f32>> = std::collections::BTreeMap::new();
    saved.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    for (r, part, v) in &saved {
        if part.starts_with("q.") && *r == 0 {
            state.insert(part.clone(), v.clone());
        }
    }
    if rank == 0 {
        for (_, part, v) in saved.iter().filter(|(_, p, _)| p.starts_with("residual.")) {
            let sum = state.entry(part.clone()).or_insert_with(|| vec![0.0; v.len()]);
            sum.iter_mut().zip(v).for_each(|(s, x)| *s += x);
        }
        for (r, part, v) in saved.iter().filter(|(_, p, _)| p.starts_with("server.")) {
            let bucket = part.trim_start_matches("server.");
            if let Some(sum) = state.get_mut(&format!("residual.{bucket}")) {
                let seg = sum.len().div_ceil(saved_world);
                for (s, x) in sum.iter_mut().skip(r * seg).zip(v) {
                    *s += x;
                }
            }
        }
        tracing::info!(saved = saved_world, world, "error feedback of every saved rank given to rank 0");
    }
    Ok(z.load_state(state.into_iter().collect())?)
}

/// Splits a checkpoint's optimizer entries into the optimizer's own and the compressor's.
pub fn split(named: HashMap<String, Tensor>) -> (HashMap<String, Tensor>, HashMap<String, Tensor>) {
    named.into_iter().partition(|(n, _)| !n.starts_with(PREFIX))
}
