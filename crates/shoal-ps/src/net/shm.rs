//! A worker's and a server's shared memory when they run on one host: a segment in `/dev/shm` the server makes for
//! the connection and both map — the shard's values in its first half, the worker's gradient in its second — so a
//! push is one copy into the segment (the server applies it from there) and a pull one copy out of it, instead of
//! the loopback socket's copies into and out of the kernel. The server names the file; a worker that cannot open it
//! (another host) keeps to TCP. The file is removed as soon as the worker has mapped it, and by the server when the
//! connection ends, so nothing is left behind.

use std::path::{Path, PathBuf};

use memmap2::MmapMut;

use crate::error::{PsError, Result};

/// One connection's segment, mapped: `2 × len` values.
#[derive(Debug)]
pub struct Segment {
    map: MmapMut,
    len: usize,
    /// The file, until it is removed.
    path: Option<PathBuf>,
}

fn failed(what: &str, path: &Path, e: std::io::Error) -> PsError {
    PsError::Comm(shoal_comm::Error::io(format!("{what} {}", path.display()), e))
}

impl Segment {
    /// A new segment for a shard of `len` values, in `dir`.
    pub fn create(dir: &Path, len: usize) -> Result<Segment> {
        let path = dir.join(format!("shoal-ps-{}-{:016x}", std::process::id(), rand::random::<u64>()));
        let bytes = (len as u64).checked_mul(8).ok_or_else(|| PsError::InvalidArgument(format!("{len} values")))?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| failed("creating", &path, e))?;
        file.set_len(bytes.max(1)).map_err(|e| failed("sizing", &path, e))?;
        // SAFETY: the file is this connection's alone (a fresh random name), and the protocol lets only one side
        // touch each half at a time (the request or the reply hands it over).
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| failed("mapping", &path, e))?;
        Ok(Segment { map, len, path: Some(path) })
    }

    /// Maps the segment a server made at `path` for `len` values, and removes its name (both sides hold it now).
    pub fn open(path: &Path, len: usize) -> Result<Segment> {
        let file =
            std::fs::OpenOptions::new().read(true).write(true).open(path).map_err(|e| failed("opening", path, e))?;
        let size = file.metadata().map_err(|e| failed("reading", path, e))?.len();
        if size < len as u64 * 8 {
            return Err(PsError::InvalidArgument(format!(
                "{} holds {size} bytes, not {} values",
                path.display(),
                len * 2
            )));
        }
        // SAFETY: as in `create`; the length was checked against the file's.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| failed("mapping", path, e))?;
        let _ = std::fs::remove_file(path);
        Ok(Segment { map, len, path: None })
    }

    /// Where it is, for the worker to open.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    fn floats(&mut self) -> &mut [f32] {
        let n = self.len * 2;
        let all: &mut [f32] = bytemuck::cast_slice_mut(&mut self.map[..n * 4]);
        all
    }

    /// The values half.
    pub fn values(&mut self) -> &mut [f32] {
        let n = self.len;
        &mut self.floats()[..n]
    }

    /// The gradient half.
    pub fn grad(&mut self) -> &mut [f32] {
        let n = self.len;
        &mut self.floats()[n..]
    }

    /// How many values each half holds.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}
