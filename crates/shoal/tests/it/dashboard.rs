//! The web dashboard in a real headless browser: a real `shoal server`, a real training job, and Chromium (driven by
//! `scripts/dashboard-check.mjs` through playwright-core) looking at the job's page while it trains. The loss chart
//! must draw, grow while the job runs, and the page must log no console error, page error or failed request.
//!
//! `scripts/test-browser.sh` installs what the browser needs (Debian's chromium, as root; playwright-core into a
//! cache directory outside the checkout). The screenshot is kept as `TARGET/dashboard.png` for a human to look at.
//!
//! Every wait has a deadline and says what it waited for; the guard kills the server and every process whose
//! environment names its data directory, whatever happened.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::platform::{data_dir_procs, free_port, shoal, tail};

/// How long the server, the job or the job's first metrics may take (debug builds on 2 loaded cores).
const WAIT: Duration = Duration::from_secs(180);
/// How long the browser check may run in all (its own timeout for the first point is 90 s).
const CHECK_TIMEOUT_S: u64 = 90;

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts")
}

/// The Cargo target directory this test was built into (`TARGET/debug/shoal` → `TARGET`).
fn target_dir() -> PathBuf {
    let exe = Path::new(env!("CARGO_BIN_EXE_shoal"));
    exe.parent().and_then(Path::parent).map_or_else(|| PathBuf::from("target"), Path::to_path_buf)
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-dashboard-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn read(path: &Path) -> String {
    String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()).into_owned()
}

/// The server, and everything it started: killed on drop, whatever happened.
struct Guard {
    server: Option<Child>,
    data: PathBuf,
    dir: PathBuf,
}

impl Guard {
    fn server_log(&self) -> String {
        tail(&read(&self.dir.join("server.log")), 4000).to_owned()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(mut child) = self.server.take() {
            // SAFETY: kill(2) on the server this test started; SIGTERM lets it shut down cleanly.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        // The server leaves running jobs running (a later server adopts them): kill what it started.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = data_dir_procs(&self.data);
            if left.is_empty() {
                break;
            }
            for pid in &left {
                // SAFETY: kill(2) on a process whose environment names this test's data directory.
                unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
            }
            if Instant::now() >= deadline {
                eprintln!("dashboard test: processes of {} still alive after SIGKILL: {left:?}", self.data.display());
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Runs `cmd` with stdout and stderr into files under `dir`, killing it at `deadline`; returns (status, stdout,
/// stderr).
fn run_until(mut cmd: Command, dir: &Path, tag: &str, deadline: Duration, what: &str) -> (ExitStatus, String, String) {
    let (out_path, err_path) = (dir.join(format!("{tag}.stdout")), dir.join(format!("{tag}.stderr")));
    let out = File::create(&out_path).expect("stdout file");
    let err = File::create(&err_path).expect("stderr file");
    let mut child =
        cmd.stdin(Stdio::null()).stdout(out).stderr(err).spawn().unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if t0.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} did not finish within {} s; its stderr:\n{}",
                deadline.as_secs(),
                tail(&read(&err_path), 4000)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (status, read(&out_path), read(&err_path))
}

/// `shoal ARGS --addr A --token T` (with an empty client config, so nothing of the user's applies).
fn client(g: &Guard, addr: &str, token: &str, args: &[&str]) -> (bool, String, String) {
    let mut c = shoal();
    c.args(args).args(["--addr", addr, "--token", token]).env("SHOAL_CONFIG", g.dir.join("client.toml"));
    let (st, out, err) = run_until(c, &g.dir, "client", Duration::from_secs(60), &format!("shoal {}", args.join(" ")));
    (st.success(), out, err)
}

fn status(g: &Guard, addr: &str, token: &str, id: &str) -> Value {
    let (ok, out, err) = client(g, addr, token, &["status", id, "--json"]);
    assert!(ok, "shoal status {id} failed: {err}\nserver log:\n{}", g.server_log());
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("shoal status --json is not JSON ({e}): {out}"))
}

#[test]
fn the_dashboard_draws_live_loss_without_console_errors() {
    // The browser first: installing it may take a minute, and the job should not run out meanwhile.
    let dir = tmpdir("live");
    let (st, out, err) = run_until(
        Command::new(scripts().join("test-browser.sh")),
        &dir,
        "test-browser",
        Duration::from_secs(1500),
        "scripts/test-browser.sh",
    );
    assert!(st.success(), "scripts/test-browser.sh failed ({st}):\n{}", tail(&err, 4000));
    let node_modules = out.lines().last().unwrap_or("").trim().to_owned();
    assert!(
        Path::new(&node_modules).join("playwright-core").is_dir(),
        "scripts/test-browser.sh printed {node_modules:?}, which holds no playwright-core"
    );

    // A server on a free port, with room for the job whatever this machine has.
    let data = dir.join("data");
    std::fs::write(dir.join("client.toml"), "").expect("client config");
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let log = File::create(dir.join("server.log")).expect("server log");
    let server = shoal()
        .args(["server", "--data-dir"])
        .arg(&data)
        .args(["--listen", &addr, "--cpus", "2", "--memory", "4GiB"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("server log"))
        .stderr(log)
        .spawn()
        .expect("start shoal server");
    let mut g = Guard { server: Some(server), data: data.clone(), dir: dir.clone() };
    let t0 = Instant::now();
    let token = loop {
        let token = std::fs::read_to_string(data.join("admin.token")).unwrap_or_default().trim().to_owned();
        if !token.is_empty() && std::net::TcpStream::connect(&addr).is_ok() {
            break token;
        }
        if let Some(st) = g.server.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            panic!("shoal server exited ({st}) before serving:\n{}", g.server_log());
        }
        assert!(t0.elapsed() < WAIT, "shoal server did not listen on {addr} within {WAIT:?}:\n{}", g.server_log());
        std::thread::sleep(Duration::from_millis(100));
    };

    // A job that trains long enough for the browser to watch it (a few ms a step: minutes; it is cancelled
    // afterwards).
    let spec = dir.join("dash.toml");
    std::fs::write(
        &spec,
        r#"name = "dash"

[workers]
count = 2

[resources]
cpus = 1
memory = "1GiB"

[train]
dataset = "digits"
global_batch = 256
steps = 20000
lr = 2e-3
eval_every = 200
log_every = 10

[train.model]
kind = "mlp"
hidden = [256, 256]
"#,
    )
    .expect("job spec");
    let spec_path = spec.to_string_lossy().into_owned();
    let (ok, out, err) = client(&g, &addr, &token, &["submit", &spec_path, "--json"]);
    assert!(ok, "shoal submit failed: {err}\nserver log:\n{}", g.server_log());
    let id = serde_json::from_str::<Value>(&out)
        .ok()
        .and_then(|v| v["id"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("shoal submit --json printed no id: {out}"));
    eprintln!("dashboard test: server {addr}, job {id}");

    // Running, with metrics stored.
    let t0 = Instant::now();
    loop {
        let v = status(&g, &addr, &token, &id);
        let state = v["state"].as_str().unwrap_or("").to_owned();
        let step = v["last_metrics"]["step"].as_f64().unwrap_or(0.0);
        if state == "running" && step >= 1.0 {
            eprintln!("dashboard test: {id} running at step {step} after {:.1} s", t0.elapsed().as_secs_f64());
            break;
        }
        assert!(
            !matches!(state.as_str(), "succeeded" | "failed" | "cancelled"),
            "job {id} ended ({state}) before the browser looked: {v:#}\nserver log:\n{}",
            g.server_log()
        );
        assert!(
            t0.elapsed() < WAIT,
            "job {id} was not running with metrics within {WAIT:?} (state {state}, step {step}): {v:#}\nserver log:\n{}",
            g.server_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // The browser looks at the job's page.
    let shot = dir.join("dashboard.png");
    let url = format!("http://{addr}/#token={token}&/jobs/{id}");
    let mut check = Command::new("node");
    check
        .arg(scripts().join("dashboard-check.mjs"))
        .arg(&url)
        .arg(&shot)
        .arg(CHECK_TIMEOUT_S.to_string())
        .env("NODE_PATH", &node_modules)
        .env("SHOAL_PLAYWRIGHT_NODE_MODULES", &node_modules);
    let (st, out, err) =
        run_until(check, &dir, "dashboard-check", Duration::from_secs(CHECK_TIMEOUT_S + 150), "dashboard-check.mjs");
    eprintln!("dashboard-check.mjs ({st}):\n{}{}", tail(&err, 4000), out);
    let report: Value = out
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("dashboard-check.mjs printed no JSON report; stderr:\n{err}"));
    if shot.exists() {
        let keep = target_dir().join("dashboard.png");
        match std::fs::copy(&shot, &keep) {
            Ok(_) => eprintln!("dashboard test: screenshot in {}", keep.display()),
            Err(e) => eprintln!("dashboard test: cannot copy the screenshot to {}: {e}", keep.display()),
        }
    }
    assert!(st.success(), "dashboard-check.mjs failed ({st}): {report:#}\n{}", tail(&err, 4000));
    assert!(report["points"].as_u64().unwrap_or(0) >= 1, "no point on the loss chart: {report:#}");
    assert!(report["memory_ranks"].as_i64().unwrap_or(0) >= 1, "no rank on the memory card: {report:#}");
    assert_eq!(report["rounds"]["shown"], false, "the federated rounds card shows for a DDP job: {report:#}");
    assert_eq!(report["console_errors"].as_array().map_or(usize::MAX, Vec::len), 0, "console errors: {report:#}");
    assert_eq!(report["page_errors"].as_array().map_or(usize::MAX, Vec::len), 0, "page errors: {report:#}");
    let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    assert!(size > 10 * 1024, "the screenshot {} has {size} bytes (want > 10 KiB)", shot.display());

    // Done: cancel the job and see it end.
    let (ok, _, err) = client(&g, &addr, &token, &["cancel", &id]);
    assert!(ok, "shoal cancel {id} failed: {err}");
    let t0 = Instant::now();
    loop {
        let v = status(&g, &addr, &token, &id);
        let state = v["state"].as_str().unwrap_or("");
        if matches!(state, "succeeded" | "failed" | "cancelled") {
            break;
        }
        assert!(t0.elapsed() < WAIT, "job {id} did not end within {WAIT:?} of its cancel (state {state})");
        std::thread::sleep(Duration::from_millis(250));
    }

    // A federated job: its page shows the rounds.
    let fed = dir.join("fed.toml");
    std::fs::write(
        &fed,
        "name = \"dash-fed\"\n[workers]\ncount = 2\n[resources]\ncpus = 1\nmemory = \"1GiB\"\n[train]\n\
         model = \"mlp\"\ndataset = \"synthetic\"\nstrategy = \"federated\"\noptimizer = \"sgd\"\nglobal_batch = 32\n\
         lr = 0.05\nlog_every = 1\n[federated]\nclients = 1000\nclients_per_round = 100\nrounds = 2000\n\
         local_steps = 5\n",
    )
    .expect("federated job spec");
    let (ok, out, err) = client(&g, &addr, &token, &["submit", &fed.to_string_lossy(), "--json"]);
    assert!(ok, "shoal submit failed: {err}\nserver log:\n{}", g.server_log());
    let fed_id = serde_json::from_str::<Value>(&out)
        .ok()
        .and_then(|v| v["id"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("shoal submit --json printed no id: {out}"));
    let t0 = Instant::now();
    while status(&g, &addr, &token, &fed_id)["last_metrics"]["step"].as_f64().unwrap_or(0.0) < 2.0 {
        assert!(t0.elapsed() < WAIT, "federated job {fed_id} logged no 2 rounds within {WAIT:?}:\n{}", g.server_log());
        std::thread::sleep(Duration::from_millis(250));
    }
    let mut check = Command::new("node");
    check
        .arg(scripts().join("dashboard-check.mjs"))
        .arg(format!("http://{addr}/#token={token}&/jobs/{fed_id}"))
        .arg(dir.join("federated.png"))
        .arg(CHECK_TIMEOUT_S.to_string())
        .env("NODE_PATH", &node_modules)
        .env("SHOAL_PLAYWRIGHT_NODE_MODULES", &node_modules);
    let (st, out, err) =
        run_until(check, &dir, "dashboard-fed", Duration::from_secs(CHECK_TIMEOUT_S + 150), "dashboard-check.mjs");
    let report: Value = out
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("dashboard-check.mjs printed no JSON report; stderr:\n{err}"));
    assert!(st.success(), "dashboard-check.mjs on the federated job failed ({st}): {report:#}\n{}", tail(&err, 4000));
    let rounds = &report["rounds"];
    assert_eq!(rounds["shown"], true, "no rounds card on a federated job's page: {report:#}");
    assert!(rounds["points"].as_u64().unwrap_or(0) >= 1, "the rounds chart drew nothing: {report:#}");
    assert!(rounds["rows"].as_u64().unwrap_or(0) >= 1, "the rounds table is empty: {report:#}");
    let (ok, _, err) = client(&g, &addr, &token, &["cancel", &fed_id]);
    assert!(ok, "shoal cancel {fed_id} failed: {err}");
    drop(g);
}
