//! In-memory checkpoints ([`MemoryStore`]): the same checkpoints as on storage (safetensors + manifest with sha256,
//! written into a temporary directory and published by renames), kept in shared memory on the host (`/dev/shm`),
//! which outlives the worker's process but not the host. One directory per job and host:
//!
//! ```text
//! /dev/shm/shoal-<job>/host-<16 hex digits of sha256(host id)>/checkpoints/step-000040/...
//! ```
//!
//! The host part keeps hosts that share one `/dev/shm` (network namespaces of one machine) apart. The newest valid
//! copy is found by skipping corrupt or partial ones with a warning naming the file, as on storage.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::dir::{CheckpointDir, Loaded};
use super::error::{Result, io_err};
use super::manifest::hex_sha256;

/// How many in-memory copies a host keeps (the newest and the one before, in case the newest is damaged).
pub const MEMORY_KEEP: usize = 2;

/// The in-memory checkpoints of one job on this host.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    /// The job's directory (`/dev/shm/shoal-<job>`), removed whole at the end.
    job_root: PathBuf,
    /// This host's checkpoints under it.
    dir: CheckpointDir,
}

/// A copy found in memory, loaded and verified, with the copies skipped on the way.
pub type MemoryCopy = Loaded;

/// Copies skipped as damaged or partial: the offending file and why.
pub type Skipped = Vec<(PathBuf, String)>;

impl MemoryStore {
    /// The store of a job whose directory is `job_root`, for the host `host_id` (the communicator's host identity).
    pub fn new(job_root: impl Into<PathBuf>, host_id: &str) -> Self {
        let job_root = job_root.into();
        let host = &hex_sha256(host_id.as_bytes())[..16];
        let dir = CheckpointDir::new(job_root.join(format!("host-{host}")));
        Self { job_root, dir }
    }

    /// The checkpoint directory of this host (for an [`AsyncSaver`](super::AsyncSaver) and loads).
    pub fn dir(&self) -> &CheckpointDir {
        &self.dir
    }

    /// The job's directory on this host.
    pub fn job_root(&self) -> &Path {
        &self.job_root
    }

    /// The steps of the copies present (valid or not), oldest first.
    pub fn steps(&self) -> Result<Vec<u64>> {
        Ok(self.dir.list()?.into_iter().map(|(s, _)| s).collect())
    }

    /// The newest copy that verifies, loaded (`None` when there is none), and every copy skipped on the way (all of
    /// them when none verifies): the offending file and why, each also logged with a warning. The copy found lists
    /// the newer ones it skipped in [`Loaded::skipped`] too.
    pub fn newest_valid(&self) -> Result<(Option<MemoryCopy>, Skipped)> {
        let mut skipped = Vec::new();
        for (step, dir) in self.dir.list()?.into_iter().rev() {
            match self.dir.load(&dir) {
                Ok(mut copy) => {
                    copy.skipped = skipped.clone();
                    return Ok((Some(copy), skipped));
                }
                Err(e) => {
                    let file = e.path().map_or_else(|| dir.clone(), Path::to_path_buf);
                    tracing::warn!(step, file = %file.display(), "skipping an invalid in-memory copy: {e}");
                    skipped.push((file, e.to_string()));
                }
            }
        }
        Ok((None, skipped))
    }

    /// The copy of `step`, loaded and verified (an error naming the file when it is missing or damaged).
    pub fn load_step(&self, step: u64) -> Result<MemoryCopy> {
        self.dir.load(&self.dir.step_dir(step))
    }

    /// Removes the job's directory on this host (every host's copies under it); a missing one is no error.
    pub fn remove(&self) -> Result<()> {
        match fs::remove_dir_all(&self.job_root) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&self.job_root, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::Real;
    use crate::checkpoint::layout::{MANIFEST_FILE, MODEL_FILE, OPTIMIZER_FILE};
    use crate::checkpoint::saver::AsyncSaver;
    use crate::checkpoint::testing::{TempDir, TestResult, bits, meta, model, optimizer};

    #[test]
    fn copies_round_trip_bit_exact_and_keep_the_newest_two() -> TestResult {
        let tmp = TempDir::new();
        let store = MemoryStore::new(tmp.path().join("shoal-job"), "host-a");
        assert!(store.newest_valid()?.0.is_none());
        assert!(store.steps()?.is_empty());
        let mut saver = AsyncSaver::new(store.dir().clone(), MEMORY_KEEP);
        for s in 1..=4u64 {
            saver.submit(s * 10, model(s as Real), optimizer(s as Real + 0.5), meta(s))?;
        }
        saver.flush(Duration::from_secs(60))?;
        assert_eq!(store.steps()?, vec![30, 40]);
        let newest = store.newest_valid()?.0.ok_or("no copy")?;
        assert_eq!(newest.manifest.step, 40);
        assert_eq!(bits(&newest.model), bits(&model(4.0)));
        assert_eq!(bits(&newest.optimizer), bits(&optimizer(4.5)));
        assert_eq!(newest.manifest.meta(), meta(4));
        assert!(newest.skipped.is_empty());
        assert_eq!(store.load_step(30)?.manifest.step, 30);
        // Two hosts of one job keep apart under the job's directory.
        let other = MemoryStore::new(tmp.path().join("shoal-job"), "host-b");
        assert_ne!(other.dir().root(), store.dir().root());
        assert!(other.newest_valid()?.0.is_none());
        assert!(store.dir().root().starts_with(store.job_root()));
        Ok(())
    }

    #[test]
    fn a_damaged_or_partial_copy_is_skipped_naming_its_file() -> TestResult {
        let tmp = TempDir::new();
        let store = MemoryStore::new(tmp.path().join("shoal-job"), "h");
        for s in [10u64, 20] {
            store.dir().save(s, &model(s as Real), &optimizer(1.0), meta(0))?;
        }
        // A flipped byte in the newest copy's optimizer state.
        let p = store.dir().step_dir(20).join(OPTIMIZER_FILE);
        let mut b = fs::read(&p)?;
        let last = b.len() - 1;
        b[last] ^= 0x01;
        fs::write(&p, b)?;
        let got = store.newest_valid()?.0.ok_or("no copy")?;
        assert_eq!(got.manifest.step, 10);
        assert_eq!(bits(&got.model), bits(&model(10.0)));
        assert_eq!(got.skipped.len(), 1);
        assert_eq!(got.skipped[0].0, p);
        assert!(got.skipped[0].1.contains("checksum mismatch"), "{:?}", got.skipped);
        let err = store.load_step(20).err().ok_or("damaged copy loaded")?;
        assert_eq!(err.path(), Some(p.as_path()));

        // A partial copy: the model file missing, then no manifest at all.
        fs::remove_file(store.dir().step_dir(10).join(MODEL_FILE))?;
        let err = store.load_step(10).err().ok_or("partial copy loaded")?;
        assert_eq!(err.path(), Some(store.dir().step_dir(10).join(MODEL_FILE).as_path()));
        fs::remove_file(store.dir().step_dir(10).join(MANIFEST_FILE))?;
        let (none, skipped) = store.newest_valid()?;
        assert!(none.is_none());
        let files: Vec<&Path> = skipped.iter().map(|(f, _)| f.as_path()).collect();
        assert_eq!(files, [p.as_path(), store.dir().step_dir(10).join(MANIFEST_FILE).as_path()]);
        assert!(store.load_step(99).is_err());
        Ok(())
    }

    #[test]
    fn remove_takes_the_whole_job_directory_and_tolerates_none() -> TestResult {
        let tmp = TempDir::new();
        let store = MemoryStore::new(tmp.path().join("shoal-job"), "h");
        store.dir().save(1, &model(1.0), &optimizer(1.0), meta(0))?;
        assert!(store.job_root().is_dir());
        store.remove()?;
        assert!(!store.job_root().exists());
        store.remove()?;
        assert!(store.newest_valid()?.0.is_none());
        Ok(())
    }
}
