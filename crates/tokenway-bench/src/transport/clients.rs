//! One way per transport to send a streaming chat request and time it.
//!
//! Every request is timed from the moment the bench starts to do anything for it, connection
//! setup included: for a fresh connection that is the TCP/TLS or QUIC handshake, for a 0-RTT
//! resumed connection the early-data flight. The tunnel transports are reached through an edge
//! on loopback over HTTP/1.1 keep-alive; their "fresh" and "0-RTT" requests follow a
//! `POST /admin/reconnect` to that edge (which closes its tunnel connection and redials at
//! once), and the clock starts when that call has returned: the edge began dialling up to one
//! loopback HTTP exchange (≈0.1 ms) before the request arrived, so those TTFTs slightly
//! understate a cold start.
//!
//! Bytes are HTTP message bytes as HTTP/1.1 would carry them (request line or status line,
//! headers, body), not counting TLS, QUIC, TCP or IP overhead, handshakes or retransmissions.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokenway_transport::client::{QuicClient, QuicConnect, ZeroRtt};
use tokenway_transport::fallback::TcpClient;
use tokenway_transport::trust::{client_tls, Trust};
use tokenway_transport::QuicSettings;

use super::report::LayerCounters;
use super::stack::Targets;
use super::{Mode, Transport};
use crate::load;

/// Longest time for one request, connection setup included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for one TCP/TLS or QUIC handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// TLS server name of the gateway's self-signed certificate.
const SERVER_NAME: &str = "localhost";
const CHAT_PATH: &str = "/v1/chat/completions";

/// The outcome of one request.
#[derive(Clone, Debug, Default)]
pub struct Record {
    /// Time to the first `data:` event, from the start of the request (setup included).
    pub ttft: Option<Duration>,
    /// Largest gap between consecutive chunks that carried `data:` events.
    pub max_gap: Option<Duration>,
    /// Time to the end of the response.
    pub total: Duration,
    /// Request bytes (HTTP/1.1-equivalent head + body).
    pub request_bytes: u64,
    /// Response bytes (HTTP/1.1-equivalent head + body).
    pub response_bytes: u64,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// For direct HTTP/3 0-RTT requests: whether the server accepted the early data.
    pub zero_rtt_accepted: Option<bool>,
    /// The request was refused before its first byte and sent again on the same connection.
    pub retried: bool,
}

type Pool = Client<HttpConnector, Full<Bytes>>;

/// Everything the client side needs, created inside the client namespace.
pub struct Clients {
    targets: Targets,
    endpoint: quinn::Endpoint,
    quic: QuicSettings,
    trust: Trust,
    /// rustls config for 0-RTT HTTP/3: keeps the resumption tickets across connections.
    h3_resuming: Arc<rustls::ClientConfig>,
    h2_tls: Arc<rustls::ClientConfig>,
    pool: Pool,
    h2: Mutex<Option<Arc<TcpClient>>>,
    h3: Mutex<Option<Arc<QuicClient>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn head_bytes(first_line: usize, headers: &HeaderMap) -> u64 {
    let fields: usize = headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    (first_line + 2 + fields + 2) as u64
}

impl Clients {
    /// Sets up the client side. Must run on a thread inside the client namespace (sockets are
    /// created in the namespace of the thread that creates them).
    pub fn new(targets: Targets) -> Result<Self, String> {
        let quic = QuicSettings::default();
        let endpoint =
            tokenway_transport::endpoint::client_endpoint(([0, 0, 0, 0], 0).into(), &quic)
                .map_err(|e| format!("cannot open the QUIC client endpoint: {e}"))?;
        let trust = Trust::Pinned(vec![targets.fingerprint.clone()]);
        let h3_resuming = client_tls(&trust, &[tokenway_transport::ALPN_H3], true)
            .map_err(|e| format!("TLS config: {e}"))?;
        let h2_tls = client_tls(&trust, &[tokenway_transport::ALPN_H2], false)
            .map_err(|e| format!("TLS config: {e}"))?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let pool = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(usize::MAX)
            .pool_idle_timeout(Duration::from_secs(300))
            .build(connector);
        Ok(Self {
            targets,
            endpoint,
            quic,
            trust,
            h3_resuming,
            h2_tls,
            pool,
            h2: Mutex::new(None),
            h3: Mutex::new(None),
        })
    }

    /// The edge a tunnel transport goes through in `mode`.
    fn edge(&self, transport: Transport, mode: Mode) -> SocketAddr {
        if let Some((_, edge, _)) = self
            .targets
            .layered
            .iter()
            .find(|(t, _, _)| *t == transport)
        {
            return *edge;
        }
        match (transport, mode) {
            (Transport::TunnelTcp, _) => self.targets.edge_tcp,
            (_, Mode::Fresh) => self.targets.edge_full,
            _ => self.targets.edge,
        }
    }

    /// Sends one chat request with `body` over `transport` in `mode`, reads the answer to the
    /// end and times it. Never panics; failures end up in [`Record::error`].
    pub async fn send(&self, transport: Transport, mode: Mode, body: Bytes) -> Record {
        match tokio::time::timeout(REQUEST_TIMEOUT, self.send_inner(transport, mode, body)).await {
            Ok(record) => record,
            Err(_) => Record {
                total: REQUEST_TIMEOUT,
                error: Some(format!("no complete answer within {REQUEST_TIMEOUT:?}")),
                ..Record::default()
            },
        }
    }

    async fn send_inner(&self, transport: Transport, mode: Mode, body: Bytes) -> Record {
        let req = chat_request(body.clone());
        let request_bytes = head_bytes(format!("POST {CHAT_PATH} HTTP/1.1").len(), req.headers())
            + req.body().size_hint_exact();
        match transport {
            Transport::H1 => {
                let addr = self.targets.gateway_plain;
                match mode {
                    Mode::Fresh => {
                        let start = Instant::now();
                        let r = h1_fresh(addr, req).await;
                        finish(start, r, request_bytes, None).await
                    }
                    Mode::Reused | Mode::ZeroRtt => {
                        let start = Instant::now();
                        let r = self.pooled(addr, req).await;
                        finish(start, r, request_bytes, None).await
                    }
                }
            }
            Transport::H2 => {
                let start = Instant::now();
                let client = match mode {
                    Mode::Fresh => self.h2_connect().await.map(Arc::new),
                    Mode::Reused | Mode::ZeroRtt => self.h2_reused().await,
                };
                let client = match client {
                    Ok(c) => c,
                    Err(e) => return failed(start, request_bytes, e),
                };
                let r = client
                    .send_request(req)
                    .await
                    .map_err(|e| e.message.clone());
                let record = finish(start, r, request_bytes, None).await;
                if mode == Mode::Fresh {
                    client.close();
                }
                record
            }
            Transport::H3 => {
                let start = Instant::now();
                let client = match mode {
                    Mode::Fresh => self.h3_connect(false).await.map(Arc::new),
                    Mode::ZeroRtt => self.h3_connect(true).await.map(Arc::new),
                    Mode::Reused => self.h3_reused().await,
                };
                let client = match client {
                    Ok(c) => c,
                    Err(e) => return failed(start, request_bytes, e),
                };
                // A request refused before its first byte on a connection that is still open
                // (0-RTT early data refused, or reported refused) is sent once more on the
                // same connection, as the edge does; the retry is counted.
                let mut retried = false;
                let r = match client.send_request(req).await {
                    Err(e) if mode == Mode::ZeroRtt && e.retryable && !client.is_closed() => {
                        retried = true;
                        client.send_request(chat_request(body)).await
                    }
                    other => other,
                }
                .map_err(|e| e.message.clone());
                let mut record = finish(start, r, request_bytes, None).await;
                record.retried = retried;
                if mode == Mode::ZeroRtt {
                    record.zero_rtt_accepted = Some(client.zero_rtt() == ZeroRtt::Accepted);
                }
                if mode != Mode::Reused {
                    // Let the server's session tickets arrive before closing, so the next
                    // 0-RTT connection has one (tickets follow the handshake by about an RTT).
                    if mode == Mode::ZeroRtt {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    client.close();
                }
                record
            }
            Transport::Tunnel
            | Transport::TunnelTcp
            | Transport::TunnelFec
            | Transport::TunnelFecObfs
            | Transport::TunnelBrutal => {
                let edge = self.edge(transport, mode);
                if mode != Mode::Reused {
                    if let Err(e) = self.admin(edge, "/admin/reconnect").await {
                        return failed(Instant::now(), request_bytes, e);
                    }
                }
                let start = Instant::now();
                let r = self.pooled(edge, req).await;
                finish(start, r, request_bytes, None).await
            }
        }
    }

    async fn pooled(
        &self,
        addr: SocketAddr,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<hyper::body::Incoming>, String> {
        *req.uri_mut() = format!("http://{addr}{CHAT_PATH}")
            .parse()
            .expect("a socket address and a static path form a valid URI");
        self.pool
            .request(req)
            .await
            .map_err(|e| format!("request failed: {e}"))
    }

    /// `POST path` to an edge's admin endpoint (not timed).
    async fn admin(&self, edge: SocketAddr, path: &str) -> Result<(), String> {
        let req = Request::post(format!("http://{edge}{path}"))
            .body(Full::new(Bytes::new()))
            .expect("a socket address and a static path form a valid URI");
        let resp = self
            .pool
            .request(req)
            .await
            .map_err(|e| format!("{path} on the edge: {e}"))?;
        let status = resp.status();
        let _ = resp.into_body().collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("{path} on the edge answered {status}"))
        }
    }

    /// The datagram-layer counters of a layered tunnel's edge and gateway, summed.
    pub async fn layer_counters(&self, transport: Transport) -> Option<LayerCounters> {
        let (_, edge, gateway) = *self
            .targets
            .layered
            .iter()
            .find(|(t, _, _)| *t == transport)?;
        let edge = self.metrics_text(edge).await;
        let gateway = self.metrics_text(gateway).await;
        let sum = |text: &str, prefix: &str| -> f64 {
            text.lines()
                .filter(|l| l.starts_with(prefix))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        let values = LayerCounters::METRICS.map(|m| sum(&edge, m) + sum(&gateway, m));
        Some(LayerCounters::from_values(values))
    }

    /// A server's `/metrics` text (empty when it cannot be read).
    async fn metrics_text(&self, addr: SocketAddr) -> String {
        let req = Request::get(format!("http://{addr}/metrics"))
            .body(Full::new(Bytes::new()))
            .expect("a socket address and a static path form a valid URI");
        let Ok(resp) = self.pool.request(req).await else {
            return String::new();
        };
        let Ok(body) = resp.into_body().collect().await else {
            return String::new();
        };
        String::from_utf8_lossy(&body.to_bytes()).into_owned()
    }

    /// Reads an edge's `/metrics` and sums the series starting with `prefix`.
    pub async fn edge_metric(&self, transport: Transport, mode: Mode, prefix: &str) -> f64 {
        let edge = self.edge(transport, mode);
        let req = Request::get(format!("http://{edge}/metrics"))
            .body(Full::new(Bytes::new()))
            .expect("a socket address and a static path form a valid URI");
        let Ok(resp) = self.pool.request(req).await else {
            return 0.0;
        };
        let Ok(body) = resp.into_body().collect().await else {
            return 0.0;
        };
        String::from_utf8_lossy(&body.to_bytes())
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    async fn h2_connect(&self) -> Result<TcpClient, String> {
        TcpClient::connect(
            self.targets.gateway_tls,
            SERVER_NAME,
            self.h2_tls.clone(),
            CONNECT_TIMEOUT,
            "bench",
            None,
        )
        .await
        .map_err(|e| e.to_string())
    }

    async fn h2_reused(&self) -> Result<Arc<TcpClient>, String> {
        if let Some(c) = lock(&self.h2).as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let c = Arc::new(self.h2_connect().await?);
        *lock(&self.h2) = Some(c.clone());
        Ok(c)
    }

    /// A new HTTP/3 connection: resuming with early data when `resume`, else with a TLS
    /// configuration that has never seen the server (a full handshake).
    async fn h3_connect(&self, resume: bool) -> Result<QuicClient, String> {
        let tls = if resume {
            self.h3_resuming.clone()
        } else {
            client_tls(&self.trust, &[tokenway_transport::ALPN_H3], false)
                .map_err(|e| e.to_string())?
        };
        QuicClient::connect(QuicConnect {
            endpoint: &self.endpoint,
            addr: self.targets.gateway_h3,
            server_name: SERVER_NAME,
            tls,
            settings: &self.quic,
            initial_rtt: None,
            peer: "bench",
            metrics: None,
            timeout: CONNECT_TIMEOUT,
        })
        .await
        .map_err(|e| e.to_string())
    }

    async fn h3_reused(&self) -> Result<Arc<QuicClient>, String> {
        if let Some(c) = lock(&self.h3).as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let c = Arc::new(self.h3_connect(true).await?);
        *lock(&self.h3) = Some(c.clone());
        Ok(c)
    }

    /// Closes the reused connections and the QUIC endpoint.
    pub fn close(&self) {
        if let Some(c) = lock(&self.h2).take() {
            c.close();
        }
        if let Some(c) = lock(&self.h3).take() {
            c.close();
        }
        self.endpoint.close(0u32.into(), b"");
    }
}

trait SizeHintExact {
    fn size_hint_exact(&self) -> u64;
}

impl SizeHintExact for Full<Bytes> {
    fn size_hint_exact(&self) -> u64 {
        hyper::body::Body::size_hint(self).lower()
    }
}

fn chat_request(body: Bytes) -> Request<Full<Bytes>> {
    Request::builder()
        .method(Method::POST)
        .uri(CHAT_PATH)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::ACCEPT, "text/event-stream")
        .header(header::CONTENT_LENGTH, body.len())
        .body(Full::new(body))
        .expect("method, URI and static headers are valid")
}

/// HTTP/1.1 on a new TCP connection, closed after the response.
async fn h1_fresh(
    addr: SocketAddr,
    mut req: Request<Full<Bytes>>,
) -> Result<Response<hyper::body::Incoming>, String> {
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| format!("TCP connect did not finish within {CONNECT_TIMEOUT:?}"))?
        .map_err(|e| format!("TCP connect: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("HTTP/1.1 handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    req.headers_mut().insert(
        header::HOST,
        addr.to_string()
            .parse()
            .expect("a socket address is a valid header value"),
    );
    req.headers_mut()
        .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
    sender
        .send_request(req)
        .await
        .map_err(|e| format!("request failed: {e}"))
}

fn failed(start: Instant, request_bytes: u64, error: String) -> Record {
    Record {
        total: start.elapsed(),
        request_bytes,
        error: Some(error),
        ..Record::default()
    }
}

async fn finish<B, E>(
    start: Instant,
    response: Result<Response<B>, E>,
    request_bytes: u64,
    zero_rtt_accepted: Option<bool>,
) -> Record
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
    E: std::fmt::Display,
{
    let response = match response {
        Ok(r) => r,
        Err(e) => return failed(start, request_bytes, e.to_string()),
    };
    let status: StatusCode = response.status();
    let head = head_bytes(format!("HTTP/1.1 {status}").len(), response.headers());
    let read = load::read_stream(start, status, response.into_body(), None).await;
    Record {
        ttft: read.sample.ttft,
        max_gap: read.sample.gaps.iter().max().copied(),
        total: read.sample.total,
        request_bytes,
        response_bytes: head + read.body_bytes,
        error: read.sample.error,
        zero_rtt_accepted,
        retried: false,
    }
}
