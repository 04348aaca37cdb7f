//! `shoal-data`: Shoal's data plane — datasets, their partitioning across ranks, the distributed sampler, the
//! prefetching loader, and data where it lives in object stores ([`lake`]).
//!
//! # Invariants
//!
//! - This crate knows nothing of tensors: samples are plain `Vec<f32>` features or `Vec<u32>` tokens with a
//!   label ([`Sample`]); turning a [`Batch`] into tensors is the trainer's job.
//! - A [`Dataset`]'s `get(i)` is a pure function of `i`, and every shuffle and every synthetic sample comes from
//!   this crate's own fixed generator keyed by explicit seeds: the same bits in every process and on every
//!   platform, so ranks agree without talking and a run can be resumed exactly.
//! - The sampler's cursor ([`SamplerState`]) counts *global* samples consumed in an epoch, so a checkpoint taken
//!   at one world size resumes at another with the same global batch.
//! - Under dynamic sharding ([`shards`]) the order is no longer the seed's alone, but the rows every rank trained on
//!   by a step boundary follow from the shares and what each rank published to the coordinator, so a checkpoint's
//!   [`shards::Ledger`] resumes with every row trained on exactly once an epoch.
//! - Nothing waits without a deadline: the loader's threads wait in slices of at most 50 ms and stop when the
//!   loader is dropped; its consumer gives up after a timeout.
//! - Built-in data ships inside crates (`smartcore`'s digits, `lipsum`'s Cicero); nothing is downloaded.
//! - Data in an object store is read where it lives, by ranged or streamed requests, never copied to local disk
//!   first; a location opens in one place ([`lake::open_store`]), with the stores' own environment variables.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use shoal_data::{builtin, DistributedSampler, Loader, LoaderConfig, Options, SamplerConfig};
//!
//! # fn main() -> shoal_data::Result<()> {
//! let digits: Arc<dyn shoal_data::Dataset> = Arc::from(builtin("digits", &Options::default())?);
//! // Rank 1 of 2, global batch 64: this rank takes 32 samples of each global batch.
//! let sampler = DistributedSampler::new(SamplerConfig::new(digits.len(), 64), 2, 1)?;
//! let mut loader = Loader::new(digits, sampler.epoch_batches(), LoaderConfig::default())?;
//! let batch = loader.next_batch()?.expect("an epoch has batches");
//! let (pixels, width) = batch.dense().expect("digits are dense");
//! assert_eq!((batch.samples.len(), width, pixels.len()), (32, 64, 32 * 64));
//! assert_eq!(batch.next.position, 64); // a checkpoint here records 64 global samples consumed
//! println!("waited {:?} for data", loader.stats().last_wait);
//! # Ok(())
//! # }
//! ```

mod builtin;
pub mod clients;
mod dataset;
mod error;
pub mod lake;
mod loader;
mod partition;
pub mod rng;
mod sampler;
pub mod shards;
mod stream;

pub use builtin::{ByteText, Digits, Synthetic, builtin};
pub use dataset::{
    Dataset, DatasetInfo, Features, IterableDataset, Kind, Label, Sample, SampleIter, Streamed, Subset, shard_stream,
    train_eval_split,
};
pub use error::{Error, Result};
pub use loader::{Batch, Loader, LoaderConfig, LoaderStats};
pub use partition::{Partition, block};
pub use sampler::{
    CyclingBatches, DistributedSampler, EpochBatches, LANE_WINDOW, Lanes, RankBatch, SamplerConfig, SamplerState,
    Shares, Tail, weighted_share,
};
pub use shoal_spec::data::{Options, Split, catalogue};
pub use stream::TextFile;
