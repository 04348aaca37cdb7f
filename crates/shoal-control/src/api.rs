//! The HTTP+JSON API under `/api/v1/`, and `GET /healthz`.
//!
//! Every error is JSON, `{"error": "...", "field": "train.steps" | null, "status": 400}`, with a 4xx status for
//! anything the caller can fix (a bad spec names the key path; an oversized body is a 413; an unknown job a 404);
//! a handler never panics on input.
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/healthz` | liveness and the database in use |
//! | GET | `/api/v1/whoami` | the caller's user, team and role |
//! | POST | `/api/v1/tokens` | (admin) a new token for `{"user", "team", "admin"}` |
//! | POST | `/api/v1/jobs` | submit a spec (JSON, or TOML with `Content-Type: application/toml`) → `{"id"}` |
//! | GET | `/api/v1/jobs?state=&team=&limit=` | the caller's team's jobs (an admin's: all, or `team`) |
//! | GET | `/api/v1/jobs/{id}` | status: state, restarts, workers (rank, pid, host, state), events, summary |
//! | POST | `/api/v1/jobs/{id}/cancel` | cancel (a running job's workers get SIGTERM, then SIGKILL) |
//! | GET | `/api/v1/jobs/{id}/logs?rank=&attempt=&offset=&follow=` | a worker's output; `follow=true` streams it |
//! | GET | `/api/v1/jobs/{id}/events?after=` | transitions and notable facts, oldest first |
//! | POST | `/api/v1/jobs/{id}/metrics` | ingest `{"metrics": [{"rank", "step", "time_ms", "data"}]}` |
//! | GET | `/api/v1/jobs/{id}/metrics?rank=&after=&limit=` | stored per-step metrics |
//! | GET | `/api/v1/queues` | queues with their guarantees and what they hold |
//! | GET | `/api/v1/nodes` | nodes with capacity and allocation |

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::{hash_token, new_token};
use crate::db::{JobRow, JobState, MetricRow, Principal, now};
use crate::error::{ControlError, Result};
use crate::http::{AppState, Caller, MAX_BODY, MAX_LOG_CHUNK, body, query, visible_job};
use crate::view::{job_json, job_view, nodes_json, queues_json};

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/api/v1/whoami", get(whoami))
        .route("/api/v1/tokens", post(create_token))
        .route("/api/v1/jobs", post(submit).get(list_jobs))
        .route("/api/v1/jobs/{id}", get(job_status))
        .route("/api/v1/jobs/{id}/cancel", post(cancel))
        .route("/api/v1/jobs/{id}/logs", get(logs))
        .route("/api/v1/jobs/{id}/events", get(events))
        .route("/api/v1/jobs/{id}/metrics", get(get_metrics).post(post_metrics))
        .route("/api/v1/queues", get(queues))
        .route("/api/v1/nodes", get(nodes))
        .route("/api/v1/overview", get(crate::observe::overview))
        .route("/api/v1/overview/stream", get(crate::observe::overview_stream))
        .route("/api/v1/jobs/{id}/samples", get(crate::observe::samples))
        .route("/api/v1/jobs/{id}/stream", get(crate::observe::job_stream))
        .route("/api/v1/jobs/{id}/diagnosis", get(crate::observe::diagnosis))
        .route("/api/v1/cost", get(crate::observe::cost))
        .route("/metrics", get(crate::observe::prometheus))
        .route("/", get(crate::observe::index))
        .route("/assets/{*path}", get(crate::observe::asset))
        .fallback(|| async { ControlError::NotFound("no such endpoint; the API lives under /api/v1/".into()) })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn(body_deadline))
        .layer(axum::middleware::from_fn_with_state(state.clone(), crate::observe::count_requests))
        .with_state(state)
}

/// Reads every request's body (at most [`MAX_BODY`]) within [`crate::http::BODY_TIMEOUT`]: a client that sends
/// less than its `Content-Length`, or trickles it, is answered 408 and its connection freed, instead of being held
/// open by a handler waiting for the rest.
async fn body_deadline(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return ControlError::TooLarge(format!("at most {MAX_BODY} bytes")).into_response();
    }
    let (parts, b) = req.into_parts();
    match tokio::time::timeout(crate::http::BODY_TIMEOUT, axum::body::to_bytes(b, MAX_BODY)).await {
        Ok(Ok(bytes)) => next.run(axum::extract::Request::from_parts(parts, Body::from(bytes))).await,
        Ok(Err(e)) if std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>()) => {
            ControlError::TooLarge(format!("at most {MAX_BODY} bytes")).into_response()
        }
        Ok(Err(e)) => ControlError::bad(format!("cannot read the request body: {e}")).into_response(),
        Err(_) => ControlError::Timeout(format!(
            "the request body did not arrive within {} s",
            crate::http::BODY_TIMEOUT.as_secs()
        ))
        .into_response(),
    }
}

async fn healthz(State(state): State<AppState>) -> Response {
    Json(json!({ "ok": true, "database": state.control.db.backend() })).into_response()
}

use axum::Json;

async fn whoami(caller: Caller) -> Json<Principal> {
    Json(caller.0)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewToken {
    user: String,
    team: String,
    #[serde(default)]
    admin: bool,
}

fn valid_label(field: &str, v: &str) -> Result<()> {
    if v.is_empty() || v.len() > 64 || !v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')) {
        return Err(ControlError::bad_field(field, format!("{v:?}: 1-64 letters, digits, '.', '_' or '-'")));
    }
    Ok(())
}

async fn create_token(
    State(state): State<AppState>,
    caller: Caller,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    if !caller.0.admin {
        return Err(ControlError::Forbidden("only an admin creates tokens".into()));
    }
    let b = body(b)?;
    let req: NewToken = serde_json::from_slice(&b).map_err(|e| ControlError::bad(format!("token request: {e}")))?;
    valid_label("user", &req.user)?;
    valid_label("team", &req.team)?;
    let token = new_token();
    let p = Principal { user: req.user, team: req.team, admin: req.admin };
    state.control.db.insert_token(&hash_token(&token), &p).await?;
    Ok((StatusCode::CREATED, Json(json!({ "token": token, "user": p.user, "team": p.team, "admin": p.admin })))
        .into_response())
}

async fn submit(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    let b = body(b)?;
    let text = std::str::from_utf8(&b).map_err(|_| ControlError::bad("the job spec is not UTF-8 text"))?;
    let is_toml = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|ct| ct.contains("toml"));
    let spec = if is_toml { shoal_spec::parse_job(text, "job.toml") } else { shoal_spec::parse_job_json(text) }
        .map_err(|e| {
            let field = (!e.path.is_empty()).then(|| e.path.clone());
            ControlError::BadRequest { message: e.to_string(), field }
        })?;
    let control = &state.control;
    if !control.queues.iter().any(|q| q.name == spec.queue) {
        let names: Vec<&str> = control.queues.iter().map(|q| q.name.as_str()).collect();
        return Err(ControlError::bad_field(
            "queue",
            format!("no queue {:?}; the queues are: {}", spec.queue, names.join(", ")),
        ));
    }
    control.admissible(&caller.0.team, &spec)?;
    let spec_json =
        serde_json::to_string(&spec).map_err(|e| ControlError::Internal(format!("serializing the spec: {e}")))?;
    let id = loop {
        let token = new_token();
        let id = format!("j-{}", &token[6..14]);
        if control.db.job(&id).await?.is_none() {
            break id;
        }
    };
    let dir = control.job_dir(&id);
    let place = control.config.policy.admit(&caller.0.team, &dir, &spec)?;
    let jobs_dir = control.config.data_dir.join("jobs");
    if let Some(owner) = control.config.policy.resume_source(&caller.0.team, &dir, &jobs_dir, &spec)? {
        // Another job's checkpoint: only one of the caller's own team (another team's job looks missing).
        let theirs = control.db.job(&owner).await?;
        if theirs.is_none_or(|j| j.team != caller.0.team) {
            return Err(ControlError::bad_field(
                "checkpoint.resume_from",
                format!("no job {owner} of team {} to resume from", caller.0.team),
            ));
        }
    }
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("job.json"), &spec_json)?;
    if let crate::policy::CheckpointPlace::Local(p) = &place {
        control.exec.task_dir(p)?;
    }
    let (lo, hi) = spec.workers.range();
    let row = JobRow {
        id: id.clone(),
        name: spec.name.clone(),
        user: caller.0.user.clone(),
        team: caller.0.team.clone(),
        queue: spec.queue.clone(),
        priority: i64::from(spec.priority),
        state: JobState::Pending,
        spec: spec_json,
        // Derived from the id under the server's key when needed (`Control::job_secret`); nothing stored.
        secret: String::new(),
        restarts: 0,
        attempt: 0,
        workers: i64::from(lo),
        created_ms: now(),
        started_ms: None,
        finished_ms: None,
        reason: format!(
            "submitted by {} ({}) to queue {}: {} worker{} × {} CPU, {} MiB memory{}",
            caller.0.user,
            caller.0.team,
            spec.queue,
            if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") },
            if hi == 1 { "" } else { "s" },
            spec.resources.cpus as f64 / 1000.0,
            spec.resources.memory >> 20,
            if spec.resources.gpus > 0 {
                format!(", {} GPU", spec.resources.gpus as f64 / 1000.0)
            } else {
                String::new()
            }
        ),
        cancel_requested: false,
        summary: None,
        // One job per checkpoint location (a unique column): a job resumes only its own checkpoints.
        checkpoint_key: place.key(),
    };
    control.db.insert_job(&row).await?;
    control.wake.notify_one();
    tracing::info!(job = %id, name = %spec.name, team = %caller.0.team, "job submitted");
    Ok((StatusCode::CREATED, Json(json!({ "id": id, "state": "pending", "name": spec.name }))).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    /// The token, for clients that cannot set headers (see [`Caller`]).
    #[serde(default, rename = "access_token")]
    _token: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    team: Option<String>,
    #[serde(default)]
    limit: Option<i64>,
}

async fn list_jobs(
    State(state): State<AppState>,
    caller: Caller,
    q: std::result::Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<Value>> {
    let q = query(q)?;
    let mut states = Vec::new();
    for s in q.state.iter().flat_map(|s| s.split(',')).filter(|s| !s.is_empty()) {
        states.push(JobState::parse(s).ok_or_else(|| {
            ControlError::bad_field(
                "state",
                format!("no state {s:?}; one of pending, running, preempted, succeeded, failed, cancelled"),
            )
        })?);
    }
    let team = match (&q.team, caller.0.admin) {
        (Some(t), true) => Some(t.clone()),
        (None, true) => None,
        (Some(t), false) if *t != caller.0.team => {
            return Err(ControlError::Forbidden(format!("you are in team {}, not {t}", caller.0.team)));
        }
        (_, false) => Some(caller.0.team.clone()),
    };
    let limit = q.limit.unwrap_or(1000).clamp(1, 100_000);
    let jobs = state.control.db.jobs(team.as_deref(), &states, limit).await?;
    Ok(Json(json!({ "jobs": jobs.iter().map(job_json).collect::<Vec<_>>() })))
}

async fn job_status(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>> {
    let job = visible_job(&state, &caller, &id).await?;
    Ok(Json(job_view(&state.control, &job).await?))
}

async fn cancel(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Response> {
    let job = visible_job(&state, &caller, &id).await?;
    if job.state.is_final() {
        return Err(ControlError::Conflict(format!("job {id} already {}", job.state.as_str())));
    }
    state.control.db.request_cancel(&id).await?;
    state.control.db.event(&id, "cancel", job.state, &format!("cancel requested by {}", caller.0.user)).await?;
    state.control.wake.notify_one();
    Ok((StatusCode::ACCEPTED, Json(json!({ "id": id, "state": job.state, "cancel_requested": true }))).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LogQuery {
    /// The token, for clients that cannot set headers (see [`Caller`]).
    #[serde(default, rename = "access_token")]
    _token: Option<String>,
    #[serde(default)]
    rank: Option<i64>,
    #[serde(default)]
    attempt: Option<i64>,
    #[serde(default)]
    offset: Option<u64>,
    #[serde(default)]
    follow: Option<bool>,
}

async fn logs(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    q: std::result::Result<Query<LogQuery>, QueryRejection>,
) -> Result<Response> {
    let q = query(q)?;
    let job = visible_job(&state, &caller, &id).await?;
    let rank = q.rank.unwrap_or(0);
    if rank < 0 || rank >= job.workers.max(1) {
        return Err(ControlError::bad_field("rank", format!("job {id} has ranks 0..{}", job.workers.max(1) - 1)));
    }
    let attempt = match q.attempt {
        None => job.attempt,
        Some(a) if (1..=job.attempt).contains(&a) => a,
        Some(a) if job.attempt == 0 => {
            return Err(ControlError::bad_field("attempt", format!("{a}: job {id} has not started yet")));
        }
        Some(a) => {
            return Err(ControlError::bad_field("attempt", format!("{a}: job {id} has attempts 1..={}", job.attempt)));
        }
    };
    let path = state.control.exec.log_path(&id, attempt, rank);
    let offset = q.offset.unwrap_or(0);
    if !q.follow.unwrap_or(false) {
        // At most MAX_LOG_CHUNK per request, whatever the file's size: `x-log-next` says where to continue,
        // `x-log-size` how long the log is now.
        let (data, size) = crate::control::read_from_async(path, offset, MAX_LOG_CHUNK).await?;
        let next = offset.min(size) + data.len() as u64;
        return Ok((
            [
                (header::CONTENT_TYPE, "text/plain; charset=utf-8".to_owned()),
                (header::HeaderName::from_static("x-log-size"), size.to_string()),
                (header::HeaderName::from_static("x-log-next"), next.to_string()),
            ],
            data,
        )
            .into_response());
    }
    let control = state.control.clone();
    let stream = futures_util::stream::unfold((offset, false), move |(pos, done)| {
        let control = control.clone();
        let path = path.clone();
        let id = id.clone();
        async move {
            if done {
                return None;
            }
            loop {
                let (data, _) =
                    crate::control::read_from_async(path.clone(), pos, MAX_LOG_CHUNK).await.unwrap_or_default();
                if !data.is_empty() {
                    let next = pos + data.len() as u64;
                    return Some((Ok::<Bytes, std::io::Error>(Bytes::from(data)), (next, false)));
                }
                let finished = match control.db.job(&id).await {
                    Ok(Some(j)) => j.state.is_final() || j.attempt > attempt,
                    _ => true,
                };
                if finished {
                    return Some((Ok(Bytes::new()), (pos, true)));
                }
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
        }
    });
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], Body::from_stream(stream)).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AfterQuery {
    /// The token, for clients that cannot set headers (see [`Caller`]).
    #[serde(default, rename = "access_token")]
    _token: Option<String>,
    #[serde(default)]
    after: Option<i64>,
}

async fn events(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    q: std::result::Result<Query<AfterQuery>, QueryRejection>,
) -> Result<Json<Value>> {
    let q = query(q)?;
    let job = visible_job(&state, &caller, &id).await?;
    let ev = state.control.db.events(&job.id, q.after.unwrap_or(0)).await?;
    Ok(Json(json!({ "events": ev })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricsBatch {
    metrics: Vec<MetricRow>,
}

async fn post_metrics(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Json<Value>> {
    let b = body(b)?;
    let job = visible_job(&state, &caller, &id).await?;
    let batch: MetricsBatch =
        serde_json::from_slice(&b).map_err(|e| ControlError::bad(format!("metrics batch: {e}")))?;
    if let Some((i, m)) = batch.metrics.iter().enumerate().find(|(_, m)| m.rank < 0 || m.step < 0) {
        return Err(ControlError::bad_field(
            format!("metrics[{i}]"),
            format!("rank {} step {}: must be >= 0", m.rank, m.step),
        ));
    }
    let n = state.control.db.insert_metrics(&job.id, &batch.metrics).await?;
    Ok(Json(json!({ "stored": n })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricsQuery {
    /// The token, for clients that cannot set headers (see [`Caller`]).
    #[serde(default, rename = "access_token")]
    _token: Option<String>,
    #[serde(default)]
    rank: Option<i64>,
    #[serde(default)]
    after: Option<i64>,
    #[serde(default)]
    limit: Option<i64>,
    #[serde(default)]
    max_points: Option<usize>,
}

async fn get_metrics(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    q: std::result::Result<Query<MetricsQuery>, QueryRejection>,
) -> Result<Json<Value>> {
    let q = query(q)?;
    let job = visible_job(&state, &caller, &id).await?;
    let m = state
        .control
        .db
        .metrics(&job.id, q.rank, q.after.unwrap_or(-1), q.limit.unwrap_or(1_000_000).clamp(1, 10_000_000))
        .await?;
    let m = match q.max_points {
        Some(n) => crate::observe::downsample(m, n.max(2)),
        None => m,
    };
    Ok(Json(json!({ "metrics": m })))
}

async fn queues(State(state): State<AppState>, _caller: Caller) -> Result<Json<Value>> {
    Ok(Json(json!({ "queues": queues_json(&state.control).await? })))
}

async fn nodes(State(state): State<AppState>, _caller: Caller) -> Result<Json<Value>> {
    Ok(Json(json!({ "nodes": nodes_json(&state.control) })))
}
