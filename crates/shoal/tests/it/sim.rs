//! `shoal sim`: the real binary on a small hand-made trace — the report's keys, byte-identical output for the same
//! inputs, files written by `--out`, `compare`'s plots, a bad row refused with its line.

use std::path::PathBuf;
use std::process::{Command, Output};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

fn shoal(args: &[&str]) -> std::io::Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_shoal")).arg("sim").args(args).output()
}

fn dir(tag: &str) -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("shoal-sim-cli-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

const TRACE: &str = "job_id,submit_s,duration_s,gpus,gpu_milli,cpus,memory_mib,team,min_workers,max_workers
a,0,600,4,,8,4096,vision,,
b,10,30,1,500,2,1024,nlp,,
c,20,3600,8,,16,8192,vision,,
d,30,60,1,,2,1024,nlp,1,4
e,40,120,2,,4,2048,speech,,
";

#[test]
fn sim_prints_one_json_report_the_same_every_time() -> Result {
    let d = dir("json")?;
    let trace = d.join("trace.csv");
    std::fs::write(&trace, TRACE)?;
    let t = trace.to_str().ok_or("path")?;
    let args = ["--trace", t, "--nodes", "2", "--gpus-per-node", "8", "--policy", "las+fgd", "--seed", "7", "--json"];
    let first = shoal(&args)?;
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let second = shoal(&args)?;
    assert_eq!(first.stdout, second.stdout, "not deterministic");
    let report: serde_json::Value = serde_json::from_slice(&first.stdout)?;
    for key in [
        "policy",
        "jobs",
        "avg_jct_s",
        "p99_jct_s",
        "avg_queue_s",
        "makespan_s",
        "gpu_allocation_mean",
        "unallocated_gpus_mean",
        "preemptions",
        "median_jct_s",
        "teams",
    ] {
        assert!(report.get(key).is_some(), "{key} missing from {report}");
    }
    assert_eq!(report["policy"], "las+fgd");
    assert_eq!(report["jobs"], 5);
    assert_eq!(report["completed"], 5);

    let out = d.join("out");
    let o = shoal(&[
        "--trace",
        t,
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--policy",
        "fifo",
        "--out",
        out.to_str().ok_or("path")?,
    ])?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for f in ["report.json", "series.csv", "jobs.csv"] {
        assert!(out.join(f).is_file(), "{f} not written");
    }
    std::fs::remove_dir_all(&d)?;
    Ok(())
}

#[test]
fn compare_writes_a_table_and_plots() -> Result {
    let d = dir("compare")?;
    let trace = d.join("trace.csv");
    std::fs::write(&trace, TRACE)?;
    let out = d.join("out");
    let o = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["sim", "compare", "--trace", trace.to_str().ok_or("path")?, "--nodes", "1", "--gpus-per-node", "8"])
        .args(["--policies", "fifo,las,bestfit,fgd", "--json", "--out", out.to_str().ok_or("path")?])
        .output()?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    assert_eq!(doc["policies"], serde_json::json!(["fifo+bestfit", "las+bestfit", "drf+bestfit", "drf+fgd"]));
    for f in ["jct_cdf.svg", "allocation.svg", "queue.svg", "fragmentation.svg", "compare.json"] {
        let text = std::fs::read_to_string(out.join(f))?;
        assert!(!text.is_empty(), "{f} empty");
    }
    assert!(std::fs::read_to_string(out.join("jct_cdf.svg"))?.contains("<svg"));
    std::fs::remove_dir_all(&d)?;
    Ok(())
}

#[test]
fn a_bad_row_is_refused_with_its_line() -> Result {
    let d = dir("bad")?;
    let trace = d.join("trace.csv");
    std::fs::write(&trace, format!("{TRACE}f,50,abc,1,,1,1,x,,\n"))?;
    let o = shoal(&["--trace", trace.to_str().ok_or("path")?, "--nodes", "1", "--gpus-per-node", "8"])?;
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("trace.csv line 7: duration_s: not a number: 'abc'"), "{err}");
    std::fs::remove_dir_all(&d)?;
    Ok(())
}
