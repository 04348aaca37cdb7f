//! The heartbeat: a thread that tells the control plane, twice a second, that this rank lives and where it stands —
//! its phase, the steps it completed, the collective it is in (or finished last), its sequence number and for how
//! long ([`shoal_comm::Communicator::activity`]). It writes a [`Heartbeat`] to `heartbeat.rank-R.json` in the output
//! directory (a temporary file renamed over it, so a reader never sees half of one); the control loop reads it to
//! tell a live rank from a stopped one and to dump a hang. The step loop only stores a number (one atomic store per
//! step): nothing of the heartbeat runs on the training thread.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use shoal_comm::Communicator;
use shoal_wire::Heartbeat;

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
}

impl Phase {
    fn name(v: u8) -> &'static str {
        match v {
            0 => "resume",
            1 => "train",
            2 => "checkpoint",
            3 => "eval",
            _ => "finish",
        }
    }
}

#[derive(Debug, Default)]
struct Shared {
    step: AtomicU64,
    phase: AtomicU8,
    stop: AtomicBool,
    /// Where the state came from (`Heartbeat::resumed`), once known.
    resumed: std::sync::Mutex<Option<String>>,
}

/// The running heartbeat; it stops when dropped.
#[derive(Debug)]
pub(super) struct Beat {
    shared: Arc<Shared>,
}

/// The file rank `rank`'s heartbeat is written to in `output`.
pub fn heartbeat_file(output: &Path, rank: usize) -> PathBuf {
    output.join(format!("heartbeat.rank-{rank}.json"))
}

impl Beat {
    /// Starts the heartbeat thread of `rank` of `attempt`; `None` when the thread cannot be started (the run goes
    /// on without heartbeats, and says so in its log).
    pub(super) fn start(comm: Communicator, rank: usize, attempt: i64, output: &Path) -> Option<Beat> {
        let shared = Arc::new(Shared::default());
        let (s, path) = (shared.clone(), heartbeat_file(output, rank));
        let tmp = output.join(format!(".heartbeat.rank-{rank}.json.tmp"));
        let started = std::thread::Builder::new().name("shoal-heartbeat".into()).spawn(move || {
            let mut beat = 0u64;
            let mut warned = false;
            while !s.stop.load(Ordering::Relaxed) {
                beat += 1;
                let a = comm.activity();
                let hb = Heartbeat {
                    rank: rank as i64,
                    attempt,
                    pid: std::process::id(),
                    beat,
                    time_ms: now_ms(),
                    phase: Phase::name(s.phase.load(Ordering::Relaxed)).to_owned(),
                    step: s.step.load(Ordering::Relaxed),
                    op: a.op.to_owned(),
                    seq: a.seq,
                    in_op: a.in_op,
                    op_s: a.for_.as_secs_f64(),
                    ops_done: a.done,
                    resumed: s.resumed.lock().map(|r| r.clone()).unwrap_or_default(),
                };
                if let Err(e) = write(&tmp, &path, &hb)
                    && !warned
                {
                    warned = true;
                    tracing::warn!(rank, error = %e, path = %path.display(), "writing the heartbeat failed");
                }
                std::thread::sleep(INTERVAL);
            }
        });
        match started {
            Ok(_) => Some(Beat { shared }),
            Err(e) => {
                tracing::warn!(rank, error = %e, "the heartbeat thread could not start; no heartbeats");
                None
            }
        }
    }

    /// The steps completed so far.
    pub(super) fn step(&self, step: u64) {
        self.shared.step.store(step, Ordering::Relaxed);
    }

    /// Where the state came from: said in every later heartbeat.
    pub(super) fn resumed(&self, from: String) {
        if let Ok(mut r) = self.shared.resumed.lock() {
            *r = Some(from);
        }
    }

    pub(super) fn phase(&self, phase: Phase) {
        self.shared.phase.store(phase as u8, Ordering::Relaxed);
    }
}

impl Drop for Beat {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
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
