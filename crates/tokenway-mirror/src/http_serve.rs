//! The accept loop the mirror and the peer server share: HTTP/1.1 and HTTP/2 on one port,
//! TCP_NODELAY, at most `max_connections` open (a further one is closed at once, not queued),
//! and on shutdown a drain of open connections for at most `grace`.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::range_server::Body;

/// Serves `handler` on `listener` until `shutdown` resolves; `what` names the server in logs.
pub async fn serve<H, Fut>(
    listener: TcpListener,
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
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
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
        let svc = service_fn(move |req| {
            let response = handler(req);
            async move { Ok::<_, Infallible>(response.await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), svc)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "{what}: connection ended with an error");
            }
            drop(permit);
        });
    }
    let _ = tokio::time::timeout(grace, graceful.shutdown()).await;
}
