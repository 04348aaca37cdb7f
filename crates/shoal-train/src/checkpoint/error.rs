//! The checkpoint module's error type: every variant that concerns a file names it, so a corrupt or missing
//! checkpoint is reported by its file, never by a panic.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Errors of this module. Every variant that concerns a file carries its path.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// An I/O operation on `path` failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A file that a checkpoint needs does not exist.
    #[error("{}: missing", path.display())]
    Missing {
        /// The missing file.
        path: PathBuf,
    },
    /// A file exists but its contents are wrong.
    #[error("{}: corrupt: {why}", path.display())]
    Corrupt {
        /// The corrupt file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A path given as a checkpoint is none: neither a checkpoint nor a directory of them, or one without a valid
    /// checkpoint.
    #[error("{}: {why}", path.display())]
    NotACheckpoint {
        /// The path given.
        path: PathBuf,
        /// Why it is not one.
        why: String,
    },
    /// The caller passed tensors that cannot be saved.
    #[error("cannot save checkpoint: {why}")]
    InvalidInput {
        /// What is wrong.
        why: String,
    },
    /// A bounded wait ran out.
    #[error("timed out after {:.1}s waiting for {what}", waited.as_secs_f64())]
    Timeout {
        /// What was being waited for.
        what: String,
        /// How long we waited.
        waited: Duration,
    },
    /// The background saver thread could not be started or died.
    #[error("checkpoint saver thread: {why}")]
    SaverGone {
        /// What happened.
        why: String,
    },
    /// Mirroring to the object store failed (the local checkpoint is whole).
    #[error("checkpoint mirror: {why}")]
    Remote {
        /// What failed, naming the object URL.
        why: String,
    },
}

impl CheckpointError {
    /// The file or directory the error is about, if any.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Io { path, .. }
            | Self::Missing { path }
            | Self::Corrupt { path, .. }
            | Self::NotACheckpoint { path, .. } => Some(path),
            Self::InvalidInput { .. } | Self::Timeout { .. } | Self::SaverGone { .. } | Self::Remote { .. } => None,
        }
    }
}

/// Result of this module.
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

pub(super) fn io_err(path: &Path, source: io::Error) -> CheckpointError {
    CheckpointError::Io { path: path.to_path_buf(), source }
}

pub(super) fn open_err(path: &Path, source: io::Error) -> CheckpointError {
    if source.kind() == io::ErrorKind::NotFound {
        CheckpointError::Missing { path: path.to_path_buf() }
    } else {
        io_err(path, source)
    }
}

pub(super) fn corrupt(path: &Path, why: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt { path: path.to_path_buf(), why: why.into() }
}
