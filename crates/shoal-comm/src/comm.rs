//! The [`Communicator`]: a group of ranks, the links between them, and the
//! bookkeeping every operation shares (ordering, sequence numbers, deadlines,
//! failure reports). The algorithms themselves live in `algo.rs`.
//!
//! Ordering. Every operation takes a *ticket* when it is called; operations run
//! one at a time in ticket order, whether they run on the caller's thread
//! (blocking forms) or on the communicator's worker thread (`*_async` forms). So a
//! program that issues the same collectives in the same order on every rank gets
//! the same wire sequence numbers on every rank, and a mismatch is detected.
//!
//! Failure. The first failed operation closes the communicator (streams may be
//! out of step); later calls return [`Error::Closed`] naming that failure. The
//! error of the failed call lists the ranks that had entered the operation and the
//! ones that had not, from shared-memory progress counters and from the status
//! every rank publishes to the rendezvous store a few times a second.

use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak, mpsc};
use std::time::{Duration, Instant};

use crate::arrival::{ArrivalStats, Arrivals};
use crate::error::{Error, Participation, Result};
use crate::ring::{HeapRegion, Region, RingConfig, RingTransport, ShmRegion};
use crate::store::Store;
use crate::tcp::TcpTransport;
use crate::transport::{OpCtx, RecvReq, SendReq, Sink, Transport, TransportKind};

/// Which transport carries the links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportChoice {
    /// Shared memory between processes on one host, TCP across hosts, the heap
    /// between threads of one process.
    Auto,
    Tcp,
    Shm,
    InProc,
}

impl std::str::FromStr for TransportChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => TransportChoice::Auto,
            "tcp" => TransportChoice::Tcp,
            "shm" => TransportChoice::Shm,
            "inproc" => TransportChoice::InProc,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown transport {s:?} (expected auto, tcp, shm or inproc)"
                )));
            }
        })
    }
}

/// Which algorithm a collective uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algo {
    /// Chosen per call from the message size and the topology.
    Auto,
    /// Bandwidth-optimal ring (reduce-scatter + all-gather), pipelined in chunks.
    Ring,
    /// Latency-optimal: recursive doubling (all-reduce), binomial trees (broadcast, reduce).
    Tree,
    /// Reduce inside each host over shared memory, ring across hosts, broadcast inside each host.
    Hier,
    /// All-reduce only (Rabenseifner): reduce-scatter by recursive halving, then
    /// all-gather by recursive doubling. Bandwidth-optimal like the ring (each rank
    /// sends `2(n-1)/n` of the buffer, `n` a power of two) in `2 log2 n` steps
    /// instead of `2(n-1)`; non-powers of two fold the extra ranks in first. Other
    /// collectives choose as under [`Algo::Auto`]. Name: `rhd`.
    HalvingDoubling,
}

impl Algo {
    pub fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::Ring => "ring",
            Algo::Tree => "tree",
            Algo::Hier => "hier",
            Algo::HalvingDoubling => "rhd",
        }
    }
}

impl std::str::FromStr for Algo {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => Algo::Auto,
            "ring" => Algo::Ring,
            "tree" => Algo::Tree,
            "hier" => Algo::Hier,
            "rhd" => Algo::HalvingDoubling,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown algorithm {s:?} (expected auto, ring, tree, hier or rhd)"
                )));
            }
        })
    }
}

/// How a communicator is built and behaves.
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Name of the communicator; prefixes its keys in the store.
    pub name: String,
    pub transport: TransportChoice,
    pub algo: Algo,
    /// Limit for every operation and for building the communicator.
    pub timeout: Duration,
    /// The job secret every connection proves it holds.
    pub secret: Vec<u8>,
    /// Identity of this host; ranks with equal ids may share memory. Default:
    /// hostname plus kernel boot id.
    pub host_id: Option<String>,
    /// Address peers dial for TCP links (default 127.0.0.1).
    pub advertise: IpAddr,
    /// Directory for shared-memory segments.
    pub shm_dir: std::path::PathBuf,
    pub ring: RingConfig,
    /// Messages up to this many bytes use the latency-optimal algorithms under `Algo::Auto`.
    pub small_bytes: usize,
    /// Fault injection: every collective first sleeps this long (a slowed transport, for testing diagnosis).
    /// Zero in production; set from `SHOAL_FAULT_COMM_DELAY` by the environment contract.
    pub fault_delay: Duration,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            name: "world".into(),
            transport: TransportChoice::Auto,
            algo: Algo::Auto,
            timeout: Duration::from_secs(60),
            secret: Vec::new(),
            host_id: None,
            advertise: IpAddr::V4(Ipv4Addr::LOCALHOST),
            shm_dir: "/dev/shm".into(),
            ring: RingConfig::default(),
            small_bytes: 64 << 10,
            fault_delay: Duration::ZERO,
        }
    }
}

/// This machine's identity: hostname and boot id (containers on one kernel with
/// different hostnames do not share `/dev/shm`, so both count).
pub fn default_host_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}:{}", host.trim(), boot.trim())
}

/// Process-wide registry of in-process segments, keyed by world id, communicator and rank.
fn inproc_registry() -> &'static Mutex<std::collections::HashMap<String, Arc<HeapRegion>>> {
    static REG: OnceLock<Mutex<std::collections::HashMap<String, Arc<HeapRegion>>>> = OnceLock::new();
    REG.get_or_init(Default::default)
}

type Job = Box<dyn FnOnce() + Send>;

/// How often a rank publishes which operation it is in.
const STATUS_INTERVAL: Duration = Duration::from_millis(200);
/// How long a failure report waits for the store's view of who arrived.
const REPORT_LIMIT: Duration = Duration::from_secs(2);

pub(crate) struct Inner {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) cfg: CommConfig,
    pub(crate) store: Arc<dyn Store>,
    /// Host id of every rank.
    pub(crate) hosts: Vec<String>,
    transports: Vec<Arc<dyn Transport>>,
    /// Peer rank -> index into `transports`.
    route: Vec<Option<usize>>,
    next_ticket: AtomicU64,
    turn: Mutex<u64>,
    turn_cv: Condvar,
    coll_seq: AtomicU64,
    p2p_send: Vec<AtomicU64>,
    p2p_recv: Vec<AtomicU64>,
    closed: Mutex<Option<String>>,
    pub(crate) scratch: Mutex<Vec<u64>>,
    worker: Mutex<Option<mpsc::Sender<Job>>>,
    /// The collective this rank is in now, or was in last (seq 0 = none yet); see [`Activity`].
    current: Mutex<Current>,
    pub(crate) hier: OnceLock<std::result::Result<Hier, String>>,
    splits: AtomicU64,
    /// Bytes this rank has sent in all operations.
    sent: AtomicU64,
    /// Who this rank waits for inside operations ([`crate::arrival`]); shared with communicators split from this one.
    arrivals: Arc<Arrivals>,
}

/// What [`Inner::current`] holds: the collective a rank is in, or was in last.
#[derive(Debug, Clone, Copy)]
struct Current {
    seq: u64,
    name: &'static str,
    /// When it began (`in_op`) or ended.
    since: Instant,
    in_op: bool,
    /// Collectives completed.
    done: u64,
}

/// What a rank's communicator is doing now ([`Communicator::activity`]): cheap to take (one uncontended lock, no
/// system call), for a reporter thread that tells the control plane where a rank stands, e.g. in a hang.
#[derive(Debug, Clone, PartialEq)]
pub struct Activity {
    /// The collective it is in (`in_op`), or the last one it finished; empty before the first.
    pub op: &'static str,
    /// That collective's sequence number (every rank gives a collective the same one); 0 before the first.
    pub seq: u64,
    /// Whether it is inside that collective now.
    pub in_op: bool,
    /// How long it has been in it (`in_op`), or since it finished it.
    pub for_: Duration,
    /// Collectives completed so far.
    pub done: u64,
    /// Why the communicator is closed, if it is (the first failure).
    pub closed: Option<String>,
}

/// Sub-communicators of the hierarchical algorithm.
pub(crate) struct Hier {
    pub(crate) local: Communicator,
    pub(crate) leaders: Option<Communicator>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("name", &self.cfg.name)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("transports", &self.transports.iter().map(|t| t.kind()).collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// A group of ranks that run collectives together. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct Communicator {
    pub(crate) inner: Arc<Inner>,
}

/// The result of a non-blocking operation.
#[derive(Debug)]
pub struct Pending<T> {
    rx: mpsc::Receiver<Result<T>>,
    op: &'static str,
    ready: Option<Result<T>>,
}

impl<T> Pending<T> {
    /// Waits for the operation (bounded by the communicator's timeout).
    pub fn wait(mut self) -> Result<T> {
        if let Some(r) = self.ready.take() {
            return r;
        }
        self.rx.recv().unwrap_or_else(|_| Err(Error::Closed(format!("the worker running {} stopped", self.op))))
    }

    /// True once the operation has finished (successfully or not).
    pub fn is_done(&mut self) -> bool {
        if self.ready.is_none() {
            match self.rx.try_recv() {
                Ok(r) => self.ready = Some(r),
                Err(mpsc::TryRecvError::Empty) => {}
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.ready = Some(Err(Error::Closed(format!("the worker running {} stopped", self.op))))
                }
            }
        }
        self.ready.is_some()
    }
}

/// Keys in the store, all under the communicator's name.
fn key(name: &str, what: &str) -> String {
    format!("shoal/{name}/{what}")
}

impl Communicator {
    /// Builds a communicator of `size` ranks; every rank calls this with the same
    /// store, name and size. Rank addresses, host identities and shared-memory
    /// segments are exchanged through `store`.
    pub fn init(store: Arc<dyn Store>, rank: usize, size: usize, cfg: CommConfig) -> Result<Communicator> {
        Self::init_with(store, rank, size, cfg, Arrivals::new(rank, size))
    }

    /// [`Self::init`], recording arrivals in `arrivals` (a split communicator adds to its parent's record).
    fn init_with(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        cfg: CommConfig,
        arrivals: Arrivals,
    ) -> Result<Communicator> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!("rank {rank} is not in a world of size {size}")));
        }
        cfg.ring.validate()?;
        let deadline = Instant::now() + cfg.timeout;
        let name = cfg.name.clone();
        let host = cfg.host_id.clone().unwrap_or_else(default_host_id);
        let pid = std::process::id();
        let listener = if cfg.transport != TransportChoice::InProc {
            Some(
                TcpListener::bind((cfg.advertise, 0))
                    .map_err(|e| Error::io(format!("binding a TCP listener on {}", cfg.advertise), e))?,
            )
        } else {
            None
        };
        let addr = match &listener {
            Some(l) => l.local_addr().map_err(|e| Error::io("listener address", e))?.to_string(),
            None => "-".into(),
        };
        if rank == 0 {
            let id: u64 = rand::random();
            store.set(&key(&name, "world"), format!("{id:016x}").as_bytes())?;
        }
        store.set(&key(&name, &format!("peer/{rank}")), format!("{host}\t{pid}\t{addr}").as_bytes())?;
        let world = String::from_utf8_lossy(&store.get(&key(&name, "world"), cfg.timeout)?).to_string();
        let mut hosts = Vec::with_capacity(size);
        let mut pids = Vec::with_capacity(size);
        let mut addrs = Vec::with_capacity(size);
        for r in 0..size {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = store.get(&key(&name, &format!("peer/{r}")), left)?;
            let v = String::from_utf8_lossy(&v).to_string();
            let mut it = v.split('\t');
            let (h, p, a) = (it.next().unwrap_or(""), it.next().unwrap_or(""), it.next().unwrap_or("-"));
            hosts.push(h.to_string());
            pids.push(p.parse::<u32>().unwrap_or(0));
            addrs.push(a.to_string());
        }

        // Decide the mechanism of every link.
        let mut kinds: Vec<Option<TransportKind>> = vec![None; size];
        for r in (0..size).filter(|&r| r != rank) {
            let same_host = hosts[r] == hosts[rank];
            let same_proc = same_host && pids[r] == pid;
            kinds[r] = Some(match cfg.transport {
                TransportChoice::Tcp => TransportKind::Tcp,
                TransportChoice::InProc if same_proc => TransportKind::InProc,
                TransportChoice::Shm if same_host => TransportKind::Shm,
                TransportChoice::Auto if same_proc => TransportKind::InProc,
                TransportChoice::Auto if same_host => TransportKind::Shm,
                TransportChoice::Auto => TransportKind::Tcp,
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "transport {other:?} cannot link rank {rank} (host {}, pid {pid}) with rank {r} (host {}, pid {})",
                        hosts[rank], hosts[r], pids[r]
                    )));
                }
            });
        }

        let mut transports: Vec<Arc<dyn Transport>> = Vec::new();
        let mut route = vec![None; size];
        for kind in [TransportKind::InProc, TransportKind::Shm] {
            let group: Vec<usize> = (0..size).filter(|&r| r == rank || kinds[r] == Some(kind)).collect();
            if group.len() < 2 {
                continue;
            }
            let t = Self::build_rings(&*store, &name, &world, rank, size, &group, kind, &cfg, deadline)?;
            for &r in &group {
                if r != rank {
                    route[r] = Some(transports.len());
                }
            }
            transports.push(Arc::new(t));
        }
        if kinds.contains(&Some(TransportKind::Tcp)) {
            let tcp_addrs: Vec<Option<String>> =
                (0..size).map(|r| (kinds[r] == Some(TransportKind::Tcp)).then(|| addrs[r].clone())).collect();
            let listener = listener.ok_or_else(|| Error::InvalidArgument("no TCP listener".into()))?;
            let t = TcpTransport::connect_mesh(
                &format!("{world}/{name}"),
                rank,
                &tcp_addrs,
                listener,
                &cfg.secret,
                deadline,
            )?;
            for r in 0..size {
                if kinds[r] == Some(TransportKind::Tcp) {
                    route[r] = Some(transports.len());
                }
            }
            transports.push(Arc::new(t));
        }
        // Everyone is linked before anyone starts an operation.
        let everyone: Vec<usize> = (0..size).collect();
        Self::store_barrier(&*store, &name, "ready", rank, &everyone, deadline)?;
        let inner = Arc::new(Inner {
            rank,
            size,
            cfg,
            store,
            hosts,
            transports,
            route,
            next_ticket: AtomicU64::new(0),
            turn: Mutex::new(0),
            turn_cv: Condvar::new(),
            coll_seq: AtomicU64::new(0),
            p2p_send: (0..size).map(|_| AtomicU64::new(0)).collect(),
            p2p_recv: (0..size).map(|_| AtomicU64::new(0)).collect(),
            closed: Mutex::new(None),
            scratch: Mutex::new(Vec::new()),
            worker: Mutex::new(None),
            current: Mutex::new(Current { seq: 0, name: "", since: Instant::now(), in_op: false, done: 0 }),
            hier: OnceLock::new(),
            splits: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            arrivals: Arc::new(arrivals),
        });
        spawn_status_publisher(Arc::downgrade(&inner));
        tracing::debug!(comm = %inner.cfg.name, rank, size, transports = ?inner.transports.iter().map(|t| t.kind().name()).collect::<Vec<_>>(), "communicator ready");
        Ok(Communicator { inner })
    }

    #[allow(clippy::too_many_arguments)]
    fn build_rings(
        store: &dyn Store,
        name: &str,
        world: &str,
        rank: usize,
        size: usize,
        group: &[usize],
        kind: TransportKind,
        cfg: &CommConfig,
        deadline: Instant,
    ) -> Result<RingTransport> {
        let me = group.iter().position(|&r| r == rank).unwrap_or(0);
        let bytes = cfg.ring.segment_bytes(group.len());
        let tag = kind.name();
        let seg_key = |r: usize| key(name, &format!("{tag}/seg/{r}"));
        let mut own_path = None;
        let own: Arc<dyn Region> = match kind {
            TransportKind::Shm => {
                let nonce: u32 = rand::random();
                let path = cfg.shm_dir.join(format!("shoal-{world}-{}-{rank}-{nonce:08x}", sanitize(name)));
                let region = ShmRegion::create(&path, bytes)?;
                RingTransport::init_own_segment(&region, &cfg.ring, group.len())?;
                store.set(&seg_key(rank), path.to_string_lossy().as_bytes())?;
                own_path = Some(path);
                Arc::new(region)
            }
            _ => {
                let region = HeapRegion::new(bytes)?;
                RingTransport::init_own_segment(&region, &cfg.ring, group.len())?;
                let region = Arc::new(region);
                let reg_key = format!("{world}/{}", seg_key(rank));
                inproc_registry()
                    .lock()
                    .map_err(|_| Error::Closed("registry poisoned".into()))?
                    .insert(reg_key.clone(), region.clone());
                store.set(&seg_key(rank), reg_key.as_bytes())?;
                region
            }
        };
        let result = (|| {
            let mut regions: Vec<Arc<dyn Region>> = Vec::with_capacity(group.len());
            for &r in group {
                if r == rank {
                    regions.push(own.clone());
                    continue;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                let v = String::from_utf8_lossy(&store.get(&seg_key(r), left)?).to_string();
                regions.push(match kind {
                    TransportKind::Shm => Arc::new(ShmRegion::open(std::path::Path::new(&v), bytes)?),
                    _ => inproc_registry()
                        .lock()
                        .map_err(|_| Error::Closed("registry poisoned".into()))?
                        .get(&v)
                        .cloned()
                        .ok_or_else(|| {
                            Error::InvalidArgument(format!(
                                "rank {r}'s in-process segment {v:?} is not in this process"
                            ))
                        })?,
                });
            }
            RingTransport::new(kind, cfg.ring, size, group.to_vec(), me, regions)
        })();
        // Once every rank of the group has mapped every segment, the names can go: nothing is
        // left in /dev/shm even if a process dies later. Only the group waits: a rank with
        // nobody to share memory with never builds rings and never comes here.
        let barrier = Self::store_barrier(store, name, &format!("{tag}/mapped"), rank, group, deadline);
        if let Some(p) = own_path {
            let _ = std::fs::remove_file(p);
        } else if let Ok(mut reg) = inproc_registry().lock() {
            reg.remove(&format!("{world}/{}", seg_key(rank)));
        }
        let t = result?;
        barrier?;
        Ok(t)
    }

    fn store_barrier(
        store: &dyn Store,
        name: &str,
        what: &str,
        rank: usize,
        members: &[usize],
        deadline: Instant,
    ) -> Result<()> {
        store.set(&key(name, &format!("{what}/{rank}")), b"1")?;
        let keys: Vec<String> = members.iter().map(|r| key(name, &format!("{what}/{r}"))).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        store.wait(&refs, deadline.saturating_duration_since(Instant::now()))
    }

    /// Builds `size` communicators over the in-process transport, one per thread
    /// that will use it (for tests and single-process tools).
    pub fn local_world(size: usize, cfg: CommConfig) -> Result<Vec<Communicator>> {
        let store: Arc<dyn Store> = Arc::new(crate::store::MemStore::default());
        let handles: Vec<_> = (0..size)
            .map(|r| {
                let store = store.clone();
                let cfg = cfg.clone();
                std::thread::spawn(move || Communicator::init(store, r, size, cfg))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Closed("a rank's init thread panicked".into()))))
            .collect()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &CommConfig {
        &self.inner.cfg
    }

    /// The rendezvous store it was built with.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// Host id of every rank.
    pub fn hosts(&self) -> &[String] {
        &self.inner.hosts
    }

    /// The mechanism of the link to `peer` (None for ourselves).
    pub fn link_kind(&self, peer: usize) -> Option<TransportKind> {
        let i = (*self.inner.route.get(peer)?)?;
        Some(self.inner.transports[i].kind())
    }

    /// What this rank is doing now: the collective it is in or finished last, and for how long ([`Activity`]).
    pub fn activity(&self) -> Activity {
        let c = self.inner.current.lock().map(|c| *c).unwrap_or(Current {
            seq: 0,
            name: "",
            since: Instant::now(),
            in_op: false,
            done: 0,
        });
        Activity {
            op: c.name,
            seq: c.seq,
            in_op: c.in_op,
            for_: c.since.elapsed(),
            done: c.done,
            closed: self.closed_reason(),
        }
    }

    /// Who this rank waited for inside operations so far, and how long it left ready messages waiting
    /// ([`ArrivalStats`], cumulative; see [`crate::arrival`] for how it is measured). A communicator split from
    /// another adds to its parent's record, so the ranks are those of the communicator everything was split from.
    pub fn arrival_stats(&self) -> ArrivalStats {
        self.inner.arrivals.stats()
    }

    /// Bytes this rank has sent in all operations so far (payloads and headers).
    pub fn bytes_sent(&self) -> u64 {
        self.inner.sent.load(Ordering::Relaxed)
    }

    /// Why the communicator is closed, if it is.
    pub fn closed_reason(&self) -> Option<String> {
        self.inner.closed.lock().ok().and_then(|c| c.clone())
    }

    /// Splits into sub-communicators: ranks that pass the same `colour` form one,
    /// ordered by `(key, rank)`; `None` takes no part (gets `None`). Collective
    /// over this communicator.
    pub fn split(&self, colour: Option<u32>, key_: i64) -> Result<Option<Communicator>> {
        let n = self.inner.splits.fetch_add(1, Ordering::SeqCst);
        let inner = &self.inner;
        let tag = format!("split{n}");
        let c = colour.map(|c| c.to_string()).unwrap_or_else(|| "-".into());
        inner.store.set(&key(&inner.cfg.name, &format!("{tag}/{}", inner.rank)), format!("{c}\t{key_}").as_bytes())?;
        let deadline = Instant::now() + inner.cfg.timeout;
        let mut members: Vec<(i64, usize)> = Vec::new();
        for r in 0..inner.size {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = String::from_utf8_lossy(&inner.store.get(&key(&inner.cfg.name, &format!("{tag}/{r}")), left)?)
                .to_string();
            let (rc, rk) = v.split_once('\t').unwrap_or(("-", "0"));
            if colour.is_some() && rc == c {
                members.push((rk.parse().unwrap_or(0), r));
            }
        }
        let Some(colour) = colour else { return Ok(None) };
        members.sort();
        let new_rank = members.iter().position(|&(_, r)| r == inner.rank).unwrap_or(0);
        let mut cfg = inner.cfg.clone();
        cfg.name = format!("{}.{tag}.{colour}", inner.cfg.name);
        cfg.host_id = Some(inner.hosts[inner.rank].clone());
        let parents: Vec<usize> = members.iter().map(|&(_, r)| r).collect();
        let arrivals = Arrivals::split(&inner.arrivals, &parents, new_rank);
        Communicator::init_with(inner.store.clone(), new_rank, members.len(), cfg, arrivals).map(Some)
    }

    // ---- plumbing shared by the algorithms ----

    /// Runs `f` as one operation: waits for this call's turn, checks the
    /// communicator is open, enriches and records failures.
    pub(crate) fn run<T>(
        &self,
        ticket: u64,
        name: &'static str,
        seq: u64,
        f: impl FnOnce(&OpCtx) -> Result<T>,
    ) -> Result<T> {
        let inner = &self.inner;
        {
            let mut turn = inner.turn.lock().map_err(|_| Error::Closed("turn lock poisoned".into()))?;
            while *turn != ticket {
                turn = inner.turn_cv.wait(turn).map_err(|_| Error::Closed("turn lock poisoned".into()))?;
            }
        }
        let result = (|| {
            if let Some(why) = self.closed_reason() {
                return Err(Error::Closed(why));
            }
            if seq >> 63 == 0 {
                if let Ok(mut c) = inner.current.lock() {
                    *c = Current { seq, name, since: Instant::now(), in_op: true, done: c.done };
                }
                for t in &inner.transports {
                    t.set_progress(seq);
                }
            }
            if !inner.cfg.fault_delay.is_zero() && seq >> 63 == 0 {
                std::thread::sleep(inner.cfg.fault_delay);
            }
            inner.arrivals.begin_op();
            let op = OpCtx::new(name, seq, inner.rank, inner.cfg.timeout).with_arrivals(&inner.arrivals);
            let r = f(&op).map_err(|e| self.enrich(e, seq));
            inner.sent.fetch_add(op.sent.load(Ordering::Relaxed), Ordering::Relaxed);
            if seq >> 63 == 0
                && let Ok(mut c) = inner.current.lock()
            {
                c.in_op = false;
                c.since = Instant::now();
                c.done += 1;
            }
            r
        })();
        if let Err(e) = &result
            && !matches!(e, Error::Closed(_) | Error::InvalidArgument(_))
        {
            if let Ok(mut c) = inner.closed.lock() {
                c.get_or_insert_with(|| format!("{name} #{seq} failed: {e}"));
            }
            // The peers still waiting on this rank in the failed operation learn at once that it left.
            for t in &inner.transports {
                t.close();
            }
            tracing::debug!(comm = %inner.cfg.name, rank = inner.rank, op = name, seq, error = %e, "collective failed; communicator closed");
        }
        if let Ok(mut turn) = inner.turn.lock() {
            *turn += 1;
        }
        inner.turn_cv.notify_all();
        result
    }

    /// Takes a ticket and, for a collective, its wire sequence number.
    pub(crate) fn ticket(&self) -> u64 {
        self.inner.next_ticket.fetch_add(1, Ordering::SeqCst)
    }

    pub(crate) fn next_coll_seq(&self) -> u64 {
        self.inner.coll_seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    pub(crate) fn next_p2p_seq(&self, peer: usize, send: bool) -> u64 {
        let c = if send { &self.inner.p2p_send[peer] } else { &self.inner.p2p_recv[peer] };
        (1 << 63) | (c.fetch_add(1, Ordering::SeqCst) + 1)
    }

    /// Runs an operation on the worker thread, in ticket order.
    pub(crate) fn spawn<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Communicator) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        let (tx, rx) = mpsc::channel();
        let comm = self.clone();
        let job: Job = Box::new(move || {
            let _ = tx.send(f(&comm));
        });
        let sent = (|| {
            let mut w = self.inner.worker.lock().ok()?;
            if w.is_none() {
                let (jtx, jrx) = mpsc::channel::<Job>();
                std::thread::Builder::new()
                    .name(format!("shoal-comm-{}-{}", self.inner.cfg.name, self.inner.rank))
                    .spawn(move || {
                        for job in jrx {
                            job();
                        }
                    })
                    .ok()?;
                *w = Some(jtx);
            }
            w.as_ref()?.send(job).ok()
        })();
        let ready = sent.is_none().then(|| Err(Error::Closed(format!("could not start the worker for {op}"))));
        Pending { rx, op, ready }
    }

    /// Moves one message out and one in, routing each to its transport.
    pub(crate) fn xchg(
        &self,
        op: &OpCtx,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, usize, Sink<'_>)>,
    ) -> Result<()> {
        let inner = &self.inner;
        let route = |peer: usize| -> Result<usize> {
            inner.route.get(peer).copied().flatten().ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} #{}: no link from rank {} to rank {peer}",
                    op.name, op.seq, inner.rank
                ))
            })
        };
        let st = send.map(|(p, _)| route(p)).transpose()?;
        let rt = recv.as_ref().map(|(p, _, _)| route(*p)).transpose()?;
        let send = send.map(|(peer, data)| SendReq { peer, data });
        let recv = recv.map(|(peer, len, sink)| RecvReq { peer, len, sink });
        match (st, rt) {
            (Some(a), Some(b)) if a != b => {
                // Two mechanisms: send on a helper thread, receive here.
                let (ts, tr) = (&inner.transports[a], &inner.transports[b]);
                std::thread::scope(|s| {
                    let h = s.spawn(|| ts.exchange(op, send, None));
                    let r = tr.exchange(op, None, recv);
                    let sr = h.join().unwrap_or_else(|_| Err(Error::Closed("send thread panicked".into())));
                    r.and(sr)
                })
            }
            (Some(i), _) | (None, Some(i)) => inner.transports[i].exchange(op, send, recv),
            (None, None) => Ok(()),
        }
    }

    /// Adds who had entered operation `seq` to a timeout or lost-peer error.
    /// Publishes this rank's own status at once and gives the others one
    /// publishing interval to show theirs, so the report is current.
    fn enrich(&self, e: Error, seq: u64) -> Error {
        if !e.is_peer_failure() {
            return e;
        }
        // The store may sit behind the very link that failed (another host, a cut cable), where each of its
        // calls waits for its own deadline: ask it on a thread, for at most REPORT_LIMIT, and otherwise report
        // what this rank's own links know.
        let asking = self.clone();
        let (tx, rx) = mpsc::channel();
        let asked = std::thread::Builder::new().name("shoal-comm-report".into()).spawn(move || {
            let inner = &asking.inner;
            if seq >> 63 == 0 {
                let (cur, name) = inner.current.lock().map(|c| (c.seq, c.name)).unwrap_or((seq, ""));
                let k = key(&inner.cfg.name, &format!("status/{}", inner.rank));
                let _ = inner.store.set(&k, format!("{cur} {name}").as_bytes());
                std::thread::sleep(STATUS_INTERVAL + Duration::from_millis(100));
            }
            let _ = tx.send(asking.participation(seq, true));
        });
        let known = asked.ok().and_then(|_| rx.recv_timeout(REPORT_LIMIT).ok());
        let fill = |p: &mut Participation| {
            *p = known.clone().unwrap_or_else(|| self.participation(seq, false));
        };
        match e {
            Error::Timeout { op, seq, rank, waited, waiting_for, mut participation, bytes_moved } => {
                fill(&mut participation);
                Error::Timeout { op, seq, rank, waited, waiting_for, participation, bytes_moved }
            }
            Error::PeerLost { op, seq, rank, peer, reason, mut participation, bytes_moved } => {
                fill(&mut participation);
                participation.arrived.retain(|&r| r != peer);
                if !participation.missing.contains(&peer) {
                    participation.missing.push(peer);
                    participation.missing.sort();
                }
                Error::PeerLost { op, seq, rank, peer, reason, participation, bytes_moved }
            }
            e => e,
        }
    }

    /// Which ranks are known to have entered operation `seq` (p2p sequence numbers
    /// are not comparable across ranks, so they report everyone as arrived).
    /// Who reached operation `seq`: from this rank's own links, and from the ranks' published status in the
    /// store when `ask_store`.
    fn participation(&self, seq: u64, ask_store: bool) -> Participation {
        let inner = &self.inner;
        let mut p = Participation::default();
        for r in 0..inner.size {
            if r == inner.rank || seq >> 63 == 1 {
                p.arrived.push(r);
                continue;
            }
            let local = inner.route[r].and_then(|i| inner.transports[i].peer_progress(r));
            let known = local.or_else(|| {
                if !ask_store {
                    return None;
                }
                let v = inner.store.try_get(&key(&inner.cfg.name, &format!("status/{r}"))).ok().flatten()?;
                String::from_utf8_lossy(&v).split(' ').next()?.parse::<u64>().ok()
            });
            if known.is_some_and(|s| s >= seq) {
                p.arrived.push(r);
            } else {
                p.missing.push(r);
            }
        }
        p
    }
}

fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect()
}

/// Publishes `status/{rank}` = "seq op" whenever it changes, a few times a second,
/// so that a failing rank can tell who had entered the operation it failed in.
fn spawn_status_publisher(weak: Weak<Inner>) {
    let _ = std::thread::Builder::new().name("shoal-comm-status".into()).spawn(move || {
        let mut last = 0u64;
        loop {
            std::thread::sleep(STATUS_INTERVAL);
            let Some(inner) = weak.upgrade() else { return };
            if inner.closed.lock().map(|c| c.is_some()).unwrap_or(true) {
                return;
            }
            let (seq, name) = inner.current.lock().map(|c| (c.seq, c.name)).unwrap_or((0, ""));
            if seq != last && seq >> 63 == 0 {
                let k = key(&inner.cfg.name, &format!("status/{}", inner.rank));
                if inner.store.set(&k, format!("{seq} {name}").as_bytes()).is_ok() {
                    last = seq;
                }
            }
        }
    });
}
