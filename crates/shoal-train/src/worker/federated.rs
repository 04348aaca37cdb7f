//! Federated learning in simulation (`train.strategy = "federated"`): the job's worker processes are a bounded
//! pool that the clients take turns in, and together play the server.
//!
//! Every round:
//! - the clients of the round are drawn from the round's own seed (the same on every process): `clients_per_round`
//!   of them without replacement, or under `[federated.dp]` each client with probability
//!   `clients_per_round / clients` (Poisson sampling, as the accountant assumes);
//! - sampled client `i` runs in process `i mod N`: the global model in, `local_steps` (or `local_epochs`) of the
//!   job's optimizer on that client's own samples only (FedProx adds `mu · (w − w_global)` to the gradient), and its
//!   update `w − w_global` out — clipped to `dp.clip` under DP (and noised, with `dp.local`);
//! - the updates are summed over the processes (weighted by the clients' samples; under DP unweighted, with the
//!   server's Gaussian noise `σ·clip` added to the sum from the round's seed, divided by the expected number of
//!   clients) and every process applies the same server step — FedAvg and FedProx `w += server_lr · Δ`, FedAdam an
//!   Adam step on `−Δ` (Reddi et al.'s adaptivity τ = 1e-3) — so the global model never needs sending again;
//! - rank 0 evaluates the global model on the held-out data and writes the round's line to `metrics.jsonl`
//!   (`step` is the round), with the ε spent so far under DP.
//!
//! A client's data stays in the process that trains it, for that round: only updates cross between processes.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use candle_core::{Device, Tensor};
use shoal_comm::{Communicator, ReduceOp};
use shoal_data::Dataset;
use shoal_data::clients::{Cut, cut};
use shoal_data::rng::SplitMix64;

use super::wire::{FederatedReport, RoundReport, metrics_file};
use crate::Real;
use crate::batch::to_tensors;
use crate::dp;
use crate::error::{Error, Result};
use crate::models::Model;
use crate::params::Params;
use crate::spec::{FedAlgorithm, FedPartition, FederatedSpec, JobSpec};

/// The model's parameters as one flat buffer, in registration order.
fn flat(params: &Params) -> Result<Vec<Real>> {
    let mut out = Vec::with_capacity(params.full_count());
    for (_, v) in params.vars() {
        out.extend(v.as_tensor().flatten_all()?.to_vec1::<Real>()?);
    }
    Ok(out)
}

/// Sets the model's parameters from a flat buffer.
fn load(params: &Params, w: &[Real]) -> Result<()> {
    let mut at = 0;
    for (_, v) in params.vars() {
        let n = v.elem_count();
        v.set(&Tensor::from_slice(&w[at..at + n], v.shape(), &Device::Cpu)?)?;
        at += n;
    }
    Ok(())
}

/// The round's sampled clients (sorted), the same in every process.
fn sample(f: &FederatedSpec, round: usize, seed: u64, poisson: bool) -> Vec<usize> {
    let mut g = SplitMix64::from_key(&[seed, round as u64, 0xfed]);
    if poisson {
        let q = f.per_round() as f64 / f.clients as f64;
        return (0..f.clients).filter(|_| g.unit_f64() < q).collect();
    }
    first_of_permutation(f.clients, f.per_round(), &[seed, round as u64, 0xfed])
}

/// The first `k` of a seeded permutation of `0..n`, sorted.
fn first_of_permutation(n: usize, k: usize, key: &[u64]) -> Vec<usize> {
    let mut chosen = shoal_data::rng::permutation(n, key);
    chosen.truncate(k.min(n));
    chosen.sort_unstable();
    chosen
}

/// Mean loss and accuracy of the model on `data`, in batches of `batch`.
fn evaluate(model: &dyn Model, data: &dyn Dataset, batch: usize) -> Result<(f64, f64)> {
    let (mut loss, mut correct, mut rows) = (0f64, 0f64, 0usize);
    let mut i = 0;
    while i < data.len() {
        let samples: Vec<_> =
            (i..(i + batch).min(data.len())).map(|k| data.get(k)).collect::<shoal_data::Result<_>>()?;
        i += samples.len();
        let Some(x) = to_tensors(&samples)? else { continue };
        let logits = model.forward(&x.input)?;
        loss += f64::from(model.loss(&logits, &x.target)?.to_scalar::<Real>()?) * x.rows as f64;
        correct += model.correct(&logits, &x.target)?;
        rows += x.rows;
    }
    Ok((loss / rows.max(1) as f64, correct / rows.max(1) as f64))
}

/// One client's local training from the global `w`: its update `w_local − w`, and its mean loss.
#[allow(clippy::too_many_arguments)]
fn train_client(
    spec: &JobSpec,
    f: &FederatedSpec,
    model: &dyn Model,
    params: &Params,
    data: &dyn Dataset,
    mine: &[usize],
    w: &[Real],
    round: usize,
    client: usize,
) -> Result<(Vec<Real>, f64)> {
    let t = &spec.train;
    let batch = t.global_batch.min(mine.len()).max(1);
    let steps = match (f.local_steps, f.local_epochs) {
        (_, Some(e)) => e * mine.len().div_ceil(batch),
        (Some(s), None) => s,
        (None, None) => 10,
    };
    let cfg = super::setup::optimizer_config(spec);
    let mut local = w.to_vec();
    let (mut m, mut v) = (Vec::new(), Vec::new());
    let order: Vec<usize> = shoal_data::rng::permutation(mine.len(), &[t.seed, round as u64, client as u64, 0x10ca1])
        .into_iter()
        .map(|k| mine[k])
        .collect();
    let mu = if f.algorithm == FedAlgorithm::Fedprox { f.mu() } else { 0.0 };
    let mut loss_sum = 0f64;
    for step in 0..steps {
        load(params, &local)?;
        let start = (step * batch) % order.len();
        let samples: Vec<_> =
            (0..batch).map(|k| data.get(order[(start + k) % order.len()])).collect::<shoal_data::Result<_>>()?;
        let x = to_tensors(&samples)?.ok_or_else(|| Error::InvalidArgument("an empty local batch".into()))?;
        let loss = model.loss(&model.forward(&x.input)?, &x.target)?;
        loss_sum += f64::from(loss.to_scalar::<Real>()?);
        let grads = loss.backward()?;
        let mut g = Vec::with_capacity(local.len());
        for (name, var) in params.vars() {
            match grads.get(var.as_tensor()) {
                Some(gr) => g.extend(gr.flatten_all()?.to_vec1::<Real>()?),
                None => {
                    tracing::debug!(param = name, "no gradient: taken as zero");
                    g.extend(std::iter::repeat_n(0.0 as Real, var.elem_count()));
                }
            }
        }
        if mu > 0.0 {
            let mu = mu as Real;
            for ((gi, li), wi) in g.iter_mut().zip(&local).zip(w) {
                *gi += mu * (li - wi);
            }
        }
        let lr = t.lr;
        shoal_ps::optim::update_flat(cfg, step as u64 + 1, lr, &mut local, &g, &mut m, &mut v, step == 0)?;
    }
    let update: Vec<Real> = local.iter().zip(w).map(|(l, g)| l - g).collect();
    Ok((update, loss_sum / steps.max(1) as f64))
}

fn norm(x: &[Real]) -> f64 {
    x.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>().sqrt()
}

/// Runs every round of the job; rank 0 returns what it did (and writes `metrics.jsonl`).
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    spec: &JobSpec,
    comm: &Communicator,
    model: &dyn Model,
    params: &Params,
    train: &dyn Dataset,
    eval: &dyn Dataset,
    output: &Path,
    mut on_round: impl FnMut(usize),
) -> Result<Option<FederatedReport>> {
    let f = spec
        .federated
        .as_ref()
        .ok_or_else(|| Error::Spec("train.strategy = \"federated\" without [federated]".into()))?;
    let t = &spec.train;
    let (rank, world) = (comm.rank(), comm.size());
    let classes = train.info().classes;
    let labels: Vec<u32> = (0..train.len())
        .map(|i| match train.get(i).map(|s| s.label) {
            Ok(shoal_data::Label::Class(c)) => Ok(c),
            Ok(_) => Err(Error::Spec("federated partitions need a classification dataset (a class a sample)".into())),
            Err(e) => Err(e.into()),
        })
        .collect::<Result<_>>()?;
    let how = match f.partition {
        FedPartition::Iid => Cut::Iid,
        FedPartition::Dirichlet => Cut::Dirichlet(f.alpha()),
        FedPartition::Shards => Cut::Shards(f.shards_per_client()),
    };
    let parts = cut(&labels, classes, f.clients, how, t.seed)?;
    let histogram = shoal_data::clients::histogram(&parts, &labels, classes);
    let dp = f.dp;
    let q = f.per_round() as f64 / f.clients as f64;
    let sigma = match dp {
        Some(d) => Some(match (d.noise_multiplier, d.epsilon) {
            (Some(s), _) => s,
            (None, Some(e)) => dp::sigma_for(e, q, f.rounds as u64, d.delta()).ok_or_else(|| {
                Error::Spec(format!(
                    "federated.dp.epsilon: no noise multiplier up to 1000 keeps ε within {e} over {} rounds",
                    f.rounds
                ))
            })?,
            (None, None) => return Err(Error::Spec("federated.dp: give noise_multiplier or epsilon".into())),
        }),
        None => None,
    };
    if rank == 0 {
        eprintln!(
            "federated: {} clients ({:?} partition), {} a round, {} rounds, {} in {world} process(es){}",
            f.clients,
            f.partition,
            f.per_round(),
            f.rounds,
            f.algorithm.as_str(),
            sigma.map_or_else(String::new, |s| format!(", DP σ = {s:.3}"))
        );
    }
    // Every process starts from rank 0's initial model.
    let mut w = flat(params)?;
    comm.broadcast(&mut w, 0)?;
    let (mut m, mut v) = (vec![0.0 as Real; w.len()], vec![0.0 as Real; w.len()]);
    let mut metrics = match rank {
        0 => {
            let path = metrics_file(output, 0);
            Some(std::fs::File::create(&path).map_err(|e| Error::io(format!("creating {}", path.display()), e))?)
        }
        _ => None,
    };
    let mut rounds = Vec::with_capacity(f.rounds);
    let mean_samples = (train.len() as f64 / f.clients as f64).max(1.0) as Real;
    for round in 0..f.rounds {
        let started = Instant::now();
        let bytes_before = comm.bytes_sent();
        let sampled = sample(f, round, t.seed, dp.is_some());
        let dropped = dropouts(f, round, t.seed, sampled.len());
        // Under secure aggregation: this process's clients' keys, every client's public key and key shares.
        let secure = match f.secure_aggregation {
            true => Some(Secure::agree(comm, &sampled, rank, world)?),
            false => None,
        };
        // [weighted update sum…, weight, loss sum, clients]
        let mut sum = vec![0.0 as Real; w.len() + 3];
        let mut masked_sum: Vec<i32> = match &secure {
            Some(_) => vec![0; w.len() + 3],
            None => Vec::new(),
        };
        for (i, &c) in sampled.iter().enumerate() {
            if i % world != rank || parts[c].is_empty() || dropped.contains(&i) {
                continue;
            }
            let (mut update, loss) = train_client(spec, f, model, params, train, &parts[c], &w, round, c)?;
            let weight = match dp {
                Some(d) => {
                    let scale = (d.clip / norm(&update).max(1e-12)).min(1.0) as Real;
                    update.iter_mut().for_each(|u| *u *= scale);
                    if let (true, Some(s)) = (d.local, sigma) {
                        let mut g = SplitMix64::from_key(&[t.seed, round as u64, c as u64, 0x1dd9]);
                        update.iter_mut().for_each(|u| *u += (g.normal() * s * d.clip) as Real);
                    }
                    1.0
                }
                // Samples against the mean client's: about 1, so a round's sum stays in secure aggregation's range.
                None => parts[c].len() as Real / mean_samples,
            };
            let mut mine: Vec<Real> = update.iter().map(|u| weight * u).collect();
            mine.extend([weight, loss as Real, 1.0]);
            match &secure {
                Some(s) => {
                    // The server is given this client's masked vector only.
                    // `Real` is f64 in an `f64` build: the fixed point takes f32 either way.
                    #[allow(clippy::unnecessary_cast)]
                    let plain: Vec<f32> = mine.iter().map(|v| *v as f32).collect();
                    let y = s.masked(i, &plain)?;
                    masked_sum.iter_mut().zip(y).for_each(|(a, b)| *a = a.wrapping_add(b));
                }
                None => sum.iter_mut().zip(&mine).for_each(|(a, b)| *a += b),
            }
        }
        match &secure {
            Some(s) => {
                comm.all_reduce(&mut masked_sum, ReduceOp::Sum)?;
                s.unmask(&mut masked_sum, &dropped)?;
                #[allow(clippy::unnecessary_cast)]
                let unmasked: Vec<Real> =
                    crate::secagg::dequantize(&masked_sum).into_iter().map(|v| v as Real).collect();
                sum = unmasked;
            }
            None => comm.all_reduce(&mut sum, ReduceOp::Sum)?,
        }
        let n = w.len();
        let (weight, loss, clients) = (sum[n], f64::from(sum[n + 1]), sum[n + 2].round());
        sum.truncate(n);
        let mut delta = sum;
        match (dp, sigma) {
            (Some(d), Some(s)) => {
                if !d.local {
                    // The server's noise on the sum, from the round's seed: the same draw in every process.
                    let mut g = SplitMix64::from_key(&[t.seed, round as u64, 0x5e4e]);
                    delta.iter_mut().for_each(|x| *x += (g.normal() * s * d.clip) as Real);
                }
                let denom = f.per_round() as Real;
                delta.iter_mut().for_each(|x| *x /= denom);
            }
            _ if weight > 0.0 => delta.iter_mut().for_each(|x| *x /= weight),
            _ => {}
        }
        let lr = f.server_lr() as Real;
        match f.algorithm {
            FedAlgorithm::Fedavg | FedAlgorithm::Fedprox => {
                w.iter_mut().zip(&delta).for_each(|(wi, d)| *wi += lr * d);
            }
            FedAlgorithm::Fedadam => {
                let (b1, b2, tau) = (0.9 as Real, 0.99 as Real, 1e-3 as Real);
                for ((wi, d), (mi, vi)) in w.iter_mut().zip(&delta).zip(m.iter_mut().zip(v.iter_mut())) {
                    *mi = b1 * *mi + (1.0 - b1) * d;
                    *vi = b2 * *vi + (1.0 - b2) * d * d;
                    *wi += lr * *mi / (vi.sqrt() + tau);
                }
            }
        }
        load(params, &w)?;
        let epsilon = match (dp, sigma) {
            (Some(d), Some(s)) => Some(dp::epsilon(q, s, round as u64 + 1, d.delta()).0),
            _ => None,
        };
        on_round(round + 1);
        if rank != 0 {
            continue;
        }
        let (eval_loss, eval_accuracy) = evaluate(model, eval, 256)?;
        let r = RoundReport {
            round: round + 1,
            clients: clients as usize,
            loss: loss / f64::from(clients.max(1.0)),
            eval_loss,
            eval_accuracy,
            bytes: comm.bytes_sent().saturating_sub(bytes_before),
            epsilon,
        };
        if let Some(file) = metrics.as_mut() {
            let line = serde_json::json!({
                "step": r.round, "loss": r.loss, "eval_loss": r.eval_loss, "eval_accuracy": r.eval_accuracy,
                "clients": r.clients, "round_bytes": r.bytes, "epsilon": r.epsilon, "rank": 0,
                "step_s": started.elapsed().as_secs_f64(), "samples": weight,
            });
            writeln!(file, "{line}").map_err(|e| Error::io("writing metrics.jsonl", e))?;
        }
        if t.log_every > 0 && ((round + 1) % t.log_every == 0 || round + 1 == f.rounds) {
            eprintln!(
                "round {:>4}/{} clients {:>3} loss {:.4} eval accuracy {:.4}{}",
                round + 1,
                f.rounds,
                r.clients,
                r.loss,
                eval_accuracy,
                epsilon.map_or_else(String::new, |e| format!(" ε {e:.3}"))
            );
        }
        rounds.push(r);
    }
    comm.barrier()?;
    if rank != 0 {
        return Ok(None);
    }
    Ok(Some(FederatedReport {
        algorithm: f.algorithm.as_str().into(),
        clients: f.clients,
        clients_per_round: f.per_round(),
        partition: format!("{:?}", f.partition).to_lowercase(),
        epsilon: rounds.last().and_then(|r| r.epsilon),
        rounds,
        noise_multiplier: sigma,
        delta: dp.map(|d| d.delta()),
        histogram,
    }))
}

/// Runs the federated job as this process's part of the pool; rank 0 writes and returns the summary.
pub(super) fn train(
    spec: &JobSpec,
    setup: &super::setup::Setup,
    params: &Params,
    output: &Path,
    beat: Option<&super::heartbeat::Beat>,
    started: Instant,
) -> Result<Option<super::wire::Summary>> {
    if let Some(b) = beat {
        b.phase(super::heartbeat::Phase::Train);
    }
    std::fs::create_dir_all(output).map_err(|e| Error::io(format!("creating {}", output.display()), e))?;
    let report =
        run(spec, &setup.comm, setup.model.as_ref(), params, setup.train.as_ref(), setup.eval.as_ref(), output, |r| {
            if let Some(b) = beat {
                b.step(r as u64);
            }
        })?;
    let Some(report) = report else { return Ok(None) };
    // The global model the rounds ended with.
    let named: std::collections::HashMap<String, Tensor> =
        params.vars().iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    let path = output.join("model.safetensors");
    candle_core::safetensors::save(&named, &path).map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))?;
    let last = report.rounds.last();
    let t = &spec.train;
    let bytes = setup.comm.bytes_sent();
    let model = format!("{:?}", t.model.kind).to_lowercase();
    let bare = super::wire::Summary::bare(
        &spec.name,
        &model,
        &t.dataset,
        setup.world,
        crate::spec::Strategy::Federated,
        started.elapsed().as_secs_f64(),
    );
    let summary = super::wire::Summary {
        parameters: params.full_count(),
        steps: report.rounds.len(),
        final_loss: last.map(|r| r.loss).filter(|l| l.is_finite()),
        eval_loss: last.map_or(f64::NAN, |r| r.eval_loss),
        eval_accuracy: last.map(|r| r.eval_accuracy),
        comm_bytes: bytes,
        comm_bytes_per_step: bytes as f64 / report.rounds.len().max(1) as f64,
        federated: Some(report),
        ..bare
    };
    super::report::write_json(&output.join("summary.json"), &summary)?;
    Ok(Some(summary))
}

/// The indices (into the round's sampled clients) of those that drop out this round (`federated.dropout`).
fn dropouts(f: &FederatedSpec, round: usize, seed: u64, sampled: usize) -> Vec<usize> {
    let k = (f.dropout.unwrap_or(0.0) * sampled as f64).floor() as usize;
    first_of_permutation(sampled, k, &[seed, round as u64, 0xd40f])
}

/// A round's secure aggregation as this process sees it: its clients' keys, and every client's public key and
/// key shares (in a deployment each share would reach its holder encrypted; here they cross between the pool's
/// processes, which stand for the clients).
struct Secure {
    keys: std::collections::HashMap<usize, crate::secagg::Keys>,
    publics: Vec<[u8; 32]>,
    shares: Vec<Vec<[u64; 5]>>,
}

impl Secure {
    /// Draws the keys of this process's clients (client `i` of the round in process `i mod world`) and exchanges
    /// the public keys and the shares.
    fn agree(comm: &Communicator, sampled: &[usize], rank: usize, world: usize) -> Result<Secure> {
        let n = sampled.len();
        let mut keys = std::collections::HashMap::new();
        let mut publics = vec![0i32; n * 8];
        let mut shares = vec![0i64; n * n * 5];
        for i in (0..n).filter(|i| i % world == rank) {
            let k = crate::secagg::Keys::generate();
            for (b, chunk) in k.public.chunks(4).enumerate() {
                publics[i * 8 + b] = i32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            }
            for (j, s) in crate::secagg::share(&k, n).iter().enumerate() {
                for (c, v) in s.iter().enumerate() {
                    shares[(i * n + j) * 5 + c] = *v as i64;
                }
            }
            keys.insert(i, k);
        }
        // Every slot is one process's: the sum gathers them.
        comm.all_reduce(&mut publics, ReduceOp::Sum)?;
        comm.all_reduce(&mut shares, ReduceOp::Sum)?;
        let publics = (0..n)
            .map(|i| {
                let mut p = [0u8; 32];
                for b in 0..8 {
                    p[b * 4..b * 4 + 4].copy_from_slice(&publics[i * 8 + b].to_le_bytes());
                }
                p
            })
            .collect();
        let shares = (0..n)
            .map(|i| (0..n).map(|j| std::array::from_fn(|c| shares[(i * n + j) * 5 + c] as u64)).collect())
            .collect();
        Ok(Secure { keys, publics, shares })
    }

    fn masked(&self, i: usize, plain: &[f32]) -> Result<Vec<i32>> {
        let k = self.keys.get(&i).ok_or_else(|| Error::InvalidArgument(format!("no keys for client {i}")))?;
        Ok(crate::secagg::masked(k, i, &self.publics, plain))
    }

    fn unmask(&self, sum: &mut [i32], dropped: &[usize]) -> Result<()> {
        crate::secagg::unmask(sum, &self.publics, dropped, &self.shares)
    }
}
