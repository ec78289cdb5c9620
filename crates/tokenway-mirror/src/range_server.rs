//! Answering `GET`/`HEAD` of a blob with byte ranges, piece by piece (shared by the mirror
//! and by peers, which speak the same API).
//!
//! The first piece is obtained before the status line is sent, so a source that cannot
//! deliver answers with a clean JSON error instead of a cut body; later pieces of a
//! multi-piece range are fetched lazily as the body is read, so a response never holds more
//! than one piece in memory. Blobs are immutable and named by their hash: the ETag is the
//! hash and caches may keep them forever.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

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
/// Gets piece `i` of the blob being served.
pub type PieceFetch = Arc<dyn Fn(u64) -> PieceFuture + Send + Sync>;
/// Told how many body bytes were produced.
pub type OnBytes = Arc<dyn Fn(u64) + Send + Sync>;

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
            Err(RangeError::Malformed(m)) => {
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
    let head_piece = match fetch(first).await.and_then(|p| slice(first, p)) {
        Ok(p) => p,
        Err(e) => return error_response(&e),
    };
    on_bytes(head_piece.len() as u64);
    let rest = stream::unfold(first + 1, move |i| {
        let fetch = Arc::clone(&fetch);
        let slice = slice.clone();
        let on_bytes = Arc::clone(&on_bytes);
        async move {
            if i > last {
                return None;
            }
            let item = match fetch(i).await.and_then(|p| slice(i, p)) {
                Ok(b) => {
                    on_bytes(b.len() as u64);
                    Ok(Frame::data(b))
                }
                Err(e) => Err(BoxError::from(e.to_string())),
            };
            Some((item, i + 1))
        }
    });
    let body = stream::iter([Ok::<_, BoxError>(Frame::data(head_piece))]).chain(rest);
    *resp.body_mut() = BodyExt::boxed_unsync(StreamBody::new(body));
    resp
}
