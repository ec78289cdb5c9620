//! The local OpenAI-compatible endpoint: HTTP/1.1 and h2c on one port, every request carried
//! through the tunnel. `/metrics` and `/admin/*` are answered locally.
//!
//! Every accepted socket gets TCP_NODELAY so a token event is written at once.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokenway_transport::client::BoxError;
use tokio::net::TcpListener;

use crate::body::EdgeBody;
use crate::metrics::EdgeMetrics;
use tokenway_telemetry::stream_clock::StreamClock;
use tokenway_transport::tunnel::{Outgoing, Tunnel};
use tokenway_wire::sse::ErrorEventStyle;

/// The body of every local response.
pub type LocalBody = UnsyncBoxBody<Bytes, BoxError>;

/// Routes with their own label; anything else is `other`.
const ROUTES: [&str; 6] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/models",
    "/health",
];

/// Headers that belong to one hop (RFC 9110 §7.6.1) or that the tunnel sets itself.
static HOP_BY_HOP: [HeaderName; 13] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::TE,
    header::UPGRADE,
    header::TRAILER,
    header::HOST,
    HeaderName::from_static(tokenway_transport::tunnel::AUTH_HEADER),
    HeaderName::from_static(tokenway_transport::tunnel::IDEMPOTENCY_HEADER),
    HeaderName::from_static(tokenway_transport::cc::RX_RATE_HEADER),
    // A gateway's own: from an app it would keep the request from its gateway's overflow.
    HeaderName::from_static(tokenway_transport::tunnel::OVERFLOW_HEADER),
    HeaderName::from_static(tokenway_transport::tunnel::SUPERSEDES_HEADER),
];

/// State shared by every local connection.
pub struct Local {
    /// The tunnel.
    pub tunnel: Arc<Tunnel>,
    /// Metrics.
    pub metrics: Arc<EdgeMetrics>,
    /// `max_body_bytes`.
    pub max_body_bytes: usize,
    /// The bound on request bodies held, all requests together.
    pub bodies: tokenway_transport::body_budget::BodyBudget,
}

/// How long open local connections get to finish after shutdown is asked (as the gateway's).
pub const DRAIN: Duration = Duration::from_secs(5);

/// Serves `listener` until `stop` changes, then drains: no new connection is accepted, an
/// HTTP/1.1 connection finishes the response in flight and closes, an HTTP/2 one sends GOAWAY
/// and finishes its streams; after [`DRAIN`] what is still open is dropped. Before, the
/// connections were left to the process's exit: a token stream in flight at a restart was cut
/// mid-answer without an error event.
pub async fn serve(
    listener: TcpListener,
    local: Arc<Local>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, _peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.changed() => break,
        };
        let _ = stream.set_nodelay(true);
        let local = local.clone();
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder.http1().timer(TokioTimer::new()).keep_alive(true);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(1024)
            // The heads HTTP/1.1 clients may send (MAX_REQUEST_HEAD_BYTES), not h2's 16 KiB.
            .max_header_list_size(MAX_REQUEST_HEAD_BYTES as u32);
        let svc = service_fn(move |req| handle(local.clone(), req));
        let conn = builder
            .serve_connection(TokioIo::new(stream), svc)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "local connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::info!("local connections still open after the drain period; closing them");
    }
}

fn full(body: impl Into<Bytes>) -> LocalBody {
    Full::new(body.into())
        .map_err(|n| match n {})
        .boxed_unsync()
}

/// An OpenAI-style error answer.
fn error(status: StatusCode, code: &str, message: &str) -> Response<LocalBody> {
    let body = format!(
        "{{\"error\":{{\"message\":{},\"type\":\"tunnel_error\",\"param\":null,\"code\":{}}}}}",
        json_string(message),
        json_string(code)
    );
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Requests the edge answers itself instead of carrying them through the tunnel.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Here {
    Metrics,
    Rebind,
    Reconnect,
}

async fn handle(
    local: Arc<Local>,
    req: Request<Incoming>,
) -> Result<Response<LocalBody>, Infallible> {
    let here = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => Some(Here::Metrics),
        (&Method::POST, "/admin/rebind") => Some(Here::Rebind),
        (&Method::POST, "/admin/reconnect") => Some(Here::Reconnect),
        _ => None,
    };
    let Some(here) = here else {
        return Ok(forward(&local, req).await);
    };
    // A web page in the user's browser may send a plain POST to loopback without a CORS
    // preflight; the admin routes (closing every tunnel connection) are not for pages, and a
    // browser always names the page's origin.
    if here != Here::Metrics && req.headers().contains_key(header::ORIGIN) {
        return Ok(error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "the edge's /admin routes do not take requests from web pages (an Origin header)",
        ));
    }
    let response = match here {
        Here::Metrics => {
            let mut r = Response::new(full(tokenway_telemetry::render(&local.metrics.registry)));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(tokenway_telemetry::CONTENT_TYPE),
            );
            r
        }
        Here::Rebind => match local.tunnel.rebind() {
            Ok(addr) => {
                local.metrics.rebinds("admin").inc();
                Response::new(full(format!("rebound to {addr}\n")))
            }
            Err(e) => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "rebind_failed",
                &e.to_string(),
            ),
        },
        Here::Reconnect => {
            local.tunnel.reconnect();
            Response::new(full("reconnecting\n"))
        }
    };
    Ok(response)
}

/// The largest request head the gateway's fronts take (its `MAX_HEAD_BYTES`, docs/tunnel.md).
const MAX_REQUEST_HEAD_BYTES: usize = 64 * 1024;

/// Room left in a request head for the headers the tunnel adds (token, idempotency key,
/// receive rate, authority).
const TUNNEL_HEADERS_BYTES: usize = 512;

/// The size of `headers` as HTTP/3 counts it (RFC 9114 §4.2.2): name, value and 32 bytes for
/// each field.
fn field_section_size(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 32)
        .sum()
}

/// Drops the hop-by-hop headers, and those the `Connection` header names, in place.
fn strip(headers: &mut HeaderMap) {
    // Rare (clients send `Connection: keep-alive` or nothing), so only then a list is built.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in HOP_BY_HOP.iter().chain(&named) {
        headers.remove(name);
    }
}

async fn forward(local: &Local, req: Request<Incoming>) -> Response<LocalBody> {
    let start = Instant::now();
    let route = ROUTES
        .iter()
        .copied()
        .find(|r| *r == req.uri().path())
        .unwrap_or("other");
    let error_style = ErrorEventStyle::for_path(req.uri().path());
    let (mut parts, body) = req.into_parts();
    let version = parts.version;
    let limit = local.max_body_bytes;
    let too_large = || {
        count(
            local,
            route,
            &Arc::from("none"),
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                &format!("the request body exceeds the edge's max_body_bytes ({limit})"),
            ),
        )
    };
    // A declared length over the limit is refused before anything is read (nor is
    // `100 Continue` sent: hyper sends it only when the body is first read).
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large();
    }
    // The body is held (for a retry on a fresh connection) within the edge's bound on held
    // bodies, taken as it arrives (a declared length must fit the room left, but holds
    // nothing until its bytes come).
    let mut held = local.bodies.hold();
    // An h2c request's head is held with its body (`request_head_bytes`); an HTTP/1.1
    // connection holds one head at a time, bounded by itself.
    let head = if version == http::Version::HTTP_2 {
        tokenway_transport::body_budget::request_head_bytes(&parts)
    } else {
        0
    };
    let busy = || {
        let mut r = error(
            StatusCode::SERVICE_UNAVAILABLE,
            "edge_busy",
            "the edge holds as many request bodies as it may; retry shortly",
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        count(local, route, &Arc::from("none"), r)
    };
    // A body of no declared length needs a byte of room: with none left it is refused before
    // hyper invites it (`100 Continue` goes out when the body is first read).
    let need = declared.map_or(usize::from(!hyper::body::Body::is_end_stream(&body)), |n| {
        n as usize
    });
    if !held.grow(head) || !held.has_room_for(need) {
        return busy();
    }
    let mut collected = bytes::BytesMut::new();
    let mut limited = std::pin::pin!(Limited::new(body, limit));
    while let Some(frame) = limited.frame().await {
        match frame {
            Ok(f) => {
                if let Ok(data) = f.into_data() {
                    let more = (head + collected.len() + data.len()).saturating_sub(held.bytes());
                    if !held.grow(more) {
                        return busy();
                    }
                    collected.extend_from_slice(&data);
                }
            }
            Err(e) if e.is::<http_body_util::LengthLimitError>() => return too_large(),
            Err(e) => {
                return count(
                    local,
                    route,
                    &Arc::from("none"),
                    error(
                        StatusCode::BAD_REQUEST,
                        "bad_request",
                        &format!("cannot read the request body: {e}"),
                    ),
                )
            }
        }
    }
    let body = collected.freeze();
    let mut headers = std::mem::take(&mut parts.headers);
    strip(&mut headers);
    // The gateway takes request heads up to 64 KiB (RFC 9114's field section size: names,
    // values and 32 bytes per field); a larger one could never be sent, and is the request's
    // fault, not the tunnel's: no retries, no 502.
    let head = field_section_size(&headers)
        + parts.uri.path_and_query().map_or(1, |p| p.as_str().len())
        + parts.method.as_str().len()
        + 4 * 32
        + TUNNEL_HEADERS_BYTES;
    if head > MAX_REQUEST_HEAD_BYTES {
        return count(
            local,
            route,
            &Arc::from("none"),
            error(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "request_header_fields_too_large",
                &format!(
                    "the request head is {head} bytes; the gateway takes at most \
                     {MAX_REQUEST_HEAD_BYTES}"
                ),
            ),
        );
    }
    let out = Outgoing {
        method: parts.method,
        path: parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/")),
        headers,
        body,
    };
    let sent = local.tunnel.send(&out).await;
    // The answer's head is in (or the request failed): the body is no longer held for a retry.
    drop(held);
    match sent {
        Ok(answer) => {
            let histograms =
                local
                    .metrics
                    .stream_histograms(route, &answer.gateway, answer.transport);
            let (mut parts, body) = answer.response.into_parts();
            let sse = parts
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            strip(&mut parts.headers);
            // The local connection's version, not the tunnel's (HTTP/3 or HTTP/2).
            parts.version = version;
            let mut clock = StreamClock::new(histograms, start, sse);
            if !parts.status.is_success() {
                // An error answer's bytes are no tokens (a fast 429 or 503 is no first token),
                // as the gateway counts them.
                clock = clock.error_answer();
            }
            let resp = Response::from_parts(
                parts,
                EdgeBody::new(body, clock)
                    .with_error_style(error_style)
                    .boxed_unsync(),
            );
            count(local, route, &answer.gateway, resp)
        }
        Err(e) => {
            let status = if e.code == tokenway_transport::tunnel::HEAD_TOO_LARGE {
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
            } else {
                StatusCode::BAD_GATEWAY
            };
            let mut r = error(status, e.code, &e.message);
            // A refused token is the edge's configuration and an oversized head the request's
            // own, not passing faults: the OpenAI clients' retries (two, on any 502) would
            // only be refused again.
            if e.code == tokenway_transport::tunnel::AUTH_FAILED
                || e.code == tokenway_transport::tunnel::HEAD_TOO_LARGE
            {
                r.headers_mut()
                    .insert("x-should-retry", HeaderValue::from_static("false"));
            }
            count(local, route, &Arc::from("none"), r)
        }
    }
}

fn count(
    local: &Local,
    route: &'static str,
    gateway: &Arc<str>,
    r: Response<LocalBody>,
) -> Response<LocalBody> {
    local
        .metrics
        .requests_counter(route, gateway, r.status().as_u16())
        .inc();
    r
}

/// Binds the local endpoint.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, crate::EdgeError> {
    tokenway_transport::socket::listen_tcp(addr)
        .map_err(|source| crate::EdgeError::Bind { addr, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What only the tunnel's ends set never comes from an app: the token, the idempotency
    /// key, the rate advertisement, and the overflow mark between gateways (which kept an
    /// app's request from its gateway's overflow), with the hop-by-hop fields.
    #[test]
    fn the_tunnels_own_fields_never_come_from_an_app() {
        let mut h = HeaderMap::new();
        for name in [
            "tw-auth",
            "tw-idempotency-key",
            "tw-rx-rate",
            "tw-overflow",
            "tw-supersedes",
            "te",
            "x-secret",
        ] {
            h.insert(HeaderName::from_static(name), HeaderValue::from_static("1"));
        }
        h.insert(header::CONNECTION, HeaderValue::from_static("x-secret"));
        h.insert("x-kept", HeaderValue::from_static("yes"));
        strip(&mut h);
        let left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["x-kept"]);
    }
}
