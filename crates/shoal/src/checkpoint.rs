//! `shoal checkpoint inspect DIR [--json]` and `shoal checkpoint consolidate DIR --out FILE.safetensors
//! [--optimizer] [--json]`: a checkpoint's contents and layout, and its full tensors by parameter name in one
//! safetensors file, over `shoal_train::checkpoint::{inspect, consolidate}`. `DIR` is one checkpoint
//! (`.../checkpoints/step-000050`), a run's `checkpoints/` or the run's directory (its newest valid checkpoint).

use std::path::{Path, PathBuf};

use anyhow::Result;
use shoal_train::checkpoint::{self, ConsolidateOptions, Inspection, Part};

#[derive(Debug, clap::Subcommand)]
pub enum CheckpointCmd {
    /// What a checkpoint holds: step, world size and strategy it was saved under, sampler position, optimizer
    /// step, every tensor (name, shape, dtype, elements, bytes) with its layout, totals, and for a run every step
    /// with its status (an invalid one names its bad file). Verifies the checksums; loads no tensor.
    Inspect {
        /// A checkpoint (`step-NNNNNN`), a run's `checkpoints/`, or a run's directory (its newest valid checkpoint).
        dir: PathBuf,
        /// One JSON object (`step`, `world_size`, `strategy`, `tensors: [{name, part, shape, dtype, elements, bytes,
        /// layout, shards: [{file, offsets, shape}]}]`, `totals`, `steps`, ...).
        #[arg(long)]
        json: bool,
    },
    /// Write a checkpoint's full model tensors by parameter name into one safetensors file (atomically, with
    /// step, strategy and world size in its metadata), after verifying its checksums.
    Consolidate {
        /// A checkpoint (`step-NNNNNN`), a run's `checkpoints/`, or a run's directory (its newest valid checkpoint).
        dir: PathBuf,
        /// The safetensors file to write (replaced if it exists).
        #[arg(long)]
        out: PathBuf,
        /// Also the optimizer's state, under names prefixed `optimizer.`.
        #[arg(long)]
        optimizer: bool,
        /// Print what was written as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: &CheckpointCmd) -> Result<bool> {
    match cmd {
        CheckpointCmd::Inspect { dir, json } => inspect(dir, *json),
        CheckpointCmd::Consolidate { dir, out, optimizer, json } => consolidate(dir, out, *optimizer, *json),
    }
}

fn shape(s: &[usize]) -> String {
    format!("[{}]", s.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))
}

fn inspect(dir: &Path, json: bool) -> Result<bool> {
    let i = checkpoint::inspect(dir)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&i)?);
        return Ok(true);
    }
    print_inspection(&i);
    Ok(true)
}

fn print_inspection(i: &Inspection) {
    println!("checkpoint {}", i.dir.display());
    println!("  step {} (epoch {}), saved by {} rank(s) under {}", i.step, i.epoch, i.world_size, i.strategy);
    println!("  sampler {}", i.sampler);
    match i.optimizer_t {
        Some(t) => println!("  optimizer t {t}"),
        None => println!("  optimizer t not recorded"),
    }
    if let Some(l) = &i.model_layout {
        println!("  model layout {}", describe_layout(l));
    }
    for (name, f) in &i.files {
        println!("  file {name}: {} bytes, sha256 {}", f.bytes, f.sha256);
    }
    let width = i.tensors.iter().map(|t| t.name.len()).max().unwrap_or(4).max(4);
    for part in [Part::Model, Part::Optimizer] {
        let totals = match part {
            Part::Model => i.totals.model,
            Part::Optimizer => i.totals.optimizer,
        };
        println!();
        println!("{}: {} tensors, {} elements, {} bytes", part.as_str(), totals.tensors, totals.elements, totals.bytes);
        println!("  {:<width$}  {:<16} {:<5} {:>12} {:>12}  layout", "name", "shape", "dtype", "elements", "bytes");
        for t in i.tensors.iter().filter(|t| t.part == part) {
            let layout = t
                .shards
                .iter()
                .map(|s| format!("{} at {} shape {}", s.file, shape(&s.offsets), shape(&s.shape)))
                .collect::<Vec<_>>()
                .join(", ");
            println!(
                "  {:<width$}  {:<16} {:<5} {:>12} {:>12}  {} ({layout})",
                t.name,
                shape(&t.shape),
                t.dtype,
                t.elements,
                t.bytes,
                t.layout
            );
        }
    }
    println!();
    println!(
        "total: {} tensors, {} elements, {} bytes",
        i.totals.all.tensors, i.totals.all.elements, i.totals.all.bytes
    );
    println!();
    println!("steps:");
    for s in &i.steps {
        let mark = if s.dir == i.dir { "  <- described" } else { "" };
        match &s.error {
            None => println!("  step {:>8}  valid    {}{mark}", s.step, s.dir.display()),
            Some(e) => println!("  step {:>8}  invalid  {e}", s.step),
        }
    }
}

/// The model layout a trainer recorded, in words: `data 1 × tensor 1 × pipeline 2 (4 micro-batches, interleaved,
/// 2 virtual stages: rank r holds chunks r, r + 2, …)`.
fn describe_layout(l: &serde_json::Value) -> String {
    let n = |k: &str| l[k].as_u64().unwrap_or(1);
    let mut s = format!("data {} × tensor {} × pipeline {}", n("data"), n("tensor"), n("pipeline_stages"));
    if let Some(schedule) = l["schedule"].as_str() {
        let (stages, v) = (n("pipeline_stages"), n("virtual_stages"));
        s.push_str(&format!(" ({} micro-batches, {schedule}", n("micro_batches")));
        if v > 1 {
            s.push_str(&format!(", {v} virtual stages: rank r holds chunks r, r + {stages}, … of {}", stages * v));
        }
        s.push(')');
    }
    s
}

fn consolidate(dir: &Path, out: &Path, optimizer: bool, json: bool) -> Result<bool> {
    let c = checkpoint::consolidate(dir, out, ConsolidateOptions { optimizer })?;
    for s in &c.skipped {
        eprintln!("skipped invalid checkpoint step {}: {}", s.step, s.error.as_deref().unwrap_or("invalid"));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&c)?);
        return Ok(true);
    }
    let elements: u64 = c.tensors.iter().map(|t| t.bytes / 4).sum();
    println!(
        "wrote {} ({} tensors, {elements} elements, {} bytes, sha256 {})",
        c.out.display(),
        c.tensors.len(),
        c.bytes,
        c.sha256
    );
    println!("  from {} (step {}, {} rank(s) under {})", c.source.display(), c.step, c.world_size, c.strategy);
    let width = c.tensors.iter().map(|t| t.name.len()).max().unwrap_or(4).max(4);
    for t in &c.tensors {
        println!("  {:<width$}  {:<16} {:<5} {:>12}", t.name, shape(&t.shape), t.dtype, t.bytes);
    }
    Ok(true)
}
