//! Checkpoints in a real S3 server (s3s-fs, started by the test): mirrored as they are saved, pruned to `keep`
//! there too, and a run with an empty output directory resumes from them, skipping a corrupt newest one and naming
//! the object at fault.

use std::path::PathBuf;
use std::process::Command;

use crate::support_s3::S3;

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-remote-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn job(steps: usize) -> String {
    format!(
        r#"
name = "s3-ckpt"
[train]
model = "mlp"
dataset = "digits"
global_batch = 32
steps = {steps}
lr = 0.01
log_every = 20
[checkpoint]
every = 20
keep = 2
url = "s3://checkpoints/run-1"
"#
    )
}

fn run(s3: &S3, args: &[&str]) -> (serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal")).args(args).envs(s3.env()).output().expect("run shoal");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "shoal {args:?} failed:\n{stderr}");
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("summary is not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    (v, stderr)
}

#[test]
fn checkpoints_go_to_s3_and_a_fresh_run_resumes_from_there_past_a_corrupt_one() {
    let s3 = S3::start(&["checkpoints"]).expect("start an S3 server for the test");
    let dir = tmpdir("s3");
    let spec = dir.join("job.toml");
    std::fs::write(&spec, job(60)).expect("job file");
    let out1 = dir.join("first");
    let (v, _) = run(
        &s3,
        &["run", "-n", "2", "--json", "--output", out1.to_str().expect("utf-8"), spec.to_str().expect("utf-8")],
    );
    assert_eq!(v["steps"], 60, "{v}");
    let key =
        |step: u64, file: &str| s3.object_path("checkpoints", &format!("run-1/checkpoints/step-{step:06}/{file}"));
    // Mirrored and pruned to keep = 2 in the bucket.
    for step in [40, 60] {
        for file in ["manifest.json", "model.safetensors", "optimizer.safetensors"] {
            assert!(key(step, file).is_file(), "{} missing in the bucket", key(step, file).display());
        }
    }
    assert!(!key(20, "manifest.json").exists(), "step 20 should have been pruned from the bucket");

    // Corrupt the newest remote checkpoint; resume into an empty output directory: only S3 has the checkpoints.
    let model = key(60, "model.safetensors");
    let mut bytes = std::fs::read(&model).expect("model object");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&model, bytes).expect("corrupt the model object");
    std::fs::write(&spec, job(80)).expect("job file");
    let out2 = dir.join("second");
    let (v, stderr) = run(
        &s3,
        &[
            "run",
            "-n",
            "2",
            "--json",
            "--resume",
            "--output",
            out2.to_str().expect("utf-8"),
            spec.to_str().expect("utf-8"),
        ],
    );
    assert!(
        stderr.contains("skipped checkpoint object s3://checkpoints/run-1/checkpoints/step-000060/model.safetensors"),
        "the corrupt object must be named:\n{stderr}"
    );
    assert!(stderr.contains("fetched checkpoint step 40"), "{stderr}");
    assert_eq!(v["resumed_from"], 40, "{v}");
    assert_eq!(v["steps"], 80, "{v}");
    // The resumed run mirrors its own checkpoints.
    assert!(key(80, "manifest.json").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}
