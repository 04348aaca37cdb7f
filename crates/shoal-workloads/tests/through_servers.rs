//! The workloads trained through real parameter servers: servers on threads listening on loopback TCP, workers on
//! threads, each with its own authenticated connections (and the shared memory a server on the same host offers).

use std::net::TcpListener;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use shoal_ps::net::{Client, Server, ServerConfig};
use shoal_ps::optim::OptimConfig;
use shoal_ps::{Mode, Rule};
use shoal_workloads::a3c::{self, A3cConfig, Window};
use shoal_workloads::clicks::{ClickConfig, Clicks, Split};
use shoal_workloads::recommender::{self, RecConfig, Recommender};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
/// Servers' addresses and threads (each ends with its shard's version).
type Servers = (Vec<String>, Vec<JoinHandle<Res<u64>>>);

const SECRET: &[u8] = b"workloads-test-secret";

/// `n` servers for `workers` workers, with AdamW; their addresses and threads.
fn servers(n: usize, workers: usize, mode: Mode) -> Res<Servers> {
    let mut addrs = Vec::new();
    let mut handles = Vec::new();
    for index in 0..n {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        addrs.push(listener.local_addr()?.to_string());
        let cfg = ServerConfig {
            index,
            servers: n,
            workers,
            mode,
            optim: OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
            rule: Rule::Mean,
            f: 0,
            wait: Duration::from_secs(60),
            secret: SECRET.to_vec(),
            attack: None,
        };
        let server = Server::new(listener, cfg, None)?;
        handles.push(std::thread::spawn(move || -> Res<u64> { Ok(server.run()?.version) }));
    }
    Ok((addrs, handles))
}

fn client(addrs: &[String], worker: usize, mode: Mode) -> Res<Client> {
    Ok(Client::connect(addrs.to_vec(), worker, SECRET, mode, Duration::from_secs(60))?)
}

fn join<T>(h: JoinHandle<Res<T>>) -> Res<T> {
    h.join().map_err(|_| "a thread panicked")?
}

fn rec_config() -> RecConfig {
    RecConfig {
        clicks: ClickConfig { users: 100_000, items: 10_000, ..ClickConfig::default() },
        batch: 256,
        steps: 600,
        eval: 20_000,
        ..RecConfig::default()
    }
}

/// Two workers, two servers, each mode: the loss falls, the held-out AUC nears the planted model's, and the
/// pushes move little more than the rows the batches touched.
fn recommender_in(mode: Mode) -> Res<()> {
    let cfg = rec_config();
    let (addrs, servers) = servers(2, 2, mode)?;
    let workers: Vec<JoinHandle<Res<_>>> = (0..2)
        .map(|w| {
            let addrs = addrs.clone();
            std::thread::spawn(move || -> Res<_> {
                let mut c = client(&addrs, w, mode)?;
                let out = recommender::train(&mut c, &cfg, w, 2)?;
                c.done()?;
                Ok(out)
            })
        })
        .collect();
    let mut outs = Vec::new();
    for w in workers {
        outs.push(join(w)?);
    }
    for s in servers {
        join(s)?;
    }
    let (report, params) = &outs[0];
    let eval = recommender::evaluate(&cfg, params)?;
    eprintln!("{mode:?}: {report:?}\n{eval:?}");
    assert!(report.loss_last < report.loss_first - 0.02, "{report:?}");
    assert!(eval.auc > eval.planted_auc - 0.05, "{eval:?}");
    // The rows pushed (with their spans) against the rows touched; the top network goes whole besides.
    let rows = (report.push_bytes - report.top_bytes) as f64 / report.touched_bytes as f64;
    assert!(rows > 1.0 && rows < 1.3, "pushed rows / touched rows = {rows}: {report:?}");
    assert!(report.push_bytes < report.model_bytes * report.steps as u64 / 100, "{report:?}");
    Ok(())
}

#[test]
fn recommender_async() -> Res<()> {
    recommender_in(Mode::Async)
}

#[test]
fn recommender_sync() -> Res<()> {
    recommender_in(Mode::Sync)
}

/// Actors against one server in the asynchronous mode until solved.
fn a3c_with(actors: usize, cfg: A3cConfig) -> Res<(Window, Vec<a3c::ActorReport>)> {
    let (addrs, servers) = servers(1, actors, Mode::Async)?;
    let window = Arc::new(Window::default());
    let handles: Vec<JoinHandle<Res<_>>> = (0..actors)
        .map(|a| {
            let (addrs, window) = (addrs.clone(), window.clone());
            std::thread::spawn(move || -> Res<_> {
                let mut c = client(&addrs, a, Mode::Async)?;
                let r = a3c::act(&mut c, &cfg, a, window.as_ref())?;
                c.done()?;
                Ok(r)
            })
        })
        .collect();
    let mut reports = Vec::new();
    for h in handles {
        reports.push(join(h)?);
    }
    for s in servers {
        join(s)?;
    }
    let window = Arc::try_unwrap(window).map_err(|_| "the window is still shared")?;
    Ok((window, reports))
}

#[test]
fn a3c_actors_learn_to_balance() -> Res<()> {
    let cfg = A3cConfig { max_seconds: 60.0, ..A3cConfig::default() };
    let (window, reports) = a3c_with(2, cfg)?;
    let (episodes, solved) = window.result();
    eprintln!("{episodes} episodes, solved {solved:?}, last mean {}: {reports:?}", window.mean());
    assert!(solved.is_some() || window.mean() > 100.0, "{reports:?}");
    Ok(())
}

/// One worker, one step, one server: the server changed exactly the rows the batch touched and the top network,
/// and no other value.
#[test]
fn a_sparse_push_updates_exactly_the_touched_rows() -> Res<()> {
    let cfg = RecConfig {
        clicks: ClickConfig { users: 2_000, items: 300, ..ClickConfig::default() },
        batch: 16,
        steps: 1,
        ..RecConfig::default()
    };
    let (addrs, servers) = servers(1, 1, Mode::Sync)?;
    let mut c = client(&addrs, 0, Mode::Sync)?;
    let (report, after) = recommender::train(&mut c, &cfg, 0, 1)?;
    c.done()?;
    for s in servers {
        assert_eq!(join(s)?, 1, "one update");
    }
    let model = Recommender::new(&cfg)?;
    let before = model.init(cfg.clicks.seed);
    let clicks = Clicks::new(cfg.clicks)?;
    let batch: Vec<_> = (0..16).map(|i| clicks.get(Split::Train, i)).collect();
    let (_, grads) = model.loss_and_grads(&before, &batch)?;
    let mut expected = vec![false; before.len()];
    for (start, len) in model.runs(&grads.users, &grads.items) {
        expected[start..start + len].iter_mut().for_each(|e| *e = true);
    }
    let changed: Vec<bool> = before.iter().zip(&after).map(|(a, b)| a != b).collect();
    assert_eq!(changed, expected);
    // Pushed: those rows and the top network, with one 12-byte span each (the top network's is one span).
    let runs = grads.users.len() + grads.items.len() + 1;
    assert_eq!(report.push_bytes, grads.values.len() as u64 * 4 + 12 * runs as u64);
    Ok(())
}
