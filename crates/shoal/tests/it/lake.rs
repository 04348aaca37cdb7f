//! Training on data where it lives: a planted classification table as Parquet, CSV and JSONL, in a real S3 server
//! (s3s-fs, started by the test) and on disk. A model trained on the Parquet files from S3 ends with the parameters
//! and the held-out accuracy of the same files read from disk; CSV and JSONL train as well; a resumed run goes on
//! bit for bit; a missing or non-numeric column is refused naming it and the file, before any rank starts.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use arrow_array::{Float32Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

use shoal_data::lake::planted::Planted;

use crate::support_s3::S3;

pub(crate) type Res<T> = Result<T, String>;

const FEATURES: usize = 6;
const CLASSES: usize = 4;

fn tmpdir(tag: &str) -> Res<PathBuf> {
    let d = std::env::temp_dir().join(format!("shoal-lake-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    Ok(d)
}

/// Row `i` of the planted table (`shoal data make`'s, at 6 features and 4 classes): its features and class.
fn row(i: u64) -> (Vec<f32>, i64) {
    let planted = Planted { rows: 0, row_group: 1, features: FEATURES, extra: 0, classes: CLASSES, seed: 0 };
    planted.row(i)
}

pub(crate) fn names() -> Vec<String> {
    (0..FEATURES).map(|j| format!("f{j}")).collect()
}

/// Rows `rows` of the table as Parquet (500 rows a row group), with a text column beside.
fn parquet(path: &Path, rows: std::ops::Range<u64>) -> Res<()> {
    parquet_in_groups(path, rows, 500)
}

/// [`parquet`] with `group` rows a row group.
pub(crate) fn parquet_in_groups(path: &Path, rows: std::ops::Range<u64>, group: usize) -> Res<()> {
    let mut fields: Vec<Field> = names().iter().map(|n| Field::new(n, DataType::Float32, false)).collect();
    fields.push(Field::new("label", DataType::Int64, false));
    fields.push(Field::new("note", DataType::Utf8, false));
    let schema = Arc::new(Schema::new(fields));
    let data: Vec<_> = rows.clone().map(row).collect();
    let mut cols: Vec<Arc<dyn arrow_array::Array>> =
        (0..FEATURES).map(|j| Arc::new(Float32Array::from_iter_values(data.iter().map(|(x, _)| x[j]))) as _).collect();
    cols.push(Arc::new(Int64Array::from_iter_values(data.iter().map(|(_, c)| *c))));
    cols.push(Arc::new(StringArray::from_iter_values(rows.map(|i| format!("row {i}")))));
    let batch = RecordBatch::try_new(schema.clone(), cols).map_err(|e| e.to_string())?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    }
    let file = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let props = WriterProperties::builder().set_max_row_group_row_count(Some(group)).build();
    let mut w = ArrowWriter::try_new(file, schema, Some(props)).map_err(|e| e.to_string())?;
    w.write(&batch).map_err(|e| e.to_string())?;
    w.close().map_err(|e| e.to_string())?;
    Ok(())
}

/// The same rows as CSV (with a header) or JSONL.
fn text(path: &Path, rows: std::ops::Range<u64>, csv: bool) -> Res<()> {
    let mut out = String::new();
    if csv {
        out.push_str(&names().join(","));
        out.push_str(",label,note\n");
    }
    for i in rows {
        let (x, c) = row(i);
        if csv {
            for v in x {
                let _ = write!(out, "{v},");
            }
            let _ = writeln!(out, "{c},row {i}");
        } else {
            let fs: Vec<String> = x.iter().enumerate().map(|(j, v)| format!("\"f{j}\":{v}")).collect();
            let _ = writeln!(out, "{{{},\"label\":{c},\"note\":\"row {i}\"}}", fs.join(","));
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    }
    std::fs::write(path, out).map_err(|e| e.to_string())
}

/// A job training an MLP on `dataset` (the table's six features, four classes) for `steps` steps.
fn job(dir: &Path, name: &str, dataset: &str, steps: usize, extra: &str) -> Res<PathBuf> {
    let cols: Vec<String> = names().iter().map(|n| format!("\"{n}\"")).collect();
    let body = format!(
        "name = \"{name}\"\n[train]\ndataset = \"{dataset}\"\nglobal_batch = 64\nsteps = {steps}\nseed = 3\n\
         optimizer = \"adamw\"\nlr = 0.01\nschedule = \"constant\"\neval_every = 0\n[train.model]\nkind = \"mlp\"\n\
         hidden = [32]\n[train.data]\nfeature_columns = [{}]\nlabel_column = \"label\"\nclasses = {CLASSES}\n{extra}\
         [checkpoint]\nevery = 10\n",
        cols.join(", ")
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, body).map_err(|e| e.to_string())?;
    Ok(path)
}

fn shoal(envs: &[(String, String)], args: &[&str]) -> Res<Output> {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(args)
        .envs(envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .map_err(|e| e.to_string())
}

/// `shoal run -n 2` of `job` into `out` (`--resume` when asked); the run's `summary.json`.
fn run(envs: &[(String, String)], job: &Path, out: &Path, resume: bool) -> Res<serde_json::Value> {
    let (job, outs) = (job.display().to_string(), out.display().to_string());
    let mut args = vec!["run", "-n", "2", "--output", &outs];
    if resume {
        args.push("--resume");
    }
    args.push(&job);
    let o = shoal(envs, &args)?;
    if !o.status.success() {
        return Err(format!("{job}: {}", String::from_utf8_lossy(&o.stderr)));
    }
    let text = std::fs::read_to_string(out.join("summary.json")).map_err(|e| e.to_string())?;
    serde_json::from_str(&text).map_err(|e| e.to_string())
}

/// The model tensors a run's last checkpoint holds.
fn model(out: &Path, step: usize) -> Res<Vec<(String, Vec<u8>)>> {
    let bytes =
        std::fs::read(out.join(format!("checkpoints/step-{step:06}/model.safetensors"))).map_err(|e| e.to_string())?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let mut t: Vec<(String, Vec<u8>)> = st.tensors().into_iter().map(|(n, v)| (n, v.data().to_vec())).collect();
    t.sort();
    Ok(t)
}

fn accuracy(s: &serde_json::Value) -> Res<f64> {
    s["eval_accuracy"].as_f64().ok_or_else(|| format!("no eval_accuracy in {s}"))
}

#[test]
fn a_model_trained_on_parquet_from_s3_ends_where_the_same_files_from_disk_do() -> Res<()> {
    let s3 = S3::start(&["lake"])?;
    let local = tmpdir("train")?;
    for (k, rows) in [(0, 0..2600), (1, 2600..4000)] {
        let name = format!("part-{k}.parquet");
        parquet(&local.join("table").join(&name), rows.clone())?;
        parquet(&s3.object_path("lake", &format!("table/{name}")), rows.clone())?;
        text(&s3.object_path("lake", &format!("csv/part-{k}.csv")), rows.clone(), true)?;
        text(&s3.object_path("lake", &format!("jsonl/part-{k}.jsonl")), rows, false)?;
    }
    let env = s3.env().into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();

    let from_s3 = run(&env, &job(&local, "s3", "s3://lake/table/*.parquet", 40, "")?, &local.join("out-s3"), false)?;
    let disk_url = format!("{}/table/", local.display());
    let from_disk = run(&[], &job(&local, "disk", &disk_url, 40, "")?, &local.join("out-disk"), false)?;
    let acc = accuracy(&from_s3)?;
    assert!(acc > 0.8, "the MLP learns the planted classes from S3: held-out accuracy {acc}");
    assert_eq!(acc, accuracy(&from_disk)?, "the same held-out accuracy from disk");
    assert_eq!(from_s3["final_loss"], from_disk["final_loss"]);
    assert_eq!(model(&local.join("out-s3"), 40)?, model(&local.join("out-disk"), 40)?, "the same parameters");

    // Stopped at step 20 and resumed to 40: the same parameters as the straight run.
    let half = job(&local, "half", "s3://lake/table/*.parquet", 20, "")?;
    run(&env, &half, &local.join("out-half"), false)?;
    let rest = job(&local, "half", "s3://lake/table/*.parquet", 40, "")?;
    run(&env, &rest, &local.join("out-half"), true)?;
    assert_eq!(model(&local.join("out-half"), 40)?, model(&local.join("out-s3"), 40)?, "resumed at step 20");

    // CSV and JSONL from S3 train too (their blocks are whole files here, so their order differs from Parquet's).
    for format in ["csv", "jsonl"] {
        let url = format!("s3://lake/{format}/");
        let s = run(&env, &job(&local, format, &url, 40, "")?, &local.join(format!("out-{format}")), false)?;
        let acc = accuracy(&s)?;
        assert!(acc > 0.8, "{format}: held-out accuracy {acc}");
    }
    let _ = std::fs::remove_dir_all(local);
    Ok(())
}

#[test]
fn missing_and_non_numeric_columns_are_refused_naming_the_column_and_the_file() -> Res<()> {
    let s3 = S3::start(&["lake"])?;
    let local = tmpdir("refuse")?;
    parquet(&s3.object_path("lake", "t/part-0.parquet"), 0..600)?;
    let env = s3.env().into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
    for (extra_cols, needle) in
        [("f0\", \"nope", "has no column \"nope\""), ("f0\", \"note", "feature column \"note\" is Utf8, not a number")]
    {
        let job = job(&local, "bad", "s3://lake/t/*.parquet", 5, "")?;
        let body = std::fs::read_to_string(&job).map_err(|e| e.to_string())?;
        let body = body.replacen("feature_columns = [\"f0", &format!("feature_columns = [\"{extra_cols}"), 1);
        std::fs::write(&job, body).map_err(|e| e.to_string())?;
        let o = shoal(&env, &["run", "-n", "2", &job.display().to_string()])?;
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{needle}: {err}");
        assert!(err.contains(needle), "the error names the column ({needle}): {err}");
        assert!(err.contains("s3://lake/t/part-0.parquet"), "the error names the file: {err}");
        assert!(!err.contains("[rank"), "no rank starts: {err}");
    }
    let _ = std::fs::remove_dir_all(local);
    Ok(())
}

#[test]
fn a_table_uploaded_by_data_make_reads_the_same_rows_from_s3_as_from_disk() -> Res<()> {
    let s3 = S3::start(&["lake"])?;
    let local = tmpdir("bench")?;
    let env = s3.env().into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
    let path = local.join("t.parquet");
    let p = path.display().to_string();
    let made =
        shoal(&env, &["data", "make", &p, "--rows", "50000", "--row-group", "4096", "--to", "s3://lake/t/t.parquet"])?;
    assert!(made.status.success(), "data make: {}", String::from_utf8_lossy(&made.stderr));
    let on_s3 = std::fs::metadata(s3.object_path("lake", "t/t.parquet")).map_err(|e| e.to_string())?.len();
    assert_eq!(on_s3, std::fs::metadata(&path).map_err(|e| e.to_string())?.len(), "the upload holds every byte");

    let o = shoal(&env, &["data", "bench", "s3://lake/t/t.parquet", "--against", &p, "--json"])?;
    assert!(o.status.success(), "data bench: {}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
    let sources = v["sources"].as_array().ok_or_else(|| format!("no sources in {v}"))?;
    assert_eq!(sources.len(), 2, "{v}");
    // 8 lanes of 50,000 rows in global batches of 256: each lane's 6,250 rows hold 195 whole parts of 32.
    for s in sources {
        assert_eq!(s["rows"], 195 * 256, "every rank's rows of an epoch, from {}", s["url"]);
        let ratio = s["fetched_over_projected"].as_f64().ok_or("no fetched_over_projected")?;
        assert!((1.0..=1.2).contains(&ratio), "only the wanted columns fetched, about once: {ratio} from {}", s["url"]);
        assert!(s["peak_rss_bytes"].as_u64().is_some_and(|b| b > 0), "{s}");
    }
    assert_eq!(sources[0]["fetched_bytes"], sources[1]["fetched_bytes"], "the same reads from either");
    assert!(v["ratio"].as_f64().is_some_and(|r| r > 0.0), "{v}");
    let _ = std::fs::remove_dir_all(local);
    Ok(())
}

/// Cicero's text as a Parquet table, a paragraph (a line) a row, 40 rows a row group, with an id column beside.
fn text_parquet(path: &Path) -> Res<Vec<u8>> {
    let lines: Vec<&str> = lipsum::LIBER_PRIMUS.lines().filter(|l| !l.trim().is_empty()).collect();
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("text", DataType::Utf8, false),
    ]));
    let cols: Vec<Arc<dyn arrow_array::Array>> = vec![
        Arc::new(Int64Array::from_iter_values(0..lines.len() as i64)),
        Arc::new(StringArray::from_iter_values(lines.iter())),
    ];
    let batch = RecordBatch::try_new(schema.clone(), cols).map_err(|e| e.to_string())?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    }
    let file = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let props = WriterProperties::builder().set_max_row_group_row_count(Some(40)).build();
    let mut w = ArrowWriter::try_new(file, schema, Some(props)).map_err(|e| e.to_string())?;
    w.write(&batch).map_err(|e| e.to_string())?;
    w.close().map_err(|e| e.to_string())?;
    Ok(lines.join("\n").into_bytes())
}

#[test]
fn a_gpt_learns_a_text_column_read_from_s3() -> Res<()> {
    let s3 = S3::start(&["lake"])?;
    let local = tmpdir("text")?;
    let text = text_parquet(&s3.object_path("lake", "text/part-0.parquet"))?;
    let env = s3.env().into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
    let job = local.join("gpt.toml");
    let body = "name = \"lake-gpt\"\n[train]\ndataset = \"s3://lake/text/*.parquet\"\nglobal_batch = 32\nsteps = 300\n\
                seed = 1\noptimizer = \"adamw\"\nlr = 5e-3\nwarmup_steps = 20\nlog_every = 1000\n[train.model]\n\
                kind = \"gpt\"\nlayers = 1\nheads = 4\nwidth = 64\ncontext = 32\n[train.data]\ntext_column = \"text\"\n";
    std::fs::write(&job, body).map_err(|e| e.to_string())?;
    let s = run(&env, &job, &local.join("out"), false)?;
    // The entropy of the text's bytes: what a model of byte frequencies alone reaches.
    let mut counts = [0f64; 256];
    for &b in &text {
        counts[usize::from(b)] += 1.0;
    }
    let n = text.len() as f64;
    let unigram: f64 = counts.iter().filter(|&&c| c > 0.0).map(|&c| -(c / n) * (c / n).ln()).sum();
    let eval = s["eval_loss"].as_f64().ok_or_else(|| format!("no eval_loss in {s}"))?;
    assert!(eval < unigram - 0.3, "the GPT (eval loss {eval}) beats the text's byte entropy ({unigram})");
    assert!(s["eval_perplexity"].as_f64().is_some(), "{s}");
    assert_eq!(s["dataset"], "s3://lake/text/*.parquet", "{s}");

    // A text column that is not text, and feature columns beside a text column, are refused naming them.
    let bad = body.replace("text_column = \"text\"", "text_column = \"id\"");
    std::fs::write(&job, bad).map_err(|e| e.to_string())?;
    let o = shoal(&env, &["run", "-n", "2", &job.display().to_string()])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("text column \"id\" is Int64, not text"), "{err}");
    let both = body.replace("text_column = \"text\"", "text_column = \"text\"\nfeature_columns = [\"id\"]");
    std::fs::write(&job, both).map_err(|e| e.to_string())?;
    let o = shoal(&env, &["run", "-n", "2", &job.display().to_string()])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("train.data.feature_columns"), "{err}");
    let _ = std::fs::remove_dir_all(local);
    Ok(())
}
