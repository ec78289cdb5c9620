//! Answering `GET`/`HEAD` of a blob with byte ranges, piece by piece (shared by the mirror
//! and by peers, which speak the same API).
//!
//! The first piece is awaited for up to [`EARLY_HEAD_AFTER`] before the status line is sent,
//! so a source that cannot deliver (a blob the origin lacks, an origin that refuses) answers
//! with a clean JSON error instead of a cut body. A piece that takes longer (a cold mirror
//! fetching it from a far or busy origin, which may take tens of seconds) gets its head then
//! and its body when the piece is there: a puller can tell such a mirror, which answered at
//! once, from one that is hung and never answers (see `crate::straggler::SILENT_AFTER` and
//! `crate::http_client::HEAD_TIMEOUT`), and if the piece then fails the body is cut, which the
//! puller counts as a failed fetch like any other. A server at its serving bound must say so
//! with a 503 the puller can tell from a failure, so the first piece's fetch is told (see
//! [`BudgetWait`]) to give up waiting for its share of the bound by [`HEAD_BUSY_BY`], before
//! the head goes. Later pieces of a multi-piece range are
//! fetched lazily as the body is read, so a response never holds more than one piece in
//! memory. Blobs are immutable and named by their hash: the ETag is the hash and caches may
//! keep them forever.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream;
use futures_util::StreamExt as _;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;

use crate::http_error::ServeError;
use crate::http_range::{parse_range, RangeError};
use crate::manifest::FileEntry;

/// Error type of response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Response body of the mirror and peer servers.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;
/// One piece's bytes, or why not.
pub type PieceFuture = Pin<Box<dyn Future<Output = Result<Bytes, ServeError>> + Send>>;
/// Gets piece `i` of the blob being served, waiting for its share of a serving bound as
/// the [`BudgetWait`] says.
pub type PieceFetch = Arc<dyn Fn(u64, BudgetWait) -> PieceFuture + Send + Sync>;
/// Told how many body bytes were produced.
pub type OnBytes = Arc<dyn Fn(u64) + Send + Sync>;

/// How long the first piece of a response is waited for before the head is sent without it.
/// Well below `crate::straggler::SILENT_AFTER` (2 s), so a cold mirror is never taken for a
/// silent one; long enough that a cache hit or a quick origin refusal still gets its exact
/// status.
pub const EARLY_HEAD_AFTER: Duration = Duration::from_secs(1);

/// How long after a request its first piece's fetch stops waiting for a share of the
/// server's serving bound and answers busy (503): early enough that the answer still beats
/// [`EARLY_HEAD_AFTER`], so the puller reads "busy, come back" and not a cut body (which it
/// counts as a failure).
pub const HEAD_BUSY_BY: Duration = Duration::from_millis(800);

/// How long a piece's fetch may wait for its share of the server's serving bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetWait {
    /// The response's first piece: its head waits for it, so a busy answer must come by
    /// this instant (or, once it has passed, the server's usual wait applies: the head has
    /// gone anyway).
    Head(tokio::time::Instant),
    /// A later piece: the head has gone; the server's usual wait.
    Body,
}

impl BudgetWait {
    /// The wait for a share, given the server's usual one.
    pub fn limit(self, usual: Duration) -> Duration {
        match self {
            Self::Head(by) => {
                let left = by.saturating_duration_since(tokio::time::Instant::now());
                if left.is_zero() {
                    usual
                } else {
                    left.min(usual)
                }
            }
            Self::Body => usual,
        }
    }
}

/// `Cache-Control` of blobs: content addressed, so never stale.
pub const IMMUTABLE: &str = "public, max-age=31536000, immutable";

/// A complete body.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|e| match e {})
        .boxed_unsync()
}

/// An empty body.
pub fn empty() -> Body {
    Empty::new().map_err(|e| match e {}).boxed_unsync()
}

/// The JSON error response.
pub fn error_response(e: &ServeError) -> Response<Body> {
    let r: Response<Full<Bytes>> = e.response();
    r.map(|b| b.map_err(|e| match e {}).boxed_unsync())
}

/// Answers a request for `entry`'s blob with an optional `Range` header value.
pub async fn blob_response(
    entry: Arc<FileEntry>,
    range: Option<&str>,
    head: bool,
    fetch: PieceFetch,
    on_bytes: OnBytes,
) -> Response<Body> {
    let size = entry.size;
    let etag = HeaderValue::from_str(&format!("\"{}\"", entry.hash))
        .expect("invariant: a hex hash is a valid header value");
    let base = |status: StatusCode| {
        let mut r = Response::new(empty());
        *r.status_mut() = status;
        let h = r.headers_mut();
        h.insert(header::ETAG, etag.clone());
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static(IMMUTABLE));
        h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        r
    };
    let (status, range) = match range {
        None => (StatusCode::OK, 0..size),
        Some(v) => match parse_range(v, size) {
            Ok(r) => (StatusCode::PARTIAL_CONTENT, r),
            // Not a byte range: ignored, as RFC 9110 section 14.2 says.
            Err(RangeError::Malformed(_)) => (StatusCode::OK, 0..size),
            Err(RangeError::Refused(m)) => {
                return error_response(&ServeError::new(
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    "bad_range",
                    m,
                ))
            }
            Err(RangeError::Unsatisfiable) => {
                let mut r = error_response(&ServeError::new(
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    "bad_range",
                    format!("range outside the blob of {size} bytes"),
                ));
                if let Ok(v) = HeaderValue::from_str(&format!("bytes */{size}")) {
                    r.headers_mut().insert(header::CONTENT_RANGE, v);
                }
                return r;
            }
        },
    };
    let mut resp = base(status);
    let len = range.end - range.start;
    resp.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    if status == StatusCode::PARTIAL_CONTENT {
        if let Ok(v) =
            HeaderValue::from_str(&format!("bytes {}-{}/{size}", range.start, range.end - 1))
        {
            resp.headers_mut().insert(header::CONTENT_RANGE, v);
        }
    }
    if head || len == 0 {
        return resp;
    }
    let ps = entry.piece_size;
    let first = range.start / ps;
    let last = (range.end - 1) / ps;
    let slice = move |i: u64, piece: Bytes| -> Result<Bytes, ServeError> {
        let pr = entry.piece_range(i);
        if piece.len() as u64 != pr.end - pr.start {
            return Err(ServeError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                format!(
                    "piece {i} has {} bytes, expected {}",
                    piece.len(),
                    pr.end - pr.start
                ),
            ));
        }
        let a = range.start.max(pr.start) - pr.start;
        let b = range.end.min(pr.end) - pr.start;
        Ok(piece.slice(a as usize..b as usize))
    };
    let mut first_fetch = fetch(
        first,
        BudgetWait::Head(tokio::time::Instant::now() + HEAD_BUSY_BY),
    );
    let early = tokio::select! {
        r = &mut first_fetch => Some(r),
        () = tokio::time::sleep(EARLY_HEAD_AFTER) => None,
    };
    let head_piece: PieceFuture = match early {
        Some(r) => match r.and_then(|p| slice(first, p)) {
            Ok(p) => Box::pin(std::future::ready(Ok(p))),
            Err(e) => return error_response(&e),
        },
        // Slow: the head goes now, the piece when it is there.
        None => {
            let slice = slice.clone();
            Box::pin(async move { first_fetch.await.and_then(|p| slice(first, p)) })
        }
    };
    let on_first = Arc::clone(&on_bytes);
    let head_item = stream::once(async move {
        match head_piece.await {
            Ok(b) => {
                on_first(b.len() as u64);
                Ok(Frame::data(b))
            }
            Err(e) => {
                tracing::warn!(error = %e, "a blob response lost its first piece after its head was sent; body cut");
                Err(BoxError::from(e.to_string()))
            }
        }
    });
    let rest = stream::unfold(first + 1, move |i| {
        let fetch = Arc::clone(&fetch);
        let slice = slice.clone();
        let on_bytes = Arc::clone(&on_bytes);
        async move {
            if i > last {
                return None;
            }
            let item = match fetch(i, BudgetWait::Body).await.and_then(|p| slice(i, p)) {
                Ok(b) => {
                    on_bytes(b.len() as u64);
                    Ok(Frame::data(b))
                }
                Err(e) => Err(BoxError::from(e.to_string())),
            };
            Some((item, i + 1))
        }
    });
    let body = head_item.chain(rest);
    *resp.body_mut() = BodyExt::boxed_unsync(StreamBody::new(body));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{Blake3Hash, PieceHashing};
    use std::time::Duration;
    use tokio::time::Instant;

    const PIECE: u64 = 1024;

    fn entry(data: &[u8]) -> Arc<FileEntry> {
        Arc::new(FileEntry {
            path: "w.bin".into(),
            size: data.len() as u64,
            hash: Blake3Hash::of(data),
            piece_size: PIECE,
            pieces: data.chunks(PIECE as usize).map(Blake3Hash::of).collect(),
            group_size: None,
            piece_hashing: PieceHashing::Standalone,
        })
    }

    /// Serves `data`'s pieces after `delay`, or fails with `fail` after it.
    fn fetch(data: Vec<u8>, delay: Duration, fail: Option<ServeError>) -> PieceFetch {
        let data = Bytes::from(data);
        Arc::new(move |i, _| {
            let (data, fail) = (data.clone(), fail.clone());
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                if let Some(e) = fail {
                    return Err(e);
                }
                let a = (i * PIECE) as usize;
                Ok(data.slice(a..(a + PIECE as usize).min(data.len())))
            })
        })
    }

    fn data() -> Vec<u8> {
        (0..3 * PIECE).map(|i| (i % 251) as u8).collect()
    }

    fn no_count() -> OnBytes {
        Arc::new(|_| {})
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_first_piece_gets_its_head_after_a_second_and_its_body_when_ready() {
        let d = data();
        let t = Instant::now();
        let f = fetch(d.clone(), Duration::from_secs(30), None);
        let resp = blob_response(entry(&d), Some("bytes=1000-2999"), false, f, no_count()).await;
        assert_eq!(
            t.elapsed(),
            EARLY_HEAD_AFTER,
            "the head waits one EARLY_HEAD_AFTER"
        );
        assert_eq!(resp.status(), StatusCode::PARTIAL_CONTENT);
        assert_eq!(resp.headers()[header::CONTENT_LENGTH], "2000");
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(&body[..], &d[1000..3000]);
        // The first piece arrived at 30 s; the next two were fetched after it, 30 s each.
        assert_eq!(t.elapsed(), Duration::from_secs(90));
    }

    #[tokio::test(start_paused = true)]
    async fn a_quick_failure_is_a_clean_error_and_a_late_one_cuts_the_body() {
        let d = data();
        let quick = fetch(
            d.clone(),
            Duration::from_millis(200),
            Some(ServeError::origin("origin refused")),
        );
        let resp = blob_response(entry(&d), None, false, quick, no_count()).await;
        assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        assert!(
            String::from_utf8_lossy(&body).contains("origin refused"),
            "{body:?}"
        );

        let late = fetch(
            d.clone(),
            Duration::from_secs(5),
            Some(ServeError::origin("origin went away")),
        );
        let resp = blob_response(entry(&d), None, false, late, no_count()).await;
        assert_eq!(
            resp.status(),
            StatusCode::OK,
            "the head went before the failure"
        );
        let err = resp.into_body().collect().await.expect_err("a cut body");
        assert!(err.to_string().contains("origin went away"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_at_its_serving_bound_answers_busy_before_the_head_goes() {
        use crate::mirror::serve_budget::ServeBudget;
        let d = data();
        let budget = Arc::new(ServeBudget::new(
            PIECE,
            tokenway_telemetry::Gauge::default(),
        ));
        let f = |budget: &Arc<ServeBudget>| -> PieceFetch {
            let (budget, data) = (Arc::clone(budget), Bytes::from(d.clone()));
            Arc::new(move |i, wait| {
                let (budget, data) = (Arc::clone(&budget), data.clone());
                Box::pin(async move {
                    let share = budget
                        .take(PIECE, wait.limit(Duration::from_secs(5)))
                        .await?;
                    let a = (i * PIECE) as usize;
                    let piece = data.slice(a..(a + PIECE as usize).min(data.len()));
                    Ok(crate::mirror::serve_budget::ServeBudget::hold(piece, share))
                })
            })
        };
        // A response holds the whole bound while its client does not read.
        let holder = blob_response(entry(&d), None, false, f(&budget), no_count()).await;
        assert_eq!(holder.status(), StatusCode::OK);
        let t = Instant::now();
        let busy = blob_response(entry(&d), None, false, f(&budget), no_count()).await;
        assert_eq!(
            busy.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "busy is said in the status, not by cutting a 200's body"
        );
        assert_eq!(t.elapsed(), HEAD_BUSY_BY);
        assert!(HEAD_BUSY_BY < EARLY_HEAD_AFTER);
        // A later piece waits the server's usual time: the holder's client reads on, and its
        // second piece gets the share its first gave back.
        let mut body = holder.into_body();
        let mut got = Vec::new();
        while let Some(frame) = body.frame().await {
            // Copied and dropped, as a server writes and drops what it sent.
            got.extend_from_slice(frame.expect("frame").data_ref().expect("data"));
        }
        assert_eq!(got, d);
        assert_eq!(
            BudgetWait::Body.limit(Duration::from_secs(5)),
            Duration::from_secs(5)
        );
        let by = Instant::now() + Duration::from_millis(300);
        assert_eq!(
            BudgetWait::Head(by).limit(Duration::from_secs(5)),
            Duration::from_millis(300)
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            BudgetWait::Head(by).limit(Duration::from_secs(5)),
            Duration::from_secs(5),
            "past the head's instant, the head has gone: the usual wait"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_fast_piece_is_answered_at_once_and_counted() {
        let d = data();
        let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = Arc::clone(&n);
        let on_bytes: OnBytes = Arc::new(move |b| {
            counted.fetch_add(b, std::sync::atomic::Ordering::Relaxed);
        });
        let t = Instant::now();
        let f = fetch(d.clone(), Duration::ZERO, None);
        let resp = blob_response(entry(&d), None, false, f, on_bytes).await;
        assert_eq!(t.elapsed(), Duration::ZERO);
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(&body[..], &d[..]);
        assert_eq!(n.load(std::sync::atomic::Ordering::Relaxed), d.len() as u64);
    }

    #[tokio::test(start_paused = true)]
    async fn a_range_header_that_is_not_a_byte_range_is_ignored_and_multi_range_refused() {
        let d = data();
        for ignored in ["items=0-1", "bytes=+5-+9", "garbage"] {
            let f = fetch(d.clone(), Duration::ZERO, None);
            let resp = blob_response(entry(&d), Some(ignored), false, f, no_count()).await;
            assert_eq!(resp.status(), StatusCode::OK, "{ignored}");
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            assert_eq!(&body[..], &d[..]);
        }
        let f = fetch(d.clone(), Duration::ZERO, None);
        let resp = blob_response(entry(&d), Some("bytes=0-1,5-6"), false, f, no_count()).await;
        assert_eq!(resp.status(), StatusCode::RANGE_NOT_SATISFIABLE);
    }
}
