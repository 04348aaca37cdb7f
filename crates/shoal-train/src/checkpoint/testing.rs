//! What the checkpoint module's tests share: a temporary directory removed on drop, and small checkpoints whose
//! values are known (NaN, -0, infinity, a subnormal, a scalar and an empty tensor among them).

use crate::Real;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::dir::CheckpointDir;
use super::direct::now_unix_ms;
use super::error::Result;
use super::format::TensorData;
use super::manifest::ManifestMeta;

/// What a test returns: any error fails it.
pub(super) type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// A fresh directory under the system temp dir, removed on drop.
pub(super) struct TempDir(pub(super) PathBuf);

impl TempDir {
    pub(super) fn new() -> Self {
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
    pub(super) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Model tensors whose values depend on `seed`, with the edge cases among them.
pub(super) fn model(seed: Real) -> Vec<TensorData> {
    vec![
        TensorData::new("layers.0.weight", vec![3, 4], (0..12).map(|i| i as Real * 0.5 + seed).collect()),
        TensorData::new("layers.0.bias", vec![4], vec![Real::NAN, -0.0, Real::INFINITY, 1e-40]),
        TensorData::new("scale", vec![], vec![seed]),
        TensorData::new("empty", vec![0, 5], vec![]),
    ]
}

/// Optimizer state for [`model`]'s first tensor.
pub(super) fn optimizer(seed: Real) -> Vec<TensorData> {
    vec![
        TensorData::new("m.layers.0.weight", vec![3, 4], vec![seed; 12]),
        TensorData::new("v.layers.0.weight", vec![3, 4], vec![-seed; 12]),
    ]
}

/// The caller's part of a manifest, every field set.
pub(super) fn meta(epoch: u64) -> ManifestMeta {
    ManifestMeta {
        epoch,
        sampler: serde_json::json!({"epoch": epoch, "position": 17}),
        rng: serde_json::json!({"seed": 42, "state": [1, 2, 3]}),
        world_size: 2,
        strategy: "ddp".into(),
        extra: serde_json::json!({"losses": [2.5, 2.25]}),
    }
}

/// Names, shapes and the exact bits of the values, to compare tensors (NaN included).
pub(super) fn bits(ts: &[TensorData]) -> Vec<(String, Vec<usize>, Vec<u64>)> {
    ts.iter()
        .map(|t| (t.name.clone(), t.shape.clone(), t.data.iter().map(|x| u64::from(x.to_bits())).collect()))
        .collect()
}

/// Saves steps 10, 20 and 30 (seeds 1, 2, 3); returns their directories.
pub(super) fn save3(cd: &CheckpointDir) -> Result<Vec<PathBuf>> {
    (1..=3u64).map(|s| cd.save(s * 10, &model(s as Real), &optimizer(s as Real), meta(s))).collect()
}
