//! What the hub's handlers and its rounds share: the board of the open round and the connected clients, who a
//! request's token belongs to, and the bodies of numbers (one line of JSON, then little-endian values).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use crate::Real;

/// How recently a client must have been heard from to count as connected (a polling client is heard from at least
/// every [`MAX_WAIT`]).
pub const LIVE: Duration = Duration::from_secs(45);
/// The longest a `task` request is held open.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

pub(super) fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The round open for updates.
pub(super) struct Open {
    pub(super) round: usize,
    /// The global model as the `task` body sends it.
    pub(super) body: axum::body::Bytes,
    pub(super) sampled: Vec<usize>,
    pub(super) fetched: Vec<bool>,
    /// The updates that arrived: the client, its samples, its loss and update.
    pub(super) updates: BTreeMap<usize, (f64, f64, Vec<Real>)>,
    /// Under secure aggregation: the protocol's state (the updates come masked, through it).
    pub(super) secure: Option<SecureRound>,
}

#[derive(Default)]
pub(super) struct Board {
    pub(super) seen: Vec<Option<Instant>>,
    pub(super) open: Option<Open>,
    pub(super) done: Option<Instant>,
    /// Bytes of the bodies received and sent.
    pub(super) bytes: u64,
}

pub(super) struct Shared {
    pub(super) names: Vec<String>,
    pub(super) tokens: HashMap<[u8; 32], usize>,
    pub(super) state: Mutex<Board>,
    /// Bumped when a round opens or the job ends: what waiting `task` requests watch.
    pub(super) changed: tokio::sync::watch::Sender<u64>,
    /// The `join` answer but for the client's own name and index.
    pub(super) spec: serde_json::Value,
    pub(super) rounds: usize,
    pub(super) sigma: Option<f64>,
    pub(super) parameters: usize,
}

impl Shared {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Board> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The client a request's token belongs to (and it is heard from now).
    pub(super) fn caller(&self, headers: &HeaderMap) -> std::result::Result<usize, Response> {
        let token = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let Some(token) = token else {
            return Err(refuse(StatusCode::UNAUTHORIZED, "no `Authorization: Bearer TOKEN` header"));
        };
        let Some(&client) = self.tokens.get(&hash(token)) else {
            tracing::warn!("a federated request with an unknown token refused");
            return Err(refuse(StatusCode::UNAUTHORIZED, "unknown token"));
        };
        self.lock().seen[client] = Some(Instant::now());
        Ok(client)
    }
}

pub(super) fn refuse(status: StatusCode, message: &str) -> Response {
    (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
}

/// A JSON line, then the values as little-endian f32: the body of a model or an update.
pub(super) fn encode(head: &serde_json::Value, values: &[Real]) -> Vec<u8> {
    let mut out = head.to_string().into_bytes();
    out.push(b'\n');
    out.reserve(values.len() * 4);
    // `Real` is f64 in an `f64` build: the wire takes f32 either way.
    #[allow(clippy::unnecessary_cast)]
    for v in values {
        out.extend_from_slice(&(*v as f32).to_le_bytes());
    }
    out
}

/// The JSON line and the values of a body [`encode`] made; `None` when it is not one.
pub(super) fn decode(body: &[u8]) -> Option<(serde_json::Value, Vec<Real>)> {
    let cut = body.iter().position(|&b| b == b'\n')?;
    let head = serde_json::from_slice(&body[..cut]).ok()?;
    let rest = &body[cut + 1..];
    if !rest.len().is_multiple_of(4) {
        return None;
    }
    let values = rest.chunks_exact(4).map(|c| Real::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect();
    Some((head, values))
}

/// The hub's view of one round's protocol.
#[derive(Debug, Default)]
pub(super) struct SecureRound {
    /// Each client's mask and cipher public keys.
    pub(super) keys: BTreeMap<usize, ([u8; 32], [u8; 32])>,
    pub(super) roster: Option<Vec<usize>>,
    /// Sealed shares by sender: (receiver, bytes).
    pub(super) sealed: BTreeMap<usize, Vec<(usize, Vec<u8>)>>,
    pub(super) u2: Option<Vec<usize>>,
    pub(super) masked: BTreeMap<usize, Vec<i32>>,
    pub(super) u3: Option<Vec<usize>>,
    /// Revealed shares by revealer: (about whom, share).
    pub(super) reveals: BTreeMap<usize, Vec<(usize, [u64; 5])>>,
}

impl SecureRound {
    /// Whether `client` may still take part: its keys not posted, the roster not fixed.
    pub(super) fn open_to(&self, client: usize) -> bool {
        self.roster.is_none() && !self.keys.contains_key(&client)
    }
}

impl Shared {
    /// Holds a request until `answer` has one (checked now and each time the board changes), for `wait` seconds
    /// (default 10, at most [`MAX_WAIT`]); then `204`.
    pub(super) async fn long_poll(&self, wait: Option<f64>, mut answer: impl FnMut() -> Option<Response>) -> Response {
        let wait = Duration::from_secs_f64(wait.unwrap_or(10.0).clamp(0.0, MAX_WAIT.as_secs_f64()));
        let until = tokio::time::Instant::now() + wait;
        let mut changed = self.changed.subscribe();
        loop {
            if let Some(r) = answer() {
                return r;
            }
            match tokio::time::timeout_at(until, changed.changed()).await {
                Ok(Ok(())) => continue,
                _ => return StatusCode::NO_CONTENT.into_response(),
            }
        }
    }
}
