//! `shoal run --nnodes` across real hosts (network namespaces with their own addresses and hostnames, see
//! `hosts.rs`): 4 ranks on 2 hosts train to the parameters of one worker, and a link cut mid-run ends the job on
//! both hosts with an error that names the ranks that could not be reached.

use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use crate::hosts::Hosts;

const SECRET: &str = "0123456789abcdef0123456789abcdef";

fn shoal() -> &'static str {
    env!("CARGO_BIN_EXE_shoal")
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-multihost-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A small MLP job on the digits, checkpointed at its end.
fn job(dir: &Path, steps: usize) -> PathBuf {
    let p = dir.join("job.toml");
    let text = format!(
        "name = \"two-hosts\"\n[train]\ndataset = \"digits\"\nglobal_batch = 64\nsteps = {steps}\nseed = 3\n\
         optimizer = \"adamw\"\nlr = 3e-3\nwarmup_steps = 5\nlog_every = 1\n[train.model]\nkind = \"mlp\"\n\
         hidden = [32, 16]\n[checkpoint]\nevery = {steps}\nkeep = 1\n"
    );
    std::fs::write(&p, text).expect("job file");
    p
}

/// Starts `shoal run` as node `rank` of 2 on `hosts`.
fn node(hosts: &Hosts, rank: usize, out: &Path, job: &Path, extra_env: &[(&str, &str)]) -> Child {
    let rdzv = format!("{}:29411", hosts.addr(0));
    let mut c = hosts.command(rank, shoal());
    c.args(["run", "--nnodes", "2", "--node-rank", &rank.to_string(), "--rdzv", &rdzv, "-n", "2", "--json"])
        .arg("--output")
        .arg(out)
        .arg(job)
        .env("SHOAL_JOB_SECRET", SECRET)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra_env {
        c.env(k, v);
    }
    c.spawn().expect("start shoal run in a host")
}

/// Waits for `child` at most `limit`; kills it past that and fails naming `what`.
fn wait(mut child: Child, limit: Duration, what: &str) -> Output {
    let t0 = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().expect("output"),
            Ok(None) if t0.elapsed() < limit => std::thread::sleep(Duration::from_millis(100)),
            _ => {
                let _ = child.kill();
                let out = child.wait_with_output().expect("output");
                panic!(
                    "{what} did not end within {limit:?}:\n{}\n{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
}

/// The newest checkpoint's model tensors under `out`.
fn params(out: &Path) -> Vec<(String, Vec<f32>)> {
    let dir = shoal_train::checkpoint::CheckpointDir::new(out);
    let loaded = dir.latest_valid().expect("read checkpoints").unwrap_or_else(|| panic!("no checkpoint in {out:?}"));
    loaded.model.into_iter().map(|t| (t.name, t.data)).collect()
}

/// Whether `errors` name one of `ranks`: `rank R`, or R in a `missing [..]` list.
fn names_any(errors: &str, ranks: &[usize]) -> bool {
    let missing = errors.split("missing [").skip(1).filter_map(|s| s.split(']').next());
    let listed: Vec<usize> = missing.flat_map(|l| l.split(", ").filter_map(|n| n.trim().parse().ok())).collect();
    ranks.iter().any(|r| {
        listed.contains(r) || errors.contains(&format!("rank {r} ")) || errors.contains(&format!("rank {r}\n"))
    })
}

#[test]
fn four_ranks_on_two_hosts_train_to_the_parameters_of_one_worker() {
    let dir = tmpdir("equal");
    let job = job(&dir, 30);
    let single = dir.join("single");
    let out = std::process::Command::new(shoal())
        .args(["run", "-n", "1", "--json", "--output"])
        .arg(&single)
        .arg(&job)
        .output()
        .expect("run one worker");
    assert!(out.status.success(), "one worker failed: {}", String::from_utf8_lossy(&out.stderr));

    let hosts = Hosts::new(2, None);
    let (out0, out1) = (dir.join("node0"), dir.join("node1"));
    let n1 = node(&hosts, 1, &out1, &job, &[]);
    let n0 = node(&hosts, 0, &out0, &job, &[]);
    let r0 = wait(n0, Duration::from_secs(300), "node 0");
    let r1 = wait(n1, Duration::from_secs(60), "node 1");
    for (i, r) in [&r0, &r1].into_iter().enumerate() {
        assert!(
            r.status.success(),
            "node {i} failed ({}):\n{}\n{}",
            r.status,
            String::from_utf8_lossy(&r.stdout),
            String::from_utf8_lossy(&r.stderr)
        );
    }
    let summary: serde_json::Value = serde_json::from_slice(&r0.stdout).expect("node 0 prints the summary");
    assert_eq!(summary["world_size"], 4, "{summary}");
    let report: serde_json::Value = serde_json::from_slice(&r1.stdout).expect("node 1 prints its report");
    assert_eq!(report["ranks"], serde_json::json!([2, 3]), "{report}");
    // Ranks 2 and 3 ran on the second host: their per-rank metrics are there, one line per step.
    let m2 = std::fs::read_to_string(out1.join("metrics.rank-2.jsonl")).expect("rank 2's metrics on node 1");
    assert_eq!(m2.lines().count(), 30, "rank 2's metrics:\n{m2}");
    eprintln!("node 0: {}", String::from_utf8_lossy(&r0.stderr).lines().take(3).collect::<Vec<_>>().join("\n"));

    let (one, four) = (params(&single), params(&out0));
    assert_eq!(one.len(), four.len());
    for ((na, a), (nb, b)) in one.iter().zip(&four) {
        assert_eq!(na, nb);
        let max_a = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let max_d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        let rel = max_d / max_a.max(f32::MIN_POSITIVE);
        assert!(rel <= 1e-5, "parameter {na}: 4 ranks on 2 hosts differ from 1 worker by {rel:e} relative");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cut_link_ends_the_job_on_both_hosts_naming_the_unreachable_ranks() {
    let dir = tmpdir("cut");
    let job = job(&dir, 100_000);
    let hosts = Hosts::new(2, None);
    let (out0, out1) = (dir.join("node0"), dir.join("node1"));
    let timeout = [("SHOAL_TIMEOUT", "5s")];
    let n1 = node(&hosts, 1, &out1, &job, &timeout);
    let n0 = node(&hosts, 0, &out0, &job, &timeout);
    // Training across the link: rank 0 has logged some steps.
    let t0 = Instant::now();
    let metrics = out0.join("metrics.jsonl");
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 5 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no training steps within 120 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    hosts.cut(1);
    let cut_at = Instant::now();
    let r0 = wait(n0, Duration::from_secs(90), "node 0 after the cut");
    let r1 = wait(n1, Duration::from_secs(90), "node 1 after the cut");
    let took = cut_at.elapsed();
    for (i, r) in [&r0, &r1].into_iter().enumerate() {
        assert!(!r.status.success(), "node {i} succeeded although its link was cut");
    }
    // The errors, without the progress lines before them.
    let errors = |b: &[u8]| -> String {
        String::from_utf8_lossy(b).lines().filter(|l| !l.contains("] step ")).collect::<Vec<_>>().join("\n")
    };
    let err0 = errors(&r0.stderr);
    // Each host's ranks name ranks of the other host: as the rank they waited for, or among those missing.
    assert!(names_any(&err0, &[2, 3]), "node 0's errors name neither rank 2 nor rank 3 (on the cut host):\n{err0}");
    let err1 = errors(&r1.stderr);
    assert!(names_any(&err1, &[0, 1]), "node 1's errors name neither rank 0 nor rank 1 (beyond the cut):\n{err1}");
    eprintln!("both hosts ended {:.1} s after the cut\nnode 0:\n{err0}\nnode 1:\n{err1}", took.as_secs_f64());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_launch_over_several_hosts_names_what_it_lacks_before_anything_starts() {
    let run = |args: &[&str], secret: Option<&str>| {
        let mut c = std::process::Command::new(shoal());
        c.args(["run"]).args(args).args(["-n", "1", "--", "true"]).env_remove("SHOAL_JOB_SECRET");
        if let Some(s) = secret {
            c.env("SHOAL_JOB_SECRET", s);
        }
        let out = c.output().expect("shoal run");
        assert!(!out.status.success(), "shoal run {args:?} started although it lacks something");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(run(&["--nnodes", "2", "--rdzv", "127.0.0.1:29999"], Some(SECRET)).contains("--node-rank"));
    assert!(
        run(&["--nnodes", "2", "--node-rank", "2", "--rdzv", "127.0.0.1:29999"], Some(SECRET))
            .contains("not below --nnodes 2")
    );
    assert!(run(&["--nnodes", "2", "--node-rank", "1"], Some(SECRET)).contains("--rdzv"));
    assert!(
        run(&["--nnodes", "2", "--node-rank", "1", "--rdzv", "127.0.0.1:29999"], None).contains("SHOAL_JOB_SECRET")
    );
    assert!(run(&["--nnodes", "2", "--node-rank", "1", "--rdzv", "127.0.0.1"], Some(SECRET)).contains("HOST:PORT"));
    assert!(run(&["--node-rank", "1"], Some(SECRET)).contains("--nnodes"));
}

#[test]
fn a_rank_failing_on_one_host_stops_the_other_host_naming_it() {
    // Two launchers on loopback (the report between them goes through the rendezvous store either way): rank 2,
    // on node 1, exits 3 after a second; every other rank would sleep a minute.
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("port");
    let rdzv = format!("127.0.0.1:{port}");
    let script = "if [ \"$RANK\" = 2 ]; then sleep 1; exit 3; fi; sleep 60";
    let start = |node: &str| {
        std::process::Command::new(shoal())
            .args(["run", "--nnodes", "2", "--node-rank", node, "--rdzv", &rdzv, "-n", "2", "--timeout-grace", "2s"])
            .args(["--", "sh", "-c", script])
            .env("SHOAL_JOB_SECRET", SECRET)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start shoal run")
    };
    let (n0, n1) = (start("0"), start("1"));
    let r1 = wait(n1, Duration::from_secs(60), "node 1");
    let r0 = wait(n0, Duration::from_secs(60), "node 0 after node 1's rank failed");
    assert_eq!(r1.status.code(), Some(3), "node 1: {}", String::from_utf8_lossy(&r1.stderr));
    let err0 = String::from_utf8_lossy(&r0.stderr);
    assert!(!r0.status.success(), "node 0 succeeded although rank 2 failed");
    assert!(err0.contains("rank 2 on node 1 ended: exit status 3"), "node 0 does not name the failed rank: {err0}");
}
