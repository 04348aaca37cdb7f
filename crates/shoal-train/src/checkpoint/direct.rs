//! Writing to disk at the disk's speed: a chunked writer that goes through `O_DIRECT` from an aligned buffer where
//! the filesystem allows it (falling back to the page cache where it does not), and the disk probes that measure
//! what the disk can do, for comparison with a checkpoint save.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::error::{CheckpointError, Result, io_err};
use crate::{REAL_BYTES, Real};

/// Bytes converted, hashed and written at a time.
pub(super) const CHUNK_BYTES: usize = 4 << 20;

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
pub(super) struct ChunkWriter<'a> {
    path: &'a Path,
    file: File,
    direct: bool,
    buf: AlignedBuf,
    len: usize,
    written: u64,
}

impl ChunkWriter<'_> {
    pub(super) fn push(&mut self, mut bytes: &[u8]) -> Result<()> {
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
    pub(super) fn push_real(&mut self, mut values: &[Real]) -> Result<()> {
        while !values.is_empty() {
            if !self.len.is_multiple_of(REAL_BYTES) {
                // Only after an odd-sized header: go through bytes until aligned to a value.
                let (head, rest) = values.split_at(1);
                self.push(&head[0].to_le_bytes())?;
                values = rest;
                continue;
            }
            let n = ((CHUNK_BYTES - self.len) / REAL_BYTES).min(values.len());
            let at = self.len;
            for (d, x) in self.buf.get()[at..at + REAL_BYTES * n].chunks_exact_mut(REAL_BYTES).zip(&values[..n]) {
                d.copy_from_slice(&x.to_le_bytes());
            }
            self.len += REAL_BYTES * n;
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
pub(super) fn write_stream(
    path: &Path,
    direct: bool,
    fill: impl Fn(&mut ChunkWriter<'_>) -> Result<()>,
) -> Result<u64> {
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

/// Milliseconds since the Unix epoch (0 before it).
pub(super) fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)).unwrap_or(0)
}

/// `bytes` in `seconds`, in MB/s (10^6 bytes per second).
pub(super) fn mb_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 { bytes as f64 / 1e6 / seconds } else { f64::INFINITY }
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
    use crate::checkpoint::testing::{TempDir, TestResult};

    #[test]
    fn disk_write_speed_is_measured() -> TestResult {
        let tmp = TempDir::new();
        let mbps = measure_disk_write(tmp.path(), 8 << 20)?;
        assert!(mbps > 0.0);
        assert_eq!(fs::read_dir(tmp.path())?.count(), 0, "probe file left behind");
        Ok(())
    }
}
