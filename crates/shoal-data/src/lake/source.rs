//! Opening a location in an object store and listing its files.

use std::sync::Arc;

use futures_util::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::error::{Error, Result};

/// A file's format, from its extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Parquet,
    Csv,
    Jsonl,
}

impl Format {
    /// The format a file name's extension says (`.parquet`/`.pq`, `.csv`, `.jsonl`/`.ndjson`/`.json`).
    pub fn of(name: &str) -> Option<Format> {
        let ext = name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase())?;
        match ext.as_str() {
            "parquet" | "pq" => Some(Format::Parquet),
            "csv" => Some(Format::Csv),
            "jsonl" | "ndjson" | "json" => Some(Format::Jsonl),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Parquet => "parquet",
            Format::Csv => "csv",
            Format::Jsonl => "jsonl",
        }
    }

    /// Parses a `format` setting.
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "parquet" => Some(Format::Parquet),
            "csv" => Some(Format::Csv),
            "jsonl" => Some(Format::Jsonl),
            _ => None,
        }
    }
}

/// One file of a source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LakeFile {
    /// Its key in the store.
    pub path: ObjPath,
    /// Its URL, for messages.
    pub url: String,
    pub bytes: u64,
}

/// An opened location: the store, and the files it names, in key order.
#[derive(Debug)]
pub struct Source {
    pub url: String,
    pub store: Arc<dyn ObjectStore>,
    pub files: Vec<LakeFile>,
    pub rt: tokio::runtime::Runtime,
}

fn lake_err(url: &str, why: impl std::fmt::Display) -> Error {
    Error::Lake { url: url.to_owned(), why: why.to_string() }
}

/// Turns a local path into a `file://` URL; a URL stays as it is.
pub fn to_url(location: &str) -> Result<url::Url> {
    if location.contains("://") {
        return url::Url::parse(location).map_err(|e| lake_err(location, format!("not a URL: {e}")));
    }
    let abs =
        std::path::absolute(location).map_err(|e| Error::Io { what: format!("the path {location}"), source: e })?;
    let mut url = url::Url::from_file_path(&abs).map_err(|()| lake_err(location, "not an absolute path"))?;
    if location.ends_with('/') && !url.path().ends_with('/') {
        url.set_path(&format!("{}/", url.path()));
    }
    Ok(url)
}

/// The store a URL lives in, and the key it names, with options from the `AWS_*`, `GOOGLE_*` and `AZURE_*`
/// variables. The one place a URL becomes a store (the checkpoints' mirror opens theirs here too).
pub fn open_store(url: &url::Url) -> Result<(Arc<dyn ObjectStore>, ObjPath)> {
    let opts: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_"))
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    let (store, path) = object_store::parse_url_opts(url, opts).map_err(|e| lake_err(url.as_str(), e))?;
    Ok((Arc::from(store), path))
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters but `/` and `?` for one.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    fn go(p: &[u8], n: &[u8]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some(b'*'), _) => go(&p[1..], n) || (n.first().is_some_and(|&c| c != b'/') && go(p, &n[1..])),
            (Some(b'?'), Some(&c)) => c != b'/' && go(&p[1..], &n[1..]),
            (Some(a), Some(b)) => a == b && go(&p[1..], &n[1..]),
            _ => false,
        }
    }
    go(pattern.as_bytes(), name.as_bytes())
}

impl Source {
    /// Opens `location`: one file, every file under a prefix (ending in `/`, or naming no object), or the files a
    /// glob in its last part matches. Refused when it names no file, naming the location.
    pub fn open(location: &str) -> Result<Source> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Io { what: "starting the I/O runtime".into(), source: e })?;
        // A glob: list from the part before its first wildcard.
        let (base, pattern) = match location.find(['*', '?']) {
            Some(at) => {
                let cut = location[..at].rfind('/').map_or(0, |i| i + 1);
                (&location[..cut], Some(&location[cut..]))
            }
            None => (location, None),
        };
        let url = to_url(base)?;
        let (store, key) = open_store(&url)?;
        let shown = url.as_str().trim_end_matches('/').to_owned();
        let files = rt.block_on(async {
            let mut files = Vec::new();
            if pattern.is_none() && !location.ends_with('/') {
                match store.head(&key).await {
                    Ok(meta) => {
                        files.push(LakeFile { path: meta.location, url: shown.clone(), bytes: meta.size });
                        return Ok(files);
                    }
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(lake_err(&shown, e)),
                }
            }
            let prefix = (!key.as_ref().is_empty()).then_some(&key);
            let listed: Vec<object_store::ObjectMeta> =
                store.list(prefix).try_collect().await.map_err(|e| lake_err(&shown, e))?;
            for meta in listed {
                let rel = meta.location.as_ref().strip_prefix(key.as_ref()).unwrap_or(meta.location.as_ref());
                let rel = rel.trim_start_matches('/');
                if pattern.is_some_and(|p| !glob_match(p, rel)) {
                    continue;
                }
                let url = format!("{shown}/{rel}");
                files.push(LakeFile { path: meta.location, url, bytes: meta.size });
            }
            files.sort_by(|a, b| a.path.as_ref().cmp(b.path.as_ref()));
            Ok(files)
        })?;
        if files.is_empty() {
            return Err(lake_err(location, "names no file (no object, none under it, or none matching)"));
        }
        Ok(Source { url: location.to_owned(), store, files, rt })
    }

    /// The format of the files: `format` when given, else their extensions', which must agree.
    pub fn format(&self, format: Option<Format>) -> Result<Format> {
        if let Some(f) = format {
            return Ok(f);
        }
        let mut found: Option<Format> = None;
        for f in &self.files {
            let Some(this) = Format::of(f.path.as_ref()) else {
                return Err(lake_err(&f.url, "no known extension (.parquet, .csv, .jsonl): give the format"));
            };
            if found.is_some_and(|x| x != this) {
                return Err(lake_err(&self.url, "its files' extensions say different formats: give the format"));
            }
            found = Some(this);
        }
        found.ok_or_else(|| lake_err(&self.url, "names no file"))
    }
}

/// Copies the local file `from` to `location` (a URL or a path) through the object store, in parts of 16 MiB — so a
/// store keeps the object's checksums, as it does for any upload. Returns the bytes written.
pub fn upload(from: &std::path::Path, location: &str) -> Result<u64> {
    use tokio::io::AsyncReadExt;
    let url = to_url(location)?;
    let (store, path) = open_store(&url)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Io { what: "starting the I/O runtime".into(), source: e })?;
    let io = |e: std::io::Error| Error::Io { what: format!("reading {}", from.display()), source: e };
    rt.block_on(async {
        let mut file = tokio::fs::File::open(from).await.map_err(io)?;
        let upload = store.put_multipart(&path).await.map_err(|e| lake_err(location, e))?;
        let mut writer = object_store::WriteMultipart::new_with_chunk_size(upload, 16 << 20);
        let mut buf = vec![0u8; 4 << 20];
        let mut total = 0u64;
        loop {
            let n = file.read(&mut buf).await.map_err(io)?;
            if n == 0 {
                break;
            }
            writer.wait_for_capacity(4).await.map_err(|e| lake_err(location, e))?;
            writer.write(&buf[..n]);
            total += n as u64;
        }
        writer.finish().await.map_err(|e| lake_err(location, e))?;
        Ok(total)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_within_a_path_part() {
        assert!(glob_match("*.parquet", "a.parquet"));
        assert!(glob_match("part-?.csv", "part-1.csv"));
        assert!(!glob_match("*.parquet", "dir/a.parquet"));
        assert!(!glob_match("*.parquet", "a.csv"));
        assert!(glob_match("*/*.csv", "d/x.csv"));
    }

    #[test]
    fn formats_come_from_extensions() {
        assert_eq!(Format::of("s3://b/x/part-0.PARQUET"), Some(Format::Parquet));
        assert_eq!(Format::of("a.ndjson"), Some(Format::Jsonl));
        assert_eq!(Format::of("README"), None);
    }
}
