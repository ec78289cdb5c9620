//! The HTTP/3 fronts: the public HTTP/3 endpoint and the edges' tunnel port.
//!
//! Both hand every request to the same request-handling core as the TCP fronts
//! ([`service::handle_request`]); the tunnel port first checks the edge's token (failures see the
//! masquerade site and are never proxied), refuses replayed idempotency keys, and serves CONNECT
//! port forwarding to allow-listed targets. Each connection and each request stream runs in its
//! own task, so garbage datagrams, half-open handshakes and slow streams never hold up others.
//!
//! Every response stream gets a priority class (ARCHITECTURE, "The tunnel, layer by layer",
//! item 1) before its head is sent; see [`response_priority`].

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use h3::quic::StreamId;
use h3::server::RequestStream;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokenway_transport::h3_quinn_prio::{self, Priority, PriorityMap, BULK_BODY_BYTES};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::error::{ApiError, ResponseBody};
use crate::proxy::is_event_stream;
use crate::service::{self, Transport};
use crate::state::Shared;

/// Largest request head accepted, as on the HTTP/1.1 front: the field section's size
/// (RFC 9114 section 4.2.2, advertised in SETTINGS) and the largest HEADERS frame buffered; a
/// frame announcing more closes the connection with H3_EXCESSIVE_LOAD before its payload is
/// read.
const MAX_HEAD_BYTES: u64 = 64 * 1024;

type SendHalf = RequestStream<h3_quinn_prio::SendStream<Bytes>, Bytes>;
type RecvHalf = RequestStream<h3_quinn_prio::RecvStream, Bytes>;

/// Which HTTP/3 front an endpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Front {
    /// The public HTTP/3 API front.
    Public,
    /// The authenticated tunnel port.
    Tunnel,
}

impl Front {
    /// The metric label of this front.
    pub fn label(self) -> &'static str {
        match self {
            Front::Public => "h3",
            Front::Tunnel => "tunnel",
        }
    }
}

/// Accepts connections on `endpoint` until `stop` fires, then drains: new connections are
/// refused, every open one is sent GOAWAY (its client opens no new request on it), and the
/// requests in flight get up to `drain` to finish before the endpoint closes, as the TCP fronts'
/// connections do.
pub async fn serve(
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    front: Front,
    stop: watch::Receiver<bool>,
    drain: Duration,
) {
    // Every request stream in flight holds a receiver; `closed()` resolves when none is left.
    let (open, _) = watch::channel(());
    let open = Arc::new(open);
    let mut stopping = stop.clone();
    // `max_connections` open at once on this front; a connection attempt past it is refused
    // at once (a QUIC server has no accept queue to leave it in), before any handshake work.
    let slots = Arc::new(tokio::sync::Semaphore::new(shared.config.max_connections));
    loop {
        let incoming = tokio::select! {
            i = endpoint.accept() => match i { Some(i) => i, None => break },
            _ = stopping.changed() => break,
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!(
                front = front.label(),
                "max_connections reached: refusing a QUIC connection"
            );
            incoming.refuse();
            continue;
        };
        let shared = shared.clone();
        let (stop, open) = (stop.clone(), open.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(incoming, shared, front, stop, open).await {
                tracing::debug!(error = %e, "HTTP/3 connection ended");
            }
            drop(slot);
        });
    }
    endpoint.set_server_config(None);
    if tokio::time::timeout(drain, open.closed()).await.is_err() {
        tracing::info!(
            front = front.label(),
            "HTTP/3 requests still open after the drain period; closing them"
        );
    }
    endpoint.close(quinn::VarInt::from_u32(0), b"");
    let _ = tokio::time::timeout(Duration::from_secs(2), endpoint.wait_idle()).await;
}

async fn connection(
    incoming: quinn::Incoming,
    shared: Arc<Shared>,
    front: Front,
    mut stop: watch::Receiver<bool>,
    open: Arc<watch::Sender<()>>,
) -> Result<(), String> {
    let remote = incoming.remote_address();
    let connecting = incoming.accept().map_err(|e| e.to_string())?;
    // Accepting 0-RTT lets a resumed edge's first request start before the handshake ends; the
    // idempotency window makes a replayed one harmless.
    let conn = if shared.config.quic.zero_rtt {
        match connecting.into_0rtt() {
            Ok((conn, _accepted)) => conn,
            Err(connecting) => connecting.await.map_err(|e| e.to_string())?,
        }
    } else {
        connecting.await.map_err(|e| e.to_string())?
    };
    tokio::spawn(tokenway_transport::stats::sample_connection(
        conn.clone(),
        front.label().to_string(),
        shared.quic_metrics.clone(),
        Duration::from_secs(1),
        // Every connection of the front shares the label: no per-connection gauges.
        tokenway_transport::stats::Sampled::Shared,
    ));
    // The datagram layer's FEC flush delay follows this connection's RTT (tunnel port with
    // `[tunnel.datagram]` only; the config's settings share the endpoint's layer slot).
    if front == Front::Tunnel {
        if let Some(d) = shared
            .config
            .tunnel
            .as_ref()
            .and_then(|t| t.datagram.as_ref())
        {
            d.layer.follow_rtt(&conn);
        }
    }
    // The connection, to reach its brutal rate handle (tunnel port with `[tunnel.datagram]`
    // and `cc = "brutal"` only): looked up per request, not kept, since quinn builds a new
    // controller (and handle) when a migration resets the path, and the edge's next request
    // must reach that one.
    let rate = tokenway_transport::cc::rate_handle(&conn)
        .is_some_and(|h| h.negotiates())
        .then(|| conn.clone());
    let h3_conn = h3_quinn_prio::Connection::new(conn);
    let priorities = h3_conn.priorities();
    let mut h3 = h3::server::builder()
        .enable_extended_connect(false)
        .max_field_section_size(MAX_HEAD_BYTES)
        .build::<_, Bytes>(h3_conn)
        .await
        .map_err(|e| e.to_string())?;
    // At shutdown, GOAWAY: the requests accepted so far are served, later ones refused, and
    // once they are done (their answers acknowledged) the connection closes, so that its
    // client dials afresh instead of finding it refusing. Each request task holds a receiver
    // of `requests`.
    let (requests, _) = watch::channel(());
    let mut closing = *stop.borrow();
    if closing {
        let _ = h3.shutdown(1).await;
    }
    loop {
        let accepted = if closing {
            tokio::select! {
                a = h3.accept() => a,
                // Dropping `h3` closes the connection (H3_NO_ERROR).
                () = requests.closed() => return Ok(()),
            }
        } else {
            tokio::select! {
                a = h3.accept() => a,
                _ = stop.changed() => {
                    closing = true;
                    let _ = h3.shutdown(1).await;
                    continue;
                }
            }
        };
        match accepted {
            Ok(Some(resolver)) => {
                let shared = shared.clone();
                let priorities = priorities.clone();
                let rate = rate.clone();
                let in_flight = (open.subscribe(), requests.subscribe());
                tokio::spawn(async move {
                    let _in_flight = in_flight;
                    // A stream that never completes its head holds no task past the client read
                    // timeout (dropping the resolver stops the stream).
                    let head = tokio::time::timeout(
                        shared.config.timeouts.client_read(),
                        resolver.resolve_request(),
                    )
                    .await;
                    match head {
                        Ok(Ok((req, stream))) => {
                            let prio = StreamPriority {
                                map: priorities,
                                id: stream.id(),
                            };
                            request(req, stream, prio, shared, front, remote, rate).await
                        }
                        Ok(Err(e)) => tracing::debug!(%remote, error = %e, "bad HTTP/3 request"),
                        Err(_) => {
                            tracing::debug!(%remote, "HTTP/3 request head not complete in time")
                        }
                    }
                });
            }
            Ok(None) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Where to set the priority of one request's response stream.
struct StreamPriority {
    map: PriorityMap,
    id: StreamId,
}

impl StreamPriority {
    fn set(&self, priority: Priority) {
        self.map.set(self.id, priority);
    }

    /// Completes when the client stops the response stream or the connection is gone.
    fn stopped(&self) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        self.map.stopped(self.id)
    }
}

/// The class of a response stream as far as the request head decides it: control endpoints and
/// port forwarding first, long prompts' answers (request body over [`BULK_BODY_BYTES`]) last.
/// `None` leaves it to [`response_priority`].
fn request_priority(parts: &http::request::Parts) -> Option<Priority> {
    let path = parts.uri.path();
    if parts.method == Method::CONNECT || matches!(path, "/health" | "/metrics" | "/v1/models") {
        Some(Priority::Control)
    } else if content_length(&parts.headers) > BULK_BODY_BYTES {
        Some(Priority::Bulk)
    } else {
        None
    }
}

/// The class of any other response stream: Server-Sent-Events token streams and bodies known
/// to be short are interactive, every other non-streaming body is bulk.
fn response_priority(response: &Response<ResponseBody>) -> Priority {
    let short = response
        .body()
        .size_hint()
        .upper()
        .is_some_and(|n| n <= BULK_BODY_BYTES);
    if is_event_stream(response.headers()) || short {
        Priority::Interactive
    } else {
        Priority::Bulk
    }
}

/// The request's declared `Content-Length` (0 when absent or unreadable).
fn content_length(headers: &HeaderMap) -> u64 {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

async fn request(
    req: Request<()>,
    stream: RequestStream<h3_quinn_prio::BidiStream<Bytes>, Bytes>,
    prio: StreamPriority,
    shared: Arc<Shared>,
    front: Front,
    remote: SocketAddr,
    rate: Option<quinn::Connection>,
) {
    let (mut send, recv) = stream.split();
    let (mut parts, ()) = req.into_parts();
    // A tunnel request, noted as running until it ends, so that a retry can stop it.
    let mut running = None;
    let transport = match front {
        Front::Public => Transport::H3,
        Front::Tunnel => {
            let Some(tunnel) = shared.tunnel.as_ref() else {
                return;
            };
            if !tunnel.is_authenticated(&parts.headers) {
                tracing::debug!(%remote, "unauthenticated tunnel request: masquerade");
                let req = Request::from_parts(parts, ());
                let resp = Box::pin(tunnel.masquerade.respond(&req, &shared.client)).await;
                write_response(
                    &mut send,
                    resp,
                    req.method() == Method::HEAD,
                    shared.config.timeouts.client_write(),
                )
                .await;
                return;
            }
            match tunnel.admit(&mut parts.headers, Instant::now()) {
                Ok(key) => running = tunnel.run(key),
                Err(e) => {
                    write_error(&mut send, e, &shared).await;
                    return;
                }
            }
            // Hysteria-2-style rate negotiation: brutal at min(edge `tw-rx-rate`, our
            // `bandwidth.up`) when `[tunnel.datagram] cc = "brutal"`; the header is consumed.
            if let Some(rate) = rate.as_ref().and_then(tokenway_transport::cc::rate_handle) {
                rate.apply_peer_rx_rate(&mut parts.headers);
            }
            Transport::Tunnel
        }
    };
    let class = request_priority(&parts);
    if parts.method == Method::CONNECT {
        prio.set(Priority::Control);
        Box::pin(forward(parts, send, recv, &shared, front)).await;
        return;
    }
    let head = parts.method == Method::HEAD;
    let req = Request::from_parts(parts, H3Body { recv });
    let stopped = prio.stopped();
    let stall = shared.config.timeouts.client_write();
    let rx_rate = (transport == Transport::Tunnel).then(|| own_rx_rate(&shared));
    let serve = async {
        // Boxed, like the other large futures here: the task spawned per request stays small, so
        // tokio does not copy kilobytes of future state into the task and out again.
        let mut resp = Box::pin(service::handle_request(shared, req, transport, remote)).await;
        if let Some(rx_rate) = rx_rate {
            advertise_rx_rate(resp.headers_mut(), rx_rate);
        }
        prio.set(class.unwrap_or_else(|| response_priority(&resp)));
        write_response(&mut send, resp, head, stall).await
    };
    // A retry of this request from its edge (whose QUIC path went silent) stops it: dropping
    // `serve` cancels it upstream, as a client leaving does.
    let serve = async {
        let superseded = async {
            match &running {
                Some(r) => r.superseded().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            finished = serve => finished,
            () = superseded => {
                tracing::debug!(%remote, "tunnel request superseded by its retry; cancelled");
                false
            }
        }
    };
    // A client that cancels (STOP_SENDING, which dropping a stream sends) or whose connection
    // closes cancels the request at once, as on the TCP fronts: dropping `serve` drops the
    // upstream request and frees its backend slot. Waiting for a write to fail would hold the
    // backend through queueing, prefill and a whole non-streaming answer.
    match stopped {
        Some(stopped) => {
            tokio::pin!(stopped);
            tokio::select! {
                finished = serve => {
                    // Done once the client has acknowledged the whole answer (`stopped` then
                    // resolves), bounded like a stalled reader: the request counts as in
                    // flight until then, so a shutdown's drain does not close the connection
                    // (which abandons data not yet delivered) under its last bytes. A reset
                    // stream has nothing left to deliver (and `stopped` would not resolve).
                    if finished {
                        let _ = tokio::time::timeout(stall, &mut stopped).await;
                    }
                }
                () = &mut stopped => {
                    tracing::debug!(%remote, "HTTP/3 client left; request cancelled");
                }
            }
        }
        None => {
            serve.await;
        }
    }
}

/// Puts this gateway's receive rate (`[tunnel.datagram] bandwidth.down`, when set) on an
/// authenticated tunnel answer, for the edge's brutal rate (`tokenway_transport::cc`,
/// "Negotiation"), in place of any header of that name a backend's answer carried: a backend
/// must not set how fast the edge sends.
fn advertise_rx_rate(headers: &mut HeaderMap, rx_rate: Option<u64>) {
    headers.remove(tokenway_transport::cc::RX_RATE_HEADER);
    if let Some(rate) = rx_rate {
        headers.insert(
            tokenway_transport::cc::RX_RATE_HEADER,
            http::HeaderValue::from(rate),
        );
    }
}

/// This gateway's receive rate, bytes per second (`[tunnel.datagram] bandwidth.down`).
fn own_rx_rate(shared: &Shared) -> Option<u64> {
    shared
        .config
        .tunnel
        .as_ref()
        .and_then(|t| t.datagram.as_ref())
        .and_then(|d| d.bandwidth.down)
        .map(|b| b.bytes_per_sec())
}

/// Sends one of the gateway's own error answers.
async fn write_error(send: &mut SendHalf, e: ApiError, shared: &Shared) {
    let stall = shared.config.timeouts.client_write();
    write_response(send, e.into_response(), false, stall).await;
}

/// Sends a response head and streams its body, frame by frame. A client that leaves the
/// stream's flow-control window full for `stall` (it reads nothing, while its connection stays
/// alive) has its stream reset, as the TCP fronts close such a connection (`client_write_ms`):
/// else it would hold its backend slot, and the backend's output, as long as it liked.
///
/// Returns whether the whole response went out and the stream was finished (not reset or
/// failed).
async fn write_response(
    send: &mut SendHalf,
    resp: Response<ResponseBody>,
    head_only: bool,
    stall: Duration,
) -> bool {
    let (parts, mut body) = resp.into_parts();
    let stalled = |send: &mut SendHalf| {
        tracing::debug!(
            stall_ms = stall.as_millis() as u64,
            "HTTP/3 client read nothing; resetting its stream"
        );
        send.stop_stream(h3::error::Code::H3_REQUEST_CANCELLED);
        false
    };
    match tokio::time::timeout(stall, send.send_response(Response::from_parts(parts, ()))).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) => return false,
        Err(_) => return stalled(send),
    }
    if !head_only {
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    if let Ok(data) = frame.into_data() {
                        match tokio::time::timeout(stall, send.send_data(data)).await {
                            Ok(Ok(())) => {}
                            Ok(Err(_)) => return false,
                            Err(_) => return stalled(send),
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "response body failed; resetting the stream");
                    send.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
                    return false;
                }
            }
        }
    }
    matches!(tokio::time::timeout(stall, send.finish()).await, Ok(Ok(())))
}

/// CONNECT: relays bytes between the stream and an allow-listed TCP target.
async fn forward(
    parts: http::request::Parts,
    mut send: SendHalf,
    mut recv: RecvHalf,
    shared: &Shared,
    front: Front,
) {
    let target = parts.uri.authority().map(|a| a.as_str().to_string());
    let allowed = match (front, &shared.tunnel, &target) {
        (Front::Tunnel, Some(t), Some(target)) => t.may_forward_to(target),
        _ => false,
    };
    let Some(target) = target.filter(|_| allowed) else {
        let e = ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            "forward_not_allowed",
            "this target is not in the gateway's forward_allow list",
        );
        write_error(&mut send, e, shared).await;
        return;
    };
    let connect = tokio::time::timeout(
        shared.config.timeouts.connect(),
        TcpStream::connect(&target),
    )
    .await;
    let mut tcp = match connect {
        Ok(Ok(s)) => s,
        _ => {
            let e = ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "forward_unreachable",
                format!("cannot connect to {target}"),
            );
            write_error(&mut send, e, shared).await;
            return;
        }
    };
    let _ = tcp.set_nodelay(true);
    let mut ok = Response::new(());
    if front == Front::Tunnel {
        advertise_rx_rate(ok.headers_mut(), own_rx_rate(shared));
    }
    if send.send_response(ok).await.is_err() {
        return;
    }
    let write_deadline = shared.config.timeouts.client_write();
    let clean = {
        let (mut tcp_read, mut tcp_write) = tcp.split();
        // Each direction says whether it ended cleanly: a FIN passed on as a FIN. A reset, a
        // read error or a write that stalls past `client_write_ms` is not, and ends both.
        let upstream = async {
            loop {
                match recv.recv_data().await {
                    Ok(Some(mut chunk)) => {
                        let bytes = chunk.copy_to_bytes(chunk.remaining());
                        let wrote =
                            tokio::time::timeout(write_deadline, tcp_write.write_all(&bytes)).await;
                        if !matches!(wrote, Ok(Ok(()))) {
                            return false;
                        }
                    }
                    Ok(None) => return tcp_write.shutdown().await.is_ok(),
                    Err(_) => return false,
                }
            }
        };
        let downstream = async {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                match tcp_read.read(&mut buf).await {
                    Ok(0) => return send.finish().await.is_ok(),
                    Err(_) => return false,
                    Ok(n) => {
                        let data = Bytes::copy_from_slice(&buf[..n]);
                        let sent = tokio::time::timeout(write_deadline, send.send_data(data)).await;
                        if !matches!(sent, Ok(Ok(()))) {
                            return false;
                        }
                    }
                }
            }
        };
        tokio::pin!(upstream, downstream);
        tokio::select! {
            up = &mut upstream => up && downstream.await,
            down = &mut downstream => down && upstream.await,
        }
    };
    if !clean {
        // Whoever is still there learns of the break: the edge by a reset stream (not a FIN
        // that would make a cut download look complete), the target by a TCP reset.
        send.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
        recv.stop_sending(h3::error::Code::H3_INTERNAL_ERROR);
        let _ = tcp.set_zero_linger();
    }
}

/// A request body read from an HTTP/3 stream.
pub struct H3Body {
    recv: RecvHalf,
}

impl Body for H3Body {
    type Data = Bytes;
    type Error = h3::error::StreamError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.recv.poll_recv_data(cx) {
            Poll::Ready(Ok(Some(mut buf))) => {
                let bytes = buf.copy_to_bytes(buf.remaining());
                Poll::Ready(Some(Ok(Frame::data(bytes))))
            }
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(method: Method, path: &str, content_length: Option<u64>) -> http::request::Parts {
        let mut req = Request::builder().method(method).uri(path);
        if let Some(n) = content_length {
            req = req.header(http::header::CONTENT_LENGTH, n);
        }
        req.body(()).expect("valid request").into_parts().0
    }

    fn response(content_type: &str, body: ResponseBody) -> Response<ResponseBody> {
        Response::builder()
            .header(http::header::CONTENT_TYPE, content_type)
            .body(body)
            .expect("valid response")
    }

    fn unknown_length() -> ResponseBody {
        let chunks = futures_util::stream::iter([Ok::<_, crate::error::BoxError>(Frame::data(
            Bytes::from_static(b"x"),
        ))]);
        http_body_util::StreamBody::new(chunks).boxed()
    }

    #[test]
    fn control_endpoints_and_connect_are_control() {
        for path in ["/health", "/metrics", "/v1/models"] {
            assert_eq!(
                request_priority(&head(Method::GET, path, None)),
                Some(Priority::Control)
            );
        }
        let connect = Request::builder()
            .method(Method::CONNECT)
            .uri("db.internal:5432")
            .body(())
            .expect("valid request")
            .into_parts()
            .0;
        assert_eq!(request_priority(&connect), Some(Priority::Control));
    }

    #[test]
    fn long_prompts_are_bulk_and_others_wait_for_the_response() {
        let big = BULK_BODY_BYTES + 1;
        let path = "/v1/chat/completions";
        assert_eq!(
            request_priority(&head(Method::POST, path, Some(big))),
            Some(Priority::Bulk)
        );
        assert_eq!(request_priority(&head(Method::POST, path, Some(100))), None);
    }

    #[test]
    fn event_streams_and_short_bodies_are_interactive_other_bodies_bulk() {
        let sse = response("text/event-stream", unknown_length());
        assert_eq!(response_priority(&sse), Priority::Interactive);
        let short = response("application/json", crate::error::full("{}"));
        assert_eq!(response_priority(&short), Priority::Interactive);
        let unknown = response("application/json", unknown_length());
        assert_eq!(response_priority(&unknown), Priority::Bulk);
    }
}
