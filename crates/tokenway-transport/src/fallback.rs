//! The TCP fallback: HTTP/2 over TLS over TCP to the gateway's TLS port, for paths where UDP
//! does not get through. Same request interface as [`crate::client::QuicClient`].
//!
//! TCP_NODELAY is set so a small request or first token is not held back by Nagle's algorithm.
//! A request that needs an upgraded byte stream (CONNECT for port forwarding) uses
//! [`TcpClient::connect_stream`], since HTTP/2 CONNECT in hyper hands the stream over as an
//! upgrade rather than as a body.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Body;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls_pki_types::ServerName;
use tokenway_telemetry::quic::{ConnectLabels, QuicMetrics};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::client::{absolute_uri, BoxError, ClientBody, RequestError};
use crate::error::TransportError;

type ReqBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// One HTTP/2-over-TLS connection to a gateway.
pub struct TcpClient {
    sender: http2::SendRequest<ReqBody>,
    server_name: String,
    addr: SocketAddr,
    driver: tokio::task::AbortHandle,
    tasks: ConnTasks,
    /// [`TcpClient::close`] was called: a request that fails from now on failed for that
    /// (hyper's "dispatch task is gone", when the aborted connection task dropped the request
    /// before its sender could see the connection closed), and is retryable.
    closed: std::sync::atomic::AtomicBool,
}

/// hyper's executor for one connection, keeping a handle to every task it spawns. hyper runs
/// the HTTP/2 connection itself (the task that owns the socket) and each stream's body pump as
/// tasks of their own; aborting only the task hyper hands back started a graceful close that
/// waited for every open stream, so requests on a dead path hung until the keep-alive gave up
/// (10 to 20 s) instead of failing at once to be retried on the next connection.
#[derive(Clone, Default)]
struct ConnTasks(Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>);

impl ConnTasks {
    /// Aborts every task of the connection still running.
    fn abort_all(&self) {
        for task in lock(&self.0).drain(..) {
            task.abort();
        }
    }
}

impl<F> hyper::rt::Executor<F> for ConnTasks
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        let task = tokio::spawn(fut).abort_handle();
        let mut tasks = lock(&self.0);
        // Bounded by the tasks running: finished ones are dropped as new ones come.
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl std::fmt::Debug for TcpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpClient")
            .field("peer", &self.addr)
            .finish()
    }
}

impl TcpClient {
    /// Connects to `addr`, checking the server against `tls` (which must offer ALPN h2), within
    /// `timeout`.
    pub async fn connect(
        addr: SocketAddr,
        server_name: &str,
        tls: Arc<rustls::ClientConfig>,
        timeout: Duration,
        peer: &str,
        metrics: Option<&QuicMetrics>,
    ) -> Result<Self, TransportError> {
        let err = |message: String| TransportError::Connect { addr, message };
        let name = ServerName::try_from(server_name.to_string())
            .map_err(|e| err(format!("bad server name {server_name:?}: {e}")))?;
        let connect = async {
            let tcp = TcpStream::connect(addr)
                .await
                .map_err(|e| err(format!("TCP connect: {e}")))?;
            let _ = tcp.set_nodelay(true);
            let tls_stream = TlsConnector::from(tls)
                .connect(name, tcp)
                .await
                .map_err(|e| err(format!("TLS handshake: {e}")))?;
            if tls_stream.get_ref().1.alpn_protocol() != Some(crate::ALPN_H2) {
                return Err(err("the server did not agree to HTTP/2 (ALPN h2)".into()));
            }
            let tasks = ConnTasks::default();
            let (sender, conn) = http2::Builder::new(tasks.clone())
                .timer(TokioTimer::new())
                .keep_alive_interval(Some(Duration::from_secs(10)))
                .keep_alive_timeout(Duration::from_secs(10))
                .initial_stream_window_size(4 << 20)
                .initial_connection_window_size(16 << 20)
                // Response heads as large as the QUIC path takes (h2's default is 16 KiB).
                .max_header_list_size(64 << 10)
                .handshake(TokioIo::new(tls_stream))
                .await
                .map_err(|e| err(format!("HTTP/2 handshake: {e}")))?;
            let driver = tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "HTTP/2 tunnel connection ended");
                }
            });
            Ok(Self {
                sender,
                server_name: server_name.to_string(),
                addr,
                driver: driver.abort_handle(),
                tasks,
                closed: std::sync::atomic::AtomicBool::new(false),
            })
        };
        let client = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| err(format!("TCP/TLS connect did not finish within {timeout:?}")))??;
        if let Some(m) = metrics {
            m.connections
                .get_or_create(&ConnectLabels {
                    peer: peer.to_string(),
                    transport: "tcp".into(),
                })
                .inc();
        }
        Ok(client)
    }

    /// Whether the connection has closed.
    pub fn is_closed(&self) -> bool {
        self.sender.is_closed() || self.closed_here()
    }

    /// Whether [`Self::close`] was called.
    fn closed_here(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The gateway's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes the connection at once: the socket is dropped and requests waiting on it fail
    /// (as retryable) now, not when the keep-alive notices.
    pub fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.driver.abort();
        self.tasks.abort_all();
    }

    /// Sends one request; bodies stream both ways.
    pub async fn send_request<B>(
        &self,
        req: Request<B>,
    ) -> Result<Response<ClientBody>, RequestError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (mut parts, body) = req.into_parts();
        parts.uri = absolute_uri(parts.uri, &self.server_name)?;
        parts.headers.remove(http::header::HOST);
        let req = Request::from_parts(parts, body.map_err(Into::into).boxed_unsync());
        let mut sender = self.sender.clone();
        if sender.ready().await.is_err() {
            return Err(RequestError::new("the HTTP/2 connection is closed", true));
        }
        match sender.send_request(req).await {
            Ok(resp) => Ok(resp.map(|b| b.map_err(BoxError::from).boxed_unsync())),
            Err(e) => {
                let retryable =
                    e.is_closed() || e.is_canceled() || sender.is_closed() || self.closed_here();
                Err(RequestError::new(
                    format!("HTTP/2 request failed: {e}"),
                    retryable,
                ))
            }
        }
    }

    /// Sends a CONNECT request for `authority` with `headers` and, on a 2xx answer, returns the
    /// byte stream it opened; otherwise the status.
    pub async fn connect_stream(
        &self,
        authority: &str,
        headers: http::HeaderMap,
    ) -> Result<Result<hyper::upgrade::Upgraded, http::StatusCode>, RequestError> {
        let mut req = Request::connect(authority)
            .body(
                http_body_util::Empty::<Bytes>::new()
                    .map_err(|n| match n {})
                    .boxed_unsync(),
            )
            .map_err(|e| {
                RequestError::new(format!("bad CONNECT target {authority:?}: {e}"), false)
            })?;
        *req.headers_mut() = headers;
        let mut sender = self.sender.clone();
        if sender.ready().await.is_err() {
            return Err(RequestError::new("the HTTP/2 connection is closed", true));
        }
        let resp = sender.send_request(req).await.map_err(|e| {
            let retryable = e.is_closed() || e.is_canceled() || self.closed_here();
            RequestError::new(format!("HTTP/2 CONNECT failed: {e}"), retryable)
        })?;
        if !resp.status().is_success() {
            return Ok(Err(resp.status()));
        }
        let upgraded = hyper::upgrade::on(resp)
            .await
            .map_err(|e| RequestError::new(format!("HTTP/2 CONNECT stream: {e}"), false))?;
        Ok(Ok(upgraded))
    }
}
