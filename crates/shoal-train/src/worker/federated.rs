//! Federated learning as the job's worker processes run it (`train.strategy = "federated"`): simulated clients
//! in a bounded pool of processes, or (`federated.listen`) rank 0 as the server of remote clients
//! (`crate::fed::hub`). Both take their local training, privacy and server step from `crate::fed`.
//!
//! In simulation, every round:
//! - the round's clients are drawn from the round's own seed (the same on every process, [`fed::sample`]);
//! - sampled client `i` runs in process `i mod N`: the global model in, its local training on its own samples
//!   only ([`fed::Local`]), its update out — clipped (and under local DP noised) by [`fed::privatize`];
//! - the updates are summed over the processes (weighted by the clients' samples; under DP unweighted), or under
//!   `[robust]` gathered one by one (with `[chaos]`'s attackers' replaced by their forgeries), and every process
//!   applies the same server step ([`fed::Global::step`]), so the global model never needs sending again;
//! - a client whose local training took longer than `federated.round_timeout` is late: dropped from the round;
//! - rank 0 evaluates the global model on the held-out data and records the round ([`fed::Recorder`]).
//!
//! A client's data stays in the process that trains it, for that round: only updates cross between processes.

use std::path::Path;
use std::time::Instant;

use candle_core::Tensor;
use shoal_comm::{Communicator, ReduceOp};
use shoal_data::Dataset;

use super::wire::{FederatedReport, RoundReport};
use crate::Real;
use crate::error::{Error, Result};
use crate::fed::{self, Combined, Global, Local};
use crate::models::Model;
use crate::params::Params;
use crate::spec::{FederatedSpec, JobSpec};

/// What the server's rule is (`[robust]`, or the mean).
fn rule_of(spec: &JobSpec) -> (shoal_ps::Rule, usize) {
    spec.robust.map_or((shoal_ps::Rule::Mean, 0), |r| (r.rule.rule(), r.f))
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
    let labels = fed::labels(train)?;
    let parts = fed::partition(f, &labels, classes, t.seed)?;
    let histogram = shoal_data::clients::histogram(&parts, &labels, classes);
    let sigma = fed::sigma(f)?;
    let (rule, tolerated) = rule_of(spec);
    let robust = spec.robust.is_some();
    let attack = spec.chaos.as_ref().and_then(|c| Some((c.attack()?, c.byzantine_clients.clone())));
    if rank == 0 {
        eprintln!(
            "federated: {} clients ({:?} partition), {} a round, {} rounds, {} in {world} process(es){}{}",
            f.clients,
            f.partition,
            f.per_round(),
            f.rounds,
            f.algorithm.as_str(),
            sigma.map_or_else(String::new, |s| format!(", DP σ = {s:.3}")),
            if robust { format!(", combined by {} (f = {tolerated})", rule.name()) } else { String::new() },
        );
        if std::env::var_os(shoal_comm::env::var::VERBOSE).is_some_and(|v| v == "1") {
            fed::print_histogram(&histogram);
        }
    }
    // Every process starts from rank 0's initial model.
    let mut w = fed::flat(params)?;
    comm.broadcast(&mut w, 0)?;
    let mut global = Global::new(w, f, sigma, t.seed);
    let mut recorder = match rank {
        0 => Some(fed::Recorder::create(output, f, t.log_every)?),
        _ => None,
    };
    let local = Local { spec, model, params, data: train };
    let mean_samples = (train.len() as f64 / f.clients as f64).max(1.0) as Real;
    let everyone: Vec<usize> = (0..f.clients).collect();
    let deadline = f.deadline();
    let n = global.w.len();
    for round in 0..f.rounds {
        let started = Instant::now();
        let bytes_before = comm.bytes_sent();
        let sampled = fed::sample(f, round, t.seed, &everyone);
        let dropped = dropouts(f, round, t.seed, sampled.len());
        // Under secure aggregation: this process's clients' keys, every client's public key and key shares.
        let secure = match f.secure_aggregation {
            true => Some(Secure::agree(comm, &sampled, rank, world)?),
            false => None,
        };
        // [weighted update sum…, weight, loss sum, clients]; under [robust] a row a sampled client, its update
        // unweighted and the same three after it.
        let rows = if robust { sampled.len() } else { 1 };
        let width = n + 3;
        let mut sum = vec![0.0 as Real; rows * width];
        let mut masked_sum: Vec<i32> = match &secure {
            Some(_) => vec![0; width],
            None => Vec::new(),
        };
        // 1 for each sampled client whose update missed the deadline.
        let mut late = vec![0.0 as Real; sampled.len()];
        for (i, &c) in sampled.iter().enumerate() {
            if i % world != rank || parts[c].is_empty() || dropped.contains(&i) {
                continue;
            }
            let began = Instant::now();
            let (mut update, loss) = local.train(&parts[c], &global.w, round, c)?;
            if deadline.is_some_and(|d| began.elapsed() > d) {
                // Its update would arrive after the round closed.
                late[i] = 1.0;
                continue;
            }
            fed::privatize(&mut update, f.dp, sigma, t.seed, round, c);
            let weight = match (f.dp, robust) {
                (Some(_), _) | (None, true) => 1.0,
                // Samples against the mean client's: about 1, so a round's sum stays in secure aggregation's range.
                (None, false) => parts[c].len() as Real / mean_samples,
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
                None => {
                    let row = if robust { i } else { 0 };
                    sum[row * width..(row + 1) * width].iter_mut().zip(&mine).for_each(|(a, b)| *a += b);
                }
            }
        }
        // Lateness needs a deadline: without one (the same in every process) nobody is late.
        if deadline.is_some() {
            comm.all_reduce(&mut late, ReduceOp::Sum)?;
        }
        let late: Vec<usize> = (0..sampled.len()).filter(|&i| late[i] > 0.5).collect();
        match &secure {
            Some(s) => {
                comm.all_reduce(&mut masked_sum, ReduceOp::Sum)?;
                // A late client's masks are removed like a dropped one's.
                let missing: Vec<usize> = dropped.iter().chain(&late).copied().collect();
                s.unmask(&mut masked_sum, &missing)?;
                #[allow(clippy::unnecessary_cast)]
                let unmasked = crate::secagg::dequantize(&masked_sum).into_iter().map(|v| v as Real).collect();
                sum = unmasked;
            }
            None => comm.all_reduce(&mut sum, ReduceOp::Sum)?,
        }
        // The tallies, summed over the rows.
        let tally = |k: usize| (0..rows).map(|r| f64::from(sum[r * width + n + k])).sum::<f64>();
        let (weight, loss, clients) = (tally(0), tally(1), tally(2).round());
        if robust {
            // The updates of the clients that sent one, in the round's order; the attackers' replaced by forgeries.
            let arrived: Vec<usize> = (0..rows).filter(|&r| sum[r * width + n + 2] > 0.5).collect();
            let mut gathered: Vec<Real> =
                arrived.iter().flat_map(|&r| sum[r * width..r * width + n].to_vec()).collect();
            if let Some((a, liars)) = &attack {
                let at: Vec<usize> =
                    arrived.iter().enumerate().filter(|(_, r)| liars.contains(&sampled[**r])).map(|(k, _)| k).collect();
                // An attack forges from the honest updates: a round of attackers only has none to forge from.
                if !at.is_empty() && at.len() < arrived.len() {
                    a.apply(&mut gathered, n, &at, t.seed ^ round as u64)?;
                }
            }
            let updates: Vec<&[Real]> = gathered.chunks(n.max(1)).collect();
            global.step(Combined::Each { updates, rule, f: tolerated }, round)?;
        } else {
            sum.truncate(n);
            global.step(Combined::Sum { sum, weight: weight as Real }, round)?;
        }
        fed::load(params, &global.w)?;
        on_round(round + 1);
        let Some(rec) = recorder.as_mut() else { continue };
        let (eval_loss, eval_accuracy) = fed::evaluate(model, eval, 256)?;
        let r = RoundReport {
            round: round + 1,
            clients: clients as usize,
            sampled: sampled.len(),
            dropped: dropped.len(),
            late: late.len(),
            loss: loss / clients.max(1.0),
            eval_loss,
            eval_accuracy,
            bytes: comm.bytes_sent().saturating_sub(bytes_before),
            epsilon: sigma.and_then(|s| fed::epsilon_after(f, s, round + 1)),
        };
        rec.round(r, started.elapsed(), weight)?;
    }
    comm.barrier()?;
    let Some(rec) = recorder else { return Ok(None) };
    let rounds = rec.rounds();
    Ok(Some(FederatedReport {
        algorithm: f.algorithm.as_str().into(),
        clients: f.clients,
        clients_per_round: f.per_round(),
        partition: format!("{:?}", f.partition).to_lowercase(),
        epsilon: rounds.last().and_then(|r| r.epsilon),
        rounds,
        noise_multiplier: sigma,
        delta: f.dp.map(|d| d.delta()),
        histogram,
        rule: rule.name().into(),
        remote: false,
    }))
}

/// Runs the federated job as this process's part of the pool — or, with `federated.listen`, as the server of
/// remote clients; rank 0 writes and returns the summary.
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
    let step = |r: usize| {
        if let Some(b) = beat {
            b.step(r as u64);
        }
    };
    let remote = spec.federated.as_ref().is_some_and(FederatedSpec::remote);
    let report = match remote {
        true => {
            let hub = crate::fed::hub::Hub::new(spec, setup.model.as_ref(), params, setup.eval.as_ref(), output)?;
            Some(hub.run(step)?)
        }
        false => run(
            spec,
            &setup.comm,
            setup.model.as_ref(),
            params,
            setup.train.as_ref(),
            setup.eval.as_ref(),
            output,
            step,
        )?,
    };
    let Some(report) = report else { return Ok(None) };
    // The global model the rounds ended with.
    let named: std::collections::HashMap<String, Tensor> =
        params.vars().iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    let path = output.join("model.safetensors");
    candle_core::safetensors::save(&named, &path).map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))?;
    let last = report.rounds.last();
    let t = &spec.train;
    let bytes = match remote {
        true => report.rounds.iter().map(|r| r.bytes).sum(),
        false => setup.comm.bytes_sent(),
    };
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
    fed::first_of_permutation(sampled, k, &[seed, round as u64, 0xd40f])
}

/// A round's secure aggregation as this process sees it: its clients' keys and self-mask seeds, and every
/// client's public key and shares of keys and seeds (in a deployment each share reaches its holder sealed, as the
/// hub relays them; here they cross between the pool's processes, which stand for the clients).
struct Secure {
    keys: std::collections::HashMap<usize, (crate::secagg::Keys, [u8; 32])>,
    publics: Vec<[u8; 32]>,
    key_shares: Vec<Vec<[u64; 5]>>,
    seed_shares: Vec<Vec<[u64; 5]>>,
}

impl Secure {
    /// Draws the keys and seeds of this process's clients (client `i` of the round in process `i mod world`) and
    /// exchanges the public keys and the shares.
    fn agree(comm: &Communicator, sampled: &[usize], rank: usize, world: usize) -> Result<Secure> {
        let n = sampled.len();
        let mut keys = std::collections::HashMap::new();
        let mut publics = vec![0i32; n * 8];
        // Every slot is one process's: the sum gathers them. Key shares, then seed shares.
        let mut shares = vec![0i64; 2 * n * n * 5];
        for i in (0..n).filter(|i| i % world == rank) {
            let k = crate::secagg::Keys::generate();
            let seed = crate::secagg::new_seed();
            for (b, chunk) in k.public.chunks(4).enumerate() {
                publics[i * 8 + b] = i32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            }
            for (half, cut) in [crate::secagg::share(&k, n), crate::secagg::share_bytes(&seed, n)].iter().enumerate() {
                for (j, s) in cut.iter().enumerate() {
                    for (c, v) in s.iter().enumerate() {
                        shares[half * n * n * 5 + (i * n + j) * 5 + c] = *v as i64;
                    }
                }
            }
            keys.insert(i, (k, seed));
        }
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
        let matrix = |half: usize| -> Vec<Vec<[u64; 5]>> {
            (0..n)
                .map(|i| {
                    (0..n)
                        .map(|j| std::array::from_fn(|c| shares[half * n * n * 5 + (i * n + j) * 5 + c] as u64))
                        .collect()
                })
                .collect()
        };
        Ok(Secure { keys, publics, key_shares: matrix(0), seed_shares: matrix(1) })
    }

    /// Client `i`'s masked vector: its pairwise masks and its self-mask on it.
    fn masked(&self, i: usize, plain: &[f32]) -> Result<Vec<i32>> {
        let (k, seed) = self.keys.get(&i).ok_or_else(|| Error::InvalidArgument(format!("no keys for client {i}")))?;
        let mut y = crate::secagg::masked(k, i, &self.publics, plain);
        crate::secagg::apply_self_mask(&mut y, seed, 1);
        Ok(y)
    }

    fn unmask(&self, sum: &mut [i32], dropped: &[usize]) -> Result<()> {
        crate::secagg::unmask(sum, &self.publics, dropped, &self.key_shares, &self.seed_shares)
    }
}
