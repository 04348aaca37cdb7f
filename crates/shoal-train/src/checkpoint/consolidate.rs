//! One safetensors file of the full tensors by parameter name out of a checkpoint ([`consolidate`]), for tools that
//! know nothing of Shoal: the checkpoint is verified first (a corrupt one is refused naming the file), the tensors
//! are assembled whole from their shards (today each is one whole shard), and the file is written to a temporary
//! name, fsynced and renamed into place, with the step, strategy and world size in its `__metadata__`.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::dir::{CheckpointDir, Loaded, fsync_dir};
use super::error::{CheckpointError, Result, io_err};
use super::format::{TensorData, validate_tensors, write_safetensors_with};
use super::inspect::{StepStatus, Target, none_valid, not_a_checkpoint, resolve};

/// Prefix of the optimizer's tensors in a consolidated file.
pub const OPTIMIZER_PREFIX: &str = "optimizer.";

/// What [`consolidate`] writes besides the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsolidateOptions {
    /// Also the optimizer's state, each tensor under its name prefixed [`OPTIMIZER_PREFIX`].
    pub optimizer: bool,
}

/// One tensor written.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct WrittenTensor {
    /// Its name in the output.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype (`F32`).
    pub dtype: String,
    /// Its bytes.
    pub bytes: u64,
}

/// What [`consolidate`] wrote.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Consolidated {
    /// The step directory read.
    pub source: PathBuf,
    /// The file written.
    pub out: PathBuf,
    /// The checkpoint's step.
    pub step: u64,
    /// The strategy it was saved under.
    pub strategy: String,
    /// The world size it was saved by.
    pub world_size: usize,
    /// The tensors, in file order.
    pub tensors: Vec<WrittenTensor>,
    /// Size of the file.
    pub bytes: u64,
    /// Its sha256, lowercase hex.
    pub sha256: String,
    /// The `__metadata__` written.
    pub metadata: std::collections::BTreeMap<String, String>,
    /// Newer checkpoints of the run that were passed over as invalid.
    pub skipped: Vec<StepStatus>,
}

/// Loads and verifies the checkpoint `path` leads to: the step directory itself, or a run's newest valid one (the
/// newer invalid ones are returned, naming their files).
fn load(path: &Path) -> Result<(Loaded, Vec<StepStatus>)> {
    match resolve(path)? {
        Target::Step(dir) => Ok((CheckpointDir::new(&dir).load(&dir)?, Vec::new())),
        Target::Run(cd) => {
            let mut skipped = Vec::new();
            for (step, dir) in cd.list()?.into_iter().rev() {
                match cd.load(&dir) {
                    Ok(loaded) => return Ok((loaded, skipped)),
                    Err(e) => skipped.push(StepStatus {
                        step,
                        file: Some(e.path().map_or_else(|| dir.clone(), Path::to_path_buf)),
                        dir,
                        valid: false,
                        error: Some(e.to_string()),
                    }),
                }
            }
            skipped.reverse();
            Err(none_valid(&cd, &skipped))
        }
    }
}

/// Writes the full model tensors of the checkpoint `path` leads to (see [`inspect`](super::inspect())) into the
/// safetensors file `out` by parameter name, and with `opts.optimizer` the optimizer's too. `out` is replaced
/// atomically: nothing is left at `out` but the old file or the whole new one.
pub fn consolidate(path: &Path, out: &Path, opts: ConsolidateOptions) -> Result<Consolidated> {
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Some(file_name) = out.file_name().and_then(|n| n.to_str()) else {
        return Err(not_a_checkpoint(out, "is not a file name to write"));
    };
    if out.is_dir() {
        return Err(not_a_checkpoint(out, "is a directory, not a file to write"));
    }
    if !parent.is_dir() {
        return Err(CheckpointError::Missing { path: parent });
    }
    let (loaded, skipped) = load(path)?;
    let Loaded { dir, manifest, model, optimizer, .. } = loaded;
    let mut tensors = model;
    if opts.optimizer {
        tensors
            .extend(optimizer.into_iter().map(|t| TensorData { name: format!("{OPTIMIZER_PREFIX}{}", t.name), ..t }));
    }
    validate_tensors("consolidated", &tensors)?;
    let metadata: std::collections::BTreeMap<String, String> = [
        ("format", "pt".to_string()),
        ("step", manifest.step.to_string()),
        ("strategy", manifest.strategy.clone()),
        ("world_size", manifest.world_size.to_string()),
        ("epoch", manifest.epoch.to_string()),
        ("source", dir.display().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();

    let tmp = parent.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let written = write_safetensors_with(&tmp, &tensors, Some(metadata.clone().into_iter().collect::<HashMap<_, _>>()))
        .and_then(|entry| fs::rename(&tmp, out).map(|()| entry).map_err(|e| io_err(out, e)));
    let entry = match written {
        Ok(entry) => entry,
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
    };
    fsync_dir(&parent)?;
    Ok(Consolidated {
        source: dir,
        out: out.to_path_buf(),
        step: manifest.step,
        strategy: manifest.strategy,
        world_size: manifest.world_size,
        tensors: tensors
            .iter()
            .map(|t| WrittenTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                dtype: format!("{:?}", super::format::REAL_ST_DTYPE),
                bytes: (t.data.len() * crate::REAL_BYTES) as u64,
            })
            .collect(),
        bytes: entry.bytes,
        sha256: entry.sha256,
        metadata,
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use safetensors::SafeTensors;

    use super::*;
    use crate::checkpoint::layout::MODEL_FILE;
    use crate::checkpoint::testing::{TempDir, TestResult, model, save3};

    #[test]
    fn the_model_is_written_by_name_with_its_metadata() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path().join("run"));
        let dirs = save3(&cd)?;
        let out = tmp.path().join("full.safetensors");
        let c = consolidate(cd.root(), &out, ConsolidateOptions::default())?;
        assert_eq!((c.source.as_path(), c.step, c.world_size), (dirs[2].as_path(), 30, 2));
        let bytes = fs::read(&out)?;
        assert_eq!(c.bytes, bytes.len() as u64);
        let st = SafeTensors::deserialize(&bytes)?;
        let mut names = st.names();
        names.sort_unstable();
        assert_eq!(names, ["empty", "layers.0.bias", "layers.0.weight", "scale"]);
        let w = st.tensor("layers.0.weight")?;
        let want: Vec<u8> = model(3.0)[0].data.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!((w.shape(), w.data()), (&[3usize, 4][..], &want[..]));
        let (_, meta) = SafeTensors::read_metadata(&bytes)?;
        let meta = meta.metadata().clone().ok_or("no metadata")?;
        assert_eq!(meta.get("step").map(String::as_str), Some("30"));
        assert_eq!(meta.get("strategy").map(String::as_str), Some("ddp"));
        assert_eq!(meta.get("world_size").map(String::as_str), Some("2"));

        // With the optimizer, its tensors are prefixed; the file is replaced whole.
        let c = consolidate(&dirs[0], &out, ConsolidateOptions { optimizer: true })?;
        assert_eq!(c.tensors.len(), 6);
        let bytes = fs::read(&out)?;
        let st = SafeTensors::deserialize(&bytes)?;
        assert_eq!(st.tensor("optimizer.m.layers.0.weight")?.shape(), &[3, 4]);
        assert_eq!(st.tensor("scale")?.data(), &1.0f32.to_le_bytes());
        let left: Vec<_> = fs::read_dir(tmp.path())?.flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 2, "no temp file left: {left:?}");
        Ok(())
    }

    #[test]
    fn a_corrupt_checkpoint_is_refused_naming_the_file() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path().join("run"));
        let dirs = save3(&cd)?;
        let p = dirs[2].join(MODEL_FILE);
        let mut b = fs::read(&p)?;
        let last = b.len() - 1;
        b[last] ^= 1;
        fs::write(&p, b)?;
        let out = tmp.path().join("out.safetensors");
        let err = consolidate(&dirs[2], &out, ConsolidateOptions::default()).err().ok_or("consolidated")?;
        assert_eq!(err.path(), Some(p.as_path()));
        assert!(!out.exists());
        // The run falls back to the newest valid one, saying which it passed over.
        let c = consolidate(cd.root(), &out, ConsolidateOptions::default())?;
        assert_eq!(c.step, 20);
        assert_eq!(c.skipped.len(), 1);
        assert_eq!(c.skipped[0].file.as_deref(), Some(p.as_path()));
        // An output in a directory that does not exist names it.
        let nowhere = tmp.path().join("no/such/dir/x.safetensors");
        let err = consolidate(cd.root(), &nowhere, ConsolidateOptions::default()).err().ok_or("wrote")?;
        assert_eq!(err.path(), nowhere.parent());
        Ok(())
    }
}
