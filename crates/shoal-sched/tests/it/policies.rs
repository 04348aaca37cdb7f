use crate::check;

// The same cluster and jobs under each ordering; what differs is which job starts.

const BLOCKED_HEAD: &str = "
    node n1 gpus=4
    job a gpus=2 at=0
    job b gpus=4 at=1
    job c gpus=1 at=2
    sched 0
";

#[test]
fn fifo_starts_nothing_behind_a_job_that_cannot_start() {
    check(&format!("policy fifo\n{BLOCKED_HEAD}"), "@0 place a n1:0,1");
}

#[test]
fn backfill_starts_later_jobs_that_fit() {
    for policy in ["backfill", "drf", "sjf", "las", "elastic"] {
        check(&format!("policy {policy}\n{BLOCKED_HEAD}"), "@0 place a n1:0,1\n@0 place c n1:2");
    }
}

#[test]
fn sjf_starts_the_shortest_expected_job_first() {
    let jobs = "
        node n1 gpus=1
        job long gpus=1 rt=1000 at=0
        job short gpus=1 rt=10 at=1
        sched 0
    ";
    check(&format!("policy sjf\n{jobs}"), "@0 place short n1:0");
    check(&format!("policy fifo\n{jobs}"), "@0 place long n1:0");
}

#[test]
fn las_preempts_a_job_that_has_had_more_service() {
    // a holds one GPU for 2000 ms: past the 1000 GPU-ms threshold, it yields to b, which has had none.
    check(
        "
        policy las
        las 1000
        grace 0
        node n1 gpus=1
        job a gpus=1 at=0
        sched 0
        job b gpus=1 at=2000
        sched 2000
        sched 2000
        ",
        "
        @0 place a n1:0
        @2000 preempt a priority by b grace 0
        @2000 requeue a
        @2000 place b n1:0
        ",
    );
}

#[test]
fn las_leaves_a_job_alone_below_its_threshold() {
    check(
        "
        policy las
        las 5000
        node n1 gpus=1
        job a gpus=1 at=0
        sched 0
        job b gpus=1 at=2000
        sched 2000
        ",
        "@0 place a n1:0",
    );
}

#[test]
fn las_counts_service_in_gpus_held() {
    // a holds 4 GPUs for 500 ms = 2000 GPU-ms, past the threshold; c's one GPU for 1000 ms is below it.
    check(
        "
        policy las
        las 1500
        grace 0
        node n1 gpus=5
        job a gpus=4 at=0
        job c gpus=1 at=0
        sched 0
        job b gpus=4 at=500
        sched 500
        sched 500
        ",
        "
        @0 place a n1:0,1,2,3
        @0 place c n1:4
        @500 preempt a priority by b grace 0
        @500 requeue a
        @500 place b n1:0,1,2,3
        ",
    );
}

#[test]
fn elastic_shrinks_a_peer_for_a_waiting_job() {
    let jobs = "
        node n1 gpus=4
        job e tasks=1..4 gpus=1 at=0
        sched 0
        job w gpus=2 at=1
        sched 10
    ";
    check(
        &format!("policy elastic\n{jobs}"),
        "
        @0 place e n1:0 n1:1 n1:2 n1:3
        @10 shrink e by 2 for w
        @10 place w n1:2,3
        ",
    );
    check(&format!("policy drf\n{jobs}"), "@0 place e n1:0 n1:1 n1:2 n1:3");
}

const CPU_HEAVY: &str = "
    node n1 cpus=8 gpus=2
    node n2 cpus=64 gpus=2
    job c cpus=8 at=0
    job g1 gpus=1 cpus=4 at=1
    job g2 gpus=1 cpus=4 at=2
    job g3 gpus=1 cpus=4 at=3
    job g4 gpus=1 cpus=4 at=4
    sched 0
";

#[test]
fn bestfit_strands_gpus_behind_a_cpu_only_job() {
    check(
        &format!("policy bestfit\n{CPU_HEAVY}"),
        "
        @0 place c n1
        @0 place g1 n2:0
        @0 place g2 n2:1
        ",
    );
}

#[test]
fn fgd_keeps_the_cpu_only_job_off_the_node_whose_gpus_it_would_strand() {
    check(
        &format!("policy fgd\n{CPU_HEAVY}"),
        "
        @0 place c n2
        @0 place g1 n1:0
        @0 place g2 n1:1
        @0 place g3 n2:0
        @0 place g4 n2:1
        ",
    );
}

#[test]
fn fgd_keeps_whole_gpus_whole_for_the_whole_gpu_jobs() {
    // Half-GPU and whole-GPU jobs are both common: the second half goes beside the first, not onto a whole GPU.
    check(
        "
        policy fgd
        node n1 gpus=2
        job h1 gpus=0.5 at=0
        job w1 gpus=1 at=1
        job h2 gpus=0.5 at=2
        job w2 gpus=1 at=3
        sched 0
        ",
        "
        @0 place h1 n1:0@500
        @0 place w1 n1:1
        @0 place h2 n1:0@500
        ",
    );
}

/// Replays a synthetic workload (arrivals, passes, some jobs ending) under `policy`; the decisions, rendered.
fn replay(policy: &str, queue: shoal_sched::Quota, seed: u64) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    use shoal_sched::{Config, Queue, Scheduler, synthetic_cluster, synthetic_jobs};
    let config = Config {
        policy: policy.parse()?,
        preempt_grace_ms: 50,
        las_thresholds_gpu_ms: vec![500, 5_000],
        ..Config::default()
    };
    let queues = vec![Queue { name: "default".into(), guaranteed: queue, can_borrow: true }];
    let mut s = Scheduler::new(synthetic_cluster(12, 8), queues, config)?;
    let mut out = Vec::new();
    let mut running: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    for (i, mut j) in synthetic_jobs(400, seed).into_iter().enumerate() {
        let now = 10 * i as u64;
        j.submitted_at_ms = now;
        if s.submit(j).is_err() {
            continue;
        }
        if i % 3 == 0 && !running.is_empty() {
            let done = running.iter().nth((i * 7) % running.len()).cloned().unwrap_or_default();
            running.remove(&done);
            s.finish(&done)?;
        }
        for d in s.schedule(now) {
            match &d {
                shoal_sched::Decision::Place { job, .. } => {
                    running.insert(job.clone());
                }
                shoal_sched::Decision::Preempt { job, .. } => {
                    running.remove(job);
                }
                _ => {}
            }
            out.push(crate::render(&d, now));
        }
        assert!(s.books_balance());
    }
    Ok(out)
}

#[test]
fn the_pass_over_a_static_order_decides_as_the_general_one() -> Result<(), Box<dyn std::error::Error>> {
    // A queue guaranteed everything but one unit takes the general pass; an unlimited one the static order's.
    let almost = shoal_sched::Quota { cpus_milli: u64::MAX - 1, memory_bytes: u64::MAX - 1, gpus_milli: u64::MAX - 1 };
    for policy in ["fifo", "backfill", "sjf", "las", "drf", "elastic", "las+fgd", "drf+fgd"] {
        for seed in [1, 2] {
            let a = replay(policy, shoal_sched::Quota::UNLIMITED, seed)?;
            let b = replay(policy, almost, seed)?;
            assert!(a.len() > 100, "{policy}: only {} decisions", a.len());
            assert_eq!(a, b, "{policy} seed {seed}");
        }
    }
    Ok(())
}
