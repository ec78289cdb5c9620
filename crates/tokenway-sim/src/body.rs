//! The response body: either one buffer, or a stream of SSE events fed through a bounded channel.
//!
//! Every event the generator sends becomes its own data frame as soon as hyper polls for it, so
//! nothing is held back waiting for more bytes. When the client goes away hyper drops the body,
//! the channel closes, and the generator's next send fails: that is how a stream learns to give
//! its slot back. A reader that takes nothing for [`STUCK_READER`] is given up on: the body
//! ends in an error (hyper resets the stream or closes the connection), never in a clean end
//! that would pass a cut answer off as a whole one.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;

/// Events buffered between the generator and the connection. Small: back-pressure from a slow
/// reader should reach the generator (and keep its slot busy) quickly, like a real server.
pub(crate) const STREAM_CHANNEL_EVENTS: usize = 8;

/// Longest a stream waits for its reader to take one event: a client that reads nothing for
/// this long is taken for gone, and its slot and KV cache are freed (a stalled reader held
/// them for good, and a few such clients wedged every slot).
pub(crate) const STUCK_READER: Duration = Duration::from_secs(60);

/// The body of every response of the simulator.
pub(crate) enum SimBody {
    /// A complete body (`None` once sent).
    Full(Option<Bytes>),
    /// Events from a generator task; `abandoned` is set when the generator gave up on the
    /// reader.
    Channel {
        rx: mpsc::Receiver<Bytes>,
        abandoned: Arc<AtomicBool>,
    },
}

impl SimBody {
    pub(crate) fn full(bytes: impl Into<Bytes>) -> Self {
        Self::Full(Some(bytes.into()))
    }
}

/// The generator's end of a streamed body.
pub(crate) struct StreamTx {
    tx: mpsc::Sender<Bytes>,
    abandoned: Arc<AtomicBool>,
}

/// A streamed body and the generator's end of it.
pub(crate) fn stream_channel() -> (StreamTx, SimBody) {
    let (tx, rx) = mpsc::channel(STREAM_CHANNEL_EVENTS);
    let abandoned = Arc::new(AtomicBool::new(false));
    let body = SimBody::Channel {
        rx,
        abandoned: abandoned.clone(),
    };
    (StreamTx { tx, abandoned }, body)
}

impl StreamTx {
    /// Sends one event; `false` if the reader is gone, or took nothing for [`STUCK_READER`]
    /// (then the body ends in an error once what is buffered has gone).
    pub(crate) async fn send(&self, event: Bytes) -> bool {
        match self.tx.try_send(event) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(event)) => {
                match tokio::time::timeout(STUCK_READER, self.tx.send(event)).await {
                    Ok(sent) => sent.is_ok(),
                    Err(_) => {
                        tracing::info!(
                            "a stream's reader took nothing for {STUCK_READER:?}; given up"
                        );
                        self.abandoned.store(true, Ordering::Relaxed);
                        false
                    }
                }
            }
        }
    }

    /// Resolves when the reader has gone.
    pub(crate) async fn closed(&self) {
        self.tx.closed().await
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            Self::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Self::Channel { rx, abandoned } => rx.poll_recv(cx).map(|b| match b {
                Some(b) => Some(Ok(Frame::data(b))),
                None if abandoned.load(Ordering::Relaxed) => Some(Err(std::io::Error::other(
                    "the stream's reader took nothing for a minute",
                ))),
                None => None,
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Self::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Self::Full(None) => SizeHint::with_exact(0),
            Self::Channel { .. } => SizeHint::default(),
        }
    }
}
