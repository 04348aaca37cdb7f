//! `shoal bench checkpoint`: how fast a checkpoint of a large model is saved,
//! against the disk's own sequential write speed measured in the same run.
//!
//! Each round probes the disk twice (through the page cache with fsync, like
//! `dd conv=fsync`, and with `O_DIRECT`, like `dd oflag=direct`), then saves a
//! checkpoint of `--params` parameters with AdamW's two moments (12 bytes per
//! parameter) exactly as training does: safetensors files, sha256 of each,
//! the manifest last. The disk's speed is the faster probe, so the ratio is
//! the conservative one. Medians over the rounds; the target is ≥ 0.5.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use serde_json::json;
use shoal_train::Real;
use shoal_train::checkpoint::{CheckpointDir, ManifestMeta, TensorData, measure_disk_write, measure_disk_write_direct};

use crate::bench::BenchArgs;

/// The save speed must reach this share of the disk's.
const TARGET: f64 = 0.5;

/// A count like `100M` (K, M, G: powers of ten).
pub(crate) fn parse_count(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1e3),
        Some((i, 'M' | 'm')) => (&s[..i], 1e6),
        Some((i, 'G' | 'g')) => (&s[..i], 1e9),
        _ => (s, 1.0),
    };
    let v: f64 = num.trim().parse().with_context(|| format!("--params: {s:?} is not a count like 100M"))?;
    if !(v.is_finite() && v > 0.0) {
        bail!("--params: {s:?} must be positive");
    }
    Ok((v * mult).round() as usize)
}

fn median(v: Vec<f64>) -> f64 {
    shoal_spec::median(v).unwrap_or(f64::NAN)
}

/// A directory removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn run(args: &BenchArgs) -> Result<bool> {
    let n = parse_count(args.params.as_deref().unwrap_or("100M"))?;
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let scratch = Scratch(base.join(format!("shoal-bench-checkpoint-{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0).with_context(|| format!("creating {}", scratch.0.display()))?;
    let bytes = (n as u64) * 12;
    eprintln!(
        "checkpoint of {n} parameters with AdamW state ({:.2} GB) in {}, {} round(s)",
        bytes as f64 / 1e9,
        scratch.0.display(),
        args.rounds
    );
    let values = |k: Real| -> Vec<Real> { (0..n).map(|i| k * ((i % 1013) as Real - 506.0) / 506.0).collect() };
    let model = vec![TensorData::new("w", vec![n], values(0.02))];
    let optimizer = vec![TensorData::new("w.m", vec![n], values(0.001)), TensorData::new("w.v", vec![n], values(1e-6))];
    let dir = CheckpointDir::new(&scratch.0);
    let (mut buffered, mut direct, mut save, mut save_s) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let b = measure_disk_write(&scratch.0, bytes)?;
        let d = measure_disk_write_direct(&scratch.0, bytes)?;
        let meta = ManifestMeta {
            epoch: 0,
            sampler: json!({}),
            rng: json!({}),
            world_size: 1,
            strategy: "bench".into(),
            extra: json!({}),
        };
        let stats = dir.save_with_stats(round as u64 + 1, &model, &optimizer, meta)?;
        dir.prune(0)?;
        eprintln!(
            "  round {}: disk {b:.0} MB/s (page cache + fsync), {d:.0} MB/s (direct); save {:.0} MB/s in {:.2} s",
            round + 1,
            stats.mb_per_s,
            stats.seconds
        );
        buffered.push(b);
        direct.push(d);
        save.push(stats.mb_per_s);
        save_s.push(stats.seconds);
    }
    let (b, d, s) = (median(buffered), median(direct), median(save));
    let disk = b.max(d);
    let ratio = s / disk;
    let ok = ratio >= TARGET;
    if args.json {
        println!(
            "{}",
            json!({
                "kind": "checkpoint",
                "params": n,
                "bytes": bytes,
                "rounds": args.rounds,
                "disk_buffered_mb_per_s": b,
                "disk_direct_mb_per_s": d,
                "save_mb_per_s": s,
                "save_s": median(save_s),
                "ratio": ratio,
                "target": TARGET,
                "ok": ok,
            })
        );
    } else {
        println!("checkpoint save, {n} parameters + AdamW state, medians of {} round(s)", args.rounds);
        println!("  disk, page cache + fsync   {b:>8.0} MB/s");
        println!("  disk, O_DIRECT             {d:>8.0} MB/s");
        println!("  shoal checkpoint save      {s:>8.0} MB/s  ({:.2} s)", median(save_s));
        println!("  save / faster disk probe   {ratio:>8.2}   target ≥ {TARGET}  {}", if ok { "ok" } else { "BELOW" });
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_parse_with_suffixes() -> Result<()> {
        assert_eq!(parse_count("100M")?, 100_000_000);
        assert_eq!(parse_count("1.5k")?, 1500);
        assert_eq!(parse_count("2G")?, 2_000_000_000);
        assert_eq!(parse_count("12")?, 12);
        assert!(parse_count("-1M").is_err());
        assert!(parse_count("many").is_err());
        Ok(())
    }
}
