//! The HTTP/3 fronts: the public HTTP/3 endpoint and the edges' tunnel port.
//!
//! Both hand every request to the same request-handling core as the TCP fronts
//! ([`service::handle_request`]); the tunnel port first checks the edge's token (failures see the
//! masquerade site and are never proxied), refuses replayed idempotency keys, and serves CONNECT
//! port forwarding to allow-listed targets. Each connection and each request stream runs in its
//! own task, so garbage datagrams, half-open handshakes and slow streams never hold up others.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use h3::server::RequestStream;
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::error::{ApiError, ResponseBody};
use crate::service::{self, Transport};
use crate::state::Shared;

type SendHalf = RequestStream<h3_quinn::SendStream<Bytes>, Bytes>;
type RecvHalf = RequestStream<h3_quinn::RecvStream, Bytes>;

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

/// Accepts connections on `endpoint` until `stop` fires.
pub async fn serve(
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    front: Front,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let incoming = tokio::select! {
            i = endpoint.accept() => match i { Some(i) => i, None => break },
            _ = stop.changed() => break,
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(incoming, shared, front).await {
                tracing::debug!(error = %e, "HTTP/3 connection ended");
            }
        });
    }
    endpoint.close(quinn::VarInt::from_u32(0), b"");
    let _ = tokio::time::timeout(Duration::from_secs(2), endpoint.wait_idle()).await;
}

async fn connection(
    incoming: quinn::Incoming,
    shared: Arc<Shared>,
    front: Front,
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
    ));
    let mut h3 = h3::server::builder()
        .enable_extended_connect(false)
        .build::<_, Bytes>(h3_quinn::Connection::new(conn))
        .await
        .map_err(|e| e.to_string())?;
    loop {
        match h3.accept().await {
            Ok(Some(resolver)) => {
                let shared = shared.clone();
                tokio::spawn(async move {
                    match resolver.resolve_request().await {
                        Ok((req, stream)) => request(req, stream, shared, front, remote).await,
                        Err(e) => tracing::debug!(%remote, error = %e, "bad HTTP/3 request"),
                    }
                });
            }
            Ok(None) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
    }
}

async fn request(
    req: Request<()>,
    stream: RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>,
    shared: Arc<Shared>,
    front: Front,
    remote: SocketAddr,
) {
    let (mut send, recv) = stream.split();
    let (mut parts, ()) = req.into_parts();
    let transport = match front {
        Front::Public => Transport::H3,
        Front::Tunnel => {
            let Some(tunnel) = shared.tunnel.as_ref() else {
                return;
            };
            if !tunnel.is_authenticated(&parts.headers) {
                tracing::debug!(%remote, "unauthenticated tunnel request: masquerade");
                let req = Request::from_parts(parts, ());
                let resp = tunnel.masquerade.respond(&req, &shared.client).await;
                write_response(&mut send, resp, req.method() == Method::HEAD).await;
                return;
            }
            if let Err(e) = tunnel.admit(&mut parts.headers, Instant::now()) {
                write_response(&mut send, e.into_response(), false).await;
                return;
            }
            Transport::Tunnel
        }
    };
    if parts.method == Method::CONNECT {
        forward(parts, send, recv, &shared, front).await;
        return;
    }
    let head = parts.method == Method::HEAD;
    let req = Request::from_parts(parts, H3Body { recv });
    let resp = service::handle_request(shared, req, transport).await;
    write_response(&mut send, resp, head).await;
}

/// Sends a response head and streams its body, frame by frame.
async fn write_response(send: &mut SendHalf, resp: Response<ResponseBody>, head_only: bool) {
    let (parts, mut body) = resp.into_parts();
    if send
        .send_response(Response::from_parts(parts, ()))
        .await
        .is_err()
    {
        return;
    }
    if !head_only {
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    if let Ok(data) = frame.into_data() {
                        if send.send_data(data).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "response body failed; resetting the stream");
                    send.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
                    return;
                }
            }
        }
    }
    let _ = send.finish().await;
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
        write_response(&mut send, e.into_response(), false).await;
        return;
    };
    let connect = tokio::time::timeout(
        shared.config.timeouts.connect(),
        TcpStream::connect(&target),
    )
    .await;
    let tcp = match connect {
        Ok(Ok(s)) => s,
        _ => {
            let e = ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "forward_unreachable",
                format!("cannot connect to {target}"),
            );
            write_response(&mut send, e.into_response(), false).await;
            return;
        }
    };
    let _ = tcp.set_nodelay(true);
    if send.send_response(Response::new(())).await.is_err() {
        return;
    }
    let (mut tcp_read, mut tcp_write) = tcp.into_split();
    let upstream = async {
        while let Ok(Some(mut chunk)) = recv.recv_data().await {
            let bytes = chunk.copy_to_bytes(chunk.remaining());
            if tcp_write.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = tcp_write.shutdown().await;
    };
    let downstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match tcp_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if send
                        .send_data(Bytes::copy_from_slice(&buf[..n]))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        let _ = send.finish().await;
    };
    tokio::join!(upstream, downstream);
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
