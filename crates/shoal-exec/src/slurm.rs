//! The Slurm executor: a placed gang becomes one Slurm allocation, each rank one step in it.
//!
//! Shoal's own scheduler keeps its queues, quotas, priorities and gangs; Slurm is told exactly where it placed each
//! rank. [`Executor::start_gang`] writes a batch script and submits it with `sbatch` (`--job-name
//! shoal-JOB-ATTEMPT`, `--nodes`, `--ntasks`, `--ntasks-per-node`, `--cpus-per-task`, `--mem`, `--nodelist`,
//! `--gres=gpu:N` when GPUs are asked, `--output`/`--error` in the attempt's directory, `--no-requeue`: restarts are
//! Shoal's); a layout with as many ranks on every node is one job, an uneven one a heterogeneous job, one component
//! per node. The script starts one `srun` step per rank, pinned to its node (`--nodelist`, `--exclusive`), in the
//! background, with that rank's environment contract (written by `TaskEnv::vars` through `task_env`, exported in
//! the step's subshell), then waits for them.
//!
//! - Each step runs the rank under a tiny `sh` wrapper that records the training process's PID and its exit status
//!   beside its log (`rank-R.exit`, as the local executor does: a cluster shares its filesystem with the server).
//!   Signals reach every process of a step (Slurm signals them all), so the wrapper only waits through them. When a
//!   step ends without a status (it never started), the batch script records srun's status as `rank-R.srun`.
//! - [`Executor::probe`] asks `scontrol show job` (no accounting daemon is needed: a finished job is remembered for
//!   `MinJobAge`), cached briefly so a gang's ranks cost one call per tick. A rank that recorded a failure is
//!   reported at once; a success only once the allocation is over, so nothing of an attempt outlives it. When
//!   Slurm itself ends the job (time limit, out of memory, node failure, preemption), the rank is lost with
//!   Slurm's state and reason. A `scontrol` that cannot reach the controller is an error ("cannot tell now").
//! - [`Executor::stop`] signals the whole allocation (Shoal always stops a gang whole): `scancel --signal=TERM` to a
//!   running job (its steps only; the batch script waits for them), `scancel` to end it, or one that has not started
//!   (scancel would wait for it to start before signalling it).
//! - The rendezvous is on rank 0's node, at the address Slurm knows it by (`NodeAddr`), so every node reaches it;
//!   rank 0 hosts the store (`SHOAL_RENDEZVOUS_HOST=1`).
//! - [`Executor::nodes`]: Slurm's nodes (`scontrol show node -o`) with their CPUs, memory and GPUs, for the
//!   scheduler's model; nodes down, drained or not responding are left out.
//! - The Slurm job id is the task's [`Task::external_id`]: a restarted server probes and adopts the job, and
//!   `shoal-*` jobs running in this server's data directory that no adopted task owns are strays.
//! - When the server runs as root, jobs are submitted for the task user (`sbatch --uid/--gid`).
//!
//! sbatch's own input variables in the server's environment (`SBATCH_PARTITION`, `SBATCH_ACCOUNT`,
//! `SBATCH_QOS`, `SBATCH_TIMELIMIT`, ...) apply to every job; `SLURM_CONF` names the cluster's configuration.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use shoal_comm::env::TaskEnv;

use crate::error::{ExecError, Result};
use crate::executor::{Executor, GangError, NodeInfo, Stop, Stray, Task, TaskLaunch, TaskStatus, Usage, task_env};
use crate::local::{TaskUser, give_to, task_dir_for};
use crate::procfs::hostname;

/// How long one Slurm command may take before the executor says it cannot tell.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an answer of `scontrol show job` is reused (the ranks of a gang are probed one after the other).
const JOB_CACHE: Duration = Duration::from_millis(250);
/// Repeated stops of one allocation (one per rank) within this long are one.
const STOP_REPEAT: Duration = Duration::from_secs(2);
/// Every Slurm job of Shoal is named `shoal-JOB-ATTEMPT`.
const NAME_PREFIX: &str = "shoal-";
/// The rendezvous port is drawn from this range (below Linux's ephemeral ports).
const RENDEZVOUS_PORTS: std::ops::Range<u16> = 20000..32000;

/// The rank's wrapper ([`crate::executor::EXIT_WRAPPER`]): it waits through the signals Slurm sends every process
/// of the step (the program gets them itself).
const WRAPPER: &str = crate::executor::EXIT_WRAPPER;

/// Slurm's commands, found on `PATH` when the executor is made.
#[derive(Debug)]
struct Bins {
    sbatch: PathBuf,
    squeue: PathBuf,
    scontrol: PathBuf,
    scancel: PathBuf,
    srun: PathBuf,
}

/// Runs tasks as steps of Slurm allocations.
#[derive(Debug)]
pub struct SlurmExecutor {
    data_dir: PathBuf,
    host: String,
    user: Option<TaskUser>,
    bins: Bins,
    /// Node name → the address Slurm reaches it at.
    addrs: Mutex<HashMap<String, String>>,
    /// Slurm job id → when it was asked and what `scontrol` said (`None`: Slurm does not know it).
    jobs: Mutex<HashMap<String, (Instant, Option<JobInfo>)>>,
    /// Slurm job id → the last stop asked and when.
    stops: Mutex<HashMap<String, (Instant, Stop)>>,
    /// Shoal job → the nodes its tasks were started on (where its in-memory checkpoints may lie).
    ran_on: Mutex<HashMap<String, std::collections::BTreeSet<String>>>,
}

/// What `scontrol show job` says of a job (of its components, for a heterogeneous one, the one that tells most).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobInfo {
    pub state: String,
    pub reason: String,
    /// `CODE:SIGNAL` of the batch script.
    pub exit_code: String,
    pub time_limit: String,
    pub nodes: String,
}

/// States in which a job has nothing running any more.
const FINAL: [&str; 10] = [
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "REVOKED",
];

impl JobInfo {
    pub fn is_final(&self) -> bool {
        FINAL.contains(&self.state.as_str())
    }

    /// Why Slurm itself ended the job, when it did (a time limit, memory, a node, preemption).
    fn ended_by_slurm(&self, id: &str) -> Option<String> {
        let what = match self.state.as_str() {
            "TIMEOUT" => format!("Slurm ended job {id} at its time limit of {} (TIMEOUT)", self.time_limit),
            "OUT_OF_MEMORY" => format!("Slurm killed job {id}: out of memory (OUT_OF_MEMORY)"),
            "NODE_FAIL" => format!("a node of Slurm job {id} failed (NODE_FAIL; nodes {})", self.nodes),
            "PREEMPTED" => format!("Slurm preempted job {id} (PREEMPTED)"),
            "BOOT_FAIL" => format!("a node of Slurm job {id} failed to boot (BOOT_FAIL)"),
            "DEADLINE" => format!("Slurm job {id} reached its deadline (DEADLINE)"),
            _ => return None,
        };
        Some(self.with_reason(what))
    }

    fn with_reason(&self, what: String) -> String {
        match self.reason.as_str() {
            "" | "None" => what,
            r => format!("{what}, reason {r}"),
        }
    }

    /// Parses `scontrol show job -o` (one line per component).
    pub fn parse(text: &str) -> Option<JobInfo> {
        let parts: Vec<JobInfo> = text
            .lines()
            .filter(|l| l.contains("JobState="))
            .map(|l| {
                let f = fields(l);
                let get = |k: &str| f.get(k).cloned().unwrap_or_default();
                JobInfo {
                    state: get("JobState"),
                    reason: get("Reason"),
                    exit_code: get("ExitCode"),
                    time_limit: get("TimeLimit"),
                    nodes: get("NodeList"),
                }
            })
            .collect();
        // A component still active makes the job active; else the first that did not complete tells why.
        parts
            .iter()
            .find(|p| !p.is_final())
            .or_else(|| parts.iter().find(|p| p.state != "COMPLETED"))
            .or_else(|| parts.first())
            .cloned()
    }
}

/// `Key=Value` fields of one line of Slurm's `-o` output (a word without `=` belongs to the value before it).
fn fields(line: &str) -> HashMap<String, String> {
    let mut out: HashMap<String, String> = HashMap::new();
    let mut last: Option<String> = None;
    for word in line.split_whitespace() {
        match word.split_once('=') {
            Some((k, v)) if !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'/' || b == b':') => {
                out.insert(k.to_owned(), v.to_owned());
                last = Some(k.to_owned());
            }
            _ => {
                if let Some(v) = last.as_ref().and_then(|k| out.get_mut(k)) {
                    v.push(' ');
                    v.push_str(word);
                }
            }
        }
    }
    out
}

/// What a rank's files say: the wrapper's exit status and, when its step ended without one, srun's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankFiles {
    pub exit: Option<i32>,
    pub srun: Option<i32>,
}

/// How rank `rank` of Slurm job `id` stands, from what Slurm says of the job (`None`: it no longer knows it) and
/// the rank's files. `batch_err`: the last words of the batch script's error output, for a rank lost without them.
pub fn judge(id: &str, rank: i64, info: Option<&JobInfo>, files: RankFiles, batch_err: &str) -> TaskStatus {
    let srun_lost = |c: i32| {
        let said = if batch_err.is_empty() { String::new() } else { format!("; srun said: {batch_err}") };
        TaskStatus::Lost(format!(
            "the Slurm step of rank {rank} in job {id} ended (srun status {c}) without the task recording a status{said}"
        ))
    };
    let Some(info) = info else {
        return match files.exit {
            Some(c) => TaskStatus::Exited(c),
            None => TaskStatus::Lost(format!(
                "Slurm no longer knows job {id} (ended longer ago than its MinJobAge, or its controller lost its \
                 state), and rank {rank} recorded no exit status"
            )),
        };
    };
    if !info.is_final() {
        // Being torn down (COMPLETING): its final state, once there, says why.
        if info.state == "COMPLETING" {
            return TaskStatus::Running;
        }
        return match files {
            RankFiles { exit: Some(c), .. } if c != 0 => TaskStatus::Exited(c),
            RankFiles { exit: None, srun: Some(c) } => srun_lost(c),
            _ => TaskStatus::Running,
        };
    }
    if files.exit != Some(0)
        && let Some(why) = info.ended_by_slurm(id)
    {
        return TaskStatus::Lost(why);
    }
    match files {
        RankFiles { exit: Some(c), .. } => TaskStatus::Exited(c),
        RankFiles { exit: None, srun: Some(c) } => srun_lost(c),
        RankFiles { exit: None, srun: None } => TaskStatus::Lost(info.with_reason(format!(
            "Slurm job {id} ended {} (exit code {}) without rank {rank} recording a status",
            info.state, info.exit_code
        ))),
    }
}

/// One node's line of `scontrol show node -o`, if the node can take jobs.
pub fn parse_node(line: &str) -> Option<NodeInfo> {
    let f = fields(line);
    let name = f.get("NodeName")?.clone();
    let state = f.get("State").map_or("", String::as_str);
    if ["DOWN", "DRAIN", "FAIL", "FUTURE", "NOT_RESPONDING", "POWERED_DOWN"].iter().any(|s| state.contains(s))
        || state.ends_with('*')
    {
        tracing::warn!(node = %name, state, "leaving out a Slurm node that cannot take jobs");
        return None;
    }
    let num = |k: &str| f.get(k).and_then(|v| v.parse::<u64>().ok());
    let cpus = num("CPUEfctv").or_else(|| num("CPUTot"))?;
    let mem_mib = num("RealMemory")?;
    let (gpus, gpu_kind) = f.get("Gres").map_or((0, String::new()), |g| gres_gpus(g));
    Some(NodeInfo {
        host: f.get("NodeAddr").cloned().unwrap_or_else(|| name.clone()),
        name,
        cpus_milli: cpus * 1000,
        memory_bytes: mem_mib << 20,
        gpus,
        gpu_kind: if gpu_kind.is_empty() { "gpu".into() } else { gpu_kind },
    })
}

/// GPUs in a node's `Gres=` (`gpu:2`, `gpu:a100:4(S:0-1)`, `(null)`): their number and kind.
fn gres_gpus(gres: &str) -> (u32, String) {
    let mut n = 0;
    let mut kind = String::new();
    for g in gres.split(',') {
        let g = g.split('(').next().unwrap_or("");
        let parts: Vec<&str> = g.split(':').collect();
        if parts.first() != Some(&"gpu") {
            continue;
        }
        n += parts.last().and_then(|c| c.parse::<u32>().ok()).unwrap_or(0);
        if parts.len() == 3 {
            kind = parts[1].to_owned();
        }
    }
    (n, kind)
}

/// Single-quoted for `sh`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn valid_env_name(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// Runs a Slurm command with a deadline; its output whatever its status. An error: it could not run or answer.
fn run(program: &Path, args: &[String], what: &str) -> Result<Output> {
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| ExecError::Unavailable(format!("{what}: cannot run {}: {e}", program.display())))?;
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(COMMAND_TIMEOUT) {
        Ok(out) => out.map_err(|e| ExecError::Unavailable(format!("{what}: {e}"))),
        Err(_) => {
            // SAFETY: plain syscall on our own child, not reaped yet (its waiting thread still holds it).
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
            }
            let _ = rx.recv_timeout(Duration::from_secs(5));
            Err(ExecError::Unavailable(format!(
                "{what}: {} did not answer within {} s",
                program.display(),
                COMMAND_TIMEOUT.as_secs()
            )))
        }
    }
}

fn stderr_line(out: &Output) -> String {
    let e = String::from_utf8_lossy(&out.stderr);
    let e = e.trim();
    if e.is_empty() { format!("exit status {}", out.status) } else { e.lines().last().unwrap_or(e).to_owned() }
}

/// Which nodes a gang uses and which ranks each runs, in the order of first use (rank 0's node first).
fn layout(launches: &[TaskLaunch]) -> Vec<(String, Vec<usize>)> {
    let mut nodes: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, l) in launches.iter().enumerate() {
        match nodes.iter_mut().find(|(n, _)| *n == l.node) {
            Some((_, ranks)) => ranks.push(i),
            None => nodes.push((l.node.clone(), vec![i])),
        }
    }
    nodes
}

/// What one rank asks of Slurm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ask {
    cpus: u64,
    mem_mib: u64,
    gpus: u64,
}

impl Ask {
    fn of(l: &TaskLaunch) -> Ask {
        let shares: u64 = l.gpus.iter().map(|(_, s)| u64::from(*s)).sum();
        Ask {
            cpus: l.cpus_milli.div_ceil(1000).max(1),
            mem_mib: l.memory_bytes.div_ceil(1 << 20).max(1),
            // Slurm counts whole GPUs: a fractional share takes one.
            gpus: shares.div_ceil(1000),
        }
    }
}

/// The name of a batch script and its outputs in the attempt's directory: `batch` for a gang, `batch-rank-R` for a
/// newcomer that joins a running group with an allocation of its own.
fn batch_stem(first: &TaskLaunch) -> String {
    match first.join {
        Some(_) => format!("batch-rank-{}", first.rank),
        None => "batch".into(),
    }
}

/// The `sbatch` options of a gang (after the common ones): one component for an even layout, one per node
/// otherwise (a heterogeneous job), and the component each rank's step runs in.
fn allocation_args(nodes: &[(String, Vec<usize>)], ask: Ask) -> (Vec<Vec<String>>, Vec<Option<usize>>) {
    let component = |names: &[&str], per_node: usize| {
        let n = names.len();
        let mut a = vec![
            format!("--nodes={n}"),
            format!("--ntasks={}", n * per_node),
            format!("--ntasks-per-node={per_node}"),
            format!("--cpus-per-task={}", ask.cpus),
            format!("--mem={}M", ask.mem_mib * per_node as u64),
            format!("--nodelist={}", names.join(",")),
        ];
        if ask.gpus > 0 {
            a.push(format!("--gres=gpu:{}", ask.gpus * per_node as u64));
        }
        a
    };
    let world: usize = nodes.iter().map(|(_, r)| r.len()).sum();
    let per_node = nodes.first().map_or(0, |(_, r)| r.len());
    if nodes.iter().all(|(_, r)| r.len() == per_node) {
        let names: Vec<&str> = nodes.iter().map(|(n, _)| n.as_str()).collect();
        return (vec![component(&names, per_node)], vec![None; world]);
    }
    let mut groups = vec![None; world];
    let comps = nodes
        .iter()
        .enumerate()
        .map(|(g, (n, ranks))| {
            for &r in ranks {
                groups[r] = Some(g);
            }
            component(&[n.as_str()], ranks.len())
        })
        .collect();
    (comps, groups)
}

impl SlurmExecutor {
    /// An executor submitting to the Slurm cluster that `SLURM_CONF` (or Slurm's default configuration) names;
    /// tasks run as `user` when the server is root. Slurm's commands must be on `PATH`.
    pub fn new(data_dir: &Path, user: Option<TaskUser>) -> Result<SlurmExecutor> {
        let find = |name: &str| -> Result<PathBuf> {
            std::env::var_os("PATH")
                .into_iter()
                .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
                .map(|d| d.join(name))
                .find(|p| p.is_file())
                .ok_or_else(|| {
                    ExecError::Config(format!(
                        "the Slurm executor needs Slurm's `{name}` on PATH (Debian: apt-get install slurm-client)"
                    ))
                })
        };
        Ok(SlurmExecutor {
            data_dir: data_dir.to_path_buf(),
            host: hostname(),
            user,
            bins: Bins {
                sbatch: find("sbatch")?,
                squeue: find("squeue")?,
                scontrol: find("scontrol")?,
                scancel: find("scancel")?,
                srun: find("srun")?,
            },
            addrs: Mutex::new(HashMap::new()),
            jobs: Mutex::new(HashMap::new()),
            stops: Mutex::new(HashMap::new()),
            ran_on: Mutex::new(HashMap::new()),
        })
    }

    /// The directory of one attempt's script, logs and exit files.
    pub fn attempt_dir(&self, job: &str, attempt: i64) -> PathBuf {
        self.data_dir.join("jobs").join(job).join(format!("attempt-{attempt}"))
    }

    fn exit_path(&self, job: &str, attempt: i64, rank: i64) -> PathBuf {
        self.attempt_dir(job, attempt).join(format!("rank-{rank}.exit"))
    }

    /// The address Slurm reaches `node` at (asked once per node).
    fn node_addr(&self, node: &str) -> Result<String> {
        if let Some(a) = self.addrs.lock().unwrap_or_else(|p| p.into_inner()).get(node) {
            return Ok(a.clone());
        }
        let args = ["show".into(), "node".into(), "-o".into(), node.to_owned()];
        let out = run(&self.bins.scontrol, &args, &format!("asking Slurm for node {node}"))?;
        if !out.status.success() {
            return Err(ExecError::Unavailable(format!("scontrol show node {node}: {}", stderr_line(&out))));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let f = fields(text.lines().next().unwrap_or(""));
        let addr = f.get("NodeAddr").cloned().unwrap_or_else(|| node.to_owned());
        self.addrs.lock().unwrap_or_else(|p| p.into_inner()).insert(node.to_owned(), addr.clone());
        Ok(addr)
    }

    /// What Slurm says of job `id` now (`None`: it does not know it), cached for [`JOB_CACHE`].
    fn job(&self, id: &str) -> Result<Option<JobInfo>> {
        if let Some((at, info)) = self.jobs.lock().unwrap_or_else(|p| p.into_inner()).get(id)
            && at.elapsed() < JOB_CACHE
        {
            return Ok(info.clone());
        }
        let args = ["show".into(), "job".into(), "-o".into(), id.to_owned()];
        let out = run(&self.bins.scontrol, &args, &format!("asking Slurm about job {id}"))?;
        let info = if out.status.success() {
            let text = String::from_utf8_lossy(&out.stdout);
            Some(JobInfo::parse(&text).ok_or_else(|| {
                ExecError::Unavailable(format!("scontrol show job {id} said nothing of its state: {}", text.trim()))
            })?)
        } else if String::from_utf8_lossy(&out.stderr).contains("Invalid job id") {
            None
        } else {
            return Err(ExecError::Unavailable(format!("scontrol show job {id}: {}", stderr_line(&out))));
        };
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).insert(id.to_owned(), (Instant::now(), info.clone()));
        Ok(info)
    }

    fn forget(&self, id: &str) {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }

    fn read_code(path: &Path) -> Option<i32> {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    }

    /// The last line of the batch script's error output (srun's own messages) of rank `rank`'s allocation — its
    /// own when it joined a running group, else its gang's — if any.
    fn batch_err(&self, job: &str, attempt: i64, rank: i64) -> String {
        let dir = self.attempt_dir(job, attempt);
        let text = std::fs::read_to_string(dir.join(format!("batch-rank-{rank}.err")))
            .or_else(|_| std::fs::read_to_string(dir.join("batch.err")))
            .unwrap_or_default();
        text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim().chars().take(300).collect()
    }

    /// The batch script of a gang: one background step per rank with its environment, then `wait`.
    fn script(&self, launches: &[TaskLaunch], groups: &[Option<usize>]) -> Result<String> {
        let first = &launches[0];
        let dir = self.attempt_dir(&first.job_id, first.attempt);
        let nodes = layout(launches);
        let mut s = format!(
            "#!/bin/sh\n# Shoal job {}, attempt {}: one Slurm step per rank (written by Shoal's Slurm executor).\n",
            first.job_id, first.attempt
        );
        for (i, l) in launches.iter().enumerate() {
            let ask = Ask::of(l);
            let Some(program) = l.argv.first() else {
                return Err(ExecError::BadTask(format!("job {} rank {}: empty command", l.job_id, l.rank)));
            };
            let (local_rank, local_world) = nodes
                .iter()
                .find(|(n, _)| *n == l.node)
                .and_then(|(_, ranks)| Some((ranks.iter().position(|&r| r == i)?, ranks.len())))
                .unwrap_or((0, 1));
            let exit = self.exit_path(&l.job_id, l.attempt, l.rank as i64);
            // A newcomer to a running group (its own allocation) takes its seat there and meets at the control
            // plane's store.
            let (rank, world_size, rendezvous) = l.seat();
            let (host, port) = rendezvous.rsplit_once(':').unwrap_or((rendezvous, ""));
            let contract = TaskEnv {
                job_id: l.job_id.clone(),
                rank,
                world_size,
                local_rank,
                local_world_size: local_world,
                rendezvous: rendezvous.to_owned(),
                // No store runs beside the tasks: rank 0 hosts it, on its node.
                host_store: l.join.is_none(),
                secret: l.secret.clone(),
                master_addr: host.to_owned(),
                master_port: port.parse().unwrap_or(0),
                attempt: Some(l.attempt),
                exit_file: Some(exit.display().to_string()),
                server_data: Some(self.data_dir.display().to_string()),
                server: l.server.clone(),
                server_ca: l.server_ca.clone(),
                threads: Some(ask.cpus as usize),
                // Slurm says which GPUs a step with `--gres` sees; a task that asked none sees none.
                gpus: if ask.gpus > 0 { None } else { Some(String::new()) },
                join: l.join.as_ref().map(|j| (j.generation, l.rank)),
            };
            s.push_str("(\n");
            for (k, v) in task_env(&contract, &l.env) {
                if !valid_env_name(&k) {
                    return Err(ExecError::BadTask(format!("job {}: {k:?} is not a variable name", l.job_id)));
                }
                s.push_str(&format!("export {k}={}\n", sh_quote(&v)));
            }
            let mut step: Vec<String> = vec![self.bins.srun.display().to_string()];
            if let Some(g) = groups.get(i).copied().flatten() {
                step.push(format!("--het-group={g}"));
            }
            step.extend([
                "--nodes=1".into(),
                "--ntasks=1".into(),
                format!("--nodelist={}", l.node),
                "--exclusive".into(),
                format!("--cpus-per-task={}", ask.cpus),
                format!("--mem={}M", ask.mem_mib),
                format!("--job-name=rank-{}", l.rank),
                format!("--output={}", dir.join(format!("rank-{}.log", l.rank)).display()),
                "--open-mode=append".into(),
            ]);
            if ask.gpus > 0 {
                step.push(format!("--gres=gpu:{}", ask.gpus));
            }
            step.extend(["/bin/sh".into(), "-c".into(), WRAPPER.into(), "shoal-task".into()]);
            step.push(exit.display().to_string());
            step.push(program.clone());
            step.extend(l.argv[1..].iter().cloned());
            let quoted: Vec<String> = step.iter().map(|a| sh_quote(a)).collect();
            let srun_file = sh_quote(&format!("{}.srun", dir.join(format!("rank-{}", l.rank)).display()));
            let exit_q = sh_quote(&exit.display().to_string());
            // srun's own status, when the step ended without the wrapper recording one (it never started).
            s.push_str(&format!(
                "{}\nc=$?\n[ -e {exit_q} ] || {{ printf '%s' \"$c\" > {srun_file}.tmp && /bin/mv {srun_file}.tmp {srun_file}; }}\n) &\n",
                quoted.join(" ")
            ));
        }
        s.push_str("wait\n");
        Ok(s)
    }

    fn submit(&self, launches: &[TaskLaunch]) -> Result<Vec<Task>> {
        let first = launches.first().ok_or_else(|| ExecError::BadTask("a gang of no tasks".into()))?;
        if launches.iter().any(|l| l.job_id != first.job_id || l.attempt != first.attempt) {
            return Err(ExecError::BadTask("a gang's tasks must be of one attempt of one job".into()));
        }
        let dir = self.attempt_dir(&first.job_id, first.attempt);
        self.task_dir(&dir)?;
        for l in launches {
            let exit = self.exit_path(&l.job_id, l.attempt, l.rank as i64);
            for suffix in ["", ".pid", ".tmp"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", exit.display()));
            }
            let _ = std::fs::remove_file(dir.join(format!("rank-{}.srun", l.rank)));
        }
        let nodes = layout(launches);
        let ask = Ask::of(first);
        let (components, groups) = allocation_args(&nodes, ask);
        let script = self.script(launches, &groups)?;
        let stem = batch_stem(first);
        let path = dir.join(format!("{stem}.sh"));
        std::fs::write(&path, &script).map_err(|e| ExecError::io(format!("writing {}", path.display()), e))?;
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .map_err(|e| ExecError::io(format!("chmod 0600 {}", path.display()), e))?;
        give_to(&path, self.user.as_ref())?;
        let name = format!("{NAME_PREFIX}{}-{}", first.job_id, first.attempt);
        let mut args = vec![
            "--parsable".into(),
            format!("--job-name={name}"),
            format!("--chdir={}", dir.display()),
            format!("--output={}", dir.join(format!("{stem}.out")).display()),
            format!("--error={}", dir.join(format!("{stem}.err")).display()),
            "--no-requeue".into(),
        ];
        if let Some(u) = &self.user {
            args.push(format!("--uid={}", u.uid));
            args.push(format!("--gid={}", u.gid));
        }
        for (i, c) in components.into_iter().enumerate() {
            if i > 0 {
                args.push(":".into());
            }
            args.extend(c);
        }
        args.push(path.display().to_string());
        let t0 = Instant::now();
        let out = run(&self.bins.sbatch, &args, &format!("submitting {name} to Slurm"))?;
        if !out.status.success() {
            return Err(ExecError::BadTask(format!("sbatch refused {name}: {}", stderr_line(&out))));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let id = text.trim().split(';').next().unwrap_or("").trim().to_owned();
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ExecError::Unavailable(format!("sbatch answered no job id for {name}: {:?}", text.trim())));
        }
        tracing::info!(
            job = %first.job_id,
            attempt = first.attempt,
            slurm_job = %id,
            nodes = %nodes.iter().map(|(n, r)| format!("{n}×{}", r.len())).collect::<Vec<_>>().join(","),
            ms = t0.elapsed().as_millis() as u64,
            "submitted the gang to Slurm"
        );
        self.ran_on
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(first.job_id.clone())
            .or_default()
            .extend(nodes.iter().map(|(n, _)| n.clone()));
        let started = now_ms();
        Ok(launches
            .iter()
            .map(|l| Task {
                job_id: l.job_id.clone(),
                attempt: l.attempt,
                rank: l.rank as i64,
                host: l.node.clone(),
                pid: None,
                worker_pid: None,
                start_ticks: None,
                cpus: String::new(),
                gpus: l.gpus.iter().map(|(i, _)| i.to_string()).collect::<Vec<_>>().join(","),
                started_ms: Some(started),
                external_id: Some(id.clone()),
            })
            .collect())
    }

    /// `scancel` with `args` for job `id`, logged when it fails (a stop has no result to report).
    fn scancel(&self, id: &str, args: &[&str]) -> bool {
        let mut a: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
        a.push(id.to_owned());
        match run(&self.bins.scancel, &a, &format!("scancel {id}")) {
            Ok(out) if out.status.success() => true,
            Ok(out) => {
                tracing::warn!(slurm_job = id, ?args, error = %stderr_line(&out), "scancel failed");
                false
            }
            Err(e) => {
                tracing::warn!(slurm_job = id, ?args, error = %e, "scancel failed");
                false
            }
        }
    }
}

impl Executor for SlurmExecutor {
    fn host(&self) -> &str {
        &self.host
    }

    fn nodes(&self) -> Result<Option<Vec<NodeInfo>>> {
        let args = ["show".into(), "node".into(), "-o".into()];
        let out = run(&self.bins.scontrol, &args, "asking Slurm for its nodes")?;
        if !out.status.success() {
            return Err(ExecError::Unavailable(format!("scontrol show node: {}", stderr_line(&out))));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let nodes: Vec<NodeInfo> = text.lines().filter_map(parse_node).collect();
        if nodes.is_empty() {
            return Err(ExecError::Config(format!("Slurm has no node that can take jobs: {}", text.trim())));
        }
        let mut addrs = self.addrs.lock().unwrap_or_else(|p| p.into_inner());
        for n in &nodes {
            addrs.insert(n.name.clone(), n.host.clone());
        }
        Ok(Some(nodes))
    }

    /// Rank 0's node, at the address Slurm reaches it by, and a port drawn at random (rank 0 binds it there; a
    /// port taken meanwhile fails the attempt, which restarts by its policy).
    fn rendezvous(&self, _job: &str, _attempt: i64, node: &str) -> Result<String> {
        let addr = self.node_addr(node)?;
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        let span = u64::from(RENDEZVOUS_PORTS.end - RENDEZVOUS_PORTS.start);
        let port = RENDEZVOUS_PORTS.start + (h.finish() % span) as u16;
        Ok(format!("{addr}:{port}"))
    }

    fn task_dir(&self, dir: &Path) -> Result<()> {
        task_dir_for(dir, self.user.as_ref())
    }

    fn give(&self, path: &Path) -> Result<()> {
        give_to(path, self.user.as_ref())
    }

    /// A gang of one, or a newcomer to a running group (an allocation of its own); larger gangs start together
    /// ([`Executor::start_gang`]).
    fn start(&self, launch: &TaskLaunch) -> Result<Task> {
        if launch.world_size != 1 && launch.join.is_none() {
            return Err(ExecError::BadTask(format!(
                "job {}: the Slurm executor starts a gang's {} ranks together, not one by one",
                launch.job_id, launch.world_size
            )));
        }
        self.submit(std::slice::from_ref(launch))?
            .pop()
            .ok_or_else(|| ExecError::BadTask("sbatch started no task".into()))
    }

    /// One `sbatch` for the whole gang: all its ranks start, or none.
    fn start_gang(&self, launches: &[TaskLaunch]) -> std::result::Result<Vec<Task>, GangError> {
        self.submit(launches).map_err(|error| GangError { started: Vec::new(), rank: 0, error })
    }

    /// A newcomer gets an allocation of its own, its step started like a gang's.
    fn joins_in_place(&self) -> bool {
        true
    }

    fn describe(&self, task: &Task) -> String {
        format!("on {} (Slurm job {})", task.host, task.external_id.as_deref().unwrap_or("?"))
    }

    fn probe(&self, task: &Task) -> Result<TaskStatus> {
        let Some(id) = task.external_id.as_deref() else {
            return Ok(TaskStatus::Lost("no Slurm job was recorded for it".into()));
        };
        let info = self.job(id)?;
        let exit = self.exit_path(&task.job_id, task.attempt, task.rank);
        let files = RankFiles {
            exit: Self::read_code(&exit),
            srun: Self::read_code(
                &self.attempt_dir(&task.job_id, task.attempt).join(format!("rank-{}.srun", task.rank)),
            ),
        };
        let err =
            if files.exit.is_none() { self.batch_err(&task.job_id, task.attempt, task.rank) } else { String::new() };
        Ok(judge(id, task.rank, info.as_ref(), files, &err))
    }

    /// Signals the task's whole allocation: Shoal stops a gang whole, so the calls for its other ranks are one.
    fn stop(&self, task: &Task, how: Stop) {
        let Some(id) = task.external_id.as_deref() else { return };
        {
            let mut stops = self.stops.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((at, h)) = stops.get(id)
                && *h == how
                && at.elapsed() < STOP_REPEAT
            {
                return;
            }
            stops.retain(|_, (at, _)| at.elapsed() < STOP_REPEAT);
            stops.insert(id.to_owned(), (Instant::now(), how));
        }
        tracing::info!(slurm_job = id, job = %task.job_id, ?how, "stopping the Slurm job");
        // TERM goes to the steps only (the batch script waits for them), and only to a job that runs: scancel
        // waits for a pending job to start before it signals it. Anything else is cancelled outright.
        let running = match self.job(id) {
            Ok(Some(info)) if info.is_final() => {
                self.forget(id);
                return;
            }
            Ok(Some(info)) => info.state == "RUNNING",
            Ok(None) => return,
            Err(_) => false,
        };
        if how == Stop::Term && running {
            self.scancel(id, &["--signal=TERM"]);
        } else {
            self.scancel(id, &[]);
        }
        self.forget(id);
    }

    /// Slurm here gathers no accounting (`sstat`): unknown.
    fn usage(&self, _task: &Task) -> Option<Usage> {
        None
    }

    fn adopt(&self, task: &Task) {
        tracing::info!(job = %task.job_id, rank = task.rank, slurm_job = ?task.external_id, "adopted a Slurm task");
    }

    /// Active Slurm jobs named `shoal-*` that run in this server's data directory and that no adopted task owns.
    fn strays(&self, adopted: &[Task]) -> Vec<Stray> {
        let owned: HashSet<&str> = adopted.iter().filter_map(|t| t.external_id.as_deref()).collect();
        let args = ["--noheader".into(), "--format=%i|%j|%Z".into()];
        let out = match run(&self.bins.squeue, &args, "listing Slurm's jobs") {
            Ok(out) if out.status.success() => out,
            Ok(out) => {
                tracing::warn!(error = %stderr_line(&out), "cannot list Slurm's jobs for strays");
                return Vec::new();
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot list Slurm's jobs for strays");
                return Vec::new();
            }
        };
        let mine = self.data_dir.join("jobs");
        let mut seen = HashSet::new();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let mut f = l.splitn(3, '|');
                // A heterogeneous job's components are `ID+N`.
                let id = f.next()?.trim().split('+').next()?.to_owned();
                let name = f.next()?.trim();
                let dir = f.next()?.trim();
                let job_id = name.strip_prefix(NAME_PREFIX)?.rsplit_once('-')?.0.to_owned();
                let pid = id.parse::<i64>().ok()?;
                (Path::new(dir).starts_with(&mine) && !owned.contains(id.as_str()) && seen.insert(pid)).then(|| Stray {
                    pid,
                    owner: 0,
                    job_id,
                    what: format!("Slurm job {id}"),
                })
            })
            .collect()
    }

    fn kill_stray(&self, stray: &Stray) {
        self.scancel(&stray.pid.to_string(), &[]);
    }

    fn log_path(&self, job: &str, attempt: i64, rank: i64) -> PathBuf {
        self.attempt_dir(job, attempt).join(format!("rank-{rank}.log"))
    }

    /// Removes the job's in-memory checkpoints on the nodes it ran on (every node, when this server did not start
    /// it): a small Slurm job per node (1 CPU, 16 MiB, one minute), since only Slurm reaches the nodes. Submitted,
    /// not awaited: a busy node takes it when it can. A failure is logged; the copies then stay until the node
    /// restarts.
    fn job_ended(&self, job: &str) {
        let Some(dir) = shoal_spec::memory_checkpoint_dir(job) else { return };
        let nodes: Vec<String> = match self.ran_on.lock().unwrap_or_else(|p| p.into_inner()).remove(job) {
            Some(n) => n.into_iter().collect(),
            None => self.addrs.lock().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect(),
        };
        for node in nodes {
            let mut args = vec![
                "--parsable".into(),
                format!("--job-name={NAME_PREFIX}clean"),
                "--chdir=/".into(),
                "--output=/dev/null".into(),
                "--no-requeue".into(),
                format!("--nodelist={node}"),
                "--nodes=1".into(),
                "--ntasks=1".into(),
                "--cpus-per-task=1".into(),
                "--mem=16M".into(),
                "--time=1".into(),
            ];
            if let Some(u) = &self.user {
                args.push(format!("--uid={}", u.uid));
                args.push(format!("--gid={}", u.gid));
            }
            args.push(format!("--wrap=/bin/rm -rf {}", sh_quote(&dir.display().to_string())));
            match run(&self.bins.sbatch, &args, &format!("cleaning job {job}'s in-memory checkpoints on {node}")) {
                Ok(out) if out.status.success() => {
                    tracing::info!(job, node, dir = %dir.display(), "asked Slurm to remove the job's in-memory checkpoints")
                }
                Ok(out) => tracing::warn!(
                    job,
                    node,
                    "sbatch refused the clean-up of in-memory checkpoints: {}",
                    stderr_line(&out)
                ),
                Err(e) => tracing::warn!(job, node, "the clean-up of in-memory checkpoints: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUNNING: &str = "JobId=17 JobName=shoal-j-1-1 UserId=shoal(999) JobState=RUNNING Reason=None \
                           Dependency=(null) ExitCode=0:0 RunTime=00:00:03 TimeLimit=UNLIMITED NodeList=n[1-2] \
                           BatchHost=n1 Command=/tmp/a b/batch.sh";

    fn info(state: &str, reason: &str) -> JobInfo {
        JobInfo {
            state: state.into(),
            reason: reason.into(),
            exit_code: "0:0".into(),
            time_limit: "00:01:00".into(),
            nodes: "n[1-2]".into(),
        }
    }

    #[test]
    fn scontrol_lines_parse() {
        let i = JobInfo::parse(RUNNING).expect("a job");
        assert_eq!((i.state.as_str(), i.reason.as_str(), i.nodes.as_str()), ("RUNNING", "None", "n[1-2]"));
        assert_eq!(fields(RUNNING).get("Command").map(String::as_str), Some("/tmp/a b/batch.sh"));
        // A heterogeneous job: the component still running tells.
        let het = "JobId=8 HetJobId=8 HetJobOffset=0 JobState=COMPLETED Reason=None ExitCode=0:0\n\
                   JobId=9 HetJobId=8 HetJobOffset=1 JobState=RUNNING Reason=None ExitCode=0:0";
        assert_eq!(JobInfo::parse(het).map(|i| i.state), Some("RUNNING".into()));
        assert_eq!(JobInfo::parse("nothing here"), None);
    }

    #[test]
    fn ranks_are_judged_by_their_files_and_slurm() {
        let f = |exit, srun| RankFiles { exit, srun };
        let run = info("RUNNING", "None");
        assert_eq!(judge("17", 0, Some(&run), f(None, None), ""), TaskStatus::Running);
        // A success waits for the allocation's end; a failure does not.
        assert_eq!(judge("17", 0, Some(&run), f(Some(0), None), ""), TaskStatus::Running);
        assert_eq!(judge("17", 0, Some(&run), f(Some(3), None), ""), TaskStatus::Exited(3));
        assert!(matches!(judge("17", 1, Some(&run), f(None, Some(1)), "srun: error: boom"),
            TaskStatus::Lost(w) if w.contains("srun status 1") && w.contains("boom")));
        let done = info("COMPLETED", "None");
        assert_eq!(judge("17", 0, Some(&done), f(Some(0), None), ""), TaskStatus::Exited(0));
        assert_eq!(judge("17", 0, Some(&info("COMPLETING", "None")), f(Some(143), None), ""), TaskStatus::Running);
        // Slurm's own reasons win over the status its kill left.
        let t = judge("17", 0, Some(&info("TIMEOUT", "TimeLimit")), f(Some(143), None), "");
        assert!(
            matches!(&t, TaskStatus::Lost(w) if w.contains("TIMEOUT") && w.contains("00:01:00") && w.contains("TimeLimit")),
            "{t:?}"
        );
        let t = judge("17", 0, Some(&info("NODE_FAIL", "NodeDown")), f(None, None), "");
        assert!(matches!(&t, TaskStatus::Lost(w) if w.contains("NODE_FAIL")), "{t:?}");
        assert_eq!(judge("17", 0, Some(&info("TIMEOUT", "TimeLimit")), f(Some(0), None), ""), TaskStatus::Exited(0));
        let t = judge("17", 0, Some(&info("FAILED", "NonZeroExitCode")), f(None, None), "");
        assert!(matches!(&t, TaskStatus::Lost(w) if w.contains("FAILED") && w.contains("NonZeroExitCode")), "{t:?}");
        // Forgotten by Slurm: the files alone tell.
        assert_eq!(judge("17", 0, None, f(Some(2), None), ""), TaskStatus::Exited(2));
        assert!(
            matches!(judge("17", 0, None, f(None, None), ""), TaskStatus::Lost(w) if w.contains("no longer knows"))
        );
    }

    #[test]
    fn nodes_parse_with_their_gpus_and_state() {
        let n = parse_node(
            "NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=4 CPUTot=4 Gres=gpu:a100:2(S:0) \
             NodeAddr=10.214.0.1 NodeHostName=n1 RealMemory=10847 State=IDLE ThreadsPerCore=1",
        )
        .expect("a node");
        assert_eq!(
            n,
            NodeInfo {
                name: "n1".into(),
                host: "10.214.0.1".into(),
                cpus_milli: 4000,
                memory_bytes: 10847 << 20,
                gpus: 2,
                gpu_kind: "a100".into()
            }
        );
        assert_eq!(gres_gpus("(null)"), (0, String::new()));
        assert_eq!(gres_gpus("gpu:4,mps:100"), (4, String::new()));
        assert!(parse_node("NodeName=n2 CPUTot=4 RealMemory=1 State=DOWN+NOT_RESPONDING").is_none());
        assert!(parse_node("NodeName=n2 CPUTot=4 RealMemory=1 State=IDLE*").is_none());
    }

    fn launch(rank: usize, world: usize, node: &str) -> TaskLaunch {
        TaskLaunch {
            join: None,
            job_id: "j-00000001".into(),
            attempt: 1,
            rank,
            world_size: world,
            secret: "s3cr'et".into(),
            rendezvous: "10.214.0.1:23456".into(),
            argv: vec!["/bin/shoal".into(), "worker".into()],
            cpus_milli: 1500,
            memory_bytes: 1 << 30,
            gpus: Vec::new(),
            node: node.into(),
            env: vec![("FOO".into(), "a b,c".into())],
            queue: "default".into(),
            server: Some("http://10.214.0.1:8080".into()),
            server_ca: None,
        }
    }

    #[test]
    fn an_even_layout_is_one_job_an_uneven_one_a_heterogeneous_job() {
        let ask = Ask::of(&launch(0, 2, "n1"));
        assert_eq!(ask, Ask { cpus: 2, mem_mib: 1024, gpus: 0 });
        let even = layout(&[launch(0, 2, "n1"), launch(1, 2, "n2")]);
        let (c, g) = allocation_args(&even, ask);
        assert_eq!(c.len(), 1);
        assert!(c[0].contains(&"--nodes=2".into()) && c[0].contains(&"--ntasks-per-node=1".into()), "{c:?}");
        assert!(c[0].contains(&"--nodelist=n1,n2".into()) && c[0].contains(&"--mem=1024M".into()), "{c:?}");
        assert_eq!(g, vec![None, None]);
        let uneven = layout(&[launch(0, 3, "n1"), launch(1, 3, "n2"), launch(2, 3, "n1")]);
        assert_eq!(uneven, vec![("n1".into(), vec![0, 2]), ("n2".into(), vec![1])]);
        let (c, g) = allocation_args(&uneven, ask);
        assert_eq!(c.len(), 2);
        assert!(c[0].contains(&"--ntasks=2".into()) && c[0].contains(&"--mem=2048M".into()), "{c:?}");
        assert_eq!(g, vec![Some(0), Some(1), Some(0)]);
    }

    #[test]
    fn the_script_quotes_the_contract_and_pins_each_rank() {
        // Made-up paths: the rendering is tested, nothing runs.
        let exec = SlurmExecutor {
            data_dir: "/data".into(),
            host: "h".into(),
            user: None,
            bins: Bins {
                sbatch: "/x/sbatch".into(),
                squeue: "/x/squeue".into(),
                scontrol: "/x/scontrol".into(),
                scancel: "/x/scancel".into(),
                srun: "/x/srun".into(),
            },
            addrs: Mutex::new(HashMap::new()),
            jobs: Mutex::new(HashMap::new()),
            stops: Mutex::new(HashMap::new()),
            ran_on: Mutex::new(HashMap::new()),
        };
        let ls = [launch(0, 2, "n1"), launch(1, 2, "n2")];
        let s = exec.script(&ls, &[None, None]).expect("a script");
        assert!(s.starts_with("#!/bin/sh\n"), "{s}");
        assert!(s.contains("export SHOAL_JOB_SECRET='s3cr'\\''et'\n"), "{s}");
        assert!(s.contains("export SHOAL_RENDEZVOUS_HOST='1'\n"), "{s}");
        assert!(s.contains("export FOO='a b,c'\n"), "{s}");
        assert!(s.contains("'--nodelist=n2'") && s.contains("'--cpus-per-task=2'"), "{s}");
        assert!(s.contains("'/data/jobs/j-00000001/attempt-1/rank-1.exit'"), "{s}");
        assert_eq!(s.matches(") &\n").count(), 2, "{s}");
        assert!(s.ends_with("wait\n"), "{s}");
        let bad = TaskLaunch { env: vec![("A;B".into(), "x".into())], ..launch(0, 1, "n1") };
        assert!(exec.script(&[bad], &[None]).is_err());
    }
}
