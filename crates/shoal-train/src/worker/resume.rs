//! Resuming: the checkpoint a run starts from — its own newest valid state: the in-memory copy on its host
//! (`checkpoint.memory_every`) when every rank has one of the same step and no newer checkpoint is in storage, else
//! its newest valid checkpoint in storage (fetched first from the object store its checkpoints are mirrored to),
//! else the one `checkpoint.resume_from` names — loaded into the model's parameters ([`load`]), then into the
//! sampler and the optimizer once the trainer exists ([`restore`]).

use std::path::PathBuf;

use candle_core::Tensor;
use shoal_comm::ReduceOp;

use super::setup::{Setup, Training};
use crate::checkpoint::{CheckpointDir, Loaded, MANIFEST_FILE, TensorData};
use crate::error::{Error, Result};
use crate::params::Params;
use crate::spec::JobSpec;

/// The checkpoint this rank starts from, its model tensors already set into `params`; `None` to start from
/// scratch. `resume`: look for the run's own checkpoints (`--resume`).
pub(super) fn load(spec: &JobSpec, resume: bool, setup: &Setup, params: &Params) -> Result<Option<Loaded>> {
    let (rank, ckpt_dir, comm) = (setup.rank, &setup.ckpt_dir, &setup.comm);
    // The in-memory copy every rank agrees on, if any; a remote store is asked only when there is none.
    let memory = if resume { memory_copy(setup)? } else { None };
    if resume && memory.is_none() && spec.checkpoint.url.as_deref().is_some_and(crate::remote::is_remote) {
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
    let own = match (resume, memory) {
        (false, _) => None,
        (true, None) => ckpt_dir.latest_valid().map_err(|e| Error::Checkpoint(e.to_string()))?,
        (true, Some(copy)) => Some(match storage_newer_than(ckpt_dir, copy.manifest.step)? {
            Some(newer) => newer,
            None => copy,
        }),
    };
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
            for (i, (name, _)) in params.vars().iter().enumerate() {
                let td = by_name.get(name.as_str()).ok_or_else(|| {
                    Error::Checkpoint(format!("{}: no tensor {name} in model.safetensors", l.dir.display()))
                })?;
                // Whole tensors: a tensor-parallel rank keeps its part.
                let full = params.full_dims(i);
                if td.shape != full {
                    return Err(Error::Checkpoint(format!(
                        "{}: tensor {name} has shape {:?}, the model expects {full:?}",
                        l.dir.display(),
                        td.shape,
                    )));
                }
                params.set_whole(i, &td.data)?;
            }
            if rank == 0 {
                match &setup.memory {
                    Some(m) if l.dir.starts_with(m.job_root()) => eprintln!(
                        "resuming from memory copy at step {} ({}; storage not read)",
                        l.manifest.step,
                        l.dir.display()
                    ),
                    _ => eprintln!("resuming from {} (step {})", l.dir.display(), l.manifest.step),
                }
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

/// The in-memory copy this rank resumes from: the newest step that verifies on every rank's host (each rank reads
/// its host's copy), or `None` on every rank when some rank has none of that step. Corrupt or partial copies are
/// skipped with a warning naming the file. Every rank calls it (two all-reduces) when in-memory copies are on.
fn memory_copy(setup: &Setup) -> Result<Option<Loaded>> {
    let (Some(store), comm) = (&setup.memory, &setup.comm) else { return Ok(None) };
    let warn = |file: &std::path::Path, why: &str| {
        if setup.host_leader {
            eprintln!("warning: skipped memory copy file {}: {why}", file.display());
        }
    };
    let mine = match store.newest_valid() {
        Ok((copy, skipped)) => {
            for (file, why) in &skipped {
                warn(file, why);
            }
            copy
        }
        Err(e) => {
            warn(store.dir().root(), &e.to_string());
            None
        }
    };
    // Steps are far below 2^53: exact in an f64.
    let my_step = mine.as_ref().map_or(0, |l| l.manifest.step);
    let mut agreed = [my_step as f64];
    comm.all_reduce(&mut agreed, ReduceOp::Min)?;
    let agreed = agreed[0] as u64;
    if agreed == 0 {
        return Ok(None);
    }
    let copy = if my_step == agreed {
        mine
    } else {
        match store.load_step(agreed) {
            Ok(l) => Some(l),
            Err(e) => {
                warn(e.path().unwrap_or(store.dir().root()), &e.to_string());
                None
            }
        }
    };
    let mut everyone = [if copy.is_some() { 1f64 } else { 0.0 }];
    comm.all_reduce(&mut everyone, ReduceOp::Min)?;
    if everyone[0] < 1.0 {
        if setup.rank == 0 {
            eprintln!("warning: not every rank has a valid memory copy of step {agreed}; looking in storage");
        }
        return Ok(None);
    }
    // Its skipped copies were reported above.
    Ok(copy.map(|c| Loaded { skipped: Vec::new(), ..c }))
}

/// The newest valid checkpoint in storage newer than `step`, if any: storage checkpoints at or below it are not
/// read (their names are listed, nothing more). Invalid ones are skipped with a warning naming the file.
fn storage_newer_than(ckpt_dir: &CheckpointDir, step: u64) -> Result<Option<Loaded>> {
    let listed = ckpt_dir.list().map_err(|e| Error::Checkpoint(e.to_string()))?;
    let mut skipped = Vec::new();
    for (s, dir) in listed.into_iter().rev().filter(|(s, _)| *s > step) {
        match ckpt_dir.load(&dir) {
            Ok(mut l) => {
                l.skipped = skipped;
                return Ok(Some(l));
            }
            Err(e) => {
                let file = e.path().map_or_else(|| dir.clone(), std::path::Path::to_path_buf);
                tracing::warn!(step = s, file = %file.display(), "skipping invalid checkpoint: {e}");
                skipped.push((file, e.to_string()));
            }
        }
    }
    Ok(None)
}

/// Puts the sampler and the optimizer state where checkpoint `l` left them; returns the step to start from.
pub(super) fn restore(l: &Loaded, tr: &mut Training) -> Result<usize> {
    let state: shoal_data::SamplerState = serde_json::from_value(l.manifest.sampler.clone())
        .map_err(|e| Error::Checkpoint(format!("{}: sampler state: {e}", l.dir.display())))?;
    tr.sampler.restore(state)?;
    if let Some(shards) = &tr.shards {
        // A checkpoint of a static run (or one without a ledger) goes on from the next whole epoch's blocks.
        let ledger = match l.manifest.extra.get("shards") {
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|e| Error::Checkpoint(format!("{}: the shards' ledger: {e}", l.dir.display())))?,
            None => {
                tracing::warn!(
                    checkpoint = %l.dir.display(),
                    "the checkpoint has no ledger of dynamic sharding: the next epoch's blocks are handed out from here"
                );
                shoal_data::shards::Ledger {
                    batch: tr.sampler.batch_number(),
                    fresh_from: state.epoch + 1,
                    ..Default::default()
                }
            }
        };
        tr.shards = Some(shards.resumed(tr.sampler.clone(), ledger)?);
    }
    let named: std::collections::HashMap<String, Tensor> = l
        .optimizer
        .iter()
        .map(|td| Ok((td.name.clone(), Tensor::from_slice(&td.data, td.shape.as_slice(), &candle_core::Device::Cpu)?)))
        .collect::<Result<_>>()?;
    let opt_t = l.manifest.extra.get("optimizer_t").and_then(|v| v.as_u64()).unwrap_or(l.manifest.step);
    let (named, compression) = crate::strategy::compress::split(named);
    tr.trainer.load_optimizer_state(opt_t, &named)?;
    tr.trainer.load_compression_state(&compression)?;
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
