//! Seeing what happens: the dashboard's assets, the overview, resource samples, live streams (server-sent events),
//! diagnosis, cost, and `/metrics` in the Prometheus text format.
//!
//! Metric names follow Prometheus' conventions: the `shoal_` prefix, base units in the name (`_seconds`,
//! `_bytes`), `_total` for counters.

use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{MatchedPath, Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt};
use prometheus::{Encoder, GaugeVec, Opts, Registry, TextEncoder};
use serde::Deserialize;
use serde_json::{Value, json};
use shoal_wire::{CostReport, Diagnosis, ErrorBody, MetricList, Overview, SampleList};
use utoipa::IntoParams;

use crate::api_error::{ApiError, ApiResult, AuthErrors, JobErrors};
use crate::control::{Control, parse_stored_spec};
use crate::db::{JobRow, JobState, MetricRow};
use crate::diagnose::{Context, diagnose};
use crate::error::{ControlError, Result};
use crate::http::{AppState, Caller, JobPath, job_id, query, visible_job};

include!(concat!(env!("OUT_DIR"), "/assets.rs"));

/// Counts every request by route and status.
pub async fn count_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = req.method().to_string();
    let t0 = std::time::Instant::now();
    let resp = next.run(req).await;
    let m = &state.control.metrics;
    m.api_requests.with_label_values(&[method.as_str(), route.as_str(), resp.status().as_str()]).inc();
    m.api_latency.with_label_values(&[route.as_str()]).observe(t0.elapsed().as_secs_f64());
    resp
}

// ---------------------------------------------------------------------------------------------------------------
// assets

pub async fn index() -> Response {
    asset_response("index.html")
}

pub async fn asset(Path(path): Path<String>) -> Response {
    asset_response(&path)
}

fn asset_response(path: &str) -> Response {
    let Some((_, body)) = ASSETS.iter().find(|(p, _)| *p == path) else {
        return ApiError::not_found(format!("no asset {path:?}")).into_response();
    };
    let ct = match path.rsplit('.').next() {
        Some("html") => "text/html; charset=utf-8",
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("json") => "application/json",
        _ => "text/plain; charset=utf-8",
    };
    ([(header::CONTENT_TYPE, ct), (header::CACHE_CONTROL, "no-cache")], Bytes::from_static(body)).into_response()
}

// ---------------------------------------------------------------------------------------------------------------
// overview

#[utoipa::path(
    get, path = "/api/v1/overview", tag = "cluster",
    responses(
        (status = 200, description = "The cluster at a glance: capacity, allocation, jobs by state, queues, history",
            body = Overview),
        AuthErrors,
    )
)]
pub async fn overview(State(state): State<AppState>, _caller: Caller) -> ApiResult<Json<Overview>> {
    Ok(Json(crate::view::overview(&state.control).await?))
}

/// Event streams one caller may hold open at once.
pub const MAX_STREAMS_PER_CALLER: usize = 16;

/// One open event stream of a caller; dropping it (the stream ends or its client goes away) frees the slot.
#[derive(Debug)]
pub struct StreamSlot {
    control: std::sync::Arc<Control>,
    who: String,
}

impl StreamSlot {
    fn take(control: &std::sync::Arc<Control>, caller: &Caller) -> ApiResult<StreamSlot> {
        let who = format!("{}@{}", caller.0.user, caller.0.team);
        let mut open = control.streams.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(who.clone()).or_default();
        if *n >= MAX_STREAMS_PER_CALLER {
            return Err(ApiError::too_many(format!(
                "{who} already has {MAX_STREAMS_PER_CALLER} event streams open; close one first"
            )));
        }
        *n += 1;
        Ok(StreamSlot { control: control.clone(), who })
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.control.streams.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.who) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.who);
            }
        }
    }
}

/// The `access_token` query parameter the event streams take (a browser's `EventSource` cannot set headers).
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StreamQuery {
    /// The bearer token, when no `Authorization` header can be sent.
    #[serde(default)]
    pub access_token: Option<String>,
}

#[utoipa::path(
    get, path = "/api/v1/overview/stream", tag = "cluster", params(StreamQuery),
    responses(
        (status = 200, description = "Server-sent events: an `overview` event (an `Overview` object) every 2 s",
            body = String, content_type = "text/event-stream"),
        AuthErrors,
        (status = 429, description = "The caller holds too many event streams", body = ErrorBody),
    )
)]
pub async fn overview_stream(
    State(state): State<AppState>,
    caller: Caller,
) -> ApiResult<Sse<impl Stream<Item = std::result::Result<Event, Infallible>>>> {
    let control = state.control.clone();
    let slot = StreamSlot::take(&control, &caller)?;
    // The slot rides in the stream's state: it is freed when the stream is dropped.
    let s = futures_util::stream::unfold((true, slot), move |(first, slot)| {
        let control = control.clone();
        async move {
            if !first {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            let ev = match crate::view::overview(&control).await.map(|v| serde_json::to_string(&v)) {
                Ok(Ok(v)) => Event::default().event("overview").data(v),
                Ok(Err(e)) => Event::default().event("error").data(json!({ "error": e.to_string() }).to_string()),
                Err(e) => Event::default().event("error").data(json!({ "error": e.to_string() }).to_string()),
            };
            Some((Ok(ev), (false, slot)))
        }
    });
    Ok(Sse::new(s).keep_alive(KeepAlive::default()))
}

// ---------------------------------------------------------------------------------------------------------------
// samples and metrics

/// Bucket means over steps, per rank, to about `max_points` rows each; the last row of each rank is kept as is.
pub fn downsample(rows: Vec<MetricRow>, max_points: usize) -> Vec<MetricRow> {
    let mut ranks: Vec<i64> = rows.iter().map(|r| r.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let mut out = Vec::new();
    for rank in ranks {
        let mine: Vec<&MetricRow> = rows.iter().filter(|r| r.rank == rank).collect();
        if mine.len() <= max_points {
            out.extend(mine.into_iter().cloned());
            continue;
        }
        let per = mine.len().div_ceil(max_points - 1);
        let (body, last) = mine.split_at(mine.len() - 1);
        for chunk in body.chunks(per) {
            let Some(tail) = chunk.last() else { continue };
            let mut data = serde_json::Map::new();
            if let Some(obj) = tail.data.as_object() {
                for (k, v) in obj {
                    let mean = if k == "step" || k == "comm_bytes" || !v.is_f64() {
                        None
                    } else {
                        let vals: Vec<f64> =
                            chunk.iter().filter_map(|r| r.data.get(k).and_then(Value::as_f64)).collect();
                        (!vals.is_empty()).then(|| vals.iter().sum::<f64>() / vals.len() as f64)
                    };
                    data.insert(k.clone(), mean.map_or_else(|| v.clone(), |m| json!(m)));
                }
            }
            out.push(MetricRow { rank, step: tail.step, time_ms: tail.time_ms, data: Value::Object(data) });
        }
        out.extend(last.iter().map(|r| (*r).clone()));
    }
    out.sort_by_key(|r| (r.step, r.rank));
    out
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SamplesQuery {
    #[serde(default, rename = "access_token")]
    #[param(ignore)]
    _token: Option<String>,
    /// Only samples after this time (ms since the epoch).
    #[serde(default)]
    after: Option<i64>,
    /// About this many samples per rank, evenly spaced (at least 2).
    #[serde(default)]
    max_points: Option<usize>,
}

#[utoipa::path(
    get, path = "/api/v1/jobs/{id}/samples", tag = "jobs",
    params(JobPath, SamplesQuery),
    responses(
        (status = 200, description = "Resource samples of its workers, oldest first", body = SampleList),
        (status = 400, description = "A bad query", body = ErrorBody),
        JobErrors,
    )
)]
pub async fn samples(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
    q: std::result::Result<Query<SamplesQuery>, QueryRejection>,
) -> ApiResult<Json<SampleList>> {
    let id = job_id(id)?;
    let q = query(q)?;
    let job = visible_job(&state, &caller, &id).await?;
    let mut rows = state.control.db.samples(&job.id, q.after.unwrap_or(0), 1_000_000).await?;
    if let Some(n) = q.max_points.filter(|n| *n >= 2) {
        let ranks = rows.iter().map(|r| r.rank).collect::<std::collections::BTreeSet<_>>().len().max(1);
        let keep = n.saturating_mul(ranks).max(2);
        if rows.len() > keep {
            let stride = rows.len().div_ceil(keep);
            let last = rows.len() - 1;
            rows =
                rows.into_iter().enumerate().filter(|(i, _)| i % stride == 0 || *i == last).map(|(_, r)| r).collect();
        }
    }
    Ok(Json(SampleList { samples: rows.iter().map(crate::view::sample).collect() }))
}

// ---------------------------------------------------------------------------------------------------------------
// the job's live stream

struct StreamState {
    /// Held for as long as the stream is open.
    _slot: StreamSlot,
    control: std::sync::Arc<Control>,
    id: String,
    first: bool,
    done: bool,
    last_job: String,
    after_step: std::collections::HashMap<i64, i64>,
    after_sample: i64,
    log_offset: u64,
    log_attempt: i64,
}

async fn stream_round(st: &mut StreamState) -> Vec<Event> {
    let mut events = Vec::new();
    let job = match st.control.db.job(&st.id).await {
        Ok(Some(j)) => j,
        _ => {
            st.done = true;
            return events;
        }
    };
    if let Ok(Ok(text)) = crate::view::job_detail(&st.control, &job).await.map(|v| serde_json::to_string(&v))
        && text != st.last_job
    {
        events.push(Event::default().event("job").data(text.clone()));
        st.last_job = text;
    }
    // New metrics of every rank (and evaluations, rank -1).
    let min_after = st.after_step.values().copied().min().unwrap_or(-1);
    let rows = if st.after_step.is_empty() { -1 } else { min_after };
    if let Ok(rows) = st.control.db.metrics(&st.id, None, rows, 1_000_000).await {
        let fresh: Vec<MetricRow> =
            rows.into_iter().filter(|r| r.step > st.after_step.get(&r.rank).copied().unwrap_or(-1)).collect();
        for r in &fresh {
            let e = st.after_step.entry(r.rank).or_insert(-1);
            *e = (*e).max(r.step);
        }
        if !fresh.is_empty() {
            let fresh = if st.first { downsample(fresh, 2000) } else { fresh };
            let list = MetricList { metrics: fresh.into_iter().map(crate::view::metric).collect() };
            if let Ok(text) = serde_json::to_string(&list) {
                events.push(Event::default().event("metrics").data(text));
            }
        }
    }
    if let Ok(s) = st.control.db.samples(&st.id, st.after_sample, 100_000).await
        && let Some(last) = s.last()
    {
        st.after_sample = last.time_ms;
        let list = SampleList { samples: s.iter().map(crate::view::sample).collect() };
        if let Ok(text) = serde_json::to_string(&list) {
            events.push(Event::default().event("samples").data(text));
        }
    }
    // New output of rank 0 of the current attempt (at most 64 KiB per round).
    if job.attempt != st.log_attempt {
        st.log_attempt = job.attempt;
        st.log_offset = 0;
    }
    let path = st.control.exec.log_path(&st.id, job.attempt, 0);
    if let Ok((data, _)) = crate::control::read_from_async(path, st.log_offset, 64 << 10).await
        && !data.is_empty()
    {
        st.log_offset += data.len() as u64;
        let log = shoal_wire::LogText { rank: 0, text: String::from_utf8_lossy(&data).into_owned() };
        if let Ok(text) = serde_json::to_string(&log) {
            events.push(Event::default().event("log").data(text));
        }
    }
    st.first = false;
    if job.state.is_final() {
        st.done = true;
    }
    events
}

#[utoipa::path(
    get, path = "/api/v1/jobs/{id}/stream", tag = "jobs",
    params(JobPath, StreamQuery),
    responses(
        (status = 200, description = "Server-sent events until the job ends: `job` (a `JobDetail`, when it changed), \
                                      `metrics` (a `MetricList` of new lines), `samples` (a `SampleList`), `log` (a \
                                      `LogText` of rank 0's new output)", body = String, content_type = "text/event-stream"),
        JobErrors,
        (status = 429, description = "The caller holds too many event streams", body = ErrorBody),
    )
)]
pub async fn job_stream(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
) -> ApiResult<Sse<impl Stream<Item = std::result::Result<Event, Infallible>>>> {
    let job = visible_job(&state, &caller, &job_id(id)?).await?;
    let slot = StreamSlot::take(&state.control, &caller)?;
    let st = StreamState {
        _slot: slot,
        control: state.control.clone(),
        id: job.id.clone(),
        first: true,
        done: false,
        last_job: String::new(),
        after_step: Default::default(),
        after_sample: 0,
        log_offset: 0,
        log_attempt: job.attempt,
    };
    let s = futures_util::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        if !st.first {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let evs = stream_round(&mut st).await;
        Some((futures_util::stream::iter(evs.into_iter().map(Ok)), st))
    })
    .flatten();
    Ok(Sse::new(s).keep_alive(KeepAlive::default()))
}

// ---------------------------------------------------------------------------------------------------------------
// diagnosis and cost

/// The findings for one job.
pub async fn diagnosis_of(c: &Control, job: &JobRow) -> Result<Vec<crate::diagnose::Finding>> {
    let spec = c.spec_of(job)?;
    let rows = c.db.metrics(&job.id, None, -1, 10_000_000).await?;
    let rows: Vec<MetricRow> = rows.into_iter().filter(|r| r.rank >= 0).collect();
    let samples = c.db.samples(&job.id, 0, 1_000_000).await?;
    let mut ctx = Context {
        world_size: job.workers,
        cpus_per_worker: spec.resources.cpus as f64 / 1000.0,
        memory_per_worker: spec.resources.memory,
        reference_busbw: None,
    };
    let first = diagnose(&rows, &samples, &ctx);
    if !first.iter().any(|f| f.kind == "communication") {
        return Ok(first);
    }
    // Communication: compare with what the transport does here, for the bytes this job sends per step.
    let per_step = crate::diagnose::breakdowns(&rows).iter().map(|b| b.comm_bytes_per_step).fold(0.0, f64::max);
    let reference = bench_reference(c).await;
    ctx.reference_busbw = reference
        .iter()
        .min_by(|a, b| {
            ((a.0 as f64).ln() - per_step.max(1.0).ln())
                .abs()
                .total_cmp(&((b.0 as f64).ln() - per_step.max(1.0).ln()).abs())
        })
        .map(|r| r.1);
    Ok(diagnose(&rows, &samples, &ctx))
}

/// The all-reduce reference of this machine: loaded from `DATA/bench.json`, or measured once with `shoal bench`
/// (2 ranks, 64 KiB to 16 MiB) and saved there.
async fn bench_reference(c: &Control) -> Vec<(u64, f64)> {
    let mut cached = c.bench.lock().await;
    if !cached.is_empty() {
        return cached.clone();
    }
    let program = c.config.worker_program.clone();
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(&program)
            .args(["bench", "allreduce", "--ranks", "2", "--sizes", "64KiB,1MiB,16MiB", "--iters", "20"])
            .args(["--warmup", "5", "--timeout", "30s", "--json"])
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await;
    match out {
        Ok(Ok(o)) if o.status.success() => {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            let rows = crate::diagnose::parse_bench(&text);
            if !rows.is_empty() {
                let _ = std::fs::write(c.config.data_dir.join("bench.json"), &text);
                tracing::info!(rows = rows.len(), "measured the all-reduce reference for diagnosis");
            }
            *cached = rows;
        }
        other => tracing::warn!(?other, "could not measure the all-reduce reference; diagnosis goes without it"),
    }
    cached.clone()
}

#[utoipa::path(
    get, path = "/api/v1/jobs/{id}/diagnosis", tag = "jobs",
    params(JobPath),
    responses(
        (status = 200, description = "What holds the job back, with evidence and an action", body = Diagnosis),
        JobErrors,
    )
)]
pub async fn diagnosis(
    State(state): State<AppState>,
    caller: Caller,
    id: std::result::Result<Path<String>, PathRejection>,
) -> ApiResult<Json<Diagnosis>> {
    let job = visible_job(&state, &caller, &job_id(id)?).await?;
    let findings = diagnosis_of(&state.control, &job).await?;
    Ok(Json(Diagnosis { id: job.id, state: job.state, findings: findings.iter().map(crate::view::finding).collect() }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct CostQuery {
    #[serde(default, rename = "access_token")]
    #[param(ignore)]
    _token: Option<String>,
    /// An admin's choice of team (another caller may name only its own); an admin sees all teams by default.
    #[serde(default)]
    team: Option<String>,
    /// Jobs created at or after this time (ms since the epoch).
    #[serde(default)]
    since: Option<i64>,
}

#[utoipa::path(
    get, path = "/api/v1/cost", tag = "cluster", params(CostQuery),
    responses(
        (status = 200, description = "Resource-hours and money per job and team at the server's prices",
            body = CostReport),
        (status = 400, description = "A bad query", body = ErrorBody),
        AuthErrors,
        (status = 403, description = "Another team's costs", body = ErrorBody),
    )
)]
pub async fn cost(
    State(state): State<AppState>,
    caller: Caller,
    q: std::result::Result<Query<CostQuery>, QueryRejection>,
) -> ApiResult<Json<CostReport>> {
    let q = query(q)?;
    let team = match (q.team, caller.0.admin) {
        (t, true) => t,
        (Some(t), false) if t != caller.0.team => {
            return Err(ApiError::forbidden(format!("you are in team {}, not {t}", caller.0.team)));
        }
        (_, false) => Some(caller.0.team.clone()),
    };
    let c = &state.control;
    let jobs = c.db.jobs_since(team.as_deref(), q.since.unwrap_or(0)).await?;
    let now_ms = c.db.now();
    let mut costs = Vec::with_capacity(jobs.len());
    for j in &jobs {
        let Ok(spec) = parse_stored_spec(j) else { continue };
        let tasks = c.db.all_tasks(&j.id).await?;
        let samples = c.db.samples(&j.id, 0, 1_000_000).await?;
        // Each phase at its own resources, from the event that began it (a job without phases: one rate).
        let began: Vec<i64> = match spec.phases.len() {
            0 => Vec::new(),
            _ => c.db.events(&j.id, 0).await?.iter().filter(|e| e.kind == "phase").map(|e| e.time_ms).collect(),
        };
        let rates: Vec<crate::cost::Rate> = (0..spec.phases.len().max(1))
            .map(|i| {
                let r = spec.in_phase(i).resources;
                crate::cost::Rate {
                    per_worker: (r.cpus as f64 / 1000.0, r.memory, r.gpus as f64 / 1000.0),
                    from_ms: if i == 0 { i64::MIN } else { began.get(i - 1).copied().unwrap_or(i64::MAX) },
                    until_step: spec.phases.get(i).and_then(|p| p.until_step),
                }
            })
            .collect();
        costs.push(crate::cost::job_cost(j, &rates, &tasks, &samples, &c.config.prices, now_ms));
    }
    Ok(Json(crate::cost::report(costs, &c.config.prices)))
}

// ---------------------------------------------------------------------------------------------------------------
// Prometheus

fn gauge(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> Option<GaugeVec> {
    let g = GaugeVec::new(Opts::new(name, help), labels).ok()?;
    reg.register(Box::new(g.clone())).ok()?;
    Some(g)
}

async fn scrape(c: &Control, team: Option<&str>) -> Result<String> {
    let reg = Registry::new();
    let jobs = c.db.jobs(team, &[], 100_000).await?;
    if let Some(g) = gauge(&reg, "shoal_jobs", "Jobs by state", &["state"]) {
        for st in JobState::ALL {
            g.with_label_values(&[st.as_str()]).set(jobs.iter().filter(|j| j.state == st).count() as f64);
        }
    }
    if let (Some(p), Some(r)) = (
        gauge(&reg, "shoal_queue_pending_jobs", "Jobs waiting in a queue", &["queue"]),
        gauge(&reg, "shoal_queue_running_jobs", "Jobs running from a queue", &["queue"]),
    ) {
        for q in &c.queues {
            let n = |s: JobState| jobs.iter().filter(|j| j.queue == q.name && j.state == s).count() as f64;
            p.with_label_values(&[q.name.as_str()]).set(n(JobState::Pending));
            r.with_label_values(&[q.name.as_str()]).set(n(JobState::Running));
        }
    }
    let node = crate::view::node(c);
    for (name, help, v) in [
        ("shoal_node_cpus", "CPUs a node offers", node.cpus),
        ("shoal_node_cpus_allocated", "CPUs allocated to jobs", node.allocated.cpus),
        ("shoal_node_memory_bytes", "Memory a node offers", node.memory_bytes as f64),
        ("shoal_node_memory_allocated_bytes", "Memory allocated to jobs", node.allocated.memory_bytes as f64),
        ("shoal_node_gpus", "GPUs a node offers", node.gpus.len() as f64),
        ("shoal_node_gpus_allocated", "GPUs allocated to jobs", node.allocated.gpus),
    ] {
        if let Some(g) = gauge(&reg, name, help, &["node"]) {
            g.with_label_values(&[node.id.as_str()]).set(v);
        }
    }
    let loss = gauge(&reg, "shoal_job_loss", "Newest training loss of a running job", &["job", "name"]);
    let step = gauge(&reg, "shoal_job_step", "Newest step of a running job", &["job", "name"]);
    let tput = gauge(&reg, "shoal_job_samples_per_second", "Training throughput of a running job", &["job", "name"]);
    let restarts = gauge(&reg, "shoal_job_restarts", "Times a job was started again", &["job", "name"]);
    let cpu = gauge(&reg, "shoal_task_cpu_usage_ratio", "CPUs a worker used (1 = one CPU busy)", &["job", "rank"]);
    let rss = gauge(&reg, "shoal_task_resident_memory_bytes", "Resident memory of a worker", &["job", "rank"]);
    let cpu_s = gauge(&reg, "shoal_task_cpu_seconds", "CPU time a worker used so far", &["job", "rank"]);
    let held = gauge(
        &reg,
        "shoal_task_training_memory_bytes",
        "What a worker holds for training, from its buffers (kind: params, grads, optimizer, activations: the last \
         step's peak)",
        &["job", "rank", "kind"],
    );
    let share = gauge(
        &reg,
        "shoal_task_batch_share",
        "A worker's part of the global batch under train.balance = \"dynamic\" (the ranks' parts sum to 1)",
        &["job", "rank"],
    );
    for j in jobs.iter().filter(|j| matches!(j.state, JobState::Running | JobState::Preempted)) {
        let labels = [j.id.as_str(), j.name.as_str()];
        if let Some(g) = &restarts {
            g.with_label_values(&labels).set(j.restarts as f64);
        }
        let last = c.db.last_metric_step(&j.id, 0).await?;
        if let Some(m) = c.db.metrics(&j.id, Some(0), last - 1, 1).await?.first() {
            let f = |k: &str| m.data.get(k).and_then(Value::as_f64);
            if let (Some(g), Some(v)) = (&loss, f("loss")) {
                g.with_label_values(&labels).set(v);
            }
            if let Some(g) = &step {
                g.with_label_values(&labels).set(m.step as f64);
            }
            if let (Some(g), Some(n), Some(t)) = (&tput, f("samples"), f("step_s"))
                && t > 0.0
            {
                g.with_label_values(&labels).set(n / t);
            }
        }
        if let Some(g) = &held {
            for rank in 0..j.workers.max(0) {
                let last = c.db.last_metric_step(&j.id, rank).await?;
                let Some(m) = c.db.metrics(&j.id, Some(rank), last - 1, 1).await?.into_iter().next() else { continue };
                let r = rank.to_string();
                if let (Some(g), Some(v)) = (&share, m.data.get("share").and_then(Value::as_f64)) {
                    g.with_label_values(&[j.id.as_str(), r.as_str()]).set(v);
                }
                for (kind, key) in [
                    ("params", "params_bytes"),
                    ("grads", "grads_bytes"),
                    ("optimizer", "optimizer_bytes"),
                    ("activations", "activations_bytes"),
                ] {
                    if let Some(v) = m.data.get(key).and_then(Value::as_f64) {
                        g.with_label_values(&[j.id.as_str(), r.as_str(), kind]).set(v);
                    }
                }
            }
        }
        let recent = c.db.samples(&j.id, c.db.now() - 10_000, 10_000).await?;
        for s in &recent {
            let rank = s.rank.to_string();
            let l = [j.id.as_str(), rank.as_str()];
            if let (Some(g), Some(v)) = (&cpu, s.cpu_percent) {
                g.with_label_values(&l).set(v / 100.0);
            }
            if let (Some(g), Some(v)) = (&rss, s.rss_bytes) {
                g.with_label_values(&l).set(v as f64);
            }
            if let (Some(g), Some(v)) = (&cpu_s, s.cpu_seconds) {
                g.with_label_values(&l).set(v);
            }
        }
    }
    let mut families = c.metrics.registry.gather();
    families.extend(reg.gather());
    let mut buf = Vec::new();
    TextEncoder::new()
        .encode(&families, &mut buf)
        .map_err(|e| ControlError::Internal(format!("encoding metrics: {e}")))?;
    String::from_utf8(buf).map_err(|e| ControlError::Internal(format!("metrics text: {e}")))
}

/// `GET /metrics`: needs a token like the API (Prometheus sends it with `authorization: {credentials: ...}`).
/// `/metrics`: an admin's token sees every job's series, a team's token its own team's only (the node's capacity
/// and allocation are the same for all).
#[utoipa::path(
    get, path = "/metrics", tag = "meta",
    responses(
        (status = 200, description = "Prometheus text exposition: the server's own metrics, jobs, queues, the node, \
                                      running jobs' loss, step, throughput and workers' resources",
            body = String, content_type = "text/plain; version=0.0.4"),
        AuthErrors,
    )
)]
pub async fn prometheus(State(state): State<AppState>, caller: Caller) -> ApiResult<Response> {
    let team = (!caller.0.admin).then_some(caller.0.team.as_str());
    let text = scrape(&state.control, team).await?;
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response())
}
