//! The proxy core: send one client request to the ranked backends until one answers.
//!
//! Until the first byte has gone to the client every failure is retried on the next ranked
//! backend: connect errors, resets, 5xx answers, and silence past the first-byte timeout. The
//! gateway therefore holds the response head back until the backend's first body frame arrives
//! (for a stream that is its first token event, which is when a client can use it anyway).
//! The request body was read whole to route it, so a retry resends the same bytes.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName};
use http::request::Parts;
use http::{Request, Response, StatusCode, Uri};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokenway_router::{BackendId, Outcome};

use crate::error::{ApiError, ResponseBody};
use crate::relay::{Meter, RelayBody};
use crate::state::{Attempt, Shared, Upstream};

/// Header naming the backend that served a response.
pub const BACKEND_HEADER: &str = "x-tokenway-backend";

/// What the proxy needs to know about one client request.
pub struct ProxyRequest<'a> {
    /// The client's request head.
    pub parts: &'a Parts,
    /// The client's body, forwarded unchanged.
    pub body: Bytes,
    /// Route label.
    pub route: &'static str,
    /// Transport label.
    pub transport: &'static str,
    /// When the request arrived.
    pub start: Instant,
}

/// Why an attempt failed before its first byte.
enum Failure {
    Connect(String),
    Reset(String),
    Timeout,
}

/// Sends `req` to the backends in `ranked` order (at most `max_attempts` of them) and returns the
/// response to send to the client, plus the name of the backend it came from.
pub async fn forward(
    shared: &Arc<Shared>,
    req: ProxyRequest<'_>,
    ranked: Vec<BackendId>,
) -> (Response<ResponseBody>, Option<String>) {
    let attempts = ranked.len().min(shared.config.max_attempts as usize);
    let mut last_failure = None;
    for (n, id) in ranked.into_iter().take(attempts).enumerate() {
        let is_last = n + 1 == attempts;
        let mut attempt = Attempt::start(shared.clone(), id);
        let upstream = shared.upstream(id);
        let deadline = tokio::time::Instant::now() + shared.config.timeouts.first_byte();
        let request = upstream_request(upstream, req.parts, req.body.clone());
        let response = match tokio::time::timeout_at(deadline, shared.client.request(request)).await
        {
            Err(_) => Err(Failure::Timeout),
            Ok(Err(e)) if e.is_connect() => Err(Failure::Connect(error_chain(&e))),
            Ok(Err(e)) => Err(Failure::Reset(error_chain(&e))),
            Ok(Ok(resp)) => Ok(resp),
        };
        let response = match response {
            Ok(r) => r,
            Err(f) => {
                attempt.finish(f.outcome());
                tracing::info!(backend = %upstream.name, reason = %f.describe(), "attempt failed before the first byte");
                last_failure = Some((upstream.name.clone(), f));
                continue;
            }
        };
        if response.status().is_server_error() && !is_last {
            attempt.finish(Outcome::ServerError);
            tracing::info!(backend = %upstream.name, status = %response.status(), "backend answered 5xx; retrying on the next");
            continue;
        }
        let (parts, mut body) = response.into_parts();
        let first = match tokio::time::timeout_at(deadline, first_frame(&mut body)).await {
            Err(_) => Err(Failure::Timeout),
            Ok(Err(e)) => Err(Failure::Reset(error_chain(&e))),
            Ok(Ok(f)) => Ok(f),
        };
        let first = match first {
            Ok(f) => f,
            Err(f) => {
                attempt.finish(f.outcome());
                tracing::info!(backend = %upstream.name, reason = %f.describe(), "attempt failed before the first byte");
                last_failure = Some((upstream.name.clone(), f));
                continue;
            }
        };
        attempt.first_byte(req.start.elapsed());
        if parts.status.is_server_error() {
            // The last candidate's own error answer goes to the client as it is; it still
            // counts against the backend's health.
            attempt.finish(Outcome::ServerError);
        }
        let [ttft, gap, duration] = shared.stream_histograms(id, req.route, req.transport);
        let meter = Meter {
            ttft,
            gap,
            duration,
            start: req.start,
            sse: is_event_stream(&parts.headers),
        };
        let body = RelayBody::new(
            first,
            body,
            attempt,
            meter,
            shared.config.timeouts.stream_idle(),
        );
        let mut resp = Response::new(BodyExt::boxed(body));
        *resp.status_mut() = parts.status;
        copy_end_to_end_headers(&parts.headers, resp.headers_mut());
        if let Some(v) = &upstream.name_header {
            resp.headers_mut()
                .insert(HeaderName::from_static(BACKEND_HEADER), v.clone());
        }
        return (resp, Some(upstream.name.clone()));
    }
    let error = match last_failure {
        Some((backend, Failure::Timeout)) => ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "upstream_timeout",
            format!("no backend answered in time (last tried: {backend})"),
        ),
        Some((backend, f)) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_unavailable",
            format!(
                "no backend could serve the request (last tried: {backend}: {})",
                f.describe()
            ),
        ),
        None => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_unavailable",
            "every backend answered with a server error",
        ),
    };
    (error.into_response(), None)
}

impl Failure {
    fn outcome(&self) -> Outcome {
        match self {
            Failure::Connect(_) => Outcome::ConnectError,
            Failure::Reset(_) => Outcome::ServerError,
            Failure::Timeout => Outcome::Timeout,
        }
    }

    fn describe(&self) -> String {
        match self {
            Failure::Connect(e) => format!("connect failed: {e}"),
            Failure::Reset(e) => format!("connection failed: {e}"),
            Failure::Timeout => "timed out before the first byte".to_string(),
        }
    }
}

/// Reads up to the first non-empty data frame (or trailers, or the end of the body).
async fn first_frame(body: &mut Incoming) -> Result<Option<Frame<Bytes>>, hyper::Error> {
    loop {
        match body.frame().await {
            None => return Ok(None),
            Some(Err(e)) => return Err(e),
            Some(Ok(f)) => {
                if f.data_ref().is_some_and(|d| d.is_empty()) {
                    continue;
                }
                return Ok(Some(f));
            }
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// Whether a response is a Server-Sent-Events stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and those the gateway sets itself.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

fn copy_end_to_end_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !is_hop_by_hop(name) {
            to.append(name.clone(), value.clone());
        }
    }
}

/// The request sent to `upstream`: same method, path, query and end-to-end headers; the client's
/// credentials replaced by the backend's own.
fn upstream_request(upstream: &Upstream, parts: &Parts, body: Bytes) -> Request<Full<Bytes>> {
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let mut uri_parts = upstream.base.clone().into_parts();
    uri_parts.path_and_query = path.parse().ok();
    let uri = Uri::from_parts(uri_parts).unwrap_or_else(|_| upstream.base.clone());
    let mut request = Request::new(Full::new(body));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    let headers = request.headers_mut();
    for (name, value) in &parts.headers {
        if is_hop_by_hop(name)
            || name == header::HOST
            || name == header::AUTHORIZATION
            || name == header::CONTENT_LENGTH
        {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    if let Some(auth) = &upstream.authorization {
        headers.insert(header::AUTHORIZATION, auth.clone());
    }
    request
}
