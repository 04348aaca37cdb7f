//! A throwaway S3-compatible server for integration tests.
//!
//! [`S3::start`] runs `scripts/test-s3.sh start`, which builds the `s3s-fs`
//! server once per machine with `cargo install` (about 5 minutes on two cores,
//! cached under `~/.cache/shoal/`), then starts it on 127.0.0.1 with the fixed
//! credentials `testkey` / `testsecret` and the requested buckets. Dropping
//! the [`S3`] stops the server and removes its directory.
//!
//! Each call starts its own server on its own port, so tests running in
//! parallel do not share state. Starting one takes well under a second once
//! the binary is built.
//!
//! `s3s-fs` keeps each object as a plain file, `DIR/data/BUCKET/KEY`, where
//! `/` in a key makes nested directories; see [`S3::object_path`]. Its own
//! bookkeeping (`.bucket-*.internal.json`, `.bucket-*.metadata.json`, temporary
//! `.tmp.*` files) lives directly in `DIR/data`, outside every bucket.

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// Access key the server accepts.
const ACCESS_KEY: &str = "testkey";

/// Secret key the server accepts.
const SECRET_KEY: &str = "testsecret";

/// How many times [`S3::start`] tries a new port when the one it picked was
/// taken by someone else before the server could bind it.
const START_ATTEMPTS: usize = 3;

/// How many lines of the script's stderr an error carries.
const STDERR_TAIL_LINES: usize = 40;

/// A running S3 server for a test; stopped and wiped on drop.
#[derive(Debug)]
pub struct S3 {
    /// Where clients reach it: `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// The server directory (`SHOAL_S3_DIR`); objects are under `dir/data`.
    /// Removed on drop.
    pub dir: PathBuf,
    /// The server's TCP port on 127.0.0.1 (`SHOAL_S3_PORT`).
    port: u16,
}

impl S3 {
    /// Starts one with `scripts/test-s3.sh` on a free port, with the given
    /// buckets (each becomes an empty directory `dir/data/BUCKET`).
    ///
    /// The first call on a machine builds `s3s-fs`, which takes minutes. The
    /// error carries the tail of the script's stderr.
    pub fn start(buckets: &[&str]) -> Result<S3, String> {
        let script = script_path();
        if !script.is_file() {
            return Err(format!("{} not found", script.display()));
        }
        if let Some(bad) = buckets.iter().find(|b| b.is_empty() || b.contains(char::is_whitespace)) {
            return Err(format!("invalid bucket name {bad:?}"));
        }
        let buckets = buckets.join(" ");
        let mut last_error = String::new();
        for _ in 0..START_ATTEMPTS {
            let port = free_port()?;
            let dir = PathBuf::from(format!("/tmp/shoal-s3-{port}"));
            let output = run_script(&script, "start", &dir, port, Some(&buckets), Stdio::piped())?;
            let stderr = String::from_utf8_lossy(&output.stderr);
            if output.status.success() {
                let stdout = String::from_utf8_lossy(&output.stdout);
                let endpoint = stdout.lines().last().unwrap_or_default().trim().to_owned();
                let expected = format!("http://127.0.0.1:{port}");
                let server = S3 { endpoint, dir, port };
                if server.endpoint == expected {
                    return Ok(server);
                }
                // `server` is dropped here, which stops it.
                return Err(format!(
                    "{} start printed no endpoint {expected} (stdout: {stdout:?}); stderr:\n{}",
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

    /// The environment a client needs: `AWS_ENDPOINT`, the credentials,
    /// `AWS_REGION` and `AWS_ALLOW_HTTP=true` (the server speaks plain HTTP).
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT", self.endpoint.as_str()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    /// Where the object `bucket/key` lives on disk: `dir/data/bucket/key`
    /// (s3s-fs stores each object as one plain file, `/` in the key making
    /// nested directories).
    ///
    /// Deleting an object removes only its file: the directories its key made
    /// stay behind, empty (they are not listed as objects).
    pub fn object_path(&self, bucket: &str, key: &str) -> PathBuf {
        let mut path = self.dir.join("data").join(bucket);
        path.extend(key.split('/').filter(|part| !part.is_empty()));
        path
    }
}

impl Drop for S3 {
    /// Stops the server and removes its directory, ignoring errors.
    fn drop(&mut self) {
        let _ = run_script(&script_path(), "stop", &self.dir, self.port, None, Stdio::null());
    }
}

/// `scripts/test-s3.sh` of this workspace.
fn script_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/test-s3.sh")
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| format!("cannot bind 127.0.0.1:0 to find a free port: {e}"))?;
    let port = listener.local_addr().map_err(|e| format!("cannot read the port of a bound socket: {e}"))?.port();
    drop(listener);
    Ok(port)
}

/// Runs `bash SCRIPT ACTION` for the server in `dir` on `port`.
///
/// stdout is captured; stderr goes to `stderr` (captured when piped).
fn run_script(
    script: &Path,
    action: &str,
    dir: &Path,
    port: u16,
    buckets: Option<&str>,
    stderr: Stdio,
) -> Result<Output, String> {
    let mut command = Command::new("bash");
    command
        .arg(script)
        .arg(action)
        .env("SHOAL_S3_DIR", dir)
        .env("SHOAL_S3_PORT", port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr);
    if let Some(buckets) = buckets {
        command.env("SHOAL_S3_BUCKETS", buckets);
    }
    command.output().map_err(|e| format!("cannot run bash {} {action}: {e}", script.display()))
}

/// The last [`STDERR_TAIL_LINES`] lines of `text`.
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(STDERR_TAIL_LINES)..].join("\n")
}
