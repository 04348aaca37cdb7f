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
fn fake_server(body: String) -> String {
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

fn job_view(id: &str, name: &str, state: shoal_wire::JobState, workers: i64) -> shoal_wire::JobView {
    shoal_wire::JobView {
        id: id.into(),
        name: name.into(),
        user: "u".into(),
        team: "t".into(),
        queue: "default".into(),
        priority: 0,
        state,
        restarts: 0,
        attempt: 1,
        worker_count: workers,
        created_ms: 0,
        started_ms: Some(0),
        finished_ms: None,
        reason: String::new(),
        cancel_requested: false,
    }
}

/// What a server answers to `GET /api/v1/jobs`: two jobs.
fn jobs_body() -> String {
    let list = shoal_wire::JobList {
        jobs: vec![
            job_view("j-1", "a", shoal_wire::JobState::Running, 2),
            job_view("j-2", "b", shoal_wire::JobState::Pending, 1),
        ],
    };
    serde_json::to_string(&list).expect("serialize")
}

/// What a server answers to `GET /api/v1/jobs/j-1`: a running job with one worker and one event.
fn job_body() -> String {
    let detail = shoal_wire::JobDetail {
        job: job_view("j-1", "a", shoal_wire::JobState::Running, 1),
        workers: vec![shoal_wire::TaskView {
            job_id: "j-1".into(),
            attempt: 1,
            rank: 0,
            node: "local".into(),
            host: "h".into(),
            pid: Some(10),
            wrapper_pid: Some(9),
            state: shoal_wire::TaskState::Running,
            exit_code: None,
            reason: String::new(),
            cpus: "0".into(),
            gpus: String::new(),
            started_ms: Some(0),
            ended_ms: None,
            cpu_seconds: None,
            role: shoal_wire::TaskRole::Worker,
        }],
        events: vec![shoal_wire::Event {
            id: 1,
            job_id: "j-1".into(),
            time_ms: 0,
            kind: "submitted".into(),
            state: "pending".into(),
            message: "m".into(),
        }],
        spec: None,
        summary: None,
        last_metrics: None,
        hang_dump: None,
    };
    serde_json::to_string(&detail).expect("serialize")
}

#[test]
fn a_closed_stdout_ends_output_commands_quietly() {
    let jobs = fake_server(jobs_body());
    let job = fake_server(job_body());
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

/// `shoal plan`: the GPT example on 4 devices lists layouts that use all four, each with the contract's fields, the
/// ones that fit first and fastest first; the same model at 7B (context 512, 8 samples a step) on eight 80 GiB devices
/// needs sharding
/// (activations kept whole, f32, no recomputation); a width its
/// heads do not divide is refused naming the flags.
#[test]
fn plan_ranks_layouts_of_a_jobs_model_and_of_a_7b_gpt() {
    let gpt = examples().join("gpt_cicero.toml");
    let gpt = gpt.to_str().expect("utf-8 path");
    let run = |args: &[&str]| -> serde_json::Value {
        let out = shoal()
            .arg("plan")
            .args(args)
            .args(["--flops", "1e11", "--bandwidth", "1e10", "--json"])
            .output()
            .expect("shoal plan");
        assert!(out.status.success(), "shoal plan {args:?}: {}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("JSON")
    };
    let v = run(&[gpt, "--devices", "4", "--memory-per-device", "1GiB", "--top", "100"]);
    let layouts = v["layouts"].as_array().expect("layouts");
    assert!(layouts.len() >= 4, "{v}");
    for l in layouts {
        for k in ["data", "tensor", "pipeline", "zero", "memory_per_device_bytes", "step_time_s"] {
            assert!(l.get(k).is_some(), "{k} missing: {l}");
        }
        let used =
            l["data"].as_u64().unwrap_or(0) * l["tensor"].as_u64().unwrap_or(0) * l["pipeline"].as_u64().unwrap_or(0);
        assert_eq!(used, 4, "{l}");
    }
    let times: Vec<f64> =
        layouts.iter().filter(|l| l["fits"] == true).filter_map(|l| l["step_time_s"].as_f64()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "fastest first: {times:?}");
    assert_eq!(v["parameters"], 137_216, "{v}");
    // Runnable layouts carry the strategy and the [parallel] table that run them: the data-parallel ones none.
    let runs = |s: &str| layouts.iter().filter(|l| l["runnable"] == true && l["strategy"] == s).collect::<Vec<_>>();
    assert!(runs("ddp").iter().all(|l| l["parallel"].is_null()), "{v}");
    assert!(runs("tensor").iter().any(|l| l["parallel"]["tensor"] == 4), "{v}");
    assert!(runs("3d").iter().any(|l| l["parallel"]["data"] == 2 && l["parallel"]["pipeline_stages"] == 2), "{v}");
    assert!(layouts.iter().filter(|l| l["runnable"] == false).all(|l| l["strategy"].is_null()), "{v}");
    let big = run(&[
        gpt,
        "--devices",
        "8",
        "--memory-per-device",
        "80GiB",
        "--layers",
        "32",
        "--width",
        "4096",
        "--heads",
        "32",
        "--vocab",
        "32000",
        "--context",
        "512",
        "--global-batch",
        "8",
        "--top",
        "1000",
    ]);
    let first = &big["layouts"][0];
    assert_eq!(first["fits"], true, "{big}");
    let ddp = big["layouts"]
        .as_array()
        .and_then(|ls| ls.iter().find(|l| l["data"] == 8 && l["zero"] == 0).cloned())
        .expect("ddp");
    assert_eq!(ddp["fits"], false, "DDP of a 7B model on 80 GiB devices: {ddp}");
    let out = shoal().args(["plan", gpt, "--width", "100", "--heads", "3"]).output().expect("shoal plan");
    assert!(
        !out.status.success() && text(&out.stderr).contains("--width 100 is not divisible by --heads 3"),
        "{}",
        text(&out.stderr)
    );
}
