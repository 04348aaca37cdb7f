//! A parameter server's process (`train.strategy = "ps"`): the tasks past the workers' number serve the model
//! instead of training it. Each joins the job's communicator only to meet (then takes no part in the workers'
//! group), derives the plan that spreads the model over the servers from the model's shapes, listens, says where in
//! the rendezvous store, and serves (`shoal_ps::net::Server`) until every worker has finished. Its shard is saved
//! at the workers' checkpoints into `ps/server-S/` beside them, in the same format (a manifest and safetensors
//! files, each piece of a tensor under the tensor's name with its offset in the manifest), and a resumed job's
//! server starts from its newest save.

use crate::kernels::{from_f32, to_f32};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use shoal_comm::env::EnvContract;
use shoal_ps::net::{Persist, Server, ServerConfig};
use shoal_ps::{PsError, ShardPlan, Snapshot};

use crate::checkpoint::{CheckpointDir, ManifestMeta, TensorData};
use crate::error::{Error, Result};
use crate::params::{Params, SeededRng};
use crate::spec::JobSpec;
use crate::strategy::ps::plan;

/// Whether this task is one of the job's parameter servers, and which: the last `ps.servers` tasks are.
pub(super) fn server_index(spec: &JobSpec, env: &EnvContract) -> Option<usize> {
    let servers = spec.ps_servers();
    let workers = env.world_size.checked_sub(servers)?;
    (servers > 0 && env.rank >= workers).then(|| env.rank - workers)
}

/// Runs server `index` of `spec` to the end of the job; its saves go under `output`'s checkpoint root, and it starts
/// from the newest when the job `resume`s.
pub(super) fn run(spec: &JobSpec, output: &Path, resume: bool, env: EnvContract, index: usize) -> Result<()> {
    let servers = spec.ps_servers();
    let workers = env.world_size - servers;
    let (name, secret, timeout, advertise) =
        (env.cfg.name.clone(), env.cfg.secret.clone(), env.cfg.timeout, env.cfg.advertise);
    let (link, attempt, task_rank) = (super::setup::server_link(&env), env.attempt, env.task_rank);
    let world = env.connect()?;
    // The workers' group forms without the servers.
    let _none = world.split(None, 0)?;
    // On the platform the control loop hears from the server as from every task: it serves while the workers train.
    let beat = attempt.and_then(|a| super::heartbeat::Beat::start(world.clone(), task_rank, a, 0, output, link));
    if let Some(b) = &beat {
        b.phase(super::heartbeat::Phase::Train);
    }
    let mut rng = SeededRng::new(spec.train.seed);
    let (params, _) = super::setup::build_model(spec, &mut rng)?;
    let plan = plan(&params, servers)?;
    let listener = TcpListener::bind((advertise, 0)).map_err(|e| Error::io("binding the parameter server", e))?;
    let addr = listener.local_addr().map_err(|e| Error::io("the parameter server's address", e))?.to_string();
    shoal_ps::net::publish(world.store().as_ref(), &name, index, &addr)?;
    let root = super::setup::checkpoint_root(spec, output)?.join("ps").join(format!("server-{index}"));
    let persist = ShardDir::new(root, &params, &plan, index, spec.checkpoint.keep, resume);
    let (rule, f) = spec.robust.map_or((shoal_ps::Rule::Mean, 0), |r| (r.rule.rule(), r.f));
    let cfg = ServerConfig {
        index,
        servers,
        workers,
        mode: spec.ps.unwrap_or_default().mode(),
        optim: super::setup::optimizer_config(spec),
        rule,
        f,
        wait: super::setup::server_wait(timeout),
        secret,
        attack: spec.chaos.as_ref().and_then(|c| Some((c.attack()?, c.byzantine_ranks.clone()))),
    };
    if let (0, Some((attack, liars))) = (index, &cfg.attack) {
        eprintln!(
            "experiment ([chaos]): the servers take what workers {liars:?} push as {} (scale {})",
            attack.name(),
            attack.scale()
        );
    }
    tracing::info!(server = index, %addr, values = plan.sizes()[index], "parameter server listening");
    let report = Server::new(listener, cfg, Some(Arc::new(persist))).and_then(Server::run);
    let report = match (report, &beat) {
        (Ok(r), _) => r,
        (Err(e), Some(b)) => {
            b.fail(&e.to_string());
            return Err(e.into());
        }
        (Err(e), None) => return Err(e.into()),
    };
    if let Some(b) = &beat {
        b.phase(super::heartbeat::Phase::Finish);
    }
    eprintln!(
        "parameter server {index}: version {}, {} pushes and {} pulls served, {:.1} MB in, {:.1} MB out{}",
        report.version,
        report.pushes,
        report.pulls,
        report.bytes_in as f64 / 1e6,
        report.bytes_out as f64 / 1e6,
        if report.restored { " (resumed from its save)" } else { "" }
    );
    drop(world);
    Ok(())
}

/// A server's saves, as checkpoints of their own: `ROOT/checkpoints/step-N/`.
struct ShardDir {
    dir: CheckpointDir,
    /// This server's pieces: the tensor's name, the piece's values and its shape.
    pieces: Vec<(String, std::ops::Range<usize>, Vec<usize>)>,
    keep: usize,
    /// Whether the job resumes (a fresh run ignores older saves).
    resume: bool,
}

impl ShardDir {
    fn new(root: PathBuf, params: &Params, plan: &ShardPlan, index: usize, keep: usize, resume: bool) -> ShardDir {
        let pieces = plan.servers.get(index).cloned().unwrap_or_default();
        let pieces = pieces
            .into_iter()
            .filter_map(|p| {
                let (name, var) = params.vars().get(p.tensor)?;
                let dims = var.dims();
                let row: usize = dims.iter().skip(1).product::<usize>().max(1);
                let shape = if dims.len() > 1 {
                    let mut s = vec![p.range.len() / row];
                    s.extend_from_slice(&dims[1..]);
                    s
                } else {
                    vec![p.range.len()]
                };
                Some((name.clone(), p.range, shape))
            })
            .collect();
        ShardDir { dir: CheckpointDir::new(root), pieces, keep, resume }
    }

    fn layout(&self) -> serde_json::Value {
        self.pieces.iter().map(|(n, r, _)| serde_json::json!({ "tensor": n, "start": r.start, "end": r.end })).collect()
    }

    fn root(&self) -> &Path {
        self.dir.root()
    }
}

fn failed(e: impl std::fmt::Display) -> PsError {
    PsError::Checkpoint(e.to_string())
}

impl Persist for ShardDir {
    fn save(&self, s: &Snapshot) -> shoal_ps::Result<()> {
        let cut = |all: &[f32], suffix: &str| -> Vec<TensorData> {
            let mut at = 0;
            self.pieces
                .iter()
                .map(|(n, r, shape)| {
                    let part =
                        all.get(at..at + r.len()).map(|p| p.iter().map(|&v| from_f32(v)).collect()).unwrap_or_default();
                    at += r.len();
                    TensorData::new(format!("{n}{suffix}"), shape.clone(), part)
                })
                .collect()
        };
        let model = cut(&s.values, "");
        let mut optimizer = Vec::new();
        if !s.m.is_empty() {
            optimizer.extend(cut(&s.m, ".m"));
        }
        if !s.v.is_empty() {
            optimizer.extend(cut(&s.v, ".v"));
        }
        let meta = ManifestMeta {
            epoch: 0,
            sampler: serde_json::Value::Null,
            rng: serde_json::Value::Null,
            world_size: s.clocks.len(),
            strategy: "ps-server".into(),
            extra: serde_json::json!({
                "server": s.server,
                "servers": s.servers,
                "version": s.version,
                "clocks": s.clocks,
                "pieces": self.layout(),
            }),
        };
        self.dir.save(s.step, &model, &optimizer, meta).map_err(failed)?;
        self.dir.prune(self.keep).map_err(failed)?;
        Ok(())
    }

    fn load(&self) -> shoal_ps::Result<Option<Snapshot>> {
        if !self.resume {
            return Ok(None);
        }
        let Some(l) = self.dir.latest_valid().map_err(failed)? else { return Ok(None) };
        let where_ = l.dir.display().to_string();
        let extra = &l.manifest.extra;
        if extra.get("pieces") != Some(&self.layout()) {
            return Err(PsError::Checkpoint(format!(
                "{where_} holds other pieces of the model than this server serves now (ps.servers or the model \
                 changed): resume from the workers' checkpoint instead, or remove {}",
                self.root().display()
            )));
        }
        let join = |tensors: &[TensorData], suffix: &str| -> shoal_ps::Result<Vec<f32>> {
            let mut out = Vec::new();
            for (n, r, _) in &self.pieces {
                let name = format!("{n}{suffix}");
                match tensors.iter().find(|t| t.name == name) {
                    Some(t) if t.data.len() == r.len() => out.extend(t.data.iter().map(|&v| to_f32(v))),
                    Some(_) | None if suffix.is_empty() => {
                        return Err(PsError::Checkpoint(format!("{where_}: piece {name} is missing or mis-sized")));
                    }
                    _ => return Ok(Vec::new()),
                }
            }
            Ok(out)
        };
        let num = |k: &str| extra.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
        let clocks = extra
            .get("clocks")
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();
        Ok(Some(Snapshot {
            server: num("server") as usize,
            servers: num("servers") as usize,
            step: l.manifest.step,
            version: num("version"),
            values: join(&l.model, "")?,
            m: join(&l.optimizer, ".m")?,
            v: join(&l.optimizer, ".v")?,
            clocks,
        }))
    }
}
