//! What a checkpoint holds, read without loading its tensors ([`inspect`]): where a path given by a user leads (one
//! checkpoint, or the newest valid one of a run), the manifest's step, world size, strategy, sampler position and
//! optimizer step, every tensor with its shape, dtype, size and layout, and the status of every step beside it.
//!
//! The layout says how the shards in the files map onto the full tensors. Every strategy saves whole tensors today,
//! so each tensor has one shard at offsets `[0, ...]` with the full shape; a sharded checkpoint would list several.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::dir::CheckpointDir;
use super::error::{CheckpointError, Result};
use super::format::read_safetensors_header;
use super::layout::{CHECKPOINTS_SUBDIR, MANIFEST_FILE, MODEL_FILE, OPTIMIZER_FILE, parse_step_name};
use super::manifest::{FileEntry, Manifest};

/// The part of a checkpoint a tensor belongs to.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// The model's parameters (`model.safetensors`).
    Model,
    /// The optimizer's state (`optimizer.safetensors`).
    Optimizer,
}

impl Part {
    /// `model` or `optimizer`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Model => "model",
            Self::Optimizer => "optimizer",
        }
    }
}

/// One stored piece of a tensor: the file holding it, where it starts in the full tensor, and its shape.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// File name within the step directory.
    pub file: String,
    /// Index of its first element in the full tensor, one per dimension.
    pub offsets: Vec<usize>,
    /// Its shape.
    pub shape: Vec<usize>,
}

/// One full tensor of a checkpoint and how it is stored.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    /// Parameter (or optimizer state) name.
    pub name: String,
    /// Model or optimizer.
    pub part: Part,
    /// Full shape.
    pub shape: Vec<usize>,
    /// Dtype as safetensors spells it (`F32`).
    pub dtype: String,
    /// Elements of the full tensor.
    pub elements: u64,
    /// Bytes of the full tensor.
    pub bytes: u64,
    /// `whole` (one shard holding all of it) or `sharded`.
    pub layout: String,
    /// The pieces that make it up.
    pub shards: Vec<Shard>,
}

/// Counts of a set of tensors.
#[derive(Serialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Tensors.
    pub tensors: usize,
    /// Elements.
    pub elements: u64,
    /// Bytes of tensor data.
    pub bytes: u64,
}

impl Totals {
    fn add(&mut self, t: &TensorLayout) {
        self.tensors += 1;
        self.elements += t.elements;
        self.bytes += t.bytes;
    }
}

/// Totals of the model, of the optimizer, and of both.
#[derive(Serialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PartTotals {
    /// The model's tensors.
    pub model: Totals,
    /// The optimizer's tensors.
    pub optimizer: Totals,
    /// Both.
    pub all: Totals,
}

/// Whether one step directory holds a valid checkpoint.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct StepStatus {
    /// The step.
    pub step: u64,
    /// Its directory.
    pub dir: PathBuf,
    /// Whether its manifest and every file it lists check out.
    pub valid: bool,
    /// The offending file, when invalid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// What is wrong, when invalid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl StepStatus {
    fn of(step: u64, dir: &Path, res: &Result<Manifest>) -> Self {
        match res {
            Ok(_) => Self { step, dir: dir.to_path_buf(), valid: true, file: None, error: None },
            Err(e) => Self {
                step,
                dir: dir.to_path_buf(),
                valid: false,
                file: Some(e.path().map_or_else(|| dir.to_path_buf(), Path::to_path_buf)),
                error: Some(e.to_string()),
            },
        }
    }
}

/// A verified checkpoint described: its manifest, its tensors and their layout, and the steps beside it.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Inspection {
    /// The step directory described.
    pub dir: PathBuf,
    /// Optimizer steps completed when it was saved.
    pub step: u64,
    /// Epoch the run was in.
    pub epoch: u64,
    /// World size of the run that saved it.
    pub world_size: usize,
    /// Strategy of the run that saved it (`ddp`, `zero1`, ...).
    pub strategy: String,
    /// The sampler's position (`{"epoch", "position"}` from the trainer).
    pub sampler: serde_json::Value,
    /// The optimizer's step count `t`, when the trainer recorded it.
    pub optimizer_t: Option<u64>,
    /// How the ranks that saved it split the model, when they did (`{data, tensor, pipeline_stages, micro_batches,
    /// schedule, virtual_stages}`, as the trainer recorded it); the tensors are whole whatever it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_layout: Option<serde_json::Value>,
    /// When the manifest was written, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// Its files with size and sha256.
    pub files: BTreeMap<String, FileEntry>,
    /// Every tensor, the model's first, each in file order.
    pub tensors: Vec<TensorLayout>,
    /// Totals of the tensors.
    pub totals: PartTotals,
    /// Every step directory beside it, oldest first (only this one when a single checkpoint was named).
    pub steps: Vec<StepStatus>,
}

/// Where a path given as a checkpoint leads.
pub(super) enum Target {
    /// One step directory.
    Step(PathBuf),
    /// A run's checkpoints: the newest valid one is meant.
    Run(CheckpointDir),
}

/// Resolves `path`: a step directory (it has a `manifest.json`, or its name is `step-NNNNNN`), a run directory
/// (it has `checkpoints/`) or a `checkpoints/` directory itself (it holds step directories).
pub(super) fn resolve(path: &Path) -> Result<Target> {
    if !path.exists() {
        return Err(CheckpointError::Missing { path: path.to_path_buf() });
    }
    if !path.is_dir() {
        return Err(not_a_checkpoint(path, "is not a directory"));
    }
    let named_step = path.file_name().and_then(|n| n.to_str()).and_then(parse_step_name).is_some();
    if path.join(MANIFEST_FILE).exists() || named_step {
        return Ok(Target::Step(path.to_path_buf()));
    }
    if path.join(CHECKPOINTS_SUBDIR).is_dir() {
        return Ok(Target::Run(CheckpointDir::new(path)));
    }
    let as_root = CheckpointDir::new(path.parent().unwrap_or(Path::new("")));
    if as_root.checkpoints_dir() == path && !as_root.list()?.is_empty() {
        return Ok(Target::Run(as_root));
    }
    let holds_steps = std::fs::read_dir(path)
        .map(|rd| rd.flatten().any(|e| e.file_name().to_str().and_then(parse_step_name).is_some()))
        .unwrap_or(false);
    if holds_steps {
        return Err(not_a_checkpoint(path, format!("holds step directories but is not named {CHECKPOINTS_SUBDIR}")));
    }
    Err(not_a_checkpoint(
        path,
        format!("not a checkpoint (no {MANIFEST_FILE}) nor a run directory (no {CHECKPOINTS_SUBDIR}/)"),
    ))
}

pub(super) fn not_a_checkpoint(path: &Path, why: impl Into<String>) -> CheckpointError {
    CheckpointError::NotACheckpoint { path: path.to_path_buf(), why: why.into() }
}

/// "no valid checkpoint" for a run whose steps are `steps`, naming each offending file.
pub(super) fn none_valid(cd: &CheckpointDir, steps: &[StepStatus]) -> CheckpointError {
    if steps.is_empty() {
        return not_a_checkpoint(&cd.checkpoints_dir(), "holds no checkpoint");
    }
    let why: Vec<String> = steps.iter().filter_map(|s| s.error.clone()).collect();
    not_a_checkpoint(&cd.checkpoints_dir(), format!("no valid checkpoint: {}", why.join("; ")))
}

/// Describes the checkpoint `path` leads to (see [`resolve`]) after verifying it (manifest, sizes, sha256), without
/// loading its tensors. For a run, every step is verified and listed, and the newest valid one is described.
pub fn inspect(path: &Path) -> Result<Inspection> {
    let (dir, manifest, steps) = match resolve(path)? {
        Target::Step(dir) => {
            let manifest = CheckpointDir::new(&dir).verify(&dir)?;
            let steps = vec![StepStatus::of(manifest.step, &dir, &Ok(manifest.clone()))];
            (dir, manifest, steps)
        }
        Target::Run(cd) => {
            let mut steps = Vec::new();
            let mut newest = None;
            for (step, dir) in cd.list()? {
                let res = cd.verify(&dir);
                steps.push(StepStatus::of(step, &dir, &res));
                if let Ok(m) = res {
                    newest = Some((dir, m));
                }
            }
            let (dir, manifest) = newest.ok_or_else(|| none_valid(&cd, &steps))?;
            (dir, manifest, steps)
        }
    };
    describe(dir, manifest, steps)
}

fn describe(dir: PathBuf, manifest: Manifest, steps: Vec<StepStatus>) -> Result<Inspection> {
    let mut tensors = Vec::new();
    let mut totals = PartTotals::default();
    for (part, file) in [(Part::Model, MODEL_FILE), (Part::Optimizer, OPTIMIZER_FILE)] {
        for h in read_safetensors_header(&dir.join(file))? {
            let elements = h.shape.iter().map(|&d| d as u64).product();
            let t = TensorLayout {
                name: h.name,
                part,
                dtype: h.dtype,
                elements,
                bytes: (h.data_offsets.1 - h.data_offsets.0) as u64,
                layout: "whole".to_string(),
                shards: vec![Shard { file: file.to_string(), offsets: vec![0; h.shape.len()], shape: h.shape.clone() }],
                shape: h.shape,
            };
            match part {
                Part::Model => totals.model.add(&t),
                Part::Optimizer => totals.optimizer.add(&t),
            }
            totals.all.add(&t);
            tensors.push(t);
        }
    }
    Ok(Inspection {
        dir,
        step: manifest.step,
        epoch: manifest.epoch,
        world_size: manifest.world_size,
        optimizer_t: manifest.extra.get("optimizer_t").and_then(serde_json::Value::as_u64),
        model_layout: manifest.extra.get("layout").filter(|l| l.is_object()).cloned(),
        strategy: manifest.strategy,
        sampler: manifest.sampler,
        created_unix_ms: manifest.created_unix_ms,
        files: manifest.files,
        tensors,
        totals,
        steps,
    })
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::checkpoint::testing::{TempDir, TestResult, meta, model, optimizer, save3};

    #[test]
    fn a_step_a_run_and_its_checkpoints_dir_lead_to_the_same_checkpoint() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        let dirs = save3(&cd)?;
        for p in [dirs[2].clone(), tmp.path().to_path_buf(), cd.checkpoints_dir()] {
            let i = inspect(&p)?;
            assert_eq!(i.dir, dirs[2], "{}", p.display());
            assert_eq!((i.step, i.world_size, i.strategy.as_str()), (30, 2, "ddp"));
            assert_eq!(i.sampler["position"], 17);
        }
        let i = inspect(tmp.path())?;
        assert_eq!(i.steps.iter().map(|s| (s.step, s.valid)).collect::<Vec<_>>(), [(10, true), (20, true), (30, true)]);
        let names: Vec<_> = i.tensors.iter().map(|t| (t.part, t.name.as_str(), t.shape.clone())).collect();
        assert_eq!(names[0], (Part::Model, "layers.0.weight", vec![3, 4]));
        assert_eq!(names[4], (Part::Optimizer, "m.layers.0.weight", vec![3, 4]));
        let w = &i.tensors[0];
        assert_eq!((w.dtype.as_str(), w.elements, w.bytes, w.layout.as_str()), ("F32", 12, 48, "whole"));
        assert_eq!(w.shards, vec![Shard { file: MODEL_FILE.into(), offsets: vec![0, 0], shape: vec![3, 4] }]);
        assert_eq!(i.tensors[2].shards[0].offsets, Vec::<usize>::new(), "a scalar");
        assert_eq!(i.totals.model, Totals { tensors: 4, elements: 17, bytes: 68 });
        assert_eq!(i.totals.all.tensors, 6);
        Ok(())
    }

    #[test]
    fn invalid_steps_are_listed_naming_the_file() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        let dirs = save3(&cd)?;
        fs::write(dirs[2].join(OPTIMIZER_FILE), b"junk")?;
        let i = inspect(tmp.path())?;
        assert_eq!(i.step, 20);
        let bad = &i.steps[2];
        assert!(!bad.valid);
        assert_eq!(bad.file.as_deref(), Some(dirs[2].join(OPTIMIZER_FILE).as_path()));
        // Named directly, it is an error naming the file.
        let err = inspect(&dirs[2]).err().ok_or("inspected a corrupt checkpoint")?;
        assert_eq!(err.path(), Some(dirs[2].join(OPTIMIZER_FILE).as_path()));
        Ok(())
    }

    #[test]
    fn what_is_not_a_checkpoint_is_an_error_naming_it() -> TestResult {
        let tmp = TempDir::new();
        let missing = tmp.path().join("nope");
        assert!(matches!(inspect(&missing), Err(CheckpointError::Missing { path }) if path == missing));
        let empty = tmp.path().join("empty");
        fs::create_dir(&empty)?;
        let err = inspect(&empty).err().ok_or("an empty dir inspected")?;
        assert!(err.to_string().contains("not a checkpoint"), "{err}");
        let file = tmp.path().join("f");
        fs::write(&file, b"x")?;
        assert_eq!(inspect(&file).err().and_then(|e| e.path().map(Path::to_path_buf)), Some(file));
        // A run whose only checkpoint is bad.
        let cd = CheckpointDir::new(tmp.path().join("run"));
        let d = cd.save(5, &model(1.0), &optimizer(1.0), meta(0))?;
        fs::write(d.join(MANIFEST_FILE), b"{not json")?;
        let err = inspect(cd.root()).err().ok_or("inspected")?;
        assert!(err.to_string().contains("no valid checkpoint") && err.to_string().contains(MANIFEST_FILE), "{err}");
        Ok(())
    }
}
