//! The accept loop the mirror and the peer server share: HTTP/1.1, optionally over TLS,
//! TCP_NODELAY, at most `max_connections` open (a further one is closed at once, not queued),
//! and on shutdown a drain of open connections for at most `grace`.
//!
//! HTTP/1.1 only: pullers fetch pieces over several connections at once (no head-of-line
//! blocking of one TCP connection, no flow-control windows to tune), and an HTTP/2 stream whose
//! client never opens its window would park the piece it is being sent in the server's send
//! queue, out of reach of any write timeout, for as long as the connection lives.
//!
//! A connection whose client takes less than [`MIN_PROGRESS`] per [`WRITE_STALL_TIMEOUT`]
//! while the server has bytes to send is closed ([`StallGuard`]): otherwise a client that stops
//! reading, or reads a few bytes now and then, keeps the piece it is being sent in memory (and
//! its share of the serving budget) for as long as it likes. And every connection ends once
//! nothing has moved on it for [`Limits::idle`] (two minutes by default; a request head must
//! arrive within [`HEADER_READ_TIMEOUT`]): a connection slot is otherwise held for good by a
//! client that connects and sends nothing, or by a puller that vanished without a FIN (spot
//! termination, power-off, a dropped NAT entry) while its pooled connection was idle, and once
//! all slots are held the server closes every new connection.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
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

/// Longest an HTTP/1 request head may take to arrive, idle keep-alive time included: longer
/// than the pullers' own pool idle timeout (30 s), so they drop an idle connection first and
/// never send on one the server is closing.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Bytes a client must take per [`WRITE_STALL_TIMEOUT`] while the server has bytes to send
/// (about 2 KiB/s: a puller on the slowest link takes megabytes).
pub const MIN_PROGRESS: u64 = 64 << 10;

/// The default of [`Limits::idle`]: longer than a cold mirror may keep a response waiting on
/// its origin without writing a byte.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// The bounds of a server's connections.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once; a further one is closed at accept.
    pub max_connections: usize,
    /// How long open connections may finish after shutdown.
    pub grace: Duration,
    /// A connection on which nothing has moved either way for this long is closed.
    pub idle: Duration,
}

/// Serves `handler` on `listener` (over TLS with `tls`) until `shutdown` resolves; `what` names
/// the server in logs.
pub async fn serve<H, Fut>(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    what: &'static str,
    limits: Limits,
    handler: H,
    shutdown: impl Future<Output = ()>,
) where
    H: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let Limits {
        max_connections,
        grace,
        idle,
    } = limits;
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT.min(idle));
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
        // Requests of this connection whose answers are still being worked on: the
        // connection is not idle meanwhile (a preheat answers only when it is done).
        let busy = Arc::new(AtomicUsize::new(0));
        let working = Arc::clone(&busy);
        let svc = service_fn(move |mut req: Request<Incoming>| {
            req.extensions_mut().insert(RemoteAddr(remote));
            let response = handler(req);
            let working = Working::start(&working);
            async move {
                let response = response.await;
                drop(working);
                Ok::<_, Infallible>(response)
            }
        });
        let Some(acceptor) = acceptor.clone() else {
            let io = TokioIo::new(guarded(stream, idle, busy));
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
            let io = TokioIo::new(guarded(stream, idle, busy));
            let conn = builder.serve_connection(io, svc).into_owned();
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(error = %e, "{what}: connection ended with an error");
            }
            drop(permit);
        });
    }
    let _ = tokio::time::timeout(grace, graceful.shutdown()).await;
}

/// A connection's stream with its write-stall and idle bounds.
fn guarded<T>(stream: T, idle: Duration, busy: Arc<AtomicUsize>) -> StallGuard<T> {
    StallGuard::new(stream, WRITE_STALL_TIMEOUT)
        .with_min_progress(MIN_PROGRESS)
        .with_idle_limit(idle)
        .with_busy_count(busy)
}

/// One request being worked on, counted while it lives (dropped with its future if the
/// connection goes first).
struct Working(Arc<AtomicUsize>);

impl Working {
    fn start(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(count))
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
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

    /// Reads what the server sends until it closes the connection (or 10 s pass: a hang).
    async fn read_to_close(stream: &mut tokio::net::TcpStream) -> Result<Vec<u8>, &'static str> {
        let mut got = Vec::new();
        match tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut got)).await {
            Ok(_) => Ok(got),
            Err(_) => Err("the server kept the connection open"),
        }
    }

    /// A plain-HTTP server of two connection slots with `handler` and the `idle` bound, served
    /// until the test ends; its address.
    async fn start<H, Fut>(idle: Duration, handler: H) -> std::net::SocketAddr
    where
        H: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Response<Body>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            max_connections: 2,
            grace: Duration::from_secs(1),
            idle,
        };
        tokio::spawn(serve(
            listener,
            None,
            "test",
            limits,
            handler,
            std::future::pending(),
        ));
        addr
    }

    #[tokio::test]
    async fn a_request_being_worked_on_keeps_its_connection_however_long_it_takes() {
        // A preheat answers only when it is done, minutes later: the client waits on a
        // connection where nothing moves, and that is not idleness.
        let addr = start(Duration::from_millis(200), |_req| async {
            tokio::time::sleep(Duration::from_millis(1000)).await;
            Response::new(crate::range_server::full("done"))
        })
        .await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /v1/preheat HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = read_to_close(&mut s).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("done"), "{answer}");
    }

    #[tokio::test]
    async fn connections_idle_past_the_limit_are_closed_and_free_their_slots() {
        let addr = start(Duration::from_millis(300), |_req| async {
            Response::new(crate::range_server::full("ok"))
        })
        .await;
        // One client connects and never says a word; another makes a request and then keeps
        // its connection idle. Together they hold both slots.
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut kept = tokio::net::TcpStream::connect(addr).await.unwrap();
        kept.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut head = [0u8; 12];
        kept.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 200");
        // Both are closed once idle past the limit, which frees their slots.
        assert!(read_to_close(&mut silent).await.unwrap().is_empty());
        read_to_close(&mut kept).await.unwrap();
        let mut next = tokio::net::TcpStream::connect(addr).await.unwrap();
        next.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = read_to_close(&mut next).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("ok"), "{answer}");
    }
}
