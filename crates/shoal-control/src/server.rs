//! Starting and stopping a server: lock the data directory, open and migrate the store, make sure an admin token
//! exists (written to `DATA/admin.token`, mode 0600, on first start), describe this machine as the cluster's node,
//! adopt what still runs, then serve the API and run the control loop until shut down.

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use shoal_sched::{Gpu, Node, Queue, Quota};

use crate::api::{AppState, router};
use crate::auth::{hash_token, new_token};
use crate::control::{Control, ControlConfig};
use crate::db::{Db, Principal};
use crate::error::{ControlError, Result};
use crate::executor;

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
    pub prices: crate::cost::Prices,
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
            prices: crate::cost::Prices::default(),
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
    parse_bench(&text)
}

pub fn parse_bench(text: &str) -> Vec<(u64, f64)> {
    let rows: Vec<serde_json::Value> = match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Array(a)) => a,
        _ => text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect(),
    };
    rows.iter()
        .filter(|r| r.get("op").and_then(|o| o.as_str()).is_none_or(|o| o == "allreduce"))
        .filter_map(|r| {
            let bytes = r.get("bytes")?.as_u64()?;
            let bw = r.get("busbw_GBps")?.as_f64()?;
            (bw > 0.0).then_some((bytes, bw * 1e9))
        })
        .collect()
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
    let lock = lock_data_dir(&opts.data_dir)?;
    let url = opts.database.clone().unwrap_or_else(|| format!("sqlite://{}", opts.data_dir.join("shoal.db").display()));
    let db = Db::open(&url).await?;
    let token = admin_token(&db, &opts.data_dir).await?;
    let host = executor::hostname();
    let node = Node {
        id: "local".into(),
        host: host.clone(),
        cpus_milli: opts.cpus_milli.unwrap_or(executor::cpu_count() as u64 * 1000),
        memory_bytes: opts.memory_bytes.unwrap_or_else(executor::total_memory),
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
    };
    let queues = vec![Queue {
        name: "default".into(),
        guaranteed: Quota {
            cpus_milli: node.cpus_milli,
            memory_bytes: node.memory_bytes,
            gpus_milli: node.gpus.len() as u64 * 1000,
        },
        can_borrow: true,
    }];
    let config = ControlConfig {
        data_dir: opts.data_dir.clone(),
        worker_program: opts.worker_program.clone(),
        tick: opts.tick,
        kill_grace: opts.kill_grace,
        preempt_grace: opts.preempt_grace,
        prices: opts.prices.clone(),
        bench: bench_reference(&opts.data_dir.join("bench.json")),
    };
    let control = Arc::new(Control::new(db, config, node, queues)?);
    control.recover().await?;
    Ok(Prepared { control, admin_token: token, database_url: url, lock })
}

/// Starts a server; returns once it listens.
pub async fn start(opts: ServerOptions) -> Result<Server> {
    let Prepared { control, admin_token: token, database_url: url, lock } = prepare(&opts).await?;
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| ControlError::Config(format!("cannot listen on {}: {e}", opts.listen)))?;
    let addr = listener.local_addr()?;
    let (tx, rx) = tokio::sync::watch::channel(false);
    let looping = tokio::spawn(control.clone().run(rx.clone()));
    let app = router(AppState { control: control.clone(), auth: !opts.no_auth });
    let mut rx2 = rx;
    let serve = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx2.changed().await;
            })
            .await
    });
    tracing::info!(%addr, database = %crate::db::redact(&url), "shoal server listening");
    Ok(Server { addr, admin_token: token, control, shutdown: tx, serve, looping, _lock: lock })
}
