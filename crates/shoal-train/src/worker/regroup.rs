//! Regrouping in place, the worker's side of an elastic job that goes on without a lost member or with newcomers
//! (`fault_tolerance.policy = "elastic"`, data parallelism, a server that hears the heartbeats): the process, its
//! model and its optimizer stay; the communicator is built again at the new size.
//!
//! - A rank whose collective failed (a peer gone) waits for its heartbeat's answer to name its new group
//!   ([`shoal_wire::Regroup`]); a rank told of a new group while training votes in the step's scalars, so every
//!   member leaves at the same step boundary.
//! - [`enter`] builds the new group's communicator at the store the server hosts for it.
//! - [`sync`] makes every member's state the group rank 0's — a survivor, whose state is whole and consistent (a
//!   data-parallel rank applies an update only after every gradient arrived, so it stands at a step boundary): the
//!   steps done, the sampler's position and the optimizer state by broadcast here, the parameters by the
//!   strategy's own start (a broadcast from rank 0). A newcomer takes the same path from nothing.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use shoal_comm::{Communicator, Store, TcpStore};
use shoal_data::SamplerState;
use shoal_wire::Regroup;

use super::setup::{Setup, Training};
use crate::error::{Error, Result};
use crate::spec::{FaultPolicy, JobSpec, Strategy};

/// Whether this rank regroups in place when its group changes (the server decides the same from the spec as
/// submitted: a strategy `"auto"` chose, DDP included, is not regrouped in place).
pub(super) fn in_place(spec: &JobSpec, setup: &Setup) -> bool {
    spec.fault_tolerance.policy == FaultPolicy::Elastic
        && spec.train.strategy == Strategy::Ddp
        && setup.chose.is_none()
        && spec.phases.is_empty()
        && setup.link.is_some()
        && setup.attempt.is_some()
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

/// Makes this rank's state the group rank 0's: `mine` is where this rank stands (`None`: a newcomer, nothing yet).
/// Returns where the group goes on from. Every member calls it, right after [`enter`] and before the trainer over
/// the new communicator is built (its start broadcasts the parameters).
pub(super) fn sync(
    comm: &Communicator,
    mine: Option<(&Boundary, &Training)>,
    optimizer_t: u64,
) -> Result<(Boundary, u64, HashMap<String, Tensor>)> {
    let root = comm.rank() == 0;
    // What rank 0 sends: the boundary, the optimizer's step count and the names and shapes of its state.
    let (header, values) = match (root, mine) {
        (true, Some((b, tr))) => {
            let state = tr.trainer.optimizer_state()?;
            let shapes: Vec<(String, Vec<usize>)> = state.iter().map(|(n, t)| (n.clone(), t.dims().to_vec())).collect();
            let mut values = Vec::with_capacity(shapes.iter().map(|(_, s)| s.iter().product::<usize>()).sum());
            for (_, t) in &state {
                values.extend(t.flatten_all()?.to_vec1::<f32>()?);
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
    let mut values = if root { values } else { vec![0f32; total] };
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

#[derive(Serialize, Deserialize)]
struct Header {
    boundary: Boundary,
    optimizer_t: u64,
    shapes: Vec<(String, Vec<usize>)>,
}
