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
use shoal_exec::Stop;
use shoal_exec::fake::FakeExecutor;
use tower::ServiceExt;

struct Env {
    app: axum::Router,
    p: Prepared,
    fake: Arc<FakeExecutor>,
    dir: PathBuf,
}

async fn env(tag: &str) -> Env {
    let dir = std::env::temp_dir().join(format!("shoal-control-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let fake = Arc::new(FakeExecutor::new(&dir.join("logs")));
    let mut opts = ServerOptions::new(&dir.join("data"), "127.0.0.1:0".parse().expect("addr"), &dir.join("worker"));
    opts.cpus_milli = Some(4000);
    opts.memory_bytes = Some(8 << 30);
    opts.kill_grace = Duration::from_millis(100);
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
        "name = \"{name}\"\n[workers]\ncount = {workers}\n[resources]\ncpus = 1\nmemory = \"256MiB\"\n[restart]\n\
         max = {restarts}\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\nglobal_batch = 8\nsteps = 2\nlr = 0.01\n"
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
    let first = &e.fake.launches()[0];
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
