//! GPU telemetry through NVML (feature `nvml`): what a node has, and per task the utilisation, memory,
//! temperature and power of the GPUs it was given. Without the feature, or where NVML cannot be loaded (no driver),
//! every answer is "none" and the rest of the server is unchanged.

/// One GPU as the node offers it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuInfo {
    pub index: u32,
    pub name: String,
    pub memory_bytes: u64,
}

/// A reading over a task's GPUs: mean utilisation, memory used, hottest temperature, total power.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuReading {
    pub util_percent: f64,
    pub memory_bytes: u64,
    pub temperature_c: f64,
    pub power_w: f64,
}

#[cfg(feature = "nvml")]
mod imp {
    use super::{GpuInfo, GpuReading};
    use nvml_wrapper::Nvml;
    use nvml_wrapper::enum_wrappers::device::TemperatureSensor;

    /// NVML, loaded once.
    #[derive(Debug)]
    pub struct Gpus {
        nvml: Option<Nvml>,
    }

    impl Gpus {
        pub fn new() -> Gpus {
            match Nvml::init() {
                Ok(n) => Gpus { nvml: Some(n) },
                Err(e) => {
                    tracing::info!(error = %e, "NVML not available; no GPU telemetry");
                    Gpus { nvml: None }
                }
            }
        }

        pub fn list(&self) -> Vec<GpuInfo> {
            let Some(n) = &self.nvml else { return Vec::new() };
            let count = n.device_count().unwrap_or(0);
            (0..count)
                .filter_map(|i| {
                    let d = n.device_by_index(i).ok()?;
                    Some(GpuInfo {
                        index: i,
                        name: d.name().unwrap_or_else(|_| "gpu".into()),
                        memory_bytes: d.memory_info().map(|m| m.total).unwrap_or(0),
                    })
                })
                .collect()
        }

        pub fn read(&self, indices: &[u32]) -> Option<GpuReading> {
            let n = self.nvml.as_ref()?;
            let mut r = GpuReading::default();
            let mut seen = 0u32;
            for &i in indices {
                let Ok(d) = n.device_by_index(i) else { continue };
                seen += 1;
                r.util_percent += d.utilization_rates().map(|u| f64::from(u.gpu)).unwrap_or(0.0);
                r.memory_bytes += d.memory_info().map(|m| m.used).unwrap_or(0);
                r.temperature_c =
                    r.temperature_c.max(d.temperature(TemperatureSensor::Gpu).map(f64::from).unwrap_or(0.0));
                r.power_w += d.power_usage().map(|mw| f64::from(mw) / 1000.0).unwrap_or(0.0);
            }
            (seen > 0).then(|| {
                r.util_percent /= f64::from(seen);
                r
            })
        }

        /// GPU memory held on the GPUs `indices` by the processes of session `sid` (a task's processes: it leads
        /// its own session), from NVML's per-process figures; `None` when NVML cannot tell.
        pub fn session_memory(&self, indices: &[u32], sid: i64) -> Option<u64> {
            use nvml_wrapper::enums::device::UsedGpuMemory;
            let n = self.nvml.as_ref()?;
            let mut held = 0u64;
            let mut seen = false;
            for &i in indices {
                let Ok(d) = n.device_by_index(i) else { continue };
                let Ok(procs) = d.running_compute_processes() else { continue };
                seen = true;
                for p in procs {
                    if shoal_exec::procfs::session_of(i64::from(p.pid)) == Some(sid)
                        && let UsedGpuMemory::Used(b) = p.used_gpu_memory
                    {
                        held += b;
                    }
                }
            }
            seen.then_some(held)
        }
    }
}

#[cfg(not(feature = "nvml"))]
mod imp {
    use super::{GpuInfo, GpuReading};

    /// Built without the `nvml` feature: no GPU telemetry.
    #[derive(Debug)]
    pub struct Gpus;

    impl Gpus {
        pub fn new() -> Gpus {
            Gpus
        }

        pub fn list(&self) -> Vec<GpuInfo> {
            Vec::new()
        }

        pub fn read(&self, _indices: &[u32]) -> Option<GpuReading> {
            None
        }

        pub fn session_memory(&self, _indices: &[u32], _sid: i64) -> Option<u64> {
            None
        }
    }
}

pub use imp::Gpus;

impl Default for Gpus {
    fn default() -> Self {
        Gpus::new()
    }
}

/// `0,2` (a task's `CUDA_VISIBLE_DEVICES`) as indices.
pub fn indices(list: &str) -> Vec<u32> {
    list.split(',').filter_map(|s| s.trim().parse().ok()).collect()
}
