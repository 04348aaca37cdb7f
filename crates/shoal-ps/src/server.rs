//! A server's part of the model and how pushes become updates, without the network: a [`Shard`] holds its values,
//! their optimizer state and their version (updates applied); a [`Round`] gathers the synchronous mode's pushes for
//! one version and combines them by a robust rule; [`Clocks`] keeps the bounded-staleness mode's promise that no
//! worker runs more than `staleness` steps ahead of the slowest.
//!
//! Modes: `sync` — every worker's gradient for version `t` before version `t + 1` ([`Round`]); `async` — each push
//! applied on arrival ([`Shard::apply`]); `ssp` — applied on arrival, a worker waiting while it is more than
//! `staleness` steps ahead ([`Clocks::may_start`]).

use crate::attack::Attack;
use crate::error::{PsError, Result};
use crate::optim::{OptimConfig, update, update_flat};
use crate::robust::{Rule, aggregate};
use crate::shard::Span;

/// How pushes become updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Sync,
    Async,
    Ssp { staleness: u64 },
}

impl Mode {
    /// How many steps a worker may run ahead of the slowest (unbounded outside `ssp`).
    pub fn staleness(self) -> u64 {
        match self {
            Mode::Ssp { staleness } => staleness,
            _ => u64::MAX / 4,
        }
    }
}

/// A server's shard as saved: its values and optimizer state, its version, the workers' clocks, and the workers'
/// step it was taken at.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub server: usize,
    pub servers: usize,
    pub step: u64,
    pub version: u64,
    pub values: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub clocks: Vec<u64>,
}

/// One server's values, with the optimizer's state for them and how many updates they have had.
#[derive(Debug, Clone, PartialEq)]
pub struct Shard {
    pub values: Vec<f32>,
    cfg: OptimConfig,
    m: Vec<f32>,
    v: Vec<f32>,
    /// Updates applied: the version a pull returns.
    pub version: u64,
}

impl Shard {
    /// A shard starting from `values` (version 0), updated by `cfg`.
    pub fn new(values: Vec<f32>, cfg: OptimConfig) -> Shard {
        Shard { values, cfg, m: Vec::new(), v: Vec::new(), version: 0 }
    }

    /// A shard resuming at `version` with its optimizer state (`m`, `v`: empty, or as long as `values`).
    pub fn with_state(values: Vec<f32>, cfg: OptimConfig, m: Vec<f32>, v: Vec<f32>, version: u64) -> Result<Shard> {
        for (name, s) in [("m", &m), ("v", &v)] {
            if !s.is_empty() && s.len() != values.len() {
                return Err(PsError::InvalidArgument(format!(
                    "optimizer state {name} has {} values, the shard {}",
                    s.len(),
                    values.len()
                )));
            }
        }
        Ok(Shard { values, cfg, m, v, version })
    }

    /// The optimizer's state: `m` and `v` (empty until an update needs them).
    pub fn moments(&self) -> (&[f32], &[f32]) {
        (&self.m, &self.v)
    }

    /// The optimizer this shard is updated by.
    pub fn config(&self) -> OptimConfig {
        self.cfg
    }

    /// Applies one update to the values of `spans` only (rows of an embedding table a batch touched: the others,
    /// and their optimizer state, stay as they are — a "lazy" update), from `grad`, the spans' gradients one after
    /// another. Spans must be in order, apart, and inside the shard. Returns the new version.
    pub fn apply_spans(&mut self, spans: &[Span], grad: &[f32], lr: f64) -> Result<u64> {
        let n = self.values.len();
        check_spans(spans, n)?;
        let total: usize = spans.iter().map(|s| s.len as usize).sum();
        if total != grad.len() {
            return Err(PsError::InvalidArgument(format!(
                "a push of {} values for spans of {total} values",
                grad.len()
            )));
        }
        let (uses_m, uses_v) = match self.cfg {
            OptimConfig::Sgd { momentum, .. } => (momentum != 0.0, false),
            OptimConfig::AdamW { .. } => (true, true),
        };
        if uses_m {
            self.m.resize(n, 0.0);
        }
        if uses_v {
            self.v.resize(n, 0.0);
        }
        let t = self.version + 1;
        let mut at = 0;
        for s in spans {
            let r = s.start as usize..s.start as usize + s.len as usize;
            let g = &grad[at..at + r.len()];
            at += r.len();
            // A zero momentum buffer makes the first use's formula and the later one's agree.
            let m = uses_m.then(|| (&mut self.m[r.clone()], false));
            let v = uses_v.then(|| (&mut self.v[r.clone()], false));
            update(self.cfg, t, lr, &mut self.values[r], g, m, v)?;
        }
        self.version = t;
        Ok(t)
    }

    /// Applies one update from `grad` with learning rate `lr`: the formula every strategy applies
    /// ([`crate::optim::update`]), so a shard's values are what one process would hold. Returns the new version.
    pub fn apply(&mut self, grad: &[f32], lr: f64) -> Result<u64> {
        let n = self.values.len();
        if grad.len() != n {
            return Err(PsError::InvalidArgument(format!("a push of {} values to a shard of {n}", grad.len())));
        }
        let t = self.version + 1;
        update_flat(self.cfg, t, lr, &mut self.values, grad, &mut self.m, &mut self.v, self.version == 0)?;
        self.version = t;
        Ok(t)
    }
}

/// Refuses spans out of order, overlapping, or reaching past `n` values.
pub fn check_spans(spans: &[Span], n: usize) -> Result<()> {
    let mut end = 0u64;
    for s in spans {
        let stop = s.start.checked_add(u64::from(s.len)).filter(|&e| e <= n as u64);
        match stop {
            Some(stop) if s.start >= end => end = stop,
            _ => {
                return Err(PsError::InvalidArgument(format!(
                    "span {}..+{} is out of order, overlaps the one before, or reaches past the shard's {n} values",
                    s.start, s.len
                )));
            }
        }
    }
    Ok(())
}

/// One worker's push to a round: the spans it covers (empty: every value) and their gradients.
type Pushed = (Vec<Span>, Vec<f32>);

/// The synchronous mode's gathering of one version's pushes: one from each of `workers`, for the shard's current
/// version, combined by `rule` (bearing `f` attackers) once all are in, times `scale`.
#[derive(Debug)]
pub struct Round {
    rule: Rule,
    f: usize,
    version: u64,
    scale: f32,
    pushes: Vec<Option<Pushed>>,
    /// `[chaos]`: the workers whose pushes are forged, and how.
    attack: Option<(Attack, Vec<usize>)>,
}

impl Round {
    /// A round of `workers` pushes for `version`; refused when `rule` cannot bear `f` attackers among them.
    pub fn new(workers: usize, rule: Rule, f: usize, version: u64) -> Result<Round> {
        rule.check(workers, f)?;
        Ok(Round { rule, f, version, scale: 1.0, pushes: vec![None; workers], attack: None })
    }

    /// The combination multiplied by `scale` before it is applied (the number of workers, when each pushes its
    /// share of the global batch's gradient: the mean of the shares, times their number, is their sum).
    pub fn scaled(self, scale: f32) -> Round {
        Round { scale, ..self }
    }

    /// An experiment (`[chaos]`): the pushes of `liars` are replaced, once all are in, by what `attack` sends
    /// (seeded by the round's version, so every server forges alike).
    pub fn attacked(self, attack: Option<(Attack, Vec<usize>)>) -> Round {
        Round { attack, ..self }
    }

    /// The version this round gathers pushes for.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Takes `worker`'s push computed on `version`: refused when it is for another version or the worker pushed
    /// already. Returns whether the round is complete.
    pub fn push(&mut self, worker: usize, version: u64, grad: Vec<f32>) -> Result<bool> {
        self.push_spans(worker, version, Vec::new(), grad)
    }

    /// [`Round::push`] of the gradients of some spans only (a sparse push; empty `spans`: every value). A round
    /// with sparse pushes in it combines by the mean only (the robust rules compare whole gradients).
    pub fn push_spans(&mut self, worker: usize, version: u64, spans: Vec<Span>, grad: Vec<f32>) -> Result<bool> {
        if !spans.is_empty() && self.rule != Rule::Mean {
            return Err(PsError::InvalidArgument(format!(
                "worker {worker} pushed some rows only, but {} compares whole gradients: a sparse push needs the \
                 mean",
                self.rule.name()
            )));
        }
        let n = self.pushes.len();
        let Some(slot) = self.pushes.get_mut(worker) else {
            return Err(PsError::InvalidArgument(format!("worker {worker} of {n} pushed")));
        };
        if version != self.version {
            return Err(PsError::InvalidArgument(format!(
                "worker {worker} pushed a gradient of version {version} to a round for version {}",
                self.version
            )));
        }
        if slot.is_some() {
            return Err(PsError::InvalidArgument(format!("worker {worker} pushed twice for version {}", self.version)));
        }
        *slot = Some((spans, grad));
        Ok(self.pushes.iter().all(Option::is_some))
    }

    /// The workers whose push is still missing.
    pub fn missing(&self) -> Vec<usize> {
        self.pushes.iter().enumerate().filter(|(_, p)| p.is_none()).map(|(k, _)| k).collect()
    }

    /// Combines the complete round's pushes by the rule and applies them to `shard`; the next round is for the new
    /// version.
    pub fn finish(self, shard: &mut Shard, lr: f64) -> Result<u64> {
        if shard.version != self.version {
            return Err(PsError::InvalidArgument(format!(
                "a round for version {} finished on a shard at version {}",
                self.version, shard.version
            )));
        }
        let missing = self.missing();
        if !missing.is_empty() {
            return Err(PsError::InvalidArgument(format!("the round still waits for workers {missing:?}")));
        }
        let pushes: Vec<Pushed> = self.pushes.into_iter().flatten().collect();
        let n = shard.values.len();
        if pushes.iter().all(|(s, _)| s.is_empty()) {
            let mut combined = vec![0f32; n];
            match &self.attack {
                Some((attack, liars)) if n > 0 => {
                    let mut gathered: Vec<f32> = pushes.iter().flat_map(|(_, g)| g.iter().copied()).collect();
                    attack.apply(&mut gathered, n, liars, self.version)?;
                    let views: Vec<&[f32]> = gathered.chunks(n).collect();
                    aggregate(self.rule, self.f, &views, &mut combined)?;
                }
                _ => {
                    let views: Vec<&[f32]> = pushes.iter().map(|(_, g)| g.as_slice()).collect();
                    aggregate(self.rule, self.f, &views, &mut combined)?;
                }
            }
            if self.scale != 1.0 {
                combined.iter_mut().for_each(|x| *x *= self.scale);
            }
            return shard.apply(&combined, lr);
        }
        // Sparse: the mean over the workers of what each pushed (nothing pushed is a zero), on the rows any touched,
        // in time and memory of the rows touched, not of the shard.
        let full = [Span { start: 0, len: u32::try_from(n).unwrap_or(u32::MAX) }];
        let mut all: Vec<(Span, &[f32])> = Vec::new();
        for (spans, grad) in &pushes {
            let spans = if spans.is_empty() { &full[..] } else { &spans[..] };
            check_spans(spans, n)?;
            let mut at = 0;
            for s in spans {
                let g = grad.get(at..at + s.len as usize).ok_or_else(|| {
                    PsError::InvalidArgument(format!("a push of {} values is shorter than its spans", grad.len()))
                })?;
                at += s.len as usize;
                if s.len > 0 {
                    all.push((*s, g));
                }
            }
        }
        all.sort_by_key(|(s, _)| s.start);
        // The union of the spans, in order, and where each starts in the combined gradient.
        let mut union: Vec<(u64, u64, usize)> = Vec::new();
        let mut total = 0usize;
        for (s, _) in &all {
            let end = s.start + u64::from(s.len);
            match union.last_mut() {
                Some(u) if s.start <= u.1 => {
                    total += end.saturating_sub(u.1) as usize;
                    u.1 = u.1.max(end);
                }
                _ => {
                    union.push((s.start, end, total));
                    total += s.len as usize;
                }
            }
        }
        let mut grad = vec![0f32; total];
        for (s, g) in &all {
            let u = union[union.partition_point(|u| u.0 <= s.start) - 1];
            let at = u.2 + (s.start - u.0) as usize;
            grad[at..at + g.len()].iter_mut().zip(g.iter()).for_each(|(a, g)| *a += g);
        }
        let k = self.scale / pushes.len() as f32;
        grad.iter_mut().for_each(|g| *g *= k);
        let spans = union
            .iter()
            .map(|&(start, end, _)| {
                u32::try_from(end - start)
                    .map(|len| Span { start, len })
                    .map_err(|_| PsError::InvalidArgument(format!("a run of {} touched values", end - start)))
            })
            .collect::<Result<Vec<_>>>()?;
        shard.apply_spans(&spans, &grad, lr)
    }
}

/// Each worker's clock (steps it has pushed) in the bounded-staleness mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clocks {
    staleness: u64,
    clocks: Vec<u64>,
}

impl Clocks {
    /// `workers` at clock 0, none to run more than `staleness` steps ahead of the slowest.
    pub fn new(workers: usize, staleness: u64) -> Clocks {
        Clocks { staleness, clocks: vec![0; workers] }
    }

    /// Whether `worker` may start its next step now: its clock at most `staleness` ahead of the slowest.
    pub fn may_start(&self, worker: usize) -> bool {
        let slowest = self.clocks.iter().copied().min().unwrap_or(0);
        self.clocks.get(worker).is_some_and(|&c| c - slowest <= self.staleness)
    }

    /// `worker` finished a step.
    pub fn tick(&mut self, worker: usize) -> Result<u64> {
        let n = self.clocks.len();
        let c =
            self.clocks.get_mut(worker).ok_or_else(|| PsError::InvalidArgument(format!("worker {worker} of {n}")))?;
        *c += 1;
        Ok(*c)
    }

    /// The slowest worker's clock.
    pub fn slowest(&self) -> u64 {
        self.clocks.iter().copied().min().unwrap_or(0)
    }

    /// `worker` has finished: it holds no one back any more.
    pub fn retire(&mut self, worker: usize) {
        if let Some(c) = self.clocks.get_mut(worker) {
            *c = u64::MAX / 2;
        }
    }

    /// Each worker's clock.
    pub fn clocks(&self) -> &[u64] {
        &self.clocks
    }

    /// Sets the clocks (a restored server's).
    pub fn restore(&mut self, clocks: &[u64]) {
        for (c, &r) in self.clocks.iter_mut().zip(clocks) {
            *c = r;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::update;

    const ADAMW: OptimConfig = OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };

    /// Sparse pushes that overlap in part, leave gaps and include an empty span: the round updates the union of
    /// the rows pushed with the mean over the workers (a row one worker did not push counts as its zero), and
    /// leaves every other value and its moments alone.
    #[test]
    fn a_sparse_round_updates_the_union_of_the_rows_with_their_mean() -> Result<()> {
        let n = 20;
        let start: Vec<f32> = (0..n).map(|i| i as f32 * 0.1).collect();
        let mut shard = Shard::new(start.clone(), ADAMW);
        let mut round = Round::new(3, Rule::Mean, 0, 0)?;
        let sp = |start: u64, len: u32| Span { start, len };
        round.push_spans(0, 0, vec![sp(2, 3), sp(10, 2)], vec![1.0, 2.0, 3.0, 4.0, 5.0])?;
        round.push_spans(1, 0, vec![sp(3, 4)], vec![10.0, 20.0, 30.0, 40.0])?;
        round.push_spans(2, 0, vec![sp(0, 0), sp(11, 1)], vec![7.0])?;
        round.finish(&mut shard, 0.1)?;
        // The same update done densely with the mean gradient, on the touched values only.
        let mut dense = vec![0f32; n];
        for (i, g) in [(2, 1.0), (3, 2.0), (4, 3.0), (10, 4.0), (11, 5.0), (3, 10.0), (4, 20.0), (5, 30.0), (6, 40.0)] {
            dense[i] += g;
        }
        dense[11] += 7.0;
        let touched = [2usize, 3, 4, 5, 6, 10, 11];
        let mut want = Shard::new(start.clone(), ADAMW);
        let spans = [sp(2, 5), sp(10, 2)];
        let g: Vec<f32> = touched.iter().map(|&i| dense[i] * (1.0 / 3.0)).collect();
        want.apply_spans(&spans, &g, 0.1)?;
        assert_eq!(shard.values, want.values);
        assert_eq!(shard.moments(), want.moments());
        for i in (0..n).filter(|i| !touched.contains(i)) {
            assert_eq!(shard.values[i], start[i], "value {i} was not pushed");
        }
        assert_eq!(shard.version, 1);
        Ok(())
    }

    /// A synchronous round of the mean over the workers' gradients makes the update one process makes with the
    /// mean gradient, bit for bit, version after version.
    #[test]
    fn a_synchronous_round_of_the_mean_updates_as_one_process_does() -> Result<()> {
        let start = vec![0.5f32, -1.0, 2.0];
        let mut shard = Shard::new(start.clone(), ADAMW);
        let (mut p, mut m, mut v) = (start, vec![0f32; 3], vec![0f32; 3]);
        for step in 0..4u64 {
            let grads: Vec<Vec<f32>> = (0..3)
                .map(|w| (0..3).map(|j| ((w * 3 + j) as f32 - 4.0) * 0.1 + step as f32 * 0.01).collect())
                .collect();
            let mut round = Round::new(3, Rule::Mean, 0, shard.version)?;
            for (w, g) in grads.iter().enumerate() {
                let done = round.push(w, step, g.clone())?;
                assert_eq!(done, w == 2);
            }
            assert_eq!(round.finish(&mut shard, 0.01)?, step + 1);
            let mean: Vec<f32> =
                (0..3).map(|j| (grads.iter().map(|g| f64::from(g[j])).sum::<f64>() / 3.0) as f32).collect();
            update(ADAMW, step + 1, 0.01, &mut p, &mean, Some((&mut m, false)), Some((&mut v, false)))?;
            assert_eq!(shard.values, p);
        }
        Ok(())
    }

    #[test]
    fn a_round_refuses_stale_doubled_and_foreign_pushes_and_names_who_is_missing() -> Result<()> {
        let mut shard = Shard::new(vec![0.0; 2], OptimConfig::Sgd { momentum: 0.9, weight_decay: 0.0 });
        let mut round = Round::new(3, Rule::Median, 1, 0)?;
        assert!(round.push(0, 0, vec![1.0, 1.0])?.eq(&false));
        let stale = round.push(1, 7, vec![1.0, 1.0]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(stale.contains("worker 1 pushed a gradient of version 7 to a round for version 0"), "{stale}");
        assert!(round.push(0, 0, vec![2.0, 2.0]).is_err(), "twice");
        assert!(round.push(5, 0, vec![2.0, 2.0]).is_err(), "no worker 5");
        assert_eq!(round.missing(), vec![1, 2]);
        assert!(Round::new(3, Rule::Krum, 1, 0).is_err(), "Krum bears one attacker from 5 workers");
        round.push(1, 0, vec![3.0, 3.0])?;
        round.push(2, 0, vec![-100.0, 2.0])?;
        // The median of (1, 3, -100) and of (1, 3, 2): 1 and 2; SGD's first step moves by the gradient itself.
        assert_eq!(round.finish(&mut shard, 0.5)?, 1);
        assert_eq!(shard.values, vec![-0.5, -1.0]);
        assert!(shard.apply(&[1.0], 0.1).is_err(), "a push of the wrong size");
        Ok(())
    }

    /// `[chaos]` in a synchronous round: one sign-flipping worker of five drags the mean far from the honest update,
    /// and the median stays near it.
    #[test]
    fn an_attacked_round_moves_the_mean_and_not_the_median() -> Result<()> {
        let sgd = OptimConfig::Sgd { momentum: 0.0, weight_decay: 0.0 };
        let honest: Vec<Vec<f32>> = (0..5).map(|w| vec![1.0 + 0.01 * w as f32, -2.0 + 0.01 * w as f32]).collect();
        let flip = Some((Attack::SignFlip { scale: 10.0 }, vec![4]));
        let moved = |rule: Rule, f: usize, attack: Option<(Attack, Vec<usize>)>| -> Result<Vec<f32>> {
            let mut shard = Shard::new(vec![0.0, 0.0], sgd);
            let mut round = Round::new(5, rule, f, 0)?.attacked(attack);
            for (w, g) in honest.iter().enumerate() {
                round.push(w, 0, g.clone())?;
            }
            round.finish(&mut shard, 1.0)?;
            Ok(shard.values)
        };
        let clean = moved(Rule::Mean, 0, None)?;
        let mean = moved(Rule::Mean, 0, flip.clone())?;
        let median = moved(Rule::Median, 1, flip)?;
        assert!(mean[0] > 0.0 && mean[1] < 0.0, "the flipped mean steps uphill: {mean:?}");
        for (m, c) in median.iter().zip(&clean) {
            assert!((m - c).abs() < 0.05, "the median {median:?} against the clean mean {clean:?}");
        }
        Ok(())
    }

    /// Under bounded staleness no worker starts a step more than `staleness` ahead of the slowest.
    #[test]
    fn no_worker_runs_more_than_its_staleness_ahead() -> Result<()> {
        let mut c = Clocks::new(3, 2);
        // Worker 0 runs alone: it may do 2 steps ahead of the others (clocks 0), then waits.
        for _ in 0..2 {
            assert!(c.may_start(0));
            c.tick(0)?;
        }
        assert!(c.may_start(0));
        c.tick(0)?;
        assert!(!c.may_start(0), "3 ahead of the slowest");
        c.tick(1)?;
        assert!(!c.may_start(0), "worker 2 is still at 0");
        c.tick(2)?;
        assert!(c.may_start(0));
        assert_eq!(c.slowest(), 1);
        assert!(!c.may_start(7));
        assert!(c.tick(7).is_err());
        Ok(())
    }
}
