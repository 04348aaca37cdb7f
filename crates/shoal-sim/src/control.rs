//! A trace replayed through the server's own control loop (feature `control`, `shoal sim --engine control`):
//! `shoal-control`'s store (SQLite in a scratch directory), admission, placement, preemption with its grace
//! period and requeueing, with `shoal-exec`'s fake executor standing in for the processes and a manual clock
//! for time.
//!
//! Each job is submitted as its team, through the same function as `POST /api/v1/jobs`, as a command job whose
//! `expected_runtime` is its duration (capped at the spec's longest duration, `shoal_spec::MAX_DURATION`). The loop turns (`Control::tick`) at each
//! instant of the simulated scheduler loop; after each turn this driver reads which tasks the fake executor runs.
//! A job's work is counted as [`crate::simulate`] counts it (task-milliseconds, linear in its tasks); when it is
//! done its tasks exit 0, and the next turn finds the job succeeded. Nothing here decides: every start, stop and
//! requeue is the control loop's.
//!
//! Slower than the scheduler alone (every turn reads the store), so meant for traces of up to some thousands of
//! jobs; the report is the same [`Outcome`].

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use shoal_control::clock::Clock;
use shoal_control::db::{JobState, Principal};
use shoal_control::server::{ServerOptions, prepare};
use shoal_exec::NodeInfo;
use shoal_exec::fake::FakeExecutor;
use shoal_sched::Node;

use crate::books::{Books, prepared, turn_at};
use crate::error::{Result, SimError};
use crate::outcome::{Outcome, SimOptions};
use crate::trace::{Trace, TraceJob};

/// Runs `trace` on `nodes` through the server's control loop under `options`.
pub fn simulate_control(trace: &Trace, nodes: Vec<Node>, options: &SimOptions) -> Result<Outcome> {
    if options.las_thresholds_gpu_ms.is_some() {
        return Err(SimError::Options(
            "--las-thresholds: the server's control loop runs shoal-sched's default thresholds; drop the option or \
             use --engine scheduler"
                .into(),
        ));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| SimError::Control(format!("starting the control loop's runtime: {e}")))?;
    let scratch = Scratch::new()?;
    runtime.block_on(run(trace, nodes, options, &scratch.0))
}

/// A directory for the server's store, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Scratch> {
        let base =
            if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = base.join(format!("shoal-sim-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|source| SimError::Io { path: dir.display().to_string(), source })?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn control_err(what: &str) -> impl Fn(shoal_control::error::ControlError) -> SimError + '_ {
    move |e| SimError::Control(format!("{what}: {e}"))
}

/// One job as this driver follows it.
#[derive(Debug, Default, Clone, Copy)]
struct Follow {
    /// Tasks running after the last turn, and since when.
    tasks: u32,
    since: u64,
    /// Task-milliseconds of work left.
    left: u128,
    /// Bumped when its end moves.
    version: u64,
    /// Its tasks were told to exit 0 (its work is done) at this time.
    exited_at: Option<u64>,
}

/// The job spec a trace job is submitted as.
fn spec_of(j: &TraceJob, name: &str) -> String {
    let r = &j.per_task;
    let workers = if j.tasks_min == j.tasks_max {
        format!("count = {}", j.tasks_min)
    } else {
        format!("min = {}\nmax = {}", j.tasks_min, j.tasks_max)
    };
    let gpus = match (r.gpus_milli, r.gpu_memory_bytes) {
        (0, _) => String::new(),
        (g, 0) => format!("gpus = {}\n", g as f64 / 1000.0),
        (g, m) => format!("gpus = {}\ngpu_memory = {m}\n", g as f64 / 1000.0),
    };
    let policy = if j.tasks_min == j.tasks_max { "none" } else { "elastic" };
    format!(
        "name = \"{name}\"\npriority = {}\nexpected_runtime = {}\n[workers]\n{workers}\n[resources]\ncpus = \"{}m\"\n\
         memory = {}\n{gpus}[fault_tolerance]\npolicy = \"{policy}\"\nmax_restarts = 0\nbackoff = 0\n[train]\n\
         command = [\"true\"]\n",
        j.priority,
        (j.duration_ms.clamp(1000, shoal_spec::MAX_DURATION.as_millis() as u64) as f64 / 1000.0),
        r.cpus_milli.max(1),
        r.memory_bytes.max(1),
    )
}

async fn run(trace: &Trace, nodes: Vec<Node>, options: &SimOptions, dir: &std::path::Path) -> Result<Outcome> {
    let trace = &*prepared(trace, options)?;
    let gpu_memory = nodes.iter().flat_map(|n| n.gpus.iter().map(|g| g.memory_bytes)).max().unwrap_or(80 << 30);
    let infos: Vec<NodeInfo> = nodes
        .iter()
        .map(|n| NodeInfo {
            name: n.id.clone(),
            host: n.host.clone(),
            cpus_milli: n.cpus_milli,
            memory_bytes: n.memory_bytes,
            gpus: n.gpus.len() as u32,
            gpu_kind: n.gpus.first().map_or_else(|| "gpu".to_owned(), |g| g.kind.clone()),
        })
        .collect();
    let first = trace.jobs.first().map(|j| j.submit_ms).unwrap_or(0);
    // The epoch of the simulated clock: the trace's first submission, a day after 1970 so no time is 0.
    let base: i64 = 86_400_000;
    let at = |t: u64| base + (t - first) as i64;
    let clock = Clock::manual(at(first));
    let fake = Arc::new(FakeExecutor::with_nodes(&dir.join("logs"), infos));
    fake.tell_no_usage();
    let listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let mut opts = ServerOptions::new(&dir.join("data"), listen, &dir.join("shoal"));
    opts.executor = Some(fake.clone());
    opts.clock = clock.clone();
    opts.sched_policy = options.policy;
    opts.preempt_grace = Duration::from_millis(options.grace_ms);
    opts.kill_grace = Duration::from_millis(100);
    opts.gpu_memory_bytes = gpu_memory;
    // The fake runs nothing: tasks "run" as the simulation's own user.
    let euid = std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(1);
    opts.task_user = (euid == 0).then(|| "root".to_owned());
    let prepared = prepare(&opts).await.map_err(control_err("starting the server"))?;
    let control = prepared.control;
    let mut books = Books::new("control", trace, options, nodes.len(), control.with_scheduler(|s| s.total_gpu_milli()));

    let n = trace.jobs.len();
    let width = n.to_string().len().max(6);
    let ids: Vec<String> = (0..n).map(|i| format!("j-{i:0width$}")).collect();
    let callers: HashMap<&str, Principal> = trace
        .jobs
        .iter()
        .map(|j| (j.team.as_str(), Principal { user: format!("{}-user", j.team), team: j.team.clone(), admin: false }))
        .collect();
    let mut follow: Vec<Follow> = trace
        .jobs
        .iter()
        .map(|j| Follow { left: j.duration_ms as u128 * j.tasks_min as u128, ..Follow::default() })
        .collect();
    // (time, job, version): a job's work done; (time, usize::MAX, 0): a turn the loop asks for.
    let mut events: BinaryHeap<Reverse<(u64, usize, u64)>> = BinaryHeap::new();
    let mut open = n;
    let mut next = 0usize;
    let mut last_t = first;
    let mut draining_milli = 0u64;
    // Jobs submitted and not done, in trace order.
    let mut active: BTreeSet<usize> = BTreeSet::new();
    while open > 0 {
        let arrival = books.jobs.get(next).map(|j| j.submit_ms);
        let event = events.peek().map(|Reverse(e)| e.0);
        let Some(first_event) = arrival.into_iter().chain(event).min() else {
            return Err(SimError::Audit {
                at_ms: last_t,
                what: format!("{open} jobs are not done and nothing will happen any more"),
            });
        };
        let now = turn_at(first_event, options.interval_ms);
        books.out.drain_gpu_milli_ms += draining_milli as u128 * now.saturating_sub(last_t) as u128;
        last_t = now;
        books.advance(now);
        // What happens up to the turn, in time order: submissions, and jobs whose work is done.
        loop {
            let arrival = books.jobs.get(next).map(|j| j.submit_ms).filter(|&a| a <= now);
            let event = events.peek().map(|Reverse(e)| *e).filter(|e| e.0 <= now);
            match (arrival, event) {
                (Some(a), e) if e.is_none_or(|e| a < e.0) => {
                    let i = next;
                    next += 1;
                    clock.set(at(a));
                    let tj = &trace.jobs[i];
                    let refused = match shoal_spec::parse_job(&spec_of(tj, &ids[i]), &tj.id) {
                        Ok(spec) => {
                            let caller = &callers[tj.team.as_str()];
                            let submitted =
                                shoal_control::api::submit_spec(&control, caller, spec, Some(ids[i].clone())).await;
                            submitted.err().map(|e| e.to_string())
                        }
                        Err(e) => Some(e.to_string()),
                    };
                    if refused.is_some() {
                        open -= 1;
                    } else {
                        active.insert(i);
                    }
                    books.arrived(i, refused);
                }
                (_, Some((t, i, version))) => {
                    events.pop();
                    if i == usize::MAX || follow[i].version != version || follow[i].exited_at.is_some() {
                        continue;
                    }
                    clock.set(at(t));
                    fake.exit_job(&ids[i], 0);
                    follow[i].exited_at = Some(t);
                }
                _ => break,
            }
        }
        clock.set(at(now));
        let stopping_before = control.stopping_any();
        control.tick().await.map_err(control_err("a turn of the control loop"))?;
        books.out.passes += 1;

        // What the loop did: which jobs' tasks run now.
        let counts = fake.running_counts();
        let mut ended = Vec::new();
        for &i in &active {
            let f = follow[i];
            let now_tasks = counts.get(&ids[i]).copied().unwrap_or(0);
            if now_tasks == f.tasks && f.exited_at.is_none() {
                continue;
            }
            let tj = &trace.jobs[i];
            // Work done at the old size up to the moment it changed.
            let until = f.exited_at.unwrap_or(now);
            let dt = until.saturating_sub(f.since) as u128;
            let done = (dt * f.tasks as u128).min(follow[i].left);
            follow[i].left -= done;
            books.jobs[i].worked_task_ms += done;
            books.jobs[i].gpu_milli_ms += tj.per_task.gpus_milli as u128 * f.tasks as u128 * dt;
            if let Some(t) = f.exited_at {
                // Its tasks exited 0 before this turn, which found them so: the job succeeded.
                let row = control.db.job(&ids[i]).await.map_err(control_err("reading a job"))?;
                match row.map(|r| (r.state, r.reason)) {
                    Some((JobState::Succeeded, _)) => {
                        books.ended(i, f.tasks, t);
                        follow[i].tasks = 0;
                        open -= 1;
                        fake.forget(&ids[i]);
                        ended.push(i);
                    }
                    Some((state, reason)) => {
                        return Err(SimError::Control(format!(
                            "job {}: every task exited 0 at {t} ms, but the control loop says {} ({reason})",
                            tj.id,
                            state.as_str()
                        )));
                    }
                    None => return Err(SimError::Control(format!("job {} is not in the store", tj.id))),
                }
                continue;
            }
            if f.tasks == 0 {
                books.started(i, now_tasks, now);
            } else if now_tasks == 0 {
                let row = control.db.job(&ids[i]).await.map_err(control_err("reading a job"))?;
                let preempted = match row.map(|r| (r.state, r.reason)) {
                    Some((JobState::Preempted, _)) => true,
                    Some((state, reason)) if state.is_final() => {
                        return Err(SimError::Control(format!(
                            "job {} ended {} with work left: {reason}",
                            tj.id,
                            state.as_str()
                        )));
                    }
                    // Stopped to grow (it starts again at once) or to shrink (back in the queue).
                    _ => false,
                };
                if preempted {
                    // The loop requeues it when its grace period is over.
                    events.push(Reverse((now.saturating_add(options.grace_ms), usize::MAX, 0)));
                }
                // Its tasks are gone: it waits (a preempted job's capacity stays held until the loop requeues it,
                // counted as draining below).
                books.stopped(i, preempted);
                books.requeued(i, f.tasks);
            } else {
                books.resized(i, f.tasks, now_tasks);
            }
            follow[i].tasks = now_tasks;
            follow[i].since = now;
            follow[i].version += 1;
            if now_tasks > 0 {
                let dt = follow[i].left.div_ceil(now_tasks as u128);
                let end = now.saturating_add(u64::try_from(dt).unwrap_or(u64::MAX));
                events.push(Reverse((end, i, follow[i].version)));
            }
        }
        for i in ended {
            active.remove(&i);
        }
        if stopping_before || control.stopping_any() {
            // As the server's loop does, turn again soon: what follows a stop waits only for its processes, and a
            // job a stop put back in the queue reaches the scheduler on the next turn.
            events.push(Reverse((now + options.interval_ms.max(1), usize::MAX, 0)));
        }
        let pending = books.pending;
        let (allocated, fragmentation) = control.with_scheduler(|s| {
            let head = if pending > 0 { s.blocked().and_then(|b| s.request(b)) } else { None };
            (s.allocated_gpu_milli(), head.map(|r| s.fragmentation_milli(&r.per_task)).unwrap_or(0))
        });
        draining_milli = allocated.saturating_sub(books.held_gpu_milli());
        books.sampled(now, allocated, fragmentation);
    }
    // The resizes the loop carried out, from each job's events.
    for (i, id) in ids.iter().enumerate() {
        if books.jobs[i].rejected.is_some() {
            continue;
        }
        for e in control.db.events(id, 0).await.map_err(control_err("reading a job's events"))? {
            if e.kind == "elastic" {
                books.out.grows += u64::from(e.message.starts_with("grows"));
                books.out.shrinks += u64::from(e.message.starts_with("shrinks"));
            }
        }
    }
    Ok(books.finish())
}
