//! The tunnel client: one connection manager per gateway, and the choice of gateway per request.
//! The edge sends every local request through it; a gateway sends its overflow to peer gateways
//! through it (configured by [`TunnelClientConfig`]).
//!
//! Each gateway has a link task that keeps a connection up: it dials (QUIC raced against the TCP
//! fallback), measures RTT (QUIC's own estimate, or a timed `GET /health` over TCP), feeds the
//! [`Selector`], redials at once when the connection dies or its QUIC path goes silent
//! ([`crate::liveness`]: seconds, where the idle timeout would take 30), and while on TCP
//! tries QUIC again every `quic_retry`, moving new requests back to QUIC when it works.
//! Requests already running on the old connection finish there.
//!
//! A request that fails before its response head because the connection died (or its 0-RTT
//! data was refused) is sent again, on a fresh connection, to another gateway if one is up.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri};
use http_body_util::{BodyExt, Empty, Full};
use tokenway_telemetry::quic::{PeerLabels, QuicMetrics};
use tokio::sync::{watch, Notify};

use crate::client::{ClientBody, RequestError};
use crate::dial::{Conn, Dialer, Target};
use crate::liveness::{Liveness, Verdict};
use crate::select::Selector;
use crate::tunnel_config::{GatewayEntry, TunnelClientConfig};
use crate::TransportError;

/// Header carrying the tunnel token (docs/tunnel.md).
pub const AUTH_HEADER: &str = "tw-auth";
/// Header carrying the per-request idempotency key (docs/tunnel.md).
pub const IDEMPOTENCY_HEADER: &str = "tw-idempotency-key";
/// Header marking a request one gateway sent on to a peer gateway (its overflow), which does
/// not send it on again.
pub const OVERFLOW_HEADER: &str = "tw-overflow";
/// Header of a retried tunnel request listing the idempotency keys of its earlier attempts
/// (comma-separated): the gateway cancels any of them it is still running. An attempt that
/// failed before its answer's head (its path went silent, its connection was set aside) may
/// have reached the gateway all the same, which runs it until it sees the connection die;
/// without this the retry made the backend generate the whole answer twice.
pub const SUPERSEDES_HEADER: &str = "tw-supersedes";

/// How often each link measures its gateway.
const PROBE_EVERY: Duration = Duration::from_millis(500);
/// Longest pause between redials of an unreachable gateway.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// A fresh idempotency key: 32 lowercase hex characters.
pub fn idempotency_key() -> HeaderValue {
    let mut hex = [0u8; 32];
    hex::encode_to_slice(rand::random::<[u8; 16]>(), &mut hex).expect("32 bytes hold 16 in hex");
    HeaderValue::from_bytes(&hex).expect("hex is a valid header value")
}

/// Whether a gateway accepts this client's token, as its `GET /health` over the tunnel told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenCheck {
    /// Not checked yet.
    Unknown,
    /// The gateway answered as the gateway.
    Accepted,
    /// The gateway answered with its masquerade site: it does not know the token.
    Refused,
}

struct Link {
    /// Where the gateway is: its addresses as last resolved (none before a name resolves).
    target: Mutex<Target>,
    /// Its configured `host:port`s, resolved again before each dial after a failure (the
    /// machine went offline, the gateway moved in DNS).
    entry: GatewayEntry,
    /// The key of its entry in messages (`gateways[i]`).
    key: String,
    /// The last token check; kept across connections (the token does not change).
    token: watch::Sender<TokenCheck>,
    /// Why the last dial failed, while the gateway is unreachable (told to requests that find no
    /// gateway).
    dial_error: Mutex<Option<String>>,
    /// Why the last background QUIC attempt (while on TCP) failed.
    reprobe_error: Mutex<Option<String>>,
    /// The gateway's name, shared with every answer.
    name: Arc<str>,
    conn: Mutex<Option<Conn>>,
    last_rtt: Mutex<Option<Duration>>,
    wake: Notify,
    /// A background QUIC re-probe (while on the TCP fallback) is running.
    probing: std::sync::atomic::AtomicBool,
    /// Bumped by [`Tunnel::reconnect`]: a dial that started before is stale when it completes
    /// (its connection may have been set up over a path that has changed since).
    generation: std::sync::atomic::AtomicU64,
}

impl Link {
    fn current(&self) -> Option<Conn> {
        lock(&self.conn).clone()
    }

    fn target(&self) -> Target {
        lock(&self.target).clone()
    }

    /// Resolves the gateway's names again (addresses of the endpoint's family first); keeps
    /// the last addresses when the lookup fails but says why.
    async fn resolve(&self, v6: bool) -> Result<(), TransportError> {
        let fresh = target(&self.key, &self.entry, v6).await;
        if let Ok(t) = &fresh {
            let mut cur = lock(&self.target);
            if (cur.quic, cur.tcp) != (t.quic, t.tcp) && (cur.quic.is_some() || cur.tcp.is_some()) {
                tracing::info!(gateway = %self.name, quic = ?t.quic, tcp = ?t.tcp, "the gateway's address changed");
            }
            *cur = t.clone();
        }
        fresh.map(|_| ())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A request ready to be sent (any number of times).
#[derive(Clone)]
pub struct Outgoing {
    /// Method.
    pub method: Method,
    /// Path and query.
    pub path: PathAndQuery,
    /// Headers, without hop-by-hop ones and without the tunnel headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
}

/// [`SendError::code`] of a token the gateway refused.
pub const AUTH_FAILED: &str = "tunnel_auth_failed";
/// [`SendError::code`] of a request whose headers are larger than the gateway accepts.
pub const HEAD_TOO_LARGE: &str = "request_header_fields_too_large";

/// Why a request got no answer from the tunnel.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct SendError {
    /// The OpenAI-style error code: `gateway_unreachable`, [`AUTH_FAILED`] or
    /// [`HEAD_TOO_LARGE`].
    pub code: &'static str,
    /// What happened.
    pub message: String,
}

impl From<RequestError> for SendError {
    fn from(e: RequestError) -> Self {
        Self {
            code: if e.head_too_large {
                HEAD_TOO_LARGE
            } else {
                "gateway_unreachable"
            },
            message: e.message,
        }
    }
}

impl SendError {
    fn token_refused(gateway: &str) -> Self {
        Self {
            code: AUTH_FAILED,
            message: format!(
                "gateway {gateway} refused the tunnel token (it answered with its masquerade \
                 site): `token` must be one of the gateway's [tunnel] tokens"
            ),
        }
    }
}

/// Whether a response is a web page (the masquerade site) rather than the gateway's API.
fn is_html<B>(response: &Response<B>) -> bool {
    response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/html"))
}

/// A response on its way back, with where it came from.
pub struct Answer {
    /// The response; its body streams.
    pub response: Response<ClientBody>,
    /// The gateway's name.
    pub gateway: Arc<str>,
    /// `tunnel` or `tunnel-tcp`.
    pub transport: &'static str,
}

/// All gateways and their connections.
pub struct Tunnel {
    links: Vec<Arc<Link>>,
    selector: Mutex<Selector>,
    changed: watch::Sender<u64>,
    dialer: Dialer,
    token: HeaderValue,
    /// `tw-rx-rate` value, when `[datagram] bandwidth.down` is set.
    rx_rate: Option<HeaderValue>,
    wait_for_link: Duration,
    quic_retry: Duration,
    /// The QUIC endpoint is bound to IPv6 (dual-stack): IPv6 gateway addresses are usable.
    v6: bool,
}

/// Longest wait for a gateway's name to resolve: the system resolver retries for up to 30 s
/// when DNS packets are lost or its server is unreachable, and a link waiting on it does not
/// dial the address it already knows.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);

/// The first address of `s` the endpoint can use (IPv4 only unless `v6`).
async fn resolve(s: &str, key: &str, v6: bool) -> Result<SocketAddr, TransportError> {
    let addrs: Vec<SocketAddr> = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(s))
        .await
        .map_err(|_| {
            TransportError::Config(format!(
                "{key} {s:?} does not resolve: no answer within {RESOLVE_TIMEOUT:?}"
            ))
        })?
        .map_err(|e| TransportError::Config(format!("{key} {s:?} does not resolve: {e}")))?
        .collect();
    addrs
        .iter()
        .find(|a| v6 || a.is_ipv4())
        .copied()
        .ok_or_else(|| {
            TransportError::Config(format!(
                "{key} {s:?} resolves to no usable address ({addrs:?})"
            ))
        })
}

async fn target(key: &str, g: &GatewayEntry, v6: bool) -> Result<Target, TransportError> {
    let quic = resolve(&g.quic, &format!("{key}.quic"), v6).await?;
    let tcp = match &g.tcp {
        Some(t) => Some(resolve(t, &format!("{key}.tcp"), v6).await?),
        None => None,
    };
    Ok(Target {
        name: g.name.clone(),
        quic: Some(quic),
        tcp,
        server_name: g.server_name.clone(),
    })
}

impl Tunnel {
    /// Resolves the gateways, opens the QUIC client endpoint and starts one link per gateway.
    /// A gateway whose name does not resolve yet (the machine is not online yet) is resolved
    /// again before each of its dials; until then it is unreachable, and says why.
    pub async fn start(
        config: &TunnelClientConfig,
        metrics: QuicMetrics,
    ) -> Result<Arc<Self>, TransportError> {
        let mut targets = Vec::new();
        for (i, g) in config.gateways.iter().enumerate() {
            let key = format!("gateways[{i}]");
            let t = match target(&key, g, true).await {
                Ok(t) => Ok(t),
                Err(e) => {
                    tracing::warn!(gateway = %g.name, error = %e, "the gateway's name does not resolve now; trying again before each dial");
                    Err(e.to_string())
                }
            };
            targets.push((key, g.clone(), t));
        }
        let v6 = targets.iter().any(|(_, _, t)| {
            t.as_ref()
                .is_ok_and(|t| t.quic.is_some_and(|a| a.is_ipv6()))
        });
        let bind = if v6 {
            SocketAddr::from(([0u16; 8], 0))
        } else {
            SocketAddr::from(([0, 0, 0, 0], 0))
        };
        // `[quic]` plus the `[datagram]` layer (FEC, obfuscation, tunnel cc), if configured.
        let mut quic = config.tunnel_quic();
        quic.datagram_metrics = Some(metrics.datagram.clone());
        let endpoint = crate::endpoint::client_endpoint(bind, &quic)?;
        let trust = config.trust()?;
        let dialer = Dialer {
            endpoint,
            tls: Arc::new(crate::dial::GatewayTls::new(
                crate::trust::client_tls(&trust, &[crate::ALPN_H3], config.quic.zero_rtt)?,
                crate::trust::client_tls(&trust, &[crate::ALPN_H2], false)?,
            )),
            settings: quic,
            head_start: config.head_start(),
            tcp_won_last: Default::default(),
            connect_timeout: config.connect_timeout(),
            metrics: Some(metrics),
        };
        let token = HeaderValue::from_str(&config.token)
            .map_err(|_| TransportError::Config("token must be printable ASCII".into()))?;
        // What this client can receive, advertised to the gateway for brutal (docs/edge.md).
        let rx_rate = config
            .datagram
            .as_ref()
            .and_then(|d| d.bandwidth.down)
            .map(|b| HeaderValue::from(b.bytes_per_sec()));
        let links: Vec<_> = targets
            .into_iter()
            .map(|(key, entry, resolved)| {
                let (target, dial_error) = match resolved {
                    Ok(t) => (t, None),
                    Err(why) => (
                        Target {
                            name: entry.name.clone(),
                            quic: None,
                            tcp: None,
                            server_name: entry.server_name.clone(),
                        },
                        Some(why),
                    ),
                };
                Arc::new(Link {
                    token: watch::channel(TokenCheck::Unknown).0,
                    dial_error: Mutex::new(dial_error),
                    reprobe_error: Mutex::new(None),
                    name: Arc::from(entry.name.as_str()),
                    target: Mutex::new(target),
                    entry,
                    key,
                    conn: Mutex::new(None),
                    last_rtt: Mutex::new(None),
                    wake: Notify::new(),
                    probing: std::sync::atomic::AtomicBool::new(false),
                    generation: std::sync::atomic::AtomicU64::new(0),
                })
            })
            .collect();
        let (changed, _) = watch::channel(0);
        let tunnel = Arc::new(Self {
            selector: Mutex::new(Selector::new(links.len(), config.reevaluate())),
            links,
            changed,
            dialer,
            token,
            rx_rate,
            wait_for_link: config.head_start() + config.connect_timeout() * 2,
            quic_retry: config.quic_retry(),
            v6,
        });
        for i in 0..tunnel.links.len() {
            tokio::spawn(run_link(Arc::downgrade(&tunnel), i));
        }
        Ok(tunnel)
    }

    /// The gateways' QUIC addresses.
    pub fn quic_addrs(&self) -> Vec<SocketAddr> {
        self.links.iter().filter_map(|l| l.target().quic).collect()
    }

    /// Moves the QUIC endpoint to a fresh UDP socket; open connections migrate.
    pub fn rebind(&self) -> Result<SocketAddr, TransportError> {
        let ep = &self.dialer.endpoint;
        let local = ep.local_addr().map_err(|source| TransportError::Socket {
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            source,
        })?;
        let bind = SocketAddr::new(local.ip(), 0);
        let udp = crate::socket::bind_udp(bind, self.dialer.settings.socket_buffer_bytes)?;
        // The new socket gets a fresh datagram layer (per-peer FEC state starts over; the
        // gateway sees a new address anyway).
        let (socket, _) = crate::socket::layered_socket(udp, &self.dialer.settings, "client")?;
        ep.rebind_abstract(socket)
            .map_err(|source| TransportError::Socket { addr: bind, source })?;
        let now = ep
            .local_addr()
            .map_err(|source| TransportError::Socket { addr: bind, source })?;
        tracing::info!(from = %local, to = %now, "QUIC endpoint rebound");
        Ok(now)
    }

    /// Closes every connection; the links redial (a test knob for 0-RTT resumption). A dial
    /// under way is superseded too: its connection is closed when it completes, and the link
    /// dials again.
    pub fn reconnect(&self) {
        for (i, l) in self.links.iter().enumerate() {
            l.generation
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            let old = lock(&l.conn).take();
            // The gateway is down until the redial: a 0-RTT connection of that redial may
            // carry requests meanwhile ([`Self::set_early_conn`]).
            self.set_conn(i, None);
            if let Some(c) = old {
                c.close();
            }
            l.wake.notify_one();
        }
    }

    fn set_conn(&self, i: usize, conn: Option<Conn>) {
        let up = conn.is_some();
        *lock(&self.links[i].conn) = conn;
        lock(&self.selector).set_up(i, up);
        self.changed.send_modify(|n| *n += 1);
    }

    /// Closes `conn` of gateway `i` (it no longer answers) and has the link redial at once.
    fn retire(&self, i: usize, conn: &Conn) {
        conn.close();
        self.unlink(i, conn);
    }

    /// Takes `conn` off gateway `i` if it is still the link's, and wakes the link to redial.
    fn unlink(&self, i: usize, conn: &Conn) {
        let same = lock(&self.links[i].conn)
            .as_ref()
            .is_some_and(|c| c.same(conn));
        if same {
            self.set_conn(i, None);
        }
        self.links[i].wake.notify_one();
    }

    /// Takes `conn` of gateway `i` out of use (its QUIC path went silent) and has the link
    /// redial at once, without closing it: requests still waiting for their answer's head
    /// leave it for a fresh connection, answers already streaming stay on it (see
    /// [`Conn::set_aside`]). Closing it cut every stream of a user whose coverage dropped
    /// for 4 s, although QUIC would have carried them on when the path came back.
    fn set_aside(&self, i: usize, conn: &Conn) {
        conn.set_aside();
        self.unlink(i, conn);
        if let Conn::Quic(q) = conn {
            tokio::spawn(close_if_still_silent(Arc::clone(q)));
        }
    }

    /// After the local address changed: closes every TCP fallback connection, which cannot
    /// migrate as QUIC's do (its socket keeps the old source address, a black hole until
    /// HTTP/2's keep-alive gives up), so their links redial from the new address at once.
    /// Returns how many were closed.
    pub fn redial_tcp(&self) -> usize {
        let mut closed = 0;
        for (i, link) in self.links.iter().enumerate() {
            if let Some(c) = link.current().filter(|c| !c.is_quic()) {
                self.retire(i, &c);
                closed += 1;
            }
        }
        closed
    }

    /// A 0-RTT connection of gateway `i` whose handshake has not completed: it carries
    /// requests as early data only while no gateway is reachable. Nothing has answered it yet,
    /// so it does not make the gateway reachable (with a dead gateway's resumption ticket,
    /// every redial would otherwise draw requests to it for a connect timeout).
    fn set_early_conn(&self, i: usize, conn: Conn) {
        let mut sel = lock(&self.selector);
        if sel.any_up() {
            return;
        }
        *lock(&self.links[i].conn) = Some(conn);
        sel.set_up(i, true);
        drop(sel);
        self.changed.send_modify(|n| *n += 1);
    }

    /// Drops `conn` of gateway `i` when it is dead, and wakes the link to redial.
    fn report_failure(&self, i: usize, conn: &Conn) {
        if conn.is_closed() {
            self.unlink(i, conn);
        }
    }

    /// A live connection to the best gateway, waiting for a link to come up.
    async fn acquire(&self, avoid: &[usize]) -> Option<(usize, Conn)> {
        let deadline = tokio::time::Instant::now() + self.wait_for_link;
        let mut changed = self.changed.subscribe();
        let mut woken = false;
        loop {
            let pick = {
                let mut sel = lock(&self.selector);
                let now = Instant::now();
                match sel.pick(now, avoid) {
                    None if !avoid.is_empty() => sel.pick(now, &[]),
                    pick => pick,
                }
            };
            if let Some(i) = pick {
                match self.links[i].current() {
                    Some(c) if !c.is_closed() => return Some((i, c)),
                    Some(c) => self.report_failure(i, &c),
                    None => self.mark_down_if_empty(i),
                }
                continue;
            }
            // No `borrow_and_update` here: a link that came up since the pick is a change not
            // yet seen, and `changed()` returns at once for it (marking it seen here made the
            // request wait out `wait_for_link` and fail while a gateway was up).
            if !woken {
                // Links waiting out a redial backoff (after an outage) dial now: the network
                // may be back, and a request is waiting for it.
                woken = true;
                for l in &self.links {
                    l.wake.notify_one();
                }
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                // One last look: the deadline and a link coming up may have crossed.
                let mut sel = lock(&self.selector);
                let i = sel.pick(Instant::now(), &[])?;
                drop(sel);
                return self.links[i]
                    .current()
                    .filter(|c| !c.is_closed())
                    .map(|c| (i, c));
            }
        }
    }

    /// Marks gateway `i` down if it still has no connection (one a link installs meanwhile
    /// is kept, where an unconditional `set_conn(i, None)` dropped it).
    fn mark_down_if_empty(&self, i: usize) {
        // Selector, then connection: the order `set_early_conn` takes them in.
        let mut sel = lock(&self.selector);
        if lock(&self.links[i].conn).is_none() {
            sel.set_up(i, false);
            drop(sel);
            self.changed.send_modify(|n| *n += 1);
        }
    }

    fn request<B>(&self, out: &Outgoing, body: B) -> Result<Request<B>, RequestError> {
        let mut req = Request::new(body);
        *req.method_mut() = out.method.clone();
        *req.uri_mut() = Uri::from(out.path.clone());
        *req.headers_mut() = tunnel_headers(&out.headers, &self.token, self.rx_rate.as_ref());
        Ok(req)
    }

    /// [`Self::request`] for a retry: it names the earlier attempts' keys (`earlier`), which
    /// the gateway stops if it still runs them ([`SUPERSEDES_HEADER`]).
    fn retry_request<B>(
        &self,
        out: &Outgoing,
        body: B,
        earlier: &[HeaderValue],
    ) -> Result<Request<B>, RequestError> {
        let mut req = self.request(out, body)?;
        if !earlier.is_empty() {
            let list = earlier
                .iter()
                .filter_map(|k| k.to_str().ok())
                .collect::<Vec<_>>()
                .join(",");
            if let Ok(v) = HeaderValue::from_str(&list) {
                req.headers_mut().insert(SUPERSEDES_HEADER, v);
            }
        }
        Ok(req)
    }

    /// "no gateway is reachable", with why each gateway could not be dialled.
    fn unreachable(&self) -> String {
        let why: Vec<String> = self
            .links
            .iter()
            .filter_map(|l| {
                lock(&l.dial_error)
                    .as_ref()
                    .map(|e| format!("{}: {e}", l.name))
            })
            .collect();
        if why.is_empty() {
            "no gateway is reachable".to_string()
        } else {
            format!("no gateway is reachable ({})", why.join("; "))
        }
    }

    /// Whether gateway `i` refuses this client's token. A web page from the gateway before its
    /// token check has answered waits (briefly) for that answer: with a wrong token the very
    /// first request would otherwise hand the masquerade site to the app.
    async fn token_refused(&self, i: usize, html: bool) -> bool {
        let mut check = self.links[i].token.subscribe();
        let state = *check.borrow_and_update();
        match state {
            TokenCheck::Refused => true,
            TokenCheck::Accepted => false,
            TokenCheck::Unknown if !html => false,
            TokenCheck::Unknown => {
                let _ = tokio::time::timeout(
                    TOKEN_CHECK_TIMEOUT * 2,
                    check.wait_for(|c| *c != TokenCheck::Unknown),
                )
                .await;
                let refused = *check.borrow() == TokenCheck::Refused;
                refused
            }
        }
    }

    /// Sends `out` to the best gateway, retrying once on a fresh connection when the first
    /// attempt failed before any response byte because its connection died.
    pub async fn send(&self, out: &Outgoing) -> Result<Answer, SendError> {
        // Gateways this request failed on or was refused by: each refusal adds one, so with
        // several gateways that refuse the token the request ends (it went back and forth
        // between two of them, never waiting, while a third accepted).
        let mut avoid: Vec<usize> = Vec::new();
        // Those of them that refused the token: another gateway is asked only if it has not
        // (one avoided after a failed attempt may accept, its connection redialled).
        let mut refused: Vec<usize> = Vec::new();
        let mut last = None;
        // Two retries after a dead connection (the first fresh connection after a QUIC path
        // went silent may be an unanswered 0-RTT one that loses its race against TCP); one
        // more after a failure on a connection that is still open (0-RTT data refused: the
        // same connection carries the retry as 1-RTT).
        let (mut fresh_retries, mut same_retries) = (2, 1);
        // The idempotency keys of this request's attempts so far.
        let mut earlier: Vec<HeaderValue> = Vec::new();
        loop {
            let Some((i, conn)) = self.acquire(&avoid).await else {
                return Err(last
                    .unwrap_or_else(|| RequestError::new(self.unreachable(), false))
                    .into());
            };
            if *self.links[i].token.borrow() == TokenCheck::Refused {
                // Another gateway may know the token (one not yet given a rotated token list).
                if !refused.contains(&i) && self.another_accepts(i, &refused) {
                    refused.push(i);
                    if !avoid.contains(&i) {
                        avoid.push(i);
                    }
                    continue;
                }
                return Err(SendError::token_refused(&self.links[i].name));
            }
            let req = self.retry_request(out, Full::new(out.body.clone()), &earlier)?;
            // Kept for the next attempt, if this one fails: it may have reached the gateway.
            earlier.extend(req.headers().get(IDEMPOTENCY_HEADER).cloned());
            match conn.send_request(req).await {
                Ok(response) => {
                    if self.token_refused(i, is_html(&response)).await {
                        // The masquerade site answered: nothing ran, another gateway may.
                        if !refused.contains(&i) && self.another_accepts(i, &refused) {
                            refused.push(i);
                            if !avoid.contains(&i) {
                                avoid.push(i);
                            }
                            continue;
                        }
                        return Err(SendError::token_refused(&self.links[i].name));
                    }
                    return Ok(Answer {
                        response,
                        gateway: self.links[i].name.clone(),
                        transport: conn.transport_label(),
                    });
                }
                Err(e) if e.retryable && !conn.is_closed() && same_retries > 0 => {
                    same_retries -= 1;
                    tracing::info!(gateway = %self.links[i].name, error = %e, "request refused before the first byte; retrying");
                    last = Some(e);
                }
                Err(e) if e.retryable && fresh_retries > 0 => {
                    fresh_retries -= 1;
                    tracing::info!(gateway = %self.links[i].name, error = %e, "request failed before the first byte; retrying on a fresh connection");
                    self.report_failure(i, &conn);
                    if !avoid.contains(&i) {
                        avoid.push(i);
                    }
                    last = Some(e);
                }
                // The request's fault, not the gateway's: nothing to report.
                Err(e) if e.head_too_large => return Err(e.into()),
                Err(e) => {
                    self.report_failure(i, &conn);
                    return Err(e.into());
                }
            }
        }
    }

    /// Whether a gateway other than `i`, and not one that `refused` this request, has a live
    /// connection and has not refused the token.
    fn another_accepts(&self, i: usize, refused: &[usize]) -> bool {
        self.links.iter().enumerate().any(|(j, l)| {
            j != i
                && !refused.contains(&j)
                && *l.token.borrow() != TokenCheck::Refused
                && l.current().is_some_and(|c| !c.is_closed())
        })
    }

    /// A connection and the tunnel headers for a CONNECT (port forwarding): the token, a fresh
    /// idempotency key and this end's rate advertisement, as every tunnel request carries (a
    /// connection used only for forwarding switches to brutal too).
    pub async fn connection(&self) -> Option<(Conn, HeaderMap)> {
        self.acquire(&[]).await.map(|(_, c)| {
            let headers = tunnel_headers(&HeaderMap::new(), &self.token, self.rx_rate.as_ref());
            (c, headers)
        })
    }
}

/// Longest wait for the answer to a TCP link's RTT probe.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// TCP probes in a row without an answer that make a fallback connection dead: HTTP/2's own
/// keep-alive would take 10 s plus 10 s to notice; a lossy path can still delay one answer
/// past [`HEALTH_TIMEOUT`] (TCP retransmission), so one miss is not enough.
const TCP_PROBE_MISSES: u32 = 3;
/// How often a gateway that refused the token is asked again (its token list may be fixed).
const TOKEN_RECHECK: Duration = Duration::from_secs(10);

/// Longest wait for the answer to a token check.
const TOKEN_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Asks gateway `i`, over its new connection, for `GET /health` with the tunnel token: the
/// gateway itself answers `ok`, a gateway that does not know the token shows its masquerade
/// site (a web page). No answer leaves the last verdict in place.
async fn check_token(tunnel: std::sync::Weak<Tunnel>, i: usize, conn: Conn) {
    let Some(t) = tunnel.upgrade() else { return };
    let out = Outgoing {
        method: Method::GET,
        path: PathAndQuery::from_static("/health"),
        headers: HeaderMap::new(),
        body: Bytes::new(),
    };
    let Ok(req) = t.request(&out, Full::new(Bytes::new())) else {
        return;
    };
    let answer = tokio::time::timeout(TOKEN_CHECK_TIMEOUT, conn.send_request(req)).await;
    let Ok(Ok(response)) = answer else { return };
    let verdict = if is_html(&response) {
        TokenCheck::Refused
    } else {
        TokenCheck::Accepted
    };
    let _ = tokio::time::timeout(TOKEN_CHECK_TIMEOUT, response.into_body().collect()).await;
    let link = &t.links[i];
    let before = link.token.send_replace(verdict);
    if verdict == TokenCheck::Refused && before != TokenCheck::Refused {
        tracing::error!(gateway = %link.name, "the gateway refused the tunnel token (it answered with its masquerade site); check `token` against the gateway's [tunnel] tokens");
    } else if verdict == TokenCheck::Accepted && before == TokenCheck::Refused {
        tracing::info!(gateway = %link.name, "the gateway accepts the tunnel token now");
    }
}

/// Times `GET /health` over a TCP fallback connection, sent with the tunnel token like every
/// request (without it, the gateway's tunnel port would answer with its masquerade site);
/// `None` when no answer came within [`HEALTH_TIMEOUT`].
async fn health_rtt(t: &Tunnel, conn: &Conn) -> Option<Duration> {
    let start = Instant::now();
    let out = Outgoing {
        method: Method::GET,
        path: PathAndQuery::from_static("/health"),
        headers: HeaderMap::new(),
        body: Bytes::new(),
    };
    let req = t.request(&out, Empty::<Bytes>::new()).ok()?;
    let resp = tokio::time::timeout(HEALTH_TIMEOUT, conn.send_request(req))
        .await
        .ok()?
        .ok()?;
    let _ = tokio::time::timeout(HEALTH_TIMEOUT, resp.into_body().collect()).await;
    Some(start.elapsed())
}

/// While link `i` is on the TCP fallback: tries QUIC once and, when the handshake completes,
/// moves new requests to it (requests in flight finish on TCP).
async fn reprobe_quic(tunnel: std::sync::Weak<Tunnel>, i: usize) {
    let Some(t) = tunnel.upgrade() else { return };
    let link = t.links[i].clone();
    let last_rtt = *lock(&link.last_rtt);
    let generation = link.generation.load(std::sync::atomic::Ordering::Acquire);
    // `quic` returns once the gateway has answered (a 0-RTT connection's handshake completed).
    let dialed = t.dialer.quic(&link.target(), last_rtt).await;
    // Why QUIC keeps failing is told once per new reason (a wrong `[datagram] obfs.psk` looks
    // like UDP being blocked: the edge would otherwise stay on TCP without a word).
    let why = dialed.as_ref().err().map(ToString::to_string);
    let before = std::mem::replace(&mut *lock(&link.reprobe_error), why.clone());
    if let Some(why) = why.filter(|w| before.as_ref() != Some(w)) {
        tracing::warn!(gateway = %link.name, error = %why, "QUIC still fails; staying on TCP (UDP blocked, or the [datagram] obfs.psk differs from the gateway's?)");
    }
    if let Ok(q) = dialed {
        // Only replace a TCP connection (or none); a link that meanwhile got QUIC keeps it.
        let on_tcp = link.current().is_none_or(|c| !c.is_quic());
        let stale = link.generation.load(std::sync::atomic::Ordering::Acquire) != generation;
        if stale {
            q.close();
        } else if on_tcp && !q.is_closed() {
            tracing::info!(gateway = %link.name, "QUIC works again; new requests move back to it");
            t.set_conn(i, Some(q));
        }
    }
    link.probing
        .store(false, std::sync::atomic::Ordering::Release);
}

/// The datagrams a QUIC connection has received and sent.
/// How long a connection set aside for a silent path ([`Tunnel::set_aside`]) may stay silent
/// before it is closed, cutting the answers still on it: long enough to ride out a blackout
/// (a lift, a tunnel), short enough that a gateway that died is not waited for until QUIC's
/// idle timeout (30 s), with its clients' answers hanging.
pub const ASIDE_GRACE: Duration = Duration::from_secs(10);

/// Watches a connection set aside: closes it if its path stays silent for [`ASIDE_GRACE`];
/// leaves it be (to close when its last answer is dropped) once anything arrives on it.
async fn close_if_still_silent(q: Arc<crate::client::QuicClient>) {
    let (rx, _) = datagram_counts(&q);
    let until = tokio::time::Instant::now() + ASIDE_GRACE;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if q.connection().close_reason().is_some() || datagram_counts(&q).0 != rx {
            return;
        }
        if tokio::time::Instant::now() >= until {
            tracing::info!("a connection set aside for its silent path stayed silent; closing it");
            q.close();
            return;
        }
    }
}

fn datagram_counts(q: &crate::client::QuicClient) -> (u64, u64) {
    let stats = q.connection().stats();
    (stats.udp_rx.datagrams, stats.udp_tx.datagrams)
}

async fn run_link(tunnel: std::sync::Weak<Tunnel>, i: usize) {
    let mut backoff = Duration::from_millis(100);
    // The path liveness of the current QUIC connection (which one it is, and its counters).
    let mut liveness: Option<(Conn, Liveness)> = None;
    let mut next_quic_try = Instant::now();
    let mut tcp_misses = 0;
    let mut token_checked = Instant::now();
    // The names are looked up again before a dial that follows a failed one (and before the
    // first, when they did not resolve at start).
    let mut resolve_first = true;
    loop {
        let Some(t) = tunnel.upgrade() else { return };
        let link = t.links[i].clone();
        match link.current() {
            None => {
                let known = {
                    let tg = link.target();
                    tg.quic.is_some() || tg.tcp.is_some()
                };
                if resolve_first || !known {
                    if let Err(e) = link.resolve(t.v6).await {
                        if !known {
                            *lock(&link.dial_error) = Some(e.to_string());
                            tracing::warn!(gateway = %link.name, error = %e, "cannot resolve the gateway");
                            let wait = backoff;
                            backoff = (backoff * 2).min(MAX_BACKOFF);
                            drop(t);
                            tokio::select! {
                                _ = tokio::time::sleep(wait) => {}
                                _ = link.wake.notified() => {}
                            }
                            continue;
                        }
                    }
                }
                let target = link.target();
                let last_rtt = *lock(&link.last_rtt);
                // A 0-RTT QUIC connection carries requests at once, as early data, while the
                // race goes on: it wins only when the gateway answers its handshake, and TCP
                // still joins after the head start.
                let mut early = None;
                let generation = link.generation.load(std::sync::atomic::Ordering::Acquire);
                let raced = t
                    .dialer
                    .race_early(&target, last_rtt, |c| {
                        tracing::debug!(gateway = %link.name, "0-RTT connection ready before its handshake completes");
                        t.set_early_conn(i, c.clone());
                        early = Some(c.clone());
                    })
                    .await;
                *lock(&link.dial_error) = raced.as_ref().err().map(ToString::to_string);
                match raced {
                    Ok(c)
                        if link.generation.load(std::sync::atomic::Ordering::Acquire)
                            != generation =>
                    {
                        // Reconnected while this dial was under way: dial again.
                        c.close();
                        if let Some(e) = early {
                            e.close();
                            t.report_failure(i, &e);
                        }
                        continue;
                    }
                    Ok(c) => {
                        tracing::info!(gateway = %link.name, transport = c.transport_label(), "tunnel connected");
                        if !c.is_quic() {
                            next_quic_try = Instant::now() + t.quic_retry;
                        }
                        t.set_conn(i, Some(c.clone()));
                        tcp_misses = 0;
                        token_checked = Instant::now();
                        tokio::spawn(check_token(tunnel.clone(), i, c.clone()));
                        // TCP won against an unanswered 0-RTT connection: closing it fails its
                        // requests as retryable, and they go again over TCP.
                        if let Some(e) = early.filter(|e| !e.same(&c)) {
                            e.close();
                        }
                        backoff = Duration::from_millis(100);
                        resolve_first = false;
                        continue;
                    }
                    Err(e) => {
                        resolve_first = true;
                        if let Some(early) = early {
                            early.close();
                            t.report_failure(i, &early);
                        }
                        tracing::warn!(gateway = %link.name, error = %e, "cannot reach the gateway");
                        let wait = backoff;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        drop(t);
                        tokio::select! {
                            _ = tokio::time::sleep(wait) => {}
                            _ = link.wake.notified() => {}
                        }
                        continue;
                    }
                }
            }
            Some(c) if c.is_closed() => {
                tracing::info!(gateway = %link.name, "tunnel connection closed; redialing");
                t.report_failure(i, &c);
                continue;
            }
            Some(c) => {
                if let Conn::Quic(q) = &c {
                    let (rx, tx) = datagram_counts(q);
                    if !liveness.as_ref().is_some_and(|(lc, _)| lc.same(&c)) {
                        liveness = Some((c.clone(), Liveness::new(rx, tx)));
                    }
                    let verdict = liveness
                        .as_mut()
                        .map(|(_, l)| l.observe(Instant::now(), rx, tx, q.rtt()));
                    if let Some(Verdict::Dead(silent)) = verdict {
                        tracing::warn!(gateway = %link.name, silent_ms = silent.as_millis() as u64, "the QUIC path went silent (datagrams sent, none received); redialing, TCP joining at once (answers streaming on the silent connection keep it)");
                        if let Some(m) = &t.dialer.metrics {
                            m.dead_paths
                                .get_or_create(&PeerLabels {
                                    peer: link.name.to_string(),
                                })
                                .inc();
                        }
                        liveness = None;
                        t.dialer.prefer_tcp_next(&link.target());
                        t.set_aside(i, &c);
                        continue;
                    }
                }
                let rtt = match &c {
                    Conn::Quic(q) => Some(q.rtt()),
                    Conn::Tcp(_) => health_rtt(&t, &c).await,
                };
                if let Some(rtt) = rtt {
                    tcp_misses = 0;
                    *lock(&link.last_rtt) = Some(rtt);
                    lock(&t.selector).observe_rtt(i, rtt);
                } else {
                    tcp_misses += 1;
                    if tcp_misses >= TCP_PROBE_MISSES {
                        tracing::warn!(gateway = %link.name, "the TCP fallback connection stopped answering; redialing");
                        tcp_misses = 0;
                        t.set_aside(i, &c);
                        continue;
                    }
                }
                if *link.token.borrow() == TokenCheck::Refused
                    && token_checked.elapsed() >= TOKEN_RECHECK
                {
                    token_checked = Instant::now();
                    tokio::spawn(check_token(tunnel.clone(), i, c.clone()));
                }
                if !c.is_quic() && Instant::now() >= next_quic_try {
                    next_quic_try = Instant::now() + t.quic_retry;
                    // On its own task: a QUIC dial into a UDP black hole takes the whole
                    // connect timeout, and the link must stay free to redial TCP meanwhile.
                    if !link.probing.swap(true, std::sync::atomic::Ordering::AcqRel) {
                        tokio::spawn(reprobe_quic(tunnel.clone(), i));
                    }
                }
            }
        }
        drop(t);
        tokio::select! {
            _ = tokio::time::sleep(PROBE_EVERY) => {}
            _ = link.wake.notified() => {}
        }
    }
}

/// A tunnel request's headers: the caller's, with this end's token, a fresh idempotency key,
/// and this end's rate advertisement or none. The rate is this end's to advertise, never the
/// caller's: a local client (or a public one, through a gateway's overflow) could otherwise set
/// the rate of the whole shared connection.
fn tunnel_headers(
    caller: &HeaderMap,
    token: &HeaderValue,
    rx_rate: Option<&HeaderValue>,
) -> HeaderMap {
    let mut h = caller.clone();
    h.insert(AUTH_HEADER, token.clone());
    h.insert(IDEMPOTENCY_HEADER, idempotency_key());
    h.remove(crate::cc::RX_RATE_HEADER);
    h.remove(SUPERSEDES_HEADER);
    if let Some(rate) = rx_rate {
        h.insert(crate::cc::RX_RATE_HEADER, rate.clone());
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callers_rate_advertisement_never_rides_the_tunnel() {
        let mut caller = HeaderMap::new();
        caller.insert(crate::cc::RX_RATE_HEADER, HeaderValue::from_static("1000"));
        caller.insert(AUTH_HEADER, HeaderValue::from_static("forged"));
        caller.insert("x-keep", HeaderValue::from_static("kept"));
        let token = HeaderValue::from_static("token");
        let h = tunnel_headers(&caller, &token, None);
        assert!(h.get(crate::cc::RX_RATE_HEADER).is_none());
        assert_eq!(h[AUTH_HEADER], "token");
        assert_eq!(h["x-keep"], "kept");
        assert_eq!(h[IDEMPOTENCY_HEADER].len(), 32);
        let ours = HeaderValue::from_static("2500000");
        let h = tunnel_headers(&caller, &token, Some(&ours));
        let rates: Vec<_> = h.get_all(crate::cc::RX_RATE_HEADER).iter().collect();
        assert_eq!(rates, [&ours]);
        // Nor does a caller name attempts to stop: only a retry of this end does.
        caller.insert(SUPERSEDES_HEADER, HeaderValue::from_static("00"));
        assert!(tunnel_headers(&caller, &token, None)
            .get(SUPERSEDES_HEADER)
            .is_none());
    }
}
