//! The client-write deadline of the HTTP/2 front, per stream.
//!
//! On HTTP/1.1 a client that stops reading stalls the socket, and the connection's
//! [`StallGuard`](tokenway_transport::stall_io::StallGuard) closes it after
//! `timeouts.client_write_ms`. On HTTP/2 one stream can stop while the connection lives on: once
//! that stream's flow-control window is spent, hyper waits for window before it polls the
//! response body again, nothing is written, PINGs are still answered, and the relay (its backend
//! slot and upstream connection) would be held for as long as the connection lives. So an
//! HTTP/2 response body is pumped through a one-frame channel by a task of its own: a frame the
//! stream does not take within the deadline ends the pump, which drops the relay (cancelling the
//! backend's work and freeing its slot), and the stream is then reset instead of ended.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::mpsc;

use crate::error::{BoxError, ResponseBody};

/// `body`, pumped so that a stream that takes none of it for `deadline` gives it up. A body
/// already at its end is returned as it is.
pub fn with_write_deadline(body: ResponseBody, deadline: Duration) -> ResponseBody {
    if body.is_end_stream() {
        return body;
    }
    let hint = body.size_hint();
    let (tx, rx) = mpsc::channel(1);
    let abandoned = Arc::new(AtomicBool::new(false));
    tokio::spawn(pump(body, tx, deadline, Arc::clone(&abandoned)));
    Pumped {
        rx,
        hint,
        abandoned,
    }
    .boxed()
}

type Item = Result<Frame<Bytes>, BoxError>;

async fn pump(
    mut body: ResponseBody,
    tx: mpsc::Sender<Item>,
    deadline: Duration,
    abandoned: Arc<AtomicBool>,
) {
    loop {
        let frame = tokio::select! {
            f = body.frame() => f,
            // The client reset the stream (or the connection closed): stop at once.
            () = tx.closed() => return,
        };
        let Some(frame) = frame else { return };
        let failed = frame.is_err();
        match tokio::time::timeout(deadline, tx.send(frame)).await {
            Ok(Ok(())) if !failed => {}
            Ok(_) => return,
            Err(_) => {
                tracing::debug!(
                    deadline_ms = deadline.as_millis() as u64,
                    "HTTP/2 client read nothing of its stream; giving up its response"
                );
                abandoned.store(true, Ordering::Relaxed);
                return;
            }
        }
    }
}

/// The client's side of the pump.
struct Pumped {
    rx: mpsc::Receiver<Item>,
    hint: SizeHint,
    abandoned: Arc<AtomicBool>,
}

impl Body for Pumped {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(None) if self.abandoned.load(Ordering::Relaxed) => Poll::Ready(Some(Err(
                "the client read nothing within the write deadline".into(),
            ))),
            other => other,
        }
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;

    /// A body of endless frames that notes when it is dropped.
    fn endless(dropped: Arc<AtomicBool>) -> ResponseBody {
        struct Guard(Arc<AtomicBool>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let guard = Guard(dropped);
        let frames = futures_util::stream::repeat_with(move || {
            let _keep = &guard;
            Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"data: x\n\n")))
        });
        StreamBody::new(frames).boxed()
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_takes_nothing_gives_up_its_body_and_is_reset() {
        let dropped = Arc::new(AtomicBool::new(false));
        let mut body = with_write_deadline(endless(dropped.clone()), Duration::from_secs(5));
        // A reader takes frames as they come.
        for _ in 0..3 {
            let f = body.frame().await.expect("a frame").expect("data");
            assert_eq!(
                f.into_data().expect("data"),
                Bytes::from_static(b"data: x\n\n")
            );
        }
        assert!(!dropped.load(Ordering::Relaxed));
        // Then it stops reading: past the deadline the upstream body is dropped.
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert!(
            dropped.load(Ordering::Relaxed),
            "the relay was not given up"
        );
        // What it reads later: the frame that was waiting, then an error (a reset, not an end).
        assert!(body.frame().await.expect("the waiting frame").is_ok());
        assert!(body.frame().await.expect("an error").is_err());
    }

    #[tokio::test]
    async fn a_finished_body_ends_cleanly_with_its_size() {
        let full = http_body_util::Full::new(Bytes::from_static(b"{}"))
            .map_err(|never| match never {})
            .boxed();
        let body = with_write_deadline(full, Duration::from_secs(5));
        assert_eq!(body.size_hint().exact(), Some(2));
        let all = body.collect().await.expect("whole").to_bytes();
        assert_eq!(all, Bytes::from_static(b"{}"));
    }
}
