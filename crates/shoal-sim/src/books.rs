//! What both engines keep while a trace runs — [`crate::simulate`] over the scheduler alone and
//! `simulate_control` through the server's loop — so that their reports are counted the same way: each job's
//! record, the jobs waiting and running, each team's GPUs held and asked for (and its fair entitlement while jobs
//! wait), the cluster after each pass and at each arrival.

use std::borrow::Cow;
use std::collections::BTreeSet;

use crate::error::{Result, SimError};
use crate::outcome::{ArrivalSample, JobRecord, Outcome, Sample, SimOptions, TeamTally, repeated, water_fill};
use crate::trace::Trace;

/// The trace as `options` replay it (`repeat` copies back to back), after checking `load` and `repeat`.
pub(crate) fn prepared<'t>(trace: &'t Trace, options: &SimOptions) -> Result<Cow<'t, Trace>> {
    if !(options.load.is_finite() && options.load > 0.0) {
        return Err(SimError::Options(format!("load must be a positive number, not {}", options.load)));
    }
    if options.repeat == 0 {
        return Err(SimError::Options("repeat must be at least 1".into()));
    }
    Ok(if options.repeat > 1 { Cow::Owned(repeated(trace, options.repeat)) } else { Cow::Borrowed(trace) })
}

/// The instant of the scheduler loop's pass for something that happens at `t`: the next multiple of the interval
/// (`t` itself with none).
pub(crate) fn turn_at(t: u64, interval_ms: u64) -> u64 {
    match interval_ms {
        0 => t,
        i => t.div_ceil(i).saturating_mul(i),
    }
}

/// See the module documentation. Job `i` is the trace's `i`th.
#[derive(Debug)]
pub(crate) struct Books {
    /// The outcome being filled (its `jobs` and `teams` at [`Books::finish`]).
    pub(crate) out: Outcome,
    pub(crate) jobs: Vec<JobRecord>,
    /// Jobs waiting, and running.
    pub(crate) pending: u64,
    pub(crate) running: u64,
    team_of: Vec<usize>,
    /// Per job: GPU thousandths per task, and its fewest tasks.
    gpu: Vec<u64>,
    min_tasks: Vec<u64>,
    /// Per team: GPU capacity held by running jobs, asked for by waiting ones (at their minimum), and its
    /// entitlement now.
    held: Vec<u64>,
    asked: Vec<u64>,
    entitled_now: Vec<f64>,
    tallies: Vec<TeamTally>,
    last_t: Option<u64>,
    /// What the jobs arrived so far ask for, and the running totals of those arrived at this instant.
    arrived_gpu_milli: u64,
    arrived_now: Vec<u64>,
}

impl Books {
    /// Empty books for `trace` (as [`prepared`]) on `nodes` nodes of `total_gpu_milli` GPU capacity.
    pub(crate) fn new(
        engine: &'static str,
        trace: &Trace,
        options: &SimOptions,
        nodes: usize,
        total_gpu_milli: u64,
    ) -> Books {
        let first = trace.jobs.first().map(|j| j.submit_ms).unwrap_or(0);
        let jobs = trace
            .jobs
            .iter()
            .map(|j| JobRecord {
                id: j.id.clone(),
                team: j.team.clone(),
                submit_ms: first + ((j.submit_ms - first) as f64 / options.load).round() as u64,
                first_start_ms: None,
                end_ms: None,
                starts: 0,
                preemptions: 0,
                gpu_milli_ms: 0,
                demand_milli_ms: j.per_task.gpus_milli as u128 * j.tasks_min as u128 * j.duration_ms as u128,
                worked_task_ms: 0,
                rejected: None,
            })
            .collect();
        let names: Vec<&str> =
            trace.jobs.iter().map(|j| j.team.as_str()).collect::<BTreeSet<_>>().into_iter().collect();
        let out = Outcome {
            engine,
            policy: options.policy,
            options: options.clone(),
            trace: trace.name.clone(),
            skipped: trace.skipped,
            nodes,
            total_gpu_milli,
            jobs: Vec::new(),
            series: Vec::new(),
            passes: 0,
            preemptions: 0,
            shrinks: 0,
            grows: 0,
            drain_gpu_milli_ms: 0,
            teams: Vec::new(),
            arrivals: Vec::with_capacity(trace.jobs.len()),
        };
        Books {
            out,
            jobs,
            pending: 0,
            running: 0,
            team_of: trace.jobs.iter().map(|j| names.binary_search(&j.team.as_str()).unwrap_or(0)).collect(),
            gpu: trace.jobs.iter().map(|j| j.per_task.gpus_milli).collect(),
            min_tasks: trace.jobs.iter().map(|j| u64::from(j.tasks_min)).collect(),
            held: vec![0; names.len()],
            asked: vec![0; names.len()],
            entitled_now: vec![0.0; names.len()],
            tallies: names
                .iter()
                .map(|t| TeamTally { team: (*t).to_owned(), contended_gpu_milli_ms: 0, entitled_gpu_milli_ms: 0.0 })
                .collect(),
            last_t: None,
            arrived_gpu_milli: 0,
            arrived_now: Vec::new(),
        }
    }

    /// Time moves to the pass at `now`: while jobs waited, each team's held GPUs and entitlement accrue.
    pub(crate) fn advance(&mut self, now: u64) {
        if let Some(last) = self.last_t
            && self.pending > 0
        {
            let dt = now.saturating_sub(last);
            for (t, tally) in self.tallies.iter_mut().enumerate() {
                tally.contended_gpu_milli_ms += self.held[t] as u128 * dt as u128;
                tally.entitled_gpu_milli_ms += self.entitled_now[t] * dt as f64;
            }
        }
        self.last_t = Some(now);
    }

    /// Job `i` arrived: waiting, or refused saying why.
    pub(crate) fn arrived(&mut self, i: usize, refused: Option<String>) {
        match refused {
            None => {
                self.pending += 1;
                self.asked[self.team_of[i]] += self.gpu[i] * self.min_tasks[i];
            }
            Some(why) => self.jobs[i].rejected = Some(why),
        }
        self.arrived_gpu_milli = self.arrived_gpu_milli.saturating_add(self.gpu[i].saturating_mul(self.min_tasks[i]));
        self.arrived_now.push(self.arrived_gpu_milli);
    }

    /// Job `i` started (again) at `now` with `tasks` tasks.
    pub(crate) fn started(&mut self, i: usize, tasks: u32, now: u64) {
        let team = self.team_of[i];
        self.pending -= 1;
        self.running += 1;
        self.asked[team] -= self.gpu[i] * self.min_tasks[i];
        self.held[team] += self.gpu[i] * u64::from(tasks);
        self.jobs[i].starts += 1;
        self.jobs[i].first_start_ms.get_or_insert(now);
    }

    /// Running job `i` went from `from` to `to` tasks.
    pub(crate) fn resized(&mut self, i: usize, from: u32, to: u32) {
        let team = self.team_of[i];
        self.held[team] = self.held[team] + self.gpu[i] * u64::from(to) - self.gpu[i] * u64::from(from);
    }

    /// Running job `i` stopped (`preempted`, or for a resize): it no longer runs (its tasks are held until
    /// [`Books::requeued`]).
    pub(crate) fn stopped(&mut self, i: usize, preempted: bool) {
        self.running -= 1;
        if preempted {
            self.jobs[i].preemptions += 1;
            self.out.preemptions += 1;
        }
    }

    /// Job `i`, which held `tasks` tasks, waits again.
    pub(crate) fn requeued(&mut self, i: usize, tasks: u32) {
        let team = self.team_of[i];
        self.pending += 1;
        self.held[team] -= self.gpu[i] * u64::from(tasks);
        self.asked[team] += self.gpu[i] * self.min_tasks[i];
    }

    /// Job `i`, running with `tasks` tasks, ended at `t`.
    pub(crate) fn ended(&mut self, i: usize, tasks: u32, t: u64) {
        self.running -= 1;
        self.held[self.team_of[i]] -= self.gpu[i] * u64::from(tasks);
        self.jobs[i].end_ms = Some(t);
    }

    /// GPU capacity held by running jobs.
    pub(crate) fn held_gpu_milli(&self) -> u64 {
        self.held.iter().sum()
    }

    /// The cluster after the pass at `now`: `allocated` GPU capacity (running and draining jobs), FGD's
    /// `fragmentation` for the head of the queue.
    pub(crate) fn sampled(&mut self, now: u64, allocated: u64, fragmentation: u64) {
        if self.pending > 0 {
            let demand: Vec<u64> = self.held.iter().zip(&self.asked).map(|(h, a)| h + a).collect();
            self.entitled_now = water_fill(&demand, self.out.total_gpu_milli);
        }
        let sample = Sample {
            t_ms: now,
            allocated_gpu_milli: allocated,
            pending: self.pending,
            running: self.running,
            fragmentation_milli: fragmentation,
        };
        match self.out.series.last_mut() {
            Some(last) if last.t_ms == now => *last = sample,
            _ => self.out.series.push(sample),
        }
        let unallocated_gpu_milli = self.out.total_gpu_milli.saturating_sub(allocated);
        self.out
            .arrivals
            .extend(self.arrived_now.drain(..).map(|a| ArrivalSample { arrived_gpu_milli: a, unallocated_gpu_milli }));
    }

    /// The outcome, with every job's record and each team's tally.
    pub(crate) fn finish(mut self) -> Outcome {
        self.out.jobs = self.jobs;
        self.out.teams = self.tallies;
        self.out
    }
}
