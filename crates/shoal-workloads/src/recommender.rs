//! A DLRM-like recommender trained through the parameter servers: a user and an item embedding table, and a small
//! network on top of `[e_user, e_item, e_user ⊙ e_item, dense features]` giving the logit of a click. The tables are
//! the model's bulk (a million user rows and more) and a batch touches a few hundred of their rows, so a worker
//! pushes the gradients of the rows its batch touched and pulls the rows its next batch will read — with the top
//! network whole — and the servers update those rows alone (their lazy update). The held-out AUC is compared with
//! the planted model's ([`crate::clicks`]), the best any model can reach.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use shoal_data::rng::SplitMix64;
use shoal_ps::ShardPlan;
use shoal_ps::net::{Client, Part};
use shoal_ps::shard::Span;

use crate::clicks::{Click, ClickConfig, Clicks, DENSE, Split, auc, sigmoid};
use crate::error::{Error, Result};
use crate::nn::{Dense, Layout};

/// The recommender's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RecConfig {
    pub clicks: ClickConfig,
    /// Embedding width and the top network's hidden width.
    pub dim: usize,
    pub hidden: usize,
    /// Impressions per worker and step.
    pub batch: usize,
    /// Steps each worker takes.
    pub steps: usize,
    /// The servers' AdamW learning rate.
    pub lr: f64,
    /// Held-out impressions the AUC is measured on.
    pub eval: usize,
}

impl Default for RecConfig {
    fn default() -> Self {
        RecConfig {
            clicks: ClickConfig::default(),
            dim: 16,
            hidden: 32,
            batch: 512,
            steps: 6000,
            lr: 0.007,
            eval: 50_000,
        }
    }
}

/// The network, laid out for the servers: `user_emb`, `item_emb`, then the top network.
#[derive(Debug, Clone)]
pub struct Recommender {
    pub layout: Layout,
    dim: usize,
    users: usize,
    items: usize,
    user: usize,
    item: usize,
    /// Where the top network starts, and its layers relative to there.
    top: usize,
    l0: Dense,
    l1: Dense,
}

/// One batch's gradients: those of the rows it touched (sorted ids, a row of `dim` values each) and of the whole
/// top network.
#[derive(Debug, Clone, Default)]
pub struct Grads {
    pub users: Vec<u32>,
    pub items: Vec<u32>,
    /// `users`' rows, then `items`' rows, then the top network: the order of the flat parameters.
    pub values: Vec<f32>,
}

impl Recommender {
    pub fn new(cfg: &RecConfig) -> Result<Recommender> {
        if cfg.dim == 0 || cfg.hidden == 0 || cfg.batch == 0 {
            return Err(Error::InvalidArgument("recommender: dim, hidden and batch must be at least 1".into()));
        }
        let c = &cfg.clicks;
        let mut layout = Layout::default();
        let user = layout.add("user_emb", c.users, cfg.dim);
        let item = layout.add("item_emb", c.items, cfg.dim);
        let top = layout.len();
        let rel = |d: Dense| Dense { w: d.w - top, b: d.b - top, ..d };
        let l0 = rel(layout.dense("top.0", 3 * cfg.dim + DENSE, cfg.hidden));
        let l1 = rel(layout.dense("top.1", cfg.hidden, 1));
        Ok(Recommender { layout, dim: cfg.dim, users: c.users, items: c.items, user, item, top, l0, l1 })
    }

    /// Values of the top network.
    pub fn top_len(&self) -> usize {
        self.layout.len() - self.top
    }

    /// Seeded starting values: embeddings uniform in ±0.05, the top network as PyTorch would.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut p = vec![0f32; self.layout.len()];
        let mut rng = SplitMix64::from_key(&[seed, 0xE4B]);
        for x in &mut p[..self.top] {
            *x = ((rng.unit_f64() * 2.0 - 1.0) * 0.05) as f32;
        }
        self.l0.init(&mut p[self.top..], &mut rng);
        self.l1.init(&mut p[self.top..], &mut rng);
        p
    }

    fn width(&self) -> usize {
        3 * self.dim + DENSE
    }

    fn check(&self, c: &Click) -> Result<()> {
        if c.user as usize >= self.users || c.item as usize >= self.items {
            return Err(Error::InvalidArgument(format!(
                "impression of user {} and item {} outside the tables ({} users, {} items)",
                c.user, c.item, self.users, self.items
            )));
        }
        Ok(())
    }

    fn rows<'a>(&self, p: &'a [f32], c: &Click) -> (&'a [f32], &'a [f32]) {
        let d = self.dim;
        let (u, i) = (self.user + c.user as usize * d, self.item + c.item as usize * d);
        (&p[u..u + d], &p[i..i + d])
    }

    /// The top network's input for `batch` (one row of [`Self::width`] values each), its hidden layer after the
    /// ReLU, and the logits.
    fn forward(&self, p: &[f32], batch: &[Click]) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (d, w) = (self.dim, self.width());
        let mut z = vec![0f32; batch.len() * w];
        for (c, zr) in batch.iter().zip(z.chunks_exact_mut(w)) {
            self.check(c)?;
            let (eu, ei) = self.rows(p, c);
            zr[..d].copy_from_slice(eu);
            zr[d..2 * d].copy_from_slice(ei);
            zr[2 * d..3 * d].iter_mut().zip(eu.iter().zip(ei)).for_each(|(z, (a, b))| *z = a * b);
            zr[3 * d..].copy_from_slice(&c.dense);
        }
        let top = &p[self.top..];
        let mut h = vec![0f32; batch.len() * self.l0.out];
        self.l0.forward(top, &z, &mut h);
        h.iter_mut().for_each(|x| *x = x.max(0.0));
        let mut logits = vec![0f32; batch.len()];
        self.l1.forward(top, &h, &mut logits);
        Ok((z, h, logits))
    }

    /// The click logits of `batch`.
    pub fn logits(&self, p: &[f32], batch: &[Click]) -> Result<Vec<f32>> {
        Ok(self.forward(p, batch)?.2)
    }

    /// The batch's mean binary cross-entropy and its gradients, of the touched rows only.
    pub fn loss_and_grads(&self, p: &[f32], batch: &[Click]) -> Result<(f32, Grads)> {
        self.loss_and_grads_of(p, batch, touched(batch))
    }

    /// [`Self::loss_and_grads`] given the ids the batch touches ([`touched`]), found already.
    pub fn loss_and_grads_of(&self, p: &[f32], batch: &[Click], ids: (Vec<u32>, Vec<u32>)) -> Result<(f32, Grads)> {
        let (d, w, n) = (self.dim, self.width(), batch.len());
        let (z, h, logits) = self.forward(p, batch)?;
        let mut loss = 0f64;
        let dl: Vec<f32> = batch
            .iter()
            .zip(&logits)
            .map(|(c, &l)| {
                let (l64, y) = (f64::from(l), f64::from(u8::from(c.clicked)));
                loss += l64.max(0.0) - l64 * y + (-l64.abs()).exp().ln_1p();
                ((sigmoid(l64) - y) / n as f64) as f32
            })
            .collect();
        let top = &p[self.top..];
        let mut gtop = vec![0f32; self.top_len()];
        let mut dh = vec![0f32; h.len()];
        self.l1.backward(top, &h, &dl, &mut gtop, Some(&mut dh));
        dh.iter_mut().zip(&h).for_each(|(g, &h)| *g = if h > 0.0 { *g } else { 0.0 });
        let mut dz = vec![0f32; z.len()];
        self.l0.backward(top, &z, &dh, &mut gtop, Some(&mut dz));
        let (users, items) = ids;
        let mut values = vec![0f32; (users.len() + items.len()) * d];
        let (gu, rest) = values.split_at_mut(users.len() * d);
        for (c, dzr) in batch.iter().zip(dz.chunks_exact(w)) {
            let (eu, ei) = self.rows(p, c);
            let (a, b) = (users.binary_search(&c.user), items.binary_search(&c.item));
            let (Ok(a), Ok(b)) = (a, b) else { continue };
            let (du, dv) = (&mut gu[a * d..(a + 1) * d], &mut rest[b * d..(b + 1) * d]);
            for k in 0..d {
                du[k] += dzr[k] + dzr[2 * d + k] * ei[k];
                dv[k] += dzr[d + k] + dzr[2 * d + k] * eu[k];
            }
        }
        values.extend_from_slice(&gtop);
        Ok(((loss / n as f64) as f32, Grads { users, items, values }))
    }

    /// The runs of the flat parameters a batch touching `users` and `items` (sorted) reads: their rows, then the
    /// top network whole.
    pub fn runs(&self, users: &[u32], items: &[u32]) -> Vec<(usize, usize)> {
        let d = self.dim;
        let mut runs: Vec<(usize, usize)> = users.iter().map(|&u| (self.user + u as usize * d, d)).collect();
        runs.extend(items.iter().map(|&i| (self.item + i as usize * d, d)));
        runs.push((self.top, self.top_len()));
        runs
    }
}

/// The ids a batch touches, sorted and without repeats.
pub fn touched(batch: &[Click]) -> (Vec<u32>, Vec<u32>) {
    let mut users: Vec<u32> = batch.iter().map(|c| c.user).collect();
    let mut items: Vec<u32> = batch.iter().map(|c| c.item).collect();
    users.sort_unstable();
    users.dedup();
    items.sort_unstable();
    items.dedup();
    (users, items)
}

/// What one worker did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerReport {
    pub worker: usize,
    pub steps: usize,
    pub samples: u64,
    pub seconds: f64,
    /// Mean training loss over the first and the last tenth of the steps.
    pub loss_first: f64,
    pub loss_last: f64,
    /// Bytes pushed and pulled over the whole run (values and span tables; the first full pull of the starting
    /// values and the last one of the trained model included in `pull_bytes`).
    pub push_bytes: u64,
    pub pull_bytes: u64,
    /// The size of the embedding rows the batches touched, summed over the steps: what a sparse push must move.
    pub touched_bytes: u64,
    /// The size of the top network's values, summed over the steps: pushed whole every step.
    pub top_bytes: u64,
    /// The whole model's size: what a dense push would move every step.
    pub model_bytes: u64,
}

/// The servers' spans and the runs' values for each server; a server no run reaches gets one empty span, so that
/// every worker still takes part in each of its synchronous rounds.
fn routed(plan: &ShardPlan, runs: &[(usize, usize)]) -> Result<Vec<(Vec<Span>, std::ops::Range<usize>)>> {
    let mut out = plan.route(runs)?;
    for (spans, range) in &mut out {
        if spans.is_empty() {
            spans.push(Span { start: 0, len: 0 });
            *range = 0..0;
        }
    }
    Ok(out)
}

/// Cuts `buf` into consecutive parts of the lengths given (the servers' ranges of it, which follow one another).
fn split_lens(buf: &mut [f32], lens: impl Iterator<Item = usize>) -> Vec<&mut [f32]> {
    let mut rest = buf;
    lens.map(|n| {
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(n);
        rest = tail;
        mine
    })
    .collect()
}

/// Writes pulled values (the runs' values one after another) into the flat parameters.
fn scatter(p: &mut [f32], runs: &[(usize, usize)], pulled: &[f32]) {
    let mut at = 0;
    for &(start, len) in runs {
        p[start..start + len].copy_from_slice(&pulled[at..at + len]);
        at += len;
    }
}

/// Trains as worker `worker` of `workers` through `client`: gives the servers the seeded starting values (the
/// first worker's are taken, every worker's are the same), then for each step computes the gradients of its batch
/// on the rows it pulled, pushes them and pulls the rows of its next batch; the last step pulls the whole model,
/// which is returned with the report.
pub fn train(client: &mut Client, cfg: &RecConfig, worker: usize, workers: usize) -> Result<(WorkerReport, Vec<f32>)> {
    let model = Recommender::new(cfg)?;
    let clicks = Clicks::new(cfg.clicks)?;
    let plan = ShardPlan::new(&model.layout.tensors, client.servers())?;
    let cuts = plan.cuts();
    let mut p = model.init(cfg.clicks.seed);
    let inits: Vec<[&[f32]; 3]> = cuts.iter().map(|r| [&p[r.clone()], &[][..], &[][..]]).collect();
    client.init(false, 0, &inits)?;
    // The servers hold the first worker's values, which are these: pull them in case another run's are there.
    let all: Vec<Part<'_>> = split_lens(&mut p, cuts.iter().map(|r| r.len()))
        .into_iter()
        .map(|v| Part { push: None, push_spans: &[], pull: Some(v), pull_spans: &[] })
        .collect();
    client.exchange(cfg.lr, all)?;
    let batch_of = |step: usize| -> Vec<Click> {
        let first = ((step * workers + worker) * cfg.batch) as u64;
        (first..first + cfg.batch as u64).map(|i| clicks.get(Split::Train, i)).collect()
    };
    let (push0, pull0) = (client.bytes_pushed, client.bytes_pulled);
    let mut report = WorkerReport {
        worker,
        steps: cfg.steps,
        model_bytes: model.layout.len() as u64 * 4,
        pull_bytes: pull0,
        ..WorkerReport::default()
    };
    let tenth = (cfg.steps / 10).max(1);
    let (mut first, mut last) = (Vec::new(), Vec::new());
    let start = Instant::now();
    // The batch, the ids it touches, and their runs and routes: found once, for its pull and then its push.
    let mut batch = batch_of(0);
    let mut ids = touched(&batch);
    let mut push_routes = routed(&plan, &model.runs(&ids.0, &ids.1))?;
    let mut pulled = Vec::new();
    for step in 0..cfg.steps {
        let (loss, grads) = model.loss_and_grads_of(&p, &batch, ids)?;
        if step < tenth {
            first.push(f64::from(loss));
        }
        if step + tenth >= cfg.steps {
            last.push(f64::from(loss));
        }
        report.samples += batch.len() as u64;
        report.touched_bytes += ((grads.users.len() + grads.items.len()) * cfg.dim * 4) as u64;
        report.top_bytes += model.top_len() as u64 * 4;
        let final_step = step + 1 == cfg.steps;
        if final_step {
            // Push, then pull the whole model.
            let parts = push_routes
                .iter()
                .zip(split_lens(&mut p, cuts.iter().map(|r| r.len())))
                .map(|((spans, r), v)| Part {
                    push: Some(&grads.values[r.clone()]),
                    push_spans: spans,
                    pull: Some(v),
                    pull_spans: &[],
                })
                .collect();
            client.exchange(cfg.lr, parts)?;
            break;
        }
        let next = batch_of(step + 1);
        let next_ids = touched(&next);
        let pull_runs = model.runs(&next_ids.0, &next_ids.1);
        let pull_routes = routed(&plan, &pull_runs)?;
        pulled.clear();
        pulled.resize(pull_runs.iter().map(|r| r.1).sum(), 0.0);
        let outs = split_lens(&mut pulled, pull_routes.iter().map(|r| r.1.len()));
        let parts = push_routes
            .iter()
            .zip(&pull_routes)
            .zip(outs)
            .map(|(((push_spans, pr), (pull_spans, _)), out)| Part {
                push: Some(&grads.values[pr.clone()]),
                push_spans,
                pull: Some(out),
                pull_spans,
            })
            .collect();
        client.exchange(cfg.lr, parts)?;
        scatter(&mut p, &pull_runs, &pulled);
        (batch, ids, push_routes) = (next, next_ids, pull_routes);
        if step % 500 == 0 {
            tracing::debug!(worker, step, loss, "recommender step");
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    report.push_bytes = client.bytes_pushed - push0;
    report.pull_bytes += client.bytes_pulled - pull0;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    report.loss_first = mean(&first);
    report.loss_last = mean(&last);
    Ok((report, p))
}

/// The held-out figures of a trained model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Eval {
    pub impressions: usize,
    /// The model's AUC, and the planted model's on the same impressions.
    pub auc: f64,
    pub planted_auc: f64,
    /// Mean binary cross-entropy of the model, and of the planted probabilities.
    pub loss: f64,
    pub planted_loss: f64,
}

/// Measures `p` on the first `cfg.eval` held-out impressions.
pub fn evaluate(cfg: &RecConfig, p: &[f32]) -> Result<Eval> {
    let model = Recommender::new(cfg)?;
    let clicks = Clicks::new(cfg.clicks)?;
    if p.len() != model.layout.len() {
        return Err(Error::InvalidArgument(format!(
            "a recommender of {} values evaluated with {}",
            model.layout.len(),
            p.len()
        )));
    }
    let held: Vec<Click> = (0..cfg.eval as u64).map(|i| clicks.get(Split::Eval, i)).collect();
    let mut scores = Vec::with_capacity(held.len());
    for chunk in held.chunks(4096) {
        scores.extend(model.logits(p, chunk)?.into_iter().map(|l| sigmoid(f64::from(l))));
    }
    let labels: Vec<bool> = held.iter().map(|c| c.clicked).collect();
    let planted: Vec<f64> = held.iter().map(|c| c.p).collect();
    let bce = |ps: &[f64]| {
        ps.iter()
            .zip(&labels)
            .map(|(&q, &y)| -(if y { q.max(1e-12).ln() } else { (1.0 - q).max(1e-12).ln() }))
            .sum::<f64>()
            / ps.len().max(1) as f64
    };
    let none = || Error::InvalidArgument("the held-out impressions hold one class only".into());
    Ok(Eval {
        impressions: held.len(),
        auc: auc(&scores, &labels).ok_or_else(none)?,
        planted_auc: auc(&planted, &labels).ok_or_else(none)?,
        loss: bce(&scores),
        planted_loss: bce(&planted),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> RecConfig {
        RecConfig {
            clicks: ClickConfig { users: 50, items: 20, ..ClickConfig::default() },
            dim: 3,
            hidden: 5,
            batch: 6,
            ..RecConfig::default()
        }
    }

    /// The sparse gradients against central differences of the loss, through every parameter a batch reaches.
    #[test]
    fn gradients_match_finite_differences() -> Result<()> {
        let cfg = small();
        let model = Recommender::new(&cfg)?;
        let clicks = Clicks::new(cfg.clicks)?;
        let batch: Vec<Click> = (0..cfg.batch as u64).map(|i| clicks.get(Split::Train, i)).collect();
        let p = model.init(3);
        let (_, g) = model.loss_and_grads(&p, &batch)?;
        let runs = model.runs(&g.users, &g.items);
        assert_eq!(runs.iter().map(|r| r.1).sum::<usize>(), g.values.len());
        let loss = |p: &[f32]| model.loss_and_grads(p, &batch).map(|(l, _)| f64::from(l));
        let mut at = 0;
        for &(start, len) in &runs {
            for k in start..start + len {
                let (mut a, mut b) = (p.clone(), p.clone());
                a[k] += 1e-3;
                b[k] -= 1e-3;
                let fd = (loss(&a)? - loss(&b)?) / 2e-3;
                let got = f64::from(g.values[at]);
                assert!((fd - got).abs() < 2e-3 + 0.02 * fd.abs(), "value {k}: {fd} vs {got}");
                at += 1;
            }
        }
        // A row no impression touched has no gradient: it is not in the runs at all.
        let untouched = (0..50u32).find(|u| g.users.binary_search(u).is_err()).unwrap_or(0);
        let (mut a, mut b) = (p.clone(), p.clone());
        a[untouched as usize * 3] += 1e-2;
        b[untouched as usize * 3] -= 1e-2;
        assert_eq!(loss(&a)?, loss(&b)?);
        Ok(())
    }

    #[test]
    fn buffers_split_along_the_routes() -> Result<()> {
        let layout = [shoal_ps::Tensor { name: "t".into(), len: 40, row: 4 }];
        let plan = ShardPlan::new(&layout, 2)?;
        let runs = [(4, 4), (36, 4)];
        let routes = routed(&plan, &runs)?;
        let mut buf: Vec<f32> = (0..8).map(|x| x as f32).collect();
        let parts = split_lens(&mut buf, routes.iter().map(|r| r.1.len()));
        assert_eq!(
            parts.iter().map(|p| p.to_vec()).collect::<Vec<_>>(),
            vec![vec![0., 1., 2., 3.], vec![4., 5., 6., 7.]]
        );
        // A server no run reaches still gets an (empty) span.
        let routes = routed(&plan, &[(0, 4)])?;
        assert_eq!(routes[1], (vec![Span { start: 0, len: 0 }], 0..0));
        let mut p = vec![0f32; 40];
        scatter(&mut p, &runs, &buf);
        assert_eq!(&p[4..8], &[0., 1., 2., 3.]);
        assert_eq!(&p[36..40], &[4., 5., 6., 7.]);
        Ok(())
    }
}
