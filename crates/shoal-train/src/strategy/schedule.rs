//! The order in which one pipeline rank runs a step's micro-batches: its forwards and backwards, and the messages
//! it exchanges with its neighbours, as a list of [`Op`]s.
//!
//! A rank holds one model chunk (GPipe, 1F1B) or `V` of them (interleaved): chunk `c` of rank `r` of `P` is the
//! virtual stage `c·P + r` of `V·P`, so a micro-batch goes round the ranks `V` times, and the activation of rank
//! `P-1`'s chunk `c` goes to rank 0's chunk `c+1` (its gradient back the other way).
//!
//! The communicator's point-to-point calls block until the message is handed over (a large one waits for the
//! receiver), so the lists are written to match under that rule, with nothing buffered. The tests run every list
//! of every rank against the others under exactly that rule (a send completes only when its receiver has reached
//! the matching receive) for many shapes.
//!
//! - GPipe: every micro-batch's forward (receive the activation, compute, send it on), then every backward (receive
//!   the gradient, compute, send the input's gradient back).
//! - 1F1B (PipeDream-flush): stage `s` of `S` runs `W = min(S-1-s, M)` forwards first, then alternates one forward
//!   and one backward `M - W` times, then runs the `W` backwards left. It has GPipe's bubble, `(S-1)/(M+S-1)` of
//!   the step, and holds at most `W + 1` micro-batches' activations instead of `M`. Wherever a stage sends to a
//!   neighbour and receives from the same neighbour at one point, the lower-ranked of the two sends first and the
//!   higher one receives first.
//! - Interleaved 1F1B (Megatron-LM's): the micro-batches taken in groups of `P`, each group through chunk 0, then
//!   chunk 1, … (backwards through the chunks from the last); rank `r` runs `2(P-1-r) + (V-1)P` forwards first
//!   (all of them when `M = P`, or when a short last batch leaves `M` not a multiple of `P`), then one forward and one
//!   backward in turn, then the backwards left. Its bubble is `(P-1)/(V·M + P-1)` of the step: a micro-batch's turn
//!   on a chunk is `1/V` of its turn on a whole stage. Messages: the ranks' orders of computation are played out
//!   together with a forward taking one unit of time and a backward two (messages free), every message placed at
//!   the moment its sender finishes computing it; each rank's list is the one global order of those events, seen
//!   from that rank. A send and its receive are therefore at the same place of that order on both ranks, and a
//!   blocking send never waits on a receive that waits, in turn, on it.

use crate::spec::PipelineSchedule;

/// One thing a rank does, for micro-batch `.0` on its model chunk `.1` (always 0 but under an interleaved
/// schedule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Receive the activation for the chunk's input from the previous rank.
    RecvAct(usize, usize),
    Forward(usize, usize),
    /// Send the chunk's output to the next rank.
    SendAct(usize, usize),
    /// Receive the gradient of the chunk's output from the next rank.
    RecvGrad(usize, usize),
    Backward(usize, usize),
    /// Send the gradient of the chunk's input to the previous rank.
    SendGrad(usize, usize),
}

/// The shape of one step of a pipeline: ranks, model chunks per rank, micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Ranks (`P`).
    pub stages: usize,
    /// Model chunks per rank (`V`: 1 but under an interleaved schedule).
    pub chunks: usize,
    /// Micro-batches this step.
    pub micro: usize,
}

impl Shape {
    /// The virtual stage of rank `rank`'s chunk `chunk`.
    pub fn virtual_stage(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }

    /// Whether rank `rank`'s chunk `chunk` is the model's first virtual stage (it takes the model's input).
    pub fn is_first(&self, rank: usize, chunk: usize) -> bool {
        rank == 0 && chunk == 0
    }

    /// Whether rank `rank`'s chunk `chunk` is the model's last virtual stage (it computes the loss).
    pub fn is_last(&self, rank: usize, chunk: usize) -> bool {
        rank + 1 == self.stages && chunk + 1 == self.chunks.max(1)
    }

    /// The rank activations go to from `rank` (gradients come from it).
    pub fn next(&self, rank: usize) -> usize {
        (rank + 1) % self.stages.max(1)
    }

    /// The rank activations come from to `rank` (gradients go to it).
    pub fn prev(&self, rank: usize) -> usize {
        (rank + self.stages.max(1) - 1) % self.stages.max(1)
    }

    /// For a send of rank `rank`, the rank it goes to and the receive that takes it there; `None` for other ops.
    pub fn matching(&self, rank: usize, op: Op) -> Option<(usize, Op)> {
        let wraps = rank + 1 == self.stages;
        match op {
            Op::SendAct(i, c) => Some((self.next(rank), Op::RecvAct(i, if wraps { c + 1 } else { c }))),
            Op::SendGrad(i, c) => {
                Some((self.prev(rank), Op::RecvGrad(i, if rank == 0 { c.saturating_sub(1) } else { c })))
            }
            _ => None,
        }
    }
}

/// The ops of rank `stage` for one step of `shape` under `schedule` (GPipe and 1F1B use one chunk whatever
/// `shape.chunks` says). An error only for an interleaved shape whose order cannot complete, which the spec's
/// checks rule out.
pub fn ops(schedule: PipelineSchedule, shape: Shape, stage: usize) -> Result<Vec<Op>, String> {
    match schedule {
        PipelineSchedule::Interleaved => {
            let mut all = interleaved(shape)?;
            if stage >= all.len() {
                return Err(format!("rank {stage} of a pipeline of {} ranks", shape.stages));
            }
            Ok(all.swap_remove(stage))
        }
        _ => Ok(flat(schedule, shape.stages, stage, shape.micro)),
    }
}

/// GPipe and 1F1B: one chunk per rank.
fn flat(schedule: PipelineSchedule, stages: usize, stage: usize, micro: usize) -> Vec<Op> {
    let (first, last) = (stage == 0, stage + 1 >= stages);
    let mut out = Vec::new();
    let mut push = |op: Op| {
        let skip = match op {
            Op::RecvAct(..) | Op::SendGrad(..) => first,
            Op::SendAct(..) | Op::RecvGrad(..) => last,
            Op::Forward(..) | Op::Backward(..) => false,
        };
        if !skip {
            out.push(op);
        }
    };
    if schedule == PipelineSchedule::OneFOneB {
        let warmup = (stages.saturating_sub(1 + stage)).min(micro);
        let steady = micro - warmup;
        for i in 0..warmup {
            push(Op::RecvAct(i, 0));
            push(Op::Forward(i, 0));
            push(Op::SendAct(i, 0));
        }
        if steady > 0 {
            push(Op::RecvAct(warmup, 0));
        }
        for j in 0..steady {
            push(Op::Forward(warmup + j, 0));
            // With the next stage (this one is lower): send, then receive.
            push(Op::SendAct(warmup + j, 0));
            push(Op::RecvGrad(j, 0));
            push(Op::Backward(j, 0));
            if j + 1 < steady {
                // With the previous stage (this one is higher): receive, then send.
                push(Op::RecvAct(warmup + j + 1, 0));
            }
            push(Op::SendGrad(j, 0));
        }
        for i in steady..micro {
            push(Op::RecvGrad(i, 0));
            push(Op::Backward(i, 0));
            push(Op::SendGrad(i, 0));
        }
    } else {
        for i in 0..micro {
            push(Op::RecvAct(i, 0));
            push(Op::Forward(i, 0));
            push(Op::SendAct(i, 0));
        }
        for i in 0..micro {
            push(Op::RecvGrad(i, 0));
            push(Op::Backward(i, 0));
            push(Op::SendGrad(i, 0));
        }
    }
    out
}

/// Rank `rank`'s computations under the interleaved schedule, in order: `(backward, micro-batch, chunk)`.
fn interleaved_order(shape: Shape, rank: usize) -> Vec<(bool, usize, usize)> {
    let Shape { stages: p, chunks: v, micro: m } = shape;
    // Groups of P micro-batches, each through the chunks in turn (a short last group as the others).
    let units = |backward: bool| {
        let mut out = Vec::with_capacity(m * v);
        for start in (0..m).step_by(p.max(1)) {
            let group = start..(start + p).min(m);
            for c in 0..v {
                let c = if backward { v - 1 - c } else { c };
                out.extend(group.clone().map(|i| (backward, i, c)));
            }
        }
        out
    };
    let (fwd, bwd) = (units(false), units(true));
    let total = fwd.len();
    let warmup =
        if m == p || !m.is_multiple_of(p.max(1)) { total } else { (2 * (p - 1 - rank) + (v - 1) * p).min(total) };
    let mut out = Vec::with_capacity(2 * total);
    out.extend_from_slice(&fwd[..warmup]);
    for j in 0..total - warmup {
        out.push(fwd[warmup + j]);
        out.push(bwd[j]);
    }
    out.extend_from_slice(&bwd[total - warmup..]);
    out
}

/// Every rank's ops under the interleaved schedule (see the module documentation).
fn interleaved(shape: Shape) -> Result<Vec<Vec<Op>>, String> {
    let Shape { stages: p, chunks: v, micro: m } = shape;
    if p < 2 || v == 0 || m == 0 {
        return Err(format!("an interleaved pipeline of {p} ranks, {v} chunks each, {m} micro-batches"));
    }
    let orders: Vec<_> = (0..p).map(|r| interleaved_order(shape, r)).collect();
    let s_total = p * v;
    // When each virtual stage's forward and backward of each micro-batch ends (unit time: forward 1, backward 2).
    let mut fwd_end = vec![vec![None::<u64>; m]; s_total];
    let mut bwd_end = vec![vec![None::<u64>; m]; s_total];
    // Events: (time, 0 for a message or 1 for a computation, rank, sequence number on that rank, what).
    let mut events: Vec<(u64, u8, usize, usize, Event)> = Vec::new();
    let (mut pc, mut free) = (vec![0usize; p], vec![0u64; p]);
    loop {
        let mut moved = false;
        for r in 0..p {
            while let Some(&(backward, i, c)) = orders[r].get(pc[r]) {
                let s = shape.virtual_stage(r, c);
                // What the computation waits for: the activation (or the loss), or the gradient and its own forward.
                let ready = if backward {
                    let own = fwd_end[s][i];
                    let grad = if shape.is_last(r, c) { Some(0) } else { bwd_end[s + 1][i] };
                    own.zip(grad).map(|(a, b)| a.max(b))
                } else if s == 0 {
                    Some(0)
                } else {
                    fwd_end[s - 1][i]
                };
                let Some(ready) = ready else { break };
                let start = free[r].max(ready);
                let end = start + if backward { 2 } else { 1 };
                let seq = pc[r];
                if backward {
                    bwd_end[s][i] = Some(end);
                    events.push((start, 1, r, seq, Event::Backward(i, c)));
                    if !shape.is_first(r, c) {
                        events.push((end, 0, r, seq, Event::Grad(i, c)));
                    }
                } else {
                    fwd_end[s][i] = Some(end);
                    events.push((start, 1, r, seq, Event::Forward(i, c)));
                    if !shape.is_last(r, c) {
                        events.push((end, 0, r, seq, Event::Act(i, c)));
                    }
                }
                free[r] = end;
                pc[r] += 1;
                moved = true;
            }
        }
        if (0..p).all(|r| pc[r] == orders[r].len()) {
            break;
        }
        if !moved {
            return Err(format!(
                "the interleaved order of {p} ranks × {v} chunks over {m} micro-batches cannot complete"
            ));
        }
    }
    events.sort_by_key(|e| (e.0, e.1, e.2, e.3));
    let mut lists = vec![Vec::new(); p];
    for (_, _, r, _, e) in events {
        match e {
            Event::Forward(i, c) => lists[r].push(Op::Forward(i, c)),
            Event::Backward(i, c) => lists[r].push(Op::Backward(i, c)),
            Event::Act(i, c) | Event::Grad(i, c) => {
                let send = if matches!(e, Event::Act(..)) { Op::SendAct(i, c) } else { Op::SendGrad(i, c) };
                let Some((peer, recv)) = shape.matching(r, send) else { continue };
                lists[r].push(send);
                lists[peer].push(recv);
            }
        }
    }
    Ok(lists)
}

/// What happens at one moment of the interleaved schedule's play.
#[derive(Debug, Clone, Copy)]
enum Event {
    Forward(usize, usize),
    Backward(usize, usize),
    /// The activation of rank's chunk goes to the next virtual stage.
    Act(usize, usize),
    /// The gradient of the chunk's input goes to the previous virtual stage.
    Grad(usize, usize),
}

/// The bubble of `stages` ranks of `chunks` model chunks each over `micro` micro-batches in theory (every forward
/// and every backward taking the same time on every rank, messages free): `(P-1)/(V·M + P-1)` of the step
/// (`V = 1`: GPipe's and 1F1B's `(S-1)/(M+S-1)`).
pub fn theoretical_bubble(stages: usize, micro: usize, chunks: usize) -> f64 {
    let s = stages.max(1) as f64;
    (s - 1.0) / ((chunks.max(1) * micro) as f64 + s - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(stages: usize, chunks: usize, micro: usize) -> Shape {
        Shape { stages, chunks, micro }
    }

    fn all(schedule: PipelineSchedule, sh: Shape) -> Vec<Vec<Op>> {
        (0..sh.stages).map(|r| ops(schedule, sh, r).expect("a schedule")).collect()
    }

    /// Runs every rank's ops against the others; an error naming the stuck ops on a deadlock. With `rendezvous`, a
    /// send completes only when its receiver is at the matching receive (nothing buffered); without, a send never
    /// waits and a receive waits for its message. Returns each rank's time (a forward taking 1, a backward 2, a
    /// message nothing) at its last op, and its time computing.
    fn simulate(sh: Shape, lists: &[Vec<Op>], rendezvous: bool) -> Result<Vec<(u64, u64)>, String> {
        let n = lists.len();
        let mut pc = vec![0usize; n];
        let (mut clock, mut busy) = (vec![0u64; n], vec![0u64; n]);
        // Messages sent and not yet received (buffered play): (receiver, its receive) → when sent.
        let mut posted: std::collections::HashMap<(usize, Op), u64> = std::collections::HashMap::new();
        loop {
            if (0..n).all(|s| pc[s] == lists[s].len()) {
                return Ok(clock.into_iter().zip(busy).collect());
            }
            let mut moved = false;
            for s in 0..n {
                while let Some(op) = lists[s].get(pc[s]).copied() {
                    match op {
                        Op::Forward(..) | Op::Backward(..) => {
                            let d = if matches!(op, Op::Forward(..)) { 1 } else { 2 };
                            clock[s] += d;
                            busy[s] += d;
                        }
                        Op::SendAct(..) | Op::SendGrad(..) => {
                            let (peer, recv) = sh.matching(s, op).expect("a send has a receiver");
                            if !rendezvous {
                                posted.insert((peer, recv), clock[s]);
                            } else if lists[peer].get(pc[peer]).copied() == Some(recv) {
                                let t = clock[s].max(clock[peer]);
                                clock[s] = t;
                                clock[peer] = t;
                                pc[peer] += 1;
                            } else {
                                break;
                            }
                        }
                        // Under rendezvous a receive completes with its send: the sender moves both.
                        Op::RecvAct(..) | Op::RecvGrad(..) => match posted.remove(&(s, op)) {
                            Some(t) => clock[s] = clock[s].max(t),
                            None => break,
                        },
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

    /// Every micro-batch's forward and backward exactly once on every chunk of the rank, each message exactly once,
    /// and in an order that respects what each needs: the activation received before the forward, the forward before
    /// its output is sent and before the backward, the gradient received before the backward, the backward before
    /// the input's gradient is sent.
    fn check_list(sh: Shape, rank: usize, l: &[Op], what: &str) {
        let at = |op: Op| {
            let found: Vec<usize> = l.iter().enumerate().filter(|(_, o)| **o == op).map(|(k, _)| k).collect();
            assert!(found.len() <= 1, "{what}: rank {rank} has {op:?} {} times", found.len());
            found.first().copied()
        };
        let mut count = 0;
        for c in 0..sh.chunks {
            let (first, last) = (sh.is_first(rank, c), sh.is_last(rank, c));
            for i in 0..sh.micro {
                let f = at(Op::Forward(i, c)).unwrap_or_else(|| panic!("{what}: rank {rank}: no forward {i}/{c}"));
                let b = at(Op::Backward(i, c)).unwrap_or_else(|| panic!("{what}: rank {rank}: no backward {i}/{c}"));
                assert!(f < b, "{what}: rank {rank}: backward {i}/{c} before its forward");
                let ra = at(Op::RecvAct(i, c));
                let sa = at(Op::SendAct(i, c));
                let rg = at(Op::RecvGrad(i, c));
                let sg = at(Op::SendGrad(i, c));
                assert_eq!(ra.is_some(), !first, "{what}: rank {rank}: receive of activation {i}/{c}");
                assert_eq!(sg.is_some(), !first, "{what}: rank {rank}: send of gradient {i}/{c}");
                assert_eq!(sa.is_some(), !last, "{what}: rank {rank}: send of activation {i}/{c}");
                assert_eq!(rg.is_some(), !last, "{what}: rank {rank}: receive of gradient {i}/{c}");
                assert!(ra.is_none_or(|k| k < f), "{what}: rank {rank}: forward {i}/{c} before its input came");
                assert!(sa.is_none_or(|k| k > f), "{what}: rank {rank}: output {i}/{c} sent before its forward");
                assert!(rg.is_none_or(|k| k < b), "{what}: rank {rank}: backward {i}/{c} before its gradient came");
                assert!(sg.is_none_or(|k| k > b), "{what}: rank {rank}: gradient {i}/{c} sent before its backward");
                count += 2 + [ra, sa, rg, sg].iter().filter(|k| k.is_some()).count();
            }
        }
        assert_eq!(count, l.len(), "{what}: rank {rank}: ops of chunks it does not hold: {l:?}");
    }

    #[test]
    fn every_schedule_completes_when_sends_wait_for_their_receivers() {
        for schedule in [PipelineSchedule::Gpipe, PipelineSchedule::OneFOneB] {
            for stages in 2..=8 {
                for micro in 1..=17 {
                    let sh = shape(stages, 1, micro);
                    let lists = all(schedule, sh);
                    let what = format!("{schedule:?}, {stages} stages, {micro} micro-batches");
                    for (s, l) in lists.iter().enumerate() {
                        check_list(sh, s, l, &what);
                    }
                    if let Err(e) = simulate(sh, &lists, true) {
                        panic!("{what}: {e}");
                    }
                }
            }
        }
    }

    /// The interleaved schedule on every shape up to 6 ranks × 4 chunks × 18 micro-batches (a multiple of the ranks,
    /// as the spec requires, and any other count, as a short last batch gives): every list valid, every rank's
    /// together complete under blocking sends.
    #[test]
    fn interleaved_lists_are_valid_and_complete_when_sends_wait_for_their_receivers() {
        for stages in 2..=6 {
            for chunks in 1..=4 {
                for micro in 1..=18 {
                    let sh = shape(stages, chunks, micro);
                    let lists = all(PipelineSchedule::Interleaved, sh);
                    let what = format!("interleaved, {stages} ranks × {chunks} chunks, {micro} micro-batches");
                    for (s, l) in lists.iter().enumerate() {
                        check_list(sh, s, l, &what);
                    }
                    if let Err(e) = simulate(sh, &lists, true) {
                        panic!("{what}: {e}");
                    }
                }
            }
        }
    }

    /// Played with a forward taking 1 and a backward 2, the interleaved schedule's idle time over the step is
    /// Megatron-LM's `(P-1)/(V·M + P-1)` where M is a multiple of P (more than P), below 1F1B's `(P-1)/(M+P-1)`.
    #[test]
    fn the_interleaved_bubble_is_a_chunk_of_1f1b_s() {
        for (stages, chunks, micro) in [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 3, 16), (2, 4, 6)] {
            let sh = shape(stages, chunks, micro);
            let played = |schedule| {
                let times = simulate(sh, &all(schedule, sh), false).expect("completes");
                let span = times.iter().map(|(t, _)| *t).max().unwrap_or(0) as f64;
                // Every rank computes for the same time: the bubble is what the longest span adds to it.
                let busy = times[0].1 as f64;
                assert!(times.iter().all(|(_, b)| *b as f64 == busy));
                (span - busy) / span
            };
            let (flat, inter) = (played(PipelineSchedule::OneFOneB), played(PipelineSchedule::Interleaved));
            let what =
                format!("{stages} ranks × {chunks} chunks, {micro} micro-batches: 1f1b {flat}, interleaved {inter}");
            assert!((flat - theoretical_bubble(stages, micro, 1)).abs() < 1e-12, "{what}");
            assert!((inter - theoretical_bubble(stages, micro, chunks)).abs() < 1e-12, "{what}");
            assert!(inter < flat, "{what}");
        }
    }

    #[test]
    fn interleaved_ranks_hold_chunks_round_the_ring_and_warm_up_as_megatron_does() {
        let sh = shape(2, 2, 4);
        assert_eq!((sh.virtual_stage(0, 1), sh.virtual_stage(1, 1)), (2, 3));
        // Rank 1's first chunk sends on to rank 0's second; rank 0's second chunk sends gradients back to it.
        assert_eq!(sh.matching(1, Op::SendAct(3, 0)), Some((0, Op::RecvAct(3, 1))));
        assert_eq!(sh.matching(0, Op::SendGrad(3, 1)), Some((1, Op::RecvGrad(3, 0))));
        let computed = |l: &[Op]| -> Vec<Op> {
            l.iter().copied().filter(|o| matches!(o, Op::Forward(..) | Op::Backward(..))).collect()
        };
        // Rank 0 of 2, 2 chunks, 4 micro-batches: 2(P-1) + (V-1)P = 4 forwards first, micro-batches in groups of 2.
        use Op::{Backward as B, Forward as F};
        let want = [F(0, 0), F(1, 0), F(0, 1), F(1, 1), F(2, 0), B(0, 1), F(3, 0), B(1, 1)];
        assert_eq!(&computed(&ops(PipelineSchedule::Interleaved, sh, 0).expect("ops"))[..8], want);
        // Rank 1 (the model's last chunk is its second): (V-1)P = 2 forwards first.
        let want = [F(0, 0), F(1, 0), F(0, 1), B(0, 1), F(1, 1), B(1, 1), F(2, 0), B(0, 0)];
        assert_eq!(&computed(&ops(PipelineSchedule::Interleaved, sh, 1).expect("ops"))[..8], want);
        assert!((theoretical_bubble(2, 4, 2) - 1.0 / 9.0).abs() < 1e-12);
    }

    #[test]
    fn one_f_one_b_warms_up_with_the_stages_below_it_and_holds_few_activations() {
        let l = ops(PipelineSchedule::OneFOneB, shape(4, 1, 8), 0).expect("ops");
        // Three forwards before the first backward on the first of 4 stages.
        let before: Vec<_> = l.iter().take_while(|o| !matches!(o, Op::Backward(..))).copied().collect();
        assert_eq!(before.iter().filter(|o| matches!(o, Op::Forward(..))).count(), 4);
        // Most forwards held (run, backward not yet) at once: S - s on stage s, M under GPipe.
        let held = |l: &[Op]| {
            let (mut now, mut most) = (0i32, 0);
            for o in l {
                match o {
                    Op::Forward(..) => now += 1,
                    Op::Backward(..) => now -= 1,
                    _ => {}
                }
                most = most.max(now);
            }
            most
        };
        for s in 0..4 {
            assert_eq!(held(&ops(PipelineSchedule::OneFOneB, shape(4, 1, 8), s).expect("ops")), 4 - s as i32);
            assert_eq!(held(&ops(PipelineSchedule::Gpipe, shape(4, 1, 8), s).expect("ops")), 8);
        }
        assert!((theoretical_bubble(2, 4, 1) - 0.2).abs() < 1e-12);
    }
}
