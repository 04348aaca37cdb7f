//! Job traces: Shoal's own CSV and the Alibaba GPU cluster trace (2023, `openb_pod_list`), told apart by their
//! header row.
//!
//! Shoal's CSV: `job_id,submit_s,duration_s,gpus,gpu_milli,cpus,memory_mib,team` and optionally
//! `priority,queue,min_workers,max_workers`, in any order. A job is a gang of `min_workers..=max_workers`
//! identical tasks (1 and 1 when absent); each task takes `gpus` GPUs (a whole number), each of them at
//! `gpu_milli` thousandths (empty: 1000). A share below 1000 only with `gpus = 1` — a fraction of one GPU, as in
//! the Alibaba trace, whose `num_gpu` and `gpu_milli` mean the same. `cpus` are cores (decimals allowed) per
//! task, `memory_mib` MiB per task; `submit_s` and `duration_s` seconds (decimals allowed). `duration_s` is the
//! run time at `min_workers` tasks; with more tasks it runs proportionally faster. `priority` (default 0):
//! higher first, may preempt lower; `queue` (default `default`): every queue of a trace may use the whole
//! cluster. Unknown columns are refused naming them; a bad row with its line number.
//!
//! The Alibaba trace: `name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,
//! deletion_time,scheduled_time` (times in seconds). A pod is a one-task job submitted at `creation_time` that
//! runs for `deletion_time - scheduled_time`; its team is its `qos` class. Pods never scheduled in the real
//! cluster (no `scheduled_time` or `deletion_time`) are skipped and counted. `gpu_spec` (a constraint on GPU
//! models) is not modelled.

use std::fmt::Write as _;
use std::path::Path;

use shoal_sched::Resources;

use crate::csv::{Row, Table};
use crate::error::{Result, SimError, read};

const MIB: u64 = 1 << 20;

/// One job of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceJob {
    /// Unique id.
    pub id: String,
    /// Submission time.
    pub submit_ms: u64,
    /// Run time at `tasks_min` tasks.
    pub duration_ms: u64,
    /// What each task asks for.
    pub per_task: Resources,
    /// Fewest tasks it runs with.
    pub tasks_min: u32,
    /// Most tasks it grows to.
    pub tasks_max: u32,
    /// Team, for fair share.
    pub team: String,
    /// Queue.
    pub queue: String,
    /// Priority (higher first).
    pub priority: i32,
}

/// Which format a trace was read in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    /// Shoal's CSV.
    Shoal,
    /// The Alibaba 2023 GPU trace's pod list.
    Alibaba,
}

/// A parsed trace, jobs in order of submission (then of their line).
#[derive(Debug, Clone)]
pub struct Trace {
    /// The file's name.
    pub name: String,
    /// Its format.
    pub format: TraceFormat,
    /// The jobs.
    pub jobs: Vec<TraceJob>,
    /// Rows skipped (Alibaba pods that never ran).
    pub skipped: usize,
}

const SHOAL_REQUIRED: [&str; 8] =
    ["job_id", "submit_s", "duration_s", "gpus", "gpu_milli", "cpus", "memory_mib", "team"];
const SHOAL_OPTIONAL: [&str; 4] = ["priority", "queue", "min_workers", "max_workers"];
const ALIBABA_REQUIRED: [&str; 8] =
    ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "creation_time", "deletion_time", "scheduled_time"];
const ALIBABA_OPTIONAL: [&str; 3] = ["gpu_spec", "qos", "pod_phase"];

/// Reads a trace file.
pub fn read_trace(path: &Path) -> Result<Trace> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string());
    parse_trace(&name, &read(path)?)
}

/// Parses a trace; `name` names it in errors.
pub fn parse_trace(name: &str, text: &str) -> Result<Trace> {
    let table = Table::parse(name, text)?;
    let (format, jobs, skipped) = if table.header.contains(&"job_id") {
        let (jobs, skipped) = shoal_rows(&table)?;
        (TraceFormat::Shoal, jobs, skipped)
    } else if table.header.contains(&"num_gpu") {
        let (jobs, skipped) = alibaba_rows(&table)?;
        (TraceFormat::Alibaba, jobs, skipped)
    } else {
        return Err(SimError::Format {
            file: name.to_owned(),
            why: format!(
                "a trace's header starts Shoal's {} or the Alibaba trace's {}",
                SHOAL_REQUIRED.join(","),
                ALIBABA_REQUIRED.join(",")
            ),
        });
    };
    let mut seen = std::collections::HashSet::new();
    for (line, j) in &jobs {
        if !seen.insert(j.id.as_str()) {
            return Err(SimError::Row {
                file: name.to_owned(),
                line: *line,
                column: if format == TraceFormat::Shoal { "job_id" } else { "name" }.into(),
                message: format!("{} appears twice", j.id),
            });
        }
    }
    let mut jobs = jobs;
    jobs.sort_by_key(|(line, j)| (j.submit_ms, *line));
    Ok(Trace { name: name.to_owned(), format, jobs: jobs.into_iter().map(|(_, j)| j).collect(), skipped })
}

/// A task's GPUs from a count and a share of each, as both formats give them.
fn gpus_of(row: &Row<'_, '_>, count_col: &str, share_col: &str, count: u64, share: Option<u64>) -> Result<u64> {
    match (count, share) {
        (0, None | Some(0)) => Ok(0),
        (0, Some(s)) => Err(row.error(share_col, format!("{s} thousandths of a GPU with {count_col} = 0"))),
        (_, Some(s)) if s == 0 || s > 1000 => Err(row.error(share_col, format!("must be 1 to 1000: '{s}'"))),
        (1, s) => Ok(s.unwrap_or(1000)),
        (n, None | Some(1000)) => Ok(n * 1000),
        (n, Some(s)) => Err(row.error(share_col, format!("a share of {s} below 1000 needs {count_col} = 1, not {n}"))),
    }
}

fn shoal_rows(t: &Table<'_>) -> Result<(Vec<(usize, TraceJob)>, usize)> {
    let c = t.columns(&SHOAL_REQUIRED, &SHOAL_OPTIONAL)?;
    let mut out = Vec::with_capacity(t.rows.len());
    for (line, fields) in &t.rows {
        let row = Row { file: t.file, line: *line, fields };
        let id = row.text(c[0]);
        if id.is_empty() {
            return Err(row.error("job_id", "empty"));
        }
        let count = row.uint("gpus", c[3], None)?;
        let share = if row.text(c[4]).is_empty() { None } else { Some(row.uint("gpu_milli", c[4], None)?) };
        let gpus_milli = gpus_of(&row, "gpus", "gpu_milli", count, share)?;
        let min = row.uint("min_workers", c[10], Some(1))?;
        let max = row.uint("max_workers", c[11], Some(min))?;
        if min == 0 || min > u32::MAX as u64 {
            return Err(row.error("min_workers", format!("must be at least 1: '{min}'")));
        }
        if max < min || max > u32::MAX as u64 {
            return Err(row.error("max_workers", format!("{max} is below min_workers ({min})")));
        }
        let priority = row.int("priority", c[8], 0)?;
        let priority =
            i32::try_from(priority).map_err(|_| row.error("priority", format!("out of range: '{priority}'")))?;
        let team = row.text(c[7]);
        let queue = row.text(c[9]);
        out.push((
            *line,
            TraceJob {
                id: id.to_owned(),
                submit_ms: row.scaled("submit_s", c[1], 1000.0)?,
                duration_ms: row.scaled("duration_s", c[2], 1000.0)?,
                per_task: Resources {
                    cpus_milli: row.scaled("cpus", c[5], 1000.0)?,
                    memory_bytes: row.uint("memory_mib", c[6], None)?.saturating_mul(MIB),
                    gpus_milli,
                    gpu_memory_bytes: 0,
                },
                tasks_min: min as u32,
                tasks_max: max as u32,
                team: if team.is_empty() { "default".into() } else { team.to_owned() },
                queue: if queue.is_empty() { "default".into() } else { queue.to_owned() },
                priority,
            },
        ));
    }
    Ok((out, 0))
}

fn alibaba_rows(t: &Table<'_>) -> Result<(Vec<(usize, TraceJob)>, usize)> {
    let c = t.columns(&ALIBABA_REQUIRED, &ALIBABA_OPTIONAL)?;
    let mut out = Vec::with_capacity(t.rows.len());
    let mut skipped = 0;
    for (line, fields) in &t.rows {
        let row = Row { file: t.file, line: *line, fields };
        let id = row.text(c[0]);
        if id.is_empty() {
            return Err(row.error("name", "empty"));
        }
        let created = row.uint("creation_time", c[5], None)?;
        if row.text(c[6]).is_empty() || row.text(c[7]).is_empty() {
            skipped += 1;
            continue;
        }
        let deleted = row.uint("deletion_time", c[6], None)?;
        let scheduled = row.uint("scheduled_time", c[7], None)?;
        if deleted < scheduled {
            return Err(row.error("deletion_time", format!("{deleted} is before scheduled_time ({scheduled})")));
        }
        let count = row.uint("num_gpu", c[3], None)?;
        let share = row.uint("gpu_milli", c[4], Some(0))?;
        let gpus_milli = gpus_of(&row, "num_gpu", "gpu_milli", count, if count == 0 { None } else { Some(share) })?;
        let qos = row.text(c[9]);
        out.push((
            *line,
            TraceJob {
                id: id.to_owned(),
                submit_ms: created.saturating_mul(1000),
                duration_ms: (deleted - scheduled).saturating_mul(1000),
                per_task: Resources {
                    cpus_milli: row.uint("cpu_milli", c[1], None)?,
                    memory_bytes: row.uint("memory_mib", c[2], None)?.saturating_mul(MIB),
                    gpus_milli,
                    gpu_memory_bytes: 0,
                },
                tasks_min: 1,
                tasks_max: 1,
                team: if qos.is_empty() { "none".into() } else { qos.to_owned() },
                queue: "default".into(),
                priority: 0,
            },
        ));
    }
    Ok((out, skipped))
}

/// Writes jobs in Shoal's CSV (every column), readable by [`parse_trace`].
pub fn write_trace(jobs: &[TraceJob]) -> String {
    let mut s = String::from(
        "job_id,submit_s,duration_s,gpus,gpu_milli,cpus,memory_mib,team,priority,queue,min_workers,max_workers\n",
    );
    for j in jobs {
        let r = &j.per_task;
        let (gpus, milli) = match r.gpus_milli {
            0 => (0, String::new()),
            m if m < 1000 => (1, m.to_string()),
            m => (m / 1000, "1000".into()),
        };
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{},{},{},{}",
            j.id,
            millis(j.submit_ms),
            millis(j.duration_ms),
            gpus,
            milli,
            millis(r.cpus_milli),
            r.memory_bytes / MIB,
            j.team,
            j.priority,
            j.queue,
            j.tasks_min,
            j.tasks_max
        );
    }
    s
}

/// Thousandths as a decimal with no trailing zeros.
fn millis(v: u64) -> String {
    if v.is_multiple_of(1000) {
        (v / 1000).to_string()
    } else {
        let s = format!("{}.{:03}", v / 1000, v % 1000);
        s.trim_end_matches('0').to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses `text` as `t.csv`; `Ok` with the jobs as `id submit duration gpus_milli cpus_milli tasks team`, or the
    /// error's text.
    fn check(text: &str, want: &[&str]) {
        let got: Vec<String> = match parse_trace("t.csv", text) {
            Ok(t) => t
                .jobs
                .iter()
                .map(|j| {
                    format!(
                        "{} {} {} {} {} {}..{} {}",
                        j.id,
                        j.submit_ms,
                        j.duration_ms,
                        j.per_task.gpus_milli,
                        j.per_task.cpus_milli,
                        j.tasks_min,
                        j.tasks_max,
                        j.team
                    )
                })
                .chain(std::iter::once(format!("skipped {}", t.skipped)))
                .collect(),
            Err(e) => vec![e.to_string()],
        };
        assert_eq!(got, want, "{text}");
    }

    const SHOAL: &str = "job_id,submit_s,duration_s,gpus,gpu_milli,cpus,memory_mib,team";

    #[test]
    fn shoal_rows_with_fractions_gangs_and_defaults() {
        check(
            &format!(
                "{SHOAL},min_workers,max_workers\n\
                 a,0,10,1,500,2,1024,x,,\n\
                 # a comment\n\
                 b,1.5,0.25,2,,4,1024,y,2,4\n\
                 c,1,3,0,,0.5,10,,,\n"
            ),
            &[
                "a 0 10000 500 2000 1..1 x",
                "c 1000 3000 0 500 1..1 default",
                "b 1500 250 2000 4000 2..4 y",
                "skipped 0",
            ],
        );
    }

    #[test]
    fn bad_rows_are_refused_with_their_line() {
        for (row, want) in [
            ("a,0,abc,1,,1,1,t", "t.csv line 2: duration_s: not a number: 'abc'"),
            ("a,0,1,1.5,,1,1,t", "t.csv line 2: gpus: not a whole number: '1.5'"),
            ("a,0,1,2,500,1,1,t", "t.csv line 2: gpu_milli: a share of 500 below 1000 needs gpus = 1, not 2"),
            ("a,0,1,0,500,1,1,t", "t.csv line 2: gpu_milli: 500 thousandths of a GPU with gpus = 0"),
            ("a,0,1,1,1500,1,1,t", "t.csv line 2: gpu_milli: must be 1 to 1000: '1500'"),
            ("a,-1,1,1,,1,1,t", "t.csv line 2: submit_s: must be a finite number, 0 or more: '-1'"),
            ("a,0,1,1,,1,1", "t.csv line 2: row: 7 fields where the header has 8"),
            (",0,1,1,,1,1,t", "t.csv line 2: job_id: empty"),
            ("a,0,inf,1,,1,1,t", "t.csv line 2: duration_s: must be a finite number, 0 or more: 'inf'"),
        ] {
            check(&format!("{SHOAL}\n{row}\n"), &[want]);
        }
        check(&format!("{SHOAL}\na,0,1,1,,1,1,t\n\na,0,1,1,,1,1,t\n"), &["t.csv line 4: job_id: a appears twice"]);
        check(
            &format!("{SHOAL},min_workers,max_workers\na,0,1,1,,1,1,t,3,2\n"),
            &["t.csv line 2: max_workers: 2 is below min_workers (3)"],
        );
    }

    #[test]
    fn unknown_and_missing_columns_are_named() {
        check(
            &format!("{SHOAL},colour,size\n"),
            &[
                "t.csv line 1: unknown column(s) colour, size; expected job_id,submit_s,duration_s,gpus,gpu_milli,cpus,memory_mib,team and optionally priority,queue,min_workers,max_workers",
            ],
        );
        check(
            "job_id,submit_s\n",
            &["t.csv line 1: missing column(s) duration_s, gpus, gpu_milli, cpus, memory_mib, team"],
        );
        check(
            "a,b\n",
            &[
                "t.csv line 1: unknown format: a trace's header starts Shoal's job_id,submit_s,duration_s,gpus,gpu_milli,cpus,memory_mib,team or the Alibaba trace's name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time,scheduled_time",
            ],
        );
        check("", &["t.csv is empty"]);
    }

    #[test]
    fn alibaba_pods_run_from_scheduled_to_deleted_and_never_scheduled_ones_are_skipped() {
        check(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
             p0,12000,16384,1,1000,,LS,Running,0,100,10\n\
             p1,6000,12288,1,460,,BE,Running,5,20,6\n\
             p2,6000,12288,8,1000,,LS,Failed,7,9,8\n\
             p3,6000,12288,1,1000,,BE,Pending,7,9,\n\
             p4,8000,100,0,0,,,Succeeded,8,18,8\n",
            &[
                "p0 0 90000 1000 12000 1..1 LS",
                "p1 5000 14000 460 6000 1..1 BE",
                "p2 7000 1000 8000 6000 1..1 LS",
                "p4 8000 10000 0 8000 1..1 none",
                "skipped 1",
            ],
        );
        check(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
             p0,12000,16384,1,1000,,LS,Running,0,5,10\n",
            &["t.csv line 2: deletion_time: 5 is before scheduled_time (10)"],
        );
    }

    #[test]
    fn written_traces_read_back() -> Result<()> {
        let t = parse_trace(
            "t.csv",
            &format!(
                "{SHOAL},priority,queue,min_workers,max_workers\na,0.5,10.125,1,250,2.5,1024,x,3,q,1,2\nb,1,2,8,,16,2048,y,0,default,2,2\n"
            ),
        )?;
        let back = parse_trace("t.csv", &write_trace(&t.jobs))?;
        assert_eq!(back.jobs, t.jobs);
        Ok(())
    }
}
