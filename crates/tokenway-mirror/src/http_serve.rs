//! The accept loop the mirror and the peer server share: HTTP/1.1 and HTTP/2 on one port,
//! optionally over TLS, TCP_NODELAY, at most `max_connections` open (a further one is closed at
//! once, not queued), and on shutdown a drain of open connections for at most `grace`.
//!
//! A connection whose client reads nothing for [`WRITE_STALL_TIMEOUT`] while the server has
//! bytes to send is closed ([`StallGuard`]): otherwise a client that stops reading keeps the
//! piece it was being sent in memory for as long as it likes.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use tokenway_transport::stall_io::StallGuard;

use crate::range_server::Body;

/// The address a request's connection came from, put in every request's extensions (the
/// mirror files a peer that announces an unspecified address such as `0.0.0.0:PORT` under it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteAddr(pub SocketAddr);

/// Longest a connection may go without the client taking a byte while the server has bytes
/// to send (a puller reads continuously; its own idle bound is 10 s).
pub const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `handler` on `listener` (over TLS with `tls`) until `shutdown` resolves; `what` names
/// the server in logs.
pub async fn serve<H, Fut>(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    what: &'static str,
    max_connections: usize,
    grace: Duration,
    handler: H,
    shutdown: impl Future<Output = ()>,
) where
    H: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    let acceptor = tls.map(TlsAcceptor::from);
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    tokio::pin!(shutdown);
    loop {
        let (stream, remote) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "{what}: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::warn!("{what}: {max_connections} connections open; closing a new one");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        let svc = service_fn(move |mut req: Request<Incoming>| {
            req.extensions_mut().insert(RemoteAddr(remote));
            let response = handler(req);
            async move { Ok::<_, Infallible>(response.await) }
        });
        let Some(acceptor) = acceptor.clone() else {
            let io = TokioIo::new(StallGuard::new(stream, WRITE_STALL_TIMEOUT));
            let conn = builder.serve_connection(io, svc).into_owned();
            let conn = graceful.watch(conn);
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "{what}: connection ended with an error");
                }
                drop(permit);
            });
            continue;
        };
        // The handshake runs on the connection's own task, so a slow client holds up no one;
        // the drain on shutdown waits for handshakes in progress too (the watcher is taken
        // first), within the grace period.
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let stream =
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "{what}: TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!("{what}: TLS handshake timed out");
                        return;
                    }
                };
            let io = TokioIo::new(StallGuard::new(stream, WRITE_STALL_TIMEOUT));
            let conn = builder.serve_connection(io, svc).into_owned();
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(error = %e, "{what}: connection ended with an error");
            }
            drop(permit);
        });
    }
    let _ = tokio::time::timeout(grace, graceful.shutdown()).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_client_that_stops_reading_fails_the_write_after_the_stall_timeout() {
        let (server, mut client) = tokio::io::duplex(1024);
        let mut guarded = StallGuard::new(server, WRITE_STALL_TIMEOUT);
        let piece = vec![7u8; 8 * 1024];
        // A slow but reading client (1 KiB every 10 s): the write takes 80 s and succeeds.
        let read = async {
            let mut got = vec![0u8; 8 * 1024];
            for chunk in got.chunks_mut(1024) {
                tokio::time::sleep(Duration::from_secs(10)).await;
                client.read_exact(chunk).await.unwrap();
            }
        };
        let (w, ()) = tokio::join!(guarded.write_all(&piece), read);
        w.unwrap();
        // Now the client reads nothing: the write fails once the timeout has passed.
        let t = tokio::time::Instant::now();
        let e = guarded.write_all(&piece).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() >= WRITE_STALL_TIMEOUT);
        drop(client);
    }
}
