//! Asynchronous advantage actor-critic (A3C, Mnih et al. 2016) on [`CartPole`], with the parameter servers as the
//! shared model: each actor pulls the newest policy and value networks, plays up to `t_max` steps, computes the
//! gradient of its rollout's loss (the policy's log-probability times the advantage over the n-step return, an
//! entropy bonus, the value's squared error) and pushes it; the servers apply each push as it arrives (the
//! asynchronous mode), so an actor never waits for another.
//!
//! Finished episodes go to an [`Episodes`] record shared by the actors, which says when the task is solved (a
//! mean reward of 195 over the last 100 episodes, whichever actor played them) and so when to stop.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use shoal_data::rng::SplitMix64;
use shoal_ps::net::{Client, Part};
use shoal_ps::{ShardPlan, Tensor};

use crate::cartpole::{CartPole, Outcome, SOLVED};
use crate::error::{Error, Result};
use crate::nn::{Dense, Layout};

/// The actors' settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct A3cConfig {
    pub hidden: usize,
    /// Steps of a rollout before its push (fewer when the episode ends).
    pub t_max: usize,
    pub gamma: f64,
    /// Weight of the entropy bonus and of the value's loss.
    pub entropy: f64,
    pub value: f64,
    /// The servers' AdamW learning rate.
    pub lr: f64,
    /// When an actor gives up unsolved.
    pub max_seconds: f64,
    pub seed: u64,
}

impl Default for A3cConfig {
    fn default() -> Self {
        A3cConfig {
            hidden: 64,
            t_max: 20,
            gamma: 0.99,
            entropy: 0.01,
            value: 0.5,
            lr: 0.003,
            max_seconds: 120.0,
            seed: 5,
        }
    }
}

/// The policy and value networks, one hidden layer each, laid out for the servers.
#[derive(Debug, Clone)]
pub struct Networks {
    pub layout: Layout,
    pi0: Dense,
    pi1: Dense,
    v0: Dense,
    v1: Dense,
}

impl Networks {
    pub fn new(hidden: usize) -> Result<Networks> {
        if hidden == 0 {
            return Err(Error::InvalidArgument("a3c: hidden must be at least 1".into()));
        }
        let mut layout = Layout::default();
        let pi0 = layout.dense("pi.0", 4, hidden);
        let pi1 = layout.dense("pi.1", hidden, 2);
        let v0 = layout.dense("v.0", 4, hidden);
        let v1 = layout.dense("v.1", hidden, 1);
        Ok(Networks { layout, pi0, pi1, v0, v1 })
    }

    pub fn tensors(&self) -> &[Tensor] {
        &self.layout.tensors
    }

    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut p = vec![0f32; self.layout.len()];
        let mut rng = SplitMix64::from_key(&[seed, 0xAC]);
        for d in [self.pi0, self.pi1, self.v0, self.v1] {
            d.init(&mut p, &mut rng);
        }
        p
    }

    /// Hidden activations (tanh) and outputs of a two-layer network for the rows of `x`.
    fn net(p: &[f32], l0: Dense, l1: Dense, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let rows = x.len() / l0.inp;
        let mut h = vec![0f32; rows * l0.out];
        l0.forward(p, x, &mut h);
        h.iter_mut().for_each(|v| *v = v.tanh());
        let mut y = vec![0f32; rows * l1.out];
        l1.forward(p, &h, &mut y);
        (h, y)
    }

    /// The probability of pushing right in state `obs`.
    pub fn p_right(&self, p: &[f32], obs: &[f32; 4]) -> f64 {
        let (_, l) = Self::net(p, self.pi0, self.pi1, obs);
        softmax2(l[0], l[1]).1
    }

    /// The value of the state `obs`.
    pub fn value(&self, p: &[f32], obs: &[f32; 4]) -> f64 {
        f64::from(Self::net(p, self.v0, self.v1, obs).1[0])
    }

    /// The rollout's loss and its gradient (laid out as the parameters): for each step, `−log π(a|s)·A −
    /// entropy·H(π(s)) + value·½(R − V(s))²` with `R` the discounted return to the rollout's end plus, unless the
    /// episode failed there, `γⁿ·V` of the state it ended in, and `A = R − V(s)`; averaged over the steps.
    pub fn loss_and_grads(&self, p: &[f32], cfg: &A3cConfig, roll: &Rollout) -> (f64, Vec<f32>) {
        let n = roll.actions.len();
        let mut g = vec![0f32; p.len()];
        if n == 0 {
            return (0.0, g);
        }
        let x: Vec<f32> = roll.states.iter().flatten().copied().collect();
        let (hp, logits) = Self::net(p, self.pi0, self.pi1, &x);
        let (hv, values) = Self::net(p, self.v0, self.v1, &x);
        let mut ret = roll.bootstrap;
        let mut returns = vec![0f64; n];
        for t in (0..n).rev() {
            ret = roll.rewards[t] + cfg.gamma * ret;
            returns[t] = ret;
        }
        let (mut loss, scale) = (0f64, 1.0 / n as f64);
        let mut dlogits = vec![0f32; 2 * n];
        let mut dvalues = vec![0f32; n];
        for t in 0..n {
            let (p0, p1) = softmax2(logits[2 * t], logits[2 * t + 1]);
            let probs = [p0, p1];
            let v = f64::from(values[t]);
            let adv = returns[t] - v;
            let a = usize::from(roll.actions[t]);
            let logs = probs.map(|q| q.max(1e-12).ln());
            let h = -(probs[0] * logs[0] + probs[1] * logs[1]);
            loss += scale * (-logs[a] * adv - cfg.entropy * h + cfg.value * 0.5 * adv * adv);
            for j in 0..2 {
                let onehot = if j == a { 1.0 } else { 0.0 };
                let d = (probs[j] - onehot) * adv + cfg.entropy * probs[j] * (logs[j] + h);
                dlogits[2 * t + j] = (scale * d) as f32;
            }
            dvalues[t] = (scale * cfg.value * (v - returns[t])) as f32;
        }
        for (l0, l1, h, dy) in [(self.pi0, self.pi1, &hp, &dlogits), (self.v0, self.v1, &hv, &dvalues)] {
            let mut dh = vec![0f32; h.len()];
            l1.backward(p, h, dy, &mut g, Some(&mut dh));
            dh.iter_mut().zip(h.iter()).for_each(|(d, &h)| *d *= 1.0 - h * h);
            l0.backward(p, &x, &dh, &mut g, None);
        }
        (loss, g)
    }
}

fn softmax2(a: f32, b: f32) -> (f64, f64) {
    let (a, b) = (f64::from(a), f64::from(b));
    let m = a.max(b);
    let (ea, eb) = ((a - m).exp(), (b - m).exp());
    (ea / (ea + eb), eb / (ea + eb))
}

/// Up to `t_max` steps of one episode.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rollout {
    pub states: Vec<[f32; 4]>,
    /// Pushed right.
    pub actions: Vec<bool>,
    pub rewards: Vec<f64>,
    /// The value of what follows the last step: 0 when the episode failed there, else the value network's.
    pub bootstrap: f64,
}

/// The finished episodes of all actors, in the order they finished; says when to stop.
pub trait Episodes: Send + Sync {
    /// Records an episode of `reward` finished by `actor`; true once training should stop (solved, or stopped
    /// from outside).
    fn finished(&self, actor: usize, reward: f64) -> Result<bool>;
    /// Whether training should stop, asked between rollouts.
    fn stopped(&self) -> bool;
}

/// [`Episodes`] for actors in one process: the last 100 rewards, and when their mean first reached
/// [`SOLVED`].
#[derive(Debug)]
pub struct Window {
    start: Instant,
    inner: Mutex<WindowState>,
}

#[derive(Debug, Default)]
struct WindowState {
    last: VecDeque<f64>,
    episodes: u64,
    solved: Option<(u64, Duration)>,
}

impl Default for Window {
    fn default() -> Self {
        Window { start: Instant::now(), inner: Mutex::new(WindowState::default()) }
    }
}

impl Window {
    /// Episodes recorded, and when solved: at which episode and how long after the record was made.
    pub fn result(&self) -> (u64, Option<(u64, Duration)>) {
        let w = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        (w.episodes, w.solved)
    }

    /// The mean of the last 100 rewards (of fewer, before 100 episodes).
    pub fn mean(&self) -> f64 {
        let w = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        w.last.iter().sum::<f64>() / w.last.len().max(1) as f64
    }
}

/// Records one reward in a window of the last 100; returns whether their mean now counts as solved.
pub fn record(last: &mut VecDeque<f64>, reward: f64) -> bool {
    last.push_back(reward);
    if last.len() > 100 {
        last.pop_front();
    }
    last.len() == 100 && last.iter().sum::<f64>() / 100.0 >= SOLVED
}

impl Episodes for Window {
    fn finished(&self, _actor: usize, reward: f64) -> Result<bool> {
        let mut w = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        w.episodes += 1;
        if record(&mut w.last, reward) && w.solved.is_none() {
            w.solved = Some((w.episodes, self.start.elapsed()));
        }
        Ok(w.solved.is_some())
    }

    fn stopped(&self) -> bool {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner).solved.is_some()
    }
}

/// What one actor did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ActorReport {
    pub actor: usize,
    pub episodes: u64,
    pub updates: u64,
    pub steps: u64,
    pub seconds: f64,
    /// Mean reward of its first and last 10 episodes.
    pub first_rewards: f64,
    pub last_rewards: f64,
}

/// Plays and learns as actor `actor` through `client` (the servers in the asynchronous mode) until `episodes`
/// says stop or `cfg.max_seconds` pass. The first actor's starting values are the servers' (every actor's are
/// the same).
pub fn act(client: &mut Client, cfg: &A3cConfig, actor: usize, episodes: &dyn Episodes) -> Result<ActorReport> {
    let nets = Networks::new(cfg.hidden)?;
    let plan = ShardPlan::new(nets.tensors(), client.servers())?;
    let cuts = plan.cuts();
    let mut p = nets.init(cfg.seed);
    let inits: Vec<[&[f32]; 3]> = cuts.iter().map(|r| [&p[r.clone()], &[][..], &[][..]]).collect();
    client.init(false, 0, &inits)?;
    let pull_all = |client: &mut Client, p: &mut [f32], g: Option<&[f32]>| -> Result<()> {
        let mut rest = p;
        let parts = cuts
            .iter()
            .map(|r| {
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
                rest = tail;
                Part { push: g.map(|g| &g[r.clone()]), push_spans: &[], pull: Some(mine), pull_spans: &[] }
            })
            .collect();
        Ok(client.exchange(cfg.lr, parts)?)
    };
    pull_all(client, &mut p, None)?;
    let mut rng = SplitMix64::from_key(&[cfg.seed, 0xAC7, actor as u64]);
    let mut report = ActorReport { actor, ..ActorReport::default() };
    let mut rewards = Vec::new();
    let start = Instant::now();
    let mut env = CartPole::reset(&mut rng);
    let mut episode_reward = 0.0;
    'train: while !episodes.stopped() && start.elapsed().as_secs_f64() < cfg.max_seconds {
        let mut roll = Rollout::default();
        let mut outcome = Outcome::Running;
        while roll.actions.len() < cfg.t_max && outcome == Outcome::Running {
            let obs = env.observe();
            let right = rng.unit_f64() < nets.p_right(&p, &obs);
            outcome = env.step(right);
            roll.states.push(obs);
            roll.actions.push(right);
            roll.rewards.push(1.0);
            episode_reward += 1.0;
        }
        roll.bootstrap = if outcome == Outcome::Failed { 0.0 } else { nets.value(&p, &env.observe()) };
        let (_, g) = nets.loss_and_grads(&p, cfg, &roll);
        pull_all(client, &mut p, Some(&g))?;
        report.updates += 1;
        report.steps += roll.actions.len() as u64;
        if outcome != Outcome::Running {
            report.episodes += 1;
            rewards.push(episode_reward);
            let stop = episodes.finished(actor, episode_reward)?;
            env = CartPole::reset(&mut rng);
            episode_reward = 0.0;
            if stop {
                break 'train;
            }
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    report.first_rewards = mean(&rewards[..rewards.len().min(10)]);
    report.last_rewards = mean(&rewards[rewards.len().saturating_sub(10)..]);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rollout's gradient against central differences of its loss.
    #[test]
    fn gradients_match_finite_differences() -> Result<()> {
        let cfg = A3cConfig { hidden: 5, ..A3cConfig::default() };
        let nets = Networks::new(cfg.hidden)?;
        let p = nets.init(1);
        let roll = Rollout {
            states: vec![[0.01, -0.2, 0.03, 0.1], [0.02, 0.1, -0.04, -0.3], [0.5, 0.4, 0.1, 0.2]],
            actions: vec![true, false, true],
            rewards: vec![1.0, 1.0, 1.0],
            bootstrap: 4.5,
        };
        let (_, g) = nets.loss_and_grads(&p, &cfg, &roll);
        for k in 0..p.len() {
            let (mut a, mut b) = (p.clone(), p.clone());
            a[k] += 1e-3;
            b[k] -= 1e-3;
            // The advantage is held constant in A3C's gradient of the policy term; the value term sees it move.
            // So compare with the loss whose policy term uses the unperturbed values.
            let fd = (split_loss(&nets, &a, &p, &cfg, &roll) - split_loss(&nets, &b, &p, &cfg, &roll)) / 2e-3;
            assert!((fd - f64::from(g[k])).abs() < 1e-3 + 0.02 * fd.abs(), "value {k}: {fd} vs {}", g[k]);
        }
        Ok(())
    }

    /// The loss with the policy's advantage from the values of `fixed` and everything else from `p`.
    fn split_loss(nets: &Networks, p: &[f32], fixed: &[f32], cfg: &A3cConfig, roll: &Rollout) -> f64 {
        let n = roll.actions.len();
        let mut ret = roll.bootstrap;
        let mut total = 0.0;
        let mut returns = vec![0.0; n];
        for t in (0..n).rev() {
            ret = roll.rewards[t] + cfg.gamma * ret;
            returns[t] = ret;
        }
        for ((obs, &right), ret) in roll.states.iter().zip(&roll.actions).zip(returns) {
            let pr = nets.p_right(p, obs);
            let probs = [1.0 - pr, pr];
            let a = usize::from(right);
            let adv_fixed = ret - nets.value(fixed, obs);
            let adv = ret - nets.value(p, obs);
            let h = -(probs[0] * probs[0].ln() + probs[1] * probs[1].ln());
            total += -probs[a].ln() * adv_fixed - cfg.entropy * h + cfg.value * 0.5 * adv * adv;
        }
        total / n as f64
    }

    #[test]
    fn the_window_is_solved_by_100_episodes_averaging_195() -> Result<()> {
        let w = Window::default();
        for _ in 0..99 {
            assert!(!w.finished(0, 200.0)?);
        }
        assert!(w.finished(1, 200.0)?);
        assert_eq!(w.result().0, 100);
        assert!(w.stopped());
        let mut last = VecDeque::new();
        (0..100).for_each(|_| {
            record(&mut last, 194.0);
        });
        assert!(!record(&mut last, 194.0));
        Ok(())
    }
}
