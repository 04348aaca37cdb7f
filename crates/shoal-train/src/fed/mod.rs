//! Federated learning (`train.strategy = "federated"`): the pieces every way of running it shares — a client's
//! local training on its own samples ([`Local`]), what it does to its update under differential privacy
//! ([`privatize`]), the round's sample of clients ([`sample`]), and the server's combination of a round's updates
//! into the next global model ([`Global`]).
//!
//! Two ways run them, one code path:
//! - **simulation** (`shoal-train`'s worker, `worker::federated`): the job's worker processes are a bounded pool
//!   that the `federated.clients` clients take turns in, and together play the server;
//! - **deployment** (`federated.listen`): the job's one process is the server of remote clients over HTTPS
//!   ([`hub`]), and each client is `shoal fed client` on its own machine and data ([`client`]).
//!
//! Invariants:
//! - A client's data never leaves the process that trains it: only its update does (clipped, and noised under
//!   local DP, before it leaves).
//! - Every draw (the sampled clients, a client's local order, the server's noise) comes from a key of the job's
//!   seed and the round, so a simulation is the same run after run.
//! - The server's step is [`Global::step`] whichever way the updates came: a weighted sum (the mean, or its secure
//!   or private forms), or the updates one by one for a robust rule.

mod board;
pub mod client;
pub mod hub;
mod secure;

use candle_core::{Device, Tensor};
use shoal_data::Dataset;
use shoal_data::rng::SplitMix64;

use crate::Real;
use crate::batch::to_tensors;
use crate::dp;
use crate::error::{Error, Result};
use crate::models::Model;
use crate::params::Params;
use crate::spec::{DpSpec, FedAlgorithm, FedPartition, FederatedSpec, JobSpec};
use shoal_data::clients::{Cut, cut};

/// The model's parameters as one flat buffer, in registration order.
pub fn flat(params: &Params) -> Result<Vec<Real>> {
    let mut out = Vec::with_capacity(params.full_count());
    for (_, v) in params.vars() {
        out.extend(v.as_tensor().flatten_all()?.to_vec1::<Real>()?);
    }
    Ok(out)
}

/// Sets the model's parameters from a flat buffer (refused when its length is not the model's).
pub fn load(params: &Params, w: &[Real]) -> Result<()> {
    if w.len() != params.full_count() {
        return Err(Error::InvalidArgument(format!(
            "a model of {} parameters given {} values",
            params.full_count(),
            w.len()
        )));
    }
    let mut at = 0;
    for (_, v) in params.vars() {
        let n = v.elem_count();
        v.set(&Tensor::from_slice(&w[at..at + n], v.shape(), &Device::Cpu)?)?;
        at += n;
    }
    Ok(())
}

/// The round's sampled clients among `pool` (sorted), the same in every process: `clients_per_round` of them
/// without replacement, or under DP each with probability `clients_per_round / clients` (Poisson sampling, as the
/// accountant assumes).
pub fn sample(f: &FederatedSpec, round: usize, seed: u64, pool: &[usize]) -> Vec<usize> {
    let key = [seed, round as u64, 0xfed];
    let mut chosen: Vec<usize> = if f.dp.is_some() {
        let mut g = SplitMix64::from_key(&key);
        let q = f.per_round() as f64 / f.clients as f64;
        pool.iter().copied().filter(|_| g.unit_f64() < q).collect()
    } else {
        let mut order = shoal_data::rng::permutation(pool.len(), &key);
        order.truncate(f.per_round().min(pool.len()));
        order.into_iter().map(|k| pool[k]).collect()
    };
    chosen.sort_unstable();
    chosen
}

/// The first `k` of a seeded permutation of `0..n`, sorted.
pub(crate) fn first_of_permutation(n: usize, k: usize, key: &[u64]) -> Vec<usize> {
    let mut chosen = shoal_data::rng::permutation(n, key);
    chosen.truncate(k.min(n));
    chosen.sort_unstable();
    chosen
}

/// Mean loss and accuracy of the model on `data`, in batches of `batch`.
pub fn evaluate(model: &dyn Model, data: &dyn Dataset, batch: usize) -> Result<(f64, f64)> {
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

/// The noise multiplier σ of `[federated.dp]`: given, or the smallest that keeps ε within the target over the
/// job's rounds. `None` without DP.
pub fn sigma(f: &FederatedSpec) -> Result<Option<f64>> {
    let Some(d) = f.dp else { return Ok(None) };
    let q = f.per_round() as f64 / f.clients as f64;
    match (d.noise_multiplier, d.epsilon) {
        (Some(s), _) => Ok(Some(s)),
        (None, Some(e)) => dp::sigma_for(e, q, f.rounds as u64, d.delta()).map(Some).ok_or_else(|| {
            Error::Spec(format!(
                "federated.dp.epsilon: no noise multiplier up to 1000 keeps ε within {e} over {} rounds",
                f.rounds
            ))
        }),
        (None, None) => Err(Error::Spec("federated.dp: give noise_multiplier or epsilon".into())),
    }
}

/// ε spent after `rounds` rounds under `[federated.dp]` with noise multiplier `sigma`.
pub fn epsilon_after(f: &FederatedSpec, sigma: f64, rounds: usize) -> Option<f64> {
    let d = f.dp?;
    let q = f.per_round() as f64 / f.clients as f64;
    Some(dp::epsilon(q, sigma, rounds as u64, d.delta()).0)
}

/// Every training sample's class (federated partitions cut by label).
pub fn labels(train: &dyn Dataset) -> Result<Vec<u32>> {
    (0..train.len())
        .map(|i| match train.get(i).map(|s| s.label) {
            Ok(shoal_data::Label::Class(c)) => Ok(c),
            Ok(_) => Err(Error::Spec("federated partitions need a classification dataset (a class a sample)".into())),
            Err(e) => Err(e.into()),
        })
        .collect()
}

/// The job's partition of the training samples among its clients: each client's sample indices.
pub fn partition(f: &FederatedSpec, labels: &[u32], classes: usize, seed: u64) -> Result<Vec<Vec<usize>>> {
    let how = match f.partition {
        FedPartition::Iid => Cut::Iid,
        FedPartition::Dirichlet => Cut::Dirichlet(f.alpha()),
        FedPartition::Shards => Cut::Shards(f.shards_per_client()),
    };
    Ok(cut(labels, classes, f.clients, how, seed)?)
}

pub(crate) fn norm(x: &[Real]) -> f64 {
    x.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>().sqrt()
}

/// A client's local training: the job's model and optimizer on the client's own samples.
pub struct Local<'a> {
    pub spec: &'a JobSpec,
    pub model: &'a dyn Model,
    pub params: &'a Params,
    pub data: &'a dyn Dataset,
}

impl std::fmt::Debug for Local<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local").field("job", &self.spec.name).field("samples", &self.data.len()).finish_non_exhaustive()
    }
}

impl Local<'_> {
    /// Trains from the global `w` on the samples `mine` of `data`: `local_steps` (or `local_epochs`) of the job's
    /// optimizer with `global_batch` as the local batch (FedProx adds `mu · (w − w_global)` to the gradient).
    /// Returns the update `w_local − w` and the mean loss.
    pub fn train(&self, mine: &[usize], w: &[Real], round: usize, client: usize) -> Result<(Vec<Real>, f64)> {
        let (spec, params) = (self.spec, self.params);
        let f = spec.federated.as_ref().ok_or_else(|| Error::Spec("no [federated] table".into()))?;
        if mine.is_empty() {
            return Err(Error::InvalidArgument(format!("client {client} holds no samples")));
        }
        let t = &spec.train;
        let batch = t.global_batch.min(mine.len()).max(1);
        let steps = match (f.local_steps, f.local_epochs) {
            (_, Some(e)) => e * mine.len().div_ceil(batch),
            (Some(s), None) => s,
            (None, None) => 10,
        };
        let cfg = crate::worker::setup::optimizer_config(spec);
        let mut local = w.to_vec();
        let (mut m, mut v) = (Vec::new(), Vec::new());
        let order: Vec<usize> =
            shoal_data::rng::permutation(mine.len(), &[t.seed, round as u64, client as u64, 0x10ca1])
                .into_iter()
                .map(|k| mine[k])
                .collect();
        let mu = if f.algorithm == FedAlgorithm::Fedprox { f.mu() } else { 0.0 };
        let mut loss_sum = 0f64;
        for step in 0..steps {
            load(params, &local)?;
            let start = (step * batch) % order.len();
            let samples: Vec<_> = (0..batch)
                .map(|k| self.data.get(order[(start + k) % order.len()]))
                .collect::<shoal_data::Result<_>>()?;
            let x = to_tensors(&samples)?.ok_or_else(|| Error::InvalidArgument("an empty local batch".into()))?;
            let loss = self.model.loss(&self.model.forward(&x.input)?, &x.target)?;
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
            shoal_ps::optim::update_flat(cfg, step as u64 + 1, t.lr, &mut local, &g, &mut m, &mut v, step == 0)?;
        }
        let update: Vec<Real> = local.iter().zip(w).map(|(l, g)| l - g).collect();
        Ok((update, loss_sum / steps.max(1) as f64))
    }
}

/// Under `[federated.dp]`, what a client does to its update before it leaves: clipped to `clip`, and under local
/// DP noised with `σ·clip` from the client's and round's own seed.
pub fn privatize(update: &mut [Real], dp: Option<DpSpec>, sigma: Option<f64>, seed: u64, round: usize, client: usize) {
    let Some(d) = dp else { return };
    let scale = (d.clip / norm(update).max(1e-12)).min(1.0) as Real;
    update.iter_mut().for_each(|u| *u *= scale);
    if let (true, Some(s)) = (d.local, sigma) {
        let mut g = SplitMix64::from_key(&[seed, round as u64, client as u64, 0x1dd9]);
        update.iter_mut().for_each(|u| *u += (g.normal() * s * d.clip) as Real);
    }
}

/// How a round's updates reach the server's step.
#[derive(Debug)]
pub enum Combined<'a> {
    /// The sum of the weighted updates and the sum of the weights (the mean's numerator and denominator; under DP
    /// the sum of the clipped updates, each of weight 1).
    Sum { sum: Vec<Real>, weight: Real },
    /// Each update on its own, for `[robust]`'s rule bearing `f` attackers.
    Each { updates: Vec<&'a [Real]>, rule: shoal_ps::Rule, f: usize },
}

/// The server's side: the global model and its optimizer's state.
#[derive(Debug)]
pub struct Global {
    pub w: Vec<Real>,
    m: Vec<Real>,
    v: Vec<Real>,
    spec: FederatedSpec,
    sigma: Option<f64>,
    seed: u64,
}

impl Global {
    pub fn new(w: Vec<Real>, spec: &FederatedSpec, sigma: Option<f64>, seed: u64) -> Global {
        let n = w.len();
        Global { w, m: vec![0.0; n], v: vec![0.0; n], spec: spec.clone(), sigma, seed }
    }

    /// Whether the updates are private (`[federated.dp]`): each then counts once.
    pub fn private(&self) -> bool {
        self.spec.dp.is_some()
    }

    /// The round's combined update applied: under central DP the server's noise `σ·clip` on the sum from the
    /// round's seed (the same draw in every process), divided by the expected number of clients; else the
    /// weighted mean (or the robust rule's choice). Then FedAvg and FedProx step `w += server_lr · Δ`, FedAdam an
    /// Adam step on `−Δ` (Reddi et al.'s adaptivity τ = 1e-3). A round with nothing to combine leaves `w`.
    pub fn step(&mut self, combined: Combined<'_>, round: usize) -> Result<()> {
        let n = self.w.len();
        let delta = match combined {
            Combined::Sum { mut sum, weight } => {
                if sum.len() != n {
                    return Err(Error::InvalidArgument(format!("a sum of {} values for {n} parameters", sum.len())));
                }
                match (self.spec.dp, self.sigma) {
                    (Some(d), Some(s)) => {
                        if !d.local {
                            let mut g = SplitMix64::from_key(&[self.seed, round as u64, 0x5e4e]);
                            sum.iter_mut().for_each(|x| *x += (g.normal() * s * d.clip) as Real);
                        }
                        let denom = self.spec.per_round() as Real;
                        sum.iter_mut().for_each(|x| *x /= denom);
                    }
                    _ if weight > 0.0 => sum.iter_mut().for_each(|x| *x /= weight),
                    _ => return Ok(()),
                }
                sum
            }
            Combined::Each { updates, rule, f } => {
                if updates.is_empty() {
                    return Ok(());
                }
                // A round short of the clients the rule needs to bear `f` bears fewer (or takes the mean).
                let k = updates.len();
                let (rule, f) = match (0..=f).rev().find(|&g| k >= rule.least_workers(g)) {
                    Some(g) => (rule, g),
                    None => (shoal_ps::Rule::Mean, 0),
                };
                let mut out = vec![0.0 as Real; n];
                shoal_ps::robust::aggregate(rule, f, &updates, &mut out)?;
                out
            }
        };
        let lr = self.spec.server_lr() as Real;
        match self.spec.algorithm {
            FedAlgorithm::Fedavg | FedAlgorithm::Fedprox => {
                self.w.iter_mut().zip(&delta).for_each(|(wi, d)| *wi += lr * d);
            }
            FedAlgorithm::Fedadam => {
                let (b1, b2, tau) = (0.9 as Real, 0.99 as Real, 1e-3 as Real);
                for ((wi, d), (mi, vi)) in self.w.iter_mut().zip(&delta).zip(self.m.iter_mut().zip(self.v.iter_mut())) {
                    *mi = b1 * *mi + (1.0 - b1) * d;
                    *vi = b2 * *vi + (1.0 - b2) * d * d;
                    *wi += lr * *mi / (vi.sqrt() + tau);
                }
            }
        }
        Ok(())
    }
}

/// The server's record of the rounds: each round's line in `metrics.jsonl` (`step` is the round) and on stderr
/// every `train.log_every` rounds, and the rounds for `summary.json`.
#[derive(Debug)]
pub struct Recorder {
    file: std::fs::File,
    rounds: Vec<crate::worker::wire::RoundReport>,
    total: usize,
    log_every: usize,
}

impl Recorder {
    /// Creates `metrics.jsonl` (rank 0's) under `output`.
    pub fn create(output: &std::path::Path, f: &FederatedSpec, log_every: usize) -> Result<Recorder> {
        std::fs::create_dir_all(output).map_err(|e| Error::io(format!("creating {}", output.display()), e))?;
        let path = crate::worker::wire::metrics_file(output, 0);
        let file = std::fs::File::create(&path).map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        Ok(Recorder { file, rounds: Vec::with_capacity(f.rounds), total: f.rounds, log_every })
    }

    /// Records a round that took `took` and combined `samples` samples' worth of updates.
    pub fn round(
        &mut self,
        r: crate::worker::wire::RoundReport,
        took: std::time::Duration,
        samples: f64,
    ) -> Result<()> {
        use std::io::Write;
        let line = serde_json::json!({
            "step": r.round, "loss": r.loss, "eval_loss": r.eval_loss, "eval_accuracy": r.eval_accuracy,
            "clients": r.clients, "sampled": r.sampled, "dropped": r.dropped, "late": r.late,
            "round_bytes": r.bytes, "epsilon": r.epsilon, "rank": 0, "step_s": took.as_secs_f64(), "samples": samples,
        });
        writeln!(self.file, "{line}").map_err(|e| Error::io("writing metrics.jsonl", e))?;
        if self.log_every > 0 && (r.round.is_multiple_of(self.log_every) || r.round == self.total) {
            let missing = match (r.dropped, r.late) {
                (0, 0) => String::new(),
                (d, l) => format!(" ({d} dropped, {l} late)"),
            };
            eprintln!(
                "round {:>4}/{} clients {:>3}/{}{missing} loss {:.4} eval accuracy {:.4}{}",
                r.round,
                self.total,
                r.clients,
                r.sampled,
                r.loss,
                r.eval_accuracy,
                r.epsilon.map_or_else(String::new, |e| format!(" ε {e:.3}"))
            );
        }
        self.rounds.push(r);
        Ok(())
    }

    pub fn rounds(self) -> Vec<crate::worker::wire::RoundReport> {
        self.rounds
    }
}

/// Prints each client's label histogram (`shoal run --verbose`): its samples, then its count of each class.
pub fn print_histogram(histogram: &[Vec<usize>]) {
    let classes = histogram.first().map_or(0, Vec::len);
    let head: String = (0..classes).map(|c| format!(" {c:>5}")).collect();
    eprintln!("client samples{head}");
    for (i, h) in histogram.iter().enumerate() {
        let row: String = h.iter().map(|n| format!(" {n:>5}")).collect();
        eprintln!("{i:>6} {:>7}{row}", h.iter().sum::<usize>());
    }
}
