//! Building a communicator from the environment contract that Shoal's launcher
//! (and later its executors) give every task:
//!
//! | variable | meaning |
//! |---|---|
//! | `SHOAL_RANK`, `SHOAL_WORLD_SIZE` | this task's rank and the number of ranks |
//! | `SHOAL_RENDEZVOUS` | `host:port` of the rendezvous store |
//! | `SHOAL_JOB_SECRET` | the job secret (every connection proves it holds it) |
//! | `SHOAL_JOB_ID` | names the job's communicators |
//! | `SHOAL_TRANSPORT`, `SHOAL_ALGO` | optional: `auto`/`tcp`/`shm`, `auto`/`ring`/`tree`/`hier` |
//! | `SHOAL_TIMEOUT` | optional: per-operation limit, e.g. `30s`, `500ms`, `2m` |
//! | `SHOAL_FAULT_COMM_DELAY` | fault injection: every collective first sleeps this long (e.g. `20ms`), to test diagnosis |
//! | `SHOAL_HOST_ID` | optional: overrides the host identity (tests of multi-host layouts) |
//! | `SHOAL_RENDEZVOUS_HOST` | optional: `1` makes rank 0 host the store at `SHOAL_RENDEZVOUS` itself (for launchers that start no store, e.g. `srun` or `mpirun`) |

use std::sync::Arc;
use std::time::Duration;

use crate::comm::{CommConfig, Communicator};
use crate::error::{Error, Result};
use crate::store::{Store, TcpStore};

/// Parses `30s`, `500ms`, `2m`, `1h` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let v: f64 =
        num.parse().map_err(|_| Error::InvalidArgument(format!("bad duration {s:?} (e.g. 30s, 500ms, 2m)")))?;
    let secs = match unit.trim() {
        "" | "s" => v,
        "ms" => v / 1e3,
        "us" => v / 1e6,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        u => return Err(Error::InvalidArgument(format!("bad duration unit {u:?} in {s:?} (use ms, s, m or h)"))),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(Error::InvalidArgument(format!("bad duration {s:?}")));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn var(name: &str) -> Result<String> {
    std::env::var(name).map_err(|_| {
        Error::InvalidArgument(format!(
            "environment variable {name} is not set (is this process started by `shoal run`?)"
        ))
    })
}

fn var_usize(name: &str) -> Result<usize> {
    let v = var(name)?;
    v.parse().map_err(|_| Error::InvalidArgument(format!("{name}={v:?} is not a non-negative integer")))
}

/// The parts of the environment contract a communicator needs.
#[derive(Debug, Clone)]
pub struct EnvContract {
    pub rank: usize,
    pub world_size: usize,
    pub rendezvous: String,
    /// Rank 0 hosts the store itself (`SHOAL_RENDEZVOUS_HOST=1`).
    pub host_store: bool,
    pub cfg: CommConfig,
}

impl EnvContract {
    /// Reads the contract from the process environment.
    pub fn from_env() -> Result<EnvContract> {
        let rank = var_usize("SHOAL_RANK")?;
        let world_size = var_usize("SHOAL_WORLD_SIZE")?;
        let rendezvous = var("SHOAL_RENDEZVOUS")?;
        let mut cfg = CommConfig { secret: var("SHOAL_JOB_SECRET")?.into_bytes(), ..CommConfig::default() };
        if let Ok(job) = std::env::var("SHOAL_JOB_ID") {
            cfg.name = format!("{job}/world");
        }
        if let Ok(t) = std::env::var("SHOAL_TRANSPORT") {
            cfg.transport = t.parse().map_err(|e| Error::InvalidArgument(format!("SHOAL_TRANSPORT: {e}")))?;
        }
        if let Ok(a) = std::env::var("SHOAL_ALGO") {
            cfg.algo = a.parse().map_err(|e| Error::InvalidArgument(format!("SHOAL_ALGO: {e}")))?;
        }
        if let Ok(t) = std::env::var("SHOAL_TIMEOUT") {
            cfg.timeout = parse_duration(&t).map_err(|e| Error::InvalidArgument(format!("SHOAL_TIMEOUT: {e}")))?;
        }
        if let Ok(t) = std::env::var("SHOAL_FAULT_COMM_DELAY") {
            cfg.fault_delay =
                parse_duration(&t).map_err(|e| Error::InvalidArgument(format!("SHOAL_FAULT_COMM_DELAY: {e}")))?;
        }
        if let Ok(h) = std::env::var("SHOAL_HOST_ID") {
            cfg.host_id = Some(h);
        }
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "SHOAL_RANK={rank} is not below SHOAL_WORLD_SIZE={world_size}"
            )));
        }
        let host_store = std::env::var("SHOAL_RENDEZVOUS_HOST").is_ok_and(|v| v == "1");
        Ok(EnvContract { rank, world_size, rendezvous, host_store, cfg })
    }

    /// Connects to the rendezvous store and builds the world communicator. With
    /// `SHOAL_RENDEZVOUS_HOST=1`, rank 0 first starts the store in this process;
    /// it serves until the process exits.
    pub fn connect(self) -> Result<Communicator> {
        if self.rank == 0 && self.host_store {
            static HOSTED: std::sync::Mutex<Vec<crate::store::StoreServer>> = std::sync::Mutex::new(Vec::new());
            let server = crate::store::StoreServer::bind(self.rendezvous.as_str(), self.cfg.secret.clone())?;
            if let Ok(mut h) = HOSTED.lock() {
                h.push(server);
            }
        }
        let store: Arc<dyn Store> = Arc::new(TcpStore::connect(&self.rendezvous, &self.cfg.secret, self.cfg.timeout)?);
        Communicator::init(store, self.rank, self.world_size, self.cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_zero_can_host_the_store() {
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(0);
        let hs: Vec<_> = (0..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    let cfg = CommConfig {
                        secret: b"hosted".to_vec(),
                        transport: crate::TransportChoice::Tcp,
                        timeout: Duration::from_secs(20),
                        ..CommConfig::default()
                    };
                    let env = EnvContract {
                        rank,
                        world_size: 3,
                        rendezvous: format!("127.0.0.1:{port}"),
                        host_store: rank == 0,
                        cfg,
                    };
                    let c = env.connect()?;
                    let mut v = vec![rank as i32; 5];
                    c.all_reduce(&mut v, crate::ReduceOp::Sum)?;
                    Ok::<_, Error>(v)
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().ok().and_then(|r| r.ok()), Some(vec![3; 5]));
        }
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("30s").ok(), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms").ok(), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m").ok(), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("7").ok(), Some(Duration::from_secs(7)));
        assert!(parse_duration("abc").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}
