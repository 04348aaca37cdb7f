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
