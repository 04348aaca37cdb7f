//! Checkpoints in an object store (`s3://`, `gs://`, `az://`, `http(s)://`, `file://`, through the
//! `object_store` crate): every checkpoint is written locally first (atomic, checksummed, see
//! [`crate::checkpoint`]) and then mirrored to `URL/checkpoints/step-NNNNNN/<file>`, `manifest.json` last, so a
//! remote checkpoint with a manifest is whole. Resuming downloads the newest remote checkpoint that verifies,
//! naming each object of a newer one that does not, and falls back to older ones.
//!
//! Credentials and endpoints come from the environment the way the store's own tools read them
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT`, `AWS_ALLOW_HTTP`, ...).
//! The step loop never waits for the network: uploads run on the checkpoint saver's thread.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::checkpoint::CheckpointDir;

/// Failures name the object URL.
#[derive(Debug, thiserror::Error)]
#[error("{url}: {why}")]
pub struct RemoteError {
    pub url: String,
    pub why: String,
}

type Result<T> = std::result::Result<T, RemoteError>;

/// The step fetched (if any) and the newer checkpoints skipped, each as (object URL at fault, why).
pub type Fetched = (Option<u64>, Vec<(String, String)>);

/// A checkpoint location in an object store.
#[derive(Debug)]
pub struct RemoteStore {
    url: String,
    store: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    rt: tokio::runtime::Runtime,
}

impl RemoteStore {
    /// Opens `url` (e.g. `s3://bucket/run-7`) with options from the `AWS_*`, `GOOGLE_*` and `AZURE_*` variables.
    pub fn open(url: &str) -> Result<RemoteStore> {
        let err = |why: String| RemoteError { url: url.to_owned(), why };
        let parsed = url::Url::parse(url).map_err(|e| err(format!("not a URL: {e}")))?;
        let (store, prefix) = shoal_data::lake::open_store(&parsed).map_err(|e| match e {
            shoal_data::Error::Lake { why, .. } => err(why),
            other => err(other.to_string()),
        })?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| err(format!("cannot start the I/O runtime: {e}")))?;
        Ok(RemoteStore { url: url.trim_end_matches('/').to_owned(), store, prefix, rt })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn key(&self, rel: &str) -> ObjPath {
        let mut p = self.prefix.clone();
        for part in rel.split('/').filter(|s| !s.is_empty()) {
            p = p.join(part);
        }
        p
    }

    fn object_url(&self, rel: &str) -> String {
        format!("{}/{rel}", self.url)
    }

    /// Uploads one local step directory (`.../checkpoints/step-NNNNNN`), `manifest.json` last.
    pub fn upload_step(&self, step_dir: &Path) -> Result<u64> {
        let name = step_dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        let mut files: Vec<PathBuf> = std::fs::read_dir(step_dir)
            .map_err(|e| RemoteError { url: step_dir.display().to_string(), why: e.to_string() })?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        // The manifest last: a remote checkpoint with a manifest has all its files.
        files.sort_by_key(|p| (p.file_name().is_some_and(|n| n == crate::checkpoint::MANIFEST_FILE), p.clone()));
        let mut bytes = 0u64;
        for f in files {
            let file = f.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
            let rel = format!("checkpoints/{name}/{file}");
            let data =
                std::fs::read(&f).map_err(|e| RemoteError { url: f.display().to_string(), why: e.to_string() })?;
            bytes += data.len() as u64;
            let key = self.key(&rel);
            self.rt
                .block_on(self.store.put(&key, PutPayload::from(data)))
                .map_err(|e| RemoteError { url: self.object_url(&rel), why: format!("upload failed: {e}") })?;
        }
        Ok(bytes)
    }

    /// Remote step names with their step numbers, newest first.
    pub fn steps(&self) -> Result<Vec<(u64, String)>> {
        let prefix = self.key("checkpoints");
        let listing = self
            .rt
            .block_on(self.store.list_with_delimiter(Some(&prefix)))
            .map_err(|e| RemoteError { url: self.object_url("checkpoints/"), why: format!("listing failed: {e}") })?;
        let mut out: Vec<(u64, String)> = listing
            .common_prefixes
            .iter()
            .filter_map(|p| {
                let name = p.filename()?.to_owned();
                crate::checkpoint::parse_step_name(&name).map(|s| (s, name))
            })
            .collect();
        out.sort_by_key(|x| std::cmp::Reverse(x.0));
        Ok(out)
    }

    /// Deletes remote checkpoints beyond the newest `keep` (the manifest first, so a half-deleted one is never
    /// taken for whole).
    pub fn prune(&self, keep: usize) -> Result<Vec<String>> {
        let mut removed = Vec::new();
        for (_, name) in self.steps()?.into_iter().skip(keep.max(1)) {
            let dir = self.key(&format!("checkpoints/{name}"));
            let mut objects: Vec<ObjPath> = self.rt.block_on(async {
                self.store.list(Some(&dir)).filter_map(|m| async move { m.ok().map(|m| m.location) }).collect().await
            });
            objects.sort_by_key(|p| p.filename() != Some(crate::checkpoint::MANIFEST_FILE));
            for o in objects {
                self.rt.block_on(self.store.delete(&o)).map_err(|e| RemoteError {
                    url: format!("{}/{o}", self.url),
                    why: format!("delete failed: {e}"),
                })?;
            }
            removed.push(self.object_url(&format!("checkpoints/{name}")));
        }
        Ok(removed)
    }

    /// Downloads the newest remote checkpoint that verifies into `local` (its step directory is replaced).
    /// Returns its step and the newer ones skipped, each with the object URL at fault and why.
    pub fn fetch_latest_valid(&self, local: &CheckpointDir) -> Result<Fetched> {
        let mut skipped = Vec::new();
        for (step, name) in self.steps()? {
            let dir = local.step_dir(step);
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)
                .map_err(|e| RemoteError { url: dir.display().to_string(), why: e.to_string() })?;
            let prefix = self.key(&format!("checkpoints/{name}"));
            let objects: Vec<ObjPath> = self.rt.block_on(async {
                self.store.list(Some(&prefix)).filter_map(|m| async move { m.ok().map(|m| m.location) }).collect().await
            });
            let mut failed = None;
            for o in &objects {
                let Some(file) = o.filename() else { continue };
                let got = self.rt.block_on(async { self.store.get(o).await?.bytes().await });
                match got {
                    Ok(bytes) => {
                        if let Err(e) = std::fs::write(dir.join(file), &bytes) {
                            return Err(RemoteError { url: dir.join(file).display().to_string(), why: e.to_string() });
                        }
                    }
                    Err(e) => {
                        failed = Some((format!("{}/{o}", self.url), format!("download failed: {e}")));
                        break;
                    }
                }
            }
            let verdict = match failed {
                Some(f) => Err(f),
                None => local.verify(&dir).map(|_| ()).map_err(|e| {
                    // Name the object, not the local copy.
                    let file = e.path().and_then(|p| p.file_name()).and_then(|f| f.to_str()).unwrap_or("manifest.json");
                    (self.object_url(&format!("checkpoints/{name}/{file}")), e.to_string())
                }),
            };
            match verdict {
                Ok(()) => return Ok((Some(step), skipped)),
                Err((url, why)) => {
                    tracing::warn!(object = %url, "skipping invalid remote checkpoint: {why}");
                    skipped.push((url, why));
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
        }
        Ok((None, skipped))
    }
}

/// Whether a `checkpoint.url` names an object store rather than a local directory.
pub fn is_remote(url: &str) -> bool {
    url.contains("://") && !url.starts_with("file://")
}
impl crate::checkpoint::Mirror for RemoteStore {
    fn upload(&self, step_dir: &Path) -> std::result::Result<(), String> {
        self.upload_step(step_dir).map(drop).map_err(|e| e.to_string())
    }

    fn prune(&self, keep: usize) -> std::result::Result<(), String> {
        RemoteStore::prune(self, keep).map(drop).map_err(|e| e.to_string())
    }
}
