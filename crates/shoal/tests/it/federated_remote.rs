//! Federated learning with real clients: the job's process serves HTTPS (`federated.listen`) to four
//! `shoal fed client` processes, each on its own CSV file that `shoal fed partition` cut, authenticated by token
//! and client certificate. One client reaches the server through a TCP relay that this test cuts for a while: it
//! loses its connection mid-job, reconnects under TLS and trains in later rounds, and the rounds it missed close
//! at `round_timeout` with it counted as dropped or late. A wrong token, a certificate of another CA and no
//! certificate at all are refused. The global model learns the digits.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::tls::{certificates, openssl};

type Res<T> = Result<T, String>;

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

fn free_port() -> Res<u16> {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).map_err(|e| e.to_string())
}

/// A client key and certificate signed by the CA `ca` (`{ca}.pem`, `{ca}.key`) in `dir`: `{name}.pem`,
/// `{name}.key`.
fn client_cert(dir: &Path, ca: &str, name: &str) {
    let (key, csr, pem) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"));
    let subj = format!("/CN={name}");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &subj,
        ],
    );
    let (ca_pem, ca_key) = (format!("{ca}.pem"), format!("{ca}.key"));
    // Extensions make it an X.509 v3 certificate, which TLS libraries require.
    let ext = format!("{name}.cnf");
    std::fs::write(dir.join(&ext), "extendedKeyUsage = clientAuth\nbasicConstraints = CA:FALSE\n").expect("ext file");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_pem,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
}

/// A TCP relay from a local port to `to` that can be cut: while cut, its connections are closed and new ones
/// closed at once.
struct Relay {
    port: u16,
    cut: Arc<AtomicBool>,
}

impl Relay {
    fn start(to: u16) -> Res<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let cut = Arc::new(AtomicBool::new(false));
        let c = cut.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(inbound) = conn else { continue };
                if c.load(Ordering::SeqCst) {
                    let _ = inbound.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(outbound) = TcpStream::connect(("127.0.0.1", to)) else { continue };
                for (mut from, mut into) in
                    [(inbound.try_clone(), outbound.try_clone()), (outbound.try_clone(), inbound.try_clone())]
                        .into_iter()
                        .filter_map(|(a, b)| Some((a.ok()?, b.ok()?)))
                {
                    let c = c.clone();
                    std::thread::spawn(move || {
                        let _ = from.set_read_timeout(Some(Duration::from_millis(100)));
                        let mut buf = [0u8; 16384];
                        loop {
                            if c.load(Ordering::SeqCst) {
                                break;
                            }
                            match from.read(&mut buf) {
                                Ok(0) => break,
                                Ok(n) => {
                                    if into.write_all(&buf[..n]).is_err() {
                                        break;
                                    }
                                }
                                Err(e)
                                    if matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                    ) => {}
                                Err(_) => break,
                            }
                        }
                        let _ = from.shutdown(Shutdown::Both);
                        let _ = into.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Ok(Relay { port, cut })
    }
}

struct Killed(Vec<Child>);

impl Drop for Killed {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn rounds_done(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl")).map(|s| s.lines().count()).unwrap_or(0)
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) -> Res<()> {
    let t0 = Instant::now();
    while !done() {
        if t0.elapsed() > limit {
            return Err(format!("waited {limit:?} for {what}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn client(dir: &Path, port: u16, c: usize, token: &str, cert: Option<&str>) -> Command {
    let mut cmd = shoal();
    cmd.args(["fed", "client", "--json", "--retry-for", "60", "--server", &format!("https://127.0.0.1:{port}")])
        .arg("--data")
        .arg(dir.join(format!("parts/client-{c:04}.csv")))
        .args(["--token", token, "--ca"])
        .arg(dir.join("ca.pem"))
        .env("RAYON_NUM_THREADS", "1");
    if let Some(name) = cert {
        cmd.arg("--cert").arg(dir.join(format!("{name}.pem"))).arg("--key").arg(dir.join(format!("{name}.key")));
    }
    cmd
}

#[test]
fn remote_clients_train_over_tls_and_one_cut_off_reconnects_and_rejoins() -> Res<()> {
    let dir: PathBuf = std::env::temp_dir().join(format!("shoal-fed-remote-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    certificates(&dir);
    client_cert(&dir, "ca", "alice");
    // Another CA, and a client certificate it signed.
    openssl(
        &dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "rogue-ca.key",
            "-out",
            "rogue-ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=rogue",
        ],
    );
    client_cert(&dir, "rogue-ca", "mallory");
    let port = free_port()?;
    let d = dir.display();
    let spec = format!(
        "name = \"fed-remote\"\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\nstrategy = \"federated\"\n\
         global_batch = 32\nlr = 0.05\noptimizer = \"sgd\"\nseed = 3\nlog_every = 1\n[federated]\nclients = 4\n\
         rounds = 16\nlocal_steps = 40\npartition = \"iid\"\nround_timeout = 3\nlisten = \"127.0.0.1:{port}\"\n\
         tokens = \"{d}/parts/tokens\"\ntls_cert = \"{d}/server.pem\"\ntls_key = \"{d}/server.key\"\n\
         client_ca = \"{d}/ca.pem\"\n"
    );
    let job = dir.join("remote.toml");
    std::fs::write(&job, spec).map_err(|e| e.to_string())?;
    let parts = shoal()
        .args(["fed", "partition"])
        .arg(&job)
        .arg("--out")
        .arg(dir.join("parts"))
        .arg("--tokens")
        .output()
        .map_err(|e| e.to_string())?;
    if !parts.status.success() {
        return Err(format!("shoal fed partition: {}", String::from_utf8_lossy(&parts.stderr)));
    }
    let token =
        |c: usize| std::fs::read_to_string(dir.join(format!("parts/client-{c:04}.token"))).map_err(|e| e.to_string());
    let out = dir.join("out");
    let server = shoal()
        .args(["run", "--json", "--output"])
        .arg(&out)
        .arg(&job)
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut procs = Killed(vec![server]);
    wait_for("the federated server to listen", Duration::from_secs(60), || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    })?;

    // Refused: a wrong token, a certificate of another CA, no certificate.
    let wrong = client(&dir, port, 0, "not-the-token-of-anyone", Some("alice")).output().map_err(|e| e.to_string())?;
    let said = String::from_utf8_lossy(&wrong.stderr).to_string();
    assert!(!wrong.status.success() && said.contains("unknown token"), "a wrong token: {said}");
    for cert in [Some("mallory"), None] {
        let o = client(&dir, port, 0, &token(0)?, cert).output().map_err(|e| e.to_string())?;
        let said = String::from_utf8_lossy(&o.stderr).to_lowercase();
        assert!(!o.status.success() && said.contains("tls"), "client certificate {cert:?} accepted: {said}");
    }

    // Clients 0, 2, 3 straight to the server; client 1 through the relay.
    let relay = Relay::start(port)?;
    for c in 0..4 {
        let p = if c == 1 { relay.port } else { port };
        let child = client(&dir, p, c, &token(c)?, Some("alice"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        procs.0.push(child);
    }
    wait_for("two rounds", Duration::from_secs(120), || rounds_done(&out) >= 2)?;
    relay.cut.store(true, Ordering::SeqCst);
    let cut_at = rounds_done(&out);
    wait_for("a round without client 1", Duration::from_secs(60), || rounds_done(&out) >= cut_at + 2)?;
    relay.cut.store(false, Ordering::SeqCst);

    // Every process ends on its own.
    let mut outputs = Vec::new();
    for child in procs.0.drain(..) {
        outputs.push(child.wait_with_output().map_err(|e| e.to_string())?);
    }
    let text = |o: &std::process::Output| {
        (String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&o.stderr).to_string())
    };
    for (k, o) in outputs.iter().enumerate() {
        let (_, err) = text(o);
        assert!(o.status.success(), "process {k} failed: {err}");
    }
    let summary: Value = serde_json::from_slice(&outputs[0].stdout).map_err(|e| e.to_string())?;
    let job_summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    let acc = job_summary["eval_accuracy"].as_f64().ok_or_else(|| format!("no accuracy: {summary}"))?;
    assert!(acc > 0.85, "4 remote clients, 16 rounds: held-out accuracy {acc}");
    let rounds = job_summary["federated"]["rounds"].as_array().cloned().unwrap_or_default();
    assert_eq!(rounds.len(), 16);
    assert_eq!(job_summary["federated"]["remote"], true);
    let missed: Vec<usize> = rounds
        .iter()
        .filter(|r| r["dropped"].as_u64().unwrap_or(0) + r["late"].as_u64().unwrap_or(0) > 0)
        .filter_map(|r| r["round"].as_u64().map(|x| x as usize))
        .collect();
    assert!(!missed.is_empty(), "the cut client missed no round: {rounds:?}");
    // Client 1 (the cut one) reconnected and trained in a round after one it missed.
    let report: Value =
        serde_json::from_slice(&outputs[2].stdout).map_err(|e| format!("{e}: {}", text(&outputs[2]).1))?;
    assert_eq!(report["client"], "client-0001");
    assert!(report["reconnects"].as_u64().unwrap_or(0) >= 1, "client 1 never lost the server: {report}");
    let trained: Vec<usize> =
        report["rounds"].as_array().into_iter().flatten().filter_map(|r| r.as_u64()).map(|r| r as usize).collect();
    let first_missed = missed[0];
    assert!(
        trained.iter().any(|&r| r > first_missed),
        "client 1 trained {trained:?}, nothing after round {first_missed}"
    );
    // The rounds' record names who was combined: client 1 is missing from a round and back in a later one.
    let record = std::fs::read_to_string(out.join("rounds.jsonl")).map_err(|e| e.to_string())?;
    let with1: Vec<bool> = record.lines().map(|l| l.contains("client-0001")).collect();
    let gone = with1.iter().position(|w| !w).ok_or("client 1 in every round")?;
    assert!(with1[gone..].iter().any(|w| *w), "client 1 never back after round {}: {record}", gone + 1);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A federated job served on loopback to 4 `shoal fed client`s of the digits; `fault` makes one client exit in
/// the middle of a round (`SHOAL_FAULT_FED_CLIENT_EXIT`). Returns the job's summary and the clients' exit codes.
fn loopback_run(dir: &Path, name: &str, extra: &str, fault: Option<(usize, &str)>) -> Res<(Value, Vec<Option<i32>>)> {
    let port = free_port()?;
    let parts = dir.join("parts");
    let spec = format!(
        "name = \"{name}\"\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\nstrategy = \"federated\"\n\
         global_batch = 32\nlr = 0.05\noptimizer = \"sgd\"\nseed = 5\nlog_every = 1\n[federated]\nclients = 4\n\
         local_steps = 20\npartition = \"iid\"\nround_timeout = 3\nlisten = \"127.0.0.1:{port}\"\n\
         tokens = \"{}/tokens\"\n{extra}\n",
        parts.display()
    );
    let job = dir.join(format!("{name}.toml"));
    std::fs::write(&job, spec).map_err(|e| e.to_string())?;
    if !parts.join("tokens").exists() {
        let o = shoal().args(["fed", "partition"]).arg(&job).arg("--out").arg(&parts).arg("--tokens").output();
        let o = o.map_err(|e| e.to_string())?;
        if !o.status.success() {
            return Err(format!("shoal fed partition: {}", String::from_utf8_lossy(&o.stderr)));
        }
    }
    let out = dir.join(name);
    let server = shoal()
        .args(["run", "--json", "--output"])
        .arg(&out)
        .arg(&job)
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut procs = Killed(vec![server]);
    wait_for("the federated server to listen", Duration::from_secs(60), || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    })?;
    for c in 0..4 {
        let token = std::fs::read_to_string(parts.join(format!("client-{c:04}.token"))).map_err(|e| e.to_string())?;
        let mut cmd = shoal();
        cmd.args(["fed", "client", "--retry-for", "30", "--server", &format!("http://127.0.0.1:{port}"), "--token"])
            .arg(token.trim())
            .arg("--data")
            .arg(parts.join(format!("client-{c:04}.csv")))
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let (Some((round, step)), 3) = (fault, c) {
            cmd.env("SHOAL_FAULT_FED_CLIENT_EXIT", format!("{round}:{step}"));
        }
        procs.0.push(cmd.spawn().map_err(|e| e.to_string())?);
    }
    let mut codes = Vec::new();
    for child in procs.0.drain(..) {
        let o = child.wait_with_output().map_err(|e| e.to_string())?;
        if codes.is_empty() && !o.status.success() {
            return Err(format!("the federated server failed: {}", String::from_utf8_lossy(&o.stderr)));
        }
        codes.push(o.status.code());
    }
    let summary = std::fs::read_to_string(out.join("summary.json")).map_err(|e| e.to_string())?;
    Ok((serde_json::from_str(&summary).map_err(|e| e.to_string())?, codes[1..].to_vec()))
}

/// The model a run ended with, every value as f32.
fn model(dir: &Path) -> Res<Vec<f32>> {
    let bytes = std::fs::read(dir.join("model.safetensors")).map_err(|e| e.to_string())?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let mut named: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(named.into_iter().flat_map(|(_, v)| v).collect())
}

#[test]
fn secure_aggregation_between_remote_clients_gives_plain_fedavgs_model_and_survives_a_client_lost_mid_round() -> Res<()>
{
    let dir: PathBuf = std::env::temp_dir().join(format!("shoal-fed-secure-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    // One round from the same model: the unmasked sum is the plain sum, to the fixed point's rounding.
    let (plain, _) = loopback_run(&dir, "plain", "rounds = 1", None)?;
    let (secure, _) = loopback_run(&dir, "secure", "rounds = 1\nsecure_aggregation = true", None)?;
    let (a, b) = (model(&dir.join("plain"))?, model(&dir.join("secure"))?);
    assert_eq!(a.len(), b.len());
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(diff <= 1e-6, "secure aggregation's model is plain FedAvg's within 1e-6: {diff}");
    let bytes = |s: &Value| s["federated"]["rounds"][0]["bytes"].as_u64().unwrap_or(0);
    let ratio = bytes(&secure) as f64 / bytes(&plain).max(1) as f64;
    assert!(ratio > 1.0 && ratio <= 2.0, "secure aggregation's bytes against plain: {ratio}");
    eprintln!(
        "secure aggregation over HTTP, 4 clients, 1 round: model within {diff:e} of plain, {ratio:.3}× the bytes"
    );

    // Client 3 sends its keys and shares in round 2, then dies before its masked vector: the survivors' shares of
    // its key take its masks off, and the rounds go on without it.
    let (lost, codes) = loopback_run(&dir, "lost", "rounds = 3\nsecure_aggregation = true", Some((2, "masked")))?;
    assert_eq!(codes[3], Some(3), "client 3 exited by the fault: {codes:?}");
    assert!(codes[..3].iter().all(|c| *c == Some(0)), "the other clients ended well: {codes:?}");
    let rounds = lost["federated"]["rounds"].as_array().cloned().unwrap_or_default();
    assert_eq!(rounds.len(), 3);
    assert_eq!(rounds[0]["clients"], 4, "{rounds:?}");
    assert_eq!(rounds[1]["clients"], 3, "round 2 combined the 3 survivors: {rounds:?}");
    let missing = |r: &Value| r["late"].as_u64().unwrap_or(0) + r["dropped"].as_u64().unwrap_or(0);
    assert_eq!(missing(&rounds[1]), 1, "{rounds:?}");
    let acc = lost["eval_accuracy"].as_f64().unwrap_or(0.0);
    let loss = rounds[1]["loss"].as_f64().unwrap_or(f64::NAN);
    assert!(loss.is_finite() && loss < 3.0, "round 2's unmasked loss is a loss, not noise: {loss}");
    let first = rounds[0]["eval_accuracy"].as_f64().unwrap_or(1.0);
    assert!(
        acc > first && acc > 0.7,
        "the model still learns after round 2's unmasking: {first} after round 1, {acc} after 3"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
