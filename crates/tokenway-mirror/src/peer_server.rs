//! `pull --serve ADDR`: this node serves the verified pieces it holds to other pullers, with
//! the same blob range API as a mirror (`GET /v1/blobs/{hash}` with `Range`). A piece it does
//! not hold is 404, so a puller moves on to the next source. What it serves was verified
//! when it was written, and the receiver verifies again: peers need not trust each other.

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
use crate::range_server::{blob_response, error_response, full, Body, PieceFetch};

/// Connections served at once; more are closed at accept.
pub const MAX_CONNECTIONS: usize = 1024;

/// A peer server's shared state.
pub struct PeerServer {
    holdings: Arc<Holdings>,
    token: Option<AccessToken>,
    faults: Faults,
    /// Body bytes served to other peers.
    pub bytes_served: AtomicU64,
}

impl PeerServer {
    /// Serves what `holdings` holds to requests carrying `token` (everyone without one);
    /// `faults` is the test-only corruption setting.
    pub fn new(holdings: Arc<Holdings>, token: Option<AccessToken>, faults: Faults) -> Arc<Self> {
        Arc::new(Self {
            holdings,
            token,
            faults,
            bytes_served: AtomicU64::new(0),
        })
    }

    async fn read_piece(&self, hash: Blake3Hash, i: u64) -> Result<Bytes, ServeError> {
        // The partial file may be renamed into place between lookup and open: look twice.
        for _ in 0..2 {
            let Some((entry, path)) = self.holdings.piece(&hash, i) else {
                return Err(ServeError::not_found(format!(
                    "this peer does not hold piece {i} of blob {hash}"
                )));
            };
            let r = entry.piece_range(i);
            // Pooled, and around the page cache: the pull wrote these pieces with O_DIRECT.
            let res = tokio::task::spawn_blocking(move || {
                crate::mirror::cache::read_pooled_at(&path, r.start, (r.end - r.start) as usize)
            })
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            match res {
                Ok(b) => return Ok(self.faults.apply(b)),
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
        let fetch: PieceFetch = Arc::new(move |i| {
            let me = Arc::clone(&me);
            Box::pin(async move { me.read_piece(hash, i).await })
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
            MAX_CONNECTIONS,
            Duration::from_secs(2),
            handler,
            shutdown,
        )
        .await;
    }
}
