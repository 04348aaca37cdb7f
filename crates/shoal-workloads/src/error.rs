//! The workloads' errors.

/// What can go wrong in a workload.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting that cannot work, naming it.
    #[error("{0}")]
    InvalidArgument(String),
    /// The parameter servers failed (a server down past the deadline, a refused push).
    #[error(transparent)]
    Ps(#[from] shoal_ps::PsError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
