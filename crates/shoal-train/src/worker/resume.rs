//! Resuming: the checkpoint a run starts from — its own newest valid one (fetched first from the object store its
//! checkpoints are mirrored to), else the one `checkpoint.resume_from` names — loaded into the model's parameters
//! ([`load`]), then into the sampler and the optimizer once the trainer exists ([`restore`]).

use std::path::PathBuf;

use candle_core::Tensor;

use super::setup::{Setup, Training};
use crate::checkpoint::{CheckpointDir, Loaded, MANIFEST_FILE, TensorData};
use crate::error::{Error, Result};
use crate::params::Params;
use crate::spec::JobSpec;

/// The checkpoint this rank starts from, its model tensors already set into `params`; `None` to start from
/// scratch. `resume`: look for the run's own checkpoints (`--resume`).
pub(super) fn load(spec: &JobSpec, resume: bool, setup: &Setup, params: &Params) -> Result<Option<Loaded>> {
    let (rank, ckpt_dir, comm) = (setup.rank, &setup.ckpt_dir, &setup.comm);
    if resume && spec.checkpoint.url.as_deref().is_some_and(crate::remote::is_remote) {
        // Rank 0 brings the newest valid remote checkpoint into the local staging directory; the others wait.
        if let Some(r) = &setup.remote {
            let (step, skipped) = r.fetch_latest_valid(ckpt_dir).map_err(|e| Error::Checkpoint(e.to_string()))?;
            for (url, why) in &skipped {
                eprintln!("warning: skipped checkpoint object {url}: {why}");
            }
            match step {
                Some(s) => eprintln!("fetched checkpoint step {s} from {}", r.url()),
                None => eprintln!("no valid checkpoint in {}; starting from scratch", r.url()),
            }
        }
        comm.barrier()?;
    }
    let own = if resume { ckpt_dir.latest_valid().map_err(|e| Error::Checkpoint(e.to_string()))? } else { None };
    let resumed = if resume || spec.checkpoint.resume_from.is_some() {
        let loaded = match (own, spec.checkpoint.resume_path()) {
            (Some(l), _) => Some(l),
            (None, Some(from)) => Some(load_resume_from(from)?),
            (None, None) => None,
        };
        if let Some(l) = &loaded {
            for (path, why) in &l.skipped {
                if rank == 0 {
                    eprintln!("warning: skipped checkpoint file {}: {why}", path.display());
                }
            }
            let by_name: std::collections::HashMap<&str, &TensorData> =
                l.model.iter().map(|t| (t.name.as_str(), t)).collect();
            for (name, var) in params.vars() {
                let td = by_name.get(name.as_str()).ok_or_else(|| {
                    Error::Checkpoint(format!("{}: no tensor {name} in model.safetensors", l.dir.display()))
                })?;
                if td.shape != var.dims() {
                    return Err(Error::Checkpoint(format!(
                        "{}: tensor {name} has shape {:?}, the model expects {:?}",
                        l.dir.display(),
                        td.shape,
                        var.dims()
                    )));
                }
                var.set(&Tensor::from_slice(&td.data, var.shape(), &candle_core::Device::Cpu)?)?;
            }
            if rank == 0 {
                eprintln!("resuming from {} (step {})", l.dir.display(), l.manifest.step);
            }
        } else if rank == 0 {
            eprintln!("no valid checkpoint under {}; starting from scratch", ckpt_dir.checkpoints_dir().display());
        }
        loaded
    } else {
        None
    };
    Ok(resumed)
}

/// Puts the sampler and the optimizer state where checkpoint `l` left them; returns the step to start from.
pub(super) fn restore(l: &Loaded, tr: &mut Training) -> Result<usize> {
    let state: shoal_data::SamplerState = serde_json::from_value(l.manifest.sampler.clone())
        .map_err(|e| Error::Checkpoint(format!("{}: sampler state: {e}", l.dir.display())))?;
    tr.sampler.restore(state)?;
    let named: std::collections::HashMap<String, Tensor> = l
        .optimizer
        .iter()
        .map(|td| Ok((td.name.clone(), Tensor::from_slice(&td.data, td.shape.as_slice(), &candle_core::Device::Cpu)?)))
        .collect::<Result<_>>()?;
    let opt_t = l.manifest.extra.get("optimizer_t").and_then(|v| v.as_u64()).unwrap_or(l.manifest.step);
    tr.trainer.load_optimizer_state(opt_t, &named)?;
    Ok(l.manifest.step as usize)
}

/// The checkpoint `checkpoint.resume_from` names: a checkpoint directory (with its manifest), or a checkpoint
/// root whose newest valid checkpoint is taken. Asked for explicitly, so finding none is an error naming it.
fn load_resume_from(path: &str) -> Result<Loaded> {
    let path = PathBuf::from(path);
    let what = |e: &dyn std::fmt::Display| Error::Checkpoint(format!("checkpoint.resume_from {}: {e}", path.display()));
    if path.join(MANIFEST_FILE).exists() {
        return CheckpointDir::new(&path).load(&path).map_err(|e| what(&e));
    }
    CheckpointDir::new(&path).latest_valid().map_err(|e| what(&e))?.ok_or_else(|| what(&"no valid checkpoint there"))
}
