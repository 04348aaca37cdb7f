//! Diagnosis on real runs: a real server, real workers training on real data, problems injected for real (a slow
//! data source, a rank stopped and continued from outside, slowed collectives), and a healthy run. Each must be
//! named correctly; `/metrics` of the same server must pass Prometheus' own parser.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

/// A `shoal server` on a free loopback port, killed with everything it started when dropped.
struct Server {
    child: Child,
    dir: PathBuf,
    addr: String,
    token: String,
}

impl Server {
    fn start(tag: &str) -> Server {
        let dir = std::env::temp_dir().join(format!("shoal-diag-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let addr = format!("127.0.0.1:{port}");
        let child = shoal()
            .args(["server", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen", &addr])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("server.log")).expect("log"))
            .spawn()
            .expect("start shoal server");
        let mut s = Server { child, dir, addr, token: String::new() };
        let t0 = Instant::now();
        loop {
            if let Ok(t) = std::fs::read_to_string(s.dir.join("data/admin.token")) {
                s.token = t.trim().to_owned();
                if s.cli(&["jobs", "--json"]).is_ok() {
                    return s;
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "the server did not come up: {}", s.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    fn cli(&self, args: &[&str]) -> Result<Value, String> {
        let out = shoal()
            .args(args)
            .args(["--addr", &self.addr, "--token", &self.token])
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(text.trim()).map_err(|e| format!("{e}: {text}"))
    }

    fn submit(&self, toml: &str) -> String {
        let path = self.dir.join("job.toml");
        std::fs::write(&path, toml).expect("job file");
        let v = self.cli(&["submit", "--json", path.to_str().expect("utf-8 path")]).expect("submit");
        v["id"].as_str().expect("id").to_owned()
    }

    fn wait(&self, id: &str, done: impl Fn(&Value) -> bool, what: &str, limit: Duration) -> Value {
        let t0 = Instant::now();
        loop {
            let v = self.cli(&["status", id, "--json"]).expect("status");
            if done(&v) {
                return v;
            }
            assert!(
                !matches!(v["state"].as_str(), Some("failed" | "cancelled")),
                "{id} ended while waiting for {what}: {v:#}\n{}",
                self.log()
            );
            assert!(t0.elapsed() < limit, "{id}: no {what} within {limit:?}: {v:#}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn diagnose(&self, id: &str) -> Vec<Value> {
        let v = self.cli(&["diagnose", id, "--json"]).expect("diagnose");
        v["findings"].as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        kill_tasks_of(&self.dir.join("data"));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// SIGKILLs every process the server of `data` started (their environment names it).
fn kill_tasks_of(data: &Path) {
    let want = format!("SHOAL_SERVER_DATA={}", data.display());
    let Ok(dir) = std::fs::read_dir("/proc") else { return };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ"))
            && env.split(|&b| b == 0).any(|v| v == want.as_bytes())
        {
            // SAFETY: plain syscall on a process this test's server started.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

fn job(name: &str, steps: usize, env: &str) -> String {
    format!(
        r#"
name = "{name}"
[workers]
count = 2
[resources]
cpus = 1
memory = "1GiB"
[restart]
max = 0
[env]
{env}
[train]
dataset = "digits"
global_batch = 512
steps = {steps}
lr = 2e-3
log_every = 50
[train.model]
kind = "mlp"
hidden = [256, 256]
[checkpoint]
every = 0
keep = 1
"#
    )
}

fn kinds(f: &[Value]) -> Vec<&str> {
    f.iter().filter_map(|x| x["kind"].as_str()).collect()
}

#[test]
fn diagnosis_names_injected_problems_and_calls_a_healthy_run_healthy() {
    let s = Server::start("inject");
    let limit = Duration::from_secs(300);
    let succeeded = |v: &Value| v["state"] == "succeeded";

    // Healthy. Other tests share this machine's two cores and each worker is pinned to one of them, so a burst of
    // outside load on one core can make a rank truly slower for a while; one more run is allowed for that.
    let mut f = Vec::new();
    for attempt in 0..2 {
        let id = s.submit(&job(&format!("healthy-{attempt}"), 300, ""));
        s.wait(&id, succeeded, "success", limit);
        f = s.diagnose(&id);
        if kinds(&f) == ["healthy"] {
            break;
        }
        eprintln!("healthy run {attempt} was judged {f:?} (outside load?); running it once more");
    }
    assert_eq!(kinds(&f), ["healthy"], "{f:#?}");

    // A slow data source: every batch takes 60 ms to load, longer than a step, so the prefetcher cannot hide it.
    let id = s.submit(&job("slow-data", 120, "SHOAL_FAULT_DATA_DELAY = \"60ms\""));
    s.wait(&id, succeeded, "success", limit);
    let f = s.diagnose(&id);
    assert_eq!(f.first().and_then(|x| x["kind"].as_str()), Some("data_loading"), "{f:#?}");
    assert!(f[0]["evidence"].as_str().unwrap_or("").contains("waiting for the next batch"), "{f:#?}");

    // Slowed collectives.
    let id = s.submit(&job("slow-comm", 120, "SHOAL_FAULT_COMM_DELAY = \"40ms\""));
    s.wait(&id, succeeded, "success", limit);
    let f = s.diagnose(&id);
    assert_eq!(f.first().and_then(|x| x["kind"].as_str()), Some("communication"), "{f:#?}");
    let evidence = f[0]["evidence"].as_str().unwrap_or("");
    assert!(evidence.contains("bus bandwidth") && evidence.contains("`shoal bench` measured"), "{f:#?}");

    // A straggler: rank 1 stopped and continued from outside, 120 ms of every 160 ms.
    let id = s.submit(&job("straggler", 2000, ""));
    let v = s.wait(
        &id,
        |v| v["state"] == "running" && v["last_metrics"]["step"].as_u64().is_some_and(|st| st >= 20),
        "the first steps",
        limit,
    );
    let rank1 = v["workers"]
        .as_array()
        .and_then(|w| w.iter().find(|w| w["rank"] == 1))
        .and_then(|w| w["pid"].as_i64())
        .expect("rank 1's pid") as i32;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                // SAFETY: signals to the process group of a worker this test's server started.
                unsafe {
                    libc::kill(-rank1, libc::SIGSTOP);
                }
                std::thread::sleep(Duration::from_millis(120));
                // SAFETY: as above.
                unsafe {
                    libc::kill(-rank1, libc::SIGCONT);
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        })
    };
    // Let the duty cycle act on at least a full diagnosis window of steps.
    let t0 = Instant::now();
    let mut f = Vec::new();
    while t0.elapsed() < limit {
        std::thread::sleep(Duration::from_secs(2));
        f = s.diagnose(&id);
        let v = s.cli(&["status", &id, "--json"]).expect("status");
        let step = v["last_metrics"]["step"].as_u64().unwrap_or(0);
        if step >= 220 || v["state"] != "running" {
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = stopper.join();
    // SAFETY: make sure the rank runs again whatever happened above.
    unsafe {
        libc::kill(-rank1, libc::SIGCONT);
    }
    assert_eq!(f.first().and_then(|x| x["kind"].as_str()), Some("straggler"), "{f:#?}");
    assert_eq!(f[0]["rank"], 1, "{f:#?}");

    // Prometheus' own parser accepts /metrics while a job runs (skipped, saying so, where promtool is missing).
    check_metrics_with_promtool(&s);
    let _ = s.cli(&["cancel", &id, "--json"]);
}

fn check_metrics_with_promtool(s: &Server) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/test-promtool.sh");
    let out = Command::new("bash").arg(&script).output().expect("run test-promtool.sh");
    assert!(out.status.success(), "installing promtool failed: {}", String::from_utf8_lossy(&out.stderr));
    let promtool = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    // Fetch /metrics with the token over a plain socket.
    use std::io::{Read, Write};
    let mut sock = std::net::TcpStream::connect(&s.addr).expect("connect");
    sock.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    write!(
        sock,
        "GET /metrics HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        s.addr, s.token
    )
    .expect("request");
    let mut resp = String::new();
    sock.read_to_string(&mut resp).expect("response");
    let (head, body) = resp.split_once("\r\n\r\n").expect("http response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.into() };
    for name in
        ["shoal_jobs", "shoal_queue_pending_jobs", "shoal_node_cpus", "shoal_job_loss", "shoal_api_requests_total"]
    {
        assert!(body.contains(&format!("\n{name}")) || body.starts_with(name), "no {name} in:\n{body}");
    }
    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start promtool");
    child.stdin.take().expect("stdin").write_all(body.as_bytes()).expect("feed promtool");
    let out = child.wait_with_output().expect("promtool");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.trim().is_empty(), "promtool check metrics:\n{text}\n--- input:\n{body}");
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}
