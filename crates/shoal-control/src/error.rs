//! Errors of the control plane. API errors carry the HTTP status, a message and, when one value is at fault, its
//! key path (`train.steps`, `resources.gpus`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// A bad request: the message says what, `field` names the key when one is at fault.
    #[error("{message}")]
    BadRequest { message: String, field: Option<String> },
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    #[error("forbidden: {0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("request body too large: {0}")]
    TooLarge(String),
    /// The client was too slow (a request body that does not arrive in time).
    #[error("request timeout: {0}")]
    Timeout(String),
    /// The caller holds too many of something at once (event streams).
    #[error("too many requests: {0}")]
    TooMany(String),
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

    pub fn status(&self) -> StatusCode {
        match self {
            ControlError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ControlError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ControlError::Forbidden(_) => StatusCode::FORBIDDEN,
            ControlError::NotFound(_) => StatusCode::NOT_FOUND,
            ControlError::Conflict(_) => StatusCode::CONFLICT,
            ControlError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ControlError::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            ControlError::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
            ControlError::Config(_)
            | ControlError::Db(_)
            | ControlError::Io(_)
            | ControlError::Exec(_)
            | ControlError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(error = %self, "request failed");
        }
        let field = match &self {
            ControlError::BadRequest { field, .. } => field.clone(),
            _ => None,
        };
        let body = serde_json::json!({ "error": self.to_string(), "field": field, "status": status.as_u16() });
        (status, axum::Json(body)).into_response()
    }
}
