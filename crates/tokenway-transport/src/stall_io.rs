//! A write-stall guard for the connections of clients: the gateway's fronts and the mirror's
//! and peers' servers.
//!
//! A client that stops reading fills its receive window and our send buffer; the connection's
//! writes then stay pending forever, and what the answer held stays held: a backend slot on the
//! gateway, a piece in memory on a mirror. [`StallGuard`] fails a write that has made no
//! progress for the configured time, which ends the connection and releases everything it held.
//!
//! Reads are untouched unless an idle limit is set ([`StallGuard::with_idle_limit`]), for servers
//! without read timeouts of their own: a read then fails once nothing has moved either way for
//! that long. It bounds a connection that never sends a request (hyper's protocol detection
//! waits for its first bytes forever), an idle keep-alive connection, and one whose client
//! vanished without a FIN (a powered-off machine, a dropped NAT entry), which nothing else
//! would ever notice while the server has nothing to write.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// An I/O object whose writes fail after `limit` without progress (and, with an idle limit,
/// whose reads fail once nothing moved either way for that long).
pub struct StallGuard<T> {
    inner: T,
    limit: Duration,
    stalled_since: Option<Pin<Box<Sleep>>>,
    idle: Option<Idle>,
}

/// The idle bound: its limit, the last progress in either direction, and the timer of a
/// pending read.
struct Idle {
    limit: Duration,
    last_progress: Instant,
    timer: Pin<Box<Sleep>>,
}

impl<T> StallGuard<T> {
    /// Wraps `inner`.
    pub fn new(inner: T, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled_since: None,
            idle: None,
        }
    }

    /// Also fails a read once neither a read nor a write has made progress for `limit`.
    pub fn with_idle_limit(mut self, limit: Duration) -> Self {
        let now = Instant::now();
        self.idle = Some(Idle {
            limit,
            last_progress: now,
            timer: Box::pin(tokio::time::sleep_until(now + limit)),
        });
        self
    }

    /// Bytes moved (a flush or a shutdown that had nothing to do is not progress).
    fn progressed(&mut self) {
        if let Some(idle) = &mut self.idle {
            idle.last_progress = Instant::now();
        }
    }

    /// Turns a pending write into a timeout error once it has been pending for `limit`.
    fn check<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match r {
            Poll::Pending => {
                let limit = self.limit;
                let timer = self
                    .stalled_since
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client stopped reading",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
            ready => {
                self.stalled_since = None;
                ready
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallGuard<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let this = &mut *self;
        let Some(idle) = &mut this.idle else {
            return r;
        };
        match r {
            Poll::Pending => {
                let deadline = idle.last_progress + idle.limit;
                if idle.timer.deadline() != deadline {
                    idle.timer.as_mut().reset(deadline);
                }
                match idle.timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the connection was idle too long",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
            ready => {
                idle.last_progress = Instant::now();
                ready
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallGuard<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.progressed();
        }
        self.check(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.progressed();
        }
        self.check(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.check(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Over TLS a shutdown first writes what is still queued and the close_notify alert, so
        // it waits on a client that stopped reading like any write does.
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.check(cx, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const IDLE: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn a_read_fails_once_nothing_moved_either_way_for_the_idle_limit() {
        let (server, mut client) = tokio::io::duplex(1 << 20);
        let mut guarded = StallGuard::new(server, Duration::from_secs(30)).with_idle_limit(IDLE);
        // The server writes every 10 s for 100 s while the client sends nothing: the read
        // waiting all along is not idle.
        let t = tokio::time::Instant::now();
        let mut buf = [0u8; 16];
        let (mut rd, mut wr) = tokio::io::split(&mut guarded);
        let writes = async {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_secs(10)).await;
                wr.write_all(b"token").await.unwrap();
            }
        };
        tokio::select! {
            () = writes => {}
            r = rd.read(&mut buf) => panic!("the read ended while data was moving: {r:?}"),
        }
        // Then nothing moves: the read fails an idle limit after the last write.
        let e = rd.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(t.elapsed(), Duration::from_secs(100) + IDLE);
        drop(client.read(&mut buf).await);
    }

    #[tokio::test(start_paused = true)]
    async fn without_an_idle_limit_a_read_waits_as_long_as_it_takes() {
        let (server, _client) = tokio::io::duplex(1024);
        let mut guarded = StallGuard::new(server, Duration::from_secs(30));
        let mut buf = [0u8; 16];
        let r = tokio::time::timeout(Duration::from_secs(3600), guarded.read(&mut buf)).await;
        assert!(r.is_err(), "{r:?}");
    }
}
