//! The compression hook's side in the strategies: which parts of a gradient bucket are matrices (PowerSGD's), and
//! the compressor's state in a checkpoint. The codecs and their reductions are `shoal_comm::compress`; DDP calls
//! [`Compressor::all_reduce`] on each bucket, ZeRO [`Compressor::reduce_scatter`].
//!
//! Each rank's error feedback is its own, so a checkpoint holds every rank's, named
//! `compression.rank{R}.{part}.{bucket}` (gathered: a collective). Resumed at the same world size each rank takes
//! its own back, so the run goes on bit for bit. At another size the mass is kept: rank 0 takes the sum of every
//! saved rank's residual (each summed segment's second-stage residual added where it belongs), which is what the
//! ranks had not yet sent, and every rank takes rank 0's PowerSGD factors (the same on every rank).
//!
//! `[compression] momentum` (DDP with AdamW, 1-bit Adam's scheme for any codec): past the warm-up a rank sends, in
//! place of its gradients, its first moment taken one step with them ([`moment_in`]); the summed codes are the
//! moment every rank takes, given to the optimizer as the gradient that leads there ([`moment_out`]). A moment is
//! a smoother signal than a gradient, and what a code leaves out of it returns through error feedback. The second
//! moment cannot follow gradients no rank has whole, so past the warm-up it takes no new squares
//! ([`Optimizer::freeze_second_moment`]).

use crate::Real;
use crate::kernels::{as_f32, from_f32};
use std::collections::HashMap;

use candle_core::{Device, Tensor};
use shoal_comm::{Communicator, Compressor, Matrix, ReduceOp};

use crate::error::{Error, Result};
use crate::kernels::with_slice;
use crate::optim::{AdamTerms, Optimizer};
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
        None => (1, own.iter().flat_map(|(_, v)| v.iter().map(|&x| from_f32(x))).collect::<Vec<Real>>()),
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
            let mine: Vec<Real> = own.iter().flat_map(|(_, v)| v.iter().map(|&x| from_f32(x))).collect();
            let mut all = vec![0.0 as Real; len * c.size()];
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
    let mut saved: Vec<(usize, String, Vec<Real>)> = Vec::new();
    for (name, t) in named {
        let Some(rest) = name.strip_prefix(PREFIX) else { continue };
        let parsed = rest.strip_prefix("rank").and_then(|s| s.split_once('.'));
        let Some((r, part)) = parsed.and_then(|(r, p)| Some((r.parse::<usize>().ok()?, p))) else {
            return Err(Error::Checkpoint(format!("compression state {name:?}: not compression.rankR.PART.BUCKET")));
        };
        saved.push((r, part.to_string(), t.flatten_all()?.to_vec1::<Real>()?));
    }
    if saved.is_empty() {
        return Ok(());
    }
    let saved_world = saved.iter().map(|(r, _, _)| r + 1).max().unwrap_or(1);
    if saved_world == world {
        return Ok(z.load_state(
            saved.into_iter().filter(|(r, _, _)| *r == rank).map(|(_, p, v)| (p, narrow(&v))).collect(),
        )?);
    }
    // Another world size: the factors every rank shares, and on rank 0 the mass nobody had sent yet.
    let mut state: std::collections::BTreeMap<String, Vec<Real>> = std::collections::BTreeMap::new();
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
    Ok(z.load_state(state.into_iter().map(|(p, v)| (p, narrow(&v))).collect())?)
}

/// Compression state is `f32` in every build.
fn narrow(v: &[Real]) -> Vec<f32> {
    as_f32(v).into_owned()
}

/// Splits a checkpoint's optimizer entries into the optimizer's own and the compressor's.
pub fn split(named: HashMap<String, Tensor>) -> (HashMap<String, Tensor>, HashMap<String, Tensor>) {
    named.into_iter().partition(|(n, _)| !n.starts_with(PREFIX))
}

/// `[compression] momentum`, on the way in: `g`, this rank's share of the gradients of the parameters `members`
/// (one after the other), becomes what it sends instead — its AdamW first moment taken one step with them,
/// `β1·m/W + (1 - β1)·g` over `W` ranks, so that the ranks' sum is the moment the summed gradients would make.
/// `scaled` (a sparse code) divides each value by its update's divisor `√(v/c2) + ε`, so that the values the code
/// keeps are the largest updates; with the second moment frozen that is a fixed scale, as error feedback needs.
pub(crate) fn moment_in(
    opt: &Optimizer,
    params: &Params,
    members: &[usize],
    g: &mut [Real],
    world: usize,
    scaled: bool,
) -> Result<()> {
    let t = adamw_terms(opt)?;
    let w = world as Real;
    each_moment(opt, params, members, g, scaled, |x, m, v| {
        let y = t.beta1 * m / w + (1.0 - t.beta1) * x;
        v.map_or(y, |v| y / ((v / t.c2).sqrt() + t.eps))
    })
}

/// On the way out: `g`, the summed codes, is the moment `m'` the ranks agree on (multiplied back when `scaled`);
/// it becomes the gradient that takes each rank's `m` there in the optimizer's update, `(m' - β1·m) / (1 - β1)`.
/// A dense code (`scaled` false: sign, the quantisers, PowerSGD) gives every value some moment, even one whose
/// squares were all but zero in the warm-up, where a step would then be thousands of learning rates: `m'` is held
/// so that no step goes beyond the most one of Adam's can ([`AdamTerms::bound`]). A sparse code sends only values
/// a moment has built up, whose steps stay whole.
pub(crate) fn moment_out(
    opt: &Optimizer,
    params: &Params,
    members: &[usize],
    g: &mut [Real],
    scaled: bool,
) -> Result<()> {
    let t = adamw_terms(opt)?;
    let b1 = t.beta1;
    each_moment(opt, params, members, g, true, |x, m, v| {
        let divisor = v.map_or(1.0, |v| (v / t.c2).sqrt() + t.eps);
        let agreed = match scaled {
            true => x * divisor,
            false => {
                let most = t.bound * t.c1 * divisor;
                x.clamp(-most, most)
            }
        };
        (agreed - b1 * m) / (1.0 - b1)
    })
}

fn adamw_terms(opt: &Optimizer) -> Result<AdamTerms> {
    opt.next_terms().ok_or_else(|| Error::InvalidArgument("compression.momentum sends AdamW's first moment".into()))
}

/// Runs `f(value, m, v)` over every value of `g` (the parameters `members`, one after the other), with the
/// parameter's first moment (0 before any update) and, when `second`, its second.
fn each_moment(
    opt: &Optimizer,
    params: &Params,
    members: &[usize],
    g: &mut [Real],
    second: bool,
    f: impl Fn(Real, Real, Option<Real>) -> Real,
) -> Result<()> {
    let mut rest = g;
    for &i in members {
        let (name, var) = &params.vars()[i];
        let n = var.elem_count();
        if rest.len() < n {
            return Err(Error::InvalidArgument(format!("gradient bucket too short for {name}")));
        }
        let (seg, tail) = std::mem::take(&mut rest).split_at_mut(n);
        rest = tail;
        let (m, v) = opt.moments(i);
        let v = v.filter(|_| second);
        let sized = |t: Option<&Tensor>| t.is_none_or(|t| t.elem_count() == n);
        if !sized(m) || !sized(v) {
            return Err(Error::InvalidArgument(format!("the AdamW moments of {name} are not its size")));
        }
        match (m, v) {
            (None, None) => seg.iter_mut().for_each(|x| *x = f(*x, 0.0, None)),
            (Some(m), None) => with_slice(m, |m| seg.iter_mut().zip(m).for_each(|(x, &m)| *x = f(*x, m, None)))?,
            (None, Some(v)) => with_slice(v, |v| seg.iter_mut().zip(v).for_each(|(x, &v)| *x = f(*x, 0.0, Some(v))))?,
            (Some(m), Some(v)) => with_slice(m, |m| {
                with_slice(v, |v| seg.iter_mut().zip(m.iter().zip(v)).for_each(|(x, (&m, &v))| *x = f(*x, m, Some(v))))
            })??,
        }
    }
    Ok(())
}
