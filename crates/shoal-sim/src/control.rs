//! A trace replayed through the server's own control loop (feature `control`, `shoal sim --engine control`):
//! `shoal-control`'s store (SQLite in a scratch directory), admission, placement, preemption with its grace
//! period and requeueing, with `shoal-exec`'s fake executor standing in for the processes and a manual clock
//! for time.
//!
//! Each job is submitted as its team, through the same function as `POST /api/v1/jobs`, as a command job whose
//! `expected_runtime` is its duration (capped at the spec's 7 days). The loop turns (`Control::tick`) at each
//! instant of the simulated scheduler loop; after each turn this driver reads which tasks the fake executor runs.
//! A job's work is counted as [`crate::simulate`] counts it (task-milliseconds, linear in its tasks); when it is
//! done its tasks exit 0, and the next turn finds the job succeeded. Nothing here decides: every start, stop and
//! requeue is the control loop's.
//!
//! Slower than the scheduler alone (every turn reads the store), so meant for traces of up to some thousands of
//! jobs; the report is the same [`Outcome`].

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};
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

use crate::error::{Result, SimError};
use crate::sim::{JobRecord, Outcome, Sample, SimOptions, TeamTally, repeated, water_fill};
use crate::trace::{Trace, TraceJob};

/// The longest `expected_runtime` a spec takes.
const MAX_EXPECTED: u64 = 7 * 24 * 3600 * 1000;

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
    submitted: bool,
    done: bool,
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
        (j.duration_ms.clamp(1000, MAX_EXPECTED) as f64 / 1000.0),
        r.cpus_milli.max(1),
        r.memory_bytes.max(1),
    )
}

async fn run(trace: &Trace, nodes: Vec<Node>, options: &SimOptions, dir: &std::path::Path) -> Result<Outcome> {
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
    let mut opts =
        ServerOptions::new(&dir.join("data"), "127.0.0.1:0".parse().expect("a literal address"), &dir.join("shoal"));
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
    let total_gpu_milli = control.with_scheduler(|s| s.total_gpu_milli());

    let submit_of = |j: &TraceJob| first + ((j.submit_ms - first) as f64 / options.load).round() as u64;
    let n = trace.jobs.len();
    let width = n.to_string().len().max(6);
    let ids: Vec<String> = (0..n).map(|i| format!("j-{i:0width$}")).collect();
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
    let _ = n;
    let mut follow: Vec<Follow> = trace
        .jobs
        .iter()
        .map(|j| Follow { left: j.duration_ms as u128 * j.tasks_min as u128, ..Follow::default() })
        .collect();
    let team_names: Vec<&str> =
        trace.jobs.iter().map(|j| j.team.as_str()).collect::<BTreeSet<_>>().into_iter().collect();
    let team_of: Vec<usize> =
        trace.jobs.iter().map(|j| team_names.binary_search(&j.team.as_str()).unwrap_or(0)).collect();
    let callers: Vec<Principal> = team_names
        .iter()
        .map(|t| Principal { user: format!("{t}-user"), team: (*t).to_owned(), admin: false })
        .collect();
    let mut tallies: Vec<TeamTally> = team_names
        .iter()
        .map(|t| TeamTally { team: (*t).to_owned(), contended_gpu_milli_ms: 0, entitled_gpu_milli_ms: 0.0 })
        .collect();
    let mut held = vec![0u64; team_names.len()];
    let mut asked = vec![0u64; team_names.len()];
    let mut entitled_now = vec![0.0f64; team_names.len()];

    let mut out = Outcome {
        policy: options.policy,
        options: options.clone(),
        trace: trace.name.clone(),
        skipped: trace.skipped,
        nodes: nodes.len(),
        total_gpu_milli,
        jobs: Vec::new(),
        series: Vec::new(),
        passes: 0,
        preemptions: 0,
        shrinks: 0,
        grows: 0,
        drain_gpu_milli_ms: 0,
        teams: Vec::new(),
    };
    // (time, job, version): a job's work done; (time, usize::MAX, 0): a grace period ends.
    let mut events: BinaryHeap<Reverse<(u64, usize, u64)>> = BinaryHeap::new();
    let (mut pending, mut running, mut open) = (0u64, 0u64, n);
    let mut next = 0usize;
    let mut last_t: Option<u64> = None;
    let mut draining_milli = 0u64;
    // Jobs submitted and not done, in trace order.
    let mut active: BTreeSet<usize> = BTreeSet::new();
    while open > 0 {
        let arrival = jobs.get(next).map(|j| j.submit_ms);
        let event = events.peek().map(|Reverse(e)| e.0);
        let first_event = match (arrival, event) {
            (Some(a), Some(e)) => a.min(e),
            (Some(a), None) => a,
            (None, Some(e)) => e,
            (None, None) => {
                return Err(SimError::Audit {
                    at_ms: last_t.unwrap_or(first),
                    what: format!("{open} jobs are not done and nothing will happen any more"),
                });
            }
        };
        let now = match options.interval_ms {
            0 => first_event,
            i => first_event.div_ceil(i).saturating_mul(i),
        };
        if let Some(last) = last_t {
            let dt = now.saturating_sub(last);
            out.drain_gpu_milli_ms += draining_milli as u128 * dt as u128;
            if pending > 0 {
                for (t, tally) in tallies.iter_mut().enumerate() {
                    tally.contended_gpu_milli_ms += held[t] as u128 * dt as u128;
                    tally.entitled_gpu_milli_ms += entitled_now[t] * dt as f64;
                }
            }
        }
        last_t = Some(now);
        // What happens up to the turn, in time order: submissions, and jobs whose work is done.
        loop {
            let arrival = jobs.get(next).map(|j| j.submit_ms).filter(|&a| a <= now);
            let event = events.peek().map(|Reverse(e)| *e).filter(|e| e.0 <= now);
            match (arrival, event) {
                (Some(a), e) if e.is_none_or(|e| a < e.0) => {
                    let i = next;
                    next += 1;
                    clock.set(at(a));
                    let tj = &trace.jobs[i];
                    let spec = shoal_spec::parse_job(&spec_of(tj, &ids[i]), &tj.id);
                    let result = match spec {
                        Ok(spec) => {
                            shoal_control::api::submit_spec(&control, &callers[team_of[i]], spec, Some(ids[i].clone()))
                                .await
                                .map_err(|e| e.to_string())
                        }
                        Err(e) => Err(e.to_string()),
                    };
                    match result {
                        Ok(_) => {
                            active.insert(i);
                            follow[i].submitted = true;
                            pending += 1;
                            asked[team_of[i]] += tj.per_task.gpus_milli * tj.tasks_min as u64;
                        }
                        Err(why) => {
                            follow[i].done = true;
                            open -= 1;
                            jobs[i].rejected = Some(why);
                        }
                    }
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
        out.passes += 1;

        // What the loop did: which jobs' tasks run now.
        let counts = fake.running_counts();
        for i in active.clone() {
            let f = follow[i];
            let now_tasks = counts.get(&ids[i]).copied().unwrap_or(0);
            if now_tasks == f.tasks && f.exited_at.is_none() {
                continue;
            }
            let tj = &trace.jobs[i];
            let g = tj.per_task.gpus_milli;
            let team = team_of[i];
            // Work done at the old size up to the moment it changed.
            let until = f.exited_at.unwrap_or(now);
            let dt = until.saturating_sub(f.since) as u128;
            let done = (dt * f.tasks as u128).min(follow[i].left);
            follow[i].left -= done;
            jobs[i].worked_task_ms += done;
            jobs[i].gpu_milli_ms += g as u128 * f.tasks as u128 * dt;
            held[team] = held[team] + g * now_tasks as u64 - g * f.tasks as u64;
            if let Some(t) = f.exited_at {
                // Its tasks exited 0 before this turn, which found them so: the job succeeded.
                let row = control.db.job(&ids[i]).await.map_err(control_err("reading a job"))?;
                match row.map(|r| (r.state, r.reason)) {
                    Some((JobState::Succeeded, _)) => {
                        follow[i].done = true;
                        follow[i].tasks = 0;
                        jobs[i].end_ms = Some(t);
                        running -= 1;
                        open -= 1;
                        fake.forget(&ids[i]);
                        active.remove(&i);
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
                jobs[i].starts += 1;
                jobs[i].first_start_ms.get_or_insert(now);
                pending -= 1;
                running += 1;
                asked[team] -= g * tj.tasks_min as u64;
            } else if now_tasks == 0 {
                let row = control.db.job(&ids[i]).await.map_err(control_err("reading a job"))?;
                match row.map(|r| (r.state, r.reason)) {
                    Some((JobState::Preempted, _)) => {
                        jobs[i].preemptions += 1;
                        out.preemptions += 1;
                        events.push(Reverse((now.saturating_add(options.grace_ms), usize::MAX, 0)));
                    }
                    Some((state, reason)) if state.is_final() => {
                        return Err(SimError::Control(format!(
                            "job {} ended {} with work left: {reason}",
                            tj.id,
                            state.as_str()
                        )));
                    }
                    // Stopped to grow (it starts again at once) or to shrink (back in the queue).
                    _ => {}
                }
                running -= 1;
                pending += 1;
                asked[team] += g * tj.tasks_min as u64;
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
        if stopping_before || control.stopping_any() {
            // As the server's loop does, turn again soon: what follows a stop waits only for its processes, and a
            // job a stop put back in the queue reaches the scheduler on the next turn.
            events.push(Reverse((now + options.interval_ms.max(1), usize::MAX, 0)));
        }
        let running_milli: u64 = held.iter().sum();
        let (allocated, fragmentation) = control.with_scheduler(|s| {
            let head = if pending > 0 { s.blocked().and_then(|b| s.request(b)) } else { None };
            (s.allocated_gpu_milli(), head.map(|r| s.fragmentation_milli(&r.per_task)).unwrap_or(0))
        });
        draining_milli = allocated.saturating_sub(running_milli);
        if pending > 0 {
            let demand: Vec<u64> = held.iter().zip(&asked).map(|(h, a)| h + a).collect();
            entitled_now = water_fill(&demand, total_gpu_milli);
        }
        let sample =
            Sample { t_ms: now, allocated_gpu_milli: allocated, pending, running, fragmentation_milli: fragmentation };
        match out.series.last_mut() {
            Some(last) if last.t_ms == now => *last = sample,
            _ => out.series.push(sample),
        }
    }
    // The resizes the loop carried out, from each job's events.
    for (i, f) in follow.iter().enumerate() {
        if !f.submitted {
            continue;
        }
        for e in control.db.events(&ids[i], 0).await.map_err(control_err("reading a job's events"))? {
            if e.kind == "elastic" {
                out.grows += u64::from(e.message.starts_with("grows"));
                out.shrinks += u64::from(e.message.starts_with("shrinks"));
            }
        }
    }
    out.jobs = jobs;
    out.teams = tallies;
    Ok(out)
}
