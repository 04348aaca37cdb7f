use proptest::prelude::*;
use shoal_sched::{Config, Decision, Gpu, JobRequest, Node, Queue, Quota, Resources, Scheduler};
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Op {
    Submit {
        prio: i32,
        team: u8,
        queue: u8,
        min: u32,
        extra: u32,
        gpus: u64,
        gmem_g: u64,
        cpus: u64,
        spread: bool,
        rt: Option<u64>,
    },
    Schedule {
        dt: u64,
    },
    Finish {
        pick: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3i32, 0..3u8, 0..2u8, 1..4u32, 0..3u32,
              prop_oneof![Just(0u64), Just(250), Just(500), Just(1000), Just(2000), Just(4000)],
              0..30u64, 1..20u64, any::<bool>(), proptest::option::of(1..500u64))
            .prop_map(|(prio, team, queue, min, extra, gpus, gmem_g, cpus, spread, rt)| Op::Submit {
                prio, team, queue, min, extra, gpus, gmem_g, cpus, spread, rt
            }),
        3 => (0..300u64).prop_map(|dt| Op::Schedule { dt }),
        2 => any::<usize>().prop_map(|pick| Op::Finish { pick }),
    ]
}

fn cluster() -> Vec<Node> {
    (0..3)
        .map(|i| Node {
            id: format!("n{i}"),
            host: format!("h{i}"),
            cpus_milli: 32_000,
            memory_bytes: 64 << 30,
            gpus: (0..4).map(|g| Gpu { index: g, memory_bytes: (16 + 8 * g as u64) << 30, kind: "T".into() }).collect(),
            labels: BTreeMap::new(),
        })
        .collect()
}

proptest! {
    /// After any sequence of submit/schedule/finish no node or GPU is
    /// over-allocated, the free-capacity book agrees with the jobs' tasks, and
    /// every placement is a whole gang within min..max.
    #[test]
    fn never_over_allocated(ops in proptest::collection::vec(op(), 1..60)) {
        let nodes = cluster();
        let queues = vec![
            Queue { name: "q0".into(), guaranteed: Quota { cpus_milli: 48_000, memory_bytes: 96 << 30, gpus_milli: 6_000 }, can_borrow: true },
            Queue { name: "q1".into(), guaranteed: Quota { cpus_milli: 48_000, memory_bytes: 96 << 30, gpus_milli: 6_000 }, can_borrow: false },
        ];
        let mut s = Scheduler::new(nodes.clone(), queues, Config { preempt_grace_ms: 50, max_preemption_tries_per_pass: 4, ..Config::default() }).expect("new");
        let mut now = 0u64;
        let mut ids: Vec<String> = Vec::new();
        let mut ranges: BTreeMap<String, (u32, u32)> = BTreeMap::new();
        for (n, op) in ops.into_iter().enumerate() {
            match op {
                Op::Submit { prio, team, queue, min, extra, gpus, gmem_g, cpus, spread, rt } => {
                    let id = format!("j{n}");
                    let job = JobRequest {
                        id: id.clone(), team: format!("t{team}"), queue: format!("q{queue}"), priority: prio,
                        tasks_min: min, tasks_max: min + extra,
                        per_task: Resources { cpus_milli: cpus * 1000, memory_bytes: 4 << 30, gpus_milli: gpus, gpu_memory_bytes: if gpus > 0 { gmem_g << 30 } else { 0 } },
                        spread, submitted_at_ms: now, expected_runtime_ms: rt,
                        avoid_nodes: Vec::new(),
                    };
                    if s.submit(job).is_ok() {
                        ranges.insert(id.clone(), (min, min + extra));
                        ids.push(id);
                    }
                }
                Op::Schedule { dt } => {
                    now += dt;
                    for d in s.schedule(now) {
                        if let Decision::Place { job, assignments } = &d {
                            let (lo, hi) = ranges[job];
                            prop_assert!(assignments.len() as u32 >= lo && assignments.len() as u32 <= hi, "{d:?}");
                        }
                    }
                }
                Op::Finish { pick } => {
                    if !ids.is_empty() {
                        let id = ids.remove(pick % ids.len());
                        prop_assert!(s.finish(&id).is_ok());
                    }
                }
            }
            prop_assert!(s.books_balance());
            for (a, node) in s.allocations().iter().zip(&nodes) {
                prop_assert!(a.cpus_milli <= node.cpus_milli, "{a:?}");
                prop_assert!(a.memory_bytes <= node.memory_bytes, "{a:?}");
                for (&(share, mem), g) in a.gpus.iter().zip(&node.gpus) {
                    prop_assert!(share <= 1000 && mem <= g.memory_bytes, "{a:?}");
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
struct SimJob {
    at: u64,
    tasks: u32,
    gpus: u64,
    rt: u64,
}

fn sim_job() -> impl Strategy<Value = SimJob> {
    (0..200u64, 1..3u32, prop_oneof![Just(500u64), Just(1000), Just(2000), Just(4000)], 1..100u64)
        .prop_map(|(at, tasks, gpus, rt)| SimJob { at, tasks, gpus, rt })
}

proptest! {
    /// EASY backfill with exact run-time estimates: a job never starts later
    /// than the first reservation it was given (one team, one priority, so
    /// the order is FIFO).
    #[test]
    fn backfill_never_delays_a_reservation(mut jobs in proptest::collection::vec(sim_job(), 1..16)) {
        jobs.sort_by_key(|j| j.at);
        let nodes: Vec<Node> = cluster().into_iter().take(2).collect();
        let mut s = Scheduler::new(nodes, shoal_sched::synthetic_queues(), Config::default()).expect("new");
        let mut ends: BTreeMap<String, u64> = BTreeMap::new();
        let mut first_reservation: BTreeMap<String, u64> = BTreeMap::new();
        let mut next = 0usize;
        let mut now = 0u64;
        for _ in 0..1000 {
            let next_submit = jobs.get(next).map(|j| j.at);
            let next_end = ends.values().copied().min();
            now = match (next_submit, next_end) {
                (None, None) => break,
                (a, b) => a.unwrap_or(u64::MAX).min(b.unwrap_or(u64::MAX)).max(now),
            };
            let done: Vec<String> = ends.iter().filter(|(_, e)| **e <= now).map(|(id, _)| id.clone()).collect();
            for id in done {
                ends.remove(&id);
                s.finish(&id).expect("finish");
            }
            while next < jobs.len() && jobs[next].at <= now {
                let j = &jobs[next];
                let _ = s.submit(JobRequest {
                    id: format!("j{next:02}"), team: "t".into(), queue: "default".into(), priority: 0,
                    tasks_min: j.tasks, tasks_max: j.tasks,
                    per_task: Resources { cpus_milli: 1000, memory_bytes: 1 << 30, gpus_milli: j.gpus, gpu_memory_bytes: 0 },
                    spread: false, submitted_at_ms: j.at, expected_runtime_ms: Some(j.rt),
                    avoid_nodes: Vec::new(),
                });
                next += 1;
            }
            for d in s.schedule(now) {
                if let Decision::Place { job, .. } = d {
                    let rt = jobs[job[1..].parse::<usize>().expect("id")].rt;
                    if let Some(&t) = first_reservation.get(&job) {
                        prop_assert!(now <= t, "{job} reserved for {t} started at {now}");
                    }
                    ends.insert(job, now + rt);
                }
            }
            if let Some((job, t)) = s.reservation() {
                first_reservation.entry(job.to_string()).or_insert(t);
            }
        }
        prop_assert_eq!(s.pending_count(), 0);
    }
}
