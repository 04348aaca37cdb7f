//! Dynamic sharding (`train.data.sharding = "dynamic"`): a blocked dataset's blocks handed out on demand.
//!
//! The blocks of every epoch form one endless *hand-out sequence*: first the pieces a [`Ledger`] left pending (the
//! unread rests of blocks, then blocks never started), then each later epoch's blocks in a seeded order. A
//! [`Coordinator`] every rank reaches (the job's rendezvous store) holds one counter: a rank that has used up its
//! piece takes the next number, publishes the list of numbers it took (one key a rank), and reads that piece. So a
//! rank that consumes faster takes more pieces, and no piece goes to two ranks.
//!
//! A rank still takes exactly its share of each global batch (the same shares as [`DistributedSampler`], a batch
//! may span two pieces or two epochs): the rows every rank consumed by a global batch number are known to all from
//! the shares alone. [`DynamicShards::ledger_at`] turns that, with the published lists, into the ledger of a step
//! boundary: each rank's pieces read whole are done, its piece in progress is pending from the first row it had
//! not read, and every piece taken but not started — by a live rank's read-ahead, or by a rank that died — is
//! pending again. The ledger goes into the checkpoint; a run that resumes from it (at any world size) hands the
//! pending pieces out first, under a new generation of keys. Every row is trained on exactly once an epoch, through
//! any number of restarts.
//!
//! Rows within a piece are read in a seeded order of the whole block (a piece resumed part-way skips the rows of
//! that order it had read), so a restart changes who reads a row, never which rows an epoch holds.

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::sampler::permute;
use crate::{DistributedSampler, Error, RankBatch, Result};

/// What every rank reaches to take pieces: a counter, and keys that ranks publish and read.
pub trait Coordinator: Send + Sync + std::fmt::Debug {
    /// Adds one to counter `key` (absent: 0) and returns the value before.
    fn take(&self, key: &str) -> Result<u64>;
    /// Sets `key`.
    fn put(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The value of `key`, if set.
    fn read(&self, key: &str) -> Result<Option<Vec<u8>>>;
}

/// A block of an epoch, from row `skip` of its seeded order on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    pub epoch: u64,
    /// The block's number in the dataset's list of blocks.
    pub block: usize,
    /// Rows of the block's order already trained on.
    pub skip: usize,
}

/// What is left to hand out, as of a step boundary (see the [module docs](self)); saved in checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    /// Names the coordinator's keys of the run that starts from this ledger.
    pub generation: u64,
    /// The global batch number the ledger stands at.
    pub batch: u64,
    /// Pieces to hand out first, in order.
    pub pending: Vec<Piece>,
    /// The first epoch none of whose blocks was handed out: it and every later one follow the pending pieces.
    pub fresh_from: u64,
}

/// The coordinator's key of generation `g`'s counter.
fn counter_key(g: u64) -> String {
    format!("shoal/shards/{g}/next")
}

/// The coordinator's key of the numbers rank `r` took in generation `g`.
fn taken_key(g: u64, r: usize) -> String {
    format!("shoal/shards/{g}/rank/{r}")
}

fn coordinator_error(what: impl Into<String>, reason: impl std::fmt::Display) -> Error {
    Error::Coordinator { what: what.into(), reason: reason.to_string() }
}

/// A rank's side of dynamic sharding: its pieces' [`plan`](DynamicShards::plan) and the ledgers of boundaries.
#[derive(Debug, Clone)]
pub struct DynamicShards {
    coordinator: Arc<dyn Coordinator>,
    blocks: Arc<[Range<usize>]>,
    seed: u64,
    shuffle: bool,
    ledger: Arc<Ledger>,
    /// The nominal sampler: where global batches stand, and each rank's share of them.
    sampler: DistributedSampler,
}

impl DynamicShards {
    /// Rank `sampler.rank()` of `sampler.world_size()`, handing out `blocks` (covering the dataset `sampler` counts)
    /// from `ledger`, whose batch must be where `sampler` stands. Errors: no blocks, an empty block, a ledger that
    /// names a block the dataset lacks or stands elsewhere than the sampler.
    pub fn new(
        coordinator: Arc<dyn Coordinator>,
        blocks: Arc<[Range<usize>]>,
        sampler: DistributedSampler,
        ledger: Ledger,
    ) -> Result<Self> {
        if blocks.is_empty() || blocks.iter().any(|b| b.is_empty()) {
            return Err(crate::error::invalid("dynamic sharding", "every block must hold rows"));
        }
        if let Some(p) = ledger.pending.iter().find(|p| p.block >= blocks.len() || p.skip >= blocks[p.block].len()) {
            return Err(crate::error::invalid(
                "dynamic sharding",
                format!(
                    "the checkpoint's ledger names block {} from row {}, which this dataset's {} blocks lack (was the \
                     dataset changed?)",
                    p.block,
                    p.skip,
                    blocks.len()
                ),
            ));
        }
        if ledger.batch != sampler.batch_number() {
            return Err(crate::error::invalid(
                "dynamic sharding",
                format!(
                    "the ledger stands at global batch {}, the sampler at {}",
                    ledger.batch,
                    sampler.batch_number()
                ),
            ));
        }
        let cfg = sampler.config();
        let (seed, shuffle) = (cfg.seed, cfg.shuffle);
        Ok(DynamicShards { coordinator, blocks, seed, shuffle, ledger: Arc::new(ledger), sampler })
    }

    /// The same ranks and data from `ledger` on (after a resume; the sampler restored to its batch first).
    pub fn resumed(&self, sampler: DistributedSampler, ledger: Ledger) -> Result<Self> {
        DynamicShards::new(Arc::clone(&self.coordinator), Arc::clone(&self.blocks), sampler, ledger)
    }

    /// The ledger this run started from.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Piece number `k` of the hand-out sequence.
    fn item(&self, k: u64, epoch_order: &mut Option<(u64, Vec<usize>)>) -> Piece {
        let l = &self.ledger;
        let pending = l.pending.len() as u64;
        if k < pending {
            return l.pending[k as usize];
        }
        let n = self.blocks.len() as u64;
        let (epoch, at) = (l.fresh_from + (k - pending) / n, ((k - pending) % n) as usize);
        let block = if self.shuffle {
            match epoch_order {
                Some((e, order)) if *e == epoch => order[at],
                _ => {
                    let order = crate::rng::permutation(n as usize, &[self.seed, epoch, n, 0xd15a]);
                    let b = order[at];
                    *epoch_order = Some((epoch, order));
                    b
                }
            }
        } else {
            at
        };
        Piece { epoch, block, skip: 0 }
    }

    /// Row `i` of piece `p`'s block order.
    fn row(&self, p: &Piece, i: usize) -> usize {
        let b = &self.blocks[p.block];
        let at = if self.shuffle { permute(i, b.len(), &[self.seed, p.epoch, p.block as u64, 0x5a3d]) } else { i };
        b.start + at
    }

    /// This rank's batches from the ledger on, without end (for [`Loader::fallible`](crate::Loader::fallible)):
    /// each the rank's share of a global batch, its rows from the pieces it takes; `next` is the nominal sampler's
    /// position, and [`RankBatch::row_epochs`] the epoch of every row. An error of the coordinator ends it.
    pub fn plan(&self) -> ShardPlan {
        ShardPlan { shards: self.clone(), taken: Vec::new(), current: None, order: None, failed: false }
    }

    /// The ledger of the boundary before global batch `batch` (at or after where this run started), from what every
    /// rank published. Errors: a coordinator that cannot be read, or a rank that consumed rows it never published.
    pub fn ledger_at(&self, batch: u64) -> Result<Ledger> {
        let l = &self.ledger;
        if batch < l.batch {
            return Err(crate::error::invalid(
                "dynamic sharding",
                format!("batch {batch} is before the run's start at {}", l.batch),
            ));
        }
        let world = self.sampler.world_size();
        // Every number taken below `end`, and what is left of each: `None` once read whole.
        let mut left: Vec<Option<Piece>> = Vec::new();
        let mut seen: Vec<bool> = Vec::new();
        let mut order = None;
        for r in 0..world {
            let key = taken_key(l.generation, r);
            let taken: Vec<u64> = match self.coordinator.read(&key)? {
                Some(v) => serde_json::from_slice(&v).map_err(|e| coordinator_error(key.clone(), e))?,
                None => Vec::new(),
            };
            let mut consumed: usize = (l.batch..batch).map(|b| self.sampler.share_len(b, r)).sum();
            for &k in &taken {
                let k = k as usize;
                if left.len() <= k {
                    left.resize(k + 1, None);
                    seen.resize(k + 1, false);
                }
                let p = self.item(k as u64, &mut order);
                let rows = self.blocks[p.block].len() - p.skip;
                seen[k] = true;
                left[k] = match consumed {
                    c if c >= rows => None,
                    c => Some(Piece { skip: p.skip + c, ..p }),
                };
                consumed = consumed.saturating_sub(rows);
            }
            if consumed > 0 {
                return Err(coordinator_error(
                    key,
                    format!("rank {r} trained on {consumed} rows more than the pieces it published hold"),
                ));
            }
        }
        let end = left.len() as u64;
        let mut pending: Vec<Piece> = Vec::new();
        for k in 0..end {
            match seen[k as usize] {
                true => pending.extend(left[k as usize]),
                false => pending.push(self.item(k, &mut order)),
            }
        }
        let n = self.blocks.len() as u64;
        let fresh_from = match end.checked_sub(l.pending.len() as u64) {
            None => {
                pending.extend_from_slice(&l.pending[end as usize..]);
                l.fresh_from
            }
            Some(into) => {
                // Numbers taken reached into fresh epochs: the rest of the last one reached is pending.
                let (epoch, at) = (l.fresh_from + into / n, into % n);
                if at > 0 {
                    for k in end..end + (n - at) {
                        pending.push(self.item(k, &mut order));
                    }
                    epoch + 1
                } else {
                    epoch
                }
            }
        };
        Ok(Ledger { generation: l.generation + 1, batch, pending, fresh_from })
    }
}

/// One rank's batches under dynamic sharding (see [`DynamicShards::plan`]).
#[derive(Debug)]
pub struct ShardPlan {
    shards: DynamicShards,
    taken: Vec<u64>,
    /// The piece being read, and the next row of its order.
    current: Option<(Piece, usize)>,
    order: Option<(u64, Vec<usize>)>,
    failed: bool,
}

impl ShardPlan {
    /// Takes the next piece from the coordinator and publishes what this rank took.
    fn take(&mut self) -> Result<Piece> {
        let s = &self.shards;
        let (g, rank) = (s.ledger.generation, s.sampler.rank());
        let k = s.coordinator.take(&counter_key(g))?;
        self.taken.push(k);
        let list = serde_json::to_vec(&self.taken).map_err(|e| coordinator_error("the pieces taken", e))?;
        s.coordinator.put(&taken_key(g, rank), &list)?;
        let p = self.shards.item(k, &mut self.order);
        tracing::debug!(rank, piece = k, epoch = p.epoch, block = p.block, skip = p.skip, "took a piece");
        Ok(p)
    }

    fn batch(&mut self) -> Result<RankBatch> {
        let mut nominal = self.shards.sampler.next_batch_cycling();
        let want = nominal.indices.len();
        let mut indices = Vec::with_capacity(want);
        let mut row_epochs = Vec::with_capacity(want);
        while indices.len() < want {
            let (piece, at) = match self.current {
                Some((p, at)) if p.skip + at < self.shards.blocks[p.block].len() => (p, at),
                _ => (self.take()?, 0),
            };
            let end = self.shards.blocks[piece.block].len() - piece.skip;
            let n = (want - indices.len()).min(end - at);
            for i in at..at + n {
                indices.push(self.shards.row(&piece, piece.skip + i));
                row_epochs.push(piece.epoch);
            }
            self.current = Some((piece, at + n));
        }
        nominal.indices = indices;
        nominal.row_epochs = row_epochs;
        Ok(nominal)
    }
}

impl Iterator for ShardPlan {
    type Item = Result<RankBatch>;

    fn next(&mut self) -> Option<Result<RankBatch>> {
        if self.failed {
            return None;
        }
        let b = self.batch();
        self.failed = b.is_err();
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;
    use crate::{Lanes, SamplerConfig};

    #[derive(Debug, Default)]
    struct Memory(Mutex<HashMap<String, Vec<u8>>>);

    impl Coordinator for Memory {
        fn take(&self, key: &str) -> Result<u64> {
            let mut m = self.0.lock().map_err(|e| coordinator_error(key, e))?;
            let v = m.get(key).and_then(|v| std::str::from_utf8(v).ok()?.parse().ok()).unwrap_or(0u64);
            m.insert(key.into(), (v + 1).to_string().into_bytes());
            Ok(v)
        }
        fn put(&self, key: &str, value: &[u8]) -> Result<()> {
            self.0.lock().map_err(|e| coordinator_error(key, e))?.insert(key.into(), value.to_vec());
            Ok(())
        }
        fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
            Ok(self.0.lock().map_err(|e| coordinator_error(key, e))?.get(key).cloned())
        }
    }

    /// Uneven blocks over 1,000 rows.
    fn blocks() -> Arc<[Range<usize>]> {
        let cuts = [0, 70, 200, 230, 400, 480, 600, 777, 800, 950, 1000];
        cuts.windows(2).map(|w| w[0]..w[1]).collect::<Vec<_>>().into()
    }

    fn ranks(
        coordinator: &Arc<Memory>,
        world: usize,
        ledger: &Ledger,
        batch: u64,
    ) -> Result<Vec<(DynamicShards, ShardPlan)>> {
        let cfg = SamplerConfig { seed: 9, ..SamplerConfig::new(1000, 24) };
        let lanes = Lanes { blocks: blocks(), lanes: 4 };
        (0..world)
            .map(|r| {
                let mut s = DistributedSampler::with_lanes(cfg, lanes.clone(), world, r)?;
                let per_epoch = s.batches_per_epoch() as u64;
                let state = crate::SamplerState {
                    epoch: batch / per_epoch,
                    position: (batch % per_epoch) as usize * cfg.global_batch,
                };
                s.restore(state)?;
                let c: Arc<dyn Coordinator> = coordinator.clone();
                let d = DynamicShards::new(c, blocks(), s, ledger.clone())?;
                let plan = d.plan();
                Ok((d, plan))
            })
            .collect()
    }

    /// Runs `steps` global batches over `world` ranks, rank `slow` taking its batch only every other step (its
    /// read-ahead grows unevenly), and records every (epoch, row) trained on.
    fn train(
        ranks: &mut [(DynamicShards, ShardPlan)],
        steps: usize,
        seen: &mut Vec<(u64, usize)>,
    ) -> Result<Vec<Vec<RankBatch>>> {
        let mut ahead: Vec<Vec<RankBatch>> = vec![Vec::new(); ranks.len()];
        for _ in 0..steps {
            for (r, (_, plan)) in ranks.iter_mut().enumerate() {
                // Read ahead unevenly: rank 0 plans three batches beyond the step, others one.
                let depth = if r == 0 { 3 } else { 1 };
                while ahead[r].len() < depth + 1 {
                    let b = plan.next().ok_or_else(|| coordinator_error("plan", "ended"))??;
                    ahead[r].push(b);
                }
                let b = ahead[r].remove(0);
                seen.extend(b.row_epochs.iter().copied().zip(b.indices.iter().copied()));
            }
        }
        Ok(ahead)
    }

    fn counts(seen: &[(u64, usize)], epoch: u64) -> Vec<usize> {
        let mut c = vec![0usize; 1000];
        for &(e, row) in seen {
            if e == epoch {
                c[row] += 1;
            }
        }
        c
    }

    #[test]
    fn every_row_is_trained_once_an_epoch_through_a_restart_at_another_world_size() -> Result<()> {
        let store = Arc::new(Memory::default());
        let mut seen = Vec::new();
        // 3 ranks for 17 global batches (of 41 an epoch), then the ledger, then 2 ranks on from it.
        let mut first = ranks(&store, 3, &Ledger::default(), 0)?;
        train(&mut first, 17, &mut seen)?;
        let ledger = first[1].0.ledger_at(17)?;
        assert_eq!((ledger.generation, ledger.batch), (1, 17));
        drop(first);
        let mut second = ranks(&store, 2, &ledger, 17)?;
        // Through the end of epoch 0 and the whole of epoch 1 (every batch holds 24 rows).
        train(&mut second, 90 - 17, &mut seen)?;
        assert_eq!(seen.len(), 90 * 24);
        for epoch in [0, 1] {
            let c = counts(&seen, epoch);
            let wrong: Vec<_> = c.iter().enumerate().filter(|(_, n)| **n != 1).take(5).collect();
            assert!(wrong.is_empty(), "epoch {epoch}: rows not seen exactly once: {wrong:?}");
        }
        // A second ledger from the second run's keys goes on from there.
        let again = second[0].0.ledger_at(90)?;
        assert_eq!((again.generation, again.batch), (2, 90));
        assert!(again.fresh_from >= 2);
        Ok(())
    }

    #[test]
    fn the_ledger_names_what_was_left_and_a_faster_rank_takes_more_pieces() -> Result<()> {
        let store = Arc::new(Memory::default());
        let mut r = ranks(&store, 2, &Ledger::default(), 0)?;
        let mut seen = Vec::new();
        train(&mut r, 5, &mut seen)?;
        // Rank 0 read three batches ahead: it took at least as many pieces as rank 1.
        let took = |rank: usize| -> Result<Vec<u64>> {
            let v = store.read(&taken_key(0, rank))?.unwrap_or_default();
            serde_json::from_slice(&v).map_err(|e| coordinator_error("taken", e))
        };
        assert!(took(0)?.len() >= took(1)?.len());
        let ledger = r[0].0.ledger_at(5)?;
        let pending_rows: usize = ledger.pending.iter().map(|p| blocks()[p.block].len() - p.skip).sum();
        // Epoch 0's rows not yet trained on are all pending (the epoch's blocks were handed out in part only).
        assert_eq!(ledger.fresh_from, 1);
        assert_eq!(pending_rows, 1000 - 5 * 24);
        // A ledger past the rows published is refused, naming the rank.
        let err = r[0].0.ledger_at(200).map(|_| ()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("more than the pieces it published"), "{err}");
        // A ledger from another dataset is refused.
        let bad = Ledger { pending: vec![Piece { epoch: 0, block: 99, skip: 0 }], ..Ledger::default() };
        assert!(ranks(&store, 2, &bad, 0).is_err());
        Ok(())
    }
}
