//! `shoal plan JOB.toml`: the layouts (data × tensor × pipeline × ZeRO) a job's model could train in on a cluster,
//! with the planner's memory and step-time estimates (`shoal_train::plan`), fitting and fastest first.

use std::path::PathBuf;

use anyhow::{Result, anyhow};
use shoal_train::plan::{
    BatchCost, ClusterCost, Layout, ModelCost, TRAINING_EFFICIENCY, measure_host, parallel_keys, plan,
};

/// `shoal plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// The job spec whose model and batch are planned for.
    pub job: PathBuf,
    /// Devices (workers) to use; default: this machine's cores.
    #[arg(long)]
    pub devices: Option<usize>,
    /// Memory of each device, e.g. 80GiB; default: this machine's memory shared by the devices.
    #[arg(long, value_name = "BYTES")]
    pub memory_per_device: Option<String>,
    /// Sustained training FLOP/s of one device, e.g. 4e11; default: measured here (one core's matrix-product rate
    /// times the share a training step sustains of it).
    #[arg(long)]
    pub flops: Option<f64>,
    /// Bytes/s a device moves to a peer, e.g. 2.5e10; default: measured here (a memory copy).
    #[arg(long)]
    pub bandwidth: Option<f64>,
    /// A GPT at another size than the spec's: blocks, width, heads, vocabulary, context (e.g. a 7B model:
    /// --layers 32 --width 4096 --heads 32 --vocab 32000 --context 2048).
    #[arg(long)]
    pub layers: Option<usize>,
    #[arg(long)]
    pub width: Option<usize>,
    #[arg(long)]
    pub heads: Option<usize>,
    #[arg(long)]
    pub vocab: Option<usize>,
    #[arg(long)]
    pub context: Option<usize>,
    /// Plan for this global batch (samples per optimizer step) instead of the spec's `train.global_batch`.
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Show this many layouts (default 10).
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// One JSON object: the cluster, the model's parameters and the layouts.
    #[arg(long)]
    pub json: bool,
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// How a layout runs: its `train.strategy` and `[parallel]` keys, and whether it fits.
fn runs_as(l: &Layout) -> String {
    let how = match (l.strategy, &l.parallel) {
        (None, _) => return "not runnable in this build".to_owned(),
        (Some(s), None) => format!("strategy = \"{s}\""),
        (Some(s), Some(p)) => format!("strategy = \"{s}\", [parallel] {}", parallel_keys(p)),
    };
    if l.fits { how } else { format!("{how} (does not fit)") }
}

pub fn run(a: &PlanArgs) -> Result<bool> {
    let spec = shoal_train::spec::load_job(&a.job).map_err(|e| anyhow!("{e}"))?;
    let m = &spec.train.model;
    let resized = [a.layers, a.width, a.heads, a.vocab, a.context].iter().any(Option::is_some);
    let model = if resized || m.kind == shoal_train::spec::ModelKind::Gpt {
        if m.kind != shoal_train::spec::ModelKind::Gpt {
            return Err(anyhow!(
                "--layers/--width/--heads/--vocab/--context size a GPT; {} names a {:?}",
                a.job.display(),
                m.kind
            ));
        }
        let (heads, width) = (a.heads.unwrap_or(m.heads()), a.width.unwrap_or(m.width()));
        if heads == 0 || !width.is_multiple_of(heads) {
            return Err(anyhow!("--width {width} is not divisible by --heads {heads}"));
        }
        ModelCost::gpt(
            a.vocab.unwrap_or(m.vocab()),
            a.context.unwrap_or(m.context()),
            a.layers.unwrap_or(m.layers()),
            heads,
            width,
        )
    } else {
        ModelCost::of(&spec).map_err(|e| anyhow!("{}: {e}", a.job.display()))?
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let devices = a.devices.unwrap_or(cores);
    if devices == 0 {
        return Err(anyhow!("--devices: at least 1"));
    }
    let memory_per_device = match &a.memory_per_device {
        Some(s) => shoal_spec::parse_bytes(s).map_err(|e| anyhow!("--memory-per-device: {e}"))?,
        None => shoal_exec::procfs::total_memory() / devices as u64,
    };
    let (flops, bandwidth) = match (a.flops, a.bandwidth) {
        (Some(f), Some(b)) => (f, b),
        (f, b) => {
            // Products of the GPT's width; an MLP's are measured at 64.
            let width = if m.kind == shoal_train::spec::ModelKind::Gpt { a.width.unwrap_or(m.width()) } else { 64 };
            let (mf, mb) = measure_host(width);
            // What a training step sustains of the products' rate here; more devices than this machine has cores
            // (workers of one job here) share them.
            let share = (cores as f64 / devices as f64).min(1.0);
            (f.unwrap_or(mf * TRAINING_EFFICIENCY * share), b.unwrap_or(mb))
        }
    };
    if !(flops > 0.0 && bandwidth > 0.0) {
        return Err(anyhow!("--flops and --bandwidth must be positive"));
    }
    let cluster = ClusterCost::new(devices, memory_per_device, flops, bandwidth);
    let mut batch = BatchCost::of(&spec);
    if let Some(g) = a.global_batch {
        if g == 0 {
            return Err(anyhow!("--global-batch: at least 1"));
        }
        batch.global = g;
    }
    let layouts = plan(&model, batch, &cluster);
    let shown: Vec<&Layout> = layouts.iter().take(a.top).collect();
    if a.json {
        let v = serde_json::json!({
            "model": model.kind,
            "parameters": model.params(),
            "devices": devices,
            "memory_per_device_bytes": memory_per_device,
            "flops_per_s": flops,
            "bandwidth_bytes_per_s": bandwidth,
            "layouts": shown,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(true);
    }
    println!(
        "{} of {:.3}M parameters on {devices} devices of {} ({:.3} TFLOP/s, {:.2} GB/s each){}",
        model.kind,
        model.params() as f64 / 1e6,
        gib(memory_per_device),
        flops / 1e12,
        bandwidth / 1e9,
        match (a.flops.is_none() || a.bandwidth.is_none(), devices > cores) {
            (true, true) => format!(", measured here, {devices} devices sharing {cores} cores"),
            (true, false) => ", measured here".to_owned(),
            (false, _) => String::new(),
        }
    );
    println!("  #      d×t×p  zero    memory/dev        step     compute        comm  bubble  runs as");
    for (i, l) in shown.iter().enumerate() {
        println!(
            "{:>3}  {:>9}  {:>4}  {:>12}  {:>9.4}s  {:>9.4}s  {:>9.4}s  {:>5.1}%  {}",
            i + 1,
            format!("{}×{}×{}", l.data, l.tensor, l.pipeline),
            l.zero,
            gib(l.memory_per_device_bytes),
            l.step_time_s,
            l.compute_s,
            l.comm_s,
            100.0 * l.bubble,
            runs_as(l)
        );
    }
    if !layouts.iter().any(|l| l.fits) {
        println!("no layout fits {} per device", gib(memory_per_device));
    }
    Ok(true)
}
