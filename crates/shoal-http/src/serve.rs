//! The accept loop shared by every server of Shoal.

use std::sync::Arc;
use std::time::Duration;

/// How long a client may take to send a request's headers — and how long a kept-alive connection may sit idle
/// before its next request.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more are closed as they arrive (logged).
pub const MAX_CONNECTIONS: usize = 512;
/// How long shutdown waits for open requests to finish.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Serves `app` on `listener` until `shutdown` changes: HTTP/1.1 (inside TLS when `tls` is given) with
/// [`HEADER_TIMEOUT`] on the TLS handshake, on headers and on idle connections, at most [`MAX_CONNECTIONS`] at
/// once, then a graceful shutdown (open requests finish, for at most [`SHUTDOWN_GRACE`]).
///
/// Under TLS the peer's certificate chain, when it sent one, reaches the handlers as a request extension
/// ([`crate::tls::PeerCertificates`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT).keep_alive(true);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: wait a moment rather than spin.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.changed() => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%peer, limit = MAX_CONNECTIONS, "too many connections; closing a new one");
            drop(stream);
            continue;
        };
        let (http, watcher, tls, app) = (http.clone(), graceful.watcher(), tls.clone(), app.clone());
        tokio::spawn(async move {
            let served = match tls {
                None => {
                    let svc = hyper_util::service::TowerToHyperService::new(app);
                    watcher.watch(http.serve_connection(hyper_util::rt::TokioIo::new(stream), svc)).await
                }
                Some(acceptor) => match tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls_stream)) => {
                        let peer_certs = tls_stream.get_ref().1.peer_certificates().map(|c| {
                            crate::tls::PeerCertificates(Arc::new(c.iter().map(|d| d.clone().into_owned()).collect()))
                        });
                        let app = match peer_certs {
                            Some(certs) => app.layer(axum::Extension(certs)),
                            None => app,
                        };
                        let svc = hyper_util::service::TowerToHyperService::new(app);
                        let conn = http.serve_connection(hyper_util::rt::TokioIo::new(tls_stream), svc);
                        watcher.watch(conn).await
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        Ok(())
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake did not finish in time");
                        Ok(())
                    }
                },
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(slot);
        });
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(SHUTDOWN_GRACE) => tracing::warn!("open connections did not finish in time"),
    }
    Ok(())
}
