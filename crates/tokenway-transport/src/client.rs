//! An HTTP/3 client connection to one gateway (`h3` over `quinn`).
//!
//! Requests stream both ways: the request body is written to the QUIC stream as it is read,
//! and every response DATA frame is handed on as it arrives. Nothing is buffered here.
//!
//! 0-RTT: when the gateway's rustls configuration holds a resumption ticket from it, the
//! connection is used at once (`Connecting::into_0rtt`) and the first requests travel as early
//! data. If the server rejects the early data, quinn discards every stream opened so far and
//! restarts stream numbering; the HTTP/3 session is then rebuilt on the same (now 1-RTT)
//! connection, and requests that were in flight fail with a retryable error. A 0-RTT connection
//! whose handshake does not finish within the connect timeout is closed, so a path that stopped
//! carrying UDP is given up instead of swallowing requests. Until its handshake completes such a
//! connection is usable but not established ([`QuicClient::established`]): nothing has come
//! back from the gateway yet.
//!
//! Priority: a request whose body is known to exceed [`BULK_BODY_BYTES`] is uploaded as
//! [`Priority::Bulk`], every other one as [`Priority::Interactive`], so a short message is not
//! queued behind a long prompt on the same connection.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::{Request, Response, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use tokenway_telemetry::quic::{ConnectLabels, QuicMetrics};
use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::error::TransportError;
use crate::h3_quinn_prio::{self, Priority, PriorityMap, BULK_BODY_BYTES};
use crate::settings::QuicSettings;

/// A boxed error of a body or request.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The streaming response body every client hands back.
pub type ClientBody = UnsyncBoxBody<Bytes, BoxError>;

type H3Sender = h3::client::SendRequest<h3_quinn_prio::OpenStreams, Bytes>;

/// Largest response head accepted (field section size, RFC 9114 section 4.2.2), as the
/// gateway's HTTP/3 fronts accept for request heads.
const MAX_RESPONSE_HEAD_BYTES: u64 = 64 * 1024;

/// One HTTP/3 session on the QUIC connection: its request sender and its streams' priorities.
#[derive(Clone)]
struct Session {
    sender: H3Sender,
    priorities: PriorityMap,
}

/// A request that failed before its response head arrived.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// What went wrong.
    pub message: String,
    /// The request was not processed by the server (the connection died, or 0-RTT data was
    /// rejected), so it may be sent again, on a fresh connection when this one is closed.
    pub retryable: bool,
    /// The request's head is larger than the server accepts (its
    /// `SETTINGS_MAX_FIELD_SECTION_SIZE`): the request's own fault, the same anywhere, and
    /// nothing was sent.
    pub head_too_large: bool,
}

impl RequestError {
    pub(crate) fn new(message: impl Into<String>, retryable: bool) -> Self {
        Self {
            message: message.into(),
            retryable,
            head_too_large: false,
        }
    }
}

/// How a request that got no response head failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failed {
    /// Not processed by the server: may be sent again.
    Unprocessed,
    /// Maybe processed: not sent again.
    Final,
    /// Its head is over the server's limit; never sent.
    HeadTooLarge,
}

/// Where the 0-RTT attempt of a connection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroRtt {
    /// The connection did a full handshake.
    NotUsed,
    /// Early data sent; the handshake has not finished.
    Pending,
    /// The server accepted the early data.
    Accepted,
    /// The server rejected the early data (requests sent as early data were not processed).
    Rejected,
    /// The handshake never completed (it timed out, or the connection was closed first): the
    /// gateway was not reached, and requests sent as early data were not processed.
    /// [`QuicClient::handshake_error`] tells why.
    Failed,
}

/// What [`QuicClient::connect`] needs.
pub struct QuicConnect<'a> {
    /// The client endpoint (shared by every connection so a rebind migrates them all).
    pub endpoint: &'a quinn::Endpoint,
    /// The gateway's tunnel (UDP) address.
    pub addr: SocketAddr,
    /// The TLS server name (SNI).
    pub server_name: &'a str,
    /// The rustls client configuration, offering ALPN h3, reused across connections.
    pub tls: Arc<rustls::ClientConfig>,
    /// QUIC settings.
    pub settings: &'a QuicSettings,
    /// The last RTT measured to this gateway, seeding the new connection's estimate.
    pub initial_rtt: Option<Duration>,
    /// The peer's name, for metric labels.
    pub peer: &'a str,
    /// Metrics to update (0-RTT outcomes, connection statistics).
    pub metrics: Option<QuicMetrics>,
    /// Longest wait for the handshake.
    pub timeout: Duration,
}

struct Inner {
    conn: quinn::Connection,
    server_name: String,
    session: Mutex<Session>,
    /// Sessions abandoned after a 0-RTT rejection: dropping the last sender of a session closes
    /// the QUIC connection, so they live as long as the client.
    retired: Mutex<Vec<Session>>,
    driver: Mutex<AbortHandle>,
    zero_rtt: watch::Receiver<ZeroRtt>,
    /// Why the handshake of a 0-RTT connection did not complete ([`ZeroRtt::Failed`]); set
    /// before the verdict is sent.
    handshake_error: Mutex<Option<String>>,
    /// The gateway sent GOAWAY (it is shutting down), or the connection was set aside: no new
    /// request goes on this connection.
    draining: AtomicBool,
    /// Set aside ([`QuicClient::set_aside`]): requests still waiting for their answer's head
    /// leave it.
    aside: watch::Sender<bool>,
}

impl Drop for Inner {
    /// Closes the connection with H3_NO_ERROR before the HTTP/3 driver stops, rather than
    /// leaving the close to the driver's reaction to its last sender going (which races the
    /// abort) or to the last handle's drop: the metrics sampler and the datagram layer's RTT
    /// follower hold handles too, and end on the close (the sampler counting the last second).
    fn drop(&mut self) {
        self.conn
            .close(quinn::VarInt::from_u32(H3_NO_ERROR), b"client done");
        lock(&self.driver).abort();
    }
}

/// HTTP/3's code for a connection closed without error (RFC 9114, section 8.1).
const H3_NO_ERROR: u32 = 0x100;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One HTTP/3 connection to a gateway. Cheap to share behind an `Arc`.
pub struct QuicClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for QuicClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicClient")
            .field("peer", &self.inner.conn.remote_address())
            .finish()
    }
}

async fn start_h3(conn: &quinn::Connection) -> Result<(AbortHandle, Session), String> {
    let h3_conn = h3_quinn_prio::Connection::new(conn.clone());
    let priorities = h3_conn.priorities();
    let (mut driver, sender) = h3::client::builder()
        .send_grease(false)
        // A response head is never buffered beyond this (vendor/README.md, "Bounded frame
        // buffering"); the gateway's are a few hundred bytes.
        .max_field_section_size(MAX_RESPONSE_HEAD_BYTES)
        .build::<_, _, Bytes>(h3_conn)
        .await
        .map_err(|e| format!("HTTP/3 setup failed: {e}"))?;
    let task = tokio::spawn(async move {
        let e = driver.wait_idle().await;
        tracing::debug!(error = %e, "HTTP/3 connection ended");
    });
    Ok((task.abort_handle(), Session { sender, priorities }))
}

impl QuicClient {
    /// Connects, sending early data when a resumption ticket allows it.
    pub async fn connect(p: QuicConnect<'_>) -> Result<Self, TransportError> {
        let addr = p.addr;
        let err = |message: String| TransportError::Connect { addr, message };
        let config = crate::endpoint::client_config(p.tls, p.settings, p.initial_rtt)?;
        let connecting = p
            .endpoint
            .connect_with(config, addr, p.server_name)
            .map_err(|e| err(e.to_string()))?;
        let (zero_tx, zero_rx) = watch::channel(ZeroRtt::NotUsed);
        let (conn, accepted) = match (p.settings.zero_rtt, connecting) {
            (true, connecting) => match connecting.into_0rtt() {
                Ok((conn, accepted)) => {
                    let _ = zero_tx.send(ZeroRtt::Pending);
                    (conn, Some(accepted))
                }
                Err(connecting) => (handshake(connecting, p.timeout, addr).await?, None),
            },
            (false, connecting) => (handshake(connecting, p.timeout, addr).await?, None),
        };
        let (driver, session) = start_h3(&conn).await.map_err(err)?;
        // The datagram layer's FEC flush delay follows this connection's RTT.
        if let Some(d) = &p.settings.datagram {
            d.layer.follow_rtt(&conn);
        }
        if let Some(m) = &p.metrics {
            tokio::spawn(crate::stats::sample_connection(
                conn.clone(),
                p.peer.to_string(),
                m.clone(),
                Duration::from_secs(1),
                crate::stats::Sampled::Connection,
            ));
        }
        let inner = Arc::new(Inner {
            conn: conn.clone(),
            server_name: p.server_name.to_string(),
            session: Mutex::new(session),
            retired: Mutex::new(Vec::new()),
            driver: Mutex::new(driver),
            zero_rtt: zero_rx,
            handshake_error: Mutex::new(None),
            draining: AtomicBool::new(false),
            aside: watch::Sender::new(false),
        });
        let count_connection = |metrics: &Option<QuicMetrics>, peer: &str| {
            if let Some(m) = metrics {
                m.connections
                    .get_or_create(&ConnectLabels {
                        peer: peer.to_string(),
                        transport: "quic".into(),
                    })
                    .inc();
            }
        };
        if accepted.is_none() {
            count_connection(&p.metrics, p.peer);
        }
        if let Some(accepted) = accepted {
            let weak = Arc::downgrade(&inner);
            let metrics = p.metrics.clone();
            let peer = p.peer.to_string();
            let timeout = p.timeout;
            tokio::spawn(async move {
                // A 0-RTT connection is usable at once but not established: it counts as a
                // connection only once the handshake completes.
                let verdict = match tokio::time::timeout(timeout, accepted).await {
                    Err(_) => {
                        conn.close(0u32.into(), b"handshake timeout");
                        Err(format!(
                            "QUIC handshake with {addr} did not finish within {timeout:?} \
                             (the gateway is down or UDP does not get through)"
                        ))
                    }
                    Ok(ok) => match conn.close_reason() {
                        Some(reason) => Err(format!("QUIC handshake with {addr} failed: {reason}")),
                        None => Ok(ok),
                    },
                };
                let ok = match verdict {
                    Err(message) => {
                        if let Some(inner) = weak.upgrade() {
                            *lock(&inner.handshake_error) = Some(message);
                        }
                        let _ = zero_tx.send(ZeroRtt::Failed);
                        return;
                    }
                    Ok(ok) => ok,
                };
                count_connection(&metrics, &peer);
                if let Some(m) = &metrics {
                    m.zero_rtt_result(ok);
                }
                if !ok {
                    tracing::debug!(%addr, "0-RTT rejected; restarting HTTP/3 on the 1-RTT connection");
                    if let Some(inner) = weak.upgrade() {
                        lock(&inner.driver).abort();
                        match start_h3(&conn).await {
                            Ok((driver, session)) => {
                                *lock(&inner.driver) = driver;
                                let old = std::mem::replace(&mut *lock(&inner.session), session);
                                lock(&inner.retired).push(old);
                            }
                            Err(e) => {
                                tracing::info!(%addr, error = %e, "cannot restart HTTP/3 after a 0-RTT rejection");
                                conn.close(0u32.into(), b"");
                            }
                        }
                    }
                }
                let _ = zero_tx.send(if ok {
                    ZeroRtt::Accepted
                } else {
                    ZeroRtt::Rejected
                });
            });
        }
        Ok(Self { inner })
    }

    /// The underlying QUIC connection (statistics, RTT, close reason).
    pub fn connection(&self) -> &quinn::Connection {
        &self.inner.conn
    }

    /// The current RTT estimate.
    pub fn rtt(&self) -> Duration {
        self.inner.conn.rtt()
    }

    /// Whether the connection has closed (for any reason), or takes no new request because
    /// the gateway sent GOAWAY: either way a new request needs a new connection.
    pub fn is_closed(&self) -> bool {
        self.inner.conn.close_reason().is_some() || self.inner.draining.load(Ordering::Relaxed)
    }

    /// Why the handshake of a 0-RTT connection did not complete, once it is known
    /// ([`ZeroRtt::Failed`]); `None` while it is pending or when it completed.
    pub fn handshake_error(&self) -> Option<String> {
        lock(&self.inner.handshake_error).clone()
    }

    /// What a request sent as early data is told when its data was not processed.
    fn early_data_lost(&self) -> String {
        match self.handshake_error() {
            Some(why) => format!("0-RTT early data was not processed: {why}"),
            None => "0-RTT early data was rejected".to_string(),
        }
    }

    /// Where the connection's 0-RTT attempt stands.
    pub fn zero_rtt(&self) -> ZeroRtt {
        *self.inner.zero_rtt.borrow()
    }

    /// Waits until the gateway has answered: at once after a full handshake; for a 0-RTT
    /// connection, until its handshake completed (whether the early data was accepted or not).
    /// A 0-RTT connection is usable before that, but nothing says yet that the gateway exists
    /// or that UDP gets through, so it must not count as established (a dialer that did let a
    /// dead QUIC path win its race against TCP). Errs when the handshake never completed.
    pub async fn established(&self) -> Result<(), TransportError> {
        let mut zero = self.inner.zero_rtt.clone();
        let state = match zero.wait_for(|z| *z != ZeroRtt::Pending).await {
            Ok(z) => *z,
            // The handshake task ended without a verdict.
            Err(_) => ZeroRtt::Failed,
        };
        let why = match (state, self.inner.conn.close_reason()) {
            (ZeroRtt::Failed, _) => self
                .handshake_error()
                .unwrap_or_else(|| "the QUIC handshake did not complete".to_string()),
            (_, Some(reason)) => format!("QUIC connection closed: {reason}"),
            (_, None) => return Ok(()),
        };
        Err(TransportError::Connect {
            addr: self.inner.conn.remote_address(),
            message: why,
        })
    }

    /// Closes the connection at once.
    pub fn close(&self) {
        self.inner.conn.close(0u32.into(), b"");
    }

    /// Takes the connection out of use without closing it (its path went silent): no new
    /// request goes on it, and a request still waiting for its answer's head fails at once
    /// as retryable (to go to a fresh connection). Answers already streaming keep it until
    /// they end or QUIC gives up on it (its idle timeout), so a path that comes back within
    /// that loses them nothing; the connection closes when the last of them is dropped.
    pub fn set_aside(&self) {
        self.inner.draining.store(true, Ordering::Relaxed);
        self.inner.aside.send_replace(true);
    }

    /// Sends one request; the request body streams to the server as it is read, and the
    /// response body streams back frame by frame. A URI without an authority gets the server
    /// name. The body is uploaded as [`Priority::Bulk`] when its length (`Content-Length` or the
    /// body's size hint) exceeds [`BULK_BODY_BYTES`], else as [`Priority::Interactive`].
    pub async fn send_request<B>(
        &self,
        req: Request<B>,
    ) -> Result<Response<ClientBody>, RequestError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let priority = if body_len(&req) > BULK_BODY_BYTES {
            Priority::Bulk
        } else {
            Priority::Interactive
        };
        self.send_request_with_priority(req, priority).await
    }

    /// [`send_request`](Self::send_request) with the upload's priority chosen by the caller.
    pub async fn send_request_with_priority<B>(
        &self,
        req: Request<B>,
        priority: Priority,
    ) -> Result<Response<ClientBody>, RequestError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (mut parts, body) = req.into_parts();
        parts.uri = absolute_uri(parts.uri, &self.inner.server_name)?;
        parts.headers.remove(http::header::HOST);
        let started_early = *self.inner.zero_rtt.borrow() == ZeroRtt::Pending;
        let Session {
            mut sender,
            priorities,
        } = lock(&self.inner.session).clone();
        let inner = &self.inner;
        let result = async {
            let stream = sender
                .send_request(Request::from_parts(parts, ()))
                .await
                .map_err(|e| {
                    if e.is_remote_closing() {
                        inner.draining.store(true, Ordering::Relaxed);
                    }
                    // A head over the gateway's limit is the request's fault: sending it
                    // again anywhere fails the same way.
                    if matches!(e, h3::error::StreamError::HeaderTooBig { .. }) {
                        (
                            format!(
                                "the request's headers are larger than the gateway accepts: {e}"
                            ),
                            Failed::HeadTooLarge,
                        )
                    } else {
                        (
                            format!("cannot open a request stream: {e}"),
                            Failed::Unprocessed,
                        )
                    }
                })?;
            // The head has gone out at the default class; the body follows at the chosen one.
            priorities.set(stream.id(), priority);
            let (send, mut recv) = stream.split();
            tokio::spawn(pump_request(body, send));
            let head = recv.recv_response().await.map_err(|e| {
                let fate = if is_rejected(&e) {
                    Failed::Unprocessed
                } else {
                    Failed::Final
                };
                (format!("no response: {e}"), fate)
            })?;
            Ok::<_, (String, Failed)>((head, recv))
        };
        // A connection set aside while the request waits for its head: the request leaves it.
        let mut aside = self.inner.aside.subscribe();
        let result = async move {
            tokio::select! {
                // An answer that came as the path was set aside is kept, not sent again.
                biased;
                r = result => r,
                Ok(_) = aside.wait_for(|a| *a) => Err((
                    "the QUIC path went silent before the gateway answered".to_string(),
                    Failed::Unprocessed,
                )),
            }
        };
        let mut zero = self.inner.zero_rtt.clone();
        let outcome = if started_early {
            let mut verdict = zero.clone();
            // Fires only on a real rejection: once the handshake task has sent its verdict it
            // drops the sender, and `wait_for` then errs, which must not read as "rejected"
            // (that re-sent every accepted early request).
            let rejected = async move {
                if verdict
                    .wait_for(|z| matches!(z, ZeroRtt::Rejected | ZeroRtt::Failed))
                    .await
                    .is_err()
                {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                r = result => r,
                () = rejected => Err((self.early_data_lost(), Failed::Unprocessed)),
            }
        } else {
            result.await
        };
        match outcome {
            Ok((head, recv)) => {
                let (mut parts, ()) = head.into_parts();
                // The gateway's receive rate caps this end's brutal rate (`cc`, "Negotiation");
                // the header is consumed either way, never handed to the caller.
                match crate::cc::rate_handle(&self.inner.conn) {
                    Some(rate) => {
                        rate.apply_peer_rx_rate(&mut parts.headers);
                    }
                    None => {
                        parts.headers.remove(crate::cc::RX_RATE_HEADER);
                    }
                }
                let body = H3Body {
                    recv,
                    _client: self.inner.clone(),
                    done: false,
                };
                Ok(Response::from_parts(parts, body.boxed_unsync()))
            }
            Err((message, Failed::HeadTooLarge)) => Err(RequestError {
                message,
                retryable: false,
                head_too_large: true,
            }),
            Err((message, fate)) => {
                // An error may be the first sign of a 0-RTT rejection: wait for the verdict so
                // that a retry goes to the rebuilt session.
                if *self.inner.zero_rtt.borrow() == ZeroRtt::Pending {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(5),
                        zero.wait_for(|z| *z != ZeroRtt::Pending),
                    )
                    .await;
                }
                let verdict = *self.inner.zero_rtt.borrow();
                let rejected =
                    started_early && matches!(verdict, ZeroRtt::Rejected | ZeroRtt::Failed);
                // quinn fails every early stream of a connection whose handshake never completed
                // with "0-RTT rejected", although nothing answered: say what happened instead.
                let message = if started_early && verdict == ZeroRtt::Failed {
                    self.early_data_lost()
                } else {
                    message
                };
                Err(RequestError::new(
                    message,
                    fate == Failed::Unprocessed || rejected || self.is_closed(),
                ))
            }
        }
    }
}

async fn handshake(
    connecting: quinn::Connecting,
    timeout: Duration,
    addr: SocketAddr,
) -> Result<quinn::Connection, TransportError> {
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(TransportError::Connect {
            addr,
            message: format!("QUIC handshake failed: {e}"),
        }),
        Err(_) => Err(TransportError::Connect {
            addr,
            message: format!("QUIC handshake did not finish within {timeout:?}"),
        }),
    }
}

/// Whether a stream error means the server did not process the request (RFC 9114 §4.1.1:
/// H3_REQUEST_REJECTED), or the connection is gone.
fn is_rejected(e: &h3::error::StreamError) -> bool {
    match e {
        h3::error::StreamError::RemoteTerminate { code, .. } => {
            *code == h3::error::Code::H3_REQUEST_REJECTED
        }
        h3::error::StreamError::ConnectionError { .. } => true,
        _ => false,
    }
}

/// The request body's length as far as it is known up front: `Content-Length`, else the
/// body's lower size bound.
fn body_len<B: Body>(req: &Request<B>) -> u64 {
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    declared.max(req.body().size_hint().lower())
}

/// Fills in `https://server_name` when a URI has no authority.
pub(crate) fn absolute_uri(uri: Uri, server_name: &str) -> Result<Uri, RequestError> {
    if uri.authority().is_some() {
        return Ok(uri);
    }
    let pq = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    // An IPv6 address goes in brackets in a URI (RFC 3986 §3.2.2); bare, `2001:db8::1` does not
    // parse as an authority and every request failed.
    let host = match server_name.parse::<std::net::Ipv6Addr>() {
        Ok(_) => format!("[{server_name}]"),
        Err(_) => server_name.to_owned(),
    };
    format!("https://{host}{pq}")
        .parse()
        .map_err(|e| RequestError::new(format!("bad request URI: {e}"), false))
}

async fn pump_request<B>(
    body: B,
    mut send: h3::client::RequestStream<h3_quinn_prio::SendStream<Bytes>, Bytes>,
) where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let body = body.map_err(Into::<BoxError>::into);
    let mut body = std::pin::pin!(body);
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    if data.is_empty() {
                        continue;
                    }
                    if send.send_data(data).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "request body failed; cancelling the stream");
                send.stop_stream(h3::error::Code::H3_REQUEST_CANCELLED);
                return;
            }
        }
    }
    let _ = send.finish().await;
}

/// A response body read from an HTTP/3 request stream.
struct H3Body {
    recv: h3::client::RequestStream<h3_quinn_prio::RecvStream, Bytes>,
    /// Keeps the session's senders alive while the body streams.
    _client: Arc<Inner>,
    done: bool,
}

impl Body for H3Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.recv.poll_recv_data(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(Some(mut buf))) => {
                let data = buf.copy_to_bytes(buf.remaining());
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(Ok(None)) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Err(e)) => {
                self.done = true;
                Poll::Ready(Some(Err(Box::new(e))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_length_comes_from_content_length_or_the_size_hint() {
        let declared = Request::builder()
            .header(http::header::CONTENT_LENGTH, "70000")
            .body(http_body_util::Empty::<Bytes>::new())
            .expect("request");
        assert_eq!(body_len(&declared), 70_000);
        let hinted = Request::new(http_body_util::Full::new(Bytes::from(vec![0u8; 100])));
        assert_eq!(body_len(&hinted), 100);
        assert!(body_len(&hinted) <= BULK_BODY_BYTES);
    }

    #[test]
    fn a_gateway_named_by_address_gets_a_valid_uri() {
        let uri = |name: &str| {
            absolute_uri(Uri::from_static("/v1/models?x=1"), name)
                .expect("a valid URI")
                .to_string()
        };
        assert_eq!(uri("gw.example"), "https://gw.example/v1/models?x=1");
        assert_eq!(uri("198.18.0.1"), "https://198.18.0.1/v1/models?x=1");
        assert_eq!(uri("2001:db8::1"), "https://[2001:db8::1]/v1/models?x=1");
        assert_eq!(uri("::1"), "https://[::1]/v1/models?x=1");
    }
}
