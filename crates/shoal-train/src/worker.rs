//! One rank of a job: builds the communicator from the environment contract,
//! the datasets, the model and the [`Trainer`] from the job spec, trains, and
//! (on rank 0) writes `metrics.jsonl` and `summary.json` into the output
//! directory. `shoal run JOB.toml` starts N of these.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use shoal_comm::{Communicator, ReduceOp};
use shoal_data::{Dataset, DistributedSampler, Loader, LoaderConfig, SamplerConfig, Split};

use crate::batch::{Flat, to_flat, to_tensors};
use crate::checkpoint::{AsyncSaver, CheckpointDir, ManifestMeta, TensorData};
use crate::error::{Error, Result};
use crate::models::{Cnn, Gpt, GptConfig, Mlp, Model};
use crate::optim::{OptimConfig, learning_rate};
use crate::params::{Params, SeededRng};
use crate::spec::{JobSpec, ModelKind, OptimizerKind, Overlap, Schedule, Strategy, median};
use crate::trainer::{Trainer, TrainerConfig, overlap_pays};

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub output: PathBuf,
    pub resume: bool,
}

/// Medians of the per-step time split.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct StepTime {
    pub data_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub optimizer_s: f64,
    /// The whole step, as the loop saw it.
    #[serde(default)]
    pub step_s: f64,
}

/// What `summary.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub name: String,
    pub model: String,
    pub dataset: String,
    pub parameters: usize,
    pub steps: usize,
    pub world_size: usize,
    /// How the work was spread over the workers: the strategy that ran (`train.strategy`).
    #[serde(default)]
    pub strategy: Strategy,
    /// The loss of the last step; none (null or absent in the file) when it was not a finite number, or when no
    /// step ran and the checkpoint resumed from recorded none.
    #[serde(default)]
    pub final_loss: Option<f64>,
    pub eval_loss: f64,
    pub eval_accuracy: Option<f64>,
    pub eval_perplexity: Option<f64>,
    /// Text: cross-entropy (nats per token) on the eval set of a unigram model
    /// fitted on the training tokens — the baseline a language model must beat.
    pub baseline_loss: Option<f64>,
    pub samples_per_s: f64,
    pub comm_bytes: u64,
    /// Whether gradient all-reduces overlapped backward (`train.overlap`, resolved).
    #[serde(default)]
    pub overlap: bool,
    pub step_time: StepTime,
    pub elapsed_s: f64,
    /// Step the run started from (0, or the checkpoint it resumed).
    pub resumed_from: u64,
    /// Checkpoints written, the last save's speed, and how long the step loop
    /// waited for saves in total.
    pub checkpoints: usize,
    pub checkpoint_mb_per_s: Option<f64>,
    pub checkpoint_stall_s: f64,
    /// Seconds the saves took in the background, in total (the stall is what the loop paid of it).
    #[serde(default)]
    pub checkpoint_save_s: f64,
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub samples: usize,
    pub data_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub optimizer_s: f64,
    pub step_s: f64,
    /// The rank that measured this line.
    #[serde(default)]
    pub rank: usize,
    /// Bytes this rank has sent in collectives so far (cumulative).
    #[serde(default)]
    pub comm_bytes: u64,
}

/// The metrics file of a rank: `metrics.jsonl` for rank 0 (the job's curve), `metrics.rank-R.jsonl` for the others.
pub fn metrics_file(output: &std::path::Path, rank: usize) -> std::path::PathBuf {
    if rank == 0 { output.join("metrics.jsonl") } else { output.join(format!("metrics.rank-{rank}.jsonl")) }
}

/// One line of `eval.jsonl` (rank 0): an evaluation pass.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalMetrics {
    pub step: usize,
    pub eval_loss: f64,
    pub eval_accuracy: Option<f64>,
    pub eval_perplexity: Option<f64>,
}

/// Keeps the lines of a JSON-lines file whose `step` is at most `max_step`.
fn truncate_jsonl(path: &std::path::Path, max_step: u64) -> Result<()> {
    let kept: String = std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .is_some_and(|st| st <= max_step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(path, kept).map_err(|e| Error::io(format!("rewriting {}", path.display()), e))
}

/// The model of a job and the parameters behind it.
pub fn build_model(spec: &JobSpec, rng: &mut SeededRng) -> Result<(Params, Box<dyn Model>)> {
    let t = &spec.train;
    let shape = t.data_shape().map_err(|e| Error::Spec(e.to_string()))?;
    let m = &t.model;
    let mut params = Params::default();
    let model: Box<dyn Model> = match m.kind {
        ModelKind::Mlp => Box::new(Mlp::new(&mut params, rng, shape.features, m.hidden(), shape.classes)?),
        ModelKind::Cnn => Box::new(Cnn::new(&mut params, rng, shape.features, m.channels(), shape.classes)?),
        ModelKind::Gpt => Box::new(Gpt::new(
            &mut params,
            rng,
            GptConfig {
                vocab: m.vocab(),
                context: m.context(),
                layers: m.layers(),
                heads: m.heads(),
                width: m.width(),
            },
        )?),
    };
    Ok((params, model))
}

/// Loss (mean over rows) and correct predictions of one batch.
fn loss_and_correct(model: &dyn Model, input: &Tensor, target: &Tensor) -> Result<(Tensor, usize)> {
    let logits = model.forward(input)?;
    let loss = candle_nn::loss::cross_entropy(&logits, target)?;
    let pred = logits.argmax(candle_core::D::Minus1)?;
    let correct = pred.eq(target)?.to_dtype(candle_core::DType::F32)?.sum_all()?.to_scalar::<f32>()? as usize;
    Ok((loss, correct))
}

/// Mean loss and accuracy over the eval set (sharded across ranks, summed with an all-reduce).
fn evaluate(
    model: &dyn Model,
    data: &dyn Dataset,
    comm: &Communicator,
    batch: usize,
    max_batches: usize,
) -> Result<(f64, f64)> {
    let n = data.len().min(batch * max_batches.max(1));
    let share = shoal_comm::chunk::segment(n, comm.size(), comm.rank());
    let (mut loss_sum, mut correct, mut rows, mut tokens) = (0f64, 0f64, 0f64, 0f64);
    let mut i = share.start;
    while i < share.end {
        let end = (i + batch).min(share.end);
        let samples = (i..end).map(|j| data.get(j)).collect::<shoal_data::Result<Vec<_>>>()?;
        if let Some(t) = to_tensors(&samples)? {
            let (loss, c) = loss_and_correct(model, &t.input, &t.target)?;
            let targets = t.target.elem_count() as f64;
            loss_sum += loss.to_scalar::<f32>()? as f64 * targets;
            correct += c as f64;
            tokens += targets;
            rows += t.rows as f64;
        }
        i = end;
    }
    let mut v = [loss_sum, correct, tokens, rows];
    comm.all_reduce(&mut v, ReduceOp::Sum)?;
    let [loss_sum, correct, tokens, _] = v;
    Ok((loss_sum / tokens.max(1.0), correct / tokens.max(1.0)))
}

/// Where checkpoints go: `checkpoint.url` (a path or `file://` URL), else the output directory.
/// Where checkpoints are written locally: the `checkpoint.url` directory, or the output directory (also the staging
/// directory of an object-store URL, whose checkpoints are mirrored there by [`crate::remote`]).
pub fn checkpoint_root(spec: &JobSpec, output: &Path) -> Result<PathBuf> {
    match spec.checkpoint.url.as_deref() {
        None => Ok(output.to_path_buf()),
        Some(u) if u.starts_with("file://") => Ok(PathBuf::from(&u["file://".len()..])),
        Some(u) if !u.contains("://") => Ok(PathBuf::from(u)),
        Some(_) => Ok(output.to_path_buf()),
    }
}

/// The checkpoint `checkpoint.resume_from` names: a checkpoint directory (with its manifest), or a checkpoint
/// root whose newest valid checkpoint is taken. Asked for explicitly, so finding none is an error naming it.
fn load_resume_from(path: &str) -> Result<crate::checkpoint::Loaded> {
    let path = PathBuf::from(path);
    let what = |e: &dyn std::fmt::Display| Error::Checkpoint(format!("checkpoint.resume_from {}: {e}", path.display()));
    if path.join(crate::checkpoint::MANIFEST_FILE).exists() {
        return CheckpointDir::new(&path).load(&path).map_err(|e| what(&e));
    }
    CheckpointDir::new(&path).latest_valid().map_err(|e| what(&e))?.ok_or_else(|| what(&"no valid checkpoint there"))
}

/// The object store a job's checkpoints are mirrored to, when `checkpoint.url` names one.
pub fn checkpoint_remote(spec: &JobSpec) -> Result<Option<Arc<crate::remote::RemoteStore>>> {
    match spec.checkpoint.url.as_deref() {
        Some(u) if crate::remote::is_remote(u) => crate::remote::RemoteStore::open(u)
            .map(|r| Some(Arc::new(r)))
            .map_err(|e| Error::Checkpoint(format!("checkpoint.url: {e}"))),
        _ => Ok(None),
    }
}

/// Copies tensors out for a checkpoint, into `spare` buffers of earlier checkpoints when there are any.
fn tensors_of(
    named: impl IntoIterator<Item = (String, Tensor)>,
    spare: &mut impl Iterator<Item = Vec<f32>>,
) -> Result<Vec<TensorData>> {
    named
        .into_iter()
        .map(|(n, t)| {
            let buf = spare.next().unwrap_or_default();
            let dims = t.dims().to_vec();
            match crate::kernels::with_slice(&t, |v| TensorData::copy_from(n.clone(), dims.clone(), v, buf)) {
                Ok(td) => Ok(td),
                Err(_) => Ok(TensorData::new(n, dims, t.flatten_all()?.to_vec1::<f32>()?)),
            }
        })
        .collect()
}

/// Cross-entropy on `eval` of the add-one-smoothed unigram distribution of `train`'s target tokens.
pub fn unigram_baseline(train: &dyn Dataset, eval: &dyn Dataset, vocab: usize) -> Result<f64> {
    let mut counts = vec![1f64; vocab.max(1)];
    for i in 0..train.len() {
        if let shoal_data::Label::Tokens(ys) = train.get(i)?.label {
            for y in ys {
                if let Some(c) = counts.get_mut(y as usize) {
                    *c += 1.0;
                }
            }
        }
    }
    let total: f64 = counts.iter().sum();
    let (mut nll, mut n) = (0f64, 0f64);
    for i in 0..eval.len() {
        if let shoal_data::Label::Tokens(ys) = eval.get(i)?.label {
            for y in ys {
                nll -= (counts.get(y as usize).copied().unwrap_or(1.0) / total).ln();
                n += 1.0;
            }
        }
    }
    Ok(nll / n.max(1.0))
}

/// A checkpoint being copied out of the model on a background thread.
type Snapshot = std::thread::JoinHandle<Result<(u64, Vec<TensorData>, Vec<TensorData>, ManifestMeta)>>;

/// Waits for a pending snapshot and hands it to the saver; returns the seconds waited.
fn submit_snapshot(snapshot: &mut Option<Snapshot>, saver: Option<&mut AsyncSaver>) -> Result<f64> {
    let Some(h) = snapshot.take() else { return Ok(0.0) };
    let t0 = Instant::now();
    let (step, model, optimizer, meta) =
        h.join().map_err(|_| Error::Checkpoint("the checkpoint copy thread panicked".into()))??;
    if let Some(saver) = saver {
        saver.submit(step, model, optimizer, meta).map_err(|e| Error::Checkpoint(e.to_string()))?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// Runs this process's rank of `spec`; rank 0 returns the summary.
pub fn run(spec: &JobSpec, opts: &WorkerOptions) -> Result<Option<Summary>> {
    let started = Instant::now();
    let env = shoal_comm::env::EnvContract::from_env()?;
    let comm = env.connect()?;
    let (world, rank) = (comm.size(), comm.rank());
    spec.validate_world(world).map_err(|e| Error::Spec(e.to_string()))?;
    let t = &spec.train;
    let mut data_opts = t.data_options();
    data_opts.split = Split::Train;
    let train: Arc<dyn Dataset> = Arc::from(shoal_data::builtin(&t.dataset, &data_opts)?);
    data_opts.split = Split::Eval;
    let eval: Arc<dyn Dataset> = Arc::from(shoal_data::builtin(&t.dataset, &data_opts)?);

    let mut rng = SeededRng::new(t.seed);
    let (params, model) = build_model(spec, &mut rng)?;
    let parameters = params.count();
    let ckpt_dir = CheckpointDir::new(checkpoint_root(spec, &opts.output)?);
    let remote = if rank == 0 { checkpoint_remote(spec)? } else { None };
    if opts.resume && spec.checkpoint.url.as_deref().is_some_and(crate::remote::is_remote) {
        // Rank 0 brings the newest valid remote checkpoint into the local staging directory; the others wait.
        if let Some(r) = &remote {
            let (step, skipped) = r.fetch_latest_valid(&ckpt_dir).map_err(|e| Error::Checkpoint(e.to_string()))?;
            for (url, why) in &skipped {
                eprintln!("warning: skipped checkpoint object {url}: {why}");
            }
            match step {
                Some(s) => eprintln!("fetched checkpoint step {s} from {}", r.url()),
                None => eprintln!("no valid checkpoint in {}; starting from scratch", r.url()),
            }
        }
        comm.barrier()?;
    }
    let own = if opts.resume { ckpt_dir.latest_valid().map_err(|e| Error::Checkpoint(e.to_string()))? } else { None };
    let resumed = if opts.resume || spec.checkpoint.resume_from.is_some() {
        let loaded = match (own, spec.checkpoint.resume_path()) {
            (Some(l), _) => Some(l),
            (None, Some(from)) => Some(load_resume_from(from)?),
            (None, None) => None,
        };
        if let Some(l) = &loaded {
            for (path, why) in &l.skipped {
                if rank == 0 {
                    eprintln!("warning: skipped checkpoint file {}: {why}", path.display());
                }
            }
            let by_name: std::collections::HashMap<&str, &TensorData> =
                l.model.iter().map(|t| (t.name.as_str(), t)).collect();
            for (name, var) in params.vars() {
                let td = by_name.get(name.as_str()).ok_or_else(|| {
                    Error::Checkpoint(format!("{}: no tensor {name} in model.safetensors", l.dir.display()))
                })?;
                if td.shape != var.dims() {
                    return Err(Error::Checkpoint(format!(
                        "{}: tensor {name} has shape {:?}, the model expects {:?}",
                        l.dir.display(),
                        td.shape,
                        var.dims()
                    )));
                }
                var.set(&Tensor::from_slice(&td.data, var.shape(), &candle_core::Device::Cpu)?)?;
            }
            if rank == 0 {
                eprintln!("resuming from {} (step {})", l.dir.display(), l.manifest.step);
            }
        } else if rank == 0 {
            eprintln!("no valid checkpoint under {}; starting from scratch", ckpt_dir.checkpoints_dir().display());
        }
        loaded
    } else {
        None
    };
    let optimizer = match t.optimizer {
        OptimizerKind::Sgd => OptimConfig::Sgd { momentum: t.momentum(), weight_decay: t.weight_decay() },
        OptimizerKind::Adamw => {
            let [beta1, beta2] = t.betas();
            OptimConfig::AdamW { beta1, beta2, eps: t.eps(), weight_decay: t.weight_decay() }
        }
    };
    let overlap = match t.overlap {
        Overlap::On => true,
        Overlap::Off => false,
        Overlap::Auto => overlap_pays(&comm),
    };
    if rank == 0 {
        tracing::info!(
            overlap,
            setting = ?t.overlap,
            threads = candle_core::utils::get_num_threads(),
            "gradient all-reduce {}",
            if overlap { "overlaps backward" } else { "runs after backward (no core free for a communicator thread)" }
        );
    }
    let cfg = TrainerConfig {
        optimizer,
        bucket_bytes: t.bucket_bytes(),
        clip_grad_norm: t.clip_grad_norm,
        overlap,
        ..TrainerConfig::default()
    };
    // The strategy `train.strategy` names (the spec refuses names that have none yet): what the manifest and the
    // summary record.
    let ran = t.strategy;
    let strategy: Box<dyn crate::strategy::Strategy> = match ran {
        Strategy::Ddp => Box::new(crate::strategy::ddp::Ddp::new(Some(comm.clone()), cfg.ddp())),
    };
    let mut trainer = Trainer::with_strategy(params, strategy, cfg)?;

    let micro = t.micro_batch();
    let mut sampler =
        DistributedSampler::new(SamplerConfig { seed: t.seed, ..SamplerConfig::new(train.len(), micro) }, world, rank)?;
    let mut start_step = 0usize;
    if let Some(l) = &resumed {
        let state: shoal_data::SamplerState = serde_json::from_value(l.manifest.sampler.clone())
            .map_err(|e| Error::Checkpoint(format!("{}: sampler state: {e}", l.dir.display())))?;
        sampler.restore(state)?;
        let named: std::collections::HashMap<String, Tensor> = l
            .optimizer
            .iter()
            .map(|td| {
                Ok((td.name.clone(), Tensor::from_slice(&td.data, td.shape.as_slice(), &candle_core::Device::Cpu)?))
            })
            .collect::<Result<_>>()?;
        let opt_t = l.manifest.extra.get("optimizer_t").and_then(|v| v.as_u64()).unwrap_or(l.manifest.step);
        let params = trainer.params().clone();
        trainer.optimizer_mut().load_state(&params, opt_t, &named)?;
        start_step = l.manifest.step as usize;
    }
    let summary_path = opts.output.join("summary.json");
    if start_step >= t.steps {
        // Nothing left to train. Keep the summary of the run that got here, when rank 0 has it.
        let kept = if rank == 0 { read_summary(&summary_path, &spec.name) } else { None };
        if any_rank(&comm, kept.is_some())? {
            if rank == 0 {
                eprintln!(
                    "the run is already complete: its newest checkpoint is step {start_step} of {}; {} kept",
                    t.steps,
                    summary_path.display()
                );
            }
            comm.barrier()?;
            return Ok(kept);
        }
        if rank == 0 {
            eprintln!(
                "the run is already complete (checkpoint step {start_step} of {}), but {} is missing: evaluating \
                 the checkpoint for a new one",
                t.steps,
                summary_path.display()
            );
        }
    }
    // Fault injection for testing diagnosis (feature `failpoints`): a slow data source.
    let delay = shoal_comm::env::fault_delay(shoal_comm::env::var::FAULT_DATA_DELAY)?;
    let mut loader =
        Loader::new(train.clone(), sampler.cycling_batches(), LoaderConfig { delay, ..LoaderConfig::default() })?;
    let mut saver = (rank == 0).then(|| {
        let s = AsyncSaver::new(ckpt_dir.clone(), spec.checkpoint.keep.max(1));
        match &remote {
            Some(r) => s.with_mirror(r.clone()),
            None => s,
        }
    });
    if let Some(s) = &saver {
        let p = trainer.params();
        let mut sizes: Vec<usize> = p.vars().iter().map(|(_, v)| v.elem_count()).collect();
        sizes.extend(trainer.optimizer().state_sizes(p));
        s.prefault(sizes);
    }
    let (mut checkpoints, mut stall_s, mut last_mb_s) = (0usize, 0f64, None);
    let mut sampler_state = sampler.state();
    let mut snapshot: Option<Snapshot> = None;

    std::fs::create_dir_all(&opts.output).map_err(|e| Error::io(format!("creating {}", opts.output.display()), e))?;
    // Every rank keeps its own step timings (for the per-rank breakdown and straggler detection); rank 0's file is
    // the job's curve. After a resume, the steps after the checkpoint are redone: drop what was logged for them.
    let mut metrics = {
        let path = metrics_file(&opts.output, rank);
        if start_step > 0 {
            truncate_jsonl(&path, start_step as u64)?;
        }
        let f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(start_step > 0)
            .truncate(start_step == 0)
            .open(&path);
        Some(f.map_err(|e| Error::io(format!("creating {}", path.display()), e))?)
    };
    let eval_path = opts.output.join("eval.jsonl");
    if rank == 0 {
        if start_step > 0 {
            // The final evaluation is redone when a complete run is evaluated again: drop the old one.
            truncate_jsonl(&eval_path, start_step.min(t.steps - 1) as u64)?;
        } else {
            let _ = std::fs::remove_file(&eval_path);
        }
    }
    let text_model = t.model.kind == ModelKind::Gpt;
    let log_eval = |step: usize, loss: f64, acc: f64| -> Result<()> {
        if rank != 0 {
            return Ok(());
        }
        let e = EvalMetrics {
            step,
            eval_loss: loss,
            eval_accuracy: (!text_model).then_some(acc),
            eval_perplexity: text_model.then(|| loss.exp()),
        };
        let line = serde_json::to_string(&e).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&eval_path)
            .map_err(|e| Error::io(format!("opening {}", eval_path.display()), e))?;
        writeln!(f, "{line}").map_err(|e| Error::io("writing eval.jsonl", e))
    };
    let (mut data_t, mut compute_t, mut comm_t, mut opt_t, mut step_t) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // The loss of the last step taken; before any, the one the checkpoint recorded.
    let mut last_loss = resumed
        .as_ref()
        .and_then(|l| l.manifest.extra.get("loss").and_then(serde_json::Value::as_f64))
        .unwrap_or(f64::NAN);
    let mut samples_seen = 0usize;
    // The model's hand-written backward pass, unless SHOAL_AUTOGRAD=1 asks for candle's autograd.
    let hand = model.hand_backward().filter(|_| std::env::var("SHOAL_AUTOGRAD").map_or(true, |v| v != "1"));
    let train_started = Instant::now();
    for step in start_step..t.steps {
        let step_started = Instant::now();
        let (mut data_s, mut compute_s) = (0f64, 0f64);
        let mut local_loss = 0f64;
        let mut global_samples = 0usize;
        for k in 0..t.grad_accum {
            let d0 = Instant::now();
            let batch =
                loader.next_batch()?.ok_or_else(|| Error::InvalidArgument("the loader ran out of batches".into()))?;
            data_s += d0.elapsed().as_secs_f64();
            let c0 = Instant::now();
            let weight = batch.samples.len() as f64 / (batch.global_size * t.grad_accum) as f64;
            global_samples += batch.global_size;
            sampler_state = batch.next;
            let last = k + 1 == t.grad_accum;
            match (to_flat(&batch.samples)?, hand) {
                (Some(flat), Some(hand)) => trainer.backward_with(last, |sink| {
                    local_loss += f64::from(hand.loss_and_grads(&flat, weight as f32, sink)?);
                    sink.attach_scalars(&[local_loss as f32]);
                    Ok(())
                })?,
                (flat, _) => {
                    let loss = match flat.map(Flat::into_tensors).transpose()? {
                        Some(x) => {
                            let logits = model.forward(&x.input)?;
                            let l = (candle_nn::loss::cross_entropy(&logits, &x.target)? * weight)?;
                            local_loss += l.to_scalar::<f32>()? as f64;
                            Some(l)
                        }
                        None => None,
                    };
                    if last {
                        trainer.attach_scalars(&[local_loss as f32]);
                    }
                    trainer.backward(loss.as_ref(), last)?;
                }
            }
            compute_s += c0.elapsed().as_secs_f64();
        }
        let lr = learning_rate(step, t.steps, t.lr, t.warmup_steps, t.min_lr, t.schedule == Schedule::Cosine);
        stall_s += submit_snapshot(&mut snapshot, saver.as_mut())?;
        let times = trainer.step(lr)?;
        // The global loss: every rank's weighted share, summed with the gradients.
        let comm_s = times.comm_s;
        last_loss = times.scalars.first().copied().map_or(f64::NAN, f64::from);
        samples_seen += global_samples;
        data_t.push(data_s);
        compute_t.push(compute_s);
        comm_t.push(comm_s);
        opt_t.push(times.optimizer_s);
        step_t.push(step_started.elapsed().as_secs_f64());
        if let Some(f) = metrics.as_mut() {
            let m = StepMetrics {
                step: step + 1,
                loss: last_loss,
                lr,
                samples: global_samples,
                data_s,
                compute_s,
                comm_s,
                optimizer_s: times.optimizer_s,
                step_s: step_started.elapsed().as_secs_f64(),
                rank,
                comm_bytes: trainer.comm().map_or(0, |c| c.bytes_sent()),
            };
            let line = serde_json::to_string(&m).map_err(|e| Error::InvalidArgument(e.to_string()))?;
            writeln!(f, "{line}").map_err(|e| Error::io("writing metrics.jsonl", e))?;
            if rank == 0 && t.log_every > 0 && ((step + 1) % t.log_every == 0 || step + 1 == t.steps) {
                eprintln!(
                    "step {:>6}/{} loss {:.4} lr {:.2e} {:.1} ms",
                    step + 1,
                    t.steps,
                    last_loss,
                    lr,
                    m.step_s * 1e3
                );
            }
        }
        let every = spec.checkpoint.every;
        if ((every > 0 && (step + 1) % every == 0) || step + 1 == t.steps) && saver.is_some() {
            // The step loop pays only for cheap handles here: the copy into
            // plain buffers runs on a thread while the next step computes,
            // and is joined before the next optimizer update changes the
            // parameters (optimizer state tensors are replaced, never mutated).
            let s0 = Instant::now();
            let params = trainer.params();
            let model_h: Vec<(String, Tensor)> =
                params.vars().iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
            let opt_h = trainer.optimizer().state(params);
            let meta = ManifestMeta {
                epoch: sampler_state.epoch,
                sampler: serde_json::to_value(sampler_state).map_err(|e| Error::Checkpoint(e.to_string()))?,
                rng: serde_json::json!({ "init_seed": t.seed, "sampler_seed": t.seed }),
                world_size: world,
                strategy: ran.as_str().into(),
                extra: serde_json::json!({ "optimizer_t": trainer.optimizer().t, "loss": last_loss }),
            };
            let at = (step + 1) as u64;
            let mut spare = saver.as_ref().map(|s| s.spare_buffers()).unwrap_or_default().into_iter();
            snapshot = Some(std::thread::spawn(move || {
                Ok((at, tensors_of(model_h, &mut spare)?, tensors_of(opt_h, &mut spare)?, meta))
            }));
            stall_s += s0.elapsed().as_secs_f64();
            checkpoints += 1;
        }
        if t.eval_every > 0 && (step + 1) % t.eval_every == 0 && step + 1 < t.steps {
            let (el, ea) = evaluate(model.as_ref(), eval.as_ref(), &comm, micro, t.eval_batches)?;
            if rank == 0 {
                eprintln!("eval at step {}: loss {el:.4} accuracy {ea:.4}", step + 1);
            }
            log_eval(step + 1, el, ea)?;
        }
    }
    stall_s += submit_snapshot(&mut snapshot, saver.as_mut())?;
    let train_s = train_started.elapsed().as_secs_f64();
    if let Some(saver) = saver.as_mut()
        && let Some(stats) =
            saver.flush(std::time::Duration::from_secs(600)).map_err(|e| Error::Checkpoint(e.to_string()))?
    {
        last_mb_s = Some(stats.mb_per_s);
    }
    let (eval_loss, eval_acc) = evaluate(model.as_ref(), eval.as_ref(), &comm, micro, t.eval_batches)?;
    log_eval(t.steps, eval_loss, eval_acc)?;
    let text = t.model.kind == ModelKind::Gpt;
    let baseline_loss =
        if text && rank == 0 { Some(unigram_baseline(train.as_ref(), eval.as_ref(), t.model.vocab())?) } else { None };
    let summary = Summary {
        name: spec.name.clone(),
        model: format!("{:?}", t.model.kind).to_lowercase(),
        dataset: t.dataset.clone(),
        parameters,
        steps: t.steps,
        world_size: world,
        strategy: ran,
        final_loss: last_loss.is_finite().then_some(last_loss),
        eval_loss,
        eval_accuracy: (!text).then_some(eval_acc),
        eval_perplexity: text.then(|| eval_loss.exp()),
        baseline_loss,
        samples_per_s: samples_seen as f64 / train_s.max(1e-9),
        comm_bytes: comm.bytes_sent(),
        overlap,
        // Zeros when no step ran (a complete run evaluated again).
        step_time: StepTime {
            data_s: median(data_t).unwrap_or(0.0),
            compute_s: median(compute_t).unwrap_or(0.0),
            comm_s: median(comm_t).unwrap_or(0.0),
            optimizer_s: median(opt_t).unwrap_or(0.0),
            step_s: median(step_t).unwrap_or(0.0),
        },
        elapsed_s: started.elapsed().as_secs_f64(),
        resumed_from: start_step as u64,
        checkpoints,
        checkpoint_mb_per_s: last_mb_s,
        checkpoint_stall_s: stall_s,
        checkpoint_save_s: saver.as_ref().map_or(0.0, AsyncSaver::total_save_seconds),
    };
    comm.barrier()?;
    if rank == 0 {
        write_json(&summary_path, &summary)?;
        return Ok(Some(summary));
    }
    Ok(None)
}

/// The `summary.json` at `path` when it is one of job `name`; `None` when it is missing, unreadable or another
/// job's.
fn read_summary(path: &Path, name: &str) -> Option<Summary> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str::<Summary>(&text).ok().filter(|s| s.name == name)
}

/// Whether `mine` holds on any rank (every rank gets the same answer).
fn any_rank(comm: &Communicator, mine: bool) -> Result<bool> {
    let mut v = [if mine { 1f64 } else { 0.0 }];
    comm.all_reduce(&mut v, ReduceOp::Sum)?;
    Ok(v[0] > 0.0)
}

/// Writes JSON atomically (temp file, fsync, rename).
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(format!("renaming {} to {}", tmp.display(), path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job_with_url(url: &str) -> JobSpec {
        let text = format!(
            "name = \"t\"\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\nglobal_batch = 8\nsteps = 1\nlr = 0.1\n\
             [checkpoint]\nurl = \"{url}\"\n"
        );
        crate::spec::parse_job(&text, "t.toml").unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn every_object_store_scheme_the_spec_accepts_opens() {
        for url in [
            "http://127.0.0.1:9/ckpt",
            "https://example.invalid/ckpt",
            "gs://bucket/ckpt",
            "abfss://container@account.dfs.core.windows.net/ckpt",
        ] {
            let spec = job_with_url(url);
            match checkpoint_remote(&spec) {
                Ok(Some(_)) => {}
                Ok(None) => panic!("{url}: not taken as remote"),
                Err(e) => panic!("{url}: {e}"),
            }
        }
    }
}
