//! TLS from PEM files: a server's configuration (its certificate chain and key, and optionally the CA whose
//! client certificates it requires), and a client's (the CA it trusts instead of the public roots, and optionally
//! its own certificate and key). Every error names the file and the option it came from.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::ConfigError;

/// Where a certificate chain and its key are.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// PEM: the certificate first, then any intermediates.
    pub cert: PathBuf,
    /// PEM: its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// The certificate chain a client presented (leaf first), handed to the handlers as a request extension when the
/// server asked for one.
#[derive(Debug, Clone)]
pub struct PeerCertificates(pub Arc<Vec<CertificateDer<'static>>>);

fn bad(path: &Path, what: impl std::fmt::Display) -> ConfigError {
    ConfigError(format!("{}: {what}", path.display()))
}

/// The certificates of a PEM file (`option` names where it was given, for the errors).
pub fn certificates(path: &Path, option: &str) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(path, format!("reading the certificates ({option}): {e}")))?
        .collect::<Result<_, _>>()
        .map_err(|e| bad(path, format!("not a PEM certificate file ({option}): {e}")))?;
    if certs.is_empty() {
        return Err(bad(path, format!("holds no CERTIFICATE block ({option})")));
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The rustls configuration for `files`: HTTP/1.1 only. Without `client_ca`, no client certificates (callers
/// authenticate by token); with it, every client must present a certificate that CA signed.
pub fn server_config(files: &TlsFiles, client_ca: Option<&Path>) -> Result<Arc<rustls::ServerConfig>, ConfigError> {
    let certs = certificates(&files.cert, "--tls-cert")?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| bad(&files.key, format!("no private key read (--tls-key): {e}")))?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError(format!("TLS protocol versions: {e}")))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certificates(ca, "client CA")? {
                roots.add(c).map_err(|e| bad(ca, format!("not a usable CA certificate: {e}")))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| bad(ca, format!("cannot verify clients with it: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        ConfigError(format!(
            "{} and {} do not make a usable certificate and key: {e}",
            files.cert.display(),
            files.key.display()
        ))
    })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// An HTTP client whose every request is bounded by `timeout`, and whose `https://` requests verify the server
/// against `ca` (PEM: one or more certificates) instead of the public roots, presenting `identity` (a certificate
/// chain and its key) when given. Error statuses come back as responses, for the caller to read their bodies.
pub fn client(ca: Option<&Path>, identity: Option<&TlsFiles>, timeout: Duration) -> Result<ureq::Agent, ConfigError> {
    let mut tls = ureq::tls::TlsConfig::builder();
    if let Some(ca) = ca {
        let roots: Vec<ureq::tls::Certificate<'static>> =
            certificates(ca, "--ca")?.iter().map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned()).collect();
        tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&roots));
    }
    if let Some(id) = identity {
        let chain: Vec<ureq::tls::Certificate<'static>> = certificates(&id.cert, "--cert")?
            .iter()
            .map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned())
            .collect();
        // The pair is checked here, so that a bad one is an error naming the files rather than a failure deep in
        // the first request.
        let der = PrivateKeyDer::from_pem_file(&id.key)
            .map_err(|e| bad(&id.key, format!("no private key read (--key): {e}")))?;
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| ConfigError(format!("TLS protocol versions: {e}")))?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_client_auth_cert(certificates(&id.cert, "--cert")?, der)
            .map_err(|e| {
                ConfigError(format!(
                    "{} and {} do not make a usable client certificate and key (--cert, --key): {e}",
                    id.cert.display(),
                    id.key.display()
                ))
            })?;
        let pem = std::fs::read(&id.key).map_err(|e| bad(&id.key, format!("reading the key (--key): {e}")))?;
        let key = ureq::tls::PrivateKey::from_pem(&pem)
            .map_err(|e| bad(&id.key, format!("no private key read (--key): {e}")))?;
        tls = tls.client_cert(Some(ureq::tls::ClientCert::new_with_certs(&chain, key)));
    }
    Ok(ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .tls_config(tls.build())
        .build()
        .into())
}
