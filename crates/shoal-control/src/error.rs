//! Errors of the control plane's logic (store, control loop, policy, start-up). Nothing here knows HTTP: the API
//! turns them into responses with stable codes (`api_error.rs`): a `BadRequest` — something the caller can fix,
//! naming the key path when one value is at fault (`train.steps`, `resources.gpus`) — becomes a 4xx, everything
//! else a 500.

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Refused for something the caller can fix: the message says what, `field` names the key when one is at
    /// fault.
    #[error("{message}")]
    BadRequest { message: String, field: Option<String> },
    /// The server's own configuration (flags, data directory, database URL).
    #[error("{0}")]
    Config(String),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// Starting, probing or preparing tasks.
    #[error("executor: {0}")]
    Exec(#[from] shoal_exec::ExecError),
    #[error("internal: {0}")]
    Internal(String),
}

pub type Result<T, E = ControlError> = std::result::Result<T, E>;

impl ControlError {
    pub fn bad(message: impl Into<String>) -> Self {
        ControlError::BadRequest { message: message.into(), field: None }
    }

    pub fn bad_field(field: impl Into<String>, message: impl Into<String>) -> Self {
        ControlError::BadRequest { message: message.into(), field: Some(field.into()) }
    }
}
