//! The API through the router (no socket), the control loop ticked by hand, real task processes, against both
//! stores: SQLite in a temp directory and a real PostgreSQL server started for the test
//! (`scripts/test-postgres.sh`).

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use shoal_control::api::router;
use shoal_control::http::AppState;
use shoal_control::server::{Prepared, ServerOptions, prepare};
use tower::ServiceExt;

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-api-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A stand-in worker: its behaviour is read from `mode` next to it (`ok`, `fail`, `sleep`, `hog`).
fn fake_worker(dir: &Path) -> PathBuf {
    let p = dir.join("fake-worker.sh");
    std::fs::write(
        &p,
        "#!/bin/sh\nd=$(dirname \"$0\")\necho \"rank $SHOAL_RANK of $SHOAL_WORLD_SIZE job $SHOAL_JOB_ID args $*\"\n\
         echo \"step 1/1 loss 0.5 uid $(id -u)\"\ncase $(cat \"$d/mode\") in\n  ok) exit 0 ;;\n  fail) exit 3 ;;\n  \
         short) sleep 0.4; exit 0 ;;\n  sleep) exec sleep 60 ;;\n  hog) head -c 400000000 /dev/zero | tail -c 300000000 > /dev/null; exit 0 ;;\nesac\n",
    )
    .expect("write fake worker");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    p
}

fn set_mode(dir: &Path, mode: &str) {
    std::fs::write(dir.join("mode"), mode).expect("write mode");
}

struct Env {
    app: Router,
    p: Prepared,
    admin: String,
    dir: PathBuf,
}

async fn env(tag: &str, database: Option<String>) -> Env {
    env_with(tag, database, |_| {}).await
}

async fn env_with(tag: &str, database: Option<String>, tweak: impl FnOnce(&mut ServerOptions)) -> Env {
    let dir = tmpdir(tag);
    let worker = fake_worker(&dir);
    let mut opts = ServerOptions::new(&dir.join("data"), "127.0.0.1:0".parse().expect("addr"), &worker);
    opts.database = database;
    opts.cpus_milli = Some(4000);
    opts.memory_bytes = Some(8 << 30);
    opts.gpus = 8;
    opts.kill_grace = Duration::from_millis(500);
    opts.preempt_grace = Duration::from_secs(1);
    tweak(&mut opts);
    let p = prepare(&opts).await.expect("prepare the server");
    let app = router(AppState { control: p.control.clone(), auth: true });
    let admin = p.admin_token.clone();
    Env { app, p, admin, dir }
}

async fn call(
    app: &Router,
    method: &str,
    path: &str,
    token: Option<&str>,
    ct: &str,
    body: Vec<u8>,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(path).header("content-type", ct);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = app.clone().oneshot(req.body(Body::from(body)).expect("request")).await.expect("router answers");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v)
}

async fn get(app: &Router, path: &str, token: &str) -> (StatusCode, Value) {
    call(app, "GET", path, Some(token), "application/json", Vec::new()).await
}

async fn submit(app: &Router, token: &str, toml: &str) -> (StatusCode, Value) {
    call(app, "POST", "/api/v1/jobs", Some(token), "application/toml", toml.as_bytes().to_vec()).await
}

const JOB: &str = r#"
name = "tiny"
[workers]
count = 2
[resources]
cpus = 1
memory = "256MiB"
[fault_tolerance]
max_restarts = 1
backoff = "0s"
[train]
model = "mlp"
dataset = "digits"
global_batch = 8
steps = 2
lr = 0.01
"#;

fn job_with(extra_top: &str, replace: &[(&str, &str)]) -> String {
    let mut s = format!("{extra_top}\n{JOB}");
    for (a, b) in replace {
        s = s.replace(a, b);
    }
    s
}

async fn tick_until(e: &Env, id: &str, want: &str, limit: Duration) -> Value {
    let t0 = Instant::now();
    loop {
        e.p.control.tick().await.expect("tick");
        let (st, v) = get(&e.app, &format!("/api/v1/jobs/{id}"), &e.admin).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        if v["state"] == want {
            return v;
        }
        assert!(t0.elapsed() < limit, "job {id} did not reach {want} within {limit:?}: {v:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn pid_alive(pid: i64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').and_then(|(_, r)| r.trim_start().chars().next()))
        .is_some_and(|c| c != 'Z' && c != 'X')
}

// ---------------------------------------------------------------------------------------------------------------

async fn bad_input_is_a_4xx_naming_the_field(e: &Env) {
    let a = &e.app;
    let t = e.admin.as_str();
    let cases: Vec<(String, &str, StatusCode, Option<&str>, &str)> = vec![
        (job_with("", &[("steps = 2", "stepz = 2")]), "application/toml", StatusCode::BAD_REQUEST, Some("train"), "stepz"),
        (job_with("", &[("steps = 2", "steps = \"many\"")]), "application/toml", StatusCode::BAD_REQUEST, Some("train.steps"), ""),
        (job_with("", &[("cpus = 1", "cpus = -1")]), "application/toml", StatusCode::BAD_REQUEST, Some("resources.cpus"), "negative"),
        (job_with("", &[("count = 2", "min = 3\nmax = 2")]), "application/toml", StatusCode::BAD_REQUEST, Some("workers.min"), "greater than max"),
        (job_with("", &[("memory = \"256MiB\"", "memory = \"256MiB\"\ngpus = 16")]), "application/toml", StatusCode::BAD_REQUEST, Some("resources.gpus"), "can never run: asks 16 GPUs per task, the largest node has 8 GPUs"),
        (job_with("", &[("count = 2", "count = 5")]), "application/toml", StatusCode::BAD_REQUEST, Some("workers"), "can never run"),
        (job_with("queue = \"gpu-big\"", &[]), "application/toml", StatusCode::BAD_REQUEST, Some("queue"), "no queue"),
        (job_with("", &[("name = \"tiny\"", "name = \"../../etc/passwd\"")]), "application/toml", StatusCode::BAD_REQUEST, Some("name"), ""),
        ("name = \"x\"\n[train\nmodel=".into(), "application/toml", StatusCode::BAD_REQUEST, None, "line"),
        ("{\"name\": \"x\", \"train\": ".into(), "application/json", StatusCode::BAD_REQUEST, None, ""),
        (r#"{"name": "x", "train": {"model": "mlp", "dataset": "digits", "global_batch": 8, "steps": 2, "lr": 0.1}, "bogus": 1}"#.into(), "application/json", StatusCode::BAD_REQUEST, None, "bogus"),
        ("x".repeat(2 << 20), "application/json", StatusCode::PAYLOAD_TOO_LARGE, None, ""),
    ];
    for (body, ct, want, field, text) in cases {
        let (st, v) = call(a, "POST", "/api/v1/jobs", Some(t), ct, body.clone().into_bytes()).await;
        let head: String = body.chars().take(80).collect();
        assert_eq!(st, want, "{head:?} -> {v}");
        assert!(v["error"].is_string(), "not a JSON error: {v}");
        if let Some(f) = field {
            let got = v["field"].as_str().unwrap_or("");
            assert!(got.starts_with(f), "{head:?}: field {got:?}, want {f:?} ({v})");
        }
        assert!(v["error"].as_str().unwrap_or("").contains(text), "{head:?}: {v}");
    }
    // Paths and queries.
    for (path, want) in [
        ("/api/v1/jobs/..%2F..%2Fetc%2Fpasswd", StatusCode::NOT_FOUND),
        ("/api/v1/jobs/j-00000000", StatusCode::NOT_FOUND),
        ("/api/v1/jobs/j-zz/logs", StatusCode::NOT_FOUND),
        ("/api/v1/jobs?state=bogus", StatusCode::BAD_REQUEST),
        ("/api/v1/jobs?limit=abc", StatusCode::BAD_REQUEST),
        ("/api/v1/nowhere", StatusCode::NOT_FOUND),
    ] {
        let (st, v) = get(a, path, t).await;
        assert_eq!(st, want, "{path}: {v}");
        assert!(v["error"].is_string(), "{path}: {v}");
    }
    // The server still serves.
    let (st, v) = get(a, "/healthz", t).await;
    assert_eq!(st, StatusCode::OK, "{v}");
}

async fn auth_isolates_teams(e: &Env) {
    let a = &e.app;
    let (st, v) = call(a, "GET", "/api/v1/jobs", None, "application/json", Vec::new()).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED, "{v}");
    let (st, _) = call(a, "GET", "/api/v1/jobs", Some("shoal_not-a-token"), "application/json", Vec::new()).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let mut tokens = Vec::new();
    for (user, team) in [("alice", "vision"), ("bob", "nlp")] {
        let body = json!({ "user": user, "team": team }).to_string().into_bytes();
        let (st, v) = call(a, "POST", "/api/v1/tokens", Some(&e.admin), "application/json", body).await;
        assert_eq!(st, StatusCode::CREATED, "{v}");
        tokens.push(v["token"].as_str().expect("token").to_owned());
    }
    let (alice, bob) = (&tokens[0], &tokens[1]);
    let body = json!({ "user": "mallory", "team": "nlp", "admin": true }).to_string().into_bytes();
    let (st, _) = call(a, "POST", "/api/v1/tokens", Some(alice), "application/json", body).await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let (st, v) = get(a, "/api/v1/whoami", alice).await;
    assert_eq!((st, v["team"].as_str()), (StatusCode::OK, Some("vision")));

    let (st, v) = submit(a, alice, JOB).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    let (st, v) = get(a, &format!("/api/v1/jobs/{id}"), alice).await;
    assert_eq!((st, v["team"].as_str(), v["user"].as_str()), (StatusCode::OK, Some("vision"), Some("alice")));
    let (st, _) = get(a, &format!("/api/v1/jobs/{id}"), bob).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "another team's job must look missing");
    let (st, _) =
        call(a, "POST", &format!("/api/v1/jobs/{id}/cancel"), Some(bob), "application/json", Vec::new()).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, _) = get(a, &format!("/api/v1/jobs/{id}/logs"), bob).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (_, v) = get(a, "/api/v1/jobs", bob).await;
    assert!(v["jobs"].as_array().expect("jobs").iter().all(|j| j["id"] != id.as_str()), "{v}");
    let (st, _) = get(a, "/api/v1/jobs?team=vision", bob).await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    for tok in [alice.as_str(), e.admin.as_str()] {
        let (_, v) = get(a, "/api/v1/jobs", tok).await;
        assert!(v["jobs"].as_array().expect("jobs").iter().any(|j| j["id"] == id.as_str()), "{v}");
    }
    // Alice cancels her own pending job.
    let (st, v) =
        call(a, "POST", &format!("/api/v1/jobs/{id}/cancel"), Some(alice), "application/json", Vec::new()).await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    tick_until(e, &id, "cancelled", Duration::from_secs(30)).await;
}

async fn lifecycle_with_real_processes(e: &Env) {
    let a = &e.app;
    let t = e.admin.as_str();
    // Success: both ranks exit 0.
    set_mode(&e.dir, "ok");
    let (st, v) = submit(a, t, JOB).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    let v = tick_until(e, &id, "succeeded", Duration::from_secs(60)).await;
    let workers = v["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 2, "{v}");
    for (r, w) in workers.iter().enumerate() {
        assert_eq!(w["rank"], r as i64);
        assert_eq!(w["exit_code"], 0, "{w}");
        assert!(w["pid"].as_i64().is_some_and(|p| p > 1), "{w}");
    }
    let kinds: Vec<&str> = v["events"].as_array().expect("events").iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds, ["submitted", "placed", "started", "succeeded"], "{v:#}");
    let (st, log) = get(a, &format!("/api/v1/jobs/{id}/logs?rank=1"), t).await;
    assert_eq!(st, StatusCode::OK);
    let log = log.as_str().unwrap_or_default().to_owned();
    assert!(log.contains(&format!("rank 1 of 2 job {id} args worker --output")), "{log}");
    let (st, v) = get(a, &format!("/api/v1/jobs/{id}/logs?rank=7"), t).await;
    assert_eq!((st, v["field"].as_str()), (StatusCode::BAD_REQUEST, Some("rank")), "{v}");
    let (st, v) = call(a, "POST", &format!("/api/v1/jobs/{id}/cancel"), Some(t), "application/json", Vec::new()).await;
    assert_eq!(st, StatusCode::CONFLICT, "cancelling a finished job: {v}");

    // Failure: restarted once by policy, then failed with the rank and status named.
    set_mode(&e.dir, "fail");
    let (_, v) = submit(a, t, JOB).await;
    let id = v["id"].as_str().expect("id").to_owned();
    let v = tick_until(e, &id, "failed", Duration::from_secs(60)).await;
    assert_eq!(v["restarts"], 1, "{v:#}");
    assert_eq!(v["attempt"], 2, "{v:#}");
    let reason = v["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("exited with status 3") && reason.contains("no restarts left"), "{reason}");
    let kinds: Vec<&str> = v["events"].as_array().expect("events").iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds, ["submitted", "placed", "started", "restarted", "placed", "started", "failed"], "{v:#}");

    // Cancel a running job: every process goes.
    set_mode(&e.dir, "sleep");
    let (_, v) = submit(a, t, JOB).await;
    let id = v["id"].as_str().expect("id").to_owned();
    let v = tick_until(e, &id, "running", Duration::from_secs(30)).await;
    let pids: Vec<i64> = v["workers"].as_array().expect("workers").iter().filter_map(|w| w["pid"].as_i64()).collect();
    assert_eq!(pids.len(), 2);
    assert!(pids.iter().all(|&p| pid_alive(p)));
    let (st, _) = call(a, "POST", &format!("/api/v1/jobs/{id}/cancel"), Some(t), "application/json", Vec::new()).await;
    assert_eq!(st, StatusCode::ACCEPTED);
    tick_until(e, &id, "cancelled", Duration::from_secs(30)).await;
    assert!(pids.iter().all(|&p| !pid_alive(p)), "a cancelled job's process survived: {pids:?}");

    // Over its memory: killed with a reason that says so.
    set_mode(&e.dir, "hog");
    let hog = job_with(
        "",
        &[("memory = \"256MiB\"", "memory = \"64MiB\""), ("max = 1", "max = 0"), ("count = 2", "count = 1")],
    );
    let (st, v) = submit(a, t, &hog).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    let v = tick_until(e, &id, "failed", Duration::from_secs(60)).await;
    let reason = v["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("over its request") && reason.contains("resources.memory"), "{v:#}");

    // Queues and nodes describe the one local node.
    let (_, v) = get(a, "/api/v1/queues", t).await;
    assert_eq!(v["queues"][0]["name"], "default", "{v}");
    let (_, v) = get(a, "/api/v1/nodes", t).await;
    assert_eq!(v["nodes"][0]["cpus"], 4.0, "{v}");
    assert_eq!(v["nodes"][0]["gpus"].as_array().map(Vec::len), Some(8), "{v}");

    // Metrics ingestion and reading back.
    let batch = json!({ "metrics": [
        { "rank": 0, "step": 1, "time_ms": 1, "data": { "step": 1, "loss": 2.5 } },
        { "rank": 0, "step": 2, "time_ms": 2, "data": { "step": 2, "loss": 2.0 } },
    ]});
    let (st, v) = call(
        a,
        "POST",
        &format!("/api/v1/jobs/{id}/metrics"),
        Some(t),
        "application/json",
        batch.to_string().into_bytes(),
    )
    .await;
    assert_eq!((st, v["stored"].as_i64()), (StatusCode::OK, Some(2)), "{v}");
    let (st, v) = call(
        a,
        "POST",
        &format!("/api/v1/jobs/{id}/metrics"),
        Some(t),
        "application/json",
        batch.to_string().into_bytes(),
    )
    .await;
    assert_eq!((st, v["stored"].as_i64()), (StatusCode::OK, Some(0)), "a repeated batch is stored once: {v}");
    // A line is a JSON object: anything else is refused, naming it, and never stored.
    let odd = json!({ "metrics": [{ "rank": 0, "step": 3, "time_ms": 3, "data": [null, null] }] });
    let (st, v) = call(
        a,
        "POST",
        &format!("/api/v1/jobs/{id}/metrics"),
        Some(t),
        "application/json",
        odd.to_string().into_bytes(),
    )
    .await;
    assert_eq!((st, v["field"].as_str()), (StatusCode::BAD_REQUEST, Some("metrics[0].data")), "{v}");
    let (_, v) = get(a, &format!("/api/v1/jobs/{id}/metrics?after=1"), t).await;
    assert_eq!(v["metrics"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v["metrics"][0]["data"]["loss"], 2.0, "{v}");

    // Resource samples, thinned to about max_points per rank, however large the number asked for.
    let rows: Vec<shoal_control::db::SampleRow> = (0..40)
        .map(|i| shoal_control::db::SampleRow {
            rank: i % 2,
            time_ms: 1_000 + i,
            cpu_percent: Some(50.0),
            rss_bytes: Some(1 << 20),
            cpu_seconds: None,
            net_rx_bytes_per_s: None,
            net_tx_bytes_per_s: None,
            gpu_util_percent: None,
            gpu_memory_bytes: None,
            gpu_temperature_c: None,
            gpu_power_w: None,
        })
        .collect();
    e.p.control.db.insert_samples(&id, &rows).await.expect("insert samples");
    let (st, v) = get(a, &format!("/api/v1/jobs/{id}/samples?max_points=5"), t).await;
    let n = v["samples"].as_array().map_or(0, Vec::len);
    assert!(st == StatusCode::OK && (10..=12).contains(&n), "{n} samples for 5 per rank: {v}");
    let (st, v) = get(a, &format!("/api/v1/jobs/{id}/samples?max_points={}", usize::MAX), t).await;
    assert_eq!((st, v["samples"].as_array().map(Vec::len)), (StatusCode::OK, Some(40)), "{v}");
}

/// A job of higher priority preempts a running one: the victim gets SIGTERM and its grace period, goes back to the
/// queue (`preempted`, then `requeued`), and starts again once the room is free.
async fn preemption_by_priority(e: &Env) {
    let a = &e.app;
    let t = e.admin.as_str();
    set_mode(&e.dir, "sleep");
    let low = job_with("priority = 0", &[("count = 2", "count = 4"), ("name = \"tiny\"", "name = \"low\"")]);
    let (st, v) = submit(a, t, &low).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let low_id = v["id"].as_str().expect("id").to_owned();
    let v = tick_until(e, &low_id, "running", Duration::from_secs(30)).await;
    let low_pids: Vec<i64> =
        v["workers"].as_array().expect("workers").iter().filter_map(|w| w["pid"].as_i64()).collect();
    let high = job_with("priority = 10", &[("name = \"tiny\"", "name = \"high\"")]);
    let (st, v) = submit(a, t, &high).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let high_id = v["id"].as_str().expect("id").to_owned();
    let v = tick_until(e, &high_id, "running", Duration::from_secs(60)).await;
    assert_eq!(v["workers"].as_array().map(Vec::len), Some(2), "{v:#}");
    assert!(
        low_pids.iter().all(|&p| !pid_alive(p)),
        "the preempted job's workers must be gone before the other starts"
    );
    let (_, v) = get(a, &format!("/api/v1/jobs/{low_id}"), t).await;
    assert_eq!(v["state"], "pending", "{v:#}");
    let kinds: Vec<&str> = v["events"].as_array().expect("events").iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds, ["submitted", "placed", "started", "preempted", "requeued"], "{v:#}");
    let why = v["events"][3]["message"].as_str().unwrap_or_default();
    assert!(why.contains(&high_id) && why.contains("higher priority"), "{why}");
    // When the high-priority job ends, the victim runs again (attempt 2, not counted as a restart).
    for id in [&high_id, &low_id] {
        let (st, _) =
            call(a, "POST", &format!("/api/v1/jobs/{id}/cancel"), Some(t), "application/json", Vec::new()).await;
        assert_eq!(st, StatusCode::ACCEPTED);
        if id == &high_id {
            tick_until(e, id, "cancelled", Duration::from_secs(30)).await;
        }
    }
    let v = tick_until(e, &low_id, "cancelled", Duration::from_secs(30)).await;
    assert_eq!(v["restarts"], 0, "{v:#}");
}

async fn suite(tag: &str, database: Option<String>) {
    let e = env(tag, database).await;
    let (st, v) = get(&e.app, "/healthz", &e.admin).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    bad_input_is_a_4xx_naming_the_field(&e).await;
    auth_isolates_teams(&e).await;
    lifecycle_with_real_processes(&e).await;
    if tag == "sqlite" {
        preemption_by_priority(&e).await;
    }
    let _ = std::fs::remove_dir_all(&e.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_and_lifecycle_on_sqlite() {
    suite("sqlite", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_and_lifecycle_on_postgres() {
    let pg = support::postgres::Postgres::start().expect("start a PostgreSQL server for the test");
    suite("postgres", Some(pg.url.clone())).await;
    // The state lives in PostgreSQL: a second server on a new data directory sees the jobs.
    let e = env("postgres-2", Some(pg.url.clone())).await;
    let (_, v) = get(&e.app, "/api/v1/jobs", &e.admin).await;
    assert!(v["jobs"].as_array().map_or(0, Vec::len) >= 5, "{v}");
    let _ = std::fs::remove_dir_all(&e.dir);
}

#[tokio::test]
async fn a_data_directory_serves_one_server_at_a_time() {
    let dir = tmpdir("lock");
    let opts = ServerOptions::new(&dir, "127.0.0.1:0".parse().expect("addr"), Path::new("/bin/true"));
    let first = prepare(&opts).await.expect("first server");
    let err = prepare(&opts).await.expect_err("a second server on the same data directory");
    assert!(err.to_string().contains(&dir.display().to_string()), "{err}");
    let token = std::fs::read_to_string(dir.join("admin.token")).expect("admin.token");
    assert_eq!(token.trim(), first.admin_token);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.join("admin.token")).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let mut bad = opts.clone();
    bad.no_auth = true;
    bad.listen = "0.0.0.0:0".parse().expect("addr");
    drop(first);
    let err = prepare(&bad).await.expect_err("no auth on a public address");
    assert!(err.to_string().contains("without authentication"), "{err}");
}

// ---------------------------------------------------------------------------------------------------------------
// hardening: what one team can reach, what tasks run as, what a hostile client can hold

async fn new_token_for(e: &Env, user: &str, team: &str) -> String {
    let body = json!({ "user": user, "team": team }).to_string().into_bytes();
    let (st, v) = call(&e.app, "POST", "/api/v1/tokens", Some(&e.admin), "application/json", body).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    v["token"].as_str().expect("token").to_owned()
}

fn field_of(v: &Value) -> &str {
    v["field"].as_str().unwrap_or("")
}

fn mode_of(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).map(|m| m.permissions().mode() & 0o777).unwrap_or(0)
}

/// The uid tasks must run as here: the `shoal` system user when the tests run as root, else our own.
fn expected_task_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if me != 0 {
        return me;
    }
    shoal_exec::TaskUser::lookup("shoal").map_or(u32::MAX, |u| u.uid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_team_never_reaches_another_teams_data() {
    let store = tmpdir("confine-store");
    let root = store.clone();
    let e = env_with("confine", None, move |o| o.policy.storage_root = Some(root)).await;
    let a = &e.app;
    let alpha = new_token_for(&e, "alice", "alpha").await;
    let beta = new_token_for(&e, "bob", "beta").await;
    let data = e.dir.join("data");

    // Alpha's job runs, as the unprivileged task user, and leaves checkpoints-to-be in its own directory.
    set_mode(&e.dir, "ok");
    let (st, v) = submit(a, &alpha, JOB).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let alpha_id = v["id"].as_str().expect("id").to_owned();
    let v = tick_until(&e, &alpha_id, "succeeded", Duration::from_secs(60)).await;
    let (_, log) = get(a, &format!("/api/v1/jobs/{alpha_id}/logs?rank=0"), &alpha).await;
    let want = format!("uid {}", expected_task_uid());
    assert!(log.as_str().unwrap_or("").contains(&want), "tasks must run as {want}: {log}\n{v:#}");
    let alpha_dir = data.join("jobs").join(&alpha_id);

    // Beta cannot point its checkpoints at alpha's job, alpha's storage, or anywhere else on the host.
    for url in [
        alpha_dir.join("run").display().to_string(),
        format!("file://{}", alpha_dir.display()),
        store.join("alpha/run").display().to_string(),
        store.join("beta/../alpha/run").display().to_string(),
        "/etc/cron.d".into(),
        "relative/ckpt".into(),
        "s3://alpha-bucket/ckpt".into(),
    ] {
        let spec = job_with("", &[("lr = 0.01", &format!("lr = 0.01\n[checkpoint]\nurl = \"{url}\""))]);
        let (st, v) = submit(a, &beta, &spec).await;
        assert_eq!((st, field_of(&v)), (StatusCode::BAD_REQUEST, "checkpoint.url"), "{url}: {v}");
    }
    assert!(!store.join("alpha").exists(), "a refused spec created a directory in another team's storage");
    // Its own team directory is fine, once: a second job may not share (and resume) the first one's checkpoints.
    let own = store.join("beta/run1").display().to_string();
    let spec = job_with("", &[("lr = 0.01", &format!("lr = 0.01\n[checkpoint]\nurl = \"{own}\""))]);
    let (st, v) = submit(a, &beta, &spec).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let beta_id = v["id"].as_str().expect("id").to_owned();
    let (st, v) = submit(a, &beta, &spec).await;
    assert_eq!((st, field_of(&v)), (StatusCode::BAD_REQUEST, "checkpoint.url"), "{v}");
    assert!(v["error"].as_str().unwrap_or("").contains(&beta_id), "{v}");
    tick_until(&e, &beta_id, "succeeded", Duration::from_secs(60)).await;

    // Starting from a checkpoint: one of the team's own jobs, never another team's.
    let from = |dir: &Path| {
        job_with("", &[("lr = 0.01", &format!("lr = 0.01\n[checkpoint]\nresume_from = \"{}\"", dir.display()))])
    };
    let (st, v) = submit(a, &beta, &from(&alpha_dir.join("run/checkpoints"))).await;
    assert_eq!((st, field_of(&v)), (StatusCode::BAD_REQUEST, "checkpoint.resume_from"), "{v}");
    for bad in [Path::new("/etc"), &store.join("alpha/run")] {
        let (st, v) = submit(a, &beta, &from(bad)).await;
        assert_eq!((st, field_of(&v)), (StatusCode::BAD_REQUEST, "checkpoint.resume_from"), "{bad:?}: {v}");
    }
    let (st, v) = submit(a, &alpha, &from(&alpha_dir.join("run/checkpoints"))).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let (st, v) = call(
        a,
        "POST",
        &format!("/api/v1/jobs/{}/cancel", v["id"].as_str().unwrap_or("")),
        Some(&alpha),
        "application/json",
        vec![],
    )
    .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");

    // No loader tricks; a hostile PATH cannot stop the exit status from being recorded.
    let spec = format!("{JOB}\n[env]\nLD_PRELOAD = \"/tmp/evil.so\"\n");
    let (st, v) = submit(a, &beta, &spec).await;
    assert_eq!((st, field_of(&v)), (StatusCode::BAD_REQUEST, "env.LD_PRELOAD"), "{v}");
    let (st, v) = submit(a, &beta, &format!("{JOB}\n[env]\nPATH = \"/nonexistent\"\n")).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    let v = tick_until(&e, &id, "succeeded", Duration::from_secs(60)).await;
    assert!(v["workers"].as_array().expect("workers").iter().all(|w| w["exit_code"] == 0), "{v:#}");

    // /metrics shows a team its own jobs only.
    set_mode(&e.dir, "sleep");
    let (_, v) = submit(a, &alpha, JOB).await;
    let running = v["id"].as_str().expect("id").to_owned();
    tick_until(&e, &running, "running", Duration::from_secs(60)).await;
    let (_, m) = get(a, "/metrics", &beta).await;
    let m = m.as_str().unwrap_or("").to_owned();
    assert!(m.contains("shoal_node_cpus") && !m.contains(&running), "beta sees alpha's job in /metrics:\n{m}");
    for tok in [&alpha, &e.admin] {
        let (_, m) = get(a, "/metrics", tok).await;
        assert!(m.as_str().unwrap_or("").contains(&running), "{m}");
    }
    // The token goes in a header; only the event streams take it in the query.
    let (st, _) = call(a, "GET", &format!("/api/v1/jobs?access_token={alpha}"), None, "application/json", vec![]).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, v) =
        call(a, "POST", &format!("/api/v1/jobs/{running}/cancel"), Some(&alpha), "application/json", vec![]).await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    tick_until(&e, &running, "cancelled", Duration::from_secs(30)).await;

    // Log reads are bounded, and attempts start at 1.
    let log = data.join("jobs").join(&alpha_id).join("attempt-1/rank-0.log");
    std::fs::write(&log, vec![b'x'; 3 << 20]).expect("a large log");
    let (st, body) = get(a, &format!("/api/v1/jobs/{alpha_id}/logs?rank=0"), &alpha).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(body.as_str().map(str::len), Some(shoal_control::http::MAX_LOG_CHUNK));
    let (st, v) = get(a, &format!("/api/v1/jobs/{alpha_id}/logs?attempt=0"), &alpha).await;
    assert_eq!((st, field_of(&v)), (StatusCode::BAD_REQUEST, "attempt"), "{v}");

    // Secrets at rest: the directory closed to others, its files to everyone but the server's user.
    let dir_mode = mode_of(&data);
    assert!(dir_mode == 0o700 || dir_mode == 0o710, "data directory mode {dir_mode:o}");
    for f in ["shoal.db", "server.key", "admin.token"] {
        assert_eq!(mode_of(&data.join(f)), 0o600, "{f}");
    }
    let (_, v) = get(a, &format!("/api/v1/jobs/{alpha_id}"), &e.admin).await;
    for hidden in ["secret", "checkpoint_key", "summary_json"] {
        assert!(v.get(hidden).is_none(), "{hidden} in {v}");
    }
    let w = &v["workers"][0];
    assert!(w.get("start_ticks").is_none() && w["pid"].is_i64() && w["wrapper_pid"].is_i64(), "{w}");
    let _ = std::fs::remove_dir_all(&e.dir);
    let _ = std::fs::remove_dir_all(&store);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_submits_and_cancels_never_run_a_job_twice() {
    let e = env_with("storm", None, |o| o.tick = Duration::from_millis(20)).await;
    set_mode(&e.dir, "short");
    let (tx, rx) = tokio::sync::watch::channel(false);
    let looping = tokio::spawn(e.p.control.clone().run(rx));
    let spec = job_with("", &[("max = 1", "max = 0"), ("count = 2", "min = 1\nmax = 2")]);
    let mut clients = Vec::new();
    for c in 0..6 {
        let (app, token, spec) = (e.app.clone(), e.admin.clone(), spec.clone());
        clients.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for j in 0..6 {
                let (st, v) = submit(&app, &token, &spec).await;
                assert_eq!(st, StatusCode::CREATED, "{v}");
                let id = v["id"].as_str().expect("id").to_owned();
                if (c + j) % 2 == 0 {
                    tokio::time::sleep(Duration::from_millis(((c * 7 + j * 13) % 40) as u64)).await;
                    let (st, v) = call(
                        &app,
                        "POST",
                        &format!("/api/v1/jobs/{id}/cancel"),
                        Some(&token),
                        "application/json",
                        vec![],
                    )
                    .await;
                    assert!(st == StatusCode::ACCEPTED || st == StatusCode::CONFLICT, "{st} {v}");
                }
                ids.push(id);
            }
            ids
        }));
    }
    let mut ids = Vec::new();
    for c in clients {
        ids.extend(c.await.expect("client"));
    }
    let t0 = Instant::now();
    let jobs = loop {
        let (_, v) = get(&e.app, "/api/v1/jobs", &e.admin).await;
        let jobs = v["jobs"].as_array().cloned().unwrap_or_default();
        let open = jobs
            .iter()
            .filter(|j| !["succeeded", "failed", "cancelled"].contains(&j["state"].as_str().unwrap_or("")))
            .count();
        if open == 0 && jobs.len() == ids.len() {
            break jobs;
        }
        assert!(t0.elapsed() < Duration::from_secs(180), "{open} jobs still open: {v:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let _ = tx.send(true);
    let _ = looping.await;
    for j in &jobs {
        let id = j["id"].as_str().expect("id");
        let (_, v) = get(&e.app, &format!("/api/v1/jobs/{id}"), &e.admin).await;
        let attempt = v["attempt"].as_i64().unwrap_or(-1);
        assert!(attempt <= 1, "job {id} ran {attempt} times: {v:#}");
        let dirs = std::fs::read_dir(e.dir.join("data/jobs").join(id))
            .map(|d| d.flatten().filter(|f| f.file_name().to_string_lossy().starts_with("attempt-")).count())
            .unwrap_or(0);
        assert_eq!(dirs as i64, attempt, "job {id}: attempt directories vs attempts: {v:#}");
        match v["state"].as_str() {
            Some("succeeded") => assert_eq!(attempt, 1, "{v:#}"),
            Some("cancelled") if attempt == 0 => {
                assert!(!e.dir.join("data/jobs").join(id).join("run/summary.json").exists(), "{v:#}")
            }
            Some("cancelled") => {}
            other => panic!("job {id} ended {other:?}: {v:#}"),
        }
    }
    let leftover: Vec<i64> = own_processes(&e.dir.join("data"));
    assert!(leftover.is_empty(), "processes left behind: {leftover:?}");
    let alloc = e.p.control.allocations();
    assert!(alloc.iter().all(|a| a.cpus_milli == 0 && a.memory_bytes == 0), "allocations left: {alloc:?}");
    let _ = std::fs::remove_dir_all(&e.dir);
}

/// Processes whose environment names this data directory.
fn own_processes(data: &Path) -> Vec<i64> {
    let want = format!("SHOAL_SERVER_DATA={}", data.display());
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i64>().ok())
                .filter(|pid| {
                    std::fs::read(format!("/proc/{pid}/environ"))
                        .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == want.as_bytes()))
                        && pid_alive(*pid)
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_cannot_be_processed_does_not_stall_the_others() {
    let e = env("isolated", None).await;
    set_mode(&e.dir, "ok");
    let (_, v) = submit(&e.app, &e.admin, JOB).await;
    let broken = v["id"].as_str().expect("id").to_owned();
    // Its directory is gone, and a file sits where it was: every attempt to start it fails.
    let dir = e.dir.join("data/jobs").join(&broken);
    std::fs::remove_dir_all(&dir).expect("remove the job directory");
    std::fs::write(&dir, b"not a directory").expect("a file in its place");
    let (_, v) = submit(&e.app, &e.admin, JOB).await;
    let healthy = v["id"].as_str().expect("id").to_owned();
    tick_until(&e, &healthy, "succeeded", Duration::from_secs(60)).await;
    let v = tick_until(&e, &broken, "failed", Duration::from_secs(60)).await;
    assert!(v["reason"].as_str().unwrap_or("").contains("directory"), "{v:#}");
    let _ = std::fs::remove_dir_all(&e.dir);
}

#[tokio::test]
async fn a_damaged_database_is_never_taken_for_a_new_one() {
    let dir = tmpdir("damaged");
    let opts = ServerOptions::new(&dir, "127.0.0.1:0".parse().expect("addr"), Path::new("/bin/true"));
    let db = dir.join("shoal.db");
    let first = prepare(&opts).await.expect("first start");
    first.control.db.close().await;
    drop(first);
    let good = std::fs::read(&db).expect("the database");
    assert!(good.len() >= 8 * 4096, "the log was not folded into the file: {} bytes", good.len());
    std::fs::create_dir_all(dir.join("jobs/j-00000001")).expect("a job directory");
    // Empty, not a database, damaged inside, missing beside a job history.
    let mut inside = good.clone();
    let (mid, len) = (inside.len() / 2, inside.len());
    for b in &mut inside[4096.min(mid)..len.saturating_sub(4096).max(mid)] {
        *b = 0xA5;
    }
    for (what, bytes, want) in [
        ("empty", Some(Vec::new()), "empty"),
        ("garbage", Some(b"this is not a database, not even close".repeat(200)), "not a database"),
        ("damaged inside", Some(inside.clone()), "damaged"),
        ("missing", None, "missing"),
    ] {
        for f in [db.clone(), dir.join("shoal.db-wal"), dir.join("shoal.db-shm")] {
            let _ = std::fs::remove_file(f);
        }
        if let Some(b) = &bytes {
            std::fs::write(&db, b).expect("write");
        }
        let err = prepare(&opts).await.expect_err(what);
        let msg = err.to_string();
        assert!(
            msg.contains(&db.display().to_string()) && msg.contains(want) && msg.contains("--init"),
            "{what}: {msg}"
        );
        if let Some(b) = &bytes {
            assert_eq!(&std::fs::read(&db).expect("kept"), b, "{what}: the file must be left as it was");
        }
    }
    // --init starts afresh and keeps the damaged file beside it, whether the damage shows at once or inside.
    let mut init = opts.clone();
    init.init = true;
    for bytes in [b"garbage".to_vec(), inside.clone()] {
        std::fs::write(&db, &bytes).expect("write");
        let p = prepare(&init).await.expect("--init");
        p.control.db.close().await;
        drop(p);
    }
    let kept = std::fs::read_dir(&dir)
        .expect("dir")
        .flatten()
        .any(|f| f.file_name().to_string_lossy().starts_with("shoal.db.damaged-"));
    assert!(kept, "the damaged file must be kept");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_is_cut_off() {
    use std::io::{Read, Write};
    let dir = tmpdir("slow");
    let opts = ServerOptions::new(&dir, "127.0.0.1:0".parse().expect("addr"), Path::new("/bin/true"));
    let server = shoal_control::start(opts).await.expect("server");
    let addr = server.addr;
    let held = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_millis(900))).expect("timeout");
        let t0 = Instant::now();
        for b in
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa".iter().cycle()
        {
            if s.write_all(&[*b]).is_err() {
                break;
            }
            let mut buf = [0u8; 512];
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => break,
            }
            if t0.elapsed() > Duration::from_secs(40) {
                break;
            }
        }
        t0.elapsed()
    })
    .await
    .expect("client");
    let limit = shoal_control::server::HEADER_TIMEOUT + Duration::from_secs(3);
    assert!(held <= limit, "a client sending a byte a second was held for {held:?} (limit {limit:?})");
    server.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_body_that_never_arrives_is_answered_408() {
    let e = env("body", None).await;
    // A body over the limit with no length declared (chunked) is refused as it streams in.
    let chunks = futures_util::stream::iter(
        (0..3).map(|_| Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b'x'; 1 << 20]))),
    );
    let req = Request::builder()
        .method("POST")
        .uri("/api/v1/jobs")
        .header("content-type", "application/toml")
        .header("authorization", format!("Bearer {}", e.admin))
        .body(Body::from_stream(chunks))
        .expect("request");
    let resp = e.app.clone().oneshot(req).await.expect("router answers");
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // The server's clock from here on: its body deadline passes without the test waiting for it.
    tokio::time::pause();
    let never = futures_util::stream::pending::<std::result::Result<axum::body::Bytes, std::io::Error>>();
    let req = Request::builder()
        .method("POST")
        .uri("/api/v1/jobs")
        .header("content-type", "application/toml")
        .header("content-length", "100")
        .header("authorization", format!("Bearer {}", e.admin))
        .body(Body::from_stream(never))
        .expect("request");
    let resp = e.app.clone().oneshot(req).await.expect("router answers");
    assert_eq!(resp.status(), StatusCode::REQUEST_TIMEOUT);
    let _ = std::fs::remove_dir_all(&e.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_program_the_task_user_cannot_reach_runs_from_a_copy() {
    use std::os::unix::fs::PermissionsExt;
    let e = env_with("private", None, |o| {
        // The program sits in a directory only its owner may enter (a checkout under a private home, say).
        let private = o.worker_program.parent().expect("dir").join("private");
        std::fs::create_dir_all(&private).expect("private dir");
        let program = private.join("fake-worker.sh");
        std::fs::copy(&o.worker_program, &program).expect("copy the program");
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        o.worker_program = program;
    })
    .await;
    let (st, v) = submit(&e.app, &e.admin, JOB).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    let v = tick_until(&e, &id, "succeeded", Duration::from_secs(60)).await;
    assert!(v["workers"].as_array().expect("workers").iter().all(|w| w["exit_code"] == 0), "{v:#}");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        assert!(e.dir.join("data/bin/fake-worker.sh").exists(), "the task user's copy of the program");
    }
    let _ = std::fs::remove_dir_all(&e.dir);
}
