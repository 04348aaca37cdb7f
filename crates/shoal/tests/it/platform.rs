//! The platform end to end: a real `shoal server` process, jobs submitted with the real CLI (and raw HTTP), real
//! `shoal worker` processes started by the server's local executor — success with status, logs and metrics;
//! cancellation; restarts by policy; `kill -9` of the server with adoption of its running workers; a worker lost
//! while the server was down; team isolation; one server per data directory.
//!
//! Every wait polls with a deadline and names what it waited for; a failing test prints every server's stderr,
//! each job's `shoal status --json`, its files and the tail of its worker logs. Nothing started by a test is left
//! running: the guard kills its servers and every process whose environment names its data directory.

use std::cell::RefCell;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// How long any one wait may take (generous: debug builds on 2 loaded cores).
const WAIT: Duration = Duration::from_secs(120);

pub(crate) fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-platform-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Runs `bash SCRIPT start` (a test cluster's set-up), killing it after `limit`: its output, or what went wrong
/// (`what` names the cluster).
pub(crate) fn run_setup(script: &Path, limit: Duration, what: &str) -> Result<std::process::Output, String> {
    let child = Command::new("bash")
        .arg(script)
        .arg("start")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.map_err(|e| format!("waiting for {}: {e}", script.display())),
        Err(_) => {
            // SAFETY: kill(2) on our own child, not reaped yet (its thread still waits for it).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            Err(format!("{what} did not start within {} s", limit.as_secs()))
        }
    }
}

pub(crate) fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub(crate) fn tail(s: &str, n: usize) -> &str {
    if s.len() <= n {
        return s;
    }
    let mut i = s.len() - n;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

pub(crate) fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

// ------------------------------------------------------------------------------------------------------------
// processes

/// Whether `pid` exists and is not a zombie.
pub(crate) fn alive(pid: i64) -> bool {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    s.rfind(')').and_then(|i| s[i + 1..].split_whitespace().next()).is_some_and(|st| st != "Z" && st != "X")
}

/// Live processes whose environment passes `keep`.
fn procs_where(keep: impl Fn(&[&[u8]]) -> bool) -> Vec<i64> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return out };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i64>() else { continue };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
        if keep(&vars) && alive(pid) {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out
}

/// Live processes (task wrappers and the workers they run) of one attempt of a job.
pub(crate) fn attempt_procs(job: &str, attempt: i64) -> Vec<i64> {
    let (j, a) = (format!("SHOAL_JOB_ID={job}"), format!("SHOAL_ATTEMPT={attempt}"));
    procs_where(|vars| vars.contains(&j.as_bytes()) && vars.contains(&a.as_bytes()))
}

/// Live processes started by a server of `data` (any job, any attempt).
pub(crate) fn data_dir_procs(data: &Path) -> Vec<i64> {
    let server = format!("SHOAL_SERVER_DATA={}", data.display());
    let exit = format!("SHOAL_EXIT_FILE={}/", data.display());
    procs_where(|vars| vars.iter().any(|v| *v == server.as_bytes() || v.starts_with(exit.as_bytes())))
}

fn signal_group(pid: i64, sig: i32) {
    assert!(pid > 1, "refusing to signal process group {pid}");
    // SAFETY: kill(2) on the process group of a task this test's server started (the wrapper leads its session).
    let rc = unsafe { libc::kill(-(pid as i32), sig) };
    assert_eq!(rc, 0, "kill(-{pid}, {sig}): {}", std::io::Error::last_os_error());
}

/// A child process killed (and reaped) when the test is done with it, whatever happened.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ------------------------------------------------------------------------------------------------------------
// raw HTTP (no client library: std::net only)

#[derive(Debug)]
pub(crate) struct Resp {
    pub(crate) status: u16,
    pub(crate) headers: String,
    pub(crate) body: Vec<u8>,
}

impl Resp {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("HTTP {} body is not JSON ({e}): {}", self.status, text(&self.body)))
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(nl) = b.windows(2).position(|w| w == b"\r\n") else { return out };
        let size_text = text(&b[..nl]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        b = &b[nl + 2..];
        if size == 0 || b.len() < size {
            out.extend_from_slice(&b[..size.min(b.len())]);
            return out;
        }
        out.extend_from_slice(&b[..size]);
        b = b.get(size + 2..).unwrap_or(&[]);
    }
}

fn http(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<(&str, &[u8])>,
) -> std::io::Result<Resp> {
    let sock = addr.parse().map_err(|e| std::io::Error::other(format!("{addr}: {e}")))?;
    let mut s = TcpStream::connect_timeout(&sock, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_write_timeout(Some(Duration::from_secs(30)))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    let payload = body.map_or(&[][..], |(_, b)| b);
    if let Some((ct, _)) = body {
        req.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", payload.len()));
    s.write_all(req.as_bytes())?;
    s.write_all(payload)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no HTTP header in {:?}", text(&raw))))?;
    let headers = text(&raw[..end]);
    let status = headers
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line: {headers}")))?;
    let mut body = raw[end + 4..].to_vec();
    if headers.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Ok(Resp { status, headers, body })
}

// ------------------------------------------------------------------------------------------------------------
// a platform under test

/// One test's data directory and the server serving it; kills everything of it on drop.
/// A real `shoal server` on a free loopback port for one test, with helpers to drive it; everything it started is
/// killed on drop. Shared by the platform and diagnosis tests.
pub(crate) struct Platform {
    root: PathBuf,
    data: PathBuf,
    server: Option<Child>,
    addr: String,
    /// The admin token.
    pub(crate) token: String,
    /// Every server's output file, in start order.
    server_logs: Vec<PathBuf>,
    /// Jobs submitted in this test (for the diagnostics).
    jobs: RefCell<Vec<String>>,
    /// More arguments and environment for every server of this test.
    server_args: Vec<String>,
    server_env: Vec<(String, String)>,
}

impl Platform {
    pub(crate) fn new(tag: &str) -> Platform {
        Platform::with_server(tag, &[], &[])
    }

    /// A platform whose servers get `args` (after the listen address and data directory) and `env`.
    pub(crate) fn with_server(tag: &str, args: &[&str], env: &[(&str, &str)]) -> Platform {
        let root = tmpdir(tag);
        let data = root.join("data");
        let mut p = Platform {
            root,
            data,
            server: None,
            addr: String::new(),
            token: String::new(),
            server_logs: Vec::new(),
            jobs: RefCell::new(Vec::new()),
            server_args: args.iter().map(|a| (*a).to_owned()).collect(),
            server_env: env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        };
        p.start_server(None);
        p
    }

    /// The admin token of the servers of this test.
    pub(crate) fn token(&self) -> &str {
        &self.token
    }

    /// The data directory.
    pub(crate) fn data(&self) -> &Path {
        &self.data
    }

    /// Spawns `shoal server` on the data directory (on `port`, or a free one) and waits until it answers.
    pub(crate) fn start_server(&mut self, port: Option<u16>) {
        assert!(self.server.is_none(), "a server is already running");
        let mut port = port.unwrap_or_else(free_port);
        for try_no in 0..5 {
            let log = self.root.join(format!("server-{}.log", self.server_logs.len()));
            self.server_logs.push(log.clone());
            let out = std::fs::File::create(&log).expect("server log");
            let err = out.try_clone().expect("server log");
            let addr = format!("127.0.0.1:{port}");
            // An argument naming `{port}` (an --advertise-url for hosts in network namespaces) gets the port, and
            // the server listens on every address, so those hosts reach it.
            let args: Vec<String> = self.server_args.iter().map(|a| a.replace("{port}", &port.to_string())).collect();
            let listen = match self.server_args.iter().any(|a| a.contains("{port}")) {
                true => format!("0.0.0.0:{port}"),
                false => addr.clone(),
            };
            let mut child = shoal()
                .args(["server", "--listen", &listen, "--data-dir"])
                .arg(&self.data)
                .args(&args)
                .env("SHOAL_LOG", "shoal_control=info,warn")
                .env("HOME", &self.root)
                .env_remove("SHOAL_DATA_DIR")
                .envs(self.server_env.iter().map(|(k, v)| (k, v)))
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .expect("start shoal server");
            let deadline = Instant::now() + WAIT;
            let ready = loop {
                if let Ok(Some(st)) = child.try_wait() {
                    break Err(st);
                }
                if let Ok(r) = http(&addr, "GET", "/healthz", None, None)
                    && r.status == 200
                {
                    break Ok(r);
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "the server on {addr} did not answer /healthz within {} s:\n{}",
                        WAIT.as_secs(),
                        std::fs::read_to_string(&log).unwrap_or_default()
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            match ready {
                Ok(r) => {
                    let h = r.json();
                    assert_eq!(h["ok"], true, "healthz: {h}");
                    assert_eq!(h["database"], "sqlite", "healthz: {h}");
                    self.server = Some(child);
                    self.addr = addr;
                    self.token = std::fs::read_to_string(self.data.join("admin.token"))
                        .expect("admin.token in the data directory")
                        .trim()
                        .to_owned();
                    assert!(self.token.starts_with("shoal_"), "admin token {:?}", self.token);
                    return;
                }
                Err(st) => {
                    let msg = std::fs::read_to_string(&log).unwrap_or_default();
                    // Someone took the port in between: another one.
                    if msg.contains("cannot listen") && try_no < 4 {
                        port = free_port();
                        continue;
                    }
                    panic!("the server on {addr} exited ({st}) before it answered:\n{msg}");
                }
            }
        }
    }

    /// `kill -9` of the server (its tasks, in their own sessions, live on).
    pub(crate) fn kill_server(&mut self) -> i64 {
        let mut child = self.server.take().expect("a running server");
        let pid = i64::from(child.id());
        child.kill().expect("SIGKILL the server");
        let st = child.wait().expect("reap the server");
        assert!(!st.success(), "the killed server exited with {st}");
        pid
    }

    pub(crate) fn port(&self) -> u16 {
        self.addr.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("port")
    }

    /// The `shoal` CLI against this server as `token`.
    pub(crate) fn cli(&self, token: &str, args: &[&str]) -> Output {
        shoal()
            .args(args)
            .args(["--addr", &self.addr, "--token", token])
            .env("HOME", &self.root)
            .env_remove("SHOAL_ADDR")
            .env_remove("SHOAL_TOKEN")
            .env_remove("SHOAL_CONFIG")
            .output()
            .expect("run the shoal CLI")
    }

    /// The CLI as admin; must succeed and print JSON.
    pub(crate) fn cli_json(&self, args: &[&str]) -> Value {
        self.cli_json_as(&self.token, args)
    }

    fn cli_json_as(&self, token: &str, args: &[&str]) -> Value {
        let out = self.cli(token, args);
        assert!(
            out.status.success(),
            "shoal {args:?} failed ({}):\n{}\n{}",
            out.status,
            text(&out.stdout),
            text(&out.stderr)
        );
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("shoal {args:?} did not print JSON ({e}):\n{}", text(&out.stdout)))
    }

    pub(crate) fn request(&self, method: &str, path: &str, token: Option<&str>, body: Option<(&str, &[u8])>) -> Resp {
        http(&self.addr, method, path, token, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// GET as admin; must be 200 with JSON.
    pub(crate) fn get(&self, path: &str) -> Value {
        let r = self.request("GET", path, Some(&self.token), None);
        assert_eq!(r.status, 200, "GET {path}: {}", text(&r.body));
        r.json()
    }

    /// The job's status (raw HTTP, as admin), or None while the server does not answer.
    pub(crate) fn try_status(&self, id: &str) -> Option<Value> {
        let r = http(&self.addr, "GET", &format!("/api/v1/jobs/{id}"), Some(&self.token), None).ok()?;
        assert_eq!(r.status, 200, "GET /api/v1/jobs/{id}: {}", text(&r.body));
        Some(r.json())
    }

    /// Submits a job spec with `shoal submit --json` as `token`; returns its id.
    fn submit_as(&self, token: &str, name: &str, spec: &str) -> String {
        let path = self.root.join(format!("{name}.toml"));
        std::fs::write(&path, spec).expect("write the job spec");
        let v = self.cli_json_as(token, &["submit", "--json", path.to_str().expect("utf-8 path")]);
        let id = v["id"].as_str().unwrap_or_else(|| panic!("submit printed no id: {v}")).to_owned();
        assert!(
            id.len() == 10 && id.starts_with("j-") && id[2..].bytes().all(|b| b.is_ascii_hexdigit()),
            "job id {id:?}"
        );
        assert_eq!(v.as_object().map(|o| o.len()), Some(1), "submit --json prints only the id: {v}");
        self.jobs.borrow_mut().push(id.clone());
        id
    }

    pub(crate) fn submit(&self, name: &str, spec: &str) -> String {
        self.submit_as(&self.token.clone(), name, spec)
    }

    /// Polls `f` until it gives a value; panics naming `what` after the deadline.
    pub(crate) fn wait<T>(&self, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(t) = f() {
                return t;
            }
            assert!(Instant::now() < deadline, "timed out after {} s waiting for {what}", WAIT.as_secs());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the job is in `state`; a job that ends in another final state fails the test at once.
    pub(crate) fn wait_state(&self, id: &str, state: &str) -> Value {
        self.wait(&format!("job {id} to be {state}"), || {
            let v = self.try_status(id)?;
            let now = v["state"].as_str().unwrap_or("");
            if now == state {
                return Some(v);
            }
            assert!(
                !["succeeded", "failed", "cancelled"].contains(&now),
                "job {id} ended {now} while waiting for {state}: {}",
                v["reason"]
            );
            None
        })
    }

    /// Waits until the job runs attempt `attempt` with every worker's process alive; returns the status.
    fn wait_running(&self, id: &str, attempt: i64) -> Value {
        let v = self.wait_state_where(id, &format!("attempt {attempt} running with live workers"), |v| {
            v["state"] == "running"
                && v["attempt"] == attempt
                && v["workers"].as_array().is_some_and(|ws| {
                    !ws.is_empty() && ws.iter().all(|w| w["state"] == "running" && w["pid"].as_i64().is_some_and(alive))
                })
        });
        assert_eq!(v["workers"].as_array().map(Vec::len), v["worker_count"].as_u64().map(|n| n as usize), "{v}");
        v
    }

    pub(crate) fn wait_state_where(&self, id: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
        self.wait(&format!("job {id}: {what}"), || {
            let v = self.try_status(id)?;
            if ok(&v) {
                return Some(v);
            }
            let now = v["state"].as_str().unwrap_or("");
            assert!(
                !["succeeded", "failed", "cancelled"].contains(&now),
                "job {id} ended {now} while waiting for {what}: {}",
                v["reason"]
            );
            None
        })
    }

    pub(crate) fn job_dir(&self, id: &str) -> PathBuf {
        self.data.join("jobs").join(id)
    }

    /// What a failing test prints: servers' output, each job's status, files and worker log tails.
    fn diagnostics(&self) -> String {
        let mut s = String::new();
        for log in &self.server_logs {
            let t = std::fs::read_to_string(log).unwrap_or_default();
            s.push_str(&format!("==== {} ====\n{}\n", log.display(), tail(&t, 12_000)));
        }
        for id in self.jobs.borrow().iter() {
            if self.server.is_some() {
                let out = self.cli(&self.token, &["status", id, "--json"]);
                s.push_str(&format!(
                    "==== shoal status {id} --json ====\n{}{}\n",
                    text(&out.stdout),
                    text(&out.stderr)
                ));
            } else {
                s.push_str(&format!("==== job {id}: no server running ====\n"));
            }
            let mut files = Vec::new();
            let mut stack = vec![self.job_dir(id)];
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                    let p = e.path();
                    if p.is_dir() {
                        stack.push(p);
                    } else {
                        files.push(p);
                    }
                }
            }
            files.sort();
            for f in &files {
                s.push_str(&format!("  {}\n", f.display()));
            }
            for f in files.iter().filter(|f| f.extension().is_some_and(|e| e == "log" || e == "exit")) {
                let t = std::fs::read_to_string(f).unwrap_or_default();
                s.push_str(&format!("==== {} (tail) ====\n{}\n", f.display(), tail(&t, 3000)));
            }
        }
        s
    }
}

impl Drop for Platform {
    fn drop(&mut self) {
        let failed = std::thread::panicking();
        if failed {
            eprintln!(
                "\n######## diagnostics (data directory {}) ########\n{}",
                self.data.display(),
                self.diagnostics()
            );
        }
        if let Some(mut c) = self.server.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Whatever the servers started: no orphans.
        for _ in 0..50 {
            let left = data_dir_procs(&self.data);
            if left.is_empty() {
                break;
            }
            for pid in left {
                // SAFETY: kill(2) on a process whose environment names this test's data directory.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if failed {
            eprintln!("kept {} for inspection", self.root.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

// ------------------------------------------------------------------------------------------------------------
// jobs and what status says about them

/// An MLP on the 8x8 digits, 2 workers: a small one (well under a millisecond a step) or a larger one (a few
/// milliseconds a step), for jobs that must still run while the test acts on them.
fn digits_job(
    name: &str,
    steps: usize,
    restart_max: u32,
    checkpoint_every: usize,
    log_every: usize,
    large: bool,
) -> String {
    let (batch, hidden) = if large { (128, "[256, 256]") } else { (64, "[64]") };
    format!(
        r#"
name = "{name}"
queue = "default"
priority = 0

[workers]
count = 2

[resources]
cpus = 1
memory = "1GiB"

[fault_tolerance]
max_restarts = {restart_max}
backoff = "1s"

[train]
dataset = "digits"
global_batch = {batch}
steps = {steps}
seed = 0
optimizer = "adamw"
lr = 3e-3
warmup_steps = 10
log_every = {log_every}

[train.model]
kind = "mlp"
hidden = {hidden}

[checkpoint]
every = {checkpoint_every}
keep = 2
"#
    )
}

/// A job that runs until it is stopped.
fn endless_job(name: &str, restart_max: u32) -> String {
    digits_job(name, 10_000_000, restart_max, 0, 100, true)
}

pub(crate) fn events(v: &Value) -> Vec<(i64, String, String)> {
    v["events"]
        .as_array()
        .unwrap_or_else(|| panic!("status has no events array: {v}"))
        .iter()
        .map(|e| {
            (
                e["id"].as_i64().expect("event id"),
                e["kind"].as_str().expect("event kind").to_owned(),
                e["message"].as_str().expect("event message").to_owned(),
            )
        })
        .collect()
}

pub(crate) fn kinds(v: &Value) -> Vec<String> {
    events(v).into_iter().map(|(_, k, _)| k).collect()
}

fn count_kind(v: &Value, kind: &str) -> usize {
    kinds(v).iter().filter(|k| *k == kind).count()
}

/// The wrapper pids (session leaders, so process-group ids) of every rank.
fn worker_pids(v: &Value) -> Vec<i64> {
    v["workers"].as_array().expect("workers").iter().map(|w| w["wrapper_pid"].as_i64().expect("wrapper pid")).collect()
}

/// The wrapper pid of one rank.
fn rank_pid(v: &Value, rank: i64) -> i64 {
    v["workers"]
        .as_array()
        .expect("workers")
        .iter()
        .find(|w| w["rank"] == rank)
        .and_then(|w| w["wrapper_pid"].as_i64())
        .unwrap_or_else(|| panic!("no pid for rank {rank}: {v}"))
}

/// Each running rank's `pid` is the training process itself (`shoal worker`), not its exit-status wrapper.
fn assert_pids_are_workers(v: &Value) {
    for w in v["workers"].as_array().expect("workers") {
        let (pid, wrapper) = (w["pid"].as_i64().unwrap_or(0), w["wrapper_pid"].as_i64().unwrap_or(0));
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> = cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        assert!(
            pid != wrapper && args.get(1).is_some_and(|a| a == "worker"),
            "pid {pid} is not the worker: {args:?} ({w})"
        );
    }
}

/// The stored metrics of rank 0: every step from 1 to `steps` once, in order, each with a finite loss.
fn check_metrics(p: &Platform, id: &str, steps: i64) -> Vec<f64> {
    let m = p.get(&format!("/api/v1/jobs/{id}/metrics?rank=0"));
    let rows = m["metrics"].as_array().unwrap_or_else(|| panic!("metrics: {m}"));
    let got: Vec<i64> = rows.iter().map(|r| r["step"].as_i64().expect("metric step")).collect();
    let want: Vec<i64> = (1..=steps).collect();
    assert_eq!(got, want, "stored metric steps must be 1..={steps}, each once, in order");
    rows.iter()
        .map(|r| {
            assert_eq!(r["rank"], 0, "{r}");
            assert_eq!(r["data"]["step"], r["step"], "{r}");
            let loss = r["data"]["loss"].as_f64().unwrap_or_else(|| panic!("metric without a loss: {r}"));
            assert!(loss.is_finite() && loss >= 0.0, "loss {loss} at {r}");
            loss
        })
        .collect()
}

/// Samples the processes of attempts `a` and `a + 1` of a job until `done` says so (polling the status), and
/// fails at the first sample where both have a live process: an attempt never starts while the previous one
/// still runs.
fn watch_no_overlap(p: &Platform, id: &str, a: i64, done: impl Fn(&Value) -> bool) -> Value {
    p.wait(&format!("job {id} to leave attempt {a} (no process of both attempts may ever be alive together)"), || {
        let old = attempt_procs(id, a);
        let new = attempt_procs(id, a + 1);
        assert!(
            old.is_empty() || new.is_empty(),
            "attempt {} of {id} runs (pids {new:?}) while processes of attempt {a} are alive (pids {old:?})",
            a + 1
        );
        let v = p.try_status(id)?;
        if done(&v) {
            return Some(v);
        }
        let now = v["state"].as_str().unwrap_or("");
        assert!(
            !["succeeded", "failed", "cancelled"].contains(&now),
            "job {id} ended {now} during a restart: {}",
            v["reason"]
        );
        None
    })
}

// ------------------------------------------------------------------------------------------------------------
// tests

#[test]
fn a_submitted_job_runs_to_success_with_status_logs_and_metrics() {
    let p = Platform::new("success");
    let steps = 200;
    let id = p.submit("digits-small", &digits_job("digits-small", steps, 0, 60, 10, false));
    p.wait_state(&id, "succeeded");

    let v = p.cli_json(&["status", &id, "--json"]);
    assert_eq!(v["id"], id.as_str(), "{v}");
    assert_eq!(v["name"], "digits-small", "{v}");
    assert_eq!(v["state"], "succeeded", "{v}");
    assert_eq!(v["restarts"], 0, "{v}");
    assert_eq!(v["attempt"], 1, "{v}");
    assert_eq!(
        (v["user"].as_str(), v["team"].as_str(), v["queue"].as_str()),
        (Some("admin"), Some("admin"), Some("default"))
    );
    let ms = |k: &str| v[k].as_i64().unwrap_or_else(|| panic!("status without {k}: {v}"));
    assert!(ms("created_ms") <= ms("started_ms") && ms("started_ms") <= ms("finished_ms"), "{v}");
    let ws = v["workers"].as_array().unwrap_or_else(|| panic!("no workers: {v}"));
    assert_eq!(ws.len(), 2, "{v}");
    let mut ranks: Vec<i64> = ws.iter().map(|w| w["rank"].as_i64().expect("rank")).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1]);
    for w in ws {
        assert!(w["pid"].as_i64().is_some_and(|p| p > 1), "worker pid: {w}");
        assert!(w["host"].as_str().is_some_and(|h| !h.is_empty()), "worker host: {w}");
        assert_eq!(w["state"], "exited", "{w}");
        assert_eq!(w["exit_code"], 0, "{w}");
        assert!(!alive(w["pid"].as_i64().unwrap_or(0)), "worker {w} still alive after success");
    }
    let k = kinds(&v);
    let pos = |kind: &str| k.iter().position(|x| x == kind).unwrap_or_else(|| panic!("no {kind} event: {k:?}"));
    assert!(pos("submitted") < pos("started") && pos("started") < pos("succeeded"), "event order: {k:?}");
    for bad in ["restarted", "failed", "adopted", "requeued"] {
        assert!(!k.iter().any(|x| x == bad), "unexpected {bad} event: {k:?}");
    }
    let sum = &v["summary"];
    let acc = sum["eval_accuracy"].as_f64().unwrap_or_else(|| panic!("summary without eval_accuracy: {sum}"));
    assert!((0.85..=1.0).contains(&acc), "eval accuracy {acc} after {steps} steps on digits");
    assert_eq!(sum["steps"], steps, "{sum}");
    assert_eq!(sum["world_size"], 2, "{sum}");
    assert_eq!(v["last_metrics"]["step"], steps, "{v}");

    // Logs: rank 0 prints its progress; rank 1 exists; rank 2 does not.
    let out = p.cli(&p.token, &["logs", &id, "--rank", "0"]);
    assert!(out.status.success(), "shoal logs: {}", text(&out.stderr));
    let log = text(&out.stdout);
    assert!(log.contains("step") && log.contains(&format!("{steps}/{steps}")), "rank 0's log:\n{log}");
    assert_eq!(log, std::fs::read_to_string(p.job_dir(&id).join("attempt-1/rank-0.log")).expect("rank-0.log"));
    assert!(p.cli(&p.token, &["logs", &id, "--rank", "1"]).status.success());
    let out = p.cli(&p.token, &["logs", &id, "--rank", "2"]);
    assert!(!out.status.success() && text(&out.stderr).contains("400"), "rank 2: {}", text(&out.stderr));
    // A finished job's log is not followed forever.
    let t0 = Instant::now();
    let out = p.cli(&p.token, &["logs", &id, "--follow"]);
    assert!(out.status.success() && text(&out.stdout) == log, "logs --follow of a finished job");
    assert!(t0.elapsed() < Duration::from_secs(30));

    // Metrics: every step, losses that went down.
    let losses = check_metrics(&p, &id, steps as i64);
    let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
    let (first, last) = (mean(&losses[..10]), mean(&losses[losses.len() - 10..]));
    assert!(last < first * 0.5, "the loss must fall: first 10 steps {first:.4}, last 10 {last:.4}");
    let after = p.get(&format!("/api/v1/jobs/{id}/metrics?rank=0&after={}&limit=5", steps - 3));
    assert_eq!(after["metrics"].as_array().map(Vec::len), Some(3), "{after}");

    // Lists.
    let jobs = p.cli_json(&["jobs", "--json"]);
    let listed = jobs["jobs"].as_array().expect("jobs").iter().find(|j| j["id"] == id.as_str()).cloned();
    let listed = listed.unwrap_or_else(|| panic!("shoal jobs does not list {id}: {jobs}"));
    assert_eq!((listed["state"].as_str(), listed["worker_count"].as_i64()), (Some("succeeded"), Some(2)), "{listed}");
    let running = p.cli_json(&["jobs", "--json", "--state", "running,pending"]);
    assert_eq!(running["jobs"].as_array().map(Vec::len), Some(0), "{running}");
    let q = p.cli_json(&["queues", "--json"]);
    let default = q["queues"].as_array().expect("queues").iter().find(|q| q["name"] == "default").cloned();
    let default = default.unwrap_or_else(|| panic!("no default queue: {q}"));
    assert!(default["guaranteed"]["cpus"].as_f64().is_some_and(|c| c > 0.0), "{default}");
    assert_eq!((default["pending"].as_i64(), default["running"].as_i64()), (Some(0), Some(0)), "{default}");
    let n = p.cli_json(&["nodes", "--json"]);
    let node = &n["nodes"][0];
    assert!(node["cpus"].as_f64().is_some_and(|c| c > 0.0), "{n}");
    assert!(node["memory_bytes"].as_u64().is_some_and(|m| m > 0), "{n}");
    assert!(node["host"].as_str().is_some_and(|h| !h.is_empty()), "{n}");
    assert_eq!(node["allocated"]["cpus"].as_f64(), Some(0.0), "a finished job holds no CPUs: {n}");
    // The plain-text forms work too.
    for args in [&["status", id.as_str()][..], &["jobs"], &["queues"], &["nodes"]] {
        let out = p.cli(&p.token, args);
        assert!(out.status.success() && !out.stdout.is_empty(), "shoal {args:?}: {}", text(&out.stderr));
    }
}

#[test]
fn cancel_stops_every_worker() {
    let p = Platform::new("cancel");
    let id = p.submit("endless", &endless_job("endless", 3));
    let v = p.wait_running(&id, 1);
    let wrappers = worker_pids(&v);
    // Every process of the job (the wrappers and the workers they run).
    let all = p.wait("the workers under the wrappers", || {
        let a = attempt_procs(&id, 1);
        (a.len() > wrappers.len()).then_some(a)
    });
    for w in &wrappers {
        assert!(all.contains(w), "wrapper {w} not among the job's processes {all:?}");
    }
    // While it runs it holds its resources.
    let n = p.cli_json(&["nodes", "--json"]);
    assert_eq!(n["nodes"][0]["allocated"]["cpus"].as_f64(), Some(2.0), "2 workers × 1 CPU allocated: {n}");
    let q = p.cli_json(&["queues", "--json"]);
    assert_eq!(q["queues"][0]["running"], 1, "{q}");

    let out = p.cli(&p.token, &["cancel", &id]);
    assert!(out.status.success(), "shoal cancel: {}", text(&out.stderr));
    assert!(text(&out.stdout).contains(&id), "{}", text(&out.stdout));
    let v = p.wait_state(&id, "cancelled");
    for pid in &all {
        assert!(!alive(*pid), "process {pid} of the cancelled job {id} is still alive");
    }
    assert!(attempt_procs(&id, 1).is_empty(), "processes of {id} left: {:?}", attempt_procs(&id, 1));
    let k = kinds(&v);
    assert!(k.contains(&"cancel".to_owned()) && k.contains(&"cancelled".to_owned()), "events: {k:?}");
    assert_eq!(v["restarts"], 0, "a cancellation is no restart: {v}");
    assert!(v["finished_ms"].as_i64().is_some(), "{v}");
    for w in v["workers"].as_array().expect("workers") {
        assert_ne!(w["state"], "running", "{w}");
    }
    let n = p.cli_json(&["nodes", "--json"]);
    assert_eq!(n["nodes"][0]["allocated"]["cpus"].as_f64(), Some(0.0), "a cancelled job holds no CPUs: {n}");
    // A second cancel is refused: it is over.
    let out = p.cli(&p.token, &["cancel", &id]);
    assert!(!out.status.success() && text(&out.stderr).contains("409"), "second cancel: {}", text(&out.stderr));
}

#[test]
fn a_failing_worker_is_restarted_by_policy_then_fails() {
    let p = Platform::new("restart");
    let id = p.submit("fragile", &endless_job("fragile", 1));
    // Attempt 1 is training (a metrics step is stored), then rank 0 dies of SIGKILL.
    let v = p.wait_state_where(&id, "attempt 1 training", |v| {
        v["state"] == "running" && v["attempt"] == 1 && !v["last_metrics"].is_null()
    });
    let victim = rank_pid(&v, 0);
    let first = attempt_procs(&id, 1);
    assert!(first.len() >= 4, "2 wrappers and 2 workers expected, found {first:?}");
    signal_group(victim, libc::SIGKILL);

    // Restarted: attempt 2 starts only after every process of attempt 1 is gone.
    let v = watch_no_overlap(&p, &id, 1, |v| {
        v["state"] == "running"
            && v["attempt"] == 2
            && v["workers"].as_array().is_some_and(|ws| ws.iter().all(|w| w["pid"].as_i64().is_some_and(alive)))
    });
    for pid in &first {
        assert!(!alive(*pid), "process {pid} of attempt 1 alive while attempt 2 runs");
    }
    assert_eq!(v["restarts"], 1, "{v}");
    let ev = events(&v);
    let restarted: Vec<_> = ev.iter().filter(|e| e.1 == "restarted").collect();
    assert_eq!(restarted.len(), 1, "events: {ev:?}");
    assert!(
        restarted[0].2.contains("rank 0 exited with status 137") && restarted[0].2.contains("restart 1 of 1"),
        "the restart must say why: {}",
        restarted[0].2
    );
    let started: Vec<_> = ev.iter().filter(|e| e.1 == "started").collect();
    assert_eq!(started.len(), 2, "events: {ev:?}");
    assert!(restarted[0].0 < started[1].0, "attempt 2 started before the restart was decided: {ev:?}");
    assert!(started[1].2.starts_with("attempt 2"), "{}", started[1].2);
    let mut pids2 = worker_pids(&v);
    pids2.sort_unstable();
    assert!(pids2.iter().all(|p| !first.contains(p)), "attempt 2 reuses attempt 1's pids? {pids2:?} {first:?}");

    // Kill it again: no restarts left.
    let second = p.wait("attempt 2's workers", || {
        let a = attempt_procs(&id, 2);
        (a.len() >= 4).then_some(a)
    });
    signal_group(rank_pid(&v, 0), libc::SIGKILL);
    let v = p.wait_state(&id, "failed");
    let reason = v["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("rank 0 exited with status 137") && reason.contains("no restarts left"),
        "the failure must name the rank and its status: {reason}"
    );
    assert_eq!((v["restarts"].as_i64(), v["attempt"].as_i64()), (Some(1), Some(2)), "{v}");
    assert_eq!(
        (count_kind(&v, "restarted"), count_kind(&v, "started"), count_kind(&v, "failed")),
        (1, 2, 1),
        "{:?}",
        kinds(&v)
    );
    for pid in second {
        assert!(!alive(pid), "process {pid} of attempt 2 alive after the job failed");
    }
    assert!(!p.job_dir(&id).join("attempt-3").exists(), "a third attempt started");
}

#[test]
fn kill_9_of_the_server_adopts_running_workers() {
    let mut p = Platform::new("adopt");
    let steps = 1500;
    let id = p.submit("survivor", &digits_job("survivor", steps, 2, 250, 100, true));
    let v = p.wait_state_where(&id, "attempt 1 training with a metrics step stored", |v| {
        v["state"] == "running" && !v["last_metrics"].is_null()
    });
    let wrappers = worker_pids(&v);
    assert_pids_are_workers(&v);
    let procs = attempt_procs(&id, 1);
    assert!(procs.len() >= 4, "2 wrappers and 2 workers expected, found {procs:?}");

    let port = p.port();
    p.kill_server();
    // Hold the workers while no server runs, so that they are certainly still running when the next one starts
    // (the adoption of running tasks is what is under test, not how fast a job can end).
    for w in &wrappers {
        signal_group(*w, libc::SIGSTOP);
    }
    for pid in &procs {
        assert!(alive(*pid), "process {pid} of the job died with the server");
    }

    p.start_server(Some(port));
    let v = p.wait_state_where(&id, "an adopted event", |v| kinds(v).iter().any(|k| k == "adopted"));
    let adopted: Vec<_> = events(&v).into_iter().filter(|e| e.1 == "adopted").collect();
    assert_eq!(adopted.len(), 1, "{adopted:?}");
    assert!(adopted[0].2.contains("2 of 2 workers still running"), "{}", adopted[0].2);
    for w in &wrappers {
        assert!(adopted[0].2.contains(&w.to_string()), "the adopted event names pid {w}: {}", adopted[0].2);
    }
    // The adopted job holds its resources again (before anything pending could take them).
    let n = p.cli_json(&["nodes", "--json"]);
    assert_eq!(n["nodes"][0]["allocated"]["cpus"].as_f64(), Some(2.0), "the adopted job's 2 CPUs: {n}");
    for w in &wrappers {
        signal_group(*w, libc::SIGCONT);
    }

    let v = p.wait_state(&id, "succeeded");
    assert_eq!((v["attempt"].as_i64(), v["restarts"].as_i64()), (Some(1), Some(0)), "{v}");
    let k = kinds(&v);
    for bad in ["restarted", "requeued", "failed", "warning"] {
        assert!(!k.iter().any(|x| x == bad), "unexpected {bad} event after adoption: {k:?}");
    }
    assert_eq!(count_kind(&v, "started"), 1, "{k:?}");
    assert!(!p.job_dir(&id).join("attempt-2").exists(), "a second attempt started");
    let mut after = worker_pids(&v);
    after.sort_unstable();
    let mut before = wrappers.clone();
    before.sort_unstable();
    assert_eq!(after, before, "the adopted workers are the ones that finished");
    for w in v["workers"].as_array().expect("workers") {
        assert_eq!((w["state"].as_str(), w["exit_code"].as_i64()), (Some("exited"), Some(0)), "{w}");
    }
    assert_eq!(v["summary"]["resumed_from"], 0, "the run went through without a restart: {}", v["summary"]);
    assert_eq!(v["summary"]["steps"], steps, "{}", v["summary"]);
    // Metrics ingestion picked up where the killed server left off.
    check_metrics(&p, &id, steps as i64);
    let n = p.cli_json(&["nodes", "--json"]);
    assert_eq!(n["nodes"][0]["allocated"]["cpus"].as_f64(), Some(0.0), "the adopted job's CPUs are released: {n}");
}

#[test]
fn a_worker_lost_while_the_server_was_down_is_restarted_once() {
    let mut p = Platform::new("lost");
    let steps = 1500;
    let id = p.submit("phoenix", &digits_job("phoenix", steps, 2, 100, 100, true));
    let ckpts = p.job_dir(&id).join("run/checkpoints");
    let v = p.wait_state_where(&id, "a checkpoint of attempt 1", |v| {
        v["state"] == "running" && ckpts.join("step-000100/manifest.json").is_file()
    });
    let victim = rank_pid(&v, 0);
    let first = attempt_procs(&id, 1);
    assert!(first.len() >= 4, "2 wrappers and 2 workers expected, found {first:?}");

    p.kill_server();
    // Rank 0's whole session dies while no server watches: no exit status is recorded for it.
    signal_group(victim, libc::SIGKILL);
    p.wait("rank 0's processes to die", || (!alive(victim)).then_some(()));
    assert!(!p.job_dir(&id).join("attempt-1/rank-0.exit").exists(), "a SIGKILLed wrapper wrote an exit file");

    p.start_server(None);
    let v = watch_no_overlap(&p, &id, 1, |v| v["attempt"] == 2);
    for pid in &first {
        assert!(!alive(*pid), "process {pid} of attempt 1 alive once attempt 2 started");
    }
    let v = if v["state"] == "succeeded" { v } else { p.wait_state(&id, "succeeded") };
    assert_eq!((v["restarts"].as_i64(), v["attempt"].as_i64()), (Some(1), Some(2)), "{v}");
    let ev = events(&v);
    let restarted: Vec<_> = ev.iter().filter(|e| e.1 == "restarted").collect();
    assert_eq!(restarted.len(), 1, "exactly one restart: {ev:?}");
    assert!(
        restarted[0].2.contains("rank 0 was lost") && restarted[0].2.contains("restart 1 of 2"),
        "the restart must say rank 0 was lost: {}",
        restarted[0].2
    );
    assert_eq!(count_kind(&v, "adopted"), 1, "{ev:?}");
    let started: Vec<_> = ev.iter().filter(|e| e.1 == "started").collect();
    assert_eq!(started.len(), 2, "{ev:?}");
    assert!(restarted[0].0 < started[1].0, "attempt 2 started before the restart: {ev:?}");
    assert!(!p.job_dir(&id).join("attempt-3").exists(), "a third attempt started");
    // Attempt 2 resumed from a checkpoint rather than from scratch, and finished the job.
    let from = v["summary"]["resumed_from"].as_u64().unwrap_or(0);
    assert!(from >= 100 && from < steps as u64, "attempt 2 resumed from step {from}: {}", v["summary"]);
    assert_eq!(v["summary"]["steps"], steps, "{}", v["summary"]);
    let log = p.request("GET", &format!("/api/v1/jobs/{id}/logs?rank=0&attempt=2"), Some(&p.token), None);
    assert_eq!(log.status, 200);
    assert!(text(&log.body).contains("resuming from"), "attempt 2's rank 0 log:\n{}", text(&log.body));
    for w in v["workers"].as_array().expect("workers") {
        assert_eq!((w["state"].as_str(), w["exit_code"].as_i64()), (Some("exited"), Some(0)), "{w}");
    }
    check_metrics(&p, &id, steps as i64);
}

#[test]
fn auth_isolates_teams_end_to_end() {
    let p = Platform::new("auth");
    let mut tokens = Vec::new();
    for (user, team) in [("alice", "vision"), ("bob", "nlp")] {
        let body = json!({ "user": user, "team": team }).to_string();
        let r = p.request("POST", "/api/v1/tokens", Some(&p.token), Some(("application/json", body.as_bytes())));
        assert_eq!(r.status, 201, "creating {user}'s token: {}", text(&r.body));
        let v = r.json();
        assert_eq!(
            (v["user"].as_str(), v["team"].as_str(), v["admin"].as_bool()),
            (Some(user), Some(team), Some(false))
        );
        let t = v["token"].as_str().unwrap_or_else(|| panic!("no token: {v}")).to_owned();
        assert!(t.starts_with("shoal_"), "{t}");
        let who = p.request("GET", "/api/v1/whoami", Some(&t), None).json();
        assert_eq!((who["user"].as_str(), who["team"].as_str()), (Some(user), Some(team)), "{who}");
        tokens.push(t);
    }
    let (alice, bob) = (tokens[0].clone(), tokens[1].clone());

    let id = p.submit_as(&alice, "alices", &endless_job("alices", 0));
    let v = p.cli_json_as(&alice, &["status", &id, "--json"]);
    assert_eq!((v["user"].as_str(), v["team"].as_str()), (Some("alice"), Some("vision")), "{v}");
    let listed = |token: &str| {
        let j = p.cli_json_as(token, &["jobs", "--json"]);
        j["jobs"].as_array().expect("jobs").iter().any(|j| j["id"] == id.as_str())
    };
    assert!(listed(&alice), "alice does not see her own job");
    assert!(listed(&p.token), "the admin does not see alice's job");
    assert!(!listed(&bob), "bob (team nlp) sees alice's job (team vision)");

    // Bob cannot see, follow or touch it: to him it does not exist.
    for args in [&["status", id.as_str(), "--json"][..], &["cancel", id.as_str()], &["logs", id.as_str()]] {
        let out = p.cli(&bob, args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "bob's shoal {args:?} succeeded:\n{}", text(&out.stdout));
        assert!(err.contains("404") && err.contains(&id), "bob's shoal {args:?}: {err}");
    }
    for path in [format!("/api/v1/jobs/{id}/metrics"), format!("/api/v1/jobs/{id}/events")] {
        let r = p.request("GET", &path, Some(&bob), None);
        assert_eq!(r.status, 404, "bob GET {path}: {}", text(&r.body));
    }
    let r = p.request("GET", "/api/v1/jobs?team=vision", Some(&bob), None);
    assert_eq!(r.status, 403, "bob lists team vision: {}", text(&r.body));
    let r = p.request(
        "POST",
        "/api/v1/tokens",
        Some(&alice),
        Some(("application/json", br#"{"user":"eve","team":"vision","admin":true}"#)),
    );
    assert_eq!(r.status, 403, "a non-admin made a token: {}", text(&r.body));
    let v = p.try_status(&id).expect("status");
    assert_eq!(v["cancel_requested"], false, "bob's refused cancel left a mark: {v}");

    // Without a token, or with a wrong one: 401, as JSON.
    for token in [None, Some("shoal_0000"), Some("not-a-token")] {
        for (method, path) in [
            ("GET", "/api/v1/jobs".to_owned()),
            ("GET", format!("/api/v1/jobs/{id}")),
            ("POST", format!("/api/v1/jobs/{id}/cancel")),
        ] {
            let r = p.request(method, &path, token, None);
            assert_eq!(r.status, 401, "{method} {path} with token {token:?}: {}", text(&r.body));
            assert!(r.headers.to_ascii_lowercase().contains("content-type: application/json"), "{}", r.headers);
            let e = r.json();
            assert_eq!(e["status"], 401, "{e}");
            assert!(e["error"].as_str().is_some_and(|m| m.contains("unauthorized")), "{e}");
        }
    }
    let out = shoal()
        .args(["jobs", "--addr", &p.addr])
        .env("HOME", &p.root)
        .env("SHOAL_DATA_DIR", p.root.join("nowhere"))
        .env_remove("SHOAL_TOKEN")
        .env_remove("SHOAL_CONFIG")
        .output()
        .expect("shoal jobs");
    assert!(!out.status.success() && text(&out.stderr).contains("401"), "jobs without a token: {}", text(&out.stderr));
    // Healthz needs no token.
    assert_eq!(p.request("GET", "/healthz", None, None).status, 200);

    // Alice may cancel her own job.
    let v = p.cli_json_as(&alice, &["cancel", &id, "--json"]);
    assert_eq!(v["cancel_requested"], true, "{v}");
    let v = p.wait_state(&id, "cancelled");
    assert!(events(&v).iter().any(|e| e.1 == "cancel" && e.2.contains("alice")), "{:?}", events(&v));
}

#[test]
fn the_second_server_on_a_data_dir_is_refused() {
    let p = Platform::new("lock");
    let first_pid = p.server.as_ref().map(Child::id).expect("server");
    let second = format!("127.0.0.1:{}", free_port());
    let mut child = KillOnDrop(
        shoal()
            .args(["server", "--listen", &second, "--data-dir"])
            .arg(&p.data)
            .env("HOME", &p.root)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a second server"),
    );
    let st = p.wait("the second server to exit", || child.0.try_wait().expect("try_wait"));
    let mut err = String::new();
    child.0.stderr.take().expect("stderr").read_to_string(&mut err).expect("read stderr");
    assert!(!st.success(), "the second server exited with {st}:\n{err}");
    assert!(
        err.contains(&p.data.display().to_string()) && err.contains("another shoal server"),
        "the refusal must name the data directory: {err}"
    );
    assert!(err.contains(&format!("pid {first_pid}")), "the refusal names the holder: {err}");
    assert!(http(&second, "GET", "/healthz", None, None).is_err(), "the refused server listens on {second}");
    // The first one is unharmed.
    let h = p.request("GET", "/healthz", None, None);
    assert_eq!(h.status, 200);
    assert!(p.cli(&p.token, &["jobs"]).status.success());
}

/// The README's main command, shortened: the embedded server trains the demo GPT on 2 workers,
/// stdout carries one JSON object, and the model beats the unigram baseline on held-out text.
#[test]
fn demo_runs_the_built_in_job_end_to_end() {
    let out = shoal().args(["demo", "--json", "--steps", "40"]).output().expect("run shoal demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "shoal demo failed:\n{stdout}\n{stderr}");
    let v: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{stdout}"));
    if let Some(d) = v["data_dir"].as_str() {
        let _ = std::fs::remove_dir_all(d);
    }
    assert_eq!((v["state"].as_str(), v["succeeded"].as_bool()), (Some("succeeded"), Some(true)), "{v}");
    let sum = &v["summary"];
    assert_eq!((sum["steps"].as_u64(), sum["world_size"].as_u64()), (Some(40), Some(2)), "{sum}");
    let (eval, baseline) =
        (sum["eval_loss"].as_f64().expect("eval_loss"), sum["baseline_loss"].as_f64().expect("baseline"));
    assert!(eval < baseline, "after 40 steps the GPT's eval loss {eval} should beat the unigram baseline {baseline}");
    let kinds: Vec<&str> = v["events"].as_array().expect("events").iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds.last(), Some(&"succeeded"), "{kinds:?}");
    assert!(!v["diagnosis"].as_array().expect("diagnosis").is_empty(), "{v}");
    assert!(stderr.contains("succeeded"), "progress belongs on stderr:\n{stderr}");

    let bad = shoal().args(["demo", "--steps", "0"]).output().expect("run shoal demo");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--steps"), "{}", String::from_utf8_lossy(&bad.stderr));
}

/// A job with attackers (`[chaos]`) is marked as an experiment in its events as it is submitted, and under the
/// median one sign-flipping worker of three does not keep the model from learning.
#[test]
fn an_attack_is_told_as_an_experiment_and_the_median_bears_it() {
    let p = Platform::new("robust-chaos");
    let spec = digits_job("attacked", 120, 0, 120, 10, false)
        .replace("count = 2", "count = 3")
        .replace("cpus = 1\n", "cpus = 0.5\n")
        + "\n[robust]\nrule = \"median\"\nf = 1\n[chaos]\nbyzantine_ranks = [2]\nattack = \"signflip\"\n";
    let id = p.submit("attacked", &spec);
    let v = p.wait_state(&id, "succeeded");
    let ev = events(&v);
    let told: Vec<_> = ev.iter().filter(|e| e.1 == "experiment").collect();
    assert_eq!(told.len(), 1, "{ev:?}");
    assert!(told[0].2.contains("ranks [2] send Signflip (scale 10)") && told[0].2.contains("Median"), "{told:?}");
    let log = std::fs::read_to_string(p.job_dir(&id).join("attempt-1/rank-0.log")).expect("rank-0.log");
    assert!(log.contains("experiment ([chaos]): ranks [2] send signflip (scale 10)"), "{log}");
    let losses = check_metrics(&p, &id, 120);
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(last < first * 0.7, "under the median the loss fell from {first} to {last} only");
}

/// A parameter-server job (`train.strategy = "ps"`): the platform starts its server beside its two workers as the
/// last task of the gang, the scheduler accounts for three tasks, the job shows each task's role, and the server's
/// log says what it served.
#[test]
fn parameter_servers_are_tasks_of_their_job() {
    let p = Platform::new("ps-tasks");
    let spec = digits_job("ps", 60, 0, 30, 10, false)
        .replace("dataset = \"digits\"", "dataset = \"digits\"\nstrategy = \"ps\"")
        .replace("cpus = 1\n", "cpus = 0.5\n")
        + "\n[ps]\nservers = 1\nmode = \"sync\"\n";
    let id = p.submit("ps", &spec);
    let v = p.wait_state(&id, "succeeded");
    assert_eq!(v["worker_count"], 3, "two workers and a server: {v}");
    let roles: Vec<(i64, String)> = v["workers"]
        .as_array()
        .unwrap_or_else(|| panic!("tasks: {v}"))
        .iter()
        .map(|t| (t["rank"].as_i64().unwrap_or(-1), t["role"].as_str().unwrap_or("").to_string()))
        .collect();
    assert_eq!(roles, vec![(0, "worker".into()), (1, "worker".into()), (2, "server".into())], "{v}");
    let log = std::fs::read_to_string(p.job_dir(&id).join("attempt-1/rank-2.log")).expect("rank-2.log");
    assert!(log.contains("parameter server 0: version 60, 120 pushes"), "{log}");
    // The events tell the server apart from the workers.
    let told: Vec<String> = events(&v).into_iter().map(|e| e.2).collect();
    assert!(told.iter().any(|m| m.starts_with("attempt 1: 2 workers and 1 parameter server on ")), "{told:#?}");
    assert!(told.iter().any(|m| m == "all 2 workers and 1 parameter server exited 0"), "{told:#?}");
    let losses = check_metrics(&p, &id, 60);
    assert!(losses[losses.len() - 1] < losses[0] * 0.7, "the loss fell from {} to {} only", losses[0], losses[59]);
}
