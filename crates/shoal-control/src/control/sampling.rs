//! Sampling: each running task's CPU, memory and GPU, the host's network rates, and the cluster's allocation, stored
//! at a fixed period for the dashboard, the diagnosis and the cost report.

use std::time::Instant;

use shoal_exec::Usage;

use crate::db::{ClusterSample, JobRow, JobState, SampleRow, TaskRow};

use super::state::{Control, handle};

/// How often a running task's resources are stored.
pub const SAMPLE_EVERY_MS: i64 = 2000;
/// How often the cluster's allocation is stored.
pub const CLUSTER_SAMPLE_EVERY_MS: i64 = 5000;

impl Control {
    /// Samples the CPU and memory of a running task (kept every [`SAMPLE_EVERY_MS`], with the host's network rates
    /// read then); returns its usage now.
    pub(super) async fn sample(&self, t: &TaskRow) -> Option<Usage> {
        let mut u = self.exec.usage(&handle(t))?;
        if u.gpu_memory_bytes.is_none()
            && !t.gpus.is_empty()
            && let Some(pid) = t.pid
        {
            u.gpu_memory_bytes = self.gpus.session_memory(&crate::gpu::indices(&t.gpus), pid);
        }
        let k = (t.job_id.clone(), t.attempt, t.rank);
        let now_ms = self.db.now();
        let prev = self.sampled.lock().unwrap_or_else(|p| p.into_inner()).get(&k).copied();
        let due = prev.is_none_or(|(at, _)| now_ms - at >= SAMPLE_EVERY_MS);
        if due {
            let net = self.net_rates();
            let cpu_percent = prev.and_then(|(at, cpu)| {
                let dt = (now_ms - at) as f64 / 1000.0;
                (dt > 0.0).then(|| ((u.cpu_seconds - cpu) / dt * 100.0).max(0.0))
            });
            self.sampled.lock().unwrap_or_else(|p| p.into_inner()).insert(k, (now_ms, u.cpu_seconds));
            let gpu = if t.gpus.is_empty() { None } else { self.gpus.read(&crate::gpu::indices(&t.gpus)) };
            let row = SampleRow {
                rank: t.rank,
                time_ms: now_ms,
                cpu_percent,
                rss_bytes: Some(u.rss_bytes as i64),
                cpu_seconds: Some(u.cpu_seconds),
                net_rx_bytes_per_s: net.map(|n| n.0),
                net_tx_bytes_per_s: net.map(|n| n.1),
                gpu_util_percent: gpu.map(|g| g.util_percent),
                gpu_memory_bytes: gpu.map(|g| g.memory_bytes as i64),
                gpu_temperature_c: gpu.map(|g| g.temperature_c),
                gpu_power_w: gpu.map(|g| g.power_w),
            };
            if cpu_percent.is_some() {
                let _ = self.db.insert_samples(&t.job_id, std::slice::from_ref(&row)).await;
            }
            let _ = self.db.set_task_cpu(t, u.cpu_seconds).await;
        }
        Some(u)
    }

    /// The host's network rates since the previous call (bytes/s in, out).
    pub(super) fn net_rates(&self) -> Option<(f64, f64)> {
        let (rx, tx) = shoal_exec::procfs::host_net_bytes()?;
        let now_t = Instant::now();
        let mut prev = self.net_prev.lock().unwrap_or_else(|p| p.into_inner());
        let out = prev.and_then(|(at, prx, ptx): (Instant, u64, u64)| {
            let dt = now_t.duration_since(at).as_secs_f64();
            (dt >= 0.5).then(|| (rx.saturating_sub(prx) as f64 / dt, tx.saturating_sub(ptx) as f64 / dt))
        });
        if prev.is_none() || out.is_some() {
            *prev = Some((now_t, rx, tx));
        }
        drop(prev);
        let mut last = self.net_last.lock().unwrap_or_else(|p| p.into_inner());
        if out.is_some() {
            *last = out;
        }
        *last
    }

    /// Records the cluster's allocation (every [`CLUSTER_SAMPLE_EVERY_MS`]).
    pub(super) async fn sample_cluster(&self, active: &[JobRow]) {
        let now_ms = self.db.now();
        {
            let mut last = self.cluster_sampled.lock().unwrap_or_else(|p| p.into_inner());
            if now_ms - *last < CLUSTER_SAMPLE_EVERY_MS {
                return;
            }
            *last = now_ms;
        }
        let alloc = self.allocations();
        let c = ClusterSample {
            time_ms: now_ms,
            cpus_allocated: alloc.iter().map(|a| a.cpus_milli as f64 / 1000.0).sum(),
            memory_allocated_bytes: alloc.iter().map(|a| a.memory_bytes as i64).sum(),
            gpus_allocated: alloc.iter().flat_map(|a| a.gpus.iter().map(|g| f64::from(g.0) / 1000.0)).sum::<f64>()
                + 0.0,
            pending: active.iter().filter(|j| j.state == JobState::Pending).count() as i64,
            running: active.iter().filter(|j| j.state == JobState::Running).count() as i64,
        };
        if let Err(e) = self.db.insert_cluster_sample(&c).await {
            tracing::warn!(error = %e, "storing a cluster sample failed");
        }
    }
}
