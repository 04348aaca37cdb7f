//! The pending jobs of a static order ([`crate::Scheduler`]'s pass when no queue has a guarantee), grouped into
//! classes of jobs that fit or fail alike, each class kept in pass order in chunks that know their shortest
//! expected run time.
//!
//! Constraints: a pass over 10^4–10^5 pending jobs runs at every instant something happens, and nearly all of
//! them cannot start. Whether a job fits depends only on its task shape, its task counts and whether it spreads;
//! once one job of a class is known not to fit in a pass where nothing more is freed, no later job of its class
//! fits either. Beside a backfill reservation, a job that cannot fit in both states may still start when it ends
//! before the reservation, so the later jobs worth looking at are those with a short enough expected run time.
//!
//! Solution: the pass merges the classes by their next job in order (a heap), drops a class once it cannot fit,
//! and jumps over the jobs of a class that end too late for the reservation, chunk by chunk. Each visit it saves
//! is a visit that decided nothing, so the decisions are those of the plain walk over every pending job.

use crate::model::Resources;

/// A pending job's place in a pass's order: (priority, highest first), the ordering's key, submission time, id.
pub(crate) type PendKey = (std::cmp::Reverse<i32>, u64, u64, crate::model::JobId);

/// Jobs that fit or fail alike: (team under DRF — its turn in the pass — else empty), task shape, fewest and
/// most tasks, spread.
pub(crate) type ClassKey = (String, (u64, u64, u64, u64), u32, u32, bool);

/// What a pass needs of a pending job to pass over it without looking it up.
#[derive(Debug, Clone)]
pub(crate) struct PendInfo {
    pub per_task: Resources,
    pub tasks_min: u32,
    pub tasks_max: u32,
    pub spread: bool,
    /// The expected run time, `u64::MAX` when unknown.
    pub runtime: u64,
    /// The job's `failed_at`.
    pub failed_at: Option<u64>,
}

/// Jobs per chunk, about: a chunk splits at twice this.
const CHUNK: usize = 64;

#[derive(Debug, Clone)]
struct Chunk {
    items: Vec<(PendKey, PendInfo)>,
    /// The shortest expected run time of its jobs.
    min_runtime: u64,
}

impl Chunk {
    fn recount(&mut self) {
        self.min_runtime = self.items.iter().map(|(_, i)| i.runtime).min().unwrap_or(u64::MAX);
    }
}

/// A position in a [`Class`]: chunk, item.
pub(crate) type Pos = (usize, usize);

/// One class's jobs, in pass order.
#[derive(Debug, Clone, Default)]
pub(crate) struct Class {
    chunks: Vec<Chunk>,
}

impl Class {
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// The chunk where `key` is or would go.
    fn chunk_for(&self, key: &PendKey) -> usize {
        let i = self.chunks.partition_point(|c| c.items.last().is_some_and(|(k, _)| k < key));
        i.min(self.chunks.len().saturating_sub(1))
    }

    pub fn insert(&mut self, key: PendKey, info: PendInfo) {
        if self.chunks.is_empty() {
            self.chunks.push(Chunk { items: Vec::new(), min_runtime: u64::MAX });
        }
        let ci = self.chunk_for(&key);
        let c = &mut self.chunks[ci];
        let at = c.items.partition_point(|(k, _)| *k < key);
        c.min_runtime = c.min_runtime.min(info.runtime);
        c.items.insert(at, (key, info));
        if c.items.len() >= 2 * CHUNK {
            let mut tail = Chunk { items: c.items.split_off(CHUNK), min_runtime: u64::MAX };
            c.recount();
            tail.recount();
            self.chunks.insert(ci + 1, tail);
        }
    }

    fn find(&self, key: &PendKey) -> Option<Pos> {
        if self.chunks.is_empty() {
            return None;
        }
        let ci = self.chunk_for(key);
        self.chunks[ci].items.binary_search_by(|(k, _)| k.cmp(key)).ok().map(|ii| (ci, ii))
    }

    pub fn get(&self, key: &PendKey) -> Option<&PendInfo> {
        self.find(key).map(|p| self.at(p).1)
    }

    pub fn remove(&mut self, key: &PendKey) -> Option<PendInfo> {
        let (ci, ii) = self.find(key)?;
        let c = &mut self.chunks[ci];
        let (_, info) = c.items.remove(ii);
        if c.items.is_empty() {
            self.chunks.remove(ci);
        } else if info.runtime == c.min_runtime {
            c.recount();
        }
        Some(info)
    }

    pub fn get_mut(&mut self, key: &PendKey) -> Option<&mut PendInfo> {
        let (ci, ii) = self.find(key)?;
        Some(&mut self.chunks[ci].items[ii].1)
    }

    pub fn at(&self, (ci, ii): Pos) -> (&PendKey, &PendInfo) {
        let (k, i) = &self.chunks[ci].items[ii];
        (k, i)
    }

    /// The first position at or after `from` (`None`: the start) whose job's expected run time is at most
    /// `max_runtime`.
    pub fn next(&self, from: Option<Pos>, max_runtime: u64) -> Option<Pos> {
        let (mut ci, mut ii) = from.unwrap_or((0, 0));
        while let Some(c) = self.chunks.get(ci) {
            let rest = &c.items[ii.min(c.items.len())..];
            if c.min_runtime <= max_runtime
                && let Some(off) = rest.iter().position(|(_, i)| i.runtime <= max_runtime)
            {
                return Some((ci, ii + off));
            }
            ci += 1;
            ii = 0;
        }
        None
    }

    /// The position after `p`.
    pub fn after(&self, (ci, ii): Pos) -> Pos {
        if ii + 1 < self.chunks[ci].items.len() { (ci, ii + 1) } else { (ci + 1, 0) }
    }

    /// The first job whose key is at least `key`.
    pub fn first_from(&self, key: &PendKey) -> Option<&PendKey> {
        let ci = self.chunks.partition_point(|c| c.items.last().is_some_and(|(k, _)| k < key));
        let c = self.chunks.get(ci)?;
        c.items.get(c.items.partition_point(|(k, _)| k < key)).map(|(k, _)| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(t: u64) -> PendKey {
        (std::cmp::Reverse(0), 0, t, format!("j{t:05}"))
    }

    fn info(runtime: u64) -> PendInfo {
        PendInfo { per_task: Resources::default(), tasks_min: 1, tasks_max: 1, spread: false, runtime, failed_at: None }
    }

    #[test]
    fn a_class_keeps_its_order_and_finds_short_jobs_across_chunks() {
        let mut c = Class::default();
        // Inserted out of order; runtime = t, but every job of 100..=400 runs long.
        for t in (0..1000u64).rev().chain(1000..1200) {
            c.insert(key(t), info(if (100..=400).contains(&t) { 1_000_000 } else { t }));
        }
        let mut walk = Vec::new();
        let mut p = c.next(None, u64::MAX);
        while let Some(q) = p {
            walk.push(c.at(q).0.2);
            p = c.next(Some(c.after(q)), u64::MAX);
        }
        assert_eq!(walk, (0..1200).collect::<Vec<_>>());
        // After job 99, the first with a run time of at most 500 is job 401.
        let from = c.after(c.find(&key(99)).unwrap_or((0, 0)));
        assert_eq!(c.next(Some(from), 500).map(|q| c.at(q).0.2), Some(401));
        for t in 0..1200 {
            if t != 700 {
                assert!(c.remove(&key(t)).is_some());
            }
        }
        assert_eq!(c.next(None, u64::MAX).map(|q| c.at(q).0.2), Some(700));
        assert_eq!(c.first_from(&key(3)).map(|k| k.2), Some(700));
        assert!(c.remove(&key(700)).is_some() && c.is_empty());
    }
}
