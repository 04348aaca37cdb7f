//! Replacing persistent stragglers (`fault_tolerance.replace_stragglers`, elastic jobs only): while such a job runs,
//! its newest metrics rows (those of the last [`KEEP_MS`] by the time the workers wrote on them) are diagnosed as
//! `shoal diagnose` would, once per second of rows. A rank named the straggler in every one of those diagnoses for
//! [`PERSIST_MS`] is replaced: an event names it, its node and the evidence, and the job restarts (elastic, one of
//! its restarts) without it — with one worker fewer while that stays within `[workers] min..max`, else at the same
//! size with a fresh process in its place. With no restarts left it is only told, once. A job that regroups in place
//! (`group.rs`) loses the straggler's process instead and goes on without it, no restart used; free capacity then
//! brings it a newcomer, placed away from the straggler's node where the cluster has another.
//!
//! Judged by the workers' own clock on their rows (not the server's), so what counts is the time the job trained.
//! Kept in memory: a server restarted meanwhile starts judging afresh.

use shoal_spec::{FaultPolicy, JobSpec};

use crate::db::{JobRow, TaskRow};
use crate::diagnose::{Context, WINDOW_S, diagnose, row_ms};
use crate::error::Result;

use super::state::{Control, StopWhy, Straggling};

/// How long the same rank must be named the straggler in every diagnosis before it is replaced.
pub const PERSIST_MS: i64 = 30_000;
/// Rows kept per job: a little more than the diagnosis window.
const KEEP_MS: i64 = (WINDOW_S * 1e3) as i64 + 2_000;
/// Rows of time between two diagnoses.
const EVERY_MS: i64 = 1_000;
/// Rows read from the store per tick at most.
const READ_LIMIT: i64 = 200_000;

impl Control {
    /// Judges `job` (running, elastic, `replace_stragglers`) for a persistent straggler; `true` when it is being
    /// stopped to replace one.
    pub(super) async fn replace_straggler(&self, job: &JobRow, spec: &JobSpec, tasks: &[TaskRow]) -> Result<bool> {
        let ft = &spec.fault_tolerance;
        if !ft.replace_stragglers || ft.policy != FaultPolicy::Elastic {
            return Ok(false);
        }
        let known = self
            .stragglers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&job.id)
            .filter(|s| s.attempt == job.attempt)
            .map(|s| s.after_step);
        let after_step = match known {
            Some(s) => s,
            // A new attempt: only its own rows count.
            None => {
                let from = self.db.last_metric_step(&job.id, 0).await?;
                let fresh = Straggling { attempt: job.attempt, after_step: from, ..Default::default() };
                self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).insert(job.id.clone(), fresh);
                from
            }
        };
        let new = self.db.metrics(&job.id, None, after_step, READ_LIMIT).await?;
        let verdict = {
            let mut all = self.stragglers.lock().unwrap_or_else(|p| p.into_inner());
            let Some(s) = all.get_mut(&job.id) else { return Ok(false) };
            s.after_step = new.iter().map(|r| r.step).max().unwrap_or(s.after_step).max(s.after_step);
            s.rows.extend(new.into_iter().filter(|r| r.rank >= 0));
            let end = s.rows.iter().map(row_ms).max().unwrap_or(0);
            s.rows.retain(|r| row_ms(r) >= end - KEEP_MS);
            if end - s.judged_ms < EVERY_MS {
                return Ok(false);
            }
            s.judged_ms = end;
            let ctx = Context { world_size: job.workers, ..Context::default() };
            let first = diagnose(&s.rows, &[], &ctx).into_iter().next();
            s.named = match (first, s.named.take()) {
                (Some(f), Some((rank, since, _))) if f.kind == "straggler" && f.rank == Some(rank) => {
                    Some((rank, since, f.evidence))
                }
                (Some(f), _) if f.kind == "straggler" => f.rank.map(|r| (r, end, f.evidence)),
                _ => None,
            };
            match &s.named {
                Some((rank, since, evidence)) if end - since >= PERSIST_MS => {
                    let told = std::mem::replace(&mut s.told, true);
                    Some((*rank, end - since, evidence.clone(), told))
                }
                _ => None,
            }
        };
        let Some((rank, for_ms, evidence, told)) = verdict else { return Ok(false) };
        // The rows' ranks are the group's; a group regrouped in place numbers its tasks otherwise.
        let task = match self.members(job) {
            Some(m) => m.get(rank as usize).copied().unwrap_or(rank),
            None => rank,
        };
        let node = tasks.iter().find(|t| t.rank == task).map(|t| t.node.clone()).unwrap_or_default();
        let on = if node.is_empty() { String::new() } else { format!(" on node {node}") };
        let named = format!(
            "rank {rank}{on} was named the straggler in every diagnosis for {:.0} s \
             (fault_tolerance.replace_stragglers): {evidence}",
            for_ms as f64 / 1e3
        );
        if (job.restarts as u64) >= u64::from(ft.max_restarts) {
            if !told {
                let why = format!("{named}; not replaced: no restarts left ({} used)", job.restarts);
                self.db.event(&job.id, "straggler", job.state, &why).await?;
            }
            return Ok(false);
        }
        let (lo, _) = spec.workers.range();
        let fewer = job.workers - 1;
        // In place: the straggler's process goes, the others regroup without it and take a newcomer when there is
        // room for one (away from its node where the cluster has another); no restart is used.
        if self.regroups_in_place(spec)
            && fewer >= i64::from(lo.max(1))
            && let Some(t) = tasks.iter().find(|t| t.rank == task)
        {
            if !node.is_empty() && self.nodes.len() > 1 {
                let _ = self.sched().avoid(&job.id, &node);
            }
            let why = format!(
                "{named}; replacing it in place: its process is stopped, the others go on without it and take a \
                 newcomer when there is room"
            );
            self.db.event(&job.id, "straggler", job.state, &why).await?;
            self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).remove(&job.id);
            self.exec.stop(&super::state::handle(t), shoal_exec::Stop::Kill);
            self.wake.notify_one();
            return Ok(true);
        }
        let how = if fewer >= i64::from(lo) {
            self.shrunk.lock().unwrap_or_else(|p| p.into_inner()).insert(job.id.clone(), fewer as u32);
            format!("the job restarts without it, with at most {fewer} workers")
        } else {
            format!("the job restarts with a fresh process in its place ({} workers is the minimum)", lo)
        };
        let how = if node.is_empty() || self.nodes.len() < 2 {
            how
        } else {
            let mut avoided = self.avoided.lock().unwrap_or_else(|p| p.into_inner());
            let nodes = avoided.entry(job.id.clone()).or_default();
            if !nodes.contains(&node) {
                nodes.push(node.clone());
            }
            format!("{how}, placed elsewhere than node {node} where it fits")
        };
        self.db.event(&job.id, "straggler", job.state, &format!("{named}; replacing it: {how}")).await?;
        self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).remove(&job.id);
        let why = format!("rank {rank}{on} was a persistent straggler, replaced ({how})");
        self.begin_stop(job, tasks, StopWhy::Failure(why));
        Ok(true)
    }

    /// The nodes `job` is placed elsewhere than when it can: where its replaced stragglers ran.
    pub(super) fn avoided_nodes(&self, id: &str) -> Vec<String> {
        self.avoided.lock().unwrap_or_else(|p| p.into_inner()).get(id).cloned().unwrap_or_default()
    }

    /// The most workers `job` may be placed with again, after a straggler was replaced by shrinking it.
    pub(super) fn shrunk_to(&self, id: &str) -> Option<u32> {
        self.shrunk.lock().unwrap_or_else(|p| p.into_inner()).get(id).copied()
    }
}
