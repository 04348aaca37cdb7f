//! Where a rank computes: the CPU unless the task was given GPUs (`resources.gpus`), then the CUDA device its
//! local rank falls on among those it sees.
//!
//! Invariants:
//! - A task given no GPU computes on the CPU, whatever the host has.
//! - A task given GPUs either gets a CUDA device or is refused with an error that names `resources.gpus` and what
//!   is missing — a build without the `cuda` feature, a host without the CUDA driver, no device visible — never a
//!   panic and never a silent fall back to the CPU. The driver is probed for before a device is opened: candle
//!   links `libcuda` (a `cuda` build does not start without one), so the probe tells the build's stand-in library
//!   (what a machine without a driver runs the `cuda` build's tests against) from a driver, then asks the driver.
//! - Which GPUs a task sees is the launcher's business: the executors write the task's assigned GPUs into
//!   `CUDA_VISIBLE_DEVICES` (through `shoal_comm::env::TaskEnv::vars`), which renumbers them from 0 for the
//!   process. Ranks of one host that share what they see (`shoal run` gives no list) take devices by local rank,
//!   round robin; fractional GPUs (`gpus = 0.5`) are tasks that see the same one device.
//! - The decision ([`choose`]) is a pure function of what was asked and what was found ([`Probe`]), so every
//!   refusal is tested on a machine without a GPU.

use crate::error::{Error, Result};
use crate::spec::JobSpec;

/// Where a rank computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Cpu,
    /// CUDA device `ordinal` as the process numbers them (after `CUDA_VISIBLE_DEVICES`).
    Cuda {
        ordinal: usize,
    },
}

impl Placement {
    pub fn is_cuda(&self) -> bool {
        matches!(self, Placement::Cuda { .. })
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Cpu => write!(f, "cpu"),
            Placement::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// What a task asked for and was given.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Asked {
    /// `resources.gpus` in thousandths of a GPU.
    pub gpus_milli: u64,
    /// `CUDA_VISIBLE_DEVICES` as the launcher set it (`None`: not set, every device of the host).
    pub visible: Option<String>,
    /// This rank's place among the ranks of its host.
    pub local_rank: usize,
}

impl Asked {
    /// What `spec` asks for and this process's environment gives.
    pub fn from_env(spec: &JobSpec) -> Asked {
        use shoal_comm::env::var;
        Asked {
            gpus_milli: spec.resources.gpus,
            visible: std::env::var(var::VISIBLE_GPUS).ok(),
            local_rank: std::env::var(var::LOCAL_RANK).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0),
        }
    }

    /// The devices `CUDA_VISIBLE_DEVICES` lists (`None` when it is not set). CUDA stops at the first entry that is
    /// not a device (`-1`, `NoDevFiles`), and an empty value hides them all.
    pub fn visible_devices(&self) -> Option<Vec<String>> {
        let v = self.visible.as_deref()?;
        Some(
            v.split(',')
                .map(str::trim)
                .take_while(|d| !d.is_empty() && !d.starts_with('-') && *d != "NoDevFiles")
                .map(str::to_owned)
                .collect(),
        )
    }
}

/// What this process found of CUDA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// This binary was built without the `cuda` feature.
    NotBuilt,
    /// The CUDA driver library (`libcuda.so`) is not on this host.
    NoDriver,
    /// The driver is there but failed to start (its own words).
    DriverError(String),
    /// The driver counts this many devices (those `CUDA_VISIBLE_DEVICES` lets it see).
    Devices(usize),
}

/// `resources.gpus` as written (`0.5`, `2`).
fn gpus_text(milli: u64) -> String {
    if milli.is_multiple_of(1000) { format!("{}", milli / 1000) } else { format!("{}", milli as f64 / 1000.0) }
}

/// Where a rank that asked for `asked` computes, given what was found (see the module's invariants).
pub fn choose(asked: &Asked, probe: &Probe) -> Result<Placement> {
    if asked.gpus_milli == 0 {
        return Ok(Placement::Cpu);
    }
    let gpus = gpus_text(asked.gpus_milli);
    let refuse = |what: String| Err(Error::Spec(format!("resources.gpus = {gpus} asks for a GPU, but {what}")));
    let listed = asked.visible_devices();
    if let Some(l) = &listed
        && l.is_empty()
    {
        return refuse(format!(
            "the task was given none (CUDA_VISIBLE_DEVICES={:?})",
            asked.visible.as_deref().unwrap_or_default()
        ));
    }
    let found = match probe {
        Probe::NotBuilt => {
            return refuse(
                "this shoal was built without the `cuda` feature: build it with `--features cuda` (README: \
                 building with CUDA), or set resources.gpus = 0 to train on the CPU"
                    .into(),
            );
        }
        Probe::NoDriver => {
            return refuse(
                "this host has no CUDA driver (libcuda.so was not found): run on a GPU host, or set \
                 resources.gpus = 0"
                    .into(),
            );
        }
        Probe::DriverError(e) => return refuse(format!("the CUDA driver failed to start: {e}")),
        Probe::Devices(0) => return refuse("the CUDA driver sees no device on this host".into()),
        Probe::Devices(n) => *n,
    };
    // The devices this rank may take from: those listed (the driver sees exactly those), else all.
    let count = listed.map_or(found, |l| l.len().min(found)).max(1);
    Ok(Placement::Cuda { ordinal: asked.local_rank % count })
}

/// What this process finds of CUDA. Without the `cuda` feature, [`Probe::NotBuilt`]; with it, the driver
/// library is looked for before any call into it.
pub fn probe() -> Probe {
    #[cfg(feature = "cuda")]
    {
        cuda::probe()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Probe::NotBuilt
    }
}

/// The candle device of a placement.
pub fn open(p: &Placement) -> Result<candle_core::Device> {
    match p {
        Placement::Cpu => Ok(candle_core::Device::Cpu),
        #[cfg(feature = "cuda")]
        Placement::Cuda { ordinal } => cuda::open(*ordinal),
        #[cfg(not(feature = "cuda"))]
        Placement::Cuda { ordinal } => Err(Error::Spec(format!(
            "resources.gpus: device cuda:{ordinal} asked of a shoal built without the `cuda` feature"
        ))),
    }
}

/// The device `spec`'s rank computes on in this process: [`choose`] over [`Asked::from_env`] and [`probe`], opened.
pub fn select(spec: &JobSpec) -> Result<(Placement, candle_core::Device)> {
    let asked = Asked::from_env(spec);
    // Probing loads the driver: only for a task that asked for a GPU.
    let found = if asked.gpus_milli == 0 { Probe::NotBuilt } else { probe() };
    let placement = choose(&asked, &found)?;
    let device = open(&placement)?;
    Ok((placement, device))
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::Probe;
    use crate::error::{Error, Result};
    use candle_core::cuda::cudarc;

    /// Whether the `libcuda` this process was linked against is the build's stand-in (see
    /// `scripts/cuda-toolchain.sh`), which marks itself with `shoal_cuda_stub`, rather than a driver.
    fn stand_in() -> bool {
        // SAFETY: `dlsym` on the default handle with a NUL-terminated name only reads the loaded objects' tables.
        !unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"shoal_cuda_stub".as_ptr()) }.is_null()
    }

    pub(super) fn probe() -> Probe {
        // candle links the driver library: a process that runs has one loaded, the driver's or the stand-in.
        if stand_in() {
            return Probe::NoDriver;
        }
        match cudarc::driver::result::init().and_then(|()| cudarc::driver::result::device::get_count()) {
            Ok(n) => Probe::Devices(usize::try_from(n).unwrap_or(0)),
            Err(e) => Probe::DriverError(e.to_string()),
        }
    }

    pub(super) fn open(ordinal: usize) -> Result<candle_core::Device> {
        match probe() {
            Probe::Devices(n) if ordinal < n => candle_core::Device::new_cuda(ordinal)
                .map_err(|e| Error::Spec(format!("resources.gpus: CUDA device {ordinal} did not open: {e}"))),
            found => Err(Error::Spec(format!("resources.gpus: CUDA device {ordinal} cannot be had: {found:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(milli: u64, visible: Option<&str>, local_rank: usize) -> Asked {
        Asked { gpus_milli: milli, visible: visible.map(str::to_owned), local_rank }
    }

    fn refusal(a: &Asked, p: &Probe) -> String {
        match choose(a, p) {
            Ok(pl) => panic!("{a:?} with {p:?} chose {pl}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_task_without_gpus_computes_on_the_cpu_whatever_the_host_has() {
        for p in [Probe::NotBuilt, Probe::NoDriver, Probe::Devices(8), Probe::DriverError("x".into())] {
            assert_eq!(choose(&asked(0, Some("0,1"), 3), &p).ok(), Some(Placement::Cpu));
            assert_eq!(choose(&asked(0, None, 0), &p).ok(), Some(Placement::Cpu));
        }
    }

    #[test]
    fn a_task_given_gpus_is_refused_naming_what_is_missing() {
        let e = refusal(&asked(1000, Some("0"), 0), &Probe::NotBuilt);
        assert!(e.contains("resources.gpus = 1 asks for a GPU") && e.contains("without the `cuda` feature"), "{e}");
        let e = refusal(&asked(500, Some("0"), 0), &Probe::NoDriver);
        assert!(e.contains("resources.gpus = 0.5") && e.contains("no CUDA driver (libcuda.so"), "{e}");
        let e = refusal(&asked(2000, None, 0), &Probe::Devices(0));
        assert!(e.contains("resources.gpus = 2") && e.contains("sees no device"), "{e}");
        let e = refusal(&asked(1000, None, 0), &Probe::DriverError("CUDA_ERROR_NO_DEVICE".into()));
        assert!(e.contains("failed to start: CUDA_ERROR_NO_DEVICE"), "{e}");
        // Given an empty list (or one CUDA reads as none): refused before the driver is even considered.
        for v in ["", "-1", "NoDevFiles", " , 0"] {
            let e = refusal(&asked(1000, Some(v), 0), &Probe::Devices(4));
            assert!(e.contains("the task was given none (CUDA_VISIBLE_DEVICES="), "{v:?}: {e}");
        }
    }

    #[test]
    fn ranks_take_the_devices_they_see_by_local_rank() {
        // The executor gave the task its GPUs: the process sees them as 0..n.
        assert_eq!(choose(&asked(1000, Some("3"), 5), &Probe::Devices(1)).ok(), Some(Placement::Cuda { ordinal: 0 }));
        assert_eq!(choose(&asked(2000, Some("2,5"), 1), &Probe::Devices(2)).ok(), Some(Placement::Cuda { ordinal: 1 }));
        // UUIDs are devices too; the list stops where CUDA stops reading it.
        assert_eq!(
            asked(1, Some("GPU-1a2b,GPU-3c4d,-1,7"), 0).visible_devices(),
            Some(vec!["GPU-1a2b".to_owned(), "GPU-3c4d".to_owned()])
        );
        // No list (`shoal run` on a GPU host): local ranks round robin over every device.
        let on = |r| choose(&asked(1000, None, r), &Probe::Devices(4)).ok();
        assert_eq!([on(0), on(3), on(4), on(6)], [0, 3, 0, 2].map(|o| Some(Placement::Cuda { ordinal: o })));
        // Two tasks of half a GPU each see the same device.
        for r in 0..2 {
            assert_eq!(
                choose(&asked(500, Some("0"), r), &Probe::Devices(1)).ok(),
                Some(Placement::Cuda { ordinal: 0 })
            );
        }
    }

    #[test]
    fn this_build_refuses_gpus_with_a_clear_error_when_none_can_be_had() {
        // On a machine without a GPU (CI) every path ends in a refusal, never a panic; with one (a `cuda` build on
        // a GPU host) it ends on a device.
        let a = asked(1000, None, 0);
        match (probe(), choose(&a, &probe())) {
            (Probe::Devices(n), Ok(p)) if n > 0 => {
                assert!(p.is_cuda());
                if let Err(e) = open(&p) {
                    panic!("a device was found but did not open: {e}");
                }
            }
            (found, Ok(p)) => panic!("{found:?} chose {p}"),
            (found, Err(e)) => {
                let e = e.to_string();
                assert!(
                    e.starts_with("job spec: resources.gpus = 1 asks for a GPU") || e.contains("resources.gpus = 1"),
                    "{found:?}: {e}"
                );
                if !cfg!(feature = "cuda") {
                    assert_eq!(found, Probe::NotBuilt);
                    assert!(e.contains("`cuda` feature"), "{e}");
                }
            }
        }
        assert_eq!(open(&Placement::Cpu).map(|d| d.is_cpu()).ok(), Some(true));
        if !cfg!(feature = "cuda") {
            let e = open(&Placement::Cuda { ordinal: 0 }).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("resources.gpus") && e.contains("without the `cuda` feature"), "{e}");
        }
    }
}

/// Checks that need a CUDA device (a `cuda` build); each is skipped with a message where none is found.
#[cfg(all(test, feature = "cuda"))]
mod gpu_tests {
    use super::*;
    use crate::models::{Gpt, GptConfig, Model};
    use crate::params::{Params, SeededRng};
    use crate::precision::{Precision, compute_dtype};
    use crate::trainer::{Trainer, TrainerConfig};
    use crate::{OptimConfig, Real};
    use candle_core::Tensor;

    fn device() -> Option<candle_core::Device> {
        let found = probe();
        let Probe::Devices(1..) = found else {
            eprintln!("skipped: no CUDA device here ({found:?})");
            return None;
        };
        match open(&Placement::Cuda { ordinal: 0 }) {
            Ok(d) => Some(d),
            Err(e) => panic!("a device was found but did not open: {e}"),
        }
    }

    const CFG: GptConfig = GptConfig { vocab: 64, context: 32, layers: 2, heads: 4, width: 64 };

    /// `steps` steps of a small GPT on `device` in `p`, its parameters held there (`resident`) or on the host:
    /// the losses.
    fn losses(device: &candle_core::Device, p: Precision, steps: usize, resident: bool) -> crate::Result<Vec<f64>> {
        let mut params = Params::default();
        params.set_compute(compute_dtype(p));
        match resident {
            true => params.set_resident(device.clone()),
            false => params.set_device(device.clone()),
        }
        let model = Gpt::new(&mut params, &mut SeededRng::new(3), CFG)?;
        let cfg = TrainerConfig {
            optimizer: OptimConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
            precision: p,
            ..TrainerConfig::default()
        };
        let mut t = Trainer::new(params, None, cfg)?;
        let held = t.params().vars().iter().all(|(_, v)| v.device().same_device(device));
        assert_eq!(held, resident || device.is_cpu(), "the parameters are where they were asked to be");
        let mut out = Vec::new();
        for k in 0..steps {
            let (b, n) = (4, CFG.context);
            let seq = |i: usize, j: usize| ((k * 7 + i * 5 + j) % CFG.vocab) as u32;
            let ids: Vec<u32> = (0..b).flat_map(|i| (0..n).map(move |j| seq(i, j))).collect();
            let next: Vec<u32> = (0..b).flat_map(|i| (0..n).map(move |j| seq(i, j + 1))).collect();
            let x = Tensor::from_vec(ids, (b, n), &candle_core::Device::Cpu)?;
            let y = Tensor::from_vec(next, b * n, &candle_core::Device::Cpu)?;
            let logits = model.forward(&x)?;
            assert_eq!(logits.device().is_cuda(), device.is_cuda());
            let loss = model.loss(&logits, &y)?;
            out.push(f64::from(loss.to_scalar::<Real>()?));
            t.backward(Some(&loss), true)?;
            t.step(1e-2)?;
        }
        Ok(out)
    }

    #[test]
    fn gpu_training_follows_the_cpu_and_learns_in_bf16() -> crate::Result<()> {
        let Some(gpu) = device() else { return Ok(()) };
        let cpu = losses(&candle_core::Device::Cpu, Precision::F32, 10, false)?;
        // The parameters on the host (the weights copied up for each pass), then held on the device.
        for resident in [false, true] {
            let on_gpu = losses(&gpu, Precision::F32, 10, resident)?;
            for (i, (a, b)) in on_gpu.iter().zip(&cpu).enumerate() {
                assert!((a - b).abs() < 1e-3 * (1.0 + b.abs()), "step {i} (held on the GPU: {resident}): {a}, cpu {b}");
            }
            eprintln!("gpu f32 (held on the GPU: {resident}) follows cpu f32 ({on_gpu:?} vs {cpu:?})");
        }
        // (On the CPU this run goes from 4.44 to 2.32 in 30 steps and to 1.34 in 40.)
        let bf16 = losses(&gpu, Precision::Bf16, 40, true)?;
        assert!(bf16[39] < 0.6 * bf16[0], "bf16 on the GPU: {bf16:?}");
        eprintln!("bf16 held on the GPU: {} -> {}", bf16[0], bf16[39]);
        Ok(())
    }
}
