//! The request-handling core shared by every front: a small stack of steps per request —
//! route, authenticate, read a bounded body, parse what routing needs, rank, forward, measure.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use tokenway_router::{prompt_blocks, Route, RouteError, RouteRequest, SessionKind};
use tokenway_transport::body_budget::Held;

use crate::admission::Refused;
use crate::cors::Cors;
use crate::error::{full, ApiError, ResponseBody};
use crate::proxy::{self, Forwarded, ProxyRequest};
use crate::request_meta::RequestMeta;
use crate::state::WILDCARD_MODEL;
use crate::state::{Reservation, Shared};
use crate::status;
use crate::tunnel::AUTH_HEADER;

/// The routes the gateway proxies by the `model` of their JSON body, each its own metric label:
/// the OpenAI API's (the first [`HOT_ROUTES`] carry nearly all traffic) and what vLLM, SGLang
/// and llama.cpp serve beside it. Only these: the path goes to the backend with the gateway's
/// own backend key, so no other path (a server's admin routes such as vLLM's
/// `/v1/load_lora_adapter`, or one with `..` segments a path-routing proxy would resolve) may.
pub(crate) const PROXIED: [&str; 14] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/rerank",
    "/v1/score",
    "/v2/rerank",
    "/rerank",
    "/score",
    "/pooling",
    "/classify",
    "/tokenize",
    "/detokenize",
];

/// How many of [`PROXIED`]'s first routes have cached per-backend counters.
pub(crate) const HOT_ROUTES: usize = 3;

/// The proxied route `path` is, as its metric label.
pub(crate) fn proxied(path: &str) -> Option<&'static str> {
    PROXIED.iter().copied().find(|r| *r == path)
}

/// The `route` label of a request to `path` in `tokenway_requests_total`: its proxied route
/// (sloppy slashes read as [`answer`] reads them), else `other`. For the answers the HTTP/1.1
/// front gives itself, which the request-handling core never sees.
pub(crate) fn route_label(path: &str) -> &'static str {
    proxied(normalized(path).as_deref().unwrap_or(path)).unwrap_or("other")
}

/// `path` with repeated slashes collapsed and a trailing one dropped (`/v1//chat/completions/`
/// is `/v1/chat/completions`, as the Python servers read it after their redirect), or `None`
/// when it is already so.
fn normalized(path: &str) -> Option<String> {
    if !(path.contains("//") || (path.len() > 1 && path.ends_with('/'))) {
        return None;
    }
    let mut out = String::with_capacity(path.len());
    for segment in path.split('/').filter(|s| !s.is_empty()) {
        out.push('/');
        out.push_str(segment);
    }
    if out.is_empty() {
        out.push('/');
    }
    Some(out)
}

/// The client-side transport a request came in on, for metric labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// HTTP/1.x over TCP.
    H1,
    /// HTTP/2 over TCP (TLS or h2c).
    H2,
    /// HTTP/3 over QUIC.
    H3,
    /// The edge's tunnel over QUIC.
    Tunnel,
    /// The edge's tunnel over its TCP fallback.
    TunnelTcp,
}

impl Transport {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::H1 => "h1",
            Transport::H2 => "h2",
            Transport::H3 => "h3",
            Transport::Tunnel => "tunnel",
            Transport::TunnelTcp => "tunnel-tcp",
        }
    }

    /// The transport of a request that arrived on a TCP front, from its HTTP version.
    pub fn of_tcp_request<B>(req: &Request<B>) -> Self {
        match req.version() {
            http::Version::HTTP_2 => Transport::H2,
            _ => Transport::H1,
        }
    }
}

/// Which TCP listener a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpFront {
    /// `listen` or `tls_listen`: the gateway's API. A request with the tunnel's header is an
    /// edge's; with a wrong token it sees the masquerade site.
    Api,
    /// `tunnel.tcp_listen`: edges only. Every request without a valid tunnel token sees the
    /// masquerade site, as on the tunnel's UDP port.
    Tunnel,
}

/// What the HTTP/1.1 front does with a request before it reads the body ([`before_body`]).
pub enum BeforeBody {
    /// Read it and handle the request.
    Read,
    /// Refuse the request with this answer (an error), unread.
    Refuse(Response<ResponseBody>),
    /// The request is the masquerade site's: it needs no body.
    Masquerade,
}

/// Handles one request from a TCP front. A request carrying the tunnel token is an edge's
/// request over its TCP fallback; a wrong token sees the masquerade site, and so does any
/// request without the token on the tunnel's own TCP port.
pub async fn handle<B>(
    shared: Arc<Shared>,
    mut req: Request<B>,
    peer: SocketAddr,
    front: TcpFront,
) -> Result<Response<ResponseBody>, Infallible>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let mut transport = Transport::of_tcp_request(&req);
    if let Some(tunnel) = &shared.tunnel {
        if front == TcpFront::Tunnel || req.headers().contains_key(AUTH_HEADER) {
            if !tunnel.is_authenticated(req.headers()) {
                return Ok(tunnel.masquerade.respond(&req, &shared.client).await);
            }
            // A request on the TCP fallback is not noted as running: a retry comes from an
            // edge whose QUIC path went silent, and supersedes what ran there.
            if let Err(e) = tunnel.admit(req.headers_mut(), Instant::now()) {
                return Ok(e.into_response());
            }
            if req.method() == Method::CONNECT {
                return Ok(crate::forward_tcp::connect(&shared, req).await);
            }
            transport = Transport::TunnelTcp;
        }
    }
    let mut resp = handle_request(shared.clone(), req, transport, peer).await;
    // The public HTTP/3 front is the API's; edges on the tunnel's port have their own UDP port.
    if let (Some(alt_svc), TcpFront::Api) = (shared.alt_svc.get(), front) {
        resp.headers_mut().insert(header::ALT_SVC, alt_svc.clone());
    }
    Ok(resp)
}

/// Handles one request from any front, which passes the client's address (`peer`): the one
/// request-handling core. With `cors_allow_origins` set, a browser's preflight from an allowed
/// origin is answered here, before authentication (it carries no key), and every answer to
/// such an origin is marked readable.
pub async fn handle_request<B>(
    shared: Arc<Shared>,
    req: Request<B>,
    transport: Transport,
    peer: SocketAddr,
) -> Response<ResponseBody>
where
    B: Body + Send,
    B::Data: Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let Some(cors) = &shared.cors else {
        return answer(shared, req, transport, peer).await;
    };
    if let (true, Some(allow)) = (
        Cors::is_preflight(req.method(), req.headers()),
        cors.allow(req.headers()),
    ) {
        shared.count_request("other", None, StatusCode::NO_CONTENT.as_u16());
        return cors.preflight(allow, req.headers());
    }
    let allow = cors.allow(req.headers());
    let mut response = answer(shared.clone(), req, transport, peer).await;
    cors.mark(&mut response, allow);
    response
}

/// [`handle_request`] past CORS.
async fn answer<B>(
    shared: Arc<Shared>,
    req: Request<B>,
    transport: Transport,
    peer: SocketAddr,
) -> Response<ResponseBody>
where
    B: Body + Send,
    B::Data: Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let start = Instant::now();
    let transport = transport.as_str();
    let mut req = req;
    if let Some(path) = normalized(req.uri().path()) {
        let mut uri = req.uri().clone().into_parts();
        let query = uri
            .path_and_query
            .as_ref()
            .and_then(|pq| pq.query())
            .map_or(String::new(), |q| format!("?{q}"));
        if let Ok(pq) = format!("{path}{query}").parse() {
            uri.path_and_query = Some(pq);
            if let Ok(uri) = http::Uri::from_parts(uri) {
                *req.uri_mut() = uri;
            }
        }
    }
    join_cookies(req.headers_mut());
    let path = req.uri().path();
    let route = proxied(path);
    let method = req.method().clone();
    // Reads answer HEAD as GET; the body is dropped below, its length kept.
    let read = method == Method::GET || method == Method::HEAD;
    let (mut response, route_label, backend) = match (read, &method, path, route) {
        (true, _, "/health", _) => (text(StatusCode::OK, "ok\n"), "/health", None),
        (true, _, "/metrics", _) => {
            let mut r = Response::new(full(tokenway_telemetry::render(&shared.registry)));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(tokenway_telemetry::CONTENT_TYPE),
            );
            (r, "/metrics", None)
        }
        (true, _, "/admin/backends", _) => (status::backends_json(&shared), "/admin", None),
        (true, _, "/status", _) => (status::page(&shared), "/status", None),
        (true, _, "/v1/models", _) => {
            let r = match authenticate(&shared, req.headers()) {
                Ok(()) => models(&shared),
                Err(e) => e.into_response(),
            };
            (r, "/v1/models", None)
        }
        (true, _, _, _) if path.starts_with(MODEL_PREFIX) => {
            let r = match authenticate(&shared, req.headers()) {
                Ok(()) => model(&shared, &path[MODEL_PREFIX.len()..]),
                Err(e) => e.into_response(),
            };
            (r, "/v1/models", None)
        }
        (_, &Method::POST, _, Some(route)) => {
            match proxy_route(&shared, req, route, transport, start, peer).await {
                // A 200 from a backend was counted with a counter looked up while the backend
                // worked, so the count is not in the way of the answer's first byte.
                Ok(f) if f.counted => return f.response,
                Ok(f) => (f.response, route, f.backend),
                Err(e) => (e.into_response(), route, None),
            }
        }
        _ => (
            not_routed(&method, path, allowed_methods(path, route)),
            "other",
            None,
        ),
    };
    if method == Method::HEAD {
        let length = response.body().size_hint().exact();
        if let Some(n) = length.filter(|_| !response.headers().contains_key(header::CONTENT_LENGTH))
        {
            response
                .headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        *response.body_mut() = full(Bytes::new());
    }
    shared.count_request(route_label, backend, response.status().as_u16());
    response
}

async fn proxy_route<B>(
    shared: &Arc<Shared>,
    req: Request<B>,
    route: &'static str,
    transport: &'static str,
    start: Instant,
    peer: SocketAddr,
) -> Result<Forwarded, ApiError>
where
    B: Body + Send,
    B::Data: Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    authenticate(shared, req.headers())?;
    let (parts, body) = req.into_parts();
    // `_held` keeps the body's bytes in the budget until the answer's head is in (or every
    // attempt failed): as long as a retry or a hedge may send it again.
    let (body, _held) = read_body(shared, &parts, body).await?;
    let meta = RequestMeta::parse(&body)?;
    let mut request = Arc::new(route_request(shared, &parts, &meta, peer)?);
    let overflow = crate::overflow::eligible(shared, &parts);
    let (mut routed, mut reservation) = route_reserving(shared, &request);
    if matches!(routed, Err(RouteError::UnknownModel { .. })) {
        if let Some(alias) = model_alias(shared, &request.model) {
            let mut aliased = (*request).clone();
            aliased.model = alias;
            request = Arc::new(aliased);
            (routed, reservation) = route_reserving(shared, &request);
        }
    }
    let held_since = Instant::now();
    let mut queued = false;
    // The peer region is asked once; when it cannot take the request, the local answer
    // (a queued wait, or a 503 with Retry-After) stands, not the tunnel's 502.
    let mut overflow_tried = false;
    loop {
        // The router may say "hold": a backend is prefilling this prompt's prefix for another
        // request right now. Wait, then route again as a held request; the router bounds the
        // total by `routing.prefill_hold_max_ms` (docs/routing.md, "Holding for a prefill").
        while let Ok(Route {
            hold: Some(wait),
            backends,
            ..
        }) = &routed
        {
            let wait = *wait;
            // A hold always names its backend first; without one there is nothing to wait for.
            let Some(first) = backends.first().copied() else {
                break;
            };
            tokio::time::sleep(wait).await;
            let again = (*request).clone().with_held(first, held_since.elapsed());
            (routed, reservation) = route_reserving(shared, &again);
        }
        // Every healthy backend of the model is at its max_inflight: wait for a slot, once and
        // bounded (admission.rs), unless a peer region can take the request now.
        let Err(RouteError::Saturated { model }) = &routed else {
            break;
        };
        if queued {
            break;
        }
        if let Some(tunnel) = overflow.filter(|_| !overflow_tried) {
            overflow_tried = true;
            // Boxed: the rare overflow's kilobytes stay out of every request's future.
            match Box::pin(crate::overflow::forward(tunnel, &parts, body.clone())).await {
                Ok((resp, peer)) => return Ok(Forwarded::uncounted(resp, Some(peer))),
                Err(e) => {
                    tracing::info!(error = %e.message, "the peer region cannot take a request this region has no slot for; it waits for a local one");
                }
            }
        }
        queued = true;
        let model = model.clone();
        let waited = shared
            .admission
            .wait_for(shared.config.timeouts.queue(), || {
                match route_reserving(shared, &request) {
                    (Err(RouteError::Saturated { .. }), _) => None,
                    other => Some(other),
                }
            })
            .await;
        (routed, reservation) = match waited {
            Ok(routed) => routed,
            Err(refused) => return Err(queue_refused(shared, &model, refused)),
        };
    }
    let routed = match routed {
        Ok(routed) => routed,
        // Nothing local can take it (none healthy, all saturated, model not served here).
        Err(
            e @ (RouteError::NoHealthyBackend { .. }
            | RouteError::Saturated { .. }
            | RouteError::UnknownModel { .. }),
        ) if overflow.is_some() && !overflow_tried => {
            let tunnel = overflow.expect("checked");
            match Box::pin(crate::overflow::forward(tunnel, &parts, body)).await {
                Ok((resp, peer)) => return Ok(Forwarded::uncounted(resp, Some(peer))),
                // A model this region does not serve: the peer's failure is the answer.
                Err(overflow_error) if matches!(e, RouteError::UnknownModel { .. }) => {
                    return Err(overflow_error)
                }
                // This region's own 503 with Retry-After (its backends will be back or free),
                // rather than a 502 saying that the peer could not be reached.
                Err(overflow_error) => {
                    tracing::info!(error = %overflow_error.message, "the peer region cannot take a request this region cannot serve now");
                    return Err(route_error(shared, e));
                }
            }
        }
        Err(e) => return Err(route_error(shared, e)),
    };
    // Not a second time after the peer just failed: its failure would only add its wait.
    let spare = overflow
        .filter(|_| !overflow_tried)
        .map(|t| (t, body.clone()));
    // Inline: the request's future is boxed whole (`front_h1`), one allocation for all its
    // states; only the rare overflow to a peer region is boxed apart, so that its kilobytes do
    // not enlarge every request's.
    let forwarded = proxy::forward(
        shared,
        ProxyRequest {
            parts: &parts,
            body,
            route,
            transport,
            start,
            request,
        },
        routed,
        reservation,
    )
    .await;
    // Every local attempt failed before the first byte: a peer region may still serve it.
    if let (false, Some((tunnel, body))) = (forwarded.from_backend(), spare) {
        if let Ok((resp, peer)) = Box::pin(crate::overflow::forward(tunnel, &parts, body)).await {
            return Ok(Forwarded::uncounted(resp, Some(peer)));
        }
    }
    Ok(forwarded)
}

/// What the router sees of a request: model, prompt blocks, session key, client region, sizes.
fn route_request(
    shared: &Shared,
    parts: &http::request::Parts,
    meta: &RequestMeta<'_>,
    peer: SocketAddr,
) -> Result<RouteRequest, ApiError> {
    let settings = &shared.config.routing;
    let prompt = meta.prompt_text();
    let tracked_bytes = tokenway_router::MAX_PROMPT_BLOCKS.saturating_mul(settings.block_bytes);
    let untracked_bytes = prompt.len().saturating_sub(tracked_bytes);
    let mut r = RouteRequest::new(routed_model(shared, meta)?)
        .with_blocks(prompt_blocks(prompt, settings.block_bytes))
        .with_prompt_tokens(u32::try_from(prompt.len() / 4).unwrap_or(u32::MAX))
        .with_untracked_tokens(u32::try_from(untracked_bytes / 4).unwrap_or(u32::MAX))
        .with_whole_answer(meta.stream != Some(true));
    if let Some(limit) = meta.output_limit() {
        r = r.with_max_output_tokens(limit);
    }
    let header = |name: &http::HeaderName| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
    };
    let [session_header, region_header] = &shared.routing_headers;
    if let Some(session) = header(session_header) {
        r = r.with_session(SessionKind::Header, session);
    } else if let Some(user) = meta.user.as_deref().filter(|u| !u.is_empty()) {
        r = r.with_session(SessionKind::User, user);
    } else if settings.source_affinity {
        r = r.with_session(SessionKind::SourceAddr, peer.ip().to_string());
    }
    let region = header(region_header).unwrap_or(&shared.config.region);
    Ok(r.with_client_region(region))
}

/// The model a request is routed by: the one it names, or, when it names none (vLLM then
/// serves its only model), the one model the backends serve, else the wildcard backends'.
fn routed_model(shared: &Shared, meta: &RequestMeta<'_>) -> Result<String, ApiError> {
    if let Some(named) = meta.model.as_deref().filter(|m| !m.is_empty()) {
        return Ok(named.to_owned());
    }
    // The one id the backends list, found without copying their lists.
    let upstreams = shared.live_upstreams();
    let mut only: Option<String> = None;
    let mut several = false;
    for (_, u) in &upstreams {
        let entries = u.model_entries.lock().unwrap_or_else(|p| p.into_inner());
        for id in entries
            .iter()
            .filter_map(|e| e.get("id").and_then(|v| v.as_str()))
            .filter(|id| !id.is_empty())
        {
            match &only {
                None => only = Some(id.to_owned()),
                Some(o) if o != id => several = true,
                Some(_) => {}
            }
        }
    }
    match only {
        Some(id) if !several => Ok(id),
        _ if upstreams.iter().any(|(_, u)| u.wildcard) => Ok(WILDCARD_MODEL.to_owned()),
        _ => meta.require_model().map(str::to_owned),
    }
}

/// Another name the router may know a model by, tried when no backend names the one asked
/// for: Ollama's `name:latest` for a `name` without a tag (Ollama fills the tag in itself),
/// then the backends that take any model (`"*"`). The body goes to the backend unchanged.
fn model_alias(shared: &Shared, model: &str) -> Option<String> {
    let router = shared.router();
    if !model.contains(':') {
        let tagged = format!("{model}:latest");
        if router.serves(&tagged) {
            return Some(tagged);
        }
    }
    (model != WILDCARD_MODEL && router.serves(WILDCARD_MODEL)).then(|| WILDCARD_MODEL.to_owned())
}

/// Joins the `cookie` fields of a request into one, `; ` between them: HTTP/2 and HTTP/3 clients
/// may send each cookie as a field of its own (RFC 9113 §8.2.3, RFC 9114 §4.2.1), and an
/// HTTP/1.1 backend must see one (RFC 6265 §5.4: servers may read only the first).
fn join_cookies(headers: &mut http::HeaderMap) {
    let mut cookies = headers.get_all(header::COOKIE).iter();
    let (Some(first), Some(_)) = (cookies.next(), cookies.next()) else {
        return;
    };
    let mut joined = first.as_bytes().to_vec();
    for more in headers.get_all(header::COOKIE).iter().skip(1) {
        joined.extend_from_slice(b"; ");
        joined.extend_from_slice(more.as_bytes());
    }
    // Made of valid field values and `; `: always a valid value.
    if let Ok(value) = HeaderValue::from_bytes(&joined) {
        headers.insert(header::COOKIE, value);
    }
}

/// Body bytes a request to a route that takes none may carry and still be read (and ignored).
const NO_BODY_TOLERATED: u64 = 1024;

/// Whether `headers` declare a body of more than `limit` bytes, or one of untold length
/// (chunked).
fn declares_body_over(headers: &http::HeaderMap, limit: u64) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > limit)
}

/// What can be decided from a request's head alone, before the HTTP/1.1 front reads its body:
/// a request to a proxied route without a valid API key is refused, so that a client without
/// one is neither invited by `100 Continue` to send up to `max_body_bytes` nor has such a body
/// held while it arrives (HTTP/2 and HTTP/3 check the key before reading the body as well, in
/// [`proxy_route`]); and a request that fails tunnel authentication is the masquerade site's.
pub fn before_body(shared: &Shared, parts: &http::request::Parts, front: TcpFront) -> BeforeBody {
    if let Some(tunnel) = &shared.tunnel {
        if (front == TcpFront::Tunnel || parts.headers.contains_key(AUTH_HEADER))
            && !tunnel.is_authenticated(&parts.headers)
        {
            return BeforeBody::Masquerade;
        }
    }
    let path = parts.uri.path();
    let normal = normalized(path);
    let path = normal.as_deref().unwrap_or(path);
    // No route here takes a body but a proxied one by POST: a body declared to any other is
    // refused unread (before, `GET /health` or `PUT /v1/chat/completions` with a body was
    // invited by `100 Continue`, key or no key, and its body held in the shared budget while it
    // trickled in). A small one (a client that sends `{}` anyway) is read and ignored.
    let takes_body = parts.method == Method::POST && proxied(path).is_some();
    if !takes_body && declares_body_over(&parts.headers, NO_BODY_TOLERATED) {
        let mut refusal = match proxied(path) {
            Some(_) => not_routed(&parts.method, path, allowed_methods(path, Some("POST"))),
            None if matches!(parts.method, Method::POST | Method::PUT | Method::PATCH) => {
                not_routed(&parts.method, path, allowed_methods(path, None))
            }
            None => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "body_not_allowed",
                format!("{} {path} takes no request body", parts.method),
            )
            .into_response(),
        };
        let route = proxied(path).unwrap_or("other");
        shared.count_request(route, None, refusal.status().as_u16());
        if let Some(cors) = &shared.cors {
            cors.mark_for(&parts.headers, &mut refusal);
        }
        return BeforeBody::Refuse(refusal);
    }
    let Some(route) = proxied(path) else {
        // A body sent to a route that takes none is not read: its 404 or 405 comes now.
        if matches!(parts.method, Method::POST | Method::PUT | Method::PATCH) {
            let mut refusal = not_routed(&parts.method, path, allowed_methods(path, None));
            shared.count_request("other", None, refusal.status().as_u16());
            if let Some(cors) = &shared.cors {
                cors.mark_for(&parts.headers, &mut refusal);
            }
            return BeforeBody::Refuse(refusal);
        }
        return BeforeBody::Read;
    };
    if parts.method != Method::POST {
        return BeforeBody::Read;
    }
    match authenticate(shared, &parts.headers) {
        Ok(()) => BeforeBody::Read,
        Err(e) => {
            shared.count_request(route, None, e.status.as_u16());
            let mut refusal = e.into_response();
            // A browser's request: the page must be able to read its 401.
            if let Some(cors) = &shared.cors {
                cors.mark_for(&parts.headers, &mut refusal);
            }
            BeforeBody::Refuse(refusal)
        }
    }
}

/// The token of an `Authorization: Bearer TOKEN` value; the scheme's name is case-insensitive
/// (RFC 9110 §11.1), so `bearer TOKEN` is the same.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

/// Checks the Bearer key when keys are configured.
fn authenticate(shared: &Shared, headers: &http::HeaderMap) -> Result<(), ApiError> {
    let keys = &shared.api_keys;
    if keys.is_empty() {
        return Ok(());
    }
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .map(str::trim);
    match presented {
        Some(p) if keys.matches(p.as_bytes()) => Ok(()),
        Some(_) => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "incorrect API key provided",
        )),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "missing API key: send `Authorization: Bearer <key>`",
        )),
    }
}

/// Marks a request whose body its front read within the gateway's body budget itself, and
/// holds there until the answer's head is in (the HTTP/1.1 front): [`read_body`] does not
/// count it a second time.
#[derive(Debug, Clone, Copy)]
pub struct BodyHeld;

/// Reads the whole body under the size limit, the client read timeout and the budget of bodies
/// held (`max_held_body_bytes`), whose bytes the returned [`Held`] keeps until it is dropped.
async fn read_body<B>(
    shared: &Shared,
    parts: &http::request::Parts,
    body: B,
) -> Result<(Bytes, Held), ApiError>
where
    B: Body,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let limit = shared.config.max_body_bytes;
    let too_large = || ApiError::body_too_large(limit);
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let counted = parts.extensions.get::<BodyHeld>().is_none();
    let mut held = shared.bodies.hold();
    // On HTTP/2 and HTTP/3 the request's head is held with it, in the same budget.
    let head = tokenway_transport::body_budget::request_head_bytes(parts);
    if counted && !held.grow(head) {
        return Err(ApiError::bodies_held());
    }
    // A declared length that does not fit the room left is not read; it takes its bytes as
    // they arrive (a declaration alone holds nothing). A body of no declared length needs a
    // byte of room: with none left it is refused before hyper invites it (`100 Continue` goes
    // out when the body is first read).
    let need = declared.map_or(usize::from(!body.is_end_stream()), |n| n as usize);
    if counted && !held.has_room_for(need) {
        return Err(ApiError::bodies_held());
    }
    let head = if counted { head } else { 0 };
    // The client read timeout bounds each silence, not the whole upload (as on HTTP/1.1).
    let silence = shared.config.timeouts.client_read();
    let mut body = std::pin::pin!(Limited::new(body, limit));
    // Room for what was declared, up to 64 KiB: a declaration alone reserves no more.
    let mut read = bytes::BytesMut::with_capacity(declared.map_or(0, |n| n as usize).min(1 << 16));
    loop {
        match tokio::time::timeout(silence, body.frame()).await {
            Err(_) => return Err(ApiError::request_timeout()),
            Ok(None) => return Ok((read.freeze(), held)),
            Ok(Some(Err(e))) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(too_large())
            }
            Ok(Some(Err(e))) => {
                return Err(ApiError::bad_request(format!(
                    "cannot read the request body: {e}"
                )))
            }
            Ok(Some(Ok(frame))) => {
                if let Ok(mut data) = frame.into_data() {
                    use bytes::{Buf, BufMut};
                    let more = (head + read.len() + data.remaining()).saturating_sub(held.bytes());
                    if counted && !held.grow(more) {
                        return Err(ApiError::bodies_held());
                    }
                    if read.is_empty() && body.is_end_stream() {
                        // The whole body in one frame: no copy.
                        return Ok((data.copy_to_bytes(data.remaining()), held));
                    }
                    read.put(data);
                }
            }
        }
    }
}

fn route_error(shared: &Shared, e: RouteError) -> ApiError {
    match e {
        RouteError::UnknownModel { model } if !shared.models_being_discovered() => ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("the model `{model}` does not exist or no backend serves it"),
        ),
        RouteError::UnknownModel { model } => ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "no_healthy_backend",
                format!(
                    "no reachable backend serves `{model}` yet; backends still being discovered"
                ),
            )
        },
        RouteError::NoHealthyBackend { model } => ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "no_healthy_backend",
                format!("no healthy backend serves `{model}` right now"),
            )
        },
        RouteError::UnknownPolicy { given } => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            format!("routing policy {given:?} is not known"),
        ),
        RouteError::Saturated { model } => ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "backends_saturated",
                format!("every backend serving `{model}` is at its max_inflight limit"),
            )
        },
    }
}

/// Routes `request` and, unless the router says to hold it, reserves a slot of the first
/// backend under the same lock (state.rs, `Reservation`). The lock is let go before this
/// returns: it must never be held across an await.
fn route_reserving(
    shared: &Arc<Shared>,
    request: &RouteRequest,
) -> (Result<Route, RouteError>, Option<Reservation>) {
    let mut router = shared.router();
    let routed = router.route(request, Instant::now());
    let reservation = match &routed {
        Ok(Route {
            hold: None,
            backends,
            ..
        }) => backends
            .first()
            .map(|&id| Reservation::take(shared, &mut router, id)),
        _ => None,
    };
    (routed, reservation)
}

/// The 503 of a request that found every backend of `model` full and could not wait for a slot.
fn queue_refused(shared: &Shared, model: &str, refused: Refused) -> ApiError {
    let why = match refused {
        Refused::Full if shared.config.queue_max == 0 => String::new(),
        Refused::Full => format!(
            ", and {} requests already wait for a slot (queue_max)",
            shared.config.queue_max
        ),
        Refused::TimedOut => format!(
            "; no slot freed within {} ms (timeouts.queue_ms)",
            shared.config.timeouts.queue_ms
        ),
    };
    ApiError {
        retry_after: Some(1),
        ..ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "backends_saturated",
            format!("every backend serving `{model}` is at its max_inflight limit{why}"),
        )
    }
}

/// Where one model's entry is read (`GET /v1/models/{id}`, OpenAI's "retrieve model").
const MODEL_PREFIX: &str = "/v1/models/";

/// The methods `path` (proxied as `route`, if it is) allows, `None` for an unknown path.
fn allowed_methods(path: &str, route: Option<&str>) -> Option<&'static str> {
    match (path, route) {
        (_, Some(_)) => Some("POST"),
        ("/health" | "/metrics" | "/admin/backends" | "/status" | "/v1/models", _) => {
            Some("GET, HEAD")
        }
        _ if path.starts_with(MODEL_PREFIX) => Some("GET, HEAD"),
        _ => None,
    }
}

/// A request no route takes: 405 with the methods the path allows (RFC 9110 section 15.5.6),
/// or 404 for an unknown path.
fn not_routed(
    method: &Method,
    path: &str,
    allowed: Option<&'static str>,
) -> Response<ResponseBody> {
    let Some(allowed) = allowed else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "unknown_url",
            format!("unknown route {method} {path}"),
        )
        .into_response();
    };
    let mut r = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        format!("{method} is not allowed on {path}; use {allowed}"),
    )
    .into_response();
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allowed));
    r
}

/// `GET /v1/models/{id}`: the entry `/v1/models` lists for `id` (percent-decoded; ids such as
/// `meta-llama/Llama-3.1-8B` may come with their slash raw or as `%2F`), or OpenAI's 404.
fn model(shared: &Shared, raw_id: &str) -> Response<ResponseBody> {
    let id = percent_encoding::percent_decode_str(raw_id).decode_utf8_lossy();
    let entry = model_entries(shared)
        .into_iter()
        .find(|e| e.get("id").and_then(|v| v.as_str()) == Some(&*id));
    match entry {
        Some(e) => json(e.to_string()),
        None => ApiError {
            param: Some("model"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("the model `{id}` does not exist or is not served here"),
            )
        }
        .into_response(),
    }
}

/// `/v1/models`: the union of what the backends serve, first entry per id wins.
fn models(shared: &Shared) -> Response<ResponseBody> {
    let data = model_entries(shared);
    json(serde_json::json!({"object": "list", "data": data}).to_string())
}

fn model_entries(shared: &Shared) -> Vec<serde_json::Value> {
    let mut seen = std::collections::HashSet::new();
    let mut data = Vec::new();
    for (_, u) in shared.live_upstreams() {
        let entries = u
            .model_entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for e in entries {
            let id = e
                .get("id")
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_string();
            if !id.is_empty() && seen.insert(id) {
                data.push(e);
            }
        }
    }
    data
}

fn json(body: String) -> Response<ResponseBody> {
    let mut r = Response::new(full(body));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn text(status: StatusCode, body: &'static str) -> Response<ResponseBody> {
    let mut r = Response::new(full(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token("Bearer k1"), Some("k1"));
        assert_eq!(bearer_token("bearer k1"), Some("k1"));
        assert_eq!(bearer_token("BEARER k1"), Some("k1"));
        assert_eq!(bearer_token("Basic k1"), None);
        assert_eq!(bearer_token("Bearerk1"), None);
    }

    #[test]
    fn the_route_label_reads_sloppy_paths_as_the_core_does() {
        assert_eq!(route_label("/v1/chat/completions"), "/v1/chat/completions");
        assert_eq!(
            route_label("/v1//chat/completions/"),
            "/v1/chat/completions"
        );
        assert_eq!(route_label("/nothing"), "other");
    }

    #[test]
    fn cookies_sent_as_separate_fields_reach_the_backend_as_one() {
        let mut h = http::HeaderMap::new();
        h.append(header::COOKIE, HeaderValue::from_static("a=1"));
        join_cookies(&mut h);
        assert_eq!(h[header::COOKIE], "a=1");
        h.append(header::COOKIE, HeaderValue::from_static("b=2"));
        h.append(header::COOKIE, HeaderValue::from_static("c=3; d=4"));
        h.append(header::ACCEPT, HeaderValue::from_static("*/*"));
        join_cookies(&mut h);
        let all: Vec<_> = h.get_all(header::COOKIE).iter().collect();
        assert_eq!(all, ["a=1; b=2; c=3; d=4"]);
        assert_eq!(h[header::ACCEPT], "*/*");
        let mut none = http::HeaderMap::new();
        join_cookies(&mut none);
        assert!(none.is_empty());
    }
}
