//! Regrouping in place, the worker's side of an elastic job that goes on without a lost member or with newcomers
//! (`fault_tolerance.policy = "elastic"`, DDP or a ZeRO stage, a server that hears the heartbeats): the process, its
//! model and its optimizer stay; the communicator is built again at the new size.
//!
//! - A rank whose collective failed (a peer gone) waits for its heartbeat's answer to name its new group
//!   ([`shoal_wire::Regroup`]); a rank told of a new group while training votes in the step's scalars, so every
//!   member leaves at the same step boundary.
//! - [`enter`] builds the new group's communicator at the store the server hosts for it.
//! - [`rejoin`] gives every member one state: the group rank 0's when every member brought its whole state (a
//!   newcomer takes the same path from nothing), else — a strategy that shards the state lost a shard with a member
//!   — the newest in-memory copy or checkpoint, re-sharded for the new size, with the processes kept.

use crate::Real;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use shoal_comm::{Communicator, ReduceOp, Store, TcpStore};
use shoal_data::SamplerState;
use shoal_wire::Regroup;

use super::setup::{Setup, Training};
use crate::error::{Error, Result};
use crate::params::Params;
use crate::spec::JobSpec;

/// Whether this rank regroups in place when its group changes (the server decides the same from the spec as
/// submitted: a strategy `"auto"` chose, DDP included, is not regrouped in place).
pub(super) fn in_place(spec: &JobSpec, setup: &Setup) -> bool {
    spec.regroups_in_place() && setup.chose.is_none() && setup.link.is_some() && setup.attempt.is_some()
}

/// How long a rank whose collective failed waits to hear of its new group before it fails: the server's time to
/// find the lost member gone (its process probed, or its heartbeats missed for `heartbeat_timeout`), and some.
pub(super) fn patience(spec: &JobSpec) -> Duration {
    spec.fault_tolerance.heartbeat_timeout.0 + Duration::from_secs(10)
}

/// Where a group stands at a step boundary: what its rank 0 gives every member.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Boundary {
    /// Optimizer steps done.
    pub(super) step: usize,
    /// The sampler's position after them.
    pub(super) sampler: SamplerState,
    /// The loss of the last of them (NaN before any).
    pub(super) loss: f64,
}

/// Builds the communicator of group `r` and makes it this rank's.
pub(super) fn enter(spec: &JobSpec, setup: &mut Setup, r: &Regroup) -> Result<()> {
    let mut cfg = setup.comm.config().clone();
    cfg.name = shoal_comm::env::group_name(&setup.comm_base, r.generation);
    cfg.advertise = shoal_comm::env::advertise_towards(&r.rendezvous);
    let store: Arc<dyn Store> = Arc::new(TcpStore::connect(&r.rendezvous, &cfg.secret, cfg.timeout)?);
    let comm = Communicator::init(store, r.rank, r.world, cfg)?;
    setup.regrouped(comm, spec)
}

/// What a member brings to its new group: where it stands, and its state when that is whole and consistent.
pub(super) struct Given {
    pub(super) boundary: Boundary,
    pub(super) optimizer_t: u64,
    /// `None`: part of the state left with a lost peer (a strategy that shards it, whose collective failed).
    pub(super) state: Option<Whole>,
}

/// A member's whole state as named tensors: the parameters (only for a strategy that shards them, whose new start
/// needs them whole on the new rank 0; DDP's are there already) and the optimizer's.
pub(super) struct Whole {
    model: Vec<(String, Tensor)>,
    optimizer: Vec<(String, Tensor)>,
}

/// What this member gives its next group, taken as it leaves the old one at `boundary`. Data parallel: its own
/// state, the same on every rank. A strategy that shards the state: the whole state gathered over the old group
/// while it is still whole — a regrouping every member agreed on (`failed` false); after a failed collective
/// nothing: the group rolls back to its newest copy (see [`rejoin`]).
pub(super) fn given(spec: &JobSpec, tr: &Training, boundary: Boundary, failed: bool) -> Given {
    let optimizer_t = tr.trainer.optimizer().t;
    let sharded = spec.train.strategy.shards_state();
    let state = match (sharded, failed) {
        (true, true) => None,
        (false, _) => tr.trainer.optimizer_state().ok().map(|optimizer| Whole { model: Vec::new(), optimizer }),
        (true, false) => {
            // Collectives over the old group: a peer lost now leaves this rank with a part only.
            let whole = tr.trainer.model_state().and_then(|m| Ok((m, tr.trainer.optimizer_state()?)));
            match whole {
                Ok((model, optimizer)) => Some(Whole { model, optimizer }),
                Err(e) => {
                    tracing::warn!(error = %e, "the state could not be gathered before regrouping; the group rolls back");
                    None
                }
            }
        }
    };
    Given { boundary, optimizer_t, state }
}

/// Where a rank goes on from after meeting its new group.
pub(super) struct Rejoined {
    pub(super) training: Training,
    pub(super) boundary: Boundary,
    /// What the group rolled back to, when it had to: `memory copy at step N` or `storage checkpoint at step N`.
    pub(super) rolled_back: Option<String>,
}

/// Meets the new group (every member calls it right after [`enter`], a newcomer with `mine` `None`) and builds this
/// rank's trainer over it, from one state every member agrees on:
/// - when every member brought its whole state, the group rank 0's — a survivor, whose state is whole and
///   consistent (a data-parallel rank applies an update only after every gradient arrived, so it stands at a step
///   boundary): the steps done, the sampler's position and the optimizer state by broadcast here, the parameters by
///   the strategy's own start (a broadcast from rank 0);
/// - when some member lost part of it (a sharded strategy's peer gone), the newest checkpoint the group can read —
///   the in-memory copy every rank's host holds, else storage — re-sharded for the new size as any resume is: the
///   processes stay, the steps since that copy are trained again.
pub(super) fn rejoin(spec: &JobSpec, setup: &mut Setup, mine: Option<&Given>, params: Params) -> Result<Rejoined> {
    let whole = mine.is_none_or(|g| g.state.is_some());
    let mut agreed: [Real; 1] = [if whole { 1.0 } else { 0.0 }];
    setup.comm.all_reduce(&mut agreed, ReduceOp::Min)?;
    let none = HashMap::new();
    if agreed[0] >= 1.0 {
        let root = setup.comm.rank() == 0;
        let own = match mine {
            Some(Given { boundary, optimizer_t, state: Some(w) }) => Some((boundary, *optimizer_t, &w.optimizer[..])),
            _ => None,
        };
        let (boundary, optimizer_t, named) = sync(&setup.comm, own)?;
        // The new rank 0's parameters seed the strategy's start; the others' tensors only need to be whole.
        let model: HashMap<String, Tensor> = match mine.and_then(|g| g.state.as_ref()) {
            Some(w) if root => w.model.iter().cloned().collect(),
            _ => HashMap::new(),
        };
        params.unshard(&model)?;
        let mut training = super::setup::training(spec, setup, params)?;
        training.sampler.restore(boundary.sampler)?;
        training.trainer.load_optimizer_state(optimizer_t, &named)?;
        return Ok(Rejoined { training, boundary, rolled_back: None });
    }
    params.unshard(&none)?;
    let Some(copy) = super::resume::load(spec, true, setup, &params)? else {
        return Err(Error::Checkpoint(format!(
            "the group lost part of its {} state with a member and has no checkpoint or in-memory copy to roll back to \
             (set checkpoint.memory_every)",
            spec.train.strategy
        )));
    };
    let mut training = super::setup::training(spec, setup, params)?;
    let step = super::resume::restore(&copy, &mut training)?;
    let loss = copy.manifest.extra.get("loss").and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN);
    let boundary = Boundary { step, sampler: training.sampler.state(), loss };
    let source = match &setup.memory {
        Some(m) if copy.dir.starts_with(m.job_root()) => "memory copy",
        _ => "storage checkpoint",
    };
    Ok(Rejoined { training, boundary, rolled_back: Some(format!("{source} at step {}", copy.manifest.step)) })
}

/// Makes this rank's state the group rank 0's: `mine` is where this rank stands and its optimizer state (`None`:
/// a newcomer, nothing yet). Returns where the group goes on from.
fn sync(
    comm: &Communicator,
    mine: Option<(&Boundary, u64, &Named)>,
) -> Result<(Boundary, u64, HashMap<String, Tensor>)> {
    let root = comm.rank() == 0;
    // What rank 0 sends: the boundary, the optimizer's step count and the names and shapes of its state.
    let (header, values) = match (root, mine) {
        (true, Some((b, optimizer_t, state))) => {
            let shapes: Vec<(String, Vec<usize>)> = state.iter().map(|(n, t)| (n.clone(), t.dims().to_vec())).collect();
            let mut values = Vec::with_capacity(shapes.iter().map(|(_, s)| s.iter().product::<usize>()).sum());
            for (_, t) in state {
                values.extend(t.flatten_all()?.to_vec1::<Real>()?);
            }
            let header = Header { boundary: b.clone(), optimizer_t, shapes };
            (Some(serde_json::to_vec(&header).map_err(|e| Error::InvalidArgument(e.to_string()))?), values)
        }
        (true, None) => {
            return Err(Error::InvalidArgument(
                "rank 0 of a regrouped group has no state to give: it must be a member that trained".into(),
            ));
        }
        (false, _) => (None, Vec::new()),
    };
    let header: Header = {
        let mut len = [header.as_ref().map_or(0, |h| h.len() as i64)];
        comm.broadcast(&mut len, 0)?;
        let n = usize::try_from(len[0]).map_err(|_| Error::InvalidArgument("a negative header length".into()))?;
        let mut words = vec![0i64; n.div_ceil(8)];
        if let Some(h) = &header {
            for (w, chunk) in words.iter_mut().zip(h.chunks(8)) {
                let mut b = [0u8; 8];
                b[..chunk.len()].copy_from_slice(chunk);
                *w = i64::from_le_bytes(b);
            }
        }
        comm.broadcast(&mut words, 0)?;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).take(n).collect();
        serde_json::from_slice(&bytes)
            .map_err(|e| Error::InvalidArgument(format!("the group's state from rank 0 does not parse: {e}")))?
    };
    let total: usize = header.shapes.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    let mut values = if root { values } else { vec![0.0 as Real; total] };
    if values.len() != total {
        return Err(Error::InvalidArgument(format!(
            "optimizer state of {} values, its shapes say {total}",
            values.len()
        )));
    }
    comm.broadcast(&mut values, 0)?;
    let mut named = HashMap::with_capacity(header.shapes.len());
    let mut at = 0;
    for (name, shape) in header.shapes {
        let n: usize = shape.iter().product();
        named.insert(name, Tensor::from_slice(&values[at..at + n], shape.as_slice(), &Device::Cpu)?);
        at += n;
    }
    Ok((header.boundary, header.optimizer_t, named))
}

/// Named tensors, as a strategy gives its state.
type Named = [(String, Tensor)];

#[derive(Serialize, Deserialize)]
struct Header {
    boundary: Boundary,
    optimizer_t: u64,
    shapes: Vec<(String, Vec<usize>)>,
}
