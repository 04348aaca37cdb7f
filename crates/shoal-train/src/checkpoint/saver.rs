//! Saving off the step loop: [`AsyncSaver`] hands each checkpoint to one background thread that saves it, prunes
//! to the newest `keep` and uploads it to a [`Mirror`] when there is one; the step loop pays only for its copy of
//! the tensors, into buffers of earlier saves (or prefaulted ones) so that the copy costs no page faults.

use crate::Real;
use std::path::Path;
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use super::dir::{CheckpointDir, SaveStats};
use super::error::{CheckpointError, Result};
use super::format::TensorData;
use super::manifest::ManifestMeta;

/// Default bound on how long `AsyncSaver::submit` (and drop) waits for the previous save.
const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(600);

struct Job {
    step: u64,
    model: Vec<TensorData>,
    optimizer: Vec<TensorData>,
    meta: ManifestMeta,
}

/// Test hook: lets a test hold the worker before it writes anything.
#[cfg(test)]
#[derive(Debug, Default)]
struct Gate {
    closed: Mutex<bool>,
    cv: std::sync::Condvar,
}

#[cfg(test)]
impl Gate {
    fn set_closed(&self, closed: bool) {
        *self.closed.lock().unwrap_or_else(|e| e.into_inner()) = closed;
        self.cv.notify_all();
    }

    fn wait_open(&self, max: Duration) {
        let g = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self.cv.wait_timeout_while(g, max, |closed| *closed);
    }
}

/// A second home for saved checkpoints (an object store: `crate::remote::RemoteStore`), written by the saver
/// thread after each local save.
pub trait Mirror: Send + Sync + std::fmt::Debug {
    /// Copies one saved step directory (`.../checkpoints/step-NNNNNN`), its manifest last.
    fn upload(&self, step_dir: &Path) -> Result<(), String>;
    /// Keeps the newest `keep` checkpoints there.
    fn prune(&self, keep: usize) -> Result<(), String>;
}

/// Saves checkpoints on one background thread, then prunes to the newest `keep`.
#[derive(Debug)]
pub struct AsyncSaver {
    dir: CheckpointDir,
    keep: usize,
    jobs: Option<mpsc::Sender<Job>>,
    results: Option<mpsc::Receiver<Result<SaveStats>>>,
    worker: Option<thread::JoinHandle<()>>,
    /// Step of the save in flight, if any.
    pending: Option<u64>,
    wait_timeout: Duration,
    last_wait: Duration,
    last_stats: Option<SaveStats>,
    /// Where every saved checkpoint is mirrored to (an object store).
    mirror: Option<Arc<dyn Mirror>>,
    /// Buffers of saved checkpoints, handed back for the next snapshot (their
    /// pages are already mapped, so copying into them costs no page faults).
    spare: Arc<Mutex<Vec<Vec<Real>>>>,
    /// Seconds the finished saves took, in total.
    saved_seconds: f64,
    /// Nice value of the saver thread (and the threads it starts), when set: the lowest priority keeps a save from
    /// preempting the training thread on a shared core.
    nice: Option<i32>,
    #[cfg(test)]
    gate: Arc<Gate>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("step", &self.step).finish_non_exhaustive()
    }
}

impl AsyncSaver {
    /// A saver for `dir` that keeps the newest `keep` valid checkpoints. The
    /// thread starts with the first `submit`.
    pub fn new(dir: CheckpointDir, keep: usize) -> Self {
        Self {
            dir,
            keep,
            jobs: None,
            results: None,
            worker: None,
            pending: None,
            wait_timeout: DEFAULT_WAIT_TIMEOUT,
            last_wait: Duration::ZERO,
            last_stats: None,
            mirror: None,
            spare: Arc::default(),
            saved_seconds: 0.0,
            nice: None,
            #[cfg(test)]
            gate: Arc::default(),
        }
    }

    /// Runs the saver thread (and the writer and hashing threads it starts) at nice value `nice` (19: the lowest
    /// priority), so that on a core it shares with the training thread a save takes only the time training leaves
    /// (Linux; elsewhere ignored).
    pub fn with_nice(mut self, nice: i32) -> Self {
        self.nice = Some(nice);
        self
    }

    /// Seconds the saves finished so far took (writing, hashing, fsync), in total.
    pub fn total_save_seconds(&self) -> f64 {
        self.saved_seconds
    }

    /// The tensor buffers of finished saves, in the order they were
    /// submitted, for [`TensorData::copy_from`] into the next snapshot.
    pub fn spare_buffers(&self) -> Vec<Vec<Real>> {
        std::mem::take(&mut *self.spare.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Allocates buffers of `sizes` (the snapshot's tensors, in order) on a
    /// background thread and writes every page once, so that the first
    /// snapshot copies into mapped memory instead of paying a page fault
    /// every 4 KiB inside the training loop's window. Buffers already handed
    /// back by a save take precedence.
    pub fn prefault(&self, sizes: Vec<usize>) {
        let spare = Arc::clone(&self.spare);
        let spawned = thread::Builder::new().name("shoal-ckpt-prefault".to_string()).spawn(move || {
            let bufs: Vec<Vec<Real>> = sizes
                .into_iter()
                .map(|n| {
                    let mut v = Vec::with_capacity(n);
                    v.resize(n, 0.0);
                    v
                })
                .collect();
            let mut spare = spare.lock().unwrap_or_else(|e| e.into_inner());
            if spare.is_empty() {
                *spare = bufs;
            }
        });
        if let Err(e) = spawned {
            tracing::debug!("no prefault thread: {e}");
        }
    }

    /// Also uploads every saved checkpoint to `remote` (on the saver thread) and prunes it to `keep` there.
    pub fn with_mirror(mut self, remote: Arc<dyn Mirror>) -> Self {
        self.mirror = Some(remote);
        self
    }

    /// Bound on how long `submit` (and drop) waits for a save still running
    /// (default 600 s).
    pub fn with_wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &CheckpointDir {
        &self.dir
    }

    /// Whether a save is in flight (submitted and its result not yet collected).
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// How long the last `submit` waited for the previous save.
    pub fn last_wait(&self) -> Duration {
        self.last_wait
    }

    /// Stats of the last save whose result was collected (by `submit` or `flush`).
    pub fn last_stats(&self) -> Option<&SaveStats> {
        self.last_stats.as_ref()
    }

    fn ensure_worker(&mut self) -> Result<()> {
        if self.jobs.is_some() {
            return Ok(());
        }
        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let (res_tx, res_rx) = mpsc::channel::<Result<SaveStats>>();
        let dir = self.dir.clone();
        let keep = self.keep;
        let mirror = self.mirror.clone();
        let spare = Arc::clone(&self.spare);
        let nice = self.nice;
        #[cfg(test)]
        let gate = Arc::clone(&self.gate);
        let handle = thread::Builder::new()
            .name("shoal-ckpt-saver".to_string())
            .spawn(move || {
                if let Some(nice) = nice {
                    set_thread_nice(nice);
                }
                while let Ok(job) = job_rx.recv() {
                    #[cfg(test)]
                    gate.wait_open(Duration::from_secs(60));
                    let Job { step, model, optimizer, meta } = job;
                    let mut res = dir.save_with_stats(step, &model, &optimizer, meta);
                    {
                        let mut spare = spare.lock().unwrap_or_else(|e| e.into_inner());
                        spare.clear();
                        spare.extend(model.into_iter().chain(optimizer).map(|t| t.data));
                    }
                    if let Ok(stats) = &mut res {
                        let t = Instant::now();
                        match dir.prune(keep) {
                            Ok(removed) => stats.pruned = removed,
                            Err(e) => tracing::warn!("pruning checkpoints failed: {e}"),
                        }
                        stats.prune_seconds = t.elapsed().as_secs_f64();
                    }
                    if let (Ok(stats), Some(m)) = (&mut res, &mirror) {
                        let t = Instant::now();
                        let up = m.upload(&stats.dir).and_then(|()| m.prune(keep));
                        stats.upload_seconds = t.elapsed().as_secs_f64();
                        if let Err(why) = up {
                            res = Err(CheckpointError::Remote { why });
                        }
                    }
                    if res_tx.send(res).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| CheckpointError::SaverGone { why: format!("cannot start: {e}") })?;
        self.jobs = Some(job_tx);
        self.results = Some(res_rx);
        self.worker = Some(handle);
        Ok(())
    }

    /// The worker is gone: forget it so that the next submit starts a new one.
    fn reap_worker(&mut self) -> CheckpointError {
        self.jobs = None;
        self.results = None;
        self.pending = None;
        let why = match self.worker.take().map(thread::JoinHandle::join) {
            Some(Err(_)) => "panicked".to_string(),
            _ => "exited".to_string(),
        };
        CheckpointError::SaverGone { why }
    }

    /// Waits up to `timeout` for the save in flight. `Ok(None)` if none.
    fn wait_pending(&mut self, timeout: Duration) -> Result<Option<SaveStats>> {
        let Some(step) = self.pending else { return Ok(None) };
        let Some(results) = &self.results else { return Err(self.reap_worker()) };
        let started = Instant::now();
        match results.recv_timeout(timeout) {
            Ok(res) => {
                self.pending = None;
                let stats = res?;
                self.saved_seconds += stats.seconds;
                self.last_stats = Some(stats.clone());
                Ok(Some(stats))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(CheckpointError::Timeout {
                what: format!("the checkpoint save of step {step}"),
                waited: started.elapsed(),
            }),
            // The worker only drops its sender by exiting, i.e. by panicking here.
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(self.reap_worker()),
        }
    }

    /// Hands a checkpoint to the background thread and returns at once; the
    /// caller has already made the copies (that copy is all the step loop pays
    /// for). If the previous save is still running, first waits for it (at
    /// most the wait timeout); returns how long it waited (also logged when
    /// over 1 ms, and kept in [`last_wait`](Self::last_wait)).
    ///
    /// If the previous save failed, the new save is still queued and the
    /// previous save's error is returned. If the wait times out, the error is
    /// `Timeout` and this checkpoint is dropped (not queued).
    pub fn submit(
        &mut self,
        step: u64,
        model: Vec<TensorData>,
        optimizer: Vec<TensorData>,
        meta: ManifestMeta,
    ) -> Result<Duration> {
        let started = Instant::now();
        let previous = match self.wait_pending(self.wait_timeout) {
            Err(e @ CheckpointError::Timeout { .. }) => return Err(e),
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
        let waited = started.elapsed();
        self.last_wait = waited;
        if waited > Duration::from_millis(1) {
            tracing::info!(step, waited_s = waited.as_secs_f64(), "checkpoint submit waited for the previous save");
        }
        self.ensure_worker()?;
        let job = Job { step, model, optimizer, meta };
        let sent = match &self.jobs {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        };
        if !sent {
            return Err(self.reap_worker());
        }
        self.pending = Some(step);
        previous.map(|()| waited)
    }

    /// Waits up to `timeout` for the save in flight and returns its result:
    /// `Ok(None)` if nothing was in flight. On `Timeout` the save stays in
    /// flight and a later `flush` can wait again.
    pub fn flush(&mut self, timeout: Duration) -> Result<Option<SaveStats>> {
        self.wait_pending(timeout)
    }
}

/// Sets the calling thread's nice value (Linux: per thread, inherited by the threads it starts).
fn set_thread_nice(nice: i32) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: plain syscalls on the calling thread; no memory is passed.
        let r = unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, nice)
        };
        if r != 0 {
            tracing::debug!("could not lower the saver thread's priority: {}", std::io::Error::last_os_error());
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

impl Drop for AsyncSaver {
    fn drop(&mut self) {
        if self.pending.is_some() {
            match self.wait_pending(self.wait_timeout) {
                Ok(_) => {}
                Err(e) => tracing::warn!("checkpoint save in flight at shutdown: {e}"),
            }
        }
        self.jobs = None; // closes the channel: an idle worker exits at once
        if self.pending.is_none() {
            if let Some(h) = self.worker.take() {
                let _ = h.join();
            }
        } else {
            tracing::warn!("leaving the checkpoint saver thread running (save timed out)");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::checkpoint::testing::{TempDir, TestResult, bits, meta, model, optimizer};

    #[test]
    fn async_saver_saves_in_background() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        let mut saver = AsyncSaver::new(cd.clone(), 2).with_wait_timeout(Duration::from_secs(120));
        assert!(saver.flush(Duration::from_secs(1))?.is_none());

        // Large-ish: 4 Mi floats (16 MiB).
        let big = vec![TensorData::new("w", vec![1024, 4096], (0..4 << 20).map(|i| i as Real).collect())];
        saver.gate.set_closed(true);
        saver.submit(1, big.clone(), optimizer(1.0), meta(0))?;
        // submit returned while the worker is held before writing a byte.
        assert!(saver.is_pending());
        assert!(!cd.step_dir(1).exists());
        let timeout = saver.flush(Duration::from_millis(50));
        assert!(matches!(timeout, Err(CheckpointError::Timeout { .. })), "{timeout:?}");
        assert!(saver.is_pending());
        saver.gate.set_closed(false);
        let stats = saver.flush(Duration::from_secs(120))?.ok_or("no stats")?;
        assert_eq!(stats.step, 1);
        assert_eq!(stats.dir, cd.step_dir(1));
        assert!(stats.bytes > 16 << 20);
        assert!(stats.seconds > 0.0 && stats.mb_per_s > 0.0);
        assert!(!saver.is_pending());
        assert!(saver.flush(Duration::from_secs(1))?.is_none());
        assert_eq!(bits(&cd.load(&stats.dir)?.model), bits(&big));

        // Back-to-back submits: the second waits for the first; pruning keeps 2.
        for s in 2..=4 {
            saver.submit(s, model(s as Real), optimizer(s as Real), meta(s))?;
        }
        let last = saver.flush(Duration::from_secs(120))?.ok_or("no stats")?;
        assert_eq!(last.step, 4);
        assert_eq!(saver.last_stats().map(|s| s.step), Some(4));
        let steps: Vec<u64> = cd.list()?.into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![3, 4]);
        Ok(())
    }

    #[test]
    fn async_saver_reports_errors() -> TestResult {
        let tmp = TempDir::new();
        // The output "directory" is a file: every save fails.
        let root = tmp.path().join("not-a-dir");
        fs::write(&root, b"x")?;
        let mut saver = AsyncSaver::new(CheckpointDir::new(&root), 1);
        saver.submit(1, model(1.0), optimizer(1.0), meta(0))?;
        // The first save's error comes back from the next submit.
        let err = saver.submit(2, model(1.0), optimizer(1.0), meta(0));
        assert!(matches!(err, Err(CheckpointError::Io { .. })), "{err:?}");
        // ... and the second one was still queued; its error comes from flush.
        let err = saver.flush(Duration::from_secs(60));
        assert!(matches!(err, Err(CheckpointError::Io { .. })), "{err:?}");
        assert!(saver.flush(Duration::from_secs(1))?.is_none());
        Ok(())
    }
}
