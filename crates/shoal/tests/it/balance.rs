//! Batch rebalancing for uneven workers (`train.balance = "dynamic"`): with one of two ranks computing four times
//! as long (the `failpoints` build's `SHOAL_FAULT_SLOW_RANK`), the shares move towards the fast rank — seen in the
//! ranks' metrics and the summary — while the parameters stay those of one process taking the whole global batch.

use std::path::{Path, PathBuf};
use std::process::Command;

type Res<T> = Result<T, String>;

fn tmpdir(tag: &str) -> Res<PathBuf> {
    let d = std::env::temp_dir().join(format!("shoal-balance-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    Ok(d)
}

fn job(dir: &Path, extra: &str) -> Res<String> {
    let p = dir.join("job.toml");
    let text = format!(
        "name = \"balance\"\n[train]\ndataset = \"digits\"\nglobal_batch = 64\nsteps = 40\nseed = 2\n\
         optimizer = \"adamw\"\nlr = 3e-3\nbalance = \"dynamic\"\nbalance_every = 4\n{extra}[train.model]\n\
         kind = \"mlp\"\nhidden = [64]\n[checkpoint]\nevery = 40\n"
    );
    std::fs::write(&p, text).map_err(|e| e.to_string())?;
    Ok(p.display().to_string())
}

/// `shoal run -n N` of `spec` into `out`, with `envs`; its summary.
fn run(n: &str, spec: &str, out: &Path, envs: &[(&str, &str)]) -> Res<serde_json::Value> {
    let o = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["run", "-n", n, "--json", "--output", &out.display().to_string(), spec])
        .envs(envs.iter().copied())
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .map_err(|e| e.to_string())?;
    if !o.status.success() {
        return Err(format!("shoal run -n {n} {spec}: {}", String::from_utf8_lossy(&o.stderr)));
    }
    serde_json::from_slice(&o.stdout).map_err(|e| format!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

/// The final checkpoint's tensors as f32, by name.
fn params(out: &Path) -> Res<Vec<(String, Vec<f32>)>> {
    let bytes = std::fs::read(out.join("checkpoints/step-000040/model.safetensors")).map_err(|e| e.to_string())?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let mut v: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            let f = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            (n, f)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(v)
}

#[test]
fn a_slow_rank_takes_a_smaller_share_and_the_parameters_stay_those_of_one_process() -> Res<()> {
    let dir = tmpdir("slow")?;
    let spec = job(&dir, "")?;
    run("1", &spec, &dir.join("one"), &[])?;
    let two = run("2", &spec, &dir.join("two"), &[("SHOAL_FAULT_SLOW_RANK", "1:4")])?;

    let shares: Vec<f64> = two["shares"]
        .as_array()
        .ok_or_else(|| format!("no shares in the summary: {two}"))?
        .iter()
        .filter_map(serde_json::Value::as_f64)
        .collect();
    assert_eq!(shares.len(), 2, "{two}");
    eprintln!("shares at the end, rank 1 computing 4× as long: {shares:?}");
    assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-9, "shares sum to 1: {shares:?}");
    assert!(shares[1] < 0.4, "the rank computing 4× as long ends with a smaller share: {shares:?}");
    // Rank 1's metrics: equal halves at first, a smaller part once the shares were set.
    let text = std::fs::read_to_string(dir.join("two/metrics.rank-1.jsonl")).map_err(|e| e.to_string())?;
    let parts: Vec<f64> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).map_err(|e| e.to_string()))
        .collect::<Res<Vec<_>>>()?
        .iter()
        .map(|v| v["share"].as_f64().ok_or_else(|| format!("no share in {v}")))
        .collect::<Res<_>>()?;
    assert_eq!(parts.len(), 40);
    assert_eq!(parts[0], 0.5, "equal shares before any was set");
    assert!(parts[39] < 0.4, "rank 1's share at the end: {:?}", &parts[30..]);

    // The same parameters as one process taking every global batch whole.
    let (a, b) = (params(&dir.join("two"))?, params(&dir.join("one"))?);
    assert_eq!(a.len(), b.len());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        let worst = x.iter().zip(y).map(|(p, q)| (p - q).abs() / q.abs().max(1.0)).fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{name}: {worst} from one process's");
    }

    // Only where each rank computes the whole model on its share.
    let refused = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["run", "-n", "2", &job(&dir, "strategy = \"ps\"\n")?])
        .output()
        .map_err(|e| e.to_string())?;
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("train.balance"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
