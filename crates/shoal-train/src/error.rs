//! The one error type of `shoal-train`.

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while training.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Comm(#[from] shoal_comm::Error),
    #[error(transparent)]
    Data(#[from] shoal_data::Error),
    #[error(transparent)]
    Ps(#[from] shoal_ps::PsError),
    #[error("job spec: {0}")]
    Spec(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A stop asked from outside (SIGTERM), taken at a step boundary by every rank with a checkpoint there: not a
    /// failure of the run, which resumes from that checkpoint.
    #[error("stopped on request after step {step}, with a checkpoint there")]
    Stopped { step: usize },
    /// The job's own program (`train.command`) failed: the rank exits with its status (`code`).
    #[error("train.command `{program}` {how}")]
    Program { program: String, code: i32, how: String },
}

impl Error {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }
}
