//! `[robust]` in data parallelism: instead of summing the ranks' gradient buckets, every rank gathers all of them
//! and combines them by a robust rule (`shoal_ps::robust`), so that up to `f` ranks sending anything at all move
//! the model no further than the rule lets them. Each rank's bucket is its part of the global batch's gradient
//! (its samples' share of the loss), so the rule's combination of the `W` parts, times `W`, stands for their sum —
//! exactly the sum's value, to rounding, under the mean. The step's scalars (the loss, the votes) after the
//! gradients are summed as usual. Every rank combines the same gathered bytes in the same order, so all end with
//! the same bits. `[chaos]` simulates attackers there, for experiments.

use crate::Real;
use shoal_comm::{Communicator, ReduceOp};
use shoal_ps::{Attack, Rule};

use crate::error::Result;

/// Combines `data[..grads]` over `comm`'s ranks by `rule` bearing `f` attackers (see the module documentation),
/// and sums the rest (`data[grads..]`, the scalars); `gathered` is reused from call to call. `attack` (`[chaos]`,
/// an experiment): the ranks that lie, what they send, and the seed of this bucket's draws — simulated in the
/// gathered parts, the same on every rank.
pub(crate) fn all_reduce(
    comm: &Communicator,
    rule: Rule,
    f: usize,
    data: &mut [Real],
    grads: usize,
    gathered: &mut Vec<Real>,
    attack: Option<(&Attack, &[usize], u64)>,
) -> Result<()> {
    let w = comm.size();
    let (g, scalars) = data.split_at_mut(grads.min(data.len()));
    gathered.clear();
    gathered.resize(g.len() * w, 0.0);
    comm.all_gather(g, gathered)?;
    if let Some((attack, liars, seed)) = attack {
        attack.apply(gathered, g.len(), liars, seed)?;
    }
    let parts: Vec<&[Real]> = gathered.chunks(g.len().max(1)).take(w).collect();
    shoal_ps::aggregate(rule, f, &parts, g)?;
    let scale = w as Real;
    g.iter_mut().for_each(|x| *x *= scale);
    if !scalars.is_empty() {
        comm.all_reduce(scalars, ReduceOp::Sum)?;
    }
    Ok(())
}
