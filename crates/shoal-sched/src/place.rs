//! Free capacity per node and gang placement over it (packing, spreading,
//! GPU-memory-aware, fractional GPUs). Placement may look at two states at once:
//! the cluster now and the cluster at the backfill reservation's start; a task
//! then only goes where it fits in both.

use crate::fgd;
pub(crate) use crate::free::{NodeFree, TaskAlloc, alloc, release};
use crate::free::{gpu_view, node_cap};
use crate::model::Resources;

/// How a gang's tasks choose their places.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pack<'a> {
    /// Best fit ([`crate::Packing::BestFit`]).
    BestFit,
    /// Least added fragmentation against this workload ([`crate::Packing::Fgd`]); best fit when it is empty.
    Fgd(&'a fgd::Workload),
}

/// Chooses nodes and task counts for a gang of `k` tasks, or `None`.
fn plan(a: &[NodeFree], b: Option<&[NodeFree]>, r: &Resources, k: u32, spread: bool) -> Option<Vec<(usize, u32)>> {
    if k == 0 {
        return Some(Vec::new());
    }
    if spread {
        let mut out = Vec::with_capacity((k as usize).min(a.len()));
        for i in 0..a.len() {
            if node_cap(&a[i], b.map(|b| &b[i]), r, 1) >= 1 {
                out.push((i, 1));
                if out.len() == k as usize {
                    return Some(out);
                }
            }
        }
        return None;
    }
    // Best fit on one node: the fullest node that still holds the whole gang.
    let mut best: Option<(u32, usize)> = None;
    let mut caps: Vec<(u32, usize)> = Vec::new();
    let mut total = 0u64;
    for i in 0..a.len() {
        let c = node_cap(&a[i], b.map(|b| &b[i]), r, u32::MAX);
        if c == 0 {
            continue;
        }
        if c >= k {
            if best.is_none_or(|(bc, _)| c < bc) {
                best = Some((c, i));
                if c == k {
                    break;
                }
            }
        } else if best.is_none() {
            total += c as u64;
            caps.push((c, i));
        }
    }
    if let Some((_, i)) = best {
        return Some(vec![(i, k)]);
    }
    if total < k as u64 {
        return None;
    }
    // Fewest hosts: the roomiest nodes first.
    caps.sort_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
    let mut left = k;
    let mut out = Vec::new();
    for (c, i) in caps {
        let take = c.min(left);
        out.push((i, take));
        left -= take;
        if left == 0 {
            break;
        }
    }
    Some(out)
}

/// Picks the GPUs of one task on node `i`.
fn pick_gpus(a: &NodeFree, b: Option<&NodeFree>, r: &Resources) -> Option<Vec<(u32, u32)>> {
    if r.gpus_milli == 0 {
        return Some(Vec::new());
    }
    if r.gpus_milli < 1000 {
        // Best fit: the busiest GPU that still has room, so fractions share GPUs.
        let mut best: Option<(u32, usize)> = None;
        for i in 0..a.gpus.len() {
            let g = gpu_view(a, b, i);
            if g.share as u64 >= r.gpus_milli && g.mem >= r.gpu_memory_bytes && best.is_none_or(|(s, _)| g.share < s) {
                best = Some((g.share, i));
            }
        }
        return best.map(|(_, i)| vec![(i as u32, r.gpus_milli as u32)]);
    }
    let per = (r.gpus_milli / 1000) as usize;
    let mut out = Vec::with_capacity(per);
    for i in 0..a.gpus.len() {
        let g = gpu_view(a, b, i);
        if g.share == 1000 && g.mem >= r.gpu_memory_bytes {
            out.push((i as u32, 1000));
            if out.len() == per {
                return Some(out);
            }
        }
    }
    None
}

/// Places a gang of `k` tasks (all or nothing), allocating in `a` and, when
/// given, in `b` too.
pub(crate) fn place(
    a: &mut [NodeFree],
    mut b: Option<&mut [NodeFree]>,
    r: &Resources,
    k: u32,
    spread: bool,
    pack: Pack<'_>,
) -> Option<Vec<TaskAlloc>> {
    if let Pack::Fgd(w) = pack
        && !w.is_empty()
    {
        if k == 1 {
            return fgd::place(a, b, r, k, spread, w);
        }
        plan(a, b.as_deref(), r, k, spread)?;
        if let Some(placed) = fgd::place(a, b.as_deref_mut(), r, k, spread, w) {
            return Some(placed);
        }
        // One task at a time may strand the gang where the planned placement fits it: best fit then.
    }
    let chosen = plan(a, b.as_deref(), r, k, spread)?;
    let mut tasks = Vec::new();
    for (node, count) in chosen {
        for _ in 0..count {
            let gpus = pick_gpus(&a[node], b.as_deref().map(|b| &b[node]), r);
            let Some(gpus) = gpus else {
                // Cannot happen (counts come from node_cap); undo and give up.
                for t in &tasks {
                    release(a, t, r);
                    if let Some(b) = b.as_deref_mut() {
                        release(b, t, r);
                    }
                }
                return None;
            };
            let t = TaskAlloc { node, gpus };
            alloc(a, &t, r);
            if let Some(b) = b.as_deref_mut() {
                alloc(b, &t, r);
            }
            tasks.push(t);
        }
    }
    Some(tasks)
}

/// [`place`], first on the nodes not in `avoid` (positions: a node the job should leave if it can, such as the one
/// its replaced straggler ran on), then, when the gang does not fit there, anywhere.
pub(crate) fn place_avoiding(
    a: &mut [NodeFree],
    mut b: Option<&mut [NodeFree]>,
    r: &Resources,
    k: u32,
    spread: bool,
    avoid: &[usize],
    pack: Pack<'_>,
) -> Option<Vec<TaskAlloc>> {
    if !avoid.is_empty()
        && avoid.len() < a.len()
        && let Some(placed) = place_excluding(a, b.as_deref_mut(), r, k, spread, avoid, pack)
    {
        return Some(placed);
    }
    place(a, b, r, k, spread, pack)
}

/// Like [`place`], on every node but those at `exclude` (none of them is used, whatever is left).
pub(crate) fn place_excluding(
    a: &mut [NodeFree],
    b: Option<&mut [NodeFree]>,
    r: &Resources,
    k: u32,
    spread: bool,
    exclude: &[usize],
    pack: Pack<'_>,
) -> Option<Vec<TaskAlloc>> {
    let n = a.len();
    let mut kept: Vec<(usize, NodeFree)> = Vec::with_capacity(exclude.len());
    for &i in exclude.iter().filter(|&&i| i < n) {
        if kept.iter().all(|(j, _)| *j != i) {
            let empty = a[i].none_like();
            kept.push((i, std::mem::replace(&mut a[i], empty)));
        }
    }
    let placed = place(a, b, r, k, spread, pack);
    for (i, n) in kept {
        // What the placement took from other nodes stays taken; the excluded nodes come back whole.
        a[i] = n;
    }
    placed
}

/// Whether a gang of `k` tasks fits (no change); agrees with [`place`], but
/// stops at the first nodes that are enough.
pub(crate) fn fits(a: &[NodeFree], r: &Resources, k: u32, spread: bool) -> bool {
    let mut have = 0u64;
    for n in a {
        have += node_cap(n, None, r, if spread { 1 } else { k }) as u64;
        if have >= k as u64 {
            return true;
        }
    }
    k == 0
}
