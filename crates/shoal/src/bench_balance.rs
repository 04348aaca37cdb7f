//! `shoal bench balance`: two workers, one slowed to half speed from outside (stopped and continued by signals, 5 ms
//! each, so it gets half of its core), training the same job with `train.balance = "static"` and `"dynamic"`; the
//! steps per second of each, their ratio, the shares the dynamic run ended with, and how far its parameters lie
//! from one unslowed process's on the same global batches. `--steps` (default 300); `--json`: one object
//! `steps static_samples_per_s dynamic_samples_per_s speedup shares max_param_rel_diff static_max_param_rel_diff`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench::BenchArgs;

/// The job: an MLP (784 → 256 → 256 → 10) on the synthetic blobs in global batches of 2,048, so that a step is
/// mostly computation, which the shares divide (the optimizer and the all-reduce they do not).
fn job(dir: &Path, balance: &str, steps: usize) -> Result<PathBuf> {
    let p = dir.join(format!("{balance}.toml"));
    let text = format!(
        "name = \"balance-{balance}\"\n[train]\ndataset = \"synthetic\"\nglobal_batch = 2048\nsteps = {steps}\nseed = 1\n\
         optimizer = \"adamw\"\nlr = 1e-3\nbalance = \"{balance}\"\n{every}log_every = 1000\n[train.model]\n\
         kind = \"mlp\"\nhidden = [256, 256]\n[checkpoint]\nevery = {steps}\n",
        every = if balance == "dynamic" { "balance_every = 5\n" } else { "" }
    );
    std::fs::write(&p, text)?;
    Ok(p)
}

/// Whether `pid` descends from `root`.
fn descends(pid: u32, root: u32) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        if p == root {
            return true;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { return false };
        // The parent is the second field after the command's closing parenthesis.
        let Some(ppid) = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)) else {
            return false;
        };
        match ppid.parse() {
            Ok(0) | Err(_) => return false,
            Ok(q) => p = q,
        }
    }
    false
}

/// The process of rank `rank` under `root`, once it has started.
fn find_rank(root: u32, rank: usize) -> Option<u32> {
    let want = format!("{}={rank}", shoal_comm::env::var::RANK);
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let has = env.split(|&b| b == 0).any(|v| v == want.as_bytes());
        (has && pid != root && descends(pid, root)).then_some(pid)
    })
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) with a pid of a process this benchmark started (a descendant) and a plain signal number.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Runs `shoal run -n n` of `spec`, with rank 1 at half speed when `slow`; the summary.
fn run(spec: &Path, out: &Path, n: usize, slow: bool) -> Result<serde_json::Value> {
    let exe = std::env::current_exe()?;
    let mut child: Child = Command::new(exe)
        .args(["run", "-n", &n.to_string(), "--json", "--output"])
        .arg(out)
        .arg(spec)
        .env(shoal_comm::env::var::RAYON_THREADS, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let root = child.id();
    if slow {
        let started = Instant::now();
        let mut rank1 = None;
        while child.try_wait()?.is_none() {
            match rank1 {
                None => {
                    rank1 = find_rank(root, 1);
                    if rank1.is_none() && started.elapsed() > Duration::from_secs(60) {
                        let _ = child.kill();
                        bail!("rank 1 of {} did not start within 60 s", spec.display());
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Some(pid) => {
                    signal(pid, libc::SIGSTOP);
                    std::thread::sleep(Duration::from_millis(5));
                    signal(pid, libc::SIGCONT);
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        if let Some(pid) = rank1 {
            signal(pid, libc::SIGCONT);
        }
    }
    let o = child.wait_with_output()?;
    if !o.status.success() {
        bail!("shoal run {}: {}", spec.display(), String::from_utf8_lossy(&o.stderr));
    }
    serde_json::from_slice(&o.stdout).with_context(|| format!("the summary of {}", spec.display()))
}

/// The largest difference between two checkpoints' tensors, relative to the larger of 1 and the value.
fn max_diff(a: &Path, b: &Path) -> Result<f64> {
    let (x, y) = (std::fs::read(a)?, std::fs::read(b)?);
    let (x, y) = (safetensors::SafeTensors::deserialize(&x)?, safetensors::SafeTensors::deserialize(&y)?);
    let mut worst = 0f64;
    // Checkpoints hold the build's precision (`train.dtype`): f32, or f64.
    let values = |t: &safetensors::tensor::TensorView<'_>| -> Result<Vec<f64>> {
        let d = t.data();
        Ok(match t.dtype() {
            safetensors::Dtype::F32 => {
                d.chunks_exact(4).map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect()
            }
            safetensors::Dtype::F64 => d
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
                .collect(),
            other => bail!("a checkpoint tensor of {other:?}"),
        })
    };
    for (name, t) in x.tensors() {
        let u = y.tensor(&name)?;
        for (p, q) in values(&t)?.iter().zip(values(&u)?.iter()) {
            worst = worst.max((p - q).abs() / q.abs().max(1.0));
        }
    }
    Ok(worst)
}

pub fn run_balance(args: &BenchArgs) -> Result<bool> {
    let steps = args.steps.unwrap_or(300);
    let dir = std::env::temp_dir().join(format!("shoal-bench-balance-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let ckpt = |out: &str| dir.join(out).join(format!("checkpoints/step-{steps:06}/model.safetensors"));
    let stat = run(&job(&dir, "static", steps)?, &dir.join("static"), 2, true)?;
    let dynamic = run(&job(&dir, "dynamic", steps)?, &dir.join("dynamic"), 2, true)?;
    run(&job(&dir, "dynamic", steps)?, &dir.join("one"), 1, false)?;
    let rate = |s: &serde_json::Value| s["samples_per_s"].as_f64().unwrap_or(0.0);
    let (rs, rd) = (rate(&stat), rate(&dynamic));
    let speedup = rd / rs.max(1e-9);
    let diff = max_diff(&ckpt("dynamic"), &ckpt("one"))?;
    let static_diff = max_diff(&ckpt("static"), &ckpt("one"))?;
    let shares = dynamic["shares"].clone();
    let _ = std::fs::remove_dir_all(&dir);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "steps": steps, "static_samples_per_s": rs, "dynamic_samples_per_s": rd, "speedup": speedup,
                "shares": shares, "max_param_rel_diff": diff, "static_max_param_rel_diff": static_diff,
            })
        );
    } else {
        println!("# shoal bench balance: 2 workers, rank 1 at half speed (SIGSTOP/SIGCONT 5 ms each), {steps} steps");
        println!("static   {rs:>10.0} samples/s");
        println!("dynamic  {rd:>10.0} samples/s   shares at the end {shares}");
        println!(
            "dynamic / static: {speedup:.2}×; parameters against one process: {diff:.2e} at most (relative), static's \
             {static_diff:.2e}"
        );
    }
    Ok(true)
}
