//! `pull --serve ADDR`: this node serves the verified pieces it holds to other pullers, with
//! the same blob range API as a mirror (`GET /v1/blobs/{hash}` with `Range`). A piece it does
//! not hold is 404, so a puller moves on to the next source. What it serves was verified
//! when it was written, and the receiver verifies again: peers need not trust each other.
//!
//! The node is usually an inference host whose memory is for its engine: the pieces held for
//! responses are bounded ([`MAX_PEER_SERVING_BYTES`], the mirror's serving budget with a small
//! size); past it a request is answered 503 at once (after [`PEER_BUDGET_WAIT`]) and the
//! puller moves on to another source.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::net::TcpListener;

use crate::auth::AccessToken;
use crate::faults::Faults;
use crate::holdings::Holdings;
use crate::http_error::ServeError;
use crate::manifest::Blake3Hash;
use crate::mirror::serve_budget::ServeBudget;
use crate::range_server::{blob_response, error_response, full, Body, BudgetWait, PieceFetch};

/// Connections served at once; more are closed at accept.
pub const MAX_CONNECTIONS: usize = 1024;
/// Piece bytes held for responses at once, all connections together.
pub const MAX_PEER_SERVING_BYTES: u64 = 256 << 20;
/// Longest a response waits for its share of that bound (a peer is only an extra source).
pub const PEER_BUDGET_WAIT: Duration = Duration::from_secs(1);

/// A peer server's shared state.
pub struct PeerServer {
    holdings: Arc<Holdings>,
    token: Option<AccessToken>,
    faults: Faults,
    serving: ServeBudget,
    /// Body bytes served to other peers.
    pub bytes_served: AtomicU64,
}

impl PeerServer {
    /// Serves what `holdings` holds to requests carrying `token` (everyone without one);
    /// `faults` is the test-only corruption setting.
    pub fn new(holdings: Arc<Holdings>, token: Option<AccessToken>, faults: Faults) -> Arc<Self> {
        Self::with_budget(holdings, token, faults, MAX_PEER_SERVING_BYTES)
    }

    /// [`Self::new`] holding at most `budget` bytes of pieces for responses.
    pub fn with_budget(
        holdings: Arc<Holdings>,
        token: Option<AccessToken>,
        faults: Faults,
        budget: u64,
    ) -> Arc<Self> {
        Arc::new(Self {
            holdings,
            token,
            faults,
            serving: ServeBudget::new(budget, tokenway_telemetry::Gauge::default()),
            bytes_served: AtomicU64::new(0),
        })
    }

    async fn read_piece(
        &self,
        hash: Blake3Hash,
        i: u64,
        wait: BudgetWait,
    ) -> Result<Bytes, ServeError> {
        // The partial file may be renamed into place between lookup and open: look twice.
        for _ in 0..2 {
            let Some((entry, path)) = self.holdings.piece(&hash, i) else {
                return Err(ServeError::not_found(format!(
                    "this peer does not hold piece {i} of blob {hash}"
                )));
            };
            let r = entry.piece_range(i);
            let share = self
                .serving
                .take(r.end - r.start, wait.limit(PEER_BUDGET_WAIT))
                .await?;
            // Pooled, and around the page cache: the pull wrote these pieces with O_DIRECT.
            let res = tokio::task::spawn_blocking(move || {
                crate::mirror::cache::read_pooled_at(&path, r.start, (r.end - r.start) as usize)
            })
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            match res {
                Ok(b) => return Ok(ServeBudget::hold(self.faults.apply(b), share)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    return Err(ServeError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "unavailable",
                        format!("reading piece {i}: {e}"),
                    ))
                }
            }
        }
        Err(ServeError::busy("the piece moved while being read; retry"))
    }

    async fn route(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path();
        if req.method() == Method::GET && path == "/healthz" {
            return Response::new(full("ok\n"));
        }
        if let Err(e) = crate::auth::check(self.token.as_ref(), req.headers()) {
            return error_response(&e);
        }
        let Some(hex) = path.strip_prefix("/v1/blobs/") else {
            return error_response(&ServeError::not_found(format!("no route {path}")));
        };
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return error_response(&ServeError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "blobs are GET or HEAD",
            ));
        }
        let hash = match Blake3Hash::from_hex(hex) {
            Ok(h) => h,
            Err(e) => {
                return error_response(&ServeError::bad_request(format!("blob {hex:?}: {e}")))
            }
        };
        let Some(entry) = self.holdings.entry(&hash) else {
            return error_response(&ServeError::not_found(format!(
                "this peer does not hold blob {hash}"
            )));
        };
        let range = req
            .headers()
            .get(header::RANGE)
            .and_then(|v| v.to_str().ok());
        let me = Arc::clone(&self);
        let fetch: PieceFetch = Arc::new(move |i, wait| {
            let me = Arc::clone(&me);
            Box::pin(async move { me.read_piece(hash, i, wait).await })
        });
        let me = Arc::clone(&self);
        let on_bytes = Arc::new(move |n| {
            me.bytes_served.fetch_add(n, Ordering::Relaxed);
        });
        blob_response(entry, range, req.method() == Method::HEAD, fetch, on_bytes).await
    }

    /// Serves on `listener` until `shutdown` resolves.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
        let handler = move |req| Arc::clone(&self).route(req);
        crate::http_serve::serve(
            listener,
            None,
            "peer",
            crate::http_serve::Limits {
                max_connections: MAX_CONNECTIONS,
                grace: Duration::from_secs(2),
                idle: crate::http_serve::IDLE_TIMEOUT,
            },
            handler,
            shutdown,
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{FileEntry, PieceHashing};
    use crate::piece_bits::PieceBits;

    #[tokio::test]
    async fn pieces_held_for_responses_stay_within_the_budget_and_past_it_a_request_is_busy() {
        const PIECE: u64 = 64 * 1024;
        let dir = tempfile::tempdir().expect("tempdir");
        let data: Vec<u8> = (0..3 * PIECE).map(|i| (i % 251) as u8).collect();
        let path = dir.path().join("blob");
        std::fs::write(&path, &data).expect("write the blob");
        let entry = FileEntry {
            path: "blob".into(),
            size: data.len() as u64,
            hash: Blake3Hash::of(&data),
            piece_size: PIECE,
            pieces: data.chunks(PIECE as usize).map(Blake3Hash::of).collect(),
            group_size: None,
            piece_hashing: PieceHashing::Standalone,
        };
        let holdings = Arc::new(Holdings::default());
        holdings.add(&entry, path, PieceBits::full(3));
        // Room for two pieces.
        let server = PeerServer::with_budget(holdings, None, Faults::default(), 2 * PIECE);
        let a = server
            .read_piece(entry.hash, 0, BudgetWait::Body)
            .await
            .expect("first piece");
        let b = server
            .read_piece(entry.hash, 1, BudgetWait::Body)
            .await
            .expect("second piece");
        assert_eq!(&a[..], &data[..PIECE as usize]);
        let busy = server
            .read_piece(entry.hash, 2, BudgetWait::Body)
            .await
            .expect_err("over the budget");
        assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
        // A response that has sent its piece gives its share back.
        drop(a);
        let c = server
            .read_piece(entry.hash, 2, BudgetWait::Body)
            .await
            .expect("room again");
        assert_eq!(&c[..], &data[2 * PIECE as usize..]);
        drop((b, c));
    }
}
