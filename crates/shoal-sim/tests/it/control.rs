//! The same traces through the server's control loop (`simulate_control`: the store, admission, placement,
//! preemption and requeueing of `shoal-control`, the fake executor for processes, a manual clock) and through the
//! scheduler alone: the same jobs start and end at the same instants.

use shoal_sim::{Outcome, SimOptions, homogeneous, simulate, simulate_control};

use super::{Result, render, synthetic};

/// `jobs` jobs of the synthetic trace through both, elastic ones made rigid unless `elastic`.
fn both(policy: &str, jobs: usize, seed: u64, nodes: usize, elastic: bool) -> Result<(Outcome, Outcome)> {
    let mut trace = synthetic(jobs, seed);
    if !elastic {
        for j in &mut trace.jobs {
            j.tasks_max = j.tasks_min;
        }
    }
    let options = SimOptions { policy: policy.parse()?, seed, ..SimOptions::default() };
    let direct = simulate(&trace, homogeneous(nodes, 8)?, &options)?;
    let through = simulate_control(&trace, homogeneous(nodes, 8)?, &options)?;
    Ok((direct, through))
}

#[test]
fn the_control_loop_starts_and_ends_every_job_when_the_scheduler_alone_does() -> Result {
    for policy in ["fifo", "backfill", "drf", "las", "sjf", "backfill+fgd", "las+fgd"] {
        let (direct, through) = both(policy, 120, 11, 4, false)?;
        eprintln!(
            "{policy}: {} preemptions, {} grows, {} shrinks",
            through.preemptions, through.grows, through.shrinks
        );
        assert_eq!(render(&through), render(&direct), "{policy}");
        assert_eq!(through.preemptions, direct.preemptions, "{policy}");
        assert_eq!((direct.engine, through.engine), ("scheduler", "control"));
        if policy.starts_with("las") {
            assert!(
                through.preemptions > 0,
                "{policy}: the loop preempted nothing, so its preemption path went untried"
            );
        }
        for (j, d) in through.jobs.iter().zip(&direct.jobs) {
            assert_eq!(j.worked_task_ms, d.worked_task_ms, "{policy} {}", j.id);
        }
    }
    Ok(())
}

/// Elastic jobs through the control loop: the fake executor cannot add workers to a running group, so a job is
/// resized as the server resizes it there — every worker stops at a checkpoint and the job starts again at the new
/// size — where the scheduler alone resizes it in place. `e` (1..4 one-GPU tasks, 400 s of work at one) starts at 4
/// on a 4-GPU node, shrinks to 2 for `w` at 50 s and grows back when `w` ends; its work is kept throughout.
#[test]
fn elastic_jobs_resize_through_the_control_loop_and_keep_their_work() -> Result {
    let trace =
        shoal_sim::parse_trace("t.csv", &format!("{}\ne,0,400,1,,1,1,x,1,4\nw,50,10,2,,1,1,y,,\n", super::HEADER))?;
    let cluster = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,65536,4,T4\n";
    let options = SimOptions { policy: "elastic".parse()?, grace_ms: 0, ..SimOptions::default() };
    let direct = simulate(&trace, shoal_sim::parse_cluster("n.csv", cluster)?, &options)?;
    let through = simulate_control(&trace, shoal_sim::parse_cluster("n.csv", cluster)?, &options)?;
    assert_eq!(render(&direct), ["e 0 105", "w 50 60"]);
    // Through the loop (a turn a second), `e` is stopped for `w` at 50 s, back in the queue at 51 and started
    // again at 2 at 52; it grows back when `w` ends at 60: stopped, and started at 4 at 62. Each resize costs two
    // turns with nothing done: 3 s later than in place.
    assert_eq!(render(&through), ["e 0 108", "w 50 60"]);
    assert_eq!((direct.shrinks, direct.grows), (1, 1));
    assert_eq!((through.shrinks, through.grows), (1, 1), "the loop shrank e for w and grew it back");
    for (j, t) in through.jobs.iter().zip(&trace.jobs) {
        assert_eq!(j.worked_task_ms, t.duration_ms as u128 * t.tasks_min as u128, "{}", j.id);
    }
    Ok(())
}
