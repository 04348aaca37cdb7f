//! The event loop: arrivals and completions in time order, one scheduling pass of `shoal-sched` at each instant
//! something happened, its decisions carried out on the simulated jobs.
//!
//! A job's work is `duration × tasks_min` task-milliseconds; with `k` tasks it does `k` a millisecond (elastic
//! jobs scale linearly). A preempted job keeps the work it did (it checkpoints when told) and holds its
//! resources through the grace period doing none; it resumes with what is left. Every job's run-time estimate
//! is its real duration (perfect user estimates, which backfill and SJF use; LAS uses none).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

use shoal_sched::{Config, Decision, JobRequest, Node, Policy, Queue, Quota, Scheduler};

use crate::error::{Result, SimError};
use crate::trace::{Trace, TraceJob};

/// How to run a simulation.
#[derive(Debug, Clone, PartialEq)]
pub struct SimOptions {
    /// The scheduling policy.
    pub policy: Policy,
    /// Arrivals this many times as fast as the trace's (`submit = first + (submit - first) / load`); durations
    /// are kept. 1 replays the trace as it was.
    pub load: f64,
    /// The trace replayed this many times back to back (copy `c` submitted `c` trace spans later, its ids
    /// suffixed `~c`), to offer more work than the cluster holds; 1 replays it once.
    pub repeat: u32,
    /// The scheduler's loop: a pass runs at the first multiple of this after something happened (everything
    /// up to then happens at its own time, the pass sees it all); 0 runs a pass at every instant something happens.
    pub interval_ms: u64,
    /// Grace period of a preempted job.
    pub grace_ms: u64,
    /// LAS thresholds in GPU-milliseconds (`None`: shoal-sched's defaults).
    pub las_thresholds_gpu_ms: Option<Vec<u64>>,
    /// Check the invariants after every pass (no node over capacity, the scheduler's books balance); slow.
    pub audit: bool,
    /// The seed given, recorded in the report (it draws a synthetic trace; the simulation itself draws nothing).
    pub seed: u64,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            policy: Policy::default(),
            load: 1.0,
            repeat: 1,
            interval_ms: 1_000,
            grace_ms: 30_000,
            las_thresholds_gpu_ms: None,
            audit: false,
            seed: 0,
        }
    }
}

/// What happened to one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRecord {
    /// Its id.
    pub id: String,
    /// Its team.
    pub team: String,
    /// Submitted (after the load factor).
    pub submit_ms: u64,
    /// First started.
    pub first_start_ms: Option<u64>,
    /// Ended.
    pub end_ms: Option<u64>,
    /// How many times it started (1 + resumptions after preemption).
    pub starts: u32,
    /// How many times it was preempted.
    pub preemptions: u32,
    /// GPU time held while running, thousandths of a GPU times milliseconds.
    pub gpu_milli_ms: u128,
    /// GPU time it asked for: its GPUs at `tasks_min` times its duration.
    pub demand_milli_ms: u128,
    /// Task-milliseconds of work done (equals `duration × tasks_min` once it ends).
    pub worked_task_ms: u128,
    /// Why the scheduler refused it, if it did.
    pub rejected: Option<String>,
}

/// The cluster after one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// When.
    pub t_ms: u64,
    /// GPU capacity held by running and draining jobs, thousandths.
    pub allocated_gpu_milli: u64,
    /// Jobs waiting.
    pub pending: u64,
    /// Jobs running.
    pub running: u64,
    /// FGD's fragmentation for the head of the queue (the first job the pass could not start), thousandths of a
    /// GPU; 0 when nothing waits.
    pub fragmentation_milli: u64,
}

/// The cluster as a job of the trace arrives: after the pass of the instant it arrives at (the same instants,
/// in the same order, under every policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrivalSample {
    /// GPU capacity asked for by the jobs arrived so far, this one included (GPUs × minimum tasks), thousandths.
    pub arrived_gpu_milli: u64,
    /// GPU capacity nobody holds after the pass, thousandths.
    pub unallocated_gpu_milli: u64,
}

/// One team's GPU time while jobs waited, against what it was entitled to then.
#[derive(Debug, Clone, PartialEq)]
pub struct TeamTally {
    /// The team.
    pub team: String,
    /// GPU time its jobs held while some job waited, thousandths × ms.
    pub contended_gpu_milli_ms: u128,
    /// Its entitlement over the same time, thousandths × ms: at each instant the cluster's GPUs split max-min
    /// fairly among the teams by what they ask for (held plus waiting at their minimum size).
    pub entitled_gpu_milli_ms: f64,
}

/// Max-min fair split of `capacity` among demands: each gets its demand or an equal level, whichever is less.
pub(crate) fn water_fill(demand: &[u64], capacity: u64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..demand.len()).filter(|&i| demand[i] > 0).collect();
    order.sort_by_key(|&i| (demand[i], i));
    let mut out = vec![0.0; demand.len()];
    let mut left = capacity as f64;
    let mut n = order.len();
    for i in order {
        let level = left / n as f64;
        let give = (demand[i] as f64).min(level);
        out[i] = give;
        left -= give;
        n -= 1;
    }
    out
}

/// Everything a simulation produced; [`crate::Report`] sums it up.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The policy it ran.
    pub policy: Policy,
    /// The options.
    pub options: SimOptions,
    /// The trace's name.
    pub trace: String,
    /// Rows the trace skipped.
    pub skipped: usize,
    /// Nodes of the cluster.
    pub nodes: usize,
    /// GPU capacity, thousandths.
    pub total_gpu_milli: u64,
    /// One record per job, in trace order.
    pub jobs: Vec<JobRecord>,
    /// The cluster after each pass (one sample per instant).
    pub series: Vec<Sample>,
    /// Scheduling passes run.
    pub passes: u64,
    /// Decisions carried out, by kind.
    pub preemptions: u64,
    /// Shrinks.
    pub shrinks: u64,
    /// Grows.
    pub grows: u64,
    /// GPU time held by preempted jobs through their grace periods (thousandths × ms): no work done.
    pub drain_gpu_milli_ms: u128,
    /// Each team's share while jobs waited, by team name.
    pub teams: Vec<TeamTally>,
    /// One sample per job of the trace, in arrival order.
    pub arrivals: Vec<ArrivalSample>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Unsubmitted,
    Waiting,
    Running { since: u64, tasks: u32 },
    Draining { since: u64, tasks: u32 },
    Done,
}

#[derive(Debug)]
struct Live {
    phase: Phase,
    /// Task-milliseconds of work left.
    left: u128,
    /// Bumped when the job's end moves, so stale completion events are ignored.
    version: u64,
}

/// Events at one instant happen in this order: completions first, then the ends of grace periods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Finish,
    Wake,
}

/// The trace's jobs `repeat` times back to back, copy `c` shifted by `c` spans (last submission − first, plus
/// one second) and its ids suffixed `~c`.
pub(crate) fn repeated(trace: &Trace, repeat: u32) -> Trace {
    let first = trace.jobs.first().map(|j| j.submit_ms).unwrap_or(0);
    let span = trace.jobs.last().map(|j| j.submit_ms - first).unwrap_or(0) + 1000;
    let mut jobs = Vec::with_capacity(trace.jobs.len() * repeat as usize);
    for c in 0..repeat as u64 {
        jobs.extend(trace.jobs.iter().map(|j| TraceJob {
            id: if c == 0 { j.id.clone() } else { format!("{}~{c}", j.id) },
            submit_ms: j.submit_ms + c * span,
            ..j.clone()
        }));
    }
    Trace { jobs, ..trace.clone() }
}

/// Runs `trace` on `nodes` under `options`.
pub fn simulate(trace: &Trace, nodes: Vec<Node>, options: &SimOptions) -> Result<Outcome> {
    if !(options.load.is_finite() && options.load > 0.0) {
        return Err(SimError::Options(format!("load must be a positive number, not {}", options.load)));
    }
    if options.repeat == 0 {
        return Err(SimError::Options("repeat must be at least 1".into()));
    }
    let copies;
    let trace = if options.repeat > 1 {
        copies = repeated(trace, options.repeat);
        &copies
    } else {
        trace
    };
    let queues: BTreeSet<&str> = trace.jobs.iter().map(|j| j.queue.as_str()).collect();
    let queues: Vec<Queue> = queues
        .into_iter()
        .map(|q| Queue { name: q.to_owned(), guaranteed: Quota::UNLIMITED, can_borrow: true })
        .collect();
    let mut config = Config { policy: options.policy, preempt_grace_ms: options.grace_ms, ..Config::default() };
    if let Some(t) = &options.las_thresholds_gpu_ms {
        config.las_thresholds_gpu_ms = t.clone();
    }
    let node_count = nodes.len();
    let mut sched = Scheduler::new(nodes, queues, config).map_err(SimError::Cluster)?;
    let total_gpu_milli = sched.total_gpu_milli();

    let first = trace.jobs.first().map(|j| j.submit_ms).unwrap_or(0);
    let submit_of = |j: &TraceJob| first + ((j.submit_ms - first) as f64 / options.load).round() as u64;
    let mut jobs: Vec<JobRecord> = trace
        .jobs
        .iter()
        .map(|j| JobRecord {
            id: j.id.clone(),
            team: j.team.clone(),
            submit_ms: submit_of(j),
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
    let mut live: Vec<Live> = trace
        .jobs
        .iter()
        .map(|j| Live { phase: Phase::Unsubmitted, left: j.duration_ms as u128 * j.tasks_min as u128, version: 0 })
        .collect();
    let index: HashMap<&str, usize> = trace.jobs.iter().enumerate().map(|(i, j)| (j.id.as_str(), i)).collect();

    let mut events: BinaryHeap<Reverse<(u64, Kind, usize, u64)>> = BinaryHeap::new();
    let mut out = Outcome {
        policy: options.policy,
        options: options.clone(),
        trace: trace.name.clone(),
        skipped: trace.skipped,
        nodes: node_count,
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
    // What the jobs arrived so far ask for, and those arrived at this instant (their `arrived_gpu_milli`).
    let mut arrived_gpu_milli = 0u64;
    let mut arrived_now: Vec<u64> = Vec::new();
    let team_names: Vec<&str> =
        trace.jobs.iter().map(|j| j.team.as_str()).collect::<BTreeSet<_>>().into_iter().collect();
    let team_of: Vec<usize> =
        trace.jobs.iter().map(|j| team_names.binary_search(&j.team.as_str()).unwrap_or(0)).collect();
    let gpu_of = |i: usize| trace.jobs[i].per_task.gpus_milli;
    // Per team: GPU capacity held, GPU capacity asked for by waiting jobs; and the tallies.
    let mut held = vec![0u64; team_names.len()];
    let mut asked = vec![0u64; team_names.len()];
    let mut entitled_now = vec![0.0f64; team_names.len()];
    let mut tallies: Vec<TeamTally> = team_names
        .iter()
        .map(|t| TeamTally { team: (*t).to_owned(), contended_gpu_milli_ms: 0, entitled_gpu_milli_ms: 0.0 })
        .collect();
    let mut last_t: Option<u64> = None;
    let (mut pending, mut running) = (0u64, 0u64);
    let mut next = 0usize;
    loop {
        let arrival = jobs.get(next).map(|j| j.submit_ms);
        let event = events.peek().map(|Reverse(e)| e.0);
        let first_event = match (arrival, event) {
            (Some(a), Some(e)) => a.min(e),
            (Some(a), None) => a,
            (None, Some(e)) => e,
            (None, None) => break,
        };
        // The pass runs at the next tick of the scheduler's loop; what happens before it, happens at its time.
        let now = match options.interval_ms {
            0 => first_event,
            i => first_event.div_ceil(i).saturating_mul(i),
        };
        if let Some(last) = last_t
            && pending > 0
        {
            let dt = now.saturating_sub(last);
            for (t, tally) in tallies.iter_mut().enumerate() {
                tally.contended_gpu_milli_ms += held[t] as u128 * dt as u128;
                tally.entitled_gpu_milli_ms += entitled_now[t] * dt as f64;
            }
        }
        last_t = Some(now);
        loop {
            let arrival = jobs.get(next).map(|j| j.submit_ms).filter(|&a| a <= now);
            let event = events.peek().map(|Reverse(e)| *e).filter(|e| e.0 <= now);
            let (t, kind, i, version) = match (arrival, event) {
                (Some(a), Some(e)) if a < e.0 => (a, None, next, 0),
                (_, Some(e)) => (e.0, Some(e.1), e.2, e.3),
                (Some(a), None) => (a, None, next, 0),
                (None, None) => break,
            };
            let Some(kind) = kind else {
                submit(&mut sched, &trace.jobs[i], &mut live[i], &mut jobs[i], t, &mut pending, &mut asked[team_of[i]]);
                arrived_gpu_milli = arrived_gpu_milli
                    .saturating_add(trace.jobs[i].per_task.gpus_milli.saturating_mul(trace.jobs[i].tasks_min as u64));
                arrived_now.push(arrived_gpu_milli);
                next += 1;
                continue;
            };
            events.pop();
            if kind == Kind::Finish && live[i].version == version {
                let Phase::Running { since, tasks } = live[i].phase else {
                    return Err(SimError::Audit {
                        at_ms: t,
                        what: format!("job {} ended but was not running", jobs[i].id),
                    });
                };
                progress(&mut live[i], &mut jobs[i], &trace.jobs[i], since, tasks, t);
                if live[i].left != 0 {
                    return Err(SimError::Audit { at_ms: t, what: format!("job {} ended with work left", jobs[i].id) });
                }
                sched.finish(&jobs[i].id).map_err(|e| SimError::Audit { at_ms: t, what: e.to_string() })?;
                live[i].phase = Phase::Done;
                jobs[i].end_ms = Some(t);
                running -= 1;
                held[team_of[i]] -= gpu_of(i) * tasks as u64;
            }
        }
        let decisions = sched.schedule(now);
        out.passes += 1;
        for d in decisions {
            let id = match &d {
                Decision::Place { job, .. }
                | Decision::Preempt { job, .. }
                | Decision::Requeue { job }
                | Decision::Grow { job, .. }
                | Decision::Shrink { job, .. } => job,
            };
            let Some(&i) = index.get(id.as_str()) else {
                return Err(SimError::Audit { at_ms: now, what: format!("a decision names unknown job {id}") });
            };
            let (l, rec, tj) = (&mut live[i], &mut jobs[i], &trace.jobs[i]);
            let (g, team) = (tj.per_task.gpus_milli, team_of[i]);
            let bad =
                |what: &str| SimError::Audit { at_ms: now, what: format!("job {id}: {what} in phase {:?}", l.phase) };
            match (&d, l.phase) {
                (Decision::Place { assignments, .. }, Phase::Waiting) => {
                    let tasks = assignments.len() as u32;
                    l.phase = Phase::Running { since: now, tasks };
                    rec.starts += 1;
                    rec.first_start_ms.get_or_insert(now);
                    pending -= 1;
                    running += 1;
                    asked[team] -= g * tj.tasks_min as u64;
                    held[team] += g * tasks as u64;
                    schedule_end(l, &mut events, i, now, tasks);
                }
                (Decision::Grow { tasks: added, .. }, Phase::Running { since, tasks }) => {
                    progress(l, rec, tj, since, tasks, now);
                    let tasks = tasks + added.len() as u32;
                    held[team] += g * added.len() as u64;
                    l.phase = Phase::Running { since: now, tasks };
                    out.grows += 1;
                    schedule_end(l, &mut events, i, now, tasks);
                }
                (Decision::Shrink { by, .. }, Phase::Running { since, tasks }) if *by < tasks => {
                    progress(l, rec, tj, since, tasks, now);
                    let tasks = tasks - by;
                    held[team] -= g * *by as u64;
                    l.phase = Phase::Running { since: now, tasks };
                    out.shrinks += 1;
                    schedule_end(l, &mut events, i, now, tasks);
                }
                (Decision::Preempt { grace_ms, .. }, Phase::Running { since, tasks }) => {
                    progress(l, rec, tj, since, tasks, now);
                    l.phase = Phase::Draining { since: now, tasks };
                    l.version += 1;
                    rec.preemptions += 1;
                    out.preemptions += 1;
                    running -= 1;
                    events.push(Reverse((now.saturating_add(*grace_ms), Kind::Wake, i, 0)));
                }
                (Decision::Requeue { .. }, Phase::Draining { since, tasks }) => {
                    out.drain_gpu_milli_ms +=
                        tj.per_task.gpus_milli as u128 * tasks as u128 * now.saturating_sub(since) as u128;
                    l.phase = Phase::Waiting;
                    pending += 1;
                    held[team] -= g * tasks as u64;
                    asked[team] += g * tj.tasks_min as u64;
                }
                _ => return Err(bad(&format!("{d:?}"))),
            }
        }
        if options.audit {
            audit(&sched, now)?;
        }
        if pending > 0 {
            let demand: Vec<u64> = held.iter().zip(&asked).map(|(h, a)| h + a).collect();
            entitled_now = water_fill(&demand, total_gpu_milli);
        }
        let head = if pending > 0 { sched.blocked().and_then(|b| sched.request(b)) } else { None };
        let sample = Sample {
            t_ms: now,
            allocated_gpu_milli: sched.allocated_gpu_milli(),
            pending,
            running,
            fragmentation_milli: head.map(|r| sched.fragmentation_milli(&r.per_task)).unwrap_or(0),
        };
        match out.series.last_mut() {
            Some(last) if last.t_ms == now => *last = sample,
            _ => out.series.push(sample),
        }
        let unallocated_gpu_milli = total_gpu_milli.saturating_sub(sample.allocated_gpu_milli);
        out.arrivals
            .extend(arrived_now.drain(..).map(|a| ArrivalSample { arrived_gpu_milli: a, unallocated_gpu_milli }));
        if next == jobs.len() && events.is_empty() && pending > 0 {
            return Err(SimError::Audit {
                at_ms: now,
                what: format!("{pending} jobs wait on a cluster where nothing will end"),
            });
        }
    }
    if options.audit {
        for (r, l) in jobs.iter().zip(&live) {
            let ok = match l.phase {
                Phase::Done => r.rejected.is_some() || (r.end_ms.is_some() && r.starts == r.preemptions + 1),
                _ => false,
            };
            if !ok {
                return Err(SimError::Audit {
                    at_ms: 0,
                    what: format!("job {} did not end once: {:?} {r:?}", r.id, l.phase),
                });
            }
        }
    }
    out.jobs = jobs;
    out.teams = tallies;
    Ok(out)
}

/// Submits a job at `t`; a job the scheduler refuses is recorded so.
fn submit(
    sched: &mut Scheduler,
    j: &TraceJob,
    l: &mut Live,
    rec: &mut JobRecord,
    t: u64,
    pending: &mut u64,
    asked: &mut u64,
) {
    let req = JobRequest {
        id: j.id.clone(),
        team: j.team.clone(),
        queue: j.queue.clone(),
        priority: j.priority,
        tasks_min: j.tasks_min,
        tasks_max: j.tasks_max,
        per_task: j.per_task,
        spread: false,
        submitted_at_ms: t,
        expected_runtime_ms: Some(j.duration_ms),
        avoid_nodes: Vec::new(),
    };
    match sched.submit(req) {
        Ok(()) => {
            l.phase = Phase::Waiting;
            *pending += 1;
            *asked += j.per_task.gpus_milli * j.tasks_min as u64;
        }
        Err(e) => {
            l.phase = Phase::Done;
            rec.rejected = Some(e.to_string());
        }
    }
}

/// Counts the work and GPU time of a running job from `since` to `now`.
fn progress(l: &mut Live, rec: &mut JobRecord, j: &TraceJob, since: u64, tasks: u32, now: u64) {
    let dt = now.saturating_sub(since) as u128;
    let done = (dt * tasks as u128).min(l.left);
    l.left -= done;
    rec.worked_task_ms += done;
    rec.gpu_milli_ms += j.per_task.gpus_milli as u128 * tasks as u128 * dt;
}

/// Puts the job's completion, at its current size, on the event queue.
fn schedule_end(
    l: &mut Live,
    events: &mut BinaryHeap<Reverse<(u64, Kind, usize, u64)>>,
    i: usize,
    now: u64,
    tasks: u32,
) {
    l.version += 1;
    let k = tasks.max(1) as u128;
    let dt = l.left.div_ceil(k);
    let end = now.saturating_add(u64::try_from(dt).unwrap_or(u64::MAX));
    events.push(Reverse((end, Kind::Finish, i, l.version)));
}

/// The scheduler's free-capacity books agree with its jobs, and no node holds more than it has.
fn audit(sched: &Scheduler, now: u64) -> Result<()> {
    if !sched.books_balance() {
        return Err(SimError::Audit { at_ms: now, what: "the scheduler's free-capacity books do not balance".into() });
    }
    for (a, n) in sched.allocations().iter().zip(sched.nodes()) {
        let over_gpu = a.gpus.iter().zip(&n.gpus).any(|(&(share, mem), g)| share > 1000 || mem > g.memory_bytes);
        if a.cpus_milli > n.cpus_milli || a.memory_bytes > n.memory_bytes || over_gpu {
            return Err(SimError::Audit { at_ms: now, what: format!("node {} is over capacity: {a:?}", n.id) });
        }
    }
    Ok(())
}
