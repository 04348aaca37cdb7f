//! Physical limits of the two transports on this machine, measured in-process:
//! one-thread memcpy bandwidth (the ceiling of a shared-memory collective) and
//! loopback TCP throughput with both directions busy at once (the ceiling of the
//! TCP transport, where every rank sends and receives at the same time).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Limits {
    /// One thread, 256 MiB copy_from_slice, best of several, bytes copied once / time.
    #[serde(rename = "memcpy_1t_GBps")]
    pub memcpy_1t_gbps: f64,
    /// Loopback TCP, both directions at once: mean over the two directions.
    #[serde(rename = "tcp_bidir_per_dir_GBps")]
    pub tcp_bidir_per_dir_gbps: f64,
    #[serde(rename = "tcp_bidir_a_to_b_GBps")]
    pub tcp_bidir_a_to_b_gbps: f64,
    #[serde(rename = "tcp_bidir_b_to_a_GBps")]
    pub tcp_bidir_b_to_a_gbps: f64,
}

pub fn measure() -> Result<Limits> {
    let memcpy = memcpy_gbps(256 << 20, 10);
    let (ab, ba) = tcp_bidir_gbps(1 << 20, Duration::from_secs(2))?;
    Ok(Limits {
        memcpy_1t_gbps: memcpy,
        tcp_bidir_per_dir_gbps: (ab + ba) / 2.0,
        tcp_bidir_a_to_b_gbps: ab,
        tcp_bidir_b_to_a_gbps: ba,
    })
}

/// Best-of-`reps` single-thread copy bandwidth, GB/s (1e9 bytes), counting each byte once.
pub fn memcpy_gbps(bytes: usize, reps: usize) -> f64 {
    // Touch both buffers first so page faults are not timed.
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut dst = vec![0u8; bytes];
    dst.fill(1);
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    assert_eq!(dst[bytes - 1], src[bytes - 1]);
    bytes as f64 / best / 1e9
}

/// Two connected loopback sockets A and B; A→B and B→A streams run at the same time
/// (one writer and one reader thread per socket), `chunk`-byte writes for `dur`.
/// Returns (A→B, B→A) GB/s, each = bytes received / time to the last byte.
pub fn tcp_bidir_gbps(chunk: usize, dur: Duration) -> Result<(f64, f64)> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding loopback listener")?;
    let addr = listener.local_addr()?;
    let a = TcpStream::connect(addr).context("connecting loopback")?;
    let (b, _) = listener.accept()?;
    for s in [&a, &b] {
        s.set_nodelay(true)?;
    }
    let start = Instant::now() + Duration::from_millis(50);
    let deadline = start + dur;
    let spawn_writer = |mut s: TcpStream| {
        std::thread::spawn(move || -> std::io::Result<u64> {
            let buf = vec![0x5au8; chunk];
            while Instant::now() < start {
                std::hint::spin_loop();
            }
            let mut sent = 0u64;
            while Instant::now() < deadline {
                s.write_all(&buf)?;
                sent += chunk as u64;
            }
            s.shutdown(Shutdown::Write)?;
            Ok(sent)
        })
    };
    let spawn_reader = |mut s: TcpStream| {
        std::thread::spawn(move || -> std::io::Result<(u64, f64)> {
            let mut buf = vec![0u8; chunk];
            let mut got = 0u64;
            loop {
                let n = s.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                got += n as u64;
            }
            Ok((got, start.elapsed().as_secs_f64()))
        })
    };
    let wa = spawn_writer(a.try_clone()?);
    let wb = spawn_writer(b.try_clone()?);
    let rb = spawn_reader(b); // receives A→B
    let ra = spawn_reader(a); // receives B→A
    let join = |h: std::thread::JoinHandle<std::io::Result<u64>>| -> Result<u64> {
        h.join().map_err(|_| anyhow::anyhow!("writer thread panicked"))?.context("tcp writer")
    };
    let (sent_ab, sent_ba) = (join(wa)?, join(wb)?);
    let (got_ab, t_ab) = rb.join().map_err(|_| anyhow::anyhow!("reader panicked"))?.context("tcp reader")?;
    let (got_ba, t_ba) = ra.join().map_err(|_| anyhow::anyhow!("reader panicked"))?.context("tcp reader")?;
    anyhow::ensure!(got_ab == sent_ab && got_ba == sent_ba, "tcp byte counts differ");
    Ok((got_ab as f64 / t_ab / 1e9, got_ba as f64 / t_ba / 1e9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_measurements_run() {
        assert!(memcpy_gbps(1 << 20, 2) > 0.0);
        let (ab, ba) = tcp_bidir_gbps(64 << 10, Duration::from_millis(100)).expect("tcp");
        assert!(ab > 0.0 && ba > 0.0);
    }
}
