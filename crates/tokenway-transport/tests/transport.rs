//! HTTP/3 over the priority-aware quinn adapter (`h3_quinn_prio`), on loopback, in-process: a
//! self-signed server, and clients that trust it by pinned fingerprint.
//!
//! The priority tests start a 20 MB transfer, wait until it is under way, then make a small
//! exchange on the same connection, and check how much of the bulk transfer had arrived when
//! the small exchange finished. No clock is read: the bulk byte counter is the only witness.
//!
//! They run quinn with `send_fairness(true)`, as `QuicSettings::transport_config` does. With
//! `send_fairness(false)` quinn keeps writing a stream it has started until that stream's send
//! buffer is empty, whatever the priorities (quinn-proto, `PendingStreamsQueue::reinsert_pending`),
//! so the small exchange regularly waits for most or all of the 20 MB; [`report_priority_races`]
//! (ignored by default) shows it.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, SizeHint};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use tokenway_transport::certs::Identity;
use tokenway_transport::client::{QuicClient, QuicConnect};
use tokenway_transport::h3_quinn_prio::{Connection, OpenStreams, Priority, PriorityMap};
use tokenway_transport::trust::{client_tls, Trust};
use tokenway_transport::{endpoint, QuicSettings, ALPN_H3};

/// Size of the bulk transfer.
const BULK: u64 = 20 << 20;
/// How much of the bulk transfer must have arrived before the small exchange starts.
const UNDER_WAY: u64 = 1 << 20;
/// Longest wait for anything in these tests (a hang fails instead of blocking CI).
const DEADLINE: Duration = Duration::from_secs(60);

static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

fn zeros(n: u64) -> Bytes {
    let n = usize::try_from(n.min(ZEROS.len() as u64)).expect("at most 64 KiB");
    Bytes::from_static(&ZEROS[..n])
}

/// The project's QUIC settings without 0-RTT, as a quinn transport configuration.
fn transport(fair: bool) -> Arc<quinn::TransportConfig> {
    let settings = QuicSettings {
        zero_rtt: false,
        ..QuicSettings::default()
    };
    let mut t = settings.transport_config(None);
    t.send_fairness(fair);
    Arc::new(t)
}

/// A request body of `remaining` zero bytes with an exact size hint.
struct Zeros {
    remaining: u64,
}

impl Body for Zeros {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let chunk = zeros(self.remaining);
        self.remaining -= chunk.len() as u64;
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// What the test server shares with the test.
#[derive(Default)]
struct ServerState {
    /// Bytes of `/upload` bodies received so far.
    uploaded: AtomicU64,
    /// The priorities of the last connection's streams.
    priorities: Mutex<Option<PriorityMap>>,
    /// The last connection.
    conn: Mutex<Option<quinn::Connection>>,
}

/// The test server's `SETTINGS_MAX_FIELD_SECTION_SIZE`.
const SERVER_MAX_HEAD: u64 = 16 << 10;

/// Chunks of the `/stream` response.
const STREAM_CHUNKS: usize = 300;
/// Pause between two chunks of the `/stream` response (a token stream).
const STREAM_GAP: Duration = Duration::from_millis(3);

struct Server {
    addr: SocketAddr,
    fingerprint: String,
    state: Arc<ServerState>,
    _endpoint: quinn::Endpoint,
}

/// Starts the test server on loopback. Routes:
/// - `POST /upload`: counts the body into `uploaded`, answers with the count;
/// - `GET /download`: answers with [`BULK`] zero bytes, sent as [`Priority::Bulk`];
/// - `POST /ping`: reads the body, answers with `uploaded` as it is at that moment;
/// - `GET /stream`: [`STREAM_CHUNKS`] chunks of 64 bytes, [`STREAM_GAP`] apart;
/// - `GET /dropped`: 64 bytes, then the response is dropped unfinished (a task that died).
///
/// A request carrying `tw-rx-rate` is applied to the connection's rate handle, as the gateway's
/// tunnel code does; one carrying `x-answer-rx` is answered with its value as `tw-rx-rate`, as
/// the gateway advertises its receive rate.
fn start_server(fair: bool) -> Server {
    let identity = Identity::self_signed(&["localhost"]).expect("self-signed identity");
    let tls = identity.quic_server_config(false).expect("TLS config");
    let crypto = QuicServerConfig::try_from(tls).expect("TLS config usable for QUIC");
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(transport(fair));
    let ep = quinn::Endpoint::server(config, "127.0.0.1:0".parse().expect("addr"))
        .expect("server endpoint");
    let state = Arc::new(ServerState::default());
    let server = Server {
        addr: ep.local_addr().expect("bound address"),
        fingerprint: identity.fingerprint(),
        state: state.clone(),
        _endpoint: ep.clone(),
    };
    tokio::spawn(async move {
        while let Some(incoming) = ep.accept().await {
            tokio::spawn(serve_connection(incoming, state.clone()));
        }
    });
    server
}

async fn serve_connection(incoming: quinn::Incoming, state: Arc<ServerState>) {
    let Ok(conn) = incoming.await else { return };
    *state.conn.lock().expect("not poisoned") = Some(conn.clone());
    // As the gateway does: the rate handle is looked up per request (a path reset builds a
    // new controller with a new handle).
    let rate = conn.clone();
    let conn = Connection::new(conn);
    let priorities = conn.priorities();
    *state.priorities.lock().expect("not poisoned") = Some(priorities.clone());
    let Ok(mut h3) = h3::server::builder()
        .max_field_section_size(SERVER_MAX_HEAD)
        .build::<_, Bytes>(conn)
        .await
    else {
        return;
    };
    while let Ok(Some(resolver)) = h3.accept().await {
        let (state, priorities, rate) = (state.clone(), priorities.clone(), rate.clone());
        tokio::spawn(async move {
            let Ok((mut req, mut stream)) = resolver.resolve_request().await else {
                return;
            };
            if let Some(rate) = tokenway_transport::cc::rate_handle(&rate) {
                rate.apply_peer_rx_rate(req.headers_mut());
            }
            let path = req.uri().path();
            let mut received = 0u64;
            while let Ok(Some(chunk)) = stream.recv_data().await {
                let n = chunk.remaining() as u64;
                received += n;
                if path == "/upload" {
                    state.uploaded.fetch_add(n, Ordering::SeqCst);
                }
            }
            let answer = match path {
                "/upload" => received.to_string(),
                "/ping" => state.uploaded.load(Ordering::SeqCst).to_string(),
                _ => String::new(),
            };
            let download = path == "/download";
            if download && !priorities.set(stream.id(), Priority::Bulk) {
                stream.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
                return;
            }
            let mut head = Response::new(());
            if let Some(rx) = req.headers().get("x-answer-rx") {
                head.headers_mut()
                    .insert(tokenway_transport::cc::RX_RATE_HEADER, rx.clone());
            }
            if stream.send_response(head).await.is_err() {
                return;
            }
            if path == "/dropped" {
                let _ = stream.send_data(zeros(64)).await;
                return;
            }
            let mut left = if download { BULK } else { 0 };
            while left > 0 {
                let chunk = zeros(left);
                left -= chunk.len() as u64;
                if stream.send_data(chunk).await.is_err() {
                    return;
                }
            }
            if path == "/stream" {
                for _ in 0..STREAM_CHUNKS {
                    tokio::time::sleep(STREAM_GAP).await;
                    if stream.send_data(zeros(64)).await.is_err() {
                        return;
                    }
                }
            } else if !download && stream.send_data(Bytes::from(answer)).await.is_err() {
                return;
            }
            let _ = stream.finish().await;
        });
    }
}

fn client_endpoint() -> quinn::Endpoint {
    endpoint::client_endpoint(
        "127.0.0.1:0".parse().expect("addr"),
        &QuicSettings::default(),
    )
    .expect("client endpoint")
}

fn pinned_tls(server: &Server) -> Arc<rustls::ClientConfig> {
    client_tls(
        &Trust::Pinned(vec![server.fingerprint.clone()]),
        &[ALPN_H3],
        false,
    )
    .expect("client TLS")
}

/// A bare `h3` client over the adapter, with the stream priorities at hand.
struct RawClient {
    sender: h3::client::SendRequest<OpenStreams, Bytes>,
    priorities: PriorityMap,
    _endpoint: quinn::Endpoint,
}

async fn raw_client(server: &Server, fair: bool) -> RawClient {
    let ep = client_endpoint();
    let crypto = QuicClientConfig::try_from(pinned_tls(server)).expect("TLS config for QUIC");
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(transport(fair));
    let conn = ep
        .connect_with(config, server.addr, "localhost")
        .expect("connect")
        .await
        .expect("handshake");
    let conn = Connection::new(conn);
    let priorities = conn.priorities();
    let (mut driver, sender) = h3::client::new(conn).await.expect("HTTP/3 session");
    tokio::spawn(async move { driver.wait_idle().await });
    RawClient {
        sender,
        priorities,
        _endpoint: ep,
    }
}

fn request<B>(method: Method, path: &str, body: B) -> Request<B> {
    Request::builder()
        .method(method)
        .uri(format!("https://localhost{path}"))
        .body(body)
        .expect("valid request")
}

/// Sends a request with `body` as `priority` and returns the response body.
async fn raw_exchange(
    client: &RawClient,
    method: Method,
    path: &str,
    body: u64,
    priority: Priority,
    on_data: impl Fn(usize),
) -> Bytes {
    let mut sender = client.sender.clone();
    let mut stream = sender
        .send_request(request(method, path, ()))
        .await
        .expect("request stream");
    assert!(client.priorities.set(stream.id(), priority), "registered");
    let mut left = body;
    while left > 0 {
        let chunk = zeros(left);
        left -= chunk.len() as u64;
        stream.send_data(chunk).await.expect("request body");
    }
    stream.finish().await.expect("request end");
    stream.recv_response().await.expect("response head");
    let mut answer = Vec::new();
    while let Some(mut chunk) = stream.recv_data().await.expect("response body") {
        on_data(chunk.remaining());
        if chunk.remaining() < 64 {
            answer.extend_from_slice(&chunk.copy_to_bytes(chunk.remaining()));
        }
    }
    Bytes::from(answer)
}

fn count(body: &[u8]) -> u64 {
    std::str::from_utf8(body)
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("a byte count")
}

/// Waits (up to [`DEADLINE`]) until `counter` reaches `at_least`.
async fn wait_for(counter: &AtomicU64, at_least: u64) {
    tokio::time::timeout(DEADLINE, async {
        while counter.load(Ordering::SeqCst) < at_least {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("waited too long");
}

/// Uploads [`BULK`] bytes as `bulk`, and once the upload is under way sends a small request as
/// `small`; returns how many bulk bytes the server had when it answered the small request.
async fn upload_race(fair: bool, bulk: Priority, small: Priority) -> u64 {
    let server = start_server(fair);
    let client = Arc::new(raw_client(&server, fair).await);
    let upload = {
        let client = client.clone();
        tokio::spawn(async move {
            raw_exchange(&client, Method::POST, "/upload", BULK, bulk, |_| {}).await
        })
    };
    wait_for(&server.state.uploaded, UNDER_WAY).await;
    let ping = raw_exchange(&client, Method::POST, "/ping", 2, small, |_| {});
    let seen = count(&tokio::time::timeout(DEADLINE, ping).await.expect("ping"));
    let uploaded = tokio::time::timeout(DEADLINE, upload)
        .await
        .expect("upload finished")
        .expect("upload task");
    assert_eq!(count(&uploaded), BULK, "the whole upload arrived");
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interactive_request_overtakes_a_bulk_upload() {
    let seen = upload_race(true, Priority::Bulk, Priority::Interactive).await;
    assert!(
        seen < BULK,
        "the small request waited for the whole bulk upload ({seen} bytes)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interactive_response_overtakes_a_bulk_download_and_streams_are_forgotten() {
    let server = start_server(true);
    let client = Arc::new(raw_client(&server, true).await);
    let downloaded = Arc::new(AtomicU64::new(0));
    let download = {
        let (client, downloaded) = (client.clone(), downloaded.clone());
        tokio::spawn(async move {
            let add = |n: usize| {
                downloaded.fetch_add(n as u64, Ordering::SeqCst);
            };
            raw_exchange(
                &client,
                Method::GET,
                "/download",
                0,
                Priority::Interactive,
                add,
            )
            .await
        })
    };
    wait_for(&downloaded, UNDER_WAY).await;
    let ping = raw_exchange(
        &client,
        Method::POST,
        "/ping",
        2,
        Priority::Interactive,
        |_| {},
    );
    tokio::time::timeout(DEADLINE, ping).await.expect("ping");
    let seen = downloaded.load(Ordering::SeqCst);
    tokio::time::timeout(DEADLINE, download)
        .await
        .expect("download finished")
        .expect("download task");
    assert_eq!(
        downloaded.load(Ordering::SeqCst),
        BULK,
        "the whole download"
    );
    assert!(
        seen < BULK,
        "the small response waited for the whole bulk download ({seen} bytes)"
    );
    // Every request stream has ended, so both priority maps empty out.
    let server_map = server
        .state
        .priorities
        .lock()
        .expect("not poisoned")
        .clone();
    let server_map = server_map.expect("a connection was served");
    for map in [&server_map, &client.priorities] {
        tokio::time::timeout(DEADLINE, async {
            while !map.is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("entries removed when their streams end");
    }
}

/// Sends a request through the edge's client and reads the whole response body.
async fn body_of<B>(client: &QuicClient, req: Request<B>) -> Bytes
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let resp = client.send_request(req).await.expect("response");
    resp.into_body().collect().await.expect("body").to_bytes()
}

/// The edge's client to `server` (without 0-RTT), and the endpoint it lives on.
async fn edge_client(server: &Server) -> (QuicClient, quinn::Endpoint) {
    let settings = QuicSettings {
        zero_rtt: false,
        ..QuicSettings::default()
    };
    let ep = client_endpoint();
    let client = QuicClient::connect(QuicConnect {
        endpoint: &ep,
        addr: server.addr,
        server_name: "localhost",
        tls: pinned_tls(server),
        settings: &settings,
        initial_rtt: None,
        peer: "test",
        metrics: None,
        timeout: Duration::from_secs(5),
    })
    .await
    .expect("connected");
    (client, ep)
}

/// The edge's client, with the project's QUIC settings: a bulk upload and a small request share
/// one connection and both arrive whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_client_carries_a_bulk_upload_and_a_small_request_together() {
    let server = start_server(false);
    let (client, _ep) = edge_client(&server).await;
    let client = Arc::new(client);
    let upload = {
        let client = client.clone();
        let req = request(Method::POST, "/upload", Zeros { remaining: BULK });
        tokio::spawn(async move { body_of(&client, req).await })
    };
    wait_for(&server.state.uploaded, UNDER_WAY).await;
    let ping = request(Method::POST, "/ping", Full::new(Bytes::from_static(b"hi")));
    let seen = count(
        &tokio::time::timeout(DEADLINE, body_of(&client, ping))
            .await
            .expect("ping"),
    );
    let uploaded = tokio::time::timeout(DEADLINE, upload)
        .await
        .expect("upload finished")
        .expect("upload task");
    assert_eq!(count(&uploaded), BULK, "the whole upload arrived");
    assert!(seen <= BULK);
}

/// A request head over the server's limit fails as the request's own fault (not retryable,
/// marked as such) and leaves the connection serving the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_over_the_servers_limit_is_the_requests_fault_and_the_connection_lives_on() {
    let server = start_server(false);
    let (client, _ep) = edge_client(&server).await;
    // Settle the server's SETTINGS first: the limit is known once they arrive.
    let ping = request(Method::POST, "/ping", Full::new(Bytes::from_static(b"hi")));
    body_of(&client, ping).await;
    let mut big = request(Method::POST, "/ping", Full::new(Bytes::from_static(b"hi")));
    big.headers_mut().insert(
        "x-big",
        http::HeaderValue::from_str(&"a".repeat(SERVER_MAX_HEAD as usize)).expect("value"),
    );
    let err = tokio::time::timeout(DEADLINE, client.send_request(big))
        .await
        .expect("in time")
        .expect_err("refused");
    assert!(err.head_too_large, "{err}");
    assert!(!err.retryable, "{err}");
    assert!(
        err.message.contains("larger than the gateway accepts"),
        "{err}"
    );
    assert!(!client.is_closed());
    let ping = request(Method::POST, "/ping", Full::new(Bytes::from_static(b"hi")));
    tokio::time::timeout(DEADLINE, body_of(&client, ping))
        .await
        .expect("the next request is answered");
}

/// Not a pass/fail property (the outcome depends on scheduling): how far the bulk upload got
/// before the small request was answered, for each fairness setting and pair of priorities.
/// `cargo test -p tokenway-transport --test transport -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn report_priority_races() {
    let pairs = [
        (Priority::Bulk, Priority::Interactive),
        (Priority::Interactive, Priority::Interactive),
    ];
    for fair in [false, true] {
        for (bulk, small) in pairs {
            let mut kib = Vec::new();
            for _ in 0..5 {
                kib.push(upload_race(fair, bulk, small).await >> 10);
            }
            eprintln!(
                "send_fairness({fair}) upload {bulk:?}, ping {small:?}: KiB of {} received at the answer: {kib:?}",
                BULK >> 10
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The datagram layer (FEC and obfuscation below QUIC) and the tunnel's congestion control.

use tokenway_transport::datagram::DatagramHandle;
use tokenway_transport::settings::{
    Bandwidth, BandwidthSettings, FecScopeSetting, FecSetting, ObfsSettings,
};
use tokenway_transport::{CongestionControl, DatagramSettings};

const PSK: &str = "a pre-shared key for the tests";

/// QUIC settings with a datagram layer: `fec` as in config files, obfuscation under `psk`.
fn layered(fec: &str, psk: &str) -> QuicSettings {
    QuicSettings {
        zero_rtt: false,
        datagram: Some(DatagramSettings {
            fec: FecSetting::try_from(fec.to_string()).expect("fec mode"),
            fec_scope: FecScopeSetting::All,
            obfs: Some(ObfsSettings { psk: psk.into() }),
            ..DatagramSettings::default()
        }),
        ..QuicSettings::default()
    }
}

struct LayeredServer {
    server: Server,
    layer: DatagramHandle,
}

/// The test server (routes as in [`start_server`]) on the project's server endpoint.
fn start_layered_server(settings: &QuicSettings) -> LayeredServer {
    start_layered_server_on(settings, "127.0.0.1:0".parse().expect("addr"))
}

fn start_layered_server_on(settings: &QuicSettings, bind: SocketAddr) -> LayeredServer {
    let identity = Identity::self_signed(&["localhost"]).expect("self-signed identity");
    let (ep, layer) =
        endpoint::server_endpoint_with_layer(bind, &identity, settings).expect("server endpoint");
    let state = Arc::new(ServerState::default());
    let server = Server {
        addr: ep.local_addr().expect("bound address"),
        fingerprint: identity.fingerprint(),
        state: state.clone(),
        _endpoint: ep.clone(),
    };
    tokio::spawn(async move {
        while let Some(incoming) = ep.accept().await {
            tokio::spawn(serve_connection(incoming, state.clone()));
        }
    });
    LayeredServer {
        server,
        layer: layer.expect("the settings carry a datagram layer"),
    }
}

/// The edge's `QuicClient` on the project's client endpoint with `settings` (its datagram
/// layer), connected to `server`; with the endpoint and the layer, to keep while it is used.
async fn layered_quic_client(
    server: &Server,
    settings: &QuicSettings,
) -> (QuicClient, quinn::Endpoint, Option<DatagramHandle>) {
    let (ep, layer) =
        endpoint::client_endpoint_with_layer("127.0.0.1:0".parse().expect("addr"), settings)
            .expect("client endpoint");
    let client = QuicClient::connect(QuicConnect {
        endpoint: &ep,
        addr: server.addr,
        server_name: "localhost",
        tls: pinned_tls(server),
        settings,
        initial_rtt: None,
        peer: "test",
        metrics: None,
        timeout: DEADLINE,
    })
    .await
    .expect("connected");
    (client, ep, layer)
}

/// A bare h3 client on the project's client endpoint with `settings`, connecting to `addr`
/// (the server, or a relay in front of it) within `within`.
async fn layered_client(
    server: &Server,
    addr: SocketAddr,
    settings: &QuicSettings,
    within: Duration,
) -> Result<(RawClient, DatagramHandle, quinn::Connection), String> {
    // The loopback address of the target's family.
    let bind = SocketAddr::new(
        if addr.is_ipv6() {
            std::net::Ipv6Addr::LOCALHOST.into()
        } else {
            std::net::Ipv4Addr::LOCALHOST.into()
        },
        0,
    );
    let (ep, layer) =
        endpoint::client_endpoint_with_layer(bind, settings).expect("client endpoint");
    let config = endpoint::client_config(pinned_tls(server), settings, None).expect("config");
    let connecting = ep
        .connect_with(config, addr, "localhost")
        .map_err(|e| e.to_string())?;
    let conn = tokio::time::timeout(within, connecting)
        .await
        .map_err(|_| "handshake timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let h3_conn = Connection::new(conn.clone());
    let priorities = h3_conn.priorities();
    let (mut driver, sender) = h3::client::new(h3_conn).await.map_err(|e| e.to_string())?;
    tokio::spawn(async move { driver.wait_idle().await });
    let client = RawClient {
        sender,
        priorities,
        _endpoint: ep,
    };
    Ok((client, layer.expect("a datagram layer"), conn))
}

/// Reads `/stream` and returns how many body bytes arrived.
async fn stream_bytes(client: &RawClient) -> u64 {
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    let add = move |n: usize| {
        g.fetch_add(n as u64, Ordering::SeqCst);
    };
    tokio::time::timeout(
        DEADLINE,
        raw_exchange(
            client,
            Method::GET,
            "/stream",
            0,
            Priority::Interactive,
            add,
        ),
    )
    .await
    .expect("the stream finished");
    got.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_works_over_the_datagram_layer_with_fec_and_obfuscation() {
    let settings = layered("auto", PSK);
    let s = start_layered_server(&settings);
    let (client, client_layer, _conn) =
        layered_client(&s.server, s.server.addr, &settings, DEADLINE)
            .await
            .expect("connected");
    let answer = raw_exchange(
        &client,
        Method::POST,
        "/ping",
        2,
        Priority::Interactive,
        |_| {},
    )
    .await;
    assert_eq!(count(&answer), 0);
    assert_eq!(stream_bytes(&client).await, 64 * STREAM_CHUNKS as u64);
    let (c, sv) = (client_layer.stats(), s.layer.stats());
    assert!(
        c.sent.source_packets > 0,
        "the client sent FEC source packets: {c:?}"
    );
    assert!(sv.sent.source_packets > 0, "the server too: {sv:?}");
    assert!(
        sv.sent.repair_packets > 0,
        "the token stream got repair packets: {sv:?}"
    );
    assert_eq!(sv.dropped() - sv.received.dropped.late_repair, 0, "{sv:?}");
}

/// A UDP relay between a client and `server`: every datagram is delayed by `delay`, and
/// dropped with probability `loss` (seeded, per direction). Returns the client-facing address.
async fn start_lossy_relay(
    server: SocketAddr,
    loss: f64,
    delay: Duration,
    seed: u64,
) -> SocketAddr {
    use rand::{Rng, SeedableRng};
    let front = Arc::new(
        tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind"),
    );
    let back = Arc::new(
        tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind"),
    );
    let addr = front.local_addr().expect("relay address");
    let client: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    for (from, to, towards_server, seed) in [
        (front.clone(), back.clone(), true, seed),
        (back, front, false, seed.wrapping_add(1)),
    ] {
        let client = client.clone();
        let (tx, mut rx) =
            tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
        let out = to.clone();
        let route = client.clone();
        tokio::spawn(async move {
            while let Some((at, datagram)) = rx.recv().await {
                tokio::time::sleep_until(at).await;
                let dest = if towards_server {
                    Some(server)
                } else {
                    *route.lock().expect("not poisoned")
                };
                if let Some(dest) = dest {
                    let _ = out.send_to(&datagram, dest).await;
                }
            }
        });
        tokio::spawn(async move {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            let mut buf = vec![0u8; 65_536];
            while let Ok((n, peer)) = from.recv_from(&mut buf).await {
                if towards_server {
                    *client.lock().expect("not poisoned") = Some(peer);
                }
                if rng.random::<f64>() < loss {
                    continue;
                }
                let at = tokio::time::Instant::now() + delay;
                if tx.send((at, buf[..n].to_vec())).is_err() {
                    return;
                }
            }
        });
    }
    addr
}

/// Streams `/stream` through a relay with 5% loss and 20 ms of delay each way; returns the
/// client's layer counters and the server's QUIC lost-packet count.
async fn lossy_stream_run(fec: &str) -> (tokenway_transport::datagram::DatagramStats, u64) {
    let settings = layered(fec, PSK);
    let s = start_layered_server(&settings);
    let relay = start_lossy_relay(s.server.addr, 0.05, Duration::from_millis(20), 7).await;
    let (client, client_layer, _conn) = layered_client(&s.server, relay, &settings, DEADLINE)
        .await
        .expect("connected through the relay");
    assert_eq!(stream_bytes(&client).await, 64 * STREAM_CHUNKS as u64);
    let conn = s
        .server
        .state
        .conn
        .lock()
        .expect("not poisoned")
        .clone()
        .expect("served a connection");
    (client_layer.stats(), conn.stats().path.lost_packets)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fec_recovers_a_lossy_stream_and_quic_sees_fewer_losses() {
    let (with_fec, lost_with_fec) = lossy_stream_run("fixed:4:2").await;
    let (without, lost_without) = lossy_stream_run("off").await;
    assert!(
        with_fec.received.recovered > 0,
        "FEC restored packets: {with_fec:?}"
    );
    eprintln!(
        "recovered {}, QUIC lost {lost_with_fec} with FEC, {lost_without} without",
        with_fec.received.recovered
    );
    assert_eq!(without.received.recovered, 0);
    assert!(
        lost_with_fec < lost_without,
        "QUIC declared {lost_with_fec} packets lost with FEC, {lost_without} without"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_the_wrong_psk_cannot_connect_and_is_counted() {
    let s = start_layered_server(&layered("auto", PSK));
    let wrong = layered("auto", "not the pre-shared key at all");
    let attempt = layered_client(&s.server, s.server.addr, &wrong, Duration::from_secs(2)).await;
    assert!(attempt.is_err(), "connected with the wrong psk");
    let stats = s.layer.stats();
    assert!(stats.stranger_drops > 0, "{stats:?}");
    assert_eq!(stats.peers, 0, "no state for a peer without the key");
    assert_eq!(
        stats.sent.source_packets + stats.sent.plain_packets,
        0,
        "never answered"
    );
}

/// Layered settings whose server side runs brutal with `bandwidth.up` of 2 MB/s, FEC off.
fn brutal_settings() -> QuicSettings {
    let mut settings = layered("off", PSK);
    if let Some(d) = settings.datagram.as_mut() {
        d.cc = Some(CongestionControl::Brutal);
        d.bandwidth = BandwidthSettings {
            up: Some(Bandwidth(2_000_000)),
            down: None,
        };
    }
    settings
}

/// Sends a request advertising a receive rate of `rx` bytes/s, as an edge does, and reads its
/// answer.
async fn advertise(client: &RawClient, rx: &'static str) {
    let mut sender = client.sender.clone();
    let mut req = request(Method::POST, "/ping", ());
    req.headers_mut().insert(
        tokenway_transport::cc::RX_RATE_HEADER,
        http::HeaderValue::from_static(rx),
    );
    let mut stream = sender.send_request(req).await.expect("request");
    stream.finish().await.expect("request end");
    stream.recv_response().await.expect("response");
    while stream.recv_data().await.expect("body").is_some() {}
}

/// The server's connection and the rate handle of its current controller.
fn server_rate(server: &Server) -> (quinn::Connection, Arc<tokenway_transport::cc::RateHandle>) {
    let conn = server.state.conn.lock().expect("not poisoned").clone();
    let conn = conn.expect("a connection");
    let rate = tokenway_transport::cc::rate_handle(&conn).expect("a tunnel connection");
    (conn, rate)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_side_switches_to_brutal_at_the_advertised_rate() {
    let settings = brutal_settings();
    let s = start_layered_server(&settings);
    let (client, _layer, conn) = layered_client(&s.server, s.server.addr, &settings, DEADLINE)
        .await
        .expect("connected");
    let client_rate = tokenway_transport::cc::rate_handle(&conn).expect("a tunnel connection");
    assert_eq!(
        client_rate.rate(),
        Some(2_000_000),
        "the edge starts at its up"
    );
    advertise(&client, "500000").await;
    let (server_conn, rate) = server_rate(&s.server);
    assert_eq!(rate.rate(), Some(500_000), "min(edge rx, gateway up)");
    assert!(server_conn.congestion_state().window() >= 4 * 1200);
}

/// The edge's side of the negotiation: the gateway answers with its receive rate, and the
/// edge's QUIC client lowers its brutal rate to it (never above its own `up`, never for an
/// unreadable or tiny value) and hands the header to no caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_edge_sends_at_no_more_than_the_gateways_advertised_receive_rate() {
    let settings = brutal_settings();
    let s = start_layered_server(&settings);
    let (client, _ep, _layer) = layered_quic_client(&s.server, &settings).await;
    let rate =
        tokenway_transport::cc::rate_handle(client.connection()).expect("a tunnel connection");
    assert_eq!(rate.rate(), Some(2_000_000), "the edge starts at its up");
    let answered_with = |rx: &'static str| {
        let mut req = request(Method::POST, "/ping", Full::new(Bytes::new()));
        req.headers_mut()
            .insert("x-answer-rx", http::HeaderValue::from_static(rx));
        let client = &client;
        async move {
            let resp = tokio::time::timeout(DEADLINE, client.send_request(req))
                .await
                .expect("answered in time")
                .expect("response");
            assert!(
                resp.headers()
                    .get(tokenway_transport::cc::RX_RATE_HEADER)
                    .is_none(),
                "the advertisement is consumed, never handed on"
            );
            resp.into_body().collect().await.expect("body");
        }
    };
    answered_with("500000").await;
    assert_eq!(rate.rate(), Some(500_000), "min(edge up, gateway rx)");
    answered_with("fast").await;
    assert_eq!(
        rate.rate(),
        Some(500_000),
        "an unreadable value changes nothing"
    );
    answered_with("10").await;
    assert_eq!(
        rate.rate(),
        Some(500_000),
        "a rate below the floor is ignored"
    );
    answered_with("9000000").await;
    assert_eq!(
        rate.rate(),
        Some(2_000_000),
        "never above the edge's own up"
    );
}

/// quinn resets the path (a new controller, so a new rate handle at the configured plan) when
/// a client moves to a new port of an IPv6 address (or to another IP); the gateway's side
/// must reach the new controller with the edge's next advertisement. Before the fix the
/// gateway kept the first connection's handle and the connection stayed on cubic for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_negotiated_brutal_rate_reaches_the_new_controller_after_a_path_reset() {
    let settings = brutal_settings();
    let Ok(probe) = std::net::UdpSocket::bind("[::1]:0") else {
        eprintln!("SKIP: no IPv6 loopback on this machine");
        return;
    };
    drop(probe);
    let s = start_layered_server_on(&settings, "[::1]:0".parse().expect("addr"));
    let (client, _layer, _conn) = layered_client(&s.server, s.server.addr, &settings, DEADLINE)
        .await
        .expect("connected");
    advertise(&client, "500000").await;
    let (_, before) = server_rate(&s.server);
    assert_eq!(before.rate(), Some(500_000));

    // The client moves to a new port; a request on the new path makes the server follow it.
    let udp = tokenway_transport::socket::bind_udp("[::1]:0".parse().expect("addr"), 1 << 20)
        .expect("new socket");
    let (socket, _) = tokenway_transport::socket::layered_socket(udp, &settings, "client")
        .expect("layered socket");
    client._endpoint.rebind_abstract(socket).expect("rebind");
    advertise(&client, "400000").await;
    let (_, after) = server_rate(&s.server);
    assert!(
        !Arc::ptr_eq(&before, &after),
        "quinn kept the controller: this test no longer covers a path reset"
    );
    assert_eq!(
        after.rate(),
        Some(400_000),
        "the new controller got the rate"
    );
}

/// Reads a response body to its end: the bytes, and whether it ended cleanly.
async fn read_to_end<S: h3::quic::RecvStream>(
    stream: &mut h3::client::RequestStream<S, Bytes>,
) -> (usize, bool) {
    let mut got = 0;
    loop {
        match stream.recv_data().await {
            Ok(Some(c)) => got += c.remaining(),
            Ok(None) => return (got, true),
            Err(_) => return (got, false),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_dropped_unfinished_reads_as_broken_not_complete() {
    let server = start_server(true);
    let client = raw_client(&server, true).await;
    let mut sender = client.sender.clone();
    let mut stream = sender
        .send_request(request(Method::GET, "/dropped", ()))
        .await
        .expect("request stream");
    stream.finish().await.expect("request end");
    // The reset may come before the head is read (it discards what was not read yet).
    let clean = match stream.recv_response().await {
        Err(_) => false,
        Ok(_) => {
            tokio::time::timeout(DEADLINE, read_to_end(&mut stream))
                .await
                .expect("the body ends")
                .1
        }
    };
    assert!(
        !clean,
        "a response its server dropped unfinished read as complete"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_ends_inside_a_data_frame_reads_as_broken() {
    // A bare QUIC server that answers a HEADERS frame (:status 200) and a DATA frame that
    // announces 100 bytes but carries 10, then ends the stream.
    let identity = Identity::self_signed(&["localhost"]).expect("self-signed identity");
    let tls = identity.quic_server_config(false).expect("TLS config");
    let crypto = QuicServerConfig::try_from(tls).expect("TLS config usable for QUIC");
    let ep = quinn::Endpoint::server(
        quinn::ServerConfig::with_crypto(Arc::new(crypto)),
        "127.0.0.1:0".parse().expect("addr"),
    )
    .expect("server endpoint");
    let server = Server {
        addr: ep.local_addr().expect("bound address"),
        fingerprint: identity.fingerprint(),
        state: Arc::default(),
        _endpoint: ep.clone(),
    };
    tokio::spawn(async move {
        let conn = ep
            .accept()
            .await
            .expect("incoming")
            .await
            .expect("handshake");
        let (mut send, mut recv) = conn.accept_bi().await.expect("request stream");
        let _ = recv.read_chunk(1 << 16, true).await;
        let mut answer = vec![0x01, 0x03, 0x00, 0x00, 0xd9, 0x00, 0x40, 0x64];
        answer.extend_from_slice(&[7u8; 10]);
        send.write_all(&answer).await.expect("write");
        // The end comes on its own, after the client has read what came.
        tokio::time::sleep(Duration::from_millis(300)).await;
        send.finish().expect("finish");
        // Keep the connection until the client is done.
        let _ = conn.closed().await;
    });
    let client = raw_client(&server, true).await;
    let mut sender = client.sender.clone();
    let mut stream = sender
        .send_request(request(Method::GET, "/", ()))
        .await
        .expect("request stream");
    stream.finish().await.expect("request end");
    let head = stream.recv_response().await.expect("response head");
    assert_eq!(head.status(), 200);
    let (got, clean) = tokio::time::timeout(DEADLINE, read_to_end(&mut stream))
        .await
        .expect("the body ends");
    assert_eq!(got, 10);
    assert!(!clean, "a DATA frame cut short read as a complete body");
}

/// The TCP fallback's `close` drops the connection at once: a request waiting for its answer
/// fails now (to be retried elsewhere), not when HTTP/2's keep-alive gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_tcp_fallback_fails_a_waiting_request_at_once() {
    use tokenway_transport::fallback::TcpClient;
    let identity = Identity::self_signed(&["localhost"]).expect("self-signed identity");
    let acceptor = tokio_rustls::TlsAcceptor::from(identity.tcp_server_config().expect("TLS"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    // An HTTP/2 server that never answers.
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper::service::service_fn(|_req| async {
                    std::future::pending::<Result<Response<Full<Bytes>>, std::convert::Infallible>>(
                    )
                    .await
                });
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                        .await;
            });
        }
    });
    let tls = client_tls(
        &Trust::Pinned(vec![identity.fingerprint()]),
        &[tokenway_transport::ALPN_H2],
        false,
    )
    .expect("client TLS");
    let client = Arc::new(
        TcpClient::connect(addr, "localhost", tls, Duration::from_secs(5), "test", None)
            .await
            .expect("connected"),
    );
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .send_request(request(Method::GET, "/never", Full::new(Bytes::new())))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "the server never answers");
    client.close();
    let err = tokio::time::timeout(Duration::from_secs(3), waiting)
        .await
        .expect("the waiting request fails at once")
        .expect("task")
        .expect_err("no answer");
    assert!(err.retryable, "{err}");
    assert!(client.is_closed());
}

/// A `QuicClient` on the datagram layer that is dropped without `close()` (a connection set
/// aside, its last answer done) closes its connection itself with H3_NO_ERROR, although the
/// layer's RTT follower and the sampler hold handles to it. The server here is bare QUIC, so
/// only the client closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layered_quic_client_dropped_without_close_closes_its_connection() {
    let settings = layered("auto", PSK);
    let identity = Identity::self_signed(&["localhost"]).expect("self-signed identity");
    let (server_ep, _server_layer) = endpoint::server_endpoint_with_layer(
        "127.0.0.1:0".parse().expect("addr"),
        &identity,
        &settings,
    )
    .expect("server endpoint");
    let server = Server {
        addr: server_ep.local_addr().expect("bound address"),
        fingerprint: identity.fingerprint(),
        state: Arc::new(ServerState::default()),
        _endpoint: server_ep.clone(),
    };
    let closed = tokio::spawn(async move {
        let conn = server_ep
            .accept()
            .await
            .expect("incoming")
            .await
            .expect("handshake");
        conn.closed().await
    });
    let (client, _ep, _layer) = layered_quic_client(&server, &settings).await;
    client.established().await.expect("handshake completed");
    client.set_aside();
    drop(client);
    let reason = tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .expect("the connection closed once its client was dropped")
        .expect("server task");
    assert!(
        matches!(&reason, quinn::ConnectionError::ApplicationClosed(c)
            if c.error_code == 0x100u32.into() && &c.reason[..] == b"client done"),
        "closed by the client's drop, with H3_NO_ERROR: {reason}"
    );
}
