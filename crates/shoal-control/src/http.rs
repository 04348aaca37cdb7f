//! What every HTTP handler shares: the application state, the authenticated caller, request limits, and the
//! checks that turn a request's path and query into a job the caller may see.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequestParts, Path, Query};
use axum::http::StatusCode;
use axum::http::request::Parts;

use crate::api_error::{ApiError, ApiResult};
use crate::auth::hash_token;
use crate::control::Control;
use crate::db::{JobRow, Principal};

/// How long a client may take to send a request's body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// The largest request body accepted (a job spec or a metrics batch).
pub const MAX_BODY: usize = 1 << 20;

/// The most of a log one request returns (and one chunk of a followed log holds): a reader, however slow, holds
/// at most this much of the server's memory.
pub const MAX_LOG_CHUNK: usize = 1 << 20;

/// What every handler sees.
#[derive(Debug, Clone)]
pub struct AppState {
    pub control: Arc<Control>,
    /// Whether requests must carry a token (always, except a loopback server started without auth).
    pub auth: bool,
}

pub(crate) fn body(b: std::result::Result<Bytes, BytesRejection>) -> ApiResult<Bytes> {
    b.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(format!("at most {MAX_BODY} bytes"))
        } else {
            ApiError::bad(format!("cannot read the request body: {e}"))
        }
    })
}

pub(crate) fn query<T>(q: std::result::Result<Query<T>, QueryRejection>) -> ApiResult<T> {
    q.map(|Query(t)| t).map_err(|e| ApiError::bad(format!("bad query string: {}", e.body_text())))
}

/// The job an endpoint under `/api/v1/jobs/{id}` is about (for the OpenAPI document: `params(JobPath)`).
#[derive(Debug, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub struct JobPath {
    /// The job's id: `j-` and 8 hex digits.
    pub id: String,
}

/// A job id from the path; one that does not even decode (`%FF`) is no job either.
pub(crate) fn job_id(p: std::result::Result<Path<String>, PathRejection>) -> ApiResult<String> {
    p.map(|Path(id)| id).map_err(|e| ApiError::not_found(format!("no such job: {}", e.body_text())))
}

/// Job ids are `j-` and 8 hex digits; anything else is not a job (and never reaches a file path).
fn valid_id(id: &str) -> ApiResult<()> {
    let ok = id.len() == 10 && id.starts_with("j-") && id[2..].bytes().all(|b| b.is_ascii_hexdigit());
    if ok { Ok(()) } else { Err(ApiError::not_found(format!("no job {id:?} (job ids look like j-0123abcd)"))) }
}

/// The job, if it exists and the caller may see it (another team's job is reported as missing).
pub(crate) async fn visible_job(state: &AppState, caller: &Caller, id: &str) -> ApiResult<JobRow> {
    valid_id(id)?;
    match state.control.db.job(id).await? {
        Some(j) if caller.may_access(&j.team) => Ok(j),
        _ => Err(ApiError::not_found(format!("no job {id}"))),
    }
}

/// The authenticated caller of a request.
#[derive(Debug, Clone)]
pub struct Caller(pub Principal);

impl Caller {
    /// Whether the caller may see and act on a job of `team`.
    pub fn may_access(&self, team: &str) -> bool {
        self.0.admin || self.0.team == team
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> std::result::Result<Self, Self::Rejection> {
        if !state.auth {
            return Ok(Caller(Principal { user: "local".into(), team: "default".into(), admin: true }));
        }
        // A browser's EventSource cannot set headers: the event streams (and only they) accept `access_token` in
        // the query instead. Query strings are never logged.
        let from_query = parts
            .uri
            .query()
            .filter(|_| parts.uri.path().ends_with("/stream"))
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("access_token=")).map(str::to_owned));
        let token = match (parts.headers.get(axum::http::header::AUTHORIZATION), from_query) {
            (Some(header), _) => {
                let value =
                    header.to_str().map_err(|_| ApiError::unauthorized("the Authorization header is not text"))?;
                value
                    .strip_prefix("Bearer ")
                    .ok_or_else(|| ApiError::unauthorized("the Authorization header must be `Bearer TOKEN`"))?
                    .trim()
                    .to_owned()
            }
            (None, Some(t)) => t,
            (None, None) => {
                return Err(ApiError::unauthorized(
                    "no `Authorization: Bearer TOKEN` header (event streams also take an `access_token` query \
                     parameter)",
                ));
            }
        };
        let token = token.as_str();
        let principal = state
            .control
            .db
            .find_token(&hash_token(token))
            .await?
            .ok_or_else(|| ApiError::unauthorized("unknown token"))?;
        Ok(Caller(principal))
    }
}
