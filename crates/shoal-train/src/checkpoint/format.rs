//! Tensors in safetensors files: [`TensorData`], the flat `Real` buffers callers hand in, checked and written as
//! one file (header, then the values little-endian, converted a chunk at a time straight into the writer's buffer)
//! while a second thread hashes the same bytes, and parsed back from a verified file.

use crate::{REAL_BYTES, Real};

/// [`Real`] as safetensors names it.
#[cfg(not(feature = "f64"))]
pub(super) const REAL_ST_DTYPE: Dtype = Dtype::F32;
/// [`Real`] as safetensors names it.
#[cfg(feature = "f64")]
pub(super) const REAL_ST_DTYPE: Dtype = Dtype::F64;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::thread;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use sha2::{Digest, Sha256};

use super::direct::{CHUNK_BYTES, write_stream};
use super::error::{CheckpointError, Result, corrupt, io_err, open_err};
use super::manifest::FileEntry;

/// One named tensor as a flat, row-major `Real` buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorData {
    /// Parameter (or optimizer state) name, e.g. `layers.0.weight` or `adamw.m.layers.0.weight`.
    pub name: String,
    /// Shape; the product must equal `data.len()` (`[]` is a scalar).
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub data: Vec<Real>,
}

impl TensorData {
    /// Builds a tensor.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, data: Vec<Real>) -> Self {
        Self { name: name.into(), shape, data }
    }

    /// A copy of `values` into `buf` (reusing its allocation when it is large enough).
    pub fn copy_from(name: impl Into<String>, shape: Vec<usize>, values: &[Real], mut buf: Vec<Real>) -> Self {
        buf.clear();
        buf.extend_from_slice(values);
        Self::new(name, shape, buf)
    }
}

/// Refuses tensors that cannot be saved: an empty or reserved name, a name twice, values that do not fill the
/// shape.
pub(super) fn validate_tensors(what: &str, tensors: &[TensorData]) -> Result<()> {
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

/// The safetensors header (length prefix included) for `tensors` laid out in order, with the string map `extra`
/// under `__metadata__` when given.
fn safetensors_header(path: &Path, tensors: &[TensorData], extra: Option<HashMap<String, String>>) -> Result<Vec<u8>> {
    let mut offset = 0usize;
    let mut infos = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n = t
            .data
            .len()
            .checked_mul(REAL_BYTES)
            .ok_or_else(|| CheckpointError::InvalidInput { why: format!("tensor {:?} is too large", t.name) })?;
        let end = offset
            .checked_add(n)
            .ok_or_else(|| CheckpointError::InvalidInput { why: "tensors are too large".to_string() })?;
        infos.push((
            t.name.clone(),
            TensorInfo { dtype: REAL_ST_DTYPE, shape: t.shape.clone(), data_offsets: (offset, end) },
        ));
        offset = end;
    }
    let metadata = Metadata::new(extra, infos)
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
fn to_le_into(src: &[Real], buf: &mut Vec<u8>) {
    buf.resize(src.len() * REAL_BYTES, 0);
    for (d, x) in buf.chunks_exact_mut(REAL_BYTES).zip(src) {
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
        for chunk in t.data.chunks(CHUNK_BYTES / REAL_BYTES) {
            to_le_into(chunk, &mut buf);
            hasher.update(&buf);
        }
    }
    format!("{:x}", hasher.finalize())
}

/// Writes header + tensors to `path` (direct I/O where allowed) and fsyncs; returns the bytes written.
fn write_file(path: &Path, header: &[u8], tensors: &[TensorData]) -> Result<u64> {
    write_stream(path, true, |w| {
        w.push(header)?;
        tensors.iter().try_for_each(|t| w.push_real(&t.data))
    })
}

/// Writes `tensors` as a safetensors file and fsyncs it. The sha256 is
/// computed on a second thread while the file is written (the two overlap;
/// each converts its own chunks, so neither holds a full copy).
pub(super) fn write_safetensors(path: &Path, tensors: &[TensorData]) -> Result<FileEntry> {
    write_safetensors_with(path, tensors, None)
}

/// [`write_safetensors`] with a `__metadata__` string map in the header.
pub(super) fn write_safetensors_with(
    path: &Path,
    tensors: &[TensorData],
    extra: Option<HashMap<String, String>>,
) -> Result<FileEntry> {
    let header = safetensors_header(path, tensors, extra)?;
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
pub(super) fn parse_safetensors(path: &Path, bytes: &[u8]) -> Result<Vec<TensorData>> {
    let (n, metadata) =
        SafeTensors::read_metadata(bytes).map_err(|e| corrupt(path, format!("not a valid safetensors file: {e}")))?;
    let data = 8usize
        .checked_add(n)
        .and_then(|start| bytes.get(start..))
        .ok_or_else(|| corrupt(path, "header runs past the end of the file"))?;
    let mut out = Vec::new();
    for name in metadata.offset_keys() {
        let info = metadata.info(&name).ok_or_else(|| corrupt(path, format!("tensor {name:?} lost")))?;
        let (s, e) = info.data_offsets;
        let raw =
            data.get(s..e).ok_or_else(|| corrupt(path, format!("tensor {name:?} runs past the end of the file")))?;
        // Either precision is read into the build's own (an f32 checkpoint resumes in f64 and back).
        let values = match info.dtype {
            Dtype::F32 => raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as Real).collect(),
            Dtype::F64 => raw
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as Real)
                .collect(),
            other => return Err(corrupt(path, format!("tensor {name:?} has dtype {other:?}, not F32 or F64"))),
        };
        out.push(TensorData { name, shape: info.shape.clone(), data: values });
    }
    Ok(out)
}

/// Largest safetensors header read on its own (the safetensors crate's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor as a safetensors header describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct HeaderEntry {
    /// Its name.
    pub name: String,
    /// Its dtype as safetensors spells it (`F32`).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Byte range within the data section.
    pub data_offsets: (usize, usize),
}

/// Reads only the header of the safetensors file at `path` (not its data) and checks it against the file's
/// length; returns its tensors in file order.
pub(super) fn read_safetensors_header(path: &Path) -> Result<Vec<HeaderEntry>> {
    let mut file = File::open(path).map_err(|e| open_err(path, e))?;
    let len = file.metadata().map_err(|e| io_err(path, e))?.len();
    let mut prefix = [0u8; 8];
    if len < 8 {
        return Err(corrupt(path, format!("{len} bytes is too short for a safetensors file")));
    }
    file.read_exact(&mut prefix).map_err(|e| io_err(path, e))?;
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER_BYTES || n > len - 8 {
        return Err(corrupt(path, format!("header length {n} does not fit the file ({len} bytes)")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(|e| io_err(path, e))?;
    let metadata: Metadata =
        serde_json::from_slice(&header).map_err(|e| corrupt(path, format!("not a valid safetensors header: {e}")))?;
    let data_len = metadata.data_len() as u64;
    if 8 + n + data_len != len {
        return Err(corrupt(
            path,
            format!(
                "the header describes {} bytes but the file has {len} (truncated or overwritten)",
                8 + n + data_len
            ),
        ));
    }
    let mut out = Vec::new();
    for name in metadata.offset_keys() {
        let info = metadata.info(&name).ok_or_else(|| corrupt(path, format!("tensor {name:?} lost")))?;
        out.push(HeaderEntry {
            dtype: format!("{:?}", info.dtype),
            shape: info.shape.clone(),
            data_offsets: info.data_offsets,
            name,
        });
    }
    Ok(out)
}

/// Copies tensors out for a checkpoint, into `spare` buffers of earlier checkpoints when there are any.
pub fn tensors_of(
    named: impl IntoIterator<Item = (String, candle_core::Tensor)>,
    spare: &mut impl Iterator<Item = Vec<Real>>,
) -> crate::error::Result<Vec<TensorData>> {
    named
        .into_iter()
        .map(|(n, t)| {
            let buf = spare.next().unwrap_or_default();
            let dims = t.dims().to_vec();
            match crate::kernels::with_slice(&t, |v| TensorData::copy_from(n.clone(), dims.clone(), v, buf)) {
                Ok(td) => Ok(td),
                Err(_) => Ok(TensorData::new(n, dims, t.flatten_all()?.to_vec1::<Real>()?)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::PathBuf;
    use std::time::Instant;

    use super::*;
    use crate::checkpoint::dir::CheckpointDir;
    use crate::checkpoint::direct::measure_disk_write;
    use crate::checkpoint::layout::{MANIFEST_FILE, MODEL_FILE};
    use crate::checkpoint::manifest::{Manifest, hex_sha256};
    use crate::checkpoint::testing::{TempDir, TestResult, meta, model, optimizer};

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
