//! What sums the gradients of ranks computing on GPUs (`train.collectives`): NCCL on the devices, or Shoal's own
//! collectives with the gradients staged through the host.
//!
//! Invariants:
//! - Every rank of a group decides alike: the decision rests on the spec, the build, and what every rank published
//!   in the group's store (its host and GPU), which they all read whole before deciding.
//! - NCCL runs only where it can: parameters held on the GPUs (plain DDP, `Params::resident`), more than one rank,
//!   a build with the `nccl` feature, and no two ranks on one GPU (NCCL refuses a device shared by two ranks:
//!   fractional GPUs are summed by Shoal's collectives). `auto` falls back to Shoal's where it cannot; `nccl`
//!   refuses to start, naming `train.collectives` and what is missing.

use shoal_comm::Communicator;

use crate::device::Placement;
use crate::error::{Error, Result};
use crate::params::Params;
use crate::spec::{Collectives, JobSpec};
use crate::strategy::DeviceAllReduce;

/// The device all-reduce the gradients of `comm`'s ranks go through, this one computing on `placement`, or `None`
/// for Shoal's own collectives (see the module's invariants).
pub(super) fn device_reduce(
    spec: &JobSpec,
    placement: Placement,
    comm: &Communicator,
    params: &Params,
) -> Result<Option<Box<dyn DeviceAllReduce>>> {
    let asked = spec.train.collectives;
    let refuse = |why: String| Err(Error::Spec(format!("train.collectives: \"nccl\" {why}")));
    match asked {
        Collectives::Shoal => return Ok(None),
        Collectives::Nccl if !cfg!(feature = "nccl") => {
            return refuse("needs a shoal built with the `nccl` feature".into());
        }
        Collectives::Nccl if !params.resident() => {
            return refuse(format!(
                "sums gradients held on GPUs, and these ranks compute on the {} (resources.gpus)",
                placement
            ));
        }
        _ => {}
    }
    if !params.resident() || comm.size() <= 1 || !cfg!(feature = "nccl") {
        return Ok(None);
    }
    let devices = published_devices(spec, placement, comm)?;
    if let Some((a, b)) = shared_gpu(&devices) {
        let why = format!("ranks {a} and {b} share GPU {} (NCCL needs a GPU per rank)", devices[a]);
        if asked == Collectives::Nccl {
            return refuse(why);
        }
        if comm.rank() == 0 {
            eprintln!("gradients summed through Shoal's collectives: {why}");
        }
        return Ok(None);
    }
    connect(placement, comm)
}

/// Each rank's GPU as `host/device` (the device as `CUDA_VISIBLE_DEVICES` names it, else its ordinal), published in
/// the group's store and read back for every rank, in rank order.
fn published_devices(spec: &JobSpec, placement: Placement, comm: &Communicator) -> Result<Vec<String>> {
    let Placement::Cuda { ordinal } = placement else {
        return Err(Error::InvalidArgument(
            "the parameters are held on a GPU, but this rank computes on the CPU".into(),
        ));
    };
    let asked = crate::device::Asked::from_env(spec);
    let device = asked.visible_devices().and_then(|v| v.get(ordinal).cloned()).unwrap_or_else(|| ordinal.to_string());
    let host = comm.hosts().get(comm.rank()).cloned().unwrap_or_default();
    let (store, cfg) = (comm.store(), comm.config());
    let key = |r: usize| format!("collectives/{}/device/{r}", cfg.name);
    store.set(&key(comm.rank()), format!("{host}/{device}").as_bytes())?;
    (0..comm.size())
        .map(|r| {
            let bytes = store.get(&key(r), cfg.timeout)?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        })
        .collect()
}

/// The first two ranks that name the same GPU.
fn shared_gpu(devices: &[String]) -> Option<(usize, usize)> {
    devices.iter().enumerate().find_map(|(b, d)| devices[..b].iter().position(|x| x == d).map(|a| (a, b)))
}

#[cfg(feature = "nccl")]
fn connect(placement: Placement, comm: &Communicator) -> Result<Option<Box<dyn DeviceAllReduce>>> {
    let Placement::Cuda { ordinal } = placement else { return Ok(None) };
    let cfg = comm.config();
    let nccl = crate::nccl::Nccl::connect(
        comm.store().clone(),
        &format!("{}-grads", cfg.name),
        comm.rank(),
        comm.size(),
        ordinal,
        cfg.timeout,
    )?;
    if comm.rank() == 0 {
        eprintln!("gradients summed on the GPUs through NCCL");
    }
    Ok(Some(Box::new(crate::nccl::NcclAllReduce::new(nccl))))
}

#[cfg(not(feature = "nccl"))]
fn connect(_: Placement, _: &Communicator) -> Result<Option<Box<dyn DeviceAllReduce>>> {
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::shared_gpu;

    #[test]
    fn two_ranks_on_one_gpu_are_found_and_distinct_gpus_are_not() {
        let d = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(shared_gpu(&d(&["a/0", "a/1", "b/0", "b/1"])), None);
        assert_eq!(shared_gpu(&d(&["a/0", "a/1", "a/0"])), Some((0, 2)));
        assert_eq!(shared_gpu(&d(&["a/GPU-1", "b/GPU-1", "b/GPU-1"])), Some((1, 2)));
        assert_eq!(shared_gpu(&[]), None);
    }
}
