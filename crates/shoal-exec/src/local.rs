//! The local executor: a job's tasks as child processes of the server, on this machine.
//!
//! - Every task runs in its own session (`setsid`), so a signal to its process group reaches whatever it started,
//!   and it **outlives the server**: a server killed with `kill -9` finds its tasks again when it restarts
//!   ([`Executor::probe`] checks the recorded PID *and* the process' start time, so a reused PID is never mistaken
//!   for a task).
//! - A tiny `sh` wrapper (absolute paths only, whatever the job's `PATH`) starts the training process, writes its
//!   PID to `rank-R.exit.pid` (the task's `worker_pid`; the wrapper, leader of the session, is its `pid`) and
//!   records its exit status in `rank-R.exit` next to its log, so the status of a task that ended while the server
//!   was down is still known; a task that vanished without one is *lost*. (Started in the wrapper's background, the process ignores SIGINT as
//!   every `sh` background job does; the server stops tasks with SIGTERM, then SIGKILL.)
//! - When the server runs as root, tasks run as an unprivileged user ([`TaskUser`]; `--task-user`), in directories
//!   that user owns.
//! - Isolation: the task is pinned to as many whole CPUs as it asked for (rounded up, least-loaded CPUs first, via
//!   `sched_setaffinity` before `exec`), its tensor threads are told the same number (`RAYON_NUM_THREADS`,
//!   `OMP_NUM_THREADS`), it sees only its GPUs (`CUDA_VISIBLE_DEVICES`), and its memory (the RSS of every process
//!   of its session) is watched against its request: over the limit, it is killed with a reason that says so.
//! - Output (stdout and stderr together) goes to `DATA/jobs/ID/attempt-A/rank-R.log`, written by the task itself,
//!   so logs do not depend on the server being up.

use std::collections::{HashMap, HashSet};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use shoal_comm::env::{TaskEnv, var};

use crate::error::{ExecError, Result};
use crate::executor::{Executor, Fault, Stop, Stray, Task, TaskLaunch, TaskStatus, Usage, set_env};
use crate::procfs::{
    cpu_list, hostname, is_zombie, own_cpus, parse_cpu_list, processes_marked, session_alive, session_of,
    session_usage, start_ticks,
};

/// Runs tasks as local processes.
#[derive(Debug)]
pub struct LocalExecutor {
    data_dir: PathBuf,
    host: String,
    /// CPUs this server may use (its own affinity).
    cpus: Vec<usize>,
    /// Children started by this server process, to reap them.
    children: Mutex<HashMap<(String, i64, i64), Child>>,
    /// How many running tasks are pinned to each CPU, by task.
    pinned: Mutex<HashMap<(String, i64, i64), Vec<usize>>>,
    /// Exit statuses of reaped wrappers whose sessions still had processes.
    reaped: Mutex<HashMap<(String, i64, i64), i32>>,
    /// The unprivileged user tasks run as; `None`: as the server's own user.
    user: Option<TaskUser>,
}

/// An account tasks run as: never the server's privileges unless asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// The default task user of a server running as root (created as a system user when missing).
pub const DEFAULT_TASK_USER: &str = "shoal";

impl TaskUser {
    /// Looks `name` up in the user database.
    pub fn lookup(name: &str) -> Option<TaskUser> {
        let c = std::ffi::CString::new(name).ok()?;
        // SAFETY: getpwnam returns a pointer into static storage or null; we copy the fields out at once and this
        // runs before the server starts threads that could call it concurrently.
        unsafe {
            let pw = libc::getpwnam(c.as_ptr());
            if pw.is_null() {
                return None;
            }
            Some(TaskUser { name: name.to_owned(), uid: (*pw).pw_uid, gid: (*pw).pw_gid })
        }
    }

    /// Which user a server's tasks run as. As root: `requested`, by default [`DEFAULT_TASK_USER`] (created as a
    /// system user without a home or a login shell if missing); `root` only when asked for by name (then `None`).
    /// As another user: tasks run as that user, and asking for someone else is an error (no privilege to switch).
    pub fn resolve(requested: Option<&str>) -> Result<Option<TaskUser>> {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if euid != 0 {
            return match requested {
                None => Ok(None),
                Some(n) if TaskUser::lookup(n).is_some_and(|u| u.uid == euid) => Ok(None),
                Some(n) => Err(ExecError::Config(format!(
                    "--task-user {n}: the server runs as uid {euid}, not root, and cannot start tasks as another user"
                ))),
            };
        }
        let name = requested.unwrap_or(DEFAULT_TASK_USER);
        if name == "root" {
            tracing::warn!("tasks run as root (--task-user root): every job runs with the server's privileges");
            return Ok(None);
        }
        if let Some(u) = TaskUser::lookup(name) {
            return TaskUser::checked(u);
        }
        if requested.is_some() {
            return Err(ExecError::Config(format!("--task-user {name}: no such user")));
        }
        let out = Command::new("/usr/sbin/useradd")
            .args(["--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name])
            .output()
            .map_err(|e| ExecError::Config(format!("creating the task user {name} with useradd: {e}")))?;
        // Another server may have created it meanwhile; the lookup decides.
        match TaskUser::lookup(name) {
            Some(u) => {
                tracing::info!(user = name, uid = u.uid, "created the system user tasks run as");
                TaskUser::checked(u)
            }
            None => Err(ExecError::Config(format!(
                "creating the task user {name}: useradd said {}; create it, or name one with --task-user",
                String::from_utf8_lossy(&out.stderr).trim()
            ))),
        }
    }

    fn checked(u: TaskUser) -> Result<Option<TaskUser>> {
        if u.uid == 0 {
            return Err(ExecError::Config(format!(
                "--task-user {}: has uid 0; tasks run as root only with --task-user root",
                u.name
            )));
        }
        Ok(Some(u))
    }
}

fn key(t: &Task) -> (String, i64, i64) {
    (t.job_id.clone(), t.attempt, t.rank)
}

impl LocalExecutor {
    pub fn new(data_dir: &Path, user: Option<TaskUser>) -> LocalExecutor {
        LocalExecutor {
            data_dir: data_dir.to_path_buf(),
            host: hostname(),
            cpus: own_cpus(),
            children: Mutex::new(HashMap::new()),
            pinned: Mutex::new(HashMap::new()),
            reaped: Mutex::new(HashMap::new()),
            user,
        }
    }

    /// The directory of one attempt's logs and exit files.
    pub fn attempt_dir(&self, job: &str, attempt: i64) -> PathBuf {
        self.data_dir.join("jobs").join(job).join(format!("attempt-{attempt}"))
    }

    fn exit_path(&self, job: &str, attempt: i64, rank: i64) -> PathBuf {
        self.attempt_dir(job, attempt).join(format!("rank-{rank}.exit"))
    }

    /// Picks `n` CPUs, least loaded first.
    fn pick_cpus(&self, n: usize) -> Vec<usize> {
        let pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
        let mut load: HashMap<usize, usize> = self.cpus.iter().map(|&c| (c, 0)).collect();
        for cs in pinned.values() {
            for c in cs {
                *load.entry(*c).or_default() += 1;
            }
        }
        let mut order: Vec<usize> = self.cpus.clone();
        order.sort_by_key(|c| (load.get(c).copied().unwrap_or(0), *c));
        order.truncate(n.min(self.cpus.len()));
        order.sort_unstable();
        order
    }

    fn start_task(&self, l: &TaskLaunch) -> Result<Task> {
        let dir = self.attempt_dir(&l.job_id, l.attempt);
        self.task_dir(&dir)?;
        let rank = l.rank as i64;
        let log_path = self.log_path(&l.job_id, l.attempt, rank);
        let exit_path = self.exit_path(&l.job_id, l.attempt, rank);
        let _ = std::fs::remove_file(&exit_path);
        let _ = std::fs::remove_file(format!("{}.pid", exit_path.display()));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| ExecError::io(format!("opening {}", log_path.display()), e))?;
        let err = log.try_clone().map_err(|e| ExecError::io("duplicating the log descriptor", e))?;
        let whole = l.cpus_milli.div_ceil(1000).max(1) as usize;
        let cpus = self.pick_cpus(whole);
        let Some(program) = l.argv.first() else {
            return Err(ExecError::BadTask(format!("job {} rank {}: empty command", l.job_id, l.rank)));
        };
        // A task joining a running group takes its seat there; the others start the attempt's first group.
        let (rank, world, rendezvous) = l.seat();
        let (host, port) = rendezvous.rsplit_once(':').unwrap_or((rendezvous, ""));
        let contract = TaskEnv {
            job_id: l.job_id.clone(),
            rank,
            world_size: world,
            local_rank: rank,
            local_world_size: world,
            rendezvous: rendezvous.to_owned(),
            // No store runs beside the tasks: rank 0 hosts it, at the address the executor picked (a group joined in
            // place meets at the control plane's).
            host_store: l.join.is_none(),
            secret: l.secret.clone(),
            master_addr: host.to_owned(),
            master_port: port.parse().unwrap_or(0),
            attempt: Some(l.attempt),
            exit_file: Some(exit_path.display().to_string()),
            server_data: Some(self.data_dir.display().to_string()),
            server: l.server.clone(),
            server_ca: l.server_ca.clone(),
            threads: Some(cpus.len().max(1)),
            gpus: Some(l.gpus.iter().map(|(i, _)| i.to_string()).collect::<Vec<_>>().join(",")),
            join: l.join.as_ref().map(|j| (j.generation, l.rank)),
        };
        let mut cmd = Command::new("/bin/sh");
        // Absolute paths only: the job's own `PATH` must not decide whether its exit status is recorded.
        cmd.arg("-c")
            .arg(crate::executor::EXIT_WRAPPER)
            .arg("shoal-task")
            .arg(&exit_path)
            .arg(program)
            .args(&l.argv[1..])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .current_dir(&dir);
        if let Some(u) = &self.user {
            cmd.env("HOME", &dir).env("USER", &u.name).env("LOGNAME", &u.name);
        }
        set_env(&mut cmd, &contract, &l.env);
        let mask = cpus.clone();
        let ids = self.user.as_ref().map(|u| (u.uid, u.gid));
        // SAFETY: only async-signal-safe calls (setsid, sched_setaffinity, setgroups, setgid, setuid) between fork
        // and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if !mask.is_empty() {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    for &c in &mask {
                        libc::CPU_SET(c, &mut set);
                    }
                    // Pinning is best effort: a CPU the kernel refuses leaves the inherited mask.
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
                }
                // Drop the server's privileges for good: supplementary groups, then the group, then the user.
                if let Some((uid, gid)) = ids
                    && (libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|source| crate::SpawnError {
            rank: l.rank,
            program: PathBuf::from(program),
            source,
        })?;
        let pid = child.id() as i64;
        let worker_pid = worker_pid_of(&exit_path, std::time::Duration::from_millis(500));
        let row = Task {
            job_id: l.job_id.clone(),
            attempt: l.attempt,
            rank: l.rank as i64,
            host: self.host.clone(),
            pid: Some(pid),
            worker_pid,
            start_ticks: start_ticks(pid),
            cpus: cpu_list(&cpus),
            gpus: l.gpus.iter().map(|(i, _)| i.to_string()).collect::<Vec<_>>().join(","),
            started_ms: Some(now_ms()),
            external_id: None,
        };
        self.children.lock().unwrap_or_else(|p| p.into_inner()).insert(key(&row), child);
        self.pinned.lock().unwrap_or_else(|p| p.into_inner()).insert(key(&row), cpus);
        Ok(row)
    }

    fn adopt_task(&self, t: &Task) {
        self.pinned.lock().unwrap_or_else(|p| p.into_inner()).insert(key(t), parse_cpu_list(&t.cpus));
    }

    /// A task is over only when every process of its session is gone: when the wrapper has ended but something it
    /// started lingers (a worker that ignored SIGTERM, a stray child), the leftovers get SIGKILL and the task counts
    /// as running until they are gone, so nothing of an attempt outlives it.
    fn probe_task(&self, t: &Task) -> TaskStatus {
        let k = key(t);
        // Our own child: reap it (its status is the wrapper's, which is the task's) and remember the status.
        {
            let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(Ok(Some(st))) = children.get_mut(&k).map(|c| c.try_wait()) {
                use std::os::unix::process::ExitStatusExt;
                children.remove(&k);
                let code = st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0));
                self.reaped.lock().unwrap_or_else(|p| p.into_inner()).insert(k.clone(), code);
            }
        }
        let wrapper_alive = match (t.pid, t.start_ticks) {
            (Some(pid), Some(ticks)) => start_ticks(pid) == Some(ticks) && !is_zombie(pid),
            (Some(pid), None) => Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid),
            _ => false,
        };
        if wrapper_alive {
            return TaskStatus::Running;
        }
        if let Some(sid) = t.pid
            && session_alive(sid)
        {
            // SAFETY: plain syscall; the session's processes are in the group the wrapper led.
            unsafe {
                libc::kill(-(sid as i32), libc::SIGKILL);
            }
            return TaskStatus::Running;
        }
        // The exit file may land just after the process is gone.
        let mut code = self.read_exit(t);
        if code.is_none() {
            code = self.reaped.lock().unwrap_or_else(|p| p.into_inner()).get(&k).copied();
        }
        if code.is_none() {
            std::thread::sleep(std::time::Duration::from_millis(20));
            code = self.read_exit(t);
        }
        self.release(&k);
        self.reaped.lock().unwrap_or_else(|p| p.into_inner()).remove(&k);
        match code {
            Some(c) => TaskStatus::Exited(c),
            None => TaskStatus::Lost(format!(
                "process {} ended without recording an exit status",
                t.pid.map_or_else(|| "?".into(), |p| p.to_string())
            )),
        }
    }

    fn read_exit(&self, t: &Task) -> Option<i32> {
        std::fs::read_to_string(self.exit_path(&t.job_id, t.attempt, t.rank)).ok()?.trim().parse().ok()
    }

    fn release(&self, k: &(String, i64, i64)) {
        self.pinned.lock().unwrap_or_else(|p| p.into_inner()).remove(k);
    }

    /// Sends `sig` to the task's whole session (its process group), if it is still the recorded process.
    fn signal(&self, t: &Task, sig: i32) {
        let Some(pid) = t.pid else { return };
        if pid <= 1 {
            return;
        }
        if t.start_ticks.is_some() && start_ticks(pid) != t.start_ticks {
            return;
        }
        // SAFETY: plain syscall; a negative pid addresses the process group the task leads.
        unsafe {
            libc::kill(-(pid as i32), sig);
        }
    }
}

/// Creates `dir` (and its parents) for a job's tasks: owned by the task user (when there is one), mode 0700.
pub(crate) fn task_dir_for(dir: &Path, user: Option<&TaskUser>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ExecError::io(format!("creating {}", dir.display()), e))?;
    give_to(dir, user)?;
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .map_err(|e| ExecError::io(format!("chmod 0700 {}", dir.display()), e))
}

/// Hands a file or directory over to the task user (no-op without one).
pub(crate) fn give_to(path: &Path, user: Option<&TaskUser>) -> Result<()> {
    if let Some(u) = user {
        std::os::unix::fs::chown(path, Some(u.uid), Some(u.gid))
            .map_err(|e| ExecError::io(format!("chown {} to {}", path.display(), u.name), e))?;
    }
    Ok(())
}

/// The training process's PID, which the wrapper writes beside the exit file as soon as it has started it
/// (waiting up to `limit` for it).
fn worker_pid_of(exit_path: &Path, limit: std::time::Duration) -> Option<i64> {
    let path = PathBuf::from(format!("{}.pid", exit_path.display()));
    let t0 = std::time::Instant::now();
    loop {
        if let Some(pid) = std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse::<i64>().ok()) {
            return Some(pid);
        }
        if t0.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

impl Executor for LocalExecutor {
    fn host(&self) -> &str {
        &self.host
    }

    /// Rank 0 hosts the store on loopback, at a port free now: every rank runs here.
    fn rendezvous(&self, _job: &str, _attempt: i64, _node: &str) -> Result<String> {
        let port =
            shoal_comm::env::free_port().map_err(|e| ExecError::io("finding a free port for the rendezvous", e))?;
        Ok(format!("127.0.0.1:{port}"))
    }

    fn task_dir(&self, dir: &Path) -> Result<()> {
        task_dir_for(dir, self.user.as_ref())
    }

    fn give(&self, path: &Path) -> Result<()> {
        give_to(path, self.user.as_ref())
    }

    fn start(&self, launch: &TaskLaunch) -> Result<Task> {
        self.start_task(launch)
    }

    fn joins_in_place(&self) -> bool {
        true
    }

    /// Always answers: `/proc` and the exit files are here.
    fn probe(&self, task: &Task) -> Result<TaskStatus> {
        Ok(self.probe_task(task))
    }

    fn stop(&self, task: &Task, how: Stop) {
        self.signal(task, how.signal());
    }

    /// Signals the training process alone (the wrapper stays and records how it ended), once it is known to be
    /// the task's: its wrapper is the same process as recorded (start time) and it belongs to the wrapper's session.
    fn inject(&self, task: &Task, fault: Fault) -> Result<String> {
        let (Some(pid), Some(worker)) = (task.pid, task.worker_pid) else {
            return Err(ExecError::BadTask(format!("rank {} has no recorded training process", task.rank)));
        };
        let wrapper_same = task.start_ticks.is_none() || start_ticks(pid) == task.start_ticks;
        if worker <= 1 || !wrapper_same || crate::procfs::session_of(worker) != Some(pid) {
            return Err(ExecError::BadTask(format!(
                "rank {}'s training process {worker} is gone (or no longer the task's)",
                task.rank
            )));
        }
        let sig = match fault {
            Fault::Kill => libc::SIGKILL,
            Fault::Pause => libc::SIGSTOP,
        };
        // SAFETY: plain syscall on a process checked above to be the task's.
        let r = unsafe { libc::kill(worker as i32, sig) };
        if r != 0 {
            return Err(ExecError::io(
                format!("{} to pid {worker}", fault.signal_name()),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(format!("{} to pid {worker} on {}", fault.signal_name(), task.host))
    }

    fn usage(&self, task: &Task) -> Option<Usage> {
        session_usage(task.pid?)
    }

    /// Its CPUs count as used again.
    fn adopt(&self, task: &Task) {
        self.adopt_task(task);
    }

    /// Processes whose environment names this executor's data directory (`SHOAL_SERVER_DATA`), outside the
    /// sessions of the adopted tasks.
    fn strays(&self, adopted: &[Task]) -> Vec<Stray> {
        let owners: HashSet<i64> = adopted.iter().filter_map(|t| t.pid).collect();
        let marker = format!("{}={}", var::SERVER_DATA, self.data_dir.display());
        let me = i64::from(std::process::id());
        processes_marked(&marker, var::JOB_ID)
            .into_iter()
            .filter_map(|(pid, job_id)| {
                let owner = session_of(pid).unwrap_or(0);
                (pid != me && !owners.contains(&owner)).then(|| Stray {
                    pid,
                    owner,
                    job_id,
                    what: format!("process {pid}"),
                })
            })
            .collect()
    }

    fn kill_stray(&self, stray: &Stray) {
        if stray.pid > 1 {
            // SAFETY: plain syscall on a process whose environment names this executor's data directory.
            unsafe {
                libc::kill(stray.pid as i32, libc::SIGKILL);
            }
        }
    }

    fn log_path(&self, job: &str, attempt: i64, rank: i64) -> PathBuf {
        self.attempt_dir(job, attempt).join(format!("rank-{rank}.log"))
    }

    /// Every task ran on this host: its in-memory checkpoints are removed here.
    fn job_ended(&self, job: &str) {
        let Some(dir) = shoal_spec::memory_checkpoint_dir(job) else { return };
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => tracing::info!(job, dir = %dir.display(), "removed the job's in-memory checkpoints"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(job, dir = %dir.display(), "could not remove the job's in-memory checkpoints: {e}")
            }
        }
    }
}
