//! Checkpoints: parameters and optimizer state in safetensors, plus a JSON
//! manifest written last and atomically.
//!
//! Layout under a run's output directory `root`:
//!
//! ```text
//! root/checkpoints/step-000100/model.safetensors      tensors by parameter name, F32, little-endian
//! root/checkpoints/step-000100/optimizer.safetensors  optimizer state by name, F32, little-endian
//! root/checkpoints/step-000100/manifest.json          step, epoch, sampler, RNG, world size, strategy,
//!                                                     extra, size + sha256 of every file
//! root/checkpoints/step-000200.tmp-<pid>/             a save in progress (or left by a crash)
//! ```
//!
//! A save writes both tensor files into `step-NNNNNN.tmp-<pid>`, fsyncs each
//! file and the directory, renames the directory to `step-NNNNNN`, fsyncs
//! `checkpoints/`, then writes `manifest.json.tmp`, fsyncs it, renames it to
//! `manifest.json` and fsyncs the step directory. A checkpoint is valid only if
//! its manifest parses and every file it lists has the listed size and sha256;
//! readers skip anything else with a warning naming the offending file.
//!
//! The module knows nothing about tensors libraries: callers hand it flat
//! `Real` buffers ([`TensorData`]). Corrupt input never panics; it is an error
//! naming the file. Nothing here waits without a bound.
//!
//! One concern a file, each using only the files listed before it:
//! - `error.rs`: [`CheckpointError`], naming the file concerned;
//! - `layout.rs`: the names in the tree above (subdirectory, files, step and temp directories);
//! - `direct.rs`: the chunked writer (`O_DIRECT` from aligned buffers where the filesystem allows it) and the disk
//!   probes ([`measure_disk_write`], [`measure_disk_write_direct`]);
//! - `manifest.rs`: [`Manifest`], [`ManifestMeta`], [`FileEntry`]; reading a manifest and checking files against
//!   it (size, sha256);
//! - `format.rs`: [`TensorData`] in safetensors files, written while a second thread hashes them, and parsed back;
//! - `dir.rs`: [`CheckpointDir`] — atomic saves, verified loads, the newest valid checkpoint, pruning;
//! - `saver.rs`: [`AsyncSaver`], the background saver thread with its reused snapshot buffers, and the [`Mirror`]
//!   it uploads to;
//! - `inspect.rs`: [`inspect`] — where a path given as a checkpoint leads (a step, or a run's newest valid one),
//!   what the checkpoint holds (manifest, every tensor with shape, dtype, size and layout: shards onto full
//!   tensors) and the status of each step, read without loading the tensors;
//! - `consolidate.rs`: [`consolidate`] — a verified checkpoint's full tensors by parameter name in one
//!   safetensors file, written atomically;
//! - `memory.rs`: [`MemoryStore`], the same checkpoints kept in shared memory on the host (`/dev/shm`), one
//!   directory per job and host, for restarts that read no storage.

mod consolidate;
mod dir;
mod direct;
mod error;
mod format;
mod inspect;
mod layout;
mod manifest;
mod memory;
mod saver;
#[cfg(test)]
mod testing;

pub use consolidate::{ConsolidateOptions, Consolidated, OPTIMIZER_PREFIX, WrittenTensor, consolidate};
pub use dir::{CheckpointDir, Loaded, SaveStats};
pub use direct::{measure_disk_write, measure_disk_write_direct};
pub use error::{CheckpointError, Result};
pub use format::{TensorData, tensors_of};
pub use inspect::{Inspection, Part, PartTotals, Shard, StepStatus, TensorLayout, Totals, inspect};
pub(crate) use layout::parse_step_name;
pub use layout::{CHECKPOINTS_SUBDIR, MANIFEST_FILE, MODEL_FILE, OPTIMIZER_FILE};
pub use manifest::{FORMAT_VERSION, FileEntry, Manifest, ManifestMeta};
pub use memory::{MEMORY_KEEP, MemoryCopy, MemoryStore};
pub use saver::{AsyncSaver, Mirror};
