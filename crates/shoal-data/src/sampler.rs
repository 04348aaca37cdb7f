//! The distributed sampler: which samples each rank takes at each step.
//!
//! Every epoch has its own deterministic order: a permutation of `0..len` keyed by `(seed, epoch)` (or the index
//! order when shuffling is off). That order is cut into *global batches* of `global_batch` samples, and each global
//! batch into `world_size` contiguous near-equal rank shares. So the global batch at a step depends only on
//! `(seed, epoch, position)` and never on the world size, which is what allows resuming a checkpoint at a different
//! world size: the cursor ([`SamplerState`]) counts *global* samples consumed in the epoch, not per-rank ones.
//!
//! Tail policy, when `len` is not a multiple of `global_batch` ([`Tail`]):
//! - `Partial` (default): the last global batch is smaller; every sample is seen exactly once per epoch. A rank's
//!   share of that batch may be smaller than the others' (even empty), but every rank still takes the step, so all
//!   ranks run the same number of steps.
//! - `DropLast`: the last `len % global_batch` samples of the epoch's order are skipped (a different set each epoch
//!   when shuffling); every global batch is full; no sample is seen twice.
//! - `Pad`: the last global batch is filled up with the first samples of the epoch's order, so those are seen
//!   twice; every global batch is full and nothing is skipped.
//!
//! A dataset read in blocks (a lake table's row groups, [`crate::lake::LakeTable`]) is ordered by [`Lanes`] instead
//! of a permutation of every index: each epoch the blocks are shuffled and laid end to end, that stream is cut into
//! `lanes` equal runs, and every global batch takes `global_batch / lanes` consecutive rows of each run, shuffled
//! within windows of [`LANE_WINDOW`] rows. A rank's share of a global batch is then a few whole runs' parts, so the
//! ranks read different blocks, each block from start to end, holding a few at a time; the global batch still
//! depends only on `(seed, epoch, position)`, not on the world size. The runs' tails that do not fill a global batch
//! are left out of the epoch (a different set each epoch).
//!
//! With [`Shares`] (`train.balance = "dynamic"`), a global batch is cut into contiguous rank shares in proportion
//! to integer weights instead of equally; the shares change only at global batch numbers set in advance, the same
//! on every rank, so the global batch itself is untouched and every sample is still taken once.
//!
//! A global batch larger than the dataset is refused under `Partial` (every step would silently take the whole
//! dataset instead) and `DropLast` (nothing would be left); only `Pad` fills it up.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::invalid;
use crate::partition::{block, check_rank};
use crate::{Error, Result};

/// What to do with the last, incomplete global batch of an epoch (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tail {
    #[default]
    Partial,
    DropLast,
    Pad,
}

/// The sampler's fixed parameters; the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerConfig {
    /// Samples in the dataset.
    pub len: usize,
    /// Samples per step over all ranks together.
    pub global_batch: usize,
    pub seed: u64,
    /// Shuffle each epoch (otherwise index order).
    pub shuffle: bool,
    pub tail: Tail,
}

impl SamplerConfig {
    /// Shuffled, seed 0, `Tail::Partial`.
    pub fn new(len: usize, global_batch: usize) -> Self {
        SamplerConfig { len, global_batch, seed: 0, shuffle: true, tail: Tail::Partial }
    }

    /// Global samples in one epoch after the tail policy.
    pub fn samples_per_epoch(&self) -> usize {
        let full = self.len / self.global_batch * self.global_batch;
        match self.tail {
            Tail::Partial => self.len,
            Tail::DropLast => full,
            Tail::Pad if full == self.len => full,
            Tail::Pad => full + self.global_batch,
        }
    }

    /// Steps (global batches) in one epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.samples_per_epoch().div_ceil(self.global_batch)
    }
}

/// Where a sampler stands: the epoch, and the number of *global* samples of that epoch already consumed. Saved in
/// checkpoints; valid at any world size with the same [`SamplerConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SamplerState {
    pub epoch: u64,
    pub position: usize,
}

/// One rank's share of one global batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankBatch {
    pub epoch: u64,
    /// Step within the epoch (`0..batches_per_epoch`).
    pub step: usize,
    /// This rank's dataset indices (possibly empty in a `Partial` tail).
    pub indices: Vec<usize>,
    /// Samples in the whole global batch (for weighting this rank's loss: `indices.len() / global_size`).
    pub global_size: usize,
    /// The sampler state once this batch is consumed: what a checkpoint taken after this step records.
    pub next: SamplerState,
    /// The epoch of every index when they are not all of `epoch` (under dynamic sharding a batch may span two);
    /// empty otherwise.
    pub row_epochs: Vec<u64>,
}

/// Rows of a lane shuffled together.
pub const LANE_WINDOW: usize = 4096;

/// The order of a dataset read in blocks (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lanes {
    /// The blocks' index ranges, in the dataset's order; together they cover `0..len` once.
    pub blocks: Arc<[std::ops::Range<usize>]>,
    /// Runs every global batch draws from in equal parts: must divide the global batch.
    pub lanes: usize,
}

/// Rank shares set during training (see the [module docs](self)): from a global batch number on (counted over
/// epochs, `epoch × batches_per_epoch + step`), global batches are cut in proportion to integer weights, one a
/// rank. Shared by the sampler's clones (the loader's among them) and the loop that sets them.
#[derive(Debug, Default)]
pub struct Shares {
    plan: std::sync::Mutex<Vec<(u64, Arc<[u32]>)>>,
}

impl Shares {
    /// From global batch number `from` on, cut batches by `weights` (one a rank; all zero means equally). Settings
    /// must come in increasing `from`; an earlier one than the last is ignored.
    pub fn set_from(&self, from: u64, weights: Vec<u32>) {
        let mut plan = self.plan.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if plan.last().is_none_or(|(f, _)| *f <= from) {
            plan.push((from, weights.into()));
        }
    }

    /// The weights set last, if any.
    pub fn latest(&self) -> Option<Arc<[u32]>> {
        let plan = self.plan.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        plan.last().map(|(_, w)| Arc::clone(w))
    }

    /// The weights that cut global batch `batch`, if any were set for it.
    pub fn at(&self, batch: u64) -> Option<Arc<[u32]>> {
        let plan = self.plan.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        plan.iter().rev().find(|(f, _)| *f <= batch).map(|(_, w)| Arc::clone(w))
    }
}

/// Rank `rank`'s contiguous part of `n` items cut in proportion to `weights` (equally when they sum to zero or do
/// not have one a rank).
pub fn weighted_share(n: usize, weights: &[u32], world: usize, rank: usize) -> std::ops::Range<usize> {
    let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
    if weights.len() != world || total == 0 {
        return block(n, world, rank);
    }
    let cum = |r: usize| weights[..r].iter().map(|&w| u64::from(w)).sum::<u64>();
    let at = |c: u64| usize::try_from(n as u128 * u128::from(c) / u128::from(total)).unwrap_or(n);
    at(cum(rank))..at(cum(rank + 1))
}

/// One epoch of a [`Lanes`] order: the blocks in the epoch's order, with where each starts in the stream.
#[derive(Debug)]
struct LaneEpoch {
    blocks: Vec<std::ops::Range<usize>>,
    starts: Vec<usize>,
    /// Rows of the stream each lane owns, and the part of them an epoch reads (a whole number of `per`).
    lane_len: usize,
    usable: usize,
    /// Rows of each lane in a global batch, and the lanes.
    per: usize,
    lanes: usize,
    key: [u64; 2],
}

/// How an epoch's positions become dataset indices.
#[derive(Debug, Clone)]
enum Order {
    Index,
    Permutation(Arc<[usize]>),
    Lanes(Arc<LaneEpoch>),
}

/// A deterministic, resumable sampler giving each rank its share of each global batch. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    cfg: SamplerConfig,
    world_size: usize,
    rank: usize,
    state: SamplerState,
    order: Order,
    lanes: Option<Lanes>,
    shares: Option<Arc<Shares>>,
}

impl DistributedSampler {
    /// A sampler at epoch 0, position 0. Errors: an empty dataset, a zero global batch, a global batch smaller than
    /// the world size, `Partial` or `DropLast` with fewer samples than one global batch, a bad rank.
    pub fn new(cfg: SamplerConfig, world_size: usize, rank: usize) -> Result<Self> {
        Self::build(cfg, None, world_size, rank)
    }

    /// [`new`](Self::new) with an order by lanes: the epoch's order is made once, by lanes (a permutation of every
    /// index of a large table would take memory in proportion to it).
    fn build(cfg: SamplerConfig, lanes: Option<Lanes>, world_size: usize, rank: usize) -> Result<Self> {
        check_rank(world_size, rank)?;
        if cfg.len == 0 {
            return Err(invalid("sampler", "the dataset is empty"));
        }
        if cfg.global_batch == 0 {
            return Err(invalid("global_batch", "must be at least 1"));
        }
        if cfg.global_batch < world_size {
            return Err(invalid(
                "global_batch",
                format!("{} is smaller than the world size {world_size}", cfg.global_batch),
            ));
        }
        if cfg.tail == Tail::Partial && cfg.global_batch > cfg.len {
            return Err(invalid(
                "global_batch",
                format!(
                    "{} exceeds the {} samples: every step would take only {}; use a smaller global batch or the \
                     pad tail policy",
                    cfg.global_batch, cfg.len, cfg.len
                ),
            ));
        }
        if cfg.samples_per_epoch() == 0 {
            return Err(invalid(
                "global_batch",
                format!("{} exceeds the {} samples and the tail policy is drop_last", cfg.global_batch, cfg.len),
            ));
        }
        let mut s = DistributedSampler {
            cfg,
            world_size,
            rank,
            state: SamplerState::default(),
            order: Order::Index,
            lanes,
            shares: None,
        };
        s.set_epoch(0);
        Ok(s)
    }

    /// A sampler over a dataset read in blocks, ordered by `lanes` (see the [module docs](self)); `cfg.len` is the
    /// dataset's length and the tail policy is `DropLast` whatever `cfg` says. Errors as [`DistributedSampler::new`],
    /// and: lanes that do not divide the global batch, blocks that do not cover the dataset, runs shorter than a
    /// global batch's part.
    pub fn with_lanes(cfg: SamplerConfig, lanes: Lanes, world_size: usize, rank: usize) -> Result<Self> {
        let l = lanes.lanes;
        if l == 0 || !cfg.global_batch.is_multiple_of(l) {
            return Err(invalid("lanes", format!("{l} does not divide the global batch {}", cfg.global_batch)));
        }
        let covered: usize = lanes.blocks.iter().map(|b| b.len()).sum();
        if covered != cfg.len {
            return Err(invalid("lanes", format!("the blocks cover {covered} rows of {}", cfg.len)));
        }
        let per = cfg.global_batch / l;
        let lane_len = cfg.len / l;
        let usable = lane_len / per * per * l;
        if usable == 0 {
            return Err(invalid(
                "global_batch",
                format!(
                    "{} needs at least {} rows in each of {l} lanes; the dataset has {}",
                    cfg.global_batch, per, cfg.len
                ),
            ));
        }
        let cfg = SamplerConfig { len: usable, tail: Tail::DropLast, ..cfg };
        DistributedSampler::build(cfg, Some(lanes), world_size, rank)
    }

    /// Cuts global batches by `shares` from now on (and in every clone made after).
    pub fn with_shares(mut self, shares: Arc<Shares>) -> Self {
        self.shares = Some(shares);
        self
    }

    /// The number of the global batch at the current position, counted over epochs (what [`Shares`] are set by).
    pub fn batch_number(&self) -> u64 {
        self.batch_number_at(self.state)
    }

    /// The number of the next global batch a sampler at `state` gives.
    pub fn batch_number_at(&self, state: SamplerState) -> u64 {
        let bpe = self.batches_per_epoch() as u64;
        match state.position >= self.cfg.samples_per_epoch() {
            true => (state.epoch + 1) * bpe,
            false => state.epoch * bpe + (state.position / self.cfg.global_batch) as u64,
        }
    }

    /// Rank `rank`'s number of samples in global batch number `batch` (as [`next_batch`](Self::next_batch) cuts
    /// it, by the shares set for that batch).
    pub fn share_len(&self, batch: u64, rank: usize) -> usize {
        let n = self.cfg.global_batch;
        let step = (batch % self.batches_per_epoch() as u64) as usize;
        let size = self.cfg.samples_per_epoch().saturating_sub(step * n).min(n);
        match self.shares.as_ref().and_then(|s| s.at(batch)) {
            Some(w) => weighted_share(size, &w, self.world_size, rank).len(),
            None => block(size, self.world_size, rank).len(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn epoch(&self) -> u64 {
        self.state.epoch
    }

    /// Steps in one epoch (the same on every rank).
    pub fn batches_per_epoch(&self) -> usize {
        self.cfg.batches_per_epoch()
    }

    /// Moves to the start of `epoch`.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.state = SamplerState { epoch, position: 0 };
        self.order = match &self.lanes {
            Some(lanes) => Order::Lanes(Arc::new(self.lane_epoch(lanes, epoch))),
            None if self.cfg.shuffle => Order::Permutation(
                crate::rng::permutation(self.cfg.len, &[self.cfg.seed, epoch, self.cfg.len as u64]).into(),
            ),
            None => Order::Index,
        };
    }

    fn lane_epoch(&self, lanes: &Lanes, epoch: u64) -> LaneEpoch {
        let n = lanes.blocks.len();
        let blocks: Vec<_> = if self.cfg.shuffle {
            crate::rng::permutation(n, &[self.cfg.seed, epoch, n as u64, 0x1a7e])
                .iter()
                .map(|&k| lanes.blocks[k].clone())
                .collect()
        } else {
            lanes.blocks.to_vec()
        };
        let mut starts = Vec::with_capacity(n);
        let mut at = 0;
        for b in &blocks {
            starts.push(at);
            at += b.len();
        }
        LaneEpoch {
            blocks,
            starts,
            lane_len: at / lanes.lanes,
            usable: self.cfg.len / lanes.lanes,
            per: self.cfg.global_batch / lanes.lanes,
            lanes: lanes.lanes,
            key: [self.cfg.seed, epoch],
        }
    }

    /// The cursor, for a checkpoint.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// Continues from a saved cursor (possibly saved at another world size). The position must be a step boundary
    /// of this configuration.
    pub fn restore(&mut self, state: SamplerState) -> Result<()> {
        let spe = self.cfg.samples_per_epoch();
        if state.position > spe || (!state.position.is_multiple_of(self.cfg.global_batch) && state.position != spe) {
            return Err(Error::Invalid {
                what: "sampler state",
                reason: format!(
                    "position {} is not a step boundary of an epoch of {spe} samples in global batches of {}",
                    state.position, self.cfg.global_batch
                ),
            });
        }
        self.set_epoch(state.epoch);
        self.state.position = state.position;
        Ok(())
    }

    fn at(&self, position: usize) -> usize {
        let p = position % self.cfg.len; // wraps only for `Pad`
        match &self.order {
            Order::Index => p,
            Order::Permutation(o) => o[p],
            Order::Lanes(e) => e.index(p, self.cfg.shuffle),
        }
    }

    /// The whole global batch (all ranks' indices, rank 0's first) at the current position, without moving.
    pub fn peek_global(&self) -> Vec<usize> {
        let end = (self.state.position + self.cfg.global_batch).min(self.cfg.samples_per_epoch());
        (self.state.position..end).map(|p| self.at(p)).collect()
    }

    /// This rank's share of the next global batch of the current epoch, or `None` at the end of the epoch (call
    /// [`set_epoch`](Self::set_epoch) to go on, or use [`next_batch_cycling`](Self::next_batch_cycling)).
    pub fn next_batch(&mut self) -> Option<RankBatch> {
        let start = self.state.position;
        let end = (start + self.cfg.global_batch).min(self.cfg.samples_per_epoch());
        if start >= end {
            return None;
        }
        let weights = self.shares.as_ref().and_then(|s| s.at(self.batch_number()));
        let share = match weights {
            Some(w) => weighted_share(end - start, &w, self.world_size, self.rank),
            None => block(end - start, self.world_size, self.rank),
        };
        let indices = (start + share.start..start + share.end).map(|p| self.at(p)).collect();
        self.state.position = end;
        Some(RankBatch {
            epoch: self.state.epoch,
            step: start / self.cfg.global_batch,
            indices,
            global_size: end - start,
            next: self.state,
            row_epochs: Vec::new(),
        })
    }

    /// Like [`next_batch`](Self::next_batch), but moves on to the next epoch at the end of one.
    pub fn next_batch_cycling(&mut self) -> RankBatch {
        if self.state.position >= self.cfg.samples_per_epoch() {
            self.set_epoch(self.state.epoch + 1);
        }
        // An epoch always has at least one batch (checked in `new`).
        self.next_batch().unwrap_or_else(|| unreachable!("an epoch has at least one batch"))
    }

    /// The remaining batches of the current epoch, as an iterator (for [`Loader`](crate::Loader)).
    pub fn epoch_batches(&self) -> EpochBatches {
        EpochBatches(self.clone())
    }

    /// All batches from here on, across epochs, without end.
    pub fn cycling_batches(&self) -> CyclingBatches {
        CyclingBatches(self.clone())
    }
}

impl LaneEpoch {
    /// The dataset index at `position` of the epoch.
    fn index(&self, position: usize, shuffle: bool) -> usize {
        let global = self.per * self.lanes;
        let (batch, offset) = (position / global, position % global);
        let (lane, i) = (offset / self.per, offset % self.per);
        let mut k = batch * self.per + i;
        if shuffle {
            let w = k / LANE_WINDOW;
            let size = LANE_WINDOW.min(self.usable - w * LANE_WINDOW);
            k = w * LANE_WINDOW + permute(k % LANE_WINDOW, size, &[self.key[0], self.key[1], lane as u64, w as u64]);
        }
        let s = lane * self.lane_len + k;
        let j = self.starts.partition_point(|&st| st <= s).saturating_sub(1);
        self.blocks[j].start + (s - self.starts[j])
    }
}

/// `i`'s place in a permutation of `0..n` keyed by `key`: a 4-round Feistel network over the smallest even number
/// of bits that holds `n`, walked round its cycle until it lands inside `0..n`.
pub(crate) fn permute(i: usize, n: usize, key: &[u64]) -> usize {
    if n <= 1 {
        return i;
    }
    let bits = (usize::BITS - (n - 1).leading_zeros()).max(2);
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let round_keys: Vec<u64> = (0..4u64)
        .map(|r| crate::rng::SplitMix64::from_key(&[key.iter().fold(r, |h, &k| h.rotate_left(17) ^ k), r]).next_u64())
        .collect();
    let mut x = i as u64;
    loop {
        for rk in &round_keys {
            let (l, r) = (x >> half, x & mask);
            let f = crate::rng::SplitMix64::from_key(&[r, *rk]).next_u64() & mask;
            x = (r << half) | (l ^ f);
        }
        if (x as usize) < n {
            return x as usize;
        }
    }
}

/// See [`DistributedSampler::epoch_batches`].
#[derive(Debug, Clone)]
pub struct EpochBatches(DistributedSampler);

impl Iterator for EpochBatches {
    type Item = RankBatch;
    fn next(&mut self) -> Option<RankBatch> {
        self.0.next_batch()
    }
}

/// See [`DistributedSampler::cycling_batches`].
#[derive(Debug, Clone)]
pub struct CyclingBatches(DistributedSampler);

impl Iterator for CyclingBatches {
    type Item = RankBatch;
    fn next(&mut self) -> Option<RankBatch> {
        Some(self.0.next_batch_cycling())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samplers(cfg: SamplerConfig, world: usize) -> Vec<DistributedSampler> {
        (0..world).map(|r| DistributedSampler::new(cfg, world, r).expect("valid")).collect()
    }

    /// Runs every rank through one epoch; returns the global batches (concatenated rank shares) per step.
    fn run_epoch(ss: &mut [DistributedSampler]) -> Vec<Vec<usize>> {
        let mut steps = Vec::new();
        loop {
            let parts: Vec<Option<RankBatch>> = ss.iter_mut().map(|s| s.next_batch()).collect();
            if parts.iter().all(Option::is_none) {
                return steps;
            }
            assert!(parts.iter().all(Option::is_some), "ranks disagree on the number of steps");
            let parts: Vec<RankBatch> = parts.into_iter().flatten().collect();
            assert!(parts.windows(2).all(|w| w[0].next == w[1].next && w[0].step == w[1].step));
            let global: Vec<usize> = parts.iter().flat_map(|b| b.indices.clone()).collect();
            assert_eq!(global.len(), parts[0].global_size);
            steps.push(global);
        }
    }

    fn counts(len: usize, steps: &[Vec<usize>]) -> Vec<usize> {
        let mut c = vec![0; len];
        for i in steps.iter().flatten() {
            c[*i] += 1;
        }
        c
    }

    fn tails() -> impl Strategy<Value = Tail> {
        prop_oneof![Just(Tail::Partial), Just(Tail::DropLast), Just(Tail::Pad)]
    }

    proptest! {
        #[test]
        fn every_sample_once_per_epoch_and_world_size_invariant(
            len in 1usize..300, gb in 1usize..40, world in 1usize..6, seed: u64, tail in tails(), shuffle: bool,
        ) {
            prop_assume!(gb >= world);
            prop_assume!(tail == Tail::Pad || gb <= len);
            let cfg = SamplerConfig { len, global_batch: gb, seed, shuffle, tail };
            prop_assume!(cfg.samples_per_epoch() > 0);
            let reference = run_epoch(&mut samplers(cfg, 1));
            let mut ss = samplers(cfg, world);
            for epoch in 0..2u64 {
                for s in ss.iter_mut() { s.set_epoch(epoch); }
                let steps = run_epoch(&mut ss);
                prop_assert_eq!(steps.len(), cfg.batches_per_epoch());
                let c = counts(len, &steps);
                match tail {
                    Tail::Partial => prop_assert!(c.iter().all(|&n| n == 1)),
                    Tail::DropLast => {
                        prop_assert!(c.iter().all(|&n| n <= 1));
                        prop_assert!(steps.iter().all(|s| s.len() == gb));
                    }
                    Tail::Pad => {
                        // Padding wraps around the epoch's order, so counts differ by at most one.
                        let (min, max) = (c.iter().min().copied().unwrap_or(0), c.iter().max().copied().unwrap_or(0));
                        prop_assert!(min >= 1 && max - min <= 1, "{:?}", c);
                        prop_assert!(steps.iter().all(|s| s.len() == gb));
                    }
                }
                if epoch == 0 {
                    // The global batches do not depend on the world size.
                    prop_assert_eq!(&steps, &reference);
                }
            }
        }

        #[test]
        fn resume_at_another_world_size_continues_exactly(
            len in 1usize..200, gb in 4usize..30, cut in 0usize..40, w1 in 1usize..5, w2 in 1usize..5, seed: u64,
        ) {
            prop_assume!(gb <= len);
            let cfg = SamplerConfig { len, global_batch: gb, seed, shuffle: true, tail: Tail::Partial };
            // Uninterrupted, one rank, across epochs.
            let mut whole = DistributedSampler::new(cfg, 1, 0).expect("valid");
            let reference: Vec<Vec<usize>> = (0..40).map(|_| whole.next_batch_cycling().indices).collect();
            // `cut` steps at world size w1, then a checkpoint, then the rest at w2.
            let mut first = samplers(cfg, w1);
            let mut state = SamplerState::default();
            for (step, want) in reference.iter().enumerate().take(cut) {
                let got: Vec<usize> = first.iter_mut().flat_map(|s| s.next_batch_cycling().indices).collect();
                prop_assert_eq!(&got, want, "step {}", step);
                state = first[0].state();
            }
            let mut second = samplers(cfg, w2);
            for s in second.iter_mut() { s.restore(state).expect("valid state"); }
            for want in &reference[cut..] {
                let got: Vec<usize> = second.iter_mut().flat_map(|s| s.next_batch_cycling().indices).collect();
                prop_assert_eq!(&got, want);
            }
        }
    }

    #[test]
    fn epochs_and_seeds_reshuffle() {
        let cfg = SamplerConfig::new(50, 50);
        let mut s = DistributedSampler::new(cfg, 1, 0).expect("valid");
        let e0 = s.next_batch().expect("one batch").indices;
        assert!(s.next_batch().is_none());
        s.set_epoch(1);
        let e1 = s.next_batch().expect("one batch").indices;
        assert_ne!(e0, e1);
        s.set_epoch(0);
        assert_eq!(s.next_batch().expect("one batch").indices, e0);
        let mut other = DistributedSampler::new(SamplerConfig { seed: 1, ..cfg }, 1, 0).expect("valid");
        assert_ne!(other.next_batch().expect("one batch").indices, e0);
        let mut plain = DistributedSampler::new(SamplerConfig { shuffle: false, ..cfg }, 1, 0).expect("valid");
        assert_eq!(plain.next_batch().expect("one batch").indices, (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn tail_shares_and_state() {
        // 10 samples, global batch 4, 3 ranks: steps of 4, 4, 2; rank shares 2/1/1 then 1/1/0.
        let cfg = SamplerConfig { shuffle: false, ..SamplerConfig::new(10, 4) };
        let mut s2 = DistributedSampler::new(cfg, 3, 2).expect("valid");
        let sizes: Vec<usize> = s2.epoch_batches().map(|b| b.indices.len()).collect();
        assert_eq!(sizes, vec![1, 1, 0]);
        let mut s0 = DistributedSampler::new(cfg, 3, 0).expect("valid");
        let b = s0.next_batch().expect("batch");
        assert_eq!((b.indices, b.global_size, b.next), (vec![0, 1], 4, SamplerState { epoch: 0, position: 4 }));
        assert_eq!(s0.peek_global(), vec![4, 5, 6, 7]);
        assert_eq!(s2.next_batch_cycling().next, SamplerState { epoch: 0, position: 4 });
        let last = s2.cycling_batches().nth(1).expect("endless");
        assert_eq!((last.epoch, last.step, last.global_size), (0, 2, 2));
        assert_eq!(s2.cycling_batches().nth(2).expect("endless").epoch, 1);
    }

    #[test]
    fn bad_configs_and_states_are_errors() {
        let cfg = SamplerConfig::new(10, 4);
        assert!(DistributedSampler::new(SamplerConfig { len: 0, ..cfg }, 1, 0).is_err());
        assert!(DistributedSampler::new(SamplerConfig { global_batch: 0, ..cfg }, 1, 0).is_err());
        assert!(DistributedSampler::new(cfg, 5, 0).is_err());
        assert!(DistributedSampler::new(cfg, 2, 2).is_err());
        assert!(
            DistributedSampler::new(SamplerConfig { global_batch: 11, tail: Tail::DropLast, ..cfg }, 1, 0).is_err()
        );
        // A partial tail would silently shrink every step to the whole dataset; padding fills the batch up.
        let e = DistributedSampler::new(SamplerConfig { global_batch: 11, ..cfg }, 1, 0).err().map(|e| e.to_string());
        assert!(e.as_deref().is_some_and(|e| e.contains("11 exceeds the 10 samples")), "{e:?}");
        assert!(DistributedSampler::new(SamplerConfig { global_batch: 11, tail: Tail::Pad, ..cfg }, 1, 0).is_ok());
        let mut s = DistributedSampler::new(cfg, 2, 0).expect("valid");
        assert!(s.restore(SamplerState { epoch: 3, position: 5 }).is_err());
        assert!(s.restore(SamplerState { epoch: 3, position: 12 }).is_err());
        s.restore(SamplerState { epoch: 3, position: 10 }).expect("end of epoch is a boundary");
        assert!(s.next_batch().is_none());
        assert_eq!(s.next_batch_cycling().epoch, 4);
    }

    /// Blocks of uneven sizes (like row groups) covering `0..len`.
    fn blocks(len: usize) -> Lanes {
        let mut out = Vec::new();
        let mut at = 0;
        let mut k = 0;
        while at < len {
            let n = (97 + 61 * (k % 5)).min(len - at);
            out.push(at..at + n);
            at += n;
            k += 1;
        }
        Lanes { blocks: out.into(), lanes: 4 }
    }

    /// Lanes: no index twice in an epoch, the same global batches at any world size, each rank's share read from
    /// its own blocks (at 2 and 4 ranks, which divide the 4 lanes: a block is read by at most 2 ranks, where a lane
    /// boundary cuts it), and every epoch a different order.
    #[test]
    fn lanes_read_disjoint_blocks_per_rank_with_the_same_global_batches() -> Result<()> {
        let len = 3001;
        let cfg = SamplerConfig { seed: 7, ..SamplerConfig::new(len, 64) };
        let lanes = blocks(len);
        let run = |world: usize| -> Result<Vec<Vec<usize>>> {
            let mut ss = (0..world)
                .map(|r| DistributedSampler::with_lanes(cfg, lanes.clone(), world, r))
                .collect::<Result<Vec<_>>>()?;
            Ok(run_epoch(&mut ss))
        };
        let one = run(1)?;
        assert_eq!(one.len(), len / 4 / 16);
        let c = counts(len, &one);
        assert!(c.iter().all(|&n| n <= 1), "an index twice in an epoch");
        assert_eq!(c.iter().sum::<usize>(), one.len() * 64);
        for world in [2, 3, 4] {
            assert_eq!(run(world)?, one, "global batches at {world} ranks");
        }
        let block_of = |i: usize| lanes.blocks.iter().position(|b| b.contains(&i)).unwrap_or(usize::MAX);
        for world in [2, 4] {
            let mut readers: std::collections::HashMap<usize, std::collections::HashSet<usize>> = Default::default();
            for s in &one {
                for (r, share) in s.chunks(64 / world).enumerate() {
                    for &i in share {
                        readers.entry(block_of(i)).or_default().insert(r);
                    }
                }
            }
            assert!(readers.values().all(|r| r.len() <= 2), "{world} ranks: a block read by more than 2 ranks");
            let shared = readers.values().filter(|r| r.len() == 2).count();
            assert!(
                shared < world,
                "{world} ranks: {shared} blocks shared (lane boundaries cut at most {})",
                world - 1
            );
        }
        let mut s = DistributedSampler::with_lanes(cfg, lanes.clone(), 1, 0)?;
        let first = s.peek_global();
        s.set_epoch(1);
        assert_ne!(s.peek_global(), first, "epochs differ");
        assert!(DistributedSampler::with_lanes(SamplerConfig::new(len, 66), lanes, 1, 0).is_err(), "4 ∤ 66");
        Ok(())
    }

    #[test]
    fn the_feistel_permutation_is_a_bijection() {
        for n in [1, 2, 3, 7, 64, 1000, 4096] {
            let mut seen = vec![false; n];
            for i in 0..n {
                let j = permute(i, n, &[3, n as u64]);
                assert!(j < n && !seen[j], "n {n}: {i} -> {j}");
                seen[j] = true;
            }
        }
    }

    #[test]
    fn shares_cut_the_same_global_batches_unevenly_from_the_batch_they_are_set_for() -> Result<()> {
        let cfg = SamplerConfig::new(1000, 60);
        let shares: Vec<Arc<Shares>> = (0..3).map(|_| Arc::new(Shares::default())).collect();
        let mut ranks: Vec<DistributedSampler> = (0..3)
            .map(|r| Ok(DistributedSampler::new(cfg, 3, r)?.with_shares(Arc::clone(&shares[r]))))
            .collect::<Result<_>>()?;
        let plain = DistributedSampler::new(cfg, 1, 0)?;
        let mut whole = plain.cycling_batches();
        for b in 0..40u64 {
            if b == 5 {
                for s in &shares {
                    s.set_from(7, vec![1, 2, 3]);
                }
            }
            let parts: Vec<RankBatch> = ranks.iter_mut().map(DistributedSampler::next_batch_cycling).collect();
            let joined: Vec<usize> = parts.iter().flat_map(|p| p.indices.iter().copied()).collect();
            let expected = whole.next().map(|p| p.indices).unwrap_or_default();
            assert_eq!(joined, expected, "batch {b}: the ranks' shares make up the single-rank global batch");
            let sizes: Vec<usize> = parts.iter().map(|p| p.indices.len()).collect();
            let want = if b < 7 || expected.len() < 60 { None } else { Some(vec![10, 20, 30]) };
            if let Some(w) = want {
                assert_eq!(sizes, w, "batch {b}: shares 1:2:3");
            } else if expected.len() == 60 {
                assert_eq!(sizes, vec![20, 20, 20], "batch {b}: equal shares before they are set");
            }
        }
        assert_eq!(weighted_share(7, &[0, 0], 2, 1), block(7, 2, 1), "zero weights share equally");
        Ok(())
    }
}
