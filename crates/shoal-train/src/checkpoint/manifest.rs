//! The manifest (`manifest.json`): what a checkpoint holds besides its tensors and the size and sha256 of each of
//! its files, read back with every check a checkpoint must pass before it is trusted (format, step, plain file
//! names, the files it must list), and the files verified against it.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::direct::CHUNK_BYTES;
use super::error::{Result, corrupt, io_err, open_err};
use super::layout::{MANIFEST_FILE, MODEL_FILE, OPTIMIZER_FILE, parse_step_name};

/// Version of the manifest format written by this module.
pub const FORMAT_VERSION: u32 = 1;

/// Largest manifest we are willing to read (a bigger one is corrupt).
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// Size and checksum of one file of a checkpoint.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct FileEntry {
    /// Size in bytes.
    pub bytes: u64,
    /// Lowercase hex sha256 of the whole file.
    pub sha256: String,
}

/// Everything the caller puts in the manifest (all of [`Manifest`] but the
/// step, the files and the creation time, which `save` fills in).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct ManifestMeta {
    /// Epoch the run was in.
    pub epoch: u64,
    /// Opaque sampler state (epoch, position) from the caller.
    pub sampler: serde_json::Value,
    /// Opaque RNG states from the caller.
    pub rng: serde_json::Value,
    /// World size of the run that saved.
    pub world_size: usize,
    /// Strategy of the run that saved (e.g. `ddp`).
    pub strategy: String,
    /// Anything else the trainer wants back.
    pub extra: serde_json::Value,
}

/// Contents of `manifest.json`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Manifest {
    /// Format version, [`FORMAT_VERSION`].
    pub format: u32,
    /// Optimizer steps completed when the checkpoint was taken.
    pub step: u64,
    /// See [`ManifestMeta::epoch`].
    pub epoch: u64,
    /// See [`ManifestMeta::sampler`].
    pub sampler: serde_json::Value,
    /// See [`ManifestMeta::rng`].
    pub rng: serde_json::Value,
    /// See [`ManifestMeta::world_size`].
    pub world_size: usize,
    /// See [`ManifestMeta::strategy`].
    pub strategy: String,
    /// See [`ManifestMeta::extra`].
    #[serde(default)]
    pub extra: serde_json::Value,
    /// File name (relative to the step directory) to its size and sha256.
    pub files: BTreeMap<String, FileEntry>,
    /// When the manifest was written, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
}

impl Manifest {
    /// The caller's part of the manifest.
    pub fn meta(&self) -> ManifestMeta {
        ManifestMeta {
            epoch: self.epoch,
            sampler: self.sampler.clone(),
            rng: self.rng.clone(),
            world_size: self.world_size,
            strategy: self.strategy.clone(),
            extra: self.extra.clone(),
        }
    }
}

pub(super) fn hex_sha256(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

fn check_size(path: &Path, actual: u64, entry: &FileEntry) -> Result<()> {
    if actual != entry.bytes {
        return Err(corrupt(
            path,
            format!("size is {actual} bytes but the manifest says {} (truncated or overwritten)", entry.bytes),
        ));
    }
    Ok(())
}

fn check_sha(path: &Path, actual: &str, entry: &FileEntry) -> Result<()> {
    if !actual.eq_ignore_ascii_case(&entry.sha256) {
        return Err(corrupt(
            path,
            format!("sha256 is {actual} but the manifest says {} (checksum mismatch)", entry.sha256),
        ));
    }
    Ok(())
}

/// Reads a whole file after checking its size against the manifest, then checks its sha256.
pub(super) fn read_verified(path: &Path, entry: &FileEntry) -> Result<Vec<u8>> {
    let file = File::open(path).map_err(|e| open_err(path, e))?;
    let len = file.metadata().map_err(|e| io_err(path, e))?.len();
    check_size(path, len, entry)?;
    let cap = usize::try_from(len).map_err(|_| corrupt(path, "file too large for memory"))?;
    let mut bytes = Vec::with_capacity(cap);
    file.take(len.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| io_err(path, e))?;
    check_size(path, bytes.len() as u64, entry)?;
    check_sha(path, &hex_sha256(&bytes), entry)?;
    Ok(bytes)
}

/// Checks a file's size and sha256 without holding it in memory.
pub(super) fn verify_streaming(path: &Path, entry: &FileEntry) -> Result<()> {
    let mut file = File::open(path).map_err(|e| open_err(path, e))?;
    let len = file.metadata().map_err(|e| io_err(path, e))?.len();
    check_size(path, len, entry)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut total = 0u64;
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                hasher.update(&buf[..n]);
                total += n as u64;
                if total > entry.bytes {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(path, e)),
        }
    }
    check_size(path, total, entry)?;
    check_sha(path, &format!("{:x}", hasher.finalize()), entry)
}

/// A file name listed in a manifest must be a plain name inside the step directory.
fn plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && Path::new(name).components().count() == 1
}

/// Reads and checks `dir/manifest.json` (not the files it lists).
pub(super) fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST_FILE);
    let file = File::open(&path).map_err(|e| open_err(&path, e))?;
    let mut bytes = Vec::new();
    file.take(MAX_MANIFEST_BYTES + 1).read_to_end(&mut bytes).map_err(|e| io_err(&path, e))?;
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(corrupt(&path, format!("larger than {MAX_MANIFEST_BYTES} bytes")));
    }
    let manifest: Manifest =
        serde_json::from_slice(&bytes).map_err(|e| corrupt(&path, format!("not a valid manifest: {e}")))?;
    if manifest.format != FORMAT_VERSION {
        return Err(corrupt(&path, format!("format {} is not the supported format {FORMAT_VERSION}", manifest.format)));
    }
    if let Some(step) = dir.file_name().and_then(|n| n.to_str()).and_then(parse_step_name)
        && step != manifest.step
    {
        return Err(corrupt(&path, format!("says step {} but the directory is for step {step}", manifest.step)));
    }
    for name in manifest.files.keys() {
        if !plain_file_name(name) {
            return Err(corrupt(&path, format!("lists the file {name:?}, which is not a plain file name")));
        }
    }
    for required in [MODEL_FILE, OPTIMIZER_FILE] {
        if !manifest.files.contains_key(required) {
            return Err(corrupt(&path, format!("does not list {required}")));
        }
    }
    Ok(manifest)
}
