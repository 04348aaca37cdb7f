//! `shoal data inspect URL`: what a dataset in an object store or on a path holds, read from where it is — before a
//! job is submitted on it. `shoal data bench`: reading a Parquet table the way training does, from where it lives
//! and from disk side by side. `shoal data make`: a planted table to try them on.

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
    /// Reads a Parquet table the way training does — every rank its lanes' row groups, only the wanted columns,
    /// through the same cache — from URL and, side by side, from --against (the same files elsewhere, e.g. on
    /// disk): rows per second, bytes fetched against the wanted columns' compressed bytes, each rank's peak memory.
    Bench {
        url: String,
        /// The same table elsewhere, read right after.
        #[arg(long)]
        against: Option<String>,
        /// The feature columns (comma-separated; default f0..f7).
        #[arg(long, value_delimiter = ',')]
        columns: Vec<String>,
        #[arg(long, default_value = "label")]
        label: String,
        #[arg(long, default_value_t = 10)]
        classes: usize,
        /// Reading processes.
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        #[arg(long, default_value_t = 256)]
        global_batch: usize,
        /// One JSON object: {sources: [{url, ranks, rows, seconds, rows_per_s, mb_per_s, fetched_bytes,
        /// projected_bytes, fetched_over_projected, peak_rss_bytes}], ratio}.
        #[arg(long)]
        json: bool,
    },
    /// Writes a planted Parquet table to a local path: features f0.. uniform in [-1, 1), `label` the largest of a
    /// few fixed linear scores, and columns x0.. no job reads.
    Make {
        path: std::path::PathBuf,
        #[arg(long, default_value_t = 1_000_000)]
        rows: u64,
        #[arg(long, default_value_t = 131_072)]
        row_group: usize,
        #[arg(long, default_value_t = 8)]
        features: usize,
        #[arg(long, default_value_t = 8)]
        extra: usize,
        #[arg(long, default_value_t = 10)]
        classes: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Then copies the file there through the object store (e.g. `s3://bucket/table.parquet`), as an upload.
        #[arg(long)]
        to: Option<String>,
    },
    /// One reading rank of `shoal data bench`.
    #[command(hide = true)]
    ReadRank {
        url: String,
        #[arg(long, value_delimiter = ',')]
        columns: Vec<String>,
        #[arg(long)]
        label: String,
        #[arg(long)]
        classes: usize,
        #[arg(long)]
        ranks: usize,
        #[arg(long)]
        rank: usize,
        #[arg(long)]
        global_batch: usize,
    },
}

/// What one reading rank reports.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct RankRead {
    rows: u64,
    seconds: f64,
    fetched_bytes: u64,
    projected_bytes: u64,
    peak_rss_bytes: u64,
}

/// One source's figures in `shoal data bench`.
#[derive(Debug, serde::Serialize)]
struct SourceRead {
    url: String,
    ranks: usize,
    rows: u64,
    seconds: f64,
    rows_per_s: f64,
    mb_per_s: f64,
    fetched_bytes: u64,
    projected_bytes: u64,
    fetched_over_projected: f64,
    peak_rss_bytes: u64,
}

/// One rank's epoch over the table, as the worker reads it.
fn read_rank(
    url: &str,
    columns: &[String],
    label: &str,
    classes: usize,
    ranks: usize,
    rank: usize,
    global: usize,
) -> Result<RankRead> {
    use shoal_data::{Dataset, DistributedSampler, Lanes, Loader, LoaderConfig, SamplerConfig};
    let spec = shoal_data::lake::TableSpec {
        location: url.to_owned(),
        format: Some(Format::Parquet),
        features: columns.to_vec(),
        label: label.to_owned(),
        classes,
        text: None,
        context: 0,
        cache_bytes: shoal_data::lake::table::DEFAULT_CACHE_BYTES,
    };
    let table = std::sync::Arc::new(shoal_data::lake::LakeTable::open(spec)?);
    let lanes = Lanes { blocks: table.blocks().into(), lanes: shoal_spec::data::default_lanes(global) };
    let sampler = DistributedSampler::with_lanes(SamplerConfig::new(table.len(), global), lanes, ranks, rank)?;
    let start = std::time::Instant::now();
    let data: std::sync::Arc<dyn Dataset> = table.clone();
    let mut loader =
        Loader::new(data, sampler.epoch_batches(), LoaderConfig { prefetch: 4, ..LoaderConfig::default() })?;
    let mut rows = 0u64;
    while let Some(b) = loader.next_batch()? {
        rows += b.samples.len() as u64;
    }
    Ok(RankRead {
        rows,
        seconds: start.elapsed().as_secs_f64(),
        fetched_bytes: table.fetched_bytes(),
        projected_bytes: table.projected_bytes(),
        peak_rss_bytes: crate::bench::peak_rss(),
    })
}

/// Every rank of `shoal data bench` on one source, as processes; their figures together.
fn read_source(
    url: &str,
    columns: &[String],
    label: &str,
    classes: usize,
    ranks: usize,
    global: usize,
) -> Result<SourceRead> {
    let exe = std::env::current_exe()?;
    let children = (0..ranks)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["data", "read-rank", url, "--columns", &columns.join(","), "--label", label])
                .args(["--classes", &classes.to_string(), "--ranks", &ranks.to_string(), "--rank", &r.to_string()])
                .args(["--global-batch", &global.to_string()])
                .stdout(std::process::Stdio::piped())
                .spawn()
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut reads = Vec::with_capacity(ranks);
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            anyhow::bail!("reading rank {r} of {url} failed ({})", out.status);
        }
        reads.push(serde_json::from_slice::<RankRead>(&out.stdout)?);
    }
    let rows: u64 = reads.iter().map(|r| r.rows).sum();
    let seconds = reads.iter().map(|r| r.seconds).fold(0.0, f64::max);
    let fetched: u64 = reads.iter().map(|r| r.fetched_bytes).sum();
    let projected = reads.first().map_or(0, |r| r.projected_bytes);
    Ok(SourceRead {
        url: url.to_owned(),
        ranks,
        rows,
        seconds,
        rows_per_s: rows as f64 / seconds.max(1e-9),
        mb_per_s: fetched as f64 / seconds.max(1e-9) / 1e6,
        fetched_bytes: fetched,
        projected_bytes: projected,
        fetched_over_projected: fetched as f64 / projected.max(1) as f64,
        peak_rss_bytes: reads.iter().map(|r| r.peak_rss_bytes).max().unwrap_or(0),
    })
}

pub fn run(cmd: &DataCmd) -> Result<bool> {
    match cmd {
        DataCmd::Make { path, rows, row_group, features, extra, classes, seed, to } => {
            let t = shoal_data::lake::planted::Planted {
                rows: *rows,
                row_group: *row_group,
                features: *features,
                extra: *extra,
                classes: *classes,
                seed: *seed,
            };
            let bytes = t.write(path)?;
            println!("{}: {rows} rows, {bytes} bytes", path.display());
            if let Some(url) = to {
                let sent = shoal_data::lake::source::upload(path, url)?;
                println!("{url}: {sent} bytes uploaded");
            }
            Ok(true)
        }
        DataCmd::ReadRank { url, columns, label, classes, ranks, rank, global_batch } => {
            let r = read_rank(url, columns, label, *classes, *ranks, *rank, *global_batch)?;
            println!("{}", serde_json::to_string(&r)?);
            Ok(true)
        }
        DataCmd::Bench { url, against, columns, label, classes, ranks, global_batch, json } => {
            let columns = if columns.is_empty() { (0..8).map(|j| format!("f{j}")).collect() } else { columns.clone() };
            let mut sources = vec![read_source(url, &columns, label, *classes, *ranks, *global_batch)?];
            if let Some(other) = against {
                sources.push(read_source(other, &columns, label, *classes, *ranks, *global_batch)?);
            }
            let ratio = (sources.len() == 2).then(|| sources[0].rows_per_s / sources[1].rows_per_s.max(1e-9));
            if *json {
                println!("{}", serde_json::json!({ "sources": sources, "ratio": ratio }));
                return Ok(true);
            }
            for s in &sources {
                println!(
                    "{}: {} rows by {} ranks in {:.2} s: {:.0} rows/s, {:.1} MB/s fetched; fetched {} bytes = {:.3} × the \
                     wanted columns' {} compressed bytes; peak memory of a rank {:.1} MB",
                    s.url,
                    s.rows,
                    s.ranks,
                    s.seconds,
                    s.rows_per_s,
                    s.mb_per_s,
                    s.fetched_bytes,
                    s.fetched_over_projected,
                    s.projected_bytes,
                    s.peak_rss_bytes as f64 / 1e6
                );
            }
            if let Some(r) = ratio {
                println!("{} against {}: {r:.3}× the rows per second", sources[0].url, sources[1].url);
            }
            Ok(true)
        }
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
