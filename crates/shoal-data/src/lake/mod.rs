//! Data where it lives: tabular and text files in object stores (`s3://`, `gs://`, `az://`, `http(s)://`,
//! `file://`) or on a local path, read through the `object_store` crate with ranged reads — never downloaded whole
//! first. [`source`] opens a location (a file, a prefix ending in `/`, or a glob such as
//! `s3://bucket/clicks/*.parquet`) and lists its files with their [`Format`]; [`inspect()`] reads what a user checks
//! before submitting a job: the schema, rows, row groups, bytes, and the read throughput from where the data is.
//!
//! Credentials and endpoints come from the environment as the stores' own tools read them (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT`, `AWS_ALLOW_HTTP`, `GOOGLE_*`, `AZURE_*`).

pub mod inspect;
pub mod planted;
pub mod source;
pub mod table;

pub use inspect::{Column, FileReport, Inspection, inspect};
pub use source::{Format, LakeFile, Source, open_store};
pub use table::{LakeTable, Rows, TableSpec, open_splits};
