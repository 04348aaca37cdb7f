//! Set-up of one rank: the communicator from the environment contract, the datasets, the model and where its
//! checkpoints go ([`setup`]); then, once the model holds the weights of any checkpoint it resumes from, the
//! trainer over the strategy the job names and the sampler of this rank's batches ([`training`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::spec::data::Sharding;
use shoal_comm::Communicator;
use shoal_data::shards::{Coordinator, DynamicShards, Ledger};
use shoal_data::{Dataset, DistributedSampler, Lanes, Options, SamplerConfig, Shares, Split};

use crate::checkpoint::{CheckpointDir, MemoryStore};
use crate::error::{Error, Result};
use crate::models::{Cnn, Gpt, GptConfig, Mlp, Model, Vit, VitConfig};
use crate::optim::OptimConfig;
use crate::params::{Params, SeededRng};
use crate::remote::RemoteStore;
use crate::spec::{JobSpec, ModelKind, OptimizerKind, Overlap, Strategy};
use crate::trainer::{Trainer, TrainerConfig, overlap_pays};

/// What set-up builds for the phases after it.
pub(super) struct Setup {
    /// The job as this attempt runs it: the spec itself, or under `train.strategy = "auto"` the planner's layout
    /// applied to it (its strategy and `[parallel]` table).
    pub(super) spec: JobSpec,
    /// Why `train.strategy = "auto"` chose that layout (absent when the spec named its strategy).
    pub(super) chose: Option<String>,
    /// This rank (in its group).
    pub(super) rank: usize,
    /// This task's own number among its attempt's tasks (its rank, unless it joined a regrouped group): what its
    /// heartbeats are known by.
    pub(super) task_rank: usize,
    /// The group generation the rank entered by its start (0: the attempt's first group; more: it joined a group
    /// in place, and takes its state from the group's rank 0 rather than from a checkpoint).
    pub(super) joined: u32,
    /// The name of the attempt's first communicator: each group's is derived from it.
    pub(super) comm_base: String,
    /// The number of ranks.
    pub(super) world: usize,
    /// The object store checkpoints are mirrored to (rank 0 only).
    pub(super) remote: Option<Arc<RemoteStore>>,
    /// Where checkpoints are written and looked for.
    pub(super) ckpt_dir: CheckpointDir,
    pub(super) model: Box<dyn Model>,
    /// How many parameters the model has.
    pub(super) parameters: usize,
    pub(super) eval: Arc<dyn Dataset>,
    pub(super) train: Arc<dyn Dataset>,
    /// A lake dataset's blocks, which its sampler reads in lanes (`None`: a built-in dataset).
    pub(super) lanes: Option<Lanes>,
    pub(super) comm: Communicator,
    /// The platform's attempt (`None` under `shoal run`): the worker then sends heartbeats.
    pub(super) attempt: Option<i64>,
    /// The server they go to (`SHOAL_SERVER`); without one, or while it cannot be reached, to files.
    pub(super) link: Option<Arc<super::heartbeat::ServerLink>>,
    /// This host's in-memory checkpoints (`checkpoint.memory_every` > 0 and a job id known).
    pub(super) memory: Option<MemoryStore>,
    /// Whether this rank is the first of its host: the one that writes the host's in-memory copies and removes them
    /// at the end.
    pub(super) host_leader: bool,
    /// Under `train.strategy = "ps"`, the communicator of every task, servers included, that `comm` (the workers')
    /// was split from: kept open while the job runs.
    pub(super) _with_servers: Option<Communicator>,
    /// Where this rank computes (`crate::device`): the CPU, or the GPU the task was given.
    pub(super) placement: crate::device::Placement,
}

/// The trainer and the sampler of this rank's batches.
pub(super) struct Training {
    pub(super) sampler: DistributedSampler,
    /// Under `train.balance = "dynamic"`: the rank shares the step loop sets and the sampler (and its loader's
    /// copy) cuts the global batches by.
    pub(super) shares: Option<Arc<Shares>>,
    /// Under `train.data.sharding = "dynamic"`: the blocks this rank takes from the job's rendezvous store.
    pub(super) shards: Option<DynamicShards>,
    /// Samples of one micro-batch.
    pub(super) micro: usize,
    /// Whether gradient all-reduces overlap backward (`train.overlap`, resolved).
    pub(super) overlap: bool,
    /// The strategy that runs (`train.strategy`, or the one `"auto"` chose): what the manifest and the summary
    /// record.
    pub(super) ran: Strategy,
    /// Why `train.strategy = "auto"` chose `ran` (absent when the spec named it).
    pub(super) chose: Option<String>,
    pub(super) trainer: Trainer,
}

/// Connects this rank to the others, resolves `train.strategy = "auto"` at their number (`crate::plan::resolve`:
/// the same layout on every rank), and builds the datasets and the model; the model's parameters come beside, for
/// a checkpoint to be loaded into before the trainer takes them.
pub(super) fn setup(asked: &JobSpec, output: &Path) -> Result<(Setup, Params)> {
    let env = shoal_comm::env::EnvContract::from_env()?;
    // A task given GPUs that this build or host cannot use is refused before it keeps the others waiting.
    let (placement, device) = crate::device::select(asked)?;
    let attempt = env.attempt;
    let job_id = env.job_id.clone();
    let link = server_link(&env);
    let (task_rank, joined, comm_base) = (env.task_rank, env.generation, env.cfg.name.clone());
    // Said again until this rank's heartbeats start, when `_announcing` is dropped at the end of the set-up.
    let _announcing = match (joined, &link, attempt) {
        (1.., Some(l), Some(a)) => {
            let (announcing, first) = super::heartbeat::Announcing::start(l.clone(), task_rank, a, joined);
            if let Err(e) = first {
                tracing::warn!(error = %e, "could not tell the server this task joins group {joined}");
            }
            Some(announcing)
        }
        _ => None,
    };
    let comm = env.connect()?;
    // Under parameter servers, the workers' own group: the servers are the last tasks, and train nothing.
    let (comm, with_servers) = match asked.ps_servers() {
        0 => (comm, None),
        _ => {
            let rank = comm.rank() as i64;
            let workers = comm.split(Some(0), rank)?.ok_or_else(|| {
                Error::InvalidArgument("the workers' group did not form without the parameter servers".into())
            })?;
            (workers, Some(comm))
        }
    };
    let (world, rank) = (comm.size(), comm.rank());
    let (planned, chose) = crate::plan::resolve(asked, world).map_err(Error::Spec)?;
    if let (0, Some(why)) = (rank, &chose) {
        eprintln!("train.strategy = \"auto\" chose {why}");
    }
    let spec = &planned;
    if placement.is_cuda() && !matches!(spec.train.strategy, Strategy::Ddp | Strategy::Zero1 | Strategy::Zero2) {
        return Err(Error::Spec(format!(
            "resources.gpus: training on a GPU runs under train.strategy \"ddp\", \"zero1\" or \"zero2\", not \"{}\"",
            spec.train.strategy.as_str()
        )));
    }
    if rank == 0 && placement.is_cuda() {
        eprintln!("computing on {placement} in {}", spec.train.precision.name());
    }
    let host_leader = host_leader(&comm);
    let host = comm.hosts().get(rank).cloned().unwrap_or_default();
    let memory = match (spec.checkpoint.memory_every, job_id.as_deref().and_then(crate::spec::memory_checkpoint_dir)) {
        (0, _) => None,
        (_, Some(root)) => Some(MemoryStore::new(root, &host)),
        (_, None) => {
            if rank == 0 {
                tracing::warn!("checkpoint.memory_every is set but the job has no usable id: no in-memory copies");
            }
            None
        }
    };
    spec.validate_world(world).map_err(|e| Error::Spec(e.to_string()))?;
    let t = &spec.train;
    let (train, eval, lanes) = open_data(t)?;

    let mut rng = SeededRng::new(t.seed);
    // Under tensor parallelism each rank builds only its part of the model (the tensor index varies fastest).
    let tensor = spec.tensor_degree();
    let shard = (tensor > 1).then(|| crate::tensor_parallel::Shard::new(rank % tensor, tensor));
    let (params, model) = build_model_placed(spec, &mut rng, shard, device)?;
    let parameters = params.full_count();
    let ckpt_dir = CheckpointDir::new(checkpoint_root(spec, output)?);
    let remote = if rank == 0 { checkpoint_remote(spec)? } else { None };
    Ok((
        Setup {
            spec: planned.clone(),
            chose,
            rank,
            task_rank,
            joined,
            comm_base,
            world,
            remote,
            ckpt_dir,
            model,
            parameters,
            eval,
            train,
            lanes,
            comm,
            attempt,
            link,
            memory,
            host_leader,
            _with_servers: with_servers,
            placement,
        },
        params,
    ))
}

/// A job's training data, held-out data, and for a lake dataset the blocks its sampler reads in lanes.
pub type JobData = (Arc<dyn Dataset>, Arc<dyn Dataset>, Option<Lanes>);

/// The job's training and held-out data: a built-in dataset's splits, or a lake dataset's rows (`train.dataset` a
/// location) read where they are, with the blocks its sampler reads in lanes.
pub fn open_data(t: &crate::spec::TrainSpec) -> Result<JobData> {
    let o = t.data_options();
    if !crate::spec::data::is_lake(&t.dataset) {
        let train = shoal_data::builtin(&t.dataset, &Options { split: Split::Train, ..o.clone() })?;
        let eval = shoal_data::builtin(&t.dataset, &Options { split: Split::Eval, ..o })?;
        return Ok((Arc::from(train), Arc::from(eval), None));
    }
    let spec = shoal_data::lake::TableSpec {
        location: t.dataset.clone(),
        format: o.format.as_deref().and_then(shoal_data::lake::Format::parse),
        features: o.feature_columns.clone().unwrap_or_default(),
        label: o.label_column.clone().unwrap_or_default(),
        classes: o.classes.unwrap_or(0),
        text: o.text_column.clone(),
        context: o.context.unwrap_or(crate::spec::data::DEFAULT_CONTEXT),
        cache_bytes: shoal_data::lake::table::DEFAULT_CACHE_BYTES,
    };
    let (train, eval) = shoal_data::lake::open_splits(spec, o.eval.as_deref(), o.eval_fraction.unwrap_or(0.1))?;
    let lanes = Lanes { blocks: train.blocks().into(), lanes: lanes_of(t) };
    Ok((Arc::new(train), Arc::new(eval), Some(lanes)))
}

/// `train.data.lanes`, or by default the largest divisor of the micro-batch up to 8.
fn lanes_of(t: &crate::spec::TrainSpec) -> usize {
    let micro = t.micro_batch();
    t.data.lanes.unwrap_or_else(|| crate::spec::data::default_lanes(micro))
}

/// The link to the control plane a task's heartbeats go over (on the platform; `None` under `shoal run`, or while
/// the server cannot be reached: then they go to files).
pub(super) fn server_link(env: &shoal_comm::env::EnvContract) -> Option<Arc<super::heartbeat::ServerLink>> {
    match (&env.server, &env.job_id, env.attempt) {
        (Some(server), Some(job), Some(_)) => {
            match super::heartbeat::ServerLink::new(server, env.server_ca.as_deref(), job, &env.cfg.secret) {
                Ok(l) => Some(Arc::new(l)),
                Err(e) => {
                    tracing::warn!(server, error = %e, "heartbeats cannot go to the server; they go to files");
                    None
                }
            }
        }
        _ => None,
    }
}

/// Whether this rank is the first of its host in `comm`.
fn host_leader(comm: &Communicator) -> bool {
    let host = comm.hosts().get(comm.rank()).cloned().unwrap_or_default();
    comm.hosts().iter().position(|h| *h == host) == Some(comm.rank())
}

impl Setup {
    /// This rank trains in a new group now, over `comm`: its rank, the world, whether it leads its host, and (when it
    /// became rank 0) the object store rank 0 mirrors checkpoints to follow.
    pub(super) fn regrouped(&mut self, comm: Communicator, spec: &JobSpec) -> Result<()> {
        spec.validate_world(comm.size()).map_err(|e| Error::Spec(e.to_string()))?;
        self.rank = comm.rank();
        self.world = comm.size();
        self.host_leader = host_leader(&comm);
        if self.rank == 0 && self.remote.is_none() {
            self.remote = checkpoint_remote(spec)?;
        }
        self.comm = comm;
        Ok(())
    }
}

/// The optimizer, whether all-reduces overlap backward, the trainer over the strategy `train.strategy` names (its
/// start makes the ranks' parameters agree), and the sampler.
pub(super) fn training(spec: &JobSpec, setup: &Setup, params: Params) -> Result<Training> {
    let t = &spec.train;
    let (comm, world, rank) = (&setup.comm, setup.world, setup.rank);
    let optimizer = optimizer_config(spec);
    let overlap = match t.overlap {
        Overlap::On => true,
        Overlap::Off => false,
        Overlap::Auto => overlap_pays(comm),
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
    // `[compression]`: DDP then reduces its buckets after backward, through the compressor.
    let compression = spec.compression.filter(|c| c.is_on()).map(|c| compress_config(&c, t.seed));
    let overlap = overlap && !(compression.is_some() && t.strategy == Strategy::Ddp);
    let cfg = TrainerConfig {
        optimizer,
        bucket_bytes: t.bucket_bytes(),
        clip_grad_norm: t.clip_grad_norm,
        overlap,
        precision: t.precision,
        ..TrainerConfig::default()
    };
    // The strategy `train.strategy` names (the spec refuses names that have none yet; `"auto"` was resolved into
    // the spec at set-up): what the manifest and the summary record.
    let (ran, chose) = (t.strategy, setup.chose.clone());
    let strategy: Box<dyn crate::strategy::Strategy> = match ran {
        Strategy::Ddp => {
            let ddp = crate::strategy::ddp::Ddp::new(Some(comm.clone()), cfg.ddp());
            // `train.collectives`: gradients held on the GPUs summed there (NCCL) or staged through the host.
            let ddp = match super::collectives::device_reduce(spec, setup.placement, comm, &params)? {
                Some(r) => ddp.with_device_reduce(r),
                None => ddp,
            };
            let ddp = match spec.robust {
                Some(r) => ddp.with_robust(r.rule.rule(), r.f),
                None => ddp,
            };
            let ddp = match spec.chaos.as_ref().and_then(|c| Some((c.attack()?, c.byzantine_ranks.clone()))) {
                Some((attack, liars)) => {
                    if setup.rank == 0 {
                        eprintln!(
                            "experiment ([chaos]): ranks {liars:?} send {} (scale {}) in place of their gradients",
                            attack.name(),
                            attack.scale()
                        );
                    }
                    ddp.attacked_by(attack, liars)
                }
                None => ddp,
            };
            Box::new(match compression {
                Some(c) => ddp.with_compression(c).sending_moment(spec.compression.is_some_and(|c| c.momentum)),
                None => ddp,
            })
        }
        Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3 => {
            let zero = match ran {
                Strategy::Zero1 => crate::strategy::zero::Zero1::new(Some(comm.clone())),
                Strategy::Zero2 => crate::strategy::zero::Zero::new(Some(comm.clone()), 2, cfg.bucket_bytes),
                // The next layer's gather overlaps the current layer's computation where a core is free for it.
                _ => crate::strategy::zero::Zero3::new(Some(comm.clone()), overlap),
            };
            Box::new(match compression {
                Some(c) => zero.with_compression(c),
                None => zero,
            })
        }
        Strategy::Pipeline => {
            Box::new(crate::strategy::pipeline::Pipeline::new(Some(comm.clone()), pipeline_config(spec)?))
        }
        Strategy::Tensor => Box::new(crate::strategy::tensor::TensorParallel::new(Some(comm.clone()))),
        Strategy::ThreeD => {
            Box::new(crate::strategy::composed::Composed::new(Some(comm.clone()), layout_config(spec)?))
        }
        Strategy::Ps => {
            let ps = spec.ps.unwrap_or_default();
            let timeout = comm.config().timeout;
            let addresses = shoal_ps::net::addresses(comm.store().as_ref(), &setup.comm_base, ps.servers, timeout)?;
            let cfg = crate::strategy::ps::PsConfig {
                addresses,
                mode: ps.mode(),
                secret: comm.config().secret.clone(),
                timeout: server_wait(timeout) + std::time::Duration::from_secs(30),
            };
            Box::new(crate::strategy::ps::Ps::new(Some(comm.clone()), &params, cfg)?)
        }
        Strategy::Auto => return Err(Error::Spec("train.strategy: \"auto\" was not resolved".into())),
        Strategy::Federated => {
            return Err(Error::Spec("train.strategy = \"federated\" trains clients, not one trainer".into()));
        }
    };
    let trainer = Trainer::with_strategy(params, strategy, cfg)?;

    let micro = t.micro_batch();
    // The stages of a pipeline, or a tensor-parallel group, share every batch: the data is split over the
    // data-parallel replicas only (a rank's replica: its index past the tensor index, which varies fastest).
    let replicas = world / spec.model_parallel();
    let cfg = SamplerConfig { seed: t.seed, ..SamplerConfig::new(setup.train.len(), micro) };
    let replica = (rank / spec.tensor_degree()) % replicas;
    let sampler = match &setup.lanes {
        Some(lanes) => DistributedSampler::with_lanes(cfg, lanes.clone(), replicas, replica)?,
        None => DistributedSampler::new(cfg, replicas, replica)?,
    };
    let shares = (t.balance == crate::spec::Balance::Dynamic).then(|| Arc::new(Shares::default()));
    let sampler = match &shares {
        Some(s) => sampler.with_shares(Arc::clone(s)),
        None => sampler,
    };
    let shards = match (t.data.sharding, &setup.lanes) {
        (Some(Sharding::Dynamic), Some(lanes)) => {
            let coordinator = Arc::new(StoreCoordinator { store: Arc::clone(comm.store()) });
            Some(DynamicShards::new(coordinator, Arc::clone(&lanes.blocks), sampler.clone(), Ledger::default())?)
        }
        _ => None,
    };
    Ok(Training { sampler, shares, shards, micro, overlap, ran, chose, trainer })
}

/// Dynamic sharding's coordinator: the job's rendezvous store.
#[derive(Debug)]
struct StoreCoordinator {
    store: Arc<dyn shoal_comm::Store>,
}

impl StoreCoordinator {
    fn failed(key: &str, e: impl std::fmt::Display) -> shoal_data::Error {
        shoal_data::Error::Coordinator { what: format!("the rendezvous store's key {key}"), reason: e.to_string() }
    }
}

impl Coordinator for StoreCoordinator {
    fn take(&self, key: &str) -> shoal_data::Result<u64> {
        let v = self.store.add(key, 1).map_err(|e| Self::failed(key, e))?;
        u64::try_from(v - 1).map_err(|e| Self::failed(key, e))
    }

    fn put(&self, key: &str, value: &[u8]) -> shoal_data::Result<()> {
        self.store.set(key, value).map_err(|e| Self::failed(key, e))
    }

    fn read(&self, key: &str) -> shoal_data::Result<Option<Vec<u8>>> {
        // A rank sets its key before it reads the piece, so a boundary after those rows reads it.
        self.store.try_get(key).map_err(|e| Self::failed(key, e))
    }
}

/// The longest a parameter server holds a request back, or waits to hear from any worker: the communicator's
/// deadline, and at least a minute (a synchronous round waits for the slowest worker's whole step).
pub(super) fn server_wait(timeout: std::time::Duration) -> std::time::Duration {
    timeout.max(std::time::Duration::from_secs(60))
}

/// The optimizer `train.optimizer` names, with its settings.
pub fn optimizer_config(spec: &JobSpec) -> OptimConfig {
    let t = &spec.train;
    match t.optimizer {
        OptimizerKind::Sgd => OptimConfig::Sgd { momentum: t.momentum(), weight_decay: t.weight_decay() },
        OptimizerKind::Adamw => {
            let [beta1, beta2] = t.betas();
            OptimConfig::AdamW { beta1, beta2, eps: t.eps(), weight_decay: t.weight_decay() }
        }
    }
}

/// `[compression]` as the compressor takes it (seeded by the job's seed, so every rank draws alike).
fn compress_config(c: &shoal_spec::CompressionSpec, seed: u64) -> shoal_comm::CompressConfig {
    use shoal_comm::Codec;
    use shoal_spec::CodecName;
    let codec_of = |name: CodecName| match name {
        CodecName::None => Codec::None,
        CodecName::Fp16 => Codec::Fp16,
        CodecName::Bf16 => Codec::Bf16,
        CodecName::Int8 => Codec::Int8 { stochastic: c.stochastic },
        CodecName::Topk => Codec::TopK { ratio: c.ratio() },
        CodecName::Randk => Codec::RandK { ratio: c.ratio() },
        CodecName::Sign => Codec::Sign,
        CodecName::Powersgd => Codec::PowerSgd { rank: c.rank() },
    };
    shoal_comm::CompressConfig {
        codec: codec_of(c.codec),
        error_feedback: c.error_feedback,
        warmup_steps: c.warmup_steps,
        warmup_codec: codec_of(c.warmup_codec),
        seed,
    }
}

/// A pipeline job's `[parallel]` layout.
fn pipeline_config(spec: &JobSpec) -> Result<crate::strategy::pipeline::PipelineConfig> {
    let p =
        spec.parallel.as_ref().ok_or_else(|| Error::Spec("train.strategy = \"pipeline\" needs [parallel]".into()))?;
    let (stages, micro_batches) = p.stages_and_micro_batches();
    Ok(crate::strategy::pipeline::PipelineConfig {
        stages,
        micro_batches,
        schedule: p.schedule,
        virtual_stages: p.virtual_stages(),
        balance: p.balance.unwrap_or_default(),
    })
}

/// A composed job's `[parallel]` layout.
fn layout_config(spec: &JobSpec) -> Result<crate::strategy::composed::LayoutConfig> {
    let p = spec.parallel.as_ref().ok_or_else(|| Error::Spec("train.strategy = \"3d\" needs [parallel]".into()))?;
    Ok(crate::strategy::composed::LayoutConfig {
        data: spec.data_degree(),
        tensor: spec.tensor_degree(),
        pipeline: spec.pipeline_stages(),
        micro_batches: spec.pipeline_micro_batches(),
        schedule: p.schedule,
        virtual_stages: p.virtual_stages(),
        zero: spec.zero_stage(),
    })
}

/// The model of a job and the parameters behind it.
pub fn build_model(spec: &JobSpec, rng: &mut SeededRng) -> Result<(Params, Box<dyn Model>)> {
    build_model_sharded(spec, rng, None)
}

/// [`build_model`] for one rank of a tensor-parallel group (`shard`): its parameters are its parts of the model's
/// (`crate::tensor_parallel`).
pub fn build_model_sharded(
    spec: &JobSpec,
    rng: &mut SeededRng,
    shard: Option<crate::tensor_parallel::Shard>,
) -> Result<(Params, Box<dyn Model>)> {
    build_model_placed(spec, rng, shard, candle_core::Device::Cpu)
}

/// [`build_model_sharded`] for a model that computes on `device`. Its parameters are held there too
/// ([`Params::set_resident`]) under plain data parallelism (DDP without `[compression]` or `[robust]`, whose host
/// loops read the optimizer's state); otherwise they stay on the host and the passes take copies.
pub fn build_model_placed(
    spec: &JobSpec,
    rng: &mut SeededRng,
    shard: Option<crate::tensor_parallel::Shard>,
    device: candle_core::Device,
) -> Result<(Params, Box<dyn Model>)> {
    let t = &spec.train;
    let shape = t.data_shape().map_err(|e| Error::Spec(e.to_string()))?;
    let m = &t.model;
    let mut params = shard.map_or_else(Params::default, Params::tensor_parallel);
    params.set_compute(crate::precision::compute_dtype(t.precision));
    let plain_ddp =
        t.strategy == Strategy::Ddp && spec.robust.is_none() && !spec.compression.is_some_and(|c| c.is_on());
    match (device.is_cpu(), plain_ddp) {
        (false, true) => params.set_resident(device),
        _ => params.set_device(device),
    }
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
        ModelKind::Vit => Box::new(Vit::new(
            &mut params,
            rng,
            VitConfig {
                side: crate::spec::ModelSpec::image_side(shape.features).ok_or_else(|| {
                    Error::Spec(format!("train.dataset: {} features are not a square image", shape.features))
                })?,
                patch: m.patch(),
                layers: m.layers(),
                heads: m.heads(),
                width: m.width(),
                classes: shape.classes,
            },
        )?),
    };
    Ok((params, model))
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

/// The object store a job's checkpoints are mirrored to, when `checkpoint.url` names one.
pub fn checkpoint_remote(spec: &JobSpec) -> Result<Option<Arc<crate::remote::RemoteStore>>> {
    match spec.checkpoint.url.as_deref() {
        Some(u) if crate::remote::is_remote(u) => crate::remote::RemoteStore::open(u)
            .map(|r| Some(Arc::new(r)))
            .map_err(|e| Error::Checkpoint(format!("checkpoint.url: {e}"))),
        _ => Ok(None),
    }
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
