//! The checkpoints of one run on disk ([`CheckpointDir`]): a save written into a temporary step directory and
//! published by renames (tensor files, then the manifest last), loading with verification, the newest valid
//! checkpoint found by skipping corrupt ones, and pruning to the newest `keep` (never what a save is writing).

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Instant, SystemTime};

use super::direct::{mb_per_s, now_unix_ms};
use super::error::{CheckpointError, Result, io_err};
use super::format::{TensorData, parse_safetensors, validate_tensors, write_safetensors};
use super::layout::{
    CHECKPOINTS_SUBDIR, MANIFEST_FILE, MODEL_FILE, OPTIMIZER_FILE, parse_step_name, parse_temp_name, step_dir_name,
};
use super::manifest::{
    FORMAT_VERSION, FileEntry, Manifest, ManifestMeta, read_manifest, read_verified, verify_streaming,
};

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

pub(super) fn fsync_dir(dir: &Path) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use crate::Real;
    use safetensors::SafeTensors;
    use safetensors::tensor::Dtype;

    use super::*;
    use crate::checkpoint::manifest::hex_sha256;
    use crate::checkpoint::testing::{TempDir, TestResult, bits, meta, model, optimizer, save3};

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
            cd.save(s, &model(s as Real), &optimizer(0.0), meta(0))?;
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
}
