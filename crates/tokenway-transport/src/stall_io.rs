//! A write-stall guard for the connections of clients: the gateway's fronts and the mirror's
//! and peers' servers.
//!
//! A client that stops reading fills its receive window and our send buffer; the connection's
//! writes then stay pending forever, and what the answer held stays held: a backend slot on the
//! gateway, a piece in memory on a mirror. [`StallGuard`] fails a write that has made no
//! progress for the configured time, which ends the connection and releases everything it held.
//! Reads are untouched (an idle connection is bounded by its server's own read timeouts).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// An I/O object whose writes fail after `limit` without progress.
pub struct StallGuard<T> {
    inner: T,
    limit: Duration,
    stalled_since: Option<Pin<Box<Sleep>>>,
}

impl<T> StallGuard<T> {
    /// Wraps `inner`.
    pub fn new(inner: T, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled_since: None,
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
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallGuard<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.check(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
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
