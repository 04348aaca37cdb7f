//! The Slurm executor end to end, on a real two-node Slurm cluster (`scripts/test-slurm.sh`: slurmctld and two
//! slurmd, each in its own network and UTS namespaces, linked by veth pairs through a bridge): a real
//! `shoal server --executor slurm`, jobs submitted with the real CLI, each gang one Slurm allocation.
//!
//! - A two-worker DDP job runs through Slurm, one rank on each node (each rank's training process is checked to
//!   live in its node's network namespace, so their collectives crossed the link), and succeeds; the time from
//!   `shoal submit` to every rank running is measured and printed.
//! - Cancelling a job ends its Slurm job and every process.
//! - A server killed with `kill -9` adopts its running Slurm job when it starts again.
//! - A rank killed on its node fails the job with its exit status; a job over its Slurm time limit fails with
//!   Slurm's reason (TIMEOUT).
//! - An elastic job that loses a rank goes on in place with the survivor, and a newcomer joins its group in a Slurm
//!   allocation of its own, with no process of the survivor restarted.
//!
//! The set-up needs root (network namespaces, daemons) and, on a fresh machine, Debian's mirror: without them these
//! tests fail, saying so; they never skip. They run one at a time (they share the cluster's CPUs).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::platform::{Platform, alive, attempt_procs, events, kinds, text};

/// How long the cluster's set-up may take (a cold one installs Slurm with apt-get).
const SETUP: Duration = Duration::from_secs(900);

/// One Slurm test at a time; the cluster is set up once per test process (its script is idempotent anyway).
fn cluster() -> (MutexGuard<'static, ()>, String, String) {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    static CONF: OnceLock<Result<(String, String), String>> = OnceLock::new();
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let conf = CONF.get_or_init(start_cluster).clone();
    match conf {
        Ok((c, head)) => (guard, c, head),
        Err(e) => panic!("{e}"),
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/test-slurm.sh")
}

/// Runs `scripts/test-slurm.sh start`; the path of the cluster's slurm.conf and the head's address on the nodes'
/// network (this machine's, where the server runs).
fn start_cluster() -> Result<(String, String), String> {
    let t0 = Instant::now();
    let out = crate::platform::run_setup(&script(), SETUP, "the Slurm test cluster")?;
    let stdout = text(&out.stdout);
    let ok = stdout.lines().find(|l| l.starts_with("OK "));
    let word = |key: &str| ok.and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix(key)));
    match (out.status.success(), word("SLURM_CONF="), word("HEAD=")) {
        (true, Some(c), Some(head)) => {
            eprintln!("slurm cluster: {} (set-up took {:.1} s here)", ok.unwrap_or(""), t0.elapsed().as_secs_f64());
            Ok((c.to_owned(), head.to_owned()))
        }
        _ => Err(format!(
            "the Slurm test cluster could not be set up ({}): these tests need root, ip netns and Slurm (installed \
             from Debian's mirror when missing); nothing was skipped.\nstdout:\n{stdout}\nstderr:\n{}",
            out.status,
            text(&out.stderr)
        )),
    }
}

/// A Slurm command of the test cluster; its stdout (it must succeed).
fn slurm(conf: &str, program: &str, args: &[&str]) -> String {
    let out =
        Command::new(program).args(args).env("SLURM_CONF", conf).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(out.status.success(), "{program} {args:?}: {}{}", text(&out.stdout), text(&out.stderr));
    text(&out.stdout)
}

/// `Key=Value` of `scontrol show job -o ID`, or None when Slurm does not know the job.
fn slurm_job(conf: &str, id: &str, key: &str) -> Option<String> {
    let out = Command::new("scontrol").args(["show", "job", "-o", id]).env("SLURM_CONF", conf).output().ok()?;
    let line = text(&out.stdout);
    line.split_whitespace().find_map(|w| w.strip_prefix(&format!("{key}="))).map(str::to_owned)
}

/// The platform under test with `shoal server --executor slurm`, and a guard that cancels whatever Slurm job of
/// its data directory is left (the platform's own guard kills the processes).
struct SlurmPlatform {
    p: Platform,
    conf: String,
    _one: MutexGuard<'static, ()>,
}

impl SlurmPlatform {
    fn new(tag: &str, env: &[(&str, &str)]) -> SlurmPlatform {
        let (one, conf, head) = cluster();
        let mut all = vec![("SLURM_CONF", conf.as_str()), ("SHOAL_LOG", "shoal_control=info,shoal_exec=info,warn")];
        all.extend_from_slice(env);
        // The nodes reach the server (their heartbeats, a regrouping group's store) at the head's address.
        let advertise = format!("http://{head}:{{port}}");
        let p = Platform::with_server(tag, &["--executor", "slurm", "--advertise-url", &advertise], &all);
        SlurmPlatform { p, conf, _one: one }
    }

    /// The Slurm job id of the job's attempt (from its `started` event).
    fn slurm_id(&self, v: &Value) -> String {
        events(v)
            .iter()
            .filter(|(_, k, _)| k == "started")
            .find_map(|(_, _, m)| {
                m.split("Slurm job ").nth(1).map(|r| r.chars().take_while(char::is_ascii_digit).collect())
            })
            .unwrap_or_else(|| panic!("no Slurm job in the started event: {v}"))
    }

    /// Waits until every rank of attempt 1 has started its training process; their PIDs by rank.
    fn wait_ranks(&self, id: &str, world: usize) -> Vec<i64> {
        let dir = self.p.job_dir(id).join("attempt-1");
        self.p.wait(&format!("every rank of {id} to run on Slurm"), || {
            let pids: Vec<i64> = (0..world)
                .filter_map(|r| {
                    std::fs::read_to_string(dir.join(format!("rank-{r}.exit.pid"))).ok()?.trim().parse().ok()
                })
                .collect();
            (pids.len() == world).then_some(pids)
        })
    }

    /// Waits for `state` with a deadline of `limit` (Slurm's time limits take longer than the platform's waits).
    fn wait_final(&self, id: &str, state: &str, limit: Duration) -> Value {
        let t0 = Instant::now();
        loop {
            if let Some(v) = self.p.try_status(id) {
                let now = v["state"].as_str().unwrap_or("");
                if now == state {
                    return v;
                }
                assert!(
                    !["succeeded", "failed", "cancelled"].contains(&now),
                    "job {id} ended {now} while waiting for {state}: {}",
                    v["reason"]
                );
            }
            assert!(t0.elapsed() < limit, "timed out after {} s waiting for job {id} to be {state}", limit.as_secs());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Slurm no longer runs the job: not in squeue, and scontrol (which remembers it) says it ended.
    fn assert_slurm_job_over(&self, slurm_id: &str) {
        let q = slurm(&self.conf, "squeue", &["--noheader", "--format=%i %T", "--jobs", slurm_id]);
        assert!(q.trim().is_empty(), "Slurm still lists job {slurm_id}: {q}");
        let st = slurm_job(&self.conf, slurm_id, "JobState").unwrap_or_default();
        assert!(
            ["COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"].contains(&st.as_str()),
            "Slurm job {slurm_id} is {st:?}, not over"
        );
    }
}

impl Drop for SlurmPlatform {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = Path::new(&self.conf).parent().and_then(Path::parent).map(|d| d.join("log/slurmctld.log"));
            let t = log.and_then(|l| std::fs::read_to_string(l).ok()).unwrap_or_default();
            eprintln!("==== slurmctld.log (tail) ====\n{}", crate::platform::tail(&t, 4000));
        }
        let Ok(out) =
            Command::new("squeue").args(["--noheader", "--format=%i|%Z"]).env("SLURM_CONF", &self.conf).output()
        else {
            return;
        };
        for line in text(&out.stdout).lines() {
            if let Some((id, dir)) = line.split_once('|')
                && Path::new(dir.trim()).starts_with(self.p.data())
            {
                let _ = Command::new("scancel").arg(id.trim()).env("SLURM_CONF", &self.conf).status();
            }
        }
    }
}

/// A digits MLP, 2 workers one per node, 1 CPU and 512 MiB each.
fn job(name: &str, steps: usize, restart_max: u32) -> String {
    format!(
        r#"
name = "{name}"

[workers]
count = 2
spread = true

[resources]
cpus = 1
memory = "512MiB"

[fault_tolerance]
max_restarts = {restart_max}
backoff = "1s"

[train]
dataset = "digits"
global_batch = 128
steps = {steps}
seed = 0
optimizer = "adamw"
lr = 3e-3
warmup_steps = 10
log_every = 10

[train.model]
kind = "mlp"
hidden = [256, 256]
"#
    )
}

/// The network namespace a process lives in (`net:[INODE]`'s inode).
fn netns_of(pid: i64) -> Option<u64> {
    let l = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
    l.to_string_lossy().strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn event_ms(v: &Value, kind: &str) -> i64 {
    v["events"]
        .as_array()
        .and_then(|es| es.iter().find(|e| e["kind"] == kind))
        .and_then(|e| e["time_ms"].as_i64())
        .unwrap_or_else(|| panic!("no {kind} event with a time: {v}"))
}

#[test]
fn slurm_runs_a_two_worker_ddp_job_across_both_nodes() {
    let s = SlurmPlatform::new("slurm-ddp", &[]);
    let p = &s.p;
    // The scheduler's nodes are Slurm's.
    let n = p.cli_json(&["nodes", "--json"]);
    let mut names: Vec<&str> = n["nodes"].as_array().expect("nodes").iter().filter_map(|x| x["id"].as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["n1", "n2"], "shoal nodes shows Slurm's nodes: {n}");
    for x in n["nodes"].as_array().expect("nodes") {
        assert_eq!(x["cpus"].as_f64(), Some(4.0), "{x}");
        assert!(x["memory_bytes"].as_u64().is_some_and(|m| m > 1 << 30), "{x}");
    }

    let steps = 600;
    let t0 = now_ms();
    let id = p.submit("ddp", &job("ddp", steps, 0));
    // Every rank's training process: which node (network namespace) it runs in, and how long it took.
    let (pids, ranks_ms) = {
        let dir = p.job_dir(&id).join("attempt-1");
        let mut running_ms = None;
        let mut slurm_id = None;
        let pids = p.wait(&format!("every rank of {id} to run on Slurm"), || {
            if slurm_id.is_none() {
                slurm_id =
                    p.try_status(&id).and_then(|v| kinds(&v).contains(&"started".to_owned()).then(|| s.slurm_id(&v)));
            }
            if running_ms.is_none()
                && let Some(j) = &slurm_id
                && slurm_job(&s.conf, j, "JobState").as_deref() == Some("RUNNING")
            {
                running_ms = Some(now_ms());
            }
            let pids: Vec<i64> = (0..2)
                .filter_map(|r| {
                    std::fs::read_to_string(dir.join(format!("rank-{r}.exit.pid"))).ok()?.trim().parse().ok()
                })
                .collect();
            (pids.len() == 2).then_some(pids)
        });
        let ranks_ms = now_ms();
        let v = p.try_status(&id).expect("status");
        let (placed, started) = (event_ms(&v, "placed"), event_ms(&v, "started"));
        eprintln!(
            "latency from shoal submit: placed by Shoal's scheduler {} ms; sbatch returned {} ms; Slurm job RUNNING \
             (seen by polling scontrol) {} ms; every rank's training process running {} ms",
            placed - t0,
            started - t0,
            running_ms.map_or_else(|| "?".into(), |r| (r - t0).to_string()),
            ranks_ms - t0
        );
        (pids, ranks_ms - t0)
    };
    assert!(ranks_ms < 60_000, "{ranks_ms} ms from submit to every rank running");
    let ns = |node: &str| std::fs::metadata(format!("/run/netns/shoal-{node}")).map(|m| m.ino()).ok();
    for (rank, pid) in pids.iter().enumerate() {
        let node = ["n1", "n2"][rank];
        assert_eq!(netns_of(*pid), ns(node), "rank {rank} (pid {pid}) runs in the network namespace of {node}");
    }

    let v = p.wait_state(&id, "succeeded");
    let ws = v["workers"].as_array().unwrap_or_else(|| panic!("no workers: {v}"));
    let mut placed: Vec<(i64, String, String)> = ws
        .iter()
        .map(|w| {
            (
                w["rank"].as_i64().unwrap_or(-1),
                w["node"].as_str().unwrap_or("").into(),
                w["host"].as_str().unwrap_or("").into(),
            )
        })
        .collect();
    placed.sort();
    assert_eq!(
        placed,
        [(0, "n1".into(), "n1".into()), (1, "n2".into(), "n2".into())],
        "one rank on each Slurm node: {v}"
    );
    for w in ws {
        assert_eq!((w["state"].as_str(), w["exit_code"].as_i64()), (Some("exited"), Some(0)), "{w}");
    }
    let slurm_id = s.slurm_id(&v);
    s.assert_slurm_job_over(&slurm_id);
    assert_eq!(slurm_job(&s.conf, &slurm_id, "JobName").as_deref(), Some(format!("shoal-{id}-1").as_str()));
    assert_eq!(slurm_job(&s.conf, &slurm_id, "NodeList").as_deref(), Some("n[1-2]"));
    let sum = &v["summary"];
    assert_eq!(sum["world_size"], 2, "{sum}");
    assert_eq!(sum["steps"], steps, "{sum}");
    let acc = sum["eval_accuracy"].as_f64().unwrap_or_else(|| panic!("summary without eval_accuracy: {sum}"));
    assert!((0.85..=1.0).contains(&acc), "eval accuracy {acc} after {steps} steps on digits");
    // The log API reads what each step wrote.
    let out = p.cli(&p.token, &["logs", &id, "--rank", "0"]);
    assert!(out.status.success(), "shoal logs: {}", text(&out.stderr));
    assert!(text(&out.stdout).contains(&format!("{steps}/{steps}")), "rank 0's log:\n{}", text(&out.stdout));
    assert!(p.cli(&p.token, &["logs", &id, "--rank", "1"]).status.success());
    let n = p.cli_json(&["nodes", "--json"]);
    for x in n["nodes"].as_array().expect("nodes") {
        assert_eq!(x["allocated"]["cpus"].as_f64(), Some(0.0), "a finished job holds no CPUs: {x}");
    }
}

#[test]
fn slurm_cancel_ends_the_slurm_job_and_every_process() {
    let s = SlurmPlatform::new("slurm-cancel", &[]);
    let p = &s.p;
    let id = p.submit("endless", &format!("{}\n[checkpoint]\nmemory_every = 20\n", job("endless", 10_000_000, 3)));
    let pids = s.wait_ranks(&id, 2);
    // Its in-memory copies, on the nodes (whose /dev/shm is this machine's: the nodes are network namespaces).
    let shm = std::path::PathBuf::from(format!("/dev/shm/shoal-{id}"));
    p.wait("an in-memory copy on the nodes", || shm.exists().then_some(()));
    let v = p.wait_state(&id, "running");
    let slurm_id = s.slurm_id(&v);
    assert_eq!(slurm_job(&s.conf, &slurm_id, "JobState").as_deref(), Some("RUNNING"));
    let n = p.cli_json(&["nodes", "--json"]);
    let held: f64 = n["nodes"].as_array().expect("nodes").iter().filter_map(|x| x["allocated"]["cpus"].as_f64()).sum();
    assert_eq!(held, 2.0, "2 workers × 1 CPU allocated: {n}");

    let out = p.cli(&p.token, &["cancel", &id]);
    assert!(out.status.success(), "shoal cancel: {}", text(&out.stderr));
    let v = p.wait_state(&id, "cancelled");
    s.assert_slurm_job_over(&slurm_id);
    for pid in &pids {
        assert!(!alive(*pid), "worker {pid} of the cancelled job {id} is still alive");
    }
    assert!(attempt_procs(&id, 1).is_empty(), "processes of {id} left: {:?}", attempt_procs(&id, 1));
    assert_eq!(v["restarts"], 0, "a cancellation is no restart: {v}");
    let k = kinds(&v);
    assert!(k.contains(&"cancelled".to_owned()), "events: {k:?}");
    // The job is over: a Slurm job on each node it ran on removes its in-memory copies.
    p.wait(&format!("{} removed", shm.display()), || (!shm.exists()).then_some(()));
}

#[test]
fn slurm_jobs_outlive_a_killed_server_and_are_adopted() {
    let mut s = SlurmPlatform::new("slurm-adopt", &[]);
    let id = s.p.submit("endless", &job("endless", 10_000_000, 0));
    let pids = s.wait_ranks(&id, 2);
    let v = s.p.wait_state(&id, "running");
    let slurm_id = s.slurm_id(&v);
    let port = s.p.port();
    s.p.kill_server();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(slurm_job(&s.conf, &slurm_id, "JobState").as_deref(), Some("RUNNING"), "the job outlives the server");
    s.p.start_server(Some(port));
    let v = s.p.wait_state_where(&id, "adopted", |v| kinds(v).contains(&"adopted".to_owned()));
    let adopted = events(&v).into_iter().find(|(_, k, _)| k == "adopted").map(|(_, _, m)| m).unwrap_or_default();
    assert!(
        adopted.contains("2 of 2 workers still running") && adopted.contains(&format!("Slurm job {slurm_id}")),
        "{adopted}"
    );
    assert_eq!(v["state"], "running", "{v}");
    for pid in &pids {
        assert!(alive(*pid), "worker {pid} survived the server");
    }
    let out = s.p.cli(&s.p.token, &["cancel", &id]);
    assert!(out.status.success(), "shoal cancel: {}", text(&out.stderr));
    s.p.wait_state(&id, "cancelled");
    s.assert_slurm_job_over(&slurm_id);
}

#[test]
fn slurm_reports_a_rank_killed_on_its_node_with_its_status() {
    let s = SlurmPlatform::new("slurm-kill", &[]);
    let p = &s.p;
    let id = p.submit("fragile", &job("fragile", 10_000_000, 0));
    let pids = s.wait_ranks(&id, 2);
    // SAFETY: kill(2) on rank 1's training process, which this test's server started through Slurm.
    assert_eq!(unsafe { libc::kill(pids[1] as i32, libc::SIGKILL) }, 0, "kill rank 1 (pid {})", pids[1]);
    let v = p.wait_state(&id, "failed");
    // Rank 1's status is recorded; the job fails on it, or on rank 0 if rank 0 saw its peer gone first.
    let reason = v["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("rank 1 exited with status 137") || reason.contains("rank 0 exited with status 1"),
        "reason: {reason}"
    );
    let rank1 = v["workers"].as_array().and_then(|ws| ws.iter().find(|w| w["rank"] == 1)).cloned();
    assert_eq!(rank1.as_ref().and_then(|w| w["exit_code"].as_i64()), Some(137), "rank 1: {rank1:?}");
    s.assert_slurm_job_over(&s.slurm_id(&v));
    assert!(!alive(pids[0]), "rank 0 (pid {}) outlived its failed gang", pids[0]);
}

#[test]
fn slurm_reports_its_time_limit_as_the_reason() {
    // sbatch's own input variable, in the server's environment: a limit of one minute on every job.
    let s = SlurmPlatform::new("slurm-timeout", &[("SBATCH_TIMELIMIT", "1")]);
    let p = &s.p;
    let id = p.submit("slow", &job("slow", 10_000_000, 0));
    s.wait_ranks(&id, 2);
    let v = p.wait_state(&id, "running");
    let slurm_id = s.slurm_id(&v);
    assert_eq!(slurm_job(&s.conf, &slurm_id, "TimeLimit").as_deref(), Some("00:01:00"));
    // Slurm checks time limits every 30 s: the job ends 60 to 90 s after it started.
    let v = s.wait_final(&id, "failed", Duration::from_secs(240));
    let reason = v["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("TIMEOUT") && reason.contains(&format!("Slurm ended job {slurm_id} at its time limit")),
        "reason: {reason}"
    );
    let failed = events(&v).into_iter().find(|(_, k, _)| k == "failed").map(|(_, _, m)| m).unwrap_or_default();
    assert!(failed.contains("TIMEOUT"), "the failed event names Slurm's reason: {failed}");
    s.assert_slurm_job_over(&slurm_id);
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn slurm_elastic_job_regroups_in_place_and_a_newcomer_joins_in_an_allocation_of_its_own() {
    let s = SlurmPlatform::new("slurm-elastic", &[]);
    let p = &s.p;
    let steps = 8000;
    let spec = job("stretchy", steps, 0)
        .replace("count = 2\n", "min = 1\nmax = 2\n")
        .replace("max_restarts = 0\n", "policy = \"elastic\"\nmax_restarts = 0\n")
        .replace("[train]\n", "[env]\nSHOAL_FAULT_DATA_DELAY = \"5ms\"\n[train]\n");
    let id = p.submit("stretchy", &spec);
    let pids = s.wait_ranks(&id, 2);
    let gang = s.slurm_id(&p.wait_state(&id, "running"));
    p.wait_state_where(&id, "training past step 100", |v| v["last_metrics"]["step"].as_u64().is_some_and(|s| s > 100));
    // SAFETY: kill(2) on rank 1's training process, which this test's server started through Slurm.
    assert_eq!(unsafe { libc::kill(pids[1] as i32, libc::SIGKILL) }, 0, "kill rank 1 (pid {})", pids[1]);

    let grown = p.wait_state_where(&id, "regrouped in place twice", |v| {
        events(v).iter().filter(|e| e.1 == "regrouped").count() >= 2
            && v["workers"].as_array().is_some_and(|w| w.len() == 2)
    });
    let said: Vec<String> = events(&grown).into_iter().filter(|e| e.1 == "regrouped").map(|e| e.2).collect();
    assert!(said[0].contains("rank 1 exited with status 137") && said[0].contains("survivors (task 0)"), "{said:?}");
    assert!(said[1].contains("grows in place from 1 to 2 workers") && said[1].contains("task 2 joins"), "{said:?}");
    assert_eq!(grown["attempt"].as_i64(), Some(1), "{grown}");
    assert!(alive(pids[0]), "the survivor (pid {}) kept its process", pids[0]);
    // The newcomer runs in a Slurm job of its own, named as the attempt's.
    let newcomer: String = said[1]
        .split("Slurm job ")
        .nth(1)
        .map(|r| r.chars().take_while(char::is_ascii_digit).collect())
        .unwrap_or_else(|| panic!("no Slurm job of the newcomer's own: {said:?}"));
    assert_ne!(newcomer, gang, "{said:?}");
    assert_eq!(slurm_job(&s.conf, &newcomer, "JobName").as_deref(), Some(format!("shoal-{id}-1").as_str()));

    let v = s.wait_final(&id, "succeeded", Duration::from_secs(600));
    assert_eq!((v["attempt"].as_i64(), v["restarts"].as_i64()), (Some(1), Some(0)), "{}", v["events"]);
    assert_eq!(v["summary"]["steps"], steps, "{}", v["summary"]);
    assert_eq!(v["summary"]["world_size"], 2, "{}", v["summary"]);
    s.assert_slurm_job_over(&gang);
    s.assert_slurm_job_over(&newcomer);
}
