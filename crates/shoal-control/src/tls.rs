//! TLS for the API (`--tls-cert`, `--tls-key`): the certificate chain and private key read from PEM files into a
//! rustls server configuration. Every error names the file and what was wrong with it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::{ControlError, Result};

/// Where the server's certificate chain and key are.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// PEM: the server's certificate first, then any intermediates.
    pub cert: PathBuf,
    /// PEM: its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

fn bad(path: &Path, what: impl std::fmt::Display) -> ControlError {
    ControlError::Config(format!("{}: {what}", path.display()))
}

/// The rustls configuration for `files`: HTTP/1.1 only, no client certificates (callers authenticate by token).
pub fn server_config(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| bad(&files.cert, format!("reading the certificate chain (--tls-cert): {e}")))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| bad(&files.cert, format!("not a PEM certificate chain (--tls-cert): {e}")))?;
    if certs.is_empty() {
        return Err(bad(&files.cert, "holds no CERTIFICATE block (--tls-cert)"));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| bad(&files.key, format!("no private key read (--tls-key): {e}")))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ControlError::Config(format!("TLS protocol versions: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| {
            ControlError::Config(format!(
                "{} and {} do not make a usable certificate and key: {e}",
                files.cert.display(),
                files.key.display()
            ))
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
