//! Overflow to peer gateways: when no local backend can take a request (none healthy, all at
//! their `max_inflight`, or every attempt failed before the first byte), the gateway sends it
//! through the tunnel to a peer gateway in another region, the way an edge would, and streams
//! the answer back.
//!
//! `[overflow]` holds the tunnel client's keys (token, trust, gateways, QUIC and fallback
//! settings; an edge has the same ones): the gateway runs the tunnel client the edge runs
//! ([`tokenway_transport::tunnel::Tunnel`]) with its RTT choice among the peers, TCP fallback,
//! 0-RTT and retries. A request that already overflowed once carries [`HOP_HEADER`] and never
//! overflows again, so two gateways that overflow to each other cannot bounce a request between
//! them.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokenway_transport::client::ClientBody;
use tokenway_transport::tunnel::{Outgoing, Tunnel, AUTH_HEADER, IDEMPOTENCY_HEADER};

use crate::error::{ApiError, BoxError, ResponseBody};
use crate::state::Shared;

/// Marks a request that is itself an overflow; its receiver does not overflow it further.
pub const HOP_HEADER: &str = tokenway_transport::tunnel::OVERFLOW_HEADER;

/// The peer tunnel, when overflow is configured and `parts` is not an overflow already.
pub fn eligible<'a>(shared: &'a Shared, parts: &Parts) -> Option<&'a Arc<Tunnel>> {
    shared
        .overflow
        .get()
        .filter(|_| !parts.headers.contains_key(HOP_HEADER))
}

/// Sends the request (`parts`, whole `body`) to the best peer gateway; the response streams
/// back unchanged. Returns it with the backend label `overflow:<peer>`.
pub async fn forward(
    tunnel: &Tunnel,
    parts: &Parts,
    body: Bytes,
) -> Result<(Response<ResponseBody>, String), ApiError> {
    let mut headers = http::HeaderMap::new();
    crate::proxy::copy_end_to_end_headers(&parts.headers, &mut headers);
    headers.remove(http::header::HOST);
    headers.remove(http::header::CONTENT_LENGTH);
    // The tunnel adds its own token and a fresh idempotency key.
    headers.remove(AUTH_HEADER);
    headers.remove(IDEMPOTENCY_HEADER);
    headers.insert(HOP_HEADER, HeaderValue::from_static("1"));
    let out = Outgoing {
        method: parts.method.clone(),
        path: parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
        headers,
        body,
    };
    match tunnel.send(&out).await {
        Ok(answer) => {
            let (mut head, body) = answer.response.into_parts();
            // The peer answered over HTTP/3 (or HTTP/2); the client's front sets its own.
            head.version = http::Version::default();
            let body = SyncBody(Mutex::new(body)).boxed();
            tracing::debug!(peer = %answer.gateway, status = %head.status, "request overflowed to a peer gateway");
            Ok((
                Response::from_parts(head, body),
                format!("overflow:{}", answer.gateway),
            ))
        }
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "overflow_unavailable",
            format!("no local backend could take the request and no peer gateway answered: {e}"),
        )),
    }
}

/// The tunnel client's body (not `Sync`) as the fronts' `Sync` response body. `poll_frame` has
/// `&mut self`, so the mutex is never locked, only used to make the type `Sync`.
struct SyncBody(Mutex<ClientBody>);

impl Body for SyncBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let inner = self.0.get_mut().unwrap_or_else(|p| p.into_inner());
        Pin::new(inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.lock().map(|b| b.is_end_stream()).unwrap_or(true)
    }

    fn size_hint(&self) -> SizeHint {
        self.0.lock().map(|b| b.size_hint()).unwrap_or_default()
    }
}
