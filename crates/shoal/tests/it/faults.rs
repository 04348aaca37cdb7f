//! Faults end to end, with real processes: a worker killed with `kill -9` (policy `restart`: the gang starts again
//! after its backoff from the newest checkpoint and the job succeeds; policy `none`: the job fails with the
//! reason), a worker stopped with SIGSTOP (a hang: dumped within `hang_timeout` + 5 s naming the stopped rank, then
//! recovered), a server killed with `kill -9` while a restart waits out its backoff, `shoal chaos` killing workers
//! while the job still succeeds, and `shoal chaos --stop` hanging one that is found and recovered.
//!
//! Each job slows its data source (`SHOAL_FAULT_DATA_DELAY`, a test hook of the `failpoints` build) so that it is
//! certainly still training when the test acts on it, however fast the machine.

use serde_json::Value;

use crate::platform::{Platform, alive, events, text};

/// Two workers training an MLP on the digits, at least 5 ms a step, checkpoints every 50 steps.
fn job(name: &str, steps: usize, fault_tolerance: &str) -> String {
    format!(
        r#"
name = "{name}"
[workers]
count = 2
[resources]
cpus = 1
memory = "1GiB"
[fault_tolerance]
{fault_tolerance}
[env]
SHOAL_FAULT_DATA_DELAY = "5ms"
[train]
dataset = "digits"
global_batch = 64
steps = {steps}
lr = 3e-3
log_every = 100
[train.model]
kind = "mlp"
hidden = [64]
[checkpoint]
every = 50
keep = 2
"#
    )
}

/// The training process of `rank` (what a user would `kill -9`).
pub(crate) fn worker_pid(v: &Value, rank: i64) -> i64 {
    v["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["rank"] == rank))
        .and_then(|w| w["pid"].as_i64())
        .unwrap_or_else(|| panic!("no training process for rank {rank}: {v}"))
}

/// Waits until `id` runs attempt `attempt` past step `step`.
pub(crate) fn training(p: &Platform, id: &str, attempt: i64, step: i64) -> Value {
    p.wait_state_where(id, &format!("attempt {attempt} past step {step}"), |v| {
        v["state"] == "running"
            && v["attempt"] == attempt
            && v["last_metrics"]["step"].as_i64().is_some_and(|s| s > step)
            && v["workers"].as_array().is_some_and(|ws| ws.iter().all(|w| w["pid"].as_i64().is_some_and(alive)))
    })
}

pub(crate) fn kill(pid: i64, sig: i32) {
    // SAFETY: plain syscall on a process this test's server started.
    let r = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(r, 0, "signal {sig} to {pid}: {}", std::io::Error::last_os_error());
}

/// Rank `rank` of `id`'s running attempt as the server last heard from it (`GET /api/v1/jobs/{id}/debug`): the
/// dump's attempt, and the rank's phase and step; `None` while the job is not running.
fn heard(p: &Platform, id: &str, rank: i64) -> Option<(i64, String, u64)> {
    let r = p.request("GET", &format!("/api/v1/jobs/{id}/debug"), Some(p.token()), None);
    if r.status != 200 {
        return None;
    }
    let d = r.json();
    let r = d["ranks"].as_array()?.iter().find(|x| x["rank"] == rank)?.clone();
    Some((d["attempt"].as_i64()?, r["phase"].as_str()?.to_owned(), r["step"].as_u64()?))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as i64
}

fn event_time(v: &Value, kind: &str, nth: usize) -> i64 {
    let ev: Vec<&Value> = v["events"].as_array().expect("events").iter().filter(|e| e["kind"] == kind).collect();
    ev.get(nth).and_then(|e| e["time_ms"].as_i64()).unwrap_or_else(|| panic!("no {kind} event #{nth}: {ev:?}"))
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn kill_9_of_a_worker_restarts_the_gang_after_its_backoff_and_the_job_succeeds() {
    let p = Platform::new("faults-kill");
    let id = p.submit("kill9", &job("kill9", 600, "policy = \"restart\"\nmax_restarts = 2\nbackoff = \"2s\""));
    let v = training(&p, &id, 1, 120);
    let t0 = now_ms();
    kill(worker_pid(&v, 1), libc::SIGKILL);
    // The first step attempt 2 completes after the checkpoint it resumed from, as its rank 0's heartbeat tells it.
    let stepped = p.wait("a step of attempt 2", || {
        let (attempt, phase, step) = heard(&p, &id, 0)?;
        (attempt == 2 && phase == "train" && step % 50 != 0).then(now_ms)
    });
    let v = p.wait_state(&id, "succeeded");
    assert_eq!((v["restarts"].as_i64(), v["attempt"].as_i64()), (Some(1), Some(2)), "{v}");
    let ev = events(&v);
    let restarted: Vec<_> = ev.iter().filter(|e| e.1 == "restarted").collect();
    assert_eq!(restarted.len(), 1, "{ev:?}");
    let why = &restarted[0].2;
    assert!(
        why.contains("rank 1 exited with status 137 (killed: SIGKILL)")
            && why.contains("restart 1 of 2")
            && why.contains("after a backoff of 2s")
            && why.contains("newest checkpoint"),
        "{why}"
    );
    // Attempt 2 started only once the backoff was over.
    let waited = event_time(&v, "started", 1) - event_time(&v, "restarted", 0);
    let (restarted_at, started_at) = (event_time(&v, "restarted", 0), event_time(&v, "started", 1));
    eprintln!(
        "recovery from kill -9, restart from storage: {} ms to the restart decided (detection and every process \
         gone), {waited} ms backoff (2 s) and placement to attempt 2 started, {} ms from the start to its first step \
         (rendezvous, checkpoint load, step); {} ms in all",
        restarted_at - t0,
        stepped - started_at,
        stepped - t0
    );
    assert!(waited >= 2000, "attempt 2 started {waited} ms after the restart, within its 2 s backoff: {ev:?}");
    // It resumed from a checkpoint of attempt 1 and finished every step.
    let sum = &v["summary"];
    assert_eq!(sum["steps"], 600, "{sum}");
    assert!(sum["resumed_from"].as_i64().is_some_and(|s| s >= 100 && s % 50 == 0), "{sum}");
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn heartbeats_and_a_collectives_report_reach_the_server_over_http() {
    let p = Platform::new("faults-wire");
    // Collectives give up after 3 s; heartbeats and hangs are judged far later, so what ends the job is rank 0's
    // own report of the collective rank 1 never joined.
    let spec = job("wired", 100_000, "policy = \"none\"\nheartbeat_timeout = \"60s\"\nhang_timeout = \"60s\"")
        .replace("[env]\n", "[env]\nSHOAL_TIMEOUT = \"3s\"\n");
    let id = p.submit("wired", &spec);
    let v = training(&p, &id, 1, 20);
    // Both ranks are heard over HTTP: the server knows their phase and step, and no heartbeat file was needed.
    let (attempt, phase, step) = p.wait("rank 1 heard training", || heard(&p, &id, 1).filter(|h| h.1 == "train"));
    assert_eq!((attempt, phase.as_str()), (1, "train"));
    assert!(step > 0, "rank 1 heard at step {step}");
    let run = p.job_dir(&id).join("run");
    for rank in 0..2 {
        let file = run.join(format!("heartbeat.rank-{rank}.json"));
        assert!(!file.exists(), "{} was written: the heartbeats did not reach the server", file.display());
    }
    // A heartbeat whose tag does not verify under the job's secret is refused.
    let forged = br#"{"rank":0,"attempt":1,"pid":1,"beat":1,"time_ms":0,"phase":"train","step":0,"op":"","seq":0,"in_op":false,"op_s":0.0,"ops_done":0}"#;
    let path = format!("/api/v1/jobs/{id}/heartbeat");
    let r = p.request("POST", &path, None, Some(("application/json", forged)));
    assert_eq!(r.status, 401, "{}", text(&r.body));

    // Rank 1 stopped: rank 0's all-reduce gives up, and its report names the operation and the missing rank.
    kill(worker_pid(&v, 1), libc::SIGSTOP);
    let v = p.wait_state(&id, "failed");
    let ev = events(&v);
    let report = ev.iter().find(|e| e.1 == "rank_report").unwrap_or_else(|| panic!("no rank_report: {ev:?}"));
    assert!(
        report.2.contains("rank 0 of attempt 1 reports") && report.2.contains("timed out") && report.2.contains('#'),
        "{report:?}"
    );
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn policy_none_fails_the_job_with_the_reason() {
    let p = Platform::new("faults-none");
    let id = p.submit("fragile", &job("fragile", 100_000, "policy = \"none\""));
    let v = training(&p, &id, 1, 20);
    kill(worker_pid(&v, 0), libc::SIGKILL);
    let v = p.wait_state(&id, "failed");
    let reason = v["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("rank 0 exited with status 137") && reason.contains("fault_tolerance.policy = \"none\""),
        "{reason}"
    );
    assert_eq!((v["restarts"].as_i64(), v["attempt"].as_i64()), (Some(0), Some(1)), "{v}");
    assert!(!events(&v).iter().any(|e| e.1 == "restarted"), "{:?}", events(&v));
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn a_stopped_worker_is_a_hang_dumped_naming_it_and_recovered() {
    let p = Platform::new("faults-hang");
    let spec =
        job("stuck", 800, "max_restarts = 2\nbackoff = \"0s\"\nhang_timeout = \"3s\"\nheartbeat_timeout = \"60s\"");
    let id = p.submit("stuck", &spec);
    let v = training(&p, &id, 1, 60);
    // On demand, while it trains: every rank, where it stands.
    let d = p.cli_json(&["debug", &id, "--json"]);
    let ranks = d["ranks"].as_array().unwrap_or_else(|| panic!("{d}"));
    assert_eq!(ranks.len(), 2, "{d}");
    for r in ranks {
        assert!(r["state"] == "in_collective" || r["state"] == "computing", "{d}");
        assert_eq!(r["phase"], "train", "{d}");
        assert!(r["op"].as_str().is_some_and(|o| !o.is_empty()) && r["seq"].as_u64().is_some_and(|s| s > 0), "{d}");
    }
    let out = p.cli(p.token(), &["debug", &id]);
    assert!(out.status.success() && text(&out.stdout).contains("RANK"), "{}", text(&out.stdout));

    let stopped = worker_pid(&v, 1);
    let t0 = now_ms();
    kill(stopped, libc::SIGSTOP);
    let v = p.wait_state_where(&id, "a hang event", |v| events(v).iter().any(|e| e.1 == "hang"));
    let found = event_time(&v, "hang", 0) - t0;
    eprintln!("SIGSTOP to the hang event: {found} ms (hang_timeout 3 s)");
    assert!(found <= 8000, "the hang was found {found} ms after the SIGSTOP (hang_timeout 3 s + 5 s)");
    assert!(found >= 3000, "a hang reported {found} ms after the SIGSTOP, before hang_timeout");
    let ev = events(&v);
    let hang = &ev.iter().find(|e| e.1 == "hang").expect("hang").2;
    assert!(hang.contains("no step completed") && hang.contains("hang_timeout = 3s"), "{hang}");
    assert!(hang.contains("rank 0 waits in") && hang.contains("not in it: rank 1: no heartbeat"), "{hang}");
    let dump = &v["hang_dump"];
    assert_eq!(dump["culprits"], serde_json::json!([1]), "{dump}");
    assert_eq!(dump["ranks"][1]["state"], "silent", "{dump}");
    assert_eq!(dump["ranks"][1]["pid"].as_i64(), Some(stopped), "{dump}");
    assert_eq!(dump["ranks"][0]["state"], "in_collective", "{dump}");
    assert_eq!(dump["ranks"][0]["in_op"], true, "{dump}");
    assert!(dump["ranks"][0]["op_s"].as_f64().is_some_and(|s| s >= 2.0), "{dump}");

    // Recovered: the stopped process is gone, attempt 2 trains to the end.
    let v = p.wait_state(&id, "succeeded");
    assert!(!alive(stopped), "the stopped worker {stopped} outlived its job");
    assert_eq!((v["restarts"].as_i64(), v["attempt"].as_i64()), (Some(1), Some(2)), "{v}");
    let restarted: Vec<_> = events(&v).into_iter().filter(|e| e.1 == "restarted").collect();
    assert!(restarted.len() == 1 && restarted[0].2.contains("hang:"), "{restarted:?}");
    assert_eq!(v["summary"]["steps"], 800, "{}", v["summary"]);
    assert_eq!(v["hang_dump"]["culprits"], serde_json::json!([1]), "the last hang's dump stays: {v}");
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn chaos_kills_workers_and_the_job_still_succeeds() {
    let p = Platform::new("faults-chaos");
    let id = p.submit("chaotic", &job("chaotic", 1500, "max_restarts = 10\nbackoff = \"0s\""));
    training(&p, &id, 1, 20);
    let out = p.cli(p.token(), &["chaos", &id, "--kill-every", "3s", "--for", "7s", "--seed", "7", "--json"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "shoal chaos failed: {}\n{stdout}", text(&out.stderr));
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect();
    let faults: Vec<&Value> = lines.iter().filter(|l| l["action"] == "kill" && l["rank"].is_i64()).collect();
    assert!(!faults.is_empty(), "no worker was killed: {stdout}");
    for f in &faults {
        assert!(f["message"].as_str().is_some_and(|m| m.contains("SIGKILL to pid")), "{f}");
        assert!(f["elapsed_s"].as_f64().is_some_and(|s| s >= 3.0), "{f}");
    }
    let done = lines.last().expect("lines");
    assert_eq!(done["done"], true, "{stdout}");
    assert_eq!(done["faults"].as_u64(), Some(faults.len() as u64), "{stdout}");

    let v = p.wait_state(&id, "succeeded");
    let ev = events(&v);
    let chaos = ev.iter().filter(|e| e.1 == "chaos").count();
    let restarts = ev.iter().filter(|e| e.1 == "restarted").count();
    assert_eq!(chaos, faults.len(), "{ev:?}");
    // Every kill ended its attempt; two kills may land on one attempt.
    assert!(restarts >= 1 && restarts <= faults.len(), "{restarts} restarts for {} kills: {ev:?}", faults.len());
    assert!(ev.iter().filter(|e| e.1 == "restarted").all(|e| e.2.contains("exited with status 137")), "{ev:?}");
    assert_eq!(v["summary"]["steps"], 1500, "{}", v["summary"]);
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn a_server_killed_during_a_restarts_backoff_still_waits_it_out() {
    let mut p = Platform::new("faults-server");
    let id = p.submit("patient", &job("patient", 400, "max_restarts = 1\nbackoff = \"6s\""));
    let v = training(&p, &id, 1, 60);
    kill(worker_pid(&v, 0), libc::SIGKILL);
    p.wait_state_where(&id, "the restart", |v| events(v).iter().any(|e| e.1 == "restarted"));
    p.kill_server();
    p.start_server(None);
    let v = p.wait_state(&id, "succeeded");
    assert_eq!((v["restarts"].as_i64(), v["attempt"].as_i64()), (Some(1), Some(2)), "{v}");
    let waited = event_time(&v, "started", 1) - event_time(&v, "restarted", 0);
    assert!(
        waited >= 6000,
        "attempt 2 started {waited} ms after the restart: the new server cut the 6 s backoff short"
    );
    assert_eq!(v["summary"]["steps"], 400, "{}", v["summary"]);
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn chaos_stop_hangs_a_worker_that_is_found_dumped_and_recovered() {
    let p = Platform::new("faults-chaos-stop");
    let spec =
        job("frozen", 600, "max_restarts = 2\nbackoff = \"0s\"\nhang_timeout = \"3s\"\nheartbeat_timeout = \"60s\"");
    let id = p.submit("frozen", &spec);
    training(&p, &id, 1, 40);
    let out =
        p.cli(p.token(), &["chaos", &id, "--kill-every", "1s", "--for", "1500ms", "--stop", "--seed", "3", "--json"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "shoal chaos --stop failed: {}\n{stdout}", text(&out.stderr));
    let stops: Vec<Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["action"] == "stop" && l["rank"].is_i64())
        .collect();
    assert_eq!(stops.len(), 1, "{stdout}");
    let (rank, pid) = (stops[0]["rank"].as_i64().expect("rank"), stops[0]["pid"].as_i64().expect("pid"));
    assert!(stops[0]["message"].as_str().is_some_and(|m| m.contains("SIGSTOP to pid")), "{stdout}");
    let v = p.wait_state_where(&id, "a hang event", |v| events(v).iter().any(|e| e.1 == "hang"));
    assert_eq!(v["hang_dump"]["culprits"], serde_json::json!([rank]), "{}", v["hang_dump"]);
    assert_eq!(v["hang_dump"]["ranks"][rank as usize]["pid"].as_i64(), Some(pid), "{}", v["hang_dump"]);
    let v = p.wait_state(&id, "succeeded");
    assert!(!alive(pid), "the stopped worker {pid} outlived its job");
    assert_eq!((v["restarts"].as_i64(), v["attempt"].as_i64()), (Some(1), Some(2)), "{v}");
    assert_eq!(v["summary"]["steps"], 600, "{}", v["summary"]);
}

/// Like [`job`], with storage checkpoints every `every` steps and in-memory copies every `memory_every`; restart
/// after 1 s.
fn memory_job(name: &str, steps: usize, every: usize, memory_every: usize) -> String {
    job(name, steps, "policy = \"restart\"\nmax_restarts = 2\nbackoff = \"1s\"").replace(
        "[checkpoint]\nevery = 50\nkeep = 2\n",
        &format!("[checkpoint]\nevery = {every}\nkeep = 2\nmemory_every = {memory_every}\n"),
    )
}

/// The in-memory copies' directory of job `id` on this host.
fn shm_dir(id: &str) -> std::path::PathBuf {
    std::path::Path::new("/dev/shm").join(format!("shoal-{id}"))
}

/// The complete in-memory copies of job `id` (step directories), each host's.
fn memory_copies(id: &str) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for host in std::fs::read_dir(shm_dir(id)).into_iter().flatten().flatten() {
        for step in std::fs::read_dir(host.path().join("checkpoints")).into_iter().flatten().flatten() {
            let name = step.file_name().to_string_lossy().into_owned();
            if name.starts_with("step-") && !name.contains(".tmp") && step.path().join("manifest.json").is_file() {
                out.push(step.path());
            }
        }
    }
    out.sort();
    out
}

/// The losses rank 0 logged, by step, bit for bit.
fn loss_bits(p: &Platform, id: &str) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(p.job_dir(id).join("run/metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| (v["step"].as_u64().expect("step"), v["loss"].as_f64().expect("loss").to_bits()))
        .collect()
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn kill_9_with_in_memory_copies_restarts_from_memory_bit_for_bit() {
    restart_from_memory_bit_for_bit("faults-memory", "ddp");
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn kill_9_with_in_memory_copies_under_zero1_restarts_from_memory_bit_for_bit() {
    // The optimizer state is sharded: the copy holds it whole, gathered by every rank.
    restart_from_memory_bit_for_bit("faults-memory-zero1", "zero1");
}

/// A job of `strategy` with in-memory copies every 10 steps and no storage checkpoint before its end, killed with
/// `kill -9` of rank 1, restarts from memory, says so, and ends bit for bit as the same job without the failure.
fn restart_from_memory_bit_for_bit(tag: &str, strategy: &str) {
    let p = Platform::new(tag);
    // Storage holds only the final checkpoint: whatever the restart resumes from before it came from memory.
    let spec = |name: &str| {
        memory_job(name, 600, 1000, 10).replace("[train]\n", &format!("[train]\nstrategy = \"{strategy}\"\n"))
    };
    // The same job without a failure, to compare with.
    let clean = p.submit("clean", &spec("clean"));
    let c = p.wait_state(&clean, "succeeded");
    assert_eq!(c["summary"]["memory_copies"].as_u64().map(|n| n > 0), Some(true), "{c}");
    assert!(!shm_dir(&clean).exists(), "a succeeded job's in-memory copies remain in {}", shm_dir(&clean).display());
    let cs = &c["summary"];
    let (copies, stall, step) = (
        cs["memory_copies"].as_f64().unwrap_or(0.0),
        cs["memory_stall_s"].as_f64().unwrap_or(0.0),
        cs["step_time"]["step_s"].as_f64().unwrap_or(0.0),
    );
    eprintln!(
        "in-memory copies: {copies} in the run without a failure, {:.3} ms of the step loop each, {:.2}% of the \
         median step ({:.2} ms)",
        1e3 * stall / copies.max(1.0),
        100.0 * stall / copies.max(1.0) / step.max(1e-9),
        step * 1e3
    );

    let id = p.submit("killed", &spec("killed"));
    let v = training(&p, &id, 1, 120);
    p.wait("an in-memory copy", || (!memory_copies(&id).is_empty()).then_some(()));
    let t0 = now_ms();
    kill(worker_pid(&v, 1), libc::SIGKILL);
    let stepped = p.wait("a step of attempt 2", || {
        let (attempt, phase, step) = heard(&p, &id, 0)?;
        (attempt == 2 && phase == "train" && step % 10 != 0).then(now_ms)
    });
    let v = p.wait_state(&id, "succeeded");
    assert_eq!((v["restarts"].as_i64(), v["attempt"].as_i64()), (Some(1), Some(2)), "{v}");
    let (restarted_at, started_at) = (event_time(&v, "restarted", 0), event_time(&v, "started", 1));
    eprintln!(
        "recovery from kill -9, restart from memory: {} ms to the restart decided (detection and every process \
         gone), {} ms backoff (1 s) and placement to attempt 2 started, {} ms from the start to its first step \
         (rendezvous, in-memory copy load, step); {} ms in all",
        restarted_at - t0,
        started_at - restarted_at,
        stepped - started_at,
        stepped - t0
    );
    // It resumed from memory, said so, and read no storage checkpoint (there was none before the end).
    let sum = &v["summary"];
    assert_eq!(sum["strategy"], strategy, "{sum}");
    let from = sum["resumed_from"].as_u64().expect("resumed_from");
    assert!(from >= 10 && from.is_multiple_of(10) && from < 600, "{sum}");
    assert_eq!(sum["resumed_from_memory"], true, "{sum}");
    let log = std::fs::read_to_string(p.job_dir(&id).join("attempt-2/rank-0.log")).expect("rank-0.log");
    assert!(log.contains(&format!("resuming from memory copy at step {from}")), "{log}");
    let resumed: Vec<_> = events(&v).into_iter().filter(|e| e.1 == "resumed").collect();
    assert_eq!(resumed.len(), 1, "{:?}", events(&v));
    assert!(resumed[0].2.contains(&format!("attempt 2 resumed from its memory copy at step {from}")), "{resumed:?}");
    // Bit for bit the run without the failure: every step's loss and the final parameters and optimizer state.
    assert_eq!(loss_bits(&p, &id), loss_bits(&p, &clean));
    assert_eq!(loss_bits(&p, &id).len(), 600);
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let read = |job: &str| std::fs::read(p.job_dir(job).join("run/checkpoints/step-000600").join(f)).expect(f);
        assert!(read(&id) == read(&clean), "{f} differs from the run without a failure");
    }
    assert_eq!(sum["final_loss"], c["summary"]["final_loss"]);
    assert!(!shm_dir(&id).exists(), "a succeeded job's in-memory copies remain in {}", shm_dir(&id).display());
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn a_corrupt_in_memory_copy_is_skipped_naming_it_and_the_restart_reads_storage() {
    let p = Platform::new("faults-memory-corrupt");
    let id = p.submit("corrupt", &memory_job("corrupt", 600, 50, 10));
    let v = training(&p, &id, 1, 120);
    p.wait("an in-memory copy", || (!memory_copies(&id).is_empty()).then_some(()));
    // Rank 0 writes its host's copies: once it is gone, none changes.
    kill(worker_pid(&v, 0), libc::SIGKILL);
    let copies = memory_copies(&id);
    assert!(!copies.is_empty());
    for c in &copies {
        let f = c.join("model.safetensors");
        let mut b = std::fs::read(&f).expect("model.safetensors of a copy");
        let last = b.len() - 1;
        b[last] ^= 0x01;
        std::fs::write(&f, b).expect("flip a byte");
    }
    let v = p.wait_state(&id, "succeeded");
    assert_eq!((v["restarts"].as_i64(), v["attempt"].as_i64()), (Some(1), Some(2)), "{v}");
    let log = std::fs::read_to_string(p.job_dir(&id).join("attempt-2/rank-0.log")).expect("rank-0.log");
    let newest = copies.last().expect("a copy").join("model.safetensors");
    assert!(
        log.contains(&format!("warning: skipped memory copy file {}", newest.display())) && log.contains("checksum"),
        "{log}"
    );
    let sum = &v["summary"];
    let from = sum["resumed_from"].as_u64().expect("resumed_from");
    assert!(from >= 50 && from.is_multiple_of(50), "{sum}");
    assert_eq!(sum["resumed_from_memory"], false, "{sum}");
    assert!(log.contains(&format!("checkpoints/step-{from:06} (step {from})")), "{log}");
    assert!(!log.contains("resuming from memory copy"), "{log}");
    let resumed: Vec<_> = events(&v).into_iter().filter(|e| e.1 == "resumed").collect();
    assert_eq!(resumed.len(), 1, "{:?}", events(&v));
    assert!(resumed[0].2.contains(&format!("from its storage checkpoint at step {from}")), "{resumed:?}");
    assert_eq!(sum["steps"], 600, "{sum}");
    assert!(!shm_dir(&id).exists(), "a succeeded job's in-memory copies remain in {}", shm_dir(&id).display());
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn a_cancelled_jobs_in_memory_copies_are_removed() {
    let p = Platform::new("faults-memory-cancel");
    let id = p.submit("cancelled", &memory_job("cancelled", 100_000, 1000, 10));
    training(&p, &id, 1, 30);
    p.wait("an in-memory copy", || (!memory_copies(&id).is_empty()).then_some(()));
    let out = p.cli(p.token(), &["cancel", &id]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    p.wait_state(&id, "cancelled");
    // Removed by the control loop as the job ends (right after the state is stored).
    p.wait("the cancelled job's in-memory copies removed", || (!shm_dir(&id).exists()).then_some(()));
}

/// A job of `min..max` workers of one CPU each, at least 5 ms a step, storage checkpoints only every 1000 steps: a
/// checkpoint at any other step is one a stop asked for.
fn elastic_job(name: &str, steps: usize, workers: &str, priority: i64) -> String {
    job(name, steps, "policy = \"elastic\"")
        .replace("[workers]\ncount = 2\n", &format!("priority = {priority}\n[workers]\n{workers}\n"))
        .replace("every = 50\n", "every = 1000\n")
}

/// The running attempt's number of workers.
fn workers_of(v: &Value) -> usize {
    v["workers"].as_array().map_or(0, Vec::len)
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn an_elastic_job_grows_into_free_capacity_and_shrinks_for_a_higher_priority_one_losing_no_step() {
    let p = Platform::with_server("faults-resize", &["--cpus", "2"], &[]);
    // A filler holds one of the two CPUs, so the elastic job starts with one worker.
    let filler = p.submit("filler", &elastic_job("filler", 1_000_000, "count = 1", 0));
    p.wait_state(&filler, "running");
    let id = p.submit("stretchy", &elastic_job("stretchy", 2500, "min = 1\nmax = 2", 0));
    let v = training(&p, &id, 1, 100);
    assert_eq!(workers_of(&v), 1, "{v}");

    // The filler goes: the job grows to two workers in place, its first worker going on as it was.
    let first = worker_pid(&v, 0);
    let r = p.request("POST", &format!("/api/v1/jobs/{filler}/cancel"), Some(p.token()), None);
    assert_eq!(r.status, 202, "{}", text(&r.body));
    let v = p.wait_state_where(&id, "running with two workers", |v| v["state"] == "running" && workers_of(v) == 2);
    assert_eq!((v["attempt"].as_i64(), worker_pid(&v, 0)), (Some(1), first), "grown in place: {v}");
    let grown_at = v["attempt"].as_i64().unwrap_or(0);
    training(&p, &id, grown_at, 0);

    // A job of higher priority needs a CPU: the elastic job shrinks back to one worker instead of stopping.
    let urgent = p.submit("urgent", &elastic_job("urgent", 300, "count = 1", 10));
    p.wait_state_where(&id, "running with one worker beside the urgent job", |v| {
        v["state"] == "running" && v["attempt"].as_i64().is_some_and(|a| a > grown_at) && workers_of(v) == 1
    });
    p.wait_state(&urgent, "succeeded");
    let v = p.wait_state(&id, "succeeded");

    let ev = events(&v);
    let said = |kind: &str, what: &str| ev.iter().any(|e| e.1 == kind && e.2.contains(what));
    assert!(said("regrouped", "grows in place from 1 to 2 workers"), "{ev:?}");
    assert!(said("elastic", "shrinks by 1 workers for job"), "{ev:?}");
    assert!(said("requeued", "shrinks by 1"), "{ev:?}");
    // No failure: a resize is not a restart.
    assert_eq!(v["restarts"].as_i64(), Some(0), "{ev:?}");
    assert!(!ev.iter().any(|e| e.1 == "restarted"), "{ev:?}");
    // Every later attempt resumed where the one before stopped: at a checkpoint a stop asked for (storage
    // checkpoints are due only every 1000 steps), so no step was lost.
    let resumed: Vec<u64> = ev
        .iter()
        .filter(|e| e.1 == "resumed")
        .filter_map(|e| e.2.rsplit("at step ").next()?.trim().parse().ok())
        .collect();
    assert!(!resumed.is_empty(), "{ev:?}");
    assert!(resumed.iter().any(|s| s % 1000 != 0), "no checkpoint at a stop: {resumed:?}");
    let sum = &v["summary"];
    assert_eq!(sum["steps"], 2500, "{sum}");
    eprintln!("elastic resizes: attempts {}, resumed at steps {resumed:?}", v["attempt"]);
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn phases_resize_the_job_at_their_boundary_and_release_what_the_next_does_not_need() {
    let p = Platform::with_server("faults-phases", &["--cpus", "2"], &[]);
    let spec = elastic_job("phased", 600, "count = 2", 0).replace(
        "[train]\n",
        "[[phases]]\nuntil_step = 250\n[[phases]]\n[phases.workers]\ncount = 1\n[phases.resources]\ncpus = 1\nmemory = \"512MiB\"\n[train]\n",
    );
    let id = p.submit("phased", &spec);
    let v = training(&p, &id, 1, 10);
    assert_eq!(workers_of(&v), 2, "{v}");
    // Phase 2 runs on one worker; the CPU phase 1 used beside it is free for another job at once.
    p.wait_state_where(&id, "phase 2 running on one worker", |v| {
        v["state"] == "running" && v["attempt"] == 2 && workers_of(v) == 1
    });
    let other = p.submit("other", &elastic_job("other", 50, "count = 1", 0));
    p.wait_state(&other, "succeeded");
    let v2 = p.wait_state(&id, "succeeded");
    let ev = events(&v2);
    let phase: Vec<_> = ev.iter().filter(|e| e.1 == "phase").collect();
    assert_eq!(phase.len(), 1, "{ev:?}");
    assert!(
        phase[0].2.contains("phase 1 of 2 ended at step 250") && phase[0].2.contains("phase 2 runs with 1 workers"),
        "{phase:?}"
    );
    assert!(ev.iter().any(|e| e.1 == "resumed" && e.2.ends_with("at step 250")), "{ev:?}");
    assert_eq!(v2["restarts"].as_i64(), Some(0), "{ev:?}");
    let sum = &v2["summary"];
    assert_eq!((sum["steps"].as_u64(), sum["resumed_from"].as_u64()), (Some(600), Some(250)), "{sum}");
    assert_eq!(sum["world_size"], 1, "{sum}");
    // The cost report shows each phase at its own size: two workers of one CPU, then one.
    let cost = p.get("/api/v1/cost");
    let job =
        cost["jobs"].as_array().and_then(|js| js.iter().find(|j| j["id"] == id.as_str())).expect("the job's cost");
    let phases: Vec<(u64, u64)> = job["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .map(|p| (p["phase"].as_u64().unwrap_or(9), p["workers"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(phases, vec![(0, 2), (1, 1)], "{job}");
    let summed: f64 = job["phases"].as_array().expect("phases").iter().filter_map(|p| p["cost"].as_f64()).sum();
    assert!((summed - job["cost"].as_f64().unwrap_or(-1.0)).abs() < 1e-9, "{job}");
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn strategy_auto_runs_the_planners_choice_and_says_why_in_the_events() {
    let p = Platform::new("auto-strategy");
    let spec = job("auto", 60, "").replace("[train]\n", "[train]\nstrategy = \"auto\"\n");
    let id = p.submit("auto", &spec);
    let v = p.wait_state(&id, "succeeded");
    let ev = events(&v);
    let chose = ev.iter().find(|e| e.1 == "strategy").unwrap_or_else(|| panic!("no strategy event: {ev:?}"));
    assert!(
        chose.2.contains(
            "attempt 1: train.strategy = \"auto\" chose ddp (data 2 × tensor 1 × pipeline 1): the whole model fits \
             each of the 2 workers"
        ),
        "{chose:?}"
    );
    assert_eq!(v["summary"]["strategy"], "ddp", "{}", v["summary"]);
    // A GPT whose activations fit no data-parallel worker in 230 MiB: the planner splits it into a pipeline, the
    // workers run one, and the event says so.
    let gpt = "name = \"auto-gpt\"\n[workers]\ncount = 2\n[resources]\ncpus = 1\nmemory = \"230MiB\"\n[train]\n\
               dataset = \"cicero\"\nglobal_batch = 16\nsteps = 3\nlr = 3e-3\nstrategy = \"auto\"\n[train.model]\n\
               kind = \"gpt\"\nlayers = 2\nheads = 4\nwidth = 64\ncontext = 256\n";
    let id = p.submit("auto-gpt", gpt);
    let v = p.wait_state(&id, "succeeded");
    let ev = events(&v);
    let chose = ev.iter().find(|e| e.1 == "strategy").unwrap_or_else(|| panic!("no strategy event: {ev:?}"));
    assert!(chose.2.contains("chose pipeline (data 1 × tensor 1 × pipeline 2;") && chose.2.contains("ddp would need"));
    assert_eq!(v["summary"]["strategy"], "pipeline", "{}", v["summary"]);
}

/// Rank 0's metrics file: each row's step, global samples and time (ms since the epoch), in the order written.
fn steps_and_samples(p: &Platform, id: &str) -> Vec<(u64, u64, u64)> {
    let text = std::fs::read_to_string(p.job_dir(id).join("run/metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| {
            (
                v["step"].as_u64().expect("step"),
                v["samples"].as_u64().expect("samples"),
                v["unix_ms"].as_u64().expect("time"),
            )
        })
        .collect()
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn elastic_kill_9_shrinks_in_place_and_grows_back_with_no_process_restarted() {
    let p = Platform::with_server("faults-inplace", &["--cpus", "3"], &[]);
    let steps = 1500;
    let id = p.submit("inplace", &elastic_job("inplace", steps, "min = 2\nmax = 3", 0));
    let v = training(&p, &id, 1, 100);
    assert_eq!(workers_of(&v), 3, "{v}");
    let (pid0, pid2) = (worker_pid(&v, 0), worker_pid(&v, 2));
    let t0 = now_ms();
    kill(worker_pid(&v, 1), libc::SIGKILL);

    // The survivors go on in place, then the freed CPU brings a newcomer into the group: one attempt throughout.
    let grown = p.wait_state_where(&id, "regrouped in place twice", |v| {
        events(v).iter().filter(|e| e.1 == "regrouped").count() >= 2 && workers_of(v) == 3
    });
    let regrouped_at = event_time(&grown, "regrouped", 0);
    assert_eq!(grown["attempt"].as_i64(), Some(1), "{grown}");
    let ranks: Vec<i64> =
        grown["workers"].as_array().expect("workers").iter().filter_map(|w| w["rank"].as_i64()).collect();
    assert_eq!(ranks, vec![0, 2, 3], "the members: the survivors and the newcomer: {grown}");
    assert_eq!((worker_pid(&grown, 0), worker_pid(&grown, 2)), (pid0, pid2), "the survivors kept their processes");
    // The group trains again: steps after the regrouping, heard from the survivor that is still rank 0.
    let before = grown["last_metrics"]["step"].as_u64().unwrap_or(0);
    let stepped = p.wait("a step after the regrouping", || {
        let (attempt, phase, step) = heard(&p, &id, 0)?;
        (attempt == 1 && phase == "train" && step > before + 1).then(now_ms)
    });

    let v = p.wait_state(&id, "succeeded");
    let ev = events(&v);
    let regrouped: Vec<&String> = ev.iter().filter(|e| e.1 == "regrouped").map(|e| &e.2).collect();
    assert!(
        regrouped[0].contains("rank 1 exited with status 137")
            && regrouped[0].contains("the 2 survivors (task 0, 2) go on in place as group 1"),
        "{regrouped:?}"
    );
    assert!(
        regrouped[1].contains("grows in place from 2 to 3 workers") && regrouped[1].contains("task 3 joins group 2")
    );
    assert_eq!((v["attempt"].as_i64(), v["restarts"].as_i64()), (Some(1), Some(0)), "{ev:?}");
    assert!(!ev.iter().any(|e| e.1 == "restarted" || e.1 == "resized"), "{ev:?}");
    // Every step once, in order, each with the whole global batch: the same samples as a run with no failure.
    let rows = steps_and_samples(&p, &id);
    let got: Vec<u64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(got, (1..=steps as u64).collect::<Vec<_>>(), "steps logged");
    // Epochs of the digits end in a short batch: every epoch after the regrouping has the pattern of the first,
    // which ran before the kill.
    let epoch = rows.iter().position(|r| r.1 != 64).expect("an epoch's short tail") + 1;
    let off: Vec<&(u64, u64, u64)> =
        rows.iter().enumerate().filter(|(i, r)| r.1 != rows[i % epoch].1).map(|x| x.1).collect();
    assert!(off.is_empty() && epoch < 100, "steps whose global batch differs from a run with no failure: {off:?}");
    assert_eq!(v["summary"]["steps"], steps, "{}", v["summary"]);
    // The longest wait between two steps: the kill's cost to training, detection to the first step of the group.
    let stall = rows.windows(2).map(|w| w[1].2.saturating_sub(w[0].2)).max().unwrap_or(0);
    eprintln!(
        "elastic in place: kill -9 to the survivors' group decided {} ms, to a step heard from the new group {} ms; \
         the longest time between two steps {stall} ms",
        regrouped_at - t0,
        stepped - t0
    );
    // The same job with no failure ends where this one did: its final evaluation within 2%.
    let calm = p.submit("calm", &elastic_job("calm", steps, "min = 2\nmax = 3", 0));
    let c = p.wait_state(&calm, "succeeded");
    let (lost, kept) = (v["summary"]["final_loss"].as_f64(), c["summary"]["final_loss"].as_f64());
    let (Some(lost), Some(kept)) = (lost, kept) else { panic!("final losses: {lost:?} {kept:?}") };
    eprintln!("final evaluation loss {lost:.5} with a worker lost and regrouped in place, {kept:.5} with none");
    assert!((lost - kept).abs() <= 0.02 * kept, "{lost} against {kept} with no failure");
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn elastic_zero3_grows_re_sharded_and_after_a_kill_9_rolls_back_in_place_to_its_memory_copy() {
    let p = Platform::with_server("faults-inplace-zero", &["--cpus", "3"], &[]);
    let steps = 1500;
    let spec = |name: &str| {
        elastic_job(name, steps, "min = 2\nmax = 3", 0)
            .replace("[train]\n", "[train]\nstrategy = \"zero3\"\n")
            .replace("keep = 2\n", "keep = 2\nmemory_every = 20\n")
    };
    // A filler holds one of the three CPUs, so the job starts with two workers; when it goes, the job grows in
    // place: the whole state gathered over the two, re-sharded over three.
    let filler = p.submit("filler", &elastic_job("filler", 1_000_000, "count = 1", 0));
    p.wait_state(&filler, "running");
    let id = p.submit("sharded", &spec("sharded"));
    let v = training(&p, &id, 1, 50);
    assert_eq!(workers_of(&v), 2, "{v}");
    let r = p.request("POST", &format!("/api/v1/jobs/{filler}/cancel"), Some(p.token()), None);
    assert_eq!(r.status, 202, "{}", text(&r.body));
    p.wait_state_where(&id, "grown to three workers", |v| workers_of(v) == 3);
    // The newcomer joins at a step boundary once it has started, which on a loaded host can be hundreds of steps
    // later: the kill must come after it trains in the group of three, where each rank holds only its shard (a kill
    // during the regrouping finds the state gathered whole, and nothing to roll back).
    let (_, _, joined) = p.wait("the newcomer heard training", || heard(&p, &id, 2).filter(|h| h.1 == "train"));
    let v = training(&p, &id, 1, joined as i64 + 50);
    let (pid0, pid2) = (worker_pid(&v, 0), worker_pid(&v, 2));
    kill(worker_pid(&v, 1), libc::SIGKILL);

    // Rank 1's shards are gone with it: the survivors keep their processes and roll back to the newest in-memory
    // copy, re-sharded over two; then a newcomer joins and the state is gathered and re-sharded over three.
    let grown = p.wait_state_where(&id, "regrouped in place three times", |v| {
        events(v).iter().filter(|e| e.1 == "regrouped").count() >= 3 && workers_of(v) == 3
    });
    assert_eq!(grown["attempt"].as_i64(), Some(1), "{grown}");
    assert_eq!((worker_pid(&grown, 0), worker_pid(&grown, 2)), (pid0, pid2), "the survivors kept their processes");
    let v = p.wait_state(&id, "succeeded");
    let ev = events(&v);
    let said: Vec<&String> = ev.iter().filter(|e| e.1 == "regrouped" || e.1 == "resumed").map(|e| &e.2).collect();
    assert!(said[0].contains("grows in place from 2 to 3 workers"), "{said:?}");
    assert!(said.iter().any(|e| e.contains("the 2 survivors (task 0, 2) go on in place as group 2")), "{said:?}");
    assert!(
        said.iter().any(|e| e.contains("resumed from its memory copy at step") && e.contains("regrouped")),
        "the roll-back to the in-memory copy is told: {said:?}"
    );
    assert!(said.iter().skip(1).any(|e| e.contains("grows in place from 2 to 3 workers")), "{said:?}");
    assert_eq!((v["attempt"].as_i64(), v["restarts"].as_i64()), (Some(1), Some(0)), "{ev:?}");
    assert_eq!(v["summary"]["strategy"], "zero3", "{}", v["summary"]);
    // The steps after the copy were trained again, and logged once: every step once, in order.
    let got: Vec<u64> = steps_and_samples(&p, &id).iter().map(|r| r.0).collect();
    assert_eq!(got, (1..=steps as u64).collect::<Vec<_>>(), "steps logged");
    // The same job with no failure ends where this one did: its final evaluation within 2%.
    let calm = p.submit("calm", &spec("calm"));
    let c = p.wait_state(&calm, "succeeded");
    let (lost, kept) = (v["summary"]["final_loss"].as_f64(), c["summary"]["final_loss"].as_f64());
    let (Some(lost), Some(kept)) = (lost, kept) else { panic!("final losses: {lost:?} {kept:?}") };
    eprintln!(
        "zero3: final evaluation loss {lost:.5} with a worker lost and rolled back in place, {kept:.5} with none"
    );
    assert!((lost - kept).abs() <= 0.02 * kept, "{lost} against {kept} with no failure");
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn a_persistent_straggler_is_replaced_in_place_and_a_newcomer_takes_its_place() {
    let p = Platform::with_server("faults-straggler", &["--cpus", "2"], &[]);
    // No slowed data here: a rank stopped while it waits for its data would be judged slow at loading it.
    let spec = elastic_job("slowpoke", 1_000_000, "min = 1\nmax = 2", 0)
        .replace("policy = \"elastic\"", "policy = \"elastic\"\nreplace_stragglers = true")
        .replace("SHOAL_FAULT_DATA_DELAY = \"5ms\"\n", "");
    let id = p.submit("slowpoke", &spec);
    let v = training(&p, &id, 1, 20);
    assert_eq!(workers_of(&v), 2, "{v}");
    let group = v["workers"]
        .as_array()
        .and_then(|w| w.iter().find(|w| w["rank"] == 1))
        .and_then(|w| w["wrapper_pid"].as_i64())
        .expect("rank 1's process group") as i32;
    // Rank 1 is stopped from outside 120 ms of every 160 ms until it is gone.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                // SAFETY: signals to the process group of a worker this test's server started.
                if unsafe { libc::kill(-group, libc::SIGSTOP) } != 0 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(120));
                // SAFETY: as above.
                unsafe { libc::kill(-group, libc::SIGCONT) };
                std::thread::sleep(std::time::Duration::from_millis(40));
            }
        })
    };
    let replaced = p.wait_state_where(&id, "the straggler replaced and a newcomer in its place", |v| {
        let ev = events(v);
        ev.iter().any(|e| e.1 == "straggler") && ev.iter().filter(|e| e.1 == "regrouped").count() >= 2
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = stopper.join();
    // SAFETY: whatever happened above, nothing of the group stays stopped.
    unsafe { libc::kill(-group, libc::SIGCONT) };
    let ev = events(&replaced);
    let said: Vec<&String> = ev.iter().filter(|e| e.1 == "straggler" || e.1 == "regrouped").map(|e| &e.2).collect();
    assert!(said[0].contains("rank 1") && said[0].contains("replacing it in place"), "{said:?}");
    assert!(said[1].contains("rank 1 exited with status 137") && said[1].contains("survivors (task 0)"), "{said:?}");
    assert!(said[2].contains("grows in place from 1 to 2 workers") && said[2].contains("task 2 joins"), "{said:?}");
    assert_eq!((replaced["attempt"].as_i64(), replaced["restarts"].as_i64()), (Some(1), Some(0)), "{ev:?}");
    // The group trains on, then the job is cancelled: its point was made.
    let before = replaced["last_metrics"]["step"].as_u64().unwrap_or(0);
    p.wait("steps after the replacement", || {
        let (_, phase, step) = heard(&p, &id, 0)?;
        (phase == "train" && step > before + 10).then_some(())
    });
    let r = p.request("POST", &format!("/api/v1/jobs/{id}/cancel"), Some(p.token()), None);
    assert_eq!(r.status, 202, "{}", text(&r.body));
    p.wait_state(&id, "cancelled");
}
