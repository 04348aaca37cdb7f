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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct NodeFree {
    pub cpu: u64,
    pub mem: u64,
    pub gpus: Vec<GpuFree>,
}

impl NodeFree {
    pub fn of(node: &Node) -> NodeFree {
        NodeFree {
            cpu: node.cpus_milli,
            mem: node.memory_bytes,
            gpus: node.gpus.iter().map(|g| GpuFree { share: 1000, mem: g.memory_bytes }).collect(),
        }
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
        let gf = &mut n.gpus[g as usize];
        gf.share -= share;
        gf.mem -= r.gpu_memory_bytes;
    }
}

pub(crate) fn release(free: &mut [NodeFree], t: &TaskAlloc, r: &Resources) {
    let n = &mut free[t.node];
    n.cpu += r.cpus_milli;
    n.mem += r.memory_bytes;
    for &(g, share) in &t.gpus {
        let gf = &mut n.gpus[g as usize];
        gf.share += share;
        gf.mem += r.gpu_memory_bytes;
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

/// How many tasks of `r` fit on the node (in both states when `b` is given), at most `limit`.
pub(crate) fn node_cap(a: &NodeFree, b: Option<&NodeFree>, r: &Resources, limit: u32) -> u32 {
    let (cpu, mem) = match b {
        Some(b) => (a.cpu.min(b.cpu), a.mem.min(b.mem)),
        None => (a.cpu, a.mem),
    };
    let mut cap = limit as u64;
    if let Some(c) = cpu.checked_div(r.cpus_milli) {
        cap = cap.min(c);
    }
    if let Some(c) = mem.checked_div(r.memory_bytes) {
        cap = cap.min(c);
    }
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
        for i in 0..a.gpus.len() {
            let g = gpu_view(a, b, i);
            if g.share == 1000 && g.mem >= r.gpu_memory_bytes {
                whole += 1;
            }
        }
        g_cap = whole / per;
    }
    cap.min(g_cap) as u32
}
