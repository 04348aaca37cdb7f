//! `shoal bench` with `--check` across processes, and a rank killed in the
//! middle of an all-reduce.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

fn run_json(args: &[&str]) -> Vec<serde_json::Value> {
    let out = shoal().args(args).arg("--json").output().expect("run shoal bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "shoal {args:?} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}"))).collect()
}

fn check_rows(rows: &[serde_json::Value], op: &str, ranks: u64, sizes: usize) {
    assert_eq!(rows.len(), sizes, "one row per size: {rows:?}");
    for row in rows {
        for k in ["op", "ranks", "transport", "algo", "dtype", "bytes", "time_s", "algbw_GBps", "busbw_GBps", "wrong"] {
            assert!(row.get(k).is_some(), "key {k} missing in {row}");
        }
        assert_eq!(row["op"], op);
        assert_eq!(row["ranks"], ranks);
        assert_eq!(row["wrong"], 0, "wrong values in {row}");
        assert!(row["time_s"].as_f64().is_some_and(|t| t >= 0.0));
    }
}

#[test]
fn every_collective_is_correct_across_four_processes_over_tcp_and_shm() {
    for transport in ["tcp", "shm"] {
        for op in ["allreduce", "broadcast", "allgather", "reducescatter"] {
            let rows = run_json(&[
                "bench",
                op,
                "--ranks",
                "4",
                "--transport",
                transport,
                "--sizes",
                "0B,4B,4100B,3MiB",
                "--iters",
                "3",
                "--warmup",
                "1",
                "--check",
            ]);
            check_rows(&rows, op, 4, 4);
            assert!(rows.iter().all(|r| r["transport"] == transport));
        }
    }
}

#[test]
fn every_dtype_and_reduction_is_correct_with_three_processes() {
    for (dtype, redop, algo) in [
        ("bf16", "max", "ring"),
        ("f16", "avg", "tree"),
        ("i64", "prod", "ring"),
        ("f64", "min", "auto"),
        ("i32", "sum", "tree"),
    ] {
        let rows = run_json(&[
            "bench",
            "allreduce",
            "--ranks",
            "3",
            "--transport",
            "auto",
            "--algo",
            algo,
            "--dtype",
            dtype,
            "--op",
            redop,
            "--sizes",
            "6B,1000002B",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--check",
        ]);
        check_rows(&rows, "allreduce", 3, 2);
        assert!(rows.iter().all(|r| r["dtype"] == dtype));
    }
}

#[test]
fn the_table_reports_zero_wrong_values() {
    let out = shoal()
        .args([
            "bench",
            "allreduce",
            "--ranks",
            "2",
            "--transport",
            "shm",
            "--sizes",
            "4KiB,1MiB",
            "--iters",
            "5",
            "--check",
        ])
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("busbw(GB/s)") && text.contains("#wrong"), "{text}");
    assert!(text.contains("2 sizes, 0 wrong values"), "{text}");
}

#[test]
fn bad_flags_are_named() {
    for (args, needle) in [
        (vec!["bench", "allreduce", "--sizes", "4XB"], "4XB"),
        (vec!["bench", "allreduce", "--dtype", "u8"], "u8"),
        (vec!["bench", "allreduce", "--transport", "carrier-pigeon"], "carrier-pigeon"),
        (vec!["bench", "allreduce", "--timeout", "soon"], "soon"),
        (vec!["bench", "compress", "--sizes", "2B"], "--sizes"),
        (vec!["bench", "compress", "--dtype", "f64"], "--dtype"),
        (vec!["bench", "compress", "--op", "max"], "--op"),
        (vec!["bench", "compress", "--ranks", "1"], "--ranks"),
        (vec!["bench", "compress", "--transport", "carrier-pigeon"], "--transport"),
        (vec!["bench", "compress", "--timeout", "soon"], "--timeout"),
    ] {
        let out = shoal().args(&args).output().expect("run");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn compress_reports_every_codec_and_each_sends_less_than_a_plain_all_reduce() {
    let rows = run_json(&["bench", "compress", "--sizes", "256KiB", "--ranks", "2", "--iters", "3", "--warmup", "1"]);
    let codecs = ["none", "fp16", "bf16", "int8", "topk", "randk", "sign", "powersgd"];
    assert_eq!(rows.len(), codecs.len(), "one row per codec: {rows:?}");
    for codec in codecs {
        let row = rows.iter().find(|r| r["codec"] == codec).unwrap_or_else(|| panic!("no row for {codec}: {rows:?}"));
        for k in [
            "codec",
            "bytes",
            "ranks",
            "encode_gbps",
            "decode_gbps",
            "codec_gbps",
            "sent_bytes",
            "plain_bytes",
            "reduction",
            "time_s",
            "plain_time_s",
            "speedup",
        ] {
            assert!(row.get(k).is_some(), "key {k} missing in {row}");
        }
        assert_eq!(row["bytes"], 256 * 1024, "{row}");
        assert_eq!(row["ranks"], 2, "{row}");
        let sent = row["sent_bytes"].as_u64().expect("sent_bytes is a count");
        let plain = row["plain_bytes"].as_u64().expect("plain_bytes is a count");
        let reduction = row["reduction"].as_f64().expect("reduction is a number");
        assert!(plain >= 256 * 1024, "a plain all-reduce of 256 KiB over 2 ranks sends all of it: {row}");
        assert!(row["time_s"].as_f64().is_some_and(|t| t > 0.0), "{row}");
        assert!(row["plain_time_s"].as_f64().is_some_and(|t| t > 0.0), "{row}");
        if codec == "none" {
            assert_eq!(sent, plain, "{row}");
            assert!(row["codec_gbps"].is_null(), "no codec, no speed: {row}");
        } else {
            assert!(sent < plain, "{codec} must send less than a plain all-reduce: {row}");
            assert!(row["codec_gbps"].as_f64().is_some_and(|g| g > 0.0), "{row}");
        }
        let least = match codec {
            "int8" => 3.9,
            "topk" => 20.0,
            _ => 0.0,
        };
        assert!(reduction >= least, "{codec}: {reduction}× fewer bytes, expected at least {least}×: {row}");
    }
}

/// Children of `parent` whose environment says `SHOAL_RANK=rank`.
fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let ppid =
            stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)).and_then(|p| p.parse::<u32>().ok());
        if ppid != Some(parent) {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if env.split(|b| *b == 0).any(|kv| kv == format!("SHOAL_RANK={rank}").as_bytes()) {
            return Some(pid);
        }
    }
    None
}

fn killed_rank_is_named(transport: &str) {
    let timeout_s = 10;
    let child = shoal()
        .args([
            "bench",
            "allreduce",
            "--ranks",
            "3",
            "--transport",
            transport,
            "--sizes",
            "32MiB",
            "--iters",
            "100000",
            "--warmup",
            "1",
            "--timeout",
            &format!("{timeout_s}s"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start bench");
    let parent = child.id();
    let deadline = Instant::now() + Duration::from_secs(30);
    let victim = loop {
        if let Some(p) = rank_pid(parent, 1) {
            break p;
        }
        assert!(Instant::now() < deadline, "rank 1 never started");
        std::thread::sleep(Duration::from_millis(50));
    };
    // Let the ranks get into the timed loop, then kill rank 1 mid all-reduce.
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: kill(2) on a process we started (indirectly).
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let killed_at = Instant::now();
    let out = child.wait_with_output().expect("bench output");
    let waited = killed_at.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "bench must fail when a rank dies:\n{err}");
    assert!(err.contains("rank 1 failed first (killed by signal 9"), "the launcher must name rank 1:\n{err}");
    for survivor in [0, 2] {
        let line = err
            .lines()
            .find(|l| l.starts_with(&format!("[rank {survivor}] error:")))
            .unwrap_or_else(|| panic!("rank {survivor} must report its failed collective:\n{err}"));
        // The kill lands in the timed all-reduce or in the barrier before it.
        assert!(
            line.contains("all_reduce #") || line.contains("barrier #"),
            "rank {survivor} must name the operation: {line}"
        );
        // Either as the lost peer, or among the missing when the survivor first
        // saw the other survivor leave (it left because rank 1 died).
        let missing = line.split("missing [").nth(1).and_then(|r| r.split(']').next()).unwrap_or("");
        assert!(
            line.contains("peer rank 1 ") || missing.split(", ").any(|r| r == "1"),
            "rank {survivor} must name rank 1: {line}"
        );
    }
    assert!(waited < Duration::from_secs(timeout_s + 10), "took {waited:?}");
}

#[test]
fn a_killed_rank_is_named_by_the_launcher_and_the_survivors_over_tcp() {
    killed_rank_is_named("tcp");
}

#[test]
fn a_killed_rank_is_named_by_the_launcher_and_the_survivors_over_shm() {
    killed_rank_is_named("shm");
}

#[test]
fn datasets_are_listed_as_json_objects_with_name_and_kind() {
    let out = shoal().args(["datasets", "--json"]).output().expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let list = v.as_array().expect("an array");
    let kinds: Vec<(&str, &str)> =
        list.iter().map(|d| (d["name"].as_str().unwrap_or(""), d["kind"].as_str().unwrap_or(""))).collect();
    for want in [("digits", "image"), ("cicero", "text"), ("synthetic", "synthetic")] {
        assert!(kinds.contains(&want), "{want:?} missing from {kinds:?}");
    }
}

#[test]
fn checkpoint_bench_reports_save_and_disk_speeds_and_cleans_up() {
    let dir = std::env::temp_dir().join(format!("shoal-it-bench-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let dir_s = dir.to_string_lossy().to_string();
    let rows = run_json(&["bench", "checkpoint", "--params", "2M", "--rounds", "2", "--dir", &dir_s]);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!(r["kind"], "checkpoint");
    assert_eq!(r["params"], 2_000_000);
    assert_eq!(r["bytes"], 24_000_000);
    for k in ["disk_buffered_mb_per_s", "disk_direct_mb_per_s", "save_mb_per_s", "ratio"] {
        assert!(r[k].as_f64().is_some_and(|v| v.is_finite() && v > 0.0), "{k} in {r}");
    }
    // The ratio is the save against the faster probe.
    let disk =
        r["disk_buffered_mb_per_s"].as_f64().unwrap_or(0.0).max(r["disk_direct_mb_per_s"].as_f64().unwrap_or(0.0));
    let ratio = r["save_mb_per_s"].as_f64().unwrap_or(0.0) / disk;
    assert!((ratio - r["ratio"].as_f64().unwrap_or(0.0)).abs() < 1e-9, "{r}");
    // Nothing is left behind in the directory it wrote to.
    let left: Vec<_> = std::fs::read_dir(&dir).expect("read scratch").collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);

    let out = shoal().args(["bench", "checkpoint", "--params", "lots"]).output().expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--params"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn the_recommender_learns_through_server_processes_pushing_only_the_rows_it_touched() {
    for mode in ["sync", "async"] {
        let rows = run_json(&["bench", "recommender", "--users", "100K", "--steps", "400", "--mode", mode]);
        let f = &rows[0];
        let num = |k: &str| f[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {f}"));
        assert_eq!(
            (f["users"].as_u64(), f["items"].as_u64(), f["mode"].as_str()),
            (Some(100_000), Some(10_000), Some(mode))
        );
        assert!(num("loss_last") < num("loss_first") - 0.02, "{f}");
        assert!(num("auc") > 0.75 && num("auc_gap") < 0.06, "{f}");
        // The rows pushed, with their spans, against the rows touched; and the whole push against a dense one.
        assert!(num("rows_ratio") > 1.0 && num("rows_ratio") < 1.3, "{f}");
        assert!(num("dense_ratio") < 0.01, "{f}");
        assert!(num("samples_per_s") > 0.0, "{f}");
    }
}

#[test]
fn a3c_actors_as_processes_solve_cartpole() {
    let rows = run_json(&["bench", "a3c", "--actors", "1,2", "--repeats", "1", "--seconds", "20"]);
    let doc = &rows[0];
    let runs = doc["runs"].as_array().cloned().unwrap_or_default();
    assert_eq!(runs.len(), 2, "{doc}");
    for run in &runs {
        // Solved: a mean of 195 over 100 episodes needs at least 100 of them.
        assert_eq!(run["solved"], true, "{doc}");
        assert!(run["episodes"].as_u64().is_some_and(|e| e >= 100), "{doc}");
        assert!(run["seconds"].as_f64().is_some_and(|s| s > 0.0 && s < 120.0), "{doc}");
    }
    assert!(doc["speedup"].as_f64().is_some_and(|s| s > 0.0), "{doc}");
}
