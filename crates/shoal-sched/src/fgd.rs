//! Fragmentation gradient descent (Weng et al., "Beware of Fragmentation", ATC'23): a task goes to the node and
//! GPUs where the expected fragmentation of the cluster grows least.
//!
//! A node's fragmentation for a task shape `m` is the GPU capacity on it that a task of shape `m` could not use:
//! all of its free GPU capacity when `m` does not fit there at all (too few CPUs, too little memory, too few GPUs
//! with enough room, or `m` asks for no GPU); otherwise the free capacity of the GPUs that cannot hold `m`'s share
//! of one GPU (for a fraction `d < 1`, the GPUs with less than `d` free; for whole GPUs, the partly used ones).
//! The expected fragmentation weighs that over the workload, a distribution of task shapes. Units: thousandths
//! of a GPU.

use std::collections::HashSet;

use crate::free::{NodeFree, TaskAlloc, alloc, gpu_view, node_cap, release};
use crate::model::Resources;

/// Task shapes with their weights.
pub(crate) type Workload = [(Resources, u64)];

/// The free GPU capacity on `n` (thousandths of a GPU).
pub(crate) fn free_gpu(n: &NodeFree) -> u64 {
    n.gpus.iter().map(|g| g.share as u64).sum()
}

/// The GPU capacity on `n` that a task of shape `m` could not use; `total` is [`free_gpu`]`(n)`.
pub(crate) fn frag_for(n: &NodeFree, total: u64, m: &Resources) -> u64 {
    if total == 0 {
        return 0;
    }
    if m.gpus_milli == 0 || n.cpu < m.cpus_milli || n.mem < m.memory_bytes {
        return total;
    }
    if m.gpus_milli < 1000 {
        let fit = n.gpus.iter().filter(|g| g.share as u64 >= m.gpus_milli && g.mem >= m.gpu_memory_bytes);
        let usable: u64 = fit.map(|g| g.share as u64).sum();
        total - usable
    } else {
        let whole = n.gpus.iter().filter(|g| g.share == 1000 && g.mem >= m.gpu_memory_bytes).count() as u64;
        if whole >= m.gpus_milli / 1000 { total - 1000 * whole } else { total }
    }
}

/// The node's fragmentation weighed over the workload.
fn node_frag(n: &NodeFree, w: &Workload) -> u64 {
    let total = free_gpu(n);
    if total == 0 {
        return 0;
    }
    w.iter().map(|(m, weight)| weight * frag_for(n, total, m)).sum()
}

/// The GPU choices for one task of `r` on a node (the GPUs in both states when `b` is given): no GPU; for a
/// fraction, each GPU with room (one per distinct free state); for whole GPUs, the first fully free ones.
fn gpu_options(a: &NodeFree, b: Option<&NodeFree>, r: &Resources) -> Vec<Vec<(u32, u32)>> {
    if r.gpus_milli == 0 {
        return vec![Vec::new()];
    }
    if r.gpus_milli < 1000 {
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for i in 0..a.gpus.len() {
            let g = gpu_view(a, b, i);
            if (g.share as u64) < r.gpus_milli || g.mem < r.gpu_memory_bytes {
                continue;
            }
            let state = (g, a.gpus[i]);
            if !seen.contains(&state) {
                seen.push(state);
                out.push(vec![(i as u32, r.gpus_milli as u32)]);
            }
        }
        return out;
    }
    let per = (r.gpus_milli / 1000) as usize;
    let whole: Vec<(u32, u32)> = (0..a.gpus.len())
        .filter(|&i| {
            let g = gpu_view(a, b, i);
            g.share == 1000 && g.mem >= r.gpu_memory_bytes
        })
        .take(per)
        .map(|i| (i as u32, 1000))
        .collect();
    if whole.len() == per { vec![whole] } else { Vec::new() }
}

/// The task of `r` that adds least fragmentation, on a node not in `skip`; ties go to the node left with the
/// least free GPU capacity, then to the first node.
fn choose(
    a: &[NodeFree],
    b: Option<&[NodeFree]>,
    r: &Resources,
    w: &Workload,
    skip: &[usize],
    scratch: &mut NodeFree,
) -> Option<TaskAlloc> {
    let mut seen: HashSet<(&NodeFree, Option<&NodeFree>)> = HashSet::new();
    // (added fragmentation, free GPU left, node) and the GPUs.
    type Choice = ((i64, u64, usize), Vec<(u32, u32)>);
    let mut best: Option<Choice> = None;
    for (i, na) in a.iter().enumerate() {
        let nb = b.map(|b| &b[i]);
        if skip.contains(&i) || node_cap(na, nb, r, 1) == 0 || !seen.insert((na, nb)) {
            continue;
        }
        let before = node_frag(na, w) as i64;
        for gpus in gpu_options(na, nb, r) {
            scratch.clone_from(na);
            scratch.cpu -= r.cpus_milli;
            scratch.mem -= r.memory_bytes;
            for &(g, share) in &gpus {
                scratch.take_gpu(g as usize, share, r.gpu_memory_bytes);
            }
            let key = (node_frag(scratch, w) as i64 - before, free_gpu(scratch), i);
            if best.as_ref().is_none_or(|(k, _)| key < *k) {
                best = Some((key, gpus));
            }
        }
    }
    best.map(|((_, _, node), gpus)| TaskAlloc { node, gpus })
}

/// Places a gang of `k` tasks one task at a time, each where it adds least fragmentation (all or nothing),
/// allocating in `a` and, when given, in `b` too. `None` when some task finds no room.
pub(crate) fn place(
    a: &mut [NodeFree],
    mut b: Option<&mut [NodeFree]>,
    r: &Resources,
    k: u32,
    spread: bool,
    w: &Workload,
) -> Option<Vec<TaskAlloc>> {
    let mut tasks: Vec<TaskAlloc> = Vec::with_capacity(k as usize);
    let mut scratch = NodeFree { cpu: 0, mem: 0, gpus: Vec::new(), whole: 0, mem_floor: 0 };
    let mut used: Vec<usize> = Vec::new();
    for _ in 0..k {
        let skip: &[usize] = if spread { &used } else { &[] };
        let Some(t) = choose(a, b.as_deref(), r, w, skip, &mut scratch) else {
            for t in &tasks {
                release(a, t, r);
                if let Some(b) = b.as_deref_mut() {
                    release(b, t, r);
                }
            }
            return None;
        };
        alloc(a, &t, r);
        if let Some(b) = b.as_deref_mut() {
            alloc(b, &t, r);
        }
        used.push(t.node);
        tasks.push(t);
    }
    Some(tasks)
}
