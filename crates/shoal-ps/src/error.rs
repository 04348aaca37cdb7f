//! Errors of the parameter server's pieces.

/// What went wrong, named so that the caller can say which input was at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PsError {
    /// Bad arguments: sizes that disagree, a rule asked to tolerate more attackers than it can.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

pub type Result<T> = std::result::Result<T, PsError>;
