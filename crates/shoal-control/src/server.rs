//! Starting and stopping a server: lock the data directory, open and migrate the store, make sure an admin token
//! exists (written to `DATA/admin.token`, mode 0600, on first start), choose the executor and describe the cluster's
//! nodes (this machine, or what the executor's cluster manager says), adopt what still runs, then serve the API and
//! run the control loop until shut down.

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use shoal_sched::{Gpu, Node, Queue, Quota};

use crate::api::router;
use crate::auth::{hash_token, new_token};
use crate::control::{Control, ControlConfig};
use crate::db::{Db, Principal};
use crate::error::{ControlError, Result};
use crate::http::AppState;
use shoal_exec::{Executor, NodeInfo, procfs};

/// What runs the tasks of a server (`shoal server --executor`).
#[derive(Debug, Clone, Default)]
pub enum ExecutorKind {
    /// This machine's processes ([`shoal_exec::LocalExecutor`]).
    #[default]
    Local,
    /// A Slurm cluster: each job's gang one allocation ([`shoal_exec::SlurmExecutor`]); its nodes are the
    /// scheduler's.
    Slurm,
    /// A Kubernetes cluster: each attempt a headless Service and a Pod per rank
    /// ([`shoal_exec::KubeExecutor`]); its Nodes are the scheduler's.
    #[cfg(feature = "kubernetes")]
    Kubernetes(shoal_exec::KubeOptions),
}

/// How to run a server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// `postgres://...` or `sqlite://...`; default `sqlite://DATA/shoal.db`.
    pub database: Option<String>,
    /// The `shoal` executable (runs `shoal worker` for built-in jobs).
    pub worker_program: PathBuf,
    /// CPUs, memory and GPUs this node offers; default: what the machine has (no GPUs unless declared).
    pub cpus_milli: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub gpus: u32,
    pub gpu_memory_bytes: u64,
    /// Serve without tokens (refused on a non-loopback address).
    pub no_auth: bool,
    pub tick: Duration,
    pub kill_grace: Duration,
    pub preempt_grace: Duration,
    /// The scheduler's policy (ordering and packing of pending jobs).
    pub sched_policy: shoal_sched::Policy,
    pub prices: crate::cost::Prices,
    /// `--init`: a damaged database is set aside (kept) and a new one started, instead of refusing to start.
    pub init: bool,
    /// What jobs may touch: `--storage-root`, `--storage-config`, `--allow-loader-env`.
    pub policy: crate::policy::Policy,
    /// `--task-user NAME` (`root` to run tasks with the server's privileges); default: see
    /// [`shoal_exec::TaskUser::resolve`].
    pub task_user: Option<String>,
    /// Which executor runs the tasks (`--executor`; default local), as `task_user`.
    pub executor_kind: ExecutorKind,
    /// An executor made by the caller (tests), instead of the one `executor_kind` names.
    pub executor: Option<Arc<dyn shoal_exec::Executor>>,
    /// Serve HTTPS with this certificate and key (`--tls-cert`, `--tls-key`); `None`: plain HTTP.
    pub tls: Option<shoal_http::tls::TlsFiles>,
    /// The URL tasks reach this server at, for their heartbeats (`--advertise-url`). [`start`] fills in its own
    /// address when absent (loopback for an unspecified one); with none, tasks report through files only.
    pub advertise: Option<String>,
    /// What the store and the loop read the time from: the system's, or a simulation's (`shoal sim --engine
    /// control`).
    pub clock: crate::clock::Clock,
}

impl ServerOptions {
    pub fn new(data_dir: &Path, listen: SocketAddr, worker_program: &Path) -> ServerOptions {
        ServerOptions {
            data_dir: data_dir.to_path_buf(),
            listen,
            database: None,
            worker_program: worker_program.to_path_buf(),
            cpus_milli: None,
            memory_bytes: None,
            gpus: 0,
            gpu_memory_bytes: 80 << 30,
            no_auth: false,
            tick: Duration::from_millis(500),
            kill_grace: Duration::from_secs(10),
            preempt_grace: Duration::from_secs(30),
            sched_policy: shoal_sched::Policy::default(),
            prices: crate::cost::Prices::default(),
            init: false,
            policy: crate::policy::Policy::default(),
            task_user: None,
            executor_kind: ExecutorKind::Local,
            executor: None,
            tls: None,
            clock: crate::clock::Clock::system(),
            advertise: None,
        }
    }
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    pub addr: SocketAddr,
    /// The admin token (also in `DATA/admin.token`).
    pub admin_token: String,
    pub control: Arc<Control>,
    shutdown: tokio::sync::watch::Sender<bool>,
    serve: tokio::task::JoinHandle<std::io::Result<()>>,
    looping: tokio::task::JoinHandle<()>,
    _lock: std::fs::File,
}

impl Server {
    /// Stops serving and the control loop. Tasks keep running (a later server adopts them).
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.looping.await;
        let _ = self.serve.await;
        self.control.db.close().await;
    }

    /// Serves until SIGINT or SIGTERM.
    pub async fn wait_for_signal(self) -> Result<()> {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down; running jobs keep running and are adopted at the next start");
        self.shutdown().await;
        Ok(())
    }
}

fn lock_data_dir(dir: &Path) -> Result<std::fs::File> {
    let path = dir.join("server.lock");
    let mut f = std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&path)?;
    // SAFETY: flock on a descriptor we own.
    let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&f), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        return Err(ControlError::Config(format!(
            "another shoal server (pid {}) uses the data directory {}",
            holder.trim(),
            dir.display()
        )));
    }
    f.set_len(0)?;
    write!(f, "{}", std::process::id())?;
    Ok(f)
}

/// `(bytes, bus bandwidth in bytes/s)` of the all-reduce rows of a saved `shoal bench allreduce --json` report
/// (JSON lines, or one array).
pub fn bench_reference(path: &Path) -> Vec<(u64, f64)> {
    let Ok(text) = std::fs::read_to_string(path) else { return Vec::new() };
    crate::diagnose::parse_bench(&text)
}

/// The data directory holds secrets (the store, tokens, the server key): only its owner may read it. When tasks
/// run as another user, that user's group may pass through it (mode 0710) to reach its own job directories, which
/// it owns, without listing or reading anything else.
fn secure_data_dir(dir: &Path, task_user: Option<&shoal_exec::TaskUser>) -> Result<()> {
    let jobs = dir.join("jobs");
    std::fs::create_dir_all(&jobs)?;
    for d in [dir, jobs.as_path()] {
        match task_user {
            Some(u) => {
                std::os::unix::fs::chown(d, None, Some(u.gid))?;
                std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o710))?;
            }
            None => std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700))?,
        }
    }
    Ok(())
}

/// The first directory on the way to `path` (its ancestors, and `path` itself when `itself`) that `user` cannot
/// pass through, if any. Only the user's own group counts: tasks run without supplementary groups.
fn blocked_for(user: &shoal_exec::TaskUser, path: &Path, itself: bool) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut dirs: Vec<&Path> = path.ancestors().skip(usize::from(!itself)).collect();
    dirs.reverse();
    dirs.into_iter().find_map(|d| {
        let m = std::fs::metadata(d).ok()?;
        let mode = m.mode();
        let bit = if m.uid() == user.uid {
            0o100
        } else if m.gid() == user.gid {
            0o010
        } else {
            0o001
        };
        (mode & bit == 0).then(|| d.to_path_buf())
    })
}

/// Makes sure the task user can reach its jobs and run the worker program. The data directory must be reachable
/// (an error naming the directory in the way otherwise); a worker program it cannot reach (a checkout under a
/// private home, say) is linked or copied to `DATA/bin/`, where it can.
fn reachable_program(data_dir: &Path, program: &Path, user: &shoal_exec::TaskUser) -> Result<PathBuf> {
    if let Some(d) = blocked_for(user, data_dir, false) {
        return Err(ControlError::Config(format!(
            "tasks run as {} (uid {}), who cannot pass through {} on the way to the data directory {}: choose a \
             --data-dir it can reach, or --task-user",
            user.name,
            user.uid,
            d.display(),
            data_dir.display()
        )));
    }
    if blocked_for(user, program, false).is_none() {
        return Ok(program.to_path_buf());
    }
    let bin = data_dir.join("bin");
    std::fs::create_dir_all(&bin)?;
    std::os::unix::fs::chown(&bin, None, Some(user.gid))?;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o710))?;
    let name = program.file_name().map_or_else(|| "worker".into(), |n| n.to_string_lossy().into_owned());
    let copy = bin.join(name);
    let _ = std::fs::remove_file(&copy);
    if std::fs::hard_link(program, &copy).is_err() {
        std::fs::copy(program, &copy)
            .map_err(|e| ControlError::Config(format!("copying {} to {}: {e}", program.display(), copy.display())))?;
    }
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755))?;
    tracing::info!(
        program = %program.display(),
        copy = %copy.display(),
        user = %user.name,
        "the task user cannot reach the worker program; tasks run a copy"
    );
    Ok(copy)
}

/// Reads or creates `DATA/server.key` (32 random bytes, mode 0600), the key job secrets are derived from.
fn server_key(dir: &Path) -> Result<Vec<u8>> {
    let path = dir.join("server.key");
    match std::fs::read(&path) {
        Ok(k) if k.len() >= 32 => return Ok(k),
        Ok(_) => {
            return Err(ControlError::Config(format!(
                "{} is shorter than 32 bytes: damaged? Remove it only if no job is running (their secrets derive \
                 from it)",
                path.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(ControlError::Config(format!("{}: {e}", path.display()))),
    }
    let mut key = vec![0u8; 32];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut key);
    let mut f = std::fs::OpenOptions::new().create_new(true).write(true).mode(0o600).open(&path)?;
    f.write_all(&key)?;
    f.sync_all()?;
    Ok(key)
}

/// Reads or creates the admin token, making sure the store knows it.
async fn admin_token(db: &Db, dir: &Path) -> Result<String> {
    let path = dir.join("admin.token");
    let admin = Principal { user: "admin".into(), team: "admin".into(), admin: true };
    if let Ok(t) = std::fs::read_to_string(&path) {
        let t = t.trim().to_owned();
        if db.find_token(&hash_token(&t)).await?.is_none() {
            db.insert_token(&hash_token(&t), &admin).await?;
        }
        return Ok(t);
    }
    let t = new_token();
    db.insert_token(&hash_token(&t), &admin).await?;
    let mut f = std::fs::OpenOptions::new().create(true).write(true).truncate(true).mode(0o600).open(&path)?;
    writeln!(f, "{t}")?;
    Ok(t)
}

/// A server's state, ready to serve: the data directory locked, the store open and migrated, the admin token in
/// place, running tasks adopted. [`start`] serves it; tests drive it through [`crate::api::router`] and
/// [`Control::tick`] without a socket.
#[derive(Debug)]
pub struct Prepared {
    pub control: Arc<Control>,
    pub admin_token: String,
    pub database_url: String,
    lock: std::fs::File,
}

/// Everything [`start`] does before it listens.
pub async fn prepare(opts: &ServerOptions) -> Result<Prepared> {
    if opts.no_auth && !opts.listen.ip().is_loopback() {
        return Err(ControlError::Config(format!(
            "refusing to serve {} without authentication: only a loopback address may go without tokens",
            opts.listen
        )));
    }
    std::fs::create_dir_all(&opts.data_dir)
        .map_err(|e| ControlError::Config(format!("data directory {}: {e}", opts.data_dir.display())))?;
    let task_user = shoal_exec::TaskUser::resolve(opts.task_user.as_deref())?;
    secure_data_dir(&opts.data_dir, task_user.as_ref())?;
    let lock = lock_data_dir(&opts.data_dir)?;
    let db_path = opts.data_dir.join("shoal.db");
    let url = opts.database.clone().unwrap_or_else(|| format!("sqlite://{}", db_path.display()));
    let mut db = Db::open(&url, opts.init).await?;
    db.set_clock(opts.clock.clone());
    for suffix in ["", "-wal", "-shm"] {
        let p = PathBuf::from(format!("{}{suffix}", db_path.display()));
        if p.exists() {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))?;
        }
    }
    let secret_key = server_key(&opts.data_dir)?;
    let token = admin_token(&db, &opts.data_dir).await?;
    let exec: Arc<dyn Executor> = match (&opts.executor, &opts.executor_kind) {
        (Some(exec), _) => exec.clone(),
        (None, ExecutorKind::Local) => Arc::new(shoal_exec::LocalExecutor::new(&opts.data_dir, task_user.clone())),
        (None, ExecutorKind::Slurm) => Arc::new(
            shoal_exec::SlurmExecutor::new(&opts.data_dir, task_user.clone())
                .map_err(|e| ControlError::Config(format!("--executor slurm: {e}")))?,
        ),
        #[cfg(feature = "kubernetes")]
        (None, ExecutorKind::Kubernetes(k)) => Arc::new(
            shoal_exec::KubeExecutor::new(&opts.data_dir, k.clone())
                .map_err(|e| ControlError::Config(format!("--executor kubernetes: {e}")))?,
        ),
    };
    let nodes = match exec.nodes().map_err(|e| ControlError::Config(format!("the executor's nodes: {e}")))? {
        Some(list) => cluster_nodes(&list, opts),
        None => vec![this_node(opts)],
    };
    // One queue, and no guarantee: a guarantee of the whole cluster would only sort a job that does not fit now
    // behind later ones that do ("borrowing"), which breaks FIFO's order for nothing.
    let queues = vec![Queue { name: "default".into(), guaranteed: Quota::UNLIMITED, can_borrow: true }];
    let worker_program = match &task_user {
        Some(u) => reachable_program(&opts.data_dir, &opts.worker_program, u)?,
        None => opts.worker_program.clone(),
    };
    let server_ca = match (&opts.advertise, &opts.tls) {
        (Some(_), Some(t)) => Some(public_ca(&opts.data_dir, &t.cert)?),
        _ => None,
    };
    let config = ControlConfig {
        data_dir: opts.data_dir.clone(),
        worker_program,
        tick: opts.tick,
        kill_grace: opts.kill_grace,
        preempt_grace: opts.preempt_grace,
        sched_policy: opts.sched_policy,
        prices: opts.prices.clone(),
        bench: bench_reference(&opts.data_dir.join("bench.json")),
        policy: opts.policy.clone(),
        task_user,
        secret_key,
        server: opts.advertise.clone(),
        server_ca,
    };
    let control = Arc::new(Control::with_executor(db, config, nodes, queues, exec)?);
    control.recover().await?;
    Ok(Prepared { control, admin_token: token, database_url: url, lock })
}

/// A copy of the server's certificate chain that every task may read (`DATA/server-ca.pem`, mode 0644): what a
/// worker trusts for the server's HTTPS address when it sends its heartbeats.
fn public_ca(data_dir: &Path, cert: &Path) -> Result<String> {
    let copy = data_dir.join("server-ca.pem");
    let bytes = std::fs::read(cert).map_err(|e| {
        ControlError::Config(format!("{}: reading the certificate chain (--tls-cert): {e}", cert.display()))
    })?;
    std::fs::write(&copy, bytes)
        .and_then(|()| std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o644)))
        .map_err(|e| ControlError::Config(format!("{}: {e}", copy.display())))?;
    Ok(copy.display().to_string())
}

/// The URL tasks reach a server listening on `addr` at: the address itself, loopback for an unspecified one.
pub fn default_advertise(addr: SocketAddr, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    let ip = match addr.ip() {
        ip if ip.is_unspecified() && ip.is_ipv4() => std::net::IpAddr::from([127, 0, 0, 1]),
        ip if ip.is_unspecified() => std::net::IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1]),
        ip => ip,
    };
    format!("{scheme}://{}", SocketAddr::new(ip, addr.port()))
}

/// This machine as the cluster's one node: what the options declare, else what it has.
fn this_node(opts: &ServerOptions) -> Node {
    Node {
        id: "local".into(),
        host: procfs::hostname(),
        cpus_milli: opts.cpus_milli.unwrap_or(procfs::cpu_count() as u64 * 1000),
        memory_bytes: opts.memory_bytes.unwrap_or_else(procfs::total_memory),
        gpus: if opts.gpus > 0 {
            (0..opts.gpus).map(|i| Gpu { index: i, memory_bytes: opts.gpu_memory_bytes, kind: "gpu".into() }).collect()
        } else {
            // Discovered through NVML (feature `nvml`); none otherwise.
            crate::gpu::Gpus::new()
                .list()
                .into_iter()
                .map(|g| Gpu { index: g.index, memory_bytes: g.memory_bytes, kind: g.name })
                .collect()
        },
        labels: Default::default(),
    }
}

/// The nodes an executor's cluster manager describes, as the scheduler's model (each GPU with the declared GPU
/// memory). The options that describe this machine do not apply to them.
fn cluster_nodes(list: &[NodeInfo], opts: &ServerOptions) -> Vec<Node> {
    if opts.cpus_milli.is_some() || opts.memory_bytes.is_some() || opts.gpus > 0 {
        tracing::warn!("--cpus, --memory and --gpus describe this machine; the executor's nodes say what they offer");
    }
    let nodes: Vec<Node> = list
        .iter()
        .map(|n| Node {
            id: n.name.clone(),
            host: n.host.clone(),
            cpus_milli: n.cpus_milli,
            memory_bytes: n.memory_bytes,
            gpus: (0..n.gpus)
                .map(|i| Gpu { index: i, memory_bytes: opts.gpu_memory_bytes, kind: n.gpu_kind.clone() })
                .collect(),
            labels: Default::default(),
        })
        .collect();
    tracing::info!(
        nodes = %nodes.iter().map(|n| format!("{} ({} CPUs, {} MiB, {} GPUs)", n.id, n.cpus_milli / 1000,
            n.memory_bytes >> 20, n.gpus.len())).collect::<Vec<_>>().join(", "),
        "the cluster's nodes, from the executor"
    );
    nodes
}

pub use shoal_http::{HEADER_TIMEOUT, MAX_CONNECTIONS};

/// Starts a server; returns once it listens.
pub async fn start(opts: ServerOptions) -> Result<Server> {
    // Listen first: a server on a taken port must fail before it touches its state or recovers anything.
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| ControlError::Config(format!("cannot listen on {}: {e}", opts.listen)))?;
    let tls = match &opts.tls {
        Some(files) => Some(tokio_rustls::TlsAcceptor::from(
            shoal_http::tls::server_config(files, None).map_err(|e| ControlError::Config(e.0))?,
        )),
        None => None,
    };
    if tls.is_none() && !opts.listen.ip().is_loopback() {
        tracing::warn!(
            listen = %opts.listen,
            "serving plain HTTP on a non-loopback address: tokens and job specs cross the network unencrypted; \
             give --tls-cert and --tls-key"
        );
        eprintln!(
            "shoal server: warning: serving plain HTTP on {}, a non-loopback address: tokens cross the network \
             unencrypted (give --tls-cert and --tls-key)",
            opts.listen
        );
    }
    let addr = listener.local_addr()?;
    let mut opts = opts;
    if opts.advertise.is_none() {
        opts.advertise = Some(default_advertise(addr, tls.is_some()));
    }
    let Prepared { control, admin_token: token, database_url: url, lock } = prepare(&opts).await?;
    let (tx, rx) = tokio::sync::watch::channel(false);
    let looping = tokio::spawn(control.clone().run(rx.clone()));
    let app = router(AppState { control: control.clone(), auth: !opts.no_auth });
    let serve = tokio::spawn(shoal_http::serve(listener, app, tls, rx));
    tracing::info!(%addr, database = %crate::db::redact(&url), "shoal server listening");
    Ok(Server { addr, admin_token: token, control, shutdown: tx, serve, looping, _lock: lock })
}
