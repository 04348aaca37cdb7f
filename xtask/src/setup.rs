//! `cargo xtask setup-peers`: installs Open MPI (apt) and a Python virtualenv with
//! numpy, mpi4py and torch into the peers cache. Idempotent: each piece is checked
//! first and only installed when missing.

use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::util::{capture_stdout, du, peers_dir, run_visible, venv_python, which};

const TORCH_CPU_INDEX: &str = "https://download.pytorch.org/whl/cpu";

#[derive(Debug, clap::Args)]
pub struct SetupArgs {
    /// Skip PyTorch (and so the Gloo peer).
    #[arg(long)]
    pub no_torch: bool,
}

pub fn setup_peers(args: &SetupArgs) -> Result<()> {
    let t_all = Instant::now();
    let dir = peers_dir();
    let mut did: Vec<String> = Vec::new();
    println!("peers cache: {}", dir.display());
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;

    // 1. Open MPI from the distribution (mpirun + mpicc, the latter to build mpi4py).
    if which("mpirun").is_some() {
        println!("open mpi: present ({})", mpi_version().unwrap_or_else(|| "version unknown".into()));
    } else {
        let t = Instant::now();
        println!("open mpi: mpirun missing, installing openmpi-bin libopenmpi-dev with apt-get ...");
        apt_install(&["openmpi-bin", "libopenmpi-dev"])?;
        anyhow::ensure!(which("mpirun").is_some(), "apt-get finished but mpirun is still not on PATH");
        did.push(format!(
            "installed Open MPI {} via apt ({:.0} s)",
            mpi_version().unwrap_or_default(),
            t.elapsed().as_secs_f64()
        ));
    }

    // 2. The virtualenv.
    let py = venv_python(&dir);
    if py.exists() {
        println!("venv: present ({})", dir.join("venv").display());
    } else {
        let t = Instant::now();
        let base = which("python3").context("python3 not found on PATH (needed for the venv)")?;
        println!("venv: creating {} with {}", dir.join("venv").display(), base.display());
        run_visible(Command::new(&base).args(["-m", "venv"]).arg(dir.join("venv")))?;
        did.push(format!("created venv ({:.0} s)", t.elapsed().as_secs_f64()));
    }

    // 3. numpy + mpi4py (mpi4py built from source against the system Open MPI when
    //    mpicc is there, so the binding matches the mpirun that launches it).
    let mut have = probe(&py);
    if let Some(v) = have.numpy.clone() {
        println!("numpy: present ({v})");
    } else {
        let t = Instant::now();
        pip(&py, &["numpy"])?;
        have = probe(&py);
        let v = have.numpy.clone().context("numpy installed but `import numpy` fails")?;
        did.push(format!("pip installed numpy {v} ({:.0} s)", t.elapsed().as_secs_f64()));
    }
    if let Some(v) = have.mpi4py.clone() {
        println!("mpi4py: present ({v})");
    } else {
        let t = Instant::now();
        if which("mpicc").is_some() {
            println!("mpi4py: building from source against the system Open MPI (a few minutes) ...");
            pip(&py, &["--no-binary", "mpi4py", "mpi4py"])?;
        } else {
            println!("mpi4py: mpicc not found, installing the binary wheel");
            pip(&py, &["mpi4py"])?;
        }
        have = probe(&py);
        let v = have.mpi4py.clone().context("mpi4py installed but `import mpi4py.MPI` fails")?;
        did.push(format!("pip installed mpi4py {v} ({:.0} s)", t.elapsed().as_secs_f64()));
    }

    // 4. torch: the CPU-only index first (~200 MB), plain PyPI (several GB with CUDA wheels) otherwise.
    if args.no_torch {
        println!("torch: skipped (--no-torch)");
    } else if let Some(v) = have.torch.clone() {
        println!("torch: present ({v})");
    } else {
        let t = Instant::now();
        let mut from = "";
        if reachable("download.pytorch.org:443") {
            println!("torch: installing from {TORCH_CPU_INDEX} ...");
            match pip(&py, &["--retries", "2", "--timeout", "60", "torch", "--index-url", TORCH_CPU_INDEX]) {
                Ok(()) => from = "the CPU-only index",
                Err(e) => println!("torch: CPU-only index failed ({e:#}); falling back to PyPI"),
            }
        } else {
            println!(
                "torch: {TORCH_CPU_INDEX} unreachable; installing from PyPI (large: several GB with CUDA wheels) ..."
            );
        }
        if from.is_empty() {
            pip(&py, &["torch"])?;
            from = "PyPI";
        }
        have = probe(&py);
        let v = have.torch.clone().context("torch installed but `import torch.distributed` fails")?;
        did.push(format!("pip installed torch {v} from {from} ({:.0} s)", t.elapsed().as_secs_f64()));
    }

    write_manifest(&dir, &py, &have)?;
    if did.is_empty() {
        println!("setup-peers: nothing to do, all peers present in {}", dir.display());
    } else {
        println!("setup-peers: done in {:.0} s; cache size {}:", t_all.elapsed().as_secs_f64(), du(&dir));
        for d in &did {
            println!("  - {d}");
        }
    }
    Ok(())
}

fn apt_install(pkgs: &[&str]) -> Result<()> {
    let root = capture_stdout(Command::new("id").arg("-u")).map(|s| s.trim() == "0").unwrap_or(false);
    let mut prefix: Vec<String> = Vec::new();
    if !root {
        if which("sudo").is_none() {
            bail!("not root and no sudo: install {} yourself", pkgs.join(" "));
        }
        prefix.push("sudo".into());
    }
    let apt = |args: &[&str]| -> Result<()> {
        let mut all: Vec<String> = prefix.clone();
        all.push("apt-get".into());
        all.extend(args.iter().map(|s| s.to_string()));
        println!("  {}", all.join(" "));
        let out = Command::new(&all[0])
            .args(&all[1..])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output()
            .with_context(|| format!("starting {}", all.join(" ")))?;
        if !out.status.success() {
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            bail!("{} failed ({}):\n{}", all.join(" "), out.status, crate::util::tail(&text, 20));
        }
        Ok(())
    };
    apt(&["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend_from_slice(pkgs);
    apt(&args)
}

fn pip(py: &Path, args: &[&str]) -> Result<()> {
    println!("pip install {}", args.join(" "));
    run_visible(Command::new(py).args(["-m", "pip", "install", "--progress-bar", "off"]).args(args))
}

/// Versions of the Python peers importable in the venv (None = missing or broken).
#[derive(Debug, Default, serde::Deserialize)]
pub struct Probe {
    pub numpy: Option<String>,
    pub mpi4py: Option<String>,
    pub torch: Option<String>,
}

const PROBE_PY: &str = r#"
import importlib, json
out = {}
for mod in ("numpy", "mpi4py.MPI", "torch.distributed"):
    top = mod.split(".")[0]
    try:
        importlib.import_module(mod)
        out[top] = str(getattr(importlib.import_module(top), "__version__", "?"))
    except Exception:
        out[top] = None
print(json.dumps(out))
"#;

/// One interpreter start that imports every peer module (torch takes seconds to import).
pub fn probe(py: &Path) -> Probe {
    if !py.exists() {
        return Probe::default();
    }
    capture_stdout(Command::new(py).args(["-c", PROBE_PY]))
        .and_then(|s| serde_json::from_str(s.trim()).ok())
        .unwrap_or_default()
}

pub fn mpi_version() -> Option<String> {
    let out = capture_stdout(Command::new("mpirun").arg("--version"))?;
    out.lines().next().and_then(|l| l.split_whitespace().last()).map(str::to_owned)
}

/// DNS + TCP connect within 10 s (so an unreachable index fails fast, not after pip's retries).
fn reachable(hostport: &str) -> bool {
    let Ok(addrs) = hostport.to_socket_addrs() else { return false };
    addrs.into_iter().any(|a| TcpStream::connect_timeout(&a, Duration::from_secs(10)).is_ok())
}

/// Records what is installed, for the benchmark reports.
fn write_manifest(dir: &Path, py: &Path, have: &Probe) -> Result<()> {
    let v = serde_json::json!({
        "openmpi": mpi_version(),
        "python": capture_stdout(Command::new(py).arg("--version")).map(|s| s.trim().to_owned()),
        "numpy": have.numpy,
        "mpi4py": have.mpi4py,
        "torch": have.torch,
    });
    std::fs::write(dir.join("versions.json"), serde_json::to_string_pretty(&v)? + "\n")?;
    Ok(())
}
