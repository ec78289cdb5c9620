//! The local OpenAI-compatible endpoint: HTTP/1.1 and h2c on one port, every request carried
//! through the tunnel. `/metrics` and `/admin/*` are answered locally.
//!
//! Every accepted socket gets TCP_NODELAY so a token event is written at once.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokenway_telemetry::{RequestLabels, StreamLabels};
use tokenway_transport::client::BoxError;
use tokio::net::TcpListener;

use crate::body::EdgeBody;
use crate::metrics::EdgeMetrics;
use crate::tunnel::{Outgoing, Tunnel};
use tokenway_telemetry::stream_clock::{StreamClock, StreamHistograms};

/// The body of every local response.
pub type LocalBody = UnsyncBoxBody<Bytes, BoxError>;

/// Routes with their own label; anything else is `other`.
const ROUTES: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/health",
];

/// Headers that belong to one hop (RFC 9110 §7.6.1) or that the tunnel sets itself.
const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "upgrade",
    "trailer",
    "host",
    crate::tunnel::AUTH_HEADER,
    crate::tunnel::IDEMPOTENCY_HEADER,
];

/// State shared by every local connection.
pub struct Local {
    /// The tunnel.
    pub tunnel: Arc<Tunnel>,
    /// Metrics.
    pub metrics: Arc<EdgeMetrics>,
    /// `max_body_bytes`.
    pub max_body_bytes: usize,
}

/// Serves `listener` until `stop` changes.
pub async fn serve(
    listener: TcpListener,
    local: Arc<Local>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
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
            _ = stop.changed() => return,
        };
        let _ = stream.set_nodelay(true);
        let local = local.clone();
        tokio::spawn(async move {
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder.http1().timer(TokioTimer::new()).keep_alive(true);
            builder
                .http2()
                .timer(TokioTimer::new())
                .max_concurrent_streams(1024);
            let svc = service_fn(move |req| handle(local.clone(), req));
            if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
                tracing::debug!(error = %e, "local connection ended with an error");
            }
        });
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
        "{{\"error\":{{\"message\":{},\"type\":\"tunnel_error\",\"code\":{}}}}}",
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

async fn handle(
    local: Arc<Local>,
    req: Request<Incoming>,
) -> Result<Response<LocalBody>, Infallible> {
    let path = req.uri().path().to_string();
    let response = match (req.method(), path.as_str()) {
        (&Method::GET, "/metrics") => {
            let mut r = Response::new(full(tokenway_telemetry::render(&local.metrics.registry)));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(tokenway_telemetry::CONTENT_TYPE),
            );
            r
        }
        (&Method::POST, "/admin/rebind") => match local.tunnel.rebind() {
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
        (&Method::POST, "/admin/reconnect") => {
            local.tunnel.reconnect();
            Response::new(full("reconnecting\n"))
        }
        _ => forward(&local, req).await,
    };
    Ok(response)
}

fn strip(headers: &HeaderMap) -> HeaderMap {
    let mut out = headers.clone();
    // Headers named in `Connection` are hop-by-hop too.
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    for h in HOP_BY_HOP.iter().map(|s| s.to_string()).chain(named) {
        out.remove(h.as_str());
    }
    out
}

async fn forward(local: &Local, req: Request<Incoming>) -> Response<LocalBody> {
    let start = Instant::now();
    let route = ROUTES
        .iter()
        .copied()
        .find(|r| *r == req.uri().path())
        .unwrap_or("other");
    let (parts, body) = req.into_parts();
    let version = parts.version;
    let limit = local.max_body_bytes;
    let body = match Limited::new(body, limit).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return count(
                local,
                route,
                "none",
                error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "request_too_large",
                    &format!("the request body exceeds the edge's max_body_bytes ({limit})"),
                ),
            )
        }
        Err(e) => {
            return count(
                local,
                route,
                "none",
                error(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    &format!("cannot read the request body: {e}"),
                ),
            )
        }
    };
    let out = Outgoing {
        method: parts.method.clone(),
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into()),
        headers: strip(&parts.headers),
        body,
    };
    match local.tunnel.send(&out).await {
        Ok(answer) => {
            let labels = StreamLabels {
                route: route.to_string(),
                backend: answer.gateway.clone(),
                transport: answer.transport.to_string(),
                client_region: "local".to_string(),
                backend_region: "local".to_string(),
            };
            let m = &local.metrics.requests;
            let histograms = StreamHistograms {
                ttft: m.ttft.get_or_create(&labels).clone(),
                gap: m.inter_token.get_or_create(&labels).clone(),
                duration: m.duration.get_or_create(&labels).clone(),
            };
            let (mut parts, body) = answer.response.into_parts();
            let sse = parts
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            let stripped = strip(&parts.headers);
            parts.headers = stripped;
            // The local connection's version, not the tunnel's (HTTP/3 or HTTP/2).
            parts.version = version;
            let resp = Response::from_parts(
                parts,
                EdgeBody::new(body, StreamClock::new(histograms, start, sse)).boxed_unsync(),
            );
            count(local, route, &answer.gateway, resp)
        }
        Err(e) => count(
            local,
            route,
            "none",
            error(StatusCode::BAD_GATEWAY, "gateway_unreachable", &e.message),
        ),
    }
}

fn count(local: &Local, route: &str, gateway: &str, r: Response<LocalBody>) -> Response<LocalBody> {
    local
        .metrics
        .requests
        .requests
        .get_or_create(&RequestLabels {
            route: route.to_string(),
            backend: gateway.to_string(),
            status: r.status().as_u16(),
        })
        .inc();
    r
}

/// Binds the local endpoint.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, crate::EdgeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| crate::EdgeError::Bind { addr, source })
}
