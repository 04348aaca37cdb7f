//! `shoal data inspect` against a real S3 server (s3s-fs, started by the test) and the same files on disk: the same
//! schema, rows, row groups and bytes from both, read through ranged requests.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use arrow_array::{Float32Array, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

use crate::support_s3::S3;

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-data-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Clicks: `rows` rows of user, item and a dense feature, 1000 rows a row group.
fn clicks(path: &Path, first: i64, rows: usize) {
    let schema = Arc::new(Schema::new(vec![
        Field::new("user", DataType::Int64, false),
        Field::new("item", DataType::Int64, false),
        Field::new("x0", DataType::Float32, false),
    ]));
    let users = Int64Array::from_iter_values((0..rows as i64).map(|i| (first + i) % 997));
    let items = Int64Array::from_iter_values((0..rows as i64).map(|i| (first + i) % 101));
    let xs = Float32Array::from_iter_values((0..rows).map(|i| i as f32 * 0.25));
    let batch =
        RecordBatch::try_new(schema.clone(), vec![Arc::new(users), Arc::new(items), Arc::new(xs)]).expect("a batch");
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("the file's directory");
    }
    let file = std::fs::File::create(path).expect("the Parquet file");
    let props = WriterProperties::builder().set_max_row_group_row_count(Some(1000)).build();
    let mut w = ArrowWriter::try_new(file, schema, Some(props)).expect("a writer");
    w.write(&batch).expect("write");
    w.close().expect("close");
}

fn inspect(envs: &[(String, String)], url: &str) -> Result<serde_json::Value, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["data", "inspect", url, "--json"])
        .envs(envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn inspect_reads_the_same_dataset_from_s3_as_from_disk() {
    let s3 = S3::start(&["lake"]).expect("start an S3 server for the test");
    let local = tmpdir("inspect");
    for (name, first, rows) in [("part-0.parquet", 0, 2500), ("part-1.parquet", 2500, 1200)] {
        clicks(&local.join(name), first, rows);
        clicks(&s3.object_path("lake", &format!("clicks/{name}")), first, rows);
    }
    std::fs::write(s3.object_path("lake", "clicks/README"), "not data").expect("a stray object");
    let env = s3.env().into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
    let remote = inspect(&env, "s3://lake/clicks/*.parquet").expect("inspect from S3");
    let disk = inspect(&[], &format!("{}/*.parquet", local.display())).expect("inspect from disk");
    for v in [&remote, &disk] {
        assert_eq!(v["format"], "parquet", "{v}");
        assert_eq!(v["rows"], 3700, "{v}");
        // 1000 rows a group: 3 + 2.
        assert_eq!(v["row_groups"], 5, "{v}");
        assert_eq!(v["files"].as_array().map(Vec::len), Some(2), "{v}");
        assert!(v["read_mb_s"].as_f64().is_some_and(|r| r > 0.0), "{v}");
    }
    assert_eq!(remote["columns"], disk["columns"]);
    assert_eq!(remote["bytes"], disk["bytes"]);
    assert_eq!(remote["files"][1]["url"], "s3://lake/clicks/part-1.parquet", "{remote}");
    let names: Vec<&str> =
        remote["columns"].as_array().into_iter().flatten().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(names, ["user", "item", "x0"]);

    // A prefix: the stray object has no known extension, and is named.
    let e = inspect(&env, "s3://lake/clicks/").err().unwrap_or_default();
    assert!(e.contains("s3://lake/clicks/README") && e.contains("extension"), "{e}");
    // Nothing there: the location is named.
    let e = inspect(&env, "s3://lake/none/*.csv").err().unwrap_or_default();
    assert!(e.contains("s3://lake/none/*.csv") && e.contains("names no file"), "{e}");
    // A CSV in the bucket.
    let table = s3.object_path("lake", "tables/t.csv");
    std::fs::create_dir_all(table.parent().expect("a directory")).expect("the key's directory");
    std::fs::write(&table, "a,b\n1,x\n2,y\n").expect("a CSV object");
    let csv = inspect(&env, "s3://lake/tables/t.csv").expect("inspect a CSV");
    assert_eq!((csv["format"].as_str(), csv["rows"].as_u64()), (Some("csv"), Some(2)), "{csv}");
}
