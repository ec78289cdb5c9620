//! Graceful close of open client connections at shutdown, at no cost per poll.
//!
//! hyper-util's `GracefulShutdown` wraps each connection in a future that polls a shared
//! `watch` channel's `changed()` on every poll of the connection: that takes the channel's
//! mutex, one mutex for all connections of all front threads, several times per request
//! (`tokio::sync::notify` and `watch::Receiver::changed` were 2.4 % of the gateway's user time
//! in a `wrk -c1` profile). Here a connection registers with the shared [`Notify`] once, on its
//! first poll, and afterwards reads an atomic flag per poll; [`Drain::shutdown`] sets the flag,
//! wakes every connection once, and waits until all have finished.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::server::graceful::GracefulConnection;
use tokio::sync::futures::OwnedNotified;
use tokio::sync::{watch, Notify};

/// A connection that can be asked to finish what it is doing and close.
pub trait Graceful: Future {
    /// Starts the graceful close.
    fn graceful_shutdown(self: Pin<&mut Self>);
}

/// hyper's connections (HTTP/2, and the auto-detecting one).
impl<C: GracefulConnection> Graceful for C {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        GracefulConnection::graceful_shutdown(self);
    }
}

/// The drain signal shared by every front thread.
pub struct Drain {
    draining: AtomicBool,
    notify: Arc<Notify>,
    /// Every watched connection holds a receiver; `closed()` resolves when the last one ends.
    open: watch::Sender<()>,
}

impl Default for Drain {
    fn default() -> Self {
        Self {
            draining: AtomicBool::new(false),
            notify: Arc::new(Notify::new()),
            open: watch::Sender::new(()),
        }
    }
}

impl Drain {
    /// Wraps `conn` so that it starts a graceful close when the drain begins.
    pub fn watch<C: Graceful>(self: &Arc<Self>, conn: C) -> Watched<C> {
        Watched {
            conn,
            drain: self.clone(),
            woken: None,
            closing: false,
            _open: self.open.subscribe(),
        }
    }

    /// Asks every watched connection to close gracefully (an HTTP/1.1 connection finishes the
    /// response in flight, an HTTP/2 one sends GOAWAY) and waits until all have ended.
    pub async fn shutdown(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
        self.open.closed().await;
    }

    fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
}

pin_project_lite::pin_project! {
    /// A connection watched by a [`Drain`].
    pub struct Watched<C> {
        #[pin]
        conn: C,
        drain: Arc<Drain>,
        // Registered on the first poll; a task's waker stays valid for the task's life, so it
        // is not polled again until the drain wakes it.
        #[pin]
        woken: Option<OwnedNotified>,
        closing: bool,
        _open: watch::Receiver<()>,
    }
}

impl<C: Graceful> Future for Watched<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let mut this = self.project();
        if !*this.closing {
            if this.woken.is_none() {
                this.woken
                    .set(Some(this.drain.notify.clone().notified_owned()));
                let mut woken = this.woken.as_mut().as_pin_mut().expect("just set");
                // Register before reading the flag: a drain that starts in between wakes us.
                woken.as_mut().enable();
                let _ = woken.poll(cx);
            }
            if this.drain.draining() {
                *this.closing = true;
                this.conn.as_mut().graceful_shutdown();
            }
        }
        this.conn.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper_util::rt::TokioIo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A real HTTP/1.1 server connection on one end of an in-memory pipe, watched by `drain`.
    fn serve(drain: &Arc<Drain>) -> (tokio::task::JoinHandle<()>, tokio::io::DuplexStream) {
        let (client, server) = tokio::io::duplex(4096);
        let svc = hyper::service::service_fn(|_req| async {
            Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from("ok"))))
        });
        let conn =
            hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(server), svc);
        let watched = drain.watch(conn);
        (
            tokio::spawn(async move {
                let _ = watched.await;
            }),
            client,
        )
    }

    #[tokio::test]
    async fn shutdown_closes_idle_keep_alive_connections_and_returns() {
        let drain = Arc::new(Drain::default());
        let (task, mut client) = serve(&drain);
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 1024];
        let n = client.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
        // The connection is now idle between requests; the drain must close it.
        tokio::time::timeout(Duration::from_secs(5), drain.shutdown())
            .await
            .expect("drain finished");
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("connection ended")
            .unwrap();
        assert_eq!(
            client.read(&mut buf).await.unwrap(),
            0,
            "closed by the server"
        );
    }

    #[tokio::test]
    async fn a_connection_watched_after_the_drain_began_closes_too() {
        let drain = Arc::new(Drain::default());
        let d = drain.clone();
        let first = serve(&drain);
        let shutdown = tokio::spawn(async move { d.shutdown().await });
        tokio::task::yield_now().await;
        let (task, _client) = serve(&drain);
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("late connection ended")
            .unwrap();
        drop(first);
        tokio::time::timeout(Duration::from_secs(5), shutdown)
            .await
            .expect("drain finished")
            .unwrap();
    }

    #[tokio::test]
    async fn shutdown_without_connections_returns_at_once() {
        let drain = Drain::default();
        tokio::time::timeout(Duration::from_secs(1), drain.shutdown())
            .await
            .expect("nothing to wait for");
    }
}
