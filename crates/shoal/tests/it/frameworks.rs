//! Jobs that run their own program (`train.command`) on the platform: a data-parallel JAX program over 2 worker
//! processes (JAX from PyPI, in an environment `scripts/test-jax.sh` builds once outside the checkout) trains on a
//! CSV table and its printed metrics reach the job's page; the frameworks' environment (TF_CONFIG, JAX's) reaches
//! every rank; a program that fails fails the job with its status.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::lake::Res;
use crate::platform::{Platform, run_setup};

/// Building the JAX environment the first time (about 25 s here, more on a slow mirror).
const SETUP: Duration = Duration::from_secs(600);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The python of the JAX environment.
fn jax_python() -> Res<String> {
    let out = run_setup(&repo().join("scripts/test-jax.sh"), SETUP, "the JAX environment")?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !Path::new(&path).exists() {
        return Err(format!("scripts/test-jax.sh printed {path:?}, which is not a file"));
    }
    Ok(path)
}

/// A table whose class is the largest of four fixed linear scores of six features (the planted table's rule).
fn csv(path: &Path, rows: u64) -> Res<()> {
    let planted =
        shoal_data::lake::planted::Planted { rows: 0, row_group: 1, features: 6, extra: 0, classes: 4, seed: 0 };
    let mut out = String::from("f0,f1,f2,f3,f4,f5,label\n");
    for i in 0..rows {
        let (x, c) = planted.row(i);
        let xs: Vec<String> = x.iter().map(|v| v.to_string()).collect();
        out.push_str(&format!("{},{c}\n", xs.join(",")));
    }
    std::fs::write(path, out).map_err(|e| e.to_string())
}

fn command_job(name: &str, command: &[&str], steps: usize, restarts: &str) -> String {
    let argv: Vec<String> = command.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "name = \"{name}\"\n[workers]\ncount = 2\n[resources]\ncpus = 1\nmemory = \"2GiB\"\n[fault_tolerance]\n\
         {restarts}\n[train]\ncommand = [{}]\nsteps = {steps}\n",
        argv.join(", ")
    )
}

/// Rank `rank`'s stored metrics rows of job `id`.
fn metrics(p: &Platform, id: &str, rank: i64) -> Vec<Value> {
    let m = p.get(&format!("/api/v1/jobs/{id}/metrics?rank={rank}"));
    m["metrics"].as_array().cloned().unwrap_or_default()
}

#[test]
fn a_jax_program_trains_on_two_workers_and_its_metrics_reach_the_job_page() -> Res<()> {
    let python = jax_python()?;
    let p = Platform::new("jax");
    let data = p.data().join("table.csv");
    csv(&data, 3000)?;
    let script = repo().join("examples/jax_mlp.py").canonicalize().map_err(|e| e.to_string())?;
    let (script, data) = (script.display().to_string(), data.display().to_string());
    let steps = 150;
    let argv = [
        python.as_str(),
        &script,
        "--data",
        &data,
        "--features",
        "f0,f1,f2,f3,f4,f5",
        "--label",
        "label",
        "--classes",
        "4",
        "--steps",
        "150",
    ];
    let id = p.submit("jax", &command_job("jax", &argv, steps, "policy = \"none\""));
    let v = p.wait_state(&id, "succeeded");
    let sum = &v["summary"];
    assert_eq!(sum["steps"].as_u64(), Some(steps as u64), "{sum}");
    let acc = sum["eval_accuracy"].as_f64().ok_or_else(|| format!("no eval_accuracy: {sum}"))?;
    assert!(acc > 0.8, "the JAX MLP learns the planted classes: held-out accuracy {acc}");
    // Every step of both ranks is on the job's page, with the loss falling and the same parameters on both.
    let (r0, r1) = (metrics(&p, &id, 0), metrics(&p, &id, 1));
    let steps_of = |rows: &[Value]| rows.iter().filter_map(|r| r["step"].as_i64()).collect::<Vec<_>>();
    let want: Vec<i64> = (1..=steps as i64).collect();
    assert_eq!(steps_of(&r0), want, "rank 0's steps");
    assert_eq!(steps_of(&r1), want, "rank 1's steps");
    let loss = |rows: &[Value], i: usize| rows[i]["data"]["loss"].as_f64().unwrap_or(f64::NAN);
    let (first, last) = (loss(&r0, 0), loss(&r0, steps - 1));
    assert!(last < first * 0.5, "the loss falls: {first} at step 1, {last} at step {steps}");
    let norm = |rows: &[Value]| rows[steps - 1]["data"]["param_norm"].as_f64();
    assert_eq!(norm(&r0), norm(&r1), "both ranks applied the same updates");
    assert_eq!(v["last_metrics"]["step"].as_i64(), Some(steps as i64), "{v}");
    Ok(())
}

#[test]
fn every_rank_of_a_program_gets_the_frameworks_environment_and_a_failure_fails_the_job() -> Res<()> {
    let p = Platform::new("framework-env");
    // Each rank prints its contract as one metrics line, then rank 1 fails with status 3.
    let script = r#"printf '{"step":1,"loss":0.5,"tf_config":%s,"jax_coordinator":"%s","jax_processes":"%s","jax_id":"%s","torch_rank":"%s","master":"%s:%s"}\n' "$TF_CONFIG" "$JAX_COORDINATOR_ADDRESS" "$JAX_NUM_PROCESSES" "$JAX_PROCESS_ID" "$RANK" "$MASTER_ADDR" "$MASTER_PORT"; [ "$RANK" = 1 ] && exit 3; exit 0"#;
    let id = p.submit("env", &command_job("env", &["sh", "-c", script], 1, "policy = \"none\""));
    let v = p.wait_state(&id, "failed");
    let reason = v["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("rank 1") && reason.contains("status 3"), "the failure names the rank and status: {v}");
    let lines: Vec<Value> = (0..2).filter_map(|r| metrics(&p, &id, r).first().map(|m| m["data"].clone())).collect();
    assert_eq!(lines.len(), 2, "both ranks' lines were ingested: {lines:?}");
    let workers = lines[0]["tf_config"]["cluster"]["worker"].as_array().cloned().unwrap_or_default();
    assert_eq!(workers.len(), 2, "TF_CONFIG names both workers: {}", lines[0]);
    for (rank, line) in lines.iter().enumerate() {
        assert_eq!(line["tf_config"]["cluster"]["worker"].as_array(), Some(&workers), "one cluster: {line}");
        assert_eq!(line["tf_config"]["task"], serde_json::json!({"type": "worker", "index": rank}), "{line}");
        assert_eq!(line["jax_coordinator"], workers[0], "rank 0 coordinates JAX: {line}");
        assert_eq!(line["jax_processes"], "2", "{line}");
        assert_eq!(
            (line["jax_id"].as_str(), line["torch_rank"].as_str()),
            (Some(rank.to_string().as_str()), Some(rank.to_string().as_str()))
        );
    }
    Ok(())
}
