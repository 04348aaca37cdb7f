//! The crate's one error type.

/// What can go wrong reading a trace or a cluster, or running a simulation. Variants carry facts.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The server's control loop, driven by `--engine control`, failed or did what a job's work does not explain.
    #[error("the control loop: {0}")]
    Control(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// The header names no format this crate reads.
    #[error("{file} line 1: unknown format: {why}")]
    Format {
        /// The file.
        file: String,
        /// What was expected.
        why: String,
    },
    /// The header has columns the format does not know.
    #[error("{file} line 1: unknown column(s) {}; expected {expected}", .columns.join(", "))]
    UnknownColumns {
        /// The file.
        file: String,
        /// The columns refused.
        columns: Vec<String>,
        /// The columns the format knows.
        expected: String,
    },
    /// The header lacks columns the format needs.
    #[error("{file} line 1: missing column(s) {}", .columns.join(", "))]
    MissingColumns {
        /// The file.
        file: String,
        /// The columns missing.
        columns: Vec<String>,
    },
    /// One row is wrong.
    #[error("{file} line {line}: {column}: {message}")]
    Row {
        /// The file.
        file: String,
        /// Its line, from 1 (the header).
        line: usize,
        /// The column, or `row` for the row as a whole.
        column: String,
        /// What is wrong.
        message: String,
    },
    /// The trace or the cluster is empty.
    #[error("{what} is empty")]
    Empty {
        /// Which.
        what: String,
    },
    /// The options do not make sense together.
    #[error("{0}")]
    Options(String),
    /// The scheduler refused the cluster.
    #[error("cluster: {0}")]
    Cluster(shoal_sched::SchedError),
    /// An invariant of the simulation broke (a node over capacity, a job started twice...).
    #[error("at {at_ms} ms: {what}")]
    Audit {
        /// Simulated time.
        at_ms: u64,
        /// What broke.
        what: String,
    },
    /// A plot could not be drawn.
    #[error("plot {file}: {message}")]
    Plot {
        /// The file.
        file: String,
        /// What the plotting library said.
        message: String,
    },
    /// A report could not be serialised.
    #[error("report: {0}")]
    Json(#[from] serde_json::Error),
}

/// `Result` with [`SimError`].
pub type Result<T, E = SimError> = std::result::Result<T, E>;

/// Reads a whole file, naming it on failure.
pub(crate) fn read(path: &std::path::Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| SimError::Io { path: path.display().to_string(), source })
}

/// Writes a whole file, naming it on failure.
pub(crate) fn write(path: &std::path::Path, text: &[u8]) -> Result<()> {
    std::fs::write(path, text).map_err(|source| SimError::Io { path: path.display().to_string(), source })
}
