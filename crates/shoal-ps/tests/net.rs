//! The parameter server over real sockets: servers on loopback listeners, workers as threads with their own
//! connections, as the trainer runs them (one process each) but inside one test.

use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shoal_ps::net::{Client, Mode, Part, Persist, SPAN_BYTES, ServeReport, Server, ServerConfig, Snapshot, Span};
use shoal_ps::optim::OptimConfig;
use shoal_ps::{PsError, Result, Round, Rule, Shard};

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
const ADAMW: OptimConfig = OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
const WAIT: Duration = Duration::from_secs(20);

/// A save kept in memory, as a checkpoint directory would keep it on disk.
#[derive(Default)]
struct Kept(Mutex<Option<Snapshot>>);

impl Persist for Kept {
    fn save(&self, s: &Snapshot) -> Result<()> {
        *self.0.lock().map_err(|_| PsError::Checkpoint("poisoned".into()))? = Some(s.clone());
        Ok(())
    }
    fn load(&self) -> Result<Option<Snapshot>> {
        Ok(self.0.lock().map_err(|_| PsError::Checkpoint("poisoned".into()))?.clone())
    }
}

fn config(index: usize, servers: usize, workers: usize, mode: Mode) -> ServerConfig {
    ServerConfig {
        index,
        servers,
        workers,
        mode,
        optim: ADAMW,
        rule: Rule::Mean,
        f: 0,
        wait: WAIT,
        secret: SECRET.to_vec(),
        attack: None,
    }
}

/// Starts a server on `addr` (any free port for `127.0.0.1:0`); returns where it listens and its thread.
fn start(
    addr: &str,
    cfg: ServerConfig,
    persist: Option<Arc<dyn Persist>>,
) -> Result<(String, shoal_ps::net::Killer, std::thread::JoinHandle<Result<ServeReport>>)> {
    let listener = TcpListener::bind(addr).map_err(|e| PsError::Server(format!("binding {addr}: {e}")))?;
    let at = listener.local_addr().map_err(|e| PsError::Server(e.to_string()))?.to_string();
    let server = Server::new(listener, cfg, persist)?;
    let killer = server.killer();
    Ok((at, killer, std::thread::spawn(move || server.run())))
}

fn joined<T>(h: std::thread::JoinHandle<Result<T>>) -> Result<T> {
    h.join().map_err(|_| PsError::Server("a thread panicked".into()))?
}

/// Worker `w`'s gradient at `step` for a run of `n` values: distinct per worker and step.
fn grad(w: usize, step: u64, n: usize) -> Vec<f32> {
    (0..n).map(|j| ((w * 7 + j * 3) % 11) as f32 * 0.05 - 0.25 + step as f32 * 0.01).collect()
}

fn dense<'a>(push: Option<&'a [f32]>, pull: Option<&'a mut [f32]>) -> Part<'a> {
    Part { push, push_spans: &[], pull, pull_spans: &[] }
}

/// Synchronous mode over two servers: every step, every worker's values are what one process holding the whole
/// model makes from the sum of the workers' gradients — the values split between the servers as the plan says —
/// whether a worker's pushes and pulls go through memory shared with the servers (workers 0 and 2) or over TCP
/// (worker 1).
#[test]
fn synchronous_servers_update_as_one_process_does() -> Result<()> {
    let (workers, n) = (3usize, 10usize);
    let cut = 4;
    let start_values: Vec<f32> = (0..n).map(|j| j as f32 * 0.1 - 0.3).collect();
    let mut servers = Vec::new();
    for s in 0..2 {
        servers.push(start("127.0.0.1:0", config(s, 2, workers, Mode::Sync), None)?);
    }
    let addrs: Vec<String> = servers.iter().map(|s| s.0.clone()).collect();
    let steps = 5u64;
    let mut handles = Vec::new();
    for w in 0..workers {
        let (addrs, start_values) = (addrs.clone(), start_values.clone());
        handles.push(std::thread::spawn(move || -> Result<Vec<Vec<f32>>> {
            let c = Client::connect(addrs, w, SECRET, Mode::Sync, WAIT)?;
            let mut c = if w == 1 { c.tcp_only() } else { c };
            if w == 0 {
                let (a, b) = start_values.split_at(cut);
                c.init(false, 0, &[[a, &[], &[]], [b, &[], &[]]])?;
            }
            let mut values = vec![0f32; n];
            {
                let (a, b) = values.split_at_mut(cut);
                c.exchange(0.0, vec![dense(None, Some(a)), dense(None, Some(b))])?;
            }
            let mut seen = vec![values.clone()];
            for step in 0..steps {
                let g = grad(w, step, n);
                let (ga, gb) = g.split_at(cut);
                let (a, b) = values.split_at_mut(cut);
                c.exchange(0.01, vec![dense(Some(ga), Some(a)), dense(Some(gb), Some(b))])?;
                assert_eq!(c.versions(), &[step + 1, step + 1]);
                seen.push(values.clone());
            }
            c.done()?;
            Ok(seen)
        }));
    }
    let seen: Vec<Vec<Vec<f32>>> = handles.into_iter().map(joined).collect::<Result<_>>()?;
    for (_, _, h) in servers {
        assert_eq!(joined(h)?.version, steps);
    }
    // One process: the mean of the workers' gradients times their number, the same AdamW.
    let mut one = Shard::new(start_values, ADAMW);
    for step in 0..steps {
        let mut round = Round::new(workers, Rule::Mean, 0, step)?.scaled(workers as f32);
        for w in 0..workers {
            round.push(w, step, grad(w, step, n))?;
        }
        round.finish(&mut one, 0.01)?;
        for s in &seen {
            let got = &s[step as usize + 1];
            for (a, b) in got.iter().zip(&one.values) {
                assert!((a - b).abs() <= 1e-6, "step {step}: {a} against {b}");
            }
        }
    }
    Ok(())
}

/// Bounded staleness: with one worker slowed, no worker ever starts a step more than `staleness` ahead of the
/// slowest — and the fast ones do reach the bound; without it (`async`) they run further ahead.
#[test]
fn no_worker_computes_more_than_staleness_steps_ahead() -> Result<()> {
    let lead = |mode: Mode| -> Result<u64> {
        let (workers, n, steps) = (3usize, 6usize, 12u64);
        let (addr, _, server) = start("127.0.0.1:0", config(0, 1, workers, mode), None)?;
        let mut handles = Vec::new();
        for w in 0..workers {
            let addr = addr.clone();
            handles.push(std::thread::spawn(move || -> Result<u64> {
                let mut c = Client::connect(vec![addr], w, SECRET, mode, WAIT)?;
                if w == 0 {
                    c.init(false, 0, &[[&vec![0.5; n], &[], &[]]])?;
                }
                let mut values = vec![0f32; n];
                c.exchange(0.0, vec![dense(None, Some(&mut values))])?;
                let mut most = 0;
                for step in 0..steps {
                    // This worker's clock is `step` (its pushes so far); the servers' answer names the slowest's.
                    let ahead = step.saturating_sub(c.slowest());
                    if let Mode::Ssp { staleness } = mode {
                        assert!(ahead <= staleness, "worker {w} at step {step}, the slowest at {}", c.slowest());
                    }
                    most = most.max(ahead);
                    if w == 2 {
                        std::thread::sleep(Duration::from_millis(40));
                    }
                    let g = grad(w, step, n);
                    c.exchange(0.001, vec![dense(Some(&g), Some(&mut values))])?;
                }
                c.done()?;
                Ok(most)
            }));
        }
        let leads: Vec<u64> = handles.into_iter().map(joined).collect::<Result<_>>()?;
        joined(server)?;
        Ok(leads[..2].iter().copied().max().unwrap_or(0))
    };
    assert_eq!(lead(Mode::Ssp { staleness: 2 })?, 2, "the fast workers run to the bound and no further");
    assert!(lead(Mode::Async)? > 2, "without a bound the fast workers run further ahead");
    Ok(())
}

/// A server killed after its save and started again resumes from the save: the workers reconnect by themselves,
/// the server takes up their version, and the next update starts from the saved values and optimizer state.
#[test]
fn a_restarted_server_resumes_from_its_save() -> Result<()> {
    let (workers, n) = (2usize, 8usize);
    let kept: Arc<Kept> = Arc::default();
    let persist: Arc<dyn Persist> = kept.clone();
    let (addr, killer, first) = start("127.0.0.1:0", config(0, 1, workers, Mode::Sync), Some(persist.clone()))?;
    let barrier = Arc::new(std::sync::Barrier::new(workers + 1));
    let mut handles = Vec::new();
    for w in 0..workers {
        let (addr, barrier) = (addr.clone(), barrier.clone());
        handles.push(std::thread::spawn(move || -> Result<Vec<f32>> {
            let mut c = Client::connect(vec![addr], w, SECRET, Mode::Sync, WAIT)?;
            if w == 0 {
                c.init(false, 0, &[[&vec![0.25; n], &[], &[]]])?;
            }
            let mut values = vec![0f32; n];
            c.exchange(0.0, vec![dense(None, Some(&mut values))])?;
            for step in 0..5u64 {
                let g = grad(w, step, n);
                c.exchange(0.01, vec![dense(Some(&g), Some(&mut values))])?;
                if step == 2 && w == 0 {
                    c.checkpoint(3)?;
                }
            }
            // The server dies here and comes back; step 5 is pushed to the new one.
            barrier.wait();
            barrier.wait();
            let g = grad(w, 5, n);
            c.exchange(0.01, vec![dense(Some(&g), Some(&mut values))])?;
            assert_eq!(c.versions(), &[6]);
            c.done()?;
            Ok(values)
        }));
    }
    barrier.wait();
    killer.kill();
    assert!(joined(first).is_err(), "a killed server says it was stopped");
    let saved = kept.load()?.ok_or_else(|| PsError::Checkpoint("nothing saved".into()))?;
    assert_eq!((saved.step, saved.version), (3, 3));
    let (_, _, second) = start(&addr, config(0, 1, workers, Mode::Sync), Some(persist))?;
    barrier.wait();
    let got: Vec<Vec<f32>> = handles.into_iter().map(joined).collect::<Result<_>>()?;
    let report = joined(second)?;
    assert!(report.restored);
    assert_eq!(report.version, 6);
    // The save's values and moments, updated once by step 5's gradients.
    let mut want = Shard::with_state(saved.values, ADAMW, saved.m, saved.v, 5)?;
    let mut round = Round::new(workers, Rule::Mean, 0, 5)?.scaled(workers as f32);
    for w in 0..workers {
        round.push(w, 5, grad(w, 5, n))?;
    }
    round.finish(&mut want, 0.01)?;
    for g in &got {
        assert_eq!(g, &want.values);
    }
    Ok(())
}

/// A sparse push moves the touched rows only, and the server updates those rows and nothing else.
#[test]
fn a_sparse_push_moves_and_updates_exactly_the_touched_rows() -> Result<()> {
    let (row, rows) = (4usize, 1000usize);
    let n = row * rows;
    let (addr, _, server) = start("127.0.0.1:0", config(0, 1, 1, Mode::Async), None)?;
    let mut c = Client::connect(vec![addr], 0, SECRET, Mode::Async, WAIT)?;
    let start_values: Vec<f32> = (0..n).map(|j| (j % 13) as f32 * 0.01).collect();
    c.init(false, 0, &[[&start_values, &[], &[]]])?;
    let touched = [3usize, 4, 500, 999];
    let spans: Vec<Span> = touched.iter().map(|&r| Span { start: (r * row) as u64, len: row as u32 }).collect();
    let g: Vec<f32> = (0..touched.len() * row).map(|k| k as f32 * 0.1 + 0.05).collect();
    let mut pulled = vec![0f32; touched.len() * row];
    c.exchange(0.1, vec![Part { push: Some(&g), push_spans: &spans, pull: Some(&mut pulled), pull_spans: &spans }])?;
    // Only the touched rows' bytes, each row with its span (start and length).
    let moved = (touched.len() * row * 4) as u64 + SPAN_BYTES * touched.len() as u64;
    assert_eq!(c.bytes_pushed, moved);
    assert_eq!(c.bytes_pulled, moved);
    let mut all = vec![0f32; n];
    c.exchange(0.0, vec![dense(None, Some(&mut all))])?;
    for r in 0..rows {
        let (now, before) = (&all[r * row..(r + 1) * row], &start_values[r * row..(r + 1) * row]);
        if let Some(k) = touched.iter().position(|&t| t == r) {
            assert_eq!(now, &pulled[k * row..(k + 1) * row]);
            assert!(now.iter().zip(before).all(|(a, b)| a != b), "row {r} was touched");
        } else {
            assert_eq!(now, before, "row {r} was not touched");
        }
    }
    // Spans out of order, or past the shard, are refused naming them.
    let bad = [Span { start: (n - 2) as u64, len: 4 }];
    let e = c
        .exchange(0.1, vec![Part { push: Some(&[1.0; 4]), push_spans: &bad, pull: None, pull_spans: &[] }])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("reaches past the shard's 4000 values"), "{e}");
    c.done()?;
    joined(server)?;
    Ok(())
}

/// A worker without the job secret is refused, and a server that waits for a worker that never comes says which.
#[test]
fn strangers_are_refused_and_a_missing_worker_is_named() -> Result<()> {
    let mut cfg = config(0, 1, 2, Mode::Sync);
    cfg.wait = Duration::from_secs(2);
    let (addr, _, server) = start("127.0.0.1:0", cfg, None)?;
    let wrong = Client::connect(vec![addr.clone()], 0, b"not the secret, not the secret!!", Mode::Sync, WAIT);
    assert!(wrong.is_err(), "the wrong secret");
    let mut c = Client::connect(vec![addr], 0, SECRET, Mode::Sync, Duration::from_secs(10))?;
    c.init(false, 0, &[[&[1.0, 2.0], &[], &[]]])?;
    let mut v = [0f32; 2];
    let e =
        c.exchange(0.1, vec![dense(Some(&[0.5, 0.5]), Some(&mut v))]).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("the round still waits for workers [1]"), "{e}");
    let report = joined(server).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(report.contains("workers [0, 1] had not finished"), "{report}");
    Ok(())
}
