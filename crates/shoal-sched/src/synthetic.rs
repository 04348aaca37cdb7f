//! A synthetic cluster and workload for benchmarks and property tests, drawn
//! from the crate's own small generator (SplitMix64) so any seed replays exactly.

use std::collections::BTreeMap;

use crate::model::{Gpu, JobRequest, Node, Queue, Quota, Resources};

const GIB: u64 = 1 << 30;

/// SplitMix64: tiny, seeded, good enough for workloads.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// `nodes` identical nodes (`node-00000`…), each with 128 cores, 2 TiB of
/// memory and `gpus_per_node` 80 GiB GPUs.
pub fn synthetic_cluster(nodes: usize, gpus_per_node: usize) -> Vec<Node> {
    (0..nodes)
        .map(|i| Node {
            id: format!("node-{i:05}"),
            host: format!("host-{i:05}"),
            cpus_milli: 128_000,
            memory_bytes: 2048 * GIB,
            gpus: (0..gpus_per_node)
                .map(|g| Gpu { index: g as u32, memory_bytes: 80 * GIB, kind: "H100".into() })
                .collect(),
            labels: BTreeMap::new(),
        })
        .collect()
}

/// One queue, `default`, that may use the whole cluster.
pub fn synthetic_queues() -> Vec<Queue> {
    vec![Queue { name: "default".into(), guaranteed: Quota::UNLIMITED, can_borrow: true }]
}

/// `n` jobs (`job-000000`…) in queue `default` from 8 teams: a mix of half-GPU
/// notebooks, one-GPU jobs, multi-GPU and multi-node gangs, elastic ranges and
/// CPU-only jobs, priorities 0 to 3, expected run times 10 min to 10 h.
pub fn synthetic_jobs(n: usize, seed: u64) -> Vec<JobRequest> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|i| {
            let roll = rng.range(0, 99);
            let (min, max, gpus, gmem, cpus, mem) = match roll {
                0..=19 => (1, 1, 500, 20 * GIB, 4_000, 16 * GIB),
                20..=49 => (1, 1, 1000, 40 * GIB, 8_000, 64 * GIB),
                50..=64 => {
                    let k = rng.range(2, 4) as u32;
                    (k, k, 2000, 60 * GIB, 16_000, 128 * GIB)
                }
                65..=79 => (1, 1, 8000, 80 * GIB, 96_000, 1024 * GIB),
                80..=89 => {
                    let k = rng.range(2, 8) as u32;
                    (k, k + rng.range(0, 4) as u32, 8000, 80 * GIB, 96_000, 1024 * GIB)
                }
                _ => {
                    let k = rng.range(1, 8) as u32;
                    (k, k, 0, 0, 4_000, 8 * GIB)
                }
            };
            JobRequest {
                id: format!("job-{i:06}"),
                team: format!("team-{}", rng.range(0, 7)),
                queue: "default".into(),
                priority: rng.range(0, 3) as i32,
                tasks_min: min,
                tasks_max: max,
                per_task: Resources { cpus_milli: cpus, memory_bytes: mem, gpus_milli: gpus, gpu_memory_bytes: gmem },
                spread: false,
                submitted_at_ms: i as u64,
                expected_runtime_ms: Some(rng.range(600_000, 36_000_000)),
                avoid_nodes: Vec::new(),
            }
        })
        .collect()
}
