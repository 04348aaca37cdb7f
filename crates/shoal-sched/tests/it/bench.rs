use shoal_sched::{Config, Decision, Scheduler, synthetic_cluster, synthetic_jobs, synthetic_queues};
use std::time::Instant;

/// Run with:
/// `cargo test -p shoal-sched --release -- --ignored --nocapture full_pass_10k_jobs_1k_nodes`
#[test]
#[ignore = "benchmark: run in release"]
fn full_pass_10k_jobs_1k_nodes() {
    let mut s = Scheduler::new(synthetic_cluster(1000, 8), synthetic_queues(), Config::default()).expect("new");
    let t = Instant::now();
    for j in synthetic_jobs(10_000, 42) {
        s.submit(j).expect("submit");
    }
    let submit = t.elapsed();
    let t = Instant::now();
    let decisions = s.schedule(0);
    let pass = t.elapsed();
    let (mut jobs, mut tasks) = (0usize, 0usize);
    for d in &decisions {
        if let Decision::Place { assignments, .. } = d {
            jobs += 1;
            tasks += assignments.len();
        }
    }
    let secs = pass.as_secs_f64();
    println!(
        "10,000 pending jobs on 1,000 nodes x 8 GPUs: submit {:.1} ms; pass {:.1} ms; \
         placed {jobs} jobs ({tasks} tasks), {} still pending; {:.0} placements/s, {:.0} jobs considered/s \
         (anchors: Kubernetes 400 pods/s, Slurm 500 jobs/s)",
        submit.as_secs_f64() * 1e3,
        secs * 1e3,
        s.pending_count(),
        jobs as f64 / secs,
        10_000.0 / secs,
    );
    // A second pass with everything still pending (steady state, nothing free).
    let t = Instant::now();
    let again = s.schedule(1);
    println!("second pass (cluster full): {:.1} ms, {} decisions", t.elapsed().as_secs_f64() * 1e3, again.len());
    // A churn pass: a tenth of the running jobs finish and 1,000 urgent jobs
    // arrive (priority 5: shrink, preemption and reservation paths).
    let placed: Vec<String> = decisions
        .iter()
        .filter_map(|d| if let Decision::Place { job, .. } = d { Some(job.clone()) } else { None })
        .collect();
    for id in placed.iter().step_by(10) {
        s.finish(id).expect("finish");
    }
    for mut j in synthetic_jobs(1_000, 7) {
        j.id = format!("urgent-{}", j.id);
        j.priority = 5;
        s.submit(j).expect("submit");
    }
    let t = Instant::now();
    let churn = s.schedule(2);
    let kinds = |f: fn(&Decision) -> bool| churn.iter().filter(|d| f(d)).count();
    println!(
        "churn pass: {:.1} ms, {} place, {} preempt, {} shrink, {} grow",
        t.elapsed().as_secs_f64() * 1e3,
        kinds(|d| matches!(d, Decision::Place { .. })),
        kinds(|d| matches!(d, Decision::Preempt { .. })),
        kinds(|d| matches!(d, Decision::Shrink { .. })),
        kinds(|d| matches!(d, Decision::Grow { .. })),
    );
    if !cfg!(debug_assertions) {
        assert!(secs <= 0.100, "pass took {:.1} ms", secs * 1e3);
        assert!(jobs as f64 / secs >= 10_000.0);
    }
}
