//! Watching running jobs through their ranks' heartbeats (sent twice a second by each worker over HTTP, tagged with
//! the job secret, [`Control::heard`]; or, with no server to send to or while it cannot be reached, written to
//! `heartbeat.rank-R.json` in the run directory; the newer counts; see `shoal_wire::Heartbeat`): a rank whose heartbeat stops changing for
//! `fault_tolerance.heartbeat_timeout` while its process runs is taken for dead; a job whose step counter does not
//! move for `fault_tolerance.hang_timeout` while every rank lives and trains is hung (a rank resuming, handing a
//! checkpoint to its saver, evaluating or finishing stops the clock: those may take long without being hangs). Either way the verdict comes
//! with a dump of every rank — the collective it is in, its sequence number and for how long, or how long it has
//! been silent — naming the ranks that hold the others up. The dump of the last hang is kept in the job's
//! directory (`hang-dump.json`) for `shoal status`; [`Control::debug_dump`] takes one on demand.
//!
//! Liveness is judged by the server's own clock (when a rank's heartbeat counter last changed), never by the
//! worker's, so clocks that disagree between hosts do not matter.

use std::time::{Duration, Instant};

use shoal_exec::TaskStatus;
use shoal_spec::JobSpec;
use shoal_wire::{HangDump, Heartbeat, RankDump};

use crate::db::{JobRow, TaskRow, TaskState};
use crate::error::Result;

use super::state::{Control, Seen, Watch};

/// A rank whose heartbeat has not changed for this long is shown as silent in a dump (four missed beats).
const SILENT: Duration = Duration::from_secs(2);

/// What the heartbeats say of a running job.
#[derive(Debug)]
pub(super) enum Verdict {
    Fine,
    /// A rank's heartbeats stopped while its process runs.
    Silent {
        why: String,
        dump: HangDump,
    },
    /// No step for the hang timeout while every rank lives.
    Hang {
        why: String,
        dump: HangDump,
    },
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn list(ranks: &[i64]) -> String {
    let words: Vec<String> = ranks.iter().map(i64::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", words[0]),
        _ => format!("ranks {}", words.join(", ")),
    }
}

impl Control {
    /// Rank `rank`'s newest heartbeat: the one it sent over HTTP or the one in its file, whichever is of the later
    /// attempt or, within one, written later.
    fn heartbeat_of(&self, id: &str, rank: i64) -> Option<Heartbeat> {
        let path = self.run_dir(id).join(format!("heartbeat.rank-{rank}.json"));
        let file: Option<Heartbeat> = std::fs::read(path).ok().and_then(|b| serde_json::from_slice(&b).ok());
        let heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        let wire = heard.get(id).and_then(|ranks| ranks.get(&rank)).cloned();
        [file, wire].into_iter().flatten().max_by_key(|hb| (hb.attempt, hb.time_ms, hb.beat))
    }

    /// A heartbeat of `job` that came over HTTP (its tag already checked): kept for the next look at the job.
    /// Returns the rank's failure report when the heartbeat is the first to carry it, for the job's events.
    pub fn heard(&self, job: &JobRow, hb: Heartbeat) -> Option<String> {
        let mut heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        let ranks = heard.entry(job.id.clone()).or_default();
        let told = ranks.get(&hb.rank).is_some_and(|b| b.error.is_some() && b.attempt == hb.attempt);
        let news = match &hb.error {
            Some(e) if !told => Some(format!("rank {} of attempt {} reports: {e}", hb.rank, hb.attempt)),
            _ => None,
        };
        // A rank that left a failed collective to regroup: the loop looks at once for the member it lost.
        let regrouping = hb.phase == "regroup" && ranks.get(&hb.rank).is_none_or(|b| b.phase != "regroup");
        let newer =
            ranks.get(&hb.rank).is_none_or(|b| (hb.attempt, hb.time_ms, hb.beat) >= (b.attempt, b.time_ms, b.beat));
        if newer {
            ranks.insert(hb.rank, hb);
        }
        drop(heard);
        if news.is_some() || regrouping {
            self.wake.notify_one();
        }
        news
    }

    /// Reads the heartbeats of `ranks` of `job`'s current attempt into its watch.
    fn refresh(&self, job: &JobRow, ranks: &[i64]) {
        let beats: Vec<(i64, Heartbeat)> = ranks
            .iter()
            .filter_map(|&r| self.heartbeat_of(&job.id, r).map(|hb| (r, hb)))
            .filter(|(_, hb)| hb.attempt == job.attempt)
            .collect();
        let at = Instant::now();
        let mut watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        let w = watched.entry(job.id.clone()).or_insert_with(|| Watch::new(job.attempt));
        if w.attempt != job.attempt {
            *w = Watch::new(job.attempt);
        }
        for (rank, hb) in beats {
            match w.ranks.get_mut(&rank) {
                Some(seen) if seen.hb.beat == hb.beat && seen.hb.pid == hb.pid => {}
                Some(seen) => {
                    seen.hb = hb;
                    seen.changed = at;
                }
                None => {
                    w.ranks.insert(rank, Seen { hb, changed: at });
                }
            }
        }
        if w.first_step.is_none() {
            w.first_step = w.ranks.values().filter(|s| s.hb.phase == "train").map(|s| s.hb.step).min();
        }
    }

    /// Where attempt `attempt` of job `id` took its state from, as its lowest rank's heartbeat says, each time that
    /// changes (else `None`): for the attempt's `resumed` events.
    pub(super) fn resume_news(&self, id: &str, attempt: i64) -> Option<String> {
        let mut watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        let w = watched.get_mut(id).filter(|w| w.attempt == attempt)?;
        let lowest = w.ranks.keys().min()?;
        let from = w.ranks.get(lowest)?.hb.resumed.clone()?;
        if w.resume_told.as_ref() == Some(&from) {
            return None;
        }
        w.resume_told = Some(from.clone());
        Some(format!("attempt {attempt} resumed from its {from}"))
    }

    /// What `train.strategy = "auto"` chose for attempt `attempt` of job `id`, as rank 0's heartbeat says, the first
    /// time it says so: for the attempt's `strategy` event.
    pub(super) fn strategy_news(&self, id: &str, attempt: i64) -> Option<String> {
        let mut watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        let w = watched.get_mut(id).filter(|w| w.attempt == attempt && !w.strategy_told)?;
        let why = w.ranks.get(&0)?.hb.strategy.clone()?;
        w.strategy_told = true;
        Some(format!("attempt {attempt}: train.strategy = \"auto\" chose {why}"))
    }

    /// Whether attempt `attempt` of job `id` completed a training step after it was first seen training.
    pub(super) fn progressed(&self, id: &str, attempt: i64) -> bool {
        let watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        watched.get(id).is_some_and(|w| w.attempt == attempt && w.first_step.is_some_and(|f| w.step > f))
    }

    /// Judges a running job (not being stopped) by its ranks' heartbeats; `statuses` are its current attempt's
    /// tasks as probed this tick.
    pub(super) fn observe(&self, job: &JobRow, spec: &JobSpec, statuses: &[(&TaskRow, TaskStatus)]) -> Verdict {
        let ranks: Vec<i64> = statuses.iter().map(|(t, _)| t.rank).collect();
        self.refresh(job, &ranks);
        let ft = &spec.fault_tolerance;
        let at = Instant::now();
        let running: Vec<(i64, bool)> = statuses.iter().map(|(t, s)| (t.rank, *s == TaskStatus::Running)).collect();
        let mut watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        let Some(w) = watched.get_mut(&job.id) else { return Verdict::Fine };
        let all_running = !running.is_empty() && running.iter().all(|(_, r)| *r);
        let all_training =
            all_running && running.iter().all(|(r, _)| w.ranks.get(r).is_some_and(|s| s.hb.phase == "train"));
        let step = w.ranks.values().map(|s| s.hb.step).max().unwrap_or(0);
        if !all_training {
            w.step_moved = None;
        } else if step > w.step || w.step_moved.is_none() {
            w.step_moved = Some(at);
        }
        w.step = w.step.max(step);

        // A rank that beat before and stopped: dead, whatever the others do.
        let silent = running
            .iter()
            .filter(|(_, r)| *r)
            .filter_map(|(rank, _)| w.ranks.get(rank).map(|s| (*rank, at.duration_since(s.changed))))
            .filter(|(_, quiet)| *quiet >= ft.heartbeat_timeout.0)
            .max_by_key(|(_, quiet)| *quiet);
        if let Some((rank, quiet)) = silent {
            let dump = build_dump(job, w, &running, at, self.db.now());
            let why = format!(
                "rank {rank} sent no heartbeat for {} (fault_tolerance.heartbeat_timeout = {}) while its process \
                 runs: taken for dead",
                secs(quiet),
                ft.heartbeat_timeout
            );
            return Verdict::Silent { why, dump };
        }
        if let Some(moved) = w.step_moved
            && at.duration_since(moved) >= ft.hang_timeout.0
        {
            let dump = build_dump(job, w, &running, at, self.db.now());
            let why = format!(
                "hang: no step completed for {} (fault_tolerance.hang_timeout = {}; step {}) while every worker lives",
                secs(at.duration_since(moved)),
                ft.hang_timeout,
                w.step
            );
            return Verdict::Hang { why, dump };
        }
        Verdict::Fine
    }

    /// A dump of `job`'s ranks now, from their newest heartbeats (`shoal debug`).
    pub async fn debug_dump(&self, job: &JobRow) -> Result<HangDump> {
        let tasks = self.db.tasks(&job.id, job.attempt).await?;
        let ranks: Vec<i64> = tasks.iter().map(|t| t.rank).collect();
        self.refresh(job, &ranks);
        let running: Vec<(i64, bool)> = tasks.iter().map(|t| (t.rank, t.state == TaskState::Running)).collect();
        let watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        let empty = Watch::new(job.attempt);
        let w = watched.get(&job.id).unwrap_or(&empty);
        Ok(build_dump(job, w, &running, Instant::now(), self.db.now()))
    }

    /// Keeps `dump` as the job's last hang dump (`hang-dump.json` in its directory, replaced atomically).
    pub(super) fn save_dump(&self, dump: &HangDump) {
        let dir = self.job_dir(&dump.job_id);
        let (tmp, path) = (dir.join(".hang-dump.json.tmp"), dir.join("hang-dump.json"));
        let written = serde_json::to_vec_pretty(dump)
            .map_err(std::io::Error::other)
            .and_then(|b| std::fs::write(&tmp, b))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::warn!(job = %dump.job_id, error = %e, path = %path.display(), "keeping the hang dump failed");
        }
    }

    /// The dump taken when the job last hung, if it did.
    pub fn hang_dump(&self, id: &str) -> Option<HangDump> {
        let bytes = std::fs::read(self.job_dir(id).join("hang-dump.json")).ok()?;
        serde_json::from_slice(&bytes).ok()
    }
}

/// Every rank of `running` (`(rank, its process runs)`) as the watch last saw it, at `at`.
fn build_dump(job: &JobRow, w: &Watch, running: &[(i64, bool)], at: Instant, now_ms: i64) -> HangDump {
    let mut ranks = Vec::with_capacity(running.len());
    for &(rank, alive) in running {
        let seen = w.ranks.get(&rank);
        let quiet = seen.map(|s| at.duration_since(s.changed));
        let mut r = RankDump {
            rank,
            state: String::new(),
            phase: seen.map_or_else(String::new, |s| s.hb.phase.clone()),
            step: seen.map_or(0, |s| s.hb.step),
            op: seen.map_or_else(String::new, |s| s.hb.op.clone()),
            seq: seen.map_or(0, |s| s.hb.seq),
            in_op: seen.is_some_and(|s| s.hb.in_op),
            op_s: 0.0,
            silent_s: quiet.map(|q| q.as_secs_f64()),
            pid: seen.map(|s| s.hb.pid),
            note: String::new(),
        };
        let last_op = if r.op.is_empty() { "no collective yet".to_owned() } else { format!("{} #{}", r.op, r.seq) };
        match (alive, seen, quiet) {
            (false, _, _) => {
                r.state = "exited".into();
                r.note = "its process has ended".into();
            }
            (true, None, _) | (true, _, None) => {
                r.state = "unknown".into();
                r.note = "no heartbeat yet (starting)".into();
            }
            (true, Some(s), Some(q)) if q >= SILENT => {
                r.state = "silent".into();
                r.op_s = s.hb.op_s;
                let where_ = if s.hb.in_op {
                    format!("in {last_op} for {:.1} s", s.hb.op_s)
                } else {
                    format!("after {last_op}")
                };
                r.note = format!(
                    "no heartbeat for {} (stopped, descheduled or stuck outside the runtime); last seen at step {}, \
                     {where_}",
                    secs(q),
                    s.hb.step
                );
            }
            (true, Some(s), Some(q)) => {
                r.op_s = s.hb.op_s + q.as_secs_f64();
                if s.hb.in_op {
                    r.state = "in_collective".into();
                    r.note = format!("in {last_op} for {:.1} s (step {})", r.op_s, s.hb.step);
                } else {
                    r.state = "computing".into();
                    r.note = format!("computing for {:.1} s since {last_op} (step {})", r.op_s, s.hb.step);
                }
            }
        }
        ranks.push(r);
    }
    // The collective the others wait in: the newest one any live rank is inside.
    let waited =
        ranks.iter().filter(|r| r.state == "in_collective").max_by_key(|r| r.seq).map(|r| (r.op.clone(), r.seq));
    let silent: Vec<i64> = ranks.iter().filter(|r| r.state == "silent").map(|r| r.rank).collect();
    let (culprits, summary) = match &waited {
        Some((op, seq)) => {
            let waiting: Vec<&RankDump> =
                ranks.iter().filter(|r| r.state == "in_collective" && r.seq == *seq).collect();
            let longest = waiting.iter().map(|r| r.op_s).fold(0.0, f64::max);
            let missing: Vec<&RankDump> = ranks.iter().filter(|r| !waiting.iter().any(|x| x.rank == r.rank)).collect();
            let culprits: Vec<i64> = missing.iter().map(|r| r.rank).collect();
            let waiting_ranks: Vec<i64> = waiting.iter().map(|r| r.rank).collect();
            let verb = if waiting_ranks.len() == 1 { "waits" } else { "wait" };
            let mut s = format!("{} {verb} in {op} #{seq} (for up to {longest:.1} s)", list(&waiting_ranks));
            if missing.is_empty() {
                s.push_str("; every rank is in it");
            } else {
                let why: Vec<String> = missing.iter().map(|r| format!("rank {}: {}", r.rank, r.note)).collect();
                s.push_str(&format!("; not in it: {}", why.join("; ")));
            }
            (culprits, s)
        }
        None if !silent.is_empty() => {
            let why: Vec<String> =
                ranks.iter().filter(|r| r.state == "silent").map(|r| format!("rank {}: {}", r.rank, r.note)).collect();
            (silent, why.join("; "))
        }
        None => (Vec::new(), format!("no rank waits in a collective (step {})", w.step)),
    };
    HangDump {
        job_id: job.id.clone(),
        attempt: job.attempt,
        time_ms: now_ms,
        step: w.step,
        stalled_s: w.step_moved.map(|m| at.duration_since(m).as_secs_f64()),
        culprits,
        summary,
        ranks,
    }
}

/// A dump in words, one rank after another, for events.
pub(super) fn dump_text(d: &HangDump) -> String {
    let ranks: Vec<String> = d.ranks.iter().map(|r| format!("rank {}: {}", r.rank, r.note)).collect();
    format!("{}. Ranks: {}", d.summary, ranks.join("; "))
}
