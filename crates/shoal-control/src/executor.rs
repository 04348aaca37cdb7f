//! The local executor: a job's tasks as child processes of the server, on this machine.
//!
//! - Every task runs in its own session (`setsid`), so a signal to its process group reaches whatever it started,
//!   and it **outlives the server**: a server killed with `kill -9` finds its tasks again when it restarts
//!   ([`LocalExecutor::probe`] checks the recorded PID *and* the process' start time, so a reused PID is never
//!   mistaken for a task).
//! - A tiny `sh` wrapper (absolute paths only, whatever the job's `PATH`) starts the training process, writes its
//!   PID to `rank-R.exit.pid` (the task's `pid`; the wrapper's is `wrapper_pid`) and records its exit status in
//!   `rank-R.exit` next to its log, so the status of a task that ended while the server was down is still known; a
//!   task that vanished without one is *lost*. (Started in the wrapper's background, the process ignores SIGINT as
//!   every `sh` background job does; the server stops tasks with SIGTERM, then SIGKILL.)
//! - When the server runs as root, tasks run as an unprivileged user ([`TaskUser`]; `--task-user`), in directories
//!   that user owns.
//! - Isolation: the task is pinned to as many whole CPUs as it asked for (rounded up, least-loaded CPUs first, via
//!   `sched_setaffinity` before `exec`), its tensor threads are told the same number (`RAYON_NUM_THREADS`,
//!   `OMP_NUM_THREADS`), it sees only its GPUs (`CUDA_VISIBLE_DEVICES`), and its memory (the RSS of every process
//!   of its session) is watched against its request: over the limit, it is killed with a reason that says so.
//! - Output (stdout and stderr together) goes to `DATA/jobs/ID/attempt-A/rank-R.log`, written by the task itself,
//!   so logs do not depend on the server being up.

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use shoal_comm::env::{TaskEnv, var};

use crate::db::{TaskRow, TaskState};
use crate::error::{ControlError, Result};

/// Everything one task needs to start.
#[derive(Debug, Clone)]
pub struct TaskLaunch {
    pub job_id: String,
    pub attempt: i64,
    pub rank: usize,
    pub world_size: usize,
    pub secret: String,
    /// `host:port` that rank 0 hosts the job's rendezvous store at.
    pub rendezvous: String,
    /// The program and its arguments.
    pub argv: Vec<String>,
    pub cpus_milli: u64,
    pub memory_bytes: u64,
    /// `(gpu index, share in thousandths)`.
    pub gpus: Vec<(u32, u32)>,
    pub node: String,
    /// The job's own `[env]`.
    pub env: Vec<(String, String)>,
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
    pub fn resolve(requested: Option<&str>) -> crate::Result<Option<TaskUser>> {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if euid != 0 {
            return match requested {
                None => Ok(None),
                Some(n) if TaskUser::lookup(n).is_some_and(|u| u.uid == euid) => Ok(None),
                Some(n) => Err(ControlError::Config(format!(
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
            return Err(ControlError::Config(format!("--task-user {name}: no such user")));
        }
        let out = Command::new("/usr/sbin/useradd")
            .args(["--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name])
            .output()
            .map_err(|e| ControlError::Config(format!("creating the task user {name} with useradd: {e}")))?;
        // Another server may have created it meanwhile; the lookup decides.
        match TaskUser::lookup(name) {
            Some(u) => {
                tracing::info!(user = name, uid = u.uid, "created the system user tasks run as");
                TaskUser::checked(u)
            }
            None => Err(ControlError::Config(format!(
                "creating the task user {name}: useradd said {}; create it, or name one with --task-user",
                String::from_utf8_lossy(&out.stderr).trim()
            ))),
        }
    }

    fn checked(u: TaskUser) -> crate::Result<Option<TaskUser>> {
        if u.uid == 0 {
            return Err(ControlError::Config(format!(
                "--task-user {}: has uid 0; tasks run as root only with --task-user root",
                u.name
            )));
        }
        Ok(Some(u))
    }
}

fn key(t: &TaskRow) -> (String, i64, i64) {
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

    pub fn host(&self) -> &str {
        &self.host
    }

    /// Creates `dir` (and its parents) for a task to write in: owned by the task user, mode 0700.
    pub fn task_dir(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        self.give(dir)?;
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        Ok(())
    }

    /// Hands a file or directory the server made over to the task user (no-op without one).
    pub fn give(&self, path: &Path) -> Result<()> {
        if let Some(u) = &self.user {
            std::os::unix::fs::chown(path, Some(u.uid), Some(u.gid))
                .map_err(|e| ControlError::Internal(format!("chown {} to {}: {e}", path.display(), u.name)))?;
        }
        Ok(())
    }

    /// The directory of one attempt's logs and exit files.
    pub fn attempt_dir(&self, job: &str, attempt: i64) -> PathBuf {
        self.data_dir.join("jobs").join(job).join(format!("attempt-{attempt}"))
    }

    pub fn log_path(&self, job: &str, attempt: i64, rank: i64) -> PathBuf {
        self.attempt_dir(job, attempt).join(format!("rank-{rank}.log"))
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

    /// Starts one task; returns its row (state `running`, PID and start time recorded).
    pub fn start(&self, l: &TaskLaunch) -> Result<TaskRow> {
        let dir = self.attempt_dir(&l.job_id, l.attempt);
        self.task_dir(&dir)?;
        let rank = l.rank as i64;
        let log_path = self.log_path(&l.job_id, l.attempt, rank);
        let exit_path = self.exit_path(&l.job_id, l.attempt, rank);
        let _ = std::fs::remove_file(&exit_path);
        let _ = std::fs::remove_file(format!("{}.pid", exit_path.display()));
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path)?;
        let err = log.try_clone()?;
        let whole = l.cpus_milli.div_ceil(1000).max(1) as usize;
        let cpus = self.pick_cpus(whole);
        let Some(program) = l.argv.first() else {
            return Err(ControlError::Internal(format!("job {}: empty command", l.job_id)));
        };
        let (host, port) = l.rendezvous.rsplit_once(':').unwrap_or((l.rendezvous.as_str(), ""));
        let contract = TaskEnv {
            job_id: l.job_id.clone(),
            rank: l.rank,
            world_size: l.world_size,
            local_rank: l.rank,
            local_world_size: l.world_size,
            rendezvous: l.rendezvous.clone(),
            // No store runs beside the tasks: rank 0 hosts it, at the address the executor picked.
            host_store: true,
            secret: l.secret.clone(),
            master_addr: host.to_owned(),
            master_port: port.parse().unwrap_or(0),
            attempt: Some(l.attempt),
            exit_file: Some(exit_path.display().to_string()),
            server_data: Some(self.data_dir.display().to_string()),
            threads: Some(cpus.len().max(1)),
            gpus: Some(l.gpus.iter().map(|(i, _)| i.to_string()).collect::<Vec<_>>().join(",")),
        };
        let mut cmd = Command::new("/bin/sh");
        // Absolute paths only: the job's own `PATH` must not decide whether its exit status is recorded.
        cmd.arg("-c")
            .arg(
                "f=$1; shift; \"$@\" & w=$!; printf '%s' \"$w\" > \"$f.pid\"; wait $w; c=$?; printf '%s' \"$c\" > \
                 \"$f.tmp\" && /bin/mv \"$f.tmp\" \"$f\"; exit $c",
            )
            .arg("shoal-task")
            .arg(&exit_path)
            .arg(program)
            .args(&l.argv[1..])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .current_dir(&dir)
            .envs(contract.vars());
        if let Some(u) = &self.user {
            cmd.env("HOME", &dir).env("USER", &u.name).env("LOGNAME", &u.name);
        }
        // The job's own variables may override the thread counts; the contract's names are refused by the spec.
        cmd.envs(l.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
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
        let child = cmd.spawn().map_err(|e| ControlError::Internal(format!("starting {program}: {e}")))?;
        let pid = child.id() as i64;
        let worker_pid = worker_pid_of(&exit_path, std::time::Duration::from_millis(500));
        let row = TaskRow {
            job_id: l.job_id.clone(),
            attempt: l.attempt,
            rank,
            node: l.node.clone(),
            host: self.host.clone(),
            pid: Some(pid),
            worker_pid,
            start_ticks: start_ticks(pid),
            state: TaskState::Running,
            exit_code: None,
            reason: String::new(),
            cpus: cpu_list(&cpus),
            gpus: l.gpus.iter().map(|(i, _)| i.to_string()).collect::<Vec<_>>().join(","),
            started_ms: Some(crate::db::now()),
            ended_ms: None,
            cpu_seconds: None,
        };
        self.children.lock().unwrap_or_else(|p| p.into_inner()).insert(key(&row), child);
        self.pinned.lock().unwrap_or_else(|p| p.into_inner()).insert(key(&row), cpus);
        Ok(row)
    }

    /// Takes over a task found in the store after a restart: its CPUs count as used again.
    pub fn adopt(&self, t: &TaskRow) {
        self.pinned.lock().unwrap_or_else(|p| p.into_inner()).insert(key(t), parse_cpu_list(&t.cpus));
    }

    /// Whether the task still runs, how it ended, or that it is lost.
    ///
    /// A task is over only when every process of its session is gone: when the wrapper has ended but something it
    /// started lingers (a worker that ignored SIGTERM, a stray child), the leftovers get SIGKILL and the task counts
    /// as running until they are gone, so nothing of an attempt outlives it.
    pub fn probe(&self, t: &TaskRow) -> TaskStatus {
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

    fn read_exit(&self, t: &TaskRow) -> Option<i32> {
        std::fs::read_to_string(self.exit_path(&t.job_id, t.attempt, t.rank)).ok()?.trim().parse().ok()
    }

    fn release(&self, k: &(String, i64, i64)) {
        self.pinned.lock().unwrap_or_else(|p| p.into_inner()).remove(k);
    }

    /// Sends `sig` to the task's whole session (its process group), if it is still the recorded process.
    pub fn signal(&self, t: &TaskRow, sig: i32) {
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

    /// Resident memory of every process in the task's session.
    pub fn rss_bytes(&self, t: &TaskRow) -> Option<u64> {
        self.usage(t).map(|u| u.rss_bytes)
    }

    /// Memory and CPU time of every process in the task's session (CPU time of processes that already ended and
    /// were reaped is included through their parents' `cutime`/`cstime`).
    pub fn usage(&self, t: &TaskRow) -> Option<Usage> {
        let sid = t.pid?;
        let page = 4096u64;
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let mut u = Usage::default();
        let mut found = false;
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(|s| s.parse::<i64>().ok()) else { continue };
            let Some(f) = stat_fields(pid) else { continue };
            // fields after the comm: [0]=state, [3]=session, [11..=14]=utime stime cutime cstime, [21]=rss (pages)
            if f.get(3).and_then(|s| s.parse::<i64>().ok()) == Some(sid) {
                found = true;
                let n = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
                u.rss_bytes += n(21) * page;
                u.cpu_seconds += (n(11) + n(12) + n(13) + n(14)) as f64 / hz;
            }
        }
        found.then_some(u)
    }
}

impl LocalExecutor {
    /// Processes started by a server of this data directory (their environment says so): `(pid, session, job id)`.
    /// After a crash, those that belong to no adopted task are strays (e.g. started just before the crash, before
    /// their task was recorded) and must not run on beside a new attempt.
    pub fn own_processes(&self) -> Vec<(i64, i64, String)> {
        let want = format!("{}={}", var::SERVER_DATA, self.data_dir.display());
        let mut out = Vec::new();
        let Ok(dir) = std::fs::read_dir("/proc") else { return out };
        for entry in dir.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i64>().ok()) else { continue };
            let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
            let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
            if !vars.contains(&want.as_bytes()) {
                continue;
            }
            let job = vars
                .iter()
                .find_map(|v| v.strip_prefix(format!("{}=", var::JOB_ID).as_bytes()))
                .map(|j| String::from_utf8_lossy(j).into_owned())
                .unwrap_or_default();
            let sid = stat_fields(pid).and_then(|f| f.get(3).and_then(|s| s.parse().ok())).unwrap_or(0);
            out.push((pid, sid, job));
        }
        out
    }
}

/// Reads at most `max` bytes of `path` from byte `from` on (clamped to its length), without reading what comes
/// before: logs and metrics files are followed by offset every tick and grow for the whole run. Returns the bytes
/// and the file's length. A missing file is empty.
pub fn read_from(path: &Path, from: u64, max: usize) -> std::io::Result<(Vec<u8>, u64)> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    let start = from.min(len);
    f.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::with_capacity(((len - start) as usize).min(max));
    f.take(max as u64).read_to_end(&mut buf)?;
    Ok((buf, len))
}

/// [`read_from`] on a blocking-I/O thread, for async handlers (a log read from its start can be large).
pub async fn read_from_async(path: PathBuf, from: u64, max: usize) -> std::io::Result<(Vec<u8>, u64)> {
    tokio::task::spawn_blocking(move || read_from(&path, from, max)).await.map_err(std::io::Error::other)?
}

/// What a task's processes use now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub rss_bytes: u64,
    pub cpu_seconds: f64,
}

/// Bytes received and sent by the host, all interfaces (`/proc/net/dev`).
pub fn host_net_bytes() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/net/dev").ok()?;
    let (mut rx, mut tx) = (0u64, 0u64);
    for line in s.lines().skip(2) {
        let Some((_, rest)) = line.split_once(':') else { continue };
        let f: Vec<u64> = rest.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        if f.len() >= 9 {
            rx += f[0];
            tx += f[8];
        }
    }
    Some((rx, tx))
}

/// The fields of `/proc/PID/stat` after the command name.
fn stat_fields(pid: i64) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// Field 22 of `/proc/PID/stat`: start time in clock ticks since boot.
pub fn start_ticks(pid: i64) -> Option<i64> {
    stat_fields(pid)?.get(19)?.parse().ok()
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

/// Whether any live (not zombie) process belongs to session `sid`.
fn session_alive(sid: i64) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else { return false };
    dir.flatten().any(|e| {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i64>().ok()) else { return false };
        stat_fields(pid).is_some_and(|f| {
            f.get(3).and_then(|s| s.parse::<i64>().ok()) == Some(sid)
                && !matches!(f.first().map(String::as_str), Some("Z" | "X"))
        })
    })
}

fn is_zombie(pid: i64) -> bool {
    stat_fields(pid).and_then(|f| f.first().cloned()).is_some_and(|s| s == "Z" || s == "X")
}

fn own_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity writes into the set we own.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            let v: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
            if !v.is_empty() {
                return v;
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

/// `0-3,6` from `[0, 1, 2, 3, 6]`.
pub fn cpu_list(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j { cpus[i].to_string() } else { format!("{}-{}", cpus[i], cpus[j]) });
        i = j + 1;
    }
    out.join(",")
}

fn parse_cpu_list(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.parse::<usize>().ok()),
        }
    }
    out
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "localhost".into())
}

/// The machine's memory in bytes (`MemTotal`).
pub fn total_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()).map(|kb| kb * 1024))
        })
        .unwrap_or(1 << 30)
}

/// The CPUs this process may run on.
pub fn cpu_count() -> usize {
    own_cpus().len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_round_trip() {
        for v in [vec![], vec![0], vec![0, 1, 2, 3, 6], vec![1, 3, 4, 5, 9, 10]] {
            assert_eq!(parse_cpu_list(&cpu_list(&v)), v);
        }
        assert_eq!(cpu_list(&[0, 1, 2, 3, 6]), "0-3,6");
    }

    #[test]
    fn read_from_reads_only_the_tail() -> std::io::Result<()> {
        let p = std::env::temp_dir().join(format!("shoal-read-from-{}", std::process::id()));
        std::fs::write(&p, b"0123456789")?;
        assert_eq!(read_from(&p, 4, 3)?, (b"456".to_vec(), 10));
        assert_eq!(read_from(&p, 8, 100)?, (b"89".to_vec(), 10));
        assert_eq!(read_from(&p, 50, 100)?, (Vec::new(), 10));
        std::fs::remove_file(&p)?;
        assert_eq!(read_from(&p, 0, 100)?, (Vec::new(), 0));
        Ok(())
    }

    #[test]
    fn own_process_has_a_start_time() {
        let me = std::process::id() as i64;
        assert!(start_ticks(me).is_some());
        assert!(!is_zombie(me));
    }
}
