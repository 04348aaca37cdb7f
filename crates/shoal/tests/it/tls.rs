//! TLS on the API: `shoal server --tls-cert --tls-key` serves HTTPS with a certificate from a private CA (made here
//! with the `openssl` command), the CLI verifies it (`--ca`), refuses it without the CA, and a plain-HTTP client
//! gets nothing; a certificate file that is not one is refused at start naming it; a server on a non-loopback
//! address without TLS says why that is risky.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-tls-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

pub(crate) fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().expect("the openssl command");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA (`ca.pem`) and a certificate it signed for 127.0.0.1 (`server.pem`, `server.key`).
pub(crate) fn certificates(dir: &Path) {
    openssl(
        dir,
        &["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key"]
            .into_iter()
            .chain(["-out", "ca.pem", "-days", "2", "-subj", "/CN=shoal test CA"])
            .collect::<Vec<_>>(),
    );
    openssl(
        dir,
        &["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "server.key"]
            .into_iter()
            .chain(["-out", "server.csr", "-subj", "/CN=127.0.0.1"])
            .collect::<Vec<_>>(),
    );
    std::fs::write(dir.join("san.cnf"), "subjectAltName = IP:127.0.0.1\n").expect("san");
    openssl(
        dir,
        &["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial"]
            .into_iter()
            .chain(["-out", "server.pem", "-days", "2", "-extfile", "san.cnf"])
            .collect::<Vec<_>>(),
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `shoal server` with `extra` arguments and waits until it wrote its admin token and listens.
fn server(dir: &Path, port: u16, extra: &[&str]) -> (Server, String) {
    let data = dir.join("data");
    let child = shoal()
        .args(["server", "--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
        .arg(&data)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start shoal server");
    let s = Server(child);
    let t0 = Instant::now();
    loop {
        let token = std::fs::read_to_string(data.join("admin.token")).unwrap_or_default();
        if !token.trim().is_empty() && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return (s, token.trim().to_owned());
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the server did not start within 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn jobs(addr: &str, token: &str, extra: &[&str]) -> Output {
    shoal().args(["jobs", "--json", "--addr", addr, "--token", token]).args(extra).output().expect("shoal jobs")
}

#[test]
fn the_api_serves_https_that_the_cli_verifies() {
    let dir = tmpdir("https");
    certificates(&dir);
    let port = free_port();
    let (cert, key) = (dir.join("server.pem"), dir.join("server.key"));
    let (_server, token) =
        server(&dir, port, &["--tls-cert", cert.to_str().unwrap_or(""), "--tls-key", key.to_str().unwrap_or("")]);
    let https = format!("https://127.0.0.1:{port}");
    let ca = dir.join("ca.pem");

    let ok = jobs(&https, &token, &["--ca", ca.to_str().unwrap_or("")]);
    assert!(ok.status.success(), "shoal jobs over HTTPS with the CA: {}", String::from_utf8_lossy(&ok.stderr));
    let v: serde_json::Value = serde_json::from_slice(&ok.stdout).expect("jobs as JSON");
    assert!(v.is_object() || v.is_array(), "{v}");

    // Without the private CA the certificate is not trusted.
    let untrusted = jobs(&https, &token, &[]);
    assert!(!untrusted.status.success(), "a certificate of an unknown CA was accepted");
    let err = String::from_utf8_lossy(&untrusted.stderr).to_lowercase();
    assert!(err.contains("certificate") || err.contains("issuer"), "no word of the certificate: {err}");

    // Plain HTTP to a TLS port gets no answer.
    let plain = jobs(&format!("http://127.0.0.1:{port}"), &token, &[]);
    assert!(!plain.status.success(), "plain HTTP was answered on the TLS port");

    // The CA from the environment works as --ca does.
    let env = shoal()
        .args(["jobs", "--json", "--addr", &https, "--token", &token])
        .env("SHOAL_CA", &ca)
        .output()
        .expect("shoal jobs");
    assert!(env.status.success(), "SHOAL_CA: {}", String::from_utf8_lossy(&env.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_tls_files_are_refused_naming_them() {
    let dir = tmpdir("bad");
    std::fs::write(dir.join("not-a-cert.pem"), "hello\n").expect("write");
    std::fs::write(dir.join("empty.key"), "").expect("write");
    let out = shoal()
        .args(["server", "--listen", &format!("127.0.0.1:{}", free_port()), "--data-dir"])
        .arg(dir.join("data"))
        .arg("--tls-cert")
        .arg(dir.join("not-a-cert.pem"))
        .arg("--tls-key")
        .arg(dir.join("empty.key"))
        .output()
        .expect("shoal server");
    assert!(!out.status.success(), "a server started with a file that is not a certificate");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not-a-cert.pem"), "the error does not name the certificate file: {err}");

    let half = shoal().args(["server", "--tls-cert", "x.pem"]).output().expect("shoal server");
    assert!(!half.status.success());
    assert!(String::from_utf8_lossy(&half.stderr).contains("--tls-key"), "a certificate without its key");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plain_http_beyond_loopback_is_warned_about() {
    let dir = tmpdir("warn");
    let port = free_port();
    let mut child = shoal()
        .args(["server", "--listen", &format!("0.0.0.0:{port}"), "--data-dir"])
        .arg(dir.join("data"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start shoal server");
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let out = child.wait_with_output().expect("server output");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("plain HTTP") && err.contains("--tls-cert"), "no warning about plain HTTP: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}
