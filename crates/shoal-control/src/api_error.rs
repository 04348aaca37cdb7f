//! The HTTP layer's error: what a handler answers when it cannot do what was asked — a stable machine-readable
//! [`ErrorCode`], a message for people and, when one value is at fault, its key path; written as the JSON
//! [`ErrorBody`] with the code's HTTP status. Every library error a handler meets converts into it (`?` works on
//! the logic's [`ControlError`], sqlx, io, `shoal_exec` and `shoal_spec` errors): a refusal the caller can fix is
//! a 4xx, anything else an `internal` 500, logged here.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use shoal_wire::{ErrorBody, ErrorCode};

use crate::error::ControlError;

/// An error answer of the API.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    /// The key path of the value at fault (`train.steps`, `rank`), when one is.
    pub field: Option<String>,
}

pub type ApiResult<T> = std::result::Result<T, ApiError>;

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError { code, message: message.into(), field: None }
    }

    pub fn bad(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::BadRequest, message)
    }

    pub fn bad_field(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError { field: Some(field.into()), ..ApiError::bad(message) }
    }

    pub fn unauthorized(message: impl std::fmt::Display) -> Self {
        ApiError::new(ErrorCode::Unauthorized, format!("unauthorized: {message}"))
    }

    pub fn forbidden(message: impl std::fmt::Display) -> Self {
        ApiError::new(ErrorCode::Forbidden, format!("forbidden: {message}"))
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::NotFound, message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::Conflict, message)
    }

    pub fn too_large(message: impl std::fmt::Display) -> Self {
        ApiError::new(ErrorCode::PayloadTooLarge, format!("request body too large: {message}"))
    }

    pub fn timeout(message: impl std::fmt::Display) -> Self {
        ApiError::new(ErrorCode::RequestTimeout, format!("request timeout: {message}"))
    }

    pub fn too_many(message: impl std::fmt::Display) -> Self {
        ApiError::new(ErrorCode::TooManyRequests, format!("too many requests: {message}"))
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::Internal, message)
    }

    /// A refusal of a submitted job spec: what the logic refuses as a bad request (a value, the policy, what the
    /// cluster can never give) is an `invalid_spec`; a server failure stays `internal`.
    pub fn spec(e: impl Into<ApiError>) -> Self {
        let mut e = e.into();
        if e.code == ErrorCode::BadRequest {
            e.code = ErrorCode::InvalidSpec;
        }
        e
    }

    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: self.message.clone(),
            code: self.code,
            field: self.field.clone(),
            status: self.status().as_u16(),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}

impl std::error::Error for ApiError {}

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> Self {
        match e {
            ControlError::BadRequest { message, field } => ApiError { code: ErrorCode::BadRequest, message, field },
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        ControlError::from(e).into()
    }
}

impl From<std::io::Error> for ApiError {
    fn from(e: std::io::Error) -> Self {
        ControlError::from(e).into()
    }
}

impl From<shoal_exec::ExecError> for ApiError {
    fn from(e: shoal_exec::ExecError) -> Self {
        ControlError::from(e).into()
    }
}

impl From<shoal_spec::SpecError> for ApiError {
    fn from(e: shoal_spec::SpecError) -> Self {
        let field = (!e.path.is_empty()).then(|| e.path.clone());
        ApiError { code: ErrorCode::InvalidSpec, message: e.to_string(), field }
    }
}

/// The error answer of every endpoint that needs a token, for the OpenAPI document (`responses(AuthErrors)`).
#[derive(Debug, utoipa::IntoResponses)]
pub enum AuthErrors {
    /// No token, or an unknown one (`unauthorized`).
    #[response(status = 401)]
    Unauthorized(ErrorBody),
}

/// The error answers of every endpoint under `/api/v1/jobs/{id}`, for the OpenAPI document.
#[derive(Debug, utoipa::IntoResponses)]
pub enum JobErrors {
    /// No token, or an unknown one (`unauthorized`).
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// No such job, or one of another team (`not_found`).
    #[response(status = 404)]
    NotFound(ErrorBody),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(error = %self.message, code = %self.code, "request failed");
        }
        (status, axum::Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_errors_get_their_codes() {
        let e = ApiError::from(ControlError::bad_field("resources.gpus", "can never run"));
        assert_eq!((e.code, e.field.as_deref()), (ErrorCode::BadRequest, Some("resources.gpus")));
        assert_eq!(ApiError::spec(e).code, ErrorCode::InvalidSpec);
        let e = ApiError::from(ControlError::Internal("boom".into()));
        assert_eq!((e.code, e.status()), (ErrorCode::Internal, StatusCode::INTERNAL_SERVER_ERROR));
        assert_eq!(ApiError::spec(e).code, ErrorCode::Internal, "a server failure is not the spec's fault");
        let e = ApiError::from(std::io::Error::other("disk"));
        assert_eq!(e.code, ErrorCode::Internal);
        let e = ApiError::from(shoal_spec::parse_job_json("{\"name\": 1}").expect_err("a bad spec"));
        assert_eq!((e.code, e.status()), (ErrorCode::InvalidSpec, StatusCode::BAD_REQUEST));
        assert_eq!(e.field.as_deref(), Some("name"), "{e}");
    }

    #[test]
    fn every_code_has_its_status_in_the_body() {
        for code in ErrorCode::ALL {
            let b = ApiError::new(code, "x").body();
            assert_eq!((b.code, b.status), (code, code.status()));
        }
    }
}
