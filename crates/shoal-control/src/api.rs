//! The HTTP+JSON API under `/api/v1/`, `GET /healthz`, and its OpenAPI 3 document.
//!
//! Request and response bodies are the `shoal-wire` types. Every error is JSON,
//! `{"error": "...", "code": "invalid_spec", "field": "train.steps" | null, "status": 400}`, with a 4xx status for
//! anything the caller can fix; a handler never panics on input. `code` is stable and machine-readable:
//!
//! | code | status | when |
//! |---|---|---|
//! | `bad_request` | 400 | a malformed body, query or parameter (`field` names the parameter when one is at fault) |
//! | `invalid_spec` | 400 | a submitted job spec is refused: syntax, a bad value, the storage policy, what the cluster can never give (`field` is its key path, `train.steps`, when one value is at fault) |
//! | `unauthorized` | 401 | no token, or an unknown one |
//! | `forbidden` | 403 | not allowed: not an admin, another team |
//! | `not_found` | 404 | no such job (another team's job looks missing too) or endpoint |
//! | `method_not_allowed` | 405 | the endpoint exists, not with this method |
//! | `conflict` | 409 | the job's state forbids it (cancelling a finished job) |
//! | `payload_too_large` | 413 | a body over 1 MiB |
//! | `request_timeout` | 408 | a body that does not arrive within 30 s |
//! | `too_many_requests` | 429 | more than 16 open event streams of one caller |
//! | `internal` | 500 | the server failed (database, disk, starting processes) |
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/healthz` | liveness and the database in use (no token) |
//! | GET | `/api/v1/openapi.json` | this API as an OpenAPI 3 document (no token) |
//! | GET | `/api/v1/whoami` | the caller's user, team and role |
//! | POST | `/api/v1/tokens` | (admin) a new token for `{"user", "team", "admin"}` |
//! | POST | `/api/v1/jobs` | submit a spec (JSON, or TOML with `Content-Type: application/toml`) → `{"id", "state", "name"}` |
//! | GET | `/api/v1/jobs?state=&team=&limit=` | the caller's team's jobs (an admin's: all, or `team`) |
//! | GET | `/api/v1/jobs/{id}` | status: state, restarts, workers (rank, pid, host, state), events, summary |
//! | POST | `/api/v1/jobs/{id}/cancel` | cancel (a running job's workers get SIGTERM, then SIGKILL) |
//! | GET | `/api/v1/jobs/{id}/logs?rank=&attempt=&offset=&follow=` | a worker's output (`text/plain`); `follow=true` streams it |
//! | GET | `/api/v1/jobs/{id}/events?after=` | transitions and notable facts, oldest first |
//! | POST | `/api/v1/jobs/{id}/metrics` | ingest `{"metrics": [{"rank", "step", "time_ms", "data"}]}` |
//! | GET | `/api/v1/jobs/{id}/metrics?rank=&after=&limit=&max_points=` | stored per-step metrics |
//! | GET | `/api/v1/jobs/{id}/samples?after=&max_points=` | resource samples of its workers |
//! | GET | `/api/v1/jobs/{id}/stream` | live job, metrics, samples and log events (`text/event-stream`) |
//! | GET | `/api/v1/jobs/{id}/diagnosis` | what holds it back |
//! | GET | `/api/v1/jobs/{id}/debug` | a running job's ranks now: collective, sequence number, time in it, silence |
//! | POST | `/api/v1/jobs/{id}/chaos` | kill (SIGKILL) or stop (SIGSTOP) one running worker `{"action", "rank"}` |
//! | GET | `/api/v1/queues` | queues with their guarantees and what they hold |
//! | GET | `/api/v1/nodes` | nodes with capacity and allocation |
//! | GET | `/api/v1/overview` | the cluster at a glance; `/api/v1/overview/stream` every 2 s (`text/event-stream`) |
//! | GET | `/api/v1/cost?team=&since=` | resource-hours and money per job and team |
//! | GET | `/metrics` | Prometheus text |
//!
//! The router is built from one table ([`endpoints`]); the OpenAPI document ([`ApiDoc`]) is generated from the
//! handlers' own annotations and types, and a test checks that it describes every row of the table.

use std::sync::OnceLock;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter};
use serde::Deserialize;
use shoal_wire::{
    CancelAccepted, ChaosDone, ChaosRequest, ErrorBody, EventList, HangDump, Health, Heartbeat, HeartbeatReply,
    JobDetail, JobList, MetricList, MetricsBatch, MetricsStored, NewToken, NodeList, QueueList, Submitted,
    TokenCreated, WhoAmI,
};
use utoipa::{IntoParams, OpenApi};

use crate::api_error::{ApiError, ApiResult, AuthErrors, JobErrors};
use crate::auth::{hash_token, new_token};
use crate::db::{JobRow, JobState, Principal};
use crate::http::{AppState, Caller, JobPath, MAX_BODY, MAX_LOG_CHUNK, body, job_id, query, visible_job};

/// Every endpoint: method, path and what serves it. The router is built from this table (with the dashboard's
/// pages), and the OpenAPI document must describe each row.
fn table() -> Vec<(Method, &'static str, MethodRouter<AppState>)> {
    use crate::observe;
    macro_rules! endpoints {
        ($($method:ident $path:literal => $handler:expr),* $(,)?) => {
            vec![$((Method::$method, $path, axum::routing::on(MethodFilter::$method, $handler))),*]
        };
    }
    endpoints![
        GET "/healthz" => healthz,
        GET "/api/v1/openapi.json" => openapi_json,
        GET "/api/v1/whoami" => whoami,
        POST "/api/v1/tokens" => create_token,
        POST "/api/v1/jobs" => submit,
        GET "/api/v1/jobs" => list_jobs,
        GET "/api/v1/jobs/{id}" => job_status,
        POST "/api/v1/jobs/{id}/cancel" => cancel,
        GET "/api/v1/jobs/{id}/logs" => logs,
        GET "/api/v1/jobs/{id}/events" => events,
        GET "/api/v1/jobs/{id}/metrics" => get_metrics,
        POST "/api/v1/jobs/{id}/metrics" => post_metrics,
        GET "/api/v1/jobs/{id}/samples" => observe::samples,
        GET "/api/v1/jobs/{id}/stream" => observe::job_stream,
        GET "/api/v1/jobs/{id}/diagnosis" => observe::diagnosis,
        GET "/api/v1/jobs/{id}/debug" => debug,
        POST "/api/v1/jobs/{id}/chaos" => chaos,
        POST "/api/v1/jobs/{id}/heartbeat" => heartbeat,
        GET "/api/v1/queues" => queues,
        GET "/api/v1/nodes" => nodes,
        GET "/api/v1/overview" => observe::overview,
        GET "/api/v1/overview/stream" => observe::overview_stream,
        GET "/api/v1/cost" => observe::cost,
        GET "/metrics" => observe::prometheus,
    ]
}

/// The method and path of every endpoint of the API (the dashboard's pages, `/` and `/assets/`, are not API).
pub fn endpoints() -> Vec<(Method, &'static str)> {
    table().into_iter().map(|(m, p, _)| (m, p)).collect()
}

pub fn router(state: AppState) -> Router {
    let mut r = Router::new();
    for (_, path, handler) in table() {
        r = r.route(path, handler);
    }
    r.route("/", axum::routing::get(crate::observe::index))
        .route("/assets/{*path}", axum::routing::get(crate::observe::asset))
        .fallback(|| async { ApiError::not_found("no such endpoint; the API lives under /api/v1/") })
        .method_not_allowed_fallback(|method: Method| async move {
            ApiError::new(shoal_wire::ErrorCode::MethodNotAllowed, format!("this endpoint does not take {method}"))
        })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn(body_deadline))
        .layer(axum::middleware::from_fn_with_state(state.clone(), crate::observe::count_requests))
        .with_state(state)
}

// ---------------------------------------------------------------------------------------------------------------
// the OpenAPI document

/// The API as an OpenAPI 3 document, from the handlers' annotations and the `shoal-wire` types.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "Shoal API",
        description = "Shoal's control plane: submit and follow training jobs, see the cluster. Errors are JSON \
                       `ErrorBody` objects with a stable `code`; a bearer token (`Authorization: Bearer TOKEN`) is \
                       needed everywhere but /healthz and this document."
    ),
    paths(
        healthz,
        openapi_json,
        whoami,
        create_token,
        submit,
        list_jobs,
        job_status,
        cancel,
        debug,
        chaos,
        heartbeat,
        logs,
        events,
        get_metrics,
        post_metrics,
        queues,
        nodes,
        crate::observe::samples,
        crate::observe::job_stream,
        crate::observe::diagnosis,
        crate::observe::overview,
        crate::observe::overview_stream,
        crate::observe::cost,
        crate::observe::prometheus,
    ),
    components(schemas(ErrorBody, shoal_wire::ErrorCode, shoal_wire::LogText, shoal_wire::Overview)),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    tags(
        (name = "jobs", description = "Submit, follow and cancel jobs"),
        (name = "cluster", description = "Queues, nodes, the overview, cost"),
        (name = "meta", description = "Health, tokens, this document, Prometheus metrics"),
    )
)]
pub struct ApiDoc;

/// The bearer-token scheme every operation needs unless it says otherwise.
#[derive(Debug)]
struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("A token from `shoal server`'s admin.token or POST /api/v1/tokens"))
                    .build(),
            ),
        );
    }
}

#[utoipa::path(
    get, path = "/api/v1/openapi.json", tag = "meta", security(()),
    responses((status = 200, description = "This API as an OpenAPI 3 document", body = Object))
)]
async fn openapi_json() -> Response {
    static DOC: OnceLock<Bytes> = OnceLock::new();
    let doc = DOC.get_or_init(|| match ApiDoc::openapi().to_json() {
        Ok(text) => Bytes::from(text),
        Err(e) => {
            tracing::error!(error = %e, "cannot write the OpenAPI document");
            Bytes::new()
        }
    });
    if doc.is_empty() {
        return ApiError::internal("the OpenAPI document could not be written").into_response();
    }
    ([(header::CONTENT_TYPE, "application/json")], doc.clone()).into_response()
}

// ---------------------------------------------------------------------------------------------------------------
// limits

/// Reads every request's body (at most [`MAX_BODY`]) within [`crate::http::BODY_TIMEOUT`]: a client that sends
/// less than its `Content-Length`, or trickles it, is answered 408 and its connection freed, instead of being held
/// open by a handler waiting for the rest.
async fn body_deadline(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return ApiError::too_large(format!("at most {MAX_BODY} bytes")).into_response();
    }
    let (parts, b) = req.into_parts();
    match tokio::time::timeout(crate::http::BODY_TIMEOUT, axum::body::to_bytes(b, MAX_BODY)).await {
        Ok(Ok(bytes)) => next.run(axum::extract::Request::from_parts(parts, Body::from(bytes))).await,
        Ok(Err(e)) if std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>()) => {
            ApiError::too_large(format!("at most {MAX_BODY} bytes")).into_response()
        }
        Ok(Err(e)) => ApiError::bad(format!("cannot read the request body: {e}")).into_response(),
        Err(_) => ApiError::timeout(format!(
            "the request body did not arrive within {} s",
            crate::http::BODY_TIMEOUT.as_secs()
        ))
        .into_response(),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// handlers

#[utoipa::path(
    get, path = "/healthz", tag = "meta", security(()),
    responses((status = 200, description = "The server answers; the database it uses", body = Health))
)]
async fn healthz(State(state): State<AppState>) -> Json<Health> {
    Json(Health { ok: true, database: state.control.db.backend().as_str().to_owned() })
}

#[utoipa::path(
    get, path = "/api/v1/whoami", tag = "meta",
    responses(
        (status = 200, description = "The token's owner", body = WhoAmI),
        AuthErrors,
    )
)]
async fn whoami(caller: Caller) -> Json<WhoAmI> {
    Json(crate::view::whoami(&caller.0))
}

fn valid_label(field: &str, v: &str) -> ApiResult<()> {
    if v.is_empty() || v.len() > 64 || !v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')) {
        return Err(ApiError::bad_field(field, format!("{v:?}: 1-64 letters, digits, '.', '_' or '-'")));
    }
    Ok(())
}

#[utoipa::path(
    post, path = "/api/v1/tokens", tag = "meta",
    request_body(content = NewToken, description = "Who the token is for", content_type = "application/json"),
    responses(
        (status = 201, description = "The new token, shown this once", body = TokenCreated),
        (status = 400, description = "A malformed request or label", body = ErrorBody),
        AuthErrors,
        (status = 403, description = "Only an admin creates tokens", body = ErrorBody),
    )
)]
async fn create_token(
    State(state): State<AppState>,
    caller: Caller,
    b: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<(StatusCode, Json<TokenCreated>)> {
    if !caller.0.admin {
        return Err(ApiError::forbidden("only an admin creates tokens"));
    }
    let b = body(b)?;
    let req: NewToken = serde_json::from_slice(&b).map_err(|e| ApiError::bad(format!("token request: {e}")))?;
    valid_label("user", &req.user)?;
    valid_label("team", &req.team)?;
    let token = new_token();
    let p = Principal { user: req.user, team: req.team, admin: req.admin };
    state.control.db.insert_token(&hash_token(&token), &p).await?;
    Ok((StatusCode::CREATED, Json(TokenCreated { token, user: p.user, team: p.team, admin: p.admin })))
}

#[utoipa::path(
    post, path = "/api/v1/jobs", tag = "jobs",
    request_body(
        description = "A job spec: the JSON form of the spec, or its TOML with `Content-Type: application/toml`",
        content((shoal_spec::JobSpec = "application/json"), (String = "application/toml"))
    ),
    responses(
        (status = 201, description = "Accepted and pending", body = Submitted),
        (status = 400, description = "`invalid_spec`: refused, naming the key path; `bad_request`: not text", body = ErrorBody),
        AuthErrors,
        (status = 413, description = "Over 1 MiB", body = ErrorBody),
    )
)]
async fn submit(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<(StatusCode, Json<Submitted>)> {
    let b = body(b)?;
    let text = std::str::from_utf8(&b).map_err(|_| ApiError::bad("the job spec is not UTF-8 text"))?;
    let is_toml = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|ct| ct.contains("toml"));
    let spec = if is_toml { shoal_spec::parse_job(text, "job.toml") } else { shoal_spec::parse_job_json(text) }?;
    let submitted = submit_spec(&state.control, &caller.0, spec, None).await?;
    Ok((StatusCode::CREATED, Json(submitted)))
}

/// Accepts a parsed job spec from `caller`, as `POST /api/v1/jobs` does: the queue must exist, the job must be able
/// to run here and its team may touch what it names; it is recorded pending and the loop woken. `id` gives the job
/// its id — a replayed history's, which must be free — instead of a new random one.
pub async fn submit_spec(
    control: &crate::control::Control,
    caller: &Principal,
    spec: shoal_spec::JobSpec,
    id: Option<String>,
) -> ApiResult<Submitted> {
    if !control.queues.iter().any(|q| q.name == spec.queue) {
        let names: Vec<&str> = control.queues.iter().map(|q| q.name.as_str()).collect();
        return Err(ApiError::spec(ApiError::bad_field(
            "queue",
            format!("no queue {:?}; the queues are: {}", spec.queue, names.join(", ")),
        )));
    }
    control.admissible(&caller.team, &spec).map_err(ApiError::spec)?;
    let spec_json =
        serde_json::to_string(&spec).map_err(|e| ApiError::internal(format!("serializing the spec: {e}")))?;
    let id = match id {
        Some(id) => {
            valid_label("id", &id)?;
            if !id.starts_with(|c: char| c.is_ascii_alphanumeric()) {
                return Err(ApiError::bad_field("id", format!("{id:?} must start with a letter or digit")));
            }
            if control.db.job(&id).await?.is_some() {
                return Err(ApiError::bad(format!("a job {id} exists already")));
            }
            id
        }
        None => loop {
            let token = new_token();
            let id = format!("j-{}", &token[6..14]);
            if control.db.job(&id).await?.is_none() {
                break id;
            }
        },
    };
    let dir = control.job_dir(&id);
    let place = control.config.policy.admit(&caller.team, &dir, &spec).map_err(ApiError::spec)?;
    let jobs_dir = control.config.data_dir.join("jobs");
    if let Some(owner) =
        control.config.policy.resume_source(&caller.team, &dir, &jobs_dir, &spec).map_err(ApiError::spec)?
    {
        // Another job's checkpoint: only one of the caller's own team (another team's job looks missing).
        let theirs = control.db.job(&owner).await?;
        if theirs.is_none_or(|j| j.team != caller.team) {
            return Err(ApiError::spec(ApiError::bad_field(
                "checkpoint.resume_from",
                format!("no job {owner} of team {} to resume from", caller.team),
            )));
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
        user: caller.user.clone(),
        team: caller.team.clone(),
        queue: spec.queue.clone(),
        priority: i64::from(spec.priority),
        state: JobState::Pending,
        spec: spec_json,
        // Derived from the id under the server's key when needed (`Control::job_secret`); nothing stored.
        secret: String::new(),
        restarts: 0,
        attempt: 0,
        workers: i64::from(lo),
        created_ms: control.db.now(),
        started_ms: None,
        finished_ms: None,
        reason: format!(
            "submitted by {} ({}) to queue {}: {} worker{} × {} CPU, {} MiB memory{}",
            caller.user,
            caller.team,
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
    control.db.insert_job(&row).await.map_err(ApiError::spec)?;
    // Attackers simulated on purpose are said at once, so that nobody takes the run for a sound one.
    if let Some(c) = &spec.chaos {
        let message = format!(
            "experiment ([chaos]): ranks {:?} send {:?} (scale {}) in place of their gradients, against [robust] rule \
             {:?}",
            c.byzantine_ranks,
            c.attack,
            c.attack().map_or(0.0, |a| a.scale()),
            spec.robust.map(|r| r.rule)
        );
        control.db.event(&id, "experiment", JobState::Pending, &message).await.map_err(ApiError::spec)?;
    }
    control.wake.notify_one();
    tracing::info!(job = %id, name = %spec.name, team = %caller.team, "job submitted");
    Ok(Submitted { id, state: JobState::Pending, name: spec.name })
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct ListQuery {
    /// The token, for clients that cannot set headers (see [`Caller`]).
    #[serde(default, rename = "access_token")]
    #[param(ignore)]
    _token: Option<String>,
    /// States to list, comma-separated (`running,pending`); all when absent.
    #[serde(default)]
    state: Option<String>,
    /// An admin's choice of team (another caller may name only its own).
    #[serde(default)]
    team: Option<String>,
    /// At most this many, newest first (1..=100000, default 1000).
    #[serde(default)]
    limit: Option<i64>,
}

#[utoipa::path(
    get, path = "/api/v1/jobs", tag = "jobs", params(ListQuery),
    responses(
        (status = 200, description = "Jobs, newest first", body = JobList),
        (status = 400, description = "A bad state or query", body = ErrorBody),
        AuthErrors,
        (status = 403, description = "Another team's jobs", body = ErrorBody),
    )
)]
async fn list_jobs(
    State(state): State<AppState>,
    caller: Caller,
    q: std::result::Result<Query<ListQuery>, QueryRejection>,
) -> ApiResult<Json<JobList>> {
    let q = query(q)?;
    let mut states = Vec::new();
    for s in q.state.iter().flat_map(|s| s.split(',')).filter(|s| !s.is_empty()) {
        states.push(JobState::parse(s).ok_or_else(|| {
            ApiError::bad_field(
                "state",
                format!("no state {s:?}; one of pending, running, preempted, succeeded, failed, cancelled"),
            )
        })?);
    }
    let team = match (&q.team, caller.0.admin) {
        (Some(t), true) => Some(t.clone()),
        (None, true) => None,
        (Some(t), false) if *t != caller.0.team => {
            return Err(ApiError::forbidden(format!("you are in team {}, not {t}", caller.0.team)));
        }
        (_, false) => Some(caller.0.team.clone()),
    };
    let limit = q.limit.unwrap_or(1000).clamp(1, 100_000);
    let jobs = state.control.db.jobs(team.as_deref(), &states, limit).await?;
    Ok(Json(JobList { jobs: jobs.iter().map(crate::view::job).collect() }))
}

#[utoipa::path(
    get, path = "/api/v1/jobs/{id}", tag = "jobs",
    params(JobPath),
    responses(
        (status = 200, description = "The job with its workers, events, spec and summary", body = JobDetail),
        JobErrors,
    )
)]
async fn job_status(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
) -> ApiResult<Json<JobDetail>> {
    let job = visible_job(&state, &caller, &job_id(id)?).await?;
    Ok(Json(crate::view::job_detail(&state.control, &job).await?))
}

#[utoipa::path(
    post, path = "/api/v1/jobs/{id}/cancel", tag = "jobs",
    params(JobPath),
    responses(
        (status = 202, description = "Cancel recorded; the job ends `cancelled` once its workers are gone", body = CancelAccepted),
        JobErrors,
        (status = 409, description = "The job already ended", body = ErrorBody),
    )
)]
async fn cancel(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
) -> ApiResult<(StatusCode, Json<CancelAccepted>)> {
    let id = job_id(id)?;
    let job = visible_job(&state, &caller, &id).await?;
    if job.state.is_final() {
        return Err(ApiError::conflict(format!("job {id} already {}", job.state.as_str())));
    }
    state.control.db.request_cancel(&id).await?;
    state.control.db.event(&id, "cancel", job.state, &format!("cancel requested by {}", caller.0.user)).await?;
    state.control.wake.notify_one();
    Ok((StatusCode::ACCEPTED, Json(CancelAccepted { id, state: job.state, cancel_requested: true })))
}

#[utoipa::path(
    get, path = "/api/v1/jobs/{id}/debug", tag = "jobs",
    params(JobPath),
    responses(
        (status = 200, description = "Every rank of the running job now: the collective it is in (or finished last), \
            its sequence number and time in it, or how long it has been silent; the ranks holding the others up",
            body = HangDump),
        JobErrors,
        (status = 409, description = "The job is not running", body = ErrorBody),
    )
)]
async fn debug(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
) -> ApiResult<Json<HangDump>> {
    let id = job_id(id)?;
    let job = visible_job(&state, &caller, &id).await?;
    if job.state != JobState::Running {
        return Err(ApiError::conflict(format!(
            "job {id} is {}, not running: it has no ranks to dump",
            job.state.as_str()
        )));
    }
    Ok(Json(state.control.debug_dump(&job).await?))
}

#[utoipa::path(
    post, path = "/api/v1/jobs/{id}/heartbeat", tag = "jobs",
    params(JobPath, ("x-shoal-tag" = String, Header,
        description = "HMAC-SHA256 of the body under the job secret, in hex (what `shoal_comm::auth::sign` gives)")),
    request_body(content = Heartbeat, content_type = "application/json"),
    responses(
        (status = 200, description = "Heard: the rank lives (a report of its failure goes into the job's events); the \
            answer names the newer group the rank is to train in when its elastic job regroups in place",
            body = HeartbeatReply),
        (status = 400, description = "A malformed heartbeat", body = ErrorBody),
        (status = 401, description = "No job with that id, or a tag that does not verify under its secret",
            body = ErrorBody),
        (status = 409, description = "The job is not running", body = ErrorBody),
        (status = 413, description = "Over 1 MiB", body = ErrorBody),
    ),
    security(()),
)]
/// A worker's heartbeat. Not for tokens: the job's own tasks prove they hold its secret by the tag, and the secret
/// never crosses the wire.
async fn heartbeat(
    State(state): State<AppState>,
    headers: HeaderMap,
    id: std::result::Result<Path<String>, PathRejection>,
    b: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<Json<HeartbeatReply>> {
    let id = job_id(id)?;
    let b = body(b)?;
    let tag = headers.get("x-shoal-tag").and_then(|v| v.to_str().ok()).unwrap_or_default();
    let job = state.control.db.job(&id).await?;
    let Some(job) = job.filter(|j| shoal_comm::auth::verify(state.control.job_secret(j).as_bytes(), &b, tag)) else {
        return Err(ApiError::unauthorized(format!(
            "heartbeat for job {id}: no such job, or the x-shoal-tag header is not the body's tag under its secret"
        )));
    };
    let hb: Heartbeat = serde_json::from_slice(&b).map_err(|e| ApiError::bad(format!("heartbeat: {e}")))?;
    if hb.rank < 0 {
        return Err(ApiError::bad_field("rank", format!("{}: must be >= 0", hb.rank)));
    }
    if job.state != JobState::Running {
        return Err(ApiError::conflict(format!("job {id} is {}, not running", job.state.as_str())));
    }
    let reply = HeartbeatReply { regroup: state.control.regroup_for(&job, &hb) };
    if let Some(report) = state.control.heard(&job, hb) {
        state.control.db.event(&id, "rank_report", job.state, &report).await?;
    }
    Ok(Json(reply))
}

#[utoipa::path(
    post, path = "/api/v1/jobs/{id}/chaos", tag = "jobs",
    params(JobPath),
    request_body(content = ChaosRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "The fault was injected: what was done to which worker", body = ChaosDone),
        (status = 400, description = "A malformed request, a rank that is not a running worker, or a job not running",
            body = ErrorBody),
        JobErrors,
        (status = 413, description = "Over 1 MiB", body = ErrorBody),
    )
)]
async fn chaos(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
    b: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<Json<ChaosDone>> {
    let id = job_id(id)?;
    let b = body(b)?;
    let job = visible_job(&state, &caller, &id).await?;
    let req: ChaosRequest = serde_json::from_slice(&b).map_err(|e| ApiError::bad(format!("chaos request: {e}")))?;
    Ok(Json(state.control.chaos(&job, req.rank, req.action, &caller.0.user).await?))
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct LogQuery {
    /// The token, for clients that cannot set headers (see [`Caller`]).
    #[serde(default, rename = "access_token")]
    #[param(ignore)]
    _token: Option<String>,
    /// The worker's rank (default 0).
    #[serde(default)]
    rank: Option<i64>,
    /// The attempt, from 1 (default: the current one).
    #[serde(default)]
    attempt: Option<i64>,
    /// Where to start, in bytes (default 0).
    #[serde(default)]
    offset: Option<u64>,
    /// Stream the log as it grows, until the attempt ends.
    #[serde(default)]
    follow: Option<bool>,
}

#[utoipa::path(
    get, path = "/api/v1/jobs/{id}/logs", tag = "jobs",
    params(JobPath, LogQuery),
    responses(
        (status = 200, description = "The worker's output from `offset`, at most 1 MiB (or all of it as it grows, \
                                      with `follow=true`)", body = String, content_type = "text/plain",
            headers(
                ("x-log-size" = u64, description = "How long the log is now (not with `follow`)"),
                ("x-log-next" = u64, description = "The offset to ask for next (not with `follow`)"),
            )
        ),
        (status = 400, description = "A rank or attempt the job does not have, or a bad query", body = ErrorBody),
        JobErrors,
    )
)]
async fn logs(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
    q: std::result::Result<Query<LogQuery>, QueryRejection>,
) -> ApiResult<Response> {
    let id = job_id(id)?;
    let q = query(q)?;
    let job = visible_job(&state, &caller, &id).await?;
    let rank = q.rank.unwrap_or(0);
    if rank < 0 || rank >= job.workers.max(1) {
        return Err(ApiError::bad_field("rank", format!("job {id} has ranks 0..{}", job.workers.max(1) - 1)));
    }
    let attempt = match q.attempt {
        None => job.attempt,
        Some(a) if (1..=job.attempt).contains(&a) => a,
        Some(a) if job.attempt == 0 => {
            return Err(ApiError::bad_field("attempt", format!("{a}: job {id} has not started yet")));
        }
        Some(a) => {
            return Err(ApiError::bad_field("attempt", format!("{a}: job {id} has attempts 1..={}", job.attempt)));
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

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct AfterQuery {
    /// The token, for clients that cannot set headers (see [`Caller`]).
    #[serde(default, rename = "access_token")]
    #[param(ignore)]
    _token: Option<String>,
    /// Only events after this event id (default 0: all).
    #[serde(default)]
    after: Option<i64>,
}

#[utoipa::path(
    get, path = "/api/v1/jobs/{id}/events", tag = "jobs",
    params(JobPath, AfterQuery),
    responses(
        (status = 200, description = "Its events, oldest first", body = EventList),
        (status = 400, description = "A bad query", body = ErrorBody),
        JobErrors,
    )
)]
async fn events(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
    q: std::result::Result<Query<AfterQuery>, QueryRejection>,
) -> ApiResult<Json<EventList>> {
    let id = job_id(id)?;
    let q = query(q)?;
    let job = visible_job(&state, &caller, &id).await?;
    let ev = state.control.db.events(&job.id, q.after.unwrap_or(0)).await?;
    Ok(Json(EventList { events: ev.iter().map(crate::view::event).collect() }))
}

#[utoipa::path(
    post, path = "/api/v1/jobs/{id}/metrics", tag = "jobs",
    params(JobPath),
    request_body(content = MetricsBatch, content_type = "application/json"),
    responses(
        (status = 200, description = "How many lines were new", body = MetricsStored),
        (status = 400, description = "A malformed batch, or a negative rank or step", body = ErrorBody),
        JobErrors,
        (status = 413, description = "Over 1 MiB", body = ErrorBody),
    )
)]
async fn post_metrics(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
    b: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<Json<MetricsStored>> {
    let id = job_id(id)?;
    let b = body(b)?;
    let job = visible_job(&state, &caller, &id).await?;
    let batch: MetricsBatch = serde_json::from_slice(&b).map_err(|e| ApiError::bad(format!("metrics batch: {e}")))?;
    if let Some((i, m)) = batch.metrics.iter().enumerate().find(|(_, m)| m.rank < 0 || m.step < 0) {
        return Err(ApiError::bad_field(
            format!("metrics[{i}]"),
            format!("rank {} step {}: must be >= 0", m.rank, m.step),
        ));
    }
    // A line is a JSON object (what readers, the dashboard and the downsampling take apart by key).
    if let Some((i, m)) = batch.metrics.iter().enumerate().find(|(_, m)| !m.data.is_object()) {
        return Err(ApiError::bad_field(format!("metrics[{i}].data"), format!("{}: must be a JSON object", m.data)));
    }
    let rows: Vec<_> = batch.metrics.into_iter().map(crate::view::metric_row).collect();
    let stored = state.control.db.insert_metrics(&job.id, &rows).await?;
    Ok(Json(MetricsStored { stored }))
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct MetricsQuery {
    /// The token, for clients that cannot set headers (see [`Caller`]).
    #[serde(default, rename = "access_token")]
    #[param(ignore)]
    _token: Option<String>,
    /// One rank's lines only (-1: the evaluations).
    #[serde(default)]
    rank: Option<i64>,
    /// Only steps after this one.
    #[serde(default)]
    after: Option<i64>,
    /// At most this many lines.
    #[serde(default)]
    limit: Option<i64>,
    /// About this many lines per rank, as bucket means (at least 2).
    #[serde(default)]
    max_points: Option<usize>,
}

#[utoipa::path(
    get, path = "/api/v1/jobs/{id}/metrics", tag = "jobs",
    params(JobPath, MetricsQuery),
    responses(
        (status = 200, description = "Stored metrics lines by step, then rank", body = MetricList),
        (status = 400, description = "A bad query", body = ErrorBody),
        JobErrors,
    )
)]
async fn get_metrics(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
    q: std::result::Result<Query<MetricsQuery>, QueryRejection>,
) -> ApiResult<Json<MetricList>> {
    let id = job_id(id)?;
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
    Ok(Json(MetricList { metrics: m.into_iter().map(crate::view::metric).collect() }))
}

#[utoipa::path(
    get, path = "/api/v1/queues", tag = "cluster",
    responses(
        (status = 200, description = "Queues with their guarantees and what their jobs hold", body = QueueList),
        AuthErrors,
    )
)]
async fn queues(State(state): State<AppState>, _caller: Caller) -> ApiResult<Json<QueueList>> {
    Ok(Json(QueueList { queues: crate::view::queues(&state.control).await? }))
}

#[utoipa::path(
    get, path = "/api/v1/nodes", tag = "cluster",
    responses(
        (status = 200, description = "Nodes with their capacity and allocation", body = NodeList),
        AuthErrors,
    )
)]
async fn nodes(State(state): State<AppState>, _caller: Caller) -> Json<NodeList> {
    Json(NodeList { nodes: crate::view::nodes(&state.control) })
}
