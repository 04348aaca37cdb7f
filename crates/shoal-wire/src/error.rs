//! The API's error body: `{"error": "...", "code": "invalid_spec", "field": "train.steps" | null, "status": 400}`.
//!
//! `code` is stable and machine-readable (clients branch on it, never on the message); `error` is for people;
//! `field` names the key path when one value is at fault; `status` repeats the HTTP status.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// What went wrong, as a client can act on it. Each code has one HTTP status ([`ErrorCode::status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: the request is malformed (its body, query or a parameter); `field` names the parameter when one is.
    BadRequest,
    /// 400: the submitted job spec is refused (syntax, a bad value, what the policy or the cluster cannot give);
    /// `field` names its key path (`train.steps`, `resources.gpus`) when one value is at fault.
    InvalidSpec,
    /// 401: no token, or one the server does not know.
    Unauthorized,
    /// 403: the caller may not do this (not an admin, another team).
    Forbidden,
    /// 404: no such job (another team's job looks missing too) or endpoint.
    NotFound,
    /// 405: the endpoint exists, not with this method.
    MethodNotAllowed,
    /// 409: the request conflicts with the job's state (cancelling a finished job).
    Conflict,
    /// 413: the request body is over the server's limit.
    PayloadTooLarge,
    /// 408: the request body did not arrive in time.
    RequestTimeout,
    /// 429: the caller holds too many of something at once (event streams).
    TooManyRequests,
    /// 500: the server failed (its database, its disk, starting processes); the message says what.
    Internal,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 11] = [
        ErrorCode::BadRequest,
        ErrorCode::InvalidSpec,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::Conflict,
        ErrorCode::PayloadTooLarge,
        ErrorCode::RequestTimeout,
        ErrorCode::TooManyRequests,
        ErrorCode::Internal,
    ];

    /// The code as it is written in the JSON body.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::InvalidSpec => "invalid_spec",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::Conflict => "conflict",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::RequestTimeout => "request_timeout",
            ErrorCode::TooManyRequests => "too_many_requests",
            ErrorCode::Internal => "internal",
        }
    }

    /// The HTTP status an error of this code is answered with.
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::BadRequest | ErrorCode::InvalidSpec => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::Conflict => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::RequestTimeout => 408,
            ErrorCode::TooManyRequests => 429,
            ErrorCode::Internal => 500,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Every error response of the API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong, for people.
    pub error: String,
    /// What went wrong, for programs.
    pub code: ErrorCode,
    /// The key path of the value at fault (`train.steps`, `rank`), when one is.
    pub field: Option<String>,
    /// The HTTP status, repeated.
    pub status: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_written_as_documented_and_read_back() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_string(&code).expect("serialize");
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).expect("deserialize"), code);
            assert!((400..600).contains(&code.status()), "{code}");
        }
    }

    #[test]
    fn the_body_keeps_its_null_field() {
        let b = ErrorBody { error: "no job j-1".into(), code: ErrorCode::NotFound, field: None, status: 404 };
        let v = serde_json::to_value(&b).expect("serialize");
        assert_eq!(v, serde_json::json!({ "error": "no job j-1", "code": "not_found", "field": null, "status": 404 }));
    }
}
