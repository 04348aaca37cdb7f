//! The command line's edges: a closed stdout (`shoal jobs | head -1`), a spec too large to submit, and how
//! `shoal run` names the job file and reconciles `-n` with `workers.count`.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-cli-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Runs `cmd` with a stdout whose reading end is already closed, as after `| head -1` has exited.
fn with_closed_stdout(cmd: &mut Command) -> Output {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    cmd.stdout(writer).stderr(Stdio::piped()).output().expect("run shoal")
}

/// Asserts that a command ended quietly on its closed stdout: exit 0 or SIGPIPE, no panic, no complaint.
fn assert_quiet(what: &str, out: &Output) {
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{what}: {stderr}");
    let ok = out.status.success() || out.status.signal() == Some(libc::SIGPIPE);
    assert!(ok, "{what}: {:?}\n{stderr}", out.status);
}

/// A server that answers every request with `body` (HTTP/1.1, JSON), on a thread; returns its address.
fn fake_server(body: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(&stream);
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                line.clear();
            }
            let mut w = &stream;
            let _ = write!(
                w,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    addr
}

const JOBS: &str = r#"{"jobs": [
  {"id": "j-1", "name": "a", "state": "running", "team": "t", "queue": "default", "worker_count": 2},
  {"id": "j-2", "name": "b", "state": "pending", "team": "t", "queue": "default", "worker_count": 1}
]}"#;

const JOB: &str = r#"{"id": "j-1", "name": "a", "state": "running", "team": "t", "user": "u", "queue": "default",
  "workers": [{"rank": 0, "pid": 10, "host": "h", "state": "running", "cpus": "0"}],
  "events": [{"time_ms": 0, "kind": "submitted", "message": "m"}]}"#;

#[test]
fn a_closed_stdout_ends_output_commands_quietly() {
    let jobs = fake_server(JOBS);
    let job = fake_server(JOB);
    let mlp = examples().join("mlp_digits.toml");
    let cases: Vec<(&str, Vec<String>)> = vec![
        ("jobs", vec!["jobs".into(), "--addr".into(), jobs.clone(), "--token".into(), "x".into()]),
        ("jobs --json", vec!["jobs".into(), "--json".into(), "--addr".into(), jobs, "--token".into(), "x".into()]),
        ("status", vec!["status".into(), "j-1".into(), "--addr".into(), job, "--token".into(), "x".into()]),
        ("datasets", vec!["datasets".into()]),
        ("validate", vec!["validate".into(), mlp.display().to_string()]),
    ];
    for (what, args) in cases {
        let out = with_closed_stdout(shoal().args(&args));
        assert_quiet(what, &out);
    }
}

const SHORT_JOB: &str = r#"
name = "cli-short"
[train]
model = "mlp"
dataset = "digits"
global_batch = 16
steps = 4
lr = 0.01
"#;

#[test]
fn shoal_run_reports_its_job_even_when_stdout_is_closed() {
    let dir = tmpdir("closed");
    let job = dir.join("job.toml");
    std::fs::write(&job, SHORT_JOB).expect("write job");
    for json in [false, true] {
        let mut cmd = shoal();
        cmd.args(["run", "-n", "1", "--output"]).arg(dir.join("out")).arg(&job);
        if json {
            cmd.arg("--json");
        }
        let out = with_closed_stdout(&mut cmd);
        let stderr = text(&out.stderr);
        assert!(out.status.success(), "json {json}: {:?}\n{stderr}", out.status);
        assert!(!stderr.contains("panicked"), "json {json}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_spec_over_the_server_limit_is_refused_before_sending() {
    let dir = tmpdir("big");
    let job = dir.join("big.toml");
    let padding = format!("# {}\n", "x".repeat(10 << 20));
    std::fs::write(&job, format!("{padding}{SHORT_JOB}")).expect("write job");
    // Nothing listens on port 1: the refusal must come before any connection.
    let out = shoal().arg("submit").arg(&job).args(["--addr", "127.0.0.1:1", "--token", "x"]).output().expect("run");
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains(&job.display().to_string()), "{stderr}");
    assert!(stderr.contains("at most 1048576 bytes"), "{stderr}");
    assert!(!stderr.contains("cannot reach"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn shoal_run_names_the_job_file_and_reconciles_n_with_workers_count() {
    let dir = tmpdir("count");
    let job = dir.join("job.toml");
    let file = job.display().to_string();
    let refused = |body: String, args: &[&str], needles: &[&str]| {
        std::fs::write(&job, body).expect("write job");
        let out = shoal().arg("run").args(args).arg(&job).output().expect("run");
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} must fail");
        assert!(!stderr.contains("[rank"), "no rank may start: {stderr}");
        for needle in needles {
            assert!(stderr.contains(needle), "{args:?}: {needle:?} not in {stderr}");
        }
    };
    // Too few samples per micro-batch for the workers: the file is named, not an empty origin.
    refused(
        SHORT_JOB.replace("global_batch = 16", "global_batch = 2"),
        &["-n", "4"],
        &[&format!("shoal run: {file}: train.global_batch: 2 samples cannot be shared among 4 workers")],
    );
    let counted = format!("{SHORT_JOB}[workers]\ncount = 2\n");
    refused(counted.clone(), &["-n", "3"], &[&format!("{file}: workers.count = 2 but -n 3")]);
    let elastic = format!("{SHORT_JOB}[workers]\nmin = 2\nmax = 3\n");
    refused(elastic.clone(), &[], &[&format!("{file}: workers.min/max"), "-n"]);
    refused(elastic.clone(), &["-n", "4"], &["-n 4 is above workers.max = 3"]);
    refused(elastic, &["-n", "1"], &["-n 1 is below workers.min = 2"]);
    let out = shoal().args(["run", "--", "true"]).output().expect("run");
    assert!(!out.status.success() && text(&out.stderr).contains("-n N"), "{}", text(&out.stderr));

    // Only workers.count given: it is used.
    std::fs::write(&job, counted).expect("write job");
    let out = shoal().args(["run", "--json", "--output"]).arg(dir.join("out")).arg(&job).output().expect("run");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).expect("summary");
    assert_eq!(s["world_size"], 2, "{s}");
    let _ = std::fs::remove_dir_all(dir);
}
