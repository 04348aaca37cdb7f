//! The job spec: a TOML file (or the same object as JSON, for the HTTP API) describing one training job.
//!
//! ```toml
//! name = "mlp-digits"            # [A-Za-z0-9._-], not starting with '.'
//! queue = "default"              # on a platform: queue, priority, [workers], [resources],
//!                                # [fault_tolerance] (see the `platform` module; `shoal run` uses only
//!                                # workers.count)
//! [env]                          # extra environment for every worker (not the contract's own names)
//! NCCL_DEBUG = "INFO"
//!
//! [train]
//! dataset = "digits"             # a built-in dataset: digits, cicero, synthetic
//! strategy = "ddp"               # ddp (default) | zero1 | zero2 | zero3 | pipeline | tensor | 3d | auto
//! global_batch = 64              # samples per optimizer step over all ranks and accumulation steps
//! steps = 600                    # optimizer steps
//! seed = 0
//! optimizer = "adamw"            # adamw (default) | sgd
//! lr = 3e-3
//! warmup_steps = 20
//! schedule = "cosine"            # cosine (default) | constant
//!
//! [train.model]                  # or just `model = "mlp"` in [train] for all the defaults
//! kind = "mlp"                   # mlp | cnn | gpt | vit
//! hidden = [128, 64]
//!
//! [train.data]                   # data::Options (dataset options), e.g. features/classes/samples
//!
//! [checkpoint]
//! every = 100                    # 0 = only at the end
//! keep = 3
//! memory_every = 10              # copy the state to this host's shared memory every 10 steps; 0 = off
//! url = "file:///tmp/ckpt"       # optional; default: the run's output directory
//!
//! [parallel]                     # with strategy = "pipeline", "tensor" or "3d" only
//! pipeline_stages = 2            # pipeline: stages of consecutive layers, one rank each (world size = stages)
//! micro_batches = 4              # pipeline: the global batch split into this many micro-batches
//! schedule = "1f1b"              # pipeline: 1f1b (default) | gpipe | interleaved
//! # virtual_stages = 2           # interleaved: model chunks per rank (≥ 2, default 2; micro_batches a multiple of
//! #                              # pipeline_stages, the layers cut into pipeline_stages × virtual_stages chunks)
//! # tensor = 2                   # tensor (instead of the three above): ranks that split every layer (world size)
//! # strategy = "3d" composes them: data × tensor × pipeline_stages = world size (each 1 by default)
//! # data = 2                     # 3d: data-parallel replicas, each a whole model split by tensor and pipeline
//! # zero = 1                     # 3d: 0 (default) | 1 — the optimizer state sharded over each data-parallel group
//! # balance = "time"             # pipeline: stages cut by measured layer time (default) | "params" (parameter count)
//! ```
//!
//! # Contract
//!
//! - Every table rejects unknown keys; every error names the key path (`train.model.hidden[1]`) and the reason,
//!   and [`parse_job`] / [`load_job`] / [`parse_job_json`] validate before returning, so a bad spec stops before
//!   any process starts.
//! - Options that apply to one optimizer or model only (`momentum` for SGD, `betas`/`eps` for AdamW, `hidden` for
//!   the MLP, ...) are `Option`s in the struct and are an error when set for another one; read the resolved value
//!   through the accessor of the same name (`TrainSpec::momentum()`, `ModelSpec::hidden()`, ...).
//! - `[train.model]` and `model = "kind"` are the same key: TOML cannot hold both, so the table form names the
//!   kind with `kind = "..."`.
//! - Feature `openapi`: the spec's types describe themselves to OpenAPI documents (`utoipa::ToSchema`; the forms
//!   deriving cannot say, quantities and the model's two forms, in `schema.rs`), for the server's API document.
//!
//! # Defaults
//!
//! | key | default |
//! |---|---|
//! | `train.strategy` | `ddp` |
//! | `train.precision` | `f32` (`bf16`, `f16`: 16-bit passes, f32 master weights) |
//! | `train.collectives` | `auto` (NCCL for GPU ranks under plain DDP in a build with it, else Shoal's own; `nccl`, `shoal`) |
//! | `train.seed` | 0 |
//! | `train.optimizer` | `adamw` |
//! | `train.momentum` (sgd) | 0.9 |
//! | `train.weight_decay` | 0.01 for adamw (PyTorch's AdamW default), 0.0 for sgd (PyTorch's SGD default) |
//! | `train.betas` (adamw) | [0.9, 0.999] |
//! | `train.eps` (adamw) | 1e-8 |
//! | `train.grad_accum` | 1 |
//! | `train.warmup_steps` | 0 (linear warm-up from 0 to `lr` over these steps) |
//! | `train.schedule` | `cosine` (from `lr` after warm-up down to `min_lr` at `steps`) |
//! | `train.min_lr` | 0.0 |
//! | `train.clip_grad_norm` | none (no clipping) |
//! | `train.eval_every` | 0 (evaluate only at the end) |
//! | `train.eval_batches` | 8 |
//! | `train.bucket_mb` | 25.0 (MiB) |
//! | `train.overlap` | `auto` (overlap the gradient all-reduce with backward only when a core is free for it) |
//! | `train.log_every` | 1 |
//! | `train.model.hidden` (mlp) | [128, 64] |
//! | `train.model.channels` (cnn) | [16, 32] |
//! | `train.model.layers`, `heads`, `width`, `context` (gpt) | 2, 4, 64, 64 |
//! | `train.model.vocab` (gpt) | 256 (byte-level) |
//! | `train.model.patch` (vit) | 4 (4×4 patches: 4 of them for the 8×8 digits) |
//! | `train.model.layers`, `heads`, `width` (vit) | 2, 4, 64 |
//! | `train.model.dropout` | 0.0 |
//! | `checkpoint.every` | 0 (only at the end) |
//! | `checkpoint.keep` | 3 |
//! | `checkpoint.memory_every` | 0 (no in-memory copies) |
//! | `parallel.schedule` | `1f1b` |
//! | `parallel.virtual_stages` | 2 under `schedule = "interleaved"`, else 1 |
//! | `parallel.balance` | `time` under `strategy = "pipeline"` (a composed layout cuts by `params`) |
//! | `ps.servers` | 1 |
//! | `ps.mode` | `sync` |
//! | `ps.staleness` (ssp) | 3 |
//!
//! # Model architectures (what [`ModelSpec::param_count`] counts)
//!
//! - **mlp**: `features → hidden[0] → … → classes`, each a linear layer with bias, ReLU between.
//! - **cnn**: the input is a `side × side` single-channel image (`features = side²`); per entry `c` of `channels`:
//!   3×3 convolution (padding 1, bias) to `c` channels, ReLU, 2×2 max-pool (stride 2, so `side /= 2`); then a
//!   linear layer with bias from `c_last × side²` to `classes`.
//! - **gpt**: token embedding `vocab × width`, learned position embedding `context × width`, `layers` pre-norm
//!   blocks (LayerNorm with bias, causal self-attention with a fused QKV linear `width → 3·width` and an output
//!   linear `width → width`, LayerNorm, MLP `width → 4·width → width`, all linears with bias), a final LayerNorm
//!   and an untied head `width → vocab`, with bias.
//! - **vit**: the `side × side` image cut into `(side/patch)²` patches of `patch × patch` pixels, each projected by
//!   a linear `patch² → width` (with bias); a learned class token `width` first, learned position embeddings
//!   `(patches + 1) × width`; `layers` pre-norm blocks as the GPT's but without the causal mask; a final LayerNorm
//!   and a head `width → classes` (with bias) on the class token.

use std::fmt;
use std::path::Path;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
pub mod data;

use data::{Kind, Options, Split};

mod compression;
mod federated;
mod platform;
mod ps;
mod robust;
#[cfg(feature = "openapi")]
mod schema;
mod stats;

pub use compression::{CodecName, CompressionSpec};
pub use federated::{DpSpec, FedAlgorithm, FedPartition, FederatedSpec};
pub use platform::{
    FaultPolicy, FaultToleranceSpec, MAX_BYTES, MAX_DURATION, MAX_MILLI, MAX_WORKERS, PhaseSpec, ResourcesSpec,
    Seconds, WorkersSpec, parse_bytes, parse_milli,
};
pub use ps::{MAX_SERVERS, PsMode, PsSpec};
pub use robust::{AttackName, ChaosSpec, RobustSpec, RuleName};
pub use stats::median;

// ---------------------------------------------------------------------------------------------------------------
// errors

/// A job spec that cannot be used: where (`origin`, e.g. the file name, and the key `path`, empty for the whole
/// document) and why. Displays as `JOB.toml: train.steps: must be > 0`; syntax and type errors add the line and
/// column when the parser knows them.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", render(.origin, .path, .message, *.line, *.column))]
pub struct SpecError {
    /// Where the spec came from (a file name, `job.json`, ...).
    pub origin: String,
    /// The key path, e.g. `train.model.hidden[1]`; empty when the error is about the document as a whole.
    pub path: String,
    /// What is wrong.
    pub message: String,
    /// 1-based line in the document, when known.
    pub line: Option<usize>,
    /// 1-based column in the document, when known.
    pub column: Option<usize>,
}

fn render(origin: &str, path: &str, message: &str, line: Option<usize>, column: Option<usize>) -> String {
    let mut s = String::from(origin);
    match (path.is_empty(), line, column) {
        (true, Some(l), Some(c)) => s.push_str(&format!(": line {l}, column {c}")),
        (true, Some(l), None) => s.push_str(&format!(": line {l}")),
        _ => {}
    }
    if !path.is_empty() {
        s.push_str(": ");
        s.push_str(path);
    }
    s.push_str(": ");
    s.push_str(message);
    if !path.is_empty()
        && let Some(l) = line
    {
        s.push_str(&format!(" (line {l})"));
    }
    s
}

impl SpecError {
    fn at(path: impl Into<String>, message: impl Into<String>) -> Self {
        SpecError { origin: String::new(), path: path.into(), message: message.into(), line: None, column: None }
    }

    /// The same error, said to come from `origin` (a file name): errors of checks run on a parsed spec, such as
    /// [`JobSpec::validate_world`], carry none.
    pub fn with_origin(mut self, origin: &str) -> Self {
        origin.clone_into(&mut self.origin);
        self
    }
}

type Result<T, E = SpecError> = std::result::Result<T, E>;

// ---------------------------------------------------------------------------------------------------------------
// the spec

/// A whole job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// The job's name: 1–128 characters of `[A-Za-z0-9._-]`, not starting with `.` (it names directories).
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$"))]
    pub name: String,
    /// The queue it waits in on a platform (default `default`).
    #[serde(default = "default_queue")]
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9._-]{1,64}$"))]
    pub queue: String,
    /// Higher runs first and may preempt lower (default 0).
    #[serde(default)]
    pub priority: i32,
    /// How long the job is expected to run (`"2h"`), as a Slurm user gives `--time`: the scheduler's backfill lets
    /// it start ahead of a waiting job's reservation when it ends before it, and shortest-first ordering sorts by
    /// it. Not enforced: a job that runs longer is not stopped. Without it, a job is never backfilled ahead of a
    /// reservation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, example = "2h"))]
    pub expected_runtime: Option<Seconds>,
    #[serde(default)]
    pub workers: WorkersSpec,
    #[serde(default)]
    pub resources: ResourcesSpec,
    /// `[fault_tolerance]`: what follows a failed or lost worker or a hang.
    #[serde(default)]
    pub fault_tolerance: FaultToleranceSpec,
    /// `[env]`: extra environment variables for every worker (names of the environment contract are refused).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub env: std::collections::BTreeMap<String, String>,
    /// `[[phases]]`: stretches of training with their own `[workers]` and `[resources]`; the platform resizes the
    /// job at each boundary (every worker checkpoints there) and releases what the next phase does not need.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhaseSpec>,
    pub train: TrainSpec,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    /// `[parallel]`: how the model is cut across the ranks (`train.strategy = "pipeline"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel: Option<ParallelSpec>,
    /// `[compression]`: what the ranks send in place of their gradients (none by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<CompressionSpec>,
    /// `[robust]`: the rule that combines the ranks' gradients when some may lie (the plain sum by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub robust: Option<RobustSpec>,
    /// `[chaos]`: ranks that send forged gradients, for experiments with `[robust]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chaos: Option<ChaosSpec>,
    /// `[ps]`: the parameter servers of `train.strategy = "ps"` (one synchronous server by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ps: Option<PsSpec>,
    /// `[federated]`: the clients, rounds and rules of `train.strategy = "federated"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub federated: Option<FederatedSpec>,
}

/// `[parallel]`: the layout of a pipeline-parallel or tensor-parallel job.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSpec {
    /// Pipeline: stages of consecutive layers, one rank each (at least 2; required with `strategy = "pipeline"`,
    /// refused with any other).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 2))]
    pub pipeline_stages: Option<usize>,
    /// Pipeline: micro-batches the global batch is split into, each passed through the stages in turn (required with
    /// `strategy = "pipeline"`, refused with any other).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub micro_batches: Option<usize>,
    /// The order in which a stage runs its micro-batches' forward and backward passes.
    #[serde(default)]
    pub schedule: PipelineSchedule,
    /// Model chunks per rank under `schedule = "interleaved"` (at least 2; default 2): rank `r` of `P` holds chunks
    /// `r, r + P, …` of the model's `P · virtual_stages` chunks of consecutive layers. Any other schedule has one
    /// (1, or left out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub virtual_stages: Option<usize>,
    /// Data-parallel degree (`strategy = "3d"` only; default 1): replicas of the model, each split by `tensor` and
    /// `pipeline_stages`, each taking its share of every global batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<u64>,
    /// Tensor parallel: the ranks every layer is split across, Megatron-style (at least 2; required with
    /// `strategy = "tensor"`, where the world size must equal it; with `strategy = "3d"` any degree, default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 2))]
    pub tensor: Option<u64>,
    /// The pipeline degree under another name: `pipeline_stages` (accepted with `strategy = "3d"`, where it must
    /// agree with `pipeline_stages` if both are set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<u64>,
    /// ZeRO stage within each data-parallel group (`strategy = "3d"` only): 0 (default) or 1, the optimizer state
    /// sharded over the group; 2 and 3 are not available in a composed layout yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero: Option<u64>,
    /// How `strategy = "pipeline"` cuts the model into stages: `"time"` (default) by each layer's measured forward
    /// and backward time, `"params"` by parameter count. A composed layout (`"3d"`) cuts by parameter count only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance: Option<StageBalance>,
}

/// `parallel.balance`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum StageBalance {
    /// Cut first by parameter count, then again after the first steps by the time each layer was measured to take
    /// (forward and backward, the loss with the last layer), moving parameters and optimizer state between stages.
    #[default]
    #[serde(rename = "time")]
    Time,
    /// Cut by parameter count, once.
    #[serde(rename = "params")]
    Params,
}

impl StageBalance {
    pub fn as_str(self) -> &'static str {
        match self {
            StageBalance::Time => "time",
            StageBalance::Params => "params",
        }
    }
}

/// `parallel.schedule`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum PipelineSchedule {
    /// Every micro-batch's forward, then every backward (GPipe).
    #[serde(rename = "gpipe")]
    Gpipe,
    /// Stage `s` runs `S-1-s` forwards, then alternates one forward and one backward, then the backwards left
    /// (PipeDream-flush): as little idle time as GPipe with at most `S-s` micro-batches' activations held.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B: each rank holds `virtual_stages` non-contiguous chunks of layers, and the
    /// micro-batches (a multiple of the stages) go round the ranks once per chunk; the bubble shrinks to
    /// `(P-1)/(V·M + P-1)` for `V` times the messages.
    #[serde(rename = "interleaved")]
    Interleaved,
}

impl PipelineSchedule {
    pub fn as_str(self) -> &'static str {
        match self {
            PipelineSchedule::Gpipe => "gpipe",
            PipelineSchedule::OneFOneB => "1f1b",
            PipelineSchedule::Interleaved => "interleaved",
        }
    }
}

impl ParallelSpec {
    /// Model chunks per pipeline rank: `virtual_stages` (default 2) under the interleaved schedule, else 1.
    pub fn virtual_stages(&self) -> usize {
        match self.schedule {
            PipelineSchedule::Interleaved => self.virtual_stages.unwrap_or(2),
            _ => 1,
        }
    }

    /// Checks `schedule` and `virtual_stages` of a pipeline of `stages` stages and `micro` micro-batches: the
    /// interleaved schedule has at least 2 chunks per rank and a multiple of the stages as micro-batches (as
    /// Megatron-LM requires); any other has one chunk per rank.
    fn validate_chunks(&self, stages: usize, micro: usize) -> Result<()> {
        if let Some(v) = self.virtual_stages {
            positive("parallel.virtual_stages", v)?;
        }
        if self.schedule != PipelineSchedule::Interleaved {
            return match self.virtual_stages {
                Some(v) if v != 1 => Err(SpecError::at(
                    "parallel.virtual_stages",
                    format!("{v} virtual stages: only schedule = \"interleaved\" has more than 1"),
                )),
                _ => Ok(()),
            };
        }
        let v = self.virtual_stages();
        if v < 2 {
            return Err(SpecError::at(
                "parallel.virtual_stages",
                format!("{v}: the interleaved schedule holds at least 2 model chunks per rank"),
            ));
        }
        if !micro.is_multiple_of(stages.max(1)) {
            return Err(SpecError::at(
                "parallel.micro_batches",
                format!(
                    "{micro} micro-batches: the interleaved schedule takes them in groups of parallel.pipeline_stages \
                     = {stages} (a multiple of it)"
                ),
            ));
        }
        Ok(())
    }

    /// The pipeline's stages and micro-batches (0 where not set: refused by validation under a pipeline).
    pub fn stages_and_micro_batches(&self) -> (usize, usize) {
        (self.pipeline_stages.unwrap_or(0), self.micro_batches.unwrap_or(0))
    }

    /// The degrees of a composed layout (`strategy = "3d"`): data, tensor, pipeline (each 1 where not set).
    pub fn degrees(&self) -> (usize, usize, usize) {
        let n = |v: Option<u64>| v.map_or(1, |n| usize::try_from(n).unwrap_or(usize::MAX));
        let pipeline = self.pipeline_stages.or_else(|| self.pipeline.map(|p| usize::try_from(p).unwrap_or(usize::MAX)));
        (n(self.data), n(self.tensor), pipeline.unwrap_or(1))
    }

    /// The ZeRO stage inside each data-parallel group of a composed layout (0 where not set).
    pub fn zero_stage(&self) -> u8 {
        self.zero.map_or(0, |z| u8::try_from(z).unwrap_or(u8::MAX))
    }

    /// Checks a composed layout on its own (what needs the model or the world size is checked with them).
    fn validate_composed(&self) -> Result<()> {
        for (key, v) in [("data", self.data), ("tensor", self.tensor), ("pipeline", self.pipeline)] {
            if v == Some(0) {
                return Err(SpecError::at(format!("parallel.{key}"), "must be > 0"));
            }
        }
        if self.pipeline_stages == Some(0) {
            return Err(SpecError::at("parallel.pipeline_stages", "must be > 0"));
        }
        if let (Some(a), Some(b)) = (self.pipeline_stages, self.pipeline)
            && a as u64 != b
        {
            return Err(SpecError::at(
                "parallel.pipeline",
                format!("{b} disagrees with parallel.pipeline_stages = {a} (the same degree: set one of them)"),
            ));
        }
        let (_, _, pipeline) = self.degrees();
        if pipeline > 1 {
            let Some(micro) = self.micro_batches else {
                return Err(SpecError::at("parallel.micro_batches", "required with a pipeline of 2 stages or more"));
            };
            positive("parallel.micro_batches", micro)?;
            self.validate_chunks(pipeline, micro)?;
        } else {
            let pipeline_only = [
                ("micro_batches", self.micro_batches.is_some()),
                ("schedule", self.schedule != PipelineSchedule::default()),
                ("virtual_stages", self.virtual_stages.is_some_and(|v| v != 1)),
            ];
            if let Some((key, _)) = pipeline_only.iter().find(|(_, set)| *set) {
                return Err(SpecError::at(
                    format!("parallel.{key}"),
                    "applies to a pipeline only (parallel.pipeline_stages ≥ 2)",
                ));
            }
        }
        if self.balance == Some(StageBalance::Time) {
            return Err(SpecError::at(
                "parallel.balance",
                "\"time\" applies to train.strategy = \"pipeline\"; a composed layout cuts its stages by parameter count \
                 (\"params\")",
            ));
        }
        match self.zero {
            None | Some(0 | 1) => Ok(()),
            Some(z @ (2 | 3)) => Err(SpecError::at(
                "parallel.zero",
                format!("ZeRO-{z} inside a composed layout is not available yet; available: 0, 1"),
            )),
            Some(z) => Err(SpecError::at("parallel.zero", format!("{z}: a ZeRO stage is 0, 1, 2 or 3"))),
        }
    }

    /// Checks a tensor-parallel layout on its own: `tensor` set and at least 2, nothing of a pipeline's.
    fn validate_tensor(&self) -> Result<()> {
        let pipeline = [
            ("pipeline_stages", self.pipeline_stages.is_some()),
            ("micro_batches", self.micro_batches.is_some()),
            ("schedule", self.schedule != PipelineSchedule::default()),
            ("virtual_stages", self.virtual_stages.is_some_and(|v| v != 1)),
        ];
        if let Some((key, _)) = pipeline.iter().find(|(_, set)| *set) {
            return Err(SpecError::at(
                format!("parallel.{key}"),
                "applies to train.strategy = \"pipeline\" only (composing tensor and pipeline parallelism is not \
                 available yet)",
            ));
        }
        if self.balance.is_some() {
            return Err(SpecError::at("parallel.balance", "applies to train.strategy = \"pipeline\" only"));
        }
        let refused = [
            ("pipeline", self.pipeline, "composing tensor and pipeline parallelism is train.strategy = \"3d\""),
            ("data", self.data, "composing tensor parallelism with data parallelism is train.strategy = \"3d\""),
            ("zero", self.zero, "ZeRO inside a tensor-parallel group is not available yet"),
        ];
        for (key, set, why) in refused {
            if set.is_some() {
                return Err(SpecError::at(format!("parallel.{key}"), why));
            }
        }
        match self.tensor {
            None => Err(SpecError::at("parallel.tensor", "train.strategy = \"tensor\" needs parallel.tensor (≥ 2)")),
            Some(n) if n < 2 => Err(SpecError::at("parallel.tensor", format!("{n} ranks: at least 2"))),
            Some(_) => Ok(()),
        }
    }

    /// Checks a pipeline layout on its own (what needs the model or the world size is checked with them).
    fn validate(&self) -> Result<()> {
        let (Some(stages), Some(micro)) = (self.pipeline_stages, self.micro_batches) else {
            let key = if self.pipeline_stages.is_none() { "pipeline_stages" } else { "micro_batches" };
            return Err(SpecError::at(format!("parallel.{key}"), "required with train.strategy = \"pipeline\""));
        };
        if stages < 2 {
            return Err(SpecError::at("parallel.pipeline_stages", format!("{stages} stages: at least 2")));
        }
        positive("parallel.micro_batches", micro)?;
        self.validate_chunks(stages, micro)?;
        let refused = [
            ("data", self.data, "composing pipeline stages with data parallelism is train.strategy = \"3d\""),
            ("tensor", self.tensor, "composing pipeline and tensor parallelism is train.strategy = \"3d\""),
            ("pipeline", self.pipeline, "the pipeline degree is parallel.pipeline_stages"),
            ("zero", self.zero, "ZeRO inside a pipeline is train.strategy = \"3d\" with parallel.zero"),
        ];
        for (key, set, why) in refused {
            if set.is_some() {
                return Err(SpecError::at(format!("parallel.{key}"), why));
            }
        }
        Ok(())
    }
}

fn default_queue() -> String {
    "default".to_owned()
}

/// How work is spread over the workers.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Data parallel: every rank holds the whole model and a share of each global batch.
    #[default]
    Ddp,
    /// ZeRO stage 1: data parallel with the optimizer state sharded over the ranks.
    Zero1,
    /// ZeRO stage 2: the gradients sharded too, each bucket reduce-scattered as backward passes it.
    Zero2,
    /// ZeRO stage 3: the parameters sharded too, each layer gathered just before its use in forward and backward
    /// and freed after, the next layer's gather overlapping the current layer's computation.
    Zero3,
    /// Pipeline parallel: the model cut into `parallel.pipeline_stages` stages of consecutive layers, one rank each,
    /// activations sent forward and their gradients back between neighbours, micro-batch by micro-batch.
    Pipeline,
    /// Tensor parallel (Megatron-LM style): every transformer layer split across `parallel.tensor` ranks — attention
    /// by heads, the MLP by its hidden units, the vocabulary of the GPT's embedding and head by rows — with
    /// all-reduces of activations in forward and backward; each rank holds only its shards and their optimizer state.
    Tensor,
    /// Composed layouts (Megatron-LM's "3D parallelism"): `parallel.data` × `parallel.tensor` ×
    /// `parallel.pipeline_stages` ranks, tensor-parallel groups inside pipeline stages inside data-parallel replicas,
    /// with `parallel.zero = 1` sharding the optimizer state over each data-parallel group.
    #[serde(rename = "3d")]
    ThreeD,
    /// Parameter servers (`[ps]`): `ps.servers` server processes beside the workers hold the model, spread over
    /// them by size, with its optimizer state; each worker pushes its gradient and pulls the new values, in
    /// `ps.mode` (`sync`: data parallelism's result; `async`; `ssp`: bounded staleness).
    Ps,
    /// The planner's choice for the job's model at the world size it starts with and `resources.memory` per worker
    /// (`shoal_train::plan::choose`): among the layouts this build runs — data parallel with ZeRO 0–3, tensor,
    /// pipeline and composed ones, each with its `[parallel]` table — the fastest by the cost model that fits, else
    /// the one that holds the least; the workers run it as if the spec had named it, and what ran, and why, is
    /// recorded. A spec with `"auto"` has no `[parallel]` table of its own.
    Auto,
    /// Federated learning (`[federated]`): clients train on their own data, a server combines their updates.
    Federated,
}

impl Strategy {
    /// The strategies that can run, as written in a spec.
    pub const NAMES: [&'static str; 10] =
        ["ddp", "zero1", "zero2", "zero3", "pipeline", "tensor", "3d", "ps", "auto", "federated"];
    /// Strategies a spec may name that do not exist yet (refused with a message saying so).
    pub const PLANNED: [&'static str; 1] = ["fsdp"];

    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Ddp => "ddp",
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Zero3 => "zero3",
            Strategy::Pipeline => "pipeline",
            Strategy::Tensor => "tensor",
            Strategy::ThreeD => "3d",
            Strategy::Ps => "ps",
            Strategy::Auto => "auto",
            Strategy::Federated => "federated",
        }
    }

    /// Whether every rank runs the whole model on its own part of the batch (DDP and the ZeRO stages), so any world
    /// size runs it.
    pub fn is_data_parallel(self) -> bool {
        matches!(self, Strategy::Ddp | Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3)
    }

    /// Whether the strategy shards state over ranks (the ZeRO stages): a rank lost takes its shard with it.
    pub fn shards_state(self) -> bool {
        matches!(self, Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3)
    }

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "ddp" => Some(Strategy::Ddp),
            "zero1" => Some(Strategy::Zero1),
            "zero2" => Some(Strategy::Zero2),
            "zero3" => Some(Strategy::Zero3),
            "pipeline" => Some(Strategy::Pipeline),
            "tensor" => Some(Strategy::Tensor),
            "3d" => Some(Strategy::ThreeD),
            "ps" => Some(Strategy::Ps),
            "auto" => Some(Strategy::Auto),
            "federated" => Some(Strategy::Federated),
            _ => None,
        }
    }

    /// Why `name` cannot be used: not available yet, or not a strategy at all; both list what is available.
    fn refusal(name: &str) -> String {
        let available = Strategy::NAMES.join(", ");
        if Strategy::PLANNED.contains(&name) {
            format!("{name:?} is not available yet; available: {available}")
        } else {
            format!("unknown strategy {name:?}; available: {available}")
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Strategy {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Strategy;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a strategy name (available: {})", Strategy::NAMES.join(", "))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Strategy, E> {
                Strategy::from_name(v).ok_or_else(|| E::custom(Strategy::refusal(v)))
            }
        }
        deserializer.deserialize_str(V)
    }
}

/// The built-in models.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Mlp,
    Cnn,
    Gpt,
    Vit,
}

impl ModelKind {
    /// The names as written in a spec.
    pub const NAMES: [&'static str; 4] = ["mlp", "cnn", "gpt", "vit"];

    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
            ModelKind::Gpt => "gpt",
            ModelKind::Vit => "vit",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "mlp" => Some(ModelKind::Mlp),
            "cnn" => Some(ModelKind::Cnn),
            "gpt" => Some(ModelKind::Gpt),
            "vit" => Some(ModelKind::Vit),
            _ => None,
        }
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The optimizers.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// SGD with (heavy-ball) momentum, PyTorch semantics.
    Sgd,
    /// AdamW (decoupled weight decay), PyTorch semantics.
    #[default]
    Adamw,
}

impl OptimizerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adamw => "adamw",
        }
    }
}

/// The learning-rate schedule after the linear warm-up.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Cosine decay from `lr` (at the end of warm-up) to `min_lr` (at `steps`).
    #[default]
    Cosine,
    /// `lr` throughout.
    Constant,
}

/// What training computes in (`train.dtype`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit floats: parameters, activations, gradients, optimizer state and what the collectives move.
    #[default]
    F32,
    /// 64-bit floats throughout, to tell floating-point rounding from a bug when two layouts are compared; run by
    /// a build with the `f64` feature (a build runs the one precision it was built for, and refuses the other).
    F64,
}

impl Dtype {
    /// What this build computes in: `f64` with the `f64` feature (which shoal-train's `f64` turns on), else `f32`.
    pub const BUILT: Dtype = if cfg!(feature = "f64") { Dtype::F64 } else { Dtype::F32 };

    /// The name a spec gives it.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
        }
    }
}

/// What the forward and backward passes compute in (`train.precision`): the parameters, the optimizer state and
/// checkpoints stay in `train.dtype` (f32 master weights) whatever this says.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in `train.dtype`.
    #[default]
    F32,
    /// bfloat16 activations and weight copies (f32's range, 8 bits of mantissa): no loss scaling needed.
    Bf16,
    /// IEEE half (5 exponent bits): the loss is scaled up before backward and the gradients back down, a step
    /// whose gradients overflowed skipped and the scale halved (dynamic loss scaling).
    F16,
}

impl Precision {
    /// The names a spec may give.
    pub const NAMES: [&'static str; 3] = ["f32", "bf16", "f16"];

    /// The name a spec gives it.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// Whether the passes compute in a 16-bit type.
    pub fn is_mixed(self) -> bool {
        self != Precision::F32
    }
}

/// What sums the gradients of ranks computing on GPUs (`train.collectives`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Collectives {
    /// NCCL where it can run (a build with the `nccl` feature, ranks on GPUs, plain DDP), Shoal's own otherwise.
    #[default]
    Auto,
    /// NCCL on the devices' buffers; a run where it cannot is refused at start.
    Nccl,
    /// Shoal's own collectives (shared memory or TCP), GPU gradients staged through the host.
    Shoal,
}

impl Collectives {
    /// The name a spec gives it.
    pub fn name(self) -> &'static str {
        match self {
            Collectives::Auto => "auto",
            Collectives::Nccl => "nccl",
            Collectives::Shoal => "shoal",
        }
    }
}

/// How the global batch is shared among the ranks (`train.balance`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Balance {
    /// Equal shares.
    #[default]
    Static,
    /// Shares re-set every `train.balance_every` steps in proportion to each rank's measured compute rate, so a
    /// slower worker takes fewer samples; the gradient stays the global batch's mean (each rank's loss is weighted
    /// by its share).
    Dynamic,
}

/// When the gradient all-reduce runs.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Overlap {
    /// `on` when every rank on a host can have a core beside its compute threads, else `off`.
    #[default]
    Auto,
    /// Each bucket is reduced on the communicator's thread while backward fills the next.
    On,
    /// The buckets are reduced on the training thread after backward. On a host whose cores
    /// the compute threads already fill, overlapping only takes cores from the computation.
    Off,
}

/// `[train]`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSpec {
    /// `command = ["python3", "train.py", …]`: every worker runs this program (any framework's) instead of a
    /// built-in model, with the environment contract (torchrun's, `TF_CONFIG`, JAX's and Shoal's own); the lines
    /// it prints that are JSON objects with an integer `step` are its metrics. Such a job holds none of `model`,
    /// `dataset`, `global_batch` and `lr`, and `steps` only to show progress.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// `model = "mlp"` or a `[train.model]` table with `kind = "mlp"` and sizes (required without `command`).
    #[serde(default = "ModelSpec::unset", skip_serializing_if = "ModelSpec::is_unset")]
    pub model: ModelSpec,
    /// A built-in dataset (see `data::catalogue()`), or a location (required without `command`).
    #[cfg_attr(feature = "openapi", schema(value_type = crate::schema::DatasetName))]
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub dataset: String,
    #[serde(default)]
    pub strategy: Strategy,
    /// What every value of training is computed in (default `f32`).
    #[serde(default, skip_serializing_if = "is_f32")]
    pub dtype: Dtype,
    /// What forward and backward compute in (default `f32`): `bf16` or `f16` keep f32 master weights, optimizer
    /// state and checkpoints, and cast the weights for each pass.
    #[serde(default, skip_serializing_if = "is_f32_precision")]
    pub precision: Precision,
    /// What sums GPU ranks' gradients (default `auto`: NCCL where it can run, else Shoal's own).
    #[serde(default, skip_serializing_if = "is_auto_collectives")]
    pub collectives: Collectives,
    /// How the global batch is shared among the ranks (default `static`: equally).
    #[serde(default, skip_serializing_if = "is_static")]
    pub balance: Balance,
    /// Under `balance = "dynamic"`: steps between two settings of the shares (default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance_every: Option<usize>,
    /// Samples per optimizer step, over all ranks and all accumulation micro-steps together.
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    #[serde(default, skip_serializing_if = "is_zero")]
    pub global_batch: usize,
    /// Optimizer steps (with `command`: the steps the program will report, for progress; 0 when unknown).
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    #[serde(default)]
    pub steps: usize,
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub optimizer: OptimizerKind,
    /// Peak learning rate.
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0.0))]
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub lr: f64,
    /// SGD only (default 0.9); read [`TrainSpec::momentum`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f64>,
    /// Default 0.01 for AdamW, 0.0 for SGD; read [`TrainSpec::weight_decay`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    /// AdamW only (default [0.9, 0.999]); read [`TrainSpec::betas`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(min_items = 2, max_items = 2))]
    pub betas: Option<[f64; 2]>,
    /// AdamW only (default 1e-8); read [`TrainSpec::eps`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
    /// Micro-steps per optimizer step: each takes `global_batch / grad_accum` samples over all ranks.
    #[serde(default = "one")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub grad_accum: usize,
    #[serde(default)]
    pub warmup_steps: usize,
    #[serde(default)]
    pub schedule: Schedule,
    #[serde(default)]
    pub min_lr: f64,
    /// Clip the global gradient L2 norm to this; none = no clipping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_grad_norm: Option<f64>,
    /// Evaluate every this many steps; 0 = only at the end (there is always a final evaluation).
    #[serde(default)]
    pub eval_every: usize,
    /// Batches (of `global_batch / grad_accum` samples) per evaluation.
    #[serde(default = "eight")]
    pub eval_batches: usize,
    /// Gradient bucket size in MiB for the all-reduce; read [`TrainSpec::bucket_bytes`].
    #[serde(default = "bucket_mb_default")]
    pub bucket_mb: f64,
    /// When gradient buckets are all-reduced: during backward (`on`), after it (`off`), or `auto`.
    #[serde(default)]
    pub overlap: Overlap,
    /// Log (metrics line) every this many steps.
    #[serde(default = "one")]
    pub log_every: usize,
    /// `[train.data]`: the dataset's options. Build datasets from [`TrainSpec::data_options`], which fills in the
    /// text window length from the model.
    #[serde(default)]
    pub data: Options,
}

fn one() -> usize {
    1
}
fn is_static(b: &Balance) -> bool {
    *b == Balance::Static
}
fn is_f32(d: &Dtype) -> bool {
    *d == Dtype::F32
}
fn is_f32_precision(p: &Precision) -> bool {
    *p == Precision::F32
}
fn is_auto_collectives(c: &Collectives) -> bool {
    *c == Collectives::Auto
}
fn eight() -> usize {
    8
}
fn bucket_mb_default() -> f64 {
    25.0
}

/// `[train.model]`: the model kind and its sizes. Every size is optional; the accessors resolve the defaults. A
/// size that does not apply to the kind is an error.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSpec {
    pub kind: ModelKind,
    /// MLP hidden widths (default [128, 64]); may be empty (a linear model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hidden: Option<Vec<usize>>,
    /// CNN conv channels, one conv block each (default [16, 32]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub channels: Option<Vec<usize>>,
    /// GPT or ViT blocks (default 2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layers: Option<usize>,
    /// GPT or ViT attention heads (default 4); must divide `width`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heads: Option<usize>,
    /// GPT or ViT model width (default 64).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub width: Option<usize>,
    /// GPT context length in tokens (default 64).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<usize>,
    /// GPT vocabulary (default 256: byte-level tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vocab: Option<usize>,
    /// ViT patch side in pixels (default 4); must divide the image side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<usize>,
    /// Dropout probability (default 0.0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    /// No model was given (a job whose `train.command` runs its own program).
    #[serde(skip)]
    unset: bool,
}

/// The table form of [`ModelSpec`] (the derived, strict deserializer).
#[derive(Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
struct ModelTable {
    kind: ModelKind,
    #[serde(default)]
    hidden: Option<Vec<usize>>,
    #[serde(default)]
    channels: Option<Vec<usize>>,
    #[serde(default)]
    layers: Option<usize>,
    #[serde(default)]
    heads: Option<usize>,
    #[serde(default)]
    width: Option<usize>,
    #[serde(default)]
    context: Option<usize>,
    #[serde(default)]
    vocab: Option<usize>,
    #[serde(default)]
    patch: Option<usize>,
    #[serde(default)]
    dropout: Option<f64>,
}

impl<'de> Deserialize<'de> for ModelSpec {
    /// Either a string naming the kind (all defaults) or a table with `kind` and sizes.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ModelSpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a model name (\"mlp\", \"cnn\", \"gpt\", \"vit\") or a table with `kind` and sizes")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ModelSpec, E> {
                match ModelKind::from_name(v) {
                    Some(kind) => Ok(ModelSpec::new(kind)),
                    None => Err(E::unknown_variant(v, &ModelKind::NAMES)),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ModelSpec, A::Error> {
                let t = ModelTable::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(ModelSpec {
                    kind: t.kind,
                    hidden: t.hidden,
                    channels: t.channels,
                    layers: t.layers,
                    heads: t.heads,
                    width: t.width,
                    context: t.context,
                    vocab: t.vocab,
                    patch: t.patch,
                    dropout: t.dropout,
                    unset: false,
                })
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// `[checkpoint]`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Save every this many steps; 0 = only at the end (there is always a final checkpoint).
    #[serde(default)]
    pub every: usize,
    /// Keep the newest this many checkpoints (≥ 1).
    #[serde(default = "keep_default")]
    pub keep: usize,
    /// Copy the training state to shared memory on each host (`/dev/shm`, outliving the process, not the host)
    /// every this many steps, for a restart that needs no storage; 0 = never.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub memory_every: usize,
    /// A directory or an object-store URL (`file://`, `s3://`, `gs://`, `az://`, ...); none = the run's output
    /// directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Start from this checkpoint when the job has none of its own yet: a checkpoint directory
    /// (`.../checkpoints/step-000100`) or a checkpoint root (its newest valid one). A local path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<String>,
}

fn keep_default() -> usize {
    3
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

/// Largest `checkpoint.memory_every` accepted (a copy every billion steps is as good as none, and a bigger number
/// is more likely a typo).
pub const MAX_MEMORY_EVERY: usize = 1_000_000_000;

/// Where a job's in-memory checkpoints live on a host: `/dev/shm/shoal-<job>` (the job id with every character
/// outside `[A-Za-z0-9_.-]` replaced by `_`); `None` for an id that leaves no usable name. The worker writes there
/// and removes it when the job succeeds; an executor may remove it when the job ends otherwise.
pub fn memory_checkpoint_dir(job_id: &str) -> Option<std::path::PathBuf> {
    let name: String = job_id
        .chars()
        .take(128)
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') { c } else { '_' })
        .collect();
    if name.is_empty() || name.chars().all(|c| c == '.') {
        return None;
    }
    Some(std::path::Path::new("/dev/shm").join(format!("shoal-{name}")))
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        CheckpointSpec { every: 0, keep: keep_default(), memory_every: 0, url: None, resume_from: None }
    }
}

/// The shape of a job's dataset, as the model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataShape {
    pub kind: Kind,
    /// Features per sample (for text: tokens per window).
    pub features: usize,
    /// Classes (for text: the token alphabet, 256 for bytes).
    pub classes: usize,
}

impl DataShape {
    /// Classification data (dense features, a class label), as opposed to text.
    pub fn is_classification(&self) -> bool {
        !matches!(self.kind, Kind::Text)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// parsing

/// Parses and validates a TOML job spec; `origin` (e.g. the file name) prefixes every error.
pub fn parse_job(text: &str, origin: &str) -> Result<JobSpec> {
    let spec = deserialize_toml(text).map_err(|e| e.with_origin(origin))?;
    spec.validate().map_err(|e| e.with_origin(origin))?;
    Ok(spec)
}

/// Reads, parses and validates a job spec file: TOML, or JSON when the name ends in `.json`; errors name the file.
pub fn load_job(path: &Path) -> Result<JobSpec> {
    check_job(path).map_err(|problems| {
        problems
            .into_iter()
            .next()
            .unwrap_or_else(|| SpecError::at("", "invalid").with_origin(&path.display().to_string()))
    })
}

/// [`load_job`] reporting every problem instead of the first: a file that cannot be read or parsed gives one
/// error; a parsed spec gives one per independent part ([`JobSpec::problems`]). The error list is never empty.
pub fn check_job(path: &Path) -> std::result::Result<JobSpec, Vec<SpecError>> {
    let origin = path.display().to_string();
    let spec = read_job(path).map_err(|e| vec![e.with_origin(&origin)])?;
    let problems = spec.problems();
    if problems.is_empty() {
        return Ok(spec);
    }
    Err(problems.into_iter().map(|e| e.with_origin(&origin)).collect())
}

/// Reads and deserializes a job spec file (JSON when the name ends in `.json`, TOML otherwise), unvalidated.
fn read_job(path: &Path) -> Result<JobSpec> {
    let text =
        std::fs::read_to_string(path).map_err(|e| SpecError::at("", format!("cannot read the job spec: {e}")))?;
    if path.extension().is_some_and(|e| e == "json") { deserialize_json(&text) } else { deserialize_toml(&text) }
}

/// Parses and validates a job spec given as JSON (the HTTP API's form: the same object as the TOML); errors are
/// prefixed with `job.json`.
pub fn parse_job_json(text: &str) -> Result<JobSpec> {
    const ORIGIN: &str = "job.json";
    let spec = deserialize_json(text).map_err(|e| e.with_origin(ORIGIN))?;
    spec.validate().map_err(|e| e.with_origin(ORIGIN))?;
    Ok(spec)
}

fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

fn path_string(path: &serde_path_to_error::Path) -> String {
    let s = path.to_string();
    if s == "." { String::new() } else { s }
}

/// Tables a spec may no longer hold, with what replaced them.
const RETIRED: [(&str, &str); 1] = [(
    "restart",
    "`[restart]` was replaced by `[fault_tolerance]`: write `[fault_tolerance]` with `max_restarts = N` (was \
     `max`) and, if wanted, `policy`, `backoff`, `heartbeat_timeout` and `hang_timeout`",
)];

/// An unknown top-level key that names a retired table says what replaced it.
fn retired(mut e: SpecError) -> SpecError {
    if let Some((_, why)) = RETIRED.iter().find(|(key, _)| e.path == *key)
        && e.message.starts_with("unknown field")
    {
        (*why).clone_into(&mut e.message);
    }
    e
}

fn deserialize_toml(text: &str) -> Result<JobSpec> {
    let from_toml = |e: &toml::de::Error| {
        let (line, column) = match e.span() {
            Some(span) => {
                let (l, c) = line_column(text, span.start);
                (Some(l), Some(c))
            }
            None => (None, None),
        };
        (e.message().trim_end().to_owned(), line, column)
    };
    let de = toml::Deserializer::parse(text).map_err(|e| {
        let (mut message, line, column) = from_toml(&e);
        // Syntax errors may not name the key: quote the line.
        if let Some(src) = line.and_then(|l| text.lines().nth(l - 1)).map(str::trim).filter(|l| !l.is_empty()) {
            message = format!("{message}: `{src}`");
            if src.starts_with("model") || src.contains("train.model") {
                message.push_str(
                    " (`model = \"...\"` and a [train.model] table are the same key: name the model inside the \
                     table with `kind = \"...\"`)",
                );
            }
        }
        SpecError { origin: String::new(), path: String::new(), message, line, column }
    })?;
    let spec = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = path_string(e.path());
        let (message, line, column) = from_toml(e.inner());
        // A data error about the whole document (a missing top-level key) has no useful position.
        let (line, column) = if path.is_empty() { (None, None) } else { (line, column) };
        retired(SpecError { origin: String::new(), path, message, line, column })
    })?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| SpecError::at("", e.message().to_owned()))?;
    let train = table.get("train").and_then(toml::Value::as_table);
    let federated = table.contains_key("federated")
        || train.and_then(|t| t.get("strategy")).and_then(toml::Value::as_str) == Some("federated");
    check_train_keys(|k| train.is_some_and(|t| t.contains_key(k)), federated)?;
    Ok(spec)
}

/// The keys a `[train]` of built-in training must hold; one with `command` holds none of them but `steps`.
const BUILT_IN_TRAIN_KEYS: [&str; 5] = ["model", "dataset", "global_batch", "steps", "lr"];

/// `[train]` holds the keys of built-in training, or `command` and none of them (but `steps`); a federated job's
/// rounds are `federated.rounds`, so it needs no `steps`.
fn check_train_keys(has: impl Fn(&str) -> bool, federated: bool) -> Result<()> {
    let command = has("command");
    for key in BUILT_IN_TRAIN_KEYS {
        match (command, has(key)) {
            (false, false) if federated && key == "steps" => {}
            (false, false) => return Err(SpecError::at("train", format!("missing field `{key}`"))),
            (true, true) if key != "steps" => {
                return Err(SpecError::at(
                    format!("train.{key}"),
                    "a job with train.command runs its own program: built-in training's keys do not apply",
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

fn deserialize_json(text: &str) -> Result<JobSpec> {
    let from_json = |path: String, e: &serde_json::Error| {
        let (line, column) = (e.line(), e.column());
        let full = e.to_string();
        let message = full.strip_suffix(&format!(" at line {line} column {column}")).unwrap_or(&full).to_owned();
        let known = line > 0;
        SpecError { origin: String::new(), path, message, line: known.then_some(line), column: known.then_some(column) }
    };
    let mut de = serde_json::Deserializer::from_str(text);
    let spec: JobSpec =
        serde_path_to_error::deserialize(&mut de).map_err(|e| retired(from_json(path_string(e.path()), e.inner())))?;
    de.end().map_err(|e| from_json(String::new(), &e))?;
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| from_json(String::new(), &e))?;
    let train = value.get("train").and_then(serde_json::Value::as_object);
    let federated = value.get("federated").is_some_and(|f| !f.is_null())
        || train.and_then(|t| t.get("strategy")).and_then(serde_json::Value::as_str) == Some("federated");
    check_train_keys(|k| train.is_some_and(|t| t.contains_key(k)), federated)?;
    Ok(spec)
}

// ---------------------------------------------------------------------------------------------------------------
// accessors

impl ModelSpec {
    /// A model of this kind with every size at its default.
    pub fn new(kind: ModelKind) -> Self {
        ModelSpec {
            kind,
            hidden: None,
            channels: None,
            layers: None,
            heads: None,
            width: None,
            context: None,
            vocab: None,
            patch: None,
            dropout: None,
            unset: false,
        }
    }

    /// What `model` holds when the spec gives none (a job with `train.command`).
    pub fn unset() -> Self {
        ModelSpec { unset: true, ..ModelSpec::new(ModelKind::Mlp) }
    }

    /// Whether the spec gave no model.
    pub fn is_unset(&self) -> bool {
        self.unset
    }

    pub fn hidden(&self) -> &[usize] {
        self.hidden.as_deref().unwrap_or(&[128, 64])
    }
    pub fn channels(&self) -> &[usize] {
        self.channels.as_deref().unwrap_or(&[16, 32])
    }
    pub fn layers(&self) -> usize {
        self.layers.unwrap_or(2)
    }
    pub fn heads(&self) -> usize {
        self.heads.unwrap_or(4)
    }
    pub fn width(&self) -> usize {
        self.width.unwrap_or(64)
    }
    pub fn context(&self) -> usize {
        self.context.unwrap_or(64)
    }
    pub fn vocab(&self) -> usize {
        self.vocab.unwrap_or(256)
    }
    pub fn patch(&self) -> usize {
        self.patch.unwrap_or(4)
    }
    pub fn dropout(&self) -> f64 {
        self.dropout.unwrap_or(0.0)
    }

    /// The side of the square image a CNN sees for `features` pixels, if `features` is a square ≥ 4.
    pub fn image_side(features: usize) -> Option<usize> {
        let side = (features as f64).sqrt().round() as usize;
        (side >= 2 && side.checked_mul(side) == Some(features)).then_some(side)
    }

    /// The number of parameters of this model (architectures in the [module docs](self)) for `features` inputs
    /// and `classes` outputs (the GPT uses its own `vocab` and `context` instead); saturates at `u64::MAX`.
    pub fn param_count(&self, features: usize, classes: usize) -> u64 {
        let n = |v: usize| v as u128;
        let linear = |i: u128, o: u128| i.saturating_mul(o).saturating_add(o);
        let total: u128 = match self.kind {
            ModelKind::Mlp => {
                let mut widths = vec![n(features)];
                widths.extend(self.hidden().iter().map(|&h| n(h)));
                widths.push(n(classes));
                widths.windows(2).fold(0u128, |acc, w| acc.saturating_add(linear(w[0], w[1])))
            }
            ModelKind::Cnn => {
                let mut side = n(ModelSpec::image_side(features).unwrap_or(0));
                let (mut total, mut inc) = (0u128, 1u128);
                for &c in self.channels() {
                    total = total.saturating_add(linear(inc.saturating_mul(9), n(c)));
                    inc = n(c);
                    side /= 2;
                }
                total.saturating_add(linear(inc.saturating_mul(side).saturating_mul(side), n(classes)))
            }
            ModelKind::Gpt => {
                let (d, v, t, l) = (n(self.width()), n(self.vocab()), n(self.context()), n(self.layers()));
                let block = d.saturating_mul(d).saturating_mul(12).saturating_add(d.saturating_mul(13));
                v.saturating_mul(d)
                    .saturating_add(t.saturating_mul(d))
                    .saturating_add(l.saturating_mul(block))
                    .saturating_add(d.saturating_mul(2))
                    .saturating_add(linear(d, v))
            }
            ModelKind::Vit => {
                let (d, l, p) = (n(self.width()), n(self.layers()), n(self.patch()));
                let side = n(ModelSpec::image_side(features).unwrap_or(0));
                let patches = side.checked_div(p).map_or(0, |g| g.saturating_mul(g));
                let block = d.saturating_mul(d).saturating_mul(12).saturating_add(d.saturating_mul(13));
                linear(p.saturating_mul(p), d)
                    .saturating_add(d)
                    .saturating_add(patches.saturating_add(1).saturating_mul(d))
                    .saturating_add(l.saturating_mul(block))
                    .saturating_add(d.saturating_mul(2))
                    .saturating_add(linear(d, n(classes)))
            }
        };
        u64::try_from(total).unwrap_or(u64::MAX)
    }

    /// The sizes that apply to this kind, as written in a spec.
    fn allowed(&self) -> &'static [&'static str] {
        match self.kind {
            ModelKind::Mlp => &["hidden", "dropout"],
            ModelKind::Cnn => &["channels", "dropout"],
            ModelKind::Gpt => &["layers", "heads", "width", "context", "vocab", "dropout"],
            ModelKind::Vit => &["layers", "heads", "width", "patch", "dropout"],
        }
    }
}

impl TrainSpec {
    /// SGD momentum (default 0.9; 0 for AdamW, which does not use it).
    pub fn momentum(&self) -> f64 {
        match self.optimizer {
            OptimizerKind::Sgd => self.momentum.unwrap_or(0.9),
            OptimizerKind::Adamw => 0.0,
        }
    }
    /// Weight decay: default 0.01 for AdamW (decoupled), 0.0 for SGD (L2 added to the gradient).
    pub fn weight_decay(&self) -> f64 {
        self.weight_decay.unwrap_or(match self.optimizer {
            OptimizerKind::Sgd => 0.0,
            OptimizerKind::Adamw => 0.01,
        })
    }
    /// AdamW's betas (default [0.9, 0.999]).
    pub fn betas(&self) -> [f64; 2] {
        self.betas.unwrap_or([0.9, 0.999])
    }
    /// AdamW's epsilon (default 1e-8).
    pub fn eps(&self) -> f64 {
        self.eps.unwrap_or(1e-8)
    }
    /// Samples per micro-step over all ranks: `global_batch / grad_accum`.
    pub fn micro_batch(&self) -> usize {
        self.global_batch / self.grad_accum.max(1)
    }
    /// The gradient bucket size in bytes (`bucket_mb` MiB, rounded to whole f32s, at least one).
    pub fn bucket_bytes(&self) -> usize {
        let bytes = (self.bucket_mb * 1024.0 * 1024.0 / 4.0).round().max(1.0) as usize;
        bytes.saturating_mul(4)
    }

    /// The options to build the dataset with: `[train.data]`, plus, for a text dataset, the window length
    /// (`context`) from the model when `[train.data]` leaves it out.
    pub fn data_options(&self) -> Options {
        let mut o = self.data.clone();
        let text = matches!(self.catalogue_kind(), Some(Kind::Text));
        if text && o.context.is_none() && self.model.kind == ModelKind::Gpt {
            o.context = Some(self.model.context());
        }
        o
    }

    fn catalogue_kind(&self) -> Option<Kind> {
        if data::is_lake(&self.dataset) {
            return self.data.text_column.as_ref().map(|_| Kind::Text);
        }
        data::catalogue().into_iter().find(|i| i.name == self.dataset).map(|i| i.kind)
    }

    /// The dataset's kind, features and classes with these options (without loading it); an error naming
    /// `train.dataset` when it is unknown.
    pub fn data_shape(&self) -> Result<DataShape> {
        if data::is_lake(&self.dataset) {
            let opts = Options { split: Split::Train, ..self.data.clone() };
            let c = data::check(&self.dataset, &opts).map_err(|e| match e {
                data::DataError::BadOption { option, reason, .. } => {
                    SpecError::at(format!("train.data.{option}"), reason)
                }
                other => SpecError::at("train.data", other.to_string()),
            })?;
            let kind = if self.data.text_column.is_some() { Kind::Text } else { Kind::Tabular };
            let features = match kind {
                Kind::Text => self.data_options().context.unwrap_or(c.features),
                _ => c.features,
            };
            return Ok(DataShape { kind, features, classes: c.classes });
        }
        let cat = data::catalogue();
        let Some(info) = cat.iter().find(|i| i.name == self.dataset) else {
            let known: Vec<&str> = cat.iter().map(|i| i.name.as_str()).collect();
            return Err(SpecError::at(
                "train.dataset",
                format!("unknown dataset \"{}\"; the built-in datasets are: {}", self.dataset, known.join(", ")),
            ));
        };
        let o = self.data_options();
        let (features, classes) = match info.kind {
            Kind::Text => (o.context.unwrap_or(info.features), info.classes),
            Kind::Synthetic => (o.features.unwrap_or(info.features), o.classes.unwrap_or(info.classes)),
            Kind::Image | Kind::Tabular => (info.features, info.classes),
        };
        Ok(DataShape { kind: info.kind, features, classes })
    }

    /// Bytes of memory one replica needs for parameters, gradients and optimizer state (4-byte floats: 4 per
    /// parameter for AdamW, 3 for SGD with momentum, 2 without), plus a synthetic dataset's class centres.
    /// Activations are not counted.
    pub fn memory_bytes(&self) -> Result<u128> {
        let shape = self.data_shape()?;
        let params = u128::from(self.model.param_count(shape.features, shape.classes));
        let copies: u128 = match self.optimizer {
            OptimizerKind::Adamw => 4,
            OptimizerKind::Sgd if self.momentum() == 0.0 => 2,
            OptimizerKind::Sgd => 3,
        };
        let centres = match shape.kind {
            Kind::Synthetic => (shape.features as u128).saturating_mul(shape.classes as u128),
            _ => 0,
        };
        Ok(params.saturating_mul(copies).saturating_add(centres).saturating_mul(4))
    }

    /// The same settings with every default that applies written out: the optimizer's options, the model's
    /// sizes and, for a text dataset, the window length. Options that do not apply stay unset.
    pub fn resolved(&self) -> TrainSpec {
        let mut t = self.clone();
        t.weight_decay = Some(self.weight_decay());
        match self.optimizer {
            OptimizerKind::Sgd => t.momentum = Some(self.momentum()),
            OptimizerKind::Adamw => {
                t.betas = Some(self.betas());
                t.eps = Some(self.eps());
            }
        }
        t.model = self.model.resolved();
        t.data = self.data_options();
        t
    }
}

impl ModelSpec {
    /// The same model with every size of its kind written out.
    pub fn resolved(&self) -> ModelSpec {
        let mut m = ModelSpec { dropout: Some(self.dropout()), ..ModelSpec::new(self.kind) };
        match self.kind {
            ModelKind::Mlp => m.hidden = Some(self.hidden().to_vec()),
            ModelKind::Cnn => m.channels = Some(self.channels().to_vec()),
            ModelKind::Gpt => {
                m.layers = Some(self.layers());
                m.heads = Some(self.heads());
                m.width = Some(self.width());
                m.context = Some(self.context());
                m.vocab = Some(self.vocab());
            }
            ModelKind::Vit => {
                m.layers = Some(self.layers());
                m.heads = Some(self.heads());
                m.width = Some(self.width());
                m.patch = Some(self.patch());
            }
        }
        m
    }
}

impl JobSpec {
    /// The spec with every default filled in ([`TrainSpec::resolved`]; the platform tables already hold theirs).
    /// It validates exactly when `self` does and describes the same job.
    pub fn resolved(&self) -> JobSpec {
        JobSpec { train: self.train.resolved(), ..self.clone() }
    }

    /// Whether an elastic job of this spec changes size in place — its survivors keep their processes and only
    /// build their communicator again — rather than restarting its gang: data-parallel strategies (DDP and every ZeRO
    /// stage: their state is whole or re-sharded at any world size) with no `[[phases]]`. The control plane and
    /// the workers decide from this one rule.
    pub fn regroups_in_place(&self) -> bool {
        self.fault_tolerance.policy == FaultPolicy::Elastic
            && !self.is_command()
            && self.train.strategy.is_data_parallel()
            && self.phases.is_empty()
    }

    /// The spec as TOML, in the form [`parse_job`] reads back.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| SpecError::at("", format!("cannot write the spec as TOML: {e}")))
    }
}

// ---------------------------------------------------------------------------------------------------------------
// validation

/// Bytes of memory available to this process: `MemAvailable` from `/proc/meminfo`, lowered to the cgroup's
/// `memory.max - memory.current` when that is smaller; `None` when neither can be read.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        kb.checked_mul(1024)
    });
    let read = |p: &str| std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
    let cgroup = match (read("/sys/fs/cgroup/memory.max"), read("/sys/fs/cgroup/memory.current")) {
        (Some(max), Some(cur)) => Some(max.saturating_sub(cur)),
        _ => None,
    };
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn gib(bytes: u128) -> String {
    let g = bytes as f64 / (1u64 << 30) as f64;
    match g {
        ..1.0 => format!("{:.1} MiB", g * 1024.0),
        ..1e6 => format!("{g:.2} GiB"),
        _ => format!("{g:.2e} GiB"),
    }
}

/// 1234 -> "1234", 1_860_000 -> "1.86M", ...
fn count(n: u64) -> String {
    let x = n as f64;
    match n {
        0..10_000 => n.to_string(),
        10_000..1_000_000 => format!("{:.1}K", x / 1e3),
        1_000_000..1_000_000_000 => format!("{:.2}M", x / 1e6),
        1_000_000_000..1_000_000_000_000 => format!("{:.2}B", x / 1e9),
        _ => format!("{x:.2e}"),
    }
}

fn positive(path: &str, v: usize) -> Result<()> {
    if v == 0 { Err(SpecError::at(path, "must be > 0")) } else { Ok(()) }
}

fn finite_in(path: &str, v: f64, ok: bool, what: &str) -> Result<()> {
    if v.is_finite() && ok { Ok(()) } else { Err(SpecError::at(path, format!("must be {what}, got {v}"))) }
}

const URL_SCHEMES: [&str; 12] =
    ["file", "memory", "s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss", "http", "https"];

impl JobSpec {
    /// Checks every value, with the memory available now ([`available_memory`]) for the model-size check.
    /// Errors carry no origin (the parse functions add it).
    pub fn validate(&self) -> Result<()> {
        self.validate_with_memory(available_memory())
    }

    /// [`JobSpec::validate`] with an explicit memory budget in bytes (`None` skips the model-size check).
    pub fn validate_with_memory(&self, available: Option<u64>) -> Result<()> {
        match self.problems_with_memory(available).into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Every problem [`JobSpec::validate`] finds, one per independent part of the spec (name, queue, `[env]`,
    /// `[workers]`, `[resources]`, `[fault_tolerance]`, `[train]` numbers, the world size, model and data, `[checkpoint]`,
    /// `[parallel]`, `[compression]`), in that
    /// order; empty when the spec is valid. The first one is what `validate` returns.
    pub fn problems(&self) -> Vec<SpecError> {
        self.problems_with_memory(available_memory())
    }

    /// [`JobSpec::problems`] with an explicit memory budget in bytes (`None` skips the model-size check).
    pub fn problems_with_memory(&self, available: Option<u64>) -> Vec<SpecError> {
        let platform = |r: Result<(), (String, String)>| r.map_err(|(p, m)| SpecError::at(p, m));
        if self.is_command() {
            return [
                validate_name(&self.name),
                validate_queue(&self.queue),
                validate_expected_runtime(self.expected_runtime),
                validate_env(&self.env),
                platform(self.workers.validate()),
                platform(self.resources.validate()),
                platform(self.fault_tolerance.validate()),
                self.validate_command(),
            ]
            .into_iter()
            .filter_map(Result::err)
            .collect();
        }
        let numbers = self.train.validate_numbers();
        // The world-size check divides by numbers the train check refuses: only run it on valid ones.
        let (lo, _) = self.workers.range();
        let world = if numbers.is_ok() && (self.workers.count.is_some() || self.workers.min.is_some()) {
            self.validate_world(lo as usize)
        } else {
            Ok(())
        };
        [
            validate_name(&self.name),
            validate_queue(&self.queue),
            validate_expected_runtime(self.expected_runtime),
            validate_env(&self.env),
            platform(self.workers.validate()),
            platform(self.resources.validate()),
            platform(self.fault_tolerance.validate()),
            // Before the numbers: a [federated] table without its strategy explains a missing train.steps.
            self.validate_federated(),
            numbers.clone(),
            world,
            if numbers.is_ok() { self.validate_phases() } else { Ok(()) },
            self.train.validate_model_and_data(available),
            self.checkpoint.validate(),
            if numbers.is_ok() { self.validate_parallel() } else { Ok(()) },
            platform(self.compression.map_or(Ok(()), |c| c.validate(self.train.strategy, self.train.optimizer))),
            // A federated job's [robust] and [chaos] are checked with [federated].
            match self.train.strategy {
                Strategy::Federated => Ok(()),
                strategy => platform(
                    self.robust.map_or(Ok(()), |r| r.validate(strategy, self.compression.is_some_and(|c| c.is_on()))),
                ),
            },
            match self.train.strategy {
                Strategy::Federated => Ok(()),
                _ => platform(self.chaos.as_ref().map_or(Ok(()), |c| c.validate(self.robust.as_ref()))),
            },
            self.validate_ps(),
            self.validate_balance(),
            self.validate_collectives(),
            self.validate_sharding(),
        ]
        .into_iter()
        .filter_map(Result::err)
        .collect()
    }

    /// Whether the workers run the job's own program (`train.command`) instead of built-in training.
    pub fn is_command(&self) -> bool {
        !self.train.command.is_empty()
    }

    /// A job that runs its own program: a program named, and nothing of built-in training's that would be ignored.
    fn validate_command(&self) -> Result<()> {
        let t = &self.train;
        if t.command.first().is_none_or(|p| p.trim().is_empty()) {
            return Err(SpecError::at("train.command", "names no program: give [\"program\", \"arg\", …]"));
        }
        let built_in = "a job with train.command runs its own program: built-in training's settings do not apply";
        let set = [
            ("phases", !self.phases.is_empty()),
            ("parallel", self.parallel.is_some()),
            ("compression", self.compression.is_some()),
            ("robust", self.robust.is_some()),
            ("chaos", self.chaos.is_some()),
            ("ps", self.ps.is_some()),
            ("train.strategy", t.strategy != Strategy::default()),
            ("train.balance", t.balance != Balance::default()),
            ("train.collectives", t.collectives != Collectives::default()),
            ("train.data", t.data != data::Options::default()),
        ];
        match set.into_iter().find(|(_, on)| *on) {
            Some((key, _)) => Err(SpecError::at(key, built_in)),
            None => Ok(()),
        }
    }

    /// `train.collectives = "nccl"` sums gradients held on the devices: plain data parallelism, whose ranks each
    /// hold every gradient there — not the other strategies, nor a `[compression]` or `[robust]` rule, which work
    /// on host buffers. (Whether the build has NCCL and the ranks have GPUs is known only where they start.)
    fn validate_collectives(&self) -> Result<()> {
        if self.train.collectives != Collectives::Nccl {
            return Ok(());
        }
        let why = match (self.train.strategy, self.compression.is_some_and(|c| c.is_on()), self.robust.is_some()) {
            (Strategy::Ddp, false, false) => return Ok(()),
            (Strategy::Ddp, true, _) => "[compression] encodes the gradients on the host".to_string(),
            (Strategy::Ddp, _, true) => "a [robust] rule combines the gradients on the host".to_string(),
            (s, _, _) => format!("train.strategy = \"{s}\" reduces through Shoal's own collectives"),
        };
        Err(SpecError::at(
            "train.collectives",
            format!("\"nccl\" sums the gradients of plain DDP (train.strategy = \"ddp\") on the devices: {why}"),
        ))
    }

    /// `train.balance = "dynamic"` needs ranks that each compute the whole model on their share of the batch and
    /// sum their gradients: a data-parallel strategy, without a robust rule (which weighs every rank alike).
    fn validate_balance(&self) -> Result<()> {
        let t = &self.train;
        if t.balance == Balance::Static {
            return match t.balance_every {
                Some(_) => Err(SpecError::at("train.balance_every", "applies to train.balance = \"dynamic\" only")),
                None => Ok(()),
            };
        }
        if !t.strategy.is_data_parallel() {
            return Err(SpecError::at(
                "train.balance",
                format!(
                    "\"dynamic\" shares the batch among data-parallel ranks (ddp, zero1, zero2, zero3), not under \
                     train.strategy = \"{}\"",
                    t.strategy
                ),
            ));
        }
        if self.robust.is_some() {
            return Err(SpecError::at(
                "train.balance",
                "\"dynamic\" gives ranks unequal shares, which a [robust] rule would weigh alike: use one or the other",
            ));
        }
        if t.balance_every == Some(0) {
            return Err(SpecError::at("train.balance_every", "must be >= 1"));
        }
        Ok(())
    }

    /// `train.data.sharding = "dynamic"` hands blocks to data-parallel ranks that each train on their own rows; a
    /// job that regroups in place keeps no checkpoint of what the lost member consumed, so it restarts instead.
    fn validate_sharding(&self) -> Result<()> {
        let t = &self.train;
        if t.data.sharding != Some(data::Sharding::Dynamic) {
            return Ok(());
        }
        if !t.strategy.is_data_parallel() {
            return Err(SpecError::at(
                "train.data.sharding",
                format!(
                    "\"dynamic\" hands blocks to data-parallel ranks (ddp, zero1, zero2, zero3), not under \
                     train.strategy = \"{}\"",
                    t.strategy
                ),
            ));
        }
        if self.fault_tolerance.policy == FaultPolicy::Elastic {
            return Err(SpecError::at(
                "train.data.sharding",
                "\"dynamic\" recovers what a lost worker consumed from the newest checkpoint: use \
                 fault_tolerance.policy = \"restart\" (elastic groups go on without a checkpoint)",
            ));
        }
        Ok(())
    }

    /// `[federated]` against the strategy, and what federated learning does not combine with.
    fn validate_federated(&self) -> Result<()> {
        let t = &self.train;
        let Some(f) = &self.federated else {
            return match t.strategy {
                Strategy::Federated => Err(SpecError::at(
                    "federated",
                    "train.strategy = \"federated\" needs a [federated] table with clients and rounds",
                )),
                _ => Ok(()),
            };
        };
        if t.strategy != Strategy::Federated {
            return Err(SpecError::at(
                "federated",
                format!("applies to train.strategy = \"federated\" only, not \"{}\"", t.strategy),
            ));
        }
        f.validate().map_err(|(k, m)| SpecError::at(&k, m))?;
        if let Some(r) = &self.robust {
            let rule = r.rule.rule();
            if f.secure_aggregation {
                return Err(SpecError::at(
                    "robust.rule",
                    "secure aggregation shows the server only the sum of the updates, which a robust rule cannot sift",
                ));
            }
            if f.dp.is_some() && rule != shoal_ps::Rule::Mean {
                return Err(SpecError::at(
                    "robust.rule",
                    "the privacy accountant assumes the noised mean of the clipped updates; a robust rule changes it",
                ));
            }
            if rule == shoal_ps::Rule::Mean && r.f > 0 {
                return Err(SpecError::at(
                    "robust.f",
                    format!("the mean bears no attacker (f = {}): choose a robust rule", r.f),
                ));
            }
            // The rule sees each round's sampled clients.
            let n = if f.dp.is_some() { f.clients } else { f.per_round() };
            rule.check(n, r.f).map_err(|e| SpecError::at("robust.f", format!("{e} (the clients of a round)")))?;
        }
        if let Some(c) = &self.chaos {
            if self.robust.is_none() {
                return Err(SpecError::at(
                    "chaos.attack",
                    "attacks are simulated where [robust] combines the updates: add [robust] (rule = \"mean\" for no \
                     defence)",
                ));
            }
            if f.remote() {
                return Err(SpecError::at(
                    "chaos.byzantine_clients",
                    "attacks are simulated: not with federated.listen",
                ));
            }
            c.validate_federated(f.clients).map_err(|(k, m)| SpecError::at(&k, m))?;
        }
        let why = "federated clients train whole models on their own data";
        let set = [
            ("parallel", self.parallel.is_some()),
            ("compression", self.compression.is_some()),
            ("phases", !self.phases.is_empty()),
            ("train.balance", t.balance != Balance::Static),
            ("train.grad_accum", t.grad_accum != 1),
        ];
        match set.into_iter().find(|(_, on)| *on) {
            Some((key, _)) => {
                Err(SpecError::at(key, format!("does not apply under train.strategy = \"federated\": {why}")))
            }
            None => Ok(()),
        }
    }

    /// `[ps]` against the strategy: the table belongs to `train.strategy = "ps"`, whose servers each hold part of
    /// the gradient (no clipping at its global norm), serve a fixed number of workers (not elastic), and combine by
    /// a robust rule only in their synchronous rounds.
    fn validate_ps(&self) -> Result<()> {
        let t = &self.train;
        if t.strategy != Strategy::Ps {
            return match self.ps {
                Some(_) => {
                    Err(SpecError::at("ps", format!("applies to train.strategy = \"ps\" only, not \"{}\"", t.strategy)))
                }
                None => Ok(()),
            };
        }
        let ps = self.ps.unwrap_or_default();
        ps.validate().map_err(|(k, m)| SpecError::at(&k, m))?;
        if t.clip_grad_norm.is_some() {
            return Err(SpecError::at(
                "train.clip_grad_norm",
                "under train.strategy = \"ps\" each server holds part of the gradient: clipping at its global norm is \
                 not available",
            ));
        }
        if self.workers.min.is_some() || self.workers.max.is_some() {
            return Err(SpecError::at(
                "workers.min",
                "the parameter servers serve a fixed number of workers: give workers.count, not a range",
            ));
        }
        if self.robust.is_some() && ps.mode != PsMode::Sync {
            return Err(SpecError::at(
                "robust.rule",
                "a robust rule combines a round's pushes: it needs ps.mode = \"sync\"",
            ));
        }
        Ok(())
    }

    /// How many parameter servers the job starts beside its workers (`ps.servers` under `train.strategy = "ps"`;
    /// else none).
    pub fn ps_servers(&self) -> usize {
        match self.train.strategy {
            Strategy::Ps => self.ps.unwrap_or_default().servers,
            _ => 0,
        }
    }

    /// `[[phases]]`: boundaries in order and inside the run, each phase's tables valid and its workers able to share
    /// the batch.
    fn validate_phases(&self) -> Result<()> {
        let mut after = 0;
        for (i, ph) in self.phases.iter().enumerate() {
            ph.validate(i, self.phases.len(), after, self.train.steps).map_err(|(p, m)| SpecError::at(p, m))?;
            after = ph.until_step.unwrap_or(self.train.steps);
            let (lo, _) = self.in_phase(i).workers.range();
            self.validate_world(lo as usize)
                .map_err(|e| SpecError::at(format!("phases[{i}].workers"), e.to_string()))?;
        }
        Ok(())
    }

    /// The phase step `step` (0-based: the step about to be taken) belongs to; 0 with no `[[phases]]`.
    pub fn phase_at(&self, step: usize) -> usize {
        let last = self.phases.len().saturating_sub(1);
        self.phases.iter().position(|p| p.until_step.is_none_or(|u| step < u)).unwrap_or(last)
    }

    /// The step the phase of `step` ends at, when another phase follows it.
    pub fn phase_end(&self, step: usize) -> Option<usize> {
        self.phases.get(self.phase_at(step))?.until_step.filter(|u| *u < self.train.steps)
    }

    /// The job as it runs in phase `i`: the phase's `[workers]` and `[resources]` in place of the job's (the job
    /// itself past the last phase, or with none).
    pub fn in_phase(&self, i: usize) -> JobSpec {
        let mut s = self.clone();
        if let Some(p) = self.phases.get(i) {
            s.workers = p.workers.unwrap_or(s.workers);
            s.resources = p.resources.unwrap_or(s.resources);
        }
        s
    }

    /// `[parallel]` against the strategy and the model: a pipeline or tensor-parallel job has one, no other job
    /// does; a pipeline's stages divide the model's layers and its micro-batches the global batch; a tensor-parallel
    /// degree divides every dimension it splits.
    fn validate_parallel(&self) -> Result<()> {
        let t = &self.train;
        let Some(p) = &self.parallel else {
            return match t.strategy {
                Strategy::Pipeline => Err(SpecError::at(
                    "parallel",
                    "train.strategy = \"pipeline\" needs a [parallel] table with pipeline_stages and micro_batches",
                )),
                Strategy::Tensor => {
                    Err(SpecError::at("parallel", "train.strategy = \"tensor\" needs a [parallel] table with tensor"))
                }
                Strategy::ThreeD => Err(SpecError::at(
                    "parallel",
                    "train.strategy = \"3d\" needs a [parallel] table with its degrees (data, tensor, pipeline_stages)",
                )),
                _ => Ok(()),
            };
        };
        match t.strategy {
            Strategy::Pipeline => self.validate_pipeline(p),
            Strategy::Tensor => self.validate_tensor(p),
            Strategy::ThreeD => self.validate_composed(p),
            other => Err(SpecError::at(
                "parallel",
                format!("applies to train.strategy = \"pipeline\", \"tensor\" or \"3d\" only, not \"{other}\""),
            )),
        }
    }

    /// The checks of a layout alone, at `world_size` ranks: `[parallel]` against `train.strategy`, the model and
    /// the batch, and the world size against them — what a planned layout must pass before it replaces a spec's
    /// strategy (`shoal_train::plan`).
    pub fn validate_layout(&self, world_size: usize) -> Result<()> {
        self.validate_parallel()?;
        self.validate_world(world_size)
    }

    /// A tensor-parallel layout against the model: the degree divides the heads (and the GPT's vocabulary).
    fn validate_tensor(&self, p: &ParallelSpec) -> Result<()> {
        p.validate_tensor()?;
        self.check_tensor_degree(p.tensor.unwrap_or(0) as usize)
    }

    /// A composed layout against the model and the batch: each degree above 1 checked as its strategy alone checks
    /// it (the world size is checked with it, [`Self::validate_world`]).
    fn validate_composed(&self, p: &ParallelSpec) -> Result<()> {
        p.validate_composed()?;
        let (_, tensor, pipeline) = p.degrees();
        if tensor > 1 {
            self.check_tensor_degree(tensor)?;
        }
        if pipeline > 1 {
            self.check_pipeline(pipeline, p.micro_batches.unwrap_or(1), p.virtual_stages())?;
        }
        Ok(())
    }

    /// A tensor-parallel degree against the model: it divides the heads (and the GPT's vocabulary).
    fn check_tensor_degree(&self, n: usize) -> Result<()> {
        let m = &self.train.model;
        let what = match m.kind {
            ModelKind::Gpt => "GPT",
            ModelKind::Vit => "ViT",
            ModelKind::Mlp | ModelKind::Cnn => {
                return Err(SpecError::at(
                    "parallel.tensor",
                    format!("model \"{}\" has no tensor-parallel layout (gpt and vit have)", m.kind),
                ));
            }
        };
        if !m.heads().is_multiple_of(n) {
            return Err(SpecError::at(
                "parallel.tensor",
                format!("{n} does not divide the {what}'s {} heads", m.heads()),
            ));
        }
        if m.kind == ModelKind::Gpt && !m.vocab().is_multiple_of(n) {
            return Err(SpecError::at(
                "parallel.tensor",
                format!("{n} does not divide the GPT's vocabulary of {} tokens", m.vocab()),
            ));
        }
        Ok(())
    }

    /// A pipeline layout against the model and the batch.
    fn validate_pipeline(&self, p: &ParallelSpec) -> Result<()> {
        p.validate()?;
        let (stages, micro) = p.stages_and_micro_batches();
        self.check_pipeline(stages, micro, p.virtual_stages())
    }

    /// A pipeline's stages, micro-batches and model chunks per rank against the model and the batch.
    fn check_pipeline(&self, stages: usize, micro: usize, chunks: usize) -> Result<()> {
        let t = &self.train;
        let m = &t.model;
        let pieces = stages.saturating_mul(chunks);
        match m.kind {
            ModelKind::Gpt if !m.layers().is_multiple_of(stages) => {
                return Err(SpecError::at(
                    "parallel.pipeline_stages",
                    format!("{stages} stages do not divide the GPT's {} layers", m.layers()),
                ));
            }
            ModelKind::Gpt if !m.layers().is_multiple_of(pieces) => {
                return Err(SpecError::at(
                    "parallel.virtual_stages",
                    format!(
                        "{stages} stages × {chunks} virtual stages = {pieces} chunks do not divide the GPT's {} layers",
                        m.layers()
                    ),
                ));
            }
            ModelKind::Gpt => {}
            ModelKind::Mlp | ModelKind::Cnn | ModelKind::Vit => {
                let (layers, what) = match m.kind {
                    ModelKind::Mlp => (m.hidden().len() + 1, "MLP"),
                    ModelKind::Vit => (m.layers() + 2, "ViT"),
                    _ => (m.channels().len() + 1, "CNN"),
                };
                if stages > layers {
                    return Err(SpecError::at(
                        "parallel.pipeline_stages",
                        format!("{stages} stages for the {what}'s {layers} layers: at most {layers}"),
                    ));
                }
                if pieces > layers {
                    return Err(SpecError::at(
                        "parallel.virtual_stages",
                        format!(
                            "{stages} stages × {chunks} virtual stages = {pieces} chunks for the {what}'s {layers} \
                             layers: at most {layers}"
                        ),
                    ));
                }
            }
        }
        if !t.global_batch.is_multiple_of(micro) {
            return Err(SpecError::at(
                "parallel.micro_batches",
                format!("{micro} does not divide train.global_batch {}", t.global_batch),
            ));
        }
        if t.grad_accum != 1 {
            return Err(SpecError::at(
                "train.grad_accum",
                "a pipeline accumulates gradients over parallel.micro_batches: leave grad_accum at 1",
            ));
        }
        Ok(())
    }

    /// The pipeline's stages (`parallel.pipeline_stages` under `train.strategy = "pipeline"`; else 1).
    pub fn pipeline_stages(&self) -> usize {
        match (&self.parallel, self.train.strategy) {
            (Some(p), Strategy::Pipeline) => p.pipeline_stages.unwrap_or(1).max(1),
            (Some(p), Strategy::ThreeD) => p.degrees().2.max(1),
            _ => 1,
        }
    }

    /// The pipeline's micro-batches a step (`parallel.micro_batches` under `train.strategy = "pipeline"`; else 1).
    pub fn pipeline_micro_batches(&self) -> usize {
        match (&self.parallel, self.train.strategy) {
            (Some(p), Strategy::Pipeline) => p.micro_batches.unwrap_or(1).max(1),
            (Some(p), Strategy::ThreeD) if p.degrees().2 > 1 => p.micro_batches.unwrap_or(1).max(1),
            _ => 1,
        }
    }

    /// The ranks every layer is split across (`parallel.tensor` under `train.strategy = "tensor"` or `"3d"`; else 1).
    pub fn tensor_degree(&self) -> usize {
        match (&self.parallel, self.train.strategy) {
            (Some(p), Strategy::Tensor | Strategy::ThreeD) => {
                p.tensor.map_or(1, |n| usize::try_from(n).unwrap_or(usize::MAX)).max(1)
            }
            _ => 1,
        }
    }

    /// The data-parallel replicas of a composed layout (`parallel.data` under `train.strategy = "3d"`; else 1).
    pub fn data_degree(&self) -> usize {
        match (&self.parallel, self.train.strategy) {
            (Some(p), Strategy::ThreeD) => p.degrees().0.max(1),
            _ => 1,
        }
    }

    /// The ZeRO stage inside each data-parallel group of a composed layout (`parallel.zero`; else 0).
    pub fn zero_stage(&self) -> u8 {
        match (&self.parallel, self.train.strategy) {
            (Some(p), Strategy::ThreeD) => p.zero_stage(),
            _ => 0,
        }
    }

    /// The ranks that hold one copy of the model between them (a pipeline's stages, a tensor-parallel group): the
    /// data is split over the world size divided by this.
    pub fn model_parallel(&self) -> usize {
        self.pipeline_stages() * self.tensor_degree()
    }

    /// Checks that the job can run on `world_size` ranks: each rank needs at least one sample of every
    /// micro-batch (`global_batch / grad_accum ≥ world_size`); a pipeline needs one rank per stage.
    pub fn validate_world(&self, world_size: usize) -> Result<()> {
        if world_size == 0 {
            return Err(SpecError::at("", "the world size must be at least 1"));
        }
        if let Some(f) = self.federated.as_ref().filter(|f| f.remote() && world_size > 1) {
            return Err(SpecError::at(
                "workers.count",
                format!(
                    "federated.listen {}: one process serves the remote clients, not {world_size}",
                    f.listen.as_deref().unwrap_or_default()
                ),
            ));
        }
        if self.is_command() || self.train.strategy == Strategy::Federated {
            // The program splits its own work; a federated job's batches are each client's own.
            return Ok(());
        }
        if let Some(Err((key, message))) = self.robust.map(|r| r.validate_world(world_size)) {
            return Err(SpecError::at(&key, message));
        }
        if let Some(Err((key, message))) = self.chaos.as_ref().map(|c| c.validate_world(world_size)) {
            return Err(SpecError::at(&key, message));
        }
        let t = &self.train;
        if let (Some(p), Strategy::ThreeD) = (&self.parallel, t.strategy) {
            let (data, tensor, pipeline) = p.degrees();
            let ranks = data.saturating_mul(tensor).saturating_mul(pipeline);
            if ranks == 0 {
                // A degree of 0: refused with its key by the layout's own check.
                return Ok(());
            }
            if ranks != world_size {
                return Err(SpecError::at(
                    "parallel.data",
                    format!(
                        "{data} × tensor {tensor} × pipeline {pipeline} = {ranks} ranks, but the job runs {world_size}"
                    ),
                ));
            }
            if t.micro_batch() < data {
                return Err(SpecError::at(
                    "train.global_batch",
                    format!(
                        "{} samples per micro-batch cannot be shared among parallel.data = {data} replicas: each \
                         needs at least one",
                        t.micro_batch()
                    ),
                ));
            }
            return Ok(());
        }
        let stages = self.pipeline_stages();
        if stages > 1 {
            if !world_size.is_multiple_of(stages) {
                return Err(SpecError::at(
                    "parallel.pipeline_stages",
                    format!("{stages} stages do not divide the world size {world_size}"),
                ));
            }
            if world_size != stages {
                return Err(SpecError::at(
                    "parallel.pipeline_stages",
                    format!(
                        "{stages} stages on {world_size} workers: a pipeline runs one rank per stage (composing it \
                         with data parallelism is not available yet)"
                    ),
                ));
            }
            return Ok(());
        }
        let tensor = self.tensor_degree();
        if tensor > 1 {
            if world_size != tensor {
                return Err(SpecError::at(
                    "parallel.tensor",
                    format!(
                        "{tensor} tensor-parallel ranks on {world_size} workers: the world size must equal it \
                         (composing it with data parallelism is not available yet)"
                    ),
                ));
            }
            return Ok(());
        }
        if t.micro_batch() < world_size {
            let what = if t.grad_accum > 1 {
                format!(
                    "{} / grad_accum {} = {} samples per micro-batch",
                    t.global_batch,
                    t.grad_accum,
                    t.micro_batch()
                )
            } else {
                format!("{} samples", t.global_batch)
            };
            return Err(SpecError::at(
                "train.global_batch",
                format!("{what} cannot be shared among {world_size} workers: each needs at least one"),
            ));
        }
        Ok(())
    }
}

fn validate_env(env: &std::collections::BTreeMap<String, String>) -> Result<()> {
    for (k, v) in env {
        let path = format!("env.{k}");
        let ok = !k.is_empty()
            && k.len() <= 128
            && !k.starts_with(|c: char| c.is_ascii_digit())
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(SpecError::at(path, "a variable name is letters, digits and '_', not starting with a digit"));
        }
        if shoal_comm::env::RESERVED.contains(&k.as_str()) {
            return Err(SpecError::at(path, "is set by Shoal for every worker (the environment contract)"));
        }
        if v.contains('\0') || v.len() > 32 * 1024 {
            return Err(SpecError::at(path, "values must be under 32 KiB and contain no NUL"));
        }
    }
    Ok(())
}

fn validate_expected_runtime(t: Option<Seconds>) -> Result<()> {
    match t {
        Some(t) if t.0.is_zero() => Err(SpecError::at("expected_runtime", "must be more than 0s")),
        _ => Ok(()),
    }
}

fn validate_queue(queue: &str) -> Result<()> {
    if queue.is_empty()
        || queue.len() > 64
        || !queue.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(SpecError::at("queue", format!("{queue:?}: 1-64 letters, digits, '.', '_' or '-'")));
    }
    Ok(())
}

fn validate_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(SpecError::at("name", "must not be empty"));
    }
    if name.len() > 128 {
        return Err(SpecError::at("name", format!("is {} characters long; at most 128", name.len())));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(SpecError::at(
            "name",
            format!("{name:?} contains {c:?}; use only letters, digits, '.', '_' and '-'"),
        ));
    }
    if name.starts_with('.') {
        return Err(SpecError::at("name", format!("{name:?} must not start with '.'")));
    }
    Ok(())
}

impl TrainSpec {
    /// `train.precision`: 16-bit passes keep f32 master weights, so they need `train.dtype = "f32"`, a built-in
    /// model (a `command` computes in what its own program says), and a strategy whose ranks each hold the whole
    /// model's gradients in f32 — `f16`'s loss scaling skips a step on every rank alike only when every rank sees
    /// the same reduced gradients (DDP).
    fn validate_precision(&self) -> Result<()> {
        let p = self.precision;
        if !p.is_mixed() {
            return Ok(());
        }
        let at = |msg: String| Err(SpecError::at("train.precision", msg));
        if self.dtype != Dtype::F32 {
            return at(format!(
                "\"{}\" keeps f32 master weights: it needs train.dtype = \"f32\", not \"{}\"",
                p.name(),
                self.dtype.name()
            ));
        }
        if !self.command.is_empty() {
            return at(format!(
                "\"{}\" applies to the built-in models; a train.command program chooses its own precision",
                p.name()
            ));
        }
        let allowed: &[Strategy] = match p {
            Precision::F16 => &[Strategy::Ddp],
            _ => &[Strategy::Ddp, Strategy::Zero1, Strategy::Zero2],
        };
        if !allowed.contains(&self.strategy) {
            let names: Vec<String> = allowed.iter().map(|s| format!("\"{}\"", s.as_str())).collect();
            return at(format!(
                "\"{}\" runs under train.strategy {}, not \"{}\"",
                p.name(),
                names.join(", "),
                self.strategy.as_str()
            ));
        }
        Ok(())
    }

    fn validate_numbers(&self) -> Result<()> {
        positive("train.global_batch", self.global_batch)?;
        if self.strategy != Strategy::Federated {
            positive("train.steps", self.steps)?;
        }
        if self.dtype != Dtype::BUILT {
            let build = if self.dtype == Dtype::F64 { "with `--features f64`" } else { "without the `f64` feature" };
            return Err(SpecError::at(
                "train.dtype",
                format!(
                    "\"{}\": this shoal was built to compute in {}; run a shoal built {build}",
                    self.dtype.name(),
                    Dtype::BUILT.name()
                ),
            ));
        }
        self.validate_precision()?;
        finite_in("train.lr", self.lr, self.lr > 0.0, "> 0 and finite")?;
        if self.grad_accum == 0 {
            return Err(SpecError::at("train.grad_accum", "must be >= 1"));
        }
        if !self.global_batch.is_multiple_of(self.grad_accum) {
            return Err(SpecError::at(
                "train.grad_accum",
                format!("{} does not divide global_batch {}", self.grad_accum, self.global_batch),
            ));
        }
        let other = |opt: OptimizerKind| if opt == OptimizerKind::Sgd { "adamw" } else { "sgd" };
        let only_for = |path: &str, set: bool, opt: OptimizerKind| {
            if set && self.optimizer != opt {
                Err(SpecError::at(
                    path,
                    format!("applies to optimizer \"{}\" only, not \"{}\"", opt.as_str(), other(opt)),
                ))
            } else {
                Ok(())
            }
        };
        only_for("train.momentum", self.momentum.is_some(), OptimizerKind::Sgd)?;
        only_for("train.betas", self.betas.is_some(), OptimizerKind::Adamw)?;
        only_for("train.eps", self.eps.is_some(), OptimizerKind::Adamw)?;
        let m = self.momentum();
        finite_in("train.momentum", m, (0.0..1.0).contains(&m), "in [0, 1)")?;
        let wd = self.weight_decay();
        finite_in("train.weight_decay", wd, wd >= 0.0, ">= 0 and finite")?;
        for (i, b) in self.betas().into_iter().enumerate() {
            finite_in(&format!("train.betas[{i}]"), b, (0.0..1.0).contains(&b), "in [0, 1)")?;
        }
        finite_in("train.eps", self.eps(), self.eps() > 0.0, "> 0 and finite")?;
        if self.warmup_steps > self.steps {
            return Err(SpecError::at(
                "train.warmup_steps",
                format!("{} exceeds steps {}", self.warmup_steps, self.steps),
            ));
        }
        finite_in("train.min_lr", self.min_lr, self.min_lr >= 0.0 && self.min_lr <= self.lr, "in [0, lr]")?;
        if let Some(c) = self.clip_grad_norm {
            finite_in("train.clip_grad_norm", c, c > 0.0, "> 0 and finite")?;
        }
        positive("train.eval_batches", self.eval_batches)?;
        positive("train.log_every", self.log_every)?;
        finite_in(
            "train.bucket_mb",
            self.bucket_mb,
            self.bucket_mb > 0.0 && self.bucket_mb <= 65536.0,
            "> 0 and at most 65536 (MiB)",
        )
    }

    fn validate_model_and_data(&self, available: Option<u64>) -> Result<()> {
        let m = &self.model;
        // Sizes that do not apply to the kind.
        let set: [(&str, bool); 9] = [
            ("hidden", m.hidden.is_some()),
            ("channels", m.channels.is_some()),
            ("layers", m.layers.is_some()),
            ("heads", m.heads.is_some()),
            ("width", m.width.is_some()),
            ("context", m.context.is_some()),
            ("vocab", m.vocab.is_some()),
            ("patch", m.patch.is_some()),
            ("dropout", m.dropout.is_some()),
        ];
        if let Some((key, _)) = set.iter().find(|(k, on)| *on && !m.allowed().contains(k)) {
            return Err(SpecError::at(
                format!("train.model.{key}"),
                format!("does not apply to model \"{}\" (it takes: {})", m.kind, m.allowed().join(", ")),
            ));
        }
        // Sizes.
        let d = m.dropout();
        finite_in("train.model.dropout", d, (0.0..1.0).contains(&d), "in [0, 1)")?;
        match m.kind {
            ModelKind::Mlp => {
                for (i, &h) in m.hidden().iter().enumerate() {
                    positive(&format!("train.model.hidden[{i}]"), h)?;
                }
            }
            ModelKind::Cnn => {
                if m.channels().is_empty() {
                    return Err(SpecError::at("train.model.channels", "a CNN needs at least one conv layer"));
                }
                for (i, &c) in m.channels().iter().enumerate() {
                    positive(&format!("train.model.channels[{i}]"), c)?;
                }
            }
            ModelKind::Gpt => {
                positive("train.model.layers", m.layers())?;
                positive("train.model.heads", m.heads())?;
                positive("train.model.width", m.width())?;
                positive("train.model.context", m.context())?;
                positive("train.model.vocab", m.vocab())?;
                if !m.width().is_multiple_of(m.heads()) {
                    return Err(SpecError::at(
                        "train.model.heads",
                        format!("{} heads do not divide width {}", m.heads(), m.width()),
                    ));
                }
            }
            ModelKind::Vit => {
                positive("train.model.layers", m.layers())?;
                positive("train.model.heads", m.heads())?;
                positive("train.model.width", m.width())?;
                positive("train.model.patch", m.patch())?;
                if !m.width().is_multiple_of(m.heads()) {
                    return Err(SpecError::at(
                        "train.model.heads",
                        format!("{} heads do not divide width {}", m.heads(), m.width()),
                    ));
                }
            }
        }
        // The dataset, and whether it fits the model.
        let shape = self.data_shape()?;
        match (m.kind, shape.is_classification()) {
            (ModelKind::Gpt, true) => {
                return Err(SpecError::at(
                    "train.dataset",
                    format!(
                        "model \"gpt\" needs a text dataset, but \"{}\" is {} (classification) data",
                        self.dataset, shape.kind
                    ),
                ));
            }
            (ModelKind::Mlp | ModelKind::Cnn | ModelKind::Vit, false) => {
                return Err(SpecError::at(
                    "train.dataset",
                    format!(
                        "model \"{}\" needs a classification dataset, but \"{}\" is {} data (use model \"gpt\")",
                        m.kind, self.dataset, shape.kind
                    ),
                ));
            }
            _ => {}
        }
        match m.kind {
            ModelKind::Vit => {
                let Some(side) = ModelSpec::image_side(shape.features) else {
                    return Err(SpecError::at(
                        "train.dataset",
                        format!(
                            "model \"vit\" needs square images, but \"{}\" has {} features, not a square",
                            self.dataset, shape.features
                        ),
                    ));
                };
                if !side.is_multiple_of(m.patch()) {
                    return Err(SpecError::at(
                        "train.model.patch",
                        format!("{}-pixel patches do not divide the {side}x{side} image", m.patch()),
                    ));
                }
            }
            ModelKind::Cnn => {
                let Some(side) = ModelSpec::image_side(shape.features) else {
                    return Err(SpecError::at(
                        "train.dataset",
                        format!(
                            "model \"cnn\" needs square images, but \"{}\" has {} features, not a square",
                            self.dataset, shape.features
                        ),
                    ));
                };
                let fit = side.ilog2() as usize;
                if m.channels().len() > fit {
                    return Err(SpecError::at(
                        "train.model.channels",
                        format!(
                            "{} conv blocks each halve the {side}x{side} image; at most {fit} fit",
                            m.channels().len()
                        ),
                    ));
                }
            }
            ModelKind::Gpt => {
                if m.vocab() < shape.classes {
                    return Err(SpecError::at(
                        "train.model.vocab",
                        format!("{} is smaller than the dataset's {} token values", m.vocab(), shape.classes),
                    ));
                }
                if let Some(c) = self.data.context
                    && c != m.context()
                {
                    return Err(SpecError::at(
                        "train.data.context",
                        format!(
                            "{c} differs from train.model.context {}; leave it out to follow the model",
                            m.context()
                        ),
                    ));
                }
            }
            ModelKind::Mlp => {}
        }
        // Memory, before anything is allocated for the data.
        let need = self.memory_bytes()?;
        if let Some(have) = available
            && need > u128::from(have)
        {
            let params = m.param_count(shape.features, shape.classes);
            return Err(SpecError::at(
                "train.model",
                format!(
                    "too big for memory: about {} parameters need about {} for parameters, gradients \
                         and {} state (per worker), but {} is available",
                    count(params),
                    gib(need),
                    self.optimizer.as_str(),
                    gib(u128::from(have))
                ),
            ));
        }
        // The dataset's own option checks, on the splits the trainer loads (whatever `split` says): the same
        // rules shoal-data builds them by, without building anything.
        let o = self.data_options();
        for split in [Split::Train, Split::Eval] {
            let opts = Options { split, ..o.clone() };
            let c = data::check(&self.dataset, &opts).map_err(|e| match e {
                data::DataError::BadOption { option, reason, .. } => {
                    SpecError::at(format!("train.data.{option}"), reason)
                }
                other => SpecError::at("train.data", other.to_string()),
            })?;
            if split == Split::Train && !data::is_lake(&self.dataset) {
                self.validate_batch_fits(c.len)?;
            }
        }
        if let Some(l) = self.data.lanes.filter(|l| !self.micro_batch().is_multiple_of(*l)) {
            return Err(SpecError::at(
                "train.data.lanes",
                format!(
                    "{l} does not divide the {} samples of a micro-batch (global_batch / grad_accum)",
                    self.micro_batch()
                ),
            ));
        }
        Ok(())
    }

    /// A global batch takes distinct samples: it cannot be larger than the training set.
    fn validate_batch_fits(&self, train_len: usize) -> Result<()> {
        if self.global_batch > train_len {
            return Err(SpecError::at(
                "train.global_batch",
                format!(
                    "{} is larger than the {train_len} training samples of \"{}\"; at most {train_len}",
                    self.global_batch, self.dataset
                ),
            ));
        }
        Ok(())
    }
}

impl CheckpointSpec {
    /// `resume_from` as a local path (a `file://` prefix removed).
    pub fn resume_path(&self) -> Option<&str> {
        self.resume_from.as_deref().map(|from| from.strip_prefix("file://").unwrap_or(from))
    }

    fn validate(&self) -> Result<()> {
        positive("checkpoint.keep", self.keep)?;
        if self.memory_every > MAX_MEMORY_EVERY {
            return Err(SpecError::at(
                "checkpoint.memory_every",
                format!("{} is more than {MAX_MEMORY_EVERY} steps (0 turns in-memory copies off)", self.memory_every),
            ));
        }
        if let (Some(from), Some(path)) = (&self.resume_from, self.resume_path())
            && (path.trim().is_empty() || path.contains("://"))
        {
            return Err(SpecError::at(
                "checkpoint.resume_from",
                format!("{from:?}: a local checkpoint directory (or a run's checkpoint root) is expected"),
            ));
        }
        if let Some(url) = &self.url {
            if url.trim().is_empty() {
                return Err(SpecError::at("checkpoint.url", "must not be empty (leave it out for the default)"));
            }
            if let Some((scheme, _)) = url.split_once("://")
                && !URL_SCHEMES.contains(&scheme)
            {
                return Err(SpecError::at(
                    "checkpoint.url",
                    format!("unknown scheme \"{scheme}\"; known: {}", URL_SCHEMES.join(", ")),
                ));
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    const MLP: &str = r#"
name = "t"
[train]
model = "mlp"
dataset = "digits"
global_batch = 32
steps = 10
lr = 0.01
"#;

    /// Parses `toml` (with the machine's memory); `expect` empty = must be valid, otherwise a substring of the
    /// error's Display.
    fn check(toml: &str, expect: &str) -> Result<(), String> {
        match (parse_job(toml, "JOB.toml"), expect) {
            (Ok(_), "") => Ok(()),
            (Ok(_), want) => Err(format!("expected an error containing {want:?}, but it parsed:\n{toml}")),
            (Err(e), "") => Err(format!("expected a valid spec, got: {e}\n{toml}")),
            (Err(e), want) => {
                let shown = e.to_string();
                if shown.contains(want) && shown.starts_with("JOB.toml: ") {
                    Ok(())
                } else {
                    Err(format!("error {shown:?} does not contain {want:?}"))
                }
            }
        }
    }

    #[test]
    fn collectives_are_named_and_nccl_is_refused_where_gradients_stay_on_the_host() {
        let job = |extra: &str| format!("{MLP}{extra}\n");
        let cases = [
            ("collectives = \"auto\"", ""),
            ("collectives = \"shoal\"", ""),
            ("collectives = \"nccl\"", ""),
            ("collectives = \"nccl\"\nprecision = \"bf16\"", ""),
            ("collectives = \"mpi\"", "train.collectives"),
            (
                "collectives = \"nccl\"\nstrategy = \"zero2\"",
                "train.collectives: \"nccl\" sums the gradients of plain DDP",
            ),
            ("collectives = \"nccl\"\n[compression]\ncodec = \"topk\"\nratio = 0.01", "[compression] encodes"),
        ];
        for (extra, want) in cases {
            check(&job(extra), want).unwrap_or_else(|e| panic!("{extra}: {e}"));
        }
        let j = parse_job(&job("collectives = \"nccl\""), "x").expect("valid");
        assert_eq!(j.train.collectives, Collectives::Nccl);
        assert!(j.to_toml().expect("toml").contains("collectives = \"nccl\""));
        let plain = parse_job(&job(""), "x").expect("valid");
        assert_eq!(plain.train.collectives, Collectives::Auto);
        assert!(!plain.to_toml().expect("toml").contains("collectives"), "the default is not spelled out");
    }

    #[test]
    fn precision_is_checked_against_the_dtype_and_the_strategy() {
        let job = |extra: &str| format!("{MLP}{extra}\n");
        let cases = [
            ("precision = \"f32\"", ""),
            ("precision = \"bf16\"", ""),
            ("precision = \"f16\"", ""),
            ("precision = \"bf16\"\nstrategy = \"zero2\"", ""),
            ("precision = \"fp8\"", "train.precision"),
            ("precision = 16", "train.precision"),
            ("precision = \"f16\"\nstrategy = \"zero1\"", "train.precision: \"f16\" runs under train.strategy \"ddp\""),
            ("precision = \"bf16\"\nstrategy = \"zero3\"", "train.precision: \"bf16\" runs under train.strategy"),
            ("precision = \"bf16\"\ndtype = \"f64\"", "train."),
        ];
        for (extra, want) in cases {
            check(&job(extra), want).unwrap_or_else(|e| panic!("{extra}: {e}"));
        }
        // The default is not spelled out; a chosen precision survives the round trip.
        let j = parse_job(&job("precision = \"bf16\""), "x").expect("valid");
        assert_eq!(j.train.precision, Precision::Bf16);
        let text = j.to_toml().expect("toml");
        assert!(text.contains("precision = \"bf16\""), "{text}");
        assert_eq!(parse_job(&text, "x").expect("again"), j);
        let plain = parse_job(MLP, "x").expect("valid");
        assert_eq!(plain.train.precision, Precision::F32);
        assert!(!plain.to_toml().expect("toml").contains("precision"));
    }

    #[test]
    fn compression_is_checked_against_its_codec_and_the_strategy() {
        let job = |strategy: &str, table: &str| format!("{MLP}strategy = \"{strategy}\"\n[compression]\n{table}\n");
        let cases = [
            ("ddp", "codec = \"topk\"\nratio = 0.01", ""),
            ("ddp", "codec = \"powersgd\"\nrank = 2\nwarmup_steps = 5", ""),
            ("ddp", "codec = \"int8\"\nstochastic = true\nerror_feedback = false", ""),
            ("zero2", "codec = \"sign\"", ""),
            ("zero1", "codec = \"topk\"", ""),
            ("ddp", "codec = \"gzip\"", "compression.codec"),
            ("ddp", "codec = \"topk\"\nratio = 0", "compression.ratio: must be in (0, 1]"),
            ("ddp", "codec = \"topk\"\nratio = 1.5", "compression.ratio"),
            ("ddp", "codec = \"int8\"\nratio = 0.1", "compression.ratio: applies to codec = \"topk\""),
            ("ddp", "codec = \"topk\"\nrank = 4", "compression.rank: applies to codec = \"powersgd\""),
            ("ddp", "codec = \"powersgd\"\nrank = 0", "compression.rank: must be at least 1"),
            ("ddp", "codec = \"sign\"\nstochastic = true", "compression.stochastic"),
            ("zero3", "codec = \"powersgd\"", "compression.codec: \"powersgd\" needs every gradient matrix"),
            ("ddp", "codec = \"topk\"\nlevel = 3", "level"),
            ("ddp", "codec = \"sign\"\nwarmup_steps = 5\nwarmup_codec = \"int8\"\nmomentum = true", ""),
            ("zero2", "codec = \"topk\"\nwarmup_steps = 5\nwarmup_codec = \"bf16\"", ""),
            ("ddp", "codec = \"topk\"\nmomentum = true", "compression.warmup_steps: must be at least 1"),
            ("zero1", "codec = \"sign\"\nwarmup_steps = 5\nmomentum = true", "compression.momentum: needs every rank"),
            ("ddp", "momentum = true\nwarmup_steps = 2", "compression.momentum: sends the moment"),
            ("ddp", "codec = \"sign\"\nwarmup_steps = 5\nwarmup_codec = \"topk\"", "compression.warmup_codec: is"),
            ("ddp", "codec = \"sign\"\nwarmup_codec = \"int8\"", "compression.warmup_codec: codes the warm-up"),
            (
                "ddp\"\noptimizer = \"sgd",
                "codec = \"sign\"\nwarmup_steps = 5\nmomentum = true",
                "compression.momentum: sends AdamW's first moment; train.optimizer is \"sgd\"",
            ),
        ];
        for (strategy, table, want) in cases {
            check(&job(strategy, table), want).unwrap_or_else(|e| panic!("{strategy} / {table}: {e}"));
        }
        let pipeline = "name = \"t\"\n[train]\ndataset = \"cicero\"\nstrategy = \"pipeline\"\nglobal_batch = 8\nsteps = 2\n\
                        lr = 0.01\n[train.model]\nkind = \"gpt\"\nlayers = 4\n[parallel]\npipeline_stages = 2\n\
                        micro_batches = 4\n[compression]\ncodec = \"fp16\"\n";
        check(pipeline, "compression.codec: compresses the gradients of a data-parallel strategy")
            .unwrap_or_else(|e| panic!("{e}"));
        let j = parse_job(&job("ddp", "codec = \"randk\"\nratio = 0.05"), "x").expect("valid");
        assert_eq!(parse_job(&j.to_toml().expect("toml"), "x").expect("again"), j);
    }

    #[test]
    fn a_robust_rule_is_checked_against_the_strategy_the_codec_and_the_workers() {
        let job = |strategy: &str, more: &str| format!("{MLP}strategy = \"{strategy}\"\n{more}\n");
        let cases = [
            ("ddp", "[robust]\nrule = \"median\"\nf = 1", ""),
            ("ddp", "[workers]\ncount = 5\n[robust]\nrule = \"krum\"\nf = 1", ""),
            (
                "ddp",
                "[workers]\ncount = 4\n[robust]\nrule = \"krum\"\nf = 1",
                "robust.f: invalid argument: krum with f = 1 needs at least 5 workers, not 4",
            ),
            ("ddp", "[robust]\nrule = \"mean\"\nf = 1", "robust.f: the mean bears no attacker"),
            ("ddp", "[robust]\nrule = \"average\"", "robust.rule"),
            ("zero1", "[robust]\nrule = \"median\"", "robust.rule: \"median\" combines every rank's whole gradient"),
            (
                "ddp",
                "[compression]\ncodec = \"int8\"\n[robust]\nrule = \"median\"",
                "robust.rule: a robust rule combines whole",
            ),
        ];
        for (strategy, more, want) in cases {
            check(&job(strategy, more), want).unwrap_or_else(|e| panic!("{strategy} / {more}: {e}"));
        }
        let chaos = |more: &str| {
            job("ddp", &format!("[workers]\ncount = 5\n[robust]\nrule = \"median\"\nf = 1\n[chaos]\n{more}"))
        };
        let attacks = [
            ("byzantine_ranks = [4]\nattack = \"signflip\"", ""),
            ("byzantine_ranks = [1, 3]\nattack = \"alie\"\nscale = 1.5", ""),
            ("byzantine_ranks = [5]\nattack = \"ipm\"", "chaos.byzantine_ranks: rank 5 is not one of the 5 workers"),
            ("byzantine_ranks = [1, 1]\nattack = \"noise\"", "chaos.byzantine_ranks: names a rank twice"),
            ("byzantine_ranks = []\nattack = \"noise\"", "chaos.byzantine_ranks: names no rank"),
            ("byzantine_ranks = [0]\nattack = \"noise\"\nscale = -1", "chaos.scale"),
            ("byzantine_ranks = [0]\nattack = \"flood\"", "chaos.attack"),
        ];
        for (more, want) in attacks {
            check(&chaos(more), want).unwrap_or_else(|e| panic!("{more}: {e}"));
        }
        check(&job("ddp", "[chaos]\nbyzantine_ranks = [0]\nattack = \"ipm\""), "chaos.attack: attacks are simulated")
            .unwrap_or_else(|e| panic!("{e}"));
        let r = RobustSpec { rule: RuleName::TrimmedMean, f: 2 };
        assert!(r.validate_world(5).is_ok());
        assert_eq!(r.validate_world(4).map_err(|e| e.0), Err("robust.f".to_string()));
    }

    #[test]
    fn a_job_with_a_command_holds_no_built_in_training_and_round_trips() {
        let cmd = "name = \"own\"\n[workers]\ncount = 2\n[train]\ncommand = [\"python3\", \"train.py\"]\n";
        let spec = parse_job(cmd, "JOB.toml").unwrap_or_else(|e| panic!("{e}"));
        assert!(spec.is_command() && !spec.regroups_in_place());
        assert_eq!(spec.validate_world(3).map_err(|e| e.to_string()), Ok(()));
        let toml = spec.to_toml().unwrap_or_else(|e| panic!("{e}"));
        assert!(!toml.contains("dataset") && !toml.contains("\nlr =") && !toml.contains("model"), "{toml}");
        assert_eq!(parse_job(&toml, "again.toml").map_err(|e| e.to_string()), Ok(spec.clone()));
        let json = serde_json::to_string(&spec).unwrap_or_default();
        assert_eq!(parse_job_json(&json).map_err(|e| e.to_string()), Ok(spec));
        check_all(&[
            (format!("{cmd}steps = 100\n"), ""),
            (format!("{cmd}lr = 0.1\n"), "train.lr: a job with train.command runs its own program"),
            (format!("{cmd}model = \"mlp\"\n"), "train.model: a job with train.command"),
            (format!("{cmd}strategy = \"zero1\"\n"), "train.strategy: a job with train.command"),
            (format!("{cmd}[compression]\ncodec = \"int8\"\n"), "compression: a job with train.command"),
            (cmd.replace("[\"python3\", \"train.py\"]", "[\"\"]"), "train.command: names no program"),
            (MLP.replace("dataset = \"digits\"\n", ""), "JOB.toml: train: missing field `dataset`"),
        ]);
    }

    #[test]
    fn dynamic_sharding_is_for_lake_data_under_data_parallel_strategies_that_restart() {
        let lake = "name = \"t\"\n[train]\nmodel = \"mlp\"\ndataset = \"s3://lake/t/\"\nglobal_batch = 32\nsteps = 10\n\
                    lr = 0.01\nstrategy = \"{s}\"\n[train.data]\nfeature_columns = [\"a\"]\nlabel_column = \"y\"\n\
                    classes = 2\nsharding = \"{m}\"\n{tail}";
        let job = |s: &str, m: &str, tail: &str| lake.replace("{s}", s).replace("{m}", m).replace("{tail}", tail);
        check_all(&[
            (job("ddp", "dynamic", ""), ""),
            (job("zero2", "dynamic", "[fault_tolerance]\npolicy = \"restart\"\n"), ""),
            (job("ddp", "static", ""), ""),
            (job("ddp", "sideways", ""), "train.data.sharding"),
            (
                job("ps", "dynamic", "[ps]\nservers = 1\n"),
                "train.data.sharding: \"dynamic\" hands blocks to data-parallel ranks",
            ),
            (
                job("ddp", "dynamic", "[fault_tolerance]\npolicy = \"elastic\"\n[workers]\nmin = 1\nmax = 2\n"),
                "train.data.sharding: \"dynamic\" recovers what a lost worker consumed",
            ),
            (format!("{MLP}[train.data]\nsharding = \"dynamic\"\n"), "sharding"),
        ]);
    }

    fn check_all(cases: &[(String, &str)]) {
        let failures: Vec<String> = cases.iter().filter_map(|(toml, expect)| check(toml, expect).err()).collect();
        assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
    }

    /// MLP with `train` lines appended to `[train]`, then `tail` (more tables).
    fn mlp(train: &str, tail: &str) -> String {
        format!("{MLP}{train}\n{tail}\n")
    }

    #[test]
    fn pipeline_layouts_that_do_not_divide_are_refused_by_key_path() {
        let gpt = |parallel: &str, train: &str| {
            format!(
                "name = \"t\"\n[train]\ndataset = \"cicero\"\nstrategy = \"pipeline\"\nglobal_batch = 8\nsteps = 2\n\
                 lr = 0.01\n{train}\n[train.model]\nkind = \"gpt\"\nlayers = 4\n[parallel]\n{parallel}\n"
            )
        };
        let mlp_pipe = |parallel: &str| mlp("strategy = \"pipeline\"", &format!("[parallel]\n{parallel}"));
        let cases: Vec<(String, &str)> = vec![
            (gpt("pipeline_stages = 2\nmicro_batches = 4", ""), ""),
            (gpt("pipeline_stages = 2\nmicro_batches = 4\nbalance = \"params\"", ""), ""),
            (gpt("pipeline_stages = 2\nmicro_batches = 4\nbalance = \"time\"", ""), ""),
            (gpt("pipeline_stages = 4\nmicro_batches = 8\nschedule = \"gpipe\"", ""), ""),
            (gpt("pipeline_stages = 2\nmicro_batches = 2\nschedule = \"1f1b\"\nvirtual_stages = 1", ""), ""),
            (
                gpt("pipeline_stages = 3\nmicro_batches = 4", ""),
                "parallel.pipeline_stages: 3 stages do not divide the GPT's 4 layers",
            ),
            (gpt("pipeline_stages = 1\nmicro_batches = 4", ""), "parallel.pipeline_stages: 1 stages: at least 2"),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 3", ""),
                "parallel.micro_batches: 3 does not divide train.global_batch 8",
            ),
            (gpt("pipeline_stages = 2\nmicro_batches = 0", ""), "parallel.micro_batches: must be > 0"),
            (gpt("pipeline_stages = 2\nmicro_batches = 4\nschedule = \"interleaved\"\nvirtual_stages = 2", ""), ""),
            (gpt("pipeline_stages = 2\nmicro_batches = 8\nschedule = \"interleaved\"", ""), ""),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 4\nvirtual_stages = 2", ""),
                "parallel.virtual_stages: 2 virtual stages: only schedule = \"interleaved\" has more than 1",
            ),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 4\nschedule = \"interleaved\"\nvirtual_stages = 1", ""),
                "parallel.virtual_stages: 1: the interleaved schedule holds at least 2 model chunks per rank",
            ),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 4\nschedule = \"interleaved\"\nvirtual_stages = 0", ""),
                "parallel.virtual_stages: must be > 0",
            ),
            (
                gpt("pipeline_stages = 4\nmicro_batches = 2\nschedule = \"interleaved\"", ""),
                "parallel.micro_batches: 2 micro-batches: the interleaved schedule takes them in groups of \
                 parallel.pipeline_stages = 4",
            ),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 4\nschedule = \"interleaved\"\nvirtual_stages = 3", ""),
                "parallel.virtual_stages: 2 stages × 3 virtual stages = 6 chunks do not divide the GPT's 4 layers",
            ),
            (
                mlp_pipe("pipeline_stages = 2\nmicro_batches = 4\nschedule = \"interleaved\""),
                "parallel.virtual_stages: 2 stages × 2 virtual stages = 4 chunks for the MLP's 3 layers: at most 3",
            ),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 4\nschedule = \"zigzag\"", ""),
                "parallel.schedule: unknown variant `zigzag`",
            ),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 4\ndata = 2", ""),
                "parallel.data: composing pipeline stages with data parallelism",
            ),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 4\ntensor = 2", ""),
                "parallel.tensor: composing pipeline and tensor parallelism is train.strategy = \"3d\"",
            ),
            (gpt("pipeline_stages = 2\nmicro_batches = 4\nstages = 2", ""), "parallel.stages: unknown field `stages`"),
            (
                gpt("pipeline_stages = -2\nmicro_batches = 4", ""),
                "parallel.pipeline_stages: invalid value: integer `-2`",
            ),
            (gpt("micro_batches = 4", ""), "parallel.pipeline_stages: required with train.strategy = \"pipeline\""),
            (gpt("pipeline_stages = 2", ""), "parallel.micro_batches: required with train.strategy = \"pipeline\""),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 4", "grad_accum = 2"),
                "train.grad_accum: a pipeline accumulates",
            ),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 4", "[workers]\ncount = 3"),
                "parallel.pipeline_stages: 2 stages do not divide the world size 3",
            ),
            (
                gpt("pipeline_stages = 2\nmicro_batches = 4", "[workers]\ncount = 4"),
                "parallel.pipeline_stages: 2 stages on 4 workers",
            ),
            (gpt("pipeline_stages = 2\nmicro_batches = 4", "[workers]\ncount = 2"), ""),
            (mlp_pipe("pipeline_stages = 3\nmicro_batches = 4"), ""),
            (
                mlp_pipe("pipeline_stages = 4\nmicro_batches = 4"),
                "parallel.pipeline_stages: 4 stages for the MLP's 3 layers: at most 3",
            ),
            (
                mlp("", "[parallel]\npipeline_stages = 2\nmicro_batches = 4"),
                "parallel: applies to train.strategy = \"pipeline\", \"tensor\" or \"3d\" only, not \"ddp\"",
            ),
        ];
        check_all(&cases);
        let j = parse_job(&gpt("pipeline_stages = 2\nmicro_batches = 4", ""), "x").expect("valid");
        let p = j.parallel.clone().expect("[parallel]");
        assert_eq!((p.schedule, p.virtual_stages(), j.pipeline_stages()), (PipelineSchedule::OneFOneB, 1, 2));
        // Written back and read again, the same job.
        assert_eq!(parse_job(&j.to_toml().expect("toml"), "x").expect("again"), j);
        let j = parse_job(&gpt("pipeline_stages = 2\nmicro_batches = 4\nschedule = \"interleaved\"", ""), "x")
            .expect("valid");
        let p = j.parallel.clone().expect("[parallel]");
        assert_eq!((p.schedule, p.virtual_stages, p.virtual_stages()), (PipelineSchedule::Interleaved, None, 2));
        assert_eq!(parse_job(&j.to_toml().expect("toml"), "x").expect("again"), j);
    }

    #[test]
    fn tensor_layouts_that_do_not_divide_are_refused_by_key_path() {
        let job = |kind: &str, model: &str, parallel: &str, tail: &str| {
            let dataset = if kind == "gpt" { "cicero" } else { "digits" };
            format!(
                "name = \"t\"\n[train]\ndataset = \"{dataset}\"\nstrategy = \"tensor\"\nglobal_batch = 8\nsteps = 2\n\
                 lr = 0.01\n[train.model]\nkind = \"{kind}\"\n{model}\n[parallel]\n{parallel}\n{tail}"
            )
        };
        let gpt = |model: &str, parallel: &str| job("gpt", model, parallel, "");
        let cases: Vec<(String, &str)> = vec![
            (gpt("heads = 4", "tensor = 2"), ""),
            (gpt("heads = 4", "tensor = 4"), ""),
            (gpt("heads = 4", "tensor = 3"), "parallel.tensor: 3 does not divide the GPT's 4 heads"),
            (
                gpt("heads = 3\nwidth = 48\nvocab = 257", "tensor = 3"),
                "parallel.tensor: 3 does not divide the GPT's vocabulary of 257 tokens",
            ),
            (gpt("", "tensor = 1"), "parallel.tensor: 1 ranks: at least 2"),
            (gpt("", ""), "parallel.tensor: train.strategy = \"tensor\" needs parallel.tensor"),
            (gpt("", "tensor = 2\npipeline_stages = 2"), "parallel.pipeline_stages: applies to train.strategy"),
            (gpt("", "tensor = 2\nmicro_batches = 2"), "parallel.micro_batches: applies to train.strategy"),
            (gpt("", "tensor = 2\ndata = 2"), "parallel.data: composing tensor parallelism with data parallelism"),
            (gpt("", "tensor = 2\nzero = 1"), "parallel.zero: ZeRO inside a tensor-parallel group"),
            (job("gpt", "", "tensor = 2", "[workers]\ncount = 4"), "parallel.tensor: 2 tensor-parallel ranks on 4"),
            (job("gpt", "", "tensor = 2", "[workers]\ncount = 2"), ""),
            (job("vit", "heads = 4", "tensor = 2", ""), ""),
            (
                job("vit", "heads = 2\nwidth = 32", "tensor = 4", ""),
                "parallel.tensor: 4 does not divide the ViT's 2 heads",
            ),
            (job("mlp", "", "tensor = 2", ""), "parallel.tensor: model \"mlp\" has no tensor-parallel layout"),
            (
                "name = \"t\"\n[train]\ndataset = \"cicero\"\nstrategy = \"tensor\"\nglobal_batch = 8\nsteps = 2\n\
                 lr = 0.01\nmodel = \"gpt\"\n"
                    .into(),
                "parallel: train.strategy = \"tensor\" needs a [parallel] table",
            ),
        ];
        check_all(&cases);
        let j = parse_job(&gpt("heads = 4", "tensor = 2"), "x").expect("valid");
        assert_eq!((j.tensor_degree(), j.pipeline_stages(), j.model_parallel()), (2, 1, 2));
        assert_eq!(parse_job(&j.to_toml().expect("toml"), "x").expect("again"), j);
    }

    #[test]
    fn composed_layouts_that_do_not_fit_are_refused_by_key_path() {
        let job = |kind: &str, parallel: &str, tail: &str| {
            let (dataset, model) = if kind == "gpt" { ("cicero", "layers = 4") } else { ("digits", "") };
            format!(
                "name = \"t\"\n[train]\ndataset = \"{dataset}\"\nstrategy = \"3d\"\nglobal_batch = 8\nsteps = 2\n\
                 lr = 0.01\n[train.model]\nkind = \"{kind}\"\n{model}\n[parallel]\n{parallel}\n{tail}"
            )
        };
        let gpt = |parallel: &str, workers: usize| job("gpt", parallel, &format!("[workers]\ncount = {workers}"));
        let cases: Vec<(String, &str)> = vec![
            (gpt("data = 2\npipeline_stages = 2\nmicro_batches = 2", 4), ""),
            (gpt("data = 2\npipeline = 2\nmicro_batches = 2\nzero = 1", 4), ""),
            (gpt("data = 2\ntensor = 2\nzero = 1", 4), ""),
            (gpt("tensor = 2\npipeline_stages = 2\nmicro_batches = 2\nschedule = \"gpipe\"", 4), ""),
            (gpt("data = 2\ntensor = 2\npipeline_stages = 2\nmicro_batches = 2", 8), ""),
            (gpt("data = 2\npipeline_stages = 2\nmicro_batches = 2\nschedule = \"interleaved\"", 4), ""),
            (
                gpt("data = 2\npipeline_stages = 2\nmicro_batches = 1\nschedule = \"interleaved\"", 4),
                "parallel.micro_batches: 1 micro-batches: the interleaved schedule takes them in groups",
            ),
            (
                gpt(
                    "data = 2\npipeline_stages = 2\nmicro_batches = 2\nschedule = \"interleaved\"\nvirtual_stages = 4",
                    4,
                ),
                "parallel.virtual_stages: 2 stages × 4 virtual stages = 8 chunks do not divide the GPT's 4 layers",
            ),
            (gpt("data = 2\nvirtual_stages = 2", 2), "parallel.virtual_stages: applies to a pipeline only"),
            (gpt("data = 4", 4), ""),
            (
                gpt("data = 2\ntensor = 2\npipeline_stages = 2\nmicro_batches = 2", 4),
                "parallel.data: 2 × tensor 2 × pipeline 2 = 8 ranks, but the job runs 4",
            ),
            (gpt("data = 2\ntensor = 2", 2), "parallel.data: 2 × tensor 2 × pipeline 1 = 4 ranks, but the job runs 2"),
            (gpt("data = 2\ntensor = 3", 6), "parallel.tensor: 3 does not divide the GPT's 4 heads"),
            (
                gpt("data = 1\npipeline_stages = 3\nmicro_batches = 2", 3),
                "parallel.pipeline_stages: 3 stages do not divide the GPT's 4 layers",
            ),
            (
                gpt("data = 2\npipeline_stages = 2\nmicro_batches = 3", 4),
                "parallel.micro_batches: 3 does not divide train.global_batch 8",
            ),
            (gpt("data = 2\npipeline_stages = 2", 4), "parallel.micro_batches: required with a pipeline"),
            (gpt("data = 2\nmicro_batches = 2", 2), "parallel.micro_batches: applies to a pipeline only"),
            (
                gpt("data = 2\npipeline_stages = 2\npipeline = 4\nmicro_batches = 2", 4),
                "parallel.pipeline: 4 disagrees with parallel.pipeline_stages = 2",
            ),
            (gpt("data = 2\nzero = 2", 2), "parallel.zero: ZeRO-2 inside a composed layout is not available yet"),
            (gpt("data = 2\nzero = 7", 2), "parallel.zero: 7: a ZeRO stage is 0, 1, 2 or 3"),
            (gpt("data = 2\npipeline = 2\nmicro_batches = 2\nbalance = \"params\"", 4), ""),
            (
                gpt("data = 2\npipeline = 2\nmicro_batches = 2\nbalance = \"time\"", 4),
                "parallel.balance: \"time\" applies to train.strategy = \"pipeline\"",
            ),
            (gpt("data = 0", 1), "parallel.data: must be > 0"),
            (gpt("data = 16", 16), "train.global_batch: 8 samples per micro-batch cannot be shared among"),
            (job("mlp", "tensor = 2", ""), "parallel.tensor: model \"mlp\" has no tensor-parallel layout"),
            (job("mlp", "data = 2\npipeline_stages = 2\nmicro_batches = 2", "[workers]\ncount = 4"), ""),
            (
                "name = \"t\"\n[train]\ndataset = \"cicero\"\nstrategy = \"3d\"\nglobal_batch = 8\nsteps = 2\n\
                 lr = 0.01\nmodel = \"gpt\"\n"
                    .into(),
                "parallel: train.strategy = \"3d\" needs a [parallel] table",
            ),
        ];
        check_all(&cases);
        let j = parse_job(&gpt("data = 2\ntensor = 2\npipeline_stages = 2\nmicro_batches = 4\nzero = 1", 8), "x")
            .expect("valid");
        assert_eq!(
            (j.data_degree(), j.tensor_degree(), j.pipeline_stages(), j.pipeline_micro_batches(), j.zero_stage()),
            (2, 2, 2, 4, 1)
        );
        assert_eq!(j.model_parallel(), 4);
        assert_eq!(j.train.strategy.as_str(), "3d");
        assert_eq!(parse_job(&j.to_toml().expect("toml"), "x").expect("again"), j);
    }

    #[test]
    fn vit_sizes_are_checked_against_the_images() {
        let vit = |model: &str, dataset: &str| {
            format!(
                "name = \"t\"\n[train]\ndataset = \"{dataset}\"\nglobal_batch = 8\nsteps = 2\nlr = 0.01\n\
                 [train.model]\nkind = \"vit\"\n{model}\n"
            )
        };
        let cases: Vec<(String, &str)> = vec![
            (vit("", "digits"), ""),
            (vit("patch = 2\nlayers = 1\nheads = 2\nwidth = 32", "digits"), ""),
            (vit("patch = 3", "digits"), "train.model.patch: 3-pixel patches do not divide the 8x8 image"),
            (vit("patch = 0", "digits"), "train.model.patch: must be > 0"),
            (vit("heads = 3", "digits"), "train.model.heads: 3 heads do not divide width 64"),
            (vit("vocab = 3", "digits"), "train.model.vocab: does not apply to model \"vit\""),
            (vit("", "cicero"), "train.dataset: model \"vit\" needs a classification dataset"),
        ];
        check_all(&cases);
        let m = parse_job(&vit("", "digits"), "x").expect("valid").train.model;
        // 16-pixel patch linear, class token, 5 positions, 2 blocks, final norm, head to 10 classes.
        let (w, blocks) = (64u64, 2 * (12 * 64 * 64 + 13 * 64));
        assert_eq!(m.param_count(64, 10), 16 * w + w + w + 5 * w + blocks + 2 * w + w * 10 + 10);
    }

    #[test]
    fn memory_checkpoint_dirs_are_one_plain_name_under_dev_shm() {
        let dir = |id: &str| memory_checkpoint_dir(id).map(|p| p.display().to_string());
        assert_eq!(dir("42").as_deref(), Some("/dev/shm/shoal-42"));
        assert_eq!(dir("run-17").as_deref(), Some("/dev/shm/shoal-run-17"));
        assert_eq!(dir("../../etc").as_deref(), Some("/dev/shm/shoal-.._.._etc"));
        assert_eq!(dir("a/b c").as_deref(), Some("/dev/shm/shoal-a_b_c"));
        assert_eq!(dir(""), None);
        assert_eq!(dir(".."), None);
    }

    #[test]
    fn bad_and_good_specs() {
        let cases: Vec<(String, &str)> = vec![
            // Valid.
            (MLP.into(), ""),
            (mlp("optimizer = \"sgd\"\nmomentum = 0.5\nweight_decay = 1e-4", ""), ""),
            (mlp("", "[train.data]\nseed = 3\n[checkpoint]\nevery = 5\nkeep = 1\nurl = \"s3://b/p\""), ""),
            // Unknown keys, at every level.
            ("nmae = \"x\"\n".to_owned() + MLP, "JOB.toml: nmae: unknown field `nmae`, expected one of `name`"),
            (mlp("stpes = 3", ""), "train.stpes: unknown field `stpes`"),
            (
                MLP.replace("model = \"mlp\"", "model = { kind = \"mlp\", hiden = [3] }"),
                "train.model.hiden: unknown field `hiden`, expected one of",
            ),
            (mlp("", "[train.data]\nfeatres = 3"), "train.data.featres: unknown field `featres`"),
            (mlp("", "[checkpoint]\nevry = 3"), "checkpoint.evry: unknown field `evry`"),
            (mlp("", "[schedule]\nx = 1"), "schedule: unknown field `schedule`"),
            // Wrong types and values.
            (MLP.replace("steps = 10", "steps = \"ten\""), "train.steps: invalid type: string \"ten\", expected usize"),
            (MLP.replace("steps = 10", "steps = -5"), "train.steps: invalid value: integer `-5`, expected usize"),
            (MLP.replace("lr = 0.01", "lr = -0.1"), "train.lr: must be > 0 and finite, got -0.1"),
            (MLP.replace("lr = 0.01", "lr = nan"), "train.lr: must be > 0 and finite"),
            (MLP.replace("lr = 0.01", "lr = 1"), ""),
            (MLP.replace("lr = 0.01", "lr = true"), "train.lr: invalid type: boolean `true`, expected f64"),
            (
                MLP.replace("model = \"mlp\"", "model = \"transformer\""),
                "train.model: unknown variant `transformer`, expected one of `mlp`, `cnn`, `gpt`",
            ),
            (
                MLP.replace("model = \"mlp\"", "model = 3"),
                "train.model: invalid type: integer `3`, expected a model name",
            ),
            (MLP.replace("model = \"mlp\"", "model = { hidden = [3] }"), "train.model: missing field `kind`"),
            (mlp("strategy = \"ddp\"", ""), ""),
            (
                mlp("strategy = \"fsdp\"", ""),
                "train.strategy: \"fsdp\" is not available yet; available: ddp, zero1, zero2, zero3, pipeline, tensor, 3d, ps, \
                 auto",
            ),
            (mlp("strategy = \"zero3\"", ""), ""),
            (mlp("strategy = \"pipeline\"", ""), "parallel: train.strategy = \"pipeline\" needs a [parallel] table"),
            (mlp("strategy = \"tensor\"", ""), "parallel: train.strategy = \"tensor\" needs a [parallel] table"),
            (mlp("strategy = \"ps\"", ""), ""),
            (mlp("strategy = \"ps\"", "[ps]\nservers = 3\nmode = \"ssp\"\nstaleness = 2"), ""),
            (
                mlp("strategy = \"ddp\"", "[ps]\nservers = 2"),
                "ps: applies to train.strategy = \"ps\" only, not \"ddp\"",
            ),
            (mlp("strategy = \"ps\"", "[ps]\nservers = 0"), "ps.servers: must be 1 to 256, got 0"),
            (
                mlp("strategy = \"ps\"", "[ps]\nmode = \"async\"\nstaleness = 2"),
                "ps.staleness: bounds mode = \"ssp\" only",
            ),
            (mlp("strategy = \"ps\"", "[ps]\nmode = \"eventual\""), "ps.mode: unknown variant `eventual`"),
            (mlp("strategy = \"ps\"\nclip_grad_norm = 1.0", ""), "train.clip_grad_norm: under train.strategy = \"ps\""),
            (
                mlp("strategy = \"ps\"", "[ps]\nmode = \"async\"\n[robust]\nrule = \"median\""),
                "robust.rule: a robust rule combines a round's pushes: it needs ps.mode = \"sync\"",
            ),
            (
                mlp("strategy = \"ps\"", "[workers]\nmin = 2\nmax = 4"),
                "workers.min: the parameter servers serve a fixed",
            ),
            (mlp("strategy = \"banana\"", ""), "train.strategy: unknown strategy \"banana\"; available: ddp"),
            (mlp("strategy = 3", ""), "train.strategy: invalid type: integer `3`, expected a strategy name"),
            (mlp("optimizer = \"adam\"", ""), "train.optimizer: unknown variant `adam`, expected `sgd` or `adamw`"),
            (MLP.replace("steps = 10\n", ""), "JOB.toml: train: missing field `steps`"),
            (MLP.replace("name = \"t\"\n", ""), "JOB.toml: missing field `name`"),
            // Zero and bad sizes.
            (MLP.replace("steps = 10", "steps = 0"), "JOB.toml: train.steps: must be > 0"),
            (MLP.replace("global_batch = 32", "global_batch = 0"), "train.global_batch: must be > 0"),
            (mlp("grad_accum = 0", ""), "train.grad_accum: must be >= 1"),
            (mlp("grad_accum = 5", ""), "train.grad_accum: 5 does not divide global_batch 32"),
            (mlp("warmup_steps = 11", ""), "train.warmup_steps: 11 exceeds steps 10"),
            (mlp("bucket_mb = 0.0", ""), "train.bucket_mb: must be > 0"),
            (mlp("overlap = \"yes\"", ""), "train.overlap: unknown variant `yes`, expected one of `auto`, `on`, `off`"),
            (mlp("clip_grad_norm = 0.0", ""), "train.clip_grad_norm: must be > 0"),
            (mlp("min_lr = 1.0", ""), "train.min_lr: must be in [0, lr]"),
            (mlp("momentum = 0.9", ""), "train.momentum: applies to optimizer \"sgd\" only"),
            (mlp("optimizer = \"sgd\"\nbetas = [0.9, 0.99]", ""), "train.betas: applies to optimizer \"adamw\" only"),
            (mlp("betas = [0.9, 1.5]", ""), "train.betas[1]: must be in [0, 1)"),
            (mlp("betas = [0.9]", ""), "train.betas: invalid length 1, expected an array of length 2"),
            (mlp("eval_batches = 0", ""), "train.eval_batches: must be > 0"),
            (
                MLP.replace("model = \"mlp\"", "model = { kind = \"mlp\", hidden = [64, 0] }"),
                "train.model.hidden[1]: must be > 0",
            ),
            (
                MLP.replace("model = \"mlp\"", "model = { kind = \"mlp\", hidden = [64, -1] }"),
                "train.model.hidden[1]: invalid value: integer `-1`, expected usize",
            ),
            (
                MLP.replace("model = \"mlp\"", "model = { kind = \"mlp\", layers = 2 }"),
                "train.model.layers: does not apply to model \"mlp\"",
            ),
            (
                MLP.replace("model = \"mlp\"", "model = { kind = \"mlp\", dropout = 1.0 }"),
                "train.model.dropout: must be in [0, 1)",
            ),
            (mlp("", "[checkpoint]\nkeep = 0"), "checkpoint.keep: must be > 0"),
            (mlp("", "[checkpoint]\nmemory_every = 5"), ""),
            (mlp("", "[checkpoint]\nmemory_every = 0"), ""),
            (mlp("", "[checkpoint]\nmemory_every = -1"), "checkpoint.memory_every: invalid value: integer `-1`"),
            (mlp("", "[checkpoint]\nmemory_every = \"5\""), "checkpoint.memory_every: invalid type: string"),
            (mlp("", "[checkpoint]\nmemory_every = 2000000000"), "checkpoint.memory_every: 2000000000 is more than"),
            (mlp("", "[checkpoint]\nurl = \"ftp://x/y\""), "checkpoint.url: unknown scheme \"ftp\""),
            // Datasets.
            (
                MLP.replace("\"digits\"", "\"mnist\""),
                "train.dataset: unknown dataset \"mnist\"; the built-in datasets are: digits, cicero, synthetic",
            ),
            (
                MLP.replace("\"digits\"", "\"cicero\""),
                "model \"mlp\" needs a classification dataset, but \"cicero\" is text data",
            ),
            (mlp("", "[train.data]\ncontext = 8"), "train.data.context: does not apply to this dataset"),
            (
                MLP.replace("\"digits\"", "\"synthetic\"") + "[train.data]\nfeatures = 0",
                "train.data.features: must be at least 1",
            ),
            (mlp("", "[train.data]\nsplit = \"most\""), "train.data.split: unknown variant `most`"),
            (mlp("", "[train.data]\neval_fraction = 1.5"), "train.data.eval_fraction: 1.5 is not in (0, 1)"),
            // Names.
            (MLP.replace("\"t\"", "\"../x\""), "JOB.toml: name: \"../x\" contains '/'"),
            (MLP.replace("\"t\"", "\"..\""), "name: \"..\" must not start with '.'"),
            (MLP.replace("\"t\"", "\"\""), "name: must not be empty"),
            (MLP.replace("\"t\"", "\"a b\""), "name: \"a b\" contains ' '"),
            // Malformed TOML: line and column.
            (MLP.replace("steps = 10", "steps = = 10"), "JOB.toml: line 7, column 9: "),
            ("name = \"t\"\n[train\n".into(), "JOB.toml: line 2"),
            (
                MLP.to_owned() + "[train.model]\nkind = \"mlp\"\n",
                "JOB.toml: line 9, column 8: duplicate key: `[train.model]` (`model = \"...\"` and a [train.model] table are the same key",
            ),
            // Too big for memory.
            (
                MLP.replace("model = \"mlp\"", "model = { kind = \"mlp\", hidden = [4000000000, 4000000000] }"),
                "train.model: too big for memory: about",
            ),
        ];
        check_all(&cases);
    }

    const GPT: &str = r#"
name = "g"
[train]
dataset = "cicero"
global_batch = 16
steps = 10
lr = 0.001
[train.model]
kind = "gpt"
"#;

    const CNN: &str = r#"
name = "c"
[train]
model = "cnn"
dataset = "digits"
global_batch = 16
steps = 10
lr = 0.001
"#;

    #[test]
    fn gpt_and_cnn_checks() {
        let cases: Vec<(String, &str)> = vec![
            (GPT.into(), ""),
            (GPT.to_owned() + "layers = 1\nheads = 2\nwidth = 32\ncontext = 16\n[train.data]\nstride = 4", ""),
            (
                GPT.to_owned() + "[train.data]\ncontext = 16",
                "train.data.context: 16 differs from train.model.context 64",
            ),
            (GPT.to_owned() + "heads = 3", "train.model.heads: 3 heads do not divide width 64"),
            (GPT.to_owned() + "heads = 0", "train.model.heads: must be > 0"),
            (GPT.to_owned() + "context = 0", "train.model.context: must be > 0"),
            (GPT.to_owned() + "vocab = 100", "train.model.vocab: 100 is smaller than the dataset's 256"),
            (GPT.to_owned() + "hidden = [3]", "train.model.hidden: does not apply to model \"gpt\" (it takes: layers"),
            (GPT.to_owned() + "context = 100000", "train.data.context: 100000 leaves no window"),
            (
                GPT.replace("\"cicero\"", "\"digits\""),
                "train.dataset: model \"gpt\" needs a text dataset, but \"digits\" is image",
            ),
            (GPT.to_owned() + "width = 1000000\nheads = 1\nlayers = 1000", "train.model: too big for memory"),
            (CNN.into(), ""),
            (CNN.replace("model = \"cnn\"", "model = { kind = \"cnn\", channels = [8, 8, 8] }"), ""),
            (
                CNN.replace("model = \"cnn\"", "model = { kind = \"cnn\", channels = [8, 8, 8, 8] }"),
                "train.model.channels: 4 conv blocks each halve the 8x8 image; at most 3 fit",
            ),
            (
                CNN.replace("model = \"cnn\"", "model = { kind = \"cnn\", channels = [] }"),
                "train.model.channels: a CNN needs at least one conv layer",
            ),
            (CNN.replace("\"digits\"", "\"synthetic\""), ""),
            (
                CNN.replace("\"digits\"", "\"synthetic\"") + "[train.data]\nfeatures = 50",
                "model \"cnn\" needs square images, but \"synthetic\" has 50 features",
            ),
        ];
        check_all(&cases);
    }

    #[test]
    fn defaults_are_filled_in() {
        let j = parse_job(MLP, "JOB.toml").expect("valid");
        let t = &j.train;
        assert_eq!((t.model.kind, t.model.hidden(), t.model.dropout()), (ModelKind::Mlp, &[128, 64][..], 0.0));
        assert_eq!(
            (t.strategy, t.optimizer, t.schedule, t.seed),
            (Strategy::Ddp, OptimizerKind::Adamw, Schedule::Cosine, 0)
        );
        assert_eq!((t.weight_decay(), t.betas(), t.eps(), t.momentum()), (0.01, [0.9, 0.999], 1e-8, 0.0));
        assert_eq!((t.grad_accum, t.warmup_steps, t.min_lr, t.clip_grad_norm), (1, 0, 0.0, None));
        assert_eq!((t.eval_every, t.eval_batches, t.bucket_mb, t.log_every), (0, 8, 25.0, 1));
        assert_eq!(t.bucket_bytes(), 25 << 20);
        assert_eq!(t.overlap, Overlap::Auto);
        assert_eq!(parse_job(&mlp("overlap = \"off\"", ""), "J").expect("valid").train.overlap, Overlap::Off);
        assert_eq!(t.data, Options::default());
        assert_eq!(j.checkpoint, CheckpointSpec { every: 0, keep: 3, memory_every: 0, url: None, resume_from: None });
        assert_eq!(t.data_shape().expect("known"), DataShape { kind: Kind::Image, features: 64, classes: 10 });
        // 64*128+128 + 128*64+64 + 64*10+10
        assert_eq!(t.model.param_count(64, 10), 8320 + 8256 + 650);

        let sgd = parse_job(&mlp("optimizer = \"sgd\"", ""), "x").expect("valid");
        assert_eq!((sgd.train.momentum(), sgd.train.weight_decay()), (0.9, 0.0));

        let g = parse_job(GPT, "g").expect("valid");
        let m = &g.train.model;
        assert_eq!((m.layers(), m.heads(), m.width(), m.context(), m.vocab()), (2, 4, 64, 64, 256));
        assert_eq!(g.train.data_options().context, Some(64));
        assert_eq!(g.train.data_shape().expect("known"), DataShape { kind: Kind::Text, features: 64, classes: 256 });
        let d = 64u64;
        assert_eq!(m.param_count(0, 0), 256 * d + 64 * d + 2 * (12 * d * d + 13 * d) + 2 * d + d * 256 + 256);

        let c = parse_job(CNN, "c").expect("valid");
        assert_eq!(c.train.model.channels(), &[16, 32]);
        // conv 1->16: 9*16+16, conv 16->32: 144*32+32, head 32*2*2 -> 10
        assert_eq!(c.train.model.param_count(64, 10), 160 + 4640 + 1290);
        assert_eq!(ModelSpec::image_side(784), Some(28));
        assert_eq!(ModelSpec::image_side(50), None);
    }

    #[test]
    fn memory_budget_is_named() {
        let j = parse_job(MLP, "JOB.toml").expect("valid");
        let need = j.train.memory_bytes().expect("known");
        assert_eq!(need, u128::from(j.train.model.param_count(64, 10)) * 16);
        j.validate_with_memory(Some(need as u64)).expect("fits exactly");
        let e = j.validate_with_memory(Some(need as u64 - 1)).expect_err("too big");
        assert_eq!(e.path, "train.model");
        assert!(e.message.contains("about 17.2K parameters need about 0.3 MiB"), "{e}");
        j.validate_with_memory(None).expect("no budget, no check");
    }

    #[test]
    fn world_size_needs_a_share_per_rank() {
        let j = parse_job(&mlp("grad_accum = 4", ""), "x").expect("valid");
        j.validate_world(8).expect("32 / 4 = 8 per micro-batch");
        let e = j.validate_world(9).expect_err("too many");
        assert_eq!(e.path, "train.global_batch");
        assert!(
            e.to_string().contains("32 / grad_accum 4 = 8 samples per micro-batch cannot be shared among 9"),
            "{e}"
        );
        assert!(j.validate_world(0).is_err());
    }

    #[test]
    fn platform_quantities_are_bounded_and_named() {
        let cases: Vec<(String, &str)> = vec![
            (mlp("", "[resources]\ngpus = 1\ngpu_memory = \"10GiB\""), ""),
            (mlp("", "[resources]\ngpus = 0.5\ngpu_memory = \"10GiB\""), ""),
            (mlp("", "[resources]\ngpu_memory = \"10GiB\""), "resources.gpu_memory: 10737418240 bytes of GPU memory"),
            (mlp("", "[resources]\ngpus = 0\ngpu_memory = 1"), "resources.gpu_memory: 1 bytes of GPU memory asked"),
            (mlp("", "[workers]\nmax = 4294967295"), "workers.max: 4294967295 workers is more than the limit of 65536"),
            (mlp("", "[workers]\nmin = 65537"), "workers.min: 65537 workers is more than the limit"),
            (mlp("", "[workers]\ncount = 70000"), "workers.count: 70000 workers is more than the limit"),
            (mlp("", "[workers]\nmax = 65536"), ""),
            (
                mlp("", "[resources]\ngpus = 1\ngpu_memory = 18446744073709551616"),
                "resources.gpu_memory: 18446744073709551616 is too large: at most 1 EiB",
            ),
            (
                mlp("", "[resources]\ncpus = 18446744073709551616"),
                "resources.cpus: 18446744073709551616 is too large: at most 1000000000",
            ),
            (
                mlp("", "[resources]\nmemory = -18446744073709551616"),
                "resources.memory: -18446744073709551616 is negative",
            ),
            (
                mlp("", "[resources]\ngpus = 1\ngpu_memory = \"18446744073709551616\""),
                "resources.gpu_memory: \"18446744073709551616\" is too large",
            ),
            (mlp("", "[resources]\nmemory = \"2000000TiB\""), "resources.memory: \"2000000TiB\" is too large"),
            (
                mlp("", "[resources]\nmemory = 1.8446744073709552e19"),
                "resources.memory: 18446744073709552000 is too large",
            ),
            (
                mlp("", "[resources]\ncpus = \"18446744073709551616m\""),
                "resources.cpus: \"18446744073709551616m\" is too large",
            ),
            (mlp("", "[resources]\ncpus = 9223372036854775807"), "resources.cpus: 9223372036854775807 is too large"),
            (mlp("", "[resources]\ncpus = 1e300"), "resources.cpus: 1e300 is too large"),
        ];
        check_all(&cases);
        // JSON numbers past u64 arrive as floats: refused, not saturated to u64::MAX.
        let json = r#"{"name": "j", "resources": {"gpus": 1, "gpu_memory": 18446744073709551616},
            "train": {"model": "mlp", "dataset": "digits", "global_batch": 8, "steps": 1, "lr": 0.1}}"#;
        let e = parse_job_json(json).expect_err("too large");
        assert_eq!(e.path, "resources.gpu_memory", "{e}");
        assert!(e.message.contains("too large"), "{e}");
    }

    #[test]
    fn phases_are_read_checked_and_resolve_by_step() {
        let two = "[workers]\ncount = 4\n[[phases]]\nuntil_step = 6\n[[phases]]\n[phases.workers]\ncount = 1\n\
                   [phases.resources]\ncpus = 2";
        let cases: Vec<(String, &str)> = vec![
            (mlp("", two), ""),
            (mlp("", "[[phases]]\nuntil_step = 6\n[[phases]]\nuntil_step = 6"), "phases[1].until_step: 6 is not after"),
            (mlp("", "[[phases]]\n[[phases]]\nuntil_step = 8"), "phases[0].until_step: is needed on every phase"),
            (mlp("", "[[phases]]\nuntil_step = 10"), "phases[0].until_step: 10 is not before train.steps (10)"),
            (mlp("", "[[phases]]\nuntil_step = 3\n[phases.workers]\ncount = 0"), "phases[0].workers.count: must be"),
            (mlp("", "[[phases]]\nuntil_step = 3\n[phases.workers]\ncount = 64"), "phases[0].workers: "),
            (mlp("", "[[phases]]\nuntil_step = 3\nworkers_count = 2"), "unknown field `workers_count`"),
        ];
        check_all(&cases);
        let spec = parse_job(&mlp("", two), "JOB.toml").expect("valid");
        assert_eq!((spec.phase_at(0), spec.phase_at(5), spec.phase_at(6), spec.phase_at(9)), (0, 0, 1, 1));
        assert_eq!((spec.phase_end(0), spec.phase_end(5), spec.phase_end(6)), (Some(6), Some(6), None));
        assert_eq!(spec.in_phase(0).workers.range(), (4, 4));
        let late = spec.in_phase(1);
        assert_eq!((late.workers.range(), late.resources.cpus), ((1, 1), 2000));
        let plain = parse_job(MLP, "JOB.toml").expect("valid");
        assert_eq!((plain.phase_at(3), plain.phase_end(3)), (0, None));
        assert_eq!(plain.in_phase(0), plain);
    }

    #[test]
    fn the_expected_run_time_is_read_and_checked() {
        let cases: Vec<(String, &str)> = vec![
            (format!("expected_runtime = \"90m\"\n{MLP}"), ""),
            (format!("expected_runtime = 3600\n{MLP}"), ""),
            (format!("expected_runtime = \"0s\"\n{MLP}"), "expected_runtime: must be more than 0s"),
            (format!("expected_runtime = \"9000h\"\n{MLP}"), "expected_runtime: \"9000h\" is too long: at most 7 days"),
            (format!("expected_runtime = \"soon\"\n{MLP}"), "expected_runtime:"),
        ];
        check_all(&cases);
        let j = parse_job(&format!("expected_runtime = \"90m\"\n{MLP}"), "JOB.toml").expect("valid");
        assert_eq!(j.expected_runtime.map(|t| t.0.as_secs()), Some(5400));
        assert_eq!(parse_job(MLP, "JOB.toml").expect("valid").expected_runtime, None);
    }

    #[test]
    fn fault_tolerance_is_read_checked_and_the_old_table_is_refused() {
        let cases: Vec<(String, &str)> = vec![
            (mlp("", "[fault_tolerance]\npolicy = \"none\""), ""),
            (
                mlp(
                    "",
                    "[workers]\nmin = 1\nmax = 4\n[fault_tolerance]\npolicy = \"elastic\"\nmax_restarts = 5\n\
                     backoff = \"500ms\"\nheartbeat_timeout = \"3s\"\nhang_timeout = \"2m\"\nreplace_stragglers = true",
                ),
                "",
            ),
            (mlp("", "[fault_tolerance]\npolicy = \"retry\""), "fault_tolerance.policy: unknown variant `retry`"),
            (mlp("", "[fault_tolerance]\nbackoff = \"2 parsecs\""), "fault_tolerance.backoff:"),
            (mlp("", "[fault_tolerance]\nbackoff = \"-2s\""), "fault_tolerance.backoff: \"-2s\" is negative"),
            (mlp("", "[fault_tolerance]\nbackoff = \"2h\""), "fault_tolerance.backoff: 7200s is too long"),
            (mlp("", "[fault_tolerance]\nhang_timeout = \"8d\""), "fault_tolerance.hang_timeout:"),
            (
                mlp("", "[fault_tolerance]\nhang_timeout = \"300ms\""),
                "fault_tolerance.hang_timeout: 300ms is too short",
            ),
            (mlp("", "[fault_tolerance]\nheartbeat_timeout = 0"), "fault_tolerance.heartbeat_timeout: 0s is too short"),
            (mlp("", "[fault_tolerance]\nmax = 3"), "fault_tolerance.max: unknown field `max`"),
            (mlp("", "[restart]\nmax = 3"), "JOB.toml: restart: `[restart]` was replaced by `[fault_tolerance]`"),
        ];
        check_all(&cases);
        let json = r#"{"name": "j", "restart": {"max": 1},
            "train": {"model": "mlp", "dataset": "digits", "global_batch": 8, "steps": 1, "lr": 0.1}}"#;
        let e = parse_job_json(json).expect_err("the old table");
        assert_eq!(e.path, "restart", "{e}");
        assert!(e.message.contains("[fault_tolerance]") && e.message.contains("max_restarts"), "{e}");

        let d = parse_job(MLP, "JOB.toml").expect("valid").fault_tolerance;
        assert_eq!(d, FaultToleranceSpec::default());
        assert_eq!((d.policy, d.max_restarts, d.replace_stragglers), (FaultPolicy::Restart, 3, false));
        assert_eq!((d.backoff.0.as_secs(), d.heartbeat_timeout.0.as_secs(), d.hang_timeout.0.as_secs()), (2, 10, 60));
        let mut waits = Vec::new();
        let mut last = None;
        for _ in 0..4 {
            let w = d.next_backoff(last, false);
            waits.push(w.as_secs());
            last = Some(w);
        }
        assert_eq!(waits, vec![2, 4, 8, 16], "the backoff doubles while attempts complete no step");
        assert_eq!(d.next_backoff(last, true).as_secs(), 2, "and starts again after an attempt that trained");
        let long = Some(std::time::Duration::from_secs(3000));
        assert_eq!(d.next_backoff(long, false).as_secs(), 3600, "it stops at an hour");
        // The defaults are spelled out and read back the same.
        let text = parse_job(MLP, "JOB.toml").expect("valid").resolved().to_toml().expect("TOML");
        assert!(text.contains("[fault_tolerance]") && text.contains("hang_timeout = \"60s\""), "{text}");
        let half = parse_job(&mlp("", "[fault_tolerance]\nbackoff = 0.5"), "JOB.toml").expect("valid");
        assert_eq!(half.fault_tolerance.backoff.to_string(), "500ms");
        let back = parse_job(&half.to_toml().expect("TOML"), "JOB.toml").expect("reads back");
        assert_eq!(back, half);
    }

    #[test]
    fn resolved_specs_spell_out_every_default_and_read_back_the_same() {
        let specs = [
            MLP.to_owned(),
            GPT.to_owned(),
            CNN.to_owned(),
            mlp("optimizer = \"sgd\"", ""),
            CNN.replace("\"cnn\"", "\"vit\""),
        ];
        for text in &specs {
            let spec = parse_job(text, "JOB.toml").unwrap_or_else(|e| panic!("{e}"));
            let r = spec.resolved();
            let t = &r.train;
            assert_eq!(t.weight_decay, Some(spec.train.weight_decay()));
            match t.optimizer {
                OptimizerKind::Sgd => assert_eq!((t.momentum, t.betas, t.eps), (Some(0.9), None, None)),
                OptimizerKind::Adamw => {
                    assert_eq!((t.momentum, t.betas, t.eps), (None, Some([0.9, 0.999]), Some(1e-8)))
                }
            }
            assert_eq!(t.model.dropout, Some(0.0));
            match t.model.kind {
                ModelKind::Mlp => assert_eq!(t.model.hidden.as_deref(), Some(&[128, 64][..])),
                ModelKind::Cnn => assert_eq!(t.model.channels.as_deref(), Some(&[16, 32][..])),
                ModelKind::Gpt => {
                    assert_eq!((t.model.layers, t.model.vocab, t.data.context), (Some(2), Some(256), Some(64)))
                }
                ModelKind::Vit => assert_eq!((t.model.layers, t.model.patch), (Some(2), Some(4))),
            }
            let toml_text = r.to_toml().unwrap_or_else(|e| panic!("{e}"));
            let back = parse_job(&toml_text, "resolved.toml").unwrap_or_else(|e| panic!("{e}\n{toml_text}"));
            assert_eq!(back, r, "{toml_text}");
            assert_eq!(r.resolved(), r);
            assert_eq!(r.train.data_shape().ok(), spec.train.data_shape().ok());
        }
    }

    #[test]
    fn every_independent_problem_is_reported() {
        let text = MLP.replace("\"t\"", "\"a b\"").replace("steps = 10", "steps = 0")
            + "[checkpoint]\nkeep = 0\n[resources]\ngpu_memory = \"1GiB\"\n";
        let spec = deserialize_toml(&text).unwrap_or_else(|e| panic!("{e}"));
        let paths: Vec<String> = spec.problems_with_memory(None).into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["name", "resources.gpu_memory", "train.steps", "checkpoint.keep"]);
        let e = parse_job(&text, "JOB.toml").expect_err("invalid");
        assert_eq!(e.path, "name", "validate returns the first problem");
        let dir = std::env::temp_dir().join(format!("shoal-spec-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("job.toml");
        std::fs::write(&file, &text).expect("write");
        let all = check_job(&file).expect_err("invalid");
        assert_eq!(all.len(), 4);
        assert!(all.iter().all(|e| e.origin == file.display().to_string()), "{all:?}");
        std::fs::write(&file, "name = \n").expect("write");
        assert_eq!(check_job(&file).expect_err("syntax").len(), 1);
        std::fs::write(&file, MLP).expect("write");
        assert_eq!(check_job(&file).expect("valid"), load_job(&file).expect("valid"));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_global_batch_larger_than_the_training_set_is_refused() {
        let train_len =
            data::check("digits", &Options { split: Split::Train, ..Options::default() }).expect("digits").len;
        let at_most = MLP.replace("global_batch = 32", &format!("global_batch = {train_len}"));
        parse_job(&at_most, "JOB.toml").unwrap_or_else(|e| panic!("{e}"));
        let over = MLP.replace("global_batch = 32", &format!("global_batch = {}", train_len + 1));
        let e = parse_job(&over, "JOB.toml").expect_err("larger than the data");
        assert_eq!(e.path, "train.global_batch");
        assert!(
            e.message.contains(&format!("{} is larger than the {train_len} training samples", train_len + 1)),
            "{e}"
        );
        let synthetic = MLP.replace("\"digits\"", "\"synthetic\"") + "[train.data]\nsamples = 16\nfeatures = 4\n";
        let e = parse_job(&synthetic, "JOB.toml").expect_err("16 samples");
        assert!(e.to_string().contains("train.global_batch: 32 is larger than the 16 training samples"), "{e}");
    }

    #[test]
    fn errors_have_paths_lines_and_origin() {
        let e = parse_job(&MLP.replace("steps = 10", "steps = \"ten\""), "JOB.toml").expect_err("type");
        assert_eq!((e.path.as_str(), e.line), ("train.steps", Some(7)));
        assert_eq!(e.to_string(), "JOB.toml: train.steps: invalid type: string \"ten\", expected usize (line 7)");
        let e = parse_job(&MLP.replace("steps = 10", "steps = 0"), "JOB.toml").expect_err("zero");
        assert_eq!(e.to_string(), "JOB.toml: train.steps: must be > 0");
        let e = load_job(Path::new("/nonexistent/job.toml")).expect_err("missing");
        assert!(e.to_string().starts_with("/nonexistent/job.toml: cannot read the job spec"), "{e}");
    }

    #[test]
    fn json_is_the_same_spec() {
        let toml_spec = parse_job(GPT, "g").expect("valid");
        let json = serde_json::to_string(&toml_spec).expect("serialises");
        assert_eq!(parse_job_json(&json).expect("valid json"), toml_spec);
        let short = r#"{"name": "j", "train": {"model": "mlp", "dataset": "digits", "global_batch": 8, "steps": 1, "lr": 0.1}}"#;
        assert_eq!(parse_job_json(short).expect("valid").train.model, ModelSpec::new(ModelKind::Mlp));
        let e = parse_job_json(&short.replace("\"steps\"", "\"stpes\"")).expect_err("unknown");
        assert!(e.to_string().starts_with("job.json: train.stpes: unknown field `stpes`"), "{e}");
        let e = parse_job_json(&short.replace("\"mlp\"", "{\"kind\": \"mlp\", \"hiden\": []}")).expect_err("unknown");
        assert_eq!(e.path, "train.model.hiden", "{e}");
        let e = parse_job_json("{\"name\": ").expect_err("malformed");
        assert!(e.to_string().starts_with("job.json: name: EOF while parsing a value (line 1)"), "{e}");
        let e = parse_job_json("{\"name\": \"j\",, }").expect_err("malformed");
        assert!(e.to_string().contains("(line 1)"), "{e}");
        let e = parse_job_json(&format!("{short} x")).expect_err("trailing");
        assert!(e.to_string().contains("trailing characters"), "{e}");
        // TOML round trip too.
        let text = toml::to_string(&toml_spec).expect("toml");
        assert_eq!(parse_job(&text, "round-trip").expect("valid"), toml_spec);
    }

    #[test]
    fn examples_parse_and_validate() {
        let examples = [
            ("mlp_digits.toml", include_str!("../../../examples/mlp_digits.toml")),
            ("gpt_cicero.toml", include_str!("../../../examples/gpt_cicero.toml")),
            ("cnn_digits.toml", include_str!("../../../examples/cnn_digits.toml")),
            ("mlp_synthetic.toml", include_str!("../../../examples/mlp_synthetic.toml")),
        ];
        for (file, text) in examples {
            let spec = parse_job(text, file).unwrap_or_else(|e| panic!("{e}"));
            spec.validate_world(2).unwrap_or_else(|e| panic!("{e}"));
            assert!(text.contains(&format!("Run with: cargo run --release -p shoal -- run -n 2 examples/{file}")));
        }
        // Any other job in examples/ must be valid too.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        let entries = std::fs::read_dir(&dir).map(|d| d.filter_map(|e| e.ok()).collect::<Vec<_>>()).unwrap_or_default();
        for entry in entries {
            let path = entry.path();
            if path.extension().is_some_and(|x| x == "toml") {
                load_job(&path).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}
