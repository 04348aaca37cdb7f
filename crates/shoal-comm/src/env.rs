//! The environment contract every task gets: its one writer ([`TaskEnv::vars`], used by `shoal run`'s launcher
//! and by the platform's executors) and its one reader ([`EnvContract::from_env`]), both over the names in [`var`].
//!
//! | variable | meaning |
//! |---|---|
//! | `SHOAL_RANK`, `SHOAL_WORLD_SIZE` | this task's rank and the number of ranks |
//! | `SHOAL_RENDEZVOUS` | `host:port` of the rendezvous store |
//! | `SHOAL_JOB_SECRET` | the job secret (every connection proves it holds it) |
//! | `SHOAL_JOB_ID` | names the job's communicators |
//! | `SHOAL_TRANSPORT`, `SHOAL_ALGO` | optional: `auto`/`tcp`/`shm`, `auto`/`ring`/`tree`/`hier` |
//! | `SHOAL_TIMEOUT` | optional: per-operation limit, e.g. `30s`, `500ms`, `2m` |
//! | `SHOAL_FAULT_COMM_DELAY` | fault injection (feature `failpoints` only): every collective first sleeps this long (e.g. `20ms`), to test diagnosis |
//! | `SHOAL_FAULT_SLOW_RANK` | fault injection (feature `failpoints` only): `R:F` makes rank R compute F times as long (e.g. `1:2`), to test balancing |
//! | `SHOAL_FAULT_FED_CLIENT_EXIT` | fault injection (feature `failpoints` only): `R:STEP` makes a federated client exit in round R before secure aggregation's STEP (`keys`, `shares`, `masked`, `reveal`) |
//! | `SHOAL_HOST_ID` | optional: overrides the host identity (tests of multi-host layouts) |
//! | `SHOAL_SERVER`, `SHOAL_SERVER_CA` | optional: the control plane's URL, where a task sends its heartbeats (signed with the job secret), and the PEM file of certificates to trust for it |
//! | `SHOAL_RENDEZVOUS_HOST` | optional: `1` makes rank 0 host the store at `SHOAL_RENDEZVOUS` itself (for launchers that start no store, e.g. `srun` or `mpirun`) |
//! | `SHOAL_GENERATION`, `SHOAL_TASK_RANK` | optional: a task that joins a running job's group in place — the group's generation (its communicator is [`group_name`]'s, the state comes from its rank 0) and the task's own number among the attempt's tasks (`SHOAL_RANK` is its rank in the group) |

use std::sync::Arc;
use std::time::Duration;

/// The contract's variable names: defined once here, for the writer, the reader and the list of names a job may
/// not set itself ([`RESERVED`]).
pub mod var {
    pub const JOB_ID: &str = "SHOAL_JOB_ID";
    pub const RANK: &str = "SHOAL_RANK";
    pub const WORLD_SIZE: &str = "SHOAL_WORLD_SIZE";
    pub const LOCAL_RANK: &str = "SHOAL_LOCAL_RANK";
    pub const LOCAL_WORLD_SIZE: &str = "SHOAL_LOCAL_WORLD_SIZE";
    pub const RENDEZVOUS: &str = "SHOAL_RENDEZVOUS";
    pub const RENDEZVOUS_HOST: &str = "SHOAL_RENDEZVOUS_HOST";
    pub const JOB_SECRET: &str = "SHOAL_JOB_SECRET";
    pub const ATTEMPT: &str = "SHOAL_ATTEMPT";
    /// Where the platform's exit-status wrapper records the task's status.
    pub const EXIT_FILE: &str = "SHOAL_EXIT_FILE";
    /// The data directory of the server that started the task (finds its strays after a crash).
    pub const SERVER_DATA: &str = "SHOAL_SERVER_DATA";
    /// The control plane's URL (heartbeats and failure reports go there) and the certificates to trust for it.
    pub const SERVER: &str = "SHOAL_SERVER";
    pub const SERVER_CA: &str = "SHOAL_SERVER_CA";
    pub const TRANSPORT: &str = "SHOAL_TRANSPORT";
    pub const ALGO: &str = "SHOAL_ALGO";
    pub const TIMEOUT: &str = "SHOAL_TIMEOUT";
    /// Fault injection (feature `failpoints`): every collective first sleeps this long.
    pub const FAULT_COMM_DELAY: &str = "SHOAL_FAULT_COMM_DELAY";
    /// Fault injection (feature `failpoints`): every training batch takes this long to load.
    pub const FAULT_DATA_DELAY: &str = "SHOAL_FAULT_DATA_DELAY";
    /// Fault injection (feature `failpoints`): `R:F` makes rank R's forward and backward take F times as long.
    pub const FAULT_SLOW_RANK: &str = "SHOAL_FAULT_SLOW_RANK";
    /// Fault injection (feature `failpoints`): `R:STEP` makes a federated client (`shoal fed client`) exit in round
    /// R just before the secure-aggregation step STEP (`keys`, `shares`, `masked` or `reveal`).
    pub const FAULT_FED_CLIENT_EXIT: &str = "SHOAL_FAULT_FED_CLIENT_EXIT";
    /// `1`: every rank writes the dataset rows (and their epochs) each step trained on, a line a step, to
    /// `samples-rank-R.jsonl` beside its metrics (an audit of what a run read; a job may set it in `[env]`).
    pub const RECORD_SAMPLES: &str = "SHOAL_RECORD_SAMPLES";
    /// `1` (`shoal run --verbose`): rank 0 says more at start (a federated job: each client's label histogram).
    pub const VERBOSE: &str = "SHOAL_VERBOSE";
    pub const HOST_ID: &str = "SHOAL_HOST_ID";
    /// A task that joins a running group in place: the group's generation, and the task's number in its attempt.
    pub const GENERATION: &str = "SHOAL_GENERATION";
    pub const TASK_RANK: &str = "SHOAL_TASK_RANK";
    /// torchrun's names, for programs that read those.
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    pub const MASTER_PORT: &str = "MASTER_PORT";
    pub const TORCH_RANK: &str = "RANK";
    pub const TORCH_WORLD_SIZE: &str = "WORLD_SIZE";
    pub const TORCH_LOCAL_RANK: &str = "LOCAL_RANK";
    pub const TORCH_LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
    pub const VISIBLE_GPUS: &str = "CUDA_VISIBLE_DEVICES";
    /// What TensorFlow's multi-worker strategies read: the cluster's workers and this task's place among them.
    pub const TF_CONFIG: &str = "TF_CONFIG";
    /// What a JAX program passes to `jax.distributed.initialize` (JAX reads the coordinator's address itself).
    pub const JAX_COORDINATOR_ADDRESS: &str = "JAX_COORDINATOR_ADDRESS";
    pub const JAX_NUM_PROCESSES: &str = "JAX_NUM_PROCESSES";
    pub const JAX_PROCESS_ID: &str = "JAX_PROCESS_ID";
    /// What Kubeflow Trainer's torch runtime sets on each node (read when Shoal's own contract is absent; one
    /// process per node).
    pub const PET_NNODES: &str = "PET_NNODES";
    pub const PET_NODE_RANK: &str = "PET_NODE_RANK";
    pub const PET_MASTER_ADDR: &str = "PET_MASTER_ADDR";
    pub const PET_MASTER_PORT: &str = "PET_MASTER_PORT";
    /// Thread counts of the task's compute libraries (a job may override them).
    pub const RAYON_THREADS: &str = "RAYON_NUM_THREADS";
    pub const OMP_THREADS: &str = "OMP_NUM_THREADS";
}

/// What a launcher tells one task. [`TaskEnv::vars`] is the one place the contract is written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskEnv {
    pub job_id: String,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// `host:port` of the job's rendezvous store.
    pub rendezvous: String,
    /// Rank 0 hosts the store itself (launchers that start none, such as the platform's executors).
    pub host_store: bool,
    pub secret: String,
    /// torchrun's `MASTER_ADDR` / `MASTER_PORT`, for the task's own frameworks.
    pub master_addr: String,
    pub master_port: u16,
    /// The platform's attempt number (absent for `shoal run`).
    pub attempt: Option<i64>,
    /// The platform's exit-status file and data directory (absent for `shoal run`).
    pub exit_file: Option<String>,
    pub server_data: Option<String>,
    /// The control plane's URL and the PEM file to trust for it (absent for `shoal run`).
    pub server: Option<String>,
    pub server_ca: Option<String>,
    /// Threads for the task's compute libraries (absent: their own default).
    pub threads: Option<usize>,
    /// GPUs the task sees (`None`: not restricted).
    pub gpus: Option<String>,
    /// A task that joins a running job's group in place: the group's generation and the task's own number among
    /// its attempt's tasks (`rank` and `world_size` are then the group's; no rank hosts the store).
    pub join: Option<(u32, usize)>,
}

/// Names the contract sets that a job's own environment may not: everything [`TaskEnv::vars`] writes except the
/// thread counts, which a job may tune.
pub const RESERVED: [&str; 26] = [
    var::JOB_ID,
    var::GENERATION,
    var::TASK_RANK,
    var::RANK,
    var::WORLD_SIZE,
    var::LOCAL_RANK,
    var::LOCAL_WORLD_SIZE,
    var::RENDEZVOUS,
    var::RENDEZVOUS_HOST,
    var::JOB_SECRET,
    var::ATTEMPT,
    var::EXIT_FILE,
    var::SERVER_DATA,
    var::SERVER,
    var::SERVER_CA,
    var::MASTER_ADDR,
    var::MASTER_PORT,
    var::TORCH_RANK,
    var::TORCH_WORLD_SIZE,
    var::TORCH_LOCAL_RANK,
    var::TORCH_LOCAL_WORLD_SIZE,
    var::VISIBLE_GPUS,
    var::TF_CONFIG,
    var::JAX_COORDINATOR_ADDRESS,
    var::JAX_NUM_PROCESSES,
    var::JAX_PROCESS_ID,
];

/// The frameworks' part of the contract, for a job's own program (`train.command`), written beside
/// [`TaskEnv::vars`]: `addresses` holds every rank's `host:port` reserved for its framework, in rank order (rank
/// 0's is JAX's coordinator); `rank` is this task's. TensorFlow's `TF_CONFIG` names every rank a `worker`.
pub fn framework_vars(rank: usize, addresses: &[String]) -> Vec<(&'static str, String)> {
    let quoted: Vec<String> = addresses.iter().map(|a| format!("\"{}\"", a.replace(['"', '\\'], ""))).collect();
    let tf = format!(r#"{{"cluster":{{"worker":[{}]}},"task":{{"type":"worker","index":{rank}}}}}"#, quoted.join(","));
    vec![
        (var::TF_CONFIG, tf),
        (var::JAX_COORDINATOR_ADDRESS, addresses.first().cloned().unwrap_or_default()),
        (var::JAX_NUM_PROCESSES, addresses.len().to_string()),
        (var::JAX_PROCESS_ID, rank.to_string()),
    ]
}

/// A fault-injection delay from the environment (zero when unset). Fault injection is a test hook, compiled only
/// with the `failpoints` feature; without it, setting the variable is an error that says so rather than a delay
/// silently not injected.
pub fn fault_delay(name: &str) -> Result<Duration> {
    let Ok(t) = std::env::var(name) else { return Ok(Duration::ZERO) };
    if cfg!(feature = "failpoints") {
        parse_duration(&t).map_err(|e| Error::InvalidArgument(format!("{name}: {e}")))
    } else {
        Err(Error::InvalidArgument(format!(
            "{name} is a fault-injection test hook, compiled only into builds with the `failpoints` feature"
        )))
    }
}

/// `SHOAL_FAULT_SLOW_RANK` (`R:F`): the rank whose computation is slowed, and by what factor (≥ 1); gated as
/// [`fault_delay`].
pub fn fault_slow_rank() -> Result<Option<(usize, f64)>> {
    let name = var::FAULT_SLOW_RANK;
    let Ok(t) = std::env::var(name) else { return Ok(None) };
    if !cfg!(feature = "failpoints") {
        return Err(Error::InvalidArgument(format!(
            "{name} is a fault-injection test hook, compiled only into builds with the `failpoints` feature"
        )));
    }
    let bad = || Error::InvalidArgument(format!("{name}: {t:?} is not RANK:FACTOR (e.g. 1:2)"));
    let (r, f) = t.split_once(':').ok_or_else(bad)?;
    let (r, f) = (r.trim().parse::<usize>().map_err(|_| bad())?, f.trim().parse::<f64>().map_err(|_| bad())?);
    if !(f.is_finite() && f >= 1.0) {
        return Err(bad());
    }
    Ok(Some((r, f)))
}

/// A loopback port free now, for a rendezvous store or `MASTER_PORT` (the kernel's choice; free until someone
/// else takes it, which a store that fails to bind reports).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl TaskEnv {
    /// The variables to set, in order.
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        let mut v = vec![
            (var::JOB_ID, self.job_id.clone()),
            (var::RANK, self.rank.to_string()),
            (var::WORLD_SIZE, self.world_size.to_string()),
            (var::LOCAL_RANK, self.local_rank.to_string()),
            (var::LOCAL_WORLD_SIZE, self.local_world_size.to_string()),
            (var::RENDEZVOUS, self.rendezvous.clone()),
            (var::JOB_SECRET, self.secret.clone()),
            (var::MASTER_ADDR, self.master_addr.clone()),
            (var::MASTER_PORT, self.master_port.to_string()),
            (var::TORCH_RANK, self.rank.to_string()),
            (var::TORCH_WORLD_SIZE, self.world_size.to_string()),
            (var::TORCH_LOCAL_RANK, self.local_rank.to_string()),
            (var::TORCH_LOCAL_WORLD_SIZE, self.local_world_size.to_string()),
        ];
        if self.host_store {
            v.push((var::RENDEZVOUS_HOST, "1".into()));
        }
        let optional = [
            (var::ATTEMPT, self.attempt.map(|a| a.to_string())),
            (var::EXIT_FILE, self.exit_file.clone()),
            (var::SERVER_DATA, self.server_data.clone()),
            (var::SERVER, self.server.clone()),
            (var::SERVER_CA, self.server_ca.clone()),
            (var::RAYON_THREADS, self.threads.map(|t| t.to_string())),
            (var::OMP_THREADS, self.threads.map(|t| t.to_string())),
            (var::VISIBLE_GPUS, self.gpus.clone()),
            (var::GENERATION, self.join.map(|(g, _)| g.to_string())),
            (var::TASK_RANK, self.join.map(|(_, t)| t.to_string())),
        ];
        v.extend(optional.into_iter().filter_map(|(k, x)| x.map(|x| (k, x))));
        v
    }
}

use crate::comm::{CommConfig, Communicator};
use crate::error::{Error, Result};
use crate::store::{Store, TcpStore};

/// Parses `30s`, `500ms`, `2m`, `1h` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let v: f64 =
        num.parse().map_err(|_| Error::InvalidArgument(format!("bad duration {s:?} (e.g. 30s, 500ms, 2m)")))?;
    let secs = match unit.trim() {
        "" | "s" => v,
        "ms" => v / 1e3,
        "us" => v / 1e6,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        u => return Err(Error::InvalidArgument(format!("bad duration unit {u:?} in {s:?} (use ms, s, m or h)"))),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(Error::InvalidArgument(format!("bad duration {s:?}")));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn required(name: &str) -> Result<String> {
    std::env::var(name).map_err(|_| {
        Error::InvalidArgument(format!(
            "environment variable {name} is not set (is this process started by `shoal run`?)"
        ))
    })
}

fn required_usize(name: &str) -> Result<usize> {
    let v = required(name)?;
    v.parse().map_err(|_| Error::InvalidArgument(format!("{name}={v:?} is not a non-negative integer")))
}

/// The address this host's TCP links listen on and tell their peers: the one its traffic to the rendezvous leaves
/// from (the route's source address, found by a UDP `connect`, which sends nothing), so peers on other hosts reach
/// it the way this host reaches the store; loopback when the store is on loopback or the route cannot be told.
pub fn advertise_towards(rendezvous: &str) -> std::net::IpAddr {
    use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs, UdpSocket};
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let Some(target) = rendezvous.to_socket_addrs().ok().and_then(|mut a| a.next()) else { return loopback };
    if target.ip().is_loopback() {
        return loopback;
    }
    let any: std::net::SocketAddr = if target.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { ([0u16; 8], 0).into() };
    UdpSocket::bind(any)
        .and_then(|s| s.connect(target).and_then(|()| s.local_addr()))
        .map(|a| a.ip())
        .ok()
        .filter(|ip| !ip.is_unspecified())
        .unwrap_or(loopback)
}

/// The parts of the environment contract a communicator needs.
#[derive(Debug, Clone)]
pub struct EnvContract {
    pub rank: usize,
    pub world_size: usize,
    pub rendezvous: String,
    /// Rank 0 hosts the store itself (`SHOAL_RENDEZVOUS_HOST=1`).
    pub host_store: bool,
    pub cfg: CommConfig,
    /// The platform's attempt number (`SHOAL_ATTEMPT`; absent for `shoal run`).
    pub attempt: Option<i64>,
    /// The job's id (`SHOAL_JOB_ID`), when the launcher gave one.
    pub job_id: Option<String>,
    /// The control plane's URL and the certificates to trust for it (`SHOAL_SERVER`, `SHOAL_SERVER_CA`), when a
    /// server started the task.
    pub server: Option<String>,
    pub server_ca: Option<String>,
    /// The group generation a joining task enters (`SHOAL_GENERATION`; 0: the attempt's first group).
    pub generation: u32,
    /// The task's own number among its attempt's tasks (`SHOAL_TASK_RANK`; by default its rank).
    pub task_rank: usize,
}

/// The name of a job's communicator in group generation `generation` (0: the attempt's first), under `base` (the
/// first group's name): the store keys of each generation's rendezvous apart.
pub fn group_name(base: &str, generation: u32) -> String {
    match generation {
        0 => base.to_owned(),
        g => format!("{base}/g{g}"),
    }
}

impl EnvContract {
    /// Reads the contract from the process environment.
    pub fn from_env() -> Result<EnvContract> {
        // Under Kubeflow Trainer's torch runtime (a TrainJob from `shoal k8s manifests --format trainjob`), its
        // variables stand for the contract's: one rank per node, rank 0 hosting the store at the master address.
        let trainer = std::env::var(var::RANK).is_err() && std::env::var(var::PET_NODE_RANK).is_ok();
        let (rank, world_size, rendezvous) = if trainer {
            let addr = required(var::PET_MASTER_ADDR)?;
            let port = required(var::PET_MASTER_PORT)?;
            (required_usize(var::PET_NODE_RANK)?, required_usize(var::PET_NNODES)?, format!("{addr}:{port}"))
        } else {
            (required_usize(var::RANK)?, required_usize(var::WORLD_SIZE)?, required(var::RENDEZVOUS)?)
        };
        let mut cfg = CommConfig { secret: required(var::JOB_SECRET)?.into_bytes(), ..CommConfig::default() };
        let job_id = std::env::var(var::JOB_ID).ok();
        if let Some(job) = &job_id {
            cfg.name = format!("{job}/world");
        }
        if let Ok(t) = std::env::var(var::TRANSPORT) {
            cfg.transport = t.parse().map_err(|e| Error::InvalidArgument(format!("{}: {e}", var::TRANSPORT)))?;
        }
        if let Ok(a) = std::env::var(var::ALGO) {
            cfg.algo = a.parse().map_err(|e| Error::InvalidArgument(format!("{}: {e}", var::ALGO)))?;
        }
        if let Ok(t) = std::env::var(var::TIMEOUT) {
            cfg.timeout = parse_duration(&t).map_err(|e| Error::InvalidArgument(format!("{}: {e}", var::TIMEOUT)))?;
        }
        cfg.fault_delay = fault_delay(var::FAULT_COMM_DELAY)?;
        if let Ok(h) = std::env::var(var::HOST_ID) {
            cfg.host_id = Some(h);
        }
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "{}={rank} is not below {}={world_size}",
                var::RANK,
                var::WORLD_SIZE
            )));
        }
        let host_store = trainer || std::env::var(var::RENDEZVOUS_HOST).is_ok_and(|v| v == "1");
        cfg.advertise = advertise_towards(&rendezvous);
        let attempt = match std::env::var(var::ATTEMPT) {
            Ok(a) => Some(
                a.parse::<i64>()
                    .map_err(|_| Error::InvalidArgument(format!("{}={a:?} is not an attempt number", var::ATTEMPT)))?,
            ),
            Err(_) => None,
        };
        let server = std::env::var(var::SERVER).ok().filter(|s| !s.is_empty());
        let server_ca = std::env::var(var::SERVER_CA).ok().filter(|s| !s.is_empty());
        let number = |name: &str| -> Result<Option<usize>> {
            match std::env::var(name) {
                Ok(v) => v
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| Error::InvalidArgument(format!("{name}={v:?} is not a whole number"))),
                Err(_) => Ok(None),
            }
        };
        let generation = number(var::GENERATION)?.unwrap_or(0) as u32;
        let task_rank = number(var::TASK_RANK)?.unwrap_or(rank);
        let host_store = host_store && generation == 0;
        Ok(EnvContract {
            rank,
            world_size,
            rendezvous,
            host_store,
            cfg,
            attempt,
            job_id,
            server,
            server_ca,
            generation,
            task_rank,
        })
    }

    /// Connects to the rendezvous store and builds the world communicator. With
    /// `SHOAL_RENDEZVOUS_HOST=1`, rank 0 first starts the store in this process;
    /// it serves until the process exits.
    pub fn connect(self) -> Result<Communicator> {
        if self.rank == 0 && self.host_store {
            static HOSTED: std::sync::Mutex<Vec<crate::store::StoreServer>> = std::sync::Mutex::new(Vec::new());
            let server = crate::store::StoreServer::bind(self.rendezvous.as_str(), self.cfg.secret.clone())?;
            if let Ok(mut h) = HOSTED.lock() {
                h.push(server);
            }
        }
        let mut cfg = self.cfg;
        cfg.name = group_name(&cfg.name, self.generation);
        let store: Arc<dyn Store> = Arc::new(TcpStore::connect(&self.rendezvous, &cfg.secret, cfg.timeout)?);
        Communicator::init(store, self.rank, self.world_size, cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_listen_where_the_rendezvous_is_reached_from() {
        assert_eq!(advertise_towards("127.0.0.1:29500"), std::net::IpAddr::from([127, 0, 0, 1]));
        assert_eq!(advertise_towards("not a host"), std::net::IpAddr::from([127, 0, 0, 1]));
        // A routable address (nothing is sent): the source address is this host's, not loopback.
        let ip = advertise_towards("192.0.2.1:29500");
        let local = std::net::UdpSocket::bind((ip, 0));
        assert!(ip.is_loopback() || local.is_ok(), "{ip} is not an address of this host");
    }

    #[test]
    fn tensorflow_and_jax_find_every_rank() {
        let addrs = vec!["10.0.0.1:4000".to_string(), "10.0.0.2:4001".to_string()];
        let vars: std::collections::HashMap<_, _> = framework_vars(1, &addrs).into_iter().collect();
        assert_eq!(
            vars[var::TF_CONFIG],
            r#"{"cluster":{"worker":["10.0.0.1:4000","10.0.0.2:4001"]},"task":{"type":"worker","index":1}}"#
        );
        assert_eq!(vars[var::JAX_COORDINATOR_ADDRESS], "10.0.0.1:4000");
        assert_eq!((vars[var::JAX_NUM_PROCESSES].as_str(), vars[var::JAX_PROCESS_ID].as_str()), ("2", "1"));
        assert!(RESERVED.contains(&var::TF_CONFIG) && RESERVED.contains(&var::JAX_PROCESS_ID));
    }

    #[test]
    fn rank_zero_can_host_the_store() {
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(0);
        let hs: Vec<_> = (0..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    let cfg = CommConfig {
                        secret: b"hosted".to_vec(),
                        transport: crate::TransportChoice::Tcp,
                        timeout: Duration::from_secs(20),
                        ..CommConfig::default()
                    };
                    let env = EnvContract {
                        rank,
                        world_size: 3,
                        rendezvous: format!("127.0.0.1:{port}"),
                        host_store: rank == 0,
                        cfg,
                        attempt: None,
                        job_id: None,
                        server: None,
                        server_ca: None,
                        generation: 0,
                        task_rank: rank,
                    };
                    let c = env.connect()?;
                    let mut v = vec![rank as i32; 5];
                    c.all_reduce(&mut v, crate::ReduceOp::Sum)?;
                    Ok::<_, Error>(v)
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().ok().and_then(|r| r.ok()), Some(vec![3; 5]));
        }
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("30s").ok(), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms").ok(), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m").ok(), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("7").ok(), Some(Duration::from_secs(7)));
        assert!(parse_duration("abc").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}
