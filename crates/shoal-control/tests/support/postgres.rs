//! A throwaway PostgreSQL server for integration tests.
//!
//! [`Postgres::start`] runs `scripts/test-postgres.sh start`, which installs
//! PostgreSQL with apt-get when it is missing (root only), creates a fresh
//! cluster on 127.0.0.1 and a database `shoal`. Dropping the [`Postgres`]
//! stops the server and removes its directory.
//!
//! Each call starts its own server on its own port, so tests running in
//! parallel do not share state. Starting one takes a second or two once
//! PostgreSQL is installed.

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// How many times [`Postgres::start`] tries a new port when the one it picked
/// was taken by someone else before the server could bind it.
const START_ATTEMPTS: usize = 3;

/// How many lines of the script's stderr an error carries.
const STDERR_TAIL_LINES: usize = 40;

/// A running PostgreSQL server, stopped and wiped on drop.
#[derive(Debug)]
pub struct Postgres {
    /// Connection URL, `postgres://postgres:postgres@127.0.0.1:PORT/shoal`.
    pub url: String,
    /// The cluster directory (`SHOAL_PG_DIR`), removed on drop.
    dir: PathBuf,
    /// The server's TCP port on 127.0.0.1 (`SHOAL_PG_PORT`).
    port: u16,
}

impl Postgres {
    /// Starts a fresh server with `scripts/test-postgres.sh`.
    ///
    /// Picks a free port on 127.0.0.1 and uses `/tmp/shoal-pg-PORT` as the
    /// cluster directory. The error carries the tail of the script's stderr.
    pub fn start() -> Result<Postgres, String> {
        let script = script_path();
        if !script.is_file() {
            return Err(format!("{} not found", script.display()));
        }
        let mut last_error = String::new();
        for _ in 0..START_ATTEMPTS {
            let port = free_port()?;
            // /tmp rather than std::env::temp_dir(): as root the cluster is
            // owned by the `postgres` user, who must be able to reach it, and
            // the unix socket path inside it must stay short.
            let dir = PathBuf::from(format!("/tmp/shoal-pg-{port}"));
            let output = run_script(&script, "start", &dir, port, Stdio::piped())?;
            let stderr = String::from_utf8_lossy(&output.stderr);
            if output.status.success() {
                let stdout = String::from_utf8_lossy(&output.stdout);
                let url = stdout.lines().last().unwrap_or_default().trim().to_owned();
                let server = Postgres { url, dir, port };
                if server.url.starts_with("postgres://") {
                    return Ok(server);
                }
                // `server` is dropped here, which stops it.
                return Err(format!(
                    "{} start printed no URL (stdout: {stdout:?}); stderr:\n{}",
                    script.display(),
                    tail(&stderr)
                ));
            }
            last_error = format!("{} start failed ({}); stderr:\n{}", script.display(), output.status, tail(&stderr));
            // Another process may have bound the port between our check and
            // the server's bind: try again on a new port.
            if !stderr.contains("already in use") {
                break;
            }
        }
        Err(last_error)
    }
}

impl Drop for Postgres {
    /// Stops the server and removes its directory, ignoring errors.
    fn drop(&mut self) {
        let _ = run_script(&script_path(), "stop", &self.dir, self.port, Stdio::null());
    }
}

/// `scripts/test-postgres.sh` of this workspace.
fn script_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/test-postgres.sh")
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| format!("cannot bind 127.0.0.1:0 to find a free port: {e}"))?;
    let port = listener.local_addr().map_err(|e| format!("cannot read the port of a bound socket: {e}"))?.port();
    drop(listener);
    Ok(port)
}

/// Runs `bash SCRIPT ACTION` for the cluster in `dir` on `port`.
///
/// stdout is captured; stderr goes to `stderr` (captured when piped).
fn run_script(script: &Path, action: &str, dir: &Path, port: u16, stderr: Stdio) -> Result<Output, String> {
    Command::new("bash")
        .arg(script)
        .arg(action)
        .env("SHOAL_PG_DIR", dir)
        .env("SHOAL_PG_PORT", port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .output()
        .map_err(|e| format!("cannot run bash {} {action}: {e}", script.display()))
}

/// The last [`STDERR_TAIL_LINES`] lines of `text`.
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(STDERR_TAIL_LINES)..].join("\n")
}
