//! `shoal validate JOB.toml [--json]`: a spec checked with no server, printed back with its defaults, or every
//! problem named with its key path.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

fn validate(args: &[&str], job: &Path) -> Output {
    shoal().arg("validate").args(args).arg(job).output().expect("run shoal validate")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn tmpfile(tag: &str, body: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("shoal-validate-test-{}-{tag}.toml", std::process::id()));
    std::fs::write(&path, body).expect("write job");
    path
}

#[test]
fn a_valid_spec_is_printed_back_with_every_default() {
    let job = examples().join("mlp_digits.toml");
    let out = validate(&[], &job);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    for line in
        ["queue = \"default\"", "strategy = \"ddp\"", "betas = [0.9, 0.999]", "hidden = [128, 64]", "[resources]"]
    {
        assert!(stdout.contains(line), "the resolved spec lacks {line:?}:\n{stdout}");
    }
    let want = shoal_spec::load_job(&job).expect("example is valid").resolved();
    let back = shoal_spec::parse_job(&stdout, "stdout").unwrap_or_else(|e| panic!("{e}\n{stdout}"));
    assert_eq!(back, want);

    let out = validate(&["--json"], &job);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["ok"], true);
    assert_eq!(v["spec"]["train"]["strategy"], "ddp");
    assert_eq!(v["spec"]["train"]["eps"], 1e-8);
    assert_eq!(v["spec"]["name"], "mlp-digits");
}

#[test]
fn every_problem_is_named_with_its_key_path() {
    let job = tmpfile(
        "bad",
        "name = \"a b\"\n[resources]\ngpu_memory = \"1GiB\"\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\n\
         global_batch = 8\nsteps = 0\nlr = 0.1\nstrategy = \"ddp\"\n[checkpoint]\nkeep = 0\n",
    );
    let out = validate(&[], &job);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "nothing on stdout for an invalid spec: {}", text(&out.stdout));
    let stderr = text(&out.stderr);
    let file = job.display().to_string();
    for key in ["name", "resources.gpu_memory", "train.steps", "checkpoint.keep"] {
        assert!(stderr.contains(&format!("{file}: {key}: ")), "{key} not named:\n{stderr}");
    }

    let out = validate(&["--json"], &job);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["ok"], false);
    let paths: Vec<&str> =
        v["errors"].as_array().expect("errors").iter().map(|e| e["path"].as_str().unwrap_or("?")).collect();
    assert_eq!(paths, ["name", "resources.gpu_memory", "train.steps", "checkpoint.keep"]);
    assert!(v["errors"][2]["message"].as_str().is_some_and(|m| m.contains("must be > 0")), "{v}");
    let _ = std::fs::remove_file(job);
}

#[test]
fn syntax_errors_and_unreadable_files_are_errors_too() {
    let job = tmpfile("syntax", "name = \"x\"\n[train]\nsteps = = 3\n");
    let out = validate(&["--json"], &job);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["errors"][0]["line"], 3, "{v}");
    let _ = std::fs::remove_file(job);

    let job = tmpfile(
        "strategy",
        "name = \"x\"\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\nglobal_batch = 8\nsteps = 3\nlr = 0.1\nstrategy = \"fsdp\"\n",
    );
    let out = validate(&[], &job);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("train.strategy: \"fsdp\" is not available yet; available: ddp, zero1, zero2, zero3"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(job);

    let missing = std::env::temp_dir().join("shoal-validate-no-such-job.toml");
    let out = validate(&[], &missing);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains(&format!("{}: cannot read the job spec", missing.display())));
}
