//! The simulator's tests: policies on small traces with known answers through one `check` helper, determinism,
//! conservation of work and capacity, and refused inputs.

use shoal_sim::{
    Outcome, Report, SimOptions, SynthOptions, Trace, TraceFormat, homogeneous, parse_cluster, parse_trace, simulate,
};

#[cfg(feature = "control")]
mod control;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const HEADER: &str = "job_id,submit_s,duration_s,gpus,gpu_milli,cpus,memory_mib,team,min_workers,max_workers";

/// Runs `rows` (Shoal's CSV without its header; empty `min_workers,max_workers` allowed) under `policy` on
/// `nodes` nodes of 8 GPUs (or `cluster`, a node list), a pass at every instant, no grace period, LAS thresholds
/// at 100 GPU-seconds, checking invariants throughout.
fn run(policy: &str, nodes: usize, cluster: Option<&str>, rows: &str) -> Result<Outcome> {
    let trace = parse_trace("t.csv", &format!("{HEADER}\n{rows}"))?;
    let nodes = match cluster {
        Some(text) => parse_cluster("n.csv", text)?,
        None => homogeneous(nodes, 8)?,
    };
    let options = SimOptions {
        policy: policy.parse()?,
        interval_ms: 0,
        grace_ms: 0,
        las_thresholds_gpu_ms: Some(vec![100_000]),
        audit: true,
        ..SimOptions::default()
    };
    Ok(simulate(&trace, nodes, &options)?)
}

/// One line per job: `id start end` in seconds, `preempted N` when it was.
fn render(o: &Outcome) -> Vec<String> {
    let s = |ms: Option<u64>| ms.map(|v| format!("{}", v as f64 / 1000.0)).unwrap_or_else(|| "-".into());
    o.jobs
        .iter()
        .map(|j| {
            let mut line = format!("{} {} {}", j.id, s(j.first_start_ms), s(j.end_ms));
            if j.preemptions > 0 {
                line.push_str(&format!(" preempted {}", j.preemptions));
            }
            line
        })
        .collect()
}

#[track_caller]
fn check(policy: &str, nodes: usize, cluster: Option<&str>, rows: &str, want: &str) {
    let got = match run(policy, nodes, cluster, rows) {
        Ok(o) => render(&o),
        Err(e) => vec![format!("error: {e}")],
    };
    let want: Vec<&str> = want.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    assert_eq!(got, want, "policy {policy}");
}

const LONG_THEN_SHORT: &str = "long,0,100,8,,1,1,x,,\nshort,0,10,8,,1,1,y,,\n";

#[test]
fn fifo_runs_in_order_of_submission() {
    check("fifo", 1, None, LONG_THEN_SHORT, "long 0 100\nshort 100 110");
}

#[test]
fn sjf_runs_the_shortest_first() {
    check("sjf", 1, None, LONG_THEN_SHORT, "long 10 110\nshort 0 10");
}

const HEAD_BLOCKS: &str = "a,0,100,4,,1,1,x,,\nb,1,10,8,,1,1,x,,\nc,2,50,4,,1,1,x,,\nd,3,200,4,,1,1,x,,\n";

#[test]
fn fifo_starts_nothing_behind_the_head() {
    check("fifo", 1, None, HEAD_BLOCKS, "a 0 100\nb 100 110\nc 110 160\nd 110 310");
}

#[test]
fn backfill_starts_what_ends_before_the_head_starts() {
    // c (50 s) ends by 52, before b's reservation at 100: it starts now; d (200 s) would delay b: it waits.
    check("backfill", 1, None, HEAD_BLOCKS, "a 0 100\nb 100 110\nc 2 52\nd 110 310");
}

#[test]
fn las_lets_a_new_job_preempt_one_past_its_threshold() {
    // At 100 s `long` has had 800 GPU-seconds, past the 100 GPU-second threshold: `new` preempts it, which
    // resumes with the 900 s of work it has left.
    let rows = "long,0,1000,8,,1,1,x,,\nnew,100,10,8,,1,1,y,,\n";
    check("las", 1, None, rows, "long 0 1010 preempted 1\nnew 100 110");
    check("fifo", 1, None, rows, "long 0 1000\nnew 1000 1010");
}

#[test]
fn elastic_jobs_grow_into_idle_gpus_and_shrink_for_a_peer() {
    // e: 1..4 tasks of one GPU, 400 s of work at one task. Alone on 4 GPUs it grows to 4 and ends at 100; under
    // the elastic ordering it gives w two GPUs at 50 s and grows back when w ends.
    let rows = "e,0,400,1,,1,1,x,1,4\nw,50,10,2,,1,1,y,,\n";
    let cluster = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,65536,4,T4\n";
    check("elastic", 0, Some(cluster), rows, "e 0 105\nw 50 60");
    check("drf", 0, Some(cluster), rows, "e 0 100\nw 100 110");
}

#[test]
fn fgd_keeps_gpus_usable_where_bestfit_strands_them() {
    // Two short GPU jobs first (so the recent shapes hold GPU jobs), then a CPU-only job that fits both nodes: best
    // fit takes the smaller, whose GPUs then lack CPUs, and the last two GPU jobs wait for it. FGD puts it on the
    // big node.
    let cluster = "sn,cpu_milli,memory_mib,gpu,model\nsmall,8000,65536,2,T4\nbig,64000,65536,2,T4\n";
    let rows = "w1,0,1,1,,4,1,y,,\nw2,0,1,1,,4,1,y,,\ncpu,2,100,0,,8,1,x,,\n\
                g1,3,100,1,,4,1,y,,\ng2,4,100,1,,4,1,y,,\ng3,5,100,1,,4,1,y,,\ng4,6,100,1,,4,1,y,,\n";
    let head = "w1 0 1\nw2 0 1\ncpu 2 102\ng1 3 103\ng2 4 104";
    check("bestfit", 0, Some(cluster), rows, &format!("{head}\ng3 102 202\ng4 102 202"));
    check("fgd", 0, Some(cluster), rows, &format!("{head}\ng3 5 105\ng4 6 106"));
}

fn synthetic(jobs: usize, seed: u64) -> Trace {
    let jobs = shoal_sim::philly_like(&SynthOptions { jobs, gpus: 64, load: 1.5, seed });
    Trace { name: "synthetic".into(), format: TraceFormat::Shoal, jobs, skipped: 0 }
}

#[test]
fn the_same_inputs_give_the_same_report_byte_for_byte() -> Result {
    let trace = synthetic(600, 3);
    for policy in ["fifo", "las+fgd", "elastic", "drf"] {
        let options = SimOptions { policy: policy.parse()?, seed: 3, ..SimOptions::default() };
        let a = Report::of(&simulate(&trace, homogeneous(8, 8)?, &options)?).to_json()?;
        let b = Report::of(&simulate(&synthetic(600, 3), homogeneous(8, 8)?, &options)?).to_json()?;
        assert_eq!(a, b, "{policy}");
        let json: serde_json::Value = serde_json::from_str(&a)?;
        for key in [
            "policy",
            "engine",
            "jobs",
            "avg_jct_s",
            "p99_jct_s",
            "avg_queue_s",
            "makespan_s",
            "gpu_allocation_mean",
            "unallocated_gpus_mean",
            "unallocated_gpus_arrivals_mean",
            "unallocated_gpus_oversubscribed_mean",
            "preemptions",
        ] {
            assert!(json.get(key).is_some(), "{key} missing");
        }
    }
    Ok(())
}

#[test]
fn every_job_starts_ends_and_does_its_work_once_and_no_node_is_ever_over_capacity() -> Result {
    let trace = synthetic(400, 5);
    for policy in ["fifo", "backfill", "sjf", "las", "las+fgd", "drf", "elastic", "fgd"] {
        let options = SimOptions {
            policy: policy.parse()?,
            grace_ms: 5_000,
            las_thresholds_gpu_ms: Some(vec![600_000, 6_000_000]),
            audit: true,
            ..SimOptions::default()
        };
        let o = simulate(&trace, homogeneous(8, 8)?, &options)?;
        for (j, t) in o.jobs.iter().zip(&trace.jobs) {
            assert!(j.rejected.is_none(), "{policy} {}: {:?}", j.id, j.rejected);
            let (start, end) = (j.first_start_ms.ok_or("never started")?, j.end_ms.ok_or("never ended")?);
            assert!(j.submit_ms <= start && start <= end, "{policy} {}", j.id);
            assert_eq!(j.starts, j.preemptions + 1, "{policy} {}", j.id);
            // Preempted work is kept: exactly the job's work was done, however often it stopped.
            assert_eq!(j.worked_task_ms, t.duration_ms as u128 * t.tasks_min as u128, "{policy} {}", j.id);
        }
        let peak = o.series.iter().map(|s| s.allocated_gpu_milli).max().unwrap_or(0);
        assert!(peak <= o.total_gpu_milli);
        if policy.starts_with("las") {
            assert!(o.preemptions > 0, "{policy}: no preemption");
        }
    }
    Ok(())
}

#[test]
fn bad_traces_are_refused_naming_the_file_line_and_column() -> Result {
    let dir = std::env::temp_dir().join(format!("shoal-sim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("trace.csv");
    std::fs::write(&path, format!("{HEADER}\na,0,1,1,,1,1,x,,\nb,0,abc,1,,1,1,x,,\n"))?;
    let err = shoal_sim::read_trace(&path).map(|_| ()).map_err(|e| e.to_string());
    assert_eq!(err, Err("trace.csv line 3: duration_s: not a number: 'abc'".to_owned()));
    std::fs::write(&path, "job_id,submit_s,duration_s,gpus,gpu_milli,cpus,memory_mib,team,colour\n")?;
    let err = shoal_sim::read_trace(&path).map(|_| ()).map_err(|e| e.to_string()).err().unwrap_or_default();
    assert!(err.starts_with("trace.csv line 1: unknown column(s) colour;"), "{err}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn the_unallocated_gpus_at_arrivals_are_sampled_at_the_same_instants_under_every_policy() -> Result {
    let trace = synthetic(500, 7);
    let mut arrived: Option<Vec<u64>> = None;
    for policy in ["fifo", "backfill+fgd", "las", "drf+fgd", "elastic"] {
        let options = SimOptions { policy: policy.parse()?, ..SimOptions::default() };
        let o = simulate(&trace, homogeneous(8, 8)?, &options)?;
        // One sample a job, the arrived demand growing by each job's GPUs × minimum tasks.
        assert_eq!(o.arrivals.len(), trace.jobs.len(), "{policy}");
        let mut sum = 0u64;
        for (a, j) in o.arrivals.iter().zip(&trace.jobs) {
            sum += j.per_task.gpus_milli * j.tasks_min as u64;
            assert_eq!(a.arrived_gpu_milli, sum, "{policy}");
            assert!(a.unallocated_gpu_milli <= o.total_gpu_milli, "{policy}");
        }
        let mine: Vec<u64> = o.arrivals.iter().map(|a| a.arrived_gpu_milli).collect();
        assert_eq!(arrived.get_or_insert_with(|| mine.clone()), &mine, "{policy}");
        // The report's means, over every arrival and over those once the cluster is oversubscribed.
        let r = Report::of(&o);
        let unalloc: Vec<f64> = o.arrivals.iter().map(|a| a.unallocated_gpu_milli as f64 / 1000.0).collect();
        let from = o.arrivals.iter().position(|a| a.arrived_gpu_milli >= o.total_gpu_milli).ok_or("never full")?;
        let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
        assert!((r.unallocated_gpus_arrivals_mean - mean(&unalloc)).abs() < 1e-9, "{policy}");
        assert_eq!(r.unallocated_gpus_oversubscribed_arrivals, unalloc.len() - from, "{policy}");
        assert!((r.unallocated_gpus_oversubscribed_mean - mean(&unalloc[from..])).abs() < 1e-9, "{policy}");
    }
    Ok(())
}
