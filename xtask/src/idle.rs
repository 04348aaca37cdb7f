//! Waiting for the machine to be idle before a measurement, from /proc/stat.

use std::time::{Duration, Instant};

/// Aggregate CPU counters: (idle + iowait, total) in clock ticks.
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    parse_cpu_line(stat.lines().next()?)
}

fn parse_cpu_line(line: &str) -> Option<(u64, u64)> {
    let mut it = line.split_whitespace();
    if it.next()? != "cpu" {
        return None;
    }
    // user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    let v: Vec<u64> = it.take(8).map(|x| x.parse().ok()).collect::<Option<_>>()?;
    if v.len() < 5 {
        return None;
    }
    Some((v[3] + v[4], v.iter().sum()))
}

/// Fraction of CPU time idle over the next `window`.
pub fn idle_fraction(window: Duration) -> Option<f64> {
    let (i0, t0) = cpu_ticks()?;
    std::thread::sleep(window);
    let (i1, t1) = cpu_ticks()?;
    let dt = t1.saturating_sub(t0);
    (dt > 0).then(|| i1.saturating_sub(i0) as f64 / dt as f64)
}

/// Outcome of waiting for an idle machine.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct IdleWait {
    pub reached: bool,
    pub idle: f64,
    pub waited_s: f64,
}

/// Samples 1 s windows until one is at least `min_idle` idle, for at most `max_wait`.
pub fn wait_idle(min_idle: f64, max_wait: Duration) -> IdleWait {
    let t = Instant::now();
    loop {
        let Some(last) = idle_fraction(Duration::from_secs(1)) else {
            return IdleWait { reached: true, idle: f64::NAN, waited_s: 0.0 }; // no /proc/stat
        };
        if last >= min_idle {
            return IdleWait { reached: true, idle: last, waited_s: t.elapsed().as_secs_f64() };
        }
        if t.elapsed() >= max_wait {
            return IdleWait { reached: false, idle: last, waited_s: t.elapsed().as_secs_f64() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cpu_line() {
        let l = "cpu  100 5 50 800 20 1 2 3 0 0";
        assert_eq!(parse_cpu_line(l), Some((820, 981)));
        assert_eq!(parse_cpu_line("cpu0 1 2 3 4 5"), None);
    }
}
