//! The classic cart-pole: a pole hinged on a cart that moves along a track, pushed left or right by a force of 10
//! newtons each 20 ms; the episode ends when the pole leans more than 12° or the cart leaves ±2.4 m, or after 200
//! steps (a reward of 1 a step). The physics are the classic ones (Barto, Sutton and Anderson, 1983, integrated by
//! Euler's method), so rewards compare with the usual definition of "solved": a mean of 195 or more over 100
//! consecutive episodes.

use shoal_data::rng::SplitMix64;

const GRAVITY: f64 = 9.8;
const CART_MASS: f64 = 1.0;
const POLE_MASS: f64 = 0.1;
const TOTAL_MASS: f64 = CART_MASS + POLE_MASS;
/// Half the pole's length.
const HALF_LENGTH: f64 = 0.5;
const POLE_MOMENT: f64 = POLE_MASS * HALF_LENGTH;
const FORCE: f64 = 10.0;
const TAU: f64 = 0.02;
const THETA_LIMIT: f64 = 12.0 * 2.0 * std::f64::consts::PI / 360.0;
const X_LIMIT: f64 = 2.4;
/// Steps after which an episode ends however well it goes.
pub const MAX_STEPS: usize = 200;
/// The mean reward over 100 consecutive episodes that counts as solved.
pub const SOLVED: f64 = 195.0;

/// The state: cart position and velocity, pole angle and angular velocity.
#[derive(Debug, Clone, PartialEq)]
pub struct CartPole {
    pub state: [f64; 4],
    pub steps: usize,
}

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The episode goes on.
    Running,
    /// The pole fell or the cart left the track: no future reward.
    Failed,
    /// [`MAX_STEPS`] reached with the pole up: the future was cut, not lost.
    TimeUp,
}

impl CartPole {
    /// A new episode, every state variable uniform in ±0.05.
    pub fn reset(rng: &mut SplitMix64) -> CartPole {
        let mut state = [0.0; 4];
        state.iter_mut().for_each(|s| *s = (rng.unit_f64() * 2.0 - 1.0) * 0.05);
        CartPole { state, steps: 0 }
    }

    /// The state as the network's input.
    pub fn observe(&self) -> [f32; 4] {
        self.state.map(|s| s as f32)
    }

    /// Pushes right (`true`) or left; the step earns a reward of 1.
    pub fn step(&mut self, right: bool) -> Outcome {
        let [x, x_dot, theta, theta_dot] = self.state;
        let force = if right { FORCE } else { -FORCE };
        let (sin, cos) = theta.sin_cos();
        let temp = (force + POLE_MOMENT * theta_dot * theta_dot * sin) / TOTAL_MASS;
        let theta_acc = (GRAVITY * sin - cos * temp) / (HALF_LENGTH * (4.0 / 3.0 - POLE_MASS * cos * cos / TOTAL_MASS));
        let x_acc = temp - POLE_MOMENT * theta_acc * cos / TOTAL_MASS;
        self.state = [x + TAU * x_dot, x_dot + TAU * x_acc, theta + TAU * theta_dot, theta_dot + TAU * theta_acc];
        self.steps += 1;
        let [x, _, theta, _] = self.state;
        if !(-X_LIMIT..=X_LIMIT).contains(&x) || !(-THETA_LIMIT..=THETA_LIMIT).contains(&theta) {
            Outcome::Failed
        } else if self.steps >= MAX_STEPS {
            Outcome::TimeUp
        } else {
            Outcome::Running
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushing_one_way_tips_the_pole_the_other_and_fails_within_a_second() {
        let mut env = CartPole { state: [0.0; 4], steps: 0 };
        let mut outcome = Outcome::Running;
        while outcome == Outcome::Running {
            outcome = env.step(true);
        }
        assert_eq!(outcome, Outcome::Failed);
        // The cart accelerates right and the pole falls back to the left.
        assert!(env.state[1] > 0.0 && env.state[2] < -THETA_LIMIT, "{:?}", env.state);
        assert!(env.steps > 5 && env.steps < 50, "{} steps", env.steps);
    }

    #[test]
    fn a_balancing_controller_lasts_the_whole_episode() {
        // Push toward the side the pole leans to (and its angular velocity): the textbook controller.
        let mut rng = SplitMix64::from_key(&[1]);
        for _ in 0..10 {
            let mut env = CartPole::reset(&mut rng);
            let mut outcome = Outcome::Running;
            while outcome == Outcome::Running {
                let [_, _, theta, theta_dot] = env.state;
                outcome = env.step(theta + 0.5 * theta_dot > 0.0);
            }
            assert_eq!((outcome, env.steps), (Outcome::TimeUp, MAX_STEPS));
        }
    }
}
