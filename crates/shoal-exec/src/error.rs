//! Errors of the launch layer.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// A task's program could not be started.
    #[error("{0}")]
    Spawn(#[from] SpawnError),
    /// The executor's own configuration (task user, directories).
    #[error("{0}")]
    Config(String),
    /// A task was described in a way no process can be started from (an empty command line).
    #[error("{0}")]
    BadTask(String),
    /// The executor cannot tell now (its cluster manager does not answer); nothing is known to have changed.
    #[error("{0}")]
    Unavailable(String),
    /// Something this executor cannot do.
    #[error("{0}")]
    Unsupported(String),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

impl ExecError {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> ExecError {
        ExecError::Io { what: what.into(), source }
    }
}

pub type Result<T, E = ExecError> = std::result::Result<T, E>;

/// Why a rank's process could not be started.
#[derive(Debug)]
pub struct SpawnError {
    pub rank: usize,
    pub program: PathBuf,
    pub source: std::io::Error,
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.source.kind() {
            std::io::ErrorKind::NotFound => "not found".to_string(),
            std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
            _ => self.source.to_string(),
        };
        write!(f, "cannot start `{}` (rank {}): {what}", self.program.display(), self.rank)
    }
}

impl std::error::Error for SpawnError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}
