//! What the launch layer reads about processes and the machine from `/proc` (Linux only), and how it names exit
//! statuses and signals.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;

use crate::executor::Usage;

/// The fields of `/proc/PID/stat` after the command name.
pub(crate) fn stat_fields(pid: i64) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// Field 22 of `/proc/PID/stat`: start time in clock ticks since boot (with the PID, a process's identity: a reused
/// PID has another start time).
pub fn start_ticks(pid: i64) -> Option<i64> {
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// Every process now on the machine.
fn pids() -> impl Iterator<Item = i64> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i64>().ok()))
}

/// The session a process belongs to.
pub fn session_of(pid: i64) -> Option<i64> {
    stat_fields(pid)?.get(3)?.parse().ok()
}

/// Whether any live (not zombie) process belongs to session `sid`.
pub(crate) fn session_alive(sid: i64) -> bool {
    pids().any(|pid| {
        stat_fields(pid).is_some_and(|f| {
            f.get(3).and_then(|s| s.parse::<i64>().ok()) == Some(sid)
                && !matches!(f.first().map(String::as_str), Some("Z" | "X"))
        })
    })
}

pub(crate) fn is_zombie(pid: i64) -> bool {
    stat_fields(pid).and_then(|f| f.first().cloned()).is_some_and(|s| s == "Z" || s == "X")
}

/// Memory and CPU time of every process in session `sid` (CPU time of processes that already ended and were
/// reaped is included through their parents' `cutime`/`cstime`); `None` when the session has no process.
pub(crate) fn session_usage(sid: i64) -> Option<Usage> {
    let page = 4096u64;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mut u = Usage::default();
    let mut found = false;
    for pid in pids() {
        let Some(f) = stat_fields(pid) else { continue };
        // fields after the comm: [0]=state, [3]=session, [11..=14]=utime stime cutime cstime, [21]=rss (pages)
        if f.get(3).and_then(|s| s.parse::<i64>().ok()) == Some(sid) {
            found = true;
            let n = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
            u.rss_bytes += n(21) * page;
            u.cpu_seconds += (n(11) + n(12) + n(13) + n(14)) as f64 / hz;
        }
    }
    found.then_some(u)
}

/// Processes whose environment holds `marker` (`NAME=value`): `(pid, value of `job_var` or "")`.
pub(crate) fn processes_marked(marker: &str, job_var: &str) -> Vec<(i64, String)> {
    let prefix = format!("{job_var}=");
    let mut out = Vec::new();
    for pid in pids() {
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        if !vars.contains(&marker.as_bytes()) {
            continue;
        }
        let job = vars
            .iter()
            .find_map(|v| v.strip_prefix(prefix.as_bytes()))
            .map(|j| String::from_utf8_lossy(j).into_owned())
            .unwrap_or_default();
        out.push((pid, job));
    }
    out
}

/// Processes whose parent is `parent`.
pub(crate) fn children_of(parent: u32) -> Vec<u32> {
    pids()
        .filter(|&pid| stat_fields(pid).and_then(|f| f.get(1)?.parse::<u32>().ok()) == Some(parent))
        .map(|pid| pid as u32)
        .collect()
}

/// The CPUs this process may run on (its affinity).
pub fn own_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity writes into the set we own.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            let v: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
            if !v.is_empty() {
                return v;
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

/// How many CPUs this process may run on.
pub fn cpu_count() -> usize {
    own_cpus().len()
}

/// `0-3,6` from `[0, 1, 2, 3, 6]`.
pub fn cpu_list(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j { cpus[i].to_string() } else { format!("{}-{}", cpus[i], cpus[j]) });
        i = j + 1;
    }
    out.join(",")
}

/// `[0, 1, 2, 3, 6]` from `0-3,6` (what does not parse is skipped).
pub fn parse_cpu_list(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.parse::<usize>().ok()),
        }
    }
    out
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "localhost".into())
}

/// The machine's memory in bytes (`MemTotal`).
pub fn total_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()).map(|kb| kb * 1024))
        })
        .unwrap_or(1 << 30)
}

/// Bytes received and sent by the host, all interfaces (`/proc/net/dev`).
pub fn host_net_bytes() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/net/dev").ok()?;
    let (mut rx, mut tx) = (0u64, 0u64);
    for line in s.lines().skip(2) {
        let Some((_, rest)) = line.split_once(':') else { continue };
        let f: Vec<u64> = rest.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        if f.len() >= 9 {
            rx += f[0];
            tx += f[8];
        }
    }
    Some((rx, tx))
}

/// Reads at most `max` bytes of `path` from byte `from` on (clamped to its length), without reading what comes
/// before: logs and metrics files are followed by offset and grow for the whole run. Returns the bytes and the
/// file's length. A missing file is empty.
pub fn read_from(path: &Path, from: u64, max: usize) -> std::io::Result<(Vec<u8>, u64)> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    let start = from.min(len);
    f.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::with_capacity(((len - start) as usize).min(max));
    f.take(max as u64).read_to_end(&mut buf)?;
    Ok((buf, len))
}

/// The usual name of a signal, for messages.
pub fn signal_name(s: i32) -> Option<&'static str> {
    Some(match s {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return None,
    })
}

/// `exit status 3`, `killed by signal 9 (SIGKILL)`.
pub fn describe(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => {
            format!("killed by signal {s}{}", signal_name(s).map(|n| format!(" ({n})")).unwrap_or_default())
        }
        _ => format!("{status}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_round_trip() {
        for v in [vec![], vec![0], vec![0, 1, 2, 3, 6], vec![1, 3, 4, 5, 9, 10]] {
            assert_eq!(parse_cpu_list(&cpu_list(&v)), v);
        }
        assert_eq!(cpu_list(&[0, 1, 2, 3, 6]), "0-3,6");
    }

    #[test]
    fn read_from_reads_only_the_tail() -> std::io::Result<()> {
        let p = std::env::temp_dir().join(format!("shoal-read-from-{}", std::process::id()));
        std::fs::write(&p, b"0123456789")?;
        assert_eq!(read_from(&p, 4, 3)?, (b"456".to_vec(), 10));
        assert_eq!(read_from(&p, 8, 100)?, (b"89".to_vec(), 10));
        assert_eq!(read_from(&p, 50, 100)?, (Vec::new(), 10));
        std::fs::remove_file(&p)?;
        assert_eq!(read_from(&p, 0, 100)?, (Vec::new(), 0));
        Ok(())
    }

    #[test]
    fn own_process_has_a_start_time_a_session_and_a_parent() {
        let me = std::process::id() as i64;
        assert!(start_ticks(me).is_some());
        assert!(!is_zombie(me));
        let sid = session_of(me).expect("a session");
        assert!(session_alive(sid));
        assert!(session_usage(sid).is_some_and(|u| u.rss_bytes > 0));
        // SAFETY: getppid cannot fail.
        let parent = unsafe { libc::getppid() } as u32;
        assert!(children_of(parent).contains(&(me as u32)));
    }
}
