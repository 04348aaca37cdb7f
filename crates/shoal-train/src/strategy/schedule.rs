//! The order in which one pipeline stage runs a step's micro-batches: its forwards and backwards, and the messages
//! it exchanges with its neighbours, as a list of [`Op`]s.
//!
//! The communicator's point-to-point calls block until the message is handed over (a large one waits for the
//! receiver), so the lists are written to match under that rule, with nothing buffered: wherever a stage sends to
//! a neighbour and receives from the same neighbour at one point of the schedule, the lower-ranked of the two sends
//! first and the higher one receives first. The tests run every list of every stage against the others under
//! exactly that rule (a send completes only when its receiver has reached the matching receive) for many shapes.
//!
//! - GPipe: every micro-batch's forward (receive the activation, compute, send it on), then every backward (receive
//!   the gradient, compute, send the input's gradient back).
//! - 1F1B (PipeDream-flush): stage `s` of `S` runs `W = min(S-1-s, M)` forwards first, then alternates one forward
//!   and one backward `M - W` times, then runs the `W` backwards left. It has GPipe's bubble, `(S-1)/(M+S-1)` of
//!   the step, and holds at most `W + 1` micro-batches' activations instead of `M`.

use crate::spec::PipelineSchedule;

/// One thing a stage does, for micro-batch `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Receive micro-batch `i`'s activation from the previous stage.
    RecvAct(usize),
    Forward(usize),
    /// Send micro-batch `i`'s output to the next stage.
    SendAct(usize),
    /// Receive the gradient of micro-batch `i`'s output from the next stage.
    RecvGrad(usize),
    Backward(usize),
    /// Send the gradient of micro-batch `i`'s input to the previous stage.
    SendGrad(usize),
}

/// The ops of stage `stage` of `stages` for `micro` micro-batches under `schedule` (an interleaved schedule is not
/// built: the spec refuses it, and it runs as an error here).
pub fn ops(schedule: PipelineSchedule, stages: usize, stage: usize, micro: usize) -> Vec<Op> {
    let (first, last) = (stage == 0, stage + 1 >= stages);
    let mut out = Vec::new();
    let mut push = |op: Op| {
        let skip = match op {
            Op::RecvAct(_) | Op::SendGrad(_) => first,
            Op::SendAct(_) | Op::RecvGrad(_) => last,
            Op::Forward(_) | Op::Backward(_) => false,
        };
        if !skip {
            out.push(op);
        }
    };
    match schedule {
        PipelineSchedule::Gpipe | PipelineSchedule::Interleaved => {
            for i in 0..micro {
                push(Op::RecvAct(i));
                push(Op::Forward(i));
                push(Op::SendAct(i));
            }
            for i in 0..micro {
                push(Op::RecvGrad(i));
                push(Op::Backward(i));
                push(Op::SendGrad(i));
            }
        }
        PipelineSchedule::OneFOneB => {
            let warmup = (stages - 1 - stage).min(micro);
            let steady = micro - warmup;
            for i in 0..warmup {
                push(Op::RecvAct(i));
                push(Op::Forward(i));
                push(Op::SendAct(i));
            }
            if steady > 0 {
                push(Op::RecvAct(warmup));
            }
            for j in 0..steady {
                push(Op::Forward(warmup + j));
                // With the next stage (this one is lower): send, then receive.
                push(Op::SendAct(warmup + j));
                push(Op::RecvGrad(j));
                push(Op::Backward(j));
                if j + 1 < steady {
                    // With the previous stage (this one is higher): receive, then send.
                    push(Op::RecvAct(warmup + j + 1));
                }
                push(Op::SendGrad(j));
            }
            for i in steady..micro {
                push(Op::RecvGrad(i));
                push(Op::Backward(i));
                push(Op::SendGrad(i));
            }
        }
    }
    out
}

/// The bubble of `stages` stages over `micro` micro-batches in theory (every forward and every backward taking the
/// same time on every stage, messages free): `(S-1)/(M+S-1)` of the step.
pub fn theoretical_bubble(stages: usize, micro: usize) -> f64 {
    let s = stages.max(1) as f64;
    (s - 1.0) / (micro as f64 + s - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs every stage's ops against the others where a send completes only when its receiver is at the matching
    /// receive (nothing buffered); returns the ops each stage has done, or the stuck ops on a deadlock.
    fn simulate(lists: &[Vec<Op>]) -> Result<(), String> {
        let n = lists.len();
        let mut pc = vec![0usize; n];
        loop {
            if (0..n).all(|s| pc[s] == lists[s].len()) {
                return Ok(());
            }
            let mut moved = false;
            for s in 0..n {
                while let Some(op) = lists[s].get(pc[s]).copied() {
                    let peer_at = |p: usize| lists[p].get(pc[p]).copied();
                    let ok = match op {
                        Op::Forward(_) | Op::Backward(_) => true,
                        Op::SendAct(i) => peer_at(s + 1) == Some(Op::RecvAct(i)),
                        Op::SendGrad(i) => peer_at(s - 1) == Some(Op::RecvGrad(i)),
                        // A receive completes with its send: the sender moves both.
                        Op::RecvAct(_) | Op::RecvGrad(_) => false,
                    };
                    if !ok {
                        break;
                    }
                    match op {
                        Op::SendAct(_) => pc[s + 1] += 1,
                        Op::SendGrad(_) => pc[s - 1] += 1,
                        _ => {}
                    }
                    pc[s] += 1;
                    moved = true;
                }
            }
            if !moved {
                let stuck: Vec<_> = (0..n).map(|s| lists[s].get(pc[s])).collect();
                return Err(format!("deadlock: {stuck:?}"));
            }
        }
    }

    #[test]
    fn every_schedule_completes_when_sends_wait_for_their_receivers() {
        for schedule in [PipelineSchedule::Gpipe, PipelineSchedule::OneFOneB] {
            for stages in 2..=8 {
                for micro in 1..=17 {
                    let lists: Vec<_> = (0..stages).map(|s| ops(schedule, stages, s, micro)).collect();
                    for (s, l) in lists.iter().enumerate() {
                        // Every micro-batch's forward before its backward, each once.
                        for i in 0..micro {
                            let f = l.iter().position(|o| *o == Op::Forward(i));
                            let b = l.iter().position(|o| *o == Op::Backward(i));
                            assert!(matches!((f, b), (Some(f), Some(b)) if f < b), "{schedule:?} {stages}/{s} {micro}");
                        }
                        assert_eq!(
                            l.iter().filter(|o| matches!(o, Op::Forward(_) | Op::Backward(_))).count(),
                            2 * micro
                        );
                    }
                    if let Err(e) = simulate(&lists) {
                        panic!("{schedule:?}, {stages} stages, {micro} micro-batches: {e}");
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_warms_up_with_the_stages_below_it_and_holds_few_activations() {
        let l = ops(PipelineSchedule::OneFOneB, 4, 0, 8);
        // Three forwards before the first backward on the first of 4 stages.
        let before: Vec<_> = l.iter().take_while(|o| !matches!(o, Op::Backward(_))).copied().collect();
        assert_eq!(before.iter().filter(|o| matches!(o, Op::Forward(_))).count(), 4);
        // Most forwards held (run, backward not yet) at once: S - s on stage s, M under GPipe.
        let held = |l: &[Op]| {
            let (mut now, mut most) = (0i32, 0);
            for o in l {
                match o {
                    Op::Forward(_) => now += 1,
                    Op::Backward(_) => now -= 1,
                    _ => {}
                }
                most = most.max(now);
            }
            most
        };
        for s in 0..4 {
            assert_eq!(held(&ops(PipelineSchedule::OneFOneB, 4, s, 8)), 4 - s as i32);
            assert_eq!(held(&ops(PipelineSchedule::Gpipe, 4, s, 8)), 8);
        }
        assert!((theoretical_bubble(2, 4) - 0.2).abs() < 1e-12);
    }
}
