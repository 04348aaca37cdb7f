//! The control loop's decisions against a scripted executor (`shoal_exec::fake`): tasks start, exit, vanish, refuse
//! to start or cannot be probed on command, with no process behind them. The store is a real SQLite database; the
//! jobs are submitted through the API's router. Real processes are the business of `tests/api.rs`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use shoal_control::api::router;
use shoal_control::db::JobState;
use shoal_control::http::AppState;
use shoal_control::server::{Prepared, ServerOptions, prepare};
use shoal_exec::fake::FakeExecutor;
use shoal_exec::{Executor, Stop};
use tower::ServiceExt;

struct Env {
    app: axum::Router,
    p: Prepared,
    fake: Arc<FakeExecutor>,
    dir: PathBuf,
}

async fn env(tag: &str) -> Env {
    env_with(tag, 0).await
}

/// A server (this host as its one node) with `gpus` GPUs of 16 GiB.
async fn env_with(tag: &str, gpus: u32) -> Env {
    let dir = std::env::temp_dir().join(format!("shoal-control-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let fake = Arc::new(FakeExecutor::new(&dir.join("logs")));
    let mut opts = ServerOptions::new(&dir.join("data"), "127.0.0.1:0".parse().expect("addr"), &dir.join("worker"));
    opts.cpus_milli = Some(4000);
    opts.memory_bytes = Some(8 << 30);
    opts.kill_grace = Duration::from_millis(100);
    opts.gpus = gpus;
    opts.gpu_memory_bytes = 16 << 30;
    opts.executor = Some(fake.clone());
    // The fake runs nothing: no task user is needed.
    opts.task_user = users::me();
    let p = prepare(&opts).await.expect("prepare the server");
    let app = router(AppState { control: p.control.clone(), auth: true });
    Env { app, p, fake, dir }
}

mod users {
    /// This process's own user name, so the server starts its (fake) tasks as it is.
    pub fn me() -> Option<String> {
        // SAFETY: geteuid has no preconditions; getpwuid returns static storage or null, read at once.
        unsafe {
            let pw = libc::getpwuid(libc::geteuid());
            if pw.is_null() {
                return None;
            }
            std::ffi::CStr::from_ptr((*pw).pw_name).to_str().ok().map(str::to_owned)
        }
    }
}

fn job(name: &str, workers: u32, restarts: u32) -> String {
    format!(
        "name = \"{name}\"\n[workers]\ncount = {workers}\n[resources]\ncpus = 1\nmemory = \"256MiB\"\n[fault_tolerance]\n\
         max_restarts = {restarts}\nbackoff = \"0s\"\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\nglobal_batch = 8\nsteps = 2\nlr = 0.01\n"
    )
}

impl Env {
    async fn submit(&self, toml: &str) -> String {
        let req = Request::builder()
            .method("POST")
            .uri("/api/v1/jobs")
            .header("content-type", "application/toml")
            .header("authorization", format!("Bearer {}", self.p.admin_token))
            .body(Body::from(toml.to_owned()))
            .expect("request");
        let resp = self.app.clone().oneshot(req).await.expect("router answers");
        let status = resp.status();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        let v: Value = serde_json::from_slice(&bytes).expect("JSON");
        assert_eq!(status, StatusCode::CREATED, "{v}");
        v["id"].as_str().expect("an id").to_owned()
    }

    async fn tick(&self) {
        self.p.control.tick().await.expect("a tick never fails for one job's sake");
    }

    async fn state(&self, id: &str) -> JobState {
        self.p.control.db.job(id).await.expect("store").expect("the job").state
    }

    async fn reason(&self, id: &str) -> String {
        self.p.control.db.job(id).await.expect("store").expect("the job").reason
    }

    async fn events(&self, id: &str, kind: &str) -> Vec<String> {
        let all = self.p.control.db.events(id, 0).await.expect("events");
        all.into_iter().filter(|e| e.kind == kind).map(|e| e.message).collect()
    }
}

/// One job's supervision failing (its tasks cannot be probed; later, its directory vanishes before a restart) is
/// that job's trouble alone: every other job is still placed, supervised and finished, and the troubled job gets one
/// warning naming the cause — not one per tick.
#[tokio::test]
async fn one_jobs_failing_supervision_stalls_no_other_job() {
    let e = env("isolation").await;
    let blind = e.submit(&job("blind", 2, 0)).await;
    let steady = e.submit(&job("steady", 1, 0)).await;
    e.tick().await;
    assert_eq!(e.fake.running(&blind), vec![(1, 0), (1, 1)]);
    assert_eq!(e.fake.running(&steady), vec![(1, 0)]);
    // Submitted in the same millisecond, the two are placed in either order.
    let launches = e.fake.launches();
    let first = launches.iter().find(|l| l.job_id == blind).expect("blind's launch");
    assert_eq!(first.world_size, 2);
    assert!(first.argv.iter().any(|a| a == "worker"), "{:?}", first.argv);

    e.fake.fail_probes(&blind, "the cluster manager does not answer");
    e.fake.exit_job(&steady, 0);
    for _ in 0..3 {
        e.tick().await;
    }
    assert_eq!(e.state(&steady).await, JobState::Succeeded, "{}", e.reason(&steady).await);
    assert_eq!(e.state(&blind).await, JobState::Running, "an unanswered probe is not a task's end");
    let warnings = e.events(&blind, "warning").await;
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("the cluster manager does not answer"), "{warnings:?}");

    // Newcomers are still scheduled beside it, and finish.
    let later = e.submit(&job("later", 1, 0)).await;
    e.tick().await;
    assert_eq!(e.fake.running(&later), vec![(1, 0)]);
    e.fake.exit(&later, 0, 0);
    e.tick().await;
    assert_eq!(e.state(&later).await, JobState::Succeeded, "{}", e.reason(&later).await);

    // The executor answers again: the job is supervised as before.
    e.fake.heal_probes(&blind);
    e.fake.exit_job(&blind, 0);
    e.tick().await;
    assert_eq!(e.state(&blind).await, JobState::Succeeded, "{}", e.reason(&blind).await);

    // A job whose directory vanished before its restart fails naming what is missing; the others go on.
    let homeless = e.submit(&job("homeless", 1, 1)).await;
    let other = e.submit(&job("other", 1, 0)).await;
    e.tick().await;
    assert_eq!(e.fake.running(&homeless), vec![(1, 0)]);
    std::fs::remove_dir_all(e.p.control.job_dir(&homeless)).expect("remove the job directory");
    e.fake.exit(&homeless, 0, 3);
    for _ in 0..4 {
        e.tick().await;
    }
    assert_eq!(e.state(&homeless).await, JobState::Failed);
    let why = e.reason(&homeless).await;
    assert!(why.contains("job.json"), "{why}");
    assert_eq!(e.events(&homeless, "restarted").await.len(), 1, "the first failure used its one restart");
    assert_eq!(e.fake.started(&homeless), 1, "nothing started without its spec");
    assert_eq!(e.fake.running(&other), vec![(1, 0)]);
    e.fake.exit(&other, 0, 0);
    e.tick().await;
    assert_eq!(e.state(&other).await, JobState::Succeeded, "{}", e.reason(&other).await);
    let _ = std::fs::remove_dir_all(&e.dir);
}

/// A failing rank stops its whole gang (SIGTERM, then SIGKILL after the grace for a rank that ignores it), and the
/// job restarts — a new attempt of every rank — only once every task is gone; a lost rank counts as a failure.
#[tokio::test]
async fn a_failed_rank_stops_the_gang_before_the_restart() {
    let e = env("gang").await;
    let id = e.submit(&job("gang", 3, 2)).await;
    e.tick().await;
    assert_eq!(e.fake.running(&id).len(), 3);
    e.fake.ignore_term(&id);
    e.fake.exit(&id, 1, 7);
    e.tick().await;
    // Ranks 0 and 2 were asked to stop and ignore it: the job is still running, nothing new started.
    assert_eq!(e.state(&id).await, JobState::Running);
    assert_eq!(e.fake.started(&id), 3);
    let terms: Vec<i64> = e.fake.stops(&id).iter().filter(|s| s.2 == Stop::Term).map(|s| s.1).collect();
    assert!(terms.contains(&0) && terms.contains(&2), "{terms:?}");
    tokio::time::sleep(Duration::from_millis(150)).await;
    e.tick().await;
    let kills: Vec<i64> = e.fake.stops(&id).iter().filter(|s| s.2 == Stop::Kill).map(|s| s.1).collect();
    assert_eq!(kills, vec![0, 2], "SIGKILL after the grace");
    e.tick().await;
    e.tick().await;
    assert_eq!(e.fake.running(&id), vec![(2, 0), (2, 1), (2, 2)], "attempt 2, every rank");
    let restarted = e.events(&id, "restarted").await;
    assert!(restarted.iter().any(|m| m.contains("rank 1 exited with status 7")), "{restarted:?}");

    // A rank that vanishes without an exit status is lost: the second restart.
    assert!(e.fake.vanish(&id, 2));
    for _ in 0..5 {
        e.tick().await;
        tokio::time::sleep(Duration::from_millis(120)).await;
    }
    assert_eq!(e.fake.running(&id).len(), 3);
    assert!(e.fake.running(&id).iter().all(|t| t.0 == 3), "{:?}", e.fake.running(&id));
    let restarted = e.events(&id, "restarted").await;
    assert!(restarted.iter().any(|m| m.contains("rank 2 was lost")), "{restarted:?}");
    e.fake.exit_job(&id, 0);
    e.tick().await;
    assert_eq!(e.state(&id).await, JobState::Succeeded);
    let tasks = e.p.control.db.tasks(&id, 3).await.expect("tasks");
    assert!(tasks.iter().all(|t| t.exit_code == Some(0)), "{tasks:?}");
    let _ = std::fs::remove_dir_all(&e.dir);
}

/// A task that cannot start fails its job with the executor's reason, after whatever of the gang started is
/// stopped; the job's budget of restarts decides what follows.
#[tokio::test]
async fn a_start_that_fails_half_way_is_undone() {
    let e = env("refuse").await;
    let id = e.submit(&job("refused", 2, 0)).await;
    e.fake.refuse_starts(&id, "no such node");
    e.tick().await;
    e.tick().await;
    assert_eq!(e.state(&id).await, JobState::Failed);
    let why = e.reason(&id).await;
    assert!(why.contains("could not start rank 0") && why.contains("no such node"), "{why}");
    assert!(e.fake.running(&id).is_empty());
    let _ = std::fs::remove_dir_all(&e.dir);
}

/// A placement that fails before anything is recorded (no rendezvous can be hosted) leaves the job pending and gives
/// the scheduler its resources back: once the executor can host one again, the job is placed and runs.
#[tokio::test]
async fn a_placement_that_cannot_begin_is_tried_again() {
    let e = env("rendezvous").await;
    e.fake.refuse_rendezvous(Some("no port free"));
    let id = e.submit(&job("patient", 2, 0)).await;
    for _ in 0..3 {
        e.tick().await;
    }
    assert_eq!(e.state(&id).await, JobState::Pending);
    assert_eq!(e.fake.started(&id), 0);
    e.fake.refuse_rendezvous(None);
    e.tick().await;
    e.tick().await;
    assert_eq!(e.fake.running(&id), vec![(1, 0), (1, 1)], "placed once the rendezvous can be hosted");
    e.fake.exit_job(&id, 0);
    e.tick().await;
    assert_eq!(e.state(&id).await, JobState::Succeeded, "{}", e.reason(&id).await);
    let _ = std::fs::remove_dir_all(&e.dir);
}

impl Env {
    async fn call(&self, method: &str, uri: &str, body: &str) -> (StatusCode, Value) {
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {}", self.p.admin_token))
            .body(Body::from(body.to_owned()))
            .expect("request");
        let resp = self.app.clone().oneshot(req).await.expect("router answers");
        let status = resp.status();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    async fn attempt(&self, id: &str) -> i64 {
        self.p.control.db.job(id).await.expect("store").expect("the job").attempt
    }

    /// Writes rank `rank`'s heartbeat as its worker would.
    fn beat(&self, id: &str, attempt: i64, rank: i64, hb: (u64, u64, &str, u64, bool)) {
        self.beat_in(id, attempt, rank, "train", hb);
    }

    /// [`Env::beat`] in another phase than `train`.
    fn beat_in(&self, id: &str, attempt: i64, rank: i64, phase: &str, hb: (u64, u64, &str, u64, bool)) {
        let (beat, step, op, seq, in_op) = hb;
        let v = serde_json::json!({
            "rank": rank, "attempt": attempt, "pid": 4000 + rank, "beat": beat, "time_ms": 0, "phase": phase,
            "step": step, "op": op, "seq": seq, "in_op": in_op, "op_s": 0.0, "ops_done": seq,
        });
        let dir = self.p.control.run_dir(id);
        std::fs::create_dir_all(&dir).expect("run dir");
        std::fs::write(dir.join(format!("heartbeat.rank-{rank}.json")), v.to_string()).expect("heartbeat");
    }
}

fn job_with(name: &str, workers: u32, fault_tolerance: &str) -> String {
    format!(
        "name = \"{name}\"\n[workers]\ncount = {workers}\n[resources]\ncpus = 1\nmemory = \"256MiB\"\n\
         [fault_tolerance]\n{fault_tolerance}\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\nglobal_batch = 8\n\
         steps = 2\nlr = 0.01\n"
    )
}

/// A worker killed through the chaos endpoint fails its rank (137); policy `restart` stops the gang and starts it
/// again only after the backoff, which doubles while attempts complete no step and is back to its base after one
/// that trained, the events saying what it waits for and why; after `max_restarts` the job fails naming the cause.
#[tokio::test]
async fn a_killed_worker_restarts_the_gang_after_a_doubling_backoff() {
    let e = env("backoff").await;
    let id = e.submit(&job_with("backoff", 2, "max_restarts = 3\nbackoff = \"1s\"")).await;
    e.tick().await;
    assert_eq!(e.fake.running(&id), vec![(1, 0), (1, 1)]);
    let (st, v) = e.call("POST", &format!("/api/v1/jobs/{id}/chaos"), r#"{"action": "kill", "rank": 1}"#).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!((v["rank"].as_i64(), v["action"].as_str(), v["attempt"].as_i64()), (Some(1), Some("kill"), Some(1)));
    assert_eq!(e.fake.faults(&id), vec![(1, 1, shoal_exec::Fault::Kill)]);
    let chaos = e.events(&id, "chaos").await;
    assert!(chaos.len() == 1 && chaos[0].contains("kill rank 1"), "{chaos:?}");
    e.tick().await;
    e.tick().await;
    let restarted = e.events(&id, "restarted").await;
    assert_eq!(restarted.len(), 1, "{restarted:?}");
    assert!(
        restarted[0].contains("rank 1 exited with status 137 (killed: SIGKILL)")
            && restarted[0].contains("restart 1 of 3")
            && restarted[0].contains("after a backoff of 1s (fault_tolerance.backoff = 1s)"),
        "{restarted:?}"
    );
    // Within the backoff nothing starts, however often the loop turns.
    e.tick().await;
    e.tick().await;
    assert_eq!(e.state(&id).await, JobState::Pending);
    assert_eq!(e.fake.started(&id), 2, "started again before its backoff was over");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    e.tick().await;
    e.tick().await;
    assert_eq!(e.fake.running(&id), vec![(2, 0), (2, 1)], "the whole gang starts again after the backoff");

    // Attempt 2 completed no step (no heartbeat ever said so): the second restart waits twice as long.
    assert!(e.fake.exit(&id, 0, 1));
    e.tick().await;
    e.tick().await;
    let restarted = e.events(&id, "restarted").await;
    assert!(
        restarted.len() == 2 && restarted[1].contains("after a backoff of 2s (the attempt completed no step"),
        "{restarted:?}"
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    e.tick().await;
    assert_eq!(e.state(&id).await, JobState::Pending, "the second backoff is 2 s, not 1 s");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    e.tick().await;
    e.tick().await;
    assert_eq!(e.fake.running(&id), vec![(3, 0), (3, 1)]);

    // Attempt 3 trains (its heartbeats show steps going by): after its failure the backoff is back to 1 s.
    for (beat, step) in [(1, 40), (2, 41), (3, 42)] {
        for r in 0..2 {
            e.beat(&id, 3, r, (beat, step, "all_reduce", step, false));
        }
        e.tick().await;
    }
    let (st, _) = e.call("POST", &format!("/api/v1/jobs/{id}/chaos"), r#"{"action": "kill", "rank": 1}"#).await;
    assert_eq!(st, StatusCode::OK);
    e.tick().await;
    e.tick().await;
    let restarted = e.events(&id, "restarted").await;
    assert!(
        restarted.len() == 3 && restarted[2].contains("after a backoff of 1s (the attempt trained"),
        "{restarted:?}"
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    e.tick().await;
    e.tick().await;
    assert_eq!(e.fake.running(&id), vec![(4, 0), (4, 1)]);

    // No restarts left: the job fails, naming the cause.
    let (st, _) = e.call("POST", &format!("/api/v1/jobs/{id}/chaos"), r#"{"action": "kill", "rank": 0}"#).await;
    assert_eq!(st, StatusCode::OK);
    e.tick().await;
    e.tick().await;
    assert_eq!(e.state(&id).await, JobState::Failed);
    let why = e.reason(&id).await;
    assert!(why.contains("rank 0 exited with status 137") && why.contains("no restarts left (3 used)"), "{why}");
    let _ = std::fs::remove_dir_all(&e.dir);
}

/// Policy `none` fails the job at the first failure, with the reason; the chaos endpoint refuses ranks that do not
/// run, and jobs that do not run.
#[tokio::test]
async fn policy_none_fails_at_once_with_the_reason() {
    let e = env("none").await;
    let id = e.submit(&job_with("none", 2, "policy = \"none\"")).await;
    e.tick().await;
    let (st, v) = e.call("POST", &format!("/api/v1/jobs/{id}/chaos"), r#"{"action": "kill", "rank": 5}"#).await;
    assert_eq!((st, v["field"].as_str()), (StatusCode::BAD_REQUEST, Some("rank")), "{v}");
    let (st, v) = e.call("POST", &format!("/api/v1/jobs/{id}/chaos"), r#"{"action": "explode", "rank": 0}"#).await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    // Rank 1 fails by itself (its log's last error line says why) just after rank 0 is killed: the kill is named
    // first, rank 1's own report after it.
    let log = e.fake.log_path(&id, 1, 1);
    std::fs::create_dir_all(log.parent().expect("logs dir")).expect("logs dir");
    std::fs::write(&log, "step 3\nerror: all_reduce #12 failed: peer 0 lost; entered: [1], not: [0]\n").expect("log");
    let (st, v) = e.call("POST", &format!("/api/v1/jobs/{id}/chaos"), r#"{"action": "kill", "rank": 0}"#).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(e.fake.exit(&id, 1, 1));
    e.tick().await;
    e.tick().await;
    assert_eq!(e.state(&id).await, JobState::Failed);
    let why = e.reason(&id).await;
    assert!(
        why.starts_with(
            "rank 0 exited with status 137 (killed: SIGKILL) (also rank 1 exited with status 1: \
                         all_reduce #12 failed: peer 0 lost; entered: [1], not: [0])"
        ) && why.contains("fault_tolerance.policy = \"none\""),
        "{why}"
    );
    assert!(e.events(&id, "restarted").await.is_empty());
    assert_eq!(e.fake.started(&id), 2, "nothing started again");
    let (st, v) = e.call("POST", &format!("/api/v1/jobs/{id}/chaos"), r#"{"action": "kill", "rank": 0}"#).await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "a failed job has no worker to hit: {v}");
    let _ = std::fs::remove_dir_all(&e.dir);
}

/// A job whose step counter stops while every rank lives is a hang: after `hang_timeout` an event `hang` dumps every
/// rank (the two waiting in all_reduce #7 and the one that never arrived), `shoal status`'s `hang_dump` holds the
/// same, and the gang is killed and restarted by its policy. `debug` shows the ranks on demand.
#[tokio::test]
async fn a_hang_is_dumped_naming_the_missing_rank_and_recovered() {
    let e = env("hang").await;
    let id =
        e.submit(&job_with("hang", 3, "backoff = \"0s\"\nhang_timeout = \"1s\"\nheartbeat_timeout = \"30s\"")).await;
    e.tick().await;
    assert_eq!(e.fake.running(&id).len(), 3);
    let (st, v) = e.call("GET", &format!("/api/v1/jobs/{id}/debug"), "").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v["ranks"].as_array().is_some_and(|r| r.iter().all(|r| r["state"] == "unknown")), "{v}");
    // Training: every rank steps.
    let mut beat = 0;
    for step in 1..=3u64 {
        beat += 1;
        for r in 0..3 {
            e.beat(&id, 1, r, (beat, step, "all_reduce", step * 2, false));
        }
        e.tick().await;
    }
    // Ranks 0 and 1 enter all_reduce #7 and wait; rank 2 stays where it was (its process lives: SIGSTOP).
    let started = std::time::Instant::now();
    let mut hang = Vec::new();
    while hang.is_empty() {
        assert!(started.elapsed() < Duration::from_secs(20), "no hang found");
        beat += 1;
        for r in 0..2 {
            e.beat(&id, 1, r, (beat, 3, "all_reduce", 7, true));
        }
        if beat == 5 {
            let (st, v) = e.call("GET", &format!("/api/v1/jobs/{id}/debug"), "").await;
            assert_eq!(st, StatusCode::OK, "{v}");
            assert_eq!(v["ranks"][0]["state"], "in_collective", "{v}");
            assert_eq!(v["culprits"], serde_json::json!([2]), "{v}");
        }
        e.tick().await;
        hang = e.events(&id, "hang").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(started.elapsed() >= Duration::from_secs(1), "a hang before hang_timeout");
    let msg = &hang[0];
    assert!(msg.contains("no step completed") && msg.contains("hang_timeout = 1s"), "{msg}");
    assert!(msg.contains("ranks 0, 1 wait in all_reduce #7") && msg.contains("not in it: rank 2"), "{msg}");
    let (st, v) = e.call("GET", &format!("/api/v1/jobs/{id}"), "").await;
    assert_eq!(st, StatusCode::OK);
    let dump = &v["hang_dump"];
    assert_eq!(dump["culprits"], serde_json::json!([2]), "{v}");
    assert_eq!((dump["attempt"].as_i64(), dump["step"].as_u64()), (Some(1), Some(3)), "{dump}");
    let ranks = dump["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 3);
    for r in &ranks[..2] {
        assert_eq!(
            (r["op"].as_str(), r["seq"].as_u64(), r["in_op"].as_bool()),
            (Some("all_reduce"), Some(7), Some(true))
        );
        assert!(r["op_s"].as_f64().is_some_and(|s| s >= 0.0), "{r}");
    }
    assert_eq!((ranks[2]["seq"].as_u64(), ranks[2]["in_op"].as_bool()), (Some(6), Some(false)), "{dump}");
    // Killed at once (a hung gang cannot stop cleanly), then restarted.
    let kills: Vec<i64> = e.fake.stops(&id).iter().filter(|s| s.2 == Stop::Kill).map(|s| s.1).collect();
    assert_eq!(kills, vec![0, 1, 2], "{:?}", e.fake.stops(&id));
    for _ in 0..3 {
        e.tick().await;
    }
    assert_eq!(e.attempt(&id).await, 2);
    assert_eq!(e.fake.running(&id), vec![(2, 0), (2, 1), (2, 2)]);
    let restarted = e.events(&id, "restarted").await;
    assert!(restarted.len() == 1 && restarted[0].contains("hang:") && restarted[0].contains("rank 2"), "{restarted:?}");
    // The new attempt is judged afresh: old heartbeats (attempt 1) are not its own.
    e.tick().await;
    assert_eq!(e.events(&id, "hang").await.len(), 1);
    e.fake.exit_job(&id, 0);
    e.tick().await;
    assert_eq!(e.state(&id).await, JobState::Succeeded, "{}", e.reason(&id).await);
    let _ = std::fs::remove_dir_all(&e.dir);
}

/// A rank whose heartbeats stop for `heartbeat_timeout` while its process runs is taken for dead, even while the
/// others still step: the event names it, and the job restarts by its policy.
#[tokio::test]
async fn a_rank_whose_heartbeats_stop_is_taken_for_dead() {
    let e = env("silent").await;
    let id = e.submit(&job_with("silent", 2, "backoff = \"0s\"\nheartbeat_timeout = \"1s\"")).await;
    e.tick().await;
    let started = std::time::Instant::now();
    let mut beat = 0;
    let mut silent = Vec::new();
    while silent.is_empty() {
        assert!(started.elapsed() < Duration::from_secs(20), "the silent rank was never found");
        beat += 1;
        e.beat(&id, 1, 0, (beat, beat, "all_reduce", beat, false));
        if beat == 1 {
            e.beat(&id, 1, 1, (1, 1, "all_reduce", 1, false));
        }
        e.tick().await;
        silent = e.events(&id, "heartbeat").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(started.elapsed() >= Duration::from_secs(1), "taken for dead before heartbeat_timeout");
    assert!(
        silent[0].contains("rank 1 sent no heartbeat for") && silent[0].contains("heartbeat_timeout = 1s"),
        "{silent:?}"
    );
    for _ in 0..3 {
        e.tick().await;
    }
    assert_eq!(e.fake.running(&id), vec![(2, 0), (2, 1)]);
    assert!(e.events(&id, "restarted").await[0].contains("rank 1 sent no heartbeat"));
    let _ = std::fs::remove_dir_all(&e.dir);
}

fn job_range(name: &str, lo: u32, hi: u32, fault_tolerance: &str) -> String {
    job_with(name, 1, fault_tolerance).replace("count = 1", &format!("min = {lo}\nmax = {hi}"))
}

/// After a failure, policy `elastic` starts again at once with as many workers as are free within
/// `[workers] min..max` (here more than it ran with); policy `restart` asks for the number it ran with.
#[tokio::test]
async fn elastic_restarts_at_the_size_that_is_free_and_restart_at_the_same_size() {
    let e = env("elastic").await;
    for (policy, after) in [("elastic", 4usize), ("restart", 2)] {
        let holder = e.submit(&job_with(&format!("holder-{policy}"), 2, "")).await;
        e.tick().await;
        assert_eq!(e.fake.running(&holder).len(), 2);
        let id = e
            .submit(&job_range(policy, 1, 4, &format!("policy = \"{policy}\"\nbackoff = \"0s\"\nmax_restarts = 1")))
            .await;
        e.tick().await;
        assert_eq!(e.fake.running(&id).len(), 2, "{policy}: two CPUs of four were free");
        // A rank dies, and the holder ends before the restart is placed: four CPUs are free for it.
        let (st, v) = e.call("POST", &format!("/api/v1/jobs/{id}/chaos"), r#"{"action": "kill", "rank": 0}"#).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        e.fake.exit_job(&holder, 0);
        e.tick().await;
        assert_eq!(e.state(&holder).await, JobState::Succeeded);
        for _ in 0..3 {
            e.tick().await;
        }
        let launched = e.fake.launches().into_iter().filter(|l| l.job_id == id && l.attempt == 2).count();
        assert_eq!(launched, after, "{policy}");
        let restarted = e.events(&id, "restarted").await;
        assert_eq!(restarted.len(), 1, "{restarted:?}");
        if policy == "elastic" {
            assert!(restarted[0].contains("(elastic)") && restarted[0].contains("within 1..4"), "{restarted:?}");
        } else {
            assert!(restarted[0].contains("all 2 start again at once"), "{restarted:?}");
        }
        // Policy `restart` came back at its own size and stays there (it asks for exactly that many).
        let running = e.fake.running(&id);
        assert_eq!(running.len(), after, "{policy}: {running:?}");
        assert!(running.iter().all(|(attempt, _)| *attempt == 2), "{policy}: {running:?}");
        assert!(e.events(&id, "resized").await.is_empty(), "{policy}");
        e.fake.exit_job(&id, 0);
        e.tick().await;
        assert_eq!(e.state(&id).await, JobState::Succeeded, "{}", e.reason(&id).await);
    }
    let _ = std::fs::remove_dir_all(&e.dir);
}

/// A rank handing a checkpoint to its saver (or evaluating) stops the hang clock, however long it takes while it
/// beats: the others waiting for it meanwhile is no hang. Once it trains again and the steps stay still, it is.
#[tokio::test]
async fn a_long_checkpoint_is_no_hang() {
    let e = env("checkpoint").await;
    let id = e.submit(&job_with("saving", 2, "backoff = \"0s\"\nhang_timeout = \"1s\"")).await;
    e.tick().await;
    let mut beat = 0;
    for step in 1..=2u64 {
        beat += 1;
        for r in 0..2 {
            e.beat(&id, 1, r, (beat, step, "all_reduce", step, false));
        }
        e.tick().await;
    }
    let t0 = std::time::Instant::now();
    while t0.elapsed() < Duration::from_millis(2500) {
        beat += 1;
        e.beat_in(&id, 1, 0, "checkpoint", (beat, 2, "all_reduce", 2, false));
        e.beat(&id, 1, 1, (beat, 2, "all_reduce", 3, true));
        e.tick().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(e.events(&id, "hang").await.is_empty(), "a checkpoint taken for a hang");
    assert_eq!(e.state(&id).await, JobState::Running);
    let t1 = std::time::Instant::now();
    while e.events(&id, "hang").await.is_empty() {
        assert!(t1.elapsed() < Duration::from_secs(20), "the hang after the checkpoint was never found");
        beat += 1;
        e.beat(&id, 1, 0, (beat, 2, "all_reduce", 2, false));
        e.beat(&id, 1, 1, (beat, 2, "all_reduce", 3, true));
        e.tick().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(t1.elapsed() >= Duration::from_secs(1), "the clock did not start again when training resumed");
    let hang = e.events(&id, "hang").await;
    assert!(hang[0].contains("rank 1 waits in all_reduce #3") && hang[0].contains("not in it: rank 0"), "{hang:?}");
    let _ = std::fs::remove_dir_all(&e.dir);
}

/// Appends steps `from..=to` (a step every 50 ms of the workers' clock) to each rank's metrics file, as workers
/// would: the arrival skew of a job whose ranks other than `late` wait 40 ms of every step for it.
fn write_rows(dir: &std::path::Path, ranks: i64, late: i64, from: i64, to: i64) {
    use std::io::Write;
    std::fs::create_dir_all(dir).expect("run dir");
    for rank in 0..ranks {
        let name = if rank == 0 { "metrics.jsonl".to_owned() } else { format!("metrics.rank-{rank}.jsonl") };
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(name)).expect("metrics file");
        for step in from..=to {
            let waited: Vec<f64> = (0..ranks)
                .map(|k| {
                    if rank != late && k == late {
                        0.040 * step as f64
                    } else {
                        0.0001 * step as f64 * f64::from(k != rank)
                    }
                })
                .collect();
            let lag = if rank == late { 0.030 * step as f64 } else { 0.0 };
            let row = serde_json::json!({
                "step": step, "loss": 1.0, "lr": 0.01, "samples": 8, "data_s": 0.0001, "compute_s": 0.005,
                "comm_s": 0.044, "optimizer_s": 0.0009, "step_s": 0.050, "rank": rank, "comm_bytes": step * 1000,
                "unix_ms": 1_700_000_000_000i64 + step * 50, "comm_waited_for": waited,
                "comm_wait_s": waited.iter().sum::<f64>(), "comm_lag_s": lag,
            });
            writeln!(f, "{row}").expect("write a row");
        }
    }
}

/// An elastic job with `fault_tolerance.replace_stragglers`: once its diagnosis has named the same rank the
/// straggler for 30 s of its rows, an event names the rank and the evidence, and the job restarts without it (one
/// worker fewer, within its range), using one of its restarts.
#[tokio::test]
async fn a_persistent_straggler_is_replaced() {
    let e = env("straggler").await;
    let ft = "policy = \"elastic\"\nbackoff = \"0s\"\nmax_restarts = 2\nreplace_stragglers = true";
    let id = e.submit(&job_range("straggler", 2, 3, ft)).await;
    e.tick().await;
    assert_eq!(e.fake.running(&id).len(), 3);
    let dir = e.p.control.run_dir(&id);
    // Two seconds of rows a tick: named from the first diagnosis on, replaced once 30 s of rows name it.
    let mut ticks = 0;
    while e.events(&id, "straggler").await.is_empty() && ticks < 25 {
        write_rows(&dir, 3, 1, ticks * 40 + 1, (ticks + 1) * 40);
        e.tick().await;
        ticks += 1;
        if ticks < 15 {
            assert!(e.events(&id, "straggler").await.is_empty(), "too soon, after {} s of rows", ticks * 2);
        }
    }
    let told = e.events(&id, "straggler").await;
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(
        told[0].contains("rank 1")
            && told[0].contains("for rank 1 inside collectives")
            && told[0].contains("at most 2 workers"),
        "{told:?}"
    );
    for _ in 0..3 {
        e.tick().await;
    }
    let running = e.fake.running(&id);
    assert_eq!(running.len(), 2, "{running:?}");
    assert!(running.iter().all(|(attempt, _)| *attempt == 2), "{running:?}");
    let restarted = e.events(&id, "restarted").await;
    assert!(restarted.len() == 1 && restarted[0].contains("persistent straggler"), "{restarted:?}");
    let _ = std::fs::remove_dir_all(&e.dir);
}

/// Two tasks asking for half a GPU each share one, each held to its `gpu_memory`: the one whose processes hold more
/// GPU memory than it asked for is killed with a reason naming the rank, the GPU and `resources.gpu_memory`; its
/// neighbour on the same GPU runs on and succeeds.
#[tokio::test]
async fn a_fractional_gpu_task_over_its_gpu_memory_is_killed_and_its_neighbour_runs_on() {
    let e = env_with("gpu-memory", 1).await;
    let spec = |name: &str| {
        format!(
            "name = \"{name}\"\n[resources]\ncpus = 1\nmemory = \"256MiB\"\ngpus = 0.5\ngpu_memory = \"6GiB\"\n\
             [fault_tolerance]\npolicy = \"none\"\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\nglobal_batch = 8\n\
             steps = 2\nlr = 0.01\n"
        )
    };
    let greedy = e.submit(&spec("greedy")).await;
    let modest = e.submit(&spec("modest")).await;
    e.tick().await;
    let gpus = |id: &str| e.fake.launches().iter().find(|l| l.job_id == id).map(|l| l.gpus.clone()).expect("launched");
    assert_eq!(gpus(&greedy).len(), 1);
    assert_eq!(gpus(&greedy)[0].0, gpus(&modest)[0].0, "the two halves share one GPU");
    let within = shoal_exec::Usage { rss_bytes: 1 << 20, cpu_seconds: 1.0, gpu_memory_bytes: Some(5 << 30) };
    let over = shoal_exec::Usage { gpu_memory_bytes: Some(7 << 30), ..within };
    e.fake.set_usage(&modest, 0, within);
    e.fake.set_usage(&greedy, 0, over);
    e.tick().await;
    e.tick().await;
    assert_eq!(e.state(&greedy).await, JobState::Failed);
    let why = e.reason(&greedy).await;
    assert!(
        why.contains(
            "rank 0 held 7.00 GiB of GPU memory on GPU 0, over its request of 6.00 GiB (resources.gpu_memory)"
        ),
        "{why}"
    );
    assert_eq!(e.state(&modest).await, JobState::Running, "the neighbour within its share runs on");
    e.fake.exit_job(&modest, 0);
    e.tick().await;
    assert_eq!(e.state(&modest).await, JobState::Succeeded);
    let _ = std::fs::remove_dir_all(&e.dir);
}
