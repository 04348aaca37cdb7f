//! `shoal debug` (a running job's ranks now: the collective each is in, its sequence number and time in it) and
//! `shoal chaos` (a random worker of a running job killed or stopped at an interval, through the server, so that it
//! works on every executor).

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Args;
use serde_json::json;
use shoal_wire::{ChaosAction, ChaosDone, ChaosRequest, HangDump, JobDetail, JobState, TaskState};

use crate::platform::{Client, ClientArgs};

/// `shoal debug ID`.
pub fn debug(client: &Client, id: &str, json_out: bool) -> Result<bool> {
    let path = format!("/api/v1/jobs/{id}/debug");
    if json_out {
        println!("{}", serde_json::to_string_pretty(&client.get(&path)?)?);
        return Ok(true);
    }
    let d: HangDump = client.get_as(&path)?;
    print_dump(&d);
    Ok(true)
}

/// A dump in lines: the summary, then one line per rank.
fn print_dump(d: &HangDump) {
    let stalled = d.stalled_s.map_or(String::new(), |s| format!(", step counter still for {s:.1} s"));
    println!("{} attempt {}: step {}{stalled}", d.job_id, d.attempt, d.step);
    println!("  {}", d.summary);
    if !d.culprits.is_empty() {
        let ranks: Vec<String> = d.culprits.iter().map(i64::to_string).collect();
        println!("  holding the others up: rank {}", ranks.join(", rank "));
    }
    println!("  {:<5} {:<8} {:<14} {:<8} WHERE", "RANK", "PID", "STATE", "STEP");
    for r in &d.ranks {
        println!(
            "  {:<5} {:<8} {:<14} {:<8} {}",
            r.rank,
            r.pid.map_or("-".into(), |p| p.to_string()),
            r.state,
            r.step,
            r.note
        );
    }
}

/// `shoal chaos`'s options.
#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// The running job.
    pub id: String,
    /// Hit a random running worker this often (30s, 500ms, 2m); the first after one interval.
    #[arg(long, value_parser = duration)]
    pub kill_every: Duration,
    /// Stop after this long (default: when the job ends).
    #[arg(long = "for", value_parser = duration)]
    pub for_: Option<Duration>,
    /// Seed of the choice of workers (default: from the clock, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// SIGSTOP the worker (a hang) instead of SIGKILL (a crash).
    #[arg(long)]
    pub stop: bool,
    /// One JSON object per line: each fault (the server's answer and `elapsed_s`), each skip, and the end.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

fn duration(s: &str) -> Result<Duration, String> {
    let d = shoal_comm::env::parse_duration(s).map_err(|e| e.to_string())?;
    if d < Duration::from_millis(100) {
        return Err(format!("{s:?} is too short: at least 100ms"));
    }
    Ok(d)
}

/// SplitMix64: the same workers for the same seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z % n.max(1) as u64) as usize
    }
}

/// `shoal chaos ID --kill-every D [--for D] [--seed S] [--stop]`.
pub fn chaos(a: &ChaosArgs) -> Result<bool> {
    let client = Client::from_args(&a.client)?;
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
    });
    let mut rng = Rng(seed);
    let action = if a.stop { ChaosAction::Stop } else { ChaosAction::Kill };
    let job_path = format!("/api/v1/jobs/{}", a.id);
    let chaos_path = format!("/api/v1/jobs/{}/chaos", a.id);
    // The job must exist (and be visible) before the first interval is waited out.
    let first: JobDetail = client.get_as(&job_path)?;
    if first.job.state.is_final() {
        bail!("job {} already {}", a.id, first.job.state.as_str());
    }
    let started = Instant::now();
    let say = |line: String, value: serde_json::Value| {
        if a.json {
            println!("{value}");
        } else {
            println!("[{:>7.1}s] {line}", started.elapsed().as_secs_f64());
        }
    };
    let every = a.kill_every;
    let how = match action {
        ChaosAction::Kill => "killing",
        ChaosAction::Stop => "stopping",
    };
    say(
        format!("{how} a random worker of {} every {every:?}; seed {seed}", a.id),
        json!({"start": true, "job_id": a.id, "action": action, "every_s": every.as_secs_f64(), "seed": seed}),
    );
    let mut injected = 0usize;
    let mut n = 0u32;
    let end_state = loop {
        n += 1;
        let due = started + every.saturating_mul(n);
        if a.for_.is_some_and(|f| due > started + f) {
            break None;
        }
        // Wait for the next fault, noticing meanwhile a job that ended.
        let mut ended = None;
        while Instant::now() < due {
            std::thread::sleep((due - Instant::now()).min(Duration::from_secs(1)));
            let d: JobDetail = client.get_as(&job_path)?;
            if d.job.state.is_final() {
                ended = Some(d.job.state);
                break;
            }
        }
        if ended.is_some() {
            break ended;
        }
        let d: JobDetail = client.get_as(&job_path)?;
        if d.job.state.is_final() {
            break Some(d.job.state);
        }
        let running: Vec<i64> = d
            .workers
            .iter()
            .filter(|w| w.state == TaskState::Running && w.attempt == d.job.attempt)
            .map(|w| w.rank)
            .collect();
        if d.job.state != JobState::Running || running.is_empty() {
            let why = format!("job {} is {} with no running worker: nothing to hit this time", a.id, d.job.state);
            say(why.clone(), json!({"skipped": why, "elapsed_s": started.elapsed().as_secs_f64()}));
            continue;
        }
        let rank = running[rng.below(running.len())];
        let body = serde_json::to_vec(&ChaosRequest { action, rank })?;
        match client.post_as::<ChaosDone>(&chaos_path, "application/json", &body) {
            Ok(done) => {
                injected += 1;
                let mut v = serde_json::to_value(&done)?;
                v["elapsed_s"] = json!(started.elapsed().as_secs_f64());
                say(done.message.clone(), v);
            }
            // The job may have moved on between the look and the request (its gang restarting).
            Err(e) => {
                let why = format!("rank {rank} not hit: {e:#}");
                say(why.clone(), json!({"skipped": why, "elapsed_s": started.elapsed().as_secs_f64()}));
            }
        }
    };
    let state = end_state.map_or("still running".to_owned(), |s| format!("ended {s}"));
    say(
        format!("{injected} faults injected in {:.1} s; job {} {state}", started.elapsed().as_secs_f64(), a.id),
        json!({"done": true, "faults": injected, "elapsed_s": started.elapsed().as_secs_f64(),
               "job_state": end_state.map(JobState::as_str)}),
    );
    Ok(true)
}
