//! Checkpoints: parameters and optimizer state in safetensors, plus a JSON
//! manifest written last and atomically.
//!
//! Layout under a run's output directory `root`:
//!
//! ```text
//! root/checkpoints/step-000100/model.safetensors      tensors by parameter name, F32, little-endian
//! root/checkpoints/step-000100/optimizer.safetensors  optimizer state by name, F32, little-endian
//! root/checkpoints/step-000100/manifest.json          step, epoch, sampler, RNG, world size, strategy,
//!                                                     extra, size + sha256 of every file
//! root/checkpoints/step-000200.tmp-<pid>/             a save in progress (or left by a crash)
//! ```
//!
//! A save writes both tensor files into `step-NNNNNN.tmp-<pid>`, fsyncs each
//! file and the directory, renames the directory to `step-NNNNNN`, fsyncs
//! `checkpoints/`, then writes `manifest.json.tmp`, fsyncs it, renames it to
//! `manifest.json` and fsyncs the step directory. A checkpoint is valid only if
//! its manifest parses and every file it lists has the listed size and sha256;
//! readers skip anything else with a warning naming the offending file.
//!
//! The module knows nothing about tensors libraries: callers hand it flat
//! `f32` buffers ([`TensorData`]). Corrupt input never panics; it is an error
//! naming the file. Nothing here waits without a bound.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Version of the manifest format written by this module.
pub const FORMAT_VERSION: u32 = 1;
/// Subdirectory of the run's output directory that holds the checkpoints.
pub const CHECKPOINTS_SUBDIR: &str = "checkpoints";
/// File holding the model parameters.
pub const MODEL_FILE: &str = "model.safetensors";
/// File holding the optimizer state.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The manifest, written last.
pub const MANIFEST_FILE: &str = "manifest.json";

/// Largest manifest we are willing to read (a bigger one is corrupt).
const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Bytes converted, hashed and written at a time.
const CHUNK_BYTES: usize = 4 << 20;
/// Default bound on how long `AsyncSaver::submit` (and drop) waits for the previous save.
const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(600);

/// Errors of this module. Every variant that concerns a file carries its path.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// An I/O operation on `path` failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A file that a checkpoint needs does not exist.
    #[error("{}: missing", path.display())]
    Missing {
        /// The missing file.
        path: PathBuf,
    },
    /// A file exists but its contents are wrong.
    #[error("{}: corrupt: {why}", path.display())]
    Corrupt {
        /// The corrupt file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The caller passed tensors that cannot be saved.
    #[error("cannot save checkpoint: {why}")]
    InvalidInput {
        /// What is wrong.
        why: String,
    },
    /// A bounded wait ran out.
    #[error("timed out after {:.1}s waiting for {what}", waited.as_secs_f64())]
    Timeout {
        /// What was being waited for.
        what: String,
        /// How long we waited.
        waited: Duration,
    },
    /// The background saver thread could not be started or died.
    #[error("checkpoint saver thread: {why}")]
    SaverGone {
        /// What happened.
        why: String,
    },
    /// Mirroring to the object store failed (the local checkpoint is whole).
    #[error("checkpoint mirror: {why}")]
    Remote {
        /// What failed, naming the object URL.
        why: String,
    },
}

impl CheckpointError {
    /// The file or directory the error is about, if any.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Io { path, .. } | Self::Missing { path } | Self::Corrupt { path, .. } => Some(path),
            Self::InvalidInput { .. } | Self::Timeout { .. } | Self::SaverGone { .. } | Self::Remote { .. } => None,
        }
    }
}

/// Result of this module.
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

fn io_err(path: &Path, source: io::Error) -> CheckpointError {
    CheckpointError::Io { path: path.to_path_buf(), source }
}

fn open_err(path: &Path, source: io::Error) -> CheckpointError {
    if source.kind() == io::ErrorKind::NotFound {
        CheckpointError::Missing { path: path.to_path_buf() }
    } else {
        io_err(path, source)
    }
}

fn corrupt(path: &Path, why: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt { path: path.to_path_buf(), why: why.into() }
}

/// One named tensor as a flat, row-major `f32` buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorData {
    /// Parameter (or optimizer state) name, e.g. `layers.0.weight` or `adamw.m.layers.0.weight`.
    pub name: String,
    /// Shape; the product must equal `data.len()` (`[]` is a scalar).
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub data: Vec<f32>,
}

impl TensorData {
    /// Builds a tensor.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Self {
        Self { name: name.into(), shape, data }
    }

    /// A copy of `values` into `buf` (reusing its allocation when it is large enough).
    pub fn copy_from(name: impl Into<String>, shape: Vec<usize>, values: &[f32], mut buf: Vec<f32>) -> Self {
        buf.clear();
        buf.extend_from_slice(values);
        Self::new(name, shape, buf)
    }
}

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

/// A verified checkpoint read back into memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    /// The step directory it came from.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Model tensors, in file order (the order they were saved in).
    pub model: Vec<TensorData>,
    /// Optimizer tensors, in file order.
    pub optimizer: Vec<TensorData>,
    /// Newer checkpoints that were skipped (by `latest_valid`): the offending
    /// file and why.
    pub skipped: Vec<(PathBuf, String)>,
}

/// What one save did.
#[derive(Clone, Debug, PartialEq)]
pub struct SaveStats {
    /// Step saved.
    pub step: u64,
    /// Final step directory.
    pub dir: PathBuf,
    /// Bytes written (both tensor files and the manifest).
    pub bytes: u64,
    /// Wall time of the save, fsyncs and renames included (pruning excluded).
    pub seconds: f64,
    /// `bytes / seconds`, in MB/s (10^6 bytes per second).
    pub mb_per_s: f64,
    /// Directories removed by the prune that followed (AsyncSaver only).
    pub pruned: Vec<PathBuf>,
    /// Wall time of that prune (AsyncSaver only).
    pub prune_seconds: f64,
    /// Seconds spent uploading to the object store mirror (AsyncSaver with a mirror only).
    pub upload_seconds: f64,
}

// ---------------------------------------------------------------------------
// Directory names and in-progress bookkeeping

fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// `step-<digits>` -> the step.
pub(crate) fn parse_step_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// `step-<digits>.tmp-<pid>[...]` -> the pid (None for any other name).
fn parse_temp_name(name: &str) -> Option<Option<u32>> {
    let rest = name.strip_prefix("step-")?;
    let (digits, after) = rest.split_once(".tmp-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let pid: String = after.chars().take_while(char::is_ascii_digit).collect();
    Some(pid.parse().ok())
}

/// Directories that a save in this process is writing right now; `prune`
/// never touches them.
static IN_PROGRESS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

struct InProgress(Vec<PathBuf>);

impl InProgress {
    fn register(paths: Vec<PathBuf>) -> Self {
        IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner()).extend(paths.iter().cloned());
        Self(paths)
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        let mut set = IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner());
        for p in &self.0 {
            if let Some(i) = set.iter().position(|q| q == p) {
                set.swap_remove(i);
            }
        }
    }
}

fn in_progress(path: &Path) -> bool {
    IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|p| p == path)
}

/// Whether another live process may own a temp directory.
fn other_process_alive(pid: Option<u32>) -> bool {
    match pid {
        Some(pid) if pid != std::process::id() => {
            cfg!(target_os = "linux") && Path::new("/proc").join(pid.to_string()).exists()
        }
        _ => false,
    }
}

fn fsync_dir(dir: &Path) -> Result<()> {
    // Directories can be opened read-only and fsynced on Unix; elsewhere this is best effort.
    match File::open(dir) {
        Ok(f) => match f.sync_all() {
            Ok(()) => Ok(()),
            Err(e) if cfg!(unix) => Err(io_err(dir, e)),
            Err(_) => Ok(()),
        },
        Err(e) if cfg!(unix) => Err(io_err(dir, e)),
        Err(_) => Ok(()),
    }
}

fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)).unwrap_or(0)
}

fn mb_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 { bytes as f64 / 1e6 / seconds } else { f64::INFINITY }
}

// ---------------------------------------------------------------------------
// safetensors writing and reading

fn validate_tensors(what: &str, tensors: &[TensorData]) -> Result<()> {
    let mut names = HashSet::with_capacity(tensors.len());
    for t in tensors {
        if t.name.is_empty() || t.name == "__metadata__" {
            return Err(CheckpointError::InvalidInput {
                why: format!("{what} tensor has the reserved or empty name {:?}", t.name),
            });
        }
        if !names.insert(t.name.as_str()) {
            return Err(CheckpointError::InvalidInput {
                why: format!("{what} tensor name {:?} appears twice", t.name),
            });
        }
        let numel = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if numel != Some(t.data.len()) {
            return Err(CheckpointError::InvalidInput {
                why: format!("{what} tensor {:?} has shape {:?} but {} values", t.name, t.shape, t.data.len()),
            });
        }
    }
    Ok(())
}

/// The safetensors header (length prefix included) for `tensors` laid out in order.
fn safetensors_header(path: &Path, tensors: &[TensorData]) -> Result<Vec<u8>> {
    let mut offset = 0usize;
    let mut infos = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n = t
            .data
            .len()
            .checked_mul(4)
            .ok_or_else(|| CheckpointError::InvalidInput { why: format!("tensor {:?} is too large", t.name) })?;
        let end = offset
            .checked_add(n)
            .ok_or_else(|| CheckpointError::InvalidInput { why: "tensors are too large".to_string() })?;
        infos.push((
            t.name.clone(),
            TensorInfo { dtype: Dtype::F32, shape: t.shape.clone(), data_offsets: (offset, end) },
        ));
        offset = end;
    }
    let metadata = Metadata::new(None, infos)
        .map_err(|e| CheckpointError::InvalidInput { why: format!("{}: {e}", path.display()) })?;
    let mut json = serde_json::to_vec(&metadata)
        .map_err(|e| CheckpointError::InvalidInput { why: format!("{}: {e}", path.display()) })?;
    // Like the safetensors crate: pad the header with spaces to a multiple of 8.
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// `src` as little-endian bytes into `buf` (resized to fit).
fn to_le_into(src: &[f32], buf: &mut Vec<u8>) {
    buf.resize(src.len() * 4, 0);
    for (d, x) in buf.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}

/// sha256 of the safetensors file that `header` + `tensors` make, computed
/// a chunk at a time (no second full copy in memory).
fn hash_safetensors(header: &[u8], tensors: &[TensorData]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(header);
    let mut buf = Vec::with_capacity(CHUNK_BYTES);
    for t in tensors {
        for chunk in t.data.chunks(CHUNK_BYTES / 4) {
            to_le_into(chunk, &mut buf);
            hasher.update(&buf);
        }
    }
    format!("{:x}", hasher.finalize())
}

/// Alignment of direct I/O: buffer address, file offset and length (the
/// largest logical block size of common devices).
const DIRECT_ALIGN: usize = 4096;

/// A `CHUNK_BYTES` buffer whose start is `DIRECT_ALIGN`-aligned.
struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
}

impl AlignedBuf {
    fn new() -> AlignedBuf {
        let raw = vec![0u8; CHUNK_BYTES + DIRECT_ALIGN];
        let start = raw.as_ptr().align_offset(DIRECT_ALIGN).min(DIRECT_ALIGN);
        AlignedBuf { raw, start }
    }

    fn get(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + CHUNK_BYTES]
    }
}

/// Streams bytes to a file a chunk at a time. With `direct`, the file was
/// opened with `O_DIRECT`: chunks go from the aligned buffer straight to the
/// device, with no copy into the page cache and no page-cache pages to
/// allocate; the last partial chunk is padded to the alignment and the file
/// cut back to its length.
struct ChunkWriter<'a> {
    path: &'a Path,
    file: File,
    direct: bool,
    buf: AlignedBuf,
    len: usize,
    written: u64,
}

impl ChunkWriter<'_> {
    fn push(&mut self, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let n = (CHUNK_BYTES - self.len).min(bytes.len());
            let at = self.len;
            self.buf.get()[at..at + n].copy_from_slice(&bytes[..n]);
            self.len += n;
            bytes = &bytes[n..];
            if self.len == CHUNK_BYTES {
                self.flush_full()?;
            }
        }
        Ok(())
    }

    /// Appends `values` as little-endian bytes, converting straight into the buffer.
    fn push_f32(&mut self, mut values: &[f32]) -> Result<()> {
        while !values.is_empty() {
            if !self.len.is_multiple_of(4) {
                // Only after an odd-sized header: go through bytes until aligned to a value.
                let (head, rest) = values.split_at(1);
                self.push(&head[0].to_le_bytes())?;
                values = rest;
                continue;
            }
            let n = ((CHUNK_BYTES - self.len) / 4).min(values.len());
            let at = self.len;
            for (d, x) in self.buf.get()[at..at + 4 * n].chunks_exact_mut(4).zip(&values[..n]) {
                d.copy_from_slice(&x.to_le_bytes());
            }
            self.len += 4 * n;
            values = &values[n..];
            if self.len == CHUNK_BYTES {
                self.flush_full()?;
            }
        }
        Ok(())
    }

    fn flush_full(&mut self) -> Result<()> {
        let len = self.len;
        let path = self.path;
        self.file.write_all(&self.buf.get()[..len]).map_err(|e| io_err(path, e))?;
        self.written += len as u64;
        self.len = 0;
        Ok(())
    }

    /// Writes what is left, fixes the length, fsyncs; returns the file's size.
    fn finish(mut self) -> Result<u64> {
        let path = self.path;
        if self.len > 0 {
            let len = self.len;
            let padded = if self.direct { len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN } else { len };
            self.buf.get()[len..padded].fill(0);
            self.file.write_all(&self.buf.get()[..padded]).map_err(|e| io_err(path, e))?;
            self.written += len as u64;
            if padded != len {
                self.file.set_len(self.written).map_err(|e| io_err(path, e))?;
            }
        }
        self.file.sync_all().map_err(|e| io_err(path, e))?;
        Ok(self.written)
    }
}

/// Opens `path` for writing, with `O_DIRECT` when asked and the filesystem allows it.
fn create_for_write(path: &Path, direct: bool) -> Result<(File, bool)> {
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    if direct {
        use std::os::unix::fs::OpenOptionsExt;
        let mut d = opts.clone();
        d.custom_flags(libc::O_DIRECT);
        if let Ok(f) = d.open(path) {
            return Ok((f, true));
        }
    }
    Ok((opts.open(path).map_err(|e| io_err(path, e))?, false))
}

/// Writes `path` with what `fill` pushes, fsyncs, and returns the bytes written.
/// With `direct`, direct I/O first; if the device refuses it mid-way (`EINVAL`
/// on a filesystem without it), the file is written again through the page cache.
fn write_stream(path: &Path, direct: bool, fill: impl Fn(&mut ChunkWriter<'_>) -> Result<()>) -> Result<u64> {
    let attempt = |direct: bool| -> Result<u64> {
        let (file, direct) = create_for_write(path, direct)?;
        let mut w = ChunkWriter { path, file, direct, buf: AlignedBuf::new(), len: 0, written: 0 };
        fill(&mut w)?;
        w.finish()
    };
    match attempt(direct) {
        Err(CheckpointError::Io { source, .. }) if direct && source.raw_os_error() == Some(libc::EINVAL) => {
            attempt(false)
        }
        other => other,
    }
}

/// Writes header + tensors to `path` (direct I/O where allowed) and fsyncs; returns the bytes written.
fn write_file(path: &Path, header: &[u8], tensors: &[TensorData]) -> Result<u64> {
    write_stream(path, true, |w| {
        w.push(header)?;
        tensors.iter().try_for_each(|t| w.push_f32(&t.data))
    })
}

/// Writes `tensors` as a safetensors file and fsyncs it. The sha256 is
/// computed on a second thread while the file is written (the two overlap;
/// each converts its own chunks, so neither holds a full copy).
fn write_safetensors(path: &Path, tensors: &[TensorData]) -> Result<FileEntry> {
    let header = safetensors_header(path, tensors)?;
    let (written, sha256) = thread::scope(|s| {
        let hasher = thread::Builder::new()
            .name("shoal-ckpt-hash".to_string())
            .spawn_scoped(s, || hash_safetensors(&header, tensors));
        let written = write_file(path, &header, tensors);
        let sha256 = match hasher {
            Ok(h) => h.join().ok(),
            Err(_) => None, // no thread: hash here instead
        };
        (written, sha256)
    });
    let written = written?;
    let sha256 = match sha256 {
        Some(s) => s,
        None => hash_safetensors(&header, tensors),
    };
    Ok(FileEntry { bytes: written, sha256 })
}

/// Parses a verified safetensors buffer into tensors, in file order.
fn parse_safetensors(path: &Path, bytes: &[u8]) -> Result<Vec<TensorData>> {
    let (n, metadata) =
        SafeTensors::read_metadata(bytes).map_err(|e| corrupt(path, format!("not a valid safetensors file: {e}")))?;
    let data = 8usize
        .checked_add(n)
        .and_then(|start| bytes.get(start..))
        .ok_or_else(|| corrupt(path, "header runs past the end of the file"))?;
    let mut out = Vec::new();
    for name in metadata.offset_keys() {
        let info = metadata.info(&name).ok_or_else(|| corrupt(path, format!("tensor {name:?} lost")))?;
        if info.dtype != Dtype::F32 {
            return Err(corrupt(path, format!("tensor {name:?} has dtype {:?}, not F32", info.dtype)));
        }
        let (s, e) = info.data_offsets;
        let raw =
            data.get(s..e).ok_or_else(|| corrupt(path, format!("tensor {name:?} runs past the end of the file")))?;
        let values = raw
            .chunks_exact(4)
            .map(|c| {
                let mut a = [0u8; 4];
                a.copy_from_slice(c);
                f32::from_le_bytes(a)
            })
            .collect();
        out.push(TensorData { name, shape: info.shape.clone(), data: values });
    }
    Ok(out)
}

fn hex_sha256(bytes: &[u8]) -> String {
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
fn read_verified(path: &Path, entry: &FileEntry) -> Result<Vec<u8>> {
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
fn verify_streaming(path: &Path, entry: &FileEntry) -> Result<()> {
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
fn read_manifest(dir: &Path) -> Result<Manifest> {
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

/// Size and modification time of the manifest and every file, to skip
/// re-hashing a checkpoint this process already verified or wrote.
type Fingerprint = Vec<(String, u64, Option<SystemTime>)>;

fn fingerprint(dir: &Path) -> Option<Fingerprint> {
    let mut out = Vec::new();
    for name in [MANIFEST_FILE, MODEL_FILE, OPTIMIZER_FILE] {
        let md = fs::metadata(dir.join(name)).ok()?;
        out.push((name.to_string(), md.len(), md.modified().ok()));
    }
    Some(out)
}

// ---------------------------------------------------------------------------
// CheckpointDir

/// The checkpoints of one run: `root/checkpoints/step-NNNNNN/`.
#[derive(Clone, Debug)]
pub struct CheckpointDir {
    root: PathBuf,
    /// Step directories this value wrote or fully verified, with their fingerprint.
    verified: Arc<Mutex<HashMap<PathBuf, Fingerprint>>>,
}

impl CheckpointDir {
    /// `root` is the run's output directory; checkpoints go in `root/checkpoints`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into(), verified: Arc::default() }
    }

    /// The run's output directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `root/checkpoints`.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.root.join(CHECKPOINTS_SUBDIR)
    }

    /// `root/checkpoints/step-NNNNNN` (whether or not it exists).
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.checkpoints_dir().join(step_dir_name(step))
    }

    /// Saves a checkpoint synchronously and atomically; returns its directory.
    /// An existing checkpoint for the same step is replaced.
    pub fn save(
        &self,
        step: u64,
        model: &[TensorData],
        optimizer: &[TensorData],
        meta: ManifestMeta,
    ) -> Result<PathBuf> {
        self.save_with_stats(step, model, optimizer, meta).map(|s| s.dir)
    }

    /// [`save`](Self::save), also returning bytes written and speed.
    pub fn save_with_stats(
        &self,
        step: u64,
        model: &[TensorData],
        optimizer: &[TensorData],
        meta: ManifestMeta,
    ) -> Result<SaveStats> {
        let start = Instant::now();
        validate_tensors("model", model)?;
        validate_tensors("optimizer", optimizer)?;

        let ckdir = self.checkpoints_dir();
        if !ckdir.is_dir() {
            fs::create_dir_all(&ckdir).map_err(|e| io_err(&ckdir, e))?;
            fsync_dir(&self.root)?;
        }
        let pid = std::process::id();
        let name = step_dir_name(step);
        let final_dir = ckdir.join(&name);
        let tmp_dir = ckdir.join(format!("{name}.tmp-{pid}"));
        let old_dir = ckdir.join(format!("{name}.tmp-{pid}-replaced"));
        let _guard = InProgress::register(vec![final_dir.clone(), tmp_dir.clone(), old_dir.clone()]);
        self.forget(&final_dir);

        if tmp_dir.exists() {
            fs::remove_dir_all(&tmp_dir).map_err(|e| io_err(&tmp_dir, e))?;
        }
        fs::create_dir(&tmp_dir).map_err(|e| io_err(&tmp_dir, e))?;
        // The two files are written (and hashed) at the same time: hashing is
        // the slowest part, and each file's hash runs on its own thread.
        let written = (|| -> Result<(FileEntry, FileEntry)> {
            let (m, o) = thread::scope(|s| {
                let model_writer = thread::Builder::new()
                    .name("shoal-ckpt-model".to_string())
                    .spawn_scoped(s, || write_safetensors(&tmp_dir.join(MODEL_FILE), model));
                let o = write_safetensors(&tmp_dir.join(OPTIMIZER_FILE), optimizer);
                let m = match model_writer {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(CheckpointError::InvalidInput { why: "the model file's writer thread panicked".into() })
                    }),
                    Err(_) => write_safetensors(&tmp_dir.join(MODEL_FILE), model),
                };
                (m, o)
            });
            let (m, o) = (m?, o?);
            fsync_dir(&tmp_dir)?;
            Ok((m, o))
        })();
        let (model_entry, optimizer_entry) = match written {
            Ok(x) => x,
            Err(e) => {
                let _ = fs::remove_dir_all(&tmp_dir);
                return Err(e);
            }
        };

        // Move any previous checkpoint of this step out of the way, then publish ours.
        let replaced = final_dir.exists();
        if replaced {
            if old_dir.exists() {
                fs::remove_dir_all(&old_dir).map_err(|e| io_err(&old_dir, e))?;
            }
            fs::rename(&final_dir, &old_dir).map_err(|e| io_err(&final_dir, e))?;
        }
        fs::rename(&tmp_dir, &final_dir).map_err(|e| io_err(&final_dir, e))?;
        fsync_dir(&ckdir)?;
        if replaced && let Err(e) = fs::remove_dir_all(&old_dir) {
            tracing::warn!(dir = %old_dir.display(), error = %e, "could not remove replaced checkpoint");
        }

        // The manifest, last: temp file, fsync, rename, fsync the directory.
        let mut files = BTreeMap::new();
        let mut bytes = model_entry.bytes + optimizer_entry.bytes;
        files.insert(MODEL_FILE.to_string(), model_entry);
        files.insert(OPTIMIZER_FILE.to_string(), optimizer_entry);
        let manifest = Manifest {
            format: FORMAT_VERSION,
            step,
            epoch: meta.epoch,
            sampler: meta.sampler,
            rng: meta.rng,
            world_size: meta.world_size,
            strategy: meta.strategy,
            extra: meta.extra,
            files,
            created_unix_ms: now_unix_ms(),
        };
        let manifest_path = final_dir.join(MANIFEST_FILE);
        let mut json = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| CheckpointError::InvalidInput { why: format!("manifest: {e}") })?;
        json.push(b'\n');
        let tmp_manifest = final_dir.join(format!("{MANIFEST_FILE}.tmp"));
        {
            let mut f = File::create(&tmp_manifest).map_err(|e| io_err(&tmp_manifest, e))?;
            f.write_all(&json).map_err(|e| io_err(&tmp_manifest, e))?;
            f.sync_all().map_err(|e| io_err(&tmp_manifest, e))?;
        }
        fs::rename(&tmp_manifest, &manifest_path).map_err(|e| io_err(&manifest_path, e))?;
        fsync_dir(&final_dir)?;
        bytes += json.len() as u64;

        if let Some(fp) = fingerprint(&final_dir) {
            self.verified.lock().unwrap_or_else(|e| e.into_inner()).insert(final_dir.clone(), fp);
        }
        let seconds = start.elapsed().as_secs_f64();
        tracing::debug!(step, dir = %final_dir.display(), bytes, seconds, "checkpoint saved");
        Ok(SaveStats {
            step,
            dir: final_dir,
            bytes,
            seconds,
            mb_per_s: mb_per_s(bytes, seconds),
            pruned: Vec::new(),
            prune_seconds: 0.0,
            upload_seconds: 0.0,
        })
    }

    fn forget(&self, dir: &Path) {
        self.verified.lock().unwrap_or_else(|e| e.into_inner()).remove(dir);
    }

    /// Step directories (`step-<digits>`, temp directories excluded), sorted by step.
    /// A missing `checkpoints/` is an empty list.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>> {
        let ckdir = self.checkpoints_dir();
        let entries = match fs::read_dir(&ckdir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err(&ckdir, e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_err(&ckdir, e))?;
            let name = entry.file_name();
            let Some(step) = name.to_str().and_then(parse_step_name) else { continue };
            let path = entry.path();
            if path.is_dir() {
                out.push((step, path));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Checks a checkpoint (manifest, then size and sha256 of every file it
    /// lists) without loading its tensors; returns the manifest.
    pub fn verify(&self, step_dir: &Path) -> Result<Manifest> {
        let manifest = read_manifest(step_dir)?;
        for (name, entry) in &manifest.files {
            verify_streaming(&step_dir.join(name), entry)?;
        }
        if let Some(fp) = fingerprint(step_dir) {
            self.verified.lock().unwrap_or_else(|e| e.into_inner()).insert(step_dir.to_path_buf(), fp);
        }
        Ok(manifest)
    }

    /// Like `verify`, but trusts a checkpoint this value wrote or verified
    /// before if none of its files changed size or modification time since.
    fn verify_cached(&self, step_dir: &Path) -> Result<()> {
        let known = self.verified.lock().unwrap_or_else(|e| e.into_inner()).get(step_dir).cloned();
        if let Some(known) = known
            && fingerprint(step_dir).as_ref() == Some(&known)
        {
            return Ok(());
        }
        self.forget(step_dir);
        self.verify(step_dir).map(|_| ())
    }

    /// Verifies a checkpoint and reads it into memory.
    pub fn load(&self, step_dir: &Path) -> Result<Loaded> {
        let manifest = read_manifest(step_dir)?;
        let mut model = Vec::new();
        let mut optimizer = Vec::new();
        for (name, entry) in &manifest.files {
            let path = step_dir.join(name);
            if name == MODEL_FILE || name == OPTIMIZER_FILE {
                let bytes = read_verified(&path, entry)?;
                let tensors = parse_safetensors(&path, &bytes)?;
                if name == MODEL_FILE {
                    model = tensors;
                } else {
                    optimizer = tensors;
                }
            } else {
                verify_streaming(&path, entry)?;
            }
        }
        Ok(Loaded { dir: step_dir.to_path_buf(), manifest, model, optimizer, skipped: Vec::new() })
    }

    /// The newest checkpoint that verifies, loaded. Each newer one that does
    /// not is logged with `tracing::warn!` naming the offending file and why,
    /// and listed in [`Loaded::skipped`]. `Ok(None)` when there is none (also
    /// when all are invalid; each was warned about).
    pub fn latest_valid(&self) -> Result<Option<Loaded>> {
        let mut skipped = Vec::new();
        for (step, dir) in self.list()?.into_iter().rev() {
            match self.load(&dir) {
                Ok(mut loaded) => {
                    loaded.skipped = skipped;
                    return Ok(Some(loaded));
                }
                Err(e) => {
                    let file = e.path().map_or_else(|| dir.clone(), Path::to_path_buf);
                    tracing::warn!(
                        step,
                        file = %file.display(),
                        "skipping invalid checkpoint: {e}"
                    );
                    skipped.push((file, e.to_string()));
                }
            }
        }
        if !skipped.is_empty() {
            tracing::warn!(
                dir = %self.checkpoints_dir().display(),
                skipped = skipped.len(),
                "no valid checkpoint found"
            );
        }
        Ok(None)
    }

    /// Removes every step directory except the newest `keep` valid ones
    /// (`keep` 0 counts as 1: the newest valid checkpoint is never removed),
    /// and temp directories left by crashed saves. A directory that cannot be
    /// checked because of an I/O error (rather than found corrupt) is left
    /// alone, as is anything a save in this process is writing and temp
    /// directories of other live processes. Returns the removed directories.
    pub fn prune(&self, keep: usize) -> Result<Vec<PathBuf>> {
        let keep = keep.max(1);
        let mut kept = 0usize;
        let mut doomed = Vec::new();
        for (_, dir) in self.list()?.into_iter().rev() {
            if in_progress(&dir) {
                continue;
            }
            if kept >= keep {
                doomed.push(dir);
                continue;
            }
            match self.verify_cached(&dir) {
                Ok(()) => kept += 1,
                Err(e @ CheckpointError::Io { .. }) => {
                    tracing::warn!(dir = %dir.display(), "not pruning a checkpoint that could not be checked: {e}");
                }
                Err(e) => {
                    tracing::info!(dir = %dir.display(), "pruning invalid checkpoint: {e}");
                    doomed.push(dir);
                }
            }
        }

        let ckdir = self.checkpoints_dir();
        if let Ok(entries) = fs::read_dir(&ckdir) {
            for entry in entries.flatten() {
                let name = entry.file_name();
                let Some(pid) = name.to_str().and_then(parse_temp_name) else { continue };
                let path = entry.path();
                if in_progress(&path) || other_process_alive(pid) {
                    continue;
                }
                doomed.push(path);
            }
        }

        let mut removed = Vec::new();
        for dir in doomed {
            self.forget(&dir);
            let res = if dir.is_dir() { fs::remove_dir_all(&dir) } else { fs::remove_file(&dir) };
            match res {
                Ok(()) => removed.push(dir),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "could not prune checkpoint"),
            }
        }
        if !removed.is_empty() {
            fsync_dir(&ckdir)?;
        }
        Ok(removed)
    }
}

// ---------------------------------------------------------------------------
// AsyncSaver

struct Job {
    step: u64,
    model: Vec<TensorData>,
    optimizer: Vec<TensorData>,
    meta: ManifestMeta,
}

/// Test hook: lets a test hold the worker before it writes anything.
#[cfg(test)]
#[derive(Debug, Default)]
struct Gate {
    closed: Mutex<bool>,
    cv: std::sync::Condvar,
}

#[cfg(test)]
impl Gate {
    fn set_closed(&self, closed: bool) {
        *self.closed.lock().unwrap_or_else(|e| e.into_inner()) = closed;
        self.cv.notify_all();
    }

    fn wait_open(&self, max: Duration) {
        let g = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self.cv.wait_timeout_while(g, max, |closed| *closed);
    }
}

/// A second home for saved checkpoints (an object store: `crate::remote::RemoteStore`), written by the saver
/// thread after each local save.
pub trait Mirror: Send + Sync + std::fmt::Debug {
    /// Copies one saved step directory (`.../checkpoints/step-NNNNNN`), its manifest last.
    fn upload(&self, step_dir: &Path) -> Result<(), String>;
    /// Keeps the newest `keep` checkpoints there.
    fn prune(&self, keep: usize) -> Result<(), String>;
}

/// Saves checkpoints on one background thread, then prunes to the newest `keep`.
#[derive(Debug)]
pub struct AsyncSaver {
    dir: CheckpointDir,
    keep: usize,
    jobs: Option<mpsc::Sender<Job>>,
    results: Option<mpsc::Receiver<Result<SaveStats>>>,
    worker: Option<thread::JoinHandle<()>>,
    /// Step of the save in flight, if any.
    pending: Option<u64>,
    wait_timeout: Duration,
    last_wait: Duration,
    last_stats: Option<SaveStats>,
    /// Where every saved checkpoint is mirrored to (an object store).
    mirror: Option<Arc<dyn Mirror>>,
    /// Buffers of saved checkpoints, handed back for the next snapshot (their
    /// pages are already mapped, so copying into them costs no page faults).
    spare: Arc<Mutex<Vec<Vec<f32>>>>,
    /// Seconds the finished saves took, in total.
    saved_seconds: f64,
    #[cfg(test)]
    gate: Arc<Gate>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("step", &self.step).finish_non_exhaustive()
    }
}

impl AsyncSaver {
    /// A saver for `dir` that keeps the newest `keep` valid checkpoints. The
    /// thread starts with the first `submit`.
    pub fn new(dir: CheckpointDir, keep: usize) -> Self {
        Self {
            dir,
            keep,
            jobs: None,
            results: None,
            worker: None,
            pending: None,
            wait_timeout: DEFAULT_WAIT_TIMEOUT,
            last_wait: Duration::ZERO,
            last_stats: None,
            mirror: None,
            spare: Arc::default(),
            saved_seconds: 0.0,
            #[cfg(test)]
            gate: Arc::default(),
        }
    }

    /// Seconds the saves finished so far took (writing, hashing, fsync), in total.
    pub fn total_save_seconds(&self) -> f64 {
        self.saved_seconds
    }

    /// The tensor buffers of finished saves, in the order they were
    /// submitted, for [`TensorData::copy_from`] into the next snapshot.
    pub fn spare_buffers(&self) -> Vec<Vec<f32>> {
        std::mem::take(&mut *self.spare.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Allocates buffers of `sizes` (the snapshot's tensors, in order) on a
    /// background thread and writes every page once, so that the first
    /// snapshot copies into mapped memory instead of paying a page fault
    /// every 4 KiB inside the training loop's window. Buffers already handed
    /// back by a save take precedence.
    pub fn prefault(&self, sizes: Vec<usize>) {
        let spare = Arc::clone(&self.spare);
        let spawned = thread::Builder::new().name("shoal-ckpt-prefault".to_string()).spawn(move || {
            let bufs: Vec<Vec<f32>> = sizes
                .into_iter()
                .map(|n| {
                    let mut v = Vec::with_capacity(n);
                    v.resize(n, 0.0);
                    v
                })
                .collect();
            let mut spare = spare.lock().unwrap_or_else(|e| e.into_inner());
            if spare.is_empty() {
                *spare = bufs;
            }
        });
        if let Err(e) = spawned {
            tracing::debug!("no prefault thread: {e}");
        }
    }

    /// Also uploads every saved checkpoint to `remote` (on the saver thread) and prunes it to `keep` there.
    pub fn with_mirror(mut self, remote: Arc<dyn Mirror>) -> Self {
        self.mirror = Some(remote);
        self
    }

    /// Bound on how long `submit` (and drop) waits for a save still running
    /// (default 600 s).
    pub fn with_wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &CheckpointDir {
        &self.dir
    }

    /// Whether a save is in flight (submitted and its result not yet collected).
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// How long the last `submit` waited for the previous save.
    pub fn last_wait(&self) -> Duration {
        self.last_wait
    }

    /// Stats of the last save whose result was collected (by `submit` or `flush`).
    pub fn last_stats(&self) -> Option<&SaveStats> {
        self.last_stats.as_ref()
    }

    fn ensure_worker(&mut self) -> Result<()> {
        if self.jobs.is_some() {
            return Ok(());
        }
        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let (res_tx, res_rx) = mpsc::channel::<Result<SaveStats>>();
        let dir = self.dir.clone();
        let keep = self.keep;
        let mirror = self.mirror.clone();
        let spare = Arc::clone(&self.spare);
        #[cfg(test)]
        let gate = Arc::clone(&self.gate);
        let handle = thread::Builder::new()
            .name("shoal-ckpt-saver".to_string())
            .spawn(move || {
                while let Ok(job) = job_rx.recv() {
                    #[cfg(test)]
                    gate.wait_open(Duration::from_secs(60));
                    let Job { step, model, optimizer, meta } = job;
                    let mut res = dir.save_with_stats(step, &model, &optimizer, meta);
                    {
                        let mut spare = spare.lock().unwrap_or_else(|e| e.into_inner());
                        spare.clear();
                        spare.extend(model.into_iter().chain(optimizer).map(|t| t.data));
                    }
                    if let Ok(stats) = &mut res {
                        let t = Instant::now();
                        match dir.prune(keep) {
                            Ok(removed) => stats.pruned = removed,
                            Err(e) => tracing::warn!("pruning checkpoints failed: {e}"),
                        }
                        stats.prune_seconds = t.elapsed().as_secs_f64();
                    }
                    if let (Ok(stats), Some(m)) = (&mut res, &mirror) {
                        let t = Instant::now();
                        let up = m.upload(&stats.dir).and_then(|()| m.prune(keep));
                        stats.upload_seconds = t.elapsed().as_secs_f64();
                        if let Err(why) = up {
                            res = Err(CheckpointError::Remote { why });
                        }
                    }
                    if res_tx.send(res).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| CheckpointError::SaverGone { why: format!("cannot start: {e}") })?;
        self.jobs = Some(job_tx);
        self.results = Some(res_rx);
        self.worker = Some(handle);
        Ok(())
    }

    /// The worker is gone: forget it so that the next submit starts a new one.
    fn reap_worker(&mut self) -> CheckpointError {
        self.jobs = None;
        self.results = None;
        self.pending = None;
        let why = match self.worker.take().map(thread::JoinHandle::join) {
            Some(Err(_)) => "panicked".to_string(),
            _ => "exited".to_string(),
        };
        CheckpointError::SaverGone { why }
    }

    /// Waits up to `timeout` for the save in flight. `Ok(None)` if none.
    fn wait_pending(&mut self, timeout: Duration) -> Result<Option<SaveStats>> {
        let Some(step) = self.pending else { return Ok(None) };
        let Some(results) = &self.results else { return Err(self.reap_worker()) };
        let started = Instant::now();
        match results.recv_timeout(timeout) {
            Ok(res) => {
                self.pending = None;
                let stats = res?;
                self.saved_seconds += stats.seconds;
                self.last_stats = Some(stats.clone());
                Ok(Some(stats))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(CheckpointError::Timeout {
                what: format!("the checkpoint save of step {step}"),
                waited: started.elapsed(),
            }),
            // The worker only drops its sender by exiting, i.e. by panicking here.
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(self.reap_worker()),
        }
    }

    /// Hands a checkpoint to the background thread and returns at once; the
    /// caller has already made the copies (that copy is all the step loop pays
    /// for). If the previous save is still running, first waits for it (at
    /// most the wait timeout); returns how long it waited (also logged when
    /// over 1 ms, and kept in [`last_wait`](Self::last_wait)).
    ///
    /// If the previous save failed, the new save is still queued and the
    /// previous save's error is returned. If the wait times out, the error is
    /// `Timeout` and this checkpoint is dropped (not queued).
    pub fn submit(
        &mut self,
        step: u64,
        model: Vec<TensorData>,
        optimizer: Vec<TensorData>,
        meta: ManifestMeta,
    ) -> Result<Duration> {
        let started = Instant::now();
        let previous = match self.wait_pending(self.wait_timeout) {
            Err(e @ CheckpointError::Timeout { .. }) => return Err(e),
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
        let waited = started.elapsed();
        self.last_wait = waited;
        if waited > Duration::from_millis(1) {
            tracing::info!(step, waited_s = waited.as_secs_f64(), "checkpoint submit waited for the previous save");
        }
        self.ensure_worker()?;
        let job = Job { step, model, optimizer, meta };
        let sent = match &self.jobs {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        };
        if !sent {
            return Err(self.reap_worker());
        }
        self.pending = Some(step);
        previous.map(|()| waited)
    }

    /// Waits up to `timeout` for the save in flight and returns its result:
    /// `Ok(None)` if nothing was in flight. On `Timeout` the save stays in
    /// flight and a later `flush` can wait again.
    pub fn flush(&mut self, timeout: Duration) -> Result<Option<SaveStats>> {
        self.wait_pending(timeout)
    }
}

impl Drop for AsyncSaver {
    fn drop(&mut self) {
        if self.pending.is_some() {
            match self.wait_pending(self.wait_timeout) {
                Ok(_) => {}
                Err(e) => tracing::warn!("checkpoint save in flight at shutdown: {e}"),
            }
        }
        self.jobs = None; // closes the channel: an idle worker exits at once
        if self.pending.is_none() {
            if let Some(h) = self.worker.take() {
                let _ = h.join();
            }
        } else {
            tracing::warn!("leaving the checkpoint saver thread running (save timed out)");
        }
    }
}

/// Sequential write speed of the disk under `dir`, MB/s: `bytes` of
/// incompressible data in 4 MiB writes, then fsync — through the page cache,
/// as `dd conv=fsync` does. See [`measure_disk_write_direct`] for the other way.
pub fn measure_disk_write(dir: impl AsRef<Path>, bytes: u64) -> Result<f64> {
    probe_disk(dir.as_ref(), bytes, false)
}

/// Like [`measure_disk_write`], with `O_DIRECT` (as `dd oflag=direct`) where
/// the filesystem allows it (else through the page cache).
pub fn measure_disk_write_direct(dir: impl AsRef<Path>, bytes: u64) -> Result<f64> {
    probe_disk(dir.as_ref(), bytes, true)
}

fn probe_disk(dir: &Path, bytes: u64, direct: bool) -> Result<f64> {
    if bytes == 0 {
        return Err(CheckpointError::InvalidInput { why: "measure_disk_write of 0 bytes".into() });
    }
    fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let path = dir.join(format!(".shoal-disk-probe-{}-{}", std::process::id(), now_unix_ms()));
    // Incompressible-looking data (xorshift), generated once.
    let mut data = vec![0u8; CHUNK_BYTES];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for c in data.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    let result = (|| -> Result<f64> {
        let start = Instant::now();
        write_stream(&path, direct, |w| {
            let mut left = bytes;
            while left > 0 {
                let n = usize::try_from(left.min(data.len() as u64)).unwrap_or(data.len());
                w.push(&data[..n])?;
                left -= n as u64;
            }
            Ok(())
        })?;
        Ok(mb_per_s(bytes, start.elapsed().as_secs_f64()))
    })();
    let _ = fs::remove_file(&path);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "shoal-ckpt-test-{}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed),
                now_unix_ms()
            ));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).expect("create temp dir");
            Self(p)
        }
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn model(seed: f32) -> Vec<TensorData> {
        vec![
            TensorData::new("layers.0.weight", vec![3, 4], (0..12).map(|i| i as f32 * 0.5 + seed).collect()),
            TensorData::new("layers.0.bias", vec![4], vec![f32::NAN, -0.0, f32::INFINITY, 1e-40]),
            TensorData::new("scale", vec![], vec![seed]),
            TensorData::new("empty", vec![0, 5], vec![]),
        ]
    }

    fn optimizer(seed: f32) -> Vec<TensorData> {
        vec![
            TensorData::new("m.layers.0.weight", vec![3, 4], vec![seed; 12]),
            TensorData::new("v.layers.0.weight", vec![3, 4], vec![-seed; 12]),
        ]
    }

    fn meta(epoch: u64) -> ManifestMeta {
        ManifestMeta {
            epoch,
            sampler: serde_json::json!({"epoch": epoch, "position": 17}),
            rng: serde_json::json!({"seed": 42, "state": [1, 2, 3]}),
            world_size: 2,
            strategy: "ddp".into(),
            extra: serde_json::json!({"losses": [2.5, 2.25]}),
        }
    }

    fn bits(ts: &[TensorData]) -> Vec<(String, Vec<usize>, Vec<u32>)> {
        ts.iter().map(|t| (t.name.clone(), t.shape.clone(), t.data.iter().map(|x| x.to_bits()).collect())).collect()
    }

    fn save3(cd: &CheckpointDir) -> Result<Vec<PathBuf>> {
        (1..=3u64).map(|s| cd.save(s * 10, &model(s as f32), &optimizer(s as f32), meta(s))).collect()
    }

    #[test]
    fn round_trip_is_bit_exact() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        let dir = cd.save(7, &model(1.5), &optimizer(2.5), meta(3))?;
        assert_eq!(dir, tmp.path().join("checkpoints/step-000007"));
        for f in [MODEL_FILE, OPTIMIZER_FILE, MANIFEST_FILE] {
            assert!(dir.join(f).is_file(), "{f}");
        }
        assert!(!dir.join("manifest.json.tmp").exists());
        let loaded = cd.load(&dir)?;
        assert_eq!(bits(&loaded.model), bits(&model(1.5)));
        assert_eq!(bits(&loaded.optimizer), bits(&optimizer(2.5)));
        assert_eq!(loaded.manifest.step, 7);
        assert_eq!(loaded.manifest.format, FORMAT_VERSION);
        assert_eq!(loaded.manifest.meta(), meta(3));
        assert_eq!(loaded.manifest.files.len(), 2);
        let model_len = fs::metadata(dir.join(MODEL_FILE))?.len();
        assert_eq!(loaded.manifest.files[MODEL_FILE].bytes, model_len);
        assert_eq!(loaded.manifest.files[MODEL_FILE].sha256, hex_sha256(&fs::read(dir.join(MODEL_FILE))?));

        // The file is plain safetensors: the crate reads it on its own.
        let bytes = fs::read(dir.join(MODEL_FILE))?;
        let st = SafeTensors::deserialize(&bytes)?;
        let w = st.tensor("layers.0.weight")?;
        assert_eq!(w.dtype(), Dtype::F32);
        assert_eq!(w.shape(), &[3, 4]);
        assert_eq!(&w.data()[4..8], &2.0f32.to_le_bytes());

        let latest = cd.latest_valid()?.ok_or("no checkpoint")?;
        assert_eq!(latest.dir, dir);
        assert!(latest.skipped.is_empty());

        // Saving the same step again replaces it.
        let again = cd.save(7, &model(9.0), &optimizer(9.0), meta(4))?;
        assert_eq!(again, dir);
        assert_eq!(bits(&cd.load(&dir)?.model), bits(&model(9.0)));
        assert_eq!(cd.list()?.len(), 1);
        Ok(())
    }

    #[test]
    fn bad_input_is_rejected() {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        let wrong = vec![TensorData::new("w", vec![2, 2], vec![1.0; 3])];
        let dup = vec![TensorData::new("w", vec![1], vec![1.0]), TensorData::new("w", vec![1], vec![2.0])];
        for bad in [wrong, dup] {
            let err = cd.save(1, &bad, &[], ManifestMeta::default());
            assert!(matches!(err, Err(CheckpointError::InvalidInput { .. })), "{err:?}");
        }
        assert!(cd.list().map(|l| l.is_empty()).unwrap_or(false));
    }

    #[test]
    fn empty_dir_has_no_checkpoint() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path().join("never-created"));
        assert!(cd.latest_valid()?.is_none());
        assert!(cd.list()?.is_empty());
        assert!(cd.prune(2)?.is_empty());
        fs::create_dir_all(cd.checkpoints_dir())?;
        assert!(cd.latest_valid()?.is_none());
        Ok(())
    }

    #[test]
    fn prune_keeps_newest_n() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        for s in 1..=5u64 {
            cd.save(s, &model(s as f32), &optimizer(0.0), meta(0))?;
        }
        let removed = cd.prune(2)?;
        assert_eq!(removed.len(), 3);
        let steps: Vec<u64> = cd.list()?.into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![4, 5]);
        // keep = 0 still keeps the newest valid one.
        cd.prune(0)?;
        let steps: Vec<u64> = cd.list()?.into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![5]);
        Ok(())
    }

    #[test]
    fn prune_counts_only_valid_checkpoints() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        let dirs = save3(&cd)?;
        // The newest is corrupt (changed behind the cache's back: size differs).
        fs::write(dirs[2].join(MODEL_FILE), b"garbage")?;
        let removed = cd.prune(1)?;
        assert_eq!(removed, vec![dirs[2].clone(), dirs[0].clone()]);
        assert_eq!(cd.list()?, vec![(20, dirs[1].clone())]);
        Ok(())
    }

    /// Saves three checkpoints, damages the newest with `damage`, and checks
    /// that `latest_valid` falls back to the second, naming `file` as skipped.
    fn check_fallback(damage: impl FnOnce(&Path) -> io::Result<()>, file: &str) -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        let dirs = save3(&cd)?;
        damage(&dirs[2])?;
        let loaded = cd.latest_valid()?.ok_or("no valid checkpoint")?;
        assert_eq!(loaded.dir, dirs[1]);
        assert_eq!(loaded.manifest.step, 20);
        assert_eq!(bits(&loaded.model), bits(&model(2.0)));
        assert_eq!(loaded.skipped.len(), 1, "{:?}", loaded.skipped);
        assert_eq!(loaded.skipped[0].0, dirs[2].join(file), "{:?}", loaded.skipped);
        assert!(loaded.skipped[0].1.contains(file), "{:?}", loaded.skipped);
        // Loading it directly is an error naming the file.
        let err = cd.load(&dirs[2]).err().ok_or("damaged checkpoint loaded")?;
        assert_eq!(err.path(), Some(dirs[2].join(file).as_path()));
        Ok(())
    }

    #[test]
    fn fallback_on_truncated_model() -> TestResult {
        check_fallback(
            |d| {
                let p = d.join(MODEL_FILE);
                let len = fs::metadata(&p)?.len();
                fs::OpenOptions::new().write(true).open(&p)?.set_len(len / 2)
            },
            MODEL_FILE,
        )
    }

    #[test]
    fn fallback_on_flipped_byte() -> TestResult {
        check_fallback(
            |d| {
                let p = d.join(OPTIMIZER_FILE);
                let mut b = fs::read(&p)?;
                let last = b.len() - 1;
                b[last] ^= 0x40;
                fs::write(&p, b)
            },
            OPTIMIZER_FILE,
        )?;
        let err = {
            let tmp = TempDir::new();
            let cd = CheckpointDir::new(tmp.path());
            let d = cd.save(1, &model(1.0), &optimizer(1.0), meta(0))?;
            let p = d.join(MODEL_FILE);
            let mut b = fs::read(&p)?;
            b[9] ^= 1; // inside the header
            fs::write(&p, b)?;
            cd.load(&d).err().ok_or("loaded")?
        };
        assert!(err.to_string().contains("checksum mismatch"), "{err}");
        Ok(())
    }

    #[test]
    fn fallback_on_missing_manifest() -> TestResult {
        check_fallback(|d| fs::remove_file(d.join(MANIFEST_FILE)), MANIFEST_FILE)
    }

    #[test]
    fn fallback_on_garbage_manifest() -> TestResult {
        check_fallback(|d| fs::write(d.join(MANIFEST_FILE), b"{\"format\": 1, \"step\": \x01garbage"), MANIFEST_FILE)?;
        // Valid JSON, wrong step: also rejected.
        check_fallback(
            |d| {
                let p = d.join(MANIFEST_FILE);
                let mut m: Manifest = serde_json::from_slice(&fs::read(&p)?)?;
                m.step = 999;
                fs::write(&p, serde_json::to_vec(&m)?)
            },
            MANIFEST_FILE,
        )
    }

    #[test]
    fn checksummed_but_malformed_safetensors_is_corrupt() -> TestResult {
        // A file whose checksum matches the manifest but whose content is not
        // F32 safetensors must still be an error naming it, not a panic.
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        let d = cd.save(1, &model(1.0), &optimizer(1.0), meta(0))?;
        let with_header = |h: &str, data: &[u8]| {
            let mut v = (h.len() as u64).to_le_bytes().to_vec();
            v.extend_from_slice(h.as_bytes());
            v.extend_from_slice(data);
            v
        };
        let junks = [
            Vec::new(),
            b"\xff\xff\xff\xff\xff\xff\xff\xff{}".to_vec(),
            with_header(r#"{"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}"#, &[0; 4]),
            with_header(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, &[0; 4]),
            with_header(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#, &[0; 8]),
        ];
        for junk in &junks {
            let junk = junk.as_slice();
            fs::write(d.join(MODEL_FILE), junk)?;
            let mp = d.join(MANIFEST_FILE);
            let mut m: Manifest = serde_json::from_slice(&fs::read(&mp)?)?;
            m.files.insert(MODEL_FILE.into(), FileEntry { bytes: junk.len() as u64, sha256: hex_sha256(junk) });
            fs::write(&mp, serde_json::to_vec(&m)?)?;
            match cd.load(&d) {
                Err(CheckpointError::Corrupt { path, .. }) => assert_eq!(path, d.join(MODEL_FILE)),
                other => return Err(format!("{junk:?}: {other:?}").into()),
            }
        }
        Ok(())
    }

    #[test]
    fn crash_temp_dir_is_ignored_and_pruned() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        let dirs = save3(&cd)?;
        // A save that crashed before the rename (pid that cannot be alive).
        let stale = cd.checkpoints_dir().join("step-000040.tmp-4294967295");
        fs::create_dir(&stale)?;
        fs::write(stale.join(MODEL_FILE), b"half")?;
        // One from this very process (e.g. a failed save) is stale too.
        let own = cd.checkpoints_dir().join(format!("step-000050.tmp-{}", std::process::id()));
        fs::create_dir(&own)?;
        assert_eq!(cd.list()?.len(), 3);
        let loaded = cd.latest_valid()?.ok_or("none")?;
        assert_eq!(loaded.dir, dirs[2]);
        assert!(loaded.skipped.is_empty());
        let removed = cd.prune(3)?;
        assert!(removed.contains(&stale) && removed.contains(&own), "{removed:?}");
        assert!(!stale.exists() && !own.exists());
        assert_eq!(cd.list()?.len(), 3);
        Ok(())
    }

    #[test]
    fn async_saver_saves_in_background() -> TestResult {
        let tmp = TempDir::new();
        let cd = CheckpointDir::new(tmp.path());
        let mut saver = AsyncSaver::new(cd.clone(), 2).with_wait_timeout(Duration::from_secs(120));
        assert!(saver.flush(Duration::from_secs(1))?.is_none());

        // Large-ish: 4 Mi floats (16 MiB).
        let big = vec![TensorData::new("w", vec![1024, 4096], (0..4 << 20).map(|i| i as f32).collect())];
        saver.gate.set_closed(true);
        saver.submit(1, big.clone(), optimizer(1.0), meta(0))?;
        // submit returned while the worker is held before writing a byte.
        assert!(saver.is_pending());
        assert!(!cd.step_dir(1).exists());
        let timeout = saver.flush(Duration::from_millis(50));
        assert!(matches!(timeout, Err(CheckpointError::Timeout { .. })), "{timeout:?}");
        assert!(saver.is_pending());
        saver.gate.set_closed(false);
        let stats = saver.flush(Duration::from_secs(120))?.ok_or("no stats")?;
        assert_eq!(stats.step, 1);
        assert_eq!(stats.dir, cd.step_dir(1));
        assert!(stats.bytes > 16 << 20);
        assert!(stats.seconds > 0.0 && stats.mb_per_s > 0.0);
        assert!(!saver.is_pending());
        assert!(saver.flush(Duration::from_secs(1))?.is_none());
        assert_eq!(bits(&cd.load(&stats.dir)?.model), bits(&big));

        // Back-to-back submits: the second waits for the first; pruning keeps 2.
        for s in 2..=4 {
            saver.submit(s, model(s as f32), optimizer(s as f32), meta(s))?;
        }
        let last = saver.flush(Duration::from_secs(120))?.ok_or("no stats")?;
        assert_eq!(last.step, 4);
        assert_eq!(saver.last_stats().map(|s| s.step), Some(4));
        let steps: Vec<u64> = cd.list()?.into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![3, 4]);
        Ok(())
    }

    #[test]
    fn async_saver_reports_errors() -> TestResult {
        let tmp = TempDir::new();
        // The output "directory" is a file: every save fails.
        let root = tmp.path().join("not-a-dir");
        fs::write(&root, b"x")?;
        let mut saver = AsyncSaver::new(CheckpointDir::new(&root), 1);
        saver.submit(1, model(1.0), optimizer(1.0), meta(0))?;
        // The first save's error comes back from the next submit.
        let err = saver.submit(2, model(1.0), optimizer(1.0), meta(0));
        assert!(matches!(err, Err(CheckpointError::Io { .. })), "{err:?}");
        // ... and the second one was still queued; its error comes from flush.
        let err = saver.flush(Duration::from_secs(60));
        assert!(matches!(err, Err(CheckpointError::Io { .. })), "{err:?}");
        assert!(saver.flush(Duration::from_secs(1))?.is_none());
        Ok(())
    }

    #[test]
    fn disk_write_speed_is_measured() -> TestResult {
        let tmp = TempDir::new();
        let mbps = measure_disk_write(tmp.path(), 8 << 20)?;
        assert!(mbps > 0.0);
        assert_eq!(fs::read_dir(tmp.path())?.count(), 0, "probe file left behind");
        Ok(())
    }

    /// `cargo test --release -- --ignored --nocapture save_throughput`:
    /// 100M parameters with AdamW state (1.2 GB) against the disk's speed.
    #[test]
    #[ignore = "writes 1.2 GB"]
    fn save_throughput() -> TestResult {
        let dir = std::env::var_os("SHOAL_CKPT_BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from);
        let tmp = TempDir(dir.join(format!("shoal-ckpt-bench-{}", std::process::id())));
        let n = 100_000_000usize;
        let model = vec![TensorData::new("w", vec![n], vec![0.5; n])];
        let opt = vec![TensorData::new("m.w", vec![n], vec![0.25; n]), TensorData::new("v.w", vec![n], vec![0.125; n])];
        let t = Instant::now();
        let h = hash_safetensors(b"", &opt);
        println!("hash of 800 MB: {:.2} s ({})", t.elapsed().as_secs_f64(), &h[..8]);
        let t = Instant::now();
        let mut buf = Vec::new();
        let mut acc = 0u8;
        for c in opt[0].data.chunks(CHUNK_BYTES / 4) {
            to_le_into(c, &mut buf);
            acc ^= buf[7];
        }
        println!("convert 400 MB: {:.2} s ({acc})", t.elapsed().as_secs_f64());
        let disk = measure_disk_write(tmp.path(), 1_200_000_000)?;
        let cd = CheckpointDir::new(tmp.path());
        let stats = cd.save_with_stats(1, &model, &opt, meta(0))?;
        let t = Instant::now();
        let loaded = cd.load(&stats.dir)?;
        let load_s = t.elapsed().as_secs_f64();
        println!(
            "disk {disk:.0} MB/s; save {:.0} MB/s ({:.2} s, {:.0}% of disk); load+verify {load_s:.2} s",
            stats.mb_per_s,
            stats.seconds,
            100.0 * stats.mb_per_s / disk
        );
        assert_eq!(loaded.model[0].data.len(), n);
        Ok(())
    }
}
