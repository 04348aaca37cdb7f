//! Free capacity per node, and how many tasks of a shape a node holds (in two states at once when asked: the
//! cluster now and at the backfill reservation's start).

use crate::model::{Node, Resources};

/// Free share and memory of one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GpuFree {
    pub share: u32,
    pub mem: u64,
}

/// Free capacity of one node.
///
/// Invariant: `whole` is the number of `gpus` wholly free (share 1000; such a GPU has all its memory free, at
/// least `mem_floor`, the smallest GPU memory of the node). Whoever changes a share keeps it (`alloc`,
/// `release`). Equality and hashing look at the free capacity only (`cpu`, `mem`, `gpus`).
#[derive(Debug)]
pub(crate) struct NodeFree {
    pub cpu: u64,
    pub mem: u64,
    pub gpus: Vec<GpuFree>,
    pub whole: u32,
    pub mem_floor: u64,
}

impl NodeFree {
    pub fn of(node: &Node) -> NodeFree {
        NodeFree {
            cpu: node.cpus_milli,
            mem: node.memory_bytes,
            gpus: node.gpus.iter().map(|g| GpuFree { share: 1000, mem: g.memory_bytes }).collect(),
            whole: node.gpus.len() as u32,
            mem_floor: node.gpus.iter().map(|g| g.memory_bytes).min().unwrap_or(0),
        }
    }

    /// A node of this one's GPUs with nothing free.
    pub fn none_like(&self) -> NodeFree {
        NodeFree {
            cpu: 0,
            mem: 0,
            gpus: vec![GpuFree { share: 0, mem: 0 }; self.gpus.len()],
            whole: 0,
            mem_floor: self.mem_floor,
        }
    }

    /// Takes `share` and `mem` of GPU `g`.
    #[inline]
    pub fn take_gpu(&mut self, g: usize, share: u32, mem: u64) {
        let gf = &mut self.gpus[g];
        if gf.share == 1000 && share > 0 {
            self.whole -= 1;
        }
        gf.share -= share;
        gf.mem -= mem;
    }

    /// Gives back `share` and `mem` of GPU `g`.
    #[inline]
    pub fn give_gpu(&mut self, g: usize, share: u32, mem: u64) {
        let gf = &mut self.gpus[g];
        let was = gf.share == 1000;
        gf.share += share;
        gf.mem += mem;
        if !was && gf.share == 1000 {
            self.whole += 1;
        }
    }
}

impl Clone for NodeFree {
    fn clone(&self) -> NodeFree {
        NodeFree { cpu: self.cpu, mem: self.mem, gpus: self.gpus.clone(), whole: self.whole, mem_floor: self.mem_floor }
    }

    /// Reuses `self`'s GPU vector.
    fn clone_from(&mut self, o: &NodeFree) {
        self.cpu = o.cpu;
        self.mem = o.mem;
        self.gpus.clone_from(&o.gpus);
        self.whole = o.whole;
        self.mem_floor = o.mem_floor;
    }
}

impl PartialEq for NodeFree {
    fn eq(&self, o: &NodeFree) -> bool {
        self.cpu == o.cpu && self.mem == o.mem && self.gpus == o.gpus
    }
}

impl Eq for NodeFree {}

impl std::hash::Hash for NodeFree {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.cpu.hash(h);
        self.mem.hash(h);
        self.gpus.hash(h);
    }
}

/// One placed task: node position and `(gpu position on the node, share)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TaskAlloc {
    pub node: usize,
    pub gpus: Vec<(u32, u32)>,
}

pub(crate) fn alloc(free: &mut [NodeFree], t: &TaskAlloc, r: &Resources) {
    let n = &mut free[t.node];
    n.cpu -= r.cpus_milli;
    n.mem -= r.memory_bytes;
    for &(g, share) in &t.gpus {
        n.take_gpu(g as usize, share, r.gpu_memory_bytes);
    }
}

pub(crate) fn release(free: &mut [NodeFree], t: &TaskAlloc, r: &Resources) {
    let n = &mut free[t.node];
    n.cpu += r.cpus_milli;
    n.mem += r.memory_bytes;
    for &(g, share) in &t.gpus {
        n.give_gpu(g as usize, share, r.gpu_memory_bytes);
    }
}

#[inline]
pub(crate) fn gpu_view(a: &NodeFree, b: Option<&NodeFree>, i: usize) -> GpuFree {
    let ga = a.gpus[i];
    match b {
        Some(b) => {
            let gb = b.gpus[i];
            GpuFree { share: ga.share.min(gb.share), mem: ga.mem.min(gb.mem) }
        }
        None => ga,
    }
}

/// `min(cap, have / each)` (`cap` when `each` is 0), without dividing when `have` holds `cap` of them.
#[inline]
fn cap_by(cap: u64, have: u64, each: u64) -> u64 {
    if each == 0 {
        return cap;
    }
    match cap.checked_mul(each) {
        Some(need) if have >= need => cap,
        _ => cap.min(have / each),
    }
}

/// How many tasks of `r` fit on the node (in both states when `b` is given), at most `limit`.
pub(crate) fn node_cap(a: &NodeFree, b: Option<&NodeFree>, r: &Resources, limit: u32) -> u32 {
    let (cpu, mem) = match b {
        Some(b) => (a.cpu.min(b.cpu), a.mem.min(b.mem)),
        None => (a.cpu, a.mem),
    };
    let mut cap = limit as u64;
    cap = cap_by(cap, cpu, r.cpus_milli);
    cap = cap_by(cap, mem, r.memory_bytes);
    if cap == 0 || r.gpus_milli == 0 {
        return cap as u32;
    }
    let mut g_cap = 0u64;
    if r.gpus_milli < 1000 {
        for i in 0..a.gpus.len() {
            let g = gpu_view(a, b, i);
            let mut c = g.share as u64 / r.gpus_milli;
            if let Some(m) = g.mem.checked_div(r.gpu_memory_bytes) {
                c = c.min(m);
            }
            g_cap += c;
            if g_cap >= cap {
                break;
            }
        }
    } else {
        let per = r.gpus_milli / 1000;
        let mut whole = 0u64;
        if b.is_none() && r.gpu_memory_bytes <= a.mem_floor {
            // Every wholly free GPU has the memory.
            whole = a.whole as u64;
        } else {
            for i in 0..a.gpus.len() {
                let g = gpu_view(a, b, i);
                if g.share == 1000 && g.mem >= r.gpu_memory_bytes {
                    whole += 1;
                }
            }
        }
        g_cap = cap_by(cap, whole, per);
    }
    cap.min(g_cap) as u32
}

/// Whether a gang fits, kept up to date as tasks are released and allocated, at the cost of the nodes they touch
/// rather than a scan of the cluster: the sum over nodes of how many of the gang's tasks each holds (at most the
/// gang, or one when spread). Invariant: `have` is that sum for the cluster last passed to it, so `fits` agrees with
/// `place::fits` on it — as long as every change to that cluster goes through `release`/`alloc`.
#[derive(Debug, Clone)]
pub(crate) struct FitCount<'r> {
    r: &'r Resources,
    k: u32,
    limit: u32,
    have: u64,
}

impl<'r> FitCount<'r> {
    /// Counts over the whole cluster (one scan).
    pub fn new(free: &[NodeFree], r: &'r Resources, k: u32, spread: bool) -> FitCount<'r> {
        let limit = if spread { 1 } else { k };
        let have = free.iter().map(|n| node_cap(n, None, r, limit) as u64).sum();
        FitCount { r, k, limit, have }
    }

    pub fn fits(&self) -> bool {
        self.have >= self.k as u64
    }

    fn change(&mut self, free: &mut [NodeFree], t: &TaskAlloc, tr: &Resources, give_back: bool) {
        let old = node_cap(&free[t.node], None, self.r, self.limit) as u64;
        if give_back {
            release(free, t, tr);
        } else {
            alloc(free, t, tr);
        }
        let new = node_cap(&free[t.node], None, self.r, self.limit) as u64;
        self.have = self.have - old + new;
    }

    /// [`release`], counted.
    pub fn release(&mut self, free: &mut [NodeFree], t: &TaskAlloc, tr: &Resources) {
        self.change(free, t, tr, true);
    }

    /// [`alloc`], counted.
    pub fn alloc(&mut self, free: &mut [NodeFree], t: &TaskAlloc, tr: &Resources) {
        self.change(free, t, tr, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Gpu;

    const GIB: u64 = 1 << 30;

    fn node(gpu_mem_gib: &[u64]) -> NodeFree {
        NodeFree::of(&Node {
            id: "n".into(),
            host: "h".into(),
            cpus_milli: 32_000,
            memory_bytes: 256 * GIB,
            gpus: gpu_mem_gib
                .iter()
                .enumerate()
                .map(|(i, &m)| Gpu { index: i as u32, memory_bytes: m * GIB, kind: "g".into() })
                .collect(),
            labels: Default::default(),
        })
    }

    fn shape(cpu: u64, milli: u64, gpu_mem_gib: u64) -> Resources {
        Resources { cpus_milli: cpu, memory_bytes: GIB, gpus_milli: milli, gpu_memory_bytes: gpu_mem_gib * GIB }
    }

    /// `node_cap` by the plain count over the GPUs, without the `whole` shortcut.
    fn cap_plain(a: &NodeFree, r: &Resources, limit: u32) -> u32 {
        let mut b = a.clone();
        b.mem_floor = 0; // forces the loop
        node_cap(&b, Some(a), r, limit)
    }

    #[test]
    fn the_whole_gpu_count_and_the_fit_count_follow_every_change() {
        // (GPU memories of the node's GPUs, GiB) for each node; the tasks placed then released, in order:
        // (node, shape: cpu milli, GPU milli, GPU memory GiB; GPUs as (position, share)).
        let nodes: [&[u64]; 3] = [&[80, 80, 80, 80], &[16, 32], &[]];
        type Step = (usize, (u64, u64, u64), &'static [(u32, u32)]);
        let steps: &[Step] = &[
            (0, (1000, 2000, 10), &[(0, 1000), (1, 1000)]),
            (0, (500, 500, 8), &[(2, 500)]),
            (1, (500, 250, 4), &[(1, 250)]),
            (0, (500, 500, 8), &[(2, 500)]),
            (1, (2000, 1000, 16), &[(0, 1000)]),
            (2, (4000, 0, 0), &[]),
        ];
        // The gangs asked about: (shape, tasks, spread).
        let asks: &[((u64, u64, u64), u32, bool)] = &[
            ((1000, 1000, 0), 3, false),
            ((1000, 1000, 20), 2, false),
            ((1000, 2000, 0), 2, false),
            ((500, 500, 8), 4, false),
            ((500, 250, 30), 2, true),
            ((100, 0, 0), 3, true),
        ];
        let mut free: Vec<NodeFree> = nodes.iter().map(|g| node(g)).collect();
        let pristine = free.clone();
        let tasks: Vec<(TaskAlloc, Resources)> = steps
            .iter()
            .map(|&(n, (c, g, m), gpus)| (TaskAlloc { node: n, gpus: gpus.to_vec() }, shape(c, g, m)))
            .collect();
        let check = |free: &[NodeFree], counts: &[FitCount<'_>]| {
            for n in free {
                assert_eq!(n.whole as usize, n.gpus.iter().filter(|g| g.share == 1000).count());
            }
            for (c, &(_, k, spread)) in counts.iter().zip(asks) {
                let plain: u64 = free.iter().map(|n| cap_plain(n, c.r, if spread { 1 } else { k }) as u64).sum();
                assert_eq!(c.have, plain);
                assert_eq!(c.fits(), plain >= k as u64);
                for n in free {
                    assert_eq!(node_cap(n, None, c.r, u32::MAX), cap_plain(n, c.r, u32::MAX));
                }
            }
        };
        let shapes: Vec<Resources> = asks.iter().map(|&((c, g, m), _, _)| shape(c, g, m)).collect();
        let mut counts: Vec<FitCount<'_>> =
            asks.iter().zip(&shapes).map(|(&(_, k, spread), r)| FitCount::new(&free, r, k, spread)).collect();
        // Each count follows its own copy of the cluster; `free` changes by the plain `alloc`/`release`.
        let mut copies: Vec<Vec<NodeFree>> = vec![free.clone(); asks.len()];
        check(&free, &counts);
        for (t, r) in &tasks {
            alloc(&mut free, t, r);
            for (c, copy) in counts.iter_mut().zip(&mut copies) {
                c.alloc(copy, t, r);
                assert_eq!(*copy, free);
            }
            check(&free, &counts);
        }
        for (t, r) in tasks.iter().rev() {
            release(&mut free, t, r);
            for (c, copy) in counts.iter_mut().zip(&mut copies) {
                c.release(copy, t, r);
                assert_eq!(*copy, free);
            }
            check(&free, &counts);
        }
        assert_eq!(free, pristine);
        assert!(free.iter().zip(&pristine).all(|(a, b)| a.whole == b.whole));
    }
}
