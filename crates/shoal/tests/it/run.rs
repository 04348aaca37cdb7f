//! `shoal run -- CMD` with real processes: the environment contract, prefixed
//! output, a failing rank, Ctrl-C, `--json`, `--output`, bad input; and that
//! nothing it started is left running afterwards.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

/// A string unique to one test, put in the environment of `shoal run` (and so
/// of every rank and everything they start).
fn marker() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("run-test-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst))
}

/// `shoal run` with the marker in its environment.
fn run_cmd(marker: &str, args: &[&str]) -> Command {
    let mut c = shoal();
    c.arg("run").args(args).env("SHOAL_TEST_MARKER", marker);
    c
}

fn run(marker: &str, args: &[&str]) -> (Output, Duration) {
    let t = Instant::now();
    let out = run_cmd(marker, args).output().expect("start shoal run");
    (out, t.elapsed())
}

/// Live processes (not zombies) whose environment carries `marker`.
fn with_marker(marker: &str) -> Vec<(u32, String)> {
    let needle = format!("SHOAL_TEST_MARKER={marker}");
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return found };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        if env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()) {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            found.push((pid, String::from_utf8_lossy(&cmd).replace('\0', " ")));
        }
    }
    found
}

/// Asserts that nothing carrying `marker` is left (allowing a moment for a
/// SIGKILLed process to finish dying).
fn assert_nothing_left(marker: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = with_marker(marker);
        if left.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            for (pid, _) in &left {
                // SAFETY: kill(2) on a leftover of this test, so it does not linger.
                unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
            }
            panic!("processes left running after shoal run: {left:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn every_rank_sees_the_environment_contract_and_its_output_is_prefixed() {
    let m = marker();
    let script = r#"echo "env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $SHOAL_RANK $SHOAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $SHOAL_RENDEZVOUS ${SHOAL_JOB_SECRET:+secret}"; echo "to-stderr $RANK" >&2"#;
    let (out, _) = run(&m, &["-n", "3", "--", "sh", "-c", script]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let mut ranks = BTreeSet::new();
    let mut ports = BTreeSet::new();
    let mut stores = BTreeSet::new();
    for line in stdout.lines() {
        let rest = line.strip_prefix("[rank ").unwrap_or_else(|| panic!("unprefixed line {line:?}"));
        let (r, body) = rest.split_once("] ").expect("prefix");
        let f: Vec<&str> = body.split(' ').collect();
        assert_eq!(f.len(), 11, "{line:?}");
        assert_eq!(f[0], "env");
        assert_eq!(f[1], r, "RANK matches the prefix: {line:?}");
        assert_eq!((f[2], f[4], f[6]), ("3", "3", "3"), "world sizes: {line:?}");
        assert_eq!((f[3], f[5]), (r, r), "LOCAL_RANK and SHOAL_RANK: {line:?}");
        assert_eq!(f[7], "127.0.0.1");
        assert!(f[8].parse::<u16>().is_ok_and(|p| p > 0), "MASTER_PORT: {line:?}");
        assert!(f[9].contains(':'), "SHOAL_RENDEZVOUS is host:port: {line:?}");
        assert_eq!(f[10], "secret", "SHOAL_JOB_SECRET set: {line:?}");
        ranks.insert(r.parse::<usize>().expect("rank"));
        ports.insert(f[8].to_string());
        stores.insert(f[9].to_string());
    }
    assert_eq!(ranks, (0..3).collect(), "distinct ranks 0..3:\n{stdout}");
    assert_eq!((ports.len(), stores.len()), (1, 1), "one MASTER_PORT and one store for all:\n{stdout}");
    for r in 0..3 {
        assert!(stderr.lines().any(|l| l == format!("[rank {r}] to-stderr {r}")), "stderr of rank {r}:\n{stderr}");
    }
    assert!(!stdout.contains("to-stderr"), "stderr lines stay on stderr:\n{stdout}");
    assert_nothing_left(&m);
}

#[test]
fn a_failing_rank_is_named_and_the_others_are_stopped() {
    let m = marker();
    let script = r#"if [ "$RANK" = 2 ]; then echo dying; exit 3; fi; sleep 60"#;
    let (out, took) = run(&m, &["-n", "4", "--", "sh", "-c", script]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "the failing rank's code:\n{err}");
    assert!(err.lines().any(|l| l == "shoal run: rank 2 exited with status 3"), "{err}");
    assert!(took < Duration::from_secs(30), "did not stop the sleeping ranks: {took:?}");
    assert!(text(&out.stdout).contains("[rank 2] dying"));
    assert_nothing_left(&m);
}

#[test]
fn ranks_that_ignore_sigterm_are_killed_after_the_grace() {
    let m = marker();
    let script = r#"if [ "$RANK" = 0 ]; then exit 4; fi; trap '' TERM; sleep 60"#;
    let (out, took) = run(&m, &["-n", "3", "--timeout-grace", "1s", "--", "sh", "-c", script]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("shoal run: rank 0 exited with status 4"), "{err}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert_nothing_left(&m);
}

#[test]
fn a_rank_killed_by_a_signal_is_named_with_the_signal() {
    let m = marker();
    let script = r#"if [ "$RANK" = 1 ]; then kill -9 $$; fi; sleep 60"#;
    let (out, took) = run(&m, &["-n", "2", "--", "sh", "-c", script]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 9), "{err}");
    assert!(err.contains("shoal run: rank 1 killed by signal 9"), "{err}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert_nothing_left(&m);
}

#[test]
fn children_that_left_the_rank_are_not_left_behind() {
    let m = marker();
    // A background child in the rank's group, and one in a session of its own.
    let script = r#"sleep 60 & setsid sleep 61 & sleep 0.3; if [ "$RANK" = 1 ]; then exit 7; fi; wait"#;
    let (out, took) = run(&m, &["-n", "2", "--", "sh", "-c", script]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{err}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert_nothing_left(&m);
}

#[test]
fn ctrl_c_stops_every_rank_and_exits_130() {
    let m = marker();
    // The background sleep ignores SIGINT (an asynchronous list of a
    // non-interactive shell): only the launcher's cleanup can stop it.
    let script = r#"sleep 60 & echo ready; wait"#;
    let mut child = run_cmd(&m, &["-n", "3", "--timeout-grace", "2s", "--", "sh", "-c", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start shoal run");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut ready = 0;
    while ready < 3 {
        let line = rx.recv_timeout(Duration::from_secs(30)).expect("every rank says ready");
        ready += usize::from(line.ends_with("] ready"));
    }
    let t = Instant::now();
    // SAFETY: kill(2) on the process this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if t.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("shoal run did not stop after SIGINT");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err);
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted (SIGINT)"), "{err}");
    assert_nothing_left(&m);
}

#[test]
fn json_reports_every_rank_on_an_otherwise_quiet_stdout() {
    let m = marker();
    let (out, _) = run(&m, &["-n", "2", "--json", "--", "sh", "-c", "echo hello $RANK"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout:?}"));
    assert_eq!(v["ranks"], 2);
    assert_eq!(v["ok"], true);
    assert!(v["first_failure"].is_null());
    assert!(v["elapsed_s"].as_f64().is_some_and(|t| t >= 0.0));
    let st = v["statuses"].as_array().expect("statuses");
    assert_eq!(st.len(), 2);
    for (r, s) in st.iter().enumerate() {
        assert_eq!(s["rank"], r);
        assert_eq!(s["exit_code"], 0);
        assert!(s["signal"].is_null());
    }
    assert!(stderr.contains("[rank 0] hello 0") && stderr.contains("[rank 1] hello 1"), "{stderr}");

    let (out, _) =
        run(&m, &["-n", "3", "--json", "--", "sh", "-c", r#"if [ "$RANK" = 1 ]; then exit 5; fi; sleep 60"#]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(5));
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout:?}"));
    assert_eq!(v["ok"], false);
    assert_eq!(v["first_failure"]["rank"], 1);
    assert_eq!(v["first_failure"]["status"], "exit status 5");
    assert_eq!(v["statuses"][1]["exit_code"], 5);
    for r in [0, 2] {
        assert_eq!(v["statuses"][r]["signal"], libc::SIGTERM, "{v}");
        assert!(v["statuses"][r]["exit_code"].is_null());
    }
    assert_nothing_left(&m);
}

#[test]
fn a_missing_command_is_named() {
    let m = marker();
    for cmd in ["shoal-no-such-command-xyz", "./no/such/dir/prog"] {
        let (out, _) = run(&m, &["-n", "2", "--", cmd, "arg"]);
        let err = text(&out.stderr);
        assert!(!out.status.success());
        assert_eq!(out.status.code(), Some(127), "{err}");
        assert!(err.contains(cmd) && err.contains("not found"), "{err}");
    }
}

#[test]
fn output_dir_gets_one_log_per_rank() {
    let m = marker();
    let dir = std::env::temp_dir().join(format!("shoal-{m}"));
    let _ = std::fs::remove_dir_all(&dir);
    let out_dir = dir.join("out");
    let (out, _) = run(
        &m,
        &[
            "-n",
            "3",
            "--output",
            out_dir.to_str().expect("utf-8 path"),
            "--",
            "sh",
            "-c",
            "echo out-$RANK; echo err-$RANK >&2",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    for r in 0..3 {
        let log = std::fs::read_to_string(out_dir.join(format!("logs/rank-{r}.log"))).expect("log file");
        let lines: BTreeSet<&str> = log.lines().collect();
        let want: BTreeSet<String> = [format!("out-{r}"), format!("err-{r}")].into();
        assert_eq!(lines, want.iter().map(String::as_str).collect(), "rank {r}: {log:?}");
    }
    assert!(text(&out.stdout).contains("[rank 1] out-1"), "the terminal still gets the lines");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_is_reported_before_anything_starts() {
    let m = marker();
    for (args, needle) in [
        (vec!["-n", "0", "--", "true"], "at least 1"),
        (vec!["-n", "2", "--timeout-grace", "soon", "--", "true"], "soon"),
        (vec!["-n", "2", "no-such-job.toml"], "no-such-job.toml"),
        (vec!["-n", "2", "train.py"], "--"),
        (vec!["-n", "2"], "nothing to run"),
        (vec!["-n", "2", "--resume", "--", "true"], "--resume"),
        (vec!["-n", "2", "job.toml", "--", "true"], "not both"),
    ] {
        let (out, _) = run(&m, &args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} must fail");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn a_killed_launcher_takes_its_ranks_and_their_children_with_it() {
    let m = marker();
    // `sh` forks `sleep` here: the rank's child, which the death signal alone
    // would leave running.
    let mut child = run_cmd(&m, &["-n", "2", "--", "sh", "-c", "echo ready; sleep 60; :"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start shoal run");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut ready = 0;
    while ready < 2 {
        let line = lines.next().expect("every rank says ready").expect("line");
        ready += usize::from(line.ends_with("] ready"));
    }
    std::thread::sleep(Duration::from_millis(200));
    child.kill().expect("SIGKILL shoal run");
    let _ = child.wait();
    assert_nothing_left(&m);
}
