//! The response body: either one buffer, or a stream of SSE events fed through a bounded channel.
//!
//! Every event the generator sends becomes its own data frame as soon as hyper polls for it, so
//! nothing is held back waiting for more bytes. When the client goes away hyper drops the body,
//! the channel closes, and the generator's next send fails: that is how a stream learns to give
//! its slot back.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;

/// Events buffered between the generator and the connection. Small: back-pressure from a slow
/// reader should reach the generator (and keep its slot busy) quickly, like a real server.
pub(crate) const STREAM_CHANNEL_EVENTS: usize = 8;

/// The body of every response of the simulator.
pub(crate) enum SimBody {
    /// A complete body (`None` once sent).
    Full(Option<Bytes>),
    /// Events from a generator task.
    Channel(mpsc::Receiver<Bytes>),
}

impl SimBody {
    pub(crate) fn full(bytes: impl Into<Bytes>) -> Self {
        Self::Full(Some(bytes.into()))
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Self::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Self::Channel(rx) => rx.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Self::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Self::Full(None) => SizeHint::with_exact(0),
            Self::Channel(_) => SizeHint::default(),
        }
    }
}
