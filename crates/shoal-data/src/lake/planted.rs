//! A planted table for benchmarks and examples: rows of numeric features whose class is the largest of a few fixed
//! linear scores (so a model can learn it), beside columns a job does not read (so projection shows), written as
//! Parquet one row group at a time.

use std::path::Path;
use std::sync::Arc;

use arrow_array::{ArrayRef, Float32Array, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// The planted table's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planted {
    pub rows: u64,
    /// Rows per row group.
    pub row_group: usize,
    /// Feature columns `f0..`, each uniform in [-1, 1).
    pub features: usize,
    /// Columns `x0..` a job does not read.
    pub extra: usize,
    /// Classes of the `label` column.
    pub classes: usize,
    pub seed: u64,
}

impl Planted {
    /// Row `i`: its features and class.
    pub fn row(&self, i: u64) -> (Vec<f32>, i64) {
        let mut g = SplitMix64::from_key(&[self.seed, i]);
        let x: Vec<f32> = (0..self.features).map(|_| (g.unit_f64() * 2.0 - 1.0) as f32).collect();
        let score =
            |c: usize| -> f32 { x.iter().enumerate().map(|(j, v)| v * (((j * 7 + c * 3) % 5) as f32 - 2.0)).sum() };
        let class = (0..self.classes.max(1)).max_by(|&a, &b| score(a).total_cmp(&score(b))).unwrap_or(0);
        (x, class as i64)
    }

    /// Writes the table to `path` (a local file); its bytes.
    pub fn write(&self, path: &Path) -> Result<u64> {
        let io = |e: std::io::Error| Error::Io { what: path.display().to_string(), source: e };
        let pq = |e: parquet::errors::ParquetError| Error::Malformed {
            what: path.display().to_string(),
            reason: e.to_string(),
        };
        let mut fields: Vec<Field> =
            (0..self.features).map(|j| Field::new(format!("f{j}"), DataType::Float32, false)).collect();
        fields.push(Field::new("label", DataType::Int64, false));
        fields.extend((0..self.extra).map(|j| Field::new(format!("x{j}"), DataType::Float32, false)));
        let schema = Arc::new(Schema::new(fields));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let file = std::fs::File::create(path).map_err(io)?;
        let props = WriterProperties::builder().set_max_row_group_row_count(Some(self.row_group.max(1))).build();
        let mut w = ArrowWriter::try_new(file, Arc::clone(&schema), Some(props)).map_err(pq)?;
        let mut at = 0u64;
        while at < self.rows {
            let n = (self.rows - at).min(self.row_group.max(1) as u64);
            let rows: Vec<(Vec<f32>, i64)> = (at..at + n).map(|i| self.row(i)).collect();
            let mut cols: Vec<ArrayRef> = (0..self.features)
                .map(|j| Arc::new(Float32Array::from_iter_values(rows.iter().map(|(x, _)| x[j]))) as ArrayRef)
                .collect();
            cols.push(Arc::new(Int64Array::from_iter_values(rows.iter().map(|(_, c)| *c))));
            for j in 0..self.extra {
                let mut g = SplitMix64::from_key(&[self.seed, at, j as u64, 0xE7]);
                cols.push(Arc::new(Float32Array::from_iter_values((0..n).map(|_| g.unit_f64() as f32))));
            }
            let batch = RecordBatch::try_new(Arc::clone(&schema), cols)
                .map_err(|e| Error::Malformed { what: path.display().to_string(), reason: e.to_string() })?;
            w.write(&batch).map_err(pq)?;
            at += n;
        }
        w.close().map_err(pq)?;
        Ok(std::fs::metadata(path).map_err(io)?.len())
    }
}
