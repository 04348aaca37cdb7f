//! A table in a data lake as a [`Dataset`]: the rows of Parquet, CSV or JSONL files where they live, each row a
//! sample of numeric feature columns and an integer class column — or, with a text column ([`TableSpec::text`]),
//! text for a language model: each block's rows joined by newlines, its bytes the tokens, cut into windows of
//! `context + 1` bytes (input and next-token target) as the built-in text is.
//!
//! A text block's windows are counted before it is read, from its size (a Parquet row group's text column chunk,
//! uncompressed, less the values' length prefixes; a CSV or JSONL block's bytes): `max(1, bytes / context)`
//! windows, spread evenly over the text the block really holds once read. So the dataset's length is known when it
//! is opened without reading it, every window is real text, and windows overlap or leave gaps only as much as that
//! count is off.
//!
//! The files are cut into *blocks* — a Parquet file's row groups; a CSV or JSONL file's byte ranges of about
//! [`TEXT_BLOCK_BYTES`] ending on a record boundary (found by one streamed pass over the file when it is opened) —
//! which are the unit of reading: the first `get` of a row in a block fetches that block alone (a Parquet row group's
//! projected column chunks, or the block's byte range) and decodes it into features and labels, kept in a cache
//! bounded in bytes (least recently used out first). The sampler reads blocks in runs ([`DistributedSampler`]'s
//! lanes), so a rank holds a few decoded blocks at a time whatever the dataset's size.
//!
//! Schema errors — a missing column, a feature that is not a number, a label that is not a non-negative integer
//! below `classes` — name the column and the file (and, for a label, the row).
//!
//! [`DistributedSampler`]: crate::DistributedSampler

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow_array::{Array, RecordBatch};
use arrow_schema::{DataType, Schema};
use bytes::Bytes;
use futures_util::future::{BoxFuture, FutureExt};
use futures_util::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::arrow::async_reader::{AsyncFileReader, ParquetRecordBatchStreamBuilder};
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};

use super::source::{Format, LakeFile, Source};
use crate::error::{Error, Result};
use crate::{Dataset, DatasetInfo, Kind, Sample};

/// A CSV or JSONL block's size, about (it ends at the first record boundary after it).
pub const TEXT_BLOCK_BYTES: u64 = 4 << 20;

/// What to read from a lake location (`train.dataset` and `[train.data]`).
#[derive(Debug, Clone, PartialEq)]
pub struct TableSpec {
    pub location: String,
    /// `None`: from the files' extensions.
    pub format: Option<Format>,
    pub features: Vec<String>,
    pub label: String,
    pub classes: usize,
    /// The text column of a language model's data (`features`, `label` and `classes` then unused).
    pub text: Option<String>,
    /// Tokens a text window gives as input (its target is the same shifted by one).
    pub context: usize,
    /// Most bytes of decoded blocks held at once (at least one block is always held).
    pub cache_bytes: usize,
}

/// Where a block's rows are.
#[derive(Debug, Clone, PartialEq)]
enum Place {
    RowGroup(usize),
    /// Byte range of whole records (a CSV block never holds the header).
    Bytes(Range<u64>),
}

#[derive(Debug, Clone, PartialEq)]
struct Block {
    file: usize,
    place: Place,
    /// Index of the block's first sample in the table.
    first: usize,
    /// Records (rows) it holds.
    rows: usize,
    /// Samples it gives: its rows, or for text its windows.
    samples: usize,
}

/// One decoded block.
#[derive(Debug)]
struct Decoded {
    features: Vec<f32>,
    labels: Vec<u32>,
    /// Text: the rows' bytes, joined by newlines.
    text: Vec<u8>,
}

impl Decoded {
    fn bytes(&self) -> usize {
        (self.features.len() + self.labels.len()) * 4 + self.text.len()
    }
}

#[derive(Debug, Default)]
struct Cache {
    blocks: HashMap<usize, Arc<Decoded>>,
    order: VecDeque<usize>,
    bytes: usize,
}

/// How each file is read.
#[derive(Debug)]
enum Reading {
    /// A Parquet file's footer, read once, and the mask of the wanted columns.
    Parquet(Vec<(ArrowReaderMetadata, ProjectionMask)>),
    /// The text files' schema (the first file's, which every file must have) and whether a CSV has a header.
    Text(Arc<Schema>),
}

/// Decoded blocks a table keeps by default: enough for a rank's lanes' current and next blocks at the usual row
/// group sizes (a rank of a 2 GB table read in 8 lanes peaks under 300 MB resident).
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;

/// A lake table as a [`Dataset`]. See the [module docs](self).
#[derive(Debug)]
pub struct LakeTable {
    spec: TableSpec,
    format: Format,
    source: Source,
    reading: Reading,
    blocks: Vec<Block>,
    len: usize,
    cache: Mutex<Cache>,
    /// Serialises fetches (the I/O runtime is one thread).
    fetching: Mutex<()>,
    fetched: Arc<AtomicU64>,
}

fn bad(url: &str, why: impl std::fmt::Display) -> Error {
    Error::Lake { url: url.to_owned(), why: why.to_string() }
}

/// Whether arrow can turn a column of this type into features.
fn numeric(t: &DataType) -> bool {
    t.is_numeric() || matches!(t, DataType::Boolean)
}

/// Checks that `schema` (of the file `url`) has every wanted column, with numbers where features are wanted and
/// integers where the label is; the columns' indices, features first, then the label.
fn columns(schema: &Schema, spec: &TableSpec, url: &str) -> Result<Vec<usize>> {
    let have = || schema.fields().iter().map(|f| f.name().as_str()).collect::<Vec<_>>().join(", ");
    if let Some(name) = &spec.text {
        let i =
            schema.index_of(name).map_err(|_| bad(url, format!("has no column {name:?} (its columns: {})", have())))?;
        let t = schema.field(i).data_type();
        if !matches!(
            t,
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View | DataType::Binary | DataType::LargeBinary
        ) {
            return Err(bad(url, format!("text column {name:?} is {t}, not text")));
        }
        return Ok(vec![i]);
    }
    let mut out = Vec::with_capacity(spec.features.len() + 1);
    for (name, label) in spec.features.iter().map(|f| (f, false)).chain([(&spec.label, true)]) {
        let Ok(i) = schema.index_of(name) else {
            return Err(bad(url, format!("has no column {name:?} (its columns: {})", have())));
        };
        let t = schema.field(i).data_type();
        if label && !t.is_integer() {
            return Err(bad(url, format!("label column {name:?} is {t}, not an integer")));
        }
        if !numeric(t) {
            return Err(bad(url, format!("feature column {name:?} is {t}, not a number")));
        }
        out.push(i);
    }
    Ok(out)
}

impl LakeTable {
    /// Opens `spec.location`: lists its files, reads every Parquet footer (or streams every CSV/JSONL file once to
    /// find its blocks' record boundaries), and checks the columns in every file.
    pub fn open(spec: TableSpec) -> Result<LakeTable> {
        let source = Source::open(&spec.location)?;
        let format = source.format(spec.format)?;
        let mut blocks = Vec::new();
        let mut first = 0usize;
        let reading = match format {
            Format::Parquet => {
                let mut metas = Vec::with_capacity(source.files.len());
                for (k, f) in source.files.iter().enumerate() {
                    let meta = source.rt.block_on(parquet_footer(&source, f))?;
                    let wanted = columns(meta.schema(), &spec, &f.url)?;
                    let mask = ProjectionMask::roots(meta.parquet_schema(), wanted);
                    for (g, rg) in meta.metadata().row_groups().iter().enumerate() {
                        let rows = usize::try_from(rg.num_rows()).unwrap_or(0);
                        if rows == 0 {
                            continue;
                        }
                        let samples = match spec.text {
                            Some(_) => {
                                let chunk: i64 = rg
                                    .columns()
                                    .iter()
                                    .enumerate()
                                    .filter(|(i, _)| mask.leaf_included(*i))
                                    .map(|(_, c)| c.uncompressed_size())
                                    .sum();
                                // Each value's 4-byte length prefix is not text.
                                let text = usize::try_from(chunk).unwrap_or(0).saturating_sub(4 * rows);
                                windows(text, spec.context)
                            }
                            None => rows,
                        };
                        blocks.push(Block { file: k, place: Place::RowGroup(g), first, rows, samples });
                        first += samples;
                    }
                    metas.push((meta, mask));
                }
                Reading::Parquet(metas)
            }
            Format::Csv | Format::Jsonl => {
                let schema =
                    Arc::new(source.rt.block_on(super::inspect::text_schema(&source, &source.files[0], format))?);
                for (k, f) in source.files.iter().enumerate() {
                    if k > 0 {
                        let this = source.rt.block_on(super::inspect::text_schema(&source, f, format))?;
                        if this.fields() != schema.fields() {
                            return Err(bad(&f.url, format!("its columns differ from {}'s", source.files[0].url)));
                        }
                    }
                    columns(&schema, &spec, &f.url)?;
                    for (range, rows) in source.rt.block_on(text_blocks(&source, f, format))? {
                        if rows == 0 {
                            continue;
                        }
                        let samples = match spec.text {
                            Some(_) => windows((range.end - range.start) as usize, spec.context),
                            None => rows,
                        };
                        blocks.push(Block { file: k, place: Place::Bytes(range), first, rows, samples });
                        first += samples;
                    }
                }
                Reading::Text(schema)
            }
        };
        Ok(LakeTable {
            spec,
            format,
            source,
            reading,
            blocks,
            len: first,
            cache: Mutex::new(Cache::default()),
            fetching: Mutex::new(()),
            fetched: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The blocks' row ranges, in table order (what the sampler's lanes read in runs).
    pub fn blocks(&self) -> Vec<Range<usize>> {
        self.blocks.iter().map(|b| b.first..b.first + b.samples).collect()
    }

    /// Bytes fetched from the store so far for rows (footers and the text formats' boundary pass not counted).
    pub fn fetched_bytes(&self) -> u64 {
        self.fetched.load(Ordering::Relaxed)
    }

    /// The compressed bytes of the wanted columns in every Parquet row group (what reading every row must fetch at
    /// least); the files' bytes for the text formats.
    pub fn projected_bytes(&self) -> u64 {
        match &self.reading {
            Reading::Parquet(metas) => metas
                .iter()
                .map(|(meta, mask)| {
                    meta.metadata()
                        .row_groups()
                        .iter()
                        .flat_map(|rg| rg.columns().iter().enumerate())
                        .filter(|(i, _)| mask.leaf_included(*i))
                        .map(|(_, c)| u64::try_from(c.compressed_size()).unwrap_or(0))
                        .sum::<u64>()
                })
                .sum(),
            Reading::Text(_) => self.source.files.iter().map(|f| f.bytes).sum(),
        }
    }

    /// The block holding row `index`.
    fn block_of(&self, index: usize) -> Option<usize> {
        let k = self.blocks.partition_point(|b| b.first + b.samples <= index);
        (k < self.blocks.len()).then_some(k)
    }

    /// Block `k`, decoded, from the cache or fetched.
    fn decoded(&self, k: usize) -> Result<Arc<Decoded>> {
        if let Some(d) = self.lock_cache().blocks.get(&k) {
            return Ok(Arc::clone(d));
        }
        let _one = self.fetching.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Another thread may have fetched it while this one waited.
        if let Some(d) = self.lock_cache().blocks.get(&k) {
            return Ok(Arc::clone(d));
        }
        let d = Arc::new(self.fetch(k)?);
        let mut c = self.lock_cache();
        c.bytes += d.bytes();
        c.blocks.insert(k, Arc::clone(&d));
        c.order.push_back(k);
        while c.bytes > self.spec.cache_bytes && c.order.len() > 1 {
            if let Some(old) = c.order.pop_front()
                && let Some(gone) = c.blocks.remove(&old)
            {
                c.bytes -= gone.bytes();
            }
        }
        Ok(d)
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reads and decodes block `k`.
    fn fetch(&self, k: usize) -> Result<Decoded> {
        let b = &self.blocks[k];
        let f = &self.source.files[b.file];
        let batches = match (&self.reading, &b.place) {
            (Reading::Parquet(metas), Place::RowGroup(g)) => {
                let (meta, mask) = &metas[b.file];
                let reader = Ranged::new(&self.source, f, Arc::clone(&self.fetched));
                self.source.rt.block_on(async {
                    let stream = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, meta.clone())
                        .with_projection(mask.clone())
                        .with_row_groups(vec![*g])
                        .with_batch_size(b.rows.max(1))
                        .build()
                        .map_err(|e| bad(&f.url, e))?;
                    stream.try_collect::<Vec<RecordBatch>>().await.map_err(|e| bad(&f.url, e))
                })?
            }
            (Reading::Text(schema), Place::Bytes(range)) => {
                let raw = self
                    .source
                    .rt
                    .block_on(self.source.store.get_range(&f.path, range.clone()))
                    .map_err(|e| bad(&f.url, e))?;
                self.fetched.fetch_add(raw.len() as u64, Ordering::Relaxed);
                decode_text(&raw, schema, self.format, b.rows).map_err(|e| bad(&f.url, e))?
            }
            _ => return Err(bad(&f.url, "a block read in a format other than its file's")),
        };
        self.decode(k, &batches)
    }

    /// Features (cast to f32, row-major) and labels of a block's record batches; or its text.
    fn decode(&self, k: usize, batches: &[RecordBatch]) -> Result<Decoded> {
        let b = &self.blocks[k];
        let url = &self.source.files[b.file].url;
        if let Some(name) = &self.spec.text {
            let mut text = Vec::new();
            for batch in batches {
                let col = batch.column_by_name(name).ok_or_else(|| bad(url, "lost its text column"))?;
                let col = arrow_cast::cast(col, &DataType::LargeBinary).map_err(|e| bad(url, e))?;
                let col = col
                    .as_any()
                    .downcast_ref::<arrow_array::LargeBinaryArray>()
                    .ok_or_else(|| bad(url, "a text column cast to bytes is not bytes"))?;
                for v in col.iter().flatten() {
                    if !text.is_empty() {
                        text.push(b'\n');
                    }
                    text.extend_from_slice(v);
                }
            }
            if text.is_empty() {
                return Err(bad(url, format!("block {k}'s rows of text column {name:?} hold no text")));
            }
            return Ok(Decoded { features: Vec::new(), labels: Vec::new(), text });
        }
        let width = self.spec.features.len();
        let mut features = vec![0f32; b.rows * width];
        let mut labels = Vec::with_capacity(b.rows);
        let mut row = 0usize;
        for batch in batches {
            let n = batch.num_rows();
            if row + n > b.rows {
                return Err(bad(url, format!("a block said to hold {} rows holds more", b.rows)));
            }
            for (j, name) in self.spec.features.iter().enumerate() {
                let col = column_f32(batch, name).map_err(|why| bad(url, why))?;
                for (r, v) in col.iter().enumerate() {
                    features[(row + r) * width + j] = v.unwrap_or(f32::NAN);
                }
            }
            let col = batch.column_by_name(&self.spec.label).ok_or_else(|| bad(url, "lost its label column"))?;
            let ints = arrow_cast::cast(col, &DataType::Int64).map_err(|e| bad(url, e))?;
            let ints = ints
                .as_any()
                .downcast_ref::<arrow_array::Int64Array>()
                .ok_or_else(|| bad(url, "a label column cast to Int64 is not one"))?;
            for (r, v) in ints.iter().enumerate() {
                let class = v
                    .and_then(|v| u32::try_from(v).ok())
                    .filter(|&c| (c as usize) < self.spec.classes)
                    .ok_or_else(|| {
                        bad(
                            url,
                            format!(
                                "row {} of label column {:?} is {v:?}, not a class in 0..{} (classes)",
                                b.first + row + r,
                                self.spec.label,
                                self.spec.classes
                            ),
                        )
                    })?;
                labels.push(class);
            }
            row += n;
        }
        if row != b.rows {
            return Err(bad(url, format!("a block said to hold {} rows holds {row}", b.rows)));
        }
        Ok(Decoded { features, labels, text: Vec::new() })
    }
}

/// Windows of `context` tokens a text block of about `bytes` bytes gives.
fn windows(bytes: usize, context: usize) -> usize {
    (bytes / context.max(1)).max(1)
}

/// A column of `batch` cast to f32.
fn column_f32(batch: &RecordBatch, name: &str) -> std::result::Result<arrow_array::Float32Array, String> {
    let col = batch.column_by_name(name).ok_or_else(|| format!("lost its column {name:?}"))?;
    let cast = arrow_cast::cast(col, &DataType::Float32).map_err(|e| format!("column {name:?}: {e}"))?;
    cast.as_any()
        .downcast_ref::<arrow_array::Float32Array>()
        .cloned()
        .ok_or_else(|| format!("column {name:?} did not become f32"))
}

/// Decodes a byte range of whole CSV (no header) or JSONL records.
fn decode_text(
    raw: &Bytes,
    schema: &Arc<Schema>,
    format: Format,
    rows: usize,
) -> std::result::Result<Vec<RecordBatch>, String> {
    let batch = rows.max(1);
    match format {
        Format::Csv => arrow_csv::ReaderBuilder::new(Arc::clone(schema))
            .with_header(false)
            .with_batch_size(batch)
            .build(std::io::Cursor::new(raw.as_ref()))
            .map_err(|e| e.to_string())?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| e.to_string()),
        _ => arrow_json::ReaderBuilder::new(Arc::clone(schema))
            .with_batch_size(batch)
            .build(std::io::Cursor::new(raw.as_ref()))
            .map_err(|e| e.to_string())?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| e.to_string()),
    }
}

/// A Parquet file's footer, read once with ranged reads of its end.
async fn parquet_footer(source: &Source, f: &LakeFile) -> Result<ArrowReaderMetadata> {
    let mut reader = Ranged::new(source, f, Arc::new(AtomicU64::new(0)));
    ArrowReaderMetadata::load_async(&mut reader, ArrowReaderOptions::new())
        .await
        .map_err(|e| bad(&f.url, format!("not a Parquet file: {e}")))
}

/// A CSV or JSONL file's blocks: byte ranges of about [`TEXT_BLOCK_BYTES`] of whole records (after a CSV's header
/// line), with their record counts, from one streamed pass.
async fn text_blocks(source: &Source, f: &LakeFile, format: Format) -> Result<Vec<(Range<u64>, usize)>> {
    let got = source.store.get(&f.path).await.map_err(|e| bad(&f.url, e))?;
    let mut stream = got.into_stream();
    let mut out = Vec::new();
    let (mut at, mut start, mut rows) = (0u64, 0u64, 0usize);
    let mut header = format == Format::Csv;
    let mut line_empty = true;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| bad(&f.url, e))?;
        for &byte in chunk.iter() {
            at += 1;
            if byte != b'\n' {
                line_empty &= byte == b'\r' || byte == b' ';
                continue;
            }
            if header {
                header = false;
                start = at;
            } else if !line_empty {
                rows += 1;
            }
            line_empty = true;
            if at - start >= TEXT_BLOCK_BYTES {
                out.push((start..at, rows));
                (start, rows) = (at, 0);
            }
        }
    }
    if !line_empty && !header {
        rows += 1;
    }
    if at > start {
        out.push((start..at, rows));
    }
    Ok(out)
}

/// A Parquet file in the store, read by ranged requests, the bytes fetched counted.
struct Ranged {
    store: Arc<dyn object_store::ObjectStore>,
    path: object_store::path::Path,
    size: u64,
    fetched: Arc<AtomicU64>,
}

impl Ranged {
    fn new(source: &Source, f: &LakeFile, fetched: Arc<AtomicU64>) -> Ranged {
        Ranged { store: Arc::clone(&source.store), path: f.path.clone(), size: f.bytes, fetched }
    }
}

fn store_err(e: object_store::Error) -> parquet::errors::ParquetError {
    parquet::errors::ParquetError::External(Box::new(e))
}

impl AsyncFileReader for Ranged {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        async move {
            let b = self.store.get_range(&self.path, range).await.map_err(store_err)?;
            self.fetched.fetch_add(b.len() as u64, Ordering::Relaxed);
            Ok(b)
        }
        .boxed()
    }

    fn get_byte_ranges(&mut self, ranges: Vec<Range<u64>>) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        async move {
            let v = self.store.get_ranges(&self.path, &ranges).await.map_err(store_err)?;
            self.fetched.fetch_add(v.iter().map(|b| b.len() as u64).sum(), Ordering::Relaxed);
            Ok(v)
        }
        .boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        _options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        async move {
            let size = self.size;
            let meta =
                ParquetMetaDataReader::new().with_prefetch_hint(Some(64 << 10)).load_and_finish(self, size).await?;
            Ok(Arc::new(meta))
        }
        .boxed()
    }
}

impl Dataset for LakeTable {
    fn info(&self) -> DatasetInfo {
        if let Some(text) = &self.spec.text {
            return DatasetInfo {
                name: self.spec.location.clone(),
                kind: Kind::Text,
                len: self.len,
                features: self.spec.context,
                classes: 256,
                description: format!(
                    "{} ({} file(s), {} blocks): text column {text}, windows of {} bytes",
                    self.spec.location,
                    self.source.files.len(),
                    self.blocks.len(),
                    self.spec.context
                ),
            };
        }
        DatasetInfo {
            name: self.spec.location.clone(),
            kind: Kind::Tabular,
            len: self.len,
            features: self.spec.features.len(),
            classes: self.spec.classes,
            description: format!(
                "{} ({} file(s), {} blocks): features {}, label {}",
                self.spec.location,
                self.source.files.len(),
                self.blocks.len(),
                self.spec.features.join(", "),
                self.spec.label
            ),
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> Result<Sample> {
        let k = self.block_of(index).ok_or(Error::OutOfRange {
            dataset: self.spec.location.clone(),
            index,
            len: self.len,
        })?;
        let d = self.decoded(k)?;
        let r = index - self.blocks[k].first;
        if self.spec.text.is_some() {
            // Window r of the block's windows, spread evenly over its text (taken round it when shorter).
            let (n, w, len) = (self.blocks[k].samples, self.spec.context + 1, d.text.len());
            let start = if n <= 1 || len <= w { 0 } else { r * (len - w) / (n - 1) };
            let bytes: Vec<u32> = (start..start + w).map(|i| u32::from(d.text[i % len])).collect();
            return Ok(Sample {
                features: crate::Features::Tokens(bytes[..w - 1].to_vec()),
                label: crate::Label::Tokens(bytes[1..].to_vec()),
            });
        }
        let w = self.spec.features.len();
        Ok(Sample::class(d.features[r * w..(r + 1) * w].to_vec(), d.labels[r]))
    }
}

/// A contiguous range of a lake table's rows (a training or a held-out part), as a dataset.
#[derive(Debug, Clone)]
pub struct Rows {
    table: Arc<LakeTable>,
    range: Range<usize>,
}

impl Rows {
    /// The range's blocks, clipped to it, in its own indices (what the sampler's lanes read).
    pub fn blocks(&self) -> Vec<Range<usize>> {
        self.table
            .blocks()
            .into_iter()
            .filter_map(|b| {
                let (s, e) = (b.start.max(self.range.start), b.end.min(self.range.end));
                (s < e).then(|| s - self.range.start..e - self.range.start)
            })
            .collect()
    }

    /// The table these rows are of.
    pub fn table(&self) -> &LakeTable {
        &self.table
    }
}

impl Dataset for Rows {
    fn info(&self) -> DatasetInfo {
        DatasetInfo { len: self.range.len(), ..self.table.info() }
    }

    fn len(&self) -> usize {
        self.range.len()
    }

    fn get(&self, index: usize) -> Result<Sample> {
        if index >= self.range.len() {
            return Err(Error::OutOfRange { dataset: self.table.spec.location.clone(), index, len: self.range.len() });
        }
        self.table.get(self.range.start + index)
    }
}

/// A lake dataset's training and held-out rows: the held-out ones from `eval` (a second location, read with the
/// same columns), else the last `eval_fraction` of the table's rows (in file order: its last blocks).
pub fn open_splits(spec: TableSpec, eval: Option<&str>, eval_fraction: f64) -> Result<(Rows, Rows)> {
    match eval {
        Some(location) => {
            let held = LakeTable::open(TableSpec { location: location.to_owned(), ..spec.clone() })?;
            let table = Arc::new(LakeTable::open(spec)?);
            let held = Arc::new(held);
            Ok((Rows { range: 0..table.len(), table }, Rows { range: 0..held.len(), table: held }))
        }
        None => {
            let table = Arc::new(LakeTable::open(spec)?);
            let n = table.len();
            let cut = n - shoal_spec::data::eval_count(n, eval_fraction);
            Ok((Rows { table: Arc::clone(&table), range: 0..cut }, Rows { table, range: cut..n }))
        }
    }
}
