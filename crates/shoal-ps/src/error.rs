//! Errors of the parameter server's pieces.

/// What went wrong, named so that the caller can say which input was at fault.
#[derive(Debug, thiserror::Error)]
pub enum PsError {
    /// Bad arguments: sizes that disagree, a rule asked to tolerate more attackers than it can.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A connection between a worker and a server failed, or a peer broke the protocol.
    #[error(transparent)]
    Comm(#[from] shoal_comm::Error),
    /// A server refused a request, or did not answer it in time; the message names the server and why.
    #[error("{0}")]
    Server(String),
    /// A server's shard could not be saved or restored.
    #[error("parameter server checkpoint: {0}")]
    Checkpoint(String),
}

pub type Result<T> = std::result::Result<T, PsError>;
