//! The crate's one error type.

use std::time::Duration;

/// Everything that can go wrong in `shoal-data`. Every variant carries the facts needed to act on it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A sample index past the end of a dataset.
    #[error("index {index} is out of range for dataset `{dataset}` of {len} samples")]
    OutOfRange { dataset: String, index: usize, len: usize },
    /// No built-in dataset has this name.
    #[error("unknown dataset `{name}`; the built-in datasets are: {known}")]
    UnknownDataset { name: String, known: String },
    /// A dataset option with a value that cannot be used, or one that does not apply.
    #[error("dataset `{dataset}`: option `{option}`: {reason}")]
    BadOption { dataset: String, option: &'static str, reason: String },
    /// A bad argument to a partition, sampler or loader (world size, rank, batch size, state...).
    #[error("{what}: {reason}")]
    Invalid { what: &'static str, reason: String },
    /// Fetching one sample of a batch failed; `index` is the dataset index that failed.
    #[error("loading sample {index} (batch {seq}) failed: {source}")]
    Load {
        seq: u64,
        index: usize,
        #[source]
        source: Box<Error>,
    },
    /// The loader waited longer than its timeout for the next batch.
    #[error("timed out after {waited:?} waiting for batch {seq} from the loader's threads")]
    Timeout { seq: u64, waited: Duration },
    /// Every loader thread exited (panicked) before the batch came.
    #[error("the loader's threads are gone (a panic in Dataset::get?) before batch {seq} was produced")]
    LoaderGone { seq: u64 },
    /// Reading a data source failed.
    #[error("reading {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A location in an object store that cannot be opened or listed, or names nothing usable.
    #[error("{url}: {why}")]
    Lake { url: String, why: String },
    /// The coordinator of dynamic sharding failed or holds what cannot be.
    #[error("the shard coordinator: {what}: {reason}")]
    Coordinator { what: String, reason: String },
    /// A data source's content is not what was expected.
    #[error("malformed data in {what}: {reason}")]
    Malformed { what: String, reason: String },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Error {
    Error::Invalid { what, reason: reason.into() }
}

impl From<shoal_spec::data::DataError> for Error {
    fn from(e: shoal_spec::data::DataError) -> Self {
        match e {
            shoal_spec::data::DataError::Unknown { name, known } => Error::UnknownDataset { name, known },
            shoal_spec::data::DataError::BadOption { dataset, option, reason } => {
                Error::BadOption { dataset, option, reason }
            }
        }
    }
}
