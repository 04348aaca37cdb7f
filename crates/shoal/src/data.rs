//! `shoal data inspect URL`: what a dataset in an object store or on a path holds, read from where it is — before a
//! job is submitted on it.

use anyhow::Result;
use shoal_data::lake::{Format, inspect};

#[derive(Debug, clap::Subcommand)]
pub enum DataCmd {
    /// The schema, rows, row groups (Parquet), bytes and read throughput of a file, a prefix (ending in `/`) or a
    /// glob (`s3://bucket/clicks/*.parquet`), from where it lives (s3://, gs://, az://, http(s)://, file://, a
    /// path). Credentials and endpoints from `AWS_*`, `GOOGLE_*`, `AZURE_*`.
    Inspect {
        url: String,
        /// parquet, csv (with a header) or jsonl (default: the files' extension).
        #[arg(long)]
        format: Option<String>,
        /// One JSON object: url, format, columns [{name, data_type, nullable}], files [{url, bytes, rows,
        /// row_groups}], rows, row_groups, bytes, read_seconds, read_mb_s.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: &DataCmd) -> Result<bool> {
    match cmd {
        DataCmd::Inspect { url, format, json } => {
            let format = match format.as_deref() {
                None => None,
                Some(f) => Some(
                    Format::parse(f)
                        .ok_or_else(|| anyhow::anyhow!("--format: {f:?} is none of parquet, csv, jsonl"))?,
                ),
            };
            let got = inspect(url, format)?;
            if *json {
                println!("{}", serde_json::to_string(&got)?);
                return Ok(true);
            }
            println!("{} ({}, {} file(s))", got.url, got.format.name(), got.files.len());
            let groups = got.row_groups.map(|g| format!(" in {g} row groups")).unwrap_or_default();
            println!("rows     {}{groups}", got.rows);
            println!("bytes    {} ({:.1} MB)", got.bytes, got.bytes as f64 / 1e6);
            println!("read     {:.3} s, {:.1} MB/s from where it is", got.read_seconds, got.read_mb_s);
            println!("columns");
            for c in &got.columns {
                println!("  {:<24} {}{}", c.name, c.data_type, if c.nullable { " (nullable)" } else { "" });
            }
            if got.files.len() > 1 {
                println!("files");
                for f in &got.files {
                    println!("  {}  {} bytes, {} rows", f.url, f.bytes, f.rows);
                }
            }
            Ok(true)
        }
    }
}
