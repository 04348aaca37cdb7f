//! The heartbeat: a thread that tells the control plane, twice a second, that this rank lives and where it stands —
//! its phase, the steps it completed, the collective it is in (or finished last), its sequence number and for how
//! long ([`shoal_comm::Communicator::activity`]). It sends a [`Heartbeat`] over HTTP to the server that started the
//! task (`SHOAL_SERVER`, tagged with the job secret), so it works wherever the task runs — Slurm, Kubernetes, this
//! host; with no server, or while it cannot be reached, it writes `heartbeat.rank-R.json` in the output directory
//! instead (a temporary file renamed over it, so a reader never sees half of one). The control loop takes the newer
//! to tell a live rank from a stopped one and to dump a hang. A rank that fails says why at once
//! ([`Beat::fail`]: a collective's report reaches the job's events before the process has exited). The step loop only stores a number (one atomic store per
//! step): nothing of the heartbeat runs on the training thread.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use shoal_comm::Communicator;
use shoal_wire::{Heartbeat, HeartbeatReply, Regroup};

/// How often a heartbeat is written.
pub const INTERVAL: Duration = Duration::from_millis(500);

/// Where a rank stands in its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Phase {
    Resume = 0,
    Train = 1,
    /// Waiting for a checkpoint's copy to be handed to the saver (rank 0).
    Checkpoint = 2,
    /// A periodic evaluation.
    Eval = 3,
    Finish = 4,
    /// Leaving a group for the next one (an elastic job regrouping in place).
    Regroup = 5,
}

impl Phase {
    fn name(v: u8) -> &'static str {
        match v {
            0 => "resume",
            1 => "train",
            2 => "checkpoint",
            3 => "eval",
            5 => "regroup",
            _ => "finish",
        }
    }
}

#[derive(Debug, Default)]
struct Shared {
    /// Counts the heartbeats sent.
    beat: AtomicU64,
    step: AtomicU64,
    phase: AtomicU8,
    stop: AtomicBool,
    /// Where the state came from (`Heartbeat::resumed`), once known.
    resumed: std::sync::Mutex<Option<String>>,
    /// What `train.strategy = "auto"` chose and why (`Heartbeat::strategy`).
    chose: std::sync::Mutex<Option<String>>,
    /// The group generation the rank trains in.
    generation: AtomicU32,
    /// The newest group the server told of, not yet entered.
    regroup: std::sync::Mutex<Option<Regroup>>,
    /// Beat every [`HURRY`] instead of every [`INTERVAL`] (while waiting to hear of a new group).
    hurry: AtomicBool,
}

/// How often a rank that waits for its new group asks the server.
const HURRY: Duration = Duration::from_millis(50);

/// The running heartbeat; it stops when dropped.
pub(super) struct Beat {
    reporter: Arc<Reporter>,
    /// The heartbeat thread (woken to ask the server at once).
    thread: std::thread::Thread,
}

/// The file rank `rank`'s heartbeat is written to in `output`.
pub fn heartbeat_file(output: &Path, rank: usize) -> PathBuf {
    output.join(format!("heartbeat.rank-{rank}.json"))
}

/// The server end of the heartbeats: `POST {server}/api/v1/jobs/{job}/heartbeat`, each body tagged with the job
/// secret (`X-Shoal-Tag`, [`shoal_comm::auth::sign`]) so the server knows it comes from one of the job's tasks,
/// which the secret never leaves.
#[derive(Debug)]
pub(super) struct ServerLink {
    url: String,
    secret: Vec<u8>,
    agent: ureq::Agent,
}

/// The header that carries a heartbeat's tag.
pub const TAG_HEADER: &str = "x-shoal-tag";

impl ServerLink {
    /// The link to `server` (trusting the PEM certificates in `ca` when given) for `job`'s heartbeats.
    pub(super) fn new(server: &str, ca: Option<&str>, job: &str, secret: &[u8]) -> Result<ServerLink, String> {
        let mut tls = ureq::tls::TlsConfig::builder();
        if let Some(ca) = ca {
            let pem = std::fs::read(ca).map_err(|e| format!("{ca}: {e}"))?;
            let certs = ureq::tls::parse_pem(&pem)
                .filter_map(|item| match item {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c)),
                    Ok(_) => None,
                    Err(e) => Some(Err(e)),
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("{ca}: not a PEM certificate file: {e}"))?;
            tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&certs));
        }
        let agent =
            ureq::Agent::config_builder().timeout_global(Some(SEND_LIMIT)).tls_config(tls.build()).build().into();
        let url = format!("{}/api/v1/jobs/{job}/heartbeat", server.trim_end_matches('/'));
        Ok(ServerLink { url, secret: secret.to_vec(), agent })
    }

    /// Sends one heartbeat and reads the server's answer; an error says why it did not arrive.
    fn send(&self, hb: &Heartbeat) -> Result<HeartbeatReply, String> {
        let body = serde_json::to_vec(hb).map_err(|e| e.to_string())?;
        let tag = shoal_comm::auth::sign(&self.secret, &body).map_err(|e| e.to_string())?;
        let mut answer = self
            .agent
            .post(&self.url)
            .header(TAG_HEADER, &tag)
            .content_type("application/json")
            .send(&body[..])
            .map_err(|e| format!("{}: {e}", self.url))?;
        // An answer it cannot read still means the heartbeat arrived.
        let text = answer.body_mut().read_to_string().unwrap_or_default();
        Ok(serde_json::from_str::<HeartbeatReply>(&text).unwrap_or_default())
    }
}

/// A task starting into a running group tells the server it is there (one heartbeat, phase `join`, from the calling
/// thread) before it meets the group: the members are told of the group only then, and train on meanwhile.
pub(super) fn announce(link: &ServerLink, rank: usize, attempt: i64, generation: u32) -> Result<(), String> {
    link.send(&Heartbeat {
        rank: rank as i64,
        attempt,
        pid: std::process::id(),
        beat: 0,
        time_ms: now_ms(),
        phase: "join".into(),
        step: 0,
        op: String::new(),
        seq: 0,
        in_op: false,
        op_s: 0.0,
        ops_done: 0,
        resumed: None,
        strategy: None,
        error: None,
        generation,
    })
    .map(drop)
}

/// A task starting into a running group says it is there again every [`INTERVAL`] until its heartbeats start
/// (dropped then): meeting the group and building its data can take longer than the server waits for a heartbeat,
/// and a newcomer waiting for its group is not a dead one.
pub(super) struct Announcing {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::Thread>,
}

impl Announcing {
    /// Announces `rank` of `attempt` joining group `generation` now, from the calling thread (an error when the
    /// server cannot be told), then every [`INTERVAL`] from a thread of its own.
    pub(super) fn start(
        link: Arc<ServerLink>,
        rank: usize,
        attempt: i64,
        generation: u32,
    ) -> (Announcing, Result<(), String>) {
        let first = announce(&link, rank, attempt, generation);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("shoal-announce".into())
            .spawn(move || {
                loop {
                    std::thread::park_timeout(INTERVAL);
                    if flag.load(Ordering::Relaxed) {
                        break;
                    }
                    if let Err(e) = announce(&link, rank, attempt, generation) {
                        tracing::debug!(error = %e, "could not say again that this task joins group {generation}");
                    }
                }
            })
            .map(|h| h.thread().clone());
        if let Err(e) = &thread {
            tracing::warn!(error = %e, "no thread to say again that this task joins its group");
        }
        (Announcing { stop, thread: thread.ok() }, first)
    }
}

impl Drop for Announcing {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = &self.thread {
            t.unpark();
        }
    }
}

/// How long one heartbeat may take to reach the server before it goes to the file instead.
const SEND_LIMIT: Duration = Duration::from_secs(2);

/// What a heartbeat is built from, and where it goes.
struct Reporter {
    comm: std::sync::Mutex<Communicator>,
    rank: usize,
    attempt: i64,
    shared: Shared,
    link: Option<Arc<ServerLink>>,
    path: PathBuf,
    tmp: PathBuf,
}

impl Reporter {
    fn heartbeat(&self, error: Option<String>) -> Heartbeat {
        let s = &self.shared;
        let a = self.comm.lock().unwrap_or_else(|p| p.into_inner()).activity();
        Heartbeat {
            rank: self.rank as i64,
            attempt: self.attempt,
            pid: std::process::id(),
            beat: s.beat.fetch_add(1, Ordering::Relaxed) + 1,
            time_ms: now_ms(),
            phase: Phase::name(s.phase.load(Ordering::Relaxed)).to_owned(),
            step: s.step.load(Ordering::Relaxed),
            op: a.op.to_owned(),
            seq: a.seq,
            in_op: a.in_op,
            op_s: a.for_.as_secs_f64(),
            ops_done: a.done,
            resumed: s.resumed.lock().map(|r| r.clone()).unwrap_or_default(),
            strategy: s.chose.lock().map(|r| r.clone()).unwrap_or_default(),
            error,
            generation: s.generation.load(Ordering::Relaxed),
        }
    }

    /// Sends `hb` to the server, or writes it to the file when there is no server; when the server cannot be
    /// reached, writes the file and says why it was not heard.
    fn report(&self, hb: &Heartbeat) -> Result<(), String> {
        let write = || write(&self.tmp, &self.path, hb).map_err(|e| format!("{}: {e}", self.path.display()));
        match self.link.as_ref().map(|link| link.send(hb)) {
            None => write(),
            Some(Ok(reply)) => {
                // Compared under the lock the rank takes the group under: an answer to a beat sent before the rank
                // entered that group cannot bring it back.
                if let Some(next) = reply.regroup
                    && let Ok(mut r) = self.shared.regroup.lock()
                    && next.generation > self.shared.generation.load(Ordering::Relaxed)
                    && r.as_ref().is_none_or(|old| old.generation < next.generation)
                {
                    tracing::info!(
                        generation = next.generation,
                        rank = next.rank,
                        world = next.world,
                        "told of a new group"
                    );
                    *r = Some(next);
                }
                Ok(())
            }
            Some(Err(why)) => write().and(Err(why)),
        }
    }
}

impl Beat {
    /// Starts the heartbeat thread of `rank` of `attempt` (to `link` when given, else or meanwhile to a file in
    /// `output`); `None` when the thread cannot be started (the run goes on without heartbeats, and says so in its
    /// log).
    pub(super) fn start(
        comm: Communicator,
        rank: usize,
        attempt: i64,
        generation: u32,
        output: &Path,
        link: Option<Arc<ServerLink>>,
    ) -> Option<Beat> {
        // The first beat already names the group the rank trains in: a rank that joined group g must not be told
        // of g again, as if it were a member yet to enter it.
        let shared = Shared::default();
        shared.generation.store(generation, Ordering::Relaxed);
        let reporter = Arc::new(Reporter {
            comm: std::sync::Mutex::new(comm),
            rank,
            attempt,
            shared,
            link,
            path: heartbeat_file(output, rank),
            tmp: output.join(format!(".heartbeat.rank-{rank}.json.tmp")),
        });
        let r = reporter.clone();
        let started = std::thread::Builder::new().name("shoal-heartbeat".into()).spawn(move || {
            let mut warned = false;
            while !r.shared.stop.load(Ordering::Relaxed) {
                let hb = r.heartbeat(None);
                if let Err(e) = r.report(&hb)
                    && !warned
                {
                    warned = true;
                    tracing::warn!(rank, error = %e, "a heartbeat did not reach the server; written to its file");
                }
                // A rank starting to wait for its new group unparks this thread, which then asks every HURRY.
                let pause = if r.shared.hurry.load(Ordering::Relaxed) { HURRY } else { INTERVAL };
                std::thread::park_timeout(pause);
            }
        });
        match started {
            Ok(h) => Some(Beat { reporter, thread: h.thread().clone() }),
            Err(e) => {
                tracing::warn!(rank, error = %e, "the heartbeat thread could not start; no heartbeats");
                None
            }
        }
    }

    /// Tells the control plane at once, from the calling thread, why this rank fails (before it exits), and stops
    /// the heartbeats.
    pub(super) fn fail(&self, why: &str) {
        self.reporter.shared.stop.store(true, Ordering::Relaxed);
        let hb = self.reporter.heartbeat(Some(why.to_owned()));
        if let Err(e) = self.reporter.report(&hb) {
            tracing::warn!(rank = self.reporter.rank, error = %e, "the failure report did not reach the server");
        }
    }

    /// The steps completed so far.
    pub(super) fn step(&self, step: u64) {
        self.reporter.shared.step.store(step, Ordering::Relaxed);
    }

    /// Where the state came from: said at once (a short run may end before the next beat), and in every later
    /// heartbeat.
    pub(super) fn resumed(&self, from: String) {
        if let Ok(mut r) = self.reporter.shared.resumed.lock() {
            *r = Some(from);
        }
        self.thread.unpark();
    }

    /// What `train.strategy = "auto"` chose, and why: said at once from the calling thread (a short run may end
    /// before the heartbeat thread runs again), and in every later heartbeat.
    pub(super) fn chose(&self, why: String) {
        if let Ok(mut c) = self.reporter.shared.chose.lock() {
            *c = Some(why);
        }
        let hb = self.reporter.heartbeat(None);
        if let Err(e) = self.reporter.report(&hb) {
            tracing::debug!(rank = self.reporter.rank, error = %e, "what the planner chose is said with the next beat");
            self.thread.unpark();
        }
    }

    pub(super) fn phase(&self, phase: Phase) {
        self.reporter.shared.phase.store(phase as u8, Ordering::Relaxed);
    }

    /// Whether the server told of a group newer than the one the rank trains in.
    pub(super) fn regroup_pending(&self) -> bool {
        self.reporter.shared.regroup.lock().is_ok_and(|r| r.is_some())
    }

    /// Waits until the server tells of a newer group, asking it every [`HURRY`], for at most `limit`.
    pub(super) fn wait_regroup(&self, limit: Duration) -> Option<Regroup> {
        let s = &self.reporter.shared;
        s.hurry.store(true, Ordering::Relaxed);
        self.thread.unpark();
        let deadline = std::time::Instant::now() + limit;
        let found = loop {
            let taken = s.regroup.lock().ok().and_then(|mut r| {
                let next = r.take()?;
                // Taken with the lock held: the answers to heartbeats sent before the rank enters it do not bring
                // it back.
                s.generation.store(next.generation, Ordering::Relaxed);
                Some(next)
            });
            if let Some(r) = taken {
                break Some(r);
            }
            if std::time::Instant::now() >= deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        s.hurry.store(false, Ordering::Relaxed);
        found
    }

    /// The rank trains over `comm` now: the communicator of its new group, or of the group it joined.
    pub(super) fn regrouped(&self, generation: u32, comm: Communicator) {
        let s = &self.reporter.shared;
        match s.regroup.lock() {
            Ok(mut r) => {
                s.generation.store(generation, Ordering::Relaxed);
                if r.as_ref().is_some_and(|old| old.generation <= generation) {
                    *r = None;
                }
            }
            Err(_) => s.generation.store(generation, Ordering::Relaxed),
        }
        *self.reporter.comm.lock().unwrap_or_else(|p| p.into_inner()) = comm;
    }
}

impl Drop for Beat {
    fn drop(&mut self) {
        self.reporter.shared.stop.store(true, Ordering::Relaxed);
        self.thread.unpark();
    }
}

fn write(tmp: &Path, path: &Path, hb: &Heartbeat) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(hb).map_err(std::io::Error::other)?;
    std::fs::write(tmp, bytes)?;
    std::fs::rename(tmp, path)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of its own for `tag`'s heartbeat files, and a world of one rank.
    fn solo(tag: &str) -> anyhow::Result<(PathBuf, Communicator)> {
        let dir = std::env::temp_dir().join(format!("shoal-beat-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let comm = Communicator::local_world(1, Default::default())?.pop();
        Ok((dir, comm.ok_or_else(|| anyhow::anyhow!("a world of one"))?))
    }

    /// A task that joined group 2 says so from its very first beat: a beat naming group 0 would have the server
    /// tell it of group 2 again, and the rank would leave the group it is in for one that already formed.
    #[test]
    fn a_joined_rank_names_its_group_from_the_first_beat() -> anyhow::Result<()> {
        let (dir, comm) = solo("joined")?;
        let beat = Beat::start(comm, 3, 1, 2, &dir, None).ok_or_else(|| anyhow::anyhow!("the heartbeat thread"))?;
        let file = heartbeat_file(&dir, 3);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let first: Heartbeat = loop {
            if let Ok(bytes) = std::fs::read(&file) {
                break serde_json::from_slice(&bytes)?;
            }
            anyhow::ensure!(std::time::Instant::now() < deadline, "no heartbeat in {} within 10 s", file.display());
            std::thread::sleep(Duration::from_millis(5));
        };
        drop(beat);
        assert_eq!((first.rank, first.attempt, first.generation), (3, 1, 2), "{first:?}");
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    /// A rank that entered group 2 forgets a pending word of group 2 (an answer to a beat sent before it entered),
    /// and keeps a word of a newer group.
    #[test]
    fn entering_a_group_forgets_older_words_of_it_and_keeps_newer_ones() -> anyhow::Result<()> {
        let (dir, comm) = solo("regroup")?;
        let beat = Beat::start(comm.clone(), 0, 1, 0, &dir, None).ok_or_else(|| anyhow::anyhow!("the thread"))?;
        let word = |generation| Regroup { generation, rank: 0, world: 1, rendezvous: String::new(), members: vec![0] };
        let set = |r: Regroup| -> anyhow::Result<()> {
            *beat.reporter.shared.regroup.lock().map_err(|_| anyhow::anyhow!("poisoned"))? = Some(r);
            Ok(())
        };
        set(word(2))?;
        beat.regrouped(2, comm.clone());
        assert!(!beat.regroup_pending());
        set(word(3))?;
        beat.regrouped(2, comm);
        assert!(beat.regroup_pending());
        assert_eq!(beat.wait_regroup(Duration::from_millis(1)).map(|r| r.generation), Some(3));
        assert!(!beat.regroup_pending());
        drop(beat);
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
