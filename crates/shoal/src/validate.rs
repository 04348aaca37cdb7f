//! `shoal validate JOB.toml [--json]`: checks a job spec on this machine, with no server, through the parser
//! and checks the server uses (`shoal_spec::check_job`).
//!
//! - valid: exit 0; stdout holds the spec with every default filled in, as TOML (`parse_job` reads it back), or
//!   with `--json` `{"ok": true, "spec": {...}}`;
//! - invalid: exit 1; every problem is named with its key path, one line each on stderr
//!   (`JOB.toml: train.steps: must be > 0`), or with `--json`
//!   `{"ok": false, "errors": [{"path", "message", "line", "column"}]}` on stdout.

use std::io::Write;
use std::path::Path;

use anyhow::{Result, anyhow};
use serde_json::{Value, json};
use shoal_spec::{JobSpec, SpecError};

/// Runs the command; `Ok(false)` when the spec is invalid (the problems are already printed).
pub fn run(job: &Path, json_out: bool) -> Result<bool> {
    match (shoal_spec::check_job(job), json_out) {
        (Ok(spec), false) => print_toml(&spec.resolved(), job),
        (Ok(spec), true) => print_line(&json!({ "ok": true, "spec": spec.resolved() }).to_string()).map(|()| true),
        (Err(problems), false) => {
            let mut err = std::io::stderr().lock();
            for p in &problems {
                let _ = writeln!(err, "{p}");
            }
            Ok(false)
        }
        (Err(problems), true) => {
            let errors: Vec<Value> = problems.iter().map(problem_json).collect();
            print_line(&json!({ "ok": false, "errors": errors }).to_string()).map(|()| false)
        }
    }
}

fn print_toml(spec: &JobSpec, job: &Path) -> Result<bool> {
    let text = spec.to_toml().map_err(|e| anyhow!("{}: {e}", job.display()))?;
    eprintln!("{}: valid; the spec with its defaults filled in follows", job.display());
    print_line(text.trim_end())?;
    Ok(true)
}

/// One problem as `{"path", "message", "line", "column"}` (the position when the parser knows it, else null).
fn problem_json(p: &SpecError) -> Value {
    json!({ "path": p.path, "message": p.message, "line": p.line, "column": p.column })
}

fn print_line(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}").and_then(|()| out.flush()).map_err(|e| anyhow!("writing to stdout: {e}"))
}
