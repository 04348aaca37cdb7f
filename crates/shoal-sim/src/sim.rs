//! The event loop: arrivals and completions in time order, one scheduling pass of `shoal-sched` at each instant
//! something happened, its decisions carried out on the simulated jobs.
//!
//! A job's work is `duration × tasks_min` task-milliseconds; with `k` tasks it does `k` a millisecond (elastic
//! jobs scale linearly). A preempted job keeps the work it did (it checkpoints when told) and holds its
//! resources through the grace period doing none; it resumes with what is left. Every job's run-time estimate
//! is its real duration (perfect user estimates, which backfill and SJF use; LAS uses none).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

use shoal_sched::{Config, Decision, JobRequest, Node, Queue, Quota, Scheduler};

use crate::books::{Books, prepared, turn_at};
use crate::error::{Result, SimError};
use crate::outcome::{JobRecord, Outcome, SimOptions};
use crate::trace::{Trace, TraceJob};

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

/// Runs `trace` on `nodes` under `options`.
pub fn simulate(trace: &Trace, nodes: Vec<Node>, options: &SimOptions) -> Result<Outcome> {
    let trace = &*prepared(trace, options)?;
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
    let mut books = Books::new("scheduler", trace, options, node_count, sched.total_gpu_milli());
    let mut live: Vec<Live> = trace
        .jobs
        .iter()
        .map(|j| Live { phase: Phase::Unsubmitted, left: j.duration_ms as u128 * j.tasks_min as u128, version: 0 })
        .collect();
    let index: HashMap<&str, usize> = trace.jobs.iter().enumerate().map(|(i, j)| (j.id.as_str(), i)).collect();

    let mut events: BinaryHeap<Reverse<(u64, Kind, usize, u64)>> = BinaryHeap::new();
    let mut next = 0usize;
    loop {
        let arrival = books.jobs.get(next).map(|j| j.submit_ms);
        let event = events.peek().map(|Reverse(e)| e.0);
        let first_event = match (arrival, event) {
            (Some(a), Some(e)) => a.min(e),
            (Some(a), None) => a,
            (None, Some(e)) => e,
            (None, None) => break,
        };
        // The pass runs at the next tick of the scheduler's loop; what happens before it, happens at its time.
        let now = turn_at(first_event, options.interval_ms);
        books.advance(now);
        loop {
            let arrival = books.jobs.get(next).map(|j| j.submit_ms).filter(|&a| a <= now);
            let event = events.peek().map(|Reverse(e)| *e).filter(|e| e.0 <= now);
            let (t, kind, i, version) = match (arrival, event) {
                (Some(a), Some(e)) if a < e.0 => (a, None, next, 0),
                (_, Some(e)) => (e.0, Some(e.1), e.2, e.3),
                (Some(a), None) => (a, None, next, 0),
                (None, None) => break,
            };
            let Some(kind) = kind else {
                let refused = submit(&mut sched, &trace.jobs[i], &mut live[i], t);
                books.arrived(i, refused);
                next += 1;
                continue;
            };
            events.pop();
            if kind == Kind::Finish && live[i].version == version {
                let Phase::Running { since, tasks } = live[i].phase else {
                    return Err(SimError::Audit {
                        at_ms: t,
                        what: format!("job {} ended but was not running", books.jobs[i].id),
                    });
                };
                progress(&mut live[i], &mut books.jobs[i], &trace.jobs[i], since, tasks, t);
                if live[i].left != 0 {
                    return Err(SimError::Audit {
                        at_ms: t,
                        what: format!("job {} ended with work left", books.jobs[i].id),
                    });
                }
                sched.finish(&books.jobs[i].id).map_err(|e| SimError::Audit { at_ms: t, what: e.to_string() })?;
                live[i].phase = Phase::Done;
                books.ended(i, tasks, t);
            }
        }
        let decisions = sched.schedule(now);
        books.out.passes += 1;
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
            let (l, tj) = (&mut live[i], &trace.jobs[i]);
            let bad =
                |what: &str| SimError::Audit { at_ms: now, what: format!("job {id}: {what} in phase {:?}", l.phase) };
            match (&d, l.phase) {
                (Decision::Place { assignments, .. }, Phase::Waiting) => {
                    let tasks = assignments.len() as u32;
                    l.phase = Phase::Running { since: now, tasks };
                    books.started(i, tasks, now);
                    schedule_end(l, &mut events, i, now, tasks);
                }
                (Decision::Grow { tasks: added, .. }, Phase::Running { since, tasks }) => {
                    progress(l, &mut books.jobs[i], tj, since, tasks, now);
                    let to = tasks + added.len() as u32;
                    books.resized(i, tasks, to);
                    l.phase = Phase::Running { since: now, tasks: to };
                    books.out.grows += 1;
                    schedule_end(l, &mut events, i, now, to);
                }
                (Decision::Shrink { by, .. }, Phase::Running { since, tasks }) if *by < tasks => {
                    progress(l, &mut books.jobs[i], tj, since, tasks, now);
                    let to = tasks - by;
                    books.resized(i, tasks, to);
                    l.phase = Phase::Running { since: now, tasks: to };
                    books.out.shrinks += 1;
                    schedule_end(l, &mut events, i, now, to);
                }
                (Decision::Preempt { grace_ms, .. }, Phase::Running { since, tasks }) => {
                    progress(l, &mut books.jobs[i], tj, since, tasks, now);
                    l.phase = Phase::Draining { since: now, tasks };
                    l.version += 1;
                    books.stopped(i, true);
                    events.push(Reverse((now.saturating_add(*grace_ms), Kind::Wake, i, 0)));
                }
                (Decision::Requeue { .. }, Phase::Draining { since, tasks }) => {
                    books.out.drain_gpu_milli_ms +=
                        tj.per_task.gpus_milli as u128 * tasks as u128 * now.saturating_sub(since) as u128;
                    l.phase = Phase::Waiting;
                    books.requeued(i, tasks);
                }
                _ => return Err(bad(&format!("{d:?}"))),
            }
        }
        if options.audit {
            audit(&sched, now)?;
        }
        let head = if books.pending > 0 { sched.blocked().and_then(|b| sched.request(b)) } else { None };
        let fragmentation = head.map(|r| sched.fragmentation_milli(&r.per_task)).unwrap_or(0);
        books.sampled(now, sched.allocated_gpu_milli(), fragmentation);
        if next == books.jobs.len() && events.is_empty() && books.pending > 0 {
            return Err(SimError::Audit {
                at_ms: now,
                what: format!("{} jobs wait on a cluster where nothing will end", books.pending),
            });
        }
    }
    if options.audit {
        for (r, l) in books.jobs.iter().zip(&live) {
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
    Ok(books.finish())
}

/// Submits a job at `t`; says why when the scheduler refuses it.
fn submit(sched: &mut Scheduler, j: &TraceJob, l: &mut Live, t: u64) -> Option<String> {
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
            None
        }
        Err(e) => {
            l.phase = Phase::Done;
            Some(e.to_string())
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
