//! A scripted executor for the control loop's unit tests: tasks start, run, exit, vanish or refuse to start when
//! the test says so, with no process behind them. The real-process end-to-end tests use [`crate::LocalExecutor`].
//!
//! A task runs until the test ends it ([`FakeExecutor::exit`], [`FakeExecutor::exit_job`],
//! [`FakeExecutor::vanish`]) or it is stopped: [`Stop::Term`] ends it with 143 unless
//! [`FakeExecutor::ignore_term`] was set for its job, [`Stop::Kill`] with 137.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{ExecError, Result};
use crate::executor::{Executor, Fault, NodeInfo, Stop, Stray, Task, TaskLaunch, TaskStatus, Usage};

type Key = (String, i64, i64);

#[derive(Debug, Default)]
struct State {
    next_pid: i64,
    tasks: HashMap<Key, (TaskStatus, Usage)>,
    /// Jobs whose next starts fail, with the reason.
    refuse: HashMap<String, String>,
    ignore_term: HashSet<String>,
    /// Jobs whose tasks cannot be probed, with the reason.
    blind: HashMap<String, String>,
    /// Why no rendezvous can be hosted now, if so.
    no_rendezvous: Option<String>,
    launches: Vec<TaskLaunch>,
    stops: Vec<(Key, Stop)>,
    faults: Vec<(Key, Fault)>,
    adopted: Vec<Key>,
    /// The cluster described to the server, if one was given.
    nodes: Option<Vec<NodeInfo>>,
    /// Tasks tell no usage (a simulation's: nothing runs to measure).
    no_usage: bool,
}

/// See the module documentation.
#[derive(Debug)]
pub struct FakeExecutor {
    logs: PathBuf,
    state: Mutex<State>,
}

impl FakeExecutor {
    /// Task logs (which the fake never writes) would be under `logs`.
    pub fn new(logs: &Path) -> FakeExecutor {
        FakeExecutor { logs: logs.to_path_buf(), state: Mutex::new(State { next_pid: 1000, ..State::default() }) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fake executor whose cluster is `nodes` (what [`Executor::nodes`] describes to the server), as a
    /// simulation of a cluster gives it.
    pub fn with_nodes(logs: &Path, nodes: Vec<NodeInfo>) -> FakeExecutor {
        let fake = FakeExecutor::new(logs);
        fake.state().nodes = Some(nodes);
        fake
    }

    /// From now on tasks tell no usage, as an executor that cannot measure them: the server then samples nothing
    /// (a simulation's tasks have nothing to measure).
    pub fn tell_no_usage(&self) {
        self.state().no_usage = true;
    }

    /// How many tasks of each job run now (jobs with none are left out).
    pub fn running_counts(&self) -> HashMap<String, u32> {
        let mut out: HashMap<String, u32> = HashMap::new();
        for (k, (s, _)) in &self.state().tasks {
            if *s == TaskStatus::Running {
                *out.entry(k.0.clone()).or_default() += 1;
            }
        }
        out
    }

    /// Forgets the tasks of `job` that ended, and what was asked of them (a long simulation's jobs that finished).
    pub fn forget(&self, job: &str) {
        let mut st = self.state();
        st.tasks.retain(|k, (s, _)| k.0 != job || *s == TaskStatus::Running);
        st.launches.retain(|l| l.job_id != job);
        st.stops.retain(|(k, _)| k.0 != job);
    }

    /// Every task start asked for so far, in order.
    pub fn launches(&self) -> Vec<TaskLaunch> {
        self.state().launches.clone()
    }

    /// How many tasks of `job` were started (all attempts).
    pub fn started(&self, job: &str) -> usize {
        self.state().launches.iter().filter(|l| l.job_id == job).count()
    }

    /// The stops sent to `job`'s tasks: `(attempt, rank, how)`.
    pub fn stops(&self, job: &str) -> Vec<(i64, i64, Stop)> {
        self.state().stops.iter().filter(|(k, _)| k.0 == job).map(|(k, s)| (k.1, k.2, *s)).collect()
    }

    /// The faults injected into `job`'s tasks: `(attempt, rank, fault)`.
    pub fn faults(&self, job: &str) -> Vec<(i64, i64, Fault)> {
        self.state().faults.iter().filter(|(k, _)| k.0 == job).map(|(k, f)| (k.1, k.2, *f)).collect()
    }

    /// Tasks that were adopted: `(job, attempt, rank)`.
    pub fn adopted(&self) -> Vec<(String, i64, i64)> {
        self.state().adopted.clone()
    }

    /// Starts of `job`'s tasks fail from now on, saying `why`.
    pub fn refuse_starts(&self, job: &str, why: &str) {
        self.state().refuse.insert(job.to_owned(), why.to_owned());
    }

    /// Probes of `job`'s tasks fail from now on, saying `why` (a cluster manager that does not answer).
    pub fn fail_probes(&self, job: &str, why: &str) {
        self.state().blind.insert(job.to_owned(), why.to_owned());
    }

    /// Probes of `job`'s tasks answer again.
    pub fn heal_probes(&self, job: &str) {
        self.state().blind.remove(job);
    }

    /// [`Executor::rendezvous`] fails saying `why` (`None`: it answers again).
    pub fn refuse_rendezvous(&self, why: Option<&str>) {
        self.state().no_rendezvous = why.map(str::to_owned);
    }

    /// `job`'s tasks ignore [`Stop::Term`].
    pub fn ignore_term(&self, job: &str) {
        self.state().ignore_term.insert(job.to_owned());
    }

    /// The running tasks of `job`: `(attempt, rank)`.
    pub fn running(&self, job: &str) -> Vec<(i64, i64)> {
        let mut v: Vec<(i64, i64)> = self
            .state()
            .tasks
            .iter()
            .filter(|(k, (s, _))| k.0 == job && *s == TaskStatus::Running)
            .map(|(k, _)| (k.1, k.2))
            .collect();
        v.sort_unstable();
        v
    }

    /// Ends `job`'s running task at `rank` with `code`; false when there is none.
    pub fn exit(&self, job: &str, rank: i64, code: i32) -> bool {
        self.end(job, Some(rank), TaskStatus::Exited(code))
    }

    /// Ends every running task of `job` with `code`.
    pub fn exit_job(&self, job: &str, code: i32) -> bool {
        self.end(job, None, TaskStatus::Exited(code))
    }

    /// A running task of `job` disappears without an exit status.
    pub fn vanish(&self, job: &str, rank: i64) -> bool {
        self.end(job, Some(rank), TaskStatus::Lost("vanished (fake executor)".into()))
    }

    /// Sets what a running task of `job` uses.
    pub fn set_usage(&self, job: &str, rank: i64, usage: Usage) {
        for (k, (s, u)) in self.state().tasks.iter_mut() {
            if k.0 == job && k.2 == rank && *s == TaskStatus::Running {
                *u = usage;
            }
        }
    }

    fn end(&self, job: &str, rank: Option<i64>, to: TaskStatus) -> bool {
        let mut any = false;
        for (k, (s, _)) in self.state().tasks.iter_mut() {
            if k.0 == job && rank.is_none_or(|r| r == k.2) && *s == TaskStatus::Running {
                *s = to.clone();
                any = true;
            }
        }
        any
    }
}

fn key(t: &Task) -> Key {
    (t.job_id.clone(), t.attempt, t.rank)
}

impl Executor for FakeExecutor {
    fn host(&self) -> &str {
        "fake-host"
    }

    fn nodes(&self) -> Result<Option<Vec<NodeInfo>>> {
        Ok(self.state().nodes.clone())
    }

    fn rendezvous(&self, _job: &str, _attempt: i64, node: &str) -> Result<String> {
        match &self.state().no_rendezvous {
            Some(why) => Err(ExecError::Unavailable(why.clone())),
            None => Ok(format!("{node}:29400")),
        }
    }

    /// A real directory: the control plane writes the job's spec there.
    fn task_dir(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| ExecError::io(format!("creating {}", dir.display()), e))
    }

    /// The file must exist, as for a real executor.
    fn give(&self, path: &Path) -> Result<()> {
        std::fs::metadata(path).map(drop).map_err(|e| ExecError::io(format!("handing over {}", path.display()), e))
    }

    fn start(&self, l: &TaskLaunch) -> Result<Task> {
        let mut st = self.state();
        st.launches.push(l.clone());
        if let Some(why) = st.refuse.get(&l.job_id) {
            return Err(ExecError::Config(format!("rank {}: {why}", l.rank)));
        }
        st.next_pid += 1;
        let pid = st.next_pid;
        let t = Task {
            job_id: l.job_id.clone(),
            attempt: l.attempt,
            rank: l.rank as i64,
            host: "fake-host".into(),
            pid: Some(pid),
            worker_pid: Some(pid + 100_000),
            start_ticks: Some(pid),
            cpus: String::new(),
            gpus: l.gpus.iter().map(|(i, _)| i.to_string()).collect::<Vec<_>>().join(","),
            started_ms: Some(0),
            external_id: None,
        };
        st.tasks.insert(
            key(&t),
            (TaskStatus::Running, Usage { rss_bytes: 1 << 20, cpu_seconds: 0.0, gpu_memory_bytes: None }),
        );
        Ok(t)
    }

    fn probe(&self, t: &Task) -> Result<TaskStatus> {
        let st = self.state();
        if let Some(why) = st.blind.get(&t.job_id) {
            return Err(ExecError::Unavailable(format!("probing rank {}: {why}", t.rank)));
        }
        Ok(match st.tasks.get(&key(t)) {
            Some((s, _)) => s.clone(),
            None => TaskStatus::Lost("never started by this executor".into()),
        })
    }

    fn stop(&self, t: &Task, how: Stop) {
        let mut st = self.state();
        st.stops.push((key(t), how));
        let ignores = how == Stop::Term && st.ignore_term.contains(&t.job_id);
        if let Some((s, _)) = st.tasks.get_mut(&key(t))
            && *s == TaskStatus::Running
            && !ignores
        {
            *s = TaskStatus::Exited(128 + how.signal());
        }
    }

    /// A kill ends the task with 137; a pause leaves it running (the test then plays the hang with heartbeats).
    fn inject(&self, t: &Task, fault: Fault) -> Result<String> {
        let mut st = self.state();
        st.faults.push((key(t), fault));
        match st.tasks.get_mut(&key(t)) {
            Some((s, _)) if *s == TaskStatus::Running => {
                if fault == Fault::Kill {
                    *s = TaskStatus::Exited(137);
                }
                Ok(format!("{} to fake rank {}", fault.signal_name(), t.rank))
            }
            _ => Err(ExecError::BadTask(format!("rank {} is not running", t.rank))),
        }
    }

    fn usage(&self, t: &Task) -> Option<Usage> {
        let st = self.state();
        if st.no_usage {
            return None;
        }
        match st.tasks.get(&key(t)) {
            Some((TaskStatus::Running, u)) => Some(*u),
            _ => None,
        }
    }

    fn adopt(&self, t: &Task) {
        self.state().adopted.push(key(t));
    }

    fn strays(&self, _adopted: &[Task]) -> Vec<Stray> {
        Vec::new()
    }

    fn kill_stray(&self, _stray: &Stray) {}

    fn log_path(&self, job: &str, attempt: i64, rank: i64) -> PathBuf {
        self.logs.join(format!("{job}-{attempt}-rank-{rank}.log"))
    }
}
