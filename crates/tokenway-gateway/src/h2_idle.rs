//! The idle timeout of the HTTP/2 front's client connections.
//!
//! hyper's HTTP/2 server closes no connection for idleness, and the PINGs the gateway sends
//! (every client library answers them) keep a quiet one looking alive: a client that opened a
//! connection, asked once and went quiet held its `max_connections` slot for good, and pools of
//! such clients, or one client opening thousands, filled the front. So a connection is watched:
//! once no request has started for `timeouts.client_read_ms` and none is in flight (its answer
//! still streaming), it is closed gracefully (GOAWAY, as the HTTP/1.1 front closes an idle
//! keep-alive connection after the same time). An edge's connection (a request that carried
//! the tunnel's header) is never closed so: the edge keeps its fallback link up on purpose.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::time::{Instant, Sleep};

use crate::drain::Graceful;
use crate::error::ResponseBody;

/// What a connection's requests tell its watcher.
#[derive(Debug, Default)]
pub struct Activity {
    /// Requests started, ever.
    started: AtomicU64,
    /// Requests ended (their answer sent, or given up).
    ended: AtomicU64,
    /// An edge's connection: never closed for idleness.
    edge: AtomicBool,
}

impl Activity {
    /// Notes a request starting; the guard notes its end when dropped (keep it in the answer's
    /// body with [`InFlight::track`]).
    pub fn start(self: &Arc<Self>, edge: bool) -> InFlight {
        if edge {
            self.edge.store(true, Ordering::Relaxed);
        }
        self.started.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(self))
    }
}

/// One request in flight on a watched connection.
#[derive(Debug)]
pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.ended.fetch_add(1, Ordering::Relaxed);
    }
}

impl InFlight {
    /// `body`, holding this request in flight until it is dropped (sent whole or reset).
    pub fn track(self, body: ResponseBody) -> ResponseBody {
        // The frame mapper owns the guard: it goes when the body goes.
        body.map_frame(move |frame| {
            let _held = &self;
            frame
        })
        .boxed()
    }
}

pin_project_lite::pin_project! {
    /// A connection closed gracefully once idle for `idle` (see the module docs): between
    /// `idle` and twice that after its last request ended.
    pub struct IdleClose<C> {
        #[pin]
        conn: C,
        #[pin]
        timer: Sleep,
        idle: Duration,
        activity: Arc<Activity>,
        seen: u64,
        closing: bool,
    }
}

impl<C> IdleClose<C> {
    /// Watches `conn`, whose requests report to `activity`.
    pub fn new(conn: C, activity: Arc<Activity>, idle: Duration) -> Self {
        Self {
            conn,
            timer: tokio::time::sleep(idle),
            idle,
            activity,
            seen: 0,
            closing: false,
        }
    }
}

impl<C: Graceful> Future for IdleClose<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let mut this = self.project();
        while !*this.closing && this.timer.as_mut().poll(cx).is_ready() {
            let started = this.activity.started.load(Ordering::Relaxed);
            let ended = this.activity.ended.load(Ordering::Relaxed);
            if started == *this.seen
                && ended == started
                && !this.activity.edge.load(Ordering::Relaxed)
            {
                *this.closing = true;
                this.conn.as_mut().graceful_shutdown();
            } else {
                *this.seen = started;
                let next = Instant::now() + *this.idle;
                this.timer.as_mut().reset(next);
            }
        }
        this.conn.poll(cx)
    }
}

impl<C: Graceful> Graceful for IdleClose<C> {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        let this = self.project();
        *this.closing = true;
        this.conn.graceful_shutdown();
    }
}
