//! The prefetching loader: background threads turn a rank's planned batches (indices from the sampler) into
//! samples ahead of the training loop, into a bounded window of `prefetch` batches.
//!
//! Batches come out in plan order whatever the number of threads. The consumer's time blocked in
//! [`Loader::next`] is measured (the *data wait* of the step-time breakdown). Nothing waits without a deadline:
//! threads sleep in slices of at most 50 ms and check for shutdown; the consumer gives up after
//! [`LoaderConfig::timeout`]. Dropping the loader stops and joins its threads (a thread in the middle of a
//! `Dataset::get` finishes that call first).

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::invalid;
use crate::{Dataset, Error, RankBatch, Result, Sample, SamplerState};

const SLICE: Duration = Duration::from_millis(50);

/// Loader settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Batches fetched ahead of the consumer (K ≥ 1).
    pub prefetch: usize,
    /// Fetching threads (≥ 1).
    pub threads: usize,
    /// Longest wait for one batch before [`Error::Timeout`].
    pub timeout: Duration,
    /// Fault injection: each batch takes this much longer to load (a slow data source, for testing diagnosis).
    pub delay: Duration,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig { prefetch: 2, threads: 1, timeout: Duration::from_secs(60), delay: Duration::ZERO }
    }
}

/// A batch of samples, in the order of the planned indices.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Position of this batch in the loader's output (0, 1, 2, ...).
    pub seq: u64,
    pub epoch: u64,
    pub step: usize,
    pub indices: Vec<usize>,
    pub samples: Vec<Sample>,
    /// Samples in the global batch this rank's share belongs to.
    pub global_size: usize,
    /// The sampler state once this batch is consumed (for a checkpoint after this step).
    pub next: SamplerState,
    /// The epoch of every index when they are not all of `epoch` (see [`RankBatch::row_epochs`]).
    pub row_epochs: Vec<u64>,
}

impl Batch {
    /// The dense features of every sample, row-major (`rows × width`), with the width; `None` if a sample is not
    /// dense or the widths differ.
    pub fn dense(&self) -> Option<(Vec<f32>, usize)> {
        let width = self.samples.first().map_or(0, |s| s.features.len());
        let mut out = Vec::with_capacity(width * self.samples.len());
        for s in &self.samples {
            let d = s.features.as_dense().filter(|d| d.len() == width)?;
            out.extend_from_slice(d);
        }
        Some((out, width))
    }

    /// The class of every sample; `None` if a sample has no class label.
    pub fn classes(&self) -> Option<Vec<u32>> {
        self.samples.iter().map(Sample::class_label).collect()
    }

    /// Input tokens and target tokens of every sample, row-major, with the window width; `None` if a sample is not
    /// a token window or the widths differ.
    pub fn tokens(&self) -> Option<(Vec<u32>, Vec<u32>, usize)> {
        let width = self.samples.first().map_or(0, |s| s.features.len());
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for s in &self.samples {
            let x = s.features.as_tokens().filter(|x| x.len() == width)?;
            let crate::Label::Tokens(y) = &s.label else { return None };
            if y.len() != width {
                return None;
            }
            xs.extend_from_slice(x);
            ys.extend_from_slice(y);
        }
        Some((xs, ys, width))
    }
}

/// Counters of the consumer's side.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoaderStats {
    pub batches: u64,
    /// Time the consumer spent blocked in `next`, over all batches.
    pub total_wait: Duration,
    /// Time the consumer spent blocked for the last batch.
    pub last_wait: Duration,
}

type Plan = Box<dyn Iterator<Item = Result<RankBatch>> + Send>;

struct State {
    plan: Plan,
    next_dispatch: u64,
    next_consume: u64,
    ready: BTreeMap<u64, Result<Batch>>,
    /// The sequence number at which the plan ran out.
    end: Option<u64>,
    stop: bool,
    alive: usize,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    prefetch: u64,
    delay: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic never happens while the lock is held (dataset code runs unlocked), so poisoning is recoverable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, State>, slice: Duration) -> MutexGuard<'a, State> {
        self.cv.wait_timeout(g, slice).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0)
    }
}

/// Decrements the count of live threads however a thread ends, so the consumer can tell it is alone.
struct Alive(Arc<Shared>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.lock().alive -= 1;
        self.0.cv.notify_all();
    }
}

/// A background prefetcher of one rank's batches. See the [module docs](self).
pub struct Loader {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    timeout: Duration,
    stats: LoaderStats,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader").field("threads", &self.threads.len()).field("stats", &self.stats).finish()
    }
}

impl Loader {
    /// Starts fetching the batches of `plan` (e.g. [`DistributedSampler::epoch_batches`](crate::DistributedSampler))
    /// from `dataset`.
    pub fn new(
        dataset: Arc<dyn Dataset>,
        plan: impl Iterator<Item = RankBatch> + Send + 'static,
        cfg: LoaderConfig,
    ) -> Result<Self> {
        Loader::fallible(dataset, plan.map(Ok), cfg)
    }

    /// [`new`](Self::new) with a plan that can fail (e.g. [`crate::shards::ShardPlan`]): its error is the batch's,
    /// and the plan ends there.
    pub fn fallible(
        dataset: Arc<dyn Dataset>,
        plan: impl Iterator<Item = Result<RankBatch>> + Send + 'static,
        cfg: LoaderConfig,
    ) -> Result<Self> {
        if cfg.prefetch == 0 {
            return Err(invalid("prefetch", "must be at least 1"));
        }
        if cfg.threads == 0 {
            return Err(invalid("threads", "must be at least 1"));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                plan: Box::new(plan),
                next_dispatch: 0,
                next_consume: 0,
                ready: BTreeMap::new(),
                end: None,
                stop: false,
                alive: cfg.threads,
            }),
            cv: Condvar::new(),
            prefetch: cfg.prefetch as u64,
            delay: cfg.delay,
        });
        let mut threads = Vec::with_capacity(cfg.threads);
        for t in 0..cfg.threads {
            let (mine, dataset) = (Arc::clone(&shared), Arc::clone(&dataset));
            let spawned = std::thread::Builder::new()
                .name(format!("shoal-data-{t}"))
                .spawn(move || fetch_loop(&Alive(mine), dataset.as_ref()));
            match spawned {
                Ok(h) => threads.push(h),
                Err(e) => {
                    // Account for the threads that will never run, then let Drop stop the others.
                    shared.lock().alive -= cfg.threads - t;
                    drop(Loader { shared, threads, timeout: cfg.timeout, stats: LoaderStats::default() });
                    return Err(Error::Io { what: "spawning a loader thread".into(), source: e });
                }
            }
        }
        Ok(Loader { shared, threads, timeout: cfg.timeout, stats: LoaderStats::default() })
    }

    /// The next batch in plan order; `Ok(None)` once the plan is exhausted. A failed `get` comes back as
    /// [`Error::Load`] naming the index (later batches can still be taken). Blocks at most the configured timeout.
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        let started = Instant::now();
        let shared = Arc::clone(&self.shared);
        let mut g = shared.lock();
        let seq = g.next_consume;
        let out = loop {
            if let Some(r) = g.ready.remove(&seq) {
                g.next_consume += 1;
                shared.cv.notify_all();
                break r.map(Some);
            }
            if g.end.is_some_and(|end| seq >= end) {
                break Ok(None);
            }
            if g.alive == 0 {
                break Err(Error::LoaderGone { seq });
            }
            let waited = started.elapsed();
            if waited >= self.timeout {
                break Err(Error::Timeout { seq, waited });
            }
            g = shared.wait(g, SLICE.min(self.timeout - waited));
        };
        drop(g);
        let waited = started.elapsed();
        self.stats.last_wait = waited;
        self.stats.total_wait += waited;
        if matches!(out, Ok(Some(_)) | Err(Error::Load { .. })) {
            self.stats.batches += 1;
        }
        out
    }

    /// Consumer-side counters, including the data-wait time.
    /// Batches planned ahead of the consumer at most (`LoaderConfig::prefetch`): a batch is taken from the plan only
    /// once fewer than this many wait unconsumed.
    pub fn prefetch(&self) -> usize {
        self.shared.prefetch as usize
    }

    pub fn stats(&self) -> LoaderStats {
        self.stats
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.cv.notify_all();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

fn fetch_loop(alive: &Alive, dataset: &dyn Dataset) {
    let shared = &alive.0;
    loop {
        let mut g = shared.lock();
        // Wait for room in the window.
        while !g.stop && g.end.is_none() && g.next_dispatch >= g.next_consume + shared.prefetch {
            g = shared.wait(g, SLICE);
        }
        if g.stop || g.end.is_some() {
            return;
        }
        let seq = g.next_dispatch;
        let plan = match g.plan.next() {
            Some(Ok(plan)) => plan,
            Some(Err(e)) => {
                g.ready.insert(seq, Err(e));
                g.end = Some(seq + 1);
                shared.cv.notify_all();
                return;
            }
            None => {
                g.end = Some(seq);
                shared.cv.notify_all();
                return;
            }
        };
        g.next_dispatch += 1;
        drop(g);
        if !shared.delay.is_zero() {
            std::thread::sleep(shared.delay);
        }
        let samples: Result<Vec<Sample>> = plan
            .indices
            .iter()
            .map(|&index| dataset.get(index).map_err(|e| Error::Load { seq, index, source: Box::new(e) }))
            .collect();
        let batch = samples.map(|samples| Batch {
            seq,
            epoch: plan.epoch,
            step: plan.step,
            indices: plan.indices,
            samples,
            global_size: plan.global_size,
            next: plan.next,
            row_epochs: plan.row_epochs,
        });
        shared.lock().ready.insert(seq, batch);
        shared.cv.notify_all();
    }
}

impl Iterator for Loader {
    type Item = Result<Batch>;

    /// [`next_batch`](Loader::next_batch) as an iterator (ends at the end of the plan).
    fn next(&mut self) -> Option<Result<Batch>> {
        self.next_batch().transpose()
    }
}
