//! `train.strategy = "ps"`: the model lives on parameter servers (`shoal_ps::net`), spread over them by size
//! ([`plan`]: the parameters in order as one flat run, cut where the servers' shares end). A worker holds a copy of
//! the values it last pulled, computes its share of the global batch's gradient on it, pushes each server its
//! part, and pulls the new values — all servers at once, once a step. The servers hold the optimizer state and
//! apply the one update formula (`shoal_ps::optim`), so workers stay stateless; under `ps.mode = "sync"` the result
//! is data parallelism's, to rounding.
//!
//! The step's scalars (the loss, the stop and regroup votes) are summed over the workers under `sync`; under
//! `async` and `ssp` a worker does not wait for the others, so it takes its own, times the number of workers (its
//! estimate of their sum). Checkpoints hold whole tensors, as every strategy's: the values this worker holds, and
//! the servers' optimizer state pulled from them; at rank 0's checkpoints the servers also save their shards.

use crate::Real;
use crate::kernels::{as_f32, from_f32, with_f32_mut};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use shoal_comm::{Communicator, ReduceOp};
use shoal_ps::net::{Client, Part};
use shoal_ps::{Mode, ShardPlan};

use super::{GradSink, StepTimes, Strategy, TensorGrads, add_f32, check_order, copy_f32, flat_offsets};
use crate::error::{Error, Result};
use crate::optim::Optimizer;
use crate::params::Params;

/// The plan that spreads `params` over `servers` servers: the same on every worker and server.
pub fn plan(params: &Params, servers: usize) -> Result<ShardPlan> {
    let tensors: Vec<shoal_ps::Tensor> = params
        .vars()
        .iter()
        .map(|(name, v)| {
            let dims = v.dims();
            let row = dims.iter().skip(1).product::<usize>().max(1);
            shoal_ps::Tensor { name: name.clone(), len: v.elem_count(), row: if dims.len() > 1 { row } else { 1 } }
        })
        .collect();
    Ok(ShardPlan::new(&tensors, servers)?)
}

/// How a worker reaches the servers.
#[derive(Debug, Clone)]
pub struct PsConfig {
    /// Where each server listens, in order.
    pub addresses: Vec<String>,
    pub mode: Mode,
    /// The job secret.
    pub secret: Vec<u8>,
    /// The longest one exchange may take.
    pub timeout: Duration,
}

/// The parameter-server strategy of one worker.
pub struct Ps {
    comm: Option<Communicator>,
    client: std::sync::Mutex<Client>,
    mode: Mode,
    cuts: Vec<std::ops::Range<usize>>,
    offsets: Vec<usize>,
    /// This worker's copy of the values, as one flat run.
    flat: Vec<Real>,
    /// The step's gradient, as one flat run.
    grad: Vec<Real>,
    next: Option<usize>,
    scalars: Vec<Real>,
}

impl std::fmt::Debug for Ps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ps").field("client", &*self.client()).field("cuts", &self.cuts).finish_non_exhaustive()
    }
}

impl Ps {
    /// Worker `comm.rank()` of the job's workers (`comm`: theirs alone, without the servers), connected to the
    /// servers of `cfg` for the model `params`.
    pub fn new(comm: Option<Communicator>, params: &Params, cfg: PsConfig) -> Result<Ps> {
        let worker = comm.as_ref().map_or(0, Communicator::rank);
        let plan = plan(params, cfg.addresses.len())?;
        let client = Client::connect(cfg.addresses, worker, &cfg.secret, cfg.mode, cfg.timeout)?;
        let (offsets, total) = flat_offsets(params);
        Ok(Ps {
            comm,
            client: std::sync::Mutex::new(client),
            mode: cfg.mode,
            cuts: plan.cuts(),
            offsets,
            flat: vec![0.0; total],
            grad: vec![0.0; total],
            next: None,
            scalars: Vec::new(),
        })
    }

    fn client(&self) -> std::sync::MutexGuard<'_, Client> {
        self.client.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, Communicator::rank)
    }

    fn workers(&self) -> usize {
        self.comm.as_ref().map_or(1, Communicator::size)
    }

    /// Pulls every server's newest values into the parameters.
    fn pull(&mut self, params: &Params) -> Result<()> {
        let client = self.client.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        with_f32_mut(&mut self.flat, |flat| {
            let parts = split_mut(flat, &self.cuts).into_iter().map(|out| Part {
                push: None,
                push_spans: &[],
                pull: Some(out),
                pull_spans: &[],
            });
            client.exchange(0.0, parts.collect())
        })?;
        params.load_flat(&self.flat)
    }
}

/// `v` cut at `cuts` (which cover it in order).
fn split_mut<'a, T>(mut v: &'a mut [T], cuts: &[std::ops::Range<usize>]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(cuts.len());
    for r in cuts {
        let (a, b) = std::mem::take(&mut v).split_at_mut(r.len());
        out.push(a);
        v = b;
    }
    out
}

struct Sink<'a> {
    grad: &'a mut [Real],
    offsets: &'a [usize],
    next: &'a mut Option<usize>,
    scratch: Vec<Real>,
    scalars: &'a mut Vec<Real>,
}

impl GradSink for Sink<'_> {
    fn put(&mut self, index: usize, fill: &mut dyn FnMut(&mut [Real]) -> Result<()>) -> Result<()> {
        check_order(index, self.offsets.len(), *self.next)?;
        *self.next = index.checked_sub(1);
        let start = self.offsets[index];
        let end = self.offsets.get(index + 1).copied().unwrap_or(self.grad.len());
        self.scratch.clear();
        self.scratch.resize(end - start, 0.0);
        fill(&mut self.scratch)?;
        self.grad[start..end].iter_mut().zip(&self.scratch).for_each(|(g, x)| *g += x);
        Ok(())
    }

    fn attach_scalars(&mut self, values: &[Real]) {
        *self.scalars = values.to_vec();
    }
}

impl Strategy for Ps {
    fn name(&self) -> &'static str {
        "ps"
    }

    fn comm(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }

    /// Worker 0 gives the servers their starting values (kept by a server that holds values already); every
    /// worker then pulls them.
    fn init(&mut self, params: &Params) -> Result<()> {
        if self.rank() == 0 {
            let flat = params.flatten()?;
            let flat = as_f32(&flat);
            let parts: Vec<[&[f32]; 3]> = self.cuts.iter().map(|r| [&flat[r.clone()], &[][..], &[][..]]).collect();
            self.client().init(false, 0, &parts)?;
        }
        self.pull(params)
    }

    fn backward(
        &mut self,
        _params: &Params,
        last: bool,
        scalars: Vec<Real>,
        f: &mut dyn FnMut(&mut dyn GradSink) -> Result<()>,
    ) -> Result<()> {
        self.next = Some(self.offsets.len().saturating_sub(1));
        let mut sink = Sink {
            grad: &mut self.grad,
            offsets: &self.offsets,
            next: &mut self.next,
            scratch: Vec::new(),
            scalars: &mut self.scalars,
        };
        f(&mut sink)?;
        if last && !scalars.is_empty() {
            self.scalars = scalars;
        }
        Ok(())
    }

    fn backward_tensors(&mut self, _params: &Params, last: bool, scalars: Vec<Real>, grads: TensorGrads) -> Result<()> {
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let start = self.offsets[i];
            let end = self.offsets.get(i + 1).copied().unwrap_or(self.grad.len());
            add_f32(&mut self.grad[start..end], g)?;
        }
        if last && !scalars.is_empty() {
            self.scalars = scalars;
        }
        Ok(())
    }

    fn attach_step_scalars(&mut self, values: Vec<Real>) {
        self.scalars = values;
    }

    /// Pushes this worker's gradient to every server and pulls the new values (the servers apply the optimizer);
    /// clipping is refused by the spec, each server holding only its part of the gradient.
    fn step(&mut self, params: &Params, opt: &mut Optimizer, lr: f64, clip: Option<f64>) -> Result<StepTimes> {
        if clip.is_some() {
            return Err(Error::InvalidArgument(
                "the parameter servers each hold part of the gradient: clipping at its global norm is not available"
                    .into(),
            ));
        }
        let t0 = Instant::now();
        let mut scalars = std::mem::take(&mut self.scalars);
        match (self.mode, &self.comm) {
            (Mode::Sync, Some(c)) if c.size() > 1 && !scalars.is_empty() => {
                c.all_reduce(&mut scalars, ReduceOp::Sum)?
            }
            (Mode::Sync, _) => {}
            _ => {
                let w = self.workers() as Real;
                scalars.iter_mut().for_each(|x| *x *= w);
            }
        }
        let grad = as_f32(&self.grad);
        let pushes: Vec<&[f32]> = self.cuts.iter().map(|r| &grad[r.clone()]).collect();
        let client = self.client.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        with_f32_mut(&mut self.flat, |flat| {
            let parts = pushes
                .into_iter()
                .zip(split_mut(flat, &self.cuts))
                .map(|(g, out)| Part { push: Some(g), push_spans: &[], pull: Some(out), pull_spans: &[] })
                .collect();
            client.exchange(lr, parts)
        })?;
        drop(grad);
        params.load_flat(&self.flat)?;
        self.grad.iter_mut().for_each(|g| *g = 0.0);
        opt.t += 1;
        Ok(StepTimes { comm_s: t0.elapsed().as_secs_f64(), scalars, ..StepTimes::default() })
    }

    /// Tells the servers this worker has finished (they end once every worker has).
    fn finish(&mut self) -> Result<()> {
        Ok(self.client().done()?)
    }

    /// The gradients pushed to the servers.
    fn bytes_sent_elsewhere(&self) -> u64 {
        self.client().bytes_pushed
    }

    /// The optimizer state lives on the servers.
    fn optimizer_bytes(&self, _opt: &Optimizer) -> usize {
        0
    }

    /// The servers' optimizer state, pulled from them, as whole named tensors (`{parameter}.m`, `.v`); at rank 0's
    /// call the servers also save their shards, as of the optimizer's step.
    fn optimizer_state(&self, params: &Params, opt: &Optimizer) -> Result<Vec<(String, Tensor)>> {
        let mut client = self.client();
        if self.rank() == 0 {
            client.checkpoint(opt.t)?;
        }
        let state = client.state()?;
        drop(client);
        let flat = |k: usize| -> Vec<Real> {
            state
                .iter()
                .zip(&self.cuts)
                .flat_map(|(s, r)| {
                    let part = if k == 0 { &s.2 } else { &s.3 };
                    if part.is_empty() { vec![0.0; r.len()] } else { part.iter().map(|&v| from_f32(v)).collect() }
                })
                .collect()
        };
        let any = |k: usize| state.iter().any(|s| if k == 0 { !s.2.is_empty() } else { !s.3.is_empty() });
        let mut out = Vec::new();
        for (k, suffix) in [(0, "m"), (1, "v")] {
            if !any(k) {
                continue;
            }
            let all = flat(k);
            for (i, (name, var)) in params.vars().iter().enumerate() {
                let start = self.offsets[i];
                let values = all.get(start..start + var.elem_count()).ok_or_else(|| {
                    Error::InvalidArgument(format!("the servers' state is shorter than parameter {name}"))
                })?;
                out.push((format!("{name}.{suffix}"), Tensor::from_slice(values, var.shape(), var.device())?));
            }
        }
        super::in_optimizer_order(params, &mut out);
        Ok(out)
    }

    /// Gives the servers a checkpoint's optimizer state with this worker's values (worker 0; the others wait for
    /// it, then pull), replacing what they hold: the run goes on from the checkpoint, whichever strategy wrote it.
    fn load_optimizer_state(
        &mut self,
        params: &Params,
        opt: &mut Optimizer,
        t: u64,
        named: &std::collections::HashMap<String, Tensor>,
    ) -> Result<()> {
        opt.t = t;
        if self.rank() == 0 {
            let values = params.flatten()?;
            let mut moments = [Vec::new(), Vec::new()];
            for (k, suffix) in ["m", "v"].into_iter().enumerate() {
                if !params.vars().iter().any(|(n, _)| named.contains_key(&format!("{n}.{suffix}"))) {
                    continue;
                }
                let mut all = vec![0.0 as Real; values.len()];
                for (i, (name, var)) in params.vars().iter().enumerate() {
                    if let Some(x) = named.get(&format!("{name}.{suffix}")) {
                        if x.elem_count() != var.elem_count() {
                            return Err(Error::Checkpoint(format!(
                                "optimizer state {name}.{suffix} has {} values, the parameter {}",
                                x.elem_count(),
                                var.elem_count()
                            )));
                        }
                        let start = self.offsets[i];
                        copy_f32(&mut all[start..start + var.elem_count()], x)?;
                    }
                }
                moments[k] = all;
            }
            let values = as_f32(&values);
            let moments = moments.each_ref().map(|m| as_f32(m));
            let parts: Vec<[&[f32]; 3]> = self
                .cuts
                .iter()
                .map(|r| {
                    let [m, v] = &moments;
                    let m: &[f32] = if m.is_empty() { &[] } else { &m[r.clone()] };
                    let v: &[f32] = if v.is_empty() { &[] } else { &v[r.clone()] };
                    [&values[r.clone()], m, v]
                })
                .collect();
            self.client().init(true, t, &parts)?;
        }
        if let Some(c) = self.comm.as_ref().filter(|c| c.size() > 1) {
            c.barrier()?;
        }
        self.pull(params)
    }
}
