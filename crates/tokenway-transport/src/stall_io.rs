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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
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
    /// Bytes a backlogged write must make per `limit` (0: any progress will do).
    min_progress: u64,
    /// Bytes written since the backlog's timer started.
    progress: u64,
    /// The last write poll was pending (a write accepted at once means there is no backlog).
    last_pending: bool,
}

/// The idle bound: its limit, the last progress in either direction, the timer of a pending
/// read, and the count of requests the server is still working on (not idle however long).
struct Idle {
    limit: Duration,
    last_progress: Instant,
    timer: Pin<Box<Sleep>>,
    busy: Option<Arc<AtomicUsize>>,
}

impl<T> StallGuard<T> {
    /// Wraps `inner`.
    pub fn new(inner: T, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled_since: None,
            idle: None,
            min_progress: 0,
            progress: 0,
            last_pending: false,
        }
    }

    /// Has a backlogged write fail unless `bytes` were taken in each `limit`, not merely one:
    /// a client that reads a few bytes now and then otherwise holds what it is being sent
    /// (a piece of a model, for a mirror) for as long as it likes. A write the connection
    /// takes at once ends the backlog.
    pub fn with_min_progress(mut self, bytes: u64) -> Self {
        self.min_progress = bytes;
        self
    }

    /// Accounts `n` bytes a write took.
    fn took(&mut self, n: usize) {
        let at_once = !self.last_pending && n > 0;
        self.last_pending = false;
        self.progress += n as u64;
        if at_once || self.progress >= self.min_progress {
            self.stalled_since = None;
            self.progress = 0;
        }
    }

    /// Also fails a read once neither a read nor a write has made progress for `limit`.
    pub fn with_idle_limit(mut self, limit: Duration) -> Self {
        let now = Instant::now();
        self.idle = Some(Idle {
            limit,
            last_progress: now,
            timer: Box::pin(tokio::time::sleep_until(now + limit)),
            busy: None,
        });
        self
    }

    /// With an idle limit: the connection is not idle while `busy` is above zero (the server
    /// counts there the requests whose answers it is still working on: a long preheat writes
    /// nothing until it is done, while the client rightly waits).
    pub fn with_busy_count(mut self, busy: Arc<AtomicUsize>) -> Self {
        if let Some(idle) = &mut self.idle {
            idle.busy = Some(busy);
        }
        self
    }

    fn account_write(&mut self, r: &Poll<io::Result<usize>>) {
        match r {
            Poll::Pending => self.last_pending = true,
            Poll::Ready(Ok(n)) => {
                if *n > 0 {
                    self.progressed();
                }
                self.took(*n);
            }
            Poll::Ready(Err(_)) => {}
        }
    }

    /// A flush or a shutdown: pending is a backlog; done takes no bytes, so it ends a backlog
    /// only without a `min_progress` (on TCP a flush is done at once whatever is queued in
    /// the kernel), and it says nothing of whether the next write is taken at once.
    fn account_flush(&mut self, r: &Poll<io::Result<()>>) {
        match r {
            Poll::Pending => self.last_pending = true,
            Poll::Ready(Ok(())) => {
                if self.progress >= self.min_progress {
                    self.stalled_since = None;
                    self.progress = 0;
                }
            }
            Poll::Ready(Err(_)) => {}
        }
    }

    /// Bytes moved (a flush or a shutdown that had nothing to do is not progress).
    fn progressed(&mut self) {
        if let Some(idle) = &mut self.idle {
            idle.last_progress = Instant::now();
        }
    }

    /// Turns a pending write into a timeout error once it has been backlogged for `limit`
    /// (without `min_progress` bytes taken meanwhile).
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
            ready => ready,
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
                if idle
                    .busy
                    .as_ref()
                    .is_some_and(|b| b.load(Ordering::Acquire) > 0)
                {
                    idle.last_progress = Instant::now();
                }
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
        self.account_write(&r);
        self.check(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.account_write(&r);
        self.check(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.account_flush(&r);
        self.check(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Over TLS a shutdown first writes what is still queued and the close_notify alert, so
        // it waits on a client that stopped reading like any write does.
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.account_flush(&r);
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

    /// A client reading `chunk` bytes every `every` from a 1 KiB pipe while `len` bytes are
    /// written through a guard wanting 4 KiB per 30 s; whether the write completes.
    async fn trickle(chunk: usize, every: Duration, len: usize) -> io::Result<()> {
        let (server, mut client) = tokio::io::duplex(1024);
        let mut guarded = StallGuard::new(server, Duration::from_secs(30)).with_min_progress(4096);
        let read = async {
            let mut buf = vec![0u8; chunk];
            loop {
                tokio::time::sleep(every).await;
                if client.read(&mut buf).await.unwrap_or(0) == 0 {
                    break;
                }
            }
        };
        let data = vec![7u8; len];
        tokio::select! {
            r = async {
                guarded.write_all(&data).await?;
                guarded.shutdown().await
            } => r,
            () = read => Ok(()),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_taking_a_few_bytes_now_and_then_does_not_hold_the_write() {
        // 100 bytes every 10 s: some progress all along, 300 bytes per 30 s.
        let t = tokio::time::Instant::now();
        let e = trickle(100, Duration::from_secs(10), 64 << 10)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(120), "{:?}", t.elapsed());
        // 1 KiB a second is slow but enough: 64 KiB take about a minute and get through.
        trickle(1024, Duration::from_secs(1), 64 << 10)
            .await
            .unwrap();
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
