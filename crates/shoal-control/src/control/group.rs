//! Elastic jobs regrouped in place: with `fault_tolerance.policy = "elastic"`, data parallelism (every rank holds the
//! whole state) and tasks that hear the server, a lost member does not stop the job. The survivors keep their
//! processes and their state: each learns of the new group in its next heartbeat's answer ([`Regroup`]), leaves the
//! collective that failed (or, when nothing failed, the step it is in: every rank votes in the step's scalars, so
//! all regroup at the same boundary), builds a communicator of the new size at a rendezvous store this server
//! hosts, and takes the state of the group's rank 0 (always a survivor). Free capacity grows the group the same way:
//! the newcomers start into it (`TaskLaunch::join`, where the executor supports it) and receive the state from rank
//! 0. The global batch stays the same; each rank's share of it follows the group's size.
//!
//! A group is this server's memory of an attempt: after a server restart, or when the regrouping does not complete
//! (a member fails to join in time), the job falls back to a whole restart from its newest checkpoint.

use shoal_comm::store::StoreServer;
use shoal_exec::{Join, TaskLaunch};
use shoal_sched::TaskPlacement;
use shoal_spec::JobSpec;
use shoal_wire::{Heartbeat, JobState, Regroup};

use super::state::{Control, Group};
use super::tasks::{intent_row, started_row};
use crate::db::{JobRow, TaskRow, Transition};
use crate::error::{ControlError, Result};

impl Control {
    /// Whether `spec`'s job regroups in place when it loses a member or grows.
    pub(super) fn regroups_in_place(&self, spec: &JobSpec) -> bool {
        spec.regroups_in_place() && self.config.server.is_some()
    }

    /// The members of `job`'s current attempt when it regrouped in place (`None`: every task of the attempt).
    pub fn members(&self, job: &JobRow) -> Option<Vec<i64>> {
        let groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        groups.get(&job.id).filter(|g| g.attempt == job.attempt).map(|g| g.members.clone())
    }

    /// The answer to a heartbeat: the newer group its rank belongs to, if there is one.
    pub fn regroup_for(&self, job: &JobRow, hb: &Heartbeat) -> Option<Regroup> {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        let g = groups.get_mut(&job.id).filter(|g| g.attempt == hb.attempt)?;
        g.heard.insert(hb.rank, hb.generation);
        if hb.generation == g.generation {
            g.joining.retain(|&r| r != hb.rank);
        }
        if g.generation <= hb.generation || !g.joining.is_empty() {
            return None;
        }
        let rank = g.members.iter().position(|&m| m == hb.rank)?;
        Some(Regroup {
            generation: g.generation,
            rank,
            world: g.members.len(),
            rendezvous: g.rendezvous.clone(),
            members: g.members.clone(),
        })
    }

    /// Whether `job`'s newest group has not formed yet: a newcomer not heard from, or a member whose heartbeats do
    /// not yet say it trains in it. A group named now would reach only the members that have not yet taken the last
    /// word, and the others would wait in the last group for peers that went on to the next.
    pub(super) fn group_forming(&self, job: &JobRow) -> bool {
        let groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        groups.get(&job.id).filter(|g| g.attempt == job.attempt).is_some_and(|g| {
            !g.joining.is_empty() || g.members.iter().any(|m| g.heard.get(m).is_none_or(|&h| h < g.generation))
        })
    }

    /// Forgets the group of a job whose attempt ended.
    pub(super) fn forget_group(&self, id: &str) {
        self.groups.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }

    /// The next group of `job` with `members`: its generation, and where it meets (this server hosts the store, on
    /// the address tasks reach it at).
    fn next_group(&self, job: &JobRow, members: Vec<i64>, joining: Vec<i64>) -> Result<(u32, String)> {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(g) = groups.get_mut(&job.id).filter(|g| g.attempt == job.attempt) {
            g.generation += 1;
            let still: Vec<i64> = g.joining.iter().chain(&joining).copied().filter(|r| members.contains(r)).collect();
            g.joining = still;
            g.members = members;
            return Ok((g.generation, g.rendezvous.clone()));
        }
        let host = self
            .config
            .server
            .as_deref()
            .and_then(|u| u.split("://").nth(1))
            .and_then(|rest| rest.split('/').next())
            .and_then(|hp| hp.rsplit_once(':').map(|(h, _)| h.to_owned()))
            .ok_or_else(|| ControlError::Internal("no server address for a group's store".into()))?;
        let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
        let store = StoreServer::bind((host.as_str(), 0), self.job_secret(job).into_bytes())
            .map_err(|e| ControlError::Internal(format!("hosting job {}'s group store on {host}: {e}", job.id)))?;
        let rendezvous = store.local_addr().to_string();
        groups.insert(
            job.id.clone(),
            Group {
                attempt: job.attempt,
                generation: 1,
                members,
                rendezvous: rendezvous.clone(),
                joining,
                heard: std::collections::HashMap::new(),
                _store: store,
            },
        );
        Ok((1, rendezvous))
    }

    /// `job` lost the members `lost` (`why`): the others go on in place as a smaller group. `tasks` are the
    /// attempt's tasks.
    pub(super) async fn shrink_in_place(&self, job: &JobRow, tasks: &[TaskRow], lost: &[i64], why: &str) -> Result<()> {
        let before = self.members(job).unwrap_or_else(|| {
            let mut all: Vec<i64> = tasks.iter().map(|t| t.rank).collect();
            all.sort_unstable();
            all
        });
        let positions: Vec<usize> =
            before.iter().enumerate().filter(|(_, m)| lost.contains(m)).map(|(i, _)| i).collect();
        let members: Vec<i64> = before.iter().copied().filter(|m| !lost.contains(m)).collect();
        let (generation, _) = self.next_group(job, members.clone(), Vec::new())?;
        let _ = self.sched().release_tasks(&job.id, &positions);
        // The ranks are numbered afresh: what the straggler watch kept of the old group's rows no longer applies.
        self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).remove(&job.id);
        let message = format!(
            "{why}; elastic: the {} survivors (task {}) go on in place as group {generation} of {} workers, no \
             process restarted; they take rank 0's state at their next step boundary",
            members.len(),
            members.iter().map(i64::to_string).collect::<Vec<_>>().join(", "),
            members.len()
        );
        self.db
            .transition(
                &job.id,
                &[JobState::Running],
                JobState::Running,
                Transition { kind: "regrouped", message, workers: Some(members.len() as i64), ..Default::default() },
            )
            .await?;
        Ok(())
    }

    /// Grows `job` in place by the tasks the scheduler placed (`added`): they start into a new group with the
    /// members. `false` when the job cannot grow in place (the caller grows it by a restart).
    pub(super) async fn grow_in_place(&self, job: &JobRow, spec: &JobSpec, added: &[TaskPlacement]) -> Result<bool> {
        if !self.regroups_in_place(spec) || !self.exec.joins_in_place() || added.is_empty() {
            return Ok(false);
        }
        let tasks = self.db.tasks(&job.id, job.attempt).await?;
        let before = self.members(job).unwrap_or_else(|| {
            let mut all: Vec<i64> = tasks.iter().map(|t| t.rank).collect();
            all.sort_unstable();
            all
        });
        let next = tasks.iter().map(|t| t.rank).max().unwrap_or(-1) + 1;
        let numbers: Vec<i64> = (next..next + added.len() as i64).collect();
        let members: Vec<i64> = before.iter().chain(&numbers).copied().collect();
        let world = members.len();
        let (generation, rendezvous) = self.next_group(job, members.clone(), numbers.clone())?;
        self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).remove(&job.id);
        let mut rows = Vec::with_capacity(added.len());
        let mut where_ = Vec::with_capacity(added.len());
        for (k, (number, a)) in numbers.iter().zip(added).enumerate() {
            let intent = intent_row(&job.id, job.attempt, *number, a, self.exec.host());
            self.db.upsert_task(&intent).await?;
            let mut launch: TaskLaunch = self.launch_of(job, spec, job.attempt, *number as usize, world, "", a);
            launch.join =
                Some(Join { generation, rank: before.len() + k, world_size: world, rendezvous: rendezvous.clone() });
            let task = self.exec.start(&launch)?;
            where_.push(format!("task {number} {}", self.exec.describe(&task)));
            let row = started_row(task, &a.node, self.db.now());
            self.db.upsert_task(&row).await?;
            rows.push(row);
        }
        let message = format!(
            "grows in place from {} to {world} workers into free capacity ([workers] max = {}): task {} joins group \
             {generation}; the members keep their processes and the newcomers take rank 0's state ({})",
            before.len(),
            spec.workers.range().1,
            numbers.iter().map(i64::to_string).collect::<Vec<_>>().join(", "),
            where_.join("; ")
        );
        self.db
            .transition(
                &job.id,
                &[JobState::Running],
                JobState::Running,
                Transition { kind: "regrouped", message, workers: Some(world as i64), ..Default::default() },
            )
            .await?;
        Ok(true)
    }
}
