//! The `Executor` trait: what the control loop asks of whatever runs its tasks (this machine's processes, a Slurm
//! cluster's allocations; Kubernetes pods behind the same calls), and the types that cross it.

use std::path::{Path, PathBuf};
use std::process::Command;

use shoal_comm::env::TaskEnv;

use crate::error::Result;

/// Everything one task needs to start.
#[derive(Debug, Clone, Default)]
pub struct TaskLaunch {
    pub job_id: String,
    pub attempt: i64,
    pub rank: usize,
    pub world_size: usize,
    pub secret: String,
    /// `host:port` that rank 0 hosts the job's rendezvous store at ([`Executor::rendezvous`]).
    pub rendezvous: String,
    /// The program and its arguments.
    pub argv: Vec<String>,
    pub cpus_milli: u64,
    pub memory_bytes: u64,
    /// `(gpu index, share in thousandths)`.
    pub gpus: Vec<(u32, u32)>,
    /// The node the scheduler placed the task on.
    pub node: String,
    /// The job's own `[env]` (and its team's storage credentials).
    pub env: Vec<(String, String)>,
    /// The job's queue (a cluster manager with queues of its own may be told: Kueue's label on a Pod).
    pub queue: String,
    /// The control plane's URL as the task reaches it, for its heartbeats, and the certificates to trust for it
    /// (`SHOAL_SERVER`, `SHOAL_SERVER_CA`); `None`: the task reports through files only.
    pub server: Option<String>,
    pub server_ca: Option<String>,
    /// A task that joins its job's running group in place ([`Executor::joins_in_place`]) instead of starting with
    /// its attempt: `rank` is then the task's own number among the attempt's tasks.
    pub join: Option<Join>,
}

impl TaskLaunch {
    /// The seat the task takes: its rank, the world size and the rendezvous store of the group it meets first — a
    /// running group it joins in place ([`TaskLaunch::join`]), else its attempt's first group.
    pub fn seat(&self) -> (usize, usize, &str) {
        match &self.join {
            Some(j) => (j.rank, j.world_size, j.rendezvous.as_str()),
            None => (self.rank, self.world_size, self.rendezvous.as_str()),
        }
    }
}

/// Where a task that joins a running group sits in it: the group's generation, its rank and size there, and the
/// rendezvous store the group meets at (hosted by the control plane, not by a rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Join {
    pub generation: u32,
    pub rank: usize,
    pub world_size: usize,
    pub rendezvous: String,
}

/// The exit status of a worker that stopped at a step boundary with a checkpoint there (on a SIGTERM, or at the end
/// of a `[[phases]]` phase): not a failure by itself, and not the end of the run (EX_TEMPFAIL: it resumes there).
pub const STOPPED_EXIT: i32 = 75;

/// The `sh -c` script that runs a task's program (`$2...`) and records how it ended in the file `$1`: the program's
/// PID in `$1.pid` at once, its exit status in `$1` (written to `$1.tmp` and renamed) once it is gone. A SIGTERM or
/// SIGINT sent to the whole task (its process group, or Slurm's step) does not end the wrapper before the program:
/// the program gets the signal itself (its disposition is the default again after `exec`) and may take its time — a
/// worker finishes its step and checkpoints — while the wrapper waits on, so the status is always recorded and the
/// task is never taken for ended while its program still runs.
pub const EXIT_WRAPPER: &str = "f=$1; shift; \"$@\" & w=$!; printf '%s' \"$w\" > \"$f.pid\"; trap : TERM INT; while :; \
                                do wait \"$w\"; c=$?; kill -0 \"$w\" 2>/dev/null || break; done; printf '%s' \"$c\" > \
                                \"$f.tmp\" && /bin/mv \"$f.tmp\" \"$f\"; exit $c";

/// A started task as its executor identifies it; the control plane stores these fields with the task and hands
/// them back to probe, signal, sample or adopt it, also after its own restart.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Task {
    pub job_id: String,
    pub attempt: i64,
    pub rank: i64,
    /// The host the task runs on.
    pub host: String,
    /// The process the executor watches (the local executor: the exit-status wrapper, leader of the task's session).
    pub pid: Option<i64>,
    /// The training process itself (what a user signals or attaches a debugger to).
    pub worker_pid: Option<i64>,
    /// The watched process's start time, so that a reused PID is never taken for the task.
    pub start_ticks: Option<i64>,
    /// CPUs the task is pinned to (`0-3,6`; empty: not pinned).
    pub cpus: String,
    /// GPUs the task sees (`0,1`).
    pub gpus: String,
    /// When it started (ms since the epoch).
    pub started_ms: Option<i64>,
    /// The cluster manager's own id of what runs the task (the Slurm executor: the Slurm job id of its gang's
    /// allocation), `None` for the local executor.
    pub external_id: Option<String>,
}

/// A gang start that failed: the tasks that did start (the caller stops them and waits until they are gone), the
/// rank that could not, and why.
#[derive(Debug)]
pub struct GangError {
    pub started: Vec<Task>,
    pub rank: usize,
    pub error: crate::error::ExecError,
}

/// A node of a cluster an executor runs tasks on, with what it offers to jobs (for the scheduler's model).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// The name tasks are placed by ([`TaskLaunch::node`]).
    pub name: String,
    /// Its address or host name, as the cluster manager knows it.
    pub host: String,
    pub cpus_milli: u64,
    pub memory_bytes: u64,
    pub gpus: u32,
    /// The GPUs' kind (`gpu` when the cluster manager does not say).
    pub gpu_kind: String,
}

/// What became of a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskStatus {
    Running,
    /// Exited with this status (128 + N when killed by signal N, as a shell reports it).
    Exited(i32),
    /// Gone without a recorded status.
    Lost(String),
}

/// How a task is asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Stop cleanly (SIGTERM; a checkpoint may be written).
    Term,
    /// Stop now (SIGKILL).
    Kill,
}

impl Stop {
    pub fn signal(self) -> i32 {
        match self {
            Stop::Term => libc::SIGTERM,
            Stop::Kill => libc::SIGKILL,
        }
    }
}

/// A fault injected into one task on purpose (`shoal chaos`): what happens to its training process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL: it dies as in a crash.
    Kill,
    /// SIGSTOP: it lives and does nothing, as in a hang.
    Pause,
}

impl Fault {
    pub fn signal_name(self) -> &'static str {
        match self {
            Fault::Kill => "SIGKILL",
            Fault::Pause => "SIGSTOP",
        }
    }
}

/// What a task's processes use now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub rss_bytes: u64,
    pub cpu_seconds: f64,
    /// GPU memory its processes hold, when the executor can tell; otherwise the server asks NVML (feature `nvml`)
    /// for the processes of the task's session on its GPUs.
    pub gpu_memory_bytes: Option<u64>,
}

/// Something an executor started that no task it was told about owns (left by a crash between a start and its
/// record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stray {
    /// The process (the local executor) or the cluster manager's job (the Slurm executor's job id).
    pub pid: i64,
    /// The task's handle it belongs to ([`Task::pid`]: the session for the local executor; 0 when none).
    pub owner: i64,
    pub job_id: String,
    /// What it is, for logs and events (`process 4242`, `Slurm job 17`).
    pub what: String,
}

/// Runs a job's tasks. Implementations: [`crate::LocalExecutor`] (this machine's processes),
/// [`crate::SlurmExecutor`] (a Slurm cluster's allocations); with the `kubernetes` feature,
/// `KubeExecutor` (Pods through a Kubernetes API server); with the `fake` feature, `FakeExecutor` (scripted, for
/// the control loop's tests). Every call is quick and never waits on a task: the control loop calls them every tick
/// for every task.
pub trait Executor: Send + Sync + std::fmt::Debug {
    /// The host the executor starts tasks from (shown with a task until it has started).
    fn host(&self) -> &str;

    /// The nodes tasks run on, with what each offers, when the executor has a cluster of its own to describe
    /// (read once, when the server starts); `None`: this host alone, as the server's options describe it.
    fn nodes(&self) -> Result<Option<Vec<NodeInfo>>> {
        Ok(None)
    }

    /// Where rank 0 of attempt `attempt` of job `job`, placed on `node`, hosts the job's rendezvous store
    /// (`host:port`), reachable from every rank.
    fn rendezvous(&self, job: &str, attempt: i64, node: &str) -> Result<String>;

    /// Creates `dir` (and its parents) for a job's tasks to write in, theirs alone.
    fn task_dir(&self, dir: &Path) -> Result<()>;

    /// Hands a file the control plane wrote over to the tasks (their spec).
    fn give(&self, path: &Path) -> Result<()>;

    /// Starts one task, with the environment contract.
    fn start(&self, launch: &TaskLaunch) -> Result<Task>;

    /// Whether [`Executor::start`] honours [`TaskLaunch::join`]: a task started into a running job's group in place
    /// (by default not: the job then grows by a restart at its new size).
    fn joins_in_place(&self) -> bool {
        false
    }

    /// Starts every rank of one attempt (`launches`, in rank order) and gives their handles in the same order. An
    /// executor whose cluster manager allocates a gang at once (Slurm) makes it one request; by default, each task
    /// is started in turn and the first failure ends the start.
    fn start_gang(&self, launches: &[TaskLaunch]) -> std::result::Result<Vec<Task>, GangError> {
        let mut started = Vec::with_capacity(launches.len());
        for l in launches {
            match self.start(l) {
                Ok(t) => started.push(t),
                Err(error) => return Err(GangError { started, rank: l.rank, error }),
            }
        }
        Ok(started)
    }

    /// How a started task is described in the job's events (where it runs and under which identity).
    fn describe(&self, task: &Task) -> String {
        format!("pid {} cpus {}", task.worker_pid.or(task.pid).unwrap_or(0), task.cpus)
    }

    /// Whether the task still runs, how it ended, or that it is lost. A task is over only when everything it
    /// started is gone. An error says the executor cannot tell now (its cluster manager does not answer): never
    /// that the task ended.
    fn probe(&self, task: &Task) -> Result<TaskStatus>;

    /// What the cluster manager says of a task that has not ended and waits for something (a Pod no node can take,
    /// an image that cannot be pulled), for the job's events; `None`: nothing to say.
    fn notes(&self, _task: &Task) -> Option<String> {
        None
    }

    /// Asks the task (everything it started) to stop.
    fn stop(&self, task: &Task, how: Stop);

    /// Injects `fault` into the task on purpose (`shoal chaos`) and says what was done (`SIGKILL to pid 4242`).
    /// What the executor watches sees the result as it would a real fault. By default a kill is
    /// [`Executor::stop`] with [`Stop::Kill`] (the whole task) and a pause is refused; an executor that reaches the
    /// training process itself signals that process alone.
    fn inject(&self, task: &Task, fault: Fault) -> Result<String> {
        match fault {
            Fault::Kill => {
                self.stop(task, Stop::Kill);
                Ok(format!("stopped rank {} with SIGKILL through the executor", task.rank))
            }
            Fault::Pause => {
                Err(crate::error::ExecError::Unsupported("this executor cannot pause (SIGSTOP) a single worker".into()))
            }
        }
    }

    /// What the task uses now (`None`: it has no processes, or the executor cannot tell).
    fn usage(&self, task: &Task) -> Option<Usage>;

    /// Takes over a task found in the store after a restart of the control plane.
    fn adopt(&self, task: &Task);

    /// What this executor started that belongs to none of the `adopted` tasks.
    fn strays(&self, adopted: &[Task]) -> Vec<Stray>;

    /// Kills a stray found by [`Executor::strays`].
    fn kill_stray(&self, stray: &Stray);

    /// The file the task's output (stdout and stderr together) is written to.
    fn log_path(&self, job: &str, attempt: i64, rank: i64) -> PathBuf;

    /// The job ended (succeeded, failed or cancelled) and none of its processes is left: removes what its tasks
    /// leave on their hosts beyond the job's directory — the in-memory checkpoints in `/dev/shm`
    /// (`shoal_spec::memory_checkpoint_dir`). By default nothing: an executor that cannot reach its hosts' shared
    /// memory leaves that to the workers (which remove it when the job succeeds) and to the hosts' restarts.
    fn job_ended(&self, _job: &str) {}
}

/// The one place a task's environment is put together: the contract ([`TaskEnv::vars`], its one writer), then the
/// job's own variables (which may tune thread counts; the contract's own names are refused by the spec), in the
/// order they are to be set.
pub(crate) fn task_env(contract: &TaskEnv, env: &[(String, String)]) -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = contract.vars().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    vars.extend(env.iter().cloned());
    vars
}

/// Sets a local task's environment ([`task_env`]) on its command.
pub(crate) fn set_env(cmd: &mut Command, contract: &TaskEnv, env: &[(String, String)]) {
    cmd.envs(task_env(contract, env));
}
