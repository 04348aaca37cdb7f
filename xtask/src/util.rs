//! Small helpers shared by the xtask commands: paths, PATH lookup, child processes
//! with a deadline, timestamps.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

/// Root of the cargo workspace (the parent of `xtask/`).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Directory holding our peer benchmark scripts (`xtask/peers`).
pub fn peer_scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("peers")
}

/// Cache directory for the installed peers, outside the checkout, keyed by version.
pub fn peers_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SHOAL_PEERS_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join(".cache/shoal/peers-v1")
}

/// Python interpreter of the peers' virtualenv.
pub fn venv_python(peers: &Path) -> PathBuf {
    peers.join("venv/bin/python")
}

/// First executable called `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// Runs a command to completion with inherited stdio; error on a non-zero exit.
pub fn run_visible(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd.status().with_context(|| format!("starting {shown}"))?;
    anyhow::ensure!(status.success(), "{shown} failed: {status}");
    Ok(())
}

/// Captured stdout of a command when it succeeds.
pub fn capture_stdout(cmd: &mut Command) -> Option<String> {
    let out = cmd.stdin(Stdio::null()).stderr(Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What a finished child left behind.
#[derive(Debug)]
pub struct Finished {
    pub ok: bool,
    pub timed_out: bool,
    pub status: String,
    pub stdout: String,
    pub stderr: String,
}

fn reader<R: Read + Send + 'static>(r: Option<R>) -> Option<JoinHandle<String>> {
    r.map(|mut r| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            String::from_utf8_lossy(&buf).into_owned()
        })
    })
}

/// A started child and the threads collecting its stdout and stderr.
type Running = (Child, Option<JoinHandle<String>>, Option<JoinHandle<String>>);

/// Starts all `cmds` at once (stdout and stderr captured) and waits for them all, up to
/// `timeout`; on timeout every child still running gets SIGTERM, then SIGKILL 3 s later.
pub fn run_group(cmds: Vec<Command>, timeout: Duration) -> Result<Vec<Finished>> {
    let mut children: Vec<Running> = Vec::new();
    for mut cmd in cmds {
        let shown = format!("{cmd:?}");
        let spawned = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                for (c, _, _) in children.iter_mut() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(e).with_context(|| format!("starting {shown}"));
            }
        };
        let out = reader(child.stdout.take());
        let err = reader(child.stderr.take());
        children.push((child, out, err));
    }
    let deadline = Instant::now() + timeout;
    let mut statuses: Vec<Option<std::process::ExitStatus>> = vec![None; children.len()];
    let mut timed_out = false;
    loop {
        for (i, (c, _, _)) in children.iter_mut().enumerate() {
            if statuses[i].is_none() {
                statuses[i] = c.try_wait()?;
            }
        }
        if statuses.iter().all(Option::is_some) {
            break;
        }
        if Instant::now() >= deadline {
            timed_out = true;
            for (i, (c, _, _)) in children.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    let _ = Command::new("kill").arg("-TERM").arg(c.id().to_string()).status();
                }
            }
            let grace = Instant::now() + Duration::from_secs(3);
            while Instant::now() < grace {
                for (i, (c, _, _)) in children.iter_mut().enumerate() {
                    if statuses[i].is_none() {
                        statuses[i] = c.try_wait()?;
                    }
                }
                if statuses.iter().all(Option::is_some) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            for (i, (c, _, _)) in children.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    let _ = c.kill();
                    statuses[i] = Some(c.wait()?);
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut done = Vec::new();
    for ((_, out, err), st) in children.into_iter().zip(statuses) {
        let st = st.context("child status missing")?;
        done.push(Finished {
            ok: st.success() && !timed_out,
            timed_out,
            status: st.to_string(),
            stdout: out.and_then(|h| h.join().ok()).unwrap_or_default(),
            stderr: err.and_then(|h| h.join().ok()).unwrap_or_default(),
        });
    }
    Ok(done)
}

/// Last `n` lines of a text, for error messages.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// UTC timestamp `YYYYMMDD-HHMMSS` for result file names.
pub fn timestamp() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!("{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Proleptic Gregorian date of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Human size of a directory tree (via `du -sh`), or "?".
pub fn du(path: &Path) -> String {
    capture_stdout(Command::new("du").arg("-sh").arg(path))
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// Ends a benchmark run: appends the summary rows to the raw results, writes the
/// table to `txt`, and prints either the rows (one JSON object per line) or the table.
pub fn finish_report(
    raw: &mut impl std::io::Write,
    txt: &Path,
    text: &str,
    rows: &[serde_json::Value],
    json: bool,
) -> Result<()> {
    for v in rows {
        writeln!(raw, "{}", serde_json::json!({"kind": "summary", "row": v})).context("writing raw results")?;
    }
    std::fs::write(txt, text).with_context(|| format!("writing {}", txt.display()))?;
    if json {
        for v in rows {
            println!("{v}");
        }
    } else {
        print!("{text}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }
}
