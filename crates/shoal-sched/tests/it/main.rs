//! The scheduler's integration tests: scripts run through one `check` helper.
//!
//! A script is one command a line; `#` starts a comment.
//!
//! ```text
//! node ID [cpus=C] [mem=M] [gpus=N] [gmem=G] [gpu_gmem=i:G]   (defaults: 64 cpus, 512G, 8 GPUs of 80G)
//! queue NAME [cpus=C] [mem=M] [gpus=N] [borrow]              (none: one unlimited `default`)
//! grace MS
//! policy NAME                                                (an ordering, a packing or ORDERING+PACKING)
//! las T1,T2,...                                              (LAS thresholds in GPU-milliseconds)
//! job ID [team=T] [queue=Q] [prio=P] [tasks=N|tasks=MIN..MAX] [cpus=C] [mem=M]
//!        [gpus=G] [gmem=M] [spread] [at=MS] [rt=MS]          (defaults: 1 task, 1 cpu, 1G)
//! sched NOW
//! finish ID
//! ```
//!
//! CPUs and GPUs are decimal (`0.5`), sizes take `G`/`M` suffixes. The output
//! has one line per decision (`@NOW place a n1:0,1 n2:0@500`, `@NOW preempt b
//! priority by a grace 1000`, ...) and per refused submission (`error: ...`).

mod backfill;
mod bench;
mod elastic;
mod fairshare;
mod placement;
mod policies;
mod preemption;
mod properties;
mod quota;
mod submit;

use shoal_sched::{Config, Decision, Gpu, JobRequest, Node, PreemptReason, Queue, Quota, Resources, Scheduler};
use std::collections::BTreeMap;

fn num(v: &str) -> u64 {
    let (digits, mult) = match v.as_bytes().last() {
        Some(b'G') => (&v[..v.len() - 1], 1u64 << 30),
        Some(b'M') => (&v[..v.len() - 1], 1u64 << 20),
        _ => (v, 1),
    };
    digits.parse::<u64>().unwrap_or_else(|_| panic!("bad number {v}")) * mult
}

fn milli(v: &str) -> u64 {
    (v.parse::<f64>().unwrap_or_else(|_| panic!("bad decimal {v}")) * 1000.0).round() as u64
}

fn kv(words: &[&str]) -> BTreeMap<String, String> {
    words
        .iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (w.to_string(), String::new()),
        })
        .collect()
}

pub fn render(d: &Decision, now: u64) -> String {
    let tasks = |ts: &[shoal_sched::TaskPlacement]| {
        ts.iter()
            .map(|t| {
                let gpus: Vec<String> =
                    t.gpus.iter().map(|&(i, s)| if s == 1000 { format!("{i}") } else { format!("{i}@{s}") }).collect();
                if gpus.is_empty() { t.node.clone() } else { format!("{}:{}", t.node, gpus.join(",")) }
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    match d {
        Decision::Place { job, assignments } => format!("@{now} place {job} {}", tasks(assignments)),
        Decision::Grow { job, tasks: t } => format!("@{now} grow {job} {}", tasks(t)),
        Decision::Shrink { job, by, for_job } => format!("@{now} shrink {job} by {by} for {for_job}"),
        Decision::Requeue { job } => format!("@{now} requeue {job}"),
        Decision::Preempt { job, reason, grace_ms } => match reason {
            PreemptReason::Priority { by } => format!("@{now} preempt {job} priority by {by} grace {grace_ms}"),
            PreemptReason::QuotaReclaim { owner_queue, by } => {
                format!("@{now} preempt {job} reclaim for {owner_queue} by {by} grace {grace_ms}")
            }
        },
    }
}

/// Runs a script; returns the scheduler and the output lines.
pub fn run(script: &str) -> (Scheduler, Vec<String>) {
    let lines: Vec<Vec<&str>> = script
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").split_whitespace().collect::<Vec<_>>())
        .filter(|w| !w.is_empty())
        .collect();
    let mut nodes = Vec::new();
    let mut queues = Vec::new();
    let mut config = Config::default();
    for w in &lines {
        let a = kv(&w[2.min(w.len())..]);
        let get = |k: &str| a.get(k).map(String::as_str);
        match w[0] {
            "node" => {
                let n = get("gpus").map(num).unwrap_or(8);
                let gmem = get("gmem").map(num).unwrap_or(80 << 30);
                let mut gpus: Vec<Gpu> =
                    (0..n).map(|i| Gpu { index: i as u32, memory_bytes: gmem, kind: "H100".into() }).collect();
                if let Some(spec) = get("gpu_gmem") {
                    for part in spec.split(',') {
                        let (i, m) = part.split_once(':').expect("gpu_gmem=i:SIZE");
                        gpus[num(i) as usize].memory_bytes = num(m);
                    }
                }
                nodes.push(Node {
                    id: w[1].to_string(),
                    host: w[1].to_string(),
                    cpus_milli: get("cpus").map(milli).unwrap_or(64_000),
                    memory_bytes: get("mem").map(num).unwrap_or(512 << 30),
                    gpus,
                    labels: BTreeMap::new(),
                });
            }
            "queue" => queues.push(Queue {
                name: w[1].to_string(),
                guaranteed: Quota {
                    cpus_milli: get("cpus").map(milli).unwrap_or(u64::MAX),
                    memory_bytes: get("mem").map(num).unwrap_or(u64::MAX),
                    gpus_milli: get("gpus").map(milli).unwrap_or(u64::MAX),
                },
                can_borrow: a.contains_key("borrow"),
            }),
            "grace" => config.preempt_grace_ms = num(w[1]),
            "policy" => config.policy = w[1].parse().expect("policy"),
            "las" => config.las_thresholds_gpu_ms = w[1].split(',').map(num).collect(),
            _ => {}
        }
    }
    if queues.is_empty() {
        queues.push(Queue { name: "default".into(), guaranteed: Quota::UNLIMITED, can_borrow: true });
    }
    let mut s = Scheduler::new(nodes, queues, config).expect("scheduler");
    let mut out = Vec::new();
    for w in &lines {
        let a = kv(&w[2.min(w.len())..]);
        let get = |k: &str| a.get(k).map(String::as_str);
        match w[0] {
            "job" => {
                let (min, max) = match get("tasks") {
                    None => (1, 1),
                    Some(t) => match t.split_once("..") {
                        Some((a, b)) => (num(a) as u32, num(b) as u32),
                        None => (num(t) as u32, num(t) as u32),
                    },
                };
                let job = JobRequest {
                    id: w[1].to_string(),
                    team: get("team").unwrap_or("t").to_string(),
                    queue: get("queue").unwrap_or("default").to_string(),
                    priority: get("prio").map(|p| p.parse().expect("prio")).unwrap_or(0),
                    tasks_min: min,
                    tasks_max: max,
                    per_task: Resources {
                        cpus_milli: get("cpus").map(milli).unwrap_or(1000),
                        memory_bytes: get("mem").map(num).unwrap_or(1 << 30),
                        gpus_milli: get("gpus").map(milli).unwrap_or(0),
                        gpu_memory_bytes: get("gmem").map(num).unwrap_or(0),
                    },
                    spread: a.contains_key("spread"),
                    submitted_at_ms: get("at").map(num).unwrap_or(0),
                    expected_runtime_ms: get("rt").map(num),
                    avoid_nodes: get("avoid").map(|n| n.split(',').map(str::to_owned).collect()).unwrap_or_default(),
                };
                if let Err(e) = s.submit(job) {
                    out.push(format!("error: {e}"));
                }
            }
            "sched" => {
                let now = num(w[1]);
                for d in s.schedule(now) {
                    out.push(render(&d, now));
                }
            }
            "finish" => {
                if let Err(e) = s.finish(w[1]) {
                    out.push(format!("error: {e}"));
                }
            }
            _ => {}
        }
    }
    (s, out)
}

/// Runs `script` and compares its output with `expected` (lines, trimmed).
#[track_caller]
pub fn check(script: &str, expected: &str) {
    let (s, out) = run(script);
    let want: Vec<&str> = expected.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let got: Vec<&str> = out.iter().map(String::as_str).collect();
    assert!(s.books_balance(), "free-capacity books do not balance");
    if got != want {
        panic!("script output differs\n--- expected\n{}\n--- got\n{}\n", want.join("\n"), got.join("\n"));
    }
}
