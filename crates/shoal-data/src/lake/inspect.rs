//! `shoal data inspect`: what a location holds, read from where it is.

use std::time::Instant;

use futures_util::StreamExt;
use object_store::ObjectStoreExt;
use parquet::arrow::parquet_to_arrow_schema;
use parquet::errors::ParquetError;
use parquet::file::metadata::ParquetMetaDataReader;
use serde::Serialize;

use super::source::{Format, LakeFile, Source};
use crate::error::{Error, Result};

/// Bytes read from the start of a CSV or JSONL file to infer its schema.
const SCHEMA_PROBE: u64 = 64 << 10;
/// Records a schema is inferred from.
const SCHEMA_RECORDS: usize = 100;

/// A column: its name, its Arrow type, whether it may be null.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Column {
    pub name: String,
    pub data_type: String,
    pub nullable: bool,
}

/// One file's figures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileReport {
    pub url: String,
    pub bytes: u64,
    pub rows: u64,
    /// Parquet's row groups (none for CSV and JSONL).
    pub row_groups: Option<u64>,
}

/// What a location holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Inspection {
    pub url: String,
    pub format: Format,
    pub columns: Vec<Column>,
    pub files: Vec<FileReport>,
    pub rows: u64,
    pub row_groups: Option<u64>,
    pub bytes: u64,
    /// Reading every byte once, in order, from where it is: seconds and megabytes (10^6) per second.
    pub read_seconds: f64,
    pub read_mb_s: f64,
}

fn bad(url: &str, why: impl std::fmt::Display) -> Error {
    Error::Malformed { what: url.to_owned(), reason: why.to_string() }
}

fn columns(schema: &arrow_schema::Schema) -> Vec<Column> {
    schema
        .fields()
        .iter()
        .map(|f| Column { name: f.name().clone(), data_type: f.data_type().to_string(), nullable: f.is_nullable() })
        .collect()
}

/// Inspects `location` (see [`Source::open`]) read as `format` (default: the files' extension): every file's schema
/// must be the first one's (a file that differs is named), Parquet's rows and row groups come from its footers,
/// CSV's and JSONL's rows are its records (lines; a CSV's header is not one), and every byte is read once to time
/// the read.
pub fn inspect(location: &str, format: Option<Format>) -> Result<Inspection> {
    let source = Source::open(location)?;
    let format = source.format(format)?;
    let mut schema: Option<arrow_schema::Schema> = None;
    let mut files = Vec::with_capacity(source.files.len());
    for f in &source.files {
        let (this, rows, row_groups) = match format {
            Format::Parquet => source.rt.block_on(parquet_meta(&source, f))?,
            Format::Csv | Format::Jsonl => (source.rt.block_on(text_schema(&source, f, format))?, 0, None),
        };
        match &schema {
            None => schema = Some(this),
            Some(first) if *first != this => {
                return Err(bad(&f.url, format!("its schema differs from the first file's ({})", source.files[0].url)));
            }
            Some(_) => {}
        }
        files.push(FileReport { url: f.url.clone(), bytes: f.bytes, rows, row_groups });
    }
    // Read every byte once, counting lines for the text formats.
    let start = Instant::now();
    for (f, report) in source.files.iter().zip(&mut files) {
        let (bytes, lines) = source.rt.block_on(read_all(&source, f))?;
        if bytes != f.bytes {
            return Err(bad(&f.url, format!("read {bytes} bytes of {}", f.bytes)));
        }
        match format {
            Format::Csv => report.rows = lines.saturating_sub(1),
            Format::Jsonl => report.rows = lines,
            Format::Parquet => {}
        }
    }
    let read_seconds = start.elapsed().as_secs_f64();
    let bytes: u64 = files.iter().map(|f| f.bytes).sum();
    Ok(Inspection {
        url: source.url.clone(),
        format,
        columns: schema.as_ref().map(columns).unwrap_or_default(),
        rows: files.iter().map(|f| f.rows).sum(),
        row_groups: (format == Format::Parquet).then(|| files.iter().filter_map(|f| f.row_groups).sum()),
        files,
        bytes,
        read_seconds,
        read_mb_s: bytes as f64 / read_seconds.max(1e-9) / 1e6,
    })
}

/// A Parquet file's schema, rows and row groups, from its footer: a ranged read of the file's end (64 KiB, or
/// what the footer says it needs).
async fn parquet_meta(source: &Source, f: &LakeFile) -> Result<(arrow_schema::Schema, u64, Option<u64>)> {
    let len = f.bytes;
    let mut want = len.min(SCHEMA_PROBE);
    let mut reader = ParquetMetaDataReader::new();
    for _ in 0..3 {
        let tail = source.store.get_range(&f.path, len - want..len).await.map_err(|e| bad(&f.url, e))?;
        match reader.try_parse_sized(&tail, len) {
            Ok(()) => {
                let meta = reader.finish().map_err(|e| bad(&f.url, e))?;
                let file = meta.file_metadata();
                let schema = parquet_to_arrow_schema(file.schema_descr(), file.key_value_metadata())
                    .map_err(|e| bad(&f.url, e))?;
                let rows = u64::try_from(file.num_rows()).unwrap_or(0);
                return Ok((schema, rows, Some(meta.num_row_groups() as u64)));
            }
            Err(ParquetError::NeedMoreData(needed)) if (needed as u64) <= len => want = needed as u64,
            Err(e) => return Err(bad(&f.url, format!("not a Parquet file: {e}"))),
        }
    }
    Err(bad(&f.url, "its footer could not be read"))
}

/// A CSV (with a header) or JSONL file's schema, inferred from its first records.
pub(super) async fn text_schema(source: &Source, f: &LakeFile, format: Format) -> Result<arrow_schema::Schema> {
    let end = f.bytes.min(SCHEMA_PROBE);
    let head = source.store.get_range(&f.path, 0..end).await.map_err(|e| bad(&f.url, e))?;
    // Whole records only, unless the file is all there.
    let cut = if end < f.bytes { head.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) } else { head.len() };
    let text = &head[..cut];
    let schema = match format {
        Format::Csv => {
            arrow_csv::reader::Format::default().with_header(true).infer_schema(text, Some(SCHEMA_RECORDS)).map(|s| s.0)
        }
        _ => arrow_json::reader::infer_json_schema(std::io::BufReader::new(text), Some(SCHEMA_RECORDS)).map(|s| s.0),
    };
    schema.map_err(|e| bad(&f.url, e))
}

/// Streams a whole file: its bytes and its lines (a last line without its newline counted).
async fn read_all(source: &Source, f: &LakeFile) -> Result<(u64, u64)> {
    let got = source.store.get(&f.path).await.map_err(|e| bad(&f.url, e))?;
    let mut stream = got.into_stream();
    let (mut bytes, mut lines, mut last) = (0u64, 0u64, b'\n');
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| bad(&f.url, e))?;
        bytes += chunk.len() as u64;
        lines += chunk.iter().filter(|&&b| b == b'\n').count() as u64;
        if let Some(&b) = chunk.last() {
            last = b;
        }
    }
    if last != b'\n' {
        lines += 1;
    }
    Ok((bytes, lines))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{Float32Array, Int64Array, RecordBatch, StringArray};
    use arrow_schema::{DataType, Field, Schema};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;

    use super::*;

    fn dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("shoal-lake-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).ok();
        d
    }

    fn write_parquet(path: &std::path::Path, first: i64, rows: usize) -> Result<()> {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("x", DataType::Float32, false),
            Field::new("tag", DataType::Utf8, true),
        ]));
        let ids = Int64Array::from_iter_values((0..rows as i64).map(|i| first + i));
        let xs = Float32Array::from_iter_values((0..rows).map(|i| i as f32 * 0.5));
        let tags = StringArray::from_iter((0..rows).map(|i| (i % 3 != 0).then(|| format!("t{i}"))));
        let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(ids), Arc::new(xs), Arc::new(tags)])
            .map_err(|e| bad("batch", e))?;
        let file = std::fs::File::create(path).map_err(|e| Error::Io { what: "create".into(), source: e })?;
        let props = WriterProperties::builder().set_max_row_group_row_count(Some(100)).build();
        let mut w = ArrowWriter::try_new(file, schema, Some(props)).map_err(|e| bad("writer", e))?;
        w.write(&batch).map_err(|e| bad("write", e))?;
        w.close().map_err(|e| bad("close", e))?;
        Ok(())
    }

    #[test]
    fn parquet_files_under_a_glob_give_schema_rows_and_row_groups() -> Result<()> {
        let d = dir("pq");
        write_parquet(&d.join("part-0.parquet"), 0, 250)?;
        write_parquet(&d.join("part-1.parquet"), 250, 120)?;
        std::fs::write(d.join("notes.txt"), "not data").ok();
        let got = inspect(&format!("{}/*.parquet", d.display()), None)?;
        assert_eq!(got.format, Format::Parquet);
        assert_eq!(got.rows, 370);
        // 100 rows a group: 3 + 2.
        assert_eq!(got.row_groups, Some(5));
        assert_eq!(got.files.len(), 2);
        let names: Vec<&str> = got.columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["id", "x", "tag"]);
        assert_eq!((got.columns[1].data_type.as_str(), got.columns[2].nullable), ("Float32", true));
        let on_disk: u64 = ["part-0.parquet", "part-1.parquet"]
            .iter()
            .map(|f| std::fs::metadata(d.join(f)).map(|m| m.len()).unwrap_or(0))
            .sum();
        assert_eq!(got.bytes, on_disk);
        assert!(got.read_mb_s > 0.0);
        Ok(())
    }

    #[test]
    fn csv_and_jsonl_count_records_and_infer_types() -> Result<()> {
        let d = dir("text");
        std::fs::write(d.join("a.csv"), "user,item,clicked\n1,10,0.5\n2,20,1.5\n3,30,0").ok();
        let got = inspect(&d.join("a.csv").display().to_string(), None)?;
        assert_eq!((got.format, got.rows, got.row_groups), (Format::Csv, 3, None));
        let types: Vec<(&str, &str)> = got.columns.iter().map(|c| (c.name.as_str(), c.data_type.as_str())).collect();
        assert_eq!(types, [("user", "Int64"), ("item", "Int64"), ("clicked", "Float64")]);
        std::fs::write(d.join("b.jsonl"), "{\"text\": \"salve\", \"n\": 1}\n{\"text\": \"vale\", \"n\": 2}\n").ok();
        let got = inspect(&format!("{}/", d.display()), Some(Format::Jsonl)).err();
        // The directory mixes a CSV in: read as JSONL, its schema differs, and the file is named.
        assert!(got.is_some_and(|e| e.to_string().contains("a.csv")));
        let got = inspect(&format!("{}/*.jsonl", d.display()), None)?;
        assert_eq!((got.format, got.rows), (Format::Jsonl, 2));
        assert_eq!(got.columns.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["n", "text"]);
        Ok(())
    }

    #[test]
    fn a_location_with_nothing_is_refused_naming_it() {
        let d = dir("none");
        let e = inspect(&format!("{}/*.parquet", d.display()), None).err().map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("names no file") && e.contains("*.parquet")));
        let e = inspect(&format!("{}/missing.csv", d.display()), None).err().map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("missing.csv")), "");
    }
}
