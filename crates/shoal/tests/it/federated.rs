//! Federated learning in simulation, through `shoal run`: 20 clients of the digits cut by a Dirichlet draw over
//! the labels, 10 sampled a round, trained by FedAvg in a pool of 2 worker processes, reach the target accuracy;
//! FedProx holds up on far less alike clients; under differential privacy the accountant's ε stays within its
//! target and the model still learns; bad tables are refused naming the key.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

type Res<T> = Result<T, String>;

fn tmpdir(tag: &str) -> Res<PathBuf> {
    let d = std::env::temp_dir().join(format!("shoal-fed-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    Ok(d)
}

fn job(federated: &str) -> String {
    format!(
        "name = \"fed\"\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\nstrategy = \"federated\"\nglobal_batch = 32\n\
         lr = 0.05\noptimizer = \"sgd\"\nseed = 1\nlog_every = 100\n[federated]\n{federated}\n"
    )
}

/// `shoal run -n 2` of `body`; the run's `summary.json`, or the error it printed.
fn run(dir: &Path, name: &str, body: &str) -> Res<Value> {
    let (spec, out) = (dir.join(format!("{name}.toml")), dir.join(name));
    std::fs::write(&spec, body).map_err(|e| e.to_string())?;
    let o = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["run", "-n", "2", "--json", "--output"])
        .arg(&out)
        .arg(&spec)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .map_err(|e| e.to_string())?;
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    serde_json::from_slice(&o.stdout).map_err(|e| format!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

fn accuracy(s: &Value) -> Res<f64> {
    s["eval_accuracy"].as_f64().ok_or_else(|| format!("no eval_accuracy: {s}"))
}

#[test]
fn fedavg_on_non_iid_digits_reaches_93_percent_and_fedprox_holds_on_less_alike_clients() -> Res<()> {
    let dir = tmpdir("avg")?;
    let base = "clients = 20\nclients_per_round = 10\nrounds = 40\nlocal_steps = 10\npartition = \"dirichlet\"\n";
    let s = run(&dir, "fedavg", &job(&format!("{base}alpha = 0.5")))?;
    let acc = accuracy(&s)?;
    assert!(acc >= 0.93, "FedAvg, 20 clients, Dirichlet 0.5: held-out accuracy {acc}");
    let f = &s["federated"];
    let rounds = f["rounds"].as_array().ok_or_else(|| format!("no rounds: {f}"))?;
    assert_eq!(rounds.len(), 40);
    assert!(rounds.iter().all(|r| r["clients"] == 10), "10 clients every round: {rounds:?}");
    let first = rounds[0]["eval_accuracy"].as_f64().unwrap_or(1.0);
    assert!(first < acc, "the accuracy rises over the rounds: {first} after round 1, {acc} after 40");
    // The partition is far from IID, and every sample is some client's.
    let hist: Vec<Vec<u64>> = serde_json::from_value(f["histogram"].clone()).map_err(|e| e.to_string())?;
    assert_eq!(hist.len(), 20);
    let total: u64 = hist.iter().flatten().sum();
    assert_eq!(total, 1617, "the digits' training split, cut among the clients");
    let skewed = hist.iter().filter(|h| h.iter().max().copied().unwrap_or(0) * 3 > h.iter().sum::<u64>()).count();
    assert!(skewed >= 5, "a Dirichlet(0.5) cut gives many clients a dominant class: {hist:?}");
    let lines = std::fs::read_to_string(dir.join("fedavg/metrics.jsonl")).map_err(|e| e.to_string())?;
    assert_eq!(lines.lines().count(), 40, "a metrics line a round");

    let avg = accuracy(&run(&dir, "a01", &job(&format!("{base}alpha = 0.1")))?)?;
    let prox = accuracy(&run(&dir, "prox", &job(&format!("{base}alpha = 0.1\nalgorithm = \"fedprox\"\nmu = 0.01")))?)?;
    assert!(prox >= avg - 1e-9, "FedProx ({prox}) no worse than FedAvg ({avg}) on Dirichlet 0.1");
    let adam = run(&dir, "adam", &job(&format!("{base}alpha = 0.5\nalgorithm = \"fedadam\"")))?;
    assert!(accuracy(&adam)? > 0.85, "FedAdam learns too: {}", accuracy(&adam)?);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn differential_privacy_stays_within_its_epsilon_and_the_model_still_learns() -> Res<()> {
    let dir = tmpdir("dp")?;
    let body = job(
        "clients = 100\nclients_per_round = 30\nrounds = 100\nlocal_steps = 5\n[federated.dp]\nclip = 1.0\nepsilon = 8.0",
    );
    let s = run(&dir, "dp", &body)?;
    let f = &s["federated"];
    let eps = f["epsilon"].as_f64().ok_or_else(|| format!("no epsilon: {f}"))?;
    assert!(eps <= 8.0 && eps > 7.5, "the calibrated noise spends about the whole budget: ε {eps}");
    assert_eq!(f["delta"].as_f64(), Some(1e-5));
    let sigma = f["noise_multiplier"].as_f64().ok_or("no noise multiplier")?;
    assert!(sigma > 1.0, "{sigma}");
    let rounds = f["rounds"].as_array().ok_or("no rounds")?;
    let spent: Vec<f64> = rounds.iter().filter_map(|r| r["epsilon"].as_f64()).collect();
    assert!(spent.windows(2).all(|w| w[0] < w[1]), "ε grows round by round");
    let acc = accuracy(&s)?;
    assert!(acc >= 0.85, "private FedAvg at ε {eps}: held-out accuracy {acc}");
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn bad_federated_tables_are_refused_naming_the_key() -> Res<()> {
    let dir = tmpdir("bad")?;
    let cases = [
        (job("clients = 4\nrounds = 2\nmu = 0.1"), "federated.mu: applies to algorithm = \"fedprox\" only"),
        (job("clients = 4\nrounds = 2\nclients_per_round = 5"), "federated.clients_per_round: 5 is not in 1..=4"),
        (job("clients = 4\nrounds = 2\n[federated.dp]\nclip = 1.0"), "federated.dp.noise_multiplier"),
        (
            job("clients = 4\nrounds = 2").replace("strategy = \"federated\"\n", ""),
            "federated: applies to train.strategy",
        ),
        (
            job("clients = 4\nrounds = 2").replace("[federated]\nclients = 4\nrounds = 2\n", ""),
            "needs a [federated] table",
        ),
        (job("clients = 4\nrounds = 2\nsecure = true"), "unknown field `secure`"),
        (job("clients = 4\nrounds = 2\ndropout = 1.0"), "federated.dropout: 1 is not in [0, 1)"),
    ];
    for (body, want) in cases {
        let err = run(&dir, "bad", &body).err().unwrap_or_default();
        assert!(err.contains(want), "want {want:?} in: {err}");
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

/// The model a run ended with, every tensor as f32 values.
fn model(dir: &Path) -> Res<Vec<(String, Vec<f32>)>> {
    let bytes = std::fs::read(dir.join("model.safetensors")).map_err(|e| e.to_string())?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

#[test]
fn secure_aggregation_gives_plain_fedavgs_model_with_30_percent_dropping_out_for_few_more_bytes() -> Res<()> {
    let dir = tmpdir("secagg")?;
    let base = "clients = 20\nclients_per_round = 10\nlocal_steps = 10\npartition = \"dirichlet\"\nalpha = 0.5\n\
                dropout = 0.3\n";
    // One round from the same model: the aggregates agree to the fixed point's rounding.
    let plain = run(&dir, "plain1", &job(&format!("{base}rounds = 1")))?;
    let secure = run(&dir, "secure1", &job(&format!("{base}rounds = 1\nsecure_aggregation = true")))?;
    let (a, b) = (model(&dir.join("plain1"))?, model(&dir.join("secure1"))?);
    assert_eq!(a.len(), b.len());
    let diff =
        a.iter().zip(&b).flat_map(|(x, y)| x.1.iter().zip(&y.1).map(|(p, q)| (p - q).abs())).fold(0f32, f32::max);
    assert!(diff <= 1e-6, "secure aggregation's model is plain FedAvg's within 1e-6: {diff}");
    assert_eq!(secure["federated"]["rounds"][0]["clients"], 7, "3 of the 10 sampled dropped out: {secure}");
    assert_eq!(plain["federated"]["rounds"][0]["clients"], 7);
    // Whole runs: the same accuracy, and the keys and shares cost little beside the masked vectors.
    let plain = run(&dir, "plain", &job(&format!("{base}rounds = 40")))?;
    let secure = run(&dir, "secure", &job(&format!("{base}rounds = 40\nsecure_aggregation = true")))?;
    let bytes = |s: &Value| -> u64 {
        s["federated"]["rounds"].as_array().map_or(0, |r| r.iter().filter_map(|x| x["bytes"].as_u64()).sum())
    };
    let ratio = bytes(&secure) as f64 / bytes(&plain).max(1) as f64;
    assert!(ratio <= 2.0, "secure aggregation sends {ratio}× plain FedAvg's bytes");
    let (pa, sa) = (accuracy(&plain)?, accuracy(&secure)?);
    assert!((pa - sa).abs() <= 0.02 && sa > 0.9, "accuracy plain {pa}, secure {sa}");
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn a_robust_rule_bears_attacking_clients_that_wreck_the_mean() -> Res<()> {
    let dir = tmpdir("robust")?;
    // 3 of 20 clients send their update reversed and scaled 10×, in every round they are sampled for.
    let base = "clients = 20\nclients_per_round = 10\nrounds = 30\nlocal_steps = 10\n";
    let attack = "[chaos]\nbyzantine_clients = [0, 1, 2]\nattack = \"signflip\"\n";
    let mean = run(&dir, "mean", &format!("{}[robust]\nrule = \"mean\"\n{attack}", job(base)))?;
    let median = run(&dir, "median", &format!("{}[robust]\nrule = \"median\"\nf = 3\n{attack}", job(base)))?;
    let honest = run(&dir, "honest", &format!("{}[robust]\nrule = \"median\"\nf = 3\n", job(base)))?;
    let (m, d, h) = (accuracy(&mean)?, accuracy(&median)?, accuracy(&honest)?);
    assert!(m < 0.5, "the mean under 3 sign-flipping clients should fail: {m}");
    assert!(d > 0.85, "the coordinate-wise median bears them: {d}");
    assert!(h > 0.85, "the median with honest clients only: {h}");
    assert_eq!(median["federated"]["rule"], "median");
    eprintln!(
        "held-out accuracy under 3 sign-flipping clients: mean {m:.4}, median {d:.4}; median, no attacker {h:.4}"
    );
    // The attackers are refused by name where they cannot be.
    let cases = [
        (
            format!(
                "{}[robust]\nrule = \"median\"\nf = 1\n[chaos]\nbyzantine_ranks = [0]\nattack = \"noise\"\n",
                job(base)
            ),
            "chaos.byzantine_ranks: a federated job's attackers are clients",
        ),
        (
            format!(
                "{}[robust]\nrule = \"median\"\nf = 1\n[chaos]\nbyzantine_clients = [20]\nattack = \"noise\"\n",
                job(base)
            ),
            "client 20 is not one of the 20 clients",
        ),
        (format!("{}[robust]\nrule = \"krum\"\nf = 4\n", job(base)), "robust.f"),
        (
            format!("{}secure_aggregation = true\n[robust]\nrule = \"median\"\nf = 1\n", job(base)),
            "robust.rule: secure aggregation",
        ),
        (job(&format!("{base}listen = \"127.0.0.1:7000\"")), "federated.tokens"),
        (job(&format!("{base}listen = \"0.0.0.0:7000\"\ntokens = \"t\"")), "federated.tls_cert"),
        (
            job(&format!("{base}listen = \"127.0.0.1:7000\"\ntokens = \"t\"\ndropout = 0.1")),
            "federated.dropout: is for simulations",
        ),
        (job(&format!("{base}tokens = \"t\"")), "federated.tokens: applies to remote clients only"),
        (job(&format!("{base}listen = \"127.0.0.1:7000\"\ntokens = \"t\"")), "workers.count"),
    ];
    for (body, want) in cases {
        let err = run(&dir, "bad", &body).err().unwrap_or_default();
        assert!(err.contains(want), "want {want:?} in: {err}");
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
