//! The state store: SQLite (the embedded default, WAL) or PostgreSQL, through sqlx's `Any` driver so that one
//! set of SQL statements serves both.
//!
//! Rules that keep one SQL text valid on both: `$N` placeholders (SQLite reads them by number too), only `BIGINT`,
//! `DOUBLE PRECISION` and `TEXT` columns, booleans as 0/1, times as milliseconds since the Unix epoch, JSON as
//! text, `INSERT ... ON CONFLICT DO NOTHING` for idempotent inserts. Every state change of a job and its event are
//! written in one transaction, conditional on the state it leaves (so two writers can never both move a job).

use std::sync::atomic::{AtomicI64, Ordering};

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};

use crate::error::{ControlError, Result};

/// Where a job or a task stands: the API's vocabulary (`shoal-wire`), stored by name (`as_str`, `parse`).
pub use shoal_wire::{JobState, TaskState};

/// One job as stored (the API shows it as a [`shoal_wire::JobView`], built in `view.rs`).
#[derive(Debug, Clone)]
pub struct JobRow {
    pub id: String,
    pub name: String,
    pub user: String,
    pub team: String,
    pub queue: String,
    pub priority: i64,
    pub state: JobState,
    /// The validated spec, as JSON.
    pub spec: String,
    /// The job secret its workers authenticate with.
    pub secret: String,
    /// Times it was started again after a failure or a loss.
    pub restarts: i64,
    /// Starts so far (1 after the first placement); preemption counts as a new attempt but not as a restart.
    pub attempt: i64,
    /// Workers of the current (or last) attempt.
    pub workers: i64,
    pub created_ms: i64,
    pub started_ms: Option<i64>,
    pub finished_ms: Option<i64>,
    /// Why it is in its state (the last transition's reason).
    pub reason: String,
    pub cancel_requested: bool,
    /// The run's `summary.json` once it finished (JSON).
    pub summary: Option<String>,
    /// Where its checkpoints live when not in its own directory (`checkpoint.url`, normalised): unique, so no
    /// two jobs share (and resume) one location.
    pub checkpoint_key: Option<String>,
}

/// One worker process of one attempt (the API shows it as a [`shoal_wire::TaskView`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRow {
    pub job_id: String,
    pub attempt: i64,
    pub rank: i64,
    pub node: String,
    pub host: String,
    /// The exit-status wrapper: the leader of the task's session, whose process group gets the signals.
    pub pid: Option<i64>,
    /// The training process itself (the wrapper's child): the one to attach a profiler or debugger to.
    pub worker_pid: Option<i64>,
    /// The wrapper's start time in clock ticks since boot (`/proc/PID/stat` field 22), so a reused PID is not
    /// mistaken for it.
    pub start_ticks: Option<i64>,
    pub state: TaskState,
    pub exit_code: Option<i64>,
    pub reason: String,
    /// CPUs it is pinned to (`0-3,6`), empty when not pinned.
    pub cpus: String,
    /// `CUDA_VISIBLE_DEVICES` it got, empty for none.
    pub gpus: String,
    pub started_ms: Option<i64>,
    pub ended_ms: Option<i64>,
    /// CPU time its processes used (user + system), as last sampled.
    pub cpu_seconds: Option<f64>,
    /// The cluster manager's id of what runs it (the Slurm executor: the Slurm job id), `None` for local tasks.
    pub external_id: Option<String>,
}

/// One resource sample of one task (the API shows it as a [`shoal_wire::Sample`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRow {
    pub rank: i64,
    pub time_ms: i64,
    pub cpu_percent: Option<f64>,
    pub rss_bytes: Option<i64>,
    pub cpu_seconds: Option<f64>,
    /// The host's network, all interfaces (bytes/s).
    pub net_rx_bytes_per_s: Option<f64>,
    pub net_tx_bytes_per_s: Option<f64>,
    pub gpu_util_percent: Option<f64>,
    pub gpu_memory_bytes: Option<i64>,
    pub gpu_temperature_c: Option<f64>,
    pub gpu_power_w: Option<f64>,
}

/// Cluster-wide allocation at one time (the API shows it as a [`shoal_wire::ClusterSample`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSample {
    pub time_ms: i64,
    pub cpus_allocated: f64,
    pub memory_allocated_bytes: i64,
    pub gpus_allocated: f64,
    pub pending: i64,
    pub running: i64,
}

/// One transition or notable fact of a job (the API shows it as a [`shoal_wire::Event`]).
#[derive(Debug, Clone)]
pub struct EventRow {
    pub id: i64,
    pub job_id: String,
    pub time_ms: i64,
    /// `submitted`, `placed`, `started`, `succeeded`, `failed`, `cancelled`, `preempted`, `requeued`, `lost`,
    /// `adopted`, `restarted`, `warning`, ...
    pub kind: String,
    /// The job's state after the event.
    pub state: String,
    pub message: String,
}

/// A bearer token's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub user: String,
    pub team: String,
    pub admin: bool,
}

/// One metrics line of one rank (the API's is a [`shoal_wire::Metric`]).
#[derive(Debug, Clone, PartialEq)]
pub struct MetricRow {
    pub rank: i64,
    pub step: i64,
    pub time_ms: i64,
    /// The line as the worker wrote it (JSON object).
    pub data: serde_json::Value,
}

/// The store.
#[derive(Debug)]
pub struct Db {
    pool: AnyPool,
    backend: Backend,
    next_event: AtomicI64,
    /// What every timestamp is read from (see [`crate::clock`]).
    clock: crate::clock::Clock,
}

/// Which database is behind the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    /// `sqlite` or `postgres`.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

/// Schema migrations, applied in order; `schema_version` holds how many ran.
const MIGRATIONS: &[&str] = &[
    "CREATE TABLE tokens (hash TEXT PRIMARY KEY, user_name TEXT NOT NULL, team TEXT NOT NULL, admin BIGINT NOT NULL, \
     created_ms BIGINT NOT NULL)",
    "CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, user_name TEXT NOT NULL, team TEXT NOT NULL, \
     queue TEXT NOT NULL, priority BIGINT NOT NULL, state TEXT NOT NULL, spec TEXT NOT NULL, secret TEXT NOT NULL, \
     restarts BIGINT NOT NULL, attempt BIGINT NOT NULL, workers BIGINT NOT NULL, created_ms BIGINT NOT NULL, \
     started_ms BIGINT, finished_ms BIGINT, reason TEXT NOT NULL, cancel_requested BIGINT NOT NULL, summary TEXT)",
    "CREATE INDEX jobs_state ON jobs (state)",
    "CREATE TABLE tasks (job_id TEXT NOT NULL, attempt BIGINT NOT NULL, rank BIGINT NOT NULL, node TEXT NOT NULL, \
     host TEXT NOT NULL, pid BIGINT, start_ticks BIGINT, state TEXT NOT NULL, exit_code BIGINT, reason TEXT NOT NULL, \
     cpus TEXT NOT NULL, gpus TEXT NOT NULL, PRIMARY KEY (job_id, attempt, rank))",
    "CREATE TABLE events (id BIGINT PRIMARY KEY, job_id TEXT NOT NULL, time_ms BIGINT NOT NULL, kind TEXT NOT NULL, \
     state TEXT NOT NULL, message TEXT NOT NULL)",
    "CREATE INDEX events_job ON events (job_id, id)",
    "CREATE TABLE metrics (job_id TEXT NOT NULL, rank BIGINT NOT NULL, step BIGINT NOT NULL, time_ms BIGINT NOT NULL, \
     data TEXT NOT NULL, PRIMARY KEY (job_id, rank, step))",
    "ALTER TABLE tasks ADD COLUMN started_ms BIGINT",
    "ALTER TABLE tasks ADD COLUMN ended_ms BIGINT",
    "ALTER TABLE tasks ADD COLUMN cpu_seconds DOUBLE PRECISION",
    "CREATE TABLE samples (job_id TEXT NOT NULL, rank BIGINT NOT NULL, time_ms BIGINT NOT NULL, cpu_percent DOUBLE \
     PRECISION, rss_bytes BIGINT, cpu_seconds DOUBLE PRECISION, net_rx DOUBLE PRECISION, net_tx DOUBLE PRECISION, \
     gpu_util DOUBLE PRECISION, gpu_memory BIGINT, gpu_temperature DOUBLE PRECISION, gpu_power DOUBLE PRECISION, \
     PRIMARY KEY (job_id, rank, time_ms))",
    "CREATE TABLE cluster_samples (time_ms BIGINT PRIMARY KEY, cpus DOUBLE PRECISION NOT NULL, memory_bytes BIGINT \
     NOT NULL, gpus DOUBLE PRECISION NOT NULL, pending BIGINT NOT NULL, running BIGINT NOT NULL)",
    "ALTER TABLE tasks ADD COLUMN worker_pid BIGINT",
    "ALTER TABLE jobs ADD COLUMN checkpoint_key TEXT",
    "CREATE UNIQUE INDEX jobs_checkpoint_key ON jobs (checkpoint_key)",
    "ALTER TABLE tasks ADD COLUMN external_id TEXT",
];

const JOB_COLUMNS: &str = "id, name, user_name, team, queue, priority, state, spec, secret, restarts, attempt, \
                           workers, created_ms, started_ms, finished_ms, reason, cancel_requested, summary, \
                           checkpoint_key";

fn job_from(row: &AnyRow) -> Result<JobRow> {
    let state: String = row.try_get("state")?;
    Ok(JobRow {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        user: row.try_get("user_name")?,
        team: row.try_get("team")?,
        queue: row.try_get("queue")?,
        priority: row.try_get("priority")?,
        state: JobState::parse(&state)
            .ok_or_else(|| ControlError::Internal(format!("unknown job state {state:?} in the store")))?,
        spec: row.try_get("spec")?,
        secret: row.try_get("secret")?,
        restarts: row.try_get("restarts")?,
        attempt: row.try_get("attempt")?,
        workers: row.try_get("workers")?,
        created_ms: row.try_get("created_ms")?,
        started_ms: row.try_get("started_ms")?,
        finished_ms: row.try_get("finished_ms")?,
        reason: row.try_get("reason")?,
        cancel_requested: row.try_get::<i64, _>("cancel_requested")? != 0,
        summary: row.try_get("summary")?,
        checkpoint_key: row.try_get("checkpoint_key")?,
    })
}

fn task_from(row: &AnyRow) -> Result<TaskRow> {
    let state: String = row.try_get("state")?;
    Ok(TaskRow {
        job_id: row.try_get("job_id")?,
        attempt: row.try_get("attempt")?,
        rank: row.try_get("rank")?,
        node: row.try_get("node")?,
        host: row.try_get("host")?,
        pid: row.try_get("pid")?,
        worker_pid: row.try_get("worker_pid")?,
        start_ticks: row.try_get("start_ticks")?,
        state: TaskState::parse(&state)
            .ok_or_else(|| ControlError::Internal(format!("unknown task state {state:?} in the store")))?,
        exit_code: row.try_get("exit_code")?,
        reason: row.try_get("reason")?,
        cpus: row.try_get("cpus")?,
        gpus: row.try_get("gpus")?,
        started_ms: row.try_get("started_ms")?,
        ended_ms: row.try_get("ended_ms")?,
        cpu_seconds: un_nan(row.try_get("cpu_seconds")?),
        external_id: row.try_get("external_id")?,
    })
}

const TASK_COLUMNS: &str = "job_id, attempt, rank, node, host, pid, start_ticks, state, exit_code, reason, cpus, gpus, \
                            started_ms, ended_ms, cpu_seconds, worker_pid, external_id";

/// What a state change also writes.
#[derive(Debug, Default, Clone)]
pub struct Transition<'a> {
    pub kind: &'a str,
    pub message: String,
    pub restarts: Option<i64>,
    pub attempt: Option<i64>,
    pub workers: Option<i64>,
    pub started_ms: Option<i64>,
    pub finished_ms: Option<i64>,
    pub summary: Option<String>,
}

impl Db {
    /// The time now by the store's clock, in milliseconds since the epoch.
    pub fn now(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Reads every timestamp from `clock` from now on (a simulation's).
    pub fn set_clock(&mut self, clock: crate::clock::Clock) {
        self.clock = clock;
    }

    /// Opens (creating if needed) and migrates the store at `url`: `sqlite://PATH` or `postgres://...`.
    ///
    /// A SQLite file that exists but is empty, is not a database or fails SQLite's integrity check is refused
    /// with its path and the cause — never taken for a new store — unless `init` is set, which moves it aside
    /// (`shoal.db.damaged-MS`, kept) and starts afresh. With `init` unset, a missing database beside a
    /// non-empty `jobs/` directory is refused too: that history was lost, and starting an empty one would hide it.
    pub async fn open(url: &str, init: bool) -> Result<Db> {
        Db::open_as(url, if init { Opening::Init } else { Opening::Strict }).await
    }

    async fn open_as(url: &str, how: Opening) -> Result<Db> {
        let init = how != Opening::Strict;
        // The SQLite file, without the URL's options.
        let sqlite = url.strip_prefix("sqlite://").map(|p| std::path::PathBuf::from(p.split('?').next().unwrap_or(p)));
        if let Some(path) = &sqlite {
            check_sqlite_file(path, init)?;
        }
        let db = Db::connect(url).await?;
        if let Some(path) = sqlite.as_deref().filter(|_| db.backend == Backend::Sqlite) {
            let verdict = match sqlx::query("PRAGMA quick_check").fetch_one(&db.pool).await {
                Ok(row) => row.try_get::<String, _>(0)?,
                Err(e) => e.to_string(),
            };
            if verdict != "ok" {
                db.pool.close().await;
                if how == Opening::Init {
                    set_aside(path)?;
                    return Box::pin(Db::open_as(url, Opening::AfterSetAside)).await;
                }
                return Err(damaged(path, &format!("SQLite's integrity check failed: {verdict}")));
            }
        }
        let ready = async {
            db.migrate().await?;
            let max: Option<i64> =
                sqlx::query("SELECT MAX(id) AS m FROM events").fetch_one(&db.pool).await?.try_get("m")?;
            db.next_event.store(max.unwrap_or(0) + 1, Ordering::SeqCst);
            Ok::<(), ControlError>(())
        };
        match ready.await {
            Ok(()) => Ok(db),
            // Damage the quick check did not see (it reads the b-trees, not every page) shows up here.
            Err(ControlError::Db(e)) if is_damage(&e) && sqlite.is_some() => {
                db.pool.close().await;
                let path = sqlite.as_deref().unwrap_or(std::path::Path::new(url));
                if how == Opening::Init {
                    set_aside(path)?;
                    return Box::pin(Db::open_as(url, Opening::AfterSetAside)).await;
                }
                Err(damaged(path, &e.to_string()))
            }
            Err(e) => Err(e),
        }
    }

    async fn connect(url: &str) -> Result<Db> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres
        } else {
            return Err(ControlError::Config(format!(
                "--database {url:?}: expected sqlite://PATH or postgres://USER:PASSWORD@HOST:PORT/DB"
            )));
        };
        let url = if backend == Backend::Sqlite && !url.contains('?') { format!("{url}?mode=rwc") } else { url.into() };
        let pool = AnyPoolOptions::new()
            .max_connections(if backend == Backend::Sqlite { 4 } else { 8 })
            .acquire_timeout(std::time::Duration::from_secs(10))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if backend == Backend::Sqlite {
                        // WAL: readers never block the writer; NORMAL is durable across a process crash.
                        sqlx::query("PRAGMA journal_mode=WAL").execute(&mut *conn).await?;
                        sqlx::query("PRAGMA synchronous=NORMAL").execute(&mut *conn).await?;
                        sqlx::query("PRAGMA busy_timeout=10000").execute(&mut *conn).await?;
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await
            .map_err(|e| ControlError::Config(format!("cannot open the database {}: {e}", redact(&url))))?;
        Ok(Db { pool, backend, next_event: AtomicI64::new(0), clock: crate::clock::Clock::system() })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Folds SQLite's write-ahead log into the database file, then closes every connection.
    pub async fn close(&self) {
        if self.backend == Backend::Sqlite
            && let Err(e) = sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)").execute(&self.pool).await
        {
            tracing::warn!(error = %e, "checkpointing the write-ahead log at close failed");
        }
        self.pool.close().await;
    }

    /// Begins a write transaction. On SQLite it takes the write lock at once (`BEGIN IMMEDIATE`): a deferred
    /// transaction that reads first and writes later cannot upgrade its lock when another writer committed in
    /// between, and fails with `database is locked` without waiting. Busy answers are retried until
    /// [`WRITE_DEADLINE`]; what still fails then says what it waited for.
    async fn write_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Any>> {
        let begin = if self.backend == Backend::Sqlite { "BEGIN IMMEDIATE" } else { "BEGIN" };
        let t0 = std::time::Instant::now();
        let mut pause = std::time::Duration::from_millis(5);
        loop {
            match self.pool.begin_with(begin).await {
                Ok(tx) => return Ok(tx),
                Err(e) if is_busy(&e) && t0.elapsed() < WRITE_DEADLINE => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_millis(200));
                }
                Err(e) if is_busy(&e) => {
                    return Err(ControlError::Internal(format!(
                        "the database stayed locked by another writer for {} s: {e}",
                        WRITE_DEADLINE.as_secs()
                    )));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    async fn migrate(&self) -> Result<()> {
        sqlx::query("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)").execute(&self.pool).await?;
        let mut tx = self.write_tx().await?;
        let row = sqlx::query("SELECT version FROM schema_version").fetch_optional(&mut *tx).await?;
        let done = match row {
            Some(r) => r.try_get::<i64, _>("version")?,
            None => {
                sqlx::query("INSERT INTO schema_version (version) VALUES (0)").execute(&mut *tx).await?;
                0
            }
        };
        if done as usize > MIGRATIONS.len() {
            return Err(ControlError::Config(format!(
                "the database has schema version {done}, newer than this server knows ({}): upgrade shoal",
                MIGRATIONS.len()
            )));
        }
        for m in &MIGRATIONS[done as usize..] {
            sqlx::query(m).execute(&mut *tx).await?;
        }
        sqlx::query("UPDATE schema_version SET version = $1").bind(MIGRATIONS.len() as i64).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    // ---- tokens

    pub async fn insert_token(&self, hash: &str, p: &Principal) -> Result<()> {
        sqlx::query("INSERT INTO tokens (hash, user_name, team, admin, created_ms) VALUES ($1, $2, $3, $4, $5)")
            .bind(hash)
            .bind(&p.user)
            .bind(&p.team)
            .bind(i64::from(p.admin))
            .bind(self.now())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn find_token(&self, hash: &str) -> Result<Option<Principal>> {
        let row = sqlx::query("SELECT user_name, team, admin FROM tokens WHERE hash = $1")
            .bind(hash)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| {
            Ok(Principal {
                user: r.try_get("user_name")?,
                team: r.try_get("team")?,
                admin: r.try_get::<i64, _>("admin")? != 0,
            })
        })
        .transpose()
    }

    pub async fn has_admin_token(&self) -> Result<bool> {
        Ok(sqlx::query("SELECT hash FROM tokens WHERE admin = 1").fetch_optional(&self.pool).await?.is_some())
    }

    // ---- jobs

    /// Stores a new pending job and its `submitted` event.
    pub async fn insert_job(&self, job: &JobRow) -> Result<()> {
        let mut tx = self.write_tx().await?;
        let inserted = sqlx::query(&format!(
            "INSERT INTO jobs ({JOB_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, \
             $15, $16, $17, $18, $19)"
        ))
        .bind(&job.id)
        .bind(&job.name)
        .bind(&job.user)
        .bind(&job.team)
        .bind(&job.queue)
        .bind(job.priority)
        .bind(job.state.as_str())
        .bind(&job.spec)
        .bind(&job.secret)
        .bind(job.restarts)
        .bind(job.attempt)
        .bind(job.workers)
        .bind(job.created_ms)
        .bind(job.started_ms)
        .bind(job.finished_ms)
        .bind(&job.reason)
        .bind(i64::from(job.cancel_requested))
        .bind(job.summary.as_deref())
        .bind(job.checkpoint_key.as_deref())
        .execute(&mut *tx)
        .await;
        if let Err(sqlx::Error::Database(d)) = &inserted
            && d.is_unique_violation()
            && let Some(key) = &job.checkpoint_key
        {
            let why = d.message().to_owned();
            drop(tx);
            let owner = sqlx::query("SELECT id FROM jobs WHERE checkpoint_key = $1")
                .bind(key)
                .fetch_optional(&self.pool)
                .await?
                .map(|r| r.try_get::<String, _>("id"))
                .transpose()?;
            return Err(match owner {
                Some(owner) => ControlError::bad_field(
                    "checkpoint.url",
                    format!("{key}: already the checkpoint location of job {owner}; each job keeps its own"),
                ),
                None => ControlError::Internal(format!("storing job {}: {why}", job.id)),
            });
        }
        inserted?;
        self.event_in(&mut tx, &job.id, "submitted", job.state, &job.reason).await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn job(&self, id: &str) -> Result<Option<JobRow>> {
        let row = sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(job_from).transpose()
    }

    /// Jobs, newest first, optionally of one team and in some states.
    pub async fn jobs(&self, team: Option<&str>, states: &[JobState], limit: i64) -> Result<Vec<JobRow>> {
        let rows = sqlx::query(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE ($1 = '' OR team = $1) ORDER BY created_ms DESC, id DESC LIMIT $2"
        ))
        .bind(team.unwrap_or(""))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        let mut out = Vec::new();
        for r in &rows {
            let j = job_from(r)?;
            if states.is_empty() || states.contains(&j.state) {
                out.push(j);
            }
        }
        Ok(out)
    }

    /// Jobs in any of `states`, oldest first.
    pub async fn jobs_in(&self, states: &[JobState]) -> Result<Vec<JobRow>> {
        let mut out = Vec::new();
        for st in states {
            let rows = sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE state = $1"))
                .bind(st.as_str())
                .fetch_all(&self.pool)
                .await?;
            for r in &rows {
                out.push(job_from(r)?);
            }
        }
        out.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        Ok(out)
    }

    /// Moves a job from one of `from` to `to` with an event, in one transaction. Returns false (and changes
    /// nothing) when the job is not in any of `from` any more.
    pub async fn transition(&self, id: &str, from: &[JobState], to: JobState, t: Transition<'_>) -> Result<bool> {
        let mut tx = self.write_tx().await?;
        let Some(row) = sqlx::query("SELECT state FROM jobs WHERE id = $1").bind(id).fetch_optional(&mut *tx).await?
        else {
            return Ok(false);
        };
        let state: String = row.try_get("state")?;
        if !from.iter().any(|s| s.as_str() == state) {
            return Ok(false);
        }
        let n = sqlx::query(
            "UPDATE jobs SET state = $1, reason = $2, restarts = COALESCE($3, restarts), attempt = COALESCE($4, \
             attempt), workers = COALESCE($5, workers), started_ms = COALESCE($6, started_ms), finished_ms = \
             COALESCE($7, finished_ms), summary = COALESCE($8, summary) WHERE id = $9 AND state = $10",
        )
        .bind(to.as_str())
        .bind(&t.message)
        .bind(t.restarts)
        .bind(t.attempt)
        .bind(t.workers)
        .bind(t.started_ms)
        .bind(t.finished_ms)
        .bind(t.summary.as_deref())
        .bind(id)
        .bind(&state)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n != 1 {
            return Ok(false);
        }
        self.event_in(&mut tx, id, t.kind, to, &t.message).await?;
        tx.commit().await?;
        Ok(true)
    }

    pub async fn request_cancel(&self, id: &str) -> Result<()> {
        let mut tx = self.write_tx().await?;
        sqlx::query("UPDATE jobs SET cancel_requested = 1 WHERE id = $1").bind(id).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    // ---- events

    async fn event_in(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        job: &str,
        kind: &str,
        state: JobState,
        message: &str,
    ) -> Result<()> {
        let id = self.next_event.fetch_add(1, Ordering::SeqCst);
        sqlx::query("INSERT INTO events (id, job_id, time_ms, kind, state, message) VALUES ($1, $2, $3, $4, $5, $6)")
            .bind(id)
            .bind(job)
            .bind(self.now())
            .bind(kind)
            .bind(state.as_str())
            .bind(message)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// Records an event without a state change (`state` is the job's current one).
    pub async fn event(&self, job: &str, kind: &str, state: JobState, message: &str) -> Result<()> {
        let mut tx = self.write_tx().await?;
        self.event_in(&mut tx, job, kind, state, message).await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn events(&self, job: &str, after: i64) -> Result<Vec<EventRow>> {
        let rows = sqlx::query(
            "SELECT id, job_id, time_ms, kind, state, message FROM events WHERE job_id = $1 AND id > $2 ORDER BY id",
        )
        .bind(job)
        .bind(after)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(EventRow {
                    id: r.try_get("id")?,
                    job_id: r.try_get("job_id")?,
                    time_ms: r.try_get("time_ms")?,
                    kind: r.try_get("kind")?,
                    state: r.try_get("state")?,
                    message: r.try_get("message")?,
                })
            })
            .collect()
    }

    // ---- tasks

    pub async fn upsert_task(&self, t: &TaskRow) -> Result<()> {
        let mut tx = self.write_tx().await?;
        sqlx::query("DELETE FROM tasks WHERE job_id = $1 AND attempt = $2 AND rank = $3")
            .bind(&t.job_id)
            .bind(t.attempt)
            .bind(t.rank)
            .execute(&mut *tx)
            .await?;
        sqlx::query(&format!(
            "INSERT INTO tasks ({TASK_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, \
             $16, $17)"
        ))
        .bind(&t.job_id)
        .bind(t.attempt)
        .bind(t.rank)
        .bind(&t.node)
        .bind(&t.host)
        .bind(t.pid)
        .bind(t.start_ticks)
        .bind(t.state.as_str())
        .bind(t.exit_code)
        .bind(&t.reason)
        .bind(&t.cpus)
        .bind(&t.gpus)
        .bind(t.started_ms)
        .bind(t.ended_ms)
        .bind(nan(t.cpu_seconds))
        .bind(t.worker_pid)
        .bind(&t.external_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The tasks of one attempt, by rank.
    pub async fn tasks(&self, job: &str, attempt: i64) -> Result<Vec<TaskRow>> {
        let rows =
            sqlx::query(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE job_id = $1 AND attempt = $2 ORDER BY rank"))
                .bind(job)
                .bind(attempt)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(task_from).collect()
    }

    /// Every task of a job, all attempts.
    pub async fn all_tasks(&self, job: &str) -> Result<Vec<TaskRow>> {
        let rows = sqlx::query(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE job_id = $1 ORDER BY attempt, rank"))
            .bind(job)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(task_from).collect()
    }

    /// Sets a running task's sampled CPU time.
    pub async fn set_task_cpu(&self, t: &TaskRow, cpu_seconds: f64) -> Result<()> {
        sqlx::query("UPDATE tasks SET cpu_seconds = $1 WHERE job_id = $2 AND attempt = $3 AND rank = $4")
            .bind(cpu_seconds)
            .bind(&t.job_id)
            .bind(t.attempt)
            .bind(t.rank)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    // ---- resource samples

    pub async fn insert_samples(&self, job: &str, rows: &[SampleRow]) -> Result<()> {
        let mut tx = self.write_tx().await?;
        for r in rows {
            sqlx::query(
                "INSERT INTO samples (job_id, rank, time_ms, cpu_percent, rss_bytes, cpu_seconds, net_rx, net_tx, \
                 gpu_util, gpu_memory, gpu_temperature, gpu_power) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
                 $11, $12) ON CONFLICT DO NOTHING",
            )
            .bind(job)
            .bind(r.rank)
            .bind(r.time_ms)
            .bind(nan(r.cpu_percent))
            .bind(r.rss_bytes)
            .bind(nan(r.cpu_seconds))
            .bind(nan(r.net_rx_bytes_per_s))
            .bind(nan(r.net_tx_bytes_per_s))
            .bind(nan(r.gpu_util_percent))
            .bind(r.gpu_memory_bytes)
            .bind(nan(r.gpu_temperature_c))
            .bind(nan(r.gpu_power_w))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Samples of a job after `after_ms`, oldest first.
    pub async fn samples(&self, job: &str, after_ms: i64, limit: i64) -> Result<Vec<SampleRow>> {
        let rows = sqlx::query(
            "SELECT rank, time_ms, cpu_percent, rss_bytes, cpu_seconds, net_rx, net_tx, gpu_util, gpu_memory, \
             gpu_temperature, gpu_power FROM samples WHERE job_id = $1 AND time_ms > $2 ORDER BY time_ms, rank LIMIT $3",
        )
        .bind(job)
        .bind(after_ms)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(SampleRow {
                    rank: r.try_get("rank")?,
                    time_ms: r.try_get("time_ms")?,
                    cpu_percent: un_nan(r.try_get("cpu_percent")?),
                    rss_bytes: r.try_get("rss_bytes")?,
                    cpu_seconds: un_nan(r.try_get("cpu_seconds")?),
                    net_rx_bytes_per_s: un_nan(r.try_get("net_rx")?),
                    net_tx_bytes_per_s: un_nan(r.try_get("net_tx")?),
                    gpu_util_percent: un_nan(r.try_get("gpu_util")?),
                    gpu_memory_bytes: r.try_get("gpu_memory")?,
                    gpu_temperature_c: un_nan(r.try_get("gpu_temperature")?),
                    gpu_power_w: un_nan(r.try_get("gpu_power")?),
                })
            })
            .collect()
    }

    pub async fn insert_cluster_sample(&self, c: &ClusterSample) -> Result<()> {
        sqlx::query(
            "INSERT INTO cluster_samples (time_ms, cpus, memory_bytes, gpus, pending, running) VALUES ($1, $2, $3, $4, \
             $5, $6) ON CONFLICT DO NOTHING",
        )
        .bind(c.time_ms)
        .bind(c.cpus_allocated)
        .bind(c.memory_allocated_bytes)
        .bind(c.gpus_allocated)
        .bind(c.pending)
        .bind(c.running)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Cluster samples after `after_ms`, oldest first, at most `limit` (the newest ones).
    pub async fn cluster_samples(&self, after_ms: i64, limit: i64) -> Result<Vec<ClusterSample>> {
        let rows = sqlx::query(
            "SELECT time_ms, cpus, memory_bytes, gpus, pending, running FROM cluster_samples WHERE time_ms > $1 ORDER \
             BY time_ms DESC LIMIT $2",
        )
        .bind(after_ms)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        let mut out = rows
            .iter()
            .map(|r| {
                Ok(ClusterSample {
                    time_ms: r.try_get("time_ms")?,
                    cpus_allocated: r.try_get("cpus")?,
                    memory_allocated_bytes: r.try_get("memory_bytes")?,
                    gpus_allocated: r.try_get("gpus")?,
                    pending: r.try_get("pending")?,
                    running: r.try_get("running")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        out.reverse();
        Ok(out)
    }

    /// Every job created since `since_ms`, optionally of one team (for cost reports).
    pub async fn jobs_since(&self, team: Option<&str>, since_ms: i64) -> Result<Vec<JobRow>> {
        let rows = sqlx::query(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE ($1 = '' OR team = $1) AND created_ms >= $2 ORDER BY created_ms, id"
        ))
        .bind(team.unwrap_or(""))
        .bind(since_ms)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(job_from).collect()
    }

    // ---- metrics

    /// Stores metrics lines; a line already stored (same rank and step) is kept as it was.
    pub async fn insert_metrics(&self, job: &str, rows: &[MetricRow]) -> Result<u64> {
        let mut tx = self.write_tx().await?;
        let mut n = 0;
        for m in rows {
            n += sqlx::query(
                "INSERT INTO metrics (job_id, rank, step, time_ms, data) VALUES ($1, $2, $3, $4, $5) ON CONFLICT \
                 DO NOTHING",
            )
            .bind(job)
            .bind(m.rank)
            .bind(m.step)
            .bind(m.time_ms)
            .bind(m.data.to_string())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        }
        tx.commit().await?;
        Ok(n)
    }

    /// Metrics of a job after `after_step`, optionally of one rank (-1: the evaluations), by step.
    pub async fn metrics(&self, job: &str, rank: Option<i64>, after_step: i64, limit: i64) -> Result<Vec<MetricRow>> {
        let rows = sqlx::query(
            "SELECT rank, step, time_ms, data FROM metrics WHERE job_id = $1 AND ($2 = 0 OR rank = $3) AND step > $4 \
             ORDER BY step, rank LIMIT $5",
        )
        .bind(job)
        .bind(i64::from(rank.is_some()))
        .bind(rank.unwrap_or(0))
        .bind(after_step)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let data: String = r.try_get("data")?;
                Ok(MetricRow {
                    rank: r.try_get("rank")?,
                    step: r.try_get("step")?,
                    time_ms: r.try_get("time_ms")?,
                    data: serde_json::from_str(&data).unwrap_or(serde_json::Value::Null),
                })
            })
            .collect()
    }

    /// The newest step stored for a job and rank (-1 when none).
    pub async fn last_metric_step(&self, job: &str, rank: i64) -> Result<i64> {
        let row = sqlx::query("SELECT MAX(step) AS m FROM metrics WHERE job_id = $1 AND rank = $2")
            .bind(job)
            .bind(rank)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get::<Option<i64>, _>("m")?.unwrap_or(-1))
    }
}

/// How [`Db::open`] treats a damaged SQLite file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// Refuse it.
    Strict,
    /// Set it aside and start afresh (`--init`).
    Init,
    /// It was just set aside: a missing file is expected, and a new one that fails too is an error.
    AfterSetAside,
}

/// Refuses a SQLite file that cannot be this server's store (see [`Db::open`]); with `init`, moves it aside.
fn check_sqlite_file(path: &std::path::Path, init: bool) -> Result<()> {
    let cause = match std::fs::File::open(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let jobs = path.parent().map(|d| d.join("jobs"));
            let had_jobs =
                jobs.as_ref().and_then(|j| std::fs::read_dir(j).ok()).is_some_and(|mut d| d.next().is_some());
            if had_jobs && !init {
                return Err(ControlError::Config(format!(
                    "the database {} is missing but {} holds jobs: their history would be lost. Restore the \
                     file, or start afresh with --init",
                    path.display(),
                    jobs.map(|j| j.display().to_string()).unwrap_or_default()
                )));
            }
            return Ok(());
        }
        Err(e) => return Err(ControlError::Config(format!("the database {}: {e}", path.display()))),
        Ok(mut f) => {
            use std::io::Read;
            let mut head = [0u8; 16];
            let n = f.read(&mut head).unwrap_or(0);
            if n == 0 {
                Some("the file is empty (0 bytes)".to_owned())
            } else if n < 16 || &head != b"SQLite format 3\0" {
                Some("the file is not a database (no SQLite header)".to_owned())
            } else {
                None
            }
        }
    };
    match cause {
        None => Ok(()),
        Some(_) if init => set_aside(path),
        Some(why) => Err(damaged(path, &why)),
    }
}

fn damaged(path: &std::path::Path, why: &str) -> ControlError {
    ControlError::Config(format!(
        "the database {} is damaged: {why}. It is left as it is; restore it from a backup, or start afresh with \
         --init (the damaged file is kept beside it)",
        path.display()
    ))
}

/// Moves a damaged database (and its WAL files) aside, keeping them.
fn set_aside(path: &std::path::Path) -> Result<()> {
    let stamp = crate::clock::Clock::system().now_ms();
    for suffix in ["", "-wal", "-shm"] {
        let from = std::path::PathBuf::from(format!("{}{suffix}", path.display()));
        if from.exists() {
            let to = format!("{}.damaged-{stamp}{suffix}", path.display());
            std::fs::rename(&from, &to)?;
            tracing::warn!(from = %from.display(), to = %to, "damaged database set aside (--init)");
        }
    }
    Ok(())
}

/// How long a write waits for the database's write lock, all retries together.
pub const WRITE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// The primary result code of a database error (SQLite's `extended & 0xff`); 0 when it has none.
fn primary_code(e: &sqlx::Error) -> i64 {
    match e {
        sqlx::Error::Database(d) => d.code().and_then(|c| c.parse::<i64>().ok()).unwrap_or(0) & 0xff,
        _ => 0,
    }
}

/// SQLite's I/O, corruption and not-a-database errors (`SQLITE_IOERR`, `SQLITE_CORRUPT`, `SQLITE_NOTADB`).
fn is_damage(e: &sqlx::Error) -> bool {
    matches!(primary_code(e), 10 | 11 | 26)
}

/// SQLite's `SQLITE_BUSY` / `SQLITE_LOCKED` (and their extended codes): another connection holds the lock.
fn is_busy(e: &sqlx::Error) -> bool {
    matches!(primary_code(e), 5 | 6)
        || matches!(e, sqlx::Error::Database(d) if d.message().contains("database is locked"))
}

/// An absent double as NaN. sqlx's `Any` driver binds a `None::<f64>` as a 4-byte float, which PostgreSQL
/// rejects for a `DOUBLE PRECISION` column; NaN is a valid double in PostgreSQL and SQLite stores it as NULL.
fn nan(v: Option<f64>) -> f64 {
    v.unwrap_or(f64::NAN)
}

fn un_nan(v: Option<f64>) -> Option<f64> {
    v.filter(|x| !x.is_nan())
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}
