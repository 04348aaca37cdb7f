//! Parameter servers end to end (`strategy = "ps"`, real processes): `shoal run -n 3` with `ps.servers = 2` starts
//! three workers and two servers; every mode learns the digits, the synchronous one exactly as data parallelism
//! does, the servers save their shards beside the workers' checkpoints, and a job resumed from its checkpoint goes
//! on as if it had never stopped.

use std::path::{Path, PathBuf};

use crate::train::run_json;

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-ps-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// The digits MLP, SGD with momentum at a constant learning rate (a shorter run is a prefix of a longer one),
/// under `strategy` with `more` tables.
fn job(dir: &Path, tag: &str, strategy: &str, steps: usize, more: &str) -> PathBuf {
    let text = format!(
        "name = \"ps-{tag}\"\n[train]\ndataset = \"digits\"\nstrategy = \"{strategy}\"\nglobal_batch = 48\n\
         steps = {steps}\nseed = 5\noptimizer = \"sgd\"\nlr = 0.05\nschedule = \"constant\"\nlog_every = 1000\n\
         [train.model]\nkind = \"mlp\"\nhidden = [64]\n[checkpoint]\nevery = 100\nkeep = 2\n{more}\n"
    );
    let path = dir.join(format!("{tag}.toml"));
    std::fs::write(&path, text).expect("write job");
    path
}

fn run(job: &Path, out: &Path, resume: bool) -> serde_json::Value {
    let (out, job) = (out.to_str().unwrap_or(""), job.to_str().unwrap_or(""));
    let mut args = vec!["run", "-n", "3", "--json", "--output", out];
    if resume {
        args.push("--resume");
    }
    args.push(job);
    run_json(&args)
}

fn number(s: &serde_json::Value, key: &str) -> f64 {
    s[key].as_f64().unwrap_or_else(|| panic!("{key} in {s}"))
}

#[test]
fn parameter_servers_learn_in_every_mode_and_sync_is_data_parallelism() {
    let dir = tmpdir("modes");
    let ddp = run(&job(&dir, "ddp", "ddp", 200, ""), &dir.join("ddp"), false);
    for (mode, table) in [
        ("sync", "[ps]\nservers = 2\nmode = \"sync\""),
        ("async", "[ps]\nservers = 2\nmode = \"async\""),
        ("ssp", "[ps]\nservers = 2\nmode = \"ssp\"\nstaleness = 2"),
    ] {
        let out = dir.join(mode);
        let s = run(&job(&dir, mode, "ps", 200, table), &out, false);
        assert_eq!(s["strategy"], "ps", "{s}");
        assert_eq!(s["world_size"], 3, "the servers are not workers: {s}");
        assert!(number(&s, "eval_accuracy") >= 0.9, "{mode}: {s}");
        if mode == "sync" {
            let (a, b) = (number(&s, "eval_loss"), number(&ddp, "eval_loss"));
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "sync ps {a} against ddp {b}");
        }
        // Each server saved its shard at the workers' checkpoints, in the checkpoint format.
        for server in 0..2 {
            let manifest = out.join(format!("ps/server-{server}/checkpoints/step-000200/manifest.json"));
            let text = std::fs::read_to_string(&manifest).unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
            let m: serde_json::Value = serde_json::from_str(&text).expect("manifest");
            assert_eq!((m["strategy"].as_str(), m["extra"]["server"].as_u64()), (Some("ps-server"), Some(server)));
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_parameter_server_job_resumed_from_its_checkpoint_goes_on_as_if_it_never_stopped() {
    let dir = tmpdir("resume");
    let table = "[ps]\nservers = 2";
    let whole = run(&job(&dir, "whole", "ps", 200, table), &dir.join("whole"), false);
    let out = dir.join("halves");
    run(&job(&dir, "halves", "ps", 100, table), &out, false);
    let resumed = run(&job(&dir, "halves", "ps", 200, table), &out, true);
    assert_eq!(resumed["resumed_from"], 100, "{resumed}");
    assert_eq!(number(&resumed, "eval_loss"), number(&whole, "eval_loss"), "{resumed}\n{whole}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Robust aggregation on the servers (`[robust]` under `ps.mode = "sync"`), with one of five workers flipping its
/// gradient ten times over (`[chaos]`, forged where the servers gather the round): the mean is dragged uphill and
/// fails, the median keeps learning.
#[test]
fn the_servers_median_bears_a_sign_flipping_worker_that_ruins_the_mean() {
    let dir = tmpdir("robust");
    let chaos = "[chaos]\nbyzantine_ranks = [4]\nattack = \"signflip\"";
    let accuracy = |tag: &str, rule: &str| -> Option<f64> {
        let table =
            format!("[ps]\nservers = 1\n[robust]\nrule = \"{rule}\"\nf = {}\n{chaos}", u8::from(rule != "mean"));
        let (job, out) = (job(&dir, tag, "ps", 200, &table), dir.join(tag));
        let (out, job) = (out.to_str().unwrap_or(""), job.to_str().unwrap_or(""));
        run_json(&["run", "-n", "5", "--json", "--output", out, job])["eval_accuracy"].as_f64()
    };
    let mean = accuracy("mean", "mean");
    assert!(mean.is_none_or(|a| a < 0.5), "the attacked mean still reached {mean:?}");
    let median = accuracy("median", "median");
    assert!(median.is_some_and(|a| a >= 0.85), "the median reached {median:?} only");
    let _ = std::fs::remove_dir_all(dir);
}
