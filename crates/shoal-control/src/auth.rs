//! Bearer tokens: random, shown once, stored only as their SHA-256. A token maps to a user, a team and whether it
//! is an admin; a user sees and acts on its own team's jobs only, an admin on all.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::api::AppState;
use crate::db::Principal;
use crate::error::ControlError;

/// A new token: `shoal_` and 32 random bytes in hex.
pub fn new_token() -> String {
    let mut b = [0u8; 32];
    rand::rng().fill_bytes(&mut b);
    format!("shoal_{}", hex(&b))
}

/// A job's secret: HMAC-SHA256 of its id under the server's key, in hex. Nothing secret about a job is stored; a
/// server with the same key derives the same secret after a restart (adopted workers keep authenticating).
pub fn derive_secret(key: &[u8], job_id: &str) -> String {
    use hmac::Mac;
    let Ok(mut mac) = hmac::Hmac::<Sha256>::new_from_slice(key) else {
        unreachable!("HMAC accepts keys of any length")
    };
    mac.update(b"shoal job secret\0");
    mac.update(job_id.as_bytes());
    hex(&mac.finalize().into_bytes())
}

pub fn hash_token(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
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
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
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
                let value = header
                    .to_str()
                    .map_err(|_| ControlError::Unauthorized("the Authorization header is not text".into()))?;
                value
                    .strip_prefix("Bearer ")
                    .ok_or_else(|| {
                        ControlError::Unauthorized("the Authorization header must be `Bearer TOKEN`".into())
                    })?
                    .trim()
                    .to_owned()
            }
            (None, Some(t)) => t,
            (None, None) => {
                return Err(ControlError::Unauthorized(
                    "no `Authorization: Bearer TOKEN` header (event streams also take an `access_token` query \
                     parameter)"
                        .into(),
                ));
            }
        };
        let token = token.as_str();
        let principal = state
            .control
            .db
            .find_token(&hash_token(token))
            .await?
            .ok_or_else(|| ControlError::Unauthorized("unknown token".into()))?;
        Ok(Caller(principal))
    }
}
