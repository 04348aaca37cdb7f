//! The step loop: each step's micro-batches through the model and the trainer, its line in the rank's metrics
//! file, a checkpoint every `checkpoint.every` steps and at the end (copied out on a thread while the next step
//! computes, saved in the background by rank 0), an in-memory copy every `checkpoint.memory_every` steps (the same
//! way, by the first rank of each host, into `/dev/shm`; skipped when the previous one is still being written, so
//! it never waits for a save), and an evaluation every `train.eval_every` steps.

use crate::{REAL_BYTES, Real};
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shoal_data::{DistributedSampler, Loader, LoaderConfig, SamplerState, Shares};

use super::eval::{EvalLog, evaluate};
use super::heartbeat::Phase;
use super::setup::{Setup, Training};
use super::wire::{StepMetrics, metrics_file};
use crate::batch::{Flat, to_flat, to_tensors};
use crate::checkpoint::{AsyncSaver, CheckpointError, MEMORY_KEEP, ManifestMeta, TensorData, tensors_of};
use crate::error::{Error, Result};
use crate::optim::learning_rate;
use crate::spec::{JobSpec, ModelKind, Schedule, TrainSpec};

/// What the step loop reads from and writes to, kept until the worker returns.
pub(super) struct StepLoop {
    /// This rank's metrics file.
    metrics: Option<File>,
    /// The rows each step trained on, when asked for (`SHOAL_RECORD_SAMPLES=1`).
    samples: Option<File>,
    /// Rank 0's checkpoint saver.
    pub(super) saver: Option<AsyncSaver>,
    /// The in-memory copies' saver of the first rank of each host (`checkpoint.memory_every` > 0).
    pub(super) memory_saver: Option<AsyncSaver>,
    loader: Loader,
    pub(super) eval_log: EvalLog,
    /// The step the run starts from (0, or the checkpoint it resumed).
    pub(super) start_step: usize,
    /// Whether that checkpoint was an in-memory copy (for the summary).
    pub(super) resumed_from_memory: bool,
    /// Where the run stands at its last step boundary (what a regrouping group takes from its rank 0).
    pub(super) boundary: super::regroup::Boundary,
}

/// What the step loop measured, for the summary.
pub(super) struct Trained {
    /// The step a stop asked from outside ended the loop at (its checkpoint written), if one did.
    pub(super) stopped_at: Option<usize>,
    /// Whether the loop ended at a step boundary for the group to regroup in place (a member told of a new group).
    pub(super) regroup: bool,
    /// The loss of the last step taken; before any, the one the checkpoint recorded (NaN if none).
    pub(super) last_loss: f64,
    /// Samples of the steps taken, over all ranks.
    pub(super) samples_seen: usize,
    /// Each step's time split, in seconds: data, compute, communication, optimizer, and the whole step.
    pub(super) data_t: Vec<f64>,
    pub(super) compute_t: Vec<f64>,
    pub(super) comm_t: Vec<f64>,
    pub(super) opt_t: Vec<f64>,
    pub(super) step_t: Vec<f64>,
    /// Seconds of the step loop, the hand-over of the last checkpoint included.
    pub(super) train_s: f64,
    /// Checkpoints taken.
    pub(super) checkpoints: usize,
    /// Seconds the step loop spent on checkpoints (copies and waits for the saver).
    pub(super) stall_s: f64,
    /// The last save's speed, MB/s.
    pub(super) last_mb_s: Option<f64>,
    /// The most a step allocated beyond what it started with (activations and temporaries), when measured.
    pub(super) activations_peak: Option<usize>,
    /// In-memory copies handed to this rank's memory saver.
    pub(super) memory_copies: usize,
    /// Seconds the step loop spent on in-memory copies (the state's handles, the optimizer state gathered for them
    /// alone, the wait for the copy thread).
    pub(super) memory_stall_s: f64,
    /// Under a pipeline: each step's bubble (averaged over the stages), and the theory's.
    pub(super) bubble_t: Vec<f64>,
    pub(super) bubble_theory: Option<f64>,
    /// Bytes this rank sent in each step's collectives.
    pub(super) bytes_t: Vec<u64>,
}

impl Trained {
    /// Adds what a later stretch of the same run measured (after the group regrouped in place).
    pub(super) fn absorb(&mut self, later: Trained) {
        self.stopped_at = later.stopped_at;
        self.regroup = later.regroup;
        self.last_loss = later.last_loss;
        self.samples_seen += later.samples_seen;
        self.data_t.extend(later.data_t);
        self.compute_t.extend(later.compute_t);
        self.comm_t.extend(later.comm_t);
        self.opt_t.extend(later.opt_t);
        self.step_t.extend(later.step_t);
        self.train_s += later.train_s;
        self.checkpoints += later.checkpoints;
        self.stall_s += later.stall_s;
        self.last_mb_s = later.last_mb_s.or(self.last_mb_s);
        self.activations_peak = match (self.activations_peak, later.activations_peak) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.memory_copies += later.memory_copies;
        self.memory_stall_s += later.memory_stall_s;
        self.bytes_t.extend(later.bytes_t);
    }
}

impl StepLoop {
    /// Starts the loader and (rank 0) the saver, and opens the metrics files in `output`: after a resume, what was
    /// logged for the steps after the checkpoint is dropped.
    pub(super) fn open(
        spec: &JobSpec,
        setup: &Setup,
        tr: &Training,
        start_step: usize,
        last_loss: f64,
        output: &Path,
    ) -> Result<StepLoop> {
        let t = &spec.train;
        let (rank, trainer, sampler) = (setup.rank, &tr.trainer, &tr.sampler);
        // Fault injection for testing diagnosis (feature `failpoints`): a slow data source.
        let delay = shoal_comm::env::fault_delay(shoal_comm::env::var::FAULT_DATA_DELAY)?;
        let cfg = LoaderConfig { delay, ..LoaderConfig::default() };
        let loader = match &tr.shards {
            Some(shards) => Loader::fallible(setup.train.clone(), shards.plan(), cfg)?,
            None => Loader::new(setup.train.clone(), sampler.cycling_batches(), cfg)?,
        };
        let saver = (rank == 0).then(|| {
            let s = AsyncSaver::new(setup.ckpt_dir.clone(), spec.checkpoint.keep.max(1));
            match &setup.remote {
                Some(r) => s.with_mirror(r.clone()),
                None => s,
            }
        });
        let memory_saver = match (&setup.memory, setup.host_leader) {
            // At the lowest priority: a copy is written in the time training leaves on its core.
            (Some(m), true) => Some(AsyncSaver::new(m.dir().clone(), MEMORY_KEEP).with_nice(19)),
            _ => None,
        };
        let sizes = || {
            let p = trainer.params();
            let mut sizes: Vec<usize> = p.vars().iter().map(|(_, v)| v.elem_count()).collect();
            sizes.extend(trainer.optimizer().state_sizes(p));
            sizes
        };
        for s in saver.iter().chain(&memory_saver) {
            s.prefault(sizes());
        }

        std::fs::create_dir_all(output).map_err(|e| Error::io(format!("creating {}", output.display()), e))?;
        // Every rank keeps its own step timings (for the per-rank breakdown and straggler detection); rank 0's file is
        // the job's curve. After a resume, the steps after the checkpoint are redone: drop what was logged for them.
        let metrics = {
            let path = metrics_file(output, rank);
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
        let samples = match std::env::var(shoal_comm::env::var::RECORD_SAMPLES).is_ok_and(|v| v == "1") {
            true => {
                let path = output.join(format!("samples-rank-{rank}.jsonl"));
                truncate_jsonl(&path, start_step as u64)?;
                let f = std::fs::OpenOptions::new().create(true).append(true).open(&path);
                Some(f.map_err(|e| Error::io(format!("creating {}", path.display()), e))?)
            }
            false => None,
        };
        let eval_log = EvalLog::new(output, rank, t.model.kind == ModelKind::Gpt);
        if rank == 0 {
            if start_step > 0 {
                // The final evaluation is redone when a complete run is evaluated again: drop the old one.
                truncate_jsonl(eval_log.path(), start_step.min(t.steps - 1) as u64)?;
            } else {
                let _ = std::fs::remove_file(eval_log.path());
            }
        }
        let boundary = super::regroup::Boundary { step: start_step, sampler: sampler.state(), loss: last_loss };
        Ok(StepLoop {
            metrics,
            samples,
            saver,
            memory_saver,
            loader,
            eval_log,
            start_step,
            resumed_from_memory: false,
            boundary,
        })
    }

    /// Trains from the start step to `train.steps`, then waits for the last checkpoint's save.
    pub(super) fn run(
        &mut self,
        spec: &JobSpec,
        setup: &Setup,
        tr: &mut Training,
        beat: Option<&super::heartbeat::Beat>,
    ) -> Result<Trained> {
        let t = &spec.train;
        let (world, rank, comm, model, eval) = (setup.world, setup.rank, &setup.comm, &setup.model, &setup.eval);
        let (trainer, sampler, micro, ran) = (&mut tr.trainer, &tr.sampler, tr.micro, tr.ran);
        let (loader, saver, metrics, eval_log) = (&mut self.loader, &mut self.saver, &mut self.metrics, &self.eval_log);
        let (samples, shards) = (&mut self.samples, &tr.shards);
        let memory_saver = &mut self.memory_saver;
        let start_step = self.start_step;
        let (mut checkpoints, mut stall_s, mut last_mb_s) = (0usize, 0f64, None);
        let (mut memory_copies, mut memory_stall_s) = (0usize, 0f64);
        // The same on every rank (the optimizer state may be a collective to gather).
        let memory_every = if setup.memory.is_some() { spec.checkpoint.memory_every } else { 0 };
        let mut sampler_state = sampler.state();
        let mut snapshot: Option<Snapshot> = None;
        let mut memory_snapshot: Option<MemorySnapshot> = None;
        let (mut data_t, mut compute_t, mut comm_t, mut opt_t, mut step_t) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // The loss of the last step taken; before any, the one the run started from recorded.
        let mut last_loss = self.boundary.loss;
        // Told of a new group: every member leaves at the same step boundary (agreed in the step's scalars).
        let regroups = super::regroup::in_place(spec, setup);
        let mut regroup = false;
        let mut samples_seen = 0usize;
        // The model's hand-written backward pass, unless SHOAL_AUTOGRAD=1 asks for candle's autograd or the passes
        // compute in 16 bits (the hand-written one computes in `Real`).
        let hand = model
            .hand_backward()
            .filter(|_| !t.precision.is_mixed() && !setup.placement.is_cuda())
            .filter(|_| std::env::var("SHOAL_AUTOGRAD").map_or(true, |v| v != "1"));
        let train_started = Instant::now();
        let mut activations_peak: Option<usize> = None;
        // SIGTERM from here on is a stop at the next step boundary, agreed by every rank through the step's scalars.
        let graceful = super::stop::Graceful::arm();
        let mut stopped_at = None;
        // `[[phases]]`: the run ends at its phase's last step, with a checkpoint there, and the platform starts the
        // next phase at its own size (the same step on every rank).
        let phase_end = spec.phase_end(start_step);
        // A pipeline's micro-batches a step (each stage holds the whole global batch).
        let pipeline_micro = spec.pipeline_micro_batches();
        let layout = model_layout(spec);
        let (mut bubble_t, mut bubble_theory) = (Vec::new(), None);
        let mut bytes_t: Vec<u64> = Vec::new();
        let mut cut = trainer.stage_layers();
        let mut balance = Balancer::new(t, tr.shares.clone(), sampler, loader.prefetch());
        let slow = shoal_comm::env::fault_slow_rank()?.and_then(|(r, f)| (r == rank).then_some(f));
        for step in start_step..t.steps {
            let step_started = Instant::now();
            let bytes_before = trainer.bytes_sent();
            let vote = graceful.vote();
            let moving = Real::from(u8::from(regroups && beat.is_some_and(|b| b.regroup_pending())));
            let held = crate::memory::PeakOver::start();
            let (mut data_s, mut compute_s) = (0f64, 0f64);
            let mut local_loss = 0f64;
            let mut global_samples = 0usize;
            let mut mine = 0usize;
            let (mut rows, mut row_epochs) = (Vec::new(), Vec::new());
            // Under `train.balance = "dynamic"`: this rank's measured rate, summed into every rank's scalars.
            let rates = balance.as_ref().map_or_else(Vec::new, |b| b.rates(step));
            let scalars = |loss: f64| [[loss as Real, vote, moving].as_slice(), &rates].concat();
            for k in 0..t.grad_accum {
                let d0 = Instant::now();
                let batch = loader
                    .next_batch()?
                    .ok_or_else(|| Error::InvalidArgument("the loader ran out of batches".into()))?;
                data_s += d0.elapsed().as_secs_f64();
                let c0 = Instant::now();
                let weight = batch.samples.len() as f64 / (batch.global_size * t.grad_accum) as f64;
                global_samples += batch.global_size;
                mine += batch.samples.len();
                sampler_state = batch.next;
                if samples.is_some() {
                    rows.extend_from_slice(&batch.indices);
                    match batch.row_epochs.is_empty() {
                        true => row_epochs.extend(std::iter::repeat_n(batch.epoch, batch.indices.len())),
                        false => row_epochs.extend_from_slice(&batch.row_epochs),
                    }
                }
                let last = k + 1 == t.grad_accum;
                if trainer.splits_model() {
                    // A pipeline stage: the batch's micro-batches in the schedule's order, the loss on the last stage.
                    let n = batch.samples.len();
                    let parts = crate::strategy::pipeline::micro_batch_ranges(n, pipeline_micro)
                        .into_iter()
                        .map(|r| {
                            let w = weight * r.len() as f64 / n as f64;
                            let x = to_tensors(&batch.samples[r])?
                                .ok_or_else(|| Error::InvalidArgument("an empty micro-batch".into()))?;
                            Ok((x, w))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    trainer.run_micro_batches(
                        parts.len(),
                        |i| Ok(model.forward(&parts[i].0.input)?),
                        |i, logits| {
                            let l = (model.loss(logits, &parts[i].0.target)? * parts[i].1)?;
                            local_loss += l.to_scalar::<Real>()? as f64;
                            Ok(l)
                        },
                    )?;
                    if last {
                        trainer.attach_scalars(&scalars(local_loss));
                    }
                    compute_s += c0.elapsed().as_secs_f64();
                    continue;
                }
                match (to_flat(&batch.samples)?, hand) {
                    (Some(flat), Some(hand)) => trainer.backward_with(last, |sink| {
                        local_loss += f64::from(hand.loss_and_grads(&flat, weight as Real, sink)?);
                        sink.attach_scalars(&scalars(local_loss));
                        Ok(())
                    })?,
                    (flat, _) => {
                        let loss = match flat.map(Flat::into_tensors).transpose()? {
                            Some(x) => {
                                let logits = model.forward(&x.input)?;
                                let l = (model.loss(&logits, &x.target)? * weight)?;
                                local_loss += l.to_scalar::<Real>()? as f64;
                                Some(l)
                            }
                            None => None,
                        };
                        if last {
                            trainer.attach_scalars(&scalars(local_loss));
                        }
                        trainer.backward(loss.as_ref(), last)?;
                    }
                }
                compute_s += c0.elapsed().as_secs_f64();
            }
            if let Some(f) = slow {
                // Fault injection (feature `failpoints`): this rank computes `f` times as long.
                std::thread::sleep(Duration::from_secs_f64(compute_s * (f - 1.0)));
                compute_s *= f;
            }
            let lr = learning_rate(step, t.steps, t.lr, t.warmup_steps, t.min_lr, t.schedule == Schedule::Cosine);
            // A checkpoint's hand-over may wait for the saver: not a hang (the control loop judges only training).
            let handing = snapshot.is_some();
            if let (true, Some(b)) = (handing, beat) {
                b.phase(Phase::Checkpoint);
            }
            stall_s += submit_snapshot(&mut snapshot, saver.as_mut())?;
            if let (true, Some(b)) = (handing, beat) {
                b.phase(Phase::Train);
            }
            // Forward and backward's peak beyond the step's start: activations and temporaries. The run's first
            // step is left out when others follow (it also allocates buffers kept from then on).
            let step_peak = held.end();
            if let Some(p) = step_peak
                && (step > start_step || activations_peak.is_none())
            {
                let p = if step == start_step + 1 { p } else { activations_peak.map_or(p, |a| a.max(p)) };
                activations_peak = Some(p);
            }
            memory_stall_s += submit_memory_copy(&mut memory_snapshot, memory_saver.as_mut());
            let times = trainer.step(lr)?;
            // The global loss: every rank's weighted share, summed with the gradients.
            let comm_s = times.comm_s;
            last_loss = times.scalars.first().copied().map_or(f64::NAN, f64::from);
            // Some rank was asked to stop: every rank sees the same sum, checkpoints this step and ends.
            let asked = times.scalars.get(1).is_some_and(|v| *v > 0.0);
            let stopping = asked || phase_end == Some(step + 1);
            regroup = times.scalars.get(2).is_some_and(|v| *v > 0.0) && step + 1 < t.steps;
            self.boundary = super::regroup::Boundary { step: step + 1, sampler: sampler_state, loss: last_loss };
            if let Some(b) = balance.as_mut() {
                b.after_step(step, mine, compute_s, &times.scalars, sampler_state);
            }
            samples_seen += global_samples;
            data_t.push(data_s);
            compute_t.push(compute_s);
            comm_t.push(comm_s);
            opt_t.push(times.optimizer_s);
            step_t.push(step_started.elapsed().as_secs_f64());
            bytes_t.push(trainer.bytes_sent().saturating_sub(bytes_before));
            if let Some(b) = times.bubble {
                bubble_t.push(b.mean);
                bubble_theory = Some(b.theory);
            }
            if cut.is_some() {
                let now = trainer.stage_layers();
                if let (Some(was), Some(new), 0) = (&cut, &now, rank)
                    && was != new
                {
                    let show = |c: &[std::ops::Range<usize>]| {
                        c.iter().map(|r| format!("{}..{}", r.start, r.end)).collect::<Vec<_>>().join(" | ")
                    };
                    eprintln!(
                        "pipeline stages cut again by measured time after step {}: layers {} (were {})",
                        step + 1,
                        show(new),
                        show(was)
                    );
                }
                cut = now;
            }
            if let Some(b) = beat {
                b.step(step as u64 + 1);
            }
            if let Some(f) = metrics.as_mut() {
                let arrivals = trainer.comm().map(|c| c.arrival_stats()).unwrap_or_default();
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
                    comm_bytes: trainer.bytes_sent(),
                    step_comm_bytes: bytes_t.last().copied().unwrap_or(0),
                    unix_ms: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64),
                    comm_waited_for: arrivals.waited_for.iter().map(|d| d.as_secs_f64()).collect(),
                    comm_wait_s: arrivals.waited().as_secs_f64(),
                    comm_lag_s: arrivals.lag.as_secs_f64(),
                    params_bytes: trainer.param_bytes() as u64,
                    grads_bytes: trainer.gradient_bytes() as u64,
                    optimizer_bytes: trainer.optimizer_bytes() as u64,
                    activations_bytes: step_peak.map(|p| p as u64),
                    share: balance.as_ref().map(|_| mine as f64 / global_samples.max(1) as f64),
                    bubble_fraction: times.bubble.map(|b| b.rank),
                    bubble_theory: times.bubble.map(|b| b.theory),
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
            if let Some(f) = samples.as_mut() {
                let line = serde_json::json!({ "step": step + 1, "rows": rows, "epochs": row_epochs });
                writeln!(f, "{line}").map_err(|e| Error::io("writing samples-rank-R.jsonl", e))?;
            }
            let every = spec.checkpoint.every;
            let checkpoint_now = (every > 0 && (step + 1) % every == 0) || step + 1 == t.steps || stopping;
            // No copy at the last step: the run ends there, and its in-memory copies with it.
            let memory_now = memory_every > 0 && (step + 1) % memory_every == 0 && step + 1 < t.steps;
            // Gathered on every rank (a collective when the strategy shards the parameters or the state), kept by
            // rank 0's saver and by the memory saver of each host's first rank.
            let g0 = Instant::now();
            let state = match checkpoint_now || memory_now {
                true => {
                    let mut optimizer = trainer.optimizer_state()?;
                    optimizer.extend(trainer.compression_state()?);
                    Some((trainer.model_state()?, optimizer))
                }
                false => None,
            };
            if memory_now && !checkpoint_now {
                memory_stall_s += g0.elapsed().as_secs_f64();
            }
            let writing = checkpoint_now && saver.is_some();
            let copying = memory_now && memory_saver.as_mut().is_some_and(|m| saver_idle(m, (step + 1) as u64));
            if let (true, Some((model_h, opt_h))) = (writing || copying, state) {
                // The step loop pays only for cheap handles here (or, when the strategy shards them, for gathering
                // whole tensors): the copy into plain buffers runs on a thread while the next step computes, and is
                // joined before the next optimizer update changes the parameters and the optimizer state (both
                // in place).
                let s0 = Instant::now();
                let mut extra = match &layout {
                    Some(l) => {
                        serde_json::json!({ "optimizer_t": trainer.optimizer().t, "loss": last_loss, "layout": l })
                    }
                    None => serde_json::json!({ "optimizer_t": trainer.optimizer().t, "loss": last_loss }),
                };
                if let Some(s) = shards {
                    // What every rank trained on by this boundary, and so what a resume hands out first.
                    let ledger = s.ledger_at(sampler.batch_number_at(sampler_state))?;
                    extra["shards"] = serde_json::to_value(ledger).map_err(|e| Error::Checkpoint(e.to_string()))?;
                }
                let meta = ManifestMeta {
                    epoch: sampler_state.epoch,
                    sampler: serde_json::to_value(sampler_state).map_err(|e| Error::Checkpoint(e.to_string()))?,
                    rng: serde_json::json!({ "init_seed": t.seed, "sampler_seed": t.seed }),
                    world_size: world,
                    strategy: ran.as_str().into(),
                    extra,
                };
                let at = (step + 1) as u64;
                // Tensors held on a device are copied out here, on the thread that computes on it (one transfer
                // each on its stream); host tensors on a thread while the next step computes.
                let on_device = model_h.iter().any(|(_, t)| !t.device().is_cpu());
                if copying {
                    let mut spare = memory_saver.as_ref().map(|s| s.spare_buffers()).unwrap_or_default().into_iter();
                    let (model_h, opt_h, meta) = (model_h.clone(), opt_h.clone(), meta.clone());
                    // A small state is copied here at once (less than a thread's start); a large one on a
                    // thread while the next step computes.
                    let bytes: usize = model_h.iter().chain(&opt_h).map(|(_, t)| t.elem_count() * REAL_BYTES).sum();
                    memory_snapshot = Some(if bytes <= INLINE_COPY_BYTES || on_device {
                        MemorySnapshot::Copied(
                            tensors_of(model_h, &mut spare)
                                .and_then(|m| Ok((at, m, tensors_of(opt_h, &mut spare)?, meta))),
                        )
                    } else {
                        MemorySnapshot::Copying(std::thread::spawn(move || {
                            Ok((at, tensors_of(model_h, &mut spare)?, tensors_of(opt_h, &mut spare)?, meta))
                        }))
                    });
                    memory_copies += 1;
                }
                if writing {
                    let mut spare = saver.as_ref().map(|s| s.spare_buffers()).unwrap_or_default().into_iter();
                    snapshot = Some(match on_device {
                        true => {
                            let copied = tensors_of(model_h, &mut spare)
                                .and_then(|m| Ok((at, m, tensors_of(opt_h, &mut spare)?, meta)));
                            std::thread::spawn(move || copied)
                        }
                        false => std::thread::spawn(move || {
                            Ok((at, tensors_of(model_h, &mut spare)?, tensors_of(opt_h, &mut spare)?, meta))
                        }),
                    });
                    checkpoints += 1;
                    stall_s += s0.elapsed().as_secs_f64();
                } else {
                    memory_stall_s += s0.elapsed().as_secs_f64();
                }
            }
            if stopping {
                if rank == 0 {
                    let why = if asked { "stop asked for" } else { "phase ends" };
                    eprintln!("{why}: checkpoint at step {} and end", step + 1);
                }
                stopped_at = Some(step + 1);
                break;
            }
            if regroup {
                if rank == 0 {
                    eprintln!("the group changes: regrouping in place after step {}", step + 1);
                }
                break;
            }
            if t.eval_every > 0 && (step + 1) % t.eval_every == 0 && step + 1 < t.steps {
                if let Some(b) = beat {
                    b.phase(Phase::Eval);
                }
                let evaluated = evaluate(model.as_ref(), trainer, eval.as_ref(), comm, micro, t.eval_batches);
                if let Some(b) = beat {
                    b.phase(Phase::Train);
                }
                let (el, ea) = evaluated?;
                if rank == 0 {
                    eprintln!("eval at step {}: loss {el:.4} accuracy {ea:.4}", step + 1);
                }
                eval_log.log(step + 1, el, ea)?;
            }
        }
        stall_s += submit_snapshot(&mut snapshot, saver.as_mut())?;
        memory_stall_s += submit_memory_copy(&mut memory_snapshot, memory_saver.as_mut());
        if let Some(m) = memory_saver.as_mut()
            && let Err(e) = m.flush(Duration::from_secs(60))
        {
            tracing::warn!("the last in-memory copy was not written: {e}");
        }
        let train_s = train_started.elapsed().as_secs_f64();
        if let Some(saver) = saver.as_mut()
            && let Some(stats) =
                saver.flush(std::time::Duration::from_secs(600)).map_err(|e| Error::Checkpoint(e.to_string()))?
        {
            last_mb_s = Some(stats.mb_per_s);
        }
        drop(graceful);
        Ok(Trained {
            stopped_at,
            regroup,
            last_loss,
            samples_seen,
            data_t,
            compute_t,
            comm_t,
            opt_t,
            step_t,
            train_s,
            checkpoints,
            stall_s,
            last_mb_s,
            activations_peak,
            memory_copies,
            memory_stall_s,
            bubble_t,
            bubble_theory,
            bytes_t,
        })
    }
}

/// A checkpoint being copied out of the model on a background thread.
type Snapshot = std::thread::JoinHandle<Result<Copied>>;

/// A checkpoint copied out of the model: its step, model and optimizer tensors, and manifest metadata.
type Copied = (u64, Vec<TensorData>, Vec<TensorData>, ManifestMeta);

/// States up to this size are copied for memory on the training thread (about 0.1 ms at memory speed, less than
/// starting a thread and waiting for it on a busy core).
const INLINE_COPY_BYTES: usize = 1 << 20;

/// An in-memory copy being taken: on a thread, or already copied.
enum MemorySnapshot {
    Copying(Snapshot),
    Copied(Result<Copied>),
}

/// `train.balance = "dynamic"`: every `train.balance_every` steps each rank's compute rate over the steps since the
/// last setting (samples per second of its forward and backward) rides in the step's summed scalars, one slot a
/// rank, as a whole number (so the sum is exact whatever order the ranks add in); every rank then sets the same
/// shares, in proportion to the rates, from a global batch far enough ahead that no loader has planned it yet.
///
/// A rank's rate is the median of its steps' rates, not their total over the total time: one step stretched by
/// something other than the rank's speed (its core taken by another process for a time slice, a page fault, a
/// collector) does not swing the shares.
struct Balancer {
    shares: Arc<Shares>,
    every: usize,
    replicas: usize,
    replica: usize,
    /// Global batches the loader may have planned ahead of the loop, and a margin: a setting made after a step
    /// applies from this many batches on, which no loader has planned yet.
    lag: u64,
    sampler: DistributedSampler,
    /// Samples per second of each step since the last setting.
    step_rates: Vec<f64>,
}

impl Balancer {
    fn new(
        t: &TrainSpec,
        shares: Option<Arc<Shares>>,
        sampler: &DistributedSampler,
        prefetch: usize,
    ) -> Option<Balancer> {
        let shares = shares?;
        Some(Balancer {
            shares,
            every: t.balance_every.unwrap_or(DEFAULT_BALANCE_EVERY).max(1),
            replicas: sampler.world_size(),
            replica: sampler.rank(),
            lag: prefetch as u64 + 2,
            sampler: sampler.clone(),
            step_rates: Vec::new(),
        })
    }

    fn deciding(&self, step: usize) -> bool {
        (step + 1).is_multiple_of(self.every)
    }

    /// The scalars this rank adds to `step`'s: its rate at a setting step, zeros otherwise.
    fn rates(&self, step: usize) -> Vec<Real> {
        let mut v = vec![0 as Real; self.replicas];
        if self.deciding(step)
            && let Some(rate) = shoal_spec::median(self.step_rates.iter().copied())
        {
            // Whole samples per second, at least 1, within what the scalar type holds exactly.
            v[self.replica] = rate.round().clamp(1.0, 16_000_000.0) as Real;
        }
        v
    }

    /// Counts a step of `samples` computed in `compute_s` (a step without either tells nothing of the rate).
    fn count(&mut self, samples: usize, compute_s: f64) {
        if samples > 0 && compute_s > 0.0 {
            self.step_rates.push(samples as f64 / compute_s);
        }
    }

    /// After `step`: counts this rank's work, and at a setting step sets the shares from the summed rates.
    fn after_step(&mut self, step: usize, samples: usize, compute_s: f64, scalars: &[Real], next: SamplerState) {
        if !self.deciding(step) {
            self.count(samples, compute_s);
            return;
        }
        let rates = scalars.get(3..3 + self.replicas).unwrap_or(&[]);
        // Set only when every rank measured (each rank sees the same sums, so each decides alike).
        if rates.len() == self.replicas && rates.iter().all(|r| *r >= 1.0) {
            let weights: Vec<u32> = rates.iter().map(|r| *r as u32).collect();
            let from = self.sampler.batch_number_at(next) + self.lag;
            tracing::debug!(step = step + 1, from, ?weights, "balance: rank shares set");
            self.shares.set_from(from, weights);
        }
        self.step_rates.clear();
        self.count(samples, compute_s);
    }
}

/// Steps between two settings of the shares under `train.balance = "dynamic"`, unless `train.balance_every` says.
const DEFAULT_BALANCE_EVERY: usize = 10;

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

/// Whether the memory saver is free for a new copy (the previous one written); an error of the previous copy is
/// logged, not fatal: storage checkpoints still stand behind it.
fn saver_idle(saver: &mut AsyncSaver, step: u64) -> bool {
    match saver.flush(Duration::ZERO) {
        Ok(_) => true,
        Err(CheckpointError::Timeout { .. }) => {
            tracing::debug!(step, "the previous in-memory copy is still being written: none at this step");
            false
        }
        Err(e) => {
            tracing::warn!(step, "an in-memory copy failed: {e}");
            true
        }
    }
}

/// Waits for a pending in-memory copy and hands it to the memory saver; returns the seconds waited. A failure is
/// logged, never fatal.
fn submit_memory_copy(snapshot: &mut Option<MemorySnapshot>, saver: Option<&mut AsyncSaver>) -> f64 {
    let Some(snapshot) = snapshot.take() else { return 0.0 };
    let t0 = Instant::now();
    let copied = match snapshot {
        MemorySnapshot::Copied(c) => c,
        MemorySnapshot::Copying(h) => {
            h.join().map_err(|_| Error::Checkpoint("the in-memory copy thread panicked".into())).and_then(|r| r)
        }
    };
    match (copied, saver) {
        (Ok((step, model, optimizer, meta)), Some(saver)) => {
            if let Err(e) = saver.submit(step, model, optimizer, meta) {
                tracing::warn!(step, "an in-memory copy failed: {e}");
            }
        }
        (Ok(_), None) => {}
        (Err(e), _) => tracing::warn!("an in-memory copy could not be taken: {e}"),
    }
    t0.elapsed().as_secs_f64()
}

/// Keeps the lines of a JSON-lines file whose `step` is at most `max_step`.
fn truncate_jsonl(path: &std::path::Path, max_step: u64) -> Result<()> {
    // Most often nothing is to go (a group regrouping in place at the step its files end at): the last line says
    // so without reading a long run's whole file.
    if last_step(path).is_some_and(|s| s <= max_step) {
        return Ok(());
    }
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

/// The `step` of a JSON-lines file's last whole line, read from its end (`None`: no file, or no such line there).
fn last_step(path: &std::path::Path) -> Option<u64> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    let from = len.saturating_sub(64 * 1024);
    f.seek(SeekFrom::Start(from)).ok()?;
    let mut tail = Vec::new();
    f.read_to_end(&mut tail).ok()?;
    // Only a file that ends with a whole line: a torn last line is for the full rewrite to drop.
    if tail.last() != Some(&b'\n') {
        return None;
    }
    let line = tail[..tail.len() - 1].rsplit(|&b| b == b'\n').next()?;
    serde_json::from_slice::<serde_json::Value>(line).ok()?.get("step")?.as_u64()
}

/// How the ranks that saved a checkpoint split the model (recorded in its manifest for `shoal checkpoint inspect`; the
/// tensors themselves are whole whatever the layout): the pipeline's stages, micro-batches, schedule and model
/// chunks per rank, the tensor-parallel and data-parallel degrees; `None` when every rank holds the whole model.
fn model_layout(spec: &JobSpec) -> Option<serde_json::Value> {
    let (stages, tensor, data) = (spec.pipeline_stages(), spec.tensor_degree(), spec.data_degree());
    if stages <= 1 && tensor <= 1 && data <= 1 {
        return None;
    }
    let mut l = serde_json::json!({ "data": data, "tensor": tensor, "pipeline_stages": stages });
    if let (Some(p), true) = (&spec.parallel, stages > 1) {
        l["micro_batches"] = spec.pipeline_micro_batches().into();
        l["schedule"] = p.schedule.as_str().into();
        l["virtual_stages"] = p.virtual_stages().into();
    }
    Some(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metrics_file_keeps_its_steps_up_to_the_one_a_run_goes_on_from() {
        let dir = std::env::temp_dir().join(format!("shoal-truncate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("metrics.jsonl");
        let lines: String = (1..=5).map(|s| format!("{{\"step\":{s},\"loss\":0.5}}\n")).collect();
        std::fs::write(&path, &lines).expect("write");
        assert_eq!(last_step(&path), Some(5));
        truncate_jsonl(&path, 5).expect("nothing to drop");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), lines);
        truncate_jsonl(&path, 3).expect("drop 4 and 5");
        let kept: String = (1..=3).map(|s| format!("{{\"step\":{s},\"loss\":0.5}}\n")).collect();
        assert_eq!(std::fs::read_to_string(&path).expect("read"), kept);
        // A torn last line (a writer killed mid-line) goes whatever its step.
        std::fs::write(&path, format!("{kept}{{\"step\":4,\"lo")).expect("write");
        assert_eq!(last_step(&path), None);
        truncate_jsonl(&path, 9).expect("drop the torn line");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), kept);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
