//! `shoal-train`: Shoal's training runtime on candle — models (MLP, CNN, GPT),
//! optimizers with checkpointable state, the data-parallel [`Trainer`], and the
//! worker that runs a job spec.
//!
//! Invariants:
//! - The model code knows nothing of distribution: the [`Trainer`] takes a
//!   model's [`Params`] and a `shoal_comm::Communicator` and does the rest. A
//!   model only declares its layers and goes through them one by one
//!   ([`layers`]), which is all a strategy that shards the parameters (ZeRO-3)
//!   needs to gather each layer just before its use.
//! - Every rank applies the same update to the same parameters, so the ranks'
//!   models stay identical (under a pipeline, each stage updates its own layers
//!   with gradients of the same global batch; under tensor parallelism, each rank
//!   its parts of every layer, and the replicated parameters identically from rank
//!   0's gradients); a run of N workers matches a run
//!   of one worker with the same global batch within floating-point tolerance.
//! - This crate talks to the control plane only over the wire and through the
//!   files it writes for it (metrics, heartbeats, the summary); it depends on
//!   none of the control plane, only on the wire types (`shoal-wire`).
//! - Nothing the control plane needs to hear runs on the training thread: the
//!   heartbeat is a thread of its own that the step loop only hands a number.
//! - A checkpoint is trusted only after its sha256 checks, in storage or in memory; a resume from an in-memory
//!   copy is exact like one from storage, and every rank resumes from the same step. The step loop never waits for
//!   an in-memory copy's save: a copy whose predecessor is still being written is skipped.
//!
//! - Every value of training — parameters, activations, gradients, optimizer state, what the collectives move —
//!   is a [`Real`]: `f32`, or `f64` in a build with the `f64` feature (`train.dtype = "f64"`), which tells rounding
//!   from a bug when two layouts are compared. The spec's validation refuses a `train.dtype` the build does not compute in.
//!
//! - The parameters, their gradients, the optimizer state and checkpoints are [`Real`] whatever `train.precision`
//!   says: a bf16 or f16 run casts the weights for its passes (`precision`), so checkpoints are the same format in
//!   every precision.
//!
//! - A task given GPUs computes on one (`device`) or is refused with an error naming `resources.gpus`; a task
//!   given none computes on the CPU. Under plain DDP on a GPU the parameters, their gradients and the optimizer's
//!   state are held on the device (`Params::set_resident`) and updated there by the same formula as on the host,
//!   bit for bit on the CPU; what crosses ranks is summed on the devices through NCCL where every rank has a GPU
//!   of its own (`strategy::DeviceAllReduce`, `train.collectives`), else staged through the host a bucket at a
//!   time into `shoal_comm`'s collectives (the host-staged path, which works with every transport). Under the other
//!   strategies that take a GPU the parameters and the optimizer stay on the host and the model copies the weights
//!   to the device for its passes.
//!
//! Feature flags: `failpoints` (fault-injection hooks), `f64` (compute in `f64`), `cuda` (candle's CUDA backend:
//! GPU compute), `nccl` (the NCCL communicator, [`nccl`]; implies `cuda`).

// In an f64 build the widenings of a `Real` to f64 are identities.
#![cfg_attr(feature = "f64", allow(clippy::useless_conversion, clippy::unnecessary_cast))]

pub mod batch;
pub mod checkpoint;
pub mod device;
pub mod dp;
pub mod error;
pub mod fed;
pub mod kernels;
pub mod layers;
pub mod memory;
pub mod models;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod optim;
pub mod params;
pub mod plan;
pub mod precision;
pub mod remote;
pub mod secagg;
pub use shoal_spec as spec;
pub mod strategy;
pub mod tensor_parallel;
pub mod trainer;
pub mod worker;

pub use error::{Error, Result};

/// The element type training computes in (see the invariants above).
#[cfg(not(feature = "f64"))]
pub type Real = f32;
/// The element type training computes in (see the invariants above).
#[cfg(feature = "f64")]
pub type Real = f64;
/// [`Real`] as a candle dtype.
#[cfg(not(feature = "f64"))]
pub const REAL_DTYPE: candle_core::DType = candle_core::DType::F32;
/// [`Real`] as a candle dtype.
#[cfg(feature = "f64")]
pub const REAL_DTYPE: candle_core::DType = candle_core::DType::F64;
/// Bytes of one [`Real`].
pub const REAL_BYTES: usize = std::mem::size_of::<Real>();
/// [`Real`]'s name in a job spec (`train.dtype`).
#[cfg(not(feature = "f64"))]
pub const REAL_NAME: &str = "f32";
/// [`Real`]'s name in a job spec (`train.dtype`).
#[cfg(feature = "f64")]
pub const REAL_NAME: &str = "f64";

// The spec's validation refuses the precision this build does not compute in: the two must agree.
const _: () = assert!(cfg!(feature = "f64") == matches!(spec::Dtype::BUILT, spec::Dtype::F64));
pub use layers::Layers;
pub use models::{Cnn, Gpt, GptConfig, HandBackward, Mlp, Model, Vit, VitConfig};
pub use optim::{AdamTerms, OptimConfig, Optimizer};
pub use params::{Params, SeededRng};
pub use trainer::{GradSink, StepTimes, Trainer, TrainerConfig, overlap_pays};
