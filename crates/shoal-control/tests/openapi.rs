//! The API's OpenAPI document, from a real server on a loopback socket: it describes every endpoint of the router
//! with the content types they really send, and Schemathesis, fuzzing every operation from it, finds no server
//! error and no response that breaks its schema.
//!
//! Schemathesis comes from PyPI, pinned ([`SCHEMATHESIS`]), into a virtual environment cached outside the checkout
//! (`~/.cache/shoal/schemathesis-VERSION/`, or `$SHOAL_CACHE_DIR/schemathesis-VERSION/`), installed on first use
//! and reused after. The run is bounded (20 examples per operation, a fixed seed): `SHOAL_FUZZ_EXAMPLES` and
//! `SHOAL_FUZZ_SEED` dig deeper or elsewhere.
//! Without Python or PyPI the test fails saying so: it is never skipped.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use shoal_exec::fake::FakeExecutor;

/// The Schemathesis release the test runs.
const SCHEMATHESIS: &str = "4.32.5";

/// How long one Schemathesis run may take before the test fails.
const FUZZ_LIMIT: Duration = Duration::from_secs(300);

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-openapi-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A real server on a free loopback port, in its own runtime, whose tasks run `/bin/false` (or no process at all,
/// with a scripted executor): nothing a request submits can start real work.
struct Live {
    rt: tokio::runtime::Runtime,
    server: Option<shoal_control::Server>,
    dir: PathBuf,
    base: String,
    admin: String,
    agent: ureq::Agent,
}

impl Live {
    fn start(tag: &str, tweak: impl FnOnce(&mut shoal_control::ServerOptions)) -> Live {
        let dir = tmpdir(tag);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let mut opts = shoal_control::ServerOptions::new(
            &dir.join("data"),
            "127.0.0.1:0".parse().expect("addr"),
            Path::new("/bin/false"),
        );
        opts.cpus_milli = Some(2000);
        opts.memory_bytes = Some(4 << 30);
        opts.tick = Duration::from_millis(100);
        opts.kill_grace = Duration::from_millis(200);
        tweak(&mut opts);
        let server = rt.block_on(shoal_control::start(opts)).expect("start the server");
        let base = format!("http://{}", server.addr);
        let admin = server.admin_token.clone();
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Live { rt, server: Some(server), dir, base, admin, agent }
    }

    /// A request as `token`; the status and the body as JSON (a JSON string when it is not JSON).
    fn call(&self, method: &str, path: &str, token: Option<&str>, body: Option<&Value>) -> (u16, Value) {
        let url = format!("{}{path}", self.base);
        let auth = token.map(|t| format!("Bearer {t}"));
        let resp = match (method, body) {
            ("GET", _) => {
                let mut r = self.agent.get(&url);
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.call()
            }
            (_, b) => {
                let mut r = self.agent.post(&url).header("Content-Type", "application/json");
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.send(b.map_or_else(String::new, Value::to_string))
            }
        };
        let mut resp = resp.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_else(|e| panic!("{method} {path}: body: {e}"));
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    fn control(&self) -> Arc<shoal_control::control::Control> {
        self.server.as_ref().map(|s| s.control.clone()).expect("a running server")
    }

    fn document(&self) -> Value {
        let (st, doc) = self.call("GET", "/api/v1/openapi.json", None, None);
        assert_eq!(st, 200, "GET /api/v1/openapi.json without a token: {doc}");
        assert!(doc.is_object(), "the document is not a JSON object: {doc}");
        doc
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            self.rt.block_on(s.shutdown());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn the_openapi_document_describes_every_endpoint_of_the_router() {
    let live = Live::start("doc", |_| {});
    let doc = live.document();
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "not OpenAPI 3: {}", doc["openapi"]);
    let paths = doc["paths"].as_object().unwrap_or_else(|| panic!("no paths: {doc:#}"));

    // Every route of the router is described, and nothing else is.
    let routes = shoal_control::api::endpoints();
    let mut missing = Vec::new();
    for (method, path) in &routes {
        let op = &doc["paths"][*path][method.as_str().to_ascii_lowercase()];
        if !op.is_object() || !op["responses"].is_object() {
            missing.push(format!("{method} {path}"));
        }
    }
    assert!(missing.is_empty(), "routes the OpenAPI document does not describe: {missing:?}");
    for (path, ops) in paths {
        for method in ops.as_object().into_iter().flat_map(|o| o.keys()) {
            let known = routes.iter().any(|(m, p)| p == path && m.as_str().eq_ignore_ascii_case(method));
            assert!(known, "the document describes {method} {path}, which the router does not serve");
        }
    }

    // Bearer tokens everywhere but the health check and the document itself.
    assert_eq!(doc["components"]["securitySchemes"]["bearer"]["scheme"], "bearer", "{:#}", doc["components"]);
    assert_eq!(doc["security"], json!([{ "bearer": [] }]), "a global bearer requirement");
    for open in ["/healthz", "/api/v1/openapi.json"] {
        assert_eq!(doc["paths"][open]["get"]["security"], json!([{}]), "{open} needs no token");
    }

    // The content types they really send.
    let content = |path: &str, status: &str| -> Vec<String> {
        doc["paths"][path]["get"]["responses"][status]["content"]
            .as_object()
            .map(|c| c.keys().cloned().collect())
            .unwrap_or_default()
    };
    assert_eq!(content("/api/v1/jobs/{id}/logs", "200"), ["text/plain"]);
    assert_eq!(content("/api/v1/jobs/{id}/stream", "200"), ["text/event-stream"]);
    assert_eq!(content("/api/v1/overview/stream", "200"), ["text/event-stream"]);
    assert_eq!(content("/metrics", "200"), ["text/plain; version=0.0.4"]);
    assert_eq!(content("/api/v1/jobs/{id}", "200"), ["application/json"]);
    assert_eq!(content("/api/v1/jobs/{id}", "404"), ["application/json"]);
    let submit = &doc["paths"]["/api/v1/jobs"]["post"]["requestBody"]["content"];
    assert_eq!(submit["application/json"]["schema"]["$ref"], "#/components/schemas/JobSpec", "{submit:#}");
    assert!(submit["application/toml"].is_object(), "{submit:#}");
    let spec = &doc["components"]["schemas"]["JobSpec"];
    assert_eq!(spec["required"], json!(["name", "train"]), "{spec:#}");
    for part in ["WorkersSpec", "ResourcesSpec", "FaultToleranceSpec", "TrainSpec", "ModelSpec", "CheckpointSpec"] {
        assert!(doc["components"]["schemas"][part].is_object(), "no {part} schema");
    }

    // The error body and its codes, in the document and on the wire.
    let codes = &doc["components"]["schemas"]["ErrorCode"]["enum"];
    for code in shoal_wire::ErrorCode::ALL {
        assert!(
            codes.as_array().is_some_and(|a| a.iter().any(|c| c == code.as_str())),
            "{code} not in the ErrorCode schema: {codes}"
        );
    }
    let (st, v) = live.call("GET", "/api/v1/jobs", None, None);
    assert_eq!((st, v["code"].as_str(), v["status"].as_u64()), (401, Some("unauthorized"), Some(401)), "{v}");
    let bad_steps = json!({ "name": "x", "train": { "model": "mlp", "dataset": "digits", "steps": "many" } });
    let (st, v) = live.call("POST", "/api/v1/jobs", Some(&live.admin), Some(&bad_steps));
    assert_eq!((st, v["code"].as_str(), v["field"].as_str()), (400, Some("invalid_spec"), Some("train.steps")), "{v}");
    let (st, v) = live.call("GET", "/api/v1/jobs?state=bogus", Some(&live.admin), None);
    assert_eq!((st, v["code"].as_str(), v["field"].as_str()), (400, Some("bad_request"), Some("state")), "{v}");
    let (st, v) = live.call("POST", "/api/v1/whoami", Some(&live.admin), Some(&json!({})));
    assert_eq!((st, v["code"].as_str()), (405, Some("method_not_allowed")), "{v}");
    let (st, v) = live.call("GET", "/api/v1/jobs/j-00000000", Some(&live.admin), None);
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")), "{v}");
}

// ---------------------------------------------------------------------------------------------------------------
// Schemathesis

/// Where the virtual environment with Schemathesis lives: outside the checkout, one per version.
fn venv_dir() -> PathBuf {
    let cache = std::env::var_os("SHOAL_CACHE_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
        home.join(".cache/shoal")
    });
    cache.join(format!("schemathesis-{SCHEMATHESIS}"))
}

fn output_text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The `st` program of the cached environment, installed there from PyPI first when it is not.
fn schemathesis() -> PathBuf {
    let dir = venv_dir();
    let st = dir.join("bin/st");
    // Written last: a directory without it is an install that did not finish.
    let done = dir.join("installed");
    let works = || {
        done.is_file()
            && Command::new(&st)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(SCHEMATHESIS))
    };
    if works() {
        return st;
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).unwrap_or_else(|e| panic!("creating {}: {e}", parent.display()));
    }
    let venv = Command::new("python3").arg("-m").arg("venv").arg(&dir).output().unwrap_or_else(|e| {
        panic!("cannot run python3 to make a virtual environment for Schemathesis (python3 with venv is needed): {e}")
    });
    assert!(
        venv.status.success(),
        "python3 -m venv {} failed (python3 with venv is needed):\n{}",
        dir.display(),
        output_text(&venv)
    );
    let pip = Command::new(dir.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check", &format!("schemathesis=={SCHEMATHESIS}")])
        .output()
        .unwrap_or_else(|e| panic!("cannot run pip of {}: {e}", dir.display()));
    assert!(
        pip.status.success(),
        "cannot install schemathesis=={SCHEMATHESIS} from PyPI into {} (is PyPI reachable?):\n{}",
        dir.display(),
        output_text(&pip)
    );
    std::fs::write(&done, SCHEMATHESIS).unwrap_or_else(|e| panic!("writing {}: {e}", done.display()));
    assert!(works(), "schemathesis {SCHEMATHESIS} does not run from {}", dir.display());
    st
}

/// Runs `program` with `args`, killing it after `limit`; its exit status and everything it printed.
fn run_bounded(program: &Path, args: &[String], cwd: &Path, limit: Duration) -> (Option<i32>, String) {
    let mut child = Command::new(program)
        .args(args)
        .current_dir(cwd)
        .env("NO_COLOR", "1")
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for schemathesis") {
            break Some(st);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let text = format!("{}{}", reader.join().unwrap_or_default(), err_reader.join().unwrap_or_default());
    match status {
        Some(st) => (st.code(), text),
        None => (None, format!("{text}\n(killed after {} s)", limit.as_secs())),
    }
}

/// A job that ran (its scripted tasks end at once) with a few metrics lines and resource samples of two ranks:
/// the ids Schemathesis tries reach a real job most of the time, so that more than "not found" is exercised.
fn a_finished_job(live: &Live) -> String {
    let spec = json!({
        "name": "fuzz-target",
        "workers": { "count": 2 },
        "resources": { "cpus": 0.5, "memory": "64MiB" },
        "fault_tolerance": { "max_restarts": 0 },
        "train": { "model": "mlp", "dataset": "digits", "global_batch": 8, "steps": 2, "lr": 0.1 },
    });
    let (st, v) = live.call("POST", "/api/v1/jobs", Some(&live.admin), Some(&spec));
    assert_eq!(st, 201, "submit: {v}");
    let id = v["id"].as_str().expect("id").to_owned();
    let t0 = Instant::now();
    loop {
        let (_, v) = live.call("GET", &format!("/api/v1/jobs/{id}"), Some(&live.admin), None);
        if v["state"].as_str().is_some_and(|s| ["succeeded", "failed", "cancelled"].contains(&s)) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the job did not end: {v:#}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let batch = json!({ "metrics": (1..=5).map(|s| json!({
        "rank": 0, "step": s, "time_ms": s,
        "data": { "step": s, "loss": 2.0 / s as f64, "step_s": 0.01, "data_s": 0.001, "compute_s": 0.008,
                  "comm_s": 0.001, "optimizer_s": 0.0005, "samples": 8 },
    })).collect::<Vec<_>>() });
    let (st, v) = live.call("POST", &format!("/api/v1/jobs/{id}/metrics"), Some(&live.admin), Some(&batch));
    assert_eq!((st, v["stored"].as_u64()), (200, Some(5)), "{v}");
    // Resource samples of two ranks, as the control loop would have taken them of a job that ran a while.
    let samples: Vec<shoal_control::db::SampleRow> = (0..20)
        .map(|i| shoal_control::db::SampleRow {
            rank: i % 2,
            time_ms: 1_000 * (i + 1),
            cpu_percent: Some(90.0),
            rss_bytes: Some(64 << 20),
            cpu_seconds: Some(i as f64),
            net_rx_bytes_per_s: Some(0.0),
            net_tx_bytes_per_s: Some(0.0),
            gpu_util_percent: None,
            gpu_memory_bytes: None,
            gpu_temperature_c: None,
            gpu_power_w: None,
        })
        .collect();
    live.rt.block_on(live.control().db.insert_samples(&id, &samples)).expect("insert samples");
    id
}

/// Ends every running job's scripted tasks (exit status 1) every 50 ms until `stop`: whatever a request submits
/// is over (or restarted by its policy) at once, and a followed log ends with its attempt.
fn end_every_job(live: &Live, fake: Arc<FakeExecutor>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let control = live.control();
    let rt = live.rt.handle().clone();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let running = rt.block_on(control.db.jobs_in(&[shoal_control::db::JobState::Running]));
            for j in running.unwrap_or_default() {
                fake.exit_job(&j.id, 1);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    })
}

#[test]
fn schemathesis_finds_no_server_error_and_no_response_off_its_schema() {
    let st = schemathesis();
    // Tasks are scripted, with no process behind them: a spec the fuzzer gets accepted costs nothing to run.
    let fake = Arc::new(FakeExecutor::new(&std::env::temp_dir().join("shoal-openapi-fuzz-logs")));
    let exec: Arc<dyn shoal_exec::Executor> = fake.clone();
    let live = Live::start("fuzz", |o| o.executor = Some(exec));
    let stop = Arc::new(AtomicBool::new(false));
    let ender = end_every_job(&live, fake, stop.clone());
    let job = a_finished_job(&live);
    let config = live.dir.join("schemathesis.toml");
    std::fs::write(
        &config,
        format!(
            "[dictionaries.jobs]\nvalues = [\"{job}\"]\n\n[parameters]\n\"path.id\" = {{ dictionary = \"jobs\", \
             probability = 0.7 }}\n"
        ),
    )
    .expect("write schemathesis.toml");
    let args: Vec<String> = [
        "--config-file",
        config.to_str().expect("utf-8 path"),
        "run",
        &format!("{}/api/v1/openapi.json", live.base),
        "--header",
        &format!("Authorization: Bearer {}", live.admin),
        "--checks",
        "not_a_server_error,response_schema_conformance",
        "--max-examples",
        &std::env::var("SHOAL_FUZZ_EXAMPLES").unwrap_or_else(|_| "20".into()),
        "--seed",
        &std::env::var("SHOAL_FUZZ_SEED").unwrap_or_else(|_| "7".into()),
        "--generation-database",
        "none",
        // One worker: with two threads, Hypothesis' description of its own lambdas races in CPython's `ast`
        // ("AST constructor recursion depth mismatch") and the run reports a tool error, not a finding.
        "--workers",
        "1",
        "--request-timeout",
        "30",
        // Event streams never end by themselves.
        "--exclude-path-regex",
        "/stream$",
        "--no-shrink",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let t0 = Instant::now();
    // A run that ends with only errors of the tool itself (`Runtime Error`, no `FAILURES` section: nothing the
    // checks found) is run again, at most twice; any finding fails at once.
    let mut attempt = 0;
    let (code, out) = loop {
        attempt += 1;
        let (code, out) = run_bounded(&st, &args, &live.dir, FUZZ_LIMIT);
        let tool_error_only = code != Some(0) && !out.contains("FAILURES") && out.contains("Runtime Error");
        if !tool_error_only || attempt == 3 {
            break (code, out);
        }
        eprintln!("schemathesis ended with an error of its own (not a finding); running it again:\n{out}");
    };
    let took = t0.elapsed();
    assert_eq!(
        code,
        Some(0),
        "schemathesis found server errors or responses off their schema ({} s):\n{out}",
        took.as_secs()
    );
    let (_, jobs) = live.call("GET", "/api/v1/jobs?limit=100000", Some(&live.admin), None);
    let accepted = jobs["jobs"].as_array().map_or(0, |j| j.len().saturating_sub(1));
    eprintln!(
        "schemathesis passed in {} s, {accepted} generated job specs accepted:\n{}",
        took.as_secs(),
        tail(&out, 3000)
    );
    // The server is still up and well.
    let (status, v) = live.call("GET", "/healthz", None, None);
    assert_eq!((status, v["ok"].as_bool()), (200, Some(true)), "{v}");
    stop.store(true, Ordering::Relaxed);
    let _ = ender.join();
}

fn tail(s: &str, n: usize) -> &str {
    let mut i = s.len().saturating_sub(n);
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}
